"""The exact sparse reduce-scatter's local work (lossless_hc.training.row_exchange), one process playing
every sender: what each sends is the smaller of its rows and its chunk, and the owner's sum is the dense
sum in rank order, bit for bit. The collectives around it: tests/test_plugins_fsdp.py (auto_rows)."""
import pytest
import torch

from lossless_hc.training.row_exchange import (NARROWED, WHOLE, GivenRows, add_segments, encode_destinations,
                                               encode_segment, received_nbytes, segment_nbytes)


def encode_destination(chunks, narrow=None):
    """One sender's counts and bytes for its one destination."""
    counts, payload, lengths = encode_destinations([chunks], narrow)
    assert lengths == [payload.numel()]
    return counts[0], payload

SHAPES = [(50, 4), (7,), (0, 3), (10, 10), (3, 2, 5)]


def sparse_chunk(shape, dtype, rows, g):
    """A chunk whose first ``rows`` rows (of its first dimension) may be non-zero, random values."""
    x = torch.zeros(shape, dtype=dtype)
    if x.numel():
        picked = torch.randperm(shape[0], generator=g)[:rows]
        x[picked] = torch.randn((len(picked), *shape[1:]), generator=g).to(dtype)
    return x


def exchange(senders):
    """The owner's chunks from every sender's chunks (senders[s][i]: sender s's chunk of parameter i),
    as the plugin moves them: each sender's counts and bytes concatenated in rank order."""
    counts, data = zip(*(encode_destination(chunks) for chunks in senders))
    for c, d, chunks in zip(counts, data, senders):
        assert d.numel() == received_nbytes(c, chunks)
    out = [torch.full(tuple(x.shape), 7.0, dtype=x.dtype) for x in senders[0]]   # overwritten, not added to
    add_segments(out, torch.tensor(counts, dtype=torch.int64), torch.cat(data))
    return out, counts


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_owner_sum_is_the_dense_sum_in_rank_order(dtype):
    g = torch.Generator().manual_seed(3)
    senders = [[sparse_chunk(s, dtype, rows, g) for s, rows in zip(SHAPES, (3, 7, 0, 10, 1))] for _ in range(3)]
    got, counts = exchange(senders)
    for i, x in enumerate(got):
        want = torch.zeros_like(x)
        for s in senders:
            want = want + s[i]
        assert torch.equal(x, want), (i, x, want)
    # a table of 50 rows with 3 set goes as rows; a full 10x10 as it is
    assert all(c[0] == 3 for c in counts) and all(c[3] == WHOLE for c in counts), counts


def test_the_smaller_form_is_sent():
    x = torch.zeros(100, 4)
    x[5] = 1.0
    count, seg = encode_segment(x)
    assert count == 1 and seg.numel() == segment_nbytes(1, 400, 4, torch.float32) == 8 + 16
    # one row of one element costs 12 bytes against 4 for the element: the chunk goes as it is
    count, seg = encode_segment(torch.tensor([0.0, 2.0, 0.0]))
    assert count == WHOLE and seg.numel() == 16   # 12 bytes padded to 8
    # the sizes compared as sent: one pair (12 bytes, 16 padded) against 4 elements (16) ties, and the
    # chunk goes whole; against 5 elements (20, 24 padded) the pair is fewer bytes
    count, seg = encode_segment(torch.tensor([0.0, 2.0, 0.0, 0.0]))
    assert count == WHOLE and seg.numel() == 16
    count, seg = encode_segment(torch.tensor([0.0, 2.0, 0.0, 0.0, 0.0]))
    assert count == 1 and seg.numel() == 16
    for rows in range(0, 101, 10):   # never more bytes than the chunk (padded to 8)
        y = torch.zeros(100, 4)
        y[:rows] = 1.0
        assert encode_segment(y)[1].numel() <= 1600


