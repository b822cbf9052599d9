// lhc_layout.h -- the hash family and the payload layout math of the lossless codec.
//
// This is the single definition shared by every backend (the C++/OpenMP kernels of csrc/cpu/, the
// CUDA kernels of csrc/cuda/) and mirrored by the pure-torch reference (lossless_hc/lhc/reference.py).
// Everything here is a pure function of plain integers, so the same key lands in the same cells with
// the same weights on every backend.
//
// Vocabulary
//   key      a block of `block` consecutive coordinates (block = 1: one coordinate).
//   cell     one slot of a segmented table; a value-sketch cell holds `block` floats.
//   segment  a run of `seg_len` consecutive cells. Segments come in groups of three; a key picks one
//            group g uniformly (by hash) and touches exactly one cell in each of its segments
//            3g, 3g+1, 3g+2, so the three cells of a key are distinct by construction. One group
//            (seg_count == 3) is the classic "3 sub-tables" Count Sketch; several groups are
//            independent small sketches of the same shape, which the decoder peels one at a time
//            (cache-resident) and in parallel, deterministically.
//   digit    a small non-negative integer counter. `per_word` digits of base `base` are packed into
//            one float32 word as sum_i digit_i * base^i, kept below 2^22 (see kIntFieldLimit).
#pragma once

#if defined(__CUDACC_RTC__)
// NVRTC (the CuPy run-time path of the CUDA backend) ships no <cstdint>: the same fixed-width types
// from the builtin ones (LP64: long long is 64-bit).
typedef unsigned long long uint64_t;
typedef long long int64_t;
typedef unsigned int uint32_t;
typedef int int32_t;
typedef unsigned long long uintptr_t;
#else
#include <math.h>  // rint, fabs (NVRTC has them built in)
#include <cstdint>
#include <cstring>  // memcpy
#endif

#if defined(__CUDACC__)
#define LHC_HD __host__ __device__ __forceinline__
#define LHC_UNROLL _Pragma("unroll")
#else
#define LHC_HD inline
#define LHC_UNROLL
#endif

