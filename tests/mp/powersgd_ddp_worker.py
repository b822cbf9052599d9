"""torch.distributed (Gloo) worker for tests/test_planner_powersgd.py: ``auto_hook(lossy=True)`` taking
torch's PowerSGD for buckets. Every rank writes OUT_DIR/<scenario>.rank<r>.json.

Scenarios:
* ``choice``: an MLP in several buckets on a slow link (given calibration): which buckets go to
  PowerSGD, the bytes and collectives each PowerSGD step issues on its bucket's group (every
  ``torch.distributed.all_reduce`` call is recorded by a wrapper that calls the real one), the
  replicas' digest.
* ``switch_guard_dense`` / ``switch_guard_plan``: one weight whose gradient on rank r at step t is a
  known matrix C(r, t) (the loss is linear in it); top-k with error feedback first, then PowerSGD, then
  the step guard's trial over the PowerSGD bucket with its verdict forced by the margin: what the
  error-feedback bookkeeping must conserve across the switch and either verdict.
* ``part``: a bucket of a table whose gradient has a few rows (allgather) and a weight (dense): PowerSGD
  takes the weight only; the table's average each step, the bytes PowerSGD's steps issue on their own
  group, and the weight's error feedback conserved through the step guard's dense verdict.
* ``part_guard_powersgd``: the same bucket with the step guard's verdict forced to PowerSGD (its third window,
  torch's hook on the whole bucket): the bucket adopts the trial's PowerSGD for good, the part's memory handed
  to it, and the table's and the weight's error feedback conserved through every window and the switch.
* ``resume_mid_trial``: the ``part`` model on a fast link (no PowerSGD of the planner's) saved (``torch.save(ddp)``)
  inside the step guard's PowerSGD window, loaded and trained on to a (forced) dense verdict: the trial's PowerSGD
  memory survives the save and goes out after the verdict, the table's and the weight's error feedback conserved.
* ``part_half``: the same with a long vector planned fp16 beside the weight: the weight's error feedback
  conserved (the vector's half-precision plain step leaves the bucket's PowerSGD part alone).
* ``converge``: a teacher-student regression trained with DDP's allreduce, torch's own PowerSGD hook
  (the bench's per-bucket baseline) and auto(lossy): the losses.
"""
import os
import sys
import threading

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, os.path.dirname(__file__))
import gloo_scenarios  # noqa: E402
from models import LinearLoss, confirm_every_guard_look, max_param_diff, param_digest  # noqa: E402

from lossless_hc.plugins.ddp import AutoHookState, Calibration, auto_hook  # noqa: E402
from lossless_hc.training.guard import VERDICT_CODES  # noqa: E402
confirm_every_guard_look()

SLOW = Calibration.default(bandwidth_bits=1e8)   # 100 Mbit/s, 50 us per hop

_calls = []   # (group, bytes) of every dist.all_reduce call in this process
_lock = threading.Lock()
_real_all_reduce = dist.all_reduce


def _recording_all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
    with _lock:
        _calls.append((group, tensor.numel() * tensor.element_size()))
    return _real_all_reduce(tensor, op=op, group=group, async_op=async_op)


def mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Tanh(), torch.nn.Linear(256, 256), torch.nn.Tanh(),
                               torch.nn.Linear(256, 16))


def data(step, rank, teacher):
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(32, 64, generator=g)
    with torch.no_grad():
        y = teacher(x)
    return x, y


