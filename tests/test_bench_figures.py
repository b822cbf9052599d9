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
    which 1 and 2 are in fact within rtol of the truth, 3 is not."""
    truth = torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.float64)
    y = torch.tensor([1.0, 2.0, 3.0, 4.5], dtype=torch.float32)
    keys = torch.arange(4)
    report = types.SimpleNamespace(error_bounds=(keys, torch.ones(4, dtype=torch.float64)),
                                   inexact_keys=torch.tensor([1, 2, 3]))
    s = bench_codec.bound_stats(report, y, truth, truth.abs(), 1, 1, 2.0 ** -10)
    assert s["bound_violations"] == 0 and s["inexact_within_rtol"] == 2
    assert s["err_over_bound_max"] == 0.5 and s["err_over_bound_median"] == 0.0 and s["bound_median"] == 1.0

