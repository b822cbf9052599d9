"""What every DDP hook state of :mod:`lossless_hc.plugins.ddp` shares: the spec, the per-parameter
aggregators (keyed by the parameter, so they survive DDP's bucket rebuild), the configuration checks, the
per-bucket fallback groups and pickling without process groups; and the hooks' argument check."""

from typing import Optional

import torch
import torch.distributed as dist

from lossless_hc.training.adapter import AggregatorSpec
from lossless_hc.training.aggregate import AggregationStats

from lossless_hc.plugins._torch_dist import check_same_configuration, new_gloo_group


class HookState:
    """What every hook state holds: the spec, the per-parameter aggregators, the fallback groups."""

    def __init__(self, spec: AggregatorSpec, process_group: Optional[dist.ProcessGroup] = None):
        if process_group is not None:
            # dist.new_group returns GroupMember.NON_GROUP_MEMBER (an int) to the processes it leaves out
            if (isinstance(process_group, int) and process_group == dist.GroupMember.NON_GROUP_MEMBER) or (
                    isinstance(process_group, dist.ProcessGroup) and dist.get_rank(process_group) < 0):
                raise ValueError(f"this process (global rank {dist.get_rank()}) is not a member of process_group: "
                                 "pass the group DDP reduces over")
            if not isinstance(process_group, dist.ProcessGroup):
                raise TypeError(f"process_group must be a torch.distributed ProcessGroup (DDP's) or None, got "
                                f"{type(process_group).__name__}")
        self.spec = spec
        self.process_group = process_group
        self._stats = AggregationStats()
        self._aggregators: dict = {}
        self._fallback_groups: dict = {}
        self._config_checked = False
        self._restored = False     # unpickled with aggregators: checked at the first step (_check_restored)
        self._restored_hits = 0

    @property
    def world_size(self) -> int:
        return dist.get_world_size(self.process_group)

    @property
    def rank(self) -> int:
        return dist.get_rank(self.process_group)

    def stats(self) -> dict:
        """Counters over all gradients so far (see :class:`lossless_hc.training.aggregate.AggregationStats`)."""
        return self._stats.as_dict()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.spec!r})"

    def close(self) -> None:
        """Destroy the Gloo groups this state made (one per bucket that issued a collective after its
        first allreduce: fallbacks, second collectives, PowerSGD). torch keeps a group, its threads and
        sockets, until then, whatever becomes of the state: a process that trains one model after another
        gains ~3 threads and 5 descriptors per bucket and training. Call it on every rank once the
        model's last step is done (nothing in flight); a later step makes the groups again."""
        groups, self._fallback_groups = list(self._fallback_groups.values()), {}
        for group in groups:
            dist.destroy_process_group(group)

    # Process groups cannot be pickled (DDP pickles its comm-hook state with the module).
    def __getstate__(self):
        state = dict(self.__dict__)
        state["process_group"] = None
        state["_fallback_groups"] = {}
        state["_config_checked"] = False
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._restored, self._restored_hits = bool(self._aggregators), 0

    # -- helpers -------------------------------------------------------------------------------
    def _aggregator(self, p: torch.nn.Parameter, grad: torch.Tensor):
        agg = self._aggregators.get(p)
        if agg is None:
            agg = self._make(p, f"param{len(self._aggregators)}{tuple(grad.shape)}", grad)
            self._aggregators[p] = agg
        elif self._restored:
            self._restored_hits += 1
        return agg

    def _check_restored(self, is_last: bool) -> None:
        """A state unpickled with aggregators keys them by the parameters pickled with it: with its DDP
        model (``torch.save(ddp_model)``) they are the model's own. Unpickled apart from the model, none
        matches, and every parameter would silently start afresh (error feedback, capacities lost): at
        the first step's last bucket, ``ValueError`` on every rank (whether any matched is compared first)."""
        if not (self._restored and is_last):
            return
        self._restored = False
        matched = self._restored_hits > 0
        check_same_configuration(f"restored aggregators matched: {matched}", self.process_group,
                                 f"{type(self).__name__} restored")
        if not matched:
            raise ValueError(f"this {type(self).__name__} was unpickled apart from its DDP model: its aggregators "
                             "belong to parameters this model does not have; save and load the DDP model itself "
                             "(torch.save(ddp_model)), which holds its hook state, or build a new state")

    def _make(self, p: torch.nn.Parameter, name: str, grad: torch.Tensor):
        return self.spec.make(name, grad, self.world_size, self.rank, self._stats, grad.device)

    def _check_configuration(self) -> None:
        """Refuse to run when ranks were configured differently (payload sizes would not match):
        :func:`check_same_configuration`, on the first call, from the main thread."""
        self._config_checked = True
        n = self.world_size
        built = sorted({a.world_size for a in self._aggregators.values()} - {n})
        if built:   # a state restored at another world size: every payload would fit none of this group's
            raise ValueError(f"this {type(self).__name__}'s aggregators were built for world size {built[0]}, this "
                             f"process group has {n}: build a new state for a new world size")
        cfg = f"{self.world_size}|{self!r}"
        check_same_configuration(cfg, self.process_group, type(self).__name__)

    def _check_bucket(self, params, is_last: bool) -> None:
        """Per-parameter options that ranks must share beyond :meth:`_check_configuration` (none here);
        ``is_last``: the bucket is the step's last (DDP's ``GradBucket.is_last``)."""

    def _fallback_group(self, bucket_index: int):
        group = self._fallback_groups.get(bucket_index)
        if group is None:
            group = self._fallback_groups[bucket_index] = new_gloo_group(self.process_group)
        return group


def require_arguments(state, bucket, kind: type, hook: str) -> None:
    """The argument check every hook of :mod:`lossless_hc.plugins.ddp` starts with: a TypeError naming
    ``hook`` unless ``state`` is a ``kind`` and ``bucket`` DDP's ``GradBucket``."""
    if not isinstance(state, kind):
        raise TypeError(f"{hook} needs a {kind.__name__}, got {type(state).__name__}")
    if not isinstance(bucket, dist.GradBucket):
        # Compiled autograd's python_reducer calls each hook per parameter with (grad, param), to trace it
        # into the backward graph; these hooks run host code on DDP's buckets.
        raise TypeError(f"{hook} takes DDP's GradBucket, got {type(bucket).__name__}: compiled autograd's "
                        "python_reducer (torch._dynamo.config.optimize_ddp = 'python_reducer') calls comm hooks "
                        "per parameter, to be traced; use torch.compile with optimize_ddp's default "
                        "('ddp_optimizer'), whose buckets reach the hook as they do eagerly")
