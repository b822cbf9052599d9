"""What every benchmark shares: the machine description, the command line, table formatting,
round-robin timing against a baseline, a free port, strict JSON output, and the end of a worker process."""
from __future__ import annotations

import gc
import json
import math
import os
import platform
import shlex
import socket
import statistics
import sys
import time
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist

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


def simd_level() -> str:
    """The compiled copy of THC's CPU kernels in use (x86-64-v4: AVX-512, x86-64-v3: AVX2 + FMA, or
    portable): the same bits from each, at different speeds, so every recorded ratio names it. The
    LHC kernels' clones take the best level this CPU runs: the same one unless LHC_CPU_ISA forces
    THC's to another. Under x86-64-v4 it also says when the LHC value peel's AVX-512 step is off
    (``lhc_peel_batch``: by default on AMD's CPUs)."""
    from lossless_hc.backends import cpu as cpu_backend  # lazily: the bench's helpers load without _C
    names = {"x86-64-v4": "x86-64-v4 (AVX-512)", "x86-64-v3": "x86-64-v3 (AVX2 + FMA)"}
    try:
        isa = cpu_backend.thc_cpu_isa()
        if isa == "x86-64-v4" and not cpu_backend.lhc_peel_batch():
            return "x86-64-v4 (AVX-512; the LHC value peel key by key)"
        return names.get(isa, isa)
    except ImportError:
        return "unknown (lossless_hc._C not built)"


def machine_info(codec_threads: int = 0) -> dict:
    try:
        affinity = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        affinity = os.cpu_count() or 0
    return {
        "cpu": cpu_model(),
        "simd": simd_level(),
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
    # `python -m lossless_hc.bench` runs the package's __main__.py as argv[0].
    as_module = sys.argv and sys.argv[0].endswith(os.path.join("bench", "__main__.py"))
    prog = "python -m lossless_hc.bench" if as_module or not sys.argv else shlex.quote(sys.argv[0])
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


def machine_rows(machine: dict, torch_threads: bool = True) -> list:
    """The cpu and torch rows of a report's header table (``torch_threads``: name torch's own thread
    count beside the codec's)."""
    threads = (f"torch threads {machine['torch_threads']}, codec threads {machine['codec_threads']}" if torch_threads
               else f"codec threads {machine['codec_threads']}")
    return [("cpu", f"{machine['cpu']} ({machine['cores']} cores, {machine['cores_available']} available; "
                    f"kernels {machine.get('simd', 'unknown')})"),
            ("torch", f"{machine['torch']} ({threads})")]


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


def free_port() -> int:
    """A TCP port no socket of this host holds now (the rendezvous of workers started next)."""
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def leave(code: int = 0) -> None:
    """End a worker process after its report is written, without interpreter finalization.

    Finalization frees what is left of the process group's and DDP's objects while torch's C++
    threads may still drop their last tensor references; on Python <= 3.13 a thread that asks for
    the GIL then is stopped by ``pthread_exit``, which C++ turns into ``std::terminate``
    ("terminate called without an active exception", SIGABRT: a failed run whose results were
    already written). The caller has finished every collective (and torn its group down); the
    streams are flushed here, a ``multiprocessing`` queue must be closed and joined by the caller."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def end_gloo_rank(code: int = 0) -> None:
    """:func:`leave` for a rank of a Gloo group this process initialised: free what the run left
    (models, hooks, pending works) while Gloo and the interpreter are alive, wait for every rank
    (none tears Gloo down while another still talks to it), destroy the group, leave."""
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()
    leave(code)


def log(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def json_safe(obj):
    """NaN/Inf -> None (strict JSON); tuples -> lists."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj


def write_report(workdir: str, stem: str, result: dict, markdown: str) -> None:
    """``workdir/stem.md`` (the command line, then the rendered tables) and ``workdir/stem.json``
    (the whole result, strict JSON: NaN/Inf as null, see :func:`json_safe`) of a run on emulated clusters."""
    with open(os.path.join(workdir, stem + ".md"), "w") as f:
        f.write(f"`{result['command']}`\n\n{markdown}")
    with open(os.path.join(workdir, stem + ".json"), "w") as f:
        json.dump(json_safe(result), f, indent=2, default=str, allow_nan=False)


def write_json(path: Optional[str], obj: dict) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(json_safe(obj), f, indent=2, default=str, allow_nan=False)
            f.write("\n")
        log(f"wrote {path}")


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
