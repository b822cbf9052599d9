"""Horovod adapter: compressors for ``hvd.DistributedOptimizer(compression=...)``.

    import horovod.torch as hvd
    from lossless_hc.plugins.horovod import Compression
    comp = Compression.lossless(max_density=0.01)
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                   compression=comp, op=hvd.Average)
    ...
    comp.stats()   # bytes sent vs dense, fallbacks, encode/decode time

    comp = Compression.auto(lossy=False)   # recommended: the planner picks each tensor's strategy

``Compression.auto`` (:mod:`lossless_hc.training.auto`): per tensor, the strategy the cost model
predicts cheapest. It calibrates when it is constructed -- blocking Horovod collectives, so every rank
must construct it at the same program point, after ``hvd.init()`` -- and issues no blocking collective
from ``compress``/``decompress`` but the step guard's verdict (below): a strategy's second collective
(allgather, two_phase's values, fp16, a sketch's exact fallback) is an asynchronous Horovod operation
named after the tensor, started from ``decompress`` and waited for when the step's last tensor is
decompressed (as the dense fallback below); the tensor ``decompress`` returned is filled in place then.
Its step guard (``guard_steps``, on by default, :mod:`lossless_hc.training.guard`) times the plans
against every tensor sent as it is (with ``lossy``, the float32 ones as ``Compression.fp16`` sends
them), alternating blocks of two whole steps (the second timed, as the
first pays Horovod's renegotiation of tensors whose payload changed), and keeps them only if they
measure faster; the verdict is the process set's first rank's, a blocking Horovod broadcast from
``decompress`` when the trial's last step ends: every rank reaches it at the same step count, after
its last tensor's operations (and second collectives) completed, so nothing of the step is outstanding.

Horovod calls ``compress(grad)`` in each parameter's gradient hook, allreduces the returned payload
in place (SUM or AVERAGE: another ``op`` is a ValueError), and calls ``decompress(payload, ctx)`` from
``optimizer.step()``. A compressor serves one ``DistributedOptimizer`` at a time (its step, whose
fallbacks it waits for, ends with its last tensor): two optimizers of one model need one each. The
policy (dense or compressed, capacity, error feedback) is :mod:`lossless_hc.training.aggregate`, and the
per-parameter bookkeeping shared with the BytePS plugin is :mod:`lossless_hc.training.adapter`; this module
only adds what is Horovod's: process sets, the Adasum and sparse-gradient checks, the dense
fallback as a Horovod allreduce, and bfloat16: Horovod has no bfloat16 allreduce, so a bfloat16
tensor sent as it is (dense, or a fallback's or inexact keys' values) travels as float32 and its sum
is rounded back once, and ``auto`` never plans its bf16 strategy here. Whether Horovod averaged is
taken from the optimizer's ``op``, not read from the payload: after ``hvd.join()`` the joined ranks
contribute zeros and an AVERAGE is still divided by the world size, so a payload's contributor count
cannot tell a SUM of fewer ranks from an AVERAGE of all (``lossless`` then falls back to a dense sum
of the ranks still training, as ``topk`` does; ``auto`` decodes dense plans and refuses other plans
clearly, ``thc`` every step after a join: ConfigurationMismatch naming ``hvd.join()``).

Which parameter? ``compress`` receives only the tensor. The optimizer's hook calls it from
``_allreduce_grad_async(self, p)`` (or a comprehension over ``ps`` for ``groups=``), so the caller's
frame holds the parameter ``p`` and the optimizer, whose ``_parameter_names`` give its name
(:func:`lossless_hc.training.adapter.find_optimizer_frame`). That
keeps error feedback attached to the parameter whatever happens to ``p.grad`` (``set_to_none``,
``sparse_as_dense`` copies).

Fallback without deadlock: a payload that fails to decode is re-aggregated densely with an
*asynchronous* Horovod allreduce issued from ``decompress``; the compressor waits for all of them
when the last outstanding tensor of the step has been decompressed. Every rank issues the same
fallbacks (they decode the same aggregate), and Horovod matches asynchronous operations by name, so
the order in which ranks reach them does not matter. A tensor whose decode reported a few inexact
keys is completed the same way with a Horovod allreduce of just those keys' coordinates
(``lhc.partial.<name>``), issued when the step's last tensor has been decompressed.
"""
from __future__ import annotations


import torch

import hashlib

from lossless_hc.training.adapter import (CompressionFactory, CompressorAdapter, refuse_uncalled,
                                          require_optimizer_frame)
