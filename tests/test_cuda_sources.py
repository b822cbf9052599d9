"""Consistency of the CUDA backend's sources, checked without a GPU: the Python launch sequence
(lossless_hc/backends/cuda_lhc.py and cuda_runtime.py) against the kernels headers (csrc/cuda/codec_kernels.cuh and the stage headers
it includes), the kernel list (csrc/cuda/kernel_list.h, which the compiled module's table and the host
emulation expand) and the compiled module's kernel table. A mismatch here would be undefined
behaviour at launch time on a GPU."""
import ast
import importlib
import pathlib
import re

import pytest
import torch

from lossless_hc.backends import cuda_lhc as _cuda

from lossless_hc.backends import cuda_runtime

ROOT = pathlib.Path(__file__).resolve().parents[1]
HEADER_PATH = ROOT / "csrc" / "cuda" / "codec_kernels.cuh"
HEADER = cuda_runtime.header_text(HEADER_PATH)   # the entry header with its stage headers in place
KERNEL_LIST = (ROOT / "csrc" / "cuda" / "kernel_list.h").read_text()
THC_HEADER_PATH = ROOT / "csrc" / "cuda" / "thc_kernels.cuh"
THC_HEADER = THC_HEADER_PATH.read_text()
TOPK_HEADER_PATH = ROOT / "csrc" / "cuda" / "topk_kernels.cuh"
LAYOUT_H = (ROOT / "csrc" / "lhc_layout.h").read_text()


def enum_names(name: str, header: str = HEADER) -> list:
    body = re.search(r"enum\s+" + name + r"\s*:\s*\w+\s*\{(.*?)\};", header, re.S).group(1)
    return [m.group(1) for m in re.finditer(r"^\s*(k\w+)", body, re.M)]


def test_layout_words_follow_the_header_enum():
    """The layout ABI: lossless_hc.lhc.layout's LAYOUT_WORDS name lhc::LayoutWord (csrc/lhc_layout.h) in
    order, and layout_words gives one word per name."""
    from lossless_hc.lhc import layout
    from lossless_hc.lhc.sizing import build_layout
    names = enum_names("LayoutWord", LAYOUT_H)
    assert names[-1] == "kLayoutWords"
    camel = ["kLw" + "".join(part.capitalize() for part in w.split("_")) for w in layout.LAYOUT_WORDS]
    assert camel == names[:-1]
    assert "enum LayoutWord" not in HEADER.replace(LAYOUT_H, ""), "one definition: csrc/lhc_layout.h"
    for kind in ("bitmap", "bloom", "multilevel", "dense"):
        words = layout.layout_words(build_layout(kind, 1 << 16, 4, 200))
        assert len(words) == len(layout.LAYOUT_WORDS) and all(-(1 << 63) <= w < 1 << 63 for w in words)


def test_layout_words_carry_every_uint64_as_the_int64_of_its_bits():
    """A uint64 word (a hash stream takes all 64 bits) reaches the kernels as the int64 of the same bits:
    2**63 - 1 as itself, 2**63 as int64's least value, 2**64 - 1 as -1."""
    from dataclasses import replace

    from lossless_hc.lhc import layout
    from lossless_hc.lhc.sizing import build_layout
    L = build_layout("bloom", 1 << 16, 4, 200)
    at = [layout.LAYOUT_WORDS.index(name) for name in ("sketch_stream", "bloom_stream")]
    for stream, word in ((0, 0), ((1 << 63) - 1, (1 << 63) - 1), (1 << 63, -(1 << 63)), ((1 << 64) - 1, -1)):
        words = layout.layout_words(replace(L, sketch=replace(L.sketch, stream=stream),
                                            bloom=replace(L.bloom, stream=stream)))
        assert [words[i] for i in at] == [word, word], hex(stream)
        assert torch.tensor(words, dtype=torch.int64).tolist() == words


