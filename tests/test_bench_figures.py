"""The benchmarks' printed figures, fed known timings and known payloads: each ratio against the
baseline it names, each median a median, the wire parts and the information bound, and the
correctness rows that must say when a decode is wrong (no timing asserts: the clocks are faked)."""
import math
import types

import pytest
import torch

from lossless_hc.bench import codec as bench_codec
from lossless_hc.bench import common


class FakeClock:
    """``perf_counter`` for ``common.time_interleaved``: each call of a timed function advances the
    clock by the next of its durations; ``calls`` records the order the functions ran in."""

    def __init__(self, durations: dict):
        self.now, self.durations, self.calls = 0.0, {k: list(v) for k, v in durations.items()}, []

    def perf_counter(self):
        return self.now

    def fn(self, name):
        def call():
            self.calls.append(name)
            self.now += self.durations[name].pop(0)
        return call


def test_time_interleaved_reports_the_median_of_the_timed_runs_only_in_round_robin(monkeypatch):
    # one warm-up run each (100 s: must not be counted), then three timed runs
    clock = FakeClock({"a": [100.0, 1.0, 2.0, 10.0], "b": [100.0, 7.0, 3.0, 5.0]})
    monkeypatch.setattr(common, "time", types.SimpleNamespace(perf_counter=clock.perf_counter))
    t = common.time_interleaved({"a": clock.fn("a"), "b": clock.fn("b")}, repeat=3, warmup=1)
    assert t["a"] == {"median_s": 2.0, "min_s": 1.0, "max_s": 10.0, "runs": 3}
    assert t["b"] == {"median_s": 5.0, "min_s": 3.0, "max_s": 7.0, "runs": 3}
    assert clock.calls == ["a", "b"] * 4   # every repetition calls each function once, in order


def test_time_cuda_reports_the_median_of_the_event_times_after_the_warmup(monkeypatch):
    """``time_cuda``'s statistics, with CUDA's events faked (they time the calls, in ms)."""
    elapsed = iter([4.0, 1.0, 30.0])   # ms of the three timed calls

    class Event:
        def __init__(self, enable_timing=False):
            assert enable_timing

        def record(self):
            pass

        def synchronize(self):
            pass

        def elapsed_time(self, end):
            return next(elapsed)
    calls = []
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: calls.append("sync"))
    t = common.time_cuda(lambda: calls.append("fn"), repeat=3, warmup=2)
    assert t == {"median_s": 4e-3, "min_s": 1e-3, "max_s": 30e-3, "runs": 3}
    assert calls == ["fn", "fn", "sync", "fn", "fn", "fn"]


def test_fmt_bytes_switches_unit_at_the_unit():
    assert common.fmt_bytes(1023) == "1023 B"
    assert common.fmt_bytes(1024) == "1.00 KiB"
    assert common.fmt_bytes(1 << 20) == "1.00 MiB"
    assert common.fmt_bytes(3 << 30) == "3.00 GiB"


# ------------------------------------------------------------------------------------------------
# bench codec
# ------------------------------------------------------------------------------------------------
CODEC_MS = {"clone": 2.0, "copy_prealloc": 1.0, "encode": 3.0, "encode_reused_out": 2.5, "decode": 5.0,
            "decode_reused_out": 4.0}


def fake_interleaved(ms: dict):
    """A ``time_interleaved`` that runs nothing and returns ``ms`` (median; min half, max twice it)."""
    def timed(fns, repeat, warmup=1):
        assert set(fns) == set(ms)
        return {k: {"median_s": ms[k] / 1e3, "min_s": ms[k] / 2e3, "max_s": 2 * ms[k] / 1e3, "runs": repeat}
                for k in fns}
    return timed


def row_of(text: str, label: str) -> list:
    line = next(l for l in text.splitlines() if l.startswith(label))
    return line[len(label):].split()


