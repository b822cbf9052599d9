// thc_math.h -- the per-coordinate arithmetic of the THC codec, one definition for every backend.
//
// csrc/cpu/thc_cpu.cpp (host compiler, OpenMP) and csrc/cuda/thc_kernels.cuh (nvcc, NVRTC, and the
// host emulation of the tests) both call these functions, so for the same inputs and streams they
// produce the same bits: the same signs, draws, levels, packed words, norm and error memory.
//
// Floating-point rules that make this hold:
//  * Every product that feeds a sum is an explicit fused multiply-add (thc_fmaf / thc_fma: std::fma on
//    the host, __fmaf_rn / __fma_rn on the device). No other product feeds a sum, so neither a host
//    compiler (GCC contracts a*b+c into an FMA in C++ whenever the target has FMA, e.g. in the AVX2
//    clones) nor nvcc (--fmad=true by default) can change a result by contracting.
//  * The remaining float operations are single IEEE operations (add, subtract, multiply, compare,
//    sign flips as bit operations), correctly rounded on both sides; on the device they are written
//    with __fmul_rn/__fadd_rn so that no later optimisation may fuse them.
//  * Reductions run in one fixed order (thc_chunk_* and the 1024-wide tree below), independent of
//    thread counts and of the Hadamard block size.
#pragma once

#include "lhc_layout.h"

#if !defined(__CUDACC_RTC__)
#include <cmath>
#include <cstring>
#endif

