"""Wire formats of the push protocol, sent as NIXL notifications.

Seed-compatible formats:
  * ``PUSH_REG:<msgpack dict>`` — D registers its pre-allocated blocks with P
    (the seed's ten fields plus optional ``transfer_id`` and ``decode_tp_rank``).
  * ``<request_id>:<tp_size>`` — P's completion notification, attached to the WRITE.

Added by kvpush:
  * ``PUSH_FAIL:<msgpack>`` — P gave up on a registration; nothing more will be written.
  * ``PUSH_CANCEL:<msgpack>`` — D aborted a registered request.
  * ``PUSH_HB:<msgpack>`` — heartbeat naming the transfers the sender still holds.
  * ``PushReg.lane`` (optional, omitted unless D offers it) — a word of D's completion
    lane: a same-host P's direct copy writes it instead of sending a completion
    (see core/lane.py).

Decoding is strict: every failure raises :class:`WireError` with a reason and
callers log and drop the message.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from typing import Annotated

import msgspec
import numpy as np

from kvpush.core.errors import WireError
from kvpush.core.lane import MAX_SLOTS

REG_PREFIX = b"PUSH_REG:"
FAIL_PREFIX = b"PUSH_FAIL:"
CANCEL_PREFIX = b"PUSH_CANCEL:"
HB_PREFIX = b"PUSH_HB:"

# Bounds keep a hostile peer from making us allocate or loop without limit.
MAX_MESSAGE_BYTES = 4 << 20
MAX_BLOCKS_PER_GROUP = 1 << 20
MAX_GROUPS = 64
MAX_HB_ENTRIES = 65536
MAX_TP = 1024
MAX_BLOCK_ID = (1 << 31) - 1
MAX_PROMPT_TOKENS = (1 << 31) - 1
DIGEST_BYTES = 16  # blake2b-128 of the prompt's token ids

# PushFail.cause values kvpush sends (a receiver treats an unknown one as no cause).
CAUSE_PROMPT_MISMATCH = "prompt_mismatch"

Name = Annotated[str, msgspec.Meta(min_length=1, max_length=512)]
Host = Annotated[str, msgspec.Meta(min_length=1, max_length=255)]
Port = Annotated[int, msgspec.Meta(ge=1, le=65535)]
TpSize = Annotated[int, msgspec.Meta(ge=1, le=MAX_TP)]
TpRank = Annotated[int, msgspec.Meta(ge=0, lt=MAX_TP)]
BlockId = Annotated[int, msgspec.Meta(ge=0, le=MAX_BLOCK_ID)]
BlockList = Annotated[list[BlockId], msgspec.Meta(max_length=MAX_BLOCKS_PER_GROUP)]
Reason = Annotated[str, msgspec.Meta(max_length=1024)]
Cause = Annotated[str, msgspec.Meta(min_length=1, max_length=64, pattern="^[a-z][a-z0-9_]*$")]


class LaneSlot(msgspec.Struct, array_like=True, frozen=True):
    """A word of D's completion lane, reserved for one P rank's copy (core/lane.py)."""

    slot: Annotated[int, msgspec.Meta(ge=0, lt=MAX_SLOTS)]
    gen: Annotated[int, msgspec.Meta(ge=1, le=(1 << 63) - 1)]


class PromptPrint(msgspec.Struct, array_like=True, frozen=True, forbid_unknown_fields=True):
    """A prompt as one side computed it: how many tokens, and a digest of their ids
    (exactly these two: a longer array is refused)."""

    tokens: Annotated[int, msgspec.Meta(ge=0, le=MAX_PROMPT_TOKENS)]
    digest: Annotated[bytes, msgspec.Meta(min_length=DIGEST_BYTES, max_length=DIGEST_BYTES)]


def fingerprint(token_ids: Sequence[int]) -> PromptPrint:
    """The print of a prompt's token ids: blake2b over their little-endian int64 bytes,
    linear in the prompt (P and D each compute it from their own engine's request)."""
    ids = np.asarray(token_ids, dtype="<i8")
    if ids.ndim != 1:
        raise ValueError(f"token ids must be flat, got shape {ids.shape}")
    digest = hashlib.blake2b(ids.tobytes(), digest_size=DIGEST_BYTES).digest()
    return PromptPrint(len(ids), digest)


class PushReg(msgspec.Struct, kw_only=True):
    """D's registration of pre-allocated blocks (``PUSH_REG``)."""

    request_id: Name
    decode_engine_id: Name
    decode_host: Host
    decode_port: Port
    decode_tp_size: TpSize
    local_block_ids: Annotated[list[BlockList], msgspec.Meta(min_length=1, max_length=MAX_GROUPS)]
    remote_engine_id: Name
    remote_host: Host
    remote_port: Port
    remote_tp_size: TpSize
    transfer_id: Name | None = None
    decode_tp_rank: TpRank = 0
    # Optional completion-lane word for a same-host copy; UNSET is never encoded, so a
    # PUSH_REG without one is the seed's.
    lane: LaneSlot | msgspec.UnsetType = msgspec.UNSET
    # D's prompt (``fingerprint``); UNSET (never encoded): D had no token ids, P skips
    # the check, as for a seed decoder.
    prompt: PromptPrint | msgspec.UnsetType = msgspec.UNSET


class PushFail(msgspec.Struct, kw_only=True):
    """P will write nothing (more) into this registration's blocks."""

    request_id: Name
    reason: Reason
    transfer_id: Name | None = None
    tp_rank: TpRank = 0
    cause: Cause | msgspec.UnsetType = msgspec.UNSET  # e.g. CAUSE_PROMPT_MISMATCH


class PushCancel(msgspec.Struct, kw_only=True):
    """D aborted this request; P must not start new WRITEs into its blocks.

    ``withdrawn``: D aborted it before it registered, so it never will; P frees the
    blocks it keeps for the transfer and sends no answer."""

    request_id: Name
    transfer_id: Name | None = None
    withdrawn: bool = False


class HbEntry(msgspec.Struct, array_like=True):
    request_id: Name
    transfer_id: Name | None = None


class Heartbeat(msgspec.Struct, kw_only=True):
    """The sender still holds these transfers: renew their lease / watchdog."""

    entries: Annotated[list[HbEntry], msgspec.Meta(max_length=MAX_HB_ENTRIES)]


class Completion(msgspec.Struct, frozen=True):
    """``<request_id>:<tp_size>``: one P rank finished writing D's request."""

    request_id: str
    tp_size: int


Message = PushReg | PushFail | PushCancel | Heartbeat | Completion

_encoder = msgspec.msgpack.Encoder()
_decoders: dict[bytes, msgspec.msgpack.Decoder] = {
    REG_PREFIX: msgspec.msgpack.Decoder(PushReg),
    FAIL_PREFIX: msgspec.msgpack.Decoder(PushFail),
    CANCEL_PREFIX: msgspec.msgpack.Decoder(PushCancel),
    HB_PREFIX: msgspec.msgpack.Decoder(Heartbeat),
}
_PREFIX_OF: dict[type, bytes] = {
    PushReg: REG_PREFIX,
    PushFail: FAIL_PREFIX,
    PushCancel: CANCEL_PREFIX,
    Heartbeat: HB_PREFIX,
}
# A completion's request id: printable, no whitespace; ':' is allowed (we split on the last).
_COMPLETION_RE = re.compile(rb"^([\x21-\x7e]{1,512}):([1-9][0-9]{0,3})$")


def encode(msg: Message) -> bytes:
    """Serialize a message to the bytes of one notification."""
    if isinstance(msg, Completion):
        return encode_completion(msg.request_id, msg.tp_size)
    return _PREFIX_OF[type(msg)] + _encoder.encode(msg)


def encode_completion(request_id: str, tp_size: int) -> bytes:
    data = f"{request_id}:{tp_size}".encode()
    if not _COMPLETION_RE.match(data) or data.startswith(tuple(_decoders)):
        raise WireError(f"request id {request_id!r} cannot be sent as a completion")
    return data


def decode(data: bytes) -> Message:
    """Parse one notification; raise WireError with the reason on anything malformed."""
    if not isinstance(data, bytes | bytearray | memoryview):
        raise WireError(f"notification is {type(data).__name__}, not bytes")
    data = bytes(data)
    if len(data) > MAX_MESSAGE_BYTES:
        raise WireError(f"notification of {len(data)} bytes exceeds {MAX_MESSAGE_BYTES}")
    for prefix, decoder in _decoders.items():
        if data.startswith(prefix):
            try:
                msg: Message = decoder.decode(data[len(prefix) :])
            except (msgspec.DecodeError, msgspec.ValidationError) as e:
                raise WireError(f"bad {prefix.decode()[:-1]}: {e}") from None
            if isinstance(msg, PushReg):
                _check_reg(msg)
            return msg
    m = _COMPLETION_RE.match(data)
    if m is None:
        raise WireError(f"unknown notification {data[:40]!r}")
    tp_size = int(m.group(2))
    if tp_size > MAX_TP:
        raise WireError(f"completion tp_size {tp_size} exceeds {MAX_TP}")
    return Completion(m.group(1).decode(), tp_size)


def _check_reg(reg: PushReg) -> None:
    total = sum(len(g) for g in reg.local_block_ids)
    if total == 0:
        raise WireError("PUSH_REG carries no block ids")
    if total > MAX_BLOCKS_PER_GROUP:
        raise WireError(f"PUSH_REG carries {total} block ids, more than {MAX_BLOCKS_PER_GROUP}")
    if reg.decode_tp_rank >= reg.decode_tp_size:
        raise WireError(f"decode_tp_rank {reg.decode_tp_rank} >= tp size {reg.decode_tp_size}")
    for group in reg.local_block_ids:
        if len(set(group)) != len(group):
            raise WireError("PUSH_REG holds duplicate block ids")
