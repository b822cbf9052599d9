"""``bench hook`` (lossless_hc.bench.hook): real DDP workers over loopback Gloo, each mode's figures, and
``auto``'s parameters equal to DDP's own at a world size of two (the sum of two ranks divided by two is one
rounding whether divided before or after)."""
import pytest

from lossless_hc.bench.common import machine_info
from lossless_hc.bench.hook import run_hook_bench, render_hook


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
    report = render_hook(res, machine_info(0), "python -m lossless_hc.bench hook")
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
