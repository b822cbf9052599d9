"""Many tensors in one message: what the torch.distributed adapters (DDP, FSDP2) share.

An adapter that reduces several gradients together (a DDP bucket, an FSDP2 parameter group's shard)
does, per step:

1. :func:`encode_message`: encode every tensor with its aggregator (:mod:`lossless_hc.training.aggregate`)
   into its slice of the message: the payloads' concatenation, one flat tensor (a *part*) per payload
   dtype, or fewer (the part rule below);
2. SUM each part across ranks with its engine (one allreduce per part, in ``message.parts`` order; or,
   for one message per destination, one reduce-scatter per part dtype);
3. :func:`decode_segments`: decode each tensor's segment of the summed parts, or :func:`decode_message`,
   which also re-aggregates every segment that failed to decode densely, and just the inexact keys'
   coordinates of every segment that reported some (one more SUM for both, supplied by the adapter
   as ``dense_sum``), and returns the exact sums.

The part rule. Payloads are float64 (THC's words, which must stay exact), float32 (the codecs'), or a
tensor sent as it is, in its own dtype. A payload joins the part of its dtype (:data:`PART_DTYPES`;
a narrower float such as float8 the float32 one). A narrower part whose widening would cost fewer than
:data:`SEPARATE_PART_MIN_BYTES` (or, given the calibrated link, ``auto``'s messages, where the widened
allreduce is predicted cheaper than two) joins the narrowest wider part that holds its values exactly
(float32 for bfloat16 and float16, float64 for float32), sparing a collective's latency for a few bytes, unless
its dtype is kept (``message_layout``'s ``keep``: an ``auto`` fp16 or bf16 plan's plain steps, whose
plan is worth its rounding only for the bytes it halves). So
a half-precision model's tensors sent as they are cross the wire in their dtype, as DDP's own
allreduce sends them, and are summed in it as it sums them. (A SUM: a float16 sum beyond 65504
becomes inf, as it does when widened, at its rounding back to float16; the DDP adapter divides a
float16 bucket first, as DDP's own hook does.) Payloads of no elements (an empty parameter's) make no
part of their own: their dtype travels in the widest part that has elements.
Which parts a message has is a function of the payload specs, identical on every rank.

The adapter owns the collectives (and so the ordering that keeps them deadlock-free); everything here
is local. Every rank that decodes the same summed message takes the same decisions (fallback,
capacity growth), so every rank issues the same fallback collective. A rank that did not decode a
message (a reduce-scatter's non-owners) applies the owner's decision with :func:`replay_failure`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Collection, Dict, List, Optional, Sequence

import torch

from lossless_hc.backends import backend_for, span_of_slices
from lossless_hc.lhc.status import DecodeStatus
from lossless_hc.training.aggregate import DecodeOutcome, partial_values

# Widening a narrower part into a wider one costs its elements x the width difference on the wire; a
# separate part costs one more collective's latency. 256 KiB is ~2 ms at 1 Gbit/s: below it, from
# about that link speed on, the latency is the larger cost. (Where the link is calibrated, auto's
# messages price both instead: message_layout's link.)
SEPARATE_PART_MIN_BYTES = 256 * 1024
PART_DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)   # a message's parts, in the SUMs' order


@dataclass
class Message:
    """One encoded message: ``parts`` are what the engine sums (one collective each, in this order);
    ``encoded`` the ``(payload, ctx)`` of each tensor, in order, with ``aggregators`` the aggregators
    that made them, and ``places`` where each one's segment lies: ``(part index, offset)``."""

    aggregators: list
    encoded: list
    parts: List[torch.Tensor]
    places: List[tuple]