def test_codec_ratios_are_each_operation_over_the_clone(monkeypatch):
    monkeypatch.setattr(bench_codec, "time_interleaved", fake_interleaved(CODEC_MS))
    numel = 1 << 12
    res = bench_codec.run_codec_bench(numel, 0.05, 2, repeat=1)
    t = res["timing"]
    assert t["encode_over_clone"] == pytest.approx(1.5) and t["decode_over_clone"] == pytest.approx(2.5)
    assert t["encode_plus_decode_over_clone"] == pytest.approx(4.0)
    assert t["decode_reused_out_over_copy"] == pytest.approx(4.0)
    assert t["memcpy_GBps"] == pytest.approx(4 * numel / 1e-3 / 1e9)
    assert t["clone_GBps"] == pytest.approx(4 * numel / 2e-3 / 1e9)
    text = bench_codec.render_codec(res, common.machine_info(), "cmd")
    assert row_of(text, "clone (1 dense input)") == ["2.000", "1.000", "4.000", "1.000"]
    assert row_of(text, "encode (1 worker)") == ["3.000", "1.500", "6.000", "1.500"]
    assert row_of(text, "decode (sum of 2)") == ["5.000", "2.500", "10.000", "2.500"]
    assert row_of(text, "encode + decode") == ["8.000", "4.000"]
    assert row_of(text, "encode into a reused out=") == ["2.500", "1.250", "5.000", "1.250"]
    assert row_of(text, "decode into a reused out=") == ["4.000", "2.000", "8.000", "2.000"]
    assert "1.000 ms = " in text and "decode into a reused out= = 4.0x that copy_" in text


def test_codec_wire_figures_against_dense_and_the_information_bound(monkeypatch):
    from lossless_hc.lhc.cost_model import information_bound_bits
    from lossless_hc.lhc.layout import HEADER_FIELDS
    monkeypatch.setattr(bench_codec, "time_interleaved", fake_interleaved(CODEC_MS))
    numel, block, workers = 1 << 12, 4, 3
    res = bench_codec.run_codec_bench(numel, 0.05, workers, block_size=block, repeat=1)
    inp, w, cor = res["inputs"], res["wire"], res["correctness"]
    assert inp["nonzero_blocks_per_worker"] == round(0.05 * numel / block)        # density of blocks
    assert inp["max_nnz"] == block * inp["nonzero_blocks_per_worker"]
    xs, _ = bench_codec.make_inputs(numel, 0.05, workers, block, "random", 0)
    u = int(torch.count_nonzero(torch.stack([x.double() for x in xs]).sum(0)))
    assert cor["true_nonzero_coords"] == u
    assert w["dense_bytes"] == 4 * numel and w["wire_over_dense"] == w["wire_bytes"] / (4 * numel) < 1
    assert w["bound_bits"] == information_bound_bits(numel, u) and w["bound_bytes"] == w["bound_bits"] / 8
    assert w["wire_over_bound"] == w["wire_bytes"] / w["bound_bytes"]
    assert w["header_bytes"] == 4 * HEADER_FIELDS
    assert w["header_bytes"] + w["index_bytes"] + w["sketch_bytes"] == w["wire_bytes"]


def test_codec_correctness_rows_show_a_wrong_decode(monkeypatch):
    """A decode that drops the largest coordinate of the sum: the support, the error and the bounds
    say so, and the verdict fails."""
    monkeypatch.setattr(bench_codec, "time_interleaved", fake_interleaved(CODEC_MS))
    decode = bench_codec.LosslessCodec.decode

    def dropping(self, payload, *args, **kwargs):
        out = decode(self, payload, *args, **kwargs)
        if kwargs.get("error_bounds"):
            y, report = out
            y = y.clone()
            y[int(y.abs().argmax())] = 0.0
            return y, report
        return out
    monkeypatch.setattr(bench_codec.LosslessCodec, "decode", dropping)
    res = bench_codec.run_codec_bench(1 << 12, 0.05, 2, repeat=1)
    cor = res["correctness"]
    assert cor["support_mismatch_coords"] == 1 and not cor["support_exact"]
    assert cor["support_mismatch_beyond_rounding"] == 1
    assert cor["max_abs_err"] == pytest.approx(cor["max_abs_sum"], rel=1e-6)
    assert cor["max_rel_err"] == cor["max_abs_err"] / cor["max_abs_sum"]
    assert cor["bound_violations"] == 1
    assert not bench_codec.decode_verdict_ok(cor)


