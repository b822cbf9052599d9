"""lossless_hc.lhc.cost_model: the automatic choice is the cheapest candidate (wire bytes, each kind's coding
time priced in bytes), never above dense plus the header, deterministic and independent of the process/rank
that evaluates it."""
import itertools
import json
import math
import os
import subprocess
import sys

import pytest

from lossless_hc import LosslessCodec, plan_layout
from lossless_hc.lhc import cost_model as cost_model
from lossless_hc.lhc.layout import HEADER_FIELDS, INDEX_KINDS
from lossless_hc.lhc.sizing import with_solvable_streams

GRID = list(itertools.product([1000, 100_000, 1 << 22], [1, 2, 8, 16, 64], [1e-4, 1e-3, 1e-2, 0.1, 0.5], [1, 32]))


@pytest.mark.parametrize("numel,n,density,block", GRID)
def test_auto_is_never_worse_than_any_kind_nor_dense(numel, n, density, block):
    plan = cost_model.plan_for_density(numel, n, density, block)
    cands = cost_model.candidates(numel, n, plan.max_nnz, block, 0, plan.union_nnz)
    assert set(cands) <= set(INDEX_KINDS) and "dense" in cands
    flat = {k: L for k, L in cands.items() if k != "multilevel"}
    priced = cost_model.priced_bytes
    best_flat = min(priced(L) for L in flat.values())
    best_flat_layout = min(flat.values(), key=lambda L: (priced(L), INDEX_KINDS.index(L.index_kind)))
    if plan.index == "multilevel":  # only where it saves its price: MULTILEVEL_BYTES_PER_NODE per node, its sketch's
        assert plan.layout == with_solvable_streams(cands["multilevel"])
        saved = best_flat - plan.layout.wire_bytes
        assert saved >= cost_model.decode_price_bytes(plan.layout) > \
            cost_model.MULTILEVEL_BYTES_PER_NODE * cost_model.multilevel_nodes(plan.layout) > 0
    else:
        assert priced(plan.layout) == best_flat and plan.index == best_flat_layout.index_kind
        if "multilevel" in cands:
            assert not cost_model.multilevel_pays_off(best_flat_layout, cands["multilevel"])
    for L in cands.values():     # never more than any kind, but for the price of a slower decoder
        assert priced(plan.layout) <= priced(L) or (L.index_kind == "multilevel" and plan.index != "multilevel")
        # never more wire than dense, nor than the bitmap unless the bitmap's sketch costs more time than it saves
        if L.index_kind == "dense" or (L.index_kind == "bitmap" and plan.index != "dense"):
            assert plan.layout.wire_bytes <= L.wire_bytes
        if plan.index == "dense" and L.index_kind != "dense":
            assert L.wire_bytes + cost_model.decode_price_bytes(L) >= plan.layout.wire_bytes
    assert plan.layout.payload_numel <= numel + HEADER_FIELDS
    assert cost_model.dense_limit_words(numel) == numel + HEADER_FIELDS


def test_explicit_kinds_still_work_and_match_the_candidates():
    for kind in INDEX_KINDS:
        c = LosslessCodec(1 << 20, 4, 5000, index=kind)
        assert c.index_kind == kind
    cands = cost_model.candidates(1 << 20, 4, 5000)
    for kind, L in cands.items():
        assert plan_layout(1 << 20, 4, 5000, index=kind) == L


def test_multilevel_is_chosen_where_the_index_dominates():
    """Low aggregate densities, where the flat indexes cost many times the sketch."""
    for n in (2, 8):
        for p in (1e-4, 1e-3):
            plan = cost_model.plan_for_density(1 << 24, n, p)
            assert plan.index == "multilevel", (n, p, plan.index)


