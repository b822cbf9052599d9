// CPU (OpenMP) kernels of the THC codec: randomized Hadamard transform, stochastic rounding onto an
// integer table with digit packing, unpacking with exactness checks. Raw pointers and sizes only.
//
// Every kernel is deterministic: parallel loops write disjoint outputs, and the one reduction (the
// squared norm) sums per-block partials in block order, so results do not depend on thread count.
#pragma once

#include <cstdint>

#include "../lhc_layout.h"

namespace lhc {
namespace cpu {

// How payload words are stored: float64 (exact under SUM and AVERAGE) or int64 (SUM only).
enum ThcWordKind : int32_t { kThcWordFloat64 = 0, kThcWordInt64 = 1 };

struct ThcForwardStats {
  double sum_squares = 0;  // ||x + e||^2 over the numel input coordinates
  uint32_t non_finite = 0; // 1 if some x[i] + e[i] is NaN/Inf (y is then unspecified)
};

// y[0, padded) = RHT(v) with v = x + e (e may be null; both numel floats, v zero-padded):
// per block of L.block coordinates, y = H (s * v) / sqrt(block), s the +-1 signs of sign_stream and
// H the (unnormalised, Sylvester-order) Walsh-Hadamard matrix.
ThcForwardStats thc_rht_forward(const ThcLayout& L, uint64_t sign_stream, const float* x, const float* e, float* y,
                                int num_threads);

// The inverse of thc_rht_forward on y (padded floats; destroyed), restricted to numel coordinates:
// r = s * H y / sqrt(block). Writes out[i] = r[i], or (with plus_a, plus_b non-null)
// out[i] = (plus_a[i] + plus_b[i]) - r[i] -- the error-feedback update e <- x + e - RHT^-1(own).
// plus_b may be null (then out = plus_a - r). out may alias plus_a or plus_b.
void thc_rht_inverse(const ThcLayout& L, uint64_t sign_stream, float* y, float* out, const float* plus_a,
                     const float* plus_b, int num_threads);

// The quantization table as the kernels see it: for integer k in [0, g), the neighbouring levels
// lo[k] <= k < k + 1 <= lo[k] + width[k] that bracket every u in [k, k + 1].
struct ThcQuantizer {
  const float* lo;      // g entries
  const float* width;   // g entries
  const float* inv_width;
  float scale;          // sqrt(padded) / M: y -> z
  float threshold;      // T: z is clipped to [-T, T]
  float dequant_a;      // own dequantized value = level * dequant_a + dequant_b (written back to y)
  float dequant_b;
};

// Quantize y (padded floats) and pack the levels into L.words words of kind `word_kind` at `words`:
// z = clamp(y * scale, -T, T), u = (z + T) g / (2T), level = lo + width * [draw < (u - lo)/width] with
// draw uniform in [0, 1) at 2^-24 resolution (unbiased up to 2^-24 of a level gap). With
// write_back, y[i] becomes the rank's own dequantized value (for error feedback).
void thc_quantize_pack(const ThcLayout& L, const ThcQuantizer& Q, uint64_t round_stream, float* y,
                       bool write_back, int32_t word_kind, void* words, int num_threads);

// Unpack aggregated words: S = word * multiplier (multiplier = n for an averaged float64 payload, else
// 1) must be an integer (within 1/2 when averaged, exactly when summed) in [0, base^per_word), and
// the digits past `padded` must be 0. Writes y[i] = digit_i * a + b for i < padded. Returns the
// number of words that fail these checks (the payload is then corrupted or not a plain SUM/AVERAGE).
uint64_t thc_unpack(const ThcLayout& L, int32_t word_kind, const void* words, double multiplier, double a, double b,
                    float* y, int num_threads);

}  // namespace cpu
}  // namespace lhc