def test_bound_stats_counts_the_inexact_keys_within_rtol():
    """Four keys of one coordinate, bounds E = 1 (none violated); keys 1, 2 and 3 listed INEXACT, of
    which 1 and 2 are in fact within rtol of the truth, 3 is not; at block 1 a re-aggregation sends all
    three."""
    truth = torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.float64)
    y = torch.tensor([1.0, 2.0, 3.0, 4.5], dtype=torch.float32)
    keys = torch.arange(4)
    report = types.SimpleNamespace(error_bounds=(keys, torch.ones(4, dtype=torch.float64)),
                                   inexact_keys=torch.tensor([1, 2, 3]))
    s = bench_codec.bound_stats(report, y, truth, truth.abs(), 1, 1, 2.0 ** -10)
    assert s["bound_violations"] == 0 and s["inexact_within_rtol"] == 2
    assert s["inexact_coords"] == s["unproven_coords"] == 3
    assert s["err_over_bound_max"] == 0.5 and s["err_over_bound_median"] == 0.0 and s["bound_median"] == 1.0


# ------------------------------------------------------------------------------------------------
# bench thc
# ------------------------------------------------------------------------------------------------
def generic_interleaved(ms: dict, default: float = 1.0):
    def timed(fns, repeat, warmup=1):
        return {k: {"median_s": ms.get(k, default) / 1e3, "min_s": ms.get(k, default) / 2e3,
                    "max_s": 2 * ms.get(k, default) / 1e3, "runs": repeat} for k in fns}
    return timed


def test_thc_ratios_wire_and_the_clipping_model(monkeypatch):
    from lossless_hc.bench import thc as bench_thc
    monkeypatch.setattr(bench_thc, "time_interleaved", generic_interleaved(
        {"clone": 2.0, "copy": 1.0, "encode": 3.0, "decode": 5.0, "encode_reuse": 2.5, "decode_reuse": 4.0,
         "encode_interleaved": 3.0, "decode_interleaved": 3.0, "interleave": 0.5, "deinterleave": 1.0,
         "interleave_torch": 2.0, "deinterleave_torch": 2.5}))
    res = bench_thc.run_thc_bench(numel=2048, workers=2, repeat=1, warmup=2)
    t, w, a = res["timing"], res["wire"], res["accuracy"]
    assert t["encode_over_clone"] == pytest.approx(1.5) and t["decode_over_clone"] == pytest.approx(2.5)
    assert t["encode_plus_decode_over_clone"] == pytest.approx(4.0)
    assert t["reused_over_copy"] == pytest.approx(6.5)
    assert w["wire_over_dense_fp32"] == w["wire_bytes"] / (4 * 2048) < 1
    # the clipped mass of a standard normal beyond +-T: 2 * integral_T^inf (z - T)^2 phi(z) dz
    T = bench_thc.THCCodec(2048, 2, rank=0).table.threshold
    h = 1e-4
    zs = [T + h * (i + 0.5) for i in range(int(12 / h))]
    clipped = 2 * h * sum((z - T) ** 2 * math.exp(-z * z / 2) / math.sqrt(2 * math.pi) for z in zs)
    assert a["clipped_mass_normal"] == pytest.approx(clipped, rel=1e-6)
    text = bench_thc.render_thc(res, common.machine_info(), "cmd")
    assert "3.0  = 1.50x clone" in text and "5.0  = 2.50x clone" in text and "2.5 + 4.0  = 6.50x copy_" in text
    # in place: (3 + 3) / (2.5 + 4 + 0.5 + 1), against the codec into reused buffers plus the copies
    assert t["interleave"]["blocks"] == 2 and "3.0 + 3.0  = 0.75x the same with the interleave as copies" in text
    assert "0.5 + back 1.0  = 1.50x copy_" in text and "2.0 + back 2.5  = 4.50x copy_" in text


def test_thc_averaged_nmse_is_against_the_averaged_truth():
    from lossless_hc.bench.thc import run_thc_bench
    summed = run_thc_bench(numel=4096, workers=4, repeat=1, warmup=2)["accuracy"]
    averaged = run_thc_bench(numel=4096, workers=4, repeat=1, warmup=2, averaged=True)["accuracy"]
    assert averaged["nmse"] == pytest.approx(summed["nmse"], rel=0.05)
    assert averaged["nmse_vs_step_input"] == pytest.approx(summed["nmse_vs_step_input"], rel=0.05)