def choice():
    model = mlp()
    ddp = DistributedDataParallel(model, bucket_cap_mb=0.2)   # several buckets
    state = AutoHookState(lossy=True, interval=2, calibration=SLOW)
    ddp.register_comm_hook(state, auto_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    teacher = torch.nn.Linear(64, 16)
    per_step = []
    dist.all_reduce = _recording_all_reduce
    try:
        for step in range(8):
            with _lock:
                _calls.clear()
            opt.zero_grad(set_to_none=True)
            x, y = data(step, dist.get_rank(), teacher)
            ((ddp(x) - y) ** 2).mean().backward()
            opt.step()
            with _lock:
                calls = list(_calls)
            # per PowerSGD bucket: the bytes of each all_reduce issued on its group this step
            per_step.append({str(i): [b for g, b in calls if g is state._fallback_groups.get(i)]
                             for i in state._powersgd.buckets})
    finally:
        dist.all_reduce = _real_all_reduce
    st = state.stats()
    lossy_model = model   # the replica the lossy run trained: what "digest" and "moved" describe
    exact = AutoHookState(lossy=False, interval=2, calibration=SLOW)   # the same model and link, exact
    exact_model = mlp()
    ddp = DistributedDataParallel(exact_model, bucket_cap_mb=0.2)
    ddp.register_comm_hook(exact, auto_hook)
    for step in range(6):
        exact_model.zero_grad(set_to_none=True)
        x, y = data(step, dist.get_rank(), teacher)
        ((ddp(x) - y) ** 2).mean().backward()
    ex = exact.stats()
    return {"plan": {k: v["strategy"] for k, v in st["plan"].items()}, "buckets": st["buckets"],
            "exact_plan": {k: v["strategy"] for k, v in ex["plan"].items()}, "exact_buckets": ex["buckets"],
            "per_step": per_step, "digest": param_digest(lossy_model),
            "moved": max_param_diff(lossy_model, mlp()),   # trained vs the seed-0 start
            "predicted_bytes": {str(i): [b for _, b in state.spec.cost_model.powersgd_collectives(c.layout)]
                                for i, c in state._powersgd.buckets.items()},
            "payload_bytes": st["payload_bytes"], "dense_bytes": st["dense_bytes"]}


def gradient(step, rank):
    return torch.randn(256, 192, generator=torch.Generator().manual_seed(7919 * step + rank))


def switch(dense_verdict):
    n, rank = dist.get_world_size(), dist.get_rank()
    model = LinearLoss((256, 192))
    ddp = DistributedDataParallel(model)
    # The switch to PowerSGD at step 2; the step guard's trial from step 3 (PowerSGD at 3 and 4, in place at 5
    # and 6), its first look at 7, forced by the margin (for the plans: confirmed by PowerSGD at 7 and 8, in
    # place at 9 and 10, the verdict at 11).
    state = AutoHookState(lossy=True, interval=2, calibration=SLOW, strategies=("topk", "powersgd"), lossy_min_bytes=0,
                          topk_ratio=0.05, guard_steps=1, guard_start=3,
                          guard_margin=1 - 1e-6 if dense_verdict else -1e6)
    ddp.register_comm_hook(state, auto_hook)
    steps = 12
    out_sum = torch.zeros(256, 192, dtype=torch.float64)
    residual_before = None
    for step in range(steps):
        model.weight.grad = None
        ddp(gradient(step, rank)).backward()
        out_sum += model.weight.grad.to(torch.float64)
        if step == 1:   # top-k's error feedback just before the bucket can switch (step index 2)
            agg = next(iter(state._aggregators.values()))
            residual_before = float(agg._topk.residual.norm())
    agg = next(iter(state._aggregators.values()))
    chosen = state._powersgd.buckets[0]
    error = chosen.error(0)   # None once the bucket left PowerSGD: its memory went out with step 7
    memory = torch.zeros(256, 192, dtype=torch.float64) if error is None else error.reshape(256, 192).to(torch.float64)
    left = agg.take_lossy_memory()   # None: flushed at the switch
    memories = [torch.empty_like(memory) for _ in range(n)]
    dist.all_gather(memories, memory)
    total = sum(gradient(t, r).to(torch.float64) for t in range(steps) for r in range(n))
    conserved = n * out_sum + sum(memories)
    st = state.stats()
    return {"plan": {k: [v["strategy"], v["changes"]] for k, v in st["plan"].items()}, "buckets": st["buckets"],
            "since_step": chosen.since_step, "residual_before": residual_before, "left": left is not None,
            "memory_left": error is not None, "steps": steps,
            "guard": st["guard"],
            "conservation_error": float((conserved - total).abs().max()), "scale": float(total.abs().max()),
            "digest": param_digest(model)}


class TableAndWeight(torch.nn.Module):
    """loss = sum(T * A) + sum(W * C): the gradients are A (a few rows of a table) and C (dense)."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(256, 192))
        self.table = torch.nn.Parameter(torch.zeros(2000, 64))

    def forward(self, a, c):
        return (self.table * a).sum() + (self.weight * c).sum()


def table_rows(step, rank):
    """A: 16 rows of small integers (sums and their division by n as exact as DDP's own)."""
    g = torch.Generator().manual_seed(104729 * step + rank)
    a = torch.zeros(2000, 64)
    a[torch.randperm(2000, generator=g)[:16]] = torch.randint(-8, 9, (16, 64), generator=g).float()
    return a


def part():
    n, rank = dist.get_world_size(), dist.get_rank()
    model = TableAndWeight()
    ddp = DistributedDataParallel(model)   # one bucket: table and weight
    # PowerSGD (the weight) from step 2; the step guard's trial from step 3 (the plans at 3 and 4, in place at 5
    # and 6, torch's hook on the whole bucket at 7 and 8, with a memory of its own), its dense verdict (forced) at
    # 9: the weight's PowerSGD memory and the trial's (the table's and the weight's) go out with step 9.
    state = AutoHookState(lossy=True, interval=2, calibration=SLOW, strategies=("dense", "allgather", "powersgd"),
                          guard_steps=1, guard_start=3, guard_margin=1 - 1e-6)
    ddp.register_comm_hook(state, auto_hook)
    steps = 10
    out_sum = torch.zeros(256, 192, dtype=torch.float64)
    table_sum = torch.zeros(2000, 64, dtype=torch.float64)
    table_errors, per_step = [], []
    dist.all_reduce = _recording_all_reduce
    try:
        for step in range(steps):
            with _lock:
                _calls.clear()
            model.zero_grad(set_to_none=True)
            ddp(table_rows(step, rank), gradient(step, rank)).backward()
            out_sum += model.weight.grad.to(torch.float64)
            expected = sum(table_rows(step, r) for r in range(n)) / n
            table_errors.append(float((model.table.grad - expected).abs().max()))
            table_sum += model.table.grad.to(torch.float64)
            with _lock:
                calls = list(_calls)
            group = state._fallback_groups.get((0, "powersgd"))   # made at the first PowerSGD step
            per_step.append([b for g, b in calls if group is not None and g is group])
    finally:
        dist.all_reduce = _real_all_reduce
    chosen = state._powersgd.buckets[0]
    st = state.stats()
    table_total = sum(table_rows(t, r).to(torch.float64) for t in range(steps) for r in range(n))
    return {"plan": {k: v["strategy"] for k, v in st["plan"].items()}, "buckets": st["buckets"], "guard": st["guard"],
            "table_errors": table_errors, "per_step": per_step, "memory_left": chosen.error(0) is not None,
            "trials_left": len(state._powersgd.trials),
            "table_conservation_error": float((n * table_sum - table_total).abs().max()),
            "predicted_bytes": [b for _, b in state.spec.cost_model.powersgd_collectives(chosen.layout)],
            **weight_conservation(state, out_sum, steps), "digest": param_digest(model)}


def weight_conservation(state, out_sum, steps):
    """What the weight's error feedback must conserve (bucket 0's PowerSGD on the (256, 192) weight, whose
    gradient on rank r at step t is gradient(t, r)): every rank's received averages times n plus every rank's
    PowerSGD memory equal the gradients' sum; its largest miss and the sum's scale."""
    n = dist.get_world_size()
    error = state._powersgd.buckets[0].error(0)
    memory = torch.zeros(256, 192, dtype=torch.float64) if error is None else error.reshape(256, 192).to(torch.float64)
    memories = [torch.empty_like(memory) for _ in range(n)]
    dist.all_gather(memories, memory)
    total = sum(gradient(t, r).to(torch.float64) for t in range(steps) for r in range(n))
    return {"conservation_error": float((n * out_sum + sum(memories) - total).abs().max()),
            "scale": float(total.abs().max()), "steps": steps}


def part_with_forced_look(look):
    """``part``'s model (one bucket: table and weight) under DDP and auto_hook, PowerSGD (the weight) from step 2,
    the step guard's trial from step 3 (the plans at 3 and 4, in place at 5 and 6, the whole bucket on PowerSGD at
    7 and 8), each look ``look(decide())``: ``(n, rank, model, ddp, state)``."""
    n, rank = dist.get_world_size(), dist.get_rank()
    model = TableAndWeight()
    ddp = DistributedDataParallel(model)
    state = AutoHookState(lossy=True, interval=2, calibration=SLOW, strategies=("dense", "allgather", "powersgd"),
                          guard_steps=1, guard_start=3)
    decide = state._guard.decide
    state._guard.decide = lambda: look(decide())
    ddp.register_comm_hook(state, auto_hook)
    return n, rank, model, ddp, state


def part_guard_powersgd():
    # The look at 9 forced to PowerSGD, confirmed by a second round (9 to 14), the verdict at 15: from then on the
    # whole bucket runs the trial's PowerSGD for good.
    n, rank, model, ddp, state = part_with_forced_look(lambda look: (VERDICT_CODES["powersgd"],) + tuple(look[1:]))
    steps = 18
    sums = {"weight": torch.zeros(256, 192, dtype=torch.float64), "table": torch.zeros(2000, 64, dtype=torch.float64)}
    table_errors, phases = [], []
    for step in range(steps):
        model.zero_grad(set_to_none=True)
        ddp(table_rows(step, rank), gradient(step, rank)).backward()
        phases.append(state._step_phase)
        sums["weight"] += model.weight.grad.to(torch.float64)
        sums["table"] += model.table.grad.to(torch.float64)
        expected = sum(table_rows(step, r) for r in range(n)) / n
        table_errors.append(float((model.table.grad - expected).abs().max()))
    chosen = state._powersgd.buckets[0]
    shapes = {"weight": (256, 192), "table": (2000, 64)}
    by_name = {name: next(k for k, v in shapes.items() if name.endswith(str(v).replace(" ", " ")))
               for name in chosen.bucket_names}
    memory = {k: torch.zeros(v, dtype=torch.float64) for k, v in shapes.items()}
    flat = chosen.error(0)
    sizes = [memory[by_name[name]].numel() for name in chosen.bucket_names]
    for name, e in zip(chosen.bucket_names, torch.split(flat, sizes)):
        memory[by_name[name]] += e.reshape(shapes[by_name[name]]).to(torch.float64)
    errors = {}
    for key, fn in (("weight", gradient), ("table", table_rows)):
        memories = [torch.empty_like(memory[key]) for _ in range(n)]
        dist.all_gather(memories, memory[key])
        total = sum(fn(t, r).to(torch.float64) for t in range(steps) for r in range(n))
        errors[key] = float((n * sums[key] + sum(memories) - total).abs().max())
    st = state.stats()
    return {"plan": {k: v["strategy"] for k, v in st["plan"].items()}, "buckets": st["buckets"], "guard": st["guard"],
            "phases": phases, "table_errors": table_errors, "trials_left": len(state._powersgd.trials),
            "whole": chosen.members is None, "since_step": chosen.since_step, "powersgd_steps": chosen.steps,
            "conservation_errors": errors, "scale": float(gradient(0, 0).abs().max()) * n, "steps": steps,
            "digest": param_digest(model)}


def part_guard_plan():
    """``part`` with the step guard's look forced to the plans (not decisive: a confirmation round, the verdict
    at 15): the trial's PowerSGD memory of the whole bucket (the table's too: rows of steps 7, 8, 13 and 14)
    goes out with step 15, and the table's allgather plan does not count those rows as that step's statistics
    (AutoAggregator.carry_memory): its per-rank count stays the 16 rows every step has."""
    # the plans, with every window's median alike: a look that needs its confirmation round
    n, rank, model, ddp, state = part_with_forced_look(
        lambda look: (VERDICT_CODES["plan"], 1.0, 1.0) + tuple(look[3:5]) + (1.0, float("nan")))
    steps = 17
    table_sum = torch.zeros(2000, 64, dtype=torch.float64)
    phases, counts = [], []
    for step in range(steps):
        model.zero_grad(set_to_none=True)
        ddp(table_rows(step, rank), gradient(step, rank)).backward()
        phases.append(state._step_phase)
        table_sum += model.table.grad.to(torch.float64)
        table = next(a for a in state._aggregators.values() if a.name.startswith("param1"))
        counts.append([max(table.tracker.rank_keys), table.tracker.peak_rank])
    total = sum(table_rows(t, r).to(torch.float64) for t in range(steps) for r in range(n))
    st = state.stats()
    return {"guard": st["guard"], "phases": phases, "counts": counts, "trials_left": len(state._powersgd.trials),
            "plan": {k: v["strategy"] for k, v in st["plan"].items()},
            "table_conservation_error": float((n * table_sum - total).abs().max())}


class WeightAndVector(torch.nn.Module):
    """loss = sum(W * C) + sum(v * d): the gradients are C (a matrix) and d (a vector PowerSGD cannot take)."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(256, 192))
        self.vector = torch.nn.Parameter(torch.zeros(100_000))

    def forward(self, c, d):
        return (self.weight * c).sum() + (self.vector * d).sum()


def vector_gradient(step, rank):
    return torch.randn(100_000, generator=torch.Generator().manual_seed(6007 * step + rank))


def part_half():
    """One bucket of a weight (PowerSGD) and a vector planned fp16: the vector's half-precision plain step
    must not take the bucket's PowerSGD part with it (the whole buffer allreduced in fp16). The weight's
    error feedback is conserved only if PowerSGD's approximation is what the weight received."""
    rank = dist.get_rank()
    model = WeightAndVector()
    ddp = DistributedDataParallel(model)   # one bucket: weight and vector
    state = AutoHookState(lossy=True, interval=2, calibration=SLOW, strategies=("dense", "fp16", "powersgd"))
    ddp.register_comm_hook(state, auto_hook)
    steps = 6
    out_sum = torch.zeros(256, 192, dtype=torch.float64)
    for step in range(steps):
        model.zero_grad(set_to_none=True)
        ddp(gradient(step, rank), vector_gradient(step, rank)).backward()
        out_sum += model.weight.grad.to(torch.float64)
    st = state.stats()
    return {"plan": {k: v["strategy"] for k, v in st["plan"].items()}, "buckets": st["buckets"],
            **weight_conservation(state, out_sum, steps), "digest": param_digest(model)}


def converge():
    teacher = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Tanh(), torch.nn.Linear(32, 16))
    losses = {}
    states = {}
    for mode in ("none", "torch_powersgd", "auto_lossy"):
        model = mlp()
        ddp = DistributedDataParallel(model, bucket_cap_mb=0.2)
        if mode == "torch_powersgd":
            from lossless_hc.bench.workloads.baselines import PowerSGDPerBucket, powersgd_hook
            ddp.register_comm_hook(PowerSGDPerBucket(matrix_approximation_rank=4, start_powerSGD_iter=2,
                                                     min_compression_rate=2, random_seed=0), powersgd_hook)
        elif mode == "auto_lossy":
            # No step guard: this compares PowerSGD's convergence, which a dense verdict would leave.
            states[mode] = AutoHookState(lossy=True, calibration=SLOW, guard_steps=0)
            ddp.register_comm_hook(states[mode], auto_hook)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        curve = []
        for step in range(60):
            opt.zero_grad(set_to_none=True)
            x, y = data(step, dist.get_rank(), teacher)
            loss = ((ddp(x) - y) ** 2).mean()
            loss.backward()
            opt.step()
            t = loss.detach().clone()
            dist.all_reduce(t)
            curve.append(float(t) / dist.get_world_size())
        losses[mode] = curve
    st = states["auto_lossy"].stats()
    return {"losses": losses, "plan": {k: v["strategy"] for k, v in st["plan"].items()}, "buckets": st["buckets"]}


class TwoWeights(torch.nn.Module):
    """loss = sum(A * C_a) + sum(B * C_b): the gradients are C_a and C_b, whatever the weights. B's product is
    made last, so its gradient is ready first (as a Sequential's last layer's): DDP's rebuilt bucket lists B
    first, while a model loaded from torch.save runs its first step with A first (registration order)."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Parameter(torch.zeros(256, 192))
        self.b = torch.nn.Parameter(torch.zeros(192, 128))

    def forward(self, ca, cb):
        return (self.a * ca).sum() + (self.b * cb).sum()


def two_gradients(step, rank):
    g = torch.Generator().manual_seed(7919 * step + rank)
    return torch.randn(256, 192, generator=g), torch.randn(192, 128, generator=g)


def saved_and_loaded(ddp):
    """``torch.save(ddp)`` read back by ``torch.load``, its hook state registered again, as a resumed run does:
    ``(ddp, state)``."""
    import io
    buf = io.BytesIO()
    torch.save(ddp, buf)
    buf.seek(0)
    ddp = torch.load(buf, weights_only=False)
    state = ddp._comm_hooks[0][1]
    ddp.register_comm_hook(state, auto_hook)
    return ddp, state


def resume():
    """PowerSGD from step 2, torch.save(ddp) after step 4, the loaded model trained on from step 5 (its first
    step in place, its buckets rebuilt after it: PowerSGD again from step 6). What it reports: the buckets,
    and n x (sum of the averaged gradients) + every rank's PowerSGD memory against the sum of every gradient."""
    n, rank = dist.get_world_size(), dist.get_rank()
    ddp = DistributedDataParallel(TwoWeights())
    state = AutoHookState(lossy=True, interval=2, calibration=SLOW, strategies=("dense", "powersgd"), guard_steps=0)
    ddp.register_comm_hook(state, auto_hook)
    steps, saved_at = 10, 5
    out_sum = {"a": torch.zeros(256, 192, dtype=torch.float64), "b": torch.zeros(192, 128, dtype=torch.float64)}
    before = None
    for step in range(steps):
        if step == saved_at:
            before = state.stats()["buckets"]
            ddp, state = saved_and_loaded(ddp)
        ddp.module.zero_grad(set_to_none=True)
        ddp(*two_gradients(step, rank)).backward()
        for name, p in ddp.module.named_parameters():
            out_sum[name] += p.grad.to(torch.float64)
    names = {agg.name: name for p, agg in state._aggregators.items()
             for name, q in ddp.module.named_parameters() if q is p}
    memory = {name: torch.zeros_like(t) for name, t in out_sum.items()}
    for index, chosen in state._powersgd.buckets.items():
        error = chosen.error(index)
        if error is None:
            continue
        taken = [names[b] for b in chosen.names]
        for name, e in zip(taken, torch.split(error, [out_sum[t].numel() for t in taken])):
            memory[name] += e.reshape(out_sum[name].shape).to(torch.float64)
    error = 0.0
    scale = 0.0
    for i, name in enumerate(("a", "b")):
        memories = [torch.empty_like(memory[name]) for _ in range(n)]
        dist.all_gather(memories, memory[name])
        total = sum(two_gradients(t, r)[i].to(torch.float64) for t in range(steps) for r in range(n))
        error = max(error, float((n * out_sum[name] + sum(memories) - total).abs().max()))
        scale = max(scale, float(total.abs().max()))
    return {"before": before, "after": state.stats()["buckets"], "steps": steps, "conservation_error": error,
            "scale": scale, "digest": param_digest(ddp.module)}


def resume_mid_trial():
    n, rank = dist.get_world_size(), dist.get_rank()
    ddp = DistributedDataParallel(TableAndWeight())   # one bucket: table and weight
    # A 10 Gbit/s link: the weight dense, the table on allgather, no PowerSGD of the planner's (so the trial's state
    # alone makes the loaded model's first step settle). The trial from step 3 (the plans at 3 and 4, in place at
    # 5 and 6, the whole bucket on PowerSGD at 7 and 8); saved after step 7, the loaded model's first step (8) in
    # place, its bucket rebuilt after it; the (forced) dense verdict at 9: the trial's memory goes out with step 9.
    state = AutoHookState(lossy=True, interval=2, calibration=Calibration.default(bandwidth_bits=1e10),
                          strategies=("dense", "allgather", "powersgd"), guard_steps=1, guard_start=3,
                          guard_margin=1 - 1e-6)
    ddp.register_comm_hook(state, auto_hook)
    steps, saved_at = 12, 8
    sums = {"weight": torch.zeros(256, 192, dtype=torch.float64), "table": torch.zeros(2000, 64, dtype=torch.float64)}
    trials_saved, table_errors = None, []
    for step in range(steps):
        if step == saved_at:
            trials_saved = sorted(state._powersgd.trials)
            ddp, state = saved_and_loaded(ddp)
        ddp.module.zero_grad(set_to_none=True)
        ddp(table_rows(step, rank), gradient(step, rank)).backward()
        sums["weight"] += ddp.module.weight.grad.to(torch.float64)
        sums["table"] += ddp.module.table.grad.to(torch.float64)
        expected = sum(table_rows(step, r) for r in range(n)) / n
        table_errors.append(float((ddp.module.table.grad - expected).abs().max()))
    errors = {}
    for key, fn in (("weight", gradient), ("table", table_rows)):
        total = sum(fn(t, r).to(torch.float64) for t in range(steps) for r in range(n))
        errors[key] = float((n * sums[key] - total).abs().max())   # every memory has gone out
    st = state.stats()
    return {"trials_saved": trials_saved, "trials_left": len(state._powersgd.trials), "guard": st["guard"],
            "buckets": st["buckets"], "plan": {k: v["strategy"] for k, v in st["plan"].items()},
            "table_errors": table_errors, "conservation_errors": errors,
            "scale": float(gradient(0, 0).abs().max()) * n, "steps": steps, "digest": param_digest(ddp.module)}


def scenario(name: str) -> dict:
    return {"choice": choice, "switch_guard_dense": lambda: switch(True), "switch_guard_plan": lambda: switch(False),
            "part": part, "part_guard_powersgd": part_guard_powersgd, "part_guard_plan": part_guard_plan,
            "part_half": part_half, "converge": converge,
            "resume": resume, "resume_mid_trial": resume_mid_trial}[name]()


if __name__ == "__main__":
    gloo_scenarios.main(scenario)
