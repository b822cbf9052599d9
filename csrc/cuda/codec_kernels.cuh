// codec_kernels.cuh -- CUDA kernels of the lossless codec (encode, index decode, peeling, output).
//
// Device code only: this file compiles under nvcc (included by codec_cuda.cu, which adds the host
// launcher of the compiled module lossless_hc._C_cuda) and under NVRTC (loaded at run time through
// CuPy by lossless_hc/_cuda.py), so it includes nothing but csrc/lhc_layout.h and uses no host API.
// The launch sequence (which kernel, grid, scratch buffers) lives in one place, lossless_hc/_cuda.py,
// shared by both ways of loading these kernels.
//
// Calling convention: every kernel parameter is 8 bytes (a pointer, a uint64_t or a double), so a
// launcher can pass any kernel's arguments as an array of 64-bit words. The codec layout travels as
// a device array of uint64 words (LayoutWord below, mirrored by _cuda.LAYOUT_WORDS).
//
// Agreement with the CPU backend: cells, signs, groups and digit packing come from lhc_layout.h, so
// the index words and header fields are bitwise equal to csrc/cpu/codec_cpu.cpp's; sketch cells are
// float sums of the same terms (atomicAdd order differs, so values agree within float rounding).
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
#pragma once

#include "../lhc_layout.h"

