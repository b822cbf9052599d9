"""Cost model: which index (dense, bitmap, Bloom, multilevel) and which sizes, per tensor.

Every rank calls :func:`plan_layout` / :func:`choose` with the same arguments (numel, world size,
block size, capacity, expected aggregate support); they are pure functions of them, so every rank
picks the same layout and payload shapes always match. :func:`choose` returns the layout with the
fewest wire bytes among the kinds :mod:`lossless_hc.lhc.sizing` can build within its
failure-probability targets, each kind's encode and decode beyond the dense layout's copy priced in
wire bytes (:func:`decode_price_bytes`: ``SKETCH_BYTES_PER_CELL`` plus ``SKETCH_BYTES_PER_VALUE`` per
value of a cell of the value sketch, which every kind but dense carries; ``BLOOM_BYTES_PER_CELL`` per
Bloom counter, ``MULTILEVEL_BYTES_PER_NODE`` per fine-table node the multilevel decoder peels); ties
prefer the cheaper decoder (dense, bitmap, bloom, multilevel).
Dense is always a candidate, so the choice never exceeds dense plus the header. Sizes are exact
(the layouts themselves), not estimates. The derivation (wire formulas, the information bound, the
multilevel break-even) is in docs/DESIGN.md, "Cost model".
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Optional

from lossless_hc.lhc.layout import HEADER_FIELDS, INDEX_KINDS, PayloadLayout, check_args, is_real
from lossless_hc.lhc.sizing import build_layout, with_solvable_streams

# Multilevel shapes tried: the finest level's words per node (G = words * digits per word keys),
# and for the levels above it (up to MAX_EXTRA_LEVELS more) the words per node of each.
WORDS_PER_GROUP_CHOICES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 128, 256)
UPPER_WORDS_CHOICES = (1, 2, 4)
MAX_EXTRA_LEVELS = 3            # up to 4 fine levels (layout.MAX_FINE_LEVELS)
# ``auto`` takes the multilevel index only where it saves this many wire bytes per fine-table node
# its decoder peels (the 1 Gbit/s break-even of its extra decode time; docs/DESIGN.md, "Cost model", "The choice").
MULTILEVEL_BYTES_PER_NODE = 4.0
# ... and the Bloom index only where it saves this many per counter of its table: its decoder tests every
# key of the tensor against the counters and peels them in one table of 32-byte cells, which costs ~28 ns
# per counter more than the bitmap's decode (docs/DESIGN.md, "Cost model", "The choice").
BLOOM_BYTES_PER_CELL = 2.0
# ... and the value sketch, which every kind but dense carries, only where it saves this many per cell,
# plus this many per value of a cell (the block): encoding into it and peeling it costs ~27 + 3.4 b ns
# per cell of b values more than the dense layout's copy (docs/DESIGN.md, "Cost model", "The choice").
SKETCH_BYTES_PER_CELL = 2.0
SKETCH_BYTES_PER_VALUE = 0.25


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
    ``numel``: log2 C(numel, nnz) + 32 nnz bits (docs/DESIGN.md, "Cost model")."""
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


def sketch_price_bytes(layout: PayloadLayout) -> float:
    """What ``layout``'s value sketch costs to encode and peel beyond a copy of the dense tensor, in wire
    bytes: ``c * (s + v * b)`` for ``c`` cells of ``b`` values, ``s`` = ``SKETCH_BYTES_PER_CELL``,
    ``v`` = ``SKETCH_BYTES_PER_VALUE``; 0 for dense, which has no sketch."""
    if layout.index_kind == "dense":
        return 0.0
    return layout.sketch.cells * (SKETCH_BYTES_PER_CELL + SKETCH_BYTES_PER_VALUE * layout.block)


def decode_price_bytes(layout: PayloadLayout) -> float:
    """What ``layout``'s encode and decode cost beyond the dense layout's copy, in wire bytes (the 1 Gbit/s
    break-even, docs/DESIGN.md "Cost model", "The choice"): its value sketch's
    (:func:`sketch_price_bytes`), plus ``MULTILEVEL_BYTES_PER_NODE`` per node of a multilevel index's fine
    tables or ``BLOOM_BYTES_PER_CELL`` per counter of a Bloom index; 0 for dense."""
    price = sketch_price_bytes(layout)
    if layout.index_kind == "multilevel":
        price += MULTILEVEL_BYTES_PER_NODE * multilevel_nodes(layout)
    elif layout.index_kind == "bloom":
        price += BLOOM_BYTES_PER_CELL * layout.bloom.cells
    return price


