// CPU kernels of the lossless codec: encode (non-zero discovery, index, sketch scatter) and decode
// (index unpacking, candidate enumeration, exact count peeling for the Bloom index, value peeling).
//
// Determinism: every floating-point accumulation happens in a fixed order that does not depend on
// the number of threads (sketch cells are summed in increasing key order; each group of the sketch
// is peeled sequentially, breadth-first from a queue seeded in increasing cell order). Parallel
// loops only do integer work or write disjoint outputs, so the same payload decodes to the same
// bits on every run and every machine with IEEE-754 doubles.
#include "codec_cpu.h"

#include <omp.h>
#include <sys/mman.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <new>
#include <type_traits>
#include <utility>
#include <vector>

namespace lhc {
namespace cpu {
namespace {

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

int resolve_threads(int num_threads) { return num_threads > 0 ? num_threads : omp_get_max_threads(); }

// [begin, end) of part `tid` when `total` items are split into `parts` contiguous ranges.
inline void split_range(uint64_t total, int parts, int tid, uint64_t* begin, uint64_t* end) {
  const uint64_t chunk = (total + (uint64_t)parts - 1) / (uint64_t)parts;
  *begin = std::min<uint64_t>(total, chunk * (uint64_t)tid);
  *end = std::min<uint64_t>(total, *begin + chunk);
}

void parallel_fill(float* p, uint64_t n, float value, int nt) {
#pragma omp parallel for num_threads(nt) schedule(static)
  for (int64_t i = 0; i < (int64_t)n; ++i) p[i] = value;
}

// Bit i set iff p[i] is not +-0.0, for i < 64. SSE2 (baseline x86-64): four lanes per compare and
// movemask, about a third of the instructions of a branch-free scalar loop, which compilers do not
// vectorise.
inline uint64_t nonzero_mask64(const uint32_t* p) {
#if defined(__SSE2__)
  const __m128i zero = _mm_setzero_si128();
  uint64_t m = 0;
  for (int i = 0; i < 64; i += 4) {
    const __m128i v = _mm_slli_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + i)), 1);
    const uint32_t is_zero = (uint32_t)_mm_movemask_ps(_mm_castsi128_ps(_mm_cmpeq_epi32(v, zero)));
    m |= (uint64_t)(~is_zero & 0xfu) << i;
  }
  return m;
#else
  uint64_t m = 0;
  for (int i = 0; i < 64; ++i) m |= (uint64_t)((p[i] << 1) != 0) << i;
  return m;
#endif
}

// Non-zero keys of x, per thread in increasing order (concatenated: sorted), and whether x held
// NaN/Inf. -0.0 counts as zero.
std::vector<std::vector<uint32_t>> find_nonzero_keys(const CodecLayout& L, const float* x, int nt,
                                                     uint32_t* non_finite) {
  std::vector<std::vector<uint32_t>> local(nt);
  std::vector<uint32_t> bad(nt, 0);
#pragma omp parallel num_threads(nt)
  {
    const int tid = omp_get_thread_num();
    uint64_t kb, ke;
    // The runtime may grant fewer threads than asked (nested regions, OMP_DYNAMIC): split by the
    // team actually running, or some keys would never be scanned.
    split_range(L.num_keys, omp_get_num_threads(), tid, &kb, &ke);
    std::vector<uint32_t> mine;  // private while scanning (no false sharing on the vector header)
    uint32_t nf = 0;
    const uint32_t* bits = reinterpret_cast<const uint32_t*>(x);
    if (L.block == 1) {
      // Chunks of 64: a vectorisable OR-reduction skips all-zero chunks (about half of them at 1%
      // density), and a non-empty chunk's keys are read off the bit mask of its non-zero lanes.
      constexpr uint64_t kChunk = 64;
      uint64_t k = kb;
      for (; k + kChunk <= ke; k += kChunk) {
        uint32_t any = 0, inf_nan = 0;
        for (uint64_t i = 0; i < kChunk; ++i) {
          const uint32_t u = bits[k + i];
          any |= u << 1;
          inf_nan |= (uint32_t)((u & 0x7f800000u) == 0x7f800000u);
        }
        nf |= inf_nan;
        if (!any) continue;
        for (uint64_t m = nonzero_mask64(bits + k); m; m &= m - 1) mine.push_back((uint32_t)(k + __builtin_ctzll(m)));
      }
      for (; k < ke; ++k) {
        const uint32_t u = bits[k];
        nf |= (uint32_t)((u & 0x7f800000u) == 0x7f800000u);
        if (u << 1) mine.push_back((uint32_t)k);
      }
    } else {
      for (uint64_t k = kb; k < ke; ++k) {
        const uint64_t lo = k * L.block, hi = std::min<uint64_t>(lo + L.block, L.numel);
        uint32_t any = 0;
        for (uint64_t i = lo; i < hi; ++i) {
          const uint32_t u = bits[i];
          nf |= (uint32_t)((u & 0x7f800000u) == 0x7f800000u);
          any |= u << 1;
        }
        if (any) mine.push_back((uint32_t)k);
      }
    }
    local[tid] = std::move(mine);
    bad[tid] = nf;
  }
  *non_finite = 0;
  for (uint32_t b : bad) *non_finite |= b;
  return local;
}

// Powers base^i for i < per_word, as floats (exact: all below 2^22).
std::vector<float> digit_powers(const DigitPacking& P) {
  std::vector<float> pw(P.per_word);
  double p = 1.0;
  for (uint32_t i = 0; i < P.per_word; ++i, p *= P.base) pw[i] = (float)p;
  return pw;
}

// Index words are split into digits kWordBlock words at a time, by loops over words that the
// compiler vectorises.
constexpr uint32_t kWordBlock = 64;
constexpr uint32_t kMaxPerWord = kIntFieldBits;  // base >= 2 and base^per_word <= 2^22

// The digits of up to kWordBlock consecutive index words: digit[i][w] is digit i of word w, and bit i
// of nonzero[w] is set iff that digit is not zero.
struct WordDigits {
  uint32_t digit[kMaxPerWord][kWordBlock];
  uint32_t nonzero[kWordBlock];
  uint64_t sum;  // of all the digits
  uint32_t max;  // the largest digit
};

// u[w] = words[w] * scale as the packed integer it must be, for w < n (n <= kWordBlock); returns false
// if a word is not a valid packed integer in [0, base^per_word) (its u is then 0): a SUM of integer
// fields below 2^22 is exact in float32, so a summed word (scale 1) must be an integer; an AVERAGE is
// within 1/2 of one after scaling back (see kIntFieldBits), so an averaged word is rounded to the
// nearest integer. Adding and subtracting 1.5 * 2^52 rounds |v| < 2^51 to the nearest integer, ties
// to even, as nearbyint does in the default rounding mode. Branch-free over words, so it vectorises
// in the (cloned) splitters it is inlined into.
inline bool word_integers(const float* words, uint32_t n, double scale, const DigitPacking& P, double* u) {
  const double tolerance = scale == 1.0 ? 0.0 : 0.5, round_magic = 6755399441055744.0;  // 1.5 * 2^52
  double limit = 1.0;
  for (uint32_t i = 0; i < P.per_word; ++i) limit *= P.base;
  uint32_t bad = 0;
  for (uint32_t w = 0; w < n; ++w) {
    const double v = (double)words[w] * scale;
    const double r = (v + round_magic) - round_magic;
    // Also false for NaN.
    const bool ok = v > -0.5 && v < limit && std::fabs(v - r) <= tolerance && r >= 0.0 && r < limit;
    bad |= (uint32_t)!ok;
    u[w] = ok ? r : 0.0;
  }
  return bad == 0;
}

// Split words[0, n) (n <= kWordBlock) into digits; false if a word is not a valid packed integer (see
// word_integers). Branch-free over words, so it vectorises (cloned for AVX-512 and AVX2, chosen at
// load time). floor((u + 0.5) / base) computed as a double product with the rounded reciprocal is the
// exact quotient: for u < 2^22, (u + 0.5) / base is at least 0.5 / base > 2^-23 from an integer, and
// the product is off by less than 2^22 * 2^-52. (std::floor would not vectorise without
// -fno-trapping-math; the conversion to int does.)
__attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
bool split_words(const float* words, uint32_t n, double scale, const DigitPacking& P, WordDigits* d) {
  const double base = P.base, inv = 1.0 / base;
  double u[kWordBlock];
  const bool valid = word_integers(words, n, scale, P, u);
  for (uint32_t w = 0; w < n; ++w) d->nonzero[w] = 0;
  uint64_t sum = 0;
  uint32_t max = 0;
  for (uint32_t i = 0; i < P.per_word; ++i) {
    for (uint32_t w = 0; w < n; ++w) {
      const double q = (double)(int32_t)((u[w] + 0.5) * inv);  // truncation: floor, as it is positive
      const uint32_t digit = (uint32_t)(int32_t)(u[w] - q * base);
      u[w] = q;
      d->digit[i][w] = digit;
      d->nonzero[w] |= (uint32_t)(digit != 0) << i;
      sum += digit;
      max = std::max(max, digit);
    }
  }
  d->sum = sum;
  d->max = max;
  return valid;
}

// Which digits of a word are non-zero, their sum and their largest, by table instead of digit by
// digit (the bitmap index needs no more): a word u < base^per_word is split once into
// hi = floor(u / base^h) and lo = u - hi * base^h, h = per_word / 2, and each half is looked up in
// a table of all base^(per_word - h) <= 2^11 * base values of a half (a few KiB, in L1, for most
// world sizes; 130 KiB at the most, for base 129).
// Entry: bits [0, 22) the non-zero mask, [22, 44) the digit sum, [44, 64) the largest digit.
struct DigitMaskTable {
  uint32_t lo_digits = 0;
  double lo_power = 1.0;  // base^lo_digits
  std::vector<uint64_t> entry;
  explicit DigitMaskTable(const DigitPacking& P) {
    lo_digits = P.per_word / 2;
    uint64_t size = 1;
    for (uint32_t i = 0; i < P.per_word - lo_digits; ++i) size *= P.base;
    for (uint32_t i = 0; i < lo_digits; ++i) lo_power *= P.base;
    entry.resize(size);
    for (uint64_t v = 0; v < size; ++v) {
      uint64_t mask = 0, sum = 0, max = 0, r = v;
      for (uint32_t i = 0; r; ++i, r /= P.base) {
        const uint64_t digit = r % P.base;
        mask |= (uint64_t)(digit != 0) << i;
        sum += digit;
        max = std::max(max, digit);
      }
      entry[v] = mask | sum << 22 | max << 44;
    }
  }
};

