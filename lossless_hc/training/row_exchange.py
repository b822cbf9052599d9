"""The exact sparse reduce-scatter's local work: what a rank sends each destination, and the owner's sum.

A reduce-scatter hands each chunk to one owner, so nothing needs to be summed on the way there: every
rank can send the owner what it holds, and the owner adds it up. For a row-sparse gradient that is
this rank's own non-zero rows with their indices -- fewer bytes than a homomorphic payload, which must
be sized for the union of every rank's rows (and more than one cell per row), and no decode, capacity
or fallback. A chunk whose rows are mostly non-zero goes as it is, which is what a dense
reduce-scatter sends.

For one parameter's chunk ``x`` (its padded shard's shape; rows along the first dimension, ``row`` =
the product of the others, 1 for a vector) this rank sends a *segment*, chosen by its own bytes:

* rows (count ``c >= 0``): the ``c`` indices of the rows of ``x`` that hold an element other than
  +-0.0 (NaN and infinities count), increasing, as int64, then those rows in ``x``'s dtype -- when
  ``pad(8 c + c row s) < pad(numel s)`` (``s``: the element size; ``pad``: rounded up to 8 bytes, as
  sent; :func:`rows_are_smaller`);
* whole (count ``-1``): ``x`` as it is;
* narrowed (count ``-2``, only where the caller passes a ``narrow`` dtype, the lossy planner's
  bfloat16): ``x`` rounded to that dtype, as a half-precision reduce-scatter sends it (summed by the
  owner in ``x``'s dtype); rows stay exact and are sent when they are fewer bytes than that.

A chunk may also come as :class:`GivenRows` (a top-k selection: indices and values already chosen):
those rows are sent as given (zeros among them included), or the chunk they make whole where that is
fewer bytes.

Each segment is padded to a multiple of 8 bytes, so that every piece reads back in place as its dtype.
The counts go first (one int64 per destination and parameter), so an owner knows every sender's
lengths before the segments arrive. The owner's chunk is the sum over senders in rank order, each
adding its whole chunk or its rows (``index_add_``) into zeros: the dense reduce-scatter's sum up to
the order of the additions (float rounding), exactly 0.0 where no rank has a non-zero, and NaN or
infinities wherever a dense sum has them; with narrowed chunks, the sum of what was sent (each rounded
once, then added in the chunk's dtype).
"""
from __future__ import annotations

import math
from typing import List, NamedTuple, Optional, Sequence, Tuple, Union

import torch

from lossless_hc.backends import backend_for, span_of_slices

WHOLE = -1       # a segment's count: the chunk as it is
NARROWED = -2    # ... the chunk rounded to the caller's narrow dtype
_ALIGN = 8       # segments' byte alignment (the int64 keys; every dtype's element size divides it)


class GivenRows(NamedTuple):
    """A vector chunk of ``length`` elements (rows of one element) given by its selected elements:
    ``index`` (int64, ascending, distinct) and ``values`` there, in the chunk's dtype; zero elsewhere.
    Read as a tensor is (``numel``, ``shape``, ``dtype``, ``device``)."""
    index: torch.Tensor
    values: torch.Tensor
    length: int

    def numel(self) -> int:
        return self.length

    @property
    def shape(self) -> tuple:
        return (self.length,)

    @property
    def dtype(self) -> torch.dtype:
        return self.values.dtype

    @property
    def device(self) -> torch.device:
        return self.values.device

    def dense(self) -> torch.Tensor:
        out = torch.zeros(self.length, dtype=self.dtype, device=self.device)
        out[self.index] = self.values
        return out


Chunk = Union[torch.Tensor, GivenRows]


def row_width(shape: Sequence[int]) -> int:
    """Elements per row of a chunk shaped ``shape``: its rows lie along the first dimension."""
    return max(1, math.prod(shape[1:])) if len(shape) > 1 else 1


def whole_dtype(dtype: torch.dtype, narrow: Optional[torch.dtype]) -> torch.dtype:
    """The dtype a chunk of ``dtype`` crosses in when sent whole: ``narrow`` where given and narrower
    (a :data:`NARROWED` segment), else ``dtype`` itself (:data:`WHOLE`)."""
    return narrow if narrow is not None and narrow.itemsize < dtype.itemsize else dtype


