"""BytePS plugin: the optimizer loop on real codec payloads through simulated BytePS.

CPU tests (no BytePS needed): several simulated workers (threads) train through tests/byteps_sim.py,
which sums their pushes in their dtype in a chosen server order and divides (floats) or floor-divides
(integers) by the number of workers, as BytePS does; the compressors are driven with the call
structure of byteps.torch.DistributedOptimizer: exact training, its refusals, payloads fitted to
BytePS's fixed key sizes, and auto. Configuration and payload averaging are
tests/test_plugins_byteps.py; the real BytePS run (scheduler, server and workers on a GPU) is
tests/test_byteps_gpu.py.
"""
from __future__ import annotations

import os
import sys
import threading
import warnings

import pytest
import torch

from byteps_sim import BytePSLikeOptimizer, SimulatedBytePS, run_workers
from lossless_hc.training.adapter import wire_numel
from lossless_hc.training.aggregate import ConfigurationMismatch
from lossless_hc.plugins import byteps as plugin
from lossless_hc.plugins.byteps import Compression


HERE = os.path.dirname(os.path.abspath(__file__))
TOL = 1e-6
_INIT_LOCK = threading.Lock()


# -- helpers -------------------------------------------------------------------------------------------

class EmbeddingModel(torch.nn.Module):
    """An embedding table (row-sparse gradients: compressed) and a small dense head (sent dense)."""

    def __init__(self, rows=2000, dim=16):
        super().__init__()
        self.emb = torch.nn.Embedding(rows, dim)
        self.fc = torch.nn.Linear(dim, 1)

    def forward(self, idx):
        return self.fc(self.emb(idx).mean(dim=1)).squeeze(-1)


def batch(rank, step, rows=2000, size=8, hot=None):
    g = torch.Generator().manual_seed(1000 * step + rank)
    idx = torch.randint(0, rows, (size, 4), generator=g)
    if hot is not None:   # many rows at once: overloads a small capacity
        idx = torch.randint(0, rows, (size, hot), generator=g)
    return idx, torch.randn(size, generator=g)


def train(compression_for_rank, world=2, steps=4, order=None, lr=0.5, hot=None, bpps=1, model_fn=EmbeddingModel):
    """Train one model per simulated worker; returns per-rank (params, compressor) and the simulator."""
    sim = SimulatedBytePS(world, order=order)

    def worker(rank, engine):
        with _INIT_LOCK:   # the global RNG is shared by the worker threads
            torch.manual_seed(0)
            model = model_fn()
        comp = compression_for_rank(rank, engine)
        opt = BytePSLikeOptimizer(torch.optim.SGD(model.parameters(), lr=lr), model.named_parameters(), comp,
                                  engine, backward_passes_per_step=bpps)
        for step in range(steps):
            opt.zero_grad()
            for micro in range(bpps):
                idx, y = batch(rank, step * bpps + micro, hot=hot)
                torch.nn.functional.mse_loss(model(idx), y).backward()
            opt.step()
        return {n: p.detach().clone() for n, p in model.named_parameters()}, comp

    return run_workers(sim, worker), sim


def none_for(rank, engine):
    return Compression.none


def lossless_for(**kw):
    return lambda rank, engine: Compression.lossless(engine=engine, **kw)


def max_diff(a, b):
    return max(float((a[n] - b[n]).abs().max()) for n in a)


def assert_replicas_identical(results):
    first = results[0][0]
    for params, _ in results[1:]:
        for n in first:
            assert torch.equal(first[n], params[n]), f"replicas drifted in {n}"


class _Mean(torch.nn.Module):
    def forward(self, x):
        return x.mean(dim=1)


class _Squeeze(torch.nn.Module):
    def forward(self, x):
        return x.squeeze(-1)


def pooled_model(hidden):
    """``(model_fn, init)``: a builder of an embedding table mean-pooled into two linear layers (``hidden``
    units between them), and the parameters every worker starts from (``train``'s seed)."""
    def model_fn():
        return torch.nn.Sequential(torch.nn.Embedding(2000, 16), _Mean(), torch.nn.Linear(16, hidden),
                                   torch.nn.Linear(hidden, 1), _Squeeze())
    with _INIT_LOCK:
        torch.manual_seed(0)
        init = {n: p.detach().clone() for n, p in model_fn().named_parameters()}
    return model_fn, init


# -- the optimizer loop through simulated BytePS ------------------------------------------------------

