"""Device backends: one seam, the same interface on every device.

    cpu           the C++/OpenMP kernels (lossless_hc._C)
    cuda          the CUDA backend, dispatching to each codec's launch sequence:
                  cuda_lhc (the lossless codec), cuda_thc (THC), cuda_topk (top-k)
    cuda_runtime  loading and launching the CUDA kernels (compiled lossless_hc._C_cuda, or NVRTC via CuPy)

:func:`backend_for` returns the backend of a device; the codecs (``lossless_hc.lhc``,
``lossless_hc.thc``) call only its methods and hold no device branches. Every backend implements:

* ``require(device, user) -> device``: raise a clear error (naming ``user``, the codec) unless its
  kernels can run there; returns the device pinned to an index (CUDA).
* ``empty(numel, device, dtype=float32)``: an output buffer (CPU: backed by huge pages where the kernel
  allows).
* ``nonzero_rows(x, row, num_threads=0) -> present``: for a contiguous tensor ``x`` of 2-, 4- or 8-byte
  floats seen as ``(x.numel() // row, row)``, a bool per row: whether it holds an element that is not
  +-0.0 (NaN and infinities count) -- the planner's row scan (``lossless_hc.training.rows``); and
  ``nonzero_row_index(x, row, num_threads=0) -> (present, index)``: that and the rows it found, sorted
  int64 on ``x``'s device (``torch.nonzero(present)``'s).
* ``dense_copy(src, dst, num_threads=0, block=1) -> counts``: ``dst.copy_(src)`` (contiguous float32, the
  same numel; ``dst`` None: no copy) and an int64 tensor on ``src``'s device, ``[keys of src holding an
  element that is not +-0.0, elements that are not finite]``, a key ``block`` consecutive elements (the
  last one partial) -- the LHC codec's dense index.
* ``bitmap_pack(keys, world_size, present=None, index=None, num_threads=0) -> words``: a rank's two-phase
  counting bitmap, ``digit_packing(world_size, keys)``'s float32 words with digit 1 at each row it holds
  (``present``: a bool per row; else ``index``: its rows, int64, any order, a row listed twice counted
  once; CPU: one outside ``[0, keys)`` is a ValueError) -- and ``bitmap_rows(words, keys, world_size,
  scale=1.0, num_threads=0) -> rows``: the rows (sorted int64) whose digit is not zero in a sum of such
  bitmaps (``scale`` n: their average), or None where a word is not one such a sum holds (not an integer
  in ``[0, base^per_word)``, or a digit past the last row). The planner's two-phase strategy
  (``lossless_hc.training.rows``).
* ``row_slots(index, k, table=None, values=None) -> slots`` and ``sum_row_slots(slots, out, stale_rows=None,
  divisor=None, count=True) -> union rows``: the allgather strategy's slots (``lossless_hc.training.rows``):
  a rank's ``k`` slots, flat float32 ``(k, 1 + row)``, each the int32 row index in the first word's bits
  (-1: unused) then the row's values (``table``'s row ``index[i]``, or ``values``' row ``i``); and the
  ranks' gathered slots added into a dense ``(keys, row)`` float32 ``out`` in rank order (CPU: a row
  outside the table is a ValueError, raised before anything is written).
* ``lhc_layout(layout, device)`` (the kernels receive it as the layout ABI, the words of
  :func:`lossless_hc.lhc.layout.layout_words`), ``lhc_encode(native, x, payload, num_threads)`` and
  ``lhc_decode(native, payload, out, scale, world_size, num_threads, rtol, verify) -> pending`` with
  ``pending.header`` (the payload's header fields as floats), ``pending.finish(total_keys,
  trace, bounds=False) -> (stats, trace)`` and then ``pending.inexact_keys()`` (sorted int64 CPU
  tensor of the keys whose error bound, or with ``verify`` also verification bound, exceeds
  ``rtol``) and, after ``bounds=True`` where every key was recovered, ``pending.error_bounds() ->
  (keys, E)`` (the support keys, sorted int64, and each one's error bound E(k), float64; CPU
  tensors); stats carry ``status`` (csrc/lhc_status.h, decided on the kernels' side),
  ``candidates``, ``false_positives``, ``support_keys``, ``peeled``. CPU reads the header first and
  runs its kernels in ``finish``; CUDA queues its kernels first and reads header and counters with one
  synchronisation. Either way the codec validates the header before it trusts the kernels' verdict,
  and the kernels size every buffer from the layout, never from the header.
* ``topk_select(x, k, out=None, num_threads=0) -> indices``: the ``min(k, numel)`` largest ``|x|``, ties
  to the lower index, ascending int64 (csrc/cpu/topk_cpu.h), identical on every backend.
* ``topk_feedback(x, residual, k, num_threads=0) -> (indices, values)``: ``topk_select`` of
  ``a = x + residual`` and ``a`` there, with ``residual <- a`` minus the selection, in place.
* ``thc_layout``, ``thc_encode`` (writes every level word, this rank's norm slot and its mirror and
  the checksum field, or the non-finite flag with everything after it zeroed; the codec zeroes the
  header and the norm slots first and writes header fields 0 and 1) and
  ``thc_decode -> (invalid word count, checksum of the words)``. Both take ``interleave_nb``: when > 0,
  ``thc_encode``'s x is encoded as ``thc_interleave(x, interleave_nb, block)`` and ``thc_decode``'s
  out receives the ``thc_deinterleave`` of the decoded blocks (the CPU backend reads and writes them
  in place, group by group; CUDA goes through a copy).
* ``thc_interleave(x, nb, block, out, num_threads=0)``: ``out[j * block + r] = x[r * nb + j]``, zero past
  ``x``'s end (the THC aggregator's spreading of a tensor over ``nb`` blocks), and its inverse
  ``thc_deinterleave(y, nb, block, out, num_threads=0)``: ``out[i] = y[(i % nb) * block + i // nb]``.

Tensors go to the kernels by address. So a tensor with torch's negative bit (``torch._neg_view``) that a
kernel only reads is resolved first (``x.resolve_neg()``: the exact answer; not where only zeros or
magnitudes are read), and one it writes is refused (``check_not_negative_view``), as are operands that share
memory where one is written (``check_disjoint``).

Every backend writes the same index and header bits (sketch cells within float rounding of each
other: CUDA adds them with atomics) and recovers the same support; decoding the same aggregate, both
read every key from the same cell in the same order, so the values, error bounds and verdicts are the
same bits (docs/DESIGN.md "Exactness"). The tests check CPU, emulated CUDA and the pure-torch
reference against each other.
"""
from __future__ import annotations