def test_decode_flag_arguments_follow_the_header_enum():
    """The DecodeFlag bits Python passes to kernels (the status itself is decided on the device)."""
    flags = {m.group(1): int(m.group(2)) for m in re.finditer(r"(kFlag\w+)\s*=\s*1u\s*<<\s*(\d+)", HEADER)}
    python = {name: value for name, value in vars(_cuda).items() if name.startswith("FLAG_")}
    as_camel = {"kFlag" + "".join(p.capitalize() for p in name[5:].split("_")): v.bit_length() - 1
                for name, v in python.items()}
    assert python and as_camel.items() <= flags.items()
    assert not hasattr(_cuda, "decode_status")


def launches(module=_cuda):
    """(kernel name, argument count, line) of every launch.launch(...) call in cuda_lhc.py (or module)."""
    tree = ast.parse(pathlib.Path(module.__file__).read_text())
    out = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "launch"
                and node.args and isinstance(node.args[0], ast.Constant) and len(node.args) >= 4):
            assert isinstance(node.args[3], ast.List), f"line {node.lineno}: arguments must be a list literal"
            out.append((node.args[0].value, len(node.args[3].elts), node.lineno))
    return out


def test_every_codec_launch_passes_as_many_arguments_as_the_kernel_takes():
    """The lossless codec's launch sequences (cuda_lhc.py) against codec_kernels.cuh."""
    kernels = cuda_runtime.header_kernels(HEADER_PATH)
    calls = launches()
    assert len(calls) >= 20
    for name, nargs, line in calls:
        assert name in kernels, f"cuda_lhc.py line {line} launches {name}, which the header does not declare"
        assert kernels[name] == nargs, f"cuda_lhc.py line {line}: {name} takes {kernels[name]} arguments, given {nargs}"


def test_every_codec_kernel_is_launched():
    """Every kernel of codec_kernels.cuh (the multilevel index's included) has a launch in cuda_lhc.py."""
    kernels = set(cuda_runtime.header_kernels(HEADER_PATH))
    assert {k for k in kernels if k.startswith("lhc_ml_")}, "the multilevel kernels are missing from the header"
    assert kernels == {name for name, _, _ in launches()}


def test_layout_words_describe_every_fine_level():
    """The multilevel fine levels travel as kLwFineStride words each (LayoutWord), one block per level
    up to lhc::kMaxFineLevels, in FINE_LEVEL_WORDS order."""
    from lossless_hc.lhc.layout import FINE_LEVEL_WORDS, LAYOUT_WORDS, MAX_FINE_LEVELS
    stride = int(re.search(r"kLwFineStride == (\d+)", LAYOUT_H).group(1))
    assert stride == len(FINE_LEVEL_WORDS)
    first = LAYOUT_WORDS.index("fine0_seg_len")
    assert len(LAYOUT_WORDS) == first + MAX_FINE_LEVELS * stride
    assert int(re.search(r"kMaxFineLevels = (\d+)", LAYOUT_H).group(1)) == MAX_FINE_LEVELS


def test_every_kernel_parameter_is_eight_bytes():
    """The launchers pass 64-bit words: a 4-byte parameter would be read misaligned."""
    for m in re.finditer(r'extern\s+"C"\s+__global__\s+void\s+(\w+)\s*\(([^)]*)\)', HEADER + THC_HEADER):
        for param in (p.strip() for p in m.group(2).split(",") if p.strip()):
            ok = "*" in param or re.match(r"(const\s+)?(uint64_t|double)\s+\w+$", param)
            assert ok, f"{m.group(1)}: parameter {param!r} is not a pointer, uint64_t or double"


def test_entry_header_includes_every_stage_header():
    """codec_kernels.cuh is the one header NVRTC and codec_cuda.cu include: every codec_*.cuh must be
    reached from it (else its kernels would be missing from both, and from header_kernels)."""
    stages = {p.name for p in (ROOT / "csrc" / "cuda").glob("codec_*.cuh")} - {HEADER_PATH.name}
    included = set(re.findall(r'^#include "(codec_\w+\.cuh)"', HEADER_PATH.read_text(), re.M))
    assert stages and included == stages
    kernels = set(cuda_runtime.header_kernels(HEADER_PATH))
    for name in stages:
        assert set(cuda_runtime.header_kernels(ROOT / "csrc" / "cuda" / name)) <= kernels, name