// As split_words, but only the non-zero masks, sum and largest digit of d (not its digits).
__attribute__((target_clones("arch=x86-64-v3", "default")))
bool split_word_masks(const float* words, uint32_t n, double scale, const DigitPacking& P, const DigitMaskTable& M,
                      WordDigits* d) {
  const double inv = 1.0 / M.lo_power, lo_power = M.lo_power;
  double u[kWordBlock];
  int32_t hi[kWordBlock], lo[kWordBlock];
  const bool valid = word_integers(words, n, scale, P, u);
  for (uint32_t w = 0; w < n; ++w) {  // vectorised
    const double q = (double)(int32_t)((u[w] + 0.5) * inv);  // exact floor, as in split_words
    hi[w] = (int32_t)q;
    lo[w] = (int32_t)(u[w] - q * lo_power);
  }
  const uint64_t* E = M.entry.data();
  const uint32_t shift = M.lo_digits;
  uint64_t sum = 0, max = 0;
  for (uint32_t w = 0; w < n; ++w) {
    const uint64_t a = E[lo[w]], b = E[hi[w]];
    d->nonzero[w] = (uint32_t)((a & 0x3fffffu) | (b & 0x3fffffu) << shift);
    sum += (a >> 22 & 0x3fffffu) + (b >> 22 & 0x3fffffu);
    max = std::max(max, std::max(a >> 44, b >> 44));
  }
  d->sum = sum;
  d->max = (uint32_t)max;
  return valid;
}

// Unpack every index word into digits: thread t calls sinks[t](first_word, n, digits) for the blocks
// of its contiguous word range, in increasing order, skipping blocks of +0.0f words (no digits: most
// of them at low density); on a private copy of the sink, moved back at the end. Returns false if a
// word is not a valid packed integer or a sink rejects a block. With `masks`, only the digits' non-zero
// masks, sum and largest are filled in (split_word_masks), not the digits.
template <typename Sink>
bool unpack_digits(const CodecLayout& L, const float* index, double scale, int nt, std::vector<Sink>& sinks,
                   const DigitMaskTable* masks = nullptr) {
  const uint64_t words = L.index.words();
  const uint32_t* raw = reinterpret_cast<const uint32_t*>(index);
  int bad = 0;
#pragma omp parallel num_threads(nt) reduction(| : bad)
  {
    uint64_t wb, we;
    split_range(words, omp_get_num_threads(), omp_get_thread_num(), &wb, &we);
    Sink sink = std::move(sinks[omp_get_thread_num()]);  // thread-private (no false sharing)
    WordDigits d;
    for (uint64_t w = wb; w < we && !bad; w += kWordBlock) {
      const uint32_t n = (uint32_t)std::min<uint64_t>(kWordBlock, we - w);
      uint32_t any = 0;
      for (uint32_t i = 0; i < n; ++i) any |= raw[w + i];
      if (!any) continue;
      const bool valid = masks ? split_word_masks(index + w, n, scale, L.index, *masks, &d)
                               : split_words(index + w, n, scale, L.index, &d);
      if (!valid || !sink(w, n, d)) bad = 1;
    }
    sinks[omp_get_thread_num()] = std::move(sink);
  }
  return bad == 0;
}

// at[m][j]: the position of the j-th lowest set bit of the byte m (j < count[m] = popcount(m); a
// table, as the baseline x86-64 target has no popcount instruction).
struct SetBitTable {
  uint8_t at[256][8] = {};
  uint8_t count[256] = {};
  constexpr SetBitTable() {
    for (int m = 0; m < 256; ++m)
      for (int b = 0; b < 8; ++b)
        if (m >> b & 1) at[m][count[m]++] = (uint8_t)b;
  }
};
constexpr SetBitTable kSetBit;

// The weight of a weight code (lhc::weight_of_code) and its exact inverse, by table: see
// PeelTable::weight.
constexpr double kWeights[4] = {1.0, 2.0, -1.0, -2.0};
constexpr double kInverseWeights[4] = {1.0, 0.5, -1.0, -0.5};
constexpr uint32_t kCodeMask = (1u << kWeightCodeBits) - 1;

// Peeling state of one group of a segmented table (three segments of seg_len cells; cell j*seg_len + o
// is offset o of segment j). Per cell: how many unresolved keys it holds, and the XOR of their
// records -- position in the key list and packed cells -- so that when one key is left the state
// holds that key's record and peeling needs no lookup; then the cell's `block` values. For block 1
// that is 32 bytes, one cache line for everything a cell needs.
// A packed cell is (offset << kWeightCodeBits) | weight code: below 2^32 as seg_len <= kMaxSegLen
// (checked when a layout is built).
union CellSlot {
  uint32_t word[2];  // word[0] the low half of bits (x86-64 is little-endian)
  uint64_t bits;     // the state slots, updated two words at a time
  double value;
};  // value slots are only ever used as value; state slots as word or bits (GCC defines union punning)

class PeelTable {
 public:
  void reset(uint64_t seg_len, uint64_t block) {
    seg_len_ = seg_len;
    stride_ = kStateSlots + block;
    slots_.resize(cells() * stride_);
  }
  uint64_t cells() const { return 3 * seg_len_; }
  uint32_t& deg(uint64_t c) { return slots_[c * stride_].word[0]; }
  uint32_t& pos(uint64_t c) { return slots_[c * stride_].word[1]; }
  uint32_t& packed(uint64_t c, int j) { return slots_[c * stride_ + 1 + j / 2].word[j % 2]; }
  double* values(uint64_t c) { return &slots_[c * stride_ + kStateSlots].value; }
  void clear_state(uint64_t c) {
    for (uint64_t i = 0; i < kStateSlots; ++i) slots_[c * stride_ + i].word[0] = slots_[c * stride_ + i].word[1] = 0;
  }
  // The cell a packed cell e of segment j names.
  uint64_t cell(int j, uint32_t e) const { return (uint64_t)j * seg_len_ + (e >> kWeightCodeBits); }
  // The weight a packed cell carries (+-1, +-2) and its inverse, by table: a conditional here
  // compiles to a branch that a random sign mispredicts half the time (measured with +-1 signs: 1.5
  // mispredictions per peeled key).
  static double weight(uint32_t e) { return kWeights[e & kCodeMask]; }
  static double inverse_weight(uint32_t e) { return kInverseWeights[e & kCodeMask]; }
  // The segment (0, 1, 2) of a group cell, without a branch.
  int segment(uint64_t c) const { return (int)(c >= seg_len_) + (int)(c >= 2 * seg_len_); }
  // A key's record as the state slots hold it: its position p in the high half of slot 0 (above the
  // degree), its packed cells e[3] in slots 1 and 2.
  struct Record {
    uint64_t pos, cells01, cells2;
  };
  static Record record(uint32_t p, const uint32_t e[3]) {
    return {(uint64_t)p << 32, (uint64_t)e[0] | (uint64_t)e[1] << 32, (uint64_t)e[2]};
  }
  // Put a key into cell c (delta 1) or take it out (delta -1). Integer additions and XORs commute:
  // states do not depend on the order of the updates. One 64-bit operation per slot: the degree (low
  // half) never carries into the position (high half), as it stays below 2^32 and is never
  // decremented below 0 (callers check).
  void update(uint64_t c, const Record& k, uint32_t delta) {
    CellSlot* s = &slots_[c * stride_];
    s[0].bits = (s[0].bits ^ k.pos) + (uint64_t)(int64_t)(int32_t)delta;
    s[1].bits ^= k.cells01;
    s[2].bits ^= k.cells2;  // the high half is padding
  }
  // Prefetch the cell a packed cell of segment j names, clamped into the table: the packed value may
  // be a stale XOR (a cell that is no longer pure), and a prefetch needs no branch to skip it.
  void prefetch_packed(int j, uint32_t e) { prefetch((uint64_t)j * seg_len_ + std::min<uint64_t>(e >> kWeightCodeBits, seg_len_ - 1)); }
  void prefetch(uint64_t c) {
    __builtin_prefetch(&slots_[c * stride_], 1, 3);
    __builtin_prefetch(&slots_[c * stride_ + stride_ - 1], 1, 3);  // the last value (block > 1)
  }

 private:
  static constexpr uint64_t kStateSlots = 3;  // degree, position, 3 packed cells, padding
  HugeVector<CellSlot> slots_;
  uint64_t seg_len_ = 0, stride_ = kStateSlots + 1;
};

// kc[3i + j] = (offset of cell j of keys[i] in its segment << kWeightCodeBits) | its weight code, for i < count: the
// packed cells of PeelTable. A pure function of each key, written as a flat loop so the compiler can
// vectorise the 64-bit hashing; cloned for AVX-512 (64-bit multiplies in vector registers) and AVX2,
// chosen at load time.
__attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
void hash_cells(const SegmentedTable& table, const uint32_t* keys, uint32_t count, uint32_t* kc) {
  const SegmentedTable t = table;
  for (uint32_t i = 0; i < count; ++i) {
    const uint64_t h = key_hash(t, keys[i]);
    const uint64_t first = 3 * hash_group(t, h);  // the key's first segment
    for (int j = 0; j < 3; ++j) {
      uint32_t code;
      const uint64_t offset = key_cell_code(t, h, j, &code) - (first + (uint64_t)j) * t.seg_len;
      kc[3 * (uint64_t)i + j] = (uint32_t)(offset << kWeightCodeBits) | code;
    }
  }
}

// group[i] = the sketch group of keys[i], for i < count; vectorised like hash_cells.
__attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
void hash_groups(const SegmentedTable& table, const uint32_t* keys, size_t count, uint32_t* group) {
  const SegmentedTable t = table;
  for (size_t i = 0; i < count; ++i) group[i] = (uint32_t)key_group(t, keys[i]);
}

