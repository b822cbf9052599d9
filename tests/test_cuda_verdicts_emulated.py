"""The CUDA kernels' exactness verdicts, run on the host (no GPU needed; tests/test_cuda_emulated.py
says how the emulation is built and what it can check): the per-key error bounds and INEXACT verdicts
equal the CPU backend's bit for bit (issue #19's example and a property over random inputs), the
verification bound's soundness rule and ancestry cap (csrc/lhc_ancestry.h), and the index checksum.
"""
import numpy as np
import pytest
import torch

import helpers
from lossless_hc.backends import cuda_lhc as _cuda
from lossless_hc.lhc import reference
from lossless_hc.lhc.codec import key_coordinates
from lossless_hc.lhc.layout import HDR_INDEX_CHECK0
from lossless_hc.lhc.status import DecodeStatus
from test_cuda import assert_same_payload, bits
from test_cuda_emulated import assert_same_bounds, emulated_decode, emulated_encode, host_codecs
from test_cuda_emulated import emulated  # noqa: F401  (the module-scoped fixture: builds and installs the emulation)


@pytest.mark.parametrize("index", ["bitmap", "bloom", "multilevel"])
def test_emulated_bound_holds_on_the_issue_example(emulated, index):
    """Issue #19's example (1.0 at 40 keys on 2 ranks beside one 5e7): the CUDA kernels' per-key bound
    makes their own output meet the contract (the keys it cannot prove are listed), as the CPU's
    does, and some seeds do come back INEXACT."""
    from test_exactness import issue_example
    statuses = []
    for seed in range(10):
        xs = issue_example(2000, seed)
        cpu, native = host_codecs(2000, 2, 41, 1, index, seed=seed)
        summed = cpu.encode(xs[0]) + cpu.encode(xs[1])
        y, report, _ = emulated_decode(native, summed)
        y_cpu, r_cpu = cpu.decode(summed)
        assert helpers.peeled_ok(report) == helpers.peeled_ok(r_cpu), (seed, report.reason, r_cpu.reason)
        statuses.append((report.status, r_cpu.status))
        if helpers.peeled_ok(r_cpu):
            helpers.assert_contract(cpu.layout, xs, y, report.inexact_keys, cpu.rtol)
            helpers.assert_contract(cpu.layout, xs, y_cpu, r_cpu.inexact_keys, cpu.rtol)
    # CUDA reads keys from the lowest pure cell of a round, often the 5e7 key's: INEXACT there
    assert any(s == helpers.INEXACT for s, _ in statuses), statuses


def test_emulated_verdicts_match_cpu_on_the_issue_example(emulated):
    """Issue #19, seed 1 of the example: key 1216 is pure in two cells of the same peeling layer, one
    of them shared with the 5e7 key. Both backends read it from the lowest-numbered one (the CPU's
    peel_layers, CUDA's rounds), so they agree on its value, bound and verdict."""
    from test_exactness import issue_example
    xs = issue_example(2000, 1)
    cpu, native = host_codecs(2000, 2, 41, 1, "bitmap", seed=1)
    summed = cpu.encode(xs[0]) + cpu.encode(xs[1])
    y, report, _ = emulated_decode(native, summed)
    y_cpu, r_cpu = cpu.decode(summed, error_bounds=True)
    assert report.status == r_cpu.status and torch.equal(report.inexact_keys, r_cpu.inexact_keys)
    assert torch.equal(bits(y), bits(y_cpu))
    assert_same_bounds(report, r_cpu)


VERDICT_KINDS = ("normal", "wide", "big_small", "cancel")


