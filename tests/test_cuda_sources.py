"""Consistency of the CUDA backend's sources, checked without a GPU: the Python launch sequence
(lossless_hc/_cuda.py) against the kernels header (csrc/cuda/codec_kernels.cuh) and the compiled
module's kernel table. A mismatch here would be undefined behaviour at launch time on a GPU."""
import ast
import pathlib
import re

import pytest

from lossless_hc import _cuda

ROOT = pathlib.Path(__file__).resolve().parents[1]
HEADER_PATH = ROOT / "csrc" / "cuda" / "codec_kernels.cuh"
HEADER = HEADER_PATH.read_text()


def enum_names(name: str) -> list:
    body = re.search(r"enum\s+" + name + r"\s*:\s*\w+\s*\{(.*?)\};", HEADER, re.S).group(1)
    return [m.group(1) for m in re.finditer(r"^\s*(k\w+)", body, re.M)]


def test_layout_words_follow_the_header_enum():
    names = enum_names("LayoutWord")
    assert names[-1] == "kLayoutWords"
    camel = ["kLw" + "".join(part.capitalize() for part in w.split("_")) for w in _cuda.LAYOUT_WORDS]
    assert camel == names[:-1]


def test_decode_flags_follow_the_header_enum():
    flags = {m.group(1): int(m.group(2)) for m in re.finditer(r"(kFlag\w+)\s*=\s*1u\s*<<\s*(\d+)", HEADER)}
    python = {name: value for name, value in vars(_cuda).items() if name.startswith("FLAG_")}
    as_camel = {"kFlag" + "".join(p.capitalize() for p in name[5:].split("_")): v.bit_length() - 1
                for name, v in python.items()}
    assert as_camel == flags


def launches():
    """(kernel name, argument count, line) of every launch.launch(...) call in _cuda.py."""
    tree = ast.parse(pathlib.Path(_cuda.__file__).read_text())
    out = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "launch"
                and node.args and isinstance(node.args[0], ast.Constant) and len(node.args) >= 4):
            assert isinstance(node.args[3], ast.List), f"line {node.lineno}: arguments must be a list literal"
            out.append((node.args[0].value, len(node.args[3].elts), node.lineno))
    return out


def test_every_launch_passes_as_many_arguments_as_the_kernel_takes():
    kernels = _cuda.header_kernels(HEADER_PATH)
    calls = launches()
    assert len(calls) >= 20
    for name, nargs, line in calls:
        assert name in kernels, f"_cuda.py line {line} launches {name}, which the header does not declare"
        assert kernels[name] == nargs, f"_cuda.py line {line}: {name} takes {kernels[name]} arguments, given {nargs}"


def test_every_kernel_parameter_is_eight_bytes():
    """The launchers pass 64-bit words: a 4-byte parameter would be read misaligned."""
    for m in re.finditer(r'extern\s+"C"\s+__global__\s+void\s+(\w+)\s*\(([^)]*)\)', HEADER):
        for param in (p.strip() for p in m.group(2).split(",") if p.strip()):
            ok = "*" in param or re.match(r"(const\s+)?(uint64_t|double)\s+\w+$", param)
            assert ok, f"{m.group(1)}: parameter {param!r} is not a pointer, uint64_t or double"


def test_compiled_module_holds_every_header_kernel():
    mod = pytest.importorskip("lossless_hc._C_cuda", reason="lossless_hc._C_cuda not built (no nvcc at build time)")
    kernels = _cuda.header_kernels(HEADER_PATH)
    assert sorted(mod.kernel_names()) == sorted(kernels)
    for name, arity in kernels.items():
        assert mod.kernel_arity(name) == arity, name
