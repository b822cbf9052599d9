"""torch.distributed FSDP2 (``fully_shard``) adapter: compressed replica all-reduce for HSDP and a
homomorphic reduce-scatter, one state class per algorithm.

FSDP2 has no ``register_comm_hook``; it has two seams, and this module fills both:

* **the replica all-reduce (HSDP).** "Custom HSDP": ``fully_shard`` shards each module over the
  *shard* dimension of a 2-D ``(replicate, shard)`` device mesh only, and the all-reduce hook
  (``FSDPModule.set_all_reduce_hook``), called with each parameter group's reduce-scattered shard,
  sums that shard across the *replicate* dimension -- the inter-node link, where compression pays.
  Per parameter the hook encodes its slot of the shard, concatenates the payloads into one message,
  SUMs it across replicas (one all-reduce per part: per payload dtype, or fewer) and decodes it
  (:mod:`lossless_hc.training.message`, shared with the DDP hook).
* **the reduce-scatter** (``FSDPModule.set_custom_reduce_scatter``, ``reduce_scatter=True``;
  :mod:`lossless_hc.plugins._fsdp_reduce_scatter`). Every rank encodes each destination's chunk
  separately (one aggregator per parameter and destination), and an all-to-all hands destination
  ``d`` every rank's message for ``d``, each as long as ``d``'s capacities make it (a reduce-scatter
  would pad every destination's to the longest), which ``d`` sums: the payloads are homomorphic, so
  that sum is a payload of the summed chunk, and ``d`` decodes it. Only ``d`` knows how its decode
  went, so the owners then share a small table (and, where some decode had inexact keys, the keys):
  every rank grows the same capacities, and the failed parameters' chunks and the inexact keys' values
  are reduce-scattered again (the same way), exactly -- identically on every rank. THC is not offered
  there: its codec agrees on a norm from the decoded aggregate, which a reduce-scatter gives to the
  owner alone. ``AutoFSDPState`` fills this seam with the exact sparse reduce-scatter instead (below),
  and ``TopKFSDPState`` with its top-k selections sent the same way (an index and a value each), so the
  homomorphic one is ``LosslessFSDPState``'s.

Averaging: :meth:`~_FSDPState.register` makes every collective a plain SUM
(``set_force_sum_reduction_for_comms(True)``) and sets ``set_gradient_divide_factor(R * S)``, so
FSDP divides each reduced shard once, after our hooks, exactly as uncompressed HSDP over the same
mesh does. With ``lossless`` the gradients therefore equal uncompressed FSDP2's within the exactness
contract (:mod:`lossless_hc.lhc.contract`: what a dense float32 sum may be off, or the codec's
``rtol`` where larger; keys the decoder cannot prove are re-aggregated densely), and bit for bit
where every decode gives the sum in the order the dense collective adds.

Usage::

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from lossless_hc.plugins.fsdp import LosslessFSDPState

    mesh = init_device_mesh("cuda", (replicas, shards), mesh_dim_names=("replicate", "shard"))
    for block in model.blocks:
        fully_shard(block, mesh=mesh["shard"])        # the shard dimension only ("custom HSDP")
    fully_shard(model, mesh=mesh["shard"])
    state = LosslessFSDPState(mesh, max_density=0.01)   # TopKFSDPState(mesh, ratio=0.01), THCFSDPState(mesh, bits=4)
    state.register(model)                               # reduce_scatter=True: also the homomorphic reduce-scatter
    ...                                                 # train as usual; state.stats()
    torch.save(state.state_dict(), f"lhc.rank{dist.get_rank()}.pt")   # with the model/optimizer checkpoint

Checkpointing: error feedback (top-k residuals, THC memories) and capacities are kept per parameter
(by FQN) and, for the reduce-scatter, per destination (the sparse reduce-scatter's check cadence per
module); they describe *this rank's* shard, so save
:meth:`~_FSDPState.state_dict` per rank (``torch.save`` as above; ``torch.distributed.checkpoint``
would keep one copy of a plain tensor for all ranks) next to the model and optimizer checkpoint,
and restore it with :meth:`~_FSDPState.load_state_dict` on the same rank and mesh before the first
backward of the resumed run: the run then continues bit for bit as if it had not stopped. For
``AutoFSDPState`` that holds with a given ``calibration`` and ``guard_steps=0``: its plans and error
feedback are saved, but the link is timed again at ``register`` and the step guard runs a trial of its
own (class doc), as a run on other machines should.

Deadlock freedom: every collective here is blocking and issued from FSDP's post-backward, which
reduces parameter groups in the same order on every rank; the fallback and the owners' table are
issued by all ranks of the group or by none (each rank decides from aggregates all of them hold).
Ranks configured differently raise :class:`ConfigurationMismatch` from :meth:`~_FSDPState.register`
on every rank.

``AutoFSDPState(mesh, lossy=False)`` (the planner, :mod:`lossless_hc.training.auto`): per parameter of
the replica all-reduce, the strategy the cost model predicts cheapest; calibrated in
:meth:`~_FSDPState.register` on the replicate group (blocking; every rank calls ``register`` at the same
point), unless a ``calibration`` is given. A strategy's second collective (allgather, two_phase's
values, fp16/bf16, a sketch's fallback) is issued blocking from the same hook, in the same order on
every rank. Its step guard (on by default, :class:`AutoFSDPState`) times the plans against steps whose
shards are all-reduced in place (with ``lossy``, in bfloat16), and keeps them only if they measure
faster. With ``reduce_scatter=True`` its reduce-scatter is the exact sparse one
(:mod:`lossless_hc.training.row_exchange`): each rank sends each destination every parameter's chunk
as its own non-zero rows with their indices, or as it is where that is fewer bytes (each sender
decides for its own chunks, so no statistics need to cross ranks), and the owner adds them up -- the
dense reduce-scatter's sum to float rounding, with no capacity or fallback. A module whose chunks all
went whole at its last check (one int64 all-reduce, every re-plan ``interval`` calls, widening to every
``max_interval`` while the module stays all-dense) takes FSDP2's own reduce-scatter until the next,
sparing the exchange's extra round. The step guard then times
it (with the replica all-reduce's plans, if any) against FSDP2's own collectives, one verdict for the
whole mesh (class doc). With ``lossy`` (and bf16 among its ``strategies``), a float32 chunk sent whole goes as
bfloat16, as FSDP2's ``MixedPrecisionPolicy(reduce_dtype=torch.bfloat16)`` would send it (its owner
sums in float32), for parameters of ``lossy_min_bytes`` or more; rows stay exact.

Limits: one parameter group per ``fully_shard`` call (no per-parameter meshes: torch refuses custom
hooks there); even ``Shard(0)`` placements (FSDP2's default); native HSDP (``fully_shard`` on the
2-D mesh) is refused, since its hook would see the already all-reduced shard. The parameter slots are
read from FSDP2's parameter group (private attributes, checked on first use: ``fsdp_params``,
``_param_fqn``, ``padded_sharded_param_size``).
"""
from __future__ import annotations

