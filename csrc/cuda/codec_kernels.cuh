// codec_kernels.cuh -- CUDA kernels of the lossless codec (encode, index decode, peeling, output).
//
// Device code only: this file compiles under nvcc (included by codec_cuda.cu, which adds the host
// launcher of the compiled module lossless_hc._C_cuda) and under NVRTC (loaded at run time through
// CuPy by lossless_hc/backends/cuda.py), so it includes nothing but csrc/lhc_layout.h and uses no host API.
// The launch sequence (which kernel, grid, scratch buffers) lives in one place, lossless_hc/backends/cuda.py,
// shared by both ways of loading these kernels.
//
// Calling convention: every kernel parameter is 8 bytes (a pointer, a uint64_t or a double), so a
// launcher can pass any kernel's arguments as an array of 64-bit words. The codec layout travels as
// a device array of uint64 words (LayoutWord below, mirrored by _cuda.LAYOUT_WORDS).
//
// Agreement with the CPU backend: cells, weights, groups and digit packing come from lhc_layout.h, so
// the index words (the multilevel index's fine tables included: exact signed integer sums converted
// once) and header fields are bitwise equal to csrc/cpu/codec_cpu.cpp's; sketch cells are float sums of
// the same terms w * v (exact: w is +-1 or +-2), in atomicAdd order rather than the CPU's key order,
// so values agree within float rounding.
//
// Determinism of decode (the payload alone decides the output bits):
//  * Integer work (counts, degrees, XORs, index totals) uses atomics: integer sums commute.
//  * Candidate and support lists are built by ordered stream compaction (tile counts, a scan, and a
//    per-tile block scan), so a key's position in a list is its rank in increasing key order.
//  * Peeling runs in rounds inside one persistent kernel (a grid barrier between phases, no host
//    round trip): A) every pure cell proposes its key, which takes the smallest proposing cell
//    (atomicMin); B) each key proposed this round reads its value from that cell; C) every cell
//    touched this round subtracts the keys peeled this round in increasing key position, walking its
//    own adjacency list (built once, sorted by key position). Each cell is written by one thread in a
//    fixed order, so the double-precision arithmetic is the same on every run.
//  * The multilevel index's fine tables are peeled in exact integers (every order gives the same
//    patterns when consistent ones exist), and its verdicts follow the CPU backend's, failures
//    included, replaying the CPU's own peeling order where that order decides ("Decode: multilevel
//    index" below).
#pragma once

#include "../lhc_layout.h"

namespace lhc {
namespace gpu {

// Order of the uint64 words describing a CodecLayout (mirrored by lossless_hc/backends/cuda.py LAYOUT_WORDS).
// The value sketch's and the Bloom table's words (seg_len, seg_count, stream, weighted) are each a
// table-words pointer (load_table), as the peeling kernels take them.
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
  // (seg_len, seg_count, stream; never weighted: read by ml_level), span, digits per word, words per
  // cell, and the payload offset of its table.
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
static_assert(kLwFineStride == 7 && kLayoutWords == kLwFine0SegLen + 4 * kLwFineStride, "fine-level words");
static_assert(kLwSketchWeighted == kLwSketchSegLen + 3 && kLwBloomWeighted == kLwBloomSegLen + 3, "table words");

// Encode statistics (device, zeroed by the caller before encode).
struct EncodeCounters {
  unsigned long long keys;  // non-zero keys of this rank
  unsigned int non_finite;  // 1 if the input held NaN/Inf
  unsigned int saturated;   // 1 if a Bloom counter hit its per-rank cap
};

// Decode statistics and failure flags (device, zeroed by the caller before decode). The host reads
// this struct once at the end of decode and turns the flags into a status with the CPU backend's
// precedence (lossless_hc/backends/cuda.py decode_status).
struct DecodeCounters {
  unsigned long long index_total;      // sum of the decoded index digits
  unsigned long long expected_total;   // what the header says the index must sum to
  unsigned long long candidates;       // keys the index could not rule out
  unsigned long long support;          // keys with an aggregated count >= 1
  unsigned long long peeled;           // support keys recovered by the value peel
  unsigned long long count_resolved;   // Bloom candidates resolved by the count peel
  unsigned long long list_count;       // scratch: length of the list a compaction just produced
  unsigned int flags;                  // DecodeFlag bits
  unsigned int abort;                  // non-zero: a later stage cannot succeed, kernels skip work
};

enum DecodeFlag : unsigned int {
  kFlagIndexWord = 1u << 0,        // an index word is not a valid packed integer / digit out of range
  kFlagIndexTotal = 1u << 1,       // index digits do not sum to what the header says
  kFlagCandOverflow = 1u << 2,     // more Bloom candidates than the count peel can hold
  kFlagCountBad = 1u << 3,         // count peel met an impossible count
  kFlagCountUnresolved = 1u << 4,  // count peel stopped before every candidate was resolved
  kFlagCountLeftover = 1u << 5,    // counters left non-zero after a complete count peel
  kFlagSupportOverflow = 1u << 6,  // more support keys than the value peel can hold
  kFlagDegreeOverflow = 1u << 7,   // a sketch cell holds more keys than kMaxCellDegree
  kFlagValueBad = 1u << 8,         // value peel states inconsistent (a guard)
  kFlagNonFinite = 1u << 9,        // a sketch cell is NaN/Inf
};

// Peeling control block (device, zeroed by the caller before each peel launch).
struct PeelControl {
  unsigned int barrier[2];  // grid barrier: arrivals, generation
  unsigned int pure[2];     // lengths of the pure-cell queues (round parity)
  unsigned int keys[2];     // lengths of the keys-peeled-this-round lists (round parity)
  unsigned int dirty[2];    // lengths of the touched-cells lists (round parity)
  unsigned int rounds;      // rounds run (diagnostics)
  unsigned int pad;
};

// Multilevel decode state (device, zeroed by the caller before decode; read by the host with the
// DecodeCounters). The index stages set `status` to the CPU backend's DecodeStatus of the first stage
// that fails (and raise DecodeCounters::abort), so the host needs no precedence rules of its own.
struct MlState {
  unsigned long long coarse_sum;   // sum of the coarse digits
  unsigned long long child_total;  // sum of the child digits of the current level's expansion
  unsigned long long nodes;        // non-zero nodes of the current level (exact: may exceed its list)
  unsigned long long prev_nodes;   // non-zero nodes of the level above it
  unsigned long long resolved;     // nodes of the current level resolved by the parallel peel and its pairs
  unsigned long long support;      // non-zero children of the finest level: the support keys (exact)
  unsigned long long candidates;   // the CPU backend's `candidates` (0 until the support is known)
  unsigned int status;             // DecodeStatus of the index: 0 while every stage passed
  unsigned int mode;               // MlMode of the current level
  unsigned int word_flags;         // current level: kMlWordCorrupt / kMlWordOverflow seen in its table
  unsigned int inconsistent;       // current level: the parallel peel met an inconsistency (see below)
  unsigned int expand_bad;         // current expansion: a child count disagrees with its node's
  unsigned int replay_bad;         // current level: the CPU-order replay met a failing step or a bad pair
};

// The host (lossless_hc/backends/cuda.py) allocates and reads these structs by these sizes.
static_assert(sizeof(EncodeCounters) == 16, "EncodeCounters: 16 bytes");
static_assert(sizeof(DecodeCounters) == 64, "DecodeCounters: 64 bytes");
static_assert(sizeof(PeelControl) <= 64, "PeelControl: at most 64 bytes");
static_assert(sizeof(MlState) == 80, "MlState: 80 bytes");

constexpr unsigned int kNotPeeled = 0xffffffffu;
constexpr unsigned int kPairRound = 0xfffffffeu;  // peeled_round of a key solved as part of a pair
constexpr unsigned int kNoCell = 0xffffffffu;
constexpr unsigned int kMaxCellDegree = 255;   // as the CPU backend: a denser cell cannot peel
constexpr int kTileThreads = 256;              // threads of the ordered-compaction kernels
constexpr int kTileRounds = 8;                 // items per thread and tile
constexpr int kTileItems = kTileThreads * kTileRounds;
constexpr int kMaxPerWord = 22;                // base >= 2 and base^per_word <= 2^22

// A segmented table from its table words: seg_len, seg_count, stream, weighted (the value sketch's
// kLwSketchSegLen.., the Bloom table's kLwBloomSegLen..; the launcher passes their address).
__device__ __forceinline__ SegmentedTable load_table(const uint64_t* w) {
  SegmentedTable t;
  t.seg_len = w[0];
  t.seg_count = w[1];
  t.stream = w[2];
  t.weighted = w[3];
  return t;
}

__device__ __forceinline__ CodecLayout load_layout(const uint64_t* w) {
  CodecLayout L;
  L.numel = w[kLwNumel];
  L.num_keys = w[kLwNumKeys];
  L.block = w[kLwBlock];
  L.index_kind = (int32_t)w[kLwIndexKind];
  L.sketch.seg_len = w[kLwSketchSegLen];
  L.sketch.seg_count = w[kLwSketchSegCount];
  L.sketch.stream = w[kLwSketchStream];
  L.sketch.weighted = w[kLwSketchWeighted];
  L.bloom.seg_len = w[kLwBloomSegLen];
  L.bloom.seg_count = w[kLwBloomSegCount];
  L.bloom.stream = w[kLwBloomStream];
  L.bloom.weighted = w[kLwBloomWeighted];
  L.index.base = (uint32_t)w[kLwIndexBase];
  L.index.per_word = (uint32_t)w[kLwIndexPerWord];
  L.index.digits = w[kLwIndexDigits];
  L.digit_cap = (uint32_t)w[kLwDigitCap];
  L.capacity = w[kLwCapacity];
  L.fingerprint = (uint32_t)w[kLwFingerprint];
  L.index_offset = w[kLwIndexOffset];
  L.sketch_offset = w[kLwSketchOffset];
  L.payload_numel = w[kLwPayloadNumel];
  return L;
}

__device__ __forceinline__ uint64_t global_thread() { return (uint64_t)blockIdx.x * blockDim.x + threadIdx.x; }
__device__ __forceinline__ uint64_t grid_threads() { return (uint64_t)gridDim.x * blockDim.x; }

// Loads that bypass L1: data written by other blocks of a persistent kernel since its start.
__device__ __forceinline__ unsigned int load_cg(const unsigned int* p) { return __ldcg(p); }
__device__ __forceinline__ int load_cg(const int* p) { return __ldcg(p); }
__device__ __forceinline__ double load_cg(const double* p) { return __ldcg(p); }

// Grid-wide barrier for a kernel whose blocks are all resident (a cooperative launch). bar[0]
// counts arrivals, bar[1] is the generation; both start at 0. Thread 0 of each block arrives after
// the block's writes (the __syncthreads and the fence make them visible device-wide first) and
// spins until the last arrival bumps the generation.
__device__ __forceinline__ void grid_barrier(unsigned int* bar) {
  __syncthreads();
  if (threadIdx.x == 0) {
    volatile unsigned int* generation = bar + 1;
    const unsigned int g = *generation;
    __threadfence();
    if (atomicAdd(bar, 1u) == gridDim.x - 1) {
      atomicExch(bar, 0u);
      __threadfence();
      atomicAdd(bar + 1, 1u);
    } else {
      while (*generation == g) __nanosleep(64);
    }
    __threadfence();
  }
  __syncthreads();
}

// The start of round r of a round-based peel inside a cooperative kernel: the round's queues by its
// parity, selected without indexing a local array (which would live in local memory), and, by thread
// 0, the next round's queue lengths cleared. Returns the number of this round's pure cells; 0 ends
// the peel, as does a round past `limit` (a guard: each round peels at least one item). With
// `clear_dirty` (the value peel) the next round's touched-cell list is cleared too.
struct PeelRound {
  unsigned int par;
  unsigned int* pure_now;
  unsigned int* pure_next;
  unsigned int* list_now;
};
__device__ __forceinline__ unsigned int begin_round(unsigned int r, uint64_t limit, PeelControl* control,
                                                    unsigned int* pure0, unsigned int* pure1, unsigned int* list0,
                                                    unsigned int* list1, PeelRound* q, bool clear_dirty = false) {
  const volatile PeelControl* vc = control;
  q->par = r & 1u;
  q->pure_now = q->par ? pure1 : pure0;
  q->pure_next = q->par ? pure0 : pure1;
  q->list_now = q->par ? list1 : list0;
  const unsigned int npure = vc->pure[q->par];
  if (npure == 0 || r > limit) return 0;
  if (global_thread() == 0) {
    control->pure[q->par ^ 1u] = 0;
    control->keys[q->par ^ 1u] = 0;
    if (clear_dirty) control->dirty[q->par ^ 1u] = 0;
    control->rounds = r + 1;
  }
  return npure;
}

// Warp-aggregated atomic increment of a 64-bit counter by a per-thread amount.
__device__ __forceinline__ void warp_add(unsigned long long* counter, unsigned int amount) {
  const unsigned int mask = __activemask();
  unsigned int sum = __reduce_add_sync(mask, amount);
  if ((threadIdx.x & 31) == (unsigned)(__ffs(mask) - 1) && sum) atomicAdd(counter, (unsigned long long)sum);
}

// Append `item` to a queue and return its slot; one atomic per warp.
__device__ __forceinline__ void queue_push(unsigned int* queue, unsigned int* length, unsigned int item) {
  const unsigned int mask = __activemask();
  const int lane = threadIdx.x & 31;
  const int leader = __ffs(mask) - 1;
  const unsigned int rank = __popc(mask & ((1u << lane) - 1));
  unsigned int base = 0;
  if (lane == leader) base = atomicAdd(length, (unsigned int)__popc(mask));
  base = __shfl_sync(mask, base, leader);
  queue[base + rank] = item;
}

// Exclusive scan of one value per thread over a block of kTileThreads threads; *total gets the sum.
__device__ __forceinline__ unsigned int block_exclusive_scan(unsigned int v, unsigned int* total) {
  __shared__ unsigned int warp_sums[kTileThreads / 32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  unsigned int x = v;
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    const unsigned int y = __shfl_up_sync(0xffffffffu, x, d);
    if (lane >= d) x += y;
  }
  if (lane == 31) warp_sums[warp] = x;
  __syncthreads();
  if (warp == 0) {
    unsigned int s = lane < kTileThreads / 32 ? warp_sums[lane] : 0;
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
      const unsigned int y = __shfl_up_sync(0xffffffffu, s, d);
      if (lane >= d) s += y;
    }
    if (lane < kTileThreads / 32) warp_sums[lane] = s;  // inclusive
  }
  __syncthreads();
  const unsigned int before = warp == 0 ? 0 : warp_sums[warp - 1];
  *total = warp_sums[kTileThreads / 32 - 1];
  __syncthreads();  // warp_sums is reused by the next call
  return before + x - v;
}

// base^i for i < per_word in shared memory (exact floats: all below 2^22).
__device__ __forceinline__ void load_powers(const DigitPacking& P, float* pw) {
  if (threadIdx.x == 0) {
    uint32_t p = 1;
    for (uint32_t i = 0; i < P.per_word && i < (uint32_t)kMaxPerWord; ++i, p *= P.base) pw[i] = (float)p;
  }
  __syncthreads();
}

// -------------------------------------------------------------------------------------------------
// Multilevel index: shape helpers (csrc/lhc_layout.h ml_node / ml_child, per level)
// -------------------------------------------------------------------------------------------------

// One fine level's shape. Read from the layout words themselves (a dynamic index into global memory):
// a copy of per-level arrays in a struct indexed by a run-time level would live in local memory, and
// would put a stack frame into every kernel that shares code with the multilevel path.
struct MlLevel {
  SegmentedTable table;  // hashed by node id; never weighted: a node adds its pattern times +-1 per cell
  uint64_t span;         // keys under one node
  uint64_t below;        // keys under one child (1 at the finest level)
  uint64_t nodes;        // nodes of the level: ceil(num_keys / span)
  uint64_t children;     // children of one node: digits * words, one pattern digit each
  uint64_t offset;       // payload offset of its table
  uint64_t acc_offset;   // its first word among the fine words of every level (back to back)
  uint32_t digits;       // w: pattern digits per word
  uint32_t words;        // words per cell (one node's pattern)
};

__device__ __forceinline__ uint32_t ml_levels(const uint64_t* w) { return (uint32_t)w[kLwFineLevels]; }

__device__ __forceinline__ MlLevel ml_level(const uint64_t* w, uint32_t l) {
  const uint64_t* f = w + kLwFine0SegLen + kLwFineStride * l;
  MlLevel v;
  v.table.seg_len = f[0];
  v.table.seg_count = f[1];
  v.table.stream = f[2];
  v.table.weighted = 0;  // an index table: never weighted
  v.span = f[3];
  v.digits = (uint32_t)f[4];
  v.words = (uint32_t)f[5];
  v.offset = f[6];
  v.below = l + 1 < ml_levels(w) ? f[kLwFineStride + 3] : 1;
  v.nodes = (w[kLwNumKeys] + v.span - 1) / v.span;
  v.children = (uint64_t)v.digits * v.words;
  v.acc_offset = v.offset - w[kLwFine0Offset];
  return v;
}

// Words of every fine table together (they sit between the coarse words and the value sketch).
__device__ __forceinline__ uint64_t ml_fine_numel(const uint64_t* w) { return w[kLwSketchOffset] - w[kLwFine0Offset]; }

// The multilevel encode's scratch (zeroed by the caller): a bit per key set when the key is non-zero
// (ceil(num_keys / 32) words, rounded up to 8 bytes), ml_fine_numel 64-bit accumulators of the fine
// words (signed sums held in two's complement: unsigned atomic adds wrap exactly as signed ones), then
// a byte per node of every level (levels back to back) set when the node holds a non-zero key.
// Integer accumulation converted once gives the CPU backend's exact words.
__device__ __forceinline__ unsigned int* ml_encode_key_bits(unsigned int* scratch) { return scratch; }
__device__ __forceinline__ uint64_t ml_encode_key_words(const uint64_t* w) { return (w[kLwNumKeys] + 31) / 32; }
__device__ __forceinline__ unsigned long long* ml_encode_acc(const uint64_t* w, unsigned int* scratch) {
  return reinterpret_cast<unsigned long long*>(scratch + (ml_encode_key_words(w) + 1) / 2 * 2);
}
__device__ __forceinline__ unsigned char* ml_encode_flags(const uint64_t* w, unsigned int* scratch) {
  return reinterpret_cast<unsigned char*>(ml_encode_acc(w, scratch) + ml_fine_numel(w));
}

// Add s_j * base^digit (digit = child % w) to word child / w of `node`'s cell j of level `lv`, s_j its
// sign there (+-1: a fine table is never weighted). A node's pattern is the sum of base^digit over its
// non-zero children, so its cell j receives s_j times its pattern.
__device__ __forceinline__ void ml_add_child(const MlLevel& lv, uint64_t node, uint64_t child,
                                             unsigned long long* acc, const float* pw) {
  const unsigned long long power = (unsigned long long)pw[child % lv.digits];  // exact: base^digit < 2^22
  const uint64_t word = child / lv.digits;
  const uint64_t h = key_hash(lv.table, node);
#pragma unroll
  for (int j = 0; j < 3; ++j) {
    int sign;
    const uint64_t c = key_cell(lv.table, h, j, &sign);
    atomicAdd(acc + lv.acc_offset + c * lv.words + word, sign < 0 ? 0ull - power : power);
  }
}

// -------------------------------------------------------------------------------------------------
// Encode
// -------------------------------------------------------------------------------------------------

// Everything a non-zero key contributes except its values: count, index digit(s). `index_scratch`:
// Bloom: the per-cell counters; multilevel: the scratch above, whose key bit is all this sets (the
// index words follow in lhc_ml_encode_keys: inlined here, that work would cost the bitmap and Bloom
// paths of the encode kernels registers).
__device__ __forceinline__ void encode_key_index(const CodecLayout& L, uint32_t key, float* payload,
                                                 unsigned int* index_scratch, const float* pw) {
  if (L.index_kind == kIndexBitmap) {
    const uint32_t per_word = L.index.per_word;
    atomicAdd(payload + L.index_offset + key / per_word, pw[key % per_word]);
  } else if (L.index_kind == kIndexBloom) {
    const uint64_t h = key_hash(L.bloom, key);
    int weight;  // ignored: the Bloom counters add 1
#pragma unroll
    for (int j = 0; j < 3; ++j) atomicAdd(index_scratch + key_cell(L.bloom, h, j, &weight), 1u);
  } else if (L.index_kind == kIndexMultilevel) {
    atomicOr(ml_encode_key_bits(index_scratch) + key / 32, 1u << (key % 32));
  }
}

// block == 1: one pass over x finds the non-zero keys, adds their index digits and scatters their
// weighted values w_j * v into the sketch (exact in float32: w is +-1 or +-2; the CPU backend adds
// the same (float)w * v). -0.0 counts as zero (as on the CPU). Grid-stride over 4-element groups.
extern "C" __global__ void lhc_encode_scan_b1(const uint64_t* layout, const float* x, float* payload,
                                              unsigned int* index_scratch, EncodeCounters* counters) {
  __shared__ float pw[kMaxPerWord];
  const CodecLayout L = load_layout(layout);
  load_powers(L.index, pw);
  const uint64_t n = L.numel;
  const uint32_t* bits = reinterpret_cast<const uint32_t*>(x);
  const bool aligned = (reinterpret_cast<uintptr_t>(x) & 15u) == 0;
  const uint64_t groups = (n + 3) / 4;
  float* sketch = payload + L.sketch_offset;
  unsigned int bad = 0;
  // Counted per thread and added once at the end: an add per loop iteration puts ~10^6 atomics on
  // one address at 1% density, which serialises in L2 and dominated the kernel (2.7 ms of 2.8 ms).
  unsigned int found = 0;
  for (uint64_t g = global_thread(); g < groups; g += grid_threads()) {
    uint32_t u[4];
    const uint64_t i0 = 4 * g;
    if (aligned && i0 + 4 <= n) {
      const uint4 v = __ldcs(reinterpret_cast<const uint4*>(bits) + g);
      u[0] = v.x; u[1] = v.y; u[2] = v.z; u[3] = v.w;
    } else {
#pragma unroll
      for (int e = 0; e < 4; ++e) u[e] = i0 + e < n ? bits[i0 + e] : 0u;
    }
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      bad |= (unsigned int)((u[e] & 0x7f800000u) == 0x7f800000u);
      if (u[e] << 1) {
        ++found;
        const uint32_t key = (uint32_t)(i0 + e);
        encode_key_index(L, key, payload, index_scratch, pw);
        const float value = __uint_as_float(u[e]);
        const uint64_t h = key_hash(L.sketch, key);
#pragma unroll
        for (int j = 0; j < 3; ++j) {
          int weight;
          const uint64_t cell = key_cell(L.sketch, h, j, &weight);
          atomicAdd(sketch + cell, (float)weight * value);
        }
      }
    }
  }
  warp_add(&counters->keys, found);
  if (bad) atomicOr(&counters->non_finite, 1u);
}

