"""torch.distributed (Gloo) worker for tests/test_planner_mp.py: DDP with ``auto_hook``.

Each scenario trains the same model from the same seed on the same per-rank batches, once with DDP's
default allreduce and once with the planner; ranks draw batches of different sizes (different local
sparsity). Every rank writes OUT_DIR/<scenario>.rank<r>.json with what the test asserts.
"""
import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, os.path.dirname(__file__))
import gloo_scenarios  # noqa: E402
from models import (DEVICE, BagModel, CountedCollectives, EmbeddingModel, LinearLoss, bag_batch, bag_loss,  # noqa: E402
                    batch, confirm_every_guard_look, loss_fn, max_param_diff, param_digest)

from lossless_hc.plugins.ddp import AutoHookState, Calibration, auto_hook  # noqa: E402
confirm_every_guard_look()


def rank_batch(step, rank, burst_from=None):
    """Rank r draws 8 (r + 1) samples; from step ``burst_from`` on, 3000 (most rows of both tables)."""
    size = 3000 if burst_from is not None and step >= burst_from else 8 * (rank + 1)
    return batch(step, rank, size=size)


def train(state=None, steps=6, bucket_cap_mb=None, burst_from=None, sparse=False, bags=False):
    """``sparse``: the users table is nn.Embedding(sparse=True); ``bags``: models.BagModel on
    models.bag_batch (rank 0 lists no row). The reference (state None) is DDP's default allreduce, sparse
    gradients by Gloo's sparse allreduce."""
    torch.manual_seed(0)
    model = (BagModel() if bags else EmbeddingModel(sparse=sparse)).to(DEVICE)
    kw = {} if bucket_cap_mb is None else {"bucket_cap_mb": bucket_cap_mb}
    ddp = DistributedDataParallel(model, **kw)
    if state is not None:
        ddp.register_comm_hook(state, auto_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        if bags:
            bag_loss(ddp, bag_batch(step, dist.get_rank())).backward()
        else:
            loss_fn(ddp, rank_batch(step, dist.get_rank(), burst_from)).backward()
        opt.step()
    return model


def collectives(state=None) -> int:
    """Collectives issued so far on the default group and on ``state``'s own groups: the Gloo process
    groups' sequence numbers (each collective increments its group's)."""
    groups = [dist.group.WORLD] + (list(state._fallback_groups.values()) if state is not None else [])
    return sum(g._get_sequence_number_for_group() for g in groups)


def train_dense(state=None, steps=10, dtype=torch.float32, hook=auto_hook):
    """A dense model (every gradient dense on every rank), several buckets; the collectives of each step,
    and the bytes the hook allreduced (DDP's own allreduce, in C++, is not counted)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64), torch.nn.Tanh(),
                                torch.nn.Linear(64, 8)).to(dtype)
    ddp = DistributedDataParallel(model, bucket_cap_mb=0.01)   # 10 kB: two buckets after DDP's rebuild
    if hook is not auto_hook or state is not None:
        ddp.register_comm_hook(state, hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(dist.get_rank())
    per_step, sent = [], []
    for step in range(steps):
        before = collectives(state)
        opt.zero_grad(set_to_none=True)
        x = torch.randn(4 * (dist.get_rank() + 1), 32, generator=g).to(dtype)
        model_out = ddp(x)
        with CountedCollectives("all_reduce") as counted:
            (model_out.float() ** 2).mean().backward()   # DDP waits for every bucket's future (and callback) here
        sent.append(counted.bytes())
        opt.step()
        per_step.append(collectives(state) - before)
    return model, per_step, sent


def bf16_sum_hook(_, bucket):
    """DDP's bf16_compress_hook without its NCCL-only check and without dividing first (bfloat16 has float32's
    range): the bucket in bfloat16, summed, then divided in float32, as auto's bf16 plain steps do."""
    n = dist.get_world_size()
    fut = dist.all_reduce(bucket.buffer().to(torch.bfloat16), async_op=True).get_future()

    def average(fut):
        return bucket.buffer().copy_(fut.value()[0]).div_(n)
    return fut.then(average)


def compare(state, **kw):
    ref = train(None, **kw)
    got = train(state, **kw)
    st = state.stats()
    return {"max_diff": max_param_diff(ref, got), "digest": param_digest(got), "stats": st,
            "plan": {k: [v["strategy"], v["changes"]] for k, v in st["plan"].items()},
            "batched": {k: v["batched"] for k, v in st["plan"].items()},
            "sparse": [k for k, v in st["plan"].items() if v["sparse"]],
            "fallbacks": {k: v["fallbacks"] for k, v in st["plan"].items()},
            "calibration": state.spec.calibration.as_list()}


