"""BytePS adapter: compressors for ``byteps.torch.DistributedOptimizer(compression=...)``.

    import byteps.torch as bps
    from lossless_hc.plugins.byteps import Compression
    comp = Compression.lossless(max_density=0.01)      # or Compression.from_env()
    opt = bps.DistributedOptimizer(opt, named_parameters=model.named_parameters(), compression=comp)
    ...
    comp.stats()   # bytes sent vs dense, fallbacks, encode/decode time

How BytePS (0.2.5) drives a compressor: the optimizer's gradient hook calls
``_push_pull_grad_async(self, p)``, which calls ``compress(p.grad)`` and pushes the returned tensor
with ``push_pull_async_inplace(payload, average=True, name="Gradient." + name)``; ``step()`` waits
for each handle and sets ``p.grad`` to ``decompress(output, ctx)``. The server sums what the
workers push in the pushed dtype and the worker divides the result by the number of workers
(integer tensors are floor-divided). So:

* **Averaging.** BytePS always averages. Every payload here is floating point (the lossless codec's
  float32, THC's float64, or the dense gradient itself), so the average is a float division, and
  the decoders read the payload's header to know it was averaged (``averaged=True``): the header's
  integer fields come back within 1/2 of an integer after scaling by the world size, and the
  decoded values are the average. No payload is ever an integer tensor, so floor division never
  applies to one; an integer gradient (never compressed) is averaged as plain BytePS would.
* **The server only sums.** The payload pushed under ``Gradient.<name>`` is a fixed-shape sketch;
  the server adds it like any gradient. No server patch and no decompression on the server.
* **A name's size is fixed by its first push.** BytePS sizes a tensor's keys, partitions and server
  buffers at the first ``push_pull`` of a name. A parameter's payload can change size later (the
  capacity grows after a fallback, or the tensor goes dense), so the payload is fitted to the first
  one's size (the *slot*): a smaller payload is zero-padded (zeros add nothing to the sum), a
  larger one sends its first slot elements under ``Gradient.<name>`` and the rest under
  ``lhc.tail.<name>.<elements>``. The average is element-wise, so the two halves put together are
  the average of the whole payload.
* **Names are declared in the same order on every rank.** BytePS numbers its keys in the order
  names are declared, so every rank must declare extra names in the same order. The dense fallback
  names (``lhc.fallback.<name>``) are declared for all of the optimizer's parameters, sorted, at the
  first ``compress``; a tail name is declared, in sorted order, at the end of the step whose decode
  made a payload outgrow its slot (every rank decodes the same aggregate, so every rank declares
  the same names then).
* **Dense fallback.** A payload that fails to decode is aggregated again exactly: an asynchronous
  BytePS ``push_pull`` (sum) of the dense gradient under ``lhc.fallback.<name>``, waited for when
  the step's last gradient is decompressed (:mod:`lossless_hc.training.adapter`). Every rank decodes the same
  aggregate, so every rank takes the same decision.
* **Inexact keys.** A decode that reports a few inexact keys is completed by a ``push_pull`` (sum)
  of just their coordinates, issued when the step's last gradient has been decompressed, in the
  order of the parameters' names (so every rank declares new names in the same order). Their count
  changes from step to step, so they are zero-padded to a power of two and pushed under
  ``lhc.partial.<name>.<that size>``: a name keeps one size, as BytePS requires.
* **Which parameter?** ``compress`` receives only the tensor; the caller's frame
  (``_push_pull_grad_async(self, p)``) holds the parameter and the optimizer, whose
  ``_parameter_names`` give its name (keyed by ``p.__hash__()`` when named_parameters were given).
* **Which push is being decompressed?** Not ``ctx``: BytePS 0.2.5's ``synchronize()`` passes every
  parameter the context of the *last* handle of its loop before (it unpacks ``(handle, _)`` and
  reuses that loop's ``ctx``). Its ``push_pull`` is in place, so the output it hands back is the very
  tensor ``compress`` returned: the compressor keeps each push's context under that tensor, until
  decompressed. ``ctx`` serves only an engine that returns another tensor.

``Compression.auto`` (the planner, :mod:`lossless_hc.training.auto`) where the fixed-shape push
allows it: every strategy must be one push of the payload (any size: it is fitted to the slot as
above) plus, at most, the dense fallback under its declared name. So the candidates are ``dense`` and
``sketch`` (exact), plus ``topk`` with ``lossy=True``; allgather has no BytePS operation, and two_phase,
fp16/bf16 would need a second key whose size changes every step. THC is left out too: its float64
payload cannot share a float32 slot. The first step is the sketch (sized for 1% of the rows per
rank), so the slot BytePS fixes is the small payload; a later dense plan sends the head and a tail.
BytePS has no allgather to time the link with, so ``auto`` plans with ``Calibration.default()`` unless
a ``calibration`` is given (the dense/sketch choice is mostly one of wire bytes).

Not supported, with a clear error: BytePS's asynchronous mode (``BYTEPS_ENABLE_ASYNC=1`` pushes
parameter deltas, not gradients, and never calls ``decompress``), and sparse gradients (BytePS
pushes dense tensors only: use ``nn.Embedding(sparse=False)``).

This module imports without BytePS (configuration and tests); BytePS is needed at the first
``compress``. ``scripts/setup_byteps.sh`` installs it, patched for current PyTorch (docs/BYTEPS.md).
"""
from __future__ import annotations

