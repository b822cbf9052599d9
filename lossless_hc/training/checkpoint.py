"""Checkpointing an aggregator's state, so that a resumed run continues bit-identically.

What an aggregator (:mod:`lossless_hc.training.aggregate`) carries from step to step, and what
:func:`aggregator_state_dict` therefore saves:

* :class:`~lossless_hc.training.aggregate.TensorAggregator`: the capacity and the union capacity
  (they size the codec: payload shapes and which tensors are compressed) and, with a
  :class:`~lossless_hc.training.capacity.CapacityPolicy`, the density tracker (its averages, peaks,
  step count and history);
* :class:`~lossless_hc.training.topk_aggregate.TopKAggregator`: the above and the error-feedback residual;
* :class:`~lossless_hc.training.thc_aggregate.THCAggregator`: the codec's step, agreed norm and error memory;
* :class:`~lossless_hc.training.strategies.AutoAggregator` (``auto``): the plan (strategy, statistics,
  the sketch's sizing) and the lossy strategies' error feedback.

The result holds only Python numbers and CPU tensors (``torch.save`` with ``weights_only=True``
loads it). :func:`load_aggregator_state_dict` restores it into an aggregator of the same kind, shape
and dtype (with the same capacity policy, and for THC compressing or not alike; for ``auto`` a saved
strategy the aggregator allows) and raises ``ValueError`` otherwise; other options (world size,
seed, index, bits, ratio) are not compared: the state is restored as saved.
"""
from __future__ import annotations

import torch

from lossless_hc.training.topk_aggregate import TopKAggregator
from lossless_hc.training.capacity import DensityTracker
from lossless_hc.training.plan_stats import TensorStats
from lossless_hc.training.plan_tracker import restored_interval
from lossless_hc.training.thc_aggregate import THCAggregator
from lossless_hc.training.strategies import AutoAggregator

_TRACKER_FIELDS = ("steps", "union", "per_rank", "peak_union", "peak_rank")
_AUTO_TRACKER_FIELDS = ("steps", "rank_keys", "union", "peak_rank", "force", "last_step", "reaggregated",
                        "current_interval")


def _kind(agg) -> str:
    if isinstance(agg, THCAggregator):
        return "thc"
    return "topk" if isinstance(agg, TopKAggregator) else "lossless"


def aggregator_state_dict(agg) -> dict:
    """The state ``agg`` carries between steps (see the module doc)."""
    if isinstance(agg, AutoAggregator):
        return _auto_state_dict(agg)
    state = {"kind": _kind(agg), "shape": list(agg.shape), "dtype": str(agg.dtype)}
    if isinstance(agg, THCAggregator):
        codec = agg.codec
        if codec is not None:
            state["codec"] = {k: (v.detach().cpu().clone() if isinstance(v, torch.Tensor) else v)
                              for k, v in codec.state_dict().items()}
        return state
    state["capacity"] = int(agg.capacity)
    state["union_capacity"] = None if agg.union_capacity is None else int(agg.union_capacity)
    tracker: DensityTracker = agg.tracker
    if tracker is not None:
        state["tracker"] = {f: getattr(tracker, f) for f in _TRACKER_FIELDS}
        state["tracker"]["history"] = [list(h) for h in tracker.history]
        state["tracker"]["rebuilds"] = tracker.rebuilds
        state["tracker"]["skew"] = tracker.skew
    if isinstance(agg, TopKAggregator):
        state["residual"] = None if agg.residual is None else agg.residual.detach().cpu().clone()
    return state


def load_aggregator_state_dict(agg, state: dict) -> None:
    """Restore :func:`aggregator_state_dict`'s ``state`` into ``agg`` (same configuration)."""
    if isinstance(agg, AutoAggregator):
        _load_auto_state_dict(agg, state)
        return
    expected = (_kind(agg), list(agg.shape), str(agg.dtype))
    got = (state.get("kind"), list(state.get("shape", [])), state.get("dtype"))
    if got != expected:
        raise ValueError(f"{agg.name}: the saved state is for a {got[0]} aggregator of {got[2]} {got[1]}, this one is "
                         f"a {expected[0]} aggregator of {expected[2]} {expected[1]}")
    if isinstance(agg, THCAggregator):
        if ("codec" in state) != (agg.codec is not None):
            raise ValueError(f"{agg.name}: the saved state and this aggregator disagree on whether THC compresses it")
        if agg.codec is not None:
            device = agg.codec.device
            agg.codec.load_state_dict({k: (v.to(device) if isinstance(v, torch.Tensor) else v)
                                       for k, v in state["codec"].items()})
        return
    if ("tracker" in state) != (agg.tracker is not None):
        raise ValueError(f"{agg.name}: the saved state and this aggregator disagree on the capacity policy")
    _require(agg, state, ("capacity", "union_capacity") + (("residual",) if isinstance(agg, TopKAggregator) else ()))
    if isinstance(agg, TopKAggregator):
        _check_residual(agg, state["residual"], "residual")
    agg.capacity = int(state["capacity"])
    agg.union_capacity = state["union_capacity"]
    if agg.tracker is not None:
        for f in _TRACKER_FIELDS:
            setattr(agg.tracker, f, state["tracker"][f])
        agg.tracker.history = [tuple(h) for h in state["tracker"]["history"]]
        # checkpoints before the count kept every rebuild in the history
        agg.tracker.rebuilds = int(state["tracker"].get("rebuilds", len(agg.tracker.history)))
        agg.tracker.skew = float(state["tracker"].get("skew", 1.0))   # checkpoints before the skew: none learnt
    agg._decide_codec()   # the codec is a pure function of the configuration and the capacities
    if isinstance(agg, TopKAggregator):
        residual = state["residual"]
        agg.residual = None if residual is None else _restored(residual, agg.device)


