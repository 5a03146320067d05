"""Hostile notifications for the fuzzer: malformed, mistyped, oversized and lying ones.

``Generator.next()`` returns (category, destination "P"/"D", sender name, bytes).
Every registration it makes is invalid in at least one way (an id out of D's range,
negative or duplicate ids, more blocks or groups than P holds, a bad TP rank, an
address that is not D's, a missing or mistyped field), or, when bit-flipped, comes
from a sender that is not D; so none may lead to a WRITE, whatever P has staged.
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import msgspec

from kvpush.core import wire

PREFIXES = sorted(v for k, v in vars(wire).items() if k.endswith("_PREFIX"))
REG_FIELDS = [
    "request_id",
    "decode_engine_id",
    "decode_host",
    "decode_port",
    "decode_tp_size",
    "local_block_ids",
    "remote_engine_id",
    "remote_host",
    "remote_port",
    "remote_tp_size",
]


@dataclass
class World:
    """What the generator knows of the live target: names, ports, ids in use."""

    p_agent: str
    d_agent: str
    p_port: int
    d_port: int
    d_blocks: int
    p_blocks_per_request: int
    staged_tids: list[str]
    recv_tids: list[str]
    staged_rids: list[str] = field(default_factory=list)
    recv_rids: list[str] = field(default_factory=list)


class Generator:
    def __init__(self, world: World, rng: random.Random) -> None:
        self.w = world
        self.rng = rng
        self._enc = msgspec.msgpack.Encoder()
        self._big: list[tuple[str, str, bytes]] = []
        self.breaks: Counter[str] = Counter()  # how registrations were broken
        self._kinds = [
            (self.random_bytes, 8),
            (self.prefix_random, 8),
            (self.prefix_junk, 12),
            (self.registration, 30),
            (self.structured, 15),
            (self.completion, 10),
            (self.unknown_prefix, 4),
            (self.corrupted, 8),
        ]
        self._weights = [w for _, w in self._kinds]

    def next(self) -> tuple[str, str, str, bytes]:
        if self.rng.random() < 1 / 4000:
            return self.big()
        fn = self.rng.choices([f for f, _ in self._kinds], self._weights)[0]
        cat, dest, raw = fn()
        if cat == "corrupted_valid" and dest == "P":
            # A flipped bit can mend a broken registration: such bytes come from a stranger,
            # so that P's sender check, not luck, keeps them from being written.
            return cat, dest, f"agent-{self.rng.getrandbits(24):x}", raw
        return cat, dest, self.sender(dest), raw

    # ---- pieces ------------------------------------------------------------------------

    def sender(self, dest: str) -> str:
        r = self.rng.random()
        peer = self.w.d_agent if dest == "P" else self.w.p_agent
        if r < 0.6:
            return peer
        if r < 0.95:
            return f"agent-{self.rng.getrandbits(24):x}"
        return self.text(64)

    def text(self, n: int = 40) -> str:
        r = self.rng.random()
        k = self.rng.randint(0, n)
        if r < 0.5:
            return "".join(self.rng.choice("abcdef0123456789-_:~") for _ in range(k))
        if r < 0.8:
            return "".join(chr(self.rng.randint(0, 0x2FF)) for _ in range(k))
        return self.rng.choice(["", ":", "PUSH_REG:", " ", "a" * 513, "\x00", "x:1"])

    def integer(self) -> int:
        return self.rng.choice(
            [
                0,
                -1,
                1,
                self.rng.randint(-(2**63), 2**64 - 1),
                self.rng.randint(-1000, 70000),
                2**31,
                2**31 - 1,
                65536,
                1025,
            ]
        )

    def value(self, depth: int = 0) -> Any:
        r = self.rng.random()
        if depth > 3 or r < 0.3:
            return self.rng.choice(
                [self.integer(), self.text(), None, True, 1.5, float("nan"), b"\xff\x00"]
            )
        if r < 0.65:
            return [self.value(depth + 1) for _ in range(self.rng.randint(0, 6))]
        return {self.text(12): self.value(depth + 1) for _ in range(self.rng.randint(0, 6))}

    def pack(self, obj: Any) -> bytes:
        try:
            return self._enc.encode(obj)
        except (TypeError, OverflowError, ValueError):
            return b"\xc1"  # never valid msgpack

    # ---- categories ----------------------------------------------------------------------

    def random_bytes(self) -> tuple[str, str, bytes]:
        n = self.rng.choice([0, 1, 8, 64, self.rng.randint(0, 2048)])
        return "random_bytes", self.rng.choice("PD"), self.rng.randbytes(n)

    def prefix_random(self) -> tuple[str, str, bytes]:
        raw = self.rng.choice(PREFIXES) + self.rng.randbytes(self.rng.randint(0, 256))
        return "prefix_random", self.rng.choice("PD"), raw

    def prefix_junk(self) -> tuple[str, str, bytes]:
        raw = self.rng.choice(PREFIXES) + self.pack(self.value())
        return "prefix_msgpack_junk", self.rng.choice("PD"), raw

    def unknown_prefix(self) -> tuple[str, str, bytes]:
        pre = self.rng.choice([b"PUSH_XYZ:", b"push_reg:", b"PUSH_REG", b"PUSH:", b"PUSH_REG;"])
        return "unknown_prefix", self.rng.choice("PD"), pre + self.pack(self.value())

    def corrupted(self) -> tuple[str, str, bytes]:
        _, dest, raw = self.registration() if self.rng.random() < 0.5 else self.structured()
        data = bytearray(raw)
        if self.rng.random() < 0.5 and len(data) > 1:
            del data[self.rng.randint(1, len(data) - 1) :]
        for _ in range(self.rng.randint(1, 4)):
            if data:
                data[self.rng.randrange(len(data))] ^= 1 << self.rng.randrange(8)
        return "corrupted_valid", dest, bytes(data)

    def completion(self) -> tuple[str, str, bytes]:
        rid = self.rng.choice([self.text(), *self.w.recv_rids[:4], "x" * 600, "a:b"])
        tp = self.rng.choice(["1", "0", "2", "1024", "1025", "9999", "-1", "x", ""])
        return "completion", "D", f"{rid}:{tp}".encode(errors="replace")

    def structured(self) -> tuple[str, str, bytes]:
        """FAIL / CANCEL / HB / STAGED with live ids and field-level mutations."""
        w, rng = self.w, self.rng
        rid = rng.choice([self.text(), *w.recv_rids[:4], *w.staged_rids[:4]])
        tid = rng.choice([None, self.text(), *w.recv_tids[:4], *w.staged_tids[:4]])
        kind = rng.choice(["FAIL", "CANCEL", "HB", "STAGED"])
        if kind == "FAIL":
            msg: dict[str, Any] = dict(request_id=rid, reason=self.text(), transfer_id=tid)
            msg["tp_rank"] = self.integer()
            prefix, dest = wire.FAIL_PREFIX, "D"
        elif kind == "CANCEL":
            msg, prefix, dest = dict(request_id=rid, transfer_id=tid), wire.CANCEL_PREFIX, "P"
        elif kind == "HB":
            n = rng.choice([0, 1, 5, rng.randint(0, 300)])
            entries: list[Any] = [[rng.choice([rid, self.text()]), tid] for _ in range(n)]
            if entries and rng.random() < 0.3:
                entries[0] = rng.choice([[rid], [rid, tid, 1], {}, 5, [None, None]])
            msg, prefix, dest = {"entries": entries}, wire.HB_PREFIX, rng.choice("PD")
        else:
            msg = dict(request_id=rid, tp_size=self.integer())
            prefix, dest = getattr(wire, "STAGED_PREFIX", wire.FAIL_PREFIX), "D"
        if rng.random() < 0.3:
            key = rng.choice([*msg, self.text(8)])
            msg[key] = self.value()
        return f"structured_{kind.lower()}", dest, prefix + self.pack(msg)

    def registration(self) -> tuple[str, str, bytes]:
        """A PUSH_REG that could match staged blocks, broken in 1-3 ways."""
        w, rng = self.w, self.rng
        n = w.p_blocks_per_request
        tid = rng.choice([None, self.text(), *w.staged_tids, *w.recv_tids[:2]])
        rid = rng.choice([*w.staged_rids, *w.recv_rids[:2], self.text()]) if w.staged_rids else "r"
        reg: dict[str, Any] = dict(
            request_id=rid or "r",
            decode_engine_id="fuzzD",
            decode_host="127.0.0.1",
            decode_port=w.d_port,
            decode_tp_size=1,
            local_block_ids=[rng.sample(range(w.d_blocks), rng.randint(1, n))],
            remote_engine_id="fuzzP",
            remote_host="127.0.0.1",
            remote_port=w.p_port,
            remote_tp_size=1,
            transfer_id=tid,
            decode_tp_rank=0,
        )
        if rng.random() < 0.2:  # harmless oddities
            reg[self.text(8) or "extra"] = self.value()
        breaks = rng.sample(sorted(BREAKS), rng.randint(1, 3))
        for b in sorted(breaks, key=lambda b: b in ("missing", "mistyped")):  # those last
            BREAKS[b](self, reg)
        for b in breaks:
            self.breaks[b] += 1
        return "registration", "P", wire.REG_PREFIX + self.pack(reg)

    def big(self) -> tuple[str, str, str, bytes]:
        """Rare: oversized messages and lists at or past their bounds (made once, reused)."""
        if not self._big:
            ids = list(range(700_000))  # in bounds, about 3.4 MB of msgpack
            base = dict(
                request_id="big",
                decode_engine_id="fuzzD",
                decode_host="127.0.0.1",
                decode_port=self.w.d_port,
                decode_tp_size=1,
                remote_engine_id="fuzzP",
                remote_host="127.0.0.1",
                remote_port=self.w.p_port,
                remote_tp_size=1,
                transfer_id=self.w.staged_tids[0],
            )
            regs = [
                [[0] * (wire.MAX_BLOCKS_PER_GROUP + 1)],
                [ids],  # far more blocks than P holds
                [[1]] * (wire.MAX_GROUPS + 1),
            ]
            hb = [["r", None]] * wire.MAX_HB_ENTRIES
            self._big = [
                ("oversized", "P", wire.REG_PREFIX + b"\x00" * wire.MAX_MESSAGE_BYTES),
                ("oversized", "D", b"x" * (wire.MAX_MESSAGE_BYTES + 1)),
                *[
                    ("huge_list", "P", wire.REG_PREFIX + self.pack({**base, "local_block_ids": g}))
                    for g in regs
                ],
                ("huge_list", "D", wire.HB_PREFIX + self.pack({"entries": hb})),
                ("huge_list", "P", wire.HB_PREFIX + self.pack({"entries": hb + [["r", None]]})),
            ]
        cat, dest, raw = self.rng.choice(self._big)
        return cat, dest, self.w.d_agent if dest == "P" else self.w.p_agent, raw


def _ids(reg: dict[str, Any]) -> list[int]:
    """The first group's ids, or a fresh in-range pair if an earlier break removed them."""
    groups = reg.get("local_block_ids")
    if isinstance(groups, list) and groups and isinstance(groups[0], list) and groups[0]:
        return list(groups[0])
    return [0, 1]


