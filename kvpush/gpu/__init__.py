"""kvpush on GPU memory: KV caches as torch tensors, and the staging fast path.

Everything here imports torch lazily (inside functions or at first use), so
``import kvpush.gpu`` works on a machine without torch; the core never imports
this package. Modules:

  tensors.py   KVLayout from a list of torch tensors (CUDA -> VRAM, CPU -> DRAM)
  copy.py      batched copies between raw address ranges (CuPy kernel, torch fallback)
  slots.py     bounded first-fit allocator of staging slots
  staging.py   GpuStaging: the core's StagingHook (gather, one WRITE, scatter)
  engine.py    GpuEngine: a stepped engine around the core with a KV cache in torch tensors
  process.py   a GpuEngine (and raw NIXL benchmarks) in a child process, driven over a pipe
  raw.py       raw NIXL WRITEs between two processes, the baseline of the benchmark
  bench.py     `python -m kvpush.gpu.bench`: raw NIXL vs kvpush direct vs kvpush staged
"""
