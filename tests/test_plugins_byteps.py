"""BytePS plugin: configuration, and BytePS's averaging of real codec payloads.

CPU tests (no BytePS needed): several simulated workers (threads) push real payloads through
tests/byteps_sim.py, which sums them in their dtype in a chosen server order and divides (floats) or
floor-divides (integers) by the number of workers, as BytePS does. The optimizer loop through the
same simulator is tests/test_plugins_byteps_training.py, the compressors' calls one at a time
tests/test_plugins_byteps_engine.py; the real BytePS run (scheduler, server and workers on a GPU) is
tests/test_byteps_gpu.py.
"""
from __future__ import annotations

import pytest
import torch

from byteps_sim import SimulatedBytePS, run_workers
from lossless_hc.training.aggregate import TensorAggregator, partial_values
from lossless_hc.training.topk_aggregate import TopKAggregator
from lossless_hc.training.thc_aggregate import THCAggregator
from lossless_hc.plugins import byteps as plugin
from lossless_hc.plugins.byteps import Compression, options_from_env


# -- helpers -------------------------------------------------------------------------------------------

def byteps_average(payloads, order=None):
    """What BytePS hands every worker for these per-worker tensors: the server's sum in the payload's
    dtype (in the order given), divided by the number of workers, floor-divided for integers."""
    order = order or list(range(len(payloads)))
    acc = payloads[order[0]].clone()
    for q in order[1:]:
        acc += payloads[q]
    return acc.div_(len(payloads)) if acc.dtype.is_floating_point else acc.floor_divide_(len(payloads))


# -- configuration from the environment -----------------------------------------------------------------

def test_from_env_default_is_bytePS_own_none():
    assert Compression.from_env({}) is Compression.none
    assert Compression.from_env({"BYTEPS_LHC_COMPRESSOR": "none", "PATH": "/bin"}) is Compression.none


@pytest.mark.parametrize("env, kind, attrs", [
    ({"BYTEPS_LHC_COMPRESSOR": "lossless"}, "lossless",
     {"max_density": 0.01, "block_size": None, "seed": 0, "index": "auto"}),
    ({"BYTEPS_LHC_COMPRESSOR": "LOSSLESS", "BYTEPS_LHC_MAX_DENSITY": "0.05", "BYTEPS_LHC_SEED": "7",
      "BYTEPS_LHC_BLOCK_SIZE": "16", "BYTEPS_LHC_INDEX": "bloom"}, "lossless",
     {"max_density": 0.05, "block_size": 16, "seed": 7, "index": "bloom"}),
    ({"BYTEPS_LHC_COMPRESSOR": "lossless", "BYTEPS_LHC_BLOCK_SIZE": "auto"}, "lossless",
     {"block_size": None}),
    ({"BYTEPS_LHC_COMPRESSOR": "topk", "BYTEPS_LHC_RATIO": " 0.1 ", "BYTEPS_LHC_SEED": "3"}, "topk",
     {"ratio": 0.1, "seed": 3}),
    ({"BYTEPS_LHC_COMPRESSOR": "thc", "BYTEPS_LHC_BITS": "2", "BYTEPS_LHC_GRANULARITY": "12",
      "BYTEPS_LHC_OVERFLOW_FREQ": "64", "BYTEPS_LHC_SEED": "5"}, "thc",
     {"bits": 2, "granularity": 12, "overflow_freq": 64.0, "seed": 5}),
    ({"BYTEPS_LHC_COMPRESSOR": "thc", "BYTEPS_LHC_NON_FINITE": "Propagate"}, "thc", {"non_finite": "propagate"}),
])
def test_from_env_builds_the_configured_compressor(env, kind, attrs):
    comp = Compression.from_env(env)
    assert type(comp) is plugin.BytePSCompressor and comp.spec.kind == kind
    for k, v in attrs.items():
        assert getattr(comp, k) == v, k