import math
import os
import warnings
from typing import Mapping, Optional

import torch

from lossless_hc.thc.codec import NON_FINITE_CHOICES
from lossless_hc.training.adapter import (INDEX_CHOICES, CompressionFactory, CompressorAdapter, EncodedTensor,
                                          refuse_uncalled, require_optimizer_frame, wire_numel)
from lossless_hc.training.auto import AutoCompressorAdapter, AutoSpec, as_strategies
from lossless_hc.training.planner import Calibration

try:
    import byteps.torch as bps
    _IMPORT_ERROR: Optional[BaseException] = None
except ImportError as e:  # BytePS is optional until a compressor is used
    bps = None
    _IMPORT_ERROR = e


class BytePSEngine:
    """The BytePS operations the compressors use, in one place (tests substitute a simulated engine)."""

    def __init__(self):
        if bps is None:
            raise ImportError("lossless_hc.plugins.byteps needs BytePS (scripts/setup_byteps.sh installs it): "
                              f"{_IMPORT_ERROR}")
        from byteps.torch import ops
        self._ops = ops

    def size(self) -> int:
        return self._ops.size()

    def rank(self) -> int:
        return self._ops.rank()

    def declare(self, name: str) -> None:
        self._ops.declare(name)

    def push_pull_async_inplace(self, tensor: torch.Tensor, average: bool, name: str):
        return self._ops.push_pull_async_inplace(tensor, average=average, name=name)

    def synchronize(self, handle) -> None:
        self._ops.synchronize(handle)


def _parameter_name(opt, p) -> Optional[str]:
    names = opt._parameter_names
    if getattr(opt, "_is_tensor_instance", False):
        return names.get(p.__hash__())
    return names.get(p)


def _tail_name(name: str, extra: int) -> str:
    """BytePS key of the ``extra`` elements by which a payload outgrew its first push's size."""
    return f"lhc.tail.{name}.{extra}"


def _fallback_name(name: str) -> str:
    """BytePS key of a parameter's dense fallback."""
    return f"lhc.fallback.{name}"


def _partial_name(name: str, slot: int) -> str:
    """BytePS key of a parameter's re-aggregation of up to ``slot`` inexact coordinates."""
    return f"lhc.partial.{name}.{slot}"


class _PaddedPush:
    """Handle of a partial re-aggregation: ``values`` pushed zero-padded as ``padded``."""

    __slots__ = ("handle", "padded", "values")

    def __init__(self, handle, padded: torch.Tensor, values: torch.Tensor):
        self.handle, self.padded, self.values = handle, padded, values


class _Sent:
    """The BytePS half of a compressed gradient's ``ctx``: how the payload was fitted to its slot."""

    __slots__ = ("enc", "flat", "head", "shape", "dtype", "numel", "tail")

    def __init__(self, enc: EncodedTensor, flat: torch.Tensor, head: torch.Tensor, shape, dtype, numel: int, tail):
        self.enc = enc
        self.flat = flat      # the 1-D wire tensor BytePS averages in place
        self.head = head      # what went to the optimizer's push_pull (flat, or its first slot elements)
        self.shape = shape    # of the payload the aggregator made
        self.dtype = dtype
        self.numel = numel
        self.tail = tail      # handle of the tail's push_pull, or None


