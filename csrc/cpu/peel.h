// Peeling a group of a segmented table: the per-cell states (PeelTable), the breadth-first peel and
// the two-key stopping sets it leaves (solve_pairs). The value sketch, the Bloom counters and the
// multilevel fine tables share them.
#pragma once

#include <cmath>
#include <cstring>
#include <limits>

#include "../lhc_ancestry.h"
#include "codec_cpu_internal.h"

namespace lhc {
namespace cpu {
namespace detail {

// The weight of a weight code (lhc::weight_of_code) and its exact inverse, by table: see
// PeelCells::weight.
constexpr double kWeights[4] = {1.0, 2.0, -1.0, -2.0};
constexpr double kInverseWeights[4] = {1.0, 0.5, -1.0, -0.5};
constexpr uint32_t kCodeMask = (1u << kWeightCodeBits) - 1;

// Peeling state of one group of a segmented table (three segments of seg_len cells; cell j*seg_len + o
// is offset o of segment j). Per cell: how many unresolved keys it holds, and the XOR of their
// records -- position in the key list and packed cells -- so that when one key is left the state
// holds that key's record and peeling needs no lookup; then the cell's `block` values. For block 1
// that is 32 bytes, one cache line for everything a cell needs.
// A packed cell is (offset << kWeightCodeBits) | weight code: below 2^32 as seg_len <= kMaxSegLen
// (checked when a layout is built).
union CellSlot {
  uint32_t word[2];  // word[0] the low half of bits (x86-64 is little-endian)
  uint64_t bits;     // the state slots, updated two words at a time
  double value;
};  // value slots are only ever used as value; state slots as word or bits (GCC defines union punning)

// The cells of a PeelTable: a pointer and two sizes, passed and kept by value, so that in the peeling
// loops they stay in registers (a table object in memory would be reloaded after every store into its
// cells, which the compiler cannot prove do not alias it).
class PeelCells {
 public:
  PeelCells(CellSlot* slots, uint64_t seg_len, uint64_t stride) : slots_(slots), seg_len_(seg_len), stride_(stride) {}
  uint64_t cells() const { return 3 * seg_len_; }
  uint32_t& deg(uint64_t c) const { return slots_[c * stride_].word[0]; }
  uint32_t& pos(uint64_t c) const { return slots_[c * stride_].word[1]; }
  uint32_t& packed(uint64_t c, int j) const { return word(c, kPackedWord + j); }
  double* values(uint64_t c) const { return &slots_[c * stride_ + kStateSlots].value; }
  // The value peel's error bound of cell c (see decode.cpp), kept in the padding half of the third
  // state slot (zeroed by clear_state, never touched by update): a float, so every store rounds up
  // (lhc::round_up_to_float, as the CUDA kernels round theirs). Negative once a key was read from the
  // cell (kReadCell) or a pair was solved from it (kPairCell), markers that `mark` stores as they are;
  // after the residual check a check cell holds its verification bound V (lhc::verification_bound).
  float acc(uint64_t c) const {
    float f;
    std::memcpy(&f, &word(c, kBoundWord), sizeof f);
    return f;
  }
  // A bound >= 0 (or NaN), rounded up; the negative one of a corrupted (negative) mass word stays
  // negative, which is all that is read of it (its cell holds no key, or the group is corrupt).
  void set_acc(uint64_t c, double bound) const {
    const float f = (float)round_up_to_float(bound);
    std::memcpy(&word(c, kBoundWord), &f, sizeof f);
  }
  void mark(uint64_t c, float marker) const {  // kReadCell or kPairCell
    std::memcpy(&word(c, kBoundWord), &marker, sizeof marker);
  }
  static constexpr float kReadCell = -1.0f;
  static constexpr float kPairCell = -2.0f;
  void clear_state(uint64_t c) const {
    for (uint64_t i = 0; i < kStateSlots; ++i) slots_[c * stride_ + i].bits = 0;
  }
  CellSlot* slots() const { return slots_; }
  uint64_t seg_len() const { return seg_len_; }
  uint64_t stride() const { return stride_; }
  // The cell a packed cell e of segment j names.
  uint64_t cell(int j, uint32_t e) const { return (uint64_t)j * seg_len_ + (e >> kWeightCodeBits); }
  // The weight a packed cell carries (+-1, +-2) and its inverse, by table: a conditional here
  // compiles to a branch that a random sign mispredicts half the time (measured with +-1 signs: 1.5
  // mispredictions per peeled key).
  static double weight(uint32_t e) { return kWeights[e & kCodeMask]; }
  static double inverse_weight(uint32_t e) { return kInverseWeights[e & kCodeMask]; }
  // The segment (0, 1, 2) of a group cell, without a branch.
  int segment(uint64_t c) const { return (int)(c >= seg_len_) + (int)(c >= 2 * seg_len_); }
  // A key's record as the state slots hold it: its position p in the high half of slot 0 (above the
  // degree), its packed cells e[3] in slots 1 and 2.
  struct Record {
    uint64_t pos, cells01;
    uint32_t cell2;
  };
  static Record record(uint32_t p, const uint32_t e[3]) {
    return {(uint64_t)p << 32, (uint64_t)e[0] | (uint64_t)e[1] << 32, e[2]};
  }
  // Put a key into cell c (delta 1) or take it out (delta -1). Integer additions and XORs commute:
  // states do not depend on the order of the updates. One 64-bit operation per slot: the degree (low
  // half) never carries into the position (high half), as it stays below 2^32 and is never
  // decremented below 0 (callers check). Slot 2 is updated in its low half only: its high half is the
  // bound (acc) the value peel has just stored into the same cell, and an 8-byte load over a 4-byte
  // store still in flight cannot take its data from the store (no store forwarding): it waits for the
  // store to reach the cache, which made this update the peel's largest stall.
  void update(uint64_t c, const Record& k, uint32_t delta) const {
    CellSlot* s = &slots_[c * stride_];
    s[0].bits = (s[0].bits ^ k.pos) + (uint64_t)(int64_t)(int32_t)delta;
    s[1].bits ^= k.cells01;
    s[2].word[0] ^= k.cell2;
  }
  // Prefetch the cell a packed cell of segment j names, clamped into the table: the packed value may
  // be a stale XOR (a cell that is no longer pure), and a prefetch needs no branch to skip it.
  void prefetch_packed(int j, uint32_t e) const {
    prefetch((uint64_t)j * seg_len_ + std::min<uint64_t>(e >> kWeightCodeBits, seg_len_ - 1));
  }
  void prefetch(uint64_t c) const {
    prefetch_line(&slots_[c * stride_]);
    if (stride_ > kStateSlots + 1) prefetch_line(&slots_[c * stride_ + stride_ - 1]);  // the last value (block > 1)
  }
  // A cell's state slots as 32-bit words: degree 0, position 1, packed cells 2 to 4, bound 5 (acc);
  // its values follow from slot kStateSlots. The AVX-512 step (peel_batch.cpp) addresses them so.
  static constexpr uint64_t kStateSlots = 3;
  static constexpr int kPackedWord = 2, kBoundWord = 5;
  uint32_t& word(uint64_t c, int w) const { return slots_[c * stride_ + w / 2].word[w % 2]; }

