"""The planner's cost model evaluated from 2 to 256 hosts: which aggregation strategy is fastest for
NCF-like tensors as the world grows and access skews, what the planner (auto) picks, and how far
the model is from measured collective-only replay points.

    python -m lossless_hc.bench simulate --hosts 2,4,8,16,32,64,128,256 --skews 0,0.8,1.1,1.5 \\
        --bandwidth 1gbit --plot docs/simulate_ncf.png [--measured results/replay_ncf_zipf1.1.json]

The model is :class:`lossless_hc.training.planner.CostModel` with ``Calibration.default(bandwidth,
latency)``: the emulated link (``--bandwidth``; per-message hop latency ``--alpha``, default the
planner's) and the planner's default codec constants: no timing happens here.

Tensors (one step of NCF, per rank): four embedding tables -- user GMF/MLP (``--users`` rows) and
item GMF/MLP (``--items`` rows), ``--dim`` columns -- and the dense MLP. Rows touched per rank and
in the union of n ranks are the expected numbers of distinct ids among the step's draws:
``sum_i 1 - (1 - p_i) ** draws`` (:func:`lossless_hc.bench.workloads.data.expected_distinct`),
with ``draws`` = the batch per rank (union: n x batch). Users: the batch's users, Zipf(s) (s = 0:
uniform). Items: half the draws are positives (the data's Zipf(1) popularity), half negatives
(Zipf(s)), as :class:`lossless_hc.bench.workloads.data.ImplicitFeedback` draws them.

With ``--measured`` (the JSON of ``python -m lossless_hc.bench replay``), the statistics come from
the recording itself (rows per rank and union of the first n ranks, averaged over the recorded
steps), and each framework x mode's measured per-step aggregation time is set against the
prediction: relative error (predicted - measured) / measured. The prediction for a host count uses
the calibration its auto mode measured at start-up (the link and codec constants every rank planned
with: the planner's own model), or, without one or with ``--calibration default``, the default
constants on the replay's applied link, divided by its workers' share of a core (``--cpu-fair``:
the replay's seconds are dilated ones).
"""
from __future__ import annotations

import json
import math
import statistics
import sys
from typing import Optional, Sequence

# the planner's strategy names (lossless_hc.training.planner.EXACT_STRATEGIES, LOSSY_STRATEGIES), in
# its order; repeated here so that this module imports without the planner
EXACT = ("dense", "allgather", "two_phase", "sketch")
LOSSY = ("fp16", "bf16", "thc", "topk", "topk_allgather")
STRATEGIES = EXACT + LOSSY
# bench modes -> the planner's strategy names (auto: the planner's own choice per tensor)
MODE_STRATEGY = {"none": "dense", "sparse": "allgather", "lossless": "sketch", "fp16": "fp16", "bf16": "bf16",
                 "thc": "thc", "topk": "topk", "topk-allgather": "topk_allgather"}
AUTO_MODES = ("auto", "auto-lossy", "auto-sparse", "auto-lossy-sparse")   # the planner's modes (bench cluster's names)


def planner():
    """The planner module, or SystemExit naming what is missing."""
    try:
        from lossless_hc.training import planner as mod
    except ImportError as exc:
        raise SystemExit(f"python -m lossless_hc.bench simulate needs lossless_hc.training.planner ({exc})")
    return mod


def calibration(rate_bits: float, alpha_s: Optional[float] = None, cpu_share: float = 1.0):
    """The planner's default calibration (its default codec constants) for a link of ``rate_bits``
    bit/s and ``alpha_s`` seconds per message hop (None: the planner's default latency), on hosts
    with ``cpu_share`` of a core each: every local cost is divided by it (a replay under
    ``--cpu-fair`` runs 8 workers on 2 cores at 1/4 of a core, its links dilated by the same factor)."""
    pl = planner()
    if not 0 < cpu_share <= 1:
        raise ValueError(f"cpu_share must be in (0, 1], got {cpu_share}")
    cal = pl.Calibration.default(rate_bits, pl.DEFAULT_LATENCY_S if alpha_s is None else alpha_s)
    if cpu_share == 1:
        return cal
    return pl.Calibration(cal.link, {s: (a / cpu_share, b / cpu_share) for s, (a, b) in cal.codec_seconds.items()})


