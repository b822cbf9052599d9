"""The CPU backend: the C++/OpenMP kernels of ``lossless_hc._C`` (``csrc/cpu``) behind the backend
interface (:mod:`lossless_hc.backends`). Only this module touches ``_C``.

Kernels see raw addresses and sizes (``data_ptr()``), so no extension depends on the torch C++ ABI;
the codecs validate every tensor (dtype, device, contiguity, size) before calling in.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from lossless_hc.lhc.layout import HEADER_FIELDS, DigitPacking, PayloadLayout, digit_packing, layout_words

try:
    from lossless_hc import _C
except ImportError as exc:  # pragma: no cover - exercised only on a broken install
    _C = None
    _IMPORT_ERROR = exc
else:
    _IMPORT_ERROR = None


def _require_module() -> None:
    if _C is None:
        raise ImportError(
            "lossless_hc._C (the C++ kernels) is not built; run `make build` or `pip install -e .` "
            f"({_IMPORT_ERROR})")


def decode_statuses() -> list:
    """``(name, code, message)`` of every decode status, from csrc/lhc_status.h."""
    _require_module()
    return list(_C.DECODE_STATUSES)


def _check_topk_input(x: torch.Tensor, k: int) -> None:
    if not isinstance(x, torch.Tensor) or x.dtype != torch.float32 or not x.is_contiguous():
        raise TypeError("topk_select takes a contiguous float32 tensor")
    if not isinstance(k, int) or isinstance(k, bool) or k < 0:
        raise ValueError(f"k must be an integer >= 0, got {k!r}")


def overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the memory of ``a`` and ``b`` (contiguous tensors) overlaps."""
    if a.device != b.device or a.numel() == 0 or b.numel() == 0:
        return False
    pa, pb = a.data_ptr(), b.data_ptr()
    return pa < pb + b.numel() * b.element_size() and pb < pa + a.numel() * a.element_size()


def check_disjoint(out: torch.Tensor, src: torch.Tensor, names: str) -> None:
    """Raise ValueError when the memory of ``out`` and ``src`` (contiguous tensors) overlaps: every
    backend's kernels read ``src`` while they write ``out``, so an overlap would give a silently wrong
    result (or, where torch notices it first, torch's own error)."""
    if overlaps(out, src):
        raise ValueError(f"{names} overlap in memory: the kernels read one while they write the other; "
                         "pass an out that shares no memory with the input")


def check_not_negative_view(t: torch.Tensor, name: str) -> None:
    """Raise ValueError when ``t`` carries torch's negative bit (``torch._neg_view``, ``z.conj().imag``): its
    elements read as the negation of its memory, which the kernels read or write through its address, so
    they would see, or leave, every value negated. Every backend and codec checks with this."""
    if t.is_neg():
        raise ValueError(f"{name} is a negative view (its values read as the negation of its memory, which the "
                         "kernels read or write): pass a tensor that holds its own values (t.resolve_neg())")


def check_topk_select(x: torch.Tensor, k: int, out: Optional[torch.Tensor]) -> int:
    """``topk_select``'s operands on any backend; returns the count ``min(k, numel)``. ``out``, when
    given, must be a contiguous int64 tensor of at least that many elements on ``x``'s device that holds
    its own values (the kernels write through its address). ``x`` may be a negative view: the kernels
    read its memory, whose magnitudes are its values'."""
    _check_topk_input(x, k)
    count = min(k, x.numel())
    if out is not None and (not isinstance(out, torch.Tensor) or out.dtype != torch.int64 or not out.is_contiguous()
                            or out.numel() < count or out.device != x.device):
        raise ValueError(f"out must be a contiguous int64 tensor of at least {count} elements on {x.device}")
    if out is not None:
        check_not_negative_view(out, "topk_select's out")
        check_disjoint(out, x, "topk_select's out and x")
    return count


def _check_feedback_input(x: torch.Tensor, residual: torch.Tensor, k: int) -> None:
    _check_topk_input(x, k)
    if (not isinstance(residual, torch.Tensor) or residual.dtype != torch.float32 or not residual.is_contiguous()
            or residual.numel() != x.numel() or residual.device != x.device):
        raise TypeError("topk_feedback takes a contiguous float32 residual of the input's numel, on its device")
    check_disjoint(residual, x, "topk_feedback's residual and x")
    check_not_negative_view(residual, "topk_feedback's residual")


