"""``bench hook`` (lossless_hc.bench.hook): real DDP workers over loopback Gloo, each mode's figures, and
``auto``'s parameters equal to DDP's own at a world size of two (the sum of two ranks divided by two is one
rounding whether divided before or after); and, with the launch faked (each mode's rank-0 report by hand), the
argument checks, the pooling over rounds and the printed figures; and how a worker ends (bench.common)."""
import json
import socket
import textwrap

import pytest

from lossless_hc.bench import hook as hook_bench
from lossless_hc.bench.common import machine_info
from lossless_hc.bench.hook import run_hook_bench, render_hook
from helpers import run_python


@pytest.mark.multiprocess
def test_every_mode_steps_and_auto_trains_ddp_s_parameters_without_a_calibration():
    res = run_hook_bench(ranks=2, layers=3, width=8, batch=4, bucket_kb=1, steps=6, warmup=2, rounds=1)
    modes = res["modes"]
    assert list(modes) == ["ddp", "allreduce_hook", "auto"]
    for mode, m in modes.items():
        assert m["step_p10_s"] <= m["step_median_s"] <= m["step_p90_s"]
        assert m["max_param_diff_vs_ddp"] == 0.0, mode
    assert modes["ddp"]["hook_calls"] == 0 and modes["ddp"]["hook_median_s"] is None
    # every bucket of every timed step, the same buckets for both hooks
    assert modes["allreduce_hook"]["hook_calls"] == modes["auto"]["hook_calls"] >= 6
    assert modes["auto"]["calibration"] == "not needed"   # tanh: every row non-zero, every plan dense
    assert [m["steps_pooled"] for m in modes.values()] == [6, 6, 6]
    # 8 steps in all: only the first carries the statistics (interval 16), and no plan has widened it yet
    assert modes["auto"]["statistics"] == {"statistics_steps": [1], "intervals": [16], "steps_run": 8}
    assert modes["ddp"]["statistics"] is None
    report = render_hook(res, machine_info(0), "python -m lossless_hc.bench hook")
    assert "auto's statistics steps a tensor: 1 of 8 (a round, warm-up included); its re-planning interval at " \
           "the end: 16 steps" in report
    rows = {line.split()[0]: line.split() for line in report.splitlines() if line.split()[:1] in (["ddp"], ["auto"])}
    assert rows["ddp"][-1] == rows["auto"][-1] == "0" and rows["ddp"][3] == "1.00x"   # max |param - ddp's|, x ddp


def test_bad_arguments_are_refused_before_any_worker_starts():
    with pytest.raises(ValueError, match="modes must be some of"):
        run_hook_bench(modes=["ddp", "lossless"])
    with pytest.raises(ValueError, match="each once"):
        run_hook_bench(modes=["auto", "auto"])
    with pytest.raises(ValueError, match="ranks must be an integer >= 2"):
        run_hook_bench(ranks=1)
    with pytest.raises(ValueError, match="warmup must be an integer >= 0"):
        run_hook_bench(warmup=-1)


def _no_workers(monkeypatch):
    """Any worker launch fails the test: the checks must refuse before one."""
    def launch(mode, cfg):
        raise AssertionError(f"a worker started for {mode}")
    monkeypatch.setattr(hook_bench, "_run_mode", launch)


def test_no_mode_a_flag_a_fraction_or_no_timeout_is_refused_before_any_worker_starts(monkeypatch):
    _no_workers(monkeypatch)
    with pytest.raises(ValueError, match="modes must be some of"):
        run_hook_bench(modes=[])   # `--modes ,`: no mode to time, not an empty report
    with pytest.raises(ValueError, match="layers must be an integer >= 1, got True"):
        run_hook_bench(layers=True)
    with pytest.raises(ValueError, match="width must be an integer >= 1, got 2.5"):
        run_hook_bench(width=2.5)
    with pytest.raises(ValueError, match="timeout must be > 0 seconds"):
        run_hook_bench(timeout=0.0)
    with pytest.raises(ValueError, match="timeout must be > 0 seconds"):
        run_hook_bench(timeout=float("nan"))


