// The value peel's step for eight keys of one layer at once, in AVX-512 lanes (peel.h
// value_peel_batch8): what decode.cpp's per-key step does for a block of one value, with gathers and
// scatters in place of its scalar loads and stores.
//
// Same bits as the scalar step: every lane does the scalar step's operations in its order, each one
// IEEE-rounded on its own (multiplications and subtractions are never fused: this file is compiled
// without floating-point contraction, and the scalar code has no FMA). The keys of a batch share no
// cell (checked; a batch whose keys do is declined and goes key by key), so the order in which lanes
// store cannot change a value.
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "peel.h"
#include "thc_cpu.h"

#if defined(__x86_64__) && defined(__GNUC__)
// GCC 12's AVX-512 headers build some intrinsics' results from a deliberately undefined vector, which
// -Wextra reports as uninitialised; nothing of this file's is.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop
#define LHC_PEEL_BATCH 1
#define LHC_AVX512 __attribute__((target("avx512f,avx512vl,avx512cd,avx512dq")))
#pragma GCC optimize("fp-contract=off")
#else
#define LHC_PEEL_BATCH 0
#endif

namespace lhc {
namespace cpu {
namespace detail {

#if LHC_PEEL_BATCH
namespace {

// A block-1 cell is 4 slots of 8 bytes (PeelCells: its state slots, then its value), so cell * 4 is
// its first slot and cell * 8 its first 32-bit word.
static_assert(PeelCells::kStateSlots + 1 == 4, "the shifts below assume 4 slots per block-1 cell");

// Word w of each lane's cell (cell8 = cell * 8), and each lane's value slot.
LHC_AVX512 inline __m256i word_at(__m256i cell8, int w) { return _mm256_add_epi32(cell8, _mm256_set1_epi32(w)); }
LHC_AVX512 inline __m256i value_slot(__m256i cell) {
  return _mm256_add_epi32(_mm256_slli_epi32(cell, 2), _mm256_set1_epi32((int)PeelCells::kStateSlots));
}

// The bound of each lane's cell plus |coef| err, rounded up to float
// (lhc::round_up_to_float: to nearest, then one float up if below).
LHC_AVX512 inline void add_bound(float* floats, __m256i cell8, __m512d coef, __m512d err) {
  const __m256i at = word_at(cell8, PeelCells::kBoundWord);
  const __m512d bound =
      _mm512_add_pd(_mm512_cvtps_pd(_mm256_i32gather_ps(floats, at, 4)), _mm512_mul_pd(_mm512_abs_pd(coef), err));
  const __m256 nearest = _mm512_cvtpd_ps(bound);
  const __mmask8 below = _mm512_cmp_pd_mask(_mm512_cvtps_pd(nearest), bound, _CMP_LT_OQ);
  const __m256i bits = _mm256_castps_si256(nearest);
  _mm256_i32scatter_epi32(floats, at, _mm256_mask_add_epi32(bits, below, bits, _mm256_set1_epi32(1)), 4);
}

// Each lane's cell value minus coef x.
LHC_AVX512 inline void subtract(double* values, __m256i cell, __m512d coef, __m512d x) {
  const __m256i at = value_slot(cell);
  _mm512_i32scatter_pd(values, at, _mm512_sub_pd(_mm512_i32gather_pd(at, values, 8), _mm512_mul_pd(coef, x)), 8);
}

// PeelCells::update with delta -1 in each lane's cell: position and degree (slot 0), the packed cells
// e0 | e1 << 32 (slot 1), e2 into the low half of slot 2; the cells left with one key are appended to
// next. Returns how many.
LHC_AVX512 inline uint64_t update(long long* slots, int* words, __m256i cell, __m512i rec_pos, __m512i rec_cells01,
                                  __m256i e2, uint32_t* next) {
  const __m256i slot0 = _mm256_slli_epi32(cell, 2);
  const __m512i s0 =
      _mm512_sub_epi64(_mm512_xor_si512(_mm512_i32gather_epi64(slot0, slots, 8), rec_pos), _mm512_set1_epi64(1));
  _mm512_i32scatter_epi64(slots, slot0, s0, 8);
  const __m256i slot1 = _mm256_add_epi32(slot0, _mm256_set1_epi32(1));
  _mm512_i32scatter_epi64(slots, slot1, _mm512_xor_si512(_mm512_i32gather_epi64(slot1, slots, 8), rec_cells01), 8);
  const __m256i w4 = word_at(_mm256_slli_epi32(cell, 3), PeelCells::kPackedWord + 2);
  _mm256_i32scatter_epi32(words, w4, _mm256_xor_si256(_mm256_i32gather_epi32(words, w4, 4), e2), 4);
  const __mmask8 pure = _mm256_cmpeq_epi32_mask(_mm512_cvtepi64_epi32(s0), _mm256_set1_epi32(1));
  _mm256_mask_compressstoreu_epi32(next, pure, cell);
  return (uint64_t)__builtin_popcount(pure);
}

LHC_AVX512 bool batch8_avx512(PeelCells t, const uint32_t* entries, const ValueBatchOut& out, uint32_t* order,
                              uint32_t* next, uint64_t* appended, uint32_t* inexact_lanes) {
  // The table as 32-bit words and as 8-byte slots; the caller checked that every index fits a signed
  // 32-bit gather index.
  int* const words = reinterpret_cast<int*>(t.slots());
  long long* const slots = reinterpret_cast<long long*>(t.slots());
  double* const values = reinterpret_cast<double*>(t.slots());
  float* const floats = reinterpret_cast<float*>(t.slots());
  const __m512i pairs = _mm512_loadu_si512(entries);  // (position, read cell) x 8
  const __m256i pos = _mm512_cvtepi64_epi32(pairs);
  const __m256i c = _mm512_cvtepi64_epi32(_mm512_srli_epi64(pairs, 32));
  const __m256i c8 = _mm256_slli_epi32(c, 3);
  const __m256i e0 = _mm256_i32gather_epi32(words, word_at(c8, PeelCells::kPackedWord), 4);
  const __m256i e1 = _mm256_i32gather_epi32(words, word_at(c8, PeelCells::kPackedWord + 1), 4);
  const __m256i e2 = _mm256_i32gather_epi32(words, word_at(c8, PeelCells::kPackedWord + 2), 4);
  // The read cell's segment (pure): at least 1 where ge1, 2 where ge2. The other two segments
  // j1 < j2 and their packed cells, as the scalar selects.
  const __m256i seg = _mm256_set1_epi32((int)t.seg_len());
  const __m256i seg2 = _mm256_set1_epi32((int)(2 * t.seg_len()));
  const __mmask8 ge1 = _mm256_cmpge_epu32_mask(c, seg), ge2 = _mm256_cmpge_epu32_mask(c, seg2);
  const __m256i e_pure = _mm256_mask_blend_epi32(ge2, _mm256_mask_blend_epi32(ge1, e0, e1), e2);
  const __m256i e_j1 = _mm256_mask_blend_epi32(ge1, e1, e0);
  const __m256i e_j2 = _mm256_mask_blend_epi32(ge2, e2, e1);
  const __m256i base_j1 = _mm256_mask_blend_epi32(ge1, seg, _mm256_setzero_si256());
  const __m256i base_j2 = _mm256_mask_blend_epi32(ge2, seg2, seg);
  const __m256i c1 = _mm256_add_epi32(base_j1, _mm256_srli_epi32(e_j1, kWeightCodeBits));
  const __m256i c2 = _mm256_add_epi32(base_j2, _mm256_srli_epi32(e_j2, kWeightCodeBits));
  // Decline when two keys share a cell they subtract from (their updates must run in position
  // order), or when such a cell holds no key (a corrupt state, reported by the scalar step).
  const __m512i others = _mm512_inserti64x4(_mm512_castsi256_si512(c1), c2, 1);
  const __m512i conflicts = _mm512_conflict_epi32(others);
  if (_mm512_test_epi32_mask(conflicts, conflicts)) return false;
  const __m256i c1_8 = _mm256_slli_epi32(c1, 3), c2_8 = _mm256_slli_epi32(c2, 3);
  const __m256i deg1 = _mm256_i32gather_epi32(words, c1_8, 4);
  const __m256i deg2 = _mm256_i32gather_epi32(words, c2_8, 4);
  if (_mm256_cmpeq_epi32_mask(deg1, _mm256_setzero_si256()) | _mm256_cmpeq_epi32_mask(deg2, _mm256_setzero_si256()))
    return false;

  // The coefficients: 1 / w of the read cell, w of the other two (kInverseWeights, kWeights).
  const __m512d inverse_table = _mm512_setr_pd(kInverseWeights[0], kInverseWeights[1], kInverseWeights[2],
                                               kInverseWeights[3], 0, 0, 0, 0);
  const __m512d weight_table = _mm512_setr_pd(kWeights[0], kWeights[1], kWeights[2], kWeights[3], 0, 0, 0, 0);
  const __m256i code = _mm256_set1_epi32((int)kCodeMask);
  const __m512d coef0 = _mm512_permutexvar_pd(_mm512_cvtepu32_epi64(_mm256_and_si256(e_pure, code)), inverse_table);
  const __m512d coef1 = _mm512_permutexvar_pd(_mm512_cvtepu32_epi64(_mm256_and_si256(e_j1, code)), weight_table);
  const __m512d coef2 = _mm512_permutexvar_pd(_mm512_cvtepu32_epi64(_mm256_and_si256(e_j2, code)), weight_table);

  // The key's bound: |1 / w| times its read cell's (then marked read); it joins the other two cells'
  // bounds, rounded up to float (lhc::round_up_to_float: to nearest, then one float up if below).
  const __m256i read_bound = word_at(c8, PeelCells::kBoundWord);
  const __m512d err = _mm512_mul_pd(_mm512_abs_pd(coef0), _mm512_cvtps_pd(_mm256_i32gather_ps(floats, read_bound, 4)));
  _mm512_i32scatter_pd(out.key_err, pos, err, 8);
  _mm256_i32scatter_ps(floats, read_bound, _mm256_set1_ps(PeelCells::kReadCell), 4);
  add_bound(floats, c1_8, coef1, err);
  add_bound(floats, c2_8, coef2, err);

  // The value: x = (1 / w) * its read cell, subtracted w-weighted from the other two.
  const __m512d x = _mm512_mul_pd(coef0, _mm512_i32gather_pd(value_slot(c), values, 8));
  subtract(values, c1, coef1, x);
  subtract(values, c2, coef2, x);
  _mm256_i32scatter_ps(out.gvals, pos, _mm512_cvtpd_ps(x), 4);
  // within_rtol(x, err, rtol): err (1 + rtol) + u |x| <= rtol |x|; NaN never passes.
  if (out.check_now) {
    const __m512d a = _mm512_abs_pd(x);
    const __m512d lhs = _mm512_add_pd(_mm512_mul_pd(err, _mm512_set1_pd(1.0 + out.rtol)),
                                      _mm512_mul_pd(_mm512_set1_pd(kUnitRoundoff), a));
    *inexact_lanes = (uint8_t)~_mm512_cmp_pd_mask(lhs, _mm512_mul_pd(_mm512_set1_pd(out.rtol), a), _CMP_LE_OQ);
  } else {
    *inexact_lanes = 0;
  }
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(order), c);