def test_from_env_reads_os_environ_and_passes_keywords(monkeypatch):
    monkeypatch.setenv("BYTEPS_LHC_COMPRESSOR", "lossless")
    monkeypatch.setenv("BYTEPS_LHC_MAX_DENSITY", "0.2")
    comp = Compression.from_env(seed=9)
    assert comp.max_density == 0.2 and comp.seed == 9
    # Options no aggregator takes are refused when the compressor is configured.
    with pytest.raises(TypeError, match=r"unknown option\(s\) for lossless compression: some_policy \(its options: "
                                        r"max_density, .*, policy, partial_max_fraction\)"):
        Compression.from_env(some_policy="x")


@pytest.mark.parametrize("env, message", [
    ({"BYTEPS_LHC_COMPRESSOR": "zip"}, r"BYTEPS_LHC_COMPRESSOR='zip': expected one of lossless, topk, thc, none"),
    ({"BYTEPS_LHC_COMPRESSOR": "lossless", "BYTEPS_LHC_MAX_DENSITY": "1%"},
     r"BYTEPS_LHC_MAX_DENSITY='1%': expected a number in \(0, 1\]"),
    ({"BYTEPS_LHC_COMPRESSOR": "lossless", "BYTEPS_LHC_MAX_DENSITY": "0"}, r"BYTEPS_LHC_MAX_DENSITY='0'"),
    ({"BYTEPS_LHC_COMPRESSOR": "lossless", "BYTEPS_LHC_MAX_DENSITY": "1.5"}, r"BYTEPS_LHC_MAX_DENSITY='1.5'"),
    ({"BYTEPS_LHC_COMPRESSOR": "lossless", "BYTEPS_LHC_SEED": "1.5"}, r"BYTEPS_LHC_SEED='1.5': expected an integer"),
    ({"BYTEPS_LHC_COMPRESSOR": "lossless", "BYTEPS_LHC_SEED": "-1"}, r"seed must be an integer in \[0, 2\*\*64\)"),
    ({"BYTEPS_LHC_COMPRESSOR": "lossless", "BYTEPS_LHC_BLOCK_SIZE": "0"}, r"BYTEPS_LHC_BLOCK_SIZE='0'"),
    ({"BYTEPS_LHC_COMPRESSOR": "lossless", "BYTEPS_LHC_INDEX": "tree"}, r"BYTEPS_LHC_INDEX='tree': expected one of"),
    ({"BYTEPS_LHC_COMPRESSOR": "lossless", "BYTEPS_LHC_RATIO": "0.1"},
     r"BYTEPS_LHC_RATIO applies to BYTEPS_LHC_COMPRESSOR=topk, not BYTEPS_LHC_COMPRESSOR=lossless"),
    ({"BYTEPS_LHC_COMPRESSOR": "topk", "BYTEPS_LHC_BITS": "4"}, r"BYTEPS_LHC_BITS applies to .*=thc"),
    ({"BYTEPS_LHC_MAX_DENSITY": "0.1"}, r"BYTEPS_LHC_MAX_DENSITY applies to .*=lossless, not .*=none"),
    ({"BYTEPS_LHC_COMPRESSOR": "thc", "BYTEPS_LHC_NON_FINITE": "ignore"},
     r"BYTEPS_LHC_NON_FINITE='ignore': expected one of raise, propagate"),
    ({"BYTEPS_LHC_COMPRESSOR": "thc", "BYTEPS_LHC_BITS": "four"}, r"BYTEPS_LHC_BITS='four': expected an integer"),
    ({"BYTEPS_LHC_COMPRESSOR": "thc", "BYTEPS_LHC_BITS": "0"}, r"bits must be an integer in \[1, 16\]"),
    ({"BYTEPS_LHC_COMPRESSOR": "thc", "BYTEPS_LHC_OVERFLOW_FREQ": "inf"}, r"BYTEPS_LHC_OVERFLOW_FREQ='inf'"),
    ({"BYTEPS_LHC_COMPRESSOR": "thc", "BYTEPS_LHC_OVERFLOW_FREQ": "1"}, r"overflow_freq must be a finite number > 1"),
    ({"BYTEPS_LHC_COMPRESSOR": "lossless", "BYTEPS_LHC_MAX_DENSTY": "0.1"},
     r"unknown variable\(s\) BYTEPS_LHC_MAX_DENSTY; lossless_hc reads BYTEPS_LHC_COMPRESSOR"),
])
def test_from_env_rejects_bad_values_naming_the_variable(env, message):
    with pytest.raises(ValueError, match=message):
        Compression.from_env(env)


