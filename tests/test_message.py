"""Many tensors in one message (lossless_hc.training.message, what the DDP and FSDP2 adapters share), in
one process: ranks are simulated by summing their message parts, as the engine's collectives would."""
import math

import pytest
import torch

import lossless_hc as lhc
from lossless_hc.training.aggregate import TensorAggregator
from lossless_hc.training.topk_aggregate import TopKAggregator
from lossless_hc.training.message import (SEPARATE_PART_MIN_BYTES, decode_message, decode_segments, encode_message,
                                          in_place_outputs, message_layout)
from lossless_hc.training.thc_aggregate import THCAggregator


def test_thc_message_decodes_into_the_given_outputs():
    """decode_message(..., outs=): THC's aggregators write each result into its out (what the DDP hook
    passes: the gradient's own slice of the bucket) and return it in the tensor's shape, the same bits as
    a decode into a fresh tensor; a tensor sent dense returns its segment of the sum, whatever its out."""
    n, shapes = 2, [(300, 70), (4,), (5000,)]
    fresh = [[THCAggregator(f"t{i}", s, torch.float32, n, rank=r, seed=1) for i, s in enumerate(shapes)]
             for r in range(n)]
    into = [[THCAggregator(f"t{i}", s, torch.float32, n, rank=r, seed=1) for i, s in enumerate(shapes)]
            for r in range(n)]
    assert [a.compressed for a in fresh[0]] == [True, False, True]
    g = torch.Generator().manual_seed(2)
    for step in range(3):
        xs = [[torch.randn(s, generator=g) for s in shapes] for _ in range(n)]
        mf = [encode_message(fresh[r], [x.clone() for x in xs[r]]) for r in range(n)]
        mi = [encode_message(into[r], [x.clone() for x in xs[r]]) for r in range(n)]
        assert len(mf[0].parts) == 1   # the 4 float32 coordinates sent dense join the float64 part
        sf, si = [sum(m.parts[0] for m in mf)], [sum(m.parts[0] for m in mi)]
        assert torch.equal(sf[0], si[0])
        for r in range(n):
            want = decode_message(mf[r], sf, dense_sum=None)
            bucket = torch.full((sum(math.prod(s) for s in shapes),), float("nan"))
            outs = list(torch.split(bucket, [math.prod(s) for s in shapes]))
            got = decode_message(mi[r], si, dense_sum=None, outs=outs)
            for i, (w, v) in enumerate(zip(want, got)):
                assert v.shape == w.shape and torch.equal(v, w), (step, r, i)
                assert (v.data_ptr() == outs[i].data_ptr()) == fresh[r][i].compressed


@pytest.mark.parametrize("kind", ["thc", "lossless", "topk"])
def test_message_is_encoded_into_its_slices(kind):
    """encode_message: each compressed payload is written into its slice of the message (every
    aggregator's payload size is known before encoding), a tensor sent dense is copied in, and the
    message is the same tensor as the concatenation of the payloads that the same aggregators encode
    alone; summed in place (as the adapters' all-reduce does, so the payloads' slices then hold the
    sum), it decodes to the same bits. A payload of integer words is refused (THC's int64 words: their
    norm slots are float64 bits, which a float message would convert)."""
    n, shapes = 2, [(300, 70), (4,), (5000,)]

    def make(r):
        if kind == "thc":
            return [THCAggregator(f"t{i}", s, torch.float32, n, rank=r, seed=3) for i, s in enumerate(shapes)]
        if kind == "lossless":
            return [TensorAggregator(f"t{i}", s, torch.float32, n, max_density=0.1, seed=3)
                    for i, s in enumerate(shapes)]
        return [TopKAggregator(f"t{i}", s, torch.float32, n, ratio=0.05, seed=3) for i, s in enumerate(shapes)]
    in_message, alone = [make(r) for r in range(n)], [make(r) for r in range(n)]
    wide = torch.float64 if kind == "thc" else torch.float32
    assert [a.compressed for a in in_message[0]] == [True, False, True]
    assert [a.payload_spec()[1] for a in in_message[0]] == [wide, torch.float32, wide]
    g = torch.Generator().manual_seed(4)
    for step in range(3):
        # 3% of the rows (the lossless block of a 2-D tensor is its row), 3% of a vector's coordinates
        xs = [[torch.randn(s, generator=g) * (torch.rand(s[:1] + (1,) * (len(s) - 1), generator=g) < 0.03)
               for s in shapes] for _ in range(n)]
        ms = [encode_message(in_message[r], [x.clone() for x in xs[r]]) for r in range(n)]
        payloads = [[a.encode(x.clone()) for a, x in zip(alone[r], xs[r])] for r in range(n)]
        for r, m in enumerate(ms):
            assert [p.dtype for p in m.parts] == [wide]   # 16 bytes of widening: not worth a collective
            message = m.parts[0]
            assert torch.equal(message, torch.cat([p.reshape(-1).to(wide) for p, _ in payloads[r]]))
            base, end = message.data_ptr(), message.data_ptr() + message.element_size() * message.numel()
            assert [base <= p.data_ptr() < end for p, _ in m.encoded] == [True, False, True]
            assert m.encoded[1][0].dtype == torch.float32   # the dense tensor's payload is itself
        summed = sum(m.parts[0] for m in ms)
        for m in ms:
            m.parts[0].copy_(summed)
        for r in range(n):
            got = decode_segments(ms[r], ms[r].parts)
            sums = [sum(payloads[q][i][0] for q in range(n)) for i in range(len(shapes))]
            want = [a.decode(s.to(p.dtype), ctx) for a, s, (p, ctx) in zip(alone[r], sums, payloads[r])]
            for o, w in zip(got, want):
                assert o.value is not None   # every tensor decoded (a few keys may be INEXACT: listed alike)
                assert torch.equal(o.value, w.value), (step, r)
                assert (o.partial is None and w.partial is None) or torch.equal(o.partial, w.partial)
    if kind == "thc":
        words = THCAggregator("w", (5000,), torch.float32, n, rank=0)
        words._codec = lhc.THCCodec(**dict(words._codec_args, payload_dtype=torch.int64))
        with pytest.raises(TypeError, match="floating-point payloads"):
            encode_message([words], [torch.randn(5000)])


