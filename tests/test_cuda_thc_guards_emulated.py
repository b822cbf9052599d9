"""THC's CUDA kernels (csrc/cuda/thc_kernels.cuh, lossless_hc/backends/cuda_thc.py) on the host emulation, on
inputs that reach code the steps of tests/test_cuda_thc_emulated.py leave alone: a norm of more chunks than
the emulated grid has blocks and than one tree pass sums, and the partial last word of a layout. Each test
compares the emulated kernels with the CPU backend (the same payload bits, decoded bits, or error message)
or with the definition of the norm's tree.
"""
import numpy as np
import pytest
import torch

import thc_reference as ref

import lossless_hc as lhc
from lossless_hc.backends import cuda_thc as _cuda_thc
from lossless_hc.thc.layout import HDR_CHECKSUM

from test_cuda_emulated import emulated  # noqa: F401  (the module-scoped fixture: builds and installs the emulation)
from test_cuda_thc_emulated import assert_same_bits, ranks, to_emulated_cuda


def decode_again(codec, payload, norm, averaged=False):
    """Decode `payload` as the aggregate of the codec's step-0 encode, made with agreed norm `norm`
    (decode advances the step and adopts the payload's norm, even when it raises)."""
    codec._pending, codec._step, codec._norm = True, 0, norm
    return codec.decode(payload.clone(), averaged=averaged)


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


# Layouts whose last group ends in a partial word (fewer digits than per_word): in shared memory
# (thc_decode_blocks) and in passes (thc_unpack_words), float64 and int64 words.
PARTIAL_LAST_WORD = [
    pytest.param(3000, 3, {}, id="in-shared-float64"),
    pytest.param(3000, 3, {"payload_dtype": torch.int64}, id="in-shared-int64"),
    pytest.param(20000, 3, {"hadamard_block": 8192}, id="passes-float64"),
    pytest.param(20000, 3, {"hadamard_block": 8192, "payload_dtype": torch.int64}, id="passes-int64"),
]


def last_word_digits(layout) -> int:
    """Digits of the layout's last word (its last group's coordinates past the last full word)."""
    blocks = layout.padded // layout.block
    last_group = blocks - (blocks - 1) // layout.group_blocks * layout.group_blocks
    return (last_group * layout.block) % layout.per_word or layout.per_word


@pytest.mark.parametrize("numel,n,kw", PARTIAL_LAST_WORD)
def test_emulated_partial_last_word_above_its_digits_is_invalid(emulated, numel, n, kw):  # noqa: F811
    """The last word holds `have` < per_word digits, so its largest aggregate is base^have - 1:
    base^have (a valid value for a full word) is an invalid word on both backends, counted as such
    (not a checksum mismatch), and base^have - 1 is a valid one."""
    cpu = ranks(n, numel, initial_norm=70.0, **kw)
    gpu = [to_emulated_cuda(c) for c in ranks(n, numel, initial_norm=70.0, **kw)]
    xs = [torch.randn(numel, generator=torch.Generator().manual_seed(r)) for r in range(n)]
    agg = sum(c.encode(x) for c, x in zip(cpu, xs))
    for c, x in zip(gpu, xs):
        c.encode(x)
    L = cpu[0].layout
    have = last_word_digits(L)
    assert have < L.per_word, "pick a layout whose last word is partial"
    last = L.words_offset + L.words - 1
    msgs = []
    for c in (cpu[0], gpu[0]):
        bad = agg.clone()
        bad[last] = L.base ** have
        with pytest.raises(ValueError, match="not valid aggregated digit words") as info:
            decode_again(c, bad, 70.0)
        msgs.append(str(info.value))
    assert msgs[0] == msgs[1] and msgs[0].startswith("1 payload word(s)")
    top = agg.clone()   # every digit of the last word at its largest aggregate: valid, equal outputs
    top[last] = L.base ** have - 1
    top[HDR_CHECKSUM] = ref.checksum(cpu[0], top[L.words_offset:], 0)
    outs = [decode_again(c, top, 70.0) for c in (cpu[0], gpu[0])]
    assert_same_bits(outs[0], outs[1], "decode of the largest last word")
