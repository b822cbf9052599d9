"""The LHC CUDA kernels' guards and boundaries, on the host emulation (tests/test_cuda_emulated.py):
inputs that reach a status, a bound or a capacity check which the broader emulated tests pass through
without deciding anything there. Each test compares the emulated kernels with the CPU backend (status,
counts, output bits) on a payload built to reach one such check."""
import numpy as np
import pytest
import torch

import helpers
from lossless_hc.backends import cuda_lhc as _cuda
from lossless_hc.lhc.layout import (HDR_INDEX_CHECK0, HDR_KEYS_LO, HDR_NON_FINITE, HDR_SATURATED, HEADER_FIELDS,
                                    INDEX_CHECK_PRIMES)
from lossless_hc.lhc import reference
from lossless_hc.lhc.sizing import build_layout
from lossless_hc.lhc.status import DecodeStatus
from test_cuda import assert_same_payload, bits, index_verdicts_agree
from test_cuda_emulated import emulated_encode
from test_cuda_multilevel_emulated import setup as ml_setup
from test_index_guards import add_counters, shift_count, with_header
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


def test_bloom_candidates_beyond_the_list_are_counted_as_the_cpu(emulated):  # noqa: F811
    """Three ranks of 300 keys each on a Bloom table sized for 40: 2984 candidates, more than the
    candidate list holds (the table's 1863 cells; the count peel could not resolve more). Both
    backends: INDEX_PEEL_FAILED, reporting all 2984 candidates."""
    cpu, native = codecs("bloom", 6000, 3, 300, union=40)
    p, _ = summed(cpu, 3, 300)
    status, out, _, _ = index_verdicts_agree(cpu, native, p)
    assert status == DecodeStatus.INDEX_PEEL_FAILED
    assert native.cand_cap == cpu.layout.bloom.cells < 2984
    assert not out.any()


def test_stalled_peel_outranks_a_corrupt_mass_cell(emulated):  # noqa: F811
    """Two ranks of 60 keys on a sketch sized for 40: 119 support keys fit the value peel's list
    (126 cells) but the peel stalls. A zeroed mass cell where keys are left is a corrupt sketch too;
    as on the CPU, the stalled peel decides: SKETCH_PEEL_FAILED, not SKETCH_CORRUPT."""
    cpu, native = codecs("bitmap", 3000, 2, 60, union=40)
    L = cpu.layout
    p, xs = summed(cpu, 2, 60)
    status, out, _, _ = index_verdicts_agree(cpu, native, p)
    assert status == DecodeStatus.SKETCH_PEEL_FAILED and out.isnan().any()
    key = int(torch.nonzero(xs[0]).reshape(-1)[0])
    cell = int(reference.key_cells(L.sketch, torch.tensor([key]))[0][0, 0])
    p[L.mass_offset + cell] = 0.0
    status, _, _, _ = index_verdicts_agree(cpu, native, p)
    assert status == DecodeStatus.SKETCH_PEEL_FAILED


def test_saturated_bloom_counter_is_in_the_header(emulated):  # noqa: F811
    """A rank with every key non-zero puts more keys into a Bloom counter than its digit cap: the
    emulated encode caps the counters and sets the header's saturated field, as the CPU does."""
    cpu, native = codecs("bloom", 3000, 3, 40)
    x = torch.from_numpy(np.random.default_rng(1).standard_normal(3000).astype(np.float32))
    p_cpu = cpu.encode(x)
    assert p_cpu[HDR_SATURATED] == 1.0, "the CPU encode saturates a counter"
    assert_same_payload(cpu.layout, p_cpu, emulated_encode(native, x), x)


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


