"""``python -m lossless_hc.bench hook``: what a DDP communication hook costs on the host, where the dense
allreduce is the best plan.

``ranks`` local processes train the same tanh MLP (``layers`` Linear(width, width) layers: smooth
activations, so every gradient row is non-zero and ``auto`` keeps every tensor dense without a
calibration) with DDP over Gloo on the loopback interface, buckets of ``bucket_kb`` KiB, in each mode:

- ``ddp``: no hook (DDP's own allreduce, the gradients divided as they are copied into the bucket);
- ``allreduce_hook``: torch's ``default_hooks.allreduce_hook`` (a Python hook: the bucket divided, then
  allreduced);
- ``auto``: :func:`lossless_hc.plugins.ddp.auto_hook` with ``AutoHookState(lossy=False)`` (statistics steps
  on a tensor's step counts 1, 16, 32, 64, 128, 256 and then one in 256: these dense-dominated tensors' interval
  widens, ``AutoSpec(max_interval=...)``; a bucket allreduced as it is divided first where the world size is a
  power of two, as torch's hook divides it, otherwise summed, then divided).

The modes run one after another, ``rounds`` times, the order reversed every other round; rank 0 times
every step after ``warmup`` and every hook call on the main thread (from the hook's entry to its return of
the future). The report gives each mode's median step against ``ddp``'s and against torch's Python hook,
the hook's time per call, and the largest difference of the final parameters from ``ddp``'s (0 where the
world size is a power of two: dividing before or after the sum is then the same rounding); for ``auto``, how
many steps of a round carried a tensor's statistics and its re-planning interval at the end (the interval
widens for these dense-dominated tensors: ``AutoSpec(max_interval=...)``).

Loopback links make the wire cheap, so the hook's own work is most of what separates the modes (where the
ranks share the machine's cores, that work also takes them from the other ranks' backward passes); on a slow
link the same work is a smaller share of the step.
"""
from __future__ import annotations

import os
import queue as queue_module
import statistics
import time
from typing import Callable, Sequence

import torch

from lossless_hc.bench.common import end_gloo_rank, format_table, free_port, machine_rows, section

HOOK_MODES = ("ddp", "allreduce_hook", "auto")


def _model(layers: int, width: int) -> torch.nn.Module:
    torch.manual_seed(0)   # every rank and mode starts from the same parameters
    body = []
    for _ in range(layers):
        body += [torch.nn.Linear(width, width), torch.nn.Tanh()]
    return torch.nn.Sequential(*body)


def _worker(rank: int, world: int, port: int, mode: str, cfg: dict, queue) -> None:
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    model = DistributedDataParallel(_model(cfg["layers"], cfg["width"]), bucket_cap_mb=cfg["bucket_kb"] / 1024)
    calls: list = []

    def timed(hook: Callable) -> Callable:
        def call(state, bucket):
            t0 = time.perf_counter()
            fut = hook(state, bucket)
            calls.append(time.perf_counter() - t0)
            return fut
        return call

    state = None
    if mode == "allreduce_hook":
        model.register_comm_hook(None, timed(default_hooks.allreduce_hook))
    elif mode == "auto":
        from lossless_hc.plugins.ddp import AutoHookState, auto_hook
        state = AutoHookState(process_group=None, lossy=False)
        model.register_comm_hook(state, timed(auto_hook))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(cfg["batch"], cfg["width"], generator=torch.Generator().manual_seed(rank))
    steps, first_call = [], 0
    for step in range(cfg["warmup"] + cfg["steps"]):
        if step == cfg["warmup"]:
            first_call = len(calls)
        t0 = time.perf_counter()
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
        steps.append(time.perf_counter() - t0)
    if rank == 0:
        # as a list: a tensor would go through a shared-memory handle this process no longer serves once it exits
        params = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).tolist()
        report = {"steps": steps[cfg["warmup"]:], "calls": calls[first_call:], "params": params,
                  "calibration": None}
        if state is not None:
            st = state.stats()
            plans = st["plan"].values()
            # the whole run's (warm-up included): each tensor's statistics steps, and its re-planning interval now
            report.update(calibration=st["calibration"]["source"],
                          statistics_steps=sorted({p["steps"] - p["plain_steps"] for p in plans}),
                          intervals=sorted({p["interval"] for p in plans}))
        queue.put(report)
        queue.close()
        queue.join_thread()   # the report is in the pipe: leave() skips the finalizers that would flush it
    del model, opt, state
    end_gloo_rank()


def _run_mode(mode: str, cfg: dict) -> dict:
    import torch.multiprocessing as mp
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, cfg["ranks"], port, mode, cfg, queue)) for r in range(cfg["ranks"])]
    for p in procs:
        p.start()
    result, deadline = None, time.monotonic() + cfg["timeout"]
    try:
        # rank 0's report, or an error as soon as a rank died without one (not the whole timeout later)
        while result is None and time.monotonic() < deadline and not any(p.exitcode for p in procs):
            try:
                result = queue.get(timeout=1.0)
            except queue_module.Empty:
                pass
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    if result is None or any(p.exitcode for p in procs):
        why = "rank 0 reported nothing" if result is None else "a rank failed after rank 0 reported"
        raise RuntimeError(f"bench hook: {mode}: {why} (the ranks' exit statuses {[p.exitcode for p in procs]}, "
                           f"timeout {cfg['timeout']:.0f} s)")
    return result


