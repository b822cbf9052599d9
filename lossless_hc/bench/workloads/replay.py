"""Collective-only replay: per-step, per-rank gradients recorded from a real model, fed back through
the real collectives (DDP hooks, Horovod compressors) without the model's compute.

Recording (:func:`record`) runs one model in one process: each step, each of ``ranks`` simulated
ranks computes the gradient of its own batch (its own data stream, as in data-parallel training),
then the model takes an optimizer step with the ranks' average, as data-parallel training would.
It writes, under a directory:

* ``meta.json``: the task's options, the parameters' names and shapes, which are row-sparse
  (``nn.Embedding`` weights), and per step and row-sparse tensor the rows each rank touched and the
  union of rows over the first n ranks, for every n (the simulator's statistics);
* ``rank{r}.step{s}.pt``: rank r's gradients at step s, one entry per parameter in order: a dense
  tensor, or for a row-sparse parameter ``(row indices, rows)`` (the rows whose gradient is not
  all zero).

Replaying (:class:`ReplayWorkload`, ``--model replay --replay-dir DIR`` of
:mod:`lossless_hc.bench.workloads.train`) builds a module with parameters of the recorded shapes
whose loss is ``sum_p <p, g_p>`` (for row-sparse parameters ``sum <W[idx], rows>``, through
an ``nn.Embedding``), so backward produces exactly the recorded gradient (d/dp <p, g> = g; distinct
indices, so no row is summed twice) and the framework aggregates it as it would the real one: same
tensors, same buckets, dense or sparse as the real model's. The compute left is a few
elementwise passes over the parameters.
"""
from __future__ import annotations

import json
import math
import os
from typing import Optional

import torch
from torch import nn

from lossless_hc.bench.workloads.tasks import OPTIMIZERS, WORKLOADS, Workload

FORMAT = 1


def _row_sparse_names(model: nn.Module) -> set:
    return {f"{name}.weight" if name else "weight" for name, m in model.named_modules() if isinstance(m, nn.Embedding)}


def to_rows(grad: torch.Tensor):
    """(indices of the rows of ``grad`` that are not all zero, those rows)."""
    idx = torch.nonzero(grad.reshape(grad.shape[0], -1).abs().sum(dim=1)).squeeze(1)
    return idx, grad[idx].clone()


def record(args, ranks: int, steps: int, out_dir: str, log=print) -> dict:
    """Records ``steps`` steps of ``ranks`` ranks of the task ``args.model`` (parsed options of
    :mod:`lossless_hc.bench.workloads.train`) into ``out_dir``; returns the metadata written."""
    if ranks < 1 or steps < 1:
        raise ValueError(f"record needs ranks >= 1 and steps >= 1, got {ranks}, {steps}")
    if args.model not in WORKLOADS:
        raise ValueError(f"cannot record --model {args.model}")
    os.makedirs(out_dir, exist_ok=True)
    torch.manual_seed(args.seed)
    args.sparse_embeddings = False  # recorded densely, stored as rows
    work = WORKLOADS[args.model](args, 0)
    model = work.model
    opt = OPTIMIZERS[args.optimizer](model.parameters(), args.lr)
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    row_names = _row_sparse_names(model)
    streams = [work.batches_for(r) for r in range(ranks)]
    meta = {"format": FORMAT, "model": args.model, "ranks": ranks, "steps": steps,
            "options": {k: v for k, v in vars(args).items() if isinstance(v, (int, float, str, bool, type(None)))},
            "names": [n for n, _ in params], "shapes": [list(p.shape) for _, p in params],
            "row_sparse": [n in row_names for n, _ in params], "row_stats": []}
    for step in range(steps):
        total = [torch.zeros_like(p) for _, p in params]
        supports: dict = {n: [] for n, _ in params if n in row_names}
        for r in range(ranks):
            opt.zero_grad()
            work.loss(model, next(streams[r])).backward()
            entries = []
            for (name, p), acc in zip(params, total):
                g = p.grad if p.grad is not None else torch.zeros_like(p)
                acc.add_(g)
                if name in row_names:
                    idx, rows = to_rows(g)
                    supports[name].append(idx)
                    entries.append((idx, rows))
                else:
                    entries.append(g.detach().clone())
            torch.save(entries, os.path.join(out_dir, f"rank{r}.step{step}.pt"))
        stats = {}
        for name, idxs in supports.items():
            seen, union = torch.zeros(dict(params)[name].shape[0], dtype=torch.bool), []
            for idx in idxs:
                seen[idx] = True
                union.append(int(seen.sum()))
            stats[name] = {"rank_keys": [int(i.numel()) for i in idxs], "union_keys_first_n": union}
        meta["row_stats"].append(stats)
        for (_, p), acc in zip(params, total):
            p.grad = acc.div_(ranks)
        opt.step()
        log(f"[replay] recorded step {step + 1}/{steps} of {ranks} ranks")
    with open(os.path.join(out_dir, "meta.json"), "w") as f:
        json.dump(meta, f, indent=1)
    return meta


