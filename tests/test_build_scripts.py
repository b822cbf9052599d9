"""The build and check scripts' exit status and errors (scripts/cuda_check.sh, setup.py's environment,
scripts/sanitize.sh's reports).

* scripts/cuda_check.sh exits non-zero when a compile it runs fails (nvcc, the host compiler, NVRTC) and 0
  when it passes; the NVRTC step is best effort: where no libnvrtc is found and its wheel cannot be
  installed, the step says SKIPPED and the script still exits 0. The compilers, the NVRTC check and pip are
  stubs here (each answers as the case says), so what is tested is the script's own control flow, in
  seconds and without a CUDA toolkit;
* setup.py refuses an LHC_BUILD_JOBS that is not a positive integer, naming it;
* scripts/sanitize.sh runs pytest so that a sanitizer's report, written to file descriptor 2 as the process
  ends, reaches the terminal.
"""
import os
import shutil
import stat
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _executable(path, text: str) -> str:
    with open(path, "w") as f:
        f.write(text)
    os.chmod(path, os.stat(path).st_mode | stat.S_IXUSR)
    return str(path)


def _run_cuda_check(tmp_path, nvcc_rc=0, cxx_rc=0, nvrtc_rcs=(0,), pip_rc=0):
    """Run scripts/cuda_check.sh against stubs: nvcc (exit ``nvcc_rc``; on success it writes the object and a
    ptxas report naming every kernel of kernel_list.h), c++ (exit ``cxx_rc``), the NVRTC check (exit
    ``nvrtc_rcs[i]`` on its i-th run: 0 compiled, 1 a compile failed, 2 no libnvrtc) and pip (exit ``pip_rc``);
    ``python -m pybind11`` is the real one. Returns the CompletedProcess and the NVRTC check's run count."""
    # The script and the kernel list in a tree of their own: the script writes its logs and objects under
    # the tree's build-cuda-check/, which the repository's and parallel cases' runs must not share.
    tree = tmp_path / "tree"
    for rel in ("scripts/cuda_check.sh", "csrc/cuda/kernel_list.h"):
        os.makedirs(tree / os.path.dirname(rel), exist_ok=True)
        shutil.copy(os.path.join(REPO, rel), tree / rel)
    kernels = tree / "csrc" / "cuda" / "kernel_list.h"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    nvcc = _executable(bin_dir / "nvcc", f"""#!/usr/bin/env bash
if [ "$1" = --version ]; then echo "Cuda compilation tools, release 12.4, V12.4.131"; exit 0; fi
[ {nvcc_rc} = 0 ] || {{ echo "stub nvcc: error" >&2; exit {nvcc_rc}; }}
while [ $# -gt 0 ]; do [ "$1" = -o ] && touch "$2"; shift; done
sed -n "s/^LHC_KERNEL(\\([a-z0-9_]*\\))$/ptxas info    : Compiling entry function '\\1' for 'sm_90'/p" {kernels} >&2
""")
    _executable(bin_dir / "c++", f"#!/usr/bin/env bash\nexit {cxx_rc}\n")
    runs = tmp_path / "nvrtc_runs"
    answers = " ".join(str(rc) for rc in nvrtc_rcs)
    py = _executable(bin_dir / "python", f"""#!/usr/bin/env bash
if [ "$1" = scripts/nvrtc_check.py ]; then
  echo x >> {runs}; n=$(wc -l < {runs}); rcs=({answers}); rc=${{rcs[$((n - 1))]}}
  [ "$rc" = 2 ] && echo "nvrtc-check: SKIPPED: no libnvrtc found"
  exit "$rc"
fi
if [ "$1 $2" = "-m pip" ]; then exit {pip_rc}; fi
exec {sys.executable} "$@"
""")
    env = dict(os.environ, PY=py, NVCC=nvcc, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    env.pop("LD_PRELOAD", None)
    res = subprocess.run(["bash", "scripts/cuda_check.sh"], cwd=tree, env=env, capture_output=True, text=True,
                         timeout=120)
    return res, (len(runs.read_text().splitlines()) if runs.exists() else 0)


@pytest.mark.parametrize("case, expect_rc, expect_runs", [
    (dict(), 0, 1),                                       # everything compiles
    (dict(nvcc_rc=1), 1, 0),                              # nvcc fails: the script stops there
    (dict(cxx_rc=1), 1, 0),                               # the bindings fail the host compiler
    (dict(nvrtc_rcs=(1,)), 1, 1),                         # NVRTC refuses the kernels
    (dict(nvrtc_rcs=(2, 0)), 0, 2),                       # no libnvrtc: installed, then compiled
    (dict(nvrtc_rcs=(2, 1)), 1, 2),                       # ... installed, then the compile fails
    (dict(nvrtc_rcs=(2, 2)), 0, 2),                       # ... installed, still not found: SKIPPED
    (dict(nvrtc_rcs=(2,), pip_rc=1), 0, 1),               # ... the wheel cannot be installed: SKIPPED
])
def test_cuda_check_exits_non_zero_exactly_when_a_compile_fails(tmp_path, case, expect_rc, expect_runs):
    res, runs = _run_cuda_check(tmp_path, **case)
    out = res.stdout + res.stderr
    assert res.returncode == expect_rc, out
    assert runs == expect_runs, out


def test_cuda_check_says_why_the_nvrtc_step_was_skipped_when_its_wheel_cannot_be_installed(tmp_path):
    res, _ = _run_cuda_check(tmp_path, nvrtc_rcs=(2,), pip_rc=1)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "nvidia-cuda-nvrtc==12.4.* could not be installed" in res.stdout and "SKIPPED" in res.stdout, res.stdout


# -- setup.py's environment ----------------------------------------------------------------------------
def _setup_name(jobs: str):
    env = dict(os.environ, LHC_BUILD_JOBS=jobs)
    return subprocess.run([sys.executable, "setup.py", "--name"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=120)


@pytest.mark.parametrize("jobs", ["abc", "0", "-2", "1.5"])
def test_setup_refuses_a_build_job_count_that_is_not_a_positive_integer(jobs):
    """A bad LHC_BUILD_JOBS is one error naming it, before anything compiles (not int()'s message from
    inside the compile step, nor a silently serial build for 0 or less)."""
    res = _setup_name(jobs)
    assert res.returncode != 0, res.stdout + res.stderr
    assert f"LHC_BUILD_JOBS must be a positive integer (C++ sources compiled at once), got {jobs!r}" in res.stderr, \
        res.stderr


@pytest.mark.parametrize("jobs", ["", "1", "3"])
def test_setup_takes_a_positive_build_job_count_or_none(jobs):
    res = _setup_name(jobs)
    assert res.returncode == 0 and res.stdout.strip().endswith("lossless_hc"), res.stdout + res.stderr


# -- scripts/sanitize.sh ---------------------------------------------------------------------------------
def test_sanitize_runs_pytest_so_that_a_sanitizer_report_reaches_the_terminal(tmp_path):
    """A sanitizer writes its report to file descriptor 2 and ends the process at once: under pytest's default
    capture of the descriptors the report goes to a capture file that is never printed. A library built with
    -fsanitize=undefined reads past an array from a test, run by pytest with the capture option of each of
    sanitize.sh's pytest commands and its UBSan settings: the report must be in the output."""
    import re
    script = open(os.path.join(REPO, "scripts", "sanitize.sh")).read()
    commands = [line for line in script.splitlines() if re.search(r'"\$PY" -m pytest', line)]
    assert len(commands) == 2, commands
    plain = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}   # under sanitize.sh the runtimes are preloaded
    libubsan = subprocess.run(["gcc", "-print-file-name=libubsan.so"], env=plain, capture_output=True,
                              text=True).stdout.strip()
    if not os.path.isabs(libubsan):
        pytest.skip("gcc's libubsan is not installed (scripts/sanitize.sh needs it too)")
    (tmp_path / "bad.c").write_text("int bad(int i) { int a[2] = {1, 2}; return a[i]; }\n")
    subprocess.run(["gcc", "-shared", "-fPIC", "-O0", "-fsanitize=undefined", "-fno-sanitize-recover=undefined",
                    str(tmp_path / "bad.c"), "-o", str(tmp_path / "libbad.so")], env=plain, check=True)
    (tmp_path / "test_bad.py").write_text(
        "import ctypes\n"
        f"def test_reads_past_the_array():\n    ctypes.CDLL({str(tmp_path / 'libbad.so')!r}).bad(3)\n")
    env = dict(plain, LD_PRELOAD=libubsan, UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1")
    for command in commands:
        capture = re.findall(r"--capture=\w+|(?<!\S)-s(?!\S)", command)
        res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *capture,
                              str(tmp_path / "test_bad.py")], cwd=tmp_path, env=env, capture_output=True, text=True,
                             timeout=120)
        assert res.returncode != 0, res.stdout + res.stderr
        assert "runtime error: index 3 out of bounds" in res.stdout + res.stderr, (command, res.stdout + res.stderr)