namespace lhc {
namespace gpu {

// Order of the uint64 words describing a CodecLayout (mirrored by lossless_hc/_cuda.py LAYOUT_WORDS).
enum LayoutWord : int {
  kLwNumel = 0,
  kLwNumKeys,
  kLwBlock,
  kLwIndexKind,
  kLwSketchSegLen,
  kLwSketchSegCount,
  kLwSketchStream,
  kLwBloomSegLen,
  kLwBloomSegCount,
  kLwBloomStream,
  kLwIndexBase,
  kLwIndexPerWord,
  kLwIndexDigits,
  kLwDigitCap,
  kLwCapacity,
  kLwFingerprint,
  kLwIndexOffset,
  kLwSketchOffset,
  kLwPayloadNumel,
  kLayoutWords,
};

// Encode statistics (device, zeroed by the caller before encode).
struct EncodeCounters {
  unsigned long long keys;  // non-zero keys of this rank
  unsigned int non_finite;  // 1 if the input held NaN/Inf
  unsigned int saturated;   // 1 if a Bloom counter hit its per-rank cap
};

// Decode statistics and failure flags (device, zeroed by the caller before decode). The host reads
// this struct once at the end of decode and turns the flags into a status with the CPU backend's
// precedence (lossless_hc/_cuda.py decode_status).
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

// The host (lossless_hc/_cuda.py) allocates and reads these structs by these sizes.
static_assert(sizeof(EncodeCounters) == 16, "EncodeCounters: 16 bytes");
static_assert(sizeof(DecodeCounters) == 64, "DecodeCounters: 64 bytes");
static_assert(sizeof(PeelControl) <= 64, "PeelControl: at most 64 bytes");

constexpr unsigned int kNotPeeled = 0xffffffffu;
constexpr unsigned int kPairRound = 0xfffffffeu;  // peeled_round of a key solved as part of a pair
constexpr unsigned int kNoCell = 0xffffffffu;
constexpr unsigned int kMaxCellDegree = 255;   // as the CPU backend: a denser cell cannot peel
constexpr int kTileThreads = 256;              // threads of the ordered-compaction kernels
constexpr int kTileRounds = 8;                 // items per thread and tile
constexpr int kTileItems = kTileThreads * kTileRounds;
constexpr int kMaxPerWord = 22;                // base >= 2 and base^per_word <= 2^22

__device__ __forceinline__ CodecLayout load_layout(const uint64_t* w) {
  CodecLayout L;
  L.numel = w[kLwNumel];
  L.num_keys = w[kLwNumKeys];
  L.block = w[kLwBlock];
  L.index_kind = (int32_t)w[kLwIndexKind];
  L.sketch.seg_len = w[kLwSketchSegLen];
  L.sketch.seg_count = w[kLwSketchSegCount];
  L.sketch.stream = w[kLwSketchStream];
  L.bloom.seg_len = w[kLwBloomSegLen];
  L.bloom.seg_count = w[kLwBloomSegCount];
  L.bloom.stream = w[kLwBloomStream];
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
// Encode
// -------------------------------------------------------------------------------------------------

// Everything a non-zero key contributes except its values: count, index digit(s).
__device__ __forceinline__ void encode_key_index(const CodecLayout& L, uint32_t key, float* payload,
                                                 unsigned int* bloom_count, const float* pw) {
  if (L.index_kind == kIndexBitmap) {
    const uint32_t per_word = L.index.per_word;
    atomicAdd(payload + L.index_offset + key / per_word, pw[key % per_word]);
  } else if (L.index_kind == kIndexBloom) {
    const uint64_t h = key_hash(L.bloom, key);
    int sign;
#pragma unroll
    for (int j = 0; j < 3; ++j) atomicAdd(bloom_count + key_cell(L.bloom, h, j, &sign), 1u);
  }
}

// block == 1: one pass over x finds the non-zero keys, adds their index digits and scatters their
// values into the sketch. -0.0 counts as zero (as on the CPU). Grid-stride over 4-element groups.
extern "C" __global__ void lhc_encode_scan_b1(const uint64_t* layout, const float* x, float* payload,
                                              unsigned int* bloom_count, EncodeCounters* counters) {
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
        encode_key_index(L, key, payload, bloom_count, pw);
        const float value = __uint_as_float(u[e]);
        const uint64_t h = key_hash(L.sketch, key);
#pragma unroll
        for (int j = 0; j < 3; ++j) {
          int sign;
          const uint64_t cell = key_cell(L.sketch, h, j, &sign);
          atomicAdd(sketch + cell, sign < 0 ? -value : value);
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
                                           unsigned int* bloom_count, EncodeCounters* counters) {
  __shared__ float pw[kMaxPerWord];
  const CodecLayout L = load_layout(layout);
  load_powers(L.index, pw);
  unsigned int found = 0;  // one counter atomic per warp, as in lhc_encode_scan_b1
  for (uint64_t k = global_thread(); k < L.num_keys; k += grid_threads()) {
    const unsigned int on = key_flag[k];
    if (on) encode_key_index(L, (uint32_t)k, payload, bloom_count, pw);
    found += on;
  }
  warp_add(&counters->keys, found);
}

// block > 1, pass 3: scatter every coordinate of a flagged key into its three cells.
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
      int sign;
      const uint64_t cell = key_cell(L.sketch, h, j, &sign);
      atomicAdd(sketch + cell * L.block + lane, sign < 0 ? -value : value);
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

// Bitmap word w: the non-zero digits' count, and (when `out` is given) their key positions written
// to out[at], out[at + 1], ... below out[cap]. Flags invalid words and digits (a digit above
// world_size, a position past num_keys).
struct BitmapWord {
  const CodecLayout* L;
  const float* index;
  double scale;
  long long limit;
  uint64_t world_size;
  __device__ __forceinline__ unsigned int visit(uint64_t w, uint32_t* out, unsigned long long at, uint64_t cap,
                                                unsigned long long* digit_sum, bool* bad) const {
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
      if (pos >= L->num_keys || digit > world_size) { *bad = true; continue; }
      if (out && at + count < cap) out[at + count] = (uint32_t)pos;
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

// Bitmap decode, step 1: count each tile's support keys, validate words, sum the digits.
extern "C" __global__ void lhc_bitmap_count(const uint64_t* layout, const float* payload, double scale,
                                            uint64_t world_size, unsigned long long* tile_sum,
                                            DecodeCounters* counters) {
  const CodecLayout L = load_layout(layout);
  const BitmapWord word{&L, payload + L.index_offset, scale, digit_limit(L.index), world_size};
  unsigned long long digit_sum = 0;
  bool bad = false;
  tile_count(L.index.words(), tile_sum, [&](uint64_t w) { return word.visit(w, nullptr, 0, 0, &digit_sum, &bad); });
  if (digit_sum) atomicAdd(&counters->index_total, digit_sum);
  if (bad) atomicOr(&counters->flags, (unsigned int)kFlagIndexWord);
  if (global_thread() == 0) counters->expected_total = header_index_total(L, payload, scale);
}

// Bitmap decode, step 3: write the support keys in increasing order (keys[0, cap)).
extern "C" __global__ void lhc_bitmap_write(const uint64_t* layout, const float* payload, double scale,
                                            uint64_t world_size, const unsigned long long* tile_offset,
                                            uint32_t* keys, uint64_t cap, const DecodeCounters* counters) {
  if (counters->abort) return;
  const CodecLayout L = load_layout(layout);
  const BitmapWord word{&L, payload + L.index_offset, scale, digit_limit(L.index), world_size};
  unsigned long long ignored = 0;
  bool bad = false;
  tile_emit(
      L.index.words(), tile_offset, [&](uint64_t w) { return word.visit(w, nullptr, 0, 0, &ignored, &bad); },
      [&](uint64_t w, unsigned long long at) { word.visit(w, keys, at, cap, &ignored, &bad); });
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
  int sign;
  return bcount[key_cell(L.bloom, h, 0, &sign)] && bcount[key_cell(L.bloom, h, 1, &sign)] &&
         bcount[key_cell(L.bloom, h, 2, &sign)];
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
  SegmentedTable t;
  t.seg_len = table_words[0];
  t.seg_count = table_words[1];
  t.stream = table_words[2];
  const uint32_t n = list_length(counters);
  bool over = false;
  for (uint64_t p = global_thread(); p < n; p += grid_threads()) {
    const uint64_t h = key_hash(t, keys[p]);
#pragma unroll
    for (int j = 0; j < 3; ++j) {
      int sign;
      const uint64_t c = key_cell(t, h, j, &sign);
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
                                         int signs[3]) {
  key_cells(t, key, cells, signs);
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
    int signs[3];
    if (cell_slot(t, keys[p], c, cells, signs) < 0) { *bad = true; continue; }
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
  SegmentedTable t;
  t.seg_len = table_words[0];
  t.seg_count = table_words[1];
  t.stream = table_words[2];
  const uint32_t nkeys = (uint32_t)counters->candidates;
  volatile PeelControl* vc = control;
  bool bad = false;
  for (unsigned int r = 0;; ++r) {
    const unsigned int par = r & 1u;
    // Queues by round parity, selected without indexing a local array (which would live in local memory).
    unsigned int* const pure_now = par ? pure1 : pure0;
    unsigned int* const pure_next = par ? pure0 : pure1;
    unsigned int* const list_now = par ? list1 : list0;
    const unsigned int npure = vc->pure[par];
    if (npure == 0 || r > nkeys) break;
    if (global_thread() == 0) {
      control->pure[par ^ 1u] = 0;
      control->keys[par ^ 1u] = 0;
      control->rounds = r + 1;
    }
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
      int signs[3];
      key_cells(t, keys[p], cells, signs);
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

// Fill the adjacency: adj[offsets[c] + slot] = (position << 1) | (sign < 0) for each key in c.
// The slot order depends on scheduling; lhc_sort_adjacency fixes it.
extern "C" __global__ void lhc_fill_adjacency(const uint64_t* table_words, const uint32_t* keys,
                                              const unsigned int* offsets, unsigned int* cursor, unsigned int* adj,
                                              const DecodeCounters* counters) {
  if (counters->abort) return;
  SegmentedTable t;
  t.seg_len = table_words[0];
  t.seg_count = table_words[1];
  t.stream = table_words[2];
  const uint32_t n = (uint32_t)counters->support;  // list_count now holds the degree scan's total
  for (uint64_t p = global_thread(); p < n; p += grid_threads()) {
    uint64_t cells[3];
    int signs[3];
    key_cells(t, keys[p], cells, signs);
#pragma unroll
    for (int j = 0; j < 3; ++j) {
      const unsigned int slot = atomicAdd(cursor + cells[j], 1u);
      adj[offsets[cells[j]] + slot] = ((unsigned int)p << 1) | (unsigned int)(signs[j] < 0);
    }
  }
}

// Sort each cell's adjacency by key position (insertion sort: at most kMaxCellDegree entries, ~2.4
// on average), so phase C subtracts in a fixed order; and set xr[c] to the XOR of the cell's key
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
      x ^= v >> 1;
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
// its cell, C) every touched cell subtracts, in increasing key position, the keys peeled this round
// (walking its sorted adjacency), updates its degree and queues itself if left with one key.
// Work items of B and C are (entry, lane) pairs, so wide blocks spread over threads.
extern "C" __global__ void lhc_peel_values(const uint64_t* table_words, uint64_t block, const uint32_t* keys,
                                           double* val, unsigned int* deg, unsigned int* xr, unsigned int* src,
                                           unsigned int* peeled_round, double* key_val, const unsigned int* offsets,
                                           const unsigned int* adj, unsigned int* stamp, unsigned int* pure0,
                                           unsigned int* pure1, unsigned int* list0, unsigned int* list1,
                                           unsigned int* dirty0, unsigned int* dirty1, PeelControl* control,
                                           DecodeCounters* counters) {
  if (*(volatile unsigned int*)&counters->abort) return;  // uniform: set before this launch
  SegmentedTable t;
  t.seg_len = table_words[0];
  t.seg_count = table_words[1];
  t.stream = table_words[2];
  const uint32_t nkeys = (uint32_t)counters->support;
  volatile PeelControl* vc = control;
  bool bad = false;
  for (unsigned int r = 0;; ++r) {
    const unsigned int par = r & 1u;
    unsigned int* const pure_now = par ? pure1 : pure0;
    unsigned int* const pure_next = par ? pure0 : pure1;
    unsigned int* const list_now = par ? list1 : list0;
    unsigned int* const dirty_now = par ? dirty1 : dirty0;
    const unsigned int npure = vc->pure[par];
    if (npure == 0 || r > nkeys) break;
    if (global_thread() == 0) {
      control->pure[par ^ 1u] = 0;
      control->keys[par ^ 1u] = 0;
      control->dirty[par ^ 1u] = 0;
      control->rounds = r + 1;
    }
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
      int signs[3];
      const int slot = cell_slot(t, keys[p], c, cells, signs);
      if (slot < 0) { bad = true; continue; }  // a guard: propose checked c is one of p's cells
      const int sign = slot == 0 ? signs[0] : slot == 1 ? signs[1] : signs[2];  // no local-memory indexing
      key_val[(uint64_t)p * block + lane] = (double)sign * load_cg(val + (uint64_t)c * block + lane);
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
    // C: touched cells subtract this round's keys in adjacency (key position) order.
    const unsigned int ndirty = vc->dirty[par];
    for (uint64_t item = global_thread(); item < (uint64_t)ndirty * block; item += grid_threads()) {
      const uint64_t i = item / block, lane = item - i * block;
      const unsigned int c = load_cg(dirty_now + i);
      const unsigned int begin = offsets[c], end = offsets[c + 1];
      double v = load_cg(val + (uint64_t)c * block + lane);
      unsigned int removed = 0, removed_xor = 0;
      for (unsigned int e = begin; e < end; ++e) {
        const unsigned int entry = adj[e];
        const unsigned int p = entry >> 1;
        if (load_cg(peeled_round + p) != r) continue;
        const double kv = load_cg(key_val + (uint64_t)p * block + lane);
        v = (entry & 1u) ? v + kv : v - kv;
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
// same three cells, each holding just the two of them, and relative signs t_j = s_j(a) s_j(b) not
// all equal, then with A_j = s_j(a) R_j and q the first cell with t_q != t_0,
//     v_a = (A_0 + A_q) / 2,    v_b = t_0 (A_0 - A_q) / 2.
// Pairs are disjoint (their cells hold nothing else), so threads never touch the same key or cell;
// each writes its keys' values, source cell (their first cell) and round kPairRound.
extern "C" __global__ void lhc_solve_pairs(const uint64_t* table_words, uint64_t block, const uint32_t* keys,
                                           const double* val, const unsigned int* deg, unsigned int* src,
                                           unsigned int* peeled_round, double* key_val, const unsigned int* offsets,
                                           const unsigned int* adj, DecodeCounters* counters) {
  if (counters->abort) return;
  SegmentedTable t;
  t.seg_len = table_words[0];
  t.seg_count = table_words[1];
  t.stream = table_words[2];
  const uint64_t first_cells = t.groups() * t.seg_len;  // cells of the groups' first segments
  for (uint64_t i = global_thread(); i < first_cells; i += grid_threads()) {
    const uint64_t c = (i / t.seg_len) * t.group_cells() + i % t.seg_len;
    if (deg[c] != 2u) continue;
    // The cell's two unresolved keys, in position order (the adjacency is sorted).
    unsigned int ab[2], found = 0;
    for (unsigned int e = offsets[c]; e < offsets[c + 1]; ++e) {
      const unsigned int p = adj[e] >> 1;
      if (peeled_round[p] != kNotPeeled) continue;
      if (found < 2) ab[found] = p;
      ++found;
    }
    if (found != 2) continue;
    uint64_t ca[3], cb[3];
    int sa[3], sb[3];
    key_cells(t, keys[ab[0]], ca, sa);
    key_cells(t, keys[ab[1]], cb, sb);
    if (ca[0] != c || ca[0] != cb[0] || ca[1] != cb[1] || ca[2] != cb[2] || deg[ca[1]] != 2u || deg[ca[2]] != 2u)
      continue;
    const int t0 = sa[0] * sb[0], t1 = sa[1] * sb[1], t2 = sa[2] * sb[2];
    if (t0 == t1 && t0 == t2) continue;  // proportional signs: unsolvable
    const uint64_t cq = t0 != t1 ? ca[1] : ca[2];
    const double s0 = (double)sa[0], sq = (double)(t0 != t1 ? sa[1] : sa[2]);
    for (uint64_t lane = 0; lane < block; ++lane) {
      const double A0 = s0 * val[c * block + lane], Aq = sq * val[cq * block + lane];
      key_val[(uint64_t)ab[0] * block + lane] = 0.5 * (A0 + Aq);
      key_val[(uint64_t)ab[1] * block + lane] = (double)t0 * (0.5 * (A0 - Aq));
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
