"""torch.distributed (Gloo) worker for tests/test_plugins_fsdp.py, started by torch.multiprocessing.

Usage: fsdp_worker.py REPLICAS SHARDS PORT OUT_DIR SCENARIOS. The ranks form a (replicate, shard)
device mesh. Each scenario trains the same model from the same seed on the same per-rank batches,
once with uncompressed FSDP2 (native HSDP on the 2-D mesh, or FSDP on the 1-D one) and once with a
state of lossless_hc.plugins.fsdp; every rank writes OUT_DIR/<scenario>.rank<r>.json.
"""
import hashlib
import io
import json
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

sys.path.insert(0, os.path.dirname(__file__))
from models import DEVICE, CountedCollectives, EmbeddingModel, batch, confirm_every_guard_look, loss_fn  # noqa: E402
import inexact_case  # noqa: E402

from lossless_hc.bench.common import end_gloo_rank  # noqa: E402
from lossless_hc.training.aggregate import ConfigurationMismatch  # noqa: E402
from lossless_hc.training.capacity import CapacityPolicy  # noqa: E402
from lossless_hc.plugins.fsdp import AutoFSDPState, LosslessFSDPState, THCFSDPState, TopKFSDPState  # noqa: E402
from lossless_hc.training.planner import Calibration  # noqa: E402
confirm_every_guard_look()

STEPS = 5
# LHC_TEST_DEVICE=cuda (models.DEVICE): the same scenarios on CUDA tensors (every rank on GPU 0, Gloo;
# NCCL refuses two ranks on one GPU).


def build(mesh, native: bool, hidden: int = 16, dtype=torch.float32, mp_policy=None, frozen=()):
    """The test model, fully_shard per table and at the root: natively on the whole mesh (the reference)
    or on its shard dimension only (custom HSDP, for our hooks); ``mp_policy``: a MixedPrecisionPolicy;
    ``frozen``: names of parameters that do not require grad."""
    torch.manual_seed(0)
    model = EmbeddingModel(hidden=hidden).to(DEVICE, dtype)
    for name in frozen:
        model.get_parameter(name).requires_grad_(False)
    on = mesh if native or mesh.ndim == 1 else mesh["shard"]
    policy = {} if mp_policy is None else {"mp_policy": mp_policy}
    for m in (model.users, model.items, model.fc1):
        fully_shard(m, mesh=on, **policy)
    fully_shard(model, mesh=on, **policy)
    if native:   # Gloo has no AVG: the reference sums and divides by the world size, as our hooks do
        for m in model.modules():
            if isinstance(m, FSDPModule):
                m.set_force_sum_reduction_for_comms(True)
    return model


def local(model):
    return [p.to_local().detach().cpu().clone() for p in model.parameters()]


def train(model, steps, start=0, lr=0.1, momentum=0.0, opt=None, compiled=False, micro=1):
    """``micro``: batches per step, the gradients accumulated unsharded without reduction
    (``set_requires_gradient_sync(False)``) but for the last."""
    opt = opt or torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    rank = dist.get_rank()
    forward = torch.compile(model) if compiled else model
    for step in range(start, start + steps):
        opt.zero_grad(set_to_none=True)
        for m in range(micro):
            model.set_requires_gradient_sync(m == micro - 1)
            loss_fn(forward, batch(micro * step + m, rank)).backward()
        opt.step()
    return opt


def non_finite(mesh, reduce_scatter: bool, steps=5, inject=2, state=None):
    """``state`` (lossless by default) with an Inf in the last rank's loss at step ``inject``, as an AMP
    scaler's overflow makes: every rank sees a non-finite reduced gradient there (a flag all-reduced
    over the ranks, as a GradScaler's check) and skips the optimizer step. Against native FSDP2 doing
    the same: the parameters, per step whether it was skipped, the capacity growths so far (the
    non-finite step must grow nothing, on the ranks that decoded a destination and on those that
    replayed its outcome alike), and whether the parameters ended finite."""
    rank, last = dist.get_rank(), dist.get_world_size() - 1

    def run(model, state=None):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        skipped, growths = [], []
        for step in range(steps):
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(model, batch(step, rank))
            (loss * float("inf") if step == inject and rank == last else loss).backward()
            bad = torch.tensor([float(any(not bool(torch.isfinite(p.grad.to_local()).all())
                                          for p in model.parameters() if p.grad is not None))], device=DEVICE)
            dist.all_reduce(bad)
            if float(bad) == 0:
                opt.step()
            skipped.append(float(bad) > 0)
            growths.append(state.stats()["capacity_growths"] if state is not None else 0)
        return skipped, growths

    ref = build(mesh, native=True, hidden=512)
    ref_skipped, _ = run(ref)
    got = build(mesh, native=False, hidden=512)
    state = state or LosslessFSDPState(mesh, max_density=0.05)
    state.register(got, reduce_scatter=reduce_scatter)
    skipped, growths = run(got, state)
    return {"max_diff": max_diff(local(ref), local(got)), "skipped": skipped, "ref_skipped": ref_skipped,
            "growths": growths, "stats": state.stats(),
            "finite": all(bool(torch.isfinite(t).all()) for t in local(got))}


