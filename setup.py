"""Build lossless_hc and its C++ extension lossless_hc._C (pybind11, C++17, OpenMP), plus the CUDA
extension lossless_hc._C_cuda when nvcc is available.

The extensions exchange raw addresses and sizes with Python, so they need neither torch's C++
headers nor its ABI. Environment:
  LHC_SANITIZE=1   build with -fsanitize=address,undefined (see scripts/sanitize.sh)
  LHC_DEBUG=1      -O0 -g
  LHC_CUDA=0       never build _C_cuda; LHC_CUDA=1: build it, and fail if nvcc is missing;
                   unset: build it when nvcc is found (PATH, $CUDA_HOME/bin or /usr/local/cuda/bin)
  LHC_CUDA_ARCHS   compute capabilities for _C_cuda (default "80;90": sm_80 and sm_90 machine code
                   plus compute_90 PTX for newer GPUs)
  LHC_BUILD_JOBS   how many C++ sources compile at once, a positive integer (default: one per usable CPU,
                   at most 8)
"""
import glob
import os
import re
import shutil
import subprocess

from pybind11.setup_helpers import ParallelCompile, Pybind11Extension, build_ext
from setuptools import find_packages, setup


def build_jobs() -> int:
    """How many C++ sources compile at once: LHC_BUILD_JOBS (a positive integer; unset or empty: the default),
    by default one per CPU this process may run on (a container's cpuset, not the host's count), at most 8:
    each -O3 compile holds its own memory."""
    text = os.environ.get("LHC_BUILD_JOBS", "").strip()
    if not text:
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        return min(8, cpus)
    try:
        jobs = int(text)
    except ValueError:
        jobs = 0
    if jobs < 1:
        raise ValueError(f"LHC_BUILD_JOBS must be a positive integer (C++ sources compiled at once), got {text!r}")
    return jobs


# The sources of one extension compile in parallel (setuptools alone compiles them one after another);
# every source is recompiled whenever an extension is rebuilt (depends lists every header).
ParallelCompile(default=build_jobs()).install()


def switch(name: str) -> str:
    """The 0/1 switch ``name`` from the environment: "" (unset or empty), "0" or "1"; another value is a
    ValueError (LHC_CUDA=true would otherwise read as unset, LHC_DEBUG=yes as 0)."""
    value = os.environ.get(name, "").strip()
    if value not in ("", "0", "1"):
        raise ValueError(f"{name} must be 0 or 1 (or unset), got {value!r}")
    return value


sanitize = switch("LHC_SANITIZE") == "1"
debug = switch("LHC_DEBUG") == "1" or sanitize

compile_args = ["-fopenmp", "-Wall", "-Wextra"]
link_args = ["-fopenmp"]
if debug:
    # Sanitized: -g1 (line tables) keeps file:line in the reports and builds a quarter faster than -g.
    compile_args += ["-O1" if sanitize else "-O0", "-g1" if sanitize else "-g", "-fno-omit-frame-pointer"]
else:
    compile_args += ["-O3"]
if sanitize:
    compile_args += ["-fsanitize=address,undefined", "-fno-sanitize-recover=undefined"]
    link_args += ["-fsanitize=address,undefined"]

# Every header and source under csrc/: a change to any of them rebuilds the extensions.
CSRC_FILES = sorted(glob.glob("csrc/**/*.h", recursive=True) + glob.glob("csrc/**/*.cuh", recursive=True) +
                    glob.glob("csrc/**/*.cpp", recursive=True) + glob.glob("csrc/**/*.cu", recursive=True))

ext = Pybind11Extension(
    "lossless_hc._C",
    sources=["csrc/bindings.cpp", "csrc/thc_bindings.cpp", "csrc/topk_bindings.cpp", *sorted(glob.glob("csrc/cpu/*.cpp"))],
    include_dirs=["csrc"],
    depends=CSRC_FILES,
    cxx_std=17,
    extra_compile_args=compile_args,
    extra_link_args=link_args,
)


def find_nvcc():
    """nvcc's path, or None."""
    candidates = [shutil.which("nvcc")]
    for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if root:
            candidates.append(os.path.join(root, "bin", "nvcc"))
    for c in candidates:
        if c and os.path.isfile(c) and os.access(c, os.X_OK):
            return c
    return None


def cuda_home(nvcc):
    """The toolkit root of nvcc: $CUDA_HOME/$CUDA_PATH, else two levels above the real nvcc binary, else
    /usr/local/cuda (nvcc may be a wrapper script outside the toolkit)."""
    for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")):
        if root and os.path.isdir(os.path.join(root, "include")):
            return root
    real = os.path.realpath(nvcc)
    root = os.path.dirname(os.path.dirname(real))
    if os.path.isfile(os.path.join(root, "include", "cuda_runtime.h")):
        return root
    return "/usr/local/cuda"