def verdict_inputs(rng, numel, block, n, k, kind):
    """n ranks' inputs of k keys each (random keys, overlapping): N(0,1), 12 decades wide, ones
    beside a few 1e7-sized values (issue #19's cross-key case), or rank 1 cancelling rank 0 on half
    of rank 0's keys."""
    keys_per = max(1, k // block)
    num_keys = -(-numel // block)
    xs = []
    for _ in range(n):
        x = torch.zeros(numel, dtype=torch.float64)
        keys = torch.from_numpy(rng.choice(num_keys, size=min(keys_per, num_keys), replace=False))
        idx, _ = key_coordinates(keys, block, numel)
        m = idx.numel()
        if kind == "normal":
            v = rng.standard_normal(m)
        elif kind == "wide":
            v = rng.choice([-1.0, 1.0], m) * 10.0 ** rng.uniform(-6, 6, m)
        elif kind == "big_small":
            v = np.where(rng.random(m) < 0.05, 5e7, 1.0) * rng.choice([-1.0, 1.0], m)
        else:
            v = rng.standard_normal(m)
        x[idx] = torch.from_numpy(v)
        xs.append(x)
    if kind == "cancel" and n >= 2:
        half = (xs[0] != 0) & (torch.rand(numel, generator=torch.Generator().manual_seed(int(rng.integers(1 << 30)))) < 0.5)
        xs[1] = torch.where(half, -xs[0], xs[1])
    return [x.float() for x in xs]


@pytest.mark.parametrize("index", ["bitmap", "bloom", "multilevel"])
def test_emulated_verdicts_match_cpu_property(emulated, index):
    """CPU and CUDA read every key from the same cell, round every cell in the same order and decide
    with the same operations: over random seeds, value kinds, block sizes, world sizes, sums or
    averages and verify off or on, the status, the inexact keys, the decoded bits and the error bounds
    agree (corrupted sketches included)."""
    rng = np.random.default_rng(helpers.stable_seed("emu-verdicts", index))
    seen = set()
    for trial in range(8):
        block = int(rng.choice([1, 1, 2, 3, 8]))
        n = int(rng.choice([2, 3, 5, 8]))
        numel = int(rng.integers(300, 2000)) * block
        k = int(rng.integers(8, 60)) * block
        kind = VERDICT_KINDS[trial % len(VERDICT_KINDS)]
        verify = trial % 2 == 1
        # capacity for 2k: "cancel" gives rank 1 half of rank 0's keys besides its own
        cpu, native = host_codecs(numel, n, 2 * k, block, index, seed=int(rng.integers(1 << 31)), verify=verify)
        xs = verdict_inputs(rng, numel, block, n, k, kind)
        summed = helpers.sum_payloads([cpu.encode(x) for x in xs], rng)
        averaged = bool(trial % 3 == 2)
        payloads = [summed / n if averaged else summed]
        corrupt = summed.clone()
        L = cpu.layout
        i = int(rng.integers(L.sketch_offset, L.payload_numel))
        corrupt[i] = corrupt[i] * float(rng.choice([1.0 + 2.0 ** -10, -1.0, 2.0]))
        payloads.append(corrupt)
        for j, p in enumerate(payloads):
            avg = averaged and j == 0
            y, report, _ = emulated_decode(native, p, avg, verify)
            y_cpu, r_cpu = cpu.decode(p, averaged=avg, error_bounds=True)
            what = (trial, index, kind, block, n, j, verify)
            assert report.status == r_cpu.status, (what, report.reason, r_cpu.reason)
            assert torch.equal(report.inexact_keys, r_cpu.inexact_keys), what
            if helpers.peeled_ok(r_cpu):
                assert torch.equal(bits(y), bits(y_cpu)), what
                assert_same_bounds(report, r_cpu, what)
            seen.add(int(r_cpu.status))
    assert {0, helpers.INEXACT, 7} <= seen, seen   # OK, INEXACT and SKETCH_CORRUPT all compared


@pytest.mark.parametrize("group,case", [(86953, 2), (36392, 3)])
def test_emulated_verify_uses_only_sound_cells(emulated, group, case):
    """The verification bound's soundness rule (csrc/lhc_ancestry.h) on the CUDA kernel: on the two
    fuzz aggregates where a corrupted word reaches a cell checking a key along two peel paths
    (tests/test_fuzz.py), and on a plain 8-rank sum of ~15,000 keys decoded with verify (a few
    ancestries there exceed lhc::kAncestryCap), CUDA (which walks ancestries) lists the same inexact
    keys as the CPU (which keeps each ancestry's roots and size, walking only where its parents'
    roots meet), with the same bits; the fuzz cases' wrong keys among them."""
    from lossless_hc.fuzz import outside_contract, truth
    from test_fuzz import corrupted_case
    g, cpu, p = corrupted_case(14, group, case)
    native = _cuda.CudaLayout(cpu.layout, torch.device("cpu"))
    y, report, _ = emulated_decode(native, p, False, True)
    y_cpu, r_cpu = cpu.decode(p, error_bounds=True)
    assert report.status == r_cpu.status == helpers.INEXACT
    assert torch.equal(report.inexact_keys, r_cpu.inexact_keys)
    s, a = truth(g.xs)
    off = outside_contract(y[:g.numel], s, a, g.world_size, cpu.rtol, False)
    assert set((off.nonzero().flatten() // g.block).tolist()) <= set(report.inexact_keys.tolist())
    rng = np.random.default_rng(helpers.stable_seed("emu-sound", group))
    plain, native = host_codecs(100_000, 8, 2000, 1, "bitmap", seed=group, verify=True)
    xs = verdict_inputs(rng, 100_000, 1, 8, 2000, "normal")
    summed = helpers.sum_payloads([plain.encode(x) for x in xs], rng)
    y, report, _ = emulated_decode(native, summed, False, True)
    y_cpu, r_cpu = plain.decode(summed, error_bounds=True)
    assert report.status == r_cpu.status and torch.equal(report.inexact_keys, r_cpu.inexact_keys)
    assert torch.equal(bits(y), bits(y_cpu))


def test_emulated_index_flip_and_zeroed_sketch_are_caught(emulated):
    """The valid-looking bitmap flip of tests/test_robustness_fuzzed_payloads.py: INDEX_CORRUPT (the index checksum) on
    the CUDA kernels too; a zeroed sketch under a valid index: SKETCH_CORRUPT (the residual check)."""
    from test_robustness import CODECS
    codec, xs, summed = CODECS["bitmap"]
    native = _cuda.CudaLayout(codec.layout, torch.device("cpu"))
    p = summed.clone()
    p[codec.layout.index_offset + 22] = 2.0
    _, report, _ = emulated_decode(native, p)
    assert report.status == DecodeStatus.INDEX_CORRUPT, report.reason
    p = summed.clone()
    p[codec.layout.sketch_offset:] = 0.0
    _, report, _ = emulated_decode(native, p)
    assert report.status == 7, report.reason


@pytest.mark.parametrize("index", ["bitmap", "bloom", "multilevel"])
@pytest.mark.parametrize("averaged", [False, True])
def test_emulated_index_checksum(emulated, index, averaged):
    """The index checksum on the CUDA kernels: the encoder's header fields are the CPU's bits (its
    per-thread sums reduced mod p_f, then per warp); a key moved to another position and forged as a
    valid index (tests/test_index_check.py) is INDEX_CORRUPT as on the CPU, and with the header's
    checksum forged to match, both go on to the same verdict; index bit flips get the CPU's status."""
    from test_index_check import flip, positive_case
    n = 3
    cpu, xs, counts, rng = positive_case(index, n, "clustered", seed=2)
    native = _cuda.CudaLayout(cpu.layout, torch.device("cpu"))
    L = cpu.layout
    for x in xs:
        assert_same_payload(L, cpu.encode(x), emulated_encode(native, x), x)
    a = int(torch.nonzero(counts > 1).reshape(-1)[0])
    b = int(torch.nonzero(counts == 0).reshape(-1)[0])
    moved_xs = [x.clone() for x in xs]
    for m in moved_xs:
        m[b], m[a] = m[a].clone(), 0.0
    scale = n if averaged else 1
    payload = torch.stack([cpu.encode(x) for x in xs]).sum(0) / scale
    moved = torch.stack([cpu.encode(x) for x in moved_xs]).sum(0) / scale
    p = payload.clone()
    p[L.index_offset:L.sketch_offset] = moved[L.index_offset:L.sketch_offset]
    _, r = cpu.decode(p, averaged=averaged)
    _, re, _ = emulated_decode(native, p, averaged=averaged)
    assert r.status == re.status == DecodeStatus.INDEX_CORRUPT, (r.reason, re.reason)
    p[HDR_INDEX_CHECK0:HDR_INDEX_CHECK0 + 2] = moved[HDR_INDEX_CHECK0:HDR_INDEX_CHECK0 + 2]
    _, r = cpu.decode(p, averaged=averaged)
    _, re, _ = emulated_decode(native, p, averaged=averaged)
    assert r.status == re.status != DecodeStatus.INDEX_CORRUPT, (r.reason, re.reason)
    words = range(L.index_offset, L.sketch_offset)
    for i in range(6):
        q = flip(payload, words[(i * 7919) % len(words)], (i * 11) % 24)
        _, r = cpu.decode(q, averaged=averaged)
        _, re, _ = emulated_decode(native, q, averaged=averaged)
        assert r.status == re.status, (i, r.reason, re.reason)


def test_emulated_verify_keeps_an_ancestry_of_exactly_the_cap(emulated):
    """lhc_ancestry.h's cap on the CUDA kernel, which walks every ancestry it tests (walk_ancestry):
    on test_kernel_bounds' fan-in of 254 roots, where key k's ancestry is exactly kAncestryCap keys
    (through p's 255) and k is verified, CUDA verifies it too: OK, the CPU's bits. One root more puts
    256 keys in p's cell, more than kMaxCellDegree: SKETCH_PEEL_FAILED with nothing peeled, as on the CPU.
    Through several parents (fan_in_pairs_support) an ancestry of 256 keys is verified, one of 257 not."""
    from test_kernel_bounds import fan_in_pairs_support, fan_in_support
    cpu, native = host_codecs(600_000, 1, 1000, 1, "bitmap", seed=0, verify=True)
    cells = reference.key_cells(cpu.layout.sketch, torch.arange(cpu.layout.num_keys))[0].numpy()
    _, _, x = fan_in_support(cells, 254)
    payload = cpu.encode(x)
    y, report, _ = emulated_decode(native, payload, False, True)
    y_cpu, r_cpu = cpu.decode(payload)
    assert report.status == r_cpu.status == DecodeStatus.OK, report.reason
    assert torch.equal(bits(y), bits(y_cpu)) and torch.equal(y, x)
    _, _, x = fan_in_support(cells, 255)
    payload = cpu.encode(x)
    _, report, _ = emulated_decode(native, payload, False, True)
    _, r_cpu = cpu.decode(payload)
    assert report.status == r_cpu.status == DecodeStatus.SKETCH_PEEL_FAILED, (report.reason, r_cpu.reason)
    assert report.peeled == r_cpu.peeled == 0 and report.support == r_cpu.support
    for singles, pairs in ((253, 1), (252, 2)):
        p, x = fan_in_pairs_support(cells, singles, pairs)
        payload = cpu.encode(x)
        y, report, _ = emulated_decode(native, payload, False, True)
        y_cpu, r_cpu = cpu.decode(payload)
        over = [p] if 1 + singles + 2 * pairs > 256 else []      # p: 256 keys, then 257
        assert report.status == r_cpu.status == (DecodeStatus.INEXACT if over else DecodeStatus.OK), report.reason
        assert report.inexact_keys.tolist() == r_cpu.inexact_keys.tolist() == over, (singles, pairs)
        assert torch.equal(bits(y), bits(y_cpu)) and torch.equal(y, x)
