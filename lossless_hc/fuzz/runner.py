"""Run fuzz groups over processes and tally their verdicts (see :mod:`lossless_hc.fuzz`)."""
from __future__ import annotations

import multiprocessing as mp
import os
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import List, Optional

import torch

from lossless_hc.fuzz.cases import CASES_PER_GROUP, Verdict, run_group
from lossless_hc.fuzz.thc_cases import run_thc_group

THC_EVERY = 8   # one THC group beside every 8th LHC group (``kinds`` with "thc")
KINDS = ("lhc", "thc")

MAX_EXAMPLES = 20   # wrong verdicts kept (with what replays them); all are counted


@dataclass
class Tally:
    """Counts over every case run: by (clean or corrupted, status), and the wrong ones."""

    cases: int = 0
    statuses: Counter = field(default_factory=Counter)   # ("clean" | "corrupt", status name) -> cases
    # (how, "ok_but_wrong" | "inexact_but_wrong" | "outside_its_bound" | "proven_but_wrong" | "refused_clean") -> cases
    wrong: Counter = field(default_factory=Counter)
    examples: List[Verdict] = field(default_factory=list)   # the first MAX_EXAMPLES wrong verdicts
    wrong_groups: List[str] = field(default_factory=list)    # every group with a wrong verdict ("thc:<g>" for THC)
    seconds: float = 0.0

    @property
    def ok_but_wrong(self) -> int:
        """Every wrong case: claimed exact (ok, or exact outside the reported inexact keys) and was not, was
        outside the bound it reported, or was refused though it was a plain aggregate (THC: or accepted
        changed when corrupted)."""
        return sum(self.wrong.values())

    def add(self, verdicts: List[Verdict]) -> None:
        for v in verdicts:
            where = "clean" if v.clean else "corrupt"
            self.cases += 1
            self.statuses[(where, v.status)] += 1
            if v.wrong is not None:
                self.wrong[(v.how, v.wrong)] += 1
                if len(self.examples) < MAX_EXAMPLES:
                    self.examples.append(v)
                label = f"thc:{v.group}" if v.how.startswith("thc_") else str(v.group)
                if not self.wrong_groups or self.wrong_groups[-1] != label:
                    self.wrong_groups.append(label)

    def merge(self, other: "Tally") -> None:
        self.cases += other.cases
        self.statuses.update(other.statuses)
        self.wrong.update(other.wrong)
        self.examples.extend(other.examples[:MAX_EXAMPLES - len(self.examples)])
        self.wrong_groups.extend(other.wrong_groups)


def _run_chunk(args) -> Tally:
    seed, start, stop, rtol, device, kinds = args
    torch.set_num_threads(1)
    tally = Tally()
    for group in range(start, stop):
        if "lhc" in kinds:
            tally.add(run_group(seed, group, rtol, device))
        if "thc" in kinds and group % THC_EVERY == 0:
            tally.add(run_thc_group(seed, group // THC_EVERY, device))
    return tally


def run(cases: int, seed: int = 0, workers: Optional[int] = None, rtol: Optional[float] = None,
        device: str = "cpu", first_group: int = 0, chunk: int = 250, kinds=KINDS) -> Tally:
    """Run LHC groups ``first_group ..`` (``CASES_PER_GROUP`` cases each) until ``cases`` cases, and with
    ``kinds`` holding "thc" a THC group (:mod:`lossless_hc.fuzz.thc_cases`, numbered apart) beside every
    ``THC_EVERY``-th, over ``workers`` processes (default: the CPUs this process may use; 1 runs in
    this process). The tally depends on ``seed``, ``cases``, ``first_group`` and ``kinds`` only,
    never on ``workers``."""
    groups = -(-cases // CASES_PER_GROUP)
    if workers is None:
        workers = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    unknown = set(kinds) - set(KINDS)
    if unknown or not kinds:
        raise ValueError(f"kinds must be some of {KINDS}, got {kinds!r}")
    chunks = [(seed, g, min(g + chunk, first_group + groups), rtol, device, tuple(kinds))
              for g in range(first_group, first_group + groups, chunk)]
    t0 = time.perf_counter()
    total = Tally()
    if workers <= 1 or len(chunks) == 1:
        for c in chunks:
            total.merge(_run_chunk(c))
    else:
        # spawn: a fresh interpreter per worker (no forked OpenMP or torch thread state)
        with mp.get_context("spawn").Pool(workers) as pool:
            for t in pool.imap(_run_chunk, chunks):   # in order: examples are the first ones found
                total.merge(t)
    total.seconds = time.perf_counter() - t0
    return total