// Add weight * x[key block] into the value sketch for keys[0, count), in that order; all of them in the
// group whose first cell is `base`. `kc` is scratch for the keys' cells, hashed in one vectorisable
// pass. The group's cells stay in cache, but a group's keys are spread over all of x: each key's
// values are a miss to memory, so they are prefetched well ahead.
void scatter_keys(const CodecLayout& L, const float* x, const uint32_t* keys, size_t count, uint64_t base,
                  float* sketch, std::vector<uint32_t>& kc) {
  constexpr size_t kAhead = 16;
  const uint64_t B = L.block;
  kc.resize(3 * count);
  hash_cells(L.sketch, keys, (uint32_t)count, kc.data());
  auto cell_values = [&](size_t i, int j) {  // the values of cell j of keys[i]
    return sketch + (base + (uint64_t)j * L.sketch.seg_len + (kc[3 * i + j] >> kWeightCodeBits)) * B;
  };
  for (size_t i = 0; i < count; ++i) {
    if (i + kAhead < count) {
      __builtin_prefetch(x + (uint64_t)keys[i + kAhead] * B, 0, 0);
      // The group's cells were zero-filled with the whole payload, so they are not in cache either.
      for (int j = 0; j < 3; ++j) __builtin_prefetch(cell_values(i + kAhead, j), 1, 3);
    }
    const uint64_t lo = (uint64_t)keys[i] * B;
    const uint64_t len = std::min<uint64_t>(B, L.numel - lo);
    const float* src = x + lo;
    for (int j = 0; j < 3; ++j) {
      // w * v is exact (w = +-1, +-2), and dst + (-1 * v) is dst - v bit for bit (IEEE subtraction is
      // addition of the negation); a multiplied-in weight needs no branch: a random sign mispredicts
      // half the time.
      float* dst = cell_values(i, j);
      const float w = (float)PeelTable::weight(kc[3 * i + j]);
      for (uint64_t l = 0; l < len; ++l) dst[l] += w * src[l];
    }
  }
}

// Count keys[0, count), all of one group of `table`, into the states of t (cleared before): each
// key's cells are hashed a chunk at a time (vectorised; kc is scratch) and its cells' lines are
// prefetched well ahead, as each key costs only a few instructions.
void build_states(PeelTable& t, const SegmentedTable& table, const uint32_t* keys, uint32_t count,
                  std::vector<uint32_t>& kc) {
  constexpr uint32_t kChunk = 4096, kAhead = 32;
  kc.resize(3 * kChunk);
  for (uint32_t first = 0; first < count; first += kChunk) {
    const uint32_t n = std::min(kChunk, count - first);
    hash_cells(table, keys + first, n, kc.data());
    for (uint32_t i = 0; i < n; ++i) {
      if (i + kAhead < n)
        for (int j = 0; j < 3; ++j) t.prefetch(t.cell(j, kc[3 * (i + kAhead) + j]));
      const uint32_t* e = &kc[3 * i];
      const PeelTable::Record k = PeelTable::record(first + i, e);
      for (int j = 0; j < 3; ++j) t.update(t.cell(j, e[j]), k, 1);
    }
  }
}

// Breadth-first peeling of the keys at positions [0, count) whose states build_states put in t.
// Cells pure at the start are queued in increasing order; resolving a key queues the cells it leaves
// pure. Breadth-first order keeps each key's chain of earlier-peeled dependencies as short as the
// hypergraph allows, which bounds how far float rounding errors propagate (see
// layout.sketch_table_for).
// `resolve(pos, cell, coef)` removes the key's contribution from its cells' values; cell[0] is the
// pure cell it is read from, cell[1] and cell[2] the others (false aborts); coef[0] is the inverse of
// the key's weight in cell[0] (its value is coef[0] times that cell), coef[1] and coef[2] its weights
// in the other two. Returns the number of
// keys resolved; sets `*bad` if the states are inconsistent (a guard: states built by build_states
// are consistent whatever the payload holds).
template <typename Resolve>
uint32_t peel(PeelTable& t, uint32_t count, std::vector<uint32_t>& queue, Resolve&& resolve, bool* bad) {
  const uint64_t cells = t.cells();
  // A cell enters the queue once at most: pure at the start, or when its count drops to 1 (counts
  // only decrease, and a cell pure at the start only drops to 0).
  queue.resize(cells);
  uint64_t tail = 0;
  for (uint64_t c = 0; c < cells; ++c) {
    queue[tail] = (uint32_t)c;
    tail += t.deg(c) == 1;
  }
  uint32_t resolved = 0;
  constexpr uint64_t kAhead = 8;
  for (uint64_t head = 0; head < tail; ++head) {
    // Software pipeline: load the state of the cell queued 2 * kAhead ahead; kAhead ahead, its state
    // names its key's other cells (if it is still pure then, it stays so): load those too.
    // Branch-free apart from the stale-entry test: the weights of random keys and which of its three
    // cells a key is read from are coin flips to a branch predictor.
    if (head + kAhead < tail) {
      const uint64_t c = queue[head + kAhead];
      for (int j = 0; j < 3; ++j) t.prefetch_packed(j, t.packed(c, j));
      if (head + 2 * kAhead < tail) t.prefetch(queue[head + 2 * kAhead]);
    }
    const uint64_t c = queue[head];
    if (t.deg(c) != 1) continue;  // its last key was resolved through another cell meanwhile
    const uint32_t pos = t.pos(c);
    const uint32_t e[3] = {t.packed(c, 0), t.packed(c, 1), t.packed(c, 2)};
    const uint64_t cell[3] = {t.cell(0, e[0]), t.cell(1, e[1]), t.cell(2, e[2])};
    const int pure = t.segment(c);  // the key's cell in c's segment is c, if the state is consistent
    if (cell[pure] != c || pos >= count) { *bad = true; return resolved; }
    // The pure cell first, then the other two in their order (which fixes the queue order).
    const int j1 = (int)(pure == 0), j2 = 2 - (int)(pure == 2);
    const uint64_t ordered[3] = {c, cell[j1], cell[j2]};
    const double coef[3] = {PeelTable::inverse_weight(e[pure]), PeelTable::weight(e[j1]), PeelTable::weight(e[j2])};
    if (!resolve(pos, ordered, coef)) return resolved;
    ++resolved;
    // The pure cell is left with no key; nothing reads its state again (it is dequeued already).
    const PeelTable::Record k = PeelTable::record(pos, e);
    for (int j = 1; j < 3; ++j) {
      const uint64_t d = ordered[j];
      if (t.deg(d) == 0) { *bad = true; return resolved; }
      t.update(d, k, (uint32_t)-1);
      queue[tail] = (uint32_t)d;
      tail += t.deg(d) == 1;
    }
  }
  return resolved;
}

