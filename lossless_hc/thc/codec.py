r"""THC: tensor homomorphic compression of dense gradients (Li et al., NSDI 2024).

Every rank maps its gradient to a fixed-shape payload of small integers packed into 64-bit words;
the element-wise SUM (or AVERAGE) of the payloads, computed by any engine without decoding, decodes
to an unbiased estimate of the sum (or average) of the gradients. See :class:`THCCodec`.
"""
from __future__ import annotations

import hashlib
import math
import numbers
import struct
from typing import Optional, Sequence

import torch

from lossless_hc.backends import (as_device, backend_for, check_disjoint, checked_out,
                                  check_num_threads)
from lossless_hc.backends.cpu import thc_round_stream, thc_sign_stream
from lossless_hc.lhc.layout import check_int, check_uint64, is_real
from lossless_hc.thc.layout import (HDR_CHECKSUM, HDR_CONTRIBUTORS, HDR_FINGERPRINT, HDR_NON_FINITE, HEADER_FIELDS,
                                    LAYOUT_VERSION, WORD_KINDS, FINGERPRINT_BITS, plan_thc_layout)
from lossless_hc.thc.table import THCTable, check_table_args, clip_threshold, table_for, table_variance


NON_FINITE_CHOICES = ("raise", "propagate")


def check_non_finite(non_finite) -> str:
    """``non_finite`` validated: "raise" or "propagate" (see :class:`THCCodec`)."""
    if non_finite not in NON_FINITE_CHOICES:
        raise ValueError(f"non_finite must be 'raise' or 'propagate', got {non_finite!r}")
    return non_finite


def _largest_norm(numel: int) -> float:
    """The largest norm M a step can agree on: numel coordinates, each finite squared in float32 (a larger
    coordinate makes its rank's input non-finite; docstring of ``non_finite``)."""
    return math.sqrt(numel) * math.sqrt(torch.finfo(torch.float32).max)


