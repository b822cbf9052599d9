"""THCAggregator (lossless_hc.training.thc_aggregate) beyond tests/test_aggregate.py: its defaults, how
it reports the way each tensor goes out (dense where THC's payload is not strictly smaller), a tensor of one
block shorter than the block, its error memory, its timing statistics and the message of a failed decode."""
import types

import pytest
import torch

import lossless_hc as lhc
from lossless_hc.training import aggregate as aggregate_module
from lossless_hc.training import thc_aggregate
from lossless_hc.training.aggregate import ConfigurationMismatch
from lossless_hc.training.thc_aggregate import THCAggregator

from test_aggregate import aggregate


def test_thc_aggregator_defaults_are_the_documented_thc_configuration():
    """THCAggregator's defaults are THCCodec's (bits=4, granularity=30, overflow_freq=32, seed=0, not exact):
    a 1024-coordinate tensor (one block, no interleave) gives the payload of THCCodec(1024, n, rank)."""
    agg = THCAggregator("w", (1024,), torch.float32, 2, 1)
    assert agg.compressed and not agg.exact and not agg.interleaved
    c = agg.codec
    assert (c.table.bits, c.granularity, c.overflow_freq, c.seed, c.non_finite) == (4, 30, 32.0, 0, "raise")
    codec = lhc.THCCodec(1024, 2, rank=1)
    x = torch.randn(1024, generator=torch.Generator().manual_seed(1))
    payload, _ = agg.encode(x)
    assert torch.equal(payload, codec.encode(x))


def test_sent_as_names_how_each_tensor_goes_out():
    """sent_as (the plugins' stats): "thc" for one Hadamard block, "thc-interleaved" for more, "dense (exact=)"
    when asked for, "dense (smaller)" when THC's payload would not be smaller or the dtype is no float."""
    one_block = THCAggregator("w", (1024,), torch.float32, 4, 0)
    blocks = THCAggregator("w", (64, 100), torch.float32, 4, 0)
    two_blocks = THCAggregator("w", (2048,), torch.float32, 4, 0)
    exact = THCAggregator("w", (64, 100), torch.float32, 4, 0, exact=True)
    tiny = THCAggregator("bias", (4,), torch.float32, 4, 0)
    ints = THCAggregator("steps", (4096,), torch.int64, 4, 0)
    assert one_block.sent_as == "thc" and not one_block.interleaved and one_block.compressed
    assert blocks.sent_as == "thc-interleaved" and blocks.interleaved and blocks.compressed
    assert two_blocks.sent_as == "thc-interleaved" and two_blocks.interleaved
    assert exact.sent_as == "dense (exact=)" and not exact.compressed and not exact.interleaved
    assert tiny.sent_as == "dense (smaller)" and not tiny.compressed
    assert ints.sent_as == "dense (smaller)" and ints.payload_spec() == (4096, torch.int64)


def test_a_single_block_tensor_shorter_than_its_block_is_encoded_as_it_is():
    """A tensor of one Hadamard block whose numel is not the block's (1000 coordinates, padded to 1024) is not
    interleaved: its error memory is THCCodec(1000)'s bit for bit at every step, the norm-only first step leaves
    exactly the gradient there (1000 coordinates, the tensor's order), and error feedback conserves the sum."""
    n = 2
    aggs = [THCAggregator("w", (1000,), torch.float32, n, rank=r, seed=7) for r in range(n)]
    codecs = [lhc.THCCodec(1000, n, rank=r, seed=7) for r in range(n)]
    assert all(a.compressed and not a.interleaved and a.sent_as == "thc" for a in aggs)
    g = torch.Generator().manual_seed(2)
    fed = torch.zeros(1000, dtype=torch.float64)
    decoded = torch.zeros(1000, dtype=torch.float64)
    for step in range(3):
        xs = [torch.randn(1000, generator=g) for _ in range(n)]
        want = [c.encode(x) for c, x in zip(codecs, xs)]
        outs = aggregate(aggs, xs)
        for c in codecs:
            c.decode(sum(want))
        assert all(torch.equal(a.codec.error, c.error) for a, c in zip(aggs, codecs))
        if step == 0:   # the norm-only round: everything stays owed
            assert all(torch.equal(a.pending_error(), x) for a, x in zip(aggs, xs))
        fed += sum(xs).double()
        decoded += outs[0].value.double()
    held = sum(a.pending_error().double() for a in aggs)
    torch.testing.assert_close(decoded + held, fed, rtol=0, atol=1e-3)


