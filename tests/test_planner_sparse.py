"""The planner over sparse gradients (a COO tensor of rows, as DDP hands over nn.Embedding(sparse=True)'s
gradient): every exact strategy's result is the coalesced sparse tensor of the rows some rank listed,
equal to the float64 dense sum; the cost model prices the sparse input (no scan, the bitmap the dense
strategies carry, no lossy candidates). Collectives in-process, as in tests/test_planner.py."""
import pytest
import torch

from test_planner import on_each_payload, run_step

from lossless_hc.lhc.contract import outside_contract, truth
from lossless_hc.training.planner import DEFAULT_CODEC_SECONDS, EXACT_STRATEGIES, Calibration, CostModel, LinkModel
from lossless_hc.training.plan_stats import TensorStats, bitmap_words
import lossless_hc.training.strategies as strategies
from lossless_hc.training.strategies import AutoAggregator

MODEL = CostModel(Calibration.default(bandwidth_bits=1e9))
ROWS, DIM, N = 400, 8, 3


def sparse_grad(rng, rows, dim, listed, zero_rows=()):
    """A COO gradient listing ``listed`` rows (random values, uncoalesced: each row split in two entries)
    and ``zero_rows`` listed with zero values, as an embedding's backward can give."""
    idx = torch.as_tensor(list(listed) + list(zero_rows), dtype=torch.int64)
    vals = torch.randn(idx.numel(), dim, generator=rng)
    vals[len(listed):] = 0
    half = vals / 2
    return torch.sparse_coo_tensor(torch.cat([idx, idx]).reshape(1, -1), torch.cat([half, vals - half]),
                                   (rows, dim), check_invariants=True)


def supports(step):
    """Per rank: rank 0 lists nothing, ranks 1 and 2 overlap in a hot set and have disjoint tails."""
    hot = list(range(10 + step))
    return [[], hot + list(range(100, 130 + 5 * step)), hot + list(range(300, 310))]


def aggregators(strategy, n=N, **kw):
    return [AutoAggregator("emb", (ROWS, DIM), torch.float32, n, r, MODEL, first=strategy, allowed=(strategy,),
                           interval=2, sparse=True, **kw) for r in range(n)]


@pytest.mark.parametrize("strategy", EXACT_STRATEGIES)
@pytest.mark.parametrize("average", [False, True])
def test_every_exact_strategy_returns_the_union_rows_of_the_exact_sum(strategy, average):
    rng = torch.Generator().manual_seed(5)
    aggs = aggregators(strategy)
    unions = []   # the union each step's statistics report to the planner (rank 0's tracker)
    observe = aggs[0].tracker.observe
    aggs[0].tracker.observe = lambda keys, union, step=None: unions.append(union) or observe(keys, union, step)
    for step in range(4):
        xs = [sparse_grad(rng, ROWS, DIM, rows, zero_rows=[390 + r] if r else [])
              for r, rows in enumerate(supports(step))]
        truth = torch.stack([x.to_dense().double() for x in xs]).sum(0) / (N if average else 1)
        listed = sorted(set().union(*[set(x.coalesce().indices()[0].tolist()) for x in xs]))
        ys = run_step(aggs, xs, average)
        assert unions.pop() == len(listed) and not unions   # the listed rows, the all-zero ones included
        for y in ys:
            assert y.is_sparse and y.is_coalesced() and y.shape == (ROWS, DIM) and y.dtype == torch.float32
            assert y.indices()[0].tolist() == listed   # a listed all-zero row stays listed, as DDP's sparse allreduce
            assert torch.allclose(y.to_dense().double(), truth, rtol=0, atol=1e-5)
            assert torch.equal(y.values(), ys[0].values())   # every rank decodes the same bits
        assert all(a.strategy == strategy for a in aggs)
    assert aggs[0].tracker.rank_keys is not None and aggs[0].plan_stats()["bytes_sent"] > 0


