"""The LHC CUDA kernels' guards and boundaries, on the host emulation (tests/test_cuda_emulated.py):
inputs that reach a status, a bound or a capacity check which the broader emulated tests pass through
without deciding anything there. Each test compares the emulated kernels with the CPU backend (status,
counts, output bits) on a payload built to reach one such check."""
import numpy as np
import pytest
import torch

import helpers
from lossless_hc.backends import cuda_lhc as _cuda
from lossless_hc.lhc.layout import HDR_INDEX_CHECK0, HDR_KEYS_LO, INDEX_CHECK_PRIMES
from lossless_hc.lhc.sizing import build_layout
from lossless_hc.lhc.status import DecodeStatus
from test_cuda import index_verdicts_agree
from test_cuda_emulated import emulated  # noqa: F401  (the module-scoped fixture: builds and installs the emulation)


def codecs(kind, numel, n, k, block=1, seed=3, union=None):
    """The CPU codec of a layout built with ``union`` support keys in mind (the Bloom and sketch tables
    sized for them), and its emulated CUDA layout."""
    L = build_layout(kind, numel, n, k * block, block, seed, union)
    assert L is not None
    return helpers.codec_for(L), _cuda.CudaLayout(L, torch.device("cpu"))


def summed(cpu, n, k, data_seed=0, dist="normal"):
    rng = np.random.default_rng(data_seed)
    L = cpu.layout
    xs = helpers.make_inputs(rng, L.numel, L.block, n, k, "random", dist)
    return helpers.sum_payloads([cpu.encode(x) for x in xs], rng), xs


def test_bloom_count_peel_that_stalls_is_index_peel_failed(emulated):  # noqa: F811
    """Three ranks of 150 keys each on a Bloom table sized for 40: the aggregate's 1170 candidates fit
    the candidate list, but the count peel stalls. Both backends: INDEX_PEEL_FAILED (a capacity
    status, not INDEX_CORRUPT), the candidates counted, no support and no false positives reported
    (the keys the stalled peel did find are not a support), and an all-zero output."""
    cpu, native = codecs("bloom", 6000, 3, 150, union=40)
    p, _ = summed(cpu, 3, 150)
    status, out, _, _ = index_verdicts_agree(cpu, native, p)
    assert status == DecodeStatus.INDEX_PEEL_FAILED
    assert not out.any()


@pytest.mark.parametrize("kind", ["bitmap", "bloom", "multilevel"])
@pytest.mark.parametrize("damage", ["word", "total", "checksum"])
def test_failed_index_reports_the_cpu_s_counts(emulated, kind, damage):  # noqa: F811
    """An index that fails (a word that is no packed integer, a key total the digits do not sum to, an
    index checksum the support does not match): INDEX_CORRUPT on both backends, with the CPU's report
    -- no support; candidates only where the words were valid (Bloom: and summed to the header's
    total); false positives only after a complete count peel -- and the CPU's all-zero output: a
    support that fails the checksum is not peeled."""
    cpu, native = codecs(kind, 3000, 3, 40)
    L = cpu.layout
    p, _ = summed(cpu, 3, 40)
    if damage == "word":
        p[L.index_offset + int(torch.nonzero(p[L.index_offset:L.sketch_offset])[0])] += 0.5
    elif damage == "total":
        p[HDR_KEYS_LO] += 1
    else:
        p[HDR_INDEX_CHECK0] = (p[HDR_INDEX_CHECK0] + 1) % INDEX_CHECK_PRIMES[0]
    status, _, _, _ = index_verdicts_agree(cpu, native, p)
    assert status == DecodeStatus.INDEX_CORRUPT
