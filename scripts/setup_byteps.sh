#!/usr/bin/env bash
# Install BytePS 0.2.5.post15 (PyTorch plugin, CUDA + NCCL) into PYTHON's environment, patched at
# install time for current PyTorch and CUDA (docs/BYTEPS.md lists the patches and why).
#
#   scripts/setup_byteps.sh PYTHON              build (or reuse the cached or carried wheel) and install
#   scripts/setup_byteps.sh --fill-carry [PYTHON]  put what an offline machine needs into .byteps-carry/;
#                                               given a PYTHON whose torch is the GPU machine's (the same
#                                               version, CUDA and Python), also a wheel built against it
#
# BytePS's last release does not build against PyTorch >= 1.11 as shipped. We take the sdist from
# the package index (or from the carry folder, for the GPU machine, which has no network) and apply
# scripts/patch_byteps.py: C++17/20 as torch's headers require, no TH/THC, C10_CUDA_CHECK,
# include_paths('cuda'), BYTEPS_TORCH_VERSION instead of a macro that clashes with torch's,
# isIntegralType(t, true), BYTEPS_SHM_PREFIX for several workers on one host, and ps-lite building
# the zeromq bundled in the sdist instead of downloading it. NCCL comes from the nvidia-nccl wheel
# that CUDA builds of torch depend on (linked as a shared library, rpath set), CUDA from CUDA_HOME.
#
# Env: BYTEPS_CARRY    carry folder (default: .byteps-carry in the repository; gitignored)
#      CUDA_HOME       CUDA toolkit (default /usr/local/cuda; nvcc is not needed, its headers are)
#      BYTEPS_NCCL_HOME  NCCL with include/ and lib/ (default: PYTHON's nvidia-nccl wheel)
#      LHC_CACHE       the built wheel is cached here (default ~/.cache/lossless_hc)
#      BYTEPS_BUILD_DIR  build here and keep the tree (default: a temporary folder, removed)
#      BYTEPS_BUILD_LOG  the build's full output (default: BUILD_DIR/build.log, printed on failure)
#      MAX_JOBS        parallel compile jobs for ps-lite and zeromq (default: nproc)
#      BYTEPS_SYSROOT  where the carried libnuma debs are unpacked when numa.h is missing (default:
#                      LHC_CACHE/byteps-sysroot; kept: the library is needed at run time). A carried
#                      wheel is built against the debs unpacked in /tmp/byteps-sysroot (its run path),
#                      and installing it unpacks them there again.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BPS_VERSION=0.2.5.post15
CARRY=${BYTEPS_CARRY:-$ROOT/.byteps-carry}
SDIST=byteps-$BPS_VERSION.tar.gz

# wheel_key PYTHON: the folder (in the cache or the carry folder) of a wheel built against PYTHON's torch and
# the patches as they are now (a cached or carried wheel from an older patch set is never taken).
PATCH_TAG=$(sha256sum "$ROOT/scripts/patch_byteps.py" | cut -c1-8)
wheel_key() {
  "$1" -c "import sys, torch; print(f'byteps-$BPS_VERSION-torch{torch.__version__.replace(\"+\", \"_\")}-'
                                  f'cp{sys.version_info[0]}{sys.version_info[1]}-patch$PATCH_TAG')"
}