// block > 1, pass 1: mark keys holding a non-zero coordinate (key_flag zeroed by the caller; every
// writer stores the same 1, so the race is benign), and detect NaN/Inf.
extern "C" __global__ void lhc_encode_flag_blocks(const uint64_t* layout, const float* x, unsigned int* key_flag,
                                                  EncodeCounters* counters) {
  const CodecLayout L = load_layout(layout);
  const uint32_t* bits = reinterpret_cast<const uint32_t*>(x);
  unsigned int bad = 0;
  for (uint64_t i = global_thread(); i < L.numel; i += grid_threads()) {
    const uint32_t u = __ldcs(bits + i);
    bad |= (unsigned int)((u & 0x7f800000u) == 0x7f800000u);
    if (u << 1) key_flag[i / L.block] = 1u;
  }
  if (bad) atomicOr(&counters->non_finite, 1u);
}

// block > 1, pass 2: count the flagged keys and add their index digits.
extern "C" __global__ void lhc_encode_keys(const uint64_t* layout, const unsigned int* key_flag, float* payload,
                                           unsigned int* index_scratch, EncodeCounters* counters) {
  __shared__ float pw[kMaxPerWord];
  const CodecLayout L = load_layout(layout);
  load_powers(L.index, pw);
  unsigned int found = 0;  // one counter atomic per warp, as in lhc_encode_scan_b1
  for (uint64_t k = global_thread(); k < L.num_keys; k += grid_threads()) {
    const unsigned int on = key_flag[k];
    if (on) encode_key_index(L, (uint32_t)k, payload, index_scratch, pw);
    found += on;
  }
  warp_add(&counters->keys, found);
}

// block > 1, pass 3: scatter every coordinate of a flagged key, times the cell's weight, into its
// three cells.
extern "C" __global__ void lhc_encode_scatter_blocks(const uint64_t* layout, const float* x,
                                                     const unsigned int* key_flag, float* payload) {
  const CodecLayout L = load_layout(layout);
  float* sketch = payload + L.sketch_offset;
  for (uint64_t i = global_thread(); i < L.numel; i += grid_threads()) {
    const uint64_t key = i / L.block;
    if (!key_flag[key]) continue;
    const float value = x[i];
    const uint64_t lane = i - key * L.block;
    const uint64_t h = key_hash(L.sketch, key);
#pragma unroll
    for (int j = 0; j < 3; ++j) {
      int weight;
      const uint64_t cell = key_cell(L.sketch, h, j, &weight);
      atomicAdd(sketch + cell * L.block + lane, (float)weight * value);
    }
  }
}

// Bloom index: pack the per-rank counters (capped at digit_cap, saturation flagged) into words,
// summing the digits in increasing order as the CPU backend does (exact: all below 2^22).
extern "C" __global__ void lhc_encode_bloom_pack(const uint64_t* layout, const unsigned int* bloom_count,
                                                 float* payload, EncodeCounters* counters) {
  __shared__ float pw[kMaxPerWord];
  const CodecLayout L = load_layout(layout);
  load_powers(L.index, pw);
  const uint64_t cells = L.bloom.cells(), words = L.index.words();
  unsigned int saturated = 0;
  for (uint64_t w = global_thread(); w < words; w += grid_threads()) {
    float acc = 0.0f;
    for (uint32_t d = 0; d < L.index.per_word; ++d) {
      const uint64_t c = w * L.index.per_word + d;
      if (c >= cells) break;
      uint32_t v = bloom_count[c];
      if (v > L.digit_cap) { v = L.digit_cap; saturated = 1; }
      acc += (float)v * pw[d];
    }
    payload[L.index_offset + w] = acc;
  }
  if (saturated) atomicOr(&counters->saturated, 1u);
}

