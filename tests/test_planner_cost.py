"""The planner's cost model (lossless_hc.training.planner): its decisions over synthetic statistics,
its wire sizes against the real layouts, the link model and the calibration's format, the re-plan cadence,
and the statistics it refuses. The strategies it prices, run: tests/test_planner.py; the link fit and the
measurements it is calibrated with: tests/test_calibration.py."""
import math

import pytest
import torch

from lossless_hc.lhc.cost_model import plan_layout
from lossless_hc.training.calibration import fit_link
from lossless_hc.training.plan_tracker import PlanTracker
from lossless_hc.training.planner import (DEFAULT_CODEC_SECONDS, EXACT_STRATEGIES, LOSSY_STRATEGIES, Calibration,
                                          CostModel, LinkModel, batched_second_collectives)
from lossless_hc.training.plan_stats import TensorStats, bitmap_words, sketch_capacity, stats_header_words

MODEL = CostModel(Calibration.default(bandwidth_bits=1e9))


def stats(numel, row, n, k, union):
    return TensorStats(numel, row, n, (k,) * n, union)


# -- the cost model ------------------------------------------------------------------------------------

def test_disjoint_supports_on_few_hosts_pick_allgather():
    # NCF-like: 1M rows of 64, 2 hosts, 512 rows each, barely overlapping.
    choice, predicted = MODEL.choose(stats(64 << 20, 64, 2, 512, 1020))
    assert choice == "allgather", predicted
    assert set(predicted) == set(EXACT_STRATEGIES)


def test_high_overlap_and_many_hosts_pick_an_allreduce_strategy():
    # Zipf-like: 16 hosts of 16384 rows each whose union is only 20000 rows.
    choice, predicted = MODEL.choose(stats(64 << 20, 64, 16, 16384, 20000))
    assert choice in ("two_phase", "sketch"), predicted
    assert predicted[choice] < predicted["allgather"] / 3


def test_dense_tensor_picks_dense_and_lossy_picks_a_lossy_strategy():
    s = stats(1 << 20, 1, 4, 1 << 20, 1 << 20)
    assert MODEL.choose(s)[0] == "dense"
    choice, predicted = MODEL.choose(s, lossy=True)
    assert choice in LOSSY_STRATEGIES and set(predicted) == set(EXACT_STRATEGIES + LOSSY_STRATEGIES)


def test_half_precision_is_priced_at_its_plain_step():
    """A half-precision plan is priced at its plain steps (module doc): the tensor in half precision in one
    allreduce, and the round trip and copy back per coordinate; no header round trip, no scan (those
    come once per interval, on its statistics steps). Before, it was priced with both, as every one of
    its steps ran them: bf16 of BERT's embedding tables measured 1.08-1.45x dense's step at 10 Gbit/s in
    the step guard's trials (docs/BENCHMARKS.md, "A fast link: 10 Gbit/s"). Now on the default costs it
    saves 2 bytes per coordinate for 1 ns of local work: predicted cheaper than dense at 1 and at 10 Gbit/s
    (0.8 ns per byte), where the step guard still times it against dense."""
    s = stats(20000 * 256, 256, 2, 20000, 20000)
    for bits in (1e10, 1e9):
        model = CostModel(Calibration.default(bits))
        link = model.calibration.link
        for half in ("fp16", "bf16"):
            want = link.allreduce(2 * s.numel, 2) + DEFAULT_CODEC_SECONDS[half][0] * s.numel
            assert model.predict(half, s) == pytest.approx(want, rel=1e-12)
        choice, predicted = model.choose(s, lossy=True, allowed=("dense", "fp16", "bf16"))
        assert choice == "fp16" and predicted["dense"] > predicted["fp16"] > 0.5 * predicted["dense"], predicted


def test_choose_is_deterministic_and_allowed_narrows():
    s = stats(1 << 16, 16, 3, 40, 100)
    assert MODEL.choose(s) == MODEL.choose(s)
    assert MODEL.choose(s, allowed=("dense", "sketch"))[0] in ("dense", "sketch")
    with pytest.raises(ValueError, match="no strategy left among"):
        MODEL.choose(s, allowed=("nonsense",))


