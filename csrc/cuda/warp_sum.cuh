// warp_sum.cuh -- a warp's counters added with one atomic: shared by the codec's and THC's kernels.
#pragma once

namespace lhc {
namespace gpu {

// Add a per-thread amount to a 64-bit counter with one atomic per warp: a per-thread atomic on one
// address serialises in L2 (the bitmap count's three counters, one atomic each per thread, took most
// of its 5.8 ms on an H200 at 2^27 keys). Integer sums: the result does not depend on the order.
// Every lane of the warp must call it, converged (where the whole block runs: after a block-wide
// loop, not inside a branch).
__device__ __forceinline__ void warp_add_u64(unsigned long long* counter, unsigned long long amount) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int d = 16; d > 0; d >>= 1) amount += __shfl_sync(0xffffffffu, amount, lane ^ d);
  if (lane == 0 && amount) atomicAdd(counter, amount);
}

}  // namespace gpu
}  // namespace lhc
