"""Backend dispatch: hands a validated layout and contiguous float32 tensors to the kernels of the
codec's device.

* CPU: ``lossless_hc._C`` (C++/OpenMP). Only this module touches it.
* CUDA: ``lossless_hc._cuda``, which runs the kernels of ``csrc/cuda/`` either from the compiled
  module ``lossless_hc._C_cuda`` or, where that is absent, compiled at run time through CuPy.

Kernels see raw addresses and sizes (``data_ptr()``), so no extension depends on the torch C++ ABI.
"""
from __future__ import annotations

import torch

from .layout import INDEX_KIND_CODE, PayloadLayout

try:
    from . import _C
except ImportError as exc:  # pragma: no cover - exercised only on a broken install
    _C = None
    _IMPORT_ERROR = exc
else:
    _IMPORT_ERROR = None


def require_backend(device: torch.device) -> None:
    """Raise a clear error unless kernels for ``device`` can run here."""
    if device.type == "cuda":
        from . import _cuda
        _cuda.require(device)
        return
    if device.type != "cpu":
        raise ValueError(f"unsupported device {device}; expected 'cpu' or 'cuda'")
    if _C is None:
        raise ImportError(
            "lossless_hc._C (the C++ kernels) is not built; run `make build` or `pip install -e .` "
            f"({_IMPORT_ERROR})")


def _table(src) -> "_C.SegmentedTable":
    t = _C.SegmentedTable()
    t.seg_len, t.seg_count, t.stream = src.seg_len, src.seg_count, src.stream
    t.weighted = int(src.weighted)
    return t


def native_layout(layout: PayloadLayout, device: torch.device = torch.device("cpu")):
    """The kernels' mirror of ``layout`` on ``device`` (built once per codec): a ``_C.CodecLayout``
    for the CPU, a ``_cuda.CudaLayout`` (layout words in device memory) for CUDA."""
    if device.type == "cuda":
        from . import _cuda
        return _cuda.CudaLayout(layout, device)
    c = _C.CodecLayout()
    c.numel, c.num_keys, c.block = layout.numel, layout.num_keys, layout.block
    c.index_kind = INDEX_KIND_CODE[layout.index_kind]
    c.sketch = _table(layout.sketch)
    if layout.bloom is not None:
        c.bloom = _table(layout.bloom)
    else:
        empty = _C.SegmentedTable()
        empty.seg_len, empty.seg_count, empty.stream = 1, 3, 0
        c.bloom = empty
    idx = _C.DigitPacking()
    idx.base, idx.per_word, idx.digits = layout.index.base, layout.index.per_word, layout.index.digits
    c.index = idx
    c.digit_cap = layout.digit_cap
    c.capacity = layout.capacity
    c.fingerprint = layout.fingerprint
    c.index_offset = layout.index_offset
    c.sketch_offset = layout.sketch_offset
    c.payload_numel = layout.payload_numel
    m = layout.multilevel
    empty = _C.SegmentedTable()
    empty.seg_len, empty.seg_count, empty.stream = 1, 3, 0
    levels = m.levels if m is not None else ()
    c.fine_levels = len(levels)
    for i in range(4):
        if i < len(levels):
            lv = levels[i]
            c.set_fine_level(i, _table(lv.table), lv.span, lv.digits_per_word, lv.words_per_group,
                             layout.level_offsets[i])
        else:
            c.set_fine_level(i, empty, 1, 1, 1, layout.sketch_offset)
    return c


def is_cuda(native) -> bool:
    """Whether ``native`` (from native_layout) belongs to the CUDA backend."""
    return getattr(native, "is_cuda_layout", False)


def encode(native, x: torch.Tensor, payload: torch.Tensor, num_threads: int = 0):
    """Encode ``x`` into ``payload`` (both contiguous float32 on the codec's device). On CUDA this
    only queues kernels on the current stream and returns None."""
    if is_cuda(native):
        from . import _cuda
        return _cuda.encode(native, x, payload)
    return _C.encode(native, x.data_ptr(), payload.data_ptr(), num_threads)


