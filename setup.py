"""Build lossless_hc and its C++ extension lossless_hc._C (pybind11, C++17, OpenMP).

The extension exchanges raw addresses and sizes with Python, so it needs neither torch's C++ headers
nor its ABI. Environment:
  LHC_SANITIZE=1   build with -fsanitize=address,undefined (see scripts/sanitize.sh)
  LHC_DEBUG=1      -O0 -g
"""
import os

from pybind11.setup_helpers import Pybind11Extension, build_ext
from setuptools import setup

sanitize = os.environ.get("LHC_SANITIZE") == "1"
debug = os.environ.get("LHC_DEBUG") == "1" or sanitize

compile_args = ["-fopenmp", "-Wall", "-Wextra"]
link_args = ["-fopenmp"]
if debug:
    compile_args += ["-O1" if sanitize else "-O0", "-g", "-fno-omit-frame-pointer"]
else:
    compile_args += ["-O3"]
if sanitize:
    compile_args += ["-fsanitize=address,undefined", "-fno-sanitize-recover=undefined"]
    link_args += ["-fsanitize=address,undefined"]

ext = Pybind11Extension(
    "lossless_hc._C",
    sources=["csrc/bindings.cpp", "csrc/cpu/codec_cpu.cpp",
             "csrc/thc_bindings.cpp", "csrc/cpu/thc_cpu.cpp"],
    include_dirs=["csrc"],
    cxx_std=17,
    extra_compile_args=compile_args,
    extra_link_args=link_args,
)

setup(
    name="lossless_hc",
    version="0.1.0",
    description="Homomorphic (lossless) gradient compression for data-parallel PyTorch training",
    packages=["lossless_hc", "lossless_hc.plugins"],
    package_data={"lossless_hc": ["thc_tables.json"]},
    package_dir={"lossless_hc": "lossless_hc", "lossless_hc.plugins": "plugins"},
    ext_modules=[ext],
    cmdclass={"build_ext": build_ext},
    python_requires=">=3.9",
    install_requires=["torch>=2.0", "numpy"],
)
