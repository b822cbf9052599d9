// The lossless codec's CUDA kernels (see codec_kernels.cuh): decoding the bitmap and Bloom indexes
// (ordered compaction of the support), and the peeling states and exact count peel of the Bloom index.
#pragma once

#include "codec_common.cuh"

namespace lhc {
namespace gpu {

// -------------------------------------------------------------------------------------------------
// Decode: index
// -------------------------------------------------------------------------------------------------

// An index word as an exact integer in [0, limit), or -1 (the CPU backend's word_integers,
// csrc/cpu/digits.h): a summed word must be an integer, an averaged one (scale != 1) is within 1/2 of
// one.
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

// A thread's share of the decoded support's index checksum sums, sum of count(k) * part_f(k)
// (lhc_layout.h), added to DecodeCounters::check once at the end. Integer sums: order-free.
struct SupportCheckSums {
  uint64_t stream;
  unsigned long long sum[2] = {0ull, 0ull};
  __device__ explicit SupportCheckSums(const CodecLayout& L) : stream(index_check_stream(L.sketch.stream)) {}
  __device__ __forceinline__ void add(uint64_t key, uint32_t count) {
    uint32_t part[2];
    index_check_parts(stream, key, part);
    sum[0] += (unsigned long long)count * part[0];
    sum[1] += (unsigned long long)count * part[1];
  }
  // Every lane of the warp, converged (warp_add_u64).
  __device__ __forceinline__ void flush(DecodeCounters* counters) const {
    warp_add_u64(&counters->check[0], sum[0]);
    warp_add_u64(&counters->check[1], sum[1]);
  }
};

// The header's index checksum (one thread, beside expected_total).
__device__ __forceinline__ void read_expected_check(const float* payload, double scale, DecodeCounters* counters) {
  for (uint32_t f = 0; f < kIndexCheckFields; ++f) counters->expected_check[f] = header_index_check(payload, scale, f);
}

// Counting-bitmap word w (the bitmap index, or the multilevel index's coarse level): the non-zero
// digits' count, and (when `out` is given) their positions written to out[at], out[at + 1], ... below
// out[cap], with their digits in counts[...] when `counts` is given; each (position, digit) added to
// `check` when given (the bitmap index, whose positions are keys). Flags invalid words and digits
// (a digit above world_size, a non-zero digit at a position past `positions`).
struct BitmapWord {
  const CodecLayout* L;
  const float* index;
  double scale;
  long long limit;
  uint64_t world_size;
  uint64_t positions;  // digits that may be non-zero: num_keys (bitmap), the level-0 nodes (multilevel)
  __device__ __forceinline__ unsigned int visit(uint64_t w, uint32_t* out, uint32_t* counts, unsigned long long at,
                                                uint64_t cap, unsigned long long* digit_sum, bool* bad,
                                                SupportCheckSums* check = nullptr) const {
    const float f = index[w];
    if (__float_as_uint(f) == 0u) return 0;
    const long long u = read_word(f, scale, limit);
    if (u < 0) { *bad = true; return 0; }
    uint32_t rest = (uint32_t)u;  // below base^per_word <= kIntFieldLimit: 32-bit division, not 64-bit
    unsigned int count = 0;
    const uint32_t base = L->index.base;
    for (uint32_t i = 0; i < L->index.per_word && rest; ++i) {
      const uint32_t digit = rest % base;
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
      if (check) check->add(pos, digit);
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
// goes to counters->list_total and, clamped to `cap` (with `overflow_flag` and abort raised above it),
// to counters->list_count.
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
    counters->list_total = total;
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
// Pass 1: count each tile's non-zero digits, validate the words, add the digits' sum to *digit_total
// (and, with `keys`, the digits to the index checksum: the bitmap index's positions are its keys).
__device__ inline void count_bitmap_tiles(const CodecLayout& L, const float* payload, double scale,
                                          uint64_t world_size, uint64_t positions, unsigned long long* tile_sum,
                                          unsigned long long* digit_total, DecodeCounters* counters, bool keys) {
  const BitmapWord word{&L, payload + L.index_offset, scale, digit_limit(L.index), world_size, positions};
  unsigned long long digit_sum = 0;
  bool bad = false;
  SupportCheckSums check(L);
  tile_count(L.index.words(), tile_sum,
             [&](uint64_t w) { return word.visit(w, nullptr, nullptr, 0, 0, &digit_sum, &bad, keys ? &check : nullptr); });
  warp_add_u64(digit_total, digit_sum);
  if (keys) check.flush(counters);  // keys: the same on every thread
  if (bad) atomicOr(&counters->flags, (unsigned int)kFlagIndexWord);
  if (global_thread() == 0) {
    counters->expected_total = header_index_total(L, payload, scale);
    read_expected_check(payload, scale, counters);
  }
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
  count_bitmap_tiles(L, payload, scale, world_size, L.num_keys, tile_sum, &counters->index_total, counters, true);
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
    uint32_t rest = (uint32_t)u;  // below base^per_word <= kIntFieldLimit: 32-bit division
    for (uint32_t i = 0; i < L.index.per_word && rest; ++i) {
      const uint32_t digit = rest % L.index.base;
      rest /= L.index.base;
      if (!digit) continue;
      const uint64_t pos = w * L.index.per_word + i;
      if (pos >= cells || digit > digit_max) { bad = true; continue; }
      bcount[pos] = (int)digit;
      digit_sum += digit;
    }
  }
  warp_add_u64(&counters->index_total, digit_sum);  // every thread leaves the loop above
  if (bad) atomicOr(&counters->flags, (unsigned int)kFlagIndexWord);
  if (global_thread() == 0) {
    counters->expected_total = header_index_total(L, payload, scale);
    read_expected_check(payload, scale, counters);
  }
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

// The candidates in increasing order (cand[0, cap)). `candidates` gets their exact number, as the CPU
// backend reports it; past the cap the scan raised abort, and no later kernel reads the list.
extern "C" __global__ void lhc_bloom_cand_write(const uint64_t* layout, const int* bcount,
                                                const unsigned long long* tile_offset, uint32_t* cand, uint64_t cap,
                                                DecodeCounters* counters) {
  if (global_thread() == 0) counters->candidates = counters->list_total;
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
// past kMaxCellDegree (lhc_layout.h) raises `degree_flag` (the decode fails as SKETCH_PEEL_FAILED, as
// on the CPU).
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

// The found keys counted per tile, and their counts added to the index checksum, after a successful
// count peel; after a failed index none (the failure decides the status, and the report gives no
// support), and the candidates may outnumber their list.
extern "C" __global__ void lhc_found_count(const uint64_t* layout, const uint32_t* cand, const int* key_count,
                                           unsigned long long* tile_sum, DecodeCounters* counters) {
  const CodecLayout L = load_layout(layout);
  const uint32_t n = counters->abort ? 0u : (uint32_t)counters->candidates;  // uniform: set before this launch
  SupportCheckSums check(L);
  tile_count(n, tile_sum, [&](uint64_t p) {
    const int c = key_count[p];
    if (c >= 1) check.add(cand[p], (uint32_t)c);
    return (unsigned int)(c >= 1);
  });
  check.flush(counters);
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

}  // namespace gpu
}  // namespace lhc
