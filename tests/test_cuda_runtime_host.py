"""The host side of lossless_hc/backends/cuda_runtime.py, checked without a GPU: how the way the CUDA
kernels are loaded is chosen (``launcher``: the compiled ``lossless_hc._C_cuda`` or CuPy/NVRTC, forced by
``LHC_CUDA_BACKEND``; each way made present or absent through ``sys.modules``, so no kernel is loaded or
launched), and the scratch arenas the launch sequences carve their buffers from. The GPU tests
(tests/conftest.py's ``backend`` fixture) rely on the choice; here its answers and its errors are pinned.
"""
import sys
import types

import pytest
import torch

import lossless_hc
from lossless_hc.backends import cuda_runtime


@pytest.fixture
def ways(monkeypatch):
    """A fresh choice (reset before and after), with the compiled module present as a stand-in and
    CuPy absent; ``ways(compiled=False)`` takes the compiled module away as well."""
    cuda_runtime.reset_launcher()
    monkeypatch.delenv("LHC_CUDA_BACKEND", raising=False)
    monkeypatch.setitem(sys.modules, "cupy", None)   # `import cupy` raises ImportError

    def set_ways(compiled=True):
        module = types.ModuleType("lossless_hc._C_cuda") if compiled else None
        monkeypatch.setitem(sys.modules, "lossless_hc._C_cuda", module)
        if compiled:
            monkeypatch.setattr(lossless_hc, "_C_cuda", module, raising=False)
        else:
            monkeypatch.delattr(lossless_hc, "_C_cuda", raising=False)
        return module

    yield set_ways
    cuda_runtime.reset_launcher()


@pytest.mark.parametrize("choice", [None, "auto", "compiled", "COMPILED"])
def test_the_compiled_module_is_chosen_where_it_is_built(ways, monkeypatch, choice):
    """Unset, auto or compiled (any case): the compiled module, chosen once per process -- a later
    change of LHC_CUDA_BACKEND does not choose again until reset_launcher."""
    module = ways(compiled=True)
    if choice is not None:
        monkeypatch.setenv("LHC_CUDA_BACKEND", choice)
    first = cuda_runtime.launcher()
    assert first.name == "compiled" and first._m is module
    assert cuda_runtime.backend_name() == "compiled"
    monkeypatch.setenv("LHC_CUDA_BACKEND", "cupy")
    assert cuda_runtime.launcher() is first
    cuda_runtime.reset_launcher()
    with pytest.raises(ImportError, match="CuPy run-time compilation is unavailable"):
        cuda_runtime.launcher()


def test_forcing_cupy_does_not_fall_back_to_the_compiled_module(ways, monkeypatch):
    ways(compiled=True)
    monkeypatch.setenv("LHC_CUDA_BACKEND", "cupy")
    with pytest.raises(ImportError, match=r"no CUDA kernels available: CuPy run-time compilation is unavailable") as err:
        cuda_runtime.launcher()
    assert "_C_cuda" not in str(err.value).split("Build with")[0]


@pytest.mark.parametrize("choice, reasons", [
    (None, r"lossless_hc\._C_cuda is not built \(.*\); CuPy run-time compilation is unavailable \(.*\)\. Build"),
    ("compiled", r"lossless_hc\._C_cuda is not built \(.*\)\. Build"),
])
def test_no_way_of_loading_the_kernels_is_an_import_error_with_every_reason(ways, monkeypatch, choice, reasons):
    """What the codecs' ``require`` passes on: each way tried, and why it is unavailable; nothing is
    chosen, so a later call tries again."""
    ways(compiled=False)
    if choice is not None:
        monkeypatch.setenv("LHC_CUDA_BACKEND", choice)
    for _ in range(2):
        with pytest.raises(ImportError, match=r"^lossless_hc has no CUDA kernels available: " + reasons):
            cuda_runtime.launcher()
    module = ways(compiled=True)
    assert cuda_runtime.launcher()._m is module


@pytest.mark.parametrize("choice", ["nvrtc", "", "compiled,cupy"])
def test_an_unknown_lhc_cuda_backend_is_refused(ways, monkeypatch, choice):
    ways(compiled=True)
    monkeypatch.setenv("LHC_CUDA_BACKEND", choice)
    with pytest.raises(ValueError, match=f"LHC_CUDA_BACKEND must be auto, compiled or cupy, got '{choice}'"):
        cuda_runtime.launcher()


def test_reset_launcher_installs_a_replacement(ways):
    """The hook of the host emulation (tests/test_cuda_emulated.py): the replacement is the launcher, and
    ``active_launcher`` hands it out unwrapped while no profile is active."""
    ways(compiled=True)
    replacement = types.SimpleNamespace(name="emulated")
    cuda_runtime.reset_launcher(replacement)
    assert cuda_runtime.launcher() is replacement and cuda_runtime.active_launcher() is replacement
    assert cuda_runtime.backend_name() == "emulated"


def test_arena_slices_are_256_byte_aligned_and_sized_as_asked():
    """Every slice starts at a multiple of 256 bytes from the buffer's start, the first at its start (a GPU
    faults on an 8-byte word at an unaligned address; the host emulation does not), and each view is
    exactly the bytes asked for, in the dtype asked for."""
    names = ("state", "odd", "words", "tail")
    arena = cuda_runtime.Arena({"state": 32, "odd": 257, "words": 8 * 3, "tail": 256}, torch.device("cpu"))
    assert [arena.ptr(name) - arena.buffer.data_ptr() for name in names] == [0, 256, 768, 1024]
    assert arena.total == arena.buffer.numel() == 1280 and arena.buffer.dtype == torch.uint8
    assert [arena.view(name).numel() for name in names] == [32, 257, 24, 256]
    assert [arena.view(name).data_ptr() for name in names] == [arena.ptr(name) for name in names]
    assert arena.view("words", torch.int64).numel() == 3


def test_nvrtc_source_changes_with_the_text_of_any_header_it_includes(monkeypatch):
    """CuPy caches a compiled module by its source text, not by the files the source includes: the
    digest in the source's first line must change when any included header's text does (here
    csrc/thc_math.h, which thc_kernels.cuh includes), or an edited header would run stale kernels."""
    before = cuda_runtime._nvrtc_source()
    assert before == cuda_runtime._nvrtc_source()
    text = cuda_runtime.header_text
    monkeypatch.setattr(cuda_runtime, "header_text",
                        lambda path, seen=None: text(path, seen) + ("// edited\n" if path.name == "thc_math.h" else ""))
    after = cuda_runtime._nvrtc_source()
    assert after.splitlines()[0] != before.splitlines()[0] and after.splitlines()[1:] == before.splitlines()[1:]
