"""``python -m lossless_hc.bench codec``: its pass/fail verdict, the exit status CI can gate on, and the
correctness section's counts of the INEXACT keys' coordinates."""
import json
import types

import torch

from lossless_hc.bench.cli import main
from lossless_hc.bench.codec import decode_verdict_ok

BASE = {"ok": True, "inexact_keys": 0, "peeled_keys": 10, "support_keys": 10, "support_mismatch_beyond_rounding": 0}


def test_inexact_keys_pass_a_failed_peel_or_a_wrong_support_does_not():
    assert decode_verdict_ok(BASE)
    assert decode_verdict_ok({**BASE, "ok": False, "inexact_keys": 3})          # INEXACT: listed, not wrong
    assert not decode_verdict_ok({**BASE, "ok": False})                          # any other failed verdict
    assert not decode_verdict_ok({**BASE, "ok": False, "inexact_keys": 3, "peeled_keys": 9})
    assert not decode_verdict_ok({**BASE, "support_mismatch_beyond_rounding": 1})
    assert decode_verdict_ok({**BASE, "bound_violations": 0})
    assert not decode_verdict_ok({**BASE, "bound_violations": 1})                # a coordinate outside its E(k)


def test_codec_command_passes_an_inexact_decode(tmp_path):
    """N(0,1) values at 1% of 2^20, 4 ranks: every key peeled, the support exact, every coordinate
    within its reported bound, and some keys listed INEXACT (bounds, worst case, grown along the
    peel's chains past rtol): the command reports them and exits 0."""
    out = tmp_path / "codec.json"
    assert main(["codec", "--numel", "1048576", "--density", "0.01", "--workers", "4", "--repeat", "1",
                 "--json", str(out)]) == 0
    cor = json.load(open(out))["correctness"]
    assert not cor["ok"] and cor["inexact_keys"] > 0 and cor["peeled_keys"] == cor["support_keys"], cor
    assert cor["support_mismatch_beyond_rounding"] == 0
    assert cor["bound_violations"] == 0 and 0 < cor["err_over_bound_max"] <= 1, cor
    assert 0 <= cor["inexact_within_rtol"] <= cor["inexact_keys"], cor
    assert cor["unproven_coords"] == cor["inexact_coords"] == cor["inexact_keys"], cor   # rows of one coordinate


def test_codec_command_reports_the_coordinates_a_re_aggregation_sends(tmp_path):
    """Rows of 32 N(0,1) coordinates: of the INEXACT rows' coordinates, a re-aggregation sends the ones their
    bounds do not prove, a small part of them."""
    out = tmp_path / "codec.json"
    assert main(["codec", "--numel", "1048576", "--density", "0.01", "--workers", "4", "--repeat", "1",
                 "--block-size", "32", "--json", str(out)]) == 0
    cor = json.load(open(out))["correctness"]
    assert cor["inexact_coords"] == 32 * cor["inexact_keys"] > 0, cor
    assert 0 < cor["unproven_coords"] < cor["inexact_coords"] / 4, cor


def test_plan_command_times_every_strategy_and_checks_the_exact_ones(tmp_path, monkeypatch):
    """``bench plan``: every strategy held for its whole run, each exact one's result the sum of the inputs,
    the wire each sends per step (dense: the tensor; the half plans: half of it between their statistics
    steps), a time for each; and exit status 1 when an exact strategy's result is not the sum."""
    from lossless_hc.bench.plan import PLAN_STRATEGIES
    from lossless_hc.training.strategies import AutoAggregator
    out = tmp_path / "plan.json"
    args = ["plan", "--numel", "8192", "--row", "8", "--density", "0.25", "--workers", "3", "--interval", "4",
            "--repeat", "1", "--json", str(out)]
    assert main(args) == 0
    res = json.load(open(out))
    assert res["ok"] and list(res["strategies"]) == list(PLAN_STRATEGIES)
    for name, r in res["strategies"].items():
        assert r["strategy_held"] and r["step_s"] > 0, name
        if r["exact"]:
            assert r["relative_error"] <= 2 ** -10, (name, r)
    dense, fp16 = res["strategies"]["dense"], res["strategies"]["fp16"]
    # dense alone: plain steps only; fp16: one step in the interval of 4 carries the statistics header too
    assert dense["bytes_per_step"] == 4 * 8192 and 2 * 8192 < fp16["bytes_per_step"] < 2 * 8192 + 64
    decode = AutoAggregator.decode

    def off_by_one(self, summed, ctx):   # an exact strategy that returns a wrong sum
        outcome = decode(self, summed, ctx)
        if outcome.value is not None and not outcome.value.is_sparse:
            outcome.value = outcome.value + 1
        return outcome
    monkeypatch.setattr(AutoAggregator, "decode", off_by_one)
    assert main(args[:-2] + ["--strategies", "dense"]) == 1


