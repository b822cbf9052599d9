"""The lossless homomorphic sparse-sum codec (LHC).

Each rank encodes its (sparse) tensor into a fixed-shape float32 payload; the element-wise SUM (or
AVERAGE) of all ranks' payloads, computed by any engine in any order, decodes to the sum (or
average) of the ranks' tensors.
"""
from __future__ import annotations

import math
import struct
from dataclasses import dataclass, field, replace
from typing import Optional

import torch

from lossless_hc.backends import (as_device, backend_for, check_disjoint, checked_out,
                                  check_num_threads)
from lossless_hc.lhc.layout import (CHUNK_BITS, HDR_CONTRIBUTORS, HDR_FP_HI, HDR_FP_LO, HDR_KEYS_HI, HDR_KEYS_LO, HDR_NON_FINITE, HDR_OVERLOADED, HDR_SATURATED, HEADER_FIELDS, INDEX_CHECK_PRIMES, PayloadLayout, is_real, options_fingerprint)
from lossless_hc.lhc.cost_model import plan_layout
from lossless_hc.lhc.status import DecodeStatus, message

_ACCEPTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
DEFAULT_RTOL = 2.0 ** -10


def _key_count(fields) -> int:
    """The key count of a header's three 11-bit chunks ``fields[HDR_KEYS_LO:HDR_KEYS_HI + 1]`` (integers)."""
    lo, mid, hi = fields
    return lo + (mid << CHUNK_BITS) + (hi << (2 * CHUNK_BITS))


def _no_keys() -> torch.Tensor:
    return torch.zeros(0, dtype=torch.int64)


def key_coordinates(keys: torch.Tensor, block: int, numel: int) -> tuple:
    """``(coords, rows)``: the flat coordinates of ``keys`` (int64 keys below ``ceil(numel / block)``;
    key k covers coordinates ``k*block .. min((k+1)*block, numel) - 1``, as in
    ``DecodeReport.inexact_keys``), and for each coordinate the position of its key in ``keys``, on
    ``keys``' device. Only a partial last block needs a mask (on CUDA a boolean mask synchronises, and
    the training aggregator calls this every inexact step), so without one nothing is masked."""
    n = keys.numel()
    coords = (keys.reshape(-1, 1) * block + torch.arange(block, device=keys.device)).reshape(-1)
    rows = torch.arange(n, device=keys.device).reshape(-1, 1).expand(n, block).reshape(-1)
    if numel % block == 0:
        return coords, rows
    inside = coords < numel
    return coords[inside], rows[inside]