# -- the tensors of one NCF step ---------------------------------------------------------------------
def ncf_tensors(n: int, skew: float, users: int, items: int, dim: int, batch: int) -> list:
    """(name, numel, row, rank_keys, union_keys) of one NCF step on ``n`` ranks under the Zipf
    model of the module docstring. Dense tensors: rows of 1 coordinate, every key on every rank."""
    from lossless_hc.bench.workloads.data import expected_distinct, zipf_weights
    from lossless_hc.bench.workloads.models import NCF

    mlp_numel = sum(p.numel() for name, p in NCF(1, 1, dim=dim).named_parameters() if "mlp." in name or "out." in name)
    u = zipf_weights(users, skew)
    it = 0.5 * zipf_weights(items, 1.0) + 0.5 * zipf_weights(items, skew)
    ku, uu = expected_distinct(u, batch), expected_distinct(u, n * batch)
    ki, ui = expected_distinct(it, 2 * batch), expected_distinct(it, n * 2 * batch)
    out = []
    for name, rows, k, un in (("user_gmf", users, ku, uu), ("item_gmf", items, ki, ui),
                              ("user_mlp", users, ku, uu), ("item_mlp", items, ki, ui)):
        out.append((name, rows * dim, dim, (round(k),) * n, round(un)))
    out.append(("mlp", mlp_numel, 1, (mlp_numel,) * n, mlp_numel))
    return out