def test_codec_wire_breakdown_books_the_multilevel_fine_tables_to_the_index():
    """The wire table's parts add up to the payload, and the multilevel index is its coarse bitmap and
    its fine node tables: the sketch part is the value sketch and its mass channel, nothing else
    (the fine tables were booked to the sketch: index 0.094 of a 1%-density payload instead of 0.374)."""
    from lossless_hc.bench.codec import run_codec_bench
    from lossless_hc.lhc.codec import LosslessCodec
    from lossless_hc.lhc.layout import HEADER_FIELDS
    res = run_codec_bench(1 << 16, 0.01, 4, index="multilevel", repeat=1)
    w, lay = res["wire"], res["layout"]
    assert lay["index_kind"] == "multilevel"
    L = LosslessCodec(numel=1 << 16, world_size=4, max_nnz=res["inputs"]["max_nnz"], index="multilevel").layout
    fine = sum(lv.numel for lv in L.multilevel.levels)
    assert fine > 0
    assert w["header_bytes"] == 4 * HEADER_FIELDS
    assert w["index_bytes"] == 4 * (L.index.words + fine)
    assert w["sketch_bytes"] == 4 * (L.sketch.cells * L.block + L.sketch.cells)
    assert w["header_bytes"] + w["index_bytes"] + w["sketch_bytes"] == w["wire_bytes"]


def test_bound_stats_counts_the_unproven_coordinates_of_rows_and_a_partial_last_row():
    """Rows of 4 over 6 coordinates (the last row 2 long), both listed INEXACT, bounds E = 1e-6: the values
    near 1e-4 are not proven within rtol = 2^-10, the others are. The listed keys' coordinates stop at the
    tensor's end (6, not 8); a re-aggregation sends the 3 unproven ones, all 6 where the codec verifies
    (its verdicts use bounds the report does not carry); and the row says which is which."""
    from lossless_hc.bench.codec import bound_rows, bound_stats
    y = torch.tensor([1.0, 1e-4, 1e-4, 4.0, 5.0, 1e-4])
    truth = y.double()
    report = types.SimpleNamespace(error_bounds=(torch.arange(2), torch.full((2,), 1e-6, dtype=torch.float64)),
                                   inexact_keys=torch.tensor([0, 1]))
    s = bound_stats(report, y, truth, truth.abs(), 2, 4, 2.0 ** -10)
    assert (s["inexact_coords"], s["unproven_coords"], s["bound_violations"]) == (6, 3, 0)
    assert bound_stats(report, y, truth, truth.abs(), 2, 4, 2.0 ** -10, verify=True)["unproven_coords"] == 6
    rows = dict(bound_rows({**s, "inexact_keys": 2}))
    assert rows["re-aggregated coordinates"] == "3 of the INEXACT keys' 6 (those their bounds do not prove)"
    assert rows["INEXACT keys within rtol anyway"] == "2 of 2 (the bound is worst case)"


def test_a_verifying_codec_s_run_counts_every_inexact_coordinate_as_re_aggregated():
    """``bench codec --verify``: the bounds the report carries do not decide a verifying codec's verdicts,
    so a re-aggregation sends every coordinate of its INEXACT rows (rows of 32, some listed)."""
    from lossless_hc.bench.codec import run_codec_bench
    cor = run_codec_bench(1 << 16, 0.01, 4, block_size=32, repeat=1, verify=True)["correctness"]
    assert cor["inexact_keys"] > 0 and cor["unproven_coords"] == cor["inexact_coords"] == 32 * cor["inexact_keys"]
