// CPU kernels of the THC codec (see thc_cpu.h for the contracts).
//
// The block kernels (transform, signs, norm partials, rounding, packing) live in thc_cpu_isa.h, compiled
// here once per x86-64 level (AVX-512, AVX2 + FMA, portable) and chosen at run time; this file holds the
// entry points, which split the work into groups of blocks over OpenMP threads (static schedule,
// disjoint outputs) and reduce the norm in the fixed order of thc_math.h, so no result depends on the
// thread count or on the level chosen.
#include "thc_cpu.h"

#include "../thc_math.h"

#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#endif

namespace lhc {
namespace cpu {
namespace {

inline void* thc_word_at(void* words, int32_t word_kind, uint64_t w) {
  return word_kind == kThcWordFloat64 ? (void*)(static_cast<double*>(words) + w) : (void*)(static_cast<int64_t*>(words) + w);
}
inline const void* thc_word_at(const void* words, int32_t word_kind, uint64_t w) {
  return thc_word_at(const_cast<void*>(words), word_kind, w);
}

// Per-thread scratch of the group kernels: a group of floats, the sign masks of one block, the
// group's digits (plus one word of zero padding) and the decoder's per-word doubles.
struct ThcScratch {
  float* y;
  float* xin;           // a group's blocks of the training interleave (x or out null): block j at xin + j * xin_stride
  uint64_t xin_stride;
  uint32_t* m;
  uint32_t* q;
  double* d;
};

struct ThcGroupArgs {
  const ThcLayout* layout;
  const ThcQuantizer* Q;   // null: norm-only round
  ThcRounding R;
  float table[3][32];      // lo, width, inv_width padded to 32 entries (when g <= 32: vector lookups)
  uint64_t sign_stream, round_stream;
  const float* x;          // null: the group's blocks are at ThcScratch::xin (thc_encode's nb)
  float* e;                // null: no error feedback
  int32_t word_kind;
  void* words;
  float inv_sqrt;
  bool fits_double;
  bool chunks_in_blocks;   // the norm's chunk partials are computed block by block
  double* partial;
  ThcCheck check;
  uint64_t* check_partial; // per group: its words' checksum (thc_math.h)
};

struct ThcDecodeArgs {
  const ThcLayout* layout;
  uint64_t sign_stream;
  int32_t word_kind;
  const void* words;
  double multiplier, tolerance, a, b;
  float inv_sqrt;
  float* out;              // null: the group's blocks go to ThcScratch::xin (thc_decode's nb)
  ThcCheck check;
  uint64_t* check_partial;
};

// The ISA copies' transposition (thc_cpu_isa.h): dst[c * dst_ld + r] = src[r * src_ld + c].
using TransposeFn = void (*)(const float*, uint64_t, uint64_t, uint64_t, float*, uint64_t);

// The rows r < block of a chunk of columns [first, first + blocks) that lie wholly inside a tensor of
// `numel` floats read as rows of nb: r * nb + first + blocks <= numel (they come first).
inline uint64_t whole_rows(uint64_t numel, uint64_t nb, uint64_t first, uint64_t blocks, uint64_t block) {
  return numel >= first + blocks ? std::min<uint64_t>(block, (numel - first - blocks) / nb + 1) : 0;
}

// The interleave of `blocks` consecutive blocks from block `first` on (thc_interleave, restricted to
// them): xin[j * stride + r] = src[r * nb + first + j], zero past src_numel. A chunk of groups is
// gathered at once (kGatherGroups), so a row's columns span whole cache lines; eight rows at a time go
// through the vector transposition, and the rows are prefetched ahead (their stride defeats the
// hardware prefetcher). The padded stride keeps the blocks' rows out of one cache set.
inline void gather_columns(TransposeFn transpose, const float* src, uint64_t src_numel, uint64_t nb, uint64_t first,
                           uint64_t blocks, uint64_t block, float* xin, uint64_t stride) {
  constexpr uint64_t kBand = 8, kAhead = 16;
  const uint64_t full = whole_rows(src_numel, nb, first, blocks, block);
  for (uint64_t r = 0; r < full; r += kBand) {
    const uint64_t rows = std::min(kBand, full - r);
    for (uint64_t p = r + kAhead; p < std::min(full, r + kAhead + rows); ++p)
      for (uint64_t c = 0; c < blocks; c += 16) __builtin_prefetch(src + p * nb + first + c, 0, 1);
    transpose(src + r * nb + first, rows, blocks, nb, xin + r, stride);
  }
  for (uint64_t r = full; r < block; ++r) {
    const uint64_t base = r * nb + first;
    for (uint64_t j = 0; j < blocks; ++j) xin[j * stride + r] = base + j < src_numel ? src[base + j] : 0.0f;
  }
}
// Groups whose columns are read (encode) or written (decode) together: rows of 48 and 192 floats for
// THC's usual three blocks per group (the faster of 16, 32 and 64 for each, timed on an embedding of
// 30,000 x 256, one thread; docs/BENCHMARKS.md).
constexpr uint64_t kGatherGroups = 16, kScatterGroups = 64;

// Its inverse for decoded blocks: dst[r * nb + first + j] = y[j * stride + r] below dst_numel; the rows
// that lie wholly below it through the vector transposition.
inline void scatter_columns(TransposeFn transpose, const float* y, uint64_t stride, uint64_t blocks, uint64_t block,
                            uint64_t nb, uint64_t first, float* dst, uint64_t dst_numel) {
  const uint64_t full = whole_rows(dst_numel, nb, first, blocks, block);
  transpose(y, blocks, full, stride, dst + first, nb);
  for (uint64_t r = full; r < block; ++r) {
    const uint64_t base = r * nb + first;
    for (uint64_t j = 0; base + j < dst_numel && j < blocks; ++j) dst[base + j] = y[j * stride + r];
  }
}

// One compiled copy of the block kernels (thc_cpu_isa.h).
struct ThcKernels {
  const char* name;
  void (*fwht)(float*, uint64_t);
  double (*chunk_sum_squares)(const float*, uint64_t);
  uint32_t (*max_exponent)(const float*, uint64_t);
  void (*pack_block)(const uint32_t*, uint64_t, uint64_t, uint64_t, bool, int32_t, uint64_t, void*);
  uint64_t (*unpack_block)(const void*, int32_t, uint64_t, uint64_t, uint64_t, uint64_t, double, double, double,
                           double, float*, double*);
  void (*encode_group)(const ThcGroupArgs&, uint64_t, ThcScratch&);
  uint64_t (*decode_group)(const ThcDecodeArgs&, uint64_t, ThcScratch&);
  TransposeFn transpose;
};

}  // namespace

// The portable copy's 64-byte vectors are local to always-inline helpers (no ABI is involved).
#pragma GCC diagnostic ignored "-Wpsabi"

#define LHC_THC_ISA isa_portable
#define LHC_THC_ISA_NAME "portable"
#define LHC_THC_TARGET
#define LHC_THC_PERMUTE 0
#define LHC_THC_VW 4
#include "thc_cpu_isa.h"
#undef LHC_THC_ISA
#undef LHC_THC_ISA_NAME
#undef LHC_THC_TARGET
#undef LHC_THC_PERMUTE
#undef LHC_THC_VW

#if defined(__x86_64__) && defined(__GNUC__)
#define LHC_THC_X86_LEVELS 1
#define LHC_THC_ISA isa_avx2
#define LHC_THC_ISA_NAME "x86-64-v3"
#define LHC_THC_TARGET __attribute__((target("arch=x86-64-v3")))
#define LHC_THC_PERMUTE 0
#define LHC_THC_VW 8
#include "thc_cpu_isa.h"
#undef LHC_THC_ISA
#undef LHC_THC_ISA_NAME
#undef LHC_THC_TARGET
#undef LHC_THC_PERMUTE
#undef LHC_THC_VW

#define LHC_THC_ISA isa_avx512
#define LHC_THC_ISA_NAME "x86-64-v4"
#define LHC_THC_TARGET __attribute__((target("arch=x86-64-v4")))
#define LHC_THC_PERMUTE 1
#define LHC_THC_VW 16
#include "thc_cpu_isa.h"
#undef LHC_THC_ISA
#undef LHC_THC_ISA_NAME
#undef LHC_THC_TARGET
#undef LHC_THC_PERMUTE
#undef LHC_THC_VW
#else
#define LHC_THC_X86_LEVELS 0
#endif

namespace {

// The copies this CPU can run, best first.
std::vector<const ThcKernels*> runnable_kernels() {
  std::vector<const ThcKernels*> k;
#if LHC_THC_X86_LEVELS
  __builtin_cpu_init();
  if (__builtin_cpu_supports("x86-64-v4")) k.push_back(&isa_avx512::kKernels);
  if (__builtin_cpu_supports("x86-64-v3")) k.push_back(&isa_avx2::kKernels);
#endif
  k.push_back(&isa_portable::kKernels);
  return k;
}

const ThcKernels* find_kernels(const std::string& name) {
  for (const ThcKernels* k : runnable_kernels())
    if (name == k->name) return k;
  return nullptr;
}

// The best runnable copy, or the one LHC_CPU_ISA names if this CPU runs it; a name it cannot run (or
// a typo) is said on stderr rather than ignored in silence: the bits are the same, the speed is not.
const ThcKernels* default_kernels() {
  const char* env = std::getenv("LHC_CPU_ISA");
  const ThcKernels* best = runnable_kernels().front();
  if (env && *env) {
    if (const ThcKernels* k = find_kernels(env)) return k;
    std::string runnable;
    for (const ThcKernels* k : runnable_kernels()) runnable += std::string(runnable.empty() ? "" : ", ") + k->name;
    std::fprintf(stderr, "lossless_hc: LHC_CPU_ISA=%s is not a level this CPU runs (%s); using %s\n", env,
                 runnable.c_str(), best->name);
  }
  return best;
}

std::atomic<const ThcKernels*> g_kernels{nullptr};

const ThcKernels& kernels() {
  const ThcKernels* k = g_kernels.load(std::memory_order_acquire);
  if (!k) {
    k = default_kernels();
    g_kernels.store(k, std::memory_order_release);
  }
  return *k;
}

int thc_threads(int num_threads) { return num_threads > 0 ? num_threads : omp_get_max_threads(); }

inline float flip_sign(float v, uint32_t bit) { return thc_flip_sign(v, bit); }

inline bool horner_fits_double(const ThcLayout& L) {
  double p = 1.0;
  for (uint32_t j = 0; j < L.per_word; ++j) p *= (double)L.base;
  return p <= 9007199254740992.0;  // 2^53
}

// NaN/Inf anywhere in x[0, n)? (Only after the encode pass found ||x + e||^2 non-finite: it tells a
// non-finite input from an overflowing x + e.)
bool any_non_finite(const ThcKernels& K, const float* x, uint64_t n, int nt) {
  constexpr uint64_t kSlice = 1 << 16;
  int bad = 0;
#pragma omp parallel for num_threads(nt) schedule(dynamic, 4) reduction(| : bad)
  for (int64_t c = 0; c < (int64_t)((n + kSlice - 1) / kSlice); ++c) {
    const uint64_t lo = (uint64_t)c * kSlice, hi = std::min<uint64_t>(n, lo + kSlice);
    bad |= K.max_exponent(x + lo, hi - lo) == 0x7f800000u;
  }
  return bad != 0;
}

// Every chunk partial from x + e directly (used when the Hadamard block is smaller than a chunk).
void chunk_partials(const ThcKernels& K, const ThcLayout& L, const float* x, const float* e, double* partial, int nt) {
  const uint64_t nchunks = (L.padded + kThcNormChunk - 1) / kThcNormChunk;
#pragma omp parallel for num_threads(nt) schedule(static)
  for (int64_t c = 0; c < (int64_t)nchunks; ++c) {
    const uint64_t start = (uint64_t)c * kThcNormChunk;
    const uint64_t count = start >= L.numel ? 0 : std::min<uint64_t>(kThcNormChunk, L.numel - start);
    float v[kThcNormChunk];
    for (uint64_t i = 0; i < count; ++i) v[i] = e ? x[start + i] + e[start + i] : x[start + i];
    partial[c] = K.chunk_sum_squares(v, count);
  }
}

// The signs of coordinates [start, start + count) as 0/1 bits into bit[] (the stage entry points).
void sign_bits(uint64_t stream, uint64_t start, uint64_t count, uint32_t* bit) {
  for (uint64_t i = 0; i < count; ++i) bit[i] = thc_sign_bit(stream, start + i);
}

// Scratch of one thread for groups of L.
struct ScratchBuffers {
  std::vector<float> y, xin;
  std::vector<uint32_t> m, q;
  std::vector<double> d;
  ThcScratch view;
  // chunk_groups > 0: room in xin for that many groups' blocks (no more than L has), a padded stride apart.
  explicit ScratchBuffers(const ThcLayout& L, uint64_t chunk_groups = 0)
      : y(L.group_blocks * L.block),
        xin(std::min<uint64_t>(chunk_groups, thc_groups(L)) * L.group_blocks * (L.block + 16)),
        m(L.block),
        q(L.group_blocks * L.block + L.per_word, 0u), d(L.group_blocks * L.block / L.per_word + 1) {
    view = ThcScratch{y.data(), xin.data(), L.block + 16, m.data(), q.data(), d.data()};
  }
};

// The conditions of thc_encode's and thc_decode's nb: whole blocks, the tensor inside them.
void check_interleave(const ThcLayout& L, uint64_t numel, uint64_t nb) {
  if (nb == 0) return;
  if (L.numel != L.padded || nb * L.block != L.numel || numel > L.numel)
    throw std::invalid_argument("THC interleave: needs numel == padded == nb * block and the tensor's numel <= that");
}

// The groups of L shared out among the threads of the enclosing parallel region (dynamic chunks: on a
// shared machine a descheduled thread does not hold the others up; every group writes only its own
// results). chunk 0: group(gi, S.view) for each. Otherwise (the training interleave) `chunk` groups at
// a time, their blocks at S.xin: before(b0, blocks), each group(gi, view), after(b0, blocks), for the
// chunk's blocks [b0, b0 + blocks).
template <typename Group, typename Before, typename After>
void for_each_group(const ThcLayout& L, uint64_t chunk, ScratchBuffers& S, Group&& group, Before&& before,
                    After&& after) {
  const uint64_t ngroups = thc_groups(L);
  if (chunk == 0) {
#pragma omp for schedule(dynamic, 16) nowait
    for (int64_t gi = 0; gi < (int64_t)ngroups; ++gi) group((uint64_t)gi, S.view);
    return;
  }
  const int64_t chunks = (int64_t)((ngroups + chunk - 1) / chunk);
  const uint64_t GB = L.group_blocks, blocks_total = L.numel / L.block;
#pragma omp for schedule(dynamic, 1) nowait
  for (int64_t ci = 0; ci < chunks; ++ci) {
    const uint64_t g0 = (uint64_t)ci * chunk, g1 = std::min<uint64_t>(ngroups, g0 + chunk);
    const uint64_t b0 = g0 * GB, blocks = std::min<uint64_t>(blocks_total, g1 * GB) - b0;
    before(b0, blocks);
    for (uint64_t gi = g0; gi < g1; ++gi) {
      ThcScratch view = S.view;
      view.xin = S.xin.data() + (gi - g0) * GB * view.xin_stride;
      group(gi, view);
    }
    after(b0, blocks);
  }
}

}  // namespace

const char* thc_cpu_isa() { return kernels().name; }

bool cpu_isa_is_avx512() { return std::strcmp(thc_cpu_isa(), "x86-64-v4") == 0; }

bool thc_set_cpu_isa(const char* name) {
  const ThcKernels* k = (name && *name) ? find_kernels(name) : default_kernels();
  if (!k) return false;
  g_kernels.store(k, std::memory_order_release);
  return true;
}

std::vector<std::string> thc_cpu_isas() {
  std::vector<std::string> names;
  for (const ThcKernels* k : runnable_kernels()) names.push_back(k->name);
  return names;
}

ThcForwardStats thc_rht_forward(const ThcLayout& L, uint64_t sign_stream, const float* x, const float* e, float* y,
                                int num_threads) {
  const int nt = thc_threads(num_threads);
  const ThcKernels& K = kernels();
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
      K.fwht(yb, B);
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
  const ThcKernels& K = kernels();
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
      K.fwht(yb, B);
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


// The sum of the groups' checksums mod P (integers: the order does not matter).
uint64_t sum_checks(const std::vector<uint64_t>& part, uint64_t prime) {
  uint64_t total = 0;
  for (uint64_t v : part) total = (total + v) % prime;
  return total;
}

ThcEncodeStats thc_encode(const ThcLayout& L, const ThcQuantizer* Q, const ThcCheck& check, uint64_t sign_stream,
                          uint64_t round_stream, const float* x, float* e, int32_t word_kind, void* words,
                          int num_threads, uint64_t x_numel, uint64_t nb) {
  const int nt = thc_threads(num_threads);
  check_interleave(L, x_numel, nb);
  std::vector<float> interleaved;
  if (nb && L.block < kThcNormChunk) {
    // The norm's chunks span several blocks (chunk_partials reads the codec's input as one array):
    // the interleave is made first.
    interleaved.resize(L.numel);
    thc_interleave(x, x_numel, nb, L.block, interleaved.data(), nt);
    x = interleaved.data();
    nb = 0;
  }
  const ThcKernels& K = kernels();
  ThcEncodeStats st;
  // No separate finiteness pass over x: a NaN/Inf in x (or an overflow of x + e) makes ||x + e||^2
  // non-finite, which the one pass below computes anyway; the rounding maps NaN to a valid level
  // (thc_level), so the pass stays in bounds, and its words and e are discarded afterwards.
  const uint64_t ngroups = thc_groups(L);
  // ||x + e||^2 in the fixed order of thc_math.h: chunk partials, then the tree.
  const uint64_t nchunks = (L.padded + kThcNormChunk - 1) / kThcNormChunk;
  std::vector<double> partial(nchunks, 0.0);
  ThcGroupArgs A{};
  A.layout = &L;
  A.Q = Q;
  if (Q) {
    A.R = thc_rounding(Q->lo, Q->width, Q->inv_width, Q->scale, Q->threshold, L.granularity);
    const float* src[3] = {Q->lo, Q->width, Q->inv_width};
    for (int t = 0; t < 3; ++t)
      for (uint32_t l = 0; l < 32; ++l) A.table[t][l] = l < L.granularity ? src[t][l] : 0.0f;
  }
  A.sign_stream = sign_stream;
  A.round_stream = round_stream;
  A.x = nb ? nullptr : x;
  A.e = e;
  A.word_kind = word_kind;
  A.words = words;
  A.inv_sqrt = (float)(1.0 / std::sqrt((double)L.block));
  A.fits_double = horner_fits_double(L);
  A.chunks_in_blocks = L.block >= kThcNormChunk;   // else computed here, before the blocks
  A.partial = partial.data();
  std::vector<uint64_t> check_partial(ngroups, 0);
  A.check = check;
  A.check_partial = check_partial.data();
  if (!A.chunks_in_blocks) chunk_partials(K, L, x, e, partial.data(), nt);
#pragma omp parallel num_threads(nt)
  {
    const uint64_t chunk = nb ? kGatherGroups : 0;
    ScratchBuffers S(L, chunk);
    for_each_group(
        L, chunk, S, [&](uint64_t gi, ThcScratch& view) { K.encode_group(A, gi, view); },
        [&](uint64_t b0, uint64_t blocks) {
          gather_columns(K.transpose, x, x_numel, nb, b0, blocks, L.block, S.xin.data(), S.view.xin_stride);
        },
        [](uint64_t, uint64_t) {});
  }
  st.sum_squares = thc_tree_sum(partial.data(), nchunks);
  st.checksum = sum_checks(check_partial, check.prime);
  if (!std::isfinite(st.sum_squares)) {
    // x holds NaN/Inf (1), or x was finite but x + e (or its square) overflowed float32 (2). Either
    // way the pass has overwritten e with values derived from non-finite ones: reset it.
    st.non_finite = any_non_finite(K, x, nb ? x_numel : L.numel, nt) ? 1u : 2u;
    if (e) std::fill(e, e + L.numel, 0.0f);
  }
  return st;
}

ThcDecodeStats thc_decode(const ThcLayout& L, const ThcCheck& check, uint64_t sign_stream, int32_t word_kind,
                          const void* words, double multiplier, double a, double b, float* out, int num_threads,
                          uint64_t out_numel, uint64_t nb) {
  const int nt = thc_threads(num_threads);
  const ThcKernels& K = kernels();
  check_interleave(L, out_numel, nb);
  std::vector<uint64_t> check_partial(thc_groups(L), 0);
  const ThcDecodeArgs A{&L,
                        sign_stream,
                        word_kind,
                        words,
                        multiplier,
                        multiplier == 1.0 ? 0.0 : 0.5,
                        a,
                        b,
                        (float)(1.0 / std::sqrt((double)L.block)),
                        nb ? nullptr : out,
                        check,
                        check_partial.data()};
  uint64_t bad = 0;
#pragma omp parallel num_threads(nt) reduction(+ : bad)
  {
    // With the interleave, kScatterGroups groups decoded into S.xin, then their columns written out together.
    const uint64_t chunk = nb ? kScatterGroups : 0;
    ScratchBuffers S(L, chunk);
    for_each_group(
        L, chunk, S, [&](uint64_t gi, ThcScratch& view) { bad += K.decode_group(A, gi, view); },
        [](uint64_t, uint64_t) {},
        [&](uint64_t b0, uint64_t blocks) {
          scatter_columns(K.transpose, S.xin.data(), S.view.xin_stride, blocks, L.block, nb, b0, out, out_numel);
        });
#if LHC_THC_X86_LEVELS
    _mm_sfence();   // the output's non-temporal stores are visible before the caller reads it
#endif
  }
  ThcDecodeStats st;
  st.bad_words = bad;
  st.checksum = sum_checks(check_partial, check.prime);
  return st;
}

void thc_pack_levels(const ThcLayout& L, const uint32_t* levels, int32_t word_kind, void* words) {
  const ThcKernels& K = kernels();
  const bool fits_double = horner_fits_double(L);
  const uint64_t coords = (uint64_t)L.group_blocks * L.block;
  for (uint64_t gi = 0; gi < thc_groups(L); ++gi) {
    const uint64_t count = thc_group_size(L, gi) * L.block;
    K.pack_block(levels + gi * coords, count, L.per_word, L.base, fits_double, word_kind, thc_words_for(L, count),
                 thc_word_at(words, word_kind, thc_group_first_word(L, gi)));
  }
}

uint64_t thc_unpack_levels(const ThcLayout& L, int32_t word_kind, const void* words, double multiplier, float* sums) {
  const ThcKernels& K = kernels();
  const uint64_t coords = (uint64_t)L.group_blocks * L.block;
  ScratchBuffers S(L);
  uint64_t bad = 0;
  for (uint64_t gi = 0; gi < thc_groups(L); ++gi) {
    const uint64_t count = thc_group_size(L, gi) * L.block;
    bad += K.unpack_block(thc_word_at(words, word_kind, thc_group_first_word(L, gi)), word_kind,
                          thc_words_for(L, count), count, L.per_word, L.base, multiplier,
                          multiplier == 1.0 ? 0.0 : 0.5, 1.0, 0.0, sums + gi * coords, S.d.data());
  }
  return bad;
}

namespace {

// dst = the transpose of src (rows x cols, row strides src_ld and dst_ld) in tiles of 64 x 64 floats
// (16 KiB read and 16 KiB written: in L1 while the tile is turned), each thread a range of dst rows.
void transpose_tiled(const float* src, uint64_t rows, uint64_t cols, uint64_t src_ld, float* dst, uint64_t dst_ld,
                     int nt) {
  constexpr uint64_t kTile = 64;
  const ThcKernels& K = kernels();
  const int64_t tiles = (int64_t)((cols + kTile - 1) / kTile);
#pragma omp parallel for num_threads(nt) schedule(static)
  for (int64_t ct = 0; ct < tiles; ++ct) {
    const uint64_t c0 = (uint64_t)ct * kTile, nc = std::min(kTile, cols - c0);
    for (uint64_t r0 = 0; r0 < rows; r0 += kTile)
      K.transpose(src + r0 * src_ld + c0, std::min(kTile, rows - r0), nc, src_ld, dst + c0 * dst_ld + r0, dst_ld);
  }
}

}  // namespace

// x as the (full, nb) matrix of its first full * nb coordinates, then the partial row of the rest.
void thc_interleave(const float* x, uint64_t numel, uint64_t nb, uint64_t block, float* out, int num_threads) {
  const int nt = thc_threads(num_threads);
  const uint64_t full = numel / nb, rest = numel % nb;
  transpose_tiled(x, full, nb, nb, out, block, nt);
  if (full == block) return;  // no partial row, no padding
#pragma omp parallel for num_threads(nt) schedule(static)
  for (int64_t j = 0; j < (int64_t)nb; ++j) {
    float* row = out + (uint64_t)j * block;
    row[full] = (uint64_t)j < rest ? x[full * nb + (uint64_t)j] : 0.0f;
    std::fill(row + full + 1, row + block, 0.0f);
  }
}

void thc_deinterleave(const float* y, uint64_t numel, uint64_t nb, uint64_t block, float* out, int num_threads) {
  const uint64_t full = numel / nb, rest = numel % nb;
  transpose_tiled(y, nb, full, block, out, nb, thc_threads(num_threads));
  for (uint64_t j = 0; j < rest; ++j) out[full * nb + j] = y[j * block + full];
}

}  // namespace cpu
}  // namespace lhc