from lossless_hc.training.aggregate import ConfigurationMismatch
from lossless_hc.training.auto import AutoCompressorAdapter, AutoSpec, as_strategies
from lossless_hc.training.guard import GUARD_MARGIN, GUARD_START, GUARD_STEPS, step_guard
from lossless_hc.training.planner import STRATEGIES
from lossless_hc.training.planner import Calibration  # noqa: F401  (re-exported for users)
from lossless_hc.training.capacity import CapacityPolicy  # noqa: F401  (re-exported for users)

try:
    import horovod.torch as hvd
except ImportError as e:  # pragma: no cover - exercised only without Horovod
    raise ImportError("lossless_hc.plugins.horovod needs Horovod (scripts/setup_horovod.sh builds it)") from e


# What auto may plan on Horovod: every strategy but bf16, whose allreduce Horovod's torch operations
# do not have (a bfloat16 *gradient* is fine: auto carries it in a float32 message).
HOROVOD_STRATEGIES = tuple(s for s in STRATEGIES if s != "bf16")


class HorovodCompressor(CompressorAdapter):
    """Horovod's Compressor interface over :class:`CompressorAdapter` (one per ``Compression`` factory call)."""

    def __init__(self, spec):
        super().__init__(spec)
        self._optimizer = None       # the hvd.DistributedOptimizer that calls us (found on first use)
        self._owner = None           # ... whose step is in flight (or was last)
        self._process_set = hvd.global_process_set

    # -- Horovod's Compressor interface --------------------------------------------------------
    def compress(self, tensor: torch.Tensor):
        p, opt = require_optimizer_frame(self, "hvd.DistributedOptimizer(compression=...)")
        if tensor.requires_grad or tensor is p:
            raise ValueError("Adasum is non-linear (it is not a sum), so a homomorphic sketch cannot pass through it; "
                             "use op=hvd.Average or op=hvd.Sum with lossless_hc compression")
        if opt.op not in (hvd.Average, hvd.Sum):   # a fallback SUM beside a MAX would mix two reductions
            raise ValueError(f"lossless_hc compression sums payloads: op={opt.op} is not a sum; use op=hvd.Average "
                             "or op=hvd.Sum")
        self._check_step(opt)
        agg = self._aggregator(p, opt, tensor)
        payload, ctx = self.encode(agg, tensor)
        if payload.dtype == torch.bfloat16:   # a tensor sent as it is, in a dtype Horovod cannot reduce
            agg.stats.count_widened(payload.numel(), torch.bfloat16, torch.float32)
            return payload.float(), _CarriedAsFloat32(ctx)
        return payload, ctx

    def decompress(self, tensor: torch.Tensor, ctx) -> torch.Tensor:
        if ctx is None:
            # Horovod sends a sparse gradient around compress() (an allgather) and still calls
            # decompress(output, None): a model whose gradients are all sparse gets here first.
            raise ValueError("a sparse gradient reached the compressor, which Horovod sends uncompressed; pass "
                             "sparse_as_dense=True to hvd.DistributedOptimizer")
        if self._optimizer is not None:
            # Every gradient exists by now; a sparse one went around the compressor.
            self._check_sparse_gradients(self._optimizer)
            self._optimizer = None
        if isinstance(ctx, _CarriedAsFloat32):   # the float32 sum (or average), rounded once
            tensor, ctx = tensor.to(torch.bfloat16), ctx.ctx
        return self.decode(tensor, ctx)

    def _check_step(self, opt) -> None:
        """A step ends when its last compressed tensor is decompressed: then its fallbacks are waited for.
        So one optimizer's step at a time: a second optimizer compressing while the first's tensors are in
        flight is a ValueError (its step would end, and its fallbacks be waited for, only after the
        other's, which then reads gradients still being summed). A step whose Horovod handles were all
        dropped (``load_state_dict`` on the optimizer, an elastic restore) will never be decompressed:
        forgotten, so that the next one ends when its own tensors are decompressed."""
        if self._pending and self._owner is not None:
            in_flight = any(h is not None for h, _ in getattr(self._owner, "_handles", {}).values())
            if not in_flight:
                self.drop_step()
            elif opt is not self._owner:
                raise ValueError("one lossless_hc compressor serves one hvd.DistributedOptimizer at a time, and "
                                 "another optimizer's tensors are in flight: give each optimizer its own (call "
                                 "the Compression factory once per optimizer)")
        self._owner = opt

    # -- the dense fallback on Horovod -----------------------------------------------------------
    def _start_fallback(self, agg, dense):
        return self._sum_in_place(agg, dense, f"lhc.fallback.{agg.name}")

    def _start_partial(self, agg, values):
        return self._sum_in_place(agg, values, f"lhc.partial.{agg.name}")

    def _sum_in_place(self, agg, tensor: torch.Tensor, name: str):
        carried = tensor
        if tensor.dtype == torch.bfloat16:
            carried = tensor.float()
            agg.stats.count_widened(tensor.numel(), torch.bfloat16, torch.float32)
        return hvd.allreduce_async_(carried, name=name, op=hvd.Sum, process_set=self._process_set), carried, tensor

    def _wait_fallback(self, handle) -> None:
        h, carried, tensor = handle
        hvd.synchronize(h)
        if carried is not tensor:
            tensor.copy_(carried)

    # -- helpers -------------------------------------------------------------------------------
    def _aggregator(self, p: torch.nn.Parameter, opt, tensor: torch.Tensor):
        agg = self._aggregators.get(p)
        if agg is None:   # the name and the process set's size and rank only on first use: calls into Horovod
            if not self._aggregators:
                self._optimizer = opt
            self._process_set = getattr(opt, "process_set", hvd.global_process_set)
            name = opt._parameter_names.get(p) or f"param{len(self._aggregators)}"
            agg = self.aggregator(p, name, tensor, self._process_set.size(), self._process_set.rank())
        # Read from the optimizer, not the payload: after hvd.join() fewer ranks contribute, and a SUM of
        # one rank's payload would read as an AVERAGE of all (aggregate.payload_is_averaged).
        agg.engine_averages = opt.op == hvd.Average
        return agg

    def _check_sparse_gradients(self, opt) -> None:
        """Horovod aggregates sparse gradients itself (allgather) unless ``sparse_as_dense=True``,
        so they would silently bypass the compressor: refuse instead."""
        if getattr(opt, "sparse_as_dense", False):
            return
        for group in opt.param_groups:
            for q in group["params"]:
                if isinstance(getattr(q, "grad", None), torch.Tensor) and q.grad.is_sparse:
                    raise ValueError(f"parameter {opt._parameter_names.get(q)!r} has a sparse gradient, which Horovod "
                                     "sends uncompressed; pass sparse_as_dense=True to hvd.DistributedOptimizer")


