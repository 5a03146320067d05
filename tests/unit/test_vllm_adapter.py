"""The vLLM adapter's pure parts: options and the scheduler-side request mapping."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from kvpush.core.errors import ConfigError, LayoutError
from kvpush.vllm.config import ConnectorOptions
from kvpush.vllm.scheduler_side import SchedulerSide


def test_options_defaults_env_and_validation() -> None:
    o = ConnectorOptions.parse({}, env={})
    assert o.side_channel_port == 5600 and o.trusted is None and o.secret is None
    assert o.lane_slots == 1 << 16
    assert ConnectorOptions.parse({"lane_slots": 0}, env={}).lane_slots == 0
    o = ConnectorOptions.parse(
        {"side_channel_port": "5701", "trusted_decoders": ["10.0.0.2:5800", "h:5801"]},
        env={"KVPUSH_SHARED_SECRET": "abc", "KVPUSH_SIDE_CHANNEL_HOST": "0.0.0.0"},
    )
    assert o.side_channel_port == 5701 and o.side_channel_host == "0.0.0.0"
    assert o.trusted == frozenset({"10.0.0.2:5800", "h:5801"}) and o.secret == b"abc"
    for bad, why in [
        ({"nope": 1}, "unknown kvpush option"),
        ({"writer": "thread"}, "unknown kvpush option"),  # removed options are refused
        ({"lease_s": "soon"}, "is not a float"),
        ({"side_channel_port": 70000}, "out of range"),
        ({"watchdog_s": 0}, "must be > 0"),
        ({"peer_copy": "maybe"}, "peer_copy"),
        ({"lane_slots": -1}, "lane_slots"),
        ({"trusted_decoders": "no-port"}, "not host:port"),
        ({"shared_secret": "x"}, "unknown kvpush option"),  # secrets come from the environment
    ]:
        with pytest.raises(ConfigError, match=why):
            ConnectorOptions.parse(bad, env={})


def test_peer_copy_is_off_for_cpu_caches_and_on_demands_cuda() -> None:
    import torch  # installed with vLLM

    from kvpush.gpu.peer_copy import make_peer_copy

    caches = [torch.zeros(4, 16), [torch.zeros(4, 16)]]
    assert make_peer_copy("auto", caches) is None
    assert make_peer_copy("off", caches) is None
    with pytest.raises(LayoutError, match="CUDA"):
        make_peer_copy("on", caches)


@dataclass
class FakeRequest:
    request_id: str
    kv_transfer_params: dict[str, Any] | None
    prompt_token_ids: list[int] = field(default_factory=lambda: list(range(300)))
    status: str = "FINISHED_LENGTH_CAPPED"
    max_tokens: int = 1


def sides() -> tuple[SchedulerSide, SchedulerSide]:
    opts = ConnectorOptions.parse({}, env={})
    return SchedulerSide("P", opts, True, False, 1), SchedulerSide("D", opts, False, True, 1)


def test_decoder_registers_the_blocks_of_external_tokens_once() -> None:
    _, d = sides()
    params = {
        "do_remote_prefill": True,
        "transfer_id": "t1",
        "remote_host": "127.0.0.1",
        "remote_port": 5700,
        "remote_tp_size": 1,
    }
    req = FakeRequest("cmpl-x-0-abcdef12", params)
    assert d.get_num_new_matched_tokens(req, 0) == (300, True)
    d.update_state_after_alloc(req, ([7, 8, 9],), 300, block_size=128)
    meta = d.sched.build_meta()
    (reg,) = meta.registrations
    assert reg.block_ids == [[7, 8, 9]] and reg.transfer_id == "t1" and reg.remote_port == 5700
    # The engine calls it again once the KV arrived: nothing new.
    d.update_state_after_alloc(req, ([7, 8, 9],), 0, block_size=128)
    assert d.get_num_new_matched_tokens(req, 0) == (0, False)
    assert not d.sched.build_meta().registrations


def test_decoder_rejects_params_without_side_channel() -> None:
    _, d = sides()
    req = FakeRequest("r1", {"do_remote_prefill": True})
    d.update_state_after_alloc(req, ([1],), 10, block_size=128)
    assert "side channel" in d.sched.build_meta().rejected["r1"]


def test_prefiller_holds_blocks_and_returns_its_coordinates() -> None:
    p, _ = sides()
    req = FakeRequest("r1", {"do_remote_decode": True, "transfer_id": "t1"})
    held, params = p.request_finished(req, [4, 5])
    assert held and params is not None and params["transfer_id"] == "t1"
    assert params["remote_port"] == 5600 and params["do_remote_prefill"] is True
    assert p.sched.build_meta().finished[0].block_ids == [[4, 5]]
    p.update({"r1"}, set(), None)
    assert not p.sched.has_pending_push_work()
    aborted = FakeRequest("r2", {"do_remote_decode": True}, status="FINISHED_ABORTED")
    assert p.request_finished(aborted, [1]) == (False, None)


def test_decoder_abort_keeps_blocks_until_released() -> None:
    _, d = sides()
    params = {"do_remote_prefill": True, "remote_host": "h", "remote_port": 1}
    req = FakeRequest("r1", params)
    d.update_state_after_alloc(req, ([3],), 100, block_size=128)
    d.sched.build_meta()
    assert d.request_finished(req, [3]) == (True, None)
    assert d.sched.build_meta().cancels == ["r1"]

    @dataclass
    class Meta:
        released: set[str]

    d.update(set(), {"r1"}, Meta({"r1"}))
    assert not d.sched.has_pending_push_work()


def test_decoder_abort_before_allocation_withdraws_once() -> None:
    _, d = sides()
    params = {"do_remote_prefill": True, "transfer_id": "t1", "remote_host": "h", "remote_port": 9}
    req = FakeRequest("cmpl-x-0-abcdef12", params)
    assert d.request_finished(req, []) == (False, None)  # it holds no blocks
    assert d.sched.has_pending_push_work()  # an idle engine steps once more to send it
    meta = d.sched.build_meta()
    (w,) = meta.withdrawn
    assert (w.transfer_id, w.remote_host, w.remote_port, w.block_ids) == ("t1", "h", 9, [])
    assert not meta.cancels and not meta.registrations
    assert d.request_finished(req, []) == (False, None)
    assert not d.sched.build_meta().withdrawn and not d.sched.has_pending_push_work()
    # Without a side channel there is no one to tell.
    assert d.request_finished(FakeRequest("r2", {"do_remote_prefill": True}), []) == (False, None)
    assert not d.sched.build_meta().withdrawn


@dataclass
class NewReq:  # the fields of vLLM's NewRequestData the scheduler side reads
    req_id: str
    block_ids: tuple[list[int], ...]
    num_computed_tokens: int = 0


@dataclass
class SchedOut:
    scheduled_new_reqs: list[NewReq]
    num_scheduled_tokens: dict[str, int]


def test_prefiller_hands_over_prefills_this_step_completes() -> None:
    p, _ = sides()
    params = {"do_remote_decode": True, "transfer_id": "t"}
    reqs = {
        "whole": FakeRequest("whole", dict(params)),
        "cached": FakeRequest("cached", dict(params)),  # a prefix from P's cache
        "chunk": FakeRequest("chunk", dict(params)),  # chunked: more to come
        "long": FakeRequest("long", dict(params), max_tokens=8),  # runs on: preemptible
        "local": FakeRequest("local", None),  # not disaggregated
    }
    for r in reqs.values():
        p.update_state_after_alloc(r, ([1, 2, 3],), 0, block_size=128)
    out = SchedOut(
        [
            NewReq("whole", ([1, 2, 3],)),
            NewReq("cached", ([4, 5, 6],), num_computed_tokens=256),
            NewReq("chunk", ([7],)),
            NewReq("long", ([8, 9, 10],)),
            NewReq("local", ([11, 12, 13],)),
        ],
        {"whole": 300, "cached": 44, "chunk": 128, "long": 300, "local": 300},
    )
    meta = p.build_meta(out)
    assert [(s.request_id, s.block_ids) for s in meta.early] == [
        ("whole", [[1, 2, 3]]),
        ("cached", [[4, 5, 6]]),
    ]
    assert meta.early[0].transfer_id == "t" and not meta.finished
    # Finished by vLLM later: held whatever it ended as, and confirmed to the workers.
    assert p.request_finished(reqs["whole"], [1, 2, 3])[1] is not None
    reqs["cached"].status = "FINISHED_ABORTED"
    assert p.request_finished(reqs["cached"], [4, 5, 6]) == (True, None)
    meta = p.build_meta(SchedOut([], {}))
    assert meta.confirmed == ["whole", "cached"] and not meta.finished and not meta.early
    p.update({"whole", "cached"}, set(), None)
    assert not p.sched.has_pending_push_work()


def test_worker_side_hands_over_at_the_forward_end_or_at_the_latest_at_the_next_step() -> None:
    from kvpush.core.types import StagedBlocks, StepMeta, WorkerOutput
    from kvpush.vllm.worker_side import WorkerSide

    handed: list[list[str]] = []

    class FakeWorker:
        def start_step(self, meta: StepMeta) -> None:
            pass

        def hand_over(self, early: list[StagedBlocks]) -> None:
            handed.append([s.request_id for s in early])
            assert all(s.after is None for s in early)  # CPU caches: the bytes are final

        def get_finished(self) -> WorkerOutput:
            return WorkerOutput()

    side = WorkerSide("P", ConnectorOptions.parse({}, env={}), 0, 1)
    side.worker = FakeWorker()  # type: ignore[assignment]
    meta = StepMeta(early=[StagedBlocks("r1", [[1]])])
    side.start_step(meta)
    assert handed == []  # not before the forward ended
    side.hand_over()  # wait_for_save
    side.hand_over()
    assert handed == [["r1"]]
    side.start_step(StepMeta(early=[StagedBlocks("r2", [[2]])]))
    side.collect()  # vLLM may defer wait_for_save past this (a draft model's forward)
    assert handed == [["r1"]]
    side.start_step(StepMeta())  # ... but it never came: handed over now, once
    side.hand_over()
    assert handed == [["r1"], ["r2"]]


def test_empty_steps_give_the_core_away_after_a_short_spin(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM steps flat out while a push is pending; past IDLE_SPIN_S of empty steps each
    one sleeps (behind vllm-router a spinning D kept P off their shared core for 30 s)."""
    from kvpush.core.types import StepMeta, WorkerOutput
    from kvpush.vllm import worker_side
    from kvpush.vllm.worker_side import IDLE_SLEEP_S, IDLE_SPIN_S, WorkerSide

    now = [100.0]
    slept: list[float] = []
    monkeypatch.setattr(worker_side.time, "monotonic", lambda: now[0])
    monkeypatch.setattr(worker_side.time, "sleep", slept.append)
    results = [WorkerOutput()]

    class FakeWorker:
        def start_step(self, meta: StepMeta) -> None:
            pass

        def get_finished(self) -> WorkerOutput:
            return results.pop() if results else WorkerOutput()

    side = WorkerSide("D", ConnectorOptions.parse({}, env={}), 0, 1)
    side.worker = FakeWorker()  # type: ignore[assignment]

    def step(idle: bool, dt: float = 0.001) -> None:
        now[0] += dt
        side.start_step(StepMeta(), idle=idle)
        side.collect()

    for _ in range(4):  # the first IDLE_SPIN_S of empty steps: flat out
        step(idle=True)
    assert slept == []
    step(idle=True, dt=2 * IDLE_SPIN_S)
    step(idle=True)
    assert slept == [IDLE_SLEEP_S, IDLE_SLEEP_S]
    step(idle=False, dt=2 * IDLE_SPIN_S)  # a step with a forward never sleeps, and resets
    step(idle=True)
    assert slept == [IDLE_SLEEP_S, IDLE_SLEEP_S]
    step(idle=True, dt=2 * IDLE_SPIN_S)
    assert len(slept) == 3
    results.append(WorkerOutput(finished_recving={"r1"}))  # a push ended: flat out again
    step(idle=True)
    assert len(slept) == 4  # (this step's pause came before it learnt of r1)
    step(idle=True, dt=IDLE_SPIN_S / 2)
    step(idle=True, dt=IDLE_SPIN_S / 4)
    assert len(slept) == 4
    side._cuda = True  # a GPU engine's compute is not on these cores: never sleeps
    for _ in range(3):
        step(idle=True, dt=2 * IDLE_SPIN_S)
    assert len(slept) == 4


