"""Checkpointing an aggregator's state (lossless_hc.training.checkpoint), in one process: what a load
refuses before touching the aggregator, and what it leaves of an aggregator that trained since."""
import pytest
import torch

from lossless_hc.training.topk_aggregate import TopKAggregator
from lossless_hc.training.checkpoint import aggregator_state_dict, load_aggregator_state_dict
from lossless_hc.training.planner import Calibration, CostModel
from lossless_hc.training.strategies import AutoAggregator
from test_policy import run_steps

MODEL = CostModel(Calibration.default(1e8))


def auto(rank=0):
    return AutoAggregator("w", (4096,), torch.float32, 2, rank, MODEL, lossy=True, first="topk", lossy_min_bytes=0)


def test_a_truncated_state_is_refused_before_anything_is_restored():
    """A state without its residual (or capacity) was a KeyError, raised after the capacity had been
    overwritten; now a ValueError naming what it lacks, the aggregator untouched. An auto state too."""
    saved = TopKAggregator("t", (4096,), torch.float32, 2, ratio=0.05)
    saved.capacity = 999
    state = aggregator_state_dict(saved)
    del state["residual"]
    agg = TopKAggregator("t", (4096,), torch.float32, 2, ratio=0.05)
    before = agg.capacity
    with pytest.raises(ValueError, match="lacks residual"):
        load_aggregator_state_dict(agg, state)
    assert agg.capacity == before != 999
    state = aggregator_state_dict(auto())
    del state["thc"], state["history"]
    with pytest.raises(ValueError, match="lacks history, thc"):
        load_aggregator_state_dict(auto(), state)


def test_a_state_for_another_configuration_is_refused():
    """A saved strategy this auto aggregator does not allow, a capacity policy on one side only, another shape:
    each a ValueError, not a state restored into an aggregator it does not fit."""
    from lossless_hc.training.aggregate import TensorAggregator
    from lossless_hc.training.capacity import CapacityPolicy
    state = aggregator_state_dict(auto())
    assert state["strategy"] == "topk"
    only_sketch = AutoAggregator("w", (4096,), torch.float32, 2, 0, MODEL, allowed=("sketch",))
    with pytest.raises(ValueError, match="saved strategy 'topk' is not allowed"):
        load_aggregator_state_dict(only_sketch, state)
    with_policy = aggregator_state_dict(TensorAggregator("t", (4096,), torch.float32, 2, 0.01, policy=CapacityPolicy()))
    with pytest.raises(ValueError, match="capacity policy"):
        load_aggregator_state_dict(TensorAggregator("t", (4096,), torch.float32, 2, 0.01), with_policy)
    with pytest.raises(ValueError, match="aggregator of torch.float32 \\[4096\\]"):
        load_aggregator_state_dict(TensorAggregator("t", (64, 64), torch.float32, 2, 0.01), with_policy)


def test_a_residual_of_another_size_is_refused_and_a_negative_view_restored_as_its_values():
    """A top-k residual of another numel (it was broadcast into the next step's sum) is refused before
    anything is restored, in a top-k and an auto state; one saved as a negative view comes back as its
    values, in memory (the selection reads memory: it refused or, before, negated it)."""
    saved = TopKAggregator("t", (100,), torch.float32, 2, ratio=0.9)   # sent dense: the residual is added
    state = aggregator_state_dict(saved)
    state["capacity"], state["residual"] = 77, torch.tensor([5.0])
    agg = TopKAggregator("t", (100,), torch.float32, 2, ratio=0.9)
    with pytest.raises(ValueError, match="saved residual is not a real tensor of 100 elements"):
        load_aggregator_state_dict(agg, state)
    assert agg.capacity != 77 and agg.residual is None
    state = aggregator_state_dict(auto())
    state["topk_residual"] = torch.zeros(7)
    with pytest.raises(ValueError, match="saved topk_residual is not a real tensor of 4096 elements"):
        load_aggregator_state_dict(auto(), state)
    state = aggregator_state_dict(TopKAggregator("t", (4096,), torch.float32, 2, ratio=0.01))
    state["residual"] = torch._neg_view(-torch.arange(4096.0))
    agg = TopKAggregator("t", (4096,), torch.float32, 2, ratio=0.01)
    load_aggregator_state_dict(agg, state)
    assert not agg.residual.is_neg() and torch.equal(agg.residual, torch.arange(4096.0))
    idx, values = agg.select_indices(torch.zeros(4096))
    assert torch.equal(idx, torch.arange(4096 - agg.k, 4096)) and torch.equal(values, idx.float())