_ENGINE_METHODS = ("declare", "push_pull_async_inplace", "synchronize")   # what the compressors call


class BytePSCompressor(CompressorAdapter):
    """BytePS's compressor interface over :class:`~lossless_hc.training.adapter.CompressorAdapter` (one per
    ``Compression`` factory call; ``engine``: the BytePS engine, default the real one on first use)."""

    def __init__(self, spec, engine=None):
        super().__init__(spec)
        if engine is not None and not all(callable(getattr(engine, m, None)) for m in _ENGINE_METHODS):
            raise TypeError(f"engine must be a BytePS engine (with {', '.join(_ENGINE_METHODS)}) or None for the real "
                            f"one, got {type(engine).__name__}")
        self._engine = engine
        self._slots: dict = {}        # aggregator name -> (numel, dtype) of its first push
        self._in_flight: dict = {}    # id(tensor pushed) -> its _Sent, until decompressed
        self._declared: set = set()   # names this compressor declared to BytePS

    @property
    def engine(self):
        if self._engine is None:
            self._engine = BytePSEngine()
        return self._engine

    # -- BytePS's Compressor interface ----------------------------------------------------------
    def compress(self, tensor: torch.Tensor):
        p, opt = require_optimizer_frame(self, "byteps.torch.DistributedOptimizer(compression=...)")
        if getattr(opt, "_enable_async", False) or tensor is p:
            raise ValueError("BytePS asynchronous training (BYTEPS_ENABLE_ASYNC=1) pushes parameter deltas and never "
                             "decompresses; lossless_hc compression needs synchronous training")
        if tensor.is_sparse:
            raise ValueError(f"parameter {_parameter_name(opt, p)!r} has a sparse gradient; BytePS pushes dense "
                             "tensors only (use nn.Embedding(sparse=False))")
        agg = self._aggregators.get(p)
        if agg is None:   # the name, size and rank only on first use: calls into BytePS
            eng = self.engine
            if not self._aggregators:
                self._declare_fallbacks(opt)
            name = _parameter_name(opt, p) or f"param{len(self._aggregators)}"
            agg = self.aggregator(p, name, tensor, eng.size(), eng.rank())
        payload, enc = self.encode(agg, tensor)
        # A capacity policy may move a tensor sent as it is onto the codec later, whose payloads are float32.
        head, sent = self._fit(agg.name, payload, enc, may_widen=getattr(agg, "tracker", None) is not None)
        self._in_flight[id(head)] = sent   # the tensor is held by `sent` until decompressed: its id stays its own
        return head, sent

    def decompress(self, tensor: torch.Tensor, ctx) -> torch.Tensor:
        sent: _Sent = self._in_flight.pop(id(tensor), None)   # BytePS's ctx may be another push's (above)
        if sent is None:   # an engine that did not aggregate in place: its ctx is this push's
            sent = ctx
            self._in_flight.pop(id(sent.head), None)
        if sent.tail is not None:
            self.engine.synchronize(sent.tail)
        flat = sent.flat
        if tensor.data_ptr() != sent.head.data_ptr():   # an engine that did not aggregate in place
            flat[:sent.head.numel()].copy_(tensor.reshape(-1))
        if flat.numel() != sent.numel:
            flat = flat[:sent.numel]
        if flat.dtype != sent.dtype:
            flat = flat.to(sent.dtype)
        return self.decode(flat.reshape(sent.shape), sent.enc)

    # -- fitting payloads to BytePS's fixed-size keys -------------------------------------------
    def _fit(self, name: str, payload: torch.Tensor, enc: EncodedTensor, may_widen: bool = False):
        """The push of ``payload`` in its name's slot (BytePS fixes a name's size and dtype at its first
        push): padded, widened, or with a tail. ``may_widen``: the name's later payloads may be float32
        (a codec's) where this one is half precision, so a first push makes the slot float32."""
        slot = self._slots.get(name)
        if slot is None:
            dtype = torch.float32 if may_widen and payload.dtype in (torch.float16, torch.bfloat16) else payload.dtype
            self._slots[name] = slot = (payload.numel(), dtype)
            if dtype == payload.dtype:
                return payload, _Sent(enc, payload.reshape(-1), payload, payload.shape, payload.dtype, payload.numel(),
                                      None)
        slot_numel, slot_dtype = slot
        numel = payload.numel()
        flat = payload.reshape(-1)
        if payload.dtype != slot_dtype:
            if torch.promote_types(payload.dtype, slot_dtype) != slot_dtype:
                raise RuntimeError(f"{name}: the payload changed dtype from {slot_dtype} to {payload.dtype}, which the "
                                   "first push_pull of this name (BytePS fixes its dtype) cannot carry exactly")
            flat = flat.to(slot_dtype)
        tail = None
        if numel < slot_numel:
            padded = torch.zeros(slot_numel, dtype=slot_dtype, device=flat.device)
            padded[:numel] = flat
            flat, head = padded, padded
        elif numel > slot_numel:
            head = flat[:slot_numel]
            tail_name = _tail_name(name, numel - slot_numel)
            if tail_name not in self._declared:
                warnings.warn(f"{tail_name} was not declared at the end of a step; declaring it now relies on every "
                              "rank compressing in the same order", RuntimeWarning, stacklevel=3)
                self._declare(tail_name)
            tail = self.engine.push_pull_async_inplace(flat[slot_numel:], average=True, name=tail_name)
        else:
            head = flat
        # Bytes beyond what the aggregator counted: padding, and widening to the slot's dtype.
        extra = flat.numel() * flat.element_size() - numel * payload.element_size()
        if extra > 0:
            self._stats.payload_bytes += extra
        return head, _Sent(enc, flat, head, payload.shape, payload.dtype, numel, tail)

    def _declare(self, name: str) -> None:
        self.engine.declare(name)
        self._declared.add(name)

    def _declare_fallbacks(self, opt) -> None:
        names = sorted(n for n in opt._parameter_names.values() if isinstance(n, str))
        for n in names:
            self._declare(_fallback_name(n))

    def _after_step(self) -> None:
        # Tails for the payloads that outgrew their slot this step, in the same order on every rank.
        for agg in sorted(self._aggregators.values(), key=lambda a: a.name):
            slot = self._slots.get(agg.name)
            if slot is None:
                continue
            extra = wire_numel(agg) - slot[0]
            if extra > 0 and _tail_name(agg.name, extra) not in self._declared:
                self._declare(_tail_name(agg.name, extra))

    # -- the dense fallback on BytePS ------------------------------------------------------------
    def _start_fallback(self, agg, dense):
        name = _fallback_name(agg.name)
        if name not in self._declared:
            self._declare(name)
        return self.engine.push_pull_async_inplace(dense, average=False, name=name)

    def _start_partial(self, agg, values):
        slot = 1 << max(0, values.numel() - 1).bit_length()   # the next power of two
        name = _partial_name(agg.name, slot)
        if name not in self._declared:
            self._declare(name)
        padded = torch.zeros(slot, dtype=values.dtype, device=values.device)
        padded[:values.numel()] = values
        self._stats.payload_bytes += (slot - values.numel()) * values.element_size()
        return _PaddedPush(self.engine.push_pull_async_inplace(padded, average=False, name=name), padded, values)

    def _wait_fallback(self, handle) -> None:
        if isinstance(handle, _PaddedPush):
            self.engine.synchronize(handle.handle)
            handle.values.copy_(handle.padded[:handle.values.numel()])
            return
        self.engine.synchronize(handle)


