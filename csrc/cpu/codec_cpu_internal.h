// Internal declarations of the CPU (OpenMP) kernels of the lossless codec (codec_cpu.h is the
// public interface), shared by the files of csrc/cpu/, one per stage:
//   memory.cpp     scratch allocation (huge pages), parallel fills
//   digits.cpp     index words into packed digits (digits.h)
//   peel.cpp       keys into a segmented table's cells and groups: hashing, bucketing, peeling
//                  states (peel.h: the peeling itself and the two-key pairs)
//   peel_batch.cpp the value peel's step for eight keys at once, in AVX-512 lanes
//   support.cpp    the support from the bitmap and Bloom indexes
//   multilevel.cpp the support from the multilevel index
//   encode.cpp     lhc::cpu::encode
//   decode.cpp     lhc::cpu::decode: the value peel and the output
//
// Determinism: every floating-point accumulation happens in a fixed order that does not depend on
// the number of threads (sketch cells are summed in increasing key order; each group of the sketch
// is peeled sequentially in layers, each key read from its lowest-numbered pure cell and a layer's keys
// in increasing position: peel.h peel_layers, the CUDA kernels' rounds exactly). Parallel
// loops only do integer work or write disjoint outputs, so the same payload decodes to the same
// bits on every run and every machine with IEEE-754 doubles.
#pragma once

#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <new>
#include <type_traits>
#include <utility>
#include <vector>

#include "codec_cpu.h"

