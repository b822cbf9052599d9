"""The planner's cost model (lossless_hc.training.planner): its decisions over synthetic statistics,
its wire sizes against the real layouts, the link fit and the calibration's format, the re-plan cadence,
and the statistics it refuses. The strategies it prices, run: tests/test_planner.py."""
import math

import pytest
import torch

from lossless_hc.lhc.cost_model import plan_layout
from lossless_hc.training.calibration import fit_link
from lossless_hc.training.plan_tracker import PlanTracker
from lossless_hc.training.planner import (DEFAULT_CODEC_SECONDS, EXACT_STRATEGIES, LOSSY_STRATEGIES, Calibration,
                                          CostModel, LinkModel, TensorStats, batched_second_collectives,
                                          bitmap_words, sketch_capacity, stats_header_words)

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
    with pytest.raises(ValueError):
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
    allreduce is every strategy's and keeps its latency. On a slow-latency link that turns a mid-sized
    tensor's top-k from the sketch (one allreduce) to the allgather its bucket-mates already make."""
    model = CostModel(Calibration.default(bandwidth_bits=1e9, latency_s=1e-3))
    alpha = model.calibration.link.alpha_s
    n = 4
    s = stats(1 << 15, 1, n, 1 << 15, 1 << 15)
    both = frozenset({"allgather", "allreduce"})
    for strategy in ("dense", "sketch", "topk", "thc", "bf16"):
        assert model.predict(strategy, s, both) == model.predict(strategy, s)
    assert math.isclose(model.predict("topk_allgather", s, frozenset({"allgather"})),
                        model.predict("topk_allgather", s) - (n - 1) * alpha, rel_tol=1e-12)
    assert model.predict("topk_allgather", s, frozenset({"allreduce"})) == model.predict("topk_allgather", s)
    sparse = stats(1 << 20, 64, n, 50, 180)
    assert math.isclose(model.predict("two_phase", sparse, both),
                        model.predict("two_phase", sparse) - 2 * (n - 1) * alpha, rel_tol=1e-12)
    assert math.isclose(model.predict("allgather", sparse, both),
                        model.predict("allgather", sparse) - (n - 1) * alpha, rel_tol=1e-12)
    top = ("topk", "topk_allgather")
    assert model.choose(s, lossy=True, allowed=top)[0] == "topk"
    assert model.choose(s, lossy=True, allowed=top, batched=frozenset({"allgather"}))[0] == "topk_allgather"


def test_a_message_s_second_collectives_are_counted_per_tensor_without_its_own():
    assert batched_second_collectives(["dense", "allgather", "topk_allgather", "two_phase", "sketch"]) == [
        {"allgather", "allreduce"}, {"allgather", "allreduce"}, {"allgather", "allreduce"}, {"allgather"},
        {"allgather", "allreduce"}]
    assert batched_second_collectives(["allgather", "dense"]) == [set(), {"allgather"}]
    assert batched_second_collectives(["two_phase", "two_phase", "thc"]) == [{"allreduce"}] * 3
    assert batched_second_collectives(["topk", "bf16"]) == [set(), set()]
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
    from lossless_hc.training.planner import sketch_payload_numel
    link = MODEL.calibration.link
    for sparse in (False, True):
        for n, k, union in ((2, 40, 70), (3, 40, 100), (16, 500, 4000)):
            s = TensorStats(1 << 18, 16, n, (k,) * n, union, sparse=sparse)
            spare = 4 * (sketch_payload_numel(s) - sketch_capacity(s)[1])
            assert spare >= 0
            want = link.allreduce(MODEL.wire_bytes("sketch", s) - spare, n) + MODEL.local_seconds("sketch", s)
            assert MODEL.sketch_floor(s) == pytest.approx(want, rel=1e-12), (s, MODEL.sketch_floor(s), want)
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
    assert MODEL.wire_bytes("sketch", s) == H + plan_layout(1 << 16, 3, cap, 16, 0, union_nnz=union).wire_bytes
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


