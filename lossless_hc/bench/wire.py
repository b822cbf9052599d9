"""``python -m lossless_hc.bench wire``: wire bits per aggregate non-zero for every index kind and for
the automatic choice, against the information bound, over aggregate densities, world sizes and
block sizes.

The figures are the exact payload sizes of the layouts (``sizing.build_layout`` /
``cost_model``), which are deterministic functions of the configuration, so no tensors are encoded.
Assumptions, stated in the output: ``numel`` coordinates, an aggregate with ``ceil(density * keys)``
non-zero keys (whole blocks of ``b`` coordinates), the codec sized for exactly that union
(``union_nnz``), and a per-rank capacity equal to the union (any rank may hold all of it: the
Bloom counters' cap is then the largest). ``--verify`` also encodes and decodes one random instance
per kind at a smaller numel and judges each decode by the exactness contract (ok, or INEXACT with
the keys it could not prove listed; every other coordinate within the contract).
"""
from __future__ import annotations

import math
import time
from typing import Callable, Optional, Sequence

import torch

from lossless_hc.bench.common import format_table
from lossless_hc.lhc.codec import LosslessCodec, key_coordinates
from lossless_hc.lhc.contract import claimed_outside_contract, truth
from lossless_hc.lhc.cost_model import candidates, choose, information_bound_bits
from lossless_hc.lhc.status import DecodeStatus

KINDS = ("dense", "bitmap", "bloom", "multilevel")
DEFAULT_DENSITIES = (1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.2, 0.5)
DEFAULT_WORKERS = (2, 8, 16, 64)
DEFAULT_BLOCKS = (1, 32)
TARGET_RANGE = (1e-4, 0.1)
TARGET_RATIO = 1.5
VERIFY_MIN_KEYS = 5   # --verify-numel skips a point with fewer aggregate keys at that numel (and says so)


