"""THC's CUDA kernels (csrc/cuda/thc_kernels.cuh, lossless_hc/backends/cuda_thc.py) on the host emulation, on
inputs that reach code the steps of tests/test_cuda_thc_emulated.py leave alone: a norm of more chunks than
the emulated grid has blocks and than one tree pass sums, the partial last word of a layout, the float64
digit estimate's correction, the rounding tolerance of an averaged word, and a padded size past numel
(where no write may land). Each test compares the emulated kernels with the CPU backend (the same payload
bits, decoded bits, or error message) or with the definition of the norm's tree.
"""
import numpy as np
import pytest
import torch

import thc_reference as ref

import lossless_hc as lhc
from lossless_hc.backends import cuda_thc as _cuda_thc
from lossless_hc.thc.layout import HDR_CHECKSUM

from test_cuda_emulated import record_arenas
from test_cuda_emulated import emulated  # noqa: F401  (the module-scoped fixture: builds and installs the emulation)
from test_cuda_thc_emulated import assert_same_bits, normal_inputs, ranks, to_emulated_cuda


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


def misestimated_words(base: int, per_word: int, count: int, seed: int) -> list:
    """`count` words of `per_word` digits of `base` (each a valid aggregate) at which floor(s / base)
    computed in float64 (floor(s * (1 / base))) is off by one for at least one of the word's digits,
    as the kernels' estimate is before its correction."""
    rng = np.random.default_rng(seed)
    inv = 1.0 / base
    found = []
    while len(found) < count:
        digits = rng.integers(0, base, size=(4096, per_word))
        s = np.zeros(len(digits), dtype=np.int64)
        for j in reversed(range(per_word)):
            s = s * base + digits[:, j]
        cur, miss = s.copy(), np.zeros(len(s), dtype=bool)
        for _ in range(per_word):
            miss |= np.floor(cur.astype(np.float64) * inv).astype(np.int64) != cur // base
            cur //= base
        found.extend(int(v) for v in s[miss])
    return found[:count]


def test_emulated_digits_where_the_float64_estimate_is_off_by_one(emulated):  # noqa: F811
    """n = 8, g = 20: base 161, 6 digits per float64 word. For about 1% of the words, floor(s * (1 / 161))
    is one off floor(s / 161) at some digit (the kernels' estimate, which they correct by one). Words
    made of such values decode to the CPU's bits, in shared memory and in passes."""
    n, numel, g = 8, 20000, 20
    for block in (1024, 8192):
        kw = dict(granularity=g, initial_norm=50.0, hadamard_block=block)
        cpu, gpu = lhc.THCCodec(numel, n, **kw), to_emulated_cuda(lhc.THCCodec(numel, n, **kw))
        L = cpu.layout
        assert (L.base, L.per_word) == (161, 6)
        x = torch.randn(numel, generator=torch.Generator().manual_seed(block))
        pc = cpu.encode(x)
        gpu.encode(x)
        full = L.words - 1   # the last word may be partial
        words = torch.tensor(misestimated_words(L.base, L.per_word, full, seed=block), dtype=torch.float64)
        agg = pc * n
        agg[L.norm_offset:L.words_offset] = pc[L.norm_offset:L.words_offset]   # one rank's norm and mirror
        agg[L.words_offset:L.words_offset + full] = words
        agg[L.words_offset + full] = 0.0
        agg[HDR_CHECKSUM] = ref.checksum(cpu, agg[L.words_offset:], 0)
        assert_same_bits(cpu.decode(agg), gpu.decode(agg.clone()), f"decode, block {block}")


@pytest.mark.parametrize("block", [1024, 8192], ids=["in-shared", "passes"])
def test_emulated_averaged_words_round_within_half_a_unit(emulated, block):  # noqa: F811
    """An averaged float64 payload is multiplied back by n and rounded: a word off by less than half a
    unit (after the multiplication) is read as the nearest integer on both backends, so the decode is
    the clean one's bits."""
    n, numel = 3, 20000
    kw = dict(initial_norm=70.0, hadamard_block=block)
    cpu = ranks(n, numel, **kw)
    gpu = [to_emulated_cuda(c) for c in ranks(n, numel, **kw)]
    xs = [torch.randn(numel, generator=torch.Generator().manual_seed(10 + r)) for r in range(n)]
    agg = sum(c.encode(x) for c, x in zip(cpu, xs)) / n
    for c, x in zip(gpu, xs):
        c.encode(x)
    L = cpu[0].layout
    off = agg.clone()
    off[L.words_offset + 3] += 0.3 / n
    off[L.words_offset + 40] -= 0.45 / n
    outs = [decode_again(c, p, 70.0, averaged=True) for c in (cpu[0], gpu[0]) for p in (agg, off)]
    for y, what in zip(outs[1:], ("cpu, words off", "emulated, clean", "emulated, words off")):
        assert_same_bits(outs[0], y, what)