  // The state updates; the cells left with one key are queued.
  const __m512i rec_pos = _mm512_slli_epi64(_mm512_cvtepu32_epi64(pos), 32);
  const __m512i rec_cells01 = _mm512_or_si512(_mm512_cvtepu32_epi64(e0), _mm512_slli_epi64(_mm512_cvtepu32_epi64(e1), 32));
  const uint64_t queued = update(slots, words, c1, rec_pos, rec_cells01, e2, next);
  *appended = queued + update(slots, words, c2, rec_pos, rec_cells01, e2, next + queued);
  return true;
}

}  // namespace
#endif

}  // namespace detail

namespace {

// The step's setting: kDefault until value_peel_batch_set names one. Default: on, except on AMD's
// CPUs, where its gathers and scatters measured slower than the scalar step's prefetched loads once a
// group's table outgrows a core's L2 (Zen 4; on an Intel Xeon the step is the faster one):
// docs/BENCHMARKS.md, "The value peel's AVX-512 step on AMD".
enum BatchSetting : int { kDefault = 0, kOn = 1, kOff = 2 };
std::atomic<int> g_batch_setting{kDefault};

bool batch_on_by_default() {
  const char* env = std::getenv("LHC_PEEL_BATCH");
  if (env && std::strcmp(env, "on") == 0) return true;
  if (env && std::strcmp(env, "off") == 0) return false;
  if (env && *env) std::fprintf(stderr, "lossless_hc: LHC_PEEL_BATCH=%s is neither on nor off; ignored\n", env);
#if LHC_PEEL_BATCH
  __builtin_cpu_init();
  return !__builtin_cpu_is("amd");
#else
  return false;
#endif
}

}  // namespace

bool value_peel_batch_set(const char* request) {
  const std::string r = request;
  if (r != "default" && r != "on" && r != "off") return false;
  g_batch_setting.store(r == "on" ? kOn : r == "off" ? kOff : kDefault, std::memory_order_relaxed);
  return true;
}

bool value_peel_batch_on() {
  static const bool by_default = batch_on_by_default();
  const int s = g_batch_setting.load(std::memory_order_relaxed);
  return s == kDefault ? by_default : s == kOn;
}

namespace detail {

bool value_peel_batch8_available(PeelCells t, uint32_t count) {
#if LHC_PEEL_BATCH
  // Gather indices are signed 32-bit: a cell's words and the keys' positions must fit.
  return value_peel_batch_on() && cpu_isa_is_avx512() &&
         t.stride() == PeelCells::kStateSlots + 1 && t.cells() < (1ull << 27) && count < (1u << 31);
#else
  (void)t;
  (void)count;
  return false;
#endif
}

bool value_peel_batch8(PeelCells t, const uint32_t* entries, const ValueBatchOut& out, uint32_t* order, uint32_t* next,
                       uint64_t* appended, uint32_t* inexact_lanes) {
#if LHC_PEEL_BATCH
  return batch8_avx512(t, entries, out, order, next, appended, inexact_lanes);
#else
  (void)t, (void)entries, (void)out, (void)order, (void)next, (void)appended, (void)inexact_lanes;
  return false;
#endif
}

}  // namespace detail
}  // namespace cpu
}  // namespace lhc
