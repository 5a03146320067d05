"""The GPU benchmark harness: kvpush's core on torch tensors, against raw NIXL.

Imports torch lazily, like kvpush.gpu. Modules:

  engine.py    GpuEngine: a stepped engine around the core with a KV cache in torch tensors
  process.py   a GpuEngine (and raw NIXL benchmarks) in a child process, driven over a pipe
  raw.py       raw NIXL WRITEs between two processes, the baseline of the benchmark
  transport.py CudaNixlTransport: NixlTransport with the device current in each calling thread
  bench.py     `python -m kvpush_bench.gpu.bench`: raw NIXL vs kvpush direct vs kvpush staged
"""
