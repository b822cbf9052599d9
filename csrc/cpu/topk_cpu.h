// Top-k selection by magnitude in O(n) (csrc/cpu/topk_cpu.cpp; CUDA twin: csrc/cuda/topk_kernels.cuh).
//
// The selection is defined without reference to any algorithm, so every backend, thread count and
// machine returns the same indices: order the coordinates by |x| descending (compared as the IEEE bits
// of |x|, so NaN > +Inf > every finite value and -0 == +0), ties by index ascending, and take the
// first min(k, n); the indices are written in ascending order.
#pragma once

#include <cstdint>

namespace lhc {
namespace cpu {

struct TopkStats {
  uint64_t count = 0;       // indices written: min(k, n), exactly
  uint64_t candidates = 0;  // coordinates the last filtering pass kept (0 when the exact fallback ran)
  uint32_t threshold = 0;   // the bits of |x| of the last coordinate taken (the k-th largest)
  uint32_t fallback = 0;    // 1: the filtering passes missed, the exact histogram passes ran
};

// Writes the selection (see above) into out[0, min(k, n)). Sampled threshold, refined: a deterministic
// sample of the keys gives a threshold that keeps a little more than k coordinates with high
// probability; one filtering pass collects those (in index order, per thread range); the exact k-th
// key among them settles the threshold and its ties. Where the sample's threshold is 0, or keeps fewer
// than k, the pass keeps every non-zero coordinate instead: fewer than k of them (a sparse gradient's,
// such as an embedding table's) are all taken, with the first zero ones by index. Should the sample
// miss otherwise (far more kept than expected), an exact radix selection over the whole input (three
// histogram passes) replaces it, so the result never depends on the sample.
TopkStats topk_select(const float* x, uint64_t n, uint64_t k, int64_t* out, int num_threads);

// Top-k with error feedback in one pass over the input (CUDA twin: topk_accumulate, the selection,
// topk_take): a = x + e (one IEEE addition per coordinate), the selection above over a into
// out[0, c) (c = min(k, n), exactly: never more), values[j] = a[out[j]], and e <- a with the selected
// coordinates zeroed, so x + e_before = e_after + scatter(out, values) coordinate by coordinate
// (nothing is lost). In the common case x and e are read once and e written once (the sample reads
// a few a[i] first); should the sample miss, e <- a first and the exact selection runs over it.
TopkStats topk_feedback(const float* x, float* e, uint64_t n, uint64_t k, int64_t* out, float* values,
                        int num_threads);

}  // namespace cpu
}  // namespace lhc
