"""Checkpointing an aggregator's state (lossless_hc.training.checkpoint), in one process: what a load
refuses before touching the aggregator, and what it leaves of an aggregator that trained since."""
import pytest
import torch

from lossless_hc.training.aggregate import TopKAggregator
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
