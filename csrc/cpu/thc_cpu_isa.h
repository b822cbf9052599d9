// thc_cpu_isa.h -- the THC CPU block kernels, compiled once per x86-64 level.
//
// No include guard: thc_cpu.cpp includes this file once per instruction-set level, each time with
// LHC_THC_ISA (the namespace of that copy), LHC_THC_ISA_NAME, LHC_THC_TARGET (a function attribute such
// as __attribute__((target("arch=x86-64-v4"))), or nothing for the portable copy), LHC_THC_PERMUTE
// (1 where a two-register variable permute is one instruction, i.e. AVX-512) and LHC_THC_VW (the
// register width in floats: 16, 8 or 4) defined, and picks one
// copy at run time (__builtin_cpu_supports; LHC_CPU_ISA or lossless_hc._C.thc_cpu_isa to force one).
// Per-function target attributes rather than target_clones: GCC vectorises the inlined helpers of
// thc_math.h inside a target("arch=...") function, not inside a clone.
//
// Every copy computes the same bits: the per-coordinate operations are thc_math.h's (or, where written
// here with GCC vector extensions, the same single IEEE operations on the same operands), every
// product that feeds a sum is an explicit fma, and the Walsh-Hadamard stages run in the order
// h = 1, 2, 4, ... with the butterflies u + v, u - v of the scalar definition (only the loops that
// schedule them differ). tests/test_thc.py compares every copy this machine can run.

