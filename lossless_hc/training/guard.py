r"""The step guard: the planner's plans checked against a dense allreduce, on measured steps.

The cost model (:mod:`lossless_hc.training.planner`) prices wire bytes and local work; what it
neglects (how much of the engine's dense allreduce hides behind the backward pass, the hook's own
work competing with it for the same cores, a second collective's round trip) can make a plan it
predicts faster measure slower than the engine's own dense allreduce. ``auto`` should never be
slower than that, exact or lossy, and ``auto`` with ``lossy`` never slower than the engine's own
half-precision allreduce either (a lossy plan that steps slower than what the engine ships buys nothing:
on a fast link the conversions can cost more than the wire they save), so a DDP state, a Horovod
compressor or an FSDP2 state with a guard (``AutoHookState(guard_steps=W)``,
``Compression.auto(guard_steps=W)``, ``AutoFSDPState(mesh, guard_steps=W)``, on by default) runs one
A/B trial on whole training steps:

* **trial**: the ``2BW`` steps from the first step at or after ``start`` in which some dense gradient's
  plan is not ``dense`` (sparse gradients keep their plans throughout: their dense alternative is a
  different model), in blocks of ``B`` consecutive steps (``block``, 2) that alternate: the plans
  (the **plan window**, first), then every dense gradient sent as the engine's own plain step sends it
  (the **dense window**: DDP's buckets allreduced in place as DDP's own hook does, Horovod's tensors as
  its plain allreduce, FSDP2's shards all-reduced in place across the replicas as uncompressed HSDP
  does, and its sparse reduce-scatter replaced by FSDP2's own, in the dtypes that exchange sends chunks
  whole in; with ``lossy``, float32 gradients in half precision where it is among its strategies, as the
  engine's own half-precision hook sends them: DDP's buckets as its ``bf16_compress_hook``, Horovod's
  tensors as its ``Compression.fp16``, FSDP2's shards all-reduced in bfloat16 and its reduce-scatter chunks
  in the bfloat16 the exchange sends large ones whole in, as ``MixedPrecisionPolicy(reduce_dtype=
  torch.bfloat16)``; the aggregators sit these steps out: their statistics and plans wait).
  Alternating, so that a drift of the step time over the trial (allocator and caches still warming, a
  neighbour's load) weighs on both windows alike: back-to-back windows measured a plan faster on VGG at
  2 emulated hosts that ran slower than DDP's allreduce in the steps after. Only the **last step of
  each block is timed** (``W`` per window): the step after a switch pays for the switch (Horovod
  renegotiates every tensor whose payload changed shape; caches and the allocator change hands), a
  cost neither side pays once the verdict stands, and not the same both ways: timing every step of
  single-step blocks tilts the verdict toward the window that is cheaper to switch into (under Horovod
  the plans: docs/BENCHMARKS.md, "The step guard timing only the second step");
* **verdict**, at the first step after: with :math:`T_p` and :math:`T_d` the medians of the two
  windows' step times (a whole iteration, forward, backward, optimizer and every wait included: under
  DDP the time between consecutive starts of bucket 0's hook, under Horovod between the ends of
  consecutive steps' last decompress),

  .. math:: \text{keep the plans} \iff T_p \le (1 - m)\, T_d

  (``margin`` :math:`m`, 0.03: a tie goes to the engine's own allreduce; a negative margin tolerates
  plans up to :math:`1-m` times slower); otherwise every dense gradient is allreduced in place
  from then on (in the dense window's dtypes);
* **confirmation**: a first look that would keep the plans is not a verdict yet: the trial goes on
  for another ``2BW`` steps (``confirm`` such rounds, 1), and the rule above is applied to the medians
  of all its timed steps (``2W`` per window after one round). A look for dense is the verdict at
  once. On this project's 2-core VM a window's step times spread by +-10%, and a 5-step median of
  each window once kept plans 9% "faster" (93.7 against 102.5 ms) that then ran 1.2x slower than the
  engine's allreduce; keeping plans needs more evidence than leaving them, as dense is the engine's
  own behaviour (the safe default). The cost: ``BW`` more dense steps where the plans are faster. So a
  **decisive** look, whose plans step in at most half the dense window's time (:math:`T_p \le d\,T_d`,
  ``decisive`` :math:`d`, 0.5), is the verdict for the plans at once: a factor of 2 is far beyond that
  spread, and the confirmation's dense blocks would cost the most exactly there (an embedding model's
  plans against its dense tables: each such step more than twice a plan step).

Step times are rank-local; the verdict is rank 0's, broadcast by the caller (every rank must then
agree, as on every plan). A verdict for the plans holds for the plans it measured: when the dense
gradients' plans differ from those at the trial's first step (a re-plan every ``interval`` steps may
move a tensor to another strategy, also in the middle of the trial), a new trial opens. A verdict
for dense stands for the rest of the run (the aggregators sit out, so their plans no longer move).
Lossy plans are guarded alike; what they change is left to the caller: a THC or top-k plan sits the
dense window out with its error feedback kept (its next plan step sends it), and after a dense verdict
the caller adds what that error feedback still holds to the gradient of the first dense step, so no
error mass is lost. A DDP bucket that went to PowerSGD (a whole bucket's plan) is guarded the same way:
it is one of the plans (``"powersgd"`` for each of its parameters), it is allreduced in place in the
dense window with PowerSGD's error memory kept, and on a dense verdict it leaves PowerSGD, its error
memory added to the bucket of the first dense step.
"""
from __future__ import annotations

