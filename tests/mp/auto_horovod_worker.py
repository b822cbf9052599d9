"""Horovod worker for tests/test_planner_mp.py (``Compression.auto``), started by horovodrun.

Usage: python auto_horovod_worker.py OUT_DIR SCENARIO[,SCENARIO...]

Ranks draw batches of different sizes (different local sparsity), and odd ranks look up the item
table before the user table, so autograd (which runs later-created nodes first) reaches their gradient
hooks -- hence ``compress`` and Horovod's operations -- in a different order there; each rank records
its order. Every
rank writes OUT_DIR/<scenario>.rank<r>.json.
"""
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
import horovod.torch as hvd  # noqa: E402
from models import EmbeddingModel, batch, loss_fn, max_param_diff, param_digest  # noqa: E402

import lossless_hc._C  # noqa: E402
from lossless_hc.plugins.horovod import Calibration, Compression  # noqa: E402

RUNS = [0]


class OrderedModel(EmbeddingModel):
    """EmbeddingModel computing the same function, with the lookups in a rank-dependent order."""

    def forward(self, u, i):
        if hvd.rank() % 2:
            ei = self.items(i)
            eu = self.users(u)
        else:
            eu = self.users(u)
            ei = self.items(i)
        h = torch.relu(self.fc1(torch.cat([eu, ei], dim=-1)))
        return self.fc2(h).squeeze(-1)


def rank_batch(step, rank, burst_from=None):
    size = 3000 if burst_from is not None and step >= burst_from else 8 * (rank + 1)
    return batch(step, rank, size=size)


def train(compression, steps=6, op=None, burst_from=None, order=None):
    torch.manual_seed(0)
    model = OrderedModel()
    RUNS[0] += 1
    named = [(f"run{RUNS[0]}.{n}", p) for n, p in model.named_parameters()]
    if order is not None:   # record the order compress() is called in (the hooks' order)
        inner_compress = compression.compress

        def compress(tensor):
            order.append(tuple(tensor.shape))
            return inner_compress(tensor)
        compression.compress = compress
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=named,
                                   compression=compression, op=hvd.Average if op is None else op)
    for step in range(steps):
        opt.zero_grad()
        loss_fn(model, rank_batch(step, hvd.rank(), burst_from)).backward()
        opt.step()
    return model


def compare(make, **kw):
    ref = train(Compression.none, **kw)
    comp = make()
    order = []
    got = train(comp, order=order, **kw)
    st = comp.stats()
    return {"max_diff": max_param_diff(ref, got), "digest": param_digest(got), "order": order[:6],
            "plan": {k.split(".", 1)[1]: [v["strategy"], v["changes"]] for k, v in st["plan"].items()},
            "calibration": comp.spec.calibration.as_list(), "fallbacks": st["fallbacks"]}


def scenario(name):
    if name == "measured":   # calibrated at construction on the real process set
        return compare(lambda: Compression.auto(interval=2))
    if name == "replan":     # sparse, then dense: the plan changes mid-training; op=Sum this time
        return compare(lambda: Compression.auto(interval=2, calibration=Calibration.default(1e9)),
                       steps=10, burst_from=5, op=hvd.Sum)
    if name == "allgather":  # a slow link: the sparse tables go through the named async allgather
        return compare(lambda: Compression.auto(interval=2, calibration=Calibration.default(1e7, 0.0)))
    if name == "lossy":
        comp = Compression.auto(lossy=True, interval=2, calibration=Calibration.default(1e8), lossy_min_bytes=0)
        got = train(comp)
        return {"digest": param_digest(got),
                "plan": {k.split(".", 1)[1]: [v["strategy"], v["changes"]] for k, v in comp.stats()["plan"].items()}}
    if name == "config_mismatch":
        try:
            Compression.auto(lossy=hvd.rank() == 1)
        except Exception as e:
            return {"error": type(e).__name__, "message": str(e)}
        return {"error": None}
    raise ValueError(f"unknown scenario {name}")


def main():
    out_dir, names = sys.argv[1], sys.argv[2].split(",")
    hvd.init()
    torch.set_num_threads(1)
    for name in names:
        result = scenario(name)
        result["size"] = hvd.size()
        result["extension"] = os.path.realpath(lossless_hc._C.__file__)   # which build ran
        with open(os.path.join(out_dir, f"{name}.rank{hvd.rank()}.json"), "w") as f:
            json.dump(result, f)
    hvd.shutdown()


if __name__ == "__main__":
    main()