class THCCodec:
    r"""THC for one tensor on one rank: encode, (engine SUM/AVERAGE), decode, error feedback.

    Every rank builds the codec with the same arguments except ``rank``, and calls ``encode`` then
    ``decode`` once per step, in the same order as the others. The object is stateful (the step
    counter, the agreed scale M, the error-feedback memory), so a plugin keeps one per tensor (per
    parameter).

    Encode (rank r, step t; v = x + e, the gradient plus the error-feedback memory):

    1. Randomized Hadamard transform, the same on every rank: pad v to whole blocks of
       ``block`` = 2^k coordinates (``hadamard_block``, smaller for small tensors), flip signs with a
       step-dependent +-1 diagonal drawn from ``seed`` (shared), then ``y = H v / sqrt(block)`` per
       block (orthonormal). The coordinates of y are close to N(0, ||v||^2 / padded).
    2. Scale by the agreed norm and clip: ``z = clamp(y sqrt(padded) / M_t, -T, T)`` with
       ``T = PhiInv(1 - p/2)``, ``p = 1/overflow_freq``. M_t is the largest ||v|| among the ranks at
       step t - 1 (below), so z is close to a standard normal clipped at T (mass p clipped).
    3. Map to ``u = (z + T) g / (2T)`` in [0, g] and round without bias to a neighbouring level of the
       table (2^bits integer levels in [0, g], :func:`build_table`): ``a <= u <= b`` goes up with
       probability (u - a)/(b - a), drawn from a per-rank, per-step stream. (THC rounds in two
       stages, first to a 1001-point grid, to make the neighbour search a lookup; with integer levels
       ``floor(u)`` indexes the neighbours directly, so one unbiased stage suffices and has less
       variance.)
    4. Pack the levels as digits of base ``n g + 1`` into 64-bit words (``per_word`` per word);
       write the header (with the words' checksum, see :class:`~lossless_hc.thc.layout.THCLayout`),
       this rank's ||v|| into norm slot r and -||v|| into mirror r (0 in the other slots).
    5. Error feedback: ``e <- v - RHT^{-1}(own dequantized levels)`` (clipping and rounding error of
       this step, carried into the next; :attr:`error`).

    Aggregation: any engine sums the payloads element-wise (or averages them in float64). A digit of
    the sum is at most n g < base, so lanes never carry; words stay within the exact range of the
    dtype, so the integers survive any summation order and an average (see ``max_world_size``).

    Decode (identical on every rank, since every rank holds the same aggregated bits): recover the
    digit sums S_i, ``y_sum_i = (S_i 2T/g - n T) M_t / sqrt(padded)``, output ``RHT^{-1}(y_sum)``
    (or / n for an average). Then ``M_{t+1} = max_r slot_r``: every rank learns every rank's norm
    from the same payload, so no extra collective and no blocking norm round is needed.

    Unbiasedness: given the clipped z, the decoded sum is unbiased (E over the rounding draws), with
    variance per transformed coordinate ``(u - a)(b - u) (2T/g)^2 (M / sqrt(padded))^2`` summed over
    ranks; the rotation is orthonormal, so the expected squared error of the output is the sum of
    those variances over the ``numel`` coordinates' share. Clipping is the bias; error feedback
    returns the clipped mass at later steps.

    The first step (bootstrap): M_0 is unknown unless ``initial_norm`` is given. Then step 0 is a
    norm-only round: the payload still has its full shape (so every engine call is the same), but
    no levels are quantized, ``decode`` returns zeros, and (with error feedback) the whole step-0
    gradient stays in :attr:`error` and is sent at step 1, when M_1 = max_r ||v_r^0|| is known.
    Without error feedback the step-0 gradient is lost: pass ``initial_norm`` (any value every rank
    agrees on, e.g. a bound on the gradient norm) to quantize from step 0. The same rule applies
    whenever the agreed M is 0 (every rank sent zeros at the previous step).

    Effect of the one-step lag on clipping: M_t is last step's largest norm, not this step's. When
    ||v|| grows, z has a standard deviation above 1 and more than a fraction p of the coordinates
    clip; the clipped mass goes to error feedback (so ``e`` and hence the next norm grow, and M
    catches up one step later). When ||v|| shrinks, fewer coordinates clip and the levels are used
    less finely (more variance relative to ||v||).

    Args:
        numel: elements of the tensor (any shape with this many elements), >= 1.
        world_size: ranks whose payloads are aggregated.
        rank: this rank (selects the norm slot and the rounding stream), 0 <= rank < world_size.
        bits: the table has 2^bits levels (all g + 1 integers when 2^bits > g).
        granularity: g, levels are integers in [0, g] (1 <= g <= 65536). A table searched for (no ``levels``,
            none shipped, 2^bits <= g) costs (2^bits - 1)(g + 1)^2 steps, at most 2^32 (ValueError above).
        overflow_freq: 1/p, where p is the expected fraction of clipped coordinates for a normal input.
        seed: seeds the shared rotation and the rounding streams; identical on every rank.
        device: "cpu" (C++/OpenMP kernels) or "cuda" (the CUDA kernels of csrc/cuda/thc_kernels.cuh, from
            lossless_hc._C_cuda or compiled at run time through CuPy; the same payload bits as "cpu").
        levels: an explicit table (e.g. ``PUBLISHED_TABLE_4BIT_G30_P32``) instead of ``table_for``: as many
            integers as ``bits`` says, increasing from 0 to ``granularity`` (ValueError otherwise).
        symmetric_table: use the best table symmetric under l -> g - l (the published shape).
        hadamard_block: largest Hadamard block (power of two; 1024 as in THC's code).
        payload_dtype: torch.float64 (default; exact under SUM and AVERAGE) or torch.int64 (SUM
            only, e.g. torch.distributed with ReduceOp.SUM; more digits per word: one or two at
            granularity 30, e.g. 10 instead of 8 at world_size 2, more at small granularities).
        digits_per_word: pin the lane count (then ``world_size`` is limited, see ``max_world_size``);
            None packs as many as stay exact.
        error_feedback: keep the error memory e (recommended; needed for the bootstrap step).
        initial_norm: M_0; None means a norm-only first step. At most sqrt(numel) * sqrt(float32 max) (~1.8e19
            sqrt(numel)), the largest norm a step can agree on (a larger one overflows the kernels' float32
            scale).
        non_finite: when a rank's x + e holds NaN/Inf, every rank's decode either raises
            ``FloatingPointError`` ("raise", default) or returns all-NaN ("propagate", e.g. for AMP's
            GradScaler, which then skips the step). That rank sends only the header and its e is
            reset to zero (as when x is finite but x + e overflows float32, or the float32 sum of squares of
            one lane of the norm does: at most four coordinates, 256 apart within a chunk of 1024; a coordinate
            of about 1.845e19 or more always does, four of 9.3e18 in one lane too, while two of 1.5e19 in
            different lanes do not); the other ranks' levels
            of that step are not delivered (their e already counts them as sent): the step is lost.
        num_threads: OpenMP threads of the kernels (0: the OpenMP default).

    Example (one process emulating two ranks; the adds stand for the engine's SUM)::

        >>> codecs = [THCCodec(numel=4096, world_size=2, rank=r, seed=7) for r in range(2)]
        >>> for step in range(3):
        ...     grads = [torch.randn(4096) for _ in range(2)]
        ...     summed = codecs[0].encode(grads[0]) + codecs[1].encode(grads[1])
        ...     outs = [c.decode(summed) for c in codecs]   # step 0: zeros (norm-only round)
        >>> torch.equal(outs[0], outs[1])
        True
    """

    __slots__ = ("_backend", "layout", "table", "rank", "seed", "overflow_freq", "threshold", "device", "error_feedback",
                 "non_finite", "_num_threads", "_native", "_lo", "_width", "_inv_width", "_norm", "_step",
                 "_pending", "_error", "_shape", "_dtype", "_interleave_nb", "_last_norms", "_fingerprint_used")

    def __init__(self, numel: int, world_size: int, rank: int = 0, bits: int = 4, granularity: int = 30,
                 overflow_freq: float = 32, seed: int = 0, device="cpu", *, levels: Optional[Sequence[int]] = None,
                 symmetric_table: bool = False, hadamard_block: int = 1024,
                 payload_dtype: torch.dtype = torch.float64, digits_per_word: Optional[int] = None,
                 error_feedback: bool = True, initial_norm: Optional[float] = None, non_finite: str = "raise",
                 num_threads: int = 0):
        for name, flag in (("symmetric_table", symmetric_table), ("error_feedback", error_feedback)):
            if not isinstance(flag, bool):   # error_feedback="no" would keep the memory on
                raise TypeError(f"{name} must be a bool, got {flag!r}")
        if levels is None:
            self.table: THCTable = table_for(bits, granularity, overflow_freq, symmetric_table)
        else:
            # The same argument checks as table_for's, and the table bits describes (2^bits levels, or
            # all g + 1 integers): an explicit table is not a way around them.
            check_table_args(bits, granularity)
            if not all(isinstance(v, numbers.Integral) and not isinstance(v, bool) for v in levels):
                raise ValueError(f"levels must be integers, got {tuple(levels)!r}")
            if len(levels) != min(1 << bits, granularity + 1):
                raise ValueError(f"levels has {len(levels)} entries; bits={bits} with granularity={granularity} means "
                                 f"{min(1 << bits, granularity + 1)} (2^bits, or all g + 1 integers)")
            lv = tuple(int(v) for v in levels)
            self.table = THCTable(lv, bits, granularity, float(overflow_freq), clip_threshold(overflow_freq),
                                  table_variance(lv, granularity, overflow_freq))
        self.layout = plan_thc_layout(numel, world_size, granularity, hadamard_block, payload_dtype, digits_per_word)
        check_int(rank, "rank")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be an integer in [0, world_size={world_size}), got {rank!r}")
        check_uint64(seed, "seed")
        check_non_finite(non_finite)
        if initial_norm is not None and not (is_real(initial_norm) and 0 <= initial_norm <= _largest_norm(numel)):
            raise ValueError(f"initial_norm must be a number in [0, {_largest_norm(numel):.6g}] (or None; the largest "
                             f"norm of {numel} coordinates whose squares are finite in float32), got {initial_norm!r}")
        device = as_device(device)
        self._backend = backend_for(device)
        self.device = self._backend.require(device, "THCCodec")
        self.rank, self.seed = rank, seed
        self.overflow_freq = float(overflow_freq)
        self.threshold = self.table.threshold
        self.error_feedback = error_feedback
        self.non_finite = non_finite
        self.num_threads = num_threads
        # Neighbour lookup: for integer k in [0, g), the levels lo[k] <= k < k + 1 <= lo[k] + width[k].
        g = granularity
        lo, width = [], []
        lv = self.table.levels
        j = 0
        for k in range(g):
            while lv[j + 1] <= k:
                j += 1
            lo.append(float(lv[j]))
            width.append(float(lv[j + 1] - lv[j]))
        self._lo = torch.tensor(lo, dtype=torch.float32)
        self._width = torch.tensor(width, dtype=torch.float32)
        self._inv_width = 1.0 / self._width
        self._native = self._backend.thc_layout(self.layout, self.device, self._lo, self._width, self._inv_width)
        self._norm = float(initial_norm) if initial_norm is not None else 0.0
        self._step = 0
        self._pending = False
        self._error = torch.zeros(numel, dtype=torch.float32, device=self.device) if self.error_feedback else None
        self._shape, self._dtype = (numel,), torch.float32
        self._interleave_nb = 0
        self._last_norms: Optional[torch.Tensor] = None
        self._fingerprint_used = 0

    # -- sizes ---------------------------------------------------------------------------------
    @property
    def numel(self) -> int:
        return self.layout.numel

    @property
    def world_size(self) -> int:
        return self.layout.world_size

    @property
    def granularity(self) -> int:
        return self.layout.granularity

    @property
    def payload_numel(self) -> int:
        return self.layout.payload_numel

    @property
    def payload_dtype(self) -> torch.dtype:
        return self.layout.payload_dtype

    @property
    def wire_bytes(self) -> int:
        """Bytes one rank sends for this tensor (the whole payload)."""
        return self.layout.wire_bytes

    @property
    def bits_per_coordinate(self) -> float:
        """Wire bits per input coordinate, all included (32 for dense float32)."""
        return self.layout.bits_per_coordinate

    @property
    def step(self) -> int:
        """Steps completed (decodes done)."""
        return self._step

    @property
    def norm(self) -> float:
        """M for the next encode: the largest ||x + e|| any rank reported at the previous step
        (or ``initial_norm``); 0 means the next step is a norm-only round."""
        return self._norm

    @property
    def error(self) -> Optional[torch.Tensor]:
        """The error-feedback memory e (numel float32, 1-D): what this rank has not yet transmitted.
        After ``encode``: ``e = x + e_prev - RHT^{-1}(own dequantized levels)``. None when disabled."""
        return self._error

    @property
    def last_norms(self) -> Optional[torch.Tensor]:
        """Every rank's ||x + e|| at the last decoded step (float64, world_size), read from the payload."""
        return self._last_norms

    def reset(self) -> None:
        """Forget the error memory and the agreed norm: the next step is a norm-only round, also for a
        codec built with ``initial_norm`` (which is not remembered). Call on every rank."""
        if self._error is not None:
            self._error.zero_()
        self._norm, self._step, self._pending = 0.0, 0, False

    def __repr__(self) -> str:
        L = self.layout
        return (f"THCCodec(numel={L.numel}, world_size={L.world_size}, rank={self.rank}, levels={len(self.table.levels)}"
                f", granularity={L.granularity}, overflow_freq={self.overflow_freq:g}, block={L.block}, "
                f"{L.per_word} digits of base {L.base} per {L.payload_dtype} word, "
                f"{self.bits_per_coordinate:.2f} bits/coordinate)")

    # -- streams and the consistency fingerprint ------------------------------------------------
    def _fingerprint(self) -> int:
        """20-bit hash of everything the ranks must agree on at this step (configuration, step, M)."""
        L = self.layout
        # The seed as an unsigned 64-bit field: every bit of it enters the hash (s and s + 2^63 differ).
        msg = struct.pack("<7qQ2d", LAYOUT_VERSION, L.numel, L.world_size, L.granularity, L.block, L.per_word,
                          WORD_KINDS[L.payload_dtype], self.seed, self.overflow_freq, self._norm)
        msg += struct.pack(f"<{len(self.table.levels)}q", *self.table.levels) + struct.pack("<q", self._step)
        return int.from_bytes(hashlib.blake2b(msg, digest_size=8).digest(), "little") & ((1 << FINGERPRINT_BITS) - 1)

    # -- encode --------------------------------------------------------------------------------
    def _check_input(self, x: torch.Tensor, interleaved: bool) -> torch.Tensor:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
        if x.layout != torch.strided:   # COO, CSR, CSC, BSR, BSC
            raise TypeError(f"x is a sparse tensor ({x.layout}); pass it dense (e.g. x.to_dense())")
        if not isinstance(interleaved, bool):
            raise TypeError(f"encode's interleaved must be a bool, got {interleaved!r}")
        L = self.layout
        if interleaved:
            if L.numel != L.padded:
                raise ValueError(f"interleaved=True needs a codec of whole Hadamard blocks (numel={L.numel} is not "
                                 f"a multiple of the block, {L.block})")
            if x.numel() > L.numel:
                raise ValueError(f"x has {x.numel()} elements, more than the codec's {L.numel} (interleaved)")
        elif x.numel() != L.numel:
            raise ValueError(f"x has {x.numel()} elements, the codec was built for numel={L.numel}")
        if x.dtype not in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
            raise TypeError(f"x has dtype {x.dtype}; THCCodec encodes floating-point gradients "
                            "(float32, float16, bfloat16, float64)")
        if x.device != self.device:
            raise ValueError(f"x is on {x.device}, the codec on {self.device}")
        # resolve_neg: the kernels read memory, not torch's negative bit (x.conj().imag, torch._neg_view)
        return x.reshape(-1).to(torch.float32).contiguous().resolve_neg()

    def encode(self, x: torch.Tensor, out: Optional[torch.Tensor] = None, interleaved: bool = False) -> torch.Tensor:
        """Encode ``x`` (numel elements, any shape) into a 1-D payload of ``payload_numel`` elements
        of ``payload_dtype``: a new tensor, or ``out`` (contiguous, that dtype and size, sharing no
        memory with ``x``; every element is overwritten) to reuse a buffer across steps. No
        communication. Must be followed by ``decode`` of the aggregate before the next ``encode``.
        Remembers the shape and dtype of ``x`` for ``decode``.

        ``interleaved=True`` (the training aggregator's spreading, see ``THCAggregator``): x has at
        most numel elements, numel is a whole number nb of Hadamard blocks, and the codec encodes the
        interleave of x zero-padded to numel, block j holding x[j], x[j + nb], x[j + 2 nb], ...: the
        payload (and error memory, kept in that order) of ``encode(interleave(x))``, without making
        the interleave first on the CPU. ``decode`` then returns the sum in x's order and shape."""
        if self._pending:
            raise RuntimeError("THCCodec.encode called twice without decode: decode the aggregate of the previous "
                               "step first (every rank must run encode -> aggregate -> decode once per step)")
        flat = self._check_input(x, interleaved)
        self._shape, self._dtype = tuple(x.shape), x.dtype
        self._interleave_nb = self.layout.numel // self.layout.block if interleaved else 0
        L = self.layout
        if out is None:
            payload = self._backend.empty(L.payload_numel, self.device, L.payload_dtype)
        else:
            payload = checked_out(out, L.payload_numel, self.device, L.payload_dtype)
        check_disjoint(payload, flat, "out and x")
        if self._error is not None:
            check_disjoint(payload, self._error, "out and the codec's error memory")
        payload[:L.words_offset] = 0   # header and norm slots; the kernel writes every level word
        e = self._error
        M = self._norm
        g, T, D = L.granularity, self.threshold, L.padded
        quantize = M > 0.0   # M == 0: the norm-only round, all of x + e stays owed
        unit = M / math.sqrt(D) if quantize else 0.0   # one unit of z in the rotated domain
        if not quantize:
            payload[L.words_offset:] = 0
        self._backend.thc_encode(self._native, quantize, math.sqrt(D) / M if quantize else 0.0, T, (2.0 * T / g) * unit,
                                 -T * unit, self._sign_stream(), self._round_stream(), flat, e,
                                 WORD_KINDS[L.payload_dtype], payload, L.words_offset, L.norm_offset + self.rank,
                                 L.mirror_offset + self.rank, HDR_NON_FINITE, HDR_CHECKSUM, self._check(self._step),
                                 self.num_threads, self._interleave_nb)
        fingerprint = self._fingerprint()
        # fill_ of a one-element view: on CUDA a kernel with the value as its argument (indexed assignment of
        # a Python number copies a host scalar, which synchronises)
        payload.narrow(0, HDR_CONTRIBUTORS, 1).fill_(1)
        payload.narrow(0, HDR_FINGERPRINT, 1).fill_(fingerprint)
        self._fingerprint_used = fingerprint
        self._pending = True
        return payload

    def _sign_stream(self) -> int:
        return thc_sign_stream(self.seed, self._step)

    def _check(self, step: int) -> tuple:
        """(P, c0, k) of the payload checksum at ``step`` (THCLayout): drawn from the seed and the step,
        the same on every rank; k coprime to P - 1, so the coefficients of words less than P - 1
        apart differ."""
        P = self.layout.check_prime
        h = hashlib.blake2b(struct.pack("<QQ", self.seed, step), digest_size=16, person=b"thc-checksum").digest()
        c0 = int.from_bytes(h[:8], "little") % (P - 1)
        k = 1 + int.from_bytes(h[8:], "little") % (P - 2)
        while math.gcd(k, P - 1) != 1:
            k = k % (P - 2) + 1
        return P, c0, k

    def _round_stream(self) -> int:
        return thc_round_stream(self.seed, self.rank, self._step)

    # -- decode --------------------------------------------------------------------------------
    def decode(self, payload: torch.Tensor, averaged: bool = False, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Decode an aggregated payload into the sum of the ranks' inputs, or their average with
        ``averaged=True`` (the payload is then the engine's element-wise AVERAGE). Returns a tensor
        with the shape and dtype of the last encoded ``x`` (``out``, a contiguous float32 tensor of
        as many elements as that x, sharing no memory with ``payload``, is filled and returned when
        given and the input dtype is float32).

        Every rank computes the same bits from the same payload, and updates the same state: the step
        counter and ``norm`` (M for the next step, the largest norm slot).

        Raises ValueError when the payload is not the SUM/AVERAGE of ``world_size`` payloads of this
        configuration at this step (wrong ``averaged``, ranks built with different arguments, ranks
        out of step, corrupted words), and FloatingPointError when a rank's input was non-finite
        (unless ``non_finite="propagate"``). In both cases the step counter still advances by one,
        identically on every rank; ``norm`` is taken from the norm slots only when the header and the
        slots are valid, and kept otherwise. A payload of the wrong type, dtype, shape or device, an
        int64 payload with ``averaged=True``, or an unfit ``out``, is refused (TypeError, ValueError)
        before any state changes.
        """
        L = self.layout
        if not self._pending:
            raise RuntimeError("THCCodec.decode called without a preceding encode on this rank")
        if not isinstance(averaged, bool):   # averaged="no" would decode a sum as an average
            raise TypeError(f"decode's averaged must be a bool, got {averaged!r}")
        if not isinstance(payload, torch.Tensor):
            raise TypeError(f"payload must be a torch.Tensor, got {type(payload).__name__}")
        if payload.dtype != L.payload_dtype:
            raise TypeError(f"payload must be {L.payload_dtype} (this codec's payload_dtype), got {payload.dtype}")
        if payload.dim() != 1 or payload.numel() != L.payload_numel:
            raise ValueError(f"payload must be 1-D with {L.payload_numel} elements (this codec's payload_numel), "
                             f"got shape {tuple(payload.shape)}")
        if payload.device != self.device:
            raise ValueError(f"payload is on {payload.device}, the codec on {self.device}")
        if averaged and L.payload_dtype == torch.int64:
            raise ValueError("an int64 payload cannot be averaged exactly (integer averages truncate); aggregate it "
                             "with SUM and decode with averaged=False, or use payload_dtype=torch.float64")
        payload = payload.contiguous().resolve_neg()
        numel = math.prod(self._shape)   # L.numel, or fewer when interleaved
        if out is not None:
            checked_out(out, numel, self.device)
            check_disjoint(out, payload, "out and payload")
            if self._error is not None:   # the decode writes out, then the error memory is read next step
                check_disjoint(out, self._error, "out and the codec's error memory")
        n = L.world_size
        mult = float(n) if averaged else 1.0
        M = self._norm
        # The state advances identically on every rank whatever happens below.
        self._pending = False
        self._step += 1

        head = payload[:L.words_offset]
        if head.device.type != "cpu":
            head = head.cpu()   # one copy (and sync) for the header and the norm slots
        header = head[:HEADER_FIELDS].double().mul(mult).tolist()
        ints = []
        for v in header:
            r = round(v) if math.isfinite(v) else None
            ints.append(r if r is not None and abs(v - r) <= (0.5 if averaged else 0.0) else None)
        if L.payload_dtype == torch.float64:
            slots = head[L.norm_offset:L.words_offset].mul(mult)
        else:
            slots = head[L.norm_offset:L.words_offset].view(torch.float64).clone()
        norms, mirrors = slots[:n], slots[n:]
        contributors, fingerprint, non_finite, checksum = ints
        if contributors != n:
            hint = ""
            if not averaged and contributors == 1 and n > 1:
                hint = " (an averaged payload? pass averaged=True)"
            elif averaged and contributors == n * n and n > 1:
                hint = " (a summed payload? pass averaged=False)"
            raise ValueError(f"payload aggregates {header[HDR_CONTRIBUTORS]:g} contributions, expected "
                             f"world_size={n}{hint}")
        if fingerprint != n * self._fingerprint_used:
            raise ValueError("THC configuration or step mismatch: the ranks' fingerprints disagree (different "
                             "numel/world_size/bits/granularity/overflow_freq/seed/table/payload dtype, or ranks at "
                             "different steps or with different agreed norms). Build every rank's codec with the "
                             "same arguments and run encode -> aggregate -> decode once per step on every rank")
        if non_finite is None or not 0 <= non_finite <= n:
            raise ValueError("payload header is corrupted (non-finite flag count is not an integer in [0, n])")
        P = L.check_prime
        if checksum is None or not 0 <= checksum <= (n - non_finite) * (P - 1):
            raise ValueError("payload header is corrupted (the checksum field is not an integer in its range)")
        # A rank that flagged a non-finite input sent zeros in its slot and mirror (equal to -0 too).
        if (not bool(torch.isfinite(norms).all()) or bool((norms < 0).any())
                or not torch.equal(mirrors, torch.neg(norms))):
            raise ValueError("payload norm slots are corrupted (negative, non-finite, or not the exact negation of "
                             "their mirrors)")
        self._last_norms = norms
        self._norm = float(norms.max())

        def result(y: torch.Tensor) -> torch.Tensor:
            return y.reshape(self._shape).to(self._dtype)

        y = out.view(-1) if out is not None else self._backend.empty(numel, self.device)
        if non_finite:
            if self.non_finite == "raise":
                raise FloatingPointError(f"non-finite input (NaN/Inf) on {non_finite} rank(s) at step {self._step - 1}")
            y.fill_(float("nan"))
            return result(y)
        if M == 0.0:
            y.zero_()  # norm-only round: nothing was quantized
            return result(y)
        g, T = L.granularity, self.threshold
        unit = M / math.sqrt(L.padded)
        a, b = (2.0 * T / g) * unit, -T * unit
        if averaged:
            a /= n          # average = S a / n + b
        else:
            b *= n          # sum = S a + n b
        bad, words_check = self._backend.thc_decode(self._native, self._sign_stream_of(self._step - 1),
                                                    WORD_KINDS[L.payload_dtype], payload[L.words_offset:], mult, a, b,
                                                    y, self._check(self._step - 1), self.num_threads,
                                                    self._interleave_nb)
        if bad:
            raise ValueError(f"{bad} payload word(s) are not valid aggregated digit words (non-integer or out of "
                             f"range{' after scaling the average by n' if averaged else ''}): the payload is corrupted "
                             "or not a plain SUM/AVERAGE of world_size payloads")
        if words_check != checksum % P:
            raise ValueError("payload checksum mismatch: the level words are not the SUM/AVERAGE of what the ranks "
                             "sent (corrupted in transit or by the engine)")
        return result(y)

    def _sign_stream_of(self, step: int) -> int:
        return thc_sign_stream(self.seed, step)

    @property
    def num_threads(self) -> int:
        """OpenMP threads of the kernels (0: the OpenMP default); checked when set, since the kernels
        take any int (a count in the tens of thousands crashes the process)."""
        return self._num_threads

    @num_threads.setter
    def num_threads(self, value: int) -> None:
        self._num_threads = check_num_threads(value)

    # Pickled without the kernels' view of the layout (rebuilt from the layout on load).
    def __getstate__(self):
        return {k: getattr(self, k) for k in self.__slots__ if k not in ("_native", "_backend") and hasattr(self, k)}

    def __setstate__(self, state):
        for k, v in state.items():
            setattr(self, k, v)
        self._backend = backend_for(self.device)
        self._native = self._backend.thc_layout(self.layout, self.device, self._lo, self._width, self._inv_width)

    # -- checkpointing -------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The state to checkpoint (step, agreed norm, error memory); restore with load_state_dict."""
        return {"step": self._step, "norm": self._norm,
                "error": None if self._error is None else self._error.clone()}

    def load_state_dict(self, state: dict) -> None:
        """Restore a :meth:`state_dict`. A state no codec could have saved (a step that is not an int >= 0,
        a norm that is not finite and >= 0, an error memory of another numel) raises, changing nothing:
        a negative or non-finite M would quantize on a table it does not describe."""
        if self._pending:
            raise RuntimeError("load_state_dict between encode and decode")
        step, norm, error = state["step"], state["norm"], state["error"]
        check_int(step, "state['step']")
        if step < 0:
            raise ValueError(f"state['step'] must be >= 0, got {step}")
        if not (is_real(norm) and 0 <= norm <= _largest_norm(self.numel)):
            raise ValueError(f"state['norm'] must be a finite number >= 0 (the agreed norm M) no larger than "
                             f"{_largest_norm(self.numel):.6g}, the largest norm of {self.numel} coordinates whose "
                             f"squares are finite in float32, got {norm!r}")
        if self._error is not None and (not isinstance(error, torch.Tensor) or error.numel() != self.numel):
            raise ValueError("state has no error memory of this codec's numel")
        self._step, self._norm = step, float(norm)
        if self._error is not None:
            self._error.copy_(error.reshape(-1))