def test_non_finite_values_and_signed_zeros_sum_as_dense():
    a = torch.zeros(20, 2)
    b = torch.zeros(20, 2)
    a[3, 1], b[3, 0] = float("inf"), float("nan")
    a[4, 0], b[4, 0] = float("inf"), float("-inf")
    a[9, 1] = -0.0   # a row of zeros only: not sent
    got, counts = exchange([[a], [b]])
    assert [list(c) for c in counts] == [[2], [2]], counts
    want = a + b
    assert torch.equal(torch.isnan(got[0]), torch.isnan(want)) and torch.equal(got[0].nan_to_num(), want.nan_to_num())


def test_a_chunk_s_rows_span_every_dimension_after_the_first():
    """A (4, 3, 3) chunk has 4 rows of 9 elements: one non-zero row goes as one index and its 9 values (8 + 36
    bytes, padded to 48), not as three rows of 3."""
    x = torch.zeros(4, 3, 3)
    x[1] = 1.0
    count, segment = encode_segment(x)
    assert (count, segment.numel()) == (1, 48)


def test_a_narrow_dtype_no_narrower_than_the_chunk_s_leaves_it_whole():
    """``narrow`` applies only where it is narrower: a float16 chunk with the lossy planner's bfloat16 goes whole
    in float16 (the same bytes; bfloat16 would drop three bits of every value), and sums exactly."""
    g = torch.Generator().manual_seed(5)
    x = (1 + torch.rand(64, generator=g)).to(torch.float16)
    count, segment = encode_segment(x, narrow=torch.bfloat16)
    assert count == WHOLE and torch.equal(segment.view(torch.float16), x)


def test_a_byte_count_that_disagrees_with_the_counts_is_an_error():
    """Bytes that do not match the counts, or counts no chunk of that shape can have: a ValueError
    before anything is written (the output is left as it was)."""
    x = torch.zeros(10, 2)
    x[1] = 1.0
    counts, data = encode_destination([x])
    out = torch.full((10, 2), 3.0)
    with pytest.raises(ValueError, match="announce"):
        add_segments([out], torch.tensor([counts]), torch.cat([data, data[:8]]))
    for bad in (-3, 11):
        with pytest.raises(ValueError, match="do not fit"):
            add_segments([out], torch.tensor([[bad]]), data)
    assert bool((out == 3.0).all())


def test_narrowed_chunks_are_rounded_once_and_summed_in_their_dtype():
    """With a narrow dtype (the lossy planner's bfloat16) a chunk sent whole goes rounded to it (half the
    bytes) and the owner sums in float32; a sparse chunk still goes as exact rows."""
    g = torch.Generator().manual_seed(5)
    dense = [torch.randn(16, 8, generator=g) for _ in range(3)]
    sparse = [sparse_chunk((64, 8), torch.float32, 2, g) for _ in range(3)]
    narrow = [torch.bfloat16, torch.bfloat16]
    counts, data = zip(*(encode_destination([d, s], narrow) for d, s in zip(dense, sparse)))
    assert all(c[0] == NARROWED and c[1] == 2 for c in counts), counts
    assert all(d.numel() == 16 * 8 * 2 + 2 * (8 + 8 * 4) for d in data)
    out = [torch.zeros(16, 8), torch.zeros(64, 8)]
    add_segments(out, torch.tensor(counts), torch.cat(data), narrow)
    want = torch.zeros(16, 8)
    for d in dense:
        want = want + d.to(torch.bfloat16).float()
    assert torch.equal(out[0], want)
    assert torch.equal(out[1], sparse[0] + sparse[1] + sparse[2])
    # a chunk already as narrow as the dtype is sent as it is
    assert encode_segment(torch.ones(4, dtype=torch.bfloat16), torch.bfloat16)[0] == WHOLE
    with pytest.raises(ValueError, match="narrow"):
        add_segments([torch.zeros(16, 8)], torch.tensor([[NARROWED]]), data[0][:256])