def test_kernel_list_names_every_header_kernel_once():
    """csrc/cuda/kernel_list.h, the one list the compiled module's launch table and the host emulation
    expand, names exactly the kernels the headers declare (the lossless codec's and THC's), once each."""
    listed = re.findall(r"^LHC_KERNEL\((\w+)\)", KERNEL_LIST, re.M)
    assert len(listed) == len(set(listed))
    assert set(listed) == set(cuda_runtime.header_kernels())
    for source in ("csrc/cuda/codec_cuda.cu", "tests/cuda_emulation/emulated_kernels.cpp"):
        text = (ROOT / source).read_text()
        assert "kernel_list.h" in text and "LHC_KERNEL(lhc_" not in text, f"{source} must expand kernel_list.h"


def test_compiled_module_holds_every_header_kernel():
    mod = pytest.importorskip("lossless_hc._C_cuda", reason="lossless_hc._C_cuda not built (no nvcc at build time)")
    kernels = cuda_runtime.header_kernels()   # every header of the module: the lossless codec's and THC's
    assert (set(cuda_runtime.header_kernels(HEADER_PATH)) | set(cuda_runtime.header_kernels(THC_HEADER_PATH))
            | set(cuda_runtime.header_kernels(TOPK_HEADER_PATH))) == set(kernels)
    assert sorted(mod.kernel_names()) == sorted(kernels)
    for name, arity in kernels.items():
        assert mod.kernel_arity(name) == arity, name


# -- THC (csrc/cuda/thc_kernels.cuh, lossless_hc/backends/cuda_thc.py) ------------------------------------
def test_thc_layout_words_follow_the_header_enum():
    """THC's layout ABI: lossless_hc.thc.layout's LAYOUT_WORDS name lhc::ThcLayoutWord (csrc/lhc_layout.h) in
    order; both backends read a layout from those words (the CUDA kernels with thc_layout_from_words, the CPU
    binding too), so the CPU kernels' layout is the words' reading of every field."""
    from lossless_hc import _C
    from lossless_hc.thc.layout import LAYOUT_WORDS, plan_thc_layout
    names = enum_names("ThcLayoutWord", (ROOT / "csrc" / "lhc_layout.h").read_text())
    assert names[-1] == "kThcLayoutWords" and _C.THC_LAYOUT_WORDS == len(LAYOUT_WORDS)
    camel = ["kTl" + "".join(part.capitalize() for part in w.split("_")) for w in LAYOUT_WORDS]
    assert camel == names[:-1]
    assert "enum ThcLayoutWord" not in THC_HEADER   # one definition, in the shared header
    from lossless_hc.backends.cpu import CpuThcLayout
    layout = plan_thc_layout(1000003, 7, 30)
    native = CpuThcLayout(layout, torch.zeros(1), torch.zeros(1), torch.zeros(1)).c
    assert [getattr(native, w) for w in LAYOUT_WORDS] == layout.layout_words()


def test_thc_constants_follow_the_headers():
    from lossless_hc.backends import cuda_thc as _cuda_thc
    const = lambda name, text: int(re.search(name + r"\s*=\s*(\d+)", text).group(1))  # noqa: E731
    math_h = (ROOT / "csrc" / "thc_math.h").read_text()
    assert const("kThcThreads", THC_HEADER) == _cuda_thc.THREADS
    assert const("kThcTile", THC_HEADER) == _cuda_thc.TILE
    assert const("kThcNormChunk", math_h) == _cuda_thc.NORM_CHUNK
    assert const("kThcTreeWidth", math_h) == _cuda_thc.TREE_WIDTH
    assert re.search(r"sizeof\(ThcState\) == (\d+)", THC_HEADER).group(1) == str(_cuda_thc.STATE_BYTES)


