r"""The step guard: the planner's plans checked against a dense allreduce (and under DDP, with PowerSGD among
the strategies, against torch's PowerSGD hook on every bucket), on measured steps.

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
* **early look**: from the ``e``-th cycle of the first round on (``early`` :math:`e`, 3; a cycle is one block
  of each window, so each window then has :math:`e` timed steps), the end of every cycle is a look for a
  window that has won beyond any spread between steps: one whose *slowest* timed step so far is at most
  ``d`` times the *fastest* of every other window. Its verdict is taken there (where the rule above gives it
  too: a margin above :math:`1-d` rules first), decisive as above; otherwise the trial goes on (``decide``
  answers :data:`CONTINUE_CODE`). Slowest against fastest, not medians: one slow step of the leader or one
  fast step of another window postpones such a verdict, none forces one. What it saves: the rest of the
  round, whose dense blocks on an embedding model cost several plan steps each and decide nothing a
  factor of 2 has not decided already.

Step times are rank-local; the verdict is rank 0's, broadcast by the caller (every rank must then
agree, as on every plan). A verdict for the plans holds for the plans it measured: when the dense
gradients' plans differ from those at the trial's first step (a re-plan every ``interval`` steps may
move a tensor to another strategy, also in the middle of the trial), a new trial opens. A verdict
for dense stands for the rest of the run (the aggregators sit out, so their plans no longer move).

**A recheck** replaces that new trial where the verdict for the plans was decisive (:math:`T_p \le d\,T_w`
for every other window ``w``): the other windows' medians :math:`T_w` of that look are kept as the
**reference**, and the re-planned plans run alone for one window's ``BW`` steps (``windows`` ``("plan",)``,
the last step of each block timed). They stay iff their median :math:`T'_p \le d\,T_w` for every ``w`` of
the reference, i.e. decisive against it too (the reference is kept for the next re-plan); otherwise a
whole trial of every window opens at once. On an embedding model the dense window's steps cost several plan
steps each, and a whole trial for every re-plan between cheap strategies (allgather, two_phase, top-k
allgather, PowerSGD) spends 2BW of them each time; a factor of 2 to spare against medians measured some
steps earlier is what lets the recheck skip them. It does not compare the new plans with the old (which
no longer run).
Lossy plans are guarded alike; what they change is left to the caller: a THC or top-k plan sits the
dense window out with its error feedback kept (its next plan step sends it), and after a dense verdict
the caller adds what that error feedback still holds to the gradient of the first dense step, so no
error mass is lost. A DDP bucket that went to PowerSGD (a whole bucket's plan) is guarded the same way:
it is one of the plans (``"powersgd"`` for each of its parameters), it is allreduced in place in the
dense window with PowerSGD's error memory kept, and on a dense verdict it leaves PowerSGD, its error
memory added to the bucket of the first dense step.

**A third window: PowerSGD on every bucket** (DDP with ``lossy`` and PowerSGD among its strategies,
where some bucket PowerSGD may take does not run it whole under the plans). The cost model prices a
bucket's per-parameter plans against PowerSGD, and can misjudge both (several dependent collectives on a
loaded host); what users have instead of ``auto`` is torch's PowerSGD hook on every bucket, so the trial
runs it too: the windows cycle plan, dense, ``powersgd`` (``windows``, fixed when a trial opens), each
in blocks of ``B`` with the last step timed, ``3BW`` steps a round. In the ``powersgd`` window every
bucket PowerSGD may take runs it whole (its own error memory and warm start, kept between its windows);
the others are sent as in the dense window. With :math:`T_s` that window's median, the verdict is

.. math:: a = \begin{cases} \text{powersgd} & T_s \le (1 - m)\, T_d \\ \text{dense} & \text{otherwise}
          \end{cases}, \qquad \text{keep the plans} \iff T_p \le (1 - m)\, T_a, \text{ else } a

(PowerSGD, a change from the engine's plain step, must beat it by the margin as the plans must). A look
for the plans or for PowerSGD is confirmed as above, unless decisive: its median at most ``d`` times
each other window's. A verdict for PowerSGD stands for the rest of the run, as a dense one does (the
caller hands the plans' error feedback to PowerSGD); after a verdict for the plans or for dense the
caller adds what the trial's PowerSGD memories hold to the gradients of the first step after.
"""
from __future__ import annotations

