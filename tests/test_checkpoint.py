"""Checkpointing an aggregator's state (lossless_hc.training.checkpoint), in one process: what a load
refuses before touching the aggregator, and what it leaves of an aggregator that trained since."""
import pytest
import torch

from lossless_hc.training.topk_aggregate import TopKAggregator
from lossless_hc.training.checkpoint import aggregator_state_dict, load_aggregator_state_dict
from lossless_hc.training.planner import Calibration, CostModel
from lossless_hc.training.strategies import AutoAggregator

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