def test_the_rounds_reverse_the_order_pool_the_steps_and_compare_the_last_parameters(monkeypatch):
    """A faked launch (each mode's rank-0 report by hand): the modes' order reversed every other round,
    steps and hook calls pooled over the rounds, the percentiles of the pooled steps, the last round's
    parameters' largest absolute difference from ddp's, and the report's ratios, hook times and notes."""
    order = []
    ms = {"ddp": 10.0, "allreduce_hook": 12.0, "auto": 15.0}

    def launch(mode, cfg):
        assert cfg["timeout"] == 60.0 and cfg["steps"] == 10 and cfg["ranks"] == 3
        r = sum(m == mode for m in order)   # this mode's round
        order.append(mode)
        # unsorted, round 0: ms..ms+9, round 1: ms+10..ms+19
        steps = [1e-3 * (ms[mode] + i + 10 * r) for i in (3, 9, 0, 5, 1, 8, 2, 7, 4, 6)]
        calls = [] if mode == "ddp" else [1e-6 * (100 + 100 * r + i) for i in (0, 10, 50)]
        params = [1.0, 2.0, 3.0] if mode == "ddp" or r == 1 else [9.0, 9.0, 9.0]
        if mode == "auto" and r == 1:
            params = [1.0, 2.0 - 0.5, 3.0 + 0.25]   # the larger difference negative
        report = {"steps": steps, "calls": calls, "params": params,
                  "calibration": f"round {r}" if mode == "auto" else None}
        if mode == "auto":   # the last round's are reported
            report.update(statistics_steps=[3 + r, 5], intervals=[16, 256 if r else 32])
        return report
    monkeypatch.setattr(hook_bench, "_run_mode", launch)
    res = run_hook_bench(ranks=3, steps=10, rounds=2, timeout=60.0)
    assert order == ["ddp", "allreduce_hook", "auto", "auto", "allreduce_hook", "ddp"]
    assert res["config"] == {"ranks": 3, "layers": 24, "width": 64, "batch": 32, "bucket_kb": 50, "steps": 10,
                             "warmup": 100, "rounds": 2}
    modes = res["modes"]
    assert list(modes) == ["ddp", "allreduce_hook", "auto"]
    ddp, hook, auto = modes["ddp"], modes["allreduce_hook"], modes["auto"]
    # 20 pooled steps ms..ms+19: the median between the 10th and 11th, p10 the 3rd, p90 the 19th
    assert ddp["step_median_s"] == pytest.approx(19.5e-3) and auto["step_median_s"] == pytest.approx(24.5e-3)
    assert (ddp["step_p10_s"], ddp["step_p90_s"]) == pytest.approx((12e-3, 28e-3))
    assert (ddp["hook_calls"], ddp["hook_median_s"], ddp["hook_mean_s"]) == (0, None, None)
    assert auto["hook_calls"] == 6   # both rounds' calls
    # calls of 100, 110, 150, 200, 210, 250 us
    assert (auto["hook_median_s"], auto["hook_mean_s"]) == pytest.approx((175e-6, 170e-6))
    assert (ddp["max_param_diff_vs_ddp"], hook["max_param_diff_vs_ddp"], auto["max_param_diff_vs_ddp"]) == (
        0.0, 0.0, 0.5)
    assert auto["calibration"] == "round 1" and ddp["calibration"] is None
    assert [m["steps_pooled"] for m in modes.values()] == [20, 20, 20]
    assert auto["statistics"] == {"statistics_steps": [4, 5], "intervals": [16, 256], "steps_run": 110}
    assert ddp["statistics"] is None

    report = render_hook(res, machine_info(0), "python -m lossless_hc.bench hook")
    rows = {line.split()[0]: line.split() for line in report.splitlines() if line.split()[:1] in ([m] for m in ms)}
    # mode, median (p10-p90), x ddp, x allreduce_hook, hook us median / mean, max |param - ddp's|
    assert rows["ddp"] == ["ddp", "19.50", "(12.00-28.00)", "1.00x", "0.91x", "-", "/", "-", "0"]
    assert rows["allreduce_hook"] == ["allreduce_hook", "21.50", "(14.00-30.00)", "1.10x", "1.00x", "175", "/",
                                      "170", "0"]
    assert rows["auto"] == ["auto", "24.50", "(17.00-33.00)", "1.26x", "1.14x", "175", "/", "170", "0.5"]
    assert "3 ranks (Gloo, loopback), 24 x Linear(64, 64) + tanh, batch 32, buckets of 50 KiB, 10 timed steps " \
           "after 100, 2 rounds" in report
    assert "auto's calibration: round 1" in report
    assert "auto's statistics steps a tensor: 4-5 of 110 (a round, warm-up included); its re-planning interval " \
           "at the end: 16-256 steps" in report