def _padded(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


def segment_nbytes(count: int, numel: int, row: int, dtype: torch.dtype,
                   narrow: Optional[torch.dtype] = None) -> int:
    """Bytes of a segment of ``count`` rows (:data:`WHOLE`: the whole chunk of ``numel`` elements;
    :data:`NARROWED`: the same in ``narrow``)."""
    if count == WHOLE:
        return _padded(numel * dtype.itemsize)
    if count == NARROWED:
        if narrow is None:
            raise ValueError("a narrowed segment announced, but no narrow dtype given")
        return _padded(numel * narrow.itemsize)
    return _padded(count * (8 + row * dtype.itemsize))


def rows_are_smaller(count: int, numel: int, row: int, dtype: torch.dtype, wire: torch.dtype) -> bool:
    """Whether ``count`` rows of ``row`` elements of ``dtype`` (8 + row * itemsize bytes each: the int64
    index and the values) make a segment of fewer bytes than the chunk's ``numel`` elements sent whole in
    ``wire``, both padded as sent: the one rule by which a chunk goes as rows. Where the padded sizes tie
    the chunk goes whole (the same bytes, no index to build, nothing held back by a selection)."""
    return segment_nbytes(count, numel, row, dtype) < segment_nbytes(WHOLE, numel, row, wire)


def _scan(x: Chunk, narrow: Optional[torch.dtype]) -> Tuple[int, Optional[torch.Tensor]]:
    """``(count, index)``: how chunk ``x`` is sent (module doc) and, for rows, their indices (int64)."""
    row = row_width(x.shape)
    if isinstance(x, GivenRows):
        count, index, numel = x.index.numel(), x.index, x.length
    else:
        flat = x.reshape(-1)
        numel = flat.numel()
        keys = numel // row
        present = backend_for(flat.device).nonzero_rows(flat.contiguous(), row, torch.get_num_threads()) if keys \
            else torch.zeros(0, dtype=torch.bool, device=flat.device)
        count, index = int(torch.count_nonzero(present)), None
    wire = whole_dtype(x.dtype, narrow)
    if not rows_are_smaller(count, numel, row, x.dtype, wire):
        return (WHOLE if wire == x.dtype else NARROWED), None
    return count, index if index is not None else present.nonzero().squeeze(1)


def _write(x: Chunk, count: int, index: Optional[torch.Tensor], narrow: Optional[torch.dtype],
           out: torch.Tensor) -> None:
    """Write chunk ``x``'s segment (as :func:`_scan` chose) into ``out`` (uint8, its padded length)."""
    if count in (WHOLE, NARROWED):
        flat = x.dense() if isinstance(x, GivenRows) else x.reshape(-1)
        wire = x.dtype if count == WHOLE else narrow
        used = flat.numel() * wire.itemsize
        out[:used] = flat.to(wire).contiguous().resolve_neg().view(torch.uint8)   # bytes of values, not of memory
    else:
        row = row_width(x.shape)
        used = count * (8 + row * x.dtype.itemsize)
        out[:8 * count] = index.view(torch.uint8)
        rows = x.values if isinstance(x, GivenRows) else x.reshape(-1).view(-1, row).index_select(0, index)
        out[8 * count:used] = rows.reshape(-1).contiguous().resolve_neg().view(torch.uint8)
    out[used:] = 0


def encode_segment(x: torch.Tensor, narrow: Optional[torch.dtype] = None) -> Tuple[int, torch.Tensor]:
    """``(count, segment)``: chunk ``x`` as the bytes this rank sends its owner (module doc), a uint8
    tensor of :func:`segment_nbytes` bytes. ``narrow``: send the chunk whole in that dtype, where
    narrower than ``x``'s, rather than as it is."""
    counts, payload, _ = encode_destinations([[x]], [narrow])
    return counts[0][0], payload


def encode_destinations(chunks: List[List[Chunk]], narrow: Optional[List[Optional[torch.dtype]]] = None,
                        source: Optional[torch.Tensor] = None) -> Tuple[List[List[int]], torch.Tensor, List[int]]:
    """``(counts, payload, lengths)`` for ``chunks[d]``, destination d's chunks (one per parameter;
    ``narrow``: each parameter's narrow dtype, or None; a chunk: a tensor or :class:`GivenRows`): per
    destination the counts, the segments of every destination in one uint8 tensor (destination order,
    each destination's parameters in order), and each destination's bytes in it. ``source``: a
    contiguous tensor holding exactly the chunks, in that order (a reduce-scatter's input buffer):
    where every segment is its chunk whole, unpadded, the payload is ``source``'s own bytes, not a copy
    (a dense model's modules: the copy would be a pass over the whole gradient)."""
    narrow = narrow or [None] * (len(chunks[0]) if chunks else 0)
    scans = [[_scan(x, nd) for x, nd in zip(row, narrow)] for row in chunks]
    sizes = [[segment_nbytes(c, x.numel(), row_width(x.shape), x.dtype, nd)
              for (c, _), x, nd in zip(scan, row, narrow)] for scan, row in zip(scans, chunks)]
    counts = [[c for c, _ in scan] for scan in scans]
    if source is not None and all(c == WHOLE for row in counts for c in row):
        nbytes = source.numel() * source.element_size()
        # no padding, and the chunks are the source's memory: the same bytes
        if sum(map(sum, sizes)) == nbytes and span_of_slices(source, [x for row in chunks for x in row]) == nbytes:
            return counts, source.reshape(-1).view(torch.uint8), [sum(size) for size in sizes]
    device = chunks[0][0].device if chunks and chunks[0] else torch.device("cpu")
    payload = torch.empty(sum(map(sum, sizes)), dtype=torch.uint8, device=device)
    offset = 0
    for scan, row, size in zip(scans, chunks, sizes):
        for (c, index), x, nd, n in zip(scan, row, narrow, size):
            _write(x, c, index, nd, payload[offset:offset + n])
            offset += n
    return counts, payload, [sum(size) for size in sizes]


def received_nbytes(counts: Sequence[int], chunks: List[torch.Tensor],
                    narrow: Optional[List[Optional[torch.dtype]]] = None) -> int:
    """Bytes a sender's ``counts`` (one per parameter) announce for chunks shaped as ``chunks``."""
    narrow = narrow or [None] * len(chunks)
    return sum(segment_nbytes(int(c), x.numel(), row_width(x.shape), x.dtype, n)
               for c, x, n in zip(counts, chunks, narrow))


def add_segments(out: List[torch.Tensor], counts: torch.Tensor, received: torch.Tensor,
                 narrow: Optional[List[Optional[torch.dtype]]] = None) -> None:
    """Write into ``out`` (this rank's chunks, one per parameter) the sum of every sender's segments:
    ``counts[s]`` are sender s's counts and ``received`` the senders' segments concatenated in rank
    order (module doc); ``narrow`` as the senders were given it."""
    narrow = narrow or [None] * len(out)
    senders = counts.tolist()
    if any(c < NARROWED or c > x.numel() // row_width(x.shape) for sender in senders for c, x in zip(sender, out)):
        raise ValueError(f"the senders' counts {senders} do not fit chunks of {[tuple(x.shape) for x in out]}")
    announced = sum(received_nbytes(sender, out, narrow) for sender in senders)
    if announced != received.numel():
        raise ValueError(f"the senders' segments hold {received.numel()} bytes; their counts announce {announced}")
    for x in out:
        x.zero_()
    offset = 0
    for sender in senders:
        for c, x, nd in zip(sender, out, narrow):
            n = segment_nbytes(c, x.numel(), row_width(x.shape), x.dtype, nd)
            segment = received[offset:offset + n]
            offset += n
            if c in (WHOLE, NARROWED):
                wire = x.dtype if c == WHOLE else nd
                x.add_(segment[:x.numel() * wire.itemsize].view(wire).view(x.shape))
            elif c:
                row = row_width(x.shape)
                index = segment[:8 * c].view(torch.int64)
                rows = segment[8 * c:c * (8 + row * x.dtype.itemsize)].view(x.dtype).view(c, row)
                x.view(-1, row).index_add_(0, index, rows)
