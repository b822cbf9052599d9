"""Per-tensor aggregation policy shared by the framework adapters (Horovod, BytePS, DDP, FSDP2).

An adapter hands each gradient to :meth:`TensorAggregator.encode`, lets its engine SUM or AVERAGE
the payload (a ring allreduce, a parameter server), and hands the result to
:meth:`TensorAggregator.decode`. The adapters hold no algorithm; this module decides, per tensor:

* **dense or compressed.** A tensor goes through :class:`~lossless_hc.LosslessCodec` only while the
  codec's payload, header included, is smaller than the dense tensor; otherwise the dense tensor
  itself is the payload, so a step's first payload is never larger than dense.
* **capacity.** Each rank may send at most ``capacity`` non-zero coordinates. When a decode fails
  the adapter aggregates that tensor again, densely and exactly; where the failure says the codec was
  too small (a rank was over capacity, peeling could not finish: :data:`CAPACITY_STATUSES`) the
  capacity grows for later steps, and otherwise (a NaN/Inf input, a payload that is not a plain sum)
  it stays.
* **inexact keys.** A decode that is exact except at a few keys (``DecodeStatus.INEXACT``: their
  error bound exceeds the codec's tolerance, typically small values sharing sketch cells with large
  ones) keeps its output, and the adapter re-aggregates just those keys' coordinates with a dense
  SUM (:meth:`TensorAggregator.finish_partial`); only when they are more than
  ``partial_max_fraction`` of the tensor does it fall back densely (and grow) as after a failure.

Every decision above is a function of the configuration and of the *aggregated* payload, which every
rank holds bit for bit, so all ranks take the same decision at the same step and payload shapes
always match. Nothing here needs a collective of its own.

The aggregators:

* :class:`TensorAggregator` (``Compression.lossless``): the gradient as it is, for naturally
  sparse gradients (embedding tables). The aggregate equals the dense allreduce within the exactness
  contract (:mod:`lossless_hc.lhc.contract`: at each coordinate what a dense float32 allreduce may be
  off, or the codec's ``rtol`` where larger); keys the decoder cannot prove are re-aggregated densely.
* :class:`~lossless_hc.training.topk_aggregate.TopKAggregator` (``Compression.topk``, its own module):
  top-k sparsification with error feedback for dense gradients; the selected values are then summed
  by the LHC codec.
* :class:`~lossless_hc.training.thc_aggregate.THCAggregator` (``Compression.thc``, its own module):
  THC quantization for dense gradients (lossy, unbiased, with error feedback); it cannot fail, so it
  never falls back.
"""
from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from typing import Optional

import torch

from lossless_hc.backends import as_device, backend_for
from lossless_hc.lhc.codec import DecodeReport, LosslessCodec
from lossless_hc.lhc.contract import unproven_coordinates
from lossless_hc.lhc.status import DecodeStatus
from lossless_hc.lhc.layout import HDR_CONTRIBUTORS, check_fraction, check_int, check_uint64, is_real
from lossless_hc.training.capacity import CapacityPolicy

# The gradient dtypes the codecs take (encoded as float32); anything else goes dense.
CODEC_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# The decode outcomes that say the codec was too small for the step's keys: a failed decode grows the
# capacity only after one of these (or where some rank overloaded, whatever the status names first). The
# others -- a non-finite input, which AMP's GradScaler causes whenever its scale overflows, or a payload
# that is not a plain sum of this codec's payloads -- fall back densely and keep the capacity: more
# would not help, and a scaler's overflow steps would double every compressed tensor's capacity.
CAPACITY_STATUSES = frozenset({DecodeStatus.OVERLOADED, DecodeStatus.SKETCH_PEEL_FAILED, DecodeStatus.INDEX_PEEL_FAILED,
                               DecodeStatus.INDEX_OVERFLOW, DecodeStatus.INDEX_SATURATED, DecodeStatus.INEXACT})


