"""BytePS plugin: the optimizer loop on real codec payloads through simulated BytePS.

CPU tests (no BytePS needed): several simulated workers (threads) train through tests/byteps_sim.py,
which sums their pushes in their dtype in a chosen server order and divides (floats) or floor-divides
(integers) by the number of workers, as BytePS does; the compressors are driven with the call
structure of byteps.torch.DistributedOptimizer: exact training, a seed mismatch, a half-precision model,
and auto. The compressors' calls one at a time (the engine seam, names, refusals, payloads fitted to
BytePS's fixed key sizes) are tests/test_plugins_byteps_engine.py; configuration and payload averaging
tests/test_plugins_byteps.py; the real BytePS run (scheduler, server and workers on a GPU)
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


# -- a configuration mismatch ------------------------------------------------------------------------

def test_seed_mismatch_is_a_configuration_error():
    with pytest.raises(ConfigurationMismatch, match="fingerprints disagree"):
        train(lambda r, e: Compression.lossless(max_density=0.05, seed=r, engine=e), world=2, steps=1)


# -- a half-precision model ----------------------------------------------------------------------------

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
