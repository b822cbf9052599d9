"""Emulated cluster benchmark: real workers in network namespaces joined by shaped links.

    sudo .venv/bin/python -m lossless_hc.bench cluster --hosts 4 --bandwidth 1gbit --latency 100us --cpu-fair \\
        --model ncf --skew 1.1 --compression none,fp16,bf16,powersgd,sparse,topk-allgather,lossless,auto,auto-lossy \\
        --framework horovod,ddp
    ... --framework ddp --compression sparse,auto,auto-sparse   (auto-sparse: auto_hook over nn.Embedding(sparse=True))
    ... --framework fsdp --shards 2 --compression none,lossless,topk,thc,auto      (HSDP: hosts x 2 shards)
    ... --replay DIR      (collective-only: gradients recorded by `python -m lossless_hc.bench replay`)

The topology: one network namespace per "host", each with an interface ``eth0`` that is one end of
a veth pair whose other end is a port of a Linux bridge in the root namespace (a non-blocking
switch). Every link is shaped with netem in both directions: the host's egress (its uplink) gets
the rate and the one-way delay, the bridge port's egress (its downlink) the rate. The bridge itself
has an address in the root namespace, where Horovod's rendezvous server listens.

Per configuration (framework x compression) one real worker process per namespace (FSDP: ``--shards``) runs
:mod:`lossless_hc.bench.workloads.train` (Horovod over Gloo, rendezvous without ssh or horovodrun; or DDP
over Gloo), a warm-up, then timed steps; each rank reports its step times, its interface's byte
counters over the timed window and its compressor's statistics. A compute-only run (same number of
worker processes, no aggregation) gives the compute part of a step.

Definitions (reported per configuration; ``step`` = rank 0's median timed step):

* wire bytes: bytes counted by the kernel on each host's ``eth0`` (tx) during the timed window,
  averaged over hosts, per step — headers and retransmissions included, nothing computed;
* communication time: ``step - compute`` (the compute-only run's median step);
* aggregation throughput: dense gradient bytes of one step / communication time — how many bytes
  of gradient the aggregation delivers per second of network time (undefined when communication
  time is not positive, i.e. lost in the noise);
* encode/decode share: the compressor's encode + decode seconds per timed step / ``step``;
* max |param diff|: largest absolute difference of rank 0's final parameters to those of the
  uncompressed run of the same framework (same seed, same batches).

Teardown happens on exit, on an exception and on SIGINT/SIGTERM. Every name carries the prefix
``lhcc`` and the owning process id, so the next run deletes what a killed run left behind.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from typing import Optional, Sequence

from lossless_hc.bench.common import command_line, free_port, machine_info, write_report
from lossless_hc.bench.netns import (HOST_IFACE, ClusterError, EmulatedCluster, require_root, run_on_clusters,
                                    terminate_on_signals)

# BASELINE, LOSSLESS (modes whose result must equal the uncompressed run within the exactness contract); the
# training driver's modes and which framework implements which
from lossless_hc.bench.cluster_report import (BASELINE, LOSSLESS, add_relative, merge_rounds, plot,  # noqa: E402
                                              rate_label, render_markdown, summarize)
from lossless_hc.bench.workloads.train import COMPRESSIONS, SPARSE_MODES, SUPPORTED  # noqa: E402
FRAMEWORKS = ("horovod", "ddp", "fsdp")
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# -- parsing ---------------------------------------------------------------------------------------
_RATE_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9}
_TIME_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6}


def parse_rate(text: str) -> int:
    """'1gbit', '10gbit', '500mbit', '1e9' -> bits per second (tc's decimal units)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([kmg]?)(?:bit)?\s*", text.lower())
    if not m:
        raise ValueError(f"bandwidth {text!r}: expected e.g. 1gbit, 10gbit, 500mbit")
    bits = float(m.group(1)) * _RATE_UNITS[m.group(2)]
    if bits < 8_000:
        raise ValueError(f"bandwidth {text!r}: below 8 kbit/s")
    return int(bits)


def parse_delay(text: str) -> float:
    """'100us', '1ms', '0' -> seconds (one-way delay)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*(s|ms|us)?\s*", text.lower())
    if not m:
        raise ValueError(f"latency {text!r}: expected e.g. 100us, 1ms")
    return float(m.group(1)) * _TIME_UNITS[m.group(2) or "s"]


def parse_list(text: str, allowed: Sequence[str], what: str) -> list:
    vals = [v.strip() for v in text.split(",") if v.strip()]
    bad = [v for v in vals if v not in allowed]
    if not vals or bad:
        raise ValueError(f"{what}: unknown {bad or text!r}; choose from {', '.join(allowed)}")
    return vals


def check_run_limits(timeout_s: float, cores: Optional[int]) -> None:
    """ValueError unless ``timeout_s`` (seconds per configuration) is a positive finite number and
    ``cores`` (--cpu-fair's, None: this machine's) at least 1: checked before any namespace is built, as a
    timeout of 0 or less would fail the first configuration only after the cluster is up."""
    if not (timeout_s > 0 and math.isfinite(timeout_s)):   # NaN fails `> 0`
        raise ValueError(f"--timeout must be a positive number of seconds, got {timeout_s}")
    if cores is not None and cores < 1:
        raise ValueError(f"--cores must be at least 1, got {cores}")


# -- CPU-fair time dilation ------------------------------------------------------------------------
def cpu_fair_scaling(workers: int, cores: int) -> dict:
    """Time dilation that makes ``workers`` processes sharing ``cores`` cores behave like a cluster
    with one core per worker.

    Each worker runs one intra-op thread. With ``workers <= cores`` every worker has a core of its
    own (``share`` = 1): nothing changes. With more workers than cores each gets ``share`` =
    cores / workers of a core, so its compute takes 1/share times as long as on its own core; the
    network is slowed by the same factor -- link rate x share, one-way delay / share -- so that
    compute and communication keep the ratio they would have with one core per host. Times
    measured under dilation are this machine's seconds: compare them as ratios within one run."""
    if workers < 1 or cores < 1:
        raise ValueError(f"cpu_fair_scaling needs workers >= 1 and cores >= 1, got {workers}, {cores}")
    share = min(1.0, cores / workers)
    return {"workers": workers, "cores": cores, "threads_per_worker": 1, "share": share,
            "rate_factor": share, "delay_factor": 1.0 / share}


def apply_cpu_fair(workers: int, cores: Optional[int], rate_bits: int, delay_s: float) -> tuple:
    """(rate, delay, scaling) with :func:`cpu_fair_scaling` of ``workers`` on ``cores`` (default:
    this machine's) applied; ``scaling`` also records the applied rate and delay. The workers must
    run with ``--threads 1``."""
    fair = cpu_fair_scaling(workers, cores or os.cpu_count() or 1)
    rate_bits = max(8_000, int(round(rate_bits * fair["rate_factor"])))
    delay_s = delay_s * fair["delay_factor"]
    fair.update(applied_rate_bits=rate_bits, applied_delay_s=delay_s)
    return rate_bits, delay_s, fair


def max_param_diff(path_a: str, path_b: str) -> float:
    """Largest absolute difference between two saved state dicts (same keys and shapes)."""
    import torch

    a, b = torch.load(path_a), torch.load(path_b)
    if a.keys() != b.keys():
        raise ValueError(f"{path_a} and {path_b} hold different parameters")
    return max(float((a[k].float() - b[k].float()).abs().max()) if a[k].numel() else 0.0 for k in a)


# -- one configuration -----------------------------------------------------------------------------
@dataclasses.dataclass
class RunSpec:
    model: str
    steps: int
    warmup: int
    train_args: list
    module: str = "lossless_hc.bench.workloads.train"  # the worker's entry point (python -m)


def _stop(procs: Sequence[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGTERM)
    deadline = time.monotonic() + 5
    for p in procs:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def run_workers(cluster: EmulatedCluster, framework: str, compression: str, spec: RunSpec, workdir: str,
                timeout_s: float, save_params: Optional[str] = None, per_host: int = 1,
                label: Optional[str] = None) -> list:
    """Runs one configuration, ``per_host`` worker processes on every host (rank = host x
    per_host + local rank; FSDP's shard group is a host's processes, whose traffic stays inside the
    host's namespace, unshaped); returns the per-rank reports (raises ClusterError with the failing
    rank's log tail when a worker fails or the timeout passes). Reports and logs are named after
    ``label`` (default ``framework-compression``)."""
    if per_host != 1 and framework not in ("fsdp", "local"):
        raise ValueError(f"{framework}: one worker per host (per_host={per_host} is for fsdp)")
    n = cluster.hosts * per_host
    base_env = dict(os.environ)
    base_env["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO_ROOT, base_env.get("PYTHONPATH")]))
    base_env["PYTHONUNBUFFERED"] = "1"
    envs, server = [], None
    if framework == "horovod":
        from horovod.runner.common.util.hosts import SlotInfo
        from horovod.runner.http.http_server import RendezvousServer

        # What horovodrun's launch_gloo does, without ssh: the rendezvous server in the root
        # namespace (it listens on all addresses, hence on the bridge), one slot per host.
        server = RendezvousServer(verbose=0)
        port = server.start()
        slots = [SlotInfo(hostname=f"host{i}", rank=i, local_rank=0, cross_rank=i, size=n, local_size=1,
                          cross_size=n) for i in range(n)]
        server.init(slots)
        for s in slots:
            envs.append({"HOROVOD_GLOO_RENDEZVOUS_ADDR": cluster.bridge_address,
                         "HOROVOD_GLOO_RENDEZVOUS_PORT": str(port), "HOROVOD_CONTROLLER": "gloo",
                         "HOROVOD_CPU_OPERATIONS": "gloo", "HOROVOD_GLOO_IFACE": HOST_IFACE,
                         "HOROVOD_HOSTNAME": s.hostname, "HOROVOD_RANK": str(s.rank), "HOROVOD_SIZE": str(n),
                         "HOROVOD_LOCAL_RANK": "0", "HOROVOD_LOCAL_SIZE": "1",
                         "HOROVOD_CROSS_RANK": str(s.rank), "HOROVOD_CROSS_SIZE": str(n)})
    elif framework in ("ddp", "fsdp"):
        port = free_port()  # host 0's namespace has all ports free; any number will do
        for i in range(n):
            envs.append({"MASTER_ADDR": cluster.host_address(0), "MASTER_PORT": str(port), "RANK": str(i),
                         "WORLD_SIZE": str(n), "LOCAL_RANK": str(i % per_host),
                         "LOCAL_WORLD_SIZE": str(per_host), "GLOO_SOCKET_IFNAME": HOST_IFACE})
    elif framework == "local":
        envs = [{"RANK": str(i), "WORLD_SIZE": str(n)} for i in range(n)]
    else:
        raise ValueError(f"unknown framework {framework!r}")

    name = label or f"{framework}-{compression}"
    report = os.path.join(workdir, f"{name}.rank{{rank}}.json")
    argv = [sys.executable, "-m", spec.module, "--model", spec.model, "--framework", framework,
            "--compression", compression, "--steps", str(spec.steps), "--warmup", str(spec.warmup),
            "--net-iface", HOST_IFACE, "--log-every", str(spec.steps), "--json", report, *spec.train_args]
    if save_params:
        argv += ["--save-params", save_params]
    procs, logs = [], []
    try:
        for i in range(n):
            log = open(os.path.join(workdir, f"{name}.rank{i}.log"), "w")
            logs.append(log)
            procs.append(cluster.popen(i // per_host, argv, {**base_env, **envs[i]}, log))
        deadline = time.monotonic() + timeout_s
        while any(p.poll() is None for p in procs):
            failed = [i for i, p in enumerate(procs) if p.poll() not in (None, 0)]
            if failed or time.monotonic() > deadline:
                i = failed[0] if failed else 0
                why = f"rank {i} exited with {procs[i].returncode}" if failed else f"timeout after {timeout_s:.0f} s"
                raise ClusterError(f"{name}: {why}; log tail:\n{_tail(logs[i].name)}")
            time.sleep(0.2)
        for i, p in enumerate(procs):
            if p.returncode != 0:
                raise ClusterError(f"{name}: rank {i} exited with {p.returncode}; log tail:\n{_tail(logs[i].name)}")
    finally:
        _stop(procs)
        for log in logs:
            log.close()
        if server is not None:
            server.stop()
    out = []
    for i in range(n):
        with open(report.format(rank=i)) as f:
            out.append(json.load(f))
    return out


def _tail(path: str, lines: int = 25) -> str:
    with open(path, errors="replace") as f:
        return "".join(f.readlines()[-lines:])


# -- the benchmark ---------------------------------------------------------------------------------
class Progress:
    """A one-line text progress bar on stderr."""

    def __init__(self, total: int, stream=sys.stderr, width: int = 30):
        self.total, self.done, self.stream, self.width, self.t0 = total, 0, stream, width, time.monotonic()

    def show(self, label: str) -> None:
        filled = self.width * self.done // max(1, self.total)
        elapsed = time.monotonic() - self.t0
        self.stream.write(f"\r[{'#' * filled}{'.' * (self.width - filled)}] {self.done}/{self.total} "
                          f"{elapsed:5.0f} s  {label:<32.32}")
        self.stream.flush()

    def advance(self, label: str) -> None:
        self.done += 1
        self.show(label)
        if self.done == self.total:
            self.stream.write("\n")


def plan(frameworks: Sequence[str], compressions: Sequence[str]) -> tuple:
    """((framework, compression) pairs to run, pairs skipped because that framework does not
    implement the mode: e.g. bf16 and powersgd are DDP hooks). The uncompressed run comes first in
    each framework: the other runs' parameters are compared with it. (DDP needs no exception for
    "sparse": Gloo allreduces sparse gradients by allgather, the counterpart of Horovod's sparse
    path.)"""
    comps = [BASELINE] + [c for c in compressions if c != BASELINE]
    pairs = [(fw, c) for fw in frameworks for c in comps]
    return [p for p in pairs if p[1] in SUPPORTED[p[0]]], [p for p in pairs if p[1] not in SUPPORTED[p[0]]]


def fsdp_args(shards: int, flat: bool) -> list:
    """The driver's mesh options of an fsdp run: ``shards`` ranks per replica (HSDP: one replica per
    host), or with ``flat`` none (one shard group of every rank: plain FSDP, the reduce-scatter across
    the hosts)."""
    return [] if flat else ["--shards", str(shards)]


def driver_env(framework: str, world: int) -> dict:
    """The launcher variables :func:`run_workers` gives a ``framework`` worker of ``world`` ranks, as the
    driver's parse_args reads them (which launcher, the world size); values that parsing ignores are
    placeholders."""
    if framework == "horovod":
        return {"HOROVOD_RANK": "0", "HOROVOD_SIZE": str(world)}
    if framework in ("ddp", "fsdp"):
        return {"RANK": "0", "WORLD_SIZE": str(world), "MASTER_ADDR": "-", "MASTER_PORT": "0"}
    return {}


def refusals(model: str, runs: Sequence[tuple], steps: int, warmup: int, train_args: Sequence[str],
             shards: int = 2, hosts: int = 2, fsdp_flat: bool = False) -> dict:
    """{(framework, compression): reason} for the pairs of ``runs`` whose command line the training driver
    refuses (:func:`lossless_hc.bench.workloads.train.parse_args`, the reason its one-line error): e.g.
    ``sparse`` with --model lstm or bert, whose Adam takes no sparse gradients. Every worker would print
    that reason and exit at start-up, ending the whole benchmark; the pair is not run and is reported.
    ``hosts`` x (fsdp: ``shards``) workers, as :func:`run_benchmark` runs them (with ``fsdp_flat``: in one
    shard group, which thc refuses). Parses only: no process, no network namespace."""
    from lossless_hc.bench.workloads.options import refusal
    from lossless_hc.bench.workloads.train import parse_args

    def parse(fw):
        env = driver_env(fw, hosts * (shards if fw == "fsdp" else 1))
        return lambda argv: parse_args(argv, env=env)
    why = {(fw, comp): refusal(parse(fw), ["--model", model, "--framework", fw, "--compression", comp,
                                           "--steps", str(steps), "--warmup", str(warmup), *train_args,
                                           *(fsdp_args(shards, fsdp_flat) if fw == "fsdp" else [])])
           for fw, comp in runs}
    return {pair: reason for pair, reason in why.items() if reason is not None}


def runnable(runs: Sequence[tuple], refused: dict) -> list:
    """The pairs of ``runs`` that :func:`refusals` did not refuse; ValueError when there are none."""
    kept = [p for p in runs if p not in refused]
    if not kept:
        raise ValueError("the training driver refuses every configuration: "
                         + "; ".join(f"{fw} {c}: {why}" for (fw, c), why in refused.items()))
    return kept


def compute_label(per_host: int, sparse: bool) -> str:
    """Key of a compute-only reference: workers per host, and whether embedding gradients are sparse."""
    return f"{per_host} worker{'s' if per_host > 1 else ''}/host{', sparse embeddings' if sparse else ''}"


def run_benchmark(hosts: int, rate_bits: int, delay_s: float, model: str, frameworks: Sequence[str],
                  compressions: Sequence[str], steps: int, warmup: int, train_args: Sequence[str],
                  timeout_s: float, workdir: str, progress: Optional[Progress] = None, cpu_fair: bool = False,
                  shards: int = 2, cores: Optional[int] = None, rounds: int = 1, fsdp_flat: bool = False) -> dict:
    """Builds the cluster, runs the compute-only reference and every configuration, tears down.

    ``fsdp`` runs ``shards`` processes per host (HSDP: ``hosts`` replicas x ``shards`` shards; the
    replica all-reduce crosses the shaped links, the shard group's traffic stays in the host), or with
    ``fsdp_flat`` one shard group of every rank (plain FSDP: the reduce-scatter crosses the links).
    ``cpu_fair``: links dilated by :func:`cpu_fair_scaling` for this machine's ``cores`` (default:
    all) and one thread per worker. ``rounds``: the references and configurations run that many times,
    in the listed order and then reversed, alternately (so a slow drift of the machine weighs on every
    mode alike), and each row pools every round's timed steps (:func:`merge_rounds`); parameters are
    compared on the first round's. Returns {"rows": [...], "compute_s": {workers per host: s},
    "shaping": {...}, "cpu_fair": {...} or None, "skipped": [[framework, compression], ...] (not implemented),
    "refused": [[framework, compression, reason], ...] (:func:`refusals`: not run), "rounds"}. ValueError when
    the driver refuses every configuration."""
    if rounds < 1:
        raise ValueError(f"--rounds must be at least 1, got {rounds}")
    runs, skipped = plan(frameworks, compressions)
    refused = refusals(model, runs, steps, warmup, train_args, shards, hosts, fsdp_flat)
    runs = runnable(runs, refused)
    per_host = {fw: shards if fw == "fsdp" else 1 for fw in frameworks}
    layouts = sorted(set(per_host.values()))
    train_args = list(train_args)
    fair = None
    if cpu_fair:
        if len(layouts) > 1:
            raise ValueError("--cpu-fair: fsdp runs a different number of workers per host than "
                             f"{', '.join(f for f in frameworks if f != 'fsdp')}; run it separately")
        rate_bits, delay_s, fair = apply_cpu_fair(hosts * layouts[0], cores, rate_bits, delay_s)
        train_args += ["--threads", "1"]
    spec = RunSpec(model, steps, warmup, train_args)
    # compute-only references: per workers-per-host layout, and with sparse embedding gradients
    # when a sparse mode runs (sparse, auto-sparse: their backward and optimizer step skip the
    # untouched rows)
    refs = [(ppn, sparse) for ppn in layouts for sparse in (False, True)
            if not sparse or any(c in SPARSE_MODES and per_host[f] == ppn for f, c in runs)]
    progress = progress or Progress(rounds * (len(runs) + len(refs)))
    ref_reports: dict = {r: [] for r in refs}
    reports: dict = {p: [] for p in runs}
    params = {}
    with terminate_on_signals(), EmulatedCluster(hosts, rate_bits, delay_s) as cluster:
        for rnd in range(rounds):
            tag = f" (round {rnd + 1}/{rounds})" if rounds > 1 else ""
            for ppn, sparse in (refs if rnd % 2 == 0 else refs[::-1]):
                label = compute_label(ppn, sparse)
                progress.show(f"compute-only reference {label}{tag}")
                ref_reports[(ppn, sparse)].append(run_workers(cluster, "local", "sparse" if sparse else BASELINE,
                                                              spec, workdir, timeout_s, per_host=ppn))
                progress.advance(f"compute-only reference {label}{tag}")
            for fw, comp in (runs if rnd % 2 == 0 else runs[::-1]):
                progress.show(f"{fw} {comp}{tag}")
                path = os.path.join(workdir, f"{fw}-{comp}.params.pt") if rnd == 0 else None
                fw_spec = dataclasses.replace(spec, train_args=spec.train_args + (
                    fsdp_args(shards, fsdp_flat) if fw == "fsdp" else []))
                reports[(fw, comp)].append(run_workers(cluster, fw, comp, fw_spec, workdir, timeout_s,
                                                       save_params=path, per_host=per_host[fw]))
                if path:
                    params[(fw, comp)] = path
                progress.advance(f"{fw} {comp}{tag}")
        shaping = {"qdisc": cluster.qdisc, "latency_applied": cluster.latency_applied,
                   "rate_bits": rate_bits, "delay_s": delay_s}
    compute = {compute_label(ppn, sparse): statistics.median(merge_rounds(reps)[0]["step_seconds"])
               for (ppn, sparse), reps in ref_reports.items()}
    rows = []
    for fw, comp in runs:
        reps = reports[(fw, comp)]
        medians = [statistics.median(r[0]["step_seconds"]) for r in reps] if rounds > 1 else None
        row = summarize(fw, comp, merge_rounds(reps), compute[compute_label(per_host[fw], comp in SPARSE_MODES)],
                        hosts=hosts, round_medians=medians)
        base = params.get((fw, BASELINE))
        row["max_param_diff_vs_none"] = (max_param_diff(params[(fw, comp)], base)
                                         if base and comp != BASELINE else None)
        row["lossless_mode"] = comp in LOSSLESS
        if rounds > 1:   # each round's guard (the row's plans and guard are the last round's)
            row["auto_guard_rounds"] = [(r[0].get("stats") or {}).get("guard") for r in reps]
        rows.append(row)
    return {"rows": add_relative(rows), "compute_s": compute, "shaping": shaping, "cpu_fair": fair,
            "skipped": [list(p) for p in skipped], "refused": [[fw, c, why] for (fw, c), why in refused.items()],
            "rounds": rounds}


def worker_args(args) -> list:
    """The training driver's options this command implies: --train-args, then --skew and --replay."""
    extra = args.train_args.split() if args.train_args else []
    if args.skew:
        extra += ["--skew", str(args.skew)]
    if args.replay:
        extra += ["--replay-dir", os.path.abspath(args.replay)]
    return extra


def settings_line(model: str, train_args: Sequence[str], compressions: Sequence[str],
                  frameworks: Sequence[str] = ("horovod", "ddp")) -> str:
    """The baselines' and our modes' parameters as the workers will use them (the driver's defaults
    unless --train-args overrode them)."""
    from lossless_hc.bench.workloads.train import parse_args

    a = parse_args(["--model", model, "--framework", "local", "--compression", "none", *train_args])
    out = []
    if "powersgd" in compressions:
        out.append(f"powersgd: torch PowerSGDState rank {a.powersgd_rank}, plain allreduce for the first "
                   f"{a.powersgd_start} iterations, error feedback and warm start on")
    if "bf16" in compressions and set(frameworks) - {"fsdp"}:
        out.append("bf16: torch bf16_compress_hook")
    if {"fp16", "bf16"} & set(compressions) and "fsdp" in frameworks:
        out.append("fsdp fp16/bf16: FSDP2's MixedPrecisionPolicy(reduce_dtype=float16/bfloat16), the gradients' "
                   "collectives in half precision (the parameters' all-gather in float32)")
    if {"topk", "topk-allgather"} & set(compressions):
        out.append(f"top-k ratio {a.topk_ratio} with error feedback")
    if "thc" in compressions:
        out.append(f"thc {a.thc_bits} bits")
    if "lossless" in compressions:
        out.append(f"lossless initial capacity {a.max_density} of each tensor")
    if model == "ncf":
        out.append(f"NCF skew {a.skew} ({'uniform ids' if not a.skew else 'Zipf users and negatives'})")
    return "; ".join(out)


def cmd_cluster(args) -> int:
    """``python -m lossless_hc.bench cluster``: builds, runs, tears down, prints and writes."""
    model = "replay" if args.replay else args.model
    try:
        rate = parse_rate(args.bandwidth)
        delay = parse_delay(args.latency)
        frameworks = parse_list(args.framework, FRAMEWORKS, "--framework")
        compressions = parse_list(args.compression, COMPRESSIONS, "--compression")
        if args.hosts < 2:
            raise ValueError(f"--hosts must be at least 2, got {args.hosts}")
        if args.rounds < 1:
            raise ValueError(f"--rounds must be at least 1, got {args.rounds}")
        if not 0 <= args.warmup < args.steps:
            raise ValueError(f"--warmup must be in [0, --steps), got {args.warmup}")
        if args.shards < 1 or args.skew < 0:
            raise ValueError("--shards must be >= 1 and --skew >= 0")
        check_run_limits(args.timeout, args.cores)
        # Now, before root and namespaces: options that the compute-only reference refuses (so every run
        # would), or a refusal of every configuration, end the benchmark; run_benchmark skips the rest.
        for why in refusals(model, [("local", BASELINE)], args.steps, args.warmup, worker_args(args)).values():
            raise ValueError(f"the training driver refuses these options: {why}")
        runs = plan(frameworks, compressions)[0]
        runnable(runs, refusals(model, runs, args.steps, args.warmup, worker_args(args), args.shards, args.hosts,
                                args.fsdp_mesh == "flat"))
        if args.replay:
            from lossless_hc.bench.workloads.replay import load_meta

            recorded = load_meta(args.replay)
            if recorded["ranks"] < args.hosts * (args.shards if "fsdp" in frameworks else 1):
                raise ValueError(f"--replay {args.replay} holds {recorded['ranks']} ranks, fewer than the workers")
        require_root()
    except (ValueError, ClusterError, SystemExit) as exc:  # SystemExit: the replay directory's own message
        print(f"python -m lossless_hc.bench cluster: error: {exc}", file=sys.stderr)
        return 2
    what = f"replay of {recorded['model']}" if args.replay else args.model
    skew = recorded["options"].get("skew") if args.replay else args.skew
    title = (f"{what}{f' (Zipf skew {skew})' if skew else ''}, {args.hosts} hosts, {rate_label(rate)}, "
             f"{args.latency} one-way{', CPU-fair' if args.cpu_fair else ''}")
    if "fsdp" in frameworks:
        title += (f", fsdp: one shard group of {args.hosts * args.shards} ranks" if args.fsdp_mesh == "flat" else
                  f", fsdp: {args.hosts} replicas x {args.shards} shards")
    t0 = time.monotonic()
    train_args = worker_args(args)
    status, result, workdir = run_on_clusters(
        "python -m lossless_hc.bench cluster", "cluster", args.out,
        lambda workdir: run_benchmark(args.hosts, rate, delay, model, frameworks, compressions, args.steps,
                                      args.warmup, train_args, args.timeout, workdir, cpu_fair=args.cpu_fair,
                                      shards=args.shards, cores=args.cores, rounds=args.rounds,
                                      fsdp_flat=args.fsdp_mesh == "flat"))
    if status:
        return status
    if result["cpu_fair"]:
        f = result["cpu_fair"]
        print(f"[cluster] --cpu-fair: {f['workers']} workers on {f['cores']} cores, share {f['share']:.3g}: "
              f"rate x{f['rate_factor']:.3g} -> {rate_label(f['applied_rate_bits'])}, delay x{f['delay_factor']:.3g} "
              f"-> {1e6 * f['applied_delay_s']:.0f} us, 1 thread per worker", file=sys.stderr)
    result.update(command=command_line(), machine=machine_info(0), title=title, bandwidth_bits=rate,
                  latency_s=delay, hosts=args.hosts, model=model, steps=args.steps, warmup=args.warmup,
                  skew=skew, replay=args.replay, settings=settings_line(
                      recorded["model"] if args.replay else model,
                      (["--skew", str(skew)] if skew else []) if args.replay else train_args, compressions,
                      frameworks),
                  wall_s=time.monotonic() - t0)
    md = render_markdown(result, title)
    print(md)
    stem = (f"cluster_{'replay_' if args.replay else ''}{what.split()[-1]}{f'_zipf{skew}' if skew else ''}_"
            f"{rate_label(rate)}_{args.hosts}hosts{'_fsdp' if frameworks == ['fsdp'] else ''}"
            f"{'_flat' if 'fsdp' in frameworks and args.fsdp_mesh == 'flat' else ''}")
    write_report(workdir, stem, result, md)
    args.report_json = os.path.join(workdir, stem + ".json")   # what this run wrote (bench replay reads it)
    plot_path = args.plot or os.path.join(workdir, stem + ".png")
    plot(result, title, plot_path)
    print(f"[cluster] wrote {workdir}/{stem}.md, .json and {plot_path}", file=sys.stderr)
    return 0


def add_arguments(p) -> None:
    p.add_argument("--hosts", type=int, default=4, help="emulated hosts (default 4); fsdp: replicas")
    p.add_argument("--bandwidth", default="1gbit", help="link rate, e.g. 1gbit, 10gbit (both directions)")
    p.add_argument("--latency", default="100us", help="one-way delay added on each host's uplink")
    p.add_argument("--model", default="ncf", choices=("ncf", "lstm", "vgg", "bert", "digits"))
    p.add_argument("--compression", default="none,fp16,bf16,powersgd,sparse,topk-allgather,lossless,topk",
                   help=f"comma-separated, from {', '.join(COMPRESSIONS)} (none always runs: the reference; a "
                        f"mode a framework does not implement, or that the training driver refuses for the model "
                        f"and --train-args, e.g. sparse under lstm's and bert's Adam, is not run and is listed "
                        f"with the reason)")
    p.add_argument("--framework", default="horovod,ddp",
                   help="comma-separated: horovod, ddp, fsdp (HSDP: --hosts replicas x --shards processes per host)")
    p.add_argument("--shards", type=int, default=2, help="fsdp: processes (shards) per host (default 2)")
    p.add_argument("--fsdp-mesh", choices=("hsdp", "flat"), default="hsdp",
                   help="fsdp: hsdp, one replica per host (the replica all-reduce crosses the links, compressed); "
                        "flat, one shard group of every rank (plain FSDP: the reduce-scatter crosses the links, "
                        "compressed by lossless and topk, sent as rows by auto)")
    p.add_argument("--steps", type=int, default=30, help="steps per configuration, warm-up included")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps at the start")
    p.add_argument("--rounds", type=int, default=1,
                   help="run every configuration this many times, in alternating order, and pool the timed steps "
                        "(run-to-run drift of a shared machine weighs on every mode alike)")
    p.add_argument("--skew", type=float, default=0.0, help="ncf: Zipf exponent of user and negative-item ids (0: uniform)")
    p.add_argument("--cpu-fair", action="store_true",
                   help="one thread per worker and links dilated by the workers' share of this machine's cores")
    p.add_argument("--cores", type=int, help="--cpu-fair: cores to assume (default: this machine's)")
    p.add_argument("--replay", metavar="DIR",
                   help="collective-only: replay gradients recorded by `python -m lossless_hc.bench replay` instead "
                        "of training --model")
    p.add_argument("--train-args", default="", help="extra options for lossless_hc.bench.workloads.train, quoted")
    p.add_argument("--timeout", type=float, default=600, help="seconds per configuration")
    p.add_argument("--out", help="directory for the table (Markdown, JSON), the plot and worker logs")
    p.add_argument("--plot", help="PNG path for the plot (default: in --out)")
    p.set_defaults(func=cmd_cluster)
