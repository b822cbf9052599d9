"""The emulated cluster benchmark (lossless_hc.bench.cluster).

Unit tests of the parsing, statistics, leftover detection and the top-k allgather baseline's
packing need nothing special. The end-to-end test builds real network namespaces and runs real
Horovod and DDP workers over Gloo: it needs root and a kernel that allows `ip netns add`, and is
skipped, with the reason, otherwise.
"""
import json
import os
import sys

import pytest
import torch

from lossless_hc.bench import cluster, cluster_report, netns
from lossless_hc.bench.workloads.topk_allgather import TopKAllgather, topk_count
from helpers import emulated_cluster_skip_reason
from processes import run_launcher

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# -- no root needed --------------------------------------------------------------------------------
def test_parse_rate_and_delay():
    assert cluster.parse_rate("1gbit") == 10**9
    assert cluster.parse_rate("10gbit") == 10**10
    assert cluster.parse_rate("500mbit") == 5 * 10**8
    assert cluster.parse_delay("100us") == pytest.approx(1e-4)
    assert cluster.parse_delay("2ms") == pytest.approx(2e-3)
    assert cluster_report.rate_label(10**10) == "10gbit"
    for bad in ("fast", "1tbit", "-1gbit", "1kbit"):
        with pytest.raises(ValueError, match="bandwidth"):
            cluster.parse_rate(bad)
    with pytest.raises(ValueError, match="latency"):
        cluster.parse_delay("soon")
    with pytest.raises(ValueError, match="unknown"):
        cluster.parse_list("none,zip", cluster.COMPRESSIONS, "--compression")


def test_percentile_and_throughput():
    xs = [5.0, 1.0, 3.0, 2.0, 4.0]
    assert cluster_report.percentile(xs, 50) == 3.0
    assert cluster_report.percentile(xs, 10) == pytest.approx(1.4)
    assert cluster_report.percentile(xs, 90) == pytest.approx(4.6)
    # 100 MB in a 0.3 s step of which 0.1 s is compute: 0.2 s of communication.
    assert cluster_report.aggregation_throughput(100e6, 0.3, 0.1) == pytest.approx(500e6)
    assert cluster_report.aggregation_throughput(100e6, 0.1, 0.1) is None


def _report(rank, steps, tx, stats=None, dense=1000):
    return {"rank": rank, "step_seconds": steps, "dense_bytes_per_step": dense, "timed_steps": len(steps),
            "net_bytes": {"tx_bytes": tx, "rx_bytes": tx}, "stats": stats, "final_loss": 0.5,
            "metric": "m", "value": 0.1}


def test_summarize_and_relative_ratios():
    none = cluster_report.summarize("horovod", "none",
                                    [_report(1, [0.4] * 4, 8000), _report(0, [0.3, 0.3, 0.5, 0.3], 4000)],
                                    compute_s=0.1)
    assert none["step_s_median"] == pytest.approx(0.3)
    assert none["wire_bytes_per_step_per_host"] == pytest.approx((4000 / 4 + 8000 / 4) / 2)
    assert none["aggregation_bytes_per_s"] == pytest.approx(1000 / 0.2)
    stats = {"encode_seconds": 0.04, "decode_seconds": 0.04, "payload_bytes": 1, "dense_bytes": 1, "fallbacks": 2}
    ours = cluster_report.summarize("horovod", "lossless",
                                    [_report(0, [0.15] * 4, 400, stats), _report(1, [0.2] * 4, 400)],
                                    compute_s=0.1)
    assert ours["codec_share"] == pytest.approx(0.02 / 0.15)
    assert ours["fallbacks"] == 2
    none.update(max_param_diff_vs_none=None, lossless_mode=False)
    ours.update(max_param_diff_vs_none=3e-9, lossless_mode=True)
    rows = cluster_report.add_relative([none, ours])
    assert rows[1]["speedup_vs_none"] == pytest.approx(2.0)
    assert rows[1]["throughput_vs_none"] == pytest.approx(4.0)  # 0.2 s vs 0.05 s of communication
    assert rows[1]["wire_vs_none"] == pytest.approx(100 / 1500)
    md = cluster_report.render_markdown({"rows": rows, "compute_s": 0.1,
                                  "shaping": {"qdisc": "tbf", "latency_applied": False}}, "t")
    assert "| horovod | lossless | 150.0 (150.0–150.0) | 150.0 | 2.00x" in md
    assert "latency was NOT added" in md and "3.00e-09 (lossless)" in md
    # CPU-fair: the dilated delay is named only where the links added one
    fair = {"workers": 4, "cores": 2, "share": 0.5, "applied_rate_bits": 500_000_000, "applied_delay_s": 2e-4}
    for applied in (False, True):
        md = cluster_report.render_markdown({"rows": rows, "compute_s": 0.1, "cpu_fair": fair,
                                             "shaping": {"qdisc": "tbf", "latency_applied": applied}}, "t")
        assert "links dilated to 500mbit" in md and ("200 us one-way" in md) == applied, md