def encode_message(aggregators: Sequence, tensors: Sequence[torch.Tensor],
                   buffer: Optional[torch.Tensor] = None) -> Message:
    """Encode ``tensors[i]`` with ``aggregators[i]`` into one message (see the module doc). Every
    aggregator knows its payload's size before encoding (``payload_spec``), so the parts are allocated
    first and each payload of its part's dtype is encoded into its own slice; the others (a tensor sent
    as it is, a widened payload) are copied in, converted.

    ``buffer``: memory whose consecutive slices are ``tensors`` (a DDP bucket). Where every tensor is
    sent as it is (each payload is its tensor, in the buffer's dtype), the buffer's span of them is the
    message's one part: nothing is copied, and the engine sums the buffer in place, as its own allreduce
    does. (A top-k aggregator's new tensor of the same size is copied into a message of its own.)"""
    if len(aggregators) != len(tensors):   # zip would drop the extra ones (or sum unwritten slots)
        raise ValueError(f"encode_message: {len(aggregators)} aggregators for {len(tensors)} tensors")
    specs = [agg.payload_spec() for agg in aggregators]
    dtypes, sizes, places = message_layout(specs)
    if buffer is not None and _is_the_buffer(buffer, tensors, specs, dtypes):
        encoded = [agg.encode(t) for agg, t in zip(aggregators, tensors)]
        if all(payload.data_ptr() == t.data_ptr() for (payload, _), t in zip(encoded, tensors)):
            return Message(list(aggregators), encoded, [buffer[:sizes[0]]], places)
        # an aggregator that selects (top-k) hands over a new tensor of the same size: copied
        payloads = [payload for payload, _ in encoded]
        return Message(list(aggregators), encoded, pack_parts(payloads, dtypes, sizes, places), places)
    if len(tensors):
        # The backend's buffer: on the CPU advised to huge pages, so a message of ~100 MiB is not
        # written through one page fault per 4 KiB (a quarter of the time at that size).
        device = tensors[0].device
        parts = [backend_for(device).empty(m, device, d) for d, m in zip(dtypes, sizes)]
    else:
        parts = []
    encoded = []
    for agg, t, (numel, dtype), (part, offset) in zip(aggregators, tensors, specs, places):
        agg.stats.count_widened(numel, dtype, dtypes[part])
        piece = parts[part][offset:offset + numel]
        payload, ctx = agg.encode(t, out=piece) if dtype == piece.dtype else agg.encode(t)
        if payload.data_ptr() != piece.data_ptr():   # sent as it is, or widened
            piece.copy_(payload.reshape(-1))
        encoded.append((payload, ctx))
    return Message(list(aggregators), encoded, parts, places)


def pack_parts(payloads: Sequence[torch.Tensor], dtypes, sizes, places) -> List[torch.Tensor]:
    """The parts of :func:`message_layout`'s ``(dtypes, sizes, places)`` holding ``payloads``, copied in
    (converted where a part is wider), in the backend's buffers. Each payload must have its layout's
    size (its place ends where the next one in its part starts): a longer one would overwrite the next."""
    if len(payloads) != len(places):
        raise ValueError(f"pack_parts: {len(payloads)} payloads for a layout of {len(places)}")
    ends = [0] * len(sizes)
    for payload, (part, offset) in zip(payloads, places):
        if offset != ends[part]:
            break
        ends[part] += payload.numel()
    if ends != list(sizes):
        raise ValueError(f"pack_parts: payloads of {[p.numel() for p in payloads]} elements do not fill the "
                         f"layout's parts of {list(sizes)}")
    device = payloads[0].device if len(payloads) else torch.device("cpu")
    parts = [backend_for(device).empty(m, device, d) for d, m in zip(dtypes, sizes)]
    for payload, (part, offset) in zip(payloads, places):
        parts[part][offset:offset + payload.numel()].copy_(payload.reshape(-1))
    return parts


def _is_the_buffer(buffer: torch.Tensor, tensors: Sequence[torch.Tensor], specs, dtypes) -> bool:
    """Whether every payload is announced as its tensor, in one part of ``buffer``'s dtype, and the
    tensors are ``buffer``'s consecutive slices from its start (:func:`span_of_slices`: holding their own
    values, as the engine sums memory)."""
    if dtypes != [buffer.dtype] or any((numel, dtype) != (t.numel(), t.dtype) or dtype != buffer.dtype
                                       for t, (numel, dtype) in zip(tensors, specs)):
        return False
    span = span_of_slices(buffer, tensors)
    return span is not None and span <= buffer.numel() * buffer.element_size()


