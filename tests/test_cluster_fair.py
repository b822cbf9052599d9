"""The fair, realistic parts of the cluster benchmark: CPU-fair time dilation, Zipf access, the
collective-only replay's recording, the simulator over the planner's cost model, and a smoke run of
the new baselines on 2 emulated hosts.

The simulator's tests need ``lossless_hc.training.planner`` and skip, with the reason, without it;
the emulated-cluster smoke runs need root and network namespaces (as in tests/test_cluster.py).
"""
import copy
import json
import math
import os
import sys

import pytest
import torch

from lossless_hc.bench import cluster, cluster_report, simulate
from lossless_hc.bench.workloads import data, replay, train
from lossless_hc.bench.workloads.tasks import WORKLOADS
from helpers import emulated_cluster_skip_reason
from processes import run_launcher

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# -- CPU-fair time dilation ------------------------------------------------------------------------
def test_cpu_fair_scaling_dilates_by_the_share_of_a_core():
    f = cluster.cpu_fair_scaling(workers=4, cores=2)
    assert (f["share"], f["rate_factor"], f["delay_factor"], f["threads_per_worker"]) == (0.5, 0.5, 2.0, 1)
    f = cluster.cpu_fair_scaling(workers=16, cores=2)
    assert f["rate_factor"] == 0.125 and f["delay_factor"] == 8.0
    # a core per worker or more: nothing to dilate (each worker runs one thread)
    for workers, cores in ((2, 2), (2, 16)):
        f = cluster.cpu_fair_scaling(workers, cores)
        assert f["rate_factor"] == 1.0 and f["delay_factor"] == 1.0
    # rate x share and delay / share keep (compute time) / (transfer time) and / (delay) fixed:
    # compute stretches by 1/share, and so does transfer time (bytes / rate) and the delay
    f = cluster.cpu_fair_scaling(workers=6, cores=4)
    compute, transfer, delay = 1.0, 0.5, 0.1
    stretched = compute / f["share"]
    assert stretched / (transfer / f["rate_factor"]) == pytest.approx(compute / transfer)
    assert stretched / (delay * f["delay_factor"]) == pytest.approx(compute / delay)
    with pytest.raises(ValueError, match="cpu_fair_scaling needs workers >= 1"):
        cluster.cpu_fair_scaling(0, 2)


def test_plan_skips_what_a_framework_does_not_implement():
    runs, skipped = cluster.plan(["horovod", "ddp", "fsdp"], ["bf16", "powersgd", "lossless"])
    assert ("ddp", "bf16") in runs and ("ddp", "powersgd") in runs and ("fsdp", "lossless") in runs
    assert ("fsdp", "bf16") in runs   # FSDP2's own MixedPrecisionPolicy(reduce_dtype=bfloat16)
    assert set(skipped) == {("horovod", "bf16"), ("horovod", "powersgd"), ("fsdp", "powersgd")}
    assert runs[0] == ("horovod", "none")
    with pytest.raises(SystemExit):  # the driver refuses too, with the reason
        train.parse_args(["--framework", "horovod", "--compression", "bf16"])


def test_auto_sparse_is_ddp_auto_over_sparse_embeddings_beside_dense_auto():
    """auto-sparse runs auto_hook on nn.Embedding(sparse=True) (DDP only: Horovod sends sparse gradients
    around any compressor, FSDP2 has none), next to auto on dense embeddings, and is compared with the
    fastest exact mode."""
    runs, skipped = cluster.plan(["horovod", "ddp", "fsdp"], ["sparse", "auto", "auto-sparse"])
    assert ("ddp", "auto-sparse") in runs and ("ddp", "auto") in runs
    assert ("horovod", "auto-sparse") in skipped and ("fsdp", "auto-sparse") in skipped
    assert train.parse_args(["--framework", "ddp", "--compression", "auto-sparse"]).sparse_embeddings
    assert not train.parse_args(["--framework", "ddp", "--compression", "auto"]).sparse_embeddings
    assert cluster.compute_label(1, "auto-sparse" in cluster.SPARSE_MODES).endswith("sparse embeddings")
    # lossy=True over the same model: a DDP mode on sparse embeddings, compared with the fastest overall
    runs, skipped = cluster.plan(["horovod", "ddp"], ["auto-lossy-sparse"])
    assert ("ddp", "auto-lossy-sparse") in runs and ("horovod", "auto-lossy-sparse") in skipped
    assert train.parse_args(["--framework", "ddp", "--compression", "auto-lossy-sparse"]).sparse_embeddings
    assert "auto-lossy-sparse" in cluster_report.AUTO and "auto-lossy-sparse" not in cluster_report.AUTO_EXACT


