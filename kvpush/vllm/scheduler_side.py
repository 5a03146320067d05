"""The connector's scheduler role: maps vLLM requests onto kvpush's PushScheduler.

Written against the attributes vLLM's ``Request`` offers (``request_id``,
``kv_transfer_params``, ``prompt_token_ids``, ``status``) so it can be unit
tested with plain objects.
"""

from __future__ import annotations

import logging
import re
import secrets
from typing import Any

from kvpush.core import seal, trace
from kvpush.core.errors import worth_logging
from kvpush.core.ids import ANY_ENGINE, base_request_id
from kvpush.core.scheduler import PushScheduler
from kvpush.core.types import RecvRegistration, StepMeta, WorkerOutput
from kvpush.core.wire import PromptPrint, fingerprint
from kvpush.vllm.config import ConnectorOptions
from kvpush.vllm.layer_plan import LayerPlan, prompt_tokens
from kvpush.vllm.params import MAX_ID_CHARS, check_recv_params

log = logging.getLogger(__name__)

# A mark in the request's own params: its blocks are registered (the engine calls
# update_state_after_alloc again once the KV has arrived, and after a preemption). Its
# value is a random token of this process (`SchedulerSide._mark`), never sent anywhere: a
# client may put the key in the params it sends straight to D, but not the value, so it
# cannot have its params taken as registered and left unchecked.
_REGISTERED = "_kvpush_registered"
# vLLM's id of prompt i of a client request (completions: always; chat: with several).
_PROMPT_INDEX = re.compile(r"(?:cmpl-.*-|chatcmpl-.*_)(\d+)$")


# The connector's verdict on a request's seal, kept in its params (``SchedulerSide._params``).
_SEALED = "_kvpush_sealed"
_UNSEALED = "no"


def sub_request(request_id: str) -> tuple[int, int]:
    """(prompt, sample) of an engine request of a client request (see ``transfer_key``)."""
    child, sep, rest = request_id.partition("_")
    sample = int(child) if sep and child.isdigit() else 0
    index = _PROMPT_INDEX.match(base_request_id(rest if sep and child.isdigit() else request_id))
    return (int(index.group(1)) if index else 0), sample


def transfer_key(request_id: str, transfer_id: Any) -> str | None:
    """The key of one engine request's transfer: the router's ``transfer_id`` plus which
    engine sub-request of the client request this is.

    vLLM turns one client request into several engine requests, all with the same
    ``kv_transfer_params``: prompt ``i`` gets ``cmpl-<id>-<i>`` (chat, when it has several:
    ``chatcmpl-<id>_<i>``), sample ``j`` of ``n`` the prefix ``<j>_``, and each engine adds
    its random suffix. P and
    D see the same ids up to that suffix (the router sends the same ``X-Request-Id`` to
    both), so both derive the same key per sub-request; sub-request (0, 0) keeps the bare
    ``transfer_id``."""
    if not isinstance(transfer_id, str) or not 0 < len(transfer_id) <= MAX_ID_CHARS:
        return None  # (untrusted: on D, vllm/params.py refuses such a leg first)
    prompt, sample = sub_request(request_id)
    tid = str(transfer_id)
    return tid if prompt == sample == 0 else f"{tid}:{prompt}:{sample}"


def named_key(request_id: str, remote_request_id: Any) -> str | None:
    """D's key of a transfer whose leg names P's request (``remote_request_id``, the
    contract of vLLM's in-tree push connector) and carries no ``transfer_id``: P's id of
    the matching engine request without its engine suffix. That is the key P mints for a
    request that carried no transfer id (``p_key``), and a name P also finds a request by
    when it did carry one (``MatchTable.find_named``). D's sub-request ``i`` of a client
    request with several prompts, sample ``j`` of ``n``, names P's ``j_cmpl-<id>-<i>``."""
    if not isinstance(remote_request_id, str) or not remote_request_id:
        return None
    name = base_request_id(remote_request_id)
    child, sep, rest = name.partition("_")
    if sep and child.isdigit():  # P's id of one sample (from its answer): the parent's
        name = rest
    prompt, sample = sub_request(request_id)
    if prompt:
        named = _PROMPT_INDEX.match(name)
        if named is not None:  # (a name of another shape: as given)
            name = name[: named.start(1)] + str(prompt)
    return f"{sample}_{name}" if sample else name


