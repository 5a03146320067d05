"""P's worker side of the layer-wise push: a ``LayerFeed`` per prompt pushed layer by
layer, filled from vLLM's per-layer call as the forward runs.

``start`` (the step's metadata, before the forward) opens the feeds of prompts that
start in this step and hands them to the worker; ``saved`` (vLLM's ``save_kv_layer``,
right after a layer's attention wrote its KV) appends that layer's piece to every feed of
the step, and does nothing else: the WRITEs are posted by the next tick (the engine's
next call, or the keeper meanwhile). ``end_step`` (``wait_for_save``) adds the layers the
forward did not report (a CUDA graph has no per-layer calls: they go at its end) and
closes the feeds whose prompt is complete.
"""

from __future__ import annotations

import logging
from typing import Any

from kvpush.core import trace
from kvpush.core.layers import LayerFeed, Piece
from kvpush.core.types import LayerChunk, StagedBlocks

log = logging.getLogger(__name__)


class LayerFeeds:
    def __init__(self, layers: list[str] | None = None, cuda: bool = False, whole: bool = False):
        self.layers = layers or []  # every attention layer of this worker, in cache order
        self.cuda = cuda  # KV in GPU memory: a piece follows an event on the forward's stream
        self.whole = whole  # (peer-copy hook) such prompts are handed over whole
        self.feeds: dict[str, LayerFeed] = {}  # open, by request id
        # This step's chunks, each with its feed and the blocks it writes (one list for
        # all of its layers' pieces).
        self.current: list[tuple[LayerChunk, LayerFeed, list[list[int]]]] = []
        self._seen: set[str] = set()  # layers reported in this step

    def start(self, chunks: list[LayerChunk]) -> tuple[list[StagedBlocks], list[StagedBlocks]]:
        """This step's chunks: (prompts to hand over now, with their feed; prompts to hand
        over whole at the end of this forward)."""
        staged: list[StagedBlocks] = []
        whole: list[StagedBlocks] = []
        for c in chunks:
            if self.whole:
                if c.last and not c.failed:
                    whole.append(
                        StagedBlocks(c.request_id, c.block_ids, c.transfer_id, prompt=c.prompt)
                    )
                continue
            feed = self.feeds.get(c.request_id)
            if feed is None:
                if c.failed:
                    continue  # never handed over
                feed = self.feeds[c.request_id] = LayerFeed(list(c.total))
                staged.append(
                    StagedBlocks(
                        c.request_id, c.block_ids, c.transfer_id, feed=feed, prompt=c.prompt
                    )
                )
            if c.failed:
                del self.feeds[c.request_id]
                feed.close(c.failed)
                continue
            upto = c.upto or [len(ids) for ids in c.block_ids]
            written = [ids[f:u] for ids, f, u in zip(c.block_ids, c.first, upto, strict=True)]
            self.current.append((c, feed, written))
        return staged, whole

    def saved(self, layer: str) -> None:
        """One layer's KV of this step is written (queued, on a GPU)."""
        after = forward_event(self.cuda)
        self._seen.add(layer)
        for c, feed, written in self.current:
            feed.add(Piece(layer, written, c.first, after))
            if trace.ON:
                trace.mark("p_worker.layer", c.transfer_id, c.request_id, len(feed.pieces))

    def end_step(self) -> int:
        """The forward ended (its writes queued): the layers it did not report, then the
        feeds of prompts complete with this step are closed. Returns how many layers
        the forward did not report."""
        missing = [n for n in self.layers if n not in self._seen]
        self._seen = set()
        current, self.current = self.current, []
        if missing:
            after = forward_event(self.cuda)
            for c, feed, written in current:
                for name in missing:
                    feed.add(Piece(name, written, c.first, after))
        for c, feed, _ in current:
            if c.last:
                self.feeds.pop(c.request_id, None)
                feed.close()
        return len(missing)


def forward_event(cuda: bool) -> Any:
    """An event recorded now on the current stream (the forward's): the bytes its work
    queued so far are final once it is done. None on the CPU, where a write is done when
    its call returns."""
    if not cuda:
        return None
    import torch

    after = torch.cuda.Event()
    after.record()
    return after
