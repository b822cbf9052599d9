"""The CPU backend's Python side (lossless_hc.backends.cpu) at its edges: what its argument checks take and
refuse before a kernel sees an address, and the clear error of an install without the C++ kernels."""
import pytest
import torch

from lossless_hc.backends import backend_for, cpu
from lossless_hc.backends.cpu import overlaps

CPU = backend_for(torch.device("cpu"))


@pytest.mark.parametrize("call", [
    pytest.param(lambda: cpu.decode_statuses(), id="decode_statuses"),
    pytest.param(lambda: cpu.thc_cpu_isa(), id="thc_cpu_isa"),
    pytest.param(lambda: cpu.thc_cpu_isas(), id="thc_cpu_isas"),
    pytest.param(lambda: cpu.lhc_peel_batch(), id="lhc_peel_batch"),
    pytest.param(lambda: CPU.require(torch.device("cpu"), "LosslessCodec"), id="require"),
])
def test_without_the_extension_each_entry_point_says_how_to_build_it(monkeypatch, call):
    """An install whose lossless_hc._C failed to import: every entry point that needs the kernels raises the
    ImportError naming the build step (not an AttributeError on None from deep inside)."""
    monkeypatch.setattr(cpu, "_C", None)
    with pytest.raises(ImportError, match=r"lossless_hc\._C \(the C\+\+ kernels\) is not built; run `make build`"):
        call()


def test_operands_overlap_exactly_where_their_bytes_do():
    """overlaps() compares byte ranges: a one-element operand against itself overlaps, operands that only
    touch (one ends where the other starts, either way round) do not, elements of another size count by
    their bytes, and an empty operand overlaps nothing (a bool, as every answer)."""
    buf = torch.zeros(8)
    wide = buf.view(torch.int64)   # element i: the bytes of buf[2 i] and buf[2 i + 1]
    assert overlaps(buf[:1], buf[:1]) and overlaps(buf[3:4], buf[3:5]) and overlaps(buf[3:5], buf[3:4])
    assert not overlaps(buf[:4], buf[4:]) and not overlaps(buf[4:], buf[:4])
    assert overlaps(buf[3:5], buf[4:]) and overlaps(buf[4:], buf[3:5])
    assert not overlaps(buf[:2], wide[1:2]) and not overlaps(wide[1:2], buf[:2])
    assert overlaps(buf[:3], wide[1:2]) and overlaps(wide[1:2], buf[:3])
    assert overlaps(buf[5:6], wide[2:3]) and overlaps(wide[2:3], buf[5:6])
    assert not overlaps(buf[6:], wide[:3]) and not overlaps(wide[:3], buf[6:])
    assert overlaps(buf[:0], buf) is False and overlaps(buf, buf[2:2]) is False


def test_touching_operands_are_taken_and_a_shared_element_is_refused():
    """Through the kernels' entry points: a dst that starts where src ends (or ends where it starts) is
    copied, empty operands are counted, and a one-element dst on its src is refused."""
    buf = torch.arange(8, dtype=torch.float32)
    assert CPU.dense_copy(buf[:4], buf[4:]).tolist() == [3, 0] and buf[4:].tolist() == [0, 1, 2, 3]
    assert CPU.dense_copy(buf[4:], buf[:4]).tolist() == [3, 0]
    assert CPU.dense_copy(buf[:0], buf[8:]).tolist() == [0, 0]
    with pytest.raises(ValueError, match="dense_copy's dst and src overlap"):
        CPU.dense_copy(buf[2:3], buf[2:3])
    idx = torch.empty(1, dtype=torch.int64)
    assert CPU.topk_select(torch.zeros(0), 1, out=torch.empty(0, dtype=torch.int64)).numel() == 0
    assert CPU.topk_select(torch.tensor([-3.0]), 1, out=idx).tolist() == [0]


def test_dense_copy_refuses_operands_it_cannot_copy():
    """dense_copy takes contiguous float32 operands of one numel: another dtype, a strided view or a dst of
    another size is refused, naming the operand, before the kernel reads or writes through an address."""
    src = torch.ones(4)
    for bad_src in (src.double(), torch.ones(8)[::2], src.to(torch.int32)):
        with pytest.raises(TypeError, match="dense_copy's src must be a contiguous float32 tensor"):
            CPU.dense_copy(bad_src, None)
    for bad_dst in (torch.empty(4, dtype=torch.float64), torch.empty(8)[::2]):
        with pytest.raises(TypeError, match="dense_copy's dst must be a contiguous float32 tensor"):
            CPU.dense_copy(src, bad_dst)
    for size in (3, 5):
        with pytest.raises(ValueError, match=f"dense_copy's dst must hold 4 elements on cpu, got {size} on cpu"):
            CPU.dense_copy(src, torch.empty(size))


def test_topk_feedback_refuses_the_x_and_k_topk_select_refuses():
    """topk_feedback checks x and k as topk_select does (a float32 contiguous x, an int k >= 0, no bool),
    before its residual: a float64 x would otherwise be read as float32 words through its address."""
    residual = torch.zeros(4)
    for bad_x in (torch.ones(4, dtype=torch.float64), torch.ones(8)[::2]):
        with pytest.raises(TypeError, match="topk_select takes a contiguous float32 tensor"):
            CPU.topk_feedback(bad_x, residual, 1)
    for bad_k in (-1, True, 1.0):
        with pytest.raises(ValueError, match="k must be an integer >= 0"):
            CPU.topk_feedback(torch.ones(4), residual, bad_k)
    assert residual.tolist() == [0.0] * 4


def test_a_pending_decode_has_no_inexact_keys_until_reported_and_bounds_only_when_asked():
    """The backend's pending decode (below the codec's header checks): inexact_keys() is an empty int64
    tensor before finish() and after an exact one (the keys past rtol after an INEXACT one), and
    error_bounds() after a finish without bounds=True is a RuntimeError, not an answer; with bounds=True it
    lists the support's keys."""
    from lossless_hc import LosslessCodec
    from lossless_hc.lhc.status import DecodeStatus
    codec = LosslessCodec(1000, 1, 10, index="bitmap")
    x = torch.zeros(1000)
    x[[3, 50, 700]] = torch.tensor([1.0, -2.0, 0.5])
    payload = codec.encode(x)
    pending = CPU.lhc_decode(codec._native, payload, torch.empty(1000), 1.0, 1, rtol=codec.rtol)
    for _ in range(2):   # before finish, then after an exact one
        keys = pending.inexact_keys()
        assert keys.dtype == torch.int64 and keys.shape == (0,)
        st, trace = pending.finish(3)
        assert (st.status, st.support_keys, trace) == (DecodeStatus.OK, 3, None)
    with pytest.raises(RuntimeError, match=r"error_bounds\(\) needs finish\(\.\.\., bounds=True\)"):
        pending.error_bounds()
    pending.finish(3, bounds=True)
    keys, bounds = pending.error_bounds()
    assert keys.tolist() == [3, 50, 700] and bounds.dtype == torch.float64 and bool((bounds > 0).all())
    strict = CPU.lhc_decode(codec._native, payload, torch.empty(1000), 1.0, 1, rtol=0.0)   # no bound is 0
    assert strict.finish(3)[0].status == DecodeStatus.INEXACT and strict.inexact_keys().tolist() == [3, 50, 700]
