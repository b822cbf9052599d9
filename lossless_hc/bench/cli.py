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
    python -m lossless_hc.bench topk --numel 25000000 --ratio 0.01 [--density 1.0] [--repeat 5] [--device cpu|cuda]
        [--json PATH]
    python -m lossless_hc.bench plan --numel 4194304 [--row 1] [--density 1.0] [--workers 2]
        [--strategies dense,sketch,...] [--interval 16] [--repeat 3] [--device cpu|cuda] [--json PATH]
    python -m lossless_hc.bench hook [--ranks 2] [--layers 24] [--width 64] [--batch 32] [--bucket-kb 50]
        [--steps 400] [--warmup 100] [--rounds 2] [--modes ddp,allreduce_hook,auto] [--json PATH]
    python -m lossless_hc.bench cluster ...    (emulated cluster; needs root: see lossless_hc.bench.cluster)
    python -m lossless_hc.bench replay ...     (collective-only replay; needs root: lossless_hc.bench.replay)
    python -m lossless_hc.bench simulate ...   (the planner's cost model to 256 hosts: lossless_hc.bench.simulate)
    python -m lossless_hc.bench tta ...        (time to accuracy on the emulated cluster; needs root: lossless_hc.bench.tta)

``codec`` times encode (one worker) and decode (the SUM of all workers' payloads) against a
``torch.clone`` of one dense input measured in the same process, round-robin with them (see
``time_interleaved``), checks the decoded sum against the
float64 dense sum, and compares the wire size with dense float32 and with the information bound of
the aggregate's actual support.

With ``--device cuda`` the codec runs on the current GPU (at least 10 timed runs, CUDA events, after
warm-up), encode and decode into reused buffers, and the baseline is a device-to-device copy of one
dense input in the same run; throughput is reported in GB/s of dense float32 gradient and as a
fraction of that copy.

The ``codec`` command exits with status 1 when the decode fails (a key left unpeeled, a verdict other
than OK or INEXACT -- INEXACT lists the keys whose rigorous bound exceeds rtol, it does not make them
wrong -- or a decoded support that differs from the float64 sum's beyond rounding scale), so it can
gate CI.

``peel`` measures the sizing rule ``sizing.sketch_table_for``: peeling failure rate (a decode that
peels every key, OK or INEXACT, is not a failure), max abs error against float64 truth, the share of
keys listed INEXACT, and decode time per key (one worker, bitmap index, numel = 20 * keys).

``wire`` gives the payload sizes of every index kind against the information bound (no tensors
encoded); with ``--verify-numel`` it also decodes one instance per point and kind, judged as the
fuzzer judges (``contract.claimed_outside_contract``), and exits with status 1 if one fails.

``thc`` times THCCodec encode (one worker, error feedback on) and decode (the aggregate of all
workers' payloads) against ``torch.clone`` of one input, and reports wire bits per coordinate and the
normalized mean squared error of one step against the true average; and the THC aggregator's interleave
of the tensor over its Hadamard blocks and back (the backend's kernels, and strided torch copies)
against ``copy_``.

``topk`` times the O(numel) top-k selection (the backend's ``topk_select``) against ``torch.clone``
and ``torch.topk`` of the same tensor in the same run, and checks it against a stable sort.

``plan`` times the local work of each of ``auto``'s strategies per step and rank (encode, decode and a
second collective's finish of AutoAggregators held on that strategy, averaged over a re-planning
interval) against ``torch.clone`` and ``copy_`` of one input (:mod:`lossless_hc.bench.plan`); status 1
where an exact strategy's result is not the sum.

``hook`` times DDP training steps of a many-tensor tanh MLP over loopback Gloo without a hook, with
torch's ``allreduce_hook`` and with ``auto_hook`` (every plan dense): what the hook's own work adds to a
step, and the parameters' difference from DDP's (:mod:`lossless_hc.bench.hook`).

Importing this module has no side effects; the CLI lives in ``main``.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Optional, Sequence

import torch

from lossless_hc.bench.codec import (CLUSTER_WINDOW, SUPPORTS, decode_verdict_ok, render_codec, render_codec_cuda,
                                     run_codec_bench, run_codec_bench_cuda)
from lossless_hc.bench.common import command_line, log, machine_info, write_json
from lossless_hc.bench import wire as bench_wire
from lossless_hc.bench.cluster import add_arguments as add_cluster_arguments
from lossless_hc.bench.hook import HOOK_MODES, render_hook, run_hook_bench
from lossless_hc.bench.peel import render_peel, run_peel_bench
from lossless_hc.bench.plan import PLAN_STRATEGIES, render_plan, run_plan_bench
from lossless_hc.bench.replay import add_arguments as add_replay_arguments
from lossless_hc.bench.simulate import add_arguments as add_simulate_arguments
from lossless_hc.bench.thc import render_thc, run_thc_bench
from lossless_hc.bench.topk import render_topk, render_topk_cuda, run_topk_bench, run_topk_bench_cuda
from lossless_hc.bench.tta import add_arguments as add_tta_arguments


# ------------------------------------------------------------------------------------------------
# CLI
# ------------------------------------------------------------------------------------------------
def _positive_int(s: str) -> int:
    v = int(s)
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {s}")
    return v


def _nonnegative_int(s: str) -> int:
    v = int(s)
    if v < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {s}")
    return v


def _comma_list(s: str, convert, kind: str, valid, expected: str) -> list:
    """``s`` as a non-empty list of ``convert``ed values, each ``valid``; else a usage error."""
    try:
        vals = [convert(v) for v in s.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated {kind}, got {s!r}")
    if not vals or not all(valid(v) for v in vals):
        raise argparse.ArgumentTypeError(f"expected {expected}, got {s!r}")
    return vals


def _density_list(s: str) -> list:
    return _comma_list(s, float, "numbers", lambda v: 0.0 < v <= 1.0, "densities in (0, 1]")   # NaN fails too


def _int_list(s: str) -> list:
    return _comma_list(s, int, "integers", lambda v: v >= 1, "positive integers")


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
    c.add_argument("--verify", action="store_true",
                   help="decode with the verification bound (LosslessCodec(verify=True))")
    c.add_argument("--json", metavar="PATH", help="write all numbers to this JSON file")
    c.set_defaults(func=_cmd_codec)

    q = sub.add_parser("peel", help="peeling failure rate / accuracy / speed of sketch_table_for")
    q.add_argument("--keys", type=_int_list, default=[1000, 10000, 100000, 1000000],
                   help="comma-separated key counts")
    q.add_argument("--trials", type=_positive_int, default=20)
    q.add_argument("--numel-factor", type=_positive_int, default=20, help="numel = factor * keys")
    q.add_argument("--index", choices=("bitmap", "bloom"), default="bitmap")
    q.add_argument("--seed", type=_nonnegative_int, default=0)      # a codec seed: in [0, 2**64)
    q.add_argument("--threads", type=_nonnegative_int, default=0)
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

    k = sub.add_parser("topk", help="top-k selection (O(numel)) time vs torch.clone and torch.topk")
    k.add_argument("--numel", type=_positive_int, default=25_000_000)
    k.add_argument("--ratio", type=float, default=0.01, help="k = ceil(ratio * numel)")
    k.add_argument("--density", type=float, default=1.0,
                   help="fraction of the coordinates non-zero (N(0,1)), zeros elsewhere (default 1: all)")
    k.add_argument("--repeat", type=_positive_int, default=5)
    k.add_argument("--seed", type=int, default=0)
    k.add_argument("--threads", type=_nonnegative_int, default=0)   # 0: the OpenMP default
    k.add_argument("--no-check", action="store_true", help="skip the check against a stable sort")
    k.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cuda: the CUDA selection, CUDA events, against a device-to-device copy and torch.topk")
    k.add_argument("--json", metavar="PATH")
    k.set_defaults(func=_cmd_topk)

    pl = sub.add_parser("plan", help="auto's strategies: local work per step and rank vs torch.clone and copy_")
    pl.add_argument("--numel", type=_positive_int, default=1 << 22)
    pl.add_argument("--row", type=_positive_int, default=1, help="elements per row (key); must divide --numel")
    pl.add_argument("--density", type=float, default=1.0, help="share of each rank's rows that are non-zero")
    pl.add_argument("--workers", type=_positive_int, default=2)
    pl.add_argument("--strategies", default=",".join(PLAN_STRATEGIES))
    pl.add_argument("--interval", type=_positive_int, default=16, help="steps between statistics steps")
    pl.add_argument("--repeat", type=_positive_int, default=3, help="timed intervals")
    pl.add_argument("--topk-ratio", type=float, default=0.01)
    pl.add_argument("--seed", type=int, default=0)
    pl.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    pl.add_argument("--json", metavar="PATH")
    pl.set_defaults(func=_cmd_plan)

    hk = sub.add_parser("hook", help="DDP step time without a hook, with torch's allreduce_hook and with auto_hook "
                                     "(every plan dense) on local workers: the hook's own cost")
    hk.add_argument("--ranks", type=_positive_int, default=2)
    hk.add_argument("--layers", type=_positive_int, default=24)
    hk.add_argument("--width", type=_positive_int, default=64)
    hk.add_argument("--batch", type=_positive_int, default=32)
    hk.add_argument("--bucket-kb", type=_positive_int, default=50, help="DDP's bucket_cap_mb, in KiB")
    hk.add_argument("--steps", type=_positive_int, default=400, help="timed steps per round")
    hk.add_argument("--warmup", type=_nonnegative_int, default=100, help="untimed steps before them")
    hk.add_argument("--rounds", type=_positive_int, default=2, help="the modes' order reversed every other round")
    hk.add_argument("--modes", default=",".join(HOOK_MODES))
    hk.add_argument("--json", metavar="PATH")
    hk.set_defaults(func=_cmd_hook)

    w = sub.add_parser("wire", help="wire bits per aggregate non-zero of every index kind and of the automatic "
                                    "choice vs the information bound; table and plot")
    w.add_argument("--numel", type=_positive_int, default=1 << 26, help="elements per tensor (default 2**26)")
    w.add_argument("--densities", type=_density_list, default=None,
                   help="comma-separated aggregate densities (default 1e-5..0.5)")
    w.add_argument("--workers", type=_int_list, default=None, help="comma-separated world sizes (default 2,8,16,64)")
    w.add_argument("--block-sizes", type=_int_list, default=None, help="comma-separated block sizes (default 1,32)")
    w.add_argument("--plot", metavar="PATH", default="docs/wire_bits.png", help="PNG path ('' for none)")
    w.add_argument("--verify-numel", type=_nonnegative_int, default=0,
                   help="also encode/decode one instance per point at this numel and judge it by the exactness "
                        "contract (exit status 1 if one is outside it or fails to decode; points with fewer than "
                        "5 aggregate keys at that numel are skipped, and counted in the report)")
    w.add_argument("--seed", type=_nonnegative_int, default=0)      # a codec seed: in [0, 2**64)
    w.add_argument("--json", metavar="PATH")
    w.set_defaults(func=_cmd_wire)

    cl = sub.add_parser("cluster", help="emulated cluster (network namespaces, shaped links): step time, wire "
                                        "bytes and aggregation throughput per compression; needs root")
    add_cluster_arguments(cl)

    rp = sub.add_parser("replay", help="collective-only: recorded per-rank gradients replayed through the real "
                                       "collectives on 8/16 emulated hosts; needs root")
    add_replay_arguments(rp)

    sm = sub.add_parser("simulate", help="the planner's cost model from 2 to 256 hosts (uniform and Zipf supports), "
                                         "plot, and its error against measured replay points")
    add_simulate_arguments(sm)

    ta = sub.add_parser("tta", help="time to accuracy on the emulated cluster: every mode trained to a held-out "
                                     "target (digits, NCF, LSTM LM); curves and plots; needs root")
    add_tta_arguments(ta)

    tr = sub.add_parser("train", add_help=False,
                       help="uncompressed vs lossless training side by side on local workers (`make demo`); "
                            "`train --help` for its options")
    tr.set_defaults(func=None)
    return p



def _cmd_codec(args) -> int:
    if not 0.0 <= args.density <= 1.0:
        raise SystemExit(f"--density must be in [0, 1], got {args.density}")
    cmd = command_line()
    if args.device == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("python -m lossless_hc.bench codec --device cuda: no CUDA device")
        try:
            res = run_codec_bench_cuda(args.numel, args.density, args.workers, args.block_size, args.index,
                                       args.support, max(args.repeat, 10), args.seed, log=log, verify=args.verify)
        except ValueError as exc:
            raise SystemExit(f"python -m lossless_hc.bench codec: error: {exc}")
        print(render_codec_cuda(res, cmd))
        write_json(args.json, {"command": cmd, "machine": machine_info(0), **res})
        return 0 if decode_verdict_ok(res["correctness"]) and res["correctness"]["deterministic"] else 1
    try:
        res = run_codec_bench(args.numel, args.density, args.workers, args.block_size, args.index, args.support,
                              args.repeat, args.seed, args.threads, log=log, verify=args.verify)
    except ValueError as exc:
        raise SystemExit(f"python -m lossless_hc.bench codec: error: {exc}")
    machine = machine_info(args.threads)
    print(render_codec(res, machine, cmd))
    write_json(args.json, {"command": cmd, "machine": machine, **res})
    return 0 if decode_verdict_ok(res["correctness"]) else 1


def _cmd_peel(args) -> int:
    cmd = command_line()
    res = run_peel_bench(args.keys, args.trials, args.numel_factor, args.seed, args.threads, args.index, log=log)
    machine = machine_info(args.threads)
    print(render_peel(res, machine, cmd))
    write_json(args.json, {"command": cmd, "machine": machine, **res})
    return 0


def _cmd_wire(args) -> int:
    cmd = command_line()
    res = bench_wire.run_wire_bench(args.numel, args.densities or bench_wire.DEFAULT_DENSITIES,
                                    args.workers or bench_wire.DEFAULT_WORKERS,
                                    args.block_sizes or bench_wire.DEFAULT_BLOCKS, args.verify_numel, args.seed,
                                    log=log)
    machine = machine_info(0)
    print(bench_wire.render_wire(res, cmd, machine))
    if args.plot:
        os.makedirs(os.path.dirname(args.plot) or ".", exist_ok=True)
        bench_wire.plot_wire(res, args.plot)
        log(f"wrote {args.plot}")
    write_json(args.json, {"command": cmd, "machine": machine, **res})
    return 1 if bench_wire.failed_verifications(res) else 0


def _cmd_thc(args) -> int:
    cmd = command_line()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("python -m lossless_hc.bench thc --device cuda: no CUDA device")
    try:
        res = run_thc_bench(args.numel, args.workers, args.bits, args.granularity, args.overflow_freq,
                            args.symmetric_table, args.averaged, args.repeat, args.seed, args.threads, log=log,
                            device=args.device, cpu_check=not args.no_cpu_check)
    except ValueError as exc:
        raise SystemExit(f"python -m lossless_hc.bench thc: error: {exc}")
    machine = machine_info(args.threads)
    print(render_thc(res, machine, cmd))
    write_json(args.json, {"command": cmd, "machine": machine, **res})
    return 0 if res.get("cpu_equal") is None or res["cpu_equal"]["ok"] else 1


def _cmd_topk(args) -> int:
    cmd = command_line()
    if args.device == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("python -m lossless_hc.bench topk --device cuda: no CUDA device")
        try:
            res = run_topk_bench_cuda(args.numel, args.ratio, max(args.repeat, 10), args.seed, check=not args.no_check,
                                      density=args.density)
        except ValueError as exc:
            raise SystemExit(f"python -m lossless_hc.bench topk: error: {exc}")
        print(render_topk_cuda(res, cmd))
        write_json(args.json, {"command": cmd, "machine": machine_info(0), **res})
        return 0 if res["exact"] in (None, True) else 1
    try:
        res = run_topk_bench(args.numel, args.ratio, args.repeat, args.seed, args.threads, check=not args.no_check,
                             density=args.density)
    except ValueError as exc:
        raise SystemExit(f"python -m lossless_hc.bench topk: error: {exc}")
    machine = machine_info(args.threads)
    print(render_topk(res, machine, cmd))
    write_json(args.json, {"command": cmd, "machine": machine, **res})
    return 0 if res["exact"] in (None, True) else 1


def _cmd_plan(args) -> int:
    cmd = command_line()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("python -m lossless_hc.bench plan --device cuda: no CUDA device")
    try:
        res = run_plan_bench(args.numel, args.row, args.density, args.workers,
                             [s for s in args.strategies.split(",") if s], args.interval, args.repeat,
                             args.topk_ratio, args.seed, args.device)
    except ValueError as exc:
        raise SystemExit(f"python -m lossless_hc.bench plan: error: {exc}")
    machine = machine_info(0)
    print(render_plan(res, machine, cmd))
    write_json(args.json, {"command": cmd, "machine": machine, **res})
    return 0 if res["ok"] else 1


def _cmd_hook(args) -> int:
    cmd = command_line()
    try:
        res = run_hook_bench(args.ranks, args.layers, args.width, args.batch, args.bucket_kb, args.steps, args.warmup,
                             args.rounds, [m for m in args.modes.split(",") if m], log=log)
    except ValueError as exc:
        raise SystemExit(f"python -m lossless_hc.bench hook: error: {exc}")
    machine = machine_info(0)
    print(render_hook(res, machine, cmd))
    write_json(args.json, {"command": cmd, "machine": machine, **res})
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["train"]:  # its own parser: lossless_hc.bench.workloads.demo
        from lossless_hc.bench.workloads import demo
        return demo.main(argv[1:])
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
