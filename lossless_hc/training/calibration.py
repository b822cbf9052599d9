r"""Start-up calibration of the planner's cost model (:mod:`lossless_hc.training.planner`).

:func:`calibrate` times a few collective sizes on the real process group and each strategy's local
work on the real device, fits the link, and broadcasts rank 0's result, so every rank plans with the
same numbers (the plans are deterministic functions of them and of aggregated statistics).

Link fit. For every size ``B`` of :func:`link_sizes` rank 0 keeps the fastest of ``repeats`` runs of a
SUM allreduce of B bytes per rank and of an allgather of :func:`allgather_bytes` (where the link is timed
up to 1 MiB or more, as many bytes per rank as send what the allreduce sends: ``2B/n``, at most 4x fewer;
else, and at the smallest size, B). With ``(x, y) =
(2(n-1), 2(n-1)/n B)`` for the allreduce and ``((n-1), (n-1) B)`` for an allgather of B bytes per rank
(the hops and the bytes of :class:`LinkModel`),
:func:`fit_link` prices each collective's bytes at its *marginal* cost, the slope between its two
largest sizes, and the latency at the smallest size:

.. math:: \beta_c = \frac{t_c(B_1) - t_c(B_2)}{y_c(B_1) - y_c(B_2)}\ (B_1 > B_2 \text{ the largest}),
          \qquad \alpha = \max\Big(0,\ \min_c \frac{t_c(B_0) - y_c(B_0)\,\beta_c}{x_c}\Big)
          \ (B_0 \text{ the smallest})

(a slope that is not positive, timer noise between two latency-bound sizes, falls back to
``t_c(B_1) / y_c(B_1)``). Not one straight line through every sample, as a least-squares fit would
draw: a link that passes a burst at memory speed (the emulator's token bucket holds 256 KiB, so a
quarter-megabyte sample after a pause costs half its line-rate time) or whose time per byte grows with
size (Gloo's allgather) bends the line, and a fit in relative error through every sample priced the
bytes of an emulated 1 Gbit/s link at a third to four fifths of what its 4 and 16 MiB allreduces take
per byte, differently in every run (docs/BENCHMARKS.md, "The link calibration"). The slope is blind to a constant per message (latency, a
burst's saving), so it prices what a plan's choice changes, the bytes; a minimum over the smallest
samples, because scheduling noise only ever adds to a round trip. Where the planner may send tensors in
half precision (``lossy``, fp16 or bf16 allowed), a float16 allreduce is timed at the two largest sizes
too, for its own slope ``beta_h``: an engine need not sum float16 as fast as float32 (Horovod's float16
allreduce on the CPU took 1.55x its float32 time per byte, and its fp16 compression stepped 0.77-1.07x
its uncompressed VGG: docs/BENCHMARKS.md).

Local work (:func:`measure_codecs`, rank 0's device): per coordinate, the copy into a message (dense),
a half-precision plan's plain step (bf16; fp16 with its division by n and the product back: the
round trip and the copy of the result) and the non-zero-row scan (allgather,
two_phase); per touched coordinate, the LHC sketch's encode + decode of
a sparse tensor beyond its scan; PowerSGD (DDP buckets): per coordinate, its error feedback's passes
(add the memory, keep a copy, subtract the result), and per flop, the time of torch's own PowerSGD
products and orthogonalisations on a :data:`POWERSGD_MATRIX` matrix at :data:`POWERSGD_RANK` divided
by their flops (:func:`~lossless_hc.training.powersgd.powersgd_layout`); THC: per coordinate, a steady
step's encode (of the interleave, as ``THCAggregator`` feeds a tensor of several blocks) and decode of a
dense tensor; top-k (where its plans are candidates): per coordinate, one rank's encode of a top-k plan's
step, and per key of the union, the decode of several ranks' summed payloads (:func:`_topk_step`; its
default, :data:`~lossless_hc.training.planner.DEFAULT_CODEC_SECONDS`, otherwise); top-k allgathered (with it):
per coordinate, one rank's selection into its slots and the clearing of the result, per gathered pair the sum
of several ranks' pairs (:func:`_topk_allgather_step`).

The callers supply the collectives, and with them the deadlock freedom: every rank must call
:func:`calibrate` at the same program point (DDP: the first hook call of the second step, on the main thread; Horovod:
``Compression.auto()``, after ``hvd.init()``; FSDP2: ``AutoFSDPState.register``).
"""
from __future__ import annotations

