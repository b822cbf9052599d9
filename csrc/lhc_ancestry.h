// Which cells may verify a key: the soundness rule of the value peel's verification bound (decodes
// with verify only; lhc_layout.h verification_bound). The CUDA kernel lhc_verify_values walks
// ancestries with the functions below; the CPU decoder (cpu/verify.cpp) keeps each key's ancestry
// size and roots, built once per key in peel order (walking the few it cannot count); the reference
// (reference_peel.verification_bound) keeps Python sets.
//
// A key's parents are the other keys of the cell it was read from (all subtracted there before it was
// read); its ancestry is itself and, transitively, its parents. A corrupted value word in the read cell
// of a key a changes exactly the keys whose ancestry holds a. A cell j that k was subtracted into
// bounds k's error only if no other key of j (k and j's reader aside) changed with it: otherwise their
// errors arrive at j together and may cancel there (issue #19's two-path case: a key subtracted into
// both k's read cell and the cell checking k). So j verifies k only if no other key of j shares an
// ancestor with k. The reader m of j always has k in its ancestry; what j tells about k then passes
// through G(m), which m's own cells proved under the same rule (they hold no other key sharing an
// ancestor with m, hence none with k).
//
// The test is exact for ancestries of at most kAncestryCap keys; a larger one counts as sharing an
// ancestor with every key (so does a key of a solved pair, whose two cells give it with its partner).
// A set semantics: the result does not depend on the order keys are visited in, so the backends
// (positions per group on the CPU, over the whole support on CUDA) decide the same.
#pragma once

#include "lhc_layout.h"

namespace lhc {

constexpr uint32_t kAncestryCap = 256;  // reference_peel.ANCESTRY_CAP

// A set of at most kAncestryCap + 1 key positions in fixed arrays (a CUDA thread's local memory): open addressing, half full at most, items kept in insertion order so a
// breadth-first walk can use them as its queue, and their slots so that clear() touches no more.
struct AncestrySet {
  static constexpr uint32_t kSlotBits = 9;
  static constexpr uint32_t kSlots = 1u << kSlotBits;  // > 2 (kAncestryCap + 1)
  uint32_t slot[kSlots];                               // position + 1; 0: empty
  uint32_t item[kAncestryCap + 1];
  unsigned short where[kAncestryCap + 1];  // (no <cstdint> types beyond lhc_layout.h's under NVRTC)
  uint32_t size;

  LHC_HD void init() {
    for (uint32_t i = 0; i < kSlots; ++i) slot[i] = 0;
    size = 0;
  }
  LHC_HD void clear() {
    for (uint32_t i = 0; i < size; ++i) slot[where[i]] = 0;
    size = 0;
  }
  LHC_HD static uint32_t home(uint32_t p) { return (p * 0x9E3779B1u) >> (32 - kSlotBits); }
  LHC_HD bool contains(uint32_t p) const {
    for (uint32_t s = home(p);; s = (s + 1) & (kSlots - 1)) {
      if (slot[s] == 0) return false;
      if (slot[s] == p + 1) return true;
    }
  }
  // Adds p (size < kAncestryCap + 1); false if it was there.
  LHC_HD bool insert(uint32_t p) {
    uint32_t s = home(p);
    for (; slot[s] != 0; s = (s + 1) & (kSlots - 1))
      if (slot[s] == p + 1) return false;
    slot[s] = p + 1;
    item[size] = p;
    where[size] = (unsigned short)s;
    ++size;
    return true;
  }
};

enum AncestryWalk : int { kAncestryDisjoint = 0, kAncestryMeets = 1, kAncestryTooLarge = 2 };

// The ancestry of key k into s (cleared first), breadth first. `dag` gives a key's parents:
// dag.parents(p, &begin, &end) is false for a key with no read cell (a solved pair's), else the
// range of its read cell's adjacency, whose entries dag.member(e) names (p among them). With `other`
// (a complete ancestry) the walk stops at the first key in it: kAncestryMeets. kAncestryTooLarge once
// s would exceed kAncestryCap keys (or at a key with no read cell); else kAncestryDisjoint.
template <class Dag>
LHC_HD int walk_ancestry(const Dag& dag, uint32_t k, AncestrySet& s, const AncestrySet* other) {
  s.clear();
  s.insert(k);
  if (other && other->contains(k)) return kAncestryMeets;
  for (uint32_t head = 0; head < s.size; ++head) {
    const uint32_t p = s.item[head];
    uint64_t begin, end;
    if (!dag.parents(p, &begin, &end)) return kAncestryTooLarge;
    for (uint64_t e = begin; e < end; ++e) {
      const uint32_t q = dag.member(e);
      if (q == p || !s.insert(q)) continue;
      if (other && other->contains(q)) return kAncestryMeets;
      if (s.size > kAncestryCap) return kAncestryTooLarge;
    }
  }
  return kAncestryDisjoint;
}

// Whether cell d (holding keys dag.member(e) for e in [begin, end)) may verify key k: none of its keys
// other than k and `reader` (d's reader, or any value that is no position) shares an ancestor with k.
// k's ancestry is walked into `mine` once per key, on the first cell that needs it (*mine_state: 0
// not yet, then the walk's result); `scratch` holds the other keys' walks.
template <class Dag>
LHC_HD bool verifies_soundly(const Dag& dag, uint32_t k, uint64_t begin, uint64_t end, uint32_t reader,
                             AncestrySet& mine, int* mine_state, AncestrySet& scratch) {
  for (uint64_t e = begin; e < end; ++e) {
    const uint32_t i = dag.member(e);
    if (i == k || i == reader) continue;
    if (*mine_state == 0) *mine_state = 1 + walk_ancestry(dag, k, mine, (const AncestrySet*)nullptr);
    if (*mine_state != 1 + kAncestryDisjoint) return false;
    if (walk_ancestry(dag, i, scratch, &mine) != kAncestryDisjoint) return false;
  }
  return true;
}

}  // namespace lhc
