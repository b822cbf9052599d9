"""The ``plan`` command of ``python -m lossless_hc.bench``: the local work of ``auto``'s strategies.

For each strategy, ``workers`` :class:`~lossless_hc.training.strategies.AutoAggregator`\\ s (one per rank,
in this process) held on that strategy aggregate the same inputs step after step: each rank's gradient
of ``numel`` elements, rows of ``row`` elements, a ``density`` share of its rows non-zero (N(0,1)
values). A step is every rank's ``encode``, the SUM of the payloads (torch, in float64, not timed: the
engine's part), every rank's ``decode`` and, where the strategy makes a second collective, its SUM or
gather (not timed) and ``finish``. The time per step and rank is averaged over one re-planning
``interval`` of steps, so that the statistics steps (one in an interval for a dense, fp16, bf16, THC or
top-k plan) weigh as they do in training; the median over ``repeat`` intervals is reported against a
``torch.clone`` and a ``copy_`` of one input, timed between the intervals in the same run. One interval
runs untimed first (a sketch sized from its first statistics, THC's norm-only first step).

Each strategy is the only one its aggregators may take (``allowed``), so ``dense`` runs as a tensor that
can only be dense runs: plain steps, no statistics. What is left out: the collectives themselves, and a DDP bucket's in-place allreduce of plain steps
(the dense and half plans' steps between statistics steps run here through ``encode``/``decode``, as
under Horovod). The last step's result is compared with the float64 sum of the inputs: an exact
strategy passes ("exact") when its relative error (L2 norm) is at most 2^-10, the exactness contract's
rtol (``lhc.codec.DEFAULT_RTOL``), and the exit status is 1 otherwise. That bound is the contract's,
not float32 rounding's: the exact strategies land near 2e-8, but an error of fp16's size (3e-4) would
pass too. The lossy ones report their relative error (of that step: the inputs repeat every step, so
error feedback adds what it held back from the earlier ones).
"""
from __future__ import annotations

import math
import statistics
import time
from typing import Sequence

import torch

from lossless_hc.bench.common import format_table, machine_rows, section
from lossless_hc.training.planner import EXACT_STRATEGIES, Calibration, CostModel
from lossless_hc.training.step import run_in_process
from lossless_hc.training.strategies import AutoAggregator

PLAN_STRATEGIES = ("dense", "sketch", "allgather", "two_phase", "fp16", "bf16", "thc", "topk", "topk_allgather")


def _inputs(numel: int, row: int, density: float, workers: int, seed: int, device) -> list:
    keys = numel // row
    g = torch.Generator().manual_seed(seed)
    xs = []
    for _ in range(workers):
        x = torch.zeros(keys, row)
        held = torch.randperm(keys, generator=g)[:max(1, math.ceil(density * keys))]
        x[held] = torch.randn(held.numel(), row, generator=g)
        xs.append(x.reshape(-1).to(device))
    return xs