def _grid():
    """Statistics across sizes, rows, hosts, densities and overlaps, dense and sparse."""
    for numel, row in ((1 << 12, 1), (1 << 16, 1), (1 << 20, 1), (1 << 16, 16), (50_000 * 32, 32), (1 << 20, 128)):
        keys = -(-numel // row)
        for n in (2, 3, 16):
            for density in (1e-4, 1e-2, 0.2, 1.0):
                k = max(1, min(keys, int(density * keys)))
                for overlap in (0.0, 0.5, 1.0):
                    union = min(keys, max(k, int(k * (1 + (n - 1) * (1 - overlap)))))
                    for sparse in (False, True):
                        yield TensorStats(numel, row, n, (k,) * n, union, sparse=sparse)


def test_a_second_collective_the_message_issues_anyway_is_priced_without_its_latency():
    """batched: a message's other tensors already issue that kind of second collective (DDP batches them:
    one allgather, one allreduce per dtype), so the tensor's own adds its bytes, not its latency; the first
    allreduce is every strategy's and keeps its latency. A sketch or top-k plan's second allreduce is the
    request of its decode's inexact keys, batched alike where the tensor has any (observed or prior). On a
    slow-latency link that turns a mid-sized tensor's top-k from the allgather (one allgather latency more
    than the header's allreduce) to the sketch where its bucket-mates already issue a second allreduce."""
    model = CostModel(Calibration.default(bandwidth_bits=1e9, latency_s=1e-3))
    alpha = model.calibration.link.alpha_s
    n = 4
    s = stats(1 << 15, 1, n, 1 << 15, 1 << 15)
    both = frozenset({"allgather", "allreduce"})
    for strategy in ("dense", "thc", "bf16"):
        assert model.predict(strategy, s, both) == model.predict(strategy, s)
    for strategy in ("sketch", "topk"):
        assert math.isclose(model.predict(strategy, s, both), model.predict(strategy, s) - 2 * (n - 1) * alpha,
                            rel_tol=1e-12)
        exact = TensorStats(s.numel, 1, n, s.rank_keys, s.union_keys, **{f"{strategy}_reaggregated": 0})
        assert model.predict(strategy, exact, both) == model.predict(strategy, exact), strategy   # no request
    assert math.isclose(model.predict("topk_allgather", s, frozenset({"allgather"})),
                        model.predict("topk_allgather", s) - (n - 1) * alpha, rel_tol=1e-12)
    assert model.predict("topk_allgather", s, frozenset({"allreduce"})) == model.predict("topk_allgather", s)
    sparse = stats(1 << 20, 64, n, 50, 180)
    assert math.isclose(model.predict("two_phase", sparse, both),
                        model.predict("two_phase", sparse) - 2 * (n - 1) * alpha, rel_tol=1e-12)
    assert math.isclose(model.predict("allgather", sparse, both),
                        model.predict("allgather", sparse) - (n - 1) * alpha, rel_tol=1e-12)
    top = ("topk", "topk_allgather")
    assert model.choose(s, lossy=True, allowed=top)[0] == "topk_allgather"
    assert model.choose(s, lossy=True, allowed=top, batched=frozenset({"allreduce"}))[0] == "topk"


def test_a_message_s_second_collectives_are_counted_per_tensor_without_its_own():
    assert batched_second_collectives(["dense", "allgather", "topk_allgather", "two_phase", "thc"]) == [
        {"allgather", "allreduce"}, {"allgather", "allreduce"}, {"allgather", "allreduce"}, {"allgather"},
        {"allgather", "allreduce"}]
    assert batched_second_collectives(["allgather", "dense"]) == [set(), {"allgather"}]
    assert batched_second_collectives(["two_phase", "two_phase", "thc"]) == [{"allreduce"}] * 3
    # the inexact keys' request of a sketch or top-k plan (planner.SECOND_COLLECTIVE)
    assert batched_second_collectives(["topk", "bf16"]) == [set(), {"allreduce"}]
    assert batched_second_collectives(["sketch", "two_phase", "fp16"]) == [{"allreduce"}] * 3
    assert batched_second_collectives([]) == []


def test_the_sketch_floor_bounds_its_price_and_pruning_never_changes_a_choice():
    # choose() skips sizing the sketch's layout when sketch_floor already loses; it must pick what pricing
    # every candidate exactly picks, with or without a strategy in use.
    model = CostModel(Calibration(link=LinkModel(200e-6, 8 / 1e9)))
    for s in _grid():
        exact = model.predict("sketch", s)
        assert model.sketch_floor(s) <= exact, s
        assert 4 * sketch_capacity(s)[1] <= model.wire_bytes("sketch", s), s
        for lossy in (False, True):
            names = EXACT_STRATEGIES + (LOSSY_STRATEGIES if lossy and not s.sparse else ())
            full = {name: model.predict(name, s) for name in names}
            for current in (None, "dense", "sketch", "allgather"):
                choice, predicted = model.choose(s, lossy=lossy, current=current)
                assert list(predicted) == list(names)
                want = min(names, key=lambda name: (full[name], names.index(name)))
                common = 2 * (s.world_size - 1) * model.calibration.link.alpha_s
                if current in full and not full[want] - common < 0.8 * (full[current] - common):
                    want = current
                assert choice == want, (s, lossy, current, full, predicted)
                assert all(predicted[name] == full[name] for name in names if name != "sketch")
                others = min(v for name, v in full.items() if name != "sketch")
                assert predicted["sketch"] == full["sketch"] or full["sketch"] >= predicted["sketch"] > others


def test_the_sketch_is_pruned_at_its_floor_only_when_the_floor_beats_the_cheapest_other():
    """choose() reports the sketch at its lower bound ``sketch_floor`` exactly when that bound already
    exceeds the CHEAPEST other candidate (it cannot win); otherwise at its price. Here the floor lies between
    the cheapest (allgather) and the dearest (dense) other: pruned, the entry is the floor, below the price."""
    s = stats(1 << 16, 16, 3, 40, 100)
    choice, predicted = MODEL.choose(s)
    others = [v for name, v in predicted.items() if name != "sketch"]
    floor = MODEL.sketch_floor(s)
    assert choice == "allgather" and min(others) < floor < max(others), predicted
    assert predicted["sketch"] == floor < MODEL.predict("sketch", s)


def test_a_sketch_floor_equal_to_the_cheapest_other_is_priced_in_full():
    """The pruning is strict: a floor that only ties the cheapest other candidate does not exceed it, so the
    sketch is priced at its real layout. Exact arithmetic: 2 ranks (the allreduce's 2(n-1)/n is 1), no
    latency, 2^-30 s per byte, and an allgather whose local cost per gathered row coordinate (33/8 per
    2^30 s) brings it to the floor's H + 4 * 2000 bytes (the union capacity: 125 rows of 16)."""
    s = TensorStats(1 << 16, 16, 2, (40, 40), 100)
    assert sketch_capacity(s)[1] == 2000
    codec = dict(DEFAULT_CODEC_SECONDS, dense=(2.0 ** -30, 0.0), allgather=(0.0, 33 * 2.0 ** -33),
                 two_phase=(2.0 ** -20, 0.0), sketch=(0.0, 0.0))
    model = CostModel(Calibration(LinkModel(0.0, 2.0 ** -30), codec))
    choice, predicted = model.choose(s)
    assert choice == "allgather" and predicted["allgather"] == model.sketch_floor(s) == (20 + 4 * 2000) * 2.0 ** -30
    assert predicted["sketch"] == model.predict("sketch", s) > model.sketch_floor(s)


def test_local_work_is_per_coordinate_plus_per_touched_row_coordinate():
    """``local_seconds`` (module doc): ``c_s d' + k_s m_s b``, ``d'`` the tensor's ``d`` (a sparse gradient:
    none for allgather, ``D`` for two_phase, ``d + D`` for dense and sketch) and ``m_s b`` the coordinates of
    the rows the strategy touches: ``n K b`` for allgather, ``u b`` for two_phase and sketch,
    ``n ceil(r d)`` for the top-k strategies (coordinates, whatever ``b``), none otherwise. Exact: dyadic
    costs, distinct per strategy and every one non-zero, and a free link, so a prediction is the local work."""
    from lossless_hc.training.planner import PRICED, STRATEGIES
    codec = {name: ((i + 1) * 2.0 ** -30, (i + 3) * 2.0 ** -24) for i, name in enumerate(PRICED)}
    model = CostModel(Calibration(LinkModel(0.0, 0.0), codec))
    d, b, n, K, u = 1 << 16, 16, 3, 40, 100
    D, k = d // b, math.ceil(model.topk_ratio * d)
    touched = {"allgather": n * K * b, "two_phase": u * b, "sketch": u * b, "topk": n * k, "topk_allgather": n * k}
    dense_grad = TensorStats(d, b, n, (K, 30, 7), u)
    for name in STRATEGIES:
        c, per_key = codec[name]
        want = c * d + per_key * touched.get(name, 0)
        assert model.local_seconds(name, dense_grad) == want == model.predict(name, dense_grad), name
    sparse_grad = TensorStats(d, b, n, (K, 30, 7), u, sparse=True)
    for name, coords in (("allgather", 0), ("two_phase", D), ("dense", d + D), ("sketch", d + D)):
        c, per_key = codec[name]
        assert model.local_seconds(name, sparse_grad) == c * coords + per_key * touched.get(name, 0), name


def test_the_sketch_floor_is_the_sketch_priced_at_its_union_capacity():
    """``sketch_floor`` is ``predict("sketch")`` with the layout's words replaced by the union capacity
    (``sketch_capacity(s)[1]``) and nothing else changed: the same header (a sparse gradient's with the
    two-phase bitmap), the same allreduce and the same local work, on dense and sparse gradients alike, and
    an empty tensor's is its header's."""
    from lossless_hc.training.plan_stats import sketch_payload_numel
    link = MODEL.calibration.link
    for sparse in (False, True):
        for n, k, union in ((2, 40, 70), (3, 40, 100), (16, 500, 4000)):
            s = TensorStats(1 << 18, 16, n, (k,) * n, union, sparse=sparse)
            spare = 4 * (sketch_payload_numel(s) - sketch_capacity(s)[1])
            assert spare >= 0
            (_, first), request = MODEL.collectives("sketch", s)   # the inexact keys' request: not in the floor
            assert request[0] == "allreduce" and request[1] > 0
            want = link.allreduce(first - spare, n) + MODEL.local_seconds("sketch", s)
            assert MODEL.sketch_floor(s) == pytest.approx(want, rel=1e-12), (s, MODEL.sketch_floor(s), want)
            assert MODEL.sketch_floor(s) < MODEL.predict("sketch", s)
    empty = TensorStats(0, 1, 4, (0,) * 4, 0)   # no coordinates: no layout, the header alone
    assert MODEL.sketch_floor(empty) == link.allreduce(MODEL.wire_bytes("sketch", empty), 4) \
        == MODEL.predict("sketch", empty)


def test_the_sketch_is_sized_with_its_headroom_over_the_observed_counts():
    """``sketch_capacity`` (module doc: ``h_K K b`` per rank, ``h_U u b`` in the union, ``h_K`` = 1.5,
    ``h_U`` = 1.25), in whole rows: at least one row per rank, a union capacity at least the per-rank one,
    and neither beyond the tensor's rows (nor its coordinates, where the last row is partial)."""
    assert sketch_capacity(TensorStats(1 << 16, 16, 3, (40, 30, 7), 100)) == (60 * 16, 125 * 16)
    assert sketch_capacity(TensorStats(1 << 16, 16, 3, (40, 30, 7), 41)) == (60 * 16, 60 * 16)
    assert sketch_capacity(TensorStats(1 << 16, 16, 3, (3, 1, 0), 3)) == (5 * 16, 5 * 16)
    assert sketch_capacity(TensorStats(1 << 16, 16, 3, (0, 0, 0), 0)) == (16, 16)      # an all-zero gradient
    assert sketch_capacity(TensorStats(1 << 10, 16, 2, (60, 60), 64)) == (1 << 10, 1 << 10)   # D = 64 rows
    assert sketch_capacity(TensorStats(1000, 16, 2, (50, 10), 60)) == (1000, 1000)


def test_wire_bytes_come_from_the_real_layouts():
    s = stats(1 << 16, 16, 3, 40, 100)
    H = 4 * stats_header_words(3)
    assert MODEL.wire_bytes("dense", s) == H + 4 * (1 << 16)
    assert MODEL.wire_bytes("allgather", s) == H + 40 * (4 + 16 * 4)
    assert MODEL.wire_bytes("two_phase", s) == H + 4 * bitmap_words(4096, 3) + 100 * 16 * 4
    cap, union = sketch_capacity(s)
    # and the request of its inexact keys: 1% of the union's 100 x 16 coordinates
    request = 16 * 4
    assert MODEL.wire_bytes("sketch", s) == H + plan_layout(1 << 16, 3, cap, 16, 0, union_nnz=union).wire_bytes + request
    # top-k allgathered: the header's allreduce, then k = ceil(r d) pairs of an int32 index and a float32 value
    k = math.ceil(MODEL.topk_ratio * (1 << 16))
    assert MODEL.collectives("topk_allgather", s) == [("allreduce", H), ("allgather", 8 * k)]
    assert MODEL.touched_coordinates("topk_allgather", s) == 3 * k == MODEL.touched_coordinates("topk", s)


def test_link_model_formulas_and_fit():
    link = LinkModel(1e-4, 8e-9)
    assert link.allreduce(1000, 4) == pytest.approx(6e-4 + 1.5 * 1000 * 8e-9)
    assert link.allgather(1000, 4) == pytest.approx(3e-4 + 3 * 1000 * 8e-9)
    assert link.allreduce(1000, 1) == 0.0
    samples = [(k, b, (link.allreduce if k == "allreduce" else link.allgather)(b, 4))
               for b in (1 << 10, 1 << 16, 1 << 20) for k in ("allreduce", "allgather")]
    fit = fit_link(samples, 4, LinkModel(0, 1))
    assert fit.alpha_s == pytest.approx(1e-4, rel=1e-6) and fit.seconds_per_byte == pytest.approx(8e-9, rel=1e-6)
    assert fit.allgather_seconds_per_byte == pytest.approx(8e-9, rel=1e-6)
    assert fit_link(samples, 1, LinkModel(0, 1)) == LinkModel(0, 1)
    assert fit_link(samples[:2], 4, LinkModel(0, 1)) == LinkModel(0, 1)       # one size: no slope
    # an allgather twice as dear per byte is priced as such; the allreduce keeps its own
    slow = [(k, b, t + (link.allgather(b, 4) - 3e-4 if k == "allgather" else 0.0)) for k, b, t in samples]
    fit = fit_link(slow, 4, LinkModel(0, 1))
    assert fit.seconds_per_byte == pytest.approx(8e-9) and fit.allgather_seconds_per_byte == pytest.approx(16e-9)
    assert fit.allgather(1 << 20, 4) == pytest.approx(3e-4 + 3 * (1 << 20) * 16e-9)


def test_one_rank_pays_no_latency():
    """``LinkModel.latency``: 0 for one rank (no hop), for either kind of collective; so one rank's batched
    second collective saves nothing (its collectives cost nothing, its prediction is its local work)."""
    link = LinkModel(1e-4, 8e-9)
    assert link.latency(1) == 0.0 == link.latency(1, "allgather")
    assert link.latency(4) == pytest.approx(6e-4) and link.latency(4, "allgather") == pytest.approx(3e-4)
    s = stats(1 << 16, 16, 1, 40, 40)
    model = CostModel(Calibration(link))
    both = frozenset({"allgather", "allreduce"})
    for name in ("allgather", "two_phase"):
        assert model.predict(name, s, both) == model.predict(name, s) > 0


def test_a_link_pickled_before_the_allgather_had_its_own_cost_prices_it_as_the_allreduce():
    import pickle
    link = LinkModel(1e-4, 8e-9, 16e-9, 12e-9)
    assert pickle.loads(pickle.dumps(link)) == link
    old = LinkModel.__new__(LinkModel)
    old.__setstate__({"alpha_s": 1e-4, "seconds_per_byte": 8e-9})   # the fields a pickle of then holds
    assert old == LinkModel(1e-4, 8e-9, 8e-9, 8e-9) and old.allgather(1000, 4) == pytest.approx(3e-4 + 3 * 1000 * 8e-9)
    assert old.allreduce(1000, 4, half=True) == old.allreduce(1000, 4)


def test_a_half_precision_plan_is_priced_at_the_half_allreduce_s_own_slope():
    """An engine may sum float16 slower than float32 per byte (Horovod on the CPU: docs/BENCHMARKS.md), so
    the calibration times a float16 allreduce at the two largest sizes where a plan may go half
    (``measure_link``'s ``half_sizes``) and ``fit_link`` prices its bytes at their slope; an fp16 or bf16
    plan's plain step (and a half-precision part of a message) is priced at it. A half allreduce twice as
    dear per byte as float32 makes fp16 cost what dense does on the wire: not chosen for its local work.
    Where it was not timed, it is the float32 allreduce's."""
    link = LinkModel(1e-4, 8e-9)
    samples = [(k, b, link.allreduce(b, 2)) for b in (1 << 10, 1 << 18, 1 << 20) for k in ("allreduce",)]
    assert fit_link(samples, 2, LinkModel(0, 1)).half_seconds_per_byte == pytest.approx(8e-9)
    slow = samples + [("allreduce_half", b, link.allreduce(b, 2) + b * 8e-9) for b in (1 << 18, 1 << 20)]
    fit = fit_link(slow, 2, LinkModel(0, 1))
    assert fit.seconds_per_byte == pytest.approx(8e-9) and fit.half_seconds_per_byte == pytest.approx(16e-9)
    assert fit.alpha_s == pytest.approx(1e-4)
    s = stats(1 << 20, 1, 2, 1 << 20, 1 << 20)
    for half_beta, want in ((8e-9, "fp16"), (16e-9, "dense")):
        model = CostModel(Calibration(LinkModel(1e-4, 8e-9, None, half_beta)))
        assert model.predict("fp16", s) == pytest.approx(
            LinkModel(1e-4, half_beta).allreduce(2 << 20, 2) + DEFAULT_CODEC_SECONDS["fp16"][0] * (1 << 20))
        assert model.predict_message([("fp16", s)]) == pytest.approx(model.predict("fp16", s))
        assert model.choose(s, lossy=True, allowed=("dense", "fp16"))[0] == want
    # measured on a 1-rank "engine": the float16 allreduce at the sizes asked, after the float32 ones
    from lossless_hc.training.calibration import measure_link
    seen = []
    got = measure_link(lambda t: seen.append(t.dtype), lambda t: None, "cpu", (1024, 4096), 1, (4096,))
    assert [(k, b) for k, b, _ in got] == [("allreduce", 1024), ("allgather", 1024), ("allreduce", 4096),
                                           ("allgather", 4096), ("allreduce_half", 4096)]
    assert seen[-1] == torch.float16 and seen[0] == torch.float32


def test_a_degenerate_calibration_is_refused_not_planned_with():
    """A NaN or infinite time, a world size below 1 or no timed run gave a link of NaN or infinite cost
    per byte (every prediction NaN or inf: every tensor dense, and no switch ever), or a
    ZeroDivisionError (world size 0): each is a ValueError, and so is a link or local cost that is not a
    finite number >= 0, wherever a calibration comes from (default, fitted, broadcast, given)."""
    from lossless_hc.training.calibration import calibrate
    good = [("allreduce", 1024, 1e-4), ("allreduce", 1 << 20, 9e-3)]
    for bad in (float("nan"), float("inf")):
        with pytest.raises(ValueError, match="link sample"):
            fit_link(good[:1] + [("allreduce", 1 << 20, bad)], 4, LinkModel(0, 1))
    with pytest.raises(ValueError, match="link sample"):
        fit_link(good + [("allgather", -8, 1e-4)], 4, LinkModel(0, 1))
    for n in (0, -3):
        with pytest.raises(ValueError, match="world_size"):
            fit_link(good, n, LinkModel(0, 1))
    with pytest.raises(ValueError, match="repeats"):   # was: a link of infinite seconds per byte
        calibrate(lambda t: None, lambda t: None, lambda t: None, 0, 2, sizes=(1024, 1 << 20), repeats=0)
    for bits, latency in ((float("nan"), 1e-5), (float("inf"), 1e-5), (1e9, float("nan")), (0, 1e-5), (1e9, -1)):
        with pytest.raises(ValueError, match="bandwidth_bits"):
            Calibration.default(bits, latency)
    for link in ((float("nan"), 8e-9), (1e-4, float("nan")), (1e-4, -8e-9), (1e-4, 8e-9, float("inf"))):
        with pytest.raises(ValueError, match="LinkModel"):
            LinkModel(*link)
    with pytest.raises(ValueError, match="LinkModel"):
        Calibration.from_list([float("nan")] + Calibration.default().as_list()[1:])
    for costs in ((-1e-9, 0.0), (float("nan"), 0.0), (1e-9,)):
        with pytest.raises(ValueError, match="codec_seconds"):
            Calibration(LinkModel(1e-4, 8e-9), {"dense": costs})


def test_calibration_round_trips_through_a_flat_list():
    c = Calibration.default(bandwidth_bits=1e10, latency_s=1e-5)
    assert Calibration.from_list(c.as_list()) == c
    with pytest.raises(ValueError, match=r"a calibration has \d+ numbers, got 2"):
        Calibration.from_list([1.0, 2.0])


def test_tracker_replans_after_the_first_step_and_every_interval():
    tr = PlanTracker(1000, 10, 2, interval=4)
    due = [tr.observe((5, 7), 10) for _ in range(8)]
    assert due == [True, False, False, True, False, False, False, True]
    s = tr.stats()
    assert s.rank_keys == (5, 7) and s.union_keys == 10
    tr.force = True
    assert tr.observe((50, 7), 55)
    assert tr.stats().max_rank_keys == 50   # the spike is kept


def test_an_observation_after_unobserved_steps_weighs_as_that_many_steps():
    """A dense plan observes one step in ``interval``: an observation after m unobserved steps weighs
    1 - (1 - a)^(m+1), as m + 1 observations of the same counts would."""
    tr = PlanTracker(1000, 1, 2, interval=4, alpha=0.25)
    tr.observe((100, 100), 100, step=1)
    tr.observe((0, 0), 0, step=5)   # steps 2..4 unobserved: 4 steps' weight
    assert tr.rank_keys == [100 * 0.75 ** 4] * 2 and tr.union == 100 * 0.75 ** 4


def test_the_tracker_s_statistics_round_the_ewmas_up():
    """stats() rounds each rank's EWMA up (5.25 -> 6): a count rounded down would size a sketch or an
    allgather for fewer rows than the ranks hold on average."""
    tr = PlanTracker(1000, 1, 2, interval=4, alpha=0.25)
    tr.observe((5, 7), 12)
    tr.observe((6, 7), 13)
    assert tr.stats().rank_keys == (6, 7)


def test_tensor_stats_refuses_bad_fields():
    """A TensorStats the cost model cannot price is refused when built, with what is wrong."""
    ok = dict(numel=10, row=1, world_size=2, rank_keys=(1, 1), union_keys=2)
    TensorStats(**ok, element_bytes=2)
    for bad, match in ((dict(row=0), "row=0"), (dict(rank_keys=(1,)), "rank_keys"),
                       (dict(element_bytes=3), "element_bytes=3"),
                       # negative rows were priced: an allgather of (-5, -5) rows cheaper than one of none
                       (dict(rank_keys=(-5, -5)), "rank_keys must be counts"),
                       (dict(rank_keys=(1, float("nan"))), "rank_keys must be counts"),
                       (dict(union_keys=-3), "union_keys must be counts")):
        with pytest.raises(ValueError, match=match):
            TensorStats(**{**ok, **bad})


def test_a_second_collective_of_no_rows_is_neither_issued_nor_priced():
    """With no non-zero row on any rank, allgather's and two_phase's aggregators return after the first
    allreduce (strategies: no rows, no second request): the prediction is that allreduce and the local
    work, the empty allgather or allreduce of rows costing nothing, its latency included."""
    link = LinkModel(1e-4, 8e-9, 16e-9, 12e-9)
    model = CostModel(Calibration(link))
    s = stats(1 << 16, 16, 4, 0, 0)
    for name in ("allgather", "two_phase"):
        (_, head), (_, rows) = model.collectives(name, s)
        assert rows == 0
        assert model.predict(name, s) == pytest.approx(link.allreduce(head, 4) + model.local_seconds(name, s))
    assert link.allreduce(0, 4) == link.allreduce(0, 4, half=True) == link.allgather(0, 4) == 0.0
    # ... while any bytes at all pay the latency and their own (a one-byte collective is still issued)
    assert link.allreduce(1, 4) == pytest.approx(6e-4 + 1.5 * 8e-9, rel=1e-12)
    assert link.allreduce(1, 4, half=True) == pytest.approx(6e-4 + 1.5 * 12e-9, rel=1e-12)
    assert link.allgather(1, 4) == pytest.approx(3e-4 + 3 * 16e-9, rel=1e-12)