def test_link_fit_prices_the_bytes_a_token_bucket_lets_through_at_memory_speed():
    """Samples timed on the emulated cluster (2 hosts, 1 Gbit/s by tbf with a 256 KiB bucket, Gloo, the
    fastest of three after a warm-up; 2026-12-03): the 256 KiB allreduce passed in half its line-rate time
    and the small sizes carry scheduling noise, so a fit in relative error through the samples up to 1 MiB
    (the calibration before) gave 4.6e-9 s per byte where a 16 MiB allreduce took 8.4e-9 per byte
    (140.5 ms). The slope between the two largest sizes prices the allreduce's 16 MiB within 10% and Gloo's
    allgather's (237.9 ms, dearer per byte as it grows) within 20%, and the latency is the smallest round
    trip's: on a netem link (100 us one-way) whose 1 MiB allgather is slower per byte than the rest, which
    once fitted a latency clamped to 0, it stays the 1 KiB round trip's."""
    samples = [("allreduce", 1024, 6.00e-4), ("allgather", 1024, 3.42e-4), ("allreduce", 32768, 5.49e-4),
               ("allgather", 32768, 5.83e-4), ("allreduce", 262144, 1.155e-3), ("allgather", 262144, 1.594e-3),
               ("allreduce", 1048576, 8.738e-3), ("allgather", 1048576, 1.1568e-2),
               ("allreduce", 4194304, 3.5081e-2), ("allgather", 4194304, 5.0032e-2)]
    fit = fit_link(samples, 2, LinkModel(0, 1))
    assert fit.allreduce(16 << 20, 2) == pytest.approx(140.5e-3, rel=0.1)
    assert fit.allgather(16 << 20, 2) == pytest.approx(237.9e-3, rel=0.2)
    assert fit.seconds_per_byte == pytest.approx(8.4e-9, rel=0.05)
    assert 2.5e-4 < fit.alpha_s < 3.4e-4                      # min(600 us / 2 hops, 342 us / 1) less the bytes
    # a noise-inverted pair of latency-bound sizes prices the bytes at the larger one's mean cost, not below 0
    tiny = fit_link(samples[:4], 2, LinkModel(0, 1))
    assert tiny.seconds_per_byte == pytest.approx(5.49e-4 / 32768) and tiny.alpha_s >= 0
    netem = [("allreduce", 1024, 3.634e-4), ("allgather", 1024, 1.734e-4), ("allreduce", 32768, 5.162e-4),
             ("allgather", 32768, 4.103e-4), ("allreduce", 262144, 1.930e-3), ("allgather", 262144, 1.955e-3),
             ("allreduce", 1048576, 8.502e-3), ("allgather", 1048576, 1.0659e-2)]
    assert 1.2e-4 < fit_link(netem, 2, LinkModel(0, 1)).alpha_s < 2.2e-4


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
    with pytest.raises(ValueError):
        Calibration.from_list([1.0, 2.0])


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_the_calibration_times_thc_on_the_device(device):
    """THC's local work is measured like the others' (a steady step's encode of the interleave and decode,
    then the copy of the result), on the calibrating rank's device, not left at DEFAULT_CODEC_SECONDS' 30 ns
    per coordinate, which is 5-10x a 2-core CPU's THC step (docs/BENCHMARKS.md) and further still from a GPU's."""
    import torch
    from lossless_hc.training.calibration import measure_codecs
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    measured = measure_codecs(device, 4, numel=1 << 16, repeats=1)
    per_coord, per_key = measured["thc"]
    assert per_key == 0.0 and measured["thc"] != DEFAULT_CODEC_SECONDS["thc"]
    assert measured["dense"][0] < per_coord < 1e-6


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_the_calibration_times_a_top_k_plan_s_step_where_top_k_is_a_candidate(device):
    """Top-k's local work is measured on the device by running an auto top-k plan's step (one rank's encode
    per coordinate, the decode of several ranks' summed payloads per key of their union), where top-k is a
    candidate (``AutoSpec``: lossy, top-k allowed); not left at DEFAULT_CODEC_SECONDS' 15 ns + 15 ns per key,
    a guess from a 2-core CPU (docs/BENCHMARKS.md) and far from a GPU's step. An exact spec keeps the
    default and spends no time on it."""
    from lossless_hc.training.auto import AutoSpec
    from lossless_hc.training.calibration import measure_codecs
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    # Measured, in seconds: positive and far below a microsecond a coordinate (a millisecond unit would be
    # 1e3 x above it). No comparison with another strategy's time: beside a loaded machine's other work the
    # dense copy was once timed above top-k's step.
    measured = measure_codecs(device, 4, numel=1 << 16, repeats=3, topk_ratio=0.01)
    per_coord, per_key = measured["topk"]
    assert 0 < per_coord < 1e-6 and 0 < per_key < 1e-4, measured["topk"]
    # and top-k allgathered's step: the selection per coordinate, the gathered pairs' sum per pair. The pairs'
    # price is the sum's time beyond a clearing of the result, floored at 0: beside other work the clearing's
    # best time once exceeded the sum's, a price of 0 (the mapping itself: the timer test below).
    per_coord, per_pair = measured["topk_allgather"]
    assert 0 < per_coord < 1e-6 and 0 <= per_pair < 1e-4, measured["topk_allgather"]
    unmeasured = measure_codecs(device, 4, numel=1 << 16, repeats=1)
    assert unmeasured["topk"] == DEFAULT_CODEC_SECONDS["topk"]
    assert unmeasured["topk_allgather"] == DEFAULT_CODEC_SECONDS["topk_allgather"]

    def specs_topk(**options):   # a one-rank "engine": no link samples, rank 0's local costs
        spec = AutoSpec(**options)
        spec.measure(lambda t: None, lambda t: None, lambda t: None, 0, 1, device)
        return spec.calibration.codec_seconds["topk"]
    assert specs_topk(lossy=True) != DEFAULT_CODEC_SECONDS["topk"]
    assert specs_topk(lossy=True, strategies=("dense", "fp16")) == DEFAULT_CODEC_SECONDS["topk"]
    assert specs_topk() == DEFAULT_CODEC_SECONDS["topk"]


