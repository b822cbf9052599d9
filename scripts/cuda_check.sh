#!/usr/bin/env bash
# `make cuda-check`: compile every CUDA source of the project without a GPU.
#  1. csrc/cuda/codec_cuda.cu (the kernels of codec_kernels.cuh -- the entry header of the codec's stage
#     headers codec_*.cuh -- and THC's thc_kernels.cuh, and their launcher) with nvcc for sm_80 and
#     sm_90, warnings as errors (the host pass ignores the device-only `#pragma unroll`), every kernel of
#     csrc/cuda/kernel_list.h present, and the resource report (registers, spills) of every kernel kept
#     in the log;
#  2. csrc/cuda/bindings_cuda.cpp (the pybind11 module) with the host compiler;
#  3. csrc/cuda/codec_kernels.cuh, thc_kernels.cuh and topk_kernels.cuh through NVRTC, as the CuPy run-time
#     path compiles them
#     (libnvrtc from the nvidia-cuda-nvrtc wheel, installed into .venv on first use when PyPI is
#     reachable; without it this step says SKIPPED).
# Exits 0 with a SKIPPED line when nvcc is absent.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-$PWD/.venv/bin/python}
NVCC=${NVCC:-$(command -v nvcc || true)}
if [ -z "$NVCC" ] && [ -x /usr/local/cuda/bin/nvcc ]; then NVCC=/usr/local/cuda/bin/nvcc; fi
if [ -z "$NVCC" ]; then
  echo "cuda-check: SKIPPED: nvcc not found (the CUDA sources were not compiled)"
  exit 0
fi
OUT=build-cuda-check
mkdir -p "$OUT"
# Under `make sanitize` the sanitizer runtimes may be preloaded; the compilers must not inherit them.
unset LD_PRELOAD
# The two architectures compile at once (nvcc runs on one core), each into its own log.
archs=(80 90)
pids=()
for arch in "${archs[@]}"; do
  "$NVCC" -std=c++17 -O3 -Icsrc -Xcompiler -fPIC,-Wall,-Wextra,-Wno-unknown-pragmas --Werror all-warnings -Xptxas -v \
    -gencode=arch=compute_${arch},code=sm_${arch} -c csrc/cuda/codec_cuda.cu -o "$OUT/codec_cuda_sm${arch}.o" \
    2> "$OUT/ptxas_sm${arch}.log" &
  pids+=($!)
done
for i in "${!archs[@]}"; do
  arch=${archs[$i]}
  wait "${pids[$i]}" || { cat "$OUT/ptxas_sm${arch}.log"; echo "cuda-check: nvcc sm_${arch} FAILED"; exit 1; }
done
for arch in "${archs[@]}"; do
  if grep -E "bytes spill (stores|loads)" "$OUT/ptxas_sm${arch}.log" | grep -vq " 0 bytes spill stores, 0 bytes spill loads"; then
    echo "cuda-check: note: register spills for sm_${arch} (see $OUT/ptxas_sm${arch}.log)"
  fi
  for k in $(sed -n 's/^LHC_KERNEL(\([a-z0-9_]*\))$/\1/p' csrc/cuda/kernel_list.h); do
    grep -q "entry function '$k'" "$OUT/ptxas_sm${arch}.log" || { echo "cuda-check: kernel $k missing from sm_${arch}"; exit 1; }
  done
  echo "cuda-check: nvcc sm_${arch}: ok (lossless codec and THC kernels)"
done
c++ -std=c++17 -fsyntax-only -Wall -Wextra -Werror -Icsrc -Icsrc/cuda $("$PY" -m pybind11 --includes) \
  csrc/cuda/bindings_cuda.cpp
echo "cuda-check: bindings (host compiler): ok"

# NVRTC: find libnvrtc, else install the wheel matching nvcc's release into the venv (best effort).
set +e
"$PY" scripts/nvrtc_check.py --arch 80 --arch 90
rc=$?
if [ $rc -eq 2 ]; then
  release=$("$NVCC" --version | sed -n 's/.*release \([0-9]*\.[0-9]*\).*/\1/p')
  echo "cuda-check: installing nvidia-cuda-nvrtc==${release}.* into the venv for the NVRTC check"
  if "$PY" -m pip install --quiet "nvidia-cuda-nvrtc==${release}.*"; then
    "$PY" scripts/nvrtc_check.py --arch 80 --arch 90
    rc=$?
  else   # no index reachable, or no wheel for this release: the step is best effort
    echo "cuda-check: NVRTC step SKIPPED: nvidia-cuda-nvrtc==${release}.* could not be installed"
  fi
  [ $rc -eq 2 ] && rc=0   # still no libnvrtc: SKIPPED was printed
fi
set -e
exit $rc
