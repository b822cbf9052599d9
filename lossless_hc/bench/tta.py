"""Time to accuracy on the emulated cluster: does a mode train as well, sooner?

    sudo .venv/bin/python -m lossless_hc.bench tta --task digits --hosts 4 --bandwidth 1gbit --latency 100us \\
        --cpu-fair --modes none,bf16,powersgd,topk-allgather:0.01,topk-allgather:0.1,topk,thc,lossless,auto,auto-lossy \\
        --seeds 1 --out /tmp/tta-digits

Per task (a workload with a held-out metric, a target and a step cap: :data:`TASKS`), per mode and
seed, one real worker per emulated host (:class:`lossless_hc.bench.netns.EmulatedCluster`, workers
started by :func:`lossless_hc.bench.cluster.run_workers`) runs :mod:`lossless_hc.bench.tta_worker`:
it trains until rank 0's evaluation (every ``eval_every`` steps) reaches the target, or to the step
cap. Evaluation time is not training time (the worker pauses its clock).

Definitions (per run; ``train_s`` is rank 0's training clock, evaluation excluded):

* time to target / steps to target: ``train_s`` and the step of the first evaluation at or past
  the target (``>=`` for accuracy and hit rate, ``<=`` for perplexity); undefined when no
  evaluation reaches it. Resolution: ``eval_every`` steps;
* final metric: the last evaluation's value;
* speed-up vs none: the uncompressed run's time to target / this run's (same seed);
* curve: every evaluation, against steps and against training time.

Modes are ``--compression`` modes of :mod:`lossless_hc.bench.workloads.train` (framework DDP by
default); ``topk`` and ``topk-allgather`` take an optional ratio, ``topk-allgather:0.1`` (default:
the driver's ``--topk-ratio``, 0.01). Both keep error feedback (residual memory) on every rank.
``thc:exact-output`` is THC with the output layer over the vocabulary sent exactly
(``THCHookState(exact=...)``, what docs/THC.md asks of an Adam-trained language model).
"""
from __future__ import annotations

import dataclasses
import math
import os
import sys
import time
from typing import Optional, Sequence

from lossless_hc.bench.cluster import (RunSpec, apply_cpu_fair, check_run_limits, max_param_diff, parse_delay,
                                       parse_list, parse_rate, Progress, run_workers)
from lossless_hc.bench.cluster_report import rate_label
from lossless_hc.bench.common import command_line, machine_info, write_report
from lossless_hc.bench.netns import ClusterError, EmulatedCluster, require_root, run_on_clusters, terminate_on_signals
from lossless_hc.bench.tta_report import plot_curves, render_markdown, summarize_runs
from lossless_hc.bench.workloads.train import COMPRESSIONS, SUPPORTED

WORKER = "lossless_hc.bench.tta_worker"
RATIO_MODES = ("topk", "topk-allgather")  # modes that take ":ratio"
ALL_MODES = "none,bf16,powersgd,topk-allgather:0.01,topk-allgather:0.1,topk,thc,lossless,auto,auto-lossy"


@dataclasses.dataclass(frozen=True)
class Task:
    """A workload with a held-out metric, the target and step cap of a time-to-accuracy run, and
    the training settings (per-rank batch etc.) as :mod:`lossless_hc.bench.workloads.train` options.
    The targets were chosen from uncompressed runs of the same global batch (see docs/BENCHMARKS.md,
    "Time to accuracy"): reached in well under half the step cap."""
    model: str
    target: float
    eval_every: int
    max_steps: int
    train_args: tuple
    description: str


TASKS = {
    "digits": Task("digits", 0.96, 10, 600, ("--batch", "32", "--optimizer", "sgd", "--lr", "0.05"),
                   "DigitsCNN on scikit-learn digits, test accuracy on 360 held-out images"),
    "ncf": Task("ncf", 0.35, 25, 600, ("--users", "10000", "--items", "10000", "--dim", "32", "--batch", "512",
                                       "--optimizer", "sgd", "--lr", "1.0"),
                "NCF, 10k users x 10k items, uniform ids; HR@10 on leave-one-out held-out items vs 99 unseen"),
    "ncf-zipf": Task("ncf", 0.165, 25, 600, ("--skew", "1.1", "--users", "10000", "--items",
                                                  "10000", "--dim", "32", "--batch", "512", "--optimizer", "sgd",
                                                  "--lr", "0.3"),
                     "NCF, Zipf(1.1) users and negatives; HR@10, held-out items of Zipf-drawn users vs 99 "
                     "Zipf-drawn unseen items"),
    "lm": Task("lstm", 140.0, 25, 400, ("--vocab", "5000", "--batch", "16", "--optimizer", "adam", "--lr", "0.006",
                                        "--held-out-files", "10", "--eval-windows", "128"),
               "2-layer LSTM, 5k-word vocabulary, Python standard library sources; validation perplexity on "
               "every 10th file (held out)"),
}