def grows_capacity(report: DecodeReport) -> bool:
    """Whether a failed decode's ``report`` calls for a larger codec (:data:`CAPACITY_STATUSES`)."""
    return bool(report.overloaded_ranks) or report.status in CAPACITY_STATUSES


class ConfigurationMismatch(RuntimeError):
    """Ranks aggregated payloads built with different codec configurations."""


@dataclass
class AggregationStats:
    """Counters over every tensor one compressor (or DDP hook state) aggregated.

    payload_bytes / dense_bytes is the fraction of the uncompressed traffic this rank sent (both count
    the bytes one rank contributes; the engine's own factor, e.g. 2(n-1)/n for a ring, cancels).
    """

    tensors: int = 0            # encode/decode pairs
    compressed: int = 0         # ... of which went through the codec
    sent_dense: int = 0         # ... of which were sent dense (the codec would not have been smaller)
    fallbacks: int = 0          # codec payloads that failed to decode and were re-sent dense
    inexact_decodes: int = 0    # decodes that reported inexact keys (DecodeStatus.INEXACT)
    partial_fallbacks: int = 0  # ... of which only those keys were re-aggregated (the rest: in fallbacks)
    inexact_keys: int = 0       # keys re-aggregated (their unproven coordinates) by those partial fallbacks
    capacity_growths: int = 0   # times a tensor's capacity grew after a failure
    payload_bytes: int = 0      # bytes this rank sent, fallbacks included
    dense_bytes: int = 0        # bytes the uncompressed allreduce sends for the same tensors
    encode_seconds: float = 0.0
    decode_seconds: float = 0.0
    last_failure: Optional[str] = None

    @property
    def wire_ratio(self) -> float:
        """payload_bytes / dense_bytes (1.0 before anything was sent)."""
        return self.payload_bytes / self.dense_bytes if self.dense_bytes else 1.0

    def count_encode(self, dense_bytes: int, payload: torch.Tensor, compressed: bool, started: float) -> None:
        """Account for one encoded tensor (``started``: its ``time.perf_counter()`` at the start)."""
        self.tensors += 1
        self.dense_bytes += dense_bytes
        self.payload_bytes += payload.numel() * payload.element_size()
        if compressed:
            self.compressed += 1
        else:
            self.sent_dense += 1
        self.encode_seconds += time.perf_counter() - started

    def count_widened(self, numel: int, dtype: torch.dtype, sent: torch.dtype) -> None:
        """Add the bytes that ``numel`` values counted in their own ``dtype`` gain when they are sent as
        the wider ``sent`` (a narrower payload in a wider message part, a fallback's float32 values, a
        bfloat16 tensor Horovod carries as float32)."""
        self.payload_bytes += max(0, numel * (sent.itemsize - dtype.itemsize))

    def as_dict(self) -> dict:
        d = asdict(self)
        d["wire_ratio"] = self.wire_ratio
        return d


@dataclass
class EncodeContext:
    """What :meth:`TensorAggregator.decode` needs about one encoded tensor."""

    shape: tuple
    dtype: torch.dtype
    compressed: bool
    dense_value: torch.Tensor   # what an exact dense fallback aggregates (the tensor the payload encodes)
    codec: Optional[LosslessCodec] = None


@dataclass
class DecodeOutcome:
    """Result of :meth:`TensorAggregator.decode`.

    value      the aggregate (sum, or average when ``averaged``) in the tensor's shape and dtype (for a
               tensor sent as it is: what the engine returned, flat where it was a message's slice), or
               None when the codec failed: the adapter must then aggregate ``ctx.dense_value``
               densely (with SUM) and pass the result to :meth:`TensorAggregator.finish_fallback`.
    averaged   whether the engine averaged a compressed payload (:func:`payload_is_averaged`: the engine's
               op where the adapter knows it, else the payload's contributor count), which a fallback and
               a partial re-aggregation follow; always False for a tensor sent as it is, whose ``value``
               is what the engine returned (its sum or its average).
    report     the codec's report (None for tensors sent dense).
    partial    None, or the flat coordinates (int64, sorted, on the tensor's device; the same on every
               rank) of the keys the codec reported inexact: ``value`` is right everywhere else, and
               the adapter must SUM :func:`partial_values` across ranks and pass the result to
               :meth:`TensorAggregator.finish_partial` before ``value`` is used.
    """

    value: Optional[torch.Tensor]
    averaged: bool
    report: Optional[DecodeReport] = None
    partial: Optional[torch.Tensor] = None

    @property
    def needs_fallback(self) -> bool:
        return self.value is None

    @property
    def needs_partial(self) -> bool:
        return self.partial is not None


