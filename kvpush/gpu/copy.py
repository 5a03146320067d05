"""The device-side copy loop shared by kvpush's CUDA kernels (peer_copy.py's)."""

from __future__ import annotations

COPY_RANGE = r"""
// n bytes from s to d by the threads of one block: 16-byte vectors with eight loads in
// flight per thread before any store when s, d and n are 16-byte aligned, else bytes.
__device__ __forceinline__ void kvpush_copy_range(unsigned long long s, unsigned long long d,
                                                  long long n) {
    if (((s | d | (unsigned long long)n) & 15ULL) == 0ULL) {
        const uint4* __restrict__ s4 = reinterpret_cast<const uint4*>(s);
        uint4* __restrict__ d4 = reinterpret_cast<uint4*>(d);
        long long n4 = n >> 4, j = threadIdx.x, st = blockDim.x;
        for (; j + 7 * st < n4; j += 8 * st) {
            uint4 r[8];
#pragma unroll
            for (int k = 0; k < 8; k++) r[k] = s4[j + k * st];
#pragma unroll
            for (int k = 0; k < 8; k++) d4[j + k * st] = r[k];
        }
        for (; j < n4; j += st) d4[j] = s4[j];
    } else {
        const unsigned char* sb = reinterpret_cast<const unsigned char*>(s);
        unsigned char* db = reinterpret_cast<unsigned char*>(d);
        for (long long j = threadIdx.x; j < n; j += blockDim.x) db[j] = sb[j];
    }
}
"""