@pytest.mark.parametrize("block", [1, 3])
@pytest.mark.parametrize("value", [float("inf"), float("-inf"), float("nan")])
def test_non_finite_input_is_in_the_header(emulated, block, value):  # noqa: F811
    """One +-Inf or NaN coordinate among finite ones: the emulated encode sets the header's non-finite
    field, as the CPU does (lhc_encode_scan_b1 for blocks of 1, lhc_encode_flag_blocks above), and
    writes the CPU's mass channel (a NaN adds 0 there, an Inf adds Inf)."""
    cpu, native = codecs("bitmap", 600 * block, 2, 20, block)
    L = cpu.layout
    x = torch.zeros(L.numel)
    x[5 * block:25 * block] = 1.5   # every sum exact: the payloads' bits do not depend on the order
    x[17 * block + block - 1] = value
    p_cpu, p_gpu = cpu.encode(x), emulated_encode(native, x)
    assert p_cpu[HDR_NON_FINITE] == 1.0
    assert torch.equal(p_gpu[:HEADER_FIELDS], p_cpu[:HEADER_FIELDS])
    assert torch.equal(bits(p_gpu[L.mass_offset:]), bits(p_cpu[L.mass_offset:]))


def test_block_of_negative_zeros_is_a_zero_key(emulated):  # noqa: F811
    """A block whose lanes are all -0.0 (or a mix of -0.0 and 0.0) is no non-zero key on the CPU:
    the emulated encode of blocks (lhc_encode_flag_blocks) neither counts nor indexes it."""
    cpu, native = codecs("bitmap", 600 * 3, 2, 20, 3)
    x = torch.zeros(cpu.layout.numel)
    x[:30] = torch.arange(1, 31, dtype=torch.float32)
    x[30:33] = -0.0
    x[34] = -0.0
    p_cpu = cpu.encode(x)
    assert_same_payload(cpu.layout, p_cpu, emulated_encode(native, x), x)


def test_partial_last_block_reads_only_the_input(emulated):  # noqa: F811
    """The last block of 3000 coordinates in blocks of 7 has 4 lanes: its mass is the largest of those
    4, though the input's storage goes on with larger values (lhc_encode_keys stops at numel)."""
    cpu, native = codecs("bitmap", 3000, 2, 20, 7)
    storage = torch.full((3000 + 7,), 1.0e30)
    x = storage[:3000]
    x.zero_()
    x[-4:] = torch.tensor([1.0, -2.0, 0.5, 0.25])
    x[:70] = 3.0
    assert_same_payload(cpu.layout, cpu.encode(x), emulated_encode(native, x), x)


def test_bloom_counter_at_its_cap_is_not_saturated(emulated):  # noqa: F811
    """A rank whose keys put exactly digit_cap of them into one Bloom counter: the counter holds them
    all, unsaturated (the CPU's rule: saturated only above the cap). The emulated encode agrees."""
    cpu, native = codecs("bloom", 3000, 3, 40)
    L = cpu.layout
    cells, _ = reference.key_cells(L.bloom, torch.arange(L.num_keys))
    cell = int(cells[0, 0])
    keys = torch.nonzero((cells == cell).any(1)).reshape(-1)[:L.digit_cap]
    assert keys.numel() == L.digit_cap and torch.bincount(cells[keys].reshape(-1)).max() == L.digit_cap
    x = torch.zeros(L.numel)
    x[keys] = 1.0
    p_cpu = cpu.encode(x)
    assert p_cpu[HDR_SATURATED] == 0.0
    assert_same_payload(L, p_cpu, emulated_encode(native, x), x)


def test_bitmap_digit_past_the_last_key_is_index_corrupt(emulated):  # noqa: F811
    """A non-zero bitmap digit at the first position past the last key (the last word's spare digits),
    with the header's key total and index checksum forged to agree (tests/test_index_guards.py
    with_header): both backends INDEX_CORRUPT."""
    n = 3
    cpu, native = codecs("bitmap", 2999, n, 40)
    L = cpu.layout
    assert L.num_keys % L.index.per_word, "the last word has spare digits"
    p, _ = summed(cpu, n, 40)
    q = with_header(L, p, 1, L.num_keys)
    word, at = divmod(L.num_keys, L.index.per_word)
    q[L.index_offset + word] += L.index.base ** at
    status, _, _, _ = index_verdicts_agree(cpu, native, q)
    assert status == DecodeStatus.INDEX_CORRUPT


