"""torch.distributed adapter: a DDP communication hook.

    from lossless_hc.plugins.ddp import LosslessHookState, lossless_hook
    state = LosslessHookState(process_group=None, max_density=0.01)   # or topk_ratio=0.01
    ddp_model.register_comm_hook(state, lossless_hook)
    # dense models, lossy but unbiased: LosslessHookState(codec="thc", bits=4) with thc_hook
    ...
    state.stats()

For each gradient bucket the hook encodes every parameter's gradient separately (each parameter has
its own :class:`~lossless_hc.aggregate.TensorAggregator`, keyed by the parameter itself, so state
survives DDP's bucket rebuild), concatenates the payloads into one float32 message, allreduces it
with SUM, decodes each segment and returns the averaged bucket, as DDP expects.

Fallback without mismatched collectives: a segment that fails to decode is re-aggregated densely from
the future's callback, which may run on a communication thread while the main thread issues the next
bucket's allreduce. Issued on the main process group, the two could reach ranks in different orders
and be paired wrongly. So each bucket index gets its own fallback process group, created in the hook
(on the main thread, in bucket order on every rank); on it, collectives are issued one step at a
time, and every rank issues the same ones because every rank decodes the same aggregate.
"""

import hashlib
import math
from typing import Optional

import torch
import torch.distributed as dist

from lossless_hc.aggregate import (AggregationStats, CapacityPolicy, ConfigurationMismatch, TensorAggregator,
                                   THCAggregator, TopKAggregator)


class LosslessHookState:
    """State of :func:`lossless_hook` (one per DDP model).

    Args:
        process_group: the group DDP reduces over (None: the default group).
        max_density: each rank may send this fraction of a gradient's coordinates before that
            gradient falls back to dense (and its capacity grows). For naturally sparse gradients.
        topk_ratio: if set, top-k sparsification with error feedback (for dense models) instead of
            sending gradients as they are; ``max_density`` is then unused.
        block_size: coordinates hashed as one key; None: a 2-D gradient's row length, else 1.
        seed: hash seed, identical on every rank.
        index: the codec's index kind ("auto" picks the smallest payload).
        codec: "lossless" (default: the gradients, or their top-k, aggregated exactly) or "thc"
            (THC quantization with ``bits``, ``granularity``, ``overflow_freq``; see THCCodec).
        policy: a :class:`lossless_hc.aggregate.CapacityPolicy` adapting each gradient's capacity
            and index to the densities its aggregates show (None: fixed ``max_density``).
    """

    def __init__(self, process_group: Optional[dist.ProcessGroup] = None, max_density: float = 0.01,
                 topk_ratio: Optional[float] = None, block_size: Optional[int] = None, seed: int = 0,
                 index: str = "auto", codec: str = "lossless", bits: int = 4, granularity: int = 30,
                 overflow_freq: float = 32, policy: Optional[CapacityPolicy] = None):
        if codec not in ("lossless", "thc"):
            raise ValueError(f"codec must be 'lossless' or 'thc', got {codec!r}")
        if not 0.0 < max_density <= 1.0:
            raise ValueError(f"max_density must be in (0, 1], got {max_density}")
        if topk_ratio is not None and not 0.0 < topk_ratio <= 1.0:
            raise ValueError(f"topk_ratio must be in (0, 1], got {topk_ratio}")
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.rank = dist.get_rank(process_group)
        self.codec = codec
        self.thc_options = dict(bits=bits, granularity=granularity, overflow_freq=overflow_freq)
        self.max_density = max_density
        self.topk_ratio = topk_ratio
        self.block_size = block_size
        self.seed = seed
        self.index = index
        self.policy = policy
        self._stats = AggregationStats()
        self._aggregators: dict = {}
        self._fallback_groups: dict = {}
        self._config_checked = False

    def stats(self) -> dict:
        """Counters over all gradients so far (see :class:`lossless_hc.aggregate.AggregationStats`)."""
        return self._stats.as_dict()

    # -- helpers -------------------------------------------------------------------------------
    def _aggregator(self, p: torch.nn.Parameter, grad: torch.Tensor) -> TensorAggregator:
        agg = self._aggregators.get(p)
        if agg is None:
            name = f"param{len(self._aggregators)}{tuple(grad.shape)}"
            if self.codec == "thc":
                agg = THCAggregator(name, grad.shape, grad.dtype, self.world_size, self.rank, seed=self.seed,
                                    stats=self._stats, **self.thc_options)
            elif self.topk_ratio is not None:
                agg = TopKAggregator(name, grad.shape, grad.dtype, self.world_size, self.topk_ratio,
                                     seed=self.seed, index=self.index, stats=self._stats, policy=self.policy)
            else:
                agg = TensorAggregator(name, grad.shape, grad.dtype, self.world_size, self.max_density,
                                       block_size=self.block_size, seed=self.seed, index=self.index,
                                       stats=self._stats, policy=self.policy)
            self._aggregators[p] = agg
        return agg

    def _check_configuration(self) -> None:
        """Refuse to run when ranks were configured differently (payload sizes would not match).

        One blocking MAX allreduce of (h, -h) for a hash h of the configuration, on the first call,
        from the main thread: all ranks agree iff both maxima equal their own values."""
        self._config_checked = True
        cfg = (f"{self.world_size}|{self.max_density!r}|{self.topk_ratio!r}|{self.block_size}|{self.seed}|{self.index}|"
               f"{self.codec}|{sorted(self.thc_options.items())}|{self.policy!r}")
        h = int.from_bytes(hashlib.sha256(cfg.encode()).digest()[:6], "little")
        t = torch.tensor([h, -h], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.process_group)
        if t.tolist() != [h, -h]:
            raise ConfigurationMismatch("LosslessHookState differs across ranks (world size, max_density, "
                                        f"topk_ratio, block_size, seed, index or codec options); this rank has {cfg}")

    def _fallback_group(self, bucket_index: int):
        group = self._fallback_groups.get(bucket_index)
        if group is None:
            ranks = dist.get_process_group_ranks(self.process_group or dist.group.WORLD)
            group = dist.new_group(ranks=ranks, backend="gloo", use_local_synchronization=True)
            self._fallback_groups[bucket_index] = group
        return group


