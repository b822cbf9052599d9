// lhc::cpu::nonzero_rows: which rows of a dense gradient hold a value other than +-0.0 (the planner's
// row scan, lossless_hc/training/rows.py); lhc::cpu::dense_copy_count: the dense index's body;
// lhc::cpu::sum_row_slots: the allgather strategy's gathered rows summed into a dense table.
#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "codec_cpu.h"
#include "codec_cpu_internal.h"

namespace lhc {
namespace cpu {

namespace {

// present[r] = 1 iff some word of row r, shifted left by one (the sign bit dropped), is not zero: a
// float that is not +-0.0, NaN and infinities included. One read of the rows, in order; the OR over a
// row is branch-free and vectorises, and the rows are prefetched ahead as the encoder's scans are.
template <typename Word>
void scan_rows(const Word* x, uint64_t begin, uint64_t end, uint64_t row, uint8_t* present) {
  constexpr uint64_t kAhead = detail::kPrefetchAhead * sizeof(float) / sizeof(Word);  // the same bytes ahead
  constexpr uint64_t kLine = 64 / sizeof(Word);
  uint64_t next = begin * row;  // the next element to prefetch
  for (uint64_t r = begin; r < end; ++r) {
    const Word* p = x + r * row;
    for (const uint64_t stop = std::min((r + 1) * row + kAhead, end * row); next < stop; next += kLine)
      detail::prefetch_line(x + next);
    Word any = 0;
    for (uint64_t i = 0; i < row; ++i) any |= (Word)(p[i] << 1);
    present[r] = any != 0;
  }
}

// The same test for rows of a few words, ROW known at compile time: the loop over rows vectorises (no
// per-row prefetch bookkeeping; a sequential read is the hardware prefetcher's own case). A dense
// model's biases and convolution weights are rows of one element, which the general loop scanned at a
// fifth of the memory's speed.
template <typename Word, int ROW>
void scan_short_rows(const Word* x, uint64_t begin, uint64_t end, uint8_t* present) {
  for (uint64_t r = begin; r < end; ++r) {
    Word any = 0;
    for (int i = 0; i < ROW; ++i) any |= (Word)(x[r * ROW + i] << 1);
    present[r] = any != 0;
  }
}

template <typename Word>
void scan(const Word* x, uint64_t begin, uint64_t end, uint64_t row, uint8_t* present) {
  switch (row) {
    case 1: scan_short_rows<Word, 1>(x, begin, end, present); break;
    case 2: scan_short_rows<Word, 2>(x, begin, end, present); break;
    case 4: scan_short_rows<Word, 4>(x, begin, end, present); break;
    default: scan_rows(x, begin, end, row, present); break;
  }
}

}  // namespace

uint64_t nonzero_rows(const void* x, uint64_t rows, uint64_t row, int element_bytes, uint8_t* present,
                      int num_threads) {
  if (rows == 0) return 0;
  // Threads only where each gets rows worth their start-up (~64 KiB of input).
  const uint64_t bytes = rows * row * (uint64_t)element_bytes;
  const int nt = (int)std::max<uint64_t>(1, std::min<uint64_t>(detail::resolve_threads(num_threads), bytes >> 16));
  uint64_t count = 0;
#pragma omp parallel num_threads(nt) reduction(+ : count)
  {
    uint64_t begin, end;
    detail::split_range(rows, omp_get_num_threads(), omp_get_thread_num(), &begin, &end);
    switch (element_bytes) {
      case 2: scan(static_cast<const uint16_t*>(x), begin, end, row, present); break;
      case 4: scan(static_cast<const uint32_t*>(x), begin, end, row, present); break;
      default: scan(static_cast<const uint64_t*>(x), begin, end, row, present); break;
    }
    for (uint64_t r = begin; r < end; ++r) count += present[r];  // in cache, just written
  }
  return count;
}

void present_row_index(const uint8_t* present, uint64_t rows, int64_t* index) {
  // Eight flags a word: most words of a sparse gradient's flags are zero and cost one test.
  uint64_t m = 0, r = 0;
  for (; r + 8 <= rows; r += 8) {
    uint64_t w;
    std::memcpy(&w, present + r, sizeof w);
    w &= 0x0101010101010101ull;  // a flag's low bit: no more entries than flags, whatever else a byte holds
    for (; w; w &= w - 1) index[m++] = (int64_t)(r + (uint64_t)__builtin_ctzll(w) / 8);
  }
  for (; r < rows; ++r)
    if (present[r]) index[m++] = (int64_t)r;
}

void dense_copy_count(const float* src, float* dst, uint64_t n, uint64_t block, uint64_t counts[2], int num_threads) {
  counts[0] = counts[1] = 0;
  if (n == 0) return;
  const uint64_t bytes = n * sizeof(float);
  const int nt = (int)std::max<uint64_t>(1, std::min<uint64_t>(detail::resolve_threads(num_threads), bytes >> 16));
  const uint64_t blocks = (n + block - 1) / block;  // the last one may be partial
  uint64_t nonzero = 0, nonfinite = 0;
#pragma omp parallel num_threads(nt) reduction(+ : nonzero, nonfinite)
  {
    // Each thread a range of whole blocks, so that no block's count is split between two threads.
    uint64_t begin, end;
    detail::split_range(blocks, omp_get_num_threads(), omp_get_thread_num(), &begin, &end);
    begin = std::min(n, begin * block);
    end = std::min(n, end * block);
    // Chunks of about 4096 words (whole blocks): each is copied while its lines are in L1, and counted
    // with 32-bit lanes (the compiler vectorises the block-1 loop: no float comparisons, so NaN needs no
    // care).
    const uint64_t chunk = std::max<uint64_t>(1, 4096 / block) * block;
    for (uint64_t c0 = begin; c0 < end; c0 += chunk) {
      const uint64_t c1 = std::min(end, c0 + chunk);
      if (dst) std::memcpy(dst + c0, src + c0, (c1 - c0) * sizeof(float));
      uint32_t nz = 0, nf = 0;
      if (block == 1) {
        for (uint64_t i = c0; i < c1; ++i) {
          uint32_t w;
          std::memcpy(&w, src + i, sizeof w);
          nz += (w << 1) != 0;                      // not +-0.0
          nf += (w & 0x7f800000u) == 0x7f800000u;   // exponent all ones: NaN or +-Inf
        }
      } else {
        for (uint64_t b0 = c0; b0 < c1; b0 += block) {
          uint32_t any = 0;
          for (uint64_t i = b0, b1 = std::min(c1, b0 + block); i < b1; ++i) {
            uint32_t w;
            std::memcpy(&w, src + i, sizeof w);
            any |= w << 1;
            nf += (w & 0x7f800000u) == 0x7f800000u;
          }
          nz += any != 0;
        }
      }
      nonzero += nz;
      nonfinite += nf;
    }
  }
  counts[0] = nonzero;
  counts[1] = nonfinite;
}

bool pack_row_slots(const float* src, uint64_t src_rows, bool gather, const int64_t* index, uint64_t m, uint64_t row,
                    uint64_t k, float* slots) {
  if (m > k) return false;
  for (uint64_t s = 0; s < m; ++s)  // every label an int32 row index, every gathered row in src: checked first
    if (index[s] < 0 || index[s] > INT32_MAX || (gather && (uint64_t)index[s] >= src_rows)) return false;
  const uint64_t width = 1 + row;
  for (uint64_t s = 0; s < m; ++s) {
    float* slot = slots + s * width;
    const int32_t label = (int32_t)index[s];
    std::memcpy(slot, &label, sizeof label);
    std::memcpy(slot + 1, src + (gather ? (uint64_t)index[s] : s) * row, row * sizeof(float));
  }
  const int32_t unused = -1;
  for (uint64_t s = m; s < k; ++s) {
    float* slot = slots + s * width;
    std::memcpy(slot, &unused, sizeof unused);
    std::memset(slot + 1, 0, row * sizeof(float));
  }
  return true;
}

int64_t sum_row_slots(const float* slots, uint64_t n, uint64_t per_rank, uint64_t row, float* out, uint64_t keys,
                      const int64_t* stale, uint64_t stale_count, uint32_t divisor, bool count) {
  const uint64_t width = 1 + row;
  const auto index_at = [&](uint64_t r, uint64_t s) {
    int32_t i;
    std::memcpy(&i, slots + (r * per_rank + s) * width, sizeof i);
    return i;
  };
  // Every index checked before anything is written: a bad one leaves out as it was.
  std::vector<uint64_t> used(n, 0);
  for (uint64_t r = 0; r < n; ++r) {
    uint64_t m = 0;
    for (uint64_t s = 0; s < per_rank; ++s) m += index_at(r, s) >= 0;
    for (uint64_t s = 0; s < m; ++s) {
      const int32_t i = index_at(r, s);
      if (i < 0 || (uint64_t)i >= keys) return -1;
    }
    used[r] = m;
  }
  for (uint64_t j = 0; j < stale_count; ++j)
    if (stale[j] < 0 || (uint64_t)stale[j] >= keys) return -1;
  for (uint64_t j = 0; j < stale_count; ++j) std::memset(out + (uint64_t)stale[j] * row, 0, row * sizeof(float));
  std::vector<uint8_t> seen(count ? keys : 0, 0);
  int64_t union_rows = 0;
  for (uint64_t r = 0; r < n; ++r) {
    const float* rank = slots + r * per_rank * width;
    // The rows no earlier rank sent (a row a rank lists twice, which gather_slots never makes, counts
    // twice: the count the torch operations of the CUDA backend give).
    if (count)
      for (uint64_t s = 0; s < used[r]; ++s) union_rows += !seen[(uint64_t)index_at(r, s)];
    for (uint64_t s = 0; s < used[r]; ++s) {
      float* o = out + (uint64_t)index_at(r, s) * row;
      const float* v = rank + s * width + 1;
      for (uint64_t l = 0; l < row; ++l) o[l] = o[l] + v[l];
    }
    if (count)
      for (uint64_t s = 0; s < used[r]; ++s) seen[(uint64_t)index_at(r, s)] = 1;
  }
  if (count && divisor > 1) {
    const float d = (float)divisor;
    for (uint64_t r = 0; r < n; ++r)
      for (uint64_t s = 0; s < used[r]; ++s) {
        const uint64_t i = (uint64_t)index_at(r, s);
        if (!seen[i]) continue;  // divided already (an earlier rank sent it too)
        seen[i] = 0;
        float* o = out + i * row;
        for (uint64_t l = 0; l < row; ++l) o[l] = o[l] / d;
      }
  }
  return count ? union_rows : 0;
}

}  // namespace cpu
}  // namespace lhc
