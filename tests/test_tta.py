"""Time to accuracy (lossless_hc.bench.tta): the target logic, the held-out splits and metrics of
its workloads, the worker's training clock, and one real run on emulated hosts (network
namespaces: needs root, skipped with the reason otherwise, as in tests/test_cluster.py)."""
import json
import math
import os
import sys
import time

import pytest
import torch

from lossless_hc.bench import tta, tta_report, tta_worker
from lossless_hc.bench.workloads import data, tasks
from helpers import emulated_cluster_skip_reason
from processes import run_launcher

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# -- target logic ----------------------------------------------------------------------------------
def _curve(points):
    return [{"step": s, "train_s": t, "metric": m} for s, t, m in points]


def test_first_reach_is_the_first_evaluation_at_or_past_the_target():
    up = _curve([(0, 0.0, 0.1), (10, 1.0, 0.5), (20, 2.5, 0.95), (30, 3.0, 0.94), (40, 4.0, 0.97)])
    assert tta_report.first_reach(up, 0.95, True) == up[2]        # at the target counts
    assert tta_report.first_reach(up, 0.96, True) == up[4]        # a later dip does not matter
    assert tta_report.first_reach(up, 0.98, True) is None
    down = _curve([(0, 0.0, 5000.0), (25, 2.0, 300.0), (50, 4.0, float("nan")), (75, 6.0, 119.0)])
    assert tta_report.first_reach(down, 120.0, False) == down[3]  # perplexity: lower is better
    assert tta_report.first_reach(down, 100.0, False) is None
    assert tta_report.first_reach(_curve([(0, 0.0, float("nan"))]), 0.0, True) is None  # NaN never reaches


def _run(label, seed, points, higher=True, diff=None):
    c = _curve(points)
    return {"label": label, "seed": seed, "curve": c, "higher_is_better": higher, "steps_run": c[-1]["step"],
            "train_s": c[-1]["train_s"], "eval_s": 0.1, "wire_bytes_per_host": 1000.0 * c[-1]["step"],
            "stats": {"fallbacks": 1}, "max_param_diff_vs_none": diff, "metric": "accuracy"}


def test_summary_speedup_and_per_mode_medians():
    runs = [_run("none", 1, [(0, 0, 0.1), (10, 4.0, 0.9), (20, 8.0, 0.96)]),
            _run("thc", 1, [(0, 0, 0.1), (10, 1.0, 0.8), (20, 2.0, 0.97)]),
            _run("none", 2, [(0, 0, 0.1), (10, 5.0, 0.97)]),
            _run("thc", 2, [(0, 0, 0.1), (10, 1.0, 0.5), (20, 2.0, 0.6)])]   # never reached
    rows = tta_report.summarize_runs(runs, 0.96)
    by = {(r["label"], r["seed"]): r for r in rows}
    assert by[("none", 1)]["time_to_target_s"] == 8.0 and by[("none", 1)]["steps_to_target"] == 20
    assert by[("thc", 1)]["speedup_vs_none"] == pytest.approx(4.0)
    assert by[("thc", 2)]["reached"] is False and by[("thc", 2)]["speedup_vs_none"] is None
    assert by[("thc", 2)]["final_metric"] == 0.6
    modes = {m["label"]: m for m in tta_report.per_mode(rows)}
    assert modes["none"]["reached"] == 2 and modes["none"]["time_to_target_s"] == pytest.approx(6.5)
    assert modes["thc"]["reached"] == 1 and modes["thc"]["time_to_target_s"] == 2.0
    result = {"runs": runs, "summary": rows, "target": 0.96, "title": "t", "max_steps": 20, "eval_every": 10,
              "seeds": [1, 2], "shaping": {"qdisc": "netem"}, "cpu_fair": None}
    md = tta_report.render_markdown(result)
    assert "| thc | 1/2 | 2.00 | 4.00x | 20 |" in md and "thc seed 2: not reached" in md