def test_every_destination_in_one_payload_in_order_with_zeroed_padding():
    """Several destinations' chunks: one payload, destination after destination, each destination's
    bytes as a lone encoding gives them (so the all-to-all's split sizes are the lengths), the padding
    zeroed (the bytes are a function of the chunks)."""
    g = torch.Generator().manual_seed(9)
    chunks = [[sparse_chunk((30, 3), torch.float32, r, g), torch.randn(5, generator=g)] for r in (2, 0, 30)]
    counts, payload, lengths = encode_destinations(chunks)
    assert sum(lengths) == payload.numel() and counts == [[2, WHOLE], [0, WHOLE], [WHOLE, WHOLE]], counts
    offset = 0
    for row, n in zip(chunks, lengths):
        alone = encode_destination(row)[1]
        assert torch.equal(payload[offset:offset + n], alone)
        offset += n
    # the 5-element vector: 20 bytes, padded to 24 with zeros
    assert torch.equal(encode_segment(torch.ones(5))[1][20:], torch.zeros(4, dtype=torch.uint8))


def test_given_rows_send_what_their_dense_chunk_would():
    """A top-k selection handed over as indices and values: the owner's sum equals that of the dense
    selections; where the selection is most of the chunk it goes whole, as the dense chunk would."""
    g = torch.Generator().manual_seed(11)
    selections = []
    for _ in range(3):
        index = torch.randperm(100, generator=g)[:7].sort().values
        selections.append(GivenRows(index, torch.randn(7, generator=g), 100))
    given, counts = exchange([[s] for s in selections])
    dense, _ = exchange([[s.dense()] for s in selections])
    assert [list(c) for c in counts] == [[7]] * 3 and torch.equal(given[0], dense[0])
    full = GivenRows(torch.arange(90), torch.ones(90), 100)   # 90 x 12 bytes > 100 x 4
    count, segment = encode_segment(full)
    assert count == WHOLE and torch.equal(segment, encode_segment(full.dense())[1])


def test_a_buffer_sent_whole_is_its_own_payload():
    """Given the buffer the chunks are slots of (a reduce-scatter's input): where every chunk goes whole
    and unpadded, the payload is that buffer's bytes (no copy) and equals the copied payload; a chunk sent
    as rows, a padded one, or a narrowed one makes the payload a copy as before."""
    g = torch.Generator().manual_seed(12)
    buffer = torch.randn(2 * 46, generator=g)   # 2 destinations x (a 10x4 chunk and a 6-vector)
    chunks = [[buffer[46 * d:46 * d + 40].view(10, 4), buffer[46 * d + 40:46 * (d + 1)]] for d in range(2)]
    counts, payload, lengths = encode_destinations(chunks, source=buffer)
    assert counts == [[WHOLE, WHOLE]] * 2 and lengths == [184, 184]
    assert payload.data_ptr() == buffer.data_ptr() and torch.equal(payload, encode_destinations(chunks)[1])
    chunks[1][0][2:].zero_()   # destination 1's table: 2 rows of 10, sent as rows
    counts, payload, _ = encode_destinations(chunks, source=buffer)
    assert counts == [[WHOLE, WHOLE], [2, WHOLE]] and payload.data_ptr() != buffer.data_ptr()
    assert torch.equal(payload, encode_destinations(chunks)[1])
    odd = torch.randn(2 * 5, generator=g)   # 5-vectors: 20 bytes, padded to 24
    counts, payload, _ = encode_destinations([[odd[:5]], [odd[5:]]], source=odd)
    assert payload.numel() == 48 and payload.data_ptr() != odd.data_ptr()
    counts, payload, _ = encode_destinations(chunks[:1], narrow=[torch.bfloat16, None], source=buffer[:46])
    assert counts == [[NARROWED, WHOLE]] and payload.data_ptr() != buffer.data_ptr()
    # chunks that are not the source's memory (copies, negative views of it), or a source that is a negative
    # view: the bytes are the chunks' values, copied
    fresh = torch.randn(2 * 46, generator=g)
    slots = [[fresh[46 * d:46 * (d + 1)]] for d in range(2)]
    want = encode_destinations(slots)[1]
    assert encode_destinations(slots, source=fresh)[1].data_ptr() == fresh.data_ptr()
    for given, source in (([[x.clone()] for [x] in slots], fresh), ([[torch._neg_view(-x)] for [x] in slots], fresh),
                          (slots, torch._neg_view(-fresh))):
        counts, payload, _ = encode_destinations(given, source=source)
        assert counts == [[WHOLE]] * 2 and payload.data_ptr() != fresh.data_ptr() and torch.equal(payload, want)


