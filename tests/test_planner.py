"""The planner's strategies (lossless_hc.training.strategies), run: every strategy exact against a float64
dense sum, with the collectives done in-process (SUM of payloads, rank-ordered stacking for allgather),
re-plans and their hand-overs, and the bytes each step sends against the cost model's prediction. The
lossy strategies: tests/test_planner_lossy.py; the cost model's decisions alone: tests/test_planner_cost.py;
the candidates at the codecs' limits: tests/test_planner_codec_limits.py."""
import pytest
import torch

from lossless_hc.training.auto import AutoSpec, settle_message_plans
from lossless_hc.training.planner import EXACT_STRATEGIES, STRATEGIES, Calibration, CostModel
from lossless_hc.training.aggregate import ConfigurationMismatch
from lossless_hc.training.step import run_in_process
from lossless_hc.training.strategies import AutoAggregator
from test_planner_cost import MODEL


# -- the strategies, exact ----------------------------------------------------------------------------

def run_step(aggs, xs, average=False):
    """One step of every rank's aggregator with in-process collectives; the per-rank results."""
    return run_in_process(aggs, xs, average)[0]


def on_each_payload(aggs, record) -> None:
    """From now on ``record(rank, payload)`` sees every first payload the aggregators' ``encode`` returns."""
    for r, a in enumerate(aggs):
        def recorded(x, encode=a.encode, r=r):
            payload, ctx = encode(x)
            record(r, payload)
            return payload, ctx
        a.encode = recorded


def record_sent(aggs) -> list:
    """A list that receives the bytes of every first payload the aggregators' ``encode`` returns from now on."""
    sent = []
    on_each_payload(aggs, lambda r, payload: sent.append(payload.numel() * payload.element_size()))
    return sent


def sparse_rows(rng, rows, dim, k, hot=0):
    x = torch.zeros(rows, dim)
    idx = torch.randperm(rows, generator=rng)[:k]
    if hot:
        idx = torch.cat([torch.arange(hot), idx])
    x[idx] = torch.randn(idx.numel(), dim, generator=rng)
    return x


@pytest.mark.parametrize("strategy", EXACT_STRATEGIES)
@pytest.mark.parametrize("average", [False, True])
def test_every_exact_strategy_equals_the_dense_sum(strategy, average):
    n, rows, dim = 3, 500, 8
    rng = torch.Generator().manual_seed(1)
    aggs = [AutoAggregator("emb", (rows, dim), torch.float32, n, r, MODEL, first=strategy, allowed=(strategy,),
                           interval=2) for r in range(n)]
    for step in range(5):
        xs = [sparse_rows(rng, rows, dim, 3 + 4 * step + r, hot=2) for r in range(n)]
        truth = torch.stack([x.double() for x in xs]).sum(0) / (n if average else 1)
        for y in run_step(aggs, xs, average):
            assert y.shape == (rows, dim) and y.dtype == torch.float32
            assert torch.equal(y != 0, truth != 0)
            assert torch.allclose(y.double(), truth, rtol=0, atol=1e-5)
        assert all(a.strategy == strategy for a in aggs)
    if strategy == "sketch":   # 1% of the rows per rank at first; the later steps overflow and fall back
        assert aggs[0].fallbacks >= 1
    st = aggs[0].plan_stats()
    assert st["strategy"] == strategy and st["bytes_sent"] > 0 and strategy in st["measured_seconds"]


