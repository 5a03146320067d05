"""The vLLM connector's parts of the layer-wise push: which prompts go layer by layer and
what each step computes of them (vllm/layer_plan.py), and the worker side's feeds, filled
per layer and closed at the forward's end (vllm/layer_feeds.py)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from kvpush.core.types import LayerChunk, StagedBlocks, StepMeta, WorkerOutput
from kvpush.vllm.config import ConnectorOptions
from kvpush.vllm.layer_feeds import LayerFeeds
from kvpush.vllm.scheduler_side import SchedulerSide
from kvpush.vllm.worker_side import WorkerSide
from tests.unit.test_vllm_adapter import FakeRequest, NewReq

PARAMS = {"do_remote_decode": True, "transfer_id": "t"}


@dataclass
class Cached:  # the fields of vLLM's CachedRequestData the plan reads
    req_ids: list[str]
    new_block_ids: list[tuple[list[int], ...] | None]
    num_computed_tokens: list[int]
    resumed_req_ids: set[str] = field(default_factory=set)


@dataclass
class Out:
    scheduled_new_reqs: list[NewReq]
    num_scheduled_tokens: dict[str, int]
    scheduled_cached_reqs: Cached | None = None


def prefiller(min_tokens: int = 200) -> SchedulerSide:
    opts = ConnectorOptions.parse({"layerwise_min_tokens": min_tokens}, env={})
    return SchedulerSide("P", opts, True, False, 1, block_size=128)


def test_long_one_token_prompts_go_layer_by_layer_from_their_first_chunk() -> None:
    p = prefiller()
    reqs = {
        "long": FakeRequest("long", dict(PARAMS)),  # 300 tokens, in two chunks
        "short": FakeRequest("short", dict(PARAMS), prompt_token_ids=list(range(100))),
        "many": FakeRequest("many", dict(PARAMS), max_tokens=4),  # runs on: not layer-wise
    }
    for r in reqs.values():
        p.update_state_after_alloc(r, ([1],), 0, block_size=128)
    meta = p.build_meta(
        Out(
            [NewReq("long", ([1, 2],)), NewReq("short", ([3],)), NewReq("many", ([4, 5, 6],))],
            {"long": 200, "short": 100, "many": 300},
        )
    )
    # Chunk 1 fills block 1 and half of block 2: block 2 goes with chunk 2.
    assert meta.layered == [LayerChunk("long", "t", [[1, 2]], [0], [3], False, upto=[1])]
    assert [s.request_id for s in meta.early] == ["short"]  # whole, at the forward's end
    assert p.sched.handed_over("long")
    # Chunk 2: its first block is the one chunk 1 left half full (tokens 128-255).
    meta = p.build_meta(Out([], {"long": 100}, Cached(["long"], [([7],)], [200])))
    assert meta.layered == [LayerChunk("long", "t", [[1, 2, 7]], [1], [3], True)]
    assert p.request_finished(reqs["long"], [1, 2, 7])[0]  # held: its push may be reading
    assert p.build_meta(Out([], {})).confirmed == ["long"]


def test_a_prompt_preempted_or_finished_midway_fails_its_push() -> None:
    p = prefiller()
    for rid in ("a", "b"):
        p.update_state_after_alloc(FakeRequest(rid, dict(PARAMS)), ([1],), 0, block_size=128)
    p.build_meta(Out([NewReq("a", ([1],)), NewReq("b", ([2],))], {"a": 128, "b": 128}))
    meta = p.build_meta(Out([], {"a": 128}, Cached(["a"], [([3],)], [0], {"a"})))
    assert [(c.request_id, bool(c.failed)) for c in meta.layered] == [("a", True)]
    p.request_finished(FakeRequest("b", dict(PARAMS), status="FINISHED_ABORTED"), [2])
    meta = p.build_meta(Out([], {}))
    assert [(c.request_id, c.failed) for c in meta.layered] == [
        ("b", "finished before its prompt was computed")
    ]


def test_off_by_default() -> None:
    p = SchedulerSide("P", ConnectorOptions.parse({}, env={}), True, False, 1)
    p.update_state_after_alloc(FakeRequest("r", dict(PARAMS)), ([1],), 0, block_size=16)
    meta = p.build_meta(Out([NewReq("r", ([1] * 19,))], {"r": 300}))
    assert not meta.layered and [s.request_id for s in meta.early] == ["r"]


def test_feeds_get_one_piece_per_layer_and_close_with_the_last_chunk() -> None:
    feeds = LayerFeeds(["l0", "l1", "l2"])
    chunk1 = LayerChunk("r", "t", [[5, 6]], [0], [3], False, upto=[1])  # 6: part-filled
    staged, whole = feeds.start([chunk1])
    assert [s.request_id for s in staged] == ["r"] and not whole
    feed = staged[0].feed
    assert feed is not None
    for name in ("l0", "l1"):
        feeds.saved(name)
    assert feeds.end_step() == 1  # l2 unreported (a CUDA graph, say): added at the end
    assert [(p.layer, p.ids, p.first) for p in feed.pieces] == [
        ("l0", [[5]], [0]),
        ("l1", [[5]], [0]),
        ("l2", [[5]], [0]),
    ]
    assert not feed.closed
    staged, _ = feeds.start([LayerChunk("r", "t", [[5, 6, 9]], [1], [3], True)])
    assert staged == []  # already handed over
    for name in ("l0", "l1", "l2"):
        feeds.saved(name)
    feeds.end_step()
    assert feed.closed and not feed.failed and feed.blocks() == [[5, 6, 9]]
    assert [p.ids for p in feed.pieces[3:]] == [[[6, 9]]] * 3
    feeds.saved("l0")  # a later forward without layer-wise prompts: nothing to note
    assert len(feed.pieces) == 6


def test_with_the_copy_hook_prompts_go_whole_at_their_last_step() -> None:
    feeds = LayerFeeds(["l0"], whole=True)
    assert feeds.start([LayerChunk("r", "t", [[5]], [0], [2], False)]) == ([], [])
    staged, whole = feeds.start([LayerChunk("r", "t", [[5, 6]], [0], [2], True)])
    assert staged == [] and whole == [StagedBlocks("r", [[5, 6]], "t")]


def test_worker_side_hands_layered_prompts_over_before_the_forward() -> None:
    handed: list[list[tuple[str, bool]]] = []

    class FakeWorker:
        stats: Counter[str] = Counter()

        def start_step(self, meta: StepMeta) -> None:
            pass

        def hand_over(self, early: list[StagedBlocks]) -> None:
            if early:
                handed.append([(s.request_id, s.feed is not None) for s in early])

        def get_finished(self) -> WorkerOutput:
            return WorkerOutput()

    side = WorkerSide("P", ConnectorOptions.parse({}, env={}), 0, 1)
    side.worker = FakeWorker()  # type: ignore[assignment]
    side.layers = LayerFeeds(["l0"])
    side.start_step(StepMeta(layered=[LayerChunk("r", "t", [[1]], [0], [1], True)]))
    assert handed == [[("r", True)]]  # before the forward
    feed = side.layers.feeds["r"]
    side.layers.saved("l0")
    side.hand_over()  # wait_for_save
    assert feed.closed and len(feed.pieces) == 1
    assert FakeWorker.stats["layers_unreported"] == 0