def test_message_parts_follow_the_payload_dtypes():
    """message_layout: one part per payload dtype (float64, float32, bfloat16, float16; float8 in the
    float32 part); a narrower part whose widening costs fewer than SEPARATE_PART_MIN_BYTES joins the
    narrowest wider part that holds it exactly (never a half precision into the other)."""
    f64, f32, f16, bf16 = torch.float64, torch.float32, torch.float16, torch.bfloat16
    big = SEPARATE_PART_MIN_BYTES // 2            # bfloat16 elements whose widening to float32 costs the minimum
    assert message_layout([(100, f32), (big, bf16), (7, f32)]) == ([f32, bf16], [107, big], [(0, 0), (1, 0), (0, 100)])
    assert message_layout([(100, f32), (big - 1, bf16)])[:2] == ([f32], [100 + big - 1])
    assert message_layout([(big, bf16), (3, bf16)])[:2] == ([bf16], [big + 3])   # all sent as they are
    assert message_layout([(big, f16)])[:2] == ([f16], [big])
    assert message_layout([(big, torch.float8_e4m3fn)])[:2] == ([f32], [big])
    assert message_layout([(3, bf16), (5, f16)])[:2] == ([bf16, f16], [3, 5])     # neither holds the other
    assert message_layout([(3, f32), (5, bf16), (big, f16)])[:2] == ([f32, f16], [8, big])
    assert message_layout([(3, f64), (5, bf16)])[:2] == ([f64], [8])
    # a dtype kept (an auto fp16/bf16 plan's plain step, narrowed on purpose) stays apart however small
    assert message_layout([(100, f32), (5, bf16), (7, f16)], keep={bf16})[:2] == ([f32, bf16], [107, 5])
    assert message_layout([(10, f64), (big // 2, f32)])[:2] == ([f64, f32], [10, big // 2])
    assert message_layout([(10, f64), (big // 2 - 1, f32)])[:2] == ([f64], [10 + big // 2 - 1])
    # a bfloat16 part too small on its own joins float32, which then joins float64 with it
    assert message_layout([(10, f64), (big // 8, f32), (big // 8, bf16)])[:2] == ([f64], [10 + big // 4])
    # ... priced with what it holds then: float32 that would join float64 alone stays apart with bfloat16 in it
    assert message_layout([(10, f64), (big // 2 - 1, f32), (big // 2, bf16)])[:2] == ([f64, f32], [10, big - 1])
    assert message_layout([]) == ([], [], [])
    with pytest.raises(TypeError, match="floating-point payloads"):
        message_layout([(3, torch.int64)])


def test_the_calibrated_link_prices_the_part_rule():
    """Given the calibrated link (auto's messages and the planner's price of them), a narrower part is
    widened where one allreduce of the widened bytes is predicted to cost less than two allreduces: on a
    10 Mbit/s link 12 KB of float32 beside THC's float64 words travel apart (widened, ~14 ms more on the
    wire; apart, one latency of 0.3 ms), where the fixed rule widens them; on a 10 Gbit/s link with 2 ms per
    hop 1 MiB of them are widened, where the fixed rule sends them apart. A half part is priced at the half
    allreduce's own slope. One rank, or no link: the fixed rule."""
    from lossless_hc.training.auto import AutoMessage
    from lossless_hc.training.planner import Calibration, CostModel, LinkModel
    from lossless_hc.training.strategies import AutoAggregator
    f64, f32, bf16 = torch.float64, torch.float32, torch.bfloat16
    slow, far = LinkModel(50e-6, 8 / 10e6), LinkModel(2e-3, 8 / 10e9)
    small, big = [(10, f64), (3000, f32)], [(10, f64), (1 << 18, f32)]
    assert message_layout(small)[:2] == ([f64], [3010])
    assert message_layout(small, link=slow, world_size=4)[:2] == ([f64, f32], [10, 3000])
    assert message_layout(small, link=slow, world_size=1)[:2] == ([f64], [3010])
    assert message_layout(big)[:2] == ([f64, f32], [10, 1 << 18])
    assert message_layout(big, link=far, world_size=4)[:2] == ([f64], [10 + (1 << 18)])
    # 4 MiB of bfloat16: apart at the float32 slope, widened where the half allreduce costs twice per byte
    half = [(10, f32), (1 << 21, bf16)]
    assert message_layout(half, link=LinkModel(50e-6, 8e-9), world_size=2)[:2] == ([f32, bf16], [10, 1 << 21])
    assert message_layout(half, link=LinkModel(50e-6, 8e-9, half_seconds_per_byte=16e-9), world_size=2)[:2] == \
        ([f32], [10 + (1 << 21)])
    # AutoMessage lays out with its aggregators' link: a bfloat16 gradient's statistics step (a float32
    # header, its body in bfloat16) of 512 KiB: apart at 1 Gbit/s and 50 us, widened on the far link
    x = torch.randn(1 << 18).to(bf16)
    for link, dtypes in ((Calibration.default().link, [f32, bf16]), (far, [f32])):
        agg = AutoAggregator("w", (1 << 18,), bf16, 2, 0, CostModel(Calibration(link)))
        agg.plain_dtype = bf16
        assert [p.dtype for p in AutoMessage([agg], [x]).parts] == dtypes


def test_a_widened_payload_is_counted_as_sent():
    """A small bfloat16 tensor sent as it is joins the float32 part: its AggregationStats count the four
    bytes per coordinate it crosses the wire in, not its own two (encode_message and AutoMessage)."""
    from lossless_hc.training.auto import AutoMessage
    from lossless_hc.training.planner import Calibration, CostModel
    from lossless_hc.training.strategies import AutoAggregator
    small = TensorAggregator("small", (1000,), torch.bfloat16, 2, max_density=0.9, seed=1)
    sparse = TensorAggregator("sparse", (4096, 64), torch.float32, 2, max_density=0.05, seed=1)
    assert not small.compressed and sparse.compressed
    x = (torch.randn(4096, 64) * (torch.rand(4096, 1) < 0.02))
    m = encode_message([small, sparse], [torch.randn(1000).to(torch.bfloat16), x])
    assert [p.dtype for p in m.parts] == [torch.float32]
    assert small.stats.payload_bytes == 4000 and small.stats.dense_bytes == 2000
    assert sparse.stats.payload_bytes == sparse.codec.payload_numel * 4
    model = CostModel(Calibration.default())
    plain = AutoAggregator("plain", (1000,), torch.bfloat16, 1, 0, model, interval=8)
    plain.plain_dtype = torch.bfloat16   # as AutoSpec.native_plain_dtypes sets it under DDP
    payload, ctx = plain.encode(torch.randn(1000).to(torch.bfloat16))   # the first step carries statistics
    plain.decode(payload, ctx)
    assert not plain.carries_statistics()
    other = AutoAggregator("other", (10,), torch.float32, 1, 0, model)
    before = plain.stats.payload_bytes
    am = AutoMessage([plain, other], [torch.randn(1000).to(torch.bfloat16), torch.randn(10)])
    assert [p.dtype for p in am.parts] == [torch.float32] and am.encoded[0][0].dtype == torch.bfloat16
    assert plain.stats.payload_bytes - before == 4000


def test_a_half_precision_fallback_counts_the_float32_it_travels_in():
    """A bfloat16 tensor whose decode fails is re-sent in decode_message's float32 dense SUM: its stats count
    the codec's payload and four bytes per coordinate of the fallback, not the tensor's own two."""
    n = 2
    aggs = [TensorAggregator("t", (1000, 16), torch.bfloat16, n, max_density=0.01, seed=1) for _ in range(n)]
    g = torch.Generator().manual_seed(2)
    xs = [torch.randn(1000, 16, generator=g).to(torch.bfloat16) for _ in range(n)]   # every row: over capacity
    wire = aggs[0].codec.layout.payload_numel * 4
    ms = [encode_message([a], [x]) for a, x in zip(aggs, xs)]
    summed = [sum(m.parts[i] for m in ms) for i in range(len(ms[0].parts))]
    (y,) = decode_message(ms[0], summed, lambda t: t.add_(xs[1].reshape(-1).float()))   # the other rank's values
    assert torch.equal(y.reshape(1000, 16), xs[0].float() + xs[1].float())   # the exact dense sum, float32
    assert (aggs[0].stats.fallbacks, aggs[0].stats.payload_bytes) == (1, wire + 1000 * 16 * 4)


@pytest.mark.parametrize("numel", [1 << 18, 1000])
def test_auto_statistics_steps_carry_a_half_precision_body_in_its_dtype(numel):
    """auto's statistics step of a dense bfloat16 plan (the first step: one in 16 after it) sends its body
    in bfloat16 where the engine carries it (plain_dtype, as DDP and FSDP2 set it), beside the float32
    header, summed as bfloat16 as its plain steps and DDP's allreduce sum it (before: float32, twice the
    bytes); a body too small for a part of its own joins the header's, widened (exact). Decoded, the sum."""
    from lossless_hc.training.auto import AutoMessage, decode_message as decode_auto_message
    from lossless_hc.training.planner import Calibration, CostModel
    from lossless_hc.training.plan_stats import stats_header_words
    from lossless_hc.training.strategies import AutoAggregator
    n, model = 2, CostModel(Calibration.default())
    aggs = [AutoAggregator("w", (numel,), torch.bfloat16, n, r, model) for r in range(n)]
    for a in aggs:
        a.plain_dtype = torch.bfloat16
        assert a.carries_statistics() and a.strategy == "dense"
    g = torch.Generator().manual_seed(7)
    xs = [torch.randn(numel, generator=g).to(torch.bfloat16) for _ in range(n)]
    ms = [AutoMessage([a], [x]) for a, x in zip(aggs, xs)]
    H = stats_header_words(n)
    big = numel * 2 >= SEPARATE_PART_MIN_BYTES
    assert [p.dtype for p in ms[0].parts] == ([torch.float32, torch.bfloat16] if big else [torch.float32])
    assert aggs[0].stats.payload_bytes == aggs[0].bytes_sent == 4 * H + numel * (2 if big else 4)
    summed = [ms[0].parts[i] + ms[1].parts[i] for i in range(len(ms[0].parts))]
    for m in ms:
        (value,) = decode_auto_message(m, summed, allreduce=None, allgather=None)
        assert value.dtype == torch.bfloat16 and torch.equal(value, xs[0] + xs[1])


def test_a_bfloat16_tensor_sent_as_it_is_travels_and_sums_as_bfloat16():
    """A bfloat16 bucket whose large tensor is sent as it is (its sketch would not be smaller) and whose
    small one is compressed: two parts, the large tensor's bfloat16 (its own bytes, not float32's)
    summed as bfloat16 as DDP's allreduce sums it; the compressed one decodes within the contract."""
    n, dense_numel = 2, 1 << 18
    aggs = [[TensorAggregator("dense", (dense_numel,), torch.bfloat16, n, max_density=0.9, seed=5),
             TensorAggregator("sparse", (4096, 64), torch.bfloat16, n, max_density=0.05, seed=5)] for _ in range(n)]
    assert [a.compressed for a in aggs[0]] == [False, True]
    g = torch.Generator().manual_seed(6)
    xs = [[torch.randn(dense_numel, generator=g).to(torch.bfloat16),
           (torch.randn(4096, 64, generator=g) * (torch.rand(4096, 1, generator=g) < 0.02)).to(torch.bfloat16)]
          for _ in range(n)]
    ms = [encode_message(aggs[r], xs[r]) for r in range(n)]
    assert [p.dtype for p in ms[0].parts] == [torch.float32, torch.bfloat16]
    assert ms[0].parts[1].numel() == dense_numel
    summed = [ms[0].parts[j] + ms[1].parts[j] for j in range(2)]
    # Rank 1's re-aggregation values (inexact rows), then rank 0's SUM of both: the second collective.
    sent = []
    decode_message(ms[1], summed, dense_sum=lambda t: sent.append(t.clone()))
    dense, sparse = decode_message(ms[0], summed, dense_sum=lambda t: t.add_(sent[0]))
    assert dense.dtype == torch.bfloat16 and torch.equal(dense, xs[0][0] + xs[1][0])
    exact = xs[0][1].double() + xs[1][1].double()
    assert sparse.dtype == torch.bfloat16 and torch.equal(sparse != 0, exact != 0)
    assert torch.allclose(sparse.double(), exact, rtol=2 ** -10 + 2 ** -8, atol=0)


def test_in_place_outputs_only_where_nothing_reads_the_encoded_tensor():
    """in_place_outputs: a THC tensor's slot takes its result when the kernels can write it (contiguous
    float32 without a graph); a lossless or top-k tensor's never (its fallback reads the encoded
    tensor after decoding); None when no slot qualifies."""
    thc = THCAggregator("t", (5000,), torch.float32, 2, rank=0)
    lossless = TensorAggregator("l", (5000,), torch.float32, 2, max_density=0.05)
    topk = TopKAggregator("k", (5000,), torch.float32, 2, ratio=0.05)
    slot = torch.zeros(5000)
    outs = in_place_outputs([thc, lossless, topk], [slot, slot.clone(), slot.clone()])
    assert outs[0] is slot and outs[1] is None and outs[2] is None
    assert in_place_outputs([lossless, topk], [slot, slot]) is None
    for bad in (torch.zeros(5000, dtype=torch.float64), torch.zeros(10000)[::2], torch.zeros(5000, requires_grad=True)):
        assert in_place_outputs([thc], [bad]) is None


def test_a_bucket_of_tensors_sent_as_they_are_is_its_own_message():
    """encode_message(..., buffer=): where every tensor is sent as it is and they are the buffer's
    consecutive slices (a DDP bucket), the buffer itself is the message's one part (nothing copied) and
    each decoded result is its tensor's slice of the summed buffer; a compressed tensor among them, or
    tensors that are not the buffer's slices, get a message of their own."""
    n = 2
    shapes = [(300,), (20, 5)]   # at max_density 0.9 a sketch is never smaller: sent as they are
    aggs = [[TensorAggregator(f"t{i}", s, torch.float32, n, max_density=0.9) for i, s in enumerate(shapes)]
            for _ in range(n)]
    assert not any(a.compressed for a in aggs[0])
    g = torch.Generator().manual_seed(7)
    buffers = [torch.randn(400, generator=g) for _ in range(n)]
    views = [list(torch.split(b, [300, 100])) for b in buffers]
    grads = [[v.view(s) for v, s in zip(vs, shapes)] for vs in views]
    want = buffers[0] + buffers[1]
    ms = [encode_message(aggs[r], grads[r], buffer=buffers[r]) for r in range(n)]
    assert all(len(m.parts) == 1 and m.parts[0].data_ptr() == b.data_ptr() for m, b in zip(ms, buffers))
    for b in buffers:
        b.copy_(want)   # the engine's in-place SUM
    for r in range(n):
        results = decode_message(ms[r], ms[r].parts, dense_sum=None)
        for value, view in zip(results, views[r]):
            assert value.data_ptr() == view.data_ptr() and torch.equal(value.reshape(-1), view)
    # a compressed tensor in the bucket: a message of its own
    mixed = [TensorAggregator("c", (300,), torch.float32, n, max_density=0.05), aggs[0][1]]
    sparse = torch.zeros(400)
    sparse[:3] = 1.0
    m = encode_message(mixed, [sparse[:300], sparse[300:].view(20, 5)], buffer=sparse)
    assert mixed[0].compressed and all(p.data_ptr() != sparse.data_ptr() for p in m.parts)
    # tensors that are not the buffer's slices (copies): a message of its own
    m = encode_message(aggs[0], [grads[0][0].clone(), grads[0][1]], buffer=buffers[0])
    assert m.parts[0].data_ptr() != buffers[0].data_ptr()


@pytest.mark.parametrize("negative", ["tensors", "buffer"])
def test_a_bucket_seen_through_a_negative_view_sends_the_tensors_values(negative):
    """Tensors that are negative views of the buffer's slices, or slices of a buffer that is a negative
    view, sum to their values: the engine sums memory, so the buffer is not the message then (it was,
    and every sum came back negated)."""
    n = 2
    shapes = [(300,), (20, 5)]
    aggs = [[TensorAggregator(f"t{i}", s, torch.float32, n, max_density=0.9) for i, s in enumerate(shapes)]
            for _ in range(n)]
    g = torch.Generator().manual_seed(8)
    memory = [torch.randn(400, generator=g) for _ in range(n)]
    if negative == "tensors":
        buffers = memory
        grads = [[torch._neg_view(v).view(s) for v, s in zip(torch.split(b, [300, 100]), shapes)] for b in memory]
    else:
        buffers = [torch._neg_view(b) for b in memory]
        grads = [[v.view(s) for v, s in zip(torch.split(b, [300, 100]), shapes)] for b in memory]
    ms = [encode_message(aggs[r], grads[r], buffer=buffers[r]) for r in range(n)]
    assert all(m.parts[0].data_ptr() != b.data_ptr() for m, b in zip(ms, memory))
    results = decode_message(ms[0], [ms[0].parts[0] + ms[1].parts[0]], dense_sum=None)
    for i, value in enumerate(results):
        assert torch.equal(value.reshape(-1), (grads[0][i] + grads[1][i]).reshape(-1))


def test_a_zero_element_tensor_keeps_the_bucket_its_own_message():
    """An empty parameter in a DDP bucket (its gradient has no memory: data_ptr 0) is at its place in the
    buffer: the bucket still is the message (it was copied into a new one every step)."""
    shapes = [(300,), (0,), (100,)]
    aggs = [TensorAggregator(f"t{i}", s, torch.float32, 2, max_density=0.9) for i, s in enumerate(shapes)]
    buffer = torch.randn(400)
    grads = list(torch.split(buffer, [300, 0, 100]))
    assert grads[1].data_ptr() == 0
    m = encode_message(aggs, grads, buffer=buffer)
    assert len(m.parts) == 1 and m.parts[0].data_ptr() == buffer.data_ptr()
    results = decode_message(m, m.parts, dense_sum=None)
    assert [tuple(v.shape) for v in results] == [(300,), (0,), (100,)]


def test_misfitted_messages_are_refused():
    """Lists of other lengths, a payload longer than its place and sums of other sizes or dtypes are a
    ValueError: zip dropped tensors (or summed slots nothing wrote), an overlong payload overwrote the
    next one, and a short or misordered sum decoded other tensors' slices, all without a word."""
    from lossless_hc.training.message import pack_parts
    aggs = [TensorAggregator(f"t{i}", (100,), torch.float32, 2, max_density=0.9) for i in range(2)]
    xs = [torch.randn(100), torch.randn(100)]
    with pytest.raises(ValueError, match="2 aggregators for 1 tensors"):
        encode_message(aggs, xs[:1])
    with pytest.raises(ValueError, match="1 aggregators for 2 tensors"):
        encode_message(aggs[:1], xs)
    with pytest.raises(ValueError, match="in_place_outputs: 2 aggregators for 1 slots"):
        in_place_outputs(aggs, xs[:1])
    dtypes, sizes, places = message_layout([(100, torch.float32), (100, torch.float32)])
    with pytest.raises(ValueError, match="do not fill the layout"):
        pack_parts([torch.randn(120), torch.randn(80)], dtypes, sizes, places)
    # an overlong payload whose excess a later one's place happens to end at: still refused
    with pytest.raises(ValueError, match="do not fill the layout"):
        pack_parts([torch.randn(5), torch.randn(2), torch.randn(2)],
                   *message_layout([(3, torch.float32), (2, torch.float32), (2, torch.float32)]))
    with pytest.raises(ValueError, match="2 payloads for a layout of 1"):
        pack_parts(xs, *message_layout([(200, torch.float32)]))
    m = encode_message(aggs, xs)
    for bad in ([m.parts[0][:150]], [m.parts[0].double()], []):
        with pytest.raises(ValueError, match="the sum of part 0|a message of 1 parts"):
            decode_message(m, bad, dense_sum=None)


def test_a_bucket_whose_top_k_tensor_carries_its_residual_sends_that_tensor():
    """A top-k tensor sent whole hands over a new tensor, the gradient plus what its residual held (a
    residual kept from its sketch steps): the bucket is then not the message, even where the other
    tensors are sent as they are, and the sum holds every rank's gradient plus residual (the buffer alone
    would drop the residual, which the aggregator has handed over and cleared)."""
    n = 2
    g = torch.Generator().manual_seed(9)
    buffers = [torch.randn(400, generator=g) for _ in range(n)]
    residuals = [torch.randn(300, generator=g) for _ in range(n)]
    ms, want = [], [torch.zeros(300), torch.zeros(100)]
    for r in range(n):
        topk = TopKAggregator("k", (300,), torch.float32, n, ratio=0.5, sketch=False)
        dense = TensorAggregator("d", (100,), torch.float32, n, max_density=0.9)
        assert not topk.compressed and not dense.compressed
        topk.residual = residuals[r].clone()
        grads = list(torch.split(buffers[r], [300, 100]))
        want[0] += grads[0] + residuals[r]
        want[1] += grads[1]
        ms.append(encode_message([topk, dense], grads, buffer=buffers[r]))
        assert all(p.data_ptr() != buffers[r].data_ptr() for p in ms[r].parts) and topk.residual is None
    summed = [sum(m.parts[i] for m in ms) for i in range(len(ms[0].parts))]
    results = decode_message(ms[0], summed, dense_sum=None)
    assert all(torch.equal(v.reshape(-1), w) for v, w in zip(results, want))


def test_a_replayed_failure_grows_the_capacity_where_some_rank_overloaded():
    """replay_failure applies the owner's record on a rank that did not decode: the overloaded ranks'
    count is part of it (a failure that names a non-finite input first, where some rank also overloaded,
    grows the capacity as on the owner), so both build the same codec next step."""
    from lossless_hc.lhc.status import DecodeStatus
    from lossless_hc.training.message import replay_failure
    owner, other, kept = (TensorAggregator("t", (4096,), torch.float32, 2, max_density=0.01) for _ in range(3))
    capacity = owner.capacity
    record = (int(DecodeStatus.NON_FINITE_INPUT), 100, 1)
    replay_failure(other, *record)
    replay_failure(kept, int(DecodeStatus.NON_FINITE_INPUT), 100, 0)
    assert other.capacity > capacity and kept.capacity == capacity
    assert other.payload_spec() != kept.payload_spec()


def test_failed_and_inexact_segments_of_one_message_share_one_exact_sum():
    """decode_message re-aggregates a failed segment's dense values and another segment's inexact
    coordinates in one SUM: the fallback's values first, then the partial values, each read back from its
    own place (the partial ones after the fallback's)."""
    n, rows = 2, 4096
    g = torch.Generator().manual_seed(11)
    aggs = [[TensorAggregator("fails", (2048,), torch.float32, n, max_density=0.01, seed=5),
             TensorAggregator("sparse", (rows, 64), torch.bfloat16, n, max_density=0.05, seed=5)] for _ in range(n)]
    xs = [[torch.randn(2048, generator=g),   # dense: far over its capacity
           (torch.randn(rows, 64, generator=g) * (torch.rand(rows, 1, generator=g) < 0.02)).to(torch.bfloat16)]
          for _ in range(n)]
    ms = [encode_message(aggs[r], xs[r]) for r in range(n)]
    summed = [sum(m.parts[j] for m in ms) for j in range(len(ms[0].parts))]
    sent = []
    decode_message(ms[1], summed, dense_sum=lambda t: sent.append(t.clone()))
    dense, sparse = decode_message(ms[0], summed, dense_sum=lambda t: t.add_(sent[0]))
    assert aggs[0][0].stats.fallbacks == 1 and aggs[0][1].stats.partial_fallbacks == 1   # both in the one SUM
    assert torch.equal(dense, xs[0][0] + xs[1][0])
    exact = xs[0][1].double() + xs[1][1].double()
    assert torch.equal(sparse != 0, exact != 0)
    assert torch.allclose(sparse.double(), exact, rtol=2 ** -10 + 2 ** -8, atol=0)


def test_an_auto_message_gives_each_second_collective_its_own_slice():
    """Two tensors of one message on allgather plans share one allgather (decode_message): each is summed from
    its own slice of the gathered rows, and written divided by ``divisor`` into its ``outs`` (an offset not
    advanced gave the second tensor the first one's rows; both mutations passed every other test)."""
    from lossless_hc.training.auto import AutoMessage, decode_message as decode_auto_message
    from lossless_hc.training.planner import Calibration, CostModel
    from lossless_hc.training.strategies import AutoAggregator
    n, model, sizes = 2, CostModel(Calibration.default()), (3000, 5000)

    def ranks():
        return [[AutoAggregator(f"w{i}", (m,), torch.float32, n, r, model, first="allgather", allowed=("allgather",))
                 for i, m in enumerate(sizes)] for r in range(n)]
    g = torch.Generator().manual_seed(3)
    xs = [[torch.zeros(m) for m in sizes] for _ in range(n)]
    for per_rank in xs:
        for x in per_rank:
            x[torch.randperm(x.numel(), generator=g)[:40]] = torch.randn(40, generator=g)

    def message(r):   # every rank's messages from fresh aggregators, summed; rank r's message
        ms = [AutoMessage(a, x) for a, x in zip(ranks(), xs)]
        return ms[r], [sum(m.parts[i] for m in ms) for i in range(len(ms[0].parts))]
    requests = []   # each rank's allgather input, recorded from a run of its own
    for r in range(n):
        decode_auto_message(*message(r), None, lambda t: requests.append(t.clone()) or torch.stack([t] * n))
    m, summed = message(0)
    outs = [torch.full((size,), float("nan")) for size in sizes]
    results = decode_auto_message(m, summed, None, lambda t: torch.stack(requests), outs=outs, divisor=n)
    for i in range(len(sizes)):
        want = xs[0][i] + xs[1][i]
        assert torch.equal(results[i], want / n) and torch.equal(outs[i], want / n)


def test_a_small_half_precision_plan_keeps_its_half_part():
    """An fp16 plan's plain step of a tensor far below SEPARATE_PART_MIN_BYTES still travels in float16, in a
    part of its own beside the float32 one (its plan halves the bytes: widened into the float32 part it would
    send what dense does), and sums to the fp16 plan's value."""
    from lossless_hc.training.auto import AutoMessage, decode_message as decode_auto_message
    from lossless_hc.training.planner import Calibration, CostModel
    from lossless_hc.training.step import run_in_process
    from lossless_hc.training.strategies import AutoAggregator
    n, model = 2, CostModel(Calibration.default())
    half = [AutoAggregator("h", (256,), torch.float32, n, r, model, lossy=True, first="fp16", allowed=("fp16",),
                           lossy_min_bytes=0) for r in range(n)]
    exact = [AutoAggregator("e", (300,), torch.float32, n, r, model, first="dense", allowed=("dense", "sketch"))
             for r in range(n)]
    g = torch.Generator().manual_seed(2)
    run_in_process(half, [torch.randn(256, generator=g) for _ in range(n)])   # the statistics step
    run_in_process(exact, [torch.randn(300, generator=g) for _ in range(n)])
    assert [a.plain_step() for a in half + exact] == ["fp16"] * n + ["dense"] * n
    xs = [[torch.randn(256, generator=g), torch.randn(300, generator=g)] for _ in range(n)]
    ms = [AutoMessage([h, e], x) for h, e, x in zip(half, exact, xs)]
    assert [p.dtype for p in ms[0].parts] == [torch.float32, torch.float16]
    summed = [ms[0].parts[i] + ms[1].parts[i] for i in range(2)]
    y, z = decode_auto_message(ms[0], summed, None, None)
    assert torch.equal(z, xs[0][1] + xs[1][1])
    assert torch.equal(y, ((xs[0][0] / n).half() + (xs[1][0] / n).half()).float() * n)


def test_pack_parts_copies_each_payload_into_its_place():
    """pack_parts: the layout's parts, each payload copied into its place, converted where the part is
    wider; a layout of a single payload too (its part is that payload's copy, on its device)."""
    from lossless_hc.training.message import pack_parts
    one = torch.arange(5.0)
    (part,) = pack_parts([one], *message_layout([(5, torch.float32)]))
    assert part.dtype == torch.float32 and torch.equal(part, one) and part.data_ptr() != one.data_ptr()
    payloads = [torch.arange(3.0, dtype=torch.float64), torch.tensor([0.5, -1.5], dtype=torch.bfloat16),
                torch.tensor([[7.0, 8.0]])]
    dtypes, sizes, places = message_layout([(p.numel(), p.dtype) for p in payloads])
    assert (dtypes, sizes, places) == ([torch.float64], [7], [(0, 0), (0, 3), (0, 5)])
    (part,) = pack_parts(payloads, dtypes, sizes, places)
    assert torch.equal(part, torch.tensor([0.0, 1.0, 2.0, 0.5, -1.5, 7.0, 8.0], dtype=torch.float64))
    assert pack_parts([], *message_layout([])) == []


def test_a_link_without_a_world_size_is_one_rank_s_the_fixed_rule():
    """message_layout's world_size defaults to one rank, for which the calibrated link plays no part: the
    fixed SEPARATE_PART_MIN_BYTES rule, as for world_size=1 (12 KB of float32 beside float64 words are
    widened, where the slow link of 4 ranks would send them apart)."""
    from lossless_hc.training.planner import LinkModel
    f64, f32 = torch.float64, torch.float32
    slow, small = LinkModel(50e-6, 8 / 10e6), [(10, f64), (3000, f32)]
    assert message_layout(small, link=slow, world_size=4)[:2] == ([f64, f32], [10, 3000])
    assert message_layout(small, link=slow) == message_layout(small, link=slow, world_size=1) == message_layout(small)
    assert message_layout(small, link=slow)[:2] == ([f64], [3010])


def test_several_failed_and_inexact_segments_each_read_their_own_slice_of_the_one_sum():
    """Two failed segments and two with inexact keys in one message: dense_sum gets exactly the failed
    segments' dense values, in segment order, then the inexact coordinates' values, in segment order
    (nothing more); each result is read back from its own slice: the failed ones the exact dense sums,
    the inexact coordinates the dense sums rounded to the tensor's dtype. A half-precision segment's
    partial values travel as float32: its stats count four bytes per value, not its dtype's two."""
    n, rows = 2, 4096

    def make():
        return [TensorAggregator("f1", (2048,), torch.float32, n, max_density=0.01, seed=5),
                TensorAggregator("s1", (rows, 64), torch.bfloat16, n, max_density=0.05, seed=5),
                TensorAggregator("f2", (1024,), torch.float32, n, max_density=0.01, seed=6),
                TensorAggregator("s2", (rows, 64), torch.bfloat16, n, max_density=0.05, seed=6)]
    aggs, replicas = [make() for _ in range(n)], make()
    g = torch.Generator().manual_seed(11)

    def sparse():
        return (torch.randn(rows, 64, generator=g) * (torch.rand(rows, 1, generator=g) < 0.02)).to(torch.bfloat16)
    xs = [[torch.randn(2048, generator=g), sparse(), torch.randn(1024, generator=g), sparse()] for _ in range(n)]
    ms = [encode_message(aggs[r], xs[r]) for r in range(n)]
    summed = [sum(m.parts[j] for m in ms) for j in range(len(ms[0].parts))]
    # the same decode on replicas: which segments fail, which coordinates are inexact
    outcomes = decode_segments(encode_message(replicas, xs[0]), summed)
    assert [o.needs_fallback for o in outcomes] == [True, False, True, False]
    assert [o.needs_partial for o in outcomes] == [False, True, False, True]
    p1, p3 = outcomes[1].partial, outcomes[3].partial
    assert p1.numel() > 0 and p3.numel() > 0

    def values(r):   # what rank r's dense_sum must be handed
        return torch.cat([xs[r][0], xs[r][2], xs[r][1].reshape(-1)[p1].float(), xs[r][3].reshape(-1)[p3].float()])
    sent, seen = [], []
    decode_message(ms[1], summed, dense_sum=lambda t: sent.append(t.clone()))
    assert len(sent) == 1 and torch.equal(sent[0], values(1))
    before = [a.stats.payload_bytes for a in aggs[0]]
    results = decode_message(ms[0], summed, dense_sum=lambda t: (seen.append(t.clone()), t.add_(sent[0])))
    assert len(seen) == 1 and torch.equal(seen[0], values(0))
    assert torch.equal(results[0], xs[0][0] + xs[1][0]) and torch.equal(results[2], xs[0][2] + xs[1][2])
    for i, p in ((1, p1), (3, p3)):
        exact = (xs[0][i].float() + xs[1][i].float()).to(torch.bfloat16).reshape(-1)
        assert torch.equal(results[i].reshape(-1)[p], exact[p])
    # counted as sent: every fallback value and every partial value as the four bytes of float32 it
    # travels in (a bfloat16 segment's partial values too, not as their own two)
    assert [a.stats.payload_bytes - b for a, b in zip(aggs[0], before)] == [4 * 2048, 4 * p1.numel(), 4 * 1024,
                                                                           4 * p3.numel()]


def test_a_message_with_inexact_keys_and_no_failure_sums_just_their_values():
    """A one-part message none of whose segments failed, one with inexact keys: dense_sum gets exactly that
    segment's values at its inexact coordinates (no fallback values before them, nothing else), and those
    coordinates come back as the dense sum in the tensor's dtype."""
    n, rows = 2, 4096
    aggs = [TensorAggregator("s", (rows, 64), torch.bfloat16, n, max_density=0.05, seed=5) for _ in range(n + 1)]
    g = torch.Generator().manual_seed(11)
    xs = [(torch.randn(rows, 64, generator=g) * (torch.rand(rows, 1, generator=g) < 0.02)).to(torch.bfloat16)
          for _ in range(n)]
    ms = [encode_message([aggs[r]], [xs[r]]) for r in range(n)]
    assert len(ms[0].parts) == 1
    summed = [ms[0].parts[0] + ms[1].parts[0]]
    (outcome,) = decode_segments(encode_message([aggs[n]], [xs[0]]), summed)   # a replica: the inexact keys
    assert not outcome.needs_fallback and outcome.needs_partial and outcome.partial.numel() > 0
    p = outcome.partial
    sent, seen = [], []
    decode_message(ms[1], summed, dense_sum=lambda t: sent.append(t.clone()))
    assert len(sent) == 1 and torch.equal(sent[0], xs[1].reshape(-1)[p].float())
    (y,) = decode_message(ms[0], summed, dense_sum=lambda t: (seen.append(t.clone()), t.add_(sent[0])))
    assert len(seen) == 1 and torch.equal(seen[0], xs[0].reshape(-1)[p].float())
    exact = (xs[0].float() + xs[1].float()).to(torch.bfloat16).reshape(-1)
    assert torch.equal(y.reshape(-1)[p], exact[p])


def test_the_calibrated_link_prices_a_widening_against_the_wide_part_s_own_bytes():
    """The calibrated rule compares the wider part's allreduce grown by the widened bytes with the two
    allreduces apart: 12 KB of float32 beside float64 words on the slow link travel apart
    (widening adds ~14 ms on the wire; a second part costs one latency, 0.3 ms) however large the float64
    part (10 words or 128 MiB), and on the far link (2 ms a hop) are widened beside either."""
    from lossless_hc.training.planner import LinkModel
    f64, f32 = torch.float64, torch.float32
    slow, far = LinkModel(50e-6, 8 / 10e6), LinkModel(2e-3, 8 / 10e9)
    for words in (10, 1 << 24):   # specs only: nothing of that size is allocated
        specs = [(words, f64), (3000, f32)]
        assert message_layout(specs, link=slow, world_size=4)[:2] == ([f64, f32], [words, 3000])
        assert message_layout(specs, link=far, world_size=4)[:2] == ([f64], [words + 3000])