// A sorted key list held as consecutive parts (one per scanning thread), so that building it
// needs no concatenation copy.
struct KeyParts {
  std::vector<std::vector<uint32_t>> parts;
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

// Bloom index: candidates, then exact integer peeling of the counters. Returns a DecodeStatus and
// the keys whose aggregated count is >= 1, bucketed by sketch group (one part).
int32_t bloom_support(const CodecLayout& L, const DecodeInputs& in, const float* index, int nt, GroupedKeys* support,
                      DecodeStats* st) {
  const uint64_t n = in.world_size;
  const uint64_t bcells = L.bloom.cells();
  std::vector<uint32_t> count(bcells, 0);
  struct CountSink {
    uint32_t* count;
    uint64_t cells, digit_max, sum;
    uint32_t per_word;
    bool operator()(uint64_t first_word, uint32_t words, const WordDigits& d) {
      if (d.max > digit_max) return false;
      sum += d.sum;
      for (uint32_t w = 0; w < words; ++w)
        for (uint32_t i = 0; i < per_word; ++i) {
          const uint64_t pos = (first_word + w) * per_word + i;
          if (pos < cells)
            count[pos] = d.digit[i][w];
          else if (d.digit[i][w])
            return false;  // a digit beyond the last counter
        }
      return true;
    }
  };
  std::vector<CountSink> sinks(nt, CountSink{count.data(), bcells, n * (uint64_t)L.digit_cap, 0, L.index.per_word});
  const bool valid = unpack_digits(L, index, in.scale, nt, sinks);
  for (const auto& k : sinks) st->index_total += k.sum;
  if (!valid || st->index_total != 3 * in.total_keys) return kDecodeIndexCorrupt;

  // Candidates: keys whose three counters are all non-zero (a superset of the true support).
  std::vector<std::vector<uint32_t>> local(nt);
#pragma omp parallel num_threads(nt)
  {
    uint64_t kb, ke;
    split_range(L.num_keys, omp_get_num_threads(), omp_get_thread_num(), &kb, &ke);
    auto& mine = local[omp_get_thread_num()];
    for (uint64_t k = kb; k < ke; ++k) {
      // Most keys fail at the first counter at the densities where the Bloom index is chosen.
      const uint64_t h = key_hash(L.bloom, k);
      int weight;  // unused: index tables add counts
      if (count[key_cell(L.bloom, h, 0, &weight)] && count[key_cell(L.bloom, h, 1, &weight)] &&
          count[key_cell(L.bloom, h, 2, &weight)])
        mine.push_back((uint32_t)k);
    }
  }
  std::vector<uint32_t> cand;
  for (auto& v : local) cand.insert(cand.end(), v.begin(), v.end());
  st->candidates = cand.size();

  // Each candidate's count is the number of ranks holding it; false positives come out exactly 0.
  // Counts are integers below 2^22, exact in the table's doubles.
  PeelTable t;
  t.reset(L.bloom.seg_len, 1);
  for (uint64_t c = 0; c < bcells; ++c) {
    t.clear_state(c);
    t.values(c)[0] = count[c];
  }
  std::vector<uint32_t>().swap(count);
  std::vector<uint32_t> found, scratch;
  build_states(t, L.bloom, cand.data(), (uint32_t)cand.size(), scratch);
  found.reserve(cand.size());
  bool bad = false;
  const uint32_t resolved = peel(
      t, (uint32_t)cand.size(), scratch,
      [&](uint32_t pos, const uint64_t* cell, const double*) {
        const double c = t.values(cell[0])[0];
        if (c > (double)n) { bad = true; return false; }
        for (int j = 0; j < 3; ++j) {
          double& v = t.values(cell[j])[0];
          if (v < c) { bad = true; return false; }
          v -= c;
        }
        if (c != 0.0) found.push_back(cand[pos]);
        return true;
      },
      &bad);
  if (bad) return kDecodeIndexCorrupt;
  if (resolved != cand.size()) return kDecodeIndexPeelFailed;
  for (uint64_t c = 0; c < bcells; ++c)
    if (t.values(c)[0] != 0.0) return kDecodeIndexCorrupt;
  std::sort(found.begin(), found.end());
  st->false_positives = cand.size() - found.size();
  const SegmentedTable& T = L.sketch;
  support->by.assign(1, std::vector<HugeVector<uint32_t>>(T.groups()));
  for (uint32_t k : found) support->by[0][key_group(T, k)].push_back(k);
  return kDecodeOk;
}

// ---- Multilevel index decoding --------------------------------------------------------------------
//
// Per level: the level's known non-zero nodes (increasing, a flat array) are bucketed by the group of
// the level's fine table; each group (three segments, sized to stay in cache) is loaded, checked and
// peeled in integers by one thread; the pure cells give each node's aggregate pattern, stored by
// group (each node's slot is recorded while bucketing). Then the nodes are expanded into their
// non-zero children by contiguous ranges of positions, one per thread, so the children come out
// increasing (at the finest level: the support keys, bucketed by sketch group as they are produced).
// Integer peeling is exact and every output lands at a place fixed by the node order, so nothing
// depends on the number of threads or their scheduling.

// Turn per-part group histograms into write cursors: hist[p][g] becomes where part p's first key of
// group g goes (groups in order, parts in order within a group), and offsets[g] the first position of
// group g (offsets[groups] = the total). Stable bucketing of parts that cover increasing key ranges.
void histogram_to_cursors(std::vector<std::vector<uint64_t>>& hist, uint64_t groups, std::vector<uint64_t>* offsets) {
  uint64_t run = 0;
  for (uint64_t g = 0; g < groups; ++g) {
    (*offsets)[g] = run;
    for (auto& h : hist) {
      const uint64_t c = h[g];
      h[g] = run;
      run += c;
    }
  }
  (*offsets)[groups] = run;
}

// The increasing `keys` [0, count), bucketed (stably) by their group of `table`: group g's keys are
// bucketed[goff[g], goff[g + 1]), increasing, and the key at position i went to bucketed[slot[i]].
// Two parallel passes over contiguous ranges (a histogram, then the scatter: one sequential stream
// per group); groups are hashed a chunk at a time (vectorised) in both.
void bucket_keys(const SegmentedTable& table, const uint32_t* keys, uint64_t count, int nt,
                 std::vector<uint32_t>* bucketed, std::vector<uint32_t>* slot, std::vector<uint64_t>* goff) {
  const uint64_t groups = table.groups();
  constexpr size_t kChunk = 2048;
  bucketed->resize(count);
  slot->resize(count);
  goff->assign(groups + 1, 0);
  std::vector<std::vector<uint64_t>> hist(nt, std::vector<uint64_t>(groups, 0));
  auto pass = [&](int part, bool scatter) {
    uint64_t b, e;
    split_range(count, nt, part, &b, &e);
    uint64_t* h = hist[part].data();
    uint32_t group[kChunk];
    for (uint64_t i = b; i < e; i += kChunk) {
      const size_t n = (size_t)std::min<uint64_t>(kChunk, e - i);
      hash_groups(table, keys + i, n, group);
      if (scatter) {
        for (size_t j = 0; j < n; ++j) {
          const uint64_t at = h[group[j]]++;
          (*bucketed)[at] = keys[i + j];
          (*slot)[i + j] = (uint32_t)at;
        }
      } else {
        for (size_t j = 0; j < n; ++j) ++h[group[j]];
      }
    }
  };
  // Parts are fixed ranges (nt of them, whatever the team size), processed by whichever thread.
#pragma omp parallel for num_threads(nt) schedule(static, 1)
  for (int p = 0; p < nt; ++p) pass(p, false);
  histogram_to_cursors(hist, groups, goff);
#pragma omp parallel for num_threads(nt) schedule(static, 1)
  for (int p = 0; p < nt; ++p) pass(p, true);
}

// The two-key stopping sets left when peeling stalls: two unresolved keys a < b (positions) that
// share all three cells, each cell holding just the two of them. Cell j holds
// R_j = w_j(a) v_a + w_j(b) v_b; two of the cells solve the pair as lhc::pair_cells states (one
// subtraction and one division, about as exact as reading a pure cell). A pair whose weight ratios
// w_j(a) / w_j(b) agree in all three cells (5/128 of them) is unsolvable and stays unresolved.
// `solve(pos_a, pos_b, cells, wa, wb, va, vb)` receives each solved pair (its cells, its keys'
// weights there, its values), in increasing order of its cell in the group's first segment; the
// states are left as they are (the pair's cells are not read again). The value sketch and the
// multilevel fine tables (signed integer patterns, checked by their caller) share it.
// Runs only after a stalled peel: it hashes every key of the group once. Returns the keys solved.
template <typename Solve>
uint32_t solve_pairs(PeelTable& t, const SegmentedTable& table, const uint32_t* keys, uint32_t count, uint64_t block,
                     std::vector<uint32_t>& kc, Solve&& solve) {
  const uint64_t seg_len = t.cells() / 3;
  // Candidate cells of the first segment: two keys left, and the XOR of their packed cells names the
  // same offset in every segment (only the weight codes may differ).
  std::vector<char> candidate(seg_len, 0);
  bool any = false;
  for (uint64_t o = 0; o < seg_len; ++o) {
    if (t.deg(o) != 2) continue;
    bool same = true;
    for (int j = 0; j < 3; ++j) same &= (t.packed(o, j) >> kWeightCodeBits) == 0;
    candidate[o] = same;
    any |= same;
  }
  if (!any) return 0;
  // Every key whose first cell is a candidate, peeled or not, by cell then position. A peeled key
  // never has the same three cells as an unresolved one (it could not have been alone in any of
  // them), so within a cell the pair is the two keys with equal cells whose positions XOR to the
  // state's.
  kc.resize(3 * (uint64_t)count);
  hash_cells(table, keys, count, kc.data());
  std::vector<std::pair<uint32_t, uint32_t>> members;  // (first cell, position)
  for (uint32_t p = 0; p < count; ++p) {
    const uint32_t first = kc[3 * (uint64_t)p] >> kWeightCodeBits;
    if (candidate[first]) members.emplace_back(first, p);
  }
  std::sort(members.begin(), members.end());
  uint32_t solved = 0;
  std::vector<double> va(block), vb(block);
  for (size_t i = 0; i < members.size();) {
    size_t e = i;
    while (e < members.size() && members[e].first == members[i].first) ++e;
    const uint64_t o = members[i].first;
    for (size_t x = i; x < e; ++x)
      for (size_t y = x + 1; y < e; ++y) {
        const uint32_t a = members[x].second, b = members[y].second;
        if ((a ^ b) != t.pos(o)) continue;
        const uint32_t* ea = &kc[3 * (uint64_t)a];
        const uint32_t* eb = &kc[3 * (uint64_t)b];
        uint64_t cell[3];
        bool pair = true;
        for (int j = 0; j < 3; ++j) {
          cell[j] = t.cell(j, ea[j]);
          pair &= (ea[j] >> kWeightCodeBits) == (eb[j] >> kWeightCodeBits) && t.deg(cell[j]) == 2 &&
                  t.pos(cell[j]) == (a ^ b);
        }
        if (!pair) continue;
        int wa[3], wb[3];
        for (int j = 0; j < 3; ++j) {
          wa[j] = weight_of_code(ea[j] & kCodeMask);
          wb[j] = weight_of_code(eb[j] & kCodeMask);
        }
        const PairCells pc = pair_cells(wa, wb);
        if (pc.det == 0) continue;  // proportional weights: unsolvable
        const double* Rp = t.values(cell[pc.p]);
        const double* Rq = t.values(cell[pc.q]);
        const double det = pc.det;
        const double wap = wa[pc.p], waq = wa[pc.q], wbp = wb[pc.p], wbq = wb[pc.q];
        for (uint64_t l = 0; l < block; ++l) {
          va[l] = (wbq * Rp[l] - wbp * Rq[l]) / det;
          vb[l] = (wap * Rq[l] - waq * Rp[l]) / det;
        }
        for (int j = 0; j < 3; ++j) t.deg(cell[j]) = 0;
        solve(a, b, cell, wa, wb, va.data(), vb.data());
        solved += 2;
      }
    i = e;
  }
  return solved;
}

// Fine words [0, n) times `scale` as exact integers of magnitude below 2^22 into dst (a SUM of such
// integers is exact; an AVERAGE is within 1/2 of one after scaling back). Returns kDecodeIndexCorrupt
// for a word that is not an integer (or NaN), else kDecodeIndexOverflow for one of magnitude 2^22 or
// more (more nodes summed into one cell than the layout was sized for: reported, never decoded), else
// kDecodeOk. A bad word is stored as 0.
int32_t read_fine_words(const float* src, uint64_t n, double scale, double* dst) {
  uint32_t seen = kFineWordOk;
  for (uint64_t i = 0; i < n; ++i) {
    long long v;
    seen |= read_fine_word(src[i], scale, &v);  // lhc_layout.h, shared with the CUDA kernels
    dst[i] = (double)v;
  }
  if (seen & kFineWordCorrupt) return kDecodeIndexCorrupt;
  return (seen & kFineWordOverflow) ? kDecodeIndexOverflow : kDecodeOk;
}

// The more severe of two read_fine_words statuses: corrupt over overflow over ok.
inline int32_t worse_word_status(int32_t a, int32_t b) {
  return (b == kDecodeIndexCorrupt || (b != kDecodeOk && a == kDecodeOk)) ? b : a;
}

// One fine level of a multilevel index: exact integer peeling of its table over the known non-zero
// `nodes` (increasing). A pure cell holds one node's aggregate pattern times the node's sign there,
// whose base-(n+1) digits are its children's counts; where peeling stalls, two nodes sharing all three
// cells are solved from two of them (solve_pairs) unless their signs are proportional. Groups of the table are peeled in parallel (see above); the patterns are stored
// by group, node p's at pattern[slot[p] * words, (slot[p] + 1) * words) (slot empty: one group, slot[p]
// = p). Reading them back in node order reads one sequential stream per group. Returns a DecodeStatus
// with the precedence of a whole-table peel: a malformed word (corrupt, then overflow) anywhere; then
// an inconsistent peel (a pure cell that is no pattern; a solved pair that is no pair of patterns or
// disagrees with its third cell); then a node left unpeeled; then words left over.
int32_t peel_fine_level(const CodecLayout& L, uint32_t l, const DecodeInputs& in, const float* payload, int nt,
                        const std::vector<uint32_t>& nodes, std::vector<uint32_t>* pattern,
                        std::vector<uint32_t>* slot) {
  const uint64_t base = L.index.base, w = L.fine_digits[l], wpg = L.fine_words[l];
  const SegmentedTable& table = L.fine[l];
  const uint64_t below = l + 1 < L.fine_levels ? L.span[l + 1] : 1;
  if (w == 0 || wpg == 0 || L.span[l] != w * wpg * below || table.seg_count < 3 || table.seg_count % 3)
    return kDecodeIndexCorrupt;  // a layout guard
  const uint64_t groups = table.groups(), gcells = table.group_cells();
  const float* fine = payload + L.fine_offset[l];
  double word_limit = 1.0;
  for (uint64_t i = 0; i < w; ++i) word_limit *= (double)base;
  const uint64_t M = nodes.size();
  pattern->resize(M * wpg);
  std::vector<uint32_t> bucketed;
  std::vector<uint64_t> goff{0, M};
  slot->clear();
  if (groups > 1) bucket_keys(table, nodes.data(), M, nt, &bucketed, slot, &goff);
  const uint32_t* gnodes = groups > 1 ? bucketed.data() : nodes.data();
  // Per group: word status, and whether its peel was inconsistent, incomplete, or left words over.
  std::vector<int32_t> word_status(groups, kDecodeOk);
  std::vector<char> bad(groups, 0), failed(groups, 0), leftover(groups, 0);
#pragma omp parallel num_threads(nt)
  {
    PeelTable t;
    std::vector<uint32_t> scratch;
#pragma omp for schedule(dynamic, 1)
    for (int64_t g = 0; g < (int64_t)groups; ++g) {
      t.reset(table.seg_len, wpg);
      int32_t ws = kDecodeOk;
      for (uint64_t c = 0; c < gcells; ++c) {
        t.clear_state(c);
        ws = worse_word_status(ws, read_fine_words(fine + ((uint64_t)g * gcells + c) * wpg, wpg, in.scale, t.values(c)));
      }
      word_status[g] = ws;
      if (ws != kDecodeOk) continue;
      const uint64_t kb = goff[g], kn = goff[g + 1] - kb;
      build_states(t, table, gnodes + kb, (uint32_t)kn, scratch);
      uint32_t* gpat = pattern->data() + kb * wpg;
      bool group_bad = false;
      // Words are exact integers of magnitude below 2^22 held in doubles, so every product by a sign
      // and every sum below is exact.
      uint32_t resolved = peel(
          t, (uint32_t)kn, scratch,
          [&](uint32_t pos, const uint64_t* cell, const double* coef) {
            const double* src = t.values(cell[0]);
            uint32_t* pat = gpat + (uint64_t)pos * wpg;
            for (uint64_t i = 0; i < wpg; ++i) {
              const double u = coef[0] * src[i];  // the node's pattern word: its sign there times the cell
              if (!(u >= 0.0 && u < word_limit)) { group_bad = true; return false; }
              pat[i] = (uint32_t)u;
            }
            double* d0 = t.values(cell[0]);
            for (uint64_t i = 0; i < wpg; ++i) d0[i] = 0.0;
            for (int j = 1; j < 3; ++j) {
              double* d = t.values(cell[j]);
              for (uint64_t i = 0; i < wpg; ++i) d[i] -= coef[j] * (double)pat[i];
            }
            return true;
          },
          &group_bad);
      if (!group_bad && resolved < kn)
        resolved += solve_pairs(t, table, gnodes + kb, (uint32_t)kn, wpg, scratch,
                                [&](uint32_t pa, uint32_t pb, const uint64_t* cell, const int* wa, const int* wb,
                                    const double* va, const double* vb) {
                                  if (group_bad) return;
                                  uint32_t* pat_a = gpat + (uint64_t)pa * wpg;
                                  uint32_t* pat_b = gpat + (uint64_t)pb * wpg;
                                  for (uint64_t i = 0; i < wpg; ++i) {
                                    // Integer patterns (a division by det = +-2 that leaves a half is
                                    // no pair of patterns) that explain all three cells.
                                    const double a = va[i], b = vb[i];
                                    bool ok = a >= 0.0 && a < word_limit && a == std::floor(a) && b >= 0.0 &&
                                              b < word_limit && b == std::floor(b);
                                    for (int j = 0; j < 3; ++j) ok &= t.values(cell[j])[i] == wa[j] * a + wb[j] * b;
                                    if (!ok) { group_bad = true; return; }
                                    pat_a[i] = (uint32_t)a;
                                    pat_b[i] = (uint32_t)b;
                                  }
                                  for (int j = 0; j < 3; ++j)
                                    for (uint64_t i = 0; i < wpg; ++i) t.values(cell[j])[i] = 0.0;
                                });
      bad[g] = group_bad;
      if (group_bad) continue;
      if (resolved != kn) { failed[g] = 1; continue; }
      for (uint64_t c = 0; c < gcells && !leftover[g]; ++c)
        for (uint64_t i = 0; i < wpg; ++i)
          if (t.values(c)[i] != 0.0) leftover[g] = 1;
    }
  }
  int32_t ws = kDecodeOk;
  for (int32_t s : word_status) ws = worse_word_status(ws, s);
  if (ws != kDecodeOk) return ws;
  if (std::find(bad.begin(), bad.end(), 1) != bad.end()) return kDecodeIndexCorrupt;
  if (std::find(failed.begin(), failed.end(), 1) != failed.end()) return kDecodeIndexPeelFailed;
  if (std::find(leftover.begin(), leftover.end(), 1) != leftover.end()) return kDecodeIndexCorrupt;
  return kDecodeOk;
}

// Children of the nodes of fine level l from their patterns, in parallel over contiguous ranges of
// node positions: each child's count is at most its node's count (a child's ranks all hold the node)
// and together at least it (each of those ranks holds a key under some child). Part p (of nt, fixed
// ranges whatever the team size) calls sinks[p](child, count) for the non-zero children of its range
// in increasing order, on a private copy of the sink (no false sharing), moved back at the end. Adds
// the children's counts to *total. Returns false on an inconsistent pattern.
template <typename Sink>
bool expand_children(const CodecLayout& L, uint32_t l, int nt, const std::vector<uint32_t>& nodes,
                     const std::vector<uint32_t>& counts, const std::vector<uint32_t>& pattern,
                     const std::vector<uint32_t>& slot, std::vector<Sink>& sinks, uint64_t* total) {
  const uint32_t base = L.index.base, w = L.fine_digits[l], wpg = L.fine_words[l];
  const uint64_t children = (uint64_t)w * wpg;
  const uint64_t below = l + 1 < L.fine_levels ? L.span[l + 1] : 1;
  const uint64_t child_limit = (L.num_keys + below - 1) / below;
  // Digit j of a word u < base^w <= 2^22 is q_j - base q_{j+1} with q_j = floor(u / base^j), each
  // computed independently (no chain of divisions) as floor((u + 0.5) / base^j): a double product with
  // the rounded reciprocal is the exact quotient (see split_words; the argument holds for any divisor
  // up to 2^22).
  if (w > kMaxPerWord) return false;  // a layout guard
  double inv[kMaxPerWord + 1];
  double pw = 1.0;
  for (uint32_t j = 0; j <= w; ++j, pw *= base) inv[j] = 1.0 / pw;
  const uint64_t M = nodes.size();
  std::vector<uint64_t> sums(nt, 0);
  std::vector<char> bad(nt, 0);
#pragma omp parallel for num_threads(nt) schedule(static, 1)
  for (int part = 0; part < nt; ++part) {
    Sink sink = std::move(sinks[part]);
    uint64_t pb, pe, sum = 0;
    split_range(M, nt, part, &pb, &pe);
    bool ok = true;
    constexpr uint64_t kAhead = 16;  // the patterns are read from one stream per fine group
    for (uint64_t p = pb; p < pe && ok; ++p) {
      if (!slot.empty() && p + kAhead < pe) __builtin_prefetch(pattern.data() + slot[p + kAhead] * (uint64_t)wpg, 0, 0);
      const uint32_t* pat = pattern.data() + (slot.empty() ? p : slot[p]) * (uint64_t)wpg;
      const uint64_t first = (uint64_t)nodes[p] * children;
      const uint32_t cap = counts[p];
      uint64_t node_sum = 0;
      for (uint32_t i = 0; i < wpg; ++i) {
        const double u = pat[i];
        if (u == 0.0) continue;
        uint32_t q[kMaxPerWord + 1];
        for (uint32_t j = 0; j <= w; ++j) q[j] = (uint32_t)(int32_t)((u + 0.5) * inv[j]);
        // Branch-free (the zero digits are unpredictable): every digit is offered to the sink, which
        // keeps the non-zero ones.
        const uint64_t first_child = first + (uint64_t)i * w;
        uint32_t wrong = q[w] != 0;  // not below base^w (peel_fine_level rules that out)
        for (uint32_t j = 0; j < w; ++j) {
          const uint32_t c = q[j] - base * q[j + 1];
          wrong |= (uint32_t)(c > cap) | ((uint32_t)(first_child + j >= child_limit) & (uint32_t)(c != 0));
          node_sum += c;
          sink.offer((uint32_t)(first_child + j), c);
        }
        if (wrong) { ok = false; break; }
      }
      if (node_sum < cap) ok = false;
      sum += node_sum;
    }
    sink.finish();
    sinks[part] = std::move(sink);
    sums[part] = sum;
    bad[part] = !ok;
  }
  for (int p = 0; p < nt; ++p) {
    *total += sums[p];
    if (bad[p]) return false;
  }
  return true;
}

// The children of a level above the finest: the next level's nodes and their counts. offer() keeps
// a child with a non-zero count (stored unconditionally, kept by advancing the size).
struct ChildSink {
  std::vector<uint32_t> nodes, counts;
  uint64_t size = 0;
  void offer(uint32_t child, uint32_t c) {
    if (nodes.size() < size + 1) {
      nodes.resize(2 * size + 64);
      counts.resize(2 * size + 64);
    }
    nodes[size] = child;
    counts[size] = c;
    size += c != 0;
  }
  void finish() {
    nodes.resize(size);
    counts.resize(size);
  }
};

// The children of the finest level, the support keys, bucketed by sketch group: a chunk of keys at a
// time is hashed (vectorised) and appended to its groups' buckets (sized ahead: plain stores).
struct SupportSink {
  static constexpr uint32_t kChunk = 2048;
  struct Bucket {
    HugeVector<uint32_t> keys;
    uint64_t size = 0;
  };
  const SegmentedTable* table;
  std::vector<Bucket> buckets;
  std::vector<uint32_t> keys, group;  // a chunk of keys and their groups (+1: the offer past the last)
  uint32_t size = 0;
  void offer(uint32_t key, uint32_t c) {
    keys[size] = key;
    size += c != 0;
    if (size == kChunk) flush();
  }
  void flush() {
    for (Bucket& b : buckets)
      if (b.keys.size() < b.size + size) b.keys.resize(2 * (b.size + size));
    if (buckets.size() == 1) {
      std::copy(keys.data(), keys.data() + size, buckets[0].keys.data() + buckets[0].size);
      buckets[0].size += size;
    } else {
      hash_groups(*table, keys.data(), size, group.data());
      for (uint32_t i = 0; i < size; ++i) {
        Bucket& b = buckets[group[i]];
        b.keys[b.size++] = keys[i];
      }
    }
    size = 0;
  }
  void finish() {
    flush();
    for (Bucket& b : buckets) b.keys.resize(b.size);
  }
};

// nodes/counts = the parts' first `size` nodes and counts, concatenated in part order (in parallel).
template <typename Sink>
void concat_parts(const std::vector<Sink>& sinks, int nt, std::vector<uint32_t>* nodes, std::vector<uint32_t>* counts) {
  std::vector<uint64_t> at(sinks.size() + 1, 0);
  for (size_t p = 0; p < sinks.size(); ++p) at[p + 1] = at[p] + sinks[p].size;
  nodes->resize(at.back());
  counts->resize(at.back());
#pragma omp parallel for num_threads(nt) schedule(static, 1)
  for (int64_t p = 0; p < (int64_t)sinks.size(); ++p) {
    std::copy(sinks[p].nodes.begin(), sinks[p].nodes.begin() + sinks[p].size, nodes->begin() + at[p]);
    std::copy(sinks[p].counts.begin(), sinks[p].counts.begin() + sinks[p].size, counts->begin() + at[p]);
  }
}

// Multilevel index: the non-zero nodes of the coarsest fine level from the coarse counting bitmap,
// then each fine level peeled over exactly the non-zero nodes found above it. Returns a
// DecodeStatus and the keys with a count >= 1, in increasing order, bucketed by sketch group.
int32_t multilevel_support(const CodecLayout& L, const DecodeInputs& in, const float* payload, int nt,
                           GroupedKeys* support, DecodeStats* st) {
  const uint64_t n = in.world_size;
  if (L.fine_levels == 0 || L.fine_levels > kMaxFineLevels) return kDecodeIndexCorrupt;  // a layout guard
  Prof prof;
  const uint64_t num_nodes = L.index.digits;
  // The coarse digits: each unpacking thread appends its (increasing) non-zero nodes and counts,
  // branch-free: for each 8 digits of a word, the positions of all 8 from the table of set bits are
  // stored and the end advances by the number of non-zero ones (room for 8 past the end is kept).
  struct NodeSink {
    std::vector<uint32_t> nodes, counts;
    uint64_t size, num_nodes, sum;
    uint32_t per_word, world_size;
    bool operator()(uint64_t first_word, uint32_t words, const WordDigits& d) {
      if (d.max > world_size) return false;
      sum += d.sum;
      const uint64_t room = size + (uint64_t)words * per_word + 8;
      if (nodes.size() < room) {
        nodes.resize(2 * room);
        counts.resize(2 * room);
      }
      const uint64_t start = size;
      for (uint32_t v = 0; v < words; ++v) {
        const uint32_t first = (uint32_t)((first_word + v) * per_word);
        for (uint32_t s = 0; s < per_word; s += 8) {
          const uint32_t m = (d.nonzero[v] >> s) & 0xffu;
          for (int j = 0; j < 8; ++j) {
            nodes[size + j] = first + s + kSetBit.at[m][j];
            counts[size + j] = d.digit[s + kSetBit.at[m][j]][v];
          }
          size += kSetBit.count[m];
        }
      }
      return size == start || nodes[size - 1] < num_nodes;  // else a digit past the last node
    }
  };
  std::vector<NodeSink> sinks(nt, NodeSink{{}, {}, 0, num_nodes, 0, L.index.per_word, (uint32_t)n});
  for (NodeSink& k : sinks) {
    const uint64_t expect = std::min<uint64_t>(num_nodes, in.total_keys) / nt + 64;
    k.nodes.resize(expect);
    k.counts.resize(expect);
  }
  const bool valid = unpack_digits(L, payload + L.index_offset, in.scale, nt, sinks);
  uint64_t coarse_sum = 0;
  for (const NodeSink& k : sinks) coarse_sum += k.sum;
  // Every rank's non-zero nodes are at most its non-zero keys.
  if (!valid || coarse_sum > in.total_keys) return kDecodeIndexCorrupt;
  std::vector<uint32_t> nodes, counts, pattern, slot;
  concat_parts(sinks, nt, &nodes, &counts);
  std::vector<NodeSink>().swap(sinks);
  prof.mark("ml coarse");

  const SegmentedTable& T = L.sketch;
  const uint64_t sgroups = T.groups();
  for (uint32_t l = 0; l < L.fine_levels; ++l) {
    const int32_t status = peel_fine_level(L, l, in, payload, nt, nodes, &pattern, &slot);
    if (status != kDecodeOk) return status;
    prof.mark("ml peel");
    uint64_t total = 0;
    if (l + 1 < L.fine_levels) {
      // The next level's nodes: each part's children, then concatenated in part order.
      std::vector<ChildSink> sinks(nt);
      const bool ok = expand_children(L, l, nt, nodes, counts, pattern, slot, sinks, &total);
      // Each rank's non-zero children at any level are at most its non-zero keys.
      if (!ok || total > in.total_keys) return kDecodeIndexCorrupt;
      concat_parts(sinks, nt, &nodes, &counts);
    } else {
      // The support keys, each part's bucketed by sketch group (a part of GroupedKeys per range).
      // Buckets have room for a part's share of a group's keys (at most total_keys of them, and the
      // nodes' children): no reallocation in the common case.
      SupportSink proto{&T, std::vector<SupportSink::Bucket>(sgroups), std::vector<uint32_t>(SupportSink::kChunk + 1),
                        std::vector<uint32_t>(SupportSink::kChunk + 1)};
      const uint64_t most = std::min<uint64_t>(std::min<uint64_t>(in.total_keys, L.num_keys),
                                               nodes.size() * (uint64_t)L.fine_digits[l] * L.fine_words[l]);
      const uint64_t expect = most / ((uint64_t)nt * sgroups);
      std::vector<SupportSink> sinks(nt, proto);
      for (SupportSink& sink : sinks)
        for (auto& b : sink.buckets) b.keys.resize(expect + expect / 8 + 64);
      const bool ok = expand_children(L, l, nt, nodes, counts, pattern, slot, sinks, &total);
      support->by.clear();
      for (SupportSink& k : sinks) {
        std::vector<HugeVector<uint32_t>> part;
        for (auto& b : k.buckets) part.push_back(std::move(b.keys));
        support->by.push_back(std::move(part));
      }
      if (!ok || total > in.total_keys) return kDecodeIndexCorrupt;
      st->index_total = total;
    }
    prof.mark("ml expand");
  }
  st->candidates = support->total();
  if (st->index_total != in.total_keys) return kDecodeIndexCorrupt;
  return kDecodeOk;
}

// Bitmap index: the keys with a non-zero counter, in increasing order, bucketed by sketch group.
// Returns a DecodeStatus.
int32_t bitmap_support(const CodecLayout& L, const DecodeInputs& in, const float* index, int nt,
                       GroupedKeys* support, DecodeStats* st) {
  const SegmentedTable& T = L.sketch;
  const uint64_t groups = T.groups();
  // A group's keys and how many are set: the vector is sized ahead, so filling it is a plain store.
  struct Bucket {
    HugeVector<uint32_t> keys;
    uint64_t size = 0;
  };
  struct KeySink {
    const SegmentedTable* table;
    std::vector<Bucket> buckets;
    std::vector<uint32_t> found, group;  // one block's keys and their groups
    uint64_t num_keys, sum;
    uint32_t per_word, world_size;
    bool operator()(uint64_t first_word, uint32_t words, const WordDigits& d) {
      if (d.max > world_size) return false;
      sum += d.sum;
      // Branch-free: for each 8 digits of a word, store the positions of all 8 from the table of set
      // bits and advance by the number of non-zero ones.
      uint32_t* out = found.data();
      for (uint32_t w = 0; w < words; ++w) {
        const uint32_t first = (uint32_t)((first_word + w) * per_word);
        for (uint32_t s = 0; s < per_word; s += 8) {
          const uint32_t m = (d.nonzero[w] >> s) & 0xffu;
          for (int j = 0; j < 8; ++j) out[j] = first + s + kSetBit.at[m][j];
          out += kSetBit.count[m];
        }
      }
      const uint32_t n = (uint32_t)(out - found.data());
      if (n == 0) return true;
      if (found[n - 1] >= num_keys) return false;  // a digit past the last key (in the last word)
      for (Bucket& b : buckets)
        if (b.keys.size() < b.size + n) b.keys.resize(2 * (b.size + n));
      if (buckets.size() == 1) {
        std::copy(found.data(), found.data() + n, buckets[0].keys.data() + buckets[0].size);
        buckets[0].size += n;
        return true;
      }
      hash_groups(*table, found.data(), n, group.data());
      for (uint32_t i = 0; i < n; ++i) {
        Bucket& b = buckets[group[i]];
        b.keys[b.size++] = found[i];
      }
      return true;
    }
  };
  // Each thread's share of a group's keys, with room to spare: no reallocation for a valid payload.
  const uint64_t expect = std::min<uint64_t>(in.total_keys, L.num_keys) / ((uint64_t)nt * groups);
  const uint64_t block_keys = (uint64_t)kWordBlock * L.index.per_word + 8;  // + the 8 stores past the last
  KeySink proto{&T, std::vector<Bucket>(groups), std::vector<uint32_t>(block_keys), std::vector<uint32_t>(block_keys),
                L.num_keys, 0, L.index.per_word, (uint32_t)in.world_size};
  std::vector<KeySink> sinks(nt, proto);
  for (KeySink& sink : sinks)
    for (Bucket& b : sink.buckets) b.keys.resize(expect + expect / 8 + 64);
  const DigitMaskTable masks(L.index);
  const bool valid = unpack_digits(L, index, in.scale, nt, sinks, &masks);
  support->by.clear();
  for (auto& k : sinks) {
    st->index_total += k.sum;
    std::vector<HugeVector<uint32_t>> part;
    for (Bucket& b : k.buckets) {
      b.keys.resize(b.size);
      part.push_back(std::move(b.keys));
    }
    support->by.push_back(std::move(part));
  }
  st->candidates = support->total();
  if (!valid || st->index_total != in.total_keys) return kDecodeIndexCorrupt;
  return kDecodeOk;
}

// Stable parallel bucketing of sorted keys by sketch group: keys of group g land in
// [group_offset[g], group_offset[g+1]) of `keys`, in increasing order. Groups are hashed a chunk at
// a time (vectorised, and cheaper to redo than to store) in both passes.
void bucket_by_group(const SegmentedTable& T, const KeyParts& support, int nt, std::vector<uint32_t>* keys,
                     std::vector<uint64_t>* group_offset) {
  const uint64_t groups = T.groups();
  const size_t parts = support.parts.size();
  constexpr size_t kChunk = 2048;
  keys->resize(support.size());
  group_offset->assign(groups + 1, 0);
  std::vector<std::vector<uint64_t>> hist(parts, std::vector<uint64_t>(groups, 0));
#pragma omp parallel for num_threads(nt) schedule(static, 1)
  for (int64_t p = 0; p < (int64_t)parts; ++p) {
    const auto& part = support.parts[p];
    uint32_t group[kChunk];
    for (size_t i = 0; i < part.size(); i += kChunk) {
      const size_t n = std::min(kChunk, part.size() - i);
      hash_groups(T, part.data() + i, n, group);
      for (size_t j = 0; j < n; ++j) ++hist[p][group[j]];
    }
  }
  histogram_to_cursors(hist, groups, group_offset);
#pragma omp parallel for num_threads(nt) schedule(static, 1)
  for (int64_t p = 0; p < (int64_t)parts; ++p) {
    const auto& part = support.parts[p];
    uint64_t* cursor = hist[p].data();
    uint32_t group[kChunk];
    for (size_t i = 0; i < part.size(); i += kChunk) {
      const size_t n = std::min(kChunk, part.size() - i);
      hash_groups(T, part.data() + i, n, group);
      for (size_t j = 0; j < n; ++j) (*keys)[cursor[group[j]]++] = part[i + j];
    }
  }
}

// Keys in increasing order and their values (block floats each).
struct KeyRun {
  const uint32_t* keys;
  uint64_t count;
  const float* vals;
};

// The keys of the sorted `runs` that fall in [kb, ke), a chunk of at most `chunk` keys at a time: for
// each chunk [c0, c1), begin(c0, c1), then visit(run, i) for each of its keys, run after run. A chunk
// is done before the next starts, so `begin` can zero what `visit` then writes while it is in cache.
template <typename Begin, typename Visit>
void walk_runs_by_chunk(const std::vector<KeyRun>& runs, uint64_t kb, uint64_t ke, uint64_t chunk, Begin&& begin,
                        Visit&& visit) {
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
    }
  }
}