def test_answer_line_and_auto_marked():
    def row(fw, comp, step, base=1.0):
        return {"framework": fw, "compression": comp, "step_s_median": step, "step_s_p10": step, "step_s_p90": step,
                "speedup_vs_none": base / step, "wire_bytes_per_step_per_host": 1.0, "wire_vs_none": 1.0,
                "aggregation_bytes_per_s": None, "throughput_vs_none": None, "codec_share": 0.0,
                "max_param_diff_vs_none": None, "lossless_mode": comp in cluster_report.LOSSLESS, "fallbacks": 0,
                "aggregation_s": step - 0.1}
    rows = [row("ddp", "none", 1.0), row("ddp", "sparse", 0.4), row("ddp", "bf16", 0.5),
            row("ddp", "powersgd", 0.2), row("ddp", "auto", 0.42), row("ddp", "auto-lossy", 0.25),
            row("ddp", "auto-sparse", 0.44)]
    line = cluster_report.answer_line(rows)
    # The sparse-embedding modes train another setup of the model: each setup is answered, and each
    # planner mode compared, within its own (auto was measured against DDP's sparse mode before).
    assert "dense embeddings: fastest exact: ddp auto (420.0 ms" in line and "fastest overall: ddp powersgd" in line
    assert "sparse embeddings: fastest exact: ddp sparse (400.0 ms" in line
    assert "ddp auto: step 1.00x the fastest exact's" in line and "ddp auto-lossy: step 1.25x the fastest overall's" in line
    assert "ddp auto-sparse: step 1.10x the fastest exact's" in line
    only_dense = cluster_report.answer_line([r for r in rows if r["compression"] not in ("sparse", "auto-sparse")])
    assert only_dense.startswith("Is the step faster? fastest exact: ddp auto (420.0 ms") and "embeddings" not in only_dense
    from lossless_hc.bench.cluster_report import SPARSE_SETUP
    from lossless_hc.bench.workloads.train import SPARSE_MODES
    assert SPARSE_SETUP == SPARSE_MODES
    md = cluster_report.render_markdown({"rows": rows, "compute_s": {1: 0.1}, "shaping": {}, "skipped": [["horovod", "bf16"]]},
                                 "t")
    assert "| ddp | **auto-sparse** (planner) |" in md
    assert "| ddp | **auto** (planner) |" in md and "Not run (the framework does not implement the mode): horovod bf16" in md


# -- Zipf access -----------------------------------------------------------------------------------
def test_answer_line_never_ranks_a_lossy_mode_as_exact_nor_a_diverged_run():
    """Without an exact mode in a setup the line says so (it named the fastest lossy mode "fastest
    exact"), and a run whose loss or metric is not finite (NaN, or null read back from the JSON) is
    neither the fastest exact nor the fastest overall, nor a planner mode's reference."""
    def row(comp, step, **extra):
        return {"framework": "ddp", "compression": comp, "step_s_median": step, "step_s_mean": step,
                "speedup_vs_none": 1.0 / step, "final_loss": 0.5, "metric_value": 0.9, **extra}
    # lossy modes only beside auto-lossy: nothing exact ran
    line = cluster_report.answer_line([row("bf16", 0.5), row("topk", 0.3), row("auto-lossy", 0.4)])
    assert "fastest exact: - (no exact mode in this run)" in line
    assert "fastest overall: ddp topk (300.0 ms" in line and "ddp auto-lossy: step 1.33x the fastest overall's" in line
    # a sparse setup with only auto-lossy-sparse has no exact mode either
    line = cluster_report.answer_line([row("none", 1.0), row("auto-lossy-sparse", 0.2)])
    assert "sparse embeddings: fastest exact: - (no exact mode in this run)" in line
    # a diverged run (faster because its gradients are NaN) is not ranked, and is named
    rows = [row("none", 1.0), row("lossless", 0.6, final_loss=float("nan")), row("auto", 0.7),
            row("topk", 0.1, final_loss=None), row("fp16", 0.5, metric_value=float("inf")),
            row("auto-lossy", 0.4)]
    line = cluster_report.answer_line(rows)
    assert "fastest exact: ddp auto (700.0 ms" in line and "fastest overall: ddp auto-lossy (400.0 ms" in line
    assert "ddp auto: step 1.00x the fastest exact's" in line
    assert "ddp auto-lossy: step 1.00x the fastest overall's" in line
    assert "diverged, not ranked: ddp lossless, ddp topk, ddp fp16" in line
    line = cluster_report.answer_line([row("none", 1.0, final_loss=float("nan")), row("auto", 0.5, final_loss=None)])
    assert "fastest exact: - (every exact run diverged)" in line and "fastest overall: - (every run diverged)" in line
    assert "ddp auto: diverged" in line