@pytest.mark.parametrize("world, order", [(2, None), (2, [1, 0]), (3, None), (3, [2, 0, 1])])
def test_lossless_training_matches_uncompressed(world, order):
    ref, _ = train(none_for, world=world, order=order)
    got, sim = train(lossless_for(max_density=0.05), world=world, order=order)
    assert_replicas_identical(got)
    for (p_ref, _), (p_got, comp) in zip(ref, got):
        assert max_diff(p_ref, p_got) <= TOL
        st = comp.stats()
        assert st["compressed"] > 0 and st["sent_dense"] > 0 and st["fallbacks"] == 0
        assert st["payload_bytes"] < st["dense_bytes"]
        assert comp.aggregators()["emb.weight"].compressed and not comp.aggregators()["fc.weight"].compressed
    # The embedding's payload, not its gradient, is what the server summed under its name.
    codec = got[0][1].aggregators()["emb.weight"].codec
    assert {numel for numel, _, _ in sim.pushes["Gradient.emb.weight"]} == {codec.payload_numel}
    steps, dense_bytes = 4, 2000 * 16 * 4
    assert sim.server_bytes["Gradient.emb.weight"] == steps * world * codec.payload_numel * 4 < steps * world * dense_bytes
    assert not any(sim.lazily_declared)


def test_fallback_growth_and_tail_keep_training_exact():
    """A capacity far too small: the first step falls back to the dense sum, the capacity grows, and the
    grown payload no longer fits the size BytePS fixed for the name at its first push: its head goes
    under Gradient.<name>, the rest under a tail name declared at the end of the step on every rank."""
    world = 2
    ref, _ = train(none_for, world=world, hot=64, steps=4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # a tail declared lazily would warn
        got, sim = train(lossless_for(max_density=0.0005), world=world, hot=64, steps=4)
    assert_replicas_identical(got)
    for (p_ref, _), (p_got, comp) in zip(ref, got):
        assert max_diff(p_ref, p_got) <= TOL
        st = comp.stats()
        assert st["fallbacks"] >= 1 and st["capacity_growths"] >= 1, st
        assert "overloaded" in st["last_failure"]
    tails = [n for n in sim.pushes if n.startswith("lhc.tail.emb.weight.")]
    assert tails, sorted(sim.pushes)
    assert sim.pushes["lhc.fallback.emb.weight"] and all(not avg for _, _, avg in sim.pushes["lhc.fallback.emb.weight"])
    agg = got[0][1].aggregators()["emb.weight"]
    first = sim.pushes["Gradient.emb.weight"][0][0]
    if agg.compressed:
        assert f"lhc.tail.emb.weight.{wire_numel(agg) - first}" in sim.pushes
    assert not any(n.startswith("lhc.") for names in sim.lazily_declared for n in names)
    # Every rank declared the extra names at the same keys (the simulator checks each aggregation).
    assert sim.keys[0] == sim.keys[1]


def test_inexact_keys_are_reaggregated_alone_under_padded_names():
    """Gradients whose small keys share sketch cells with 2**30 (tests/mp/inexact_case.py): the decoder
    reports those keys inexact; each is re-aggregated by a sum push_pull of just their coordinates,
    zero-padded to a power of two under ``lhc.partial.<name>.<size>`` (a name keeps one size, as
    BytePS requires), declared at the step's end in the same order on every rank; the gradients equal
    the exact dense average bit for bit (2 workers: the division by 2 is exact)."""
    sys.path.insert(0, os.path.join(HERE, "mp"))
    import inexact_case

    world = 2
    sim = SimulatedBytePS(world)

    def worker(rank, engine):
        model = inexact_case.InexactModel()
        comp = Compression.lossless(max_density=0.05, engine=engine)
        opt = BytePSLikeOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), model.named_parameters(), comp, engine)
        differing = []
        for step in range(inexact_case.STEPS):
            opt.zero_grad()
            model(*inexact_case.gradients(step, rank)).backward()
            opt.synchronize()
            got = [p.grad.clone() for p in model.parameters()]
            differing.append(inexact_case.compare(inexact_case.dense_reference(step, world, average=True), got)["differing"])
        return differing, comp.stats()

    results = run_workers(sim, worker)
    for differing, st in results:
        assert differing == [0] * inexact_case.STEPS
        assert st["partial_fallbacks"] >= 1 and st["fallbacks"] == 0 and st["inexact_decodes"] == st["partial_fallbacks"]
    partial = {n: pushes for n, pushes in sim.pushes.items() if n.startswith("lhc.partial.")}
    assert partial, sorted(sim.pushes)
    for name, pushes in partial.items():
        size = int(name.rsplit(".", 1)[1])
        assert size & (size - 1) == 0 and all(numel == size and not avg for numel, _, avg in pushes), (name, pushes)
    assert sim.keys[0] == sim.keys[1] and not any(sim.lazily_declared)


