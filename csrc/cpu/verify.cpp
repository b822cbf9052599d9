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
constexpr uint32_t kTooLarge = std::numeric_limits<uint32_t>::max();  // an ancestry over kAncestryCap

// Whether two sorted lists share an element: a merge, or binary searches of the shorter list's
// elements when it is much shorter (a shallow key's ancestry against a deep one's).
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
    if (a[i] == b[j]) return true;
    if (a[i] < b[j])
      ++i;
    else
      ++j;
  }
  return false;
}

}  // namespace

void verify_group(PeelCells t, const SegmentedTable& table, const uint32_t* keys, uint32_t count, uint64_t block,
                  const std::vector<uint32_t>& order, const double* key_err, double rtol, VerifyScratch& s,
                  std::vector<uint32_t>& inexact) {
  const uint64_t cells = t.cells();
  // The cell -> keys adjacency, by a counting sort of the keys' hashed cells (positions increasing
  // within a cell).
  s.kc.resize(3 * (uint64_t)count);
  hash_cells(table, keys, count, s.kc.data());
  s.offsets.assign(cells + 1, 0);
  for (uint64_t i = 0; i < 3 * (uint64_t)count; ++i) ++s.offsets[t.cell((int)(i % 3), s.kc[i]) + 1];
  for (uint64_t c = 0; c < cells; ++c) s.offsets[c + 1] += s.offsets[c];
  s.members.resize(3 * (uint64_t)count);
  s.cursor.assign(s.offsets.begin(), s.offsets.end() - 1);
  for (uint64_t i = 0; i < 3 * (uint64_t)count; ++i) s.members[s.cursor[t.cell((int)(i % 3), s.kc[i])]++] = (uint32_t)(i / 3);
  // Every peeled key's ancestry (lhc_ancestry.h) as a sorted list, in peel order: itself merged with
  // its parents' (the other keys of its read cell, its pure cell's state still naming it), kTooLarge
  // above kAncestryCap keys. The same sets as lhc_ancestry.h's walks (the CUDA kernel's), kept: a
  // key's ancestry is tested against many. A solved pair's keys keep kTooLarge.
  s.anc_at.assign(count, 0);
  s.anc_len.assign(count, kTooLarge);
  s.arena.clear();
  for (const uint32_t c : order) {
    const uint32_t k = t.pos(c);
    s.merged.assign(1, k);
    bool large = false;
    for (uint32_t e = s.offsets[c]; e < s.offsets[c + 1] && !large; ++e) {
      const uint32_t p = s.members[e];
      if (p == k) continue;
      if (s.anc_len[p] == kTooLarge) {
        large = true;
        break;
      }
      const uint32_t* a = s.arena.data() + s.anc_at[p];
      s.next.resize(s.merged.size() + s.anc_len[p]);
      s.next.resize(std::set_union(s.merged.begin(), s.merged.end(), a, a + s.anc_len[p], s.next.begin()) -
                    s.next.begin());
      s.merged.swap(s.next);
      large = s.merged.size() > kAncestryCap;
    }
    if (large) continue;
    s.anc_at[k] = s.arena.size();
    s.anc_len[k] = (uint32_t)s.merged.size();
    s.arena.insert(s.arena.end(), s.merged.begin(), s.merged.end());
  }
  // Cell d verifies k soundly: none of its keys other than k and its reader shares an ancestor with k.
  const auto sound = [&](uint32_t k, uint64_t d, uint32_t reader) {
    for (uint32_t e = s.offsets[d]; e < s.offsets[d + 1]; ++e) {
      const uint32_t i = s.members[e];
      if (i == k || i == reader) continue;
      if (s.anc_len[k] == kTooLarge || s.anc_len[i] == kTooLarge) return false;
      if (meet(s.arena.data() + s.anc_at[k], s.anc_len[k], s.arena.data() + s.anc_at[i], s.anc_len[i])) return false;
    }
    return true;
  };

  s.kver.resize(count);
  const double inf = std::numeric_limits<double>::infinity();
  for (size_t i = order.size(); i-- > 0;) {
    const uint64_t c = order[i];
    const uint32_t pos = t.pos(c);
    const int pure = t.segment(c);
    // The two other cells' bounds on k's error (V / |w|), the smaller tested first: G(k) is the
    // least of those whose cell verifies k soundly, so a sound smaller one settles it.
    double v[2];
    uint64_t d[2];
    uint32_t reader[2];
    for (int j = 0, o = 0; j < 3; ++j) {
      if (j == pure) continue;
      const uint32_t e = t.packed(c, j);
      d[o] = t.cell(j, e);
      const double a = t.acc(d[o]);
      const bool read = a == PeelCells::kReadCell;
      reader[o] = read ? t.pos(d[o]) : kNoCell;
      v[o] = (a >= 0.0 ? a : read ? s.kver[reader[o]] : inf) * std::fabs(PeelCells::inverse_weight(e));
      ++o;
    }
    const int first = v[1] < v[0];
    double gk = inf;
    for (const int o : {first, 1 - first}) {
      if (!(v[o] < gk)) continue;
      if (sound(pos, d[o], reader[o])) {
        gk = v[o];
        break;
      }
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
