"""Inputs torch represents lazily (negative views), checkpointed states that no codec saved, arguments of the
wrong kind: the exact answer or a clear error, never a silently wrong one."""
import math
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

import helpers
from lossless_hc import LosslessCodec, THCCodec
from lossless_hc.lhc.status import DecodeStatus
from lossless_hc.thc.table import build_table, table_variance

INDEXES = ["bitmap", "bloom", "multilevel", "dense"]


def neg_view(t: torch.Tensor) -> torch.Tensor:
    """A view whose values are -t's while its memory holds t's (the negative bit: what ``z.conj().imag``
    gives for a complex z)."""
    v = torch._neg_view(t)
    assert v.is_neg() and v.data_ptr() == t.data_ptr()
    return v


@pytest.mark.parametrize("index", INDEXES)
def test_lhc_negative_views_encode_and_decode_their_values(index):
    numel, n = 600, 2
    codec = LosslessCodec(numel, n, 40, index=index)
    xs = helpers.make_inputs(np.random.default_rng(0), numel, 1, n, 30, "random", "normal")
    summed = codec.encode(xs[0]) + codec.encode(xs[1])
    truth, report = codec.decode(summed)
    assert report.status == DecodeStatus.OK and torch.allclose(truth, xs[0] + xs[1], rtol=2 ** -10, atol=0)
    # the ranks' inputs as negative views of their negations: the values encoded are xs, the same payload bits
    assert torch.equal(codec.encode(neg_view(-xs[0])) + codec.encode(neg_view(-xs[1])), summed)
    # the summed payload handed over as a negative view of its negation decodes the same
    y, report = codec.decode(neg_view(-summed))
    assert report.status == DecodeStatus.OK and torch.equal(y, truth)
    with pytest.raises(ValueError, match="out is a negative view"):
        codec.decode(summed, out=neg_view(torch.empty(numel)))
    with pytest.raises(ValueError, match="out is a negative view"):
        codec.encode(xs[0], out=neg_view(torch.empty(codec.payload_numel)))


def test_thc_negative_views_are_their_values():
    numel, n = 2048, 2
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(numel, generator=g) for _ in range(n)]

    def step(inputs, payload_view=lambda p: p, out=None):
        codecs = [THCCodec(numel, n, r, initial_norm=8.0 * math.sqrt(numel)) for r in range(n)]
        payloads = [c.encode(x) for c, x in zip(codecs, inputs)]
        summed = payloads[0] + payloads[1]
        return payloads, codecs[0].decode(payload_view(summed), out=out)

    payloads, y = step(xs)
    payloads_neg, y_neg = step([neg_view(-x) for x in xs], payload_view=lambda p: neg_view(-p))
    assert all(torch.equal(a, b) for a, b in zip(payloads, payloads_neg)) and torch.equal(y, y_neg)
    with pytest.raises(ValueError, match="out is a negative view"):
        step(xs, out=neg_view(torch.empty(numel)))
    codec = THCCodec(numel, n, 0, initial_norm=1.0)
    with pytest.raises(ValueError, match="out is a negative view"):
        codec.encode(xs[0], out=neg_view(torch.empty(codec.payload_numel, dtype=torch.float64)))


