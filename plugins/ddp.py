"""torch.distributed adapter: DDP communication hooks, one state class per algorithm.

    from lossless_hc.plugins.ddp import LosslessHookState, lossless_hook
    state = LosslessHookState(process_group=None, max_density=0.01)
    ddp_model.register_comm_hook(state, lossless_hook)
    # dense models: TopKHookState(ratio=0.01) with topk_hook (the top-k selections summed losslessly, within rtol),
    # or THCHookState(bits=4) with thc_hook (lossy, unbiased)
    ...
    state.stats()

    # recommended: the planner picks each parameter's cheapest exact strategy
    from lossless_hc.plugins.ddp import AutoHookState, auto_hook
    state = AutoHookState(process_group=None, lossy=False)
    ddp_model.register_comm_hook(state, auto_hook)

``auto_hook`` (:mod:`lossless_hc.training.auto`, :mod:`lossless_hc.training.strategies`): per parameter
inside the bucket message, the strategy the cost model predicts cheapest. Its first call (on the main
thread, in bucket order on every rank) checks the configuration; the first step is dense (or the
given ``first``) and needs no cost model, so the calibration on the process group (a few allreduce and
allgather sizes, up to the largest gradient's bytes; rank 0's fit and codec timings broadcast) runs at
the first call of the second step, when every gradient's size and first statistics are known, unless a
``calibration`` was given -- or, with ``lossy=False``, where every gradient's statistics keep it dense
whatever the calibration (:func:`~lossless_hc.training.planner.dense_dominates`: a gradient non-zero in
(nearly) every row, as smooth activations leave them), at the first call of a step after a statistics step
where one no longer does (``stats()["calibration"]["source"]`` "not needed" until then). Per bucket it SUMs
the first payloads (every parameter's statistics header and body) with one allreduce per part of the message
(:mod:`lossless_hc.training.message`: one per payload dtype, float64 for THC's, float32, bfloat16, float16, a
narrower part travelling inside a wider one where that widens fewer than 256 KiB); the parameters whose strategy
needs a second collective (allgather, two_phase's values, fp16/bf16, a sketch's exact fallback) get it
from the future's callback on the bucket's own process group, like the fallback below: at most one
allreduce per payload dtype and one allgather per bucket and step, the same on every rank. A bucket of dense plans between their
statistics steps (one in ``interval``, or fewer where it widened: ``max_interval``) is allreduced in place, as
DDP's own hook does.

The step guard (exact and lossy plans, on by default: ``guard_steps``, :mod:`lossless_hc.training.guard`):
the cost model can misjudge what a dense allreduce costs inside a real step (how much of it hides
behind the backward pass, the hook's own work on the same cores), so once some dense gradient's plan is
not dense (from step index 8 on) the state runs an A/B trial of 20 whole steps, the plans and every
dense-gradient bucket allreduced in place alternating in blocks of two steps, the second of each
timed (5 of each; 20 steps more where the plans look faster, the verdict then on 10 of each); unless
the plans' median step is at least 3% faster, dense gradients are allreduced in place for the rest of
the run. With ``lossy=True`` that side is what ``bf16_compress_hook`` sends: a float32 bucket in bfloat16,
every gradient of it whatever its size (``fp16_compress_hook``'s float16 where the strategies allow fp16
and not bf16), so lossy plans stay only where they beat DDP's half-precision allreduce (THC's and top-k's
error feedback, and a PowerSGD bucket's error memory, added to the gradients
of the first such step, so nothing is lost; buckets that went to PowerSGD are part of the trial and
leave it on a dense verdict). With PowerSGD among the strategies the trial has a third window, torch's
PowerSGD hook on every bucket it may take (30 steps a round; a verdict for it moves those buckets to it
for good, the plans' error feedback added to their gradients; :mod:`lossless_hc.training.guard`). After a
verdict for the plans, a re-plan that changes a dense gradient's plan opens a new trial (after a decisive one, a
recheck of the new plans alone). Rank 0's verdict
is broadcast at the first hook call of the step after the trial (main thread, like the calibration). The
verdict rests on measured step times, so with ``lossy=True`` which gradients are sent lossy can differ from
run to run (``guard_steps=0``: the plans alone decide).

With ``lossy=True`` a bucket may instead go to torch's PowerSGD (``PowerSGDState`` + ``powerSGD_hook``,
one state per bucket, its three allreduces on the bucket's own group): after each re-plan of its
parameters, from step index 2 on, when the cost model predicts it faster than their plans in one
message; or only its matrices that PowerSGD sends for less than their plans (a table on an allgather
plan keeps it), the other gradients in a message of their own beside it. Once taken it is kept, and
the parameters' THC or top-k error feedback is added to the gradient on the switch
(:mod:`lossless_hc.training.powersgd`).

Sparse gradients (``nn.Embedding(sparse=True)``, Gloo): DDP gives each its own bucket, whose buffer is
the uncoalesced COO gradient, and copies the hook's result into it, so the result must be sparse and
already averaged. ``auto_hook`` plans such a gradient among the exact strategies over the rows it
lists (allgather and two_phase never densify it) and returns a coalesced sparse tensor of the rows some
rank listed, divided by the world size, like DDP's own sparse allreduce; when the plan is allgather
(DDP's own strategy), the steps between its statistics steps (one in ``interval``) are Gloo's sparse
allreduce of the bucket itself, as DDP without a hook. The fixed hooks
(``lossless_hook``, ``topk_hook``, ``thc_hook``) encode dense tensors and refuse sparse buckets with a
TypeError; ``AutoHookState(strategies=("sketch",))`` runs the LHC sketch alone over sparse gradients.

For each gradient bucket the hook encodes every parameter's gradient separately (each parameter has
its own aggregator, built from the state's spec and keyed by the parameter itself, so state survives
DDP's bucket rebuild), concatenates the payloads into one message (one part per payload dtype, or
fewer: :mod:`lossless_hc.training.message`), allreduces each part with SUM, decodes each segment and
returns the averaged bucket, as DDP expects. A float16 bucket is divided by the world size first, as
DDP's own hook divides it (its ranks' sum can overflow where their average does not); the others are
divided after the sum, except a bucket allreduced as it is at a power-of-two world size, divided first as
DDP divides it: the same bits unless a quotient is subnormal or the sum overflows (then the finite average;
``_ddp_bucket.divide_first_exactly``).

Fallback without mismatched collectives: a segment that fails to decode is re-aggregated densely from
the future's callback, which may run on a communication thread while the main thread issues the next
bucket's allreduce. Issued on the main process group, the two could reach ranks in different orders
and be paired wrongly. So each bucket index gets its own fallback process group, created in the hook
(on the main thread, in bucket order on every rank; ``auto_hook``: when a strategy other than dense
first runs in the bucket, so a dense model creates none); on it, collectives are issued one step at a
time, and every rank issues the same ones because every rank decodes the same aggregate. The same
collective re-aggregates the coordinates of keys a decode reported inexact (one SUM per bucket
for both; see :func:`lossless_hc.training.message.decode_message`).

The states pickle with the model (``torch.save(ddp_model)``) as torch's ``PowerSGDState`` does: the
process groups are left out (a restored state uses the default group, re-created lazily), the
aggregators' error feedback and capacities are kept.
"""