def test_the_faster_bitmap_is_kept_where_multilevel_saves_little():
    """The issue #2 reference case (8 ranks at 1% each of 2^26, 7.7% aggregate): multilevel would be
    only ~1.23x smaller, ~3 bytes per node it peels, and decodes ~1.9x slower: auto keeps the bitmap."""
    L = plan_layout(1 << 26, 8, (1 << 26) // 100, index="auto")
    assert L.index_kind == "bitmap"
    ml = cost_model.candidates(1 << 26, 8, (1 << 26) // 100)["multilevel"]
    assert ml.payload_numel < L.payload_numel
    per_node = (L.wire_bytes - ml.wire_bytes) / cost_model.multilevel_nodes(ml)
    assert 1.0 < per_node < cost_model.MULTILEVEL_BYTES_PER_NODE


def test_a_bloom_index_is_priced_with_its_decode():
    """32 ranks at 0.1% each of 2^22 coordinates, sized as the planner sizes them: the Bloom index is
    smaller than the bitmap, but its decoder tests every key against 2M counters and peels them in one
    table (68 ms against 9 ms for the bitmap on a 2-core VM; docs/BENCHMARKS.md, "Which index auto
    picks"). The multilevel index is smaller than both and decodes in 18 ms. auto picked the Bloom
    index while only the multilevel decode was priced; it picks the multilevel one now."""
    cands = cost_model.candidates(1 << 22, 32, 6292, 1, 0, 165212)
    bloom, bitmap, ml = cands["bloom"], cands["bitmap"], cands["multilevel"]
    assert ml.wire_bytes < bloom.wire_bytes < bitmap.wire_bytes
    sketch = cost_model.sketch_price_bytes
    assert cost_model.decode_price_bytes(bloom) == cost_model.BLOOM_BYTES_PER_CELL * bloom.bloom.cells + sketch(bloom)
    assert cost_model.decode_price_bytes(bitmap) == sketch(bitmap) > 0 == cost_model.decode_price_bytes(cands["dense"])
    assert cost_model.decode_price_bytes(ml) == \
        cost_model.MULTILEVEL_BYTES_PER_NODE * cost_model.multilevel_nodes(ml) + sketch(ml)
    assert sketch(bloom) == sketch(bitmap) == sketch(ml)   # the same value sketch, whatever the index
    # against the Bloom index alone, multilevel would save too little per node to pay for its decode
    assert bloom.wire_bytes - ml.wire_bytes < cost_model.decode_price_bytes(ml) < cost_model.priced_bytes(bloom) - \
        ml.wire_bytes
    L = plan_layout(1 << 22, 32, 6292, union_nnz=165212)
    assert L.index_kind == "multilevel" and L.payload_numel == ml.payload_numel


def test_the_tensor_is_sent_dense_where_the_sketch_costs_more_time_than_it_saves():
    """8 ranks at 4% each of 2^22 coordinates (a union sized for 32%): the bitmap layout is 1% smaller than
    the tensor, but its encode + decode took ~55 ms against ~3 ms for the dense layout's copies (2-core VM;
    docs/BENCHMARKS.md, "The value sketch priced against the dense layout"), ~50 ms to save 0.17 MB,
    which a 1 Gbit/s ring sends in ~2.4 ms. auto sends the tensor; at 3% each the bitmap saves 21% and
    is kept, and at 1% far more."""
    four = (1 << 22) * 4 // 100
    cands = cost_model.candidates(1 << 22, 8, four)
    assert cands["bitmap"].wire_bytes < cands["dense"].wire_bytes < cost_model.priced_bytes(cands["bitmap"])
    assert plan_layout(1 << 22, 8, four).index_kind == "dense"
    assert LosslessCodec(1 << 22, 8, four).index_kind == "dense"
    assert plan_layout(1 << 22, 8, four, index="bitmap").index_kind == "bitmap"   # still there when asked for
    for pct in (3, 1):
        assert plan_layout(1 << 22, 8, (1 << 22) * pct // 100).index_kind == "bitmap", pct


def test_a_slightly_smaller_bloom_index_does_not_displace_the_bitmap():
    cands = cost_model.candidates(10_000, 2, 100)
    bloom, bitmap = cands["bloom"], cands["bitmap"]
    assert bloom.wire_bytes < bitmap.wire_bytes < cost_model.priced_bytes(bloom)
    assert plan_layout(10_000, 2, 100).index_kind == "bitmap"
    assert plan_layout(10_000, 2, 100, index="bloom").index_kind == "bloom"   # still there when asked for


def test_multilevel_is_chosen_for_sparse_rows():
    """Blocks of 32 at low density: the index is small beside the sketch, but each of the few nodes
    saves far more than its decode costs, so the multilevel index is chosen."""
    plan = cost_model.plan_for_density(1 << 26, 16, 3e-4, 32)
    assert plan.index == "multilevel"
    flat = min((L for k, L in cost_model.candidates(1 << 26, 16, plan.max_nnz, 32, 0, plan.union_nnz).items()
                if k != "multilevel"), key=lambda L: L.payload_numel)
    assert flat.payload_numel < 1.25 * plan.layout.payload_numel     # a small ratio, a large saving per node


def test_information_bound():
    assert cost_model.information_bound_bits(100, 0) == 0.0
    assert cost_model.information_bound_bits(100, 100) == pytest.approx(3200.0)
    d, u = 1 << 20, 1000
    b = cost_model.information_bound_bits(d, u)
    assert b == pytest.approx(math.log2(math.comb(d, u)) + 32 * u, rel=1e-9)
    assert cost_model.log2_binomial(10, 3) == pytest.approx(math.log2(120))


def test_choices_are_deterministic():
    a = [cost_model.plan_for_density(1 << 22, n, p).layout for n in (2, 16) for p in (1e-4, 1e-2)]
    cost_model._best_multilevel.cache_clear()
    b = [cost_model.plan_for_density(1 << 22, n, p).layout for n in (2, 16) for p in (1e-4, 1e-2)]
    assert a == b


def test_choices_are_rank_and_process_independent():
    """Another interpreter (another hash seed, as another rank would be) picks the same layouts."""
    code = ("import json; from lossless_hc.lhc import cost_model as c; "
            "print(json.dumps([[c.plan_for_density(1 << 22, n, p, b).layout.fingerprint, "
            "c.plan_for_density(1 << 22, n, p, b).layout.payload_numel] "
            "for n in (2, 16) for p in (1e-4, 1e-2, 0.2) for b in (1, 32)]))")
    here = [[cost_model.plan_for_density(1 << 22, n, p, b).layout.fingerprint,
             cost_model.plan_for_density(1 << 22, n, p, b).layout.payload_numel]
            for n in (2, 16) for p in (1e-4, 1e-2, 0.2) for b in (1, 32)]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONHASHSEED="12345", PYTHONPATH=root)
    out = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == here


def test_design_notes_derive_the_bound_and_its_limits():
    """docs/DESIGN.md ("Cost model") holds the derivation the module's docstring points to."""
    design = open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "DESIGN.md")).read()
    doc = design[design.index("## Cost model"):]
    assert "docs/DESIGN.md" in cost_model.__doc__
    for needle in ("log_2", "32 u", "n+1", "1.23", "22", "false positive", "Candidates"):
        assert needle.lower() in doc.lower(), needle