def test_each_calibration_measurement_prices_the_strategy_it_is_for():
    """measure_codecs' mapping of its measurements to strategies' costs (its docstring's formulas), with a
    timer that runs each measured step once and returns a distinct time per measurement: a timer that only
    measures cannot tell fp16's time from bf16's, two scans from one, or a per-key cost divided by the
    coordinates. Every measurement is timed exactly once, under its documented name."""
    from lossless_hc.training.calibration import (CODEC_MEASUREMENTS, POWERSGD_MATRIX, POWERSGD_RANK, TOPK_MEASUREMENTS,
                                                  TOPK_NUMEL, TOPK_RANKS, measure_codecs)
    from lossless_hc.training.powersgd import powersgd_layout
    from lossless_hc.training.topk_aggregate import topk_count
    names = CODEC_MEASUREMENTS + TOPK_MEASUREMENTS
    # distinct primes (milliseconds): no sum or difference of two of them equals a third's multiple here
    t = dict(zip(names, (1e-3 * p for p in (2, 3, 5, 7, 101, 11, 13, 17, 19, 23, 3, 29, 31))))
    seen = []

    def timer(what, fn):
        fn()
        seen.append(what)
        return t[what]
    numel, density, ratio, world = 1 << 16, 0.01, 0.01, 4
    out = measure_codecs("cpu", world, numel=numel, density=density, topk_ratio=ratio, timer=timer)
    assert sorted(seen) == sorted(names)
    d, k = numel, max(1, int(density * numel))
    flops = powersgd_layout([POWERSGD_MATRIX], POWERSGD_RANK, 1).flops
    kk = topk_count(TOPK_NUMEL, ratio)
    m, m_ag = min(world, TOPK_RANKS), max(2, min(world, TOPK_RANKS))
    expected = {
        "dense": (t["copy"] / d, 0.0),
        "allgather": (t["scan"] / d, 2 * t["copy"] / d),
        "two_phase": (2 * t["scan"] / d, 2 * t["copy"] / d),
        "sketch": (t["scan"] / d, (t["sketch"] - t["scan"]) / k),
        "fp16": ((t["fp16"] + t["copy"]) / d, 0.0),
        "bf16": ((t["bf16"] + t["copy"]) / d, 0.0),
        "thc": ((t["thc"] + t["copy"]) / d, 0.0),
        "powersgd": (t["powersgd_passes"] / d, t["powersgd_products"] / flops),
        "topk": (t["topk_encode"] / TOPK_NUMEL, t["topk_decode"] / (m * kk)),
        "topk_allgather": ((t["topk_allgather_request"] + t["topk_allgather_clear"]) / TOPK_NUMEL,
                           (t["topk_allgather_finish"] - t["topk_allgather_clear"]) / (m_ag * kk)),
    }
    for strategy, costs in expected.items():
        assert out[strategy] == pytest.approx(costs, rel=1e-12), strategy
    assert set(out) == set(DEFAULT_CODEC_SECONDS)
    # A sketch step timed below its scan prices the keys at 0, never a negative cost.
    t["sketch"] = t["scan"] / 2
    assert measure_codecs("cpu", world, numel=numel, density=density, timer=timer)["sketch"] == (t["scan"] / d, 0.0)