@pytest.mark.parametrize("kind", ["bitmap", "bloom", "multilevel"])
def test_averaged_index_word_that_rounds_to_its_limit_is_index_corrupt(emulated, kind):  # noqa: F811
    """Under AVERAGE an index word is accepted within 1/2 of an integer, which must still lie below
    base^per_word: a zero word replaced by one that rounds up to base^per_word is no packed word. Both
    backends: INDEX_CORRUPT."""
    n = 3
    cpu, native = codecs(kind, 3000, n, 40)
    L = cpu.layout
    p, _ = summed(cpu, n, 40)
    avg = helpers.average_payloads(p, n)
    zero = int(torch.nonzero(avg[L.index_offset:L.index_offset + L.index.words] == 0)[-1])
    limit = L.index.base ** L.index.per_word
    avg[L.index_offset + zero] = (limit - 0.25) / n
    assert limit - 0.5 < float(avg[L.index_offset + zero]) * n < limit
    status, _, _, _ = index_verdicts_agree(cpu, native, avg, averaged=True)
    assert status == DecodeStatus.INDEX_CORRUPT


@pytest.mark.parametrize("kind", ["bitmap", "bloom", "multilevel"])
def test_support_of_exactly_the_peel_s_capacity_is_peeled(emulated, kind):  # noqa: F811
    """A support of exactly as many keys as the value peel's list holds (the sketch's 126 cells) is
    no overflow: the CUDA decode peels it as far as the CPU does (the same peeled keys and NaNs)."""
    n = 2
    cpu, native = codecs(kind, 3000, n, 63, union=40)
    assert native.key_cap == cpu.layout.sketch.cells == 126
    rng = np.random.default_rng(4)
    keys = rng.choice(cpu.layout.num_keys, size=126, replace=False)
    xs = []
    for part in (keys[:63], keys[63:]):
        x = torch.zeros(cpu.layout.numel)
        x[torch.from_numpy(part)] = torch.from_numpy(rng.standard_normal(63).astype(np.float32))
        xs.append(x)
    p = helpers.sum_payloads([cpu.encode(x) for x in xs], rng)
    status, out, _, _ = index_verdicts_agree(cpu, native, p)
    assert status == DecodeStatus.SKETCH_PEEL_FAILED
    assert 0 < int((out != 0).sum() - out.isnan().sum()) < 126, "some keys peeled, not all"


def test_bloom_count_above_world_size_is_index_corrupt(emulated):  # noqa: F811
    """A Bloom key's count raised to world_size + 1 in all three of its counters, with the header's
    key total and index checksum forged to agree: every check but the count peel's bound passes, and
    that one holds a count to world_size. Both backends: INDEX_CORRUPT."""
    n = 3
    cpu, native = codecs("bloom", 3000, n, 40)
    L = cpu.layout
    p, xs = summed(cpu, n, 40)
    held = sum((x != 0).to(torch.int64) for x in xs)
    key = int(torch.nonzero(held == 1)[0])
    q = with_header(L, p, n, key)   # n more holders: n + 1 in all
    q = add_counters(L, q, reference.key_cells(L.bloom, torch.tensor([key]))[0][0].tolist(), n)
    status, _, _, _ = index_verdicts_agree(cpu, native, q)
    assert status == DecodeStatus.INDEX_CORRUPT


