"""The ``thc`` command of ``python -m lossless_hc.bench`` (kept apart from the lossless benchmarks).

Inputs: each worker's gradient is a shared N(0,1) component plus an independent N(0,1) one, fresh
each step (workers agree partly, as data-parallel gradients do). Step 0 is the norm-only round, then
``warmup`` steps, then the measured (and timed) step. NMSE is ||decoded - truth||^2 / ||truth||^2
against float64 truth, for two truths: the sum of what the workers encoded (x + e, one step of
compression error) and the sum of the step's inputs x (what the optimizer wanted; error feedback
moves error between steps). The model line is the table's rounding variance plus the clipped mass of
a standard normal, the per-rank NMSE when ||x + e|| equals M.
"""
from __future__ import annotations

import math
import time
from typing import Callable

import torch

from .bench import fmt_bytes, format_table, section, time_fn


def run_thc_bench(numel: int, workers: int, bits: int = 4, granularity: int = 30, overflow_freq: float = 32,
                  symmetric_table: bool = False, averaged: bool = False, repeat: int = 5, seed: int = 0,
                  threads: int = 0, warmup: int = 4, log: Callable[[str], None] = lambda s: None) -> dict:
    from .thc import THCCodec

    if threads > 0:
        torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(seed)
    common = torch.randn(numel, generator=gen)
    codecs = [THCCodec(numel, workers, rank=r, bits=bits, granularity=granularity, overflow_freq=overflow_freq,
                       seed=seed, symmetric_table=symmetric_table, num_threads=threads) for r in range(workers)]
    log(repr(codecs[0]))

    def aggregate(payloads):
        total = torch.zeros_like(payloads[0])
        for p in payloads:
            total += p
        return total / workers if averaged else total

    # Step 0 is the norm-only round (agrees on M; the inputs stay in error feedback); steps 1..warmup
    # reach the steady state of error feedback; the last step is measured.
    for _ in range(warmup):
        xs = [common + torch.randn(numel, generator=gen) for _ in range(workers)]
        agg = aggregate([c.encode(x) for c, x in zip(codecs, xs)])
        for c in codecs:
            c.decode(agg, averaged=averaged)

    xs = [common + torch.randn(numel, generator=gen) for _ in range(workers)]
    state = [c.state_dict() for c in codecs]
    encoded = torch.zeros(numel, dtype=torch.float64)    # sum of x + e: what the step quantizes
    step_in = torch.zeros(numel, dtype=torch.float64)    # sum of x: the step's true gradient sum
    for x, s_ in zip(xs, state):
        step_in += x
        encoded += x.double() + s_["error"].double()
    agg = aggregate([c.encode(x) for c, x in zip(codecs, xs)])
    y = codecs[0].decode(agg, averaged=averaged).double()
    if averaged:
        encoded /= workers
        step_in /= workers
    nmse = float((y - encoded).pow(2).sum() / encoded.pow(2).sum())
    nmse_step = float((y - step_in).pow(2).sum() / step_in.pow(2).sum())
    del y, encoded, step_in

    # Timing on rank 0 at the measured step: rewind its step counter and scale before each call so
    # every run does the same work (the error memory evolves, which does not change the work).
    c0, x0 = codecs[0], xs[0]
    pre = state[0]
    payload_buf = torch.empty(c0.payload_numel, dtype=c0.payload_dtype)
    out_buf = torch.empty(numel, dtype=torch.float32)

    def rewind(pending: bool) -> None:
        c0._pending, c0._step, c0._norm = pending, pre["step"], pre["norm"]

    def encode_once(out=None):
        rewind(False)
        return c0.encode(x0, out=out)

    def decode_once(out=None):
        rewind(True)
        return c0.decode(agg, averaged=averaged, out=out)

    t_clone = time_fn(lambda: torch.clone(x0), repeat)
    t_enc = time_fn(encode_once, repeat)
    t_dec = time_fn(decode_once, repeat)
    t_enc_reuse = time_fn(lambda: encode_once(payload_buf), repeat)
    t_dec_reuse = time_fn(lambda: decode_once(out_buf), repeat)
    dst = torch.empty_like(x0)
    t_copy = time_fn(lambda: dst.copy_(x0), repeat)

    table = c0.table
    T = table.threshold
    clipped = 2.0 * ((1 + T * T) * 0.5 * math.erfc(T / math.sqrt(2)) - T * math.exp(-T * T / 2) / math.sqrt(2 * math.pi))
    L = c0.layout
    clone_s = t_clone["median_s"]
    return {
        "config": {"numel": numel, "workers": workers, "bits": bits, "granularity": granularity,
                   "overflow_freq": overflow_freq, "symmetric_table": symmetric_table, "averaged": averaged,
                   "repeat": repeat, "seed": seed, "threads": threads},
        "layout": {"block": L.block, "padded": L.padded, "base": L.base, "digits_per_word": L.per_word,
                   "words": L.words, "payload_numel": L.payload_numel, "levels": list(table.levels),
                   "table_variance_levels": table.variance, "table_variance_z": table.variance_z},
        "wire": {"wire_bytes": L.wire_bytes, "dense_fp32_bytes": 4 * numel,
                 "bits_per_coordinate": L.bits_per_coordinate, "lane_bits_per_coordinate": L.lane_bits_per_coordinate,
                 "wire_over_dense_fp32": L.wire_bytes / (4 * numel)},
        "accuracy": {"nmse": nmse, "nmse_vs_step_input": nmse_step, "predicted_nmse_iid_normal": table.variance_z + clipped,
                     "clipped_mass_normal": clipped},
        "timing": {"clone": t_clone, "encode": t_enc, "decode": t_dec, "copy_prealloc": t_copy,
                   "encode_reused_out": t_enc_reuse, "decode_reused_out": t_dec_reuse,
                   "reused_over_copy": (t_enc_reuse["median_s"] + t_dec_reuse["median_s"]) / t_copy["median_s"],
                   "encode_over_clone": t_enc["median_s"] / clone_s, "decode_over_clone": t_dec["median_s"] / clone_s,
                   "encode_plus_decode_over_clone": (t_enc["median_s"] + t_dec["median_s"]) / clone_s},
    }


