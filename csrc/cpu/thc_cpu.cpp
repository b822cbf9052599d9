// CPU kernels of the THC codec (see thc_cpu.h for the contracts).
#include "thc_cpu.h"

#include "../thc_math.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

namespace lhc {
namespace cpu {
namespace {

int thc_threads(int num_threads) { return num_threads > 0 ? num_threads : omp_get_max_threads(); }

inline float flip_sign(float v, uint32_t bit) { return thc_flip_sign(v, bit); }

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

// The squared norm's chunk partials (thc_chunk_sum_squares, thc_math.h), compiled per ISA level so its
// fused multiply-adds are instructions, not library calls.
__attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
double chunk_sum_squares(const float* x, const float* e, uint64_t count) {
  return thc_chunk_sum_squares(x, e, count);
}

// Every chunk partial from x + e directly (used when the Hadamard block is smaller than a chunk).
void chunk_partials(const ThcLayout& L, const float* x, const float* e, double* partial, int nt) {
  const uint64_t nchunks = (L.padded + kThcNormChunk - 1) / kThcNormChunk;
#pragma omp parallel for num_threads(nt) schedule(static)
  for (int64_t c = 0; c < (int64_t)nchunks; ++c) {
    const uint64_t start = (uint64_t)c * kThcNormChunk;
    const uint64_t count = start >= L.numel ? 0 : std::min<uint64_t>(kThcNormChunk, L.numel - start);
    partial[c] = chunk_sum_squares(x + start, e ? e + start : nullptr, count);
  }
}

// Levels of the block's coords [0, B) (global index start + i) into q, and, with WriteBack, the
// rank's own dequantized value into y. All 32-bit lane arithmetic: the high half of the global index
// is constant within a block (blocks are aligned powers of two below 2^32).
template <bool WriteBack>
__attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
void quantize_block(const ThcQuantizer& Q, uint32_t g, uint64_t round_stream, uint64_t start, uint64_t count,
                    float* __restrict y, uint32_t* __restrict q) {
  // thc_level / thc_dequantize (thc_math.h): the same operations as the CUDA kernels.
  const ThcRounding R = thc_rounding(Q.lo, Q.width, Q.inv_width, Q.scale, Q.threshold, g);
  const float da = Q.dequant_a, db = Q.dequant_b;
  const uint32_t key_lo = (uint32_t)round_stream;
  const uint32_t key_hi = (uint32_t)(round_stream >> 32) ^ ((uint32_t)(start >> 32) * 0x9e3779b9u);
  const uint32_t first = (uint32_t)start;
  for (uint64_t i = 0; i < count; ++i) {
    // thc_uniform24(round_stream, start + i) with the per-block halves of the key hoisted (same bits).
    const uint32_t h = fmix32((first + (uint32_t)i) ^ key_lo);
    const float level = thc_level(R, y[i], thc_draw(fmix32(h + key_hi) >> 8));
    q[i] = (uint32_t)(int32_t)level;
    if (WriteBack) y[i] = thc_dequantize(level, da, db);
  }
}

// Round to the nearest integer for |x| < 2^51 with two additions (2^52 + x has no fraction bits),
// which vectorise on every x86 level, unlike floor/nearbyint before SSE4.1. The digit loops below
// only need an estimate within one of the true quotient; they correct it.
inline double round_small(double x) {
  constexpr double kShift = 4503599627370496.0;  // 2^52
  return (x + kShift) - kShift;
}

// Full words with a compile-time digit count: the strided digit accesses become fixed
// interleaving patterns the compiler vectorises across words. Horner in doubles (exact below 2^53).
template <int PW>
__attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
void pack_full_words_f64(const uint32_t* __restrict q, uint64_t nwords, double base, double* __restrict out) {
  for (uint64_t w = 0; w < nwords; ++w) {
    double a = 0.0;
    for (int j = PW - 1; j >= 0; --j) a = a * base + (double)(int32_t)q[w * PW + j];
    out[w] = a;
  }
}

// Digits of full words, 16 words at a time: the arithmetic runs across the 16 words of a tile
// (contiguous, vectorised), then the tile's digits are written out in coordinate order.
template <int PW>
__attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
void digits_full_words_f64(double* __restrict s, uint64_t nwords, double base_d, double a, double b,
                           float* __restrict y) {
  constexpr int kTile = 16;
  const double inv_base = 1.0 / base_d;
  uint64_t w0 = 0;
  for (; w0 + kTile <= nwords; w0 += kTile) {
    double v[kTile];
    float out[PW][kTile];
    for (int l = 0; l < kTile; ++l) v[l] = s[w0 + l];
    for (int j = 0; j < PW; ++j) {
      for (int l = 0; l < kTile; ++l) {
        double quot = round_small(v[l] * inv_base);
        const double rem = v[l] - quot * base_d;   // exact; off by one base at most
        quot += (rem >= base_d ? 1.0 : 0.0) - (rem < 0.0 ? 1.0 : 0.0);
        out[j][l] = thc_digit_value(v[l] - quot * base_d, a, b);
        v[l] = quot;
      }
    }
    float* __restrict yt = y + w0 * PW;
    for (int l = 0; l < kTile; ++l)
      for (int j = 0; j < PW; ++j) yt[l * PW + j] = out[j][l];
  }
  for (; w0 < nwords; ++w0) {
    double v = s[w0];
    for (int j = 0; j < PW; ++j) {
      double quot = round_small(v * inv_base);
      const double rem = v - quot * base_d;
      quot += (rem >= base_d ? 1.0 : 0.0) - (rem < 0.0 ? 1.0 : 0.0);
      y[w0 * PW + j] = thc_digit_value(v - quot * base_d, a, b);
      v = quot;
    }
  }
}

// Dispatch on the digit count (1..12 cover granularity 30 up to ~10^3 ranks); false: not handled.
bool pack_full_dispatch(uint64_t pw, const uint32_t* q, uint64_t nwords, double base, double* out) {
  switch (pw) {
#define LHC_PACK_CASE(P) case P: pack_full_words_f64<P>(q, nwords, base, out); return true;
    LHC_PACK_CASE(1) LHC_PACK_CASE(2) LHC_PACK_CASE(3) LHC_PACK_CASE(4) LHC_PACK_CASE(5) LHC_PACK_CASE(6)
    LHC_PACK_CASE(7) LHC_PACK_CASE(8) LHC_PACK_CASE(9) LHC_PACK_CASE(10) LHC_PACK_CASE(11) LHC_PACK_CASE(12)
#undef LHC_PACK_CASE
    default: return false;
  }
}

bool digits_full_dispatch(uint64_t pw, double* s, uint64_t nwords, double base, double a, double b, float* y) {
  switch (pw) {
#define LHC_DIGITS_CASE(P) case P: digits_full_words_f64<P>(s, nwords, base, a, b, y); return true;
    LHC_DIGITS_CASE(1) LHC_DIGITS_CASE(2) LHC_DIGITS_CASE(3) LHC_DIGITS_CASE(4) LHC_DIGITS_CASE(5)
    LHC_DIGITS_CASE(6) LHC_DIGITS_CASE(7) LHC_DIGITS_CASE(8) LHC_DIGITS_CASE(9) LHC_DIGITS_CASE(10)
    LHC_DIGITS_CASE(11) LHC_DIGITS_CASE(12)
#undef LHC_DIGITS_CASE
    default: return false;
  }
}

// Digits q[0, count) (count <= words * per_word; missing digits are 0) into `words` words.
// Horner in doubles while base^per_word <= 2^53 (exact, vectorisable across words), else uint64.
void pack_block(const uint32_t* q, uint64_t count, uint64_t per_word, uint64_t base, bool fits_double,
                int32_t word_kind, uint64_t nwords, void* words) {
  uint64_t w = 0;
  if (fits_double && word_kind == kThcWordFloat64 &&
      pack_full_dispatch(per_word, q, count / per_word, (double)base, static_cast<double*>(words)))
    w = count / per_word;
  for (; w < nwords; ++w) {
    const uint64_t first = w * per_word;
    const uint64_t have = first >= count ? 0 : std::min<uint64_t>(per_word, count - first);
    uint64_t acc = 0;
    if (fits_double) {
      double a = 0.0;
      for (uint64_t j = have; j-- > 0;) a = a * (double)base + (double)q[first + j];
      acc = (uint64_t)a;
    } else {
      for (uint64_t j = have; j-- > 0;) acc = acc * base + q[first + j];
    }
    if (word_kind == kThcWordFloat64)
      static_cast<double*>(words)[w] = (double)acc;  // exact: acc < 2^53 by the layout rule
    else
      static_cast<int64_t*>(words)[w] = (int64_t)acc;
  }
}

// The float64 words whose digits all lie inside the group (the common case), vectorised across
// words: validity first, then one digit position at a time for all words. s is scratch (nwords).
// round_small is round-to-nearest for |t| < 2^51; anything larger fails the range check.
__attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
uint64_t unpack_full_words_f64(const double* __restrict words, uint64_t nwords, uint64_t per_word, double base_d,
                               double max_word, double multiplier, double tolerance, double a, double b,
                               float* __restrict y, double* __restrict s) {
  uint64_t bad = 0;
  for (uint64_t w = 0; w < nwords; ++w) {
    const double t = words[w] * multiplier;
    const double r = round_small(t);
    // Non-short-circuit & keeps the loop free of branches; every comparison is false for NaN.
    const bool ok = (std::fabs(t - r) <= tolerance) & (r >= 0.0) & (r <= max_word);
    bad += (uint64_t)!ok;
    s[w] = ok ? r : 0.0;
  }
  if (digits_full_dispatch(per_word, s, nwords, base_d, a, b, y)) return bad;
  const double inv_base = 1.0 / base_d;
  for (uint64_t j = 0; j < per_word; ++j) {
    for (uint64_t w = 0; w < nwords; ++w) {
      const double v = s[w];
      double quot = round_small(v * inv_base);
      const double rem = v - quot * base_d;   // exact; off by one base at most
      quot += (rem >= base_d ? 1.0 : 0.0) - (rem < 0.0 ? 1.0 : 0.0);
      const double digit = v - quot * base_d;
      s[w] = quot;
      y[w * per_word + j] = thc_digit_value(digit, a, b);
    }
  }
  return bad;
}

// Aggregated words -> digit * a + b into y[0, count). Returns the number of invalid words: not an
// integer (within `tolerance` after multiplying), negative, or above the largest aggregate of the
// digits the word holds (base^have - 1; the padding digits of a block's last word must be 0).
uint64_t unpack_block(const void* words, int32_t word_kind, uint64_t nwords, uint64_t count, uint64_t per_word,
                      uint64_t base, double multiplier, double tolerance, double a, double b, float* __restrict y) {
  uint64_t bad = 0;
  const double base_d = (double)base, inv_base = 1.0 / base_d;
  uint64_t w = 0;
  if (word_kind == kThcWordFloat64) {
    const uint64_t full = count / per_word;
    double max_word = 1.0;
    for (uint64_t j = 0; j < per_word; ++j) max_word *= base_d;
    thread_local std::vector<double> scratch;
    if (scratch.size() < full) scratch.resize(full);
    bad += unpack_full_words_f64(static_cast<const double*>(words), full, per_word, base_d, max_word - 1.0,
                                 multiplier, tolerance, a, b, y, scratch.data());
    w = full;
  }
  for (; w < nwords; ++w) {
    const uint64_t first = w * per_word;
    const uint64_t have = std::min<uint64_t>(per_word, count - first);
    uint64_t limit = 1;
    for (uint64_t j = 0; j < have; ++j) limit *= base;
    if (word_kind == kThcWordFloat64) {
      const double t = static_cast<const double*>(words)[w] * multiplier;
      double s = std::nearbyint(t);
      if (!(std::fabs(t - s) <= tolerance) || !(s >= 0.0) || !(s <= (double)(limit - 1))) {
        ++bad;
        s = 0.0;
      }
      // s < 2^53: digit extraction in doubles is exact (quot * base <= s + base < 2^53), one correction.
      for (uint64_t j = 0; j < have; ++j) {
        double quot = std::floor(s * inv_base);
        double digit = s - quot * base_d;
        quot = digit < 0 ? quot - 1 : (digit >= base_d ? quot + 1 : quot);
        digit = s - quot * base_d;
        s = quot;
        y[first + j] = thc_digit_value(digit, a, b);
      }
    } else {
      const int64_t v = static_cast<const int64_t*>(words)[w];
      uint64_t s = (uint64_t)v;
      if (v < 0 || s > limit - 1) {
        ++bad;
        s = 0;
      }
      for (uint64_t j = 0; j < have; ++j) {
        y[first + j] = thc_digit_value((double)(s % base), a, b);
        s /= base;
      }
    }
  }
  return bad;
}

inline void* word_at(void* words, int32_t word_kind, uint64_t w) {
  return word_kind == kThcWordFloat64 ? (void*)(static_cast<double*>(words) + w) : (void*)(static_cast<int64_t*>(words) + w);
}
inline const void* word_at(const void* words, int32_t word_kind, uint64_t w) {
  return word_at(const_cast<void*>(words), word_kind, w);
}

inline bool horner_fits_double(const ThcLayout& L) {
  double p = 1.0;
  for (uint32_t j = 0; j < L.per_word; ++j) p *= (double)L.base;
  return p <= 9007199254740992.0;  // 2^53
}

// NaN/Inf anywhere in x[0, n)? (x * 0 is NaN exactly for non-finite x; vectorisable.)
bool any_non_finite(const float* x, uint64_t n, int nt) {
  int bad = 0;
#pragma omp parallel for num_threads(nt) schedule(static) reduction(| : bad)
  for (int64_t c = 0; c < (int64_t)((n + 4095) / 4096); ++c) {
    const uint64_t lo = (uint64_t)c * 4096, hi = std::min<uint64_t>(n, lo + 4096);
    float acc = 0.0f;
    for (uint64_t i = lo; i < hi; ++i) acc += x[i] * 0.0f;
    bad |= acc != 0.0f;  // NaN compares unequal
  }
  return bad != 0;
}

}  // namespace

ThcEncodeStats thc_encode(const ThcLayout& L, const ThcQuantizer* Q, uint64_t sign_stream, uint64_t round_stream,
                          const float* x, float* e, int32_t word_kind, void* words, int num_threads) {
  const int nt = thc_threads(num_threads);
  ThcEncodeStats st;
  if (any_non_finite(x, L.numel, nt)) {
    st.non_finite = 1;  // nothing written: e keeps its value
    return st;
  }
  const uint64_t B = L.block, ngroups = thc_groups(L), GB = L.group_blocks;
  const float inv_sqrt = (float)(1.0 / std::sqrt((double)B));
  const bool fits_double = horner_fits_double(L);
  // ||x + e||^2 in the fixed order of thc_math.h: chunk partials, then the tree.
  const uint64_t nchunks = (L.padded + kThcNormChunk - 1) / kThcNormChunk;
  const bool chunks_in_blocks = B >= kThcNormChunk;   // else computed here, before the blocks
  std::vector<double> partial(nchunks, 0.0);
  if (!chunks_in_blocks) chunk_partials(L, x, e, partial.data(), nt);
#pragma omp parallel num_threads(nt)
  {
    std::vector<float> buf(GB * B);
    std::vector<uint32_t> bit(GB * B), q(GB * B + L.per_word, 0u);
#pragma omp for schedule(static)
    for (int64_t gi = 0; gi < (int64_t)ngroups; ++gi) {
      const uint64_t blocks = thc_group_size(L, (uint64_t)gi);
      for (uint64_t j = 0; j < blocks; ++j) {
        const uint64_t bi = (uint64_t)gi * GB + j, start = bi * B;
        const uint64_t valid = start >= L.numel ? 0 : std::min<uint64_t>(B, L.numel - start);
        float* __restrict y = buf.data() + j * B;
        const float* __restrict xb = x + start;
        float* __restrict eb = e ? e + start : nullptr;
        if (eb) {
          for (uint64_t i = 0; i < valid; ++i) y[i] = xb[i] + eb[i];
        } else {
          for (uint64_t i = 0; i < valid; ++i) y[i] = xb[i];
        }
        if (chunks_in_blocks)
          for (uint64_t c = 0; c < B / kThcNormChunk; ++c) {
            const uint64_t off = c * kThcNormChunk;
            partial[(start + off) / kThcNormChunk] =
                chunk_sum_squares(y + off, nullptr, valid > off ? std::min<uint64_t>(kThcNormChunk, valid - off) : 0);
          }
        if (!Q) {  // norm-only round: the whole of v stays owed
          if (eb) std::copy(y, y + valid, eb);
          continue;
        }
        uint32_t* sb = bit.data() + j * B;
        sign_bits(sign_stream, start, B, sb);
        for (uint64_t i = 0; i < valid; ++i) y[i] = flip_sign(y[i] * inv_sqrt, sb[i]);
        for (uint64_t i = valid; i < B; ++i) y[i] = 0.0f;
        fwht_inplace(y, B);
        if (eb) quantize_block<true>(*Q, L.granularity, round_stream, start, B, y, q.data() + j * B);
        else quantize_block<false>(*Q, L.granularity, round_stream, start, B, y, q.data() + j * B);
      }
      if (!Q) continue;
      pack_block(q.data(), blocks * B, L.per_word, L.base, fits_double, word_kind, thc_words_for(L, blocks * B),
                 word_at(words, word_kind, thc_group_first_word(L, (uint64_t)gi)));
      if (!e) continue;
      for (uint64_t j = 0; j < blocks; ++j) {
        // e <- (x + e) - RHT^{-1}(own dequantized levels), the block still in cache.
        const uint64_t start = ((uint64_t)gi * GB + j) * B;
        const uint64_t valid = start >= L.numel ? 0 : std::min<uint64_t>(B, L.numel - start);
        if (!valid) continue;
        float* __restrict y = buf.data() + j * B;
        const uint32_t* sb = bit.data() + j * B;
        const float* __restrict xb = x + start;
        float* __restrict eb = e + start;
        fwht_inplace(y, B);
        for (uint64_t i = 0; i < valid; ++i) eb[i] = (xb[i] + eb[i]) - flip_sign(y[i] * inv_sqrt, sb[i]);
      }
    }
  }
  st.sum_squares = thc_tree_sum(partial.data(), nchunks);
  if (!std::isfinite(st.sum_squares)) {
    // x was finite but x + e (or its square) overflowed float32: the memory is unusable.
    st.non_finite = 2;
    if (e) std::fill(e, e + L.numel, 0.0f);
  }
  return st;
}

uint64_t thc_decode(const ThcLayout& L, uint64_t sign_stream, int32_t word_kind, const void* words,
                    double multiplier, double a, double b, float* out, int num_threads) {
  const int nt = thc_threads(num_threads);
  const uint64_t B = L.block, ngroups = thc_groups(L), GB = L.group_blocks;
  const float inv_sqrt = (float)(1.0 / std::sqrt((double)B));
  const double tolerance = multiplier == 1.0 ? 0.0 : 0.5;
  uint64_t bad = 0;
#pragma omp parallel num_threads(nt) reduction(+ : bad)
  {
    std::vector<float> buf(GB * B);
    std::vector<uint32_t> bit(B);
#pragma omp for schedule(static)
    for (int64_t gi = 0; gi < (int64_t)ngroups; ++gi) {
      const uint64_t blocks = thc_group_size(L, (uint64_t)gi);
      bad += unpack_block(word_at(words, word_kind, thc_group_first_word(L, (uint64_t)gi)), word_kind,
                          thc_words_for(L, blocks * B), blocks * B, L.per_word, L.base, multiplier, tolerance, a, b,
                          buf.data());
      for (uint64_t j = 0; j < blocks; ++j) {
        const uint64_t start = ((uint64_t)gi * GB + j) * B;
        if (start >= L.numel) break;  // padding-only blocks: checked above, not needed
        const uint64_t valid = std::min<uint64_t>(B, L.numel - start);
        float* y = buf.data() + j * B;
        fwht_inplace(y, B);
        sign_bits(sign_stream, start, B, bit.data());
        float* o = out + start;
        for (uint64_t i = 0; i < valid; ++i) o[i] = flip_sign(y[i] * inv_sqrt, bit[i]);
      }
    }
  }
  return bad;
}

void thc_pack_levels(const ThcLayout& L, const uint32_t* levels, int32_t word_kind, void* words) {
  const bool fits_double = horner_fits_double(L);
  const uint64_t coords = (uint64_t)L.group_blocks * L.block;
  for (uint64_t gi = 0; gi < thc_groups(L); ++gi) {
    const uint64_t count = thc_group_size(L, gi) * L.block;
    pack_block(levels + gi * coords, count, L.per_word, L.base, fits_double, word_kind, thc_words_for(L, count),
               word_at(words, word_kind, thc_group_first_word(L, gi)));
  }
}

uint64_t thc_unpack_levels(const ThcLayout& L, int32_t word_kind, const void* words, double multiplier, float* sums) {
  const uint64_t coords = (uint64_t)L.group_blocks * L.block;
  uint64_t bad = 0;
  for (uint64_t gi = 0; gi < thc_groups(L); ++gi) {
    const uint64_t count = thc_group_size(L, gi) * L.block;
    bad += unpack_block(word_at(words, word_kind, thc_group_first_word(L, gi)), word_kind, thc_words_for(L, count),
                        count, L.per_word, L.base, multiplier, multiplier == 1.0 ? 0.0 : 0.5, 1.0, 0.0,
                        sums + gi * coords);
  }
  return bad;
}

}  // namespace cpu
}  // namespace lhc
