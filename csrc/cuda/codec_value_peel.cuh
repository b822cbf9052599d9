// The lossless codec's CUDA kernels (see codec_kernels.cuh): decode's value peel over the support, the
// two-key pairs it leaves, and the output.
#pragma once

#include "codec_index.cuh"

namespace lhc {
namespace gpu {

// -------------------------------------------------------------------------------------------------
// Decode: value peel
// -------------------------------------------------------------------------------------------------

// Support size known (after the last compaction): record it (the list's length, and the count beyond
// its cap that the report gives, as the CPU backend's), and check the index checksum. A support that
// fails it is not peeled (abort), so `out` stays zero, as on the CPU backend.
extern "C" __global__ void lhc_support_ready(DecodeCounters* counters, uint64_t support_is_candidates) {
  if (global_thread() != 0) return;
  counters->support = counters->list_count;
  counters->support_total = counters->list_total;
  if (support_is_candidates) counters->candidates = counters->list_total;
  index_check_passes_or_aborts(counters);
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
// the support list there (lossless_hc/backends/cuda_lhc.py MAX_PEEL_POSITIONS).
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

// Each cell's own rounding bound acc[c] = cell_error_bound(mass, deg, n) (lhc_layout.h; rounded up to a
// float, as every update of acc is: the CPU backend keeps its bounds as floats), and
// the mass check: a cell holds support keys exactly when its mass is positive (else the sketch is
// corrupt: an all-zero sketch under a valid index, a flipped mass word); a NaN/Inf mass is flagged as
// a non-finite cell. After lhc_build_states (deg is final).
extern "C" __global__ void lhc_load_bounds(const uint64_t* layout, const float* payload, const unsigned int* deg,
                                           uint64_t world_size, double* acc, DecodeCounters* counters) {
  if (counters->abort) return;
  const CodecLayout L = load_layout(layout);
  const float* mass = payload + mass_offset(L);
  const uint64_t cells = L.sketch.cells();
  unsigned int flags = 0;
  for (uint64_t c = global_thread(); c < cells; c += grid_threads()) {
    const float f = mass[c];
    if ((__float_as_uint(f) & 0x7f800000u) == 0x7f800000u) flags |= kFlagNonFinite;
    const double m = (double)f;
    if ((deg[c] > 0u) != (m > 0.0)) flags |= kFlagSketchCorrupt;
    acc[c] = round_up_to_float(cell_error_bound(m, deg[c], world_size));
  }
  if (flags) atomicOr(&counters->flags, flags);
}

// After a support or cell-degree overflow (more support keys than the value peel holds, or a cell of
// too many keys: the loads above and the peel are skipped), a NaN/Inf sketch or mass cell still takes
// precedence, as in the CPU backend's status order, which loads every cell whatever the support (the
// mass channel follows the value sketch: one pass over both).
extern "C" __global__ void lhc_overflow_finite(const uint64_t* layout, const float* payload,
                                               DecodeCounters* counters) {
  if (!(counters->flags & (kFlagSupportOverflow | kFlagDegreeOverflow))) return;
  const CodecLayout L = load_layout(layout);
  const float* sketch = payload + L.sketch_offset;
  bool non_finite = false;
  for (uint64_t i = global_thread(); i < L.sketch.cells() * (L.block + 1); i += grid_threads())
    non_finite |= (__float_as_uint(sketch[i]) & 0x7f800000u) == 0x7f800000u;
  if (non_finite) atomicOr(&counters->flags, (unsigned int)kFlagNonFinite);
}

// The value peel (cooperative launch): rounds of A) propose, B) read each proposed key's value from
// its cell (R / w, as R times the exact inverse of the key's weight there), C) every touched cell
// subtracts w * v, in increasing key position, for the keys peeled this round (walking its sorted
// adjacency, which carries their weight codes), updates its degree and queues itself if left with
// one key. Products by +-1, +-2 and their inverses are exact, so each step rounds once.
// Work items of B and C are (entry, lane) pairs, so wide blocks spread over threads.
// Error bounds ride along: B gives a key the bound of its cell (acc, which C of earlier rounds made
// the cell's own bound plus |w| E of every other key of the cell) over |w|, in key_err; C adds |w| E
// of this round's keys to the bounds of their other cells, in adjacency order, rounding up to a float
// after each addition. These are the CPU backend's peel_layers and operations exactly (its layers are
// these rounds, its keys resolved in position order), so values and bounds agree bit for bit. B flags
// a key in `inexact` where a lane misses rtol with E (lhc_layout.h within_rtol); with verify,
// lhc_verify_values adds F after the residual check, walking the rounds back: B also writes the
// round's keys to order[round_start[r] ...], round_start[rounds] = the total.
extern "C" __global__ void lhc_peel_values(const uint64_t* table_words, uint64_t block, const uint32_t* keys,
                                           double* val, unsigned int* deg, unsigned int* xr, unsigned int* src,
                                           unsigned int* peeled_round, double* key_val, const unsigned int* offsets,
                                           const unsigned int* adj, unsigned int* stamp, unsigned int* pure0,
                                           unsigned int* pure1, unsigned int* list0, unsigned int* list1,
                                           unsigned int* dirty0, unsigned int* dirty1, PeelControl* control,
                                           DecodeCounters* counters, double* acc, double* key_err,
                                           unsigned int* order, unsigned int* round_start, unsigned int* inexact,
                                           double rtol) {
  if (*(volatile unsigned int*)&counters->abort) return;  // uniform: set before this launch
  const SegmentedTable t = load_table(table_words);
  const uint32_t nkeys = (uint32_t)counters->support;
  volatile PeelControl* vc = control;
  bool bad = false, any_inexact = false;
  unsigned int done = 0;  // keys peeled in the rounds before (the same in every thread)
  for (unsigned int r = 0;; ++r) {
    PeelRound q;
    if (global_thread() == 0) round_start[r] = done;  // r <= nkeys + 1: within its kcap + 2 entries
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
      const double v = inverse_weight(w) * load_cg(val + (uint64_t)c * block + lane);
      const double err = fabs(inverse_weight(w)) * load_cg(acc + c);  // acc is read-only in B
      key_val[(uint64_t)p * block + lane] = v;
      if (!within_rtol(v, err, rtol)) {
        inexact[p] = 1u;  // every writer stores 1
        any_inexact = true;
      }
      if (lane == 0) {
        key_err[p] = err;
        order[done + i] = p;
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
    done += nlist;
    grid_barrier(control->barrier);
    // C: touched cells subtract this round's keys (w * v) in adjacency (key position) order.
    const unsigned int ndirty = vc->dirty[par];
    for (uint64_t item = global_thread(); item < (uint64_t)ndirty * block; item += grid_threads()) {
      const uint64_t i = item / block, lane = item - i * block;
      const unsigned int c = load_cg(dirty_now + i);
      const unsigned int begin = offsets[c], end = offsets[c + 1];
      double v = load_cg(val + (uint64_t)c * block + lane);
      double a = lane == 0 ? load_cg(acc + c) : 0.0;
      unsigned int removed = 0, removed_xor = 0;
      for (unsigned int e = begin; e < end; ++e) {
        const unsigned int entry = adj[e];
        const unsigned int p = adj_position(entry);
        if (load_cg(peeled_round + p) != r) continue;
        const double kv = load_cg(key_val + (uint64_t)p * block + lane);
        // v - w * kv (weight_of_code), exactly: kv doubled for magnitude 2, added for a negative w.
        const double m = (entry & 1u) ? kv + kv : kv;
        v = (entry & 2u) ? v + m : v - m;
        if (lane == 0) {
          const double ke = load_cg(key_err + p);
          a = round_up_to_float(a + ((entry & 1u) ? ke + ke : ke));  // + |w| E, as the CPU's set_acc
        }
        ++removed;
        removed_xor ^= p;
      }
      val[(uint64_t)c * block + lane] = v;
      if (lane == 0) {
        acc[c] = a;
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
  if (any_inexact) atomicOr(&counters->flags, (unsigned int)kFlagInexact);
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
// Bounds as for a peeled key (the CPU backend's solve_pairs callback): the pair's cells p, q are
// marked as a pair's (acc = kPairCell: they verify nothing upstream); the third cell r gets
// w_r(a) v_a + w_r(b) v_b subtracted and their bounds added, for the residual check. A key is flagged
// inexact where a lane misses rtol with its bound; with verify always (one check cannot verify two
// values: lhc_layout.h verification_bound).
extern "C" __global__ void lhc_solve_pairs(const uint64_t* table_words, uint64_t block, const uint32_t* keys,
                                           double* val, const unsigned int* deg, unsigned int* src,
                                           unsigned int* peeled_round, double* key_val, const unsigned int* offsets,
                                           const unsigned int* adj, DecodeCounters* counters, double* acc,
                                           double* key_err, unsigned int* inexact, double rtol, uint64_t verify) {
  if (counters->abort) return;
  const SegmentedTable t = load_table(table_words);
  bool any_inexact = false;
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
    const int r = 3 - pc.p - pc.q;
    const uint64_t cr = r == 0 ? ca[0] : r == 1 ? ca[1] : ca[2];
    const double war = r == 0 ? wa[0] : r == 1 ? wa[1] : wa[2], wbr = r == 0 ? wb[0] : r == 1 ? wb[1] : wb[2];
    const double ap = acc[cp], aq = acc[cq];
    const double ea = (fabs(wbq) * ap + fabs(wbp) * aq) / fabs(det), eb = (fabs(wap) * aq + fabs(waq) * ap) / fabs(det);
    bool in_a = verify == 0, in_b = verify == 0;
    for (uint64_t lane = 0; lane < block; ++lane) {
      const double Rp = val[cp * block + lane], Rq = val[cq * block + lane];
      const double va = (wbq * Rp - wbp * Rq) / det, vb = (wap * Rq - waq * Rp) / det;
      key_val[(uint64_t)ab[0] * block + lane] = va;
      key_val[(uint64_t)ab[1] * block + lane] = vb;
      val[cr * block + lane] -= war * va + wbr * vb;
      in_a &= within_rtol(va, ea, rtol);
      in_b &= within_rtol(vb, eb, rtol);
    }
    acc[cp] = kPairCell;
    acc[cq] = kPairCell;
    acc[cr] = round_up_to_float(acc[cr] + fabs(war) * ea + fabs(wbr) * eb);  // the CPU's order of additions
    key_err[ab[0]] = ea;
    key_err[ab[1]] = eb;
    if (!in_a) inexact[ab[0]] = 1u;
    if (!in_b) inexact[ab[1]] = 1u;
    any_inexact |= !in_a || !in_b;
    for (int k = 0; k < 2; ++k) {
      src[ab[k]] = (unsigned int)c;
      peeled_round[ab[k]] = kPairRound;
    }
  }
  if (any_inexact) atomicOr(&counters->flags, (unsigned int)kFlagInexact);
}

// After the pairs: the cell each peeled key was read from is marked read (acc = kReadCell: nothing is
// left to check there) and names its reader (reader[c] = the key's position, for lhc_verify_values),
// and a pair's three cells get degree 0 (its third cell is checked).
extern "C" __global__ void lhc_mark_read(const uint64_t* table_words, const uint32_t* keys, const unsigned int* src,
                                         const unsigned int* peeled_round, unsigned int* deg, double* acc,
                                         unsigned int* reader, const DecodeCounters* counters) {
  if (counters->abort) return;
  const SegmentedTable t = load_table(table_words);
  const uint32_t n = (uint32_t)counters->support;
  for (uint64_t p = global_thread(); p < n; p += grid_threads()) {
    const unsigned int r = peeled_round[p];
    if (r == kNotPeeled) continue;
    if (r != kPairRound) {
      acc[src[p]] = kReadCell;
      reader[src[p]] = (unsigned int)p;
      continue;
    }
    uint64_t cells[3];
    int weights[3];
    key_cells(t, keys[p], cells, weights);
#pragma unroll
    for (int j = 0; j < 3; ++j) deg[cells[j]] = 0u;  // both keys of the pair store the same 0
  }
}

// The residual check: every cell left with no key and not read from must be 0 within its bound
// (its own rounding plus the bounds of the keys subtracted from it), else the sketch is corrupt.
// Cells still holding keys (a failed peel, reported as such) are skipped. A checked cell's bound then
// becomes its verification bound V = acc + |residual| (largest lane; lhc_layout.h verification_bound),
// which only lhc_verify_values reads (decodes with verify).
extern "C" __global__ void lhc_residual_check(uint64_t block, uint64_t cells, const double* val,
                                              const unsigned int* deg, double* acc, DecodeCounters* counters) {
  if (counters->abort) return;
  bool corrupt = false;
  for (uint64_t c = global_thread(); c < cells; c += grid_threads()) {
    const double a = acc[c];
    if (deg[c] != 0u || a < 0.0) continue;
    double worst = 0.0;
    for (uint64_t lane = 0; lane < block; ++lane) {
      const double r = fabs(val[c * block + lane]);
      corrupt |= !(r <= a);
      worst = fmax(worst, r);
    }
    acc[c] = round_up_to_float(a + worst);
  }
  if (corrupt) atomicOr(&counters->flags, (unsigned int)kFlagSketchCorrupt);
}

// The value peel's graph for lhc_ancestry.h: a cell's keys from the adjacency, a key's read cell
// from src (none for a solved pair's keys).
struct PeelDag {
  const unsigned int* offsets;
  const unsigned int* adj;
  const unsigned int* src;
  const unsigned int* peeled_round;
  LHC_HD bool parents(uint32_t p, uint64_t* begin, uint64_t* end) const {
    const unsigned int r = peeled_round[p];
    if (r == kPairRound || r == kNotPeeled) return false;
    *begin = offsets[src[p]];
    *end = offsets[src[p] + 1];
    return true;
  }
  LHC_HD uint32_t member(uint64_t e) const { return adj[e] >> kWeightCodeBits; }
};

// Decodes with verify only: the verification bound per key (cooperative launch, after
// lhc_residual_check). The rounds of lhc_peel_values walked back, last round first, each key's
// verification bound G from its two other cells -- a check cell's V, or |w| G of the later key read
// from it (key_ver) -- counting only the cells that verify it soundly (lhc_ancestry.h: none of their
// other keys shares an ancestor with it; the smaller bound tested first), and then the key is listed
// inexact unless both its bound E (key_err) and F = G - E prove every lane within rtol
// (lhc_layout.h verification_bound; the CPU backend's verify_group, in the same operations). Keys of
// one round depend only on later rounds' keys, so a round's keys run in any order. Each thread walks
// ancestries in two AncestrySets of its local memory.
extern "C" __global__ void lhc_verify_values(const uint64_t* table_words, uint64_t block, const uint32_t* keys,
                                             const unsigned int* src, const double* key_val, const unsigned int* order,
                                             const unsigned int* round_start, const unsigned int* reader,
                                             const double* acc, const double* key_err, double* key_ver,
                                             unsigned int* inexact, PeelControl* control, DecodeCounters* counters,
                                             double rtol, const unsigned int* offsets, const unsigned int* adj,
                                             const unsigned int* peeled_round) {
  if (*(volatile unsigned int*)&counters->abort) return;  // uniform: set before this launch
  const SegmentedTable t = load_table(table_words);
  const unsigned int rounds = *(volatile unsigned int*)&control->rounds;
  const double inf = (double)__int_as_float(0x7f800000);  // +Inf
  const PeelDag dag{offsets, adj, src, peeled_round};
  AncestrySet mine, scratch;
  mine.init();
  scratch.init();
  bool any_inexact = false;
  for (unsigned int r = rounds; r-- > 0;) {
    const unsigned int begin = round_start[r], end = round_start[r + 1];
    for (uint64_t i = begin + global_thread(); i < end; i += grid_threads()) {
      const unsigned int p = order[i];
      const uint64_t c = src[p];
      uint64_t cells[3];
      int weights[3];
      key_cells(t, keys[p], cells, weights);
      double v[2], w = 1.0;  // w: 1 / w_c(k), of the cell the key was read from
      uint64_t d[2];
      unsigned int rd[2];
      int o = 0;
#pragma unroll
      for (int j = 0; j < 3; ++j) {
        if (cells[j] == c) {
          w = inverse_weight(weights[j]);
          continue;
        }
        const double a = load_cg(acc + cells[j]);
        const bool read = a == kReadCell;
        d[o] = cells[j];
        rd[o] = read ? load_cg(reader + cells[j]) : kNotPeeled;
        v[o] = (a >= 0.0 ? a : read ? load_cg(key_ver + rd[o]) : inf) * fabs(inverse_weight(weights[j]));
        ++o;
      }
      const int first = v[1] < v[0];
      int mine_state = 0;
      double g = inf;
      for (int k = 0; k < 2; ++k) {
        const int x = k == 0 ? first : 1 - first;
        if (!(v[x] < g)) continue;
        if (verifies_soundly(dag, p, offsets[d[x]], offsets[d[x] + 1], rd[x], mine, &mine_state, scratch)) {
          g = v[x];
          break;
        }
      }
      key_ver[p] = g / fabs(w);
      const double e = key_err[p];
      const double bound = fmax(e, verification_bound(g, e));
      bool within = true;
      for (uint64_t lane = 0; lane < block; ++lane) within &= within_rtol(key_val[(uint64_t)p * block + lane], bound, rtol);
      if (!within) {
        inexact[p] = 1u;
        any_inexact = true;
      }
    }
    grid_barrier(control->barrier);
  }
  if (any_inexact) atomicOr(&counters->flags, (unsigned int)kFlagInexact);
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

// Last of the decode sequence (one thread): the decode's status, into counters->status. `ml` is the
// multilevel index's state (null for the other kinds): its verdict comes first, and its support count
// is exact where the support list overflowed.
extern "C" __global__ void lhc_decode_status(const uint64_t* layout, DecodeCounters* counters, const MlState* ml) {
  if (global_thread() != 0) return;
  const unsigned long long support = ml ? ml->support : counters->support;
  counters->status = decode_status((int)layout[kLwIndexKind], counters->flags, support, counters->peeled,
                                   ml ? ml->status : 0u);
}

}  // namespace gpu
}  // namespace lhc
