"""The report modules' figures from known worker reports and runs: the cluster table's percentiles
and aggregation time, the time-to-accuracy table's per-step figures and its baseline, the simulator's
mode mapping, recorded statistics and error summary, and the replay table's units and reuse rule."""
import math

import pytest

from lossless_hc.bench import cluster_report, replay, simulate, tta_report


def _report(rank, steps, tx=1000):
    return {"rank": rank, "step_seconds": steps, "dense_bytes_per_step": 1000, "timed_steps": len(steps),
            "net_bytes": {"tx_bytes": tx}, "stats": None, "final_loss": 0.5, "metric": "accuracy", "value": 0.9}


def test_cluster_row_percentiles_and_aggregation_time():
    steps = [0.1 * i for i in range(1, 12)]        # 0.1 .. 1.1: p10 0.2, median 0.6, p90 1.0
    row = cluster_report.summarize("ddp", "none", [_report(0, steps)], compute_s=0.25)
    assert (row["step_s_p10"], row["step_s_median"], row["step_s_p90"]) == pytest.approx((0.2, 0.6, 1.0))
    assert row["aggregation_s"] == pytest.approx(0.35) and row["aggregation_bytes_per_s"] == pytest.approx(1000 / 0.35)
    md = cluster_report.render_markdown({"rows": cluster_report.add_relative([{**row, "max_param_diff_vs_none": None,
                                                                               "lossless_mode": False}]),
                                         "compute_s": 0.25, "shaping": {"qdisc": "tbf"}}, "t")
    assert "| ddp | none | 600.0 (200.0–1000.0) | 600.0 | 1.00x" in md and md.rstrip().endswith("| 0 | 350.0 |")


def _run(label, seed, reach_s, steps_run, train_s, wire, diff):
    curve = [{"step": 0, "train_s": 0.0, "metric": 0.0}, {"step": 10, "train_s": reach_s, "metric": 1.0},
             {"step": steps_run, "train_s": train_s, "metric": 1.0}]
    return {"label": label, "seed": seed, "curve": curve, "higher_is_better": True, "steps_run": steps_run,
            "train_s": train_s, "eval_s": 0.0, "wire_bytes_per_host": wire, "stats": {},
            "max_param_diff_vs_none": diff, "metric": "accuracy"}


def test_tta_rows_per_step_figures_and_the_uncompressed_baseline():
    """The lossy mode listed first: its speed-up is still against ``none`` of the same seed; s/step and
    wire are per step run; the per-mode parameter difference is the largest over the seeds."""
    runs = [_run("thc", 1, 1.0, 20, 4.0, 20 * 2**20, 1e-3), _run("none", 1, 3.0, 20, 8.0, 20 * 2**21, None),
            _run("thc", 2, 2.0, 40, 6.0, 40 * 2**20, 5e-3), _run("none", 2, 4.0, 40, 9.0, 40 * 2**21, None)]
    rows = {(r["label"], r["seed"]): r for r in tta_report.summarize_runs(runs, 0.5)}
    assert rows[("thc", 1)]["speedup_vs_none"] == pytest.approx(3.0) and rows[("none", 1)]["speedup_vs_none"] == 1.0
    assert rows[("thc", 2)]["s_per_step"] == pytest.approx(6.0 / 40)
    assert rows[("thc", 2)]["wire_bytes_per_step_per_host"] == pytest.approx(2**20)
    modes = {m["label"]: m for m in tta_report.per_mode(list(rows.values()))}
    assert modes["thc"]["max_param_diff_vs_none"] == 5e-3 and modes["thc"]["speedup_vs_none"] == pytest.approx(2.5)
    md = tta_report.render_markdown({"runs": runs, "summary": list(rows.values()), "target": 0.5, "title": "t",
                                     "max_steps": 40, "eval_every": 10, "seeds": [1, 2], "shaping": {}})
    assert "| thc | 2/2 | 1.50 | 2.50x | 10 | 1.0000 | 0.1750 | 1.000 | 5.00e-03 | 0 |" in md


def test_simulator_maps_each_mode_to_its_strategy_and_summarizes_the_errors():
    assert simulate.MODE_STRATEGY == {"none": "dense", "sparse": "allgather", "lossless": "sketch", "fp16": "fp16",
                                      "bf16": "bf16", "thc": "thc", "topk": "topk", "topk-allgather": "topk_allgather"}
    checks = [{"hosts": 2, "framework": "ddp", "mode": "none", "strategy": "dense", "calibration": "default",
               "predicted_s": 0.0, "measured_s": 1.0, "rel_error": e} for e in (0.1, -0.2, 0.9)]
    assert "Median |relative error| 20%, max 90% over 3 points." in simulate.render([], checks, "t")


def test_simulator_items_draw_half_positives_half_negatives():
    from lossless_hc.bench.workloads.data import expected_distinct, zipf_weights
    (_, _, _, _, _), (name, numel, row, ks, union), *_ = simulate.ncf_tensors(4, 1.5, 300, 500, 8, 64)
    items = 0.5 * zipf_weights(500, 1.0) + 0.5 * zipf_weights(500, 1.5)
    assert (name, numel, row) == ("item_gmf", 500 * 8, 8)
    assert ks == (round(expected_distinct(items, 128)),) * 4 and union == round(expected_distinct(items, 4 * 128))


def test_simulator_recorded_statistics_are_of_the_first_n_ranks():
    meas = {"names": ["e.weight"], "shapes": [[100, 4]], "row_sparse": [True],
            "row_stats": [{"e.weight": {"rank_keys": [10, 12, 14], "union_keys_first_n": [10, 20, 30]}},
                          {"e.weight": {"rank_keys": [12, 14, 16], "union_keys_first_n": [12, 24, 36]}}]}
    assert simulate.recorded_tensors(meas, 2) == [("e.weight", 400, 4, (11, 13), 22)]


def test_replay_reuses_only_a_recording_that_covers_the_task():
    meta = {"model": "ncf", "ranks": 16, "steps": 6, "options": {"skew": 1.1, "batch": 64}}
    assert replay.same_recording(meta, "ncf", 8, 6, {"skew": 1.1, "batch": 64})
    assert not replay.same_recording(meta, "ncf", 32, 6, {"skew": 1.1, "batch": 64})     # too few ranks
    assert not replay.same_recording(meta, "ncf", 8, 12, {"skew": 1.1, "batch": 64})     # too few steps
    assert not replay.same_recording(meta, "ncf", 8, 6, {"skew": 1.1, "batch": 128})     # another task
    assert not replay.same_recording(meta, "lstm", 8, 6, {"skew": 1.1, "batch": 64})


def test_replay_table_in_milliseconds_and_mebibytes():
    row = {"framework": "ddp", "compression": "none", "aggregation_s": 0.0125, "wire_bytes_per_step_per_host": 3 * 2**19}
    md = replay.render({8: {"rows": [row]}, 16: {"rows": [{**row, "wire_bytes_per_step_per_host": None}]}}, "t")
    assert "| ddp | none | 12.5 (1.50) | 12.5 |" in md
