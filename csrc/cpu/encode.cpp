// lhc::cpu::encode: the non-zero keys, the index and the value sketch of one rank's input.
#if defined(__SSE2__)
#include <emmintrin.h>
#endif
#if defined(__x86_64__) && defined(__GNUC__)
// GCC 12's AVX-512 headers build some intrinsics' results from a deliberately undefined vector, which
// -Wextra reports as uninitialised (as in peel_batch.cpp).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop
#define LHC_SCAN_AVX512 1
#else
#define LHC_SCAN_AVX512 0
#endif

#include <cmath>
#include <cstring>

#include "digits.h"
#include "peel.h"
#include "thc_cpu.h"

namespace lhc {
namespace cpu {

using namespace detail;

namespace {

// Bit i set iff p[i] is not +-0.0, for i < 64. SSE2 (baseline x86-64): four lanes per compare and
// movemask, about a third of the instructions of a branch-free scalar loop, which compilers do not
// vectorise.
inline uint64_t nonzero_mask64(const uint32_t* p) {
#if defined(__SSE2__)
  const __m128i zero = _mm_setzero_si128();
  uint64_t m = 0;
  for (int i = 0; i < 64; i += 4) {
    const __m128i v = _mm_slli_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + i)), 1);
    const uint32_t is_zero = (uint32_t)_mm_movemask_ps(_mm_castsi128_ps(_mm_cmpeq_epi32(v, zero)));
    m |= (uint64_t)(~is_zero & 0xfu) << i;
  }
  return m;
#else
  uint64_t m = 0;
  for (int i = 0; i < 64; ++i) m |= (uint64_t)((p[i] << 1) != 0) << i;
  return m;
#endif
}

inline uint32_t bit_pattern(float v) {
  uint32_t u;
  std::memcpy(&u, &v, 4);
  return u;
}


// Appends the keys k in [kb, ke) with x[k] not +-0.0, in increasing order, and their values (block 1).
// Chunks of 64: a vectorisable OR-reduction skips all-zero chunks (about half of them at 1% density),
// and a non-empty chunk's keys are read off the bit mask of its non-zero lanes.
uint64_t scan_block1(const float* x, uint64_t kb, uint64_t ke, std::vector<uint32_t>* keys, std::vector<float>* vals) {
  const uint32_t* bits = reinterpret_cast<const uint32_t*>(x);
  constexpr uint64_t kChunk = 64;
  uint64_t k = kb;
  for (; k + kChunk <= ke; k += kChunk) {
    for (uint64_t i = 0; i < kChunk; i += 16) __builtin_prefetch(x + k + i + kPrefetchAhead, 0, 3);
    uint32_t any = 0;
    for (uint64_t i = 0; i < kChunk; ++i) any |= bits[k + i] << 1;
    if (!any) continue;
    for (uint64_t m = nonzero_mask64(bits + k); m; m &= m - 1) {
      const uint64_t key = k + __builtin_ctzll(m);
      keys->push_back((uint32_t)key);
      vals->push_back(x[key]);
    }
  }
  for (; k < ke; ++k)
    if (bits[k] << 1) {
      keys->push_back((uint32_t)k);
      vals->push_back(x[k]);
    }
  return k;
}

#if LHC_SCAN_AVX512
// scan_block1 for whole chunks of 64 in AVX-512: one test per 16 lanes (bits other than the sign), and
// a non-empty vector's keys and values compressed into place, 16 stores at a time. Returns where the
// chunks ended (scan_block1 does the rest).
__attribute__((target("avx512f"))) uint64_t scan_block1_avx512(const float* x, uint64_t kb, uint64_t ke,
                                                               std::vector<uint32_t>* keys, std::vector<float>* vals) {
  constexpr uint64_t kChunk = 64;
  size_t n = keys->size();
  // Room for a whole chunk past n at every step: the stores below write 16 lanes, used or not.
  auto make_room = [&](size_t need) {
    if (keys->size() >= need) return;
    const size_t grown = std::max(need, 2 * keys->size() + 4096);
    keys->resize(grown);
    vals->resize(grown);
  };
  const __m512i magnitude = _mm512_set1_epi32(0x7fffffff);
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  uint64_t k = kb;
  for (; k + kChunk <= ke; k += kChunk) {
    __m512i v[4];
    __mmask16 m[4];
    for (int j = 0; j < 4; ++j) {
      _mm_prefetch(reinterpret_cast<const char*>(x + k + 16 * j + kPrefetchAhead), _MM_HINT_T0);
      v[j] = _mm512_loadu_si512(x + k + 16 * j);
      m[j] = _mm512_test_epi32_mask(v[j], magnitude);
    }
    if (!(m[0] | m[1] | m[2] | m[3])) continue;
    make_room(n + kChunk);
    for (int j = 0; j < 4; ++j) {
      if (!m[j]) continue;
      const __m512i key = _mm512_add_epi32(_mm512_set1_epi32((int)(k + 16 * j)), lane);
      _mm512_storeu_si512(keys->data() + n, _mm512_maskz_compress_epi32(m[j], key));
      _mm512_storeu_si512(vals->data() + n, _mm512_maskz_compress_epi32(m[j], v[j]));
      n += (size_t)__builtin_popcount(m[j]);
    }
  }
  keys->resize(n);
  vals->resize(n);
  return k;
}
#endif

