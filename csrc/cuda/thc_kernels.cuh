// thc_kernels.cuh -- CUDA kernels of the THC codec (lossless_hc/thc/codec.py, device="cuda").
//
// Device code only, like codec_kernels.cuh: compiled by nvcc into lossless_hc._C_cuda (codec_cuda.cu
// holds the kernel table), by NVRTC on the CuPy path, and by the host compiler against
// tests/cuda_emulation/cuda_emulation.h in tests/test_cuda_thc_emulated.py. The launch sequence
// lives in lossless_hc/backends/cuda_thc.py. Every parameter is 8 bytes (a pointer, a uint64_t or a double
// whose float value is what the CPU backend receives as a float).
//
// Agreement with the CPU backend (csrc/cpu/thc_cpu.cpp): every per-coordinate operation comes from
// csrc/thc_math.h, the signs and draws from csrc/lhc_layout.h, the squared norm runs in the same fixed
// chunk + tree order, and the Walsh-Hadamard butterflies run stage by stage (h = 1, 2, 4, ...) with
// the same additions, so payload words, the norm slot, the error memory and the decoded output are
// the same bits as the CPU's for the same inputs and streams.
//
// Two paths, chosen by the Hadamard block B (the layout's `block`):
//  * B <= kThcTile (the default 1024): a CUDA block per tile of kThcTile coordinates (kThcTile / B
//    Hadamard blocks side by side), in shared memory: thc_encode_blocks (x + e, norm partials, signs,
//    FWHT, levels, dequantization, inverse FWHT, error feedback) and thc_decode_blocks (digits of the
//    blocks' words, FWHT, signs, output).
//  * B > kThcTile (hadamard_block up to 2^20): the transform in passes over a padded float scratch y:
//    thc_rht_tiles / thc_fwht_tiles (stages h < kThcTile, one tile per CUDA block in shared memory),
//    thc_fwht_columns (stages h >= kThcTile: columns of the block seen as a (B / kThcTile) x kThcTile
//    matrix), and the elementwise thc_quantize_coords, thc_feedback_coords, thc_unpack_words,
//    thc_rht_output.
// Shared by both: thc_check_finite, thc_norm_chunks, thc_pack_words, thc_tree_pass,
// thc_encode_finish, thc_accumulate.
#pragma once

#include "../lhc_layout.h"
#include "../thc_math.h"
#include "warp_sum.cuh"