def test_backward_passes_per_step_and_three_workers():
    ref, _ = train(none_for, world=3, bpps=2, steps=3)
    got, _ = train(lossless_for(max_density=0.05), world=3, bpps=2, steps=3)
    assert_replicas_identical(got)
    for (p_ref, _), (p_got, _) in zip(ref, got):
        assert max_diff(p_ref, p_got) <= TOL


def test_topk_trains_with_error_feedback():
    """Top-k (5%) moves the layers it compresses in the direction of the uncompressed run, by a real
    fraction of its movement, and keeps what it did not send in a non-zero residual."""
    big, init = pooled_model(64)
    got, _ = train(lambda r, e: Compression.topk(ratio=0.05, engine=e), world=2, model_fn=big, steps=3)
    ref, _ = train(none_for, world=2, model_fn=big, steps=3)
    assert_replicas_identical(got)
    comp = got[0][1]
    st = comp.stats()
    assert st["compressed"] > 0 and st["payload_bytes"] < st["dense_bytes"]
    aggs = comp.aggregators()
    compressed = sorted(n for n, a in aggs.items() if a.compressed)
    assert compressed == ["0.weight", "2.weight"], compressed
    # Error feedback: 2.weight (1024 coordinates, k = 52) leaves most of each gradient in its residual
    # (norm measured 1.31); the embedding's gradient has at most 512 non-zeros <= k = 1600, so all of it goes.
    for _, c in got:
        assert float(c.aggregators()["2.weight"].residual.norm()) > 0.1
    # Movements of the compressed layers (got - init vs ref - init); measured: cosine 0.795, projection
    # onto the reference's movement 0.60 of its length, norm ratio 0.75. Top-k sending nothing: all 0.
    d_ref = torch.cat([(ref[0][0][n] - init[n]).flatten() for n in compressed])
    d_got = torch.cat([(got[0][0][n] - init[n]).flatten() for n in compressed])
    assert torch.isfinite(d_got).all()
    cos = float(torch.nn.functional.cosine_similarity(d_ref, d_got, dim=0))
    proj = float(d_got @ d_ref / (d_ref @ d_ref))
    norm_ratio = float(d_got.norm() / d_ref.norm())
    assert cos > 0.5 and proj > 0.3 and norm_ratio < 1.5, (cos, proj, norm_ratio)


def test_thc_replicas_identical_and_direction():
    wide, init = pooled_model(512)
    ref, _ = train(none_for, world=2, model_fn=wide, steps=6, lr=0.05)
    got, _ = train(lambda r, e: Compression.thc(bits=4, engine=e), world=2, model_fn=wide, steps=6, lr=0.05)
    assert_replicas_identical(got)
    st = got[0][1].stats()
    assert st["compressed"] > 0 and st["payload_bytes"] < st["dense_bytes"]
    d_ref = torch.cat([(ref[0][0][n] - init[n]).flatten() for n in init])
    d_got = torch.cat([(got[0][0][n] - init[n]).flatten() for n in init])
    cos = torch.nn.functional.cosine_similarity(d_ref, d_got, dim=0)
    assert cos > 0.7, float(cos)


# -- errors --------------------------------------------------------------------------------------------

def test_seed_mismatch_is_a_configuration_error():
    with pytest.raises(ConfigurationMismatch, match="fingerprints disagree"):
        train(lambda r, e: Compression.lossless(max_density=0.05, seed=r, engine=e), world=2, steps=1)


def test_sparse_gradients_are_refused():
    """BytePS pre-fills p.grad densely, so a sparse embedding's gradient reaches compress sparse only after
    zero_grad(set_to_none=True); then it is refused, not pushed."""
    comp = Compression.lossless(engine=SimulatedBytePS(2).engine(0))
    p = torch.nn.Parameter(torch.zeros(100, 4))
    p.grad = torch.sparse_coo_tensor(torch.tensor([[3]]), torch.ones(1, 4), (100, 4), check_invariants=True)
    with pytest.raises(ValueError, match="'emb' has a sparse gradient; BytePS pushes dense tensors only"):
        _Opt([("emb", p)], None)._push_pull_grad_async(p, comp)


