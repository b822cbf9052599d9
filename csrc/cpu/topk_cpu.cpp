// Top-k selection by magnitude (see topk_cpu.h for the definition of the result).
#include "topk_cpu.h"

#include "../lhc_layout.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <vector>

namespace lhc {
namespace cpu {
namespace {

// The order key of a coordinate: the IEEE bits of |x| (monotone in |x|; NaN above +Inf).
inline uint32_t key_of(const float* x, uint64_t i) {
  uint32_t u;
  std::memcpy(&u, x + i, 4);
  return u & 0x7fffffffu;
}

constexpr uint64_t kSample = 1 << 16;       // sampled keys
constexpr uint64_t kSmall = 1 << 18;        // below this, select directly among all keys
constexpr double kSigmas = 4.0;             // margin of the sampled threshold, in standard deviations

// The input is split into nt parts, each a loop iteration (`omp parallel for` over parts): every part
// is scanned whatever team the runtime grants (OMP_THREAD_LIMIT, OMP_DYNAMIC, a nested call), and the
// per-part counts and offsets combine in part order, so the result does not depend on the team.
struct Range {
  uint64_t lo, hi;
};
inline Range thread_range(uint64_t n, int t, int nt) {
  return Range{n * (uint64_t)t / (uint64_t)nt, n * (uint64_t)(t + 1) / (uint64_t)nt};
}

// Candidates: indices in ascending order and their keys.
struct Candidates {
  std::vector<int64_t> idx;
  std::vector<uint32_t> key;
  void clear() {
    idx.clear();
    key.clear();
  }
};

// Writes, in ascending order, every candidate whose key exceeds T, and the first `ties` whose key
// equals T. Returns the count written.
uint64_t write_selected(const Candidates& c, uint32_t T, uint64_t ties, int64_t* out) {
  uint64_t n = 0;
  for (uint64_t j = 0; j < c.idx.size(); ++j) {
    const uint32_t key = c.key[j];
    if (key > T || (key == T && ties > 0)) {
      ties -= key == T;
      out[n++] = c.idx[j];
    }
  }
  return n;
}

// The selection when the candidates are every coordinate with a non-zero key and fewer than k: all of
// them, and the first k - c coordinates whose key is 0 (the ties at the k-th largest key, 0, taken by
// index), merged in ascending order. O(k), where the exact passes read the whole input five times.
uint64_t write_with_zero_ties(const Candidates& c, uint64_t k, int64_t* out) {
  uint64_t zeros = k - c.idx.size(), w = 0, i = 0;   // enough zero keys lie below n: c < k <= n
  for (uint64_t j = 0;; ++j) {
    const uint64_t next = j < c.idx.size() ? (uint64_t)c.idx[j] : UINT64_MAX;
    for (; zeros > 0 && i < next; ++i, --zeros) out[w++] = (int64_t)i;
    if (j == c.idx.size()) return w;
    out[w++] = c.idx[j];
    i = next + 1;
  }
}

// The k-th largest key among the candidates (1 <= k <= their count) and how many of the k lie
// strictly above it.
void kth_key(const Candidates& c, uint64_t k, uint32_t* T, uint64_t* above) {
  std::vector<uint32_t> keys(c.key);
  std::nth_element(keys.begin(), keys.begin() + (k - 1), keys.end(), std::greater<uint32_t>());
  *T = keys[k - 1];
  uint64_t a = 0;
  for (uint64_t j = 0; j < k - 1; ++j) a += keys[j] > *T;   // nth_element: keys[0, k-1) are >= T
  *above = a;
}

// Exact selection over the whole input: the k-th largest key by three histogram passes (11, 11 and
// 10 bits, most significant first), then the ordered write with per-thread counts.
void exact_select(const float* x, uint64_t n, uint64_t k, int64_t* out, int nt, TopkStats* st) {
  uint32_t prefix = 0;       // the key bits fixed so far
  uint64_t remaining = k;    // how many of the k still lie among keys with this prefix
  const int shifts[3] = {21, 10, 0}, widths[3] = {11, 11, 10};
  std::vector<uint64_t> hist((size_t)nt << 11);
  for (int pass = 0; pass < 3; ++pass) {
    const int shift = shifts[pass], bins = 1 << widths[pass];
    const int fixed = shift + widths[pass];   // bits above this pass's digit are fixed
    std::fill(hist.begin(), hist.end(), 0);
#pragma omp parallel for num_threads(nt) schedule(static)
    for (int t = 0; t < nt; ++t) {
      const Range r = thread_range(n, t, nt);
      uint64_t* h = hist.data() + ((size_t)t << 11);
      for (uint64_t i = r.lo; i < r.hi; ++i) {
        const uint32_t key = key_of(x, i);
        if (fixed >= 32 || (key >> fixed) == (prefix >> fixed)) ++h[(key >> shift) & (uint32_t)(bins - 1)];
      }
    }
    uint64_t above = 0;
    for (int b = bins - 1; b >= 0; --b) {
      uint64_t c = 0;
      for (int t = 0; t < nt; ++t) c += hist[((size_t)t << 11) + (size_t)b];
      if (above + c >= remaining) {
        prefix |= (uint32_t)b << shift;
        remaining -= above;
        break;
      }
      above += c;
    }
  }
  const uint32_t T = prefix;   // the k-th largest key; `remaining` of its ties are taken
  std::vector<uint64_t> gt(nt), eq(nt);
#pragma omp parallel for num_threads(nt) schedule(static)
  for (int t = 0; t < nt; ++t) {
    const Range r = thread_range(n, t, nt);
    uint64_t g = 0, e = 0;
    for (uint64_t i = r.lo; i < r.hi; ++i) {
      const uint32_t key = key_of(x, i);
      g += key > T;
      e += key == T;
    }
    gt[t] = g;
    eq[t] = e;
  }
  std::vector<uint64_t> offset(nt), take(nt);
  uint64_t off = 0, ties = remaining;
  for (int t = 0; t < nt; ++t) {
    take[t] = std::min(eq[t], ties);
    ties -= take[t];
    offset[t] = off;
    off += gt[t] + take[t];
  }
#pragma omp parallel for num_threads(nt) schedule(static)
  for (int t = 0; t < nt; ++t) {
    const Range r = thread_range(n, t, nt);
    uint64_t c = offset[t], left = take[t];
    for (uint64_t i = r.lo; i < r.hi; ++i) {
      const uint32_t key = key_of(x, i);
      if (key > T || (key == T && left > 0)) {
        left -= key == T;
        out[c++] = (int64_t)i;
      }
    }
  }
  st->count = off;
  st->threshold = T;
  st->fallback = 1;
}

typedef int32_t vi8 __attribute__((vector_size(32)));
typedef int64_t vl4 __attribute__((vector_size(32)));
typedef float vf8 __attribute__((vector_size(32)));

// Every coordinate of [lo, hi) whose key is >= t_lo (> 0), 16 at a time as two 8-lane vector tests
// (keys are below 2^31, so signed lanes compare them; 8 lanes, as GCC turns a 16-lane compare into
// scalar ones where the target has no 512-bit registers, and the baseline copy's 8-lane one too),
// appended to c; *next is where the 16-wide loop stopped. False as soon as c holds more than cap.
// With e (error feedback), the keys are those of a = x + e, and a is written into e on the way (the
// whole range, even past an overflow of cap). Compiled per x86-64 level (a wide compare is what makes
// the pass run at memory speed); called from inside the parallel region, whose outlined body has no
// clones.
__attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
bool collect16(const float* x, float* e, uint64_t lo, uint64_t hi, uint32_t t_lo, uint64_t cap, Candidates& c,
               uint64_t* next) {
  // key >= t_lo as key > t_lo - 1: one vpcmpgtd with AVX2 (its >= takes a min and an equality).
  const vi8 mask = 0x7fffffff - vi8{}, above = (int32_t)(t_lo - 1) - vi8{};
  uint64_t i = lo;
  bool ok = true;
  for (; i + 16 <= hi; i += 16) {
    vi8 v[2], hit[2];
    for (int half = 0; half < 2; ++half) {
      const uint64_t at = i + 8 * (uint64_t)half;
      if (e) {
        vf8 a, b;
        std::memcpy(&a, x + at, 32);
        std::memcpy(&b, e + at, 32);
        a += b;   // one IEEE addition per lane, as topk_accumulate on the device
        std::memcpy(e + at, &a, 32);
        std::memcpy(&v[half], &a, 32);
      } else {
        std::memcpy(&v[half], x + at, 32);
      }
      v[half] &= mask;
      hit[half] = v[half] > above;
    }
    const vi8 any = hit[0] | hit[1];
    vl4 h;
    std::memcpy(&h, &any, 32);
    if (!(h[0] | h[1] | h[2] | h[3])) continue;
    for (int j = 0; j < 16; ++j)
      if (hit[j >> 3][j & 7]) {
        c.idx.push_back((int64_t)(i + j));
        c.key.push_back((uint32_t)v[j >> 3][j & 7]);
      }
    if (c.idx.size() > cap) {
      ok = false;
      i += 16;
      break;
    }
  }
  if (!ok && e)   // the sample misled: the exact fallback needs a everywhere
    for (uint64_t j = i; j < hi; ++j) e[j] = x[j] + e[j];
  *next = ok ? i : hi;
  return ok;
}

// Every coordinate with key >= t_lo, in ascending order, into cand; false (cand unspecified) if more
// than `cap` qualify. With e: the keys of a = x + e, and e <- a everywhere (also when false).
bool filter_at_least(const float* x, float* e, uint64_t n, uint32_t t_lo, uint64_t cap, int nt, Candidates& cand) {
  std::vector<Candidates> part(nt);
  int overflow = 0;
#pragma omp parallel for num_threads(nt) schedule(static) reduction(| : overflow)
  for (int t = 0; t < nt; ++t) {
    const Range r = thread_range(n, t, nt);
    Candidates& c = part[t];
    const uint64_t expect = std::min<uint64_t>(cap, (uint64_t)((double)cap * (double)(r.hi - r.lo) / (double)n) + 64);
    c.idx.reserve(expect);
    c.key.reserve(expect);
    uint64_t i = r.lo;
    if (!collect16(x, e, r.lo, r.hi, t_lo, cap, c, &i)) overflow = 1;
    for (; i < r.hi; ++i) {
      if (e) e[i] = x[i] + e[i];
      const uint32_t key = key_of(e ? e : x, i);
      if (key >= t_lo && !overflow) {
        c.idx.push_back((int64_t)i);
        c.key.push_back(key);
      }
    }
  }
  if (overflow) return false;
  uint64_t total = 0;
  for (const auto& c : part) total += c.idx.size();
  if (total > cap) return false;
  cand.clear();
  cand.idx.reserve(total);
  cand.key.reserve(total);
  for (const auto& c : part) {
    cand.idx.insert(cand.idx.end(), c.idx.begin(), c.idx.end());
    cand.key.insert(cand.key.end(), c.key.begin(), c.key.end());
  }
  return true;
}

// e <- x + e over [0, n) (threads over disjoint ranges).
void accumulate(const float* x, float* e, uint64_t n, int nt) {
#pragma omp parallel for num_threads(nt) schedule(static)
  for (int64_t i = 0; i < (int64_t)n; ++i) e[i] = x[i] + e[i];
}

// The selection of topk_select over a = x + e (e null: a = x). With e, e <- a on return, every
// coordinate written exactly once in the common case (the sample and the filtering pass).
TopkStats select_impl(const float* x, float* e, uint64_t n, uint64_t k, int64_t* out, int nt) {
  TopkStats st;
  if (k == 0 || n == 0 || k >= n || n <= kSmall) {
    if (e) accumulate(x, e, n, nt);
    x = e ? e : x;
    e = nullptr;
  }
  if (k == 0 || n == 0) return st;
  if (k >= n) {
    for (uint64_t i = 0; i < n; ++i) out[i] = (int64_t)i;
    st.count = n;
    return st;
  }
  Candidates cand;
  if (n <= kSmall) {
    cand.idx.resize(n);
    cand.key.resize(n);
    for (uint64_t i = 0; i < n; ++i) {
      cand.idx[i] = (int64_t)i;
      cand.key[i] = key_of(x, i);
    }
  } else {
    // Sample one key per stride, at a hashed offset inside it (deterministic: a function of n alone).
    const uint64_t stride = n / kSample;
    std::vector<uint32_t> sample(kSample);
    for (uint64_t j = 0; j < kSample; ++j) {
      const uint64_t i = j * stride + mix64(j ^ 0x70b5e1ec7ULL) % stride;
      if (e) {
        const float a = x[i] + e[i];
        sample[j] = key_of(&a, 0);
      } else {
        sample[j] = key_of(x, i);
      }
    }
    // Rank of the threshold in the sample: the expected count m of the top k plus kSigmas deviations,
    // so that at least k keys lie at or above it with high probability.
    const double m = (double)kSample * (double)k / (double)n;
    const uint64_t r = (uint64_t)std::ceil(m + kSigmas * std::sqrt(m) + 4.0);
    bool every_nonzero = false;   // cand is every coordinate whose key is not 0
    if (r < kSample) {
      std::nth_element(sample.begin(), sample.begin() + (r - 1), sample.end(), std::greater<uint32_t>());
      // A sampled threshold of 0 (fewer than r non-zero keys in the sample: a sparse gradient, such as an
      // embedding table's, may have fewer non-zero coordinates than k) filters at the smallest non-zero key.
      uint32_t t_lo = std::max<uint32_t>(sample[r - 1], 1);
      // More than twice the expected candidates (plus slack): the sample misled; go exact.
      const uint64_t cap = 2 * (uint64_t)((double)n * (double)r / (double)kSample) + 4096;
      bool kept = filter_at_least(x, e, n, t_lo, cap, nt, cand);
      if (e) {   // the filtering pass has written a into e
        x = e;
        e = nullptr;
      }
      if (kept && cand.idx.size() < k && t_lo > 1)   // fewer than k above the sampled threshold: all non-zero ones
        kept = filter_at_least(x, nullptr, n, t_lo = 1, cap, nt, cand);
      if (!kept) cand.clear();
      every_nonzero = kept && t_lo == 1;
    }
    if (e) {   // no filtering pass ran: e <- a, for the exact selection below
      accumulate(x, e, n, nt);
      x = e;
      e = nullptr;
    }
    if (cand.idx.size() < k) {
      if (every_nonzero) {   // the k-th largest key is 0
        st.candidates = cand.idx.size();
        st.count = write_with_zero_ties(cand, k, out);
        return st;
      }
      exact_select(x, n, k, out, nt, &st);   // the threshold missed: exact selection over a
      return st;
    }
    st.candidates = cand.idx.size();
  }
  uint32_t T;
  uint64_t above;
  kth_key(cand, k, &T, &above);
  st.count = write_selected(cand, T, k - above, out);
  st.threshold = T;
  return st;
}

}  // namespace

TopkStats topk_select(const float* x, uint64_t n, uint64_t k, int64_t* out, int num_threads) {
  return select_impl(x, nullptr, n, k, out, num_threads > 0 ? num_threads : omp_get_max_threads());
}

TopkStats topk_feedback(const float* x, float* e, uint64_t n, uint64_t k, int64_t* out, float* values,
                        int num_threads) {
  const int nt = num_threads > 0 ? num_threads : omp_get_max_threads();
  const TopkStats st = select_impl(x, e, n, k, out, nt);
  // e holds a = x + e; hand the selected entries over (k is small: a gather and a scatter of zeros).
  const float* a = e ? e : x;
#pragma omp parallel for num_threads(nt) schedule(static)
  for (int64_t j = 0; j < (int64_t)st.count; ++j) {
    values[j] = a[out[j]];
    if (e) e[out[j]] = 0.0f;
  }
  return st;
}

}  // namespace cpu
}  // namespace lhc
