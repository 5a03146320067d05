"""The start-up warning for UCX settings that broke GPU pushes (docs/benchmarks.md)."""

from __future__ import annotations

import pytest

from kvpush.core.nixl_transport import ucx_warning


@pytest.mark.parametrize("value", ["y", "YES", " on ", "1", "true"])
def test_the_rma_pipeline_with_gpu_kv_is_warned_of(value: str) -> None:
    got = ucx_warning({"UCX_RMA_PPLN_ENABLE": value}, "VRAM")
    assert got is not None and "UCX_RMA_PPLN_ENABLE" in got


@pytest.mark.parametrize(
    "env, mem_type",
    [
        ({"UCX_RMA_PPLN_ENABLE": "y"}, "DRAM"),  # host KV: that protocol is not used
        ({"UCX_RMA_PPLN_ENABLE": "n"}, "VRAM"),
        ({"UCX_RMA_PPLN_ENABLE": ""}, "VRAM"),
        ({"UCX_TLS": "tcp,cuda_copy"}, "VRAM"),
    ],
)
def test_other_settings_are_not(env: dict[str, str], mem_type: str) -> None:
    assert ucx_warning(env, mem_type) is None