import math
import statistics
from typing import Optional

from lossless_hc.lhc.layout import check_int, is_real

GUARD_STEPS = 5      # timed steps per window and round (each the last of a block)
GUARD_START = 8      # the first step index the plan window may begin at (after calibration and plans settle)
GUARD_MARGIN = 0.03  # the plans must measure this much faster than dense to stay
GUARD_CONFIRM = 1    # extra rounds of both windows before a verdict for the plans (module doc)
GUARD_BLOCK = 2      # consecutive steps of one window; only a block's last step is timed (module doc)
GUARD_DECISIVE = 0.5  # a first look whose plans step in at most this fraction of dense's needs no confirmation


def step_guard(steps, start: int = GUARD_START, margin: float = GUARD_MARGIN) -> Optional["StepGuard"]:
    """The adapters' step guard from their ``guard_steps``, ``guard_start`` and ``guard_margin``: None
    when ``steps`` is 0 (the guard off), else a :class:`StepGuard`; ``steps`` an int >= 0 (TypeError,
    ValueError), the others as :class:`StepGuard` checks them, with the guard off too."""
    check_int(steps, "guard_steps")
    if steps < 0:
        raise ValueError(f"guard_steps must be an integer >= 0, got {steps!r}")
    guard = StepGuard(max(steps, 1), start, margin)
    return guard if steps else None