def test_sparse_and_dense_gradients_of_the_same_rows_give_the_same_aggregate():
    """The dense path scans for the rows the sparse path is handed; both then run the same machinery."""
    rng = torch.Generator().manual_seed(6)
    for strategy in EXACT_STRATEGIES:
        xs = [sparse_grad(rng, ROWS, DIM, rows) for rows in supports(2)]
        sparse = run_step(aggregators(strategy), xs)
        dense_aggs = [AutoAggregator("emb", (ROWS, DIM), torch.float32, N, r, MODEL, first=strategy,
                                     allowed=(strategy,)) for r in range(N)]
        dense = run_step(dense_aggs, [x.to_dense() for x in xs])
        assert torch.equal(sparse[0].to_dense(), dense[0]), strategy


def test_no_rank_lists_a_row():
    rng = torch.Generator().manual_seed(7)
    for strategy in EXACT_STRATEGIES:
        ys = run_step(aggregators(strategy), [sparse_grad(rng, ROWS, DIM, []) for _ in range(N)])
        assert all(y.is_sparse and y._nnz() == 0 for y in ys), strategy


def test_where_no_rank_has_a_row_allgather_and_two_phase_make_no_second_collective():
    """No rank with a non-zero (dense) or listed (sparse) row: K = 0 slots, an empty union. allgather and
    two_phase then decode from the first payload alone, requesting nothing (module doc: K is the largest
    rank's count; the union's rows), and every rank's value is the zero sum."""
    rng = torch.Generator().manual_seed(9)
    for sparse in (False, True):
        for strategy in ("allgather", "two_phase"):
            aggs = [AutoAggregator("emb", (ROWS, DIM), torch.float32, N, r, MODEL, first=strategy,
                                   allowed=(strategy,), sparse=sparse) for r in range(N)]
            xs = [sparse_grad(rng, ROWS, DIM, []) if sparse else torch.zeros(ROWS, DIM) for _ in range(N)]
            encoded = [a.encode(x) for a, x in zip(aggs, xs)]
            summed = sum(p for p, _ in encoded)
            for a, (_, ctx) in zip(aggs, encoded):
                out = a.decode(summed, ctx)
                assert out.request is None, (sparse, strategy)
                y = out.value
                assert (y._nnz() == 0 if sparse else torch.equal(y, torch.zeros(ROWS, DIM))), (sparse, strategy)


def test_the_first_step_of_a_sparse_gradient_is_allgather_and_lossy_is_not_offered():
    agg = AutoAggregator("emb", (ROWS, DIM), torch.float32, N, 0, MODEL, lossy=True, sparse=True)
    assert agg.strategy == "allgather" and agg.allowed == EXACT_STRATEGIES
    assert AutoAggregator("emb", (ROWS, DIM), torch.float32, N, 0, MODEL).strategy == "dense"


def test_layout_changes_and_unsupported_sparse_tensors_are_refused():
    rng = torch.Generator().manual_seed(8)
    sparse_agg = AutoAggregator("emb", (ROWS, DIM), torch.float32, N, 0, MODEL, sparse=True)
    with pytest.raises(TypeError, match="built for sparse"):
        sparse_agg.encode(torch.zeros(ROWS, DIM))
    dense_agg = AutoAggregator("emb", (ROWS, DIM), torch.float32, N, 0, MODEL)
    with pytest.raises(TypeError, match="built for dense"):
        dense_agg.encode(sparse_grad(rng, ROWS, DIM, [1, 2]))
    with pytest.raises(TypeError, match="sparse dimensions"):
        sparse_agg.encode(torch.zeros(ROWS, DIM).to_sparse(sparse_dim=2))