def prompt_print(request: Any) -> PromptPrint | None:
    """The prompt this engine computes for ``request`` (``wire.fingerprint`` of its token
    ids): P and D each send theirs and P refuses to push when they differ. None when the
    request has no token ids (prompt embeddings): not checked."""
    ids = getattr(request, "prompt_token_ids", None)
    if ids is None:
        return None
    try:
        return fingerprint(ids)
    except (TypeError, ValueError, OverflowError) as e:
        log.warning("request %s: no prompt print: %s", getattr(request, "request_id", "?"), e)
        return None


def registration(
    rid: str,
    params: dict[str, Any],
    groups: list[list[int]],
    prompt: PromptPrint | None = None,
    trusted: frozenset[str] | None = None,
) -> RecvRegistration:
    """D's registration of ``rid`` with the P named by its ``kv_transfer_params``;
    ``prompt``: D's prompt, for P to compare with its own (``prompt_print``)."""
    check_recv_params(params, trusted)  # untrusted: types, ranges, sizes (vllm/params.py)
    return RecvRegistration(
        request_id=rid,
        block_ids=groups,
        remote_engine_id=str(params.get("remote_engine_id") or ANY_ENGINE),
        remote_host=str(params["remote_host"]),
        remote_port=int(params["remote_port"]),
        remote_tp_size=int(params.get("remote_tp_size", params.get("tp_size", 1))),
        # Precedence (docs/migration.md): the transfer id both legs carry, else the P
        # request D's leg names, else neither (P matches by the shared base id).
        transfer_id=transfer_key(rid, params.get("transfer_id"))
        or named_key(rid, params.get("remote_request_id")),
        remote_pp_size=int(params.get("remote_pp_size", params.get("pp_size", 1))),
        prompt=prompt,
    )


def p_key(request_id: str, params: dict[str, Any]) -> str:
    """P's key of a transfer: as ``transfer_key`` when the request carried a transfer id,
    else minted from P's own request id without its engine suffix. P returns it in its
    answer's ``kv_transfer_params``, so a proxy that sends the legs in turn (vllm-router)
    hands it to D, whose registration then matches by key whatever request id D got."""
    return transfer_key(request_id, params.get("transfer_id")) or base_request_id(request_id)


def p_names(request_id: str, params: dict[str, Any]) -> list[str]:
    """The names a registration may give P's request: its key and its id without the
    engine suffix (core/pairing.py's ``named``; what P also remembers of an ended one)."""
    return list(dict.fromkeys((p_key(request_id, params), base_request_id(request_id))))


