r"""Cost model: which index (dense, bitmap, Bloom, multilevel) and which sizes, per tensor.

Every rank calls :func:`choose` with the same arguments (numel, world size, block size, capacity,
expected aggregate support), and it is a pure function of them, so every rank picks the same layout
and payload shapes always match. It minimises wire bytes subject to the failure-probability bounds
that :mod:`lossless_hc.lhc.layout` builds every table with (``PEEL_FAILURE_TARGET`` = 1e-3 per table for
peeling, ``SATURATION_TARGET`` for Bloom counters, ``FINE_OVERFLOW_TARGET`` for multilevel words). A
failure is never silent: decode reports it and the plugins fall back to an exact dense aggregation.

What the wire carries, for ``d`` keys (blocks of ``b`` coordinates), ``n`` ranks, ``u`` keys
non-zero in the aggregate (density ``p = u/d``)::

    header    9 words
    index     dense: none | bitmap: d digits of base n+1 | bloom: counting Bloom filter |
              multilevel: d/G coarse digits + fine table of ~1.25 M cells x words_per_group words
    sketch    ~1.25 u cells of b floats (none for dense, which sends the d*b floats themselves)

The information bound
---------------------
A decoder that recovers the aggregate exactly must learn *which* ``u`` of the ``d`` keys are
non-zero and their values. There are :math:`\binom{d}{u}` supports, so any encoding needs
:math:`\log_2\binom{d}{u}` bits for the support, and with values that are arbitrary float32 numbers
:math:`32 u b` bits for the values (no redundancy to exploit without a value model):

.. math:: B(d, u) = \log_2 \binom{d}{u} + 32\,u\,b \;\approx\; u \left(\log_2 \frac{d}{u} + \log_2 e\right) + 32 u b
   \quad (u \ll d).

(The benchmark, ``python -m lossless_hc.bench wire``, states the bound over coordinates,
:math:`\log_2\binom{d b}{u b} + 32 u b`, which for b > 1 is looser than the block form above.)

What keeps a summable code above the bound
------------------------------------------
1. **Exact integer fields cost 32 bits per 22.** A payload word is a float32 that every engine sums
   (ring, parameter server, switch) and may average. Sums of integers are exact and an average is
   invertible only below :math:`2^{22}` (``layout.INT_FIELD_BITS``), so an integer field carries at
   most 22 bits per 32 sent: a factor 32/22 = 1.45 on every index bit.
2. **Summable counters need** :math:`\log_2(n+1)` **bits.** Ranks cannot OR, only add: a key's
   aggregate indicator is a count in ``0..n`` (the number of ranks holding it), so a per-key counter
   needs base ``n + 1``. The counting bitmap therefore costs :math:`\frac{32}{\lfloor 22/\log_2(n+1)\rfloor}`
   bits per *key* (n = 2: 2.46, n = 16: 6.4, n = 64: 10.7), i.e. that divided by ``p`` per
   non-zero, against :math:`\log_2(1/p) + 1.44` in the bound: the bitmap is near the bound only where
   :math:`p` is large. Any exact summable index pays at least :math:`\log_2 n` extra bits per
   non-zero over the bound in the worst case, because the sum exposes multiplicities.
3. **The value sketch needs ~1.23 float32 cells per key.** Peeling a 3-hash count sketch succeeds
   w.h.p. only above the 3-hypergraph 2-core threshold (1.222 cells per key); with the finite-size
   margins of ``sizing.sketch_table_for`` it is ~1.25 + 3/sqrt(u) cells. Values alone thus cost
   ``>= 1.23 * 32 = 39.1`` bits per non-zero (block 1) against 32 in the bound: a floor of
   1.22x on the value part, whatever the index. For block ``b`` the factor applies to ``32 b`` bits,
   and the index is paid once per block, so blocks approach 1.25x of the bound.
   Below a few thousand keys the threshold is not what sizes the sketch: two keys sharing all
   three cells (probability ~13.5 u^2 / cells^3) cannot be peeled. The decoder solves such a pair
   unless its weight ratios agree in all three cells: a quarter of them with +-1 signs, 5/128 with
   the weights +-1, +-2 of small sketches (``sizing.sketch_table_for``), which then are sized by
   four keys paired up in every segment (``layout.small_stopping_sets``): 1.81 cells per key at
   u = 210 (block 32 at density 1e-4 of 2^26 coordinates; 2.53 with signs), 1.54 at u = 1000.
   Weights are kept to single-group tables loaded at >= 1.6 cells per key, because they amplify
   rounding along peeling chains. The multilevel fine tables (integers, signed, their pairs
   solved) are sized the same way with the signs' quarter. These small-set terms are what keep
   block 32 above 1.5x of the bound at density 1e-4 for n >= 8 (1.52 at n = 8, 1.60 at n = 16);
   n = 2 is within 1.42. Solving small stopping sets in general (a few keys left when peeling
   stalls, an exact-rank linear solve) would reach the threshold term, ~1.5 cells per key.
4. **Candidates cost cells.** A Bloom index admits false-positive candidates; each must be peeled
   (to an exact count of 0) by the index table, which needs ~1.23 counters per candidate, and the
   counters need base :math:`n q + 1` (``q``: the per-rank cap of a counter). Keeping false positives
   few at density ``p`` needs :math:`\sim(3/x)^3 (1/p) \lesssim 1` with ``x`` counters per key, i.e.
   ``x`` grows like :math:`p^{-1/3}` (x ~ 24 at p = 1e-4): the Bloom index is linear in ``u`` but
   with a large constant.
5. **Every peeled item costs a whole word.** A multilevel fine table peels *nodes*, ~1.25 cells of
   ``words_per_group`` words per non-zero node. A node with one non-zero key under it still costs a
   full word, so at density ``p`` each fine level costs ~1.25 x 32 = 40 bits per non-zero key once
   nodes are sparse, and the coarse bitmap ``32/(floor(22/log2(n+1)) p S)`` bits per non-zero for
   a coarsest node span ``S``. With ``L`` fine levels of ``w`` children, ``S ~ w^L``: the index
   costs ~``40 L + 2.5/(p w^L)`` (n = 2), e.g. ~100 bits at p = 1e-3 and ~150 at 1e-4, against
   ``log2(1/p) + 1.44`` in the bound. That, plus the 1.23 x 32 of the sketch, is why the achieved
   ratio grows toward low densities; only where nodes hold several keys (p >~ 1e-2) does the
   index approach a few bits per non-zero.

Together: with ``p`` = 1e-2 and n = 2 the bound is ~40 bits per non-zero; the sketch alone is ~40,
and the best index here costs ~35-60 more. These limits, not the search below, set the achieved
ratios reported in docs/BENCHMARKS.md.

The choice
----------
:func:`candidates` builds every layout that applies (multilevel for each group size in
``WORDS_PER_GROUP_CHOICES``) with :func:`lossless_hc.lhc.sizing.build_layout`. :func:`choose` returns the
smallest *single-level* payload (dense, bitmap, Bloom; ties to the cheaper decoder in that order),
unless the multilevel payload saves at least ``MULTILEVEL_BYTES_PER_NODE`` (4) bytes per node its
fine tables peel (:func:`multilevel_pays_off`). The reason is decode time, and it is counted per
node because that is what the multilevel decoder adds: it peels its fine tables group by group in
parallel, like the value sketch, so each non-zero node costs about what a key of the value peel
costs, whatever the block size. Measured on the issue #2 reference case (2^26 coordinates, 8 ranks
at 1% each, 7.7% aggregate density, 2-core AMD EPYC VM, interleaved decodes, minimum of 9):
0.50 s wall / 0.98 s CPU against 0.27 s / 0.53 s for the bitmap, i.e. ~0.23 s more for ~4.4 M
fine nodes, ~52 ns of 2-core wall time per node. A ring all-reduce sends each payload byte about
2(n-1)/n ~ 1.75 times per rank, ~14 ns per byte at 1 Gbit/s, so a node must save ~3.7 bytes of
wire to pay for itself there (at 10 Gbit/s ~37, with more cores proportionally fewer): 4 bytes
per node is the 1 Gbit/s break-even, the networks this library is for. (Re-measured 2026-11-24
after the branch-free value peel, which sped up both decoders: decode into a reused buffer
0.31-0.35 s for multilevel against 0.13-0.15 s for the bitmap, ~0.19 s more, ~43 ns per node, a
~3.1-byte break-even. 4 is kept: multilevel's decode time spreads widely, 0.32-0.51 s with fresh
outputs, and the rule should err toward the faster decoder.) On the reference case
multilevel would save 12.7 MiB (1.23x) = ~3 bytes per node, so the bitmap is kept. Where the index
dominates (low densities) a node saves tens to hundreds of bytes (e.g. 8.4x less wire at 5e-4
aggregate density, n = 8) and multilevel is chosen; so it is for blocks of 32 below ~1e-3, where
the index is small beside the sketch but each of the few nodes still saves tens of bytes.
``index="multilevel"`` forces it. (Before the decoder was parallel it was ~4.7x the bitmap's and
``auto`` required a 1.5x smaller payload; in between, a 1.25x ratio.)
Dense is always a candidate, so the choice never exceeds dense plus the 9-word header. Sizes are
exact (the layouts themselves), not estimates.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Optional

from lossless_hc.lhc.layout import HEADER_FIELDS, INDEX_KINDS, PayloadLayout, check_args
from lossless_hc.lhc.sizing import build_layout

# Multilevel shapes tried: the finest level's words per node (G = words * digits per word keys),
# and for the levels above it (up to MAX_EXTRA_LEVELS more) the words per node of each.
WORDS_PER_GROUP_CHOICES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 128, 256)
UPPER_WORDS_CHOICES = (1, 2, 4)
MAX_EXTRA_LEVELS = 3            # up to 4 fine levels (layout.MAX_FINE_LEVELS)
# ``auto`` takes the multilevel index only where it saves this many wire bytes per fine-table node
# its decoder peels (the 1 Gbit/s break-even of its extra decode time; see "The choice" above).
MULTILEVEL_BYTES_PER_NODE = 4.0


def multilevel_shapes(extra: int):
    """Every ``words_per_group`` tuple (coarsest level first) with ``extra`` levels above the finest."""
    import itertools

    for upper in itertools.product(UPPER_WORDS_CHOICES, repeat=extra):
        for fine in WORDS_PER_GROUP_CHOICES:
            yield tuple(upper) + (fine,)


def log2_binomial(n: int, k: int) -> float:
    """log2 C(n, k) (0 outside 0 <= k <= n)."""
    if k <= 0 or k >= n:
        return 0.0
    return (math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1)) / math.log(2)


def information_bound_bits(numel: int, nnz: int) -> float:
    """The information bound of an exact aggregate with ``nnz`` non-zero coordinates among
    ``numel``: log2 C(numel, nnz) + 32 nnz bits (see the module docstring)."""
    return log2_binomial(numel, nnz) + 32.0 * nnz


def best_multilevel(numel: int, world_size: int, max_nnz: int, block_size: int = 1, seed: int = 0,
                    union_nnz: Optional[int] = None) -> Optional[PayloadLayout]:
    """The smallest multilevel layout over :func:`multilevel_shapes` (None if none applies); ties
    keep the first found (fewer levels, smaller nodes). Depths are tried in increasing order and
    the search stops at the first depth that does not improve on the one before (a deeper tree
    only pays where the coarse bitmap dominates)."""
    return _best_multilevel(numel, world_size, max_nnz, block_size, seed, union_nnz)


@functools.lru_cache(maxsize=4096)
def _best_multilevel(numel, world_size, max_nnz, block_size, seed, union_nnz):
    best = None
    for extra in range(MAX_EXTRA_LEVELS + 1):
        depth_best = None
        for shape in multilevel_shapes(extra):
            L = build_layout("multilevel", numel, world_size, max_nnz, block_size, seed, union_nnz, shape)
            if L is None:
                continue
            if depth_best is None or L.payload_numel < depth_best.payload_numel:
                depth_best = L
        if depth_best is None or (best is not None and depth_best.payload_numel >= best.payload_numel):
            break
        best = depth_best
        if best.multilevel.levels[0].span >= best.num_keys:
            break  # the coarsest node already spans every key
    return best


def candidates(numel: int, world_size: int, max_nnz: int, block_size: int = 1, seed: int = 0,
               union_nnz: Optional[int] = None) -> dict:
    """Every layout that applies, by index kind (dense always)."""
    out = {}
    for kind in INDEX_KINDS:
        if kind == "multilevel":
            L = best_multilevel(numel, world_size, max_nnz, block_size, seed, union_nnz)
        else:
            L = build_layout(kind, numel, world_size, max_nnz, block_size, seed, union_nnz)
        if L is not None:
            out[kind] = L
    return out


def multilevel_nodes(layout: PayloadLayout) -> int:
    """Nodes the fine tables of a multilevel layout are sized to peel (all levels)."""
    return sum(lv.planned_nodes for lv in layout.multilevel.levels)


def multilevel_pays_off(flat: PayloadLayout, multilevel: PayloadLayout) -> bool:
    """Whether ``multilevel`` saves at least ``MULTILEVEL_BYTES_PER_NODE`` wire bytes per node its
    decoder peels, against the single-level layout ``flat`` (see "The choice")."""
    saved = flat.wire_bytes - multilevel.wire_bytes
    return saved > 0 and saved >= MULTILEVEL_BYTES_PER_NODE * multilevel_nodes(multilevel)


def choose(numel: int, world_size: int, max_nnz: int, block_size: int = 1, seed: int = 0,
           union_nnz: Optional[int] = None) -> PayloadLayout:
    """The single-level layout with the fewest wire bytes (ties: dense, bitmap, bloom), or the
    multilevel one where it saves enough wire per node it peels (:func:`multilevel_pays_off`).
    The same on every device (the CPU and CUDA backends both decode every kind)."""
    cands = candidates(numel, world_size, max_nnz, block_size, seed, union_nnz)
    multilevel = cands.pop("multilevel", None)
    flat = min(cands.values(), key=lambda L: (L.payload_numel, INDEX_KINDS.index(L.index_kind)))
    if multilevel is not None and multilevel_pays_off(flat, multilevel):
        return multilevel
    return flat


@dataclass(frozen=True)
class Plan:
    """What :func:`plan_for_density` decided for one tensor."""

    index: str
    max_nnz: int          # per-rank capacity (coordinates)
    union_nnz: int        # aggregate non-zeros the sketch is sized for (coordinates)
    layout: PayloadLayout

    @property
    def wire_bytes(self) -> int:
        return self.layout.wire_bytes


def plan_for_density(numel: int, world_size: int, density: float, block_size: int = 1, seed: int = 0,
                     rank_density: Optional[float] = None) -> Plan:
    """The layout for an expected *aggregate* density (non-zero coordinates of the sum / numel).

    ``rank_density`` is the per-rank capacity as a fraction of numel (default: the aggregate
    density, i.e. any rank may hold the whole aggregate support). Both are rounded up to whole
    blocks; the payload never exceeds dense plus the header.
    """
    if not 0.0 <= density <= 1.0:
        raise ValueError(f"density must be in [0, 1], got {density}")
    rd = density if rank_density is None else rank_density
    union = min(numel, math.ceil(density * numel))
    cap = min(numel, math.ceil(rd * numel))
    L = choose(numel, world_size, cap, block_size, seed, union)
    return Plan(L.index_kind, cap, union, L)


def wire_bits_per_nonzero(layout: PayloadLayout, nnz: int) -> float:
    """Wire bits of one rank's payload per non-zero coordinate of the aggregate."""
    return 32.0 * layout.payload_numel / max(1, nnz)


