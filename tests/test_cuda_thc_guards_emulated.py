"""THC's CUDA kernels (csrc/cuda/thc_kernels.cuh, lossless_hc/backends/cuda_thc.py) on the host emulation, on
inputs that reach code the steps of tests/test_cuda_thc_emulated.py leave alone: a norm of more chunks than
the emulated grid has blocks and than one tree pass sums. Each test compares the emulated kernels with the
CPU backend (the same payload bits) or with the definition of the norm's tree.
"""
import numpy as np
import pytest
import torch

import lossless_hc as lhc
from lossless_hc.backends import cuda_thc as _cuda_thc

from test_cuda_emulated import emulated  # noqa: F401  (the module-scoped fixture: builds and installs the emulation)
from test_cuda_thc_emulated import assert_same_bits, to_emulated_cuda


@pytest.mark.parametrize("block", [64, 8192], ids=["in-shared", "passes"])
def test_emulated_norm_of_more_than_a_tree_width_of_chunks(emulated, block):  # noqa: F811
    """2^20 + 5 coordinates: 1025 norm chunks of 1024, so thc_norm_chunks' grid-stride loop goes round
    the emulated grid (32 blocks) many times, and the chunk partials take two levels of thc_tree_pass
    (two groups of 1024, then their sum): the norm slot, the words and the checksum are the CPU's bits."""
    numel = (1 << 20) + 5
    L = lhc.THCCodec(numel, 2, rank=0, hadamard_block=block).layout
    assert -(-L.padded // _cuda_thc.NORM_CHUNK) > _cuda_thc.TREE_WIDTH
    kw = dict(hadamard_block=block, initial_norm=2000.0, error_feedback=False)
    cpu, gpu = lhc.THCCodec(numel, 2, rank=1, **kw), to_emulated_cuda(lhc.THCCodec(numel, 2, rank=1, **kw))
    x = torch.randn(numel, generator=torch.Generator().manual_seed(block))
    assert_same_bits(cpu.encode(x), gpu.encode(x), "payload")


def tree_reference(values: np.ndarray, width: int = 1024) -> np.ndarray:
    """thc_tree_pass's definition: per group of `width` values (zero-padded), the pairwise tree
    d[i] += d[i + s] for s = width/2, ..., 1; returns the groups' sums."""
    d = np.zeros(-(-len(values) // width) * width)
    d[:len(values)] = values
    d = d.reshape(-1, width)
    s = width // 2
    while s:
        d[:, :s] = d[:, :s] + d[:, s:2 * s]
        s //= 2
    return d[:, 0]


def test_emulated_tree_pass_goes_round_a_grid_smaller_than_its_groups(emulated):  # noqa: F811
    """thc_tree_pass on a grid of fewer blocks than groups of 1024 (a norm of more than
    32 * SMs * 2^20 coordinates on a GPU): every group's sum is written, in the tree's order."""
    values = np.random.default_rng(5).standard_normal(5 * 1024 + 17) ** 2 * 1e3
    src = torch.from_numpy(values)
    want = tree_reference(values)
    for grid in (1, 2, 6):
        out = torch.full((len(want),), float("nan"), dtype=torch.float64)
        emulated.launch("thc_tree_pass", grid, _cuda_thc.THREADS, [src.data_ptr(), len(values), out.data_ptr()], 0)
        assert out.view(torch.int64).tolist() == torch.from_numpy(want).view(torch.int64).tolist(), grid
