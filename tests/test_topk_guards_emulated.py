"""The top-k CUDA kernels (csrc/cuda/topk_kernels.cuh, lossless_hc/backends/cuda_topk.py) on the host
emulation, on what tests/test_topk.py's emulated tests leave alone: sizes that the launcher's fixed grid
of counting blocks does not divide, so the last block's range is shorter than the others', and an
``out`` longer than the selection, past which nothing may be written. The indices, values and residual
are the CPU backend's.
"""
import pytest
import torch

from lossless_hc.backends import cuda_runtime, cuda_topk
from lossless_hc.backends.cpu import CPU

from test_cuda_emulated import record_arenas
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


@pytest.mark.parametrize("n,k", [(3000, 30), (20_001, 700), (33 * 4096 + 7, 5000)])
def test_emulated_scratch_and_grids_are_what_the_kernels_index(emulated, monkeypatch, n, k):  # noqa: F811
    """The launch sequence's scratch (cuda_runtime.Arena) and grids against csrc/cuda/topk_kernels.cuh: a
    TopkState (32 bytes), kTopkBins = 2048 64-bit bins, two 64-bit counts per counting block (topk_count's
    grid, which topk_offsets is told and topk_write runs on), per-block ranges covering the n keys, and
    blocks of kTopkThreads = 256 threads (the shared scan's size) or one warp. The arena rounds each slice
    up to 256 bytes, so a short slice runs into padding unnoticed by the indices compared elsewhere."""
    asked, launches = record_arenas(monkeypatch), []

    class Recording:
        def __init__(self, inner):
            self.inner = inner

        def launch(self, kernel, grid, block, args, stream, cooperative=False):
            launches.append((kernel, grid, block, list(args)))
            self.inner.launch(kernel, grid, block, args, stream, cooperative)

    real = cuda_runtime.active_launcher
    monkeypatch.setattr(cuda_runtime, "active_launcher", lambda: Recording(real()))
    x = inputs("ties", n, seed=n)
    assert torch.equal(cuda_topk.topk_select(x, k), CPU.topk_select(x, k))
    (sizes,) = asked
    by_kernel = {}
    for kernel, grid, block, args in launches:
        by_kernel.setdefault(kernel, []).append((grid, block, args))
    assert [kernel for kernel, *_ in launches] == ["topk_hist", "topk_pick"] * 3 + ["topk_count", "topk_offsets",
                                                                                    "topk_write"]
    assert [args[3] for _, _, args in by_kernel["topk_hist"]] == [0, 1, 2]   # the three digit passes
    (count,), (offsets,), (write,) = by_kernel["topk_count"], by_kernel["topk_offsets"], by_kernel["topk_write"]
    blocks, per_block = count[0], count[2][3]
    assert write[0] == blocks and offsets[2][1] == blocks and write[2][3] == per_block
    assert blocks == counting_blocks(n) and (blocks - 1) * per_block < n <= blocks * per_block
    assert sizes["state"] >= 32 and sizes["hist"] >= 8 * 2048 and sizes["counts"] >= 16 * blocks, sizes
    for kernel, grid, block, _ in launches:
        assert block == (32 if kernel in ("topk_pick", "topk_offsets") else 256), kernel
        assert grid >= 1 and (grid == 1 or block == 256), kernel


def test_emulated_selection_of_none_or_all_into_a_longer_out(emulated):  # noqa: F811
    """The counts the launcher answers without kernels, k = 0 and k >= n, into an ``out`` with room to
    spare: the selection returned is exactly min(k, n) indices (none; all of them in order), as on the
    CPU backend, and nothing past them is written."""
    from lossless_hc.backends.cuda import CUDA
    n = 2000
    x = inputs("normal", n, seed=3)
    for backend in (CPU, CUDA):
        for k in (0, n, n + 5):
            out = torch.full((n + 10,), -7, dtype=torch.int64)
            got = backend.topk_select(x, k, out=out)
            assert torch.equal(got, torch.arange(min(k, n))), (backend.name, k)
            assert bool((out[min(k, n):] == -7).all()), (backend.name, k)