@pytest.mark.parametrize("view", [lambda e: e, lambda e: e[: e.numel() // 2 + 3], lambda e: e[5:]])
def test_thc_interleaved_encode_of_its_own_error_memory_is_its_values(view):
    """encode(x, interleaved=True) reads x in place while it writes the error memory: an x in that memory
    (the codec's ``error``, or a view of it) encodes as a copy of it would, payload and error memory alike."""
    numel, steps = 1 << 17, 3   # 128 blocks: later blocks read what earlier ones wrote, were x read in place
    results = []
    for alias in (False, True):
        codec = THCCodec(numel, 1, 0, seed=3, hadamard_block=1024)
        g = torch.Generator().manual_seed(2)
        got = []
        for step in range(steps):
            x = torch.randn(numel, generator=g)
            if step == steps - 1:
                x = view(codec.error) if alias else view(codec.error).clone()
            payload = codec.encode(x, interleaved=True)
            got += [payload.clone(), codec.error.clone(), codec.decode(payload)]
        results.append(got)
    assert all(torch.equal(a, b) for a, b in zip(*results))


def test_topk_aggregator_selects_a_negative_view_s_values():
    """A gradient handed over as a negative view sends, and keeps as residual, the bits its values give,
    step after step (the one-pass selection reads memory: it once sent the negation, silently)."""
    from lossless_hc.training.topk_aggregate import TopKAggregator
    numel = 20_000
    plain, viewed = (TopKAggregator("w", (numel,), torch.float32, 2, 0.01) for _ in range(2))
    g = torch.Generator().manual_seed(5)
    for _ in range(3):
        x = torch.randn(numel, generator=g)
        sent = plain.select(x)
        assert torch.equal(viewed.select(neg_view(-x)), sent) and torch.equal(viewed.residual, plain.residual)


def test_backend_kernels_read_a_negative_view_s_values_and_refuse_to_write_one():
    """The backends' kernels take addresses: an operand they only read is a negative view's values (the
    exact answer), one they write is refused, and so are operands sharing memory where one is written."""
    from lossless_hc.backends import backend_for
    b = backend_for(torch.device("cpu"))
    n = 5000
    x = torch.randn(n, generator=torch.Generator().manual_seed(6))
    x[::7] = 0.0
    e = torch.randn(n, generator=torch.Generator().manual_seed(7))
    # read: the values
    want_i, want_v = b.topk_feedback(x, e.clone(), 50)
    e2 = e.clone()
    got_i, got_v = b.topk_feedback(neg_view(-x), e2, 50)
    assert torch.equal(got_i, want_i) and torch.equal(got_v, want_v)
    assert torch.equal(b.topk_select(neg_view(-x), 50), b.topk_select(x, 50))
    dst = torch.empty(n)
    assert torch.equal(b.dense_copy(neg_view(-x), dst), b.dense_copy(x, None)) and torch.equal(dst, x)
    assert torch.equal(b.dense_copy(neg_view(-x), None), b.dense_copy(x, None))
    blocks = torch.empty(4 * 1024)
    b.thc_interleave(neg_view(-x[:4000]), 4, 1024, blocks)
    want = torch.empty(4 * 1024)
    b.thc_interleave(x[:4000].clone(), 4, 1024, want)
    assert torch.equal(blocks, want)
    back = torch.empty(4000)
    b.thc_deinterleave(neg_view(-want), 4, 1024, back)
    assert torch.equal(back, x[:4000])
    words = b.bitmap_pack(100, 3, index=torch.tensor([3, 50, 99])) * 2
    assert torch.equal(b.bitmap_rows(neg_view(-words), 100, 3), torch.tensor([3, 50, 99]))
    assert b.bitmap_rows(neg_view(words), 100, 3) is None   # values -2 per row: no sum of bitmaps holds them
    assert torch.equal(b.bitmap_pack(100, 3, index=neg_view(torch.tensor([-3, -7]))),
                       b.bitmap_pack(100, 3, index=torch.tensor([3, 7])))
    with pytest.raises(ValueError, match="outside"):
        b.bitmap_pack(100, 3, index=neg_view(torch.tensor([3, 7])))   # rows -3 and -7
    for index in (torch.tensor([2.7]), torch.tensor([False, True, True])):
        with pytest.raises(ValueError, match="index must be a tensor of integer rows"):
            b.bitmap_pack(100, 3, index=index)
    # written: refused
    with pytest.raises(ValueError, match="topk_feedback's residual is a negative view"):
        b.topk_feedback(x, neg_view(torch.zeros(n)), 50)
    with pytest.raises(ValueError, match="topk_select's out is a negative view"):
        b.topk_select(x, 50, out=neg_view(torch.zeros(50, dtype=torch.int64)))
    with pytest.raises(ValueError, match="dense_copy's dst is a negative view"):
        b.dense_copy(x, neg_view(torch.zeros(n)))
    with pytest.raises(ValueError, match="thc_interleave's out is a negative view"):
        b.thc_interleave(x[:4000], 4, 1024, neg_view(torch.zeros(4 * 1024)))
    with pytest.raises(ValueError, match="thc_deinterleave's out is a negative view"):
        b.thc_deinterleave(want, 4, 1024, neg_view(torch.zeros(4000)))
    # sharing memory: refused (a partial overlap too, not only the same start)
    buf = torch.randn(2 * n + 1)
    with pytest.raises(ValueError, match="dense_copy's dst and src overlap"):
        b.dense_copy(buf[:n], buf[1:n + 1])
    with pytest.raises(ValueError, match="topk_feedback's residual and x overlap"):
        b.topk_feedback(buf[:n], buf[1:n + 1], 50)
    with pytest.raises(ValueError, match="topk_select's out and x overlap"):
        b.topk_select(buf[:n], 50, out=buf[n - 50:n + 50].view(torch.int64))
    with pytest.raises(ValueError, match="THC interleave's operands overlap"):
        b.thc_interleave(buf[:4000], 4, 1024, buf[:4096])
    with pytest.raises(ValueError, match="THC interleave's operands overlap"):
        b.thc_deinterleave(buf[:4096], 4, 1024, buf[100:4100])


@pytest.mark.parametrize("bad, match", [
    ({"norm": -5.0}, r"state\['norm'\] must be a finite number >= 0"),
    ({"norm": float("nan")}, r"state\['norm'\] must be a finite number >= 0"),
    ({"norm": float("inf")}, r"state\['norm'\] must be a finite number >= 0"),
    ({"norm": "3"}, r"state\['norm'\] must be a finite number >= 0"),
    ({"norm": 1e30}, r"no larger than 5.9\d+e\+20, the largest norm of 1024 coordinates"),
    ({"step": -1}, r"state\['step'\] must be >= 0"),
    ({"step": 2.7}, r"state\['step'\] must be an int"),
    ({"step": True}, r"state\['step'\] must be an int"),
    ({"error": None}, "no error memory of this codec's numel"),
    ({"error": torch.zeros(7)}, "no error memory of this codec's numel"),
])
def test_thc_refuses_a_state_no_codec_saved_and_keeps_its_own(bad, match):
    numel, n = 1024, 2
    g = torch.Generator().manual_seed(2)
    codecs = [THCCodec(numel, n, r, initial_norm=40.0) for r in range(n)]
    payloads = [c.encode(torch.randn(numel, generator=g)) for c in codecs]
    for c in codecs:
        c.decode(payloads[0] + payloads[1])
    before = codecs[0].state_dict()
    exc = TypeError if bad.get("step") in (2.7, True) else ValueError
    with pytest.raises(exc, match=match):
        codecs[0].load_state_dict(dict(before, **bad))
    # refused before anything changed: the codec's state is its own
    after = codecs[0].state_dict()
    assert before["step"] == after["step"] == 1 and before["norm"] == after["norm"] > 0
    assert torch.equal(before["error"], after["error"]) and bool(after["error"].abs().sum() > 0)


def test_thc_refuses_an_initial_norm_no_step_could_agree_on():
    """M_0 above sqrt(numel) * sqrt(float32 max) (each coordinate's square finite) overflowed the kernels'
    float32 scale: at 2e40 the error memory became NaN and the next step raised on finite inputs, at 1e60 the
    first decode was all-NaN without an error. The largest one still decodes finite values."""
    numel, n = 4096, 2
    largest = math.sqrt(numel) * math.sqrt(torch.finfo(torch.float32).max)
    for bad in (2e40, 1e60, float("inf"), -1.0):
        with pytest.raises(ValueError, match="initial_norm must be a number in"):
            THCCodec(numel, n, 0, initial_norm=bad)
    g = torch.Generator().manual_seed(3)
    codecs = [THCCodec(numel, n, r, initial_norm=largest) for r in range(n)]
    for _ in range(2):
        xs = [torch.randn(numel, generator=g) for _ in range(n)]
        summed = codecs[0].encode(xs[0]) + codecs[1].encode(xs[1])
        ys = [c.decode(summed) for c in codecs]
        assert bool(torch.isfinite(ys[0]).all()) and torch.equal(ys[0], ys[1])
        assert bool(torch.isfinite(codecs[0].error).all())


def test_thc_loads_a_state_at_the_largest_norm_itself():
    """load_state_dict's bound is inclusive, as initial_norm's is: a saved norm of exactly sqrt(numel) *
    sqrt(float32 max) is restored, a step taking it then decodes finite values on every rank."""
    numel, n = 1024, 2
    largest = math.sqrt(numel) * math.sqrt(torch.finfo(torch.float32).max)
    codecs = [THCCodec(numel, n, r) for r in range(n)]
    for c in codecs:
        c.load_state_dict({"step": 3, "norm": largest, "error": torch.zeros(numel)})
    assert codecs[0].norm == largest and codecs[0].step == 3
    g = torch.Generator().manual_seed(5)
    summed = sum(c.encode(torch.randn(numel, generator=g)) for c in codecs)
    ys = [c.decode(summed) for c in codecs]
    assert bool(torch.isfinite(ys[0]).all()) and torch.equal(ys[0], ys[1])


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
def test_an_unfit_out_and_a_csr_gradient_are_named_as_what_they_are():
    """THCAggregator.decode refuses an unfit out as the caller's mistake (ValueError), not as ranks
    configured differently (ConfigurationMismatch), and the step then decodes; a CSR gradient, which
    is_sparse does not name, is refused as sparse rather than passed through as the dense tensor."""
    from lossless_hc.training.aggregate import ConfigurationMismatch, TensorAggregator
    from lossless_hc.training.thc_aggregate import THCAggregator
    n = 2
    aggs = [THCAggregator("w", (64, 64), torch.float32, n, rank=r, seed=5) for r in range(n)]
    g = torch.Generator().manual_seed(4)
    for _ in range(2):
        encoded = [a.encode(torch.randn(64, 64, generator=g)) for a in aggs]
        summed = encoded[0][0] + encoded[1][0]
        for bad in (torch.empty(64 * 64 - 1), neg_view(torch.empty(64 * 64))):
            with pytest.raises(ValueError, match="out must be a contiguous|out is a negative view") as info:
                aggs[0].decode(summed, encoded[0][1], out=bad)
            assert not isinstance(info.value, ConfigurationMismatch)
        values = [a.decode(summed, ctx).value for a, (_, ctx) in zip(aggs, encoded)]
        assert torch.equal(values[0], values[1])
    csr = torch.eye(8).to_sparse_csr()
    with pytest.raises(TypeError, match="sparse gradient"):
        TensorAggregator("w", (8, 8), torch.float32, n, max_density=0.9).encode(csr)


def test_an_out_on_another_device_than_the_codec_s_is_refused():
    """checked_out (every codec's ``out``) refuses a buffer on another device than the codec's, here one
    on the meta device, which has the size, dtype and layout asked for but no memory the kernels could
    write: a ValueError naming the device, not a write through its address."""
    codec = LosslessCodec(1000, 2, 50)
    x = torch.zeros(1000)
    x[:5] = 1.0
    with pytest.raises(ValueError, match="out must be a contiguous float32 tensor of .* elements on cpu"):
        codec.encode(x, out=torch.empty(codec.payload_numel, device="meta"))
    thc = THCCodec(1000, 2, 0, initial_norm=1.0)
    with pytest.raises(ValueError, match="out must be a contiguous float64 tensor of .* elements on cpu"):
        thc.encode(x, out=torch.empty(thc.payload_numel, dtype=torch.float64, device="meta"))


def test_an_input_or_payload_on_another_device_than_the_codec_s_is_refused():
    """LosslessCodec.encode's x and decode's payload are checked for the codec's device before any kernel
    sees them: a meta tensor of the right size and dtype is a ValueError naming both devices."""
    codec = LosslessCodec(1000, 2, 50)
    with pytest.raises(ValueError, match="x is on meta, the codec on cpu"):
        codec.encode(torch.zeros(1000, device="meta"))
    with pytest.raises(ValueError, match="payload is on meta, the codec on cpu"):
        codec.decode(torch.zeros(codec.payload_numel, device="meta"))


def test_thc_table_search_beyond_its_limit_is_refused_and_explicit_levels_still_work():
    with pytest.raises(ValueError, match=r"a table of 256 levels in \[0, 65536\] is searched over"):
        build_table(8, 65536)
    # every integer a level (2^bits > g) and an explicit table need no search: no (g + 1)^2 matrix
    assert len(build_table(16, 65535).levels) == 65536
    levels = (0, 20000, 45536, 65536)
    codec = THCCodec(4096, 2, 0, bits=2, granularity=65536, levels=levels, initial_norm=1.0)
    assert codec.table.levels == levels
    assert math.isclose(codec.table.variance, table_variance(levels, 65536, 32))


def test_decode_names_a_shape_that_is_no_shape():
    codec = LosslessCodec(100, 2, 5)
    x = torch.zeros(100)
    x[3] = 1.0
    summed = codec.encode(x) * 2
    for shape in (100.0, "ab", {100: 1}):
        with pytest.raises(ValueError, match=r"decode\(shape=.*\): not a shape"):
            codec.decode(summed, shape=shape)
    for shape in (100, [4, 25], torch.Size([10, 10])):
        y, report = codec.decode(summed, shape=shape)
        assert report.ok and y.numel() == 100 and float(y.reshape(-1)[3]) == 2.0


def run_as_fake_rank(rank: int, body: str) -> None:
    """Run ``body`` (its names: pytest, dist, the DDP hook states) as rank ``rank`` of a two-rank world on
    torch's fake backend (no peers needed), in a process of its own so that its default group meets no
    other test's; it must finish without an error."""
    script = textwrap.dedent(f"""
        import pytest, torch.distributed as dist
        from torch.testing._internal.distributed.fake_pg import FakeStore
        from lossless_hc.plugins.ddp import AutoHookState, LosslessHookState, TopKHookState
        dist.init_process_group("fake", store=FakeStore(), rank={rank}, world_size=2)
    """) + textwrap.dedent(body) + "\nprint('ok')\n"
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stdout + done.stderr


def test_ddp_hook_state_refuses_a_group_it_cannot_reduce_over():
    run_as_fake_rank(1, """
        left_out = dist.new_group([0])          # GroupMember.NON_GROUP_MEMBER on rank 1
        with pytest.raises(ValueError, match=r"global rank 1\\) is not a member of process_group"):
            LosslessHookState(process_group=left_out)
        with pytest.raises(TypeError, match="process_group must be a torch.distributed ProcessGroup"):
            AutoHookState(process_group="default")
        state = LosslessHookState(process_group=dist.new_group([0, 1]))
        assert (state.world_size, state.rank) == (2, 1)
    """)


def test_ddp_hook_state_takes_rank_0_of_a_group_and_refuses_an_int_for_one():
    # rank 0 of a group is a member (rank 0 is no "-1, not in the group"); an int that is not torch's
    # NON_GROUP_MEMBER marker (a rank, say) is no group at all: a TypeError, not "not a member"
    run_as_fake_rank(0, """
        state = TopKHookState(process_group=dist.new_group([0, 1]))
        assert (state.world_size, state.rank) == (2, 0)
        with pytest.raises(TypeError, match="process_group must be a torch.distributed ProcessGroup .* got int"):
            LosslessHookState(process_group=1)
    """)


@pytest.mark.parametrize("numel", [16, 4096])   # sent as it is (too small to compress), and compressed
def test_engine_adapter_hands_the_engine_the_values_of_a_negative_view(numel):
    from lossless_hc.training.adapter import CompressorAdapter, LosslessSpec, TopKSpec
    x = torch.zeros(numel)
    x[::8] = torch.arange(1.0, numel // 8 + 1)
    for spec in (LosslessSpec(0.2), TopKSpec(0.1)):
        plain, viewed = CompressorAdapter(spec), CompressorAdapter(spec)
        expected, _ = plain.encode(plain.aggregator("w", "w", x, 2, 0), x)
        payload, _ = viewed.encode(viewed.aggregator("w", "w", x, 2, 0), neg_view(-x))
        assert not payload.is_neg() and torch.equal(payload, expected)


def test_thc_aggregator_refuses_a_tensor_it_was_not_built_for():
    from lossless_hc.training.thc_aggregate import THCAggregator
    agg = THCAggregator("w", (64, 64), torch.float32, 2, 0)
    for bad in (torch.randn(64, 64, dtype=torch.float64), torch.randn(64, 32)):
        with pytest.raises(ValueError, match=r"w: got a torch\.float.. tensor of shape \(64, .*\), this aggregator was "
                                             r"built for torch\.float32 \(64, 64\)"):
            agg.encode(bad)
    payload, ctx = agg.encode(torch.randn(64, 64))   # what it was built for
    assert payload.numel() > 0


def test_the_cuda_backend_s_torch_paths_take_the_shapes_the_cpu_kernels_take():
    """dense_copy and the THC interleave take contiguous operands of the right numel in any shape on the CPU
    (their kernels see addresses); the CUDA backend's torch operations (run here on CPU tensors) broadcast
    or sliced rows instead, and refused them: now the same bits."""
    from lossless_hc.backends.cpu import CPU
    from lossless_hc.backends.cuda import CudaBackend
    cuda = CudaBackend()
    src = torch.randn(50, generator=torch.Generator().manual_seed(1))
    for backend in (CPU, cuda):
        dst = torch.empty(5, 10)
        counts = backend.dense_copy(src, dst)
        assert torch.equal(dst.reshape(-1), src) and counts.tolist() == [50, 0]
    x = torch.randn(40, 100, generator=torch.Generator().manual_seed(2))   # 4000 coordinates, 2-D
    want, got = torch.empty(4, 1024), torch.empty(4, 1024)
    CPU.thc_interleave(x, 4, 1024, want)
    cuda.thc_interleave(x, 4, 1024, got)
    assert torch.equal(got, want)
    back_cpu, back_cuda = torch.empty(40, 100), torch.empty(40, 100)
    CPU.thc_deinterleave(want, 4, 1024, back_cpu)
    cuda.thc_deinterleave(want, 4, 1024, back_cuda)
    assert torch.equal(back_cpu, x) and torch.equal(back_cuda, x)


@pytest.mark.parametrize("build", ["TensorAggregator", "TensorRows", "PlanTracker", "fit_link"])
def test_a_world_size_that_is_no_positive_int_is_refused_alike_everywhere(build):
    """The training modules' world sizes go through one check (lhc.layout.check_int with least=1): a
    TypeError for what is not an int (a bool, a float), and one ValueError naming the accepted range,
    "world_size must be an integer >= 1" (three of them said "world_size must be >= 1", in words of
    their own)."""
    from lossless_hc.training.aggregate import TensorAggregator
    from lossless_hc.training.calibration import LinkModel, fit_link
    from lossless_hc.training.plan_tracker import PlanTracker
    from lossless_hc.training.rows import TensorRows
    make = {"TensorAggregator": lambda n: TensorAggregator("w", (4,), torch.float32, n, 0.5),
            "TensorRows": lambda n: TensorRows("w", (4,), torch.float32, n, 0, False),
            "PlanTracker": lambda n: PlanTracker(4, 1, n),
            "fit_link": lambda n: fit_link([], n, LinkModel(0, 1))}[build]
    for n in (0, -3):
        with pytest.raises(ValueError, match=rf"world_size must be an integer >= 1, got {n}$"):
            make(n)
    for n in (True, 2.0):
        with pytest.raises(TypeError, match="world_size must be an int, got"):
            make(n)
    make(1)


def test_the_cuda_backend_s_torch_paths_scan_and_refuse_as_the_cpu_kernels_do():
    """The CUDA backend's row scan (run here on CPU tensors) flags the rows the CPU kernel flags (NaN counts,
    -0.0 does not), and its dense_copy and topk_feedback refuse what the CPU backend refuses, before torch
    or the kernels touch the operands."""
    from lossless_hc.backends.cpu import CPU
    from lossless_hc.backends.cuda import CudaBackend
    cuda = CudaBackend()
    x = torch.zeros(12)
    x[1], x[7], x[10] = float("nan"), 2.0, -0.0
    for backend in (CPU, cuda):
        assert backend.nonzero_rows(x, 3).tolist() == [True, False, True, False]
        with pytest.raises(ValueError, match="dense_copy's dst must hold 12 elements"):
            backend.dense_copy(x, torch.empty(11))
        with pytest.raises(TypeError, match="residual"):
            backend.topk_feedback(x, torch.zeros(11), 5)


def test_the_cuda_backend_s_bitmap_refuses_a_word_the_cpu_kernel_refuses():
    """bitmap_rows of an average (``scale`` n): a word that scales to -0.5 rounds to -0 (ties to even) within
    an average's 0.5 of rounding, yet no sum of counts is below 0, so both backends refuse the bitmap (None);
    the same word at +0.5 is a rounding of 0 (no row) or 1."""
    from lossless_hc.backends.cpu import CPU
    from lossless_hc.backends.cuda import CudaBackend
    from lossless_hc.training.plan_stats import bitmap_words
    words = torch.zeros(bitmap_words(10, 2))
    for backend in (CPU, CudaBackend()):
        assert backend.bitmap_rows(words, 10, 2, scale=2.0).tolist() == []
        words[0] = -0.25
        assert backend.bitmap_rows(words, 10, 2, scale=2.0) is None
        words[0] = 0.25
        assert backend.bitmap_rows(words, 10, 2, scale=2.0) is not None
        words[0] = 0.0


def test_the_cuda_backend_s_thc_interleave_refuses_what_the_cpu_kernel_refuses():
    """thc_interleave and thc_deinterleave (run here on CPU tensors) check their operands as the CPU backend's
    do before copying anything: blocks that do not hold ``nb * block`` floats, and an ``out`` that is a negative
    view (its memory would be left holding the negated values); with good operands both give the same bits."""
    from lossless_hc.backends.cpu import CPU
    from lossless_hc.backends.cuda import CudaBackend
    x = torch.arange(1.0, 8.0)                       # 7 coordinates into 2 blocks of 4
    for backend in (CPU, CudaBackend()):
        out = torch.zeros(8)
        backend.thc_interleave(x, 2, 4, out)
        assert out.tolist() == [1.0, 3.0, 5.0, 7.0, 2.0, 4.0, 6.0, 0.0]
        back = torch.zeros(7)
        backend.thc_deinterleave(out, 2, 4, back)
        assert torch.equal(back, x)
        with pytest.raises(ValueError, match="THC interleave of 7 coordinates into 2 blocks of 4"):
            backend.thc_interleave(x, 2, 4, torch.zeros(9))
        with pytest.raises(ValueError, match="THC interleave of 7 coordinates into 2 blocks of 4"):
            backend.thc_deinterleave(torch.zeros(9), 2, 4, back)
        with pytest.raises(ValueError, match="thc_interleave's out is a negative view"):
            backend.thc_interleave(x, 2, 4, torch._neg_view(torch.zeros(8)))
        with pytest.raises(ValueError, match="thc_deinterleave's out is a negative view"):
            backend.thc_deinterleave(out, 2, 4, torch._neg_view(torch.zeros(7)))
