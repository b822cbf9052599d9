"""Loading and launching the CUDA kernels, shared by the lossless codec (:mod:`.cuda`), THC
(:mod:`.cuda_thc`) and top-k (:mod:`.cuda_topk`): the two ways of loading them, stream and device scoping, scratch arenas.

* ``compiled``: the extension ``lossless_hc._C_cuda`` (built by setup.py where nvcc is found).
* ``cupy``: where that extension is absent but CuPy is importable, the same headers are compiled at
  run time through NVRTC (``cupy.RawModule``, cached on disk by CuPy), and the kernels are launched
  through the CUDA driver API (``libcuda``) on torch's current stream.

``LHC_CUDA_BACKEND`` forces one (``compiled`` or ``cupy``); unset or ``auto`` prefers the compiled
module. Kernels take raw addresses (``data_ptr()``) and 64-bit argument words.
"""
from __future__ import annotations

import contextlib
import ctypes
import os
import pathlib
import re
import struct
import threading
from typing import Optional

import torch

CSRC = pathlib.Path(__file__).resolve().parents[2] / "csrc"
_MASK64 = (1 << 64) - 1


def f64_bits(x: float) -> int:
    """The 64-bit pattern of a double: how a double kernel parameter travels in an argument word."""
    return struct.unpack("<Q", struct.pack("<d", float(x)))[0]


# The kernel headers of the CUDA module (the lossless codec's, THC's and the top-k selection's): compiled together by nvcc into
# lossless_hc._C_cuda and by NVRTC on the CuPy path.
KERNEL_HEADERS = (CSRC / "cuda" / "codec_kernels.cuh", CSRC / "cuda" / "thc_kernels.cuh",
                  CSRC / "cuda" / "topk_kernels.cuh")


def header_text(path: pathlib.Path, seen: Optional[set] = None) -> str:
    """A kernels header's text with the kernel headers it includes (``#include "x.cuh"``, relative to
    it: codec_kernels.cuh includes its stage headers) put in place, each once."""
    seen = set() if seen is None else seen
    if path in seen:
        return ""
    seen.add(path)
    return re.sub(r'^#include "([^"]+\.cuh)"', lambda m: header_text((path.parent / m.group(1)).resolve(), seen),
                  path.read_text(), flags=re.M)


def header_kernels(path: Optional[pathlib.Path] = None) -> dict:
    """``{name: parameter count}`` of the extern "C" kernels declared in a kernels header, or in all of
    KERNEL_HEADERS (the CuPy path checks argument counts against it; the compiled module checks
    against its own table)."""
    text = "\n".join(header_text(p) for p in ([path] if path is not None else KERNEL_HEADERS))
    out = {}
    for m in re.finditer(r'extern\s+"C"\s+__global__\s+void\s+(\w+)\s*\(([^)]*)\)', text):
        params = [p for p in m.group(2).split(",") if p.strip()]
        out[m.group(1)] = len(params)
    return out


# ------------------------------------------------------------------------------------------------
# launchers
# ------------------------------------------------------------------------------------------------
class _CompiledLauncher:
    name = "compiled"

    def __init__(self, module):
        self._m = module
        self._blocks = {}

    def launch(self, kernel: str, grid: int, block: int, args, stream: int, cooperative: bool = False) -> None:
        self._m.launch(kernel, int(grid), int(block), [int(a) & _MASK64 for a in args], int(stream), cooperative)

    def resident_blocks(self, kernel: str, block: int) -> int:
        key = (torch.cuda.current_device(), kernel, block)
        if key not in self._blocks:
            self._blocks[key] = self._m.max_active_blocks(kernel, block)
        return self._blocks[key]


def _nvrtc_source() -> str:
    """The translation unit NVRTC compiles: the kernels header, included from csrc/, under a comment
    holding a digest of the headers' text. CuPy caches compiled modules by source text and options,
    not by the files a source includes, so the digest makes an edited header compile afresh."""
    import hashlib
    digest = hashlib.sha256()
    for path in (*KERNEL_HEADERS, CSRC / "lhc_layout.h", CSRC / "lhc_ancestry.h", CSRC / "lhc_status.h", CSRC / "thc_math.h"):
        digest.update(header_text(path.resolve()).encode())
    includes = "".join(f'#include "cuda/{p.name}"\n' for p in KERNEL_HEADERS)
    return f'// lossless_hc kernels, sources sha256 {digest.hexdigest()}\n{includes}'


