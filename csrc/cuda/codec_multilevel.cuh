// The lossless codec's CUDA kernels (see codec_kernels.cuh): the multilevel index's decode stages --
// the coarse level, the verdicts between stages and the expansion of a level into the next one's
// nodes. The fine-level peel is codec_ml_peel.cuh.
#pragma once

#include "codec_index.cuh"

namespace lhc {
namespace gpu {

// -------------------------------------------------------------------------------------------------
// Decode: multilevel index
// -------------------------------------------------------------------------------------------------
//
// The CPU backend's multilevel_support (csrc/cpu/multilevel.cpp), stage by stage, with its statuses and
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
//        a queue seeded with the group's pure cells in increasing order, as lhc::cpu::detail::peel
//        does. Its cell states XOR node ids, not list positions, so they are built straight from the
//        level's source (coarse words or the parents' patterns). Then, if no group met a bad step,
//        the pairs left by that order are checked in parallel (their order cannot change a verdict:
//        they are disjoint).
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

// The DecodeStatus codes (lhc_status.h) that the multilevel stages report.
constexpr unsigned int kMlCorrupt = kDecodeIndexCorrupt;
constexpr unsigned int kMlPeelFailed = kDecodeIndexPeelFailed;
constexpr unsigned int kMlOverflow = kDecodeIndexOverflow;

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
                                                         uint64_t cap, unsigned long long* sum, bool* bad,
                                                         SupportCheckSums* check = nullptr) {
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
      if (check) check->add(child, digit);
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
  count_bitmap_tiles(L, payload, scale, world_size, L.index.digits, tile_sum, &ml->coarse_sum, counters, false);
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
      counters->support_total = total;
      counters->candidates = total;
      // The index checksum (as lhc_support_ready for the other indexes): a support that fails it is
      // not peeled.
      if (!index_check_passes_or_aborts(counters)) return;
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

// Expansion step 1: count each tile's non-zero children of the level's nodes and check them.
extern "C" __global__ void lhc_ml_expand_count(const uint64_t* layout, uint64_t level, const uint32_t* nodes,
                                               const uint32_t* counts, const uint32_t* pattern,
                                               unsigned long long* tile_sum, DecodeCounters* counters, MlState* ml) {
  if (counters->abort) return;  // uniform
  const CodecLayout L = load_layout(layout);
  const MlLevel lv = ml_level(layout, (uint32_t)level);
  unsigned long long sum = 0;
  bool bad = false;
  // The finest level's children are the support keys, their digits the keys' counts: the index checksum.
  SupportCheckSums check(L);
  SupportCheckSums* keys = level + 1 == ml_levels(layout) ? &check : nullptr;
  tile_count(ml->nodes, tile_sum, [&](uint64_t p) {
    return ml_node_children(L, lv, nodes, counts, pattern, p, nullptr, nullptr, 0, 0, &sum, &bad, keys);
  });
  warp_add_u64(&ml->child_total, sum);
  if (keys) check.flush(counters);  // keys: the same on every thread
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

}  // namespace gpu
}  // namespace lhc