def message_layout(specs: Sequence[tuple], keep: Collection[torch.dtype] = (), link=None, world_size: int = 1) -> tuple:
    """``(dtypes, sizes, places)`` of a message of payloads ``specs`` (``(numel, dtype)`` each): its
    parts' dtypes and element counts, in order, and each payload's ``(part index, offset)``. A dtype in
    ``keep`` keeps a part of its own however small (payloads narrowed on purpose: an ``auto`` fp16 or bf16
    plan's, whose plan was chosen for its halved bytes).

    ``link``: the calibrated :class:`~lossless_hc.training.planner.LinkModel` of ``world_size`` ranks (the
    same on every rank). With it, a narrower part is widened where the wider part's allreduce grown by its
    widened bytes is predicted to cost less than the two allreduces apart (a narrower part's own at the
    half-precision slope where it is half precision): on a slow link a few KiB widened cost more than a
    collective's latency, on a fast one with a long latency a few MiB cost less. Without it (or for one
    rank), the fixed :data:`SEPARATE_PART_MIN_BYTES`."""
    part_dtype = _part_dtypes(specs, keep, link if world_size > 1 else None, world_size)
    dtypes = [d for d in PART_DTYPES if d in part_dtype.values()]
    sizes = [0] * len(dtypes)
    places = []
    for numel, dtype in specs:
        part = dtypes.index(part_dtype[dtype])
        places.append((part, sizes[part]))
        sizes[part] += numel
    return dtypes, sizes, places


def _part_dtypes(specs, keep: Collection[torch.dtype] = (), link=None, world_size: int = 1) -> Dict[torch.dtype, torch.dtype]:
    """Each payload dtype of ``specs`` -> the dtype of the part it travels in (the module doc's rule;
    ``link``: :func:`message_layout`'s). An integer payload (THC's int64 words, whose norm slots are
    float64 bits) would not survive the conversion: refused."""
    dtypes = {dtype for _, dtype in specs}
    if not dtypes:
        return {}
    if not all(d.is_floating_point for d in dtypes):
        raise TypeError(f"a message sums floating-point payloads; got {sorted(str(d) for d in dtypes)}")
    home = {d: d if d in PART_DTYPES else torch.float32 for d in dtypes}   # float8 and such: exactly in float32
    present = [d for d in PART_DTYPES if d in home.values()]
    size = {d: 0 for d in present}
    for numel, dtype in specs:
        size[home[dtype]] += numel
    into = {d: d for d in present}
    # Payloads of no elements hold no value to convert: a dtype of none travels in the widest part that
    # has elements (the widest part, where none has), not in a collective of its own that carries nothing
    # nor as a wider part that would widen the others' values.
    filled = [d for d in present if size[d] > 0] or present[:1]
    for d in present:
        if d not in filled:
            into[d] = filled[0]
    present = filled
    for narrow in reversed(present):   # narrowest first, so that merges accumulate
        # the narrowest wider part that holds every value of this one exactly (half precision: float32)
        wide = next((w for w in (torch.float32, torch.float64) if w in present and w.itemsize > narrow.itemsize), None)
        if wide is not None and narrow not in keep and _widening_pays(size[narrow], narrow, size[wide], wide,
                                                                        link, world_size):
            into[narrow] = wide
            size[wide] += size[narrow]
    for d in present:   # resolve chains (bfloat16 -> float32 -> float64); PART_DTYPES lists the wider first
        into[d] = into[into[d]]
    return {d: into[h] for d, h in home.items()}