@pytest.mark.parametrize("strategy", ["two_phase", "allgather", "dense", "sketch"])
def test_a_sparse_gradient_listing_rows_past_the_table_is_refused(strategy):
    """torch builds a sparse tensor without checking its indices (check_invariants off by default):
    two_phase dropped a row listed past the table (its bitmap's padding), allgather returned a tensor
    listing it, the others failed inside indexing. Now a ValueError naming the row, whatever the plan."""
    agg = AutoAggregator("emb", (ROWS, DIM), torch.float32, N, 0, MODEL, sparse=True, first=strategy,
                         allowed=(strategy,))
    for row in (ROWS, ROWS + 5, -1):
        bad = torch.sparse_coo_tensor(torch.tensor([[1, row]]), torch.ones(2, DIM), (ROWS, DIM), check_invariants=False)
        with pytest.raises(ValueError, match=f"lists row {row} of a table of {ROWS} rows"):
            agg.encode(bad)


# -- the cost model -------------------------------------------------------------------------------------

def stats(sparse, numel=1 << 20, row=32, n=4, k=512, union=1500):
    return TensorStats(numel, row, n, (k,) * n, union, 4, sparse)


def test_a_sparse_gradient_has_no_scan_cost_and_the_dense_strategies_carry_the_bitmap():
    dense, sparse = stats(False), stats(True)
    per_coord = {s: DEFAULT_CODEC_SECONDS[s][0] for s in EXACT_STRATEGIES}
    d, D = dense.numel, dense.keys
    p_dense, p_sparse = ({s: MODEL.predict(s, st) for s in EXACT_STRATEGIES} for st in (dense, sparse))
    bitmap = 4 * bitmap_words(D, 4)
    link = MODEL.calibration.link
    assert p_dense["allgather"] - p_sparse["allgather"] == pytest.approx(per_coord["allgather"] * d)
    assert p_dense["two_phase"] - p_sparse["two_phase"] == pytest.approx(per_coord["two_phase"] * (d - D))
    for s in ("dense", "sketch"):
        assert MODEL.wire_bytes(s, sparse) == MODEL.wire_bytes(s, dense) + bitmap
        extra = link.allreduce(MODEL.wire_bytes(s, sparse), 4) - link.allreduce(MODEL.wire_bytes(s, dense), 4)
        assert p_sparse[s] - p_dense[s] == pytest.approx(extra + per_coord[s] * D)
    assert set(MODEL.choose(sparse, lossy=True)[1]) == set(EXACT_STRATEGIES)


def test_the_choice_for_a_sparse_gradient_can_differ_from_the_dense_one():
    """A machine where scanning is slow beside the link: for a dense gradient every row strategy pays
    the scan and dense wins; the sparse gradient's rows come listed, and allgather wins."""
    codec = dict(DEFAULT_CODEC_SECONDS, allgather=(2e-8, 2e-9), two_phase=(4e-8, 2e-9), sketch=(2e-8, 15e-9))
    model = CostModel(Calibration(LinkModel(50e-6, 8 / 10e9), codec))
    assert model.choose(stats(False, k=4000, union=12000))[0] == "dense"
    assert model.choose(stats(True, k=4000, union=12000))[0] == "allgather"


def test_sketch_reaggregates_inexact_rows_alone():
    """Rows whose coordinates span three orders of magnitude: the sketch's decode reports keys it cannot
    prove within rtol (INEXACT); only those rows go out again (one allreduce of their values), the rest
    is read from the sketch, and no step falls back to the dense tensor once the sketch is sized."""
    rng = torch.Generator().manual_seed(9)
    for sparse in (True, False):
        aggs = [AutoAggregator("emb", (ROWS, DIM), torch.float32, N, r, MODEL, first="sketch", allowed=("sketch",),
                               interval=1, sparse=sparse) for r in range(N)]
        for step in range(4):
            xs = []
            for rows in supports(step):
                x = sparse_grad(rng, ROWS, DIM, rows).coalesce()
                scale = 10.0 ** -(3 * torch.rand(x.values().shape, generator=rng))
                x = torch.sparse_coo_tensor(x.indices(), x.values() * scale, x.shape, check_invariants=True)
                xs.append(x if sparse else x.to_dense())
            truth = torch.stack([x.to_dense().double() for x in xs]).sum(0)
            fallbacks = aggs[0].fallbacks
            for y in run_step(aggs, xs):
                y = y.to_dense() if sparse else y
                assert torch.allclose(y.double(), truth, rtol=2 ** -10, atol=1e-7)
            if step:
                assert aggs[0].fallbacks == fallbacks   # sized: inexact rows re-aggregated, never the whole tensor
        st = aggs[0].stats
        assert st.partial_fallbacks >= 2 and st.inexact_keys >= st.partial_fallbacks, st
        assert st.inexact_decodes == st.partial_fallbacks, st   # every inexact decode here re-aggregated its rows alone
        # the inexact rows' allreduce counts in the bytes sent, as every other collective does
        assert st.payload_bytes == aggs[0].bytes_sent