def test_thc_lockstep_reports_a_payload_that_differs(monkeypatch):
    """The lockstep check (forced on the CPU) with rank 0's payload of the measured codecs altered at
    one step: ``cpu_equal`` says NO and names it."""
    from lossless_hc.bench import thc as bench_thc
    made = []

    class Altered(bench_thc.THCCodec):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

        def encode(self, x, *args, **kwargs):
            p = super().encode(x, *args, **kwargs)
            if self is made[0] and self.step == 2:
                p = p.clone()
                p.view(torch.int32)[0] ^= 1
            return p
    monkeypatch.setattr(bench_thc, "THCCodec", Altered)
    res = bench_thc.run_thc_bench(numel=2048, workers=2, repeat=1, warmup=2, cpu_check="force")
    assert not res["cpu_equal"]["ok"] and "step 2 rank 0 payload" in res["cpu_equal"]["mismatches"]
    text = bench_thc.render_thc(res, common.machine_info(), "cmd")
    assert " ".join(row_of(text, "same bits as the CPU backend")).startswith("NO: step 2 rank 0 payload")


# ------------------------------------------------------------------------------------------------
# bench topk
# ------------------------------------------------------------------------------------------------
TOPK_MS = {"clone": 2.0, "topk_select": 3.0, "torch_topk": 12.0, "aggregator_select": 5.0,
           "aggregator_encode": 9.0, "residual_reset": 1.0}


def test_topk_density_leaves_that_fraction_of_the_coordinates_non_zero():
    """``--density``: N(0,1) on ceil(density numel) coordinates, zeros elsewhere (a sparse gradient's input);
    the setup row says so, and a density outside (0, 1] is refused."""
    from lossless_hc.bench import topk as bench_topk
    x = bench_topk.topk_input(1000, 0.013, torch.Generator().manual_seed(0))
    assert int((x != 0).sum()) == 13 and x.numel() == 1000
    assert int((bench_topk.topk_input(1000, 1.0, torch.Generator().manual_seed(0)) != 0).sum()) == 1000
    for bad in (0.0, 1.5, -0.1):
        with pytest.raises(ValueError, match="--density"):
            bench_topk.topk_input(10, bad, torch.Generator())
    assert "N(0,1) on 0.013 of the coordinates" in bench_topk._values({"density": 0.013})


def test_topk_density_rounds_up_and_reaches_the_selection_and_the_residual(monkeypatch):
    """``--density`` 0.0125 of 1000 coordinates: ceil(12.5) = 13 non-zero, in the input the selection is
    timed on and in the aggregator's residual (another support at the same density), through the CLI;
    density 1 is plain N(0,1) in the setup row, and the config records the density."""
    from lossless_hc.bench import cli
    from lossless_hc.bench import topk as bench_topk
    from lossless_hc.training import topk_aggregate
    assert int((bench_topk.topk_input(1000, 0.0125, torch.Generator().manual_seed(0)) != 0).sum()) == 13
    assert bench_topk._values({"density": 1.0}) == bench_topk._values({}) == "N(0,1)"
    monkeypatch.setattr(bench_topk, "time_interleaved", generic_interleaved(TOPK_MS))
    selected, residuals, results = [], [], []
    real_backend, real_run = bench_topk.backend_for, bench_topk.run_topk_bench

    def recording_backend(device):
        b = real_backend(device)
        return types.SimpleNamespace(topk_select=lambda x, k, **kw: (selected.append(x.clone()),
                                                                    b.topk_select(x, k, **kw))[1])

    class RecordingAggregator(topk_aggregate.TopKAggregator):
        def __setattr__(self, name, value):
            if name == "residual" and value is not None:
                residuals.append(value.clone())
            super().__setattr__(name, value)
    monkeypatch.setattr(bench_topk, "backend_for", recording_backend)
    monkeypatch.setattr(topk_aggregate, "TopKAggregator", RecordingAggregator)
    monkeypatch.setattr(cli, "run_topk_bench", lambda *a, **k: results.append(real_run(*a, **k)) or results[-1])
    assert cli.main(["topk", "--numel", "1000", "--ratio", "0.01", "--density", "0.0125", "--repeat", "1"]) == 0
    assert [int((x != 0).sum()) for x in selected] == [13]
    assert int((residuals[0] != 0).sum()) == 13 and not torch.equal(residuals[0] != 0, selected[0] != 0)
    assert results[0]["config"]["density"] == 0.0125 and results[0]["exact"] is True


