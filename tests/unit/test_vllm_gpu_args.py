"""kvpush_bench.vllm_gpu's A/B variants: checked when parsed, before any server starts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvpush.deploy.servers import ServerSpec
from kvpush_bench.pairs import make_pair
from kvpush_bench.vllm_gpu import parse


def test_a_variant_names_a_resolved_tree(tmp_path: Path) -> None:
    args = parse(["--out", "x", "--configs", "plain,kvpush@b", "--variant", f"b={tmp_path}"])
    assert args.trees == {"b": str(tmp_path.resolve())}


@pytest.mark.parametrize(
    "bad", [["--variant", "no-equals-sign"], ["--variant", "=dir"], ["--configs", "kvpush@z"]]
)
def test_a_malformed_or_missing_variant_is_refused(bad: list[str]) -> None:
    with pytest.raises(SystemExit) as e:
        parse(["--out", "x", *bad])
    assert e.value.code == 2


def test_decode_args_make_a_variant_of_this_tree() -> None:
    args = parse(
        [
            "--out",
            "x",
            "--configs",
            "plain,kvpush@sync",
            "--decode-args",
            "sync=--no-async-scheduling --max-num-seqs 4",
        ]
    )
    assert args.d_args == {"sync": ["--no-async-scheduling", "--max-num-seqs", "4"]}
    assert args.trees == {}


def _launched(pair: Any, monkeypatch: pytest.MonkeyPatch) -> dict[str, ServerSpec]:
    """The spec of each vLLM server ``pair`` starts (servers and router faked)."""
    import kvpush_bench.pairs as pairs

    specs: dict[str, ServerSpec] = {}

    class FakeServer:
        def __init__(self, spec: ServerSpec) -> None:
            specs[spec.name] = spec
            self.url = f"http://{spec.name}"

    monkeypatch.setattr(pairs, "VllmServer", FakeServer)
    monkeypatch.setattr(pairs, "RouterProc", lambda *a, **k: None)
    pair._launch()
    return specs


def test_decode_args_reach_only_the_decoders_command_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pair = make_pair("kvpush@sync", "MODEL", str(tmp_path), device="cpu")
    pair.decode_args = ["--no-async-scheduling"]  # type: ignore[attr-defined]
    specs = _launched(pair, monkeypatch)
    started = {name: list(spec.extra_args) for name, spec in specs.items()}
    assert started == {"prefill": [], "decode": ["--no-async-scheduling"]}


def test_decode_env_makes_a_variant_and_is_checked() -> None:
    args = parse(
        ["--out", "x", "--configs", "kvpush@w", "--decode-env", "w=A=1", "--decode-env", "w=B=x=y"]
    )
    assert args.d_env == {"w": {"A": "1", "B": "x=y"}}
    for bad in ("w=A", "=A=1", "w==1"):
        with pytest.raises(SystemExit) as e:
            parse(["--out", "x", "--configs", "kvpush@w", "--decode-env", bad])
        assert e.value.code == 2


def test_decode_env_reaches_only_the_decoders_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pair = make_pair("kvpush@w", "MODEL", str(tmp_path), device="cpu", env={"S": "1"})
    pair.decode_env = {"K": "v"}  # type: ignore[attr-defined]
    envs = {name: dict(spec.env) for name, spec in _launched(pair, monkeypatch).items()}
    assert envs == {"prefill": {"S": "1"}, "decode": {"S": "1", "K": "v"}}


def test_env_makes_a_variant_and_is_checked() -> None:
    args = parse(["--out", "x", "--configs", "kvpush@g", "--env", "g=K=1"])
    assert args.env == {"g": {"K": "1"}} and args.d_env == {}
    with pytest.raises(SystemExit) as e:
        parse(["--out", "x", "--configs", "kvpush@g", "--env", "g=K"])
    assert e.value.code == 2
