"""What the planner knows about one tensor (:class:`TensorStats`) and the sizes its cost model
(:mod:`lossless_hc.training.planner`) derives from it: the statistics header every first payload starts
with, the two-phase counting bitmap, the sketch's capacities and payload, and the coordinates a sketch or
top-k plan is priced to re-aggregate before it ran on the tensor (the formulas: the planner's module doc)."""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Optional

import torch

from lossless_hc.lhc.cost_model import plan_layout
from lossless_hc.lhc.layout import digit_packing
from lossless_hc.lhc.layout import is_real as _is_real
from lossless_hc.training.topk_aggregate import topk_count

# A first payload's dtype by its width (predict_message): the stats know a gradient's width only.
WIRE_DTYPES = {1: torch.float8_e4m3fn, 2: torch.bfloat16, 4: torch.float32, 8: torch.float64}

RANK_HEADROOM = 1.5     # the sketch's per-rank capacity over the observed largest per-rank count
UNION_HEADROOM = 1.25   # ... and its union capacity over the observed union
# The share of the union's coordinates (top-k: of its selections) a sketch (top-k) plan's inexact-key request is
# priced to re-aggregate per step before the plan has run on the tensor (reaggregated_prior): about the most measured
# (1.01%, rows of 32 at 8 ranks; 0.19-0.91% elsewhere with 1% of the rows per rank, rows of 1 to 128, 2 to 8 ranks:
# docs/BENCHMARKS.md, "Inexact keys in training").
REAGGREGATED_SHARE = 0.01


def finite_nonnegative(value) -> bool:
    """Whether ``value`` is a real number in [0, inf): a cost, a latency or a count (NaN fails)."""
    return _is_real(value) and 0.0 <= value < math.inf