def first_inexact_sketch_step():
    """``(coordinates re-aggregated alone, partial re-aggregations, fallbacks)`` of the first step whose
    sketch decode reports inexact rows, over test_sketch_reaggregates_inexact_rows_alone's steps on dense
    gradients."""
    rng = torch.Generator().manual_seed(9)
    aggs = [AutoAggregator("emb", (ROWS, DIM), torch.float32, N, r, MODEL, first="sketch", allowed=("sketch",),
                           interval=1) for r in range(N)]
    requests = []   # the coordinates of rank 0's partial requests
    aggs[0]._at_coordinates = lambda ctx, c, at=aggs[0]._at_coordinates: requests.append(c.numel()) or at(ctx, c)
    for step in range(4):
        xs = []
        for rows in supports(step):
            x = sparse_grad(rng, ROWS, DIM, rows).coalesce()
            scale = 10.0 ** -(3 * torch.rand(x.values().shape, generator=rng))
            xs.append(torch.sparse_coo_tensor(x.indices(), x.values() * scale, x.shape, check_invariants=True).to_dense())
        fallbacks = aggs[0].stats.fallbacks
        run_step(aggs, xs)
        st = aggs[0].stats
        if st.inexact_decodes:
            return sum(requests), st.partial_fallbacks, st.fallbacks - fallbacks
    raise AssertionError("no inexact decode")


def test_inexact_rows_covering_exactly_the_partial_bound_are_re_aggregated_alone(monkeypatch):
    """A sketch decode's inexact rows' unproven coordinates are re-aggregated alone while they are at most
    PARTIAL_MAX_FRACTION of the tensor, at the bound too; with one coordinate fewer allowed the step falls
    back densely."""
    numel = ROWS * DIM
    m, partial, fallback = first_inexact_sketch_step()
    assert (partial, fallback) == (1, 0) and m >= 1 and (m / numel) * numel == m
    monkeypatch.setattr(strategies, "PARTIAL_MAX_FRACTION", m / numel)
    assert first_inexact_sketch_step() == (m, 1, 0)
    monkeypatch.setattr(strategies, "PARTIAL_MAX_FRACTION", (m - 1) / numel)
    assert first_inexact_sketch_step() == (0, 0, 1)