def test_the_planner_runs_say_what_they_ran():
    """Under the table, each planner run's last plan and the step guard's verdict (rank 0's stats), as the
    cluster report gives them: a lossy run that switched to the half-precision hook says so; the other modes
    (a plain codec's stats have no plan) add nothing."""
    guard = {"verdict": "dense", "plan_ms": 170.7, "dense_ms": 162.7, "window": 8, "steps": 5, "block": 2,
             "rounds": 1, "trials": 1, "lead_plan_ms": 173.2, "lead_dense_ms": 178.8, "alternative": {"bf16": 11}}
    runs = [_run("none", 1, [(0, 0, 0.1), (10, 4.0, 0.97)]),
            _run("thc", 1, [(0, 0, 0.1), (10, 1.0, 0.97)]),
            dict(_run("auto-lossy", 1, [(0, 0, 0.1), (10, 2.0, 0.97)]), framework="ddp",
                 stats={"fallbacks": 0, "guard": guard, "plan": {"param0(8, 4)": {"strategy": "topk"},
                                                                  "param1(4,)": {"strategy": "dense"}}})]
    result = {"runs": runs, "summary": tta_report.summarize_runs(runs, 0.96), "target": 0.96, "title": "t",
              "max_steps": 10, "eval_every": 10, "seeds": [1], "shaping": {"qdisc": "netem"}, "cpu_fair": None}
    md = tta_report.render_markdown(result)
    assert "ddp auto-lossy chose (rank 0, last plan): topk: 1 tensor (param0(8, 4)); dense: 1 tensor (param1(4,))" in md
    assert ("step guard (steps 8-27): plans 170.7 ms, dense 162.7 ms median step: dense allreduce in place "
            "(DDP's own, 11 tensors in bf16) from then on") in md
    assert md.count("chose (rank 0") == 1 and "thc chose" not in md
    result["seeds"] = [1, 2]   # several seeds: each planner run is named with its seed
    assert "ddp auto-lossy (seed 1) chose" in tta_report.render_markdown(result)


def test_a_diverged_seed_shows_in_the_final_metric_whatever_the_seeds_order():
    """statistics.median does not order NaN: [nan, 0.5, 0.6] gave 0.5 and [0.5, nan, 0.6] nan. A mode with
    a diverged seed reports nan as its final metric, in any order."""
    nan = float("nan")
    for finals in ([nan, 0.5, 0.6], [0.5, nan, 0.6], [0.5, 0.6, nan]):
        runs = [_run("topk", s, [(0, 0, 0.1), (10, 1.0, f)]) for s, f in enumerate(finals, 1)]
        (mode,) = tta_report.per_mode(tta_report.summarize_runs(runs, 0.96))
        assert mode["final_metric"] != mode["final_metric"], (finals, mode["final_metric"])


def test_ddp_sparse_is_an_exact_mode_in_the_table():
    """DDP's sparse allreduce sums the gradients exactly, as bench cluster ranks it: its parameter
    difference to the uncompressed run is marked as an exact mode's."""
    assert tta_report.EXACT == ("none", "sparse", "lossless", "auto", "auto-sparse")
    runs = [_run("none", 1, [(0, 0, 0.1), (10, 4.0, 0.97)]),
            _run("sparse", 1, [(0, 0, 0.1), (10, 3.0, 0.97)], diff=1e-7),
            _run("topk", 1, [(0, 0, 0.1), (10, 2.0, 0.97)], diff=1e-2)]
    result = {"runs": runs, "summary": tta_report.summarize_runs(runs, 0.96), "target": 0.96, "title": "t",
              "max_steps": 10, "eval_every": 10, "seeds": [1], "shaping": {"qdisc": "netem"}, "cpu_fair": None}
    md = tta_report.render_markdown(result)
    assert "1.00e-07 (exact mode)" in md and "1.00e-02 |" in md


def test_tta_refuses_what_its_workers_would_refuse_or_never_reach(monkeypatch, capsys):
    """--max-train-seconds below 0 (every worker refused it after the cluster was built: exit 1), a target
    that is not finite (every run went to the step cap, "not reached"), --timeout of 0 or less and --cores
    below 1 exit 2 before anything runs."""
    import argparse

    def never(*a, **k):
        raise AssertionError("ran past the option checks")
    monkeypatch.setattr(tta, "run_on_clusters", never)
    p = argparse.ArgumentParser()
    tta.add_arguments(p)
    for bad, message in ((["--max-train-seconds", "-1"], "--max-train-seconds"),
                         (["--max-train-seconds", "nan"], "--max-train-seconds"),
                         (["--target", "nan"], "--target must be a finite number"), (["--target", "inf"], "--target"),
                         (["--timeout", "-5"], "--timeout"), (["--cores", "0"], "--cores")):
        assert tta.cmd_tta(p.parse_args(["--hosts", "2", "--modes", "none", *bad])) == 2, bad
        assert message in capsys.readouterr().err


