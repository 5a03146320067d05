"""The few CUDA driver calls the peer copy makes itself, through ctypes.

A stream query or wait is one call each, with no CuPy objects in between. Every
call needs the device's (primary) context current on the calling thread.
"""

from __future__ import annotations

import ctypes

from kvpush.core.errors import LayoutError

NOT_READY = 600  # CUDA_ERROR_NOT_READY
_u64, _vp, _uint = ctypes.c_uint64, ctypes.c_void_p, ctypes.c_uint


class CudaError(RuntimeError):
    pass


class Driver:
    def __init__(self) -> None:
        cu = ctypes.CDLL("libcuda.so.1")
        self._query = cu.cuStreamQuery
        self._query.argtypes = [_vp]
        self._sync = cu.cuStreamSynchronize
        self._sync.argtypes = [_vp]
        self._register = cu.cuMemHostRegister_v2
        self._register.argtypes = [_vp, ctypes.c_size_t, _uint]
        self._unregister = cu.cuMemHostUnregister
        self._unregister.argtypes = [_vp]
        self._devptr = cu.cuMemHostGetDevicePointer_v2
        self._devptr.argtypes = [ctypes.POINTER(_u64), _vp, _uint]
        self._range = cu.cuMemGetAddressRange_v2
        self._range.argtypes = [ctypes.POINTER(_u64), ctypes.POINTER(ctypes.c_size_t), _u64]

    def done(self, stream: int) -> bool:
        """True once everything launched on ``stream`` finished; raises if any of it failed."""
        err = self._query(stream)
        if err == NOT_READY:
            return False
        if err:
            raise CudaError(f"the copy stream failed: CUDA error {err}")
        return True

    def wait(self, stream: int) -> None:
        err = self._sync(stream)
        if err:
            raise CudaError(f"the copy stream failed: CUDA error {err}")

    def map_host(self, addr: int, size: int) -> int:
        """Pin host memory (another process's shared memory too) for device access;
        returns its device address."""
        err = self._register(addr, size, 1 | 2)  # PORTABLE | DEVICEMAP
        if err:
            raise CudaError(f"cuMemHostRegister failed: CUDA error {err}")
        dev = _u64()
        err = self._devptr(ctypes.byref(dev), addr, 0)
        if err:
            self._unregister(addr)
            raise CudaError(f"cuMemHostGetDevicePointer failed: CUDA error {err}")
        return int(dev.value)

    def unmap_host(self, addr: int) -> None:
        self._unregister(addr)

    def allocation_range(self, ptr: int) -> tuple[int, int]:
        """(base, size) of the CUDA allocation holding ``ptr``."""
        base, size = _u64(), ctypes.c_size_t()
        err = self._range(ctypes.byref(base), ctypes.byref(size), _u64(ptr))
        if err:
            raise LayoutError(f"cuMemGetAddressRange failed ({err}) for {ptr:#x}")
        return int(base.value), int(size.value)
