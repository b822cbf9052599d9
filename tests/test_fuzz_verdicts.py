"""The fuzzer's verdict on one decode (lossless_hc.fuzz.cases._verdict), fed hand-made decoder outputs: each
way of being wrong gets its label and names the first coordinate it found, and each way of being right (or of
refusing honestly) gets none. The fuzzer's "0 wrong" means something only if a wrong output is flagged."""
from types import SimpleNamespace

import pytest
import torch

from lossless_hc.fuzz import truth
from lossless_hc.fuzz.cases import _verdict
from lossless_hc.lhc.status import DecodeStatus

# Four ranks, block 1: coordinate 0 cancels to 1 over a mass of 2e6 + 1 (an average allows gamma_3 a / 4, about
# 0.09, there: not gamma_3 a 4); 1 and 3 are plain sums; no rank wrote coordinate 2.
XS = [torch.tensor(row, dtype=torch.float64) for row in
      ([1e6, 2.0, 0.0, 0.5], [-1e6, 3.0, 0.0, 0.25], [1.0, -1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 1.0])]
GROUP = SimpleNamespace(group=17, numel=4, dtype=torch.float32, world_size=4, block=1)
RTOL = 2.0 ** -10


class Decoder:
    """A codec whose decode returns a fixed output and report, and records whether bounds were asked for."""

    def __init__(self, y, status=DecodeStatus.OK, inexact=(), bounds=None, overloaded=0, reason=None):
        self.y, self.asked = torch.tensor(y, dtype=torch.float32), []
        self.report = SimpleNamespace(status=status, ok=status == DecodeStatus.OK, reason=reason,
                                      overloaded_ranks=overloaded, inexact_keys=torch.tensor(inexact, dtype=torch.int64),
                                      error_bounds=bounds)

    def decode(self, payload, averaged, shape, dtype, error_bounds):
        assert (shape, dtype) == ((GROUP.numel,), GROUP.dtype)
        self.asked.append(error_bounds)
        return self.y.clone(), self.report


def verdict(decoder, how="sum", averaged=False):
    s, a = truth(XS)
    return _verdict(GROUP, 2, how, decoder, torch.zeros(8), averaged, s, a, RTOL)


def test_a_right_decode_is_not_wrong_and_a_wrong_one_is_flagged_at_its_first_bad_coordinate():
    """OK with the true sums is right; OK with coordinates 1 and 3 off is ok_but_wrong, reported at coordinate 1
    with what it decoded, the true sum and the mass; the verdict carries the group, case, how and status."""
    v = verdict(Decoder([1.0, 4.0, 0.0, 1.75]))
    assert (v.group, v.case, v.how, v.status, v.wrong, v.detail, v.clean) == (17, 2, "sum", "OK", None, "", True)
    v = verdict(Decoder([1.0, 4.5, 0.0, 2.0]))
    assert (v.wrong, v.detail) == ("ok_but_wrong", "coordinate 1: decoded 4.5, true sum 4.0, mass 6.0")
    v = verdict(Decoder([1.0, 4.0, 2.0 ** -100, 1.75]))   # a coordinate no rank wrote must decode to 0
    assert (v.wrong, v.detail) == ("ok_but_wrong", f"coordinate 2: decoded {2.0 ** -100!r}, true sum 0.0, mass 0.0")


def test_an_inexact_decode_is_wrong_only_at_keys_it_did_not_list_and_a_failed_one_never():
    """INEXACT vouches for every key but its listed ones: off at listed key 1 only is right, off at unlisted
    key 3 too is inexact_but_wrong there. A decode that failed (SKETCH_PEEL_FAILED) claims nothing."""
    y = [1.0, 9.0, 0.0, 7.0]
    assert verdict(Decoder(y, DecodeStatus.INEXACT, inexact=[1, 3])).wrong is None
    v = verdict(Decoder(y, DecodeStatus.INEXACT, inexact=[1]))
    assert (v.status, v.wrong, v.detail) == ("INEXACT", "inexact_but_wrong",
                                             "coordinate 3: decoded 7.0, true sum 1.75, mass 1.75")
    v = verdict(Decoder(y, DecodeStatus.SKETCH_PEEL_FAILED, reason="stuck"))
    assert (v.status, v.wrong) == ("SKETCH_PEEL_FAILED", None)


