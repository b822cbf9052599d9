"""``python -m lossless_hc.bench codec``: LosslessCodec encode/decode time against a clone (CPU) or a
device-to-device copy (CUDA) of the same bytes in the same run, exactness against the float64 sum,
and wire size against dense float32 and the information bound."""
from __future__ import annotations

import time
from typing import Callable

import torch

from lossless_hc.bench.common import (fmt_bytes, fmt_ms, fmt_sci, format_table, machine_rows, section,
                                      time_cuda, time_interleaved)
from lossless_hc.backends import cuda_runtime
from lossless_hc.lhc.codec import LosslessCodec, key_coordinates
from lossless_hc.lhc.contract import outside_bounds, truth as truth_and_mass, unproven_coordinates
from lossless_hc.lhc.cost_model import information_bound_bits
from lossless_hc.lhc.layout import HEADER_FIELDS

SUPPORTS = ("random", "identical", "disjoint", "clustered")
CLUSTER_WINDOW = 4   # clustered support: a worker's keys lie in a random window of ~4x their count


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
    if keys.numel() == 0:
        return
    coords, _ = key_coordinates(keys, block, x.numel())
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


def wire_parts(L) -> tuple:
    """``(header, index, sketch)`` bytes of a payload of layout ``L``, which add up to its wire bytes:
    the index is everything between the header and the value sketch (the counting bitmap, the Bloom
    counters, or the multilevel index's coarse bitmap *and* its fine node tables), the sketch the
    value sketch and its mass channel (the dense kind: the raw values)."""
    header = 4 * HEADER_FIELDS
    # The multilevel fine tables sit between L.index's words and the sketch (layout.sketch_offset):
    # L.index is only the coarse level, so its words alone would book the tables to the sketch.
    index = 4 * (L.sketch_offset - L.index_offset) if L.index_kind != "dense" else 0
    return header, index, L.wire_bytes - header - index


def bound_stats(report, y: torch.Tensor, truth: torch.Tensor, mass: torch.Tensor, workers: int, block: int,
                rtol: float, verify: bool = False) -> dict:
    """The decoder's per-key error bounds (``DecodeReport.error_bounds``) against the float64 truth
    (the sum ``truth`` of ``workers`` inputs and their absolute ``mass``), over the support's
    coordinates: ``bound_violations`` counts the coordinates outside them as the contract's
    :func:`~lossless_hc.lhc.contract.outside_bounds` judges (must be 0), ``err_over_bound_*`` how
    much of E the actual error uses, ``inexact_within_rtol`` how many keys listed INEXACT are in
    fact within rtol of the truth on every coordinate (the bound being worst case), and
    ``inexact_coords`` / ``unproven_coords`` the listed keys' coordinates and those of them a
    re-aggregation sends (:func:`~lossless_hc.lhc.contract.unproven_coordinates`). Empty when the
    report carries no bounds (the dense layout, a failed decode)."""
    if report.error_bounds is None:
        return {}
    keys, E = report.error_bounds
    violations = int(outside_bounds(y, truth, mass, workers, report.error_bounds, block).sum())
    coords, rows = key_coordinates(keys, block, truth.numel())
    Ec = E[rows]
    t = truth[coords]
    err = (y.reshape(-1)[coords].double() - t).abs_()
    used = err / Ec.clamp_min(1e-300)
    inexact = report.inexact_keys
    inexact_within = 0
    if inexact.numel():
        # A key is within rtol unless one of its coordinates is not; keys is sorted and holds the
        # inexact keys.
        outside = torch.zeros(keys.numel(), dtype=torch.bool)
        outside[rows[err > rtol * t.abs()]] = True
        inexact_within = int((~outside[torch.searchsorted(keys, inexact)]).sum())
    listed = key_coordinates(inexact.to(torch.int64), block, truth.numel())[0].numel()
    unproven = unproven_coordinates(y, report, block, rtol, verify).numel() if inexact.numel() else 0
    return {"bound_violations": violations, "err_over_bound_median": float(used.median()) if used.numel() else 0.0,
            "err_over_bound_max": float(used.max()) if used.numel() else 0.0,
            "bound_median": float(E.median()) if E.numel() else 0.0,
            "inexact_within_rtol": inexact_within, "inexact_coords": listed, "unproven_coords": unproven}