def dense_limit_words(numel: int) -> int:
    """The most any choice sends: the dense tensor plus the header."""
    return numel + HEADER_FIELDS


def plan_layout(numel: int, world_size: int, max_nnz: int, block_size: int = 1, seed: int = 0,
                index: str = "auto", union_nnz: Optional[int] = None) -> PayloadLayout:
    """The payload layout for a tensor of ``numel`` coordinates aggregated over ``world_size``
    ranks, each sending at most ``max_nnz`` non-zero coordinates, hashed in blocks of
    ``block_size``. ``index`` is ``"bitmap"``, ``"bloom"``, ``"multilevel"``, ``"dense"`` or
    ``"auto"`` (the smallest payload, chosen by :func:`choose`; ties prefer the
    cheaper decoder: dense, bitmap, bloom, multilevel). The layout depends on these arguments only,
    never on the device: CPU and CUDA ranks (both have every index kind) plan the same payload.

    Capacity is counted in keys (blocks): ``capacity = min(num_keys, ceil(max_nnz / block_size))``,
    i.e. ``max_nnz`` assumes non-zeros come in whole blocks (embedding rows). A rank with more
    non-zero blocks than that is *overloaded*: decode reports it.

    ``union_nnz`` sizes the value sketch (and the index) for that many non-zero coordinates in the
    *aggregate* (default ``world_size * max_nnz``, every rank's support disjoint). Ranks whose
    supports overlap (top-k of similar gradients, popular embedding rows) need far less; an aggregate
    with more non-zero keys than planned fails to peel and decode reports it (never a wrong answer).
    """
    check_args(numel, world_size, max_nnz, block_size, seed, union_nnz)
    if index not in INDEX_KINDS + ("auto",):
        raise ValueError(f"index must be one of {INDEX_KINDS + ('auto',)}, got {index!r}")
    num_keys = -(-numel // block_size)
    if index == "auto":
        return choose(numel, world_size, max_nnz, block_size, seed, union_nnz)
    if index == "multilevel":
        chosen = best_multilevel(numel, world_size, max_nnz, block_size, seed, union_nnz)
    else:
        chosen = build_layout(index, numel, world_size, max_nnz, block_size, seed, union_nnz)
    if chosen is not None:
        return chosen
    if num_keys == 0:
        # An empty tensor has nothing to index: every kind degenerates to the header alone.
        return build_layout("dense", numel, world_size, max_nnz, block_size, seed, union_nnz)
    raise ValueError(f"index={index!r} cannot be built for world_size={world_size}: its counters would not "
                     f"fit an exact float32 field; use index='bitmap' or 'auto'")