// out = the values of the keys of `runs` and zeros elsewhere, written in one pass in increasing
// address order (each thread a contiguous range) by merging the runs: no separate zero-fill of the
// output and no random stores into it.
void write_output(const CodecLayout& L, const std::vector<KeyRun>& runs, float* out, int nt) {
  const uint64_t B = L.block;
  const uint64_t chunk = std::max<uint64_t>(1, 16384 / B);  // keys zeroed, then filled, while in L2
#pragma omp parallel num_threads(nt)
  {
    uint64_t kb, ke;
    split_range(L.num_keys, omp_get_num_threads(), omp_get_thread_num(), &kb, &ke);
    walk_runs_by_chunk(
        runs, kb, ke, chunk,
        [&](uint64_t c0, uint64_t c1) { std::fill(out + c0 * B, out + std::min(c1 * B, L.numel), 0.0f); },
        [&](const KeyRun& run, uint64_t i) {
          const uint64_t lo = (uint64_t)run.keys[i] * B;
          if (B == 1)
            out[lo] = run.vals[i];  // one store, not a call to memcpy
          else
            std::memcpy(out + lo, run.vals + i * B, 4 * std::min<uint64_t>(B, L.numel - lo));
        });
  }
}

// The bitmap index: word w = sum of base^(k mod per_word) over the non-zero keys k of the word, each
// thread writing a contiguous range of words once, a cache-sized chunk at a time (zeroed, then its
// keys added in increasing order: the same exact integer sums as any order). `keys` is sorted.
void write_bitmap_words(const CodecLayout& L, const KeyParts& keys, const std::vector<float>& pw, float* index,
                        int nt) {
  const uint64_t words = L.index.words(), per_word = L.index.per_word;
  constexpr uint64_t kChunkWords = 4096;
  std::vector<KeyRun> runs;
  for (const auto& part : keys.parts) runs.push_back(KeyRun{part.data(), part.size(), nullptr});
#pragma omp parallel num_threads(nt)
  {
    uint64_t wb, we;  // whole words per thread: a word's keys are added by one thread
    split_range(words, omp_get_num_threads(), omp_get_thread_num(), &wb, &we);
    walk_runs_by_chunk(
        runs, wb * per_word, we * per_word, kChunkWords * per_word,
        [&](uint64_t c0, uint64_t c1) { std::fill(index + c0 / per_word, index + c1 / per_word, 0.0f); },
        [&](const KeyRun& run, uint64_t i) {
          const uint32_t k = run.keys[i];
          index[k / per_word] += pw[k % per_word];
        });
  }
}

}  // namespace