def test_window_statistics_subtract_counters_and_recompute_the_ratio():
    before = {"payload_bytes": 100, "dense_bytes": 400, "wire_ratio": 0.25, "last_failure": None}
    after = {"payload_bytes": 400, "dense_bytes": 800, "wire_ratio": 0.5, "last_failure": "x"}
    d = train.stats_delta(after, before)
    assert (d["payload_bytes"], d["dense_bytes"], d["last_failure"]) == (300, 400, "x")
    assert d["wire_ratio"] == 0.75      # this window's 300 / 400, not 0.5 - 0.25


def test_zipf_weights_and_expected_distinct():
    w = data.zipf_weights(1000, 1.1)
    assert float(w.sum()) == pytest.approx(1.0)
    assert float(w[0] / w[1]) == pytest.approx(2 ** 1.1)
    assert data.expected_distinct(data.zipf_weights(10, 0.0), 1) == pytest.approx(1.0)
    # uniform: n (1 - (1 - 1/n)^draws), checked against simulation
    g = torch.Generator().manual_seed(0)
    for s in (0.0, 1.1):
        w = data.zipf_weights(2000, s)
        seen = [torch.multinomial(w, 500, replacement=True, generator=g).unique().numel() for _ in range(200)]
        mean, sd = sum(seen) / len(seen), torch.tensor(seen, dtype=torch.float64).std().item()
        assert abs(mean - data.expected_distinct(w, 500)) < 5 * sd / math.sqrt(len(seen)) + 1
    with pytest.raises(ValueError, match="zipf_weights needs n >= 1 and s >= 0"):
        data.zipf_weights(10, -1.0)


def test_ncf_skew_draws_zipf_users_and_zero_skew_keeps_todays_stream():
    d = data.ImplicitFeedback(200, 300, seed=0)
    # skew 0: exactly the uniform stream (interaction picks, then negatives) of before
    g = torch.Generator().manual_seed(7)
    users, items, labels = next(d.batches(64, negatives=1, seed=7))
    pick = torch.randint(0, d.train_users.numel(), (64,), generator=g)
    neg = torch.randint(0, 300, (64,), generator=g)
    assert torch.equal(users[:64], d.train_users[pick]) and torch.equal(items[64:], neg)
    assert torch.equal(items[:64], d.train_items[pick]) and labels.tolist() == [1.0] * 64 + [0.0] * 64
    # skew 1.1: user frequencies follow Zipf(1.1) over a fixed order (the same on every rank)
    it = d.batches(1000, negatives=1, seed=3, skew=1.1)
    counts = torch.zeros(200)
    neg_counts = torch.zeros(300)
    draws = 40 * 1000
    for _ in range(40):
        u, i, _ = next(it)
        counts += torch.bincount(u[:1000], minlength=200)
        neg_counts += torch.bincount(i[1000:], minlength=300)
    w = data.zipf_weights(200, 1.1)
    freq = (counts / draws).sort(descending=True).values
    # the hottest users carry Zipf's mass (binomial standard error, 5 sigma)
    for r in range(3):
        assert abs(float(freq[r]) - float(w[r])) < 5 * math.sqrt(float(w[r]) * (1 - float(w[r])) / draws)
    wi = data.zipf_weights(300, 1.1)
    assert abs(float(neg_counts[0]) / draws - float(wi[0])) < 5 * math.sqrt(float(wi[0]) / draws)
    # ranks see the same hot users: another rank's stream, same order
    other = next(d.batches(1000, negatives=1, seed=4, skew=1.1))[0][:1000]
    assert int(torch.bincount(other, minlength=200).argmax()) == int(counts.argmax())