def test_a_restored_residual_is_the_aggregator_s_own_memory():
    """A loaded residual is a copy: the selection updates it in place, which must leave the state (one
    checkpoint loaded into several aggregators, or kept to load again) as it was saved, in a top-k and an
    auto state alike."""
    residual = torch.arange(4096.0)
    top_k = lambda: TopKAggregator("t", (4096,), torch.float32, 2, ratio=0.01)   # noqa: E731
    for kind, key, make in (("topk", "residual", top_k), ("auto", "topk_residual", auto)):
        state = aggregator_state_dict(make())
        state[key] = residual.clone()
        first, second = make(), make()
        load_aggregator_state_dict(first, state)
        load_aggregator_state_dict(second, state)
        for agg in (first, second):
            topk = agg if kind == "topk" else agg.topk_aggregator()
            idx, values = topk.select_indices(torch.zeros(4096))   # the k largest: taken out of the residual
            assert torch.equal(values, residual[-topk.k:]), kind
        assert torch.equal(state[key], residual), kind


def test_auto_keeps_nothing_the_saved_state_did_not_have():
    """An auto aggregator that built a top-k residual and a THC codec since, loaded from a state saved
    before either existed, starts them afresh (they were kept: a roll-back carried the later residual)."""
    fresh = aggregator_state_dict(auto())
    agg = auto()
    agg.topk_aggregator().residual = torch.ones(4096)
    agg.thc_aggregator()
    load_aggregator_state_dict(agg, fresh)
    assert agg._topk is None and agg._thc is None


def test_auto_thc_restored_from_a_checkpoint_propagates_non_finite_inputs():
    """auto's THC decodes a NaN/Inf input to NaN (an AMP scaler then skips the step) instead of raising;
    rebuilt from a checkpoint it was built with THC's default and raised FloatingPointError."""
    saved = auto()
    saved.thc_aggregator()
    agg = auto()
    load_aggregator_state_dict(agg, aggregator_state_dict(saved))
    assert agg._thc is not None and agg._thc.codec.non_finite == "propagate"
    assert agg._thc.codec.non_finite == saved._thc.codec.non_finite


def test_a_re_plan_due_after_a_failure_survives_a_checkpoint():
    """A step that failed on every rank sets the plan tracker's ``force``: the next step carries the
    statistics and a plan follows. Saved with it set, mid-interval, the resumed aggregator carries them
    at that step too; saved without it, not."""
    from lossless_hc.training.step import run_in_process

    def plain(rank=0):   # plans whose plain steps carry no statistics (top-k's all do)
        return AutoAggregator("w", (4096,), torch.float32, 2, rank, MODEL, lossy=True, first="dense",
                              allowed=("dense", "bf16"), lossy_min_bytes=0)
    ranks = [plain(r) for r in range(2)]
    g = torch.Generator().manual_seed(0)
    for _ in range(2):
        xs = [torch.zeros(4096) for _ in range(2)]
        for x in xs:
            x[torch.randperm(4096, generator=g)[:50]] = torch.randn(50, generator=g)
        run_in_process(ranks, xs)
    saved = ranks[0]
    assert not saved.carries_statistics()   # mid-interval
    for force in (True, False):
        saved.tracker.force = force   # True: as a failure that every rank saw leaves it (AutoAggregator.decode)
        agg = plain()
        load_aggregator_state_dict(agg, aggregator_state_dict(saved))
        assert agg.tracker.force == force and agg.carries_statistics() == force