def check_dense_copy(src: torch.Tensor, dst: Optional[torch.Tensor], block: int = 1) -> None:
    """``dense_copy``'s operands on any backend: contiguous float32 tensors of the same numel on one
    device (the kernels read and write through their addresses), not overlapping, ``dst`` holding its own
    values (a negative-view ``src`` is the caller's to resolve: counting alone reads it exactly); ``block``
    an int >= 1."""
    if isinstance(block, bool) or not isinstance(block, int) or block < 1:
        raise ValueError(f"dense_copy's block must be an int >= 1, got {block!r}")
    for name, t in (("src", src), ("dst", dst)):
        if t is not None and (not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or not t.is_contiguous()):
            raise TypeError(f"dense_copy's {name} must be a contiguous float32 tensor")
    if dst is not None and (dst.numel() != src.numel() or dst.device != src.device):
        raise ValueError(f"dense_copy's dst must hold {src.numel()} elements on {src.device}, got {dst.numel()} on "
                         f"{dst.device}")
    if dst is not None:
        check_disjoint(dst, src, "dense_copy's dst and src")
        check_not_negative_view(dst, "dense_copy's dst")


def check_interleave(flat: torch.Tensor, nb: int, block: int, blocks: torch.Tensor) -> None:
    """The operands of ``thc_interleave``/``thc_deinterleave`` on any backend: ``flat`` (the tensor's
    coordinates) and ``blocks`` (``nb`` blocks of ``block``) contiguous float32 on one device, with
    ``nb * block >= flat.numel()``."""
    for name, t in (("flat", flat), ("blocks", blocks)):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or not t.is_contiguous():
            raise TypeError(f"the {name} operand of the THC interleave must be a contiguous float32 tensor")
    if flat.device != blocks.device:
        raise ValueError(f"the THC interleave's operands are on {flat.device} and {blocks.device}")
    if not (isinstance(nb, int) and isinstance(block, int) and nb >= 1 and block >= 1):
        raise ValueError(f"nb and block must be integers >= 1, got {nb!r} and {block!r}")
    if blocks.numel() != nb * block or flat.numel() > nb * block:
        raise ValueError(f"the THC interleave of {flat.numel()} coordinates into {nb} blocks of {block} needs "
                         f"nb * block >= numel and a blocks operand of nb * block elements, got {blocks.numel()}")
    check_disjoint(blocks, flat, "the THC interleave's operands")


def check_bitmap_rows(keys: int, present: Optional[torch.Tensor], index: Optional[torch.Tensor]) -> torch.Tensor:
    """``bitmap_pack``'s rows on any backend, as the kernels read them: ``present``, one bool per row, flat and
    contiguous; else ``index``, integer rows (a bool mask, float or uint8 rows would be taken for other rows),
    as int64 holding its values (resolved from a negative view)."""
    if present is not None:
        if not isinstance(present, torch.Tensor) or present.dtype != torch.bool or present.numel() != keys:
            raise ValueError(f"bitmap_pack: present must be a bool per row ({keys}), got "
                             f"{getattr(present, 'dtype', type(present).__name__)} of "
                             f"{getattr(present, 'numel', lambda: '?')()}")
        return present.reshape(-1).contiguous()
    if not isinstance(index, torch.Tensor) or index.dtype.is_floating_point or index.dtype.is_complex \
            or index.dtype in (torch.bool, torch.uint8):
        raise ValueError(f"bitmap_pack: index must be a tensor of integer rows, got "
                         f"{getattr(index, 'dtype', type(index).__name__)}")
    return index.reshape(-1).to(torch.int64).contiguous().resolve_neg()


def thc_cpu_isa(request: str = "") -> str:
    """The compiled copy of THC's CPU kernels in use ("x86-64-v4", "x86-64-v3" or "portable"; the same
    bits from each); ``request`` switches to another first ("default": the best this CPU runs). The
    selection also governs the LHC value peel's AVX-512 step (used only under "x86-64-v4", and only
    where :func:`lhc_peel_batch` is on)."""
    _require_module()
    return _C.thc_cpu_isa(request)