def test_async_mode_is_refused_by_its_flag_or_by_the_parameter_itself():
    """Either sign of BytePS's asynchronous mode is refused: the optimizer's _enable_async (even for a
    gradient), or compress called on the parameter itself (an optimizer without the flag)."""
    eng = SimulatedBytePS(1).engine(0)
    p = torch.nn.Parameter(torch.zeros(6))
    p.grad = torch.arange(6.0)

    class Frame:
        _parameter_names = {}

        def __init__(self, flag):
            if flag is not None:
                self._enable_async = flag

        def push(self, p, tensor, comp):
            return comp.compress(tensor)

    with pytest.raises(ValueError, match="BYTEPS_ENABLE_ASYNC"):   # BytePS's step() in async mode: both
        Frame(True).push(p, p, Compression.lossless(engine=eng))
    with pytest.raises(ValueError, match="BYTEPS_ENABLE_ASYNC"):
        Frame(True).push(p, p.grad, Compression.lossless(engine=eng))
    with pytest.raises(ValueError, match="BYTEPS_ENABLE_ASYNC"):
        Frame(None).push(p, p, Compression.lossless(engine=eng))
    Frame(None).push(p, p.grad, Compression.lossless(engine=eng))   # synchronous: a gradient is compressed


def test_compress_outside_the_optimizer_is_refused():
    with pytest.raises(RuntimeError, match="must be used as byteps.torch.DistributedOptimizer"):
        Compression.lossless().compress(torch.zeros(10))


def test_engine_needs_byteps_when_missing():
    if plugin.bps is not None:
        pytest.skip("BytePS is installed here")
    with pytest.raises(ImportError, match="scripts/setup_byteps.sh"):
        plugin.BytePSEngine()
    assert Compression.none.compress(torch.ones(2))[1] is None


# -- fitting payloads to BytePS's fixed key sizes ----------------------------------------------------------

class _Opt:
    """A caller frame that looks like the optimizer's ``_push_pull_grad_async(self, p)``."""

    def __init__(self, named, engine):
        self._parameter_names = {p.__hash__(): n for n, p in named}
        self._is_tensor_instance = True
        self.engine = engine

    def _push_pull_grad_async(self, p, comp):
        payload, ctx = comp.compress(p.grad)
        return payload, ctx


class _DeclaringEngine:
    """An engine that records the names declared to it (``declared``) and carries no push."""

    def __init__(self):
        self.declared = []

    def declare(self, name):
        self.declared.append(name)

    def push_pull_async_inplace(self, tensor, average, name):
        return None

    def synchronize(self, handle):
        pass


def test_fit_pads_smaller_payloads_and_widens_dtypes():
    sim = SimulatedBytePS(1)
    eng = sim.engine(0)
    comp = Compression.lossless(engine=eng)
    p = torch.nn.Parameter(torch.zeros(6, dtype=torch.float16))
    opt = _Opt([("w", p)], eng)
    p.grad = torch.arange(6, dtype=torch.float16)
    head, ctx = opt._push_pull_grad_async(p, comp)          # the first push fixes the slot
    assert head.numel() == 6 and head.dtype == torch.float16
    comp._slots["w"] = (10, torch.float32)                  # as if the first push had been wider and longer
    comp._pending = 0
    head, ctx = opt._push_pull_grad_async(p, comp)
    assert head.numel() == 10 and head.dtype == torch.float32 and ctx.tail is None
    assert torch.equal(head[:6], torch.arange(6, dtype=torch.float32)) and not head[6:].any()
    out = comp.decompress(head, ctx)
    assert out.dtype == torch.float16 and torch.equal(out, torch.arange(6, dtype=torch.float16))
    comp._slots["w"] = (6, torch.float16)
    p.grad = torch.arange(6, dtype=torch.float16)
    comp2 = Compression.lossless(engine=eng)
    comp2._slots["w"] = (6, torch.int32)
    with pytest.raises(RuntimeError, match="changed dtype"):
        _Opt([("w", p)], eng)._push_pull_grad_async(p, comp2)


