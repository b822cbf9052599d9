"""``python -m lossless_hc.bench peel``: the sizing rule ``sketch_table_for`` measured: peeling
failure rate, max abs error against float64 truth, and decode time per key.

A decode that recovers every key peeled, whether its verdict is ok or INEXACT (some keys' proven
error bound above ``rtol``: listed, and re-aggregated by the plugins); only a decode that leaves keys
unresolved (or fails otherwise) counts against the sizing target. The errors are those of every key
peeled, the listed ones included; the share of keys listed is its own column."""
from __future__ import annotations

import statistics
import time
from typing import Callable, Sequence

import torch

from lossless_hc.bench.codec import fill_blocks, sample_distinct
from lossless_hc.bench.common import fmt_sci, format_table, machine_rows, section
from lossless_hc.lhc.codec import LosslessCodec
from lossless_hc.lhc.sizing import PEEL_FAILURE_TARGET, sketch_table_for
from lossless_hc.lhc.status import DecodeStatus

# ------------------------------------------------------------------------------------------------
# peeling benchmark
# ------------------------------------------------------------------------------------------------
def run_peel_bench(keys_list: Sequence[int], trials: int = 20, numel_factor: int = 20, seed: int = 0,
                   threads: int = 0, index: str = "bitmap",
                   log: Callable[[str], None] = lambda s: None) -> dict:

    if threads > 0:
        torch.set_num_threads(threads)
    rows = []
    for keys in keys_list:
        numel = numel_factor * keys
        table = sketch_table_for(keys)
        failures, errors, dec_times, listed = 0, [], [], []
        reasons = {}
        unresolved = []
        t_start = time.perf_counter()
        for trial in range(trials):
            trial_seed = seed * 1_000_003 + trial
            gen = torch.Generator().manual_seed(trial_seed ^ (keys * 0x9E3779B1))
            x = torch.zeros(numel, dtype=torch.float32)
            fill_blocks(x, sample_distinct(numel, keys, gen), 1, gen)
            codec = LosslessCodec(numel=numel, world_size=1, max_nnz=keys, block_size=1, seed=trial_seed,
                                  device="cpu", index=index, num_threads=threads)
            payload = codec.encode(x)
            codec.decode(payload)   # warm-up (allocations, thread pool)
            t0 = time.perf_counter()
            y, report = codec.decode(payload)
            dec_times.append(time.perf_counter() - t0)
            if report.ok or report.status == DecodeStatus.INEXACT:   # every key peeled
                errors.append(float((y.double() - x.double()).abs().max()))
                listed.append(int(report.inexact_keys.numel()))
            else:
                failures += 1
                reasons[report.reason] = reasons.get(report.reason, 0) + 1
                unresolved.append(report.unresolved)
            del x, y, payload
        med = statistics.median(dec_times)
        row = {
            "keys": keys, "numel": numel, "trials": trials, "sketch_cells": table.cells,
            "cells_per_key": table.cells / max(1, keys), "index": index,
            "failures": failures, "failure_rate": failures / trials,
            # one-sided 95% upper bound on the failure probability (exact binomial for 0 failures)
            "failure_rate_95_upper": _binomial_upper(failures, trials),
            "failure_target": PEEL_FAILURE_TARGET, "failure_reasons": reasons, "unresolved_keys": unresolved,
            "max_abs_err": max(errors) if errors else float("nan"),
            "median_abs_err": statistics.median(errors) if errors else float("nan"),
            # of the decodes that peeled: the median share of keys listed INEXACT
            "inexact_share_median": statistics.median(listed) / max(1, keys) if listed else float("nan"),
            "decode_ms_median": med * 1e3, "decode_ns_per_key": med / max(1, keys) * 1e9,
            "wall_s": time.perf_counter() - t_start,
        }
        rows.append(row)
        log(f"keys={keys}: {failures}/{trials} failures, max abs err {row['max_abs_err']:.3e}, "
            f"{row['decode_ns_per_key']:.1f} ns/key")
    return {"config": {"keys": list(keys_list), "trials": trials, "numel_factor": numel_factor, "seed": seed,
                       "threads": threads, "index": index, "world_size": 1, "values": "N(0,1)"},
            "rows": rows}


def _binomial_upper(failures: int, trials: int, conf: float = 0.95) -> float:
    """One-sided Clopper-Pearson upper bound on a failure probability (bisection on the binomial CDF)."""
    if trials <= 0:
        return 1.0
    if failures >= trials:
        return 1.0

    def cdf(p: float) -> float:
        total, term = 0.0, (1 - p) ** trials
        for i in range(failures + 1):
            total += term
            term *= (trials - i) / (i + 1) * p / (1 - p) if p < 1 else 0.0
        return total

    lo, hi = failures / trials, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if cdf(mid) > 1 - conf:
            lo = mid
        else:
            hi = mid
    return hi


def render_peel(res: dict, machine: dict, cmd: str) -> str:
    c = res["config"]
    out = [section("lossless_hc peeling benchmark (sketch_table_for)", format_table([
        ("command", cmd),
        *machine_rows(machine),
        ("setup", f"1 worker, N(0,1) values, numel = {c['numel_factor']} x keys, {c['index']} index, "
                  f"{c['trials']} trials (codec seed varies per trial)"),
    ], align="ll"))]
    rows = []
    for r in res["rows"]:
        rows.append((f"{r['keys']:,}", f"{r['sketch_cells']:,}", f"{r['cells_per_key']:.3f}",
                     f"{r['failures']}/{r['trials']}", f"{r['failure_rate_95_upper']:.3f}",
                     fmt_sci(r["max_abs_err"]), fmt_sci(r["median_abs_err"]), f"{100 * r['inexact_share_median']:.2f}%",
                     f"{r['decode_ms_median']:.3f}", f"{r['decode_ns_per_key']:.1f}"))
    body = format_table(rows, header=("keys", "cells", "cells/key", "failed", "95% upper", "max abs err",
                                      "median max err", "INEXACT keys", "decode ms", "ns/key"))
    target = res["rows"][0]["failure_target"] if res["rows"] else None
    if target is not None:
        body += (f"\nsizing target: peel failure probability < {target:g} per decode (a decode that peeled every "
                 "key, ok or INEXACT, is not a failure; INEXACT keys: the median share listed, whose bound "
                 "exceeds rtol)")
    for r in res["rows"]:
        if r["failure_reasons"]:
            body += f"\nkeys={r['keys']}: " + "; ".join(f"{n}x {why}" for why, n in r["failure_reasons"].items())
    out.append(section("results", body))
    return "\n".join(out)