@pytest.mark.parametrize("strategy", EXACT_STRATEGIES)
def test_an_engine_summing_sparse_tensors_itself_gets_the_allgather_plan_s_plain_steps(strategy):
    """native_sparse (DDP over Gloo): an allgather plan carries its statistics on the interval's steps only,
    and between them the engine sums the bare sparse gradient (encode refuses it; record_plain_step
    counts at most 8 + 4 b bytes per listed row); every other plan carries them on every step."""
    rng = torch.Generator().manual_seed(2)
    aggs = aggregators(strategy)
    for a in aggs:
        a.native_sparse = True
    carried = []
    for step in range(6):
        carry = aggs[0].carries_statistics()
        assert all(a.carries_statistics() == carry for a in aggs)
        carried.append(carry)
        xs = [sparse_grad(rng, ROWS, DIM, s) for s in supports(step)]
        if carry:
            run_step(aggs, xs)
            continue
        with pytest.raises(RuntimeError, match="native_sparse"):
            aggs[0].encode(xs[0])
        for a, x in zip(aggs, xs):
            before = (a.bytes_sent, a.stats.compressed, a.stats.sent_dense)
            a.record_plain_step(0.0, sparse_rows=x._nnz())
            assert a.bytes_sent - before[0] == x._nnz() * (8 + 4 * DIM)
            # the listed rows, not the dense tensor: counted as compressed
            assert (a.stats.compressed - before[1], a.stats.sent_dense - before[2]) == (1, 0)
    # interval 2: the first step, then step counts 2, 4 (the 1-based count of the step that follows)
    assert carried == ([True, True, False, True, False, True] if strategy == "allgather" else [True] * 6)
    assert aggs[1].plan_stats()["plain_steps"] == carried.count(False)


def test_a_native_sparse_step_recorded_later_is_timed_to_when_its_sum_arrived():
    """record_plain_step(sparse_rows=, ended=): the engine's own sparse allreduce, accounted after its sum
    arrived, is timed to that arrival under the allgather strategy, not to when it is accounted."""
    agg = AutoAggregator("emb", (ROWS, DIM), torch.float32, N, 0, MODEL, sparse=True)
    agg.record_plain_step(10.0, sparse_rows=7, ended=12.5)
    assert agg.plan_stats()["measured_seconds"] == {"allgather": 2.5}
    assert agg.bytes_sent == 7 * (8 + 4 * DIM) and (agg.steps, agg.plain_steps) == (1, 1)


def test_allgather_finish_clears_only_the_scanned_rows_of_the_scanned_memory_itself():
    """finish(out=) on an allgather plan clears only this rank's rows when out is the memory it scanned
    (the rest holds +-0.0); a strided gradient starting at out's address is not that memory: out is then
    cleared whole (only the rows were, and out's other values went into the sum)."""
    n, numel = 2, 1000
    aggs = [AutoAggregator("w", (numel,), torch.float32, n, r, MODEL, first="allgather", allowed=("allgather",))
            for r in range(n)]
    g = torch.Generator().manual_seed(0)
    memory = []
    for _ in range(n):
        buf = torch.zeros(2 * numel)
        buf[torch.randperm(2 * numel, generator=g)[:100]] = torch.randn(100, generator=g)
        memory.append(buf)
    xs = [buf[::2] for buf in memory]   # 1-D and strided: data_ptr is buf's, as is out's below
    want = xs[0] + xs[1]
    encoded = [a.encode(x) for a, x in zip(aggs, xs)]
    summed = encoded[0][0] + encoded[1][0]
    outcomes = [a.decode(summed, ctx) for a, (_, ctx) in zip(aggs, encoded)]
    assert outcomes[0].request.kind == "allgather"
    gathered = torch.stack([o.request.tensor.reshape(-1) for o in outcomes])
    value = aggs[0].finish(encoded[0][1], gathered.clone(), out=memory[0][:numel])
    assert value.data_ptr() == memory[0].data_ptr() and torch.equal(value, want)


@pytest.mark.parametrize("strategy", EXACT_STRATEGIES)
def test_payload_numel_of_a_sparse_gradient_is_the_size_of_its_next_first_payload(strategy):
    """payload_numel for a sparse gradient: dense and the sketch carry the union's bitmap after the header
    (their bodies are dense), so their first payload is header + bitmap + body, as encode makes it."""
    aggs = aggregators(strategy)
    rng = torch.Generator().manual_seed(5)
    sizes = []
    on_each_payload(aggs, lambda r, payload: sizes.append(payload.numel()))
    for step in range(3):
        expected = [a.payload_numel() for a in aggs]
        run_step(aggs, [sparse_grad(rng, ROWS, DIM, rows) for rows in supports(step)])
        assert sizes[-len(aggs):] == expected, step