def test_topk_ratios_are_over_the_clone_with_the_reset_taken_out(monkeypatch):
    from lossless_hc.bench import topk as bench_topk
    monkeypatch.setattr(bench_topk, "time_interleaved", generic_interleaved(TOPK_MS))
    res = bench_topk.run_topk_bench(numel=1000, ratio=0.0015, repeat=1)
    assert res["config"]["k"] == 2 and res["exact"] is True          # ceil(1.5)
    t, r = res["timing"], res["ratios"]
    assert t["aggregator_select"]["median_s"] == pytest.approx(4e-3)
    assert t["aggregator_encode"]["median_s"] == pytest.approx(8e-3)
    assert r == pytest.approx({"topk_select": 1.5, "torch_topk": 6.0, "aggregator_select": 2.0,
                               "aggregator_encode": 4.0})
    assert res["select_over_torch_topk"] == pytest.approx(0.25)
    text = bench_topk.render_topk(res, common.machine_info(), "cmd")
    assert "3.0  = 1.50x clone, 0.250x torch.topk" in text and "yes (exactly k)" in text


def test_topk_check_says_no_for_a_wrong_selection(monkeypatch):
    from lossless_hc.bench import topk as bench_topk
    monkeypatch.setattr(bench_topk, "time_interleaved", generic_interleaved(TOPK_MS))
    real = bench_topk.backend_for

    def wrong_backend(device):
        b = real(device)
        return types.SimpleNamespace(topk_select=lambda x, k, **kw: (b.topk_select(x, k, **kw) + 1) % x.numel())
    monkeypatch.setattr(bench_topk, "backend_for", wrong_backend)
    res = bench_topk.run_topk_bench(numel=1000, ratio=0.01, repeat=1)
    assert res["exact"] is False
    assert row_of(bench_topk.render_topk(res, common.machine_info(), "cmd"), "same indices as a stable sort") == ["NO"]


def test_topk_cuda_render_says_no_for_a_wrong_selection():
    from lossless_hc.bench.topk import render_topk_cuda
    ms = lambda v: {"median_s": v / 1e3}  # noqa: E731
    res = {"config": {"numel": 1000, "k": 10, "ratio": 0.01, "repeat": 1},
           "device": {"name": "gpu", "multiprocessors": 1, "torch_cuda": "12"},
           "timing": {"copy": ms(1.0), "topk_select": ms(2.0), "torch_topk": ms(8.0)},
           "ratios": {"topk_select": 2.0, "torch_topk": 8.0}, "select_over_torch_topk": 0.25, "exact": False}
    assert row_of(render_topk_cuda(res, "cmd"), "same indices as the CPU backend") == ["NO"]
    assert "yes (exactly k)" in render_topk_cuda({**res, "exact": True}, "cmd")
    assert "2.000  = 2.00x copy, 0.250x torch.topk" in render_topk_cuda(res, "cmd")


# ------------------------------------------------------------------------------------------------
# bench peel
# ------------------------------------------------------------------------------------------------
def test_binomial_upper_bound_is_the_clopper_pearson_one():
    from lossless_hc.bench.peel import _binomial_upper
    assert _binomial_upper(0, 20) == pytest.approx(1 - 0.05 ** (1 / 20), rel=1e-9)
    for failures, trials in ((1, 20), (3, 50)):
        p = _binomial_upper(failures, trials)
        cdf = sum(math.comb(trials, i) * p ** i * (1 - p) ** (trials - i) for i in range(failures + 1))
        assert cdf == pytest.approx(0.05, rel=1e-6) and failures / trials < p < 1