// Multilevel index, after the keys were flagged (lhc_encode_scan_b1 / lhc_encode_keys): each non-zero
// key flags its node at every level (every writer stores the same 1: a benign race) and, a child of
// its finest node, adds its digit to that node's three cells (keys are distinct children: no dedup).
extern "C" __global__ void lhc_ml_encode_keys(const uint64_t* layout, unsigned int* index_scratch) {
  __shared__ float pw[kMaxPerWord];
  const CodecLayout L = load_layout(layout);
  load_powers(L.index, pw);
  const uint32_t levels = ml_levels(layout);
  if (levels < 1 || levels > kMaxFineLevels) return;  // a layout guard (uniform)
  const unsigned int* keys = ml_encode_key_bits(index_scratch);
  unsigned char* flags = ml_encode_flags(layout, index_scratch);
  unsigned long long* acc = ml_encode_acc(layout, index_scratch);
  const MlLevel finest = ml_level(layout, levels - 1);
  for (uint64_t word = global_thread(); word < ml_encode_key_words(layout); word += grid_threads()) {
    for (unsigned int bits = keys[word]; bits; bits &= bits - 1) {
      const uint64_t key = word * 32 + (uint64_t)(__ffs(bits) - 1);
      uint64_t first = 0;
      for (uint32_t l = 0; l < levels; ++l) {
        const uint64_t span = layout[kLwFine0Span + kLwFineStride * l];
        flags[first + key / span] = 1;
        first += (L.num_keys + span - 1) / span;
      }
      ml_add_child(finest, key / finest.span, key % finest.span, acc, pw);
    }
  }
}

// Multilevel index, after lhc_ml_encode_keys: every flagged node of every level, in one grid-stride
// pass over the flag bytes. A node of level 0 adds its coarse
// digit (1 at its position: exact float adds, the word stays below 2^22); a node of level l >= 1 is a
// child of a node of level l - 1 and adds its digit to that parent's three cells. Each node is
// flagged once however many keys it holds, as the CPU backend counts each child once.
extern "C" __global__ void lhc_ml_encode_nodes(const uint64_t* layout, unsigned int* index_scratch, float* payload) {
  __shared__ float pw[kMaxPerWord];
  const CodecLayout L = load_layout(layout);
  load_powers(L.index, pw);
  const uint32_t levels = ml_levels(layout);
  if (levels < 1 || levels > kMaxFineLevels) return;  // a layout guard (uniform)
  const unsigned char* flags = ml_encode_flags(layout, index_scratch);
  unsigned long long* acc = ml_encode_acc(layout, index_scratch);
  uint64_t total = 0;
  for (uint32_t l = 0; l < levels; ++l) total += ml_level(layout, l).nodes;
  const uint32_t per_word = L.index.per_word;
  for (uint64_t i = global_thread(); i < total; i += grid_threads()) {
    if (!flags[i]) continue;
    uint32_t l = 0;
    uint64_t node = i;
    for (uint64_t n = ml_level(layout, 0).nodes; node >= n; n = ml_level(layout, l).nodes) {
      node -= n;
      ++l;
    }
    if (l == 0) {
      atomicAdd(payload + L.index_offset + node / per_word, pw[node % per_word]);
    } else {
      const MlLevel parent = ml_level(layout, l - 1);
      ml_add_child(parent, node / parent.children, node % parent.children, acc, pw);
    }
  }
}

// Multilevel index: the fine words from their exact signed integer sums (one rounding-free conversion
// each, as the CPU backend converts its accumulators: |word| < 2^22 by the layout's sizing).
extern "C" __global__ void lhc_ml_encode_pack(const uint64_t* layout, unsigned int* index_scratch, float* payload) {
  const uint32_t levels = ml_levels(layout);
  if (levels < 1 || levels > kMaxFineLevels) return;
  const unsigned long long* acc = ml_encode_acc(layout, index_scratch);
  float* fine = payload + layout[kLwFine0Offset];
  const uint64_t n = ml_fine_numel(layout);
  for (uint64_t i = global_thread(); i < n; i += grid_threads()) fine[i] = (float)(long long)acc[i];
}

// The header fields of this rank (one thread), as lhc::cpu::encode writes them.
extern "C" __global__ void lhc_encode_header(const uint64_t* layout, float* payload, const EncodeCounters* counters) {
  if (global_thread() != 0) return;
  const CodecLayout L = load_layout(layout);
  const uint64_t keys = counters->keys;
  payload[kHdrContributors] = 1.0f;
  payload[kHdrFingerprintLo] = (float)(L.fingerprint & ((1u << kChunkBits) - 1));
  payload[kHdrFingerprintHi] = (float)(L.fingerprint >> kChunkBits);
  write_chunks(payload, kHdrKeysLo, keys);
  payload[kHdrOverloaded] = keys > L.capacity ? 1.0f : 0.0f;
  payload[kHdrNonFinite] = (float)counters->non_finite;
  payload[kHdrSaturated] = (float)counters->saturated;
}

// -------------------------------------------------------------------------------------------------
// Decode: index
// -------------------------------------------------------------------------------------------------

// An index word as an exact integer in [0, limit), or -1 (the CPU backend's read_word): a summed
// word must be an integer, an averaged one (scale != 1) is within 1/2 of one.
__device__ __forceinline__ long long read_word(float f, double scale, long long limit) {
  const double v = (double)f * scale;
  if (!(v > -0.5 && v < (double)limit)) return -1;
  const double r = rint(v);
  const double tolerance = scale == 1.0 ? 0.0 : 0.5;
  if (fabs(v - r) > tolerance || r < 0.0 || r >= (double)limit) return -1;
  return (long long)r;
}

__device__ __forceinline__ long long digit_limit(const DigitPacking& P) {
  long long limit = 1;
  for (uint32_t i = 0; i < P.per_word; ++i) limit *= P.base;
  return limit;
}

// Counting-bitmap word w (the bitmap index, or the multilevel index's coarse level): the non-zero
// digits' count, and (when `out` is given) their positions written to out[at], out[at + 1], ... below
// out[cap], with their digits in counts[...] when `counts` is given. Flags invalid words and digits
// (a digit above world_size, a non-zero digit at a position past `positions`).
struct BitmapWord {
  const CodecLayout* L;
  const float* index;
  double scale;
  long long limit;
  uint64_t world_size;
  uint64_t positions;  // digits that may be non-zero: num_keys (bitmap), the level-0 nodes (multilevel)
  __device__ __forceinline__ unsigned int visit(uint64_t w, uint32_t* out, uint32_t* counts, unsigned long long at,
                                                uint64_t cap, unsigned long long* digit_sum, bool* bad) const {
    const float f = index[w];
    if (__float_as_uint(f) == 0u) return 0;
    const long long u = read_word(f, scale, limit);
    if (u < 0) { *bad = true; return 0; }
    unsigned long long rest = (unsigned long long)u;
    unsigned int count = 0;
    const uint32_t base = L->index.base;
    for (uint32_t i = 0; i < L->index.per_word && rest; ++i) {
      const uint32_t digit = (uint32_t)(rest % base);
      rest /= base;
      if (!digit) continue;
      const uint64_t pos = w * L->index.per_word + i;
      if (pos >= positions || digit > world_size) { *bad = true; continue; }
      if (out && at + count < cap) {
        out[at + count] = (uint32_t)pos;
        if (counts) counts[at + count] = digit;
      }
      ++count;
      *digit_sum += digit;
    }
    return count;
  }
};

// Ordered compaction, step 1: items [tile * kTileItems, ...) of `count_of` summed into tile_sum[tile].
template <typename CountOf>
__device__ __forceinline__ void tile_count(uint64_t items, unsigned long long* tile_sum, CountOf count_of) {
  __shared__ unsigned int block_total;
  const uint64_t tile = blockIdx.x;
  const uint64_t first = tile * (uint64_t)kTileItems;
  unsigned int mine = 0;
  for (int r = 0; r < kTileRounds; ++r) {
    const uint64_t i = first + (uint64_t)r * kTileThreads + threadIdx.x;
    if (i < items) mine += count_of(i);
  }
  if (threadIdx.x == 0) block_total = 0;
  __syncthreads();
  const unsigned int warp_sum = __reduce_add_sync(0xffffffffu, mine);
  if ((threadIdx.x & 31) == 0) atomicAdd(&block_total, warp_sum);
  __syncthreads();
  if (threadIdx.x == 0) tile_sum[tile] = block_total;
}

// Ordered compaction, step 3: item i of tile t writes its count_of(i) outputs at
// tile_offset[t] + (outputs of the earlier items of the tile), in increasing item order.
template <typename CountOf, typename Emit>
__device__ __forceinline__ void tile_emit(uint64_t items, const unsigned long long* tile_offset, CountOf count_of,
                                          Emit emit) {
  const uint64_t tile = blockIdx.x;
  const uint64_t first = tile * (uint64_t)kTileItems;
  unsigned long long running = tile_offset[tile];
  for (int r = 0; r < kTileRounds; ++r) {
    const uint64_t i = first + (uint64_t)r * kTileThreads + threadIdx.x;
    const unsigned int c = i < items ? count_of(i) : 0u;
    unsigned int total;
    const unsigned int before = block_exclusive_scan(c, &total);
    if (c) emit(i, running + before);
    running += total;
  }
}

// Step 2 (one block of 1024 threads): exclusive scan of tile_sum in place (tile offsets); the total
// goes to counters->list_count (clamped to `cap`, with `overflow_flag` and abort raised above it).
// With `check_total` the index-total check runs first (the first scan after unpacking the index).
extern "C" __global__ void lhc_scan_tiles(unsigned long long* tile_sum, uint64_t tiles, uint64_t cap,
                                          uint64_t overflow_flag, DecodeCounters* counters, uint64_t check_total) {
  __shared__ unsigned long long carry_in;
  __shared__ unsigned long long warp_sums[32];
  if (threadIdx.x == 0) carry_in = 0;
  __syncthreads();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  for (uint64_t start = 0; start < tiles; start += blockDim.x) {
    const uint64_t i = start + threadIdx.x;
    const unsigned long long v = i < tiles ? tile_sum[i] : 0ull;
    unsigned long long x = v;
    for (int d = 1; d < 32; d <<= 1) {
      const unsigned long long y = __shfl_up_sync(0xffffffffu, x, d);
      if (lane >= d) x += y;
    }
    if (lane == 31) warp_sums[warp] = x;
    __syncthreads();
    if (warp == 0) {
      unsigned long long s = lane < warps ? warp_sums[lane] : 0ull;
      for (int d = 1; d < 32; d <<= 1) {
        const unsigned long long y = __shfl_up_sync(0xffffffffu, s, d);
        if (lane >= d) s += y;
      }
      if (lane < warps) warp_sums[lane] = s;
    }
    __syncthreads();
    const unsigned long long before = (warp == 0 ? 0ull : warp_sums[warp - 1]) + carry_in;
    if (i < tiles) tile_sum[i] = before + x - v;
    __syncthreads();
    if (threadIdx.x == 0) carry_in += warp_sums[warps - 1];
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    const unsigned long long total = carry_in;
    if (check_total && counters->index_total != counters->expected_total) {
      atomicOr(&counters->flags, (unsigned int)kFlagIndexTotal);
      counters->abort = 1;
    }
    if (counters->flags & kFlagIndexWord) counters->abort = 1;
    if (total > cap) {
      atomicOr(&counters->flags, (unsigned int)overflow_flag);
      counters->abort = 1;
    }
    counters->list_count = total < cap ? total : cap;
  }
}

// What the header says the index digits sum to: the summed key count (times 3 for Bloom). Fields
// that are not integers give a value no index can match (the host rejects such a header anyway).
__device__ __forceinline__ unsigned long long header_index_total(const CodecLayout& L, const float* payload,
                                                                 double scale) {
  unsigned long long keys = 0;
  for (int f = 0; f < 3; ++f) {
    const long long chunk = read_word(payload[kHdrKeysLo + f], scale, 1ll << 40);
    if (chunk < 0) return ~0ull;
    keys += (unsigned long long)chunk << (kChunkBits * f);
  }
  return L.index_kind == kIndexBloom ? 3ull * keys : keys;
}

// The two passes over a counting bitmap of `positions` digits: the bitmap index (a digit per key)
// and the multilevel index's coarse level (a digit per level-0 node) share them.
// Pass 1: count each tile's non-zero digits, validate the words, add the digits' sum to *digit_total.
__device__ inline void count_bitmap_tiles(const CodecLayout& L, const float* payload, double scale,
                                          uint64_t world_size, uint64_t positions, unsigned long long* tile_sum,
                                          unsigned long long* digit_total, DecodeCounters* counters) {
  const BitmapWord word{&L, payload + L.index_offset, scale, digit_limit(L.index), world_size, positions};
  unsigned long long digit_sum = 0;
  bool bad = false;
  tile_count(L.index.words(), tile_sum,
             [&](uint64_t w) { return word.visit(w, nullptr, nullptr, 0, 0, &digit_sum, &bad); });
  if (digit_sum) atomicAdd(digit_total, digit_sum);
  if (bad) atomicOr(&counters->flags, (unsigned int)kFlagIndexWord);
  if (global_thread() == 0) counters->expected_total = header_index_total(L, payload, scale);
}

// Pass 2 (after the scan of the tile counts): the non-zero positions in increasing order into
// out[0, cap), and their digits into counts[0, cap) when counts is not null.
__device__ inline void write_bitmap_tiles(const CodecLayout& L, const float* payload, double scale,
                                          uint64_t world_size, uint64_t positions,
                                          const unsigned long long* tile_offset, uint32_t* out, uint32_t* counts,
                                          uint64_t cap) {
  const BitmapWord word{&L, payload + L.index_offset, scale, digit_limit(L.index), world_size, positions};
  unsigned long long ignored = 0;
  bool bad = false;
  tile_emit(
      L.index.words(), tile_offset,
      [&](uint64_t w) { return word.visit(w, nullptr, nullptr, 0, 0, &ignored, &bad); },
      [&](uint64_t w, unsigned long long at) { word.visit(w, out, counts, at, cap, &ignored, &bad); });
}

