// CPU kernels of the lossless codec: encode (non-zero discovery, index, sketch scatter) and decode
// (index unpacking, candidate enumeration, exact count peeling for the Bloom index, value peeling).
//
// Determinism: every floating-point accumulation happens in a fixed order that does not depend on
// the number of threads (sketch cells are summed in increasing key order; each group of the sketch
// is peeled sequentially, breadth-first from a queue seeded in increasing cell order). Parallel
// loops only do integer work or write disjoint outputs, so the same payload decodes to the same
// bits on every run and every machine with IEEE-754 doubles.
#include "codec_cpu.h"

#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <vector>

namespace lhc {
namespace cpu {
namespace {

// Phase timings on stderr when LHC_PROFILE is set (a diagnostic for performance work).
struct Prof {
  const char* env = std::getenv("LHC_PROFILE");
  std::chrono::steady_clock::time_point t = std::chrono::steady_clock::now();
  void mark(const char* what) {
    if (!env) return;
    const auto now = std::chrono::steady_clock::now();
    std::fprintf(stderr, "  lhc %-10s %8.2f ms\n", what, std::chrono::duration<double, std::milli>(now - t).count());
    t = now;
  }
};

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

// Exact division of a non-negative integer below 2^22 by a fixed divisor below 2^22, via a double
// reciprocal with one correction step (the estimate is off by at most one).
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
// A SUM of integer fields below 2^22 is exact in float32, so a summed word (scale 1) must be an
// integer. An AVERAGE is off by less than 1/2 after scaling back (see kIntFieldBits), so an averaged
// word is rounded to the nearest integer.
inline int64_t read_word(const float* p, double scale, int64_t limit) {
  const double v = (double)(*p) * scale;
  if (!(v > -0.5 && v < (double)limit)) return -1;  // also rejects NaN
  const double r = std::nearbyint(v);
  const double tolerance = scale == 1.0 ? 0.0 : 0.5;
  if (std::fabs(v - r) > tolerance || r < 0.0 || r >= (double)limit) return -1;
  return (int64_t)r;
}

// Non-zero keys of x, per thread in increasing order (concatenated: sorted), and whether x held
// NaN/Inf. -0.0 counts as zero.
std::vector<std::vector<uint32_t>> find_nonzero_keys(const CodecLayout& L, const float* x, int nt,
                                                     uint32_t* non_finite) {
  std::vector<std::vector<uint32_t>> local(nt);
  std::vector<uint32_t> bad(nt, 0);
#pragma omp parallel num_threads(nt)
  {
    const int tid = omp_get_thread_num();
    uint64_t kb, ke;
    // The runtime may grant fewer threads than asked (nested regions, OMP_DYNAMIC): split by the
    // team actually running, or some keys would never be scanned.
    split_range(L.num_keys, omp_get_num_threads(), tid, &kb, &ke);
    std::vector<uint32_t> mine;  // private while scanning (no false sharing on the vector header)
    uint32_t nf = 0;
    const uint32_t* bits = reinterpret_cast<const uint32_t*>(x);
    if (L.block == 1) {
      // Chunks of 64: a vectorisable OR-reduction skips all-zero chunks (about half of them at 1%
      // density), and non-empty chunks are compacted without branches.
      constexpr uint64_t kChunk = 64;
      uint32_t buf[kChunk];
      uint64_t k = kb;
      for (; k + kChunk <= ke; k += kChunk) {
        uint32_t any = 0, inf_nan = 0;
        for (uint64_t i = 0; i < kChunk; ++i) {
          const uint32_t u = bits[k + i];
          any |= u << 1;
          inf_nan |= (uint32_t)((u & 0x7f800000u) == 0x7f800000u);
        }
        nf |= inf_nan;
        if (!any) continue;
        uint32_t count = 0;
        for (uint64_t i = 0; i < kChunk; ++i) {
          buf[count] = (uint32_t)(k + i);
          count += (bits[k + i] << 1) != 0;
        }
        mine.insert(mine.end(), buf, buf + count);
      }
      for (; k < ke; ++k) {
        const uint32_t u = bits[k];
        nf |= (uint32_t)((u & 0x7f800000u) == 0x7f800000u);
        if (u << 1) mine.push_back((uint32_t)k);
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
        if (any) mine.push_back((uint32_t)k);
      }
    }
    local[tid] = std::move(mine);
    bad[tid] = nf;
  }
  *non_finite = 0;
  for (uint32_t b : bad) *non_finite |= b;
  return local;
}

// Powers base^i for i < per_word, as floats (exact: all below 2^22).
std::vector<float> digit_powers(const DigitPacking& P) {
  std::vector<float> pw(P.per_word);
  double p = 1.0;
  for (uint32_t i = 0; i < P.per_word; ++i, p *= P.base) pw[i] = (float)p;
  return pw;
}


// Splits a packed word into its digits with two small lookup tables instead of per_word divisions:
// word = hi * base^lo_digits + lo, and each half indexes a table of its digits.
struct DigitDecoder {
  uint32_t per_word, lo_digits;
  int64_t limit;            // base^per_word: valid words are below it
  SmallDivider lo_div;      // divides by base^lo_digits
  std::vector<uint32_t> lut;  // lut[v * lo_digits + i] = digit i of v, for v < base^lo_digits
  std::vector<uint32_t> nonzero;  // nonzero[v]: bit i set iff digit i of v is non-zero