def lossless_hook(state: LosslessHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: lossless (or top-k + lossless) aggregation of one bucket.

    Returns a future of the bucket's averaged gradients (same shape as ``bucket.buffer()``). The
    average equals DDP's default allreduce up to float rounding of the sum; top-k averages the
    ranks' selected values (the rest stays in each rank's error feedback).
    """
    buffer = bucket.buffer()
    if buffer.is_sparse:
        raise TypeError("lossless_hook got a sparse gradient bucket; use dense gradients (nn.Embedding(sparse=False))")
    if not state._config_checked:
        state._check_configuration()
    fallback_group = state._fallback_group(bucket.index())
    aggs = [state._aggregator(p, g) for p, g in zip(bucket.parameters(), bucket.gradients())]
    encoded = [agg.encode(g) for agg, g in zip(aggs, bucket.gradients())]
    # One message per bucket, in the widest payload dtype (THC's float64 words must stay exact; float32
    # payloads widen exactly and sum at least as accurately).
    wide = torch.float64 if any(p.dtype == torch.float64 for p, _ in encoded) else torch.float32
    message = torch.cat([payload.reshape(-1).to(wide) for payload, _ in encoded])
    n = state.world_size
    fut = dist.all_reduce(message, group=state.process_group, async_op=True).get_future()

    def decode(fut: torch.futures.Future) -> torch.Tensor:
        summed = fut.value()[0]
        results, failed, outcomes = [], [], []
        offset = 0
        for agg, (payload, ctx) in zip(aggs, encoded):
            segment = summed[offset:offset + payload.numel()].to(payload.dtype)
            offset += payload.numel()
            outcome = agg.decode(segment, ctx)
            outcomes.append(outcome)
            results.append(outcome.value)
            if outcome.needs_fallback:
                failed.append(len(results) - 1)
        if failed:
            dense = torch.cat([encoded[i][1].dense_value.reshape(-1).to(torch.float32) for i in failed])
            dist.all_reduce(dense, group=fallback_group)
            offset = 0
            for i in failed:
                m = math.prod(encoded[i][1].shape)
                results[i] = aggs[i].finish_fallback(dense[offset:offset + m], outcomes[i])
                offset += m
        offset = 0
        for value in results:
            m = value.numel()
            buffer[offset:offset + m].copy_(value.reshape(-1)).div_(n)
            offset += m
        return buffer

    return fut.then(decode)


def thc_hook(state: LosslessHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook for THC: :func:`lossless_hook` with a state built with ``codec="thc"``."""
    if state.codec != "thc":
        raise ValueError("thc_hook needs LosslessHookState(codec='thc', ...)")
    return lossless_hook(state, bucket)