@dataclass
class DecodeReport:
    r"""What ``LosslessCodec.decode`` found.

    ok               True iff the output is the exact aggregate: the same non-zero keys as the true
                     sum t, and every coordinate y_i with :math:`|y_i - t_i| \le rtol\,|t_i|`
                     (``rtol`` the codec's; proven per key, see ``LosslessCodec``) before the output
                     is rounded to the input's dtype (a float16 sum beyond +-65504 is then +-inf, as
                     in an fp16 allreduce) -- for a payload that is the sum (or average) of valid payloads. With ``verify=True`` also for a
                     payload with one corrupted sketch or mass word (or a zeroed sketch): the decode
                     refuses it (e.g. SKETCH_CORRUPT) or lists every key the corruption moved beyond
                     rtol as INEXACT (``LosslessCodec``). With or without it, a corrupted
                     index word that changes the decoded support is INDEX_CORRUPT but with
                     probability below 2**-21.9 (the index checksum, ``LosslessCodec``).
                     When False the output must not be used, except under INEXACT (below); callers
                     fall back to a dense aggregation.
    reason           why ok is False (None when ok).
    status           the :class:`~lossless_hc.lhc.status.DecodeStatus`: OK exactly when ok, else the
                     first failure found (OVERLOADED when ranks were over capacity and nothing else
                     failed; ``overloaded_ranks`` says how many). INEXACT: every key was recovered
                     and the sketch is consistent, but some keys' error bounds (with verify, or
                     verification bounds) exceed rtol: those are ``inexact_keys``; every other coordinate of the output is
                     within rtol of the true sum (re-aggregate just those keys). SKETCH_CORRUPT: a cell left after peeling is
                     not zero within its bound (nothing usable).
    error_bounds     only with ``decode(..., error_bounds=True)`` and status OK or INEXACT: ``(keys, E)``,
                     the support keys (sorted int64) and each key's proven error bound (float64): for a
                     payload that is the sum (or average) of valid payloads, every coordinate v of key
                     k as the peel computed it (float64) has ``|v - t| <= E(k)`` for the true sum t, in
                     the payload's units (an average's under ``averaged``); a float32 output ``y``
                     adds its rounding (``|y - v| <= 2**-24 |v|``), a float16/bfloat16 one its own.
                     E(k) is the peel's bound (``LosslessCodec``; with ``verify``, verdicts also use the
                     verification bound). None otherwise, and for the dense layout.
    inexact_keys     under INEXACT, the keys (blocks) whose bound exceeds rtol: a sorted int64 CPU
                     tensor (key k covers coordinates ``k*block_size`` to
                     ``min((k+1)*block_size, numel) - 1`` of the flattened tensor); empty otherwise.
    contributors     ranks that contributed to the payload (from the header).
    candidates       keys the index could not rule out (union of supports + false positives).
    false_positives  candidates the exact count peeling proved absent on every rank (Bloom index).
    support          keys non-zero on at least one rank.
    peeled           support keys recovered by peeling the value sketch.
    overloaded_ranks ranks that had more non-zero keys than the codec's capacity.
    total_keys       sum over ranks of their non-zero key counts.
    index_kind       "bitmap", "bloom", "multilevel" or "dense".
    trace            only with ``decode(..., trace=True)``: (keys, cells), each key with the cell it
                     was read from; within one cell, keys appear in the order they were peeled. The
                     two keys of a solved pair (they share all three cells; see
                     ``sizing.sketch_table_for``) both list their first cell, after every key peeled
                     from those cells.
    """

    ok: bool
    reason: Optional[str]
    status: DecodeStatus = DecodeStatus.OK
    contributors: int = 0
    candidates: int = 0
    false_positives: int = 0
    support: int = 0
    peeled: int = 0
    overloaded_ranks: int = 0
    total_keys: int = 0
    index_kind: str = ""
    trace: Optional[tuple] = None
    error_bounds: Optional[tuple] = None
    inexact_keys: torch.Tensor = field(default_factory=_no_keys)

    @property
    def unresolved(self) -> int:
        return self.support - self.peeled