def test_a_result_handed_back_in_another_tensor_is_the_one_decoded():
    """An engine that does not aggregate in place hands decompress another tensor than the pushed one
    (its ctx is then this push's): that tensor's values are decoded, not the payload this rank pushed."""
    sim = SimulatedBytePS(1)
    eng = sim.engine(0)
    comp = Compression.lossless(engine=eng)
    p = torch.nn.Parameter(torch.zeros(6))
    opt = _Opt([("w", p)], eng)
    p.grad = torch.arange(6.0)
    head, ctx = opt._push_pull_grad_async(p, comp)
    aggregated = head * 3   # the engine's result, in a tensor of its own
    assert torch.equal(comp.decompress(aggregated, ctx), torch.arange(6.0) * 3)


def test_partial_pushes_are_padded_to_a_power_of_two_under_one_name_per_size():
    """The inexact keys' values go zero-padded to the next power of two, under lhc.partial.<name>.<size>:
    a count that changes every step reuses a few names (BytePS fixes a name's size at its first push, and
    keeps every name it was given), and the values come back summed."""
    sim = SimulatedBytePS(1)
    comp = Compression.lossless(engine=sim.engine(0))
    agg = comp.aggregator("k", "w", torch.zeros(1000), 1, 0)
    for count in (3, 4, 1, 5):
        values = torch.arange(1.0, count + 1)
        comp._wait_fallback(comp._start_partial(agg, values))
        assert torch.equal(values, torch.arange(1.0, count + 1))
    assert {n: [numel for numel, _, _ in pushes] for n, pushes in sim.pushes.items()} == {
        "lhc.partial.w.4": [4, 4], "lhc.partial.w.1": [1], "lhc.partial.w.8": [8]}


def test_tails_are_declared_in_name_order_whatever_order_the_tensors_came_in():
    """At a step's end the compressor declares the tail names of the payloads that outgrew their slot, in
    the order of the tensors' names: workers whose tensors reached compress in other orders (BytePS
    numbers names as they are declared) declare them alike."""
    declared = []
    for order in (("a", "b"), ("b", "a")):
        engine = _DeclaringEngine()
        declared.append(engine.declared)
        comp = Compression.lossless(max_density=0.01, engine=engine)
        for name in order:
            agg = comp.aggregator(name, name, torch.zeros(20000), 2, 0)
            assert agg.compressed
            comp._slots[name] = (16, torch.float32)   # as if the first push had been smaller
        comp._after_step()
    assert declared[0] == declared[1] and [n.split(".")[2] for n in declared[0]] == ["a", "b"], declared

def test_auto_options_byteps_cannot_honour_are_refused():
    """partial=True (BytePS's only second push is the dense fallback: it failed at the first inexact
    decode), an empty strategies (it became every strategy) and a falsy calibration (it became the
    default) are refused when the compressor is built."""
    with pytest.raises(ValueError, match="partial"):
        Compression.auto(partial=True)
    with pytest.raises(ValueError, match="non-empty"):
        Compression.auto(strategies=())
    with pytest.raises(TypeError, match="calibration"):
        Compression.auto(calibration=0)


def test_a_half_precision_tensor_a_policy_may_compress_later_gets_a_float32_slot():
    """lossless with a CapacityPolicy on a float16 model: the table is sent as it is at first (a sketch at 50%
    is not smaller), then the policy's smaller capacity puts it on the codec, whose payload is float32. The
    first push fixed a float16 slot, which cannot carry it (a RuntimeError at that step); now a slot that
    may take a codec's payload is float32 from the first push, and training equals the uncompressed run."""
    from lossless_hc.training.capacity import CapacityPolicy

    class HalfModel(EmbeddingModel):
        def __init__(self):
            super().__init__()
            self.half()

        def forward(self, idx):
            return super().forward(idx).float()
    ref, _ = train(none_for, world=2, steps=6, model_fn=HalfModel)
    got, _ = train(lossless_for(max_density=0.5, policy=CapacityPolicy(interval=1)), world=2, steps=6,
                   model_fn=HalfModel)
    assert all(max_diff(ref[r][0], got[r][0]) == 0.0 for r in range(2))
    st = got[0][1].stats()
    assert st["compressed"] > 0 and st["sent_dense"] > 0 and st["fallbacks"] == 0, st


# -- auto (the planner) -----------------------------------------------------------------------------------

