"""Plain values passed between the scheduler side, the engine thread and the worker."""

from __future__ import annotations

import enum
import logging
import os
from dataclasses import dataclass, field
from typing import Any

from kvpush.core import trace
from kvpush.core.errors import ConfigError
from kvpush.core.lane import MAX_SLOTS
from kvpush.core.layers import LayerFeed
from kvpush.core.secret import Secret, as_secret
from kvpush.core.wire import PromptPrint

log = logging.getLogger("kvpush.transfer")


class State(enum.Enum):
    """Named states of a transfer. Which moves are legal is each record's ``MOVES`` table
    (``records.PRequest``, ``records.PushTransfer``, ``records.RecvTransfer``);
    ``transition`` enforces it."""

    REGISTERED = "registered"  # D: registration known, not yet sent to P
    AWAITING = "awaiting"  # D: registration sent, waiting for P's WRITE
    # D: aborted, waiting for P to confirm nothing is in flight; P leg: D cancelled while
    # writing, and the WRITE's outcome answers D
    CANCELLING = "cancelling"
    STAGED = "staged"  # P request: blocks finished, waiting for D's registrations
    EVICTING = "evicting"  # P request: evicted, waiting for its legs in flight to end
    MATCHED = "matched"  # P leg (and request, once every D rank has one): both halves known
    DEFERRED = "deferred"  # P leg: matched, waiting for the handshake with D
    RECHECKING = "rechecking"  # P leg: D's address answered as a new agent: handshake again
    SETTLING = "settling"  # P leg: routed, waiting for device work on P's blocks to end
    WRITING = "writing"  # P leg: WRITE posted (or copy launched)
    DONE = "done"
    FAILED = "failed"
    EXPIRED = "expired"  # lease (P) or watchdog (D) ran out
    CANCELLED = "cancelled"


class Poll(enum.Enum):
    """A transfer's state as its users need it (in the spirit of SGLang's ``KVPoll``)."""

    WAITING = "waiting"  # nothing is in flight yet: no byte can touch the blocks
    TRANSFERRING = "transferring"  # bytes may be moving: the blocks must stay
    SUCCESS = "success"  # the KV is in D's blocks
    FAILED = "failed"  # ended without the KV: failed, expired or cancelled


POLL = {
    State.REGISTERED: Poll.WAITING,
    State.STAGED: Poll.WAITING,
    State.MATCHED: Poll.WAITING,
    State.DEFERRED: Poll.WAITING,
    State.RECHECKING: Poll.WAITING,
    State.SETTLING: Poll.WAITING,  # nothing posted yet
    State.AWAITING: Poll.TRANSFERRING,  # P holds the registration: it may write any time
    State.CANCELLING: Poll.TRANSFERRING,  # a WRITE may still land until P confirms
    State.WRITING: Poll.TRANSFERRING,
    State.EVICTING: Poll.TRANSFERRING,  # a leg may still write from its blocks
    State.DONE: Poll.SUCCESS,
    State.FAILED: Poll.FAILED,
    State.EXPIRED: Poll.FAILED,
    State.CANCELLED: Poll.FAILED,
}
ENDED = frozenset(s for s, p in POLL.items() if p in (Poll.SUCCESS, Poll.FAILED))

Moves = dict[State, frozenset[State]]


class IllegalTransition(RuntimeError):
    """A move its record's ``MOVES`` table does not allow: a bug in kvpush."""


# Strict (tests: tests/conftest.py sets KVPUSH_STRICT_STATES=1): an illegal move raises.
# Otherwise it is logged as an error, counted (``illegal_transition`` in the worker's
# stats) and made anyway: the engine keeps running and the record's other checks decide.
STRICT = os.environ.get("KVPUSH_STRICT_STATES", "") == "1"
ILLEGAL_SEEN: list[str] = []  # strict only: every illegal move, for the tests' check


def transition(obj: object, new: State, name: str, why: str = "") -> None:
    """Move ``obj.state`` to ``new`` if ``type(obj).MOVES`` allows it; log the change."""
    old = obj.state  # type: ignore[attr-defined]
    if new not in type(obj).MOVES.get(old, ()):  # type: ignore[attr-defined]
        _illegal(obj, old, new, name, why)
    obj.state = new  # type: ignore[attr-defined]
    if trace.ON:
        trace.mark(f"{type(obj).__name__}.{new.value}", name)
    if log.isEnabledFor(logging.DEBUG):
        log.debug("transfer %s: %s -> %s %s", name, old.value, new.value, why)


def entered(obj: object, name: str) -> None:
    """Log (and trace) the state a record starts in; no move."""
    state: State = obj.state  # type: ignore[attr-defined]
    if trace.ON:
        trace.mark(f"{type(obj).__name__}.{state.value}", name)
    if log.isEnabledFor(logging.DEBUG):
        log.debug("transfer %s: starts %s", name, state.value)


