"""The backend interface on CUDA devices (see :mod:`lossless_hc.backends` for the contract): one seam,
dispatching to each codec's launch sequence -- :mod:`.cuda_lhc` (the lossless codec),
:mod:`.cuda_thc` (THC), :mod:`.cuda_topk` (top-k) -- whose kernels :mod:`.cuda_runtime` loads and
launches."""
from __future__ import annotations

from typing import Optional

import torch

from lossless_hc.backends import cuda_runtime, cuda_thc, cuda_topk, used_slots
from lossless_hc.backends.cuda_lhc import CudaLayout, PendingDecode, decode, encode
from lossless_hc.lhc.layout import PayloadLayout, digit_packing

# The kernels' warp reductions (__reduce_add_sync) exist from compute capability 8.0 (A100) on; the
# compiled module is built for 8.0 and 9.0 (setup.py), NVRTC for the device's own.
MIN_COMPUTE_CAPABILITY = 8


class CudaBackend:
    """The backend interface on CUDA devices (see :mod:`lossless_hc.backends` for the contract).
    Everything runs on the current torch stream: encode never synchronises, decode synchronises once."""

    name = "cuda"

    def require(self, device: torch.device, user: str) -> torch.device:
        if not torch.cuda.is_available():
            raise RuntimeError(f"{user}(device='cuda') needs a CUDA device, and torch sees none "
                               "(torch.cuda.is_available() is False)")
        try:
            cuda_runtime.launcher()
        except ImportError as exc:
            raise ImportError(f"{user}(device='cuda'): {exc}") from None
        # Tensors report their device with an index: pin to the current one.
        device = device if device.index is not None else torch.device("cuda", torch.cuda.current_device())
        major, minor = torch.cuda.get_device_capability(device)
        if major < MIN_COMPUTE_CAPABILITY:   # __reduce_add_sync (csrc/cuda): a compile or "no kernel image" error
            raise RuntimeError(f"{user}(device='cuda'): the CUDA kernels need compute capability "
                               f"{MIN_COMPUTE_CAPABILITY}.0 or newer; {device} ({torch.cuda.get_device_name(device)}) "
                               f"has {major}.{minor}: use device='cpu'")
        return device

    def empty(self, numel: int, device: torch.device, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype, device=device)

    def nonzero_rows(self, x: torch.Tensor, row: int, num_threads: int = 0) -> torch.Tensor:
        """The CPU backend's ``nonzero_rows`` on the device: one reduction over the rows (``|x|``'s
        largest is not 0 exactly where a row holds a non-zero, NaN included)."""
        from lossless_hc.backends.cpu import _check_rows
        rows = _check_rows(x, row)
        return x.reshape(rows, row).abs().amax(dim=1) != 0

    def nonzero_row_index(self, x: torch.Tensor, row: int, num_threads: int = 0) -> tuple:
        """The CPU backend's ``nonzero_row_index`` on the device: ``nonzero_rows`` and ``torch.nonzero`` of it
        (which synchronises, to size the index)."""
        present = self.nonzero_rows(x, row, num_threads)
        return present, torch.nonzero(present).reshape(-1)

    def bitmap_pack(self, keys: int, world_size: int, present: Optional[torch.Tensor] = None,
                    index: Optional[torch.Tensor] = None, num_threads: int = 0) -> torch.Tensor:
        """The CPU backend's ``bitmap_pack`` on the device, in torch operations (a few passes over the rows;
        no synchronisation, so ``index`` is not range-checked here: the caller's rows are in [0, keys))."""
        from lossless_hc.backends.cpu import check_bitmap_rows
        rows = check_bitmap_rows(keys, present, index)   # torch's indexing ignores an index's negative bit
        pk = digit_packing(world_size, keys)
        device = rows.device
        # int32 throughout: a word is below 2^22 (lhc.layout.INT_FIELD_LIMIT)
        digits = torch.zeros(pk.words * pk.per_word, dtype=torch.int32, device=device)
        if present is not None:
            digits[:keys] = rows.to(torch.int32)
        else:
            digits[rows] = 1
        weights = torch.tensor([pk.base ** j for j in range(pk.per_word)], dtype=torch.int32, device=device)
        return (digits.reshape(pk.words, pk.per_word) * weights).sum(dim=1, dtype=torch.int32).to(torch.float32)

    def bitmap_rows(self, words: torch.Tensor, keys: int, world_size: int, scale: float = 1.0,
                    num_threads: int = 0) -> Optional[torch.Tensor]:
        """The CPU backend's ``bitmap_rows`` on the device, in torch operations: the same words accepted
        (csrc/cpu/digits.h word_integers' test) and the same rows; one synchronisation (the test)."""
        from lossless_hc.backends.cpu import check_bitmap_words
        pk = check_bitmap_words(words, keys, world_size)
        v = words.to(torch.float64) * scale
        r = torch.round(v)   # ties to even, as the CPU's rounding
        limit = float(pk.base ** pk.per_word)
        ok = (v > -0.5) & (v < limit) & ((v - r).abs() <= (0.0 if scale == 1.0 else 0.5)) & (r >= 0) & (r < limit)
        rest = torch.where(ok, r, 0.0).to(torch.int32)
        cols = []
        for _ in range(pk.per_word):   # the digits from the lowest: one division per digit
            quotient = torch.div(rest, pk.base, rounding_mode="floor")
            cols.append(rest - quotient * pk.base)
            rest = quotient
        nonzero = torch.stack(cols, dim=1).reshape(-1) != 0
        if not bool(ok.all() & ~nonzero[keys:].any()):   # a digit past the rows is never a rank's
            return None
        return torch.nonzero(nonzero[:keys]).reshape(-1)

    def dense_copy(self, src: torch.Tensor, dst: Optional[torch.Tensor], num_threads: int = 0,
                   block: int = 1) -> torch.Tensor:
        """The CPU backend's ``dense_copy`` on the device: the counts stay there (no synchronisation)."""
        from lossless_hc.backends.cpu import check_dense_copy
        check_dense_copy(src, dst, block)   # then torch's copy_, which reads a negative view's values
        if dst is not None:
            dst.view(-1).copy_(src.reshape(-1))   # the same numel in any shapes, as the CPU's kernel copies
        nonzero = src.reshape(-1) != 0
        if block > 1:   # a key per block, the last one padded with zeros
            nonzero = torch.cat([nonzero, nonzero.new_zeros(-nonzero.numel() % block)]).view(-1, block).any(1)
        return torch.stack([torch.count_nonzero(nonzero), torch.count_nonzero(~torch.isfinite(src))])

    def row_slots(self, index: torch.Tensor, k: int, table: Optional[torch.Tensor] = None,
                  values: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The CPU backend's ``row_slots`` on the device, in torch operations (the rows are not range-checked
        here, which would synchronise: the caller's are rows of the table)."""
        from lossless_hc.backends.cpu import check_row_slots
        index, src, row = check_row_slots(index, k, table, values)
        rows = src.index_select(0, index) if table is not None else src
        slots = torch.zeros(k, 1 + row, dtype=torch.float32, device=index.device)
        slots[:, 0] = torch.full((k,), -1, dtype=torch.int32, device=index.device).view(torch.float32)
        m = index.numel()
        slots[:m, 0] = index.to(torch.int32).view(torch.float32)
        slots[:m, 1:] = rows.to(torch.float32)
        return slots.reshape(-1)

    def sum_row_slots(self, slots: torch.Tensor, out: torch.Tensor, stale_rows: Optional[torch.Tensor] = None,
                      divisor: Optional[int] = None, count: bool = True) -> Optional[int]:
        """The CPU backend's ``sum_row_slots`` on the device, in torch operations: each rank's ``index_add_``
        in turn (within a rank no two slots meet in a row, so even CUDA's atomic adds have one order). Not
        range-checked (that would synchronise); the count synchronises."""
        ranks = used_slots(slots)
        if stale_rows is not None:
            out.index_fill_(0, stale_rows, 0.0)
        if not count:
            for i, values in ranks:
                out.index_add_(0, i, values)
            return None
        seen = torch.zeros(out.shape[0], dtype=torch.bool, device=slots.device)
        union = torch.zeros((), dtype=torch.int64, device=slots.device)
        for i, values in ranks:
            out.index_add_(0, i, values)
            union += torch.count_nonzero(~seen.index_select(0, i))   # the rows no earlier rank sent: O(slots)
            seen.index_fill_(0, i, True)
        if divisor is not None and divisor > 1:
            sent = torch.nonzero(seen).reshape(-1)
            out.index_copy_(0, sent, out.index_select(0, sent).div_(divisor))
        return int(union)

    def lhc_layout(self, layout: PayloadLayout, device: torch.device) -> CudaLayout:
        return CudaLayout(layout, device)

    def lhc_encode(self, native: CudaLayout, x: torch.Tensor, payload: torch.Tensor, num_threads: int = 0) -> None:
        encode(native, x, payload)

    def lhc_decode(self, native: CudaLayout, payload: torch.Tensor, out: torch.Tensor, scale: float,
                   world_size: int, num_threads: int = 0, rtol: float = 0.0,
                   verify: bool = False) -> PendingDecode:
        return PendingDecode(decode(native, scale, world_size, payload, out, rtol, verify))

    def topk_select(self, x: torch.Tensor, k: int, out: Optional[torch.Tensor] = None,
                    num_threads: int = 0) -> torch.Tensor:
        """The CPU backend's ``topk_select`` on the device (the same indices and argument checks;
        csrc/cuda/topk_kernels.cuh)."""
        from lossless_hc.backends.cpu import check_topk_select
        check_topk_select(x, k, out)
        return cuda_topk.topk_select(x, k, out)

    def topk_feedback(self, x: torch.Tensor, residual: torch.Tensor, k: int, num_threads: int = 0) -> tuple:
        """The CPU backend's ``topk_feedback`` on the device (the same indices, values and residual bits)."""
        from lossless_hc.backends.cpu import _check_feedback_input
        _check_feedback_input(x, residual, k)
        x = x.resolve_neg()   # read only: the kernels take its address
        count = min(int(k), x.numel())
        idx = torch.empty(count, dtype=torch.int64, device=x.device)
        values = torch.empty(count, dtype=torch.float32, device=x.device)
        cuda_topk.topk_feedback(x, residual, count, idx, values)
        return idx, values

    def thc_layout(self, layout, device: torch.device, lo, width, inv_width):
        return cuda_thc.ThcCudaLayout(layout, device, lo, width, inv_width)

    def thc_encode(self, native, quantize: bool, scale: float, threshold: float, dequant_a: float, dequant_b: float,
                   sign_stream: int, round_stream: int, x: torch.Tensor, e, word_kind: int, payload: torch.Tensor,
                   words_offset: int, norm_slot: int, mirror_slot: int, non_finite_field: int, checksum_field: int,
                   check: tuple, num_threads: int = 0, interleave_nb: int = 0) -> None:
        # The kernels write the norm slot, its mirror and the checksum, or the non-finite flag (fixed
        # header fields of csrc/cuda/thc_kernels.cuh) with everything after it zeroed.
        if interleave_nb:
            # The interleave as a copy first: strided device copies run at close to the GPU's bandwidth.
            y = self.empty(native.layout.numel, x.device)
            self.thc_interleave(x, interleave_nb, native.layout.block, y)
            x = y
        cuda_thc.encode(native, quantize, scale, threshold, dequant_a, dequant_b, sign_stream, round_stream, x, e,
                        word_kind, payload, words_offset, norm_slot, mirror_slot, check)

    def thc_decode(self, native, sign_stream: int, word_kind: int, words: torch.Tensor, multiplier: float, a: float,
                   b: float, out: torch.Tensor, check: tuple, num_threads: int = 0, interleave_nb: int = 0) -> tuple:
        if not interleave_nb:
            return cuda_thc.decode(native, sign_stream, word_kind, words, multiplier, a, b, out, check)
        y = self.empty(native.layout.numel, out.device)
        result = cuda_thc.decode(native, sign_stream, word_kind, words, multiplier, a, b, y, check)
        self.thc_deinterleave(y, interleave_nb, native.layout.block, out)
        return result

    def thc_interleave(self, x: torch.Tensor, nb: int, block: int, out: torch.Tensor, num_threads: int = 0) -> None:
        """The CPU backend's ``thc_interleave`` (the same bits: a copy), as strided device copies."""
        from lossless_hc.backends.cpu import check_interleave, check_not_negative_view
        check_interleave(x, nb, block, out)
        check_not_negative_view(out, "thc_interleave's out")   # as the CPU's, whose kernel writes memory
        cuda_thc.interleave(x.reshape(-1), nb, block, out.view(-1))   # any contiguous shapes, as the CPU's

    def thc_deinterleave(self, y: torch.Tensor, nb: int, block: int, out: torch.Tensor,
                         num_threads: int = 0) -> None:
        """The CPU backend's ``thc_deinterleave``, as strided device copies."""
        from lossless_hc.backends.cpu import check_interleave, check_not_negative_view
        check_interleave(out, nb, block, y)
        check_not_negative_view(out, "thc_deinterleave's out")
        cuda_thc.deinterleave(y.reshape(-1), nb, block, out.view(-1))


CUDA = CudaBackend()
