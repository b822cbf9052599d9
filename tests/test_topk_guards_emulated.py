"""The top-k CUDA kernels (csrc/cuda/topk_kernels.cuh, lossless_hc/backends/cuda_topk.py) on the host
emulation, on what tests/test_topk.py's emulated tests leave alone: sizes that the launcher's fixed grid
of counting blocks does not divide, so the last block's range is shorter than the others', and an
``out`` longer than the selection, past which nothing may be written. The indices, values and residual
are the CPU backend's.
"""
import pytest
import torch

from lossless_hc.backends import cuda_topk
from lossless_hc.backends.cpu import CPU

from test_cuda_emulated import emulated  # noqa: F401  (the module-scoped fixture: builds and installs the emulation)
from test_topk import bits, inputs


def counting_blocks(n: int) -> int:
    """The blocks of topk_count / topk_write for n keys under the emulation (one SM), as the launcher
    picks them."""
    return max(1, min(-(-n // (16 * cuda_topk.THREADS)), 32))


@pytest.mark.parametrize("n,kind", [(4097, "normal"), (4097, "ties"), (20_001, "normal"), (20_001, "ties"),
                                    (33 * 4096 + 7, "ties")])   # the last: 32 blocks (the cap), of 4225 keys each
def test_emulated_selection_reaches_the_last_keys_of_a_ragged_split(emulated, n, kind):  # noqa: F811
    """n not a multiple of the counting blocks: the last keys (here the three largest magnitudes) are
    counted and written, and the threshold's ties taken in index order across the ranges, as on the CPU."""
    assert n % counting_blocks(n)
    x = inputs(kind, n, seed=n)
    x[-3:] = torch.tensor([-50.0, 40.0, -60.0])
    for k in (3, 100, n // 3):
        got = cuda_topk.topk_select(x, k)
        assert torch.equal(got, CPU.topk_select(x, k)), k
    e = 0.25 * inputs("normal", n, seed=n + 1)
    ec = e.clone()
    idx, values = torch.empty(100, dtype=torch.int64), torch.empty(100)
    assert cuda_topk.topk_feedback(x, e, 100, idx, values) == 100
    want_idx, want_values = CPU.topk_feedback(x, ec, 100)
    assert torch.equal(idx, want_idx)
    assert torch.equal(bits(values), bits(want_values)) and torch.equal(bits(e), bits(ec))


@pytest.mark.parametrize("kind", ["ties", "normal"])
def test_emulated_selection_writes_nothing_past_its_count(emulated, kind):  # noqa: F811
    """The kernels write exactly min(k, n) indices: into an ``out`` with room for n more (whatever a
    wrong tie quota could write), the selection is the CPU's and the rest keeps its sentinel."""
    n = 20_001
    x = inputs(kind, n, seed=7)
    for k in (1, 100, n // 3, n - 1):
        out = torch.full((k + n,), -7, dtype=torch.int64)
        got = cuda_topk.topk_select(x, k, out=out)
        assert torch.equal(got, CPU.topk_select(x, k)), k
        assert bool((out[k:] == -7).all()), f"k={k}: indices written past the selection"