# -- the training driver's model dtype ---------------------------------------------------------------
@pytest.mark.parametrize("model", ["ncf", "digits"])   # integer ids; float images (cast to the dtype)
def test_the_training_driver_trains_a_bfloat16_model(model):
    small = ["--users", "300", "--items", "400", "--dim", "4"] if model == "ncf" else []
    res = train.main(["--model", model, "--framework", "local", "--compression", "none", "--steps", "3",
                      "--batch", "16", "--dtype", "bfloat16", *small])
    torch.manual_seed(0)
    params = sum(p.numel() for p in WORKLOADS[model](train.parse_args(["--model", model, *small]), 0).model.parameters())
    assert res["dense_bytes_per_step"] == 2 * params and res["bytes_per_step"] == 2 * params
    assert math.isfinite(res["final_loss"]) and math.isfinite(res["value"])


# -- the replay recording ----------------------------------------------------------------------------
def _ncf_args(*extra):
    return train.parse_args(["--model", "ncf", "--framework", "local", "--compression", "none", "--users", "300",
                             "--items", "400", "--dim", "4", "--batch", "16", *extra])


def test_record_and_replay_round_trip(tmp_path):
    meta = replay.record(_ncf_args("--skew", "1.1"), ranks=3, steps=2, out_dir=str(tmp_path), log=lambda *a: None)
    assert meta["row_sparse"] == [True, True, True, True] + [False] * (len(meta["names"]) - 4)
    # step 0 of rank r is the gradient of rank r's first batch with the initial model
    ref_args = _ncf_args("--skew", "1.1")
    torch.manual_seed(ref_args.seed)
    work = WORKLOADS["ncf"](ref_args, 0)
    for r in range(3):
        work.model.zero_grad()
        work.loss(work.model, next(work.batches_for(r))).backward()
        want = [p.grad for p in work.model.parameters()]
        got = replay.load_rank(str(tmp_path), r)[0]
        for w, e in zip(want, got):
            dense = torch.zeros_like(w)
            if isinstance(e, (tuple, list)):
                dense[e[0]] = e[1]
                assert e[0].numel() == int((w.abs().sum(dim=1) > 0).sum())   # exactly the touched rows
            else:
                dense = e
            assert torch.equal(dense, w)
    # the union statistics are those of the recorded supports
    for s, stats in enumerate(meta["row_stats"]):
        for name, st in stats.items():
            i = meta["names"].index(name)
            supports = [replay.load_rank(str(tmp_path), r)[s][i][0] for r in range(3)]
            assert st["rank_keys"] == [x.numel() for x in supports]
            assert st["union_keys_first_n"] == [torch.cat(supports[:n]).unique().numel() for n in (1, 2, 3)]
    # replaying: backward leaves exactly the recorded gradient, dense or sparse
    for comp in ("none", "sparse"):
        a = train.parse_args(["--model", "replay", "--replay-dir", str(tmp_path), "--framework", "local",
                              "--compression", comp])
        w = replay.ReplayWorkload(a, 2)
        for s in range(3):  # cycles through the 2 recorded steps
            w.model.zero_grad()
            w.loss(w.model, next(w.batches)).backward()
            rec = replay.load_rank(str(tmp_path), 2)[s % 2]
            for (name, p), e in zip(w.model.named_parameters(), rec):
                assert p.grad.is_sparse == (comp == "sparse" and isinstance(e, (tuple, list))), name
                g = p.grad.to_dense() if p.grad.is_sparse else p.grad
                want = torch.zeros_like(g)
                if isinstance(e, (tuple, list)):
                    want[e[0]] = e[1]
                else:
                    want = e
                assert torch.equal(g, want), name
    with pytest.raises(SystemExit, match="rank 3 was not recorded"):
        replay.load_rank(str(tmp_path), 3)


