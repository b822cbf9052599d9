"""Collective-only benchmark: gradients recorded from a real model replayed through the real
collectives on 8 and 16 (or any number of) emulated hosts, without the model's compute.

    sudo .venv/bin/python -m lossless_hc.bench replay --model ncf --skew 1.1 --ranks 16 --hosts 8,16 \\
        --compression none,sparse,lossless,fp16,bf16 --framework ddp,horovod --cpu-fair --out results/

Step 1 (skipped when ``--dir`` already holds a recording of the same task): one process records
``--record-steps`` steps of ``--ranks`` ranks (:func:`lossless_hc.bench.workloads.replay.record`).
Step 2: for each ``--hosts`` count, ``bench cluster --replay DIR`` (one worker per host replays
its rank's gradients through DDP's hooks or Horovod's DistributedOptimizer, same buckets and
tensors as the real model). The result is the per-step aggregation time per strategy: median
replay step minus the compute-only replay step (the same workers without communication; the few
elementwise passes that turn recorded gradients into ``.grad``).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

from lossless_hc.bench import cluster
from lossless_hc.bench.cluster_report import AUTO, rate_label
from lossless_hc.bench.common import command_line


def _int_list(text: str) -> list:
    vals = [int(v) for v in text.split(",") if v.strip()]
    if not vals or min(vals) < 2:
        raise argparse.ArgumentTypeError(f"expected comma-separated host counts >= 2, got {text!r}")
    return vals


def same_recording(meta: dict, model: str, ranks: int, steps: int, options: dict) -> bool:
    """Whether a recording's metadata matches the task asked for (so it can be reused)."""
    rec = meta.get("options", {})
    return (meta.get("model") == model and meta.get("ranks", 0) >= ranks and meta.get("steps", 0) >= steps
            and all(rec.get(k) == v for k, v in options.items()))


def ensure_recording(args, log=print) -> dict:
    from lossless_hc.bench.workloads import replay, train

    targs = train.parse_args(["--model", args.model, "--framework", "local", "--compression", "none",
                              "--skew", str(args.skew), *(args.train_args.split() if args.train_args else [])])
    wanted = {k: getattr(targs, k) for k in ("skew", "batch", "users", "items", "dim", "vocab", "seed")}
    path = os.path.join(args.dir, "meta.json")
    if os.path.exists(path) and not args.rerecord:
        with open(path) as f:
            meta = json.load(f)
        if same_recording(meta, args.model, args.ranks, args.record_steps, wanted):
            log(f"[replay] reusing the recording in {args.dir}")
            return meta
    log(f"[replay] recording {args.record_steps} steps of {args.ranks} ranks of {args.model} into {args.dir}")
    return replay.record(targs, args.ranks, args.record_steps, args.dir, log=log)