// Bitmap decode, step 1: count each tile's support keys, validate words, sum the digits.
extern "C" __global__ void lhc_bitmap_count(const uint64_t* layout, const float* payload, double scale,
                                            uint64_t world_size, unsigned long long* tile_sum,
                                            DecodeCounters* counters) {
  const CodecLayout L = load_layout(layout);
  count_bitmap_tiles(L, payload, scale, world_size, L.num_keys, tile_sum, &counters->index_total, counters);
}

// Bitmap decode, step 3: write the support keys in increasing order (keys[0, cap)).
extern "C" __global__ void lhc_bitmap_write(const uint64_t* layout, const float* payload, double scale,
                                            uint64_t world_size, const unsigned long long* tile_offset,
                                            uint32_t* keys, uint64_t cap, const DecodeCounters* counters) {
  if (counters->abort) return;
  const CodecLayout L = load_layout(layout);
  write_bitmap_tiles(L, payload, scale, world_size, L.num_keys, tile_offset, keys, nullptr, cap);
}

// Bloom decode, step 1: unpack every word into the aggregated counters (bcount, bloom cells).
extern "C" __global__ void lhc_bloom_unpack(const uint64_t* layout, const float* payload, double scale,
                                            uint64_t world_size, int* bcount, DecodeCounters* counters) {
  const CodecLayout L = load_layout(layout);
  const float* index = payload + L.index_offset;
  const long long limit = digit_limit(L.index);
  const uint64_t cells = L.bloom.cells(), words = L.index.words();
  const uint64_t digit_max = world_size * (uint64_t)L.digit_cap;
  unsigned long long digit_sum = 0;
  bool bad = false;
  for (uint64_t w = global_thread(); w < words; w += grid_threads()) {
    const float f = index[w];
    if (__float_as_uint(f) == 0u) continue;  // cells start at 0 (zeroed by the caller)
    const long long u = read_word(f, scale, limit);
    if (u < 0) { bad = true; continue; }
    unsigned long long rest = (unsigned long long)u;
    for (uint32_t i = 0; i < L.index.per_word && rest; ++i) {
      const uint32_t digit = (uint32_t)(rest % L.index.base);
      rest /= L.index.base;
      if (!digit) continue;
      const uint64_t pos = w * L.index.per_word + i;
      if (pos >= cells || digit > digit_max) { bad = true; continue; }
      bcount[pos] = (int)digit;
      digit_sum += digit;
    }
  }
  if (digit_sum) atomicAdd(&counters->index_total, digit_sum);
  if (bad) atomicOr(&counters->flags, (unsigned int)kFlagIndexWord);
  if (global_thread() == 0) counters->expected_total = header_index_total(L, payload, scale);
}

// Bloom candidates: keys whose three counters are non-zero (a superset of the aggregate support).
__device__ __forceinline__ unsigned int bloom_candidate(const CodecLayout& L, const int* bcount, uint64_t key) {
  const uint64_t h = key_hash(L.bloom, key);
  int weight;  // ignored (an index table)
  return bcount[key_cell(L.bloom, h, 0, &weight)] && bcount[key_cell(L.bloom, h, 1, &weight)] &&
         bcount[key_cell(L.bloom, h, 2, &weight)];
}

extern "C" __global__ void lhc_bloom_cand_count(const uint64_t* layout, const int* bcount,
                                                unsigned long long* tile_sum) {
  const CodecLayout L = load_layout(layout);
  tile_count(L.num_keys, tile_sum, [&](uint64_t k) { return bloom_candidate(L, bcount, k); });
}

extern "C" __global__ void lhc_bloom_cand_write(const uint64_t* layout, const int* bcount,
                                                const unsigned long long* tile_offset, uint32_t* cand, uint64_t cap,
                                                DecodeCounters* counters) {
  if (global_thread() == 0) counters->candidates = counters->list_count;
  if (counters->abort) return;
  const CodecLayout L = load_layout(layout);
  tile_emit(
      L.num_keys, tile_offset, [&](uint64_t k) { return bloom_candidate(L, bcount, k); },
      [&](uint64_t k, unsigned long long at) {
        if (at < cap) cand[at] = (uint32_t)k;
      });
}

// -------------------------------------------------------------------------------------------------
// Decode: peeling states
// -------------------------------------------------------------------------------------------------

// The length of the key list a compaction produced (the last scan's clamped total).
__device__ __forceinline__ uint32_t list_length(const DecodeCounters* counters) {
  return (uint32_t)counters->list_count;
}

// Per-cell states of a key list: deg[c] keys and, with `with_xor`, xr[c] = XOR of their positions
// (zeroed by the caller; the value peel derives xr from its sorted adjacency instead, saving one
// atomic per key and cell). Integer atomics commute: the states do not depend on the order. A cell
// past kMaxCellDegree raises `degree_flag` (the value peel cannot succeed; the CPU backend gives up
// too).
extern "C" __global__ void lhc_build_states(const uint64_t* table_words, const uint32_t* keys, unsigned int* deg,
                                            unsigned int* xr, DecodeCounters* counters, uint64_t degree_flag,
                                            uint64_t with_xor) {
  if (counters->abort) return;
  const SegmentedTable t = load_table(table_words);
  const uint32_t n = list_length(counters);
  bool over = false;
  for (uint64_t p = global_thread(); p < n; p += grid_threads()) {
    const uint64_t h = key_hash(t, keys[p]);
#pragma unroll
    for (int j = 0; j < 3; ++j) {
      int weight;  // not needed: states count keys
      const uint64_t c = key_cell(t, h, j, &weight);
      over |= atomicAdd(deg + c, 1u) >= kMaxCellDegree;
      if (with_xor) atomicXor(xr + c, (unsigned int)p);
    }
  }
  if (over && degree_flag) atomicOr(&counters->flags, (unsigned int)degree_flag);
}

// Cells holding exactly one key: the first pure-cell queue of a peel.
extern "C" __global__ void lhc_seed_pure(const unsigned int* deg, uint64_t cells, unsigned int* queue,
                                         PeelControl* control, const DecodeCounters* counters) {
  if (counters->abort) return;
  for (uint64_t c = global_thread(); c < cells; c += grid_threads())
    if (deg[c] == 1u) queue_push(queue, &control->pure[0], (unsigned int)c);
}

// Which of its three cells a key was proposed from (-1 if none: inconsistent states).
__device__ __forceinline__ int cell_slot(const SegmentedTable& t, uint64_t key, uint64_t cell, uint64_t cells[3],
                                         int weights[3]) {
  key_cells(t, key, cells, weights);
  return cells[0] == cell ? 0 : cells[1] == cell ? 1 : cells[2] == cell ? 2 : -1;
}

// Phase A of a round: every pure cell proposes its key; the key keeps the smallest proposing cell,
// and the first proposal lists the key for phase B. The result is a function of the set of pure
// cells, not of the order in which threads run.
__device__ __forceinline__ void propose(const SegmentedTable& t, const uint32_t* keys, uint32_t nkeys,
                                        const unsigned int* deg, const unsigned int* xr,
                                        const unsigned int* peeled_round, unsigned int* src,
                                        const unsigned int* pure, unsigned int npure, unsigned int* list,
                                        unsigned int* list_len, bool* bad) {
  for (uint64_t i = global_thread(); i < npure; i += grid_threads()) {
    const unsigned int c = load_cg(pure + i);
    if (load_cg(deg + c) != 1u) continue;
    const unsigned int p = load_cg(xr + c);
    if (p >= nkeys || load_cg(peeled_round + p) != kNotPeeled) { *bad = true; continue; }
    uint64_t cells[3];
    int weights[3];
    if (cell_slot(t, keys[p], c, cells, weights) < 0) { *bad = true; continue; }
    if (atomicMin(src + p, c) == kNoCell) queue_push(list, list_len, p);
  }
}

// The Bloom counters' exact peel: counts[c] holds the sum over candidates in c of their aggregated
// counts; peeling gives every candidate its count (false positives get 0). Integer atomics commute,
// so two phases per round suffice: A) propose, B) resolve and subtract the count from the key's
// three cells, queueing cells left with one key. Launched cooperatively (all blocks resident).
extern "C" __global__ void lhc_peel_counts(const uint64_t* table_words, const uint32_t* keys, int* counts,
                                           unsigned int* deg, unsigned int* xr, unsigned int* src,
                                           unsigned int* peeled_round, int* key_count, unsigned int* pure0,
                                           unsigned int* pure1, unsigned int* list0, unsigned int* list1,
                                           PeelControl* control, DecodeCounters* counters, uint64_t world_size) {
  if (*(volatile unsigned int*)&counters->abort) return;  // uniform: set before this launch
  const SegmentedTable t = load_table(table_words);
  const uint32_t nkeys = (uint32_t)counters->candidates;
  volatile PeelControl* vc = control;
  bool bad = false;
  for (unsigned int r = 0;; ++r) {
    PeelRound q;
    const unsigned int npure = begin_round(r, nkeys, control, pure0, pure1, list0, list1, &q);
    if (npure == 0) break;
    const unsigned int par = q.par;
    unsigned int* const pure_now = q.pure_now;
    unsigned int* const pure_next = q.pure_next;
    unsigned int* const list_now = q.list_now;
    propose(t, keys, nkeys, deg, xr, peeled_round, src, pure_now, npure, list_now, &control->keys[par], &bad);
    grid_barrier(control->barrier);
    const unsigned int nlist = vc->keys[par];
    for (uint64_t i = global_thread(); i < nlist; i += grid_threads()) {
      const unsigned int p = load_cg(list_now + i);
      const unsigned int c = load_cg(src + p);
      const int count = load_cg(counts + c);
      if (count < 0 || (uint64_t)count > world_size) bad = true;
      key_count[p] = count;
      peeled_round[p] = r;
      uint64_t cells[3];
      int weights[3];  // ignored: the counters add counts
      key_cells(t, keys[p], cells, weights);
#pragma unroll
      for (int j = 0; j < 3; ++j) {
        atomicSub(counts + cells[j], count);
        atomicXor(xr + cells[j], p);
        if (atomicSub(deg + cells[j], 1u) == 2u) queue_push(pure_next, &control->pure[par ^ 1u], (unsigned)cells[j]);
      }
    }
    grid_barrier(control->barrier);
  }
  if (bad) atomicOr(&counters->flags, (unsigned int)kFlagCountBad);
}

// After the count peel: every candidate resolved, every counter back to 0, and the found keys
// (count >= 1) counted per tile for their ordered compaction.
extern "C" __global__ void lhc_count_check(const int* counts, uint64_t cells, const unsigned int* peeled_round,
                                           DecodeCounters* counters) {
  if (counters->abort) return;
  const uint32_t n = (uint32_t)counters->candidates;
  unsigned int resolved = 0;
  bool leftover = false;
  for (uint64_t p = global_thread(); p < n; p += grid_threads()) resolved += peeled_round[p] != kNotPeeled;
  for (uint64_t c = global_thread(); c < cells; c += grid_threads()) leftover |= counts[c] != 0;
  warp_add(&counters->count_resolved, resolved);
  if (leftover) atomicOr(&counters->flags, (unsigned int)kFlagCountLeftover);
}

// Sets abort after the count peel if it failed (one thread; runs after lhc_count_check).
extern "C" __global__ void lhc_count_verdict(DecodeCounters* counters) {
  if (global_thread() != 0 || counters->abort) return;
  if (counters->count_resolved != counters->candidates) counters->flags |= kFlagCountUnresolved;
  if (counters->flags & (kFlagCountBad | kFlagCountUnresolved | kFlagCountLeftover)) counters->abort = 1;
}

extern "C" __global__ void lhc_found_count(const int* key_count, unsigned long long* tile_sum,
                                           const DecodeCounters* counters) {
  const uint32_t n = (uint32_t)counters->candidates;
  tile_count(n, tile_sum, [&](uint64_t p) { return (unsigned int)(key_count[p] >= 1); });
}

extern "C" __global__ void lhc_found_write(const uint32_t* cand, const int* key_count,
                                           const unsigned long long* tile_offset, uint32_t* keys, uint64_t cap,
                                           DecodeCounters* counters) {
  if (counters->abort) return;
  const uint32_t n = (uint32_t)counters->candidates;
  tile_emit(
      n, tile_offset, [&](uint64_t p) { return (unsigned int)(key_count[p] >= 1); },
      [&](uint64_t p, unsigned long long at) {
        if (at < cap) keys[at] = cand[p];
      });
}