import time
from typing import Optional

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule

from lossless_hc.lhc.layout import is_real
from lossless_hc.training.adapter import AggregatorSpec, LosslessSpec, THCSpec, TopKSpec
from lossless_hc.training.auto import AutoMessage, AutoSpec, guard_half, guard_stats, plan_stats, settle_message_plans
from lossless_hc.training.auto import decode_message as decode_auto_message
from lossless_hc.training.aggregate import AggregationStats, ConfigurationMismatch
from lossless_hc.training.capacity import CapacityPolicy
from lossless_hc.training.checkpoint import aggregator_state_dict, load_aggregator_state_dict
from lossless_hc.training.guard import GUARD_MARGIN, GUARD_START, GUARD_STEPS, step_guard
from lossless_hc.training.message import decode_message, encode_message, in_place_outputs
from lossless_hc.plugins._ddp_bucket import allreduce_half, divide_first
from lossless_hc.plugins._fsdp_reduce_scatter import (HomomorphicReduceScatter, ReduceScatterBase,
                                                     RowExchangeReduceScatter, SelectionRowExchangeReduceScatter,
                                                     Slots, all_gather_stacked, param_groups)
from lossless_hc.plugins._torch_dist import check_same_configuration

__all__ = ["LosslessFSDPState", "TopKFSDPState", "THCFSDPState", "AutoFSDPState", "ConfigurationMismatch"]

