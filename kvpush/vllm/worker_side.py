"""The connector's worker role: registers vLLM's KV-cache tensors and drives a PushWorker."""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Any

from kvpush.core import trace
from kvpush.core.errors import ConfigError
from kvpush.core.layout import KVLayout, Region
from kvpush.core.types import StagedBlocks, StepMeta
from kvpush.core.worker import PushWorker, make_agent_name
from kvpush.gpu.peer_copy import make_peer_copy
from kvpush.vllm.config import ConnectorOptions
from kvpush.vllm.layer_feeds import LayerFeeds, forward_event

log = logging.getLogger(__name__)

# What the connector reports to vLLM's stats pipeline, from the worker's own counters.
# Keys "name:value" are one labelled series of metric "name" (label path or cause).
COUNTERS: dict[str, tuple[str, ...]] = {
    "bytes_sent": ("write_bytes",),
    "bytes_received": ("recv_bytes",),
    "pushes_sent:copy": ("copies_done",),  # same host: CUDA IPC copy into D's blocks
    "pushes_sent:nixl": ("writes_done",),  # NIXL WRITE
    "pushes_received": ("recv_done",),
    # NIXL descriptors posted: one per run of blocks contiguous on both sides, per layer
    # region; many per push means scattered blocks (each a separate transfer for UCX).
    "write_descriptors": ("write_descs",),
    "early_hand_overs": ("handed_over",),
    "layer_writes": ("layer_writes",),  # WRITEs of one layer (layerwise_min_tokens)
    "layers_unreported": ("layers_unreported",),  # ... posted at the forward's end instead
    "withdrawals": ("withdrawn",),
    "push_failures:nixl_write": ("write_failed",),
    "push_failures:copy": ("copy_failed",),
    "push_failures:handshake": ("handshake_failed",),
    "push_failures:invalid_registration": ("reg_invalid", "reg_wrong_sender"),
    "push_failures:untrusted_decoder": ("reg_untrusted",),
    # A registration P can never serve (another engine id; a request of P's that ended).
    "push_failures:unpairable": ("reg_unpairable",),
    "push_failures:registration_expired": ("reg_expired",),
    "push_failures:lease_expired": ("lease_expired",),
    "push_failures:receive_failed": ("recv_failed",),
    "push_failures:watchdog": ("recv_expired",),
    # D computed another prompt than P (wire.PromptPrint): P refused it, D's receive failed.
    "push_failures:prompt_mismatch": ("prompt_mismatch", "recv_prompt_mismatch"),
    # Watchdog failures whose blocks D kept for late_write_hold_s (core/late_writes.py),
    # and completions that came for them in that time (a late WRITE that did land).
    "late_write_holds": ("recv_held",),
    "late_completions_held": ("completion_held",),
    # A transfer moved where its table (core/types.transition) forbids: a kvpush bug.
    "illegal_transitions": ("illegal_transition",),
}
# Latency observations (seconds), drained from the worker at every report.
HISTOGRAMS = ("push_seconds", "kv_wait_seconds")
# vLLM keeps stepping while a push is pending (has_pending_push_work), with empty steps
# when nothing else runs. Flat out, those take a whole core, and two engines doing it on
# one core can starve each other for good: behind vllm-router, a D awaiting the KV kept a
# P on its core from reading D's registration until P's lease ran out (30 s). Empty steps
# poll flat out for IDLE_SPIN_S (most pushes end well within it), then each sleeps
# IDLE_SLEEP_S, which lets whatever shares the core run. Only with the KV in host memory:
# a GPU engine's compute is not on those cores, vLLM already sleeps 1 ms per empty step,
# and ours stretched the interval at which a GPU decoder sees its KV from about 1.5 to
# 2.2 ms (real vLLM on an H200, docs/benchmarks.md).
IDLE_SPIN_S = 0.005
IDLE_SLEEP_S = 0.0005


@dataclass
class StepReport:
    """One step's results, split the way vLLM wants them."""

    finished_sending: set[str] = field(default_factory=set)
    finished_recving: set[str] = field(default_factory=set)  # includes failed and released
    failed: dict[str, str] = field(default_factory=dict)
    released: set[str] = field(default_factory=set)
    renewed: set[str] = field(default_factory=set)
    held: set[str] = field(default_factory=set)  # failed, blocks kept until released