// -------------------------------------------------------------------------------------------------
// Decode: multilevel index
// -------------------------------------------------------------------------------------------------
//
// The CPU backend's multilevel_support (csrc/cpu/codec_cpu.cpp), stage by stage, with its statuses and
// their precedence (the first failing stage decides; MlState::status records it):
//  1. Coarse (lhc_ml_coarse_count / _write): the non-zero nodes of level 0, increasing, with their
//     counts, by the bitmap index's ordered compaction. A word that is no packed integer, a digit
//     above world_size or past the last node, or digits summing past the header's key count: corrupt.
//  2. Each fine level, coarsest first (two cooperative launches: lhc_ml_peel_level, a and the rounds of
//     b; lhc_ml_settle_level, the pairs of b, then c and d). Node v adds s_j(v) * pattern(v) into its
//     cell j (s_j = +-1, the fine table's key_cell sign), so cell words are signed:
//     a. every word of the table as an exact integer (lhc_layout.h read_fine_word): a corrupt word anywhere gives
//        corrupt, else a word of magnitude 2^22 or more gives overflow -- the CPU's whole-table word status;
//     b. a round-based exact integer peel over the level's known non-zero nodes: pure cells propose
//        their node (the smallest cell wins, as in the value peel); each peeled node reads its pattern
//        from that cell (s_j times the cell) and subtracts s_i times it from its cells i with integer
//        atomics (sums commute, so the states after a round do not depend on thread order); then the
//        two-node stopping sets left are solved (the pairs: two nodes sharing all three cells, nothing
//        else left in them, from two cells by lhc::pair_cells, checked against the third; proportional
//        signs, det == 0, stay unresolved), each by the thread of its smaller node;
//     c. the verdict. Peeling and the pairs reach the same nodes whatever the order (the 2-core of the
//        hypergraph is order-free, and its two-node components with it), and when they finish without
//        meeting an inconsistency (a pattern word outside [0, base^w), a pair that is no pair of
//        patterns, a word left in a cell with no node) the patterns are the unique consistent ones,
//        the CPU's included. So: every node resolved and consistent -> ok; resolved but inconsistent ->
//        corrupt (the CPU ends in a bad step, a bad pair or leftover words, all corrupt); stalled and
//        consistent -> peel failed (the CPU reads the same patterns in its order, so it meets no bad
//        step, and its pairs see the same cells). Only a stall together with an inconsistency leaves
//        the CPU's answer (corrupt if some group meets a bad step or a bad pair in the CPU's own
//        order, else peel failed) to its exact peeling order:
//     d. then the CPU's order is replayed (ml_replay_group): one thread per group, breadth-first from
//        a queue seeded with the group's pure cells in increasing order, as lhc::cpu::peel does. Its
//        cell states XOR node ids, not list positions, so they are built straight from the level's
//        source (coarse words or the parents' patterns). Then, if no group met a bad step, the pairs
//        left by that order are checked in parallel (their order cannot change a verdict: they are
//        disjoint).
//     A level with more non-zero nodes than cells (a stall in any order; its list would overflow) is
//     peeled the same parallel way by node id, with a claim bit per node instead of a list, and its
//     pairs found by streaming its nodes from their source, for the inconsistency check alone; it is
//     then peel failed, or replayed.
//     Corrupt payloads that stall are the only ones that take the sequential path.
//  3. Expansion (lhc_ml_expand_count / _write): each node's pattern digits are its children's counts;
//     the non-zero ones, in increasing order, are the next level's nodes (at the finest level: the
//     support keys, handed to the value peel). A child count above its node's count, a non-zero child
//     past the last, counts summing below the node's count, or children summing past the header's key
//     count: corrupt; at the finest level, children not summing to the header's key count: corrupt.
//
// Every buffer is planned from the layout: level l's node list holds min(nodes of the level, cells of
// its table) entries (a level with more non-zero nodes stalls, and is peeled by node id instead), so
// any payload decodes within bounds.

// DecodeStatus codes of the CPU backend (csrc/cpu/codec_cpu.h) that the multilevel stages report.
constexpr unsigned int kMlCorrupt = 1;     // kDecodeIndexCorrupt
constexpr unsigned int kMlPeelFailed = 2;  // kDecodeIndexPeelFailed
constexpr unsigned int kMlOverflow = 5;    // kDecodeIndexOverflow

// MlState::mode of the current level.
enum MlMode : unsigned int {
  kMlList = 0,      // its non-zero nodes fit their list: peel in parallel
  kMlTooMany = 1,   // more non-zero nodes than its table has cells (it stalls): peel by node id, no list
  kMlReplay = 2,    // set by the level's verdict: a stalled peel met an inconsistency; the replay decides
};

// read_fine_word's results (lhc_layout.h), as bits of MlState::word_flags.
constexpr unsigned int kMlWordCorrupt = kFineWordCorrupt;
constexpr unsigned int kMlWordOverflow = kFineWordOverflow;
static_assert((kMlWordCorrupt & kMlWordOverflow) == 0, "word flags are distinct bits");

__device__ __forceinline__ long long load_cg(const long long* p) { return __ldcg(p); }

// base^w: the bound of a pattern word of a level (w digits of base n + 1).
__device__ __forceinline__ long long ml_word_limit(const CodecLayout& L, const MlLevel& lv) {
  long long limit = 1;
  for (uint32_t i = 0; i < lv.digits && i < (uint32_t)kMaxPerWord; ++i) limit *= L.index.base;
  return limit;
}

// The non-zero children of node position p of level `lv` (pattern words pattern[p * words, ...)):
// their number, and when `out` is given their ids written to out[at], ... below out[cap] (digits to
// out_counts when given). Adds the digits to *sum; sets *bad where the CPU's expand_children rejects
// the node: a digit above the node's count, a non-zero digit past the last child, a word at or above
// base^w, or digits summing below the node's count.
__device__ __forceinline__ unsigned int ml_node_children(const CodecLayout& L, const MlLevel& lv, const uint32_t* nodes,
                                                         const uint32_t* counts, const uint32_t* pattern, uint64_t p,
                                                         uint32_t* out, uint32_t* out_counts, unsigned long long at,
                                                         uint64_t cap, unsigned long long* sum, bool* bad) {
  const uint32_t base = L.index.base, w = lv.digits, wpg = lv.words;
  const uint64_t child_limit = (L.num_keys + lv.below - 1) / lv.below;
  const uint64_t first = (uint64_t)nodes[p] * lv.children;
  const uint32_t node_count = counts[p];
  unsigned long long node_sum = 0;
  unsigned int found = 0;
  for (uint32_t i = 0; i < wpg; ++i) {
    uint32_t u = pattern[p * wpg + i];
    for (uint32_t j = 0; j < w && u; ++j) {
      const uint32_t digit = u % base;
      u /= base;
      if (!digit) continue;
      const uint64_t child = first + (uint64_t)i * w + j;
      if (digit > node_count || child >= child_limit) *bad = true;
      node_sum += digit;
      if (out && at + found < cap) {
        out[at + found] = (uint32_t)child;
        if (out_counts) out_counts[at + found] = digit;
      }
      ++found;
    }
    if (u) *bad = true;
  }
  if (node_sum < node_count) *bad = true;
  *sum += node_sum;
  return found;
}

// Coarse step 1: count each tile's non-zero level-0 nodes, validate the coarse words, sum the digits.
extern "C" __global__ void lhc_ml_coarse_count(const uint64_t* layout, const float* payload, double scale,
                                               uint64_t world_size, unsigned long long* tile_sum,
                                               DecodeCounters* counters, MlState* ml) {
  const CodecLayout L = load_layout(layout);
  count_bitmap_tiles(L, payload, scale, world_size, L.index.digits, tile_sum, &ml->coarse_sum, counters);
}

// Coarse step 3 (after lhc_scan_tiles and lhc_ml_verdict): the level-0 nodes in increasing order and
// their counts, nodes[0, cap) and counts[0, cap).
extern "C" __global__ void lhc_ml_coarse_write(const uint64_t* layout, const float* payload, double scale,
                                               uint64_t world_size, const unsigned long long* tile_offset,
                                               uint32_t* nodes, uint32_t* counts, uint64_t cap,
                                               const DecodeCounters* counters) {
  if (counters->abort) return;
  const CodecLayout L = load_layout(layout);
  write_bitmap_tiles(L, payload, scale, world_size, L.index.digits, tile_offset, nodes, counts, cap);
}

// One thread, between stages: the checks of the stage that just ended (the coarse level with
// `after_coarse`, else a level's expansion; its list's exact length is the last scan's total) and the
// set-up of the next (a level's node count, mode, cleared per-level state and peel control). After
// the finest expansion (`finest`): the support keys' count (exact for the report; the value peel's
// list holds at most `next_cap` of them, more is a support overflow as for the other indexes).
extern "C" __global__ void lhc_ml_verdict(uint64_t after_coarse, uint64_t finest, uint64_t next_cap,
                                          DecodeCounters* counters, MlState* ml, PeelControl* control) {
  if (global_thread() != 0) return;
  auto fail = [&](unsigned int status) {
    ml->status = status;
    counters->abort = 1;
  };
  const unsigned long long total = counters->list_count;  // lhc_scan_tiles ran uncapped
  if (after_coarse) {
    // (the scan raised abort for a bad coarse word: that is this stage's failure)
    if ((counters->flags & kFlagIndexWord) || ml->coarse_sum > counters->expected_total) return fail(kMlCorrupt);
  } else {
    if (counters->abort) return;  // an earlier stage failed and said why
    ml->prev_nodes = ml->nodes;   // the level just expanded: lhc_ml_expand_write walks its nodes
    if (ml->expand_bad || ml->child_total > counters->expected_total) return fail(kMlCorrupt);
    if (finest) {
      // As the CPU backend: the candidates are the support keys, counted before the final check.
      ml->support = total;
      ml->candidates = total;
      counters->index_total = ml->child_total;
      if (ml->child_total != counters->expected_total) return fail(kMlCorrupt);
      const unsigned long long kept = total < next_cap ? total : next_cap;
      counters->list_count = kept;
      counters->support = kept;
      counters->candidates = total;
      if (total > next_cap) {
        counters->flags |= kFlagSupportOverflow;
        counters->abort = 1;
      }
      return;
    }
  }
  ml->nodes = total;
  ml->mode = total > next_cap ? kMlTooMany : kMlList;
  ml->resolved = 0;
  ml->child_total = 0;
  ml->word_flags = 0;
  ml->inconsistent = 0;
  ml->expand_bad = 0;
  ml->replay_bad = 0;
  unsigned int* c = reinterpret_cast<unsigned int*>(control);
  for (unsigned int i = 0; i < sizeof(PeelControl) / sizeof(unsigned int); ++i) c[i] = 0;
}

// Adds node `v` (an id) to the cell states of table T: one more node, XORed into the cell's id.
__device__ __forceinline__ void ml_replay_add(const SegmentedTable& T, uint64_t v, unsigned int* deg,
                                              unsigned int* xr) {
  const uint64_t h = key_hash(T, v);
#pragma unroll
  for (int j = 0; j < 3; ++j) {
    int weight;  // ignored (an index table)
    const uint64_t c = key_cell(T, h, j, &weight);
    atomicAdd(deg + c, 1u);
    atomicXor(xr + c, (unsigned int)v);
  }
}

// Calls visit(v) for every non-zero node v (an id) of level l, streamed from the level's source:
// the coarse words at level 0 (they passed stage 1: valid packed integers, digits at real nodes),
// else the parents' patterns (they passed their expansion: every non-zero digit is a child below the
// limit). Grid-stride: each node is visited once, by some thread.
template <typename Visit>
__device__ __forceinline__ void ml_for_each_node(const CodecLayout& L, const uint64_t* layout, uint32_t l,
                                                 const float* payload, double scale, const uint32_t* parent_nodes,
                                                 const uint32_t* parent_pattern, uint64_t parents, Visit visit) {
  if (l == 0) {
    const float* index = payload + L.index_offset;
    const long long limit = digit_limit(L.index);
    const uint32_t base = L.index.base, per_word = L.index.per_word;
    for (uint64_t w = global_thread(); w < L.index.words(); w += grid_threads()) {
      const long long u = read_word(index[w], scale, limit);
      if (u <= 0) continue;
      unsigned long long rest = (unsigned long long)u;
      for (uint32_t i = 0; i < per_word && rest; ++i, rest /= base)
        if (rest % base && w * per_word + i < L.index.digits) visit(w * per_word + i);
    }
  } else {
    const MlLevel up = ml_level(layout, l - 1);
    const uint32_t base = L.index.base;
    for (uint64_t item = global_thread(); item < parents * up.words; item += grid_threads()) {
      const uint64_t p = item / up.words, i = item - p * up.words;
      uint32_t u = parent_pattern[item];
      const uint64_t first = (uint64_t)parent_nodes[p] * up.children + i * up.digits;
      for (uint32_t j = 0; j < up.digits && u; ++j, u /= base)
        if (u % base) visit(first + j);
    }
  }
}

// Cell states of level l's table by node id (degree, XOR of ids), every node streamed from the level's
// source (ml_for_each_node). For the levels whose nodes do not fit a list, and for the replay.
__device__ __forceinline__ void ml_states_by_id(const CodecLayout& L, const uint64_t* layout, uint32_t l,
                                                const SegmentedTable& T, const float* payload, double scale,
                                                const uint32_t* parent_nodes, const uint32_t* parent_pattern,
                                                uint64_t parents, unsigned int* deg, unsigned int* xr) {
  ml_for_each_node(L, layout, l, payload, scale, parent_nodes, parent_pattern, parents,
                   [&](uint64_t v) { ml_replay_add(T, v, deg, xr); });
}