def test_peel_row_statistics_from_known_decodes(monkeypatch):
    """Four trials of 100 keys whose timed decodes take 4, 1, 2 and 3 ms and are off by 0.3, (a failed
    peel), 0.1 and 0.2: one failure in four, medians of the timed decodes and of the peeled errors."""
    from lossless_hc.bench import peel as bench_peel
    clock = types.SimpleNamespace(now=0.0, calls=0)
    monkeypatch.setattr(bench_peel, "time", types.SimpleNamespace(perf_counter=lambda: clock.now))
    decode = bench_peel.LosslessCodec.decode
    ms, off = [4.0, 1.0, 2.0, 3.0], [0.3, None, 0.1, 0.2]

    def known(self, payload, *args, **kwargs):
        y, report = decode(self, payload, *args, **kwargs)
        trial, timed = divmod(clock.calls, 2)
        clock.calls += 1
        if not timed:
            return y, report
        clock.now += ms[trial] / 1e3
        if off[trial] is None:
            return y, types.SimpleNamespace(ok=False, status=None, reason="made up", unresolved=7)
        return y + off[trial] * (y != 0), report
    monkeypatch.setattr(bench_peel.LosslessCodec, "decode", known)
    res = bench_peel.run_peel_bench([100], trials=4)
    (row,) = res["rows"]
    assert row["failures"] == 1 and row["failure_rate"] == 0.25 and row["failure_reasons"] == {"made up": 1}
    assert row["unresolved_keys"] == [7]
    assert row["failure_rate_95_upper"] == bench_peel._binomial_upper(1, 4)
    assert row["max_abs_err"] == pytest.approx(0.3) and row["median_abs_err"] == pytest.approx(0.2)
    assert row["decode_ms_median"] == pytest.approx(2.5) and row["decode_ns_per_key"] == pytest.approx(25000)
    assert row["cells_per_key"] == row["sketch_cells"] / 100
    text = bench_peel.render_peel(res, common.machine_info(), "cmd")
    assert row_of(text, "100")[2:4] == ["1/4", f"{bench_peel._binomial_upper(1, 4):.3f}"]
    assert "keys=100: 1x made up" in text


# ------------------------------------------------------------------------------------------------
# bench plan
# ------------------------------------------------------------------------------------------------
def plan_with_known_times(monkeypatch, strategies, interval=2, repeat=3, workers=2, on_last=None):
    """``run_plan_bench`` whose steps take 3, 1 and 2 units per call in the three timed intervals (6 ms a
    unit: 9, 3 and 6 ms per step and rank) and whose clone and copy_ take 2 and 1 ms."""
    import itertools
    from lossless_hc.bench import plan as bench_plan
    real = bench_plan.run_in_process
    calls = itertools.count()
    units = [0] * interval + [3] * interval + [1] * interval + [2] * interval

    def known(aggs, xs):
        i = next(calls)
        values, _ = real(aggs, xs)
        if on_last is not None and i == (1 + repeat) * interval - 1:
            on_last(aggs)
        return values, units[i % len(units)] * 6e-3
    monkeypatch.setattr(bench_plan, "run_in_process", known)
    ticks = itertools.cycle([0.0, 2e-3, 0.0, 1e-3])
    monkeypatch.setattr(bench_plan, "time", types.SimpleNamespace(perf_counter=lambda: next(ticks)))
    return bench_plan, bench_plan.run_plan_bench(1024, row=8, density=0.5, workers=workers, strategies=strategies,
                                                 interval=interval, repeat=repeat)


def test_plan_times_per_step_and_rank_against_clone_and_copy(monkeypatch):
    bench_plan, res = plan_with_known_times(monkeypatch, ("dense", "sketch"))
    assert res["clone_s"] == pytest.approx(2e-3) and res["copy_s"] == pytest.approx(1e-3)
    for s in ("dense", "sketch"):
        r = res["strategies"][s]
        assert r["per_interval_s"] == pytest.approx([9e-3, 3e-3, 6e-3]) and r["step_s"] == pytest.approx(6e-3)
    assert res["strategies"]["dense"]["bytes_per_step"] == 4 * 1024 and res["ok"]
    text = bench_plan.render_plan(res, common.machine_info(), "cmd")
    assert row_of(text, "dense")[:6] == ["6.00", "3.00", "6.00", "1.000", "exact,", "rel."]
    assert "clone 2.00 ms, copy_ 1.00 ms" in text


def test_plan_fails_an_exact_strategy_that_left_its_plan(monkeypatch):
    def leave(aggs):
        aggs[0].strategy = "allgather"
    bench_plan, res = plan_with_known_times(monkeypatch, ("sketch",), on_last=leave)
    assert not res["strategies"]["sketch"]["strategy_held"] and not res["ok"]
    row = row_of(bench_plan.render_plan(res, common.machine_info(), "cmd"), "sketch")
    assert row[-7:-4] + row[-3:] == ["exact,", "rel.", "error", "(left", "its", "plan)"]