def run_hook_bench(ranks: int = 2, layers: int = 24, width: int = 64, batch: int = 32, bucket_kb: int = 50,
                   steps: int = 400, warmup: int = 100, rounds: int = 2, modes: Sequence[str] = HOOK_MODES,
                   timeout: float = 600.0, log: Callable[[str], None] = lambda s: None) -> dict:
    """Every mode's pooled step times and hook times (seconds), and its parameters' largest difference
    from ``ddp``'s (module doc)."""
    modes = list(modes)
    if not modes or any(m not in HOOK_MODES for m in modes) or len(set(modes)) < len(modes):
        raise ValueError(f"modes must be some of {', '.join(HOOK_MODES)}, each once, got {modes!r}")
    for name, value, least in (("ranks", ranks, 2), ("layers", layers, 1), ("width", width, 1), ("batch", batch, 1),
                               ("bucket_kb", bucket_kb, 1), ("steps", steps, 1), ("warmup", warmup, 0),
                               ("rounds", rounds, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ValueError(f"{name} must be an integer >= {least}, got {value!r}")
    if not timeout > 0:
        raise ValueError(f"timeout must be > 0 seconds, got {timeout!r}")
    cfg = dict(ranks=ranks, layers=layers, width=width, batch=batch, bucket_kb=bucket_kb, steps=steps,
               warmup=warmup, timeout=timeout)
    pooled = {m: {"steps": [], "calls": [], "params": None, "calibration": None, "statistics": None} for m in modes}
    for r in range(rounds):
        for mode in (modes if r % 2 == 0 else modes[::-1]):
            t0 = time.perf_counter()
            got = _run_mode(mode, cfg)
            log(f"round {r + 1}/{rounds} {mode}: median step {1e3 * statistics.median(got['steps']):.2f} ms "
                f"({time.perf_counter() - t0:.1f} s)")
            p = pooled[mode]
            p["steps"] += got["steps"]
            p["calls"] += got["calls"]
            p["params"], p["calibration"] = torch.tensor(got["params"], dtype=torch.float64), got["calibration"]
            if "statistics_steps" in got:   # auto's, the last round's
                p["statistics"] = {"statistics_steps": got["statistics_steps"], "intervals": got["intervals"],
                                   "steps_run": cfg["warmup"] + cfg["steps"]}
    reference = pooled["ddp"]["params"] if "ddp" in pooled else None
    out = {"config": {k: v for k, v in cfg.items() if k != "timeout"} | {"rounds": rounds}, "modes": {}}
    for mode, p in pooled.items():
        steps_s, calls = sorted(p["steps"]), p["calls"]
        out["modes"][mode] = {
            "steps_pooled": len(steps_s),
            "step_median_s": statistics.median(steps_s),
            "step_p10_s": steps_s[len(steps_s) // 10], "step_p90_s": steps_s[(9 * len(steps_s)) // 10],
            "hook_calls": len(calls),
            "hook_median_s": statistics.median(calls) if calls else None,
            "hook_mean_s": statistics.mean(calls) if calls else None,
            "max_param_diff_vs_ddp": None if reference is None else float((p["params"] - reference).abs().max()),
            "calibration": p["calibration"],
            "statistics": p["statistics"],
        }
    return out


def _span(values: list) -> str:
    """Sorted numbers as ``"a"`` where all are a, else ``"a-b"`` (least to largest)."""
    return str(values[0]) if values[0] == values[-1] else f"{values[0]}-{values[-1]}"


def render_hook(res: dict, machine: dict, cmd: str) -> str:
    modes = res["modes"]
    base = modes.get("ddp", {}).get("step_median_s")
    torch_hook = modes.get("allreduce_hook", {}).get("step_median_s")
    rows = []
    us = (lambda v: "-" if v is None else f"{1e6 * v:.0f}")
    for mode, m in modes.items():
        rows.append([mode, f"{1e3 * m['step_median_s']:.2f} ({1e3 * m['step_p10_s']:.2f}-{1e3 * m['step_p90_s']:.2f})",
                     "-" if base is None else f"{m['step_median_s'] / base:.2f}x",
                     "-" if torch_hook is None else f"{m['step_median_s'] / torch_hook:.2f}x",
                     f"{us(m['hook_median_s'])} / {us(m['hook_mean_s'])}",
                     "-" if m["max_param_diff_vs_ddp"] is None else f"{m['max_param_diff_vs_ddp']:.3g}"])
    c = res["config"]
    config = (f"{c['ranks']} ranks (Gloo, loopback), {c['layers']} x Linear({c['width']}, {c['width']}) + tanh, "
              f"batch {c['batch']}, buckets of {c['bucket_kb']} KiB, {c['steps']} timed steps after {c['warmup']}, "
              f"{c['rounds']} rounds")
    table = format_table(rows, ["mode", "step ms median (p10-p90)", "x ddp", "x allreduce_hook",
                                "hook us per call (median / mean)", "max |param - ddp's|"])
    calib = modes.get("auto", {}).get("calibration")
    notes = f"\n\nauto's calibration: {calib}" if calib is not None else ""
    st = modes.get("auto", {}).get("statistics")
    if st:
        counts, intervals = st["statistics_steps"], st["intervals"]
        notes += (f"\nauto's statistics steps a tensor: {_span(counts)} of {st['steps_run']} (a round, warm-up "
                  f"included); its re-planning interval at the end: {_span(intervals)} steps")
    return "\n\n".join([
        "lossless_hc hook overhead benchmark\n" + "=" * 35,
        f"command  {cmd}",
        format_table(machine_rows(machine)),
        section("configuration", config),
        section("step time (rank 0, pooled over rounds)", table + notes),
    ])
