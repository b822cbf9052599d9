// Scratch memory and parallel fills of the CPU kernels (codec_cpu_internal.h).
#include <sys/mman.h>

#include "codec_cpu_internal.h"

namespace lhc {
namespace cpu {
namespace detail {

void parallel_fill(float* p, uint64_t n, float value, int nt) {
#pragma omp parallel for num_threads(nt) schedule(static)
  for (int64_t i = 0; i < (int64_t)n; ++i) p[i] = value;
}

}  // namespace detail

using detail::kHugePage;

void advise_huge_pages(void* p, uint64_t bytes) {
#ifdef MADV_HUGEPAGE
  const uintptr_t first = ((uintptr_t)p + kHugePage - 1) & ~(uintptr_t)(kHugePage - 1);
  const uintptr_t last = ((uintptr_t)p + bytes) & ~(uintptr_t)(kHugePage - 1);
  // Advice only: a kernel without THP refuses it and the memory keeps its small pages.
  if (last > first) (void)madvise((void*)first, last - first, MADV_HUGEPAGE);
#else
  (void)p;
  (void)bytes;
#endif
}

}  // namespace cpu
}  // namespace lhc
