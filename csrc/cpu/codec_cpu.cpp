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
#include <chrono>
#include <cstdio>
#include <cstdlib>

namespace lhc {
namespace cpu {
namespace {

struct Prof { const char* env = std::getenv("LHC_PROFILE"); std::chrono::steady_clock::time_point t = std::chrono::steady_clock::now();
  void mark(const char* what) { if (!env) return; auto n = std::chrono::steady_clock::now(); std::fprintf(stderr, "  %-14s %8.2f ms\n", what, std::chrono::duration<double, std::milli>(n - t).count()); t = n; } };
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

// Per-cell peeling state: how many unresolved keys the cell holds and the XOR of their ids (when
// one key is left, the XOR is that key). Interleaved so one cache line serves both.
struct CellState {
  uint32_t deg;
  uint32_t keys;
};

inline void prefetch_write(const void* p) { __builtin_prefetch(p, 1, 1); }

// Build the cell states of `keys` over `table`. Integer increments and XORs commute, so the result
// does not depend on the visiting order; cells of keys a few steps ahead are prefetched.
std::vector<CellState> build_cell_states(const SegmentedTable& table, const std::vector<uint64_t>& keys) {
  std::vector<CellState> cs(table.cells(), CellState{0, 0});
  constexpr size_t kAhead = 8;
  const size_t n = keys.size();
  for (size_t i = 0; i < n; ++i) {
    if (i + kAhead < n) {
      uint64_t ahead[3];
      int sg[3];
      key_cells(table, keys[i + kAhead], ahead, sg);
      for (int j = 0; j < 3; ++j) prefetch_write(&cs[ahead[j]]);
    }
    uint64_t cell[3];
    int sign[3];
    key_cells(table, keys[i], cell, sign);
    for (int j = 0; j < 3; ++j) {
      ++cs[cell[j]].deg;
      cs[cell[j]].keys ^= (uint32_t)keys[i];
    }
  }
  return cs;
}

// Breadth-first peeling over cell states. Cells that are pure at the start are queued in increasing
// order; resolving a key queues the cells it leaves pure. Breadth-first order keeps every key's
// chain of earlier-peeled dependencies as short as possible, which bounds how far float rounding
// errors propagate (see layout.sketch_table_for). `resolve(key, pure, cells, signs)` removes the
// key's contribution from its cells' payload data and returns false to abort; `prefetch(cell)`
// hints the payload data of a cell that will soon be touched. Returns the number of keys resolved;
// `*bad` is set if the states are inconsistent (a corrupted payload).
template <typename Resolve, typename Prefetch>
uint64_t peel(const SegmentedTable& table, uint64_t num_keys, std::vector<CellState>& cs, uint64_t expected,
              Resolve&& resolve, Prefetch&& prefetch, bool* bad) {
  const uint64_t cells = table.cells();
  std::vector<uint64_t> queue;
  queue.reserve(expected + 16);
  for (uint64_t c = 0; c < cells; ++c)
    if (cs[c].deg == 1) queue.push_back(c);
  uint64_t resolved = 0;
  constexpr size_t kAhead = 6;
  for (size_t head = 0; head < queue.size(); ++head) {
    // Software pipeline: the key of the cell kAhead places ahead is (very likely) known already;
    // start loading its three cells now so the misses overlap with this iteration's work.
    if (head + kAhead < queue.size()) {
      const CellState& a = cs[queue[head + kAhead]];
      if (a.deg == 1 && a.keys < num_keys) {
        uint64_t ahead[3];
        int sg[3];
        key_cells(table, a.keys, ahead, sg);
        for (int j = 0; j < 3; ++j) {
          prefetch_write(&cs[ahead[j]]);
          prefetch(ahead[j]);
        }
      }
      if (head + 2 * kAhead < queue.size()) prefetch_write(&cs[queue[head + 2 * kAhead]]);
    }
    const uint64_t c = queue[head];
    if (cs[c].deg != 1) continue;
    const uint64_t key = cs[c].keys;
    if (key >= num_keys) { *bad = true; return resolved; }
    uint64_t cell[3];
    int sign[3];
    key_cells(table, key, cell, sign);
    int pure = -1;
    for (int j = 0; j < 3; ++j)
      if (cell[j] == c) pure = j;
    if (pure < 0) { *bad = true; return resolved; }
    if (!resolve(key, pure, cell, sign)) return resolved;
    ++resolved;
    for (int j = 0; j < 3; ++j) {
      CellState& s = cs[cell[j]];
      if (s.deg == 0) { *bad = true; return resolved; }
      --s.deg;
      s.keys ^= (uint32_t)key;
      if (j != pure && s.deg == 1) queue.push_back(cell[j]);
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
  Prof prof; prof.mark("zero out");
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
    std::vector<CellState> cs = build_cell_states(L.bloom, cand);
    std::vector<uint32_t> key_count;  // counts of resolved candidates, in peeling order
    std::vector<uint64_t> resolved_keys;
    key_count.reserve(cand.size());
    resolved_keys.reserve(cand.size());
    bool bad = false;
    const uint64_t resolved = peel(
        L.bloom, L.num_keys, cs, cand.size(),
        [&](uint64_t key, int pure, const uint64_t* cell, const int*) {
          const uint32_t c = count[cell[pure]];
          if (c > n) { bad = true; return false; }
          for (int j = 0; j < 3; ++j) {
            if (count[cell[j]] < c) { bad = true; return false; }
            count[cell[j]] -= c;
          }
          key_count.push_back(c);
          resolved_keys.push_back(key);
          return true;
        },
        [&](uint64_t cell) { __builtin_prefetch(&count[cell], 1, 1); }, &bad);
    if (bad) {
      st.status = kDecodeIndexCorrupt;
      return st;
    }
    if (resolved != cand.size()) {
      st.status = kDecodeIndexPeelFailed;
      return st;
    }
    for (uint64_t c = 0; c < bcells; ++c)
      if (count[c] != 0) { st.status = kDecodeIndexCorrupt; return st; }
    for (size_t i = 0; i < resolved_keys.size(); ++i)
      if (key_count[i]) support.push_back(resolved_keys[i]);
    std::sort(support.begin(), support.end());
    st.false_positives = cand.size() - support.size();
  }
  st.support_keys = support.size();
  prof.mark("index");

  // 2. Peel the value sketch over the exact support, in double precision.
  const uint64_t B = L.block;
  const uint64_t cells = L.sketch.cells();
  const float* sk = payload + L.sketch_offset;
  std::vector<double> val(cells * B);
#pragma omp parallel for num_threads(nt) schedule(static)
  for (int64_t i = 0; i < (int64_t)(cells * B); ++i) val[i] = (double)sk[i];
  prof.mark("build");
  std::vector<CellState> cs = build_cell_states(L.sketch, support);
  prof.mark("build");
  std::vector<double> v(B);
  uint64_t step = 0;
  bool bad = false;
  st.peeled = peel(
      L.sketch, L.num_keys, cs, support.size(),
      [&](uint64_t k, int pure, const uint64_t* cell, const int* sign) {
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
      },
      [&](uint64_t cell) { __builtin_prefetch(val.data() + cell * B, 1, 1); }, &bad);
  prof.mark("peel");
  if (bad) {
    st.status = kDecodeIndexCorrupt;
    return st;
  }
  if (st.peeled != support.size()) st.status = kDecodeSketchPeelFailed;
  return st;
}

}  // namespace cpu
}  // namespace lhc