def test_plan_for_density_checks_both_densities():
    """rank_density is a fraction as density is: a negative one was refused as "max_nnz must be >= 0", a NaN
    as "cannot convert float NaN to integer", and 3.0 was taken as 1 without a word."""
    for kwargs in (dict(density=float("nan")), dict(density=1.5), dict(density=0.01, rank_density=-0.5),
                   dict(density=0.01, rank_density=float("nan")), dict(density=0.01, rank_density=3.0)):
        with pytest.raises(ValueError, match="density must be in"):
            cost_model.plan_for_density(1 << 16, 4, **kwargs)
    plan = cost_model.plan_for_density(1 << 16, 4, 0.01, rank_density=0.005)
    assert (plan.max_nnz, plan.union_nnz) == (328, 656)


def test_prices_are_the_documented_bytes_per_sketch_cell_and_value_bloom_counter_and_multilevel_node():
    """decode_price_bytes is exactly its documented sum: 2 bytes per value-sketch cell plus 0.25 per value of a
    cell (blocks of 32 here: 10 bytes a cell), plus 2 per Bloom counter or 4 per multilevel node; 0 for dense;
    priced_bytes adds it to the wire bytes."""
    cands = cost_model.candidates(1 << 16, 4, 200, 32)
    dense, bitmap, bloom, ml = (cands[k] for k in ("dense", "bitmap", "bloom", "multilevel"))
    assert bitmap.block == 32 and bitmap.sketch.cells == bloom.sketch.cells == ml.sketch.cells == 102
    assert cost_model.sketch_price_bytes(bitmap) == cost_model.decode_price_bytes(bitmap) == 102 * 10.0 == 1020.0
    assert cost_model.sketch_price_bytes(dense) == cost_model.decode_price_bytes(dense) == 0.0
    assert cost_model.decode_price_bytes(bloom) == 2.0 * bloom.bloom.cells + 1020.0
    assert cost_model.multilevel_nodes(ml) == 28 and cost_model.decode_price_bytes(ml) == 4.0 * 28 + 1020.0
    assert cost_model.priced_bytes(bitmap) == bitmap.wire_bytes + 1020.0
    assert cost_model.priced_bytes(dense) == dense.wire_bytes


def test_multilevel_shapes_are_the_documented_search_space():
    """The finest level's words per node from the documented choices, up to three levels of 1, 2 or 4 words above
    it (four fine levels, layout.MAX_FINE_LEVELS), coarsest first."""
    from lossless_hc.lhc.layout import MAX_FINE_LEVELS
    fine = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 128, 256)
    assert list(cost_model.multilevel_shapes(0)) == [(f,) for f in fine]
    assert list(cost_model.multilevel_shapes(1)) == [(u, f) for u in (1, 2, 4) for f in fine]
    assert len(list(cost_model.multilevel_shapes(3))) == 27 * len(fine)
    assert cost_model.MAX_EXTRA_LEVELS + 1 == MAX_FINE_LEVELS == 4