def run_plan_bench(numel: int, row: int = 1, density: float = 1.0, workers: int = 2,
                   strategies: Sequence[str] = PLAN_STRATEGIES, interval: int = 16, repeat: int = 3,
                   topk_ratio: float = 0.01, seed: int = 0, device: str = "cpu") -> dict:
    if row < 1 or numel % row:
        raise ValueError(f"--row must divide --numel: {numel} elements in rows of {row}")
    if not 0.0 < density <= 1.0:
        raise ValueError(f"--density must be in (0, 1], got {density}")
    if not 0.0 < topk_ratio <= 1.0:   # (the planner's own check names it max_density)
        raise ValueError(f"--topk-ratio must be in (0, 1], got {topk_ratio}")
    if not strategies:
        raise ValueError(f"--strategies names none; choose among {', '.join(PLAN_STRATEGIES)}")
    unknown = [s for s in strategies if s not in PLAN_STRATEGIES]
    if unknown:
        raise ValueError(f"unknown strategies {unknown}; choose among {', '.join(PLAN_STRATEGIES)}")
    dev = torch.device(device)
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
    shape = (numel // row, row) if row > 1 else (numel,)
    xs = [x.reshape(shape) for x in _inputs(numel, row, density, workers, seed, dev)]
    truth = torch.stack([x.double() for x in xs]).sum(0)
    model = CostModel(Calibration.default(), topk_ratio=topk_ratio)
    baseline = {"clone": [], "copy_": []}
    dst = torch.empty_like(xs[0])
    out = {}
    for s in strategies:
        aggs = [AutoAggregator(f"bench.{s}", shape, torch.float32, workers, r, model, interval=interval,
                               lossy=True, first=s, allowed=(s,), lossy_min_bytes=0, device=dev)
                for r in range(workers)]
        for _ in range(interval):   # untimed: the first statistics, a sketch sized from them, THC's first step
            run_in_process(aggs, xs)
        sent0, per_interval = aggs[0].bytes_sent, []
        for _ in range(repeat):
            local = 0.0
            for _ in range(interval):
                values, seconds = run_in_process(aggs, xs)
                value = values[0]
                local += seconds
            sync()
            per_interval.append(local / (interval * workers))
            for name, fn in (("clone", lambda: xs[0].clone()), ("copy_", lambda: dst.copy_(xs[0]))):
                t0 = time.perf_counter()
                fn()
                sync()
                baseline[name].append(time.perf_counter() - t0)
        value = value.to_dense() if value.is_sparse else value
        err = float((value.double() - truth).norm() / truth.norm()) if float(truth.norm()) else 0.0
        out[s] = {"step_s": statistics.median(per_interval), "per_interval_s": per_interval,
                  "bytes_per_step": (aggs[0].bytes_sent - sent0) / (repeat * interval),
                  "strategy_held": aggs[0].strategy == s, "relative_error": err,
                  "exact": s in EXACT_STRATEGIES, "equals_sum": err <= 2 ** -10, "fallbacks": aggs[0].fallbacks}
    clone_s, copy_s = statistics.median(baseline["clone"]), statistics.median(baseline["copy_"])
    ok = all(r["equals_sum"] and r["strategy_held"] for r in out.values() if r["exact"])
    return {"config": {"numel": numel, "row": row, "density": density, "workers": workers, "interval": interval,
                       "repeat": repeat, "topk_ratio": topk_ratio, "seed": seed, "device": str(dev)},
            "clone_s": clone_s, "copy_s": copy_s, "strategies": out, "ok": ok}


def render_plan(res: dict, machine: dict, cmd: str) -> str:
    c = res["config"]
    head = section("lossless_hc auto strategies: local work per step and rank", format_table([
        ("command", cmd),
        *machine_rows(machine),
        ("setup", f"{c['workers']} ranks in one process, {c['numel']:,} float32 in rows of {c['row']}, "
                  f"{c['density']:g} of the rows non-zero per rank; mean over an interval of {c['interval']} "
                  f"steps, median of {c['repeat']} intervals (device {c['device']})"),
        ("baseline", f"clone {res['clone_s'] * 1e3:.2f} ms, copy_ {res['copy_s'] * 1e3:.2f} ms (medians, same run)"),
    ], align="ll"))
    rows = []
    for s, r in res["strategies"].items():
        t = r["step_s"]
        # an exact strategy's verdict is the contract's (rel. error <= 2^-10), shown with the error itself
        check = (("exact" if r["equals_sum"] else "NOT EXACT") + f", rel. error {r['relative_error']:.1e}") \
            if r["exact"] else f"step's rel. error {r['relative_error']:.2e}"
        rows.append((s, f"{t * 1e3:.2f}", f"{t / res['clone_s']:.2f}", f"{t / res['copy_s']:.2f}",
                     f"{r['bytes_per_step'] / (4 * c['numel']):.3f}", check + ("" if r["strategy_held"] else
                                                                                " (left its plan)")))
    table = format_table(rows, header=("strategy", "ms/step/rank", "x clone", "x copy_", "bytes of dense",
                                       "result"))
    return head + "\n" + section("results", table)