class _CupyLauncher:
    """Kernels compiled by NVRTC through CuPy; launched with the driver API on torch's stream (so
    no CuPy stream or context juggling: CuPy and torch both use the device's primary context)."""

    name = "cupy"

    def __init__(self):
        import cupy  # noqa: F401  (ImportError tells the caller this path is unavailable)
        self._cupy = cupy
        self._modules = {}
        self._functions = {}
        self._blocks = {}
        self._arity = None
        self._cuda = ctypes.CDLL("libcuda.so.1")
        self._cuda.cuLaunchKernel.restype = ctypes.c_int
        self._cuda.cuLaunchCooperativeKernel.restype = ctypes.c_int
        self._cuda.cuOccupancyMaxActiveBlocksPerMultiprocessor.restype = ctypes.c_int

    def _function(self, kernel: str):
        dev = torch.cuda.current_device()
        key = (dev, kernel)
        fn = self._functions.get(key)
        if fn is None:
            with self._cupy.cuda.Device(dev):
                module = self._modules.get(dev)
                if module is None:
                    module = self._cupy.RawModule(code=_nvrtc_source(), options=("-std=c++17", f"-I{CSRC}"))
                    self._modules[dev] = module
                found = module.get_function(kernel)
                # Recent CuPy returns a RawKernel wrapping the cupy.cuda.Function, older CuPy the
                # Function itself; its `ptr` is the CUfunction handle.
                fn = int(getattr(found, "kernel", found).ptr)
            self._functions[key] = fn
        return fn

    def launch(self, kernel: str, grid: int, block: int, args, stream: int, cooperative: bool = False) -> None:
        if self._arity is None:
            self._arity = header_kernels()
        if self._arity.get(kernel) != len(args):
            raise RuntimeError(f"lossless_hc CUDA launch failed: {kernel} takes {self._arity.get(kernel)} arguments, "
                               f"got {len(args)}")
        if grid <= 0:
            return
        fn = self._function(kernel)
        words = [ctypes.c_uint64(int(a) & _MASK64) for a in args]
        params = (ctypes.c_void_p * len(words))(*[ctypes.cast(ctypes.byref(w), ctypes.c_void_p) for w in words])
        launch = self._cuda.cuLaunchCooperativeKernel if cooperative else self._cuda.cuLaunchKernel
        extra = () if cooperative else (None,)
        rc = launch(ctypes.c_void_p(fn), ctypes.c_uint(grid), ctypes.c_uint(1), ctypes.c_uint(1),
                    ctypes.c_uint(block), ctypes.c_uint(1), ctypes.c_uint(1), ctypes.c_uint(0),
                    ctypes.c_void_p(stream), params, *extra)
        if rc != 0:
            raise RuntimeError(f"lossless_hc CUDA launch failed: {kernel}: CUresult {rc}")

    def resident_blocks(self, kernel: str, block: int) -> int:
        key = (torch.cuda.current_device(), kernel, block)
        if key not in self._blocks:
            n = ctypes.c_int(0)
            rc = self._cuda.cuOccupancyMaxActiveBlocksPerMultiprocessor(
                ctypes.byref(n), ctypes.c_void_p(self._function(kernel)), ctypes.c_int(block), ctypes.c_size_t(0))
            self._blocks[key] = n.value if rc == 0 else 1
        return self._blocks[key]


class KernelProfile:
    """Per-kernel device time of the launches made while it is active (``with profile() as p``):
    each launch is bracketed by CUDA events and waited for, so the profiled run is slower than a
    plain one and synchronises after every kernel. A diagnostic for performance work only."""

    def __init__(self):
        self.ms = {}
        self.calls = {}

    def record(self, kernel: str, ms: float) -> None:
        self.ms[kernel] = self.ms.get(kernel, 0.0) + ms
        self.calls[kernel] = self.calls.get(kernel, 0) + 1

    def table(self) -> str:
        total = sum(self.ms.values()) or 1.0
        rows = sorted(self.ms.items(), key=lambda kv: -kv[1])
        return "\n".join(f"{name:28s} {ms:9.3f} ms {100 * ms / total:5.1f}%  x{self.calls[name]}" for name, ms in rows)