def lhc_peel_batch(request: str = "") -> bool:
    """Whether the LHC value peel resolves eight keys of a layer at once in AVX-512 lanes (the same
    bits as key by key; it runs only while :func:`thc_cpu_isa` is "x86-64-v4"). ``request`` sets it
    first: "on", "off" or "default" (``LHC_PEEL_BATCH`` if set, else on unless the CPU is AMD's, whose
    gathers and scatters made it the slower step at large tables); anything else is a ValueError."""
    _require_module()
    return _C.lhc_peel_batch(request)


def release_decoder_memory() -> None:
    """Free the working memory the LHC CPU decoder keeps between decodes (its support buckets, key
    values, the multilevel index's levels, its peeling tables and lists, sized for the largest tensor or
    sketch group decoded: at 2^26 coordinates, 1% dense on 8 ranks, ~45 MB on the calling thread and
    ~9 MB per peeling thread). It frees what the calling thread kept and what its OpenMP pool's threads
    kept; another Python thread's decodes keep theirs until that thread calls it. The next decode allocates afresh, with the same bits.
    For a process done with large decodes; a training loop that decodes every step gains nothing."""
    _require_module()
    _C.release_decoder_memory()


def thc_cpu_isas() -> list:
    """The copies of THC's CPU kernels this CPU runs, best first."""
    _require_module()
    return list(_C.thc_cpu_isas())


def thc_sign_stream(seed: int, step: int) -> int:
    """THC's shared rotation stream of ``step`` (csrc/thc_math.h): the same on every device."""
    return _C.thc_sign_stream(seed, step)


def thc_round_stream(seed: int, rank: int, step: int) -> int:
    """THC's per-rank rounding stream of ``step`` (csrc/thc_math.h)."""
    return _C.thc_round_stream(seed, rank, step)


def _addr(t: Optional[torch.Tensor]) -> int:
    return t.data_ptr() if t is not None else 0


class PendingDecode:
    """A CPU decode: ``header`` (the payload's header fields as floats) is read at once; ``finish``
    runs the kernels with the key total the codec read from the validated header."""

    def __init__(self, native, payload: torch.Tensor, out: torch.Tensor, scale: float, world_size: int,
                 num_threads: int, rtol: float, verify: bool):
        self.native, self.payload, self.out = native, payload, out
        self.scale, self.world_size, self.num_threads = scale, world_size, num_threads
        self.rtol, self.verify = rtol, verify
        self.header = payload[:HEADER_FIELDS].double().tolist()
        self._stats = None

    def finish(self, total_keys: int, trace: bool = False, bounds: bool = False):
        """Run the kernels: ``(stats, trace)`` with stats as ``_C.DecodeStats`` (status from
        csrc/lhc_status.h, candidates, false_positives, support_keys, peeled) and trace the
        ``(keys, cells)`` of the peeled keys in peeling order, or None. ``bounds``: also keep the keys'
        error bounds for ``error_bounds``."""
        L = self.native.layout
        tk = tc = None
        if trace:
            tk = torch.full((L.num_keys,), -1, dtype=torch.int64)
            tc = torch.full((L.num_keys,), -1, dtype=torch.int64)
        bk = bv = None
        if bounds:
            # The support of a valid index holds at most total_keys keys (each counted by a rank).
            cap = max(1, min(int(total_keys), L.num_keys))
            bk = torch.empty(cap, dtype=torch.int64)
            bv = torch.empty(cap, dtype=torch.float64)
        st = _C.decode(self.native.words_ptr, float(self.scale), int(total_keys), int(self.world_size),
                       self.payload.data_ptr(), self.out.data_ptr(), _addr(tk), _addr(tc), self.num_threads,
                       float(self.rtol), bool(self.verify), _addr(bk), _addr(bv), bk.numel() if bounds else 0)
        self._stats, self._bounds = st, (bk, bv)
        if not trace:
            return st, None
        done = tk >= 0      # groups fill their own slices; keys a failed group never peeled stay -1
        return st, (tk[done], tc[done])

    def error_bounds(self):
        """After ``finish(..., bounds=True)`` of a decode that recovered every key: ``(keys, E)``, the
        support keys (sorted int64) and each one's error bound (float64), CPU tensors."""
        keys, bounds = self._bounds
        n = self._stats.support_keys
        if keys is None or n > keys.numel():
            raise RuntimeError("error_bounds() needs finish(..., bounds=True) of a valid payload")
        order = torch.argsort(keys[:n])
        return keys[:n][order], bounds[:n][order]

    def inexact_keys(self) -> torch.Tensor:
        """After ``finish``: the keys whose error bound exceeds rtol (sorted int64, CPU)."""
        raw = self._stats.inexact_keys_bytes if self._stats is not None else b""
        if not raw:
            return torch.zeros(0, dtype=torch.int64)
        return torch.frombuffer(bytearray(raw), dtype=torch.int64)


