// The lossless codec's CUDA kernels (see codec_kernels.cuh): the multilevel index's fine-level peel
// (steps 2a-d of codec_multilevel.cuh): rounds, pairs, verdict and the replay of the CPU's order.
#pragma once

#include "codec_multilevel.cuh"

namespace lhc {
namespace gpu {

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
      uint32_t rest = (uint32_t)u;  // below base^per_word <= kIntFieldLimit: 32-bit division
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

// The CPU backend's peel of one group g of a fine table, step by step (lhc::cpu::detail::peel with
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

// What both kernels of a fine level (lhc_ml_peel_level, lhc_ml_settle_level) read first: the codec
// layout, level l's shape and table, the table's sizes and words in the payload, and how the level's
// nodes are held (MlState::mode and node count, set by lhc_ml_verdict before the peel).
struct MlLevelView {
  CodecLayout L;
  uint32_t l;
  MlLevel lv;
  SegmentedTable T;      // lv.table
  uint64_t wpg;          // words per cell: one node's pattern
  uint64_t cells, words; // of the whole table
  long long word_limit;  // base^w: the bound of a pattern word
  const float* fine;     // the table's words in the payload
  unsigned int mode;     // MlMode
  uint32_t nkeys;        // listed nodes (kMlList), else 0
  __device__ __forceinline__ MlLevelView(const uint64_t* layout, uint64_t level, const float* payload,
                                         const volatile MlState* ml)
      : L(load_layout(layout)),
        l((uint32_t)level),
        lv(ml_level(layout, l)),
        T(lv.table),
        wpg(lv.words),
        cells(T.cells()),
        words(cells * wpg),
        word_limit(ml_word_limit(L, lv)),
        fine(payload + lv.offset),
        mode(ml->mode),
        nkeys(mode == kMlList ? (uint32_t)ml->nodes : 0u) {}
};

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
  const MlLevelView fl(layout, level, payload, ml);
  volatile MlState* vml = ml;
  volatile PeelControl* vc = control;

  // a. The table's words as exact integers; fresh cell states and node states.
  unsigned int word_flags = 0;
  for (uint64_t i = global_thread(); i < fl.words; i += grid_threads()) {
    long long v;
    word_flags |= read_fine_word(fl.fine[i], scale, &v);
    val[i] = v;
  }
  for (uint64_t c = global_thread(); c < fl.cells; c += grid_threads()) {
    deg[c] = 0;
    xr[c] = 0;
  }
  for (uint64_t p = global_thread(); p < fl.nkeys; p += grid_threads()) {
    src[p] = kNoCell;
    rnd[p] = kNotPeeled;
  }
  if (fl.mode == kMlTooMany)
    for (uint64_t i = global_thread(); i < (fl.lv.nodes + 31) / 32; i += grid_threads()) claimed[i] = 0;
  if (word_flags) atomicOr(&ml->word_flags, word_flags);
  grid_barrier(control->barrier);
  const bool words_ok = vml->word_flags == 0u;  // uniform after the barrier