DecodeStats decode(const CodecLayout& L, const DecodeInputs& in, const float* payload, float* out,
                   int64_t* trace_key, int64_t* trace_cell, int num_threads) {
  const int nt = resolve_threads(num_threads);
  DecodeStats st;
  Prof prof;
  const float* index = payload + L.index_offset;

  // 1. The exact support: keys non-zero on at least one rank, bucketed by sketch group.
  GroupedKeys support;
  if (L.index_kind == kIndexBitmap)
    st.status = bitmap_support(L, in, index, nt, &support, &st);
  else if (L.index_kind == kIndexBloom)
    st.status = bloom_support(L, in, index, nt, &support, &st);
  else if (L.index_kind == kIndexMultilevel)
    st.status = multilevel_support(L, in, payload, nt, &support, &st);
  else
    st.status = kDecodeIndexCorrupt;
  if (st.status != kDecodeOk) {
    parallel_fill(out, L.numel, 0.0f, nt);
    return st;
  }
  st.support_keys = support.total();
  prof.mark("index");

  // 2. Peel the value sketch over the support one group at a time (groups share no cells), in
  //    double precision, into vals. A key's position: its group's keys (parts concatenated) come
  //    after those of the groups before, in increasing order. A group's working set is private to the
  //    thread peeling it and sized to stay in cache; each group is peeled sequentially in a fixed
  //    order, so the values do not depend on the number of threads or their scheduling.
  const uint64_t B = L.block;
  const SegmentedTable& T = L.sketch;
  const uint64_t groups = T.groups(), gcells = T.group_cells();
  const float* sk = payload + L.sketch_offset;
  std::vector<uint64_t> goff(groups + 1, 0);  // group g's keys: positions [goff[g], goff[g + 1])
  for (uint64_t g = 0; g < groups; ++g) goff[g + 1] = goff[g] + support.group_size(g);
  HugeVector<float> vals(goff[groups] * B);  // by key position
  std::vector<uint64_t> peeled(groups, 0);
  std::vector<char> bad(groups, 0), non_finite(groups, 0);
  double group_ms[3] = {0, 0, 0};  // LHC_PROFILE: the groups' load, build and peel times, summed over threads
  std::chrono::steady_clock clock;
#pragma omp parallel num_threads(nt)
  {
    PeelTable t;
    std::vector<double> v(B);
    std::vector<uint32_t> gkeys, scratch;  // scratch: hashed cells while building, then the queue
#pragma omp for schedule(dynamic, 1)
    for (int64_t g = 0; g < (int64_t)groups; ++g) {
      const uint64_t base = (uint64_t)g * gcells, kb = goff[g];
      const auto t0 = clock.now();
      gkeys.clear();
      for (const auto& part : support.by) gkeys.insert(gkeys.end(), part[g].begin(), part[g].end());
      const uint32_t kn = (uint32_t)gkeys.size();
      float* gvals = vals.data() + kb * B;
      // Keys the peel does not reach (a failed group) keep NaN, never stale memory.
      std::fill(gvals, gvals + (uint64_t)kn * B, std::numeric_limits<float>::quiet_NaN());
      t.reset(T.seg_len, B);
      bool finite = true;
      for (uint64_t c = 0; c < gcells; ++c) {
        t.clear_state(c);
        double* dst = t.values(c);
        for (uint64_t l = 0; l < B; ++l) {
          dst[l] = (double)sk[(base + c) * B + l];
          finite &= std::isfinite(dst[l]);
        }
      }
      if (!finite) non_finite[g] = 1;
      const auto t1 = clock.now();
      build_states(t, T, gkeys.data(), kn, scratch);
      const auto t2 = clock.now();
      uint64_t step = kb;
      bool group_bad = false;
      peeled[g] = peel(
          t, kn, scratch,
          [&](uint32_t pos, const uint64_t* cell, const double* coef) {
            // Branch-free: weights and their inverses are multiplied in (exact: powers of two), so
            // mispredictions do not stall the memory pipeline.
            if (B == 1) {  // unstructured keys: no loops over one value
              const double x = coef[0] * *t.values(cell[0]);
              *t.values(cell[1]) -= coef[1] * x;
              *t.values(cell[2]) -= coef[2] * x;
              gvals[pos] = (float)x;
            } else {
              const double* src = t.values(cell[0]);
              for (uint64_t l = 0; l < B; ++l) v[l] = coef[0] * src[l];
              double* d1 = t.values(cell[1]);
              double* d2 = t.values(cell[2]);
              for (uint64_t l = 0; l < B; ++l) {
                d1[l] -= coef[1] * v[l];
                d2[l] -= coef[2] * v[l];
              }
              float* o = gvals + (uint64_t)pos * B;
              for (uint64_t l = 0; l < B; ++l) o[l] = (float)v[l];
            }
            if (trace_key) {
              trace_key[step] = (int64_t)gkeys[pos];
              trace_cell[step] = (int64_t)(base + cell[0]);
            }
            ++step;
            return true;
          },
          &group_bad);
      if (!group_bad && peeled[g] < kn)
        peeled[g] += solve_pairs(t, T, gkeys.data(), kn, B, scratch,
                                 [&](uint32_t pa, uint32_t pb, const uint64_t* cell, const int*, const int*,
                                     const double* va, const double* vb) {
                                   for (uint64_t l = 0; l < B; ++l) {
                                     gvals[(uint64_t)pa * B + l] = (float)va[l];
                                     gvals[(uint64_t)pb * B + l] = (float)vb[l];
                                   }
                                   if (trace_key) {
                                     for (const uint32_t p : {pa, pb}) {
                                       trace_key[step] = (int64_t)gkeys[p];
                                       trace_cell[step] = (int64_t)(base + cell[0]);
                                       ++step;
                                     }
                                   }
                                 });
      bad[g] = group_bad;
      if (prof.env) {
        const auto t3 = clock.now();
#pragma omp critical(lhc_profile)
        {
          group_ms[0] += std::chrono::duration<double, std::milli>(t1 - t0).count();
          group_ms[1] += std::chrono::duration<double, std::milli>(t2 - t1).count();
          group_ms[2] += std::chrono::duration<double, std::milli>(t3 - t2).count();
        }
      }
    }
  }
  if (prof.env)
    std::fprintf(stderr, "  lhc (threads' sum: load %.1f ms, build %.1f ms, peel %.1f ms)\n", group_ms[0], group_ms[1],
                 group_ms[2]);
  prof.mark("peel");
  std::vector<KeyRun> runs;
  for (uint64_t g = 0; g < groups; ++g) {
    uint64_t pos = goff[g];
    for (const auto& part : support.by) {
      runs.push_back(KeyRun{part[g].data(), part[g].size(), vals.data() + pos * B});
      pos += part[g].size();
    }
  }
  write_output(L, runs, out, nt);
  prof.mark("write");
  for (uint64_t g = 0; g < groups; ++g) {
    st.peeled += peeled[g];
    if (bad[g]) st.status = kDecodeIndexCorrupt;
    if (non_finite[g] && st.status == kDecodeOk) st.status = kDecodeSketchNonFinite;
  }
  if (st.status == kDecodeOk && st.peeled != st.support_keys) st.status = kDecodeSketchPeelFailed;

  return st;
}

