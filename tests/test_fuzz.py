"""A fast slice of ``python -m lossless_hc.fuzz`` (the same cases as the first groups of a full run),
and the fuzzer's own checks: its contract catches what it must, and its tally does not depend on how
many processes ran it."""
import pytest
import torch

from lossless_hc.fuzz import allowed_error, outside_bounds, outside_contract, run, truth
from lossless_hc.fuzz.cases import CASES_PER_GROUP, group_cases, run_group
from lossless_hc.lhc.status import DecodeStatus

SLICE = 3000
CLEAN = ("sum", "average", "tree")


@pytest.fixture(scope="module")
def fast_slice():
    return run(SLICE, seed=0, workers=1)


def wrong(tally, clean: bool):
    return {k: c for k, c in tally.wrong.items() if (k[0] in CLEAN) == clean}


def test_fast_slice_has_no_ok_but_wrong_case(fast_slice):
    """Every decode of a plain aggregate that claims exactness (ok, or exact outside its reported
    inexact keys) is within the contract and within the per-key bounds it reports, over every index
    kind, block size, world size and value kind drawn, with the default options and (every 4th
    group's second case) with verify=True."""
    t = fast_slice
    assert t.cases >= SLICE
    assert not wrong(t, clean=True), [f"group {v.group} case {v.case} {v.how} {v.status}: {v.detail}" for v in t.examples]
    clean_ok = sum(c for (where, status), c in t.statuses.items() if where == "clean" and status == "OK")
    assert clean_ok > SLICE // 4   # the slice exercises decodes that succeed, not only refusals


def test_fast_slice_corruptions_are_caught_or_harmless(fast_slice):
    """A corrupted aggregate, decoded with verify=True (the fuzzer's choice for corrupted cases), either
    is refused or decodes within the contract (group 725 is a cell corruption that hides under the
    residual bound a large key left in a neighbouring cell: the verification bound lists the keys it
    could reach)."""
    t = fast_slice
    assert not wrong(t, clean=False), [f"group {v.group} case {v.case} {v.how} {v.status}: {v.detail}" for v in t.examples]


def test_float16_overflow_is_not_outside_its_bound():
    """Seed 12, group 4688 of a million-case run: a float16 sum of 74,466 decodes to inf, which the
    contract allows (the dense float16 sum overflows too); the bound check must allow it as well."""
    g, _, _ = group_cases(12, 4688)
    assert g.xs[0].dtype == torch.float16 and float(truth(g.xs)[0].abs().max()) > 65504, \
        "seed 12, group 4688 no longer draws a float16 sum beyond float16's range"
    bad = [f"case {v.case} {v.how} {v.status}: {v.detail}" for v in run_group(12, 4688) if v.wrong]
    assert not bad, bad


def test_index_flip_dropping_a_key_under_huge_ones_is_caught():
    """The one wrong case of the million-case run at layout version 6 (docs/BENCHMARKS.md, fuzz): seed 11,
    group 52726. One index bit flip dropped a key (~2e5) from the decoded support while the key count
    matched, and its value hid under the rounding bound of ~1e29 keys in its cells; the index checksum
    (csrc/lhc_layout.h) now reports the support as INDEX_CORRUPT."""
    verdicts = run_group(11, 52726)
    assert (verdicts[3].how, verdicts[3].status) == ("index_bit", "INDEX_CORRUPT"), verdicts[3]
    bad = [f"case {v.case} {v.how} {v.status}: {v.detail}" for v in verdicts if v.wrong]
    assert not bad, bad


