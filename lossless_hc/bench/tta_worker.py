"""One rank of a time-to-accuracy run (started by :mod:`lossless_hc.bench.tta` on the emulated cluster).

Takes every option of :mod:`lossless_hc.bench.workloads.train` (model, framework, compression and
their settings; ``--steps`` is the step cap) plus:

* ``--eval-every E``: rank 0 evaluates the workload's held-out metric before training and after
  every E-th step (and the last);
* ``--target T``: training stops at the first evaluation at or past T (``>= T`` for a metric where
  higher is better, ``<= T`` otherwise: ``Workload.higher_is_better``);
* ``--max-train-seconds S`` (0: none): training also stops at the first evaluation after S
  seconds of training time;
* ``--held-out-files K``, ``--eval-windows W``: the language model's validation set is every K-th
  standard-library file, W windows of it.

Training time excludes evaluation: the clock runs from a barrier before step 1 and is paused from
the end of every evaluated step until every rank has learned rank 0's decision (a broadcast of one
integer after the evaluation) -- the other ranks wait inside that broadcast meanwhile. Everything
else counts: batches, forward, backward, aggregation (comm hooks, their start-up calibration
included), optimizer step. Each rank writes a JSON report (``--json`` with ``{rank}``); rank 0's
holds the curve ``[{"step", "train_s", "metric"}, ...]`` (step 0 at 0 s: the initial model).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

from lossless_hc.bench.common import leave
from lossless_hc.bench.workloads import train


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--eval-every", type=int, required=True)
    p.add_argument("--target", type=float, required=True)
    p.add_argument("--max-train-seconds", type=float, default=0.0)
    p.add_argument("--held-out-files", type=int, default=0)
    p.add_argument("--eval-windows", type=int, default=64)
    own, rest = p.parse_known_args(argv)
    if own.eval_every < 1 or own.max_train_seconds < 0:
        p.error("--eval-every must be >= 1 and --max-train-seconds >= 0")
    args = train.parse_args(rest)
    for key, value in vars(own).items():
        setattr(args, key, value)
    return args


def reached(value: float, target: float, higher_is_better: bool) -> bool:
    """Whether ``value`` is at or past ``target`` in the metric's good direction."""
    return value >= target if higher_is_better else value <= target


def broadcast_flag(fw, flag: int) -> int:
    """Rank 0's ``flag`` on every rank (one int32 broadcast over the training's process group)."""
    t = torch.tensor([flag], dtype=torch.int32)
    if isinstance(fw, train.Horovod):
        return int(fw.hvd.broadcast(t, root_rank=0, name="tta.stop")[0])
    if isinstance(fw, train.DDP):  # FSDP included
        fw.dist.broadcast(t, src=0)
        return int(t[0])
    if isinstance(fw, train.NoCommunication) and fw.size == 1:  # a single process decides alone
        return flag
    raise ValueError(f"time-to-accuracy needs a distributed framework, got {type(fw).__name__}")


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.device != "cpu":
        raise SystemExit("lossless_hc.bench.tta_worker runs CPU workers only")
    fw = train.FRAMEWORKS[args.framework](args)
    torch.set_num_threads(args.threads or max(1, (os.cpu_count() or 1) // fw.size))  # as train.main
    torch.manual_seed(args.seed)
    work = train.WORKLOADS[args.model](args, fw.rank)
    model = work.model
    opt = train.OPTIMIZERS[args.optimizer](model.parameters(), args.lr)
    wrapped, opt = fw.wrap(model, opt, args)
    higher = work.higher_is_better
    curve, eval_s = [], 0.0

    def checkpoint(step: int, train_s: float) -> bool:
        """Rank 0 evaluates; every rank learns whether to stop."""
        nonlocal eval_s
        t0 = time.perf_counter()
        stop = 0
        if fw.rank == 0:
            value = work.evaluate(model)
            curve.append({"step": step, "train_s": train_s, "metric": value})
            print(f"step {step:5d}  train {train_s:8.2f} s  {work.metric} {value:.4f}", flush=True)
            stop = int(reached(value, args.target, higher) or step >= args.steps
                       or (args.max_train_seconds > 0 and train_s >= args.max_train_seconds))
        stop = broadcast_flag(fw, stop)
        eval_s += time.perf_counter() - t0
        return bool(stop)

    net0 = train.interface_bytes(args.net_iface) if args.net_iface else None
    wall0 = time.perf_counter()
    done = checkpoint(0, 0.0)  # the initial model may already be at the target: no step then
    fw.barrier()
    train_s, losses, step = 0.0, [], 0
    resume = time.perf_counter()
    while not done and step < args.steps:
        step += 1
        batch = next(work.batches)
        opt.zero_grad()
        loss = work.loss(wrapped, batch)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
        if step % args.eval_every == 0 or step == args.steps:
            train_s += time.perf_counter() - resume
            done = checkpoint(step, train_s)
            resume = time.perf_counter()
    fw.barrier()
    net = None
    if net0 is not None:
        end = train.interface_bytes(args.net_iface)
        net = {k: end[k] - net0[k] for k in end}
    result = {
        "rank": fw.rank, "workers": fw.size, "model": args.model, "framework": args.framework,
        "compression": args.compression, "topk_ratio": args.topk_ratio, "seed": args.seed,
        "metric": work.metric, "higher_is_better": higher, "target": args.target,
        "eval_every": args.eval_every, "step_cap": args.steps, "steps_run": step,
        "train_s": train_s, "eval_s": eval_s, "wall_s": time.perf_counter() - wall0,
        "final_loss": sum(losses[-10:]) / max(1, len(losses[-10:])), "curve": curve,
        "dense_bytes_per_step": train.dense_grad_bytes(model), "net_bytes": net, "stats": fw.stats(),
    }
    if args.json and (fw.rank == 0 or "{rank}" in args.json):
        with open(args.json.format(rank=fw.rank), "w") as f:
            json.dump(result, f, indent=2, default=str)
    if args.save_params and fw.rank == 0:
        torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, args.save_params)
    fw.shutdown()
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
    leave()
