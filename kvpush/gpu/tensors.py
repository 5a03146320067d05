"""Describe KV caches held in torch tensors as a KVLayout (CUDA tensors become VRAM regions)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvpush.core.errors import LayoutError
from kvpush.core.layout import KVLayout, MemType, Region


def tensor_nbytes(t: Any) -> int:
    return int(t.numel()) * int(t.element_size())


def mem_type_of(t: Any) -> tuple[MemType, int]:
    """("VRAM", device index) for a CUDA tensor, ("DRAM", 0) for a CPU one."""
    if t.device.type == "cuda":
        return "VRAM", int(t.device.index or 0)
    if t.device.type == "cpu":
        return "DRAM", 0
    raise LayoutError(f"tensor on {t.device} cannot be registered (CUDA or CPU only)")


def layout_from_tensors(
    tensors: Sequence[Any],
    block_size: int,
    *,
    names: Sequence[str] | None = None,
    groups: Sequence[int] | None = None,
    physical_per_logical: int = 1,
    kv_first: bool = False,
) -> KVLayout:
    """One Region per tensor; a tensor's leading dimension indexes its physical blocks.

    ``kv_first``: tensors shaped (2, num_blocks, ...) (K and V stacked, as vLLM's
    per-layer caches) count as two regions each, K then V. Tensors must be
    contiguous and all on CUDA devices or all on the CPU.
    """
    parts: list[tuple[str, Any, int]] = []
    for i, t in enumerate(tensors):
        name = names[i] if names is not None else f"kv{i}"
        group = groups[i] if groups is not None else 0
        if kv_first:
            if t.dim() < 2 or t.shape[0] != 2:
                raise LayoutError(
                    f"{name}: kv_first needs shape (2, num_blocks, ...), not {tuple(t.shape)}"
                )
            parts += [(f"{name}.k", t[0], group), (f"{name}.v", t[1], group)]
        else:
            parts.append((name, t, group))
    if not parts:
        raise LayoutError("no tensors")
    regions = []
    kinds = set()
    for name, t, group in parts:
        if not t.is_contiguous():
            raise LayoutError(f"{name}: tensor is not contiguous")
        if t.dim() < 1 or t.shape[0] < 1 or tensor_nbytes(t) == 0:
            raise LayoutError(f"{name}: empty tensor")
        mem, dev = mem_type_of(t)
        kinds.add(mem)
        num_blocks = int(t.shape[0])
        regions.append(
            Region(name, int(t.data_ptr()), tensor_nbytes(t) // num_blocks, num_blocks, dev, group)
        )
    if len(kinds) != 1:
        raise LayoutError("tensors mix CPU and CUDA memory")
    return KVLayout(
        regions=regions,
        block_size=block_size,
        physical_per_logical=physical_per_logical,
        mem_type=kinds.pop(),
    )