def test_pending_error_is_none_for_a_tensor_sent_dense():
    """pending_error() is None where no codec holds an error memory: tiny, exact= and integer tensors."""
    for agg in (THCAggregator("bias", (4,), torch.float32, 2, 0),
                THCAggregator("w", (64, 100), torch.float32, 2, 0, exact=True),
                THCAggregator("steps", (4096,), torch.int64, 2, 0)):
        assert not agg.compressed
        agg.encode(torch.zeros(agg.shape, dtype=agg.dtype))
        assert agg.pending_error() is None


def test_empty_tensors_are_sent_dense():
    """An empty tensor (nothing for THC's codec, which refuses numel=0) goes dense: its decode is the engine's
    aggregate as it is (not averaged), in its own empty shape."""
    for shape in [(0,), (3, 0)]:
        aggs = [THCAggregator("e", shape, torch.float32, 2, rank=r) for r in range(2)]
        assert not aggs[0].compressed and aggs[0].sent_as == "dense (smaller)" and aggs[0].pending_error() is None
        outs = aggregate(aggs, [torch.zeros(shape) for _ in range(2)])
        assert outs[0].value.shape == shape and not outs[0].averaged


def test_a_payload_as_large_as_the_dense_tensor_is_not_used():
    """THC is used only where its payload is strictly smaller than the dense tensor: 96 float16 coordinates
    on 2 ranks make a 192-byte payload, the tensor's own size, so the tensor goes dense; 128 go through THC."""
    equal = THCAggregator("b", (96,), torch.float16, 2, 0)
    assert lhc.THCCodec(96, 2, rank=0).wire_bytes == 96 * 2
    assert not equal.compressed and equal.sent_as == "dense (smaller)" and equal.payload_spec() == (96, torch.float16)
    x = torch.randn(96).half()
    assert equal.encode(x)[0] is x
    smaller = THCAggregator("b", (128,), torch.float16, 2, 0)
    assert smaller.compressed and smaller.codec.wire_bytes < 128 * 2


def test_encode_and_decode_seconds_add_each_call_s_own_time(monkeypatch):
    """encode_seconds and decode_seconds add each call's clock difference (a clock that ticks one second per
    reading: exactly one second per encode and per decode of a compressed tensor)."""
    ticks = iter(range(1, 1_000_000))
    clock = types.SimpleNamespace(perf_counter=lambda: float(next(ticks)))
    monkeypatch.setattr(thc_aggregate, "time", clock)
    monkeypatch.setattr(aggregate_module, "time", clock)
    aggs = [THCAggregator("w", (64, 100), torch.float32, 2, rank=r) for r in range(2)]
    g = torch.Generator().manual_seed(0)
    for step in range(1, 4):
        aggregate(aggs, [torch.randn(64, 100, generator=g) for _ in range(2)])
        assert all((a.stats.encode_seconds, a.stats.decode_seconds) == (float(step), float(step)) for a in aggs)


def test_a_mismatch_with_every_rank_present_blames_no_missing_rank():
    """Every rank sent, one of them with another seed: whether the engine's op is a SUM or an AVERAGE, the
    ConfigurationMismatch says the fingerprints disagree and names no rank as having sent nothing."""
    n = 3
    for averages in (False, True):
        aggs = [THCAggregator("w", (1024,), torch.float32, n, r, seed=int(r == 2)) for r in range(n)]
        payloads, ctxs = zip(*(a.encode(torch.ones(1024)) for a in aggs))
        for a in aggs:
            a.engine_averages = averages
        with pytest.raises(ConfigurationMismatch, match="fingerprints disagree") as info:
            aggs[0].decode(sum(payloads) / (n if averages else 1), ctxs[0])
        assert "sent nothing" not in str(info.value), averages


def test_the_codec_takes_torch_s_thread_count_at_every_encode_and_decode():
    """The codec's kernels use torch.get_num_threads() threads, read at every encode and at every decode (a DDP
    hook decodes on a communication thread, where OpenMP's own default would be every core)."""
    threads = torch.get_num_threads()   # this process's thread count: restored below
    try:
        aggs = [THCAggregator("w", (64, 100), torch.float32, 2, rank=r) for r in range(2)]
        torch.set_num_threads(1)
        encoded = [a.encode(torch.ones(64, 100)) for a in aggs]
        assert [a.codec.num_threads for a in aggs] == [1, 1]
        torch.set_num_threads(2)
        total = sum(p for p, _ in encoded)
        for a, (_, ctx) in zip(aggs, encoded):
            a.decode(total.clone(), ctx)
        assert [a.codec.num_threads for a in aggs] == [2, 2]
    finally:
        torch.set_num_threads(threads)
