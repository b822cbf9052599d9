// The lossless codec's CUDA kernels (see codec_kernels.cuh): encode, every index kind.
#pragma once

#include "codec_common.cuh"

namespace lhc {
namespace gpu {

// -------------------------------------------------------------------------------------------------
// Encode
// -------------------------------------------------------------------------------------------------

// Everything a non-zero key contributes except its values: count, index digit(s). `index_scratch`:
// Bloom: the per-cell counters; multilevel: the scratch above, whose key bit is all this sets (the
// index words follow in lhc_ml_encode_keys: inlined here, that work would cost the bitmap and Bloom
// paths of the encode kernels registers).
__device__ __forceinline__ void encode_key_index(const CodecLayout& L, uint32_t key, float* payload,
                                                 unsigned int* index_scratch, const float* pw) {
  if (L.index_kind == kIndexBitmap) {
    const uint32_t per_word = L.index.per_word;
    atomicAdd(payload + L.index_offset + key / per_word, pw[key % per_word]);
  } else if (L.index_kind == kIndexBloom) {
    const uint64_t h = key_hash(L.bloom, key);
    int weight;  // ignored: the Bloom counters add 1
#pragma unroll
    for (int j = 0; j < 3; ++j) atomicAdd(index_scratch + key_cell(L.bloom, h, j, &weight), 1u);
  } else if (L.index_kind == kIndexMultilevel) {
    atomicOr(ml_encode_key_bits(index_scratch) + key / 32, 1u << (key % 32));
  }
}

// One thread's share of a rank's index checksum (lhc_layout.h): its keys' parts summed mod p_f (each
// below 2^11, so a warp's sum fits the 32-bit warp_add), added to the counters once per warp. Integer
// sums: the result does not depend on the order.
struct IndexCheckSums {
  uint64_t stream;
  unsigned int sum[2] = {0u, 0u};
  __device__ explicit IndexCheckSums(const CodecLayout& L) : stream(index_check_stream(L.sketch.stream)) {}
  __device__ __forceinline__ void add(uint64_t key) {
    uint32_t part[2];
    index_check_parts(stream, key, part);
#pragma unroll
    for (uint32_t f = 0; f < 2; ++f) {
      sum[f] += part[f];
      if (sum[f] >= index_check_prime(f)) sum[f] -= index_check_prime(f);
    }
  }
  __device__ __forceinline__ void flush(unsigned long long* counters) const {
    warp_add(&counters[0], sum[0]);
    warp_add(&counters[1], sum[1]);
  }
};

// block == 1: one pass over x finds the non-zero keys, adds their index digits and scatters their
// weighted values w_j * v into the sketch (exact in float32: w is +-1 or +-2; the CPU backend adds
// the same (float)w * v). -0.0 counts as zero (as on the CPU). Grid-stride over 4-element groups.
extern "C" __global__ void lhc_encode_scan_b1(const uint64_t* layout, const float* x, float* payload,
                                              unsigned int* index_scratch, EncodeCounters* counters) {
  __shared__ float pw[kMaxPerWord];
  const CodecLayout L = load_layout(layout);
  load_powers(L.index, pw);
  const uint64_t n = L.numel;
  const uint32_t* bits = reinterpret_cast<const uint32_t*>(x);
  const bool aligned = (reinterpret_cast<uintptr_t>(x) & 15u) == 0;
  const uint64_t groups = (n + 3) / 4;
  float* sketch = payload + L.sketch_offset;
  float* mass = payload + mass_offset(L);
  unsigned int bad = 0;
  // Counted per thread and added once at the end: an add per loop iteration puts ~10^6 atomics on
  // one address at 1% density, which serialises in L2 and dominated the kernel (2.7 ms of 2.8 ms).
  unsigned int found = 0;
  IndexCheckSums check(L);
  for (uint64_t g = global_thread(); g < groups; g += grid_threads()) {
    uint32_t u[4];
    const uint64_t i0 = 4 * g;
    if (aligned && i0 + 4 <= n) {
      const uint4 v = __ldcs(reinterpret_cast<const uint4*>(bits) + g);
      u[0] = v.x; u[1] = v.y; u[2] = v.z; u[3] = v.w;
    } else {
#pragma unroll
      for (int e = 0; e < 4; ++e) u[e] = i0 + e < n ? bits[i0 + e] : 0u;
    }
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      bad |= (unsigned int)((u[e] & 0x7f800000u) == 0x7f800000u);
      if (u[e] << 1) {
        ++found;
        const uint32_t key = (uint32_t)(i0 + e);
        check.add(key);
        encode_key_index(L, key, payload, index_scratch, pw);
        const float value = __uint_as_float(u[e]);
        const uint64_t h = key_hash(L.sketch, key);
#pragma unroll
        for (int j = 0; j < 3; ++j) {
          int weight;
          const uint64_t cell = key_cell(L.sketch, h, j, &weight);
          atomicAdd(sketch + cell, (float)weight * value);
          // The mass channel: |w| |v| (fmaxf turns a NaN into 0, as std::max does on the CPU).
          atomicAdd(mass + cell, fabsf((float)weight) * fmaxf(0.0f, fabsf(value)));
        }
      }
    }
  }
  warp_add(&counters->keys, found);
  check.flush(counters->check);
  if (bad) atomicOr(&counters->non_finite, 1u);
}

// block > 1, pass 1: mark keys holding a non-zero coordinate (key_flag zeroed by the caller; every
// writer stores the same 1, so the race is benign), and detect NaN/Inf.
extern "C" __global__ void lhc_encode_flag_blocks(const uint64_t* layout, const float* x, unsigned int* key_flag,
                                                  EncodeCounters* counters) {
  const CodecLayout L = load_layout(layout);
  const uint32_t* bits = reinterpret_cast<const uint32_t*>(x);
  unsigned int bad = 0;
  for (uint64_t i = global_thread(); i < L.numel; i += grid_threads()) {
    const uint32_t u = __ldcs(bits + i);
    bad |= (unsigned int)((u & 0x7f800000u) == 0x7f800000u);
    if (u << 1) key_flag[i / L.block] = 1u;
  }
  if (bad) atomicOr(&counters->non_finite, 1u);
}

// block > 1, pass 2: count the flagged keys, add their index digits and their mass: |w| times the
// block's largest magnitude (fmaxf skips NaN lanes, as std::max on the CPU) into each of the
// key's three mass cells.
extern "C" __global__ void lhc_encode_keys(const uint64_t* layout, const float* x, const unsigned int* key_flag,
                                           float* payload, unsigned int* index_scratch, EncodeCounters* counters) {
  __shared__ float pw[kMaxPerWord];
  const CodecLayout L = load_layout(layout);
  load_powers(L.index, pw);
  float* mass = payload + mass_offset(L);
  unsigned int found = 0;  // one counter atomic per warp, as in lhc_encode_scan_b1
  IndexCheckSums check(L);
  for (uint64_t k = global_thread(); k < L.num_keys; k += grid_threads()) {
    const unsigned int on = key_flag[k];
    if (on) {
      check.add(k);
      encode_key_index(L, (uint32_t)k, payload, index_scratch, pw);
      const uint64_t lo = k * L.block, hi = lo + L.block < L.numel ? lo + L.block : L.numel;
      float m = 0.0f;
      for (uint64_t i = lo; i < hi; ++i) m = fmaxf(m, fabsf(x[i]));
      const uint64_t h = key_hash(L.sketch, k);
#pragma unroll
      for (int j = 0; j < 3; ++j) {
        int weight;
        const uint64_t cell = key_cell(L.sketch, h, j, &weight);
        atomicAdd(mass + cell, fabsf((float)weight) * m);
      }
    }
    found += on;
  }
  warp_add(&counters->keys, found);
  check.flush(counters->check);
}

// block > 1, pass 3: scatter every coordinate of a flagged key, times the cell's weight, into its
// three cells.
extern "C" __global__ void lhc_encode_scatter_blocks(const uint64_t* layout, const float* x,
                                                     const unsigned int* key_flag, float* payload) {
  const CodecLayout L = load_layout(layout);
  float* sketch = payload + L.sketch_offset;
  for (uint64_t i = global_thread(); i < L.numel; i += grid_threads()) {
    const uint64_t key = i / L.block;
    if (!key_flag[key]) continue;
    const float value = x[i];
    const uint64_t lane = i - key * L.block;
    const uint64_t h = key_hash(L.sketch, key);
#pragma unroll
    for (int j = 0; j < 3; ++j) {
      int weight;
      const uint64_t cell = key_cell(L.sketch, h, j, &weight);
      atomicAdd(sketch + cell * L.block + lane, (float)weight * value);
    }
  }
}

// Bloom index: pack the per-rank counters (capped at digit_cap, saturation flagged) into words,
// summing the digits in increasing order as the CPU backend does (exact: all below 2^22).
extern "C" __global__ void lhc_encode_bloom_pack(const uint64_t* layout, const unsigned int* bloom_count,
                                                 float* payload, EncodeCounters* counters) {
  __shared__ float pw[kMaxPerWord];
  const CodecLayout L = load_layout(layout);
  load_powers(L.index, pw);
  const uint64_t cells = L.bloom.cells(), words = L.index.words();
  unsigned int saturated = 0;
  for (uint64_t w = global_thread(); w < words; w += grid_threads()) {
    float acc = 0.0f;
    for (uint32_t d = 0; d < L.index.per_word; ++d) {
      const uint64_t c = w * L.index.per_word + d;
      if (c >= cells) break;
      uint32_t v = bloom_count[c];
      if (v > L.digit_cap) { v = L.digit_cap; saturated = 1; }
      acc += (float)v * pw[d];
    }
    payload[L.index_offset + w] = acc;
  }
  if (saturated) atomicOr(&counters->saturated, 1u);
}

// Multilevel index, after the keys were flagged (lhc_encode_scan_b1 / lhc_encode_keys): each non-zero
// key flags its node at every level (every writer stores the same 1: a benign race) and, a child of
// its finest node, adds its digit to that node's three cells (keys are distinct children: no dedup).
extern "C" __global__ void lhc_ml_encode_keys(const uint64_t* layout, unsigned int* index_scratch) {
  __shared__ float pw[kMaxPerWord];
  const CodecLayout L = load_layout(layout);
  load_powers(L.index, pw);
  const uint32_t levels = ml_levels(layout);
  if (levels < 1 || levels > kMaxFineLevels) return;  // a layout guard (uniform)
  const unsigned int* keys = ml_encode_key_bits(index_scratch);
  unsigned char* flags = ml_encode_flags(layout, index_scratch);
  unsigned long long* acc = ml_encode_acc(layout, index_scratch);
  const MlLevel finest = ml_level(layout, levels - 1);
  for (uint64_t word = global_thread(); word < ml_encode_key_words(layout); word += grid_threads()) {
    for (unsigned int bits = keys[word]; bits; bits &= bits - 1) {
      const uint64_t key = word * 32 + (uint64_t)(__ffs(bits) - 1);
      uint64_t first = 0;
      for (uint32_t l = 0; l < levels; ++l) {
        const uint64_t span = layout[kLwFine0Span + kLwFineStride * l];
        flags[first + key / span] = 1;
        first += (L.num_keys + span - 1) / span;
      }
      ml_add_child(finest, key / finest.span, key % finest.span, acc, pw);
    }
  }
}

// Multilevel index, after lhc_ml_encode_keys: every flagged node of every level, in one grid-stride
// pass over the flag bytes. A node of level 0 adds its coarse
// digit (1 at its position: exact float adds, the word stays below 2^22); a node of level l >= 1 is a
// child of a node of level l - 1 and adds its digit to that parent's three cells. Each node is
// flagged once however many keys it holds, as the CPU backend counts each child once.
extern "C" __global__ void lhc_ml_encode_nodes(const uint64_t* layout, unsigned int* index_scratch, float* payload) {
  __shared__ float pw[kMaxPerWord];
  const CodecLayout L = load_layout(layout);
  load_powers(L.index, pw);
  const uint32_t levels = ml_levels(layout);
  if (levels < 1 || levels > kMaxFineLevels) return;  // a layout guard (uniform)
  const unsigned char* flags = ml_encode_flags(layout, index_scratch);
  unsigned long long* acc = ml_encode_acc(layout, index_scratch);
  uint64_t total = 0;
  for (uint32_t l = 0; l < levels; ++l) total += ml_level(layout, l).nodes;
  const uint32_t per_word = L.index.per_word;
  for (uint64_t i = global_thread(); i < total; i += grid_threads()) {
    if (!flags[i]) continue;
    uint32_t l = 0;
    uint64_t node = i;
    for (uint64_t n = ml_level(layout, 0).nodes; node >= n; n = ml_level(layout, l).nodes) {
      node -= n;
      ++l;
    }
    if (l == 0) {
      atomicAdd(payload + L.index_offset + node / per_word, pw[node % per_word]);
    } else {
      const MlLevel parent = ml_level(layout, l - 1);
      ml_add_child(parent, node / parent.children, node % parent.children, acc, pw);
    }
  }
}

// Multilevel index: the fine words from their exact signed integer sums (one rounding-free conversion
// each, as the CPU backend converts its accumulators: |word| < 2^22 by the layout's sizing).
extern "C" __global__ void lhc_ml_encode_pack(const uint64_t* layout, unsigned int* index_scratch, float* payload) {
  const uint32_t levels = ml_levels(layout);
  if (levels < 1 || levels > kMaxFineLevels) return;
  const unsigned long long* acc = ml_encode_acc(layout, index_scratch);
  float* fine = payload + layout[kLwFine0Offset];
  const uint64_t n = ml_fine_numel(layout);
  for (uint64_t i = global_thread(); i < n; i += grid_threads()) fine[i] = (float)(long long)acc[i];
}

// The header fields of this rank (one thread), as lhc::cpu::encode writes them.
extern "C" __global__ void lhc_encode_header(const uint64_t* layout, float* payload, const EncodeCounters* counters) {
  if (global_thread() != 0) return;
  const CodecLayout L = load_layout(layout);
  const uint64_t keys = counters->keys;
  payload[kHdrContributors] = 1.0f;
  payload[kHdrFingerprintLo] = (float)(L.fingerprint & ((1u << kChunkBits) - 1));
  payload[kHdrFingerprintHi] = (float)(L.fingerprint >> kChunkBits);
  write_chunks(payload, kHdrKeysLo, keys);
  payload[kHdrOverloaded] = keys > L.capacity ? 1.0f : 0.0f;
  payload[kHdrNonFinite] = (float)counters->non_finite;
  payload[kHdrSaturated] = (float)counters->saturated;
  for (uint32_t f = 0; f < kIndexCheckFields; ++f)
    payload[kHdrIndexCheck0 + f] = (float)(counters->check[f] % index_check_prime(f));
}

}  // namespace gpu
}  // namespace lhc
