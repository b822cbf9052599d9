"""Time-to-accuracy results: the target logic, the per-mode summary, the Markdown table and the two
plots (metric against training time and against steps). Runs are the rank-0 reports of
:mod:`lossless_hc.bench.tta_worker` with ``label`` and ``seed`` added (:func:`lossless_hc.bench.tta.run_tta`)."""
from __future__ import annotations

import statistics
from typing import Optional, Sequence

# EXACT: the modes whose curve must equal the uncompressed one (float rounding aside), DDP's sparse
# allreduce among them: one list with the cluster report's, so both tables call the same modes exact
from lossless_hc.bench.cluster_report import AUTO, BASELINE, EXACT, auto_choice, planner_lines, rate_label


def first_reach(curve: Sequence[dict], target: float, higher_is_better: bool) -> Optional[dict]:
    """The first point of ``curve`` (``{"step", "train_s", "metric"}``, in step order) at or past
    ``target`` (``metric >= target`` when higher is better, ``<=`` otherwise), or None. Its
    ``train_s`` is the time to target and its ``step`` the steps to target: resolution one
    evaluation interval, no interpolation (a run could have stopped there, no earlier)."""
    for point in curve:
        m = point["metric"]
        if m == m and (m >= target if higher_is_better else m <= target):  # m == m: NaN never reaches
            return point
    return None


def summarize_run(run: dict, target: float) -> dict:
    hit = first_reach(run["curve"], target, run["higher_is_better"])
    stats = run.get("stats") or {}
    return {"label": run["label"], "seed": run["seed"], "reached": hit is not None,
            "time_to_target_s": hit["train_s"] if hit else None, "steps_to_target": hit["step"] if hit else None,
            "final_metric": run["curve"][-1]["metric"], "steps_run": run["steps_run"], "train_s": run["train_s"],
            "s_per_step": run["train_s"] / run["steps_run"] if run["steps_run"] else None,
            "eval_s": run["eval_s"],
            "wire_bytes_per_step_per_host": (run["wire_bytes_per_host"] / run["steps_run"]
                                             if run.get("wire_bytes_per_host") and run["steps_run"] else None),
            "fallbacks": stats.get("fallbacks", 0) if isinstance(stats, dict) else 0,
            "max_param_diff_vs_none": run.get("max_param_diff_vs_none")}


def summarize_runs(runs: Sequence[dict], target: float) -> list:
    """One row per (mode, seed), plus ``speedup_vs_none``: the same seed's uncompressed time to
    target / this run's (None when either did not reach the target)."""
    rows = [summarize_run(r, target) for r in runs]
    base = {r["seed"]: r for r in rows if r["label"] == BASELINE}
    for r in rows:
        b = base.get(r["seed"])
        r["speedup_vs_none"] = (b["time_to_target_s"] / r["time_to_target_s"]
                                if b and b["reached"] and r["reached"] and r["time_to_target_s"] > 0 else None)
    return rows


def per_mode(rows: Sequence[dict]) -> list:
    """Rows of the same mode across seeds: medians over the seeds that reached the target."""
    out = []
    for label in dict.fromkeys(r["label"] for r in rows):
        rs = [r for r in rows if r["label"] == label]
        hit = [r for r in rs if r["reached"]]

        def med(key, among=hit):
            vals = [r[key] for r in among if r[key] is not None]
            if any(v != v for v in vals):   # a seed that diverged (NaN): shown as such, never sorted away
                return float("nan")
            return statistics.median(vals) if vals else None
        out.append({"label": label, "seeds": len(rs), "reached": len(hit), "time_to_target_s": med("time_to_target_s"),
                    "steps_to_target": med("steps_to_target"), "speedup_vs_none": med("speedup_vs_none"),
                    "final_metric": med("final_metric", rs), "s_per_step": med("s_per_step", rs),
                    "wire_bytes_per_step_per_host": med("wire_bytes_per_step_per_host", rs),
                    "max_param_diff_vs_none": max((r["max_param_diff_vs_none"] for r in rs
                                                   if r["max_param_diff_vs_none"] is not None), default=None),
                    "fallbacks": sum(r["fallbacks"] for r in rs)})
    return out


def _f(v, fmt: str, none: str = "-") -> str:
    return none if v is None else format(v, fmt)


