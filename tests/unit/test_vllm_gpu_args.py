"""kvpush_bench.vllm_gpu's A/B variants: checked when parsed, before any server starts."""

from __future__ import annotations

from pathlib import Path

import pytest

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