def lossy_gradient(step, rank):
    return torch.randn(128, 96, generator=torch.Generator().manual_seed(7919 * step + rank)).to(DEVICE)


def lossy_guard(dense_verdict, steps=12, dtype=torch.float32, strategy="topk"):
    """``auto_hook(lossy=True)`` with ``strategy`` plans (top-k or top-k allgathered: ratio 0.05, error feedback)
    under the step guard (one
    block of 2 steps per window from step 2: plans at 2 and 3, in place at 4 and 5, the first look at 6; a look
    for the plans is confirmed by plans at 6 and 7, in place at 8 and 9, the verdict at 10), forced by the margin.
    Conservation: n times the sum of the reduced (averaged) gradients plus every rank's error feedback
    left at the end equals the sum of every rank's gradients. ``dtype``: the model's (a float16 bucket is
    divided by n before it is encoded, so its memory is in the units of x_r / n)."""
    n, rank = dist.get_world_size(), dist.get_rank()
    model = LinearLoss((128, 96), DEVICE).to(dtype)
    ddp = DistributedDataParallel(model)
    state = AutoHookState(lossy=True, first=strategy, strategies=(strategy,), topk_ratio=0.05, lossy_min_bytes=0,
                          interval=2, calibration=Calibration.default(1e9), guard_steps=1, guard_start=2,
                          guard_margin=1 - 1e-6 if dense_verdict else -1e6)
    ddp.register_comm_hook(state, auto_hook)
    out_sum = torch.zeros(128, 96, dtype=torch.float64, device=DEVICE)
    for step in range(steps):
        model.weight.grad = None
        ddp(lossy_gradient(step, rank).to(dtype)).backward()
        out_sum += model.weight.grad.to(torch.float64)
    agg = next(iter(state._aggregators.values()))
    left = agg.take_lossy_memory()
    memory = torch.zeros_like(out_sum) if left is None else left.reshape(128, 96).to(torch.float64)
    if dtype == torch.float16:
        memory *= n   # held in the units of the divided bucket
    memories = [torch.empty_like(memory) for _ in range(n)]
    dist.all_gather(memories, memory)
    total = sum(lossy_gradient(t, r).to(dtype).to(torch.float64) for t in range(steps) for r in range(n))
    st = state.stats()
    return {"guard": st["guard"], "left": left is not None,
            "plain_steps": {k: v["plain_steps"] for k, v in st["plan"].items()},
            "plan": {k: v["strategy"] for k, v in st["plan"].items()},
            "conservation_error": float((n * out_sum + sum(memories) - total).abs().max()),
            "scale": float(total.abs().max())}


def lossy_guard_half(steps=12):
    """The step guard's dense window with ``lossy=True``, a dense verdict forced (trial as :func:`lossy_guard`:
    plans at 2 and 3, the dense window at 4 and 5, the verdict at 6): "in place" is what DDP's
    bf16_compress_hook sends. ``linear``: one 128 x 96 weight under top-k plans (bf16 allowed), its averaged
    gradient at every step, and the same gradients through :func:`bf16_sum_hook`. ``mixed``: the dense model of
    :func:`train_dense`, its two weights of 8 KiB or more (``lossy_min_bytes``) on top-k plans and the rest on
    exact ones, the bytes the hook allreduced per step."""
    n, rank = dist.get_world_size(), dist.get_rank()
    # a 1 Mbit/s link: the weights' plans stay top-k (bfloat16's twice the bytes of a 1% top-k would not pay)
    options = dict(lossy=True, first="topk", interval=2, calibration=Calibration.default(1e6), guard_steps=1,
                   guard_start=2, guard_margin=1 - 1e-6)
    grads = {}
    for label, make in (("hook", lambda: AutoHookState(strategies=("topk", "bf16"), lossy_min_bytes=0, **options)),
                        ("bf16", lambda: None)):
        model = LinearLoss((128, 96), DEVICE)
        ddp = DistributedDataParallel(model)
        state = make()
        ddp.register_comm_hook(state, auto_hook if state is not None else bf16_sum_hook)
        grads[label] = []
        for step in range(steps):
            model.weight.grad = None
            ddp(lossy_gradient(step, rank)).backward()
            grads[label].append(model.weight.grad.clone())
        if state is not None:
            guard = state.stats()["guard"]
    out = {"guard": guard, "same_as_bf16_hook": [bool(torch.equal(a, b)) for a, b in zip(grads["hook"], grads["bf16"])]}
    state = AutoHookState(strategies=("topk", "bf16", "dense"), lossy_min_bytes=8192, **options)
    got, _, sent = train_dense(state, steps=steps)
    st = state.stats()
    out["mixed"] = {"digest": param_digest(got), "sent": sent, "guard": st["guard"],
                    "plan": {k: v["strategy"] for k, v in st["plan"].items()}}
    out["n"] = n
    return out


