"""The record of each transfer, with its states: P's request (``PRequest``) and its legs
(``PushTransfer``, one per D rank), D's receive (``RecvTransfer``); and ``Route``, the
interface a leg's bytes go through (here, so that a leg can name what posted it).

Each record carries its own state, its legal moves (``MOVES``, checked by
``types.transition``; docs/architecture.md, "Transfer states", shows all three tables
and when each move happens). The producer and consumer keep the records in a few
indexes for lookups; what a transfer is doing is its record's state. Plain data: no I/O.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from kvpush.core import wire
from kvpush.core.errors import LayoutError
from kvpush.core.layers import LayerFeed
from kvpush.core.peer_copy import CopyDst
from kvpush.core.peers import Peer
from kvpush.core.transport import WriteState
from kvpush.core.types import ENDED, POLL, Moves, Poll, RecvRegistration, StagedBlocks, State

DKey = tuple[str, str]  # (D agent that registered, D request id)


@dataclass
class Armed:
    """A leg its route prepared when D registered: only P's ids are missing."""

    route: Route
    agent: str  # the D agent it was prepared for
    dst: CopyDst | None  # a copy's D half (a WRITE's D ids were checked: None)
    handle: object  # the route's: the peer-copy hook's prepared copy; a WRITE's (pairs, notice)


@dataclass(slots=True)  # (made on the early launch's path: kept light)
class Flight:
    """One posted leg (a WRITE, a copy), polled by the route that posted it."""

    route: Route
    handle: object  # the route's: a NIXL handle, the hook's prepared copy
    agent: str  # the D agent it goes to
    units: int  # what it moves: descriptors, blocks (counted as ``route.units``)
    nbytes: int
    notice: str | None = None  # D's request id, when P sends the completion after it
    name: str = ""  # the leg's (set when the leg goes WRITING), for the log
    error: str = ""  # why it failed (``Route.poll`` gave ERROR)
    # The connection to the agent broke (NIXL's remote disconnect): the sender drops it once
    # the failure is told, so the next push connects afresh instead of failing on it.
    gone: bool = False


class Declined(Exception):
    """The copy route's hook declined a peer: it takes the WRITE route (core/routes.py)."""


class Route:
    """P's way into one peer's blocks (core/route.py, copy_route.py, layer_route.py),
    called by the sender alone, through its chooser (core/routes.py): ``arm`` when D
    registers, ``post`` the leg when P's blocks are ready, ``poll`` the ``Flight`` it got
    until it ends, then ``release`` it."""

    posts = units = ""  # counters: legs posted, and what they moved (descriptors, blocks)
    stopped_by_forget = False  # forgetting the peer ends a posted leg (in error)

    def arm(self, peer: Peer, reg: wire.PushReg, dst: list[np.ndarray]) -> Armed | None:
        """D registered before P's blocks are ready: prepare what can be (optional)."""
        return None

    def launch(
        self, armed: Armed, pend: PendingReg, staged: StagedBlocks, peer: Peer
    ) -> Flight | None:
        """Post an armed leg before the producer's bookkeeping (``Sender.launch_armed``);
        None when a check might fail: the leg then takes ``post``."""
        return None

    def post(self, t: PushTransfer, peer: Peer) -> Flight | None:
        """Start moving the leg's bytes; None: not yet, P's blocks still follow device work
        (``settled``; the sender asks again at each tick). Raises TransportError with the
        reason to fail the leg, LayoutError or WireError for an invalid registration."""
        raise NotImplementedError

    def poll(self, f: Flight) -> WriteState:
        """PENDING; DONE (D has been or will be told); ERROR (``f.error`` says why)."""
        raise NotImplementedError

    def release(self, f: Flight) -> None:
        """Free what a flight holds, once ``poll`` gave its outcome."""


@dataclass
class PendingReg:
    reg: wire.PushReg
    sender: str
    arrived: float
    # D's ids as arrays, made on arrival so the WRITE path need not convert them.
    dst: list[np.ndarray] = field(default_factory=list)
    armed: Armed | None = None
    # Past unknown_request_grace_s with its request unknown: the worker's step count and
    # the time then (core/pairing.py refuses it once the worker has caught up with that).
    mark: tuple[int, float] | None = None


