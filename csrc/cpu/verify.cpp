// The value peel's verification bounds over one completely peeled group (decodes with verify only):
// lhc::verification_bound, with the cells that may verify each key chosen by lhc_ancestry.h.
#include <algorithm>
#include <cmath>
#include <limits>

#include "../lhc_ancestry.h"  // kAncestryCap
#include "peel.h"

namespace lhc {
namespace cpu {
namespace detail {

namespace {

constexpr uint32_t kNoCell = std::numeric_limits<uint32_t>::max();
using Ancestry = VerifyScratch::Ancestry;
constexpr uint16_t kTooLarge = Ancestry::kTooLarge;

// Whether two sorted lists share an element: a merge whose steps are branch-free (which list
// advances is a coin flip to a branch predictor), or binary searches of the shorter list's elements
// when it is much shorter (a shallow key's ancestry against a deep one's).
bool meet(const uint32_t* a, uint32_t na, const uint32_t* b, uint32_t nb) {
  if (na > nb) {
    std::swap(a, b);
    std::swap(na, nb);
  }
  if (8 * na < nb) {
    for (uint32_t i = 0; i < na; ++i)
      if (std::binary_search(b, b + nb, a[i])) return true;
    return false;
  }
  uint32_t i = 0, j = 0;
  while (i < na && j < nb) {
    const uint32_t x = a[i], y = b[j];
    if (x == y) return true;
    i += x < y;
    j += y < x;
  }
  return false;
}

// out = the sorted union of the sorted lists a and b (no duplicates within either; one in both is
// written once); its size. Branch-free as in meet.
uint32_t merge_union(const uint32_t* a, uint32_t na, const uint32_t* b, uint32_t nb, uint32_t* out) {
  uint32_t i = 0, j = 0, n = 0;
  while (i < na && j < nb) {
    const uint32_t x = a[i], y = b[j];
    out[n++] = x < y ? x : y;
    i += x <= y;
    j += y <= x;
  }
  while (i < na) out[n++] = a[i++];
  while (j < nb) out[n++] = b[j++];
  return n;
}

// The cell -> keys adjacency of a group (s.offsets, s.members), by a counting sort of the keys' hashed
// cells (positions increasing within a cell).
void build_cell_members(PeelCells t, const SegmentedTable& table, const uint32_t* keys, uint32_t count,
                        VerifyScratch& s) {
  const uint64_t cells = t.cells();
  s.kc.resize(3 * (uint64_t)count);
  hash_cells(table, keys, count, s.kc.data());
  s.offsets.assign(cells + 1, 0);
  for (uint64_t i = 0; i < 3 * (uint64_t)count; ++i) ++s.offsets[t.cell((int)(i % 3), s.kc[i]) + 1];
  for (uint64_t c = 0; c < cells; ++c) s.offsets[c + 1] += s.offsets[c];
  s.members.resize(3 * (uint64_t)count);
  s.cursor.assign(s.offsets.begin(), s.offsets.end() - 1);
  for (uint64_t i = 0; i < 3 * (uint64_t)count; ++i) s.members[s.cursor[t.cell((int)(i % 3), s.kc[i])]++] = (uint32_t)(i / 3);
}

// The parents of a peeled key for lhc_ancestry.h's walk: the keys of its read cell (read[p]; a key
// of a solved pair has none).
struct GroupDag {
  const uint32_t *read, *offsets, *members;
  bool parents(uint32_t p, uint64_t* begin, uint64_t* end) const {
    if (read[p] == kNoCell) return false;
    *begin = offsets[read[p]];
    *end = offsets[read[p] + 1];
    return true;
  }
  uint32_t member(uint64_t e) const { return members[e]; }
};

// Every peeled key's ancestry size (kTooLarge above kAncestryCap keys) and its roots as a sorted
// list (root_at, roots into s.root_arena), in peel order: the same sets as lhc_ancestry.h's
// walks (the CUDA kernel's). The tests need the roots alone: two ancestries meet exactly when their
// roots (keys without parents, the peel's first layer) do, as a common ancestor's roots are common to
// both. So the ancestry itself is never listed: a key's roots are the union of its parents' (the other
// keys of its read cell; a root's are itself), and its size is 1 + the sum of its parents' where their
// roots are disjoint (then so are their ancestries), which they are for all but ~1% of the keys with
// two parents or more; for those the ancestry is walked (lhc::walk_ancestry, capped). One parent p
// (the common case) shares p's roots. A solved pair's keys keep kTooLarge.
void build_ancestries(PeelCells t, const std::vector<uint32_t>& order, uint32_t count, VerifyScratch& s) {
  s.ancestry.assign(count, Ancestry{0, kTooLarge, 0});
  s.read.assign(count, kNoCell);
  for (const uint32_t c : order) s.read[t.pos(c)] = c;
  s.root_arena.clear();
  s.root_arena.reserve(8 * (uint64_t)count);
  s.merged.resize(2 * (kAncestryCap + 1));
  s.next.resize(2 * (kAncestryCap + 1));
  const GroupDag dag{s.read.data(), s.offsets.data(), s.members.data()};
  // Each key's entries hang off a chain of dependent loads (its cell's adjacency, its parents'
  // entries, their roots), all at random: prefetched in stages, 16, 8, 4 and 2 keys ahead.
  const uint32_t* const ord = order.data();
  const size_t nord = order.size();
  const auto members_of = [&](uint32_t c, auto&& f) {  // the key itself too: a harmless prefetch
    for (uint32_t e = s.offsets[c]; e < s.offsets[c + 1]; ++e) f(s.members[e]);
  };
  for (size_t oi = 0; oi < nord; ++oi) {
    if (oi + 16 < nord) {
      prefetch_line(&s.offsets[ord[oi + 16]]);
      t.prefetch(ord[oi + 16]);
    }
    if (oi + 8 < nord) prefetch_line(&s.members[s.offsets[ord[oi + 8]]]);
    if (oi + 4 < nord)
      members_of(ord[oi + 4], [&](uint32_t p) {
        prefetch_line(&s.ancestry[p]);
      });
    if (oi + 2 < nord)
      members_of(ord[oi + 2], [&](uint32_t p) {
        prefetch_line(s.root_arena.data() + s.ancestry[p].root_at);
      });
    const uint32_t c = ord[oi];
    const uint32_t k = t.pos(c);
    Ancestry& mine = s.ancestry[k];
    uint32_t parents = 0, parent = 0;
    for (uint32_t e = s.offsets[c]; e < s.offsets[c + 1]; ++e)
      if (s.members[e] != k) {
        parent = s.members[e];
        ++parents;
      }
    if (parents == 0) {
      mine = {(uint32_t)s.root_arena.size(), 1, 1};
      s.root_arena.push_back(k);
      continue;
    }
    if (parents == 1) {
      const Ancestry& p = s.ancestry[parent];
      if (p.size != kTooLarge && p.size + 1u <= kAncestryCap) mine = {p.root_at, (uint16_t)(p.size + 1), p.roots};
      continue;
    }
    // Two parents or more: their roots merged; any duplicate means their ancestries meet.
    // More roots than kAncestryCap: more keys too (the merge buffers hold 2 (kAncestryCap + 1)).
    uint32_t* merged = s.merged.data();
    uint32_t n = 0, inputs = 0, size = 1;
    bool large = false;
    for (uint32_t e = s.offsets[c]; e < s.offsets[c + 1] && !large; ++e) {
      const uint32_t q = s.members[e];
      if (q == k) continue;
      const Ancestry& p = s.ancestry[q];
      if ((large = p.size == kTooLarge)) break;
      size += p.size;
      inputs += p.roots;
      n = merge_union(merged, n, s.root_arena.data() + p.root_at, p.roots, s.next.data());
      s.merged.swap(s.next);
      merged = s.merged.data();
      large = n > kAncestryCap;
    }
    if (large) continue;
    if (n < inputs) {  // shared ancestors: the sum counts some twice; the union's size by a walk
      if (walk_ancestry(dag, k, s.walk, (const AncestrySet*)nullptr) != kAncestryDisjoint) continue;
      size = s.walk.size;
    }
    if (size > kAncestryCap) continue;
    mine = {(uint32_t)s.root_arena.size(), (uint16_t)size, (uint16_t)n};
    s.root_arena.insert(s.root_arena.end(), merged, merged + n);
  }
}

// s.unsound[k] bit j: k's cell in segment j holds another key, neither k nor the cell's reader, whose
// ancestry meets k's (or either ancestry is over kAncestryCap keys), so that cell cannot verify k
// (lhc::verifies_soundly). Cell by cell: a pair of keys tested once answers for both, the adjacency
// is read in order and a group's ancestry entries stay in cache; the roots are prefetched ahead.
void mark_unsound_cells(PeelCells t, VerifyScratch& s) {
  const uint64_t cells = t.cells();
  s.unsound.assign(s.ancestry.size(), 0);
  const uint32_t *const off = s.offsets.data(), *const mem = s.members.data();
  const Ancestry* const anc = s.ancestry.data();
  const uint32_t* const roots = s.root_arena.data();
  constexpr uint64_t kAhead = 16;
  for (uint64_t c = 0; c < cells; ++c) {
    if (c + 2 * kAhead < cells)
      for (uint32_t e = off[c + 2 * kAhead]; e < off[c + 2 * kAhead + 1]; ++e) prefetch_line(&anc[mem[e]]);
    if (c + kAhead < cells && off[c + kAhead + 1] - off[c + kAhead] > 1)
      for (uint32_t e = off[c + kAhead]; e < off[c + kAhead + 1]; ++e) prefetch_line(roots + anc[mem[e]].root_at);
    const uint32_t b = off[c], end = off[c + 1];
    if (end - b < 2) continue;  // no pair
    const uint32_t reader = t.acc(c) == PeelCells::kReadCell ? t.pos(c) : kNoCell;
    const uint8_t bit = (uint8_t)(1u << t.segment(c));
    for (uint32_t x = b; x < end; ++x) {
      const uint32_t k = mem[x];
      if (k == reader) continue;
      for (uint32_t y = x + 1; y < end; ++y) {
        const uint32_t i = mem[y];
        if (i == reader) continue;
        const Ancestry &ak = anc[k], &ai = anc[i];
        if (ak.size == kTooLarge || ai.size == kTooLarge ||
            meet(roots + ak.root_at, ak.roots, roots + ai.root_at, ai.roots)) {
          s.unsound[k] |= bit;
          s.unsound[i] |= bit;
        }
      }
    }
  }
}

}  // namespace

void verify_group(PeelCells t, const SegmentedTable& table, const uint32_t* keys, uint32_t count, uint64_t block,
                  const std::vector<uint32_t>& order, const double* key_err, double rtol, VerifyScratch& s,
                  std::vector<uint32_t>& inexact) {
  build_cell_members(t, table, keys, count, s);
  build_ancestries(t, order, count, s);
  mark_unsound_cells(t, s);
  const uint32_t* const ord = order.data();
  const size_t nord = order.size();
  s.kver.resize(count);
  const double inf = std::numeric_limits<double>::infinity();
  // The other two cells of the key read from cell c (f(cell) for each).
  const auto other_cells = [&](uint64_t c, auto&& f) {
    const int pure = t.segment(c);
    for (int j = 0; j < 3; ++j)
      if (j != pure) f(t.cell(j, t.packed(c, j)));
  };
  for (size_t i = nord; i-- > 0;) {
    // Prefetched in stages: the read cell's state, then the key's entries and its other cells'
    // states, then the readers' G there.
    if (i >= 16) t.prefetch(ord[i - 16]);
    if (i >= 8) {
      const uint32_t p = t.pos(ord[i - 8]);
      prefetch_line(&key_err[p]);
      prefetch_line(&s.unsound[p]);
      other_cells(ord[i - 8], [&](uint64_t d) { t.prefetch(d); });
    }
    if (i >= 4)
      other_cells(ord[i - 4], [&](uint64_t d) {
        prefetch_line(&s.kver[std::min(t.pos(d), count - 1)]);  // a reader's G (a stale pos elsewhere)
      });
    const uint64_t c = order[i];
    const uint32_t pos = t.pos(c);
    const int pure = t.segment(c);
    // The least bound (V / |w|) of its two other cells that verify it soundly.
    double gk = inf;
    for (int j = 0; j < 3; ++j) {
      if (j == pure || (s.unsound[pos] >> j & 1)) continue;
      const uint32_t e = t.packed(c, j);
      const uint64_t d = t.cell(j, e);
      const double a = t.acc(d);
      const double v = a >= 0.0 ? a : a == PeelCells::kReadCell ? s.kver[t.pos(d)] : inf;
      gk = std::min(gk, v * std::fabs(PeelCells::inverse_weight(e)));
    }
    const double w = PeelCells::inverse_weight(t.packed(c, pure));  // 1 / w_c(k)
    s.kver[pos] = gk / std::fabs(w);
    const double bound = std::max(key_err[pos], verification_bound(gk, key_err[pos]));
    const double* r = t.values(c);
    bool within = true;
    for (uint64_t l = 0; l < block; ++l) within &= within_rtol(w * r[l], bound, rtol);
    if (!within) inexact.push_back(pos);
  }
}

}  // namespace detail
}  // namespace cpu
}  // namespace lhc