BYTEPS_STRATEGIES = ("dense", "sketch")   # exact strategies one fixed-shape push can carry
BYTEPS_LOSSY_STRATEGIES = ("topk",)


class AutoBytePSCompressor(AutoCompressorAdapter, BytePSCompressor):
    """``Compression.auto`` over BytePS: the request a strategy can make here is the exact dense
    fallback, pushed (summed) under the parameter's declared fallback name."""

    def _start_request(self, agg, request):
        if request.kind != "allreduce" or request.tensor.numel() != agg.numel:
            raise RuntimeError(f"{agg.name}: BytePS can carry only the dense fallback, not an {request.kind} of "
                               f"{request.tensor.numel()} elements")
        tensor = request.tensor
        return tensor, self._start_fallback(agg, tensor)

    def _wait_request(self, handle):
        tensor, h = handle
        self._wait_fallback(h)
        return tensor


class _NoneCompressor:
    """BytePS's ``Compression.none`` where BytePS is not installed (the same no-op)."""

    @staticmethod
    def compress(tensor):
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor


class _FP16Compressor:
    """BytePS's ``Compression.fp16`` where BytePS is not installed (the same cast)."""

    @staticmethod
    def compress(tensor):
        return (tensor.to(torch.float16) if tensor.dtype.is_floating_point else tensor), tensor.dtype

    @staticmethod
    def decompress(tensor, ctx):
        return tensor.to(ctx) if ctx.is_floating_point else tensor