  explicit DigitDecoder(const DigitPacking& P)
      : per_word(P.per_word), lo_digits((P.per_word + 1) / 2), limit(1), lo_div(1) {
    int64_t lo_mod = 1;
    for (uint32_t i = 0; i < per_word; ++i) limit *= P.base;
    for (uint32_t i = 0; i < lo_digits; ++i) lo_mod *= P.base;
    lo_div = SmallDivider((uint32_t)lo_mod);
    lut.resize((size_t)lo_mod * lo_digits);
    nonzero.assign((size_t)lo_mod, 0);
    for (int64_t v = 0; v < lo_mod; ++v) {
      int64_t u = v;
      for (uint32_t i = 0; i < lo_digits; ++i, u /= P.base) {
        lut[(size_t)v * lo_digits + i] = (uint32_t)(u % P.base);
        if (u % P.base) nonzero[(size_t)v] |= 1u << i;
      }
    }
  }
};

// Unpack every index word into digits: thread t calls sinks[t](position, digit) for the non-zero
// digits of its contiguous word range, in increasing position (on a private copy of the sink,
// moved back at the end). Returns false if a word is not a valid packed integer or a sink rejects
// a digit.
template <typename Sink>
bool unpack_digits(const CodecLayout& L, const float* index, double scale, int nt, std::vector<Sink>& sinks) {
  const uint64_t words = L.index.words();
  const DigitDecoder dec(L.index);
  const uint32_t* raw = reinterpret_cast<const uint32_t*>(index);
  int bad = 0;
#pragma omp parallel num_threads(nt) reduction(| : bad)
  {
    const int tid = omp_get_thread_num();
    uint64_t wb, we;
    split_range(words, omp_get_num_threads(), tid, &wb, &we);
    Sink sink = std::move(sinks[tid]);  // thread-private while unpacking (no false sharing)
    for (uint64_t w = wb; w < we && !bad; ++w) {
      if (raw[w] == 0) continue;  // +0.0f: no digits (most words at low density)
      const int64_t u = read_word(index + w, scale, dec.limit);
      if (u < 0) { bad = 1; break; }
      int64_t hi, lo;
      dec.lo_div.divmod(u, &hi, &lo);
      const uint64_t pos = w * dec.per_word;
      // Visit only the non-zero digits (set bits of the masks): no per-digit branch to mispredict.
      const uint32_t* dl = &dec.lut[(size_t)lo * dec.lo_digits];
      for (uint32_t m = dec.nonzero[(size_t)lo]; m; m &= m - 1) {
        const uint32_t i = (uint32_t)__builtin_ctz(m);
        if (!sink(pos + i, dl[i])) { bad = 1; break; }
      }
      const uint32_t* dh = &dec.lut[(size_t)hi * dec.lo_digits];
      for (uint32_t m = dec.nonzero[(size_t)hi]; m; m &= m - 1) {
        const uint32_t i = (uint32_t)__builtin_ctz(m);
        if (!sink(pos + dec.lo_digits + i, dh[i])) { bad = 1; break; }
      }
    }
    sinks[tid] = std::move(sink);
  }
  return bad == 0;
}

// Per-cell peeling state: how many unresolved keys the cell holds and XORs identifying them (when
// one key is left, the XORs are that key). Interleaved so one cache line serves all.
// 8 bytes, so a group's states stay cache-resident: the low 8 bits of `tag` count the keys (build
// refuses a 256th), the high 24 bits XOR their positions (a group peels fewer than 2^24 keys).
struct CellState {
  uint32_t key;  // XOR of the unresolved keys' ids: no list lookup is needed to find a pure cell's key
  uint32_t tag;  // (XOR of their positions) << 8 | their count
  uint32_t deg() const { return tag & 0xffu; }
  uint32_t pos() const { return tag >> 8; }
};
constexpr uint32_t kMaxCellDegree = 0xffu;
constexpr uint32_t kMaxPeelKeys = 1u << 24;

inline void prefetch_write(const void* p) { __builtin_prefetch(p, 1, 1); }

// Add the keys keys[0, count) to the cell states of cells [base, base + table cells of the group):
// cs[c - base] counts one more key and XORs in its id and its position in `keys` (positions wrap
// at 2^24; only the value peel uses them, for groups below that). Integer increments and XORs
// commute, so the result does not depend on the visiting order. Returns false if a cell would hold
// more than kMaxCellDegree keys (not peelable anyway; then the caller reports a peeling failure).
// kc[3i + j] = ((cell_j(keys[i]) - base) << 1) | (sign_j < 0), for i < count. A pure function of
// each key, written as a flat loop so the compiler can vectorise the 64-bit hashing; cloned for
// AVX-512 (64-bit multiplies in vector registers) and AVX2, chosen at load time.
__attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
void hash_cells(const SegmentedTable& table, const uint32_t* keys, uint32_t count, uint64_t base, uint32_t* kc) {
  const SegmentedTable t = table;
  for (uint32_t i = 0; i < count; ++i) {
    const uint64_t h = key_hash(t, keys[i]);
    for (int j = 0; j < 3; ++j) {
      int sign;
      const uint64_t cell = key_cell(t, h, j, &sign);
      kc[3 * (uint64_t)i + j] = (uint32_t)((cell - base) << 1) | (uint32_t)(sign < 0);
    }
  }
}

// Add sign * x[key block] into the value sketch for keys[0, count), in that order; all their cells
// lie at or after cell `base` (a group's first cell). `kc` is scratch for the keys' cells, hashed in
// one vectorisable pass.
void scatter_keys(const CodecLayout& L, const float* x, const uint32_t* keys, size_t count, uint64_t base,
                  float* sketch, std::vector<uint32_t>& kc) {
  const uint64_t B = L.block;
  kc.resize(3 * count);
  hash_cells(L.sketch, keys, (uint32_t)count, base, kc.data());
  for (size_t i = 0; i < count; ++i) {
    const uint64_t lo = (uint64_t)keys[i] * B;
    const uint64_t len = std::min<uint64_t>(B, L.numel - lo);
    const float* src = x + lo;
    for (int j = 0; j < 3; ++j) {
      const uint32_t e = kc[3 * i + j];
      float* dst = sketch + (base + (e >> 1)) * B;
      if (e & 1u) {
        for (uint64_t l = 0; l < len; ++l) dst[l] -= src[l];
      } else {
        for (uint64_t l = 0; l < len; ++l) dst[l] += src[l];
      }
    }
  }
}

bool build_cell_states(const SegmentedTable& table, const uint32_t* keys, uint32_t count, CellState* cs,
                       uint64_t base, uint32_t* kc) {
  hash_cells(table, keys, count, base, kc);
  constexpr uint32_t kAhead = 8;
  for (uint32_t i = 0; i < count; ++i) {
    if (i + kAhead < count)
      for (int j = 0; j < 3; ++j) prefetch_write(&cs[kc[3 * (uint64_t)(i + kAhead) + j] >> 1]);
    for (int j = 0; j < 3; ++j) {
      CellState& st = cs[kc[3 * (uint64_t)i + j] >> 1];
      if (st.deg() == kMaxCellDegree) return false;
      st.tag = (st.tag + 1) ^ ((i & (kMaxPeelKeys - 1)) << 8);
      st.key ^= keys[i];
    }
  }
  return true;
}

// Breadth-first peeling of `count` keys whose cells all lie in [base, base + span); cs holds
// their states (index c - base). Cells pure at the start are queued in increasing order; resolving
// a key queues the cells it leaves pure. Breadth-first order keeps each key's chain of
// earlier-peeled dependencies as short as the hypergraph allows, which bounds how far float
// rounding errors propagate (see layout.sketch_table_for).
// `resolve(pos, key, pure, cells, signs)` removes the key's contribution from its cells' payload
// data (false aborts); `prefetch(cell)` hints payload data soon needed. Returns the number of keys
// resolved; sets `*bad` if the states are inconsistent (a guard: states built by
// build_cell_states are consistent whatever the payload holds).
template <typename Resolve, typename Prefetch>
uint32_t peel(const SegmentedTable& table, uint32_t count, CellState* cs, uint64_t base,
              uint64_t span, std::vector<uint32_t>& queue, Resolve&& resolve, Prefetch&& prefetch, bool* bad,
              const uint32_t* kc = nullptr) {
  // A key's cells and signs: from the cache `kc` filled by build_cell_states, else by hashing.
  auto cells_of = [&](uint32_t pos, uint64_t key, uint64_t cell[3], int sign[3]) {
    if (kc) {
      for (int j = 0; j < 3; ++j) {
        const uint32_t e = kc[3 * (uint64_t)pos + j];
        cell[j] = base + (e >> 1);
        sign[j] = (e & 1u) ? -1 : 1;
      }
    } else {
      key_cells(table, key, cell, sign);
    }
  };
  queue.clear();
  queue.reserve(count + 16);
  for (uint64_t c = 0; c < span; ++c)
    if (cs[c].deg() == 1) queue.push_back((uint32_t)c);
  uint32_t resolved = 0;
  constexpr size_t kAhead = 6;
  for (size_t head = 0; head < queue.size(); ++head) {
    // Software pipeline: the key of the cell kAhead places ahead is (very likely) known already;
    // start loading its three cells now so the misses overlap with this iteration's work.
    if (head + kAhead < queue.size()) {
      const CellState& a = cs[queue[head + kAhead]];
      if (a.deg() == 1 && a.pos() < count) {
        uint64_t ahead[3];
        int sg[3];
        cells_of(a.pos(), a.key, ahead, sg);
        for (int j = 0; j < 3; ++j) {
          prefetch_write(&cs[ahead[j] - base]);
          prefetch(ahead[j]);
        }
      }
      if (kc && head + 2 * kAhead < queue.size()) {
        const CellState& b = cs[queue[head + 2 * kAhead]];
        if (b.pos() < count) __builtin_prefetch(&kc[3 * (uint64_t)b.pos()], 0, 1);
        if (head + 3 * kAhead < queue.size()) __builtin_prefetch(&cs[queue[head + 3 * kAhead]], 0, 1);
      }
    }
    const uint64_t c = queue[head];
    if (cs[c].deg() != 1) continue;
    const uint32_t pos = cs[c].pos();
    const uint64_t key = cs[c].key;
    if (pos >= count) { *bad = true; return resolved; }
    uint64_t cell[3];
    int sign[3];
    cells_of(pos, key, cell, sign);
    const uint64_t here = c + base;
    const int pure = (int)(cell[1] == here) + 2 * (int)(cell[2] == here);
    if (cell[pure] != here) { *bad = true; return resolved; }
    if (!resolve(pos, key, pure, cell, sign)) return resolved;
    ++resolved;
    for (int j = 0; j < 3; ++j) {
      CellState& st = cs[cell[j] - base];
      if (st.deg() == 0) { *bad = true; return resolved; }
      st.tag = (st.tag - 1) ^ (pos << 8);
      st.key ^= (uint32_t)key;
      if (j != pure && st.deg() == 1) queue.push_back((uint32_t)(cell[j] - base));
    }
  }
  return resolved;
}

// A sorted key list held as consecutive parts (one per scanning thread), so that building it
// needs no concatenation copy.
struct KeyParts {
  std::vector<std::vector<uint32_t>> parts;
  uint64_t size() const {
    uint64_t n = 0;
    for (const auto& p : parts) n += p.size();
    return n;
  }
};

// Support keys bucketed by sketch group as they are found: by[p][g] holds, in increasing order, the
// keys of group g found by part p (one unpacking thread); parts cover increasing key ranges, so the
// parts of one group concatenated are its keys in increasing order. Bucketing while unpacking
// saves a pass over the support and its global-position bookkeeping.
struct GroupedKeys {
  std::vector<std::vector<std::vector<uint32_t>>> by;
  uint64_t group_size(uint64_t g) const {
    uint64_t n = 0;
    for (const auto& part : by) n += part[g].size();
    return n;
  }
  uint64_t total() const {
    uint64_t n = 0;
    for (const auto& part : by)
      for (const auto& v : part) n += v.size();
    return n;
  }
};

// Bloom index: candidates, then exact integer peeling of the counters. Returns a DecodeStatus and
// the keys whose aggregated count is >= 1, in increasing order.
int32_t bloom_support(const CodecLayout& L, const DecodeInputs& in, const float* index, int nt, GroupedKeys* support,
                      DecodeStats* st) {
  const uint64_t n = in.world_size;
  const uint64_t bcells = L.bloom.cells();
  std::vector<uint32_t> count(bcells, 0);
  const uint64_t digit_max = n * (uint64_t)L.digit_cap;
  struct CountSink {
    uint32_t* count;
    uint64_t cells, digit_max, sum;
    bool operator()(uint64_t pos, uint64_t digit) {
      if (pos >= cells || digit > digit_max) return false;
      count[pos] = (uint32_t)digit;
      sum += digit;
      return true;
    }
  };
  std::vector<CountSink> sinks(nt, CountSink{count.data(), bcells, digit_max, 0});
  const bool valid = unpack_digits(L, index, in.scale, nt, sinks);
  for (const auto& k : sinks) st->index_total += k.sum;
  if (!valid || st->index_total != 3 * in.total_keys) return kDecodeIndexCorrupt;

  // Candidates: keys whose three counters are all non-zero (a superset of the true support).
  std::vector<std::vector<uint32_t>> local(nt);
#pragma omp parallel num_threads(nt)
  {
    uint64_t kb, ke;
    split_range(L.num_keys, omp_get_num_threads(), omp_get_thread_num(), &kb, &ke);
    auto& mine = local[omp_get_thread_num()];
    for (uint64_t k = kb; k < ke; ++k) {
      // Most keys fail at the first counter at the densities where the Bloom index is chosen.
      const uint64_t h = key_hash(L.bloom, k);
      int sign;
      if (count[key_cell(L.bloom, h, 0, &sign)] && count[key_cell(L.bloom, h, 1, &sign)] &&
          count[key_cell(L.bloom, h, 2, &sign)])
        mine.push_back((uint32_t)k);
    }
  }
  std::vector<uint32_t> cand;
  for (auto& v : local) cand.insert(cand.end(), v.begin(), v.end());
  st->candidates = cand.size();

  // Each candidate's count is the number of ranks holding it; false positives come out exactly 0.
  std::vector<CellState> cs(bcells, CellState{0, 0});
  // Positions wrap beyond 2^24 candidates; count peeling identifies keys by id, not position, so
  // the wrap is harmless here (and peel() hashes instead of reading the cell cache).
  std::vector<uint32_t> kc(3 * cand.size());
  if (!build_cell_states(L.bloom, cand.data(), (uint32_t)cand.size(), cs.data(), 0, kc.data()))
    return kDecodeIndexPeelFailed;
  std::vector<uint32_t>().swap(kc);
  std::vector<uint32_t> found, queue;
  found.reserve(cand.size());
  bool bad = false;
  const uint32_t resolved = peel(
      L.bloom, (uint32_t)cand.size(), cs.data(), 0, bcells, queue,
      [&](uint32_t, uint64_t key, int pure, const uint64_t* cell, const int*) {
        const uint32_t c = count[cell[pure]];
        if (c > n) { bad = true; return false; }
        for (int j = 0; j < 3; ++j) {
          if (count[cell[j]] < c) { bad = true; return false; }
          count[cell[j]] -= c;
        }
        if (c) found.push_back((uint32_t)key);
        return true;
      },
      [&](uint64_t cell) { __builtin_prefetch(&count[cell], 1, 1); }, &bad);
  if (bad) return kDecodeIndexCorrupt;
  if (resolved != cand.size()) return kDecodeIndexPeelFailed;
  for (uint64_t c = 0; c < bcells; ++c)
    if (count[c] != 0) return kDecodeIndexCorrupt;
  std::sort(found.begin(), found.end());
  st->false_positives = cand.size() - found.size();
  const SegmentedTable& T = L.sketch;
  support->by.assign(1, std::vector<std::vector<uint32_t>>(T.groups()));
  for (uint32_t k : found) support->by[0][key_group(T, k)].push_back(k);
  return kDecodeOk;
}

// Bitmap index: the keys with a non-zero counter, in increasing order. Returns a DecodeStatus.
int32_t bitmap_support(const CodecLayout& L, const DecodeInputs& in, const float* index, int nt,
                       GroupedKeys* support, DecodeStats* st) {
  const SegmentedTable& T = L.sketch;
  const uint64_t groups = T.groups();
  struct KeySink {
    const SegmentedTable* table;
    std::vector<std::vector<uint32_t>> groups;
    uint64_t num_keys, world_size, sum;
    bool operator()(uint64_t pos, uint64_t digit) {
      if (pos >= num_keys || digit > world_size) return false;
      groups[table->groups() == 1 ? 0 : key_group(*table, pos)].push_back((uint32_t)pos);
      sum += digit;
      return true;
    }
  };
  const uint64_t expect = std::min<uint64_t>(in.total_keys, L.num_keys) / ((uint64_t)nt * groups) + 64;
  std::vector<KeySink> sinks(nt, KeySink{&T, std::vector<std::vector<uint32_t>>(groups), L.num_keys, in.world_size, 0});
  for (auto& k : sinks)
    for (auto& v : k.groups) v.reserve(expect + expect / 8);
  const bool valid = unpack_digits(L, index, in.scale, nt, sinks);
  support->by.clear();
  for (auto& k : sinks) {
    st->index_total += k.sum;
    support->by.push_back(std::move(k.groups));
  }
  st->candidates = support->total();
  if (!valid || st->index_total != in.total_keys) return kDecodeIndexCorrupt;
  return kDecodeOk;
}

// Stable parallel bucketing of sorted keys by sketch group: keys of group g land in
// [group_offset[g], group_offset[g+1]) of `keys`, in increasing order.
void bucket_by_group(const SegmentedTable& T, const KeyParts& support, int nt, std::vector<uint32_t>* keys,
                     std::vector<uint64_t>* group_offset) {
  const uint64_t groups = T.groups();
  const size_t parts = support.parts.size();
  keys->resize(support.size());
  group_offset->assign(groups + 1, 0);
  std::vector<std::vector<uint64_t>> hist(parts, std::vector<uint64_t>(groups, 0));
#pragma omp parallel for num_threads(nt) schedule(static, 1)
  for (int64_t p = 0; p < (int64_t)parts; ++p)
    for (uint32_t k : support.parts[p]) ++hist[p][key_group(T, k)];
  // Write cursor of (part, group): groups in order, parts in order within a group.
  uint64_t run = 0;
  for (uint64_t g = 0; g < groups; ++g) {
    (*group_offset)[g] = run;
    for (size_t p = 0; p < parts; ++p) {
      const uint64_t c = hist[p][g];
      hist[p][g] = run;
      run += c;
    }
  }
  (*group_offset)[groups] = run;
#pragma omp parallel for num_threads(nt) schedule(static, 1)
  for (int64_t p = 0; p < (int64_t)parts; ++p) {
    const auto& part = support.parts[p];
    for (size_t i = 0; i < part.size(); ++i) {
      (*keys)[hist[p][key_group(T, part[i])]++] = part[i];
    }
  }
}

}  // namespace

DecodeStats decode(const CodecLayout& L, const DecodeInputs& in, const float* payload, float* out,
                   int64_t* trace_key, int64_t* trace_cell, int num_threads) {
  const int nt = resolve_threads(num_threads);
  DecodeStats st;
  Prof prof;
  const float* index = payload + L.index_offset;

  // 1. The exact support: keys non-zero on at least one rank, bucketed by sketch group.
  GroupedKeys support;
  st.status = L.index_kind == kIndexBitmap ? bitmap_support(L, in, index, nt, &support, &st)
                                           : bloom_support(L, in, index, nt, &support, &st);
  if (st.status != kDecodeOk) {
    parallel_fill(out, L.numel, 0.0f, nt);
    return st;
  }
  st.support_keys = support.total();
  prof.mark("index");
  parallel_fill(out, L.numel, 0.0f, nt);
  prof.mark("zero out");

  // 2. Peel the value sketch over the support one group at a time (groups share no cells), in
  //    double precision, and write each group's keys into the output. A group's working set is
  //    private to the thread peeling it and sized to stay in cache; each group is peeled
  //    sequentially in a fixed order, so the output does not depend on the number of threads or
  //    their scheduling.
  const uint64_t B = L.block;
  const SegmentedTable& T = L.sketch;
  const uint64_t groups = T.groups(), gcells = T.group_cells();
  const float* sk = payload + L.sketch_offset;
  std::vector<uint64_t> goff(groups + 1, 0);  // trace positions: groups in order
  for (uint64_t g = 0; g < groups; ++g) goff[g + 1] = goff[g] + support.group_size(g);

  std::vector<uint64_t> peeled(groups, 0);
  std::vector<char> bad(groups, 0), non_finite(groups, 0);
#pragma omp parallel num_threads(nt)
  {
    std::vector<double> v(B), val(gcells * B);
    std::vector<CellState> cs(gcells);
    std::vector<float> vals;  // the group's recovered values, by position in its key list
    std::vector<uint32_t> queue, keys, kc;  // kc: each key's three cells, cached by the build
#pragma omp for schedule(dynamic, 1)
    for (int64_t g = 0; g < (int64_t)groups; ++g) {
      const uint64_t base = (uint64_t)g * gcells;
      const uint64_t kb = goff[g];
      keys.clear();
      for (const auto& part : support.by) keys.insert(keys.end(), part[g].begin(), part[g].end());
      if (keys.size() >= kMaxPeelKeys) {
        // Far beyond any sized capacity (a rank grossly overloaded): report, never allocate for it.
        for (uint32_t k : keys)
          for (uint64_t l = 0; l < B && (uint64_t)k * B + l < L.numel; ++l)
            out[(uint64_t)k * B + l] = std::numeric_limits<float>::quiet_NaN();
        continue;
      }
      const uint32_t kn = (uint32_t)keys.size();
      bool finite = true;
      for (uint64_t i = 0; i < gcells * B; ++i) {
        val[i] = (double)sk[base * B + i];
        finite &= std::isfinite(val[i]);
      }
      if (!finite) non_finite[g] = 1;
      std::fill(cs.begin(), cs.end(), CellState{0, 0});
      vals.assign((uint64_t)kn * B, std::numeric_limits<float>::quiet_NaN());
      kc.resize(3 * (uint64_t)kn);
      if (!build_cell_states(T, keys.data(), kn, cs.data(), base, kc.data())) {
        // Unpeelable as sized (a rank far over capacity): every key of the group stays NaN.
        std::fill(cs.begin(), cs.end(), CellState{0, 0});
      }
      uint64_t step = kb;
      bool group_bad = false;
      peeled[g] = peel(
          T, kn, cs.data(), base, gcells, queue,
          [&](uint32_t pos, uint64_t k, int pure, const uint64_t* cell, const int* sign) {
            // Branch-free: signs are multiplied in (exact), so mispredictions do not stall the
            // memory pipeline.
            const double* src = val.data() + (cell[pure] - base) * B;
            const double sp = (double)sign[pure];
            for (uint64_t l = 0; l < B; ++l) v[l] = sp * src[l];
            const int j1 = pure == 0 ? 1 : 0, j2 = pure == 2 ? 1 : 2;
            double* d1 = val.data() + (cell[j1] - base) * B;
            double* d2 = val.data() + (cell[j2] - base) * B;
            const double s1 = (double)sign[j1], s2 = (double)sign[j2];
            for (uint64_t l = 0; l < B; ++l) {
              d1[l] -= s1 * v[l];
              d2[l] -= s2 * v[l];
            }
            float* o = vals.data() + (uint64_t)pos * B;
            for (uint64_t l = 0; l < B; ++l) o[l] = (float)v[l];
            if (trace_key) {
              trace_key[step] = (int64_t)k;
              trace_cell[step] = (int64_t)cell[pure];
            }
            ++step;
            return true;
          },
          [&](uint64_t cell) { __builtin_prefetch(val.data() + (cell - base) * B, 1, 1); }, &group_bad, kc.data());
      bad[g] = group_bad;
      // Keys of a failed group keep NaN, never stale memory. Keys increase: the stores stream.
      for (uint32_t i = 0; i < kn; ++i) {
        const uint64_t lo = (uint64_t)keys[i] * B;
        const uint64_t len = std::min<uint64_t>(B, L.numel - lo);
        for (uint64_t l = 0; l < len; ++l) out[lo + l] = vals[(uint64_t)i * B + l];
      }
    }
  }
  prof.mark("peel");
  for (uint64_t g = 0; g < groups; ++g) {
    st.peeled += peeled[g];
    if (bad[g]) st.status = kDecodeIndexCorrupt;
    if (non_finite[g] && st.status == kDecodeOk) st.status = kDecodeSketchNonFinite;
  }
  if (st.status == kDecodeOk && st.peeled != st.support_keys) st.status = kDecodeSketchPeelFailed;

  return st;
}

EncodeStats encode(const CodecLayout& L, const float* x, float* payload, int num_threads) {
  const int nt = resolve_threads(num_threads);
  EncodeStats st;
  parallel_fill(payload, L.payload_numel, 0.0f, nt);
  KeyParts keys;
  keys.parts = find_nonzero_keys(L, x, nt, &st.non_finite);
  st.keys = keys.size();

  float* index = payload + L.index_offset;
  const std::vector<float> pw = digit_powers(L.index);
  if (L.index_kind == kIndexBitmap) {
    for (const auto& part : keys.parts)
      for (uint64_t k : part) index[k / L.index.per_word] += pw[k % L.index.per_word];
  } else if (L.index_kind == kIndexBloom) {
    const uint64_t cells = L.bloom.cells();
    std::vector<uint32_t> count(cells, 0);
    for (const auto& part : keys.parts)
      for (uint64_t k : part) {
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

  // Values: every cell is summed in increasing key order, whatever the thread count. With several
  // groups, keys are bucketed by group (stably) and each thread scatters whole groups, whose cells
  // stay in cache; with one group the scatter is sequential.
  float* sketch = payload + L.sketch_offset;
  const SegmentedTable& T = L.sketch;
  if (nt > 1 && T.groups() > 1) {
    std::vector<uint32_t> gkeys;
    std::vector<uint64_t> goff;
    bucket_by_group(T, keys, nt, &gkeys, &goff);
#pragma omp parallel num_threads(nt)
    {
      std::vector<uint32_t> kc;
#pragma omp for schedule(dynamic, 1)
      for (int64_t g = 0; g < (int64_t)T.groups(); ++g)
        scatter_keys(L, x, gkeys.data() + goff[g], goff[g + 1] - goff[g], (uint64_t)g * T.group_cells(), sketch, kc);
    }
  } else {
    // One group: its cell indices (below 2^31 at the sizes that use one group) fit the cache.
    std::vector<uint32_t> kc;
    for (const auto& part : keys.parts) scatter_keys(L, x, part.data(), part.size(), 0, sketch, kc);
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

}  // namespace cpu
}  // namespace lhc