def test_auto_top_k_allgathered_resumes_bit_for_bit():
    """A top-k-allgather plan saved after 3 steps and loaded into fresh aggregators continues as the straight
    run: its plan and its error-feedback memory (the top-k aggregator's residual, shared with topk) come
    back, so the next steps' sums are the same bits."""
    from lossless_hc.training.step import run_in_process

    def pair():
        return [AutoAggregator("w", (4096,), torch.float32, 2, r, MODEL, lossy=True, first="topk_allgather",
                               allowed=("topk_allgather",), lossy_min_bytes=0) for r in range(2)]
    g = torch.Generator().manual_seed(0)
    steps = [[torch.randn(4096, generator=g) for _ in range(2)] for _ in range(6)]
    straight = pair()
    for xs in steps[:3]:
        run_in_process(straight, xs)
    saved = [aggregator_state_dict(a) for a in straight]
    assert saved[0]["strategy"] == "topk_allgather" and saved[0]["topk_residual"] is not None
    resumed = pair()
    for a, state in zip(resumed, saved):
        load_aggregator_state_dict(a, state)
    for xs in steps[3:]:
        want, got = run_in_process(straight, xs)[0], run_in_process(resumed, xs)[0]
        assert all(torch.equal(w, v) for w, v in zip(want, got))


def same_state(a, b) -> bool:
    """Two states of aggregator_state_dict equal, tensors by their values (bit for bit)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same_state(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(map(same_state, a, b))
    return a == b


def lossless_steps(agg, steps, seed):
    """Exact steps of 4 ranks (test_policy.run_steps: one aggregator stands in for each replica), 40 to 160
    non-zeros a rank; the payload sizes."""
    return [run_steps(agg, 4, 1, 40 + 40 * (step % 4), seed=seed * 1000 + step)[0] for step in range(steps)]


def test_a_lossless_aggregator_resumes_as_the_straight_run():
    """A capacity-policy aggregator saved mid-interval (its tracker holds averages, peaks and a resize history)
    and loaded into a fresh one holds the same state and codec, and the next steps' payloads and decisions
    are the straight run's. (Each field left out of the save or the load passed every test.)"""
    from lossless_hc.training.aggregate import TensorAggregator
    from lossless_hc.training.capacity import CapacityPolicy

    def make():
        return TensorAggregator("t", (20_000,), torch.float32, 4, 0.05, seed=3, policy=CapacityPolicy(interval=4))
    straight = make()
    lossless_steps(straight, 10, seed=0)
    saved = aggregator_state_dict(straight)
    assert straight.tracker.changes >= 1 and straight.tracker.peak_union > 0 and straight.union_capacity is not None
    resumed = make()
    load_aggregator_state_dict(resumed, saved)
    assert same_state(aggregator_state_dict(resumed), saved)
    assert resumed.codec.layout == straight.codec.layout
    assert lossless_steps(resumed, 9, seed=1) == lossless_steps(straight, 9, seed=1)
    assert same_state(aggregator_state_dict(resumed), aggregator_state_dict(straight))


@pytest.mark.parametrize("first, allowed", [("sketch", ("sketch",)), ("thc", ("thc",)), ("topk", ("topk",)),
                                            ("topk", None)])   # the last one changes plans: a history
