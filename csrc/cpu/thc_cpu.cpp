// CPU kernels of the THC codec (see thc_cpu.h for the contracts).
#include "thc_cpu.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

namespace lhc {
namespace cpu {
namespace {

int thc_threads(int num_threads) { return num_threads > 0 ? num_threads : omp_get_max_threads(); }

// Flip the IEEE sign bit of v when bit is 1: multiplying by +-1 without a branch or a multiply.
inline float flip_sign(float v, uint32_t bit) {
  uint32_t u;
  std::memcpy(&u, &v, 4);
  u ^= bit << 31;
  std::memcpy(&v, &u, 4);
  return v;
}

// In-place unnormalised Walsh-Hadamard transform of n = 2^k floats (Sylvester order):
// a <- H_n a with H_1 = [1], H_2m = [[H_m, H_m], [H_m, -H_m]]. Cloned for AVX-512 and AVX2: the
// butterflies of stages h >= 8 are contiguous runs the compiler vectorises; the first three stages
// are done as one 8-point transform per group of 8 so they do not run as short scalar loops.
__attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
void fwht_inplace(float* __restrict a, uint64_t n) {
  uint64_t h = 1;
  if (n >= 8) {
    for (uint64_t i = 0; i < n; i += 8) {
      float* p = a + i;
      const float s0 = p[0] + p[1], d0 = p[0] - p[1], s1 = p[2] + p[3], d1 = p[2] - p[3];
      const float s2 = p[4] + p[5], d2 = p[4] - p[5], s3 = p[6] + p[7], d3 = p[6] - p[7];
      const float t0 = s0 + s1, t1 = d0 + d1, t2 = s0 - s1, t3 = d0 - d1;
      const float t4 = s2 + s3, t5 = d2 + d3, t6 = s2 - s3, t7 = d2 - d3;
      p[0] = t0 + t4; p[1] = t1 + t5; p[2] = t2 + t6; p[3] = t3 + t7;
      p[4] = t0 - t4; p[5] = t1 - t5; p[6] = t2 - t6; p[7] = t3 - t7;
    }
    h = 8;
  }
  for (; h < n; h <<= 1) {
    for (uint64_t i = 0; i < n; i += 2 * h) {
      float* __restrict lo = a + i;
      float* __restrict hi = a + i + h;
      for (uint64_t j = 0; j < h; ++j) {
        const float u = lo[j], v = hi[j];
        lo[j] = u + v;
        hi[j] = u - v;
      }
    }
  }
}

// The signs of coordinates [start, start + count) as 0/1 bits into bit[]; count is the block size.
inline void sign_bits(uint64_t stream, uint64_t start, uint64_t count, uint32_t* bit) {
  if ((start & 63) == 0 && (count & 63) == 0) {
    for (uint64_t c = 0; c < count; c += 64) {
      const uint64_t bits = thc_sign_bits(stream, (start + c) >> 6);
      for (uint32_t j = 0; j < 64; ++j) bit[c + j] = (uint32_t)((bits >> j) & 1);
    }
    return;
  }
  for (uint64_t i = 0; i < count; ++i) {
    const uint64_t idx = start + i;
    bit[i] = (uint32_t)((thc_sign_bits(stream, idx >> 6) >> (idx & 63)) & 1);
  }
}

}  // namespace

ThcForwardStats thc_rht_forward(const ThcLayout& L, uint64_t sign_stream, const float* x, const float* e, float* y,
                                int num_threads) {
  const int nt = thc_threads(num_threads);
  const uint64_t B = L.block, nblocks = L.padded / L.block;
  const float inv_sqrt = (float)(1.0 / std::sqrt((double)B));
  std::vector<double> partial(nblocks, 0.0);
#pragma omp parallel num_threads(nt)
  {
    std::vector<uint32_t> bit(B);
#pragma omp for schedule(static)
    for (int64_t b = 0; b < (int64_t)nblocks; ++b) {
      const uint64_t start = (uint64_t)b * B;
      const uint64_t valid = start >= L.numel ? 0 : std::min<uint64_t>(B, L.numel - start);
      float* __restrict yb = y + start;
      sign_bits(sign_stream, start, B, bit.data());
      double ss = 0.0;
      if (e) {
        for (uint64_t i = 0; i < valid; ++i) {
          const float v = x[start + i] + e[start + i];
          ss += (double)v * (double)v;
          yb[i] = flip_sign(v * inv_sqrt, bit[i]);
        }
      } else {
        for (uint64_t i = 0; i < valid; ++i) {
          const float v = x[start + i];
          ss += (double)v * (double)v;
          yb[i] = flip_sign(v * inv_sqrt, bit[i]);
        }
      }
      for (uint64_t i = valid; i < B; ++i) yb[i] = 0.0f;
      fwht_inplace(yb, B);
      partial[b] = ss;
    }
  }
  ThcForwardStats st;
  for (uint64_t b = 0; b < nblocks; ++b) st.sum_squares += partial[b];  // block order: deterministic
  st.non_finite = std::isfinite(st.sum_squares) ? 0u : 1u;
  return st;
}

void thc_rht_inverse(const ThcLayout& L, uint64_t sign_stream, float* y, float* out, const float* plus_a,
                     const float* plus_b, int num_threads) {
  const int nt = thc_threads(num_threads);
  const uint64_t B = L.block, nblocks = L.padded / L.block;
  const float inv_sqrt = (float)(1.0 / std::sqrt((double)B));
#pragma omp parallel num_threads(nt)
  {
    std::vector<uint32_t> bit(B);
#pragma omp for schedule(static)
    for (int64_t b = 0; b < (int64_t)nblocks; ++b) {
      const uint64_t start = (uint64_t)b * B;
      if (start >= L.numel) continue;  // padding-only blocks do not reach the output
      const uint64_t valid = std::min<uint64_t>(B, L.numel - start);
      float* __restrict yb = y + start;
      fwht_inplace(yb, B);
      sign_bits(sign_stream, start, B, bit.data());
      float* o = out + start;
      if (plus_a && plus_b) {
        const float* pa = plus_a + start;
        const float* pb = plus_b + start;
        for (uint64_t i = 0; i < valid; ++i) o[i] = (pa[i] + pb[i]) - flip_sign(yb[i] * inv_sqrt, bit[i]);
      } else if (plus_a) {
        const float* pa = plus_a + start;
        for (uint64_t i = 0; i < valid; ++i) o[i] = pa[i] - flip_sign(yb[i] * inv_sqrt, bit[i]);
      } else {
        for (uint64_t i = 0; i < valid; ++i) o[i] = flip_sign(yb[i] * inv_sqrt, bit[i]);
      }
    }
  }
}

namespace {

constexpr uint64_t kWordsPerChunk = 1024;

// Levels of coords [first, first + count) into q (see thc_quantize_pack). Cloned so the table
// gathers and the 32-bit hashing vectorise.
__attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
void quantize_run(const ThcQuantizer& Q, uint32_t g, uint64_t round_stream, float* __restrict y, uint64_t first,
                  uint64_t count, bool write_back, uint32_t* __restrict q) {
  const float T = Q.threshold, to_level = (float)g / (2.0f * Q.threshold), scale = Q.scale;
  const float gf = (float)g;
  const int32_t kmax = (int32_t)g - 1;
  for (uint64_t i = 0; i < count; ++i) {
    float z = y[first + i] * scale;
    z = std::min(std::max(z, -T), T);
    const float u = std::min(std::max((z + T) * to_level, 0.0f), gf);
    const int32_t k = std::min((int32_t)u, kmax);
    const float lo = Q.lo[k], width = Q.width[k];
    const float p_up = (u - lo) * Q.inv_width[k];
    const float draw = (float)thc_uniform24(round_stream, first + i) * (1.0f / 16777216.0f);
    const float level = lo + (draw < p_up ? width : 0.0f);
    q[i] = (uint32_t)level;
    if (write_back) y[first + i] = level * Q.dequant_a + Q.dequant_b;
  }
}

}  // namespace

void thc_quantize_pack(const ThcLayout& L, const ThcQuantizer& Q, uint64_t round_stream, float* y, bool write_back,
                       int32_t word_kind, void* words, int num_threads) {
  const int nt = thc_threads(num_threads);
  const uint64_t pw = L.per_word, base = L.base;
  const uint64_t nchunks = (L.words + kWordsPerChunk - 1) / kWordsPerChunk;
#pragma omp parallel num_threads(nt)
  {
    std::vector<uint32_t> q(kWordsPerChunk * pw);
#pragma omp for schedule(static)
    for (int64_t c = 0; c < (int64_t)nchunks; ++c) {
      const uint64_t w0 = (uint64_t)c * kWordsPerChunk, w1 = std::min(L.words, w0 + kWordsPerChunk);
      const uint64_t first = w0 * pw, last = std::min(L.padded, w1 * pw);
      quantize_run(Q, L.granularity, round_stream, y, first, last - first, write_back, q.data());
      std::fill(q.begin() + (last - first), q.begin() + (w1 - w0) * pw, 0u);  // digits past `padded`
      for (uint64_t w = w0; w < w1; ++w) {
        const uint32_t* d = q.data() + (w - w0) * pw;
        uint64_t acc = 0;
        for (uint64_t j = pw; j-- > 0;) acc = acc * base + d[j];
        if (word_kind == kThcWordFloat64)
          static_cast<double*>(words)[w] = (double)acc;  // exact: acc < 2^53 by the layout rule
        else
          static_cast<int64_t*>(words)[w] = (int64_t)acc;
      }
    }
  }
}

uint64_t thc_unpack(const ThcLayout& L, int32_t word_kind, const void* words, double multiplier, double a, double b,
                    float* y, int num_threads) {
  const int nt = thc_threads(num_threads);
  const uint64_t pw = L.per_word, base = L.base;
  // Largest valid aggregated word: every digit n g = base - 1, i.e. base^per_word - 1.
  uint64_t limit = 1;
  for (uint64_t j = 0; j < pw; ++j) limit *= base;
  const uint64_t max_word = limit - 1;
  const double tolerance = multiplier == 1.0 ? 0.0 : 0.5;
  const double base_d = (double)base, inv_base = 1.0 / base_d;
  uint64_t bad = 0;
#pragma omp parallel for num_threads(nt) schedule(static) reduction(+ : bad)
  for (int64_t w = 0; w < (int64_t)L.words; ++w) {
    const uint64_t first = (uint64_t)w * pw;
    if (word_kind == kThcWordFloat64) {
      const double t = static_cast<const double*>(words)[w] * multiplier;
      double s = std::nearbyint(t);
      if (!(std::fabs(t - s) <= tolerance) || !(s >= 0.0) || s > (double)max_word) {
        ++bad;
        s = 0.0;
      }
      // s < 2^53: digit extraction in doubles is exact (q base <= s + base < 2^53), one correction.
      for (uint64_t j = 0; j < pw; ++j) {
        double quot = std::floor(s * inv_base);
        double digit = s - quot * base_d;
        if (digit < 0) { quot -= 1; digit += base_d; }
        else if (digit >= base_d) { quot += 1; digit -= base_d; }
        s = quot;
        const uint64_t idx = first + j;
        if (idx < L.padded) y[idx] = (float)(digit * a + b);
        else if (digit != 0) ++bad;
      }
    } else {
      const int64_t v = static_cast<const int64_t*>(words)[w];
      uint64_t s = (uint64_t)v;
      if (v < 0 || s > max_word) {
        ++bad;
        s = 0;
      }
      for (uint64_t j = 0; j < pw; ++j) {
        const uint64_t digit = s % base;
        s /= base;
        const uint64_t idx = first + j;
        if (idx < L.padded) y[idx] = (float)((double)digit * a + b);
        else if (digit != 0) ++bad;
      }
    }
  }
  return bad;
}

}  // namespace cpu
}  // namespace lhc
