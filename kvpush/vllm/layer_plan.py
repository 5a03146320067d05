"""P's scheduler side of the layer-wise push: which prefills go layer by layer, and what
each step computes of them (``StepMeta.layered``).

A one-token P request whose prompt has at least ``layerwise_min_tokens`` tokens is handed
over at the step that starts its prompt (held as an early hand-over: the engine confirms
it at ``request_finished``); every step that computes part of its prompt sends one
``LayerChunk`` (the blocks so far, the first block the step writes and the blocks it
fills), the last one closes its feed on the worker. A request preempted or finished
before its prompt was computed sends a failed chunk: the worker closes its feed failed
and the push fails (D is told once the WRITEs already posted have ended).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvpush.core.scheduler import PushScheduler
from kvpush.core.types import LayerChunk
from kvpush.core.wire import PromptPrint


@dataclass
class _Open:
    tid: str | None
    blocks: list[int]
    prompt: int  # tokens
    prompt_print: PromptPrint | None = None  # its token ids' print (StagedBlocks.prompt)


def prompt_tokens(request: Any) -> int:
    prompt = getattr(request, "num_prompt_tokens", None)
    if prompt is None:
        prompt = len(getattr(request, "prompt_token_ids", None) or ())
    return int(prompt)


class LayerPlan:
    def __init__(self, sched: PushScheduler, min_tokens: int, block_size: int) -> None:
        self.sched = sched
        self.min_tokens = min_tokens  # 0: off
        self.block_size = block_size
        self._open: dict[str, _Open] = {}
        self._failed: list[LayerChunk] = []  # for the next step's metadata

    def takes(self, request: Any, new: Any) -> bool:
        """A one-token request with one KV-cache group whose long prompt starts here."""
        prompt = prompt_tokens(request)
        return (
            self.min_tokens > 0
            and prompt >= self.min_tokens
            and getattr(request, "max_tokens", None) == 1
            and len(new.block_ids) == 1
            and bool(new.block_ids[0])
            and new.num_computed_tokens < prompt
        )

    def start(
        self,
        new: Any,
        count: int,
        tid: str | None,
        request: Any,
        prompt: PromptPrint | None = None,
    ) -> LayerChunk:
        """Hand the request over and describe its first step (``prompt``: its print)."""
        blocks = list(new.block_ids[0])
        self.sched.hand_over(new.req_id, [blocks], tid, layered=True)
        self._open[new.req_id] = _Open(tid, blocks, prompt_tokens(request), prompt)
        return self._chunk(new.req_id, int(new.num_computed_tokens), count)

    def follow(self, scheduler_output: Any) -> list[LayerChunk]:
        """This step's chunks of the requests started earlier (and failed ones)."""
        out, self._failed = self._failed, []
        cached = getattr(scheduler_output, "scheduled_cached_reqs", None)
        if not self._open or cached is None:
            return out
        counts = getattr(scheduler_output, "num_scheduled_tokens", None) or {}
        resumed = getattr(cached, "resumed_req_ids", None) or ()
        for i, rid in enumerate(cached.req_ids):
            req = self._open.get(rid)
            if req is None or not counts.get(rid):
                continue
            if rid in resumed:  # preempted: its blocks were freed and may be reused
                out.append(self._fail(rid, "preempted before its prompt was computed"))
                continue
            new_ids = cached.new_block_ids[i]
            if new_ids:
                req.blocks.extend(new_ids[0])
            out.append(self._chunk(rid, int(cached.num_computed_tokens[i]), counts[rid]))
        return out

    def end(self, rid: str) -> None:
        """The engine finished the request: a prompt still open fails its push."""
        if rid in self._open:
            self._failed.append(self._fail(rid, "finished before its prompt was computed"))

    def _chunk(self, rid: str, computed: int, count: int) -> LayerChunk:
        req = self._open[rid]
        last = computed + count >= req.prompt
        if last:
            del self._open[rid]
        return LayerChunk(
            rid,
            req.tid,
            [list(req.blocks)],
            [computed // self.block_size],
            [-(-req.prompt // self.block_size)],
            last,
            upto=[] if last else [(computed + count) // self.block_size],
            prompt=req.prompt_print,
        )

    def _fail(self, rid: str, why: str) -> LayerChunk:
        req = self._open.pop(rid)
        return LayerChunk(rid, req.tid, [list(req.blocks)], [0], [len(req.blocks)], True, why)