# -- the simulator ---------------------------------------------------------------------------------
def test_ncf_tensor_statistics():
    small = simulate.ncf_tensors(2, 0.0, 5000, 5000, 8, 256)
    assert [t[0] for t in small] == ["user_gmf", "item_gmf", "user_mlp", "item_mlp", "mlp"]
    prev = None
    for n in (2, 8, 32, 128):
        name, numel, row, ks, union = simulate.ncf_tensors(n, 1.1, 5000, 5000, 8, 256)[0]
        assert numel == 5000 * 8 and row == 8 and len(ks) == n
        assert ks[0] <= union <= min(5000, n * ks[0])
        assert prev is None or union > prev
        prev = union
        uniform = simulate.ncf_tensors(n, 0.0, 5000, 5000, 8, 256)[0]
        assert union < uniform[4]   # skew concentrates the union


def _planner():
    return pytest.importorskip("lossless_hc.training.planner",
                               reason="the simulator evaluates lossless_hc.training.planner (not in this checkout)")


def test_simulated_allgather_grows_linearly_and_auto_takes_the_minimum():
    pl = _planner()
    rows = simulate.sweep([16, 32, 64], [0.0], 10**9, None, 10**6, 10**6, 32, 512)
    model = pl.CostModel(simulate.calibration(10**9))
    # an allgather moves (n-1) x k rows to every rank: affine in n for a fixed k per rank (the
    # per-coordinate scan of the table is the constant), so doubling n doubles the increment
    ag = []
    for n in (16, 32, 64):
        _, numel, row, ks, union = simulate.ncf_tensors(n, 0.0, 10**6, 10**6, 32, 512)[0]
        ag.append(model.predict("allgather", pl.TensorStats(numel=numel, row=row, world_size=n, rank_keys=ks,
                                                             union_keys=union)))
    assert 1.9 < (ag[2] - ag[1]) / (ag[1] - ag[0]) < 2.1
    assert rows[2]["allgather"] > 1.5 * rows[1]["allgather"] > 2.0 * rows[0]["allgather"]
    for r, n in zip(rows, (16, 32, 64)):
        tensors = simulate.ncf_tensors(n, 0.0, 10**6, 10**6, 32, 512)
        best = sum(min(model.predict(s, pl.TensorStats(numel=t[1], row=t[2], world_size=n, rank_keys=t[3],
                                                        union_keys=t[4])) for s in simulate.EXACT) for t in tensors)
        assert r["auto"] == pytest.approx(best)
        assert r["auto"] <= min(r[s] for s in simulate.EXACT) * (1 + 1e-12)
        assert r["auto-lossy"] <= r["auto"] * (1 + 1e-12)
        # sparse tables: no scan is priced, so auto over them is predicted faster than over dense ones
        assert r["auto-sparse"] < r["auto"]


