"""What a prefill's forward has written so far, for a request pushed layer by layer.

The engine's thread appends one ``Piece`` per (step, layer) as each attention layer's
KV is written (vLLM's ``save_kv_layer``) and closes the feed once the last chunk's
forward ends; the ticking thread (the engine's next call, or the keeper meanwhile)
reads it and posts the pieces that are ready (core/layer_route.py). Appends and the
close are single attribute writes, so the reader needs no lock: it reads ``closed``
before the pieces, and a closed feed gets no more of them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class Piece:
    """One layer's KV written by one step: P's blocks ``ids`` (per group), the first of
    which is block ``first`` of the request's (a chunk starts inside a block that the
    previous chunk left half full: that block is sent again, with all its tokens)."""

    layer: str
    ids: list[list[int]]
    first: list[int]
    after: Any = None  # device event the bytes are final after (None: final already)

    def ready(self) -> bool:
        if self.after is None:
            return True
        if not self.after.query():
            return False
        self.after = None
        return True


@dataclass
class LayerFeed:
    """The pieces of one request, in the order the forward wrote them."""

    total: list[int]  # the request's block count per group once its prompt is computed
    pieces: list[Piece] = field(default_factory=list)
    closed: bool = False  # the last chunk's forward ended: no more pieces
    failed: str = ""  # the engine gave the blocks up (preempted): why

    def add(self, piece: Piece) -> None:
        self.pieces.append(piece)

    def close(self, failed: str = "") -> None:
        self.failed = failed
        self.closed = True

    def blocks(self) -> list[list[int]]:
        """The request's blocks per group, as far as the pieces name them."""
        out: list[list[int]] = [[0] * n for n in self.total]
        for p in self.pieces:
            for g, (ids, first) in enumerate(zip(p.ids, p.first, strict=True)):
                out[g][first : first + len(ids)] = ids
        return out