def test_measure_codecs_times_each_measurement_by_the_fastest_of_3_runs_by_default(monkeypatch):
    """measure_codecs' default timer (no ``timer``): each measurement is the fastest of ``repeats`` runs, 3 by
    default (docs/DESIGN.md: the fastest of 3), after an untimed warm-up. On a fake clock whose readings pair
    up as (start, end) of each timed run: the copy's runs take 5, 4 and 2 s, every later run 1 s, so the
    dense copy is priced at 2 s over the coordinates and the scan at 1 s (a fourth copy run would take 1 s)."""
    import types

    import lossless_hc.training.calibration as calibration
    readings = iter([0.0, 5.0, 0.0, 4.0, 0.0, 2.0] + [0.0, 1.0] * 64)
    monkeypatch.setattr(calibration, "time", types.SimpleNamespace(perf_counter=lambda: next(readings)))
    d = 1 << 10
    out = calibration.measure_codecs("cpu", 2, numel=d)
    assert out["dense"] == (2.0 / d, 0.0) and out["allgather"] == (1.0 / d, 4.0 / d)


def test_one_rank_s_top_k_step_is_priced_per_its_own_keys_and_top_k_allgathered_s_per_two_ranks_pairs():
    """measure_codecs' top-k prices at one rank (``AutoSpec.measure`` on a one-rank engine): the top-k decode per
    key of ``m = min(n, TOPK_RANKS)`` ranks' selections, here its own ``k``; top-k allgathered's sum per pair of
    at least 2 ranks (one rank's tensor is only ever dense: _topk_allgather_step), beyond the clearing and never
    below 0."""
    from lossless_hc.training.calibration import TOPK_NUMEL, measure_codecs
    from lossless_hc.training.topk_aggregate import topk_count
    t = {"topk_decode": 6e-3, "topk_allgather_finish": 9e-3, "topk_allgather_clear": 1e-3}

    def measure():
        return measure_codecs("cpu", 1, numel=1 << 10, topk_ratio=0.01,
                              timer=lambda what, fn: (fn(), t.get(what, 1e-3))[1])
    out = measure()
    k = topk_count(TOPK_NUMEL, 0.01)
    assert out["topk"][1] == pytest.approx(6e-3 / k, rel=1e-12, abs=0)
    assert out["topk_allgather"][1] == pytest.approx(8e-3 / (2 * k), rel=1e-12, abs=0)
    t["topk_allgather_finish"] = 5e-4   # the sum timed below the clearing (a loaded machine): 0 a pair, not below
    assert measure()["topk_allgather"][1] == 0.0


def test_a_density_below_one_key_prices_the_sketch_s_keys_per_one_key():
    """measure_codecs' doc: ``k = max(1, int(density d))``. A density that rounds to no key times the sketch of
    one key and prices its time beyond the scan per that one key (not per none, nor per two)."""
    from lossless_hc.training.calibration import measure_codecs
    t = {"scan": 3e-3, "sketch": 1e-2}
    out = measure_codecs("cpu", 2, numel=1 << 10, density=1e-4, timer=lambda what, fn: (fn(), t.get(what, 1e-3))[1])
    assert out["sketch"] == pytest.approx((t["scan"] / (1 << 10), t["sketch"] - t["scan"]), rel=1e-12, abs=0)


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


