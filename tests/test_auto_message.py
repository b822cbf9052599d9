"""auto's many tensors in one message (lossless_hc.training.auto: AutoMessage, decode_message), in one
process: ranks are simulated by summing their message parts and their second collectives' inputs, as the
engine's collectives would (tests/test_message.py has the allgather side and the message layout)."""
import pytest
import torch

from lossless_hc.training.auto import AutoMessage, decode_message
from lossless_hc.training.planner import Calibration, CostModel
from lossless_hc.training.strategies import AutoAggregator


def _sparse_inputs(sizes, n, seed, nnz=40):
    g = torch.Generator().manual_seed(seed)
    xs = [[torch.zeros(m) for m in sizes] for _ in range(n)]
    for per_rank in xs:
        for x in per_rank:
            x[torch.randperm(x.numel(), generator=g)[:nnz]] = torch.randn(nnz, generator=g)
    return xs


def test_an_auto_message_issues_one_allreduce_per_dtype_in_part_order_and_each_tensor_reads_its_own_slice():
    """Tensors of one message whose decode asks for an allreduce share one per request dtype, issued in
    PART_DTYPES order (float32, then bfloat16, then float16: every rank alike, module doc), and each tensor is
    finished from its own slice of the SUM: two two_phase tensors (float32 rows), a bf16 and an fp16 plan's
    statistics step (their gradients in half precision). Before, no single-process test reached this path:
    dropping the allreduce, its dtype filter or the split's offset passed every test."""
    n, model = 2, CostModel(Calibration.default())
    specs = [("a", 3000, "two_phase"), ("b", 5000, "two_phase"), ("c", 700, "bf16"), ("d", 900, "fp16")]

    def ranks():
        return [[AutoAggregator(name, (m,), torch.float32, n, r, model, lossy=True, first=s, allowed=(s,),
                                lossy_min_bytes=0) for name, m, s in specs] for r in range(n)]
    xs = _sparse_inputs([m for _, m, _ in specs], n, seed=3)

    def message(r):   # every rank's messages from fresh aggregators, summed; rank r's message
        ms = [AutoMessage(a, x) for a, x in zip(ranks(), xs)]
        return ms[r], [sum(m.parts[i] for m in ms) for i in range(len(ms[0].parts))]
    inputs = []   # each rank's allreduce inputs, in call order, recorded from a run of its own
    for r in range(n):
        mine = []
        decode_message(*message(r), lambda t, mine=mine: mine.append(t.clone()), None)
        inputs.append(mine)
    assert [(t.dtype, t.numel()) for t in inputs[0]] == [(torch.float32, inputs[0][0].numel()),
                                                         (torch.bfloat16, 700), (torch.float16, 900)]
    assert [(t.dtype, t.numel()) for t in inputs[1]] == [(t.dtype, t.numel()) for t in inputs[0]]
    calls = []

    def allreduce(t):   # the SUM in place, as the engine's: rank 0's and rank 1's inputs of the same call
        i = len(calls)
        calls.append(t.dtype)
        t.copy_(inputs[0][i] + inputs[1][i])
    m, summed = message(0)
    a, b, c, d = decode_message(m, summed, allreduce, None)
    assert calls == [torch.float32, torch.bfloat16, torch.float16]
    assert torch.equal(a, xs[0][0] + xs[1][0]) and torch.equal(b, xs[0][1] + xs[1][1])   # two_phase: exact
    assert torch.equal(c, (xs[0][2].to(torch.bfloat16) + xs[1][2].to(torch.bfloat16)).float())
    assert torch.equal(d, ((xs[0][3] / n).half() + (xs[1][3] / n).half()).float() * n)


def test_auto_decode_message_refuses_sums_that_do_not_fit_the_message():
    """Sums of another count, size or dtype than the message's parts are a ValueError (check_sums), not
    other tensors' slices decoded without a word."""
    n, model = 2, CostModel(Calibration.default())
    aggs = [AutoAggregator(f"t{i}", (100,), torch.float32, n, 0, model) for i in range(2)]
    m = AutoMessage(aggs, [torch.randn(100), torch.randn(100)])
    assert len(m.parts) == 1
    for bad in ([m.parts[0][:150]], [m.parts[0][:-1]], [m.parts[0].double()], [], [m.parts[0], m.parts[0]]):
        with pytest.raises(ValueError, match="the sum of part 0|a message of 1 parts"):
            decode_message(m, bad, None, None)


def test_an_auto_message_prices_its_parts_on_the_calibrated_link_only_where_every_aggregator_has_it():
    """The part rule takes the calibrated link where every aggregator of the message has a cost model (every
    rank alike); one built before the calibration (DDP's first step) has none, and then the message takes the
    fixed rule: here 512 KiB of a bfloat16 body widened into the float32 part on a far link (2 ms a hop), and
    sent apart by the fixed rule."""
    from lossless_hc.training.planner import LinkModel
    far = CostModel(Calibration(LinkModel(2e-3, 8 / 10e9)))
    x, y = torch.randn(1 << 18).to(torch.bfloat16), torch.randn(100)

    def aggs(second_model):
        a = AutoAggregator("w", (1 << 18,), torch.bfloat16, 2, 0, far)
        a.plain_dtype = torch.bfloat16
        b = AutoAggregator("v", (100,), torch.float32, 2, 0, second_model, topk_ratio=0.01, thc_bits=4)
        return [a, b]
    assert [p.dtype for p in AutoMessage(aggs(far), [x, y]).parts] == [torch.float32]
    assert [p.dtype for p in AutoMessage(aggs(None), [x, y]).parts] == [torch.float32, torch.bfloat16]


def test_a_half_precision_gradient_s_dense_step_that_flushes_top_k_memory_keeps_the_memory_in_float32():
    """A dense statistics step of a bfloat16 gradient travels with its body in bfloat16 (the plain steps'
    dtype) only where the body is the gradient as it is: leaving top-k, the residual flushed into it
    (float32) goes out in float32, and the result is the float32 sum of every rank's gradient plus its residual,
    rounded once to bfloat16 (not each rank's rounded first)."""
    n, m = 2, 4096
    rng = torch.Generator().manual_seed(11)
    aggs = [AutoAggregator("w", (m,), torch.bfloat16, n, r, None, lossy=True, lossy_min_bytes=0, first="topk",
                           allowed=("topk", "dense"), topk_ratio=0.01, thc_bits=4) for r in range(n)]
    for a in aggs:
        a.plain_dtype = torch.bfloat16   # as the DDP, Horovod and FSDP2 adapters set it
        a.topk_aggregator().encode(torch.randn(m, generator=rng))   # leaves a float32 residual
        a.strategy = "dense"   # a plan that leaves top-k
    residuals = [a._topk.residual.clone() for a in aggs]
    assert all(r.dtype == torch.float32 and bool(r.ne(0).any()) for r in residuals)
    xs = [torch.randn(m, generator=rng).to(torch.bfloat16) for _ in range(n)]
    ms = [AutoMessage([a], [x]) for a, x in zip(aggs, xs)]
    summed = [sum(mm.parts[i] for mm in ms) for i in range(len(ms[0].parts))]
    value, = decode_message(ms[0], summed, None, None)
    flushed = [x.float() + r for x, r in zip(xs, residuals)]
    assert value.dtype == torch.bfloat16 and torch.equal(value, (flushed[0] + flushed[1]).to(torch.bfloat16))
