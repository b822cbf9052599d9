#!/usr/bin/env bash
# Build Horovod 0.28.1 (PyTorch + Gloo + MPI) into PYTHON's environment, caching the wheel outside the repo.
#
# Horovod's last release forces C++14, which torch >= 2.1 headers reject; upstream fixed this only on
# master (PR #3998). We take the release sdist from the package index and change the two
# CMAKE_CXX_STANDARD lines to 17 at build time (docs: ../shared/reference/RESEARCH.md section 4).
# It is built as CMake's Release (-O3, as upstream's RelWithDebInfo, without -g): a quarter less build
# time and a 1 MB wheel instead of 20 MB (debug information for Horovod's own C++, which we never debug).
# The wheel is keyed by Horovod, torch (version and CUDA) and Python versions, so a second set-up takes
# seconds.
#
# With a CUDA build of torch (the GPU machine) Horovod's torch extension is built with CUDA (its CMake
# does that by itself), for the architectures in HOROVOD_BUILD_CUDA_CC_LIST (default: LHC_CUDA_ARCHS's,
# e.g. 90), and without GPU operations: NCCL refuses two ranks on one GPU, so Horovod copies each CUDA
# tensor to the host for Gloo or MPI and back, after a CUDA event on the stream that wrote it.
#
# The GPU machine has no network: `--fill-carry` here puts the sdist into the carry folder and, given a
# PYTHON whose torch is the GPU machine's (the same version and CUDA), a wheel built against it; there,
# this script takes the wheel when its key matches and builds from the carried sdist otherwise, and
# installs with no index (Horovod's few run-time dependencies are already on that image).
#
# Usage: scripts/setup_horovod.sh PYTHON                 build (or take the cached wheel) and install
#        scripts/setup_horovod.sh --fill-carry [PYTHON]  fill the carry folder (see above)
# Env:   LHC_CACHE (default ~/.cache/lossless_hc); HOROVOD_CARRY (default .horovod-carry in the repository;
#        gitignored); HOROVOD_WITHOUT_MPI=1: Gloo only (no OpenMPI needed; `horovodrun --gloo` launches it)
set -euo pipefail
HVD_VERSION=0.28.1
ROOT=$(cd "$(dirname "$0")/.." && pwd)
CACHE=${LHC_CACHE:-$HOME/.cache/lossless_hc}
CARRY=${HOROVOD_CARRY:-$ROOT/.horovod-carry}
SDIST=horovod-$HVD_VERSION.tar.gz
WORKDIRS=()
trap 'rm -rf "${WORKDIRS[@]}"' EXIT

