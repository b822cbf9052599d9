"""The calibration (lossless_hc.training.calibration): the link fit (fit_link) over timed samples, the
sizes and repeats it times (link_sizes, measure_link), the codecs' local work each strategy is priced with
(measure_codecs, on the calibrating rank's device), and calibrate()'s collectives on rank 0 and the others.
The cost model that prices plans with it: tests/test_planner_cost.py."""
import pytest
import torch

from lossless_hc.training.calibration import fit_link
from lossless_hc.training.planner import DEFAULT_CODEC_SECONDS, Calibration, LinkModel


def no_collective(t):
    """A collective that a test expects never to be issued."""
    raise AssertionError("a collective was issued")


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


@pytest.mark.parametrize("topk_numel", [None, (1 << 14) + 3])
def test_each_calibration_measurement_prices_the_strategy_it_is_for(topk_numel):
    """measure_codecs' mapping of its measurements to strategies' costs (its docstring's formulas), with a
    timer that runs each measured step once and returns a distinct time per measurement: a timer that only
    measures cannot tell fp16's time from bf16's, two scans from one, or a per-key cost divided by the
    coordinates. Every measurement is timed exactly once, under its documented name; top-k's steps on
    ``topk_numel`` coordinates (TOPK_NUMEL by default), which its prices are per."""
    from lossless_hc.training.calibration import (CODEC_MEASUREMENTS, POWERSGD_MATRIX, POWERSGD_RANK, TOPK_MEASUREMENTS,
                                                  TOPK_NUMEL, TOPK_RANKS, measure_codecs)
    from lossless_hc.training.powersgd import powersgd_layout
    from lossless_hc.training.topk_aggregate import topk_count
    names = CODEC_MEASUREMENTS + TOPK_MEASUREMENTS
    # distinct primes (milliseconds): no sum or difference of two of them equals a third's multiple here
    t = dict(zip(names, (1e-3 * p for p in (2, 3, 5, 7, 101, 11, 13, 17, 19, 23, 3, 29, 31))))
    seen, cleared = [], []
    tn = TOPK_NUMEL if topk_numel is None else topk_numel

    def timer(what, fn):
        result = fn()
        seen.append(what)
        if what == "topk_allgather_clear":
            cleared.append(result.numel())   # the result a top-k-allgather step writes: the tensor's size
        return t[what]
    numel, density, ratio, world = 1 << 16, 0.01, 0.01, 4
    given = {} if topk_numel is None else {"topk_numel": topk_numel}
    out = measure_codecs("cpu", world, numel=numel, density=density, topk_ratio=ratio, timer=timer, **given)
    assert sorted(seen) == sorted(names) and cleared == [tn]
    d, k = numel, max(1, int(density * numel))
    flops = powersgd_layout([POWERSGD_MATRIX], POWERSGD_RANK, 1).flops
    kk = topk_count(tn, ratio)
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
        "topk": (t["topk_encode"] / tn, t["topk_decode"] / (m * kk)),
        "topk_allgather": ((t["topk_allgather_request"] + t["topk_allgather_clear"]) / tn,
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


@pytest.mark.parametrize("world_size", [2, 4])
def test_the_timed_top_k_step_is_one_between_statistics_steps(world_size, monkeypatch):
    """_topk_step's doc: the step it times is one between statistics steps, as all but one in an interval run:
    the encode scans no rows (``ctx.observed`` False) and its decode is the plan's own, the inexact keys'
    request included (random selections summed over several ranks leave some keys INEXACT at every step).
    The first step's request is finished as a plan finishes it; left open, the step was never counted and
    every encode timed was a first, statistics step (with its row scan). _topk_allgather_step's likewise: the
    request timed and the gathered pairs whose sum is timed are of steps between statistics steps."""
    import lossless_hc.training.calibration as calibration
    seen, planned = {}, {}

    def planned_ranks(strategy, *args, real=calibration._planned_ranks):
        planned[strategy] = real(strategy, *args)
        return planned[strategy]
    monkeypatch.setattr(calibration, "_planned_ranks", planned_ranks)

    def timer(what, fn):
        if what == "topk_allgather_finish":   # the finish timed: of which step's context
            agg = planned["topk_allgather"][0][0]
            agg.finish = lambda ctx, *a, real=agg.finish, **k: (seen.__setitem__("summed", ctx.observed),
                                                                real(ctx, *a, **k))[1]
        result = fn()
        if what == "topk_encode":
            seen["observed"] = result[1].observed   # (payload, AutoContext)
        if what == "topk_decode":
            seen["requests"] = result.request.kind if result.request is not None else None
        if what == "topk_allgather_request":
            seen["gathered"] = result[0].observed   # (AutoContext, the request's slots)
        return 1e-3
    calibration.measure_codecs("cpu", world_size, numel=1 << 10, topk_ratio=0.01, timer=timer)
    assert seen == {"observed": False, "requests": "allreduce", "gathered": False, "summed": False}, seen


def test_a_density_below_one_key_prices_the_sketch_s_keys_per_one_key():
    """measure_codecs' doc: ``k = max(1, int(density d))``. A density that rounds to no key times the sketch of
    one key and prices its time beyond the scan per that one key (not per none, nor per two)."""
    from lossless_hc.training.calibration import measure_codecs
    t = {"scan": 3e-3, "sketch": 1e-2}
    out = measure_codecs("cpu", 2, numel=1 << 10, density=1e-4, timer=lambda what, fn: (fn(), t.get(what, 1e-3))[1])
    assert out["sketch"] == pytest.approx((t["scan"] / (1 << 10), t["sketch"] - t["scan"]), rel=1e-12, abs=0)


def test_the_link_is_timed_only_up_to_the_largest_tensor_and_only_where_the_fit_reads():
    """link_sizes' doc: the smallest size (fit_link's latency), the largest at most a quarter of the top and the
    top (its slope); no size between, which fit_link would not read."""
    from lossless_hc.training.calibration import LINK_SIZES, link_sizes
    assert link_sizes(128 << 10) == (1 << 10, 1 << 15, 128 << 10)   # DigitsCNN's largest gradient
    assert link_sizes(100) == (1 << 10, 1 << 15)                     # a latency and a bandwidth point at least
    assert link_sizes(64 << 20) == (1 << 10, 1 << 20, 1 << 22)       # capped at 4 MiB
    assert LINK_SIZES == (1 << 10, 1 << 15, 1 << 18, 1 << 20, 1 << 22)   # docs/DESIGN.md, "Calibration"
    assert link_sizes((1 << 20) + 4) == (1 << 10, 1 << 18, (1 << 20) + 4)   # the slope spans 4x
    assert link_sizes(1280000) == (1 << 10, 1 << 18, 1280000)        # NCF's 10,000 x 32 tables
    assert link_sizes(1 << 17) == (1 << 10, 1 << 15, 1 << 17)        # exactly 4x: the quarter is in


def test_top_k_is_timed_on_the_model_s_largest_tensor_within_bounds():
    """topk_numel_for's doc: the largest tensor's float32 coordinates, clamped to [TOPK_MIN_NUMEL, TOPK_NUMEL];
    TOPK_NUMEL for an unknown model; a negative or non-integer size refused."""
    from lossless_hc.training.calibration import TOPK_MIN_NUMEL, TOPK_NUMEL, topk_numel_for
    from lossless_hc.training.planner import LOSSY_MIN_BYTES
    assert (TOPK_NUMEL, TOPK_MIN_NUMEL) == (1 << 20, LOSSY_MIN_BYTES // 4)
    assert topk_numel_for(None) == TOPK_NUMEL
    assert topk_numel_for(1280000) == 320000                          # NCF's tables
    assert topk_numel_for(1 << 30) == TOPK_NUMEL
    assert topk_numel_for(4 * TOPK_MIN_NUMEL - 4) == topk_numel_for(0) == TOPK_MIN_NUMEL
    assert topk_numel_for(4 * TOPK_MIN_NUMEL + 7) == TOPK_MIN_NUMEL + 1   # whole coordinates
    for bad, error in ((-4, ValueError), (4.0, TypeError)):
        with pytest.raises(error, match="largest_bytes must be"):
            topk_numel_for(bad)


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


def test_calibrate_times_the_local_work_with_its_repeats(monkeypatch):
    """calibrate(repeats=r) takes the fastest of r runs of each local measurement too, not measure_codecs'
    default (a caller asking for 1 run, to calibrate fast, paid for 3); and its top-k steps on the
    ``topk_numel`` it is given (TOPK_NUMEL by default)."""
    import lossless_hc.training.calibration as calibration
    asked = []

    def measure_codecs(device, world_size, repeats=3, topk_ratio=None, topk_numel=None):
        asked.append((repeats, topk_numel))
        return Calibration.default().codec_seconds
    monkeypatch.setattr(calibration, "measure_codecs", measure_codecs)
    for repeats, numel in ((1, {}), (5, {"topk_numel": 12345})):
        calibration.calibrate(lambda t: None, lambda t: None, lambda t: None, 0, 2, sizes=(1 << 10, 1 << 12),
                              repeats=repeats, topk_ratio=0.01, **numel)
    assert asked == [(1, calibration.TOPK_NUMEL), (5, 12345)]


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


def test_the_allgather_is_timed_at_the_bytes_that_send_what_the_allreduce_sends():
    """allgather_bytes' doc: 2 B / n per rank (an allgather's (n-1) B' sent equals the allreduce's 2(n-1)/n B),
    at most 4x fewer, whole float32 words, the smallest size unchanged and never gone below; all of B where
    every size is below ALLGATHER_SCALED_FROM (1 MiB) or at 2 ranks."""
    from lossless_hc.training.calibration import ALLGATHER_SCALED_FROM, allgather_bytes
    assert ALLGATHER_SCALED_FROM == 1 << 20
    big = (1 << 10, 1 << 18, 1 << 20)
    assert allgather_bytes(1 << 20, big, 2) == 1 << 20
    assert allgather_bytes(1030, (4, 1 << 20), 2) == 1030             # 2 ranks or fewer: B itself, not in words
    assert allgather_bytes(1 << 20, big, 1) == 1 << 20
    assert allgather_bytes(1 << 20, big, 4) == 1 << 19
    assert allgather_bytes(1 << 18, big, 4) == 1 << 17                 # every size but the smallest
    assert allgather_bytes(1 << 20, big, 8) == allgather_bytes(1 << 20, big, 64) == 1 << 18   # at most 4x
    assert allgather_bytes(1 << 10, big, 8) == 1 << 10                 # the latency's size as it is
    assert allgather_bytes(1030, (4, 1 << 20), 4) == 512               # whole float32 words
    assert allgather_bytes(3000, (4, 1 << 20), 3) == 2000
    assert allgather_bytes(8, (4, 8, 1 << 20), 8) == 4                 # not below the smallest size
    small = (1 << 10, 1 << 15, (1 << 20) - 4)                          # a top below 1 MiB: as the allreduce
    assert [allgather_bytes(b, small, 4) for b in small] == list(small)
    with pytest.raises(ValueError, match="world_size must be an integer >= 1"):
        allgather_bytes(1 << 20, big, 0)


@pytest.mark.parametrize("world_size", [2, 4, 16])
def test_a_link_that_is_a_link_model_is_fitted_back_from_the_sizes_it_was_timed_at(world_size, monkeypatch):
    """calibrate's samples name the bytes per rank each collective carried (the allgather's at allgather_bytes,
    not the allreduce's size): on a fake clock that each collective advances by what a LinkModel prices the
    bytes it is handed at this world size, rank 0 fits that LinkModel back exactly (alpha, beta, beta_g)."""
    import types

    import lossless_hc.training.calibration as calibration
    link = LinkModel(2e-4, 9e-9, 13e-9)
    clock = [0.0]
    monkeypatch.setattr(calibration, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    monkeypatch.setattr(calibration, "measure_codecs", lambda *a, **k: Calibration.default().codec_seconds)

    def allreduce(t):
        clock[0] += link.allreduce(4 * t.numel(), world_size)

    def allgather(t):
        clock[0] += link.allgather(4 * t.numel(), world_size)
    samples = []
    sizes = calibration.link_sizes(1 << 22)
    cal = calibration.calibrate(allreduce, allgather, lambda t: None, 0, world_size, sizes=sizes, repeats=2,
                                samples_out=samples)
    gathered = [b for k, b, _ in samples if k == "allgather"]
    assert gathered == [calibration.allgather_bytes(b, sizes, world_size) for b in sizes]
    assert gathered[1:] == [b * 2 // min(world_size, 8) for b in sizes[1:]]
    assert cal.link.alpha_s == pytest.approx(link.alpha_s, rel=1e-6)
    assert cal.link.seconds_per_byte == pytest.approx(link.seconds_per_byte, rel=1e-6)
    assert cal.link.allgather_seconds_per_byte == pytest.approx(link.allgather_seconds_per_byte, rel=1e-6)


def test_every_timing_entry_point_refuses_no_repeats():
    """check_repeats (an int >= 1, returned as given) guards each function that times runs: measure_link and
    measure_codecs refuse 0 or fewer repeats with a ValueError before timing anything, as calibrate does,
    instead of an infinite time (no run) that prices every byte at infinity; measure_codecs refuses a top-k
    tensor of no coordinates as well."""
    from lossless_hc.training.calibration import check_repeats, measure_codecs, measure_link
    assert check_repeats(2) == 2
    for bad in (0, -1):
        with pytest.raises(ValueError, match="repeats"):
            measure_link(no_collective, no_collective, "cpu", (1024,), bad)
        with pytest.raises(ValueError, match="repeats"):
            measure_codecs("cpu", 2, numel=1 << 10, repeats=bad)
        # top-k's tensor too, though top-k is not timed here (no topk_ratio)
        with pytest.raises(ValueError, match="topk_numel"):
            measure_codecs("cpu", 2, numel=1 << 10, topk_numel=bad)


def test_calibrate_on_one_rank_issues_no_collective_and_with_its_defaults_times_each_size_1_plus_3_times():
    """One rank has no link to time and no rank to agree with: calibrate issues no collective, leaves
    ``samples_out`` empty and keeps its default's link, and refuses 0 repeats as every world size does. With
    its defaults a rank of several times each size's float32 allreduce and allgather once to warm up and 3
    times (docs/DESIGN.md: the fastest of 3), no float16 one (``half`` off), then takes the one broadcast."""
    from lossless_hc.training.calibration import calibrate
    given, samples = Calibration.default(bandwidth_bits=1e9, latency_s=3e-5), []
    none = (no_collective,) * 3   # allreduce, allgather, broadcast
    assert calibrate(*none, 0, 1, default=given, samples_out=samples).link == given.link
    assert samples == []
    with pytest.raises(ValueError, match="repeats"):
        calibrate(*none, 0, 1, repeats=0)
    sent, calls = Calibration.default(), []

    def broadcast(t):
        calls.append(("broadcast", t.dtype))
        t.copy_(torch.tensor(sent.as_list(), dtype=torch.float64))
    got = calibrate(lambda t: calls.append(("allreduce", t.dtype)), lambda t: calls.append(("allgather", t.dtype)),
                    broadcast, 1, 4, sizes=(1 << 10, 1 << 20), samples_out=samples)
    assert got == sent and [(k, b) for k, b, _ in samples] == [  # 4 ranks: the allgather's 1 MiB size halved
        ("allreduce", 1 << 10), ("allgather", 1 << 10), ("allreduce", 1 << 20), ("allgather", 1 << 19)]
    assert calls == 2 * ([("allreduce", torch.float32)] * 4 + [("allgather", torch.float32)] * 4) + [
        ("broadcast", torch.float64)]