class LosslessCodec:
    r"""Lossless homomorphic compression of sparse tensors for SUM/AVERAGE aggregation.

    Every rank builds the codec with the same arguments. ``encode(x)`` maps a tensor of ``numel``
    elements with at most ``max_nnz`` non-zeros to a 1-D float32 payload of ``payload_numel``
    elements (identical on every rank); the element-wise sum of the ranks' payloads decodes to
    :math:`\sum_r x_r`.

    Algorithm (per rank, keys are blocks of ``block_size`` consecutive coordinates):

    1. Find the non-zero keys :math:`K_r` (a key is non-zero if any of its coordinates is).
    2. Index: add 1 to the counter(s) of every :math:`k \in K_r` (one counter per key for the
       ``bitmap`` index, three Bloom counters for ``bloom``; for ``multilevel`` a counter per node of
       keys and the nodes' child patterns in signed fine tables), packed as exact integer digits.
    3. Values: Count Sketch with three hashes and weights, :math:`S[h_j(k)] \mathrel{+}= w_j(k) x_k`
       for j = 0, 1, 2 (:math:`w_j = \pm 1`; :math:`\pm 1, \pm 2` in a small weighted table), a
       block-long vector per cell; the three cells of a key are distinct.

    Decoding the aggregate (any summation order):

    1. Enumerate candidate keys from the index; for ``bloom``, peel the integer counters exactly so
       that every candidate gets the exact number of ranks holding it (false positives get 0); for
       ``multilevel``, peel the fine tables level by level, exactly in integers, down to the keys.
    2. Peel the sketch over the exact support: a cell reached by one unresolved key holds
       :math:`w_j(k) x_k`; subtract it from the key's other two cells and repeat. Peeling is
       sequential in a fixed order, so the output is bitwise deterministic.

    Guarantees: when ``report.ok`` is True the output has exactly the aggregate's non-zero keys
    (keys that no rank touched are exact zeros) and every coordinate within ``rtol`` (relative) of
    the true sum. The decoder proves it key by key. A mass channel (one float per sketch cell, where
    key k adds :math:`|w_j(k)| \max_l |x_{k,l}|`; sums of non-negative terms do not cancel) gives
    each cell's absolute mass :math:`M(c)`, and along the peel a key read from cell :math:`c_k`
    gets the bound
    :math:`E(k) = \big((deg(c_k) + n + 2)\, 2^{-24} M(c_k) + \sum_j |w_j| E(j)\big) / |w_k|`
    over the keys j subtracted from :math:`c_k` before it (deg(c) the support keys hashed to c; the
    mass is inflated by its own relative rounding; ``tests/helpers.py: peel_error_bound`` asserts
    that the decoded values meet this bound). A key passes if every coordinate v has
    :math:`E(1 + rtol) + 2^{-24}|v| \le rtol\,|v|`; the others are reported as INEXACT with
    ``report.inexact_keys`` (values small beside their bound, which sums the masses of their
    cell-mates and the bounds of every key peeled before them through their cells; sums that cancel
    to ~0; and with blocks, coordinates far below their block's largest: the mass is per key). After peeling,
    every cell no key was read from must be 0 within its bound, and a cell must have positive mass
    exactly when it holds keys; otherwise SKETCH_CORRUPT (a corrupted or not-summed payload). ok is
    False, never a wrong answer, when a rank was over
    capacity, peeling could not finish, a rank's input held NaN/Inf (which would poison shared
    cells), a sketch cell overflowed float32, the ranks' configurations differ, or the payload is
    not a plain sum/average of ``world_size`` payloads.

    E(k) assumes the cells read before k are intact: it proves the contract for a payload that is
    the sum of valid payloads. ``verify=True`` also proves it for a payload with one corrupted
    word: a key must then pass with its verification bound :math:`F(k)` too (what the cells k was
    subtracted into prove about it after peeling, whatever happened before it: one corrupted word is
    upstream of k or not, so F or E holds; docs/DESIGN.md "Exactness"), and the keys of solved
    two-key stopping sets are always INEXACT (one check cannot verify two values). A cell counts
    for F(k) only if none of its other keys (its reader aside) shares a peel ancestor with k -- the
    keys a corrupted word upstream of k also reaches, whose errors could cancel k's there (the fuzzer
    found two such aggregates, seed 14) -- tested exactly for ancestries of up to 256 keys
    (csrc/lhc_ancestry.h). So one corrupted sketch or mass word is caught or harmless: the residual
    check refuses it, or the verification bound lists every key it could have moved beyond rtol. Not
    covered: corruptions of several words, which can mimic a valid payload. It costs the ancestries
    and a backward pass over the peel (a decode several times slower) and lists more keys INEXACT
    (docs/BENCHMARKS.md); it is off by default because the transports the plugins use (TCP, Gloo,
    NCCL) deliver the sum of what the ranks sent, checksummed.

    The index is checked on every decode by a summable checksum in the header: rank r sends
    :math:`c_f(r) = \sum_{k \in S_r} part_f(k) \bmod p_f` for two hashes of the key and the primes
    :math:`p_0 = 2039, p_1 = 2029`, and the decoder requires
    :math:`\sum_r c_f(r) \equiv \sum_k count(k)\, part_f(k) \pmod{p_f}` over the decoded support
    (count(k): ranks that sent k, as the index decodes it), else INDEX_CORRUPT. A support whose counts
    are wrong passes with probability :math:`1/(p_0 p_1) < 2^{-21.9}` over the seed
    (csrc/lhc_layout.h, "The index checksum").

    Args:
        numel: elements of the tensors to encode (any shape with this many elements); at most
            ``layout.MAX_KEYS`` (2^32 - 4096) keys of ``block_size`` (ValueError beyond).
        world_size: ranks whose payloads are aggregated (1..1024).
        max_nnz: non-zero coordinates one rank may send; with ``block_size`` b the capacity is
            ``ceil(max_nnz / b)`` non-zero blocks.
        block_size: coordinates hashed as one key (1 for unstructured sparsity; the row length for
            embedding gradients).
        seed: hash seed, identical on every rank.
        device: "cpu", or "cuda" / "cuda:N" (the kernels of ``csrc/cuda``, compiled into
            ``lossless_hc._C_cuda`` or compiled at run time through CuPy; the same payloads as the
            CPU backend, so CPU and GPU ranks interoperate). On CUDA everything runs on the current
            torch stream: encode never synchronises, decode synchronises once.
        index: "auto" (the cheapest payload, see :mod:`lossless_hc.lhc.cost_model`), "bitmap", "bloom",
            "multilevel" or "dense" (every kind on every device).
        num_threads: OpenMP threads of the CPU kernels (0: the OpenMP default).
        union_nnz: non-zero coordinates the *aggregate* may have (default ``world_size * max_nnz``);
            sizes the value sketch and the index. More than that in a decode is reported, not wrong.
        rtol: relative tolerance every decoded coordinate is proven to meet when ``report.ok``
            (default ``2**-10``; in [0, 1)); keys that cannot be proven are INEXACT.
        verify: also prove every key with the verification bound (above): the contract then holds
            for a payload with one corrupted sketch or mass word too (index words: the index
            checksum, above, with or without verify). Default False.

    ``rtol`` and ``verify`` act on the decode only, but they decide the verdict every rank acts on,
    so they must be equal on every rank: when they differ from the defaults they join the layout's
    fingerprint (``codec.layout.fingerprint``), so payloads of ranks configured differently decode
    as CONFIGURATION_MISMATCH.

    Input dtypes: float32; float16/bfloat16 are encoded exactly in float32 and the decoded sum is
    rounded back to the input dtype: the contract above holds before that rounding, and a float16 sum
    beyond +-65504 becomes +-inf (as ``sum.half()`` and an fp16 allreduce give it). float64 and
    integer tensors are rejected (float32 payloads would silently round them).

    Example::

        >>> codec = LosslessCodec(numel=1000, world_size=2, max_nnz=10)
        >>> xs = [torch.zeros(1000), torch.zeros(1000)]
        >>> xs[0][3], xs[1][3], xs[1][7] = 1.0, 2.0, -1.0
        >>> y, report = codec.decode(codec.encode(xs[0]) + codec.encode(xs[1]))
        >>> report.ok, y[3].item(), y[7].item()
        (True, 3.0, -1.0)
    """

    def __init__(self, numel: int, world_size: int, max_nnz: int, block_size: int = 1, seed: int = 0,
                 device="cpu", index: str = "auto", num_threads: int = 0, union_nnz: Optional[int] = None,
                 rtol: float = DEFAULT_RTOL, verify: bool = False):
        if not is_real(rtol) or not 0.0 <= rtol < 1.0:
            raise ValueError(f"rtol must be a number in [0, 1), got {rtol!r}")
        if not isinstance(verify, bool):
            raise TypeError(f"verify must be a bool, got {verify!r}")
        self.rtol, self.verify = float(rtol), verify
        self.device = as_device(device)
        # Every backend has every index kind, so the layout depends on the arguments alone: CPU and CUDA
        # ranks plan the same payload (also for "auto") and interoperate.
        layout = plan_layout(numel, world_size, max_nnz, block_size, seed, index, union_nnz)
        if (self.rtol, self.verify) != (DEFAULT_RTOL, False):
            # The decode options join the fingerprint: ranks that disagree on them see a mismatch.
            rtol_bits = struct.unpack("<Q", struct.pack("<d", self.rtol))[0]
            layout = replace(layout, fingerprint=options_fingerprint(layout.fingerprint, rtol_bits, int(verify)))
        self.layout: PayloadLayout = layout
        self._backend = backend_for(self.device)
        self.device = self._backend.require(self.device, "LosslessCodec")
        self.num_threads = num_threads
        self._native = self._backend.lhc_layout(self.layout, self.device)
        self._shape = (numel,)
        self._dtype = torch.float32

    # Pickled without the kernels' view of the layout (rebuilt from the layout on load).
    def __getstate__(self):
        return {k: v for k, v in self.__dict__.items() if k not in ("_native", "_backend")}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._backend = backend_for(self.device)
        self._native = self._backend.lhc_layout(self.layout, self.device)

    @property
    def num_threads(self) -> int:
        """OpenMP threads of the CPU kernels (0: the OpenMP default); checked when set, since the
        kernels take any int (a count in the tens of thousands crashes the process)."""
        return self._num_threads

    @num_threads.setter
    def num_threads(self, value: int) -> None:
        self._num_threads = check_num_threads(value)

    # -- sizes ---------------------------------------------------------------------------------
    @property
    def numel(self) -> int:
        return self.layout.numel

    @property
    def world_size(self) -> int:
        return self.layout.world_size

    @property
    def index_kind(self) -> str:
        return self.layout.index_kind

    @property
    def payload_numel(self) -> int:
        return self.layout.payload_numel

    @property
    def wire_bytes(self) -> int:
        """Bytes one rank sends for this tensor (the float32 payload)."""
        return self.layout.wire_bytes

    @property
    def dense_bytes(self) -> int:
        """Bytes of the same tensor sent uncompressed as float32."""
        return 4 * self.layout.numel

    @property
    def compression_ratio(self) -> float:
        """wire_bytes / dense_bytes (below 1 means smaller than dense)."""
        return self.wire_bytes / max(1, self.dense_bytes)

    def __repr__(self) -> str:
        L = self.layout
        return (f"LosslessCodec(numel={L.numel}, world_size={L.world_size}, capacity={L.capacity} keys, "
                f"block_size={L.block}, index={L.index_kind!r}, sketch_cells={L.sketch.cells}, "
                f"wire_bytes={self.wire_bytes} ({self.compression_ratio:.3f} of dense))")

    # -- encode --------------------------------------------------------------------------------
    def _check_input(self, x: torch.Tensor) -> torch.Tensor:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
        if x.layout != torch.strided:   # COO, CSR, CSC, BSR, BSC
            raise TypeError(f"x is a sparse tensor ({x.layout}); pass it dense (e.g. x.to_dense())")
        if x.numel() != self.layout.numel:
            raise ValueError(f"x has {x.numel()} elements, the codec was built for numel={self.layout.numel}")
        if x.dtype not in _ACCEPTED_DTYPES:
            raise TypeError(f"x has dtype {x.dtype}; LosslessCodec encodes float32, float16 and bfloat16 "
                            "(float64 and integers would be rounded by the float32 payload: cast explicitly)")
        if x.device != self.device:
            raise ValueError(f"x is on {x.device}, the codec on {self.device}")
        # resolve_neg: the kernels read memory, not torch's negative bit (x.conj().imag, torch._neg_view)
        return x.reshape(-1).to(torch.float32).contiguous().resolve_neg()

    def _buffer(self, out: Optional[torch.Tensor], numel: int) -> torch.Tensor:
        """``out`` checked (contiguous float32, ``numel`` elements, the codec's device) and viewed
        1-D, or a new buffer."""
        if out is None:
            return self._backend.empty(numel, self.device)
        return checked_out(out, numel, self.device)

    def encode(self, x: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Encode ``x`` (numel elements, any shape) into a 1-D float32 payload of ``payload_numel``
        elements: a new tensor, or ``out`` (contiguous float32, overwritten, sharing no memory with
        ``x``, else ValueError) to reuse a buffer.

        The shape and dtype of ``x`` are remembered as the defaults for ``decode``.
        """
        flat = self._check_input(x)
        self._shape, self._dtype = tuple(x.shape), x.dtype
        L = self.layout
        payload = self._buffer(out, L.payload_numel)
        check_disjoint(payload, flat, "out and x")
        if L.index_kind == "dense":
            counts = self._backend.dense_copy(flat, payload[HEADER_FIELDS:], self.num_threads)
            self._write_dense_header(payload, counts)
            return payload
        self._backend.lhc_encode(self._native, flat, payload, self.num_threads)
        return payload

    def encoded_keys(self, payload: torch.Tensor) -> Optional[int]:
        """The non-zero keys (blocks holding a value other than +-0.0; NaN and infinities count) that
        :meth:`encode` found in the input it wrote ``payload`` from (this rank's payload, not a SUM), read
        from its header: what a row scan of that input would count, without a second read of it. None for
        the ``dense`` index kind, whose header does not count them. (On CUDA, one small copy to the host.)"""
        if self.layout.index_kind == "dense":
            return None
        return _key_count(int(v) for v in payload[HDR_KEYS_LO:HDR_KEYS_HI + 1].tolist())

    def _write_dense_header(self, payload: torch.Tensor, counts: torch.Tensor) -> None:
        # Fills and a device-side copy only (``counts``: dense_copy's, on the payload's device): reading
        # the non-finite count back would synchronise a CUDA stream.
        L = self.layout
        mask = (1 << CHUNK_BITS) - 1
        payload[:HEADER_FIELDS].zero_()
        payload[HDR_CONTRIBUTORS].fill_(1.0)
        payload[HDR_FP_LO].fill_(float(L.fingerprint & mask))
        payload[HDR_FP_HI].fill_(float(L.fingerprint >> CHUNK_BITS))
        payload[HDR_NON_FINITE:HDR_NON_FINITE + 1].copy_(counts[1:] > 0)

    # -- decode --------------------------------------------------------------------------------
    def _read_header(self, fields: list, scale: float):
        """Header fields (``fields``: the payload's first HEADER_FIELDS values as floats) as exact
        integers (None where a field is not one), and whether every field is within what world_size
        ranks can write.

        A summed field must be an exact integer (float32 sums of integers below 2**22 are exact); an
        averaged field is within 1/2 of one after scaling back (see layout.INT_FIELD_BITS).
        """
        n = self.layout.world_size
        chunk_max = (1 << CHUNK_BITS) - 1
        per_rank_max = [1, chunk_max, chunk_max, chunk_max, chunk_max, chunk_max, 1, 1, 1,
                        *(p - 1 for p in INDEX_CHECK_PRIMES)]
        tolerance = 0.0 if scale == 1.0 else 0.5
        ints, in_range = [], True
        for v, hi in zip((float(f) * scale for f in fields), per_rank_max):
            r = round(v) if abs(v) < 2.0 ** 53 else None  # also None for NaN/Inf
            if r is None or abs(v - r) > tolerance:
                ints.append(None)
                in_range = False
                continue
            ints.append(int(r))
            in_range &= 0 <= r <= n * hi
        return ints, in_range

    def decode(self, payload: torch.Tensor, averaged: bool = False, shape=None, dtype=None,
               trace: bool = False, out: Optional[torch.Tensor] = None, error_bounds: bool = False):
        """Decode an aggregated payload; returns ``(y, report)``.

        Args:
            payload: element-wise SUM over ``world_size`` ranks of their ``encode`` outputs, or their
                AVERAGE if ``averaged=True`` (then ``y`` is the average).
            shape, dtype: of ``y``; default to those of the last ``encode`` call (else 1-D float32).
                A shape that does not hold ``numel`` elements is a ValueError, before decoding.
            trace: attach the peeling order to the report (diagnostics and tests).
            error_bounds: attach each support key's proven error bound to the report (see
                ``DecodeReport.error_bounds``).
            out: optional contiguous float32 tensor of ``numel`` elements on the codec's device to
                decode into (every element is overwritten; sharing no memory with ``payload``, else
                ValueError). Reusing one buffer across steps avoids the page faults of a fresh
                allocation; ``y`` is then a view of it when ``dtype`` is float32.

        ``y`` is the exact aggregate (within rtol) when ``report.ok``; under INEXACT it is that at
        every key outside ``report.inexact_keys``; otherwise it must not be used (it holds whatever
        was recovered, NaN if a rank's input was non-finite). ``dtype`` must be a floating dtype
        (an integer one would truncate the sum silently: TypeError).
        """
        L = self.layout
        for name, flag in (("averaged", averaged), ("trace", trace), ("error_bounds", error_bounds)):
            if not isinstance(flag, bool):   # averaged="no" would decode a sum as an average
                raise TypeError(f"decode's {name} must be a bool, got {flag!r}")
        if not isinstance(payload, torch.Tensor):
            raise TypeError(f"payload must be a torch.Tensor, got {type(payload).__name__}")
        if payload.dim() != 1 or payload.numel() != L.payload_numel:
            raise ValueError(f"payload must be 1-D with {L.payload_numel} elements (this codec's payload_numel), "
                             f"got shape {tuple(payload.shape)}")
        if payload.dtype != torch.float32:
            raise TypeError(f"payload must be float32, got {payload.dtype}")
        if payload.device != self.device:
            raise ValueError(f"payload is on {payload.device}, the codec on {self.device}")
        payload = payload.contiguous().resolve_neg()
        if shape is None:
            shape = self._shape
        elif isinstance(shape, int):
            shape = (shape,)
        elif isinstance(shape, (tuple, list, torch.Size)):
            shape = tuple(shape)
        else:
            raise ValueError(f"decode(shape={shape!r}): not a shape (an int, or a tuple, list or torch.Size of ints)")
        # Checked before decoding. Plain sizes (every decode of the training aggregators) by their product;
        # others (-1, bad entries) by torch's own reshape rule on a tensor without memory (~10x slower).
        if not (all(type(d) is int and d >= 0 for d in shape) and math.prod(shape) == L.numel):
            try:
                torch.empty(L.numel, device="meta").reshape(shape)
            except (RuntimeError, TypeError) as e:
                raise ValueError(f"decode(shape={shape}): not a shape of numel={L.numel} elements ({e})") from e
        dtype = dtype if dtype is not None else self._dtype
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise TypeError(f"decode(dtype={dtype}): the decoded sum is a float32 tensor (rounded to the input's "
                            "float16/bfloat16 where that was encoded); integer dtypes would truncate it silently: "
                            "decode to a float dtype and convert explicitly")
        n = L.world_size
        scale = float(n) if averaged else 1.0

        # Every path below writes all of out (NaN on failure paths, the kernels zero-fill first).
        out = self._buffer(out, L.numel)
        check_disjoint(out, payload, "out and payload")
        report = DecodeReport(ok=False, reason=None, index_kind=L.index_kind)

        def finish(status: DecodeStatus, reason: Optional[str] = None):
            report.status = status
            report.ok, report.reason = status == DecodeStatus.OK, (reason or message(status) or None)
            return out.reshape(shape).to(dtype), report

        def reject(status: DecodeStatus, reason: Optional[str] = None):
            out.fill_(float("nan"))
            return finish(status, reason)

        dense_nonzero = pending = None
        if L.index_kind == "dense":
            # The body copied into out with its non-zero keys and non-finite elements counted in one pass (a failure
            # below overwrites out with NaN), then the header and the counts in one transfer (one
            # synchronisation on CUDA).
            counts = self._backend.dense_copy(payload[HEADER_FIELDS:], out, self.num_threads, L.block)
            values = torch.cat([payload[:HEADER_FIELDS].to(torch.float64), counts.to(torch.float64)]).tolist()
            header_fields, dense_nonzero = values[:HEADER_FIELDS], int(values[HEADER_FIELDS])
            dense_non_finite = int(values[HEADER_FIELDS + 1])
        else:
            pending = self._backend.lhc_decode(self._native, payload, out, scale, n, self.num_threads, self.rtol,
                                               self.verify)
            header_fields = pending.header
        hdr, in_range = self._read_header(header_fields, scale)
        if hdr[HDR_CONTRIBUTORS] is None or hdr[HDR_CONTRIBUTORS] < 0:   # each rank writes 1: no sum is below 0
            return reject(DecodeStatus.HEADER_CORRUPT)
        report.contributors = hdr[HDR_CONTRIBUTORS]
        if hdr[HDR_CONTRIBUTORS] != n:
            hint = ""
            if not averaged and hdr[HDR_CONTRIBUTORS] == 1 and n > 1:
                hint = " (an averaged payload? pass averaged=True)"
            elif averaged and hdr[HDR_CONTRIBUTORS] == n * n and n > 1:
                hint = " (a summed payload? pass averaged=False)"
            return reject(DecodeStatus.WRONG_CONTRIBUTORS,
                          f"payload aggregates {hdr[HDR_CONTRIBUTORS]} contributions, expected world_size={n}{hint}")
        if not in_range:
            return reject(DecodeStatus.HEADER_CORRUPT)
        mask = (1 << CHUNK_BITS) - 1
        if hdr[HDR_FP_LO] != n * (L.fingerprint & mask) or hdr[HDR_FP_HI] != n * (L.fingerprint >> CHUNK_BITS):
            return reject(DecodeStatus.CONFIGURATION_MISMATCH)
        report.total_keys = _key_count(hdr[HDR_KEYS_LO:HDR_KEYS_HI + 1])
        report.overloaded_ranks = hdr[HDR_OVERLOADED]
        # Overload is the root cause of most other failures (peeling, saturation): name it first.
        overload = (f"overloaded: {report.overloaded_ranks} rank(s) had more than capacity={L.capacity} non-zero keys; "
                    "grow max_nnz") if report.overloaded_ranks else None

        def fail(status: DecodeStatus, reason: Optional[str] = None):
            reason = reason or message(status)
            return reject(status, f"{overload} ({reason})" if overload else reason)

        if hdr[HDR_NON_FINITE]:
            return fail(DecodeStatus.NON_FINITE_INPUT, f"non-finite input (NaN/Inf) on {hdr[HDR_NON_FINITE]} rank(s)")
        if hdr[HDR_SATURATED]:
            return fail(DecodeStatus.INDEX_SATURATED, f"index counter saturated on {hdr[HDR_SATURATED]} rank(s)")
        if report.total_keys > n * L.num_keys:
            return fail(DecodeStatus.KEY_COUNT_CORRUPT)

        if pending is None:
            if dense_non_finite:   # a NaN word, or finite inputs whose sum overflowed float32
                return fail(DecodeStatus.SKETCH_OVERFLOW,
                            f"{message(DecodeStatus.SKETCH_OVERFLOW)} ({dense_non_finite} dense value(s))")
            report.candidates = report.support = report.peeled = dense_nonzero
            return finish(DecodeStatus.OK)

        st, report.trace = pending.finish(report.total_keys, trace, bounds=error_bounds)
        report.candidates, report.false_positives = st.candidates, st.false_positives
        report.support, report.peeled = st.support_keys, st.peeled
        status, reason = DecodeStatus(st.status), None
        if overload:
            # The kernels may still have recovered every key of a truncated aggregate: never ok (and
            # not INEXACT either: the keys within rtol are not the aggregate's).
            reason = f"{overload} ({message(status) or f'recovered {st.peeled}/{st.support_keys} keys'})"
            status = status if status not in (DecodeStatus.OK, DecodeStatus.INEXACT) else DecodeStatus.OVERLOADED
        elif status == DecodeStatus.INEXACT:
            report.inexact_keys = pending.inexact_keys()
            reason = (f"{message(status)}: {report.inexact_keys.numel()} of {st.support_keys} keys "
                      f"(rtol={self.rtol:g})")
        if error_bounds and status in (DecodeStatus.OK, DecodeStatus.INEXACT):
            report.error_bounds = pending.error_bounds()
        return finish(status, reason)