class CpuLhcLayout:
    """A LosslessCodec layout on the CPU: the PayloadLayout and its layout words (the layout ABI,
    :func:`lossless_hc.lhc.layout.layout_words`) in a CPU int64 tensor the kernels read."""

    def __init__(self, layout: PayloadLayout):
        self.layout = layout
        self.words = torch.tensor(layout_words(layout), dtype=torch.int64)

    @property
    def words_ptr(self) -> int:
        return self.words.data_ptr()


class CpuThcLayout:
    """A THCCodec layout on the CPU: the THCLayout, its C++ mirror (read from the layout words, as the CUDA
    kernels read them) and the rounding table."""

    def __init__(self, layout, lo: torch.Tensor, width: torch.Tensor, inv_width: torch.Tensor):
        self.layout = layout
        self.lo, self.width, self.inv_width = lo, width, inv_width
        words = torch.tensor(layout.layout_words(), dtype=torch.int64)
        self.c = _C.thc_layout_from_words(words.data_ptr())


def _check_rows(x: torch.Tensor, row: int) -> int:
    """``nonzero_rows``'s argument check (every backend's); returns the number of rows."""
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.element_size() not in (2, 4, 8) \
            or not x.is_contiguous():
        raise TypeError("nonzero_rows takes a contiguous tensor of 2-, 4- or 8-byte floats")
    if isinstance(row, bool) or not isinstance(row, int) or row < 1 or x.numel() % row:
        raise ValueError(f"row must be an integer >= 1 dividing x.numel() = {x.numel()}, got {row!r}")
    return x.numel() // row


def check_row_slots(index: torch.Tensor, k: int, table: Optional[torch.Tensor], values: Optional[torch.Tensor]) -> tuple:
    """``row_slots``' argument check (every backend's): ``(index as int64, table or values as 2-D, row)``."""
    if (table is None) == (values is None):
        raise ValueError("row_slots takes the rows from a table or from values, one of the two")
    if not isinstance(index, torch.Tensor) or index.dim() != 1 or index.dtype.is_floating_point \
            or index.dtype.is_complex or index.dtype in (torch.bool, torch.uint8):
        raise ValueError(f"row_slots: index must be a 1-D tensor of integer rows, got "
                         f"{getattr(index, 'dtype', type(index).__name__)} {tuple(getattr(index, 'shape', ()))}")
    src = table if table is not None else values
    if not isinstance(src, torch.Tensor) or src.dim() != 2 or not src.is_floating_point() \
            or (values is not None and src.shape[0] != index.numel()):
        raise ValueError(f"row_slots: {'table' if table is not None else 'values'} must be a 2-D float tensor"
                         f"{'' if table is not None else f' of {index.numel()} rows'}, got "
                         f"{getattr(src, 'dtype', type(src).__name__)} {tuple(getattr(src, 'shape', ()))}")
    if isinstance(k, bool) or not isinstance(k, int) or k < index.numel():
        raise ValueError(f"row_slots: k must be an int >= the {index.numel()} rows sent, got {k!r}")
    return index.to(torch.int64).contiguous().resolve_neg(), src, src.shape[1]


def check_bitmap_words(words: torch.Tensor, keys: int, world_size: int) -> DigitPacking:
    """``bitmap_rows``' argument check (every backend's); returns the packing."""
    pk = digit_packing(world_size, keys)
    if not isinstance(words, torch.Tensor) or words.dtype != torch.float32 or words.dim() != 1 \
            or words.numel() != pk.words:
        raise ValueError(f"bitmap_rows takes the {pk.words} float32 words of a counting bitmap of {keys} rows "
                         f"from {world_size} ranks, got {getattr(words, 'dtype', type(words))} of "
                         f"{getattr(words, 'numel', lambda: '?')()} elements")
    return pk