CUDA_SOURCES = ["csrc/cuda/codec_cuda.cu"]
CUDA_DEPENDS = [f for f in CSRC_FILES if f not in CUDA_SOURCES]


def cuda_archs() -> list:
    """LHC_CUDA_ARCHS as a list of compute capabilities ("80;90", commas also separate; "90a" style suffixes
    kept); unset: 80 and 90. An empty or malformed value is a ValueError naming it, here rather than as an
    IndexError or an nvcc usage error in the middle of the build (which a tolerant build turns into a warning)."""
    text = os.environ.get("LHC_CUDA_ARCHS", "80;90")
    archs = [a.strip() for a in text.replace(",", ";").split(";") if a.strip()]
    if not archs or not all(re.fullmatch(r"[0-9]{2,3}[a-z]?", a) for a in archs):
        raise ValueError(f"LHC_CUDA_ARCHS must list compute capabilities such as \"80;90\", got {text!r}")
    return archs


CUDA_ARCHS = cuda_archs()


def nvcc_arch_flags():
    archs = CUDA_ARCHS
    flags = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in archs]
    flags.append(f"-gencode=arch=compute_{archs[-1]},code=compute_{archs[-1]}")
    return flags


class BuildExtWithCuda(build_ext):
    """build_ext that compiles the .cu sources of _C_cuda with nvcc and links them (static cudart)."""

    def build_extension(self, ext):
        if ext.name != "lossless_hc._C_cuda":
            return super().build_extension(ext)
        if lhc_cuda == "1":
            return self._build_cuda(ext)
        # Found nvcc without being asked for CUDA: a toolkit that cannot build the module must not
        # break the CPU build (device="cuda" then falls back to CuPy, or says what is missing).
        try:
            return self._build_cuda(ext)
        except Exception as exc:  # noqa: BLE001 -- any compiler or linker failure
            print(f"warning: lossless_hc._C_cuda not built ({exc}); set LHC_CUDA=1 to make this an error")

    def _build_cuda(self, ext):
        nvcc = ext.nvcc
        objects = []
        tmp = os.path.join(self.build_temp, "cuda")
        os.makedirs(tmp, exist_ok=True)
        for src in CUDA_SOURCES:
            obj = os.path.join(tmp, os.path.basename(src) + ".o")
            # --threads 0: the architectures compile in parallel, one per CPU.
            cmd = [nvcc, "-std=c++17", "-O3", "-Icsrc", "-Xcompiler", "-fPIC", "--expt-relaxed-constexpr",
                   "--threads", "0", *nvcc_arch_flags(), "-c", src, "-o", obj]
            if debug:
                cmd += ["-g", "-lineinfo"]
            print(" ".join(cmd))
            subprocess.check_call(cmd)
            objects.append(obj)
        ext.extra_objects = objects
        return super().build_extension(ext)


ext_modules = [ext]
lhc_cuda = switch("LHC_CUDA")
nvcc = find_nvcc() if lhc_cuda != "0" else None
if lhc_cuda == "1" and nvcc is None:
    raise RuntimeError("LHC_CUDA=1 but nvcc was not found (PATH, $CUDA_HOME/bin, /usr/local/cuda/bin): "
                       "install the CUDA toolkit or unset LHC_CUDA")
if nvcc is not None and not sanitize:
    home = cuda_home(nvcc)
    lib_dirs = [d for d in (os.path.join(home, "lib64"), os.path.join(home, "lib")) if os.path.isdir(d)]
    cuda_ext = Pybind11Extension(
        "lossless_hc._C_cuda",
        sources=["csrc/cuda/bindings_cuda.cpp"],
        include_dirs=["csrc", "csrc/cuda"],
        cxx_std=17,
        extra_compile_args=["-Wall", "-Wextra", "-O2"],
        # Static cudart: the module needs only the driver at run time, not a libcudart of the
        # version torch happens to ship.
        library_dirs=lib_dirs,
        libraries=["cudart_static", "dl", "rt", "pthread"],
        depends=CUDA_SOURCES + CUDA_DEPENDS,
    )
    cuda_ext.nvcc = nvcc
    ext_modules.append(cuda_ext)

setup(
    name="lossless_hc",
    version="0.1.0",
    description="Homomorphic (lossless) gradient compression for data-parallel PyTorch training",
    # Every subpackage of lossless_hc (lossless_hc.plugins comes from plugins/, see package_dir).
    packages=sorted(set(find_packages(include=["lossless_hc", "lossless_hc.*"])) | {"lossless_hc.plugins"}),
    package_data={"lossless_hc.thc": ["tables.json"]},
    package_dir={"lossless_hc": "lossless_hc", "lossless_hc.plugins": "plugins"},
    ext_modules=ext_modules,
    cmdclass={"build_ext": BuildExtWithCuda},
    python_requires=">=3.9",
    install_requires=["torch>=2.0", "numpy"],
)