namespace lhc {
namespace cpu {
namespace detail {

// Phase timings on stderr when LHC_PROFILE is set (a diagnostic for performance work).
struct Prof {
  const char* env = std::getenv("LHC_PROFILE");
  std::chrono::steady_clock::time_point t = std::chrono::steady_clock::now();
  void mark(const char* what) {
    if (!env) return;
    const auto now = std::chrono::steady_clock::now();
    std::fprintf(stderr, "  lhc %-10s %8.2f ms\n", what, std::chrono::duration<double, std::milli>(now - t).count());
    t = now;
  }
};

// The scans read their input once, in order, and do little with most of it: they are prefetched this many
// floats (16 KiB) ahead, as the hardware prefetcher alone, which stops at every 4 KiB page, left them
// waiting on memory (docs/BENCHMARKS.md, LHC codec).
constexpr uint64_t kPrefetchAhead = 4096;

// Load the cache line holding p, for reading and writing soon. An asm statement, not
// __builtin_prefetch: GCC 12 deletes the builtin as dead code when its address goes through a
// conditional such as a std::min clamp (PeelCells::prefetch_packed's were missing from the binary).
// p must point into an object: the callers clamp stale indices into their tables.
inline void prefetch_line(const void* p) {
#if defined(__x86_64__) || defined(__i386__)
  asm volatile("prefetcht0 %0" : : "m"(*static_cast<const char*>(p)));
#else
  __builtin_prefetch(p, 1, 3);
#endif
}

constexpr uint64_t kHugePage = 2u << 20;

// Allocator of the decoder's scratch arrays: a block of kHugePage bytes or more is aligned to a huge
// page and advised to be backed by huge pages (see advise_huge_pages); smaller ones come from
// operator new, aligned to a cache line (so a 32-byte peeling cell never straddles two). Elements a
// resize adds are default-initialised (left unwritten for plain types): every user writes them before
// reading, and zeroing tens of MiB first would be a pass for nothing.
constexpr size_t kCacheLine = 64;

template <typename T>
struct HugePageAllocator {
  using value_type = T;
  HugePageAllocator() = default;
  template <typename U>
  HugePageAllocator(const HugePageAllocator<U>&) {}
  T* allocate(size_t n) {
    const size_t bytes = n * sizeof(T);
    if (bytes < kHugePage) return static_cast<T*>(::operator new(bytes, std::align_val_t(kCacheLine)));
    void* p = std::aligned_alloc(kHugePage, (bytes + kHugePage - 1) / kHugePage * kHugePage);
    if (!p) throw std::bad_alloc();
    advise_huge_pages(p, bytes);
    return static_cast<T*>(p);
  }
  void deallocate(T* p, size_t n) {
    if (n * sizeof(T) < kHugePage)
      ::operator delete(p, std::align_val_t(kCacheLine));
    else
      std::free(p);
  }
  template <typename U>
  void construct(U* p) noexcept(std::is_nothrow_default_constructible<U>::value) {
    ::new ((void*)p) U;
  }
  template <typename U, typename... Args>
  void construct(U* p, Args&&... args) {
    ::new ((void*)p) U(std::forward<Args>(args)...);
  }
  template <typename U>
  bool operator==(const HugePageAllocator<U>&) const { return true; }
  template <typename U>
  bool operator!=(const HugePageAllocator<U>&) const { return false; }
};
template <typename T>
using HugeVector = std::vector<T, HugePageAllocator<T>>;

inline int resolve_threads(int num_threads) { return num_threads > 0 ? num_threads : omp_get_max_threads(); }

// [begin, end) of part `tid` when `total` items are split into `parts` contiguous ranges.
inline void split_range(uint64_t total, int parts, int tid, uint64_t* begin, uint64_t* end) {
  const uint64_t chunk = (total + (uint64_t)parts - 1) / (uint64_t)parts;
  *begin = std::min<uint64_t>(total, chunk * (uint64_t)tid);
  *end = std::min<uint64_t>(total, *begin + chunk);
}

// p[0, n) = value, in parallel.
void parallel_fill(float* p, uint64_t n, float value, int nt);

// A sorted key list held as consecutive parts (one per scanning thread), so that building it
// needs no concatenation copy; vals[p] holds the values of parts[p]'s keys, `block` floats per key
// (the input's key block, zero past numel), gathered while scanning so that no later pass reads the
// input at random.
struct KeyParts {
  std::vector<std::vector<uint32_t>> parts;
  std::vector<std::vector<float>> vals;
  uint64_t size() const {
    uint64_t n = 0;
    for (const auto& p : parts) n += p.size();
    return n;
  }
};

// Support keys bucketed by sketch group as they are found: by[p][g] holds, in increasing order, the
// keys of group g found by part p (one unpacking thread); parts cover increasing key ranges, so the
// parts of one group concatenated are its keys in increasing order. Bucketing while unpacking saves
// a pass over the support and a copy of it.
struct GroupedKeys {
  std::vector<std::vector<HugeVector<uint32_t>>> by;
  // The vectors of `by`, moved out (by left empty) for a support function to reuse: their memory is
  // already the process's, where fresh ones (tens of MiB in all for 2^26 keys) would be new pages, each
  // zeroed by the kernel at its first touch.
  std::vector<std::vector<HugeVector<uint32_t>>> take() {
    std::vector<std::vector<HugeVector<uint32_t>>> kept;
    kept.swap(by);
    return kept;
  }
  // Part p's bucket of group g from `kept` (take()), sized `size`; a new one where kept has none.
  static void reuse(std::vector<std::vector<HugeVector<uint32_t>>>& kept, size_t p, uint64_t g, uint64_t size,
                    HugeVector<uint32_t>* bucket) {
    if (p < kept.size() && g < kept[p].size()) bucket->swap(kept[p][g]);
    bucket->resize(size);
  }
  uint64_t group_size(uint64_t g) const {
    uint64_t n = 0;
    for (const auto& part : by) n += part[g].size();
    return n;
  }
  uint64_t total() const {
    uint64_t n = 0;
    for (const auto& part : by)
      for (const auto& v : part) n += v.size();
    return n;
  }
};

// Keys in increasing order and their values (block floats each).
struct KeyRun {
  const uint32_t* keys;
  uint64_t count;
  const float* vals;
};

// The keys of the sorted `runs` that fall in [kb, ke), a chunk of at most `chunk` keys at a time: for
// each chunk [c0, c1), begin(c0, c1), then visit(run, i) for each of its keys, run after run. A chunk
// is done before the next starts, so `begin` can zero what `visit` then writes while it is in cache.
// `block`: the floats of a key in a run's vals (0 where runs carry none).
template <typename Begin, typename Visit>
void walk_runs_by_chunk(const std::vector<KeyRun>& runs, uint64_t block, uint64_t kb, uint64_t ke, uint64_t chunk,
                        Begin&& begin, Visit&& visit) {
  std::vector<uint64_t> cursor(runs.size());
  for (size_t r = 0; r < runs.size(); ++r)
    cursor[r] = (uint64_t)(std::lower_bound(runs[r].keys, runs[r].keys + runs[r].count, kb) - runs[r].keys);
  for (uint64_t c0 = kb; c0 < ke; c0 += chunk) {
    const uint64_t c1 = std::min(c0 + chunk, ke);
    begin(c0, c1);
    for (size_t r = 0; r < runs.size(); ++r) {
      const KeyRun& run = runs[r];
      uint64_t i = cursor[r];
      for (; i < run.count && run.keys[i] < c1; ++i) visit(run, i);
      cursor[r] = i;
      // The run's next keys (and values), loaded while the other runs are walked: a hundred runs are
      // more streams than the hardware prefetcher follows (the decode's output stage ~0.85x at 2^26 keys, 1%).
      if (run.count) {
        const uint64_t ahead = std::min<uint64_t>(i + 32, run.count - 1);
        prefetch_line(run.keys + ahead);
        if (run.vals) prefetch_line(run.vals + ahead * block);
      }
    }
  }
}

// Where the support comes from (support.cpp, multilevel.cpp): each returns a DecodeStatus and the
// support keys bucketed by sketch group in *support (replacing what it held; bitmap_support reuses the
// memory of its vectors), and fills in the index fields of *st.
int32_t bitmap_support(const CodecLayout& L, const DecodeInputs& in, const float* index, int nt,
                       GroupedKeys* support, DecodeStats* st);
int32_t bloom_support(const CodecLayout& L, const DecodeInputs& in, const float* index, int nt, GroupedKeys* support,
                      DecodeStats* st);
int32_t multilevel_support(const CodecLayout& L, const DecodeInputs& in, const float* payload, int nt,
                           GroupedKeys* support, DecodeStats* st);
// Frees the multilevel working memory this thread kept between decodes (release_decoder_memory).
void release_multilevel_scratch();

}  // namespace detail
}  // namespace cpu
}  // namespace lhc