def parse_modes(text: str, framework: str) -> list:
    """'none,topk-allgather:0.1' -> [(label, compression, extra worker args), ...]."""
    out = []
    for item in [v.strip() for v in text.split(",") if v.strip()]:
        comp, _, ratio = item.partition(":")
        parse_list(comp, COMPRESSIONS, "--modes")
        if comp not in SUPPORTED[framework]:
            raise ValueError(f"--modes: {framework} does not implement {comp}")
        extra = []
        if comp == "thc" and ratio:
            if ratio != "exact-output":
                raise ValueError(f"--modes: {item}: thc takes no ratio, only ':exact-output' (the output layer exact)")
            if framework != "ddp":
                raise ValueError(f"--modes: {item}: ':exact-output' is DDP's THCHookState(exact=...); {framework} "
                                 "has no such option")
            extra = ["--thc-exact", "output"]
        elif ratio:
            if comp not in RATIO_MODES:
                raise ValueError(f"--modes: {item}: only {', '.join(RATIO_MODES)} take a ratio")
            r = float(ratio)
            if not 0 < r <= 1:
                raise ValueError(f"--modes: {item}: ratio must be in (0, 1]")
            extra = ["--topk-ratio", ratio]
        out.append((item, comp, extra))
    if not out or len({m[0] for m in out}) != len(out):
        raise ValueError(f"--modes: empty or repeated: {text!r}")
    return out


def run_tta(hosts: int, rate_bits: int, delay_s: float, task: Task, modes: Sequence[tuple], seeds: Sequence[int],
            workdir: str, timeout_s: float, framework: str = "ddp", cpu_fair: bool = False,
            cores: Optional[int] = None, target: Optional[float] = None, max_steps: Optional[int] = None,
            eval_every: Optional[int] = None, max_train_seconds: float = 0.0, extra_args: Sequence[str] = (),
            progress: Optional[Progress] = None) -> dict:
    """Builds the cluster, runs every (seed, mode), tears down. The uncompressed run of a seed goes
    first when it is among the modes: the final parameters of each other mode that ran as many
    steps are compared with its (``max_param_diff_vs_none``; None otherwise).
    Returns {"runs": [rank 0 reports + label, seed, max_param_diff_vs_none], "cpu_fair", "shaping", ...}."""
    target = task.target if target is None else target
    max_steps = max_steps or task.max_steps
    eval_every = eval_every or task.eval_every
    fair = None
    args = list(task.train_args)
    if cpu_fair:
        rate_bits, delay_s, fair = apply_cpu_fair(hosts, cores, rate_bits, delay_s)
        args += ["--threads", "1"]
    args += ["--eval-every", str(eval_every), "--target", repr(target), *extra_args]
    if max_train_seconds:
        args += ["--max-train-seconds", repr(max_train_seconds)]
    modes = sorted(modes, key=lambda m: m[0] != "none")
    progress = progress or Progress(len(modes) * len(seeds))
    runs = []
    with terminate_on_signals(), EmulatedCluster(hosts, rate_bits, delay_s) as cluster:
        for seed in seeds:
            base_params = None
            for label, comp, extra in modes:
                name = f"{framework}-{label.replace(':', '-')}-seed{seed}"
                progress.show(f"seed {seed} {label}")
                spec = RunSpec(task.model, max_steps, 0, args + ["--seed", str(seed), *extra], module=WORKER)
                params = os.path.join(workdir, f"{name}.params.pt")
                reports = run_workers(cluster, framework, comp, spec, workdir, timeout_s, save_params=params,
                                      label=name)
                rep = dict(next(r for r in reports if r["rank"] == 0))
                rep["wire_bytes_per_host"] = _mean([r["net_bytes"]["tx_bytes"] for r in reports if r.get("net_bytes")])
                rep.update(label=label, seed=seed, max_param_diff_vs_none=None)
                if label == "none":
                    base_params = params
                elif base_params and rep["steps_run"] == runs_by(runs, "none", seed)["steps_run"]:
                    rep["max_param_diff_vs_none"] = max_param_diff(params, base_params)
                runs.append(rep)
                progress.advance(f"seed {seed} {label}")
        shaping = {"qdisc": cluster.qdisc, "latency_applied": cluster.latency_applied, "rate_bits": rate_bits,
                   "delay_s": delay_s}
    return {"runs": runs, "cpu_fair": fair, "shaping": shaping, "target": target, "max_steps": max_steps,
            "eval_every": eval_every, "framework": framework, "hosts": hosts}


def runs_by(runs: Sequence[dict], label: str, seed: int) -> dict:
    return next(r for r in runs if r["label"] == label and r["seed"] == seed)


