"""The ``topk`` command of ``python -m lossless_hc.bench``: top-k selection by magnitude against a clone.

Times the backend's ``topk_select`` (O(numel): a sampled threshold, one filtering pass, an exact
fallback; exactly k indices, ties to the lower index) on one N(0,1) float32 tensor (``--density``: N(0,1) on
that fraction of its coordinates, zeros elsewhere, as an embedding table's gradient), round-robin with a
``torch.clone`` of it and with ``torch.topk(x.abs(), k, sorted=False)`` (see ``time_interleaved``), and
with ``TopKAggregator.select`` (error feedback fused into the selection: residual add, selection,
residual update in one pass; then the sparse output), and with the whole aggregator step
``TopKAggregator.encode`` (select, then the lossless codec's encode of the selected values).
The selection is checked against a stable sort (the same indices, exactly k).

``--device cuda`` times the CUDA twin (``csrc/cuda/topk_kernels.cuh``) with CUDA events against a
device-to-device copy of the same tensor and ``torch.topk`` on the GPU, in the same run, and checks that
it selects the CPU backend's indices bit for bit.
"""
from __future__ import annotations

import math

import torch

from lossless_hc.backends import backend_for
from lossless_hc.bench.common import format_table, machine_rows, section, time_cuda, time_interleaved


def topk_input(numel: int, density: float, gen: torch.Generator) -> torch.Tensor:
    """N(0,1) float32 on every coordinate, or (``density`` < 1) on ``ceil(density numel)`` random ones and
    zeros elsewhere: a sparse gradient, whose non-zero coordinates may be fewer than k."""
    if not 0.0 < density <= 1.0:
        raise ValueError(f"--density must be in (0, 1], got {density}")
    x = torch.randn(numel, generator=gen)
    if density < 1.0:
        zero = torch.ones(numel, dtype=torch.bool)
        zero[torch.randperm(numel, generator=gen)[:math.ceil(density * numel)]] = False
        x[zero] = 0.0
    return x


def run_topk_bench(numel: int, ratio: float, repeat: int = 5, seed: int = 0, threads: int = 0,
                   check: bool = True, density: float = 1.0) -> dict:
    if not 0.0 < ratio <= 1.0:
        raise ValueError(f"--ratio must be in (0, 1], got {ratio}")
    if threads > 0:
        torch.set_num_threads(threads)
    from lossless_hc.training.topk_aggregate import TopKAggregator
    gen = torch.Generator().manual_seed(seed)
    x = topk_input(numel, density, gen)
    k = min(numel, max(1, math.ceil(ratio * numel)))
    backend = backend_for(x.device)
    out = torch.empty(k, dtype=torch.int64)
    idx = backend.topk_select(x, k, num_threads=threads)
    exact = None
    if check:
        key = x.view(torch.int32) & 0x7FFFFFFF
        order = torch.sort(key, descending=True, stable=True).indices[:k]
        exact = bool(torch.equal(idx, torch.sort(order).values))
        del key, order
    agg = TopKAggregator("bench", (numel,), torch.float32, 2, ratio)
    if not agg.compressed:
        raise ValueError(f"at ratio {ratio} the aggregator sends this tensor dense: no selection to time")
    residual0 = 0.01 * topk_input(numel, density, gen)   # another random support at the same density
    agg.residual = residual0.clone()

    def select_step():
        agg.residual.copy_(residual0)   # the same work every run (select updates the residual in place)
        return agg.select(x)

    def encode_step():
        agg.residual.copy_(residual0)
        return agg.encode(x)

    fns = {
        "clone": lambda: torch.clone(x),
        "topk_select": lambda: backend.topk_select(x, k, out=out, num_threads=threads),
        "torch_topk": lambda: torch.topk(x.abs(), k, sorted=False),
        "aggregator_select": select_step,
        "aggregator_encode": encode_step,
        "residual_reset": lambda: agg.residual.copy_(residual0),
    }
    t = time_interleaved(fns, repeat)
    clone_s = t["clone"]["median_s"]
    # The residual reset (a copy_) runs inside the select and encode timings; take it out again.
    reset_s = t["residual_reset"]["median_s"]
    for name in ("aggregator_select", "aggregator_encode"):
        t[name] = {**t[name], **{f: max(0.0, t[name][f] - reset_s) for f in ("median_s", "min_s", "max_s")}}
    return {"config": {"numel": numel, "ratio": ratio, "k": k, "repeat": repeat, "seed": seed, "threads": threads,
                       "density": density},
            "exact": exact, "timing": t,
            "ratios": {name: t[name]["median_s"] / clone_s for name in ("topk_select", "torch_topk",
                                                                          "aggregator_select", "aggregator_encode")},
            "select_over_torch_topk": t["topk_select"]["median_s"] / t["torch_topk"]["median_s"]}


