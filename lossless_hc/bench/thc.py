"""The ``thc`` command of ``python -m lossless_hc.bench`` (kept apart from the lossless benchmarks).

Inputs: each worker's gradient is a shared N(0,1) component plus an independent N(0,1) one, fresh
each step (workers agree partly, as data-parallel gradients do). ``warmup`` steps (the first of them the
norm-only round), then the measured (and timed) step. NMSE is ||decoded - truth||^2 / ||truth||^2
against float64 truth, for two truths: the sum of what the workers encoded (x + e, one step of
compression error) and the sum of the step's inputs x (what the optimizer wanted; error feedback
moves error between steps). The model line is the table's rounding variance plus the clipped mass of
a standard normal, the per-rank NMSE when ||x + e|| equals M. The last rows time THCAggregator's
interleave of the tensor over its blocks and back: in place in the codec's encode and decode, as the
backend's copies and as strided torch copies.

``--device cuda`` runs the codecs on the GPU (timings synchronise the device around each call) and, in
lockstep, CPU codecs on the same inputs: every rank's payload and the decoded output of every step
must be the same bits on both backends (reported as ``cpu_equal``; the exit status fails otherwise).
"""
from __future__ import annotations

import math
from typing import Callable

import torch

from lossless_hc.backends import backend_for, cuda_thc
from lossless_hc.bench.common import fmt_bytes, format_table, machine_rows, section, time_interleaved
from lossless_hc.thc import THCCodec