def _check_residual(agg, residual, key: str) -> None:
    """``ValueError`` unless a saved top-k residual is None or a real tensor of the aggregator's numel (one
    of another size was broadcast into the next step's sum), before anything is restored."""
    if residual is None:
        return
    if not isinstance(residual, torch.Tensor) or not residual.is_floating_point() or residual.numel() != agg.numel:
        raise ValueError(f"{agg.name}: the saved {key} is not a real tensor of {agg.numel} elements, got "
                         f"{getattr(residual, 'dtype', type(residual).__name__)} of "
                         f"{getattr(residual, 'numel', lambda: '?')()}")


def _restored(residual: torch.Tensor, device) -> torch.Tensor:
    """A saved residual as the aggregator keeps it: flat float32 on its device, its own memory holding its
    values (the kernels read the residual's memory)."""
    return residual.reshape(-1).to(device, torch.float32).resolve_neg().clone()


def _require(agg, state: dict, keys) -> None:
    """``ValueError`` naming what a truncated state lacks, before anything is restored from it."""
    missing = [k for k in keys if k not in state]
    if missing:
        raise ValueError(f"{agg.name}: the saved state lacks {', '.join(missing)} (truncated, or not a state_dict())")


def _auto_state_dict(agg: AutoAggregator) -> dict:
    """An ``auto`` aggregator's plan (strategy, statistics, the sketch's sizing) and the lossy
    strategies' error feedback; Python numbers and CPU tensors."""
    sk = agg._sketch_stats
    thc = agg._thc.codec if agg._thc is not None else None
    return {"kind": "auto", "shape": list(agg.shape), "dtype": str(agg.dtype), "strategy": agg.strategy,
            "history": [list(h) for h in agg.history], "steps": agg.steps, "plan_due": agg._plan_due,
            "tracker": {f: getattr(agg.tracker, f) for f in _AUTO_TRACKER_FIELDS},
            "sketch_stats": None if sk is None else [sk.numel, sk.row, sk.world_size, list(sk.rank_keys),
                                                     sk.union_keys, sk.element_bytes],
            "topk_residual": None if agg._topk is None or agg._topk.residual is None
            else agg._topk.residual.detach().cpu().clone(),
            "thc": None if thc is None else {k: (v.detach().cpu().clone() if isinstance(v, torch.Tensor) else v)
                                             for k, v in thc.state_dict().items()}}


def _load_auto_state_dict(agg: AutoAggregator, state: dict) -> None:
    """Restore :func:`_auto_state_dict` into an ``auto`` aggregator built with the same configuration."""
    got = (state.get("kind"), list(state.get("shape", [])), state.get("dtype"))
    if got != ("auto", list(agg.shape), str(agg.dtype)):
        raise ValueError(f"{agg.name}: the saved state is for a {got[0]} aggregator of {got[2]} {got[1]}, "
                         f"this one is an auto aggregator of {agg.dtype} {list(agg.shape)}")
    _require(agg, state, ("strategy", "history", "steps", "tracker", "sketch_stats", "topk_residual", "thc"))
    if state["strategy"] not in agg.allowed:
        raise ValueError(f"{agg.name}: the saved strategy {state['strategy']!r} is not allowed here ({agg.allowed})")
    _check_residual(agg, state["topk_residual"], "topk_residual")
    agg.strategy, agg.steps = state["strategy"], int(state["steps"])
    agg._plan_due = bool(state.get("plan_due", False))
    agg.history = [tuple(h) for h in state["history"]]
    saved = dict(state["tracker"])
    saved.setdefault("last_step", saved["steps"])   # states saved before it existed observed every step
    saved["reaggregated"] = dict(saved.get("reaggregated", {}))   # ... or before it: none observed
    # ... or before it: never widened; and a widened interval this aggregator's schedule cannot have (saved
    # with another interval or a larger max_interval) starts again from its interval
    t = agg.tracker
    saved["current_interval"] = restored_interval(saved.get("current_interval"), t.interval, t.max_interval)
    for f in _AUTO_TRACKER_FIELDS:
        setattr(agg.tracker, f, saved[f])
    # Saved as None: not built yet, so none here either (an aggregator that trained since keeps nothing).
    agg._sketch_stats = agg._codec = agg._topk = agg._thc = None
    if state["sketch_stats"] is not None:
        numel, row, n, ranks, union, eb = state["sketch_stats"]
        agg._size_sketch(TensorStats(numel, row, n, tuple(ranks), union, eb))
    if state["topk_residual"] is not None:
        agg.topk_aggregator().residual = _restored(state["topk_residual"], agg.device)
    if state["thc"] is not None:
        agg.thc_aggregator().codec.load_state_dict(state["thc"])