def default_block_size(shape) -> int:
    """Coordinates hashed as one key: the row length of a 2-D tensor (an embedding table's
    gradient is non-zero in whole rows), else 1."""
    return int(shape[-1]) if len(shape) == 2 and shape[-1] > 0 else 1


def check_dense_gradient(name: str, x: torch.Tensor, shape: tuple, dtype: torch.dtype) -> None:
    """TypeError for a sparse gradient, ValueError for one of another shape or dtype than the aggregator
    ``name`` was built for (its codec and plan were sized for that tensor)."""
    if x.layout != torch.strided:   # COO (is_sparse), and CSR, CSC, BSR, BSC, which is_sparse does not name
        raise TypeError(f"{name}: sparse gradient ({x.layout}); aggregate it dense (Horovod: sparse_as_dense=True)")
    if tuple(x.shape) != shape or x.dtype != dtype:
        raise ValueError(f"{name}: got a {x.dtype} tensor of shape {tuple(x.shape)}, this aggregator "
                         f"was built for {dtype} {shape}")


class TensorAggregator:
    r"""Lossless aggregation of one tensor across steps (``Compression.lossless``).

    Args:
        name: the tensor's name, identical on every rank (used in messages only).
        shape, dtype: of the gradient.
        world_size: ranks whose payloads the engine aggregates.
        max_density: initial capacity as a fraction of the tensor's coordinates: each rank may send
            ``ceil(max_density * numel)`` non-zero coordinates (rounded up to whole blocks).
        block_size: coordinates hashed as one key; ``None`` picks :func:`default_block_size`.
        seed: hash seed, identical on every rank.
        index: the codec's index kind ("auto": the cheapest payload, :func:`~lossless_hc.lhc.cost_model.choose`).
        stats: counters shared with the compressor that owns this aggregator.
        policy: a :class:`CapacityPolicy` to adapt the capacity (per rank and of the aggregate's
            union) to the densities the aggregates show; None keeps ``max_density`` (grown only
            after failures) and sizes the sketch for ``world_size`` disjoint supports.
        device: where the codec runs and its payloads live (the gradient's device).
        partial_max_fraction: the largest share of the tensor's coordinates that a decode's inexact
            keys may cover and still be re-aggregated alone (:data:`PARTIAL_MAX_FRACTION`); above it
            the whole tensor falls back densely.

    Capacity growth after a failed decode (identical on every rank: it reads only the aggregated
    header): :math:`c \leftarrow \max(2c,\ \lceil 1.25\, K / n \rceil\, b)` with K the total of the
    ranks' non-zero key counts, so a tensor that is really dense reaches the dense mode after one
    fallback instead of doubling many times.
    """

    engine_averages: Optional[bool] = None   # set by a plugin that knows its engine's op (payload_is_averaged)

    def __init__(self, name: str, shape, dtype: torch.dtype, world_size: int, max_density: float,
                 block_size: Optional[int] = None, seed: int = 0, index: str = "auto",
                 stats: Optional[AggregationStats] = None, policy: Optional[CapacityPolicy] = None,
                 device="cpu", partial_max_fraction: Optional[float] = None):
        max_density = check_fraction("max_density", max_density)
        check_int(world_size, "world_size", least=1)
        self.name = name
        self.shape = _check_shape(shape)
        self.dtype = dtype
        self.numel = math.prod(self.shape)
        self.world_size = int(world_size)
        self.block_size = check_block_size(block_size) or default_block_size(self.shape)
        self.seed = check_uint64(seed, "seed")
        self.index = index
        self.device = as_device(device)
        self.stats = stats if stats is not None else AggregationStats()
        self.capacity = self._round_to_blocks(math.ceil(max_density * self.numel))
        self.union_capacity: Optional[int] = None   # aggregate non-zeros the codec is sized for (None: n x capacity)
        self.min_capacity = 0                       # the policy never goes below this (top-k: k)
        self.tracker = check_policy(policy).tracker() if policy is not None else None
        self.partial_max_fraction = check_partial_fraction(partial_max_fraction)
        self._codec: Optional[LosslessCodec] = None
        self._decide_codec()

    # -- the per-tensor decisions ------------------------------------------------------------------
    def _round_to_blocks(self, coords: int) -> int:
        b = self.block_size
        return max(b, -(-coords // b) * b)

    def _decide_codec(self) -> None:
        """Build the codec for the current capacity, or go dense when it would not be smaller."""
        self._codec = None
        if self.dtype not in CODEC_DTYPES or self.numel == 0 or self.capacity >= self.numel:
            return
        union = self.union_capacity
        if union is not None:
            union = min(self.numel, max(union, self.capacity))
        codec = LosslessCodec(self.numel, self.world_size, self.capacity, self.block_size, self.seed,
                              index=self.index, union_nnz=union, device=self.device)
        if codec.wire_bytes < self.numel * self.dtype.itemsize:
            self._codec = codec

    def _observe(self, union_keys: int, total_keys: Optional[int]) -> None:
        """Feed one decoded step's aggregate to the policy (same values, same order on every rank);
        rebuild the codec when a decision is due and leaves the hysteresis band."""
        tr = self.tracker
        if tr is None:
            return
        per_rank = union_keys if total_keys is None else total_keys / self.world_size
        if not tr.observe(union_keys, per_rank):
            return
        rank_keys, union_keys = tr.propose()
        b = self.block_size
        capacity = self._round_to_blocks(max(self.min_capacity, rank_keys * b))
        union = max(capacity, union_keys * b)
        current_union = self.union_capacity if self.union_capacity is not None else self.world_size * self.capacity
        if tr.accept(self.capacity, capacity) or tr.accept(current_union, union):
            self.capacity, self.union_capacity = capacity, union
            before = self._codec
            self._decide_codec()
            after = self._codec
            if before is None or after is None or before.layout != after.layout:
                tr.record_rebuild(self.capacity, self.union_capacity,
                                  after.index_kind if after is not None else "dense")

    def _key_support(self, value: torch.Tensor) -> int:
        """Non-zero keys of an aggregated dense tensor (identical on every rank): keys of ``block_size``
        coordinates holding a value other than +-0.0 (NaN and infinities count), the last key partial."""
        flat = value.detach().reshape(-1)
        b = self.block_size
        # The backends' one-pass scans: torch's comparisons and reductions took ~5-15x as long.
        if b == 1 and flat.dtype == torch.float32:
            return int(backend_for(flat.device).dense_copy(flat.contiguous(), None)[0])
        if b > 1 and flat.is_floating_point() and flat.element_size() in (2, 4, 8):
            flat = flat.contiguous()
            full = flat.numel() // b * b
            keys = int(torch.count_nonzero(backend_for(flat.device).nonzero_rows(flat[:full], b))) if full else 0
            return keys + int(full < flat.numel() and bool((flat[full:] != 0).any()))
        if b == 1:
            return int(torch.count_nonzero(flat))
        pad = (-flat.numel()) % b
        if pad:
            flat = torch.cat([flat, flat.new_zeros(pad)])
        return int(torch.count_nonzero((flat.reshape(-1, b) != 0).any(dim=1)))

    @property
    def compressed(self) -> bool:
        """Whether the next encode goes through the codec (False: the tensor is sent dense)."""
        return self._codec is not None

    @property
    def codec(self) -> Optional[LosslessCodec]:
        return self._codec

    def _grow(self, report: DecodeReport) -> None:
        if report.overloaded_ranks and self.tracker is not None:   # before the capacity it overloaded grows
            self.tracker.observe_overload(-(-self.capacity // self.block_size), report.total_keys / self.world_size)
        keys_per_rank = math.ceil(1.25 * report.total_keys / self.world_size)
        self.capacity = self._round_to_blocks(max(2 * self.capacity, keys_per_rank * self.block_size))
        if self.union_capacity is not None:
            self.union_capacity = max(2 * self.union_capacity, self.capacity,
                                      math.ceil(1.25 * report.total_keys) * self.block_size)
        self.stats.capacity_growths += 1
        self._decide_codec()

    # -- what an adapter calls ---------------------------------------------------------------------
    def _check(self, x: torch.Tensor) -> None:
        check_dense_gradient(self.name, x, self.shape, self.dtype)

    def select(self, x: torch.Tensor) -> torch.Tensor:
        """The tensor to aggregate for gradient ``x`` (``x`` itself here; top-k overrides)."""
        return x

    # Whether the adapter must keep an encoded tensor until its decode is complete: a dense fallback
    # and a partial re-aggregation read it (``ctx.dense_value``), so its memory cannot take the result.
    reads_input_after_decode = True

    def payload_spec(self):
        """The ``(numel, dtype)`` of the payload the next :meth:`encode` returns, known before encoding
        (the codec is chosen between steps; a rank over capacity still sends the codec's payload, marked
        overloaded), so that an adapter can have it written into its message
        (:mod:`lossless_hc.training.message`)."""
        if self._codec is None:
            return self.numel, self.dtype
        return self._codec.layout.payload_numel, torch.float32

    def encode(self, x: torch.Tensor, out: Optional[torch.Tensor] = None):
        """``(payload, ctx)``: the payload every rank hands to the engine, and the context for
        :meth:`decode`. The payload of a tensor sent dense is the tensor itself. ``out``: where to
        write a compressed tensor's payload (contiguous, :meth:`payload_spec`'s numel and dtype, on the
        codec's device; e.g. its slice of the adapter's message), which is then the payload; ignored
        when the tensor is sent dense."""
        self._check(x)
        t0 = time.perf_counter()
        value = self.select(x)
        codec = self._codec
        ctx = EncodeContext(self.shape, self.dtype, codec is not None, value, codec)
        payload = codec.encode(value, out=out) if codec is not None else value
        self.stats.count_encode(self.numel * self.dtype.itemsize, payload, codec is not None, t0)
        return payload, ctx

    def decode(self, aggregated: torch.Tensor, ctx: EncodeContext, partial: bool = True) -> DecodeOutcome:
        """Decode the engine's SUM or AVERAGE of every rank's payload.

        ``partial``: whether the adapter can re-aggregate a decode's inexact keys alone (see
        :class:`DecodeOutcome`); False (auto under BytePS, whose only second push is the dense fallback) makes
        such a decode fall back densely. Raises :class:`ConfigurationMismatch` when the ranks'
        codecs disagree (a configuration error, not something a fallback can fix).
        """
        if not ctx.compressed:
            if self.tracker is not None:
                self._observe(self._key_support(aggregated), None)
            return DecodeOutcome(aggregated, averaged=False)
        t0 = time.perf_counter()
        codec = ctx.codec
        averaged = payload_is_averaged(aggregated, codec.world_size, self.engine_averages)
        # wider keys' bounds: which coordinates of an inexact key are proven (unproven_coordinates)
        y, report = codec.decode(aggregated, averaged=averaged, shape=ctx.shape, dtype=ctx.dtype,
                                 error_bounds=partial and self.block_size > 1)
        self.stats.decode_seconds += time.perf_counter() - t0
        coords = self._inexact_coords(y, report, codec, partial)
        if report.ok or coords is not None:
            if codec is self._codec:
                self._observe(report.support, report.total_keys)
            return DecodeOutcome(y, averaged, report, partial=coords)
        if report.status == DecodeStatus.CONFIGURATION_MISMATCH:
            raise ConfigurationMismatch(f"{self.name}: {report.reason}")
        st = self.stats
        st.fallbacks += 1
        st.payload_bytes += self.numel * self.dtype.itemsize
        st.last_failure = f"{self.name}: {report.reason}"
        if codec is self._codec:  # once per failed step, even if a caller decodes twice
            self.after_failure(report)
        return DecodeOutcome(None, averaged, report)

    def after_failure(self, report: DecodeReport) -> None:
        """What a failed decode changes for later steps, the same on every rank that learns of it (the
        ranks that decoded; a reduce-scatter's other ranks through
        :func:`~lossless_hc.training.message.replay_failure`): the capacity grows where the failure says
        the codec was too small (:func:`grows_capacity`)."""
        if grows_capacity(report):
            self._grow(report)

    def _inexact_coords(self, y: torch.Tensor, report: DecodeReport, codec: LosslessCodec,
                        partial: bool) -> Optional[torch.Tensor]:
        """:func:`reaggregated_coordinates` of the decode (at most ``partial_max_fraction`` of the tensor), on
        this aggregator's device, their values counted as sent. A payload some rank overloaded is truncated:
        the codec reports it OVERLOADED, never INEXACT, so its keys are never re-aggregated alone."""
        coords = reaggregated_coordinates(y, report, self.block_size, codec, partial,
                                          self.partial_max_fraction * self.numel, self.stats)
        if coords is None:
            return None
        self.stats.payload_bytes += coords.numel() * self.dtype.itemsize
        return coords.to(self.device)

    def finish_fallback(self, summed: torch.Tensor, outcome: DecodeOutcome) -> torch.Tensor:
        """The aggregate from the exact dense SUM of ``ctx.dense_value``, scaled as the engine scaled
        the payload (divided by world_size when it averaged)."""
        if self.tracker is not None and outcome.report is not None:
            self._observe(self._key_support(summed), outcome.report.total_keys)
        return summed.div_(self.world_size) if outcome.averaged else summed

    def finish_partial(self, summed: torch.Tensor, outcome: DecodeOutcome) -> torch.Tensor:
        """``outcome.value`` with the coordinates ``outcome.partial`` set from ``summed``, the dense SUM
        across ranks of :func:`partial_values` (divided by world_size when the engine averaged), so
        they hold what the dense fallback would give there; written in place and returned."""
        if outcome.averaged:
            summed = summed / self.world_size
        outcome.value.view(-1)[outcome.partial] = summed.to(outcome.value.dtype)
        return outcome.value


PARTIAL_MAX_FRACTION = 0.5
"""Default :attr:`TensorAggregator.partial_max_fraction`. A partial re-aggregation of m coordinates
sends m values (no indices: every rank derives them from the same aggregate) where the dense fallback
sends numel, but it gathers and scatters through an index (an int64 per coordinate, random access).
Past half of the tensor it still sends half the dense bytes or more, and an inexact set that large
says the sketch does not suit the tensor, which the dense fallback's capacity growth answers."""


def reaggregated_coordinates(y: torch.Tensor, report: DecodeReport, block: int, codec: LosslessCodec,
                             partial: bool, max_coordinates: float, stats: AggregationStats) -> Optional[torch.Tensor]:
    """The flat coordinates of an INEXACT decode's keys (key k covers coordinates ``[k b, min((k+1) b, numel))``,
    ``b = block``) that its bounds do not prove (:func:`~lossless_hc.lhc.contract.unproven_coordinates` of the
    output ``y``), to be re-aggregated alone: None for another status, without ``partial``, or where they are
    more than ``max_coordinates`` (the caller falls back densely). Counts an INEXACT decode in ``stats`` and,
    where coordinates are returned, the partial fallback and its keys. One rule for every path that decodes a
    sketch (:class:`TensorAggregator`, ``auto``'s sketch plan)."""
    if report.status != DecodeStatus.INEXACT:
        return None
    stats.inexact_decodes += 1
    if not partial:
        return None
    coords = unproven_coordinates(y, report, block, codec.rtol, codec.verify)
    if coords.numel() > max_coordinates:
        return None
    stats.partial_fallbacks += 1
    stats.inexact_keys += report.inexact_keys.numel()
    return coords


def _check_shape(shape) -> tuple:
    """``shape`` as a tuple of ints >= 0 (a ``torch.Size`` or a sequence), else TypeError / ValueError:
    a negative or fractional size would give a negative or wrong ``numel``, refused only later by an
    encode's shape check, or never where the layout happens to match."""
    try:
        dims = tuple(shape)
    except TypeError:
        raise TypeError(f"shape must be a sequence of ints, got {type(shape).__name__}") from None
    for d in dims:
        check_int(d, "each dimension of shape")
        if d < 0:
            raise ValueError(f"shape must have sizes >= 0, got {dims}")
    return dims


def check_block_size(block_size) -> Optional[int]:
    """``block_size`` (coordinates per key) unless it is neither None nor a positive int (bool refused):
    ValueError, where it would have been truncated (2.5 -> 2) or taken as the default (0)."""
    if block_size is not None and (isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1):
        raise ValueError(f"block_size must be a positive integer or None (a 2-D tensor's row length), "
                         f"got {block_size!r}")
    return block_size


def check_policy(policy):
    """``policy`` itself if it is None or a :class:`CapacityPolicy`; a TypeError otherwise."""
    if policy is not None and not isinstance(policy, CapacityPolicy):
        raise TypeError(f"policy must be a CapacityPolicy or None, got {type(policy).__name__}")
    return policy


def check_partial_fraction(fraction) -> float:
    """``partial_max_fraction`` (None: the default), a number in [0, 1] (bool refused), else ValueError."""
    if fraction is None:
        return PARTIAL_MAX_FRACTION
    if not is_real(fraction) or not 0.0 <= fraction <= 1.0:
        raise ValueError(f"partial_max_fraction must be in [0, 1], got {fraction!r}")
    return float(fraction)


def partial_values(ctx: EncodeContext, coords: torch.Tensor) -> torch.Tensor:
    """What every rank SUMs for a partial re-aggregation at the flat coordinates ``coords`` (a decode's
    ``outcome.partial``): its own ``ctx.dense_value`` there (a new 1-D tensor in the value's dtype)."""
    return ctx.dense_value.detach().reshape(-1)[coords]


def payload_is_averaged(payload, world_size: int, engine_averages: Optional[bool] = None) -> bool:
    """Whether an engine averaged (True) or summed (False) a codec payload (a tensor, or its first words as
    a sequence of floats).

    ``engine_averages``: what the engine does, where its plugin knows it (Horovod: the optimizer's
    ``op``); it is then the answer. Otherwise it is read from the payload: every rank writes 1 into
    the header's contributor field (the first element of both codecs' payloads), so the aggregate
    holds ``world_size`` after a SUM and 1 after an AVERAGE. Anything else is left for the codec to
    report. Reading it is ambiguous where fewer ranks contribute (a rank that called ``hvd.join()``
    contributes zeros, and Horovod still divides an AVERAGE by ``world_size``): a SUM of one rank's
    payload reads as an AVERAGE of all, which is why a plugin that knows the operation says so.
    """
    if world_size == 1:
        return False
    if engine_averages is not None:
        return bool(engine_averages)
    v = float(payload[HDR_CONTRIBUTORS])
    return abs(v - 1.0) < 0.5
