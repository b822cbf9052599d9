"""How ``bench wire --verify-numel`` and ``bench peel`` judge a decode: ok, or INEXACT with the keys it
could not prove listed, is a decode that worked (the plugins re-aggregate the listed keys); only a
decode that fails, or vouches for a coordinate outside the exactness contract, counts against them.
Both counted every INEXACT decode as a failure after the mass channel (layout 6) made such verdicts
common."""
import json

import pytest

from lossless_hc.bench.cli import main
from lossless_hc.bench.wire import failed_verifications


def test_wire_verify_judges_by_the_contract_and_passes_inexact_decodes(tmp_path):
    """Every kind decodes within the contract; at block 1 some keys are listed INEXACT (bounds grown
    along the peel's chains past rtol), which is a pass, not a failure (the plugins re-aggregate
    them). The check it replaced asked every decode for ``ok``, so it failed them all."""
    out = tmp_path / "wire.json"
    assert main(["wire", "--numel", "262144", "--workers", "2", "--densities", "0.01,0.1", "--block-sizes", "1,32",
                 "--plot", "", "--verify-numel", "262144", "--json", str(out)]) == 0
    res = json.load(open(out))
    decodes = [r for v in res["verified"] for r in v["result"].values()]
    assert len(decodes) == 2 * 2 * 4                       # densities x blocks x index kinds
    assert all(r["decoded"] and r["outside_contract"] == 0 for r in decodes), decodes
    assert any(r["status"] == "INEXACT" and r["inexact_keys"] > 0 for r in decodes)
    assert failed_verifications(res) == []


def test_a_decode_outside_the_contract_fails_the_command():
    bad = {"verified": [{"result": {"bitmap": {"within_contract": True}, "bloom": {"within_contract": False}}}]}
    assert failed_verifications(bad) == bad["verified"]
    assert failed_verifications({"verified": [{"result": {"bitmap": {"within_contract": True}}}]}) == []


def test_peel_counts_inexact_decodes_as_peeled(tmp_path):
    """At 10,000 keys the decode lists a few percent of the keys INEXACT; every key is peeled, so the
    sizing rule's failure count stays 0 (its target: < 1e-3 per decode) and the errors are measured."""
    out = tmp_path / "peel.json"
    assert main(["peel", "--keys", "10000", "--trials", "3", "--json", str(out)]) == 0
    (row,) = json.load(open(out))["rows"]
    assert row["failures"] == 0, row["failure_reasons"]
    assert 0 < row["inexact_share_median"] < 0.1, row
    assert 0 < row["max_abs_err"] < 1e-4, row


def test_wire_refuses_densities_outside_0_1_and_counts_the_points_it_could_not_verify(tmp_path, capsys):
    """``--densities`` outside (0, 1] and a negative ``--verify-numel`` are usage errors (they were
    taken as 1 key and as numel, and as no verification); a point with too few keys at the verify
    numel is not verified, and the report and the JSON say how many."""
    for bad in (["--densities", "-1,2"], ["--densities", "nan"], ["--verify-numel", "-3"]):
        with pytest.raises(SystemExit) as exc:
            main(["wire", "--numel", "4096", "--plot", "", *bad])
        assert exc.value.code == 2, bad
    out = tmp_path / "wire.json"
    assert main(["wire", "--numel", "4096", "--workers", "2", "--densities", "0.001,0.1", "--block-sizes", "1",
                 "--plot", "", "--verify-numel", "1000", "--json", str(out)]) == 0
    res = json.load(open(out))
    assert len(res["verified"]) == 1 and res["verify_too_few_keys"] == 1, res["verify_too_few_keys"]
    assert "1 point(s) not verified" in capsys.readouterr().out


def test_bench_options_the_commands_would_crash_on_or_take_silently_are_usage_errors(capsys):
    """A negative --seed of peel or wire (a codec seed; it ended in a traceback), a negative --threads of
    peel (a traceback) or topk (taken, and printed as the run's setting) exit 2; plan's --topk-ratio
    outside (0, 1] is refused under its own name (the planner's message named max_density)."""
    for argv in (["peel", "--keys", "100", "--trials", "1", "--seed", "-1"],
                 ["peel", "--keys", "100", "--trials", "1", "--threads", "-1"],
                 ["wire", "--numel", "4096", "--plot", "", "--seed", "-5"],
                 ["topk", "--numel", "4096", "--repeat", "1", "--threads", "-2"]):
        with pytest.raises(SystemExit) as exc:
            main(argv)
        assert exc.value.code == 2, argv
    for ratio in ("0", "-1", "2", "nan"):
        with pytest.raises(SystemExit, match=f"--topk-ratio must be in \\(0, 1\\], got {ratio}"):
            main(["plan", "--numel", "4096", "--repeat", "1", "--interval", "2", "--strategies", "topk",
                  "--topk-ratio", ratio])
