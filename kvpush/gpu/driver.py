"""The few CUDA driver calls the peer copy makes itself, through ctypes.

A kernel launch through the driver with prebuilt argument slots costs a few
microseconds of Python, a third of a CuPy launch; a stream query is one call.
Every call needs the device's (primary) context current on the calling thread.
"""

from __future__ import annotations

import ctypes
from typing import Any

from kvpush.core.errors import LayoutError

NOT_READY = 600  # CUDA_ERROR_NOT_READY
_u64, _vp, _uint = ctypes.c_uint64, ctypes.c_void_p, ctypes.c_uint


class CudaError(RuntimeError):
    pass


class Driver:
    def __init__(self, params: int) -> None:
        cu = ctypes.CDLL("libcuda.so.1")
        # No argtypes: each argument is passed ready-made (ctypes then converts nothing;
        # the grid and block sizes, plain ints, go as C ints).
        self._launch = cu.cuLaunchKernel
        self._query = cu.cuStreamQuery
        self._query.argtypes = [_vp]
        self._sync = cu.cuStreamSynchronize
        self._sync.argtypes = [_vp]
        self._wait_event = cu.cuStreamWaitEvent
        self._wait_event.argtypes = [_vp, _vp, _uint]
        self._register = cu.cuMemHostRegister_v2
        self._register.argtypes = [_vp, ctypes.c_size_t, _uint]
        self._unregister = cu.cuMemHostUnregister
        self._unregister.argtypes = [_vp]
        self._devptr = cu.cuMemHostGetDevicePointer_v2
        self._devptr.argtypes = [ctypes.POINTER(_u64), _vp, _uint]
        self._range = cu.cuMemGetAddressRange_v2
        self._range.argtypes = [ctypes.POINTER(_u64), ctypes.POINTER(ctypes.c_size_t), _u64]
        # The kernel's arguments: one 8-byte slot each, and the array of their addresses
        # that cuLaunchKernel reads (it copies the values at the call).
        self.args, self._argv = self.arguments((0,) * params)

    @staticmethod
    def arguments(values: tuple[int, ...]) -> tuple[Any, Any]:
        """Argument slots holding ``values`` (8 bytes each) and the array of their
        addresses that cuLaunchKernel reads: pass the latter to ``launch``."""
        args = (_u64 * len(values))(*values)
        base = ctypes.addressof(args)
        return args, (_vp * len(values))(*[base + 8 * i for i in range(len(values))])

    def launch(
        self, func: Any, grid: tuple[int, int], threads: int, stream: Any, argv: Any = None
    ) -> None:
        """``func`` and ``stream`` as ``handle()`` made them; arguments in ``args`` (or in
        the slots ``argv`` points at, from ``arguments``; it copies them at the call)."""
        argv = self._argv if argv is None else argv
        err = self._launch(func, grid[0], grid[1], 1, threads, 1, 1, 0, stream, argv, None)
        if err:
            raise CudaError(f"cuLaunchKernel failed: CUDA error {err}")

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

    def wait_event(self, stream: Any, event: int) -> None:
        """Work queued on ``stream`` from now on starts after ``event``'s work is done."""
        err = self._wait_event(stream, event, 0)
        if err:
            raise CudaError(f"cuStreamWaitEvent failed: CUDA error {err}")

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


def handle(ptr: int) -> ctypes.c_void_p:
    """A CUfunction or CUstream, ready to pass to ``Driver.launch``."""
    return ctypes.c_void_p(ptr)


def function_of(kernel: Any) -> int | None:
    """The CUfunction of a compiled CuPy RawKernel, if this CuPy exposes it."""
    try:
        return int(kernel.kernel.ptr)
    except (AttributeError, TypeError):
        return None