namespace lhc {
namespace gpu {

// Device state of one encode or decode (zeroed by the host first; read back by the host after decode).
struct ThcState {
  unsigned int non_finite;       // encode: 1 if x held NaN/Inf (then no kernel touches e or the words)
  unsigned int pad;
  double sum_squares;            // encode: ||x + e||^2 (the last thc_tree_pass writes it)
  unsigned long long bad_words;  // decode: words that are not valid aggregates
  unsigned long long checksum;   // encode and decode: sum of the words' thc_check_term (each < 2^25)
};

// Payload header fields written on the device (lossless_hc/thc/layout.py): the non-finite flag and the
// checksum; fields 0 and 1 are the host's.
constexpr uint64_t kThcHdrNonFinite = 2;
constexpr uint64_t kThcHdrChecksum = 3;
static_assert(sizeof(ThcState) == 32, "ThcState: 32 bytes (lossless_hc/backends/cuda_thc.py STATE_BYTES)");

constexpr unsigned int kThcThreads = 256;  // block size of every THC kernel (kThcNormLanes lanes)
constexpr uint64_t kThcTile = 4096;        // Hadamard blocks up to this size are done in shared memory
static_assert(kThcThreads == kThcNormLanes, "one thread per norm lane");

// The layout words (lhc_layout.h ThcLayoutWord), as every backend reads them.
__device__ __forceinline__ ThcLayout thc_load_layout(const uint64_t* w) { return thc_layout_from_words(w); }

__device__ __forceinline__ uint64_t thc_min(uint64_t a, uint64_t b) { return a < b ? a : b; }
__device__ __forceinline__ uint64_t thc_valid(const ThcLayout& L, uint64_t start, uint64_t count) {
  return start >= L.numel ? 0 : thc_min(count, L.numel - start);
}
__device__ __forceinline__ bool thc_is_finite(float v) { return fabsf(v) <= 3.402823466e38f; }
__device__ __forceinline__ bool thc_is_finite(double v) { return fabs(v) <= 1.7976931348623157e308; }
__device__ __forceinline__ double thc_dmul(double a, double b) {
#if defined(__CUDA_ARCH__)
  return __dmul_rn(a, b);  // never fused into a following subtraction
#else
  return a * b;
#endif
}

// In-place unnormalised Walsh-Hadamard transforms of the blocks of `block` floats in y[0, n) in shared
// memory (block a power of two dividing n; block == n: one transform), the CPU's stages in the CPU's
// order: for h = 1, 2, ..., block/2, (y[i], y[i + h]) <- (y[i] + y[i + h], y[i] - y[i + h]). A stage's
// pairs never leave their block (h < block), so the blocks of y are transformed side by side, each
// exactly as alone. The caller synchronises before (y written by other threads); this returns
// synchronised.
__device__ __forceinline__ void thc_fwht_shared(float* y, uint32_t n, uint32_t block) {
  for (uint32_t h = 1; h < block; h <<= 1) {
    for (uint32_t p = threadIdx.x; p < n / 2; p += blockDim.x) {
      const uint32_t i = ((p & ~(h - 1)) << 1) | (p & (h - 1));
      const float u = y[i], v = y[i + h];
      y[i] = thc_add(u, v);
      y[i + h] = thc_sub(u, v);
    }
    __syncthreads();
  }
}

// d[0, n) (n a power of two, shared): the tree of thc_tree_pow2; with `rows`, on rows d[r * n, r * n + n)
// at once (each row's additions as alone). Synchronised before and after.
__device__ __forceinline__ void thc_tree_shared(double* d, uint32_t n, uint32_t rows = 1) {
  uint32_t shift = 0;  // log2(n / 2)
  while ((2u << shift) < n) ++shift;
  for (uint32_t s = n >> 1; s > 0; s >>= 1, --shift) {
    for (uint32_t q = threadIdx.x; q < rows * s; q += blockDim.x) {
      const uint32_t r = q >> shift, i = q & (s - 1);
      d[r * n + i] = thc_dadd(d[r * n + i], d[r * n + i + s]);
    }
    __syncthreads();
  }
}

__device__ __forceinline__ void thc_store_level(void* levels, uint64_t level_bytes, uint64_t i, float level) {
  if (level_bytes == 1)
    static_cast<unsigned char*>(levels)[i] = (unsigned char)(int32_t)level;
  else
    static_cast<uint32_t*>(levels)[i] = (uint32_t)(int32_t)level;
}
__device__ __forceinline__ uint64_t thc_load_level(const void* levels, uint64_t level_bytes, uint64_t i) {
  return level_bytes == 1 ? (uint64_t) static_cast<const unsigned char*>(levels)[i]
                          : (uint64_t) static_cast<const uint32_t*>(levels)[i];
}

__device__ __forceinline__ ThcRounding thc_load_rounding(const float* table, uint32_t g, double scale,
                                                         double threshold) {
  // table: lo[g], width[g], inv_width[g] (float32), as lossless_hc/thc/codec.py builds them.
  return thc_rounding(table, table + g, table + 2 * g, (float)scale, (float)threshold, g);
}

// An aggregated word -> its validity and value. Float64 words: word * multiplier must be within
// `tolerance` of an integer in [0, base^have - 1]; int64 words: in that range. Invalid words read as 0.
struct ThcWord {
  bool ok;
  double f;     // float64 kind: the integer value, exact (< 2^53)
  uint64_t u;   // int64 kind
};
__device__ __forceinline__ ThcWord thc_read_word(const void* words, uint64_t word_kind, uint64_t w, double multiplier,
                                                 double tolerance, uint64_t base, uint32_t have) {
  ThcWord r;
  const uint64_t limit = thc_pow(base, have) - 1;
  if (word_kind == 0) {
    const double t = thc_dmul(static_cast<const double*>(words)[w], multiplier);
    const double s = rint(t);
    r.ok = (fabs(t - s) <= tolerance) && (s >= 0.0) && (s <= (double)limit);
    r.f = r.ok ? s : 0.0;
    r.u = 0;
  } else {
    const long long v = static_cast<const long long*>(words)[w];
    r.ok = v >= 0 && (uint64_t)v <= limit;
    r.u = r.ok ? (uint64_t)v : 0;
    r.f = 0.0;
  }
  return r;
}

// Digit j (0 = least significant) of every digit of a word, in order, through `emit(j, digit)`.
template <typename Emit>
__device__ __forceinline__ void thc_word_digits(const ThcWord& wd, uint64_t word_kind, uint64_t base, uint32_t have,
                                                Emit emit) {
  if (word_kind == 0) {
    // Exact in doubles: s < 2^53 and quot * base <= s + base < 2^53; one correction of the estimate.
    const double base_d = (double)base, inv_base = 1.0 / base_d;
    double s = wd.f;
    for (uint32_t j = 0; j < have; ++j) {
      double quot = floor(s * inv_base);
      double digit = s - quot * base_d;
      quot = digit < 0 ? quot - 1 : (digit >= base_d ? quot + 1 : quot);
      digit = s - quot * base_d;
      s = quot;
      emit(j, digit);
    }
  } else {
    uint64_t s = wd.u;
    for (uint32_t j = 0; j < have; ++j) {
      emit(j, (double)(s % base));
      s /= base;
    }
  }
}

// ------------------------------------------------------------------------------------------------
// shared by both paths
// ------------------------------------------------------------------------------------------------

// state->non_finite |= 1 if any x[0, n) is NaN or Inf.
extern "C" __global__ void thc_check_finite(const float* x, uint64_t n, ThcState* state) {
  bool bad = false;
  for (uint64_t i = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (uint64_t)gridDim.x * blockDim.x)
    bad |= !thc_is_finite(x[i]);
  if (bad) atomicOr(&state->non_finite, 1u);
}

// partials[c] = the squared norm of chunk c of x + e (e may be null), the order of thc_chunk_sum_squares.
extern "C" __global__ void thc_norm_chunks(const uint64_t* lay, const float* x, const float* e, double* partials,
                                           ThcState* state) {
  if (state->non_finite) return;
  const ThcLayout L = thc_load_layout(lay);
  const uint64_t nchunks = (L.padded + kThcNormChunk - 1) / kThcNormChunk;
  __shared__ double red[kThcNormLanes];
  const uint32_t t = threadIdx.x;
  for (uint64_t c = blockIdx.x; c < nchunks; c += gridDim.x) {
    const uint64_t start = c * kThcNormChunk, count = thc_valid(L, start, kThcNormChunk);
    float acc = 0.0f;
    for (uint64_t i = t; i < count; i += kThcNormLanes) {
      const float v = e ? thc_add(x[start + i], e[start + i]) : x[start + i];
      acc = thc_fmaf(v, v, acc);
    }
    red[t] = (double)acc;
    __syncthreads();
    thc_tree_shared(red, kThcNormLanes);
    if (t == 0) partials[c] = red[0];
    __syncthreads();
  }
}

// One level of the tree of thc_tree_sum: out[g] = the 1024-wide tree of in[1024 g, 1024 g + 1024)
// (zero-padded past n).
extern "C" __global__ void thc_tree_pass(const double* in, uint64_t n, double* out) {
  __shared__ double d[kThcTreeWidth];
  const uint64_t groups = (n + kThcTreeWidth - 1) / kThcTreeWidth;
  for (uint64_t g = blockIdx.x; g < groups; g += gridDim.x) {
    for (uint32_t i = threadIdx.x; i < kThcTreeWidth; i += blockDim.x) {
      const uint64_t j = g * kThcTreeWidth + i;
      d[i] = j < n ? in[j] : 0.0;
    }
    __syncthreads();
    thc_tree_shared(d, kThcTreeWidth);
    if (threadIdx.x == 0) out[g] = d[0];
    __syncthreads();
  }
}

// Levels (one per padded coordinate) -> the layout's words: digit c % per_word of word
// thc_group_first_word(group) + c / per_word is the level of the group's coordinate c.
// Adds every word's checksum term (thc_check_term with (check_prime, check_c0, check_k)) to state->checksum.
extern "C" __global__ void thc_pack_words(const uint64_t* lay, const void* levels, uint64_t level_bytes,
                                          uint64_t word_kind, void* words, uint64_t check_prime, uint64_t check_c0,
                                          uint64_t check_k, ThcState* state) {
  if (state->non_finite) return;
  const ThcLayout L = thc_load_layout(lay);
  const ThcCheck C{check_prime, check_c0, check_k};
  const uint64_t coords = (uint64_t)L.group_blocks * L.block, per_group = thc_words_for(L, coords);
  unsigned long long chk = 0;
  for (uint64_t w = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x; w < L.words;
       w += (uint64_t)gridDim.x * blockDim.x) {
    const uint64_t group = w / per_group, first = (w - group * per_group) * L.per_word;
    const uint64_t count = thc_group_size(L, group) * L.block;
    const uint32_t have = (uint32_t)thc_min(L.per_word, count - first);
    const uint64_t c0 = group * coords + first;
    uint64_t acc = 0;
    for (uint32_t j = have; j-- > 0;) acc = acc * L.base + thc_load_level(levels, level_bytes, c0 + j);
    if (word_kind == 0)
      static_cast<double*>(words)[w] = (double)acc;  // exact: acc < 2^53 by the layout rule
    else
      static_cast<long long*>(words)[w] = (long long)acc;
    chk += thc_check_term(C, w, acc);
  }
  warp_add_u64(&state->checksum, chk);   // integers: the order of the additions does not matter
}

// The end of an encode: the norm slot, its negation in the mirror slot and the checksum field (the
// sum of thc_pack_words's terms mod P), or (x non-finite, or ||x + e||^2 overflowed) the non-finite
// header flag with every word after it zeroed, and e zeroed -- what lossless_hc/backends/cpu.py does
// with the CPU backend's ThcEncodeStats.
extern "C" __global__ void thc_encode_finish(void* payload, uint64_t payload_numel, uint64_t norm_slot,
                                             uint64_t mirror_slot, uint64_t check_prime, uint64_t word_kind, float* e,
                                             uint64_t numel, ThcState* state) {
  unsigned int flag = state->non_finite;
  const double total = state->sum_squares;
  if (!flag && !thc_is_finite(total)) flag = 2;
  const uint64_t tid = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x, stride = (uint64_t)gridDim.x * blockDim.x;
  if (!flag) {
    if (tid == 0) {
      const double norm = sqrt(total);
      static_cast<double*>(payload)[norm_slot] = norm;     // int64 payload: the float64 bits
      static_cast<double*>(payload)[mirror_slot] = -norm;
      const unsigned long long chk = state->checksum % check_prime;
      if (word_kind == 0)
        static_cast<double*>(payload)[kThcHdrChecksum] = (double)chk;
      else
        static_cast<long long*>(payload)[kThcHdrChecksum] = (long long)chk;
    }
    return;
  }
  for (uint64_t i = kThcHdrNonFinite + 1 + tid; i < payload_numel; i += stride)
    static_cast<unsigned long long*>(payload)[i] = 0;
  if (tid == 0) {
    if (word_kind == 0)
      static_cast<double*>(payload)[kThcHdrNonFinite] = 1.0;
    else
      static_cast<long long*>(payload)[kThcHdrNonFinite] = 1;
  }
  // e is reset in both cases, as on the CPU (whose single pass has already overwritten it when x is
  // non-finite; here thc_check_finite kept the other kernels from running, but the result is the same).
  if (e)
    for (uint64_t i = tid; i < numel; i += stride) e[i] = 0.0f;
}

// The norm-only round of the transform-in-passes path: e <- x + e.
extern "C" __global__ void thc_accumulate(const float* x, float* e, uint64_t numel, ThcState* state) {
  if (state->non_finite) return;
  for (uint64_t i = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x; i < numel; i += (uint64_t)gridDim.x * blockDim.x)
    e[i] = thc_add(x[i], e[i]);
}

// ------------------------------------------------------------------------------------------------
// B <= kThcTile: one CUDA block per Hadamard block
// ------------------------------------------------------------------------------------------------

// The in-shared path works on tiles of kThcTile coordinates: kThcTile / B consecutive Hadamard blocks,
// each transformed exactly as alone (thc_fwht_shared's blocks), so that a tile's barriers are shared
// by several small blocks (with one block of 1024 per iteration, 256 threads held 4 values each between
// some 30 barriers, and the kernel was bound by them). Tile ti: coordinates [ti * kThcTile, ...) up to
// `padded`.
__device__ __forceinline__ uint64_t thc_tiles(const ThcLayout& L) { return (L.padded + kThcTile - 1) / kThcTile; }

// Encode of every Hadamard block: v = x + e (e may be null); with partials non-null (B >= 1024) the
// norm partials of the block's chunks; quantize == 0 (the norm-only round): e <- v; else y = H(s v)
// / sqrt(B), levels (level_bytes 1 or 4 per padded coordinate) and, with e,
// e <- v - s H(dequantized levels) / sqrt(B). Launched with kThcThreads (= kThcNormLanes) threads.
extern "C" __global__ void thc_encode_blocks(const uint64_t* lay, const float* x, float* e, const float* table,
                                             double scale, double threshold, double dequant_a, double dequant_b,
                                             uint64_t sign_stream, uint64_t round_stream, uint64_t quantize,
                                             void* levels, uint64_t level_bytes, double* partials, ThcState* state) {
  if (state->non_finite) return;
  const ThcLayout L = thc_load_layout(lay);
  const uint32_t B = (uint32_t)L.block;
  constexpr uint32_t kChunks = (uint32_t)(kThcTile / kThcNormChunk);
  __shared__ float y[kThcTile];
  __shared__ double red[kChunks * kThcNormLanes];
  const float inv_sqrt = thc_inv_sqrt_block(B);
  const ThcRounding R = thc_load_rounding(table, L.granularity, scale, threshold);
  const float da = (float)dequant_a, db = (float)dequant_b;
  const uint32_t t = threadIdx.x, nt = blockDim.x;
  for (uint64_t ti = blockIdx.x; ti < thc_tiles(L); ti += gridDim.x) {
    const uint64_t start = ti * kThcTile, valid = thc_valid(L, start, kThcTile);
    const uint32_t len = (uint32_t)thc_min(kThcTile, L.padded - start);  // whole blocks
    for (uint32_t i = t; i < len; i += nt)
      y[i] = i < valid ? (e ? thc_add(x[start + i], e[start + i]) : x[start + i]) : 0.0f;
    __syncthreads();
    if (partials && B >= kThcNormChunk) {
      const uint32_t chunks = len / (uint32_t)kThcNormChunk;
      for (uint32_t k = 0; k < chunks; ++k) {
        const uint64_t off = (uint64_t)k * kThcNormChunk;
        red[k * kThcNormLanes + t] = (double)thc_norm_lane(y + off, valid > off ? thc_min(kThcNormChunk, valid - off) : 0, t);
      }
      __syncthreads();
      thc_tree_shared(red, kThcNormLanes, chunks);
      if (t < chunks) partials[start / kThcNormChunk + t] = red[t * kThcNormLanes];
      __syncthreads();
    }
    if (!quantize) {
      if (e)
        for (uint32_t i = t; i < valid; i += nt) e[start + i] = y[i];
      __syncthreads();
      continue;
    }
    for (uint32_t i = t; i < len; i += nt)
      y[i] = i < valid ? thc_flip_sign(thc_mul(y[i], inv_sqrt), thc_sign_bit(sign_stream, start + i)) : 0.0f;
    __syncthreads();
    thc_fwht_shared(y, len, B);
    for (uint32_t i = t; i < len; i += nt) {
      const float level = thc_level(R, y[i], thc_draw(thc_uniform24(round_stream, start + i)));
      thc_store_level(levels, level_bytes, start + i, level);
      if (e) y[i] = thc_dequantize(level, da, db);
    }
    if (e) {
      __syncthreads();
      thc_fwht_shared(y, len, B);
      for (uint32_t i = t; i < valid; i += nt)
        e[start + i] = thc_sub(thc_add(x[start + i], e[start + i]),
                               thc_flip_sign(thc_mul(y[i], inv_sqrt), thc_sign_bit(sign_stream, start + i)));
    }
    __syncthreads();
  }
}

// Decode of every Hadamard block: the digits of the words overlapping the block (a word may straddle
// two blocks of a group; each block reads its own digits, and the block holding a word's first digit
// checks it) -> digit * a + b -> FWHT -> signs / sqrt(B) -> out[0, numel). A tile's blocks read their
// words as one list of (block, word) items.
extern "C" __global__ void thc_decode_blocks(const uint64_t* lay, const void* words, uint64_t word_kind,
                                             double multiplier, double a, double b, uint64_t sign_stream, float* out,
                                             uint64_t check_prime, uint64_t check_c0, uint64_t check_k,
                                             ThcState* state) {
  const ThcLayout L = thc_load_layout(lay);
  const ThcCheck C{check_prime, check_c0, check_k};
  const uint64_t B = L.block, GB = L.group_blocks, pw = L.per_word, base = L.base;
  const uint64_t per_group = thc_words_for(L, GB * B);
  const double tolerance = multiplier == 1.0 ? 0.0 : 0.5;
  const float inv_sqrt = thc_inv_sqrt_block(B);
  __shared__ float y[kThcTile];
  const uint32_t t = threadIdx.x, nt = blockDim.x;
  unsigned long long bad = 0, chk = 0;
  for (uint64_t ti = blockIdx.x; ti < thc_tiles(L); ti += gridDim.x) {
    const uint64_t start = ti * kThcTile, first_block = start / B;
    const uint32_t len = (uint32_t)thc_min(kThcTile, L.padded - start), nb = (uint32_t)(len / B);
    // Block j of the tile (bi = first_block + j) overlaps words w0(j) .. w1(j) of its group: the tile's
    // items are those runs one after another; item k -> its block by walking the runs (a thread's
    // items increase, so the walk only moves forward).
    const auto run_words = [&](uint32_t jj) {  // words overlapping block jj's coordinates in its group
      const uint64_t cstart = (first_block + jj) % GB * B;
      return (cstart + B - 1) / pw - cstart / pw + 1;
    };
    uint32_t j = 0;
    uint64_t run_begin = 0, run_end = run_words(0);
    for (uint64_t k = t;; k += nt) {
      while (k >= run_end && ++j < nb) {
        run_begin = run_end;
        run_end += run_words(j);
      }
      if (j >= nb) break;
      const uint64_t bi = first_block + j, group = bi / GB, count = thc_group_size(L, group) * B;
      const uint64_t cstart = (bi - group * GB) * B, cend = cstart + B, first_word = group * per_group;
      const uint64_t w = cstart / pw + (k - run_begin), first = w * pw;
      const uint32_t have = (uint32_t)thc_min(pw, count - first);
      const ThcWord wd = thc_read_word(words, word_kind, first_word + w, multiplier, tolerance, base, have);
      if (first >= cstart) {   // the word's own block: counted and checksummed once
        bad += !wd.ok;
        chk += thc_check_term(C, first_word + w, word_kind == 0 ? (uint64_t)wd.f : wd.u);
      }
      float* yb = y + (uint64_t)j * B;
      thc_word_digits(wd, word_kind, base, have, [&](uint32_t d, double digit) {
        const uint64_t c = first + d;
        if (c >= cstart && c < cend) yb[c - cstart] = thc_digit_value(digit, a, b);
      });
    }
    __syncthreads();
    thc_fwht_shared(y, len, (uint32_t)B);
    const uint64_t valid = thc_valid(L, start, len);
    for (uint32_t i = t; i < valid; i += nt)
      out[start + i] = thc_flip_sign(thc_mul(y[i], inv_sqrt), thc_sign_bit(sign_stream, start + i));
    __syncthreads();
  }
  warp_add_u64(&state->bad_words, bad);   // every thread leaves the loop above
  warp_add_u64(&state->checksum, chk);
}

// ------------------------------------------------------------------------------------------------
// B > kThcTile: the transform in passes over y (padded floats)
// ------------------------------------------------------------------------------------------------

// y = s (x + e) / sqrt(B) (0 past numel), then the stages h < kThcTile of every tile.
extern "C" __global__ void thc_rht_tiles(const uint64_t* lay, const float* x, const float* e, uint64_t sign_stream,
                                         float* y, ThcState* state) {
  if (state->non_finite) return;
  const ThcLayout L = thc_load_layout(lay);
  const float inv_sqrt = thc_inv_sqrt_block(L.block);
  __shared__ float s[kThcTile];
  for (uint64_t tile = blockIdx.x; tile < L.padded / kThcTile; tile += gridDim.x) {
    const uint64_t start = tile * kThcTile, valid = thc_valid(L, start, kThcTile);
    for (uint32_t i = threadIdx.x; i < kThcTile; i += blockDim.x) {
      float v = 0.0f;
      if (i < valid) {
        v = e ? thc_add(x[start + i], e[start + i]) : x[start + i];
        v = thc_flip_sign(thc_mul(v, inv_sqrt), thc_sign_bit(sign_stream, start + i));
      }
      s[i] = v;
    }
    __syncthreads();
    thc_fwht_shared(s, (uint32_t)kThcTile, (uint32_t)kThcTile);
    for (uint32_t i = threadIdx.x; i < kThcTile; i += blockDim.x) y[start + i] = s[i];
    __syncthreads();
  }
}

// The stages h < kThcTile of every tile of y[0, padded).
extern "C" __global__ void thc_fwht_tiles(float* y, uint64_t padded) {
  __shared__ float s[kThcTile];
  for (uint64_t tile = blockIdx.x; tile < padded / kThcTile; tile += gridDim.x) {
    float* p = y + tile * kThcTile;
    for (uint32_t i = threadIdx.x; i < kThcTile; i += blockDim.x) s[i] = p[i];
    __syncthreads();
    thc_fwht_shared(s, (uint32_t)kThcTile, (uint32_t)kThcTile);
    for (uint32_t i = threadIdx.x; i < kThcTile; i += blockDim.x) p[i] = s[i];
    __syncthreads();
  }
}

// The stages h = kThcTile, ..., B/2 of every Hadamard block: the block as R = B / kThcTile rows of
// kThcTile; those stages are an R-point transform of every column. A CUDA block takes W = kThcTile / R
// adjacent columns (R x W floats in shared memory; rows read as runs of W).
extern "C" __global__ void thc_fwht_columns(const uint64_t* lay, float* y) {
  const ThcLayout L = thc_load_layout(lay);
  const uint32_t R = (uint32_t)(L.block / kThcTile), W = (uint32_t)(kThcTile / R);
  const uint64_t items = L.padded / kThcTile;  // (blocks) x (kThcTile / W column strips)
  __shared__ float s[kThcTile];
  for (uint64_t it = blockIdx.x; it < items; it += gridDim.x) {
    const uint64_t block = it / R, strip = it - block * R;
    float* p = y + block * L.block + strip * W;
    for (uint32_t i = threadIdx.x; i < R * W; i += blockDim.x) s[i] = p[(uint64_t)(i / W) * kThcTile + i % W];
    __syncthreads();
    for (uint32_t h = 1; h < R; h <<= 1) {
      for (uint32_t q = threadIdx.x; q < (R / 2) * W; q += blockDim.x) {
        const uint32_t col = q % W, pr = q / W;
        const uint32_t r = ((pr & ~(h - 1)) << 1) | (pr & (h - 1));
        const float u = s[r * W + col], v = s[(r + h) * W + col];
        s[r * W + col] = thc_add(u, v);
        s[(r + h) * W + col] = thc_sub(u, v);
      }
      __syncthreads();
    }
    for (uint32_t i = threadIdx.x; i < R * W; i += blockDim.x) p[(uint64_t)(i / W) * kThcTile + i % W] = s[i];
    __syncthreads();
  }
}

// Levels of every padded coordinate of y; with writeback, y <- the dequantized levels.
extern "C" __global__ void thc_quantize_coords(const uint64_t* lay, float* y, const float* table, double scale,
                                               double threshold, double dequant_a, double dequant_b,
                                               uint64_t round_stream, void* levels, uint64_t level_bytes,
                                               uint64_t writeback, ThcState* state) {
  if (state->non_finite) return;
  const ThcLayout L = thc_load_layout(lay);
  const ThcRounding R = thc_load_rounding(table, L.granularity, scale, threshold);
  const float da = (float)dequant_a, db = (float)dequant_b;
  for (uint64_t i = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x; i < L.padded;
       i += (uint64_t)gridDim.x * blockDim.x) {
    const float level = thc_level(R, y[i], thc_draw(thc_uniform24(round_stream, i)));
    thc_store_level(levels, level_bytes, i, level);
    if (writeback) y[i] = thc_dequantize(level, da, db);
  }
}

// e <- (x + e) - s y / sqrt(B) on the numel coordinates (y: the transformed dequantized levels).
extern "C" __global__ void thc_feedback_coords(const uint64_t* lay, const float* x, float* e, const float* y,
                                               uint64_t sign_stream, ThcState* state) {
  if (state->non_finite) return;
  const ThcLayout L = thc_load_layout(lay);
  const float inv_sqrt = thc_inv_sqrt_block(L.block);
  for (uint64_t i = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x; i < L.numel;
       i += (uint64_t)gridDim.x * blockDim.x)
    e[i] = thc_sub(thc_add(x[i], e[i]), thc_flip_sign(thc_mul(y[i], inv_sqrt), thc_sign_bit(sign_stream, i)));
}

// Every word -> validity (counted) and digit * a + b into y at its coordinates.
extern "C" __global__ void thc_unpack_words(const uint64_t* lay, const void* words, uint64_t word_kind,
                                            double multiplier, double a, double b, float* y, uint64_t check_prime,
                                            uint64_t check_c0, uint64_t check_k, ThcState* state) {
  const ThcLayout L = thc_load_layout(lay);
  const ThcCheck C{check_prime, check_c0, check_k};
  const uint64_t coords = (uint64_t)L.group_blocks * L.block, per_group = thc_words_for(L, coords);
  const double tolerance = multiplier == 1.0 ? 0.0 : 0.5;
  unsigned long long bad = 0, chk = 0;
  for (uint64_t w = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x; w < L.words;
       w += (uint64_t)gridDim.x * blockDim.x) {
    const uint64_t group = w / per_group, first = (w - group * per_group) * L.per_word;
    const uint32_t have = (uint32_t)thc_min(L.per_word, thc_group_size(L, group) * L.block - first);
    const ThcWord wd = thc_read_word(words, word_kind, w, multiplier, tolerance, L.base, have);
    bad += !wd.ok;
    chk += thc_check_term(C, w, word_kind == 0 ? (uint64_t)wd.f : wd.u);
    float* p = y + group * coords + first;
    thc_word_digits(wd, word_kind, L.base, have, [&](uint32_t j, double digit) { p[j] = thc_digit_value(digit, a, b); });
  }
  warp_add_u64(&state->bad_words, bad);   // every thread leaves the loop above
  warp_add_u64(&state->checksum, chk);
}

// out[0, numel) = s y / sqrt(B).
extern "C" __global__ void thc_rht_output(const uint64_t* lay, const float* y, uint64_t sign_stream, float* out) {
  const ThcLayout L = thc_load_layout(lay);
  const float inv_sqrt = thc_inv_sqrt_block(L.block);
  for (uint64_t i = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x; i < L.numel;
       i += (uint64_t)gridDim.x * blockDim.x)
    out[i] = thc_flip_sign(thc_mul(y[i], inv_sqrt), thc_sign_bit(sign_stream, i));
}

}  // namespace gpu
}  // namespace lhc
