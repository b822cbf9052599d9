"""The emulated cluster benchmark's output: the result rows (statistics of the workers' JSON reports),
the Markdown table (the user's question first) and the plot. Results are the dicts of
:func:`lossless_hc.bench.cluster.run_benchmark`."""
from __future__ import annotations

import math
import statistics
from typing import Optional, Sequence

BASELINE = "none"
# modes whose result equals the uncompressed run within the exactness contract
LOSSLESS = ("lossless", "auto", "auto-sparse")
AUTO = ("auto", "auto-lossy", "auto-sparse", "auto-lossy-sparse")   # the planner's modes: marked in the tables
AUTO_EXACT = ("auto", "auto-sparse")            # ... of them the exact ones (compared with the fastest exact mode)
EXACT = (BASELINE, "sparse", *LOSSLESS)          # the modes "fastest exact" ranks: the sum up to float rounding
# The modes that train the model with nn.Embedding(sparse=True) (workloads.train.SPARSE_MODES, which imports
# torch; tests/test_cluster_fair.py checks they agree): another setup than the other modes', compared
# within itself.
SPARSE_SETUP = ("sparse", "auto-sparse", "auto-lossy-sparse")


def rate_label(bits: int) -> str:
    for unit, scale in (("gbit", 10**9), ("mbit", 10**6), ("kbit", 10**3)):
        if bits % scale == 0:
            return f"{bits // scale}{unit}"
    return f"{bits}bit"



