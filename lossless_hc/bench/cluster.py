"""Emulated cluster benchmark: real workers in network namespaces joined by shaped links.

    sudo .venv/bin/python -m lossless_hc.bench cluster --hosts 4 --bandwidth 1gbit --latency 100us \\
        --model ncf --compression none,fp16,sparse,topk-allgather,lossless,topk --framework horovod,ddp

The topology: one network namespace per "host", each with an interface ``eth0`` that is one end of
a veth pair whose other end is a port of a Linux bridge in the root namespace (a non-blocking
switch). Every link is shaped with netem in both directions: the host's egress (its uplink) gets
the rate and the one-way delay, the bridge port's egress (its downlink) the rate. The bridge itself
has an address in the root namespace, where Horovod's rendezvous server listens.

Per configuration (framework x compression) one real worker process per namespace runs
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
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Callable, Optional, Sequence

from lossless_hc.bench.common import command_line, machine_info

PREFIX = "lhcc"
HOST_IFACE = "eth0"
NETNS_ETC = "/etc/netns"  # per-namespace files that `ip netns exec` mounts over /etc
BASELINE = "none"
COMPRESSIONS = ("none", "fp16", "sparse", "topk-allgather", "lossless", "topk", "thc")
LOSSLESS = ("lossless",)  # modes whose result must equal the uncompressed run up to float rounding
FRAMEWORKS = ("horovod", "ddp")
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class ClusterError(RuntimeError):
    """The emulated cluster could not be built, or a worker failed."""


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


def rate_label(bits: int) -> str:
    for unit, scale in (("gbit", 10**9), ("mbit", 10**6), ("kbit", 10**3)):
        if bits % scale == 0:
            return f"{bits // scale}{unit}"
    return f"{bits}bit"


def parse_list(text: str, allowed: Sequence[str], what: str) -> list:
    vals = [v.strip() for v in text.split(",") if v.strip()]
    bad = [v for v in vals if v not in allowed]
    if not vals or bad:
        raise ValueError(f"{what}: unknown {bad or text!r}; choose from {', '.join(allowed)}")
    return vals


# -- statistics ------------------------------------------------------------------------------------
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


def summarize(framework: str, compression: str, ranks: Sequence[dict], compute_s: Optional[float]) -> dict:
    """One result row from the per-rank JSON reports of :mod:`lossless_hc.bench.workloads.train`."""
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
        "framework": framework, "compression": compression, "hosts": len(ranks), "timed_steps": timed,
        "step_s_median": median, "step_s_p10": percentile(steps, 10), "step_s_p90": percentile(steps, 90),
        "compute_s": compute_s, "dense_bytes_per_step": dense,
        "wire_bytes_per_step_per_host": statistics.fmean(wire) if wire else None,
        "aggregation_bytes_per_s": (aggregation_throughput(dense, median, compute_s)
                                    if compute_s is not None else None),
        "codec_share": codec_s / median if median > 0 else None,
        "fallbacks": stats.get("fallbacks", 0) if stats else 0,
        "final_loss": ranks[0]["final_loss"], "metric": ranks[0]["metric"], "metric_value": ranks[0]["value"],
    }


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


def max_param_diff(path_a: str, path_b: str) -> float:
    """Largest absolute difference between two saved state dicts (same keys and shapes)."""
    import torch

    a, b = torch.load(path_a), torch.load(path_b)
    if a.keys() != b.keys():
        raise ValueError(f"{path_a} and {path_b} hold different parameters")
    return max(float((a[k].float() - b[k].float()).abs().max()) if a[k].numel() else 0.0 for k in a)


# -- leftovers -------------------------------------------------------------------------------------
_NAME = re.compile(rf"^{PREFIX}(\d+)(?:h\d+|v\d+|br)$")


def owner_pid(name: str) -> Optional[int]:
    """The process id embedded in a name this module made, or None for any other name."""
    m = _NAME.match(name)
    return int(m.group(1)) if m else None


def stale_names(names: Sequence[str], alive: Callable[[int], bool]) -> list:
    """Names made by this module whose owning process is no longer alive."""
    return [n for n in names if (pid := owner_pid(n)) is not None and not alive(pid)]


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    res = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and res.returncode != 0:
        raise ClusterError(f"`ip {' '.join(args)}` failed: {res.stderr.strip()}")
    return res


def list_namespaces() -> list:
    return [line.split()[0] for line in _ip("netns", "list").stdout.splitlines() if line.strip()]


def list_links() -> list:
    out = _ip("-o", "link", "show").stdout
    return [m.group(1).split("@")[0] for m in re.finditer(r"^\d+:\s+([^:]+):", out, re.M)]


def remove_leftovers() -> list:
    """Deletes namespaces, bridges and veths of runs whose process is gone; returns their names."""
    gone = stale_names(list_namespaces(), pid_alive)
    for ns in gone:
        _ip("netns", "del", ns, check=False)
    etc = os.listdir(NETNS_ETC) if os.path.isdir(NETNS_ETC) else []
    for ns in stale_names(etc, pid_alive):
        shutil.rmtree(os.path.join(NETNS_ETC, ns), ignore_errors=True)
        gone += [] if ns in gone else [os.path.join(NETNS_ETC, ns)]
    links = stale_names(list_links(), pid_alive)  # veths died with their namespaces; bridges did not
    for link in links:
        _ip("link", "del", link, check=False)
    return gone + links


def require_root() -> None:
    """Raises ClusterError unless this process may create network namespaces and shape links."""
    if os.geteuid() != 0:
        raise ClusterError("the cluster benchmark needs root: it creates network namespaces, veth pairs, "
                           "a bridge and tc qdiscs (run it with sudo, e.g. `sudo .venv/bin/python -m "
                           "lossless_hc.bench cluster ...`)")
    if shutil.which("ip") is None or shutil.which("tc") is None:
        raise ClusterError("the cluster benchmark needs iproute2 (`ip` and `tc`)")


# -- the cluster -----------------------------------------------------------------------------------
class EmulatedCluster:
    """``hosts`` network namespaces on a bridge, links shaped to ``rate_bits`` and ``delay_s``.

    Shaping uses netem (rate and delay); on a kernel built without netem (as on the VM the
    recorded figures come from) it falls back to tbf for the rate and cannot add delay:
    ``latency_applied`` says which, and the benchmark's output repeats it.

    A context manager: entering builds everything (and removes it again if building fails),
    leaving removes it. Host ``i`` has address ``host_address(i)`` on its ``eth0``; the root
    namespace has ``bridge_address`` on the bridge.
    """

    def __init__(self, hosts: int, rate_bits: int, delay_s: float, tag: Optional[int] = None):
        if hosts < 1 or hosts > 200:
            raise ValueError(f"hosts must be in [1, 200], got {hosts}")
        if delay_s < 0:
            raise ValueError(f"latency must not be negative, got {delay_s}")
        self.hosts, self.rate_bits, self.delay_s = hosts, rate_bits, delay_s
        self.tag = os.getpid() if tag is None else tag
        # A per-process /24 so that two concurrent runs (the test suite and a benchmark) do not clash.
        self.subnet = f"10.{200 + self.tag % 50}.{self.tag % 250}"
        self.bridge = f"{PREFIX}{self.tag}br"
        self.namespaces = [f"{PREFIX}{self.tag}h{i}" for i in range(hosts)]
        self.bridge_ports = [f"{PREFIX}{self.tag}v{i}" for i in range(hosts)]
        if len(self.bridge) > 15 or any(len(v) > 15 for v in self.bridge_ports):
            raise ValueError("interface names exceed 15 characters")  # kernel's IFNAMSIZ
        self._built = False
        self.qdisc: Optional[str] = None   # "netem" or "tbf", found out on the first link
        self.latency_applied = True

    @property
    def bridge_address(self) -> str:
        return f"{self.subnet}.254"

    def host_address(self, i: int) -> str:
        return f"{self.subnet}.{i + 1}"

    def _tc(self, namespace: Optional[str], *args: str) -> subprocess.CompletedProcess:
        cmd = ["tc", *(["-n", namespace] if namespace else []), *args]
        return subprocess.run(cmd, capture_output=True, text=True)

    def _shape(self, namespace: Optional[str], dev: str, delay: bool) -> None:
        """Rate (and, on uplinks, the one-way delay) on ``dev``'s egress: netem where the kernel has
        it; otherwise a token bucket (tbf) for the rate and no delay (``latency_applied`` False)."""
        if self.qdisc is None or self.qdisc == "netem":
            # A queue long enough for a bandwidth-delay product plus bursts: netem's default 1000
            # packets would drop (and stall TCP) when a whole gradient bucket is queued.
            args = ["qdisc", "add", "dev", dev, "root", "netem"]
            if delay and self.delay_s > 0:
                args += ["delay", f"{self.delay_s * 1e6:.0f}us"]
            res = self._tc(namespace, *args, "rate", f"{self.rate_bits}bit", "limit", "100000")
            if res.returncode == 0:
                self.qdisc = "netem"
                return
            if self.qdisc == "netem" or "unknown" not in res.stderr:
                raise ClusterError(f"tc netem on {dev}: {res.stderr.strip()}")
            self.qdisc, self.latency_applied = "tbf", self.delay_s == 0
        # Burst: at least a few GSO super-packets (veth passes 64 KiB ones) and ~1 ms at line rate,
        # so that the bucket does not throttle below the rate; queue: 100 ms at the rate.
        burst = max(256 * 1024, self.rate_bits // 8 // 1000)
        res = self._tc(namespace, "qdisc", "add", "dev", dev, "root", "tbf", "rate", f"{self.rate_bits}bit",
                       "burst", str(burst), "latency", "100ms")
        if res.returncode != 0:
            raise ClusterError(f"tc tbf on {dev}: {res.stderr.strip()}")

    def build(self) -> None:
        _ip("link", "add", self.bridge, "type", "bridge")
        self._built = True
        _ip("addr", "add", f"{self.bridge_address}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        for i, (ns, port) in enumerate(zip(self.namespaces, self.bridge_ports)):
            _ip("netns", "add", ns)
            _ip("link", "add", port, "type", "veth", "peer", "name", HOST_IFACE, "netns", ns)
            _ip("link", "set", port, "master", self.bridge)
            _ip("link", "set", port, "up")
            _ip("-n", ns, "addr", "add", f"{self.host_address(i)}/24", "dev", HOST_IFACE)
            _ip("-n", ns, "link", "set", HOST_IFACE, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            # Horovod 0.28.1 creates the Gloo device of its process sets (the global one included)
            # without HOROVOD_GLOO_IFACE, so Gloo advertises what this machine's hostname resolves
            # to (127.0.0.1 from /etc/hosts). `ip netns exec` bind-mounts /etc/netns/<ns>/hosts
            # over /etc/hosts: there the hostname is the host's own address.
            os.makedirs(os.path.join(NETNS_ETC, ns), exist_ok=True)
            with open(os.path.join(NETNS_ETC, ns, "hosts"), "w") as f:
                f.write(f"127.0.0.1 localhost\n{self.host_address(i)} {socket.gethostname()}\n")
            self._shape(ns, HOST_IFACE, delay=True)        # uplink: rate and one-way delay
            self._shape(None, port, delay=False)           # downlink: rate

    def teardown(self) -> None:
        """Removes every namespace and link of this cluster; safe to call twice."""
        for ns in self.namespaces:
            _ip("netns", "del", ns, check=False)  # takes its veth pair with it
            shutil.rmtree(os.path.join(NETNS_ETC, ns), ignore_errors=True)
        _ip("link", "del", self.bridge, check=False)
        self._built = False

    def __enter__(self) -> "EmulatedCluster":
        try:
            self.build()
        except BaseException:
            self.teardown()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.teardown()

    def popen(self, i: int, argv: Sequence[str], env: dict, log) -> subprocess.Popen:
        """Starts ``argv`` inside host ``i``'s namespace (its own process group, for cleanup)."""
        return subprocess.Popen(["ip", "netns", "exec", self.namespaces[i], *argv], env=env,
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


@contextlib.contextmanager
def terminate_on_signals():
    """SIGTERM (and SIGHUP) raise SystemExit like SIGINT raises KeyboardInterrupt, so that the
    ``with`` blocks above tear the cluster down however the run is stopped."""
    def handler(signum, frame):
        raise SystemExit(128 + signum)
    old = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


# -- one configuration -----------------------------------------------------------------------------
@dataclasses.dataclass
class RunSpec:
    model: str
    steps: int
    warmup: int
    train_args: list


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


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
                timeout_s: float, save_params: Optional[str] = None) -> list:
    """Runs one configuration on every host; returns the per-rank reports (raises ClusterError
    with the failing rank's log tail when a worker fails or the timeout passes)."""
    n = cluster.hosts
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
    elif framework == "ddp":
        port = _free_port()  # host 0's namespace has all ports free; any number will do
        for i in range(n):
            envs.append({"MASTER_ADDR": cluster.host_address(0), "MASTER_PORT": str(port), "RANK": str(i),
                         "WORLD_SIZE": str(n), "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                         "GLOO_SOCKET_IFNAME": HOST_IFACE})
    elif framework == "local":
        envs = [{"RANK": str(i), "WORLD_SIZE": str(n)} for i in range(n)]
    else:
        raise ValueError(f"unknown framework {framework!r}")

    name = f"{framework}-{compression}"
    report = os.path.join(workdir, f"{name}.rank{{rank}}.json")
    argv = [sys.executable, "-m", "lossless_hc.bench.workloads.train", "--model", spec.model, "--framework", framework,
            "--compression", compression, "--steps", str(spec.steps), "--warmup", str(spec.warmup),
            "--net-iface", HOST_IFACE, "--log-every", str(spec.steps), "--json", report, *spec.train_args]
    if save_params:
        argv += ["--save-params", save_params]
    procs, logs = [], []
    try:
        for i in range(n):
            log = open(os.path.join(workdir, f"{name}.rank{i}.log"), "w")
            logs.append(log)
            procs.append(cluster.popen(i, argv, {**base_env, **envs[i]}, log))
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


def plan(frameworks: Sequence[str], compressions: Sequence[str]) -> list:
    """(framework, compression) pairs to run. The uncompressed run comes first in each framework:
    the other runs' parameters are compared with it. (DDP needs no exception for "sparse": Gloo
    allreduces sparse gradients by allgather, the counterpart of Horovod's sparse path.)"""
    comps = [BASELINE] + [c for c in compressions if c != BASELINE]
    return [(fw, c) for fw in frameworks for c in comps]


def run_benchmark(hosts: int, rate_bits: int, delay_s: float, model: str, frameworks: Sequence[str],
                  compressions: Sequence[str], steps: int, warmup: int, train_args: Sequence[str],
                  timeout_s: float, workdir: str, progress: Optional[Progress] = None) -> dict:
    """Builds the cluster, runs the compute-only reference and every configuration, tears down.
    Returns {"rows": [...], "compute_s": ..., "shaping": {"qdisc": ..., "latency_applied": ...}}."""
    spec = RunSpec(model, steps, warmup, list(train_args))
    runs = plan(frameworks, compressions)
    progress = progress or Progress(len(runs) + 1)
    rows = []
    with terminate_on_signals(), EmulatedCluster(hosts, rate_bits, delay_s) as cluster:
        progress.show("compute-only reference")
        ref = run_workers(cluster, "local", BASELINE, spec, workdir, timeout_s)
        compute_s = statistics.median(ref[0]["step_seconds"])
        progress.advance("compute-only reference")
        params = {}
        for fw, comp in runs:
            progress.show(f"{fw} {comp}")
            path = os.path.join(workdir, f"{fw}-{comp}.params.pt")
            reports = run_workers(cluster, fw, comp, spec, workdir, timeout_s, save_params=path)
            params[(fw, comp)] = path
            row = summarize(fw, comp, reports, compute_s)
            base = params.get((fw, BASELINE))
            row["max_param_diff_vs_none"] = max_param_diff(path, base) if base and comp != BASELINE else None
            row["lossless_mode"] = comp in LOSSLESS
            rows.append(row)
            progress.advance(f"{fw} {comp}")
        shaping = {"qdisc": cluster.qdisc, "latency_applied": cluster.latency_applied}
    return {"rows": add_relative(rows), "compute_s": compute_s, "shaping": shaping}


# -- output ----------------------------------------------------------------------------------------
def _f(v, fmt: str, none: str = "-") -> str:
    return none if v is None else format(v, fmt)


def render_markdown(result: dict, title: str) -> str:
    sh = result.get("shaping", {})
    note = ("" if sh.get("latency_applied", True) else
            " The kernel has no netem: links are rate-limited by tbf and the requested latency was NOT added.")
    lines = [f"### {title}", "",
             f"Shaping: {sh.get('qdisc', '?')} on every host's uplink and downlink.{note}",
             f"Compute-only step (same workers, no aggregation): {1e3 * result['compute_s']:.1f} ms.", "",
             "| framework | compression | step ms median (p10–p90) | speed-up vs none | wire MiB/step/host "
             "| wire vs none | aggregation GB/s | x none | enc+dec share | max abs param diff vs none | fallbacks |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        wire = r["wire_bytes_per_step_per_host"]
        diff = r["max_param_diff_vs_none"]
        lines.append(
            f"| {r['framework']} | {r['compression']} | {1e3 * r['step_s_median']:.1f} "
            f"({1e3 * r['step_s_p10']:.1f}–{1e3 * r['step_s_p90']:.1f}) | {_f(r['speedup_vs_none'], '.2f')}x "
            f"| {_f(wire and wire / 2**20, '.2f')} | {_f(r['wire_vs_none'], '.3f')} "
            f"| {_f(r['aggregation_bytes_per_s'] and r['aggregation_bytes_per_s'] / 1e9, '.3f')} "
            f"| {_f(r['throughput_vs_none'], '.2f')} | {_f(r['codec_share'] and 100 * r['codec_share'], '.1f')}% "
            f"| {_f(diff, '.2e')}{' (lossless)' if r['lossless_mode'] and diff is not None else ''} "
            f"| {r['fallbacks']} |")
    return "\n".join(lines) + "\n"


def plot(result: dict, title: str, path: str) -> None:
    """Two panels: median step time (p10–p90 whiskers) and wire bytes per configuration."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    labels = [f"{r['framework']}\n{r['compression']}" for r in rows]
    colors = ["#4c72b0" if r["framework"] == "horovod" else "#dd8452" for r in rows]
    x = range(len(rows))
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(max(6, 0.9 * len(rows)), 7), sharex=True)
    med = [1e3 * r["step_s_median"] for r in rows]
    err = [[m - 1e3 * r["step_s_p10"] for m, r in zip(med, rows)], [1e3 * r["step_s_p90"] - m for m, r in zip(med, rows)]]
    ax1.bar(x, med, yerr=err, color=colors, capsize=3)
    ax1.axhline(1e3 * result["compute_s"], color="gray", ls="--", lw=1, label="compute only")
    ax1.set_ylabel("step time, ms (median, p10–p90)")
    ax1.legend(loc="upper right")
    ax1.set_title(title)
    ax2.bar(x, [(r["wire_bytes_per_step_per_host"] or 0) / 2**20 for r in rows], color=colors)
    ax2.set_ylabel("wire MiB / step / host")
    ax2.set_xticks(list(x), labels, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def cmd_cluster(args) -> int:
    """``python -m lossless_hc.bench cluster``: builds, runs, tears down, prints and writes."""
    try:
        rate = parse_rate(args.bandwidth)
        delay = parse_delay(args.latency)
        frameworks = parse_list(args.framework, FRAMEWORKS, "--framework")
        compressions = parse_list(args.compression, COMPRESSIONS, "--compression")
        if args.hosts < 2:
            raise ValueError(f"--hosts must be at least 2, got {args.hosts}")
        if not 0 <= args.warmup < args.steps:
            raise ValueError(f"--warmup must be in [0, --steps), got {args.warmup}")
        require_root()
    except (ValueError, ClusterError) as exc:
        print(f"python -m lossless_hc.bench cluster: error: {exc}", file=sys.stderr)
        return 2
    removed = remove_leftovers()
    if removed:
        print(f"[cluster] removed leftovers of an earlier run: {', '.join(removed)}", file=sys.stderr)
    title = f"{args.model}, {args.hosts} hosts, {rate_label(rate)}, {args.latency} one-way"
    workdir = args.out or tempfile.mkdtemp(prefix="lhc-cluster-")
    os.makedirs(workdir, exist_ok=True)
    t0 = time.monotonic()
    try:
        result = run_benchmark(args.hosts, rate, delay, args.model, frameworks, compressions, args.steps,
                               args.warmup, args.train_args.split() if args.train_args else [],
                               args.timeout, workdir)
    except ClusterError as exc:
        print(f"\npython -m lossless_hc.bench cluster: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\ninterrupted; the emulated cluster was removed", file=sys.stderr)
        return 130
    result.update(command=command_line(), machine=machine_info(0), title=title, bandwidth_bits=rate,
                  latency_s=delay, hosts=args.hosts, model=args.model, steps=args.steps, warmup=args.warmup,
                  wall_s=time.monotonic() - t0)
    md = render_markdown(result, title)
    print(md)
    stem = f"cluster_{args.model}_{rate_label(rate)}_{args.hosts}hosts"
    with open(os.path.join(workdir, stem + ".md"), "w") as f:
        f.write(f"`{result['command']}`\n\n{md}")
    with open(os.path.join(workdir, stem + ".json"), "w") as f:
        json.dump(result, f, indent=2, default=str)
    plot_path = args.plot or os.path.join(workdir, stem + ".png")
    plot(result, title, plot_path)
    print(f"[cluster] wrote {workdir}/{stem}.md, .json and {plot_path}", file=sys.stderr)
    return 0


def add_arguments(p) -> None:
    p.add_argument("--hosts", type=int, default=4, help="emulated hosts, one worker each (default 4)")
    p.add_argument("--bandwidth", default="1gbit", help="link rate, e.g. 1gbit, 10gbit (both directions)")
    p.add_argument("--latency", default="100us", help="one-way delay added on each host's uplink")
    p.add_argument("--model", default="ncf", choices=("ncf", "lstm", "vgg", "bert", "digits"))
    p.add_argument("--compression", default="none,fp16,sparse,topk-allgather,lossless,topk",
                   help=f"comma-separated, from {', '.join(COMPRESSIONS)} (none always runs: the reference)")
    p.add_argument("--framework", default="horovod,ddp", help="comma-separated: horovod, ddp")
    p.add_argument("--steps", type=int, default=30, help="steps per configuration, warm-up included")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps at the start")
    p.add_argument("--train-args", default="", help="extra options for lossless_hc.bench.workloads.train, quoted")
    p.add_argument("--timeout", type=float, default=600, help="seconds per configuration")
    p.add_argument("--out", help="directory for the table (Markdown, JSON), the plot and worker logs")
    p.add_argument("--plot", help="PNG path for the plot (default: in --out)")
    p.set_defaults(func=cmd_cluster)