# wheel_key PYTHON: the cache folder's name for a wheel built against PYTHON's torch (and, with
# HOROVOD_WITHOUT_MPI=1, without MPI).
wheel_key() {
  local key
  key=$("$1" -c "import sys, torch
cuda = torch.version.cuda
print(f'horovod-$HVD_VERSION-torch{torch.__version__.split(\"+\")[0]}' + (f'_cuda{cuda}' if cuda else '_cpu')
      + f'-cp{sys.version_info[0]}{sys.version_info[1]}')")
  [ "${HOROVOD_WITHOUT_MPI:-0}" = 1 ] && key+=-gloo
  echo "$key"
}

# sdist DIR: Horovod's sdist into DIR, from the carry folder when it is there.
sdist() {
  if [ -f "$CARRY/$SDIST" ]; then
    cp "$CARRY/$SDIST" "$1/"
  else
    "$PY" -m pip download --quiet --no-binary :all: --no-deps "horovod==$HVD_VERSION" -d "$1"
  fi
}

# build_wheel PYTHON DEST: patch and build the wheel into DEST.
build_wheel() {
  local py=$1 dest=$2 work src
  work=$(mktemp -d)
  WORKDIRS+=("$work")
  PY=$py sdist "$work"
  tar -xzf "$work/$SDIST" -C "$work"
  src="$work/horovod-$HVD_VERSION"
  for f in "$src/CMakeLists.txt" "$src/horovod/torch/CMakeLists.txt"; do
    grep -q 'set(CMAKE_CXX_STANDARD 14)' "$f" || { echo "setup_horovod: unexpected $f" >&2; exit 1; }
    sed -i 's/set(CMAKE_CXX_STANDARD 14)/set(CMAKE_CXX_STANDARD 17)/' "$f"
  done
  grep -q "else 'RelWithDebInfo'" "$src/setup.py" || { echo "setup_horovod: unexpected $src/setup.py" >&2; exit 1; }
  sed -i "s/else 'RelWithDebInfo'/else 'Release'/" "$src/setup.py"
  local with_mpi=(HOROVOD_WITH_MPI=1) cuda=()
  [ "${HOROVOD_WITHOUT_MPI:-0}" = 1 ] && with_mpi=(HOROVOD_WITHOUT_MPI=1)
  if [ -n "$("$py" -c 'import torch; print(torch.version.cuda or "")')" ]; then
    local archs=${LHC_CUDA_ARCHS:-80;90}
    cuda=(HOROVOD_BUILD_CUDA_CC_LIST="${HOROVOD_BUILD_CUDA_CC_LIST:-${archs//;/,}}")
    # CMake's FindCUDAToolkit takes the toolkit's root from nvcc's folder: name it where nvcc on PATH is a
    # wrapper outside the toolkit (/usr/local/bin/nvcc on the development machine), and so does torch (the
    # CUDA runtime library Horovod links is found under its CUDA_HOME).
    local home=${CUDA_HOME:-/usr/local/cuda}
    [ -x "$home/bin/nvcc" ] && cuda+=(HOROVOD_CUDA_HOME="$home" CUDAToolkit_ROOT="$home" CUDA_HOME="$home")
  fi
  echo "setup_horovod: building Horovod $HVD_VERSION (PyTorch, Gloo, ${with_mpi[*]}${cuda:+, CUDA ${cuda[*]}}; about" \
       "4-6 minutes on 2 cores)"
  # setup.py imports torch and packaging: build in PYTHON's environment, not an isolated one.
  "$py" -c "import packaging" 2>/dev/null || "$py" -m pip install --quiet packaging
  env HOROVOD_WITH_PYTORCH=1 HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1 HOROVOD_WITH_GLOO=1 \
    "${with_mpi[@]}" "${cuda[@]}" MAKEFLAGS="-j$(nproc)" \
    "$py" -m pip wheel --quiet --no-build-isolation --no-deps "$src" -w "$work/dist"
  mkdir -p "$dest"
  cp "$work"/dist/horovod-*.whl "$dest/"
}

if [ "${1:-}" = "--fill-carry" ]; then
  mkdir -p "$CARRY"
  PY=${2:-python3}
  [ -f "$CARRY/$SDIST" ] || sdist "$CARRY"
  if [ -n "${2:-}" ]; then
    export HOROVOD_WITHOUT_MPI=${HOROVOD_WITHOUT_MPI:-1}   # the GPU machine has no MPI
    key=$(wheel_key "$2")
    ls "$CARRY/$key"/horovod-*.whl >/dev/null 2>&1 || build_wheel "$2" "$CARRY/$key"
  fi
  du -sh "$CARRY"/*
  exit 0
fi

PY=${1:?usage: setup_horovod.sh PYTHON | --fill-carry [PYTHON]}
if "$PY" -c "import horovod, horovod.torch" 2>/dev/null \
   && [ "$("$PY" -c 'import horovod; print(horovod.__version__)')" = "$HVD_VERSION" ]; then
  exit 0
fi

# Debian's OpenMPI: needed both to build the MPI controller and to launch with mpirun.
if [ "${HOROVOD_WITHOUT_MPI:-0}" != 1 ] && { ! command -v mpicxx >/dev/null || ! command -v mpirun >/dev/null; }; then
  if [ "$(id -u)" != 0 ]; then
    echo "setup_horovod: OpenMPI is missing; install openmpi-bin and libopenmpi-dev (needs root)," \
         "or set HOROVOD_WITHOUT_MPI=1 for Gloo only" >&2
    exit 1
  fi
  echo "setup_horovod: installing Debian's OpenMPI (openmpi-bin libopenmpi-dev)"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq >/dev/null
  apt-get install -y -qq --no-install-recommends openmpi-bin libopenmpi-dev >/dev/null
fi

# shellcheck source=scripts/_carried_wheel.sh
source "$ROOT/scripts/_carried_wheel.sh"
KEY=$(wheel_key "$PY")
wheel=$(ls "$CACHE/$KEY"/horovod-*.whl 2>/dev/null | head -n1 || true)
CARRIED=0
take_carried_wheel HOROVOD horovod || true
if [ -z "$wheel" ]; then
  build_wheel "$PY" "$CACHE/$KEY"
  wheel=$(ls "$CACHE/$KEY"/horovod-*.whl | head -n1)
fi

if "$PY" -c "import cloudpickle, psutil, yaml, packaging" 2>/dev/null; then
  # Its run-time dependencies are there (the GPU machine's image, a second set-up): no index needed.
  "$PY" -m pip install --quiet --no-index --no-deps --force-reinstall "$wheel"
else
  # From the index; torch is pinned so nothing can replace the installed build.
  "$PY" -m pip install --quiet "$wheel" "torch==$("$PY" -c 'import torch; print(torch.__version__)')"
fi
import_or_rebuild HOROVOD "import horovod.torch"
