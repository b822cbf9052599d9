"""Many tensors in one message: what the torch.distributed adapters (DDP, FSDP2) share.

An adapter that reduces several gradients with one collective (a DDP bucket, an FSDP2 parameter
group's shard) does, per step:

1. :func:`encode_message`: encode every tensor with its aggregator (:mod:`lossless_hc.training.aggregate`)
   into its slice of one flat tensor, the payloads' concatenation, in the widest payload dtype (THC's
   float64 words must stay exact; float32 payloads widen exactly and sum at least as accurately);
2. SUM that tensor across ranks with its engine (allreduce, or a reduce-scatter of one message per
   destination);
3. :func:`decode_segments`: decode each tensor's segment of the sum, or :func:`decode_message`, which
   also re-aggregates every segment that failed to decode densely, and just the inexact keys'
   coordinates of every segment that reported some (one more SUM for both, supplied by the adapter
   as ``dense_sum``), and returns the exact sums.

The adapter owns the collectives (and so the ordering that keeps them deadlock-free); everything here
is local. Every rank that decodes the same summed message takes the same decisions (fallback,
capacity growth), so every rank issues the same fallback collective. A rank that did not decode a
message (a reduce-scatter's non-owners) applies the owner's decision with :func:`replay_failure`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence

import torch

from lossless_hc.backends import backend_for
from lossless_hc.training.aggregate import DecodeOutcome, partial_values


@dataclass
class Message:
    """One encoded message: ``tensor`` is what the engine sums; ``encoded`` the ``(payload, ctx)``
    of each tensor, in order, with ``aggregators`` the aggregators that made them."""

    aggregators: list
    encoded: list
    tensor: torch.Tensor

    @property
    def segment_numels(self) -> List[int]:
        return [payload.numel() for payload, _ in self.encoded]


def encode_message(aggregators: Sequence, tensors: Sequence[torch.Tensor]) -> Message:
    """Encode ``tensors[i]`` with ``aggregators[i]`` into one message (see the module doc). Every
    aggregator knows its payload's size before encoding (``payload_spec``), so the message is
    allocated first and each payload of the message's dtype is encoded into its own slice; the others
    (a tensor sent dense, a narrower payload) are copied in, converted: the same tensor as the
    concatenation of the payloads, without a second copy of them."""
    specs = [agg.payload_spec() for agg in aggregators]
    wide = _message_dtype([dtype for _, dtype in specs])
    total = sum(numel for numel, _ in specs)
    if len(tensors):
        # The backend's buffer: on the CPU advised to huge pages, so a message of ~100 MiB is not
        # written through one page fault per 4 KiB (a quarter of the time at that size).
        device = tensors[0].device
        tensor = backend_for(device).empty(total, device, wide)
    else:
        tensor = torch.empty(0, dtype=wide)
    encoded, offset = [], 0
    for agg, t, (numel, dtype) in zip(aggregators, tensors, specs):
        piece = tensor[offset:offset + numel]
        offset += numel
        payload, ctx = agg.encode(t, out=piece) if dtype == wide else agg.encode(t)
        if payload.data_ptr() != piece.data_ptr():   # sent dense, or a narrower payload dtype
            piece.copy_(payload.reshape(-1))
        encoded.append((payload, ctx))
    return Message(list(aggregators), encoded, tensor)


def _message_dtype(dtypes) -> torch.dtype:
    """The message's dtype for payloads of ``dtypes``: float64 if any is (THC's words must stay exact),
    else float32. An integer payload (THC's int64 words, whose norm slots are float64 bits) would not
    survive the conversion: refused."""
    if not all(d.is_floating_point for d in dtypes):
        raise TypeError(f"a message sums floating-point payloads; got {sorted({str(d) for d in dtypes})}")
    return torch.float64 if torch.float64 in dtypes else torch.float32


def in_place_outputs(aggregators: Sequence, slots: Sequence[torch.Tensor]) -> Optional[List[Optional[torch.Tensor]]]:
    """The ``outs`` for :func:`decode_message`: ``slots[i]``, the memory that held tensor i (its slice of
    the engine's buffer), where its aggregator never reads the encoded tensor again
    (``reads_input_after_decode`` False: THC) and the slot can be written by the kernels (contiguous
    float32, no graph); None for the others, whose results the adapter copies in. None when no tensor
    qualifies."""
    outs = [slot if not agg.reads_input_after_decode and slot.dtype == torch.float32 and slot.is_contiguous()
            and not slot.requires_grad else None for agg, slot in zip(aggregators, slots)]
    return outs if any(out is not None for out in outs) else None


def decode_segments(message: Message, summed: torch.Tensor, partial: bool = True,
                    outs: Optional[Sequence[Optional[torch.Tensor]]] = None) -> List[DecodeOutcome]:
    """Decode each tensor's segment of ``summed`` (the engine's SUM of every rank's ``message.tensor``).

    Raises :class:`~lossless_hc.training.aggregate.ConfigurationMismatch` when ranks were configured
    differently; an outcome with ``needs_fallback`` must be completed with an exact dense SUM, one
    with ``needs_partial`` with the SUM of its :func:`~lossless_hc.training.aggregate.partial_values`
    (``partial=False``: inexact keys fall back densely instead, for a caller whose other ranks did not
    decode the segment). ``outs[i]``, where given, is passed to tensor i's decode as ``out`` (only THC's
    aggregators take it: see :meth:`~lossless_hc.training.thc_aggregate.THCAggregator.decode`)."""
    kw = {} if partial else {"partial": False}   # only lossless aggregators can be inexact
    outcomes, offset = [], 0
    for i, (agg, (payload, ctx)) in enumerate(zip(message.aggregators, message.encoded)):
        segment = summed[offset:offset + payload.numel()].to(payload.dtype)
        offset += payload.numel()
        out = {"out": outs[i]} if outs is not None and outs[i] is not None else {}
        outcomes.append(agg.decode(segment, ctx, **kw, **out))
    return outcomes


def dense_values(message: Message, indices: Sequence[int]) -> torch.Tensor:
    """The tensors ``indices`` of ``message`` as the exact dense fallback sums them: one flat float32
    tensor (what the payloads encoded, top-k selections included)."""
    if not indices:
        return torch.empty(0, dtype=torch.float32, device=message.tensor.device)
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


def decode_message(message: Message, summed: torch.Tensor, dense_sum: Callable[[torch.Tensor], None],
                   outs: Optional[Sequence[Optional[torch.Tensor]]] = None) -> List[torch.Tensor]:
    """Every tensor's aggregate from ``summed``; segments that fail to decode, and the inexact keys'
    coordinates of segments that reported some, are re-aggregated by ``dense_sum(t)``, which must SUM
    ``t`` (float32: the dense values of the failed segments, then the partial values, in segment
    order) across the same ranks *in place* (blocking), and which is called at most once,
    identically on every rank (or not at all). ``outs``: as for :func:`decode_segments`."""
    outcomes = decode_segments(message, summed, outs=outs)
    results = [o.value for o in outcomes]
    failed = [i for i, o in enumerate(outcomes) if o.needs_fallback]
    partial = [i for i, o in enumerate(outcomes) if o.needs_partial]
    if failed or partial:
        dense = dense_values(message, failed)
        parts = [partial_values(message.encoded[i][1], outcomes[i]).to(torch.float32) for i in partial]
        both = torch.cat([dense] + parts) if parts else dense
        dense_sum(both)
        dense, offset = both[:dense.numel()], dense.numel()
        for i, value in zip(failed, finish_fallbacks(message, outcomes, failed, dense)):
            results[i] = value
        for i in partial:
            m = outcomes[i].partial.numel()
            results[i] = message.aggregators[i].finish_partial(both[offset:offset + m], outcomes[i])
            offset += m
    return results


def replay_failure(aggregator, total_keys: int) -> None:
    """Apply, on a rank that did not decode, the capacity growth that a failed decode caused on the rank
    that did (the owner of a reduce-scatter destination): ``total_keys`` is the owner's
    ``DecodeReport.total_keys``. Afterwards the aggregator builds the same codec as the owner's, so
    payload sizes keep matching. THC never fails: with a THC aggregator this raises TypeError."""
    grow = getattr(aggregator, "_grow", None)
    if grow is None:
        raise TypeError(f"{type(aggregator).__name__} cannot fail to decode; nothing to replay")
    grow(_OwnerReport(int(total_keys)))


@dataclass(frozen=True)
class _OwnerReport:
    """The part of a :class:`~lossless_hc.lhc.codec.DecodeReport` capacity growth reads."""

    total_keys: int
