"""torch.distributed (Gloo) worker for tests/test_plugins_ddp.py, started by torch.multiprocessing.

``LHC_TEST_DEVICE=cuda``: the model and batches on GPU 0 for every rank (Gloo carries CUDA tensors).
Each scenario trains the same model twice from the same seed on the same per-rank batches, once with
DDP's default allreduce and once with the lossless hook; every rank writes
OUT_DIR/<scenario>.rank<r>.json with what the test asserts.
"""
import copy
import gc
import os
import pickle
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, os.path.dirname(__file__))
import gloo_scenarios  # noqa: E402
from models import (DEVICE, CountedCollectives, EmbeddingModel, batch, books, books_check,  # noqa: E402
                    half_precision_error, loss_fn, max_param_diff, own_gradients, param_digest, residual_copies)
import inexact_case  # noqa: E402

from lossless_hc.training.aggregate import ConfigurationMismatch  # noqa: E402
from lossless_hc.training.capacity import CapacityPolicy  # noqa: E402
from lossless_hc.plugins.ddp import (AutoHookState, Calibration, LosslessHookState, THCHookState,  # noqa: E402
                                     TopKHookState, auto_hook, lossless_hook, thc_hook, topk_hook)

STEPS = 6


def train(state=None, steps=STEPS, sparse=False, bucket_cap_mb=None, hidden=16, hook=lossless_hook, lr=0.1,
          process_group=None, compiled=False, uneven=False, **ddp_options):
    """``uneven``: rank r trains ``steps - 2 r`` steps inside ``ddp.join()`` (DDP's uneven inputs: a rank
    that ran out shadows the others' collectives, through the hook, with zero gradients);
    ``ddp_options``: DistributedDataParallel's own (static_graph, gradient_as_bucket_view)."""
    torch.manual_seed(0)
    model = EmbeddingModel(sparse=sparse, hidden=hidden).to(DEVICE)
    kw = {} if bucket_cap_mb is None else {"bucket_cap_mb": bucket_cap_mb}
    ddp = DistributedDataParallel(model, process_group=process_group, **kw, **ddp_options)
    if state is not None:
        ddp.register_comm_hook(state, hook)
    forward = torch.compile(ddp) if compiled else ddp
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    rank = dist.get_rank()
    with ddp.join(enable=uneven):
        for step in range(max(0, steps - 2 * rank) if uneven else steps):
            opt.zero_grad(set_to_none=True)
            loss_fn(forward, batch(step, rank)).backward()
            opt.step()
    return model


def residuals(state, params) -> list:
    """Each parameter's top-k residual, copied (models.residual_copies)."""
    aggs = [state._aggregators.get(p) for p in params]
    return residual_copies([a.residual if a is not None else None for a in aggs], params)


def topk_conserved(steps=4, hidden=512, lr=0.1):
    """Top-k (5%) through topk_hook, ``hidden`` large enough that top-k beats sending the dense layer.
    At the last step, error feedback's books, checked outside the hook: what the hook returned (each
    parameter's .grad after backward, which DDP fills from the hook's bucket) must be
    sum_r (g_r + residual_before_r - residual_after_r) / n, where g_r is this rank's own gradient (the
    same backward on a plain copy of the module) and the sum over ranks a plain dist.all_reduce of the
    books in float64. Also the parameters' digest after the steps (the replicas must decode the same bits)."""
    state = TopKHookState(ratio=0.05)
    torch.manual_seed(0)
    model = EmbeddingModel(hidden=hidden).to(DEVICE)
    ddp = DistributedDataParallel(model)
    ddp.register_comm_hook(state, topk_hook)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    rank, n = dist.get_rank(), dist.get_world_size()
    params = list(model.parameters())
    for step in range(steps):
        check = step == steps - 1
        if check:
            grads, before = own_gradients(model, hidden, batch(step, rank)), residuals(state, params)
        opt.zero_grad(set_to_none=True)
        loss_fn(ddp, batch(step, rank)).backward()
        if check:
            applied = torch.cat([p.grad.detach().double().reshape(-1) for p in params])
            after = residuals(state, params)
            summed = books(grads, before, after)
            dist.all_reduce(summed)   # outside the hook, for the check only
            rtol = max(a.codec.rtol for a in state._aggregators.values() if a.codec is not None)
            conservation = books_check(applied, summed[0] / n, summed[1] / n, rtol)
        opt.step()
    return {"stats": state.stats(), "digest": param_digest(model),
            "residual_norms": [float(a.residual.norm()) for a in state._aggregators.values() if a.residual is not None],
            "conservation": conservation}


