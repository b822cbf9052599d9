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
from models import (EmbeddingModel, LinearLoss, batch, confirm_every_guard_look, loss_fn, max_param_diff,  # noqa: E402
                    param_digest)

import lossless_hc._C  # noqa: E402
from lossless_hc.plugins.horovod import Calibration, Compression  # noqa: E402
confirm_every_guard_look()

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


def compare(make, ref_compression=Compression.none, **kw):
    ref = train(ref_compression, **kw)
    comp = make()
    order = []
    got = train(comp, order=order, **kw)
    st = comp.stats()
    return {"max_diff": max_param_diff(ref, got), "digest": param_digest(got), "order": order[:6],
            "plan": {k.split(".", 1)[1]: [v["strategy"], v["changes"]] for k, v in st["plan"].items()},
            "calibration": comp.spec.calibration.as_list(), "fallbacks": st["fallbacks"], "guard": st["guard"],
            "plain_steps": {k.split(".", 1)[1]: v["plain_steps"] for k, v in st["plan"].items()}}


def lossy_gradient(step, rank):
    return torch.randn(128, 96, generator=torch.Generator().manual_seed(7919 * step + rank))


def lossy_guard(dense_verdict, steps=12, strategy="topk"):
    """``Compression.auto(lossy=True)`` with ``strategy`` plans (top-k or top-k allgathered: ratio 0.05, error
    feedback) under the step guard (one
    block of 2 steps per window from step 2: plans at 2 and 3, sent as they are at 4 and 5, the first look when
    step 5 ends; a look for the plans is confirmed by steps 6 to 9), forced by the margin. Conservation: n times the
    sum of the averaged gradients plus every rank's error feedback left at the end equals the sum of every
    rank's gradients."""
    n, rank = hvd.size(), hvd.rank()
    model = LinearLoss((128, 96))
    RUNS[0] += 1
    comp = Compression.auto(lossy=True, first=strategy, strategies=(strategy,), topk_ratio=0.05, lossy_min_bytes=0,
                            interval=2, calibration=Calibration.default(1e9), guard_steps=1, guard_start=2,
                            guard_margin=1 - 1e-6 if dense_verdict else -1e6)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0),
                                   named_parameters=[(f"run{RUNS[0]}.weight", model.weight)], compression=comp,
                                   op=hvd.Average)
    out_sum = torch.zeros(128, 96, dtype=torch.float64)
    for step in range(steps):
        opt.zero_grad()
        model(lossy_gradient(step, rank)).backward()
        opt.step()
        out_sum += model.weight.grad.to(torch.float64)
    agg = next(iter(comp.aggregators().values()))
    left = agg.take_lossy_memory()
    memory = torch.zeros_like(out_sum) if left is None else left.reshape(128, 96).to(torch.float64)
    memories = hvd.allgather(memory.reshape(1, -1), name=f"run{RUNS[0]}.memories").reshape(n, 128, 96)
    total = sum(lossy_gradient(t, r).to(torch.float64) for t in range(steps) for r in range(n))
    st = comp.stats()
    return {"guard": st["guard"], "left": left is not None,
            "plain_steps": {k.split(".", 1)[1]: v["plain_steps"] for k, v in st["plan"].items()},
            "plan": {k.split(".", 1)[1]: v["strategy"] for k, v in st["plan"].items()},
            "conservation_error": float((n * out_sum + memories.sum(0) - total).abs().max()),
            "scale": float(total.abs().max())}


def lossy_guard_half(steps=12):
    """The step guard's dense window with ``lossy=True`` and fp16 among the strategies, a dense verdict forced
    (trial as :func:`lossy_guard`): one 128 x 96 weight under top-k plans, its averaged gradient at every step,
    and the same gradients through Horovod's own ``Compression.fp16``."""
    rank = hvd.rank()
    grads = {}
    for label in ("auto", "fp16"):
        model = LinearLoss((128, 96))
        RUNS[0] += 1
        # a 1 Mbit/s link: the plans stay top-k (float16's twice the bytes of a 1% top-k would not pay)
        comp = Compression.fp16 if label == "fp16" else Compression.auto(
            lossy=True, first="topk", strategies=("topk", "fp16"), lossy_min_bytes=0, interval=2,
            calibration=Calibration.default(1e6), guard_steps=1, guard_start=2, guard_margin=1 - 1e-6)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0),
                                       named_parameters=[(f"run{RUNS[0]}.weight", model.weight)], compression=comp,
                                       op=hvd.Average)
        grads[label] = []
        for step in range(steps):
            opt.zero_grad()
            model(lossy_gradient(step, rank)).backward()
            opt.step()
            grads[label].append(model.weight.grad.clone())
        if label == "auto":
            guard = comp.stats()["guard"]
    return {"guard": guard, "same_as_fp16": [bool(torch.equal(a, b)) for a, b in zip(grads["auto"], grads["fp16"])]}


def scenario(name):
    if name == "measured":   # calibrated at construction on the real process set
        return compare(lambda: Compression.auto(interval=2))
    if name == "replan":     # sparse, then dense: the plan changes mid-training; op=Sum this time
        return compare(lambda: Compression.auto(interval=2, calibration=Calibration.default(1e9)),
                       steps=10, burst_from=5, op=hvd.Sum)
    if name == "allgather":  # a slow link: the sparse tables go through the named async allgather
        return compare(lambda: Compression.auto(interval=2, calibration=Calibration.default(1e7, 0.0)))
    if name in ("guard_dense", "guard_plan"):   # the step guard, its verdict forced by the margin
        margin = 1 - 1e-6 if name == "guard_dense" else -1e6   # plans must be 1e6x faster / may be 1e6x slower
        return compare(lambda: Compression.auto(interval=2, calibration=Calibration.default(1e9), guard_steps=1,
                                                guard_start=2, guard_margin=margin), steps=12)
    if name == "lossy_guard_half":   # with lossy, the dense window sends what Compression.fp16 sends
        return lossy_guard_half()
    if name.startswith("lossy_guard_"):
        return lossy_guard(name.startswith("lossy_guard_dense"),
                           strategy="topk_allgather" if name.endswith("_gather") else "topk")
    if name == "fp16_plain":   # an fp16 plan's plain steps: the tensor in float16, as Horovod's fp16 compression
        return compare(lambda: Compression.auto(lossy=True, first="fp16", strategies=("fp16",), lossy_min_bytes=0,
                                                interval=4, calibration=Calibration.default(1e9), guard_steps=0),
                       ref_compression=Compression.fp16, steps=10)
    if name == "lossy":
        comp = Compression.auto(lossy=True, interval=2, calibration=Calibration.default(1e8), lossy_min_bytes=0)
        got = train(comp)
        return {"digest": param_digest(got),
                "plan": {k.split(".", 1)[1]: [v["strategy"], v["changes"]] for k, v in comp.stats()["plan"].items()}}
    if name in ("config_mismatch", "guard_mismatch", "calibration_mismatch"):   # the options differ, the guard's,
        try:                                                                     # or the given calibration's numbers
            if name == "config_mismatch":
                Compression.auto(lossy=hvd.rank() == 1)
            elif name == "calibration_mismatch":
                Compression.auto(calibration=Calibration.default(1e9 if hvd.rank() == 1 else 1e8))
            else:
                Compression.auto(guard_steps=0 if hvd.rank() == 1 else 5)
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