# -- configuration from the environment ---------------------------------------------------------------

ENV_PREFIX = "BYTEPS_LHC_"
# flag -> (keyword, parser name, the compressors it applies to)
ENV_FLAGS = {
    "BYTEPS_LHC_COMPRESSOR": ("compressor", "choice", ("lossless", "topk", "thc", "none")),
    "BYTEPS_LHC_MAX_DENSITY": ("max_density", "fraction", ("lossless",)),
    "BYTEPS_LHC_BLOCK_SIZE": ("block_size", "block", ("lossless",)),
    "BYTEPS_LHC_INDEX": ("index", "index", ("lossless", "topk")),
    "BYTEPS_LHC_RATIO": ("ratio", "fraction", ("topk",)),
    "BYTEPS_LHC_BITS": ("bits", "int", ("thc",)),
    "BYTEPS_LHC_GRANULARITY": ("granularity", "int", ("thc",)),
    "BYTEPS_LHC_OVERFLOW_FREQ": ("overflow_freq", "float", ("thc",)),
    "BYTEPS_LHC_SEED": ("seed", "int", ("lossless", "topk", "thc")),
    "BYTEPS_LHC_NON_FINITE": ("non_finite", "non_finite", ("thc",)),
}


def _parse(flag: str, kind: str, raw: str):
    text = raw.strip()
    try:
        if kind == "int":
            return int(text, 10)
        if kind == "float":
            v = float(text)
            if not math.isfinite(v):
                raise ValueError
            return v
        if kind == "fraction":
            v = float(text)
            if not 0.0 < v <= 1.0:
                raise ValueError
            return v
        if kind == "block":
            if text.lower() in ("auto", ""):
                return None
            v = int(text, 10)
            if v < 1:
                raise ValueError
            return v
    except ValueError:
        expect = {"int": "an integer", "float": "a finite number", "fraction": "a number in (0, 1]",
                  "block": "a positive integer or 'auto'"}[kind]
        raise ValueError(f"{flag}={raw!r}: expected {expect}") from None
    if kind == "index":
        if text not in INDEX_CHOICES:
            raise ValueError(f"{flag}={raw!r}: expected one of {', '.join(INDEX_CHOICES)}")
        return text
    if kind == "non_finite":
        if text.lower() not in NON_FINITE_CHOICES:
            raise ValueError(f"{flag}={raw!r}: expected one of {', '.join(NON_FINITE_CHOICES)}")
        return text.lower()
    if kind == "choice":
        choices = ENV_FLAGS[flag][2]
        if text.lower() not in choices:
            raise ValueError(f"{flag}={raw!r}: expected one of {', '.join(choices)}")
        return text.lower()
    raise AssertionError(kind)


def options_from_env(env: Optional[Mapping[str, str]] = None) -> tuple:
    """``(compressor, kwargs)`` from the ``BYTEPS_LHC_*`` variables of ``env`` (default
    ``os.environ``); raises ValueError naming the variable for unknown flags, unparsable values and
    flags that do not apply to the chosen compressor. Unset compressor: ``none``."""
    env = os.environ if env is None else env
    if not isinstance(env, Mapping):
        raise TypeError(f"env must be a mapping of variable names to strings (like os.environ), got "
                        f"{type(env).__name__}")
    flags = {k: v for k, v in env.items() if isinstance(k, str) and k.startswith(ENV_PREFIX)}
    not_str = sorted(k for k, v in flags.items() if not isinstance(v, str))
    if not_str:
        raise TypeError(f"{', '.join(not_str)}: environment values are strings, got "
                        f"{', '.join(type(flags[k]).__name__ for k in not_str)} (write {not_str[0]}='...')")
    unknown = sorted(set(flags) - set(ENV_FLAGS))
    if unknown:
        raise ValueError(f"unknown variable(s) {', '.join(unknown)}; lossless_hc reads {', '.join(ENV_FLAGS)}")
    compressor = _parse("BYTEPS_LHC_COMPRESSOR", "choice", flags.pop("BYTEPS_LHC_COMPRESSOR", "none"))
    kwargs = {}
    for flag, raw in sorted(flags.items()):
        key, kind, applies = ENV_FLAGS[flag]
        if compressor not in applies:
            raise ValueError(f"{flag} applies to BYTEPS_LHC_COMPRESSOR={'|'.join(applies)}, "
                             f"not BYTEPS_LHC_COMPRESSOR={compressor}")
        kwargs[key] = _parse(flag, kind, raw)
    return compressor, kwargs