def recorded_tensors(measured: dict, n: int) -> list:
    """The same, from a replay recording: rows per rank (first n ranks) and union of the first n
    ranks, averaged over the recorded steps; dense parameters as in :func:`ncf_tensors`."""
    out = []
    for name, shape, rows in zip(measured["names"], measured["shapes"], measured["row_sparse"]):
        numel = math.prod(shape)
        if rows:
            st = [s[name] for s in measured["row_stats"]]
            ks = tuple(round(statistics.fmean(s["rank_keys"][r] for s in st)) for r in range(n))
            un = round(statistics.fmean(s["union_keys_first_n"][n - 1] for s in st))
            out.append((name, numel, numel // shape[0], ks, un))
        else:
            out.append((name, numel, 1, (numel,) * n, numel))
    return out


def step_times(model, tensors: Sequence[tuple], n: int) -> dict:
    """{strategy: predicted seconds for the whole step} plus each of :data:`AUTO_MODES` (the sum of the
    planner's per-tensor choices; the -sparse ones: the tables' gradients sparse, as DDP hands
    ``nn.Embedding(sparse=True)``'s to auto_hook -- the tables are the tensors with rows of more than
    one coordinate) and "<mode>_choice" (strategy -> tensors)."""
    pl = planner()
    total = {s: 0.0 for s in STRATEGIES}
    out = {m: 0.0 for m in AUTO_MODES}
    out.update({f"{m}_choice": {} for m in AUTO_MODES})
    for name, numel, row, ks, un in tensors:
        st = pl.TensorStats(numel=numel, row=row, world_size=n, rank_keys=tuple(ks), union_keys=un)
        for s in STRATEGIES:
            total[s] += model.predict(s, st)
        sparse = pl.TensorStats(numel=numel, row=row, world_size=n, rank_keys=tuple(ks), union_keys=un,
                                sparse=row > 1)
        for mode, lossy, stats in (("auto", False, st), ("auto-lossy", True, st), ("auto-sparse", False, sparse),
                                   ("auto-lossy-sparse", True, sparse)):
            pick, costs = model.choose(stats, lossy=lossy)
            out[mode] += costs[pick]
            out[f"{mode}_choice"].setdefault(pick, []).append(name)
    out.update(total)
    return out


def sweep(hosts: Sequence[int], skews: Sequence[float], rate_bits: float, alpha_s: Optional[float],
          users: int, items: int, dim: int, batch: int) -> list:
    model = planner().CostModel(calibration(rate_bits, alpha_s))
    rows = []
    for s in skews:
        for n in hosts:
            t = ncf_tensors(n, s, users, items, dim, batch)
            rows.append({"skew": s, "hosts": n, "union_rows_user": t[0][4], "rank_rows_user": t[0][3][0],
                         **step_times(model, t, n)})
    return rows


def recorded_calibration(result: dict):
    """The calibration an auto mode of one replayed host count planned with (rank 0's
    ``stats()["calibration"]``, the same on every rank), or None if no auto row recorded one."""
    pl = planner()
    for r in result["rows"]:
        cal = r.get("auto_calibration") or {}
        if r["compression"] in AUTO_MODES and {"alpha_s", "seconds_per_byte", "codec_seconds"} <= set(cal):
            # absent from runs before the allgather's, or the half allreduce's, own beta
            gather, half = cal.get("allgather_seconds_per_byte"), cal.get("half_seconds_per_byte")
            link = pl.LinkModel(float(cal["alpha_s"]), float(cal["seconds_per_byte"]),
                                None if gather is None else float(gather), None if half is None else float(half))
            return pl.Calibration(link,
                                  {s: (float(v[0]), float(v[1])) for s, v in cal["codec_seconds"].items()})
    return None


def check(measured: dict, alpha_s: Optional[float], use_recorded: bool = True) -> list:
    """Predicted vs measured per-step aggregation time for every replayed (hosts, framework, mode):
    priced with the calibration the replay's auto mode measured at start-up on that host count (the
    planner's own model; ``use_recorded`` and a recorded one), else with the default constants on the
    replay's applied link (``alpha_s``: per-hop latency, None: the links' applied one-way delay, or the
    planner's default where the links could not add one) and its workers' share of a core."""
    out = []
    skew = measured["recording"]["options"].get("skew") or 0.0
    for n_text, res in sorted(measured["by_hosts"].items(), key=lambda kv: int(kv[0])):
        n = int(n_text)
        cal = recorded_calibration(res) if use_recorded else None
        source = "measured"
        if cal is None:
            source = "default"
            rate = res["shaping"].get("rate_bits") or res["bandwidth_bits"]
            delay = res["shaping"].get("delay_s", res["latency_s"])
            # A hop of the planner's ring is one message one way (every rank sends to its successor at
            # once), and the cluster delays each host's uplink only: one delay per hop, not a round trip.
            applied = alpha_s if alpha_s is not None else (delay if res["shaping"].get("latency_applied") else None)
            # the measured seconds are dilated ones (the link's rate is the applied, scaled one): price
            # the codecs at the workers' share of a core too
            cal = calibration(rate, applied, (res.get("cpu_fair") or {}).get("share", 1.0))
        model = planner().CostModel(cal)
        pred = step_times(model, recorded_tensors(measured, n), n)
        for r in res["rows"]:
            mode = r["compression"]
            key = mode if mode in AUTO_MODES else MODE_STRATEGY.get(mode)
            meas = r.get("aggregation_s")
            if key is None or meas is None or meas <= 0:
                continue
            out.append({"skew": skew, "hosts": n, "framework": r["framework"], "mode": mode, "strategy": key,
                        "calibration": source, "predicted_s": pred[key], "measured_s": meas,
                        "rel_error": (pred[key] - meas) / meas})
    return out


# -- output ------------------------------------------------------------------------------------------
def render(rows: list, checks: list, title: str) -> str:
    lines = [f"### {title}", "", "| skew | hosts | user rows/rank | union | " + " | ".join(STRATEGIES)
             + " | auto (exact) | auto-lossy | auto-sparse | auto's choice for the user table |",
             "|---|---|---|---|" + "---|" * (len(STRATEGIES) + 4)]
    for r in rows:
        pick = next((s for s, names in r["auto_choice"].items() if "user_gmf" in names), "?")
        lines.append(f"| {r['skew']} | {r['hosts']} | {r['rank_rows_user']} | {r['union_rows_user']} | "
                     + " | ".join(f"{1e3 * r[s]:.2f}" for s in STRATEGIES)
                     + f" | **{1e3 * r['auto']:.2f}** | {1e3 * r['auto-lossy']:.2f} | {1e3 * r['auto-sparse']:.2f} "
                     f"| {pick} |")
    lines.append("\nPredicted milliseconds of aggregation per step.")
    if checks:
        errs = [abs(c["rel_error"]) for c in checks]
        lines += ["", "#### The model against the measured replay points", "",
                  f"Median |relative error| {100 * statistics.median(errs):.0f}%, max {100 * max(errs):.0f}% "
                  f"over {len(errs)} points.", "",
                  "| hosts | framework | mode (strategy) | calibration | predicted ms | measured ms | error |",
                  "|---|---|---|---|---|---|---|"]
        for c in checks:
            lines.append(f"| {c['hosts']} | {c['framework']} | {c['mode']} ({c['strategy']}) | {c['calibration']} | "
                         f"{1e3 * c['predicted_s']:.2f} | {1e3 * c['measured_s']:.2f} | {100 * c['rel_error']:+.0f}% |")
    return "\n".join(lines) + "\n"


def plot(rows: list, checks: list, path: str, title: str) -> None:
    """One panel per skew: each strategy's predicted step aggregation time against hosts (log-log),
    auto's choice as a thick line (labelled with its strategy for the user table), measured replay
    points as crosses in their strategy's colour."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    skews = sorted({r["skew"] for r in rows})
    fig, axes = plt.subplots(1, len(skews), figsize=(4.2 * len(skews), 4.2), sharey=True, squeeze=False)
    colors = dict(zip(STRATEGIES, plt.cm.tab10.colors))
    for ax, s in zip(axes[0], skews):
        pts = sorted((r for r in rows if r["skew"] == s), key=lambda r: r["hosts"])
        n = [r["hosts"] for r in pts]
        for st in STRATEGIES:
            ax.plot(n, [1e3 * r[st] for r in pts], color=colors[st], lw=1.2,
                    ls="-" if st in EXACT else "--", label=st)
        ax.plot(n, [1e3 * r["auto"] for r in pts], color="black", lw=3, alpha=0.35, label="auto (exact)")
        for r in pts:
            pick = next((p for p, names in r["auto_choice"].items() if "user_gmf" in names), "")
            ax.annotate(pick, (r["hosts"], 1e3 * r["auto"]), fontsize=6, rotation=45)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("hosts")
        ax.set_title(f"Zipf skew {s}" if s else "uniform ids")
        ax.grid(alpha=0.3)
    for c in checks:  # on the panel of the recording's skew (the first panel if it is not swept)
        ax = axes[0][skews.index(c["skew"])] if c["skew"] in skews else axes[0][0]
        ax.plot(c["hosts"], 1e3 * c["measured_s"], "x", color=colors.get(c["strategy"], "black"), ms=7)
    axes[0][0].set_ylabel("predicted aggregation ms / step")
    axes[0][-1].legend(fontsize=7, loc="upper left")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def cmd_simulate(args) -> int:
    from lossless_hc.bench.cluster import parse_delay, parse_rate, rate_label
    from lossless_hc.bench.common import command_line

    try:
        rate = parse_rate(args.bandwidth)
        alpha = parse_delay(args.alpha) if args.alpha else None
        if (not args.hosts or not args.skews or min(args.hosts) < 2 or max(args.hosts) > 4096
                or not all(math.isfinite(s) and s >= 0 for s in args.skews)):   # NaN fails `s < 0` too
            raise ValueError("--hosts must be in [2, 4096] and --skews finite and >= 0 (at least one of each)")
    except ValueError as exc:
        print(f"python -m lossless_hc.bench simulate: error: {exc}", file=sys.stderr)
        return 2
    rows = sweep(args.hosts, args.skews, rate, alpha, args.users, args.items, args.dim, args.batch)
    checks = []
    if args.measured:
        with open(args.measured) as f:
            checks = check(json.load(f), alpha, use_recorded=args.calibration == "recorded")
    title = (f"NCF ({args.users} users, {args.items} items, dim {args.dim}, batch {args.batch}/rank), "
             f"{rate_label(rate)}: the planner's cost model")
    print(render(rows, checks, title))
    if args.plot:
        plot(rows, checks, args.plot, title)
        print(f"[simulate] wrote {args.plot}", file=sys.stderr)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": command_line(), "rows": rows, "checks": checks}, f, indent=1)
    return 0


def add_arguments(p) -> None:
    from lossless_hc.bench.workloads.options import positive_int
    floats = lambda s: [float(v) for v in s.split(",") if v.strip()]  # noqa: E731
    ints = lambda s: [int(v) for v in s.split(",") if v.strip()]  # noqa: E731
    p.add_argument("--hosts", type=ints, default=[2, 4, 8, 16, 32, 64, 128, 256])
    p.add_argument("--skews", type=floats, default=[0.0, 0.8, 1.1, 1.5], help="Zipf exponents (0: uniform)")
    p.add_argument("--bandwidth", default="1gbit")
    p.add_argument("--alpha", help="per-message latency, e.g. 200us (default: the planner's default calibration)")
    p.add_argument("--users", type=positive_int, default=50_000)
    p.add_argument("--items", type=positive_int, default=50_000)
    p.add_argument("--dim", type=positive_int, default=32)
    p.add_argument("--batch", type=positive_int, default=512, help="interactions per rank per step")
    p.add_argument("--measured", help="JSON of `python -m lossless_hc.bench replay`: compare the model with it")
    p.add_argument("--calibration", choices=("recorded", "default"), default="recorded",
                   help="with --measured: price each host count with the calibration its auto mode measured "
                        "(recorded, where the replay has one) or with the default constants")
    p.add_argument("--plot", help="PNG path, e.g. docs/simulate_ncf.png")
    p.add_argument("--json", help="write the rows and checks here")
    p.set_defaults(func=cmd_simulate)