def test_without_ddp_or_torch_s_hook_the_report_has_no_ratio_to_them(monkeypatch):
    def launch(mode, cfg):
        return {"steps": [0.01, 0.02, 0.03], "calls": [1e-4], "params": [0.0], "calibration": None}
    monkeypatch.setattr(hook_bench, "_run_mode", launch)
    res = run_hook_bench(modes=["allreduce_hook"], rounds=1)
    assert res["modes"]["allreduce_hook"]["max_param_diff_vs_ddp"] is None
    report = render_hook(res, machine_info(0), "c")
    row = next(line.split() for line in report.splitlines() if line.startswith("allreduce_hook"))
    assert row == ["allreduce_hook", "20.00", "(10.00-30.00)", "-", "1.00x", "100", "/", "100", "-"]
    assert "calibration" not in report


def test_the_command_passes_each_option_to_its_parameter_and_refuses_a_bad_mode(monkeypatch, tmp_path, capsys):
    """``bench hook``'s options (each a different value) reach the run's configuration and JSON, an empty name
    in ``--modes`` (a trailing comma) is skipped, the defaults are the usage's, and a bad mode exits with the
    run's message, no traceback."""
    from lossless_hc.bench import cli
    launched = []

    def launch(mode, cfg):
        launched.append(mode)
        return {"steps": [0.01], "calls": [], "params": [0.0], "calibration": None}
    monkeypatch.setattr(hook_bench, "_run_mode", launch)
    path = tmp_path / "hook.json"
    assert cli.main(["hook", "--ranks", "3", "--layers", "4", "--width", "5", "--batch", "6", "--bucket-kb", "7",
                     "--steps", "8", "--warmup", "9", "--rounds", "2", "--modes", "auto,ddp,", "--json",
                     str(path)]) == 0
    assert launched == ["auto", "ddp", "ddp", "auto"]
    out = json.loads(path.read_text())
    assert out["config"] == {"ranks": 3, "layers": 4, "width": 5, "batch": 6, "bucket_kb": 7, "steps": 8,
                             "warmup": 9, "rounds": 2}
    assert list(out["modes"]) == ["auto", "ddp"] and out["command"]
    assert "3 ranks (Gloo, loopback), 4 x Linear(5, 5) + tanh, batch 6" in capsys.readouterr().out
    assert cli.main(["hook", "--json", str(path)]) == 0   # the usage's defaults, every mode
    out = json.loads(path.read_text())
    assert out["config"] == {"ranks": 2, "layers": 24, "width": 64, "batch": 32, "bucket_kb": 50, "steps": 400,
                             "warmup": 100, "rounds": 2}
    assert list(out["modes"]) == ["ddp", "allreduce_hook", "auto"]
    _no_workers(monkeypatch)
    with pytest.raises(SystemExit, match="bench hook: error: modes must be some of"):
        cli.main(["hook", "--modes", "ddp,lossless"])


