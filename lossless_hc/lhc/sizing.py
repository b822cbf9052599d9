"""Sizing rules of the lossless codec: how big each table is for a failure-probability target.

Every function here is a pure function of the configuration, evaluated identically on every rank:
the value sketch (:func:`sketch_table_for`), the counting Bloom filter (:func:`bloom_table_for`), the
multilevel index (:func:`multilevel_plan`), and :func:`build_layout`, which assembles one index
kind's :class:`~lossless_hc.lhc.layout.PayloadLayout`. Which kind to build is the cost model's choice
(:func:`lossless_hc.lhc.cost_model.plan_layout`). The derivations and measurements behind the
constants are in docs/DESIGN.md ("Sizing").
"""
from __future__ import annotations

import functools
import math
from dataclasses import replace
from typing import Optional

import torch

from lossless_hc.lhc.hashing import key_cells, mix64 as mix64_tensor
from lossless_hc.lhc.layout import (INDEX_KINDS, INT_FIELD_LIMIT, MAX_FINE_LEVELS, MAX_KEYS, MAX_SEG_LEN, SALT_BLOOM, SALT_FINE, SALT_SKETCH, DigitPacking, FineLevel, MultilevelPlan, PayloadLayout, SegmentedTable, check_args, check_int, check_uint64, digit_packing, layout_fingerprint, mix64, stream_seed)

# Target probability that peeling a correctly sized sketch fails (then the caller falls back to an
# exact dense aggregation for that step, so this trades wire size against rare extra traffic).
PEEL_FAILURE_TARGET = 1e-3
# Target probability that some rank's Bloom counter exceeds its per-rank cap (reported, not silent).
SATURATION_TARGET = 1e-6
# Bloom false positives allowed per true key. A false positive's three counters are all occupied by
# true keys, so false positives crowd the occupied counters and the count peel fails well before the
# random-hypergraph threshold of all the counters: measured, E[FP] = 0.94 U with 1.28 counters per
# candidate fails to peel. Keep them few (see bloom_table_for).
BLOOM_FP_PER_KEY = 0.25
# The share of two-key stopping sets of the value sketch that its decoder cannot solve: the two keys
# share all three cells, and the pair is solvable unless their weight ratios w_j(a) / w_j(b) agree in
# all three. With signs +-1 that is 2 of the 8 sign patterns; with weights uniform on
# {+1, +2, -1, -2} a ratio is +-1 with probability 1/4 each and +-2, +-1/2 with 1/8 each, so
# 2 (1/4)^3 + 4 (1/8)^3 = 5/128 (see sketch_table_for).
PAIR_UNSOLVABLE_SHARE_SIGNS = 0.25
PAIR_UNSOLVABLE_SHARE_WEIGHTS = 5.0 / 128.0
# A weighted value sketch is never loaded above 1 / this (cells per key): see sketch_table_for.
WEIGHTED_MIN_CELLS_PER_KEY = 1.6
# Value-sketch cells per candidate key (see sketch_table_for).
SKETCH_CELLS_PER_KEY = 1.25
# Keys per group of sub-tables the value sketch aims for: a table of more than twice this many keys
# is split into groups (see sketch_table_for). One thread peels a group, so a table of one group
# decodes on one core whatever the machine has; and a group of this many keys has ~0.7 MiB of peeling
# state at block 1 (~1.3 cells per key, 32 bytes per cell), about a core's L2 (the pair cap makes the
# groups of tables above ~150k keys larger: docs/DESIGN.md, "Groups"). Each group costs a margin of
# ~4 sqrt(keys per group) keys: up to ~5% more wire for the tables it splits (docs/DESIGN.md, "Groups").
GROUP_KEYS = 1 << 14