def _mean(xs: Sequence[float]) -> Optional[float]:
    return sum(xs) / len(xs) if xs else None


def cmd_tta(args) -> int:
    """``python -m lossless_hc.bench tta``: builds, runs, tears down, prints and writes."""
    try:
        task = TASKS[args.task]
        rate = parse_rate(args.bandwidth)
        delay = parse_delay(args.latency)
        modes = parse_modes(args.modes, args.framework)
        seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
        if not seeds or len(set(seeds)) != len(seeds):
            raise ValueError(f"--seeds: empty or repeated: {args.seeds!r}")
        if args.hosts < 2:
            raise ValueError(f"--hosts must be at least 2, got {args.hosts}")
        for name in ("max_steps", "eval_every"):
            if getattr(args, name) is not None and getattr(args, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
        # What the workers would refuse (every run failing after the cluster was built) or never reach
        # (a NaN target: every run to the step cap, reported as not reached).
        if args.target is not None and not math.isfinite(args.target):
            raise ValueError(f"--target must be a finite number, got {args.target}")
        if not (args.max_train_seconds >= 0 and math.isfinite(args.max_train_seconds)):
            raise ValueError(f"--max-train-seconds must be a finite number >= 0, got {args.max_train_seconds}")
        check_run_limits(args.timeout, args.cores)
        require_root()
    except (ValueError, ClusterError) as exc:
        print(f"python -m lossless_hc.bench tta: error: {exc}", file=sys.stderr)
        return 2
    t0 = time.monotonic()
    status, result, workdir = run_on_clusters(
        "python -m lossless_hc.bench tta", "tta", args.out,
        lambda workdir: run_tta(args.hosts, rate, delay, task, modes, seeds, workdir, args.timeout, args.framework,
                                args.cpu_fair, args.cores, args.target, args.max_steps, args.eval_every,
                                args.max_train_seconds, args.train_args.split()))
    if status:
        return status
    title = (f"{args.task}: {task.description}; {args.hosts} hosts, {rate_label(rate)}, {args.latency} one-way"
             f"{', CPU-fair' if args.cpu_fair else ''}, {args.framework}")
    result.update(task=args.task, description=task.description, title=title, command=command_line(),
                  machine=machine_info(0), bandwidth_bits=rate, latency_s=delay, seeds=seeds,
                  modes=[m[0] for m in modes], wall_s=time.monotonic() - t0)
    result["summary"] = summarize_runs(result["runs"], result["target"])
    md = render_markdown(result)
    print(md)
    stem = f"tta_{args.task}_{rate_label(rate)}_{args.hosts}hosts"
    write_report(workdir, stem, result, md)
    prefix = args.plot_prefix or os.path.join(workdir, stem)
    paths = plot_curves(result, prefix)
    print(f"[tta] wrote {workdir}/{stem}.md, .json, {', '.join(paths)} ({result['wall_s']:.0f} s)", file=sys.stderr)
    return 0


def add_arguments(p) -> None:
    p.add_argument("--task", default="digits", choices=sorted(TASKS), help="workload, metric and target (default digits)")
    p.add_argument("--modes", default=ALL_MODES,
                   help=f"comma-separated --compression modes; topk and topk-allgather take ':ratio' (default {ALL_MODES})")
    p.add_argument("--seeds", default="1", help="comma-separated seeds (model init and batches), e.g. 1,2,3")
    p.add_argument("--hosts", type=int, default=4, help="emulated hosts, one worker each (default 4)")
    p.add_argument("--bandwidth", default="1gbit", help="link rate, e.g. 1gbit, 10gbit (both directions)")
    p.add_argument("--latency", default="100us", help="one-way delay added on each host's uplink")
    p.add_argument("--framework", default="ddp", choices=("ddp", "horovod"))
    p.add_argument("--cpu-fair", action="store_true",
                   help="one thread per worker and links dilated by the workers' share of this machine's cores")
    p.add_argument("--cores", type=int, help="--cpu-fair: cores to assume (default: this machine's)")
    p.add_argument("--target", type=float, help="override the task's target")
    p.add_argument("--max-steps", type=int, help="override the task's step cap")
    p.add_argument("--eval-every", type=int, help="override the task's evaluation interval (steps)")
    p.add_argument("--max-train-seconds", type=float, default=0.0,
                   help="also stop a run after this much training time (0: no limit)")
    p.add_argument("--train-args", default="", help="extra options for the workers (lossless_hc.bench.tta_worker), quoted")
    p.add_argument("--timeout", type=float, default=900, help="seconds per run")
    p.add_argument("--out", help="directory for the table (Markdown, JSON), plots and worker logs")
    p.add_argument("--plot-prefix", help="path prefix of the two PNGs (default: in --out); writes PREFIX_time.png "
                                         "and PREFIX_steps.png")
    p.set_defaults(func=cmd_tta)