// Non-zero keys of x, per thread in increasing order (concatenated: sorted), with their blocks'
// values (KeyParts), and whether x held NaN/Inf. -0.0 counts as zero.
KeyParts find_nonzero_keys(const CodecLayout& L, const float* x, int nt, uint32_t* non_finite) {
  KeyParts out;
  out.parts.resize(nt);
  out.vals.resize(nt);
  std::vector<uint32_t> bad(nt, 0);
  const bool avx512 = cpu_isa_is_avx512();
  (void)avx512;
#pragma omp parallel num_threads(nt)
  {
    const int tid = omp_get_thread_num();
    uint64_t kb, ke;
    // The runtime may grant fewer threads than asked (nested regions, OMP_DYNAMIC): split by the
    // team actually running, or some keys would never be scanned.
    split_range(L.num_keys, omp_get_num_threads(), tid, &kb, &ke);
    std::vector<uint32_t> mine;  // private while scanning (no false sharing on the vector header)
    std::vector<float> vals;
    uint32_t nf = 0;
    const uint32_t* bits = reinterpret_cast<const uint32_t*>(x);
    if (L.block == 1) {
      uint64_t k = kb;
#if LHC_SCAN_AVX512
      if (avx512) k = scan_block1_avx512(x, kb, ke, &mine, &vals);
#endif
      k = scan_block1(x, k, ke, &mine, &vals);
    } else {
      for (uint64_t k = kb; k < ke; ++k) {
        const uint64_t lo = k * L.block, hi = std::min<uint64_t>(lo + L.block, L.numel);
        for (uint64_t i = lo; i < hi; i += 16) __builtin_prefetch(x + i + kPrefetchAhead, 0, 3);
        uint32_t any = 0;
        for (uint64_t i = lo; i < hi; ++i) any |= bits[i] << 1;
        if (any) {
          mine.push_back((uint32_t)k);
          vals.insert(vals.end(), x + lo, x + hi);
          vals.resize(vals.size() + (L.block - (hi - lo)), 0.0f);
        }
      }
    }
    // Inf and NaN are non-zero, so they are among the values found (in non-zero blocks): checked
    // there, not in the scan.
    for (const float v : vals) nf |= (uint32_t)((bit_pattern(v) & 0x7f800000u) == 0x7f800000u);
    out.parts[tid] = std::move(mine);
    out.vals[tid] = std::move(vals);
    bad[tid] = nf;
  }
  *non_finite = 0;
  for (uint32_t b : bad) *non_finite |= b;
  return out;
}