def test_the_link_is_timed_only_up_to_the_largest_tensor():
    from lossless_hc.training.calibration import LINK_SIZES, link_sizes
    assert link_sizes(128 << 10) == (1 << 10, 1 << 15, 128 << 10)   # DigitsCNN's largest gradient
    assert link_sizes(100) == (1 << 10, 1 << 15)                     # a latency and a bandwidth point at least
    assert link_sizes(64 << 20) == LINK_SIZES                        # capped at 4 MiB
    assert LINK_SIZES == (1 << 10, 1 << 15, 1 << 18, 1 << 20, 1 << 22)   # docs/DESIGN.md, "Calibration"
    assert link_sizes((1 << 20) + 4) == (1 << 10, 1 << 15, 1 << 18, (1 << 20) + 4)   # the slope spans 4x


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


def test_link_fit_takes_each_size_s_fastest_sample_and_a_flat_pair_s_mean_cost():
    """Samples repeated at a size (every rank's, or several calibrations' together) count by their fastest:
    scheduling noise only ever adds to a collective's time. Two largest sizes timed alike (a slope of exactly
    0) price the bytes at the larger one's mean cost, as a negative slope does, never at 0 (every byte free)."""
    link = LinkModel(1e-4, 8e-9)
    fast = [(k, b, (link.allreduce if k == "allreduce" else link.allgather)(b, 4))
            for b in (1 << 10, 1 << 16, 1 << 20) for k in ("allreduce", "allgather")]
    noisy = [(k, b, 3 * t) for k, b, t in fast]
    assert fit_link(noisy + fast + noisy, 4, LinkModel(0, 1)) == fit_link(fast, 4, LinkModel(0, 1))
    flat = [("allreduce", 1 << 10, 2e-4), ("allreduce", 1 << 16, 5e-4), ("allreduce", 1 << 20, 5e-4)]
    fit = fit_link(flat, 4, LinkModel(0, 1))
    assert fit.seconds_per_byte == pytest.approx(5e-4 / (1.5 * (1 << 20)), rel=1e-12, abs=0)


def test_link_latency_is_the_smallest_size_s_least_per_hop():
    """The latency is the least, over the collectives timed at the smallest size, of its time less its bytes
    per hop: scheduling noise only adds to a round trip. An allgather three times as slow per hop there does
    not raise it."""
    quick, slow = LinkModel(1e-4, 8e-9), LinkModel(3e-4, 8e-9)
    samples = [(k, b, (quick.allreduce(b, 4) if k == "allreduce" else slow.allgather(b, 4)))
               for b in (1 << 10, 1 << 16, 1 << 20) for k in ("allreduce", "allgather")]
    fit = fit_link(samples, 4, LinkModel(0, 1))
    assert fit.alpha_s == pytest.approx(1e-4, rel=1e-9) and fit.seconds_per_byte == pytest.approx(8e-9, rel=1e-9)


def test_calibrate_fits_rank_0_s_samples_and_every_rank_takes_the_broadcast():
    """calibrate() on one process standing in for ranks 0 and 1 of 4 (collectives that do nothing): rank 0's
    link is fit_link of the samples it timed at the world size it was given, with the half allreduce timed at
    the two largest sizes; rank 1 returns what the broadcast brings, not its own numbers."""
    from lossless_hc.training.calibration import calibrate
    samples = []
    cal = calibrate(lambda t: None, lambda t: None, lambda t: None, 0, 4, sizes=(1 << 10, 1 << 15, 1 << 18),
                    repeats=1, samples_out=samples, half=True)
    assert [b for k, b, _ in samples if k == "allreduce_half"] == [1 << 15, 1 << 18]
    assert cal.link == fit_link(samples, 4, Calibration.default().link)
    sent = Calibration.default(bandwidth_bits=1e9, latency_s=3e-5)

    def broadcast(t):
        t.copy_(torch.tensor(sent.as_list(), dtype=torch.float64))
    assert calibrate(lambda t: None, lambda t: None, broadcast, 1, 4, sizes=(1 << 10, 1 << 15), repeats=1) == sent


