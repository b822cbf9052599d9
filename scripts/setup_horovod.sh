#!/usr/bin/env bash
# Build Horovod 0.28.1 (PyTorch + Gloo + MPI) into the project venv, caching the wheel outside the repo.
#
# Horovod's last release forces C++14, which torch >= 2.1 headers reject; upstream fixed this only on
# master (PR #3998). We take the release sdist from the package index and change the two
# CMAKE_CXX_STANDARD lines to 17 at build time (docs: ../shared/reference/RESEARCH.md section 4).
# It is built as CMake's Release (-O3, as upstream's RelWithDebInfo, without -g): a quarter less build
# time and a 1 MB wheel instead of 20 MB (debug information for Horovod's own C++, which we never debug).
# The wheel is keyed by Horovod, torch and Python versions, so a second set-up takes seconds.
#
# Usage: scripts/setup_horovod.sh PYTHON    (the venv's python)
# Env:   LHC_CACHE (default ~/.cache/lossless_hc)
set -euo pipefail
PY=${1:?usage: setup_horovod.sh PYTHON}
HVD_VERSION=0.28.1
CACHE=${LHC_CACHE:-$HOME/.cache/lossless_hc}

if "$PY" -c "import horovod, horovod.torch" 2>/dev/null \
   && [ "$("$PY" -c 'import horovod; print(horovod.__version__)')" = "$HVD_VERSION" ]; then
  exit 0
fi

# Debian's OpenMPI: needed both to build the MPI controller and to launch with mpirun.
if ! command -v mpicxx >/dev/null || ! command -v mpirun >/dev/null; then
  if [ "$(id -u)" != 0 ]; then
    echo "setup_horovod: OpenMPI is missing; install openmpi-bin and libopenmpi-dev (needs root)" >&2
    exit 1
  fi
  echo "setup_horovod: installing Debian's OpenMPI (openmpi-bin libopenmpi-dev)"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq >/dev/null
  apt-get install -y -qq --no-install-recommends openmpi-bin libopenmpi-dev >/dev/null
fi

TORCH_VERSION=$("$PY" -c 'import torch; print(torch.__version__.replace("+", "_"))')
PY_TAG=$("$PY" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
WHEEL_DIR="$CACHE/horovod-$HVD_VERSION-torch$TORCH_VERSION-$PY_TAG"
mkdir -p "$WHEEL_DIR"
wheel=$(ls "$WHEEL_DIR"/horovod-*.whl 2>/dev/null | head -n1 || true)

if [ -z "$wheel" ]; then
  echo "setup_horovod: building Horovod $HVD_VERSION (PyTorch, Gloo, MPI; about 4-6 minutes on 2 cores)"
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
  "$PY" -m pip download --quiet --no-binary :all: --no-deps "horovod==$HVD_VERSION" -d "$work"
  tar -xzf "$work/horovod-$HVD_VERSION.tar.gz" -C "$work"
  src="$work/horovod-$HVD_VERSION"
  for f in "$src/CMakeLists.txt" "$src/horovod/torch/CMakeLists.txt"; do
    grep -q 'set(CMAKE_CXX_STANDARD 14)' "$f" || { echo "setup_horovod: unexpected $f" >&2; exit 1; }
    sed -i 's/set(CMAKE_CXX_STANDARD 14)/set(CMAKE_CXX_STANDARD 17)/' "$f"
  done
  grep -q "else 'RelWithDebInfo'" "$src/setup.py" || { echo "setup_horovod: unexpected $src/setup.py" >&2; exit 1; }
  sed -i "s/else 'RelWithDebInfo'/else 'Release'/" "$src/setup.py"
  # setup.py imports torch and packaging: build in the venv, not an isolated environment.
  "$PY" -m pip install --quiet packaging
  HOROVOD_WITH_PYTORCH=1 HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1 \
  HOROVOD_WITH_GLOO=1 HOROVOD_WITH_MPI=1 MAKEFLAGS="-j$(nproc)" \
    "$PY" -m pip wheel --quiet --no-build-isolation --no-deps "$src" -w "$work/dist"
  cp "$work"/dist/horovod-*.whl "$WHEEL_DIR/"
  wheel=$(ls "$WHEEL_DIR"/horovod-*.whl | head -n1)
fi

# Its runtime dependencies (cloudpickle, psutil, pyyaml, packaging) come from the index; torch is
# pinned so nothing can replace the CPU build.
"$PY" -m pip install --quiet "$wheel" "torch==$("$PY" -c 'import torch; print(torch.__version__)')"
"$PY" -c "import horovod.torch" || { echo "setup_horovod: horovod.torch does not import" >&2; exit 1; }