def test_parse_modes():
    modes = tta.parse_modes("none,topk-allgather:0.1,topk-allgather:0.01,lossless", "ddp")
    assert modes[1] == ("topk-allgather:0.1", "topk-allgather", ["--topk-ratio", "0.1"])
    assert modes[3] == ("lossless", "lossless", [])
    assert tta.parse_modes("thc:exact-output", "ddp") == [("thc:exact-output", "thc", ["--thc-exact", "output"])]
    for bad, why in (("none,zip", "unknown"), ("thc:0.1", "ratio"), ("topk:0", "ratio"), ("none,none", "repeated"),
                     ("bf16", "does not implement")):
        with pytest.raises(ValueError, match=why):
            tta.parse_modes(bad, "horovod" if bad == "bf16" else "ddp")


def test_thc_exact_output_is_refused_where_it_would_not_apply():
    """``--thc-exact output`` is DDP's ``THCHookState(exact=...)``: under another framework or another
    compression the output layer would not be sent exactly, so the driver and ``bench tta`` refuse it
    (with one line naming the option) instead of training without it."""
    from lossless_hc.bench.workloads import train

    assert train.parse_args(["--framework", "ddp", "--compression", "thc", "--thc-exact", "output"]).thc_exact == "output"
    for framework, compression in (("horovod", "thc"), ("fsdp", "thc"), ("local", "thc"), ("ddp", "topk")):
        with pytest.raises(SystemExit):
            train.parse_args(["--framework", framework, "--compression", compression, "--thc-exact", "output"])
    with pytest.raises(ValueError, match="exact-output"):
        tta.parse_modes("thc:exact-output", "horovod")


def test_thc_exact_output_picks_the_output_layer_over_the_vocabulary():
    """``--thc-exact output`` (tta mode ``thc:exact-output``): the nn.Linear whose outputs are as many as
    the embedding's rows, nothing else (docs/THC.md: THC's noise stops Adam from learning that layer)."""
    from lossless_hc.bench.workloads import models
    from lossless_hc.bench.workloads.train import output_layer_parameters

    lm = models.LSTMLanguageModel(300)
    assert [id(p) for p in output_layer_parameters(lm)] == [id(lm.decoder.weight), id(lm.decoder.bias)]
    assert output_layer_parameters(models.DigitsCNN()) == []


# -- held-out data and metrics ---------------------------------------------------------------------
def test_hit_rate_at_k_on_a_constructed_case():
    # column 0 is the positive; rank = candidates scoring strictly higher
    scores = torch.tensor([[5.0] + [1.0] * 99,                        # rank 0: hit
                           [5.0] + [6.0] * 9 + [0.0] * 90,            # rank 9: hit (top 10)
                           [5.0] + [6.0] * 10 + [0.0] * 89,           # rank 10: miss
                           [5.0] + [5.0] * 99])                       # ties favour the positive: hit
    assert data.hit_rate_at_k(scores, 10) == 0.75
    assert data.hit_rate_at_k(scores, 1) == 0.5
    with pytest.raises(ValueError, match="needs a rows x candidates matrix"):
        data.hit_rate_at_k(scores[0], 10)


def test_ncf_held_out_items_are_unseen_and_the_metric_learns_nothing_by_chance():
    d = data.ImplicitFeedback(2000, 3000, seed=0)
    per_user = d.train_users.numel() // d.num_users
    seen = d.train_items.view(d.num_users, per_user)
    for skew in (0.0, 1.1):
        u, items = d.held_out_candidates(users=500, candidates=100, seed=1, skew=skew)
        assert items.shape == (500, 100) and u.unique().numel() == 500
        assert torch.equal(items[:, 0], d.test_items[u])
        known = torch.cat([seen[u], d.test_items[u, None]], dim=1)
        # the positive was never a training interaction of its user; no negative is a known item
        assert not (seen[u] == items[:, :1]).any()
        assert not (items[:, 1:, None] == known[:, None, :]).any()
    # a model that scores every item alike ranks the positive first (ties): HR = 1; a model that
    # ranks the positive last: HR = 0 -- the metric reads the model, nothing else
    class Const(torch.nn.Module):
        def __init__(self, positive_score):
            super().__init__()
            self.s = positive_score

        def forward(self, users, items):
            return torch.where(items == d.test_items[users], self.s, 0.0)
    assert d.hit_rate(Const(0.0)) == 1.0 and d.hit_rate(Const(-1.0)) == 0.0