def layout_from_tensors(
    kv_caches: dict[str, Any],
    num_blocks: int,
    block_size: int,
    tp_rank: int = 0,
    tp_size: int = 1,
    mla: bool = False,
) -> KVLayout:
    """One region per layer (or per K and V when they are separate tensors' halves).

    A layer tensor either has blocks outermost (``[num_blocks, ...]``, as vLLM's CPU
    backend) or K/V outermost (``[2, num_blocks, ...]``); either way each block of a
    region must be one contiguous range.
    """
    regions: list[Region] = []
    mem_type = "DRAM"
    for name, t in kv_caches.items():
        mem_type = "VRAM" if getattr(t, "is_cuda", False) else "DRAM"
        device = int(t.device.index or 0) if mem_type == "VRAM" else 0
        heads = 0
        if t.shape[0] == num_blocks:
            halves = [("", t)]
            # vLLM's CPU layout [blocks, kv_heads, ...] is head-major inside a block, so a
            # peer of another TP size can address a head slice.
            heads = int(t.shape[1]) if t.dim() == 4 and not mla else 0
        elif t.shape[0] == 2 and t.shape[1] == num_blocks:
            halves = [(".k", t[0]), (".v", t[1])]
        else:
            raise ConfigError(f"KV cache {name} has shape {tuple(t.shape)}: no block dimension")
        for suffix, part in halves:
            block_len = part.stride(0) * part.element_size()
            if part[0].numel() * part.element_size() != block_len:
                raise ConfigError(f"KV cache {name}: a block is not one contiguous range")
            regions.append(
                Region(
                    name + suffix,
                    part.data_ptr(),
                    block_len,
                    num_blocks,
                    device,
                    layers=[name],
                    kv_heads=heads,
                )
            )
    return KVLayout(
        regions=regions,
        block_size=block_size,
        mem_type=mem_type,  # type: ignore[arg-type]
        tp_rank=tp_rank,
        tp_size=tp_size,
        attention="mla" if mla else "standard",
    )


