"""Horovod worker for tests/test_plugins_horovod.py, started by horovodrun or mpirun.

Usage: python horovod_worker.py OUT_DIR SCENARIO[,SCENARIO...]

``LHC_TEST_DEVICE=cuda``: every rank's models and batches on GPU 0 (tests/mp/models.py), for the scenarios
that train ``EmbeddingModel`` (Horovod built without GPU operations copies CUDA tensors to the host for
Gloo and back: NCCL refuses two ranks on one GPU).

Each scenario trains the same model twice from the same seed on the same per-rank batches, once
with Horovod's own uncompressed allreduce and once with a lossless_hc compressor, and every rank
writes OUT_DIR/<scenario>.rank<r>.json with what the test asserts (parameter difference, stats,
per-parameter capacities, errors raised).
"""
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
import horovod.torch as hvd  # noqa: E402
from models import (DEVICE, EmbeddingModel, LinearLoss, batch, books, books_check, half_precision_error,  # noqa: E402
                    loss_fn, max_param_diff, own_gradients, param_digest, residual_copies)
import inexact_case  # noqa: E402

from lossless_hc.training.aggregate import ConfigurationMismatch  # noqa: E402
from lossless_hc.training.capacity import CapacityPolicy  # noqa: E402
from lossless_hc.plugins.horovod import Calibration, Compression  # noqa: E402

STEPS = 6
RUNS = [0]  # training runs so far: a per-run prefix keeps Horovod operation names unique, so the
            # operations an error scenario leaves in flight can never pair with a later run's
PAIR = hvd.ProcessSet([0, 1])  # ranks 0 and 1 only (registered at init)
TAIL = hvd.ProcessSet([1, 2])  # ranks 1 and 2: a set without rank 0


def train(compression, steps=STEPS, op=None, sparse=False, groups=None, bpps=1, process_set=None, lr=0.1,
          hidden=16, matrices_only=False, broadcast=False, compiled=False, joined=False, abandon_at=None):
    """``matrices_only``: the optimizer takes the 2-D parameters only (as Muon-style optimizers do);
    ``broadcast``: SGD with momentum, parameters and optimizer state broadcast from rank 0 first;
    ``compiled``: the forward through ``torch.compile(model)``; ``joined``: uneven inputs, rank r
    trains ``steps - r`` steps and then calls ``hvd.join()`` (the ranks still training reduce with
    the joined ones' zeros); ``abandon_at``: at that step, after the backward pass, the optimizer's state
    is reloaded (Horovod drops the step's handles, as a roll-back does) and the step is not taken."""
    torch.manual_seed(0)
    model = EmbeddingModel(sparse=sparse, hidden=hidden).to(DEVICE)
    RUNS[0] += 1
    named = [(f"run{RUNS[0]}.{n}", p) for n, p in model.named_parameters() if not matrices_only or p.dim() == 2]
    kwargs = dict(named_parameters=named, compression=compression,
                  op=hvd.Average if op is None else op, sparse_as_dense=sparse, backward_passes_per_step=bpps)
    if groups is not None:
        kwargs["groups"] = groups
    if process_set is not None:
        kwargs["process_set"] = process_set
    inner = torch.optim.SGD([p for _, p in named], lr=lr, momentum=0.9 if broadcast else 0.0)
    opt = hvd.DistributedOptimizer(inner, **kwargs)
    if broadcast:
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        hvd.broadcast_optimizer_state(opt, root_rank=0)
    rank = hvd.rank()
    forward = torch.compile(model) if compiled else model
    for step in range(steps - rank if joined else steps):
        opt.zero_grad()
        for micro in range(bpps):
            loss_fn(forward, batch(step * bpps + micro, rank)).backward()
        if step == abandon_at:
            hvd.barrier()   # the dropped operations finish before their names are used again
            opt.load_state_dict(opt.state_dict())
            continue
        opt.step()
    if joined:
        hvd.join()
    return model


def compare(comp, **kw):
    ref = train(Compression.none, **kw)
    got = train(comp, **kw)
    return {"max_diff": max_param_diff(ref, got), "stats": comp.stats(),
            "capacity": {n: a.capacity for n, a in comp.aggregators().items()},
            "compressed": {n: a.compressed for n, a in comp.aggregators().items()}}