namespace lhc {

// Integer fields of the payload stay below 2^22 in magnitude. Float32 represents every integer below
// 2^24 exactly, so a SUM of integer fields whose absolute values total below 2^22 is exact in any
// order (every partial sum is such an integer). An AVERAGE divides that sum by n with at most two
// roundings (divide, or multiply by a rounded 1/n), a relative error of at most 2^-23; times a value
// below 2^22 that is an absolute error below 1/2, so round(avg * n) recovers the integer exactly.
constexpr uint32_t kIntFieldBits = 22;
constexpr uint32_t kIntFieldLimit = 1u << kIntFieldBits;

// A multilevel fine-table word (a signed sum of node patterns, +-1 per cell: see CodecLayout::fine;
// checked whole, as its digits mean nothing in an impure cell) read back as an exact integer: a SUM
// of integer words is exact, an AVERAGE (scale != 1) is within 1/2 of one after scaling back.
// kFineWordCorrupt for a word that is NaN or not an integer, kFineWordOverflow for one of magnitude
// 2^22 or more (+-Inf included: more nodes summed into the cell than the layout was sized for); *out
// is 0 for either.
enum FineWordStatus : uint32_t { kFineWordOk = 0, kFineWordCorrupt = 1, kFineWordOverflow = 2 };
LHC_HD uint32_t read_fine_word(float f, double scale, long long* out) {
  const double v = (double)f * scale;
  const double r = rint(v);  // round half to even (the default rounding mode)
  const double tolerance = scale == 1.0 ? 0.0 : 0.5;
  const bool finite = (v - v) == 0.0;  // false for +-Inf and NaN
  *out = 0;
  if (v != v || (finite && fabs(v - r) > tolerance)) return kFineWordCorrupt;
  if (fabs(r) >= (double)kIntFieldLimit) return kFineWordOverflow;
  *out = (long long)r;
  return kFineWordOk;
}

// Salts separating the independent hash streams derived from one user seed.
constexpr uint64_t kSaltSketch = 0x5ce7c4a11ULL;
constexpr uint64_t kSaltBloom = 0xb100f11ULL;
constexpr uint64_t kSaltFine = 0xf1e7ab1eULL;  // the multilevel index's fine table
constexpr uint64_t kSaltIndexCheck = 0x1dc4ec5ULL;  // the index checksum (below)

// Payload header: float32 fields, each an integer that every rank contributes (see codec.py).
enum HeaderField : uint32_t {
  kHdrContributors = 0,  // 1 per rank: the sum is the number of ranks that contributed
  kHdrFingerprintLo = 1, // 11-bit halves of the configuration fingerprint
  kHdrFingerprintHi = 2,
  kHdrKeysLo = 3,        // this rank's number of non-zero keys, in three 11-bit chunks
  kHdrKeysMid = 4,
  kHdrKeysHi = 5,
  kHdrOverloaded = 6,    // 1 if this rank had more non-zero keys than the capacity
  kHdrNonFinite = 7,     // 1 if this rank's input held NaN or Inf
  kHdrSaturated = 8,     // 1 if one of this rank's index counters hit its per-rank cap
  kHdrIndexCheck0 = 9,   // the index checksum: sum over this rank's non-zero keys of index_check_parts,
  kHdrIndexCheck1 = 10,  // field f reduced mod index_check_prime(f) (layout version 7)
  kHeaderFields = 11,
};
constexpr uint32_t kChunkBits = 11;

// splitmix64's finalizer: a bijective 64-bit mixer with full avalanche.
LHC_HD uint64_t mix64(uint64_t z) {
  z ^= z >> 30;
  z *= 0xbf58476d1ce4e5b9ULL;
  z ^= z >> 27;
  z *= 0x94d049bb133111ebULL;
  z ^= z >> 31;
  return z;
}

// Map the low 32 bits of h uniformly onto [0, n) without a division (n < 2^32).
LHC_HD uint64_t reduce32(uint64_t h, uint64_t n) { return ((h & 0xffffffffULL) * n) >> 32; }

// The per-stream seed: one user seed and a salt give an independent stream.
LHC_HD uint64_t stream_seed(uint64_t seed, uint64_t salt) { return mix64(seed ^ mix64(salt)); }

// ---- The index checksum (issue #19): a summable check that the decoded support is the true one ----
//
// Rank r writes into header field kHdrIndexCheck0 + f (f = 0, 1) the value
//     c_f(r) = (sum over its non-zero keys k of part_f(k)) mod p_f,     p_0 = 2039, p_1 = 2029 (primes),
// where part_0(k) = (h mod 2^32) mod p_0 and part_1(k) = (h >> 32) mod p_1 for h = mix64(k ^ stream),
// stream = index_check_stream(sketch stream) (the seed through the sketch's stream and kSaltIndexCheck:
// a stream of its own, independent of the sketch, Bloom and fine hashes). c_f(r) < 2^11, so n <= 1024
// ranks sum below 2^21: the field is exact under SUM and recoverable under AVERAGE (kIntFieldBits).
// The aggregate satisfies
//     (sum over r of c_f(r)) mod p_f  ==  (sum over keys k of count(k) part_f(k)) mod p_f,
// count(k) the number of ranks that sent k: the per-key counts every index kind decodes (bitmap digits,
// Bloom counts after the count peel, the multilevel index's finest child digits). A decoded support
// whose counts differ from the true ones by d(k) (|d(k)| <= n < p_f, so d(k) != 0 mod p_f) passes only
// if sum_k d(k) part_f(k) == 0 mod p_f for both f: with part_f uniform and independent across keys
// (and the two halves of h independent), probability 1/(p_0 p_1) < 2^-21.9 per corruption, over the
// seed. (Prime moduli: a modulus 2^11 would miss a count off by 2 with probability 2^-10 per field.)
constexpr uint32_t kIndexCheckFields = 2;
constexpr uint64_t kIndexCheckInvalid = ~0ULL;  // header_index_check of a field that is no such sum
LHC_HD uint32_t index_check_prime(uint32_t f) { return f == 0 ? 2039u : 2029u; }
LHC_HD uint64_t index_check_stream(uint64_t sketch_stream) { return stream_seed(sketch_stream, kSaltIndexCheck); }
LHC_HD void index_check_parts(uint64_t stream, uint64_t key, uint32_t part[2]) {
  const uint64_t h = mix64(key ^ stream);
  // 32-bit remainders (the halves are below 2^32): a multiply-high by a constant, which the CPU's
  // checksum loops vectorise and the GPU does natively.
  part[0] = (uint32_t)h % 2039u;
  part[1] = (uint32_t)(h >> 32) % 2029u;
}

// What the aggregated header field kHdrIndexCheck0 + f says the decoded support's
// sum_k count(k) part_f(k) is, mod p_f; kIndexCheckInvalid where the field (times `scale`: n for an
// AVERAGE, else 1) is not an integer in [0, 2^22) (the codec rejects such a header as corrupt anyway).
LHC_HD uint64_t header_index_check(const float* header, double scale, uint32_t f) {
  const double v = (double)header[kHdrIndexCheck0 + f] * scale;
  if (!(v > -0.5 && v < (double)kIntFieldLimit)) return kIndexCheckInvalid;  // NaN too
  const double r = rint(v);
  const double tolerance = scale == 1.0 ? 0.0 : 0.5;
  if (fabs(v - r) > tolerance || r < 0.0) return kIndexCheckInvalid;
  return (uint64_t)r % index_check_prime(f);
}

// Whether the decoded support's sums[f] = sum_k count(k) part_f(k) (any size: reduced here) match the
// header's checksum for both fields.
LHC_HD bool index_check_matches(const float* header, double scale, const unsigned long long sums[2]) {
  for (uint32_t f = 0; f < kIndexCheckFields; ++f)
    if (header_index_check(header, scale, f) != (uint64_t)(sums[f] % index_check_prime(f))) return false;
  return true;
}

struct SegmentedTable {
  uint64_t seg_len;       // cells per segment (>= 1)
  uint64_t seg_count;     // segments: 3 x groups
  uint64_t stream;        // stream_seed(user seed, salt)
  uint64_t weighted = 0;  // 1: weights +-1, +-2; 0: signs +-1 only (see weight_of_code)
  LHC_HD uint64_t cells() const { return seg_len * seg_count; }
  LHC_HD uint64_t groups() const { return seg_count / 3; }
  LHC_HD uint64_t group_cells() const { return 3 * seg_len; }
};

// The first-level hash of a key; every cell and weight of the key derives from it.
LHC_HD uint64_t key_hash(const SegmentedTable& t, uint64_t key) { return mix64(key ^ t.stream); }

// The group of the key with first-level hash h.
LHC_HD uint64_t hash_group(const SegmentedTable& t, uint64_t h) { return reduce32(h >> 32, t.groups()); }

// Key weights. The value sketch adds w_j(k) * v_k into cell j of key k. In a weighted table w_j(k)
// is one of {+1, +2, -1, -2}, chosen by the top two bits of the cell's hash hj (the offset uses the
// low 32): the weight code hj >> 62 has bit 1 = negative (bit 63) and bit 0 = magnitude 2. In an
// unweighted table bit 0 is masked off: signs +-1 only. Powers of two keep encode and decode
// arithmetic exact (a product with +-2 or +-1/2 only moves the exponent). Magnitudes of 1 and 2
// make a two-key stopping set unsolvable only when its three weight ratios agree: 5/128 of them
// instead of the 1/4 of signs; but a key read from a cell whose other keys weigh more carries their
// errors doubled, so weights cost accuracy where peeling chains are long (near the threshold), and
// layout.sketch_table_for weights only small, lightly loaded tables. The integer index tables
// are never weighted (they add counts and ignore the weight).
constexpr int kWeightCodeBits = 2;
LHC_HD int weight_of_code(uint32_t code) {
  const int magnitude = 1 + (int)(code & 1u);
  return (code & 2u) ? -magnitude : magnitude;
}

// Cell j (0, 1, 2) of the key with first-level hash h; its weight code (0..3, see weight_of_code).
LHC_HD uint64_t key_cell_code(const SegmentedTable& t, uint64_t h, int j, uint32_t* code) {
  const uint64_t start = 3 * hash_group(t, h);
  const uint64_t hj = mix64(h + 0x9e3779b97f4a7c15ULL * (uint64_t)(j + 1));
  *code = (uint32_t)(hj >> 62) & (t.weighted ? 3u : 2u);
  return (start + (uint64_t)j) * t.seg_len + reduce32(hj, t.seg_len);
}

// Cell j (0, 1, 2) of the key with first-level hash h, and its weight (+-1 or +-2).
LHC_HD uint64_t key_cell(const SegmentedTable& t, uint64_t h, int j, int* weight) {
  uint32_t code;
  const uint64_t cell = key_cell_code(t, h, j, &code);
  *weight = weight_of_code(code);
  return cell;
}

// The three cells and weights of `key`. Cell j lies in segment 3g + j, so cells are distinct.
// weight is +-1 or +-2 as an integer so callers pick their own arithmetic type.
LHC_HD void key_cells(const SegmentedTable& t, uint64_t key, uint64_t cell[3], int weight[3]) {
  const uint64_t h = key_hash(t, key);
  LHC_UNROLL
  for (int j = 0; j < 3; ++j) cell[j] = key_cell(t, h, j, &weight[j]);
}

// A two-key stopping set of the value sketch: keys a and b share all three cells and nothing else is
// left in them, so cell j holds R_j = wa[j] v_a + wb[j] v_b. Any two cells p < q whose 2x2 system has
// det = wa[p] wb[q] - wa[q] wb[p] != 0 give
//     v_a = (wb[q] R_p - wb[p] R_q) / det,    v_b = (wa[p] R_q - wa[q] R_p) / det.
// The pair of cells with the largest |det| is taken (the first of (0,1), (0,2), (1,2) on ties), as
// it amplifies the cells' rounding least. det == 0 for all three (the columns are proportional) means
// the pair cannot be solved. For +-1 weights this is the rule the decoders used before weights:
// q = the first cell whose relative sign differs from cell 0's, det = +-2.
struct PairCells {
  int p, q, det;  // det == 0: unsolvable
};
LHC_HD PairCells pair_cells(const int wa[3], const int wb[3]) {
  PairCells best = {0, 1, 0};
  const int ps[3] = {0, 0, 1}, qs[3] = {1, 2, 2};
  LHC_UNROLL
  for (int i = 0; i < 3; ++i) {
    const int det = wa[ps[i]] * wb[qs[i]] - wa[qs[i]] * wb[ps[i]];
    const int mag = det < 0 ? -det : det, best_mag = best.det < 0 ? -best.det : best.det;
    if (mag > best_mag) best = {ps[i], qs[i], det};
  }
  return best;
}

// Segments longer than this cannot pack an offset and a weight code into 32 bits (the decoders'
// packed cells); layout.py never builds one (its tables are split into groups long before).
constexpr uint64_t kMaxSegLen = 1ULL << (32 - kWeightCodeBits);

// The group of a key (the decoder buckets keys by group before peeling).
LHC_HD uint64_t key_group(const SegmentedTable& t, uint64_t key) { return hash_group(t, key_hash(t, key)); }

// Digit packing: `per_word` digits of base `base` in one word.
struct DigitPacking {
  uint32_t base;      // n_max + 1, where n_max is the largest aggregated digit possible
  uint32_t per_word;  // largest p with base^p <= kIntFieldLimit
  uint64_t digits;    // number of digits stored
  LHC_HD uint64_t words() const { return (digits + per_word - 1) / per_word; }
};

enum IndexKind : int { kIndexDense = 0, kIndexBitmap = 1, kIndexBloom = 2, kIndexMultilevel = 3 };

// Everything a kernel needs to know about one codec's payload. Offsets count float32 elements.
struct CodecLayout {
  uint64_t numel;         // coordinates of the input
  uint64_t num_keys;      // ceil(numel / block)
  uint64_t block;         // coordinates per key
  int32_t index_kind;     // IndexKind
  SegmentedTable sketch;  // value sketch: sketch.cells() cells of `block` floats
  SegmentedTable bloom;   // kIndexBloom only
  DigitPacking index;     // bitmap: one digit per key; bloom: one digit per bloom cell
  uint32_t digit_cap;     // largest digit one rank may contribute (bitmap 1, bloom q)
  uint64_t capacity;      // keys one rank may send before it reports itself overloaded
  uint32_t fingerprint;   // 22-bit configuration fingerprint, split over two header fields
  uint64_t index_offset;
  uint64_t sketch_offset;
  uint64_t payload_numel;
  // kIndexMultilevel only (the CPU backend; the CUDA kernels read the same shape from the layout
  // words, LayoutWord below). `index` packs the coarse
  // level: one digit per node of fine level 0, the number of ranks with a non-zero key under it.
  // Fine level l (0 = coarsest) has a table `fine[l]` hashed by node id at `fine_offset[l]`: node v
  // adds s_j(v) * its pattern into its cell j, s_j the +-1 key_cell gives (signed, never weighted),
  // so that two nodes sharing all three cells can be solved (pair_cells) unless their signs are
  // proportional; a node covers `span[l]` consecutive keys; each cell is `fine_words[l]` words
  // of `fine_digits[l]` base-(index.base) digits, one per child (a node of level l + 1, or a key at
  // the finest level): child c of node v is digit c % fine_digits of word c / fine_digits.
  uint32_t fine_levels;
  SegmentedTable fine[4];
  uint64_t span[4];
  uint32_t fine_digits[4];
  uint32_t fine_words[4];
  uint64_t fine_offset[4];
};
constexpr uint32_t kMaxFineLevels = 4;

// The mass channel (layout version 6): one float per value-sketch cell right after the sketch, where
// key k adds |w_j(k)| * max_l |x[k, l]|. Its aggregate bounds the absolute mass every coordinate of the
// cell summed, which the decoders' per-key error bound (cell_error_bound) is built on.
LHC_HD uint64_t mass_offset(const CodecLayout& L) { return L.sketch_offset + L.sketch.cells() * L.block; }

// Unit roundoff of float32.
constexpr double kUnitRoundoff = 1.0 / 16777216.0;  // 2^-24

// The most support keys one value-sketch cell may hold: a decode whose support puts more in some cell
// fails as SKETCH_PEEL_FAILED on every backend (the CUDA kernels sort each cell's keys in a thread; the
// bound below assumes (deg + n + 2) u < 1/4). At the planned ~2.3 keys a cell, random supports never
// come near it (reference.MAX_CELL_DEGREE).
constexpr uint32_t kMaxCellDegree = 255;

// The rounding error of the aggregated value cell c, at every coordinate: with deg support keys in c
// and n ranks, each rank adds at most deg terms (deg - 1 roundings) and the engine adds n rank cells
// (n - 1 roundings), so the error is at most gamma_{deg + n - 2} M(c) (Higham, Thm 4.4 twice), M(c)
// the cell's true absolute mass. We take (deg + n + 2) u M: the extra 4 u covers second-order terms,
// an AVERAGE's division and scaling back, and the float64 peeling arithmetic (2^-53 per operation).
// `mass` is the aggregated mass cell as the payload holds it (for an AVERAGE, the average of the masses:
// the bound is then on the average, in the units of its values): itself a float sum of non-negative
// terms, below M(c) by at most a relative gamma_{deg + n}, so it is inflated by (1 + 2 (deg + n + 2) u)
// (valid while (deg + n + 2) u < 1/4: deg <= kMaxCellDegree and n <= 1024 keep it below 2^-13).
LHC_HD double cell_error_bound(double mass, uint64_t deg, uint64_t n) {
  const double m = (double)(deg + n + 2) * kUnitRoundoff;
  return m * mass * (1.0 + 2.0 * m);
}

// Whether a decoded value v of a key with error bound err (before its rounding to float32) meets the
// contract |y - t| <= rtol |t| for the float32 output y = fl(v) and the true sum t: |y - v| <= u |v| and
// |t| >= |v| - err, so err + u |v| <= rtol (|v| - err) suffices. NaN never passes.
// The product err (1 + rtol) is rounded on its own on every backend (nvcc would otherwise fuse it with
// the addition into an FMA, which rounds once): the CPU and CUDA verdicts are the same bits.
LHC_HD bool within_rtol(double v, double err, double rtol) {
  const double a = fabs(v);  // not v < 0 ? -v : v, which compiles to a branch a random sign mispredicts
#if defined(__CUDA_ARCH__)
  const double scaled = __dmul_rn(err, 1.0 + rtol);
#else
  const double scaled = err * (1.0 + rtol);
#endif
  return scaled + kUnitRoundoff * a <= rtol * a;
}

// The smallest float32 >= x (x >= 0 or NaN), as a double: the decoders keep every cell bound rounded up
// to float32 after each update (the CPU in 4 spare bytes of its peeling state), the same operations on
// every backend, so that bounds and verdicts agree bit for bit.
LHC_HD double round_up_to_float(double x) {
  float f = (float)x;
  // Finite f below x >= 0: the next float up (f >= 0, so its bits + 1).
#if defined(__CUDA_ARCH__)
  if ((double)f < x) f = __uint_as_float(__float_as_uint(f) + 1u);
#else
  // Branch-free: on random values the comparison is a coin flip, a mispredicted branch for every other
  // bound the CPU peel stores (three per key).
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  u += (uint32_t)((double)f < x);
  memcpy(&f, &u, sizeof f);
#endif
  return (double)f;
}

// The value peel's verification bound (issue #19, corrupted payloads; decodes with verify only). A key
// k read from cell c has the a-priori bound E(k) (its cell's rounding and the bounds of the keys
// subtracted from c before); that bound assumes c and the cells before it are intact. The cells k was subtracted INTO check k
// afterwards: such a cell j is either a check cell (no key read from it: its residual must be 0 within
// acc(j)) or the pure cell of a later key m. An error d_k of k shows up in j as w_j(k) d_k, so
//   |w_j(k) d_k| <= V(j) - |w_j(k)| E(k),   V(j) = acc(j) + |residual(j)|   (check cell)
//                                           V(j) = |w_j(m)| G(m)            (read by m)
// with G(m) = min over m's two other cells j' of V(j') / |w_j'(m)|: so d_k <= G(k) - E(k) =: F(k)
// whatever happened upstream of k, provided the cells downstream of k are intact and hold no other key
// the corruption reached (the cells lhc_ancestry.h lets verify k). One corrupted cell is either
// upstream of k (F holds) or not (E holds): k is claimed within rtol only if both E(k) and F(k) are. F rounds up: the subtraction's own rounding is covered by 2^-52 G.
LHC_HD double verification_bound(double g, double err) {
  const double f = g - err;
  return (f > 0.0 ? f : 0.0) + g * 2.220446049250313e-16;
}

// ---- The layout ABI: a CodecLayout as an array of uint64 words --------------------------------------
//
// Every backend receives a codec's layout as these words, in this order (built once per codec by
// lossless_hc/lhc/layout.py layout_words, whose LAYOUT_WORDS name them): the CPU kernels through
// layout_from_words, the CUDA kernels reading the words where they need them. A table's four words
// (seg_len, seg_count, stream, weighted) are consecutive, so their address is a table of its own
// (table_from_words; the peeling kernels take the value sketch's and the Bloom table's that way).
enum LayoutWord : int {
  kLwNumel = 0,
  kLwNumKeys,
  kLwBlock,
  kLwIndexKind,
  kLwSketchSegLen,
  kLwSketchSegCount,
  kLwSketchStream,
  kLwSketchWeighted,
  kLwBloomSegLen,
  kLwBloomSegCount,
  kLwBloomStream,
  kLwBloomWeighted,
  kLwIndexBase,
  kLwIndexPerWord,
  kLwIndexDigits,
  kLwDigitCap,
  kLwCapacity,
  kLwFingerprint,
  kLwIndexOffset,
  kLwSketchOffset,
  kLwPayloadNumel,
  // Multilevel index (kIndexMultilevel; other kinds: 0 levels): the number of fine levels, then per
  // level l (coarsest first) kLwFineStride words from kLwFine0SegLen + kLwFineStride * l: its table
  // (seg_len, seg_count, stream; never weighted), span, digits per word, words per cell, and the
  // payload offset of its table. Levels past fine_levels hold a placeholder shape no kernel reads.
  kLwFineLevels,
  kLwFine0SegLen,
  kLwFine0SegCount,
  kLwFine0Stream,
  kLwFine0Span,
  kLwFine0Digits,
  kLwFine0Words,
  kLwFine0Offset,
  kLwFine1SegLen,
  kLwFine1SegCount,
  kLwFine1Stream,
  kLwFine1Span,
  kLwFine1Digits,
  kLwFine1Words,
  kLwFine1Offset,
  kLwFine2SegLen,
  kLwFine2SegCount,
  kLwFine2Stream,
  kLwFine2Span,
  kLwFine2Digits,
  kLwFine2Words,
  kLwFine2Offset,
  kLwFine3SegLen,
  kLwFine3SegCount,
  kLwFine3Stream,
  kLwFine3Span,
  kLwFine3Digits,
  kLwFine3Words,
  kLwFine3Offset,
  kLayoutWords,
};
constexpr int kLwFineStride = kLwFine1SegLen - kLwFine0SegLen;
static_assert(kLwFineStride == 7 && kLayoutWords == kLwFine0SegLen + (int)kMaxFineLevels * kLwFineStride,
              "fine-level words");
static_assert(kLwSketchWeighted == kLwSketchSegLen + 3 && kLwBloomWeighted == kLwBloomSegLen + 3, "table words");

// A segmented table from its four words (seg_len, seg_count, stream, weighted).
LHC_HD SegmentedTable table_from_words(const uint64_t* w) {
  SegmentedTable t;
  t.seg_len = w[0];
  t.seg_count = w[1];
  t.stream = w[2];
  t.weighted = w[3];
  return t;
}

// The CodecLayout of layout words `w`. Without `fine_levels` the multilevel fields stay unset: the
// CUDA kernels read a fine level's words themselves (a struct of per-level arrays indexed at run
// time would live in local memory).
LHC_HD CodecLayout layout_from_words(const uint64_t* w, bool fine_levels = true) {
  CodecLayout L;
  L.numel = w[kLwNumel];
  L.num_keys = w[kLwNumKeys];
  L.block = w[kLwBlock];
  L.index_kind = (int32_t)w[kLwIndexKind];
  L.sketch = table_from_words(w + kLwSketchSegLen);
  L.bloom = table_from_words(w + kLwBloomSegLen);
  L.index.base = (uint32_t)w[kLwIndexBase];
  L.index.per_word = (uint32_t)w[kLwIndexPerWord];
  L.index.digits = w[kLwIndexDigits];
  L.digit_cap = (uint32_t)w[kLwDigitCap];
  L.capacity = w[kLwCapacity];
  L.fingerprint = (uint32_t)w[kLwFingerprint];
  L.index_offset = w[kLwIndexOffset];
  L.sketch_offset = w[kLwSketchOffset];
  L.payload_numel = w[kLwPayloadNumel];
  if (!fine_levels) return L;
  L.fine_levels = (uint32_t)w[kLwFineLevels];
  for (uint32_t l = 0; l < kMaxFineLevels; ++l) {
    const uint64_t* f = w + kLwFine0SegLen + kLwFineStride * l;
    L.fine[l].seg_len = f[0];
    L.fine[l].seg_count = f[1];
    L.fine[l].stream = f[2];
    L.fine[l].weighted = 0;  // an index table: never weighted
    L.span[l] = f[3];
    L.fine_digits[l] = (uint32_t)f[4];
    L.fine_words[l] = (uint32_t)f[5];
    L.fine_offset[l] = f[6];
  }
  return L;
}

// Node of fine level l holding `key`, and the child of that node the key lies under.
LHC_HD uint64_t ml_node(const CodecLayout& L, uint32_t l, uint64_t key) { return key / L.span[l]; }
LHC_HD uint64_t ml_child(const CodecLayout& L, uint32_t l, uint64_t key) {
  const uint64_t below = l + 1 < L.fine_levels ? L.span[l + 1] : 1;
  return (key % L.span[l]) / below;
}

// ---- THC (tensor homomorphic compression): the randomness every backend must reproduce ----------
//
// Two streams per step, both derived from the user seed: the RHT sign stream, shared by all ranks
// (the rotation must be the same everywhere for the sum to be the rotated sum), and the rounding
// stream, distinct per rank (independent rounding errors average out across ranks).
constexpr uint64_t kSaltThcSign = 0x7c5165e5ULL;
constexpr uint64_t kSaltThcRound = 0x7c520d17ULL;

LHC_HD uint64_t thc_sign_stream(uint64_t seed, uint64_t step) {
  return mix64(stream_seed(seed, kSaltThcSign) + 0x9e3779b97f4a7c15ULL * (step + 1));
}

LHC_HD uint64_t thc_round_stream(uint64_t seed, uint64_t rank, uint64_t step) {
  return mix64(mix64(stream_seed(seed, kSaltThcRound) + 0x9e3779b97f4a7c15ULL * (step + 1)) ^ rank);
}

// The RHT signs of coordinates [64 k, 64 k + 64): bit j set means coordinate 64 k + j is negated.
LHC_HD uint64_t thc_sign_bits(uint64_t sign_stream, uint64_t k) {
  return mix64(sign_stream ^ (0xd1b54a32d192ed03ULL * (k + 1)));
}

// murmur3's 32-bit finalizer: a bijection with full avalanche, cheap in 32-bit vector lanes.
LHC_HD uint32_t fmix32(uint32_t h) {
  h ^= h >> 16;
  h *= 0x85ebca6bu;
  h ^= h >> 13;
  h *= 0xc2b2ae35u;
  h ^= h >> 16;
  return h;
}

// The rounding draw of coordinate i: a uniform integer in [0, 2^24) (two fmix32 rounds keyed by
// the 64-bit stream; the high half of i enters the second round so indices past 2^32 stay distinct).
LHC_HD uint32_t thc_uniform24(uint64_t round_stream, uint64_t i) {
  const uint32_t h = fmix32((uint32_t)i ^ (uint32_t)round_stream);
  return fmix32(h + ((uint32_t)(round_stream >> 32) ^ (uint32_t)(i >> 32) * 0x9e3779b9u)) >> 8;
}

// Shape of a THC payload's quantized part: `padded` coordinates (numel rounded up to whole
// Hadamard blocks of `block` = 2^k coordinates), stored as digits of base `base` = n g + 1, `per_word`
// digits per 64-bit word. Blocks are packed in groups of `group_blocks` consecutive blocks (the
// fewest whose coordinates fill whole words, e.g. 3 blocks of 1024 = 512 words of 6 digits), so a
// group is encoded and decoded in one cache-resident pass without touching its neighbours: the
// coordinate c of group G (c counted from the group's first coordinate) is digit c % per_word
// (weight base^(c % per_word)) of word thc_group_first_word(L, G) + c / per_word. The last group
// may hold fewer blocks; digits past a group's coordinates are 0.
struct ThcLayout {
  uint64_t numel;
  uint64_t padded;
  uint64_t block;
  uint32_t granularity;
  uint32_t base;
  uint32_t per_word;
  uint32_t group_blocks;
  uint64_t words;
};

// A ThcLayout as the layout ABI, for every backend: one uint64 word per field in this order
// (lossless_hc/thc/layout.py LAYOUT_WORDS, THCLayout.layout_words), read by thc_layout_from_words.
enum ThcLayoutWord : int {
  kTlNumel = 0,
  kTlPadded,
  kTlBlock,
  kTlGranularity,
  kTlBase,
  kTlPerWord,
  kTlGroupBlocks,
  kTlWords,
  kThcLayoutWords,
};

LHC_HD ThcLayout thc_layout_from_words(const uint64_t* w) {
  ThcLayout L;
  L.numel = w[kTlNumel];
  L.padded = w[kTlPadded];
  L.block = w[kTlBlock];
  L.granularity = (uint32_t)w[kTlGranularity];
  L.base = (uint32_t)w[kTlBase];
  L.per_word = (uint32_t)w[kTlPerWord];
  L.group_blocks = (uint32_t)w[kTlGroupBlocks];
  L.words = w[kTlWords];
  return L;
}

LHC_HD uint64_t thc_words_for(const ThcLayout& L, uint64_t coords) { return (coords + L.per_word - 1) / L.per_word; }
LHC_HD uint64_t thc_groups(const ThcLayout& L) {
  const uint64_t blocks = L.padded / L.block;
  return (blocks + L.group_blocks - 1) / L.group_blocks;
}
LHC_HD uint64_t thc_group_first_word(const ThcLayout& L, uint64_t group) {
  return group * thc_words_for(L, (uint64_t)L.group_blocks * L.block);
}
// Blocks in group `group` (group_blocks, or fewer for the last one).
LHC_HD uint64_t thc_group_size(const ThcLayout& L, uint64_t group) {
  const uint64_t blocks = L.padded / L.block, first = group * L.group_blocks;
  return blocks - first < L.group_blocks ? blocks - first : L.group_blocks;
}

// Write `value` (< 2^33) as three 11-bit chunks starting at header field `first`.
LHC_HD void write_chunks(float* header, uint32_t first, uint64_t value) {
  const uint64_t mask = (1ULL << kChunkBits) - 1;
  header[first + 0] = (float)(value & mask);
  header[first + 1] = (float)((value >> kChunkBits) & mask);
  header[first + 2] = (float)((value >> (2 * kChunkBits)) & mask);
}

}  // namespace lhc