class _FSDPState:
    """What every FSDP2 state holds: the spec, the mesh's groups, the per-parameter aggregators.

    Args:
        spec: the aggregators' configuration (:mod:`lossless_hc.training.adapter`).
        mesh: a 2-D :class:`DeviceMesh` ``(replicate, shard)`` (custom HSDP: ``fully_shard`` on
            ``mesh[<shard dim>]``) or a 1-D one (FSDP only: the reduce-scatter is all there is to
            compress, ``register(..., reduce_scatter=True)``).
    """

    supports_reduce_scatter = True
    no_reduce_scatter = ""
    reduce_scatter_comm = HomomorphicReduceScatter   # register(reduce_scatter=True)'s comm, per fully_shard module

    def __init__(self, spec: AggregatorSpec, mesh: DeviceMesh):
        if not isinstance(mesh, DeviceMesh) or mesh.ndim not in (1, 2):
            raise ValueError(f"mesh must be a 1-D (shard) or 2-D (replicate, shard) DeviceMesh, got {mesh!r}")
        self.spec = spec
        self.mesh = mesh
        self.replicate_group = mesh.get_group(0) if mesh.ndim == 2 else None
        self.shard_group = mesh.get_group(mesh.ndim - 1)
        self.replicas = dist.get_world_size(self.replicate_group) if self.replicate_group is not None else 1
        self.shards = dist.get_world_size(self.shard_group)
        self.reduce_scatter = False
        self._replica_divisor: Optional[float] = None   # set by register (a shard group of one rank)
        self._stats = AggregationStats()
        self._aggregators: dict = {}    # "replicate:<fqn>" | "shard:<fqn>-><d>" -> aggregator
        self._saved: dict = {}          # states loaded before their aggregator was built
        self._scatters: dict = {}       # module name -> its reduce-scatter comm (register(reduce_scatter=True))
        self._saved_scatters: dict = {}   # their saved states (state_dict()["reduce_scatter"]), until registered
        self._fqns: Optional[set] = None   # the registered model's parameters, as the keys name them

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.spec!r}, replicas={self.replicas}, shards={self.shards})"

    def stats(self) -> dict:
        """Counters over all gradients so far (see :class:`lossless_hc.training.aggregate.AggregationStats`)."""
        return self._stats.as_dict()

    def _device(self) -> torch.device:
        """Where small control tensors go: the mesh's device (NCCL reduces CUDA tensors only)."""
        if self.mesh.device_type == "cuda":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device(self.mesh.device_type)

    def _config(self) -> str:
        return f"{type(self).__name__}|replicas={self.replicas}|shards={self.shards}|{self.spec!r}"

    # -- registration ----------------------------------------------------------------------------
    def register(self, model: torch.nn.Module, reduce_scatter: bool = False,
                 gradient_divide_factor: Optional[float] = None) -> None:
        """Install the hooks on every ``fully_shard`` module of ``model`` (call on every rank, after
        ``fully_shard`` and before the first backward).

        * the replica all-reduce hook, when the mesh has a replicate dimension of more than one rank;
        * with ``reduce_scatter``, the state's reduce-scatter (shard dimension of more than one rank): the
          homomorphic one (:class:`LosslessFSDPState`), the row exchange of the top-k selections
          (:class:`TopKFSDPState`) or the exact sparse one (:class:`AutoFSDPState`);
        * sum-only collectives and ``set_gradient_divide_factor(gradient_divide_factor)``, by default
          the data-parallel world size (replicas x shards), so gradients are averaged as uncompressed
          FSDP2 averages them.

        Then checks, with one small all-reduce per mesh dimension, that every rank has the same
        configuration and model structure (hashed); raises :class:`ConfigurationMismatch` on every rank if not.
        """
        if not isinstance(reduce_scatter, bool):   # "no" would compress the reduce-scatter
            raise TypeError(f"reduce_scatter must be a bool, got {reduce_scatter!r}")
        if gradient_divide_factor is not None and not (
                is_real(gradient_divide_factor) and 0 < gradient_divide_factor < float("inf")):
            raise ValueError(f"gradient_divide_factor must be a finite number > 0 (or None: replicas x shards), "
                             f"got {gradient_divide_factor!r}")
        if reduce_scatter and not self.supports_reduce_scatter:
            raise ValueError(f"{type(self).__name__} cannot compress the reduce-scatter: {self.no_reduce_scatter}; "
                             "use reduce_scatter=False (the replica all-reduce)")
        if reduce_scatter and ReduceScatterBase is object:
            raise RuntimeError("this torch has no FSDPModule.set_custom_reduce_scatter (torch >= 2.8 needed)")
        if reduce_scatter and getattr(self.spec, "extra", {}).get("policy") is not None:
            if issubclass(self.reduce_scatter_comm, HomomorphicReduceScatter):
                raise ValueError("a CapacityPolicy reads every decoded aggregate, which the homomorphic reduce-scatter "
                                 "gives to the owner alone; use policy=None with reduce_scatter=True")
            if self.replicas == 1:   # top-k's reduce-scatter sends index/value pairs: no capacity to size
                raise ValueError("a CapacityPolicy sizes the replica all-reduce's payloads, and this mesh has no "
                                 "replicas (the reduce-scatter sends each selection as index/value pairs, with no "
                                 "capacity); use policy=None")
        if self.replicas == 1 and not reduce_scatter:
            raise ValueError("a mesh without replicas (1-D, or a replicate dimension of size 1) has no replica "
                             "all-reduce to compress; pass reduce_scatter=True, or a (replicate, shard) mesh of 2 or "
                             "more replicas")
        factor = float(gradient_divide_factor) if gradient_divide_factor is not None else float(self.replicas * self.shards)
        modules = [(name, m) for name, m in model.named_modules() if isinstance(m, FSDPModule)]
        if not modules:
            raise ValueError("register needs a model with fully_shard applied (no FSDPModule found)")
        self.reduce_scatter = bool(reduce_scatter)
        # A shard group of one rank: torch (2.13) would divide by the factor twice (in the copy that stands
        # in for its reduce-scatter, and after the all-reduce hook), so the replica hook divides instead.
        self._replica_divisor = factor if self.shards == 1 and self.replicas > 1 else None
        for name, module in modules:
            for group in param_groups(module):
                info = group.mesh_info
                if hasattr(info, "replicate_process_group") or getattr(info, "shard_mesh_size", None) != self.shards:
                    raise ValueError(f"module {name or '<root>'!r}: fully_shard it on the shard dimension of the mesh "
                                     f"(mesh[<shard dim>], {self.shards} ranks), not natively on the 2-D mesh: native "
                                     "HSDP all-reduces before the hook runs")
            module.set_force_sum_reduction_for_comms(True)
            if self._replica_divisor is None:
                module.set_gradient_divide_factor(factor)
            if not param_groups(module):
                continue
            if self.replicas > 1:
                module.set_all_reduce_hook(_ReplicaAllReduce(self, module))
            if reduce_scatter and self.shards > 1:
                self._scatters[name] = comm = self.reduce_scatter_comm(self, module)
                module.set_custom_reduce_scatter(comm)
        # the names the hooks key their aggregators by (Slots: FSDP2's _param_fqn, set at the first forward:
        # the name within the fully_shard module its lazy init took as root, which a torch.compile wrapper
        # does not prefix; else the fallback name)
        self._fqns = {n for _, m in modules for n, _ in m.named_parameters()} | {
            f"{type(m).__name__}.param{i}" for _, m in modules for g in param_groups(m)
            for i in range(len(g.fsdp_params))}
        self._check_saved_keys(self._saved)
        self._check_saved_scatters(self._saved_scatters)
        self._restore_scatters()
        structure = ";".join(f"{n}:{tuple(p.shape)}:{p.dtype}" for n, p in model.named_parameters())
        cfg = (f"{self._config()}{self._checked_options()}|reduce_scatter={self.reduce_scatter}|factor={factor}|"
               f"modules={[n for n, _ in modules]}|{structure}")
        groups = [g for g in (self.replicate_group, self.shard_group) if g is not None]
        check_same_configuration(cfg, groups, type(self).__name__, device=self._device())
        self._after_register(model)

    def _after_register(self, model: torch.nn.Module) -> None:
        """Called on every rank at the end of :meth:`register` (after the configuration check)."""

    def _checked_options(self) -> str:
        """Options that every rank must share but a checkpoint need not (:meth:`register` checks them)."""
        return ""

    def _narrow_dtype(self, parameter_bytes: int) -> Optional[torch.dtype]:
        """The dtype a row-exchange reduce-scatter sends a parameter's whole chunks in (None: as they are)."""
        return None

    def _phase(self, hook, now: float) -> str:
        """What ``hook`` (a replica all-reduce hook or a reduce-scatter) runs at this call: ``"plan"`` (ours)
        or ``"dense"`` (FSDP2's own collective: the shard all-reduced in place, :meth:`_replica_in_place`,
        or reduce-scattered as it is); ``now``: the call's start."""
        return "plan"

    # -- aggregators -------------------------------------------------------------------------------
    def _aggregator(self, key: str, tensor: torch.Tensor, world_size: int, rank: int, **options):
        """The aggregator of ``key``, built at its first call (``options``: the spec's ``make``'s own)."""
        agg = self._aggregators.get(key)
        if agg is None:
            agg = self.spec.make(key, tensor, world_size, rank, self._stats, tensor.device, **options)
            saved = self._saved.pop(key, None)
            if saved is not None:
                load_aggregator_state_dict(agg, saved)
            self._aggregators[key] = agg
        return agg

    # -- checkpointing ----------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """This rank's aggregator states (error feedback, capacities, THC norms), keyed by
        ``"replicate:<param FQN>"`` and ``"shard:<param FQN>-><destination>"``, and the rank that saved
        them; plain numbers and CPU tensors. Save it per rank with the model and optimizer (see the
        module doc). ``stats`` is a record of the counters, not restored."""
        aggs = {k: aggregator_state_dict(a) for k, a in self._aggregators.items()}
        scatters = {name: c.state_dict() for name, c in self._scatters.items() if hasattr(c, "state_dict")}
        return {"config": self._config(), "rank": dist.get_rank(), "aggregators": {**self._saved, **aggs},
                "reduce_scatter": {**self._saved_scatters, **scatters}, "stats": self.stats()}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` on the rank that saved it, with the same configuration and mesh shape,
        before or after :meth:`register`; ``ValueError`` otherwise, or for a key naming no parameter of the
        registered model. Every aggregator then starts from the saved state (one built since and absent
        there starts afresh), applied when it is built at the next backward."""
        if not isinstance(state, dict) or not isinstance(state.get("aggregators"), dict):
            raise ValueError("not a state_dict() of an FSDP2 state (no 'aggregators' table)")
        if state.get("config") != self._config():
            raise ValueError(f"the saved state was made by {state.get('config')!r}, this state is {self._config()!r}")
        rank = dist.get_rank()
        if state.get("rank", rank) != rank:   # each rank's file holds its own shards' error feedback
            raise ValueError(f"the saved state is rank {state['rank']}'s; this is rank {rank}: each rank loads the "
                             "state_dict it saved")
        self._check_saved_keys(state["aggregators"])
        scatters = dict(state.get("reduce_scatter") or {})   # none before 2026-12-02
        self._check_saved_scatters(scatters)   # before anything is restored
        self._aggregators = {}
        self._saved = dict(state["aggregators"])
        self._saved_scatters = scatters
        self._restore_scatters()

    def _check_saved_scatters(self, saved: dict) -> None:
        """``ValueError`` for a malformed reduce-scatter state, or (once registered) one of a module this
        model does not reduce-scatter with its hooks."""
        for value in saved.values():
            RowExchangeReduceScatter.check_state(value)
        unknown = sorted(set(saved) - set(self._scatters)) if self._fqns is not None else []
        if unknown:
            raise ValueError(f"the saved state holds reduce-scatter states of modules this model does not "
                             f"reduce-scatter with its hooks ({', '.join(map(repr, unknown[:3]))})")

    def _restore_scatters(self) -> None:
        """Hand the registered reduce-scatters their saved states (the sparse one's check cadence), once
        both are known (checked by :meth:`_check_saved_scatters` before)."""
        if not self._saved_scatters or self._fqns is None:
            return
        for name, saved in self._saved_scatters.items():
            self._scatters[name].load_state_dict(saved)
        self._saved_scatters = {}

    def _check_saved_keys(self, saved: dict) -> None:
        """``ValueError`` for saved states of parameters the registered model does not have (another
        model's, a renamed layer's): they would be kept and never used, the layer starting afresh."""
        if self._fqns is None:
            return
        unknown = sorted(k for k in saved if k.split(":", 1)[-1].split("->")[0] not in self._fqns)
        if unknown:
            raise ValueError(f"the saved state holds {len(unknown)} parameter(s) this model does not have "
                             f"({', '.join(unknown[:3])}{', ...' if len(unknown) > 3 else ''})")