def test_simulator_check_against_measured_points():
    pl = _planner()
    meas = {"recording": {"options": {"skew": 1.1}}, "names": ["e.weight", "l.weight"], "shapes": [[100, 4], [3, 2]],
            "row_sparse": [True, False],
            "row_stats": [{"e.weight": {"rank_keys": [10, 12], "union_keys_first_n": [10, 20]}}],
            "by_hosts": {"2": {"shaping": {"rate_bits": 10**9, "delay_s": 0.0, "latency_applied": False},
                               "bandwidth_bits": 10**9, "latency_s": 0.0,
                               "rows": [{"framework": "ddp", "compression": "none", "aggregation_s": 0.01},
                                        {"framework": "ddp", "compression": "powersgd", "aggregation_s": 0.01}]}}}
    out = simulate.check(meas, None)
    assert [c["strategy"] for c in out] == ["dense"]   # powersgd has no strategy in the model
    assert out[0]["rel_error"] == pytest.approx((out[0]["predicted_s"] - 0.01) / 0.01)
    # a CPU-fair replay (workers at a quarter of a core): the same link, every local cost 4x
    meas["by_hosts"]["2"]["cpu_fair"] = {"share": 0.25}
    fair = simulate.check(meas, None)
    stats = pl.TensorStats(numel=400, row=4, world_size=2, rank_keys=(10, 12), union_keys=20)
    one_core, quarter = (pl.CostModel(simulate.calibration(10**9, None, share)) for share in (1.0, 0.25))
    for strategy in simulate.STRATEGIES:
        assert quarter.local_seconds(strategy, stats) == pytest.approx(4 * one_core.local_seconds(strategy, stats))
        assert quarter.wire_bytes(strategy, stats) == one_core.wire_bytes(strategy, stats)
    extra = 3 * sum(one_core.local_seconds("dense", st) for st in
                    [stats, pl.TensorStats(numel=6, row=1, world_size=2, rank_keys=(6, 6), union_keys=6)])
    assert fair[0]["predicted_s"] == pytest.approx(out[0]["predicted_s"] + extra)
    with pytest.raises(ValueError, match=r"cpu_share must be in \(0, 1\]"):
        simulate.calibration(10**9, None, 0.0)
    # links that applied a one-way delay (netem): each of the ring's hops is priced at that delay
    del meas["by_hosts"]["2"]["cpu_fair"]
    meas["by_hosts"]["2"]["shaping"].update(delay_s=1e-3, latency_applied=True)
    delayed = simulate.check(meas, None)
    hops = 2 * 2 * (2 - 1)    # 2(n-1) for each of the two tensors
    assert delayed[0]["predicted_s"] == pytest.approx(out[0]["predicted_s"] + hops * (1e-3 - pl.DEFAULT_LATENCY_S))
    meas["by_hosts"]["2"]["shaping"].update(delay_s=0.0, latency_applied=False)
    # every mode the model prices is checked: the top-k allgather hook, and auto-lossy over sparse tables
    more = copy.deepcopy(meas)
    more["by_hosts"]["2"]["rows"] += [{"framework": "ddp", "compression": m, "aggregation_s": 0.01}
                                      for m in ("topk-allgather", "auto-lossy-sparse")]
    checked = {c["mode"]: c for c in simulate.check(more, None)}
    assert checked["topk-allgather"]["strategy"] == "topk_allgather"
    pred = simulate.step_times(pl.CostModel(simulate.calibration(10**9)), simulate.recorded_tensors(more, 2), 2)
    assert checked["auto-lossy-sparse"]["predicted_s"] == pytest.approx(pred["auto-lossy-sparse"])
    assert pred["auto-lossy-sparse"] <= pred["auto-sparse"] * (1 + 1e-12)   # more candidates for the dense tensors
    # an auto row that recorded its calibration: every mode of that host count is priced with it
    codec = {st: [1e-6, 0.0] for st in pl.PRICED}
    meas["by_hosts"]["2"]["rows"].append({"framework": "ddp", "compression": "auto", "aggregation_s": 0.02,
                                          "auto_calibration": {"alpha_s": 0.5, "seconds_per_byte": 0.0,
                                                               "codec_seconds": codec}})
    rec = simulate.check(meas, None)
    assert [(c["mode"], c["calibration"]) for c in rec] == [("none", "measured"), ("auto", "measured")]
    dense = 2 * (2 * (2 - 1) * 0.5) + 1e-6 * (400 + 6)    # each tensor's 2(n-1) hops of 0.5 s; the local copy
    assert rec[0]["predicted_s"] == pytest.approx(dense)
    assert [c["calibration"] for c in simulate.check(meas, None, use_recorded=False)] == ["default", "default"]


# -- 2 emulated hosts: the new modes run -------------------------------------------------------------