@pytest.mark.parametrize("average", [False, True])
def test_joined_ranks_with_the_engine_s_op_known_dense_is_exact_and_other_plans_refuse(average):
    """Horovod after hvd.join(): a joined rank contributes zeros in place of its payload, and an AVERAGE
    is still divided by the world size. With the engine's op given (``engine_averages``, as the Horovod
    plugin sets it from the optimizer), a dense plan's statistics step decodes the ranks still training
    exactly; an allgather plan raises a ConfigurationMismatch naming hvd.join() (read from the payload
    instead, a SUM of one rank of two reads as an AVERAGE of both: aggregate.payload_is_averaged)."""
    n, rows, dim = 2, 64, 8
    rng = torch.Generator().manual_seed(3)
    xs = [sparse_rows(rng, rows, dim, 5) for _ in range(n)]

    def decode_with_rank_1_joined(strategy, engine_averages):
        aggs = [AutoAggregator("w", (rows, dim), torch.float32, n, r, MODEL, first=strategy, allowed=(strategy,),
                               interval=1) for r in range(n)]
        run_step(aggs, xs, average)   # a step with both ranks
        aggs[0].engine_averages = engine_averages
        payload, ctx = aggs[0].encode(xs[0])   # rank 1 has joined: Horovod adds zeros for it
        summed = payload.to(torch.float64) / (n if average else 1)
        return aggs[0].decode(summed.to(payload.dtype), ctx)

    out = decode_with_rank_1_joined("dense", average)
    assert out.request is None and torch.equal(out.value, xs[0] / (n if average else 1))
    with pytest.raises(ConfigurationMismatch, match=r"hvd\.join\(\)"):
        decode_with_rank_1_joined("allgather", average)


@pytest.mark.parametrize("strategy", ["allgather", "two_phase"])
def test_rows_holding_only_nan_inf_or_subnormals_are_sent_and_negative_zero_rows_are_not(strategy):
    """The row scan (|x| maximised over a row) counts a row present iff some value is not +-0: NaN,
    infinities and the smallest subnormal reach the sum; a row of -0.0 is a zero row."""
    n, rows, dim = 2, 6, 4
    aggs = [AutoAggregator("emb", (rows, dim), torch.float32, n, r, MODEL, first=strategy, allowed=(strategy,))
            for r in range(n)]
    a, b = torch.zeros(rows, dim), torch.zeros(rows, dim)
    a[0, 3], a[1, 0], b[2, 1], b[3, 2] = float("nan"), float("inf"), 1e-45, -1.0
    a[4] = -0.0
    for y in run_step(aggs, [a, b]):
        torch.testing.assert_close(y, a + b, rtol=0, atol=0, equal_nan=True)
    enc = aggs[0].encode(a)[1]
    assert enc.rows == 2   # rank 0: the NaN and infinity rows; its -0.0 row is not one


def test_the_planner_moves_every_rank_to_the_same_cheaper_strategy():
    """Dense at the first step; its statistics (few rows per rank) then make every rank switch, and a
    later burst of density switches them back to dense, at the same step everywhere, exactly."""
    n, rows, dim = 3, 4000, 16
    rng = torch.Generator().manual_seed(2)
    aggs = [AutoAggregator("emb", (rows, dim), torch.float32, n, r, MODEL, interval=2) for r in range(n)]
    seen = []
    for step in range(12):
        k = 3900 if step >= 6 else 20
        xs = [sparse_rows(rng, rows, dim, k) for r in range(n)]
        truth = torch.stack([x.double() for x in xs]).sum(0)
        ys = run_step(aggs, xs)
        for y in ys:
            assert torch.allclose(y.double(), truth, rtol=0, atol=1e-5)
        assert len({a.strategy for a in aggs}) == 1
        seen.append(aggs[0].strategy)
    assert seen[0] != "dense" and seen[-1] == "dense", seen
    assert aggs[0].history == aggs[1].history == aggs[2].history


def test_a_plan_prices_the_second_collectives_its_message_batches():
    """An aggregator whose message (DDP's bucket) already allgathers (``batched``, set by the adapter from
    its bucket-mates' plans) prices its own allgather without the latency: on a slow-latency link a
    32 Ki-coordinate tensor's top-k goes by allgather there, and alone the tensor goes dense (top-k's sketch
    pays a second allreduce's latency too, for its inexact keys); every rank alike, and the allgathered sum
    equals the reference selections'."""
    n = 4
    model = CostModel(Calibration.default(bandwidth_bits=1e9, latency_s=1e-3))
    rng = torch.Generator().manual_seed(5)
    chosen = {}
    for batched in (frozenset(), frozenset({"allgather"})):
        aggs = [AutoAggregator("w", (1 << 15,), torch.float32, n, r, model, lossy=True, interval=2,
                               allowed=("dense", "topk", "topk_allgather")) for r in range(n)]
        for a in aggs:
            a.batched = batched
        for _ in range(3):
            run_step(aggs, [torch.randn(1 << 15, generator=rng) for _ in range(n)])
        assert len({a.strategy for a in aggs}) == 1
        chosen[batched] = aggs[0].strategy
    assert chosen == {frozenset(): "dense", frozenset({"allgather"}): "topk_allgather"}, chosen