 private:
  CellSlot* slots_;
  uint64_t seg_len_, stride_;
};

// The storage of a group's peeling states, reused group after group.
class PeelTable {
 public:
  // Room for a group of three segments of seg_len cells with `block` values each; the cells, their
  // states not yet cleared.
  PeelCells reset(uint64_t seg_len, uint64_t block) {
    const uint64_t stride = PeelCells::kStateSlots + block;
    slots_.resize(3 * seg_len * stride);
    return PeelCells(slots_.data(), seg_len, stride);
  }

 private:
  HugeVector<CellSlot> slots_;
};

// kc[3i + j] = (offset of cell j of keys[i] in its segment << kWeightCodeBits) | its weight code, for i < count: the
// packed cells of PeelTable. A pure function of each key, written as a flat loop so the compiler can
// vectorise the 64-bit hashing; cloned for AVX-512 (64-bit multiplies in vector registers) and AVX2,
// chosen at load time.
void hash_cells(const SegmentedTable& table, const uint32_t* keys, uint32_t count, uint32_t* kc);

// group[i] = the sketch group of keys[i], for i < count; vectorised like hash_cells.
void hash_groups(const SegmentedTable& table, const uint32_t* keys, size_t count, uint32_t* group);

// cell[i] = the cell of key first + i in the first segment of its group (key_cell's j = 0), for
// i < count; vectorised like hash_groups.
void hash_first_cells(const SegmentedTable& table, uint64_t first, size_t count, uint64_t* cell);

// check[f] += sum over i < count of counts[i] * part_f(keys[i]) for f = 0, 1 (the index checksum's
// sums, lhc_layout.h index_check_parts), exactly in uint64; counts == nullptr: every count is 1.
// Vectorised like hash_groups.
void index_check_sums(uint64_t stream, const uint32_t* keys, const uint32_t* counts, size_t count,
                      unsigned long long check[kIndexCheckFields]);

// Count keys[0, count), all of one group of `table`, into the states of t (cleared before): each
// key's cells are hashed a chunk at a time (vectorised; kc is scratch) and its cells' lines are
// prefetched well ahead, as each key costs only a few instructions.
void build_states(PeelCells t, const SegmentedTable& table, const uint32_t* keys, uint32_t count,
                  std::vector<uint32_t>& kc);

// Turn per-part group histograms into write cursors: hist[p][g] becomes where part p's first key of
// group g goes (groups in order, parts in order within a group), and offsets[g] the first position of
// group g (offsets[groups] = the total). Stable bucketing of parts that cover increasing key ranges.
void histogram_to_cursors(std::vector<std::vector<uint64_t>>& hist, uint64_t groups, std::vector<uint64_t>* offsets);

// Breadth-first peeling of the keys at positions [0, count) whose states build_states put in t.
// Cells pure at the start are queued in increasing order; resolving a key queues the cells it leaves
// pure. Breadth-first order keeps each key's chain of earlier-peeled dependencies as short as the
// hypergraph allows, which bounds how far float rounding errors propagate (see
// layout.sketch_table_for).
// `resolve(pos, cell, coef)` removes the key's contribution from its cells' values; cell[0] is the
// pure cell it is read from, cell[1] and cell[2] the others (false aborts); coef[0] is the inverse of
// the key's weight in cell[0] (its value is coef[0] times that cell), coef[1] and coef[2] its weights
// in the other two. Returns the number of
// keys resolved; sets `*bad` if the states are inconsistent (a guard: states built by build_states
// are consistent whatever the payload holds).
template <typename Resolve>
uint32_t peel(PeelCells t, uint32_t count, std::vector<uint32_t>& queue, Resolve&& resolve, bool* bad) {
  const uint64_t cells = t.cells();
  // A cell enters the queue once at most: pure at the start, or when its count drops to 1 (counts
  // only decrease, and a cell pure at the start only drops to 0).
  queue.resize(cells);
  uint64_t tail = 0;
  for (uint64_t c = 0; c < cells; ++c) {
    queue[tail] = (uint32_t)c;
    tail += t.deg(c) == 1;
  }
  uint32_t resolved = 0;
  constexpr uint64_t kAhead = 8;
  for (uint64_t head = 0; head < tail; ++head) {
    // Software pipeline: load the state of the cell queued 2 * kAhead ahead; kAhead ahead, its state
    // names its key's other cells (if it is still pure then, it stays so): load those too.
    // Branch-free apart from the stale-entry test: the weights of random keys and which of its three
    // cells a key is read from are coin flips to a branch predictor.
    if (head + kAhead < tail) {
      const uint64_t c = queue[head + kAhead];
      for (int j = 0; j < 3; ++j) t.prefetch_packed(j, t.packed(c, j));
      if (head + 2 * kAhead < tail) t.prefetch(queue[head + 2 * kAhead]);
    }
    const uint64_t c = queue[head];
    if (t.deg(c) != 1) continue;  // its last key was resolved through another cell meanwhile
    const uint32_t pos = t.pos(c);
    const uint32_t e[3] = {t.packed(c, 0), t.packed(c, 1), t.packed(c, 2)};
    const uint64_t cell[3] = {t.cell(0, e[0]), t.cell(1, e[1]), t.cell(2, e[2])};
    const int pure = t.segment(c);  // the key's cell in c's segment is c, if the state is consistent
    if (cell[pure] != c || pos >= count) { *bad = true; return resolved; }
    // The pure cell first, then the other two in their order (which fixes the queue order).
    const int j1 = (int)(pure == 0), j2 = 2 - (int)(pure == 2);
    const uint64_t ordered[3] = {c, cell[j1], cell[j2]};
    const double coef[3] = {PeelCells::inverse_weight(e[pure]), PeelCells::weight(e[j1]), PeelCells::weight(e[j2])};
    if (!resolve(pos, ordered, coef)) return resolved;
    ++resolved;
    // The pure cell is left with no key; nothing reads its state again (it is dequeued already).
    const PeelCells::Record k = PeelCells::record(pos, e);
    for (int j = 1; j < 3; ++j) {
      const uint64_t d = ordered[j];
      if (t.deg(d) == 0) { *bad = true; return resolved; }
      t.update(d, k, (uint32_t)-1);
      queue[tail] = (uint32_t)d;
      tail += t.deg(d) == 1;
    }
  }
  return resolved;
}

// Layered peeling (the value sketch): layer 0 is the keys alone in some cell at the start, layer L + 1
// the keys alone in some cell once the layers up to L are removed. A key is read from the
// lowest-numbered of its cells that are pure at the start of its layer, and the keys of a layer are
// resolved in increasing position. This is exactly what the CUDA kernels' rounds do (lhc_peel_values:
// every pure cell proposes its key, which keeps the smallest proposing cell; the touched cells subtract
// the round's keys in increasing position), so both backends read every key from the same cell and
// round every cell in the same order: the same values, bounds and verdicts, bit for bit. (A FIFO queue
// would read a key from whichever of its cells became pure first.) Within a layer keys do not depend
// on each other: a key's pure cell holds no other key.
// `resolve` is peel's; `order` gets the cells keys were read from, in the order they were resolved
// (the backward pass of the verification bound walks it in reverse). cur holds t.cells() entries, the
// first pure_n of them the cells pure at the start (degree 1) in increasing order, which the caller
// lists in a pass over the cells it makes anyway; after that cur, next, layer, src and bits are
// scratch. Returns the number of keys resolved; sets `*bad` if the states are inconsistent.
// `batch(entries, order, next, &appended)` may resolve kBatch consecutive keys of a layer at once:
// entries holds their (position, read cell) pairs in increasing position. It either declines
// (false), having changed nothing, or does exactly what resolve and the state updates would do for
// them in that order, appends their read cells to order and the cells they leave pure to next
// (`appended` of them, in any order: the next layer's proposals do not depend on it), and returns
// true. A batch that declines is resolved key by key.
constexpr size_t kBatch = 8;
template <typename Resolve, typename Batch>
uint32_t peel_layers(PeelCells t, uint32_t count, std::vector<uint32_t>& cur, uint64_t pure_n,
                     std::vector<uint32_t>& next, std::vector<uint32_t>& layer, std::vector<uint32_t>& src,
                     std::vector<uint64_t>& bits, std::vector<uint32_t>& order, Resolve&& resolve, Batch&& batch,
                     bool* bad) {
  constexpr uint32_t kNone = std::numeric_limits<uint32_t>::max();
  const uint64_t cells = t.cells();
  // cur[0, cur_n) and next[0, next_n): a cell is queued once at most (pure at the start, or when its
  // count drops to 1), so `cells` entries suffice. Appends are branch-free (store, then advance by the
  // test): whether a cell is left pure is a coin flip to a branch predictor, and a misprediction
  // there, resolved only when the cell's state arrives from memory, serialises the keys.
  // A key joins one layer and is resolved once: `count` entries suffice for order, and `count` pairs
  // (position, read cell) for layer. The arrays are used through local pointers, which no store can
  // change (a vector's would be reloaded after every store into the cells), and stores by index (a
  // push_back is a call kept out of line).
  next.resize(cells);
  src.assign(count, kNone);
  bits.assign(((uint64_t)count + 63) / 64, 0);
  layer.resize(2 * (uint64_t)count);
  order.resize(count);
  uint32_t *cur_p = cur.data(), *next_p = next.data();
  uint32_t* const layer_p = layer.data();
  uint32_t* const src_p = src.data();
  uint64_t* const bits_p = bits.data();
  uint32_t* const order_p = order.data();
  uint64_t cur_n = pure_n, next_n = 0, order_n = 0;
  uint32_t resolved = 0;
  const auto done = [&] {
    order.resize(order_n);
    return resolved;
  };
  constexpr size_t kAhead = 8;
  while (cur_n > 0) {
    // A: every cell pure at the start of the layer proposes its key; the key keeps the smallest.
    uint32_t lo = kNone, hi = 0;
    for (size_t i = 0; i < cur_n; ++i) {
      // Two stages, as in B: the cell 2 * kAhead ahead; kAhead ahead, its position's entry of src
      // (random in a per-key array; clamped, as a stale cell's position is an XOR of several).
      if (i + 2 * kAhead < cur_n) t.prefetch(cur_p[i + 2 * kAhead]);
      if (i + kAhead < cur_n) prefetch_line(&src_p[std::min(t.pos(cur_p[i + kAhead]), count - 1)]);
      const uint32_t c = cur_p[i];
      if (t.deg(c) != 1) continue;  // its last key went with another cell in the layer before
      const uint32_t pos = t.pos(c);
      const int j = t.segment(c);
      if (pos >= count || t.cell(j, t.packed(c, j)) != c) { *bad = true; return done(); }
      bits_p[pos / 64] |= 1ull << (pos % 64);  // again for a key's second pure cell: no branch
      src_p[pos] = std::min(src_p[pos], c);
      lo = std::min(lo, pos);
      hi = std::max(hi, pos);
    }
    uint64_t layer_n = 0;
    if (lo != kNone)
      for (uint64_t w = lo / 64; w <= hi / 64; ++w) {
        // The layer's keys with their read cells (src in increasing position: a sequential walk), so
        // that B reads each once; the word is cleared for the next layer.
        for (uint64_t b = bits_p[w]; b; b &= b - 1) {
          const uint32_t p = (uint32_t)(w * 64 + __builtin_ctzll(b));
          layer_p[2 * layer_n] = p;
          layer_p[2 * layer_n + 1] = src_p[p];
          ++layer_n;
        }
        bits_p[w] = 0;
      }
    // B and C: the layer's keys in increasing position, each read from its cell and subtracted from
    // its other two (queued for the next layer when left with one key). Eight keys at a time go to
    // `batch` first, which either resolves them all (as `step` would, key after key) or declines.
    next_n = 0;
    const auto prefetch_for = [&](size_t i) {
      // Two stages: the read cell 2 * kAhead keys ahead (in position order, i.e. a random cell);
      // kAhead ahead, its state (in cache by then) names the key's other two cells: load those.
      if (i + 2 * kAhead < layer_n) t.prefetch(layer_p[2 * (i + 2 * kAhead) + 1]);
      if (i + kAhead < layer_n) {
        // Not clamped (unlike peel's): a key's read cell is pure from the start of its layer until
        // it is resolved (no other key of the layer touches it), so its state names real cells.
        const uint32_t a = layer_p[2 * (i + kAhead) + 1];
        for (int j = 0; j < 3; ++j) t.prefetch(t.cell(j, t.packed(a, j)));
      }
    };
    const auto step = [&](size_t i) {
      const uint32_t pos = layer_p[2 * i];
      const uint64_t c = layer_p[2 * i + 1];
      const uint32_t e0 = t.packed(c, 0), e1 = t.packed(c, 1), e2 = t.packed(c, 2);
      const int pure = t.segment(c);
      // The other two segments in order, j1 < j2, and the packed cells there: masks, not an array indexed
      // by a coin flip (which goes through memory), nor conditional expressions (GCC made them branches,
      // which the coin flip mispredicts: ~0.7 per key).
      const int j1 = (int)(pure == 0), j2 = 2 - (int)(pure == 2);
      const uint32_t m0 = 0u - (uint32_t)(pure == 0), m2 = 0u - (uint32_t)(pure == 2), m1 = ~(m0 | m2);
      const uint32_t e_pure = (e0 & m0) | (e1 & m1) | (e2 & m2);
      const uint32_t e_j1 = (e1 & m0) | (e0 & ~m0), e_j2 = (e1 & m2) | (e2 & ~m2);
      const uint32_t e[3] = {e0, e1, e2};
      const uint64_t ordered[3] = {c, t.cell(j1, e_j1), t.cell(j2, e_j2)};
      const double coef[3] = {PeelCells::inverse_weight(e_pure), PeelCells::weight(e_j1), PeelCells::weight(e_j2)};
      if (!resolve(pos, ordered, coef)) return false;
      ++resolved;
      order_p[order_n++] = (uint32_t)c;
      const PeelCells::Record k = PeelCells::record(pos, e);
      for (int j = 1; j < 3; ++j) {
        const uint64_t d = ordered[j];
        if (t.deg(d) == 0) { *bad = true; return false; }
        t.update(d, k, (uint32_t)-1);
        next_p[next_n] = (uint32_t)d;
        next_n += t.deg(d) == 1;
      }
      return true;
    };
    for (size_t i = 0; i < layer_n;) {
      const size_t n = std::min<size_t>(kBatch, layer_n - i);
      for (size_t k = 0; k < n; ++k) prefetch_for(i + k);
      uint64_t appended;
      if (n == kBatch && batch(&layer_p[2 * i], order_p + order_n, next_p + next_n, &appended)) {
        resolved += kBatch;
        order_n += kBatch;
        next_n += appended;
      } else {
        for (size_t k = 0; k < n; ++k)
          if (!step(i + k)) return done();
      }
      i += n;
    }
    std::swap(cur_p, next_p);
    cur_n = next_n;
  }
  return done();
}

// What the value peel's per-key step writes besides the table (decode.cpp): each key's error bound
// and value by position, and whether it checks rtol now.
struct ValueBatchOut {
  double* key_err;
  float* gvals;
  double rtol;
  bool check_now;
};

// Whether value_peel_batch8 can run on table t with `count` keys: the step is on
// (codec_cpu.h value_peel_batch_on), the selected CPU copy is AVX-512 (thc_cpu_isa() "x86-64-v4", which
// LHC_CPU_ISA and thc_set_cpu_isa choose for THC's kernels and this step alike), a block of one
// value, and indices that fit 32 bits.
bool value_peel_batch8_available(PeelCells t, uint32_t count);

// peel_layers' `batch` for the value sketch with a block of one value (peel_batch.cpp): the eight keys
// of `entries` resolved at once, exactly as decode.cpp's per-key step and the state updates would,
// key after key: the same bits. Declines (false, nothing changed) when two of the keys share a cell
// or a cell they subtract from holds no key. inexact_lanes: the lanes (keys) failing rtol, when
// out.check_now.
bool value_peel_batch8(PeelCells t, const uint32_t* entries, const ValueBatchOut& out, uint32_t* order, uint32_t* next,
                       uint64_t* appended, uint32_t* inexact_lanes);

// The value peel's verification bounds for a completely peeled group (decodes with verify; after the
// residual check, which left each check cell's V in its acc): keys in `order` (their read cells, as
// peel_layers gives them) walked back, each key's G(k) from its two other cells -- a check cell's V, or
// |w| G(m) of the later key m read from it -- counting only cells that verify it soundly
// (lhc_ancestry.h), and the key's position appended to `inexact` unless both E(k) (key_err) and
// F(k) = G(k) - E(k) prove every value within rtol (lhc::verification_bound). verify.cpp.
struct VerifyScratch {
  // A key's ancestry: its size (kTooLarge: over kAncestryCap keys) and its roots, where in root_arena
  // and how many (at most kAncestryCap roots per key, so root_at < 2^32 for any group).
  struct Ancestry {
    uint32_t root_at;
    uint16_t size, roots;
    static constexpr uint16_t kTooLarge = 0xffff;  // > kAncestryCap
  };
  std::vector<Ancestry> ancestry;
  std::vector<uint32_t> kc, offsets, cursor, members, read, root_arena, merged, next;
  std::vector<uint8_t> unsound;  // bit j: the key's cell in segment j cannot verify it
  std::vector<double> kver;
  AncestrySet walk;  // the few ancestries that are walked
  VerifyScratch() { walk.init(); }
};
void verify_group(PeelCells t, const SegmentedTable& table, const uint32_t* keys, uint32_t count, uint64_t block,
                  const std::vector<uint32_t>& order, const double* key_err, double rtol, VerifyScratch& s,
                  std::vector<uint32_t>& inexact);

// The two-key stopping sets left when peeling stalls: two unresolved keys a < b (positions) that
// share all three cells, each cell holding just the two of them. Cell j holds
// R_j = w_j(a) v_a + w_j(b) v_b; two of the cells solve the pair as lhc::pair_cells states (one
// subtraction and one division, about as exact as reading a pure cell). A pair whose weight ratios
// w_j(a) / w_j(b) agree in all three cells (5/128 of them) is unsolvable and stays unresolved.
// `solve(pos_a, pos_b, cells, wa, wb, va, vb)` receives each solved pair (its cells, its keys'
// weights there, its values), in increasing order of its cell in the group's first segment; the
// states are left as they are (the pair's cells are not read again). The value sketch and the
// multilevel fine tables (signed integer patterns, checked by their caller) share it.
// Runs only after a stalled peel: it hashes every key of the group once. Returns the keys solved.
template <typename Solve>
uint32_t solve_pairs(PeelCells t, const SegmentedTable& table, const uint32_t* keys, uint32_t count, uint64_t block,
                     std::vector<uint32_t>& kc, Solve&& solve) {
  const uint64_t seg_len = t.cells() / 3;
  // Candidate cells of the first segment: two keys left, and the XOR of their packed cells names the
  // same offset in every segment (only the weight codes may differ).
  std::vector<char> candidate(seg_len, 0);
  bool any = false;
  for (uint64_t o = 0; o < seg_len; ++o) {
    if (t.deg(o) != 2) continue;
    bool same = true;
    for (int j = 0; j < 3; ++j) same &= (t.packed(o, j) >> kWeightCodeBits) == 0;
    candidate[o] = same;
    any |= same;
  }
  if (!any) return 0;
  // Every key whose first cell is a candidate, peeled or not, by cell then position. A peeled key
  // never has the same three cells as an unresolved one (it could not have been alone in any of
  // them), so within a cell the pair is the two keys with equal cells whose positions XOR to the
  // state's.
  kc.resize(3 * (uint64_t)count);
  hash_cells(table, keys, count, kc.data());
  std::vector<std::pair<uint32_t, uint32_t>> members;  // (first cell, position)
  for (uint32_t p = 0; p < count; ++p) {
    const uint32_t first = kc[3 * (uint64_t)p] >> kWeightCodeBits;
    if (candidate[first]) members.emplace_back(first, p);
  }
  std::sort(members.begin(), members.end());
  uint32_t solved = 0;
  std::vector<double> va(block), vb(block);
  for (size_t i = 0; i < members.size();) {
    size_t e = i;
    while (e < members.size() && members[e].first == members[i].first) ++e;
    const uint64_t o = members[i].first;
    for (size_t x = i; x < e; ++x)
      for (size_t y = x + 1; y < e; ++y) {
        const uint32_t a = members[x].second, b = members[y].second;
        if ((a ^ b) != t.pos(o)) continue;
        const uint32_t* ea = &kc[3 * (uint64_t)a];
        const uint32_t* eb = &kc[3 * (uint64_t)b];
        uint64_t cell[3];
        bool pair = true;
        for (int j = 0; j < 3; ++j) {
          cell[j] = t.cell(j, ea[j]);
          pair &= (ea[j] >> kWeightCodeBits) == (eb[j] >> kWeightCodeBits) && t.deg(cell[j]) == 2 &&
                  t.pos(cell[j]) == (a ^ b);
        }
        if (!pair) continue;
        int wa[3], wb[3];
        for (int j = 0; j < 3; ++j) {
          wa[j] = weight_of_code(ea[j] & kCodeMask);
          wb[j] = weight_of_code(eb[j] & kCodeMask);
        }
        const PairCells pc = pair_cells(wa, wb);
        if (pc.det == 0) continue;  // proportional weights: unsolvable
        const double* Rp = t.values(cell[pc.p]);
        const double* Rq = t.values(cell[pc.q]);
        const double det = pc.det;
        const double wap = wa[pc.p], waq = wa[pc.q], wbp = wb[pc.p], wbq = wb[pc.q];
        for (uint64_t l = 0; l < block; ++l) {
          va[l] = (wbq * Rp[l] - wbp * Rq[l]) / det;
          vb[l] = (wap * Rq[l] - waq * Rp[l]) / det;
        }
        for (int j = 0; j < 3; ++j) t.deg(cell[j]) = 0;
        solve(a, b, cell, wa, wb, va.data(), vb.data());
        solved += 2;
      }
    i = e;
  }
  return solved;
}

}  // namespace detail
}  // namespace cpu
}  // namespace lhc
