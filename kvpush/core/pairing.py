"""P's side of pairing beyond the matching tables: which registrations it admits, which
request a registration names by that request's id, and registrations that can never pair.

A decoder leg may name P's request (``remote_request_id``, the contract of vLLM's in-tree
push connector): D's key is then P's request id without its engine suffix, which is P's
own key of a request that carried no transfer id, and a name P also finds a request that
carried one by. P refuses at once, with a ``PUSH_FAIL``, a registration it can never serve:
one naming a decoder off the allowlist or another engine id, and one naming a request of
P's that already ended (remembered for ``registration_ttl_s``); a registration still waiting
when the request it names ends is failed then. Owned by the producer (the ticking thread).
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING

from kvpush.core import wire
from kvpush.core.ids import Key, MatchTable, base_request_id, names_other_engine
from kvpush.core.types import StagedBlocks

if TYPE_CHECKING:
    from kvpush.core.records import PendingGroup, PRequest
    from kvpush.core.shared import Shared

log = logging.getLogger(__name__)


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

    # ---- before matching -----------------------------------------------------------------

    def admit(self, sender: str, reg: wire.PushReg) -> bool:
        """Whether P may serve ``reg`` at all: a decoder on the allowlist (nothing else is
        contacted), and this engine or none named."""
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

    def withdrawn_before(self, withdrawn: dict[str, float], staged: StagedBlocks) -> bool:
        """D withdrew this request's transfer (by its key or by its name) before it came."""
        by_key = withdrawn.pop(staged.transfer_id or "", None) is not None
        return withdrawn.pop(base_request_id(staged.request_id), None) is not None or by_key

    # ---- requests that ended -------------------------------------------------------------

    def request_ended(self, preq: PRequest) -> None:
        """Remember that ``preq`` ended, and fail the registrations still waiting for it:
        none can be served any more."""
        how = "was evicted (its lease ran out, or it was aborted)" if preq.ended else "was pushed"
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
        name = key.transfer_id if key.transfer_id is not None else base_request_id(key.request_id)
        got = self.ended.get(name)
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
        log.warning("registration %s refused: %s", reg.request_id, why)
        self._send_to(reg, self._fail(reg, f"cannot pair: {why}"))

    def _fail(self, reg: wire.PushReg, reason: str) -> wire.PushFail:
        return wire.PushFail(
            request_id=reg.request_id,
            reason=reason,
            transfer_id=reg.transfer_id,
            tp_rank=self.s.config.tp_rank,
        )
