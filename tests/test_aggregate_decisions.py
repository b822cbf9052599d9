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


def test_an_aggregator_built_with_its_defaults_decodes_with_one_from_the_default_lossless_spec():
    """The constructor's default seed is Compression.lossless()'s (0): a rank that builds its aggregator
    directly and one that builds it from the spec hash alike, so their summed payloads decode exactly
    (different seeds are a ConfigurationMismatch)."""
    from lossless_hc.training.adapter import LosslessSpec
    from lossless_hc.training.aggregate import AggregationStats
    spec_built = LosslessSpec(max_density=0.05).make("t", torch.zeros(1000, 16), 2, 0, AggregationStats(), "cpu")
    direct = TensorAggregator("t", (1000, 16), torch.float32, 2, 0.05)
    assert spec_built.seed == direct.seed == 0
    xs = [torch.zeros(1000, 16), torch.zeros(1000, 16)]
    xs[0][[3, 500]] = 1.5
    xs[1][[3, 999]] = 2.0
    encoded = [a.encode(x) for a, x in zip((spec_built, direct), xs)]
    total = encoded[0][0] + encoded[1][0]
    for a, (_, ctx) in zip((spec_built, direct), encoded):
        out = a.decode(total.clone(), ctx)
        assert out.report.ok and torch.equal(out.value, xs[0] + xs[1])
