"""tests/processes.py: a launch's processes end with it, and a launch's time is not the watchdog's."""
import os
import subprocess
import sys
import time

import pytest

from processes import run_launcher

HERE = os.path.dirname(os.path.abspath(__file__))
DETACHED_SLEEP = "sleep 300 >/dev/null 2>&1 & echo $!"   # a grandchild that keeps no pipe of the launcher open


def running(pid: int) -> bool:
    """Whether ``pid`` is alive and not a zombie (a killed orphan waits for init to reap it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def ended(pid: int, within: float = 5.0) -> bool:
    stop = time.monotonic() + within
    while running(pid):
        if time.monotonic() > stop:
            os.kill(pid, 9)   # do not leave it to the next test
            return False
        time.sleep(0.05)
    return True


def test_what_a_launcher_leaves_behind_ends_with_the_launch():
    """The launcher exits while a process it started still runs (subprocess.run would leave it)."""
    res = run_launcher(["bash", "-c", DETACHED_SLEEP], timeout=60)
    assert res.returncode == 0 and ended(int(res.stdout)), res


def test_a_launch_past_its_timeout_fails_and_ends_every_process_it_started():
    """Past its timeout the test fails with the launcher's output (subprocess.run would kill the
    launcher alone and raise without it)."""
    with pytest.raises(pytest.fail.Exception, match=r"ran past its 1 s") as failed:
        run_launcher(["bash", "-c", f"{DETACHED_SLEEP}; echo waiting >&2; sleep 300"], timeout=1)
    message = str(failed.value)
    assert "waiting" in message.split("--- stderr ---")[1]
    assert ended(int(message.split("--- stdout ---\n")[1].split()[0]))


def test_a_launch_extends_the_watchdog_past_its_timeout(tmp_path):
    """With a watchdog of 1 s, a 3 s launch still passes, and a test that sleeps ends the session from
    the watchdog: its stacks on stderr, a failing exit, well before the sleep's end."""
    (tmp_path / "test_watched.py").write_text(
        "import time\nfrom processes import run_launcher\n"
        "def test_launch():\n    assert run_launcher(['sleep', '3'], timeout=60).returncode == 0\n"
        "def test_hang():\n    time.sleep(60)\n")
    # conftest alone (no codec: under scripts/sanitize.sh it would check which build that imports)
    env = {k: v for k, v in os.environ.items() if k != "LHC_EXPECT_SANITIZED"}
    env.update(PYTHONPATH=HERE, LHC_TEST_TIMEOUT="1")
    start = time.monotonic()
    res = subprocess.run([sys.executable, "-m", "pytest", "-v", "-p", "conftest", "-p", "no:cacheprovider",
                          "-p", "no:xdist", "test_watched.py"], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=120)
    assert time.monotonic() - start < 30, res
    assert res.returncode != 0 and "test_launch PASSED" in res.stdout, res
    assert "Timeout (0:00:01)" in res.stderr and "test_hang" in res.stderr, res