def run_thc_bench(numel: int, workers: int, bits: int = 4, granularity: int = 30, overflow_freq: float = 32,
                  symmetric_table: bool = False, averaged: bool = False, repeat: int = 5, seed: int = 0,
                  threads: int = 0, warmup: int = 4, log: Callable[[str], None] = lambda s: None,
                  device: str = "cpu", cpu_check: bool = True) -> dict:
    if threads > 0:
        torch.set_num_threads(threads)
    dev = torch.device(device)
    on_gpu = dev.type == "cuda"
    gen = torch.Generator().manual_seed(seed)
    common = torch.randn(numel, generator=gen)
    config = dict(bits=bits, granularity=granularity, overflow_freq=overflow_freq, seed=seed,
                  symmetric_table=symmetric_table, num_threads=threads)
    codecs = [THCCodec(numel, workers, rank=r, device=dev, **config) for r in range(workers)]
    log(repr(codecs[0]) + (f" on {torch.cuda.get_device_name(dev)}" if on_gpu else ""))
    # CUDA: CPU codecs in lockstep, every payload and output compared bit for bit.
    # (cpu_check="force" runs the lockstep on the CPU too: tests exercise it without a GPU.)
    lockstep = (on_gpu and bool(cpu_check)) or cpu_check == "force"
    ref = [THCCodec(numel, workers, rank=r, **config) for r in range(workers)] if lockstep else None
    mismatches = []

    def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
        a, b = a.detach().cpu().contiguous(), b.detach().cpu().contiguous()
        view = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
        return a.shape == b.shape and bool(torch.equal(a.view(view), b.view(view)))

    def step_all(xs, decode_all=True):
        """One step on every rank (and on the CPU reference): returns (aggregate, rank 0's output)."""
        payloads = [c.encode(x.to(dev)) for c, x in zip(codecs, xs)]
        agg = aggregate(payloads)
        outs = [c.decode(agg, averaged=averaged) for c in (codecs if decode_all else codecs[:1])]
        if ref is not None:
            rp = [c.encode(x) for c, x in zip(ref, xs)]
            ragg = aggregate(rp)
            routs = [c.decode(ragg, averaged=averaged) for c in (ref if decode_all else ref[:1])]
            for r, (p, q) in enumerate(zip(payloads, rp)):
                if not same_bits(p, q):
                    mismatches.append(f"step {codecs[0].step - 1} rank {r} payload")
            if not same_bits(outs[0], routs[0]):
                mismatches.append(f"step {codecs[0].step - 1} decode")
        return agg, outs[0]

    def aggregate(payloads):
        total = torch.zeros_like(payloads[0])
        for p in payloads:
            total += p
        return total / workers if averaged else total

    # Step 0 is the norm-only round (agrees on M; the inputs stay in error feedback); steps 1..warmup-1
    # reach the steady state of error feedback; the step after them is measured.
    for _ in range(warmup):
        step_all([common + torch.randn(numel, generator=gen) for _ in range(workers)])

    xs = [common + torch.randn(numel, generator=gen) for _ in range(workers)]
    state = [c.state_dict() for c in codecs]
    encoded = torch.zeros(numel, dtype=torch.float64)    # sum of x + e: what the step quantizes
    step_in = torch.zeros(numel, dtype=torch.float64)    # sum of x: the step's true gradient sum
    for x, s_ in zip(xs, state):
        step_in += x
        encoded += x.double() + s_["error"].double().cpu()
    agg, y = step_all(xs, decode_all=False)
    y = y.double().cpu()
    if averaged:
        encoded /= workers
        step_in /= workers
    nmse = float((y - encoded).pow(2).sum() / encoded.pow(2).sum())
    nmse_step = float((y - step_in).pow(2).sum() / step_in.pow(2).sum())
    del y, encoded, step_in

    # Timing on rank 0 at the measured step: rewind its step counter and scale before each call so
    # every run does the same work (the error memory evolves, which does not change the work).
    c0, x0 = codecs[0], xs[0].to(dev)
    pre = state[0]
    payload_buf = torch.empty(c0.payload_numel, dtype=c0.payload_dtype, device=dev)
    out_buf = torch.empty(numel, dtype=torch.float32, device=dev)

    def rewind(pending: bool, interleave_nb: int = 0) -> None:
        c0._pending, c0._step, c0._norm = pending, pre["step"], pre["norm"]
        c0._interleave_nb = interleave_nb   # what the last encode would have left for decode

    def encode_once(out=None, interleaved=False):
        rewind(False)
        return c0.encode(x0, out=out, interleaved=interleaved)

    def decode_once(out=None, interleave_nb=0):
        rewind(True, interleave_nb)
        return c0.decode(agg, averaged=averaged, out=out)

    # Timed round-robin (bench.time_interleaved), so a drift of the machine lands on the baseline and
    # the codec alike; on a GPU each call is timed to its completion, not only its launches.
    dst = torch.empty_like(x0)
    fns = {
        "clone": lambda: torch.clone(x0),
        "encode": encode_once,
        "decode": decode_once,
        "encode_reuse": lambda: encode_once(payload_buf),
        "decode_reuse": lambda: decode_once(out_buf),
        "copy": lambda: dst.copy_(x0),
    }
    # THCAggregator's interleave of this tensor over its nb blocks and back: the codec's encode and
    # decode with interleaved=True (on the CPU, read and written in place), and as copies beside the
    # codec (the backend's kernels, and the strided torch copies the CUDA backend runs).
    L0 = c0.layout
    nb = L0.padded // L0.block
    if nb > 1 and L0.numel == L0.padded:
        backend = backend_for(dev)
        spread = torch.empty(L0.padded, dtype=torch.float32, device=dev)
        fns.update({
            "encode_interleaved": lambda: encode_once(payload_buf, interleaved=True),
            "decode_interleaved": lambda: decode_once(out_buf, interleave_nb=nb),
            "interleave": lambda: backend.thc_interleave(x0, nb, L0.block, spread, threads),
            "deinterleave": lambda: backend.thc_deinterleave(spread, nb, L0.block, dst, threads),
            "interleave_torch": lambda: cuda_thc.interleave(x0, nb, L0.block, spread),
            "deinterleave_torch": lambda: cuda_thc.deinterleave(spread, nb, L0.block, dst),
        })
    if on_gpu:
        def synced(fn):
            def call():
                r = fn()
                torch.cuda.synchronize(dev)
                return r
            return call
        torch.cuda.synchronize(dev)
        t = time_interleaved({name: synced(fn) for name, fn in fns.items()}, repeat, warmup=2)
    else:
        t = time_interleaved(fns, repeat)
    t_clone, t_enc, t_dec, t_copy = t["clone"], t["encode"], t["decode"], t["copy"]
    t_enc_reuse, t_dec_reuse = t["encode_reuse"], t["decode_reuse"]
    kernels = None
    if on_gpu:
        # Where the time goes: one more encode and decode with every kernel timed (synchronising).
        from lossless_hc.backends import cuda_runtime
        with cuda_runtime.profile() as enc_prof:
            encode_once(payload_buf)
        with cuda_runtime.profile() as dec_prof:
            decode_once(out_buf)
        kernels = {"encode": dict(enc_prof.ms), "decode": dict(dec_prof.ms),
                   "encode_table": enc_prof.table(), "decode_table": dec_prof.table()}

    table = c0.table
    T = table.threshold
    clipped = 2.0 * ((1 + T * T) * 0.5 * math.erfc(T / math.sqrt(2)) - T * math.exp(-T * T / 2) / math.sqrt(2 * math.pi))
    L = c0.layout
    clone_s = t_clone["median_s"]
    return {
        "config": {"numel": numel, "workers": workers, "bits": bits, "granularity": granularity,
                   "overflow_freq": overflow_freq, "symmetric_table": symmetric_table, "averaged": averaged,
                   "repeat": repeat, "seed": seed, "threads": threads, "device": str(dev),
                   "device_name": torch.cuda.get_device_name(dev) if on_gpu else None},
        "layout": {"block": L.block, "padded": L.padded, "base": L.base, "digits_per_word": L.per_word,
                   "words": L.words, "payload_numel": L.payload_numel, "levels": list(table.levels),
                   "table_variance_levels": table.variance, "table_variance_z": table.variance_z},
        "wire": {"wire_bytes": L.wire_bytes, "dense_fp32_bytes": 4 * numel,
                 "bits_per_coordinate": L.bits_per_coordinate, "lane_bits_per_coordinate": L.lane_bits_per_coordinate,
                 "wire_over_dense_fp32": L.wire_bytes / (4 * numel)},
        "cpu_equal": None if ref is None else {"ok": not mismatches, "steps": warmup + 1,
                                               "mismatches": mismatches[:20]},
        "accuracy": {"nmse": nmse, "nmse_vs_step_input": nmse_step, "predicted_nmse_iid_normal": table.variance_z + clipped,
                     "clipped_mass_normal": clipped},
        "timing": {"clone": t_clone, "encode": t_enc, "decode": t_dec, "copy_prealloc": t_copy,
                   "encode_reused_out": t_enc_reuse, "decode_reused_out": t_dec_reuse,
                   "reused_over_copy": (t_enc_reuse["median_s"] + t_dec_reuse["median_s"]) / t_copy["median_s"],
                   "encode_over_clone": t_enc["median_s"] / clone_s, "decode_over_clone": t_dec["median_s"] / clone_s,
                   "encode_plus_decode_over_clone": (t_enc["median_s"] + t_dec["median_s"]) / clone_s,
                   "kernels_ms": kernels,
                   "interleave": None if "interleave" not in t else {
                       "blocks": nb, **{k: t[k] for k in ("encode_interleaved", "decode_interleaved", "interleave",
                                                          "deinterleave", "interleave_torch", "deinterleave_torch")}}},
    }