class CpuBackend:
    """The backend interface on the CPU (see :mod:`lossless_hc.backends` for the contract)."""

    name = "cpu"

    def require(self, device: torch.device, user: str) -> torch.device:
        _require_module()
        return device

    def empty(self, numel: int, device: torch.device, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """A new buffer (float32 unless ``dtype``), its memory advised to be backed by transparent huge
        pages before anything touches it: writing a fresh buffer of hundreds of MiB then takes one page
        fault per 2 MiB instead of one per 4 KiB, which is most of the cost of that first write."""
        buf = torch.empty(numel, dtype=dtype, device=device)
        if numel:
            _C.advise_huge_pages(buf.data_ptr(), buf.element_size() * numel)
        return buf

    @staticmethod
    def _row_scan(x: torch.Tensor, row: int, num_threads: int) -> tuple:
        """``(present, count)``: the row scan's flags and how many are set (csrc/cpu/rows.cpp)."""
        rows = _check_rows(x, row)
        present = torch.empty(rows, dtype=torch.bool)
        return present, _C.nonzero_rows(x.data_ptr(), rows, row, x.element_size(), present.data_ptr(), num_threads)

    def nonzero_rows(self, x: torch.Tensor, row: int, num_threads: int = 0) -> torch.Tensor:
        """Whether each row of ``x`` (``(x.numel() // row, row)``) holds an element that is not +-0.0 (bool;
        NaN and infinities count): one read of ``x`` (csrc/cpu/rows.cpp)."""
        return self._row_scan(x, row, num_threads)[0]

    def nonzero_row_index(self, x: torch.Tensor, row: int, num_threads: int = 0) -> tuple:
        """``(present, index)``: :meth:`nonzero_rows` and the rows it found, sorted int64 (``torch.nonzero``
        of ``present``): the scan counts them as it goes, and one pass over the flags lists them
        (csrc/cpu/rows.cpp)."""
        present, count = self._row_scan(x, row, num_threads)
        index = torch.empty(count, dtype=torch.int64)
        if count:
            _C.present_row_index(present.data_ptr(), present.numel(), index.data_ptr())
        return present, index

    def bitmap_pack(self, keys: int, world_size: int, present: Optional[torch.Tensor] = None,
                    index: Optional[torch.Tensor] = None, num_threads: int = 0) -> torch.Tensor:
        """A rank's counting bitmap of ``keys`` rows, from ``present`` (a bool per row) or ``index`` (its
        rows, int64): the float32 words of ``digit_packing(world_size, keys)``, digit 1 at a row it holds
        (csrc/cpu/bitmap.cpp)."""
        pk = digit_packing(world_size, keys)
        words = torch.empty(pk.words, dtype=torch.float32)
        rows = check_bitmap_rows(keys, present, index)
        if present is not None:
            _C.bitmap_pack(keys, pk.base, pk.per_word, rows.data_ptr(), 0, 0, words.data_ptr(), num_threads)
        else:
            try:
                _C.bitmap_pack(keys, pk.base, pk.per_word, 0, rows.data_ptr(), rows.numel(), words.data_ptr())
            except IndexError as exc:   # pybind11 maps std::out_of_range to IndexError
                raise ValueError(str(exc)) from None
        return words

    def bitmap_rows(self, words: torch.Tensor, keys: int, world_size: int, scale: float = 1.0,
                    num_threads: int = 0) -> Optional[torch.Tensor]:
        """The rows (sorted int64) with a non-zero digit in a sum (``scale`` 1) or average (``scale`` n)
        of counting bitmaps; None where a word is not one such a sum can hold (csrc/cpu/bitmap.cpp)."""
        pk = check_bitmap_words(words, keys, world_size)
        words = words.contiguous().resolve_neg()
        masks = torch.empty(pk.words, dtype=torch.int32)
        count = _C.bitmap_masks(keys, pk.base, pk.per_word, words.data_ptr(), float(scale), masks.data_ptr(),
                                num_threads)
        if count < 0:
            return None
        rows = torch.empty(count, dtype=torch.int64)
        if count:
            _C.bitmap_mask_rows(keys, pk.base, pk.per_word, masks.data_ptr(), rows.data_ptr(), num_threads)
        return rows

    def dense_copy(self, src: torch.Tensor, dst: Optional[torch.Tensor], num_threads: int = 0,
                   block: int = 1) -> torch.Tensor:
        """``dst.copy_(src)`` (contiguous float32, the same numel; ``dst`` None: counting only) and
        ``[keys of src holding an element that is not +-0.0, elements that are not finite]`` as an int64
        tensor, a key being ``block`` consecutive elements (the last one partial): one read of ``src``
        (csrc/cpu/rows.cpp)."""
        check_dense_copy(src, dst, block)
        if dst is not None:
            src = src.resolve_neg()   # the copy reads values (the counts alone read zeros and non-finites: exact)
        counts = torch.empty(2, dtype=torch.int64)
        _C.dense_copy_count(src.data_ptr(), _addr(dst), src.numel(), block, counts.data_ptr(), num_threads)
        return counts

    def row_slots(self, index: torch.Tensor, k: int, table: Optional[torch.Tensor] = None,
                  values: Optional[torch.Tensor] = None) -> torch.Tensor:
        """A rank's ``k`` allgather slots, flat float32 ``(k, 1 + row)``: slot ``i < m`` (``m = len(index)``)
        the int32 row ``index[i]`` in the first word's bits, then that row's values in float32 -- row
        ``index[i]`` of ``table`` (``(rows, row)``) or row ``i`` of ``values`` (``(m, row)``); slots ``m`` to
        ``k - 1`` the bits of -1, then zeros. One pass (csrc/cpu/rows.cpp); ``m > k``, or a row outside
        ``[0, 2^31)`` or the table, is a ValueError."""
        index, src, row = check_row_slots(index, k, table, values)
        gather = table is not None
        if src.dtype != torch.float32:   # the rows sent, converted (a half-precision table's)
            if gather:
                try:
                    src = src.index_select(0, index)
                except (IndexError, RuntimeError) as exc:
                    raise ValueError(f"row_slots: a row outside the table's {src.shape[0]}: {exc}") from None
            src, gather = src.to(torch.float32), False
        src = src.contiguous().resolve_neg()
        slots = torch.empty(k * (1 + row), dtype=torch.float32)
        _C.pack_row_slots(src.data_ptr(), src.shape[0], gather, index.data_ptr(), index.numel(), row, k,
                          slots.data_ptr())
        return slots

    def sum_row_slots(self, slots: torch.Tensor, out: torch.Tensor, stale_rows: Optional[torch.Tensor] = None,
                      divisor: Optional[int] = None, count: bool = True) -> Optional[int]:
        """The allgather strategy's gathered slots (``(n, K, 1 + row)`` float32: an int32 row index in the first
        word's bits, -1 unused, a rank's used slots first; the row's values) added into ``out`` (``(keys,
        row)`` float32, contiguous) rank by rank from rank 0, after its ``stale_rows`` (int64) are set to
        +0.0; with ``count``, returns how many rows some rank sent and divides just those by ``divisor``
        (an int > 1, else none), else returns None. A row index outside ``[0, keys)`` is a ValueError,
        raised before anything is written into ``out`` (csrc/cpu/rows.cpp)."""
        if (slots.dim() != 3 or slots.dtype != torch.float32 or out.dim() != 2 or out.dtype != torch.float32
                or not out.is_contiguous() or slots.shape[2] != out.shape[1] + 1):
            raise ValueError(f"sum_row_slots takes float32 slots (n, K, 1 + row) and a contiguous float32 out (keys, "
                             f"row), got {slots.dtype} {tuple(slots.shape)} and {out.dtype} {tuple(out.shape)}")
        n, per_rank, _ = slots.shape
        keys, row = out.shape
        slots = slots.contiguous()
        stale = None if stale_rows is None else stale_rows.to(torch.int64).contiguous()
        try:
            rows = _C.sum_row_slots(slots.data_ptr(), n, per_rank, row, out.data_ptr(), keys, _addr(stale),
                                    0 if stale is None else stale.numel(), divisor or 1, count)
        except ValueError as exc:
            raise ValueError(f"{exc} (keys = {keys})") from None
        return rows if count else None

    # -- LHC -------------------------------------------------------------------------------------
    def lhc_layout(self, layout: PayloadLayout, device: torch.device) -> CpuLhcLayout:
        return CpuLhcLayout(layout)

    def lhc_encode(self, native: CpuLhcLayout, x: torch.Tensor, payload: torch.Tensor, num_threads: int = 0) -> None:
        _C.encode(native.words_ptr, x.data_ptr(), payload.data_ptr(), num_threads)

    def lhc_decode(self, native: CpuLhcLayout, payload: torch.Tensor, out: torch.Tensor, scale: float,
                   world_size: int, num_threads: int = 0, rtol: float = 0.0,
                   verify: bool = False) -> PendingDecode:
        return PendingDecode(native, payload, out, scale, world_size, num_threads, rtol, verify)

    # -- top-k -----------------------------------------------------------------------------------
    def topk_select(self, x: torch.Tensor, k: int, out: Optional[torch.Tensor] = None,
                    num_threads: int = 0) -> torch.Tensor:
        """Indices (int64, ascending) of the ``min(k, numel)`` coordinates of ``x`` (contiguous float32)
        largest in magnitude, ties to the lower index (NaN counts as larger than every number): exactly
        the first ``min(k, numel)`` of a stable sort by ``|x|`` descending, on every backend and thread
        count (csrc/cpu/topk_cpu.h). O(numel): a sampled threshold, one filtering pass, and an exact
        fallback when the sample misses. ``out`` (int64, at least that many elements) is reused when given."""
        count = check_topk_select(x, k, out)
        if out is None:
            out = torch.empty(count, dtype=torch.int64)
        st = _C.topk_select(x.data_ptr(), x.numel(), count, out.data_ptr(), num_threads)
        assert st.count == count, (st.count, count)   # exact by construction (topk_cpu.h)
        return out[:count]

    def topk_feedback(self, x: torch.Tensor, residual: torch.Tensor, k: int, num_threads: int = 0) -> tuple:
        """Top-k with error feedback in one pass (csrc/cpu/topk_cpu.h ``topk_feedback``): with
        ``a = x + residual`` (contiguous float32, the same numel), returns ``(indices, values)`` -- the
        ``topk_select`` of ``a`` (exactly ``min(k, numel)``, ascending) and ``a`` there -- and leaves
        ``residual = a`` with those coordinates zeroed (in place), so ``x + residual_before`` equals
        ``residual_after`` plus the selection scattered back, coordinate by coordinate."""
        _check_feedback_input(x, residual, k)
        x = x.resolve_neg()   # read only
        count = min(int(k), x.numel())
        idx = torch.empty(count, dtype=torch.int64)
        values = torch.empty(count, dtype=torch.float32)
        st = _C.topk_feedback(x.data_ptr(), residual.data_ptr(), x.numel(), count, idx.data_ptr(), values.data_ptr(),
                              num_threads)
        assert st.count == count, (st.count, count)   # exact by construction (topk_cpu.h)
        return idx, values

    # -- THC -------------------------------------------------------------------------------------
    def thc_layout(self, layout, device: torch.device, lo, width, inv_width) -> CpuThcLayout:
        return CpuThcLayout(layout, lo, width, inv_width)

    def thc_encode(self, native: CpuThcLayout, quantize: bool, scale: float, threshold: float, dequant_a: float,
                   dequant_b: float, sign_stream: int, round_stream: int, x: torch.Tensor, e, word_kind: int,
                   payload: torch.Tensor, words_offset: int, norm_slot: int, mirror_slot: int, non_finite_field: int,
                   checksum_field: int, check: tuple, num_threads: int = 0, interleave_nb: int = 0) -> None:
        """Encode into ``payload``: the level words, the norm slot ``norm_slot`` and its negation in
        ``mirror_slot`` (float64 bits for an int64 payload), and the words' checksum (``check`` =
        (P, c0, k), csrc/thc_math.h) in ``checksum_field``; or, for a non-finite input, the flag
        ``non_finite_field`` with everything after it zeroed (checksum included). ``interleave_nb`` > 0:
        the input is ``thc_interleave(x, interleave_nb, block)``, read from x in place."""
        prime, c0, k = check
        if interleave_nb and e is not None and overlaps(x, e):
            # The kernel reads each block's coordinates from all of x while it writes that block's
            # error memory: x in e's memory (the codec's own ``error``, or a view of it) is read from
            # a copy, as the CUDA backend reads every interleaved x.
            x = x.clone()
        st = _C.thc_encode(native.c, bool(quantize), native.lo.data_ptr(), native.width.data_ptr(),
                           native.inv_width.data_ptr(), float(scale), float(threshold), float(dequant_a),
                           float(dequant_b), sign_stream, round_stream, x.data_ptr(), _addr(e), int(word_kind),
                           payload[words_offset:].data_ptr(), prime, c0, k, num_threads, x.numel(), int(interleave_nb))
        if st.non_finite:
            # x held NaN/Inf, or x + e overflowed float32 (either way e was reset to 0): send only the
            # header; every rank's decode sees the flag.
            payload[non_finite_field + 1:] = 0
            payload[non_finite_field] = 1
            return
        payload[checksum_field] = st.checksum
        norm = math.sqrt(st.sum_squares)
        slots = payload if payload.dtype == torch.float64 else payload.view(torch.float64)
        # int64 payload: the float64 bits; the other ranks add zeros, so the SUM keeps them exactly.
        slots[norm_slot] = norm
        slots[mirror_slot] = -norm

    def thc_decode(self, native: CpuThcLayout, sign_stream: int, word_kind: int, words: torch.Tensor,
                   multiplier: float, a: float, b: float, out: torch.Tensor, check: tuple,
                   num_threads: int = 0, interleave_nb: int = 0) -> tuple:
        """``out = RHT^-1(digit * a + b)`` of the aggregated words (``interleave_nb`` > 0: its
        ``thc_deinterleave``, written in place); returns ``(invalid words, checksum of the words mod P)``."""
        prime, c0, k = check
        st = _C.thc_decode(native.c, sign_stream, int(word_kind), words.data_ptr(), float(multiplier), float(a),
                           float(b), out.data_ptr(), prime, c0, k, num_threads, out.numel(), int(interleave_nb))
        return st.bad_words, st.checksum

    def thc_interleave(self, x: torch.Tensor, nb: int, block: int, out: torch.Tensor, num_threads: int = 0) -> None:
        """``out[j * block + r] = x[r * nb + j]``, zero past ``x``'s end (``check_interleave``)."""
        check_interleave(x, nb, block, out)
        check_not_negative_view(out, "thc_interleave's out")
        x = x.resolve_neg()   # read only
        _C.thc_interleave(x.data_ptr(), x.numel(), nb, block, out.data_ptr(), num_threads)

    def thc_deinterleave(self, y: torch.Tensor, nb: int, block: int, out: torch.Tensor,
                         num_threads: int = 0) -> None:
        """``out[i] = y[(i % nb) * block + i // nb]``: the inverse of :meth:`thc_interleave`."""
        check_interleave(out, nb, block, y)
        check_not_negative_view(out, "thc_deinterleave's out")
        y = y.resolve_neg()   # read only
        _C.thc_deinterleave(y.data_ptr(), out.numel(), nb, block, out.data_ptr(), num_threads)

    # THC's stages alone (the tests check each against the reference through these).
    def thc_rht_forward(self, native: CpuThcLayout, sign_stream: int, x: torch.Tensor, e, y: torch.Tensor,
                        num_threads: int = 0):
        return _C.thc_rht_forward(native.c, sign_stream, x.data_ptr(), _addr(e), y.data_ptr(), num_threads)

    def thc_rht_inverse(self, native: CpuThcLayout, sign_stream: int, y: torch.Tensor, out: torch.Tensor, plus_a,
                        plus_b, num_threads: int = 0) -> None:
        _C.thc_rht_inverse(native.c, sign_stream, y.data_ptr(), out.data_ptr(), _addr(plus_a), _addr(plus_b),
                           num_threads)

    def thc_pack_levels(self, native: CpuThcLayout, levels: torch.Tensor, word_kind: int,
                        words: torch.Tensor) -> None:
        _C.thc_pack_levels(native.c, levels.data_ptr(), int(word_kind), words.data_ptr())

    def thc_unpack_levels(self, native: CpuThcLayout, word_kind: int, words: torch.Tensor, multiplier: float,
                          sums: torch.Tensor) -> int:
        return _C.thc_unpack_levels(native.c, int(word_kind), words.data_ptr(), float(multiplier), sums.data_ptr())


CPU = CpuBackend()
