"""THC quantization of one dense tensor across steps: the aggregator behind ``Compression.thc``.

Split from :mod:`lossless_hc.training.aggregate` (which holds the lossless and top-k aggregators and
the vocabulary they share: :class:`~lossless_hc.training.aggregate.EncodeContext`,
:class:`~lossless_hc.training.aggregate.DecodeOutcome`, the stats and the mismatch error); the
adapters drive it the same way: ``encode`` -> the engine's SUM/AVERAGE -> ``decode``.
"""
from __future__ import annotations

import math
import time
from typing import Optional

import torch

from lossless_hc.backends import backend_for, checked_out
from lossless_hc.lhc.layout import HDR_CONTRIBUTORS
from lossless_hc.thc import THCCodec
from lossless_hc.training.aggregate import (CODEC_DTYPES, AggregationStats, ConfigurationMismatch, DecodeOutcome,
                                            EncodeContext, check_dense_gradient, payload_is_averaged)


class THCAggregator:
    r"""THC quantization of one dense tensor across steps (``Compression.thc``).

    Wraps one :class:`~lossless_hc.THCCodec` per tensor and rank (it carries the step counter, the
    agreed norm and the error-feedback memory; see its docstring for the math and the norm-only first
    step). Like :class:`TensorAggregator` it sends a tensor dense when THC's payload would not be
    smaller (tiny tensors: biases), decided from the configuration alone. THC cannot fail to decode,
    so there is no fallback; ranks configured differently, or a corrupted payload, raise
    :class:`ConfigurationMismatch`. A step where some rank's gradient holds NaN/Inf raises
    ``FloatingPointError`` on every rank (``non_finite="raise"``) or decodes to all-NaN on every rank
    (``non_finite="propagate"``: AMP's GradScaler sees the Inf and skips the step; dense-sent tensors
    carry their NaN/Inf through the engine's sum anyway).
    The codec's CPU kernels use ``torch.get_num_threads()`` threads, read at every encode and decode (a
    DDP hook decodes on a communication thread, where OpenMP's default would be every core).
    The codec follows the gradient's device: built on the CPU, it moves (with its state) to the device of
    the first gradient it sees elsewhere, e.g. CUDA (THCCodec's CUDA kernels).

    **Interleaved blocks.** THCCodec rotates each Hadamard block of B coordinates on its own but scales
    every block by one agreed M (the tensor's largest norm), which assumes the energy of x + e is
    spread evenly over the blocks: then a block's rotated coordinates are ~N(0, ||v||^2 / padded) and a
    share p = 1/overflow_freq clips at +-T. A gradient whose energy sits in a few blocks (the rows of an
    embedding or an output layer for the words of the batch, some gate blocks of an LSTM) breaks that:
    those blocks' coordinates are many times M / sqrt(padded), most of their energy clips, the clipped
    mass piles up in the error memory, and the update is a stale, sign-like version of the gradient
    (measured on the LSTM language model: NMSE 0.75-0.79 against the encoded x + e on the embedding and
    the decoder, where a normal vector gives ~0.020: 0.013 rounding, 0.007 clipping; docs/THC.md). So, for
    a tensor of more than one block, the aggregator feeds the codec a fixed interleave of the zero-padded tensor instead: with nb
    blocks, block j holds the coordinates j, j + nb, j + 2 nb, ... of the tensor (the padded tensor seen
    as a (B, nb) matrix, transposed). Every block then samples the whole tensor evenly, each block's
    energy is close to ||v||^2 B / padded, and the single scale M fits every block. (What it cannot
    spread: a tensor whose energy follows a period of nb coordinates, e.g. a matrix with nb columns of
    very different norms, keeps one column per block.) The interleave is a permutation (the same on every rank), so
    the aggregate is the codec's unbiased estimate, exactly un-permuted; the error memory lives in the
    interleaved order (:meth:`pending_error` returns it in the tensor's order). The codec does it
    (``THCCodec.encode(x, interleaved=True)``): on the CPU its kernels read and write the tensor's
    columns group by group, on CUDA through strided copies.

    ``exact=True`` sends the tensor dense (an exact SUM) whatever its size: for the parameters where THC's
    noise must not go, see docs/THC.md ("Training with THC").
    """

    engine_averages: Optional[bool] = None   # set by a plugin that knows its engine's op (payload_is_averaged)

    def __init__(self, name: str, shape, dtype: torch.dtype, world_size: int, rank: int, bits: int = 4,
                 granularity: int = 30, overflow_freq: float = 32, seed: int = 0, non_finite: str = "raise",
                 stats: Optional[AggregationStats] = None, exact: bool = False):
        self.name = name
        self.shape = tuple(shape)
        self.dtype = dtype
        self.numel = math.prod(self.shape)
        self.world_size = int(world_size)
        self.stats = stats if stats is not None else AggregationStats()
        self.exact = bool(exact)    # the user asked for this tensor to be sent dense (exact)
        self._codec = None
        self._blocks = 1            # nb > 1: the codec encodes the interleave of the padded tensor
        if dtype in CODEC_DTYPES and self.numel > 0 and not self.exact:
            self._codec_args = dict(numel=self.numel, world_size=world_size, rank=rank, bits=bits,
                                    granularity=granularity, overflow_freq=overflow_freq, seed=seed,
                                    non_finite=non_finite)
            L = THCCodec(**self._codec_args).layout
            if L.padded // L.block > 1:
                self._blocks = L.padded // L.block
                self._codec_args["numel"] = L.padded   # the same blocks, hence the same payload
            codec = THCCodec(**self._codec_args)
            if codec.wire_bytes < self.numel * dtype.itemsize:
                self._codec = codec

    @property
    def interleaved(self) -> bool:
        """Whether the codec encodes the interleave of the padded tensor (more than one block)."""
        return self._codec is not None and self._blocks > 1

    def _deinterleave(self, y: torch.Tensor) -> torch.Tensor:
        """The inverse of the interleave (class docstring): the tensor's numel coordinates, flat (float32)."""
        backend = backend_for(y.device)
        out = backend.empty(self.numel, y.device)
        backend.thc_deinterleave(y.reshape(-1), self._blocks, self._codec.layout.block, out, torch.get_num_threads())
        return out

    def pending_error(self) -> Optional[torch.Tensor]:
        """The codec's error memory (what this rank has not yet transmitted) in the tensor's own
        coordinate order, flat float32; None when the tensor is sent dense or without error feedback."""
        if self._codec is None or self._codec.error is None:
            return None
        e = self._codec.error
        return self._deinterleave(e) if self._blocks > 1 else e

    @property
    def compressed(self) -> bool:
        return self._codec is not None

    @property
    def codec(self):
        return self._codec

    @property
    def sent_as(self) -> str:
        """How this tensor goes out: "thc", "thc-interleaved", "dense (exact=)" (asked for), or
        "dense (smaller)" (THC's payload would not be smaller, or the dtype is not a float the codec takes)."""
        if self._codec is not None:
            return "thc-interleaved" if self._blocks > 1 else "thc"
        return "dense (exact=)" if self.exact else "dense (smaller)"

    # THC never reads an encoded tensor again (no fallback): its memory may take the decoded result
    # (``decode(out=)``; see :func:`lossless_hc.training.message.in_place_outputs`).
    reads_input_after_decode = False

    def payload_spec(self):
        """The ``(numel, dtype)`` of the payload :meth:`encode` returns, known before encoding: THC's
        size depends on the configuration alone (a tensor sent dense is its own payload)."""
        if self._codec is None:
            return self.numel, self.dtype
        return self._codec.layout.payload_numel, self._codec.layout.payload_dtype

    def encode(self, x: torch.Tensor, out: Optional[torch.Tensor] = None):
        """``(payload, ctx)`` as :meth:`TensorAggregator.encode`. ``out``: where to write a compressed
        tensor's payload (contiguous, :meth:`payload_spec`'s numel and dtype, on x's device; e.g. its
        slice of the adapter's message), which is then the payload; ignored when the tensor is sent
        dense (its payload is x itself)."""
        t0 = time.perf_counter()
        check_dense_gradient(self.name, x, self.shape, self.dtype)
        codec = self._codec
        if codec is not None and x.device != codec.device:
            codec = self._codec_on(x.device)
        if codec is None:
            payload = x
        else:
            codec.num_threads = torch.get_num_threads()
            payload = codec.encode(x, out=out, interleaved=self._blocks > 1)
        self.stats.count_encode(self.numel * self.dtype.itemsize, payload, codec is not None, t0)
        return payload, EncodeContext(self.shape, self.dtype, codec is not None, x, codec)

    def _codec_on(self, device: torch.device):
        """The codec rebuilt on ``device`` with the same configuration and state (step, norm, memory)."""

        codec = THCCodec(**self._codec_args, device=device)
        codec.load_state_dict(self._codec.state_dict())
        self._codec = codec
        return codec

    def decode(self, aggregated: torch.Tensor, ctx: EncodeContext,
               out: Optional[torch.Tensor] = None) -> DecodeOutcome:
        """The SUM (or AVERAGE) of the ranks' tensors from the engine's aggregate of their payloads.
        ``out``: where to write a compressed tensor's result (a contiguous float32 tensor of ``numel``
        elements on the codec's device, e.g. the slice of the engine's buffer that held this gradient:
        THC never reads the encoded gradient again, so it may overwrite it); the value is then ``out``
        in the tensor's shape. A tensor sent dense returns its segment of the aggregate either way."""
        if not ctx.compressed:
            return DecodeOutcome(aggregated, averaged=False)
        t0 = time.perf_counter()
        if out is not None:   # the caller's buffer: its own ValueError, not a mismatch between the ranks below
            checked_out(out, self.numel, ctx.codec.device)
        averaged = payload_is_averaged(aggregated, self.world_size, self.engine_averages)
        try:
            # torch's intra-op thread count, also on a DDP future's callback thread, where OpenMP's own
            # default would be every core (omp_set_num_threads, behind torch.set_num_threads, is per thread).
            ctx.codec.num_threads = torch.get_num_threads()
            y = ctx.codec.decode(aggregated, averaged=averaged, out=out)   # the tensor's order and shape
        except ValueError as e:
            hint = ""
            if self.engine_averages is not None:
                count = float(aggregated[HDR_CONTRIBUTORS]) * (self.world_size if averaged else 1)
                if count < self.world_size - 0.5:   # ranks that sent nothing: THC's norm needs every rank's
                    hint = (f" ({self.world_size - round(count)} rank(s) sent nothing, as after hvd.join(), which "
                            "THC does not support)")
            raise ConfigurationMismatch(f"{self.name}: {e}{hint}") from e
        self.stats.decode_seconds += time.perf_counter() - t0
        return DecodeOutcome(y, averaged)
