"""P's side of pairing beyond the matching tables: which registrations it admits, which
request a registration names by that request's id, and registrations that can never pair.

A decoder leg may name P's request (``remote_request_id``, the contract of vLLM's in-tree
push connector): D's key is then P's request id without its engine suffix, which is P's
own key of a request that carried no transfer id, and a name P also finds a request that
carried one by. P refuses at once, with a ``PUSH_FAIL``, a registration it can never serve:
one naming a decoder off the allowlist or another engine id, and one naming a request of
P's that already ended (remembered for ``registration_ttl_s``); a registration still waiting
when the request it names ends is failed then. Owned by the producer (the ticking thread).

And one naming a request P's engine never got: P's scheduler reports the names of each
request that comes (``StepMeta.arrived``, at vLLM's ``on_new_request``, before the engine
can schedule it) until it is handed over or leaves (``departed``); a registration whose
name has not come within ``unknown_request_grace_s`` is refused, once this worker has taken
in every request its engine got by then (``refuse_unknown``: a busy engine's late steps
never count against it). Until the scheduler reports any arrival (the sim, an older P)
nothing is refused this way.

And the prompt check (``prompt_mismatch``): a registration whose prompt print (token count
and digest) differs from the prompt P computed is refused before anything is written.

And the budget (``room_for``): registrations waiting for P's blocks hold at most
``MAX_PENDING_IDS`` of D's block ids, all decoders together; past it a registration is
refused. Without a shared secret any NIXL agent that fetched P's info can register, and one
sending 3 MB registrations for made-up transfers grew P by 3 GiB in 30 s (a red-team run).
"""

from __future__ import annotations

import logging
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING

from kvpush.core import wire
from kvpush.core.errors import worth_logging
from kvpush.core.ids import Key, MatchTable, base_request_id, names_other_engine
from kvpush.core.types import StagedBlocks, StepMeta

if TYPE_CHECKING:
    from kvpush.core.records import PendingGroup, PRequest
    from kvpush.core.shared import Shared

log = logging.getLogger(__name__)

# vLLM schedules at most max_concurrent_batches (PP size + 1) steps ahead of the one a
# worker is in: a step this many after one this worker took in past a moment was built
# by the scheduler after that moment, with every arrival the engine had by then.
STEPS_AHEAD = 16
# An engine with no step running schedules a request the moment it gets one; a worker that
# saw no step begin for this long after a moment has seen every arrival before it.
IDLE_S = 1.0
MAX_ARRIVED = 1 << 20  # names of requests not yet handed over (a bound; refusals stop past it)
# D's block ids in registrations waiting for P's blocks: 4M blocks of 16 tokens are 64M
# prompt tokens in flight to one P rank, far beyond an honest deployment's; about 200 MB.
MAX_PENDING_IDS = 1 << 22


def named(key: Key) -> str:
    """The name of P's request a registration's key names: its transfer id (P's key, or
    P's request id without its suffix), else D's request id without its suffix."""
    return key.transfer_id if key.transfer_id is not None else base_request_id(key.request_id)


def prompt_mismatch(mine: wire.PromptPrint | None, reg: wire.PushReg) -> str:
    """Why D's registration names another prompt than P computed; "" when they agree or
    either side sent no print (a seed decoder, a prompt without token ids)."""
    theirs = reg.prompt
    if mine is None or not isinstance(theirs, wire.PromptPrint) or theirs == mine:
        return ""
    if theirs.tokens != mine.tokens:
        return f"prompt mismatch: D has {theirs.tokens} prompt tokens, P computed {mine.tokens}"
    return f"prompt mismatch: D's {theirs.tokens} prompt tokens differ from P's"


def same_prompt(prompt: wire.PromptPrint | None, group: PendingGroup | None) -> bool:
    """No registration of ``group`` names a prompt other than ``prompt``."""
    if prompt is None or group is None:
        return True
    return not any(prompt_mismatch(prompt, p.reg) for p in group.regs.values())


