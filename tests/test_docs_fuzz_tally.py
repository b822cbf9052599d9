"""README's fuzzing tally against the runs docs/BENCHMARKS.md lists ("Fuzzing the exactness contract", "Every
run"): the seeds, the cases, the last decoders' share and the `unproven_coordinates` seeds' share are the sums of
the table's rows, not numbers kept by hand beside it (the total was once a run ahead of its rows)."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def every_run_rows():
    """(seed, commit cell, cases run) of each row of the "Every run" table, newest first."""
    text = (ROOT / "docs" / "BENCHMARKS.md").read_text()
    table = text.split("### Every run", 1)[1].split("\n| seed |", 1)[1].split("\n\n", 1)[0]
    rows = []
    for line in table.splitlines():
        cells = [c.strip() for c in line.split("|")[1:-1]]
        if len(cells) == 8 and cells[0].isdigit():
            rows.append((int(cells[0]), cells[2], int(cells[5].replace(",", ""))))
    return rows


def readme_tally():
    text = " ".join((ROOT / "README.md").read_text().split())
    m = re.search(r"(\d+) seeds \(one of them on two CPUs\), ([\d.]+) million cases .*?the last ([\d.]+) million on "
                  r"the decoders of 2026-12-05.*?in seeds 64–(\d+)'s ([\d,]+),", text)
    assert m, "README's fuzzing tally is not where this test reads it"
    return int(m[1]), float(m[2]), float(m[3]), int(m[4]), int(m[5].replace(",", ""))


def test_readme_s_fuzzing_tally_is_the_sum_of_the_listed_runs():
    rows = every_run_rows()
    # Since the verification bound's last fix: the rows down to seed 14's run on afa558f (the fix).
    end = next(i for i, (seed, commit, _) in enumerate(rows) if seed == 14 and commit.startswith("afa558f")) + 1
    since_fix = rows[:end]
    seeds = {seed for seed, _, _ in since_fix}
    assert len(since_fix) == len(seeds) + 1   # one seed (23) ran on two CPUs
    # The decoders of 2026-12-05: the rows down to seed 23's run on e249c2d (the first on e20dad2's decoder).
    last = rows[:next(i for i, (_, commit, _) in enumerate(rows) if commit.startswith("e249c2d")) + 1]
    newest = rows[0][0]   # the newest run (seeds 5101-5103 are a series of their own)
    unproven = sum(cases for seed, _, cases in since_fix if 64 <= seed <= newest)
    n_seeds, total_m, last_m, upto, unproven_cases = readme_tally()
    assert n_seeds == len(seeds)
    assert total_m == round(sum(c for _, _, c in since_fix) / 1e6, 2)
    assert last_m == round(sum(c for _, _, c in last) / 1e6, 2)
    assert (upto, unproven_cases) == (newest, unproven)