def sketch_table_for(keys: int, stream: int = 0) -> SegmentedTable:
    """The value sketch for ``keys`` candidate keys: the smallest segmented table whose peeling
    fails with probability below ``PEEL_FAILURE_TARGET``.

    * Cells: ``SKETCH_CELLS_PER_KEY`` (1.25) per key plus a ``3 sqrt(keys) + 8`` margin over the 2-core
      threshold of a 3-uniform hypergraph (1.222), and at least what keeps the small stopping sets
      (two keys sharing all three cells, and the 4- and 6-key sets; :func:`small_stopping_sets`)
      below the target, counting only the pairs the decoder cannot solve (``pair_share``).
    * Groups: above ``2 * GROUP_KEYS`` keys the table is split into G groups of three segments,
      each sized for its Binomial(keys, 1/G) share plus ``4 sqrt`` (peeled in cache, in parallel);
      the pair bound caps G.
    * Weights: a single-group table loaded at most 1/``WEIGHTED_MIN_CELLS_PER_KEY`` uses weights
      +-1, +-2 (``weighted``) when that is smaller than the signed table (in practice below ~880
      keys); its pairs are then unsolvable only ``PAIR_UNSOLVABLE_SHARE_WEIGHTS`` of the time.

    The derivation and the error measurements behind these rules: docs/DESIGN.md, "Sizing".
    """
    check_int(keys, "keys")
    check_uint64(stream, "stream")
    if keys < 0:
        raise ValueError(f"keys must be >= 0, got {keys}")
    if keys == 0:
        return SegmentedTable(seg_len=1, seg_count=3, stream=stream)
    signs = _grouped_table(keys, GROUP_KEYS, PAIR_UNSOLVABLE_SHARE_SIGNS, stream)
    if signs.seg_count == 3:
        cells = max(_group_cells(keys, 1, PAIR_UNSOLVABLE_SHARE_WEIGHTS), WEIGHTED_MIN_CELLS_PER_KEY * keys)
        seg_len = max(1, math.ceil(cells / 3))
        if seg_len < signs.seg_len:
            return SegmentedTable(seg_len=seg_len, seg_count=3, stream=stream, weighted=True)
    return signs


def _grouped_table(keys: int, group_keys: int, pair_share: float, stream: int) -> SegmentedTable:
    """The segmented table that peels ``keys`` keys (> 0), split into groups of about ``group_keys``
    above twice that, as derived in sketch_table_for: the number of groups is capped by the pair
    bound (for ``pair_share`` of the pairs unsolvable), and each group is sized for its
    Binomial(N, 1/G) share with a ``4 sqrt`` margin."""
    groups = 1
    if keys > 2 * group_keys:
        groups = max(1, min(math.ceil(keys / group_keys),
                            int(math.sqrt(PEEL_FAILURE_TARGET * keys / (7.0 * pair_share)))))
    per_group = keys / groups
    if groups > 1:
        per_group += 4.0 * math.sqrt(per_group)
    cells = _group_cells(per_group, groups, pair_share)
    return SegmentedTable(seg_len=max(1, math.ceil(cells / 3)), seg_count=3 * groups, stream=stream)


def small_stopping_sets(keys: float, seg_len: float, pair_share: float = 1.0) -> float:
    """Expected number of the small stopping sets the decoder cannot solve, for ``keys`` keys in one
    group of three segments of ``seg_len`` cells (see sketch_table_for): the pairs (a
    ``pair_share`` of them), and the 4- and 6-key sets in which every segment pairs the keys up.

    ``k`` keys (k even) form such a set when, in each segment, they fall into k/2 cells two by two:
    (k-1)!! pairings, each with probability ~ ``seg_len**(-k/2)``, so the expected number is
    ``C(keys, k) ((k-1)!! / seg_len**(k/2))**3``: ``keys**2 / (2 t**3)``, ``27 keys**4 / (24 t**6)``,
    ``3375 keys**6 / (720 t**9)`` for k = 2, 4, 6 (``t = seg_len``). Sets of odd size, or with a
    segment holding three or more of their keys in one cell, are rarer by a factor ~1/t. Checked by
    simulation (``u`` = 210, +-1/+-2 weights, 2e5 trials): at t = 114, 5.2e-4 failures from pairs and
    1.1e-3 from larger sets, against 5.8e-4 and 1.1e-3 here; at t = 177 with +-1 signs, 9.7e-4 from
    pairs against 9.7e-4.
    """
    u, t = float(keys), float(seg_len)
    return (pair_share * u * u / (2.0 * t ** 3) + 27.0 * u ** 4 / (24.0 * t ** 6)
            + 3375.0 * u ** 6 / (720.0 * t ** 9))