@pytest.mark.parametrize("module, header", [("cuda_thc", THC_HEADER_PATH), ("cuda_topk", TOPK_HEADER_PATH)])
def test_every_thc_and_topk_launch_passes_as_many_arguments_as_the_kernel_takes(module, header):
    """THC's and top-k's launch sequences against their kernels headers: every kernel launched, and only those."""
    launcher = importlib.import_module(f"lossless_hc.backends.{module}")
    kernels = cuda_runtime.header_kernels(header)
    calls = launches(launcher)
    assert {name for name, _, _ in calls} == set(kernels), f"every kernel of {header.name} is launched, and only those"
    for name, nargs, line in calls:
        assert kernels[name] == nargs, f"{module}.py line {line}: {name} takes {kernels[name]} arguments, given {nargs}"


def test_topk_block_size_matches_the_kernels():
    from lossless_hc.backends import cuda_topk as _cuda_topk
    text = TOPK_HEADER_PATH.read_text()
    assert int(re.search(r"kTopkThreads\s*=\s*(\d+)", text).group(1)) == _cuda_topk.THREADS
    assert int(re.search(r"kTopkBins\s*=\s*(\d+)", text).group(1)) == _cuda_topk.BINS
    assert re.search(r"sizeof\(TopkState\) == (\d+)", text).group(1) == str(_cuda_topk.STATE_BYTES)


def test_nvrtc_source_includes_every_kernel_header():
    src = cuda_runtime._nvrtc_source()
    for path in cuda_runtime.KERNEL_HEADERS:
        assert f'#include "cuda/{path.name}"' in src


def test_value_peel_positions_leave_room_for_the_weight_codes():
    """The value peel's adjacency packs (key position << kWeightCodeBits) | weight code in 32 bits:
    _cuda caps the support list below 2^(32 - kWeightCodeBits) positions, and refuses a layout whose
    sketch could peel more keys than that (a clear error, not failing decodes at its design load)."""
    import torch
    from lossless_hc.lhc.sizing import build_layout
    layout_h = (ROOT / "csrc" / "lhc_layout.h").read_text()
    bits = int(re.search(r"kWeightCodeBits = (\d+)", layout_h).group(1))
    assert _cuda.WEIGHT_CODE_BITS == bits
    assert _cuda.MAX_PEEL_POSITIONS == 1 << (32 - bits)
    assert re.search(r"kAdjCodeMask = \(1u << kWeightCodeBits\) - 1u", HEADER)
    fits = build_layout("bitmap", 3 << 30, 1, 800_000_000)   # layouts only: nothing of this size is allocated
    native = _cuda.CudaLayout(fits, torch.device("cpu"))
    assert native.key_cap == min(fits.num_keys, fits.sketch.cells) <= _cuda.MAX_PEEL_POSITIONS
    too_big = build_layout("bitmap", 3 << 30, 1, 1 << 30)
    assert too_big.sketch.cells > _cuda.MAX_PEEL_POSITIONS
    with pytest.raises(ValueError, match="support keys"):
        _cuda.CudaLayout(too_big, torch.device("cpu"))


def test_ancestry_cap_is_one_constant():
    """The verification bound's soundness rule caps ancestries at lhc::kAncestryCap in both C++
    backends and at reference_peel.ANCESTRY_CAP in the oracle: the same number."""
    from lossless_hc.lhc.reference_peel import ANCESTRY_CAP
    header = (ROOT / "csrc" / "lhc_ancestry.h").read_text()
    assert int(re.search(r"constexpr uint32_t kAncestryCap = (\d+);", header).group(1)) == ANCESTRY_CAP


def test_cell_degree_cap_is_one_constant():
    """A value-sketch cell may hold at most lhc::kMaxCellDegree support keys on both C++ backends (the CUDA
    kernels include it from lhc_layout.h) and reference.MAX_CELL_DEGREE in the oracle: the same number,
    defined once in C++."""
    from lossless_hc.lhc.reference import MAX_CELL_DEGREE
    header = (ROOT / "csrc" / "lhc_layout.h").read_text()
    assert int(re.search(r"constexpr uint32_t kMaxCellDegree = (\d+);", header).group(1)) == MAX_CELL_DEGREE
    defined = [p.name for p in (ROOT / "csrc").rglob("*") if p.suffix in (".h", ".cuh", ".cu", ".cpp")
               and re.search(r"constexpr [\w ]+ kMaxCellDegree\b", p.read_text())]
    assert defined == ["lhc_layout.h"], defined