def topk_reduce_scatters(n, ratio, params):
    """Every rank's reduce-scatter of ``TopKFSDPState(mesh, ratio)`` over ``params`` parameters, without a
    mesh: the state's aggregators and the comm's ``_sent`` (what it hands the exchange), nothing else."""
    from types import SimpleNamespace

    from lossless_hc.plugins._fsdp_reduce_scatter import SelectionRowExchangeReduceScatter
    from lossless_hc.plugins.fsdp import TopKFSDPState
    from lossless_hc.training.adapter import TopKSpec
    from lossless_hc.training.aggregate import AggregationStats
    comms = []
    for _ in range(n):
        state = TopKFSDPState.__new__(TopKFSDPState)   # its aggregators alone (no process group)
        state.spec, state._stats, state._aggregators, state._saved = TopKSpec(ratio), AggregationStats(), {}, {}
        comm = SelectionRowExchangeReduceScatter(state, None)
        comm.slots = SimpleNamespace(fqns=[f"p{i}" for i in range(params)])
        comms.append(comm)
    return comms


def test_top_k_s_reduce_scatter_sends_pairs_wherever_they_are_fewer_bytes_than_the_chunk():
    """TopKFSDPState's reduce-scatter over 4 ranks at ratio 0.05: a 1,000-element chunk goes as its 50
    selected (index, value) pairs, 600 bytes against 4,000 whole (it went whole: the LHC codec, which
    decided it and which the exchange never uses, would not have been smaller than the chunk at 4 ranks),
    and a 4-element chunk, whose one pair (16 bytes padded) is no fewer than the chunk's, whole with what
    its residual held. The owner's sum is every rank's selection (x + residual's k largest magnitudes)
    added in rank order, bit for bit, and the error feedback conserves every coordinate over the steps."""
    n, ratio, numels = 4, 0.05, (1000, 4)
    comms = topk_reduce_scatters(n, ratio, len(numels))
    g = torch.Generator().manual_seed(21)
    residual = {(r, d, i): torch.zeros(m) for r in range(n) for d in range(n) for i, m in enumerate(numels)}
    total_in = [torch.zeros(n, m, dtype=torch.float64) for m in numels]
    total_out = [torch.zeros(n, m, dtype=torch.float64) for m in numels]
    for step in range(3):
        x = [[[torch.randn(m, generator=g) for m in numels] for _ in range(n)] for _ in range(n)]   # [r][d][i]
        sent = [[comms[r]._sent(x[r][d], d, n, r) for d in range(n)] for r in range(n)]
        for d in range(n):
            owned, counts = exchange([sent[r][d] for r in range(n)])
            assert [list(c) for c in counts] == [[50, WHOLE]] * n, counts
            for i, m in enumerate(numels):
                truth = torch.zeros(m)
                for r in range(n):   # the reference error feedback, in rank order
                    a = x[r][d][i] + residual[r, d, i]
                    idx = a.abs().topk(50).indices if m == 1000 else torch.arange(m)
                    truth[idx] += a[idx]
                    residual[r, d, i] = a.index_fill(0, idx, 0.0)
                    total_in[i][d] += x[r][d][i].double()
                assert torch.equal(owned[i], truth), (step, d, i)
                total_out[i][d] += owned[i].double()
    for i, m in enumerate(numels):
        held = torch.zeros(n, m, dtype=torch.float64)
        for r in range(n):
            for d in range(n):
                e = comms[r].state._aggregators[f"shard:p{i}->{d}"].residual   # None: flushed whole
                assert torch.equal(residual[r, d, i], torch.zeros(m) if e is None else e)
                held[d] += residual[r, d, i].double()
        assert float((total_in[i] - total_out[i] - held).abs().max()) < 1e-5
    aggs = [a for c in comms for a in c.state._aggregators.values()]
    assert len(aggs) == n * n * len(numels) and all(a.codec is None for a in aggs)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_top_k_s_reduce_scatter_keeps_a_half_precision_chunk_s_rounding_in_its_residual(dtype):
    """A bfloat16 or float16 chunk's pairs carry x + residual as that dtype holds it: what the rounding
    leaves out (and, beyond float16's range, what the clamp to 65504 leaves out) stays in the residual, as
    Compression.topk's selection keeps it, so every step's pairs plus the residual are everything sent so
    far, exactly. (They were cast alone: the rounding was lost, and a float16 x + residual near 80000 went
    out as inf.)"""
    numel = 1000
    comms = topk_reduce_scatters(2, 0.05, 1)
    g = torch.Generator().manual_seed(22)
    total_in = torch.zeros(numel, dtype=torch.float64)
    total_out = torch.zeros(numel, dtype=torch.float64)
    for step in range(4):
        x = torch.randn(numel, generator=g).to(dtype)
        x[:100] = 40000.0 + 1000.0 * torch.rand(100, generator=g)   # 50 sent a step; the others' x + e ~80000
        given = comms[0]._sent([x], 0, 2, 0)[0]
        residual = comms[0].state._aggregators["shard:p0->0"].residual
        assert given.values.dtype == dtype and bool(torch.isfinite(given.values).all())
        total_in += x.double()
        total_out += given.dense().double()
        assert torch.equal(total_in - total_out, residual.double()), step


