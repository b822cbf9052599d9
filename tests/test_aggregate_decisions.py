"""TensorAggregator's per-tensor decisions (lossless_hc.training.aggregate), in one process, at their edges:
block sizes, capacities rounded to blocks, when the codec is used, and what a decode changes."""
import torch

from lossless_hc.training.aggregate import TensorAggregator, default_block_size


def test_a_matrix_without_columns_hashes_keys_of_one_coordinate():
    """A 2-D tensor's keys are its rows only where a row has coordinates: a (rows, 0) gradient gets blocks
    of 1 (a block of 0 coordinates would divide by zero), and its aggregator sends it dense as it is."""
    assert default_block_size((5, 0)) == 1
    assert default_block_size((0, 3)) == 3
    agg = TensorAggregator("t", (5, 0), torch.float32, 2, 0.5)
    assert agg.block_size == 1 and not agg.compressed
    x = torch.zeros(5, 0)
    payload, ctx = agg.encode(x)
    assert payload is x and agg.decode(payload, ctx).value is x
