#!/usr/bin/env bash
# One call on a lent GPU machine: install BytePS with the patched recipe and run the BytePS tests.
#
#   bash scripts/byteps_gpu_session.sh          (from the repository root; the device tool's `run`,
#                                                with carry: [".byteps-carry"])
#
# The GPU machine has python3 (3.12) with a CUDA build of torch (2.11, CUDA 13), nvcc and the
# nvidia-nccl wheel, and no network: fill .byteps-carry/ here first (scripts/fill_gpu_carry.sh: the BytePS
# sdist, libnuma debs and a wheel built against that machine's Python and torch, which the install there
# takes instead of building).
# Steps, each logged to $OUT (the tool's output folder;
# ./byteps-session-out when unset):
#   build     lossless_hc's extension with CUDA (LHC_CUDA=1 setup.py build_ext --inplace)   build.log
#   byteps    scripts/setup_byteps.sh python3 (patch + build + install BytePS)   build.log, byteps-build.log
#   test      pytest tests/test_plugins_byteps*.py tests/test_byteps_gpu.py: the CPU tests and the GPU
#             run (1 scheduler, 1 server, 2 workers on the one GPU; lossless vs uncompressed; server
#             logs)     test.log
#             BytePS's own logs of the run: bps-logs/{scheduler,server0,worker0,worker1}.log
# summary.txt has one line per step; under the device tool (OUT set) the rest ends up in
# byteps-session.tgz, with bps-logs/rank{0,1}.json (each run's losses and bytes per step).
# The whole call keeps within LHC_SESSION_SECONDS (default 570).
set -uo pipefail
cd "$(dirname "$0")/.."
# The device tool brings back at most 8 files from its $OUT: there, everything but summary.txt is packed
# into one archive at the end (session_pack in _session_step.sh).
PACK=${OUT:+1}
OUT=${OUT:-$PWD/byteps-session-out}
mkdir -p "$OUT" "$OUT/bps-logs"
PY=${PY:-python3}
export PYTHONUNBUFFERED=1
export LHC_CUDA_ARCHS=${LHC_CUDA_ARCHS:-90}   # the H200's: one architecture builds in half the time
START=$(date +%s)
DEADLINE=$((START + ${LHC_SESSION_SECONDS:-570}))
SUMMARY="$OUT/summary.txt"
FAILED=0

# shellcheck source=scripts/_session_step.sh
source scripts/_session_step.sh   # the working directory is the repository root (cd above)

{
  date -u
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true
  nvcc --version | tail -2 || true
  "$PY" -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda)"
  ls -la .byteps-carry || echo "no .byteps-carry: run scripts/setup_byteps.sh --fill-carry here and carry it"
} >> "$OUT/build.log" 2>&1

# lossless_hc.plugins is plugins/ (setup.py maps it when installed); without installing, a link does it.
[ -e lossless_hc/plugins ] || ln -s ../plugins lossless_hc/plugins
# Built already when gpu_session.sh's build step ran first in this call: rebuilding in place would rewrite
# the modules under a step running beside this one (`horovod+byteps`).
if "$PY" -c "import lossless_hc._C_cuda" 2>/dev/null; then
  echo "build lossless_hc (CUDA): already built in this call" | tee -a "$SUMMARY"
else
  step "build lossless_hc (CUDA)" build.log 200 env LHC_CUDA=1 "$PY" setup.py build_ext --inplace --parallel 8
fi
step "build + install BytePS" build.log 300 env BYTEPS_BUILD_DIR=/tmp/byteps-build \
  BYTEPS_BUILD_LOG="$OUT/byteps-build.log" bash scripts/setup_byteps.sh "$PY"
if "$PY" -c "import byteps.torch" >/dev/null 2>&1; then
  # The workers' own timeout (at most 240 s: a healthy run takes well under a minute) ends a minute before the
  # test's own limit, and that before the call's deadline: a hang still leaves its logs and stacks.
  # LHC_BYTEPS_TESTS=tests/test_byteps_gpu.py: the GPU run alone (the CPU tests ran in an earlier call).
  tests=${LHC_BYTEPS_TESTS:-$(echo tests/test_plugins_byteps*.py) tests/test_byteps_gpu.py}
  step "pytest $tests" test.log $((DEADLINE - $(date +%s) - 15)) env PYTHONPATH="$PWD" \
    LHC_BYTEPS_LOG_DIR="$OUT/bps-logs" LHC_BYTEPS_TIMEOUT=$(( (t = DEADLINE - $(date +%s) - 80) > 240 ? 240 : (t > 30 ? t : 30) )) \
    "$PY" -m pytest -q -rs -p no:cacheprovider $tests
else
  echo "pytest: SKIPPED (byteps.torch does not import; see byteps-build.log)" | tee -a "$SUMMARY"; FAILED=1
fi

echo
echo "== summary ($(( $(date +%s) - START ))s)"
cat "$SUMMARY"
grep -hE "passed|failed|error|SKIPPED" "$OUT/test.log" 2>/dev/null | tail -6
[ -n "$PACK" ] && session_pack byteps-session
exit $FAILED