def test_link_latency_is_floored_at_zero_and_sizes_span_a_factor_of_4():
    """A smallest sample quicker than the bytes' slope predicts (a burst) fits a latency of 0, not a negative
    one that no LinkModel takes; link_sizes keeps only sizes a quarter of the largest or less below it."""
    from lossless_hc.training.calibration import link_sizes
    samples = [("allreduce", 1 << 10, 1e-7), ("allreduce", 1 << 18, 1e-3), ("allreduce", 1 << 20, 4e-3)]
    fit = fit_link(samples, 2, LinkModel(0, 1))
    assert fit.alpha_s == 0.0 and fit.seconds_per_byte == pytest.approx(3e-3 / (3 << 18), rel=1e-12)
    assert link_sizes(1 << 19) == (1 << 10, 1 << 15, 1 << 19)   # 256 KiB is more than a quarter of 512 KiB
    assert link_sizes(3 << 18) == (1 << 10, 1 << 15, 3 << 18)   # and of 768 KiB, of which it is a third


def test_a_link_timed_by_allgathers_alone_prices_every_collective_at_their_slope():
    """fit_link's doc: a kind not timed at two sizes takes the allreduce's per-byte cost, the allreduce the
    allgather's. Allgathers alone (an engine whose allreduce was not timed) fit the allreduce and the half
    allreduce at the allgather's slope, and the latency from the allgather's smallest size."""
    link = LinkModel(1e-4, 8e-9, 16e-9)
    samples = [("allgather", b, link.allgather(b, 4)) for b in (1 << 10, 1 << 16, 1 << 20)]
    fit = fit_link(samples, 4, LinkModel(0, 1))
    assert fit.alpha_s == pytest.approx(1e-4, rel=1e-9)
    for beta in (fit.seconds_per_byte, fit.allgather_seconds_per_byte, fit.half_seconds_per_byte):
        assert beta == pytest.approx(16e-9, rel=1e-9)


def test_link_samples_of_no_bytes_are_taken_and_an_unknown_collective_is_refused():
    """fit_link refuses negative bytes (-1 as much as -8), not none: a sample of 0 bytes (a bare round trip)
    is the smallest size, whose time per hop is the latency, and a slope is taken between any two sizes, a
    byte apart too. A kind it does not know is a ValueError naming it, wherever it comes among the samples,
    not a sample priced as the one before it."""
    samples = [("allreduce", 0, 6e-4), ("allreduce", 1 << 16, 1e-3), ("allreduce", 1 << 20, 4e-3)]
    fit = fit_link(samples, 4, LinkModel(0, 1))
    assert fit.alpha_s == pytest.approx(6e-4 / 6, rel=1e-12)   # 2 (n - 1) hops, no bytes
    assert fit.seconds_per_byte == pytest.approx(3e-3 / (1.5 * ((1 << 20) - (1 << 16))), rel=1e-12)
    near = fit_link([("allreduce", 0, 6e-4), ("allreduce", 1, 7.5e-4)], 4, LinkModel(0, 1))
    assert near.seconds_per_byte == pytest.approx(1.5e-4 / 1.5, rel=1e-9) and near.alpha_s == pytest.approx(1e-4)
    for bad in (-1, -0.5):
        with pytest.raises(ValueError, match="link sample"):
            fit_link(samples + [("allgather", bad, 1e-4)], 4, LinkModel(0, 1))
    for at in (0, 3):
        with pytest.raises(ValueError, match="unknown collective 'broadcast'"):
            fit_link(samples[:at] + [("broadcast", 1 << 10, 1e-4)] + samples[at:], 4, LinkModel(0, 1))


def test_a_time_of_zero_or_below_is_floored_at_a_timer_s_tick():
    """fit_link's doc: a negative time (and a timer too coarse to see one, 0) is floored at a tick, 1e-9 s, not
    taken: a largest size timed so prices its bytes at a tick over its bytes (the slope below 0 falls back to
    the mean), not at 0 s (every byte free) nor below."""
    for t in (0.0, -5.0):
        fit = fit_link([("allreduce", 1 << 10, 1e-4), ("allreduce", 1 << 20, t)], 2, LinkModel(0, 1))
        assert fit.seconds_per_byte == pytest.approx(1e-9 / (1 << 20), rel=1e-12, abs=0), t


