"""The row-form bodies of the planner's strategies (lossless_hc.training.rows): the allgather's slots
summed (by a table of flags, by sorting, into a dense tensor) and the two-phase counting bitmap, against
plain per-row loops."""
import pytest
import torch

from lossless_hc.backends import backend_for
from lossless_hc.backends.cuda import CudaBackend
from lossless_hc.lhc.layout import digit_packing
from lossless_hc.training.rows import MARK_UNION_MAX_KEYS_PER_SLOT, gather_slots, sum_slots, sum_slots_dense

# The row-form operations on every backend (the counting bitmap, the slots' dense sums): the CPU kernels,
# the CUDA backend's torch operations run on CPU tensors (its code, tested where no GPU is), and on a GPU.
ROW_BACKENDS = [pytest.param("cpu", id="cpu"), pytest.param("torch", id="cuda-ops-on-cpu"),
                pytest.param("cuda", id="cuda", marks=pytest.mark.gpu)]


def row_backend(which: str):
    """(backend, device) of a ROW_BACKENDS entry."""
    if which == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    return (CudaBackend() if which == "torch" else backend_for(which)), ("cuda" if which == "cuda" else "cpu")


def gathered(sent: dict, keys: int, row: int, k: int, seed: int = 0):
    """The ``(n, k, 1 + row)`` slots every rank gathers, and each rank's values, for ``sent``: rank ->
    its sorted rows."""
    gen = torch.Generator().manual_seed(seed)
    values = {r: torch.randn(len(rows), row, generator=gen) for r, rows in sent.items()}
    slots = torch.stack([gather_slots(torch.tensor(sent[r], dtype=torch.int64), values[r], k, row).reshape(k, 1 + row)
                         for r in sorted(sent)])
    return slots, values


def summed_in_rank_order(sent: dict, values: dict, row: int) -> dict:
    """row -> its float32 sum, one addition at a time, ranks in order, from 0."""
    out = {}
    for r in sorted(sent):
        for i, key in enumerate(sent[r]):
            out[key] = out.get(key, torch.zeros(row)) + values[r][i]
    return out