@pytest.mark.parametrize("numel,block", [(3000, 1024), (9000, 8192)], ids=["in-shared", "passes"])
def test_emulated_kernels_write_nothing_past_numel(emulated, numel, block):  # noqa: F811
    """numel short of the padded size: the kernels transform the padded coordinates, but write only numel
    values into the error memory (the norm-only round, then steps with feedback) and into decode's out.
    Both are views into longer buffers here, whose tails must keep their sentinel."""
    n, sentinel = 2, 7.0
    cpu = ranks(n, numel, hadamard_block=block)
    gpu = [to_emulated_cuda(c) for c in ranks(n, numel, hadamard_block=block)]
    assert cpu[0].layout.padded > numel
    tails = []
    for c in gpu:   # the error memory, as a view of numel + block floats
        room = torch.full((numel + block,), sentinel)
        room[:numel] = c.error
        c._error = room[:numel]
        tails.append(room[numel:])
    make = normal_inputs(n, numel, seed=block)
    for step in range(3):
        xs = make(step)
        pc = [c.encode(x) for c, x in zip(cpu, xs)]
        pg = [c.encode(x) for c, x in zip(gpu, xs)]
        for r in range(n):
            assert_same_bits(pc[r], pg[r], f"step {step} rank {r} payload")
            assert_same_bits(cpu[r].error, gpu[r].error, f"step {step} rank {r} error memory")
            assert bool((tails[r] == sentinel).all()), f"step {step} rank {r}: written past the error memory"
        agg = sum(pc)
        for r in range(n):
            room = torch.full((numel + block,), sentinel)
            assert_same_bits(cpu[r].decode(agg), gpu[r].decode(agg.clone(), out=room[:numel]), f"step {step} decode")
            assert bool((room[numel:] == sentinel).all()), f"step {step} rank {r}: decode wrote past numel"


@pytest.mark.parametrize("numel,kw", [(20000, {"hadamard_block": 8192}), (5000, {}), (3000, {"granularity": 300})],
                         ids=["passes", "in-shared", "g300-wide-levels"])
def test_emulated_scratch_holds_what_the_kernels_write(emulated, monkeypatch, numel, kw):  # noqa: F811
    """The scratch each launch sequence asks cuda_runtime.Arena for holds what its kernels write there: a
    double per norm chunk (thc_norm_chunks) and per tree group (thc_tree_pass), a level of 1 or 4 bytes
    per padded coordinate and, transformed in passes, a float per padded coordinate. The arena rounds each
    slice up to 256 bytes, so a short slice runs into the next one unnoticed by the bits compared elsewhere."""
    asked = record_arenas(monkeypatch)
    gpu = [to_emulated_cuda(c) for c in ranks(2, numel, initial_norm=50.0, **kw)]
    gpu[0].decode(sum(c.encode(x) for c, x in zip(gpu, normal_inputs(2, numel, seed=numel)(0))))
    L = gpu[0].layout
    passes = L.block > _cuda_thc.TILE
    chunks = -(-L.padded // 1024)
    need_encode = {"partials": 8 * chunks, "tree0": 8 * -(-chunks // 1024), "tree1": 8 * -(-chunks // 1024),
                   "levels": (1 if L.granularity <= 255 else 4) * L.padded}
    need_decode = {}
    if passes:
        need_encode["y"] = need_decode["y"] = 4 * L.padded
    assert len(asked) == 3   # two encodes, a decode
    for sizes, need in zip(asked, (need_encode, need_encode, need_decode)):
        assert sizes["state"] >= _cuda_thc.STATE_BYTES
        assert all(sizes.get(name, 0) >= nbytes for name, nbytes in need.items()), (sizes, need)