class _InfInRowZero(torch.autograd.Function):
    """Identity whose backward puts an Inf in the weight gradient's first coordinate (row 0: the first
    shard's part of it), as an overflow in one place makes."""

    @staticmethod
    def forward(ctx, w):
        return w.view_as(w)

    @staticmethod
    def backward(ctx, g):
        g = g.clone()
        g.view(-1)[0] = float("inf")
        return g


class _InjectingLinear(torch.nn.Linear):
    inject = False

    def forward(self, x):   # in the module's own forward, where FSDP2 has unsharded its weight
        w = _InfInRowZero.apply(self.weight) if self.inject else self.weight
        return torch.nn.functional.linear(x, w, self.bias)


class _TwoLayers(torch.nn.Module):
    def __init__(self, width=64):
        super().__init__()
        self.a, self.b = _InjectingLinear(width, width), torch.nn.Linear(width, width)

    def forward(self, x):
        return self.b(torch.relu(self.a(x))).sum()


def _thc_two_layers(mesh, non_finite: str):
    """The two-layer model, fully_shard on the shard dimension, under THCFSDPState(non_finite=...), and
    its optimizer."""
    torch.manual_seed(0)
    model = _TwoLayers().to(DEVICE)
    for m in (model.a, model.b):
        fully_shard(m, mesh=mesh["shard"])
    fully_shard(model, mesh=mesh["shard"])
    THCFSDPState(mesh, bits=4, non_finite=non_finite).register(model)
    return model, torch.optim.SGD(model.parameters(), lr=0.01)


def _inject_at(model, step: int, inject: int, this_rank: bool) -> torch.Tensor:
    """Step ``step``'s input (its gradients zeroed), with the Inf armed at ``inject`` on ``this_rank``."""
    model.a.inject = step == inject and this_rank
    model.zero_grad(set_to_none=True)
    return torch.randn(8, 64, generator=torch.Generator().manual_seed(100 * step + dist.get_rank())).to(DEVICE)


def thc_raise_one_shard(mesh, steps=3, inject=1):
    """THCFSDPState(non_finite="raise") with an Inf in one coordinate of the last rank's gradient at step
    ``inject``: the reduce-scatter takes it to the first shard's replicate group only, yet every rank
    must raise (the shard group agrees), not that group alone while the others carry on to block."""
    rank, last = dist.get_rank(), dist.get_world_size() - 1
    model, opt = _thc_two_layers(mesh, "raise")
    for step in range(steps):
        x = _inject_at(model, step, inject, rank == last)
        try:
            model(x).backward()
        except FloatingPointError as e:
            return {"error": type(e).__name__, "message": str(e), "step": step}
        opt.step()
    return {"error": None}


def thc_propagate_scaler(mesh, steps=4, inject=1):
    """THCFSDPState(non_finite="propagate") under a real ``torch.amp.GradScaler``, with an Inf in one
    coordinate of the last rank's gradient at step ``inject`` (scaled, as AMP's overflow makes it): the
    reduce-scatter takes it to one shard's replicate group only, whose ranks decode all-NaN; the other
    ranks' shards stay finite. Per step, each rank's scale after ``update()`` (a skipped step halves it)
    and whether its local gradient shards were finite; the parameters' digest and finiteness at the end."""
    rank, last = dist.get_rank(), dist.get_world_size() - 1
    model, opt = _thc_two_layers(mesh, "propagate")
    scaler = torch.amp.GradScaler(DEVICE.type, init_scale=2.0 ** 8, growth_interval=1000)
    scales, finite = [], []
    for step in range(steps):
        x = _inject_at(model, step, inject, rank == last)
        scaler.scale(model(x)).backward()
        finite.append(all(bool(torch.isfinite(p.grad.to_local()).all()) for p in model.parameters()))
        scaler.step(opt)
        scaler.update()
        scales.append(float(scaler.get_scale()))
    params = local(model)
    digest = hashlib.sha256(b"".join(t.detach().contiguous().cpu().numpy().tobytes() for t in params)).hexdigest()
    return {"scales": scales, "finite_grads": finite, "digest": digest,
            "finite": all(bool(torch.isfinite(t).all()) for t in params)}


