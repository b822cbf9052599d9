"""pytest configuration shared by the codec tests.

* A hypothesis profile that CI can reproduce: derandomized (the examples are a function of the test),
  no per-example deadline (the first call of a test pays for imports), modest example counts.
* A watchdog (tests/processes.py): a test that runs for more than ``LHC_TEST_TIMEOUT`` seconds (default
  300; a launch of worker processes extends that past the launch's own timeout) dumps every thread's
  stack to the session's stderr (not the test's captured one, which the exit discards) and exits, so a
  hang inside the C++ kernels (which hold no GIL) fails loudly instead of blocking CI forever.
* ``PYTHONFAULTHANDLER`` set for the worker processes tests start, so a crashed rank shows its stack.
* The ``gpu`` marker (tests that need a CUDA device; ``pytest -m gpu`` selects them).
* With ``LHC_EXPECT_SANITIZED`` set (scripts/sanitize.sh), refuse to run against the repository's
  regular build: the sanitized extension must be the one imported.
"""
import os
import sys

import pytest
from hypothesis import HealthCheck, settings

sys.path.insert(0, os.path.dirname(__file__))  # `import helpers` from every test module
import processes  # noqa: E402  (tests/, on the path just above)
# Worker processes the multiprocess tests start inherit this: a rank that dies of a signal (SIGSEGV,
# SIGBUS, SIGABRT) prints its Python stack into the stderr that the failing test's message shows.
os.environ.setdefault("PYTHONFAULTHANDLER", "1")

settings.register_profile(
    "lhc",
    deadline=None,
    derandomize=True,
    max_examples=40,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile(os.environ.get("LHC_HYPOTHESIS_PROFILE", "lhc"))

_TIMEOUT = float(os.environ.get("LHC_TEST_TIMEOUT", "300"))


def pytest_configure(config):
    try:
        stderr = sys.stderr.fileno()
    except (AttributeError, ValueError, OSError):   # pytest-xdist's workers replace sys.stderr
        stderr = sys.__stderr__.fileno()
    # A copy of the session's stderr, taken while no test's output is captured.
    processes.start_watchdog(os.dup(stderr), _TIMEOUT)
    config.addinivalue_line("markers", "multiprocess: starts real worker processes (Horovod, torch.distributed)")
    config.addinivalue_line("markers", "gpu: needs a CUDA device (tests/test_cuda.py); skipped, visibly, without one. "
                                       "Run only these with `pytest -m gpu`.")
    if os.environ.get("LHC_EXPECT_SANITIZED"):
        import lossless_hc._C as ext
        repo_pkg = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "lossless_hc")
        if os.path.dirname(os.path.abspath(ext.__file__)) == repo_pkg:
            raise pytest.UsageError(f"LHC_EXPECT_SANITIZED is set but the regular build {ext.__file__} was imported")


@pytest.fixture(autouse=True)
def _hang_watchdog():
    processes.WATCHDOG.arm()
    yield
    processes.WATCHDOG.disarm()


@pytest.fixture
def gloo_world_of_one(tmp_path):
    """torch.distributed's default group as a Gloo world of this one process, destroyed after the test."""
    import torch.distributed as dist
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.fixture(params=["compiled", "cupy"])
def backend(request, monkeypatch):
    """The GPU tests' CUDA kernels, loaded one way per parameter: the compiled ``_C_cuda`` module or
    CuPy/NVRTC (skipped when that way is unavailable)."""
    from lossless_hc.backends import cuda as _cuda
    from lossless_hc.backends import cuda_runtime
    monkeypatch.setenv("LHC_CUDA_BACKEND", request.param)
    cuda_runtime.reset_launcher()
    try:
        cuda_runtime.launcher()
    except ImportError as exc:
        cuda_runtime.reset_launcher()
        pytest.skip(f"CUDA backend {request.param!r} unavailable: {exc}")
    yield request.param
    cuda_runtime.reset_launcher()