def test_bloom_counter_no_candidate_explains_is_index_corrupt(emulated):  # noqa: F811
    """3 added to a zero Bloom counter that no key's other two counters make a candidate of, with the
    header's key total forged (+1 key: the digits' sum stays 3 x the total): candidates, count peel
    and index checksum are those of the honest aggregate, but a counter is left over after the
    peel. Both backends: INDEX_CORRUPT."""
    n = 3
    cpu, native = codecs("bloom", 3000, n, 40)
    L = cpu.layout
    p, _ = summed(cpu, n, 40)
    digits = p[L.index_offset:L.index_offset + L.index.words].double()
    powers = torch.tensor([float(L.index.base ** i) for i in range(L.index.per_word)], dtype=torch.float64)
    counts = (digits[:, None] // powers % L.index.base).reshape(-1)[:L.bloom.cells]
    cells, _ = reference.key_cells(L.bloom, torch.arange(L.num_keys))
    two = (counts[cells] != 0).sum(1) == 2   # keys one zero counter away from being candidates
    near = set(cells[two].reshape(-1).tolist())
    cell = next(c for c in range(L.bloom.cells) if counts[c] == 0 and c not in near)
    q = add_counters(L, p, [cell], 3)
    q[HDR_KEYS_LO] += 1
    status, _, _, _ = index_verdicts_agree(cpu, native, q)
    assert status == DecodeStatus.INDEX_CORRUPT


@pytest.mark.parametrize("value", [float("inf"), float("nan")])
def test_non_finite_mass_cell_is_sketch_overflow(emulated, value):  # noqa: F811
    """An Inf or NaN mass cell (where keys are) in an otherwise honest aggregate: SKETCH_OVERFLOW on
    both backends (lhc_load_bounds flags it), not a verdict on a bound of Inf or a mass check."""
    cpu, native = codecs("bitmap", 3000, 3, 40)
    L = cpu.layout
    p, xs = summed(cpu, 3, 40)
    key = int(torch.nonzero(xs[0]).reshape(-1)[0])
    p[L.mass_offset + int(reference.key_cells(L.sketch, torch.tensor([key]))[0][0, 0])] = value
    status, _, _, _ = index_verdicts_agree(cpu, native, p)
    assert status == DecodeStatus.SKETCH_OVERFLOW


# -- the multilevel index -------------------------------------------------------------------------------

def ml_case(numel, n, k, seed=3, union=None, data_seed=0, last_key=False):
    """A one-level multilevel layout (test_cuda_multilevel_emulated.setup), its codecs, the ranks' inputs
    (rank 0 also holding the last key with ``last_key``) and their SUM."""
    case = ml_setup(numel, n, k, 1, (1,), union=union, seed=seed, data_seed=data_seed)
    if last_key:
        case.xs[0][-1] = 1.0
        case.payloads[0] = case.cpu.encode(case.xs[0])
    return case.cpu, case.native, case.xs, helpers.sum_payloads(case.payloads, case.rng)


def test_multilevel_child_count_above_its_node_s_is_index_corrupt(emulated):  # noqa: F811
    """A key under a node one rank holds, its digit raised to 2 consistently in the fine table, and
    the header's key total and index checksum forged to agree: only the expansion's bound (a child
    count at most its node's) tells. Both backends: INDEX_CORRUPT."""
    cpu, native, xs, p = ml_case(3000, 3, 30)
    L = cpu.layout
    span = L.multilevel.levels[0].span
    holders = lambda node: sum(bool(x[node * span:(node + 1) * span].any()) for x in xs)  # noqa: E731
    key = next(int(k) for k in torch.nonzero(xs[0]).reshape(-1) if holders(int(k) // span) == 1)
    q = with_header(L, shift_count(L, p, key, 1), 1, key)
    status, _, _, _ = index_verdicts_agree(cpu, native, q)
    assert status == DecodeStatus.INDEX_CORRUPT


def test_multilevel_child_past_the_last_key_is_index_corrupt(emulated):  # noqa: F811
    """The last node's first child past the last key given digit 1 in the fine table (consistently),
    with the header's key total and index checksum forged to agree: both backends INDEX_CORRUPT."""
    cpu, native, _, p = ml_case(3001, 3, 30, last_key=True)
    L = cpu.layout
    assert L.num_keys % L.multilevel.levels[0].span, "the last node has children past the last key"
    q = with_header(L, shift_count(L, p, L.num_keys, 1), 1, L.num_keys)
    status, _, _, _ = index_verdicts_agree(cpu, native, q)
    assert status == DecodeStatus.INDEX_CORRUPT


def test_multilevel_coarse_sum_above_the_key_total_outranks_a_stall(emulated):  # noqa: F811
    """An aggregate whose fine table stalls (INDEX_PEEL_FAILED as it is; tests/test_cuda_multilevel.py ML_STALLS)
    with the header's key total zeroed: the coarse digits sum past it, which the CPU checks first.
    Both backends: INDEX_CORRUPT."""
    cpu, native, _, p = ml_case(6000, 3, 80, union=60)
    status, _, _, _ = index_verdicts_agree(cpu, native, p)
    assert status == DecodeStatus.INDEX_PEEL_FAILED
    p[HDR_KEYS_LO:HDR_KEYS_LO + 3] = 0.0
    status, _, _, _ = index_verdicts_agree(cpu, native, p)
    assert status == DecodeStatus.INDEX_CORRUPT


def solvable_pair(n):
    """``(cpu, native, (a, b), (wa, wb), r, cell)``: the codecs of a small bitmap layout for ``n`` ranks, a
    solvable colliding pair a < b there (the same three sketch cells), their weights in those cells, and
    which of them (r) and which sketch cell is the third one, not used to solve the pair."""
    from test_pairs import colliding_pairs
    L = build_layout("bitmap", 2000, n, 8, 1, 11)
    solvable, _ = colliding_pairs(L)
    a, b = solvable[0]
    cells, weights = reference.key_cells(L.sketch, torch.tensor([a, b]))
    wa, wb = weights[0].tolist(), weights[1].tolist()
    p, q, _ = reference.pair_cells(wa, wb)
    r = 3 - p - q
    return helpers.codec_for(L), _cuda.CudaLayout(L, torch.device("cpu")), (a, b), (wa, wb), r, int(cells[0, r])


def test_verify_lists_a_solved_pair_inexact(emulated):  # noqa: F811
    """With verify, a solved pair's keys are always listed inexact (one check cannot verify two values:
    lhc_layout.h verification_bound), on both backends: the same status and inexact keys."""
    from test_cuda_emulated import emulated_decode
    from test_pairs import pair_inputs
    n = 3
    cpu, native, pair, _, _, _ = solvable_pair(n)
    cpu.verify = True
    rng = np.random.default_rng(7)
    xs = pair_inputs(rng, cpu.layout, pair, n, others=3)
    p = helpers.sum_payloads([cpu.encode(x) for x in xs], rng)
    _, r_cpu = cpu.decode(p)
    _, r, _ = emulated_decode(native, p, verify=True)
    assert r_cpu.status == DecodeStatus.INEXACT and set(pair) <= set(r_cpu.inexact_keys.tolist())
    assert r.status == r_cpu.status and torch.equal(r.inexact_keys, r_cpu.inexact_keys)


def test_pair_beside_keys_the_peel_left_is_not_solved(emulated):  # noqa: F811
    """A colliding pair (two keys with the same three cells) alone in its first cell, but with keys the
    stalled peel left in its other cells: no two-key stopping set, so neither backend solves it (its
    cells' sums hold more than the pair). The same status, peeled count and NaNs on both."""
    n = 3
    cpu, native, pair, _, _, _ = solvable_pair(n)
    L = cpu.layout
    cells, _ = reference.key_cells(L.sketch, torch.arange(L.num_keys))
    first, rest = int(cells[pair[0], 0]), set(cells[pair[0], 1:].tolist())
    others = [k for k in range(L.num_keys) if k not in pair and first not in cells[k].tolist()]
    near = [k for k in others if rest & set(cells[k].tolist())]
    rng = np.random.default_rng(5)
    # About 3/4 of the sketch's cells in keys: a stall, within the value peel's list.
    keys = set(pair) | set(near[:4]) | set(rng.choice(others, size=L.sketch.cells * 3 // 4, replace=False).tolist())
    x = torch.zeros(L.numel)
    x[torch.tensor(sorted(keys))] = torch.from_numpy(rng.standard_normal(len(keys)).astype(np.float32))
    p = cpu.encode(x) * n   # n ranks holding the same keys
    status, out, _, _ = index_verdicts_agree(cpu, native, p)
    assert status == DecodeStatus.SKETCH_PEEL_FAILED
    assert out[torch.tensor(pair)].isnan().all()


def test_corrupt_fine_word_outranks_an_overflowing_one(emulated):  # noqa: F811
    """A fine table with one word that is no integer (0.5) and another of magnitude 2^22: the CPU
    reads the whole table first and calls it INDEX_CORRUPT (a corrupt word anywhere), not
    INDEX_OVERFLOW. The emulated kernels agree, whichever word a thread meets first."""
    cpu, native, _, p = ml_case(3000, 3, 30)
    L = cpu.layout
    lo = L.level_offsets[0]
    p[lo + 1] = 0.5
    p[lo + L.multilevel.levels[0].numel - 2] = float(1 << 22)
    status, _, _, _ = index_verdicts_agree(cpu, native, p)
    assert status == DecodeStatus.INDEX_CORRUPT


def test_corrupt_third_cell_of_a_solved_pair_is_caught(emulated):  # noqa: F811
    """A solved pair's values come from two of its cells; the third is checked against them (its
    residual within its bound). 1.0 added to that cell: SKETCH_CORRUPT on both backends."""
    from test_pairs import pair_inputs
    n = 3
    cpu, native, (a, b), _, _, third = solvable_pair(n)
    L = cpu.layout
    rng = np.random.default_rng(8)
    xs = pair_inputs(rng, L, (a, b), n, others=3)
    p = helpers.sum_payloads([cpu.encode(x) for x in xs], rng)
    status, _, _, _ = index_verdicts_agree(cpu, native, p)
    assert status in (DecodeStatus.OK, DecodeStatus.INEXACT)
    p[L.sketch_offset + third] += 1.0
    status, _, _, _ = index_verdicts_agree(cpu, native, p)
    assert status == DecodeStatus.SKETCH_CORRUPT


def test_third_cell_bound_of_a_solved_pair_counts_both_keys(emulated):  # noqa: F811
    """A solved pair's third cell r must hold w_r(a) v_a + w_r(b) v_b within its bound, which carries
    |w_r(a)| E(a) + |w_r(b)| E(b). Per rank the pair's values cancel in r (exact: weights are +-1, +-2),
    so that cell holds 0 and any residual is what is written there. A residual below the CPU's bound
    (found by bisection) by half the smaller of the two keys' terms passes on both backends; just above
    the bound, SKETCH_CORRUPT on both. A bound without either term would call the first corrupt."""
    n = 2
    cpu, native, (a, b), (wa, wb), r, third_cell = solvable_pair(n)
    L = cpu.layout
    third = L.sketch_offset + third_cell
    xs = []
    for s in (1.5, -0.625):   # each rank: x_b = -(w_r(a) / w_r(b)) x_a, so w_r(a) x_a + w_r(b) x_b = 0
        x = torch.zeros(L.numel)
        x[a], x[b] = s, -s * wa[r] / wb[r]
        xs.append(x)
    p = cpu.encode(xs[0]) + cpu.encode(xs[1])
    assert p[third] == 0.0
    _, report = cpu.decode(p, error_bounds=True)
    assert report.status in (DecodeStatus.OK, DecodeStatus.INEXACT)
    keys, E = report.error_bounds
    ea, eb = (float(E[keys.tolist().index(k)]) for k in (a, b))

    def cpu_passes(residual):
        q = p.clone()
        q[third] = residual
        return cpu.decode(q)[1].status in (DecodeStatus.OK, DecodeStatus.INEXACT)

    lo, hi = 0.0, 1.0   # the CPU's bound on cell r: the largest float32 residual it passes
    assert cpu_passes(lo) and not cpu_passes(hi)
    for _ in range(200):
        mid = float(np.float32((lo + hi) / 2))
        if mid in (lo, hi):
            break
        lo, hi = (mid, hi) if cpu_passes(mid) else (lo, mid)
    bound, term = lo, min(abs(wa[r]) * ea, abs(wb[r]) * eb)
    assert 0 < term < bound
    inside = float(np.float32(bound - term / 2))
    for residual, passes in ((inside, True), (hi, False)):
        q = p.clone()
        q[third] = residual
        status, _, _, _ = index_verdicts_agree(cpu, native, q)
        assert (status in (DecodeStatus.OK, DecodeStatus.INEXACT)) == passes, (residual, status)


def test_value_in_an_empty_cell_is_caught(emulated):  # noqa: F811
    """A sketch cell no support key hashes to (its mass and its rounding bound 0) given a value: the
    residual check (|value| <= 0) fails on both backends: SKETCH_CORRUPT."""
    cpu, native = codecs("bitmap", 3000, 3, 40)
    L = cpu.layout
    p, xs = summed(cpu, 3, 40)
    support = torch.nonzero(sum(x.abs() for x in xs)).reshape(-1)
    used = set(reference.key_cells(L.sketch, support)[0].reshape(-1).tolist())
    empty = next(c for c in range(L.sketch.cells) if c not in used)
    assert p[L.mass_offset + empty] == 0.0
    p[L.sketch_offset + empty] = 0.5
    status, _, _, _ = index_verdicts_agree(cpu, native, p)
    assert status == DecodeStatus.SKETCH_CORRUPT


@pytest.mark.parametrize("kind", ["bitmap", "multilevel"])
def test_mass_in_an_empty_cell_is_caught(emulated, kind):  # noqa: F811
    """A sketch cell no support key hashes to given a positive mass (a flipped mass word), its value 0:
    no key is read from it and its residual is 0, but a cell holds keys exactly when its mass is
    positive: SKETCH_CORRUPT on both backends, not a decode that passes."""
    cpu, native = codecs(kind, 3000, 3, 40)
    L = cpu.layout
    p, xs = summed(cpu, 3, 40)
    support = torch.nonzero(sum(x.abs() for x in xs)).reshape(-1)
    used = set(reference.key_cells(L.sketch, support)[0].reshape(-1).tolist())
    empty = next(c for c in range(L.sketch.cells) if c not in used)
    assert p[L.mass_offset + empty] == 0.0 and p[L.sketch_offset + empty] == 0.0
    p[L.mass_offset + empty] = 1.0
    status, _, _, _ = index_verdicts_agree(cpu, native, p)
    assert status == DecodeStatus.SKETCH_CORRUPT


def test_partial_last_block_decodes_within_out(emulated):  # noqa: F811
    """The last key of 3000 coordinates in blocks of 7 has 4 lanes: the decode writes those 4 (the CPU
    backend's output bits) and not past the end of `out`, here a view of a longer buffer whose tail
    must stay as it was."""
    cpu, native = codecs("bitmap", 3000, 2, 20, 7)
    L = cpu.layout
    x = torch.zeros(L.numel)
    x[-4:] = torch.tensor([1.0, -2.0, 0.5, 0.25])
    x[:70] = 3.0
    p = helpers.sum_payloads([cpu.encode(x), cpu.encode(torch.zeros(L.numel))], np.random.default_rng(0))
    storage = torch.full((L.numel + 7,), 5.0)
    out = storage[:L.numel]
    _, st = _cuda.decode(native, 1.0, 2, p, out, cpu.rtol).finish()
    y_cpu, r_cpu = cpu.decode(p)
    assert st.status == r_cpu.status and torch.equal(bits(out), bits(y_cpu))
    assert torch.equal(out[-4:], x[-4:])
    assert torch.equal(storage[L.numel:], torch.full((7,), 5.0))


@pytest.mark.parametrize("kind", ["bitmap", "bloom", "multilevel"])
def test_fuzzed_index_words_report_as_the_cpu(emulated, kind):  # noqa: F811
    """Random damage to the index words (special values, random integers below 2^22): whatever stage
    fails, the emulated decode's status, candidates, support, false positives and output pattern are
    the CPU backend's (test_cuda.index_verdicts_agree)."""
    cpu, native = codecs(kind, 2000, 3, 30)
    L = cpu.layout
    p, _ = summed(cpu, 3, 30)
    rng = np.random.default_rng(helpers.stable_seed("guards-fuzz", kind))
    specials = np.array([np.nan, -1.0, 0.5, 3.0, 1e30, 2.0 ** 21], dtype=np.float32)
    statuses = set()
    for _ in range(12):
        q = p.clone()
        where = torch.from_numpy(rng.integers(L.index_offset, L.sketch_offset, size=int(rng.integers(1, 4))))
        if rng.random() < 0.5:
            q[where] = torch.from_numpy(rng.choice(specials, size=where.numel()))
        else:
            q[where] = torch.from_numpy(rng.integers(0, 2 ** 22, size=where.numel()).astype(np.float32))
        statuses.add(index_verdicts_agree(cpu, native, q)[0])
    assert DecodeStatus.INDEX_CORRUPT in statuses


def test_decode_refuses_a_dense_layout(emulated):  # noqa: F811
    """A dense layout has no index for the decode kernels: decode refuses it before queuing a kernel
    (the codec copies dense payloads itself) rather than peeling an empty support."""
    cpu, native = codecs("dense", 3000, 2, 3000)
    assert cpu.layout.index_kind == "dense"
    payload = torch.zeros(cpu.layout.payload_numel)
    out = torch.full((cpu.layout.numel,), 7.0)
    with pytest.raises(ValueError, match="bitmap, Bloom and multilevel indexes, not 'dense'"):
        _cuda.decode(native, 1.0, 2, payload, out)