@dataclass
class PendingGroup:
    """Registrations of one request from D's ranks that came before P's blocks."""

    regs: dict[int, PendingReg] = field(default_factory=dict)  # by D tp rank


@dataclass
class HandOver:
    """P: a request whose blocks the engine handed over before finishing it
    (``StepMeta.early``). Until the engine has finished it the blocks are the running
    request's, so its ``finished_sending`` goes out once both have happened, in either
    order: its push ended (``sent``) and the engine finished it (``confirmed``)."""

    rid: str
    sent: bool = False
    confirmed: bool = False

    def on_sent(self) -> bool:
        """The push ended; True when the engine already finished the request (report)."""
        self.sent = True
        return self.confirmed

    def on_confirmed(self) -> bool:
        """The engine finished the request; True when its push already ended (report)."""
        self.confirmed = True
        return self.sent


@dataclass
class PRequest:
    """One P request whose blocks the engine handed over: one leg per D rank's
    registration (every D rank registers); its blocks are freed once every leg ended."""

    # Every legal move (docs/architecture.md, "Transfer states", shows this table).
    MOVES: ClassVar[Moves] = {
        State.STAGED: frozenset(
            {
                State.MATCHED,  # every D rank's registration came: each has its leg
                State.EVICTING,  # lease ran out, aborted, or D withdrew it
            }
        ),
        State.MATCHED: frozenset(
            {
                State.DONE,  # every leg DONE
                State.FAILED,  # every leg ended, one not DONE
                State.EVICTING,
            }
        ),
        State.EVICTING: frozenset({State.EXPIRED}),  # no leg in flight any more
    }

    prid: str
    blocks: list[list[int]]
    tid: str | None
    state: State = State.STAGED
    expected: int | None = None  # D's TP size, known from the first registration
    after: Any = None  # StagedBlocks.after until waited for (None: the bytes are final)
    feed: LayerFeed | None = None  # pushed layer by layer (StagedBlocks.feed)
    prompt: wire.PromptPrint | None = None  # P's prompt (StagedBlocks.prompt)
    legs: dict[int, PushTransfer] = field(default_factory=dict)  # by D tp rank
    since: float = field(default_factory=time.monotonic)  # handed to the producer
    stats: Counter[str] | None = field(default=None, repr=False)  # counts illegal moves

    @property
    def name(self) -> str:
        return self.tid or self.prid

    @property
    def evicted(self) -> bool:
        return self.state in (State.EVICTING, State.EXPIRED)

    def ended_legs(self) -> bool:
        """Every leg it has so far has ended."""
        return all(leg.state in ENDED for leg in self.legs.values())

    def outcome(self) -> State:
        """The state every ended leg leaves the request in."""
        if self.evicted:
            return State.EXPIRED
        ok = all(leg.state is State.DONE for leg in self.legs.values())
        return State.DONE if ok else State.FAILED


# How a leg ends before anything is posted: an invalid registration, a failed handshake
# or post (FAILED), the lease ran out (EXPIRED), D's PUSH_CANCEL (CANCELLED).
_UNPOSTED_ENDS = frozenset({State.FAILED, State.EXPIRED, State.CANCELLED})