class WorkerSide:
    def __init__(
        self,
        engine_id: str,
        opts: ConnectorOptions,
        tp_rank: int,
        tp_size: int,
        prefiller: bool = True,
    ) -> None:
        self.engine_id = engine_id
        self.prefiller = prefiller  # its engine prefills for decoders (kv_producer, kv_both)
        self.opts = opts
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self.worker: PushWorker | None = None
        self._reported: Counter[str] = Counter()
        self._stats_total = 0
        self._meta = StepReport()
        self._early: list[StagedBlocks] = []  # this step's early hand-overs (StepMeta.early)
        self._cuda = False  # KV in GPU memory: early hand-overs carry an event
        self._idle = False  # this step schedules no tokens (KVPushMeta.idle)
        self._idle_since: float | None = None  # first of the empty steps in a row
        self._load_errors: set[int] = set()  # see take_load_errors
        self.layers = LayerFeeds()  # prompts pushed layer by layer (vllm/layer_feeds.py)

    def register(
        self, kv_caches: dict[str, Any], num_blocks: int, block_size: int, mla: bool = False
    ) -> None:
        from kvpush.core.nixl_transport import NixlTransport

        layout = layout_from_tensors(
            kv_caches, num_blocks, block_size, self.tp_rank, self.tp_size, mla
        )
        cfg = self.opts.worker_config(self.engine_id, self.tp_rank, self.tp_size, self.prefiller)
        self._cuda = layout.mem_type == "VRAM"
        transport = NixlTransport(make_agent_name(self.engine_id, self.tp_rank))
        hook = make_peer_copy(self.opts.peer_copy, list(kv_caches.values()))
        # With the copy hook a same-host push is a whole-request copy (the layer-wise
        # WRITE has nothing to hide there): such prompts go whole at their last step.
        self.layers = LayerFeeds(list(kv_caches), self._cuda, whole=hook is not None)
        self.worker = PushWorker(cfg, transport, layout, peer_copy=hook)
        log.info(
            "kvpush worker %s rank %d: %d regions, side channel %s:%d, peer copy %s",
            self.engine_id,
            self.tp_rank,
            len(layout.regions),
            cfg.host,
            cfg.port,
            "on" if hook is not None else "off",
        )

    def step_began(self) -> None:
        if self.worker is not None:
            self.worker.producer.pairing.step_began()

    def start_step(self, meta: StepMeta | None, idle: bool = False) -> None:
        self._idle = idle
        if trace.ON:
            self._trace_step("worker.start")
        if self.worker is not None and meta is not None:
            if self._early or self.layers.current:  # the last step had no wait_for_save
                self.hand_over()
            self._early = meta.early
            self.worker.start_step(meta)
            if meta.layered:
                staged, whole = self.layers.start(meta.layered)
                self._early.extend(whole)
                self.worker.hand_over(staged)

    def hand_over(self) -> None:
        """At the end of the forward (``wait_for_save``): push the prefills this step
        completes. On GPUs their writes may still run: an event recorded now on the
        forward's stream goes with them, and the push is queued behind it."""
        early, self._early = self._early, []
        if self.layers.current and self.worker is not None:
            # Counted: layers without a save_kv_layer call went at the forward's end.
            self.worker.stats["layers_unreported"] += self.layers.end_step()
        if trace.ON:
            self._trace_step("worker.save")
        if not early or self.worker is None:
            return
        after = forward_event(self._cuda)
        if trace.ON:
            for s in early:
                trace.mark("p_worker.save", s.transfer_id, s.request_id)
        self.worker.hand_over([replace(s, after=after) for s in early])

    def collect(self) -> StepReport:
        """This step's finished ids; also stashes what goes back as worker metadata."""
        if self.worker is None:
            return StepReport()
        if self._idle and not self._cuda:
            self._pause()
        else:
            self._idle_since = None
        out = self.worker.get_finished()
        if trace.ON:
            self._trace_step("worker.collect")
        if not out:  # most steps: nothing to report
            return StepReport()
        self._idle_since = None  # something ended: poll flat out again
        if trace.ON:
            for rid in out.finished_recving:
                trace.mark("d_worker.report", None, rid)
        report = StepReport(
            finished_sending=out.finished_sending,
            # A held receive's blocks go back to vLLM when it is released, not now.
            finished_recving=out.finished_recving
            | out.released
            | set(out.failed_recving).difference(out.held),
            failed=out.failed_recving,
            released=out.released,
            renewed=out.renewed,
            held=set(out.held),
        )
        # Their blocks go to vLLM as failed loads now (so a request under the "fail" policy
        # ends at once) and their ids as finished once the hold ends.
        self._load_errors.update(b for ids in out.held.values() for group in ids for b in group)
        self._meta.failed.update(out.failed_recving)
        self._meta.released |= out.released
        self._meta.renewed |= out.renewed
        self._meta.held |= set(out.held)
        return report

    def _trace_step(self, event: str) -> None:
        """Tracing: the step's calls, when it computes or a receive is outstanding."""
        if self.worker is not None and (not self._idle or self.worker.consumer.outstanding()):
            trace.mark(event, None, None, 0 if self._idle else 1)

    def _pause(self) -> None:
        """An empty step: give the core away once such steps went on for IDLE_SPIN_S."""
        now = time.monotonic()
        if self._idle_since is None:
            self._idle_since = now
        elif now - self._idle_since >= IDLE_SPIN_S:
            time.sleep(IDLE_SLEEP_S)

    def take_load_errors(self) -> set[int]:
        """Blocks of held receives reported since the last call (vLLM's invalid blocks)."""
        if not self._load_errors:
            return set()
        out, self._load_errors = self._load_errors, set()
        return out

    def take_meta(self) -> StepReport | None:
        meta = self._meta
        if not (meta.failed or meta.released or meta.renewed or meta.held):
            return None
        self._meta = StepReport()
        return meta

    def stats_delta(self) -> dict[str, Any]:
        """Counters since the last call, and the latencies observed since (what vLLM's
        stats pipeline wants: numbers are summed, lists joined)."""
        if self.worker is None:
            return {}
        out: dict[str, Any] = self.worker.take_observations()
        s = self.worker.stats
        total = sum(s.values())
        if total == self._stats_total:  # counters only grow: nothing changed since last time
            return out
        self._stats_total = total
        for key, sources in COUNTERS.items():
            delta = int(sum(s[k] for k in sources) - self._reported[key])
            if delta:
                self._reported[key] += delta
                out[key] = delta
        return out

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.shutdown()
            self.worker = None
