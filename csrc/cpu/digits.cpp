// Index words into packed digits (digits.h).
#if defined(__x86_64__) && defined(__GNUC__)
// GCC 12's AVX-512 headers build some intrinsics' results from a deliberately undefined vector, which
// -Wextra reports as uninitialised (as in peel_batch.cpp).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop
#define LHC_LIST_AVX512 1
#else
#define LHC_LIST_AVX512 0
#endif

#include <cstring>

#include "digits.h"

namespace lhc {
namespace cpu {
namespace detail {

// Powers base^i for i < per_word, as floats (exact: all below 2^22).
std::vector<float> digit_powers(const DigitPacking& P) {
  std::vector<float> pw(P.per_word);
  double p = 1.0;
  for (uint32_t i = 0; i < P.per_word; ++i, p *= P.base) pw[i] = (float)p;
  return pw;
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

// As split_words, but only the non-zero masks, sum and largest digit of d, and each word's value and
// largest digit.
__attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
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
    const uint64_t word_max = std::max(a >> 44, b >> 44);
    d->nonzero[w] = (uint32_t)((a & 0x3fffffu) | (b & 0x3fffffu) << shift);
    d->value[w] = (uint32_t)u[w];
    d->word_max[w] = (uint32_t)word_max;
    sum += (a >> 22 & 0x3fffffu) + (b >> 22 & 0x3fffffu);
    max = std::max(max, word_max);
  }
  d->sum = sum;
  d->max = (uint32_t)max;
  return valid;
}

DigitKeyLister::DigitKeyLister(uint32_t per_word, bool avx512)
    : per_word_(per_word), avx512_(avx512 && LHC_LIST_AVX512) {
  if (!avx512_) return;
  const uint32_t chunks = (kWordBlock * per_word + 15) / 16;
  chunk_word_.resize(chunks);
  lane_word_.resize(16 * (size_t)chunks);
  lane_bit_.resize(16 * (size_t)chunks);
  for (uint32_t c = 0; c < chunks; ++c) {
    chunk_word_[c] = 16 * c / per_word;  // a chunk spans at most 16 words (per_word >= 1)
    for (uint32_t l = 0; l < 16; ++l) {
      const uint32_t slot = 16 * c + l;
      lane_word_[16 * c + l] = slot / per_word - chunk_word_[c];
      lane_bit_[16 * c + l] = 1u << (slot % per_word);
    }
  }
}

namespace {

uint32_t list_keys_scalar(const uint32_t* masks, uint32_t words, uint32_t per_word, uint32_t first, uint32_t* out) {
  // The masks of 64 / per_word consecutive words side by side in one 64-bit run (bit k * per_word + i
  // for digit i of the run's word k), then its set bits one by one: a few instructions per word and
  // per key, and one branch per run.
  uint32_t* at = out;
  const uint32_t run_words = 64 / per_word;
  for (uint32_t w0 = 0; w0 < words; w0 += run_words) {
    const uint32_t nw = std::min(run_words, words - w0);
    uint64_t run = 0;
    for (uint32_t k = 0; k < nw; ++k) run |= (uint64_t)masks[w0 + k] << (k * per_word);
    const uint32_t key = first + w0 * per_word;
    for (; run; run &= run - 1) *at++ = key + (uint32_t)__builtin_ctzll(run);
  }
  return (uint32_t)(at - out);
}

#if LHC_LIST_AVX512
__attribute__((target("avx512f,popcnt"))) uint32_t list_keys_avx512(const uint32_t* masks, uint32_t words,
                                                                     uint32_t per_word, uint32_t first,
                                                                     const uint32_t* chunk_word,
                                                                     const uint32_t* lane_word,
                                                                     const uint32_t* lane_bit, uint32_t* out) {
  // The block's masks zero-padded: a chunk loads 16 words from its first, and the slots of words past
  // `words` must list nothing.
  uint32_t m[kWordBlock + 16];
  std::memcpy(m, masks, 4 * (size_t)words);
  std::memset(m + words, 0, 4 * (size_t)(kWordBlock + 16 - words));
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const uint32_t chunks = (words * per_word + 15) / 16;
  uint32_t n = 0;
  for (uint32_t c = 0; c < chunks; ++c) {
    const __m512i word = _mm512_permutexvar_epi32(_mm512_loadu_si512(lane_word + 16 * c),
                                                  _mm512_loadu_si512(m + chunk_word[c]));
    const __mmask16 set = _mm512_test_epi32_mask(word, _mm512_loadu_si512(lane_bit + 16 * c));
    const __m512i key = _mm512_add_epi32(_mm512_set1_epi32((int)(first + 16 * c)), lane);
    _mm512_storeu_si512(out + n, _mm512_maskz_compress_epi32(set, key));
    n += (uint32_t)__builtin_popcount(set);
  }
  return n;
}
#endif

}  // namespace

uint32_t DigitKeyLister::operator()(const uint32_t* masks, uint32_t words, uint32_t first, uint32_t* out) const {
#if LHC_LIST_AVX512
  if (avx512_)
    return list_keys_avx512(masks, words, per_word_, first, chunk_word_.data(), lane_word_.data(), lane_bit_.data(),
                            out);
#endif
  return list_keys_scalar(masks, words, per_word_, first, out);
}

}  // namespace detail
}  // namespace cpu
}  // namespace lhc