import math
import time
from typing import Callable, Optional, Sequence

import torch

from lossless_hc.lhc.codec import LosslessCodec
from lossless_hc.lhc.layout import check_int, is_real
from lossless_hc.thc.codec import THCCodec
from lossless_hc.training.topk_aggregate import topk_count
from lossless_hc.training.planner import DEFAULT_CODEC_SECONDS, LOSSY_MIN_BYTES, Calibration, CostModel, LinkModel
from lossless_hc.training.powersgd import powersgd_layout
from lossless_hc.training.step import run_in_process
from lossless_hc.training.strategies import AutoAggregator

# bytes per rank (the most link_sizes times); 4 MiB: the largest pair's slope clears a 10 Gbit/s token
# bucket's 1.25 MB burst too (what that costs, once: docs/DESIGN.md, "Calibration").
LINK_SIZES = (1 << 10, 1 << 15, 1 << 18, 1 << 20, 1 << 22)
ALLGATHER_SCALED_FROM = 1 << 20   # from this top size on, the allgather sends the allreduce's bytes (allgather_bytes)
CODEC_NUMEL = 1 << 18
CODEC_DENSITY = 0.01
POWERSGD_MATRIX, POWERSGD_RANK = (256, 1024), 4   # a mid-sized layer: the flop rate of its products
# top-k's step is timed on a tensor as large as the model's largest, at most this large: its selection's fixed
# costs weigh at 2^18 coordinates (9-11 ns per coordinate there, 2-3 ns from 2^20 on: docs/BENCHMARKS.md, "Top-k's
# price measured"), and at least TOPK_MIN_NUMEL (LOSSY_MIN_BYTES of float32: smaller tensors stay exact by
# default); its decode on the sum of at most TOPK_RANKS ranks' selections (the work per key of the
# union they make)
TOPK_NUMEL, TOPK_MIN_NUMEL, TOPK_RANKS = 1 << 20, LOSSY_MIN_BYTES // 4, 8


def fit_link(samples: Sequence[tuple], world_size: int, fallback: LinkModel) -> LinkModel:
    """``LinkModel`` from ``(kind, bytes_per_rank, seconds)`` samples (kinds ``allreduce``, ``allgather``,
    ``allreduce_half``: see the module doc): per-byte costs from each kind's two largest sizes, the latency
    from the smallest; a kind not timed at two sizes takes the allreduce's per-byte cost (the allreduce
    the allgather's). ``fallback`` for one rank or no kind timed at two sizes. ValueError for a world size
    below 1, a sample of negative bytes or a time that is not finite (a NaN would make every prediction
    NaN and every plan dense, an inf every byte infinitely dear; a negative time is floored at a timer's
    tick)."""
    check_int(world_size, "world_size", least=1)
    n = world_size
    fastest: dict = {}
    for kind, nbytes, seconds in samples:
        if not (is_real(seconds) and math.isfinite(seconds)) or not is_real(nbytes) or nbytes < 0:
            raise ValueError(f"a link sample is (kind, bytes >= 0, finite seconds), got {(kind, nbytes, seconds)!r}")
        if kind in ("allreduce", "allreduce_half"):
            hops, sent = 2.0 * (n - 1), 2.0 * (n - 1) / n * nbytes
        elif kind == "allgather":
            hops, sent = float(n - 1), float(n - 1) * nbytes
        else:
            raise ValueError(f"unknown collective {kind!r}")
        key = (kind, int(nbytes))
        if key not in fastest or seconds < fastest[key][2]:
            fastest[key] = (hops, sent, max(float(seconds), 1e-9))   # a timer's tick floors t
    if n <= 1:
        return fallback
    beta = {}
    for kind in ("allreduce", "allgather", "allreduce_half"):
        sizes = sorted(b for k, b in fastest if k == kind)
        if len(sizes) < 2 or sizes[-1] <= 0:
            continue
        (_, y1, t1), (_, y2, t2) = fastest[(kind, sizes[-1])], fastest[(kind, sizes[-2])]
        slope = (t1 - t2) / (y1 - y2)
        beta[kind] = slope if slope > 0 else t1 / y1
    if not beta:
        return fallback
    beta.setdefault("allreduce", beta.get("allgather", beta.get("allreduce_half")))
    beta.setdefault("allgather", beta["allreduce"])
    beta.setdefault("allreduce_half", beta["allreduce"])
    smallest = min(b for _, b in fastest)
    alpha = min((t - y * beta[k]) / x for (k, b), (x, y, t) in fastest.items() if b == smallest)
    return LinkModel(max(0.0, float(alpha)), float(beta["allreduce"]), float(beta["allgather"]),
                     float(beta["allreduce_half"]))