import time
from collections import deque
from typing import Optional

import torch
import torch.distributed as dist

from lossless_hc.training.adapter import LosslessSpec, THCSpec, TopKSpec
from lossless_hc.training.auto import (AutoMessage, AutoSpec, as_strategies, guard_half, guard_stats, plan_stats,
                                       settle_message_plans)
from lossless_hc.training.auto import decode_message as decode_auto_message
from lossless_hc.training.guard import (GUARD_MARGIN, GUARD_START, GUARD_STEPS, WINDOWS, WINDOWS_WITH_POWERSGD,
                                        step_guard)
from lossless_hc.training.planner import HALF_STRATEGIES, Calibration  # noqa: F401  (Calibration: re-exported)
from lossless_hc.training.powersgd import POWERSGD_RANK, POWERSGD_START, PowerSGDPlanner
from lossless_hc.training.aggregate import AggregationStats, ConfigurationMismatch  # noqa: F401
from lossless_hc.training.capacity import CapacityPolicy
from lossless_hc.training.message import decode_message, encode_message, in_place_outputs

from lossless_hc.plugins._ddp_bucket import (allreduce_half, bucket_slices, divide_first, divide_first_exactly,
                                             fill_bucket, fill_slices)
from lossless_hc.plugins._ddp_state import HookState, require_arguments
from lossless_hc.plugins._torch_dist import allreduce_parts, check_same_configuration, when_all


class LosslessHookState(HookState):
    """State of :func:`lossless_hook`: naturally sparse gradients (embeddings), aggregated losslessly
    (the dense sum's support, each value within the codec's exactness contract, keys it cannot prove
    re-aggregated densely: :func:`lossless_hook`).

    Args:
        process_group: the group DDP reduces over (None: the default group).
        max_density: each rank may send this fraction of a gradient's coordinates before that
            gradient falls back to dense (and its capacity grows).
        block_size: coordinates hashed as one key; None: a 2-D gradient's row length, else 1.
        seed: hash seed, identical on every rank.
        index: the codec's index kind ("auto" picks the smallest payload).
        policy: a :class:`lossless_hc.CapacityPolicy` adapting each gradient's capacity and index to
            the densities its aggregates show (None: fixed ``max_density``).
    """

    def __init__(self, process_group: Optional[dist.ProcessGroup] = None, max_density: float = 0.01,
                 block_size: Optional[int] = None, seed: int = 0, index: str = "auto",
                 policy: Optional[CapacityPolicy] = None):
        super().__init__(LosslessSpec(max_density, block_size, seed, index, policy=policy), process_group)