if [ "${1:-}" = "--fill-carry" ]; then
  # What the GPU machine cannot fetch: the sdist (it bundles ps-lite and zeromq), and libnuma's
  # headers and library as Debian packages in case its image lacks them (unpacked, not installed).
  mkdir -p "$CARRY"
  [ -f "$CARRY/$SDIST" ] || python3 -m pip download --quiet --no-deps --no-binary :all: "byteps==$BPS_VERSION" -d "$CARRY"
  if command -v apt-get >/dev/null; then
    (cd "$CARRY" && apt-get download libnuma1 libnuma-dev >/dev/null 2>&1) \
      || echo "setup_byteps: could not download libnuma debs (only needed where numa.h is missing)" >&2
  fi
  if [ -n "${2:-}" ]; then
    # The wheel for the GPU machine: built against the carried libnuma (a run path the install there
    # recreates), cached under its key in the carry folder, where the install there looks first.
    key=$(wheel_key "$2")
    if ! ls "$CARRY/$key"/byteps-*.whl >/dev/null 2>&1; then
      BYTEPS_SYSROOT=/tmp/byteps-sysroot BYTEPS_NUMA_FROM_DEBS=1 LHC_CACHE="$CARRY/.build-cache" bash "$0" --wheel-only "$2"
      mkdir -p "$CARRY/$key" && mv "$CARRY/.build-cache/$key"/byteps-*.whl "$CARRY/$key/" && rm -rf "$CARRY/.build-cache"
    fi
    # A wheel built with another patch set is never taken (its key differs): not carried either.
    for d in "$CARRY"/byteps-*-patch*; do
      [ -d "$d" ] && [ "${d##*-patch}" != "$PATCH_TAG" ] && rm -rf "$d"
    done
  fi
  du -sh "$CARRY"/*
  exit 0
fi
WHEEL_ONLY=0
[ "${1:-}" = "--wheel-only" ] && { WHEEL_ONLY=1; shift; }

PY=${1:?usage: setup_byteps.sh PYTHON | --fill-carry}
CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
CACHE=${LHC_CACHE:-$HOME/.cache/lossless_hc}
JOBS=${MAX_JOBS:-$(nproc)}

KEY=$(wheel_key "$PY")
# The key of the wheel installed, in a file beside the package (written at the end): one from an older
# patch set, or built against another torch, is replaced.
KEY_FILE="os.path.join(os.path.dirname(byteps.__file__), 'LHC_WHEEL_KEY')"
if [ "$WHEEL_ONLY" = 0 ] && "$PY" -c "import byteps.torch" 2>/dev/null \
   && [ "$("$PY" -c "import byteps, os; print(open($KEY_FILE).read())" 2>/dev/null)" = "$KEY" ]; then
  echo "setup_byteps: byteps $BPS_VERSION already importable ($KEY)"
  exit 0
fi
WHEEL_DIR="$CACHE/$KEY"
mkdir -p "$WHEEL_DIR"
wheel=$(ls "$WHEEL_DIR"/byteps-*.whl 2>/dev/null | head -n1 || true)
CARRIED=0
# shellcheck source=scripts/_carried_wheel.sh
source "$ROOT/scripts/_carried_wheel.sh"
if [ "$WHEEL_ONLY" = 0 ] && take_carried_wheel BYTEPS byteps; then
  BYTEPS_SYSROOT=/tmp/byteps-sysroot   # its run path to libnuma (--fill-carry)
  BYTEPS_NUMA_FROM_DEBS=1
fi

# libnuma: BytePS links -lnuma. Where the headers are missing, unpack the carried debs into a sysroot
# that stays (the library is needed at run time too).
SYSROOT=${BYTEPS_SYSROOT:-$CACHE/byteps-sysroot}
if [ "${BYTEPS_NUMA_FROM_DEBS:-0}" = 1 ] || ! echo '#include <numa.h>' | ${CXX:-g++} -E -x c++ - >/dev/null 2>&1; then
  debs=$(ls "$CARRY"/libnuma*.deb 2>/dev/null || true)
  [ -n "$debs" ] || { echo "setup_byteps: numa.h is missing and $CARRY has no libnuma debs (--fill-carry)" >&2; exit 1; }
  mkdir -p "$SYSROOT"
  for d in $debs; do dpkg -x "$d" "$SYSROOT"; done
  NUMA_LIB=$(dirname "$(ls "$SYSROOT"/usr/lib/*/libnuma.so.1 | head -n1)")
  ln -sf libnuma.so.1 "$NUMA_LIB/libnuma.so"
  export CPATH="$SYSROOT/usr/include${CPATH:+:$CPATH}"
  export LIBRARY_PATH="$NUMA_LIB${LIBRARY_PATH:+:$LIBRARY_PATH}"
  export LDFLAGS="${LDFLAGS:-} -Wl,-rpath,$NUMA_LIB"
  echo "setup_byteps: libnuma from the carried debs ($NUMA_LIB)"
fi

