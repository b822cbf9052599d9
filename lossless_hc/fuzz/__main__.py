"""``python -m lossless_hc.fuzz``: see :mod:`lossless_hc.fuzz`. Exit status 1 when any case was wrong."""
from __future__ import annotations

import argparse
import math
import sys

from lossless_hc.fuzz.cases import draw_group, run_group
from lossless_hc.fuzz.thc_cases import run_thc_group
from lossless_hc.fuzz.runner import run


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m lossless_hc.fuzz", description=__doc__)
    ap.add_argument("--cases", type=int, default=100_000, help="decodes to judge (4 per group)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workers", type=int, default=None, help="processes (default: every CPU this process may use)")
    ap.add_argument("--rtol", type=float, default=None, help="the contract's tolerance (default: the codec's)")
    ap.add_argument("--device", default="cpu", help="where the codec runs (cpu, cuda)")
    ap.add_argument("--first-group", type=int, default=0)
    ap.add_argument("--kinds", default="lhc,thc", help="codecs to fuzz: lhc, thc or both (THC: every 8th group)")
    ap.add_argument("--group", type=int, default=None, help="replay one group and print its cases")
    ap.add_argument("--thc-group", type=int, default=None, help="replay one THC group and print its cases")
    args = ap.parse_args(argv)
    # A NaN or infinite tolerance would pass every decoded value: a run that checks nothing, exit status 0.
    if args.rtol is not None and not (math.isfinite(args.rtol) and args.rtol >= 0):
        ap.error(f"--rtol must be a finite number >= 0, got {args.rtol!r}")
    if args.cases < 1:
        ap.error(f"--cases must be >= 1, got {args.cases}")
    if args.workers is not None and args.workers < 1:
        ap.error(f"--workers must be >= 1, got {args.workers}")
    kinds = tuple(k for k in args.kinds.split(",") if k)
    if not kinds or not set(kinds) <= {"lhc", "thc"}:
        ap.error(f"--kinds takes lhc, thc or lhc,thc, got {args.kinds!r}")
    if args.device not in ("cpu", "cuda") and not args.device.startswith("cuda:"):
        ap.error(f"--device must be cpu or cuda (cuda:N), got {args.device!r}")
    if args.thc_group is not None:
        for v in run_thc_group(args.seed, args.thc_group, args.device):
            print(f"  case {v.case} {v.how:16s} {v.status:24s} {v.wrong or ''} {v.detail}")
        return 0
    if args.group is not None:
        print(draw_group(args.seed, args.group).describe())
        for v in run_group(args.seed, args.group, args.rtol, args.device):
            print(f"  case {v.case} {v.how:16s} {v.status:24s} {v.wrong or ''} {v.detail}")
        return 0
    t = run(args.cases, args.seed, args.workers, args.rtol, args.device, args.first_group, kinds=kinds)
    print(f"lossless_hc.fuzz: {t.cases} cases (seed {args.seed}, {args.kinds}, from group {args.first_group}) in {t.seconds:.1f} s: {t.cases / max(t.seconds, 1e-9):.0f} cases/s")
    print(f"{'':8s}{'status':28s}{'cases':>10s}")
    for (where, status), count in sorted(t.statuses.items()):
        print(f"{where:8s}{status:28s}{count:10d}")
    print(f"ok-but-wrong: {t.ok_but_wrong}" + "".join(f"  {w}/{k}={c}" for (w, k), c in sorted(t.wrong.items())))
    if t.wrong_groups:
        more = f" and {len(t.wrong_groups) - 40} more" if len(t.wrong_groups) > 40 else ""
        print(f"groups with a wrong case: {' '.join(t.wrong_groups[:40])}{more}")
    for v in t.examples:
        flag = "--thc-group" if v.how.startswith("thc_") else "--group"
        print(f"  replay: python -m lossless_hc.fuzz --seed {args.seed} {flag} {v.group}   "
              f"(case {v.case}, {v.how}, {v.status}: {v.detail})")
    return 1 if t.ok_but_wrong else 0


if __name__ == "__main__":
    sys.exit(main())