class TopKHookState(HookState):
    """State of :func:`topk_hook`: each rank's top ``ratio`` of every gradient (error feedback keeps
    the rest), the selections summed by the LHC codec within its exactness contract (the sum's support,
    each value within ``rtol``, keys it cannot prove re-aggregated densely; not bit for bit). ``policy``
    sizes the sketch for the observed union."""

    def __init__(self, process_group: Optional[dist.ProcessGroup] = None, ratio: float = 0.01, seed: int = 0,
                 index: str = "auto", policy: Optional[CapacityPolicy] = None):
        super().__init__(TopKSpec(ratio, seed, index, policy=policy), process_group)


class THCHookState(HookState):
    """State of :func:`thc_hook`: THC quantization (lossy, unbiased, error feedback) with ``bits``,
    ``granularity`` and ``overflow_freq`` (see :class:`lossless_hc.THCCodec`). ``non_finite``: a step
    where some rank's gradient holds NaN/Inf raises ``FloatingPointError`` ("raise"; DDP cannot go on
    after an exception in a hook), or gives all-NaN gradients on every rank ("propagate": use it with
    AMP's ``GradScaler``, which then skips that step on every rank).

    ``exact``: parameters whose gradients are sent dense (an exact SUM, in the same message) instead of
    through THC. THC's error is spread evenly over a tensor's coordinates, so with an optimizer that
    scales each coordinate by its own running magnitude (Adam, RMSprop, Adagrad) it must not carry
    tensors where most coordinates' true gradient is near zero at a step and whose weights are small:
    the output layer over a vocabulary (docs/THC.md, "Training with THC"). An entry that requires grad
    but is not a parameter DDP reduces (a copy's) is a ValueError at the first step's last bucket.
    ``stats()["thc"]`` says how each parameter was sent."""

    def __init__(self, process_group: Optional[dist.ProcessGroup] = None, bits: int = 4, granularity: int = 30,
                 overflow_freq: float = 32, seed: int = 0, non_finite: str = "raise", exact=()):
        super().__init__(THCSpec(bits, granularity, overflow_freq, seed, non_finite), process_group)
        # A bare Parameter (or a string) iterates into rows (characters) that match no parameter: the
        # layer would silently go through THC.
        if isinstance(exact, (torch.Tensor, str)):
            raise TypeError(f"exact must be a sequence of parameters (e.g. [model.out.weight]), got a "
                            f"{type(exact).__name__}")
        self._exact = list(exact)
        for p in self._exact:
            if not isinstance(p, torch.Tensor):
                raise TypeError(f"exact must hold parameters, got a {type(p).__name__}")
        self._exact_checked: set = set()   # ids of parameters whose exact flag every rank agreed on

    def _is_exact(self, p: torch.nn.Parameter) -> bool:
        return any(p is q for q in self._exact)

    def _check_bucket(self, params, is_last: bool) -> None:
        """Ranks must mark the same parameters ``exact`` (a dense segment on one rank summed with THC words
        on another is garbage of a valid size): on a bucket holding a parameter not checked yet (every
        bucket of the first step; DDP's bucket order is the same on every rank), its exact flags in bucket
        order are compared across ranks (:func:`check_same_configuration`: ConfigurationMismatch on every
        rank). A blocking collective in the hook, as the first call's configuration check.

        At the first step's last bucket every parameter DDP reduces has been seen: an ``exact`` entry that
        requires grad and is none of them (a copy's parameter, one DDP was told to ignore) would leave the
        layer the user meant on THC, so it is a ValueError, on every rank (their counts are compared
        first)."""
        params = list(params)
        if all(id(p) in self._exact_checked for p in params):
            return
        flags = "".join("1" if self._is_exact(p) else "0" for p in params)
        shapes = ";".join("x".join(map(str, p.shape)) for p in params)
        self._exact_checked.update(id(p) for p in params)
        unmatched = [q for q in self._exact if q.requires_grad and id(q) not in self._exact_checked] if is_last else []
        check_same_configuration(f"exact {flags} of {shapes}; {len(unmatched)} unmatched", self.process_group,
                                 "THCHookState's exact parameters")
        if unmatched:
            unmatched_shapes = ", ".join(str(tuple(q.shape)) for q in unmatched)
            raise ValueError(f"THCHookState(exact=...) holds {len(unmatched)} tensor(s) that are not parameters "
                             f"this DDP model reduces (shapes {unmatched_shapes}): pass the wrapped model's own parameters "
                             f"(e.g. ddp_model.module.out.weight), not a copy's")

    def _make(self, p: torch.nn.Parameter, name: str, grad: torch.Tensor):
        return self.spec.make(name, grad, self.world_size, self.rank, self._stats, grad.device,
                              exact=self._is_exact(p))

    def stats(self) -> dict:
        d = super().stats()
        d["thc"] = [{"name": a.name, "sent_as": a.sent_as} for a in self._aggregators.values()]
        return d