@pytest.mark.parametrize("scale,exact", [(2.0 ** -12, True), (2.0 ** -8, False)])
def test_plan_exact_means_within_the_contracts_relative_error(monkeypatch, scale, exact):
    """An exact strategy's result off by a relative ``scale``: within the exactness contract's 2^-10
    (the codec's DEFAULT_RTOL) it passes, past it the strategy is NOT EXACT and the run fails."""
    from lossless_hc.bench import plan as bench_plan
    from lossless_hc.training.strategies import AutoAggregator
    decode = AutoAggregator.decode

    def off(self, summed, ctx):
        outcome = decode(self, summed, ctx)
        if outcome.value is not None and not outcome.value.is_sparse:
            outcome.value = outcome.value * (1 + scale)
        return outcome
    monkeypatch.setattr(AutoAggregator, "decode", off)
    res = bench_plan.run_plan_bench(1024, row=8, density=0.5, workers=2, strategies=("dense",), interval=2, repeat=1)
    r = res["strategies"]["dense"]
    assert r["relative_error"] == pytest.approx(scale, rel=1e-3)
    assert r["equals_sum"] is exact and res["ok"] is exact
    assert row_of(bench_plan.render_plan(res, common.machine_info(), "cmd"), "dense")[-4:] == \
        ["exact," if exact else "EXACT,", "rel.", "error", f"{scale:.1e}"]


# ------------------------------------------------------------------------------------------------
# bench wire
# ------------------------------------------------------------------------------------------------
def test_wire_point_bits_per_aggregate_nonzero_coordinate():
    from lossless_hc.bench.wire import wire_point
    from lossless_hc.lhc.cost_model import candidates, choose, information_bound_bits
    numel, n, block = 1 << 16, 4, 4
    p = wire_point(numel, n, 0.01, block)
    u = math.ceil(0.01 * numel / block)
    nnz = u * block
    assert (p["union_keys"], p["nnz"]) == (u, nnz)
    bound = information_bound_bits(numel, nnz)
    assert p["bound_bits_per_nz"] == pytest.approx(bound / nnz)
    assert p["bits_per_nz"] == pytest.approx({k: 32 * L.payload_numel / nnz
                                              for k, L in candidates(numel, n, nnz, block, 0, nnz).items()})
    auto = choose(numel, n, nnz, block, 0, nnz)
    assert p["auto_kind"] == auto.index_kind and p["auto_bits_per_nz"] == pytest.approx(32 * auto.payload_numel / nnz)
    assert p["auto_over_bound"] == pytest.approx(p["auto_bits_per_nz"] / p["bound_bits_per_nz"])


def test_wire_summary_and_table_columns():
    from lossless_hc.bench.wire import KINDS, render_wire, summarize
    def point(d, ratio):
        return {"block": 1, "workers": 2, "density": d, "auto_over_bound": ratio, "bound_bits_per_nz": 30.0,
                "bits_per_nz": {"dense": 4.0, "bitmap": 5.0, "bloom": 6.0, "multilevel": 7.0},
                "auto_kind": "bitmap", "auto_bits_per_nz": 5.0}
    points = [point(1e-5, 9.0), point(1e-4, 1.2), point(0.1, 1.6), point(0.2, 9.0)]
    (s,) = summarize(points)
    assert (s["min_ratio"], s["max_ratio"], s["meets_target"]) == (1.2, 1.6, False)
    assert summarize(points[1:2])[0]["meets_target"]
    text = render_wire({"numel": 10, "points": points, "verified": [], "summary": [s]}, "cmd")
    header = next(l for l in text.splitlines() if l.startswith("n "))
    assert header.split() == ["n", "density", "bound", *KINDS, "auto", "auto", "bits", "auto/bound"]
    row = next(l.split() for l in text.splitlines() if l.split()[:2] == ["2", "0.0001"])
    assert row[2:] == ["30.0", "4.0", "5.0", "6.0", "7.0", "bitmap", "5.0", "1.20"]


def test_wire_verify_fails_a_decode_outside_the_contract(monkeypatch):
    from lossless_hc.bench import wire as bench_wire
    monkeypatch.setattr(bench_wire, "claimed_outside_contract", lambda y, *a: torch.ones(1, dtype=torch.bool))
    out = bench_wire.verify_point(2, 0.05, 1, 2000)
    assert out and all(r["decoded"] and r["outside_contract"] == 1 and not r["within_contract"] for r in out.values())


def test_wire_verify_counts_keys_in_blocks():
    from lossless_hc.bench.wire import run_wire_bench
    res = run_wire_bench(4096, densities=(0.01,), workers=(2,), blocks=(4,), verify_numel=1000)
    assert res["verified"] == [] and res["verify_too_few_keys"] == 1    # 0.01 * 1000 / 4 = 2.5 keys < 5