EncodeStats encode(const CodecLayout& L, const float* x, float* payload, int num_threads) {
  const int nt = resolve_threads(num_threads);
  EncodeStats st;
  Prof prof;
  // Zero what is accumulated into: the sketch, and the coarse index of the multilevel kind. The
  // bitmap and Bloom index words and the fine tables are each written once below; the header last.
  float* index = payload + L.index_offset;
  if (L.index_kind == kIndexMultilevel) parallel_fill(index, L.index.words(), 0.0f, nt);
  parallel_fill(payload + L.sketch_offset, L.payload_numel - L.sketch_offset, 0.0f, nt);
  prof.mark("enc zero");
  KeyParts keys;
  keys.parts = find_nonzero_keys(L, x, nt, &st.non_finite);
  st.keys = keys.size();
  prof.mark("enc find");

  const std::vector<float> pw = digit_powers(L.index);
  if (L.index_kind == kIndexBitmap) {
    write_bitmap_words(L, keys, pw, index, nt);
  } else if (L.index_kind == kIndexBloom) {
    const uint64_t cells = L.bloom.cells();
    std::vector<uint32_t> count(cells, 0);
    for (const auto& part : keys.parts)
      for (uint64_t k : part) {
        uint64_t cell[3];
        int weight[3];  // unused: index tables add counts
        key_cells(L.bloom, k, cell, weight);
        for (int j = 0; j < 3; ++j) ++count[cell[j]];
      }
    const uint64_t words = L.index.words();
    uint32_t saturated = 0;
#pragma omp parallel for num_threads(nt) schedule(static) reduction(| : saturated)
    for (int64_t w = 0; w < (int64_t)words; ++w) {
      float acc = 0.0f;
      for (uint32_t d = 0; d < L.index.per_word; ++d) {
        const uint64_t c = (uint64_t)w * L.index.per_word + d;
        if (c >= cells) break;
        uint32_t v = count[c];
        if (v > L.digit_cap) { v = L.digit_cap; saturated = 1; }
        acc += (float)v * pw[d];
      }
      index[w] = acc;
    }
    st.saturated = saturated;
  } else if (L.index_kind == kIndexMultilevel) {
    // Coarse digit 1 per non-zero node of fine level 0. Per fine level, each non-zero node's pattern
    // (base^digit for each child holding a non-zero key) added to its three cells with the cells'
    // signs. Integer accumulation, converted once: bit-identical to the reference.
    const uint64_t base = L.index.base;
    uint64_t last = ~0ULL;
    for (const auto& part : keys.parts)
      for (uint64_t k : part) {
        const uint64_t v = ml_node(L, 0, k);
        if (v != last) index[v / L.index.per_word] += pw[v % L.index.per_word];
        last = v;
      }
    for (uint32_t l = 0; l < L.fine_levels; ++l) {
      const uint64_t wpg = L.fine_words[l], w = L.fine_digits[l], fcells = L.fine[l].cells();
      std::vector<int64_t> acc(fcells * wpg, 0);
      std::vector<uint64_t> pattern(wpg, 0), dpow(w, 1);
      for (uint64_t j = 1; j < w; ++j) dpow[j] = dpow[j - 1] * base;
      uint64_t cur = ~0ULL, last_child = ~0ULL;
      auto flush = [&]() {
        if (cur == ~0ULL) return;
        uint64_t cell[3];
        int sign[3];  // +-1: fine tables are signed, never weighted
        key_cells(L.fine[l], cur, cell, sign);
        for (int j = 0; j < 3; ++j)
          for (uint64_t i = 0; i < wpg; ++i) acc[cell[j] * wpg + i] += sign[j] * (int64_t)pattern[i];
        std::fill(pattern.begin(), pattern.end(), 0);
      };
      for (const auto& part : keys.parts)
        for (uint64_t k : part) {
          const uint64_t v = ml_node(L, l, k);
          if (v != cur) {
            flush();
            cur = v;
            last_child = ~0ULL;
          }
          const uint64_t c = ml_child(L, l, k);
          if (c != last_child) pattern[c / w] += dpow[c % w];  // keys are increasing: a child's keys are adjacent
          last_child = c;
        }
      flush();
      float* fine = payload + L.fine_offset[l];
#pragma omp parallel for num_threads(nt) schedule(static)
      for (int64_t i = 0; i < (int64_t)(fcells * wpg); ++i) fine[i] = (float)acc[i];
    }
  }

  prof.mark("enc index");
  // Values: every cell is summed in increasing key order, whatever the thread count. With several
  // groups, keys are bucketed by group (stably) and each thread scatters whole groups, whose cells
  // stay in cache; with one group the scatter is sequential.
  float* sketch = payload + L.sketch_offset;
  const SegmentedTable& T = L.sketch;
  if (T.groups() > 1) {
    std::vector<uint32_t> gkeys;
    std::vector<uint64_t> goff;
    bucket_by_group(T, keys, nt, &gkeys, &goff);
    prof.mark("enc bucket");
#pragma omp parallel num_threads(nt)
    {
      std::vector<uint32_t> kc;
#pragma omp for schedule(dynamic, 1)
      for (int64_t g = 0; g < (int64_t)T.groups(); ++g)
        scatter_keys(L, x, gkeys.data() + goff[g], goff[g + 1] - goff[g], (uint64_t)g * T.group_cells(), sketch, kc);
    }
  } else {
    std::vector<uint32_t> kc;
    for (const auto& part : keys.parts) scatter_keys(L, x, part.data(), part.size(), 0, sketch, kc);
  }

  prof.mark("enc values");
  float* header = payload;
  header[kHdrContributors] = 1.0f;
  header[kHdrFingerprintLo] = (float)(L.fingerprint & ((1u << kChunkBits) - 1));
  header[kHdrFingerprintHi] = (float)(L.fingerprint >> kChunkBits);
  write_chunks(header, kHdrKeysLo, st.keys);
  header[kHdrOverloaded] = st.keys > L.capacity ? 1.0f : 0.0f;
  header[kHdrNonFinite] = (float)st.non_finite;
  header[kHdrSaturated] = (float)st.saturated;
  return st;
}

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
