"""The fuzzer's bookkeeping (lossless_hc.fuzz.runner and the command line): every wrong verdict is counted
once, the examples and groups it reports are the ones that replay it, and a run with the defaults is the run
the docs describe. A fuzzer that miscounts or replays the wrong group reports a wrong decoder badly, or not."""
from collections import Counter

import pytest

from lossless_hc.fuzz import Tally, run
from lossless_hc.fuzz.cases import Verdict, run_group
from lossless_hc.fuzz.runner import MAX_EXAMPLES
from lossless_hc.fuzz.thc_cases import run_thc_group
from test_fuzz_verdicts import refuse_every_thc_decode


def verdicts(group: int, wrong: int, how: str = "sum", clean: bool = True):
    """Hand-made verdicts of one group: ``wrong`` of them ok_but_wrong, then one right one."""
    return ([Verdict(group, case, how, "OK", "ok_but_wrong", f"case {case}", clean=clean) for case in range(wrong)]
            + [Verdict(group, wrong, how, "SKETCH_PEEL_FAILED", None, clean=clean)])


def test_the_tally_counts_each_case_once_and_names_each_wrong_group_once():
    """Each verdict is one case under (clean | corrupt, status); each wrong one is one count under (how, label),
    and its group is listed once however many of its cases were wrong (THC groups as "thc:<g>", numbered apart:
    THC group 4 is not LHC group 4)."""
    t = Tally()
    t.add(verdicts(4, 2))
    t.add(verdicts(9, 3, "index_bit", clean=False))
    t.add(verdicts(4, 1, "thc_word_bit", clean=False))
    t.add(verdicts(9, 0))
    assert t.cases == 10
    assert t.statuses == Counter({("clean", "OK"): 2, ("clean", "SKETCH_PEEL_FAILED"): 2,
                                  ("corrupt", "OK"): 4, ("corrupt", "SKETCH_PEEL_FAILED"): 2})
    assert t.wrong == Counter({("sum", "ok_but_wrong"): 2, ("index_bit", "ok_but_wrong"): 3,
                               ("thc_word_bit", "ok_but_wrong"): 1})
    assert t.ok_but_wrong == 6
    assert t.wrong_groups == ["4", "9", "thc:4"]
    assert [(v.group, v.case, v.how) for v in t.examples] == \
        [(4, 0, "sum"), (4, 1, "sum"), (9, 0, "index_bit"), (9, 1, "index_bit"), (9, 2, "index_bit"),
         (4, 0, "thc_word_bit")]


def test_the_tally_keeps_the_first_examples_and_counts_them_all():
    """MAX_EXAMPLES wrong verdicts are kept, the first ones found (in this tally, then in the ones merged into
    it in order), and every wrong one is counted and its group listed, however many there are."""
    one, two = Tally(), Tally()
    for group in range(MAX_EXAMPLES + 5):
        one.add(verdicts(group, 1))
    assert one.ok_but_wrong == MAX_EXAMPLES + 5 and len(one.wrong_groups) == MAX_EXAMPLES + 5
    assert [v.group for v in one.examples] == list(range(MAX_EXAMPLES))
    half = MAX_EXAMPLES // 2
    first, second = Tally(), Tally()
    for group in range(half + 3):
        first.add(verdicts(group, 1))
        second.add(verdicts(100 + group, 1))
    total = Tally()
    total.merge(first)
    total.merge(second)
    total.merge(two)
    assert [v.group for v in total.examples] == list(range(half + 3)) + [100 + g for g in range(MAX_EXAMPLES - half - 3)]
    assert total.cases == first.cases + second.cases and total.ok_but_wrong == 2 * (half + 3)
    assert total.wrong_groups == [str(g) for g in range(half + 3)] + [str(100 + g) for g in range(half + 3)]
    assert total.statuses == first.statuses + second.statuses