def priced_bytes(layout: PayloadLayout) -> float:
    """Wire bytes plus :func:`decode_price_bytes`: what :func:`choose` minimises."""
    return layout.wire_bytes + decode_price_bytes(layout)


def multilevel_pays_off(flat: PayloadLayout, multilevel: PayloadLayout) -> bool:
    """Whether ``multilevel`` saves at least its price (``MULTILEVEL_BYTES_PER_NODE`` bytes per node its
    decoder peels, and its value sketch's) against the single-level layout ``flat`` priced the same way
    (:func:`priced_bytes`: a Bloom index's counters, a sketch; docs/DESIGN.md, "Cost model", "The choice")."""
    saved = priced_bytes(flat) - multilevel.wire_bytes
    return saved > 0 and saved >= decode_price_bytes(multilevel)


def choose(numel: int, world_size: int, max_nnz: int, block_size: int = 1, seed: int = 0,
           union_nnz: Optional[int] = None) -> PayloadLayout:
    """The single-level layout with the fewest :func:`priced_bytes` (wire bytes, plus its value sketch's
    and a Bloom index's coding time; ties: dense, bitmap, bloom), or the multilevel one where it saves
    enough per node it peels (:func:`multilevel_pays_off`). The same on every device (the CPU and CUDA
    backends both decode every kind). Its tables' streams are then checked for unsolvable pairs
    (:func:`~lossless_hc.lhc.sizing.with_solvable_streams`)."""
    cands = candidates(numel, world_size, max_nnz, block_size, seed, union_nnz)
    multilevel = cands.pop("multilevel", None)
    flat = min(cands.values(), key=lambda L: (priced_bytes(L), INDEX_KINDS.index(L.index_kind)))
    pays_off = multilevel is not None and multilevel_pays_off(flat, multilevel)
    return with_solvable_streams(multilevel if pays_off else flat)


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
    # rank_density too, here: further down a negative one fails as a negative max_nnz, a NaN as an int()
    # conversion, and one above 1 would be clamped to the tensor
    for name, value in (("density", density), ("rank_density", rank_density)):
        if value is not None and not (is_real(value) and 0.0 <= value <= 1.0):
            raise ValueError(f"{name} must be in [0, 1], got {value}")
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
    ``"auto"`` (the fewest wire bytes once each kind's encode and decode time is priced in bytes,
    :func:`choose`; ties prefer the cheaper decoder: dense, bitmap, bloom, multilevel). The layout
    depends on these arguments only, never on the device: CPU and CUDA ranks (both have every index
    kind) plan the same payload.

    Capacity is counted in keys (blocks): ``capacity = min(num_keys, ceil(max_nnz / block_size))``,
    i.e. ``max_nnz`` assumes non-zeros come in whole blocks (embedding rows). A rank with more
    non-zero blocks than that is *overloaded*: decode reports it.

    ``union_nnz`` sizes the value sketch (and the index) for that many non-zero coordinates in the
    *aggregate* (default ``world_size * max_nnz``, every rank's support disjoint). Ranks whose
    supports overlap (top-k of similar gradients, popular embedding rows) need far less; an aggregate
    with more non-zero keys than planned fails to peel and decode reports it (never a wrong answer).
    Tables whose seed's stream would fail every decode holding a given pair of keys (or of
    multilevel nodes) take another stream where one avoids it (:func:`~lossless_hc.lhc.sizing.with_solvable_streams`).
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
        return with_solvable_streams(chosen)
    if num_keys == 0:
        # An empty tensor has nothing to index: every kind degenerates to the header alone.
        return build_layout("dense", numel, world_size, max_nnz, block_size, seed, union_nnz)
    raise ValueError(f"index={index!r} cannot be built for world_size={world_size}: its counters would not "
                     f"fit an exact float32 field; use index='bitmap' or 'auto'")