from typing import Optional

import torch

from lossless_hc.backends.cpu import CPU, check_disjoint, check_not_negative_view


def checked_out(out, numel: int, device: torch.device, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``out``, a buffer the caller passed for a kernel to write, as its 1-D view: a contiguous ``dtype``
    tensor of ``numel`` elements on ``device`` that holds its own values (:func:`check_not_negative_view`),
    else ValueError. Every codec's ``out`` goes through here."""
    if (not isinstance(out, torch.Tensor) or out.dtype != dtype or out.numel() != numel or not out.is_contiguous()
            or out.device != device):
        raise ValueError(f"out must be a contiguous {str(dtype).removeprefix('torch.')} tensor of {numel} elements "
                         f"on {device}")
    check_not_negative_view(out, "out")
    return out.view(-1)


def span_of_slices(buffer: torch.Tensor, tensors) -> Optional[int]:
    """The bytes from ``buffer``'s start that ``tensors`` cover when they are its consecutive slices, in order,
    each contiguous and holding its own values; else None. No negative view on either side: whoever reads
    ``buffer`` in their place (an engine's collective, a kernel) reads memory, which would then be the
    negation of their values. An empty tensor has no memory to be in the buffer (data_ptr 0): it fits anywhere."""
    if not buffer.is_contiguous() or buffer.is_neg():
        return None
    at = buffer.data_ptr()
    for t in tensors:
        if not isinstance(t, torch.Tensor) or not t.is_contiguous() or t.is_neg() or (t.numel() and t.data_ptr() != at):
            return None
        at += t.numel() * t.element_size()
    return at - buffer.data_ptr()


def as_device(device) -> torch.device:
    """``torch.device(device)``; where torch cannot parse ``device`` ("tpu", a float), a ValueError
    naming the devices the codecs run on, as for a device torch knows but the codecs do not."""
    try:
        return torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"unsupported device {device!r}; expected 'cpu' or 'cuda'") from exc


# More OpenMP threads than any machine has cores: a larger count is a mistake, not a request.
MAX_THREADS = 4096


def check_num_threads(num_threads) -> int:
    """``num_threads`` as the kernels take it (OpenMP threads; 0: the OpenMP default), or TypeError /
    ValueError: a bool, a float or a negative count would reach the kernels as something else (or
    as a TypeError from deep inside an encode)."""
    if isinstance(num_threads, bool) or not isinstance(num_threads, int):
        raise TypeError(f"num_threads must be an int (0: the OpenMP default), got {type(num_threads).__name__}")
    if not 0 <= num_threads <= MAX_THREADS:
        raise ValueError(f"num_threads must be in [0, {MAX_THREADS}] (0: the OpenMP default), got {num_threads}")
    return num_threads


def used_slots(slots: torch.Tensor) -> list:
    """``[(rows, values)]`` per rank of the allgather strategy's gathered ``(n, K, 1 + row)`` slots: the used
    slots, which ``lossless_hc.training.rows.gather_slots`` puts first (int64 row indices, ``(m_r, row)``
    values; views, no mask). The torch operations of sum_slots and of the CUDA backend's sum_row_slots."""
    index = slots[:, :, 0].contiguous().view(torch.int32)
    used = torch.count_nonzero(index >= 0, dim=1).tolist()
    return [(index[r, :m].to(torch.int64), slots[r, :m, 1:]) for r, m in enumerate(used)]


def backend_for(device: torch.device):
    """The backend of ``device`` ("cpu" or "cuda"/"cuda:N"); ValueError for any other device."""
    device = as_device(device)
    if device.type == "cuda":
        from lossless_hc.backends.cuda import CUDA   # CUDA-only imports stay off the CPU path
        return CUDA
    if device.type != "cpu":
        raise ValueError(f"unsupported device {device}; expected 'cpu' or 'cuda'")
    return CPU