def test_measure_link_sends_the_bytes_asked_and_keeps_the_fastest_timed_run(monkeypatch):
    """measure_link's collectives carry the bytes per rank asked (float32: B / 4 elements, the half allreduce's
    float16: B / 2; one element at least), each size costs a warm-up and ``repeats`` timed runs (link_sizes'
    doc: 1 + repeats; 3 by default, as calibrate's), and a sample is the fastest timed run, the warm-up never
    counted. Here on a fake clock that each collective advances by the next of the given whole seconds."""
    import types

    import lossless_hc.training.calibration as calibration
    clock = [0.0]
    monkeypatch.setattr(calibration, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    # per size and collective: the warm-up (1 s: faster than any timed run, so counting it would show), 3 runs
    durations = iter([1, 7, 3, 5, 1, 4, 6, 2,      # 1024 B: allreduce, allgather
                      1, 9, 8, 8, 1, 3, 3, 4,      # 2 B: one float32
                      1, 5, 6, 2, 1, 4, 8, 6])     # the float16 allreduces of 4096 B and of 1 B (one float16)
    calls = []

    def collective(kind):
        def run(t):
            calls.append((kind, t.dtype, t.numel()))
            clock[0] += next(durations)
        return run
    got = calibration.measure_link(collective("allreduce"), collective("allgather"), "cpu", (1024, 2),
                                   half_sizes=(4096, 1))
    assert got == [("allreduce", 1024, 3.0), ("allgather", 1024, 2.0), ("allreduce", 2, 8.0), ("allgather", 2, 3.0),
                   ("allreduce_half", 4096, 2.0), ("allreduce_half", 1, 4.0)]
    assert calls == [(kind, dtype, numel) for kind, dtype, numel in (
        ("allreduce", torch.float32, 256), ("allgather", torch.float32, 256), ("allreduce", torch.float32, 1),
        ("allgather", torch.float32, 1), ("allreduce", torch.float16, 2048), ("allreduce", torch.float16, 1))
        for _ in range(4)]


def test_every_timing_entry_point_refuses_no_repeats():
    """check_repeats (an int >= 1, returned as given) guards each function that times runs: measure_link and
    measure_codecs refuse 0 or fewer repeats with a ValueError before timing anything, as calibrate does,
    instead of an infinite time (no run) that prices every byte at infinity."""
    from lossless_hc.training.calibration import check_repeats, measure_codecs, measure_link
    assert check_repeats(2) == 2

    def refuse(t):
        raise AssertionError("a collective was issued")
    for bad in (0, -1):
        with pytest.raises(ValueError, match="repeats"):
            measure_link(refuse, refuse, "cpu", (1024,), bad)
        with pytest.raises(ValueError, match="repeats"):
            measure_codecs("cpu", 2, numel=1 << 10, repeats=bad)


def test_calibrate_on_one_rank_issues_no_collective_and_with_its_defaults_times_each_size_1_plus_3_times():
    """One rank has no link to time and no rank to agree with: calibrate issues no collective, leaves
    ``samples_out`` empty and keeps its default's link, and refuses 0 repeats as every world size does. With
    its defaults a rank of several times each size's float32 allreduce and allgather once to warm up and 3
    times (docs/DESIGN.md: the fastest of 3), no float16 one (``half`` off), then takes the one broadcast."""
    from lossless_hc.training.calibration import calibrate

    def refuse(t):
        raise AssertionError("a collective was issued")
    given, samples = Calibration.default(bandwidth_bits=1e9, latency_s=3e-5), []
    assert calibrate(refuse, refuse, refuse, 0, 1, default=given, samples_out=samples).link == given.link
    assert samples == []
    with pytest.raises(ValueError, match="repeats"):
        calibrate(refuse, refuse, refuse, 0, 1, repeats=0)
    sent, calls = Calibration.default(), []

    def broadcast(t):
        calls.append(("broadcast", t.dtype))
        t.copy_(torch.tensor(sent.as_list(), dtype=torch.float64))
    got = calibrate(lambda t: calls.append(("allreduce", t.dtype)), lambda t: calls.append(("allgather", t.dtype)),
                    broadcast, 1, 4, sizes=(1 << 10, 1 << 15), samples_out=samples)
    assert got == sent and [(k, b) for k, b, _ in samples] == [(k, b) for b in (1 << 10, 1 << 15)
                                                                for k in ("allreduce", "allgather")]
    assert calls == 2 * ([("allreduce", torch.float32)] * 4 + [("allgather", torch.float32)] * 4) + [
        ("broadcast", torch.float64)]


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