class StepGuard:
    """The trial's schedule and verdict (module doc). Pure bookkeeping: the caller feeds step times
    and whether a plan is worth checking, asks what to run, and broadcasts :meth:`decide`'s verdict.

    Args:
        steps: ``W``, timed steps per window and round (>= 1).
        start: the first 0-based step index the plan window may begin at.
        margin: ``m`` in the verdict rule, below 1.
        confirm: rounds of ``2BW`` more steps that a look for the plans must survive (>= 0).
        block: ``B``, consecutive steps of one window, of which the last is timed (>= 1).
        decisive: ``d``, a look with ``T_p <= d T_d`` keeps the plans without confirmation (a real >= 0;
            0: never; None: :data:`GUARD_DECISIVE` as it is when the guard is built).
    """

    def __init__(self, steps: int = GUARD_STEPS, start: int = GUARD_START, margin: float = GUARD_MARGIN,
                 confirm: int = GUARD_CONFIRM, block: int = GUARD_BLOCK, decisive: Optional[float] = None):
        # Ints, not truncated (2.5 steps would run 2): every rank must run the same trial.
        for name, value, least in (("steps", steps, 1), ("start", start, 0), ("confirm", confirm, 0),
                                   ("block", block, 1)):
            check_int(value, f"guard {name}")
            if value < least:
                raise ValueError(f"guard {name} must be >= {least}, got {value}")
        if not is_real(margin) or not -math.inf < margin < 1.0:
            raise ValueError(f"guard margin must be a number below 1, got {margin!r}")
        decisive = GUARD_DECISIVE if decisive is None else decisive
        if not is_real(decisive) or not 0.0 <= decisive < math.inf:
            raise ValueError(f"guard decisive must be a number >= 0, got {decisive!r}")
        self.steps, self.start, self.margin, self.confirm = steps, start, float(margin), confirm
        self.decisive = float(decisive)
        self.block = block
        self.rounds = 1                    # rounds of both windows the current trial runs (1 + confirmations)
        self.begin: Optional[int] = None   # step index of the plan window's first step
        self.times = {"plan": [], "dense": []}
        self.lead = {"plan": [], "dense": []}   # the untimed first steps of blocks (diagnostics)
        self.verdict: Optional[str] = None   # "plan" or "dense" once decided
        self.medians: Optional[tuple] = None   # (T_p, T_d) seconds, rank 0's
        self.lead_medians: Optional[tuple] = None   # the untimed steps' medians (plans', dense's), rank 0's
        self.checked = None   # the plans at the current trial's first step
        self.trials = 0       # trials opened so far
        self.clock: Optional[float] = None   # when the current step began (begin_step); None: not known

    def phase(self, step: int, worth_checking: bool, plans=None) -> str:
        """What step ``step`` (0-based) runs: ``"plan"`` (the plans), ``"dense"`` (dense buckets in
        place; the trial's dense blocks), or ``"decide"`` (the verdict is due now: call :meth:`decide` and
        :meth:`settle`, then :meth:`phase` again). ``worth_checking``: some dense gradient's plan is not
        dense; the trial opens at the first such step from ``start`` on. ``plans``: any comparable
        value naming the dense gradients' plans (None: not tracked); after a verdict for the plans, a
        different value opens a new trial (module doc). Both identical on every rank."""
        if self.verdict == "plan" and plans is not None and plans != self.checked:
            self.begin, self.verdict, self.rounds = None, None, 1
            self.times = {"plan": [], "dense": []}
            self.lead = {"plan": [], "dense": []}
        if self.verdict is not None:
            return "plan" if self.verdict == "plan" else "dense"
        if self.begin is None:
            if step < self.start or not worth_checking:
                return "plan"
            self.begin, self.checked = step, plans
            self.trials += 1
        k = step - self.begin
        if k < self.span():
            return self._window(k)
        return "decide"

    def span(self) -> int:
        """Steps the current trial runs: ``2 * block * steps * rounds``."""
        return 2 * self.block * self.steps * self.rounds

    def _window(self, k: int) -> str:
        return "plan" if (k // self.block) % 2 == 0 else "dense"

    def begin_step(self, step: int, now: float, plans, share) -> str:
        """Step ``step`` (0-based) begins at ``now`` (``time.perf_counter()``; every engine's one entry):
        the step before it is timed from when it began (:meth:`record`; not after :attr:`clock` was reset,
        e.g. in a restored state), and what this one runs is :meth:`next_phase`'s answer, or ``"dense"``
        after a dense verdict without reading ``plans`` (a callable returning the plans tuple: after a
        dense verdict the aggregators sit out and their plans are not read)."""
        if self.clock is not None:
            self.record(step - 1, now - self.clock)
        self.clock = now
        if self.verdict == "dense":
            return "dense"
        return self.next_phase(step, plans(), share)

    def next_phase(self, step: int, plans: tuple, share) -> str:
        """What step ``step`` runs (:meth:`phase`), the verdict taken where it is due: ``plans`` names the
        dense gradients' plans (a tuple of strategies, identical on every rank; worth checking when one is
        not ``"dense"``), and ``share`` is the caller's blocking broadcast of rank 0's :meth:`decide`
        (five floats in, rank 0's five out), which every rank reaches at this step."""
        worth = any(strategy != "dense" for strategy in plans)
        phase = self.phase(step, worth, plans)
        if phase == "decide":
            keep, *medians = share(self.decide())
            self.settle(keep != 0.0, *medians)
            phase = self.phase(step, worth, plans)
        return phase

    def record(self, step: int, seconds: float) -> None:
        """The measured time of step ``step`` (0-based), kept if it falls in a window."""
        if self.begin is None or self.verdict is not None:
            return
        k = step - self.begin
        if 0 <= k < self.span():
            kept = self.times if k % self.block == self.block - 1 else self.lead
            kept[self._window(k)].append(float(seconds))

    def decide(self) -> tuple:
        """``(keep_plans, T_p, T_d, L_p, L_d)`` from this rank's windows (module doc; ``L``: the medians of
        the untimed first steps of the blocks, for the record, NaN with blocks of 1); the caller broadcasts
        rank 0's. A window with no time recorded keeps the plans (nothing measured against them)."""
        lp, ld = (statistics.median(xs) if xs else float("nan") for xs in (self.lead["plan"], self.lead["dense"]))
        if not self.times["plan"] or not self.times["dense"]:
            return True, float("nan"), float("nan"), lp, ld
        tp, td = statistics.median(self.times["plan"]), statistics.median(self.times["dense"])
        return tp <= (1.0 - self.margin) * td, tp, td, lp, ld

    def settle(self, keep_plans: bool, plan_s: float, dense_s: float, lead_plan_s: float = float("nan"),
               lead_dense_s: float = float("nan")) -> None:
        """Adopt the (broadcast) look: a verdict, or for the plans while confirmations remain and the look
        is not decisive, another round of both windows (:meth:`phase` goes on alternating; the next look
        pools every step)."""
        self.medians = (float(plan_s), float(dense_s))
        self.lead_medians = (float(lead_plan_s), float(lead_dense_s))
        decisive = plan_s <= self.decisive * dense_s   # False with a NaN median
        if keep_plans and self.rounds <= self.confirm and not decisive:
            self.rounds += 1
            return
        self.verdict = "plan" if keep_plans else "dense"

    def stats(self) -> dict:
        """``{"verdict", "plan_ms", "dense_ms", "window", "steps", "block", "rounds", "trials",
        "lead_plan_ms", "lead_dense_ms"}``: the verdict (None while a trial runs or before one starts),
        rank 0's medians of the timed steps at the last look in milliseconds, the current trial's first
        step index, the timed steps per window and round, the block length, the rounds of both windows
        the trial runs (it spans :meth:`span` steps; more than 1 after a look for the plans), how many
        trials opened, and rank 0's medians of the blocks' untimed first steps at the last look (NaN
        with blocks of 1): what switching windows cost, left out of the verdict."""
        nan = (float("nan"), float("nan"))
        tp, td = self.medians or nan
        lp, ld = self.lead_medians or nan
        return {"verdict": self.verdict, "plan_ms": 1e3 * tp, "dense_ms": 1e3 * td, "window": self.begin,
                "steps": self.steps, "block": self.block, "rounds": self.rounds, "trials": self.trials,
                "lead_plan_ms": 1e3 * lp, "lead_dense_ms": 1e3 * ld}