def _root(process_set) -> int:
    """The process set's first rank, as the global rank Horovod's broadcast takes for its root."""
    return process_set.ranks[0] if getattr(process_set, "ranks", None) else 0


class _CarriedAsFloat32:
    """``ctx`` of a bfloat16 payload that went to Horovod as float32: Horovod's torch operations reduce
    float32/64, float16 and int32/64 tensors only (``horovod.torch.mpi_ops``), not bfloat16. The
    widening is exact, and the sum is rounded back to bfloat16 once (a bfloat16 allreduce would round
    at every addition)."""

    __slots__ = ("ctx",)

    def __init__(self, ctx):
        self.ctx = ctx


class AutoHorovodCompressor(AutoCompressorAdapter, HorovodCompressor):
    """``Compression.auto``: the planner over Horovod (second collectives as named async operations)."""

    _constructed = 0   # per process: names the calibration's operations (every rank counts alike)

    def calibrate(self, process_set) -> None:
        """Check the configuration and calibrate on ``process_set`` (blocking; every rank, same point)."""
        type(self)._constructed += 1
        self._instance = type(self)._constructed
        prefix = f"lhc.auto{self._instance}.calibrate"
        n, rank = process_set.size(), process_set.rank()
        g = self._guard   # part of the configuration: a rank without it would miss the verdict's broadcast
        guard = f"guard(steps={g.steps}, start={g.start}, margin={g.margin})" if g is not None else "no guard"
        h = int.from_bytes(hashlib.sha256(f"{self.spec!r} {guard}".encode()).digest()[:6], "little")
        mine = torch.tensor([float(h)], dtype=torch.float64)   # 48 bits: exact in float64
        root = hvd.broadcast(mine, _root(process_set), name=f"{prefix}.config", process_set=process_set)
        differs = hvd.allreduce(torch.tensor([float(not torch.equal(root, mine))]), op=hvd.Sum,
                                name=f"{prefix}.verdict", process_set=process_set)
        if float(differs) > 0:
            raise ConfigurationMismatch(f"Compression.auto differs across ranks; this rank has {self.spec!r}, {guard}")
        if self.spec.calibration is not None:
            return
        count = [0]

        def name(kind):
            count[0] += 1
            return f"{prefix}.{kind}{count[0]}"

        self.spec.measure(   # the model is not known here: the sizes of 4 MiB (link_sizes)
            lambda t: hvd.allreduce_(t, op=hvd.Sum, name=name("ar"), process_set=process_set),
            lambda t: hvd.allgather(t, name=name("ag"), process_set=process_set),
            lambda t: t.copy_(hvd.broadcast(t, _root(process_set), name=name("bc"), process_set=process_set)),
            rank, n, "cpu")

    def _broadcast_verdict(self, verdict):
        t = torch.tensor([float(v) for v in verdict], dtype=torch.float64)
        root = hvd.broadcast(t, _root(self._process_set), name=f"lhc.auto{self._instance}.guard",
                             process_set=self._process_set)
        return tuple(root.tolist())

    def _start_request(self, agg, request):
        name = f"lhc.auto.{request.kind}.{agg.name}"
        if request.kind == "allgather":
            return request.kind, hvd.allgather_async(request.tensor.reshape(1, -1), name=name,
                                                     process_set=self._process_set)
        return request.kind, hvd.allreduce_async_(request.tensor, name=name, op=hvd.Sum,
                                                  process_set=self._process_set)

    def _wait_request(self, handle):
        kind, h = handle
        return hvd.synchronize(h)


