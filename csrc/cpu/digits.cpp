// Index words into packed digits (digits.h).
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

}  // namespace detail
}  // namespace cpu
}  // namespace lhc
