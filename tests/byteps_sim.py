"""An in-process stand-in for BytePS 0.2.5, for the CPU tests of lossless_hc.plugins.byteps.

It reproduces what the compressors depend on, as read from BytePS's sources (byteps/torch/ops.py,
ops.cc, common/operations.cc and global.cc, server/server.cc, torch/__init__.py):

* ``push_pull_async_inplace(tensor, average, name)``: every worker's tensor of that name is summed
  in the tensor's own dtype (the server's CPU reducer; the order in which pushes arrive is the
  server's, so it is a parameter here), and each worker receives the sum in place, divided by the
  number of workers when ``average`` (``div_`` for floating tensors, ``floor_divide_`` for integer
  ones, ops.cc).
* A name is numbered by its declaration (``declare`` or the first push of an undeclared name): key =
  position in that worker's declaration order. Workers that declared names in different orders
  would exchange different tensors under one key; the simulator refuses that.
* A key's byte size and dtype are fixed by its first push (``InitTensor`` partitions the key and
  the server allocates its buffer once); a later push of another size is an error.
* ``BytePSLikeOptimizer`` drives a compressor the way ``byteps.torch._DistributedOptimizer`` does:
  a hook on each gradient accumulator calls ``_push_pull_grad_async(self, p)``, which calls
  ``compression.compress(p.grad)`` and pushes the result under ``"Gradient." + name`` with
  ``average=True``; ``synchronize()`` waits for every handle and sets
  ``p.grad.set_(compression.decompress(output, ctx))``, with BytePS's ``ctx``: the last handle's, for every
  parameter (its loop reuses the variable of the loop before); then the wrapped optimizer steps.

Worker "processes" are threads; ``run_workers`` starts one per rank and re-raises the first error.
``byteps_modules(sim)`` gives modules ``byteps``, ``byteps.torch`` and ``byteps.torch.ops`` over the
simulator (each call as the calling thread's rank), so that a BytePS training script such as
tests/mp/byteps_worker.py runs unchanged on simulated workers.
"""
from __future__ import annotations

import threading
import types
from collections import defaultdict

import torch