def empty(numel: int, device: torch.device) -> torch.Tensor:
    """A new float32 buffer of ``numel`` elements for the codec's output. On the CPU its memory is
    advised to be backed by transparent huge pages before anything touches it: writing a fresh buffer
    of hundreds of MiB then takes one page fault per 2 MiB instead of one per 4 KiB, which is most of
    the cost of that first write."""
    buf = torch.empty(numel, dtype=torch.float32, device=device)
    if device.type == "cpu" and numel:
        _C.advise_huge_pages(buf.data_ptr(), 4 * numel)
    return buf


def decode_cuda(native, scale: float, world_size: int, payload: torch.Tensor, out: torch.Tensor):
    """Queue a CUDA decode; returns a ``_cuda.DecodeRun`` whose ``finish()`` synchronises once."""
    from . import _cuda
    return _cuda.decode(native, scale, world_size, payload, out)


def decode(native, scale: float, total_keys: int, world_size: int, payload: torch.Tensor, out: torch.Tensor,
           trace_key: torch.Tensor | None = None, trace_cell: torch.Tensor | None = None, num_threads: int = 0):
    return _C.decode(native, float(scale), int(total_keys), int(world_size), payload.data_ptr(), out.data_ptr(),
                     trace_key.data_ptr() if trace_key is not None else 0,
                     trace_cell.data_ptr() if trace_cell is not None else 0, num_threads)


# -- THC kernels (lossless_hc/thc.py validates every tensor before calling these) -----------------
def thc_native_layout(layout) -> "_C.ThcLayout":
    c = _C.ThcLayout()
    c.numel, c.padded, c.block = layout.numel, layout.padded, layout.block
    c.granularity, c.base, c.per_word, c.words = layout.granularity, layout.base, layout.per_word, layout.words
    c.group_blocks = layout.group_blocks
    return c


def thc_sign_stream(seed: int, step: int) -> int:
    return _C.thc_sign_stream(seed, step)


def thc_round_stream(seed: int, rank: int, step: int) -> int:
    return _C.thc_round_stream(seed, rank, step)


def _addr(t: torch.Tensor | None) -> int:
    return t.data_ptr() if t is not None else 0


def thc_rht_forward(native, sign_stream: int, x: torch.Tensor, e: torch.Tensor | None, y: torch.Tensor,
                    num_threads: int = 0):
    return _C.thc_rht_forward(native, sign_stream, x.data_ptr(), _addr(e), y.data_ptr(), num_threads)


def thc_rht_inverse(native, sign_stream: int, y: torch.Tensor, out: torch.Tensor, plus_a: torch.Tensor | None,
                    plus_b: torch.Tensor | None, num_threads: int = 0) -> None:
    _C.thc_rht_inverse(native, sign_stream, y.data_ptr(), out.data_ptr(), _addr(plus_a), _addr(plus_b), num_threads)


def thc_encode(native, quantize: bool, lo, width, inv_width, scale: float, threshold: float, dequant_a: float,
               dequant_b: float, sign_stream: int, round_stream: int, x: torch.Tensor, e: torch.Tensor | None,
               word_kind: int, words: torch.Tensor, num_threads: int = 0):
    return _C.thc_encode(native, bool(quantize), lo.data_ptr(), width.data_ptr(), inv_width.data_ptr(), float(scale),
                         float(threshold), float(dequant_a), float(dequant_b), sign_stream, round_stream,
                         x.data_ptr(), _addr(e), int(word_kind), words.data_ptr(), num_threads)


def thc_decode(native, sign_stream: int, word_kind: int, words: torch.Tensor, multiplier: float, a: float, b: float,
               out: torch.Tensor, num_threads: int = 0) -> int:
    return _C.thc_decode(native, sign_stream, int(word_kind), words.data_ptr(), float(multiplier), float(a), float(b),
                         out.data_ptr(), num_threads)


def thc_pack_levels(native, levels: torch.Tensor, word_kind: int, words: torch.Tensor) -> None:
    _C.thc_pack_levels(native, levels.data_ptr(), int(word_kind), words.data_ptr())


def thc_unpack_levels(native, word_kind: int, words: torch.Tensor, multiplier: float, sums: torch.Tensor) -> int:
    return _C.thc_unpack_levels(native, int(word_kind), words.data_ptr(), float(multiplier), sums.data_ptr())
