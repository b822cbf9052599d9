#!/usr/bin/env bash
# Fill .horovod-carry/ and .byteps-carry/ for the GPU machine, which has no network: the engines' sdists,
# libnuma's debs, and a Horovod and a BytePS wheel built here against that machine's Python and torch.
#
#   bash scripts/fill_gpu_carry.sh        (then, on the GPU machine, with carry [".horovod-carry", ".byteps-carry"]:
#                                          LHC_CUDA_ARCHS=90 bash scripts/gpu_session.sh build horovod byteps)
#
# The wheels are built in a throwaway venv (GPU_TORCH_VENV, default /tmp/gpu-torch-venv) of Python 3.12 with
# PyPI's torch==2.11.0, which is the GPU image's build (2.11.0+cu130), and its nvidia-* wheels: about 4.6 GB,
# never the project's venv. Each engine's script skips what the carry folder already holds; where the GPU
# machine's torch turns out to differ (another version or CUDA), the install there builds from the sdist.
# About 10 minutes on 2 cores (Horovod ~3, BytePS ~4.5, the download ~2).
#
# Env: PYTHON312 (default: the first Python 3.12 that runs, on PATH or pyenv's), GPU_TORCH (default 2.11.0),
#      GPU_TORCH_VENV, LHC_CUDA_ARCHS (default 90: the H200's)
set -euo pipefail
cd "$(dirname "$0")/.."
# The first Python 3.12 that runs: pyenv's shim on PATH exists but fails where 3.12 is not the global version.
PY312=${PYTHON312:-}
if [ -z "$PY312" ]; then
  for c in $(command -v python3.12 2>/dev/null) "$HOME"/.pyenv/versions/3.12*/bin/python3.12; do
    "$c" -c "import sys; sys.exit(sys.version_info[:2] != (3, 12))" 2>/dev/null && { PY312=$c; break; }
  done
fi
[ -n "$PY312" ] && [ -x "$PY312" ] || { echo "fill_gpu_carry: no Python 3.12 (set PYTHON312)" >&2; exit 1; }
VENV=${GPU_TORCH_VENV:-/tmp/gpu-torch-venv}
TORCH=${GPU_TORCH:-2.11.0}
if ! "$VENV/bin/python" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$TORCH' or not torch.version.cuda)" \
     2>/dev/null; then
  "$PY312" -m venv "$VENV"
  "$VENV/bin/pip" install --quiet "torch==$TORCH" packaging wheel "setuptools<82" cloudpickle psutil pyyaml
fi
"$VENV/bin/python" -c "import torch; print('fill_gpu_carry: building against torch', torch.__version__, 'CUDA', torch.version.cuda)"
LHC_CUDA_ARCHS=${LHC_CUDA_ARCHS:-90} bash scripts/setup_horovod.sh --fill-carry "$VENV/bin/python"
MAX_JOBS=${MAX_JOBS:-$(nproc)} bash scripts/setup_byteps.sh --fill-carry "$VENV/bin/python"