def test_digits_split_is_disjoint_and_fixed():
    import argparse
    a = argparse.Namespace(seed=3, batch=8)
    w = tasks.DigitsWorkload(a, 0)
    test, train = set(w.test_index.tolist()), set(w.train_index.tolist())
    assert not test & train and len(test) == 360 and len(test | train) == 1797
    assert torch.equal(tasks.DigitsWorkload(argparse.Namespace(seed=7, batch=8), 1).test_index, w.test_index)


def test_language_model_validation_files_are_held_out():
    train_ids, valid_ids, words, (train_files, valid_files) = data.python_source_split(vocab=2000, held_out_every=10)
    assert valid_files and not set(train_files) & set(valid_files)
    assert len(train_files) >= 8 * len(valid_files)
    assert len(words) == 2000 and int(train_ids.max()) < 2000 and int(valid_ids.max()) < 2000
    assert valid_ids.numel() > 10_000


# -- the worker's clock: evaluation is not training time --------------------------------------------
EVAL_PAUSE = 0.3  # seconds each evaluation sleeps in the clock test


def test_worker_excludes_evaluation_time(tmp_path, monkeypatch):
    real = tasks.DigitsWorkload.evaluate

    def slow_evaluate(self, model):  # the real metric, made slow
        time.sleep(EVAL_PAUSE)
        return real(self, model)
    monkeypatch.setattr(tasks.DigitsWorkload, "evaluate", slow_evaluate)
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    threads = torch.get_num_threads()  # the worker sets this process's thread count: restored below
    try:
        _worker_clock_checks(tmp_path)
    finally:
        torch.set_num_threads(threads)


def _worker_clock_checks(tmp_path):
    out = tmp_path / "r.json"
    res = tta_worker.main(["--model", "digits", "--framework", "local", "--compression", "none", "--steps", "30",
                           "--eval-every", "10", "--target", "2", "--batch", "16", "--threads", "1",
                           "--json", str(out)])
    assert [p["step"] for p in res["curve"]] == [0, 10, 20, 30] and res["steps_run"] == 30
    assert res["eval_s"] >= 4 * EVAL_PAUSE
    # training and evaluation are disjoint parts of the wall time: counting evaluation as
    # training would put train_s + eval_s above wall_s by >= 3 pauses
    assert res["train_s"] + res["eval_s"] <= res["wall_s"]
    times = [p["train_s"] for p in res["curve"]]
    assert times[0] == 0.0 and times == sorted(times)
    assert json.loads(out.read_text())["curve"] == res["curve"]
    # the target stops training at the first evaluation that reaches it
    res = tta_worker.main(["--model", "digits", "--framework", "local", "--compression", "none", "--steps", "30",
                           "--eval-every", "10", "--target", "0.0", "--batch", "16", "--threads", "1"])
    assert res["steps_run"] == 0 and [p["step"] for p in res["curve"]] == [0] and res["train_s"] == 0.0


# -- real namespaces, real workers -----------------------------------------------------------------


@pytest.mark.multiprocess
def test_two_hosts_lossless_curve_equals_uncompressed(tmp_path):
    reason = emulated_cluster_skip_reason()
    if reason:
        pytest.skip(f"emulated cluster: {reason}")
    cmd = [sys.executable, "-m", "lossless_hc.bench", "tta", "--task", "digits", "--hosts", "2", "--bandwidth",
           "1gbit", "--latency", "0", "--modes", "none,lossless", "--max-steps", "40", "--eval-every", "10",
           "--target", "1.01", "--cpu-fair", "--out", str(tmp_path)]
    proc = run_launcher(cmd, cwd=REPO, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(tmp_path / "tta_digits_1gbit_2hosts.json") as f:
        result = json.load(f)
    runs = {r["label"]: r for r in result["runs"]}
    none, lossless = runs["none"], runs["lossless"]
    assert [p["step"] for p in none["curve"]] == [0, 10, 20, 30, 40]
    assert [p["step"] for p in lossless["curve"]] == [p["step"] for p in none["curve"]]
    for a, b in zip(none["curve"], lossless["curve"]):
        assert math.isclose(a["metric"], b["metric"], abs_tol=1e-6)  # accuracy: multiples of 1/360
    assert none["curve"][-1]["metric"] > none["curve"][0]["metric"] + 0.2   # it learned
    assert lossless["max_param_diff_vs_none"] < 1e-5
    for suffix in ("_time.png", "_steps.png"):
        assert (tmp_path / f"tta_digits_1gbit_2hosts{suffix}").stat().st_size > 0