namespace LHC_THC_ISA {

#define LHC_TGT LHC_THC_TARGET
#define LHC_TGT_INLINE LHC_THC_TARGET inline __attribute__((always_inline))

typedef float vf16 __attribute__((vector_size(64)));
typedef int32_t vi16 __attribute__((vector_size(64)));
typedef uint32_t vu16 __attribute__((vector_size(64)));

// Vectors cross helpers by reference only (a 64-byte vector passed by value has an ISA-dependent ABI).
#define LHC_LOAD16(v, p) __builtin_memcpy(&(v), (p), 64)
#define LHC_STORE16(p, v) __builtin_memcpy((p), &(v), 64)

// ---- Walsh-Hadamard transform ------------------------------------------------------------------
// Vectors of W = LHC_THC_VW lanes for the transform: the register width of the level (16 with
// AVX-512, 8 with AVX2, 4 with SSE2), so every shuffle below is one native instruction.
constexpr int W = LHC_THC_VW;
typedef float vfw __attribute__((vector_size(4 * LHC_THC_VW)));
typedef int32_t viw __attribute__((vector_size(4 * LHC_THC_VW)));
#define LHC_LOADW(v, p) __builtin_memcpy(&(v), (p), sizeof(vfw))
#define LHC_STOREW(p, v) __builtin_memcpy((p), &(v), sizeof(vfw))

// Stage H < W inside one vector: a lane with bit H clear gets u + v (itself plus its partner), a lane
// with bit H set gets u - v (its partner minus itself): the scalar butterfly, written as
// x * (+-1) + partner, one permute and one fused operation per stage. The same bits: x * (+-1) is
// exact, so the one rounding is that of x + partner or of partner + (-x) = partner - x.
template <int H>
LHC_TGT_INLINE void stage_in(vfw& x) {
  viw swap;
  vfw sign;
  for (int l = 0; l < W; ++l) {
    swap[l] = l ^ H;
    sign[l] = (l & H) ? -1.0f : 1.0f;
  }
  const vfw s = __builtin_shuffle(x, swap);
  x = x * sign + s;
}

// Stages 1 .. W/2 of the W coordinates at p.
LHC_TGT_INLINE void stages_in_vector(float* p) {
  vfw x;
  LHC_LOADW(x, p);
  stage_in<1>(x);
  stage_in<2>(x);
  if (W > 4) stage_in<(W > 4 ? 4 : 1)>(x);
  if (W > 8) stage_in<(W > 8 ? 8 : 1)>(x);
  LHC_STOREW(p, x);
}

// Blocks below W coordinates: the scalar stages.
LHC_TGT_INLINE void fwht_small(float* __restrict a, uint64_t n) {
  for (uint64_t h = 1; h < n; h <<= 1)
    for (uint64_t i = 0; i < n; i += 2 * h)
      for (uint64_t j = i; j < i + h; ++j) {
        const float u = a[j], v = a[j + h];
        a[j] = u + v;
        a[j + h] = u - v;
      }
}

// In place, a <- H_n a (unnormalised, Sylvester order), n = 2^k: stages h < W in registers, then the
// stages h >= W three at a time (8 vectors h apart: stages h, 2h, 4h), then two, then one.
LHC_TGT void fwht(float* __restrict a, uint64_t n) {
  if (n < (uint64_t)W) {
    fwht_small(a, n);
    return;
  }
  for (uint64_t i = 0; i < n; i += W) stages_in_vector(a + i);
  uint64_t h = W;
  for (; 8 * h <= n; h *= 8)
    for (uint64_t i = 0; i < n; i += 8 * h)
      for (uint64_t j = i; j < i + h; j += W) {
        float* p = a + j;
        vfw r0, r1, r2, r3, r4, r5, r6, r7;
        LHC_LOADW(r0, p);
        LHC_LOADW(r1, p + h);
        LHC_LOADW(r2, p + 2 * h);
        LHC_LOADW(r3, p + 3 * h);
        LHC_LOADW(r4, p + 4 * h);
        LHC_LOADW(r5, p + 5 * h);
        LHC_LOADW(r6, p + 6 * h);
        LHC_LOADW(r7, p + 7 * h);
        const vfw a0 = r0 + r1, a1 = r0 - r1, a2 = r2 + r3, a3 = r2 - r3;   // stage h
        const vfw a4 = r4 + r5, a5 = r4 - r5, a6 = r6 + r7, a7 = r6 - r7;
        const vfw b0 = a0 + a2, b2 = a0 - a2, b1 = a1 + a3, b3 = a1 - a3;   // stage 2h
        const vfw b4 = a4 + a6, b6 = a4 - a6, b5 = a5 + a7, b7 = a5 - a7;
        r0 = b0 + b4;                                                        // stage 4h
        r4 = b0 - b4;
        r1 = b1 + b5;
        r5 = b1 - b5;
        r2 = b2 + b6;
        r6 = b2 - b6;
        r3 = b3 + b7;
        r7 = b3 - b7;
        LHC_STOREW(p, r0);
        LHC_STOREW(p + h, r1);
        LHC_STOREW(p + 2 * h, r2);
        LHC_STOREW(p + 3 * h, r3);
        LHC_STOREW(p + 4 * h, r4);
        LHC_STOREW(p + 5 * h, r5);
        LHC_STOREW(p + 6 * h, r6);
        LHC_STOREW(p + 7 * h, r7);
      }
  for (; 4 * h <= n; h *= 4)
    for (uint64_t i = 0; i < n; i += 4 * h)
      for (uint64_t j = i; j < i + h; j += W) {
        float* p = a + j;
        vfw r0, r1, r2, r3;
        LHC_LOADW(r0, p);
        LHC_LOADW(r1, p + h);
        LHC_LOADW(r2, p + 2 * h);
        LHC_LOADW(r3, p + 3 * h);
        const vfw a0 = r0 + r1, a1 = r0 - r1, a2 = r2 + r3, a3 = r2 - r3;
        r0 = a0 + a2;
        r2 = a0 - a2;
        r1 = a1 + a3;
        r3 = a1 - a3;
        LHC_STOREW(p, r0);
        LHC_STOREW(p + h, r1);
        LHC_STOREW(p + 2 * h, r2);
        LHC_STOREW(p + 3 * h, r3);
      }
  for (; 2 * h <= n; h *= 2)
    for (uint64_t i = 0; i < n; i += 2 * h)
      for (uint64_t j = i; j < i + h; j += W) {
        vfw u, v;
        LHC_LOADW(u, a + j);
        LHC_LOADW(v, a + j + h);
        const vfw s = u + v, d = u - v;
        LHC_STOREW(a + j, s);
        LHC_STOREW(a + j + h, d);
      }
}

// ---- signs and the squared norm ------------------------------------------------------------------
// m[i] = the RHT sign of coordinate start + i as an IEEE sign mask (bit 31), i < count.
LHC_TGT_INLINE void sign_masks(uint64_t stream, uint64_t start, uint64_t count, uint32_t* __restrict m) {
  if ((start & 63) == 0 && (count & 63) == 0) {
    for (uint64_t c = 0; c < count; c += 64) {
      const uint64_t bits = thc_sign_bits(stream, (start + c) >> 6);
      const uint32_t lo = (uint32_t)bits, hi = (uint32_t)(bits >> 32);
      for (uint32_t j = 0; j < 32; ++j) m[c + j] = ((lo >> j) & 1u) << 31;
      for (uint32_t j = 0; j < 32; ++j) m[c + 32 + j] = ((hi >> j) & 1u) << 31;
    }
    return;
  }
  for (uint64_t i = 0; i < count; ++i) m[i] = thc_sign_bit(stream, start + i) << 31;
}

// y[i] = thc_flip_sign(v[i] * s, m[i]) for i < n (y may be v).
LHC_TGT_INLINE void scale_flip(const float* v, float s, const uint32_t* __restrict m, uint64_t n, float* y) {
  for (uint64_t i = 0; i < n; ++i) {
    const float t = v[i] * s;
    uint32_t u;
    __builtin_memcpy(&u, &t, 4);
    u ^= m[i];
    __builtin_memcpy(y + i, &u, 4);
  }
}

// The pairwise tree of thc_math.h over the lanes of one chunk, widened to double.
LHC_TGT_INLINE double lanes_sum(const float* lane) {
  double d[kThcNormLanes];
  for (uint32_t t = 0; t < kThcNormLanes; ++t) d[t] = (double)lane[t];
  for (uint32_t s = kThcNormLanes >> 1; s > 0; s >>= 1)
    for (uint32_t i = 0; i < s; ++i) d[i] = d[i] + d[i + s];
  return d[0];
}

// A whole block of whole chunks in one pass: v = x + e (e may be null), the chunk partials of
// ||v||^2 (thc_chunk_sum_squares's lanes and tree) into partial[0, B / kThcNormChunk), and
// y = thc_flip_sign(v * s, m).
LHC_TGT_INLINE void block_input(const float* __restrict x, const float* __restrict e, float s,
                                const uint32_t* __restrict m, uint64_t B, float* __restrict y, double* partial) {
  for (uint64_t c = 0; c < B; c += kThcNormChunk) {
    float lane[kThcNormLanes];
    for (uint32_t t = 0; t < kThcNormLanes; ++t) lane[t] = 0.0f;
    for (uint64_t k = c; k < c + kThcNormChunk; k += kThcNormLanes)
      for (uint32_t t = 0; t < kThcNormLanes; ++t) {
        const uint64_t i = k + t;
        const float v = e ? x[i] + e[i] : x[i];
        lane[t] = __builtin_fmaf(v, v, lane[t]);
        const float r = v * s;
        uint32_t u;
        __builtin_memcpy(&u, &r, 4);
        u ^= m[i];
        __builtin_memcpy(y + i, &u, 4);
      }
    partial[c / kThcNormChunk] = lanes_sum(lane);
  }
}

// thc_chunk_sum_squares of thc_math.h (lanes of fmas, then the pairwise tree), on v[0, count).
LHC_TGT double chunk_sum_squares(const float* __restrict v, uint64_t count) {
  float lane[kThcNormLanes];
  for (uint32_t t = 0; t < kThcNormLanes; ++t) lane[t] = 0.0f;
  if (count == kThcNormChunk) {
    for (uint64_t k = 0; k < kThcNormChunk; k += kThcNormLanes)
      for (uint32_t t = 0; t < kThcNormLanes; ++t) lane[t] = __builtin_fmaf(v[k + t], v[k + t], lane[t]);
  } else {
    for (uint64_t i = 0; i < count; ++i) lane[i % kThcNormLanes] = __builtin_fmaf(v[i], v[i], lane[i % kThcNormLanes]);
  }
  return lanes_sum(lane);
}

// The largest IEEE exponent field among x[0, n) (0x7f800000: some x[i] is NaN or Inf).
LHC_TGT uint32_t max_exponent(const float* __restrict x, uint64_t n) {
  uint32_t acc = 0;
  for (uint64_t i = 0; i < n; ++i) {
    uint32_t u;
    __builtin_memcpy(&u, x + i, 4);
    u &= 0x7f800000u;
    acc = acc < u ? u : acc;
  }
  return acc;
}

// ---- stochastic rounding -------------------------------------------------------------------------
// Levels of coords [0, count) (global index start + i) as digits into q and, over y, the rank's own
// dequantized value thc_dequantize(level, da, db) (error feedback):
// thc_level of thc_math.h with the draw thc_uniform24(round_stream, start + i), the per-block halves
// of its key hoisted (blocks are aligned powers of two below 2^32, so start's high half is constant).
// `table` holds lo, width and inv_width padded to 32 entries (used when g <= 32).
LHC_TGT void quantize(const ThcRounding& R, const float (*table)[32], float da, float db, uint64_t round_stream,
                      uint64_t start, uint64_t count, float* __restrict y, uint32_t* __restrict q) {
  const uint32_t key_lo = (uint32_t)round_stream;
  const uint32_t key_hi = (uint32_t)(round_stream >> 32) ^ ((uint32_t)(start >> 32) * 0x9e3779b9u);
  const uint32_t first = (uint32_t)start;
  uint64_t i = 0;
  (void)table;
#if LHC_THC_PERMUTE
  // Tables of at most 32 entries: the three lookups are two-register permutes (vpermt2ps), not
  // element-by-element loads. The same operations as thc_level, lane by lane.
  if (R.kmax < 32) {
    vf16 tab[3][2];
    for (int t = 0; t < 3; ++t) {
      LHC_LOAD16(tab[t][0], table[t]);
      LHC_LOAD16(tab[t][1], table[t] + 16);
    }
    const vf16 T = R.threshold - vf16{}, negT = -R.threshold - vf16{}, sc = R.scale - vf16{};
    const vf16 to_level = R.to_level - vf16{}, gf = R.gf - vf16{}, zero = vf16{};
    const vi16 kmax = R.kmax - vi16{};
    const vu16 lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    for (; i + 16 <= count; i += 16) {
      const vu16 idx = (first + (uint32_t)i) + lane;
      vu16 h = idx ^ key_lo;
      h ^= h >> 16; h *= 0x85ebca6bu; h ^= h >> 13; h *= 0xc2b2ae35u; h ^= h >> 16;   // fmix32
      h += key_hi;
      h ^= h >> 16; h *= 0x85ebca6bu; h ^= h >> 13; h *= 0xc2b2ae35u; h ^= h >> 16;
      const vf16 draw = __builtin_convertvector((vi16)(h >> 8), vf16) * (1.0f / 16777216.0f);
      vf16 z;
      LHC_LOAD16(z, y + i);
      z *= sc;
      z = z < negT ? negT : z;
      z = T < z ? T : z;
      vf16 u = (z + T) * to_level;
      u = u >= zero ? u : zero;   // NaN -> 0, as thc_level
      u = gf < u ? gf : u;
      vi16 k = __builtin_convertvector(u, vi16);
      k = kmax < k ? kmax : k;
      const vf16 lo = __builtin_shuffle(tab[0][0], tab[0][1], k);
      const vf16 width = __builtin_shuffle(tab[1][0], tab[1][1], k);
      const vf16 inv_width = __builtin_shuffle(tab[2][0], tab[2][1], k);
      const vf16 p_up = (u - lo) * inv_width;
      const vf16 level = lo + (draw < p_up ? width : zero);
      vf16 own;
      for (int l = 0; l < 16; ++l) own[l] = __builtin_fmaf(level[l], da, db);
      LHC_STORE16(y + i, own);
      const vu16 digit = (vu16)__builtin_convertvector(level, vi16);
      __builtin_memcpy(q + i, &digit, sizeof digit);
    }
  }
#endif
  for (; i < count; ++i) {
    const uint32_t h = fmix32((first + (uint32_t)i) ^ key_lo);
    const float level = thc_level(R, y[i], thc_draw(fmix32(h + key_hi) >> 8));
    y[i] = thc_dequantize(level, da, db);
    q[i] = (uint32_t)(int32_t)level;
  }
}

// ---- digit packing, unpacking and the payload checksum: thc_cpu_isa_words.h -----------------------
#include "thc_cpu_isa_words.h"

// ---- one group of blocks (see thc_encode / thc_decode in thc_cpu.h) ------------------------------
// Encode group gi: per block, v = x + e, the norm's chunk partials (when chunks lie inside blocks),
// signs, forward transform, levels (and, with e, the own dequantized levels, their inverse transform
// and e <- v - RHT^{-1}(own)), all while the block is in L1; then the group's words.
LHC_TGT void encode_group(const ThcGroupArgs& A, uint64_t gi, ThcScratch& S) {
  const ThcLayout& L = *A.layout;
  const uint64_t B = L.block, GB = L.group_blocks, blocks = thc_group_size(L, gi);
  float* __restrict e = A.e;
  {
    // Prefetch the next group's x and e (the loads of this one then overlap its compute).
    const uint64_t next = (gi + 1) * GB * B, end = std::min<uint64_t>(L.numel, next + GB * B);
    for (uint64_t i = next; i < end; i += 16) {
      if (A.x) __builtin_prefetch(A.x + i, 0, 1);
      if (e) __builtin_prefetch(e + i, 1, 1);
    }
  }
  // The group's input: x's own blocks, or the interleave of src the caller made in S.xin.
  const float* xg = A.x ? A.x + gi * GB * B : S.xin;
  const uint64_t xstride = A.x ? B : S.xin_stride;
  for (uint64_t j = 0; j < blocks; ++j) {
    const uint64_t start = (gi * GB + j) * B;
    const uint64_t valid = start >= L.numel ? 0 : std::min<uint64_t>(B, L.numel - start);
    float* __restrict y = S.y + j * B;
    const float* __restrict xb = xg + j * xstride;
    float* __restrict eb = e ? e + start : nullptr;
    if (A.Q) sign_masks(A.sign_stream, start, B, S.m);
    if (A.Q && valid == B && A.chunks_in_blocks) {
      // The common case, fused: v = x + e, the norm's chunks, signs and scale in one pass.
      block_input(xb, eb, A.inv_sqrt, S.m, B, y, A.partial + start / kThcNormChunk);
    } else {
      if (eb) {
        for (uint64_t i = 0; i < valid; ++i) y[i] = xb[i] + eb[i];
      } else {
        for (uint64_t i = 0; i < valid; ++i) y[i] = xb[i];
      }
      for (uint64_t i = valid; i < B; ++i) y[i] = 0.0f;
      if (A.chunks_in_blocks)
        for (uint64_t off = 0; off < B; off += kThcNormChunk)
          A.partial[(start + off) / kThcNormChunk] =
              chunk_sum_squares(y + off, valid > off ? std::min<uint64_t>(kThcNormChunk, valid - off) : 0);
      if (!A.Q) {  // norm-only round: the whole of v stays owed
        if (eb) std::copy(y, y + valid, eb);
        continue;
      }
      scale_flip(y, A.inv_sqrt, S.m, valid, y);
    }
    fwht(y, B);
    quantize(A.R, A.table, A.Q->dequant_a, A.Q->dequant_b, A.round_stream, start, B, y, S.q + j * B);
    if (!eb || !valid) continue;
    // e <- (x + e) - RHT^{-1}(own dequantized levels), the block still in cache.
    fwht(y, B);
    for (uint64_t i = 0; i < valid; ++i) {
      const float r = y[i] * A.inv_sqrt;
      uint32_t u;
      __builtin_memcpy(&u, &r, 4);
      u ^= S.m[i];
      float own;
      __builtin_memcpy(&own, &u, 4);
      eb[i] = (xb[i] + eb[i]) - own;
    }
  }
  if (A.Q) {
    const uint64_t nw = thc_words_for(L, blocks * B), w0 = thc_group_first_word(L, gi);
    void* wp = thc_word_at(A.words, A.word_kind, w0);
    pack_block(S.q, blocks * B, L.per_word, L.base, A.fits_double, A.word_kind, nw, wp);
    // The words are still in cache; the float64 ones are valid integers by construction.
    A.check_partial[gi] = A.word_kind == kThcWordFloat64 ? check_words_f64(static_cast<const double*>(wp), nw, w0, A.check)
                                                         : check_words(wp, A.word_kind, nw, w0, 1.0, 0.0, A.check, S.d);
  }
}

// dst[0, n) = src[0, n) with non-temporal stores where the level has them (dst 64-byte aligned, n a
// multiple of 16): a decoded output is written once and read later by someone else, so its lines are
// neither read for ownership nor kept in cache. The caller fences (thc_decode, after its loop).
LHC_TGT_INLINE void stream_out(float* __restrict dst, const float* __restrict src, uint64_t n) {
#if LHC_THC_VW == 16 && defined(__x86_64__)
  if (((uintptr_t)dst & 63) == 0 && (n & 15) == 0) {
    for (uint64_t i = 0; i < n; i += 16) _mm512_stream_ps(dst + i, _mm512_loadu_ps(src + i));
    return;
  }
#elif LHC_THC_VW == 8 && defined(__x86_64__)
  if (((uintptr_t)dst & 31) == 0 && (n & 7) == 0) {
    for (uint64_t i = 0; i < n; i += 8) _mm256_stream_ps(dst + i, _mm256_loadu_ps(src + i));
    return;
  }
#endif
  std::memcpy(dst, src, 4 * n);
}

// Decode group gi: digits -> digit * a + b, then per block the inverse transform into out.
// Returns the group's invalid words.
LHC_TGT uint64_t decode_group(const ThcDecodeArgs& A, uint64_t gi, ThcScratch& S) {
  const ThcLayout& L = *A.layout;
  const uint64_t B = L.block, GB = L.group_blocks, blocks = thc_group_size(L, gi);
  const uint64_t nw = thc_words_for(L, blocks * B), w0 = thc_group_first_word(L, gi);
  const void* wp = thc_word_at(A.words, A.word_kind, w0);
  const uint64_t bad = unpack_block(wp, A.word_kind, nw, blocks * B, L.per_word, L.base, A.multiplier, A.tolerance,
                                    A.a, A.b, S.y, S.d);
  if (A.word_kind == kThcWordFloat64 && L.per_word <= 12) {
    // unpack_full_words_f64 left the full words' validated integers (invalid: 0) in S.d; the last,
    // partial word of the group is read again.
    const uint64_t full = blocks * B / L.per_word;
    const uint64_t head = check_words_f64(S.d, full, w0, A.check);
    const uint64_t tail = check_words(static_cast<const double*>(wp) + full, A.word_kind, nw - full, w0 + full,
                                      A.multiplier, A.tolerance, A.check, S.d + full);
    A.check_partial[gi] = (head + tail) % A.check.prime;
  } else {
    A.check_partial[gi] = check_words(wp, A.word_kind, nw, w0, A.multiplier, A.tolerance, A.check, S.d);
  }
  for (uint64_t j = 0; j < blocks; ++j) {
    const uint64_t start = (gi * GB + j) * B;
    if (start >= L.numel) break;  // padding-only blocks: checked above, not needed
    const uint64_t valid = std::min<uint64_t>(B, L.numel - start);
    float* y = S.y + j * B;
    fwht(y, B);
    sign_masks(A.sign_stream, start, B, S.m);
    if (!A.out) {
      scale_flip(y, A.inv_sqrt, S.m, valid, S.xin + j * S.xin_stride);  // the caller writes the columns out
      continue;
    }
    scale_flip(y, A.inv_sqrt, S.m, valid, y);
    stream_out(A.out + start, y, valid);
  }
  return bad;
}

// ---- Transposition (the training interleave: thc_interleave, thc_deinterleave) ----------------------
// dst[c * dst_ld + r] = src[r * src_ld + c] for r < rows, c < cols. Blocks of 8 x 8 go through eight
// 8-float vectors: the unpack, shuffle and 128-bit-half steps of the classic AVX transpose, written as
// two-source shuffles that each map to one instruction with AVX; the edges go one float at a time. A
// copy: every ISA moves the same bits.
typedef float vf8 __attribute__((vector_size(32)));
typedef int32_t vi8 __attribute__((vector_size(32)));

LHC_TGT_INLINE void transpose8(const float* src, uint64_t src_ld, float* dst, uint64_t dst_ld) {
  const vi8 lo = {0, 8, 1, 9, 4, 12, 5, 13}, hi = {2, 10, 3, 11, 6, 14, 7, 15};   // unpack{lo,hi}
  const vi8 even = {0, 1, 8, 9, 4, 5, 12, 13}, odd = {2, 3, 10, 11, 6, 7, 14, 15};  // shuffle 0x44, 0xee
  const vi8 first = {0, 1, 2, 3, 8, 9, 10, 11}, second = {4, 5, 6, 7, 12, 13, 14, 15};  // 128-bit halves
  vf8 r[8], t[8], u[8];
  for (int i = 0; i < 8; ++i) __builtin_memcpy(&r[i], src + i * src_ld, sizeof(vf8));
  for (int i = 0; i < 8; i += 2) {
    t[i] = __builtin_shuffle(r[i], r[i + 1], lo);
    t[i + 1] = __builtin_shuffle(r[i], r[i + 1], hi);
  }
  for (int i = 0; i < 8; i += 4)
    for (int k = 0; k < 2; ++k) {
      u[i + 2 * k] = __builtin_shuffle(t[i + k], t[i + k + 2], even);
      u[i + 2 * k + 1] = __builtin_shuffle(t[i + k], t[i + k + 2], odd);
    }
  for (int i = 0; i < 4; ++i) {
    const vf8 a = __builtin_shuffle(u[i], u[i + 4], first), b = __builtin_shuffle(u[i], u[i + 4], second);
    __builtin_memcpy(dst + i * dst_ld, &a, sizeof(vf8));
    __builtin_memcpy(dst + (i + 4) * dst_ld, &b, sizeof(vf8));
  }
}

LHC_TGT void transpose(const float* src, uint64_t rows, uint64_t cols, uint64_t src_ld, float* dst, uint64_t dst_ld) {
  uint64_t c = 0;
  for (; c + 8 <= cols; c += 8) {
    uint64_t r = 0;
    for (; r + 8 <= rows; r += 8) transpose8(src + r * src_ld + c, src_ld, dst + c * dst_ld + r, dst_ld);
    for (; r < rows; ++r)
      for (uint64_t k = c; k < c + 8; ++k) dst[k * dst_ld + r] = src[r * src_ld + k];
  }
  for (; c < cols; ++c)
    for (uint64_t r = 0; r < rows; ++r) dst[c * dst_ld + r] = src[r * src_ld + c];
}

constexpr ThcKernels kKernels = {LHC_THC_ISA_NAME, fwht, chunk_sum_squares, max_exponent, pack_block, unpack_block,
                                 encode_group, decode_group, transpose};

#undef LHC_TGT
#undef LHC_TGT_INLINE
#undef LHC_LOAD16
#undef LHC_STORE16
#undef LHC_LOADW
#undef LHC_STOREW
}  // namespace LHC_THC_ISA