class SimulatedBytePS:
    def __init__(self, world_size: int, order=None, timeout: float = 60.0):
        self.n = world_size
        self.order = list(order) if order is not None else list(range(world_size))
        assert sorted(self.order) == list(range(world_size))
        self.timeout = timeout
        self.cond = threading.Condition()
        self.keys = [dict() for _ in range(world_size)]         # rank -> name -> key
        self.lazily_declared = [set() for _ in range(world_size)]  # names first seen in a push
        self.rounds = [defaultdict(int) for _ in range(world_size)]
        self.pending = {}      # (name, round) -> {rank: (tensor, average, key)}
        self.done = set()
        self.key_shape = {}    # key -> (numel, dtype) of its first push
        self.pushes = defaultdict(list)   # name -> [(numel, dtype, average)] one per aggregation
        self.server_bytes = defaultdict(int)  # name -> bytes the server received (all workers)
        self.failed = None

    def engine(self, rank: int) -> "RankEngine":
        return RankEngine(self, rank)

    # -- one worker's calls ------------------------------------------------------------------------
    def declare(self, rank: int, name: str) -> None:
        with self.cond:
            keys = self.keys[rank]
            if name not in keys:
                keys[name] = len(keys)

    def push(self, rank: int, tensor: torch.Tensor, average: bool, name: str):
        if not tensor.is_contiguous():
            raise ValueError("Tensor is required to be contiguous.")
        with self.cond:
            if name not in self.keys[rank]:
                self.lazily_declared[rank].add(name)
                self.keys[rank][name] = len(self.keys[rank])
            r = self.rounds[rank][name]
            self.rounds[rank][name] += 1
            self.pending.setdefault((name, r), {})[rank] = (tensor, bool(average), self.keys[rank][name])
            self.cond.notify_all()
            return (name, r, rank)

    def synchronize(self, handle) -> torch.Tensor:
        name, r, rank = handle
        with self.cond:
            ok = self.cond.wait_for(lambda: self.failed is not None or (name, r) in self.done
                                    or len(self.pending.get((name, r), ())) == self.n, timeout=self.timeout)
            if self.failed is not None:
                raise RuntimeError(f"another worker failed: {self.failed!r}")
            if not ok:
                raise TimeoutError(f"rank {rank}: push_pull {name!r} #{r} never completed (ranks pushed: "
                                   f"{sorted(self.pending.get((name, r), {}))})")
            if (name, r) not in self.done:
                self._reduce(name, r)
            entry = self.pending[(name, r)]
            return entry[rank][0]

    def fail(self, exc: BaseException) -> None:
        with self.cond:
            if self.failed is None:
                self.failed = exc
            self.cond.notify_all()

    # -- the server ----------------------------------------------------------------------------------
    def _reduce(self, name: str, r: int) -> None:
        entry = self.pending[(name, r)]
        keys = {k for _, _, k in entry.values()}
        if len(keys) != 1:
            raise AssertionError(f"{name!r} has different keys on different workers {keys}: names were declared in "
                                 "different orders")
        key = keys.pop()
        tensors = [entry[q][0] for q in range(self.n)]
        shapes = {(t.numel(), t.dtype) for t in tensors}
        if len(shapes) != 1:
            raise AssertionError(f"{name!r}: workers pushed different sizes/dtypes {shapes}")
        shape = shapes.pop()
        first = self.key_shape.setdefault(key, shape)
        if first != shape:
            raise AssertionError(f"{name!r} (key {key}) was first pushed as {first}, now as {shape}: BytePS fixes a "
                                 "key's size at its first push")
        averages = {entry[q][1] for q in range(self.n)}
        assert len(averages) == 1, averages
        average = averages.pop()
        acc = tensors[self.order[0]].detach().reshape(-1).clone()
        for q in self.order[1:]:
            acc += tensors[q].detach().reshape(-1)
        if average:
            if acc.dtype.is_floating_point:
                acc.div_(self.n)
            else:
                acc.floor_divide_(self.n)
        for t in tensors:
            t.detach().reshape(-1).copy_(acc)
        self.pushes[name].append((shape[0], shape[1], average))
        self.server_bytes[name] += self.n * shape[0] * tensors[0].element_size()
        self.done.add((name, r))
        self.cond.notify_all()


class RankEngine:
    """One worker's view: the interface of lossless_hc.plugins.byteps.BytePSEngine."""

    def __init__(self, sim: SimulatedBytePS, rank: int):
        self.sim, self._rank = sim, rank

    def size(self) -> int:
        return self.sim.n

    def rank(self) -> int:
        return self._rank

    def declare(self, name: str) -> None:
        self.sim.declare(self._rank, name)

    def push_pull_async_inplace(self, tensor, average, name):
        return self.sim.push(self._rank, tensor, average, name)

    def synchronize(self, handle):
        return self.sim.synchronize(handle)