def test_a_run_is_its_groups_verdicts_and_the_thc_groups_beside_every_eighth(monkeypatch):
    """run()'s defaults are the CLI's (seed 0, from group 0, every CPU of this process), a THC group runs beside
    LHC group 0, 8, 16, .. (so one LHC group's run holds THC group 0 and one from group 1 none), and its THC
    groups are the ones ``--thc-group`` replays: under a THC decoder that refuses everything every one is
    wrong, listed by its own number."""
    want = Counter(("clean" if v.clean else "corrupt", v.status) for g in (0, 1) for v in run_group(0, g))
    t = run(8, kinds=("lhc",))
    assert (t.cases, t.statuses) == (8, want)
    assert run(4, seed=0, workers=1).cases == 8 and run(4, seed=0, workers=1, first_group=1).cases == 4
    thc = [v for g in (0, 1, 2) for v in run_thc_group(0, g)]
    t = run(68, seed=0, workers=1, kinds=("thc",), chunk=3)   # LHC groups 0 .. 16, in chunks of 3
    assert (t.cases, t.statuses) == (12, Counter(("clean" if v.clean else "corrupt", v.status) for v in thc))
    refuse_every_thc_decode(monkeypatch)
    t = run(68, seed=0, workers=1, kinds=("thc",), chunk=3)
    assert t.wrong == Counter((v.how, "refused_clean") for v in thc if v.case == 0)
    assert t.wrong_groups == ["thc:0", "thc:1", "thc:2"]


def test_a_run_reports_the_time_it_took():
    """Tally.seconds is the run's own wall time (the CLI's cases/s): not negative, and no more than the call's."""
    import time
    t0 = time.perf_counter()
    t = run(4, seed=0, workers=1, kinds=("lhc",))
    assert 0 < t.seconds <= time.perf_counter() - t0


def test_the_cli_hands_run_the_documented_defaults_and_reports_every_wrong_group(monkeypatch, capsys):
    """``python -m lossless_hc.fuzz`` runs 100,000 cases of seed 0 from group 0, LHC and THC, over every CPU,
    on the CPU, at the codec's rtol; it takes one case and any CUDA device. A tally with a wrong case exits 1
    and prints the first 40 wrong groups (and how many more) and a replay line per example, --thc-group for
    a THC one."""
    from lossless_hc.fuzz import __main__ as cli
    calls, tally = [], Tally()
    monkeypatch.setattr(cli, "run", lambda *args, **kwargs: calls.append((args, kwargs)) or tally)
    assert cli.main([]) == 0
    assert calls.pop() == ((100_000, 0, None, None, "cpu", 0), {"kinds": ("lhc", "thc")})
    assert cli.main(["--cases", "1", "--device", "cuda:1", "--kinds", "thc", "--workers", "1"]) == 0
    assert calls.pop() == ((1, 0, 1, None, "cuda:1", 0), {"kinds": ("thc",)})
    capsys.readouterr()
    for group in range(41):
        tally.add(verdicts(group, 1, "thc_word_bit" if group == 1 else "sum"))
    assert cli.main(["--seed", "5"]) == 1
    out = capsys.readouterr().out
    assert "ok-but-wrong: 41  sum/ok_but_wrong=40  thc_word_bit/ok_but_wrong=1" in out
    assert f"groups with a wrong case: 0 thc:1 {' '.join(str(g) for g in range(2, 40))} and 1 more\n" in out
    assert "replay: python -m lossless_hc.fuzz --seed 5 --group 0 " in out
    assert "replay: python -m lossless_hc.fuzz --seed 5 --thc-group 1 " in out
    assert out.count("replay:") == MAX_EXAMPLES
    tally.wrong_groups = tally.wrong_groups[:40]
    assert cli.main([]) == 1 and "39\n" in capsys.readouterr().out   # 40 groups: no "and 0 more"


@pytest.mark.parametrize("flag", ["--group", "--thc-group"])
def test_the_cli_replays_one_group(flag, capsys):
    """--group and --thc-group print that group's cases (the LHC group's configuration first) as run_group and
    run_thc_group decide them, and exit 0 whatever they are."""
    from lossless_hc.fuzz.__main__ import main
    from lossless_hc.fuzz.cases import draw_group
    assert main(["--seed", "3", flag, "7"]) == 0
    out = capsys.readouterr().out
    got = run_group(3, 7) if flag == "--group" else run_thc_group(3, 7)
    want = [f"  case {v.case} {v.how:16s} {v.status:24s} {v.wrong or ''} {v.detail}" for v in got]
    if flag == "--group":
        want.insert(0, draw_group(3, 7).describe())
    assert out.splitlines() == want