def _illegal(obj: object, old: State, new: State, name: str, why: str) -> None:
    what = f"{type(obj).__name__} {name}: illegal move {old.value} -> {new.value} ({why})"
    stats = getattr(obj, "stats", None)
    if stats is not None:
        stats["illegal_transition"] += 1
    if STRICT:
        ILLEGAL_SEEN.append(what)
        raise IllegalTransition(what)
    log.error("kvpush bug: %s", what)


def render_moves(moves: Moves) -> str:
    """The table as text, one line per state with moves (docs/architecture.md shows it)."""
    width = max(len(s.name) for s in moves)
    order = list(State)
    return "\n".join(
        f"{old.name:<{width}} -> " + ", ".join(s.name for s in sorted(to, key=order.index))
        for old, to in moves.items()
    )


@dataclass
class RecvRegistration:
    """D scheduler -> D worker: blocks pre-allocated for a request whose KV P will push."""

    request_id: str
    block_ids: list[list[int]]
    remote_engine_id: str
    remote_host: str
    remote_port: int
    remote_tp_size: int = 1
    transfer_id: str | None = None
    remote_pp_size: int = 1
    prompt: PromptPrint | None = None  # D's prompt, sent for P to compare (wire.fingerprint)


@dataclass
class StagedBlocks:
    """P scheduler -> P worker: a finished prefill whose blocks wait to be pushed."""

    request_id: str
    block_ids: list[list[int]]
    transfer_id: str | None = None
    # Device work the blocks' bytes are final after (an event with query() and
    # synchronize(), as torch's and CuPy's CUDA events have); None: final already. Lets an
    # engine hand over blocks as soon as their last write is queued: a peer copy is queued
    # behind the event, a WRITE waits for it.
    after: Any = None
    # Handed over before its forward: the layers written so far (core/layers.py); the
    # WRITE route posts them as they come (the only route that takes such a request).
    feed: LayerFeed | None = None
    prompt: PromptPrint | None = None  # P's prompt (wire.fingerprint); None: not checked


@dataclass
class LayerChunk:
    """P scheduler -> P worker: a step computes part (or all) of a prompt pushed layer by
    layer. The first chunk hands the request over (its blocks held as ``early``), each
    step's layers become pieces of its feed (core/layers.py), the last one closes it."""

    request_id: str
    transfer_id: str | None
    block_ids: list[list[int]]  # the request's blocks so far, per group
    first: list[int]  # per group: the first block this step writes
    total: list[int]  # per group: the request's blocks once its prompt is computed
    last: bool  # the prompt's last tokens are computed in this step
    failed: str = ""  # the engine gave the blocks up (preempted): the push fails
    # Per group: the block after the last one this step fills; empty: every block so far.
    # A block the step leaves part-filled goes with the next chunk, whole: written twice,
    # the earlier WRITE (not ordered with the later one) could land last with stale bytes.
    upto: list[int] = field(default_factory=list)
    # P's prompt (StagedBlocks.prompt): which prompt, not what the step writes
    prompt: PromptPrint | None = field(default=None, compare=False)