class Compression(CompressionFactory):
    """Factories for ``byteps.torch.DistributedOptimizer(compression=...)`` (:class:`CompressionFactory`:
    ``lossless``, ``topk``, ``thc``, each also taking ``engine=``), the planner ``auto`` and
    ``from_env`` (the ``BYTEPS_LHC_*`` variables); BytePS's own ``none`` and ``fp16`` are re-exported
    so examples can switch with one name."""

    compressor = BytePSCompressor
    compressor_options = ("engine",)
    # BytePS's own where its module has them (tests/byteps_sim.py's stand-in module has not: the same no-ops).
    none = getattr(getattr(bps, "Compression", None), "none", _NoneCompressor)
    fp16 = getattr(getattr(bps, "Compression", None), "fp16", _FP16Compressor)

    @classmethod
    def auto(cls, lossy: bool = False, engine=None, calibration: Optional[Calibration] = None, **options):
        """The planner where BytePS's fixed-shape push allows (module doc): per tensor, dense or the
        sketch (and top-k with ``lossy``). ``options``: :class:`lossless_hc.training.auto.AutoSpec`."""
        allowed = BYTEPS_STRATEGIES + (BYTEPS_LOSSY_STRATEGIES if lossy else ())
        strategies = as_strategies(options.pop("strategies", None))
        strategies = allowed if strategies is None else strategies
        if any(s not in allowed for s in strategies):   # () is AutoSpec's to refuse
            raise ValueError(f"BytePS can run only {', '.join(allowed)} under auto; got {strategies!r}")
        options.setdefault("first", "sketch" if "sketch" in strategies else None)
        # A sketch's inexact rows: the dense fallback push carries them, BytePS having no other second push.
        if options.setdefault("partial", False) is not False:
            raise ValueError("BytePS's only second push is the dense fallback: auto runs with partial=False there, "
                             f"got partial={options['partial']!r}")
        spec = AutoSpec(lossy=lossy, strategies=strategies,
                        calibration=Calibration.default() if calibration is None else calibration, **options)
        return AutoBytePSCompressor(spec, engine=engine)

    @staticmethod
    def from_env(env: Optional[Mapping[str, str]] = None, **kwargs):
        """The compressor the ``BYTEPS_LHC_*`` variables choose, so a training script can switch
        without code changes::

            BYTEPS_LHC_COMPRESSOR   lossless | topk | thc | none (default: none, BytePS's own)
            BYTEPS_LHC_MAX_DENSITY  lossless: per-rank capacity as a fraction of a tensor (0.01)
            BYTEPS_LHC_BLOCK_SIZE   lossless: coordinates per key, or auto (a 2-D tensor's row)
            BYTEPS_LHC_INDEX        lossless, topk: auto | dense | bitmap | bloom | multilevel
            BYTEPS_LHC_RATIO        topk: fraction of each tensor sent (0.01)
            BYTEPS_LHC_BITS         thc: table of 2^bits levels (4; the wire's bits per coordinate follow
                                    from the world size and granularity, docs/THC.md)
            BYTEPS_LHC_GRANULARITY  thc: integer levels (30)
            BYTEPS_LHC_OVERFLOW_FREQ thc: clipping (32)
            BYTEPS_LHC_SEED         lossless, topk, thc: hash seed, the same on every rank (0)
            BYTEPS_LHC_NON_FINITE   thc: raise | propagate (NaN/Inf gradients: an error, or NaN for AMP)

        ``kwargs`` are added to (and override) what the variables give, e.g. aggregator options.
        """
        compressor, options = options_from_env(env)
        options.update(kwargs)
        if compressor == "none":
            if options:
                raise ValueError(f"BYTEPS_LHC_COMPRESSOR=none takes no options, got {sorted(options)}")
            return Compression.none
        return getattr(Compression, compressor)(**options)


refuse_uncalled(Compression.auto)