def max_diff(a, b):
    return max(float((x - y).abs().max()) if x.numel() else 0.0 for x, y in zip(a, b))


def compare(mesh, state, reduce_scatter, steps=STEPS, hidden=16, lr=0.1, compiled=False, mp_policy=None, micro=1,
            count_exchange=False, frozen=(), gathers=False):
    """Uncompressed FSDP2 (eager) against ``state``'s hooks (under ``torch.compile`` with ``compiled``),
    both with ``mp_policy`` and ``micro`` batches per step. ``count_exchange``: also record, per step
    after the first, the reduce-scatter's all-to-alls (``[name, dtype, input bytes]``) and the bytes of
    each destination's message as its aggregators' payload specs give them before the step, how many
    decodes of the step were re-aggregated (failed or inexact) and the payload bytes the stats counted;
    ``gathers``: the all-gathers (the inexact keys') among the calls too."""
    ref = build(mesh, native=True, hidden=hidden, mp_policy=mp_policy, frozen=frozen)
    train(ref, steps, lr=lr, micro=micro)
    got = build(mesh, native=False, hidden=hidden, mp_policy=mp_policy, frozen=frozen)
    start = local(got)
    state.register(got, reduce_scatter=reduce_scatter)
    aggs = state._aggregators
    exchanges = []
    if count_exchange:
        opt = train(got, 1, lr=lr, micro=micro)
        for step in range(1, steps):
            specs = {k: a.payload_spec() for k, a in aggs.items() if k.startswith("shard:")}
            destinations = [sum(numel * dt.itemsize for k, (numel, dt) in specs.items() if k.endswith(f"->{d}"))
                            for d in range(state.shards)]
            before = state.stats()
            with CountedCollectives("all_to_all_single", "reduce_scatter_single", "reduce_scatter_tensor",
                                    *(("all_gather",) if gathers else ())) as counted:
                train(got, 1, start=step, opt=opt, micro=micro)
            after = state.stats()
            exchanges.append({"calls": counted.calls, "destinations": destinations,
                              "repaired": sum(after[k] - before[k] for k in ("fallbacks", "inexact_decodes")),
                              "payload_bytes": after["payload_bytes"] - before["payload_bytes"]})
    else:
        train(got, steps, lr=lr, compiled=compiled, micro=micro)
    moved = [torch.cat([(p - q).reshape(-1) for p, q in zip(local(m), start)]) for m in (ref, got)]
    cosine = float(torch.nn.functional.cosine_similarity(moved[0], moved[1], dim=0))
    digest = hashlib.sha256(b"".join(t.contiguous().numpy().tobytes() for t in local(got))).hexdigest()
    return {"max_diff": max_diff(local(ref), local(got)), "stats": state.stats(), "digest": digest,
            "cosine": cosine, "exchanges": exchanges,
            "capacity": {k: getattr(a, "capacity", None) for k, a in sorted(aggs.items())}}


