"""A DDP bucket's message (lossless_hc.training.message), beyond tests/test_message.py: a bucket that holds a
compressed tensor is not the message, and the message is then made as without a buffer, each compressed
payload encoded into its own slice of it; an empty parameter's payload makes no part of its own."""
import pytest
import torch

from lossless_hc.training.aggregate import TensorAggregator
from lossless_hc.training.message import decode_message, decode_segments, encode_message, message_layout
from lossless_hc.training.planner import LinkModel


def test_a_bucket_with_a_compressed_tensor_encodes_each_payload_into_its_slice():
    """A bucket of a compressed float32 tensor and one sent as it is (the buffer's consecutive slices, in
    its dtype): the message is not the buffer; the compressed payload is encoded straight into its slice
    of the message's one part and the other tensor copied in after it, as without a buffer; summed, each
    segment decodes to the same bits as the same aggregators' message made without the buffer."""
    n = 2
    shapes = [(4096,), (100,)]

    def make():
        return [TensorAggregator("c", shapes[0], torch.float32, n, max_density=0.05, seed=3),
                TensorAggregator("d", shapes[1], torch.float32, n, max_density=0.9, seed=3)]
    with_buffer, without = [make() for _ in range(n)], [make() for _ in range(n)]
    assert [a.compressed for a in with_buffer[0]] == [True, False]
    g = torch.Generator().manual_seed(21)
    buffers = []
    for _ in range(n):
        b = torch.randn(4196, generator=g)
        b[:4096] *= torch.rand(4096, generator=g) < 0.01
        buffers.append(b)
    grads = [list(torch.split(b, [4096, 100])) for b in buffers]
    ms = [encode_message(with_buffer[r], grads[r], buffer=buffers[r]) for r in range(n)]
    alone = [encode_message(without[r], [t.clone() for t in grads[r]]) for r in range(n)]
    for m, a, b in zip(ms, alone, buffers):
        assert len(m.parts) == 1 and m.parts[0].data_ptr() != b.data_ptr()
        assert m.places == a.places and torch.equal(m.parts[0], a.parts[0])
        part = m.parts[0]
        start = part.data_ptr()
        payload = m.encoded[0][0]
        assert payload.data_ptr() == start   # the compressed payload is its slice of the part: no copy
        assert torch.equal(part[m.places[1][1]:], b[4096:])
    summed = [ms[0].parts[0] + ms[1].parts[0]]
    for r in range(n):
        got = decode_segments(ms[r], summed)
        want = decode_segments(alone[r], summed)
        for o, w in zip(got, want):
            assert o.value is not None and torch.equal(o.value, w.value)
    assert torch.equal(got[1].value, buffers[0][4096:] + buffers[1][4096:])


@pytest.mark.parametrize("link", [None, LinkModel(1e-3, 8e-9)])
def test_an_empty_payload_makes_no_part_of_its_own(link):
    """Payloads of no elements hold nothing to convert or sum: their dtype travels in the widest part that
    has elements, not in an empty part (a collective that carries nothing) nor in a wider part of their
    own (which would widen the others' values); with no elements anywhere, one part. With or without a
    calibrated link (whose allreduce of 0 bytes is priced at 0, so the link alone would keep them apart)."""
    f32, bf16, f64 = torch.float32, torch.bfloat16, torch.float64
    assert message_layout([(100, f32), (0, bf16)], link=link, world_size=4) == ([f32], [100], [(0, 0), (0, 100)])
    assert message_layout([(0, f32), (100, bf16)], link=link, world_size=4) == ([bf16], [100], [(0, 0), (0, 0)])
    assert message_layout([(0, f64), (7, f32)], link=link, world_size=4) == ([f32], [7], [(0, 0), (0, 0)])
    assert message_layout([(0, bf16), (0, f32)], link=link, world_size=4) == ([f32], [0], [(0, 0), (0, 0)])
    # a bucket of an empty float32 parameter and a bfloat16 one: the message is the bfloat16 part, summed as such
    n = 2
    shapes = [((0,), f32), ((100,), bf16)]
    aggs = [[TensorAggregator(f"t{i}", s, d, n, max_density=0.9) for i, (s, d) in enumerate(shapes)] for _ in range(n)]
    g = torch.Generator().manual_seed(5)
    xs = [[torch.randn(s, generator=g).to(d) for s, d in shapes] for _ in range(n)]
    ms = [encode_message(aggs[r], xs[r]) for r in range(n)]
    assert [(p.dtype, p.numel()) for p in ms[0].parts] == [(bf16, 100)]
    out = decode_message(ms[0], [ms[0].parts[0] + ms[1].parts[0]], dense_sum=None)
    assert out[0].shape == (0,) and out[0].dtype == f32
    assert torch.equal(out[1], xs[0][1] + xs[1][1])