def test_factories_validate_like_horovod():
    with pytest.raises(ValueError, match="max_density must be a number in"):
        Compression.lossless(max_density=0)
    with pytest.raises(ValueError, match="ratio must be a number in"):
        Compression.topk(ratio=2)
    with pytest.raises(ValueError, match="index must be one of"):
        Compression.lossless(index="tree")
    with pytest.raises(ValueError, match="block_size"):
        Compression.lossless(block_size=0)
    assert options_from_env({"BYTEPS_LHC_COMPRESSOR": "topk"}) == ("topk", {})


def test_what_is_not_an_environment_or_an_engine_is_named():
    with pytest.raises(TypeError, match=r"BYTEPS_LHC_SEED: environment values are strings, got int"):
        Compression.from_env({"BYTEPS_LHC_COMPRESSOR": "lossless", "BYTEPS_LHC_SEED": 3})
    with pytest.raises(TypeError, match="env must be a mapping of variable names to strings"):
        Compression.from_env(["BYTEPS_LHC_COMPRESSOR=lossless"])
    with pytest.raises(TypeError, match=r"engine must be a BytePS engine \(with declare, push_pull_async_inplace"):
        Compression.lossless(engine="x")


def test_fp16_sends_floating_tensors_in_half_precision_and_restores_their_dtype():
    """Compression.fp16 (BytePS's own, or the same cast where BytePS is not installed): a float32 gradient is
    pushed as float16 and comes back float32; an integer one goes as it is."""
    x = torch.tensor([1.0, -2.5, 3000.0])
    payload, ctx = Compression.fp16.compress(x)
    assert payload.dtype == torch.float16 and torch.equal(payload, x.half())
    out = Compression.fp16.decompress(payload, ctx)
    assert out.dtype == torch.float32 and torch.equal(out, x)
    i = torch.tensor([1, -2, 3])
    payload, ctx = Compression.fp16.compress(i)
    assert payload.dtype == torch.int64 and torch.equal(Compression.fp16.decompress(payload, ctx), i)


def test_from_env_accepts_the_ends_of_each_range():
    """The largest fraction (1), the smallest block (1) and an empty block size (auto, like "auto") are
    accepted: the ranges are (0, 1] and the positive integers."""
    assert options_from_env({"BYTEPS_LHC_COMPRESSOR": "lossless", "BYTEPS_LHC_MAX_DENSITY": "1",
                             "BYTEPS_LHC_BLOCK_SIZE": "1"}) == ("lossless", {"max_density": 1.0, "block_size": 1})
    assert options_from_env({"BYTEPS_LHC_COMPRESSOR": "topk", "BYTEPS_LHC_RATIO": "1.0"}) == ("topk", {"ratio": 1.0})
    assert options_from_env({"BYTEPS_LHC_COMPRESSOR": "lossless", "BYTEPS_LHC_BLOCK_SIZE": " "}) == \
        ("lossless", {"block_size": None})


def test_from_env_refuses_options_for_byteps_s_own_none():
    """Keywords given to from_env with BYTEPS_LHC_COMPRESSOR unset (none, BytePS's own no-op) are refused:
    none takes no options, and silently training uncompressed would hide the mistake."""
    with pytest.raises(ValueError, match=r"BYTEPS_LHC_COMPRESSOR=none takes no options, got \['seed'\]"):
        Compression.from_env({}, seed=1)
    with pytest.raises(ValueError, match="takes no options"):
        Compression.from_env({"BYTEPS_LHC_COMPRESSOR": "none"}, max_density=0.1)


# -- payloads survive BytePS's averaging ----------------------------------------------------------------

def _sparse_rows(rank, rows, dim, k, seed):
    g = torch.Generator().manual_seed(seed * 100 + rank)
    x = torch.zeros(rows, dim)
    r = torch.randperm(rows, generator=g)[:k]
    x[r] = torch.randn(k, dim, generator=g)
    return x