def render_markdown(result: dict) -> str:
    runs, rows = result["runs"], result["summary"]
    metric = runs[0]["metric"] if runs else "metric"
    direction = ">=" if (runs and runs[0]["higher_is_better"]) else "<="
    fair = result.get("cpu_fair")
    sh = result.get("shaping", {})
    lines = [f"### Time to {metric} {direction} {result['target']:g}: {result['title']}", "",
             f"Step cap {result['max_steps']}, evaluation every {result['eval_every']} steps on rank 0 (excluded "
             f"from training time); seeds {', '.join(map(str, result['seeds']))}. Time to target = training "
             f"seconds at the first evaluation at or past the target (this machine's seconds"
             f"{', links dilated' if fair else ''}: compare as ratios).",
             f"Shaping: {sh.get('qdisc', '?')}{'' if sh.get('latency_applied', True) else ' (latency NOT added)'}"
             + (f"; CPU-fair: {fair['workers']} workers on {fair['cores']} cores, links "
                f"{rate_label(fair['applied_rate_bits'])} and {1e6 * fair['applied_delay_s']:.0f} us." if fair else "."),
             "",
             f"| mode | reached (seeds) | time to target s | x none | steps to target | final {metric} "
             "| s/step | wire MiB/step/host | max abs param diff vs none | fallbacks |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for m in per_mode(rows):
        mode = f"**{m['label']}** (planner)" if m["label"] in AUTO else m["label"]
        wire = m["wire_bytes_per_step_per_host"]
        diff = m["max_param_diff_vs_none"]
        lines.append(f"| {mode} | {m['reached']}/{m['seeds']} | {_f(m['time_to_target_s'], '.2f')} "
                     f"| {_f(m['speedup_vs_none'], '.2f')}x | {_f(m['steps_to_target'], '.0f')} "
                     f"| {_f(m['final_metric'], '.4f')} | {_f(m['s_per_step'], '.4f')} "
                     f"| {_f(wire and wire / 2**20, '.3f')} "
                     f"| {_f(diff, '.2e')}{' (exact mode)' if m['label'] in EXACT and diff is not None else ''} "
                     f"| {m['fallbacks']} |")
    if len(result["seeds"]) > 1:
        lines += ["", "Per seed: " + "; ".join(
            f"{r['label']} seed {r['seed']}: {_f(r['time_to_target_s'], '.2f', 'not reached')}"
            f"{' s' if r['reached'] else ''} ({_f(r['steps_to_target'], 'd', '-')} steps)" for r in rows)]
    for run in runs:   # what each planner run ran: its last plan and the step guard's verdict (rank 0's)
        stats = run.get("stats") if isinstance(run.get("stats"), dict) else {}
        choice = auto_choice(stats["plan"]) if isinstance(stats.get("plan"), dict) else None
        if run["label"] in AUTO and (choice or stats.get("guard")):
            seed = f" (seed {run['seed']})" if len(result["seeds"]) > 1 else ""
            lines += planner_lines(run.get("framework", "ddp"), run["label"] + seed, choice, stats.get("guard"))
    return "\n".join(lines) + "\n"


def plot_curves(result: dict, prefix: str) -> list:
    """PREFIX_time.png (metric vs training seconds) and PREFIX_steps.png (metric vs steps): one
    colour per mode, one line per seed, the target dashed. Returns the two paths."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = result["runs"]
    labels = list(dict.fromkeys(r["label"] for r in runs))
    cmap = plt.get_cmap("tab10")
    color = {label: cmap(i % 10) for i, label in enumerate(labels)}
    style = {label: "-" if label in EXACT else "--" for label in labels}
    paths = []
    for axis, xlabel in (("train_s", "training time, s (evaluation excluded)"), ("step", "steps")):
        fig, ax = plt.subplots(figsize=(8, 5))
        seen = set()
        for r in runs:
            xs = [p[axis] for p in r["curve"]]
            ys = [p["metric"] for p in r["curve"]]
            ax.plot(xs, ys, style[r["label"]], color=color[r["label"]], lw=1.4, alpha=0.85,
                    label=None if r["label"] in seen else r["label"])
            seen.add(r["label"])
        ax.axhline(result["target"], color="gray", ls=":", lw=1, label=f"target {result['target']:g}")
        if runs and not runs[0]["higher_is_better"]:
            ax.set_yscale("log")
        ax.set_xlabel(xlabel)
        ax.set_ylabel(runs[0]["metric"] if runs else "metric")
        ax.set_title(result["title"], fontsize=8)
        ax.legend(fontsize=7, ncol=2)
        fig.tight_layout()
        path = f"{prefix}_{'time' if axis == 'train_s' else 'steps'}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        paths.append(path)
    return paths
