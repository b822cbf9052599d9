// lhc::cpu::decode: the support from the index, then the value sketch peeled over it group by group,
// and the output.
#include <malloc.h>

#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>

#include "peel.h"

namespace lhc {
namespace cpu {

using namespace detail;

namespace {

// out = the values of the keys of `runs` and zeros elsewhere, written in one pass in increasing
// address order (each thread a contiguous range) by merging the runs a chunk of keys at a time: the
// chunk zeroed, then its keys' values stored, while it is in cache; no random stores into memory.
void write_output(const CodecLayout& L, const std::vector<KeyRun>& runs, float* out, int nt) {
  const uint64_t B = L.block;
  // 256 KiB of output: every chunk visits each run (two or so per sketch group), so a smaller one pays
  // for those visits more than for its stores (16 KiB: ~1.3x the stage's time at 2^26 keys, 55 groups).
  const uint64_t chunk = std::max<uint64_t>(1, 65536 / B);
#pragma omp parallel num_threads(nt)
  {
    uint64_t kb, ke;
    split_range(L.num_keys, omp_get_num_threads(), omp_get_thread_num(), &kb, &ke);
    walk_runs_by_chunk(
        runs, B, kb, ke, chunk,
        [&](uint64_t c0, uint64_t c1) { std::fill(out + c0 * B, out + std::min(c1 * B, L.numel), 0.0f); },
        [&](const KeyRun& run, uint64_t i) {
          const uint64_t lo = (uint64_t)run.keys[i] * B;
          if (B == 1)
            out[lo] = run.vals[i];  // one store, not a call to memcpy
          else
            std::memcpy(out + lo, run.vals + i * B, 4 * std::min<uint64_t>(B, L.numel - lo));
        });
  }
}

// The keys of `lists` (any order, repeats allowed) sorted and without repeats, widened into *out. A
// least-significant-digit radix sort, 11 bits a pass over the bits the largest key needs: linear, and
// its counters in L1, where a comparison sort of the inexact keys (a few percent of the support at
// block 1) was the longest serial stretch after the parallel stages.
void sorted_unique_keys(const std::vector<std::vector<uint32_t>>& lists, std::vector<uint64_t>* out) {
  std::vector<uint32_t> keys, spare;
  size_t m = 0;
  for (const auto& l : lists) m += l.size();
  keys.reserve(m);
  uint32_t largest = 0;
  for (const auto& l : lists)
    for (const uint32_t k : l) {
      keys.push_back(k);
      largest = std::max(largest, k);
    }
  constexpr uint32_t kBits = 11, kRadix = 1u << kBits;
  spare.resize(m);
  for (uint32_t shift = 0; shift < 32 && (largest >> shift) != 0; shift += kBits) {
    uint64_t at[kRadix + 1] = {};
    for (const uint32_t k : keys) ++at[((k >> shift) & (kRadix - 1)) + 1];
    for (uint32_t d = 0; d < kRadix; ++d) at[d + 1] += at[d];
    for (const uint32_t k : keys) spare[at[(k >> shift) & (kRadix - 1)]++] = k;
    keys.swap(spare);
  }
  out->clear();
  out->reserve(m);
  for (size_t i = 0; i < m; ++i)
    if (i == 0 || keys[i] != keys[i - 1]) out->push_back(keys[i]);
}

// A decoding thread's working memory, kept from one decode to the next (thread_local: OpenMP's pool
// threads and a calling thread each keep theirs, sized for the largest group or tensor they decoded).
// Every user sizes what it uses before writing it, as from one group to the next within a decode;
// kept, the memory is not handed back to the kernel and taken again, zeroed page by page, on every
// decode of a training run (docs/BENCHMARKS.md, "Issue #20's block-1 target").
struct GroupScratch {
  PeelTable storage;
  std::vector<uint32_t> gkeys, scratch;  // scratch: hashed cells while building
  std::vector<uint32_t> cur, next, layer, src, order;  // peel_layers' scratch, and its order
  std::vector<uint64_t> bits;
  std::vector<double> kerr;  // by position: E(k)
  VerifyScratch verify;
};
GroupScratch& group_scratch() {
  static thread_local GroupScratch s;
  return s;
}

// The calling thread's: the support's buckets (bitmap_support reuses their vectors) and the keys' values.
struct SupportScratch {
  GroupedKeys support;
  HugeVector<float> vals;
};
SupportScratch& support_scratch() {
  static thread_local SupportScratch s;
  return s;
}

// The largest OpenMP team a decode ran: release_decoder_memory reaches its threads with a team as large.
std::atomic<int> g_largest_team{1};

}  // namespace

void release_decoder_memory() {
  support_scratch() = SupportScratch();
  // The calling thread is the team's thread 0.
#pragma omp parallel num_threads(g_largest_team.load(std::memory_order_relaxed))
  {
    group_scratch() = GroupScratch();
    release_multilevel_scratch();
  }
#ifdef __GLIBC__
  // Freed memory below malloc's mmap threshold (which a freed large block raises, up to 32 MiB) stays in
  // its arenas: hand their free pages back to the kernel.
  malloc_trim(0);
#endif
}

DecodeStats decode(const CodecLayout& L, const DecodeInputs& in, const float* payload, float* out,
                   int64_t* trace_key, int64_t* trace_cell, const KeyBounds* key_bounds, int num_threads) {
  const int nt = resolve_threads(num_threads);
  for (int seen = g_largest_team.load(std::memory_order_relaxed);
       nt > seen && !g_largest_team.compare_exchange_weak(seen, nt, std::memory_order_relaxed);) {
  }
  DecodeStats st;
  Prof prof;
  const float* index = payload + L.index_offset;

  // 1. The exact support: keys non-zero on at least one rank, bucketed by sketch group.
  SupportScratch& kept = support_scratch();
  GroupedKeys& support = kept.support;
  if (L.index_kind == kIndexBitmap)
    st.status = bitmap_support(L, in, index, nt, &support, &st);
  else if (L.index_kind == kIndexBloom)
    st.status = bloom_support(L, in, index, nt, &support, &st);
  else if (L.index_kind == kIndexMultilevel)
    st.status = multilevel_support(L, in, payload, nt, &support, &st);
  else
    st.status = kDecodeIndexCorrupt;
  // A support whose per-key counts are not the ranks' (a corrupted index word that still matches the
  // key total) fails the index checksum, but for a 1/(p_0 p_1) chance (lhc_layout.h).
  if (st.status == kDecodeOk && !index_check_matches(payload, in.scale, st.index_check)) st.status = kDecodeIndexCorrupt;
  if (st.status != kDecodeOk) {
    parallel_fill(out, L.numel, 0.0f, nt);
    return st;
  }
  st.support_keys = support.total();
  prof.mark("index");

  // 2. Peel the value sketch over the support one group at a time (groups share no cells), in
  //    double precision, into vals. A key's position: its group's keys (parts concatenated) come
  //    after those of the groups before, in increasing order. A group's working set is private to the
  //    thread peeling it and sized to stay in cache; each group is peeled sequentially in a fixed
  //    order, so the values do not depend on the number of threads or their scheduling.
  const uint64_t B = L.block;
  const SegmentedTable& T = L.sketch;
  const uint64_t groups = T.groups(), gcells = T.group_cells();
  const float* sk = payload + L.sketch_offset;
  const float* mk = payload + mass_offset(L);
  const uint64_t n = in.world_size;
  std::vector<uint64_t> goff(groups + 1, 0);  // group g's keys: positions [goff[g], goff[g + 1])
  for (uint64_t g = 0; g < groups; ++g) goff[g + 1] = goff[g] + support.group_size(g);
  HugeVector<float>& vals = kept.vals;  // by key position
  vals.resize(goff[groups] * B);
  std::vector<uint64_t> peeled(groups, 0);
  std::vector<char> bad(groups, 0), non_finite(groups, 0), corrupt(groups, 0), crowded(groups, 0);
  std::vector<std::vector<uint32_t>> inexact(groups);  // per group: positions of keys failing rtol
  double group_ms[3] = {0, 0, 0};  // LHC_PROFILE: the groups' load, build and peel times, summed over threads
  std::chrono::steady_clock clock;
#pragma omp parallel num_threads(nt)
  {
    GroupScratch& gs = group_scratch();
    PeelTable& storage = gs.storage;
    std::vector<double> v(B);
    std::vector<uint32_t>&gkeys = gs.gkeys, &scratch = gs.scratch;
    std::vector<uint32_t>&cur = gs.cur, &next = gs.next, &layer = gs.layer, &src = gs.src, &order = gs.order;
    std::vector<uint64_t>& bits = gs.bits;
    std::vector<double>& kerr = gs.kerr;
    VerifyScratch& verify_scratch = gs.verify;
    // A group's peel, compiled twice: for one value per key (kBlock 1, unstructured keys: the loops
    // over a key's values fold away) and for any block (kBlock 0).
    const auto peel_group = [&](auto block_tag, int64_t g) {
      constexpr uint64_t kBlock = decltype(block_tag)::value;
      const uint64_t B = kBlock ? kBlock : L.block;
      const uint64_t base = (uint64_t)g * gcells, kb = goff[g];
      const auto t0 = clock.now();
      gkeys.clear();
      for (const auto& part : support.by) gkeys.insert(gkeys.end(), part[g].begin(), part[g].end());
      const uint32_t kn = (uint32_t)gkeys.size();
      float* gvals = vals.data() + kb * B;
      // Keys the peel does not reach (a failed group) keep NaN, never stale memory.
      std::fill(gvals, gvals + (uint64_t)kn * B, std::numeric_limits<float>::quiet_NaN());
      // The group's cells, sketch values and masses in locals: the loops below store through
      // pointers the compiler cannot tell apart from what the lambda captures by reference.
      const uint64_t cells = gcells, ranks = n;
      const float* group_sketch = sk + base * B;
      const float* group_mass = mk + base;
      const PeelCells t = storage.reset(T.seg_len, B);
      bool finite = true;
      for (uint64_t c = 0; c < cells; ++c) {
        t.clear_state(c);
        double* dst = t.values(c);
        for (uint64_t l = 0; l < B; ++l) {
          dst[l] = (double)group_sketch[c * B + l];
          finite &= std::isfinite(dst[l]);
        }
      }
      const auto t1 = clock.now();
      build_states(t, T, gkeys.data(), kn, scratch);
      // Each cell's own rounding bound from its mass and degree (cell_error_bound). A cell holds
      // support keys exactly when its mass is positive (a support key is non-zero on some rank, and a
      // float sum of non-negative terms is 0 only if they all are): anything else is corruption (an
      // all-zero sketch under a valid index, a flipped mass word).
      // The same pass checks the masses are finite, and lists the cells pure at the start in increasing
      // order: peel_layers' first layer (one pass over the group's cells fewer).
      bool cells_bad = false;
      uint32_t max_deg = 0;
      cur.resize(cells);
      uint32_t* const pure_p = cur.data();
      uint64_t pure_n = 0;
      for (uint64_t c = 0; c < cells; ++c) {
        const double m = (double)group_mass[c];
        const uint32_t deg = t.deg(c);
        finite &= std::isfinite(m);
        cells_bad |= (deg > 0) != (m > 0.0);
        max_deg = std::max(max_deg, deg);
        t.set_acc(c, cell_error_bound(m, deg, ranks));
        pure_p[pure_n] = (uint32_t)c;
        pure_n += deg == 1;
      }
      if (!finite) non_finite[g] = 1;
      corrupt[g] = cells_bad;
      // A cell of more keys than kMaxCellDegree fails the whole decode (below), unpeeled, as on CUDA.
      if (max_deg > kMaxCellDegree) {
        crowded[g] = 1;
        return;
      }
      const auto t2 = clock.now();
      uint64_t step = kb;
      bool group_bad = false;
      kerr.resize(kn);
      // Without verify the verdict is E(k) alone, taken here; with it, the backward pass below takes
      // E(k) and F(k) together.
      const bool check_now = !in.verify;
      // What the per-key step reads, copied into the closure: a reference would be reloaded after
      // every store into the cells.
      double* const key_err = kerr.data();
      const double rtol = in.rtol;
      int64_t *const trace_keys = trace_key, *const trace_cells = trace_cell;
      // Eight keys at a time in AVX-512 lanes where the CPU runs them (block 1, not tracing).
      const bool batched = kBlock == 1 && !trace_keys && value_peel_batch8_available(t, kn);
      const ValueBatchOut batch_out{key_err, gvals, rtol, check_now};
      const auto batch = [&, t, batched](const uint32_t* entries, uint32_t* order_at, uint32_t* next_at,
                                         uint64_t* appended) {
        uint32_t lanes;
        if (!batched || !value_peel_batch8(t, entries, batch_out, order_at, next_at, appended, &lanes)) return false;
        for (; lanes; lanes &= lanes - 1) inexact[g].push_back(entries[2 * __builtin_ctz(lanes)]);
        return true;
      };
      peeled[g] = peel_layers(
          t, kn, cur, pure_n, next, layer, src, bits, order,
          [&, t, gvals, key_err, rtol, check_now, trace_keys, trace_cells](uint32_t pos, const uint64_t* cell,
                                                                            const double* coef) {
            // The key's error bound: its cell's, every other key of which was subtracted already
            // (rounded up where it is stored), times 1/|w|; it joins the bounds of its other cells.
            const double err = std::fabs(coef[0]) * (double)t.acc(cell[0]);
            key_err[pos] = err;
            t.mark(cell[0], PeelCells::kReadCell);
            t.set_acc(cell[1], (double)t.acc(cell[1]) + std::fabs(coef[1]) * err);
            t.set_acc(cell[2], (double)t.acc(cell[2]) + std::fabs(coef[2]) * err);
            // Branch-free: weights and their inverses are multiplied in (exact: powers of two), so
            // mispredictions do not stall the memory pipeline.
            if (B == 1) {  // unstructured keys: no loops over one value
              const double x = coef[0] * *t.values(cell[0]);
              *t.values(cell[1]) -= coef[1] * x;
              *t.values(cell[2]) -= coef[2] * x;
              gvals[pos] = (float)x;
              if (check_now && !within_rtol(x, err, rtol)) inexact[g].push_back(pos);
            } else {
              const double* src_values = t.values(cell[0]);
              for (uint64_t l = 0; l < B; ++l) v[l] = coef[0] * src_values[l];
              double* d1 = t.values(cell[1]);
              double* d2 = t.values(cell[2]);
              for (uint64_t l = 0; l < B; ++l) {
                d1[l] -= coef[1] * v[l];
                d2[l] -= coef[2] * v[l];
              }
              float* o = gvals + (uint64_t)pos * B;
              bool within = true;
              for (uint64_t l = 0; l < B; ++l) {
                o[l] = (float)v[l];
                within &= within_rtol(v[l], err, rtol);
              }
              if (check_now && !within) inexact[g].push_back(pos);
            }
            if (trace_keys) {
              trace_keys[step] = (int64_t)gkeys[pos];
              trace_cells[step] = (int64_t)(base + cell[0]);
              ++step;
            }
            return true;
          },
          batch, &group_bad);
      if (!group_bad && peeled[g] < kn)
        peeled[g] += solve_pairs(t, T, gkeys.data(), kn, B, scratch,
                                 [&](uint32_t pa, uint32_t pb, const uint64_t* cell, const int* wa, const int* wb,
                                     const double* va, const double* vb) {
                                   // Bounds as for a peeled key (tests/helpers.py peel_error_bound);
                                   // the third cell r must then hold the pair's w_r(a) v_a + w_r(b) v_b:
                                   // it is subtracted and left to the residual check. One check cannot
                                   // verify two values (verification_bound): with verify a solved pair's
                                   // keys are listed inexact; its cells verify nothing upstream (kPairCell).
                                   const PairCells pc = pair_cells(wa, wb);
                                   const int r = 3 - pc.p - pc.q;
                                   const double ap = t.acc(cell[pc.p]), aq = t.acc(cell[pc.q]);
                                   const double det = std::abs(pc.det);
                                   const double ea = (std::abs(wb[pc.q]) * ap + std::abs(wb[pc.p]) * aq) / det;
                                   const double eb = (std::abs(wa[pc.p]) * aq + std::abs(wa[pc.q]) * ap) / det;
                                   t.mark(cell[pc.p], PeelCells::kPairCell);
                                   t.mark(cell[pc.q], PeelCells::kPairCell);
                                   t.set_acc(cell[r], (double)t.acc(cell[r]) + std::abs(wa[r]) * ea + std::abs(wb[r]) * eb);
                                   double* Rr = t.values(cell[r]);
                                   bool within_a = !in.verify, within_b = !in.verify;
                                   for (uint64_t l = 0; l < B; ++l) {
                                     gvals[(uint64_t)pa * B + l] = (float)va[l];
                                     gvals[(uint64_t)pb * B + l] = (float)vb[l];
                                     Rr[l] -= wa[r] * va[l] + wb[r] * vb[l];
                                     within_a &= within_rtol(va[l], ea, in.rtol);
                                     within_b &= within_rtol(vb[l], eb, in.rtol);
                                   }
                                   key_err[pa] = ea;
                                   key_err[pb] = eb;
                                   if (!within_a) inexact[g].push_back(pa);
                                   if (!within_b) inexact[g].push_back(pb);
                                   if (trace_key) {
                                     for (const uint32_t p : {pa, pb}) {
                                       trace_key[step] = (int64_t)gkeys[p];
                                       trace_cell[step] = (int64_t)(base + cell[0]);
                                       ++step;
                                     }
                                   }
                                 });
      bad[g] = group_bad;
      if (!group_bad && peeled[g] == kn) {
        // The residual check: with every key recovered, each cell no key was read from must be 0
        // within its bound (its own rounding plus the bounds of the keys subtracted from it). With
        // verify its verification bound V = acc + |residual| (largest lane) then takes the bound's place.
        bool residual_bad = corrupt[g];
        const bool verify = in.verify;
        if (!verify) {
          // Branch-free: whether a cell was read from (acc < 0: not checked) is a coin flip to a branch
          // predictor.
          for (uint64_t c = 0; c < cells && !residual_bad; ++c) {
            const double a = t.acc(c);
            const double* r = t.values(c);
            bool cell_bad = false;
            for (uint64_t l = 0; l < B; ++l) cell_bad |= !(std::fabs(r[l]) <= a);
            residual_bad |= !(a < 0.0) & cell_bad;
          }
        } else {
          for (uint64_t c = 0; c < cells && !residual_bad; ++c) {
            const double a = t.acc(c);
            if (a < 0.0) continue;
            const double* r = t.values(c);
            double worst = 0.0;
            for (uint64_t l = 0; l < B; ++l) {
              residual_bad |= !(std::fabs(r[l]) <= a);
              worst = std::max(worst, std::fabs(r[l]));
            }
            t.set_acc(c, a + worst);
          }
        }
        corrupt[g] = residual_bad;
        // The verification bounds, from the last peeled key back (verify_group): a key is listed
        // inexact unless both E(k) and F(k) = G(k) - E(k) prove it within rtol.
        if (in.verify && !corrupt[g])
          verify_group(t, T, gkeys.data(), kn, B, order, kerr.data(), in.rtol, verify_scratch, inexact[g]);
      }
      if (key_bounds && goff[groups] <= key_bounds->capacity) {
        // Every position of a completely peeled group holds its bound (the peel's step, or the pair
        // solver's); a group cut short keeps stale ones, so it reports NaN.
        const bool complete = !group_bad && peeled[g] == kn;
        for (uint32_t p = 0; p < kn; ++p) {
          key_bounds->keys[kb + p] = gkeys[p];
          key_bounds->bounds[kb + p] = complete ? kerr[p] : std::numeric_limits<double>::quiet_NaN();
        }
      }
      for (uint32_t& p : inexact[g]) p = gkeys[p];  // positions -> keys
      if (prof.env) {
        const auto t3 = clock.now();
#pragma omp critical(lhc_profile)
        {
          group_ms[0] += std::chrono::duration<double, std::milli>(t1 - t0).count();
          group_ms[1] += std::chrono::duration<double, std::milli>(t2 - t1).count();
          group_ms[2] += std::chrono::duration<double, std::milli>(t3 - t2).count();
        }
      }
    };
#pragma omp for schedule(dynamic, 1)
    for (int64_t g = 0; g < (int64_t)groups; ++g) {
      if (B == 1)
        peel_group(std::integral_constant<uint64_t, 1>(), g);
      else
        peel_group(std::integral_constant<uint64_t, 0>(), g);
    }
  }
  if (prof.env)
    std::fprintf(stderr, "  lhc (threads' sum: load %.1f ms, build %.1f ms, peel %.1f ms)\n", group_ms[0], group_ms[1],
                 group_ms[2]);
  prof.mark("peel");
  std::vector<KeyRun> runs;
  for (uint64_t g = 0; g < groups; ++g) {
    uint64_t pos = goff[g];
    for (const auto& part : support.by) {
      runs.push_back(KeyRun{part[g].data(), part[g].size(), vals.data() + pos * B});
      pos += part[g].size();
    }
  }
  write_output(L, runs, out, nt);
  prof.mark("write");
  bool any_corrupt = false, any_crowded = false;
  for (uint64_t g = 0; g < groups; ++g) {
    st.peeled += peeled[g];
    if (bad[g]) st.status = kDecodeIndexCorrupt;
    if (non_finite[g] && st.status == kDecodeOk) st.status = kDecodeSketchNonFinite;
    any_corrupt |= corrupt[g];
    any_crowded |= crowded[g];
  }
  if (any_crowded) {  // the CUDA kernels peel nothing then: no key counts as peeled, none as inexact
    st.peeled = 0;
    for (auto& listed : inexact) listed.clear();
  }
  if (st.status == kDecodeOk && st.peeled != st.support_keys) st.status = kDecodeSketchPeelFailed;
  if (st.status == kDecodeOk && any_corrupt) st.status = kDecodeSketchCorrupt;
  sorted_unique_keys(inexact, &st.inexact_keys);
  if (st.status == kDecodeOk && !st.inexact_keys.empty()) st.status = kDecodeInexact;
  prof.mark("report");
  return st;
}

}  // namespace cpu
}  // namespace lhc