def deferred_calibration(steps=10, dense_steps=4):
    """``auto_hook`` (exact, interval 2, no calibration given) on a 64-row table and a linear layer: every row in
    each rank's batch for ``dense_steps`` steps, then 2 rows a rank. The calibration's source after each step,
    the largest parameter difference from DDP's default allreduce, the plans."""
    def run(state):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Embedding(64, 8), torch.nn.Linear(8, 1)).to(DEVICE)
        ddp = DistributedDataParallel(model)
        if state is not None:
            ddp.register_comm_hook(state, auto_hook)
        opt, sources = torch.optim.SGD(model.parameters(), lr=0.1), []
        g = torch.Generator().manual_seed(dist.get_rank())
        for step in range(steps):
            opt.zero_grad(set_to_none=True)
            ids = torch.arange(64) if step < dense_steps else torch.randint(0, 64, (2,), generator=g)
            (ddp(ids.to(DEVICE)) ** 2).mean().backward()
            opt.step()
            if state is not None:
                sources.append(state.stats()["calibration"]["source"])
        return model, sources

    ref, _ = run(None)
    state = AutoHookState(interval=2)
    got, sources = run(state)
    st = state.stats()
    return {"max_diff": max_param_diff(ref, got), "digest": param_digest(got), "sources": sources,
            "plan": {k: [v["strategy"], v["changes"]] for k, v in st["plan"].items()},
            "calibration": state.spec.calibration.as_list()}