@pytest.mark.parametrize("world", [2, 3, 5, 7])
@pytest.mark.parametrize("reverse", [False, True], ids=["rank-order", "reverse-order"])
def test_lossless_payload_survives_byteps_average(world, reverse):
    rows, dim, k = 4000, 8, 20
    xs = [_sparse_rows(r, rows, dim, k, world) for r in range(world)]
    aggs = [TensorAggregator("emb", (rows, dim), torch.float32, world, max_density=0.01) for _ in range(world)]
    assert aggs[0].compressed
    encoded = [a.encode(x) for a, x in zip(aggs, xs)]
    payloads = [p for p, _ in encoded]
    assert all(p.dtype == torch.float32 for p in payloads), "a float payload: BytePS divides, never floor-divides"
    order = list(range(world))[::-1] if reverse else None
    avg = byteps_average(payloads, order)
    truth = torch.stack([x.double() for x in xs]).mean(0)
    outs = [a.decode(avg.clone(), ctx) for a, (_, ctx) in zip(aggs, encoded)]
    for a, out in zip(aggs, outs):
        assert out.averaged and (out.report.ok or out.needs_partial), out.report
        if out.needs_partial:   # inexact keys: completed by the SUM of every rank's values there
            a.finish_partial(sum(partial_values(ctx, out.partial) for _, ctx in encoded), out)
        assert torch.equal(out.value != 0, truth != 0), "the support is exact"
        assert float((out.value.double() - truth).abs().max()) <= 1e-6 * max(1.0, float(truth.abs().max()))
        assert torch.equal(out.value, outs[0].value), "every rank decodes the same bits"


def test_a_transposed_gradient_s_dense_fallback_is_pushed_contiguous():
    """A gradient stored transposed (not contiguous) that overloads the sketch falls back to a dense push of
    it: the push is contiguous (a clone kept the strides, which BytePS refuses) and the average is exact."""
    world = 2
    xs = [torch.randn(96, 64, generator=torch.Generator().manual_seed(r)).t() for r in range(world)]

    def worker(rank, engine):
        comp = Compression.lossless(engine=engine, max_density=0.001)
        agg = comp.aggregator("k", "w", xs[rank], world, rank)
        payload, enc = comp.encode(agg, xs[rank])
        assert agg.compressed and not xs[rank].is_contiguous()
        engine.synchronize(engine.push_pull_async_inplace(payload, average=True, name="Gradient.w"))
        return comp.decode(payload, enc)

    outs = run_workers(SimulatedBytePS(world), worker)
    truth = (xs[0] + xs[1]) / 2
    for out in outs:
        assert out.shape == truth.shape and float((out - truth).abs().max()) <= 1e-6


@pytest.mark.parametrize("world", [2, 3, 5])
def test_topk_payload_survives_byteps_average(world):
    g = torch.Generator().manual_seed(world)
    xs = [torch.randn(5000, generator=g) for _ in range(world)]
    aggs = [TopKAggregator("w", (5000,), torch.float32, world, ratio=0.01) for _ in range(world)]
    encoded = [a.encode(x) for a, x in zip(aggs, xs)]
    sent = [ctx.dense_value for _, ctx in encoded]   # what top-k selected on each rank
    avg = byteps_average([p for p, _ in encoded])
    truth = torch.stack([s.double() for s in sent]).mean(0)
    for a, (_, ctx) in zip(aggs, encoded):
        out = a.decode(avg.clone(), ctx)
        assert out.averaged and out.report.ok
        assert torch.equal(out.value != 0, truth != 0)
        assert float((out.value.double() - truth).abs().max()) <= 1e-6