def load_meta(replay_dir: str) -> dict:
    path = os.path.join(replay_dir, "meta.json")
    if not os.path.exists(path):
        raise SystemExit(f"--replay-dir {replay_dir}: no meta.json (record first: python -m lossless_hc.bench replay)")
    with open(path) as f:
        meta = json.load(f)
    if meta.get("format") != FORMAT:
        raise SystemExit(f"--replay-dir {replay_dir}: format {meta.get('format')}, expected {FORMAT}; record again")
    return meta


def load_rank(replay_dir: str, rank: int, steps: Optional[int] = None) -> list:
    """Rank ``rank``'s recorded steps: a list (one per step) of per-parameter entries."""
    meta = load_meta(replay_dir)
    if not 0 <= rank < meta["ranks"]:
        raise SystemExit(f"--replay-dir {replay_dir} holds {meta['ranks']} ranks; rank {rank} was not recorded "
                         f"(record with at least as many ranks as hosts)")
    n = meta["steps"] if steps is None else min(steps, meta["steps"])
    return [torch.load(os.path.join(replay_dir, f"rank{rank}.step{s}.pt")) for s in range(n)]


class _Dense(nn.Module):
    def __init__(self, shape):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(shape))


class ReplayModel(nn.Module):
    """Parameters of the recorded shapes; ``forward(*flat_batch)`` returns ``sum_p <p, g_p>`` so that
    backward leaves exactly the recorded gradient in each parameter. A row-sparse parameter is the
    weight of an ``nn.Embedding`` (``sparse`` as asked: DDP decides from the module whether to
    expect a sparse gradient), every other one of a holder module; one child per parameter, in the
    recorded order, so that parameter order (and DDP's buckets) follow the real model's."""

    def __init__(self, names, shapes, row_sparse, sparse: bool = False):
        super().__init__()
        self.names = [n.replace(".", "__") for n in names]  # module names may not contain dots
        self.row_sparse = list(row_sparse)
        for n, shape, rows in zip(self.names, shapes, self.row_sparse):
            if rows:
                emb = nn.Embedding(shape[0], int(math.prod(shape[1:])), sparse=sparse)
                nn.init.zeros_(emb.weight)
                self.add_module(n, emb)
            else:
                self.add_module(n, _Dense(shape))

    def forward(self, *flat):
        total, i = 0.0, 0
        for name, rows in zip(self.names, self.row_sparse):
            child = getattr(self, name)
            if rows:
                idx, vals = flat[i], flat[i + 1]
                total = total + (child(idx) * vals.reshape(idx.numel(), -1)).sum()
                i += 2
            else:
                total = total + (child.weight * flat[i]).sum()
                i += 1
        return total


class ReplayWorkload(Workload):
    """``--model replay --replay-dir DIR``: this rank's recorded gradients, cycled."""
    name, metric = "replay", "param_norm"

    def __init__(self, args, rank):
        super().__init__(args, rank)
        if not args.replay_dir:
            raise SystemExit("--model replay needs --replay-dir")
        meta = load_meta(args.replay_dir)
        self.steps = load_rank(args.replay_dir, rank)
        self.model = ReplayModel(meta["names"], meta["shapes"], meta["row_sparse"], sparse=args.sparse_embeddings)
        self.finish_init()

    def batches_for(self, rank):
        if rank != self.rank:
            raise ValueError("a replay workload holds only its own rank's gradients")
        while True:
            for entries in self.steps:
                flat = []
                for e in entries:
                    flat.extend(e if isinstance(e, (tuple, list)) else (e,))
                yield tuple(flat)

    def loss(self, model, batch):
        return model(*batch)

    @torch.no_grad()
    def evaluate(self, model):
        return float(sum(float(p.norm()) ** 2 for p in model.parameters()) ** 0.5)