# -- result rows: statistics of the workers' reports --------------------------------------------------
def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (q in [0, 100]) of a non-empty sequence."""
    if not values:
        raise ValueError("percentile of no values")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def aggregation_throughput(dense_bytes: float, step_s: float, compute_s: float) -> Optional[float]:
    """Dense gradient bytes aggregated per second of communication: dense_bytes / (step - compute).
    None when the step is not longer than compute alone (communication not measurable)."""
    comm = step_s - compute_s
    return dense_bytes / comm if comm > 0 else None


def summarize(framework: str, compression: str, ranks: Sequence[dict], compute_s: Optional[float],
              hosts: Optional[int] = None, round_medians: Optional[Sequence[float]] = None) -> dict:
    """One result row from the per-rank JSON reports of :mod:`lossless_hc.bench.workloads.train`
    (``round_medians``: rank 0's median step of each round, when the reports merge several rounds)."""
    if not ranks:
        raise ValueError("summarize: no rank reports")
    ranks = sorted(ranks, key=lambda r: r["rank"])
    steps = ranks[0]["step_seconds"]
    if not steps:
        raise ValueError("summarize: no timed steps")
    median = statistics.median(steps)
    dense = ranks[0]["dense_bytes_per_step"]
    timed = ranks[0]["timed_steps"]
    wire = [r["net_bytes"]["tx_bytes"] / timed for r in ranks if r.get("net_bytes")]
    stats = ranks[0].get("stats") or {}
    codec_s = (stats.get("encode_seconds", 0.0) + stats.get("decode_seconds", 0.0)) / timed if stats else 0.0
    return {
        "framework": framework, "compression": compression, "hosts": hosts or len(ranks), "workers": len(ranks),
        "timed_steps": timed,
        "step_s_median": median, "step_s_p10": percentile(steps, 10), "step_s_p90": percentile(steps, 90),
        "step_s_mean": statistics.fmean(steps),   # what the run's length follows (the median ignores the tails)
        "compute_s": compute_s, "dense_bytes_per_step": dense,
        "aggregation_s": median - compute_s if compute_s is not None else None,
        "wire_bytes_per_step_per_host": statistics.fmean(wire) if wire else None,
        "aggregation_bytes_per_s": (aggregation_throughput(dense, median, compute_s)
                                    if compute_s is not None else None),
        "codec_share": codec_s / median if median > 0 else None,
        "fallbacks": stats.get("fallbacks", 0) if stats else 0,
        "auto_choice": auto_choice(stats.get("plan")) if stats and isinstance(stats.get("plan"), dict) else None,
        "auto_guard": stats.get("guard") if stats else None,
        "auto_calibration": stats.get("calibration") if stats else None,   # rank 0's: what every rank planned with
        "step_s_round_medians": list(round_medians) if round_medians else None,
        "final_loss": ranks[0]["final_loss"], "metric": ranks[0]["metric"], "metric_value": ranks[0]["value"],
    }


def merge_rounds(rounds: Sequence[Sequence[dict]]) -> list:
    """One configuration's per-rank reports from several rounds (``rounds[r][i]``: round r, rank i) as
    one run's: each rank's timed steps concatenated, its timed-step count, tx/rx bytes and codec seconds
    summed; the rest (plans, guard, final parameters' loss) from the last round. Every round trains the
    same steps from the same seed, so only times and counters differ."""
    if not rounds or not rounds[0]:
        raise ValueError("merge_rounds: no reports")
    if any(len(r) != len(rounds[0]) for r in rounds):
        raise ValueError("merge_rounds: rounds with different numbers of ranks")
    merged = []
    for i in range(len(rounds[0])):
        per = [r[i] for r in rounds]
        out = dict(per[-1])
        out["step_seconds"] = [t for rep in per for t in rep["step_seconds"]]
        out["timed_steps"] = sum(rep["timed_steps"] for rep in per)
        if all(rep.get("net_bytes") for rep in per):
            out["net_bytes"] = {k: sum(rep["net_bytes"][k] for rep in per) for k in per[-1]["net_bytes"]}
        if all(rep.get("stats") for rep in per):
            stats = dict(per[-1]["stats"])
            for k in ("encode_seconds", "decode_seconds"):
                if k in stats:
                    stats[k] = sum(rep["stats"].get(k, 0.0) for rep in per)
            out["stats"] = stats
        merged.append(out)
    return merged


def auto_choice(plan: dict) -> dict:
    """{strategy: tensors} from the planner's ``stats()["plan"]`` (rank 0's last choices)."""
    out: dict = {}
    for name, p in sorted(plan.items()):
        out.setdefault(p.get("strategy"), []).append(name)
    return out


def add_relative(rows: list) -> list:
    """Adds speed-up, throughput and wire ratios against the same framework's uncompressed row."""
    base = {r["framework"]: r for r in rows if r["compression"] == BASELINE}
    for r in rows:
        b = base.get(r["framework"])
        r["speedup_vs_none"] = b["step_s_median"] / r["step_s_median"] if b else None
        ta, tb = r["aggregation_bytes_per_s"], (b or {}).get("aggregation_bytes_per_s")
        r["throughput_vs_none"] = ta / tb if ta and tb else None
        wa, wb = r["wire_bytes_per_step_per_host"], (b or {}).get("wire_bytes_per_step_per_host")
        r["wire_vs_none"] = wa / wb if wa is not None and wb else None
    return rows


# -- tables and plots ----------------------------------------------------------------------------------------
def _f(v, fmt: str, none: str = "-") -> str:
    """``v`` formatted; ``none`` for a missing value: None, or NaN (what a report's JSON reads back as null)."""
    return none if v is None or v != v else format(v, fmt)


def _computes(result: dict) -> dict:
    """{label: compute-only seconds} (one unlabelled float in results of before the labels)."""
    c = result["compute_s"]
    return {"1 worker/host": c} if isinstance(c, (int, float)) else {str(k): v for k, v in c.items()}


def diverged(row: dict) -> bool:
    """Whether a result row's run diverged: its final loss or held-out metric is not a finite number
    (NaN or inf; null where the report's strict JSON was read back). A row without those fields (made
    by hand) is taken as finite."""
    return any(k in row and not (isinstance(row[k], (int, float)) and math.isfinite(row[k]))
               for k in ("final_loss", "metric_value"))


def answer_line(rows: Sequence[dict]) -> str:
    """The user's question first: which mode makes the step fastest, exact (:data:`EXACT`) and overall,
    and where the planner's choice (auto) lands against them: the ratio of its step time to theirs
    (above 1: slower). A run with the sparse-embedding modes holds two setups of the model (SPARSE_SETUP
    and the rest); each is answered, and each planner mode compared, within its own. A run that
    diverged (:func:`diverged`) is never ranked, and is named as such; a setup without an exact mode
    (or whose exact runs all diverged) says so instead of naming a lossy mode "fastest exact"."""
    if not rows:
        return ""
    setups = [("", [r for r in rows if r["compression"] not in SPARSE_SETUP]),
              ("sparse embeddings: ", [r for r in rows if r["compression"] in SPARSE_SETUP])]
    setups = [(label, rs) for label, rs in setups if rs]
    if len(setups) > 1:
        setups[0] = ("dense embeddings: ", setups[0][1])

    def named(r):
        return (f"{r['framework']} {r['compression']} ({1e3 * r['step_s_median']:.1f} ms, "
                f"{_f(r['speedup_vs_none'], '.2f')}x none)")
    parts, refs = [], {}
    for label, rs in setups:
        ranked = [r for r in rs if not diverged(r)]
        exact = [r for r in ranked if r["compression"] in EXACT]
        best_exact = min(exact, key=lambda r: r["step_s_median"]) if exact else None
        best = min(ranked, key=lambda r: r["step_s_median"]) if ranked else None
        none_exact = ("- (every exact run diverged)" if any(r["compression"] in EXACT for r in rs)
                      else "- (no exact mode in this run)")
        parts.append(f"{label}fastest exact: {named(best_exact) if best_exact else none_exact}")
        parts.append(f"fastest overall: {named(best) if best else '- (every run diverged)'}")
        refs.update({id(r): (best_exact, best) for r in rs})
    for r in rows:
        if r["compression"] in AUTO:
            exact_mode = r["compression"] in AUTO_EXACT
            ref = refs[id(r)][0 if exact_mode else 1]
            what = f"{r['framework']} {r['compression']}"
            if diverged(r):
                parts.append(f"{what}: diverged")
                continue
            mean = (f" (mean step {r['step_s_mean'] / ref['step_s_mean']:.2f}x)"
                    if r.get("step_s_mean") and ref.get("step_s_mean") else "")
            parts.append(f"{what}: step {r['step_s_median'] / ref['step_s_median']:.2f}x "
                         f"the fastest {'exact' if exact_mode else 'overall'}'s{mean}")
    gone = [r for r in rows if diverged(r)]
    if gone:
        parts.append("diverged, not ranked: " + ", ".join(f"{r['framework']} {r['compression']}" for r in gone))
    return "Is the step faster? " + "; ".join(parts) + "."


def render_markdown(result: dict, title: str) -> str:
    sh = result.get("shaping", {})
    note = ("" if sh.get("latency_applied", True) else
            " The kernel has no netem: links are rate-limited by tbf and the requested latency was NOT added.")
    fair = result.get("cpu_fair")
    # the dilated delay only where the links carry one (tbf adds none)
    delay = (f" and {1e6 * fair['applied_delay_s']:.0f} us one-way" if fair and sh.get("latency_applied", True)
             else "")
    fair_line = ("" if not fair else
                 f"CPU-fair: {fair['workers']} workers on {fair['cores']} cores, one thread each, share "
                 f"{fair['share']:.3g} of a core: links dilated to {rate_label(fair['applied_rate_bits'])}{delay} "
                 f"(times are this machine's seconds).\n")
    computes = ", ".join(f"{1e3 * v:.1f} ms ({k})" for k, v in sorted(_computes(result).items()))
    skipped = result.get("skipped") or []
    lines = [f"### {title}", "", answer_line(result["rows"]), "",
             f"Shaping: {sh.get('qdisc', '?')} on every host's uplink and downlink.{note}",
             f"{fair_line}Compute-only step (same workers, no aggregation): {computes}."]
    if result.get("settings"):
        lines.append(f"Settings: {result['settings']}.")
    if (result.get("rounds") or 1) > 1:
        lines.append(f"Rounds: {result['rounds']}, the modes in the listed order and reversed, alternately; each "
                     "row's median and p10–p90 pool every round's timed steps. Median of each round (ms): "
                     + "; ".join(f"{r['compression']} " + " / ".join(f"{1e3 * m:.1f}" for m in r["step_s_round_medians"])
                                 for r in result["rows"] if r.get("step_s_round_medians")) + ".")
    if skipped:
        lines.append("Not run (the framework does not implement the mode): "
                     + ", ".join(f"{fw} {c}" for fw, c in skipped) + ".")
    if result.get("refused"):   # cluster.refusals: the training driver's reason
        lines.append("Not run (the training driver refuses the configuration): "
                     + "; ".join(f"{fw} {c} ({why})" for fw, c, why in result["refused"]) + ".")
    lines += ["",
              "| framework | compression | step ms median (p10–p90) | step ms mean | speed-up vs none "
              "| wire MiB/step/host | wire vs none | aggregation GB/s | x none | enc+dec share "
              "| max abs param diff vs none | fallbacks | aggregation ms/step |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        wire = r["wire_bytes_per_step_per_host"]
        diff = r["max_param_diff_vs_none"]
        mode = f"**{r['compression']}** (planner)" if r["compression"] in AUTO else r["compression"]
        agg = r.get("aggregation_s")
        lines.append(
            f"| {r['framework']} | {mode} | {1e3 * r['step_s_median']:.1f} "
            f"({1e3 * r['step_s_p10']:.1f}–{1e3 * r['step_s_p90']:.1f}) "
            f"| {_f(r.get('step_s_mean') and 1e3 * r['step_s_mean'], '.1f')} | {_f(r['speedup_vs_none'], '.2f')}x "
            f"| {_f(wire and wire / 2**20, '.2f')} | {_f(r['wire_vs_none'], '.3f')} "
            f"| {_f(r['aggregation_bytes_per_s'] and r['aggregation_bytes_per_s'] / 1e9, '.3f')} "
            f"| {_f(r['throughput_vs_none'], '.2f')} | {_f(r['codec_share'] and 100 * r['codec_share'], '.1f')}% "
            f"| {_f(diff, '.2e')}{' (lossless)' if r['lossless_mode'] and diff is not None else ''} "
            f"| {r['fallbacks']} | {_f(agg and 1e3 * agg, '.1f')} |")
    for r in result["rows"]:
        g = r.get("auto_guard")
        if r.get("auto_choice") or g:
            lines += planner_lines(r["framework"], r["compression"], r.get("auto_choice"), g)
            per_round = [x for x in (r.get("auto_guard_rounds") or []) if x]
            ends = [x["window"] + _guard_span(x) for x in (per_round or [g]) if x and x.get("window") is not None]
            warmup = result.get("warmup")
            if ends and warmup is not None and max(ends) > warmup:
                lines.append(f"step guard: the trial ran into the timed steps (from step {warmup}), so its "
                             f"dense blocks are in this row's times; --warmup {max(ends)} times after it")
            if len(per_round) > 1:
                lines.append("step guard per round: " + ", ".join(
                    f"{x['verdict'] or ('no trial' if x.get('window') is None else 'no verdict')}"
                    + (f" ({_window_medians(x)} ms)" if x.get("verdict") else "")
                    for x in per_round))
    return "\n".join(lines) + "\n"


def planner_lines(framework: str, compression: str, choice: Optional[dict], g: Optional[dict]) -> list:
    """What a planner mode ran, for the reports (this one and ``bench tta``'s): its last plan
    (:func:`auto_choice`; None for plain FSDP, whose sparse reduce-scatter is all it plans) and the step
    guard's verdict and medians ``g`` (rank 0's ``stats()["guard"]``), the first line opening a paragraph."""
    if choice:
        lines = [f"\n{framework} {compression} chose (rank 0, last plan): " + "; ".join(
            f"{st}: {len(names)} tensor{'s' if len(names) > 1 else ''} ({', '.join(names[:4])}"
            f"{', ...' if len(names) > 4 else ''})" for st, names in choice.items())]
    else:   # plain FSDP: no plan, the sparse reduce-scatter alone under the guard
        lines = [f"\n{framework} {compression}: the sparse reduce-scatter"]
    if g and g.get("verdict"):
        engine = {"ddp": "DDP", "fsdp": "HSDP"}.get(framework, framework.capitalize())
        halves = {k: v for k, v in (g.get("alternative") or {}).items() if k != "dense"}
        own = "".join(f", {v} tensor{'s' if v > 1 else ''} in {k}" for k, v in halves.items())
        dense = f"dense allreduce in place ({engine}'s own{own})" if choice else "FSDP2's own reduce-scatter"
        ran = {"plan": "the plans", "powersgd": "torch's PowerSGD hook on every bucket it may take"}.get(
            g["verdict"], dense)
        span = _guard_span(g)
        recheck = list(g.get("windows") or ()) == ["plan"]
        psgd = "powersgd" in (g.get("windows") or ()) or (recheck and math.isfinite(g.get("powersgd_ms", math.nan)))
        steps = f"steps {g['window']}-{g['window'] + span - 1}"
        rest = (f", PowerSGD {g['powersgd_ms']:.1f} ms" if psgd else "") + f" median step: {ran} from then on"
        if recheck:   # a re-plan's plans alone, against the other windows' medians of the last decisive trial
            lines.append(f"step guard ({steps}, the re-planned plans rechecked): plans {g['plan_ms']:.1f} ms "
                         f"against the last trial's dense {g['dense_ms']:.1f} ms" + rest)
        else:
            lines.append(f"step guard ({steps}): plans {g['plan_ms']:.1f} ms, dense {g['dense_ms']:.1f} ms" + rest)
        if (g.get("block") or 1) > 1 and not recheck:
            lines.append(f"step guard: blocks of {g['block']} steps per window, the last one timed; the "
                         f"untimed ones (after a switch) {_f(g['lead_plan_ms'], '.1f')} ms in the plans' "
                         f"blocks, {_f(g['lead_dense_ms'], '.1f')} ms in dense's"
                         + (f", {_f(g.get('lead_powersgd_ms'), '.1f')} ms in PowerSGD's" if psgd else ""))
    elif g and g.get("window") is None:
        lines.append("step guard: no trial (every dense gradient's plan was dense)")
    elif g:
        lines.append(f"step guard: trial from step {g['window']} not finished in this run "
                     f"({_guard_span(g)} steps)")
    if g and (g.get("trials") or 0) > 1:
        lines.append(f"step guard: {g['trials']} trials (a re-plan changed the plans after a verdict)")
    return lines


def _guard_span(g: dict) -> int:
    """Steps of the guard's trial (its stats' ``span``: fewer after an early look's verdict; for stats
    written before it, StepGuard.span: its windows, two or three with PowerSGD's, in blocks, a look for the
    plans or PowerSGD adding confirmation rounds)."""
    if g.get("span") is not None:
        return g["span"]
    windows = len(g.get("windows") or ("plan", "dense"))
    return windows * g["steps"] * (g.get("block") or 1) * (g.get("rounds") or 1)


def _window_medians(g: dict) -> str:
    """A trial's window medians for a line of the report: ``plans / dense[ / PowerSGD]`` in milliseconds."""
    windows = [w for w in ("plan", "dense", "powersgd") if w in (g.get("windows") or ("plan", "dense"))]
    return " / ".join(f"{g[f'{w}_ms']:.1f}" for w in windows)


def plot(result: dict, title: str, path: str) -> None:
    """Two panels: median step time (p10–p90 whiskers) and wire bytes per configuration."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    labels = [f"{r['framework']}\n{r['compression']}" for r in rows]
    colors = [{"horovod": "#4c72b0", "ddp": "#dd8452", "fsdp": "#55a868"}[r["framework"]] for r in rows]
    x = range(len(rows))
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(max(6, 0.9 * len(rows)), 7), sharex=True)
    med = [1e3 * r["step_s_median"] for r in rows]
    err = [[m - 1e3 * r["step_s_p10"] for m, r in zip(med, rows)], [1e3 * r["step_s_p90"] - m for m, r in zip(med, rows)]]
    ax1.bar(x, med, yerr=err, color=colors, capsize=3)
    for i, (k, v) in enumerate(sorted(_computes(result).items())):
        ax1.axhline(1e3 * v, color="gray", ls=("--", ":", "-.", "-")[i % 4], lw=1, label=f"compute only ({k})")
    ax1.set_ylabel("step time, ms (median, p10–p90)")
    ax1.legend(loc="upper right")
    ax1.set_title(title)
    ax2.bar(x, [(r["wire_bytes_per_step_per_host"] or 0) / 2**20 for r in rows], color=colors)
    ax2.set_ylabel("wire MiB / step / host")
    ax2.set_xticks(list(x), labels, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