class Compression(CompressionFactory):
    """Factories for ``hvd.DistributedOptimizer(compression=...)`` (:class:`CompressionFactory`:
    ``lossless``, ``topk``, ``thc``) and the planner ``auto``; Horovod's own ``none`` and ``fp16`` are
    re-exported so examples can switch with one name."""

    compressor = HorovodCompressor
    none = hvd.Compression.none
    fp16 = hvd.Compression.fp16

    @classmethod
    def auto(cls, lossy: bool = False, process_set=None, guard_steps: int = GUARD_STEPS,
             guard_start: int = GUARD_START, guard_margin: float = GUARD_MARGIN, **options):
        """The planner (recommended): per tensor, the cheapest exact strategy (dense, allgather,
        two_phase, sketch), or of every strategy with ``lossy`` (fp16, THC, top-k too; not bf16, which
        Horovod cannot allreduce: ``first="bf16"`` or ``strategies`` naming it are a ValueError).
        ``options``: :class:`lossless_hc.training.auto.AutoSpec`. Calibrates on ``process_set`` (None:
        every rank) at construction: call it on every rank at the same point, after ``hvd.init()``.

        ``guard_steps``, ``guard_start``, ``guard_margin``: the step guard (:mod:`lossless_hc.training.guard`,
        as DDP's ``AutoHookState``; 0 steps: none): once some tensor's plan is not dense (from step index
        ``guard_start``), ``guard_steps`` timed steps of the plans alternate with as many steps of every
        tensor sent as it is (Horovod's own allreduce; with ``lossy`` and fp16 among the strategies, a float32
        tensor in float16, as ``Compression.fp16`` sends it; in blocks of two steps, the second timed; as many
        more of each confirm a first look for the plans, unless it found them twice as fast); unless the plans'
        median step is ``guard_margin`` faster, every tensor is sent so from then on (THC's and top-k's error
        feedback with the next step), and the process set's first rank's verdict (a Horovod broadcast at the end
        of the trial's last step) holds on every rank. A step ends when its last tensor is decompressed
        (``optimizer.step()``).
        ``stats()["plan"]``: per tensor, the chosen strategy, predicted and measured seconds, bytes sent;
        ``stats()["guard"]``: the verdict, the first rank's medians, the trials opened and how many tensors
        the dense window sends as each plain step (``"alternative"``)."""
        if process_set is not None and not isinstance(process_set, hvd.ProcessSet):
            raise TypeError(f"process_set must be a horovod ProcessSet (e.g. hvd.global_process_set) or None, got "
                            f"{type(process_set).__name__}")
        guard = step_guard(guard_steps, guard_start, guard_margin)
        strategies = as_strategies(options.get("strategies"))
        if options.get("first") == "bf16" or "bf16" in (strategies or ()):
            raise ValueError("Horovod cannot allreduce bfloat16 tensors (its torch operations take float32/64, "
                             "float16 and int32/64), so auto cannot plan bf16 on Horovod; fp16 halves a float32 "
                             "gradient's bytes too")
        options["strategies"] = HOROVOD_STRATEGIES if strategies is None else strategies   # () refused by AutoSpec
        spec = AutoSpec(lossy=lossy, **options)
        # Horovod reduces each tensor on its own, in its dtype: a float16 gradient's plain steps go as
        # float16, as Horovod's own allreduce sends it (bfloat16, which it cannot reduce: float32).
        spec.native_plain_dtypes = (torch.float16,)
        comp = AutoHorovodCompressor(spec)
        comp.use_guard(guard)
        comp.calibrate(process_set if process_set is not None else hvd.global_process_set)
        return comp


refuse_uncalled(Compression.auto)