def _out_of_range(g: Generator, reg: dict[str, Any]) -> None:
    ids = _ids(reg)
    ids[g.rng.randrange(len(ids))] = g.rng.choice(
        [g.w.d_blocks, g.rng.randint(g.w.d_blocks, wire.MAX_BLOCK_ID), wire.MAX_BLOCK_ID + 1, 2**63]
    )
    reg["local_block_ids"] = [ids]


def _negative(g: Generator, reg: dict[str, Any]) -> None:
    ids = _ids(reg)
    ids[g.rng.randrange(len(ids))] = g.rng.choice([-1, -(2**31), -(2**63)])
    reg["local_block_ids"] = [ids]


def _duplicate(g: Generator, reg: dict[str, Any]) -> None:
    ids = _ids(reg)
    reg["local_block_ids"] = [ids + [g.rng.choice(ids)]]


def _too_many_blocks(g: Generator, reg: dict[str, Any]) -> None:
    k = g.rng.randint(g.w.p_blocks_per_request + 1, g.w.d_blocks)
    reg["local_block_ids"] = [g.rng.sample(range(g.w.d_blocks), k)]


def _groups(g: Generator, reg: dict[str, Any]) -> None:
    ids = _ids(reg)
    reg["local_block_ids"] = g.rng.choice([[], [[]], [ids, ids], [ids, []], [[], ids]])