@pytest.mark.parametrize("world, order", [(2, None), (3, [2, 0, 1])])
def test_auto_training_matches_uncompressed_with_identical_plans(world, order):
    """``Compression.auto``: the sketch first (the slot BytePS fixes is the small payload), then the
    planner's choice between dense and the sketch per tensor; exact, the same plan on every worker, and
    the dense head's plan switches without a lazily declared name."""
    ref, _ = train(none_for, world=world, order=order, steps=5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got, sim = train(lambda r, e: Compression.auto(engine=e, interval=2), world=world, order=order, steps=5)
    assert_replicas_identical(got)
    plans = [{n: v["strategy"] for n, v in comp.stats()["plan"].items()} for _, comp in got]
    assert all(p == plans[0] for p in plans)
    assert plans[0]["emb.weight"] == "sketch" and plans[0]["fc.bias"] == "dense", plans[0]
    for (p_ref, _), (p_got, _) in zip(ref, got):
        assert max_diff(p_ref, p_got) <= TOL
    assert sim.keys[0] == sim.keys[1]


def test_auto_offers_only_what_one_push_can_carry():
    with pytest.raises(ValueError, match="BytePS can run only"):
        Compression.auto(strategies=("allgather",), engine=SimulatedBytePS(2).engine(0))
    comp = Compression.auto(lossy=True, lossy_min_bytes=0, engine=SimulatedBytePS(2).engine(0))
    assert comp.spec.strategies == ("dense", "sketch", "topk")


def test_inexact_keys_are_reaggregated_in_name_order_whatever_order_the_ranks_decompress_in():
    """The adapter issues a step's partial re-aggregations when its last tensor is decompressed, in the
    order of the aggregators' names: ranks that decompress in different orders (hooks that complete in
    another order) still start them in one order, as an engine that numbers names as it first sees them
    (BytePS) needs."""
    sys.path.insert(0, os.path.join(HERE, "mp"))
    import inexact_case
    from lossless_hc.training.adapter import CompressorAdapter, LosslessSpec

    class Recording(CompressorAdapter):
        def __init__(self, spec):
            super().__init__(spec)
            self.started = []

        def _start_partial(self, agg, values):
            self.started.append(agg.name)
            return values

        def _wait_fallback(self, handle):
            pass

    world = 2
    adapters = [Recording(LosslessSpec(max_density=0.05)) for _ in range(world)]
    grads = [inexact_case.gradients(7, r) for r in range(world)]   # step 7's: both tensors report inexact keys
    names = ("table", "vec")
    encoded = [[a.encode(a.aggregator(name, name, g, world, r), g) for name, g in zip(names, gs)]
               for r, (a, gs) in enumerate(zip(adapters, grads))]
    summed = [sum(encoded[r][i][0] for r in range(world)) for i in range(len(names))]
    for r, order in enumerate(([0, 1], [1, 0])):   # rank 1 decompresses "vec" first
        for i in order:
            adapters[r].decode(summed[i].clone(), encoded[r][i][1])
    assert adapters[0].started == adapters[1].started == sorted(names), [a.started for a in adapters]


# -- the engine, names and declarations ---------------------------------------------------------------------

def test_the_default_engine_is_byteps_own_operations(monkeypatch):
    """BytePSEngine (a compressor's engine when none is given) is byteps.torch.ops: its size and rank, a
    declared name, the in-place averaging push_pull and its synchronize (here BytePS's modules over the
    simulator: two workers' tensors come back averaged in place, under a name declared before its push)."""
    from byteps_sim import byteps_modules
    sim = SimulatedBytePS(2)
    for name, module in byteps_modules(sim).items():
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(plugin, "bps", sys.modules["byteps.torch"])

    def worker(rank, _):
        eng = plugin.BytePSEngine()
        assert (eng.size(), eng.rank()) == (2, rank)
        eng.declare("w")
        t = torch.tensor([1.0, 2.0]) * (rank + 1)
        eng.synchronize(eng.push_pull_async_inplace(t, average=True, name="w"))
        return t

    for t in run_workers(sim, worker):
        assert torch.equal(t, torch.tensor([1.5, 3.0]))
    assert sim.keys[0] == sim.keys[1] == {"w": 0} and not any(sim.lazily_declared)
    assert sim.pushes["w"] == [(2, torch.float32, True)]


@pytest.mark.parametrize("keyed_by", ["hash", "tensor", "tensor, no flag"])
def test_the_parameter_s_name_is_read_from_the_optimizer_either_way_it_keys_them(keyed_by):
    """BytePS's optimizer keys its _parameter_names by p.__hash__() where _is_tensor_instance is set (current
    PyTorch), by the tensor itself otherwise (False, or an older BytePS without the attribute, nor
    _enable_async): the aggregator is named after the parameter either way."""
    eng = SimulatedBytePS(1).engine(0)
    p = torch.nn.Parameter(torch.zeros(6))
    p.grad = torch.arange(6.0)

    class Frame:
        def __init__(self):
            self._parameter_names = {p.__hash__() if keyed_by == "hash" else p: "w"}
            if keyed_by != "tensor, no flag":
                self._is_tensor_instance = keyed_by == "hash"
                self._enable_async = False

        def _push_pull_grad_async(self, p, comp):
            return comp.compress(p.grad)

    comp = Compression.lossless(engine=eng)
    Frame()._push_pull_grad_async(p, comp)
    assert list(comp.aggregators()) == ["w"]


def test_every_parameter_s_fallback_name_is_declared_sorted_at_the_first_compress():
    """The dense fallback names of all the optimizer's parameters are declared at the first compress, in
    name order, before anything else is pushed (every rank numbers them alike), and once."""
    sim = SimulatedBytePS(1)
    eng = sim.engine(0)
    params = {n: torch.nn.Parameter(torch.zeros(4)) for n in ("b", "c", "a")}
    for p in params.values():
        p.grad = torch.ones(4)
    opt = _Opt(list(params.items()), eng)
    comp = Compression.lossless(engine=eng)
    opt._push_pull_grad_async(params["c"], comp)
    assert sim.keys[0] == {"lhc.fallback.a": 0, "lhc.fallback.b": 1, "lhc.fallback.c": 2}
    opt._push_pull_grad_async(params["a"], comp)
    assert len(sim.keys[0]) == 3


def test_a_result_handed_back_in_another_tensor_releases_the_pushed_payload():
    """With an engine that does not aggregate in place, decompress (given this push's ctx) still lets go of
    the payload it pushed: nothing of a step is kept once its gradients are decompressed."""
    import gc
    import weakref
    eng = SimulatedBytePS(1).engine(0)
    comp = Compression.lossless(engine=eng, max_density=0.01)
    p = torch.nn.Parameter(torch.zeros(4000, 8))
    p.grad = torch.zeros(4000, 8)
    p.grad[7] = 1.0
    head, ctx = _Opt([("emb", p)], eng)._push_pull_grad_async(p, comp)
    assert comp.aggregators()["emb"].compressed
    pushed = weakref.ref(head)
    out = comp.decompress(head.clone(), ctx)
    assert torch.equal(out, p.grad)
    del head, ctx
    gc.collect()
    assert pushed() is None


def test_padding_and_widening_count_in_the_bytes_sent_and_a_lazy_tail_warns_at_the_caller():
    """What a push fitted to its slot sends beyond the payload (zero padding, widening to the slot's dtype)
    counts in stats()'s payload_bytes; a payload larger than its slot sends its own bytes (head and tail),
    and a tail name not declared at a step's end warns, pointing at the optimizer's call of compress."""
    sim = SimulatedBytePS(1)
    eng = sim.engine(0)
    comp = Compression.lossless(engine=eng)
    p = torch.nn.Parameter(torch.zeros(6, dtype=torch.float16))
    p.grad = torch.arange(6, dtype=torch.float16)
    opt = _Opt([("w", p)], eng)

    def push():
        before = comp.stats()["payload_bytes"]
        head, ctx = opt._push_pull_grad_async(p, comp)
        assert torch.equal(comp.decompress(head, ctx), p.grad)
        return comp.stats()["payload_bytes"] - before
    assert push() == 12                          # the first push: 6 float16 as they are
    comp._slots["w"] = (10, torch.float32)       # as if the first push had been wider and longer
    assert push() == 40                          # 12 counted, 28 of padding and widening
    comp._slots["w"] = (4, torch.float16)        # as if the first push had been shorter
    with pytest.warns(RuntimeWarning, match="lhc.tail.w.2 was not declared at the end of a step") as caught:
        assert push() == 12
    code = _Opt._push_pull_grad_async.__code__
    assert [(w.filename, w.lineno - code.co_firstlineno) for w in caught] == [(code.co_filename, 1)]
    assert sim.pushes["lhc.tail.w.2"] == [(2, torch.float16, True)] and not any(sim.lazily_declared)


def test_a_fallback_name_is_declared_before_its_push():
    """A fallback of a name the first compress did not declare (a parameter the optimizer has no name for)
    is declared before its push_pull, not left to the push; the dense values come back summed."""
    sim = SimulatedBytePS(1)
    comp = Compression.lossless(engine=sim.engine(0))
    agg = comp.aggregator("k", "x", torch.zeros(8), 1, 0)
    dense = torch.arange(8.0)
    comp._wait_fallback(comp._start_fallback(agg, dense))
    assert torch.equal(dense, torch.arange(8.0))
    assert sim.keys[0] == {"lhc.fallback.x": 0} and not any(sim.lazily_declared)
    assert sim.pushes["lhc.fallback.x"] == [(8, torch.float32, False)]


def test_no_tail_is_declared_for_a_payload_that_fits_its_slot():
    """At a step's end, a tail name is declared only for a payload that outgrew its slot, by its extra
    elements (even one), once; one that fits it exactly or with room to spare declares nothing."""
    engine = _DeclaringEngine()
    declared = engine.declared
    comp = Compression.lossless(max_density=0.01, engine=engine)
    aggs = {name: comp.aggregator(name, name, torch.zeros(20000), 2, 0) for name in ("a", "b")}
    assert all(a.compressed for a in aggs.values())
    comp._slots["a"] = (wire_numel(aggs["a"]), torch.float32)
    comp._slots["b"] = (wire_numel(aggs["b"]) + 16, torch.float32)
    comp._after_step()
    assert declared == []
    comp._slots["a"] = (wire_numel(aggs["a"]) - 1, torch.float32)
    comp._after_step()
    comp._after_step()
    assert declared == ["lhc.tail.a.1"]


def test_a_partial_push_s_padding_counts_in_the_bytes_sent():
    """The zeros that pad a partial re-aggregation to a power of two count in payload_bytes (5 float32
    values padded to 8: 12 bytes more)."""
    sim = SimulatedBytePS(1)
    comp = Compression.lossless(engine=sim.engine(0))
    agg = comp.aggregator("k", "w", torch.zeros(1000), 1, 0)
    before = comp.stats()["payload_bytes"]
    comp._wait_fallback(comp._start_partial(agg, torch.arange(1.0, 6.0)))
    assert comp.stats()["payload_bytes"] - before == 12


def test_auto_s_only_second_push_is_the_dense_fallback():
    """Compression.auto's second push is the exact dense fallback (a SUM under lhc.fallback.<name>, the
    tensor handed back summed); a request for anything else, an allgather or an allreduce of another size,
    is refused naming it."""
    from lossless_hc.training.step import Request
    sim = SimulatedBytePS(1)
    comp = Compression.auto(engine=sim.engine(0))
    agg = comp.aggregator("k", "w", torch.zeros(100), 1, 0)
    with pytest.raises(RuntimeError, match="w: BytePS can carry only the dense fallback, not an allgather of 100 "):
        comp._start_request(agg, Request("allgather", torch.zeros(100)))
    with pytest.raises(RuntimeError, match="not an allreduce of 99 elements"):
        comp._start_request(agg, Request("allreduce", torch.zeros(99)))
    dense = torch.arange(100.0)
    assert comp._wait_request(comp._start_request(agg, Request("allreduce", dense))) is dense
    assert torch.equal(dense, torch.arange(100.0))
    assert dict(sim.pushes) == {"lhc.fallback.w": [(100, torch.float32, False)]}


def test_auto_s_defaults_on_byteps():
    """Compression.auto without options: exact (dense and the sketch), the sketch first (the small payload
    fixes the size BytePS gives the name), no partial re-aggregation, the default calibration; with
    strategies that leave out the sketch, the planner's own first step."""
    from lossless_hc.training.planner import Calibration
    spec = Compression.auto(engine=SimulatedBytePS(2).engine(0)).spec
    assert (spec.lossy, spec.strategies, spec.first, spec.partial) == (False, ("dense", "sketch"), "sketch", False)
    assert spec.calibration == Calibration.default() and spec.given_calibration
    assert Compression.auto(strategies=("dense",)).spec.first is None
    assert Compression.auto(lossy=True, strategies=("topk", "sketch")).spec.first == "sketch"