import math
import statistics
from typing import Optional

from lossless_hc.lhc.layout import check_int, is_real

GUARD_STEPS = 5      # timed steps per window and round (each the last of a block)
GUARD_START = 8      # the first step index the plan window may begin at (after calibration and plans settle)
GUARD_MARGIN = 0.03  # the plans must measure this much faster than dense to stay
GUARD_CONFIRM = 1    # extra rounds of every window before a verdict for the plans or PowerSGD (module doc)
GUARD_BLOCK = 2      # consecutive steps of one window; only a block's last step is timed (module doc)
GUARD_DECISIVE = 0.5  # a first look whose plans step in at most this fraction of dense's needs no confirmation
WINDOWS = ("plan", "dense")                         # a trial's windows, in the order they cycle
WINDOWS_WITH_POWERSGD = ("plan", "dense", "powersgd")   # DDP with PowerSGD among its strategies (module doc)
VERDICT_CODES = {"dense": 0.0, "plan": 1.0, "powersgd": 2.0}   # decide()'s first value, as broadcast
RECHECK = ("plan",)   # the windows of a re-plan's recheck against the last decisive trial (module doc)
RETRIAL_CODE = -1.0   # decide()'s first value where a recheck does not hold: a whole trial opens
GUARD_EARLY = 3       # timed steps per window from which the end of each cycle is an early look (module doc)
CONTINUE_CODE = -2.0  # decide()'s first value at an early look that decides nothing: the trial goes on


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
            0: never, nor early looks; None: :data:`GUARD_DECISIVE` as it is when the guard is built).
        early: ``e``, the timed steps per window from which each cycle's end is an early look (>= 1; at
            least ``steps``: none).
    """

    def __init__(self, steps: int = GUARD_STEPS, start: int = GUARD_START, margin: float = GUARD_MARGIN,
                 confirm: int = GUARD_CONFIRM, block: int = GUARD_BLOCK, decisive: Optional[float] = None,
                 early: int = GUARD_EARLY):
        # Ints, not truncated (2.5 steps would run 2): every rank must run the same trial.
        for name, value, least in (("steps", steps, 1), ("start", start, 0), ("confirm", confirm, 0),
                                   ("block", block, 1), ("early", early, 1)):
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
        self.block, self.early = block, early
        self.rounds = 1                    # rounds of both windows the current trial runs (1 + confirmations)
        self.begin: Optional[int] = None   # step index of the plan window's first step
        self.windows = WINDOWS             # the current trial's windows, in the order they cycle
        self.times = {w: [] for w in WINDOWS}
        self.lead = {w: [] for w in WINDOWS}   # the untimed first steps of blocks (diagnostics)
        self.verdict: Optional[str] = None   # "plan", "dense" or "powersgd" once decided
        self.medians: Optional[dict] = None   # window -> T_w seconds at the last look, rank 0's
        self.lead_medians: Optional[dict] = None   # window -> the untimed steps' median, rank 0's
        self.checked = None   # the plans at the current trial's first step
        self.trials = 0       # trials opened so far
        self.clock: Optional[float] = None   # when the current step began (begin_step); None: not known
        # The other windows' medians at the last decisive look for the plans (window -> seconds), which a
        # re-plan's plans are rechecked against; None: a re-plan opens a whole trial.
        self.reference: Optional[dict] = None
        self.looking: Optional[int] = None   # the trial step (from begin) of the look phase() last asked for
        self.looked: Optional[int] = None    # the trial step of the last early look that went on

    windows = WINDOWS   # (class default: a guard pickled before PowerSGD's window had only these)
    reference: Optional[dict] = None   # (class default: a guard pickled before the recheck had none)
    early = GUARD_EARLY   # (class defaults: a guard pickled before the early look)
    looking: Optional[int] = None
    looked: Optional[int] = None

    def __setstate__(self, state):
        # A guard pickled before PowerSGD's window kept its medians as (plan, dense) tuples.
        for key in ("medians", "lead_medians"):
            if isinstance(state.get(key), tuple):
                state[key] = dict(zip(WINDOWS, state[key]))
        self.__dict__.update(state)

    def phase(self, step: int, worth_checking: bool, plans=None, windows=WINDOWS) -> str:
        """What step ``step`` (0-based) runs: ``"plan"`` (the plans), ``"dense"`` (dense buckets in
        place; the trial's dense blocks), ``"powersgd"`` (PowerSGD on every bucket it may take: its
        blocks, or its verdict), or ``"decide"`` (the verdict is due now: call :meth:`decide` and
        :meth:`settle`, then :meth:`phase` again). ``worth_checking``: some dense gradient's plan is not
        dense; the trial opens at the first such step from ``start`` on. ``plans``: any comparable
        value naming the dense gradients' plans (None: not tracked); after a verdict for the plans, a
        different value opens a new trial, or a recheck after a decisive verdict (module doc).
        ``windows``: the windows a trial opening at this step runs (:data:`WINDOWS` or
        :data:`WINDOWS_WITH_POWERSGD`; read only then). All identical on every rank."""
        if self.verdict == "plan" and plans is not None and plans != self.checked:
            self.begin, self.verdict, self.rounds = None, None, 1
        if self.verdict is not None:
            return self.verdict
        if self.begin is None:
            if step < self.start or not worth_checking:
                return "plan"
            windows = tuple(windows)
            if windows not in (WINDOWS, WINDOWS_WITH_POWERSGD):
                raise ValueError(f"guard windows must be {WINDOWS} or {WINDOWS_WITH_POWERSGD}, got {windows!r}")
            if self.reference is not None:   # only a re-plan after a decisive verdict for the plans opens one now
                windows = RECHECK
            self.begin, self.checked, self.windows = step, plans, windows
            self.looking = self.looked = None
            self.times = {w: [] for w in windows}
            self.lead = {w: [] for w in windows}
            self.trials += 1
        k = step - self.begin
        if k < self.span() and not self._early_look_due(k):
            return self._window(k)
        self.looking = k
        return "decide"

    def span(self) -> int:
        """Steps the current trial runs: ``len(windows) * block * steps * rounds``."""
        return len(self.windows) * self.block * self.steps * self.rounds

    def _window(self, k: int) -> str:
        return self.windows[(k // self.block) % len(self.windows)]

    def _early_look_due(self, k: int) -> bool:
        """Whether trial step ``k`` (< :meth:`span`) is an early look not yet taken (module doc)."""
        cycle = len(self.windows) * self.block
        return (self.rounds == 1 and self.windows != RECHECK and self.decisive > 0 and k % cycle == 0
                and k // cycle >= self.early and k != self.looked)

    def _early(self) -> bool:
        """Whether the look due now (:meth:`phase` answered ``"decide"``) is an early one."""
        return self.begin is not None and self.looking is not None and self.looking < self.span()

    def begin_step(self, step: int, now: float, plans, share, windows=WINDOWS) -> str:
        """Step ``step`` (0-based) begins at ``now`` (``time.perf_counter()``; every engine's one entry):
        the step before it is timed from when it began (:meth:`record`; not after :attr:`clock` was reset,
        e.g. in a restored state), and what this one runs is :meth:`next_phase`'s answer, or the verdict
        after one for dense or PowerSGD, without reading ``plans`` (a callable returning the plans tuple:
        after such a verdict the aggregators sit out and their plans are not read). ``windows``: a
        trial opening at this step would run, or a callable returning them."""
        if self.clock is not None:
            self.record(step - 1, now - self.clock)
        self.clock = now
        if self.verdict in ("dense", "powersgd"):
            return self.verdict
        return self.next_phase(step, plans(), share, windows() if callable(windows) else windows)

    def next_phase(self, step: int, plans: tuple, share, windows=WINDOWS) -> str:
        """What step ``step`` runs (:meth:`phase`), the verdict taken where it is due: ``plans`` names the
        dense gradients' plans (a tuple of strategies, identical on every rank; worth checking when one is
        not ``"dense"``), ``windows`` those of a trial opening now, and ``share`` is the caller's blocking
        broadcast of rank 0's :meth:`decide` (its floats in, rank 0's out), which every rank reaches at
        this step."""
        worth = any(strategy != "dense" for strategy in plans)
        phase = self.phase(step, worth, plans, windows)
        if phase == "decide":
            self.settle(*share(self.decide()))
            phase = self.phase(step, worth, plans, windows)
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
        """``(verdict, T_p, T_d, L_p, L_d, T_s, L_s)`` from this rank's windows (module doc): the verdict
        as :data:`VERDICT_CODES` (0 dense, 1 the plans, 2 PowerSGD), the medians of the plans', dense's
        and PowerSGD's timed steps, and ``L``, those of the untimed first steps of the blocks, for the
        record (NaN with blocks of 1, or for a window the trial does not run); the caller broadcasts rank
        0's. A plan or dense window with no time recorded keeps the plans (nothing measured against them).
        A recheck (module doc): the plans (1) where they hold against the reference, whose medians it
        returns as dense's and PowerSGD's, else :data:`RETRIAL_CODE` (also with no plan step timed). An early
        look (module doc): the verdict of a window that has won beyond the steps' spread, else
        :data:`CONTINUE_CODE`."""
        def median(xs):
            return statistics.median(xs) if xs else float("nan")

        t = {w: median(self.times.get(w, ())) for w in WINDOWS_WITH_POWERSGD}
        lead = {w: median(self.lead.get(w, ())) for w in WINDOWS_WITH_POWERSGD}
        if self.windows == RECHECK:   # the new plans against the reference; the medians reported are its
            ref = {**{w: float("nan") for w in WINDOWS_WITH_POWERSGD}, **(self.reference or {})}
            holds = bool(self.times["plan"]) and self.reference is not None and all(
                t["plan"] <= self.decisive * other for other in self.reference.values())   # False with a NaN
            return ((VERDICT_CODES["plan"] if holds else RETRIAL_CODE), t["plan"], ref["dense"], lead["plan"],
                    float("nan"), ref["powersgd"], float("nan"))
        values = (t["plan"], t["dense"], lead["plan"], lead["dense"], t["powersgd"], lead["powersgd"])
        if self._early():   # a window whose slowest step is at most d times every other's fastest, or go on
            if not all(self.times.get(w) for w in self.windows):
                return (CONTINUE_CODE,) + values
            leader = min(self.windows, key=lambda w: t[w])
            slowest = max(self.times[leader])
            clear = all(slowest <= self.decisive * min(self.times[w]) for w in self.windows if w != leader)
            return (VERDICT_CODES[leader] if clear and self._rule(t) == leader else CONTINUE_CODE,) + values
        if not self.times["plan"] or not self.times["dense"]:
            nan = float("nan")
            return VERDICT_CODES["plan"], nan, nan, lead["plan"], lead["dense"], nan, lead["powersgd"]
        return (VERDICT_CODES[self._rule(t)],) + values

    def _rule(self, t: dict) -> str:
        """The verdict rule (module doc) on the medians ``t`` (window -> seconds, NaN where not run)."""
        keep = 1.0 - self.margin
        alternative = "powersgd" if t["powersgd"] <= keep * t["dense"] else "dense"   # False with a NaN
        return "plan" if t["plan"] <= keep * t[alternative] else alternative

    def settle(self, verdict, plan_s: float, dense_s: float, lead_plan_s: float = float("nan"),
               lead_dense_s: float = float("nan"), powersgd_s: float = float("nan"),
               lead_powersgd_s: float = float("nan")) -> None:
        """Adopt the (broadcast) look: ``verdict`` a name or code of :data:`VERDICT_CODES` (a bool: True the
        plans, False dense); a verdict, or for the plans or PowerSGD while confirmations remain and the
        look is not decisive, another round of every window (:meth:`phase` goes on alternating; the next
        look pools every step). A final verdict for the plans that is decisive keeps the other windows'
        medians as the reference of a re-plan's recheck. After a recheck, ``verdict`` is the plans or
        :data:`RETRIAL_CODE` (a whole trial opens at the next :meth:`phase`); at an early look, a final
        verdict or :data:`CONTINUE_CODE` (the trial goes on)."""
        names = {code: name for name, code in VERDICT_CODES.items()}
        recheck = self.windows == RECHECK and self.begin is not None
        early = not recheck and self._early()
        if isinstance(verdict, bool):
            verdict = "plan" if verdict else "dense"
        elif not isinstance(verdict, str):
            code = float(verdict)
            verdict = ("retrial" if recheck and code == RETRIAL_CODE else "continue" if early and code == CONTINUE_CODE
                       else names.get(code))
        if verdict not in VERDICT_CODES and not (recheck and verdict == "retrial") and \
                not (early and verdict == "continue"):
            raise ValueError(f"a guard verdict is one of {sorted(VERDICT_CODES)} or its code, got {verdict!r}")
        self.medians = {"plan": float(plan_s), "dense": float(dense_s), "powersgd": float(powersgd_s)}
        self.lead_medians = {"plan": float(lead_plan_s), "dense": float(lead_dense_s),
                             "powersgd": float(lead_powersgd_s)}
        if early and verdict == "continue":   # the trial goes on; this look is not asked for again
            self.looked = self.looking
            return
        if recheck:   # the new plans held against the reference (kept for the next re-plan), or a whole trial
            if verdict == "plan":
                self.verdict = "plan"
            else:
                self.begin, self.rounds, self.reference = None, 1, None
            return
        mine = self.medians[verdict]
        others = [self.medians[w] for w in self.windows if w != verdict]
        decisive = all(mine <= self.decisive * other for other in others)   # False with a NaN median
        if verdict != "dense" and self.rounds <= self.confirm and not decisive and not early:
            self.rounds += 1
            return
        self.verdict = verdict
        self.reference = {w: self.medians[w] for w in self.windows if w != "plan"} \
            if verdict == "plan" and decisive else None

    def stats(self) -> dict:
        """``{"verdict", "plan_ms", "dense_ms", "powersgd_ms", "windows", "window", "steps", "block",
        "rounds", "trials", "span", "lead_plan_ms", "lead_dense_ms", "lead_powersgd_ms"}``: the
        verdict (None while a trial runs or before one starts), rank 0's medians of each window's timed steps
        at the last look in milliseconds (NaN for a window the trial did not run), the current trial's windows
        and first step index, the timed steps per window and round, the block length, the rounds of every
        window the trial runs (more than 1 after a look for the plans or PowerSGD), how many trials opened
        (rechecks included: ``windows`` ``["plan"]``, the reference's medians as dense's and PowerSGD's), the
        steps the trial runs (:meth:`span`) or, after its verdict, ran (fewer after an early look's), rank 0's
        medians of the blocks' untimed first steps at the last look (NaN with blocks of 1): what switching
        windows cost, left out of the verdict. Identical on every rank."""
        nan = float("nan")
        t = self.medians or {}
        lead = self.lead_medians or {}
        d = {"verdict": self.verdict, "windows": list(self.windows), "window": self.begin, "steps": self.steps,
             "block": self.block, "rounds": self.rounds, "trials": self.trials,
             # after a verdict, the trial step of the look that gave it (an early one's is below span())
             "span": min(self.looking, self.span()) if self.verdict is not None and self.looking is not None
             else self.span()}
        for w in WINDOWS_WITH_POWERSGD:
            d[f"{w}_ms"] = 1e3 * t.get(w, nan)
            d[f"lead_{w}_ms"] = 1e3 * lead.get(w, nan)
        return d