def test_rounds_pool_timed_steps_and_counters():
    stats = {"encode_seconds": 0.01, "decode_seconds": 0.02, "plan": {"a": {"strategy": "dense"}}}
    first = [_report(0, [0.30, 0.31], 2000, stats), _report(1, [0.32, 0.33], 2400)]
    second = [_report(0, [0.20, 0.21, 0.22], 3000, dict(stats, plan={"a": {"strategy": "allgather"}})),
              _report(1, [0.23, 0.24, 0.25], 3600)]
    merged = cluster_report.merge_rounds([first, second])
    assert merged[0]["step_seconds"] == [0.30, 0.31, 0.20, 0.21, 0.22] and merged[0]["timed_steps"] == 5
    assert merged[0]["net_bytes"] == {"tx_bytes": 5000, "rx_bytes": 5000}
    assert merged[0]["stats"]["encode_seconds"] == pytest.approx(0.02)
    assert merged[0]["stats"]["decode_seconds"] == pytest.approx(0.04)
    assert merged[0]["stats"]["plan"] == {"a": {"strategy": "allgather"}}   # the last round's plans
    assert merged[1]["step_seconds"] == [0.32, 0.33, 0.23, 0.24, 0.25]
    row = cluster_report.summarize("ddp", "auto", merged, compute_s=0.1, round_medians=[0.305, 0.21])
    assert row["step_s_median"] == pytest.approx(0.22)   # of the pooled steps, not of the round medians
    assert row["wire_bytes_per_step_per_host"] == pytest.approx((5000 / 5 + 6000 / 5) / 2)
    assert row["step_s_round_medians"] == [0.305, 0.21]
    row.update(max_param_diff_vs_none=None, lossless_mode=True)
    md = cluster_report.render_markdown({"rows": cluster_report.add_relative([row]), "compute_s": 0.1, "rounds": 2,
                                  "shaping": {"qdisc": "tbf"}}, "t")
    assert "Rounds: 2" in md and "auto 305.0 / 210.0" in md
    with pytest.raises(ValueError, match="different numbers of ranks"):
        cluster_report.merge_rounds([first, first[:1]])
    with pytest.raises(ValueError, match="no reports"):
        cluster_report.merge_rounds([])


def test_stale_names_only_of_dead_owners():
    names = ["lhcc123h0", "lhcc123v1", "lhcc123br", "lhcc456h0", "eth0", "lhccXh0", "lhcc123h0x", "docker0"]
    alive = {456}.__contains__
    assert netns.stale_names(names, alive) == ["lhcc123h0", "lhcc123v1", "lhcc123br"]
    assert netns.owner_pid("lhcc99br") == 99 and netns.owner_pid("eth0") is None


def test_cluster_names_fit_the_kernel_limit():
    c = netns.EmulatedCluster(hosts=64, rate_bits=10**9, delay_s=1e-4, tag=4_194_303)  # largest pid_max
    assert all(len(n) <= 15 for n in c.bridge_ports + [c.bridge])
    assert len({c.host_address(i) for i in range(64)} | {c.bridge_address}) == 65