class AutoHookState(HookState):
    """State of :func:`auto_hook`: per parameter, the cheapest strategy the planner predicts; with
    ``lossy``, per bucket, PowerSGD (of the bucket, or of some of its matrices) where it beats the bucket's
    per-parameter plans.

    Args:
        process_group: the group DDP reduces over (None: the default group).
        lossy: also consider fp16, bf16, THC and top-k per parameter, and torch's PowerSGD per bucket
            (else only exact strategies: dense, allgather, two_phase, sketch).
        powersgd_rank, powersgd_start: PowerSGD's ``matrix_approximation_rank`` (4) and the first step
            index (0-based, >= 2) it may run at (:mod:`lossless_hc.training.powersgd`: torch's
            ``powerSGD_hook``, one ``PowerSGDState`` and Gloo group per bucket, ``min_compression_rate``
            2, error feedback and warm start on; once a bucket takes it, it keeps it unless the step
            guard's verdict is dense, and its parameters' THC or top-k error feedback is added to the
            gradient on the switch).
        guard_steps, guard_start, guard_margin: the step guard's window length (5; 0: no guard), the
            first step index its trial may begin at (8) and the margin by which the plans must measure
            faster than DDP's dense allreduce to stay (0.03): an A/B trial of whole training steps,
            ``guard_steps`` timed steps of the plans alternating with as many of every dense gradient
            allreduced in place (in blocks of two steps, the second timed; as many more of each to confirm a
            first look for the plans, unless it found them twice as fast; with ``lossy``, a float32 bucket in
            bfloat16, as ``bf16_compress_hook`` sends it, or in fp16 where the strategies allow only that:
            ``AutoAggregator.guard_alternative``); if the plans' median step is not faster, dense gradients are
            sent so for the rest of the run (THC's and top-k's error feedback, and a PowerSGD bucket's error
            memory, added to the first such step's gradients); if it is, the plans stay until a re-plan changes
            them, which opens a new trial (or a recheck). With PowerSGD on, a third window runs torch's PowerSGD
            hook on every bucket it may take, and may be the verdict instead, for good
            (:mod:`lossless_hc.training.guard`; ``stats()["guard"]``).
        **options: :class:`lossless_hc.training.auto.AutoSpec` (``interval``, ``max_interval``, ``alpha``, ``first``,
            ``strategies``, ``calibration``, ``topk_ratio``, ``thc_bits``, ``seed``, ``lossy_min_bytes``);
            ``strategies`` may name ``"powersgd"`` (with ``lossy=True``): given without it, PowerSGD is
            not considered.

    PowerSGD is offered by this DDP hook only: Horovod and BytePS hand a compressor one tensor at a time
    and FSDP2 reduce-scatters, so their ``auto`` has no bucket to give it.

    ``stats()["plan"]``: per parameter, the chosen strategy (``"powersgd"`` for the parameters PowerSGD
    takes, with their ``bucket`` index), predicted seconds of every candidate, measured seconds,
    bytes sent, steps and plain steps; ``stats()["buckets"]``: per bucket index compared for PowerSGD,
    the choice (``powersgd``, ``powersgd_part`` or ``per_parameter``), the predicted seconds of each,
    and PowerSGD's parameters and wire bytes per step; ``stats()["calibration"]``: whether the
    calibration was given or measured, and what measuring it cost (seconds, sizes timed).
    """

    def __init__(self, process_group: Optional[dist.ProcessGroup] = None, lossy: bool = False,
                 powersgd_rank: int = POWERSGD_RANK, powersgd_start: int = POWERSGD_START,
                 guard_steps: int = GUARD_STEPS, guard_start: int = GUARD_START, guard_margin: float = GUARD_MARGIN,
                 **options):
        strategies = options["strategies"] = as_strategies(options.get("strategies"))
        powersgd = lossy is True and (strategies is None or "powersgd" in strategies)
        if strategies is not None and "powersgd" in strategies:
            if lossy is not True:
                raise ValueError("strategies names 'powersgd', a lossy strategy: it needs lossy=True")
            options["strategies"] = tuple(s for s in strategies if s != "powersgd") or ("dense",)
        spec = AutoSpec(lossy=lossy, **options)
        # A half-precision bucket's plain steps are allreduced in place in its dtype, as DDP's own hook
        # does (and, in a message, travel in their dtype's part): priced so.
        spec.native_plain_dtypes = (torch.float16, torch.bfloat16)
        super().__init__(spec, process_group)
        # Built (so its options checked) where PowerSGD is off too: a bad powersgd_rank is an error, not a
        # setting that lies in wait for lossy=True.
        planner = PowerSGDPlanner(powersgd_rank, powersgd_start, seed=self.spec.seed, stats=self._stats)
        self._powersgd = planner if powersgd else None
        self._guard = step_guard(guard_steps, guard_start, guard_margin)
        self._plain_done: deque = deque()

    _steps = 0   # hook calls for bucket 0: the steps begun (every rank counts alike)
    _step_phase = "plan"   # what this step runs (StepGuard.phase): "plan", "dense" buckets in place, "powersgd"
    _offered = frozenset()        # the buckets PowerSGD may take, as the last whole step had them
    _offered_now = frozenset()    # and as this step has them so far

    def __repr__(self) -> str:
        extra = f", {self._powersgd.describe()}" if self._powersgd is not None else ""
        if self._guard is not None:
            g = self._guard
            extra += f", guard(steps={g.steps}, start={g.start}, margin={g.margin})"
        return f"{type(self).__name__}({self.spec!r}{extra})"

    def __getstate__(self):
        self._record_plain_steps()
        return super().__getstate__()

    def __setstate__(self, state):
        super().__setstate__(state)
        self._plain_done = deque()   # (a state pickled before it existed: none pending either way)
        if self._guard is not None:
            self._guard.clock = None   # a restored state's first step has no predecessor to time

    def _settling(self) -> bool:
        """Whether this step is a restored state's first while PowerSGD holds buckets. A DDP model loaded
        from ``torch.save`` runs its first step with its buckets in the parameters' registration order and
        only then rebuilds them as the run that saved it had them; PowerSGD's buckets (torch's memories too)
        are known by bucket index, so that step sends every dense bucket in place, as the step guard's dense
        window does, and the memories wait for the next step, where the buckets are theirs again. (``_restored``
        holds through that step until its last bucket's :meth:`_check_restored`: read before it.)"""
        p = self._powersgd
        return self._restored and p is not None and (any(b.left_step is None for b in p.buckets.values())
                                                     or bool(p.trials))

    def stats(self) -> dict:
        self._record_plain_steps()
        d = super().stats()
        d["plan"] = plan_stats(self._aggregators.values())
        d["buckets"] = {}
        if self._powersgd is not None:
            self._powersgd.plan_stats(d["plan"])
            d["buckets"] = self._powersgd.stats()
        d["calibration"] = self.spec.calibration_stats(deferred=self._steps >= 2)
        d["guard"] = guard_stats(self._guard, self._aggregators.values())
        return d

    def _record_plain_steps(self) -> None:
        """Account the plain steps whose sums have arrived (``AutoAggregator.record_plain_step``, on the
        main thread). Their futures' callbacks, on the engine's communication thread, only note when: work
        there costs the step more than the same work in the hook (docs/BENCHMARKS.md, "What the DDP hook
        itself costs"). Called at every hook call, before anything reads the step counts (every callback of
        a step has run before DDP calls bucket 0's hook of the next), and by stats() and pickling. deque:
        the callbacks append while this pops, both atomic."""
        done = self._plain_done
        while done:
            aggs, started, ended, rows, half = done.popleft()
            for a in aggs:
                a.record_plain_step(started, sparse_rows=rows, half=half, ended=ended)

    def _begin_step(self, now: float) -> None:
        """Bucket 0's hook (main thread, every rank at the same step): count the step, time the one
        before it for the step guard, calibrate where a plan due needs it (from the second step: the model's
        tensors and their first statistics are known then), and set what this step runs."""
        self._steps += 1
        if self.spec.calibration_due(self._aggregators.values()):
            self._calibrate()
        self._offered, self._offered_now = self._offered_now, frozenset()
        if self._guard is not None:
            self._step_phase = self._guard.begin_step(self._steps - 1, now, self._plans, self._share_verdict,
                                                      self._guard_windows)

    def _guard_windows(self) -> tuple:
        """The windows of a step-guard trial opening now: PowerSGD's too (torch's hook on every bucket it may
        take) where PowerSGD is on and may run at this step, and some bucket it may take (as the last step had
        them: every rank alike) does not run it whole under the plans."""
        p = self._powersgd
        if p is None or self._steps - 1 < p.start:
            return WINDOWS
        whole = {i for i, b in p.buckets.items() if b.members is None and b.left_step is None}
        return WINDOWS_WITH_POWERSGD if self._offered - whole else WINDOWS

    def _plans(self) -> tuple:
        """The dense gradients' plans, for the step guard. Plans, and the aggregators' creation order (bucket
        order), are identical on every rank: so is this. A PowerSGD bucket's parameters are planned by their
        bucket (in place in the dense window too)."""
        on_powersgd = self._powersgd.parameter_names() if self._powersgd is not None else frozenset()
        return tuple("powersgd" if a.name in on_powersgd else a.strategy
                     for a in self._aggregators.values() if not a.sparse)

    def _share_verdict(self, verdict: tuple) -> tuple:
        """Rank 0's step-guard ``verdict`` on every rank (blocking, main thread, like the calibration)."""
        t = torch.tensor(verdict, dtype=torch.float64, device=self._collective_device())
        dist.broadcast(t, src=self._root(), group=self.process_group)
        return tuple(t.cpu().tolist())

    def _collective_device(self) -> torch.device:
        if dist.get_backend(self.process_group) == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def _root(self) -> int:
        return dist.get_global_rank(self.process_group, 0) if self.process_group is not None else 0

    def _make(self, p: torch.nn.Parameter, name: str, grad: torch.Tensor):
        agg = super()._make(p, name, grad)
        # Gloo sums sparse tensors itself (what DDP does without a hook): an allgather plan of a sparse
        # gradient sends it that way between its statistics steps (AutoAggregator.native_sparse).
        agg.native_sparse = grad.is_sparse and dist.get_backend(self.process_group) == "gloo"
        return agg

    def _powersgd_bucket(self, bucket: dist.GradBucket, buffer: torch.Tensor, grads, aggs):
        """The bucket's PowerSGD state if it runs PowerSGD this step (:class:`PowerSGDPlanner`)."""
        if self._powersgd is None or self.spec.calibration is None:
            return None
        return self._powersgd.bucket(bucket.index(), self._steps - 1, aggs, grads, buffer, self.spec.cost_model,
                                     self.world_size)

    def _calibrate(self) -> None:
        """Rank 0's calibration on every rank (blocking collectives, main thread, at the first hook call
        of the first step whose due plans need it: the second, unless every gradient's plan keeps dense by
        its bytes), the link timed up to the largest gradient's bytes; then every aggregator, built during
        the first step without a cost model, gets it."""
        group, n = self.process_group, self.world_size
        device, root = self._collective_device(), self._root()

        def gather(t):
            out = [torch.empty_like(t) for _ in range(n)]
            dist.all_gather(out, t, group=group)

        largest = max((4 * a.numel for a in self._aggregators.values()), default=0)
        self.spec.measure(lambda t: dist.all_reduce(t, group=group), gather,
                          lambda t: dist.broadcast(t, src=root, group=group), self.rank, n, device,
                          largest_bytes=largest)
        for agg in self._aggregators.values():
            agg.cost_model = self.spec.cost_model