def wire_point(numel: int, workers: int, density: float, block: int, seed: int = 0) -> dict:
    num_keys = -(-numel // block)
    u_keys = max(1, math.ceil(density * num_keys))
    nnz = min(numel, u_keys * block)
    cands = candidates(numel, workers, nnz, block, seed, nnz)
    auto = choose(numel, workers, nnz, block, seed, nnz)
    bound = information_bound_bits(numel, nnz)
    bits = {k: 32.0 * L.payload_numel / nnz for k, L in cands.items()}
    point = {"numel": numel, "workers": workers, "density": density, "block": block, "union_keys": u_keys,
             "nnz": nnz, "bound_bits_per_nz": bound / nnz, "bits_per_nz": bits,
             "auto_kind": auto.index_kind, "auto_bits_per_nz": 32.0 * auto.payload_numel / nnz,
             "auto_over_bound": 32.0 * auto.payload_numel / bound}
    if auto.multilevel is not None:
        m = auto.multilevel
        point["auto_multilevel"] = {"group_keys": m.group_keys, "digits_per_word": m.digits_per_word,
                                    "words_per_group": m.words_per_group, "load_cap": m.load_cap}
    return point


def verify_point(workers: int, density: float, block: int, numel: int, seed: int = 0) -> dict:
    """Encode/decode one random instance per kind (aggregate density as given, N(0,1) values, ranks'
    supports drawn from the union) and judge each decode by the exactness contract
    (:func:`~lossless_hc.lhc.contract.claimed_outside_contract`): ``decoded`` when it is ok or INEXACT
    (every key recovered; ``inexact_keys`` of them listed, which the plugins re-aggregate),
    ``outside_contract`` the coordinates it vouched for that are outside the contract (must be 0)."""
    num_keys = -(-numel // block)
    u = max(1, math.ceil(density * num_keys))
    g = torch.Generator().manual_seed(seed)
    union = torch.randperm(num_keys, generator=g)[:u]
    xs = []
    for r in range(workers):
        mine = union[torch.rand(u, generator=g) < 0.5] if workers > 1 else union
        if r == 0:
            mine = union  # rank 0 covers the union, so the aggregate's support is exactly it
        x = torch.zeros(num_keys * block)
        idx, _ = key_coordinates(mine, block, num_keys * block)
        x[idx] = torch.randn(idx.numel(), generator=g)
        xs.append(x[:numel].clone())
    s, a = truth(xs)
    out = {}
    for kind in KINDS:
        try:
            c = LosslessCodec(numel, workers, u * block, block_size=block, seed=seed, index=kind, union_nnz=u * block)
        except ValueError:
            continue
        y, rep = c.decode(sum(c.encode(x) for x in xs))
        decoded = rep.ok or rep.status == DecodeStatus.INEXACT
        outside = int(claimed_outside_contract(y, rep, s, a, workers, c.rtol, block).sum())
        out[kind] = {"status": rep.status.name, "decoded": decoded, "inexact_keys": int(rep.inexact_keys.numel()),
                     "outside_contract": outside, "within_contract": decoded and outside == 0, "reason": rep.reason}
    return out


def failed_verifications(res: dict) -> list:
    """The verified instances with a kind that did not decode or vouched for a coordinate outside the
    contract (the command then exits 1)."""
    return [v for v in res["verified"] if not all(r["within_contract"] for r in v["result"].values())]


def run_wire_bench(numel: int = 1 << 26, densities: Sequence[float] = DEFAULT_DENSITIES,
                   workers: Sequence[int] = DEFAULT_WORKERS, blocks: Sequence[int] = DEFAULT_BLOCKS,
                   verify_numel: int = 0, seed: int = 0, log: Callable[[str], None] = lambda s: None) -> dict:
    t0 = time.perf_counter()
    points = []
    for b in blocks:
        for n in workers:
            for p in densities:
                points.append(wire_point(numel, n, p, b, seed))
            log(f"block {b}, {n} workers done ({time.perf_counter() - t0:.1f} s)")
    verified, too_few = [], 0
    if verify_numel:
        for b in blocks:
            for n in workers:
                for p in densities:
                    if p * verify_numel / b < VERIFY_MIN_KEYS:
                        too_few += 1
                        continue
                    verified.append({"workers": n, "density": p, "block": b, "numel": verify_numel,
                                     "result": verify_point(n, p, b, verify_numel, seed)})
        log(f"verified {len(verified)} instances ({time.perf_counter() - t0:.1f} s)")
    return {"numel": numel, "points": points, "verified": verified, "verify_too_few_keys": too_few,
            "summary": summarize(points)}


def summarize(points: list) -> list:
    """auto/bound over the target density range, per block size and world size."""
    out = []
    for b in sorted({p["block"] for p in points}):
        for n in sorted({p["workers"] for p in points}):
            sel = [p for p in points if p["block"] == b and p["workers"] == n
                   and TARGET_RANGE[0] <= p["density"] <= TARGET_RANGE[1]]
            if not sel:
                continue
            ratios = [p["auto_over_bound"] for p in sel]
            out.append({"block": b, "workers": n, "min_ratio": min(ratios), "max_ratio": max(ratios),
                        "meets_target": max(ratios) <= TARGET_RATIO})
    return out


def render_wire(res: dict, cmd: str, machine: Optional[dict] = None) -> str:
    lines = [f"$ {cmd}", ""]
    if machine:
        lines.append(f"machine: {machine.get('cpu')} ({machine.get('cores_available')} cores available)")
    lines += [f"wire bits per aggregate non-zero coordinate, numel = {res['numel']}; bound = "
              "(log2 C(numel, nnz) + 32 nnz) / nnz; codec sized for the aggregate's union, per-rank capacity = union",
              ""]
    for b in sorted({p["block"] for p in res["points"]}):
        rows = []
        for p in res["points"]:
            if p["block"] != b:
                continue
            bits = p["bits_per_nz"]
            rows.append([p["workers"], f"{p['density']:g}", f"{p['bound_bits_per_nz']:.1f}"]
                        + [f"{bits[k]:.1f}" if k in bits else "-" for k in KINDS]
                        + [p["auto_kind"], f"{p['auto_bits_per_nz']:.1f}", f"{p['auto_over_bound']:.2f}"])
        lines.append(f"block size {b}")
        lines.append(format_table(rows, ["n", "density", "bound", *KINDS, "auto", "auto bits", "auto/bound"]))
        lines.append("")
    lo, hi = TARGET_RANGE
    lines.append(f"auto / bound for densities {lo:g}..{hi:g} (target <= {TARGET_RATIO} for n <= 16):")
    lines.append(format_table([[s["block"], s["workers"], f"{s['min_ratio']:.2f}", f"{s['max_ratio']:.2f}",
                                "yes" if s["meets_target"] else "no"] for s in res["summary"]],
                              ["block", "n", "min", "max", "<= target"]))
    if res["verified"]:
        bad = failed_verifications(res)
        decodes = [r for v in res["verified"] for r in v["result"].values()]
        inexact = sum(r["status"] == "INEXACT" for r in decodes)
        listed = sum(r["inexact_keys"] for r in decodes)
        lines.append("")
        lines.append(f"verify: {len(decodes)} decodes of {len(res['verified'])} instances at numel "
                     f"{res['verified'][0]['numel']} (every index kind): {len(bad)} instance(s) outside the "
                     f"contract or not decoded; {inexact} INEXACT, listing {listed} keys for re-aggregation"
                     + (f": {bad[:3]}" if bad else ""))
    if res.get("verify_too_few_keys"):
        lines.append(f"verify: {res['verify_too_few_keys']} point(s) not verified: fewer than {VERIFY_MIN_KEYS} "
                     "aggregate keys at that numel")
    return "\n".join(lines)


def plot_wire(res: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    blocks = sorted({p["block"] for p in res["points"]})
    workers = sorted({p["workers"] for p in res["points"]})
    fig, axes = plt.subplots(len(blocks), len(workers), figsize=(4 * len(workers), 3.4 * len(blocks)),
                             squeeze=False, sharex=True)
    styles = {"dense": ("0.6", ":"), "bitmap": ("C0", "-"), "bloom": ("C1", "-"), "multilevel": ("C2", "-")}
    for i, b in enumerate(blocks):
        for j, n in enumerate(workers):
            ax = axes[i][j]
            pts = [p for p in res["points"] if p["block"] == b and p["workers"] == n]
            xs = [p["density"] for p in pts]
            for k in KINDS:
                ys = [p["bits_per_nz"].get(k, math.nan) for p in pts]
                ax.plot(xs, ys, color=styles[k][0], linestyle=styles[k][1], label=k, linewidth=1.2)
            ax.plot(xs, [p["auto_bits_per_nz"] for p in pts], "k.", label="auto", markersize=6)
            ax.plot(xs, [p["bound_bits_per_nz"] for p in pts], "r--", label="bound", linewidth=1.5)
            ax.plot(xs, [TARGET_RATIO * p["bound_bits_per_nz"] for p in pts], "r:", label="1.5 x bound",
                    linewidth=1)
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.set_ylim(20, 5e3)
            ax.set_title(f"block {b}, n = {n}", fontsize=10)
            ax.grid(True, which="both", alpha=0.3)
            if i == len(blocks) - 1:
                ax.set_xlabel("aggregate density")
            if j == 0:
                ax.set_ylabel("wire bits / non-zero")
    axes[0][0].legend(fontsize=7, loc="upper right")
    fig.suptitle(f"lossless_hc wire cost per aggregate non-zero (numel {res['numel']})", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