@pytest.mark.multiprocess
def test_two_hosts_bf16_powersgd_cpu_fair_and_replay(tmp_path):
    reason = emulated_cluster_skip_reason()
    if reason:
        pytest.skip(f"emulated cluster: {reason}")
    small = "--users 5000 --items 5000 --dim 8 --batch 64"
    cmd = [sys.executable, "-m", "lossless_hc.bench", "cluster", "--hosts", "2", "--bandwidth", "200mbit",
           "--latency", "0", "--model", "ncf", "--compression", "none,bf16,powersgd", "--framework", "ddp",
           "--steps", "5", "--warmup", "1", "--cpu-fair", "--cores", "1", "--skew", "1.1", "--train-args", small,
           "--out", str(tmp_path / "c")]
    res = run_launcher(cmd, cwd=REPO, timeout=240)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    with open(tmp_path / "c" / "cluster_ncf_zipf1.1_200mbit_2hosts.json") as f:
        result = json.load(f)
    assert result["cpu_fair"]["share"] == 0.5 and result["shaping"]["rate_bits"] == 100_000_000
    assert "rate x0.5 -> 100mbit" in res.stderr
    rows = {(r["framework"], r["compression"]): r for r in result["rows"]}
    assert set(rows) == {("ddp", "none"), ("ddp", "bf16"), ("ddp", "powersgd")}
    # bf16 halves the bytes on the wire; PowerSGD's low-rank factors send less again
    none = rows[("ddp", "none")]["wire_bytes_per_step_per_host"]
    assert 0.4 * none < rows[("ddp", "bf16")]["wire_bytes_per_step_per_host"] < 0.6 * none
    assert rows[("ddp", "powersgd")]["max_param_diff_vs_none"] > 0   # lossy, and it ran
    # collective-only replay of a recording: the lossless mode reproduces the uncompressed run
    cmd = [sys.executable, "-m", "lossless_hc.bench", "replay", "--model", "ncf", "--ranks", "2", "--record-steps", "2",
           "--hosts", "2", "--bandwidth", "200mbit", "--latency", "0", "--compression", "none,lossless",
           "--framework", "ddp", "--steps", "4", "--warmup", "1", "--train-args", small, "--out", str(tmp_path / "r")]
    res = run_launcher(cmd, cwd=REPO, timeout=240)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    with open(tmp_path / "r" / "replay_ncf.json") as f:
        rep = json.load(f)
    rows = {r["compression"]: r for r in rep["by_hosts"]["2"]["rows"]}
    assert rows["lossless"]["max_param_diff_vs_none"] < 1e-6
    assert rows["lossless"]["wire_bytes_per_step_per_host"] < 0.5 * rows["none"]["wire_bytes_per_step_per_host"]


def test_simulator_uses_the_planners_strategy_names():
    pl = _planner()
    assert simulate.EXACT == pl.EXACT_STRATEGIES and simulate.LOSSY == pl.LOSSY_STRATEGIES


def test_sparse_momentum_is_coalesced_with_the_same_values():
    """torch's SGD momentum over nn.Embedding(sparse=True) gradients grows by every step's rows
    uncoalesced; coalesce_sparse_state keeps one entry per row touched, and the parameters take the
    same values as without it (the same sums, up to their order)."""
    from lossless_hc.bench.workloads.tasks import OPTIMIZERS, coalesce_sparse_state

    torch.manual_seed(0)
    a = torch.nn.Embedding(100, 4, sparse=True)
    b = torch.nn.Embedding(100, 4, sparse=True)
    b.load_state_dict(a.state_dict())
    oa, ob = OPTIMIZERS["sgd"](a.parameters(), 0.1), OPTIMIZERS["sgd"](b.parameters(), 0.1)
    g = torch.Generator().manual_seed(1)
    for _ in range(6):
        ids = torch.randint(0, 10, (30,), generator=g)
        for emb, opt in ((a, oa), (b, ob)):
            opt.zero_grad()
            emb(ids).pow(2).sum().backward()
            opt.step()
        coalesce_sparse_state(ob)
    buf_a, buf_b = oa.state[a.weight]["momentum_buffer"], ob.state[b.weight]["momentum_buffer"]
    assert buf_a._nnz() > 60 and buf_b.is_coalesced() and buf_b._nnz() <= 10   # 10 distinct rows
    torch.testing.assert_close(b.weight, a.weight, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(buf_b.to_dense(), buf_a.to_dense(), rtol=1e-6, atol=1e-6)