class _ReplicaAllReduce:
    """The all-reduce hook of one ``fully_shard`` module: SUM of its reduce-scattered shard across
    replicas, compressed; the result replaces the shard in place (FSDP divides it afterwards, or, with a
    shard group of one rank, this hook: ``_replica_divisor``)."""

    def __init__(self, state: _FSDPState, module: FSDPModule):
        self.state, self.module, self.slots = state, module, None

    def __call__(self, reduce_output: torch.Tensor) -> None:
        divisor = self.state._replica_divisor
        # Where FSDP2 leaves the division to the hook (one shard): DDP's buckets' rule, float16 before the
        # sum, the others after
        divided = divisor is not None and divide_first(reduce_output, divisor)
        self._reduce(reduce_output)
        if divisor is not None and not divided:
            reduce_output.div_(divisor)

    def _reduce(self, reduce_output: torch.Tensor) -> None:
        st = self.state
        started = time.perf_counter()
        phase = st._phase(self, started)
        if self.slots is None:
            self.slots = Slots(self.module)
        views = self.slots.views(reduce_output)
        rank = dist.get_rank(st.replicate_group)
        aggs = [st._aggregator(f"replicate:{fqn}", v, st.replicas, rank) for fqn, v in zip(self.slots.fqns, views)]
        if phase == "dense":
            st._replica_in_place(aggs, views, reduce_output, started)
            return
        auto = isinstance(st.spec, AutoSpec)
        if auto:   # the plans priced as this message batches their second collectives
            settle_message_plans(aggs)
            planned = [a.plans for a in aggs]
        message = AutoMessage(aggs, views) if auto else encode_message(aggs, views)
        for part in message.parts:
            dist.all_reduce(part, group=st.replicate_group)
        if auto:
            results = decode_auto_message(message, message.parts,
                                          lambda t: dist.all_reduce(t, group=st.replicate_group),
                                          lambda t: all_gather_stacked(t, st.replicate_group, st.replicas))
            settle_message_plans(aggs, planned)
        else:
            # THC's non_finite="raise" sees a rank's NaN/Inf only in the replicate group of the shard that
            # holds it: the shard group agrees on it, so that every rank raises (not only that shard's
            # owners, the others then blocking at their next collective)
            agree = isinstance(st.spec, THCSpec) and st.spec.non_finite == "raise" and st.shards > 1
            failed = None
            try:
                results = decode_message(message, message.parts,
                                         lambda dense: dist.all_reduce(dense, group=st.replicate_group),
                                         outs=in_place_outputs(aggs, views))
            except FloatingPointError as e:
                if not agree:
                    raise
                failed = e
            if agree:
                flag = torch.tensor([0.0 if failed is None else 1.0], device=reduce_output.device)
                dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=st.shard_group)
                if failed is not None:
                    raise failed
                if flag.item():
                    raise FloatingPointError("non-finite input (NaN/Inf) on a rank, in another shard of this "
                                             "module's gradients (non_finite='raise')")
        for view, value in zip(views, results):
            if value.data_ptr() != view.data_ptr():   # not decoded into its slot already
                view.copy_(value.reshape(view.shape))