def bucket_mates(n: int):
    """Two lossy auto tensors of one bucket on ``n`` ranks (``big``: 2^20 coordinates, ``small``: 2^15), dense,
    sketch top-k and allgathered top-k allowed, planning every 2 steps: one aggregator list per tensor."""
    model = CostModel(Calibration.default(bandwidth_bits=1e9, latency_s=1e-3))
    allowed = ("dense", "topk", "topk_allgather")
    return ([AutoAggregator(name, (numel,), torch.float32, n, r, model, lossy=True, interval=2, allowed=allowed)
             for r in range(n)] for name, numel in (("big", 1 << 20), ("small", 1 << 15)))


def test_a_message_s_plans_settle_on_their_bucket_mates_plans_of_the_same_step():
    """settle_message_plans (DDP's auto_hook, before the message and after its decode): the plans a step's
    statistics made are priced again as the message batches them, at once: a large tensor top-k'd by
    allgather draws its 32 Ki-coordinate bucket-mate from dense to the allgather at the same step
    (one entry in its history), on every rank alike."""
    n = 4
    rng = torch.Generator().manual_seed(6)
    big, small = bucket_mates(n)
    for r in range(n):
        settle_message_plans([big[r], small[r]])   # no plan yet: nothing due, nothing batched
    assert [a.batched for a in big + small] == [frozenset()] * (2 * n)
    before = [[b.plans, s.plans] for b, s in zip(big, small)]
    for aggs, numel in ((big, 1 << 20), (small, 1 << 15)):
        run_step(aggs, [torch.randn(numel, generator=rng) for _ in range(n)])
    assert {b.strategy for b in big} == {"topk_allgather"} and {s.strategy for s in small} == {"dense"}
    for r in range(n):
        settle_message_plans([big[r], small[r]], before[r])
    assert {s.strategy for s in small} == {"topk_allgather"}
    assert all(s.history == [(1, "topk_allgather")] and s.batched == {"allgather"} for s in small), small[0].history
    # the big one was planned again with its bucket-mate's allgather, and stayed
    assert all(b.batched == {"allgather"} and b.history == [(1, "topk_allgather")] for b in big), big[0].history


def test_settling_a_message_replans_only_the_tensors_that_planned_since():
    """settle_message_plans with ``plans_before`` taken after the step's plans: no tensor planned since, so
    each one's ``batched`` follows its bucket-mates' plans but none is planned again mid-interval (the small
    tensor stays dense until its own statistics step; re-planning it too passed every other test)."""
    n = 2
    rng = torch.Generator().manual_seed(6)
    big, small = bucket_mates(n)
    for aggs, numel in ((big, 1 << 20), (small, 1 << 15)):
        run_step(aggs, [torch.randn(numel, generator=rng) for _ in range(n)])
    assert {b.strategy for b in big} == {"topk_allgather"} and {s.strategy for s in small} == {"dense"}
    for r in range(n):
        plans = [big[r].plans, small[r].plans]
        settle_message_plans([big[r], small[r]], plans)
        assert [big[r].plans, small[r].plans] == plans and small[r].strategy == "dense"
        assert small[r].batched == {"allgather"} and big[r].batched == frozenset()


def test_settling_a_message_applies_the_plans_due_since_the_calibration_first_and_replans_them():
    """settle_message_plans without ``plans_before`` (DDP's hook before its message): a plan left due by a
    step taken before the calibration (no cost model yet) is applied first, and counts as planned since, so
    it is priced again with its bucket-mates' plans of the same step: the small tensor goes with the big
    one's allgather at once (not applying the due plans, or applying them only where no cost model is set,
    passed every other test)."""
    n = 2
    rng = torch.Generator().manual_seed(6)
    big, small = bucket_mates(n)
    model = big[0].cost_model
    for a in big + small:   # built before the calibration: the step's statistics leave a plan due
        a.cost_model = None
    for aggs, numel in ((big, 1 << 20), (small, 1 << 15)):
        run_step(aggs, [torch.randn(numel, generator=rng) for _ in range(n)])
    assert {a.strategy for a in big + small} == {"dense"} and {a.plans for a in big + small} == {0}
    for a in big + small:
        a.cost_model = model
    for r in range(n):
        settle_message_plans([big[r], small[r]])
        assert (big[r].strategy, small[r].strategy) == ("topk_allgather", "topk_allgather")
        assert small[r].batched == {"allgather"} and small[r].plans == 2 and big[r].plans >= 1