def _group_cells(per_group: float, groups: int, pair_share: float) -> float:
    """Cells of one of ``groups`` groups of three segments that peels ``per_group`` keys (see
    sketch_table_for); ``pair_share``: the fraction of two-key stopping sets the decoder cannot solve
    (``PAIR_UNSOLVABLE_SHARE_SIGNS`` for signed tables, the value sketch's and the fine index tables',
    ``PAIR_UNSOLVABLE_SHARE_WEIGHTS`` for the weighted value sketch). The groups' small stopping sets
    together stay below ``PEEL_FAILURE_TARGET``."""
    cells = SKETCH_CELLS_PER_KEY * per_group + 3.0 * math.sqrt(per_group) + 8
    seg = max(1, math.ceil(cells / 3))
    if groups * small_stopping_sets(per_group, seg, pair_share) <= PEEL_FAILURE_TARGET:
        return cells
    # The expected count falls monotonically in seg_len: find the smallest passing one by doubling,
    # then bisection.
    hi = seg
    while groups * small_stopping_sets(per_group, hi, pair_share) > PEEL_FAILURE_TARGET:
        hi *= 2
    lo = max(seg, hi // 2)
    while lo < hi:
        mid = (lo + hi) // 2
        if groups * small_stopping_sets(per_group, mid, pair_share) <= PEEL_FAILURE_TARGET:
            hi = mid
        else:
            lo = mid + 1
    return 3.0 * hi


def _poisson_tail(lam: float, q: int) -> float:
    """P(Poisson(lam) > q)."""
    if lam <= 0:
        return 0.0
    term = math.exp(-lam)
    cdf = term
    for i in range(1, q + 1):
        term *= lam / i
        cdf += term
    if cdf < 1 - 1e-9:
        return 1.0 - cdf
    # 1 - cdf has lost its digits: bound the tail by its first term times a geometric series.
    first = term * lam / (q + 1)
    return first / max(1e-12, 1.0 - lam / (q + 2))


def bloom_table_for(num_keys: int, union_keys: int, capacity: int, world_size: int,
                    stream: int = 0) -> tuple[SegmentedTable, int]:
    """Size the counting Bloom filter for up to ``union_keys`` distinct non-zero keys among
    ``num_keys``; return the table and the per-rank counter cap ``q``.

    Every rank adds, for each of its non-zero keys, 1 to the key's three counters (one per
    sub-table of ``t = cells/3`` counters). The aggregate is a linear sketch of the per-key counts
    c_k = (number of ranks holding key k), so after the decoder enumerates *candidates* (keys whose
    three counters are non-zero) it peels the counters exactly in integers: true keys come out with
    c_k >= 1, false positives with exactly 0. The false positives therefore cost decode time, never
    wire or exactness.

    * A non-member is a candidate with probability ``(1 - exp(-U/t))**3`` (U = union keys), so
      ``E[FP] = (num_keys - U) (1 - exp(-U/t))**3``. We keep ``E[FP] <= max(BLOOM_FP_PER_KEY U, 16)``
      (false positives sit on occupied counters only, so many of them stop the count peel even
      with 1.25 counters per candidate), and the table large enough to peel ``U + FP`` candidates
      (``sketch_table_for``).
    * Wire words, not counters, are what is sent: among the smallest feasible table and a few
      larger ones, the one whose smaller per-rank cap ``q`` packs into the fewest words wins.
    * Twins: a key whose three cells equal those of a true key (or of another candidate) is a
      candidate that can never be separated from it, so count peeling fails. That happens with
      probability ``~ (U (num_keys - U) + (U + FP)**2 / 2) / t**3``, kept below
      ``PEEL_FAILURE_TARGET``; at small sizes this term, not the false-positive rate, sets ``t``.
    * Counters: one rank's counter is Poisson(capacity/t) in the worst case; it is capped at ``q``
      with ``world_size * cells * P(Poisson > q) <= SATURATION_TARGET``; a capped counter is flagged
      in the header (decode reports it, never a wrong answer). The aggregate then stays below
      ``world_size * q + 1``, the digit base.
    """
    u = max(1, union_keys)
    others = max(0, num_keys - union_keys)

    def fp(cells: int) -> float:
        t = cells / 3.0
        return others * (1.0 - math.exp(-u / t)) ** 3

    def ok(cells: int) -> bool:
        e = fp(cells)
        t = cells / 3.0
        twins = (u * others + (u + e) ** 2 / 2.0) / t ** 3
        return (e <= max(BLOOM_FP_PER_KEY * u, 16.0) and twins <= PEEL_FAILURE_TARGET
                and cells >= sketch_table_for(u + math.ceil(e + 4 * math.sqrt(e))).cells)

    lo, hi = 3, 3 * max(1, u)
    while not ok(hi):
        hi *= 2
    while lo < hi:
        mid = (lo + hi) // 2
        if ok(mid):
            hi = mid
        else:
            lo = mid + 1

    def cap_for(t: int) -> int:
        lam = max(1, capacity) / t
        q = 1
        while world_size * 3 * t * _poisson_tail(lam, q) > SATURATION_TARGET:
            q += 1
        return q

    def words(t: int) -> float:
        q = cap_for(t)
        if world_size * q >= INT_FIELD_LIMIT:
            return math.inf
        return digit_packing(world_size * q, 3 * t).words

    # The smallest feasible table, or a larger one whose smaller per-rank cap packs more counters
    # per word (the wire counts words, not counters).
    t = min((-(-int(lo * f) // 3) for f in (1.0, 1.25, 1.5, 2.0)), key=lambda t: (words(t), t))
    return SegmentedTable(seg_len=t, seg_count=3, stream=stream), cap_for(t)


# Target probability that a cell of the multilevel fine table sums past the exact float32 range
# (then decode reports it; see multilevel_plan).
FINE_OVERFLOW_TARGET = PEEL_FAILURE_TARGET / 10

def expected_nonzero_groups(num_groups: int, union_keys: int) -> int:
    """Non-zero groups to size a fine table for: the mean number of groups hit when ``union_keys``
    keys fall uniformly at random into ``num_groups`` groups, plus 4 standard deviations (the count
    is a sum of negatively correlated indicators, so its variance is below its mean) plus 2, rounded
    up (ceil(mean + 4 sqrt(mean) + 2)), capped by the number of groups and of keys. Supports spread
    more evenly than random (exactly one key every G) hit more groups: decode then reports a failed
    fine peel, never a wrong answer."""
    if num_groups <= 0 or union_keys <= 0:
        return 0
    u = min(union_keys, MAX_KEYS)
    mean = num_groups * -math.expm1(u * math.log1p(-1.0 / num_groups)) if num_groups > 1 else 1.0
    return int(min(num_groups, u, math.ceil(mean + 4.0 * math.sqrt(mean) + 2)))


def fine_table_for(nodes: int, words_per_group: int, stream: int = 0) -> SegmentedTable:
    """The fine table that peels ``nodes`` non-zero nodes of ``words_per_group`` words each: grouped
    like the value sketch (see sketch_table_for), so that the decoder peels each group in cache and
    the groups in parallel. A group's peeling state is ``3 + words_per_group`` 8-byte slots per cell
    against 4 for the value sketch of block 1, so a group aims at ``GROUP_KEYS * 4 / (3 +
    words_per_group)`` nodes. Each group is sized for its Binomial(N, 1/G) share with the same
    ``4 sqrt`` margin, and the pair bound caps G as for the sketch.

    A node adds its pattern times its sign in each cell (+-1 from the hash, as the value sketch's
    signs), so the decoder solves two nodes sharing all three cells like the value sketch's pairs
    (exactly: the patterns are integers) unless their signs are proportional, a quarter of the
    pairs: ``PAIR_UNSOLVABLE_SHARE_SIGNS``. Signs cost no range: a cell's magnitude is at most the
    sum of its patterns, which the overflow sizing already bounds. (Unsigned, as before layout
    version 5, every such pair failed: where few nodes are non-zero the tables needed 1.59x more
    cells.)"""
    return _grouped_table(nodes, max(1, GROUP_KEYS * 4 // (3 + words_per_group)), PAIR_UNSOLVABLE_SHARE_SIGNS,
                          stream)


def _fine_level(num_keys: int, union_keys: int, base: int, words_per_group: int, below_span: int,
                stream: int) -> Optional[FineLevel]:
    """The fine level whose children each cover ``below_span`` keys, with the most digits per word
    its headroom allows (see multilevel_plan)."""
    w_max = 0
    while base ** (w_max + 1) <= INT_FIELD_LIMIT:
        w_max += 1
    for w in range(w_max, 0, -1):
        span = below_span * w * words_per_group
        num_nodes = -(-num_keys // span)
        M = expected_nonzero_groups(num_nodes, union_keys)
        if M == 0:
            table, load_cap = SegmentedTable(seg_len=1, seg_count=3, stream=stream), 0
        else:
            table = fine_table_for(M, words_per_group, stream)
            # A cell's load is Binomial(M, 1 / (groups * seg_len)); union bound over every cell.
            lam = M / (table.seg_count // 3 * table.seg_len)
            load_cap = 1
            while load_cap < M and table.cells * _poisson_tail(lam, load_cap) > FINE_OVERFLOW_TARGET:
                load_cap += 1
        if max(1, load_cap) * (base ** w - 1) < INT_FIELD_LIMIT:
            return FineLevel(w, words_per_group, span, num_nodes, M, load_cap, table)
    return None


def multilevel_plan(num_keys: int, union_keys: int, world_size: int, words_per_group, seed_stream: int = 0
                    ) -> Optional[MultilevelPlan]:
    """The multilevel index for ``union_keys`` aggregate non-zero keys among ``num_keys``;
    ``words_per_group`` is an int (one fine level) or a tuple, coarsest level first. None where it
    cannot be built.

    Levels, all summable by plain SUM/AVERAGE:

    * coarse: a counting bitmap over the nodes of the coarsest fine level (each covering ``span``
      consecutive keys): per node, the number of ranks with a non-zero key under it (base ``n + 1``
      digits, packed like the bitmap index). The decoder learns the exact set of non-zero nodes.
    * fine tables, coarsest first: each rank forms, for each of its non-zero nodes, the node's
      *pattern* -- ``words_per_group`` integers ``sum_j c_j (n+1)^j`` over its children, ``w`` per
      word, with ``c_j = 1`` for the children holding one of its non-zero keys -- and adds it into
      three cells of the level's table hashed by node id (cells of ``words_per_group`` words), each
      times the node's +-1 sign in that cell (signed, as the value sketch, so that the decoder can
      solve pairs; ``fine_table_for``). The aggregate of a cell is the signed sum of the aggregate
      patterns of the non-zero nodes hashed there; the decoder knows those nodes (from the level
      above), so it peels the table exactly in integers: a cell reached by one unresolved node holds
      that node's aggregate pattern times its sign, whose base-(n+1) digits are the per-child counts. The non-zero children are the
      next level's non-zero nodes; at the finest level they are the support keys. A large table is
      split into groups like the value sketch (``fine_table_for``): a node hits three cells of one
      group, and the decoder peels the groups in parallel, each in cache.

    Word headroom. A digit of a *pure* cell never exceeds ``n``, so no digit needs room for sums of
    several nodes: only the whole word must stay exact. A cell holding ``l`` nodes sums to at most
    ``l ((n+1)^w - 1)`` in magnitude; ``w`` is the largest with ``load_cap ((n+1)^w - 1) < 2**22``, where
    ``load_cap`` bounds the nodes per cell (Binomial(planned nodes, 1/(groups seg_len))) except with
    probability ``FINE_OVERFLOW_TARGET`` over the table. A larger load is detected (the word's
    magnitude reads at or above 2**22), never decoded wrongly. Headroom costs ``log2(load_cap)`` bits per *word*
    instead of per digit, so base-(n+1) digits pack almost as densely as in the bitmap.

    Several fine levels pay off at low density: each peeled node costs ~1.25 cells of its words,
    and the coarse bitmap costs ``num_keys / span`` digits, so stacking levels grows the span
    geometrically while every level costs about one word per non-zero key.
    """
    wpgs = (words_per_group,) if isinstance(words_per_group, int) else tuple(words_per_group)
    n = world_size
    base = n + 1
    if (num_keys <= 0 or not 1 <= len(wpgs) <= MAX_FINE_LEVELS or min(wpgs) < 1
            or base > INT_FIELD_LIMIT):
        return None
    levels = []
    below = 1
    for depth, wpg in enumerate(reversed(wpgs)):       # finest level first
        lv = _fine_level(num_keys, union_keys, base, wpg, below, mix64(seed_stream + depth))
        if lv is None:
            return None
        levels.append(lv)
        below = lv.span
    levels.reverse()
    return MultilevelPlan(tuple(levels), digit_packing(n, levels[0].num_nodes))

def build_layout(kind: str, numel: int, world_size: int, max_nnz: int, block_size: int = 1, seed: int = 0,
                 union_nnz: Optional[int] = None, words_per_group=1) -> Optional[PayloadLayout]:
    """The layout of one index ``kind`` (with its fingerprint), or None where that kind cannot be
    built for this configuration. Arguments as :func:`plan_layout`; ``words_per_group`` is the
    multilevel group size in fine words, an int or a tuple per fine level, coarsest first (the cost
    model searches it)."""
    check_args(numel, world_size, max_nnz, block_size, seed, union_nnz)
    num_keys = -(-numel // block_size)
    capacity = min(num_keys, -(-max_nnz // block_size))
    union = min(num_keys, world_size * capacity)
    if union_nnz is not None:
        union = min(num_keys, -(-union_nnz // block_size))
    sketch = sketch_table_for(union, stream_seed(seed, SALT_SKETCH))
    common = (numel, block_size, num_keys, world_size, capacity, union)
    L = None
    if kind == "dense":
        L = PayloadLayout(*common, "dense", seed, sketch, None, DigitPacking(1, 1, 0), 0)
    elif num_keys == 0:
        return None
    elif kind == "bitmap":
        L = PayloadLayout(*common, "bitmap", seed, sketch, None, digit_packing(world_size, num_keys), 1)
    elif kind == "bloom":
        bloom, q = bloom_table_for(num_keys, union, capacity, world_size, stream_seed(seed, SALT_BLOOM))
        if world_size * q < INT_FIELD_LIMIT:
            L = PayloadLayout(*common, "bloom", seed, sketch, bloom, digit_packing(world_size * q, bloom.cells), q)
    elif kind == "multilevel":
        m = multilevel_plan(num_keys, union, world_size, words_per_group, stream_seed(seed, SALT_FINE))
        if m is not None:
            L = PayloadLayout(*common, "multilevel", seed, sketch, None, m.coarse, 1, multilevel=m)
    else:
        raise ValueError(f"index must be one of {INDEX_KINDS}, got {kind!r}")
    if L is None:
        return None
    tables = [L.sketch] + ([L.bloom] if L.bloom is not None else [])
    tables += [lv.table for lv in L.multilevel.levels] if L.multilevel is not None else []
    if max(t.seg_len for t in tables) > MAX_SEG_LEN:  # not reached: tables split into groups long before
        raise ValueError(f"a table segment exceeds {MAX_SEG_LEN} cells (the decoders' packed-cell limit)")
    return replace(L, fingerprint=layout_fingerprint(L))


# Tables over at most PAIR_SCAN_MAX_IDS ids (the value sketch's keys, a fine level's nodes) where at most
# PAIR_SCAN_MAX_EXPECTED unsolvable pairs are expected get a stream without one, if one of
# PAIR_SCAN_ATTEMPTS has none (with_solvable_streams); at most PAIR_SCAN_HASHES ids are hashed per table
# (~0.1 s), as the planner prices re-planned tensors with the same call. Above these bounds re-drawing
# cannot remove them (or hashing every id costs too much), and a given pair is rarely both non-zero.
PAIR_SCAN_MAX_IDS = 1 << 16
PAIR_SCAN_MAX_EXPECTED = 4.0
PAIR_SCAN_ATTEMPTS = 32
PAIR_SCAN_HASHES = 1 << 19


def expected_unsolvable_pairs(table: SegmentedTable, ids: int) -> float:
    """Expected number of unsolvable pairs (:func:`unsolvable_pairs`) among ids ``[0, ids)`` over the
    stream: ``C(ids, 2) share / (G seg_len**3)`` for G groups, ``share`` the fraction of colliding
    pairs with proportional weights (``PAIR_UNSOLVABLE_SHARE_WEIGHTS`` or ``_SIGNS``)."""
    share = PAIR_UNSOLVABLE_SHARE_WEIGHTS if table.weighted else PAIR_UNSOLVABLE_SHARE_SIGNS
    return ids * (ids - 1) / 2.0 * share / (table.seg_count // 3 * float(table.seg_len) ** 3)


def unsolvable_pairs(table: SegmentedTable, ids: int) -> int:
    """The pairs ``a < b`` of ids in ``[0, ids)`` that ``table`` hashes to the same three cells with
    proportional weights (``w_j(a) w_0(b) == w_0(a) w_j(b)`` for every j). Whenever both ids of such a
    pair are in an aggregate, neither peeling nor the pair solver can separate them (each of the three
    cells holds a multiple of the same ``w_0(a) v_a + w_0(b) v_b``), so that decode fails, whatever
    the values."""
    cells, weights = key_cells(table, torch.arange(ids, dtype=torch.int64))
    # 2 w_j / w_0, an exact integer for weights +-1, +-2: equal for two ids exactly when their weights
    # are proportional.
    rows = torch.cat([cells, torch.div(2 * weights[:, 1:], weights[:, :1], rounding_mode="trunc")], dim=1)
    # Equal rows have equal hashes: only ids whose hash another shares are compared exactly (a sort of
    # one int64 per id, where a lexicographic unique of the rows costs ten times more).
    h = torch.zeros(ids, dtype=torch.int64)
    for j in range(rows.shape[1]):
        h = mix64_tensor(h ^ rows[:, j])
    _, inverse, counts = torch.unique(h, return_inverse=True, return_counts=True)
    shared = counts[inverse] > 1
    if not bool(shared.any()):
        return 0
    _, counts = torch.unique(rows[shared], dim=0, return_counts=True)
    return int((counts * (counts - 1) // 2).sum())


def _solvable_stream(table: SegmentedTable, ids: int) -> tuple[SegmentedTable, int]:
    """``table`` with the first stream of ``stream_seed(table.stream, attempt)``, attempt 1, 2, ...,
    whose ids form no unsolvable pair (attempt 0: its own), or the one with the fewest; and the
    attempt. Tables outside the PAIR_SCAN bounds keep their stream; 8 attempts at 2^16 ids, 32 below
    2^14."""
    if not 2 <= ids <= PAIR_SCAN_MAX_IDS or expected_unsolvable_pairs(table, ids) > PAIR_SCAN_MAX_EXPECTED:
        return table, 0
    best = None
    for attempt in range(min(PAIR_SCAN_ATTEMPTS, PAIR_SCAN_HASHES // ids)):
        t = table if attempt == 0 else replace(table, stream=stream_seed(table.stream, attempt))
        pairs = unsolvable_pairs(t, ids)
        if best is None or pairs < best[0]:
            best = (pairs, t, attempt)
        if pairs == 0:
            break
    return best[1], best[2]


@functools.lru_cache(maxsize=1024)
def with_solvable_streams(L: PayloadLayout) -> PayloadLayout:
    """``L`` with its value sketch and each multilevel fine table re-seeded, where the seed's own
    stream maps two of the table's ids (keys, nodes) to an unsolvable pair and another does not
    (``_solvable_stream``; ``L.reseeded`` records the attempts and joins the fingerprint).

    Why: the peeling failure rate the tables are sized for (``PEEL_FAILURE_TARGET``) is an average
    over streams. For one layout, a pair of ids hashed to the same cells with proportional weights
    fails every decode whose aggregate holds both, step after step (hot embedding rows, a small fine
    table's few nodes: docs/DESIGN.md, "Streams without unsolvable pairs"). Where few such pairs are
    expected among all ids, another stream has none, and those decodes succeed.
    Sizes, and so the payload's length, do not change; the plan is a pure function of the
    configuration, the same on every rank."""
    if L.index_kind == "dense":
        return L
    levels = L.multilevel.levels if L.multilevel is not None else ()
    sketch, first = _solvable_stream(L.sketch, L.num_keys)
    fine = [_solvable_stream(lv.table, lv.num_nodes) for lv in levels]
    attempts = (first,) + tuple(a for _, a in fine)
    if not any(attempts):
        return L
    multilevel = L.multilevel
    if multilevel is not None:
        multilevel = replace(multilevel, levels=tuple(replace(lv, table=t) for lv, (t, _) in zip(levels, fine)))
    out = replace(L, sketch=sketch, multilevel=multilevel, reseeded=attempts)
    return replace(out, fingerprint=layout_fingerprint(out))

