"""kvpush on GPU memory: KV caches as torch tensors, and the staging fast path.

Everything here imports torch lazily (inside functions or at first use), so
``import kvpush.gpu`` works on a machine without torch; the core never imports
this package. Modules:

  tensors.py   KVLayout from a list of torch tensors (CUDA -> VRAM, CPU -> DRAM)
  copy.py      batched copies between raw address ranges (CuPy kernel, torch fallback)
  slots.py     bounded first-fit allocator of staging slots
  staging.py   GpuStaging: the core's StagingHook (gather, one WRITE, scatter)

The GPU benchmark harness (engine, process, raw NIXL baseline, bench) is in kvpush_bench.gpu.
"""