@pytest.mark.parametrize("world", [2, 3, 5])
def test_thc_payload_survives_byteps_average(world):
    """THC's float64 payload, averaged by BytePS, decodes on every rank alike to the average of what a
    twin world of ranks decodes from the plain sum of the same gradients. (The agreed norm read back from
    an average can differ from the sum's in its last bits, so later steps may round a few coordinates to
    the neighbouring level: the comparison is relative.)"""
    g = torch.Generator().manual_seed(world)
    ranks = [THCAggregator("w", (8192,), torch.float32, world, r) for r in range(world)]
    twins = [THCAggregator("w", (8192,), torch.float32, world, r) for r in range(world)]
    assert ranks[0].compressed
    for step in range(4):
        xs = [torch.randn(8192, generator=g) for _ in range(world)]
        encoded = [a.encode(x) for a, x in zip(ranks, xs)]
        twin_enc = [a.encode(x) for a, x in zip(twins, xs)]
        assert all(p.dtype == torch.float64 for p, _ in encoded), "a float payload: BytePS divides it"
        avg = byteps_average([p for p, _ in encoded])
        summed = torch.stack([p for p, _ in twin_enc]).sum(0)
        outs = [a.decode(avg.clone(), ctx) for a, (_, ctx) in zip(ranks, encoded)]
        ref = [a.decode(summed.clone(), ctx) for a, (_, ctx) in zip(twins, twin_enc)][0]
        for out in outs:
            assert out.averaged
            assert torch.equal(out.value, outs[0].value), "replicas decode the same bits"
        assert not ref.averaged
        diff = float((outs[0].value.double() * world - ref.value.double()).norm())
        assert diff <= 1e-3 * max(float(ref.value.double().norm()), 1e-12), (step, diff)


class _PushPullFrame:
    """A caller frame like the optimizer's ``_push_pull_grad_async(self, p)`` that also pushes the
    payload (``average=True`` under ``Gradient.<name>``) and decompresses what comes back."""

    def __init__(self, named, engine):
        self._parameter_names = {p.__hash__(): n for n, p in named}
        self._is_tensor_instance = True
        self.engine = engine

    def _push_pull_grad_async(self, p, comp, tensor):
        payload, ctx = comp.compress(tensor)
        handle = self.engine.push_pull_async_inplace(payload, average=True,
                                                     name="Gradient." + self._parameter_names[p.__hash__()])
        return comp.decompress(self.engine.synchronize(handle), ctx)


@pytest.mark.parametrize("factory", ["none", "lossless", "topk", "thc", "auto"])
def test_integer_tensors_are_floor_divided_as_plain_byteps_does(factory):
    """Integer tensors never go through a codec (no payload is ever integer): through the plugin's
    compress -> BytePS push_pull(average=True) -> decompress they come back as uncompressed BytePS
    averages them: the server's integer sum, floor-divided by the number of workers, still int64."""
    world = 3
    xs = [torch.tensor([1, -1, 5, -7, 0, 2, -2, 4]), torch.tensor([0, 0, 3, 1, -1, 0, 0, 0]),
          torch.tensor([3, -3, -1, 2, 0, 0, -1, 1])]
    # sum [4, -4, 7, -4, -1, 2, -3, 5]; floor(sum / 3), where truncation would give [1, -1, 2, -1, 0, 0, -1, 1]
    floor_avg = torch.tensor([1, -2, 2, -2, -1, 0, -1, 1], dtype=torch.int64)
    sim = SimulatedBytePS(world)

    def worker(rank, engine):
        comp = (Compression.none if factory == "none" else
                getattr(Compression, factory)(engine=engine, **({"max_density": 0.5} if factory == "lossless" else {})))
        p = torch.zeros(8, dtype=torch.int64)
        out = _PushPullFrame([("count", p)], engine)._push_pull_grad_async(p, comp, xs[rank].clone())
        return out, (comp.stats() if factory != "none" else None)

    for out, st in run_workers(sim, worker):
        assert out.dtype == torch.int64 and torch.equal(out, floor_avg), out
        if st is not None:
            assert st["compressed"] == 0 and st["sent_dense"] == 1, st
    assert sim.pushes["Gradient.count"] == [(8, torch.int64, True)]   # the integer tensor itself was pushed


def test_float_payloads_do_not_depend_on_the_floor():
    """Their header reads back the number of workers: every payload is floating point."""
    lossless = TensorAggregator("e", (1000, 8), torch.float32, 3, max_density=0.01)
    assert lossless.compressed and lossless.encode(torch.zeros(1000, 8))[0].dtype.is_floating_point