@dataclass
class PushTransfer:
    """One leg: a P request on its way into one D rank's registration."""

    # Every legal move (docs/architecture.md, "Transfer states", shows this table).
    MOVES: ClassVar[Moves] = {
        State.MATCHED: frozenset(
            {
                State.DEFERRED,  # handshake with D still running
                State.RECHECKING,  # D's address answers as another agent: handshake again
                State.SETTLING,  # routed; device work on P's blocks still running
                State.WRITING,  # WRITE posted or copy launched
                State.DONE,  # this P rank feeds nothing of that D rank
            }
            | _UNPOSTED_ENDS
        ),
        State.DEFERRED: frozenset({State.RECHECKING, State.SETTLING, State.WRITING})
        | _UNPOSTED_ENDS,
        State.RECHECKING: frozenset({State.SETTLING, State.WRITING}) | _UNPOSTED_ENDS,
        # (its peer may have gone meanwhile: the handshake again)
        State.SETTLING: frozenset({State.DEFERRED, State.RECHECKING, State.WRITING})
        | _UNPOSTED_ENDS,
        # Neither lease nor cancel ends a WRITE in flight: only its outcome.
        State.WRITING: frozenset({State.CANCELLING, State.DONE, State.FAILED}),
        State.CANCELLING: frozenset({State.DONE, State.FAILED}),  # D is answered by it
    }

    prid: str
    blocks: list[list[int]]
    tid: str | None
    state: State = State.MATCHED  # a leg is made when P's blocks and a registration meet
    reg: wire.PushReg | None = None
    dst: list[np.ndarray] = field(default_factory=list)  # reg's ids, as arrays
    sender: str = ""
    armed: Armed | None = None  # what its route prepared at registration, if anything
    flight: Flight | None = None  # posted (also before this leg existed: launch_armed)
    staged_at: float = field(default_factory=time.monotonic)
    preq: PRequest | None = None
    stats: Counter[str] | None = field(default=None, repr=False)  # counts illegal moves

    @property
    def name(self) -> str:
        return self.tid or self.prid

    def poll(self) -> Poll:
        return POLL[self.state]


@dataclass
class RecvTransfer:
    """One D request waiting for the WRITEs of its P ranks into its pre-allocated blocks.

    D registers with every P rank (so each knows D's TP size); ``sources`` are the
    ones that write here, and each sends one completion or one PUSH_FAIL.
    """

    # Every legal move (docs/architecture.md, "Transfer states", shows this table).
    MOVES: ClassVar[Moves] = {
        State.REGISTERED: frozenset(
            {
                State.AWAITING,  # PUSH_REG sent to every P rank
                State.FAILED,  # bad block ids, handshake, layout or send failed
                State.CANCELLED,  # aborted before P knew of it
                State.EXPIRED,  # watchdog while handshaking
            }
        ),
        State.AWAITING: frozenset(
            {
                State.DONE,  # a completion (or lane word) from every source
                State.CANCELLING,  # abort, watchdog or PUSH_FAIL: stop the other sources
            }
        ),
        State.CANCELLING: frozenset(
            {
                State.CANCELLED,  # aborted, and no source can write any more
                State.FAILED,  # a PUSH_FAIL, and no source can write any more
                State.EXPIRED,  # watchdog
            }
        ),
    }

    reg: RecvRegistration
    state: State = State.REGISTERED
    agents: list[str] = field(default_factory=list)  # every P rank registered with
    sources: list[str] = field(default_factory=list)  # the P ranks that write here
    done_from: set[str] = field(default_factory=set)  # sources with nothing in flight
    fail_reason: str = ""  # failing: waiting for the other sources before reporting it
    fail_cause: str = ""  # the failing PUSH_FAIL's cause (wire.CAUSE_*), if it named one
    aborted: bool = False
    sent_at: float = 0.0  # when PUSH_REG went to every P rank (monotonic)
    stats: Counter[str] | None = field(default=None, repr=False)  # counts illegal moves

    @property
    def p_agent(self) -> str | None:
        return self.sources[0] if self.sources else None

    @property
    def quiet(self) -> bool:
        # done_from only ever holds sources: as many means all (no set built per check).
        return len(self.done_from) >= len(self.sources) or self.done_from >= set(self.sources)

    @property
    def rid(self) -> str:
        return self.reg.request_id

    @property
    def name(self) -> str:
        return self.reg.transfer_id or self.reg.request_id

    def poll(self) -> Poll:
        return POLL[self.state]


def source_blocks(dst: list[np.ndarray], blocks: list[list[int]]) -> list[list[int]]:
    """P's blocks for D's registered ones, per group: D may already hold a prefix (its
    own cache), so P writes the tail."""
    if len(dst) != len(blocks):
        raise LayoutError(f"{len(dst)} block groups, P holds {len(blocks)}")
    src = []
    for g, (d_ids, p_ids) in enumerate(zip(dst, blocks, strict=True)):
        if len(d_ids) > len(p_ids):
            raise LayoutError(f"group {g}: D registered {len(d_ids)} blocks, P holds {len(p_ids)}")
        src.append(p_ids if len(p_ids) == len(d_ids) else p_ids[len(p_ids) - len(d_ids) :])
    return src