def random_sent(n: int, keys: int, k: int, seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    return {r: sorted(torch.randperm(keys, generator=gen)[:int(torch.randint(0, k + 1, (1,), generator=gen))].tolist())
            for r in range(n)}


@pytest.mark.parametrize("keys,k,n,row", [(64, 8, 3, 2), (1000, 40, 4, 1), (1 << 16, 50, 5, 3), (30, 30, 2, 1)])
def test_gathered_slots_sum_to_the_rank_order_sums_by_table_by_sort(keys, k, n, row):
    """sum_slots gives the rows some rank sent, sorted, each the float32 sum of its ranks' values in rank
    order, with the tensor's rows known (a table of flags where it is small enough, else a sort) and
    without. Cases span both sides of MARK_UNION_MAX_KEYS_PER_SLOT."""
    for seed in range(4):
        sent = random_sent(n, keys, k, seed)
        slots, values = gathered(sent, keys, row, k, seed)
        want = summed_in_rank_order(sent, values, row)
        union_want = sorted(want)
        for hint in (None, keys):
            union, rows = sum_slots(slots, row, hint)
            assert union.tolist() == union_want
            assert torch.equal(rows, torch.stack([want[u] for u in union_want]) if want else torch.zeros(0, row))
        sent_slots = sum(len(v) for v in sent.values())
        takes_table = keys <= MARK_UNION_MAX_KEYS_PER_SLOT * max(1, sent_slots)
        assert takes_table == (keys < 1 << 16)   # the cases span both paths


@pytest.mark.parametrize("which", ROW_BACKENDS)
@pytest.mark.parametrize("keys,k,n,row", [(64, 8, 3, 2), (1000, 40, 4, 1), (1 << 16, 50, 5, 3), (30, 30, 2, 1)])
def test_gathered_slots_sum_densely_to_the_rank_order_sums_on_every_backend(keys, k, n, row, which):
    """sum_slots_dense writes those sums into a dense tensor, zeros elsewhere, and counts the rows: into a
    new tensor, into a given buffer, into rank 0's own gradient (only its rows cleared), divided by an
    engine's n, and without the count, on every backend alike."""
    backend, device = row_backend(which)

    def dense(*args, out=None, stale=None, **kw):
        out = None if out is None else out.to(device)
        stale = None if stale is None else stale.to(device)
        into, count = sum_slots_dense(slots.to(device), *args, out=out, stale_rows=stale, backend=backend, **kw)
        assert out is None or into.data_ptr() == out.data_ptr()   # written there, not into a copy
        return into.cpu(), count, out

    for seed in range(4):
        sent = random_sent(n, keys, k, seed)
        slots, values = gathered(sent, keys, row, k, seed)
        want = summed_in_rank_order(sent, values, row)
        expect = torch.zeros(keys, row)
        for u in want:
            expect[u] = want[u]
        into, count, _ = dense(row, keys)
        assert count == len(want) and torch.equal(into, expect)
        # into a given buffer (the engine's, which held the gradient: garbage here): the same bits, there
        into, count, buffer = dense(row, keys, out=torch.full((keys * row,), float("nan")))
        assert count == len(want) and torch.equal(buffer.cpu().view(keys, row), expect) and torch.equal(into, expect)
        # into rank 0's own gradient, zero (+-0.0) outside its rows, which alone are cleared
        own = torch.zeros(keys, row)
        if sent[0]:
            own[torch.tensor(sent[0], dtype=torch.int64)] = values[0]
        own[torch.randperm(keys, generator=torch.Generator().manual_seed(seed))[:3]] *= -1.0   # -0.0 rows
        into, count, _ = dense(row, keys, out=own.reshape(-1), stale=torch.tensor(sent[0], dtype=torch.int64))
        assert count == len(want) and torch.equal(into, expect)
        # divided there by an engine's n: the bits of dividing the whole sum
        into, _, _ = dense(row, keys, out=torch.full((keys * row,), float("nan")), divisor=3)
        assert torch.equal(into, expect / 3)
        # without the union's count (top-k allgathered): the same bits, None for the count
        into, count, _ = dense(row, keys, out=torch.full((keys * row,), float("nan")), divisor=3, count=False)
        assert count is None and torch.equal(into, expect / 3)
        assert torch.equal(dense(row, keys, count=False)[0], expect)


def test_dense_slot_sums_refuse_a_row_outside_the_table_on_the_cpu_leaving_out_as_it_was():
    """A gathered slot (a used one: unused slots are -1 and come last) or a stale row naming a row past
    the table, or a used slot below 0 (a rank's slots out of order), is a ValueError on the CPU, checked
    before a stale row is cleared or a slot added (the CUDA backend does not synchronise to check it)."""
    slots, _ = gathered({0: [1, 3], 1: [3]}, 8, 2, 2)
    bad_index = slots.clone()
    bad_index[1, 0, 0] = torch.tensor([8], dtype=torch.int32).view(torch.float32)
    interleaved = slots.clone()   # rank 1's unused slot first, its used one after it
    interleaved[1, [0, 1]] = interleaved[1, [1, 0]]
    for bad, stale in ((bad_index, torch.tensor([1])), (interleaved, torch.tensor([1])), (slots, torch.tensor([2, 8]))):
        out = torch.full((16,), 7.0)
        with pytest.raises(ValueError, match=r"outside \[0, keys\) \(keys = 8\)"):
            sum_slots_dense(bad, 2, 8, out=out, stale_rows=stale)
        assert torch.equal(out, torch.full((16,), 7.0))


def test_dense_slot_sums_divide_by_a_positive_int():
    """The divisor is a world size: 0, a negative, a float or a bool is a ValueError, not a silent cast."""
    slots, _ = gathered({0: [1, 3], 1: [3]}, 8, 2, 2)
    for bad in (0, -2, 2.0, True):
        with pytest.raises(ValueError, match="divisor must be a positive int"):
            sum_slots_dense(slots, 2, 8, divisor=bad)


@pytest.mark.parametrize("which", ROW_BACKENDS)
@pytest.mark.parametrize("divisor", [1, 2, 3, 8])
def test_dense_slot_sums_divide_each_sent_row_once_by_any_world_size(which, divisor):
    """An engine's average over 2 ranks (the smallest world it divides by) as over more: every row some
    rank sent, by one rank or several, is its rank-order sum divided once by the divisor; the count is the
    union's; with divisor 1 the sums as they are."""
    backend, device = row_backend(which)
    sent = {0: [1, 4, 6], 1: [4], 2: [0, 4, 6]}
    slots, values = gathered(sent, 8, 3, 3, seed=divisor)
    want = summed_in_rank_order(sent, values, 3)
    expect = torch.zeros(8, 3)
    for u in want:
        expect[u] = want[u] / divisor
    into, count = sum_slots_dense(slots.to(device), 3, 8, divisor=divisor, backend=backend)
    assert count == 4 and torch.equal(into.cpu(), expect)


def test_dense_slot_sums_of_a_row_one_rank_lists_twice_agree_on_the_cpu_and_cuda_ops():
    """Slots gather_slots never makes (a rank naming one row twice): the CPU kernel adds both and counts
    the row twice, as the CUDA backend's torch operations do, so the backends' counts and bits agree."""
    slots, _ = gathered({0: [1, 3, 5], 1: [3]}, 8, 2, 3)
    slots[0, 2, 0] = torch.tensor([3], dtype=torch.int32).view(torch.float32)   # rank 0: rows 1, 3, 3
    got = {}
    for which in ("cpu", "torch"):
        backend, _ = row_backend(which)
        got[which] = sum_slots_dense(slots, 2, 8, divisor=2, backend=backend)
    assert got["cpu"][1] == got["torch"][1] == 3   # rank 0's 1, 3, 3; rank 1's 3 already sent
    assert torch.equal(got["cpu"][0], got["torch"][0])


def test_dense_slot_sums_refuse_an_out_they_cannot_fill():
    """A buffer of another size, dtype or layout is a ValueError, not a partial or silently cast result."""
    slots, _ = gathered({0: [1, 3], 1: [3]}, 8, 2, 2)
    for bad in (torch.zeros(15), torch.zeros(16, dtype=torch.float64), torch.zeros(32)[::2]):
        with pytest.raises(ValueError, match="contiguous float32 tensor of 16 elements"):
            sum_slots_dense(slots, 2, 8, out=bad)


def test_the_cpu_slot_sums_read_strided_slots_and_refuse_an_out_of_another_layout():
    """CpuBackend.sum_row_slots reads gathered slots that are a strided view (here ranks along a larger
    gather's second dimension) to the bits of the contiguous ones, and refuses an ``out`` that is not a
    contiguous table (a ValueError, before its kernel would write through the pointer as if it were)."""
    backend = backend_for("cpu")
    slots, _ = gathered({0: [1, 3], 1: [3], 2: [0, 5]}, 8, 2, 2)
    strided = slots.transpose(0, 1).contiguous().transpose(0, 1)
    assert not strided.is_contiguous() and torch.equal(strided.contiguous().view(torch.int32), slots.view(torch.int32))
    want, got = torch.zeros(8, 2), torch.zeros(8, 2)
    assert backend.sum_row_slots(slots, want) == backend.sum_row_slots(strided, got) == 4
    assert torch.equal(got, want) and bool(want.any())
    out = torch.zeros(2, 8)
    with pytest.raises(ValueError, match="contiguous float32 out"):
        backend.sum_row_slots(slots, out.t())
    assert torch.equal(out, torch.zeros(2, 8))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_dense_slot_sums_add_in_rank_order_on_every_device(device):
    """Values for which another order changes the bits (1e8 + 1 - 1e8 is 0 in float32, 1e8 - 1e8 + 1 is
    1): sum_slots_dense adds rank by rank from 0, as sum_slots does (by its table of flags and by
    sorting), also with CUDA's atomic index_add_."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    sent = {0: [2, 7], 1: [7], 2: [], 3: [1, 2, 7, 9], 4: [7, 9]}
    slots, values = gathered(sent, 12, 3, 4)
    slots[0, 1, 1:], slots[1, 0, 1:], slots[3, 2, 1:] = 1e8, 1.0, -1e8   # row 7: ranks 0, 1, 3, then 4
    slots = slots.to(device)
    dense, count = sum_slots_dense(slots, 3, 12)
    assert count == 4
    assert torch.equal(dense[7].cpu(), values[4][0])   # (1e8 + 1) - 1e8 = 0, then rank 4's value
    for keys in (12, None):
        union, rows = sum_slots(slots, 3, keys)
        assert union.tolist() == [1, 2, 7, 9] and torch.equal(dense[union], rows)


@pytest.mark.parametrize("which", ROW_BACKENDS)
@pytest.mark.parametrize("n", [1, 2, 4, 7, 31, 2047])
def test_counting_bitmaps_sum_to_every_rows_count_and_list_the_union(n, which):
    """Each rank's counting bitmap (from its row indices, in any order and with a row listed twice, or from
    a bool per row), summed in float32 as an allreduce sums them, holds in digit j of word w how many
    ranks hold row w * per_word + j (counted here digit by digit), up to the largest base (n + 1 below
    2^22's field) and with every digit of a word at its largest; bitmap_rows lists the rows some rank
    holds from that sum, and from the average an engine's allreduce makes of it, at 1 to 3 threads."""
    backend, device = row_backend(which)
    keys = 1000
    gen = torch.Generator().manual_seed(n)
    held = torch.rand(n, keys, generator=gen) < 0.3
    held[:, :40] = True   # every rank holds rows 0..39: whole words of digit n
    held[:, 500:520] = False   # rows no rank holds
    pk = digit_packing(n, keys)
    total = torch.zeros(pk.words, device=device)
    for r in range(n):
        index = torch.nonzero(held[r]).reshape(-1)
        shuffled = torch.cat([index[torch.randperm(index.numel(), generator=gen)], index[:3]]).to(device)
        by_index = backend.bitmap_pack(keys, n, index=shuffled)
        assert by_index.dtype == torch.float32 and by_index.shape == (pk.words,)
        assert torch.equal(by_index, backend.bitmap_pack(keys, n, present=held[r].to(device), num_threads=2))
        total += by_index
    counts = torch.zeros(pk.words * pk.per_word, dtype=torch.int64)
    counts[:keys] = held.sum(dim=0)
    want_words = (counts.reshape(pk.words, pk.per_word) * pk.base ** torch.arange(pk.per_word)).sum(dim=1)
    assert torch.equal(total.cpu().to(torch.int64), want_words)
    union = torch.nonzero(held.any(dim=0)).reshape(-1)
    for threads in (1, 2, 3):
        assert torch.equal(backend.bitmap_rows(total, keys, n, 1.0, threads).cpu(), union)
        assert torch.equal(backend.bitmap_rows(total / n, keys, n, float(n), threads).cpu(), union)


@pytest.mark.parametrize("which", ROW_BACKENDS)
def test_a_bitmap_word_no_sum_of_bitmaps_holds_is_refused(which):
    """bitmap_rows returns None, on every backend alike, for a word outside [0, base^per_word), one that
    is not an integer in a sum, NaN, or a non-zero digit past the last row; a row index outside the rows
    is a ValueError on the CPU (the CUDA backend does not synchronise to check it)."""
    backend, device = row_backend(which)
    n, keys = 3, 100
    pk = digit_packing(n, keys)
    words = sum(backend.bitmap_pack(keys, n, index=torch.tensor(i, device=device)) for i in ([1, 5, 99], [5], [0, 98]))
    assert backend.bitmap_rows(words, keys, n).tolist() == [0, 1, 5, 98, 99]
    last_digit = pk.base ** ((keys - 1) % pk.per_word)   # row 99's digit in the last word
    for at, bad in ((2, -1.0), (2, float(pk.base ** pk.per_word)), (2, float("nan")), (2, 0.5),
                    (pk.words - 1, float(words[-1]) + pk.base * last_digit)):
        garbled = words.clone()
        garbled[at] = bad
        assert backend.bitmap_rows(garbled, keys, n) is None, (at, bad)
    assert backend.bitmap_rows(words / n + 0.4 / n, keys, n, float(n)).tolist() == [0, 1, 5, 98, 99]
    # an average's word within its 0.5 of rounding below base^per_word: a rounding of base^per_word, which no
    # sum holds (not a word of zero digits, its rows dropped)
    averaged = words / n
    averaged[2] = (pk.base ** pk.per_word - 0.25) / n
    assert backend.bitmap_rows(averaged, keys, n, float(n)) is None
    with pytest.raises(ValueError, match="float32 words"):
        backend.bitmap_rows(words[:-1], keys, n)
    if which == "cpu":
        with pytest.raises(ValueError, match="outside"):
            backend.bitmap_pack(keys, n, index=torch.tensor([3, keys]))
        with pytest.raises(ValueError, match="outside"):
            backend.bitmap_pack(keys, n, index=torch.tensor([-1]))


@pytest.mark.parametrize("which", ROW_BACKENDS)
def test_bitmaps_of_no_rows_sum_to_an_empty_list_not_a_refusal(which):
    """Ranks that hold no row pack all-zero words; their sum (or average) lists no rows: an empty int64
    tensor, on every backend alike, never the None of a word no sum of bitmaps holds."""
    backend, device = row_backend(which)
    for n, keys in ((3, 37), (1, 100), (7, 5000)):
        empty = backend.bitmap_pack(keys, n, index=torch.tensor([], dtype=torch.int64, device=device))
        assert torch.equal(empty.cpu(), torch.zeros(digit_packing(n, keys).words))
        for scale in (1.0, float(n)):
            rows = backend.bitmap_rows(empty * n / scale, keys, n, scale)
            assert rows is not None and rows.dtype == torch.int64 and rows.numel() == 0, (n, keys, scale)


def test_bitmap_rows_of_an_average_read_its_words_in_double_precision_on_the_cpu_and_cuda_ops():
    """An average's word times n, read in double precision as the CPU kernel reads it: 700050.875 * 3 is
    2100152.625, 2100153 to the nearest (row 22, the word's lowest digit, held), where float32's product,
    2100152.5, would round to even, 2100152 (row 22 dropped); the CUDA backend's torch operations list the
    CPU's rows."""
    n, keys = 3, 100
    words = torch.zeros(digit_packing(n, keys).words)
    words[2] = 700050.875
    assert float(words[2] * 3.0) == 2100152.5 and float(words[2].double() * 3.0) == 2100152.625
    got = {which: row_backend(which)[0].bitmap_rows(words, keys, n, float(n)) for which in ("cpu", "torch")}
    assert 22 in got["cpu"].tolist() and torch.equal(got["torch"], got["cpu"])


def test_a_summed_bitmap_word_out_of_range_is_a_configuration_mismatch():
    """A two-phase bitmap word no sum of this tensor's bitmaps can hold (negative, base^per_word or
    more, NaN: another plan's payload, a garbled one) is refused, not read as counts modulo the base."""
    from lossless_hc.training.aggregate import ConfigurationMismatch
    from lossless_hc.training.rows import TensorRows

    n, keys = 3, 100
    rows = TensorRows("emb", (keys, 4), torch.float32, n, 0, sparse=True)
    held = [torch.tensor([1, 5, 99]), torch.tensor([5]), torch.tensor([0, 5, 98])]
    words = sum(backend_for("cpu").bitmap_pack(keys, n, index=i) for i in held)
    assert rows._union_rows(words, averaged=False).tolist() == [0, 1, 5, 98, 99]
    assert rows._union_rows(words / n, averaged=True).tolist() == [0, 1, 5, 98, 99]
    pk = digit_packing(n, keys)
    for bad in (-1.0, float(pk.base ** pk.per_word), float("nan")):
        garbled = words.clone()
        garbled[2] = bad
        with pytest.raises(ConfigurationMismatch, match="outside"):
            rows._union_rows(garbled, averaged=False)
    with pytest.raises(ConfigurationMismatch, match="words, expected"):
        rows._union_rows(words[:-1], averaged=False)


@pytest.mark.parametrize("which", ROW_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("row", [1, 2, 4, 5, 32])
def test_the_row_scan_finds_every_row_holding_a_non_zero(dtype, row, which):
    """The backend's row scan (AutoAggregator's non-zero rows of a dense gradient) against torch's
    element-wise tests: -0.0 is zero; NaN, infinities, the smallest subnormal, a row of negative values and
    one whose values sum to 0 are not; at every thread count (the tensors are large enough for three threads,
    so rows are split between them), on every backend."""
    backend, device = row_backend(which)
    rows = (1 << 17) + 3
    gen = torch.Generator().manual_seed(row)
    x = torch.zeros(rows, row, dtype=dtype)
    hit = torch.randperm(rows, generator=gen)[:3000]
    x[hit, torch.randint(0, row, (3000,), generator=gen)] = torch.randn(3000, generator=gen).to(dtype)
    x[7:13] = 0.0
    x[7, row - 1] = -0.0
    x[8, 0] = float("nan")
    x[9, row // 2] = float("-inf")
    x.view(torch.int16 if dtype.itemsize == 2 else torch.int32 if dtype.itemsize == 4 else torch.int64)[10, 0] = 1
    x[11, 0] = -1.5   # below zero, the row's others +0.0 (where it has others)
    x[12, 0], x[12, row - 1] = (2.5, -2.5) if row > 1 else (-2.5, -2.5)   # a row summing to 0 (where it has two)
    x[rows - 1, row - 1] = 1.0   # the last word of the last row
    want = ((x != 0) | torch.isnan(x)).any(dim=1)
    assert want.tolist()[7:13] == [False, True, True, True, True, True] and want[rows - 1]
    for threads in (1, 2, 3):
        got = backend.nonzero_rows(x.reshape(-1).to(device), row, threads)
        assert torch.equal(got.cpu(), want), threads
        # ... and with the rows it found listed (the planner's scan of a gradient): torch.nonzero's list
        present, index = backend.nonzero_row_index(x.reshape(-1).to(device), row, threads)
        assert torch.equal(present.cpu(), want), threads
        assert index.dtype == torch.int64 and torch.equal(index.cpu(), torch.nonzero(want).reshape(-1)), threads


@pytest.mark.parametrize("which", ROW_BACKENDS)
@pytest.mark.parametrize("rows", [0, 1, 7, 8, 9, 64, 1001])
def test_the_row_scan_lists_no_row_every_row_or_a_few_alike(which, rows):
    """nonzero_row_index at the edges of its eight-flags-a-word listing: no row, every row, and rows at
    a word's first and last flag and past the last whole word."""
    backend, device = row_backend(which)
    for held in ([], list(range(rows)), sorted({0, rows // 2, rows - 1, 7 % max(rows, 1)} & set(range(rows)))):
        x = torch.zeros(rows, 3)
        x[held, 1] = 1.5
        present, index = backend.nonzero_row_index(x.reshape(-1).to(device), 3)
        assert index.tolist() == held and present.cpu().tolist() == [r in held for r in range(rows)]


@pytest.mark.parametrize("which", ROW_BACKENDS)
def test_the_row_scan_refuses_what_it_cannot_read(which):
    """A row that does not divide the tensor (or of no elements), integers or a strided tensor: the same
    ValueError or TypeError on every backend, from the scan and from its listing alike."""
    backend, device = row_backend(which)
    assert backend.nonzero_rows(torch.zeros(0, device=device), 4).shape == (0,)
    assert backend.nonzero_row_index(torch.zeros(0, device=device), 4)[1].shape == (0,)
    for scan in (backend.nonzero_rows, backend.nonzero_row_index):
        with pytest.raises(ValueError, match="dividing x.numel"):
            scan(torch.zeros(10, device=device), 3)
        with pytest.raises(ValueError, match="dividing x.numel"):
            scan(torch.zeros(10, device=device), 0)
        with pytest.raises(TypeError, match="contiguous tensor of 2-, 4- or 8-byte floats"):
            scan(torch.zeros(10, dtype=torch.int32, device=device), 2)
        with pytest.raises(TypeError, match="contiguous tensor of 2-, 4- or 8-byte floats"):
            scan(torch.zeros(20, device=device)[::2], 2)


def slots_by_loop(index: list, rows: torch.Tensor, k: int) -> torch.Tensor:
    """The allgather slots written one word at a time: an int32 label's bits, then the row in float32;
    unused slots -1 and zeros."""
    row = rows.shape[1]
    out = torch.zeros(k, 1 + row, dtype=torch.float32)
    for s in range(k):
        label = index[s] if s < len(index) else -1
        out[s, 0] = torch.tensor([label], dtype=torch.int32).view(torch.float32)[0]
        if s < len(index):
            out[s, 1:] = rows[s].to(torch.float32)
    return out.reshape(-1)


@pytest.mark.parametrize("which", ROW_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("keys,row,m,k", [(50, 4, 7, 7), (50, 4, 7, 12), (1000, 32, 87, 100), (9, 1, 0, 3),
                                          (9, 1, 9, 9)])
def test_row_slots_hold_a_rank_s_rows_then_unused_slots_on_every_backend(which, dtype, keys, row, m, k):
    """A rank's allgather slots from its table's rows read in place, or from its rows' values given:
    bit for bit the slots written one word at a time (the row index's bits, the values in float32, then
    -1 and zeros), on every backend; NaN, infinities and -0.0 travel as they are."""
    backend, device = row_backend(which)
    gen = torch.Generator().manual_seed(keys + m)
    table = torch.randn(keys, row, generator=gen).to(dtype)
    table[0, 0], table[-1, -1] = float("nan"), float("-inf")
    table[keys // 2, 0] = -0.0
    index = torch.randperm(keys, generator=gen)[:m].sort().values
    want = slots_by_loop(index.tolist(), table[index], k)

    def same(got: torch.Tensor) -> bool:   # labels' and values' bits, but for a NaN's payload
        got, w = got.cpu().reshape(k, 1 + row), want.reshape(k, 1 + row)
        values_nan = torch.isnan(w[:, 1:])
        return (got.dtype == torch.float32 and torch.equal(got[:, 0].view(torch.int32), w[:, 0].view(torch.int32))
                and torch.equal(torch.isnan(got[:, 1:]), values_nan)
                and torch.equal(got[:, 1:][~values_nan].view(torch.int32), w[:, 1:][~values_nan].view(torch.int32)))
    assert same(backend.row_slots(index.to(device), k, table=table.to(device)))
    assert same(backend.row_slots(index.to(device), k, values=table[index].to(device)))
    assert same(gather_slots(index, table[index], k, row))   # the CPU backend's, by the index's device


@pytest.mark.parametrize("which", ROW_BACKENDS)
def test_row_slots_refuse_more_rows_than_slots_and_a_row_outside_the_table(which):
    """More rows than slots, both or neither of a table and values, values of another row count, an index
    of floats, bools or uint8 (torch's masks) or a bool for ``k``: a ValueError on every backend; a row outside
    the table or a negative one: a ValueError on the CPU (CUDA does not check, which would synchronise its
    stream)."""
    backend, device = row_backend(which)
    table = torch.ones(10, 2, device=device)
    index = torch.tensor([1, 4, 9], device=device)
    with pytest.raises(ValueError, match="k must be an int >= the 3 rows"):
        backend.row_slots(index, 2, table=table)
    with pytest.raises(ValueError, match="from a table or from values"):
        backend.row_slots(index, 3)
    with pytest.raises(ValueError, match="from a table or from values"):
        backend.row_slots(index, 3, table=table, values=table[:3])
    with pytest.raises(ValueError, match="values must be a 2-D float tensor of 3 rows"):
        backend.row_slots(index, 3, values=table[:2])
    for mask_like in (index.float(), torch.ones(3, dtype=torch.bool, device=device),
                      torch.tensor([1, 4, 9], dtype=torch.uint8, device=device)):   # bool and uint8: masks in torch
        with pytest.raises(ValueError, match="index must be a 1-D tensor of integer rows"):
            backend.row_slots(mask_like, 3, table=table)
    with pytest.raises(ValueError, match="k must be an int"):
        backend.row_slots(index[:1], True, table=table)   # a bool is no count of slots
    if which == "cpu":
        for bad in ([1, 4, 10], [-1, 4, 9]):
            for t in (table, table.to(torch.bfloat16)):
                with pytest.raises(ValueError, match="outside"):
                    backend.row_slots(torch.tensor(bad), 3, table=t)


def test_row_slots_label_the_largest_int32_row_and_refuse_the_next_on_the_cpu():
    """A slot's label is an int32: row 2^31 - 1 (a rank's values given, no table that large) is labelled
    with its bits; row 2^31, which no int32 holds, is a ValueError, not a wrapped label."""
    backend = backend_for("cpu")
    values = torch.tensor([[1.5, -2.0], [0.25, 3.0]])
    slots = backend.row_slots(torch.tensor([0, (1 << 31) - 1]), 3, values=values).reshape(3, 3)
    assert slots[:, 0].view(torch.int32).tolist() == [0, (1 << 31) - 1, -1]
    assert torch.equal(slots[:2, 1:], values)
    with pytest.raises(ValueError, match="outside"):
        backend.row_slots(torch.tensor([0, 1 << 31]), 3, values=values)


@pytest.mark.parametrize("which", ROW_BACKENDS)
def test_bitmap_pack_reads_rows_as_their_values_or_refuses_them_alike(which):
    """Every backend packs an index that is a negative view as its values (torch's indexing ignores the
    bit: the CUDA backend packed rows 24 and 34 for [10, 20]) and refuses what is no bool per row (one
    bool broadcast to every row, a count of 2, fractions) or no integer rows (floats, bools, uint8 masks)."""
    backend, device = row_backend(which)
    keys, n = 37, 3
    plain = backend.bitmap_pack(keys, n, index=torch.tensor([10, 20], device=device))
    assert torch.equal(backend.bitmap_pack(keys, n, index=torch._neg_view(torch.tensor([-10, -20], device=device))),
                       plain)
    present = torch.zeros(keys, dtype=torch.bool, device=device)
    present[[10, 20]] = True
    assert torch.equal(backend.bitmap_pack(keys, n, present=present), plain)
    for bad in (torch.tensor([True]), torch.tensor([2] + [0] * (keys - 1)), torch.full((keys,), 0.5)):
        with pytest.raises(ValueError, match="present must be a bool per row"):
            backend.bitmap_pack(keys, n, present=bad.to(device))
    for bad in (torch.tensor([2.0]), torch.tensor([False, True]), torch.tensor([3, 5], dtype=torch.uint8)):
        with pytest.raises(ValueError, match="index must be a tensor of integer rows"):
            backend.bitmap_pack(keys, n, index=bad.to(device))


@pytest.mark.parametrize("shape,sparse,row,keys", [
    ((100, 4), True, 4, 100), ((100,), True, 1, 100), ((6, 2, 3), True, 6, 6),
    ((0, 3), True, 3, 0), ((5, 0), True, 1, 0),   # a row has at least one element, as the row scan and slots take
    ((20, 7), False, 7, 20), ((3, 4, 5), False, 1, 60), ((0,), False, 1, 0), ((0, 5), False, 5, 0)])
def test_tensor_rows_split_a_gradient_into_keys_rows_of_row_elements(shape, sparse, row, keys):
    """A sparse gradient's rows are its first dimension, a dense one's keys of default_block_size; keys * row is
    every element, and a gradient of no elements has no rows (not one row of none)."""
    from lossless_hc.training.rows import TensorRows

    rows = TensorRows("g", shape, torch.float32, 2, 1, sparse=sparse)
    assert (rows.row, rows.keys) == (row, keys)
    assert rows.keys * rows.row == rows.numel or rows.numel == 0 == rows.keys


def test_tensor_rows_refuse_a_gradient_of_another_shape_or_dtype_alone():
    """A gradient whose shape alone, or dtype alone, differs from the one the rows were built for is a
    ValueError (either would be read as another table), a sparse one for a dense layout a TypeError."""
    from lossless_hc.training.rows import TensorRows

    rows = TensorRows("g", (8, 4), torch.float32, 2, 0, sparse=False)
    rows._check_input(torch.zeros(8, 4))
    for bad in (torch.zeros(4, 8), torch.zeros(8, 4, dtype=torch.float64), torch.zeros(32)):
        with pytest.raises(ValueError, match="expected"):
            rows._check_input(bad)
    with pytest.raises(TypeError, match="sparse"):
        rows._check_input(torch.zeros(8, 4).to_sparse())


def test_the_union_of_a_summed_gradient_counts_its_non_zero_rows_and_none_of_an_empty_one():
    """_union_of (the rows some rank holds, read from a dense sum) counts the rows holding an element other
    than +-0.0, NaN included, and is 0 for a gradient of no elements."""
    from lossless_hc.training.rows import TensorRows

    rows = TensorRows("g", (6, 3), torch.float32, 2, 0, sparse=False)
    value = torch.zeros(6, 3)
    value[1, 2], value[4, 0], value[5, 1] = 2.0, float("nan"), -0.0
    assert rows._union_of(value) == 2
    assert rows._union_of(torch.zeros(6, 3)) == 0
    for shape, sparse in (((0,), False), ((0, 4), True)):
        empty = TensorRows("e", shape, torch.float32, 2, 0, sparse=sparse)
        assert empty._union_of(torch.zeros(shape)) == 0


def test_a_rank_s_values_on_the_union_s_rows_are_zero_where_it_holds_none():
    """_on_rows: this rank's values on sorted rows (the union some rank holds), float32, a zero row where it
    holds none, for a sparse rank's listed rows and a dense rank's gradient alike; no rows asked, none given
    (even where the rank holds some)."""
    from lossless_hc.training.rows import TensorRows
    from lossless_hc.training.step import AutoContext

    values = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]], dtype=torch.float64)
    index = torch.tensor([2, 5, 9])
    asked = torch.tensor([1, 2, 9, 11])
    want = torch.tensor([[0.0, 0.0], [1.0, 2.0], [5.0, 6.0], [0.0, 0.0]])
    sparse = TensorRows("emb", (12, 2), torch.float64, 2, 0, sparse=True)
    ctx = AutoContext("two_phase", 0.0, 0, index=index, values=values)
    got = sparse._on_rows(ctx, asked)
    assert got.dtype == torch.float32 and torch.equal(got, want)
    assert sparse._on_rows(ctx, torch.zeros(0, dtype=torch.int64)).shape == (0, 2)
    none = AutoContext("two_phase", 0.0, 0, index=torch.zeros(0, dtype=torch.int64), values=torch.zeros(0, 2))
    assert torch.equal(sparse._on_rows(none, asked), torch.zeros(4, 2))
    dense = TensorRows("w", (12, 2), torch.float64, 2, 0, sparse=False)
    flat = torch.zeros(12, 2, dtype=torch.float64)
    flat[index] = values
    assert torch.equal(dense._on_rows(AutoContext("two_phase", 0.0, 0, flat=flat.reshape(-1)), asked), want)
