"""Compile csrc/cuda/codec_kernels.cuh, thc_kernels.cuh and topk_kernels.cuh with NVRTC, as the CuPy run-time path
does, without a GPU.

Usage: python scripts/nvrtc_check.py [--arch 80 --arch 90]

libnvrtc is looked up in $LHC_NVRTC_LIB, the `nvidia-cuda-nvrtc` wheel (nvidia/cu*/lib on
sys.path), then the CUDA toolkit's lib64. Exit status: 0 compiled for every arch; 1 a compile
failed (the log is printed); 2 no libnvrtc was found (nothing checked; says so).
"""
from __future__ import annotations

import argparse
import ctypes
import glob
import os
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
CSRC = ROOT / "csrc"
# What lossless_hc/backends/cuda_runtime.py hands NVRTC: the kernels headers included from csrc/, C++17.
SOURCE = '#include "cuda/codec_kernels.cuh"\n#include "cuda/thc_kernels.cuh"\n#include "cuda/topk_kernels.cuh"\n'


def find_libnvrtc() -> str | None:
    env = os.environ.get("LHC_NVRTC_LIB")
    if env:
        return env
    for entry in sys.path:
        hits = sorted(glob.glob(os.path.join(entry, "nvidia", "cu*", "lib", "libnvrtc.so*")))
        hits = [h for h in hits if "alt" not in os.path.basename(h)]
        if hits:
            return hits[0]
    for root in (os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
        if root:
            hits = sorted(glob.glob(os.path.join(root, "lib64", "libnvrtc.so*")))
            if hits:
                return hits[0]
    return None


def compile_for(lib, arch: str) -> tuple[bool, str]:
    prog = ctypes.c_void_p()
    src = SOURCE.encode()
    rc = lib.nvrtcCreateProgram(ctypes.byref(prog), src, b"lhc_kernels.cu", 0, None, None)
    if rc != 0:
        return False, f"nvrtcCreateProgram failed ({rc})"
    opts = [f"--gpu-architecture=compute_{arch}".encode(), b"-std=c++17", f"-I{CSRC}".encode()]
    arr = (ctypes.c_char_p * len(opts))(*opts)
    rc = lib.nvrtcCompileProgram(prog, len(opts), arr)
    size = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetProgramLog(prog, log)
    lib.nvrtcDestroyProgram(ctypes.byref(prog))
    return rc == 0, log.value.decode(errors="replace")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", action="append", default=None, help="compute capability, e.g. 80 (repeatable)")
    args = p.parse_args()
    archs = args.arch or ["80", "90"]
    path = find_libnvrtc()
    if path is None:
        print("nvrtc-check: SKIPPED: no libnvrtc found (set LHC_NVRTC_LIB or pip install nvidia-cuda-nvrtc)")
        return 2
    # libnvrtc dlopens its builtins by soname; load the sibling copy first so it resolves.
    for builtins in sorted(glob.glob(os.path.join(os.path.dirname(path), "libnvrtc-builtins.so*"))):
        if "alt" not in os.path.basename(builtins):
            ctypes.CDLL(builtins, mode=ctypes.RTLD_GLOBAL)
            break
    lib = ctypes.CDLL(path)
    ok = True
    for arch in archs:
        good, log = compile_for(lib, arch)
        print(f"nvrtc-check: compute_{arch}: {'ok' if good else 'FAILED'} ({path})")
        if log.strip():
            print(log)
        ok &= good
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