def link_sizes(largest_bytes: int) -> tuple:
    """The sizes (bytes per rank) worth timing for tensors of at most ``largest_bytes`` bytes on the
    wire, the three :func:`fit_link` reads: the smallest of :data:`LINK_SIZES` (the latency), the largest
    of them at most a quarter of the top (so that the slope spans a factor of 4 at least), and the top,
    ``largest_bytes`` clamped to ``[LINK_SIZES[1], LINK_SIZES[-1]]`` (a latency-bound and a
    bandwidth-bound point at least). Each size costs ``1 + repeats`` allreduces and allgathers, so a
    model of small tensors is calibrated in a few round trips instead of megabytes, and no size is timed
    that the fit would not read (DigitsCNN, 128 KiB at most: 1, 32 and 128 KiB; a model of 2 MiB tensors:
    1 KiB, 256 KiB and 2 MiB; 4 MiB or more: 1 KiB, 1 MiB and 4 MiB)."""
    top = min(LINK_SIZES[-1], max(LINK_SIZES[1], int(largest_bytes)))
    below = [s for s in LINK_SIZES if 4 * s <= top]   # LINK_SIZES[0] at least, as top >= LINK_SIZES[1]
    return tuple(dict.fromkeys((below[0], below[-1], top)))


def topk_numel_for(largest_bytes: Optional[int]) -> int:
    """The coordinates top-k's step is timed on (:func:`measure_codecs`' ``topk_numel``) for tensors of at
    most ``largest_bytes`` float32 bytes: that many coordinates, clamped to ``[TOPK_MIN_NUMEL,
    TOPK_NUMEL]``; ``TOPK_NUMEL`` where the model is unknown (None). The selection's cost per coordinate
    falls with the tensor's size (its fixed costs), so a model whose largest tensor is smaller than
    :data:`TOPK_NUMEL` is priced at its own tensors' cost, not below it, and calibrates faster."""
    if largest_bytes is None:
        return TOPK_NUMEL
    check_int(largest_bytes, "largest_bytes", least=0)
    return min(TOPK_NUMEL, max(TOPK_MIN_NUMEL, largest_bytes // 4))


def check_repeats(repeats) -> int:
    """``repeats`` (timed runs per measurement), an int >= 1, else TypeError / ValueError: none would
    leave every measurement at an infinite time, and the link priced every byte at infinity."""
    check_int(repeats, "repeats", least=1)
    return repeats


def _best_time(fn: Callable[[], None], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def allgather_bytes(nbytes: int, sizes: Sequence[int], world_size: int) -> int:
    """The bytes per rank :func:`measure_link` allgathers where it allreduces ``nbytes`` of ``sizes``: as many
    as make an allgather send what that allreduce sends, ``2 nbytes / n`` (its ``(n-1) B`` against the
    allreduce's ``2(n-1)/n B``), but at most 4x fewer (n > 8), in whole float32 words, where the largest of
    ``sizes`` is at least :data:`ALLGATHER_SCALED_FROM`; ``nbytes`` itself at the smallest size (the latency's),
    at 2 ranks or fewer, and where every size is below it. The slope between two such sizes spans the same
    factor as the allreduce's and clears a token bucket's burst where the allreduce's does; an allgather of
    ``nbytes`` per rank would send ``n/2`` times the allreduce's bytes, the calibration's dearest samples, for
    sizes a plan's allgathers (a share of a tensor's bytes per rank) stay far below. Below 1 MiB the samples
    cost little, and both collectives' may pass partly within a burst, differently from run to run; there an
    allgather of B per rank, which sends more, is the steadier sample (docs/BENCHMARKS.md, "The calibration's
    time")."""
    check_int(world_size, "world_size", least=1)
    if world_size <= 2 or nbytes <= min(sizes) or max(sizes) < ALLGATHER_SCALED_FROM:
        return nbytes
    return max(min(sizes), 4 * ((nbytes * 2 // min(world_size, 8)) // 4))


def measure_link(allreduce: Callable[[torch.Tensor], None], allgather: Callable[[torch.Tensor], None],
                 device, sizes: Sequence[int] = LINK_SIZES, repeats: int = 3, half_sizes: Sequence[int] = (),
                 world_size: int = 2) -> list:
    """``[(kind, bytes per rank, seconds)]``: the fastest of ``repeats`` blocking collectives per size after
    one untimed run, a float32 allreduce at each of ``sizes`` and an allgather at :func:`allgather_bytes`
    of each (``world_size`` ranks), and a float16 allreduce at each of ``half_sizes``.
    Collective: every rank must call it with the same arguments."""
    check_repeats(repeats)
    samples = []
    for nbytes in sizes:
        t = torch.ones(max(1, nbytes // 4), dtype=torch.float32, device=device)
        allreduce(t)   # warm-up (connection set-up, allocations)
        samples.append(("allreduce", nbytes, _best_time(lambda: allreduce(t), repeats)))
        gathered = allgather_bytes(nbytes, sizes, world_size)
        g = t[:max(1, gathered // 4)]
        allgather(g)
        samples.append(("allgather", gathered, _best_time(lambda: allgather(g), repeats)))
    for nbytes in half_sizes:
        t = torch.ones(max(1, nbytes // 2), dtype=torch.float16, device=device)
        allreduce(t)
        samples.append(("allreduce_half", nbytes, _best_time(lambda: allreduce(t), repeats)))
    return samples


# The measurements of measure_codecs, by the name its ``timer`` receives (the timer seam's vocabulary).
CODEC_MEASUREMENTS = ("copy", "scan", "bf16", "fp16", "sketch", "powersgd_passes", "thc", "powersgd_products")
TOPK_MEASUREMENTS = ("topk_encode", "topk_decode", "topk_allgather_clear", "topk_allgather_request",
                     "topk_allgather_finish")


def measure_codecs(device, world_size: int, numel: int = CODEC_NUMEL, density: float = CODEC_DENSITY,
                   repeats: int = 3, topk_ratio: Optional[float] = None,
                   timer: Optional[Callable[[str, Callable[[], None]], float]] = None,
                   topk_numel: int = TOPK_NUMEL) -> dict:
    """Local costs ``{strategy: (per_coordinate_s, per_key_s)}`` measured on ``device`` (module doc);
    top-k's where ``topk_ratio`` is given (the share it selects), its steps on ``topk_numel`` coordinates
    (:func:`topk_numel_for`), else its default.

    ``timer(what, fn)``: the seconds one run of ``fn`` takes, ``what`` naming the measurement (one of
    :data:`CODEC_MEASUREMENTS`, and of :data:`TOPK_MEASUREMENTS` with ``topk_ratio``; each is timed once).
    By default the fastest of ``repeats`` runs after a warm-up run, each waited for on the device. With
    ``t(what)`` the seconds so returned, ``d = numel``, ``k = max(1, int(density d))``:

    * dense ``(t(copy) / d, 0)``; allgather ``(t(scan) / d, 2 t(copy) / d)``; two_phase
      ``(2 t(scan) / d, 2 t(copy) / d)``; sketch ``(t(scan) / d, max(0, t(sketch) - t(scan)) / k)``;
    * fp16 ``((t(fp16) + t(copy)) / d, 0)``, bf16 the same with ``t(bf16)``, thc with ``t(thc)``;
    * powersgd ``(t(powersgd_passes) / d, t(powersgd_products) / flops)``, the flops of
      :data:`POWERSGD_MATRIX` at :data:`POWERSGD_RANK`;
    * topk and topk_allgather: :func:`_topk_step`, :func:`_topk_allgather_step`.

    A caller's timer is how a test checks that every measurement prices the strategy it is for (a timer
    that only measures cannot tell fp16's time from bf16's)."""
    check_repeats(repeats)
    check_int(topk_numel, "topk_numel", least=1)
    device = torch.device(device)
    g = torch.Generator().manual_seed(0)
    x = torch.zeros(numel)
    k = max(1, int(density * numel))
    x[torch.randperm(numel, generator=g)[:k]] = torch.randn(k, generator=g)
    x = x.to(device)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)

    def best_of_repeats(what, fn):
        def run():
            fn()
            sync()
        run()
        return _best_time(run, repeats)
    timed = timer or best_of_repeats

    copy = timed("copy", lambda: torch.cat([x.new_zeros(4), x.to(torch.float32)])) / numel
    scan = timed("scan", lambda: torch.nonzero(x != 0)) / numel
    half = timed("bf16", lambda: x.to(torch.bfloat16).to(torch.float32)) / numel
    # AutoAggregator's scaling
    fp16 = timed("fp16", lambda: x.to(torch.float16).div_(2).to(torch.float32).mul_(2)) / numel
    codec = LosslessCodec(numel, 1, k, 1, 0, device=device)
    sketch = timed("sketch", lambda: codec.decode(codec.encode(x))[1])
    per_key = max(0.0, (sketch - scan * numel) / k)
    feedback = torch.zeros_like(x)
    passes = timed("powersgd_passes", lambda: (x + feedback).clone().sub_(x)) / numel
    # THC's first step is the norm-only round (THCCodec): the warm-up run takes it, the timed runs are
    # steady steps. One rank's payload decodes as a one-rank SUM; the work per coordinate is the same.
    thc = THCCodec(numel, 1, device=device)
    dense_x = torch.randn(numel, generator=g).to(device)
    thc_step = timed("thc", lambda: thc.decode(thc.encode(dense_x, interleaved=True))) / numel
    products = _powersgd_products(device)
    products()   # LAPACK's first QR call sets itself up (milliseconds): not a per-step cost
    per_flop = timed("powersgd_products", products) / powersgd_layout([POWERSGD_MATRIX], POWERSGD_RANK, 1).flops
    out = dict(DEFAULT_CODEC_SECONDS)
    out.update({"dense": (copy, 0.0), "allgather": (scan, 2 * copy), "two_phase": (2 * scan, 2 * copy),
                # a half-precision plan's plain step also copies the result into the engine's tensor
                # (its statistics steps, one in an interval, scan twice: not priced, as a dense plan's scan)
                "sketch": (scan, per_key), "fp16": (fp16 + copy, 0.0), "bf16": (half + copy, 0.0),
                # THC: and the copy of the result, as the half plans (its statistics steps' scans: as fp16's)
                "thc": (thc_step + copy, 0.0),
                "powersgd": (passes, per_flop)})
    if topk_ratio is not None:
        out["topk"] = _topk_step(device, world_size, topk_ratio, topk_numel, timed)
        out["topk_allgather"] = _topk_allgather_step(device, world_size, topk_ratio, topk_numel, timed)
    return out


def _planned_ranks(strategy: str, ranks: int, ratio: float, numel: int, device) -> tuple:
    """``(aggregators, gradients)``: ``ranks`` ranks' ``auto`` aggregators of a ``numel``-coordinate tensor held
    on ``strategy`` (top-k's ``ratio``), and a random gradient for each."""
    model = CostModel(Calibration.default(), topk_ratio=ratio)
    aggs = [AutoAggregator(f"calibration.{strategy}", (numel,), torch.float32, ranks, r, model, lossy=True,
                           first=strategy, allowed=(strategy,), device=device, lossy_min_bytes=0)
            for r in range(ranks)]
    g = torch.Generator().manual_seed(1)
    return aggs, [torch.randn(numel, generator=g).to(device) for _ in range(ranks)]


def _topk_step(device, world_size: int, ratio: float, numel: int, timed: Callable) -> tuple:
    """``(per coordinate, per key)`` of an ``auto`` top-k plan's step between its statistics steps, run as
    the plan runs it (the selection with error feedback, the sketch of the ``k = ceil(ratio d)`` selected
    keys; the decode of ``m = min(n, TOPK_RANKS)`` ranks' summed payloads): one rank's encode per coordinate
    of a ``numel``-coordinate tensor (``d``), its decode per key of the ``m k`` keys the ranks select (the cost
    model's ``c d + k_s n k``, module doc of the planner): ``(t(topk_encode) / d, t(topk_decode) / (m k))``
    with ``t`` measure_codecs' ``timer``. A statistics step's row scans, one step in an interval, are not
    priced (as a dense plan's)."""
    m = max(1, min(int(world_size), TOPK_RANKS))
    aggs, xs = _planned_ranks("topk", m, ratio, numel, device)

    # The first step, statistics, run whole: its inexact keys' request (which random selections summed over
    # several ranks make at every step) finished as a plan finishes it, or the step is never counted and the
    # next encode is a first, statistics step again (a row scan).
    run_in_process(aggs, xs)
    # the second, timed: between statistics steps, as all but one in an interval
    encoded = [a.encode(x) for a, x in zip(aggs, xs)]
    summed = torch.stack([payload for payload, _ in encoded]).sum(0)
    ctx = encoded[0][1]
    k = topk_count(numel, ratio)
    per_coordinate = timed("topk_encode", lambda: aggs[0].encode(xs[0])) / numel
    per_key = timed("topk_decode", lambda: aggs[0].decode(summed, ctx)) / (m * k)
    return per_coordinate, per_key


def _topk_allgather_step(device, world_size: int, ratio: float, numel: int, timed: Callable) -> tuple:
    """``(per coordinate, per pair)`` of an ``auto`` top-k-allgather plan's step between its statistics steps,
    run as the plan runs it: one rank's selection with error feedback into its ``k = ceil(ratio d)`` slots
    (encode, then the decode that makes the request) and the clearing of its result, per coordinate of
    a ``numel``-coordinate tensor (``d``); the sum of ``m = min(n, TOPK_RANKS)`` ranks' gathered pairs beyond that
    clearing, per pair (the cost model's ``c d + k_s n k``): ``((t(topk_allgather_request) +
    t(topk_allgather_clear)) / d, max(0, t(topk_allgather_finish) - t(topk_allgather_clear)) / (m k))`` with ``t`` measure_codecs'
    ``timer``. At least 2 ranks (one rank's tensor is only ever dense)."""
    m = max(2, min(int(world_size), TOPK_RANKS))
    aggs, xs = _planned_ranks("topk_allgather", m, ratio, numel, device)

    def request(r):
        payload, ctx = aggs[r].encode(xs[r])
        return ctx, aggs[r].decode(payload * m, ctx).request.tensor   # m ranks' contributor counts
    run_in_process(aggs, xs)   # the first step, statistics, run whole (as _topk_step runs top-k's)
    # the second, as all but one in an interval: its gathered pairs are what the timed finish sums
    made = [request(r) for r in range(m)]
    gathered = torch.stack([t for _, t in made])
    for a, (ctx, _) in zip(aggs, made):
        a.finish(ctx, gathered)
    ctx = made[0][0]
    out = torch.empty(numel, dtype=torch.float32, device=device)
    clear = timed("topk_allgather_clear", out.zero_)
    per_coordinate = (timed("topk_allgather_request", lambda: request(0)) + clear) / numel
    pairs = m * topk_count(numel, ratio)
    per_pair = max(0.0, timed("topk_allgather_finish", lambda: aggs[0].finish(ctx, gathered, out=out)) - clear) / pairs
    return per_coordinate, per_pair


def _powersgd_products(device) -> Callable[[], None]:
    """One PowerSGD step's local products on a :data:`POWERSGD_MATRIX` (torch's own orthogonalisation)."""
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import _orthogonalize

    g = torch.Generator().manual_seed(0)
    rows, cols = POWERSGD_MATRIX
    m = torch.randn(1, rows, cols, generator=g).to(device)
    q = torch.randn(1, cols, POWERSGD_RANK, generator=g).to(device)
    p = torch.empty(1, rows, POWERSGD_RANK, device=device)
    out = torch.empty_like(m)

    def run():
        _orthogonalize(q)
        torch.bmm(m, q, out=p)
        _orthogonalize(p)
        torch.bmm(m.transpose(1, 2), p, out=q)
        torch.bmm(p, q.transpose(1, 2), out=out)
    return run


def calibrate(allreduce: Callable[[torch.Tensor], None], allgather: Callable[[torch.Tensor], None],
              broadcast: Callable[[torch.Tensor], None], rank: int, world_size: int, device="cpu",
              default: Calibration = None, sizes: Sequence[int] = LINK_SIZES, repeats: int = 3,
              samples_out: Optional[list] = None, half: bool = False,
              topk_ratio: Optional[float] = None, topk_numel: int = TOPK_NUMEL) -> Calibration:
    """Rank 0's calibration on every rank (collective: every rank calls it at the same point).

    ``allreduce(t)``: blocking in-place SUM of ``t`` (float32, and float16 where ``half``: the half
    allreduce is timed at the two largest of ``sizes``); ``allgather(t)``: blocking allgather of ``t``
    (the result unused); ``broadcast(t)``: blocking in-place broadcast of a float64 tensor from rank 0.
    ``repeats``: runs of each link size and local measurement, the fastest kept (:func:`measure_link`,
    :func:`measure_codecs`); ``samples_out``: a list that receives this rank's link samples; ``topk_ratio``:
    top-k's share, where its plans are candidates (its step is timed on ``topk_numel`` coordinates,
    :func:`measure_codecs`)."""
    check_repeats(repeats)
    default = default or Calibration.default()
    half_sizes = tuple(sorted(sizes)[-2:]) if half else ()
    samples = (measure_link(allreduce, allgather, device, sizes, repeats, half_sizes, world_size)
               if world_size > 1 else [])
    if samples_out is not None:
        samples_out.extend(samples)
    values = torch.zeros(len(default.as_list()), dtype=torch.float64)
    if rank == 0:
        link = fit_link(samples, world_size, default.link)
        codecs = measure_codecs(device, world_size, repeats=repeats, topk_ratio=topk_ratio, topk_numel=topk_numel)
        values = torch.tensor(Calibration(link, codecs).as_list(), dtype=torch.float64)
    if world_size > 1:
        values = values.to(device)
        broadcast(values)
    return Calibration.from_list(values.cpu().tolist())