// The CPU backend's peel of one group g of a fine table, step by step (lhc::cpu::peel with
// peel_fine_level's resolve): a queue seeded with the group's pure cells in increasing order; a
// dequeued cell still pure gives its node (the XOR of ids of a one-node cell is that node), whose
// pattern is read there (its sign there times the cell; a word outside [0, base^w) fails) and
// subtracted, times its sign, from its three cells (the pure one becomes 0); then its other two cells,
// in segment order, lose the node and join the queue when left with one. Returns true if a step fails
// (the CPU's `bad`). Volatile accesses: the states were written by other blocks of this launch, and
// this thread rewrites them as it goes.
__device__ bool ml_replay_group(const SegmentedTable& T, uint64_t g, uint64_t wpg, long long word_limit,
                                volatile long long* val, volatile unsigned int* deg, volatile unsigned int* xr,
                                unsigned int* queue) {
  const uint64_t gcells = T.group_cells(), first = g * gcells;
  unsigned int* q = queue + first;
  uint64_t tail = 0;
  for (uint64_t c = 0; c < gcells; ++c)
    if (deg[first + c] == 1u) q[tail++] = (unsigned int)c;
  for (uint64_t head = 0; head < tail; ++head) {
    const uint64_t c = first + q[head];
    if (deg[c] != 1u) continue;  // its node was resolved through another cell meanwhile
    const uint64_t v = xr[c];
    uint64_t cell[3];
    int sign[3];  // +-1: a fine table is never weighted
    key_cells(T, v, cell, sign);
    const int pure = cell[0] == c ? 0 : cell[1] == c ? 1 : cell[2] == c ? 2 : -1;
    if (pure < 0) return true;  // a guard: states built from the node ids always name a node of the cell
    for (int j = 0; j < 3; ++j)
      if (cell[j] < first || cell[j] >= first + gcells) return true;  // a guard, likewise
    // The pure cell first, then the other two in segment order (which fixes the queue order); selected
    // without indexing the local arrays.
    const uint64_t c1 = pure == 0 ? cell[1] : cell[0], c2 = pure == 2 ? cell[1] : cell[2];
    const long long s0 = pure == 0 ? sign[0] : pure == 1 ? sign[1] : sign[2];
    const long long s1 = pure == 0 ? sign[1] : sign[0], s2 = pure == 2 ? sign[1] : sign[2];
    for (uint64_t k = 0; k < wpg; ++k) {
      const long long u = s0 * val[c * wpg + k];
      if (u < 0 || u >= word_limit) return true;
    }
    for (uint64_t k = 0; k < wpg; ++k) {
      const long long u = s0 * val[c * wpg + k];
      val[c1 * wpg + k] = val[c1 * wpg + k] - s1 * u;
      val[c2 * wpg + k] = val[c2 * wpg + k] - s2 * u;
      val[c * wpg + k] = 0;
    }
    const uint64_t others[2] = {c1, c2};
    for (int t = 0; t < 2; ++t) {
      const uint64_t d = others[t];
      if (deg[d] == 0u) return true;  // a guard
      deg[d] = deg[d] - 1u;
      xr[d] = xr[d] ^ (unsigned int)v;
      if (deg[d] == 1u) {
        if (tail >= gcells) return true;  // a guard: a cell joins the queue once at most
        q[tail++] = (unsigned int)(d - first);
      }
    }
  }
  return false;
}

// What the parallel peel of a level found in its cells once it stopped: a word left in a cell whose
// nodes were all resolved by peeling is an inconsistency (never on a plain sum; words may be negative,
// as cells sum signed patterns). A solved pair's cells keep their degree 2: ml_solve_pair checked them.
__device__ __forceinline__ bool ml_cells_inconsistent(const long long* val, const unsigned int* deg, uint64_t words,
                                                      uint64_t wpg) {
  bool inconsistent = false;
  for (uint64_t i = global_thread(); i < words; i += grid_threads())
    inconsistent |= load_cg(val + i) != 0 && load_cg(deg + i / wpg) == 0u;
  return inconsistent;
}

// Reads word k of the pattern of a node peeled from cell c (only that node is left there, so nothing
// else writes the cell this round): the node's sign in c times the cell. Flags a word no pattern can
// be, and subtracts the word times the node's sign from each of its three cells (the source becomes
// 0). Returns the word.
__device__ __forceinline__ long long ml_take_pattern_word(long long* val, uint64_t c, const uint64_t cell[3],
                                                          const int sign[3], uint64_t wpg, uint64_t k,
                                                          long long word_limit, bool* inconsistent) {
  const long long s = c == cell[0] ? sign[0] : c == cell[1] ? sign[1] : sign[2];
  const long long word = s * load_cg(val + c * wpg + k);
  *inconsistent |= word < 0 || word >= word_limit;
#pragma unroll
  for (int j = 0; j < 3; ++j)
    atomicAdd(reinterpret_cast<unsigned long long*>(val + cell[j] * wpg + k),
              (unsigned long long)(-(long long)sign[j] * word));
  return word;
}

// A two-node stopping set left after peeling, seen from node `a` (its XOR-state reference: a list
// position, or a node id where the states XOR ids) with cells cell[3]: each cell holds two unresolved
// nodes, the same two (equal XOR states), a the smaller. Returns the other node's reference, or
// kNoPartner. (A resolved node never passes: it was alone in one of its cells when it was peeled, and
// an unresolved pair filling all three would have been there too.)
constexpr uint64_t kNoPartner = ~0ull;
__device__ __forceinline__ uint64_t ml_pair_partner(uint64_t a, const uint64_t cell[3], const unsigned int* deg,
                                                    const unsigned int* xr) {
  if (load_cg(deg + cell[0]) != 2u || load_cg(deg + cell[1]) != 2u || load_cg(deg + cell[2]) != 2u) return kNoPartner;
  const unsigned int x = load_cg(xr + cell[0]);
  if (load_cg(xr + cell[1]) != x || load_cg(xr + cell[2]) != x) return kNoPartner;
  const uint64_t b = (uint64_t)(x ^ (unsigned int)a);
  return b > a ? b : kNoPartner;
}

// Solves the pair (a, b) of ml_pair_partner from its cells cell[3] (both nodes'), sa and sb their
// signs there, as the CPU backend's solve_pairs: lhc::pair_cells picks cells p, q with det != 0 (0:
// proportional signs, unsolvable: returns false), and per pattern word, from residuals R_p, R_q,
//     P_a = (sb[q] R_p - sb[p] R_q) / det,    P_b = (sa[p] R_q - sa[q] R_p) / det,
// flagged inconsistent unless both divisions are exact, both words lie in [0, base^w), and the third
// cell r holds sa[r] P_a + sb[r] P_b. Writes the words to pat_a / pat_b when given (0 where
// inconsistent). The pair's cells hold no other node: no other thread reads or writes them.
// Node a's two-node stopping set, found from a's XOR-state reference a and node id id_a
// (ml_pair_partner); id_of maps the partner's reference to its node id (nodes[ref] for a list, the
// reference itself where states XOR ids; kNoPartner where the reference names no unresolved node). Fills a's cells and both nodes' signs there and returns
// the partner's reference, or kNoPartner; sets *guard where the states name a partner that is no
// unresolved node with the same three cells (inconsistent states).
template <typename IdOf>
__device__ __forceinline__ uint64_t ml_find_pair(const SegmentedTable& T, uint64_t a, uint64_t id_a, IdOf id_of,
                                                 const unsigned int* deg, const unsigned int* xr, uint64_t cell[3],
                                                 int sa[3], int sb[3], bool* guard) {
  key_cells(T, id_a, cell, sa);
  const uint64_t b = ml_pair_partner(a, cell, deg, xr);
  if (b == kNoPartner) return kNoPartner;
  const uint64_t id_b = id_of(b);
  if (id_b == kNoPartner) { *guard = true; return kNoPartner; }
  uint64_t cb[3];
  key_cells(T, id_b, cb, sb);
  if (cb[0] != cell[0] || cb[1] != cell[1] || cb[2] != cell[2]) { *guard = true; return kNoPartner; }
  return b;
}

__device__ __forceinline__ bool ml_solve_pair(const long long* val, const uint64_t cell[3], const int sa[3],
                                              const int sb[3], uint64_t wpg, long long word_limit, uint32_t* pat_a,
                                              uint32_t* pat_b, bool* inconsistent) {
  const PairCells pc = pair_cells(sa, sb);
  if (pc.det == 0) return false;
  // p is 0 or 1, q is 1 or 2, r the third: selected without indexing the local arrays.
  const int r = 3 - pc.p - pc.q;
  const uint64_t cp = pc.p == 0 ? cell[0] : cell[1], cq = pc.q == 1 ? cell[1] : cell[2];
  const uint64_t cr = r == 0 ? cell[0] : r == 1 ? cell[1] : cell[2];
  const long long sap = pc.p == 0 ? sa[0] : sa[1], saq = pc.q == 1 ? sa[1] : sa[2];
  const long long sbp = pc.p == 0 ? sb[0] : sb[1], sbq = pc.q == 1 ? sb[1] : sb[2];
  const long long sar = r == 0 ? sa[0] : r == 1 ? sa[1] : sa[2];
  const long long sbr = r == 0 ? sb[0] : r == 1 ? sb[1] : sb[2];
  const long long det = pc.det;
  for (uint64_t k = 0; k < wpg; ++k) {
    const long long Rp = load_cg(val + cp * wpg + k), Rq = load_cg(val + cq * wpg + k);
    const long long Rr = load_cg(val + cr * wpg + k);
    const long long num_a = sbq * Rp - sbp * Rq, num_b = sap * Rq - saq * Rp;
    const long long Pa = num_a / det, Pb = num_b / det;
    const bool ok = num_a % det == 0 && num_b % det == 0 && Pa >= 0 && Pa < word_limit && Pb >= 0 &&
                    Pb < word_limit && Rr == sar * Pa + sbr * Pb;
    *inconsistent |= !ok;
    if (pat_a) {
      pat_a[k] = ok ? (uint32_t)Pa : 0u;
      pat_b[k] = ok ? (uint32_t)Pb : 0u;
    }
  }
  return true;
}

// One fine level's peel, steps 2a-b above up to the pairs (cooperative launch: every block resident;
// grid barriers between the phases); lhc_ml_settle_level follows. `nodes` (ml->nodes of them,
// increasing) are the level's non-zero nodes when they fit their list; the peel writes each node's
// pattern (wpg words) to pattern[position * wpg, ...) and its round to rnd[position].
// parent_nodes/parent_pattern: the level above's (the node source by id for l >= 1; level 0's is the
// coarse words). Scratch: val (cells x wpg integers), deg, xr, pure0/pure1 (cells), src, rnd,
// list0/list1 (the list's capacity, at least the cells when the nodes do not fit), claimed (a bit per
// node of the level), control (zeroed by lhc_ml_verdict).
extern "C" __global__ void lhc_ml_peel_level(const uint64_t* layout, uint64_t level, const float* payload,
                                             double scale, const uint32_t* nodes, long long* val, unsigned int* deg,
                                             unsigned int* xr, unsigned int* src, unsigned int* rnd,
                                             uint32_t* pattern, unsigned int* pure0, unsigned int* pure1,
                                             unsigned int* list0, unsigned int* list1, unsigned int* claimed,
                                             PeelControl* control, DecodeCounters* counters, MlState* ml,
                                             const uint32_t* parent_nodes, const uint32_t* parent_pattern) {
  if (*(volatile unsigned int*)&counters->abort) return;  // uniform: set before this launch
  const CodecLayout L = load_layout(layout);
  const uint32_t l = (uint32_t)level;
  const MlLevel lv = ml_level(layout, l);
  const SegmentedTable T = lv.table;
  const uint64_t wpg = lv.words, cells = T.cells(), words = cells * wpg;
  const long long word_limit = ml_word_limit(L, lv);
  const float* fine = payload + lv.offset;
  volatile MlState* vml = ml;
  volatile PeelControl* vc = control;
  const unsigned int mode = vml->mode;  // set by lhc_ml_verdict before this launch
  const uint32_t nkeys = mode == kMlList ? (uint32_t)vml->nodes : 0u;

  // a. The table's words as exact integers; fresh cell states and node states.
  unsigned int word_flags = 0;
  for (uint64_t i = global_thread(); i < words; i += grid_threads()) {
    long long v;
    word_flags |= read_fine_word(fine[i], scale, &v);
    val[i] = v;
  }
  for (uint64_t c = global_thread(); c < cells; c += grid_threads()) {
    deg[c] = 0;
    xr[c] = 0;
  }
  for (uint64_t p = global_thread(); p < nkeys; p += grid_threads()) {
    src[p] = kNoCell;
    rnd[p] = kNotPeeled;
  }
  if (mode == kMlTooMany)
    for (uint64_t i = global_thread(); i < (lv.nodes + 31) / 32; i += grid_threads()) claimed[i] = 0;
  if (word_flags) atomicOr(&ml->word_flags, word_flags);
  grid_barrier(control->barrier);
  const bool words_ok = vml->word_flags == 0u;  // uniform after the barrier

  if (words_ok) {
    // b. Cell states (degree, XOR of list positions, or of node ids when the nodes do not fit their
    //    list), the pure cells, then rounds.
    if (mode == kMlList) {
      for (uint64_t p = global_thread(); p < nkeys; p += grid_threads()) {
        const uint64_t h = key_hash(T, nodes[p]);
#pragma unroll
        for (int j = 0; j < 3; ++j) {
          int weight;  // ignored (an index table)
          const uint64_t c = key_cell(T, h, j, &weight);
          atomicAdd(deg + c, 1u);
          atomicXor(xr + c, (unsigned int)p);
        }
      }
    } else {
      ml_states_by_id(L, layout, l, T, payload, scale, parent_nodes, parent_pattern, vml->prev_nodes, deg, xr);
    }
    grid_barrier(control->barrier);
    for (uint64_t c = global_thread(); c < cells; c += grid_threads())
      if (load_cg(deg + c) == 1u) queue_push(pure0, &control->pure[0], (unsigned int)c);
    grid_barrier(control->barrier);
    bool guard = false, inconsistent = false;
    for (unsigned int r = 0;; ++r) {
      PeelRound q;
      const unsigned int npure = begin_round(r, cells, control, pure0, pure1, list0, list1, &q);
      if (npure == 0) break;
      const unsigned int par = q.par;
      unsigned int* const pure_now = q.pure_now;
      unsigned int* const pure_next = q.pure_next;
      unsigned int* const list_now = q.list_now;
      if (mode == kMlList) {
        // A: every pure cell proposes its node, which keeps the smallest proposing cell.
        propose(T, nodes, nkeys, deg, xr, rnd, src, pure_now, npure, list_now, &control->keys[par], &guard);
      } else {
        // A, by id: the first pure cell to claim a node takes it (which one does not matter: only
        //    whether the table is consistent is wanted here, and that does not depend on the cells the
        //    patterns are read from; see the section comment). src[c] records the cell's node.
        for (uint64_t i = global_thread(); i < npure; i += grid_threads()) {
          const unsigned int c = load_cg(pure_now + i);
          if (load_cg(deg + c) != 1u) continue;
          const unsigned int v = load_cg(xr + c);
          uint64_t cell[3];
          int weight[3];
          if (v >= lv.nodes || cell_slot(T, v, c, cell, weight) < 0) { guard = true; continue; }
          if (atomicOr(claimed + v / 32, 1u << (v % 32)) & (1u << (v % 32))) continue;
          src[c] = v;
          queue_push(list_now, &control->keys[par], c);
        }
      }
      grid_barrier(control->barrier);
      // B: each listed node reads its pattern word by word and subtracts it (ml_take_pattern_word);
      //    the first word's item updates the cell states. Work items are (node, word) pairs, so wide
      //    patterns spread over threads.
      const unsigned int nlist = vc->keys[par];
      for (uint64_t item = global_thread(); item < (uint64_t)nlist * wpg; item += grid_threads()) {
        const uint64_t i = item / wpg, k = item - i * wpg;
        const unsigned int entry = load_cg(list_now + i);  // a node position, or a cell when by id
        const unsigned int c = mode == kMlList ? load_cg(src + entry) : entry;
        const unsigned int key = mode == kMlList ? entry : load_cg(src + entry);
        uint64_t cell[3];
        int sign[3];  // +-1: a fine table is never weighted
        key_cells(T, mode == kMlList ? nodes[key] : key, cell, sign);
        const long long word = ml_take_pattern_word(val, c, cell, sign, wpg, k, word_limit, &inconsistent);
        if (mode == kMlList) pattern[(uint64_t)key * wpg + k] = word >= 0 && word < word_limit ? (uint32_t)word : 0u;
        if (k == 0) {
          if (mode == kMlList) rnd[key] = r;
#pragma unroll
          for (int j = 0; j < 3; ++j) {
            atomicXor(xr + cell[j], key);
            if (atomicSub(deg + cell[j], 1u) == 2u) queue_push(pure_next, &control->pure[par ^ 1u], (unsigned)cell[j]);
          }
        }
      }
      grid_barrier(control->barrier);
    }
    if (inconsistent || guard) atomicOr(&ml->inconsistent, 1u);
  }
}