// Add weight * vals[i] (key i's block, B floats) into the value sketch and |weight| * max |vals[i]|
// into the mass channel for keys[0, count), in that order; all of them in the group whose first
// cell is `base`. `kc` is scratch for the keys' cells, hashed in one vectorisable pass. The values
// are read in order (gathered by the scan), and the group's cells stay in cache once touched.
void scatter_keys(const CodecLayout& L, const float* vals, const uint32_t* keys, size_t count, uint64_t base,
                  float* sketch, float* mass, std::vector<uint32_t>& kc) {
  constexpr size_t kAhead = 16;
  const uint64_t B = L.block;
  kc.resize(3 * count);
  hash_cells(L.sketch, keys, (uint32_t)count, kc.data());
  auto cell_values = [&](size_t i, int j) {  // the values of cell j of keys[i]
    return sketch + (base + (uint64_t)j * L.sketch.seg_len + (kc[3 * i + j] >> kWeightCodeBits)) * B;
  };
  for (size_t i = 0; i < count; ++i) {
    if (i + kAhead < count) {
      // The cells and their mass cells were zero-filled just before, but a group of blocks of several
      // values, or the one group of a table of one, is larger than the cache.
      for (int j = 0; j < 3; ++j) {
        __builtin_prefetch(cell_values(i + kAhead, j), 1, 3);
        __builtin_prefetch(mass + (cell_values(i + kAhead, j) - sketch) / B, 1, 3);
      }
    }
    const uint64_t len = std::min<uint64_t>(B, L.numel - (uint64_t)keys[i] * B);
    const float* src = vals + i * B;
    float m = 0.0f;  // the block's largest magnitude: its mass (exact, as every |w| * m below)
    for (uint64_t l = 0; l < len; ++l) m = std::max(m, std::fabs(src[l]));
    for (int j = 0; j < 3; ++j) {
      // w * v is exact (w = +-1, +-2), and dst + (-1 * v) is dst - v bit for bit (IEEE subtraction is
      // addition of the negation); a multiplied-in weight needs no branch: a random sign mispredicts
      // half the time.
      float* dst = cell_values(i, j);
      const float w = (float)PeelCells::weight(kc[3 * i + j]);
      for (uint64_t l = 0; l < len; ++l) dst[l] += w * src[l];
      mass[(cell_values(i, j) - sketch) / B] += std::fabs(w) * m;
    }
  }
}

// Stable parallel bucketing of sorted keys by sketch group: keys of group g land in
// [group_offset[g], group_offset[g+1]) of `keys`, in increasing order, their values (B floats each)
// at the same positions of `vals`. Groups are hashed a chunk at a time (vectorised, and cheaper to
// redo than to store) in both passes.
void bucket_by_group(const SegmentedTable& T, const KeyParts& support, uint64_t B, int nt, std::vector<uint32_t>* keys,
                     std::vector<float>* vals, std::vector<uint64_t>* group_offset) {
  const uint64_t groups = T.groups();
  const size_t parts = support.parts.size();
  constexpr size_t kChunk = 2048;
  keys->resize(support.size());
  vals->resize(support.size() * B);
  group_offset->assign(groups + 1, 0);
  std::vector<std::vector<uint64_t>> hist(parts, std::vector<uint64_t>(groups, 0));
#pragma omp parallel for num_threads(nt) schedule(static, 1)
  for (int64_t p = 0; p < (int64_t)parts; ++p) {
    const auto& part = support.parts[p];
    uint32_t group[kChunk];
    for (size_t i = 0; i < part.size(); i += kChunk) {
      const size_t n = std::min(kChunk, part.size() - i);
      hash_groups(T, part.data() + i, n, group);
      for (size_t j = 0; j < n; ++j) ++hist[p][group[j]];
    }
  }
  histogram_to_cursors(hist, groups, group_offset);
#pragma omp parallel for num_threads(nt) schedule(static, 1)
  for (int64_t p = 0; p < (int64_t)parts; ++p) {
    const auto& part = support.parts[p];
    const float* part_vals = support.vals[p].data();
    uint64_t* cursor = hist[p].data();
    uint32_t group[kChunk];
    for (size_t i = 0; i < part.size(); i += kChunk) {
      const size_t n = std::min(kChunk, part.size() - i);
      hash_groups(T, part.data() + i, n, group);
      for (size_t j = 0; j < n; ++j) {
        const uint64_t to = cursor[group[j]]++;
        (*keys)[to] = part[i + j];
        std::copy(part_vals + (i + j) * B, part_vals + (i + j + 1) * B, vals->data() + to * B);
      }
    }
  }
}

// The bitmap index: word w = sum of base^(k mod per_word) over the non-zero keys k of the word, each
// thread writing a contiguous range of words once, a cache-sized chunk at a time (zeroed, then its
// keys added in increasing order: the same exact integer sums as any order). `keys` is sorted.
void write_bitmap_words(const CodecLayout& L, const KeyParts& keys, const std::vector<float>& pw, float* index,
                        int nt) {
  const uint64_t words = L.index.words(), per_word = L.index.per_word;
  constexpr uint64_t kChunkWords = 4096;
  std::vector<KeyRun> runs;
  for (const auto& part : keys.parts) runs.push_back(KeyRun{part.data(), part.size(), nullptr});
#pragma omp parallel num_threads(nt)
  {
    uint64_t wb, we;  // whole words per thread: a word's keys are added by one thread
    split_range(words, omp_get_num_threads(), omp_get_thread_num(), &wb, &we);
    walk_runs_by_chunk(
        runs, 0, wb * per_word, we * per_word, kChunkWords * per_word,
        [&](uint64_t c0, uint64_t c1) { std::fill(index + c0 / per_word, index + c1 / per_word, 0.0f); },
        [&](const KeyRun& run, uint64_t i) {
          const uint32_t k = run.keys[i];
          index[k / per_word] += pw[k % per_word];
        });
  }
}