class BytePSLikeOptimizer:
    """The call structure of ``byteps.torch._DistributedOptimizer`` (0.2.5, synchronous mode)."""

    def __init__(self, optimizer, named_parameters, compression, engine, backward_passes_per_step: int = 1):
        self.optimizer = optimizer
        self._compression = compression
        self._engine = engine
        named = list(named_parameters)
        self._enable_async = False
        self._is_tensor_instance = True
        self._parameter_names = {v.__hash__(): k for k, v in sorted(named, key=lambda kv: kv[0])}
        self._handles = {}
        self._grad_accs = []
        self._requires_update = set()
        self._delay = {v: backward_passes_per_step for _, v in named}
        self.backward_passes_per_step = backward_passes_per_step
        if engine.size() > 1:
            self._register_hooks()
        for name in sorted(self._parameter_names.values()):
            engine.declare("Gradient." + name)
        for name in sorted(self._parameter_names.values()):
            engine.declare("Parameter." + name)

    def _register_hooks(self):
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                if p.requires_grad:
                    p.grad = p.data.new(p.size()).zero_()
                    self._requires_update.add(p)
                    grad_acc = p.expand_as(p).grad_fn.next_functions[0][0]
                    grad_acc.register_hook(self._make_hook(p))
                    self._grad_accs.append(grad_acc)

    def _push_pull_grad_async(self, p):
        name = self._parameter_names.get(p.__hash__())
        tensor = p.grad
        tensor_compressed, ctx = self._compression.compress(tensor)
        handle = self._engine.push_pull_async_inplace(tensor_compressed, average=True, name="Gradient." + name)
        return handle, ctx

    def _make_hook(self, p):
        def hook(*ignore):
            handle, ctx = None, None
            self._delay[p] -= 1
            if self._delay[p] == 0:
                handle, ctx = self._push_pull_grad_async(p)
            self._handles[p] = (handle, ctx)
        return hook

    def zero_grad(self):
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.grad.detach_()
                    p.grad.zero_()

    def synchronize(self):
        for p in self._requires_update - set(self._handles):
            self._handles[p] = self._push_pull_grad_async(p)
        for p, value in self._handles.items():
            handle, ctx = value
            if handle is None:
                handle, ctx = self._push_pull_grad_async(p)
                self._handles[p] = (handle, ctx)
        # As in BytePS 0.2.5: `ctx` is left over from the loop above (the last handle's), for every parameter.
        for p, (handle, _) in self._handles.items():
            output = self._engine.synchronize(handle)
            self._delay[p] = self.backward_passes_per_step
            p.grad.set_(self._compression.decompress(output, ctx))
        self._handles.clear()

    def step(self):
        self.synchronize()
        self.optimizer.step()


_THREAD = threading.local()   # .rank: the simulated worker this thread is (set by run_workers)


def byteps_modules(sim: SimulatedBytePS) -> dict:
    """``{"byteps": ..., "byteps.torch": ..., "byteps.torch.ops": ...}`` for ``sys.modules``: BytePS's
    Python API as the compressors and a training script use it, each call going to ``sim`` as the
    calling thread's rank (no ``Compression``: lossless_hc.plugins.byteps then uses its own no-op ones)."""
    def engine():
        return sim.engine(_THREAD.rank)

    ops = types.ModuleType("byteps.torch.ops")
    ops.size = lambda: sim.n
    ops.rank = lambda: _THREAD.rank
    ops.local_rank, ops.local_size = (lambda: 0), (lambda: 1)   # each worker its own machine, as launched
    ops.declare = lambda name: engine().declare(name)
    ops.push_pull_async_inplace = lambda tensor, average=True, name=None, version=0, priority=0: \
        engine().push_pull_async_inplace(tensor, average, name)
    ops.synchronize = lambda handle: engine().synchronize(handle)
    bt = types.ModuleType("byteps.torch")
    for name in ("size", "rank", "local_rank", "local_size", "declare", "push_pull_async_inplace", "synchronize"):
        setattr(bt, name, getattr(ops, name))
    bt.ops = ops
    bt.init = bt.shutdown = lambda: None
    bt.DistributedOptimizer = lambda optimizer, named_parameters, compression, backward_passes_per_step=1: \
        BytePSLikeOptimizer(optimizer, named_parameters, compression, engine(), backward_passes_per_step)
    root = types.ModuleType("byteps")
    root.torch = bt
    return {"byteps": root, "byteps.torch": bt, "byteps.torch.ops": ops}


def run_workers(sim: SimulatedBytePS, fn, timeout: float = 120.0) -> list:
    """``fn(rank, engine)`` on one thread per rank; the results by rank, or the first error raised."""
    results = [None] * sim.n
    errors = [None] * sim.n

    def body(rank):
        try:
            _THREAD.rank = rank
            torch.set_num_threads(1)
            results[rank] = fn(rank, sim.engine(rank))
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors[rank] = e
            sim.fail(e)

    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(sim.n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
        if t.is_alive():
            raise TimeoutError("a simulated BytePS worker did not finish")
    first = next((e for e in errors if e is not None and not str(e).startswith("another worker failed")), None)
    first = first or next((e for e in errors if e is not None), None)
    if first is not None:
        raise first
    return results
