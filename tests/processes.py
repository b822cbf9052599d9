"""Launched processes and the test session's hang watchdog.

A multi-process test runs a launcher (``torch.multiprocessing.spawn``, ``horovodrun``,
``launch_byteps.sh``, ``bench cluster``) that starts the ranks. ``subprocess.run(timeout=...)`` SIGKILLs
only the launcher: what a launch script started in the background (a BytePS scheduler and server)
outlives it, keeping its ports and the cores that every later test shares, and ``bench cluster`` gets
no chance to remove its network namespaces. :func:`run_launcher` starts the launcher in a session of
its own and ends that whole process group when the launch returns, times out or is interrupted.

:data:`WATCHDOG` (armed for each test by tests/conftest.py) ends the session when a test runs past its
time, so that a hang fails loudly instead of blocking CI: ``faulthandler`` dumps every thread's stack
to the session's stderr and exits, from a thread of its own that needs no GIL. A launch extends the
time to its own timeout plus :data:`LAUNCH_MARGIN`, so that the launch's timeout comes first and
fails just that test, with the launcher's output, and the session goes on.
"""
from __future__ import annotations

import faulthandler
import os
import signal
import subprocess
import time
from typing import Optional

import pytest

LAUNCH_MARGIN = 30   # seconds after a launch's end for the test to collect its output and fail
TERM_GRACE = 10      # seconds between SIGTERM and SIGKILL to a launch past its timeout


def signal_group(pgid: int, sig: int = signal.SIGKILL) -> None:
    """Send ``sig`` to every process of the group ``pgid`` (a group that is gone already is not an error)."""
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def run_launcher(args, *, timeout: float, **popen_kwargs) -> subprocess.CompletedProcess:
    """``subprocess.run(args, capture_output=True, text=True, timeout=timeout, **popen_kwargs)`` for a
    command that starts processes of its own: run in a new session, whose every process is killed when
    the launcher returns (a rank it did not reap), runs past ``timeout`` seconds (SIGTERM first, so that
    ``bench cluster`` removes its namespaces, then SIGKILL after :data:`TERM_GRACE` s; the test then
    fails with the tail of both outputs) or the test is interrupted. The result also holds the
    launcher's ``pid``."""
    if WATCHDOG is not None:
        WATCHDOG.extend(timeout + TERM_GRACE + LAUNCH_MARGIN)
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            **popen_kwargs)
    try:   # in a session of its own the launcher leads its own process group: its id is the launcher's pid
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        signal_group(proc.pid, signal.SIGTERM)
        try:
            out, err = proc.communicate(timeout=TERM_GRACE)
        except subprocess.TimeoutExpired:
            signal_group(proc.pid)
            out, err = proc.communicate()
        cmd = " ".join(map(str, args)) if isinstance(args, (list, tuple)) else str(args)
        pytest.fail(f"{cmd} ran past its {timeout} s; its process group was ended\n"
                    f"--- stdout ---\n{out[-4000:]}\n--- stderr ---\n{err[-4000:]}")
    finally:
        signal_group(proc.pid)
        proc.wait()
    done = subprocess.CompletedProcess(args, proc.returncode, out, err)
    done.pid = proc.pid
    return done


class Watchdog:
    """The session's deadline: ``faulthandler.dump_traceback_later`` re-armed as it moves."""

    def __init__(self, fd: int, seconds: float):
        self.fd, self.seconds = fd, seconds
        self.deadline: Optional[float] = None

    def arm(self) -> None:
        """A test starts: it has ``seconds`` from now."""
        self._set(self.seconds)

    def extend(self, seconds: float) -> None:
        """Let the running test (or a fixture between tests) run at least ``seconds`` more."""
        left = self.deadline - time.monotonic() if self.deadline is not None else 0.0
        self._set(max(left, seconds))

    def disarm(self) -> None:
        self.deadline = None
        faulthandler.cancel_dump_traceback_later()

    def _set(self, seconds: float) -> None:
        self.deadline = time.monotonic() + seconds
        faulthandler.dump_traceback_later(seconds, exit=True, file=self.fd)


WATCHDOG: Optional[Watchdog] = None   # tests/conftest.py's (pytest_configure)


def start_watchdog(fd: int, seconds: float) -> Watchdog:
    global WATCHDOG
    WATCHDOG = Watchdog(fd, seconds)
    return WATCHDOG