def test_an_auto_aggregator_resumes_as_the_straight_run(first, allowed):
    """An auto plan saved after a few steps (mid-interval: a plan is due later) and loaded into fresh
    aggregators holds the same state, and the next steps' sums are the straight run's bits, over a re-plan."""
    from lossless_hc.training.step import run_in_process

    def pair():
        return [AutoAggregator("w", (4096,), torch.float32, 2, r, MODEL, lossy=True, first=first, interval=4,
                               allowed=allowed, lossy_min_bytes=0) for r in range(2)]
    g = torch.Generator().manual_seed(0)

    def inputs():
        xs = [torch.zeros(4096) for _ in range(2)]
        for x in xs:
            x[torch.randperm(4096, generator=g)[:200]] = torch.randn(200, generator=g)
        return xs
    steps = [inputs() for _ in range(11)]
    straight = pair()
    for xs in steps[:3]:
        run_in_process(straight, xs)
    saved = [aggregator_state_dict(a) for a in straight]
    resumed = pair()
    for a, state in zip(resumed, saved):
        load_aggregator_state_dict(a, state)
        assert same_state(aggregator_state_dict(a), state)
    for xs in steps[3:]:
        want, got = run_in_process(straight, xs)[0], run_in_process(resumed, xs)[0]
        assert all(torch.equal(w, v) for w, v in zip(want, got))
    assert all(same_state(aggregator_state_dict(a), aggregator_state_dict(b)) for a, b in zip(straight, resumed))
    assert straight[0].plans >= 2 and (straight[0].strategy == first or straight[0].history)


def test_an_auto_aggregator_saved_before_its_cost_model_plans_when_it_comes():
    """Built before the calibration (DDP's first step), an auto aggregator's first plan waits for the cost
    model (``plan_due``); saved then and resumed, it plans as the straight run when the model comes."""
    from lossless_hc.training.step import run_in_process

    def pair():
        return [AutoAggregator("w", (4096,), torch.float32, 2, r, None, lossy=True, interval=4, lossy_min_bytes=0,
                               topk_ratio=0.01, thc_bits=4) for r in range(2)]
    g = torch.Generator().manual_seed(0)
    steps = [[torch.randn(4096, generator=g) for _ in range(2)] for _ in range(4)]
    straight, resumed = pair(), pair()
    run_in_process(straight, steps[0])
    for a, b in zip(straight, resumed):
        state = aggregator_state_dict(a)
        assert state["plan_due"]
        load_aggregator_state_dict(b, state)
        assert same_state(aggregator_state_dict(b), state)
    for a in straight + resumed:
        a.cost_model = MODEL
    for xs in steps[1:]:
        want, got = run_in_process(straight, xs)[0], run_in_process(resumed, xs)[0]
        assert all(torch.equal(w, v) for w, v in zip(want, got))
    assert resumed[0].plans == straight[0].plans >= 1


def test_a_thc_aggregator_resumes_as_the_straight_run():
    """THC (``Compression.thc``) saved after a few steps carries its codecs' step, agreed norm and error memory:
    resumed on fresh aggregators, the next steps' decodes are the straight run's bits (a state not restored
    passed every other test)."""
    from lossless_hc.training.thc_aggregate import THCAggregator

    def ranks():
        return [THCAggregator("t", (4096,), torch.float32, 2, r, seed=5) for r in range(2)]

    def step(aggs, xs):
        encoded = [a.encode(x) for a, x in zip(aggs, xs)]
        summed = sum(p for p, _ in encoded)
        return [a.decode(summed.clone(), ctx).value for a, (_, ctx) in zip(aggs, encoded)]
    g = torch.Generator().manual_seed(0)
    steps = [[torch.randn(4096, generator=g) for _ in range(2)] for _ in range(6)]
    straight = ranks()
    for xs in steps[:3]:
        step(straight, xs)
    resumed = ranks()
    for a, b in zip(straight, resumed):
        state = aggregator_state_dict(a)
        assert "codec" in state
        load_aggregator_state_dict(b, state)
        assert same_state(aggregator_state_dict(b), state)
    for xs in steps[3:]:
        assert all(torch.equal(w, v) for w, v in zip(step(straight, xs), step(resumed, xs)))


