"""Horovod worker for tests/test_plugins_horovod.py, started by horovodrun or mpirun.

Usage: python horovod_worker.py OUT_DIR SCENARIO[,SCENARIO...]

Each scenario trains the same model twice from the same seed on the same per-rank batches, once
with Horovod's own uncompressed allreduce and once with a lossless_hc compressor, and every rank
writes OUT_DIR/<scenario>.rank<r>.json with what the test asserts (parameter difference, stats,
per-parameter capacities, errors raised).
"""
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
import horovod.torch as hvd  # noqa: E402
from models import EmbeddingModel, batch, loss_fn, max_param_diff  # noqa: E402

from lossless_hc.aggregate import ConfigurationMismatch  # noqa: E402
from lossless_hc.plugins.horovod import Compression  # noqa: E402

STEPS = 6
PAIR = hvd.ProcessSet([0, 1])  # ranks 0 and 1 only (registered at init)


def train(compression, steps=STEPS, op=None, sparse=False, groups=None, bpps=1, process_set=None, lr=0.1,
          model=None):
    torch.manual_seed(0)
    model = model or EmbeddingModel(sparse=sparse)
    kwargs = dict(named_parameters=model.named_parameters(), compression=compression,
                  op=hvd.Average if op is None else op, sparse_as_dense=sparse, backward_passes_per_step=bpps)
    if groups is not None:
        kwargs["groups"] = groups
    if process_set is not None:
        kwargs["process_set"] = process_set
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=lr), **kwargs)
    rank = hvd.rank()
    for step in range(steps):
        opt.zero_grad()
        for micro in range(bpps):
            loss_fn(model, batch(step * bpps + micro, rank)).backward()
        opt.step()
    return model


def compare(comp, **kw):
    ref = train(Compression.none, **kw)
    got = train(comp, **kw)
    return {"max_diff": max_param_diff(ref, got), "stats": comp.stats(),
            "capacity": {n: a.capacity for n, a in comp.aggregators().items()},
            "compressed": {n: a.compressed for n, a in comp.aggregators().items()}}


def expect_error(fn, exc):
    try:
        fn()
    except exc as e:
        return {"error": type(e).__name__, "message": str(e)}
    return {"error": None}


def scenario(name):
    if name == "average":
        return compare(Compression.lossless(max_density=0.05))
    if name == "sum":
        return compare(Compression.lossless(max_density=0.05), op=hvd.Sum, lr=0.02)
    if name == "sparse_as_dense":
        return compare(Compression.lossless(max_density=0.05), sparse=True)
    if name == "groups":
        return compare(Compression.lossless(max_density=0.05), groups=2)
    if name == "backward_passes":
        return compare(Compression.lossless(max_density=0.05), bpps=2)
    if name == "fallback":
        # Capacity 0.1% of a table: every rank overloads the embeddings at the first step.
        return compare(Compression.lossless(max_density=0.001))
    if name == "topk":
        comp = Compression.topk(ratio=0.05)
        model = train(comp, steps=4)
        return {"stats": comp.stats(), "residual_norms": {n: float(a.residual.norm()) if a.residual is not None
                                                          else None for n, a in comp.aggregators().items()}}
    if name == "process_set":
        out = {"included": PAIR.included()}
        if PAIR.included():
            out.update(compare(Compression.lossless(max_density=0.05), process_set=PAIR))
        return out
    if name == "adasum":
        return expect_error(lambda: train(Compression.lossless(), op=hvd.Adasum, steps=1), ValueError)
    if name == "sparse_without_dense":
        def run():
            torch.manual_seed(0)
            model = EmbeddingModel(sparse=True)
            opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                           named_parameters=model.named_parameters(),
                                           compression=Compression.lossless())
            loss_fn(model, batch(0, hvd.rank())).backward()
            opt.step()
        return expect_error(run, ValueError)
    if name == "seed_mismatch":
        return expect_error(lambda: train(Compression.lossless(max_density=0.05, seed=hvd.rank()), steps=1),
                            ConfigurationMismatch)
    raise ValueError(f"unknown scenario {name}")


def main():
    out_dir, names = sys.argv[1], sys.argv[2].split(",")
    hvd.init(process_sets=[PAIR])
    torch.set_num_threads(1)
    for name in names:
        result = scenario(name)
        result["size"] = hvd.size()
        with open(os.path.join(out_dir, f"{name}.rank{hvd.rank()}.json"), "w") as f:
            json.dump(result, f)
    hvd.shutdown()


if __name__ == "__main__":
    main()