def topk_joined(op):
    """Top-k under ``hvd.join()`` (rank r computes ``STEPS - r`` gradients, then joins) on LinearLoss,
    whose gradient C is the same whatever the weight is: with SGD at lr 1 from W = 0, what Horovod
    applied (-W) must be every rank's C summed (divided by n under Average: Horovod divides by the world
    size after a join too) less what the ranks' error feedback still holds."""
    shape = (256, 192)   # large enough that top-k beats sending it dense
    model = LinearLoss(shape)
    RUNS[0] += 1
    comp = Compression.topk(ratio=0.05)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0), compression=comp, op=op,
                                   named_parameters=[(f"run{RUNS[0]}.weight", model.weight)])
    rank, n = hvd.rank(), hvd.size()
    computed = torch.zeros(shape, dtype=torch.float64)
    for step in range(STEPS - rank):
        c = torch.randn(shape, generator=torch.Generator().manual_seed(100 * step + rank))
        computed += c.double()
        opt.zero_grad()
        model(c).backward()
        opt.step()
    hvd.join()
    (agg,) = comp.aggregators().values()
    held = agg.residual.reshape(shape).double() if agg.residual is not None else torch.zeros(shape, dtype=torch.float64)
    computed = hvd.allreduce(computed, op=hvd.Sum, name=f"run{RUNS[0]}.computed")
    held = hvd.allreduce(held, op=hvd.Sum, name=f"run{RUNS[0]}.held")
    expected = (computed - held) / (n if op == hvd.Average else 1)
    applied = -model.weight.detach().double()
    return {"max_diff": float((applied - expected).abs().max()), "max_applied": float(applied.abs().max()),
            "held": float(held.abs().max()), "stats": comp.stats()}


def topk_conserved(steps=4, hidden=512, lr=0.1):
    """Top-k (5%) per parameter, ``hidden`` large enough that top-k beats sending the dense layer. At the
    last step, error feedback's books, checked outside the compressor: what Horovod applied (each
    parameter's .grad after ``opt.synchronize()``, the step then taken without synchronizing again)
    must be sum_r (g_r + residual_before_r - residual_after_r) / n, g_r this rank's own gradient (the
    same backward on a plain copy of the model), the sum over ranks a plain hvd.allreduce of the books
    (bound: models.books_check). Also the parameters' digest after the steps."""
    comp = Compression.topk(ratio=0.05)
    torch.manual_seed(0)
    model = EmbeddingModel(hidden=hidden).to(DEVICE)
    RUNS[0] += 1
    named = [(f"run{RUNS[0]}.{n}", p) for n, p in model.named_parameters()]
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=lr), named_parameters=named,
                                   compression=comp)
    rank, n = hvd.rank(), hvd.size()

    def residuals():
        aggs = comp.aggregators()
        return residual_copies([aggs[k].residual if k in aggs else None for k, _ in named], [p for _, p in named])
    for step in range(steps):
        check = step == steps - 1
        if check:
            grads, before = own_gradients(model, hidden, batch(step, rank)), residuals()
        opt.zero_grad()
        loss_fn(model, batch(step, rank)).backward()
        if check:
            opt.synchronize()   # decompressed into .grad
            applied = torch.cat([p.grad.detach().double().reshape(-1) for _, p in named])
            after = residuals()
            summed = hvd.allreduce(books(grads, before, after), op=hvd.Sum, name=f"run{RUNS[0]}.books")   # the check's
            rtol = max(a.codec.rtol for a in comp.aggregators().values() if a.codec is not None)
            conservation = books_check(applied, summed[0] / n, summed[1] / n, rtol)
            with opt.skip_synchronize():
                opt.step()
        else:
            opt.step()
    return {"stats": comp.stats(), "digest": param_digest(model), "conservation": conservation,
            "residual_norms": {k: float(a.residual.norm()) if a.residual is not None else None
                               for k, a in comp.aggregators().items()}}


def expect_error(fn, exc):
    try:
        fn()
    except exc as e:
        return {"error": type(e).__name__, "message": str(e)}
    return {"error": None}


def slow_link_auto():
    """``auto`` on a given 100 Mbit/s link: the tables' plans are not dense, whatever the machine's load.
    ``lossy_min_bytes=0``: were ``auto``'s default lossy, every tensor could be planned lossy (not exact)."""
    return Compression.auto(interval=2, calibration=Calibration.default(1e8), lossy_min_bytes=0)