def _widening_pays(elements: int, narrow: torch.dtype, wide_elements: int, wide: torch.dtype, link,
                   world_size: int) -> bool:
    """Whether ``elements`` of a ``narrow`` part travel at less cost in the ``wide`` part (of
    ``wide_elements``) than in a part of their own (:func:`message_layout`)."""
    if link is None:
        return elements * (wide.itemsize - narrow.itemsize) < SEPARATE_PART_MIN_BYTES
    n = world_size
    merged = link.allreduce((wide_elements + elements) * wide.itemsize, n)
    apart = link.allreduce(wide_elements * wide.itemsize, n) + \
        link.allreduce(elements * narrow.itemsize, n, half=narrow.itemsize == 2)
    return merged < apart


def in_place_outputs(aggregators: Sequence, slots: Sequence[torch.Tensor]) -> Optional[List[Optional[torch.Tensor]]]:
    """The ``outs`` for :func:`decode_message`: ``slots[i]``, the memory that held tensor i (its slice of
    the engine's buffer), where its aggregator never reads the encoded tensor again
    (``reads_input_after_decode`` False: THC) and the slot can be written by the kernels (contiguous
    float32, no graph); None for the others, whose results the adapter copies in. None when no tensor
    qualifies."""
    if len(aggregators) != len(slots):
        raise ValueError(f"in_place_outputs: {len(aggregators)} aggregators for {len(slots)} slots")
    outs = [slot if not agg.reads_input_after_decode and slot.dtype == torch.float32 and slot.is_contiguous()
            and not slot.requires_grad else None for agg, slot in zip(aggregators, slots)]
    return outs if any(out is not None for out in outs) else None


def decode_segments(message: Message, summed: Sequence[torch.Tensor],
                    outs: Optional[Sequence[Optional[torch.Tensor]]] = None) -> List[DecodeOutcome]:
    """Decode each tensor's segment of ``summed``: the engine's SUMs of every rank's ``message.parts``,
    in order (a part summed in place: the part itself).

    Raises :class:`~lossless_hc.training.aggregate.ConfigurationMismatch` when ranks were configured
    differently; an outcome with ``needs_fallback`` must be completed with an exact dense SUM, one
    with ``needs_partial`` with the SUM of its :func:`~lossless_hc.training.aggregate.partial_values`.
    ``outs[i]``, where given, is passed to tensor i's decode as ``out`` (only THC's
    aggregators take it: see :meth:`~lossless_hc.training.thc_aggregate.THCAggregator.decode`)."""
    check_sums(message.parts, summed)
    outcomes = []
    for i, (agg, (payload, ctx), (part, offset)) in enumerate(zip(message.aggregators, message.encoded,
                                                                 message.places)):
        segment = summed[part][offset:offset + payload.numel()].to(payload.dtype)
        out = {"out": outs[i]} if outs is not None and outs[i] is not None else {}
        outcomes.append(agg.decode(segment, ctx, **out))
    return outcomes


def check_sums(parts: Sequence[torch.Tensor], summed: Sequence[torch.Tensor]) -> None:
    """ValueError unless ``summed`` holds one tensor per part, each of its part's size and dtype (a
    short or misordered one would decode other tensors' slices)."""
    if len(summed) != len(parts):
        raise ValueError(f"a message of {len(parts)} parts; got {len(summed)} sums")
    for i, (part, s) in enumerate(zip(parts, summed)):
        if s.numel() != part.numel() or s.dtype != part.dtype:
            raise ValueError(f"the sum of part {i} has {s.numel()} {s.dtype} elements; the part "
                             f"{part.numel()} {part.dtype}")


def dense_values(message: Message, indices: Sequence[int]) -> torch.Tensor:
    """The tensors ``indices`` of ``message`` as the exact dense fallback sums them: one flat float32
    tensor (what the payloads encoded, top-k selections included)."""
    if not indices:
        return torch.empty(0, dtype=torch.float32, device=message.parts[0].device if message.parts else "cpu")
    return torch.cat([message.encoded[i][1].dense_value.reshape(-1).to(torch.float32) for i in indices])


