// CPU kernels of the lossless codec: encode (non-zero discovery, index, sketch scatter) and decode
// (index unpacking, candidate enumeration, exact count peeling for the Bloom index, value peeling).
//
// Determinism: every floating-point accumulation happens in a fixed order that does not depend on
// the number of threads (sketch cells are summed in increasing key order; peeling is sequential
// over a LIFO stack seeded in increasing cell order). Parallel loops only do integer work or write
// disjoint outputs, so the same payload decodes to the same bits on every run and every machine
// with IEEE-754 doubles.
#include "codec_cpu.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

namespace lhc {
namespace cpu {
namespace {

int resolve_threads(int num_threads) { return num_threads > 0 ? num_threads : omp_get_max_threads(); }

// [begin, end) of part `tid` when `total` items are split into `parts` contiguous ranges.
inline void split_range(uint64_t total, int parts, int tid, uint64_t* begin, uint64_t* end) {
  const uint64_t chunk = (total + (uint64_t)parts - 1) / (uint64_t)parts;
  *begin = std::min<uint64_t>(total, chunk * (uint64_t)tid);
  *end = std::min<uint64_t>(total, *begin + chunk);
}

void parallel_fill(float* p, uint64_t n, float value, int nt) {
#pragma omp parallel for num_threads(nt) schedule(static)
  for (int64_t i = 0; i < (int64_t)n; ++i) p[i] = value;
}

// Exact division of a small non-negative integer by a fixed small base, via a double reciprocal
// with one correction step (u < 2^22, base < 2^11: the estimate is off by at most one).
struct SmallDivider {
  int64_t base;
  double inv;
  explicit SmallDivider(uint32_t b) : base((int64_t)b), inv(1.0 / (double)b) {}
  inline void divmod(int64_t u, int64_t* q, int64_t* r) const {
    int64_t qq = (int64_t)((double)u * inv);
    int64_t rr = u - qq * base;
    if (rr >= base) { ++qq; rr -= base; }
    if (rr < 0) { --qq; rr += base; }
    *q = qq;
    *r = rr;
  }
};

// Read an index word as an exact integer in [0, base^per_word). Returns -1 if it is not one.
inline int64_t read_word(const float* p, double scale, int64_t limit) {
  const double v = (double)(*p) * scale;
  if (!(v >= -0.25 && v < (double)limit)) return -1;  // also rejects NaN
  const double r = std::nearbyint(v);
  if (std::fabs(v - r) > 0.25 || r < 0.0 || r >= (double)limit) return -1;
  return (int64_t)r;
}

// Non-zero keys of x in increasing order, and whether x held NaN/Inf. -0.0 counts as zero.
std::vector<uint64_t> find_nonzero_keys(const CodecLayout& L, const float* x, int nt, uint32_t* non_finite) {
  std::vector<std::vector<uint64_t>> local(nt);
  std::vector<uint32_t> bad(nt, 0);
#pragma omp parallel num_threads(nt)
  {
    const int tid = omp_get_thread_num();
    uint64_t kb, ke;
    split_range(L.num_keys, nt, tid, &kb, &ke);
    std::vector<uint64_t>& mine = local[tid];
    uint32_t nf = 0;
    const uint32_t* bits = reinterpret_cast<const uint32_t*>(x);
    if (L.block == 1) {
      for (uint64_t k = kb; k < ke; ++k) {
        const uint32_t u = bits[k];
        nf |= (uint32_t)((u & 0x7f800000u) == 0x7f800000u);
        if (u << 1) mine.push_back(k);
      }
    } else {
      for (uint64_t k = kb; k < ke; ++k) {
        const uint64_t lo = k * L.block, hi = std::min<uint64_t>(lo + L.block, L.numel);
        uint32_t any = 0;
        for (uint64_t i = lo; i < hi; ++i) {
          const uint32_t u = bits[i];
          nf |= (uint32_t)((u & 0x7f800000u) == 0x7f800000u);
          any |= u << 1;
        }
        if (any) mine.push_back(k);
      }
    }
    bad[tid] = nf;
  }
  size_t total = 0;
  for (auto& v : local) total += v.size();
  std::vector<uint64_t> keys;
  keys.reserve(total);
  for (auto& v : local) keys.insert(keys.end(), v.begin(), v.end());
  *non_finite = 0;
  for (uint32_t b : bad) *non_finite |= b;
  return keys;
}

// Powers base^i for i < per_word, as floats (exact: all below 2^22).
std::vector<float> digit_powers(const DigitPacking& P) {
  std::vector<float> pw(P.per_word);
  double p = 1.0;
  for (uint32_t i = 0; i < P.per_word; ++i, p *= P.base) pw[i] = (float)p;
  return pw;
}

// Add sign * x[key block] into the value sketch, for keys in order; only cells in [c0, c1).
void scatter_keys(const CodecLayout& L, const float* x, const std::vector<uint64_t>& keys, float* sketch,
                  uint64_t c0, uint64_t c1) {
  const uint64_t B = L.block;
  for (uint64_t k : keys) {
    uint64_t cell[3];
    int sign[3];
    key_cells(L.sketch, k, cell, sign);
    const uint64_t lo = k * B;
    const uint64_t len = std::min<uint64_t>(B, L.numel - lo);
    for (int j = 0; j < 3; ++j) {
      if (cell[j] < c0 || cell[j] >= c1) continue;
      float* dst = sketch + cell[j] * B;
      const float* src = x + lo;
      if (sign[j] > 0) {
        for (uint64_t l = 0; l < len; ++l) dst[l] += src[l];
      } else {
        for (uint64_t l = 0; l < len; ++l) dst[l] -= src[l];
      }
    }
  }
}

}  // namespace

EncodeStats encode(const CodecLayout& L, const float* x, float* payload, int num_threads) {
  const int nt = resolve_threads(num_threads);
  EncodeStats st;
  parallel_fill(payload, L.payload_numel, 0.0f, nt);
  std::vector<uint64_t> keys = find_nonzero_keys(L, x, nt, &st.non_finite);
  st.keys = keys.size();

  float* index = payload + L.index_offset;
  const std::vector<float> pw = digit_powers(L.index);
  if (L.index_kind == kIndexBitmap) {
    for (uint64_t k : keys) index[k / L.index.per_word] += pw[k % L.index.per_word];
  } else if (L.index_kind == kIndexBloom) {
    const uint64_t cells = L.bloom.cells();
    std::vector<uint32_t> count(cells, 0);
    for (uint64_t k : keys) {
      uint64_t cell[3];
      int sign[3];
      key_cells(L.bloom, k, cell, sign);
      for (int j = 0; j < 3; ++j) ++count[cell[j]];
    }
    const uint64_t words = L.index.words();
    uint32_t saturated = 0;
#pragma omp parallel for num_threads(nt) schedule(static) reduction(| : saturated)
    for (int64_t w = 0; w < (int64_t)words; ++w) {
      float acc = 0.0f;
      for (uint32_t d = 0; d < L.index.per_word; ++d) {
        const uint64_t c = (uint64_t)w * L.index.per_word + d;
        if (c >= cells) break;
        uint32_t v = count[c];
        if (v > L.digit_cap) { v = L.digit_cap; saturated = 1; }
        acc += (float)v * pw[d];
      }
      index[w] = acc;
    }
    st.saturated = saturated;
  }

  float* sketch = payload + L.sketch_offset;
  const uint64_t cells = L.sketch.cells();
  if (nt > 1 && keys.size() * L.block > (1u << 16)) {
    // Each thread owns a contiguous range of cells and walks all keys in order: no races, and
    // every cell is summed in increasing key order whatever the thread count.
#pragma omp parallel num_threads(nt)
    {
      uint64_t c0, c1;
      split_range(cells, omp_get_num_threads(), omp_get_thread_num(), &c0, &c1);
      scatter_keys(L, x, keys, sketch, c0, c1);
    }
  } else {
    scatter_keys(L, x, keys, sketch, 0, cells);
  }

  float* header = payload;
  header[kHdrContributors] = 1.0f;
  header[kHdrFingerprintLo] = (float)(L.fingerprint & ((1u << kChunkBits) - 1));
  header[kHdrFingerprintHi] = (float)(L.fingerprint >> kChunkBits);
  write_chunks(header, kHdrKeysLo, st.keys);
  header[kHdrOverloaded] = st.keys > L.capacity ? 1.0f : 0.0f;
  header[kHdrNonFinite] = (float)st.non_finite;
  header[kHdrSaturated] = (float)st.saturated;
  return st;
}

namespace {

// Unpack every index word into digits; calls on_digit(position, digit) for non-zero digits, in
// increasing position per thread range. Returns false if a word is not a valid packed integer.
template <typename PerThread>
bool unpack_digits(const CodecLayout& L, const float* index, double scale, int nt, PerThread&& per_thread) {
  const uint64_t words = L.index.words();
  int64_t limit = 1;
  for (uint32_t i = 0; i < L.index.per_word; ++i) limit *= L.index.base;
  const SmallDivider div(L.index.base);
  int bad = 0;
#pragma omp parallel num_threads(nt) reduction(| : bad)
  {
    const int tid = omp_get_thread_num();
    uint64_t wb, we;
    split_range(words, omp_get_num_threads(), tid, &wb, &we);
    auto sink = per_thread(tid);
    for (uint64_t w = wb; w < we && !bad; ++w) {
      int64_t u = read_word(index + w, scale, limit);
      if (u < 0) { bad = 1; break; }
      for (uint64_t pos = w * L.index.per_word; u != 0; ++pos) {
        int64_t q, r;
        div.divmod(u, &q, &r);
        u = q;
        if (r != 0 && !sink(pos, (uint64_t)r)) { bad = 1; break; }
      }
    }
  }
  return bad == 0;
}

struct PeelTables {
  std::vector<uint32_t> deg;  // unresolved keys per cell
  std::vector<uint32_t> xr;   // XOR of the list positions of the unresolved keys of a cell
};

// Build degree/XOR tables of `keys` over `table`, visiting keys grouped by start segment so that
// the three cells touched by consecutive keys are close in memory.
PeelTables build_peel_tables(const SegmentedTable& table, const std::vector<uint64_t>& keys) {
  PeelTables t;
  const uint64_t cells = table.cells();
  t.deg.assign(cells, 0);
  t.xr.assign(cells, 0);
  std::vector<uint64_t> bucket_start(table.seg_count + 1, 0);
  std::vector<uint32_t> start(keys.size());
  for (size_t i = 0; i < keys.size(); ++i) {
    start[i] = (uint32_t)key_start_segment(table, keys[i]);
    ++bucket_start[start[i] + 1];
  }
  for (uint64_t s = 0; s < table.seg_count; ++s) bucket_start[s + 1] += bucket_start[s];
  std::vector<uint32_t> order(keys.size());
  for (size_t i = 0; i < keys.size(); ++i) order[bucket_start[start[i]]++] = (uint32_t)i;
  for (uint32_t i : order) {
    uint64_t cell[3];
    int sign[3];
    key_cells(table, keys[i], cell, sign);
    for (int j = 0; j < 3; ++j) {
      ++t.deg[cell[j]];
      t.xr[cell[j]] ^= i;
    }
  }
  return t;
}

// Generic peeling over a degree/XOR table. `resolve(i, cell, cells, signs)` is called once per key
// with the cell it was found pure in and must remove the key from its other cells' payload data;
// this function keeps degree and XOR up to date. Returns the number of keys resolved.
template <typename Resolve>
uint64_t peel(const SegmentedTable& table, const std::vector<uint64_t>& keys, PeelTables& t, Resolve&& resolve) {
  const uint64_t cells = table.cells();
  std::vector<uint64_t> stack;
  stack.reserve(keys.size() + 16);
  for (uint64_t c = 0; c < cells; ++c)
    if (t.deg[c] == 1) stack.push_back(c);
  uint64_t resolved = 0;
  size_t head = 0;
  while (head < stack.size()) {
    const uint64_t c = stack[head++];
    if (t.deg[c] != 1) continue;
    const uint32_t i = t.xr[c];
    if (i >= keys.size()) return resolved;  // inconsistent tables: cannot happen for valid keys
    uint64_t cell[3];
    int sign[3];
    key_cells(table, keys[i], cell, sign);
    int pure = -1;
    for (int j = 0; j < 3; ++j)
      if (cell[j] == c) pure = j;
    if (pure < 0) return resolved;
    if (!resolve(i, pure, cell, sign)) return resolved;
    ++resolved;
    for (int j = 0; j < 3; ++j) {
      --t.deg[cell[j]];
      t.xr[cell[j]] ^= i;
      if (j != pure && t.deg[cell[j]] == 1) stack.push_back(cell[j]);
    }
  }
  return resolved;
}

}  // namespace

DecodeStats decode(const CodecLayout& L, const DecodeInputs& in, const float* payload, float* out,
                   int64_t* trace_key, int64_t* trace_cell, int num_threads) {
  const int nt = resolve_threads(num_threads);
  DecodeStats st;
  parallel_fill(out, L.numel, 0.0f, nt);
  const float* index = payload + L.index_offset;
  const uint64_t n = in.world_size;

  // 1. Candidates from the index, with exact per-key counts (ranks holding the key non-zero).
  std::vector<uint64_t> support;
  if (L.index_kind == kIndexBitmap) {
    std::vector<std::vector<uint64_t>> local(nt);
    std::vector<uint64_t> sums(nt, 0);
    const bool valid = unpack_digits(L, index, in.scale, nt, [&](int tid) {
      return [&, tid](uint64_t pos, uint64_t digit) {
        if (pos >= L.num_keys || digit > n) return false;
        local[tid].push_back(pos);
        sums[tid] += digit;
        return true;
      };
    });
    for (auto& v : local) support.insert(support.end(), v.begin(), v.end());
    for (uint64_t s : sums) st.index_total += s;
    st.candidates = support.size();
    if (!valid || st.index_total != in.total_keys) {
      st.status = kDecodeIndexCorrupt;
      return st;
    }
  } else {
    const uint64_t bcells = L.bloom.cells();
    std::vector<uint32_t> count(bcells, 0);
    std::vector<uint64_t> sums(nt, 0);
    const uint64_t digit_max = n * (uint64_t)L.digit_cap;
    const bool valid = unpack_digits(L, index, in.scale, nt, [&](int tid) {
      return [&, tid](uint64_t pos, uint64_t digit) {
        if (pos >= bcells || digit > digit_max) return false;
        count[pos] = (uint32_t)digit;
        sums[tid] += digit;
        return true;
      };
    });
    for (uint64_t s : sums) st.index_total += s;
    if (!valid || st.index_total != 3 * in.total_keys) {
      st.status = kDecodeIndexCorrupt;
      return st;
    }
    // Candidates: keys whose three counters are all non-zero (a superset of the true support).
    std::vector<std::vector<uint64_t>> local(nt);
#pragma omp parallel num_threads(nt)
    {
      uint64_t kb, ke;
      split_range(L.num_keys, omp_get_num_threads(), omp_get_thread_num(), &kb, &ke);
      auto& mine = local[omp_get_thread_num()];
      for (uint64_t k = kb; k < ke; ++k) {
        uint64_t cell[3];
        int sign[3];
        key_cells(L.bloom, k, cell, sign);
        if (count[cell[0]] && count[cell[1]] && count[cell[2]]) mine.push_back(k);
      }
    }
    std::vector<uint64_t> cand;
    for (auto& v : local) cand.insert(cand.end(), v.begin(), v.end());
    st.candidates = cand.size();
    // Exact integer peeling of the counters: each candidate's count is the number of ranks that
    // hold it; false positives come out as exactly 0.
    PeelTables t = build_peel_tables(L.bloom, cand);
    std::vector<uint32_t> key_count(cand.size(), 0);
    bool consistent = true;
    const uint64_t resolved = peel(L.bloom, cand, t, [&](uint32_t i, int pure, const uint64_t* cell, const int*) {
      const uint32_t c = count[cell[pure]];
      if (c > n) { consistent = false; return false; }
      for (int j = 0; j < 3; ++j) {
        if (count[cell[j]] < c) { consistent = false; return false; }
        count[cell[j]] -= c;
      }
      key_count[i] = c;
      return true;
    });
    if (!consistent) {
      st.status = kDecodeIndexCorrupt;
      return st;
    }
    if (resolved != cand.size()) {
      st.status = kDecodeIndexPeelFailed;
      return st;
    }
    for (uint64_t c = 0; c < bcells; ++c)
      if (count[c] != 0) { st.status = kDecodeIndexCorrupt; return st; }
    for (size_t i = 0; i < cand.size(); ++i)
      if (key_count[i]) support.push_back(cand[i]);
    st.false_positives = cand.size() - support.size();
  }
  st.support_keys = support.size();

  // 2. Peel the value sketch over the exact support, in double precision.
  const uint64_t B = L.block;
  const uint64_t cells = L.sketch.cells();
  const float* sk = payload + L.sketch_offset;
  std::vector<double> val(cells * B);
#pragma omp parallel for num_threads(nt) schedule(static)
  for (int64_t i = 0; i < (int64_t)(cells * B); ++i) val[i] = (double)sk[i];
  PeelTables t = build_peel_tables(L.sketch, support);
  std::vector<double> v(B);
  uint64_t step = 0;
  st.peeled = peel(L.sketch, support, t, [&](uint32_t i, int pure, const uint64_t* cell, const int* sign) {
    const uint64_t k = support[i];
    const double* src = val.data() + cell[pure] * B;
    for (uint64_t l = 0; l < B; ++l) v[l] = sign[pure] > 0 ? src[l] : -src[l];
    for (int j = 0; j < 3; ++j) {
      if (j == pure) continue;
      double* dst = val.data() + cell[j] * B;
      if (sign[j] > 0) {
        for (uint64_t l = 0; l < B; ++l) dst[l] -= v[l];
      } else {
        for (uint64_t l = 0; l < B; ++l) dst[l] += v[l];
      }
    }
    const uint64_t lo = k * B;
    const uint64_t len = std::min<uint64_t>(B, L.numel - lo);
    for (uint64_t l = 0; l < len; ++l) out[lo + l] = (float)v[l];
    if (trace_key) {
      trace_key[step] = (int64_t)k;
      trace_cell[step] = (int64_t)cell[pure];
    }
    ++step;
    return true;
  });
  if (st.peeled != support.size()) st.status = kDecodeSketchPeelFailed;
  return st;
}

}  // namespace cpu
}  // namespace lhc