def compare(state, **kw):
    ref = train(None, **kw)
    got = train(state, **kw)
    return {"max_diff": max_param_diff(ref, got), "stats": state.stats(),
            "capacity": [a.capacity for a in state._aggregators.values()]}


def expect_error(fn, exc):
    try:
        fn()
    except exc as e:
        return {"error": type(e).__name__, "message": str(e)}
    except Exception as e:  # errors raised in a hook's future come back wrapped
        return {"error": type(e).__name__, "message": str(e)}
    return {"error": None}


def close_and_continue(steps=8, close_at=4):
    """A lossless state on small buckets (each bucket's fallback group made at its first fallback), closed
    after ``close_at`` steps and trained on: the descriptors its groups held are released, the next
    steps make the groups again, and the result is DDP's own."""
    def descriptors():
        return len(os.listdir("/proc/self/fd"))

    def descriptors_once_settled(limit, wait_s=5.0):
        """The count once torch's teardown of the destroyed groups has run (at most ``wait_s``): Gloo
        closes a group's sockets from its own threads, and a group still held by a reference cycle goes
        at the next collection. A leak stays above ``limit`` however long this waits."""
        deadline = time.monotonic() + wait_s
        while True:
            gc.collect()
            n = descriptors()
            if n <= limit or time.monotonic() > deadline:
                return n
            time.sleep(0.05)
    ref = train(None, steps=steps, bucket_cap_mb=0.05)
    torch.manual_seed(0)
    model = EmbeddingModel(hidden=16).to(DEVICE)
    ddp = DistributedDataParallel(model, bucket_cap_mb=0.05)
    state = LosslessHookState(max_density=0.001)
    ddp.register_comm_hook(state, lossless_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before, groups, after = descriptors(), 0, None
    for step in range(steps):
        if step == close_at:
            groups = len(state._fallback_groups)
            state.close()
            after = descriptors_once_settled(before)
        opt.zero_grad(set_to_none=True)
        loss_fn(ddp, batch(step, dist.get_rank())).backward()
        opt.step()
    return {"max_diff": max_param_diff(ref, model), "groups": groups, "groups_again": len(state._fallback_groups),
            "descriptors": [before, after], "stats": state.stats()}


def one_parameter_saved_and_loaded():
    """A DDP model of one parameter under lossless_hook, one step, then saved and loaded whole (torch.save of
    the DDP module pickles its comm hook's state): the loaded model, its restored hook state (None where this
    torch does not pickle it) and the state it was saved with."""
    import io
    torch.manual_seed(0)
    ddp = DistributedDataParallel(torch.nn.Linear(4, 1, bias=False).to(DEVICE))
    state = LosslessHookState(max_density=0.5)
    ddp.register_comm_hook(state, lossless_hook)
    ddp(torch.ones(2, 4, device=DEVICE)).sum().backward()
    buf = io.BytesIO()
    torch.save(ddp, buf)
    buf.seek(0)
    restored = torch.load(buf, weights_only=False)
    hooks = getattr(restored, "_comm_hooks", None) or [(None, None)]   # DDP's (hook, state) pairs
    return restored, hooks[0][1], state


def scenario(name):
    if name == "close":
        return close_and_continue()
    if name == "average":
        return compare(LosslessHookState(max_density=0.05))
    if name == "small_buckets":  # several buckets, each with its own fallback group
        return compare(LosslessHookState(max_density=0.001), bucket_cap_mb=0.05)
    if name == "fallback":
        return compare(LosslessHookState(max_density=0.001))
    if name == "policy":  # adaptive capacity: shrinks from 5% to what the batches use, identically on all ranks
        state = LosslessHookState(max_density=0.05, policy=CapacityPolicy(interval=4))
        r = compare(state, steps=24)
        aggs = [a for a in state._aggregators.values() if getattr(a, "tracker", None) is not None]
        r["history"] = [a.tracker.history for a in aggs]
        r["union_capacity"] = [a.union_capacity for a in aggs]
        r["index"] = [a.codec.index_kind if a.codec is not None else "dense" for a in aggs]
        return r
    if name == "topk":
        return topk_conserved()
    if name == "thc":
        state = THCHookState(bits=4)
        ref = train(None, steps=16, hidden=512, lr=0.02)
        got = train(state, steps=16, hidden=512, hook=thc_hook, lr=0.02)
        # The same run with every tensor decoded into a fresh output and copied into the bucket (the
        # hook decodes into the bucket's slices): the same bits.
        import lossless_hc.plugins.ddp as ddp_plugin
        into_bucket, ddp_plugin.in_place_outputs = ddp_plugin.in_place_outputs, lambda *args: None
        try:
            copied = train(THCHookState(bits=4), steps=16, hidden=512, hook=thc_hook, lr=0.02)
        finally:
            ddp_plugin.in_place_outputs = into_bucket
        torch.manual_seed(0)
        start = EmbeddingModel(hidden=512).to(DEVICE)
        moved = [torch.cat([(p - q).reshape(-1) for p, q in zip(m.parameters(), start.parameters())]).detach()
                 for m in (ref, got)]
        return {"stats": state.stats(), "digest": param_digest(got), "digest_copied": param_digest(copied),
                "cosine": float(torch.nn.functional.cosine_similarity(moved[0], moved[1], dim=0))}
    if name == "thc_exact":  # THCHookState(exact=[...]): those gradients are the exact dense average, the others THC's
        return thc_exact(steps=3)
    if name == "thc_amp":  # non_finite="propagate" with AMP's GradScaler: an Inf on one rank skips the step everywhere
        return thc_with_grad_scaler(inject_step=3, steps=8)
    if name == "exact_amp":  # the same with the exact hooks: a non-finite input falls back to DDP's dense SUM
        return {key: thc_with_grad_scaler(3, 8, state, hook) for key, state, hook in exact_hooks()}
    if name == "lossy_amp":  # top-k (its error feedback) and auto's lossy plans (THC, top-k) under the scaler
        slow = Calibration.default(1e8)
        return {"topk": thc_with_grad_scaler(3, 8, TopKHookState(ratio=0.05), topk_hook),
                **{f"auto_{s}": thc_with_grad_scaler(3, 8, AutoHookState(lossy=True, first=s, strategies=(s,),
                                                                         interval=2, calibration=slow), auto_hook)
                   for s in ("thc", "topk")}}
    if name == "pickle":  # torch.save(ddp_model) with our hook registered (DDP pickles the hook state)
        import io
        torch.manual_seed(0)
        model = EmbeddingModel()
        ddp = DistributedDataParallel(model)
        state = LosslessHookState(max_density=0.05)
        ddp.register_comm_hook(state, lossless_hook)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(2):
            opt.zero_grad(set_to_none=True)
            loss_fn(ddp, batch(step, dist.get_rank())).backward()
            opt.step()
        buf = io.BytesIO()
        torch.save(ddp, buf)
        buf.seek(0)
        restored = torch.load(buf, weights_only=False)
        hooks = getattr(restored, "_comm_hooks", None) or [(None, None)]   # DDP's (hook, state) pairs
        hook_state = hooks[0][1]
        group_dropped = hook_state is not None and hook_state.process_group is None and not hook_state._fallback_groups
        # torch rebuilds a loaded DDP's reducer without its hook: registered again, the restored state
        # carries on (its fallback groups re-created on the default group).
        before = hook_state.stats()["tensors"] if hook_state is not None else 0
        if hook_state is not None:
            restored.register_comm_hook(hook_state, lossless_hook)
        opt2 = torch.optim.SGD(restored.module.parameters(), lr=0.1)
        loss_fn(restored, batch(2, dist.get_rank())).backward()
        opt2.step()
        after = hook_state.stats()["tensors"] if hook_state is not None else 0
        return {"error": None, "restored_state": type(hook_state).__name__,
                "aggregators": len(hook_state._aggregators) if hook_state is not None else -1,
                "group_dropped": group_dropped,
                "world_size": hook_state.world_size if hook_state is not None else -1,
                "tensors_after_restore": after - before}
    if name == "pickle_one_parameter":   # the model's only aggregator restored: it matches, and trains on
        restored, hook_state, _ = one_parameter_saved_and_loaded()
        if hook_state is None:
            return {"restored_state": "NoneType"}
        aggregators = len(hook_state._aggregators)
        restored.register_comm_hook(hook_state, lossless_hook)
        restored(torch.ones(2, 4, device=DEVICE)).sum().backward()
        return {"restored_state": type(hook_state).__name__, "aggregators": aggregators,
                "grad": restored.module.weight.grad.tolist(), "tensors": hook_state.stats()["tensors"]}
    if name == "restored_on_one_rank":   # rank 0 the loaded state, the others a copy pickled apart from the model
        restored, hook_state, state = one_parameter_saved_and_loaded()
        if hook_state is None:
            return {"restored_state": "NoneType"}
        if dist.get_rank() != 0:
            hook_state = pickle.loads(pickle.dumps(state))
        restored.register_comm_hook(hook_state, lossless_hook)
        return expect_error(lambda: restored(torch.ones(2, 4, device=DEVICE)).sum().backward(), ConfigurationMismatch)
    if name == "inexact":   # keys the decoder reports inexact, re-aggregated alone (tests/mp/inexact_case.py)
        return inexact()
    if name == "config_mismatch":
        return expect_error(lambda: train(LosslessHookState(max_density=0.05 if dist.get_rank() else 0.02), steps=1),
                            ConfigurationMismatch)
    if name == "unused_accumulation":
        return unused_and_accumulation()
    if name == "half_precision":
        out = {str(dtype).split(".")[1]: half_precision(dtype) for dtype in (torch.bfloat16, torch.float16)}
        # 139k coordinates of dense layers: sent as they are after the first step's growth, in a part of
        # their own dtype (message.py)
        out.update({f"{str(dtype).split('.')[1]}_wide": half_precision(dtype, hidden=8192, lr=0.01)
                    for dtype in (torch.bfloat16, torch.float16)})
        return out
    if name == "float16_large":
        return float16_large()
    if name == "compiled":
        return compiled()
    if name == "ddp_options":   # static_graph, gradient_as_bucket_view (the gradients are views of the buckets)
        out = {}
        for option in ("static_graph", "gradient_as_bucket_view"):
            ref = train(None, **{option: True})
            for key, state, hook in exact_hooks():
                got = train(state, hook=hook, **{option: True})
                out[f"{option}_{key}"] = {"max_diff": max_param_diff(ref, got), "stats": state.stats()}
        # THC decodes into the buckets' slices: with gradient_as_bucket_view those are the gradients
        plain, viewed = train(THCHookState(bits=4), hook=thc_hook), train(THCHookState(bits=4), hook=thc_hook,
                                                                          gradient_as_bucket_view=True)
        out["thc_view_digests"] = [param_digest(plain), param_digest(viewed)]
        return out
    if name == "uneven":   # ddp.join(): the ranks run out of batches at different steps
        ref = train(None, uneven=True)
        out = {}
        for key, state, hook in exact_hooks():
            out[key] = {"max_diff": max_param_diff(ref, train(state, hook=hook, uneven=True)), "stats": state.stats()}
        return out
    if name == "subgroups":
        return subgroups()
    if name == "sparse":
        return expect_error(lambda: train(LosslessHookState(), sparse=True, steps=1), TypeError)
    if name == "thc_exact_mismatch":   # THCHookState(exact=...) naming different parameters on the ranks
        def run():
            torch.manual_seed(0)
            model = EmbeddingModel(hidden=512)
            ddp = DistributedDataParallel(model)
            params = list(model.parameters())
            state = THCHookState(exact=[params[0]] if dist.get_rank() == 0 else [params[1]])
            ddp.register_comm_hook(state, thc_hook)
            loss_fn(ddp, batch(0, dist.get_rank())).backward()
        return expect_error(run, ConfigurationMismatch)
    if name == "rank0_group":   # rank 0 in one more group than the others (its own logging group, say)
        dist.new_group(ranks=[0])
        return compare(LosslessHookState(max_density=0.05))
    if name == "restored_apart":   # a hook state unpickled without its DDP model, registered on another model
        def run():
            state = TopKHookState(ratio=0.05)
            train(state, steps=2, hook=topk_hook)
            restored = pickle.loads(pickle.dumps(state))
            train(restored, steps=1, hook=topk_hook)
        return expect_error(run, ValueError)
    if name == "restored_other_size":   # a hook state restored on a group of another world size
        state = LosslessHookState(max_density=0.05)
        train(state, steps=2)
        restored = pickle.loads(pickle.dumps(state))
        size = dist.get_world_size()
        sub = dist.new_group(ranks=list(range(size - 1)))   # every rank creates it; rank size-1 is not in it
        if dist.get_rank() == size - 1:
            return {"error": None, "not_member": True}
        restored.process_group = sub
        return expect_error(lambda: train(restored, steps=1, process_group=sub), ValueError)
    if name == "thc_exact_unmatched":   # THCHookState(exact=...) naming a copy's parameter: that layer would be THC'd
        def run():
            torch.manual_seed(0)
            model = EmbeddingModel(hidden=512)
            ddp = DistributedDataParallel(model)
            state = THCHookState(exact=[model.users.weight, copy.deepcopy(model).fc1.weight])
            ddp.register_comm_hook(state, thc_hook)
            loss_fn(ddp, batch(0, dist.get_rank())).backward()
        return expect_error(run, ValueError)
    raise ValueError(f"unknown scenario {name}")


class PartlyUsedModel(EmbeddingModel):
    """EmbeddingModel with a layer never used and a table used at even steps only: DDP needs
    find_unused_parameters=True, and hands the hook zeros for the parameters a step did not use."""

    def __init__(self):
        super().__init__()
        self.unused = torch.nn.Linear(16, 1)
        self.even_steps = torch.nn.Embedding(5000, 8)

    def forward(self, u, i, step):
        out = super().forward(u, i)
        return out + self.even_steps(u).sum(-1) if step % 2 == 0 else out


def unused_and_accumulation(steps=STEPS, micro=3):
    """find_unused_parameters=True with gradient accumulation: the first ``micro - 1`` backward passes
    of a step under no_sync (no hook), the last one reduced through the hook."""
    def run(state):
        torch.manual_seed(0)
        model = PartlyUsedModel().to(DEVICE)
        ddp = DistributedDataParallel(model, find_unused_parameters=True)
        if state is not None:
            ddp.register_comm_hook(state, lossless_hook)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(steps):
            opt.zero_grad(set_to_none=True)
            for m in range(micro):
                u, i, y = batch(micro * step + m, dist.get_rank())
                if m < micro - 1:
                    with ddp.no_sync():
                        torch.nn.functional.mse_loss(ddp(u, i, step), y).backward()
                else:
                    torch.nn.functional.mse_loss(ddp(u, i, step), y).backward()
            opt.step()
        return model

    state = LosslessHookState(max_density=0.05)
    ref, got = run(None), run(state)
    return {"max_diff": max_param_diff(ref, got), "stats": state.stats(),
            "capacity": [a.capacity for a in state._aggregators.values()]}


def subgroups():
    """Four ranks, two DDP groups ({0, 1} and {2, 3}) configured differently: the first over capacity
    at every step (dense fallbacks, through fallback groups its ranks make alone), the second within
    capacity; then auto on each, its calibration measured on its own group (the second's root is global
    rank 2). Each must equal DDP's allreduce on its own group, and neither may wait for the other's
    collectives."""
    rank = dist.get_rank()
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    group = rank // 2
    pg = groups[group]
    ref = train(None, process_group=pg)
    out = {"group": group}
    first = LosslessHookState(process_group=pg, max_density=0.001 if group == 0 else 0.05)
    second = AutoHookState(process_group=pg)
    for key, state in (("first", first), ("second", second)):
        got = train(state, hook=auto_hook if isinstance(state, AutoHookState) else lossless_hook, process_group=pg)
        out[key] = {"max_diff": max_param_diff(ref, got), "stats": state.stats()}
    # The hooks made their groups as members of their own DDP group only: a group every rank makes
    # afterwards still pairs the same ranks on every rank
    world = dist.new_group(backend="gloo")
    t = torch.ones(1)
    dist.all_reduce(t, group=world)
    out["world_sum"] = float(t)
    return out


def inexact():
    """Per step, the lossless hook aggregates constructed gradients; compared with their exact dense average."""
    rank, size = dist.get_rank(), dist.get_world_size()
    got = DistributedDataParallel(inexact_case.InexactModel())
    state = LosslessHookState(max_density=0.05)
    got.register_comm_hook(state, lossless_hook)
    steps = []
    for step in range(inexact_case.STEPS):
        got.zero_grad(set_to_none=True)
        got(*inexact_case.gradients(step, rank)).backward()
        grads = [p.grad.clone() for p in got.module.parameters()]
        ref = inexact_case.dense_reference(step, size, average=True)
        steps.append({**inexact_case.compare(ref, grads), "digest": inexact_case.digest(grads)})
    return {"steps": steps, "stats": state.stats()}


def thc_exact(steps):
    """Per step, every parameter's reduced gradient against the dense average of the ranks' local
    gradients (a plain copy of the model, its gradients averaged with an allreduce): the parameters
    given as ``exact`` must match it to float rounding, the THC'd ones only approximately."""
    import copy
    size = dist.get_world_size()
    torch.manual_seed(0)
    model = EmbeddingModel(hidden=512)
    plain = copy.deepcopy(model)
    ddp = DistributedDataParallel(model)
    state = THCHookState(exact=[model.users.weight, model.fc1.weight])
    ddp.register_comm_hook(state, thc_hook)
    names = [n for n, _ in model.named_parameters()]
    out = []
    for step in range(steps):
        ddp.zero_grad(set_to_none=True)
        plain.zero_grad(set_to_none=True)
        loss_fn(ddp, batch(step, dist.get_rank())).backward()
        loss_fn(plain, batch(step, dist.get_rank())).backward()
        diffs = {}
        for n, p, q in zip(names, model.parameters(), plain.parameters()):
            ref = q.grad.clone()
            dist.all_reduce(ref)
            ref /= size
            diffs[n] = float((p.grad - ref).abs().max())
        out.append(diffs)
        with torch.no_grad():   # the same step on both copies, so their gradients stay comparable
            for p, q in zip(model.parameters(), plain.parameters()):
                p -= 0.01 * p.grad
                q.copy_(p)
    return {"diffs": out, "stats": state.stats()}


def half_precision(dtype, steps=4, hidden=16, lr=0.1):
    """A model in ``dtype`` (bfloat16 or float16; DDP's buckets are then of that dtype) through the
    lossless hook. Per step, every reduced gradient against the float64 sum of the ranks' local
    gradients (a plain copy of the model), by :func:`models.half_precision_error`, and the bytes the
    hook allreduced (its message's parts and fallbacks) against the bucket's own bytes."""
    import copy
    size = dist.get_world_size()
    torch.manual_seed(0)
    model = EmbeddingModel(hidden=hidden).to(DEVICE, dtype)
    plain = copy.deepcopy(model)
    ddp = DistributedDataParallel(model)
    state = LosslessHookState(max_density=0.05)
    ddp.register_comm_hook(state, lossless_hook)
    worst, zeros_exact, sent, payload = 0.0, True, [], []
    for step in range(steps):
        u, i, y = batch(step, dist.get_rank())
        for m in (ddp, plain):
            m.zero_grad(set_to_none=True)
            before = state.stats()["payload_bytes"]
            with CountedCollectives("all_reduce") as counted:   # the hook's collectives run in backward
                torch.nn.functional.mse_loss(m(u, i), y.to(dtype)).backward()
            if m is ddp:
                sent.append(counted.bytes())
                payload.append(state.stats()["payload_bytes"] - before)
        for p, q in zip(model.parameters(), plain.parameters()):
            ref, mag = q.grad.double(), q.grad.double().abs()
            dist.all_reduce(ref)
            dist.all_reduce(mag)
            error, zeros = half_precision_error(p.grad, ref, mag, size, dtype)
            worst, zeros_exact = max(worst, error), zeros_exact and zeros
        with torch.no_grad():   # the same step on both copies, so their gradients stay comparable
            for p, q in zip(model.parameters(), plain.parameters()):
                p -= lr * p.grad
                q.copy_(p)
    return {"error_over_bound": worst, "zeros_exact": zeros_exact, "grad_dtype": str(p.grad.dtype), "stats": state.stats(),
            "sent_bytes": sent, "payload_bytes": payload,
            "bucket_bytes": sum(p.numel() * p.element_size() for p in model.parameters())}


def exact_hooks():
    """Fresh ``(name, state, hook)`` of the exact hooks the scenarios compare with DDP's allreduce:
    lossless, and auto on a given 100 Mbit/s link (the tables' plans are not dense, whatever the
    machine's load)."""
    return [("lossless", LosslessHookState(max_density=0.05), lossless_hook),
            ("auto", AutoHookState(interval=2, calibration=Calibration.default(1e8)), auto_hook)]


def compiled(hidden=16384, bucket_cap_mb=1):
    """``torch.compile(ddp_model)`` with the lossless and auto hooks against eager DDP's own allreduce:
    the largest parameter difference and the stats. 1.3 MB of parameters in buckets of 1 MB (DDP's
    first bucket's size, the least DDPOptimizer takes), so DDPOptimizer splits the compiled graph at the
    buckets' boundary and the hooks run from the compiled backward's gradients."""
    ref = train(None, hidden=hidden, bucket_cap_mb=bucket_cap_mb, lr=0.001)
    out = {}
    for name, state, hook in exact_hooks():
        got = train(state, hook=hook, hidden=hidden, bucket_cap_mb=bucket_cap_mb, lr=0.001, compiled=True)
        out[name] = {"max_diff": max_param_diff(ref, got), "stats": state.stats()}
    return out


class LargeGradients(torch.nn.Module):
    """A float16 table and bias whose loss gives every row it looks up, and the bias, a gradient of 40000:
    finite on each rank and on average, beyond float16's 65504 when summed over two ranks or more."""

    GRAD = 40000.0   # a multiple of float16's spacing there (32): exact

    def __init__(self):
        super().__init__()
        self.table = torch.nn.Embedding(5000, 8)
        self.bias = torch.nn.Parameter(torch.zeros(4))

    def forward(self, rows):
        return (self.table(rows).sum() + self.bias.sum()) * self.GRAD


def float16_large(steps=2):
    """:class:`LargeGradients` in float16 (the same rows on every rank, each once) through DDP's default
    allreduce and every hook: per hook, every reduced gradient's error against the float64 average, by
    :func:`models.half_precision_error`, and whether all are finite."""
    size, out = dist.get_world_size(), {}
    for name, make, hook in (("none", None, None),
                             ("lossless", lambda: LosslessHookState(max_density=0.05), lossless_hook),
                             ("auto", AutoHookState, auto_hook), ("topk", TopKHookState, topk_hook),
                             ("thc", THCHookState, thc_hook)):
        torch.manual_seed(0)
        model = LargeGradients().to(DEVICE, torch.float16)
        ddp = DistributedDataParallel(model)
        if hook is not None:
            ddp.register_comm_hook(make(), hook)
        worst, finite = 0.0, True
        for step in range(steps):
            rows = torch.randperm(5000, generator=torch.Generator().manual_seed(step))[:32].to(DEVICE)
            ddp.zero_grad(set_to_none=True)
            ddp(rows).backward()
            for p in model.parameters():
                finite = finite and bool(torch.isfinite(p.grad).all())
                ref = torch.zeros(p.shape, dtype=torch.float64, device=DEVICE)
                if p is model.bias:
                    ref += LargeGradients.GRAD * size
                else:
                    ref[rows] += LargeGradients.GRAD * size
                error, _ = half_precision_error(p.grad, ref, ref.abs(), size, torch.float16)
                worst = max(worst, error)
        out[name] = {"error_over_bound": worst, "finite": finite}
    return out


def thc_with_grad_scaler(inject_step, steps, state=None, hook=thc_hook):
    """THC hook with non_finite="propagate" (or ``state`` with ``hook``) under torch.amp.GradScaler: at
    ``inject_step`` the last rank's loss is multiplied by Inf (its gradient holds Inf/NaN, the other
    ranks' are finite). Records, per step, whether this rank's reduced gradient held a non-finite value
    and the scaler's scale, the capacity growths so far, and any exception (there must be none)."""
    torch.manual_seed(0)
    model = EmbeddingModel(hidden=512)
    ddp = DistributedDataParallel(model)
    state = state if state is not None else THCHookState(bits=4, non_finite="propagate")
    ddp.register_comm_hook(state, hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.02)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=1000)
    rank, last = dist.get_rank(), dist.get_world_size() - 1
    non_finite, scales, moved, growths = [], [], [], []
    try:
        for step in range(steps):
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(ddp, batch(step, rank))
            if step == inject_step and rank == last:
                loss = loss * float("inf")
            scaler.scale(loss).backward()
            non_finite.append(any(not bool(torch.isfinite(p.grad).all()) for p in model.parameters()
                                  if p.grad is not None))
            before = [p.detach().clone() for p in model.parameters()]
            scaler.step(opt)
            scaler.update()
            scales.append(scaler.get_scale())
            growths.append(state.stats()["capacity_growths"])
            moved.append(max(float((p.detach() - q).abs().max()) for p, q in zip(model.parameters(), before)))
        error = None
    except Exception as e:  # noqa: BLE001 - the test asserts there is none
        error = f"{type(e).__name__}: {e}"
    finite = all(bool(torch.isfinite(p).all()) for p in model.parameters())
    return {"error": error, "non_finite": non_finite, "scales": scales, "moved": moved, "finite": finite,
            "digest": param_digest(model), "stats": state.stats(), "growths": growths}


if __name__ == "__main__":
    gloo_scenarios.main(scenario)