def test_a_worker_s_end_flushes_its_report_exits_with_its_code_and_tears_gloo_down_in_order():
    """``leave``: what the process printed (pipes: buffered) reaches its readers and the exit status is
    the code given; ``end_gloo_rank`` (one rank of Gloo here): the barrier, then the group destroyed while
    it is still up, then that exit; ``free_port``: a port this host's next socket can bind."""
    from lossless_hc.bench.common import free_port
    done = run_python("import sys\nfrom lossless_hc.bench.common import leave\nprint('the report', end='')\n"
                      "print('the log', end='', file=sys.stderr)\nleave(3)",
                      PYTHONUNBUFFERED="")   # buffered, as a worker's streams are unless this is set
    assert (done.stdout, done.stderr, done.returncode) == ("the report", "the log", 3)
    done = run_python(textwrap.dedent('''
        import os
        import torch.distributed as dist
        from lossless_hc.bench.common import end_gloo_rank, free_port
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
        dist.init_process_group("gloo", rank=0, world_size=1)
        for name in ("barrier", "destroy_process_group"):
            def wrapped(*a, _real=getattr(dist, name), _name=name, **k):
                print(_name, dist.is_initialized(), end="; ")
                return _real(*a, **k)
            setattr(dist, name, wrapped)
        print("report", end="; ")
        end_gloo_rank(4)
        print("after the end")'''))
    assert (done.stdout, done.returncode) == ("report; barrier True; destroy_process_group True; ", 4), done.stderr
    port = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
    assert 0 < port < 65536


def _failing_worker(rank, world, port, mode, cfg, queue):
    """A stand-in for a rank: rank 0 reports only in mode "late"; the rank ``cfg["fails"]`` exits with 3."""
    if rank == 0 and mode == "late":
        queue.put({"steps": [0.01], "calls": [], "params": [0.0], "calibration": None})
        queue.close()
        queue.join_thread()
    raise SystemExit(3 if rank == cfg["fails"] else 0)


@pytest.mark.multiprocess
def test_a_rank_that_fails_fails_the_mode_at_once_before_or_after_rank_0_s_report(monkeypatch):
    """A rank that dies before rank 0 reported is an error as soon as it is seen, not the whole timeout later;
    one that fails after rank 0's report is an error too (its report is not taken)."""
    import time
    monkeypatch.setattr(hook_bench, "_worker", _failing_worker)
    cfg = {"ranks": 2, "timeout": 120.0}
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"early: rank 0 reported nothing \(the ranks' exit statuses \[3, 0\]"):
        hook_bench._run_mode("early", dict(cfg, fails=0))
    assert time.monotonic() - t0 < 60.0   # the timeout is 120 s
    with pytest.raises(RuntimeError, match=r"late: a rank failed after rank 0 reported \(.* \[0, 3\], timeout 120 s"):
        hook_bench._run_mode("late", dict(cfg, fails=1))


class _Reports(list):
    """The reports queue of a worker run in this process."""
    put = list.append

    def close(self):
        pass

    def join_thread(self):
        pass


def test_a_worker_reports_its_timed_steps_and_their_hook_calls_alone(monkeypatch):
    """One rank's worker in this process (a group of one, the end left to the test): the report holds the
    ``steps`` timed steps, not the warmup's, and the hook calls of those steps only (as many as without a
    warmup), the trained parameters (equal in every mode: one rank's sum is its gradient) and auto's
    calibration."""
    import torch
    import torch.distributed as dist
    from lossless_hc.bench.common import free_port
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "0")
    monkeypatch.setattr(hook_bench, "end_gloo_rank", dist.destroy_process_group)
    threads = torch.get_num_threads()
    reports = {}
    try:
        for mode, warmup in (("ddp", 3), ("allreduce_hook", 3), ("auto", 3), ("auto", 0)):
            got = _Reports()
            hook_bench._worker(0, 1, free_port(), mode, dict(layers=3, width=8, batch=4, bucket_kb=1, steps=4,
                                                             warmup=warmup), got)
            assert len(got) == 1 and len(got[0]["steps"]) == 4, mode
            reports[mode, warmup] = got[0]
    finally:
        torch.set_num_threads(threads)
    assert reports["ddp", 3]["calls"] == [] and reports["ddp", 3]["calibration"] is None
    calls = len(reports["auto", 0]["calls"])
    assert calls % 4 == 0 and calls > 0   # every bucket of the 4 steps
    assert len(reports["auto", 3]["calls"]) == len(reports["allreduce_hook", 3]["calls"]) == calls
    assert reports["auto", 3]["calibration"] == "not needed"
    assert reports["auto", 3]["params"] == reports["allreduce_hook", 3]["params"] == reports["ddp", 3]["params"]
    assert reports["auto", 0]["params"] != reports["auto", 3]["params"]   # 4 steps, not 7