class Pairing:
    def __init__(
        self,
        shared: Shared,
        staged: MatchTable[PRequest],
        pending: MatchTable[PendingGroup],
        send_to: Callable[[wire.PushReg, wire.Message], None],
    ) -> None:
        self.s = shared
        self.staged = staged  # P's requests missing registrations
        self.pending = pending  # registrations missing P's requests
        self._send_to = send_to  # a notice to the D of a registration (after its handshake)
        # Keys and names of P's requests that ended: until when, and why.
        self.ended: OrderedDict[str, tuple[float, str]] = OrderedDict()
        # Names of requests P's engine got and has not handed over (StepMeta.arrived).
        self.arrived: Counter[str] = Counter()
        self.tracking = False  # P's scheduler reports arrivals (not past MAX_ARRIVED)
        self.overflowed = False
        # Where the engine is: steps whose StepMeta this worker took in (written by the
        # engine's thread only), whether one is running, and since when none is.
        self.steps = 0
        self.in_step = False
        self.idle_since = time.monotonic()
        self.pending_ids = 0  # D's ids in ``pending``: exact at each recount, above it between

    # ---- the budget ----------------------------------------------------------------------

    def room_for(self, reg: wire.PushReg) -> bool:
        """Whether ``reg`` may wait for P's blocks; else it is refused."""
        n = sum(len(g) for g in reg.local_block_ids)
        if self.pending_ids + n > MAX_PENDING_IDS:
            self.s.stats["reg_over_budget"] += 1
            self.refuse(reg, f"{self.pending_ids} block ids already wait for prefills here")
            return False
        self.pending_ids += n
        return True

    def recount(self) -> None:
        """The ids of the registrations still waiting (those that left are not subtracted
        as they leave: each path that removes one would have to)."""
        regs = (p.reg for group in self.pending.values() for p in group.regs.values())
        self.pending_ids = sum(len(g) for reg in regs for g in reg.local_block_ids)

    # ---- before matching -----------------------------------------------------------------

    def admit(self, sender: str, reg: wire.PushReg) -> bool:
        """Whether P may serve ``reg`` at all: a decoder on the allowlist (nothing else is
        contacted), this worker's engine a prefiller (a decoder listed as a prefiller
        refuses at once), and this engine or none named."""
        allow = self.s.config.trusted_decoders
        where = f"{reg.decode_host}:{reg.decode_port}"
        if allow is not None and where not in allow:
            self.s.stats["reg_untrusted"] += 1
            log.warning(
                "registration %s from %s names untrusted decoder %s; refused",
                reg.request_id,
                sender,
                where,
            )
            if sender in self.s.peers.by_agent:  # a peer we already trust can hear why
                self.s.notify(sender, self._fail(reg, f"decoder {where} is not trusted"))
            return False
        if not self.s.config.prefiller:
            self.s.stats["reg_not_prefiller"] += 1
            self.refuse(reg, "this worker's engine is a decoder, not a prefiller")
            return False
        engine = self.s.config.engine_id
        if names_other_engine(reg.remote_engine_id, engine):
            self.refuse(reg, f"it names engine {reg.remote_engine_id!r}; this is {engine!r}")
            return False
        return True

    # ---- matching by name ----------------------------------------------------------------

    def staged_for(self, key: Key) -> PRequest | None:
        """P's request a registration (or heartbeat) names: by transfer id or request id,
        else by the request's id without its suffix (D's leg named it)."""
        preq = self.staged.find(key)
        return preq if preq is not None else self.staged.find_named(key.transfer_id)

    def adopt_named(self, staged: StagedBlocks) -> None:
        """Registrations that name this request by its id (not by its transfer id) wait
        under that name: key them as this request, so the matching that follows finds them."""
        name = base_request_id(staged.request_id)
        if staged.transfer_id == name or self.pending.by_tid(staged.transfer_id):
            return
        got = self.pending.pop_tid(name)
        if got is not None:
            self.pending.add(Key(staged.request_id, staged.transfer_id), got[1])

    # ---- requests P's engine got --------------------------------------------------------

    def took(self, meta: StepMeta) -> None:
        """The worker takes in a step: its names of requests that came to the engine and
        that left it unstaged, then the step is counted. The engine's thread writes these
        (and ``staging``) only; the ticking thread only reads them."""
        self.in_step = True
        if meta.arrived and not self.overflowed:
            self.arrived.update(meta.arrived)
            self.overflowed = len(self.arrived) > MAX_ARRIVED  # (then it grows no more)
            if self.overflowed:
                log.warning(
                    "over %d names not handed over: none refused as unknown now", MAX_ARRIVED
                )
            self.tracking = not self.overflowed
        for name in meta.departed:
            self._drop(name)
        self.steps += 1

    def step_began(self) -> None:
        """The engine starts a step (vLLM binds its metadata before the forward; the worker
        may take it in only after): an arrival may be in it. Any thread."""
        self.in_step = True

    def step_ended(self, now: float) -> None:
        self.in_step, self.idle_since = False, now

    def staging(self, staged: StagedBlocks) -> None:
        """``staged`` is handed over: from now on ``staged``/``ended`` know it."""
        for name in {staged.transfer_id, base_request_id(staged.request_id)}:
            if name is not None:
                self._drop(name)

    def _drop(self, name: str) -> None:
        left = self.arrived.get(name, 0) - 1
        if left > 0:
            self.arrived[name] = left
        else:
            self.arrived.pop(name, None)

    def refuse_unknown(self, now: float) -> None:
        """Refuse the waiting registrations that name no request P's engine got within
        ``unknown_request_grace_s`` of their arrival (the timer, every heartbeat)."""
        # Where the engine was, read before anything else: a step counted here had its
        # arrivals added (and any overflow noted) before (``took``): none is missed below.
        steps, busy, idle_since = self.steps, self.in_step, self.idle_since
        if not self.tracking:
            return
        grace = self.s.config.unknown_request_grace_s
        for key, group in self.pending.items():
            name = named(key)
            if name in self.arrived:
                continue
            for rank, pend in list(group.regs.items()):
                if now - pend.arrived < grace:
                    continue
                if pend.mark is None:  # what the engine gets after this came too late
                    pend.mark = (steps, now)
                    continue
                # Caught up with the engine at the mark: STEPS_AHEAD steps taken in since,
                # or no step has begun since before it, for IDLE_S.
                at = pend.mark[1]
                idle = not busy and idle_since <= at and now - at >= IDLE_S
                if steps - pend.mark[0] < STEPS_AHEAD and not idle:
                    continue
                del group.regs[rank]
                why = f"no request of this prefiller is named {name!r} (none came within"
                self.refuse(pend.reg, f"{why} unknown_request_grace_s={grace:g})")
            if not group.regs:
                self.pending.pop_value(group)

    # ---- requests that ended -------------------------------------------------------------

    def request_ended(self, preq: PRequest) -> None:
        """Remember that ``preq`` ended, and fail the registrations still waiting for it:
        none can be served any more."""
        how = "was evicted (its lease ran out, or it was aborted)" if preq.evicted else "was pushed"
        why = f"the prefiller's request {preq.prid} already ended: it {how}"
        until = time.monotonic() + self.s.config.registration_ttl_s
        for name in {preq.tid, base_request_id(preq.prid)}:
            if name is None:
                continue
            self.ended[name] = (until, why)
            self.ended.move_to_end(name)
            got = self.pending.pop_tid(name)
            for pend in got[1].regs.values() if got else ():
                self.refuse(pend.reg, why)

    def refuse_ended(self, key: Key, reg: wire.PushReg) -> bool:
        """Refuse ``reg`` if the request of P's it names has ended."""
        got = self.ended.get(named(key))
        if got is not None:
            self.refuse(reg, got[1])
        return got is not None

    def forget(self, now: float) -> None:
        while self.ended and next(iter(self.ended.values()))[0] < now:
            self.ended.popitem(last=False)

    # ---- refusals ------------------------------------------------------------------------

    def refuse(self, reg: wire.PushReg, why: str) -> None:
        """Fail a registration that can never pair here: D fails its request now, not at
        the registration's expiry (registration_ttl_s)."""
        self.s.stats["reg_unpairable"] += 1
        if worth_logging(self.s.stats["reg_unpairable"]):
            n = self.s.stats["reg_unpairable"]
            log.warning("registration %s refused (#%d): %s", reg.request_id, n, why)
        self._send_to(reg, self._fail(reg, f"cannot pair: {why}"))

    def _fail(self, reg: wire.PushReg, reason: str) -> wire.PushFail:
        return wire.PushFail(
            request_id=reg.request_id,
            reason=reason,
            transfer_id=reg.transfer_id,
            tp_rank=self.s.config.tp_rank,
        )