def render_thc(res: dict, machine: dict, cmd: str) -> str:
    c, L, w, a, t = res["config"], res["layout"], res["wire"], res["accuracy"], res["timing"]
    out = [section("lossless_hc THC benchmark", format_table([
        ("command", cmd),
        ("device", c["device"] + (f" ({c['device_name']})" if c.get("device_name") else "")),
        *machine_rows(machine, torch_threads=False),
        ("setup", f"{c['workers']} workers x {c['numel']:,} float32, shared N(0,1) + own N(0,1); "
                  f"{'AVERAGE' if c['averaged'] else 'SUM'} of the payloads"),
        ("table", f"{len(L['levels'])} levels {L['levels']}"),
        ("layout", f"Hadamard block {L['block']}, {L['digits_per_word']} digits of base {L['base']} per 64-bit word"),
    ], align="ll"))]
    ms = lambda d: f"{d['median_s'] * 1e3:.1f}"  # noqa: E731

    def there_and_back(forth: dict, back: dict) -> str:
        ratio = (forth["median_s"] + back["median_s"]) / t["copy_prealloc"]["median_s"]
        return f"{ms(forth)} + back {ms(back)}  = {ratio:.2f}x copy_"

    spread = t.get("interleave")

    def interleaved_over(enc: dict, dec: dict) -> float:
        """Encode + decode in place over the codec into reused buffers plus the two copies."""
        copies = (t["encode_reused_out"]["median_s"] + t["decode_reused_out"]["median_s"]
                  + spread["interleave"]["median_s"] + spread["deinterleave"]["median_s"])
        return (enc["median_s"] + dec["median_s"]) / copies

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
        ("same bits as the CPU backend", "not checked" if res.get("cpu_equal") is None else
         (f"yes (every payload and output of {res['cpu_equal']['steps']} steps)" if res["cpu_equal"]["ok"] else
          f"NO: {', '.join(res['cpu_equal']['mismatches'][:4])}")),
        ("  model: rounding + clipping", f"{a['predicted_nmse_iid_normal']:.4e} "
                                         f"({L['table_variance_z']:.4e} + {a['clipped_mass_normal']:.4e})"),
        *([] if not spread else [
            (f"interleaved into {spread['blocks']} blocks (THCAggregator)", ""),
            ("  encode(out=) + decode(out=) in place (ms)",
             f"{ms(spread['encode_interleaved'])} + {ms(spread['decode_interleaved'])}  = "
             f"{interleaved_over(spread['encode_interleaved'], spread['decode_interleaved']):.2f}x the same with "
             f"the interleave as copies"),
            ("  the interleave as copies (ms)", there_and_back(spread["interleave"], spread["deinterleave"])),
            ("  as strided torch copies (ms)", there_and_back(spread["interleave_torch"], spread["deinterleave_torch"])),
        ]),
    ], align="ll")))
    if t.get("kernels_ms"):
        k = t["kernels_ms"]
        out.append(section("kernels (one profiled run each; every launch waited for)",
                           "encode:\n" + k["encode_table"] + "\ndecode:\n" + k["decode_table"]))
    return "\n".join(out)
