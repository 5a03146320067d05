"""kvpush on GPU memory: KV caches as torch tensors, and the same-host copy over CUDA IPC.

Everything here imports torch lazily (inside functions or at first use), so
``import kvpush.gpu`` works on a machine without torch; the core never imports
this package. Modules:

  tensors.py    KVLayout from a list of torch tensors (CUDA -> VRAM, CPU -> DRAM)
  peer_copy.py  CudaPeerCopy: the core's PeerCopyHook over CUDA IPC (one kernel per copy)
  driver.py     the few CUDA driver calls the peer copy makes through ctypes
  copy.py       the device-side copy loop the kernels share
"""