def test_the_transport_bench_paces_its_engines_as_the_connector_does() -> None:
    from kvpush.vllm import worker_side
    from kvpush_bench import transport

    assert (transport.IDLE_SPIN_S, transport.IDLE_SLEEP_S) == (
        worker_side.IDLE_SPIN_S,
        worker_side.IDLE_SLEEP_S,
    )


def test_connector_meta_marks_steps_without_tokens() -> None:
    from types import SimpleNamespace

    from kvpush.vllm.connector import KVPushConnector

    conn = object.__new__(KVPushConnector)
    conn.sched_side = SchedulerSide("P", ConnectorOptions.parse({}, env={}), True, False, 1)
    empty = SimpleNamespace(total_num_scheduled_tokens=0, scheduled_new_reqs=[])
    busy = SimpleNamespace(total_num_scheduled_tokens=7, scheduled_new_reqs=[])
    assert conn.build_connector_meta(empty).idle
    assert not conn.build_connector_meta(busy).idle


def test_every_option_is_documented_once_with_its_default() -> None:
    """operating.md's table of connector options is the schema's: one row per key, in
    ConnectorOptions, with the default the core gives it."""
    import dataclasses
    import re
    from pathlib import Path

    table = Path(__file__).parents[2] / "docs" / "operating.md"
    rows = re.findall(r"^\| `(\w+)` \| ([^|]+) \|", table.read_text(), re.M)
    documented = {key: default.strip() for key, default in rows}
    environment_only = {"shared_secret", "params_secret"}
    keys = {f.name for f in dataclasses.fields(ConnectorOptions)} - environment_only
    assert len(rows) >= len(keys) and keys <= set(documented), keys - set(documented)
    defaults = ConnectorOptions()
    for key in keys:
        value = getattr(defaults, key)
        expected = "empty:" if value == "" else value if isinstance(value, str) else f"{value:g}"
        first_word = documented[key].replace("`", "").split(",")[0].split(" ")[0]
        assert first_word == expected, (key, documented[key])