def test_settling_a_message_ends_with_every_batched_set_from_the_final_plans():
    """settle_message_plans passes over the message until a pass changes no plan: here A's stale ``batched``
    moves it to the allgather (pass 1), which moves B to two_phase (pass 2), whose allreduce A is priced with
    again, keeping its plan (pass 3); every ``batched`` then follows the final plans (a pass fewer left A's
    from before B's change). Scripted aggregators: A always plans the allgather, B two_phase beside one."""
    from lossless_hc.training.planner import batched_second_collectives

    class Scripted:
        def __init__(self, strategy, batched, rule):
            self.strategy, self.batched, self.rule, self.plans, self.cost_model = strategy, batched, rule, 1, None

        def replan(self):
            self.strategy = self.rule(self.batched)
    a = Scripted("dense", frozenset({"allreduce"}), lambda batched: "allgather")
    b = Scripted("dense", frozenset(), lambda batched: "two_phase" if "allgather" in batched else "dense")
    settle_message_plans([a, b], [0, 0])
    assert (a.strategy, b.strategy) == ("allgather", "two_phase")
    assert [a.batched, b.batched] == batched_second_collectives([a.strategy, b.strategy]) == [{"allreduce"}, {"allgather"}]


def test_a_replan_that_revises_the_step_s_change_back_leaves_no_history_entry():
    """A step's plan changed dense -> allgathered top-k; a re-plan of the same step (its message's plans settling) that
    goes back to dense made no change, and leaves no entry; one that goes on to a third strategy leaves one."""
    n = 2
    model = CostModel(Calibration.default(bandwidth_bits=1e9, latency_s=1e-3))
    rng = torch.Generator().manual_seed(7)
    for replanned, history in (("dense", []), ("topk", [(1, "topk")])):
        aggs = [AutoAggregator("w", (1 << 17,), torch.float32, n, r, model, lossy=True, interval=2,
                               allowed=("dense", "topk", "topk_allgather")) for r in range(n)]
        run_step(aggs, [torch.randn(1 << 17, generator=rng) for _ in range(n)])
        assert [(a.strategy, a.history) for a in aggs] == [("topk_allgather", [(1, "topk_allgather")])] * n
        for a in aggs:
            a.cost_model = _Choosing(model, replanned)
            a.replan()
        assert [(a.strategy, a.history) for a in aggs] == [(replanned, history)] * n


def test_a_replan_at_a_later_step_keeps_the_earlier_changes_in_history():
    """replan revises only a change made at the same step: a re-plan at a later step that changes the
    strategy adds its entry after the earlier ones, and one with no history at all (a dense plan kept)
    leaves it empty."""
    n = 2
    model = CostModel(Calibration.default(bandwidth_bits=1e9, latency_s=1e-3))
    rng = torch.Generator().manual_seed(7)
    aggs = [AutoAggregator("w", (1 << 17,), torch.float32, n, r, model, lossy=True, interval=100,
                           allowed=("dense", "topk", "topk_allgather")) for r in range(n)]
    for _ in range(2):   # step 1 plans the allgathered top-k, step 2 plans nothing
        run_step(aggs, [torch.randn(1 << 17, generator=rng) for _ in range(n)])
    assert [(a.strategy, a.history) for a in aggs] == [("topk_allgather", [(1, "topk_allgather")])] * n
    for a in aggs:
        a.cost_model = _Choosing(model, "topk")
        a.replan()
    assert [(a.strategy, a.history) for a in aggs] == [("topk", [(1, "topk_allgather"), (2, "topk")])] * n
    dense = [AutoAggregator("d", (64,), torch.float32, n, r, model, allowed=("dense",)) for r in range(n)]
    run_step(dense, [torch.ones(64)] * n)
    for a in dense:
        a.replan()
    assert [(a.strategy, a.history, a.plans) for a in dense] == [("dense", [], 2)] * n