@dataclass
class StepMeta:
    """What the scheduler hands the worker each engine step."""

    registrations: list[RecvRegistration] = field(default_factory=list)
    cancels: list[str] = field(default_factory=list)  # D request ids aborted by the engine
    expired: list[str] = field(default_factory=list)  # D request ids past their watchdog
    finished: list[StagedBlocks] = field(default_factory=list)
    evictions: list[str] = field(default_factory=list)  # P request ids past their lease
    rejected: dict[str, str] = field(default_factory=dict)  # D request ids -> why unusable
    # P: prefills that end in this step, for the engine to hand over as soon as their last
    # write is queued (``PushWorker.hand_over``), before it has finished the request: the
    # worker keeps back their finished_sending until ``confirmed`` names them.
    early: list[StagedBlocks] = field(default_factory=list)
    confirmed: list[str] = field(default_factory=list)  # P: early ones the engine finished
    # D: requests aborted before they registered (no blocks of theirs to write): P may
    # free the prompt's blocks it keeps for them at once instead of at lease expiry.
    withdrawn: list[RecvRegistration] = field(default_factory=list)
    layered: list[LayerChunk] = field(default_factory=list)  # P: this step's chunks
    # P: names a registration may give (core/pairing.py) of requests that came to the
    # engine (``arrived``, at vLLM's on_new_request) or left it without being handed over
    # (``departed``): P refuses a registration whose name never came (unknown_request_grace_s).
    arrived: list[str] = field(default_factory=list)
    departed: list[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(
            self.registrations
            or self.cancels
            or self.expired
            or self.finished
            or self.evictions
            or self.rejected
            or self.early
            or self.confirmed
            or self.withdrawn
            or self.layered
            or self.arrived
            or self.departed
        )


@dataclass
class WorkerOutput:
    """What the worker reports back each engine step."""

    finished_sending: set[str] = field(default_factory=set)  # P: blocks may be freed
    finished_recving: set[str] = field(default_factory=set)  # D: KV arrived
    failed_recving: dict[str, str] = field(default_factory=dict)  # D: id -> reason
    released: set[str] = field(default_factory=set)  # D: aborted, no WRITE can touch blocks now
    # D: failed (in failed_recving) with its blocks (per group), which stay out of the
    # pool until ``released``: a late WRITE may still land in them (core/late_writes.py)
    held: dict[str, list[list[int]]] = field(default_factory=dict)
    renewed: set[str] = field(default_factory=set)  # lease (P) / watchdog (D) heartbeats

    def __bool__(self) -> bool:
        return bool(
            self.finished_sending
            or self.finished_recving
            or self.failed_recving
            or self.released
            or self.renewed
        )


def addresses(name: str, text: str) -> frozenset[str] | None:
    """``"host:port,host:port"`` as a set (None when empty); ConfigError naming ``name``
    for an entry that is not host:port."""
    entries = frozenset(x.strip() for x in text.split(",") if x.strip())
    for where in entries:
        host, _, port = where.rpartition(":")
        if not host or not port.isdigit():
            raise ConfigError(f"{name} entry {where!r} is not host:port")
    return entries or None


@dataclass
class WorkerConfig:
    """Options of one worker (one TP rank). Times in seconds."""

    engine_id: str
    host: str = "127.0.0.1"
    port: int = 5600  # this rank's handshake side channel
    tp_rank: int = 0
    tp_size: int = 1
    poll_interval_s: float = 1e-4  # while WRITEs or receives are outstanding (backs off)
    max_poll_interval_s: float = 2e-3
    match_poll_s: float = 1e-3  # while P holds blocks no registration matched yet
    idle_poll_s: float = 0.1  # nothing outstanding (20 Hz cost ~0.4 % of a core on CPU)
    heartbeat_interval_s: float = 1.0
    handshake_timeout_s: float = 5.0
    registration_ttl_s: float = 60.0  # P drops a registration its prefill never matched
    # P refuses a registration naming no request its engine got within this long (once
    # its scheduler reports arrivals, StepMeta.arrived): both legs are sent at once, so P's
    # request is normally there within milliseconds; this leaves room for a backlog.
    unknown_request_grace_s: float = 5.0
    # Handshakes under way at once, each on its own pool thread so none waits behind one
    # to a dead address; half of them at most to one host (core/peers.py). Beyond, a
    # registration that needs another fails at once.
    handshake_workers: int = 32
    # Words in D's completion lane (core/lane.py), made when the worker has a peer-copy
    # hook: same-host copies report their end there. 0: no lane (completions over NIXL).
    lane_slots: int = 1 << 16
    # Trust: P pushes only to decoders whose side channel ("host:port") is listed (None:
    # any), and with a shared secret every handshake peer must prove it holds the same
    # (given as bytes or str, kept as a Secret: no repr or log line shows it).
    trusted_decoders: frozenset[str] | None = None
    shared_secret: Secret | bytes | str | None = field(default=None, repr=False)
    # D keeps a receive's blocks this long after its watchdog failed it while a P rank
    # could still be writing (core/late_writes.py); None: the kernel's TCP give-up time.
    late_write_hold_s: float | None = None
    # This worker's engine prefills for decoders (vLLM: kv_producer or kv_both). A decoder
    # only refuses registrations at once: an operator who lists it as a prefiller would
    # otherwise have every request wait out registration_ttl_s for blocks that never come.
    prefiller: bool = True

    def __post_init__(self) -> None:
        self.shared_secret = as_secret(self.shared_secret)
        if not self.engine_id:
            raise ConfigError("engine_id must not be empty")
        if not 0 < self.port < 65536:
            raise ConfigError(f"side-channel port {self.port} out of range")
        if not 0 <= self.tp_rank < self.tp_size:
            raise ConfigError(f"tp_rank {self.tp_rank} not in [0, {self.tp_size})")
        for name in (
            "poll_interval_s",
            "max_poll_interval_s",
            "match_poll_s",
            "idle_poll_s",
            "heartbeat_interval_s",
            "handshake_timeout_s",
            "registration_ttl_s",
            "unknown_request_grace_s",
        ):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)}")
        if not 0 <= self.lane_slots <= MAX_SLOTS:
            raise ConfigError(f"lane_slots must be in [0, {MAX_SLOTS}], got {self.lane_slots}")
        if self.handshake_workers < 1:
            raise ConfigError("handshake_workers must be >= 1")
        if self.late_write_hold_s is not None and not self.late_write_hold_s >= 0:
            raise ConfigError(f"late_write_hold_s must be >= 0, got {self.late_write_hold_s}")
        if self.trusted_decoders is not None:
            addresses("trusted_decoders", ",".join(self.trusted_decoders))
