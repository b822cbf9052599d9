"""The planner's sketch strategy on a dense gradient whose sketch is sized with the LHC codec's dense
index (a support near every row: what an engine restricted to the sketch, ``allowed=("sketch",)``,
plans there). Collectives in-process, as in tests/test_planner.py."""
import torch

from lossless_hc.training.plan_stats import TensorStats
from lossless_hc.training.strategies import AutoAggregator
from test_planner import run_step
from test_planner_cost import MODEL


def test_a_sketch_with_the_dense_index_is_exact_and_its_rows_are_scanned():
    """The dense index's header counts no rows (``LosslessCodec.encoded_keys``: None), so that sketch's
    encode scans the gradient for the statistics header as a dense plan does: the step is the exact sum
    and the tracker observes each rank's non-zero rows and the union's rows (the decode's support, in keys)."""
    n, rows, dim = 2, 64, 4
    aggs = [AutoAggregator("w", (rows, dim), torch.float32, n, r, MODEL, first="sketch", allowed=("sketch",))
            for r in range(n)]
    for a in aggs:   # sized for every row of every rank, as a plan on such statistics sizes it
        a._size_sketch(TensorStats(a.numel, a.row, n, (rows,) * n, rows))
    assert aggs[0]._codec.layout.index_kind == "dense"
    rng = torch.Generator().manual_seed(5)
    xs = [torch.randn(rows, dim, generator=rng) for _ in range(n)]
    xs[0][40:] = 0   # rank 0: rows 0..39
    xs[1][:8] = 0    # rank 1: rows 8..47; the union: 48 rows of 64
    xs[1][48:] = 0
    for y in run_step(aggs, xs):
        assert torch.equal(y, (xs[0].double() + xs[1].double()).float())
    for a in aggs:
        assert a.tracker.rank_keys == [40.0, 40.0] and a.tracker.union == 48.0   # rows, not elements
        assert a.fallbacks == 0