def _tp_rank(g: Generator, reg: dict[str, Any]) -> None:
    reg["decode_tp_size"] = g.rng.randint(1, 4)
    reg["decode_tp_rank"] = g.rng.choice([reg["decode_tp_size"], 1024, -1])


def _foreign_address(g: Generator, reg: dict[str, Any]) -> None:
    port = g.rng.choice([1, 65535, g.w.d_port + 1, g.w.d_port - 1])
    if port == g.w.p_port:
        port = 0  # invalid too
    if g.rng.random() < 0.5:
        reg["decode_port"] = port
    else:
        reg["decode_host"] = g.rng.choice(["10.0.0.1", "localhost.invalid", "", "::1"])


def _missing(g: Generator, reg: dict[str, Any]) -> None:
    reg.pop(g.rng.choice(REG_FIELDS), None)


def _mistyped(g: Generator, reg: dict[str, Any]) -> None:
    key = g.rng.choice([k for k in REG_FIELDS if k in reg])
    good = type(reg[key])
    bad = g.value()
    while type(bad) is good or (good is int and isinstance(bad, bool)):
        bad = g.rng.choice([None, "x", 1.5, [1], {"a": 1}])
    reg[key] = bad


BREAKS = {
    "out_of_range": _out_of_range,
    "negative": _negative,
    "duplicate": _duplicate,
    "too_many_blocks": _too_many_blocks,
    "groups": _groups,
    "tp_rank": _tp_rank,
    "foreign_address": _foreign_address,
    "missing": _missing,
    "mistyped": _mistyped,
}
