r"""The per-tensor aggregation planner: a cost model over every strategy, and the choice.

Pure functions of their arguments (no collectives, no clocks): every rank evaluates them on the same
calibration (decided on rank 0 and broadcast, :mod:`lossless_hc.training.calibration`) and the same
aggregated statistics, so every rank takes the same decision at the same step. The strategies'
mechanics are :mod:`lossless_hc.training.strategies`; this module only prices them.

Strategies. Exact ones (the aggregate equals the dense sum up to float rounding; the sketch's within
the exactness contract, :mod:`lossless_hc.lhc.contract`, its unproven keys re-aggregated densely)::

    dense      allreduce the tensor
    allgather  allgather (row index, row values) of each rank's non-zero rows, padded to the largest
               rank's count (what DDP/Gloo and Horovod do for sparse gradients)
    two_phase  allreduce a counting bitmap of the rows (phase 1), then allreduce the values compacted
               onto the union of the supports (phase 2); no peeling
    sketch     the LHC one-pass codec (index and sizes from lossless_hc.lhc.cost_model.plan_layout)

and, only when the user allows loss, ``fp16``, ``bf16`` (the tensor allreduced in half precision),
``thc`` (THC quantization, error feedback), ``topk`` (top-k with error feedback, the selections
aggregated exactly by the sketch) and ``topk_allgather`` (the same selection and error feedback, each rank's
(index, value) pairs allgathered and summed: fewer bytes than the sketch's at a few ranks, ``n`` times
more at ``n``; the two share one error-feedback memory).

Every strategy's first collective is a SUM allreduce of a payload that starts with the statistics
header of ``1 + 2n`` words in the payload's dtype (float32; float64 for ``thc`` and float64 gradients,
:func:`~lossless_hc.training.plan_stats.header_width`): a contributor count (1 per rank: SUM gives n,
AVERAGE gives 1) and a one-hot slot vector in which rank r writes its non-zero row count ``k_r`` as two exact integer
fields, ``k_r mod 2^21`` and ``floor(k_r / 2^21)`` (each below 2^22, so an AVERAGE is invertible). So every rank learns
``k_0..k_{n-1}`` from every step of every strategy but the plain steps of a dense, fp16 or bf16 plan
(:data:`PLAIN_STRATEGIES`: such a plan carries the header on one step in ``interval`` (a dense plan that
:func:`dense_dominates`: on fewer, down to one in ``max_interval``), each followed by a re-plan, and between
them sends the bare tensor, in half precision for fp16 and bf16, as the engine's own hooks do:
``AutoAggregator.carries_statistics``) and the steps of a THC or top-k plan between those
same statistics steps (their header rides on every step, its counts zeros there, no rows scanned); the
union ``u`` (rows non-zero on some rank) comes
from the decoded aggregate (dense: its non-zero rows; allgather: the gathered indices; two_phase: the
bitmap; sketch: the decode report).

The cost model. A tensor of ``d`` coordinates in rows (keys) of ``b`` coordinates (``D = ceil(d/b)``
keys), ``n`` ranks, per-rank key counts ``k_r`` (``K = max k_r``), union ``u`` keys, ``e`` bytes per
value. Links: latency ``alpha`` and seconds per byte ``beta`` (allreduce), ``beta_g`` (allgather) and
``beta_h`` (allreduce of a float16 or bfloat16 tensor) (:class:`LinkModel`), ring collectives::

    allreduce(B) = 2(n-1) alpha + 2(n-1)/n B beta          (B: bytes each rank contributes; beta_h for half)
    allgather(B) =  (n-1) alpha +  (n-1)   B beta_g        (B: bytes each rank contributes)

Wire bytes each rank contributes (:meth:`CostModel.wire_bytes`), with ``H = w(1+2n)`` header bytes
(``w``: 4, or 8 where :func:`~lossless_hc.training.plan_stats.header_width` says)::

    dense      allreduce(H + d e)
    allgather  allreduce(H) + allgather(K (4 + 4 b))                 (int32 index + float32 row per slot)
    two_phase  allreduce(H + 4 ceil(D / q)) + allreduce(4 u b)      (q digits of base n+1 per word,
                                                                     lossless_hc.lhc.layout.digit_packing)
    sketch     allreduce(H + 4 L)       L = plan_layout(d, n, h_K K b, b, union = h_U u b).payload_numel
               + allreduce(4 R_s)       R: the inexact keys' coordinates re-aggregated per step (below)
    fp16/bf16  allreduce_half(2 d)                                    (a plain step: the tensor in half precision)
    thc        allreduce(H + 8 THC payload words)                   (lossless_hc.thc.layout)
    topk       allreduce(H + 4 L)       L sized for k = ceil(r d) per rank and min(n k, d) in the union
               + allreduce(4 R_t)
    topk_allgather  allreduce(H) + allgather(8 k)                 (int32 index + float32 value per pair)

(``h_K`` = :data:`~lossless_hc.training.plan_stats.RANK_HEADROOM`, ``h_U`` =
:data:`~lossless_hc.training.plan_stats.UNION_HEADROOM`: the margins the sketch is sized with over the
observed counts, the same numbers :mod:`lossless_hc.training.strategies` builds it with. The plans with
plain steps are priced at them, dense with its header's few bytes: their statistics steps, one in
``interval``, add a scan and, for fp16 and bf16, the header's round trip before the body's.)
A sketch (top-k) decode reports inexact keys (proven bounds above ``rtol``: :mod:`lossless_hc.lhc.contract`)
at nearly every step, and the plan re-aggregates the coordinates of theirs that the bounds do not prove
(:func:`~lossless_hc.lhc.contract.unproven_coordinates`) with one more allreduce: ``R`` is the EWMA of the
coordinates it re-aggregated per step on this tensor (``TensorStats.sketch_reaggregated``,
``topk_reaggregated``: from :meth:`~lossless_hc.training.plan_tracker.PlanTracker.observe_reaggregated`, the
plan's dense fallback for inexactness counting the tensor), or, before the plan has run on it,
:func:`~lossless_hc.training.plan_stats.reaggregated_prior`, 1% of the union's coordinates. It is priced as
issued every step wherever ``R > 0``, as it was measured, and batched as two_phase's second allreduce is.
The predicted time is the sum of the collectives' times plus the local work,
``c_s d + k_s m_s b`` from ``Calibration.codec_seconds[s] = (c_s, k_s)``: per coordinate of the
tensor and per coordinate of the rows the strategy touches (``m``: ``n K`` gathered rows for
allgather, ``u`` for two_phase and sketch, 0 otherwise; topk and topk_allgather select coordinates, not
rows, so their term is ``k_s n ceil(r d)`` whatever ``b``). :meth:`CostModel.choose` returns the
cheapest (ties: the order of :data:`EXACT_STRATEGIES` then :data:`LOSSY_STRATEGIES`), and a re-plan
keeps the strategy in use unless the cheapest is predicted more than :data:`SWITCH_MARGIN` (20%) faster, beyond
the first allreduce's latency that every strategy pays alike.

Sparse gradients (``TensorStats.sparse``: a ``torch.sparse_coo`` gradient, e.g.
``nn.Embedding(sparse=True)`` under DDP). The rank already holds its rows (index and values), so no
strategy scans the tensor, and the result is a sparse tensor of the union's rows. The strategies that
work on the dense tensor (dense, sketch) write the rows into it first and carry the two-phase bitmap
in their first payload (the union's rows, which the result lists: the rows some rank listed, as
DDP's own sparse allreduce does)::

    dense      allreduce(H + 4 ceil(D / q) + d e)          local: c d' with d' = d + D
    allgather  as above                                     local: no per-coordinate term (d' = 0)
    two_phase  as above                                     local: c D (the bitmap's digits, one per row)
    sketch     allreduce(H + 4 ceil(D / q) + 4 L)           local: c d' with d' = d + D

The lossy strategies are dense ones: a sparse gradient is planned among the exact strategies only.

PowerSGD (DDP only, ``lossy=True``: :mod:`lossless_hc.training.powersgd`) is a strategy of a whole
bucket, not of a tensor: torch's ``powerSGD_hook`` views each gradient as the matrix
``shape[0] x (numel / shape[0])`` (``m x n``), compresses it to rank ``r' = min(m, n, r)`` when
``(m + n) r' rho < m n`` (``rho``: ``min_compression_rate``) and sends the rest (vectors, small
matrices) as they are. :func:`~lossless_hc.training.powersgd.powersgd_layout` counts its three allreduces, issued one after the
other on the bucket's group::

    allreduce(e U)          U: numel of the tensors sent uncompressed (issued even when U = 0)
    allreduce(e sum m r')   P = M Q of every compressed matrix
    allreduce(e sum n r')   Q = M^T P

and its local work ``c_p d + f_p F`` (``Calibration.codec_seconds["powersgd"] = (c_p, f_p)``: error
feedback's passes over the bucket's ``d`` coordinates, and seconds per flop of the matrix products,
``F = sum (6 m n r' + 2 (m + n) r'^2)``: M Q, M^T P, P Q^T and two orthogonalisations, measured on
the device by :func:`~lossless_hc.training.calibration.measure_codecs`).
:meth:`CostModel.predict_powersgd` prices it; :meth:`CostModel.predict_message` prices the
per-parameter plans of the same bucket in one message (first payloads in the message's parts,
:mod:`~lossless_hc.training.message`, one allreduce each; the second
collectives batched as :func:`~lossless_hc.training.auto.decode_message` batches them), which is
what PowerSGD is compared with.

A message (a DDP bucket, FSDP2's replica all-reduce) batches its tensors' second collectives, one
allreduce per dtype and one allgather (:func:`~lossless_hc.training.auto.decode_message`): a tensor
whose message's other tensors already issue that kind of second collective
(:func:`batched_second_collectives`) is priced without its latency, ``batched`` in
:meth:`CostModel.predict`; the first allreduce's latency is common to every strategy
(:meth:`CostModel.choose`). The model neglects what does not scale with the tensor: the parts
a message's first payloads share, and a sketch that fails to decode costs one more dense allreduce
(the sketch's sizing keeps that below ~1e-3 per step). Its inputs are the EWMAs of the statistics
(:class:`~lossless_hc.training.plan_tracker.PlanTracker`), so a tensor whose density drifts is re-planned
within ``interval`` steps.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Optional

import torch

from lossless_hc.lhc.layout import MAX_KEYS, MAX_WORLD_SIZE, check_fraction
from lossless_hc.lhc.layout import is_real as _is_real
from lossless_hc.training.message import message_layout
from lossless_hc.training.plan_stats import (WIRE_DTYPES, TensorStats, bitmap_words, finite_nonnegative, header_width,
                                             layout_words, reaggregated_prior, sketch_capacity, sketch_payload_numel,
                                             stats_header_words)
from lossless_hc.training.topk_aggregate import topk_count

EXACT_STRATEGIES = ("dense", "allgather", "two_phase", "sketch")
LOSSY_STRATEGIES = ("fp16", "bf16", "thc", "topk", "topk_allgather")
TOPK_STRATEGIES = ("topk", "topk_allgather")   # the top-k selections, with one error-feedback memory
# The second collective a strategy issues every step (module doc), which a message batches with its other
# tensors' of the same kind
# (sketch and topk: the request of their decodes' inexact keys, measured at every step where it was looked for:
# docs/BENCHMARKS.md, "Inexact keys in training")
SECOND_COLLECTIVE = {"allgather": "allgather", "topk_allgather": "allgather", "two_phase": "allreduce",
                     "sketch": "allreduce", "topk": "allreduce"}
HALF_STRATEGIES = ("fp16", "bf16")   # the tensor allreduced in half precision
# The allgather's slots carry a row's index (topk_allgather's: a coordinate's) as an int32 bit-cast to float32
# (rows.gather_slots): tensors of more rows (coordinates) are never planned on it (unbuildable)
ALLGATHER_MAX_KEYS = (1 << 31) - 1
PLAIN_STRATEGIES = ("dense",) + HALF_STRATEGIES   # plans with plain steps between statistics steps (module doc)
HALF_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}   # each half strategy's wire dtype
STRATEGIES = EXACT_STRATEGIES + LOSSY_STRATEGIES
BUCKET_STRATEGIES = ("powersgd",)   # strategies of a whole DDP bucket (module doc), lossy
PRICED = STRATEGIES + BUCKET_STRATEGIES   # every strategy with local costs in a Calibration
# A re-plan leaves the strategy in use only for one predicted this much faster: the model's error is of
# this order (what it neglects, module doc), and a switch to a strategy with a second collective on a
# near tie costs a dependent round the model prices at its latency only.
SWITCH_MARGIN = 0.2
TOPK_RATIO = 0.01       # the lossy top-k's share of each tensor (CostModel(topk_ratio=...))
# Below this many bytes a tensor is only aggregated exactly, even with lossy=True: the cost model prices
# wire and compute, not the steps a lossy error costs, and a small tensor can save at most twice its
# bytes of wire per step (64 KiB: ~1 ms at 1 Gbit/s) while its top-k/THC error feedback can cost many
# steps (measured in docs/BENCHMARKS.md, "Time to accuracy": NCF's 4K-coordinate MLP layers under top-k).
# The same rule as torch's PowerSGD min_compression_rate and BytePS's minimum compressed size.
LOSSY_MIN_BYTES = 1 << 16
THC_BITS, THC_GRANULARITY = 4, 30

# Default link and local costs (Calibration.default): a 1 Gbit/s Ethernet link with ~50 us per
# message, and local work measured on a 2-core x86 VM (order of magnitude; calibrate() replaces them).
DEFAULT_LATENCY_S = 50e-6
DEFAULT_CODEC_SECONDS = {
    "dense": (0.5e-9, 0.0),        # copy into the message and out
    "allgather": (0.5e-9, 2e-9),   # scan for non-zero rows; scatter-add of the gathered rows
    "two_phase": (1.0e-9, 2e-9),   # scan, pack/unpack the bitmap; gather/scatter the union's rows
    "sketch": (1.5e-9, 15e-9),     # index encode/decode per coordinate; hash, sketch and peel per row coordinate
    # the half round trip and the copy of the result into the engine's tensor: a half-precision plan's
    # plain step
    "fp16": (1.0e-9, 0.0),
    "bf16": (1.0e-9, 0.0),
    "thc": (30e-9, 0.0),           # rotation, quantization, error feedback
    "topk": (15e-9, 15e-9),        # selection and error feedback; the sketch of the selection
    "topk_allgather": (2e-9, 20e-9),   # selection and error feedback, the result's zeros; the pairs' sums
    "powersgd": (2e-9, 1e-10),     # error feedback's passes per coordinate; seconds per matmul flop
}


@dataclass(frozen=True)
class LinkModel:
    """A ring's link: ``alpha_s`` seconds per message hop, ``seconds_per_byte`` per byte of a float32
    allreduce, ``allgather_seconds_per_byte`` per byte of an allgather and ``half_seconds_per_byte`` per
    byte of a half-precision (float16, bfloat16) allreduce (None: the allreduce's). Three per-byte costs
    because an engine's allgather need not stream like its allreduce (Gloo's costs more per byte), nor its
    half-precision sum like its float32 one (Horovod's CPU float16 allreduce took 1.55x its float32 time per
    byte on an emulated 1 Gbit/s link, Gloo's 1.7x at 10 Gbit/s: docs/BENCHMARKS.md)."""

    alpha_s: float
    seconds_per_byte: float
    allgather_seconds_per_byte: Optional[float] = None
    half_seconds_per_byte: Optional[float] = None

    def __post_init__(self):
        for name in ("allgather_seconds_per_byte", "half_seconds_per_byte"):
            if getattr(self, name) is None:
                object.__setattr__(self, name, self.seconds_per_byte)
        # NaN made every prediction NaN (every plan dense, every switch refused), a negative cost the
        # largest payload the cheapest: refused here, where every calibration (default, fitted, broadcast,
        # given) passes
        for name in ("alpha_s", "seconds_per_byte", "allgather_seconds_per_byte", "half_seconds_per_byte"):
            value = getattr(self, name)
            if not finite_nonnegative(value):
                raise ValueError(f"LinkModel {name} must be a finite number >= 0, got {value!r}")

    def __setstate__(self, state):
        # A model pickled before the allgather or the half allreduce had its own cost (an auto hook state
        # saved with its model).
        state.setdefault("allgather_seconds_per_byte", state["seconds_per_byte"])
        state.setdefault("half_seconds_per_byte", state["seconds_per_byte"])
        self.__dict__.update(state)

    def latency(self, n: int, kind: str = "allreduce") -> float:
        """The part of a ring collective's time that does not depend on its bytes: ``2(n-1) alpha`` for an
        allreduce, ``(n-1) alpha`` for an allgather (0 for one rank)."""
        if n <= 1:
            return 0.0
        return (2 if kind != "allgather" else 1) * (n - 1) * self.alpha_s

    def allreduce(self, nbytes: float, n: int, half: bool = False) -> float:
        """Ring allreduce of ``nbytes`` per rank: 2(n-1) alpha + 2(n-1)/n B beta (0 for one rank, and for no
        bytes: the strategies issue no collective of nothing); ``half``: of a float16 or bfloat16 tensor (beta:
        ``half_seconds_per_byte``)."""
        if n <= 1 or nbytes <= 0:
            return 0.0
        beta = self.half_seconds_per_byte if half else self.seconds_per_byte
        return self.latency(n) + 2 * (n - 1) / n * nbytes * beta

    def allgather(self, nbytes: float, n: int) -> float:
        """Ring allgather of ``nbytes`` from each rank: (n-1) alpha + (n-1) B beta_g (0 for one rank or no bytes,
        as :meth:`allreduce`)."""
        if n <= 1 or nbytes <= 0:
            return 0.0
        return self.latency(n, "allgather") + (n - 1) * nbytes * self.allgather_seconds_per_byte


@dataclass(frozen=True)
class Calibration:
    """Machine constants: the link and each strategy's local costs ``(per_coordinate_s, per_key_s)``
    (``per_key_s``: seconds per coordinate of the rows the strategy touches; see the module doc)."""

    link: LinkModel
    codec_seconds: dict = field(default_factory=lambda: dict(DEFAULT_CODEC_SECONDS))

    def __post_init__(self):
        # as LinkModel's: a NaN, infinite or negative local cost would decide every plan it enters
        for s, costs in self.codec_seconds.items():
            if len(costs) != 2 or not all(finite_nonnegative(c) for c in costs):
                raise ValueError(f"codec_seconds[{s!r}] must be two finite numbers >= 0 (per coordinate, "
                                 f"per key), got {costs!r}")

    @classmethod
    def default(cls, bandwidth_bits: float = 1e9, latency_s: float = DEFAULT_LATENCY_S) -> "Calibration":
        """``bandwidth_bits`` bit/s and ``latency_s`` per hop, and :data:`DEFAULT_CODEC_SECONDS`."""
        if not (_is_real(bandwidth_bits) and 0 < bandwidth_bits < math.inf) or \
                not finite_nonnegative(latency_s):
            raise ValueError(f"bandwidth_bits must be a finite number > 0 and latency_s one >= 0, "
                             f"got {bandwidth_bits!r} and {latency_s!r}")
        return cls(LinkModel(float(latency_s), 8.0 / bandwidth_bits), dict(DEFAULT_CODEC_SECONDS))

    def as_list(self) -> list:
        """Flat floats (alpha, the allreduce's, the allgather's and the half allreduce's beta, then per
        strategy in :data:`PRICED` order) for a broadcast."""
        link = self.link
        out = [link.alpha_s, link.seconds_per_byte, link.allgather_seconds_per_byte, link.half_seconds_per_byte]
        for s in PRICED:
            out += list(self.codec_seconds.get(s, DEFAULT_CODEC_SECONDS[s]))
        return out

    @classmethod
    def from_list(cls, values) -> "Calibration":
        v = [float(x) for x in values]
        if len(v) != 4 + 2 * len(PRICED):
            raise ValueError(f"a calibration has {4 + 2 * len(PRICED)} numbers, got {len(v)}")
        codec = {s: (v[4 + 2 * i], v[5 + 2 * i]) for i, s in enumerate(PRICED)}
        return cls(LinkModel(v[0], v[1], v[2], v[3]), codec)


@functools.lru_cache(maxsize=256)
def unbuildable(world_size: int, keys: int = 0, numel: int = 0, thc_granularity: int = THC_GRANULARITY) -> frozenset:
    """The strategies whose codec cannot be built for a tensor of ``numel`` coordinates in ``keys`` rows
    over ``world_size`` ranks: the LHC codec takes at most :data:`~lossless_hc.lhc.layout.MAX_WORLD_SIZE`
    (1024) ranks and :data:`~lossless_hc.lhc.layout.MAX_KEYS` (2^32 - 2^12) keys, so above them the sketch
    (keys: the rows) and ``topk`` (which sums its selections through one: keys, the coordinates) are out,
    not ``topk_allgather`` (the same selections, sent as pairs: its aggregator builds no codec); the
    allgathers' slots index at most :data:`ALLGATHER_MAX_KEYS` (2^31 - 1) rows (allgather) or coordinates
    (topk_allgather); above THC's exact range (:func:`~lossless_hc.thc.layout.max_world_size`, 65534 ranks
    at granularity 30) THC. Neither a candidate of :meth:`CostModel.choose` nor of an ``auto`` aggregator: pricing them would
    raise the codec's ValueError at the first re-plan, in the middle of training (or, for an allgather,
    send indices wrapped past the int32)."""
    from lossless_hc.thc.layout import max_world_size
    out = set()
    if world_size > MAX_WORLD_SIZE or keys > MAX_KEYS:
        out.add("sketch")
    if world_size > MAX_WORLD_SIZE or numel > MAX_KEYS:
        out.add("topk")
    if keys > ALLGATHER_MAX_KEYS:
        out.add("allgather")
    if numel > ALLGATHER_MAX_KEYS:
        out.add("topk_allgather")
    if world_size > max_world_size(int(thc_granularity)):
        out.add("thc")
    return frozenset(out)


def batched_second_collectives(strategies) -> list:
    """Per tensor of a message planned as ``strategies`` (in message order): the kinds of second
    collective its other tensors issue every step (:data:`SECOND_COLLECTIVE`), whose latency the message
    pays once whatever this tensor does (``batched`` of :meth:`CostModel.predict`)."""
    kinds = [SECOND_COLLECTIVE.get(s) for s in strategies]
    if not any(kinds):   # (a message of dense plans, the common case: every hook call asks)
        return [frozenset()] * len(kinds)
    issued = {k: kinds.count(k) for k in set(kinds) if k is not None}
    return [frozenset(k for k, c in issued.items() if c > (mine == k)) for mine in kinds]


class CostModel:
    """Predicted seconds and wire bytes of every strategy for a tensor (see the module docstring).

    ``topk_ratio``, ``thc_bits``: the lossy top-k's share and THC's bits, as the strategies use them
    (checked as ``AutoSpec`` checks them: a top-k ratio of 0 would price top-k at one coordinate, and an
    aggregator planned with it would fail only when it first builds top-k, mid-run)."""

    def __init__(self, calibration: Calibration, topk_ratio: float = TOPK_RATIO, thc_bits: int = THC_BITS,
                 thc_granularity: int = THC_GRANULARITY):
        from lossless_hc.thc.table import check_bits, check_table_args
        check_bits(thc_bits, "thc_bits")
        check_table_args(thc_bits, thc_granularity)
        self.calibration = calibration
        self.topk_ratio = check_fraction("topk_ratio", topk_ratio)
        self.thc_bits, self.thc_granularity = int(thc_bits), int(thc_granularity)

    # -- the collectives each strategy issues: [("allreduce"|"allreduce_half"|"allgather", bytes per rank)]
    def collectives(self, strategy: str, s: TensorStats) -> list:
        n, e, b = s.world_size, s.element_bytes, s.row
        w = header_width(strategy, s)
        H = w * stats_header_words(n)
        if s.sparse and strategy in ("dense", "sketch"):   # the union's rows ride along: the bitmap
            H += 4 * bitmap_words(s.keys, n)
        if strategy == "dense":   # a sparse gradient's body goes in the header's dtype (the bitmap's counts)
            return [("allreduce", H + s.numel * (w if s.sparse else e))]
        # allgather's slots and two_phase's rows are float32 whatever the gradient's dtype (``e``: the bytes
        # of its plain steps, 2 where they travel in half precision)
        if strategy == "allgather":
            return [("allreduce", H), ("allgather", s.max_rank_keys * (4 + b * 4))]
        if strategy == "two_phase":
            return [("allreduce", H + 4 * bitmap_words(s.keys, n)), ("allreduce", s.union_keys * b * 4)]
        if strategy == "sketch":
            words = sketch_payload_numel(s) if s.numel else 0
            return [("allreduce", H + 4 * words)] + self._reaggregated(strategy, s)
        if strategy in HALF_STRATEGIES:   # a plain step (module doc)
            return [("allreduce_half", 2 * s.numel)]
        if strategy == "thc":
            return [("allreduce", H + 8 * self._thc_words(s))]
        if strategy == "topk":
            k = topk_count(s.numel, self.topk_ratio)
            union = min(s.numel, n * k)
            words = layout_words(s.numel, n, k, 1, 0, union) if s.numel else 0
            return [("allreduce", H + 4 * words)] + self._reaggregated(strategy, s)
        if strategy == "topk_allgather":
            return [("allreduce", H), ("allgather", 8 * topk_count(s.numel, self.topk_ratio))]
        raise ValueError(f"unknown strategy {strategy!r}; one of {', '.join(STRATEGIES)}")

    def _reaggregated(self, strategy: str, s: TensorStats) -> list:
        """The request of a sketch or top-k decode's inexact keys (float32 values; none where the plan's
        observed or prior count is 0), priced as issued every step, as it was measured."""
        count = getattr(s, f"{strategy}_reaggregated")
        if count is None:
            count = reaggregated_prior(strategy, s, self.topk_ratio)
        return [("allreduce", 4 * int(count))] if count else []

    def _thc_words(self, s: TensorStats) -> int:
        from lossless_hc.thc.layout import plan_thc_layout
        if s.numel == 0:
            return 0
        return plan_thc_layout(s.numel, s.world_size, self.thc_granularity).payload_numel

    def wire_bytes(self, strategy: str, stats: TensorStats) -> int:
        """Bytes one rank contributes over all of the strategy's collectives."""
        return int(sum(nbytes for _, nbytes in self.collectives(strategy, stats)))

    def local_coordinates(self, strategy: str, s: TensorStats) -> int:
        """Coordinates the per-coordinate local cost applies to: the tensor's ``d`` for a dense
        gradient; for a sparse one (module doc) none for allgather, one per row for two_phase's
        bitmap, and ``d`` plus the bitmap for the strategies that write the rows into a dense tensor."""
        if not s.sparse:
            return s.numel
        if strategy == "allgather":
            return 0
        if strategy == "two_phase":
            return s.keys
        return s.numel + s.keys

    def touched_coordinates(self, strategy: str, s: TensorStats) -> int:
        if strategy == "allgather":
            return s.world_size * s.max_rank_keys * s.row
        if strategy in ("two_phase", "sketch"):
            return s.union_keys * s.row
        if strategy in TOPK_STRATEGIES:
            return s.world_size * topk_count(s.numel, self.topk_ratio)
        return 0

    def local_seconds(self, strategy: str, stats: TensorStats) -> float:
        """Predicted seconds of the strategy's local work for ``stats`` (module doc)."""
        per_coord, per_key = self.calibration.codec_seconds.get(strategy, DEFAULT_CODEC_SECONDS[strategy])
        return per_coord * self.local_coordinates(strategy, stats) + per_key * self.touched_coordinates(strategy, stats)

    def predict(self, strategy: str, stats: TensorStats, batched: frozenset = frozenset()) -> float:
        """Predicted seconds of one step of ``strategy`` for ``stats``. ``batched``: the kinds of second
        collective (``"allgather"``, ``"allreduce"``) the tensor's message issues anyway, whose latency
        its own second collective of that kind does not add (module doc)."""
        link, n = self.calibration.link, stats.world_size
        t = 0.0
        for i, (kind, nbytes) in enumerate(self.collectives(strategy, stats)):
            t += (link.allgather(nbytes, n) if kind == "allgather" else
                  link.allreduce(nbytes, n, half=kind == "allreduce_half"))
            if i > 0 and kind in batched:
                t -= link.latency(n, kind)
        return t + self.local_seconds(strategy, stats)

    def sketch_floor(self, stats: TensorStats) -> float:
        """A lower bound of ``predict("sketch", stats)`` that does not size the layout: the payload
        priced at its union capacity alone (:func:`~lossless_hc.training.plan_stats.sketch_payload_numel` is at
        least that) and without the inexact keys' request."""
        n = stats.world_size
        H = 4 * stats_header_words(n) + (4 * bitmap_words(stats.keys, n) if stats.sparse else 0)
        words = sketch_capacity(stats)[1] if stats.numel else 0
        return self.calibration.link.allreduce(H + 4 * words, n) + self.local_seconds("sketch", stats)

    def predict_message(self, plans) -> float:
        """Predicted seconds of one step of a message (a DDP bucket) whose tensors follow ``plans``, a
        list of ``(strategy, TensorStats)``: the first payloads in the parts
        :func:`~lossless_hc.training.message.message_layout` makes of them (one allreduce each, a half
        part's at ``beta_h``), then
        the second collectives as :func:`~lossless_hc.training.auto.decode_message` batches them (one
        allreduce per request dtype, then one allgather), plus every tensor's local work.

        A first payload's dtype: its header's (:func:`~lossless_hc.training.plan_stats.header_width`), except a
        dense plan's body, which travels apart in the gradient's wire width (``element_bytes``, its plain steps') where
        that differs, and an fp16 or bf16 plan's plain step, the tensor in that dtype, in a part of its
        own however small (``message_layout``'s ``keep``, as :class:`~lossless_hc.training.auto.AutoMessage`
        lays it out), and the parts as the calibrated link prices them (``message_layout``'s ``link``). The request
        dtype is the gradient's. The stats know a dtype by its width only, so a
        half-precision gradient is priced as bfloat16 (the part rule treats both halves alike; a model
        mixing them would have one part, or request, more than priced)."""
        link = self.calibration.link
        n = max((s.world_size for _, s in plans), default=1)
        specs = []    # the first payloads, (elements, dtype) as message_layout takes them
        gathered = 0
        second = {}   # request dtype (the gradient's width) -> bytes per rank
        local = 0.0
        for strategy, s in plans:
            (_, head), *rest = self.collectives(strategy, s)
            width = header_width(strategy, s)
            if strategy in HALF_STRATEGIES:   # a plain step: the tensor alone, in half precision
                specs.append((s.numel, HALF_DTYPES[strategy]))
            elif strategy == "dense" and not s.sparse and s.element_bytes != width:
                # the header in float32, the body as the gradient
                header = width * stats_header_words(s.world_size)
                specs += [(header // width, WIRE_DTYPES[width]),
                          (-(-(head - header) // s.element_bytes), WIRE_DTYPES[s.element_bytes])]
            else:
                specs.append((-(-head // width), WIRE_DTYPES[width]))
            for kind, nbytes in rest:
                if kind == "allgather":
                    gathered += nbytes
                else:
                    second[s.element_bytes] = second.get(s.element_bytes, 0) + nbytes
            local += self.local_seconds(strategy, s)
        dtypes, sizes, _ = message_layout(specs, {HALF_DTYPES[st] for st, _ in plans if st in HALF_STRATEGIES},
                                          link, n)
        first = sum(link.allreduce(m * d.itemsize, n, half=d.itemsize == 2) for d, m in zip(dtypes, sizes))
        return (first + sum(link.allreduce(b, n) for b in second.values())
                + link.allgather(gathered, n) + local)

    @staticmethod
    def powersgd_collectives(layout: PowerSGDLayout, element_bytes: int = 4) -> list:
        """PowerSGD's three allreduces ``[("allreduce", bytes per rank)] * 3``: the uncompressed
        tensors, P, Q (module doc)."""
        e = int(element_bytes)
        return [("allreduce", e * layout.uncompressed), ("allreduce", e * layout.p_numel),
                ("allreduce", e * layout.q_numel)]

    def predict_powersgd(self, layout: PowerSGDLayout, world_size: int, element_bytes: int = 4) -> float:
        """Predicted seconds of one PowerSGD step of a bucket (module doc): three dependent allreduces,
        each paying its latency even when empty, and the local work ``c_p d + f_p F``."""
        link, n = self.calibration.link, int(world_size)
        per_coord, per_flop = self.calibration.codec_seconds.get("powersgd", DEFAULT_CODEC_SECONDS["powersgd"])
        t = per_coord * layout.numel + per_flop * layout.flops
        if n > 1:
            for _, nbytes in self.powersgd_collectives(layout, element_bytes):
                t += link.latency(n) + 2 * (n - 1) / n * nbytes * link.seconds_per_byte
        return t

    def choose(self, stats: TensorStats, lossy: bool = False, allowed: Optional[tuple] = None,
               current: Optional[str] = None, batched: frozenset = frozenset()) -> tuple:
        """``(strategy, {strategy: predicted seconds})``: the cheapest exact strategy, or of every
        strategy when ``lossy`` (exact ones only for a sparse gradient); ``allowed`` narrows the
        candidates (ties: listed order); ``batched``: :meth:`predict`'s. ``current`` (the strategy in use) is
        kept unless the cheapest is predicted more than :data:`SWITCH_MARGIN` faster beyond what every
        strategy pays alike, the first allreduce's latency ``c = 2(n-1) alpha``:
        ``t_best - c < (1 - SWITCH_MARGIN)(t_current - c)``
        (on a small tensor ``c`` is most of every prediction, and would hide any difference).

        The sketch is priced last: when it is not ``current`` and :meth:`sketch_floor` already exceeds
        the cheapest other candidate, it cannot be chosen and its entry is that lower bound (sizing its
        layout, a search of index shapes, would cost milliseconds at every re-plan of every tensor).
        Strategies whose codec cannot be built for ``stats`` (its ranks, rows or coordinates: :func:`unbuildable`)
        are no candidates."""
        names = EXACT_STRATEGIES + (LOSSY_STRATEGIES if lossy and not stats.sparse else ())
        names = tuple(s for s in names if s not in unbuildable(stats.world_size, stats.keys, stats.numel,
                                                                    self.thc_granularity))
        if allowed is not None:
            names = tuple(s for s in names if s in allowed)
            if not names:
                raise ValueError(f"no strategy left among {allowed!r}")
        predicted = {s: self.predict(s, stats, batched) for s in names if s != "sketch"}
        if "sketch" in names:
            floor = self.sketch_floor(stats)
            beaten = current != "sketch" and predicted and floor > min(predicted.values())
            predicted["sketch"] = floor if beaten else self.predict("sketch", stats)
            predicted = {s: predicted[s] for s in names}   # listed order
        best = min(names, key=lambda s: (predicted[s], names.index(s)))
        common = self.calibration.link.latency(stats.world_size)
        if current in predicted and not predicted[best] - common < (1.0 - SWITCH_MARGIN) * (predicted[current] - common):
            best = current
        return best, predicted


@functools.lru_cache(maxsize=1)
def _ring_bytes_model() -> CostModel:
    # a link of no latency and one second per byte, and no local work: its predictions are the bytes one rank
    # moves through the ring, 2(n-1)/n B per allreduce and (n-1) B per allgather
    return CostModel(Calibration(LinkModel(0.0, 1.0), {s: (0.0, 0.0) for s in PRICED}))


@functools.lru_cache(maxsize=4096)   # pure, of hashable arguments; asked at every due plan without a model
def dense_dominates(stats: TensorStats, allowed: Optional[tuple] = None) -> bool:
    r"""Whether no calibration could move a tensor planned ``dense`` off it: true when the candidates
    (``allowed``, default every exact strategy) are all exact, the gradient is dense (not
    ``stats.sparse``), and every candidate ``s`` other than dense moves, per rank, at least
    ``1 - SWITCH_MARGIN`` of dense's bytes through the ring (:meth:`CostModel.predict` on a link of no latency
    and one second per byte, with no local work; the sketch at its :meth:`CostModel.sketch_floor`)::

        bytes(s) >= (1 - SWITCH_MARGIN) bytes(dense)

    Then :meth:`CostModel.choose` with ``current="dense"`` keeps dense on every link that prices a byte
    of an allgather as one of an allreduce (``beta_g = beta``) and every calibration whose local costs are at
    least dense's per coordinate: ``s`` pays at least the first allreduce's latency that the margin leaves out, at
    least ``(1 - SWITCH_MARGIN)`` of dense's wire time, and at least dense's local work. E.g. a gradient
    non-zero in every row (as smooth activations leave them; not a ReLU layer's, whose dead units' rows are
    zero): the allgather of its rows moves ``n/2 (1 + 1/b)`` times dense's bytes, two_phase and the sketch
    at least dense's. So a run whose every tensor is dominated needs no calibration (the DDP adapter measures
    it only once some tensor is not)."""
    names = EXACT_STRATEGIES if allowed is None else tuple(allowed)
    if stats.sparse or any(s not in EXACT_STRATEGIES for s in names):
        return False
    moved = _ring_bytes_model()
    dense = moved.predict("dense", stats)
    for s in names:
        if s == "dense":
            continue
        if (moved.sketch_floor(stats) if s == "sketch" else moved.predict(s, stats)) < (1.0 - SWITCH_MARGIN) * dense:
            return False
    return True