// One fine level, after lhc_ml_peel_level (cooperative launch, same scratch; a kernel of its own so that
// the rarely busy work below does not cost the peel's rounds registers, and with them resident blocks):
// the pairs the peel left, what the cells hold (step 2b-c above), the level's verdict, and the replay
// where the verdict asks for it (step 2d).
extern "C" __global__ void lhc_ml_settle_level(const uint64_t* layout, uint64_t level, const float* payload,
                                               double scale, const uint32_t* nodes, long long* val, unsigned int* deg,
                                               unsigned int* xr, unsigned int* rnd, uint32_t* pattern,
                                               unsigned int* queue, const unsigned int* claimed, PeelControl* control,
                                               DecodeCounters* counters, MlState* ml, const uint32_t* parent_nodes,
                                               const uint32_t* parent_pattern) {
  if (*(volatile unsigned int*)&counters->abort) return;  // uniform: set before this launch
  const CodecLayout L = load_layout(layout);
  const uint32_t l = (uint32_t)level;
  const MlLevel lv = ml_level(layout, l);
  const SegmentedTable T = lv.table;
  const uint64_t wpg = lv.words, cells = T.cells(), words = cells * wpg;
  const long long word_limit = ml_word_limit(L, lv);
  const float* fine = payload + lv.offset;
  volatile MlState* vml = ml;
  const unsigned int mode = vml->mode;  // set by lhc_ml_verdict before the peel
  const uint32_t nkeys = mode == kMlList ? (uint32_t)vml->nodes : 0u;

  if (vml->word_flags == 0u) {  // uniform: set by lhc_ml_peel_level
    bool guard = false, inconsistent = false;
    // The pairs the peel left, each by the thread of its smaller node: listed nodes by position (a
    // solved pair's round is kPairRound), else every node of the level streamed from its source by id,
    // unclaimed ones only, for the inconsistency check.
    if (mode == kMlList) {
      const auto listed = [&](uint64_t p) { return p < nkeys && load_cg(rnd + p) == kNotPeeled ? nodes[p] : kNoPartner; };
      for (uint64_t a = global_thread(); a < nkeys; a += grid_threads()) {
        if (load_cg(rnd + a) != kNotPeeled) continue;
        uint64_t cell[3];
        int sa[3], sb[3];
        const uint64_t b = ml_find_pair(T, a, nodes[a], listed, deg, xr, cell, sa, sb, &guard);
        if (b == kNoPartner) continue;
        if (ml_solve_pair(val, cell, sa, sb, wpg, word_limit, pattern + a * wpg, pattern + b * wpg, &inconsistent)) {
          rnd[a] = kPairRound;
          rnd[b] = kPairRound;
        }
      }
    } else {
      const auto by_id = [](uint64_t v) { return v; };
      ml_for_each_node(L, layout, l, payload, scale, parent_nodes, parent_pattern, vml->prev_nodes, [&](uint64_t a) {
        if (load_cg(claimed + a / 32) & (1u << (a % 32))) return;
        uint64_t cell[3];
        int sa[3], sb[3];
        if (ml_find_pair(T, a, a, by_id, deg, xr, cell, sa, sb, &guard) != kNoPartner)
          ml_solve_pair(val, cell, sa, sb, wpg, word_limit, nullptr, nullptr, &inconsistent);
      });
    }
    grid_barrier(control->barrier);
    // c. Resolved nodes (a level with too many nodes stalls: not counted), and what the cells hold.
    unsigned int resolved = 0;
    for (uint64_t p = global_thread(); p < nkeys; p += grid_threads()) resolved += load_cg(rnd + p) != kNotPeeled;
    inconsistent |= ml_cells_inconsistent(val, deg, words, wpg);
    warp_add(&ml->resolved, resolved);
    if (inconsistent || guard) atomicOr(&ml->inconsistent, 1u);
  }
  grid_barrier(control->barrier);

  // Verdict (see the section comment): one thread decides, every thread then reads the mode.
  if (global_thread() == 0) {
    unsigned int status = 0;
    if (vml->word_flags)
      status = (vml->word_flags & kMlWordCorrupt) ? kMlCorrupt : kMlOverflow;
    else if (mode == kMlList && vml->resolved == nkeys)
      status = vml->inconsistent ? kMlCorrupt : 0u;
    else if (!vml->inconsistent)
      status = kMlPeelFailed;  // stalled (too many nodes always stall), and no order meets a bad step
    else
      vml->mode = kMlReplay;   // stalled and inconsistent: the CPU's order decides
    if (status) {
      vml->status = status;
      *(volatile unsigned int*)&counters->abort = 1;
    }
  }
  grid_barrier(control->barrier);
  if (vml->mode != kMlReplay) return;  // uniform

  // d. The CPU-order replay. Fresh states from the level's node source, by node id.
  for (uint64_t c = global_thread(); c < cells; c += grid_threads()) {
    deg[c] = 0;
    xr[c] = 0;
  }
  for (uint64_t i = global_thread(); i < words; i += grid_threads()) {
    long long v;
    read_fine_word(fine[i], scale, &v);  // every word is valid here
    val[i] = v;
  }
  grid_barrier(control->barrier);
  ml_states_by_id(L, layout, l, T, payload, scale, parent_nodes, parent_pattern, vml->prev_nodes, deg, xr);
  grid_barrier(control->barrier);
  // One group per warp (its first lane): groups in one warp would take turns, not run side by side.
  bool bad = false;
  if ((threadIdx.x & 31) == 0)
    for (uint64_t g = global_thread() / 32; g < T.groups(); g += grid_threads() / 32)
      bad |= ml_replay_group(T, g, wpg, word_limit, val, deg, xr, queue);
  if (bad) atomicOr(&ml->replay_bad, 1u);
  grid_barrier(control->barrier);
  // The pairs that order left (only where no group met a bad step: states are consistent then), by
  // node id; disjoint, so the CPU's order of them cannot change the verdict. (replay_bad may be raised
  // by a faster thread's pair meanwhile: a thread that then skips its pairs changes nothing.)
  if (!vml->replay_bad) {
    bad = false;
    const auto by_id = [](uint64_t v) { return v; };
    ml_for_each_node(L, layout, l, payload, scale, parent_nodes, parent_pattern, vml->prev_nodes, [&](uint64_t a) {
      uint64_t cell[3];
      int sa[3], sb[3];
      // a guard (inconsistent states) counts as bad, like a bad pair
      if (ml_find_pair(T, a, a, by_id, deg, xr, cell, sa, sb, &bad) != kNoPartner)
        ml_solve_pair(val, cell, sa, sb, wpg, word_limit, nullptr, nullptr, &bad);
    });
    if (bad) atomicOr(&ml->replay_bad, 1u);
  }
  grid_barrier(control->barrier);
  if (global_thread() == 0) {
    // A stalled table (in the CPU's order too): corrupt if a group met a bad step or a bad pair, else
    // peel failed.
    vml->status = vml->replay_bad ? kMlCorrupt : kMlPeelFailed;
    *(volatile unsigned int*)&counters->abort = 1;
  }
}

// Expansion step 1: count each tile's non-zero children of the level's nodes and check them.
extern "C" __global__ void lhc_ml_expand_count(const uint64_t* layout, uint64_t level, const uint32_t* nodes,
                                               const uint32_t* counts, const uint32_t* pattern,
                                               unsigned long long* tile_sum, DecodeCounters* counters, MlState* ml) {
  if (counters->abort) return;  // uniform
  const CodecLayout L = load_layout(layout);
  const MlLevel lv = ml_level(layout, (uint32_t)level);
  unsigned long long sum = 0;
  bool bad = false;
  tile_count(ml->nodes, tile_sum, [&](uint64_t p) {
    return ml_node_children(L, lv, nodes, counts, pattern, p, nullptr, nullptr, 0, 0, &sum, &bad);
  });
  if (sum) atomicAdd(&ml->child_total, sum);
  if (bad) atomicOr(&ml->expand_bad, 1u);
}

// Expansion step 3 (after lhc_scan_tiles and lhc_ml_verdict): the children in increasing order,
// out_nodes[0, cap) (and their counts to out_counts, when given: levels above the finest).
extern "C" __global__ void lhc_ml_expand_write(const uint64_t* layout, uint64_t level, const uint32_t* nodes,
                                               const uint32_t* counts, const uint32_t* pattern,
                                               const unsigned long long* tile_offset, uint32_t* out_nodes,
                                               uint32_t* out_counts, uint64_t cap, const DecodeCounters* counters,
                                               const MlState* ml) {
  if (counters->abort) return;
  const CodecLayout L = load_layout(layout);
  const MlLevel lv = ml_level(layout, (uint32_t)level);
  unsigned long long ignored = 0;
  bool bad = false;
  tile_emit(
      ml->prev_nodes, tile_offset,
      [&](uint64_t p) { return ml_node_children(L, lv, nodes, counts, pattern, p, nullptr, nullptr, 0, 0, &ignored, &bad); },
      [&](uint64_t p, unsigned long long at) {
        ml_node_children(L, lv, nodes, counts, pattern, p, out_nodes, out_counts, at, cap, &ignored, &bad);
      });
}

// After a support overflow (more support keys than the value peel holds; it is skipped): a NaN/Inf
// sketch cell still takes precedence, as in the CPU backend's status order.
extern "C" __global__ void lhc_ml_overflow_finite(const uint64_t* layout, const float* payload,
                                                  DecodeCounters* counters) {
  if (!(counters->flags & kFlagSupportOverflow)) return;
  const CodecLayout L = load_layout(layout);
  const float* sketch = payload + L.sketch_offset;
  bool non_finite = false;
  for (uint64_t i = global_thread(); i < L.sketch.cells() * L.block; i += grid_threads())
    non_finite |= (__float_as_uint(sketch[i]) & 0x7f800000u) == 0x7f800000u;
  if (non_finite) atomicOr(&counters->flags, (unsigned int)kFlagNonFinite);
}

// -------------------------------------------------------------------------------------------------
// Decode: value peel
// -------------------------------------------------------------------------------------------------

// Support size known (after the last compaction): record it, and abort on a degree overflow.
extern "C" __global__ void lhc_support_ready(DecodeCounters* counters, uint64_t support_is_candidates) {
  if (global_thread() != 0) return;
  counters->support = counters->list_count;
  if (support_is_candidates) counters->candidates = counters->list_count;
}

// Raise abort if any flag of `mask` is set (one thread, between two stages).
extern "C" __global__ void lhc_abort_if(DecodeCounters* counters, uint64_t mask) {
  if (global_thread() == 0 && (counters->flags & (unsigned int)mask)) counters->abort = 1;
}

// Exclusive scan of deg over cells (CSR offsets of the cell -> key adjacency), tile by tile.
extern "C" __global__ void lhc_degree_tiles(const unsigned int* deg, uint64_t cells, unsigned long long* tile_sum) {
  tile_count(cells, tile_sum, [&](uint64_t c) { return deg[c]; });
}

// offsets[c] = keys in the cells before c (every cell, empty or not); offsets[cells] = the total.
extern "C" __global__ void lhc_degree_offsets(const unsigned int* deg, uint64_t cells,
                                              const unsigned long long* tile_offset, unsigned int* offsets,
                                              const DecodeCounters* counters) {
  if (counters->abort) return;  // uniform over the grid
  const uint64_t first = (uint64_t)blockIdx.x * kTileItems;
  unsigned long long running = tile_offset[blockIdx.x];
  for (int r = 0; r < kTileRounds; ++r) {
    const uint64_t c = first + (uint64_t)r * kTileThreads + threadIdx.x;
    const unsigned int d = c < cells ? deg[c] : 0u;
    unsigned int total;
    const unsigned int before = block_exclusive_scan(d, &total);
    if (c < cells) {
      offsets[c] = (unsigned int)(running + before);
      if (c == cells - 1) offsets[cells] = (unsigned int)(running + before + d);
    }
    running += total;
  }
}