def resume(mesh, make_state, reduce_scatter, steps=6, hidden=512):
    """Train ``steps`` at once; then half, checkpoint (model, optimizer, hook state) through torch.save,
    rebuild everything, load, and train the other half. Both must end bit for bit equal."""
    kw = dict(lr=0.02, momentum=0.9)
    straight = build(mesh, native=False, hidden=hidden)
    s0 = make_state()
    s0.register(straight, reduce_scatter=reduce_scatter)
    train(straight, steps, **kw)

    first = build(mesh, native=False, hidden=hidden)
    s1 = make_state()
    s1.register(first, reduce_scatter=reduce_scatter)
    initial = _record_at_build(s1)   # each aggregator's state when built: a fresh one's
    opt = train(first, steps // 2, **kw)
    buf = io.BytesIO()
    torch.save({"model": {k: v.to_local() for k, v in first.state_dict().items()},
                "optim": opt.state_dict(), "lhc": s1.state_dict()}, buf)
    saved_keys = len(s1.state_dict()["aggregators"])
    buf.seek(0)
    ckpt = torch.load(buf, weights_only=False)

    second = build(mesh, native=False, hidden=hidden)
    s2 = make_state()
    s2.register(second, reduce_scatter=reduce_scatter)
    s2.load_state_dict(ckpt["lhc"])
    restored = _record_at_build(s2)   # built at the resumed run's first backward, from the checkpoint
    with torch.no_grad():
        for k, v in second.state_dict().items():
            v.to_local().copy_(ckpt["model"][k])
    opt2 = torch.optim.SGD(second.parameters(), **kw)
    opt2.load_state_dict(ckpt["optim"])
    train(second, steps - steps // 2, start=steps // 2, opt=opt2)
    saved = {k: {"capacity": a.get("capacity"),
                 "residual_norm": None if a.get("residual") is None else float(a["residual"].norm()),
                 "thc_step": (a.get("codec") or {}).get("step")}
             for k, a in sorted(ckpt["lhc"]["aggregators"].items())}
    return {"max_diff": max_diff(local(straight), local(second)), "saved_keys": saved_keys,
            "saved_scatters": ckpt["lhc"].get("reduce_scatter"),
            "resumed_scatters": {k: c.state_dict() for k, c in s2._scatters.items() if hasattr(c, "state_dict")},
            "stats": s0.stats(), "bitwise": all(torch.equal(x, y) for x, y in zip(local(straight), local(second))),
            "checkpoint_stats": s1.stats(), "resumed_stats": s2.stats(),
            "initial": initial, "saved": saved, "restored": restored,
            "final_capacity": {k: getattr(a, "capacity", None) for k, a in sorted(s0._aggregators.items())},
            "resumed_final_capacity": {k: getattr(a, "capacity", None) for k, a in sorted(s2._aggregators.items())}}


def half_precision(mesh, state, reduce_scatter: bool, dtype=torch.bfloat16, steps=4, hidden=8192, lr=0.01):
    """A ``dtype`` model with dense layers of 139k coordinates (sent as they are after the first step's
    capacity growth) against uncompressed FSDP2 in that dtype: the largest parameter difference, and per
    step the bytes our hooks all-reduced (the replica all-reduce's parts and fallbacks, beside this
    rank's shard's own bytes) and, with ``reduce_scatter``, each all-to-all's input dtype and bytes
    (the parts', then the fallbacks' and inexact keys' values) and the inexact keys' all-gather's. FSDP2's
    own collectives here are reduce-scatters (replaced by ours, or not counted) and all-gathers (its
    ``all_gather_into_tensor``, not counted)."""
    ref = build(mesh, native=True, hidden=hidden, dtype=dtype)
    got = build(mesh, native=False, hidden=hidden, dtype=dtype)
    state.register(got, reduce_scatter=reduce_scatter)
    ref_opt, got_opt = (torch.optim.SGD(m.parameters(), lr=lr) for m in (ref, got))
    sent, sent_rs, counted_bytes = [], [], []
    for step in range(steps):
        train(ref, 1, start=step, opt=ref_opt)
        before = state.stats()["payload_bytes"]
        counted_names = ("all_reduce", "all_to_all_single", "all_gather") if reduce_scatter else ("all_reduce",)
        with CountedCollectives(*counted_names) as counted:
            train(got, 1, start=step, opt=got_opt)
        counted_bytes.append(state.stats()["payload_bytes"] - before)
        sent.append(counted.bytes())
        sent_rs.append([[dtype, nbytes] for name, dtype, nbytes in counted.calls
                        if name in ("all_to_all_single", "all_gather")])
    return {"max_diff": max_diff(local(ref), local(got)), "stats": state.stats(), "sent": sent,
            "sent_rs": sent_rs, "payload_bytes": counted_bytes,
            "shard_bytes": sum(p.to_local().numel() * p.element_size() for p in got.parameters()),
            "dense_layer_bytes": sum(p.numel() * p.element_size()
                                     for p in (*got.fc1.parameters(), *got.fc2.parameters()))}


def _record_at_build(state) -> dict:
    """Record, per key, the capacity and top-k residual norm of each aggregator ``state`` builds, as
    built (a checkpoint's states are applied then); the aggregators themselves are the real ones."""
    seen = {}
    build_aggregator = state._aggregator

    def recording(key, *args, **options):
        new = key not in state._aggregators
        agg = build_aggregator(key, *args, **options)
        if new:
            residual = getattr(agg, "residual", None)
            codec = getattr(agg, "codec", None)
            seen[key] = {"capacity": getattr(agg, "capacity", None),
                         "residual_norm": None if residual is None else float(residual.norm()),
                         "thc_step": codec.state_dict()["step"] if hasattr(codec, "state_dict") else None}
        return agg

    state._aggregator = recording
    return seen


def checkpoint_misuse(mesh):
    """What load_state_dict refuses, and what it does to a state that trained since."""
    make = lambda: TopKFSDPState(mesh, ratio=0.05)   # noqa: E731
    state = make()
    state.register(build(mesh, native=False))
    at_start = state.state_dict()   # before the first backward: nothing built
    model = build(mesh, native=False)
    state = make()
    state.register(model)
    train(model, 2)
    saved = state.state_dict()
    out = {"saved_rank": saved["rank"], "saved_keys": sorted(saved["aggregators"])}
    other = dict(saved, rank=(dist.get_rank() + 1) % dist.get_world_size())
    out["other_rank"] = expect_error(lambda: make().load_state_dict(other), ValueError)
    keys = sorted(saved["aggregators"])
    renamed = dict(saved, aggregators={("replicate:nosuch.weight" if k == keys[0] else k): v
                                       for k, v in saved["aggregators"].items()})
    registered = make()
    registered.register(build(mesh, native=False))
    out["unknown_after_register"] = expect_error(lambda: registered.load_state_dict(renamed), ValueError)
    unregistered = make()
    unregistered.load_state_dict(renamed)   # the model is not known yet
    out["unknown_at_register"] = expect_error(lambda: unregistered.register(build(mesh, native=False)), ValueError)
    out["truncated"] = expect_error(lambda: make().load_state_dict({"config": saved["config"]}), ValueError)
    # rolled back to the state before the first backward: nothing of the two steps is kept
    state.load_state_dict(at_start)
    out["rolled_back"] = {"built": len(state._aggregators), "saved": state.state_dict()["aggregators"]}
    # the sparse reduce-scatter's saved cadence: for a module this model has, and well formed
    auto = lambda: AutoFSDPState(mesh, calibration=Calibration.default(1e8), guard_steps=0)   # noqa: E731
    registered = auto()
    registered.register(build(mesh, native=False), reduce_scatter=True)
    rows = registered.state_dict()
    out["scatter_modules"] = sorted(rows["reduce_scatter"])
    out["unknown_scatter"] = expect_error(lambda: registered.load_state_dict(
        dict(rows, reduce_scatter={"nosuch": {"calls": 1, "all_whole": False}})), ValueError)
    out["bad_scatter"] = expect_error(lambda: registered.load_state_dict(
        dict(rows, reduce_scatter={"users": {"calls": -1, "all_whole": False}})), ValueError)
    # loaded before register: the cadence is handed to each module's reduce-scatter when register builds it
    early = auto()
    cadence = {n: {"calls": 3, "all_whole": True} for n in rows["reduce_scatter"]}
    early.load_state_dict(dict(rows, reduce_scatter=cadence))
    early.register(build(mesh, native=False), reduce_scatter=True)
    out["restored_at_register"] = early.state_dict()["reduce_scatter"]
    return out


def expect_error(fn, exc):
    try:
        fn()
    except exc as e:
        return {"error": type(e).__name__, "message": str(e)}
    except Exception as e:
        return {"error": type(e).__name__, "message": str(e)}
    return {"error": None}


def inexact(mesh, reduce_scatter: bool):
    """Per step, constructed gradients (tests/mp/inexact_case.py) through the hooks; compared with their
    exact dense average over every rank (4 or 2 ranks: a division by a power of two, exact). Also per
    step: the bytes this rank handed the plugin's all-to-alls and all-gathers (``wire``) and the payload
    bytes its stats counted (``payload``)."""
    rank, size = dist.get_rank(), dist.get_world_size()
    model = inexact_case.InexactModel()
    fully_shard(model, mesh=mesh if mesh.ndim == 1 else mesh["shard"])
    state = LosslessFSDPState(mesh, max_density=0.05)
    state.register(model, reduce_scatter=reduce_scatter)
    built = _record_at_build(state)
    steps, wire, payload = [], [], []
    for step in range(inexact_case.STEPS):
        model.zero_grad(set_to_none=True)
        before = state.stats()["payload_bytes"]
        with CountedCollectives("all_to_all_single", "all_gather") as counted:
            model(*inexact_case.gradients(step, rank)).backward()
        wire.append(sum(nbytes for _, _, nbytes in counted.calls))
        payload.append(state.stats()["payload_bytes"] - before)
        grads = [p.grad.full_tensor() for p in model.parameters()]
        ref = inexact_case.dense_reference(step, size, average=True)
        steps.append(inexact_case.compare(ref, grads))
    aggs = sorted(state._aggregators.items())
    return {"steps": steps, "wire": wire, "payload": payload, "stats": state.stats(),
            "capacity": {k: a.capacity for k, a in aggs},
            "grown": [k for k, a in aggs if a.capacity != built[k]["capacity"]]}


def with_guard(r, state):
    """``r`` with the planner's choices, each parameter's plain steps and the step guard's statistics."""
    st = state.stats()
    r.update(plan={k: [v["strategy"], v["changes"]] for k, v in st["plan"].items()},
             plain_steps={k: v["plain_steps"] for k, v in st["plan"].items()}, guard=st["guard"])
    return r


def check_verdict(mesh, calls=40):
    """RowExchangeReduceScatter of one Linear(64, 64) module driven directly on the 1-D mesh: rank 0's gradient
    dense, rank 1's one row of the weight and nothing else. Per call, whether it ran the exchange (its
    all-to-alls) or FSDP2's own reduce-scatter, and whether the output was the chunks' sum; the check interval
    at the end."""
    from lossless_hc.plugins._fsdp_reduce_scatter import RowExchangeReduceScatter
    state = AutoFSDPState(mesh, calibration=Calibration.default(1e8), guard_steps=0)
    model = torch.nn.Linear(64, 64)
    fully_shard(model, mesh=mesh)
    model(torch.randn(2, 64))   # FSDP2's lazy init names the parameters
    comm = RowExchangeReduceScatter(state, model)
    group = mesh.get_group()
    n, me = dist.get_world_size(group), dist.get_rank(group)
    numel = 64 * 64 + 64   # the two parameters' padded shards, n chunks of them
    mine = torch.randn(numel, generator=torch.Generator().manual_seed(5))
    if me == 1:
        mine = torch.zeros(numel)
        mine[64:128] = 1.0   # one row of the weight
    every = [torch.empty(numel) for _ in range(n)]
    dist.all_gather(every, mine, group=group)
    expected = sum(every).view(n, -1)[me]
    exchanged, sums = [], []
    with CountedCollectives("all_to_all_single") as counted:
        for _ in range(calls):
            before = len(counted.calls)
            out = torch.empty(numel // n)
            comm(out, mine.clone(), group)
            exchanged.append(any(c[0] == "all_to_all_single" for c in counted.calls[before:]))
            sums.append(bool(torch.equal(out, expected)))
    return {"exchanged": exchanged, "sums": sums, "interval": comm.interval, "all_whole": comm.all_whole}


def scenario(name, mesh):
    rs = mesh.ndim == 1 or name.endswith("_rs")   # the 1-D mesh has only the reduce-scatter to compress
    base = name[:-3] if name.endswith("_rs") else name
    if base == "lossless":
        return compare(mesh, LosslessFSDPState(mesh, max_density=0.05), rs)
    if base == "non_finite":
        return non_finite(mesh, rs)
    if base == "thc_raise_one_shard":
        return thc_raise_one_shard(mesh)
    if base == "thc_propagate_scaler":
        return thc_propagate_scaler(mesh)
    if base == "non_finite_auto":   # the sparse reduce-scatter
        return non_finite(mesh, rs, state=AutoFSDPState(mesh, calibration=Calibration.default(1e8)))
    if base == "non_finite_topk":   # top-k's residuals, also on the ranks that replay a destination's outcome
        return non_finite(mesh, rs, state=TopKFSDPState(mesh, ratio=0.05))
    if base == "frozen":   # fc1's bias frozen: FSDP2 reduces its module's weight alone
        return compare(mesh, LosslessFSDPState(mesh, max_density=0.05), rs, frozen=("fc1.bias",))
    if base == "accumulation":   # 3 micro-batches per step, reduced once
        return compare(mesh, LosslessFSDPState(mesh, max_density=0.05), rs, micro=3)
    if base in ("mixed", "mixed_bf16"):   # bfloat16 compute; reduced in float32 ("mixed") or in bfloat16
        reduce_dtype = torch.bfloat16 if base == "mixed_bf16" else torch.float32
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype)
        return compare(mesh, LosslessFSDPState(mesh, max_density=0.05), rs, mp_policy=policy)
    if base == "compiled":   # torch.compile(model): FSDP2's hooks, and so ours, run around the compiled graphs
        return compare(mesh, LosslessFSDPState(mesh, max_density=0.05), rs, compiled=True)
    if base == "fallback":    # capacity 0.1%: the tables overload, fall back exactly (identically), grow
        return compare(mesh, LosslessFSDPState(mesh, max_density=0.001), rs, count_exchange=mesh.ndim == 1,
                       gathers=True)
    if base == "topk":
        state = TopKFSDPState(mesh, ratio=0.05)
        r = compare(mesh, state, rs, steps=16, hidden=512, lr=0.02)
        r["residual_norms"] = [float(a.residual.norm()) for a in state._aggregators.values() if a.residual is not None]
        return r
    if base == "thc":   # lossy: replicas of one shard must stay bit-identical, and stay near the reference
        r = compare(mesh, THCFSDPState(mesh, bits=4), False, steps=16, hidden=512, lr=0.02)
        # The same run with every parameter decoded into a fresh output and copied into its slot (the hook
        # decodes into the slots of the shard): the same bits.
        import lossless_hc.plugins.fsdp as fsdp_plugin
        into_slots, fsdp_plugin.in_place_outputs = fsdp_plugin.in_place_outputs, lambda *args: None
        try:
            r["digest_copied"] = compare(mesh, THCFSDPState(mesh, bits=4), False, steps=16, hidden=512, lr=0.02)["digest"]
        finally:
            fsdp_plugin.in_place_outputs = into_slots
        return r
    if base in ("auto", "auto_slow_link"):   # the planner on the replica all-reduce, calibrated in register()
        # auto: measured on this machine's loopback (whatever it chooses); auto_slow_link: a given 100 Mbit/s
        # link, on which the tables' plans are not dense (a choice that does not depend on the machine's load)
        given = Calibration.default(1e8) if base == "auto_slow_link" else None
        state = AutoFSDPState(mesh, interval=2, calibration=given)
        r = compare(mesh, state, False)
        r["plan"] = {k: [v["strategy"], v["changes"]] for k, v in state.stats()["plan"].items()}
        return r
    if base in ("auto_guard_dense", "auto_guard_plan"):   # the step guard, its verdict forced by the margin
        # (the plans must be 1e6x faster / may be 1e6x slower): one block of 2 steps per window from step 2
        state = AutoFSDPState(mesh, interval=2, calibration=Calibration.default(1e8), guard_steps=1, guard_start=2,
                              guard_margin=1 - 1e-6 if base == "auto_guard_dense" else -1e6)
        return with_guard(compare(mesh, state, False, steps=12), state)
    if base == "auto_guard_dense_plans":   # every plan dense, reduce_scatter=True on one-rank shard groups (no
        # exchange to check): the guard has nothing to weigh, so no trial opens
        state = AutoFSDPState(mesh, strategies=("dense",), calibration=Calibration.default(1e8), guard_steps=1,
                              guard_start=2, guard_margin=-1e6)
        return with_guard(compare(mesh, state, True, steps=8), state)
    if base in ("auto_guard_lossy_dense", "auto_guard_lossy_plan", "auto_guard_lossy_plan_gather"):
        # top-k plans (or top-k allgathered) under the guard
        strategy = "topk_allgather" if base.endswith("_gather") else "topk"
        state = AutoFSDPState(mesh, lossy=True, first=strategy, strategies=(strategy,), topk_ratio=0.05,
                              lossy_min_bytes=0,
                              interval=2, calibration=Calibration.default(1e8), guard_steps=1, guard_start=2,
                              guard_margin=1 - 1e-6 if base == "auto_guard_lossy_dense" else -1e6)
        r = with_guard(compare(mesh, state, False, steps=12, hidden=512, lr=0.02), state)
        r["left"] = {k: a.take_lossy_memory() is not None for k, a in state._aggregators.items()}
        return r
    if base == "auto_guard_lossy_half":   # ... with bf16 allowed: the dense window in bfloat16, as FSDP2's
        # MixedPrecisionPolicy(reduce_dtype=torch.bfloat16) reduces; a 1 Mbit/s link keeps the plans top-k
        state = AutoFSDPState(mesh, lossy=True, first="topk", strategies=("topk", "bf16"), lossy_min_bytes=0,
                              interval=2, calibration=Calibration.default(1e6), guard_steps=1, guard_start=2,
                              guard_margin=1 - 1e-6)
        model = build(mesh, native=False, hidden=512)
        state.register(model, reduce_scatter=False)
        opt, calls = None, []
        for step in range(12):
            with CountedCollectives("all_reduce") as counted:
                opt = train(model, 1, start=step, lr=0.02, opt=opt)
            calls.append(counted.calls)
        slots = sum(a.numel for k, a in state._aggregators.items() if k.startswith("replicate:"))   # padded shards
        return with_guard({"calls": calls, "shard_numel": slots}, state)
    if base == "auto_guard_mismatch":   # only the step guard differs across ranks
        state = AutoFSDPState(mesh, calibration=Calibration.default(1e8), guard_steps=0 if dist.get_rank() == 1 else 5)
        return expect_error(lambda: state.register(build(mesh, native=False)), ConfigurationMismatch)
    if base == "bfloat16":   # a bfloat16 model: its tensors sent as they are travel as bfloat16 (message.py)
        return half_precision(mesh, LosslessFSDPState(mesh, max_density=0.05), rs)
    if base == "float16":   # FSDP2 divides a float16 gradient in part before the collectives, the rest after
        return half_precision(mesh, LosslessFSDPState(mesh, max_density=0.05), rs, dtype=torch.float16)
    if base == "auto_bfloat16":
        return half_precision(mesh, AutoFSDPState(mesh, interval=2, calibration=Calibration.default(1e8)), False)
    if base == "auto_resume":   # a given calibration: the resumed plans are the straight run's (rs: and the
        # sparse reduce-scatter's check cadence)
        return resume(mesh, lambda: AutoFSDPState(mesh, interval=2, calibration=Calibration.default(1e8)), rs,
                      hidden=16)
    if base == "check_verdict":
        return check_verdict(mesh)
    if base == "auto_rows":   # the planner's exact sparse reduce-scatter (with the replica plans on 2x2)
        state = AutoFSDPState(mesh, interval=2, calibration=Calibration.default(1e8))
        return compare(mesh, state, True, count_exchange=True)
    if base in ("auto_rows_guard_dense", "auto_rows_guard_plan"):   # the step guard over the sparse reduce-scatter
        state = AutoFSDPState(mesh, interval=2, calibration=Calibration.default(1e8), guard_steps=1, guard_start=2,
                              guard_margin=1 - 1e-6 if base == "auto_rows_guard_dense" else -1e6)
        return with_guard(compare(mesh, state, True, steps=12, count_exchange=True), state)
    if base == "auto_rows_guard_lossy":   # ... lossy: the dense window in the dtypes the exchange narrows to
        state = AutoFSDPState(mesh, lossy=True, lossy_min_bytes=1024, interval=2, calibration=Calibration.default(1e8),
                              guard_steps=1, guard_start=2, guard_margin=1 - 1e-6)
        return with_guard(compare(mesh, state, True, steps=12, count_exchange=True), state)
    if base == "auto_rows_lossy":   # ... with lossy: chunks sent whole go as bfloat16 (every parameter here)
        state = AutoFSDPState(mesh, lossy=True, lossy_min_bytes=0, interval=2, calibration=Calibration.default(1e8))
        return compare(mesh, state, True, count_exchange=True)
    if base == "auto_rows_lossy_exact":   # ... lossy, but bf16 not among the strategies: chunks go whole as they are
        state = AutoFSDPState(mesh, lossy=True, strategies=("dense", "topk"), lossy_min_bytes=0, interval=2,
                              calibration=Calibration.default(1e8))
        return compare(mesh, state, True, count_exchange=True)
    if base == "auto_rows_mixed":   # ... of bfloat16 gradients (bfloat16 compute and reduce), 3 micro-batches
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
        return compare(mesh, AutoFSDPState(mesh, interval=2, calibration=Calibration.default(1e8)), True,
                       mp_policy=policy, micro=3, count_exchange=True)
    if base == "topk_policy":   # a CapacityPolicy on the replica all-reduce, with top-k's row-exchange reduce-scatter
        state = TopKFSDPState(mesh, ratio=0.05, policy=CapacityPolicy(interval=2))
        r = compare(mesh, state, rs, steps=8, hidden=512, lr=0.02)
        r["union_capacity"] = {k: a.union_capacity for k, a in sorted(state._aggregators.items())}
        return r
    if base == "resume":
        return resume(mesh, lambda: TopKFSDPState(mesh, ratio=0.05), rs)
    if base == "resume_thc":
        return resume(mesh, lambda: THCFSDPState(mesh, bits=4), rs)
    if base == "checkpoint_misuse":
        return checkpoint_misuse(mesh)
    if base == "resume_lossless":
        return resume(mesh, lambda: LosslessFSDPState(mesh, max_density=0.001), rs, hidden=16)
    if base == "inexact":
        return inexact(mesh, rs)
    if base == "config_mismatch":
        state = LosslessFSDPState(mesh, max_density=0.05 if dist.get_rank() == 1 else 0.02)
        return expect_error(lambda: state.register(build(mesh, native=False), reduce_scatter=rs), ConfigurationMismatch)
    if base == "thc_reduce_scatter":
        return expect_error(lambda: THCFSDPState(mesh).register(build(mesh, native=False), reduce_scatter=True),
                            ValueError)
    if base == "native_hsdp":
        return expect_error(lambda: LosslessFSDPState(mesh).register(build(mesh, native=True)), ValueError)
    raise ValueError(f"unknown scenario {name}")


def worker(rank, replicas, shards, port, out_dir, names):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=replicas * shards)
    torch.set_num_threads(1)
    if DEVICE.type == "cuda":
        torch.cuda.set_device(0)
    if replicas > 1:
        mesh = init_device_mesh(DEVICE.type, (replicas, shards), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh(DEVICE.type, (shards,), mesh_dim_names=("shard",))
    for name in names:
        result = scenario(name, mesh)
        result.update(rank=rank, replicas=replicas, shards=shards)
        with open(os.path.join(out_dir, f"{name}.rank{rank}.json"), "w") as f:
            json.dump(result, f)
    end_gloo_rank()


if __name__ == "__main__":
    replicas, shards, port, out_dir = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    names = sys.argv[5].split(",")
    torch.multiprocessing.spawn(worker, args=(replicas, shards, port, out_dir, names), nprocs=replicas * shards)
