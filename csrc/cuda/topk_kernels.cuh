// topk_kernels.cuh -- CUDA kernels of the top-k selection by magnitude (the CPU's: csrc/cpu/topk_cpu.cpp).
//
// Device code only, like thc_kernels.cuh: compiled by nvcc into lossless_hc._C_cuda, by NVRTC on the
// CuPy path, and by the host compiler against tests/cuda_emulation/cuda_emulation.h. The launch
// sequence lives in lossless_hc/backends/cuda_topk.py. Every parameter is 8 bytes.
//
// The result is defined without reference to an algorithm (csrc/cpu/topk_cpu.h): the min(k, n)
// coordinates largest by the bits of |x| (NaN above +Inf, -0 == +0), ties to the lower index, written
// in ascending order. So the CPU's sampled threshold and this exact radix selection return the same
// indices. Here: three histogram passes over the key digits (11, 11, 10 bits, most significant
// first) fix the k-th largest key T and how many of its ties are taken; then every block of a fixed
// grid counts its keys above and at T over a contiguous range, one thread turns the counts into
// output offsets and tie quotas (in block order, i.e. index order), and every block writes its
// indices in order with block-wide scans. No step depends on timing, so the output is deterministic.
#pragma once

#include "../lhc_layout.h"

namespace lhc {
namespace gpu {

constexpr unsigned int kTopkThreads = 256;  // block size of every top-k kernel
constexpr unsigned int kTopkBins = 2048;    // histogram bins (11-bit digits)

// Device state of one selection (written by the host first: prefix 0, remaining k).
struct TopkState {
  unsigned int prefix;        // key bits fixed so far; after the third pass, T
  unsigned int pad;
  unsigned long long remaining;  // how many of the k lie among keys with this prefix; finally, T's ties taken
  unsigned long long pad2[2];
};
static_assert(sizeof(TopkState) == 32, "TopkState: 32 bytes (lossless_hc/backends/cuda_topk.py STATE_BYTES)");

__device__ __forceinline__ unsigned int topk_key(const float* x, uint64_t i) {
  return __float_as_uint(x[i]) & 0x7fffffffu;
}

// Pass p: shift and width of the digit, and how many low bits are free (the bits above are fixed).
__device__ __forceinline__ void topk_digit(uint64_t pass, unsigned int* shift, unsigned int* width) {
  *shift = pass == 0 ? 21u : (pass == 1 ? 10u : 0u);
  *width = pass == 2 ? 10u : 11u;
}

// Histogram of pass `pass`'s digit over the keys whose higher bits equal the prefix (grid-stride).
extern "C" __global__ void topk_hist(const float* x, uint64_t n, const TopkState* st, uint64_t pass,
                                     unsigned long long* hist) {
  __shared__ unsigned int h[kTopkBins];
  for (unsigned int b = threadIdx.x; b < kTopkBins; b += blockDim.x) h[b] = 0;
  __syncthreads();
  unsigned int shift, width;
  topk_digit(pass, &shift, &width);
  const unsigned int fixed = shift + width, prefix = st->prefix;
  for (uint64_t i = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (uint64_t)gridDim.x * blockDim.x) {
    const unsigned int key = topk_key(x, i);
    if (fixed >= 32 || (key >> fixed) == (prefix >> fixed)) atomicAdd(&h[(key >> shift) & ((1u << width) - 1)], 1u);
  }
  __syncthreads();
  for (unsigned int b = threadIdx.x; b < kTopkBins; b += blockDim.x)
    if (h[b]) atomicAdd(&hist[b], (unsigned long long)h[b]);
}

// One thread: the bin (from the top) holding the remaining-th key; fixes its digit, zeroes the histogram.
extern "C" __global__ void topk_pick(unsigned long long* hist, TopkState* st, uint64_t pass) {
  if (blockIdx.x != 0 || threadIdx.x != 0) return;
  unsigned int shift, width;
  topk_digit(pass, &shift, &width);
  unsigned long long above = 0;
  bool found = false;
  for (int b = (1 << width) - 1; b >= 0; --b) {
    const unsigned long long c = hist[b];
    hist[b] = 0;
    if (found) continue;
    if (above + c >= st->remaining) {
      st->prefix |= (unsigned int)b << shift;
      st->remaining -= above;
      found = true;
    } else {
      above += c;
    }
  }
}

// Block-wide inclusive scan of v over the block's threads (s: blockDim.x entries of shared memory).
__device__ __forceinline__ unsigned int topk_block_scan(unsigned int* s, unsigned int v) {
  const unsigned int t = threadIdx.x;
  s[t] = v;
  __syncthreads();
  for (unsigned int off = 1; off < blockDim.x; off <<= 1) {
    const unsigned int a = t >= off ? s[t - off] : 0u;
    __syncthreads();
    s[t] += a;
    __syncthreads();
  }
  const unsigned int r = s[t];
  __syncthreads();
  return r;
}

// Block b: its keys above T and at T, over [b * per_block, (b + 1) * per_block) (counts[2b], counts[2b + 1]).
extern "C" __global__ void topk_count(const float* x, uint64_t n, const TopkState* st, uint64_t per_block,
                                      unsigned long long* counts) {
  __shared__ unsigned int s[kTopkThreads];
  const unsigned int T = st->prefix;
  const uint64_t lo = (uint64_t)blockIdx.x * per_block;
  const uint64_t hi = lo + per_block < n ? lo + per_block : n;
  unsigned int gt = 0, eq = 0;
  for (uint64_t i = lo + threadIdx.x; i < hi; i += blockDim.x) {
    const unsigned int key = topk_key(x, i);
    gt += key > T;
    eq += key == T;
  }
  // Per-thread counts stay below 2^32: per_block is capped by the launcher.
  const unsigned int g = topk_block_scan(s, gt);
  const unsigned int e = topk_block_scan(s, eq);
  if (threadIdx.x == blockDim.x - 1) {
    counts[2 * blockIdx.x] = g;
    counts[2 * blockIdx.x + 1] = e;
  }
}

// One thread: block b's output offset (counts[2b]) and tie quota (counts[2b + 1]), in block order.
extern "C" __global__ void topk_offsets(unsigned long long* counts, uint64_t blocks, TopkState* st) {
  if (blockIdx.x != 0 || threadIdx.x != 0) return;
  unsigned long long off = 0, ties = st->remaining;
  for (uint64_t b = 0; b < blocks; ++b) {
    const unsigned long long gt = counts[2 * b], eq = counts[2 * b + 1];
    const unsigned long long take = eq < ties ? eq : ties;
    ties -= take;
    counts[2 * b] = off;
    counts[2 * b + 1] = take;
    off += gt + take;
  }
}

// Block b writes, in index order, its indices with key > T and the first counts[2b + 1] with key == T.
extern "C" __global__ void topk_write(const float* x, uint64_t n, const TopkState* st, uint64_t per_block,
                                      const unsigned long long* counts, long long* out) {
  __shared__ unsigned int s[kTopkThreads];
  const unsigned int T = st->prefix;
  const uint64_t lo = (uint64_t)blockIdx.x * per_block;
  const uint64_t hi = lo + per_block < n ? lo + per_block : n;
  unsigned long long written = counts[2 * blockIdx.x];
  const unsigned long long quota = counts[2 * blockIdx.x + 1];
  unsigned long long taken = 0;
  for (uint64_t base = lo; base < hi; base += blockDim.x) {
    const uint64_t i = base + threadIdx.x;
    const unsigned int key = i < hi ? topk_key(x, i) : 0u;
    const unsigned int at = i < hi && key == T;
    const unsigned int eq_incl = topk_block_scan(s, at);
    const unsigned int eq_total = s[blockDim.x - 1];
    __syncthreads();
    const unsigned int sel = i < hi && (key > T || (at && taken + (eq_incl - 1) < quota));
    const unsigned int sel_incl = topk_block_scan(s, sel);
    const unsigned int sel_total = s[blockDim.x - 1];
    __syncthreads();
    if (sel) out[written + sel_incl - 1] = (long long)i;
    written += sel_total;
    const unsigned long long left = quota - taken;
    taken += eq_total < left ? eq_total : left;
  }
}

// Error feedback (the CPU's topk_feedback, csrc/cpu/topk_cpu.h): e <- x + e, one IEEE addition per
// coordinate (no product is involved, so no contraction can change it), before the selection runs over e.
extern "C" __global__ void topk_accumulate(const float* x, float* e, uint64_t n) {
  for (uint64_t i = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (uint64_t)gridDim.x * blockDim.x)
    e[i] = x[i] + e[i];
}

// After the selection over a (= e): values[j] = a[idx[j]] and, with zero_selected, a[idx[j]] = 0 for
// j < count (the selected coordinates leave the residual).
extern "C" __global__ void topk_take(float* a, const long long* idx, uint64_t count, float* values,
                                     uint64_t zero_selected) {
  for (uint64_t j = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x; j < count;
       j += (uint64_t)gridDim.x * blockDim.x) {
    const uint64_t i = (uint64_t)idx[j];
    values[j] = a[i];
    if (zero_selected) a[i] = 0.0f;
  }
}

}  // namespace gpu
}  // namespace lhc