def test_a_chunk_with_no_non_zero_row_goes_as_zero_rows_in_no_bytes():
    """Count 0 is a segment of no rows (no bytes), distinct from the whole chunk (count -1) and the narrowed
    one (-2), the counts the module documents for the wire."""
    assert (WHOLE, NARROWED) == (-1, -2)
    count, segment = encode_segment(torch.zeros(50, 4))
    assert count == 0 and segment.numel() == 0
    out = [torch.full((50, 4), 7.0)]
    add_segments(out, torch.tensor([[0], [0]]), torch.zeros(0, dtype=torch.uint8))
    assert torch.equal(out[0], torch.zeros(50, 4))


def test_a_chunk_of_zero_width_rows_goes_whole_in_no_bytes():
    """A (5, 0) chunk (a padded shard of an empty parameter) has no elements: rows of at least one element
    are scanned (none), and it goes whole, in no bytes, and sums to itself."""
    x = torch.zeros(5, 0)
    count, segment = encode_segment(x)
    assert count == WHOLE and segment.numel() == 0
    out = [torch.zeros(5, 0)]
    add_segments(out, torch.tensor([[count], [count]]), torch.cat([segment, segment]))
    assert out[0].shape == (5, 0)


def test_given_rows_read_as_the_tensor_they_stand_for():
    """GivenRows answers numel, shape, dtype and device as its dense chunk does (the exchange sizes and
    places the payload by them), and dense() writes the values at the index into zeros."""
    given = GivenRows(torch.tensor([1, 4]), torch.tensor([2.0, -3.0], dtype=torch.float64), 6)
    dense = given.dense()
    assert torch.equal(dense, torch.tensor([0.0, 2.0, 0.0, 0.0, -3.0, 0.0], dtype=torch.float64))
    assert (given.numel(), given.shape, given.dtype, given.device) == (6, (6,), torch.float64, dense.device)
    assert isinstance(given.device, torch.device)


def test_destinations_with_no_chunks_make_an_empty_payload():
    """A rank with no parameters to send (every destination's list of chunks empty): no counts, no bytes,
    a length of 0 per destination; and no destinations at all, nothing."""
    counts, payload, lengths = encode_destinations([[], []])
    assert counts == [[], []] and lengths == [0, 0]
    assert payload.dtype == torch.uint8 and payload.numel() == 0
    counts, payload, lengths = encode_destinations([])
    assert counts == [] and lengths == [] and payload.numel() == 0