// Fine level l of the multilevel index: each non-zero node's pattern (base^digit for each child
// holding a non-zero key; wpg words) added to its three cells with the cells' signs, accumulated in
// int64 and converted once (integer sums: bit-identical to the reference, in any order). A node's
// cells are hashed and prefetched when its pattern is complete, and it is added kAhead nodes later
// (a small ring of pending nodes): the table is several MiB and its cells are random, so adding at
// once waited on a miss per cell.
void write_fine_level(const CodecLayout& L, uint32_t l, const KeyParts& keys, float* fine, int nt) {
  const uint64_t base = L.index.base, wpg = L.fine_words[l], w = L.fine_digits[l], fcells = L.fine[l].cells();
  std::vector<uint64_t> dpow(w, 1);
  for (uint64_t j = 1; j < w; ++j) dpow[j] = dpow[j - 1] * base;
  std::vector<int64_t> acc(fcells * wpg, 0);
  struct Pending {
    uint64_t cell[3];
    int sign[3];  // +-1: fine tables are signed, never weighted
  };
  constexpr size_t kAhead = 16;
  Pending ring[kAhead];
  std::vector<uint64_t> ring_pattern(kAhead * wpg, 0), pattern(wpg, 0);
  size_t head = 0, pending = 0;
  auto add_oldest = [&]() {
    const Pending& p = ring[head];
    const uint64_t* pat = &ring_pattern[head * wpg];
    for (int j = 0; j < 3; ++j)
      for (uint64_t q = 0; q < wpg; ++q) acc[p.cell[j] * wpg + q] += p.sign[j] * (int64_t)pat[q];
    head = (head + 1) % kAhead;
    --pending;
  };
  uint64_t cur = ~0ULL, last_child = ~0ULL;
  auto finish_node = [&]() {
    if (cur == ~0ULL) return;
    if (pending == kAhead) add_oldest();
    const size_t slot = (head + pending++) % kAhead;
    key_cells(L.fine[l], cur, ring[slot].cell, ring[slot].sign);
    for (int j = 0; j < 3; ++j) __builtin_prefetch(&acc[ring[slot].cell[j] * wpg], 1, 3);
    std::copy(pattern.begin(), pattern.end(), ring_pattern.begin() + slot * wpg);
    std::fill(pattern.begin(), pattern.end(), 0);
  };
  for (const auto& part : keys.parts)
    for (uint64_t k : part) {
      const uint64_t v = ml_node(L, l, k);
      if (v != cur) {
        finish_node();
        cur = v;
        last_child = ~0ULL;
      }
      const uint64_t c = ml_child(L, l, k);
      if (c != last_child) pattern[c / w] += dpow[c % w];  // keys are increasing: a child's keys are adjacent
      last_child = c;
    }
  finish_node();
  while (pending) add_oldest();
#pragma omp parallel for num_threads(nt) schedule(static)
  for (int64_t i = 0; i < (int64_t)(fcells * wpg); ++i) fine[i] = (float)acc[i];
}

}  // namespace