def scenario(name):
    if name == "measured":   # the start-up calibration on the process group, then exact training
        return compare(AutoHookState(interval=2), steps=6)
    if name == "replan":     # sparse, then a burst of density: the plan changes mid-training
        return compare(AutoHookState(interval=2, calibration=Calibration.default(1e9)), steps=10, burst_from=5)
    if name == "small_buckets":  # several buckets, each parameter planned inside its bucket's message
        return compare(AutoHookState(interval=2, calibration=Calibration.default(1e8)), steps=6, bucket_cap_mb=0.05)
    if name == "sparse_replan":   # sparse users table: planned over its listed rows, re-planned on the burst
        return compare(AutoHookState(interval=2, calibration=Calibration.default(1e9)), steps=10, burst_from=5,
                       sparse=True)
    if name.startswith("sparse_"):   # one exact strategy forced on every parameter, sparse bags included
        s = name[len("sparse_"):]
        return compare(AutoHookState(interval=2, first=s, strategies=(s,), calibration=Calibration.default(1e9)),
                       steps=6, bags=True)
    if name == "lossy":
        state = AutoHookState(lossy=True, interval=2, calibration=Calibration.default(1e8), lossy_min_bytes=0)
        got = train(state, steps=6)
        st = state.stats()
        return {"digest": param_digest(got), "plan": {k: [v["strategy"], v["changes"]] for k, v in st["plan"].items()}}
    if name == "dense_steady":   # dense plans: the statistics ride in the bucket's own allreduce
        ref, ref_steps, _ = train_dense(None)
        # every strategy a candidate, no calibration given: every gradient is non-zero in every row, so no
        # calibration could plan it off dense, and none is measured
        state = AutoHookState(interval=4)
        got, got_steps, _ = train_dense(state)
        st = state.stats()
        return {"max_diff": max_param_diff(ref, got), "digest": param_digest(got), "stats": st,
                "plan": {k: [v["strategy"], v["changes"]] for k, v in st["plan"].items()},
                "plain_steps": {k: v["plain_steps"] for k, v in st["plan"].items()},
                "calibration": None, "calibration_cost": st["calibration"],
                "collectives": got_steps, "ddp_collectives": ref_steps}
    if name == "deferred":   # a table whose gradient is dense for 4 steps, then 2 rows a rank: calibrated then
        return deferred_calibration()
    if name == "dense_steady_half":   # the same in bfloat16 and float16: plain steps in the buckets' dtype
        out = {}
        for dtype in (torch.bfloat16, torch.float16):
            ref, _, _ = train_dense(None, dtype=dtype)
            state = AutoHookState(interval=4, calibration=Calibration.default(1e9))
            got, got_steps, sent = train_dense(state, dtype=dtype)
            st = state.stats()
            out[str(dtype).split(".")[1]] = {
                "max_diff": max_param_diff(ref, got), "digest": param_digest(got), "sent": sent,
                "model_bytes": sum(p.numel() * p.element_size() for p in got.parameters()),
                "plan": {k: v["strategy"] for k, v in st["plan"].items()},
                "plain_steps": {k: v["plain_steps"] for k, v in st["plan"].items()}}
        return out
    if name == "half_plain":   # fp16 and bf16 plans: plain steps in half precision, as DDP's own hooks send
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook
        out = {}
        for strategy, hook in (("fp16", fp16_compress_hook), ("bf16", bf16_sum_hook)):
            ref, _, _ = train_dense(None, hook=hook)
            state = AutoHookState(lossy=True, first=strategy, strategies=(strategy,), lossy_min_bytes=0, interval=4,
                                  calibration=Calibration.default(1e9))
            got, got_steps, sent = train_dense(state)
            st = state.stats()
            out[strategy] = {
                "max_diff": max_param_diff(ref, got), "digest": param_digest(got), "sent": sent,
                "collectives": got_steps, "model_numel": sum(p.numel() for p in got.parameters()),
                "plan": {k: v["strategy"] for k, v in st["plan"].items()},
                "plain_steps": {k: v["plain_steps"] for k, v in st["plan"].items()}}
        # fp16 for the two larger weights (8 KiB or more), dense for the rest: buckets mixing the two plans'
        # plain steps go through the message (a float16 part beside a float32 one)
        ref, _, _ = train_dense(None)
        state = AutoHookState(lossy=True, strategies=("dense", "fp16"), lossy_min_bytes=8192, interval=4,
                              calibration=Calibration.default(1e7))
        got, _, sent = train_dense(state)
        st = state.stats()
        out["mixed"] = {"max_diff": max_param_diff(ref, got), "digest": param_digest(got), "sent": sent,
                        "plan": {k: v["strategy"] for k, v in st["plan"].items()},
                        "plain_steps": {k: v["plain_steps"] for k, v in st["plan"].items()}}
        return out
    if name in ("guard_dense", "guard_plan"):   # the step guard's trial, its verdict forced by the margin
        margin = 1 - 1e-6 if name == "guard_dense" else -1e6   # plans must be 1e6x faster / may be 1e6x slower
        state = AutoHookState(interval=2, calibration=Calibration.default(1e9), guard_steps=1, guard_start=2,
                              guard_margin=margin)
        out = compare(state, steps=12)
        out["guard"] = out["stats"]["guard"]
        out["plain_steps"] = {k: v["plain_steps"] for k, v in out["stats"]["plan"].items()}
        return out
    if name == "lossy_guard_half":   # with lossy, the dense window sends what bf16_compress_hook sends
        return lossy_guard_half()
    if name.startswith("lossy_guard_"):   # the guard over top-k plans, its verdict forced by the margin
        return lossy_guard(name.startswith("lossy_guard_dense"),
                           dtype=torch.float16 if name.endswith("_float16") else torch.float32,
                           strategy="topk_allgather" if name.endswith("_gather") else "topk")
    if name in ("config_mismatch", "guard_mismatch", "calibration_mismatch"):   # the options differ, the guard's,
        try:                                                                     # or the given calibration's numbers
            rank = dist.get_rank()
            state = (AutoHookState(lossy=rank == 1) if name == "config_mismatch" else
                     AutoHookState(guard_steps=0 if rank == 1 else 5) if name == "guard_mismatch" else
                     AutoHookState(calibration=Calibration.default(1e9 if rank == 1 else 1e8)))
            train(state, steps=1)
        except Exception as e:   # errors raised in a hook come back wrapped
            return {"error": type(e).__name__, "message": str(e)}
        return {"error": None}
    raise ValueError(f"unknown scenario {name}")


if __name__ == "__main__":
    gloo_scenarios.main(scenario)