# ------------------------------------------------------------------------------------------------
# the commands' exit status (what CI gates on)
# ------------------------------------------------------------------------------------------------
def test_codec_command_fails_a_wrong_decode(monkeypatch):
    from lossless_hc.bench.cli import main
    monkeypatch.setattr(bench_codec, "time_interleaved", fake_interleaved(CODEC_MS))
    decode = bench_codec.LosslessCodec.decode

    def dropping(self, payload, *args, **kwargs):
        y, report = decode(self, payload, *args, **kwargs)
        return (y * (y.abs() < y.abs().max()), report) if kwargs.get("error_bounds") else (y, report)
    args = ["codec", "--numel", "4096", "--density", "0.05", "--workers", "2", "--repeat", "1"]
    assert main(args) == 0
    monkeypatch.setattr(bench_codec.LosslessCodec, "decode", dropping)
    assert main(args) == 1


def test_thc_command_fails_when_the_lockstep_differs(monkeypatch):
    from lossless_hc.bench import cli
    real = cli.run_thc_bench
    res = {}

    def forced(*args, **kwargs):
        res.update(real(*args, **{**kwargs, "cpu_check": "force"}))
        return res
    monkeypatch.setattr(cli, "run_thc_bench", forced)
    args = ["thc", "--numel", "2048", "--workers", "2", "--repeat", "1"]
    assert cli.main(args) == 0 and res["cpu_equal"]["ok"]
    monkeypatch.setattr(cli, "run_thc_bench", lambda *a, **k: {**forced(*a, **k), "cpu_equal": {
        "ok": False, "steps": 5, "mismatches": ["step 2 rank 0 payload"]}})
    assert cli.main(args) == 1


def test_topk_command_fails_a_wrong_selection(monkeypatch):
    from lossless_hc.bench import cli
    from lossless_hc.bench import topk as bench_topk
    monkeypatch.setattr(bench_topk, "time_interleaved", generic_interleaved(TOPK_MS))
    args = ["topk", "--numel", "1000", "--ratio", "0.01", "--repeat", "1"]
    assert cli.main(args) == 0
    real = bench_topk.backend_for

    def wrong_backend(device):
        b = real(device)
        return types.SimpleNamespace(topk_select=lambda x, k, **kw: (b.topk_select(x, k, **kw) + 1) % x.numel())
    monkeypatch.setattr(bench_topk, "backend_for", wrong_backend)
    assert cli.main(args) == 1


def test_cuda_commands_fail_a_wrong_check(monkeypatch):
    """The --device cuda exits, with the CUDA runs stood in for (no GPU needed): top-k's selection
    and the codec's determinism each fail the command."""
    from lossless_hc.bench import cli
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(cli, "machine_info", lambda *a: {})
    monkeypatch.setattr(cli, "render_topk_cuda", lambda res, cmd: "")
    monkeypatch.setattr(cli, "render_codec_cuda", lambda res, cmd: "")
    calls = []
    for exact, status in ((True, 0), (None, 0), (False, 1)):
        monkeypatch.setattr(cli, "run_topk_bench_cuda", lambda *a, **k: calls.append(k) or {"exact": exact})
        assert cli.main(["topk", "--device", "cuda", "--numel", "1000", "--density", "0.25"]) == status
    assert [k["density"] for k in calls] == [0.25] * 3
    cor = {"ok": True, "inexact_keys": 0, "peeled_keys": 1, "support_keys": 1, "support_mismatch_beyond_rounding": 0}
    for deterministic, status in ((True, 0), (False, 1)):
        monkeypatch.setattr(cli, "run_codec_bench_cuda",
                            lambda *a, **k: {"correctness": {**cor, "deterministic": deterministic}})
        assert cli.main(["codec", "--device", "cuda", "--numel", "1000"]) == status


def test_wire_command_fails_a_decode_outside_the_contract(monkeypatch, tmp_path):
    from lossless_hc.bench import cli
    from lossless_hc.bench import wire as bench_wire
    args = ["wire", "--numel", "4096", "--workers", "2", "--densities", "0.05", "--block-sizes", "1", "--plot", "",
            "--verify-numel", "2000"]
    assert cli.main(args) == 0
    monkeypatch.setattr(bench_wire, "claimed_outside_contract", lambda y, *a: torch.ones(1, dtype=torch.bool))
    assert cli.main(args) == 1
