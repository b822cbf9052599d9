// lhc::cpu::bitmap_pack_* and bitmap_rows: the two-phase counting bitmap (lossless_hc/training/rows.py),
// a rank's rows as digits of base n + 1, per_word to a float32 word (lhc_layout.h DigitPacking), and
// the rows a sum of such bitmaps lists.
//
// A word's digits are handled as a mask of per_word <= 22 bits (bit j: digit j is not zero), the bitmap
// index's own reading (digits.h split_word_masks): packing turns a mask into its word by two table
// lookups, reading turns a word into its mask by two, and the rows are the masks' set bits. Every pass
// is a loop over words; nothing depends on the thread count.
#include <omp.h>

#include <algorithm>
#include <vector>

#include "codec_cpu.h"
#include "digits.h"

namespace lhc {
namespace cpu {

namespace {

using detail::kMaxPerWord;

// The value of a word whose non-zero digits (all 1) are the set bits of a mask: lo[m & 2047] + hi[m >> 11],
// exact integers below base^per_word <= 2^22.
struct MaskValues {
  static constexpr int kHalf = kMaxPerWord / 2;  // 11
  uint32_t lo[1u << kHalf], hi[1u << kHalf];
  explicit MaskValues(const DigitPacking& P) {
    uint32_t power[kMaxPerWord] = {};
    uint64_t p = 1;
    for (uint32_t j = 0; j < P.per_word; ++j, p *= P.base) power[j] = (uint32_t)p;
    for (uint32_t m = 0; m < (1u << kHalf); ++m) {
      uint32_t a = 0, b = 0;
      for (int j = 0; j < kHalf; ++j)
        if (m >> j & 1) a += power[j], b += power[j + kHalf];
      lo[m] = a;
      hi[m] = b;
    }
  }
  float word(uint32_t mask) const { return (float)(lo[mask & ((1u << kHalf) - 1)] + hi[mask >> kHalf]); }
};

// Set bits of a mask below 2^24, by table (the baseline x86-64 target has no popcount instruction).
inline uint32_t set_bits(uint32_t m) {
  return detail::kSetBit.count[m & 255] + detail::kSetBit.count[m >> 8 & 255] + detail::kSetBit.count[m >> 16 & 255];
}

int threads_for(uint64_t words, int num_threads) {
  // Threads only where each gets words worth their start-up (~16 Ki words, ~64 KiB of digits or more).
  return (int)std::max<uint64_t>(1, std::min<uint64_t>(detail::resolve_threads(num_threads), words >> 14));
}

}  // namespace

void bitmap_pack_present(const uint8_t* present, const DigitPacking& P, float* words, int num_threads) {
  const MaskValues V(P);
  const uint64_t n = P.words();
#pragma omp parallel for num_threads(threads_for(n, num_threads)) schedule(static)
  for (uint64_t w = 0; w < n; ++w) {
    const uint64_t first = w * P.per_word, digits = std::min<uint64_t>(P.per_word, P.digits - first);
    uint32_t mask = 0;
    for (uint64_t j = 0; j < digits; ++j) mask |= (uint32_t)(present[first + j] != 0) << j;
    words[w] = V.word(mask);
  }
}

bool bitmap_pack_index(const int64_t* index, uint64_t count, const DigitPacking& P, float* words) {
  const MaskValues V(P);
  const uint64_t n = P.words();
  std::vector<uint32_t> masks(n, 0);
  const uint64_t keys = P.digits;
  uint64_t outside = 0;
  for (uint64_t i = 0; i < count; ++i) {
    const uint64_t r = (uint64_t)index[i];  // a negative row wraps above keys
    outside |= r >= keys;
    const uint64_t at = r < keys ? r : 0;
    masks[at / P.per_word] |= (uint32_t)(r < keys) << (at % P.per_word);  // a row listed twice counts once
  }
  if (outside) return false;
  for (uint64_t w = 0; w < n; ++w) words[w] = V.word(masks[w]);
  return true;
}

int64_t bitmap_masks(const float* words, const DigitPacking& P, double scale, uint32_t* masks,
                     int num_threads) {
  const uint64_t n = P.words();
  if (n == 0) return 0;
  const detail::DigitMaskTable table(P);
  // The digits a last word holds past the keys must be zero, as every rank's bitmap has them.
  const uint32_t last_digits = (uint32_t)(P.digits - (n - 1) * P.per_word);
  const uint32_t past_keys = ~0u << last_digits & ((1u << P.per_word) - 1);
  int64_t rows = 0;
  int bad = 0;
#pragma omp parallel num_threads(threads_for(n, num_threads)) reduction(+ : rows) reduction(| : bad)
  {
    uint64_t wb, we;
    detail::split_range(n, omp_get_num_threads(), omp_get_thread_num(), &wb, &we);
    detail::WordDigits d;
    for (uint64_t w = wb; w < we; w += detail::kWordBlock) {
      const uint32_t m = (uint32_t)std::min<uint64_t>(detail::kWordBlock, we - w);
      bad |= !detail::split_word_masks(words + w, m, scale, P, table, &d);
      for (uint32_t i = 0; i < m; ++i) {
        masks[w + i] = d.nonzero[i];
        rows += set_bits(d.nonzero[i]);
      }
    }
  }
  if (bad || (masks[n - 1] & past_keys)) return -1;
  return rows;
}

void bitmap_mask_rows(const uint32_t* masks, const DigitPacking& P, int64_t* rows, int num_threads) {
  const uint64_t n = P.words();
  const int nt = threads_for(n, num_threads);
  std::vector<uint64_t> first(nt + 1, 0);  // each thread's first output position
#pragma omp parallel num_threads(nt)
  {
    const int t = omp_get_thread_num(), threads = omp_get_num_threads();
    uint64_t wb, we;
    detail::split_range(n, threads, t, &wb, &we);
    uint64_t count = 0;
    for (uint64_t w = wb; w < we; ++w) count += set_bits(masks[w]);
    first[t + 1] = count;
#pragma omp barrier
#pragma omp single
    for (int i = 0; i < threads; ++i) first[i + 1] += first[i];
    int64_t* out = rows + first[t];
    for (uint64_t w = wb; w < we; ++w)
      for (uint32_t m = masks[w]; m; m &= m - 1) *out++ = (int64_t)(w * P.per_word + __builtin_ctz(m));
  }
}

}  // namespace cpu
}  // namespace lhc
