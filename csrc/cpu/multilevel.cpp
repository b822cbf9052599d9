// The support from the multilevel index: the coarse counting bitmap, then each fine level peeled in
// exact integers and expanded into the next level's nodes (at the finest: the support keys).
#include "digits.h"
#include "peel.h"

namespace lhc {
namespace cpu {
namespace detail {
namespace {

// ---- Multilevel index decoding --------------------------------------------------------------------
//
// Per level: the level's known non-zero nodes (increasing, a flat array) are bucketed by the group of
// the level's fine table; each group (three segments, sized to stay in cache) is loaded, checked and
// peeled in integers by one thread; the pure cells give each node's aggregate pattern, stored by
// group (each node's slot is recorded while bucketing). Then the nodes are expanded into their
// non-zero children by contiguous ranges of positions, one per thread, so the children come out
// increasing (at the finest level: the support keys, bucketed by sketch group as they are produced).
// Integer peeling is exact and every output lands at a place fixed by the node order, so nothing
// depends on the number of threads or their scheduling.

// A thread's multilevel working memory, kept from one decode to the next as decode.cpp keeps its own
// (docs/DESIGN.md, "The CPU decoder keeps its working memory"); every user sizes what it uses before
// writing it. The calling thread's: the level's nodes, counts, patterns and slots, the bucketed nodes,
// and the unpacking and expanding parts' vectors; a peeling thread's: its group table and scratch.
struct MultilevelScratch {
  std::vector<uint32_t> nodes, counts, pattern, slot, bucketed;
  std::vector<std::vector<uint32_t>> part_nodes, part_counts;  // by part
};
MultilevelScratch& multilevel_scratch() {
  static thread_local MultilevelScratch s;
  return s;
}
struct FinePeelScratch {
  PeelTable storage;
  std::vector<uint32_t> scratch;
};
FinePeelScratch& fine_peel_scratch() {
  static thread_local FinePeelScratch s;
  return s;
}

// Sink vectors (any sink with `nodes` and `counts`) swapped with the kept ones of their parts, both ways:
// before a pass the kept memory goes into the sinks, after it back into the kept storage.
template <typename Sink>
void swap_part_vectors(std::vector<Sink>& sinks, MultilevelScratch& kept) {
  if (kept.part_nodes.size() < sinks.size()) {
    kept.part_nodes.resize(sinks.size());
    kept.part_counts.resize(sinks.size());
  }
  for (size_t p = 0; p < sinks.size(); ++p) {
    sinks[p].nodes.swap(kept.part_nodes[p]);
    sinks[p].counts.swap(kept.part_counts[p]);
  }
}

// The increasing `keys` [0, count), bucketed (stably) by their group of `table`: group g's keys are
// bucketed[goff[g], goff[g + 1]), increasing, and the key at position i went to bucketed[slot[i]].
// Two parallel passes over contiguous ranges (a histogram, then the scatter: one sequential stream
// per group); groups are hashed a chunk at a time (vectorised) in both.
void bucket_keys(const SegmentedTable& table, const uint32_t* keys, uint64_t count, int nt,
                 std::vector<uint32_t>* bucketed, std::vector<uint32_t>* slot, std::vector<uint64_t>* goff) {
  const uint64_t groups = table.groups();
  constexpr size_t kChunk = 2048;
  bucketed->resize(count);
  slot->resize(count);
  goff->assign(groups + 1, 0);
  std::vector<std::vector<uint64_t>> hist(nt, std::vector<uint64_t>(groups, 0));
  auto pass = [&](int part, bool scatter) {
    uint64_t b, e;
    split_range(count, nt, part, &b, &e);
    uint64_t* h = hist[part].data();
    uint32_t group[kChunk];
    for (uint64_t i = b; i < e; i += kChunk) {
      const size_t n = (size_t)std::min<uint64_t>(kChunk, e - i);
      hash_groups(table, keys + i, n, group);
      if (scatter) {
        for (size_t j = 0; j < n; ++j) {
          const uint64_t at = h[group[j]]++;
          (*bucketed)[at] = keys[i + j];
          (*slot)[i + j] = (uint32_t)at;
        }
      } else {
        for (size_t j = 0; j < n; ++j) ++h[group[j]];
      }
    }
  };
  // Parts are fixed ranges (nt of them, whatever the team size), processed by whichever thread.
#pragma omp parallel for num_threads(nt) schedule(static, 1)
  for (int p = 0; p < nt; ++p) pass(p, false);
  histogram_to_cursors(hist, groups, goff);
#pragma omp parallel for num_threads(nt) schedule(static, 1)
  for (int p = 0; p < nt; ++p) pass(p, true);
}

// Fine words [0, n) times `scale` as exact integers of magnitude below 2^22 into dst (a SUM of such
// integers is exact; an AVERAGE is within 1/2 of one after scaling back). Returns kDecodeIndexCorrupt
// for a word that is not an integer (or NaN), else kDecodeIndexOverflow for one of magnitude 2^22 or
// more (more nodes summed into one cell than the layout was sized for: reported, never decoded), else
// kDecodeOk. A bad word is stored as 0.
int32_t read_fine_words(const float* src, uint64_t n, double scale, double* dst) {
  uint32_t seen = kFineWordOk;
  for (uint64_t i = 0; i < n; ++i) {
    long long v;
    seen |= read_fine_word(src[i], scale, &v);  // lhc_layout.h, shared with the CUDA kernels
    dst[i] = (double)v;
  }
  if (seen & kFineWordCorrupt) return kDecodeIndexCorrupt;
  return (seen & kFineWordOverflow) ? kDecodeIndexOverflow : kDecodeOk;
}

// The more severe of two read_fine_words statuses: corrupt over overflow over ok.
inline int32_t worse_word_status(int32_t a, int32_t b) {
  return (b == kDecodeIndexCorrupt || (b != kDecodeOk && a == kDecodeOk)) ? b : a;
}

// One fine level of a multilevel index: exact integer peeling of its table over the known non-zero
// `nodes` (increasing). A pure cell holds one node's aggregate pattern times the node's sign there,
// whose base-(n+1) digits are its children's counts; where peeling stalls, two nodes sharing all three
// cells are solved from two of them (solve_pairs) unless their signs are proportional. Groups of the table are peeled in parallel (see above); the patterns are stored
// by group, node p's at pattern[slot[p] * words, (slot[p] + 1) * words) (slot empty: one group, slot[p]
// = p). Reading them back in node order reads one sequential stream per group. Returns a DecodeStatus
// with the precedence of a whole-table peel: a malformed word (corrupt, then overflow) anywhere; then
// an inconsistent peel (a pure cell that is no pattern; a solved pair that is no pair of patterns or
// disagrees with its third cell); then a node left unpeeled; then words left over.
int32_t peel_fine_level(const CodecLayout& L, uint32_t l, const DecodeInputs& in, const float* payload, int nt,
                        const std::vector<uint32_t>& nodes, std::vector<uint32_t>* pattern,
                        std::vector<uint32_t>* slot) {
  const uint64_t base = L.index.base, w = L.fine_digits[l], wpg = L.fine_words[l];
  const SegmentedTable& table = L.fine[l];
  const uint64_t below = l + 1 < L.fine_levels ? L.span[l + 1] : 1;
  if (w == 0 || wpg == 0 || L.span[l] != w * wpg * below || table.seg_count < 3 || table.seg_count % 3)
    return kDecodeIndexCorrupt;  // a layout guard
  const uint64_t groups = table.groups(), gcells = table.group_cells();
  const float* fine = payload + L.fine_offset[l];
  double word_limit = 1.0;
  for (uint64_t i = 0; i < w; ++i) word_limit *= (double)base;
  const uint64_t M = nodes.size();
  pattern->resize(M * wpg);
  std::vector<uint32_t>& bucketed = multilevel_scratch().bucketed;
  std::vector<uint64_t> goff{0, M};
  slot->clear();
  if (groups > 1) bucket_keys(table, nodes.data(), M, nt, &bucketed, slot, &goff);
  const uint32_t* gnodes = groups > 1 ? bucketed.data() : nodes.data();
  // Per group: word status, and whether its peel was inconsistent, incomplete, or left words over.
  std::vector<int32_t> word_status(groups, kDecodeOk);
  std::vector<char> bad(groups, 0), failed(groups, 0), leftover(groups, 0);
#pragma omp parallel num_threads(nt)
  {
    FinePeelScratch& kept = fine_peel_scratch();
    PeelTable& storage = kept.storage;
    std::vector<uint32_t>& scratch = kept.scratch;
    // A group's peel, compiled twice: for one word per node (the loops over a node's words fold away;
    // both levels of 2^26 coordinates at 0.1% on 8 ranks, say) and for any number of words.
    const auto peel_group = [&](auto words_tag, int64_t g) {
      constexpr uint64_t kWords = decltype(words_tag)::value;
      const uint64_t W = kWords ? kWords : wpg;
      const PeelCells t = storage.reset(table.seg_len, W);
      int32_t ws = kDecodeOk;
      for (uint64_t c = 0; c < gcells; ++c) {
        t.clear_state(c);
        ws = worse_word_status(ws, read_fine_words(fine + ((uint64_t)g * gcells + c) * W, W, in.scale, t.values(c)));
      }
      word_status[g] = ws;
      if (ws != kDecodeOk) return;
      const uint64_t kb = goff[g], kn = goff[g + 1] - kb;
      build_states(t, table, gnodes + kb, (uint32_t)kn, scratch);
      uint32_t* gpat = pattern->data() + kb * W;
      bool group_bad = false;
      // Words are exact integers of magnitude below 2^22 held in doubles, so every product by a sign
      // and every sum below is exact.
      uint32_t resolved = peel(
          t, (uint32_t)kn, scratch,
          [&](uint32_t pos, const uint64_t* cell, const double* coef) {
            const double* src = t.values(cell[0]);
            uint32_t* pat = gpat + (uint64_t)pos * W;
            for (uint64_t i = 0; i < W; ++i) {
              const double u = coef[0] * src[i];  // the node's pattern word: its sign there times the cell
              if (!(u >= 0.0 && u < word_limit)) { group_bad = true; return false; }
              pat[i] = (uint32_t)u;
            }
            double* d0 = t.values(cell[0]);
            for (uint64_t i = 0; i < W; ++i) d0[i] = 0.0;
            for (int j = 1; j < 3; ++j) {
              double* d = t.values(cell[j]);
              for (uint64_t i = 0; i < W; ++i) d[i] -= coef[j] * (double)pat[i];
            }
            return true;
          },
          &group_bad);
      if (!group_bad && resolved < kn)
        resolved += solve_pairs(t, table, gnodes + kb, (uint32_t)kn, W, scratch,
                                [&](uint32_t pa, uint32_t pb, const uint64_t* cell, const int* wa, const int* wb,
                                    const double* va, const double* vb) {
                                  if (group_bad) return;
                                  uint32_t* pat_a = gpat + (uint64_t)pa * W;
                                  uint32_t* pat_b = gpat + (uint64_t)pb * W;
                                  for (uint64_t i = 0; i < W; ++i) {
                                    // Integer patterns (a division by det = +-2 that leaves a half is
                                    // no pair of patterns) that explain all three cells.
                                    const double a = va[i], b = vb[i];
                                    bool ok = a >= 0.0 && a < word_limit && a == std::floor(a) && b >= 0.0 &&
                                              b < word_limit && b == std::floor(b);
                                    for (int j = 0; j < 3; ++j) ok &= t.values(cell[j])[i] == wa[j] * a + wb[j] * b;
                                    if (!ok) { group_bad = true; return; }
                                    pat_a[i] = (uint32_t)a;
                                    pat_b[i] = (uint32_t)b;
                                  }
                                  for (int j = 0; j < 3; ++j)
                                    for (uint64_t i = 0; i < W; ++i) t.values(cell[j])[i] = 0.0;
                                });
      bad[g] = group_bad;
      if (group_bad) return;
      if (resolved != kn) { failed[g] = 1; return; }
      for (uint64_t c = 0; c < gcells && !leftover[g]; ++c)
        for (uint64_t i = 0; i < W; ++i)
          if (t.values(c)[i] != 0.0) leftover[g] = 1;
    };
#pragma omp for schedule(dynamic, 1)
    for (int64_t g = 0; g < (int64_t)groups; ++g) {
      if (wpg == 1)
        peel_group(std::integral_constant<uint64_t, 1>(), g);
      else
        peel_group(std::integral_constant<uint64_t, 0>(), g);
    }
  }
  int32_t ws = kDecodeOk;
  for (int32_t s : word_status) ws = worse_word_status(ws, s);
  if (ws != kDecodeOk) return ws;
  if (std::find(bad.begin(), bad.end(), 1) != bad.end()) return kDecodeIndexCorrupt;
  if (std::find(failed.begin(), failed.end(), 1) != failed.end()) return kDecodeIndexPeelFailed;
  if (std::find(leftover.begin(), leftover.end(), 1) != leftover.end()) return kDecodeIndexCorrupt;
  return kDecodeOk;
}

// Children of the nodes of fine level l from their patterns, in parallel over contiguous ranges of
// node positions: each child's count is at most its node's count (a child's ranks all hold the node)
// and together at least it (each of those ranks holds a key under some child). Part p (of nt, fixed
// ranges whatever the team size) calls sinks[p](child, count) for the non-zero children of its range
// in increasing order, on a private copy of the sink (no false sharing), moved back at the end. Adds
// the children's counts to *total. Returns false on an inconsistent pattern.
template <typename Sink>
bool expand_children(const CodecLayout& L, uint32_t l, int nt, const std::vector<uint32_t>& nodes,
                     const std::vector<uint32_t>& counts, const std::vector<uint32_t>& pattern,
                     const std::vector<uint32_t>& slot, std::vector<Sink>& sinks, uint64_t* total) {
  const uint32_t base = L.index.base, w = L.fine_digits[l], wpg = L.fine_words[l];
  const uint64_t children = (uint64_t)w * wpg;
  const uint64_t below = l + 1 < L.fine_levels ? L.span[l + 1] : 1;
  const uint64_t child_limit = (L.num_keys + below - 1) / below;
  // A word u < base^w <= 2^22 is split into hi = floor(u / base^h) and lo = u - hi base^h, whose
  // table entries give the non-zero digits' mask, their sum and the largest (DigitMaskTable, as the
  // bitmap index reads its words): most of a word's w digits are zero, and only the non-zero ones
  // are computed, digit j as q_j - base q_{j+1} with q_j = floor(u / base^j) (DigitReciprocals).
  if (w == 0 || w > kMaxPerWord) return false;  // a layout guard
  const DigitReciprocals powers(base, w);
  const DigitMaskTable table(DigitPacking{base, w, 0});
  const uint64_t* const entry = table.entry.data();
  const uint32_t lo_digits = table.lo_digits, lo_power = (uint32_t)table.lo_power;
  const double inv_lo = 1.0 / table.lo_power;
  uint64_t word_limit = 1;
  for (uint32_t j = 0; j < w; ++j) word_limit *= base;
  constexpr uint64_t kField = (1u << 22) - 1;
  const uint64_t M = nodes.size();
  std::vector<uint64_t> sums(nt, 0);
  std::vector<char> bad(nt, 0);
#pragma omp parallel for num_threads(nt) schedule(static, 1)
  for (int part = 0; part < nt; ++part) {
    Sink sink = std::move(sinks[part]);
    uint64_t pb, pe, sum = 0;
    split_range(M, nt, part, &pb, &pe);
    bool ok = true;
    constexpr uint64_t kAhead = 16;  // the patterns are read from one stream per fine group
    for (uint64_t p = pb; p < pe && ok; ++p) {
      if (!slot.empty() && p + kAhead < pe) __builtin_prefetch(pattern.data() + slot[p + kAhead] * (uint64_t)wpg, 0, 0);
      const uint32_t* pat = pattern.data() + (slot.empty() ? p : slot[p]) * (uint64_t)wpg;
      const uint64_t first = (uint64_t)nodes[p] * children;
      const uint32_t cap = counts[p];
      uint64_t node_sum = 0;
      for (uint32_t i = 0; i < wpg; ++i) {
        const uint32_t u = pat[i];
        if (u == 0) continue;
        if (u >= word_limit) { ok = false; break; }  // peel_fine_level rules that out
        const uint32_t hi = (uint32_t)(int32_t)(((double)u + 0.5) * inv_lo), lo = u - hi * lo_power;  // exact floor
        const uint64_t a = entry[lo], b = entry[hi];
        const uint32_t mask = (uint32_t)(a & kField) | (uint32_t)(b & kField) << lo_digits;
        const uint64_t first_child = first + (uint64_t)i * w;
        node_sum += ((a >> 22) & kField) + ((b >> 22) & kField);
        // A digit above the node's count, or a non-zero child past the last (the highest set bit's).
        if (std::max(a >> 44, b >> 44) > cap || first_child + (31 - __builtin_clz(mask)) >= child_limit) {
          ok = false;
          break;
        }
        for (uint32_t m = mask; m; m &= m - 1) {
          const uint32_t j = (uint32_t)__builtin_ctz(m);
          sink.offer((uint32_t)(first_child + j), powers.quotient(u, j) - base * powers.quotient(u, j + 1));
        }
      }
      if (node_sum < cap) ok = false;
      sum += node_sum;
    }
    sink.finish();
    sinks[part] = std::move(sink);
    sums[part] = sum;
    bad[part] = !ok;
  }
  for (int p = 0; p < nt; ++p) {
    *total += sums[p];
    if (bad[p]) return false;
  }
  return true;
}

// The children of a level above the finest: the next level's nodes and their counts. offer() keeps
// a child with a non-zero count (stored unconditionally, kept by advancing the size).
struct ChildSink {
  std::vector<uint32_t> nodes, counts;
  uint64_t size = 0;
  void offer(uint32_t child, uint32_t c) {
    if (nodes.size() < size + 1) {
      nodes.resize(2 * size + 64);
      counts.resize(2 * size + 64);
    }
    nodes[size] = child;
    counts[size] = c;
    size += c != 0;
  }
  void finish() {
    nodes.resize(size);
    counts.resize(size);
  }
};

// The children of the finest level, the support keys, bucketed by sketch group: a chunk of keys at a
// time is hashed (vectorised) and appended to its groups' buckets (sized ahead: plain stores).
struct SupportSink {
  static constexpr uint32_t kChunk = 2048;
  struct Bucket {
    HugeVector<uint32_t> keys;
    uint64_t size = 0;
  };
  const SegmentedTable* table;
  std::vector<Bucket> buckets;
  std::vector<uint32_t> keys, group;  // a chunk of keys and their groups (+1: the offer past the last)
  std::vector<uint32_t> counts;       // the chunk's keys' counts (+1 as keys)
  uint64_t check_stream = 0;
  unsigned long long check[kIndexCheckFields] = {0, 0};  // sum of count(k) * part_f(k) (lhc_layout.h)
  uint32_t size = 0;
  void offer(uint32_t key, uint32_t c) {
    keys[size] = key;
    counts[size] = c;
    size += c != 0;
    if (size == kChunk) flush();
  }
  void flush() {
    index_check_sums(check_stream, keys.data(), counts.data(), size, check);
    for (Bucket& b : buckets)
      if (b.keys.size() < b.size + size) b.keys.resize(2 * (b.size + size));
    if (buckets.size() == 1) {
      std::copy(keys.data(), keys.data() + size, buckets[0].keys.data() + buckets[0].size);
      buckets[0].size += size;
    } else {
      hash_groups(*table, keys.data(), size, group.data());
      for (uint32_t i = 0; i < size; ++i) {
        Bucket& b = buckets[group[i]];
        b.keys[b.size++] = keys[i];
      }
    }
    size = 0;
  }
  void finish() {
    flush();
    for (Bucket& b : buckets) b.keys.resize(b.size);
  }
};

// nodes/counts = the parts' first `size` nodes and counts, concatenated in part order (in parallel).
template <typename Sink>
void concat_parts(const std::vector<Sink>& sinks, int nt, std::vector<uint32_t>* nodes, std::vector<uint32_t>* counts) {
  std::vector<uint64_t> at(sinks.size() + 1, 0);
  for (size_t p = 0; p < sinks.size(); ++p) at[p + 1] = at[p] + sinks[p].size;
  nodes->resize(at.back());
  counts->resize(at.back());
#pragma omp parallel for num_threads(nt) schedule(static, 1)
  for (int64_t p = 0; p < (int64_t)sinks.size(); ++p) {
    std::copy(sinks[p].nodes.begin(), sinks[p].nodes.begin() + sinks[p].size, nodes->begin() + at[p]);
    std::copy(sinks[p].counts.begin(), sinks[p].counts.begin() + sinks[p].size, counts->begin() + at[p]);
  }
}

}  // namespace

void release_multilevel_scratch() {
  multilevel_scratch() = MultilevelScratch();
  fine_peel_scratch() = FinePeelScratch();
}

// Multilevel index: the non-zero nodes of the coarsest fine level from the coarse counting bitmap,
// then each fine level peeled over exactly the non-zero nodes found above it. Returns a
// DecodeStatus and the keys with a count >= 1, in increasing order, bucketed by sketch group.
int32_t multilevel_support(const CodecLayout& L, const DecodeInputs& in, const float* payload, int nt,
                           GroupedKeys* support, DecodeStats* st) {
  const uint64_t n = in.world_size;
  auto kept = support->take();  // the caller's buckets (kept from its last decode), reused below
  if (L.fine_levels == 0 || L.fine_levels > kMaxFineLevels) return kDecodeIndexCorrupt;  // a layout guard
  Prof prof;
  const uint64_t num_nodes = L.index.digits;
  // The coarse digits: each unpacking thread appends its (increasing) non-zero nodes and counts,
  // branch-free: for each 8 digits of a word, the positions of all 8 from the table of set bits are
  // stored and the end advances by the number of non-zero ones (room for 8 past the end is kept).
  struct NodeSink {
    std::vector<uint32_t> nodes, counts;
    uint64_t size, num_nodes, sum;
    uint32_t per_word, world_size;
    bool operator()(uint64_t first_word, uint32_t words, const WordDigits& d) {
      if (d.max > world_size) return false;
      sum += d.sum;
      const uint64_t room = size + (uint64_t)words * per_word + 8;
      if (nodes.size() < room) {
        nodes.resize(2 * room);
        counts.resize(2 * room);
      }
      const uint64_t start = size;
      for (uint32_t v = 0; v < words; ++v) {
        const uint32_t first = (uint32_t)((first_word + v) * per_word);
        for (uint32_t s = 0; s < per_word; s += 8) {
          const uint32_t m = (d.nonzero[v] >> s) & 0xffu;
          for (int j = 0; j < 8; ++j) {
            nodes[size + j] = first + s + kSetBit.at[m][j];
            counts[size + j] = d.digit[s + kSetBit.at[m][j]][v];
          }
          size += kSetBit.count[m];
        }
      }
      return size == start || nodes[size - 1] < num_nodes;  // else a digit past the last node
    }
  };
  MultilevelScratch& scratch = multilevel_scratch();
  std::vector<NodeSink> sinks(nt, NodeSink{{}, {}, 0, num_nodes, 0, L.index.per_word, (uint32_t)n});
  swap_part_vectors(sinks, scratch);
  for (NodeSink& k : sinks) {
    const uint64_t expect = std::min<uint64_t>(num_nodes, in.total_keys) / nt + 64;
    k.nodes.resize(expect);
    k.counts.resize(expect);
  }
  const bool valid = unpack_digits(L, payload + L.index_offset, in.scale, nt, sinks);
  uint64_t coarse_sum = 0;
  for (const NodeSink& k : sinks) coarse_sum += k.sum;
  // Every rank's non-zero nodes are at most its non-zero keys.
  if (!valid || coarse_sum > in.total_keys) return kDecodeIndexCorrupt;
  std::vector<uint32_t>&nodes = scratch.nodes, &counts = scratch.counts, &pattern = scratch.pattern,
                        &slot = scratch.slot;
  concat_parts(sinks, nt, &nodes, &counts);
  swap_part_vectors(sinks, scratch);
  std::vector<NodeSink>().swap(sinks);
  prof.mark("ml coarse");

  const SegmentedTable& T = L.sketch;
  const uint64_t sgroups = T.groups();
  for (uint32_t l = 0; l < L.fine_levels; ++l) {
    const int32_t status = peel_fine_level(L, l, in, payload, nt, nodes, &pattern, &slot);
    if (status != kDecodeOk) return status;
    prof.mark("ml peel");
    uint64_t total = 0;
    if (l + 1 < L.fine_levels) {
      // The next level's nodes: each part's children, then concatenated in part order.
      // Room for a part's share of the nodes, and an eighth more (most nodes have one non-zero child
      // at low density): the sinks seldom grow.
      std::vector<ChildSink> sinks(nt);
      swap_part_vectors(sinks, scratch);
      for (ChildSink& sink : sinks) {
        sink.nodes.resize(nodes.size() / nt + nodes.size() / (8 * nt) + 64);
        sink.counts.resize(sink.nodes.size());
      }
      const bool ok = expand_children(L, l, nt, nodes, counts, pattern, slot, sinks, &total);
      // Each rank's non-zero children at any level are at most its non-zero keys.
      if (!ok || total > in.total_keys) return kDecodeIndexCorrupt;
      concat_parts(sinks, nt, &nodes, &counts);
      swap_part_vectors(sinks, scratch);
    } else {
      // The support keys, each part's bucketed by sketch group (a part of GroupedKeys per range).
      // Buckets have room for a part's share of a group's keys (at most total_keys of them, and the
      // nodes' children): no reallocation in the common case.
      SupportSink proto{&T, std::vector<SupportSink::Bucket>(sgroups), std::vector<uint32_t>(SupportSink::kChunk + 1),
                        std::vector<uint32_t>(SupportSink::kChunk + 1), std::vector<uint32_t>(SupportSink::kChunk + 1),
                        index_check_stream(T.stream)};
      const uint64_t most = std::min<uint64_t>(std::min<uint64_t>(in.total_keys, L.num_keys),
                                               nodes.size() * (uint64_t)L.fine_digits[l] * L.fine_words[l]);
      const uint64_t expect = most / ((uint64_t)nt * sgroups);
      std::vector<SupportSink> sinks(nt, proto);
      for (size_t t = 0; t < sinks.size(); ++t)
        for (uint64_t g = 0; g < sgroups; ++g)
          GroupedKeys::reuse(kept, t, g, expect + expect / 8 + 64, &sinks[t].buckets[g].keys);
      const bool ok = expand_children(L, l, nt, nodes, counts, pattern, slot, sinks, &total);
      support->by.clear();
      for (SupportSink& k : sinks) {
        for (uint32_t f = 0; f < kIndexCheckFields; ++f) st->index_check[f] += k.check[f];
        std::vector<HugeVector<uint32_t>> part;
        for (auto& b : k.buckets) part.push_back(std::move(b.keys));
        support->by.push_back(std::move(part));
      }
      if (!ok || total > in.total_keys) return kDecodeIndexCorrupt;
      st->index_total = total;
    }
    prof.mark("ml expand");
  }
  st->candidates = support->total();
  if (st->index_total != in.total_keys) return kDecodeIndexCorrupt;
  return kDecodeOk;
}

}  // namespace detail
}  // namespace cpu
}  // namespace lhc
