"""The emulated cluster's hosts: one network namespace per host behind a bridge, each link shaped
(rate, delay) with ``tc``, torn down on exit, on an exception and on SIGINT/SIGTERM. Every name
carries the prefix ``lhcc`` and the owning process id, so the next run deletes what a killed run
left behind. Needs root (``ip netns``)."""
from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from typing import Callable, Optional, Sequence

PREFIX = "lhcc"
HOST_IFACE = "eth0"
NETNS_ETC = "/etc/netns"  # per-namespace files that `ip netns exec` mounts over /etc


class ClusterError(RuntimeError):
    """The emulated cluster could not be built, or a worker failed."""


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


def run_on_clusters(prog: str, tag: str, out: Optional[str], run: Callable[[str], dict]):
    """The frame of a command that runs on emulated clusters (``bench cluster``, ``bench tta``), after
    its options were checked: removes an earlier run's leftovers, makes the work directory (``out``,
    or a fresh temporary one) and calls ``run(workdir)``. Returns ``(status, result, workdir)``:
    status 0 with run's result, or the command's exit status with the error printed -- 2 for a
    ValueError (an option found wrong only now), 1 for a ClusterError, 130 for an interrupt (the
    cluster is removed on the way out: EmulatedCluster's exit)."""
    removed = remove_leftovers()
    if removed:
        print(f"[{tag}] removed leftovers of an earlier run: {', '.join(removed)}", file=sys.stderr)
    workdir = out or tempfile.mkdtemp(prefix=f"lhc-{tag}-")
    os.makedirs(workdir, exist_ok=True)
    try:
        return 0, run(workdir), workdir
    except ValueError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2, None, workdir
    except ClusterError as exc:
        print(f"\n{prog}: error: {exc}", file=sys.stderr)
        return 1, None, workdir
    except KeyboardInterrupt:
        print("\ninterrupted; the emulated cluster was removed", file=sys.stderr)
        return 130, None, workdir


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