def test_the_inexact_rows_a_sketch_re_aggregates_are_the_exact_sums():
    """A sketch step whose decode reports inexact rows: finish writes the exact sums of their unproven
    coordinates (the allreduce of each rank's values there) over the decoded ones, so they equal the float64
    sum rounded once, bit for bit, where the decoded values were only within rtol; fewer than the rows'
    coordinates, and every coordinate is within the contract."""
    rng = torch.Generator().manual_seed(9)
    aggs = [AutoAggregator("emb", (ROWS, DIM), torch.float32, N, r, MODEL, first="sketch", allowed=("sketch",),
                           interval=1) for r in range(N)]
    for step in range(4):   # first_inexact_sketch_step's steps
        xs = []
        for rows in supports(step):
            x = sparse_grad(rng, ROWS, DIM, rows).coalesce()
            scale = 10.0 ** -(3 * torch.rand(x.values().shape, generator=rng))
            xs.append(torch.sparse_coo_tensor(x.indices(), x.values() * scale, x.shape, check_invariants=True).to_dense())
        encoded = [a.encode(x) for a, x in zip(aggs, xs)]
        summed = torch.stack([p.double() for p, _ in encoded]).sum(0).to(encoded[0][0].dtype)
        outcomes = [a.decode(summed.clone(), ctx) for a, (_, ctx) in zip(aggs, encoded)]
        if outcomes[0].request is None:
            continue
        result = torch.stack([o.request.tensor.double() for o in outcomes]).sum(0).float()
        if encoded[0][1].partial is None:   # the first step's dense fallback (the sketch not sized yet)
            for a, (_, ctx) in zip(aggs, encoded):
                a.finish(ctx, result.clone())
            continue
        coords = encoded[0][1].partial[1]
        rows = aggs[0].stats.inexact_keys
        assert 0 < coords.numel() < rows * DIM and torch.equal(coords, torch.unique(coords))
        s, a = truth(xs)
        for agg, (_, ctx) in zip(aggs, encoded):
            y = agg.finish(ctx, result.clone()).reshape(-1)
            assert torch.equal(y[coords], s.float()[coords]), step
            assert not outside_contract(y, s, a, N, 2.0 ** -10).any()
        return
    raise AssertionError("no inexact decode")


@pytest.mark.parametrize("strategy", ["allgather", "topk_allgather"])
def test_a_float32_gradient_s_gathered_sum_is_written_into_out_divided_by_divisor(strategy):
    """finish(out=, divisor=) on a float32 gradient's allgather (or top-k allgather) plan: the value is ``out``
    itself, in the gradient's shape, holding the sum divided by ``divisor`` (the caller's average)."""
    n, numel = 2, 1000
    aggs = [AutoAggregator("w", (numel,), torch.float32, n, r, MODEL, lossy=True, lossy_min_bytes=0,
                           first=strategy, allowed=(strategy,), topk_ratio=0.05) for r in range(n)]
    g = torch.Generator().manual_seed(1)
    xs = [torch.zeros(numel) for _ in range(n)]
    for x in xs:
        x[torch.randperm(numel, generator=g)[:10]] = torch.randn(10, generator=g)   # fewer than k: all selected
    want = (xs[0] + xs[1]) / 2
    encoded = [a.encode(x) for a, x in zip(aggs, xs)]
    summed = encoded[0][0] + encoded[1][0]
    outcomes = [a.decode(summed, ctx) for a, (_, ctx) in zip(aggs, encoded)]
    gathered = torch.stack([o.request.tensor.reshape(-1) for o in outcomes])
    out = torch.full((numel,), 7.0)
    value = aggs[0].finish(encoded[0][1], gathered.clone(), out=out, divisor=2)
    assert value.data_ptr() == out.data_ptr() and torch.equal(value, want)
