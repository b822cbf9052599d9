"""The row form of the planner's strategies (:mod:`lossless_hc.training.strategies`): a gradient as
``keys`` rows of ``row`` elements (:class:`TensorRows`: this rank's rows, and results in the
gradient's layout), and the row-form bodies, the two-phase counting bitmap and the allgather's slots.
Functions of their arguments, so every rank that holds the same summed or gathered tensor reads the
same rows from it."""
from __future__ import annotations

import math
from typing import Optional

import torch

from lossless_hc.backends import backend_for, used_slots
from lossless_hc.lhc.layout import check_int, digit_packing
from lossless_hc.training.aggregate import ConfigurationMismatch, _check_shape, default_block_size, payload_is_averaged
from lossless_hc.training.plan_stats import COUNT_FIELD_BITS, bitmap_words, stats_header_words
from lossless_hc.training.step import AutoContext


class TensorRows:
    """One gradient as ``keys`` rows of ``row`` elements: a sparse gradient's rows are its first
    dimension (``nn.Embedding(sparse=True)``), a dense one's keys of ``default_block_size``. The base of
    :class:`~lossless_hc.training.strategies.AutoAggregator`: this rank's rows as a step's context
    (:class:`~lossless_hc.training.step.AutoContext`) holds them, and results in the gradient's layout
    (a dense tensor, or a coalesced sparse tensor of the rows some rank listed)."""

    # Whether the engine averages the first payloads (None: read from their contributor word), set by a
    # plugin that knows its engine's op (aggregate.payload_is_averaged says why it matters).
    engine_averages: Optional[bool] = None

    def __init__(self, name: str, shape, dtype: torch.dtype, world_size: int, rank: int, sparse: bool):
        # Checked, not coerced: a rank outside [0, world_size) would write its row count into another rank's
        # header slot (rank -1: the last one) or past the header, and int() would truncate a world size
        check_int(world_size, f"{name}: world_size", least=1)
        check_int(rank, "rank")
        if not 0 <= rank < world_size:
            raise ValueError(f"{name}: rank must be in [0, world_size={world_size}), got {rank}")
        self.name, self.shape, self.dtype = name, _check_shape(shape), dtype
        self.numel = math.prod(self.shape)
        self.world_size, self.rank = world_size, rank
        self.sparse = bool(sparse)
        if self.sparse and not self.shape:
            raise ValueError(f"{name}: a sparse gradient needs at least one dimension (its rows)")
        self.row = max(1, math.prod(self.shape[1:])) if self.sparse else default_block_size(self.shape)
        self.keys = self.numel // self.row if self.numel else 0

    def _check_input(self, x: torch.Tensor) -> None:
        if x.is_sparse != self.sparse:
            raise TypeError(f"{self.name}: got a {'sparse' if x.is_sparse else 'dense'} gradient; this tensor's "
                            f"aggregator was built for {'sparse' if self.sparse else 'dense'} ones (a parameter's "
                            "gradient layout must not change between steps)")
        if tuple(x.shape) != self.shape or x.dtype != self.dtype:
            raise ValueError(f"{self.name}: got a {x.dtype} tensor of shape {tuple(x.shape)}, expected "
                             f"{self.dtype} {self.shape}")

    def _listed_rows(self, x: torch.Tensor, ctx: AutoContext) -> None:
        """A sparse gradient's rows, coalesced (duplicates summed): ``ctx.index``, ``ctx.values``, ``ctx.rows``."""
        if x.sparse_dim() != 1:
            raise TypeError(f"{self.name}: a sparse gradient with {x.sparse_dim()} sparse dimensions; auto takes "
                            "sparse tensors of rows (sparse_dim 1, as nn.Embedding(sparse=True) gives)")
        raw = x._indices()[0]
        if raw.numel():   # torch builds such tensors unchecked; two_phase would drop a row past the table
            lo, hi = (int(v) for v in torch.stack(torch.aminmax(raw)).tolist())
            if lo < 0 or hi >= self.keys:
                raise ValueError(f"{self.name}: a sparse gradient lists row {lo if lo < 0 else hi} of a table of "
                                 f"{self.keys} rows")
        x = x.detach().coalesce()
        ctx.index = x.indices()[0]
        ctx.values = x.values().reshape(ctx.index.numel(), self.row)
        ctx.rows = ctx.index.numel()

    def _stats_header(self, rows: int, dtype: torch.dtype, device) -> torch.Tensor:
        """This rank's statistics header (:func:`~lossless_hc.training.plan_stats.stats_header_words`): 1 in the
        contributor word, ``rows`` in this rank's two count fields (low ``COUNT_FIELD_BITS`` bits, then the
        rest), zeros elsewhere, so the ranks' SUM holds every rank's count exactly."""
        header = torch.zeros(stats_header_words(self.world_size), dtype=dtype, device=device)
        header[0] = 1.0
        header[1 + 2 * self.rank] = float(rows % (1 << COUNT_FIELD_BITS))
        header[2 + 2 * self.rank] = float(rows >> COUNT_FIELD_BITS)
        return header

    def _read_stats_header(self, summed: torch.Tensor, strategy: str) -> tuple:
        """``(averaged, per-rank row counts)`` from the summed (or averaged) statistics header of a plan of
        ``strategy``; ConfigurationMismatch unless every rank contributed, or (the engine's op known: ranks
        that left by ``hvd.join()`` add zeros) a dense plan's, whose body sums the contributors exactly,
        and where a word is not finite (no sum of headers holds one)."""
        n = self.world_size
        # One read of the header (one synchronisation on a GPU). Its words become Python floats exactly, so
        # round(w * n) (half to even) is the float64 product rounded as torch.round would.
        words = summed[:stats_header_words(n)].tolist()
        if not all(math.isfinite(w) for w in words):
            raise ConfigurationMismatch(f"{self.name}: the first payload's statistics header holds a non-finite "
                                        "word: not a sum of the ranks' headers")
        averaged = payload_is_averaged(words, n, self.engine_averages)
        scale = n if averaged else 1
        contributors = round(words[0] * scale)
        # any other strategy's next collective would miss the ranks that left
        joined = self.engine_averages is not None and 0 <= contributors < n
        if contributors != n and not (joined and strategy == "dense"):
            hint = (f"; {n - contributors} rank(s) sent nothing, as after hvd.join(): auto supports that only "
                    "while every plan is dense" if joined else " (ranks built different plans?)")
            raise ConfigurationMismatch(f"{self.name}: the first payload has {contributors} contributors, "
                                        f"expected {n}{hint}")
        fields = [round(w * scale) for w in words[1:]]
        return averaged, tuple(lo + (hi << COUNT_FIELD_BITS) for lo, hi in zip(fields[0::2], fields[1::2]))

    def _rows(self, flat: torch.Tensor) -> torch.Tensor:
        return flat.reshape(self.keys, self.row)

    def _present(self, flat: torch.Tensor) -> torch.Tensor:
        """Which rows of ``flat`` are non-zero (bool, one per key; NaN and infinities count as
        non-zero): the backend's row scan, one read of the tensor (torch's ``|x|.amax(dim=1) != 0``
        writes a temporary as large as the tensor)."""
        return backend_for(flat.device).nonzero_rows(flat.contiguous(), self.row, torch.get_num_threads())

    def _scan(self, ctx: AutoContext) -> None:
        """A dense gradient's rows: ``ctx.present`` (:meth:`_present`'s), their sorted ``ctx.index`` (listed
        as the scan counts them, not by ``torch.nonzero``) and ``ctx.rows``, from ``ctx.flat``."""
        if self.numel:
            ctx.present, ctx.index = backend_for(ctx.flat.device).nonzero_row_index(
                ctx.flat.contiguous(), self.row, torch.get_num_threads())
        else:
            ctx.present = ctx.flat.new_zeros(0, dtype=torch.bool)
            ctx.index = ctx.flat.new_zeros(0, dtype=torch.int64)
        ctx.rows = ctx.index.numel()

    def _union_of(self, value: torch.Tensor) -> int:
        return int(torch.count_nonzero(self._present(value.reshape(-1)))) if self.numel else 0

    def _scaled(self, summed: torch.Tensor, averaged: bool) -> torch.Tensor:
        return summed.div_(self.world_size) if averaged else summed

    def _shaped(self, flat: torch.Tensor) -> torch.Tensor:
        return flat.reshape(self.shape).to(self.dtype)

    @staticmethod
    def _device(ctx: AutoContext) -> torch.device:
        return (ctx.flat if ctx.flat is not None else ctx.index).device

    def _slots(self, ctx: AutoContext, k: int) -> torch.Tensor:
        """This rank's ``k`` allgather slots (:func:`gather_slots`) of its rows ``ctx.index``: a dense
        gradient's (:meth:`_scan`'s) read from it in place, in the same pass that writes the slots; a
        sparse one's from its listed values."""
        if ctx.values is None:
            return backend_for(ctx.flat.device).row_slots(ctx.index, k, table=self._rows(ctx.flat))
        return gather_slots(ctx.index, ctx.values, k, self.row)

    def _dense(self, ctx: AutoContext) -> torch.Tensor:
        """This rank's gradient as a flat dense tensor (a sparse one's rows written into zeros)."""
        if ctx.flat is None:
            flat = ctx.values.new_zeros(self.numel)
            if ctx.index.numel():
                self._rows(flat).index_copy_(0, ctx.index, ctx.values)
            ctx.flat = flat
        return ctx.flat

    def _on_rows(self, ctx: AutoContext, rows: torch.Tensor) -> torch.Tensor:
        """This rank's values on the sorted ``rows``, zero where it has none: ``(len(rows), row)`` float32."""
        if not self.sparse:   # rows of 1 as a flat gather: torch's 2-D index_select copies rows of 1 at a third the speed
            flat = ctx.flat.to(torch.float32)
            return (flat if self.row == 1 else self._rows(flat)).index_select(0, rows).reshape(-1, self.row)
        out = torch.zeros(rows.numel(), self.row, dtype=torch.float32, device=rows.device)
        if ctx.index.numel() and rows.numel():
            at = torch.searchsorted(rows, ctx.index).clamp_(max=rows.numel() - 1)
            mine = rows[at] == ctx.index   # this rank's rows among ``rows``
            out.index_copy_(0, at[mine], ctx.values[mine].to(torch.float32))
        return out

    def _at_coordinates(self, ctx: AutoContext, coords: torch.Tensor) -> torch.Tensor:
        """This rank's values at the increasing flat coordinates ``coords``, zero where it has none: 1-D
        float32."""
        if not self.sparse:
            return ctx.flat.to(torch.float32).reshape(-1).index_select(0, coords)
        rows = torch.div(coords, self.row, rounding_mode="floor")
        keys = torch.unique_consecutive(rows)
        return self._on_rows(ctx, keys)[torch.searchsorted(keys, rows), coords - rows * self.row]

    def _from_rows(self, union: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """The result holding ``values`` (``(len(union), row)``) at the sorted rows ``union``: a
        coalesced sparse tensor of those rows for a sparse gradient, else the dense tensor."""
        if self.sparse:
            return torch.sparse_coo_tensor(union.reshape(1, -1),
                                           values.to(self.dtype).reshape((union.numel(),) + self.shape[1:]),
                                           self.shape, is_coalesced=True, check_invariants=False)
        out = torch.zeros(self.keys, self.row, dtype=torch.float32, device=values.device)
        if union.numel():
            out.index_copy_(0, union, values.to(torch.float32))
        return self._shaped(out.reshape(-1))

    def _from_flat(self, flat: torch.Tensor, union: Optional[torch.Tensor]) -> torch.Tensor:
        """The result from the summed dense tensor: shaped, or (sparse gradient) its rows ``union``."""
        if self.sparse:
            return self._from_rows(union, self._rows(flat).index_select(0, union))
        return self._shaped(flat)

    def _union_rows(self, words: torch.Tensor, averaged: bool) -> torch.Tensor:
        """The rows some rank holds, sorted, from the summed (or averaged) counting bitmap: the backend's
        ``bitmap_rows``, which refuses a word no sum of this tensor's bitmaps can hold."""
        n = self.world_size
        expected = bitmap_words(self.keys, n)
        if words.numel() != expected:
            raise ConfigurationMismatch(f"{self.name}: two-phase bitmap of {words.numel()} words, expected {expected}")
        rows = backend_for(words.device).bitmap_rows(words.to(torch.float32).contiguous(), self.keys, n,
                                                     float(n) if averaged else 1.0, torch.get_num_threads())
        if rows is None:
            pk = digit_packing(n, self.keys)
            raise ConfigurationMismatch(f"{self.name}: a two-phase bitmap word outside the sums of {n} ranks' "
                                        f"bitmaps (integers in [0, {pk.base ** pk.per_word}), no row past "
                                        f"{self.keys}): ranks built different plans?")
        return rows

    def _no_rows(self, ctx: AutoContext) -> torch.Tensor:
        """The result when no rank holds a row."""
        device = self._device(ctx)
        empty = torch.zeros(0, dtype=torch.int64, device=device)
        return self._from_rows(empty, torch.zeros(0, self.row, dtype=torch.float32, device=device))

    def _bitmap(self, ctx: AutoContext) -> torch.Tensor:
        """This rank's counting bitmap: a digit of base n+1 per row, 1 at a row it holds, packed exactly into
        float32 words (``lhc.layout.digit_packing``; the backend's ``bitmap_pack``)."""
        return backend_for(self._device(ctx)).bitmap_pack(self.keys, self.world_size, present=ctx.present,
                                                          index=ctx.index, num_threads=torch.get_num_threads())


def gather_slots(index: torch.Tensor, values: torch.Tensor, k: int, row: int) -> torch.Tensor:
    """A rank's ``k`` allgather slots, flat: int32 row index (bits in a float32 word; -1: unused) and the
    row's ``row`` values, for its sorted rows ``index`` (at most
    :data:`~lossless_hc.training.planner.ALLGATHER_MAX_KEYS`; not checked on CUDA, which would synchronise
    its stream) with ``values`` ``(len(index), row)``: the backend's ``row_slots``."""
    return backend_for(index.device).row_slots(index, k, values=values.reshape(index.numel(), row))


# sum_slots finds the union by marking a table of ``keys`` flags where that table is at most this many times
# the gathered slots: O(keys + slots) passes instead of sorting the slots (torch.unique, then a binary search
# per slot).
MARK_UNION_MAX_KEYS_PER_SLOT = 64


def sum_slots(slots: torch.Tensor, row: int, keys: Optional[int] = None) -> tuple:
    """``(union, rows)`` from the gathered ``(n, K, 1 + row)`` slots: the sorted rows some rank sent and
    their sums, ``rows[i] = ((0 + v_0) + v_1) + ...`` over the ranks that sent row ``union[i]`` in rank
    order, on every device (so every rank adds the same floats in the same order: the same bits).
    A rank's slots name distinct rows (``gather_slots``: its sorted rows, then the unused slots).
    ``keys``: the tensor's rows (every index is below it), which lets a table of flags find the union
    where it is not much larger than the slots (:data:`MARK_UNION_MAX_KEYS_PER_SLOT`); the same result."""
    ranks = used_slots(slots)
    sent = torch.cat([i for i, _ in ranks])
    if keys is not None and keys <= MARK_UNION_MAX_KEYS_PER_SLOT * max(1, sent.numel()):
        seen = torch.zeros(keys, dtype=torch.bool, device=slots.device).index_fill_(0, sent, True)
        union = torch.nonzero(seen).reshape(-1)
        at = torch.empty(keys, dtype=torch.int64, device=slots.device)
        at.index_copy_(0, union, torch.arange(union.numel(), device=slots.device))
        position = lambda i: at.index_select(0, i)   # noqa: E731
    else:
        union = torch.unique(sent, sorted=True)
        position = lambda i: torch.searchsorted(union, i)   # noqa: E731
    rows = torch.zeros(union.numel(), row, dtype=torch.float32, device=slots.device)
    # One rank at a time: within a rank no two slots meet in a row, so even an atomic index_add_ (CUDA)
    # has one order; a single index_add_ over every rank's slots would add them in any order there.
    for i, values in ranks:
        rows.index_add_(0, position(i), values)
    return union, rows


def sum_slots_dense(slots: torch.Tensor, row: int, keys: int, out: Optional[torch.Tensor] = None,
                    stale_rows: Optional[torch.Tensor] = None, divisor: Optional[int] = None,
                    count: bool = True, backend=None) -> tuple:
    """``(out, union_count)``: :func:`sum_slots`'s sums written into a dense ``(keys, row)`` float32
    tensor, zero at the rows no rank sent, and how many rows some rank sent. The same bits as
    :func:`sum_slots` then an ``index_copy_`` into zeros (each row starts at 0 and adds the ranks' values
    in rank order), without finding the union's order: the backend's ``sum_row_slots`` (the CPU's one
    pass over the slots in C++; torch's ``index_add_`` rank by rank on CUDA).

    ``out``: a contiguous float32 tensor of ``keys * row`` elements to write into (e.g. the engine's
    buffer that held the gradient), returned as its ``(keys, row)`` view; else a new one. It is cleared
    first: all of it, or with ``stale_rows`` (int64 rows) only those rows, where every other row of
    ``out`` already holds only +-0.0 (``out`` is this rank's gradient and ``stale_rows`` its non-zero
    rows: a table is then written where it changes, not in full). A row no rank sent is then +-0.0.

    ``divisor``: a positive int (an engine's average): the sums are then divided by it, only the rows some
    rank sent: the same bits as dividing all of ``out``, whose other rows are +-0.0. ``count`` False: the
    union is not counted (None for it), and a ``divisor`` divides all of ``out``. ``backend``: the one to
    run on (default: the slots' device's)."""
    if divisor is not None and (isinstance(divisor, bool) or not isinstance(divisor, int) or divisor < 1):
        raise ValueError(f"divisor must be a positive int (the ranks an engine averages over) or None, got {divisor!r}")
    if out is None:
        out = torch.zeros(keys, row, dtype=torch.float32, device=slots.device)
        stale_rows = None
    else:
        if out.dtype != torch.float32 or not out.is_contiguous() or out.numel() != keys * row:
            raise ValueError(f"out must be a contiguous float32 tensor of {keys * row} elements, got "
                             f"{out.dtype} {tuple(out.shape)}{'' if out.is_contiguous() else ' (not contiguous)'}")
        out = out.view(keys, row)
        if stale_rows is None:
            out.zero_()
    backend = backend if backend is not None else backend_for(slots.device)
    union = backend.sum_row_slots(slots, out, stale_rows, divisor if count else None, count)
    if not count and divisor is not None and divisor != 1:
        out.div_(divisor)
    return out, union