def finish_fallbacks(message: Message, outcomes: List[DecodeOutcome], indices: Sequence[int],
                     summed_dense: torch.Tensor) -> List[torch.Tensor]:
    """The results of the fallbacks ``indices`` from ``summed_dense`` (the SUM of :func:`dense_values`)."""
    results, offset = [], 0
    for i in indices:
        m = math.prod(message.encoded[i][1].shape)
        results.append(message.aggregators[i].finish_fallback(summed_dense[offset:offset + m], outcomes[i]))
        offset += m
    return results


def decode_message(message: Message, summed: Sequence[torch.Tensor], dense_sum: Callable[[torch.Tensor], None],
                   outs: Optional[Sequence[Optional[torch.Tensor]]] = None) -> List[torch.Tensor]:
    """Every tensor's aggregate from ``summed`` (as for :func:`decode_segments`); segments that fail to
    decode, and the inexact keys' coordinates of segments that reported some, are re-aggregated by
    ``dense_sum(t)``, which must SUM ``t`` (float32: the dense values of the failed segments, then the
    partial values, in segment order) across the same ranks *in place* (blocking), and which is called
    at most once, identically on every rank (or not at all). ``outs``: as for :func:`decode_segments`."""
    outcomes = decode_segments(message, summed, outs=outs)
    results = [o.value for o in outcomes]
    failed = [i for i, o in enumerate(outcomes) if o.needs_fallback]
    partial = [i for i, o in enumerate(outcomes) if o.needs_partial]
    if failed or partial:
        dense = dense_values(message, failed)
        parts = [partial_values(message.encoded[i][1], outcomes[i].partial).to(torch.float32) for i in partial]
        both = torch.cat([dense] + parts) if parts else dense
        # their aggregators counted these values in the tensor's dtype; they travel as float32
        numels = [math.prod(message.encoded[i][1].shape) for i in failed] + [p.numel() for p in parts]
        for i, numel in zip(failed + partial, numels):
            message.aggregators[i].stats.count_widened(numel, message.encoded[i][1].dtype, torch.float32)
        dense_sum(both)
        dense, offset = both[:dense.numel()], dense.numel()
        for i, value in zip(failed, finish_fallbacks(message, outcomes, failed, dense)):
            results[i] = value
        for i in partial:
            m = outcomes[i].partial.numel()
            results[i] = message.aggregators[i].finish_partial(both[offset:offset + m], outcomes[i])
            offset += m
    return results


def failure_record(outcome: DecodeOutcome) -> tuple:
    """What the rank that decoded a failed segment (``outcome.needs_fallback``) tells the others for
    :func:`replay_failure`: ``(status, total_keys, overloaded_ranks)`` of its report, as integers."""
    report = outcome.report
    return int(report.status), int(report.total_keys), int(report.overloaded_ranks)


def replay_failure(aggregator, status: int, total_keys: int, overloaded_ranks: int) -> None:
    """Apply, on a rank that did not decode, what a failed decode changed on the rank that did (the
    owner of a reduce-scatter destination; the arguments are the owner's :func:`failure_record`):
    :meth:`~lossless_hc.training.aggregate.TensorAggregator.after_failure` (the capacity growth, a
    top-k residual dropped). Afterwards the aggregator builds the same codec as the owner's, so payload
    sizes keep matching. THC never fails: with a THC aggregator this raises TypeError."""
    after_failure = getattr(aggregator, "after_failure", None)
    if after_failure is None:
        raise TypeError(f"{type(aggregator).__name__} cannot fail to decode; nothing to replay")
    after_failure(_OwnerReport(DecodeStatus(int(status)), int(total_keys), int(overloaded_ranks)))


@dataclass(frozen=True)
class _OwnerReport:
    """The part of a :class:`~lossless_hc.lhc.codec.DecodeReport` that ``after_failure`` reads."""

    status: DecodeStatus
    total_keys: int
    overloaded_ranks: int
