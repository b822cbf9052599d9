"""Benchmarks for the lossless codec.

Usage::

    python -m lossless_hc.bench codec --numel 67108864 --density 0.01 --workers 8 [--block-size 32]
        [--index auto|bitmap|bloom|dense] [--support random|identical|disjoint|clustered]
        [--repeat 5] [--seed 0] [--threads 0] [--device cpu|cuda] [--json PATH]
    python -m lossless_hc.bench peel --keys 1000,10000,100000,1000000 --trials 20 [--json PATH]
    python -m lossless_hc.bench wire [--numel 67108864] [--densities 1e-5,...,0.5] [--workers 2,8,16,64]
        [--block-sizes 1,32] [--plot docs/wire_bits.png] [--verify-numel N] [--json PATH]
    python -m lossless_hc.bench thc --numel 16777216 --workers 8 [--bits 4] [--granularity 30]
        [--overflow-freq 32] [--averaged] [--repeat 5] [--json PATH]

``codec`` times encode (one worker) and decode (the SUM of all workers' payloads) against a
``torch.clone`` of one dense input measured in the same process, round-robin with them (see
``time_interleaved``), checks the decoded sum against the
float64 dense sum, and compares the wire size with dense float32 and with the information bound of
the aggregate's actual support.

With ``--device cuda`` the codec runs on the current GPU (at least 10 timed runs, CUDA events, after
warm-up), encode and decode into reused buffers, and the baseline is a device-to-device copy of one
dense input in the same run; throughput is reported in GB/s of dense float32 gradient and as a
fraction of that copy.

The ``codec`` command exits with status 1 when the decode is not exact (report not ok, or the
decoded support differs from the float64 sum's beyond rounding scale), so it can gate CI.

``peel`` measures the sizing rule ``layout.sketch_table_for``: peeling failure rate, max abs error
against float64 truth, and decode time per key (one worker, bitmap index, numel = 20 * keys).

``thc`` times THCCodec encode (one worker, error feedback on) and decode (the aggregate of all
workers' payloads) against ``torch.clone`` of one input, and reports wire bits per coordinate and the
normalized mean squared error of one step against the true average.

Importing this module has no side effects; the CLI lives in ``main``.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shlex
import statistics
import sys
import time
from typing import Callable, Optional, Sequence

import torch

SUPPORTS = ("random", "identical", "disjoint", "clustered")
CLUSTER_WINDOW = 4   # clustered support: a worker's keys lie in a random window of ~4x their count


# ------------------------------------------------------------------------------------------------
# machine / formatting helpers
# ------------------------------------------------------------------------------------------------
def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def machine_info(codec_threads: int = 0) -> dict:
    try:
        affinity = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        affinity = os.cpu_count() or 0
    return {
        "cpu": cpu_model(),
        "cores": os.cpu_count() or 0,
        "cores_available": affinity,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "codec_threads": codec_threads if codec_threads > 0 else
        f"auto (OMP default{', OMP_NUM_THREADS=' + os.environ['OMP_NUM_THREADS'] if 'OMP_NUM_THREADS' in os.environ else ''})",
        "platform": platform.platform(),
    }


def command_line() -> str:
    prog = "python -m lossless_hc.bench" if sys.argv and sys.argv[0].endswith("bench.py") else \
        (shlex.quote(sys.argv[0]) if sys.argv else "python -m lossless_hc.bench")
    return " ".join([prog] + [shlex.quote(a) for a in sys.argv[1:]])


def format_table(rows: Sequence[Sequence], header: Optional[Sequence[str]] = None,
                 align: Optional[str] = None) -> str:
    """Plain-text aligned table; ``align`` is one char per column, 'l' or 'r' (default: first column
    left, the others right)."""
    cells = [[str(c) for c in r] for r in rows]
    if header is not None:
        cells = [[str(h) for h in header]] + cells
    if not cells:
        return ""
    ncol = max(len(r) for r in cells)
    cells = [r + [""] * (ncol - len(r)) for r in cells]
    widths = [max(len(r[i]) for r in cells) for i in range(ncol)]
    align = align or ("l" + "r" * (ncol - 1))
    lines = []
    for j, r in enumerate(cells):
        parts = [c.ljust(w) if a == "l" else c.rjust(w) for c, w, a in zip(r, widths, align)]
        lines.append("  ".join(parts).rstrip())
        if header is not None and j == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def section(title: str, body: str) -> str:
    return f"{title}\n{'=' * len(title)}\n{body}\n"


def fmt_bytes(n: float) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


def fmt_ms(s: float) -> str:
    return f"{s * 1e3:.3f}"


def fmt_sci(v: float) -> str:
    return f"{v:.3e}"


# ------------------------------------------------------------------------------------------------
# timing
# ------------------------------------------------------------------------------------------------
def time_interleaved(fns: dict, repeat: int, warmup: int = 1) -> dict:
    """Median / min / max wall time of each of ``fns`` over ``repeat`` runs after ``warmup`` runs,
    returned as {name: stats}. The functions run round-robin: each repetition calls every function
    once, in the given order, and the result of each call is dropped before the next one starts (so
    allocations are not held twice). A drift of the machine (a kernel reclaiming memory after a large
    free, a neighbour on the host) then lands on all of them alike, so ratios between them stay fair;
    timed one after the other, a clone measured just after gigabytes were freed took 2-5x longer than
    the same clone a few seconds later."""
    for _ in range(warmup):
        for fn in fns.values():
            r = fn()
            del r
    times = {name: [] for name in fns}
    for _ in range(max(1, repeat)):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            r = fn()
            t1 = time.perf_counter()
            del r
            times[name].append(t1 - t0)
    return {name: {"median_s": statistics.median(ts), "min_s": min(ts), "max_s": max(ts), "runs": len(ts)}
            for name, ts in times.items()}


# ------------------------------------------------------------------------------------------------
# inputs
# ------------------------------------------------------------------------------------------------
def sample_distinct(n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """``k`` distinct uniformly random integers in [0, n) (int64, unsorted), without materialising a
    permutation of ``n`` when ``k`` is small."""
    if k > n:
        raise ValueError(f"cannot pick {k} distinct keys out of {n}")
    if k == 0:
        return torch.empty(0, dtype=torch.int64)
    if 4 * k >= n:
        return torch.randperm(n, generator=gen)[:k]
    # Draw with replacement and deduplicate: the set of distinct draws is a uniform subset given its
    # size, and a random k-subset of it is uniform among k-subsets of [0, n).
    draws = k + k // 4 + 64
    while True:
        uniq = torch.unique(torch.randint(0, n, (draws,), generator=gen, dtype=torch.int64))
        if uniq.numel() >= k:
            return uniq[torch.randperm(uniq.numel(), generator=gen)[:k]]
        draws *= 2


def make_supports(num_keys: int, k: int, workers: int, support: str, gen: torch.Generator) -> list:
    """One int64 tensor of ``k`` distinct keys per worker."""
    if support == "random":
        return [sample_distinct(num_keys, k, gen) for _ in range(workers)]
    if support == "identical":
        keys = sample_distinct(num_keys, k, gen)
        return [keys] * workers
    if support == "disjoint":
        if workers * k > num_keys:
            raise ValueError(f"disjoint support needs workers*keys = {workers * k} <= {num_keys} keys")
        keys = sample_distinct(num_keys, workers * k, gen)
        return [keys[r * k:(r + 1) * k] for r in range(workers)]
    if support == "clustered":
        window = min(num_keys, max(k, CLUSTER_WINDOW * k))
        out = []
        for _ in range(workers):
            start = int(torch.randint(0, num_keys - window + 1, (1,), generator=gen))
            out.append(sample_distinct(window, k, gen) + start)
        return out
    raise ValueError(f"support must be one of {SUPPORTS}, got {support!r}")


def fill_blocks(x: torch.Tensor, keys: torch.Tensor, block: int, gen: torch.Generator) -> None:
    """Write N(0,1) values (never exactly 0) into the blocks ``keys`` of the flat tensor ``x``."""
    n = x.numel()
    if keys.numel() == 0:
        return
    if block == 1:
        coords = keys
    else:
        coords = (keys.unsqueeze(1) * block + torch.arange(block, dtype=torch.int64)).reshape(-1)
        if int(keys.max()) * block + block > n:     # a partial last block
            coords = coords[coords < n]
    vals = torch.randn(coords.numel(), generator=gen, dtype=torch.float32)
    vals = torch.where(vals == 0, torch.ones_like(vals), vals)
    x.index_copy_(0, coords, vals)


def make_inputs(numel: int, density: float, workers: int, block: int, support: str, seed: int):
    """``workers`` dense float32 tensors with round(density*numel/block) non-zero blocks each.
    Returns (inputs, nonzero_blocks_per_worker)."""
    num_keys = -(-numel // block)
    k = int(round(density * numel / block))
    k = max(0, min(k, num_keys))
    gen = torch.Generator().manual_seed(seed)
    supports = make_supports(num_keys, k, workers, support, gen)
    xs = []
    for keys in supports:
        x = torch.zeros(numel, dtype=torch.float32)
        fill_blocks(x, keys, block, gen)
        xs.append(x)
    return xs, k


def log2_binomial(n: int, k: int) -> float:
    if k < 0 or k > n:
        return float("-inf")
    return (math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1)) / math.log(2)


# ------------------------------------------------------------------------------------------------
# codec benchmark
# ------------------------------------------------------------------------------------------------
def run_codec_bench(numel: int, density: float, workers: int, block_size: int = 1, index: str = "auto",
                    support: str = "random", repeat: int = 5, seed: int = 0, threads: int = 0,
                    log: Callable[[str], None] = lambda s: None) -> dict:
    from .codec import LosslessCodec
    from .layout import HEADER_FIELDS

    if threads > 0:
        torch.set_num_threads(threads)
    t0 = time.perf_counter()
    xs, k_blocks = make_inputs(numel, density, workers, block_size, support, seed)
    nnz_per_worker = [int(torch.count_nonzero(x)) for x in xs]
    max_nnz = max(nnz_per_worker) if nnz_per_worker else 0
    gen_s = time.perf_counter() - t0
    log(f"inputs: {workers} x {numel} float32, {k_blocks} non-zero blocks each ({gen_s:.1f} s)")

    codec = LosslessCodec(numel=numel, world_size=workers, max_nnz=max_nnz, block_size=block_size, seed=seed,
                          device="cpu", index=index, num_threads=threads)
    L = codec.layout
    log(repr(codec))

    # Every worker's payload summed (float32, in rank order), and the float64 truth (accumulated in
    # place: one extra 8*numel buffer); then every input but worker 0's is released.
    summed = torch.zeros(L.payload_numel, dtype=torch.float32)
    for x in xs:
        summed += codec.encode(x)
    truth = torch.zeros(numel, dtype=torch.float64)
    for x in xs:
        truth += x
    x0 = xs[0]
    xs.clear()

    # Timed round-robin (see time_interleaved): the baseline, a clone of one dense input (allocation
    # and copy, as a fresh encode or decode output also allocates), and a copy_ into a pre-allocated
    # buffer (raw memcpy bandwidth); encode of worker 0 and decode of the sum, each into a fresh
    # tensor and into a buffer reused across calls (what a training loop can do: no page faults).
    dst = torch.empty_like(x0)
    reuse_payload = torch.empty(L.payload_numel, dtype=torch.float32)
    reuse = torch.empty(numel, dtype=torch.float32)
    t = time_interleaved({
        "clone": lambda: torch.clone(x0),
        "copy_prealloc": lambda: dst.copy_(x0),
        "encode": lambda: codec.encode(x0),
        "encode_reused_out": lambda: codec.encode(x0, out=reuse_payload),
        "decode": lambda: codec.decode(summed),
        "decode_reused_out": lambda: codec.decode(summed, out=reuse),
    }, repeat)
    del dst, reuse_payload, reuse, x0
    t_clone, t_copy, t_enc, t_dec = t["clone"], t["copy_prealloc"], t["encode"], t["decode"]
    t_enc_reuse, t_dec_reuse = t["encode_reused_out"], t["decode_reused_out"]
    memcpy_gbps = 4 * numel / t_copy["median_s"] / 1e9 if numel else 0.0
    clone_gbps = 4 * numel / t_clone["median_s"] / 1e9 if numel else 0.0
    y, report = codec.decode(summed)

    # correctness. A support mismatch is only possible at rounding size (a sum that cancels to a few
    # ulps, or a value ~2^24 smaller than its cell-mates): count those apart from real errors, using
    # 2^-20 of the largest |sum| as the rounding scale (tests/ check the rigorous per-key bound).
    true_nz = truth != 0
    got_nz = y != 0
    u = int(true_nz.sum())
    max_abs_sum = float(truth.abs().max()) if numel else 0.0
    mismatch = true_nz ^ got_nz
    support_mismatch = int(mismatch.sum())
    tau = 2.0 ** -20 * max_abs_sum
    significant_mismatch = int((mismatch & ((truth.abs() > tau) | (y.abs() > tau))).sum()) if support_mismatch else 0
    del true_nz, got_nz, mismatch
    err = (y.double() - truth).abs_()
    max_abs_err = float(err.max()) if numel else 0.0
    del err, y, truth
    max_rel_err = max_abs_err / max_abs_sum if max_abs_sum > 0 else 0.0

    # wire
    dense_bytes = 4 * numel
    bound_bits = log2_binomial(numel, u) + 32 * u
    bound_bytes = bound_bits / 8
    header_bytes = 4 * HEADER_FIELDS
    index_bytes = 4 * (L.index.words if L.index_kind != "dense" else 0)
    sketch_bytes = codec.wire_bytes - header_bytes - index_bytes

    clone_s = t_clone["median_s"]
    return {
        "config": {"numel": numel, "density": density, "workers": workers, "block_size": block_size,
                   "index": index, "support": support, "repeat": repeat, "seed": seed, "threads": threads},
        "inputs": {"nonzero_blocks_per_worker": k_blocks, "nnz_per_worker": nnz_per_worker,
                   "max_nnz": max_nnz, "generate_s": gen_s},
        "layout": {"index_kind": L.index_kind, "num_keys": L.num_keys, "capacity_keys": L.capacity,
                   "union_keys": L.union_keys, "sketch_cells": L.sketch.cells,
                   "sketch_cells_per_union_key": L.sketch.cells / max(1, L.union_keys),
                   "index_words": L.index.words if L.index_kind != "dense" else 0,
                   "index_base": L.index.base, "index_per_word": L.index.per_word,
                   "bloom_cells": L.bloom.cells if L.bloom is not None else 0,
                   "payload_numel": L.payload_numel},
        "timing": {
            "clone": t_clone, "copy_prealloc": t_copy, "encode": t_enc, "decode": t_dec,
            "decode_reused_out": t_dec_reuse, "encode_reused_out": t_enc_reuse,
            "decode_reused_out_over_copy": t_dec_reuse["median_s"] / t_copy["median_s"] if numel else 0.0,
            "clone_ms": clone_s * 1e3, "encode_ms": t_enc["median_s"] * 1e3, "decode_ms": t_dec["median_s"] * 1e3,
            "encode_over_clone": t_enc["median_s"] / clone_s,
            "decode_over_clone": t_dec["median_s"] / clone_s,
            "encode_plus_decode_over_clone": (t_enc["median_s"] + t_dec["median_s"]) / clone_s,
            "memcpy_GBps": memcpy_gbps, "clone_GBps": clone_gbps,
        },
        "correctness": {
            "ok": report.ok, "reason": report.reason, "contributors": report.contributors,
            "candidates": report.candidates, "false_positives": report.false_positives,
            "support_keys": report.support, "peeled_keys": report.peeled, "total_keys": report.total_keys,
            "overloaded_ranks": report.overloaded_ranks,
            "true_nonzero_coords": u, "support_mismatch_coords": support_mismatch,
            "support_exact": support_mismatch == 0,
            "support_mismatch_beyond_rounding": significant_mismatch,
            "max_abs_sum": max_abs_sum, "max_abs_err": max_abs_err, "max_rel_err": max_rel_err,
        },
        "wire": {
            "wire_bytes": codec.wire_bytes, "dense_bytes": dense_bytes,
            "wire_over_dense": codec.wire_bytes / max(1, dense_bytes),
            "bound_bits": bound_bits, "bound_bytes": bound_bytes,
            "wire_over_bound": codec.wire_bytes / bound_bytes if bound_bytes > 0 else float("inf"),
            "header_bytes": header_bytes, "index_bytes": index_bytes, "sketch_bytes": sketch_bytes,
        },
    }


# ------------------------------------------------------------------------------------------------
# codec benchmark on a CUDA device
# ------------------------------------------------------------------------------------------------
def time_cuda(fn: Callable[[], object], repeat: int, warmup: int = 2) -> dict:
    """Median / min / max device time of ``fn`` in seconds, measured with CUDA events on the current
    stream around each call (after ``warmup`` calls), so host-side overhead that overlaps the device
    work is not counted, but a call that waits for the device (decode's one sync) is."""
    for _ in range(warmup):
        r = fn()
        del r
    torch.cuda.synchronize()
    times = []
    for _ in range(max(1, repeat)):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        r = fn()
        end.record()
        end.synchronize()
        del r
        times.append(start.elapsed_time(end) / 1e3)
    return {"median_s": statistics.median(times), "min_s": min(times), "max_s": max(times), "runs": len(times)}


def run_codec_bench_cuda(numel: int, density: float, workers: int, block_size: int = 1, index: str = "auto",
                         support: str = "random", repeat: int = 20, seed: int = 0,
                         log: Callable[[str], None] = lambda s: None) -> dict:
    """Encode (one worker) and decode (the SUM of all workers' payloads) on the current CUDA device,
    against a device-to-device copy of one dense input measured in the same run; both into reused
    buffers (``out=``), as a training loop would. Throughput is GB/s of dense float32 gradient
    (4 * numel bytes per call); ``*_over_copy`` is the copy's time over the operation's time (1.0:
    as fast as copying the gradient once)."""
    from . import _cuda
    from .codec import LosslessCodec

    dev = torch.device("cuda", torch.cuda.current_device())
    t0 = time.perf_counter()
    xs_cpu, k_blocks = make_inputs(numel, density, workers, block_size, support, seed)
    max_nnz = max(int(torch.count_nonzero(x)) for x in xs_cpu) if xs_cpu else 0
    truth = torch.zeros(numel, dtype=torch.float64)
    for x in xs_cpu:
        truth += x
    xs = [x.to(dev) for x in xs_cpu]
    del xs_cpu
    log(f"inputs: {workers} x {numel} float32 on {torch.cuda.get_device_name(dev)}, {k_blocks} non-zero blocks each "
        f"({time.perf_counter() - t0:.1f} s)")
    codec = LosslessCodec(numel=numel, world_size=workers, max_nnz=max_nnz, block_size=block_size, seed=seed,
                          device=dev, index=index)
    L = codec.layout
    log(repr(codec) + f"; kernels: {_cuda.backend_name()}")

    x0 = xs[0]
    dst = torch.empty_like(x0)
    t_copy = time_cuda(lambda: dst.copy_(x0), repeat)
    payload = torch.empty(L.payload_numel, dtype=torch.float32, device=dev)
    torch.cuda.reset_peak_memory_stats(dev)
    base_mem = torch.cuda.memory_allocated(dev)
    t_enc = time_cuda(lambda: codec.encode(x0, out=payload), repeat)
    enc_peak = torch.cuda.max_memory_allocated(dev) - base_mem
    summed = torch.zeros(L.payload_numel, dtype=torch.float32, device=dev)
    for x in xs:
        summed += codec.encode(x)
    xs0_again = xs[0]
    del x0, xs
    out = dst
    torch.cuda.reset_peak_memory_stats(dev)
    base_mem = torch.cuda.memory_allocated(dev)
    t_dec = time_cuda(lambda: codec.decode(summed, out=out), repeat)
    dec_peak = torch.cuda.max_memory_allocated(dev) - base_mem
    # determinism: two more decodes of the same payload, bit for bit
    y1, report = codec.decode(summed)
    y2, _ = codec.decode(summed)
    deterministic = bool(torch.equal(y1.view(torch.int32), y2.view(torch.int32)))
    y = y1.cpu()
    del y1, y2
    # Where the time goes: one more encode and decode with every kernel timed (synchronising).
    with _cuda.profile() as enc_prof:
        codec.encode(xs0_again, out=payload)
    with _cuda.profile() as dec_prof:
        codec.decode(summed, out=out)

    true_nz, got_nz = truth != 0, y != 0
    mismatch = int((true_nz ^ got_nz).sum())
    max_abs_sum = float(truth.abs().max()) if numel else 0.0
    max_abs_err = float((y.double() - truth).abs().max()) if numel else 0.0
    tau = 2.0 ** -20 * max_abs_sum
    beyond = int(((true_nz ^ got_nz) & ((truth.abs() > tau) | (y.abs() > tau))).sum()) if mismatch else 0
    dense_bytes = 4 * numel
    copy_s = t_copy["median_s"]
    return {
        "config": {"numel": numel, "density": density, "workers": workers, "block_size": block_size, "index": index,
                   "support": support, "repeat": repeat, "seed": seed, "device": str(dev)},
        "device": {"name": torch.cuda.get_device_name(dev), "kernels": _cuda.backend_name(),
                   "multiprocessors": torch.cuda.get_device_properties(dev).multi_processor_count,
                   "torch_cuda": torch.version.cuda},
        "layout": {"index_kind": L.index_kind, "num_keys": L.num_keys, "capacity_keys": L.capacity,
                   "union_keys": L.union_keys, "sketch_cells": L.sketch.cells, "payload_numel": L.payload_numel,
                   "wire_over_dense": codec.wire_bytes / max(1, dense_bytes)},
        "timing": {
            "copy": t_copy, "encode": t_enc, "decode": t_dec,
            "copy_GBps_of_gradient": dense_bytes / copy_s / 1e9,
            "copy_GBps_read_plus_write": 2 * dense_bytes / copy_s / 1e9,
            "encode_GBps_of_gradient": dense_bytes / t_enc["median_s"] / 1e9,
            "decode_GBps_of_gradient": dense_bytes / t_dec["median_s"] / 1e9,
            "encode_over_copy": copy_s / t_enc["median_s"], "decode_over_copy": copy_s / t_dec["median_s"],
            "encode_scratch_bytes": enc_peak, "decode_scratch_bytes": dec_peak,
            "encode_kernels_ms": enc_prof.ms, "decode_kernels_ms": dec_prof.ms,
            "encode_kernels_table": enc_prof.table(), "decode_kernels_table": dec_prof.table(),
        },
        "correctness": {"ok": report.ok, "reason": report.reason, "candidates": report.candidates,
                        "false_positives": report.false_positives, "support_keys": report.support,
                        "peeled_keys": report.peeled, "support_mismatch_coords": mismatch,
                        "support_mismatch_beyond_rounding": beyond, "max_abs_sum": max_abs_sum,
                        "max_abs_err": max_abs_err, "deterministic": deterministic},
    }


def render_codec_cuda(res: dict, cmd: str) -> str:
    c, d, lay, t, cor = (res[k] for k in ("config", "device", "layout", "timing", "correctness"))
    out = [section("lossless_hc codec benchmark (CUDA)", format_table([
        ("command", cmd),
        ("device", f"{d['name']} ({d['multiprocessors']} SMs), torch CUDA {d['torch_cuda']}, kernels: {d['kernels']}"),
        ("config", f"numel {c['numel']:,}, {c['workers']} workers, density {c['density']:g}, block {c['block_size']}, "
                   f"index {lay['index_kind']} (requested {c['index']}), {c['repeat']} timed runs (median)"),
        ("layout", f"union {lay['union_keys']:,} keys, sketch {lay['sketch_cells']:,} cells, "
                   f"wire/dense {lay['wire_over_dense']:.4f}"),
    ], align="ll"))]
    rows = []
    for name, key, gbps in (("device-to-device copy", "copy", t["copy_GBps_of_gradient"]),
                            ("encode (1 worker, out=)", "encode", t["encode_GBps_of_gradient"]),
                            (f"decode (sum of {c['workers']}, out=)", "decode", t["decode_GBps_of_gradient"])):
        tm = t[key]
        frac = 1.0 if key == "copy" else t[f"{key}_over_copy"]
        rows.append((name, fmt_ms(tm["median_s"]), fmt_ms(tm["min_s"]), fmt_ms(tm["max_s"]), f"{gbps:.1f}",
                     f"{frac:.3f}"))
    body = format_table(rows, header=("operation", "median ms", "min ms", "max ms", "GB/s of gradient",
                                      "fraction of copy"))
    body += (f"\ncopy moves {t['copy_GBps_read_plus_write']:.0f} GB/s counting read + write; targets: encode >= 0.50, "
             f"decode >= 0.25 of copy. Scratch: encode {fmt_bytes(t['encode_scratch_bytes'])}, "
             f"decode {fmt_bytes(t['decode_scratch_bytes'])}")
    out.append(section("time", body))
    out.append(section("kernels (one profiled run each; every launch waited for)",
                       "encode:\n" + t["encode_kernels_table"] + "\ndecode:\n" + t["decode_kernels_table"]))
    out.append(section("correctness (vs float64 dense sum)", format_table([
        ("decode ok", f"{cor['ok']}" + (f" ({cor['reason']})" if cor["reason"] else "")),
        ("candidates / false positives", f"{cor['candidates']:,} / {cor['false_positives']:,}"),
        ("support keys / peeled", f"{cor['support_keys']:,} / {cor['peeled_keys']:,}"),
        ("support mismatch (coords)", f"{cor['support_mismatch_coords']:,} "
                                      f"({cor['support_mismatch_beyond_rounding']:,} beyond 2^-20 of max |sum|)"),
        ("max abs error", f"{fmt_sci(cor['max_abs_err'])} (max |sum| {cor['max_abs_sum']:.4g})"),
        ("bitwise deterministic (2 decodes)", cor["deterministic"]),
    ], align="ll")))
    return "\n".join(out)


def render_codec(res: dict, machine: dict, cmd: str) -> str:
    c, inp, lay, t, cor, w = (res[k] for k in ("config", "inputs", "layout", "timing", "correctness", "wire"))
    out = []
    out.append(section("lossless_hc codec benchmark", format_table([
        ("command", cmd),
        ("cpu", f"{machine['cpu']} ({machine['cores']} cores, {machine['cores_available']} available)"),
        ("torch", f"{machine['torch']} (torch threads {machine['torch_threads']}, codec threads "
                  f"{machine['codec_threads']})"),
        ("python", machine["python"]),
    ], align="ll")))
    out.append(section("configuration", format_table([
        ("numel", f"{c['numel']:,}"),
        ("workers", c["workers"]),
        ("density", f"{c['density']:g}"),
        ("block size", c["block_size"]),
        ("support", c["support"]),
        ("non-zero blocks / worker", f"{inp['nonzero_blocks_per_worker']:,}"),
        ("max_nnz (coords / worker)", f"{inp['max_nnz']:,}"),
        ("index", f"{lay['index_kind']} (requested {c['index']})"),
        ("keys / capacity / union", f"{lay['num_keys']:,} / {lay['capacity_keys']:,} / {lay['union_keys']:,}"),
        ("sketch cells", f"{lay['sketch_cells']:,} ({lay['sketch_cells_per_union_key']:.3f} per union key)"),
        ("payload numel", f"{lay['payload_numel']:,}"),
        ("repeat", f"{c['repeat']} (median, after 1 warm-up; all timings round-robin)"),
    ], align="ll")))
    clone = t["clone"]["median_s"]
    rows = [
        ("clone (1 dense input)", fmt_ms(clone), fmt_ms(t["clone"]["min_s"]), fmt_ms(t["clone"]["max_s"]), "1.000"),
        ("encode (1 worker)", fmt_ms(t["encode"]["median_s"]), fmt_ms(t["encode"]["min_s"]),
         fmt_ms(t["encode"]["max_s"]), f"{t['encode_over_clone']:.3f}"),
        (f"decode (sum of {c['workers']})", fmt_ms(t["decode"]["median_s"]), fmt_ms(t["decode"]["min_s"]),
         fmt_ms(t["decode"]["max_s"]), f"{t['decode_over_clone']:.3f}"),
        ("encode + decode", fmt_ms(t["encode"]["median_s"] + t["decode"]["median_s"]), "", "",
         f"{t['encode_plus_decode_over_clone']:.3f}"),
        ("encode into a reused out=", fmt_ms(t["encode_reused_out"]["median_s"]),
         fmt_ms(t["encode_reused_out"]["min_s"]), fmt_ms(t["encode_reused_out"]["max_s"]),
         f"{t['encode_reused_out']['median_s'] / clone:.3f}"),
        ("decode into a reused out=", fmt_ms(t["decode_reused_out"]["median_s"]),
         fmt_ms(t["decode_reused_out"]["min_s"]), fmt_ms(t["decode_reused_out"]["max_s"]),
         f"{t['decode_reused_out']['median_s'] / clone:.3f}"),
    ]
    body = format_table(rows, header=("operation", "median ms", "min ms", "max ms", "x clone"))
    body += (f"\nmemcpy (pre-allocated copy_): {fmt_ms(t['copy_prealloc']['median_s'])} ms = "
             f"{t['memcpy_GBps']:.2f} GB/s; clone: {t['clone_GBps']:.2f} GB/s (bytes copied / s); "
             f"decode into a reused out= = {t['decode_reused_out_over_copy']:.1f}x that copy_")
    out.append(section("time", body))
    out.append(section("correctness (vs float64 dense sum)", format_table([
        ("decode ok", f"{cor['ok']}" + (f" ({cor['reason']})" if cor["reason"] else "")),
        ("contributors", cor["contributors"]),
        ("candidates / false positives", f"{cor['candidates']:,} / {cor['false_positives']:,}"),
        ("support keys / peeled", f"{cor['support_keys']:,} / {cor['peeled_keys']:,}"),
        ("true non-zero coords (u)", f"{cor['true_nonzero_coords']:,}"),
        ("support equal", f"{cor['support_exact']} ({cor['support_mismatch_coords']:,} mismatched coords, "
                          f"{cor['support_mismatch_beyond_rounding']:,} beyond 2^-20 of max |sum|)"),
        ("max |sum|", f"{cor['max_abs_sum']:.4g}"),
        ("max abs error", fmt_sci(cor["max_abs_err"])),
        ("max rel error (/ max |sum|)", fmt_sci(cor["max_rel_err"])),
    ], align="ll")))
    out.append(section("wire (per worker)", format_table([
        ("payload", fmt_bytes(w["wire_bytes"]), f"{w['wire_bytes']:,}", "1.000"),
        ("  header", fmt_bytes(w["header_bytes"]), f"{w['header_bytes']:,}",
         f"{w['header_bytes'] / max(1, w['wire_bytes']):.3f}"),
        ("  index", fmt_bytes(w["index_bytes"]), f"{w['index_bytes']:,}",
         f"{w['index_bytes'] / max(1, w['wire_bytes']):.3f}"),
        ("  sketch", fmt_bytes(w["sketch_bytes"]), f"{w['sketch_bytes']:,}",
         f"{w['sketch_bytes'] / max(1, w['wire_bytes']):.3f}"),
        ("dense float32", fmt_bytes(w["dense_bytes"]), f"{w['dense_bytes']:,}",
         f"wire/dense = {w['wire_over_dense']:.4f}"),
        ("info bound (log2 C(n,u) + 32u)", fmt_bytes(w["bound_bytes"]), f"{w['bound_bytes']:,.0f}",
         f"wire/bound = {w['wire_over_bound']:.3f}"),
    ], header=("part", "size", "bytes", "fraction"))))
    return "\n".join(out)


# ------------------------------------------------------------------------------------------------
# peeling benchmark
# ------------------------------------------------------------------------------------------------
def run_peel_bench(keys_list: Sequence[int], trials: int = 20, numel_factor: int = 20, seed: int = 0,
                   threads: int = 0, index: str = "bitmap",
                   log: Callable[[str], None] = lambda s: None) -> dict:
    from .codec import LosslessCodec
    from .layout import PEEL_FAILURE_TARGET, sketch_table_for

    if threads > 0:
        torch.set_num_threads(threads)
    rows = []
    for keys in keys_list:
        numel = numel_factor * keys
        table = sketch_table_for(keys)
        failures, errors, dec_times = 0, [], []
        reasons = {}
        unresolved = []
        t_start = time.perf_counter()
        for trial in range(trials):
            trial_seed = seed * 1_000_003 + trial
            gen = torch.Generator().manual_seed(trial_seed ^ (keys * 0x9E3779B1))
            x = torch.zeros(numel, dtype=torch.float32)
            fill_blocks(x, sample_distinct(numel, keys, gen), 1, gen)
            codec = LosslessCodec(numel=numel, world_size=1, max_nnz=keys, block_size=1, seed=trial_seed,
                                  device="cpu", index=index, num_threads=threads)
            payload = codec.encode(x)
            codec.decode(payload)   # warm-up (allocations, thread pool)
            t0 = time.perf_counter()
            y, report = codec.decode(payload)
            dec_times.append(time.perf_counter() - t0)
            if report.ok:
                errors.append(float((y.double() - x.double()).abs().max()))
            else:
                failures += 1
                reasons[report.reason] = reasons.get(report.reason, 0) + 1
                unresolved.append(report.unresolved)
            del x, y, payload
        med = statistics.median(dec_times)
        row = {
            "keys": keys, "numel": numel, "trials": trials, "sketch_cells": table.cells,
            "cells_per_key": table.cells / max(1, keys), "index": index,
            "failures": failures, "failure_rate": failures / trials,
            # one-sided 95% upper bound on the failure probability (exact binomial for 0 failures)
            "failure_rate_95_upper": _binomial_upper(failures, trials),
            "failure_target": PEEL_FAILURE_TARGET, "failure_reasons": reasons, "unresolved_keys": unresolved,
            "max_abs_err": max(errors) if errors else float("nan"),
            "median_abs_err": statistics.median(errors) if errors else float("nan"),
            "decode_ms_median": med * 1e3, "decode_ns_per_key": med / max(1, keys) * 1e9,
            "wall_s": time.perf_counter() - t_start,
        }
        rows.append(row)
        log(f"keys={keys}: {failures}/{trials} failures, max abs err {row['max_abs_err']:.3e}, "
            f"{row['decode_ns_per_key']:.1f} ns/key")
    return {"config": {"keys": list(keys_list), "trials": trials, "numel_factor": numel_factor, "seed": seed,
                       "threads": threads, "index": index, "world_size": 1, "values": "N(0,1)"},
            "rows": rows}


def _binomial_upper(failures: int, trials: int, conf: float = 0.95) -> float:
    """One-sided Clopper-Pearson upper bound on a failure probability (bisection on the binomial CDF)."""
    if trials <= 0:
        return 1.0
    if failures >= trials:
        return 1.0

    def cdf(p: float) -> float:
        total, term = 0.0, (1 - p) ** trials
        for i in range(failures + 1):
            total += term
            term *= (trials - i) / (i + 1) * p / (1 - p) if p < 1 else 0.0
        return total

    lo, hi = failures / trials, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if cdf(mid) > 1 - conf:
            lo = mid
        else:
            hi = mid
    return hi


def render_peel(res: dict, machine: dict, cmd: str) -> str:
    c = res["config"]
    out = [section("lossless_hc peeling benchmark (sketch_table_for)", format_table([
        ("command", cmd),
        ("cpu", f"{machine['cpu']} ({machine['cores']} cores, {machine['cores_available']} available)"),
        ("torch", f"{machine['torch']} (torch threads {machine['torch_threads']}, codec threads "
                  f"{machine['codec_threads']})"),
        ("setup", f"1 worker, N(0,1) values, numel = {c['numel_factor']} x keys, {c['index']} index, "
                  f"{c['trials']} trials (codec seed varies per trial)"),
    ], align="ll"))]
    rows = []
    for r in res["rows"]:
        rows.append((f"{r['keys']:,}", f"{r['sketch_cells']:,}", f"{r['cells_per_key']:.3f}",
                     f"{r['failures']}/{r['trials']}", f"{r['failure_rate_95_upper']:.3f}",
                     fmt_sci(r["max_abs_err"]), fmt_sci(r["median_abs_err"]),
                     f"{r['decode_ms_median']:.3f}", f"{r['decode_ns_per_key']:.1f}"))
    body = format_table(rows, header=("keys", "cells", "cells/key", "failed", "95% upper", "max abs err",
                                      "median max err", "decode ms", "ns/key"))
    target = res["rows"][0]["failure_target"] if res["rows"] else None
    if target is not None:
        body += f"\nsizing target: peel failure probability < {target:g} per decode"
    for r in res["rows"]:
        if r["failure_reasons"]:
            body += f"\nkeys={r['keys']}: " + "; ".join(f"{n}x {why}" for why, n in r["failure_reasons"].items())
    out.append(section("results", body))
    return "\n".join(out)


# ------------------------------------------------------------------------------------------------
# CLI
# ------------------------------------------------------------------------------------------------
def _positive_int(s: str) -> int:
    v = int(s)
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {s}")
    return v


def _int_list(s: str) -> list:
    try:
        vals = [int(v) for v in s.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {s!r}")
    if not vals or any(v < 1 for v in vals):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {s!r}")
    return vals


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m lossless_hc.bench", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    c = sub.add_parser("codec", help="encode/decode time vs torch.clone, exactness, and wire size")
    c.add_argument("--numel", type=_positive_int, default=1 << 26, help="elements per tensor (default 2**26)")
    c.add_argument("--density", type=float, default=0.01, help="fraction of non-zero coordinates per worker")
    c.add_argument("--workers", type=_positive_int, default=8, help="ranks whose payloads are summed")
    c.add_argument("--block-size", type=_positive_int, default=1, help="coordinates per key")
    c.add_argument("--index", choices=("auto", "bitmap", "bloom", "multilevel", "dense"), default="auto")
    c.add_argument("--support", choices=SUPPORTS, default="random",
                   help="random: independent per worker; identical; disjoint; clustered: each worker's "
                        f"blocks in a random window ~{CLUSTER_WINDOW}x their count")
    c.add_argument("--repeat", type=_positive_int, default=5, help="timed runs (median reported)")
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--threads", type=int, default=0, help="codec (and torch) threads; 0 = default")
    c.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cuda: time the CUDA kernels with CUDA events against a device-to-device copy")
    c.add_argument("--json", metavar="PATH", help="write all numbers to this JSON file")
    c.set_defaults(func=_cmd_codec)

    q = sub.add_parser("peel", help="peeling failure rate / accuracy / speed of sketch_table_for")
    q.add_argument("--keys", type=_int_list, default=[1000, 10000, 100000, 1000000],
                   help="comma-separated key counts")
    q.add_argument("--trials", type=_positive_int, default=20)
    q.add_argument("--numel-factor", type=_positive_int, default=20, help="numel = factor * keys")
    q.add_argument("--index", choices=("bitmap", "bloom"), default="bitmap")
    q.add_argument("--seed", type=int, default=0)
    q.add_argument("--threads", type=int, default=0)
    q.add_argument("--json", metavar="PATH")
    q.set_defaults(func=_cmd_peel)

    t = sub.add_parser("thc", help="THCCodec encode/decode time vs torch.clone, bits/coordinate, NMSE")
    t.add_argument("--numel", type=_positive_int, default=1 << 24, help="elements per tensor (default 2**24)")
    t.add_argument("--workers", type=_positive_int, default=8)
    t.add_argument("--bits", type=_positive_int, default=4)
    t.add_argument("--granularity", type=_positive_int, default=30)
    t.add_argument("--overflow-freq", type=float, default=32)
    t.add_argument("--symmetric-table", action="store_true", help="the symmetric (published-shape) table")
    t.add_argument("--averaged", action="store_true", help="aggregate by AVERAGE instead of SUM")
    t.add_argument("--repeat", type=_positive_int, default=5)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--threads", type=int, default=0)
    t.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cuda: the CUDA kernels, checked bit for bit against CPU codecs run in lockstep")
    t.add_argument("--no-cpu-check", action="store_true", help="with --device cuda: skip the CPU lockstep check")
    t.add_argument("--json", metavar="PATH")
    t.set_defaults(func=_cmd_thc)

    w = sub.add_parser("wire", help="wire bits per aggregate non-zero of every index kind and of the automatic "
                                    "choice vs the information bound; table and plot")
    w.add_argument("--numel", type=_positive_int, default=1 << 26, help="elements per tensor (default 2**26)")
    w.add_argument("--densities", type=lambda s: [float(v) for v in s.split(",")], default=None,
                   help="comma-separated aggregate densities (default 1e-5..0.5)")
    w.add_argument("--workers", type=_int_list, default=None, help="comma-separated world sizes (default 2,8,16,64)")
    w.add_argument("--block-sizes", type=_int_list, default=None, help="comma-separated block sizes (default 1,32)")
    w.add_argument("--plot", metavar="PATH", default="docs/wire_bits.png", help="PNG path ('' for none)")
    w.add_argument("--verify-numel", type=int, default=0,
                   help="also encode/decode one instance per point at this numel and check it is exact")
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--json", metavar="PATH")
    w.set_defaults(func=_cmd_wire)

    cl = sub.add_parser("cluster", help="emulated cluster (network namespaces, shaped links): step time, wire "
                                        "bytes and aggregation throughput per compression; needs root")
    from .cluster import add_arguments as add_cluster_arguments
    add_cluster_arguments(cl)

    tr = sub.add_parser("train", add_help=False,
                       help="uncompressed vs lossless training side by side on local workers (`make demo`); "
                            "`train --help` for its options")
    tr.set_defaults(func=None)
    return p


def _log(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def _json_safe(obj):
    """NaN/Inf -> None (strict JSON); tuples -> lists."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_json_safe(v) for v in obj]
    return obj


def _write_json(path: Optional[str], obj: dict) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(_json_safe(obj), f, indent=2, default=str, allow_nan=False)
            f.write("\n")
        _log(f"wrote {path}")


def _cmd_codec(args) -> int:
    if not 0.0 <= args.density <= 1.0:
        raise SystemExit(f"--density must be in [0, 1], got {args.density}")
    cmd = command_line()
    if args.device == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("python -m lossless_hc.bench codec --device cuda: no CUDA device")
        try:
            res = run_codec_bench_cuda(args.numel, args.density, args.workers, args.block_size, args.index,
                                       args.support, max(args.repeat, 10), args.seed, log=_log)
        except ValueError as exc:
            raise SystemExit(f"python -m lossless_hc.bench codec: error: {exc}")
        print(render_codec_cuda(res, cmd))
        _write_json(args.json, {"command": cmd, "machine": machine_info(0), **res})
        cor = res["correctness"]
        return 0 if cor["ok"] and cor["support_mismatch_beyond_rounding"] == 0 and cor["deterministic"] else 1
    try:
        res = run_codec_bench(args.numel, args.density, args.workers, args.block_size, args.index, args.support,
                              args.repeat, args.seed, args.threads, log=_log)
    except ValueError as exc:
        raise SystemExit(f"python -m lossless_hc.bench codec: error: {exc}")
    machine = machine_info(args.threads)
    print(render_codec(res, machine, cmd))
    _write_json(args.json, {"command": cmd, "machine": machine, **res})
    cor = res["correctness"]
    return 0 if cor["ok"] and cor["support_mismatch_beyond_rounding"] == 0 else 1


def _cmd_peel(args) -> int:
    cmd = command_line()
    res = run_peel_bench(args.keys, args.trials, args.numel_factor, args.seed, args.threads, args.index, log=_log)
    machine = machine_info(args.threads)
    print(render_peel(res, machine, cmd))
    _write_json(args.json, {"command": cmd, "machine": machine, **res})
    return 0


def _cmd_wire(args) -> int:
    from . import bench_wire
    cmd = command_line()
    res = bench_wire.run_wire_bench(args.numel, args.densities or bench_wire.DEFAULT_DENSITIES,
                                    args.workers or bench_wire.DEFAULT_WORKERS,
                                    args.block_sizes or bench_wire.DEFAULT_BLOCKS, args.verify_numel, args.seed,
                                    log=_log)
    machine = machine_info(0)
    print(bench_wire.render_wire(res, cmd, machine))
    if args.plot:
        os.makedirs(os.path.dirname(args.plot) or ".", exist_ok=True)
        bench_wire.plot_wire(res, args.plot)
        _log(f"wrote {args.plot}")
    _write_json(args.json, {"command": cmd, "machine": machine, **res})
    return 0


def _cmd_thc(args) -> int:
    from .bench_thc import render_thc, run_thc_bench
    cmd = command_line()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("python -m lossless_hc.bench thc --device cuda: no CUDA device")
    try:
        res = run_thc_bench(args.numel, args.workers, args.bits, args.granularity, args.overflow_freq,
                            args.symmetric_table, args.averaged, args.repeat, args.seed, args.threads, log=_log,
                            device=args.device, cpu_check=not args.no_cpu_check)
    except ValueError as exc:
        raise SystemExit(f"python -m lossless_hc.bench thc: error: {exc}")
    machine = machine_info(args.threads)
    print(render_thc(res, machine, cmd))
    _write_json(args.json, {"command": cmd, "machine": machine, **res})
    return 0 if res.get("cpu_equal") is None or res["cpu_equal"]["ok"] else 1


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["train"]:  # its own parser: lossless_hc.workloads.demo
        from .workloads import demo
        return demo.main(argv[1:])
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
