// Keys into a segmented table's cells and groups: hashing (vectorised), bucketing by group, and the
// peeling states of a group (peel.h).
#include "peel.h"

namespace lhc {
namespace cpu {
namespace detail {

// kc[3i + j] = (offset of cell j of keys[i] in its segment << kWeightCodeBits) | its weight code, for i < count: the
// packed cells of PeelCells. A pure function of each key, written as a flat loop so the compiler can
// vectorise the 64-bit hashing; cloned for AVX-512 (64-bit multiplies in vector registers) and AVX2,
// chosen at load time.
__attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
void hash_cells(const SegmentedTable& table, const uint32_t* keys, uint32_t count, uint32_t* kc) {
  const SegmentedTable t = table;
  for (uint32_t i = 0; i < count; ++i) {
    const uint64_t h = key_hash(t, keys[i]);
    const uint64_t first = 3 * hash_group(t, h);  // the key's first segment
    for (int j = 0; j < 3; ++j) {
      uint32_t code;
      const uint64_t offset = key_cell_code(t, h, j, &code) - (first + (uint64_t)j) * t.seg_len;
      kc[3 * (uint64_t)i + j] = (uint32_t)(offset << kWeightCodeBits) | code;
    }
  }
}

// group[i] = the sketch group of keys[i], for i < count; vectorised like hash_cells.
__attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
void hash_groups(const SegmentedTable& table, const uint32_t* keys, size_t count, uint32_t* group) {
  const SegmentedTable t = table;
  for (size_t i = 0; i < count; ++i) group[i] = (uint32_t)key_group(t, keys[i]);
}

// The first cells of consecutive keys (peel.h); vectorised like hash_groups.
__attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
void hash_first_cells(const SegmentedTable& table, uint64_t first, size_t count, uint64_t* cell) {
  const SegmentedTable t = table;
  for (size_t i = 0; i < count; ++i) {
    uint32_t code;  // unused: index tables add counts
    cell[i] = key_cell_code(t, key_hash(t, first + i), 0, &code);
  }
}

// The index checksum's sums (peel.h); vectorised like hash_groups.
__attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
void index_check_sums(uint64_t stream, const uint32_t* keys, const uint32_t* counts, size_t count,
                      unsigned long long check[kIndexCheckFields]) {
  uint64_t s0 = 0, s1 = 0;
  uint32_t part[kIndexCheckFields];
  if (counts) {
    for (size_t i = 0; i < count; ++i) {
      index_check_parts(stream, keys[i], part);
      s0 += (uint64_t)counts[i] * part[0];
      s1 += (uint64_t)counts[i] * part[1];
    }
  } else {
    for (size_t i = 0; i < count; ++i) {
      index_check_parts(stream, keys[i], part);
      s0 += part[0];
      s1 += part[1];
    }
  }
  check[0] += s0;
  check[1] += s1;
}

// Count keys[0, count), all of one group of `table`, into the states of t (cleared before): each
// key's cells are hashed a chunk at a time (vectorised; kc is scratch) and its cells' lines are
// prefetched well ahead, as each key costs only a few instructions.
void build_states(PeelCells t, const SegmentedTable& table, const uint32_t* keys, uint32_t count,
                  std::vector<uint32_t>& kc) {
  constexpr uint32_t kChunk = 4096, kAhead = 32;
  kc.resize(3 * kChunk);
  for (uint32_t first = 0; first < count; first += kChunk) {
    const uint32_t n = std::min(kChunk, count - first);
    hash_cells(table, keys + first, n, kc.data());
    for (uint32_t i = 0; i < n; ++i) {
      if (i + kAhead < n)
        for (int j = 0; j < 3; ++j) t.prefetch(t.cell(j, kc[3 * (i + kAhead) + j]));
      const uint32_t* e = &kc[3 * i];
      const PeelCells::Record k = PeelCells::record(first + i, e);
      for (int j = 0; j < 3; ++j) t.update(t.cell(j, e[j]), k, 1);
    }
  }
}

// Turn per-part group histograms into write cursors: hist[p][g] becomes where part p's first key of
// group g goes (groups in order, parts in order within a group), and offsets[g] the first position of
// group g (offsets[groups] = the total). Stable bucketing of parts that cover increasing key ranges.
void histogram_to_cursors(std::vector<std::vector<uint64_t>>& hist, uint64_t groups, std::vector<uint64_t>* offsets) {
  uint64_t run = 0;
  for (uint64_t g = 0; g < groups; ++g) {
    (*offsets)[g] = run;
    for (auto& h : hist) {
      const uint64_t c = h[g];
      h[g] = run;
      run += c;
    }
  }
  (*offsets)[groups] = run;
}

}  // namespace detail
}  // namespace cpu
}  // namespace lhc
