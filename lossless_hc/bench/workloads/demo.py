"""`make demo`: two local Horovod workers train the NCF recommender with and without
``Compression.lossless`` and print the two runs side by side.

    python -m lossless_hc.bench train [--workers 2] [--steps N] [--framework horovod|ddp] [--model ncf|lstm]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import torch

from lossless_hc.bench.workloads.options import positive_int
from lossless_hc.bench.workloads.train import DEFAULTS

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
LAUNCHERS = {"horovod": "launch_horovod.sh", "ddp": "launch_torchrun.sh"}
# What the compressed run uses, in each framework's API (the table's column).
LOSSLESS_API = {"horovod": "Compression.lossless", "ddp": "lossless_hook"}


def run(framework: str, model: str, workers: int, compression: str, steps: int, tmp: str) -> dict:
    out = os.path.join(tmp, f"{compression}.json")
    params = os.path.join(tmp, f"{compression}.pt")
    cmd = ["bash", os.path.join(ROOT, "scripts", LAUNCHERS[framework]), str(workers), "-m",
           "lossless_hc.bench.workloads.train", "--model", model, "--framework", framework, "--compression", compression,
           "--steps", str(steps), "--log-every", str(max(1, steps // 4)), "--json", out, "--save-params", params]
    print(f"\n$ {' '.join(cmd[1:])}", flush=True)
    env = dict(os.environ, PY=sys.executable)
    proc = subprocess.run(cmd, cwd=ROOT, env=env, text=True, capture_output=True)
    for line in proc.stdout.splitlines():  # rank 0's report, without the launcher's prefixes
        if line.startswith("[0]<stdout>:") or (framework == "ddp" and not line.startswith("[")):
            print("   ", line.removeprefix("[0]<stdout>:"), flush=True)
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-3000:])
        raise SystemExit(f"demo: the {compression} run failed (exit {proc.returncode})")
    with open(out) as f:
        result = json.load(f)
    result["params"] = torch.load(params)
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m lossless_hc.bench train", description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=positive_int, default=2)
    p.add_argument("--steps", type=positive_int, help="default: the model's (150 for ncf)")
    p.add_argument("--framework", choices=sorted(LAUNCHERS), default="horovod")
    p.add_argument("--model", choices=("ncf", "lstm"), default="ncf", help="models with embedding tables")
    args = p.parse_args(argv)
    steps = args.steps if args.steps is not None else DEFAULTS[args.model]["steps"]
    print(f"lossless_hc demo: {args.workers} {args.framework} workers train the {args.model} model "
          f"(embedding tables with row-sparse gradients) for {steps} steps, twice.")
    with tempfile.TemporaryDirectory() as tmp:
        base = run(args.framework, args.model, args.workers, "none", steps, tmp)
        ours = run(args.framework, args.model, args.workers, "lossless", steps, tmp)
    diff = max(float((base["params"][k] - ours["params"][k]).abs().max()) for k in base["params"])
    scale = max(float(v.abs().max()) for v in base["params"].values())
    mib = 2 ** 20
    speedup = base["step_ms_median"] / ours["step_ms_median"]
    speed = f"{speedup:.2f}x faster" if speedup >= 1 else f"{1 / speedup:.2f}x slower"
    rows = [
        ("bytes sent per step (one rank)", f"{base['bytes_per_step'] / mib:.2f} MiB",
         f"{ours['bytes_per_step'] / mib:.2f} MiB ({ours['bytes_per_step'] / base['bytes_per_step']:.3f}x)"),
        ("median step time", f"{base['step_ms_median']:.1f} ms",
         f"{ours['step_ms_median']:.1f} ms ({speed})"),
        (f"final {base['metric']}", f"{base['value']:.4f}", f"{ours['value']:.4f}"),
        ("training loss (mean of the last 10 steps)", f"{base['final_loss']:.5f}", f"{ours['final_loss']:.5f}"),
        ("dense fallbacks", "-", str(ours["fallbacks"])),
    ]
    w0 = max(len(r[0]) for r in rows)
    w1 = max(len(r[1]) for r in rows + [("", "uncompressed", "")])
    print(f"\n{'':{w0}}  {'uncompressed':>{w1}}  {LOSSLESS_API[args.framework]}")
    for name, a, b in rows:
        print(f"{name:{w0}}  {a:>{w1}}  {b}")
    print(f"\nmax |parameter difference| between the two runs: {diff:.3g} (largest parameter {scale:.3g})")
    print("The lossless run aggregates the same gradients as the uncompressed one, every value within the bound the\n"
          "decoder proves (what a dense float32 sum may be off, or rtol = 2^-10 of the value where larger; values\n"
          "it cannot prove are re-sent dense). (Training amplifies such differences over many steps at high learning\n"
          "rates, as it would for any change of summation order; both runs then still train equally well.)\n"
          "A fallback is a tensor re-sent dense once: here the dense layers at the first step, after which they\n"
          "are sent dense directly.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