def render(results: dict, title: str) -> str:
    """One table: per-step aggregation time (ms) per framework x compression, one column per host
    count, and the wire MiB per host."""
    hosts = sorted(results)
    keys = []
    for n in hosts:
        for r in results[n]["rows"]:
            if (r["framework"], r["compression"]) not in keys:
                keys.append((r["framework"], r["compression"]))
    head = " | ".join(f"{n} hosts: agg ms (wire MiB/host)" for n in hosts)
    lines = [f"### {title}", "", f"| framework | compression | {head} |", "|---|---|" + "---|" * len(hosts)]
    for fw, comp in keys:
        cells = []
        for n in hosts:
            r = next((r for r in results[n]["rows"] if (r["framework"], r["compression"]) == (fw, comp)), None)
            if r is None:
                cells.append("-")
                continue
            agg, wire = r.get("aggregation_s"), r.get("wire_bytes_per_step_per_host")
            # the wire is counted only where the interface could be read: the time stands without it
            cells.append("-" if agg is None else
                         f"{1e3 * agg:.1f}" + ("" if wire is None else f" ({wire / 2**20:.2f})"))
        mode = f"**{comp}** (planner)" if comp in AUTO else comp
        lines.append(f"| {fw} | {mode} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def cmd_replay(args) -> int:
    out = args.out or tempfile.mkdtemp(prefix="lhc-replay-")
    os.makedirs(out, exist_ok=True)
    args.dir = args.dir or os.path.join(out, "recording")
    # Before recording (minutes): what the recorder or bench cluster would refuse only afterwards.
    why = (f"--ranks {args.ranks} < --hosts {max(args.hosts)}" if args.ranks < max(args.hosts) else
           f"--record-steps must be at least 1, got {args.record_steps}" if args.record_steps < 1 else
           f"--warmup must be in [0, --steps), got {args.warmup}" if not 0 <= args.warmup < args.steps else None)
    if why is None:
        try:
            cluster.check_run_limits(args.timeout, args.cores)
        except ValueError as exc:
            why = str(exc)
    if why:
        print(f"python -m lossless_hc.bench replay: error: {why}", file=sys.stderr)
        return 2
    try:
        cluster.require_root()
    except cluster.ClusterError as exc:
        print(f"python -m lossless_hc.bench replay: error: {exc}", file=sys.stderr)
        return 2
    meta = ensure_recording(args, log=lambda m: print(m, file=sys.stderr))
    results = {}
    for n in args.hosts:
        sub = argparse.Namespace(
            hosts=n, bandwidth=args.bandwidth, latency=args.latency, model=args.model,
            compression=args.compression, framework=args.framework, shards=1, fsdp_mesh="hsdp", steps=args.steps,
            warmup=args.warmup, rounds=1, skew=0.0, cpu_fair=args.cpu_fair, cores=args.cores, replay=args.dir,
            train_args="", timeout=args.timeout, out=os.path.join(out, f"hosts{n}"), plot=None)
        rc = cluster.cmd_cluster(sub)
        if rc != 0:
            return rc
        with open(sub.report_json) as f:   # this run's (not an earlier run's in the same folder)
            results[n] = json.load(f)
    skew = meta["options"].get("skew")
    title = (f"collective-only replay of {meta['model']}{f' (Zipf skew {skew})' if skew else ''}, "
             f"{rate_label(cluster.parse_rate(args.bandwidth))}{', CPU-fair' if args.cpu_fair else ''}: "
             f"per-step aggregation time")
    md = render(results, title)
    print(md)
    stem = os.path.join(out, f"replay_{meta['model']}{f'_zipf{skew}' if skew else ''}")
    with open(stem + ".md", "w") as f:
        f.write(f"`{command_line()}`\n\n{md}")
    with open(stem + ".json", "w") as f:
        json.dump({"command": command_line(), "recording": {k: meta[k] for k in ("model", "ranks", "steps", "options")},
                   "row_stats": meta["row_stats"], "names": meta["names"], "shapes": meta["shapes"],
                   "row_sparse": meta["row_sparse"], "by_hosts": results}, f, indent=1, default=str)
    print(f"[replay] wrote {stem}.md and .json", file=sys.stderr)
    return 0


def add_arguments(p) -> None:
    p.add_argument("--model", default="ncf", choices=("ncf", "lstm", "vgg", "bert", "digits"))
    p.add_argument("--skew", type=float, default=0.0, help="ncf: Zipf exponent of user and negative-item ids")
    p.add_argument("--ranks", type=int, default=16, help="ranks to record (at least the largest --hosts)")
    p.add_argument("--record-steps", type=int, default=6, help="steps to record (replayed cyclically)")
    p.add_argument("--dir", help="recording directory (reused when it holds the same task; default: in --out)")
    p.add_argument("--rerecord", action="store_true", help="record again even if --dir holds a recording")
    p.add_argument("--train-args", default="", help="task options for the recording (e.g. '--users 20000')")
    p.add_argument("--hosts", type=_int_list, default=[8, 16], help="comma-separated host counts (default 8,16)")
    p.add_argument("--bandwidth", default="1gbit")
    p.add_argument("--latency", default="100us")
    p.add_argument("--compression", default="none,fp16,bf16,sparse,lossless",
                   help=f"comma-separated, from {', '.join(cluster.COMPRESSIONS)}")
    p.add_argument("--framework", default="ddp,horovod", help="comma-separated: horovod, ddp")
    p.add_argument("--steps", type=int, default=12, help="replayed steps per configuration, warm-up included")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--cpu-fair", action="store_true", help="as in bench cluster")
    p.add_argument("--cores", type=int)
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--out", help="directory for the recording (unless --dir), tables, JSON and logs")
    p.set_defaults(func=cmd_replay)