def test_log2_binomial_is_zero_only_outside_the_open_range():
    """log2 C(n, k): log2 n at k = 1 and k = n - 1, 0 at k = 0 and k = n, and 0 (not a domain error) outside."""
    assert cost_model.log2_binomial(10, 1) == pytest.approx(math.log2(10))
    assert cost_model.log2_binomial(10, 9) == pytest.approx(math.log2(10))
    for k in (-1, 0, 10, 11):
        assert cost_model.log2_binomial(10, k) == 0.0, k
    assert cost_model.information_bound_bits(100, 1) == pytest.approx(math.log2(100) + 32.0)


def test_plan_for_density_takes_both_ends_of_zero_one():
    """0 and 1 are densities (no support, every coordinate): a plan with no capacity, and the dense tensor; the
    Plan is frozen and reports its layout's wire bytes."""
    empty = cost_model.plan_for_density(1000, 2, 0.0)
    assert (empty.max_nnz, empty.union_nnz) == (0, 0)
    full = cost_model.plan_for_density(1000, 2, 1.0, rank_density=1.0)
    assert (full.index, full.max_nnz, full.union_nnz) == ("dense", 1000, 1000)
    assert cost_model.plan_for_density(1000, 2, 0.5, rank_density=0.0).max_nnz == 0
    assert full.wire_bytes == full.layout.wire_bytes == 4 * (1000 + HEADER_FIELDS)
    with pytest.raises(AttributeError):
        full.index = "bitmap"


def test_wire_bits_per_nonzero():
    """32 bits per payload word over the aggregate's non-zeros, over one where there are none."""
    L = plan_layout(1000, 2, 10)
    assert cost_model.wire_bits_per_nonzero(L, 40) == 32.0 * L.payload_numel / 40
    assert cost_model.wire_bits_per_nonzero(L, 0) == cost_model.wire_bits_per_nonzero(L, 1) == 32.0 * L.payload_numel


def test_best_multilevel_keeps_the_first_of_equal_layouts():
    """Ties keep the first found: at 2^20 keys, 8 ranks, one non-zero, the four-level shapes (1, 1, 1, 2) and
    (2, 1, 1, 1) are as small, and the first is kept; at 5000 keys, 2 ranks, one non-zero, two levels are no
    smaller than one, so the search stops at the one-level layout."""
    deep = cost_model.best_multilevel(1 << 20, 8, 1)
    assert [lv.words_per_group for lv in deep.multilevel.levels] == [1, 1, 1, 2] and deep.payload_numel == 484
    flat = cost_model.best_multilevel(5000, 2, 1)
    assert len(flat.multilevel.levels) == 1 and flat.payload_numel == 104


def test_multilevel_pays_off_at_exactly_its_price():
    """"Saves at least its price": against a single-level layout priced at exactly the multilevel layout's wire
    bytes plus its price (the multilevel layout itself, priced), the saving equals the price and pays off."""
    ml = cost_model.candidates(1 << 16, 4, 200, 32)["multilevel"]
    assert cost_model.priced_bytes(ml) - ml.wire_bytes == cost_model.decode_price_bytes(ml) > 0
    assert cost_model.multilevel_pays_off(ml, ml)


def test_plan_layout_checks_its_arguments_and_index_first():
    """plan_layout refuses an unknown index naming every choice, "auto" too (build_layout's own refusal names
    the kinds alone), and checks its arguments before any kind is sized: a union_nnz that is no int is named as
    such, not met as an unhashable key of the multilevel search's cache."""
    with pytest.raises(ValueError, match=r"index must be one of \(.*'auto'\), got 'sparse'"):
        plan_layout(100, 2, 5, index="sparse")
    with pytest.raises(TypeError, match="union_nnz"):
        plan_layout(100, 2, 5, index="multilevel", union_nnz=[3])


def test_block_size_1_and_seed_0_are_the_defaults_everywhere():
    """Every entry point's default block_size and seed are 1 and 0: the layouts equal those asked for with them
    (the seed picks the tables' streams, so a default of another seed is another layout of the same size)."""
    args = (1000, 2, 10)
    assert cost_model.best_multilevel(*args) == cost_model.best_multilevel(*args, 1, 0)
    assert cost_model.candidates(*args) == cost_model.candidates(*args, 1, 0)
    assert cost_model.choose(*args) == cost_model.choose(*args, 1, 0)
    assert plan_layout(*args) == plan_layout(*args, 1, 0)
    assert cost_model.plan_for_density(1000, 2, 0.01) == cost_model.plan_for_density(1000, 2, 0.01, 1, 0)
