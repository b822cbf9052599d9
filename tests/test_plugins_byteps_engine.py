"""BytePS plugin: what the compressors hand BytePS, driven one call at a time (no training loop).

The engine seam (BytePSEngine is byteps.torch.ops); the parameter names read from the optimizer and the names
declared to BytePS (in order, before their pushes); the refusals at the push (sparse gradients, async mode, a
call from outside the optimizer); the fitting of payloads to BytePS's fixed key sizes (padding, widening, tails,
the bytes counted). Training through simulated BytePS: tests/test_plugins_byteps_training.py; configuration
and payload averaging: tests/test_plugins_byteps.py.
"""
from __future__ import annotations

import sys

import pytest
import torch

from byteps_sim import SimulatedBytePS, run_workers
from lossless_hc.training.adapter import wire_numel
from lossless_hc.plugins import byteps as plugin
from lossless_hc.plugins.byteps import Compression


# -- helpers -------------------------------------------------------------------------------------------

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


# -- refusals at the push -----------------------------------------------------------------------------------

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