def test_an_auto_state_from_before_last_step_observed_every_step():
    """A checkpoint written before the plan tracker kept ``last_step`` (the step of its last observation)
    comes from a tracker that observed every step: its last observation is its step count, so the next one
    weighs as one step, not as every step since 0."""
    from lossless_hc.training.step import run_in_process
    aggs = [auto(r) for r in range(2)]
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        run_in_process(aggs, [torch.randn(4096, generator=g) for _ in range(2)])
    state = aggregator_state_dict(aggs[0])
    del state["tracker"]["last_step"]
    agg = auto()
    load_aggregator_state_dict(agg, state)
    assert agg.tracker.last_step == agg.tracker.steps == state["tracker"]["steps"] > 0


def test_each_kind_is_saved_by_name_and_refused_by_the_others():
    """The saved ``kind`` names the aggregator ("lossless", "topk", "thc"), so a state never loads into an
    aggregator of another kind of the same shape and dtype (a top-k state into a lossless aggregator would
    drop its error feedback; a THC state into a lossless one would size a codec from nothing)."""
    from lossless_hc.training.aggregate import TensorAggregator
    from lossless_hc.training.thc_aggregate import THCAggregator
    makers = {"lossless": lambda: TensorAggregator("t", (4096,), torch.float32, 2, 0.01),
              "topk": lambda: TopKAggregator("t", (4096,), torch.float32, 2, ratio=0.01),
              "thc": lambda: THCAggregator("t", (4096,), torch.float32, 2, 0)}
    states = {kind: aggregator_state_dict(make()) for kind, make in makers.items()}
    assert {kind: state["kind"] for kind, state in states.items()} == {k: k for k in makers}
    for saved, state in states.items():
        for kind, make in makers.items():
            if kind != saved:
                with pytest.raises(ValueError, match=f"saved state is for a {saved} aggregator of torch.float32 "
                                                     f"\\[4096\\], this one is a {kind} aggregator"):
                    load_aggregator_state_dict(make(), state)


def test_an_auto_state_of_another_shape_or_dtype_is_refused():
    """An auto state (no top-k residual or THC state yet: nothing else of its size is checked) loads only
    into an auto aggregator of its shape and dtype; another is refused by name, not restored into it."""
    state = aggregator_state_dict(auto())
    assert state["topk_residual"] is None and state["thc"] is None
    for shape, dtype in (((64, 64), torch.float32), ((4096,), torch.float64), ((2048,), torch.float32)):
        other = AutoAggregator("w", shape, dtype, 2, 0, MODEL, lossy=True, first="topk", lossy_min_bytes=0)
        with pytest.raises(ValueError, match="saved state is for a auto aggregator of torch.float32 \\[4096\\], "
                                             f"this one is an auto aggregator of {dtype}"):
            load_aggregator_state_dict(other, state)


def test_a_thc_state_and_an_aggregator_that_disagree_on_compressing_are_refused():
    """A THC state saved while compressing (it holds the codec's step, norm and error memory) does not load
    into a THC aggregator that sends the tensor dense (``exact=True``), nor the other way round: either
    would silently drop or lack the codec's state."""
    from lossless_hc.training.thc_aggregate import THCAggregator
    compressing = THCAggregator("t", (4096,), torch.float32, 2, 0)
    dense = THCAggregator("t", (4096,), torch.float32, 2, 0, exact=True)
    assert compressing.compressed and not dense.compressed
    for saved, into in ((compressing, dense), (dense, compressing)):
        with pytest.raises(ValueError, match="disagree on whether THC compresses it"):
            load_aggregator_state_dict(into, aggregator_state_dict(saved))


def test_an_auto_state_from_before_plan_due_has_no_plan_due():
    """A checkpoint written before ``plan_due`` existed had none pending: loaded into an auto aggregator
    without a cost model, its plan is the saved one (a plan due there raised: no cost model is set)."""
    state = aggregator_state_dict(auto())
    del state["plan_due"]
    agg = AutoAggregator("w", (4096,), torch.float32, 2, 0, None, lossy=True, first="topk", lossy_min_bytes=0,
                         topk_ratio=0.01, thc_bits=4)
    load_aggregator_state_dict(agg, state)
    assert agg.current_plan() == ("topk", None)