# ------------------------------------------------------------------------------------------------
# codec benchmark
# ------------------------------------------------------------------------------------------------
def run_codec_bench(numel: int, density: float, workers: int, block_size: int = 1, index: str = "auto",
                    support: str = "random", repeat: int = 5, seed: int = 0, threads: int = 0,
                    log: Callable[[str], None] = lambda s: None, verify: bool = False) -> dict:

    if threads > 0:
        torch.set_num_threads(threads)
    t0 = time.perf_counter()
    xs, k_blocks = make_inputs(numel, density, workers, block_size, support, seed)
    nnz_per_worker = [int(torch.count_nonzero(x)) for x in xs]
    max_nnz = max(nnz_per_worker) if nnz_per_worker else 0
    gen_s = time.perf_counter() - t0
    log(f"inputs: {workers} x {numel} float32, {k_blocks} non-zero blocks each ({gen_s:.1f} s)")

    codec = LosslessCodec(numel=numel, world_size=workers, max_nnz=max_nnz, block_size=block_size, seed=seed,
                          device="cpu", index=index, num_threads=threads, verify=verify)
    L = codec.layout
    log(repr(codec))

    # Every worker's payload summed (float32, in rank order), and the float64 truth and absolute mass
    # (two extra 8*numel buffers); then every input but worker 0's is released.
    summed = torch.zeros(L.payload_numel, dtype=torch.float32)
    for x in xs:
        summed += codec.encode(x)
    truth, mass = truth_and_mass(xs)
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
    y, report = codec.decode(summed, error_bounds=True)
    bounds = bound_stats(report, y, truth, mass, workers, block_size, codec.rtol, codec.verify)

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
    bound_bits = information_bound_bits(numel, u)
    bound_bytes = bound_bits / 8
    header_bytes, index_bytes, sketch_bytes = wire_parts(L)

    clone_s = t_clone["median_s"]
    return {
        "config": {"numel": numel, "density": density, "workers": workers, "block_size": block_size,
                   "index": index, "support": support, "repeat": repeat, "seed": seed, "threads": threads,
                   "verify": verify},
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
            "inexact_keys": int(report.inexact_keys.numel()),
            "overloaded_ranks": report.overloaded_ranks,
            "true_nonzero_coords": u, "support_mismatch_coords": support_mismatch,
            "support_exact": support_mismatch == 0,
            "support_mismatch_beyond_rounding": significant_mismatch,
            "max_abs_sum": max_abs_sum, "max_abs_err": max_abs_err, "max_rel_err": max_rel_err,
            **bounds,
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
def run_codec_bench_cuda(numel: int, density: float, workers: int, block_size: int = 1, index: str = "auto",
                         support: str = "random", repeat: int = 20, seed: int = 0,
                         log: Callable[[str], None] = lambda s: None, verify: bool = False) -> dict:
    """Encode (one worker) and decode (the SUM of all workers' payloads) on the current CUDA device,
    against a device-to-device copy of one dense input measured in the same run; both into reused
    buffers (``out=``), as a training loop would. Throughput is GB/s of dense float32 gradient
    (4 * numel bytes per call); ``*_over_copy`` is the copy's time over the operation's time (1.0:
    as fast as copying the gradient once)."""

    dev = torch.device("cuda", torch.cuda.current_device())
    t0 = time.perf_counter()
    xs_cpu, k_blocks = make_inputs(numel, density, workers, block_size, support, seed)
    max_nnz = max(int(torch.count_nonzero(x)) for x in xs_cpu) if xs_cpu else 0
    truth, mass = truth_and_mass(xs_cpu)
    xs = [x.to(dev) for x in xs_cpu]
    del xs_cpu
    log(f"inputs: {workers} x {numel} float32 on {torch.cuda.get_device_name(dev)}, {k_blocks} non-zero blocks each "
        f"({time.perf_counter() - t0:.1f} s)")
    codec = LosslessCodec(numel=numel, world_size=workers, max_nnz=max_nnz, block_size=block_size, seed=seed,
                          device=dev, index=index, verify=verify)
    L = codec.layout
    log(repr(codec) + f"; kernels: {cuda_runtime.backend_name()}")

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
    y1, report = codec.decode(summed, error_bounds=True)
    y2, _ = codec.decode(summed)
    deterministic = bool(torch.equal(y1.view(torch.int32), y2.view(torch.int32)))
    y = y1.cpu()
    del y1, y2
    # Where the time goes: one more encode and decode with every kernel timed (synchronising).
    with cuda_runtime.profile() as enc_prof:
        codec.encode(xs0_again, out=payload)
    with cuda_runtime.profile() as dec_prof:
        codec.decode(summed, out=out)

    bounds = bound_stats(report, y, truth, mass, workers, block_size, codec.rtol, codec.verify)
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
                   "support": support, "repeat": repeat, "seed": seed, "device": str(dev), "verify": verify},
        "device": {"name": torch.cuda.get_device_name(dev), "kernels": cuda_runtime.backend_name(),
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
                        "peeled_keys": report.peeled, "inexact_keys": int(report.inexact_keys.numel()),
                        "support_mismatch_coords": mismatch,
                        "support_mismatch_beyond_rounding": beyond, "max_abs_sum": max_abs_sum,
                        "max_abs_err": max_abs_err, "deterministic": deterministic, **bounds},
    }