  if (words_ok) {
    // b. Cell states (degree, XOR of list positions, or of node ids when the nodes do not fit their
    //    list), the pure cells, then rounds.
    if (fl.mode == kMlList) {
      for (uint64_t p = global_thread(); p < fl.nkeys; p += grid_threads()) {
        const uint64_t h = key_hash(fl.T, nodes[p]);
#pragma unroll
        for (int j = 0; j < 3; ++j) {
          int weight;  // ignored (an index table)
          const uint64_t c = key_cell(fl.T, h, j, &weight);
          atomicAdd(deg + c, 1u);
          atomicXor(xr + c, (unsigned int)p);
        }
      }
    } else {
      ml_states_by_id(fl.L, layout, fl.l, fl.T, payload, scale, parent_nodes, parent_pattern, vml->prev_nodes, deg, xr);
    }
    grid_barrier(control->barrier);
    for (uint64_t c = global_thread(); c < fl.cells; c += grid_threads())
      if (load_cg(deg + c) == 1u) queue_push(pure0, &control->pure[0], (unsigned int)c);
    grid_barrier(control->barrier);
    bool guard = false, inconsistent = false;
    for (unsigned int r = 0;; ++r) {
      PeelRound q;
      const unsigned int npure = begin_round(r, fl.cells, control, pure0, pure1, list0, list1, &q);
      if (npure == 0) break;
      const unsigned int par = q.par;
      unsigned int* const pure_now = q.pure_now;
      unsigned int* const pure_next = q.pure_next;
      unsigned int* const list_now = q.list_now;
      if (fl.mode == kMlList) {
        // A: every pure cell proposes its node, which keeps the smallest proposing cell.
        propose(fl.T, nodes, fl.nkeys, deg, xr, rnd, src, pure_now, npure, list_now, &control->keys[par], &guard);
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
          if (v >= fl.lv.nodes || cell_slot(fl.T, v, c, cell, weight) < 0) { guard = true; continue; }
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
      for (uint64_t item = global_thread(); item < (uint64_t)nlist * fl.wpg; item += grid_threads()) {
        const uint64_t i = item / fl.wpg, k = item - i * fl.wpg;
        const unsigned int entry = load_cg(list_now + i);  // a node position, or a cell when by id
        const unsigned int c = fl.mode == kMlList ? load_cg(src + entry) : entry;
        const unsigned int key = fl.mode == kMlList ? entry : load_cg(src + entry);
        uint64_t cell[3];
        int sign[3];  // +-1: a fine table is never weighted
        key_cells(fl.T, fl.mode == kMlList ? nodes[key] : key, cell, sign);
        const long long word = ml_take_pattern_word(val, c, cell, sign, fl.wpg, k, fl.word_limit, &inconsistent);
        if (fl.mode == kMlList)
          pattern[(uint64_t)key * fl.wpg + k] = word >= 0 && word < fl.word_limit ? (uint32_t)word : 0u;
        if (k == 0) {
          if (fl.mode == kMlList) rnd[key] = r;
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
  const MlLevelView fl(layout, level, payload, ml);
  volatile MlState* vml = ml;

  if (vml->word_flags == 0u) {  // uniform: set by lhc_ml_peel_level
    bool guard = false, inconsistent = false;
    // The pairs the peel left, each by the thread of its smaller node: listed nodes by position (a
    // solved pair's round is kPairRound), else every node of the level streamed from its source by id,
    // unclaimed ones only, for the inconsistency check.
    if (fl.mode == kMlList) {
      const auto listed = [&](uint64_t p) {
        return p < fl.nkeys && load_cg(rnd + p) == kNotPeeled ? nodes[p] : kNoPartner;
      };
      for (uint64_t a = global_thread(); a < fl.nkeys; a += grid_threads()) {
        if (load_cg(rnd + a) != kNotPeeled) continue;
        uint64_t cell[3];
        int sa[3], sb[3];
        const uint64_t b = ml_find_pair(fl.T, a, nodes[a], listed, deg, xr, cell, sa, sb, &guard);
        if (b == kNoPartner) continue;
        if (ml_solve_pair(val, cell, sa, sb, fl.wpg, fl.word_limit, pattern + a * fl.wpg, pattern + b * fl.wpg,
                          &inconsistent)) {
          rnd[a] = kPairRound;
          rnd[b] = kPairRound;
        }
      }
    } else {
      const auto by_id = [](uint64_t v) { return v; };
      ml_for_each_node(fl.L, layout, fl.l, payload, scale, parent_nodes, parent_pattern, vml->prev_nodes,
                       [&](uint64_t a) {
        if (load_cg(claimed + a / 32) & (1u << (a % 32))) return;
        uint64_t cell[3];
        int sa[3], sb[3];
        if (ml_find_pair(fl.T, a, a, by_id, deg, xr, cell, sa, sb, &guard) != kNoPartner)
          ml_solve_pair(val, cell, sa, sb, fl.wpg, fl.word_limit, nullptr, nullptr, &inconsistent);
      });
    }
    grid_barrier(control->barrier);
    // c. Resolved nodes (a level with too many nodes stalls: not counted), and what the cells hold.
    unsigned int resolved = 0;
    for (uint64_t p = global_thread(); p < fl.nkeys; p += grid_threads()) resolved += load_cg(rnd + p) != kNotPeeled;
    inconsistent |= ml_cells_inconsistent(val, deg, fl.words, fl.wpg);
    warp_add(&ml->resolved, resolved);
    if (inconsistent || guard) atomicOr(&ml->inconsistent, 1u);
  }
  grid_barrier(control->barrier);

  // Verdict (see the section comment): one thread decides, every thread then reads the mode.
  if (global_thread() == 0) {
    unsigned int status = 0;
    if (vml->word_flags)
      status = (vml->word_flags & kMlWordCorrupt) ? kMlCorrupt : kMlOverflow;
    else if (fl.mode == kMlList && vml->resolved == fl.nkeys)
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
  for (uint64_t c = global_thread(); c < fl.cells; c += grid_threads()) {
    deg[c] = 0;
    xr[c] = 0;
  }
  for (uint64_t i = global_thread(); i < fl.words; i += grid_threads()) {
    long long v;
    read_fine_word(fl.fine[i], scale, &v);  // every word is valid here
    val[i] = v;
  }
  grid_barrier(control->barrier);
  ml_states_by_id(fl.L, layout, fl.l, fl.T, payload, scale, parent_nodes, parent_pattern, vml->prev_nodes, deg, xr);
  grid_barrier(control->barrier);
  // One group per warp (its first lane): groups in one warp would take turns, not run side by side.
  bool bad = false;
  if ((threadIdx.x & 31) == 0)
    for (uint64_t g = global_thread() / 32; g < fl.T.groups(); g += grid_threads() / 32)
      bad |= ml_replay_group(fl.T, g, fl.wpg, fl.word_limit, val, deg, xr, queue);
  if (bad) atomicOr(&ml->replay_bad, 1u);
  grid_barrier(control->barrier);
  // The pairs that order left (only where no group met a bad step: states are consistent then), by
  // node id; disjoint, so the CPU's order of them cannot change the verdict. (replay_bad may be raised
  // by a faster thread's pair meanwhile: a thread that then skips its pairs changes nothing.)
  if (!vml->replay_bad) {
    bad = false;
    const auto by_id = [](uint64_t v) { return v; };
    ml_for_each_node(fl.L, layout, fl.l, payload, scale, parent_nodes, parent_pattern, vml->prev_nodes,
                     [&](uint64_t a) {
      uint64_t cell[3];
      int sa[3], sb[3];
      // a guard (inconsistent states) counts as bad, like a bad pair
      if (ml_find_pair(fl.T, a, a, by_id, deg, xr, cell, sa, sb, &bad) != kNoPartner)
        ml_solve_pair(val, cell, sa, sb, fl.wpg, fl.word_limit, nullptr, nullptr, &bad);
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

}  // namespace gpu
}  // namespace lhc
