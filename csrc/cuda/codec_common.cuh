// The lossless codec's CUDA kernels (see codec_kernels.cuh, the entry header): what every stage
// shares -- the layout words, the device counters and control blocks, grid barriers, scans and queues,
// and the multilevel index's level shapes.
#pragma once

#include "../lhc_ancestry.h"
#include "../lhc_layout.h"
#include "../lhc_status.h"
#include "warp_sum.cuh"

namespace lhc {
namespace gpu {

// Encode statistics (device, zeroed by the caller before encode).
struct EncodeCounters {
  unsigned long long keys;  // non-zero keys of this rank
  unsigned int non_finite;  // 1 if the input held NaN/Inf
  unsigned int saturated;   // 1 if a Bloom counter hit its per-rank cap
  unsigned long long check[2];  // the index checksum's sums of part_f over the keys (each thread's mod p_f)
};

// Decode statistics and failure flags (device, zeroed by the caller before decode). The last kernel
// of decode (lhc_decode_status) turns the flags into `status`; the host reads this struct once, at
// the end of decode.
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
  unsigned int status;                 // DecodeStatus (lhc_status.h), written by lhc_decode_status
  unsigned int pad;
  unsigned long long check[2];         // the decoded support's sum of count(k) * part_f(k) (lhc_layout.h)
  unsigned long long expected_check[2];  // header_index_check of the header's two fields
  unsigned long long list_total;       // scratch: the last compaction's length before list_count's clamp
  unsigned long long support_total;    // keys with an aggregated count >= 1, beyond the list's cap too
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
  kFlagSketchCorrupt = 1u << 10,   // a mass cell disagrees with its degree, or a residual exceeds its bound
  kFlagInexact = 1u << 11,         // some key's error bound exceeds rtol
  kFlagIndexCheck = 1u << 12,      // the decoded support fails the header's index checksum
};

// The index checksum on a complete support (one thread, once the support is known): whether the decoded
// support's sums match the header's (lhc::index_check_matches, with the header's fields read by the
// index kernels into expected_check). Where they do not, raises kFlagIndexCheck and abort: a support
// that fails it is not peeled, so `out` stays zero, as on the CPU backend.
__device__ __forceinline__ bool index_check_passes_or_aborts(DecodeCounters* counters) {
  for (uint32_t f = 0; f < kIndexCheckFields; ++f)
    if (counters->expected_check[f] != counters->check[f] % index_check_prime(f)) {
      counters->flags |= kFlagIndexCheck;
      counters->abort = 1;
      return false;
    }
  return true;
}

// The DecodeStatus of a decode's flags, with the CPU backend's precedence (csrc/cpu/: the first
// failing stage decides): the multilevel index's own verdict `index_status` (MlState::status, 0 if
// it passed); an index word or total wrong; the Bloom count peel's failures; the index checksum
// (a complete support whose counts disagree with the header's, as lhc::cpu::decode); inconsistent value
// states; a non-finite sketch cell; support keys the value peel did not recover (a support or
// cell-degree overflow among them); a corrupt sketch (mass or residual check); and last, keys
// whose error bound exceeds rtol.
__device__ __forceinline__ unsigned int decode_status(int index_kind, unsigned int flags, unsigned long long support,
                                                      unsigned long long peeled, unsigned int index_status) {
  if (index_status) return index_status;
  if (flags & (kFlagIndexWord | kFlagIndexTotal)) return kDecodeIndexCorrupt;
  if (index_kind == kIndexBloom) {
    if (flags & kFlagCandOverflow) return kDecodeIndexPeelFailed;
    if (flags & kFlagCountBad) return kDecodeIndexCorrupt;
    if (flags & kFlagCountUnresolved) return kDecodeIndexPeelFailed;
    if (flags & kFlagCountLeftover) return kDecodeIndexCorrupt;
  }
  if (flags & kFlagIndexCheck) return kDecodeIndexCorrupt;
  if (flags & kFlagValueBad) return kDecodeIndexCorrupt;
  if (flags & kFlagNonFinite) return kDecodeSketchNonFinite;
  if ((flags & (kFlagSupportOverflow | kFlagDegreeOverflow)) || peeled != support) return kDecodeSketchPeelFailed;
  if (flags & kFlagSketchCorrupt) return kDecodeSketchCorrupt;
  if (flags & kFlagInexact) return kDecodeInexact;
  return kDecodeOk;
}

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

// The host (lossless_hc/backends/cuda_lhc.py) allocates and reads these structs by these sizes.
static_assert(sizeof(EncodeCounters) == 32, "EncodeCounters: 32 bytes");
static_assert(sizeof(DecodeCounters) == 120, "DecodeCounters: 120 bytes");
static_assert(sizeof(PeelControl) <= 64, "PeelControl: at most 64 bytes");
static_assert(sizeof(MlState) == 80, "MlState: 80 bytes");

constexpr unsigned int kNotPeeled = 0xffffffffu;
constexpr unsigned int kPairRound = 0xfffffffeu;  // peeled_round of a key solved as part of a pair
constexpr unsigned int kNoCell = 0xffffffffu;
constexpr double kReadCell = -1.0;  // acc of a value cell a key was read from (csrc/cpu/peel.h, the same)
constexpr double kPairCell = -2.0;  // acc of a value cell a solved pair was read from
constexpr int kTileThreads = 256;              // threads of the ordered-compaction kernels
constexpr int kTileRounds = 8;                 // items per thread and tile
constexpr int kTileItems = kTileThreads * kTileRounds;
constexpr int kMaxPerWord = 22;                // base >= 2 and base^per_word <= 2^22

// The layout words (LayoutWord, csrc/lhc_layout.h) as the kernels read them: a table from its four
// words (the launcher passes the value sketch's or the Bloom table's address), and the codec's scalar
// fields (a fine level's words are read by ml_level, where a kernel needs one).
__device__ __forceinline__ SegmentedTable load_table(const uint64_t* w) { return table_from_words(w); }
__device__ __forceinline__ CodecLayout load_layout(const uint64_t* w) { return layout_from_words(w, false); }

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

}  // namespace gpu
}  // namespace lhc