def lossless_hook(state: LosslessHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: lossless aggregation of one bucket.

    Returns a future of the bucket's averaged gradients (same shape as ``bucket.buffer()``), equal
    to DDP's default allreduce within the exactness contract (:mod:`lossless_hc.lhc.contract`: what a
    dense float32 allreduce may be off, or the codec's ``rtol`` where larger; keys the decoder cannot
    prove are re-aggregated densely).
    """
    require_arguments(state, bucket, LosslessHookState, "lossless_hook")
    return _compressed_allreduce(state, bucket, "lossless_hook")


def topk_hook(state: TopKHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: top-k with error feedback, the ranks' selections averaged through the LHC
    codec, within its exactness contract (:class:`TopKHookState`)."""
    require_arguments(state, bucket, TopKHookState, "topk_hook")
    return _compressed_allreduce(state, bucket, "topk_hook")


def thc_hook(state: THCHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: THC, an unbiased estimate of the bucket's average."""
    require_arguments(state, bucket, THCHookState, "thc_hook")
    return _compressed_allreduce(state, bucket, "thc_hook")


def _compressed_allreduce(state: HookState, bucket: dist.GradBucket, hook: str):
    buffer = bucket.buffer()
    if buffer.is_sparse:   # the fixed codecs encode dense tensors; auto_hook plans over a sparse one's rows
        raise TypeError(f"{hook} got a sparse gradient bucket; use auto_hook (AutoHookState(strategies=('sketch',)) "
                        "for the LHC sketch alone) or dense gradients (nn.Embedding(sparse=False))")
    if not state._config_checked:
        state._check_configuration()
    state._check_bucket(bucket.parameters(), bucket.is_last())
    fallback_group = state._fallback_group(bucket.index())
    aggs = [state._aggregator(p, g) for p, g in zip(bucket.parameters(), bucket.gradients())]
    state._check_restored(bucket.is_last())
    n = state.world_size
    divided = divide_first(buffer, n)
    # A bucket whose every tensor is sent as it is: its buffer is the message, summed in place.
    message = encode_message(aggs, bucket.gradients(), buffer=buffer)
    outs = in_place_outputs(aggs, bucket_slices(buffer, bucket.gradients()))
    fut = allreduce_parts(message.parts, state.process_group, buffer.device)

    def decode(fut: torch.futures.Future) -> torch.Tensor:
        results = decode_message(message, fut.value(), lambda dense: dist.all_reduce(dense, group=fallback_group),
                                 outs=outs)
        return fill_bucket(buffer, results, None if divided else n)

    return fut.then(decode)



def auto_hook(state: AutoHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: the planner's strategy per parameter (exact unless ``lossy``).

    Returns a future of the bucket's averaged gradients; with exact strategies they equal DDP's default
    allreduce up to float rounding of the sum (the sketch's within the exactness contract, as
    :func:`lossless_hook`'s). A sparse gradient's bucket (``nn.Embedding(sparse=True)``:
    DDP gives each its own) is planned among the exact strategies over the rows it lists, without
    densifying it for allgather and two_phase, and its future holds a coalesced sparse tensor of the
    rows some rank listed, divided by the world size, as DDP's own sparse allreduce gives.

    A bucket whose every parameter is on a dense plan's plain step (no statistics this step:
    :meth:`~lossless_hc.training.strategies.AutoAggregator.plain_step`) is allreduced in place, as DDP's
    own hook does: one collective of the bucket's bytes, no copy, no scan; one whose every parameter is on
    an fp16 (bf16) plan's plain step goes as DDP's ``fp16_compress_hook`` (its bfloat16 twin) sends it, the
    bucket cast, summed and copied back. Whether a bucket is plain is a function of the plans and step
    counts, identical on every rank."""
    require_arguments(state, bucket, AutoHookState, "auto_hook")
    state._record_plain_steps()   # earlier steps' accounting: not this bucket's time
    started = time.perf_counter()
    buffer = bucket.buffer()
    if not state._config_checked:
        state._check_configuration()
    if bucket.index() == 0:   # DDP launches bucket 0 first, after every callback of the previous step
        state._begin_step(started)
    params, known = bucket.parameters(), state._aggregators
    # DDP puts each sparse gradient (nn.Embedding(sparse=True)) in a bucket of its own, whose buffer is
    # that gradient (uncoalesced COO) and whose gradients() list is empty. bucket.gradients() makes a tensor
    # (a view of the buffer) per parameter: a bucket of known parameters outside PowerSGD and the step guard's
    # windows reads them only where it runs a message (below), not on a plain step (docs/BENCHMARKS.md, "No
    # gradient views on a plain step").
    if buffer.is_sparse:
        grads = [buffer]
    elif state._powersgd is None and state._step_phase == "plan" and all(p in known for p in params):
        grads = None
    else:
        grads = bucket.gradients()
    aggs = [state._aggregator(p, g) for p, g in zip(params, grads or [None] * len(params))]
    settling = state._settling()   # before _check_restored, which ends the restored state's first step
    state._check_restored(bucket.is_last())
    # a plan due since the calibration is applied now, each priced as the bucket batches its second collective
    settle_message_plans(aggs)
    n = state.world_size
    index, psgd = bucket.index(), state._powersgd
    if psgd is not None and not buffer.is_sparse and not settling:
        if psgd.offered(buffer, grads, n):
            state._offered_now = state._offered_now | {index}
        if state._guard is not None and state._guard.verdict in ("plan", "dense"):
            # the step guard's trial is over: what its PowerSGD window's memory holds goes out with this step
            error = psgd.end_trial(index)
            if error is not None:
                buffer.add_(error)
                for a in aggs:   # the rows of the trial's PowerSGD steps: not this step's statistics
                    a.carry_memory()
    verdict = state._guard.verdict if state._guard is not None else None
    # The step guard's PowerSGD window (and verdict): torch's hook on the whole bucket where PowerSGD may take it
    if state._step_phase == "powersgd" and not buffer.is_sparse and not settling:
        window = psgd.window_bucket(index, state._steps - 1, aggs, grads, buffer, n, verdict == "powersgd")
        if window is not None:
            psgd.count_step(window, grads)
            return window.run(bucket, state._fallback_group(index))
    # The step guard's dense window (and a dense verdict; the buckets PowerSGD's window does not take), or a
    # restored state's first step (_settling): every dense float bucket in place, PowerSGD's too.
    guard_dense = (state._step_phase in ("dense", "powersgd") or settling) and not buffer.is_sparse
    divided = None
    if guard_dense and not settling and verdict in ("dense", "powersgd"):
        # For good: what THC's or top-k's error feedback, or the bucket's PowerSGD memory, still holds goes
        # out with this step's gradients (once: taking it leaves none behind). A float16 bucket's memory
        # is in the units of its divided gradients (x_r / n): it is added after the division.
        divided = divide_first(buffer, n)
        for a, g in zip(aggs, grads):
            a.add_lossy_memory_to(g)
        error = psgd.leave(index, state._steps - 1) if psgd is not None else None
        if error is not None:
            psgd.buckets[index].add_to(error, buffer, grads)
    powersgd = None if guard_dense else state._powersgd_bucket(bucket, buffer, grads, aggs)
    slices = None   # each gradient's slice of the bucket: made where a step writes results into them (not a plain one)
    part = None   # PowerSGD on some of the bucket's gradients: the future of their averages (a flat copy)
    if powersgd is not None:   # torch's powerSGD_hook, on the bucket's own group (training/powersgd.py)
        state._powersgd.count_step(powersgd, grads)
        if powersgd.members is None:
            return powersgd.run(bucket, state._fallback_group(bucket.index()))
        # its own group: the other gradients' second collectives use the bucket's, from another callback
        part = powersgd.run(powersgd.part(bucket.index(), grads),
                            state._fallback_group((bucket.index(), "powersgd")))
        slices = bucket_slices(buffer, grads)
        part_slices = powersgd.of_members(slices)
        aggs, grads, slices = powersgd.of_others(aggs), powersgd.of_others(grads), powersgd.of_others(slices)
    if divided is None:
        divided = divide_first(buffer, n)
    # (calibration_due looks at the aggregators only while no calibration is known)
    steady = part is None and not guard_dense and not state.spec.calibration_due(aggs)
    plains = [a.plain_step() for a in aggs] if steady else [None]
    if guard_dense:   # what DDP's own hooks send: in place, or with lossy bf16_compress_hook's whole bucket
        plains = ["dense"] if settling else [guard_half(aggs, buffer.dtype) or "dense"]
    if buffer.dtype == torch.float32 and plains[0] in HALF_STRATEGIES and len(set(plains)) == 1:
        # the message's bits, without its copies
        def half_plain(fut: torch.futures.Future) -> torch.Tensor:
            state._plain_done.append((aggs, started, time.perf_counter(), None, plains[0]))
            return fut.value()

        return allreduce_half(buffer, n, state.process_group, plains[0]).then(half_plain)
    # (plains is [None] off the steady path and the guard's dense window: a plan waiting for the calibration, a
    # PowerSGD part)
    as_is = all(p in ("dense", "allgather") for p in plains)
    if part is None and buffer.is_floating_point() and as_is:
        # A sparse buffer here is a sparse gradient's allgather plan between its statistics steps: Gloo's
        # own sparse allreduce, as DDP without a hook (its result is coalesced; divided as DDP divides).
        rows = buffer._nnz() if buffer.is_sparse else None   # before Gloo coalesces it in place
        if not divided:
            divided = divide_first_exactly(buffer, n)
        fut = dist.all_reduce(buffer, group=state.process_group, async_op=True).get_future()

        def plain(fut: torch.futures.Future) -> torch.Tensor:
            state._plain_done.append((aggs, started, time.perf_counter(), rows, None))
            return fut.value()[0] if divided else fut.value()[0].div_(n)

        return fut.then(plain)
    planned = [a.plans for a in aggs]
    if grads is None:
        grads = bucket.gradients()
    message = AutoMessage(aggs, grads)
    if slices is None and not buffer.is_sparse:
        slices = bucket_slices(buffer, grads)
    # A dense float32 gradient's allgather sum is written straight into its slice of the bucket
    # (AutoAggregator.finish, after every read of the gradient) and divided there, on its union's rows
    # only: no zero-filled tensor, no copy back, no division of the table's zeros.
    outs = None if buffer.is_sparse else [s if s.dtype == torch.float32 and not s.requires_grad else None
                                          for s in slices]
    # Only a strategy other than dense makes a second collective: the bucket's own group is created
    # (here, main thread, bucket order, from the plans every rank shares) when one first runs.
    fallback_group = None
    if any(ctx.strategy != "dense" for _, ctx in message.encoded):
        fallback_group = state._fallback_group(bucket.index())
    fut = allreduce_parts(message.parts, state.process_group, buffer.device)

    def gather(t: torch.Tensor) -> torch.Tensor:
        out = [torch.empty_like(t) for _ in range(n)]
        dist.all_gather(out, t, group=fallback_group)
        return torch.stack(out)

    def decode(fut: torch.futures.Future) -> torch.Tensor:
        results = decode_auto_message(message, fut.value(),
                                      lambda t: dist.all_reduce(t, group=fallback_group), gather, outs=outs,
                                      divisor=None if divided else n)
        settle_message_plans(aggs, planned)   # the plans this step's statistics made, as the bucket batches them
        if buffer.is_sparse:   # DDP copies the returned sparse tensor into the gradient
            return results[0] if divided else results[0].div_(n)
        # the results written into their slices were divided there (decode_message's divisor)
        fill_slices(slices, results, None if divided else n, in_place_divided=True)
        return buffer

    if part is None:
        return fut.then(decode)

    def joined(fut: torch.futures.Future) -> torch.Tensor:
        averaged = fut.value()[0]   # PowerSGD's averages of its gradients, flat, in bucket order
        for dst, src in zip(part_slices, torch.split(averaged, [t.numel() for t in part_slices])):
            dst.copy_(src)
        return buffer

    return when_all([part, fut.then(decode)], buffer.device).then(joined)