EncodeStats encode(const CodecLayout& L, const float* x, float* payload, int num_threads) {
  const int nt = resolve_threads(num_threads);
  EncodeStats st;
  Prof prof;
  // Zero what is accumulated into: the coarse index of the multilevel kind, and the sketch and its
  // mass (here when they are one group; group by group below, just before their keys are added, when
  // there are several: no separate pass over them, and their cells are then in cache). The bitmap and
  // Bloom index words and the fine tables are each written once below; the header last.
  float* index = payload + L.index_offset;
  const SegmentedTable& T = L.sketch;
  if (L.index_kind == kIndexMultilevel) parallel_fill(index, L.index.words(), 0.0f, nt);
  if (T.groups() <= 1) parallel_fill(payload + L.sketch_offset, L.payload_numel - L.sketch_offset, 0.0f, nt);
  prof.mark("enc zero");
  const KeyParts keys = find_nonzero_keys(L, x, nt, &st.non_finite);
  st.keys = keys.size();
  prof.mark("enc find");

  const std::vector<float> pw = digit_powers(L.index);
  if (L.index_kind == kIndexBitmap) {
    write_bitmap_words(L, keys, pw, index, nt);
  } else if (L.index_kind == kIndexBloom) {
    const uint64_t cells = L.bloom.cells();
    std::vector<uint32_t> count(cells, 0);
    for (const auto& part : keys.parts)
      for (uint64_t k : part) {
        uint64_t cell[3];
        int weight[3];  // unused: index tables add counts
        key_cells(L.bloom, k, cell, weight);
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
  } else if (L.index_kind == kIndexMultilevel) {
    // Coarse digit 1 per non-zero node of fine level 0; then each fine level (write_fine_level).
    uint64_t last = ~0ULL;
    for (const auto& part : keys.parts)
      for (uint64_t k : part) {
        const uint64_t v = ml_node(L, 0, k);
        if (v != last) index[v / L.index.per_word] += pw[v % L.index.per_word];
        last = v;
      }
    for (uint32_t l = 0; l < L.fine_levels; ++l) write_fine_level(L, l, keys, payload + L.fine_offset[l], nt);
  }

  prof.mark("enc index");
  // Values: every cell is summed in increasing key order, whatever the thread count. With several
  // groups, keys are bucketed by group (stably) and each thread scatters whole groups, whose cells
  // stay in cache; with one group the scatter is sequential.
  float* sketch = payload + L.sketch_offset;
  float* mass = payload + mass_offset(L);
  if (T.groups() > 1) {
    std::vector<uint32_t> gkeys;
    std::vector<float> gvals;
    std::vector<uint64_t> goff;
    bucket_by_group(T, keys, L.block, nt, &gkeys, &gvals, &goff);
    prof.mark("enc bucket");
#pragma omp parallel num_threads(nt)
    {
      std::vector<uint32_t> kc;
#pragma omp for schedule(dynamic, 1)
      for (int64_t g = 0; g < (int64_t)T.groups(); ++g) {
        const uint64_t base = (uint64_t)g * T.group_cells();  // the groups' cells tile sketch and mass
        std::fill(sketch + base * L.block, sketch + (base + T.group_cells()) * L.block, 0.0f);
        std::fill(mass + base, mass + base + T.group_cells(), 0.0f);
        scatter_keys(L, gvals.data() + goff[g] * L.block, gkeys.data() + goff[g], goff[g + 1] - goff[g], base, sketch,
                     mass, kc);
      }
    }
  } else {
    std::vector<uint32_t> kc;
    for (size_t p = 0; p < keys.parts.size(); ++p)
      scatter_keys(L, keys.vals[p].data(), keys.parts[p].data(), keys.parts[p].size(), 0, sketch, mass, kc);
  }

  prof.mark("enc values");
  // The index checksum (lhc_layout.h): each part's sums of the keys' parts, added exactly in uint64.
  const uint64_t check_stream = index_check_stream(L.sketch.stream);
  unsigned long long check[kIndexCheckFields] = {0, 0};
  {
    const int64_t parts = (int64_t)keys.parts.size();
    std::vector<unsigned long long> sums(2 * parts, 0);
#pragma omp parallel for num_threads(nt) schedule(static, 1)
    for (int64_t p = 0; p < parts; ++p)
      index_check_sums(check_stream, keys.parts[p].data(), nullptr, keys.parts[p].size(), &sums[2 * p]);
    for (int64_t p = 0; p < parts; ++p)
      for (uint32_t f = 0; f < kIndexCheckFields; ++f) check[f] += sums[2 * p + f];
  }
  float* header = payload;
  header[kHdrContributors] = 1.0f;
  header[kHdrFingerprintLo] = (float)(L.fingerprint & ((1u << kChunkBits) - 1));
  header[kHdrFingerprintHi] = (float)(L.fingerprint >> kChunkBits);
  write_chunks(header, kHdrKeysLo, st.keys);
  header[kHdrOverloaded] = st.keys > L.capacity ? 1.0f : 0.0f;
  header[kHdrNonFinite] = (float)st.non_finite;
  header[kHdrSaturated] = (float)st.saturated;
  for (uint32_t f = 0; f < kIndexCheckFields; ++f)
    header[kHdrIndexCheck0 + f] = (float)(check[f] % index_check_prime(f));
  return st;
}

}  // namespace cpu
}  // namespace lhc