def scenario(name):
    if name == "average":
        return compare(Compression.lossless(max_density=0.05))
    if name == "sum":
        return compare(Compression.lossless(max_density=0.05), op=hvd.Sum, lr=0.02)
    if name == "sparse_as_dense":
        return compare(Compression.lossless(max_density=0.05), sparse=True)
    if name == "matrices_only":
        return compare(Compression.lossless(max_density=0.05), matrices_only=True)
    if name == "broadcast_state":
        return compare(Compression.lossless(max_density=0.05), broadcast=True)
    if name == "groups":
        return compare(Compression.lossless(max_density=0.05), groups=2)
    if name == "backward_passes":
        return compare(Compression.lossless(max_density=0.05), bpps=2)
    if name == "fallback":
        # Capacity 0.1% of a table: every rank overloads the embeddings at the first step.
        return compare(Compression.lossless(max_density=0.001))
    if name == "policy":  # adaptive capacity: shrinks from 5% to what the batches use, identically on all ranks
        comp = Compression.lossless(max_density=0.05, policy=CapacityPolicy(interval=4))
        r = compare(comp, steps=24)
        aggs = [a for a in comp.aggregators().values() if getattr(a, "tracker", None) is not None]
        r["history"] = [a.tracker.history for a in aggs]
        r["union_capacity"] = [a.union_capacity for a in aggs]
        r["index"] = [a.codec.index_kind if a.codec is not None else "dense" for a in aggs]
        return r
    if name == "topk":
        return topk_conserved()
    if name == "join_thc":
        # THC cannot decode a sum that misses a rank: a clear error on the rank still training, which then
        # joins too (as a training loop that stops would), releasing the rank that joined first
        result = expect_error(lambda: train(Compression.thc(bits=4), joined=True, hidden=512), ConfigurationMismatch)
        if result["error"] is not None:
            hvd.join()
        return result
    if name in ("thc", "thc_sum"):
        # Lossy but unbiased: replicas must stay bit-identical and training must move like the
        # uncompressed run (same direction), with a third of the bytes for the large layers.
        comp = Compression.thc(bits=4)
        op = hvd.Sum if name == "thc_sum" else hvd.Average
        lr = 0.02 / hvd.size() if name == "thc_sum" else 0.02  # the same step size under both ops
        ref = train(Compression.none, steps=16, hidden=512, op=op, lr=lr)
        got = train(comp, steps=16, hidden=512, op=op, lr=lr)
        torch.manual_seed(0)
        start = EmbeddingModel(hidden=512).to(DEVICE)
        moved_ref = torch.cat([(p - q).reshape(-1) for p, q in zip(ref.parameters(), start.parameters())]).detach()
        moved_got = torch.cat([(p - q).reshape(-1) for p, q in zip(got.parameters(), start.parameters())]).detach()
        cosine = float(torch.nn.functional.cosine_similarity(moved_ref, moved_got, dim=0))
        return {"stats": comp.stats(), "digest": param_digest(got), "cosine": cosine,
                "compressed": {n: a.compressed for n, a in comp.aggregators().items()}}
    if name == "bfloat16":   # Horovod has no bfloat16 allreduce: the plugin carries such tensors as float32
        out = {kind: half_training(comp) for kind, comp in (
            ("lossless", Compression.lossless(max_density=0.05)),
            ("fallback", Compression.lossless(max_density=0.001)),
            ("topk", Compression.topk(ratio=0.05)),
            ("thc", Compression.thc(bits=4)),
            # on a given 100 Mbit/s link: plans that are not dense (allgather, top-k) whatever the machine's
            # load (a measured calibration planned dense on a quiet machine and allgather on a busy one)
            ("auto_lossy", Compression.auto(lossy=True, lossy_min_bytes=0, calibration=Calibration.default(1e8))))}
        out["auto_bf16"] = expect_error(lambda: Compression.auto(lossy=True, first="bf16"), ValueError)
        return out
    if name == "auto":   # exact all the same
        comp = slow_link_auto()
        ref = train(Compression.none)
        return {"max_diff": max_param_diff(ref, train(comp)), "stats": comp.stats()}
    if name == "compiled":   # torch.compile(model): Horovod's gradient hooks, and so the compressors, run as before
        ref, out = train(Compression.none), {}
        for key, comp in (("lossless", Compression.lossless(max_density=0.05)), ("auto", slow_link_auto())):
            out[key] = {"max_diff": max_param_diff(ref, train(comp, compiled=True)), "stats": comp.stats()}
        return out
    if name == "float16_auto":   # auto's plain dense steps of a float16 gradient go as float16, as Horovod's own
        return half_training(Compression.auto(strategies=("dense",)), torch.float16, steps=8)
    if name == "inexact":   # keys the decoder reports inexact, re-aggregated alone (tests/mp/inexact_case.py)
        return inexact()
    if name == "process_set":
        if hvd.size() <= 2:
            raise ValueError("the process_set scenario needs 3 or more ranks")
        out = {"included": PAIR.included()}
        if PAIR.included():
            out.update(compare(Compression.lossless(max_density=0.05), process_set=PAIR))
        # The ranks outside the set wait: Horovod stalls when they start global operations (or shut
        # down) while the set is still working.
        hvd.barrier()
        return out
    if name in ("join", "join_sum"):   # hvd.join(): lossless falls back to a dense sum of the ranks still training
        op = hvd.Sum if name == "join_sum" else hvd.Average
        return compare(Compression.lossless(max_density=0.05), op=op, joined=True)
    if name in ("join_topk", "join_topk_sum"):   # top-k's error feedback conserves every coordinate under join too
        return topk_joined(hvd.Sum if name == "join_topk_sum" else hvd.Average)
    if name in ("join_auto", "join_auto_sum"):   # every plan dense (statistics every other step): exact
        op = hvd.Sum if name == "join_auto_sum" else hvd.Average
        comp = Compression.auto(strategies=("dense",), interval=2, calibration=Calibration.default(1e9), guard_steps=0)
        ref, got = train(Compression.none, op=op, joined=True), train(comp, op=op, joined=True)
        return {"max_diff": max_param_diff(ref, got), "stats": comp.stats()}
    if name == "abandoned_step":   # a step whose handles the optimizer dropped: the next steps still end exactly
        return compare(Compression.lossless(max_density=0.001), abandon_at=0)
    if name == "process_set_type":   # a name where a ProcessSet goes: refused before any collective
        return expect_error(lambda: Compression.auto(process_set="all"), TypeError)
    if name == "op_max":   # a fallback's SUM beside Horovod's MAX of the rest: refused
        return expect_error(lambda: train(Compression.lossless(max_density=0.05), op=hvd.Max, steps=1), ValueError)
    if name == "shared_compressor":   # two optimizers of one model, one compressor: refused
        def run():
            torch.manual_seed(0)
            model = EmbeddingModel()
            RUNS[0] += 1
            comp = Compression.lossless(max_density=0.05)
            named = [(f"run{RUNS[0]}.{n}", p) for n, p in model.named_parameters()]
            tables, dense = [x for x in named if "weight" in x[0] and x[1].dim() == 2 and x[1].shape[0] > 100], \
                [x for x in named if not (x[1].dim() == 2 and x[1].shape[0] > 100)]
            opts = [hvd.DistributedOptimizer(torch.optim.SGD([p for _, p in part], lr=0.1), named_parameters=part,
                                             compression=comp) for part in (tables, dense)]
            loss_fn(model, batch(0, hvd.rank())).backward()
            for opt in opts:
                opt.step()
        return expect_error(run, ValueError)
    if name == "auto_process_set":   # auto on a set without rank 0: its broadcasts' root is the set's first rank
        out = {"included": TAIL.included()}
        if TAIL.included():
            # a given slow link: plans that are not dense, so the step guard runs a trial and broadcasts its verdict
            comp = Compression.auto(process_set=TAIL, first="allgather", interval=2, guard_steps=1, guard_start=2,
                                    calibration=Calibration.default(1e8))
            ref, got = train(Compression.none, process_set=TAIL, steps=10), train(comp, process_set=TAIL, steps=10)
            # this rank's own medians of the trial's timed steps (its decide()): what it broadcasts as the root
            own = [1e3 * statistics.median(comp._guard.times[w]) for w in ("plan", "dense")]
            out.update(max_diff=max_param_diff(ref, got), stats=comp.stats(), own_ms=own)
        hvd.barrier()
        return out
    if name == "adasum":
        return expect_error(lambda: train(Compression.lossless(), op=hvd.Adasum, steps=1), ValueError)
    if name == "sparse_without_dense":
        def run():
            torch.manual_seed(0)
            model = EmbeddingModel(sparse=True)
            RUNS[0] += 1
            opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                           named_parameters=[(f"run{RUNS[0]}.{n}", p)
                                                             for n, p in model.named_parameters()],
                                           compression=Compression.lossless())
            loss_fn(model, batch(0, hvd.rank())).backward()
            opt.step()
        return expect_error(run, ValueError)
    if name == "sparse_beside_one":   # a sparse table beside the one compressed tensor: refused naming the table
        def run():
            torch.manual_seed(0)
            emb, head = torch.nn.Embedding(1000, 8, sparse=True), torch.nn.Linear(8, 1, bias=False)
            RUNS[0] += 1
            named = [(f"run{RUNS[0]}.emb", emb.weight), (f"run{RUNS[0]}.head", head.weight)]
            opt = hvd.DistributedOptimizer(torch.optim.SGD([p for _, p in named], lr=0.1), named_parameters=named,
                                           compression=Compression.lossless())
            ids = torch.randint(0, 1000, (16,), generator=torch.Generator().manual_seed(hvd.rank()))
            head(emb(ids)).sum().backward()
            opt.step()
        return expect_error(run, ValueError)
    if name == "sparse_only":  # Horovod's own test_sparse_embeddings: every gradient sparse, SparseAdam
        def run():
            torch.manual_seed(0)
            emb = torch.nn.Embedding(1000, 8, sparse=True)
            RUNS[0] += 1
            opt = hvd.DistributedOptimizer(torch.optim.SparseAdam(emb.parameters(), lr=0.1),
                                           named_parameters=[(f"run{RUNS[0]}.emb", emb.weight)],
                                           compression=Compression.lossless())
            ids = torch.randint(0, 1000, (16,), generator=torch.Generator().manual_seed(hvd.rank()))
            emb(ids).sum().backward()
            opt.step()
        return expect_error(run, ValueError)
    if name == "seed_mismatch":
        return expect_error(lambda: train(Compression.lossless(max_density=0.05, seed=hvd.rank()), steps=1),
                            ConfigurationMismatch)
    raise ValueError(f"unknown scenario {name}")