namespace lhc {

// ---- explicit roundings ---------------------------------------------------------------------------
// Device code (nvcc's device pass, NVRTC) uses the round-to-nearest intrinsics, which are never
// contracted; host code (CPU backend, nvcc's host pass, the emulation of the tests) plain operations
// and std::fma.
#if defined(__CUDA_ARCH__)
#define LHC_THC_OP(dev, host) return dev
#else
#define LHC_THC_OP(dev, host) return host
#endif
LHC_HD float thc_fmaf(float a, float b, float c) { LHC_THC_OP(__fmaf_rn(a, b, c), std::fma(a, b, c)); }
LHC_HD double thc_fma(double a, double b, double c) { LHC_THC_OP(__fma_rn(a, b, c), std::fma(a, b, c)); }
LHC_HD float thc_mul(float a, float b) { LHC_THC_OP(__fmul_rn(a, b), a * b); }
LHC_HD float thc_add(float a, float b) { LHC_THC_OP(__fadd_rn(a, b), a + b); }
LHC_HD float thc_sub(float a, float b) { LHC_THC_OP(__fsub_rn(a, b), a - b); }
LHC_HD double thc_dadd(double a, double b) { LHC_THC_OP(__dadd_rn(a, b), a + b); }
#if defined(__CUDA_ARCH__)
LHC_HD uint32_t thc_float_bits(float v) { return __float_as_uint(v); }
LHC_HD float thc_bits_float(uint32_t u) { return __uint_as_float(u); }
#else
LHC_HD uint32_t thc_float_bits(float v) {
  uint32_t u;
  std::memcpy(&u, &v, 4);
  return u;
}
LHC_HD float thc_bits_float(uint32_t u) {
  float v;
  std::memcpy(&v, &u, 4);
  return v;
}
#endif
#undef LHC_THC_OP

// Flip the IEEE sign bit of v when bit is 1: multiplying by +-1 without a multiply.
LHC_HD float thc_flip_sign(float v, uint32_t bit) { return thc_bits_float(thc_float_bits(v) ^ (bit << 31)); }

// The RHT sign bit of coordinate idx (1: negated); thc_sign_bits holds 64 of them per word.
LHC_HD uint32_t thc_sign_bit(uint64_t sign_stream, uint64_t idx) {
  return (uint32_t)((thc_sign_bits(sign_stream, idx >> 6) >> (idx & 63)) & 1);
}

// 1/sqrt(block) as a float (block a power of two): the orthonormal scaling of one Hadamard block.
LHC_HD float thc_inv_sqrt_block(uint64_t block) {
#if defined(__CUDA_ARCH__)
  return (float)(1.0 / sqrt((double)block));   // IEEE sqrt and division (no fast-math)
#else
  return (float)(1.0 / std::sqrt((double)block));
#endif
}

// ---- stochastic rounding onto the table ----------------------------------------------------------
// The rounding draw as a float in [0, 1): u24 / 2^24, exact.
LHC_HD float thc_draw(uint32_t u24) { return (float)(int32_t)u24 * (1.0f / 16777216.0f); }

// What one rank's quantizer needs, for integer k in [0, g): the neighbouring levels lo[k] <= k and
// lo[k] + width[k] >= k + 1 (inv_width = 1 / width as floats).
struct ThcRounding {
  const float* lo;
  const float* width;
  const float* inv_width;
  float scale;      // sqrt(padded) / M: rotated coordinate -> z
  float threshold;  // T
  float to_level;   // g / (2 T)
  float gf;         // g
  int32_t kmax;     // g - 1
};

LHC_HD ThcRounding thc_rounding(const float* lo, const float* width, const float* inv_width, float scale,
                                float threshold, uint32_t granularity) {
  ThcRounding R;
  R.lo = lo;
  R.width = width;
  R.inv_width = inv_width;
  R.scale = scale;
  R.threshold = threshold;
  R.to_level = (float)granularity / (2.0f * threshold);
  R.gf = (float)granularity;
  R.kmax = (int32_t)granularity - 1;
  return R;
}

// The level of rotated coordinate y: z = clamp(y scale, -T, T), u = (z + T) g / (2T) in [0, g], then
// up to the next table level with probability (u - lo) / width. Clamps are written as std::min and
// std::max evaluate them (the same result for signed zeros).
LHC_HD float thc_level(const ThcRounding& R, float y, float draw) {
  const float T = R.threshold;
  float z = thc_mul(y, R.scale);
  z = z < -T ? -T : z;
  z = T < z ? T : z;
  float u = thc_mul(thc_add(z, T), R.to_level);
  // Written so that a NaN u (y NaN or Inf: the encode then reports the input non-finite and discards
  // the words) becomes 0, and the table index below stays in range; the same as std::max for numbers.
  u = u >= 0.0f ? u : 0.0f;
  u = R.gf < u ? R.gf : u;
  int32_t k = (int32_t)u;
  k = R.kmax < k ? R.kmax : k;
  const float lo = R.lo[k], width = R.width[k];
  const float p_up = thc_mul(thc_sub(u, lo), R.inv_width[k]);
  return thc_add(lo, draw < p_up ? width : 0.0f);
}

// The rank's own dequantized value of a level (error feedback): level * a + b, one rounding.
LHC_HD float thc_dequantize(float level, float a, float b) { return thc_fmaf(level, a, b); }

// An aggregated digit (an exact integer in double) -> digit * a + b, one rounding in double, then float.
LHC_HD float thc_digit_value(double digit, double a, double b) { return (float)thc_fma(digit, a, b); }

// ---- the squared norm ||x + e||^2 in a fixed order ------------------------------------------------
// The padded vector v is cut into chunks of kThcNormChunk coordinates (v is 0 past numel). Chunk c:
// lane t (of kThcNormLanes) accumulates, in float, v[i]^2 for i = c*1024 + t + 256 k, k = 0..3 in
// order, each step one fma from 0.0f; the 256 lanes are widened to double and summed by the tree
// below. The chunk partials are then summed by the same tree, 1024 at a time (thc_tree_sum).
// Neither the Hadamard block size nor a thread count enters this order.
constexpr uint64_t kThcNormChunk = 1024;
constexpr uint32_t kThcNormLanes = 256;
constexpr uint32_t kThcTreeWidth = 1024;

// Lane t of the chunk starting at v (count valid coordinates, count <= kThcNormChunk).
LHC_HD float thc_norm_lane(const float* v, uint64_t count, uint32_t t) {
  float acc = 0.0f;
  for (uint64_t i = t; i < count; i += kThcNormLanes) acc = thc_fmaf(v[i], v[i], acc);
  return acc;
}

#if !defined(__CUDACC_RTC__) && !defined(__CUDA_ARCH__)
// Host versions of the fixed order (the device runs the same tree across threads).
// d[0, n) with n a power of two: for s = n/2, ..., 1: d[i] += d[i + s] (i < s). Returns d[0].
inline double thc_tree_pow2(double* d, uint32_t n) {
  for (uint32_t s = n >> 1; s > 0; s >>= 1)
    for (uint32_t i = 0; i < s; ++i) d[i] = thc_dadd(d[i], d[i + s]);
  return d[0];
}

// Sum of squares of one chunk: v[0, count) (count <= kThcNormChunk), or x + e when e is non-null.
inline double thc_chunk_sum_squares(const float* x, const float* e, uint64_t count) {
  float lane[kThcNormLanes];
  for (uint32_t t = 0; t < kThcNormLanes; ++t) lane[t] = 0.0f;
  if (count == kThcNormChunk) {
    for (uint64_t k = 0; k < kThcNormChunk; k += kThcNormLanes)
      for (uint32_t t = 0; t < kThcNormLanes; ++t) {
        const float v = e ? x[k + t] + e[k + t] : x[k + t];
        lane[t] = thc_fmaf(v, v, lane[t]);
      }
  } else {
    for (uint64_t i = 0; i < count; ++i) {
      const float v = e ? x[i] + e[i] : x[i];
      lane[i % kThcNormLanes] = thc_fmaf(v, v, lane[i % kThcNormLanes]);
    }
  }
  double d[kThcNormLanes];
  for (uint32_t t = 0; t < kThcNormLanes; ++t) d[t] = (double)lane[t];
  return thc_tree_pow2(d, kThcNormLanes);
}

// The tree over n partials: groups of 1024 (the last zero-padded) summed by thc_tree_pow2, then the
// group sums the same way, until one value is left. p is overwritten.
inline double thc_tree_sum(double* p, uint64_t n) {
  if (n == 0) return 0.0;
  double d[kThcTreeWidth];
  while (n > 1) {
    const uint64_t groups = (n + kThcTreeWidth - 1) / kThcTreeWidth;
    for (uint64_t gi = 0; gi < groups; ++gi) {
      for (uint32_t i = 0; i < kThcTreeWidth; ++i) {
        const uint64_t j = gi * kThcTreeWidth + i;
        d[i] = j < n ? p[j] : 0.0;
      }
      p[gi] = thc_tree_pow2(d, kThcTreeWidth);
    }
    n = groups;
  }
  return p[0];
}
#endif

// ---- the payload checksum (lossless_hc/thc/layout.py, THCLayout) ----------------------------------
// Rank r's checksum is sum_w c_w q_w mod P over its level words q_w (w = 0 at the first level word);
// the aggregate's must be congruent to sum_w c_w S_w over the summed words S_w. Integer arithmetic
// only, so every backend computes the same value: P < 2^25, so residue products stay below 2^50.
struct ThcCheck {
  uint64_t prime;  // P
  uint64_t c0;     // in [0, P - 1)
  uint64_t k;      // in [1, P - 1), coprime to P - 1 (so c_w != c_v for 0 < |w - v| < P - 1)
};

// c_w = 1 + ((c0 + w k) mod (P - 1)), in [1, P - 1]: never 0, so every word counts.
LHC_HD uint64_t thc_check_coeff(const ThcCheck& C, uint64_t w) {
  const uint64_t m = C.prime - 1;
  return 1 + (C.c0 + (w % m) * C.k) % m;
}

// c_w * (S mod P) mod P for a word of integer value S (< 2^64).
LHC_HD uint64_t thc_check_term(const ThcCheck& C, uint64_t w, uint64_t S) {
  return (S % C.prime) * thc_check_coeff(C, w) % C.prime;
}

// ---- digit packing (see ThcLayout in lhc_layout.h) ------------------------------------------------
// base^count as an exact integer (count <= per_word, so it stays below 2^64).
LHC_HD uint64_t thc_pow(uint64_t base, uint32_t count) {
  uint64_t p = 1;
  for (uint32_t j = 0; j < count; ++j) p *= base;
  return p;
}

}  // namespace lhc
