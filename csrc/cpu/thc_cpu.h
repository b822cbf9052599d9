// CPU (OpenMP) kernels of the THC codec: randomized Hadamard transform, stochastic rounding onto an
// integer table with digit packing, unpacking with exactness checks. Raw pointers and sizes only.
//
// Every kernel is deterministic: parallel loops write disjoint outputs, and the one reduction (the
// squared norm) runs in the fixed order of thc_math.h, so results do not depend on thread count. The
// per-coordinate arithmetic (levels, dequantization, digits, norm) is thc_math.h's, shared with the
// CUDA kernels (csrc/cuda/thc_kernels.cuh), which therefore produce the same payload bits.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "../lhc_layout.h"
#include "../thc_math.h"

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
  float dequant_a;      // own dequantized value = level * dequant_a + dequant_b (error feedback)
  float dequant_b;
};

struct ThcEncodeStats {
  double sum_squares = 0;  // ||x + e||^2 over the numel input coordinates
  uint64_t checksum = 0;   // sum_w thc_check_term(check, w, word w) mod P over the level words written
  uint32_t non_finite = 0; // 1: x holds NaN/Inf; 2: x + e overflowed. Either way e is zeroed and the
                           // words are garbage (the caller zeroes the payload and sets the flag).
};

// One pass per Hadamard block (the block stays in cache):
//   v = x + e (e may be null); y = H (s * v) / sqrt(block) over the zero-padded block;
//   z = clamp(y * scale, -T, T), u = (z + T) g / (2T), level = lo + width * [draw < (u - lo)/width]
//   with draw = thc_uniform24(round_stream, i) / 2^24 (unbiased up to 2^-24 of a level gap);
//   levels packed into the block's words (see ThcLayout); with e:
//   e <- v - RHT^{-1}(level * dequant_a + dequant_b).
// With Q null (a norm-only round) nothing is quantized, `words` is not touched and e <- x + e.
// Returns ||v||^2 (chunk partials and tree of thc_math.h: independent of block size and threads).
// Also returns the checksum of the words written (0 for a norm-only round), thc_math.h's ThcCheck.
// With nb > 0 (the training interleave, thc_interleave below) x holds x_numel floats and the codec's
// input is their interleave into nb = L.numel / L.block blocks, read column by column as each group is
// encoded rather than copied first: the same bits as thc_encode of thc_interleave(x) (needs L.numel =
// L.padded = nb * L.block and x_numel <= L.numel).
ThcEncodeStats thc_encode(const ThcLayout& L, const ThcQuantizer* Q, const ThcCheck& check, uint64_t sign_stream,
                          uint64_t round_stream, const float* x, float* e, int32_t word_kind, void* words,
                          int num_threads, uint64_t x_numel = 0, uint64_t nb = 0);

struct ThcDecodeStats {
  uint64_t bad_words = 0;  // words that are not valid aggregates
  uint64_t checksum = 0;   // sum_w thc_check_term(check, w, S_w) mod P (invalid words as 0)
};

// out[0, numel) = RHT^{-1}(digit * a + b) of the aggregated words, where each word times
// `multiplier` (n for an averaged float64 payload, else 1) must be an integer (within 1/2 when
// averaged, exactly when summed) in [0, base^digits) -- digits past the block's end are 0. Returns
// the number of words failing that (the payload is corrupted or not a plain SUM/AVERAGE), and the
// checksum of the aggregated words, which the caller compares with the payload's checksum field.
// With nb > 0, out receives thc_deinterleave of that (out_numel <= L.numel floats, written group by
// group; the conditions of thc_encode's nb).
ThcDecodeStats thc_decode(const ThcLayout& L, const ThcCheck& check, uint64_t sign_stream, int32_t word_kind,
                          const void* words, double multiplier, double a, double b, float* out, int num_threads,
                          uint64_t out_numel = 0, uint64_t nb = 0);

// The packing alone (tests): levels[0, padded) -> words, and words -> digit sums (returns invalid words).
void thc_pack_levels(const ThcLayout& L, const uint32_t* levels, int32_t word_kind, void* words);
uint64_t thc_unpack_levels(const ThcLayout& L, int32_t word_kind, const void* words, double multiplier, float* sums);

// The training interleave (lossless_hc/training/thc_aggregate.py): x (numel floats) spread over nb
// blocks of `block` coordinates, block j holding the coordinates j, j + nb, j + 2 nb, ... of x, zero
// past its end: out[j * block + r] = x[r * nb + j] if r * nb + j < numel, else 0 (j < nb, r < block).
// Needs nb * block >= numel. Blocked transposition (thc_cpu_isa.h transpose), threads by ranges of
// blocks; a copy, the same bits on every ISA and thread count.
void thc_interleave(const float* x, uint64_t numel, uint64_t nb, uint64_t block, float* out, int num_threads);
// Its inverse: out[i] = y[(i % nb) * block + i / nb] for i < numel (y: nb * block floats).
void thc_deinterleave(const float* y, uint64_t numel, uint64_t nb, uint64_t block, float* out, int num_threads);

// Which compiled copy of the block kernels runs (csrc/cpu/thc_cpu_isa.h): "x86-64-v4" (AVX-512),
// "x86-64-v3" (AVX2 + FMA) or "portable"; every copy computes the same bits. The best one this CPU
// runs is chosen at first use, or the one the environment variable LHC_CPU_ISA names. The LHC value
// peel's AVX-512 step (peel_batch.cpp), the LHC encoder's AVX-512 scan (encode.cpp) and the bitmap
// index's AVX-512 key listing (digits.cpp) run only while "x86-64-v4" is selected (cpu_isa_is_avx512).
const char* thc_cpu_isa();
bool cpu_isa_is_avx512();
// Switch to the copy `name` ("" = the default choice); false (nothing changed) if this CPU cannot run it.
bool thc_set_cpu_isa(const char* name);
// The copies this CPU runs, best first.
std::vector<std::string> thc_cpu_isas();

}  // namespace cpu
}  // namespace lhc