class CountedAllreduces:
    """While active, the bytes of the tensors handed to Horovod's asynchronous collectives: the
    DistributedOptimizer's allreduces (horovod.torch.optimizer's own reference) and the plugin's (hvd's)
    allreduces and allgathers (an allgather plan's second collective: uncounted, a run whose measured
    calibration planned the tables on allgather failed the bytes check)."""

    def __enter__(self):
        import horovod.torch.optimizer as optimizer
        self.bytes = 0
        self._saved = [(optimizer, "allreduce_async_"), (hvd, "allreduce_async_"), (hvd, "allgather_async")]
        self._saved = [(module, name, getattr(module, name)) for module, name in self._saved]
        for module, name, original in self._saved:
            setattr(module, name, self._counting(original))
        return self

    def __exit__(self, *exc):
        for module, name, original in self._saved:
            setattr(module, name, original)

    def _counting(self, original):
        def call(tensor, *args, **kw):
            self.bytes += tensor.numel() * tensor.element_size()
            return original(tensor, *args, **kw)
        return call


def half_training(comp, dtype=torch.bfloat16, steps=4, lr=0.02):
    """A model in ``dtype`` (bfloat16 or float16) through ``comp``. Per step, every reduced gradient
    against the float64 sum of the ranks' local gradients (a plain copy of the model), by
    :func:`models.half_precision_error`. Meaningful for the exact compressors; for the lossy ones the
    test reads only that training ran and stayed finite."""
    import copy
    n = hvd.size()
    torch.manual_seed(0)
    model = EmbeddingModel(hidden=512).to(DEVICE, dtype)
    plain = copy.deepcopy(model)
    RUNS[0] += 1
    named = [(f"run{RUNS[0]}.{k}", p) for k, p in model.named_parameters()]
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=lr), named_parameters=named,
                                   compression=comp, op=hvd.Average)
    worst, zeros_exact, sent, counted = 0.0, True, [], []
    for step in range(steps):
        u, i, y = batch(step, hvd.rank())
        opt.zero_grad()
        plain.zero_grad()
        before = comp.stats()["payload_bytes"]
        with CountedAllreduces() as calls:
            for m in (model, plain):
                torch.nn.functional.mse_loss(m(u, i), y.to(dtype)).backward()
            opt.synchronize()
        sent.append(calls.bytes)
        counted.append(comp.stats()["payload_bytes"] - before)
        for k, (p, q) in enumerate(zip(model.parameters(), plain.parameters())):
            ref = hvd.allreduce(q.grad.double(), op=hvd.Sum, name=f"run{RUNS[0]}.ref{step}.{k}")
            mag = hvd.allreduce(q.grad.double().abs(), op=hvd.Sum, name=f"run{RUNS[0]}.mag{step}.{k}")
            error, zeros = half_precision_error(p.grad, ref, mag, n, dtype)
            worst, zeros_exact = max(worst, error), zeros_exact and zeros
        with opt.skip_synchronize():
            opt.step()
        with torch.no_grad():   # the same parameters on both copies, so their gradients stay comparable
            for p, q in zip(model.parameters(), plain.parameters()):
                q.copy_(p)
    return {"error_over_bound": worst, "zeros_exact": zeros_exact, "stats": comp.stats(), "sent": sent,
            "payload_bytes": counted,
            "dtypes": sorted({str(p.dtype) for p in model.parameters()}),
            "finite": all(bool(torch.isfinite(p).all()) for p in model.parameters())}


