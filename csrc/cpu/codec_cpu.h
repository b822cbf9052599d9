// CPU (OpenMP) kernels of the lossless codec. Raw pointers and sizes only: no framework types.
#pragma once

#include <cstdint>
#include <vector>

#include "../lhc_layout.h"
#include "../lhc_status.h"

namespace lhc {
namespace cpu {

struct EncodeStats {
  uint64_t keys = 0;       // non-zero keys found in the input
  uint32_t non_finite = 0; // 1 if the input held NaN or Inf
  uint32_t saturated = 0;  // 1 if an index digit of this rank was capped
};

// Encode `x` (layout.numel floats) into `payload` (layout.payload_numel floats, overwritten).
// Writes the header fields that depend on the input; deterministic for a given input.
EncodeStats encode(const CodecLayout& layout, const float* x, float* payload, int num_threads);

// DecodeStatus: lhc_status.h (one list for CPU, CUDA and Python).

struct DecodeStats {
  int32_t status = kDecodeOk;
  uint64_t candidates = 0;       // keys the index could not rule out
  uint64_t false_positives = 0;  // candidates whose exact aggregated count is 0 (Bloom only)
  uint64_t support_keys = 0;     // keys non-zero on at least one rank
  uint64_t peeled = 0;           // support keys recovered by peeling
  uint64_t index_total = 0;      // sum of the decoded index digits
  // The decoded support's index checksum sums: sum over its keys of count(k) * part_f(k)
  // (lhc_layout.h index_check_parts), compared with the header's (index_check_matches).
  unsigned long long index_check[kIndexCheckFields] = {0, 0};
  std::vector<uint64_t> inexact_keys;  // keys whose error bound exceeds rtol (status kDecodeInexact), sorted
};

// Inputs of decode that come from the (already validated) header.
struct DecodeInputs {
  double scale;          // multiply payload fields by this to get sums (n if averaged, else 1)
  uint64_t total_keys;   // sum over ranks of their non-zero key counts
  uint64_t world_size;
  double rtol;           // the relative tolerance a key's error bound must meet (else kDecodeInexact)
  bool verify = false;   // also the verification bound (lhc::verification_bound): corrupted cells are
                         // caught or their keys listed inexact; solved pairs are always inexact
};

// Where decode puts each support key's error bound E(k) (decode.cpp): keys[i] and bounds[i] for the
// i-th support key in the decoder's order (by sketch group, not sorted), i < support_keys, written
// only when support_keys <= capacity. A key of a group that was not peeled completely gets NaN.
struct KeyBounds {
  int64_t* keys;
  double* bounds;
  uint64_t capacity;
};

// Decode an aggregated payload into `out` (layout.numel floats, overwritten: zeros outside the
// recovered support). `trace_key`/`trace_cell` (may be null) receive, in peeling order, the key
// peeled and the cell it was read from; they must hold layout.num_keys entries. `key_bounds` (may be
// null) receives the keys' error bounds.
DecodeStats decode(const CodecLayout& layout, const DecodeInputs& in, const float* payload, float* out,
                   int64_t* trace_key, int64_t* trace_cell, const KeyBounds* key_bounds, int num_threads);

// decode keeps its working memory per thread for the next decode (docs/DESIGN.md, "The CPU decoder keeps
// its working memory"). This frees what the calling thread kept and what its OpenMP pool's threads kept
// (those of a team as large as any decode ran); other threads' stays theirs.
void release_decoder_memory();

// present[r] = 1 if row r of the `rows` x `row` matrix x (contiguous, elements of element_bytes = 2, 4 or 8:
// float16/bfloat16, float32, float64) holds an element that is not +-0.0 (NaN and infinities count), else
// 0. Reads x once; bits independent of the thread count. Returns how many rows are present.
uint64_t nonzero_rows(const void* x, uint64_t rows, uint64_t row, int element_bytes, uint8_t* present,
                      int num_threads);

// index[0, m) = the rows r < `rows` with present[r] (uint8 flags, 0 or 1) not 0, increasing; m is their
// number (nonzero_rows' count), for which the caller sized index.
void present_row_index(const uint8_t* present, uint64_t rows, int64_t* index);

// The dense index's body: dst[i] = src[i] for i < n (dst may be null: counting only), counts[0] = the
// keys (blocks of `block` >= 1 elements, the last one partial where block does not divide n) holding an
// element that is not +-0.0, and counts[1] = the elements that are not finite (NaN, +-Inf). One read of
// src; the counts are independent of the thread count.
void dense_copy_count(const float* src, float* dst, uint64_t n, uint64_t block, uint64_t counts[2],
                      int num_threads);

// A rank's allgather slots (lossless_hc/training/rows.py, the backends' row_slots): k slots of 1 + row floats,
// slot s < m the bits of int32 index[s], then the row's values: src row index[s] (gather: src holds src_rows
// rows) or src row s (not gather); slots m to k - 1 the bits of -1 and zeros. False, with nothing written,
// when m > k or a label is not an int32 row index (a gathered one in [0, src_rows)).
bool pack_row_slots(const float* src, uint64_t src_rows, bool gather, const int64_t* index, uint64_t m, uint64_t row,
                    uint64_t k, float* slots);

// The allgather strategy's gathered rows summed into a dense table (lossless_hc/training/rows.py
// sum_slots_dense): slots holds n ranks' per_rank slots of 1 + row floats, an int32 row index in the first
// word's bits (-1: unused; a rank's used slots come first) and that row's values. The rows stale[0,
// stale_count) of out (keys x row floats) are set to +0.0, then each rank's used slots are added into
// their rows, rank 0 first: out[i] = ((out[i] + v_0) + v_1) + ..., the order torch's index_add_ adds
// them in rank by rank. With `count`, returns the rows some rank sent (each counted by the first rank
// that sent it) and, if divisor > 1, divides just those rows by it (float32 division, the bits of
// dividing the whole table, whose other rows hold +-0.0); without, returns 0 and divides nothing.
// Returns -1, out untouched, where a used slot or a stale row names a row outside [0, keys).
int64_t sum_row_slots(const float* slots, uint64_t n, uint64_t per_rank, uint64_t row, float* out, uint64_t keys,
                      const int64_t* stale, uint64_t stale_count, uint32_t divisor, bool count);

// The two-phase counting bitmap (lossless_hc/training/rows.py): rows r < P.digits as digits of base P.base,
// P.per_word to a float32 word (digit r % per_word of word r / per_word), 1 at a row a rank holds, so that
// the float32 sum of n <= base - 1 ranks' bitmaps holds in each digit how many ranks hold the row.
// bitmap_pack_present: from present[r] (non-zero: held); bitmap_pack_index: from the rows index[0,
// count) (any order; a row listed twice counts once), false (words unwritten) if one is outside
// [0, P.digits). Both write all P.words() words.
void bitmap_pack_present(const uint8_t* present, const DigitPacking& P, float* words, int num_threads);
bool bitmap_pack_index(const int64_t* index, uint64_t count, const DigitPacking& P, float* words);

// Reading a summed bitmap: masks[w] (P.words() of them) gets bit j set iff digit j of words[w] * scale is
// not zero; returns how many bits are set, or -1 if a word is not a packed integer in [0, base^per_word)
// (digits.h word_integers: scale 1, a SUM, must be an integer; an AVERAGE times n is rounded) or the last
// word has a non-zero digit past P.digits. bitmap_mask_rows then writes the rows of the set bits, in
// increasing order, to rows (as many as bitmap_masks counted).
int64_t bitmap_masks(const float* words, const DigitPacking& P, double scale, uint32_t* masks, int num_threads);
void bitmap_mask_rows(const uint32_t* masks, const DigitPacking& P, int64_t* rows, int num_threads);

// The value peel's eight-key AVX-512 step (peel_batch.cpp; the same bits as key by key, at another speed):
// value_peel_batch_set("on" | "off" | "default") -- default: LHC_PEEL_BATCH ("on"/"off") if set, else on
// for CPUs that are not AMD's (peel_batch.cpp says why); false for any other request.
// value_peel_batch_on: whether it is on now (it runs only while THC's x86-64-v4 copy is selected).
bool value_peel_batch_set(const char* request);
bool value_peel_batch_on();

// Ask the kernel to back the whole 2 MiB pages inside [p, p + bytes) with transparent huge pages
// (Linux, where THP is enabled for "madvise" or "always"; elsewhere a no-op). For memory not touched
// yet: its first write then takes one page fault per 2 MiB instead of one per 4 KiB -- most of the
// cost of writing a fresh output of hundreds of MiB -- and random accesses miss the TLB far less.
void advise_huge_pages(void* p, uint64_t bytes);

}  // namespace cpu
}  // namespace lhc
