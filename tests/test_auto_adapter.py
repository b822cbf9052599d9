"""AutoCompressorAdapter (lossless_hc.training.auto), the per-tensor adapter of the Horovod and BytePS plugins,
in one process: each rank runs in a thread of its own, and an in-memory engine stands in for the collectives
(the first payloads' SUM, the named second collectives, the verdict's broadcast), so that every rank waits
for the others as the engine's own operations would. Its multi-process run is tests/test_planner_mp.py."""
import threading
import types

import torch

import lossless_hc.training.auto as auto
from lossless_hc.training.auto import AutoCompressorAdapter, AutoSpec
from lossless_hc.training.guard import StepGuard
from lossless_hc.training.planner import Calibration


class _Engine:
    """Every rank's value of one collective call, once all have made it (calls match by order)."""

    def __init__(self, n):
        self.n, self.slots, self.barrier = n, [None] * n, threading.Barrier(n, timeout=60)

    def exchange(self, rank, value):
        self.slots[rank] = value
        self.barrier.wait()
        out = list(self.slots)
        self.barrier.wait()
        return out


class _Adapter(AutoCompressorAdapter):
    """The plugin's part: a second collective runs when waited for (every rank waits in the same order), and
    records its tensor's name; the verdict is rank 0's."""

    def __init__(self, spec, engine, rank):
        super().__init__(spec)
        self.engine, self.rank, self.waited = engine, rank, []

    def _start_request(self, agg, request):
        return agg.name, request

    def _wait_request(self, handle):
        name, request = handle
        self.waited.append(name)
        ts = self.engine.exchange(self.rank, request.tensor)
        if request.kind == "allgather":
            return torch.stack([t.reshape(-1) for t in ts])
        return torch.stack([t.double() for t in ts]).sum(0).to(ts[0].dtype)

    def _broadcast_verdict(self, verdict):
        return self.engine.exchange(self.rank, verdict)[0]