@pytest.mark.parametrize("group,case,how", [(86953, 2, "sketch_bit"), (36392, 3, "wrong_sum")])
def test_corruption_reaching_a_check_cell_along_two_paths(group, case, how):
    """The two wrong cases of seed 14 before the verification bound's soundness rule (450,000 cases,
    docs/BENCHMARKS.md, fuzz). In both, the corrupted word is in the read cell of a key a, and a shares
    two cells with a later key k: it was subtracted into k's read cell and into the check cell that
    verified k. That cell received the error along both paths, which cancelled exactly (w = +1 on
    delta/2 and -2 on delta/4; +2 on -delta/2 and +2 on delta/2), so F(k) was tiny and k's wrong value
    (-0.998 and -0.745 for -1.0) was claimed within rtol. Now a cell holding a key that shares an
    ancestor with k (a is k's parent and in that cell) does not verify k (csrc/lhc_ancestry.h). The
    premise first (as test_reference_lists_the_two_path_keys checks it for the reference decoder): the
    case is still that one-word corruption, and the C++ decoder's output has keys outside the contract,
    every one of them listed inexact; else the verdict below would check nothing."""
    verdicts = [v for v in run_group(14, group) if v.case == case]
    assert [v.how for v in verdicts] == [how], f"seed 14, group {group}: case {case} is no longer a {how}"
    g, verified, p = corrupted_case(14, group, case)
    s, a = truth(g.xs)
    y, report = verified.decode(p, shape=(g.numel,), dtype=g.dtype)
    assert report.status == DecodeStatus.INEXACT, report
    off = outside_contract(y.reshape(-1), s, a, g.world_size, verified.rtol, False)
    outside = set((off.nonzero().flatten() // g.block).tolist())
    assert outside, "no key outside the contract: this case no longer exercises the rule"
    assert outside <= set(report.inexact_keys.tolist()), outside - set(report.inexact_keys.tolist())
    bad = [f"case {v.case} {v.how} {v.status}: {v.detail}" for v in verdicts if v.wrong]
    assert not bad, bad


def corrupted_case(seed: int, group: int, want: int, device: str = "cpu"):
    """The verify codec (on ``device``) and the corrupted aggregate (on the CPU) of case ``want`` (2 or
    3) of a fuzz group, as run_group decodes it."""
    g, _, cases = group_cases(seed, group, device)
    _, _, verified, p, _ = cases[want]
    return g, verified, p


@pytest.mark.parametrize("group,case", [(86953, 2), (36392, 3)])
def test_reference_lists_the_two_path_keys(group, case):
    """The oracle decides as the C++ decoder on those two aggregates: every key outside the contract is
    listed inexact by reference.decode with verify (its rule: reference_peel.verification_bound)."""
    from lossless_hc.lhc import reference
    g, verified, p = corrupted_case(14, group, case)
    s, a = truth(g.xs)
    yr, info = reference.decode(verified.layout, p, verify=True)
    assert info["inexact_keys"].numel() > 0
    off = outside_contract(yr[:g.numel].to(torch.float32), s, a, g.world_size, verified.rtol, False)
    outside = set((off.nonzero().flatten() // g.block).tolist())
    assert outside, "no key outside the contract: this case no longer exercises the rule"
    assert outside <= set(info["inexact_keys"].tolist())


def test_tally_is_a_function_of_the_seed_only():
    one = run(200, seed=3, workers=1, chunk=10)
    two = run(200, seed=3, workers=2, chunk=10)
    assert (one.cases, one.statuses, one.wrong) == (two.cases, two.statuses, two.wrong)
    assert [(v.how, v.status) for v in run_group(3, 7)] == [(v.how, v.status) for v in run_group(3, 7)]
    assert len(run_group(3, 7)) == CASES_PER_GROUP


def test_outside_bounds_flags_a_coordinate_beyond_its_keys_bound():
    """The plain cases' bound check: keys 0 and 2 of block 2 with E = 1e-6; a coordinate off by more
    than E (plus the output's rounding) is flagged, one off by less is not, and coordinates of keys
    without a bound never are."""
    xs = [torch.tensor([1.0, 2.0, 0.0, 0.0, 3.0, 4.0]), torch.tensor([1.0, 0.0, 5.0, 0.0, 0.0, 1.0])]
    s, a = truth(xs)
    bounds = (torch.tensor([0, 2]), torch.tensor([1e-6, 1e-6], dtype=torch.float64))
    y = s.float()
    assert not bool(outside_bounds(y, s, a, 2, bounds, 2).any())
    y[1] += 0.5e-6                      # within E
    y[5] += 1e-4                        # beyond E
    y[2] += 1.0                         # key 1 has no bound: the contract's business, not this check's
    assert outside_bounds(y, s, a, 2, bounds, 2).nonzero().flatten().tolist() == [5]
    y[0] += 1.5e-6                      # beyond E + u (|s| + E), about 1.12e-6 (s = 2), within twice it
    assert outside_bounds(y, s, a, 2, bounds, 2).nonzero().flatten().tolist() == [0, 5]
    y[4] = float("nan")                 # key 2 has a bound: NaN is not within it
    assert outside_bounds(y, s, a, 2, bounds, 2).nonzero().flatten().tolist() == [0, 4, 5]
    # each key's own bound: key 2's larger E does not cover key 0
    y = s.float()
    y[0] += 1e-4
    wide = (torch.tensor([0, 2]), torch.tensor([1e-6, 1e-3], dtype=torch.float64))
    assert outside_bounds(y, s, a, 2, wide, 2).nonzero().flatten().tolist() == [0]
    # a float16 output beyond 65504 is inf, as a float16 dense sum would be (seed 12, group 4688)
    big = [torch.tensor([70000.0, 1.0]), torch.tensor([5000.0, 0.0])]
    s, a = truth(big)
    y = s.to(torch.float16)
    assert torch.isinf(y[0])
    assert not bool(outside_bounds(y, s, a, 2, (torch.tensor([0]), torch.tensor([1e-3], dtype=torch.float64)), 2).any())


def test_contract_is_the_coordinates_own_bound():
    """Zero where no rank wrote, the dense allreduce's bound from the coordinate's own magnitudes (not
    the tensor's largest value), rtol relative to the sum, and never a non-finite value."""
    xs = [torch.tensor([0.0, 1.0, 5e7, 1.0, 1.0]), torch.tensor([0.0, 1.0, 5e7, -1.0, 1.0])]
    s, a = truth(xs)
    rtol = 1e-6
    exact = s.to(torch.float32)
    assert not outside_contract(exact, s, a, 2, rtol).any()
    y = exact.clone()
    y[0] = 1e-30          # a key no rank touched must stay exactly zero
    y[1] = -2.0           # a small key with the wrong sign, next to a large one
    y[3] = 2.0 ** -20     # cancellation: within 2^-24 of the mass 2, not more
    y[4] = float("nan")
    assert outside_contract(y, s, a, 2, rtol).tolist() == [True, True, False, True, True]
    assert float(allowed_error(s, a, 2, rtol)[2]) >= rtol * 1e8
    # a non-finite input: no finite output is within the contract (its sum is not a number)
    xs[1][1] = float("nan")
    s, a = truth(xs)
    assert outside_contract(exact, s, a, 2, rtol).tolist() == [False, True, False, False, False]


def test_a_decode_vouches_for_what_it_did_not_list():
    """The verdict the fuzzer and ``bench wire`` share: an ok decode vouches for every coordinate, an
    INEXACT one for all but its listed keys' (block 2 here: key 1 is coordinates 2 and 3), a failed
    one for none."""
    from types import SimpleNamespace

    from lossless_hc.lhc.contract import claimed_outside_contract
    from lossless_hc.lhc.status import DecodeStatus

    xs = [torch.tensor([1.0, 2.0, 3.0, 0.0, 0.0, 4.0]), torch.tensor([1.0, 0.0, 0.5, 0.0, 0.0, 1.0])]
    s, a = truth(xs)
    y = s.float()
    y[2] += 1.0                          # key 1
    y[5] += 1.0                          # key 2
    listed = torch.tensor([1])

    def report(status, inexact=torch.empty(0, dtype=torch.int64)):
        return SimpleNamespace(ok=status == DecodeStatus.OK, status=status, inexact_keys=inexact)

    def flagged(rep):
        return claimed_outside_contract(y, rep, s, a, 2, 2.0 ** -10, 2).nonzero().flatten().tolist()

    assert flagged(report(DecodeStatus.OK)) == [2, 5]
    assert flagged(report(DecodeStatus.INEXACT, listed)) == [5]
    assert flagged(report(DecodeStatus.INEXACT, torch.tensor([1, 2]))) == []
    assert flagged(report(DecodeStatus.SKETCH_PEEL_FAILED)) == []


@pytest.mark.parametrize("argv, message", [
    (["--rtol", "nan"], "--rtol must be a finite number >= 0"),   # it passed every value: a run that checked nothing
    (["--rtol", "inf"], "--rtol must be a finite number >= 0"),
    (["--rtol", "-1"], "--rtol must be a finite number >= 0"),
    (["--cases", "0"], "--cases must be >= 1"),
    (["--workers", "-3"], "--workers must be >= 1"),
    (["--workers", "0"], "--workers must be >= 1"),   # the smallest it refuses
    (["--kinds", "lhc,foo"], "--kinds takes lhc, thc or lhc,thc"),
    (["--kinds", ""], "--kinds takes lhc, thc or lhc,thc"),
    (["--device", "foo"], "--device must be cpu or cuda"),
])
def test_the_cli_refuses_arguments_that_would_check_nothing_or_crash(argv, message, capsys):
    from lossless_hc.fuzz.__main__ import main
    with pytest.raises(SystemExit) as exc:
        main(["--cases", "8", "--workers", "1"] + argv)
    assert exc.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("n", [2, 8, 64])
def test_contract_allows_n_minus_one_roundings(n):
    """A dense float32 SUM over n ranks rounds n - 1 times: at s = 0, a = 1 and rtol = 0 the allowance
    is gamma_{n-1} = (n-1) u / (1 - (n-1) u), plus the float64 truth's own rounding ((n + 1) 2^-53 a)
    and half the smallest subnormal, and no more (a looser contract would pass wrong decodes)."""
    u = 2.0 ** -24
    s, a = torch.zeros(1, dtype=torch.float64), torch.ones(1, dtype=torch.float64)
    want = (n - 1) * u / (1 - (n - 1) * u) + 2.0 ** -150 + (n + 1) * 2.0 ** -53
    # abs=0: pytest.approx's default absolute tolerance (1e-12) would pass without the last two terms
    assert float(allowed_error(s, a, n, 0.0)[0]) == pytest.approx(want, rel=1e-12, abs=0)
    # an average rounds once more, by u of the (averaged) sum
    s = torch.full((1,), 3.0, dtype=torch.float64)
    more = allowed_error(s, a, n, 0.0, averaged=True) - allowed_error(s, a, n, 0.0)
    assert float(more[0]) == pytest.approx(3 * u, rel=1e-9, abs=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_infinity_is_allowed_only_where_the_dense_sum_overflows(dtype):
    """A decoded infinity of the sum's sign is within the contract only where the sum is beyond the
    output dtype's largest finite value (the dense sum overflows too): never for a sum of 1."""
    big = torch.finfo(dtype).max
    xs = [torch.tensor([1.0, big, 1.0], dtype=torch.float64), torch.tensor([0.0, big, 0.0], dtype=torch.float64)]
    s, a = truth(xs)
    y = torch.tensor([float("inf"), float("inf"), -float("inf")], dtype=dtype)
    assert outside_contract(y, s, a, 2, 2.0 ** -10).tolist() == [True, False, True]
    # beyond the largest finite value: only the infinity of the sum's sign; just below it, but within the
    # allowance of it (the dense sum may round up past it), the infinity too
    below = big * (1 - 2.0 ** -16)
    xs = [torch.tensor([-big, -big, below / 2], dtype=torch.float64),
          torch.tensor([-big, -big, below / 2], dtype=torch.float64)]
    s, a = truth(xs)
    assert float(s[2]) < big <= float(s[2] + allowed_error(s, a, 2, 2.0 ** -10, dtype)[2])
    y = torch.tensor([float("inf"), -float("inf"), float("inf")], dtype=dtype)
    assert outside_contract(y, s, a, 2, 2.0 ** -10).tolist() == [True, False, False]


def test_contract_takes_the_larger_of_rtol_and_gamma():
    """max(rtol |s|, gamma_{n-1} a), not their sum: at s = a = 1 with rtol = 2^-10 the allowance is
    rtol (plus the truth's rounding and half the smallest subnormal)."""
    s = a = torch.ones(1, dtype=torch.float64)
    want = 2.0 ** -10 + 2.0 ** -150 + 3 * 2.0 ** -53
    assert float(allowed_error(s, a, 2, 2.0 ** -10)[0]) == pytest.approx(want, rel=1e-15, abs=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_contract_allows_half_the_smallest_subnormal_where_no_rank_wrote(dtype):
    """At s = a = 0 every relative term vanishes: the allowance is exactly half the output dtype's
    smallest subnormal (2^-150, 2^-25, 2^-134; rounding below the normal range is absolute). Any more
    would pass a non-zero decode of a coordinate that no rank touched."""
    zero = torch.zeros(1, dtype=torch.float64)
    info = torch.finfo(dtype)
    assert float(allowed_error(zero, zero, 4, 2.0 ** -10, dtype)[0]) == info.smallest_normal * info.eps / 2


def test_contract_of_one_rank_allows_no_summation_rounding():
    """One rank adds nothing: gamma_0 = 0, so at rtol = 0 a float32 decode of a lone value may be off by
    the truth's rounding (2 * 2^-53 a) and half the smallest subnormal only, not by gamma_1 a."""
    s = a = torch.ones(1, dtype=torch.float64)
    want = 2 * 2.0 ** -53 + 2.0 ** -150
    assert float(allowed_error(s, a, 1, 0.0)[0]) == pytest.approx(want, rel=1e-12, abs=0)
    assert outside_contract(torch.tensor([1.0 - 2.0 ** -24]), s, a, 1, 0.0).tolist() == [True]


def test_truth_of_one_rank_is_its_tensor_and_its_magnitude():
    """truth takes any number of ranks, one included: the sum and the absolute mass of a lone tensor
    are the tensor and its absolute value, flattened, in float64."""
    s, a = truth([torch.tensor([[1.5, -2.0], [0.0, 3.0]])])
    assert s.dtype == a.dtype == torch.float64
    assert s.tolist() == [1.5, -2.0, 0.0, 3.0] and a.tolist() == [1.5, 2.0, 0.0, 3.0]


def test_contract_judges_a_sum_unless_told_it_is_an_average():
    """outside_contract and claimed_outside_contract judge a SUM by default: the average's extra
    rounding (u |s|, the division by n) is allowed only with averaged=True. One rank, rtol 0, truth 1: a
    decode of 1 - 2^-24 is one such rounding off."""
    from types import SimpleNamespace

    from lossless_hc.lhc.contract import claimed_outside_contract
    from lossless_hc.lhc.status import DecodeStatus

    s = a = torch.ones(1, dtype=torch.float64)
    y = torch.tensor([1.0 - 2.0 ** -24])
    assert outside_contract(y, s, a, 1, 0.0).tolist() == [True]
    assert outside_contract(y, s, a, 1, 0.0, averaged=True).tolist() == [False]
    ok = SimpleNamespace(ok=True, status=DecodeStatus.OK, inexact_keys=torch.empty(0, dtype=torch.int64))
    assert claimed_outside_contract(y, ok, s, a, 1, 0.0, 1).tolist() == [True]
    assert claimed_outside_contract(y, ok, s, a, 1, 0.0, 1, averaged=True).tolist() == [False]


def test_a_decode_exactly_at_the_allowance_is_within_the_contract():
    """Within iff |y - s| <= the allowance (module doc): a decode off by exactly the allowance is within
    (and within its own bound, outside_bounds' doc).
    For a truth (s, a) = (1, 0) at one rank and rtol 2^-10 the allowance is 2^-10 exactly (half the
    smallest subnormal rounds away in float64); 1 + 2^-10 is exactly that far, the next float32 further."""
    s, a = torch.ones(1, dtype=torch.float64), torch.zeros(1, dtype=torch.float64)
    assert float(allowed_error(s, a, 1, 2.0 ** -10)[0]) == 2.0 ** -10
    y = torch.tensor([1.0 + 2.0 ** -10, 1.0 + 2.0 ** -10 + 2.0 ** -23])
    assert outside_contract(y, s.repeat(2), a.repeat(2), 1, 2.0 ** -10).tolist() == [False, True]
    # outside_bounds likewise flags only |y - s| > E + u (|s| + E) (+ ...): with E = 1 that is 1 + 2^-23
    # exactly, which -2^-23 is from s = 1, and -2^-22 more
    bound = (torch.tensor([0, 1]), torch.ones(2, dtype=torch.float64))
    y = torch.tensor([-2.0 ** -23, -2.0 ** -22])
    assert outside_bounds(y, s.repeat(2), a.repeat(2), 1, bound, 1).tolist() == [False, True]


def test_outside_bounds_allows_the_truths_rounding_as_the_contract_does():
    """outside_bounds adds the float64 truth's own rounding, (n + 1) 2^-53 a, as allowed_error does: a
    key with E = 0 whose ranks cancel (x and -x: s = 0, a = 2x) may decode 2^-20 off where that term is
    1.01 times 2^-20, not where it is 0.99 times it (so neither a smaller nor a larger term passes)."""
    n, y = 2, torch.tensor([2.0 ** -20])
    no_bound = (torch.tensor([0]), torch.zeros(1, dtype=torch.float64))
    for factor, flagged in ((1.01, False), (0.99, True)):
        x = torch.tensor([factor * 2.0 ** -20 / ((n + 1) * 2.0 ** -53) / 2])
        s, a = truth([x, -x])
        assert float(s[0]) == 0.0
        assert (n + 1) * 2.0 ** -53 * float(a[0]) == pytest.approx(factor * 2.0 ** -20, rel=1e-6)
        assert outside_bounds(y, s, a, n, no_bound, 1).tolist() == [flagged], factor
    # and a decode equal to the truth is never outside its bound, however large the cancelled mass
    assert not outside_bounds(torch.zeros(1), s, a, n, no_bound, 1).any()


def test_outside_bounds_rounds_the_peeled_value_relative_to_its_bound_too():
    """The peeled float64 value is off by up to E from s, so rounding it to the output costs
    u_out (|s| + E): at s = 0 (the ranks cancel) with E = 1, a float32 decode of 1 is within its bound
    (E + 2^-24 E), and a decode of 1 + 2^-23 (beyond it) is not."""
    s, a = truth([torch.tensor([3.0, 3.0]), torch.tensor([-3.0, -3.0])])
    bounds = (torch.tensor([0, 1]), torch.ones(2, dtype=torch.float64))
    y = torch.tensor([1.0, 1.0 + 2.0 ** -23])
    assert outside_bounds(y, s, a, 2, bounds, 1).tolist() == [False, True]


def test_a_plain_aggregate_refused_as_corrupted_is_wrong(monkeypatch):
    """A decoder that refuses valid sums as corrupted claims nothing, yet is wrong. With the header check of an
    average exact (a mutation of LosslessCodec._read_header: an averaged field is within 1/2 of an integer, not
    one), 3000 cases of seed 5 refused 122 plain averages as HEADER_CORRUPT and counted 0 wrong. A plain
    aggregate (no rank overloaded) refused with a status that names a corrupted payload is "refused_clean"."""
    from lossless_hc.lhc.codec import LosslessCodec
    real = LosslessCodec._read_header
    monkeypatch.setattr(LosslessCodec, "_read_header",
                        lambda self, fields, scale: real(self, [float(f) * scale for f in fields], 1.0))
    t = run(400, seed=5, workers=1, kinds=("lhc",))
    assert t.wrong[("average", "refused_clean")] > 0 and t.ok_but_wrong == t.wrong[("average", "refused_clean")]
    assert {(v.how, v.status) for v in t.examples} == {("average", "HEADER_CORRUPT")}


def sabotage_decoder(monkeypatch, mode: str) -> None:
    """LosslessCodec.decode made wrong, as ``mode`` says: "ok": an OK decode's largest value off by half of
    it; "inexact": the same at an INEXACT decode's key it did not list; "bound": every value a decode bounds
    off by 2^-16 of itself (within rtol = 2^-10), its bounds E set to 0."""
    from lossless_hc.lhc.codec import LosslessCodec, key_coordinates
    from lossless_hc.lhc.status import DecodeStatus
    real = LosslessCodec.decode

    def decode(self, payload, *args, **kwargs):
        y, report = real(self, payload, *args, **kwargs)
        flat = y.reshape(-1)
        inexact = DecodeStatus(report.status) == DecodeStatus.INEXACT
        if (mode == "ok" and report.ok) or (mode == "inexact" and inexact):
            magnitude = flat.abs().double()
            if inexact:
                magnitude[key_coordinates(report.inexact_keys, self.layout.block, flat.numel())[0]] = 0
            i = int(magnitude.argmax())
            flat[i] *= 1.5
        if mode == "bound" and report.error_bounds is not None:
            keys, E = report.error_bounds
            idx = key_coordinates(keys, self.layout.block, flat.numel())[0]
            flat[idx] = (flat[idx].double() * (1 + 2.0 ** -16)).to(flat.dtype)
            report.error_bounds = (keys, torch.zeros_like(E))
        return y, report
    monkeypatch.setattr(LosslessCodec, "decode", decode)


@pytest.mark.parametrize("mode, label", [("ok", "ok_but_wrong"), ("inexact", "inexact_but_wrong"),
                                         ("bound", "outside_its_bound")])
def test_a_wrong_decoder_is_counted_and_fails_the_run(monkeypatch, capsys, mode, label):
    """The fuzzer is a test: a decoder that claims a value outside the contract (OK, or INEXACT at a key it
    did not list) or outside the bound it reports is counted wrong, under that label, on plain aggregates,
    and the command exits with status 1."""
    from lossless_hc.fuzz.__main__ import main
    sabotage_decoder(monkeypatch, mode)
    assert main(["--cases", "200", "--seed", "0", "--workers", "1", "--kinds", "lhc"]) == 1
    out = capsys.readouterr().out
    assert f"sum/{label}=" in out and "replay: python -m lossless_hc.fuzz --seed 0 --group" in out, out
    t = run(200, seed=0, workers=1, kinds=("lhc",), chunk=10)   # many chunks: each one's counts merged
    assert t.wrong[("sum", label)] > 0
    assert t.ok_but_wrong == sum(t.wrong.values()) and t.examples and t.wrong_groups


@pytest.mark.parametrize("mode, label", [("accepts", "ok_but_wrong"), ("refuses", "refused_clean")])
def test_a_wrong_thc_decoder_is_counted(monkeypatch, mode, label):
    """THC's integrity contract (lossless_hc.fuzz.thc_cases): a decoder that returns other bits than the
    clean decode's for a corrupted aggregate (here: zeros where it refused), or that refuses the clean one,
    is counted wrong, under the THC group's own number."""
    from lossless_hc.thc import THCCodec
    real = THCCodec.decode

    def decode(self, payload, averaged=False, out=None):
        if mode == "refuses":
            raise ValueError("refused")
        try:
            return real(self, payload, averaged=averaged, out=out)
        except ValueError:
            return torch.zeros(self.numel)
    monkeypatch.setattr(THCCodec, "decode", decode)
    t = run(400, seed=0, workers=1, kinds=("thc",))
    assert sum(c for (how, w), c in t.wrong.items() if how.startswith("thc_") and w == label) > 0
    assert t.wrong_groups and all(g.startswith("thc:") for g in t.wrong_groups)


def test_the_first_groups_draw_every_kind_of_case():
    """The generator is part of the test: a class of cases it stops drawing (an index kind, NaN inputs,
    overloads, verify on a plain case, a corruption that changes nothing) passes every other test. The fast
    slice's first 400 groups draw each kind the module doc lists, and every corruption kind changes the
    aggregate's bits somewhere."""
    from collections import defaultdict

    from lossless_hc.fuzz.cases import _restamped
    corruptions = {"index_bit", "sketch_bit", "zero_sketch", "wrong_sum", "header_keys", "header_bit"}
    seen = defaultdict(set)
    for group in range(400):
        g, codec, made = group_cases(0, group)
        for what in ("index", "block", "support", "values", "dtype", "non_finite"):
            seen[what].add(getattr(g, what))
        seen["overloaded"].add(g.keys_per_rank > g.max_nnz // g.block)
        seen["world_size"].add(g.world_size)
        held = g.xs[0] != 0
        if g.values == "cancel" and bool(held.any()) and g.cancel_ranks == 2:   # rank 1 holds minus rank 0 there
            seen["cancels"].add(torch.equal(g.xs[1][held], -g.xs[0][held]))
        if g.values == "cancel" and bool(held.any()) and g.cancel_ranks == 3:
            # ranks 0, 1 and 2 sum to their float32 roundings' residue there: below 2^-22 of their mass, not all 0
            x = [g.xs[r][held].double() for r in range(3)]
            residue, mass = (x[0] + x[1] + x[2]).abs(), x[0].abs() + x[1].abs() + x[2].abs()
            seen["cancels3"].add(bool((residue <= 2.0 ** -22 * mass).all() and (residue > 0).any()
                                      and not torch.equal(x[1], -x[0])))
        seen["cancel_ranks"].add(g.cancel_ranks)
        for case, how, c, p, averaged in made:
            seen["case"].add((case, how, c.verify, averaged))
            if case >= 2:
                before = _restamped(made[0][3], codec, c)   # a finite word changed (inf + 0 * inf is NaN)
                seen["changed"].add((how, bool(((p != before) & before.isfinite()).any())))
    assert seen["index"] == {"bitmap", "bloom", "multilevel", "dense", "auto"}
    assert seen["block"] == {1, 2, 3, 4, 8, 16, 32}
    assert seen["support"] == {"independent", "shared", "hot", "disjoint"}
    assert seen["values"] == {"normal", "range", "integers", "big_small", "cancel", "near_cancel"}
    assert seen["dtype"] == {torch.float32, torch.float16, torch.bfloat16}
    assert seen["non_finite"] == seen["overloaded"] == {True, False} and True in seen["cancels"]
    assert seen["cancel_ranks"] == {0, 2, 3} and True in seen["cancels3"]
    assert min(seen["world_size"]) == 2 and max(seen["world_size"]) > 32
    assert {(how, verify, averaged) for case, how, verify, averaged in seen["case"] if case == 1} == \
        {("average", True, True), ("average", False, True), ("tree", True, False), ("tree", False, False)}
    assert {(how, verify) for case, how, verify, _ in seen["case"] if case >= 2} == {(how, True) for how in corruptions}
    assert {how for how, changed in seen["changed"] if changed} == corruptions


def test_the_first_thc_groups_draw_every_kind_of_case(monkeypatch):
    """As above for THC (:mod:`lossless_hc.fuzz.thc_cases`): sums and averages, float64 and int64 words, every
    bit width, and every corruption kind changing the aggregate's bits somewhere."""
    from lossless_hc.fuzz import thc_cases
    from lossless_hc.fuzz.thc_cases import run_thc_group
    corruptions = {"word_bit", "level_off", "norm_huge", "zero_levels"}
    from lossless_hc.thc import THCCodec
    seen, corrupt = set(), thc_cases._corrupt

    def codec(numel, n, **kw):
        seen.add((kw["bits"], kw["payload_dtype"]))
        return THCCodec(numel, n, **kw)

    def corrupted(how, summed, c, rng):
        p = corrupt(how, summed, c, rng)
        changed = (p != summed).nonzero().flatten()
        seen.add((how, changed.numel() > 0))
        if how in ("level_off", "zero_levels"):   # level words only
            assert bool((changed >= c.layout.words_offset).all()), (how, changed)
        return p
    monkeypatch.setattr(thc_cases, "THCCodec", codec)
    monkeypatch.setattr(thc_cases, "_corrupt", corrupted)
    hows = {v.how for group in range(60) for v in run_thc_group(0, group)}
    assert hows == {"thc_sum", "thc_average"} | {f"thc_{how}" for how in corruptions}
    assert {(bits, dtype) for bits, dtype in (s for s in seen if isinstance(s[0], int))} >= \
        {(b, torch.float64) for b in (2, 3, 4, 8)} | {(4, torch.int64)}
    assert {how for how, changed in (s for s in seen if isinstance(s[0], str)) if changed} == corruptions


def test_the_run_and_the_cli_take_what_they_are_given(capsys):
    """run() judges the cases asked for, rounded up to whole groups and no more (a mutation rounding down ran
    none for --cases 3; one not clamping its chunk ran 250 groups); unknown kinds are refused; and the CLI
    hands --kinds, --first-group and --rtol on (each ignored passed every other test)."""
    from collections import Counter

    from lossless_hc.fuzz.__main__ import main
    assert run(6, seed=0, workers=1, kinds=("lhc",)).cases == 8
    with pytest.raises(ValueError, match="kinds"):
        run(8, seed=0, workers=1, kinds=("lhx",))
    assert main(["--cases", "40", "--workers", "1", "--kinds", "lhc"]) == 0
    assert "40 cases (seed 0, lhc" in capsys.readouterr().out
    assert main(["--cases", "40", "--workers", "1"]) == 0   # and THC groups 0 and 1, beside LHC groups 0 and 8
    assert "48 cases (seed 0, lhc,thc" in capsys.readouterr().out
    want = Counter(("clean" if v.clean else "corrupt", v.status) for v in run_group(11, 52726))
    assert main(["--cases", "4", "--seed", "11", "--first-group", "52726", "--workers", "1", "--kinds", "lhc"]) == 0
    out = capsys.readouterr().out
    assert all(f"{where:8s}{status:28s}{count:10d}" in out for (where, status), count in want.items()), (want, out)
    # rtol 0 leaves a dense sum's rounding only: decodes within the codec's rtol (2^-10) fall outside it
    assert main(["--cases", "40", "--workers", "1", "--kinds", "lhc", "--rtol", "0"]) == 1