def run_topk_bench_cuda(numel: int, ratio: float, repeat: int = 20, seed: int = 0, check: bool = True,
                        density: float = 1.0) -> dict:
    """The CUDA selection on the current GPU: CUDA-event medians of ``topk_select`` (into a reused ``out``),
    of ``torch.topk(|x|, k, sorted=False)`` and of a device-to-device ``copy_`` of ``x`` (the baseline);
    ``check``: the indices equal the CPU backend's (which tests/test_topk.py checks against a stable sort)."""
    if not 0.0 < ratio <= 1.0:
        raise ValueError(f"--ratio must be in (0, 1], got {ratio}")
    dev = torch.device("cuda", torch.cuda.current_device())
    gen = torch.Generator().manual_seed(seed)
    x_cpu = topk_input(numel, density, gen)
    k = min(numel, max(1, math.ceil(ratio * numel)))
    x = x_cpu.to(dev)
    backend = backend_for(dev)
    out = torch.empty(k, dtype=torch.int64, device=dev)
    dst = torch.empty_like(x)
    t = {"copy": time_cuda(lambda: dst.copy_(x), repeat),
         "topk_select": time_cuda(lambda: backend.topk_select(x, k, out=out), repeat),
         "torch_topk": time_cuda(lambda: torch.topk(x.abs(), k, sorted=False), repeat)}
    exact = None
    if check:
        got = backend.topk_select(x, k).cpu()
        exact = bool(torch.equal(got, backend_for(x_cpu.device).topk_select(x_cpu, k)))
    copy_s = t["copy"]["median_s"]
    return {"config": {"numel": numel, "ratio": ratio, "k": k, "repeat": repeat, "seed": seed, "device": str(dev),
                       "density": density},
            "device": {"name": torch.cuda.get_device_name(dev), "torch_cuda": torch.version.cuda,
                       "multiprocessors": torch.cuda.get_device_properties(dev).multi_processor_count},
            "exact": exact, "timing": t,
            "ratios": {name: t[name]["median_s"] / copy_s for name in ("topk_select", "torch_topk")},
            "select_over_torch_topk": t["topk_select"]["median_s"] / t["torch_topk"]["median_s"]}


def _values(config: dict) -> str:
    density = config.get("density", 1.0)
    return "N(0,1)" if density >= 1.0 else f"N(0,1) on {density:g} of the coordinates (zeros elsewhere)"


def render_topk_cuda(res: dict, cmd: str) -> str:
    c, d, t, r = res["config"], res["device"], res["timing"], res["ratios"]
    ms = lambda v: f"{v['median_s'] * 1e3:.3f}"  # noqa: E731
    out = [section("lossless_hc top-k selection benchmark (CUDA)", format_table([
        ("command", cmd),
        ("device", f"{d['name']} ({d['multiprocessors']} SMs), torch CUDA {d['torch_cuda']}"),
        ("setup", f"{c['numel']:,} float32 {_values(c)}, k = {c['k']:,} ({c['ratio']:g}), {c['repeat']} timed runs "
                  "(CUDA events, median)"),
    ], align="ll"))]
    out.append(section("results", format_table([
        ("device-to-device copy_ of the input (ms)", ms(t["copy"])),
        ("topk_select (ms)", f"{ms(t['topk_select'])}  = {r['topk_select']:.2f}x copy, "
                             f"{res['select_over_torch_topk']:.3f}x torch.topk"),
        ("torch.topk(|x|, k, sorted=False) (ms)", f"{ms(t['torch_topk'])}  = {r['torch_topk']:.2f}x copy"),
        ("same indices as the CPU backend", "not checked" if res["exact"] is None else
         ("yes (exactly k)" if res["exact"] else "NO")),
    ], align="ll")))
    return "\n".join(out)


def render_topk(res: dict, machine: dict, cmd: str) -> str:
    c, t, r = res["config"], res["timing"], res["ratios"]
    out = [section("lossless_hc top-k selection benchmark", format_table([
        ("command", cmd),
        *machine_rows(machine, torch_threads=False),
        ("setup", f"{c['numel']:,} float32 {_values(c)}, k = {c['k']:,} ({c['ratio']:g})"),
    ], align="ll"))]
    ms = lambda d: f"{d['median_s'] * 1e3:.1f}"  # noqa: E731
    out.append(section("results", format_table([
        ("clone of the input (ms, median)", ms(t["clone"])),
        ("topk_select (ms)", f"{ms(t['topk_select'])}  = {r['topk_select']:.2f}x clone, "
                             f"{res['select_over_torch_topk']:.3f}x torch.topk"),
        ("torch.topk(|x|, k, sorted=False) (ms)", f"{ms(t['torch_topk'])}  = {r['torch_topk']:.2f}x clone"),
        ("TopKAggregator.select (ms)", f"{ms(t['aggregator_select'])}  = {r['aggregator_select']:.2f}x "
                                       "clone (residual add, selection, residual update in one pass; sparse output)"),
        ("TopKAggregator.encode, whole step (ms)", f"{ms(t['aggregator_encode'])}  = {r['aggregator_encode']:.2f}x "
                                                   "clone (select + the lossless codec's encode of the selection)"),
        ("same indices as a stable sort", "not checked" if res["exact"] is None else
         ("yes (exactly k)" if res["exact"] else "NO")),
    ], align="ll")))
    return "\n".join(out)