def render_thc(res: dict, machine: dict, cmd: str) -> str:
    c, L, w, a, t = res["config"], res["layout"], res["wire"], res["accuracy"], res["timing"]
    out = [section("lossless_hc THC benchmark", format_table([
        ("command", cmd),
        ("cpu", f"{machine['cpu']} ({machine['cores']} cores, {machine['cores_available']} available)"),
        ("torch", f"{machine['torch']} (codec threads {machine['codec_threads']})"),
        ("setup", f"{c['workers']} workers x {c['numel']:,} float32, shared N(0,1) + own N(0,1); "
                  f"{'AVERAGE' if c['averaged'] else 'SUM'} of the payloads"),
        ("table", f"{len(L['levels'])} levels {L['levels']}"),
        ("layout", f"Hadamard block {L['block']}, {L['digits_per_word']} digits of base {L['base']} per 64-bit word"),
    ], align="ll"))]
    ms = lambda d: f"{d['median_s'] * 1e3:.1f}"  # noqa: E731
    out.append(section("results", format_table([
        ("clone of one input (ms, median)", ms(t["clone"])),
        ("encode, one worker (ms)", f"{ms(t['encode'])}  = {t['encode_over_clone']:.2f}x clone"),
        ("decode of the aggregate (ms)", f"{ms(t['decode'])}  = {t['decode_over_clone']:.2f}x clone"),
        ("encode + decode", f"{t['encode_plus_decode_over_clone']:.2f}x clone"),
        ("copy_ into a preallocated buffer (ms)", ms(t["copy_prealloc"])),
        ("encode(out=) + decode(out=) (ms)", f"{ms(t['encode_reused_out'])} + {ms(t['decode_reused_out'])}  = "
                                             f"{t['reused_over_copy']:.2f}x copy_"),
        ("wire per worker", f"{fmt_bytes(w['wire_bytes'])} = {w['wire_over_dense_fp32']:.4f} of dense fp32"),
        ("bits per coordinate", f"{w['bits_per_coordinate']:.3f} (levels alone {w['lane_bits_per_coordinate']:.3f})"),
        ("NMSE vs the encoded sum (x + e)", f"{a['nmse']:.4e}  (one step of compression error)"),
        ("NMSE vs the step's input sum", f"{a['nmse_vs_step_input']:.4e}  (includes e carried in and out)"),
        ("  model: rounding + clipping", f"{a['predicted_nmse_iid_normal']:.4e} "
                                         f"({L['table_variance_z']:.4e} + {a['clipped_mass_normal']:.4e})"),
    ], align="ll")))
    return "\n".join(out)
