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

MAX_EXAMPLES = 20   # wrong verdicts kept (with what replays them); all are counted


@dataclass
class Tally:
    """Counts over every case run: by (clean or corrupted, status), and the wrong ones."""

    cases: int = 0
    statuses: Counter = field(default_factory=Counter)   # ("clean" | "corrupt", status name) -> cases
    wrong: Counter = field(default_factory=Counter)      # (how, "ok_but_wrong" | "inexact_but_wrong") -> cases
    examples: List[Verdict] = field(default_factory=list)   # the first MAX_EXAMPLES wrong verdicts
    wrong_groups: List[int] = field(default_factory=list)    # every group with a wrong verdict
    seconds: float = 0.0

    @property
    def ok_but_wrong(self) -> int:
        """Cases that claimed exactness (ok, or exact outside the reported inexact keys) and were not."""
        return sum(self.wrong.values())

    def add(self, verdicts: List[Verdict]) -> None:
        for v in verdicts:
            where = "clean" if v.how in ("sum", "average", "tree") else "corrupt"
            self.cases += 1
            self.statuses[(where, v.status)] += 1
            if v.wrong is not None:
                self.wrong[(v.how, v.wrong)] += 1
                if len(self.examples) < MAX_EXAMPLES:
                    self.examples.append(v)
                if not self.wrong_groups or self.wrong_groups[-1] != v.group:
                    self.wrong_groups.append(v.group)

    def merge(self, other: "Tally") -> None:
        self.cases += other.cases
        self.statuses.update(other.statuses)
        self.wrong.update(other.wrong)
        self.examples.extend(other.examples[:MAX_EXAMPLES - len(self.examples)])
        self.wrong_groups.extend(other.wrong_groups)


def _run_chunk(args) -> Tally:
    seed, start, stop, rtol, device = args
    torch.set_num_threads(1)
    tally = Tally()
    for group in range(start, stop):
        tally.add(run_group(seed, group, rtol, device))
    return tally


def run(cases: int, seed: int = 0, workers: Optional[int] = None, rtol: Optional[float] = None,
        device: str = "cpu", first_group: int = 0, chunk: int = 250) -> Tally:
    """Run groups ``first_group ..`` until at least ``cases`` cases (``CASES_PER_GROUP`` per group),
    over ``workers`` processes (default: the CPUs this process may use; 1 runs in this process).
    The tally depends on ``seed``, ``cases`` and ``first_group`` only, never on ``workers``."""
    groups = -(-cases // CASES_PER_GROUP)
    if workers is None:
        workers = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    chunks = [(seed, g, min(g + chunk, first_group + groups), rtol, device)
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