class LosslessFSDPState(_FSDPState):
    """Lossless aggregation of naturally sparse gradients (embedding tables) under FSDP2.

    Args:
        mesh: see :class:`_FSDPState`.
        max_density: each rank may send this fraction of a shard's coordinates before that shard falls
            back to dense (and its capacity grows).
        block_size: coordinates hashed as one key; None: a 2-D shard's row length, else 1.
        seed: hash seed, identical on every rank.
        index: the codec's index kind ("auto" picks the smallest payload).
        policy: a :class:`lossless_hc.CapacityPolicy` for the replica all-reduce (not with
            ``reduce_scatter=True``: the owner alone sees a destination's decoded aggregate).
    """

    def __init__(self, mesh: DeviceMesh, max_density: float = 0.01, block_size: Optional[int] = None, seed: int = 0,
                 index: str = "auto", policy: Optional[CapacityPolicy] = None):
        extra = {"policy": policy} if policy is not None else {}
        super().__init__(LosslessSpec(max_density, block_size, seed, index, **extra), mesh)


class TopKFSDPState(_FSDPState):
    """Each rank's top ``ratio`` of every shard (error feedback keeps the rest, per parameter and, in
    the reduce-scatter, per destination), the selections summed: by the LHC codec on the replica
    all-reduce (within its exactness contract: the sum's support, each value within ``rtol``, keys it
    cannot prove re-aggregated densely), to float rounding as index/value pairs sent to their owner on
    the reduce-scatter (:class:`~lossless_hc.plugins._fsdp_reduce_scatter.SelectionRowExchangeReduceScatter`). ``policy``: a
    :class:`lossless_hc.CapacityPolicy` for the replica all-reduce's payloads (with ``reduce_scatter=True``
    too: the selections sent to their owner have no capacity to size; a mesh without replicas refuses
    it, as it would size nothing)."""

    reduce_scatter_comm = SelectionRowExchangeReduceScatter

    def __init__(self, mesh: DeviceMesh, ratio: float = 0.01, seed: int = 0, index: str = "auto",
                 policy: Optional[CapacityPolicy] = None):
        extra = {"policy": policy} if policy is not None else {}
        super().__init__(TopKSpec(ratio, seed, index, **extra), mesh)