def _run_ranks(n, body):
    """``body(rank, engine)`` on n threads; re-raises the first failure."""
    engine, errors = _Engine(n), []

    def target(rank):
        try:
            body(rank, engine)
        except BaseException as e:   # noqa: BLE001 - handed to the test's thread
            errors.append(e)
            engine.barrier.abort()
    threads = [threading.Thread(target=target, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def _step(adapter, aggs, engine, rank, xs):
    """One step of ``adapter``: every tensor encoded, the payloads SUMmed across ranks, every tensor decoded."""
    encoded = [adapter.encode(a, x.clone()) for a, x in zip(aggs, xs)]
    summed = engine.exchange(rank, [p for p, _ in encoded])
    return encoded, [adapter.decode(sum(s[i] for s in summed), enc) for i, (_, enc) in enumerate(encoded)]


def test_the_step_guard_runs_its_trial_on_the_adapter_s_steps_and_a_dense_verdict_sends_the_thc_memory_once(
        monkeypatch):
    """Two ranks, two THC tensors, the guard's trial of one step a window from step 2: steps 0-2 run the plan
    (THC's float64 payload), step 3 is the dense window (the tensors as they are, float32, their exact SUM:
    THC's memory waits), and the verdict, due at step 4, goes dense (the fake clock makes plan steps ten
    times slower): from then on every step is the exact SUM, and the first one also carries every rank's THC
    memory, once. The guard counts every step the adapter ends (removing the step count, or the call that
    ends a guard step, or adding the memory before the verdict, passed every single-process test)."""
    n, steps = 2, 7
    clock = threading.local()

    def perf_counter():   # each rank's own clock: a plan step takes 1 s, a dense one 0.1 s
        clock.now += 1.0 if clock.adapter._guard_phase == "plan" else 0.1
        return clock.now
    monkeypatch.setattr(auto, "time", types.SimpleNamespace(perf_counter=perf_counter))
    g = torch.Generator().manual_seed(0)
    xs = [[[torch.randn(4096, generator=g), torch.randn(2048, generator=g)] for _ in range(n)] for _ in range(steps)]
    seen = [[] for _ in range(n)]   # per rank and step: (phase, payload dtypes, guard steps after, outputs, memory)

    def body(rank, engine):
        clock.now = 0.0
        spec = AutoSpec(lossy=True, calibration=Calibration.default(1e9), first="thc", strategies=("thc",),
                        lossy_min_bytes=0)
        adapter = clock.adapter = _Adapter(spec, engine, rank)
        adapter.use_guard(StepGuard(steps=1, start=2, block=1, confirm=0))
        for s in range(steps):
            aggs = [adapter.aggregator(i, f"w{i}", x, n, rank) for i, x in enumerate(xs[s][rank])]
            phase = adapter._guard_phase
            memory = [a._thc.pending_error().clone() if a._thc is not None else None for a in aggs]
            encoded, outs = _step(adapter, aggs, engine, rank, xs[s][rank])
            seen[rank].append((phase, tuple(p.dtype for p, _ in encoded), adapter._guard_steps, outs, memory))
    _run_ranks(n, body)
    for rank in range(n):
        phases, dtypes, counted, outs, _ = zip(*seen[rank])
        assert phases == ("plan",) * 3 + ("dense",) * 4
        assert dtypes == ((torch.float64,) * 2,) * 3 + ((torch.float32,) * 2,) * 4
        assert counted == tuple(range(1, steps + 1))
        for s in (3, 5, 6):
            assert all(torch.equal(outs[s][i], xs[s][0][i] + xs[s][1][i]) for i in range(2)), s
        memory = [seen[r][4][4] for r in range(n)]   # every rank's THC memory when the verdict came
        for i in range(2):
            assert memory[0][i] is not None and memory[0][i].abs().max() > 0
            want = (xs[4][0][i] + memory[0][i]) + (xs[4][1][i] + memory[1][i])
            assert torch.equal(outs[4][i], want), i


def test_a_dropped_step_s_second_collectives_are_never_waited_for():
    """drop_step forgets the step in flight: a tensor decoded before it (its allgather started) is not waited
    for at the next step's end, and the next step ends after its own tensors (the pending count reset), each
    the exact SUM."""
    n = 2
    g = torch.Generator().manual_seed(1)

    def sparse(numel):
        x = torch.zeros(numel)
        x[torch.randperm(numel, generator=g)[:30]] = torch.randn(30, generator=g)
        return x
    xs = [[[sparse(3000), sparse(5000)] for _ in range(n)] for _ in range(2)]
    results = [None] * n

    def body(rank, engine):
        spec = AutoSpec(calibration=Calibration.default(1e9), first="allgather", strategies=("allgather",))
        adapter = _Adapter(spec, engine, rank)
        aggs = [adapter.aggregator(i, f"w{i}", x, n, rank) for i, x in enumerate(xs[0][rank])]
        encoded = [adapter.encode(a, x.clone()) for a, x in zip(aggs, xs[0][rank])]
        summed = engine.exchange(rank, [p for p, _ in encoded])
        adapter.decode(summed[0][0] + summed[1][0], encoded[0][1])   # its allgather started, not waited for
        adapter.drop_step()
        _, outs = _step(adapter, aggs, engine, rank, xs[1][rank])
        results[rank] = (adapter.waited, outs)
    _run_ranks(n, body)
    for waited, outs in results:
        assert waited == ["w0", "w1"]
        assert all(torch.equal(outs[i], xs[1][0][i] + xs[1][1][i]) for i in range(2))


def test_an_integer_tensor_passes_through_the_adapter_as_the_engine_s_sum():
    """An integer tensor (a step counter) gets AutoSpec.make's pass-through aggregator, and the adapter hands
    back what the engine summed (CompressorAdapter's result), beside a planned float32 tensor of the same
    step."""
    n = 2
    xs = [[torch.tensor([3, 1 << 40, -7]), torch.randn(512, generator=torch.Generator().manual_seed(r))]
          for r in range(n)]
    results = [None] * n

    def body(rank, engine):
        adapter = _Adapter(AutoSpec(calibration=Calibration.default(1e9)), engine, rank)
        aggs = [adapter.aggregator(i, f"w{i}", x, n, rank) for i, x in enumerate(xs[rank])]
        results[rank] = _step(adapter, aggs, engine, rank, xs[rank])[1]
    _run_ranks(n, body)
    for counter, dense in results:
        assert counter.dtype == torch.int64 and torch.equal(counter, xs[0][0] + xs[1][0])
        assert torch.equal(dense, xs[0][1] + xs[1][1])


def test_the_guard_compares_the_dense_tensors_plans_only():
    """The plans the step guard compares (_dense_plans) are the dense gradients', in name order: a sparse
    gradient's (which the dense window leaves on its plan) and an integer tensor's pass-through are not
    among them."""
    spec = AutoSpec(calibration=Calibration.default())
    adapter = AutoCompressorAdapter(spec)
    tensors = (("c", torch.zeros(4096)), ("b", torch.zeros(100, 4).to_sparse()),
               ("n", torch.zeros(3, dtype=torch.int64)), ("a", torch.zeros(4096)))
    for name, tensor in tensors:
        adapter.aggregator(name, name, tensor, 2, 0)
    adapter.aggregators()["a"].strategy = "sketch"
    assert adapter.aggregators()["b"].sparse
    assert adapter._dense_plans() == ("sketch", "dense")