def test_topk_allgather_packs_and_averages_exactly():
    codec = TopKAllgather(ratio=0.25)
    grads = [torch.tensor([0.0, 4.0, -1.0, 0.5, 0.0, 0.0, -3.0, 0.1]), torch.tensor([2.0, 0.0, 0.0, 0.0, 0.0, 5.0, 0.0, 0.0])]
    packed = [codec.encode(("t", r), g) for r, g in enumerate(grads)]
    assert topk_count(8, 0.25) == 2 and all(p.numel() == 4 for p in packed)
    assert topk_count(1001, 0.01) == 11   # ceil, as the planner's topk_allgather counts (round gave 10)
    out = codec.decode(torch.cat(packed), 2, torch.empty(8))
    assert out.tolist() == [1.0, 2.0, 0.0, 0.0, 0.0, 2.5, -1.5, 0.0]
    # what was not sent stays in the residual and goes out next time
    again = codec.encode(("t", 0), torch.zeros(8))
    vals, idx = again[:2], again[2:].view(torch.int32)
    assert sorted(zip(idx.tolist(), vals.tolist())) == [(2, -1.0), (3, 0.5)]
    with pytest.raises(ValueError, match="ratio"):
        TopKAllgather(ratio=0.0)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_topk_allgather_adds_ranks_in_rank_order(device):
    """Every rank must decode the same bits: each coordinate is the float32 sum in rank order. The
    values make the order visible (2**24 absorbs a 1 that a sum of the 1s first would keep), and on
    CUDA a single atomic index_add_ over every rank's pairs adds them in a varying order."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    world, numel = 8, 1 << 18
    per_rank = torch.ones(world, numel)
    per_rank[0] = 2.0**24
    per_rank[-1] = -(2.0**24)
    idx = torch.stack([torch.randperm(numel, generator=torch.Generator().manual_seed(r)) for r in range(world)])
    vals = torch.gather(per_rank, 1, idx)   # rank r sends coordinate idx[r, j] with its value
    gathered = torch.cat([torch.cat([vals[r], idx[r].to(torch.int32).view(torch.float32)]) for r in range(world)])
    expected = torch.zeros(numel)
    for r in range(world):
        expected += per_rank[r]
    assert expected.eq(0.0).all()   # in rank order the 1s vanish into 2**24
    codec = TopKAllgather(ratio=1.0)
    for _ in range(3):
        out = codec.decode(gathered.to(device), world, torch.empty(numel, device=device)).cpu()
        assert torch.equal(out, expected / world)


def test_refuses_without_root(monkeypatch, capsys):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    rc = cluster.cmd_cluster(_args(hosts=2))
    assert rc == 2
    assert "needs root" in capsys.readouterr().err


def test_cluster_commands_map_failures_to_exit_statuses(tmp_path, capsys):
    """bench cluster and bench tta share their frame: a late option error exits 2, a cluster failure 1,
    an interrupt 130, each with its message; success returns the result and the work directory."""
    def raising(exc):
        def run(workdir):
            assert os.path.isdir(workdir)
            raise exc
        return run

    out = str(tmp_path / "run")
    assert netns.run_on_clusters("prog", "t", out, lambda w: {"in": w}) == (0, {"in": out}, out)
    for exc, status, message in ((ValueError("bad --x"), 2, "prog: error: bad --x"),
                                 (netns.ClusterError("veth gone"), 1, "prog: error: veth gone"),
                                 (KeyboardInterrupt(), 130, "interrupted; the emulated cluster was removed")):
        assert netns.run_on_clusters("prog", "t", out, raising(exc))[:2] == (status, None)
        assert message in capsys.readouterr().err


def test_cluster_and_replay_refuse_a_timeout_cores_or_steps_they_would_fail_on_later(monkeypatch, capsys):
    """--timeout of 0 or less (or NaN) and --cores below 1 are refused before a namespace is built (the
    first configuration failed after the cluster was up: "timeout after -1 s", exit 1; --cores 0 was
    this machine's count); bench replay refuses --record-steps 0 (a traceback) and --warmup >= --steps
    (refused by bench cluster after the recording) before it records."""
    from lossless_hc.bench import replay

    def never(*a, **k):
        raise AssertionError("ran past the option checks")
    monkeypatch.setattr(cluster, "run_on_clusters", never)
    monkeypatch.setattr(replay, "ensure_recording", never)
    for bad, message in ((dict(timeout=-1), "--timeout must be a positive"), (dict(timeout=0), "--timeout"),
                         (dict(timeout="nan"), "--timeout"), (dict(cores=0), "--cores must be at least 1")):
        assert cluster.cmd_cluster(_args(hosts=2, model="digits", compression="none", **bad)) == 2, bad
        assert message in capsys.readouterr().err
    p = __import__("argparse").ArgumentParser()
    replay.add_arguments(p)
    for bad, message in ((["--record-steps", "0"], "--record-steps must be at least 1"),
                         (["--steps", "3", "--warmup", "3"], "--warmup must be in [0, --steps)"),
                         (["--timeout", "0"], "--timeout"), (["--cores", "0"], "--cores")):
        args = p.parse_args(["--hosts", "2", "--ranks", "2", *bad])
        assert replay.cmd_replay(args) == 2, bad
        assert message in capsys.readouterr().err


def _args(**kw):
    import argparse
    p = argparse.ArgumentParser()
    cluster.add_arguments(p)
    return p.parse_args([f"--{k.replace('_', '-')}={v}" for k, v in kw.items()])


# -- real namespaces, real workers -----------------------------------------------------------------


@pytest.mark.multiprocess
def test_two_hosts_end_to_end(tmp_path):
    reason = emulated_cluster_skip_reason(horovod=True)
    if reason:
        pytest.skip(f"emulated cluster: {reason}")
    plot = tmp_path / "plot.png"
    cmd = [sys.executable, "-m", "lossless_hc.bench", "cluster", "--hosts", "2", "--bandwidth", "200mbit",
           "--latency", "0", "--model", "ncf", "--compression", "none,lossless", "--framework", "horovod,ddp",
           "--steps", "5", "--warmup", "1", "--train-args", "--users 20000 --items 20000 --dim 16 --batch 128",
           "--out", str(tmp_path), "--plot", str(plot)]
    proc = run_launcher(cmd, cwd=REPO, timeout=240)
    out, err = proc.stdout, proc.stderr
    assert proc.returncode == 0, out[-3000:] + err[-3000:]
    with open(tmp_path / "cluster_ncf_200mbit_2hosts.json") as f:
        result = json.load(f)
    rows = {(r["framework"], r["compression"]): r for r in result["rows"]}
    assert set(rows) == {("horovod", "none"), ("horovod", "lossless"), ("ddp", "none"), ("ddp", "lossless")}
    for (fw, comp), r in rows.items():
        dense = r["dense_bytes_per_step"]
        # the kernel's counters saw the gradients go out: a ring allreduce of 2 sends about the
        # dense size; the lossless payload of NCF's sparse embedding rows is far smaller
        if comp == "none":
            assert 0.8 * dense < r["wire_bytes_per_step_per_host"] < 1.5 * dense
        else:
            assert r["wire_bytes_per_step_per_host"] < 0.8 * rows[(fw, "none")]["wire_bytes_per_step_per_host"]
            assert r["max_param_diff_vs_none"] < 1e-5
    assert plot.stat().st_size > 0
    # nothing of that run's cluster is left behind (names carry the benchmark process's id)
    mine = [n for n in netns.list_namespaces() + netns.list_links() if netns.owner_pid(n) == proc.pid]
    assert mine == []
    assert not os.path.exists(os.path.join(netns.NETNS_ETC, f"{netns.PREFIX}{proc.pid}h0"))


def report_row(compression, ms, **extra):
    """A result row as run_benchmark gives it (one ``ms`` for median, p10 and p90), for the report tests."""
    row = {"framework": "ddp", "compression": compression, "step_s_median": ms / 1e3, "step_s_p10": ms / 1e3,
           "step_s_p90": ms / 1e3, "speedup_vs_none": 80.0 / ms, "wire_bytes_per_step_per_host": 1.0,
           "wire_vs_none": 1.0, "aggregation_bytes_per_s": 1.0, "throughput_vs_none": 1.0, "codec_share": 0.0,
           "max_param_diff_vs_none": 0.0, "lossless_mode": True, "fallbacks": 0, "aggregation_s": 0.05}
    row.update(extra)
    return row


def test_the_report_states_the_step_guards_verdict():
    """Rank 0's guard statistics in the planner's rows: the trial's steps, medians and what ran after it,
    or why there was none; under plain FSDP (no plan, the sparse reduce-scatter alone) too."""
    from lossless_hc.bench.cluster_report import render_markdown

    def row(compression, ms, guard=None):
        return report_row(compression, ms, auto_choice={"dense": ["param0(4,)"]} if guard else None,
                          auto_guard=guard)
    guard = {"verdict": "dense", "plan_ms": 93.0, "dense_ms": 83.2, "window": 8, "steps": 5}
    none_trial = {"verdict": None, "plan_ms": float("nan"), "dense_ms": float("nan"), "window": None, "steps": 5}
    hvd = dict(row("auto", 84.0, dict(guard, plan_ms=95.0)), framework="horovod")
    fsdp = dict(row("auto", 85.0, dict(guard, plan_ms=96.0)), framework="fsdp")
    flat = dict(report_row("auto", 86.0, auto_choice=None, auto_guard=dict(guard, plan_ms=97.0)), framework="fsdp")
    kept = row("auto-lossy", 70.0, dict(guard, verdict="plan", plan_ms=70.0, rounds=2))   # a confirmation round
    # with lossy, the dense window sent the large tensors as the engine's half-precision hook sends them
    half = row("auto-lossy", 71.0, dict(guard, plan_ms=98.0, alternative={"bf16": 14, "dense": 16}))
    text = render_markdown({"rows": [row("none", 80.0), row("auto", 82.0, guard), row("auto-sparse", 30.0, none_trial),
                                     hvd, fsdp, flat, kept, half], "compute_s": 0.02, "shaping": {"qdisc": "tbf"}}, "t")
    assert "step guard (steps 8-27): plans 70.0 ms, dense 83.2 ms median step: the plans from then on" in text
    assert ("step guard (steps 8-17): plans 93.0 ms, dense 83.2 ms median step: dense allreduce in place "
            "(DDP's own) from then on") in text
    assert ("step guard (steps 8-17): plans 95.0 ms, dense 83.2 ms median step: dense allreduce in place "
            "(Horovod's own) from then on") in text
    assert ("step guard (steps 8-17): plans 96.0 ms, dense 83.2 ms median step: dense allreduce in place "
            "(HSDP's own) from then on") in text
    assert ("step guard (steps 8-17): plans 98.0 ms, dense 83.2 ms median step: dense allreduce in place "
            "(DDP's own, 14 tensors in bf16) from then on") in text
    assert "fsdp auto: the sparse reduce-scatter" in text
    assert ("step guard (steps 8-17): plans 97.0 ms, dense 83.2 ms median step: FSDP2's own reduce-scatter "
            "from then on") in text
    assert "step guard: no trial (every dense gradient's plan was dense)" in text
    assert "ran into the timed steps" not in text   # no --warmup in the result: not checked


def test_the_report_gives_the_blocks_untimed_steps_and_flags_a_trial_in_the_timed_steps():
    """Blocks of 2 steps: the trial spans 2 * 2 * steps * rounds steps, and the untimed first steps of the
    blocks are reported; a trial that ends after --warmup is flagged (its dense blocks are in the row)."""
    from lossless_hc.bench.cluster_report import render_markdown
    guard = {"verdict": "plan", "plan_ms": 70.0, "dense_ms": 83.2, "window": 8, "steps": 5, "block": 2,
             "rounds": 2, "lead_plan_ms": 71.5, "lead_dense_ms": 104.0}
    row = report_row("auto-lossy", 70.0, auto_choice={"topk": ["param0(4,)"]}, auto_guard=guard,
                     framework="horovod")

    def text(warmup):
        return render_markdown({"rows": [report_row("none", 80.0), row], "compute_s": 0.02,
                                "shaping": {"qdisc": "tbf"}, "warmup": warmup}, "t")
    assert "step guard (steps 8-47): plans 70.0 ms, dense 83.2 ms median step: the plans from then on" in text(48)
    assert ("step guard: blocks of 2 steps per window, the last one timed; the untimed ones (after a switch) "
            "71.5 ms in the plans' blocks, 104.0 ms in dense's") in text(48)
    assert "ran into the timed steps" not in text(48)
    assert ("step guard: the trial ran into the timed steps (from step 20), so its dense blocks are in this "
            "row's times; --warmup 48 times after it") in text(20)


def test_the_report_gives_powersgd_s_window_where_the_trial_ran_one():
    """DDP with PowerSGD: the trial cycles three windows (3 * 2 * steps * rounds steps), whose medians and
    untimed steps the report gives, with a verdict for PowerSGD named as what ran."""
    from lossless_hc.bench.cluster_report import render_markdown
    guard = {"verdict": "powersgd", "plan_ms": 70.0, "dense_ms": 83.2, "powersgd_ms": 60.5, "window": 8,
             "steps": 5, "block": 2, "rounds": 2, "lead_plan_ms": 71.5, "lead_dense_ms": 104.0,
             "lead_powersgd_ms": 62.0, "windows": ["plan", "dense", "powersgd"]}
    row = report_row("auto-lossy", 61.0, auto_choice={"powersgd": ["param0(4, 4)"]}, auto_guard=guard,
                     auto_guard_rounds=[guard, dict(guard, verdict="plan", plan_ms=58.0)])
    text = render_markdown({"rows": [report_row("none", 80.0), row], "compute_s": 0.02,
                            "shaping": {"qdisc": "tbf"}, "warmup": 68}, "t")
    assert ("step guard (steps 8-67): plans 70.0 ms, dense 83.2 ms, PowerSGD 60.5 ms median step: torch's "
            "PowerSGD hook on every bucket it may take from then on") in text
    assert "71.5 ms in the plans' blocks, 104.0 ms in dense's, 62.0 ms in PowerSGD's" in text
    assert "ran into the timed steps" not in text
    assert "step guard per round: powersgd (70.0 / 83.2 / 60.5 ms), plan (58.0 / 83.2 / 60.5 ms)" in text


def test_the_report_names_a_recheck_of_re_planned_plans():
    """A re-plan after a decisive look runs the new plans alone (StepGuard's recheck: windows ["plan"], one
    window's blocks): the report gives their median against the last trial's other medians, and no untimed
    line (there was no switch between windows)."""
    from lossless_hc.bench.cluster_report import render_markdown
    guard = {"verdict": "plan", "plan_ms": 84.0, "dense_ms": 366.1, "powersgd_ms": 181.9, "window": 42,
             "steps": 5, "block": 2, "rounds": 1, "lead_plan_ms": 87.2, "lead_dense_ms": float("nan"),
             "lead_powersgd_ms": float("nan"), "windows": ["plan"], "trials": 2}
    row = report_row("auto-lossy", 84.0, auto_choice={"two_phase": ["param0(4, 4)"]}, auto_guard=guard)
    text = render_markdown({"rows": [report_row("none", 680.0), row], "compute_s": 0.02,
                            "shaping": {"qdisc": "tbf"}, "warmup": 52}, "t")
    assert ("step guard (steps 42-51, the re-planned plans rechecked): plans 84.0 ms against the last trial's "
            "dense 366.1 ms, PowerSGD 181.9 ms median step: the plans from then on") in text
    assert "untimed" not in text and "ran into the timed steps" not in text
    two = dict(guard, powersgd_ms=float("nan"))
    text = render_markdown({"rows": [report_row("none", 680.0), dict(row, auto_guard=two)], "compute_s": 0.02,
                            "shaping": {"qdisc": "tbf"}}, "t")
    assert "against the last trial's dense 366.1 ms median step" in text


def test_the_answer_line_gives_the_planners_mean_step_beside_its_median():
    """A skewed step distribution (many fast steps, a slow tail) can put two modes' medians apart while
    their means, which a run's length follows, agree: the answer line prints both ratios."""
    from lossless_hc.bench.cluster_report import answer_line, render_markdown

    def row(compression, median_ms, mean_ms):
        return report_row(compression, median_ms, step_s_mean=mean_ms / 1e3, speedup_vs_none=1.0)
    rows = [row("none", 240.0, 241.0), row("sparse", 20.0, 23.0), row("auto-sparse", 23.0, 23.0)]
    line = answer_line(rows)
    assert "fastest exact: ddp sparse (20.0 ms" in line
    assert "ddp auto-sparse: step 1.15x the fastest exact's (mean step 1.00x)" in line
    assert "| ddp | sparse | 20.0 (20.0–20.0) | 23.0 | 1.00x |" in render_markdown(
        {"rows": rows, "compute_s": 0.01, "shaping": {"qdisc": "tbf"}}, "t")


def test_the_report_gives_each_rounds_guard_verdict_and_repeated_trials():
    from lossless_hc.bench.cluster_report import render_markdown

    def guard(verdict, plan_ms, dense_ms, trials=1):
        return {"verdict": verdict, "plan_ms": plan_ms, "dense_ms": dense_ms, "window": 8, "steps": 5,
                "trials": trials}
    row = report_row("auto", 80.0, step_s_mean=0.08, auto_choice={"dense": ["param0(4,)"]},
                     auto_guard=guard("dense", 89.1, 76.2, trials=2),
                     auto_guard_rounds=[guard("plan", 70.0, 80.0), guard("dense", 89.1, 76.2, trials=2),
                                        dict(guard(None, float("nan"), float("nan"), trials=0), window=None),
                                        guard(None, float("nan"), float("nan"))])
    text = render_markdown({"rows": [row], "compute_s": 0.02, "shaping": {"qdisc": "tbf"}}, "t")
    assert "step guard: 2 trials (a re-plan changed the plans after a verdict)" in text
    # a round whose plans were all dense opened no trial; one whose trial did not end has no verdict
    assert "step guard per round: plan (70.0 / 80.0 ms), dense (89.1 / 76.2 ms), no trial, no verdict" in text


def test_the_report_flags_an_earlier_rounds_late_trial_and_says_nothing_of_one_round_or_one_trial():
    """Each round's trial counts for the timed steps (an earlier round's may end later than the last's); a
    round with a trial but no verdict has no medians; one round gives no per-round line, one trial no
    trials line, one tensor of a half-precision alternative is singular; a trial still open at the end is
    named unfinished, not absent."""
    from lossless_hc.bench.cluster_report import render_markdown

    def guard(verdict, window, **extra):
        return {"verdict": verdict, "plan_ms": 89.1 if verdict else float("nan"),
                "dense_ms": 76.2 if verdict else float("nan"), "window": window, "steps": 5, **extra}
    last = guard("dense", 8, trials=1, alternative={"bf16": 1, "dense": 3})
    rows = [report_row("auto-lossy", 80.0, auto_choice={"dense": ["param0(4,)"]}, auto_guard=last,
                       auto_guard_rounds=[guard(None, 30), last]),
            report_row("auto", 81.0, auto_choice={"dense": ["param0(4,)"]}, auto_guard=last, auto_guard_rounds=[last])]
    text = render_markdown({"rows": rows, "compute_s": 0.02, "shaping": {"qdisc": "tbf"}, "warmup": 20}, "t")
    assert "step guard per round: no verdict, dense (89.1 / 76.2 ms)\n" in text
    assert text.count("step guard per round") == 1
    # the first round's trial (steps 30-39) ran past --warmup 20, the last one's (steps 8-17) did not
    assert text.count("the trial ran into the timed steps") == 1
    assert "(from step 20), so its dense blocks are in this row's times; --warmup 40 times after it" in text
    assert "dense allreduce in place (DDP's own, 1 tensor in bf16) from then on" in text
    assert "trials" not in text
    open_trial = report_row("auto", 81.0, auto_choice={"dense": ["param0(4,)"]}, auto_guard=guard(None, 30))
    text = render_markdown({"rows": [open_trial], "compute_s": 0.02, "shaping": {"qdisc": "tbf"}}, "t")
    assert "step guard: trial from step 30 not finished in this run (10 steps)" in text and "no trial" not in text


def test_the_report_json_is_strict_and_renders_the_same_read_back(tmp_path):
    """write_report's JSON is strict (a guard's NaN medians and a diverged loss are null: ``json`` in
    other languages and ``jq`` refuse NaN), and the report rendered from it (bench replay reads it back)
    equals the one rendered from the run's own result."""
    import json
    from lossless_hc.bench.cluster_report import render_markdown
    from lossless_hc.bench.common import write_report
    guard = {"verdict": "plan", "plan_ms": 70.0, "dense_ms": 83.2, "window": 8, "steps": 5, "block": 2,
             "lead_plan_ms": float("nan"), "lead_dense_ms": 104.0}
    result = {"command": "c", "rows": [report_row("none", 80.0, final_loss=float("nan")),
                                       report_row("auto", 70.0, auto_choice={"dense": ["param0(4,)"]},
                                                  auto_guard=guard)],
              "compute_s": 0.02, "shaping": {"qdisc": "tbf"}}
    write_report(str(tmp_path), "r", result, "md")
    text = (tmp_path / "r.json").read_text()
    assert "NaN" not in text
    back = json.loads(text, parse_constant=lambda c: pytest.fail(f"not strict JSON: {c}"))
    assert back["rows"][0]["final_loss"] is None
    expected = render_markdown(result, "t")
    assert "untimed ones (after a switch) - ms in the plans' blocks, 104.0 ms in dense's" in expected
    assert render_markdown(back, "t") == expected


def test_replay_gives_the_aggregation_time_where_the_wire_was_not_counted():
    """A row whose wire bytes are unknown (no interface counters) still shows its aggregation time."""
    from lossless_hc.bench import replay
    rows = [report_row("none", 80.0, aggregation_s=0.05), report_row("auto", 70.0, aggregation_s=0.02,
                                                                      wire_bytes_per_step_per_host=None)]
    text = replay.render({2: {"rows": rows}}, "t")
    assert "| ddp | none | 50.0 (0.00) |" in text and "| ddp | **auto** (planner) | 20.0 |" in text