def bound_rows(cor: dict) -> list:
    """The rendered rows of bound_stats (none without bounds)."""
    if "bound_violations" not in cor:
        return []
    return [("error bounds E(k) hold", f"{cor['bound_violations'] == 0} ({cor['bound_violations']:,} coords outside; "
                                       f"median E {fmt_sci(cor['bound_median'])})"),
            ("actual error / E", f"median {fmt_sci(cor['err_over_bound_median'])}, "
                                 f"max {fmt_sci(cor['err_over_bound_max'])}"),
            ("INEXACT keys within rtol anyway", f"{cor['inexact_within_rtol']:,} of {cor['inexact_keys']:,} "
                                                "(the bound is worst case)"),
            ("re-aggregated coordinates", f"{cor['unproven_coords']:,} of the INEXACT keys' {cor['inexact_coords']:,} "
                                          "(those their bounds do not prove)")]


def decode_verdict_ok(cor: dict) -> bool:
    """The benchmark's pass/fail: every support key peeled (OK, or INEXACT: the keys whose rigorous
    bound exceeds rtol are listed, not wrong), the decoded support equal to the float64 sum's, and
    every coordinate within its decoder-reported bound (``bound_stats``)."""
    return ((cor["ok"] or cor["inexact_keys"] > 0) and cor["peeled_keys"] == cor["support_keys"]
            and cor["support_mismatch_beyond_rounding"] == 0 and cor.get("bound_violations", 0) == 0)


def render_codec_cuda(res: dict, cmd: str) -> str:
    c, d, lay, t, cor = (res[k] for k in ("config", "device", "layout", "timing", "correctness"))
    out = [section("lossless_hc codec benchmark (CUDA)", format_table([
        ("command", cmd),
        ("device", f"{d['name']} ({d['multiprocessors']} SMs), torch CUDA {d['torch_cuda']}, kernels: {d['kernels']}"),
        ("config", f"numel {c['numel']:,}, {c['workers']} workers, density {c['density']:g}, block {c['block_size']}, "
                   f"index {lay['index_kind']} (requested {c['index']}), verify {c['verify']}, "
                   f"{c['repeat']} timed runs (median)"),
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
        *bound_rows(cor),
    ], align="ll")))
    return "\n".join(out)


def render_codec(res: dict, machine: dict, cmd: str) -> str:
    c, inp, lay, t, cor, w = (res[k] for k in ("config", "inputs", "layout", "timing", "correctness", "wire"))
    out = []
    out.append(section("lossless_hc codec benchmark", format_table([
        ("command", cmd),
        *machine_rows(machine),
        ("python", machine["python"]),
    ], align="ll")))
    out.append(section("configuration", format_table([
        ("numel", f"{c['numel']:,}"),
        ("workers", c["workers"]),
        ("density", f"{c['density']:g}"),
        ("block size", c["block_size"]),
        ("decode verify", c["verify"]),
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
        *bound_rows(cor),
    ], align="ll")))
    out.append(section("wire (per worker)", format_table([
        ("payload", fmt_bytes(w["wire_bytes"]), f"{w['wire_bytes']:,}", "1.000"),
        ("  header", fmt_bytes(w["header_bytes"]), f"{w['header_bytes']:,}",
         f"{w['header_bytes'] / max(1, w['wire_bytes']):.3f}"),
        ("  index", fmt_bytes(w["index_bytes"]), f"{w['index_bytes']:,}",
         f"{w['index_bytes'] / max(1, w['wire_bytes']):.3f}"),
        ("  sketch (values + mass)", fmt_bytes(w["sketch_bytes"]), f"{w['sketch_bytes']:,}",
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