class THCFSDPState(_FSDPState):
    """THC quantization (lossy, unbiased, error feedback) of the replica all-reduce, with ``bits``,
    ``granularity`` and ``overflow_freq`` (see :class:`lossless_hc.THCCodec`). The reduce-scatter
    stays uncompressed (see the module doc). ``non_finite``: "raise" NaN/Inf gradients, on every rank
    (the shard group agrees on it: one 1-element all-reduce per hook call where there are several
    shards), or "propagate" them: all-NaN on every rank of the replicate group of the shard that holds
    them (AMP's sharded GradScaler reduces its found-inf over the mesh, so every rank skips the step)."""

    supports_reduce_scatter = False
    no_reduce_scatter = ("its codec agrees on a norm from the decoded aggregate, which a reduce-scatter gives to the "
                         "owner alone")

    def __init__(self, mesh: DeviceMesh, bits: int = 4, granularity: int = 30, overflow_freq: float = 32,
                 seed: int = 0, non_finite: str = "raise"):
        super().__init__(THCSpec(bits, granularity, overflow_freq, seed, non_finite), mesh)


class AutoFSDPState(_FSDPState):
    """The planner for the replica all-reduce (HSDP): per parameter, the cheapest exact strategy (dense,
    allgather, two_phase, sketch), or of every strategy with ``lossy``. ``options``:
    :class:`lossless_hc.training.auto.AutoSpec`. ``register(reduce_scatter=True)``: the exact sparse
    reduce-scatter (module doc), which the plan leaves alone and the step guard checks (below).
    ``stats()["plan"]``: per parameter, the chosen strategy, predicted and measured seconds, bytes sent.

    ``guard_steps``, ``guard_start``, ``guard_margin``: the step guard (:mod:`lossless_hc.training.guard`,
    as DDP's ``AutoHookState``; 0 steps: none). A step begins at the all-reduce hook that ran first in
    the first step (FSDP2 reduces its parameter groups in the same order every step), and a step's time
    is the interval between consecutive such calls. Once some parameter's plan is not dense (from step
    index ``guard_start``), ``guard_steps`` timed steps of the plans alternate with as many steps in which
    every hook all-reduces its shard in place across the replicas (what uncompressed HSDP does; with
    ``lossy``, a float32 shard in bfloat16 where bf16 is among the strategies, as
    ``MixedPrecisionPolicy(reduce_dtype=torch.bfloat16)`` reduces it; in blocks of two
    steps, the second timed; as many more of each confirm a first look for the plans, unless it found them
    twice as fast); unless the plans' median step is ``guard_margin`` faster, every shard is all-reduced
    so from then on (THC's and top-k's error feedback added to the first such step's shard). The verdict is
    the replicate group's rank 0's, broadcast on that group (blocking, from the first hook of the step
    after the trial, which every rank of the group reaches at the same step count); each replicate
    group (one per shard index) decides for its own collectives. With the sparse reduce-scatter (on a
    shard group of 2 or more ranks) a step begins at the first hook of either seam, the trial opens at
    ``guard_start`` (the exchange is always worth checking), its dense window is FSDP2's own
    collectives (the reduce-scatter, each parameter in the dtype the exchange sends it whole in --
    with ``lossy``, what ``MixedPrecisionPolicy(reduce_dtype=torch.bfloat16)`` sends for the large ones,
    which a dense verdict keeps -- and, with replicas, the shard all-reduced as above), and the verdict
    is the mesh's rank 0's, for every rank of the mesh (the shard groups must agree on their
    collectives); a re-plan of the replica all-reduce opens no new trial then.
    ``stats()["guard"]``: the verdict, rank 0's medians, the trials opened and how many of the replica
    all-reduce's parameters its dense window sends as each plain step (``"alternative"``). A resumed run
    (:meth:`load_state_dict`) runs a trial of its own."""

    reduce_scatter_comm = RowExchangeReduceScatter

    def __init__(self, mesh: DeviceMesh, lossy: bool = False, guard_steps: int = GUARD_STEPS,
                 guard_start: int = GUARD_START, guard_margin: float = GUARD_MARGIN, **options):
        guard = step_guard(guard_steps, guard_start, guard_margin)
        spec = AutoSpec(lossy=lossy, **options)
        spec.native_plain_dtypes = (torch.bfloat16, torch.float16)   # their own parts of the message (message.py)
        super().__init__(spec, mesh)
        self._guard = guard
        self._first_hook = None            # the hook that begins a step (the first one called)
        self._steps = 0                    # steps begun
        self._step_phase = "plan"          # what this step runs (StepGuard.phase)

    def stats(self) -> dict:
        d = super().stats()
        d["plan"] = plan_stats(self._aggregators.values())
        d["calibration"] = self.spec.calibration_stats()
        replica = [a for k, a in self._aggregators.items() if k.startswith("replicate:")]
        d["guard"] = guard_stats(self._guard, replica)
        return d

    def _narrow_dtype(self, parameter_bytes: int) -> Optional[torch.dtype]:
        """The sparse reduce-scatter's dtype for a parameter's chunks sent whole: with ``lossy`` (and bf16
        among the strategies), bfloat16 for a parameter of ``lossy_min_bytes`` or more, as FSDP2's
        ``MixedPrecisionPolicy(reduce_dtype=torch.bfloat16)`` would send it; otherwise None (as they are,
        exact)."""
        spec = self.spec
        allowed = spec.lossy and (spec.strategies is None or "bf16" in spec.strategies)
        return torch.bfloat16 if allowed and parameter_bytes >= spec.lossy_min_bytes else None

    def _row_check_intervals(self) -> tuple:
        """A module's sparse reduce-scatter's check intervals for an all-dense module (RowExchangeReduceScatter):
        the re-plan ``interval`` it starts at and returns to, and the ``max_interval`` it widens to."""
        return self.spec.interval, self.spec.max_interval

    def _checked_options(self) -> str:
        g = self._guard   # a rank without it would miss the verdict's broadcast
        return f"|guard(steps={g.steps}, start={g.start}, margin={g.margin})" if g is not None else "|no guard"

    def _phase(self, hook, now: float) -> str:
        if self._guard is None:
            return "plan"
        if self._first_hook is None:
            self._first_hook = hook
        if hook is self._first_hook:
            self._begin_step(now)
        return self._step_phase

    def _begin_step(self, now: float) -> None:
        """The first hook of a step: time the step before it, and set what this step runs (class doc)."""
        self._steps += 1
        self._step_phase = self._guard.begin_step(self._steps - 1, now, self._guarded_plans, self._share_verdict)

    def _mesh_wide(self) -> bool:
        """Whether the sparse reduce-scatter runs, and with it one trial and verdict for the whole mesh."""
        return self.reduce_scatter and self.shards > 1

    def _guarded_plans(self) -> tuple:
        """What the guard's trial checks (StepGuard.next_phase's ``plans``): the replica all-reduce's plans,
        in hook order (aggregators are created so and planned alike on every rank of a replicate group),
        or, with the sparse reduce-scatter, that one: its trial and verdict hold for the whole mesh (its
        shard groups must agree, and the replicate groups' plans differ), and cover the replica
        all-reduce's plans as they stand (a re-plan opens no new trial)."""
        if self._mesh_wide():
            return ("rows",)
        return tuple(a.strategy for a in self._aggregators.values())

    def _share_verdict(self, verdict: tuple) -> tuple:
        """Rank 0's step-guard ``verdict`` on every rank that must agree with it (blocking): the replicate
        group's, or, with the sparse reduce-scatter, the mesh's rank 0's (broadcast on every replicate
        group, then from every shard group's rank 0, which then holds the verdict of the mesh's rank 0,
        the rank 0 of its replicate group)."""
        t = torch.tensor(verdict, dtype=torch.float64, device=self._device())
        if self.replicate_group is not None:
            dist.broadcast(t, src=dist.get_global_rank(self.replicate_group, 0), group=self.replicate_group)
        if self._mesh_wide():
            dist.broadcast(t, src=dist.get_global_rank(self.shard_group, 0), group=self.shard_group)
        return tuple(t.cpu().tolist())

    def _replica_in_place(self, aggs, views, reduce_output: torch.Tensor, started: float) -> None:
        """The step guard's dense window (and a dense verdict): the shard all-reduced in place across
        the replicas, as uncompressed HSDP does, or with ``lossy`` a float32 shard in bfloat16
        (``AutoAggregator.guard_alternative``), as ``MixedPrecisionPolicy(reduce_dtype=torch.bfloat16)``
        reduces it; the aggregators sit the step out (after a dense verdict, their THC or top-k error
        feedback goes out with this step, once)."""
        if self._guard.verdict == "dense":
            for agg, view in zip(aggs, views):
                agg.add_lossy_memory_to(view)
        half = guard_half(aggs, reduce_output.dtype)
        if half is not None:   # the SUM: FSDP2 divides it afterwards (or _ReplicaAllReduce does)
            allreduce_half(reduce_output, self.replicas, self.replicate_group, half, average=False).wait()
        else:
            dist.all_reduce(reduce_output, group=self.replicate_group)
        for agg in aggs:
            agg.record_plain_step(started, half=half)

    def _after_register(self, model: torch.nn.Module) -> None:
        if self.spec.calibration is not None or self.replicate_group is None:
            return
        group, device = self.replicate_group, self._device()
        root = dist.get_global_rank(group, 0)
        # the link is timed up to the largest parameter's float32 bytes (an upper bound on its shard's)
        largest = max((4 * p.numel() for p in model.parameters()), default=0)
        self.spec.measure(lambda t: dist.all_reduce(t, group=group),
                          lambda t: all_gather_stacked(t, group, self.replicas),
                          lambda t: dist.broadcast(t, src=root, group=group), dist.get_rank(group), self.replicas,
                          device, largest_bytes=largest)