@dataclass(frozen=True)
class TensorStats:
    """What the planner knows about one tensor: ``numel`` coordinates in rows of ``row``,
    ``rank_keys[r]`` non-zero rows on rank r (``world_size`` entries), ``union_keys`` rows non-zero
    on some rank, ``element_bytes`` per value on the wire (4: float32); ``sparse``: the gradient
    arrives as a sparse tensor of its rows (the planner's module doc); ``sketch_reaggregated``, ``topk_reaggregated``:
    the coordinates a sketch (top-k) plan's request of its decode's inexact keys re-aggregated per step on
    this tensor (None: the plan has not run on it, :func:`reaggregated_prior` prices it)."""

    numel: int
    row: int
    world_size: int
    rank_keys: tuple
    union_keys: int
    element_bytes: int = 4
    sparse: bool = False
    sketch_reaggregated: Optional[int] = None
    topk_reaggregated: Optional[int] = None

    def __post_init__(self):
        if self.numel < 0 or self.row < 1 or self.world_size < 1:
            raise ValueError(f"bad TensorStats: numel={self.numel}, row={self.row}, world_size={self.world_size}")
        if len(self.rank_keys) != self.world_size:
            raise ValueError(f"rank_keys has {len(self.rank_keys)} entries for world_size {self.world_size}")
        # counts of rows: a negative one priced its rows' bytes below zero (an allgather of (-5,) * 4 rows
        # cheaper than one of none), a NaN fails deep in the pricing
        counts = [("rank_keys", k) for k in self.rank_keys] + [("union_keys", self.union_keys)]
        counts += [(f, getattr(self, f)) for f in ("sketch_reaggregated", "topk_reaggregated")
                   if getattr(self, f) is not None]
        for what, count in counts:
            if not finite_nonnegative(count):
                raise ValueError(f"bad TensorStats: {what} must be counts >= 0, got {count!r}")
        if self.element_bytes not in WIRE_DTYPES:
            raise ValueError(f"bad TensorStats: element_bytes={self.element_bytes}, "
                             f"expected one of {sorted(WIRE_DTYPES)}")

    @property
    def keys(self) -> int:
        return -(-self.numel // self.row)

    @property
    def max_rank_keys(self) -> int:
        return int(max(self.rank_keys)) if self.rank_keys else 0


COUNT_FIELD_BITS = 21   # a per-rank count is sent as two fields: its low 21 bits, and the rest


def stats_header_words(world_size: int) -> int:
    """Words of the statistics header every first payload starts with: contributors + 2 per rank."""
    return 1 + 2 * int(world_size)


def header_width(strategy: str, s: "TensorStats") -> int:
    """Bytes of one statistics-header word: the header takes its first payload's dtype
    (``AutoAggregator.encode``), float64 for ``thc`` and for every header-only or dense payload of a
    float64 gradient (``element_bytes`` 8), float32 otherwise (a half-precision count field would not be
    exact; a dense half-precision body travels apart from its header, :meth:`CostModel.predict_message`)."""
    if strategy == "thc" or (s.element_bytes == 8 and strategy in ("dense", "allgather")):
        return 8
    return 4


def bitmap_words(keys: int, world_size: int) -> int:
    """Float32 words of the two-phase counting bitmap: ``keys`` digits of base n+1."""
    return digit_packing(world_size, keys).words if keys else 0


def sketch_capacity(stats: TensorStats) -> tuple:
    """``(per-rank capacity, union capacity)`` in coordinates the sketch is sized with for ``stats``."""
    b, D = stats.row, stats.keys
    rank = min(D, max(1, math.ceil(RANK_HEADROOM * stats.max_rank_keys)))
    union = min(D, max(rank, math.ceil(UNION_HEADROOM * max(stats.union_keys, stats.max_rank_keys))))
    return min(stats.numel, rank * b), min(stats.numel, union * b)


@functools.lru_cache(maxsize=4096)
def layout_words(numel: int, world_size: int, max_nnz: int, row: int, seed: int, union: int) -> int:
    # plan_layout searches the index kinds and multi-level shapes (~5 ms of Python for a 1.6M-coordinate
    # table); a tensor re-planned on steady statistics, and top-k's fixed k, ask for the same layout again.
    return plan_layout(numel, world_size, max_nnz, row, seed, union_nnz=union).payload_numel


def sketch_payload_numel(stats: TensorStats, seed: int = 0) -> int:
    """Float32 words of the LHC payload sized for ``stats`` (the real layout). At least the union
    capacity ``sketch_capacity(stats)[1]``: the value sketch's cells are linear equations from which the
    union's values are recovered, one unknown per coordinate (tests/test_planner_cost.py checks it)."""
    cap, union = sketch_capacity(stats)
    return layout_words(stats.numel, stats.world_size, cap, stats.row, seed, union)


def reaggregated_prior(strategy: str, s: TensorStats, topk_ratio: float) -> int:
    """Coordinates a ``sketch`` or ``topk`` plan's request of its decode's inexact keys is priced to
    re-aggregate per step where it has not run on the tensor yet (``TensorStats.sketch_reaggregated``,
    ``topk_reaggregated`` None): :data:`REAGGREGATED_SHARE` (1%) of the union's ``u b`` coordinates (top-k:
    of its ``min(n k, d)`` selected coordinates), rounded up. The request sends only the listed keys'
    coordinates that their bounds do not prove (:func:`~lossless_hc.lhc.contract.unproven_coordinates`): a
    share that hardly depends on the rows' width, unlike the share of rows listed (docs/BENCHMARKS.md,
    "Inexact keys in training"; measured with the default ``rtol``, 2^-10: a looser one proves more)."""
    if strategy == "topk":   # its keys are coordinates, whatever the tensor's rows
        return math.ceil(REAGGREGATED_SHARE * min(s.numel, s.world_size * topk_count(s.numel, topk_ratio)))
    if strategy != "sketch":
        raise ValueError(f"only sketch and topk plans re-aggregate inexact keys, not {strategy!r}")
    return min(s.numel, math.ceil(REAGGREGATED_SHARE * s.union_keys * s.row))