class SchedulerSide:
    def __init__(
        self,
        engine_id: str,
        opts: ConnectorOptions,
        is_producer: bool,
        is_consumer: bool,
        tp_size: int,
        pp_size: int = 1,
        block_size: int = 16,
    ) -> None:
        self.engine_id = engine_id
        self.pp_size = pp_size
        self.opts = opts
        self.is_producer = is_producer
        self.is_consumer = is_consumer
        self.tp_size = tp_size
        self.sched = PushScheduler(opts.scheduler_config())
        self.layers = LayerPlan(self.sched, opts.layerwise_min_tokens, block_size)
        # P requests allocated in the step being scheduled: build_meta may hand them over.
        self._new_p: dict[str, Any] = {}
        self._traced: dict[str, str | None] = {}  # D, tracing: request id -> transfer id
        self._forwarded: dict[str, str | None] = {}  # D, tracing: first forward scheduled
        self._mark = secrets.token_hex(16)  # the value of _REGISTERED and of _SEALED
        self._unsealed = 0  # requests whose params were ignored: not sealed

    def _params(self, request: Any) -> dict[str, Any]:
        """The request's kv_transfer_params to act on: with a params secret, only sealed
        ones (`kvpush.core.seal`), else none, and the request is served as by a plain
        server. The verdict is kept in them, so each request's are checked once."""
        params = getattr(request, "kv_transfer_params", None)
        if not isinstance(params, dict):
            return {}
        secret = self.opts.params_secret
        if secret is None or params.get(_SEALED) == self._mark:
            return params
        if not (params.get("do_remote_prefill") or params.get("do_remote_decode")):
            return params  # they ask the connector for nothing
        if params.get(_SEALED) == _UNSEALED:
            return {}
        if seal.sealed(params, secret):
            params[_SEALED] = self._mark
            return params
        params[_SEALED] = _UNSEALED
        self._unsealed += 1
        if worth_logging(self._unsealed):
            log.warning(
                "request %s: kv_transfer_params not sealed by the router (%d so far); "
                "served without them",
                request.request_id,
                self._unsealed,
            )
        return {}

    # ---- D ---------------------------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int, bool]:
        params = self._params(request)
        if not (self.is_consumer and params.get("do_remote_prefill")) or self._marked(params):
            return 0, False
        count = len(getattr(request, "prompt_token_ids", None) or ()) - num_computed_tokens
        if trace.ON:
            trace.mark(
                "d_sched.matched",
                transfer_key(request.request_id, params.get("transfer_id")),
                request.request_id,
            )
        return (count, True) if count > 0 else (0, False)

    def update_state_after_alloc(
        self,
        request: Any,
        block_groups: tuple[list[int], ...],
        num_external_tokens: int,
        block_size: int,
    ) -> None:
        params = self._params(request)
        if self.is_producer and params.get("do_remote_decode"):
            if trace.ON:
                trace.mark("p_sched.alloc", p_key(request.request_id, params), request.request_id)
            self._new_p[request.request_id] = request
        if num_external_tokens <= 0 or not params.get("do_remote_prefill") or self._marked(params):
            return
        rid = request.request_id
        # P sends the blocks holding the external tokens: the last ones D allocated.
        need = -(-num_external_tokens // block_size)
        groups = [list(g[-need:]) if need else [] for g in block_groups]
        try:  # (checked before the mark goes in: the check reads every key)
            reg = registration(rid, params, groups, prompt_print(request), self.opts.trusted_p)
        except (KeyError, TypeError, ValueError) as e:
            params[_REGISTERED] = self._mark
            self.sched.reject(rid, f"invalid kv_transfer_params: {e}")
            return
        params[_REGISTERED] = self._mark
        self.sched.add_registration(reg)
        if trace.ON:
            trace.mark("d_sched.alloc", reg.transfer_id, rid)
            self._traced[rid] = reg.transfer_id

    # ---- P --------------------------------------------------------------------------------

    def on_new_request(self, request: Any) -> None:
        """vLLM's add_request, before the engine can schedule it: P's workers learn the
        names a registration may give it, to refuse one naming a request that never came."""
        params = self._params(request)
        if self.is_producer and params.get("do_remote_decode"):
            self.sched.arrived(p_names(request.request_id, params))

    def build_meta(self, scheduler_output: Any) -> StepMeta:
        """The step's metadata; first hands over the P requests whose prefill this step
        completes (``StepMeta.early``: the workers push them at the end of the forward),
        and the long ones whose prompt starts in it (``StepMeta.layered``: pushed layer by
        layer as the forward writes them)."""
        new_p, self._new_p = self._new_p, {}
        chunks = self.layers.follow(scheduler_output)
        if new_p:
            counts = getattr(scheduler_output, "num_scheduled_tokens", None) or {}
            for new in getattr(scheduler_output, "scheduled_new_reqs", None) or ():
                request = new_p.get(new.req_id)
                if request is None:
                    continue
                tid = p_key(new.req_id, self._params(request))
                if self.layers.takes(request, new):
                    count, prompt = counts.get(new.req_id, 0), prompt_print(request)
                    chunks.append(self.layers.start(new, count, tid, request, prompt))
                elif self._ends_here(request, new, counts):
                    blocks, prompt = [list(new.block_ids[0])], prompt_print(request)
                    self.sched.hand_over(new.req_id, blocks, tid, prompt=prompt)
                else:
                    continue
                if trace.ON:
                    trace.mark("p_sched.hand_over", tid, new.req_id)
        if trace.ON:
            self._trace_step(scheduler_output)
        meta = self.sched.build_meta()
        meta.layered = chunks
        return meta

    def _trace_step(self, scheduler_output: Any) -> None:
        """Tracing: a mark per step that computes tokens or that a traced D request waits
        through (how many steps, and how far apart, lie between its KV and its token)."""
        n = int(getattr(scheduler_output, "total_num_scheduled_tokens", 0) or 0)
        if n or self._traced or self._forwarded:
            trace.mark("sched.step", None, None, n)
        if self._traced:
            self._trace_forward(scheduler_output)

    def _trace_forward(self, scheduler_output: Any) -> None:
        """D: the step that computes a request whose KV was pushed (its first token)."""
        for new in getattr(scheduler_output, "scheduled_new_reqs", None) or ():
            if new.req_id in self._traced:
                tid = self._traced.pop(new.req_id)
                trace.mark("d_sched.forward", tid, new.req_id)
                self._forwarded[new.req_id] = tid

    @staticmethod
    def _ends_here(request: Any, new: Any, counts: dict[str, int]) -> bool:
        """The request ends with this step: its whole prompt is computed in it and it asks
        for one token (one that ran on could be preempted while its blocks are read)."""
        prompt = prompt_tokens(request)
        return (
            getattr(request, "max_tokens", None) == 1
            and len(new.block_ids) == 1  # one KV-cache group, as request_finished pushes
            and bool(new.block_ids[0])
            and new.num_computed_tokens + counts.get(new.req_id, 0) >= prompt > 0
        )

    # ---- P and D ---------------------------------------------------------------------------

    def request_finished(
        self, request: Any, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        params = self._params(request)
        rid = request.request_id
        if trace.ON:
            trace.mark("sched.finished", transfer_key(rid, params.get("transfer_id")), rid)
        if self.is_consumer and params.get("do_remote_prefill"):
            if not self._marked(params):
                self._withdraw(rid, params)
                return False, None
            # Still waiting for P's WRITE? Then keep the blocks until P cannot touch them.
            return self.sched.abort(rid), None
        if not (self.is_producer and params.get("do_remote_decode")):
            return False, None
        status = str(getattr(request, "status", ""))
        done = status in ("FINISHED_LENGTH_CAPPED", "FINISHED_STOPPED")
        self.layers.end(rid)  # (a prompt pushed layer by layer that never completed)
        early = self.sched.handed_over(rid)  # its push may be reading: held, whatever it ended as
        if not early and (not block_ids or not done):
            self.sched.departed(p_names(rid, params))  # never handed over
            return False, None
        tid = p_key(rid, params)
        prompt = None if early else prompt_print(request)  # (an early one has sent it)
        held = self.sched.request_finished(rid, [list(block_ids)], tid, prompt=prompt)
        if not done:
            return held, None
        return held, {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "transfer_id": tid,
            "remote_engine_id": self.engine_id,
            "remote_host": self.opts.side_channel_host,
            "remote_port": self.opts.side_channel_port,
            "remote_tp_size": self.tp_size,
            "remote_pp_size": self.pp_size,
            # The in-tree push connector's names, for proxies that build D's leg from them.
            "remote_request_id": rid,
            "tp_size": self.tp_size,
            "pp_size": self.pp_size,
        }

    def _marked(self, params: dict[str, Any]) -> bool:
        return params.get(_REGISTERED) == self._mark

    def _withdraw(self, rid: str, params: dict[str, Any]) -> None:
        """Aborted before its blocks were allocated (e.g. the client left while it queued):
        no WRITE can come, and P would keep the prompt's blocks until its lease ran out."""
        try:
            reg = registration(rid, params, [], trusted=self.opts.trusted_p)
        except (KeyError, TypeError, ValueError):
            reg = None  # no side channel named: nothing to tell (P's lease frees what it holds)
        params[_REGISTERED] = self._mark  # once
        if reg is not None:
            self.sched.withdraw(reg)

    def update(self, sending: set[str], recving: set[str], worker_meta: Any) -> None:
        """Apply one step's aggregated worker output."""
        if trace.ON and (self._traced or self._forwarded or recving):
            trace.mark("sched.update", None, None, len(recving))
        if self._forwarded:  # tracing: this step's output holds their first tokens
            for rid, tid in self._forwarded.items():
                trace.mark("d_sched.output", tid, rid)
            self._forwarded.clear()
        if not sending and not recving and worker_meta is None:
            return  # most steps: nothing happened
        if trace.ON:
            for rid in recving:
                trace.mark("d_sched.recvd", None, rid)
        released = set(getattr(worker_meta, "released", ()) or ())
        failed = dict(getattr(worker_meta, "failed", {}) or {})
        out = WorkerOutput(
            finished_sending=set(sending),
            finished_recving=set(recving) - released - set(failed),
            failed_recving=failed,
            released=released,
            renewed=set(getattr(worker_meta, "renewed", ()) or ()),
            held={rid: [] for rid in getattr(worker_meta, "held", ()) or ()},  # ids suffice
        )
        self.sched.update(out)