@pytest.mark.parametrize("name, value", [("LHC_CUDA", "yes"), ("LHC_CUDA", "true"), ("LHC_SANITIZE", "on"),
                                         ("LHC_DEBUG", "2")])
def test_setup_refuses_a_switch_that_is_not_0_or_1(name, value):
    """LHC_CUDA=true was taken as unset (a CUDA build that may fail with a warning, where 1 makes it an error),
    LHC_SANITIZE=on and LHC_DEBUG=2 as 0: a build other than the one asked for, without a word."""
    res = subprocess.run([sys.executable, "setup.py", "--name"], cwd=REPO, env=dict(os.environ, **{name: value}),
                         capture_output=True, text=True, timeout=120)
    assert res.returncode != 0, res.stdout + res.stderr
    assert f"{name} must be 0 or 1 (or unset), got {value!r}" in res.stderr, res.stderr


@pytest.mark.parametrize("name, value", [("LHC_CUDA", "0"), ("LHC_DEBUG", ""), ("LHC_SANITIZE", "0")])
def test_setup_takes_a_switch_of_0_1_or_empty(name, value):
    res = subprocess.run([sys.executable, "setup.py", "--name"], cwd=REPO, env=dict(os.environ, **{name: value}),
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and res.stdout.strip().endswith("lossless_hc"), res.stdout + res.stderr


@pytest.mark.parametrize("archs", ["", ";", "sm_90", "90;abc"])
def test_setup_refuses_cuda_archs_that_are_not_compute_capabilities(archs):
    """An empty LHC_CUDA_ARCHS ended the CUDA build with an IndexError, which a build that found nvcc without
    LHC_CUDA=1 turns into a warning (the module silently not built): one error naming it instead."""
    res = subprocess.run([sys.executable, "setup.py", "--name"], cwd=REPO, env=dict(os.environ, LHC_CUDA_ARCHS=archs),
                         capture_output=True, text=True, timeout=120)
    assert res.returncode != 0 and "LHC_CUDA_ARCHS must list compute capabilities" in res.stderr, res.stderr


@pytest.mark.parametrize("archs", ["90", "80;90", "80, 90", "90a"])
def test_setup_takes_cuda_archs_as_documented(archs):
    res = subprocess.run([sys.executable, "setup.py", "--name"], cwd=REPO, env=dict(os.environ, LHC_CUDA_ARCHS=archs),
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and res.stdout.strip().endswith("lossless_hc"), res.stdout + res.stderr