if [ -z "$wheel" ]; then
  if [ -n "${BYTEPS_BUILD_DIR:-}" ]; then
    work=$BYTEPS_BUILD_DIR
    rm -rf "$work" && mkdir -p "$work"
  else
    work=$(mktemp -d)
    trap 'rm -rf "$work"' EXIT
  fi
  LOG=${BYTEPS_BUILD_LOG:-$work/build.log}
  if [ -f "$CARRY/$SDIST" ]; then
    cp "$CARRY/$SDIST" "$work/"
  else
    "$PY" -m pip download --quiet --no-deps --no-binary :all: "byteps==$BPS_VERSION" -d "$work"
  fi
  tar -xzf "$work/$SDIST" -C "$work"
  src="$work/byteps-$BPS_VERSION"

  # torch's headers say which C++ standard they need (torch 2.14's ATen.h: C++20).
  CXX_STD=$("$PY" -c 'import os, torch
h = open(os.path.join(os.path.dirname(torch.__file__), "include", "ATen", "ATen.h")).read()
print(20 if "202002L" in h else 17)')
  echo "setup_byteps: patching BytePS for $KEY (C++$CXX_STD)"
  "$PY" "$ROOT/scripts/patch_byteps.py" "$src" "$CXX_STD"

  # NCCL: the wheel torch depends on ships include/ and lib/libnccl.so.2 (no unversioned .so to link).
  if [ -z "${BYTEPS_NCCL_HOME:-}" ]; then
    nccl=$("$PY" -c 'import nvidia.nccl as n; print(list(n.__path__)[0])' 2>/dev/null || true)
    [ -n "$nccl" ] && [ -f "$nccl/include/nccl.h" ] \
      || { echo "setup_byteps: no NCCL (set BYTEPS_NCCL_HOME; CUDA torch wheels bring nvidia-nccl)" >&2; exit 1; }
    mkdir -p "$work/nccl/lib"
    ln -s "$nccl/include" "$work/nccl/include"
    ln -s "$nccl/lib/libnccl.so.2" "$work/nccl/lib/libnccl.so"
    export BYTEPS_NCCL_HOME="$work/nccl"
    export LDFLAGS="${LDFLAGS:-} -Wl,-rpath,$nccl/lib"
  fi
  [ -f "$CUDA_HOME/include/cuda_runtime_api.h" ] || { echo "setup_byteps: no CUDA headers in $CUDA_HOME" >&2; exit 1; }

  echo "setup_byteps: building (log: $LOG)"
  set +e
  # ps-lite and its zeromq first, as setup.py would (it skips them when libps.a exists), but without
  # our LDFLAGS: make exports an environment LDFLAGS, ps-lite appends -lzmq, and zeromq's configure
  # then cannot link its own test program.
  ABI=$("$PY" -c 'import torch; print(int(torch.compiled_with_cxx11_abi()))')
  ( cd "$src/3rdparty/ps-lite" && env -u LDFLAGS -u CPATH make -j"$JOBS" ps ADD_CFLAGS="-D_GLIBCXX_USE_CXX11_ABI=$ABI" ) \
    > "$LOG" 2>&1
  rc=$?
  if [ $rc -eq 0 ]; then
    ( cd "$src" && \
      BYTEPS_WITHOUT_TENSORFLOW=1 BYTEPS_WITHOUT_MXNET=1 BYTEPS_WITH_PYTORCH=1 BYTEPS_NCCL_LINK=SHARED \
      BYTEPS_CUDA_HOME="$CUDA_HOME" CUDA_HOME="$CUDA_HOME" PATH="$CUDA_HOME/bin:$PATH" MAX_JOBS="$JOBS" \
      "$PY" -m pip wheel --no-build-isolation --no-deps -v . -w "$work/dist" ) >> "$LOG" 2>&1
    rc=$?
  fi
  set -e
  if [ $rc -ne 0 ]; then
    echo "setup_byteps: the build failed (rc=$rc); the end of $LOG:" >&2
    grep -n -E "error|Error" "$LOG" | head -40 >&2 || true
    tail -40 "$LOG" >&2
    exit $rc
  fi
  cp "$work"/dist/byteps-*.whl "$WHEEL_DIR/"
  wheel=$(ls "$WHEEL_DIR"/byteps-*.whl | head -n1)
fi

[ "$WHEEL_ONLY" = 1 ] && exit 0
"$PY" -m pip install --quiet --no-deps --no-index --force-reinstall "$wheel"
import_or_rebuild BYTEPS "import importlib.metadata as m, byteps.torch; print('setup_byteps: byteps', m.version('byteps'), 'imports')"
"$PY" -c "import byteps, os, sys; open($KEY_FILE, 'w').write(sys.argv[1])" "$KEY"