def inexact():
    """Per step, Compression.lossless aggregates constructed gradients; compared with their exact dense sum
    (Average with 2 ranks: the sum divided by 2, exact; Sum otherwise)."""
    rank, op = hvd.rank(), (hvd.Average if hvd.size() == 2 else hvd.Sum)
    RUNS[0] += 1
    model = inexact_case.InexactModel()
    named = [(f"run{RUNS[0]}.{n}", p) for n, p in model.named_parameters()]
    comp = Compression.lossless(max_density=0.05)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), named_parameters=named,
                                   compression=comp, op=op)
    steps = []
    for step in range(inexact_case.STEPS):
        opt.zero_grad()
        gt, gv = inexact_case.gradients(step, rank)
        model(gt, gv).backward()
        opt.synchronize()
        got = [p.grad.clone() for p in model.parameters()]
        with opt.skip_synchronize():
            opt.step()
        ref = inexact_case.dense_reference(step, hvd.size(), average=op == hvd.Average)
        steps.append({**inexact_case.compare(ref, got), "digest": inexact_case.digest(got)})
    return {"steps": steps, "stats": comp.stats()}


def main():
    out_dir, names = sys.argv[1], sys.argv[2].split(",")
    # With two ranks the pair is the global set, which Horovod's MPI controller refuses to add twice.
    # Registered only for the scenario that uses it: with a second process set, Horovod 0.28 negotiates
    # every global operation more slowly and erratically (a 3-rank run of the other scenarios: 45-100 s
    # instead of ~20 s on 2 cores).
    size = int(os.environ.get("HOROVOD_SIZE") or os.environ.get("OMPI_COMM_WORLD_SIZE") or 0)
    sets = [s for s, scenario_name in ((PAIR, "process_set"), (TAIL, "auto_process_set")) if scenario_name in names]
    hvd.init(process_sets=sets if size > 2 and sets else None)
    torch.set_num_threads(1)
    for name in names:
        result = scenario(name)
        result["size"] = hvd.size()
        result["device"] = str(DEVICE)
        with open(os.path.join(out_dir, f"{name}.rank{hvd.rank()}.json"), "w") as f:
            json.dump(result, f)
    # A file barrier before shutting down: an error scenario lets a rank leave while another is still
    # issuing the same step's allreduces (it raises at its first decode); Horovod's shutdown would turn
    # the slower rank's expected error into "Horovod has been shut down". No collective can be used here
    # (the error scenarios leave operations in flight).
    expected = [os.path.join(out_dir, f"{names[-1]}.rank{r}.json") for r in range(hvd.size())]
    deadline = time.monotonic() + 120
    while not all(os.path.exists(p) for p in expected) and time.monotonic() < deadline:
        time.sleep(0.05)
    hvd.shutdown()


if __name__ == "__main__":
    main()
