// Index words as packed digits: splitting words into their base-(n+1) digits, a block of words at a
// time (vectorised), and the parallel unpacking of a whole index into per-thread sinks.
#pragma once

#include <cmath>

#include "codec_cpu_internal.h"

namespace lhc {
namespace cpu {
namespace detail {

// Powers base^i for i < per_word, as floats (exact: all below 2^22).
std::vector<float> digit_powers(const DigitPacking& P);

// Index words are split kWordBlock words at a time at most (what a WordDigits holds), by loops over
// words that the compiler vectorises: the bitmap index's masks (split_word_masks) in blocks of
// kWordBlock, where each block's calls (listing, checksum, hashing, bucketing its keys) cost less per
// key than over half as many; full digits (split_words: the Bloom and multilevel indexes, at the low
// densities where a block of +0.0f words is skipped) in blocks of kDigitBlock, which skip more often.
constexpr uint32_t kWordBlock = 128;
constexpr uint32_t kDigitBlock = 64;
constexpr uint32_t kMaxPerWord = kIntFieldBits;  // base >= 2 and base^per_word <= 2^22

// The digits of up to kWordBlock consecutive index words: digit[i][w] is digit i of word w, and bit i
// of nonzero[w] is set iff that digit is not zero.
struct WordDigits {
  uint32_t digit[kMaxPerWord][kWordBlock];
  uint32_t nonzero[kWordBlock];
  uint64_t sum;  // of all the digits
  uint32_t max;  // the largest digit
  // split_word_masks only: each word's packed integer and its largest digit.
  uint32_t value[kWordBlock];
  uint32_t word_max[kWordBlock];
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
    // Also false for NaN. `&`, not `&&`: no branches, so the loop vectorises.
    const bool ok = (v > -0.5) & (v < limit) & (std::fabs(v - r) <= tolerance) & (r >= 0.0) & (r < limit);
    bad |= (uint32_t)!ok;
    u[w] = ok ? r : 0.0;
  }
  return bad == 0;
}

// Quotients by the powers of a base without a chain of divisions: q_j = floor(u / base^j) of an integer
// u < 2^22 is the product (u + 0.5) inv[j] truncated, inv[j] = 1 / base^j rounded (exact: see
// split_words; the argument holds for any divisor up to 2^22), so digit j of u, q_j - base q_(j+1),
// comes from two products that do not wait for the digits below it.
struct DigitReciprocals {
  double inv[kMaxPerWord + 1];
  DigitReciprocals(uint32_t base, uint32_t digits) {  // digits <= kMaxPerWord
    double power = 1.0;
    for (uint32_t j = 0; j <= digits; ++j, power *= base) inv[j] = 1.0 / power;
  }
  uint32_t quotient(double u, uint32_t j) const { return (uint32_t)(int32_t)((u + 0.5) * inv[j]); }
};

// Split words[0, n) (n <= kWordBlock) into digits; false if a word is not a valid packed integer (see
// word_integers). Branch-free over words, so it vectorises (cloned for AVX-512 and AVX2, chosen at
// load time). floor((u + 0.5) / base) computed as a double product with the rounded reciprocal is the
// exact quotient: for u < 2^22, (u + 0.5) / base is at least 0.5 / base > 2^-23 from an integer, and
// the product is off by less than 2^22 * 2^-52. (std::floor would not vectorise without
// -fno-trapping-math; the conversion to int does.)
bool split_words(const float* words, uint32_t n, double scale, const DigitPacking& P, WordDigits* d);

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
    // entry[r * base + d] from entry[r] (r < r * base + d but for v = 0): digit d below r's digits.
    // No division: the table is built per decode, and a division per digit of each value cost 60-90 us
    // at base 5 (3125 values), half of a 4096-coordinate decode (docs/BENCHMARKS.md).
    constexpr uint64_t kField = (1ull << 22) - 1;
    entry.assign(size, 0);
    for (uint64_t r = 0, v = 0; v < size; ++r)
      for (uint64_t d = 0; d < P.base; ++d, ++v) {
        const uint64_t e = entry[r];
        const uint64_t mask = ((e & kField) << 1) | (uint64_t)(d != 0);
        const uint64_t sum = ((e >> 22) & kField) + d;
        const uint64_t max = std::max<uint64_t>(e >> 44, d);
        entry[v] = mask | sum << 22 | max << 44;
      }
  }
};

// As split_words, but only the non-zero masks, sum and largest digit of d, and each word's value and
// largest digit (not its digits: a caller splits the few words whose largest exceeds 1 itself).
bool split_word_masks(const float* words, uint32_t n, double scale, const DigitPacking& P, const DigitMaskTable& M,
                      WordDigits* d);

// The keys a block of index words lists (a non-zero digit each), in increasing order: key first + w *
// per_word + i for bit i of masks[w], w < words (the masks of split_word_masks: bits below per_word).
// Writes up to 16 entries past the keys it returns the count of (out needs words * per_word + 16).
// With `avx512` (the caller passes cpu_isa_is_avx512()) sixteen digit slots at a time, each slot's word
// moved into its lane and tested, the set lanes' keys compressed into place: no branch on the keys,
// where the scalar loop leaves each run of 64 / per_word words after its last key, a coin flip to the
// branch predictor. The same keys either way.
class DigitKeyLister {
 public:
  DigitKeyLister(uint32_t per_word, bool avx512);
  uint32_t operator()(const uint32_t* masks, uint32_t words, uint32_t first, uint32_t* out) const;

 private:
  uint32_t per_word_;
  bool avx512_;
  // AVX-512: for each chunk c of 16 slots of a block, the first word it touches, and per lane the
  // slot's word relative to it and the bit of the slot's digit.
  std::vector<uint32_t> chunk_word_, lane_word_, lane_bit_;
};

// Unpack every index word into digits: thread t calls sinks[t](first_word, n, digits) for the blocks
// (kDigitBlock words; with `masks` kWordBlock) of its contiguous word range, in increasing order,
// skipping blocks of +0.0f words (no digits: most of them at low density); on a private copy of the
// sink, moved back at the end. Returns false if a word is not a valid packed integer or a sink rejects a
// block. With `masks`, split_word_masks fills in the digits' non-zero masks, sums and largest, and the
// words' values, not the digits (where a word's largest digit is 1, its mask says all).
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
    const uint32_t block = masks ? kWordBlock : kDigitBlock;
    for (uint64_t w = wb; w < we && !bad; w += block) {
      const uint32_t n = (uint32_t)std::min<uint64_t>(block, we - w);
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

}  // namespace detail
}  // namespace cpu
}  // namespace lhc
