// The support (the keys non-zero on at least one rank) from the bitmap and the Bloom index.
#include "digits.h"
#include "peel.h"
#include "thc_cpu.h"

namespace lhc {
namespace cpu {
namespace detail {

// Bloom index: candidates, then exact integer peeling of the counters. Returns a DecodeStatus and
// the keys whose aggregated count is >= 1, bucketed by sketch group (one part).
int32_t bloom_support(const CodecLayout& L, const DecodeInputs& in, const float* index, int nt, GroupedKeys* support,
                      DecodeStats* st) {
  const uint64_t n = in.world_size;
  const uint64_t bcells = L.bloom.cells();
  std::vector<uint32_t> count(bcells, 0);
  struct CountSink {
    uint32_t* count;
    uint64_t cells, digit_max, sum;
    uint32_t per_word;
    bool operator()(uint64_t first_word, uint32_t words, const WordDigits& d) {
      if (d.max > digit_max) return false;
      sum += d.sum;
      for (uint32_t w = 0; w < words; ++w)
        for (uint32_t i = 0; i < per_word; ++i) {
          const uint64_t pos = (first_word + w) * per_word + i;
          if (pos < cells)
            count[pos] = d.digit[i][w];
          else if (d.digit[i][w])
            return false;  // a digit beyond the last counter
        }
      return true;
    }
  };
  support->by.clear();
  std::vector<CountSink> sinks(nt, CountSink{count.data(), bcells, n * (uint64_t)L.digit_cap, 0, L.index.per_word});
  const bool valid = unpack_digits(L, index, in.scale, nt, sinks);
  for (const auto& k : sinks) st->index_total += k.sum;
  if (!valid || st->index_total != 3 * in.total_keys) return kDecodeIndexCorrupt;

  // Candidates: keys whose three counters are all non-zero (a superset of the true support). Every
  // key is tested, at random counters: they are looked up in a bitmap of the non-zero ones, 32 times
  // smaller than the counters (in cache where they are not).
  std::vector<uint64_t> occupied((bcells + 63) / 64, 0);
  for (uint64_t c = 0; c < bcells; ++c) occupied[c / 64] |= (uint64_t)(count[c] != 0) << (c % 64);
  const auto is_occupied = [&](uint64_t c) { return occupied[c / 64] >> (c % 64) & 1; };
  std::vector<std::vector<uint32_t>> local(nt);
#pragma omp parallel num_threads(nt)
  {
    uint64_t kb, ke;
    split_range(L.num_keys, omp_get_num_threads(), omp_get_thread_num(), &kb, &ke);
    auto& mine = local[omp_get_thread_num()];
    // Most keys fail at the first counter at the densities where the Bloom index is chosen: the
    // first cells of a chunk of keys are hashed together (vectorised), the other two only for keys
    // that pass.
    constexpr uint64_t kChunk = 4096;
    std::vector<uint64_t> first(kChunk);
    for (uint64_t k0 = kb; k0 < ke; k0 += kChunk) {
      const uint64_t n = std::min(kChunk, ke - k0);
      hash_first_cells(L.bloom, k0, n, first.data());
      for (uint64_t i = 0; i < n; ++i) {
        if (!is_occupied(first[i])) continue;
        const uint64_t h = key_hash(L.bloom, k0 + i);
        int weight;  // unused: index tables add counts
        if (is_occupied(key_cell(L.bloom, h, 1, &weight)) && is_occupied(key_cell(L.bloom, h, 2, &weight)))
          mine.push_back((uint32_t)(k0 + i));
      }
    }
  }
  std::vector<uint32_t> cand;
  for (auto& v : local) cand.insert(cand.end(), v.begin(), v.end());
  st->candidates = cand.size();

  // Each candidate's count is the number of ranks holding it; false positives come out exactly 0.
  // Counts are integers below 2^22, exact in the table's doubles.
  PeelTable storage;
  const PeelCells t = storage.reset(L.bloom.seg_len, 1);
  for (uint64_t c = 0; c < bcells; ++c) {
    t.clear_state(c);
    t.values(c)[0] = count[c];
  }
  std::vector<uint32_t>().swap(count);
  std::vector<uint32_t> found, scratch;
  const uint64_t check_stream = index_check_stream(L.sketch.stream);
  build_states(t, L.bloom, cand.data(), (uint32_t)cand.size(), scratch);
  found.reserve(cand.size());
  bool bad = false;
  const uint32_t resolved = peel(
      t, (uint32_t)cand.size(), scratch,
      [&](uint32_t pos, const uint64_t* cell, const double*) {
        const double c = t.values(cell[0])[0];
        if (c > (double)n) { bad = true; return false; }
        for (int j = 0; j < 3; ++j) {
          double& v = t.values(cell[j])[0];
          if (v < c) { bad = true; return false; }
          v -= c;
        }
        if (c != 0.0) {
          found.push_back(cand[pos]);
          uint32_t part[2];
          index_check_parts(check_stream, cand[pos], part);
          for (uint32_t f = 0; f < kIndexCheckFields; ++f) st->index_check[f] += (unsigned long long)c * part[f];
        }
        return true;
      },
      &bad);
  if (bad) return kDecodeIndexCorrupt;
  if (resolved != cand.size()) return kDecodeIndexPeelFailed;
  for (uint64_t c = 0; c < bcells; ++c)
    if (t.values(c)[0] != 0.0) return kDecodeIndexCorrupt;
  std::sort(found.begin(), found.end());
  st->false_positives = cand.size() - found.size();
  const SegmentedTable& T = L.sketch;
  support->by.assign(1, std::vector<HugeVector<uint32_t>>(T.groups()));
  for (uint32_t k : found) support->by[0][key_group(T, k)].push_back(k);
  return kDecodeOk;
}

// Bitmap index: the keys with a non-zero counter, in increasing order, bucketed by sketch group.
// Returns a DecodeStatus.
int32_t bitmap_support(const CodecLayout& L, const DecodeInputs& in, const float* index, int nt,
                       GroupedKeys* support, DecodeStats* st) {
  const SegmentedTable& T = L.sketch;
  const uint64_t groups = T.groups();
  // A group's keys and how many are set: the vector is sized ahead, so filling it is a plain store.
  struct Bucket {
    HugeVector<uint32_t> keys;
    uint64_t size = 0;
  };
  struct KeySink {
    const SegmentedTable* table;
    const DigitKeyLister* lister;
    std::vector<Bucket> buckets;
    std::vector<uint32_t> found, group;  // one block's keys and their groups
    uint64_t num_keys, sum;
    uint32_t per_word, world_size;
    // The index checksum: the sums of count(k) * part_f(k), as those of part_f(k) over the keys found
    // (vectorised) plus (count(k) - 1) * part_f(k) over the few keys of count 2 or more.
    uint64_t check_stream;
    uint32_t base;  // of the digits
    DigitReciprocals powers;  // of base, for a word's digits of 2 or more
    unsigned long long check[kIndexCheckFields];
    uint64_t room;  // free slots in the fullest bucket, at least
    bool operator()(uint64_t first_word, uint32_t words, const WordDigits& d) {
      if (d.max > world_size) return false;
      sum += d.sum;
      const uint32_t n = (*lister)(d.nonzero, words, (uint32_t)(first_word * per_word), found.data());
      if (n == 0) return true;
      if (found[n - 1] >= num_keys) return false;  // a digit past the last key (in the last word)
      index_check_sums(check_stream, found.data(), nullptr, n, check);
      if (d.max > 1)
        for (uint32_t w = 0; w < words; ++w) {
          if (d.word_max[w] < 2) continue;
          const double v = d.value[w];
          for (uint32_t m = d.nonzero[w]; m; m &= m - 1) {  // its non-zero digits
            const uint32_t i = (uint32_t)__builtin_ctz(m);
            const uint32_t digit = powers.quotient(v, i) - base * powers.quotient(v, i + 1);
            if (digit < 2) continue;
            uint32_t part[kIndexCheckFields];
            index_check_parts(check_stream, (first_word + w) * per_word + i, part);
            for (uint32_t f = 0; f < kIndexCheckFields; ++f) check[f] += (unsigned long long)(digit - 1) * part[f];
          }
        }
      // Every bucket has room for `room` more keys: checked bucket by bucket only when a block might
      // not fit (rarely: the buckets are sized ahead for a valid payload).
      if (room < n) {
        room = UINT64_MAX;
        for (Bucket& b : buckets) {
          if (b.keys.size() < b.size + n) b.keys.resize(2 * (b.size + n));
          room = std::min<uint64_t>(room, b.keys.size() - b.size);
        }
      }
      room -= n;
      if (buckets.size() == 1) {
        std::copy(found.data(), found.data() + n, buckets[0].keys.data() + buckets[0].size);
        buckets[0].size += n;
        return true;
      }
      hash_groups(*table, found.data(), n, group.data());
      for (uint32_t i = 0; i < n; ++i) {
        Bucket& b = buckets[group[i]];
        b.keys[b.size++] = found[i];
      }
      return true;
    }
  };
  // Each thread's share of a group's keys, with room to spare: no reallocation for a valid payload.
  const uint64_t expect = std::min<uint64_t>(in.total_keys, L.num_keys) / ((uint64_t)nt * groups);
  const uint64_t block_keys = (uint64_t)kWordBlock * L.index.per_word;
  const DigitKeyLister lister(L.index.per_word, cpu_isa_is_avx512());
  // found: room for the lister's 16 entries past a block's keys
  KeySink proto{&T, &lister, std::vector<Bucket>(groups), std::vector<uint32_t>(block_keys + 16),
                std::vector<uint32_t>(block_keys),
                L.num_keys, 0, L.index.per_word, (uint32_t)in.world_size, index_check_stream(L.sketch.stream),
                L.index.base, DigitReciprocals(L.index.base, L.index.per_word), {0, 0}, 0};
  std::vector<KeySink> sinks(nt, proto);
  auto kept = support->take();  // the caller's buckets (kept from its last decode), reused
  for (size_t t = 0; t < sinks.size(); ++t)
    for (uint64_t g = 0; g < groups; ++g)
      GroupedKeys::reuse(kept, t, g, expect + expect / 8 + 64, &sinks[t].buckets[g].keys);
  const DigitMaskTable masks(L.index);
  const bool valid = unpack_digits(L, index, in.scale, nt, sinks, &masks);
  support->by.clear();
  for (auto& k : sinks) {
    st->index_total += k.sum;
    for (uint32_t f = 0; f < kIndexCheckFields; ++f) st->index_check[f] += k.check[f];
    std::vector<HugeVector<uint32_t>> part;
    for (Bucket& b : k.buckets) {
      b.keys.resize(b.size);
      part.push_back(std::move(b.keys));
    }
    support->by.push_back(std::move(part));
  }
  // An invalid index stops each thread at its own first bad block: what was listed depends on the
  // thread count, so nothing of it is reported.
  st->candidates = valid ? support->total() : 0;
  if (!valid || st->index_total != in.total_keys) return kDecodeIndexCorrupt;
  return kDecodeOk;
}

}  // namespace detail
}  // namespace cpu
}  // namespace lhc