class _Choosing:
    """A cost model whose every choice is ``strategy`` (the rest is ``model``'s)."""

    def __init__(self, model, strategy):
        self._model, self._strategy = model, strategy

    def __getattr__(self, name):
        return getattr(self._model, name)

    def choose(self, stats, **kw):
        return self._strategy, {}


def test_an_auto_aggregator_checks_its_seed():
    """A seed that is not a uint64 (1.5 was truncated to 1, True taken as 1) is refused, as every codec's is."""
    for seed, error in ((1.5, TypeError), (True, TypeError), (-1, ValueError), (1 << 64, ValueError)):
        with pytest.raises(error, match="seed"):
            AutoAggregator("w", (100,), torch.float32, 2, 0, MODEL, seed=seed)


def test_an_auto_aggregator_checks_its_rank_world_size_shape_and_lossy_parameters():
    """A rank outside [0, world_size) wrote its row count into another rank's header slot (rank -1 of 2: the
    other rank's count read as 4194304, silently) or past the header (rank 3 of 2: an IndexError at encode);
    a world size of 2.5 was truncated to 2, a negative shape accepted, and topk_ratio=0 or thc_bits=0 raised
    only when a top-k or THC plan first built its aggregator, mid-run. Each is refused when it is built."""
    for bad, error, match in ((dict(rank=-1), ValueError, "rank must be in"), (dict(rank=2), ValueError, "rank"),
                              (dict(world_size=0), ValueError, "world_size"), (dict(world_size=2.5), TypeError,
                                                                               "world_size"),
                              (dict(rank=True), TypeError, "rank"), (dict(shape=(-4,)), ValueError, "shape"),
                              (dict(topk_ratio=0.0), ValueError, "topk_ratio"),
                              (dict(thc_bits=0), ValueError, "thc_bits")):
        args = dict(name="w", shape=(100,), dtype=torch.float32, world_size=2, rank=0, cost_model=MODEL)
        with pytest.raises(error, match=match):
            AutoAggregator(**{**args, **bad})
    # ranks 0 and 1: each count in its own slot
    aggs = [AutoAggregator("w", (64, 4), torch.float32, 2, r, MODEL) for r in (0, 1)]
    xs = [torch.zeros(64, 4), torch.zeros(64, 4)]
    xs[0][1], xs[1][5] = 1.0, 2.0
    run_step(aggs, xs)
    assert aggs[0].tracker.rank_keys == [1.0, 1.0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_allgather_is_priced_at_the_bytes_it_sends_whatever_the_gradient_s_dtype(dtype):
    """allgather's slots (an int32 index and a float32 row) are float32 for every gradient dtype. Priced at
    the plain steps' width (2 bytes where half-precision plain steps travel as they are), a float16 or
    bfloat16 gradient's allgather and two_phase were predicted at half what they send."""
    n, shape = 3, (4000, 16)
    g = torch.Generator().manual_seed(0)
    aggs = [AutoAggregator("emb", shape, dtype, n, r, MODEL, first="allgather", allowed=("allgather",))
            for r in range(n)]
    for a in aggs:
        a.plain_dtype = dtype   # as the DDP, FSDP2 and Horovod adapters set it (native_plain_dtypes)
    for _ in range(3):
        xs = []
        for _ in range(n):
            x = torch.zeros(shape, dtype=dtype)
            x[torch.randperm(shape[0], generator=g)[:200]] = torch.randn(200, shape[1], generator=g).to(dtype)
            xs.append(x)
        before = aggs[0].stats.payload_bytes
        run_step(aggs, xs)
    assert aggs[0].plan_input.element_bytes == dtype.itemsize
    predicted = sum(b for _, b in MODEL.collectives("allgather", aggs[0].plan_input))
    assert predicted == aggs[0].stats.payload_bytes - before


@pytest.mark.parametrize("strategy,dtype", [("thc", torch.float32), ("thc", torch.float16), ("dense", torch.float64),
                                            ("two_phase", torch.float32)])
def test_the_statistics_header_is_priced_in_its_payload_s_dtype(strategy, dtype):
    """The statistics header takes its first payload's dtype: float64 in THC's payload and in a float64
    gradient's (``plan_stats.header_width``). Priced as float32 words, THC's and a float64 dense step's
    first payload were predicted 4(1+2n) bytes short of what they send."""
    n, shape = 3, (4000, 16)
    g = torch.Generator().manual_seed(0)
    aggs = [AutoAggregator("w", shape, dtype, n, r, MODEL, lossy=True, first=strategy, allowed=(strategy,),
                           lossy_min_bytes=0) for r in range(n)]
    xs = []
    for _ in range(n):
        x = torch.zeros(shape, dtype=dtype)
        x[torch.randperm(shape[0], generator=g)[:200]] = torch.randn(200, shape[1], generator=g).to(dtype)
        xs.append(x)
    run_step(aggs, xs)   # the first step carries the header (a dense plan's later steps are plain)
    assert aggs[0].strategy == strategy
    predicted = sum(b for _, b in MODEL.collectives(strategy, aggs[0].plan_input))
    assert predicted == aggs[0].stats.payload_bytes


def test_auto_options_are_checked_not_coerced():
    """alpha and topk_ratio: numbers in (0, 1], bool and str refused (True was taken as 1.0: top-k of the
    whole tensor); strategies given as an iterator are read once (the check spent it, leaving every
    tensor dense), a single name is that name."""
    for options in (dict(alpha=True), dict(alpha="0.5"), dict(topk_ratio=True), dict(topk_ratio=float("nan"))):
        with pytest.raises(ValueError, match="must be a number in"):
            AutoSpec(**options)
    assert AutoSpec(lossy=True, strategies=iter(["thc"])).strategies == ("thc",)
    assert AutoSpec(strategies="sketch").strategies == ("sketch",)


def test_a_cost_model_checks_the_lossy_parameters_it_prices():
    """CostModel(topk_ratio=0) priced top-k at one coordinate; an aggregator planned with it took
    topk_allgather at step 0 and raised "max_density must be a number in (0, 1]" at step 1, when it first
    built top-k. The cost model checks topk_ratio, thc_bits and the granularity as AutoSpec does."""
    cal = Calibration.default()
    for options, name in ((dict(topk_ratio=0.0), "topk_ratio"), (dict(topk_ratio=2), "topk_ratio"),
                          (dict(topk_ratio=True), "topk_ratio"), (dict(thc_bits=0), "thc_bits"),
                          (dict(thc_bits=2.5), "thc_bits"), (dict(thc_granularity=0), "granularity")):
        with pytest.raises(ValueError, match=name):
            CostModel(cal, **options)
    assert CostModel(cal, topk_ratio=1, thc_bits=16).topk_ratio == 1.0


def test_contradictory_auto_options_are_refused():
    """A lossy first strategy without lossy=True, strategies of which lossy allows none, or a first
    strategy outside ``strategies`` would leave every tensor on another strategy than the one named:
    ValueError. A first strategy that one tensor
    cannot take (a lossy one on a tensor below lossy_min_bytes) starts that tensor dense."""
    for options in [dict(first="thc"), dict(strategies=("topk", "thc")), dict(lossy=False, first="fp16")]:
        with pytest.raises(ValueError, match="lossy strategies need lossy=True"):
            AutoSpec(**options)
    with pytest.raises(ValueError, match="not among strategies"):
        AutoSpec(first="sketch", strategies=("dense", "allgather"))
    with pytest.raises(ValueError, match="not among strategies"):
        AutoSpec(lossy=True, first="topk", strategies=("thc",))
    assert AutoSpec(strategies=STRATEGIES).strategies == STRATEGIES   # a restriction: exact ones among them
    spec = AutoSpec(lossy=True, first="topk", strategies=("dense", "topk"))
    assert (spec.first, spec.strategies) == ("topk", ("dense", "topk"))
    small = AutoAggregator("w", (8,), torch.float32, 2, 0, MODEL, lossy=True, first="topk", allowed=spec.strategies)
    assert small.strategy == "dense"


@pytest.mark.parametrize("bits", [0, 17, 2.5, True])
def test_auto_thc_bits_are_checked_up_front(bits):
    """AutoSpec(thc_bits=...) is checked where it is built: 0 used to fail only when a THC plan was first
    built, mid-run, and 2.5 was truncated to 2."""
    with pytest.raises(ValueError, match="thc_bits must be an integer in"):
        AutoSpec(lossy=True, thc_bits=bits)
    assert AutoSpec(lossy=True, thc_bits=8).thc_bits == 8


def test_float64_tensors_stay_dense_and_exact():
    aggs = [AutoAggregator("d", (10,), torch.float64, 2, r, MODEL, first="two_phase") for r in range(2)]
    xs = [torch.arange(10, dtype=torch.float64) / 3 + r for r in range(2)]
    for y in run_step(aggs, xs):
        assert y.dtype == torch.float64 and torch.equal(y, xs[0] + xs[1])
    assert aggs[0].allowed == ("dense",)


def test_one_rank_or_no_coordinate_leaves_dense_alone_and_a_first_step_outside_allowed_takes_its_first():
    """With one rank (nothing crosses the wire) or no coordinate there is nothing to save: dense is the only
    candidate, lossy or not. A first strategy the candidates exclude falls back to dense, or where dense is
    itself excluded, to the first candidate (in the planner's order), never to one outside them."""
    lossy = dict(lossy=True, lossy_min_bytes=0)
    assert AutoAggregator("w", (1 << 12, 4), torch.float32, 1, 0, MODEL, **lossy).allowed == ("dense",)
    assert AutoAggregator("w", (0,), torch.float32, 2, 0, MODEL, **lossy).allowed == ("dense",)
    assert AutoAggregator("w", (64, 4), torch.float32, 2, 0, MODEL, allowed=("two_phase",)).strategy == "two_phase"
    assert AutoAggregator("w", (64, 4), torch.float32, 2, 0, MODEL, first="sketch",
                          allowed=("two_phase", "allgather")).strategy == "allgather"
    assert AutoAggregator("w", (64, 4), torch.float32, 2, 0, MODEL, first="sketch",
                          allowed=("dense", "allgather")).strategy == "dense"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_a_plain_step_the_engine_reduced_counts_the_gradient_s_bytes(dtype):
    # DDP's in-place allreduce of a bucket sends the bucket's dtype: a bfloat16 gradient's two bytes,
    # not the four of auto's float32 payloads (which counted half-precision models' plain steps twice).
    agg = AutoAggregator("w", (1000,), dtype, 2, 0, MODEL)
    agg.record_plain_step(0.0)
    assert agg.bytes_sent == 1000 * dtype.itemsize
    assert agg.stats.payload_bytes == agg.stats.dense_bytes == 1000 * dtype.itemsize
    assert (agg.plain_steps, agg.stats.sent_dense, agg.stats.compressed) == (1, 1, 0)   # the dense tensor, plain
    assert agg.steps == 1 and set(agg.plan_stats()["measured_seconds"]) == {"dense"}


def test_a_half_precision_plain_step_the_engine_ran_counts_two_bytes_a_coordinate_as_compressed():
    # DDP's fp16/bf16 compress hook (or FSDP2's bfloat16 all-reduce) ran the plan's plain step in place:
    # two bytes a coordinate, a plain step, measured under the half strategy (to when its sum arrived, ended=)
    # and counted as compressed
    agg = AutoAggregator("w", (1000,), torch.float32, 2, 0, MODEL, lossy=True, lossy_min_bytes=0)
    agg.record_plain_step(1.0, half="bf16", ended=3.5)
    assert agg.bytes_sent == agg.stats.payload_bytes == 2000 and agg.stats.dense_bytes == 4000
    assert (agg.steps, agg.plain_steps, agg.stats.tensors, agg.stats.compressed, agg.stats.sent_dense) == (1, 1, 1, 1, 0)
    assert agg.plan_stats()["measured_seconds"] == {"bf16": 2.5}