// A value-peel adjacency entry: (key position << kWeightCodeBits) | the key's weight code in the
// cell (lhc_layout.h key_cell_code). Positions stay below 2^(32 - kWeightCodeBits): the host caps
// the support list there (lossless_hc/backends/cuda.py MAX_PEEL_POSITIONS).
constexpr unsigned int kAdjCodeMask = (1u << kWeightCodeBits) - 1u;
__device__ __forceinline__ unsigned int adj_position(unsigned int entry) { return entry >> kWeightCodeBits; }

// 1 / w for a weight w of +-1 or +-2, exactly: a key read from its pure cell is R * (1 / w).
__device__ __forceinline__ double inverse_weight(int w) { return (double)w * ((w & 1) ? 1.0 : 0.25); }

// Fill the adjacency: adj[offsets[c] + slot] = (position << kWeightCodeBits) | code for each key in
// c. The slot order depends on scheduling; lhc_sort_adjacency fixes it.
extern "C" __global__ void lhc_fill_adjacency(const uint64_t* table_words, const uint32_t* keys,
                                              const unsigned int* offsets, unsigned int* cursor, unsigned int* adj,
                                              const DecodeCounters* counters) {
  if (counters->abort) return;
  const SegmentedTable t = load_table(table_words);
  const uint32_t n = (uint32_t)counters->support;  // list_count now holds the degree scan's total
  for (uint64_t p = global_thread(); p < n; p += grid_threads()) {
    const uint64_t h = key_hash(t, keys[p]);
#pragma unroll
    for (int j = 0; j < 3; ++j) {
      uint32_t code;
      const uint64_t c = key_cell_code(t, h, j, &code);
      const unsigned int slot = atomicAdd(cursor + c, 1u);
      adj[offsets[c] + slot] = ((unsigned int)p << kWeightCodeBits) | code;
    }
  }
}

// Sort each cell's adjacency by key position (insertion sort: at most kMaxCellDegree entries, ~2.4
// on average; a key is in a cell once, so entries sort as their positions), so phase C subtracts in
// a fixed order; and set xr[c] to the XOR of the cell's key
// positions (every cell: 0 when empty), the state the peel's phase A reads a pure cell's key from.
extern "C" __global__ void lhc_sort_adjacency(const unsigned int* offsets, const unsigned int* deg, uint64_t cells,
                                              unsigned int* adj, unsigned int* xr, const DecodeCounters* counters) {
  if (counters->abort) return;
  for (uint64_t c = global_thread(); c < cells; c += grid_threads()) {
    const unsigned int d = deg[c];
    unsigned int* a = adj + offsets[c];
    unsigned int x = 0;
    for (unsigned int i = 0; i < d; ++i) {
      const unsigned int v = a[i];
      x ^= adj_position(v);
      unsigned int j = i;
      for (; j > 0 && a[j - 1] > v; --j) a[j] = a[j - 1];
      a[j] = v;
    }
    xr[c] = x;
  }
}

// Cell values in double precision (cells x block), flagging NaN/Inf cells.
extern "C" __global__ void lhc_load_cells(const uint64_t* layout, const float* payload, double* val,
                                          DecodeCounters* counters) {
  if (counters->abort) return;
  const CodecLayout L = load_layout(layout);
  const float* sketch = payload + L.sketch_offset;
  const uint64_t n = L.sketch.cells() * L.block;
  bool non_finite = false;
  for (uint64_t i = global_thread(); i < n; i += grid_threads()) {
    const float f = sketch[i];
    non_finite |= (__float_as_uint(f) & 0x7f800000u) == 0x7f800000u;
    val[i] = (double)f;
  }
  if (non_finite) atomicOr(&counters->flags, (unsigned int)kFlagNonFinite);
}

// The value peel (cooperative launch): rounds of A) propose, B) read each proposed key's value from
// its cell (R / w, as R times the exact inverse of the key's weight there), C) every touched cell
// subtracts w * v, in increasing key position, for the keys peeled this round (walking its sorted
// adjacency, which carries their weight codes), updates its degree and queues itself if left with
// one key. Products by +-1, +-2 and their inverses are exact, so each step rounds once.
// Work items of B and C are (entry, lane) pairs, so wide blocks spread over threads.
extern "C" __global__ void lhc_peel_values(const uint64_t* table_words, uint64_t block, const uint32_t* keys,
                                           double* val, unsigned int* deg, unsigned int* xr, unsigned int* src,
                                           unsigned int* peeled_round, double* key_val, const unsigned int* offsets,
                                           const unsigned int* adj, unsigned int* stamp, unsigned int* pure0,
                                           unsigned int* pure1, unsigned int* list0, unsigned int* list1,
                                           unsigned int* dirty0, unsigned int* dirty1, PeelControl* control,
                                           DecodeCounters* counters) {
  if (*(volatile unsigned int*)&counters->abort) return;  // uniform: set before this launch
  const SegmentedTable t = load_table(table_words);
  const uint32_t nkeys = (uint32_t)counters->support;
  volatile PeelControl* vc = control;
  bool bad = false;
  for (unsigned int r = 0;; ++r) {
    PeelRound q;
    const unsigned int npure = begin_round(r, nkeys, control, pure0, pure1, list0, list1, &q, true);
    if (npure == 0) break;
    const unsigned int par = q.par;
    unsigned int* const pure_now = q.pure_now;
    unsigned int* const pure_next = q.pure_next;
    unsigned int* const list_now = q.list_now;
    unsigned int* const dirty_now = par ? dirty1 : dirty0;
    // A: propose.
    propose(t, keys, nkeys, deg, xr, peeled_round, src, pure_now, npure, list_now, &control->keys[par], &bad);
    grid_barrier(control->barrier);
    // B: each listed key reads its value from its source cell (exclusively its own: degree 1).
    const unsigned int nlist = vc->keys[par];
    for (uint64_t item = global_thread(); item < (uint64_t)nlist * block; item += grid_threads()) {
      const uint64_t i = item / block, lane = item - i * block;
      const unsigned int p = load_cg(list_now + i);
      const unsigned int c = load_cg(src + p);
      uint64_t cells[3];
      int weights[3];
      const int slot = cell_slot(t, keys[p], c, cells, weights);
      if (slot < 0) { bad = true; continue; }  // a guard: propose checked c is one of p's cells
      const int w = slot == 0 ? weights[0] : slot == 1 ? weights[1] : weights[2];  // no local-memory indexing
      key_val[(uint64_t)p * block + lane] = inverse_weight(w) * load_cg(val + (uint64_t)c * block + lane);
      if (lane == 0) {
        peeled_round[p] = r;
        deg[c] = 0;
        xr[c] = 0;
#pragma unroll
        for (int j = 0; j < 3; ++j) {
          if (j == slot) continue;
          const unsigned int cj = (unsigned int)cells[j];
          if (atomicExch(stamp + cj, r) != r) queue_push(dirty_now, &control->dirty[par], cj);
        }
      }
    }
    grid_barrier(control->barrier);
    // C: touched cells subtract this round's keys (w * v) in adjacency (key position) order.
    const unsigned int ndirty = vc->dirty[par];
    for (uint64_t item = global_thread(); item < (uint64_t)ndirty * block; item += grid_threads()) {
      const uint64_t i = item / block, lane = item - i * block;
      const unsigned int c = load_cg(dirty_now + i);
      const unsigned int begin = offsets[c], end = offsets[c + 1];
      double v = load_cg(val + (uint64_t)c * block + lane);
      unsigned int removed = 0, removed_xor = 0;
      for (unsigned int e = begin; e < end; ++e) {
        const unsigned int entry = adj[e];
        const unsigned int p = adj_position(entry);
        if (load_cg(peeled_round + p) != r) continue;
        const double kv = load_cg(key_val + (uint64_t)p * block + lane);
        // v - w * kv (weight_of_code), exactly: kv doubled for magnitude 2, added for a negative w.
        const double m = (entry & 1u) ? kv + kv : kv;
        v = (entry & 2u) ? v + m : v - m;
        ++removed;
        removed_xor ^= p;
      }
      val[(uint64_t)c * block + lane] = v;
      if (lane == 0) {
        const unsigned int d = load_cg(deg + c);
        if (removed > d) { bad = true; continue; }
        deg[c] = d - removed;
        xr[c] = load_cg(xr + c) ^ removed_xor;
        if (d != 1u && d - removed == 1u) queue_push(pure_next, &control->pure[par ^ 1u], c);
      }
    }
    grid_barrier(control->barrier);
  }
  if (bad) atomicOr(&counters->flags, (unsigned int)kFlagValueBad);
}

// After the value peel stalls: the two-key stopping sets (see the CPU backend's solve_pairs). One
// thread per cell of a group's first segment holding two unresolved keys a < b: if they have the
// same three cells, each holding just the two of them, cell j holds R_j = wa_j v_a + wb_j v_b, and
// lhc_layout.h pair_cells picks two cells p < q with det = wa_p wb_q - wa_q wb_p != 0 (det == 0:
// proportional weights, unsolvable); then, exactly in this form (exact products, one subtraction,
// one division, as every backend computes it),
//     v_a = (wb_q R_p - wb_p R_q) / det,    v_b = (wa_p R_q - wa_q R_p) / det.
// Pairs are disjoint (their cells hold nothing else), so threads never touch the same key or cell;
// each writes its keys' values, source cell (their first cell) and round kPairRound.
extern "C" __global__ void lhc_solve_pairs(const uint64_t* table_words, uint64_t block, const uint32_t* keys,
                                           const double* val, const unsigned int* deg, unsigned int* src,
                                           unsigned int* peeled_round, double* key_val, const unsigned int* offsets,
                                           const unsigned int* adj, DecodeCounters* counters) {
  if (counters->abort) return;
  const SegmentedTable t = load_table(table_words);
  const uint64_t first_cells = t.groups() * t.seg_len;  // cells of the groups' first segments
  for (uint64_t i = global_thread(); i < first_cells; i += grid_threads()) {
    const uint64_t c = (i / t.seg_len) * t.group_cells() + i % t.seg_len;
    if (deg[c] != 2u) continue;
    // The cell's two unresolved keys, in position order (the adjacency is sorted).
    unsigned int ab[2], found = 0;
    for (unsigned int e = offsets[c]; e < offsets[c + 1]; ++e) {
      const unsigned int p = adj_position(adj[e]);
      if (peeled_round[p] != kNotPeeled) continue;
      if (found < 2) ab[found] = p;
      ++found;
    }
    if (found != 2) continue;
    uint64_t ca[3], cb[3];
    int wa[3], wb[3];
    key_cells(t, keys[ab[0]], ca, wa);
    key_cells(t, keys[ab[1]], cb, wb);
    if (ca[0] != c || ca[0] != cb[0] || ca[1] != cb[1] || ca[2] != cb[2] || deg[ca[1]] != 2u || deg[ca[2]] != 2u)
      continue;
    const PairCells pc = pair_cells(wa, wb);
    if (pc.det == 0) continue;  // proportional weights: unsolvable
    // p is 0 or 1, q is 1 or 2: selected without indexing the local arrays (no local memory).
    const uint64_t cp = pc.p == 0 ? ca[0] : ca[1], cq = pc.q == 1 ? ca[1] : ca[2];
    const double wap = pc.p == 0 ? wa[0] : wa[1], waq = pc.q == 1 ? wa[1] : wa[2];
    const double wbp = pc.p == 0 ? wb[0] : wb[1], wbq = pc.q == 1 ? wb[1] : wb[2];
    const double det = (double)pc.det;
    for (uint64_t lane = 0; lane < block; ++lane) {
      const double Rp = val[cp * block + lane], Rq = val[cq * block + lane];
      key_val[(uint64_t)ab[0] * block + lane] = (wbq * Rp - wbp * Rq) / det;
      key_val[(uint64_t)ab[1] * block + lane] = (wap * Rq - waq * Rp) / det;
    }
    for (int k = 0; k < 2; ++k) {
      src[ab[k]] = (unsigned int)c;
      peeled_round[ab[k]] = kPairRound;
    }
  }
}

// Output: every recovered key's block (float), NaN for keys the peel could not recover; `out` was
// zeroed by the caller, so keys outside the support stay exact zeros. Counts the peeled keys.
extern "C" __global__ void lhc_write_output(const uint64_t* layout, const uint32_t* keys,
                                            const unsigned int* peeled_round, const double* key_val, float* out,
                                            DecodeCounters* counters) {
  if (counters->abort) return;
  const CodecLayout L = load_layout(layout);
  const uint32_t n = (uint32_t)counters->support;
  const uint64_t B = L.block;
  unsigned int peeled = 0;  // one counter atomic per warp, as in lhc_encode_scan_b1
  for (uint64_t item = global_thread(); item < (uint64_t)n * B; item += grid_threads()) {
    const uint64_t p = item / B, lane = item - p * B;
    const uint64_t at = (uint64_t)keys[p] * B + lane;
    const bool done = peeled_round[p] != kNotPeeled;
    peeled += (lane == 0 && done) ? 1u : 0u;
    if (at < L.numel) out[at] = done ? (float)key_val[p * B + lane] : __int_as_float(0x7fc00000);
  }
  warp_add(&counters->peeled, peeled);
}

}  // namespace gpu
}  // namespace lhc