def test_a_plain_aggregate_refused_as_corrupted_is_wrong_unless_a_rank_was_overloaded():
    """A clean case (sum, average, tree) refused with a corruption status is refused_clean, with the decoder's
    reason; not when a rank was overloaded (its key counts can look corrupted), and never a corrupted case."""
    for how in ("sum", "average", "tree"):
        v = verdict(Decoder([0.0] * 4, DecodeStatus.HEADER_CORRUPT, reason="bad header"), how, how == "average")
        assert (v.status, v.wrong, v.detail, v.clean) == ("HEADER_CORRUPT", "refused_clean", "bad header", True)
    assert verdict(Decoder([0.0] * 4, DecodeStatus.HEADER_CORRUPT, overloaded=2)).wrong is None
    v = verdict(Decoder([0.0] * 4, DecodeStatus.INDEX_CORRUPT), "index_bit")
    assert (v.status, v.wrong, v.clean) == ("INDEX_CORRUPT", None, False)


def test_the_bounds_are_asked_for_and_checked_on_plain_aggregates_only():
    """A clean case's decode is asked for its per-key bounds and a value within the contract but beyond its
    key's bound is outside_its_bound; a corrupted case's is not asked (they hold for valid sums only)."""
    s = [1.0, 4.0, 0.0, 1.75]
    off = [1.0, 4.0 + 2.0 ** -12, 0.0, 1.75]       # within rtol 2^-10 of 4, not within E = 2^-20
    bounds = (torch.tensor([0, 1, 3]), torch.full((3,), 2.0 ** -20, dtype=torch.float64))
    decoder = Decoder(off, bounds=bounds)
    v = verdict(decoder)
    assert (v.wrong, v.detail) == ("outside_its_bound", f"coordinate 1: decoded {4.0 + 2.0 ** -12!r}, true sum 4.0, mass 6.0")
    assert decoder.asked == [True]
    assert verdict(Decoder(s, bounds=bounds)).wrong is None
    decoder = Decoder(off)
    assert verdict(decoder, "wrong_sum").wrong is None and decoder.asked == [False]


@pytest.mark.parametrize("how", ["average", "tree"])
def test_an_average_is_judged_against_the_average(how):
    """An averaged decode is judged against s / n with the mass a / n: the true averages are right, the sums
    are wrong, and coordinate 0 (1 over a mass of 2e6 + 1) is allowed gamma_3 a / n there, not n^2 times it.
    A tree is a sum."""
    averaged = how == "average"
    n = GROUP.world_size
    sums = [1.0, 4.0, 0.0, 1.75]
    right = [x / n for x in sums] if averaged else sums
    assert verdict(Decoder(right), how, averaged).wrong is None
    v = verdict(Decoder([x * n for x in right]), how, averaged)
    assert v.wrong == "ok_but_wrong" and v.detail.startswith("coordinate 0:")
    far = list(right)
    far[0] += 0.2    # beyond gamma_3 (2e6 + 1) / 4, about 0.09; within a sum's gamma_3 (2e6 + 1), about 0.36
    assert verdict(Decoder(far), how, averaged).wrong == ("ok_but_wrong" if averaged else None)


def refuse_every_thc_decode(monkeypatch) -> None:
    """From now on in the test, every THCCodec.decode raises (a decoder that refuses everything)."""
    from lossless_hc.thc import THCCodec

    def refuse(self, payload, averaged=False, out=None):
        raise ValueError("refused")
    monkeypatch.setattr(THCCodec, "decode", refuse)


def test_thc_verdicts_say_what_the_decoder_did(monkeypatch):
    """A THC group's first case is its clean aggregate, OK when decoded; a decoder that refuses everything is
    REFUSED there (refused_clean: wrong) and on every corrupted case (right: refusing a corrupted one is its
    job). Each verdict names the THC group and its case."""
    from lossless_hc.fuzz.thc_cases import CASES_PER_GROUP, run_thc_group
    got = run_thc_group(0, 5)
    assert [(v.group, v.case, v.clean) for v in got] == [(5, c, c == 0) for c in range(CASES_PER_GROUP)]
    assert (got[0].status, got[0].wrong) == ("OK", None)
    refuse_every_thc_decode(monkeypatch)
    assert [(v.status, v.wrong) for v in run_thc_group(0, 5)] == \
        [("REFUSED", "refused_clean")] + [("REFUSED", None)] * (CASES_PER_GROUP - 1)