_PROFILE: Optional[KernelProfile] = None


@contextlib.contextmanager
def profile():
    """Time every kernel launched inside the block (see KernelProfile)."""
    global _PROFILE
    previous, _PROFILE = _PROFILE, KernelProfile()
    try:
        yield _PROFILE
    finally:
        _PROFILE = previous


class _ProfiledLauncher:
    """A launcher whose launches are timed into the active KernelProfile."""

    def __init__(self, inner, prof: KernelProfile):
        self._inner, self._prof = inner, prof
        self.name = inner.name

    def __getattr__(self, attr):
        return getattr(self._inner, attr)

    def launch(self, kernel: str, grid: int, block: int, args, stream: int, cooperative: bool = False) -> None:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        self._inner.launch(kernel, grid, block, args, stream, cooperative)
        end.record()
        end.synchronize()
        self._prof.record(kernel, start.elapsed_time(end))


def active_launcher():
    """The launcher, wrapped for timing while a profile is active."""
    launch = launcher()
    return _ProfiledLauncher(launch, _PROFILE) if _PROFILE is not None else launch


_LOCK = threading.Lock()
_LAUNCHER = None
_LAUNCHER_ERROR: Optional[str] = None


def launcher():
    """The kernel launcher (compiled module or CuPy/NVRTC), chosen once per process; raises
    ImportError with the reasons when neither is available."""
    global _LAUNCHER, _LAUNCHER_ERROR
    with _LOCK:
        if _LAUNCHER is not None:
            return _LAUNCHER
        choice = os.environ.get("LHC_CUDA_BACKEND", "auto").lower()
        if choice not in ("auto", "compiled", "cupy"):
            raise ValueError(f"LHC_CUDA_BACKEND must be auto, compiled or cupy, got {choice!r}")
        reasons = []
        if choice in ("auto", "compiled"):
            try:
                from lossless_hc import _C_cuda
                _LAUNCHER = _CompiledLauncher(_C_cuda)
                return _LAUNCHER
            except ImportError as exc:
                reasons.append(f"lossless_hc._C_cuda is not built ({exc})")
        if choice in ("auto", "cupy"):
            try:
                _LAUNCHER = _CupyLauncher()
                return _LAUNCHER
            except (ImportError, OSError) as exc:
                reasons.append(f"CuPy run-time compilation is unavailable ({exc})")
        _LAUNCHER_ERROR = "; ".join(reasons)
        raise ImportError("lossless_hc has no CUDA kernels available: " + _LAUNCHER_ERROR +
                          ". Build with nvcc (LHC_CUDA=1 pip install -e .) or install CuPy.")


def reset_launcher(replacement=None) -> None:
    """Forget the chosen launcher, so the next call of ``launcher`` chooses again (tests switch
    between the compiled and the CuPy path with LHC_CUDA_BACKEND); or install ``replacement``, an
    object with the launchers' interface (tests/test_cuda_emulated.py runs the kernels on the host
    through one, with CPU tensors)."""
    global _LAUNCHER, _LAUNCHER_ERROR
    with _LOCK:
        _LAUNCHER, _LAUNCHER_ERROR = replacement, None


def device_scope(device: torch.device):
    """Make ``device`` current (CUDA); a CPU device is only seen by the host emulation of the tests."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def stream_handle(device: torch.device) -> int:
    """The current torch stream of ``device`` as a cudaStream_t integer (0 for the host emulation)."""
    return torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0


def backend_name() -> str:
    """``compiled`` or ``cupy``: which way the kernels were loaded (loads them if needed)."""
    return launcher().name




class Arena:
    """Named slices of one uint8 scratch tensor, each 256-byte aligned."""

    def __init__(self, sizes: dict, device):
        self.offsets = {}
        total = 0
        for name, nbytes in sizes.items():
            self.offsets[name] = (total, nbytes)
            total += -(-max(nbytes, 1) // 256) * 256
        self.total = total
        self.buffer = torch.empty(total, dtype=torch.uint8, device=device)

    def view(self, name: str, dtype=torch.uint8) -> torch.Tensor:
        off, nbytes = self.offsets[name]
        return self.buffer[off:off + nbytes].view(dtype)

    def ptr(self, name: str) -> int:
        return self.buffer.data_ptr() + self.offsets[name][0]
