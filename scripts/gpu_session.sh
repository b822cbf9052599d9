#!/usr/bin/env bash
# One call on a lent GPU machine: everything the CUDA backend needs checked and measured there.
#
#   bash scripts/gpu_session.sh [STEP ...]      STEP: build test thcbench bench1 sanitize bench5 thcsanitize
#                                               (default: build test thcbench bench1 sanitize bench5, in order)
#   THC's CUDA backend in one call: bash scripts/gpu_session.sh build test thcbench thcsanitize
#
# Run from the repository root on the GPU machine (the device tool: `run` with this command; the
# machine has python3 with torch (CUDA), CuPy, pybind11, pytest, hypothesis and nvcc, no network).
#   build     LHC_CUDA=1 python3 setup.py build_ext --inplace: lossless_hc._C and _C_cuda (nvcc missing
#             is an error), and a look at the GPU (nvidia-smi, versions)
#   test      pytest -m gpu (tests/test_cuda.py and tests/test_cuda_thc.py, both the compiled and the
#             CuPy/NVRTC kernels) and the source-consistency tests
#   thcbench  python -m lossless_hc.bench thc --device cuda --numel 67108864 --workers 8: THC encode/decode
#             time on the GPU, NMSE, and every payload and output checked bit for bit against CPU codecs
#             run in lockstep (exit status 1 if any differs)
#   thcsanitize  compute-sanitizer memcheck and racecheck on THC's CUDA tests (both kernel paths)
#   bench1    python -m lossless_hc.bench codec --device cuda --numel 134217728 --density 0.01 --workers 8
#   sanitize  compute-sanitizer memcheck (and racecheck) on the fuzzing and overflow tests
#   bench5    the same benchmark at density 0.05
# Logs go to $OUT (the device tool's output folder; ./gpu-session-out when unset), at most 8 files:
# summary.txt, build.log, test.log, sanitize.log, bench.log, bench-0.01.json, bench-0.05.json, thc-bench.json
# (thcbench writes its text to bench.log).
# The whole run keeps within LHC_SESSION_SECONDS (default 560 s, under the tool's 10-minute limit):
# a step that would not fit is skipped and says so; run the remaining steps in a second call.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-session-out}
mkdir -p "$OUT"
PY=${PY:-python3}
export PYTHONUNBUFFERED=1
START=$(date +%s)
DEADLINE=$((START + ${LHC_SESSION_SECONDS:-560}))
SUMMARY="$OUT/summary.txt"
STEPS=("$@")
[ ${#STEPS[@]} -eq 0 ] && STEPS=(build test thcbench bench1 sanitize bench5)
FAILED=0
SANITIZER=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer /usr/local/cuda-*/bin/compute-sanitizer \
  2>/dev/null | head -1)
SANITIZER=${SANITIZER:-compute-sanitizer}

SKIP_HINT='bash scripts/gpu_session.sh $name'
# shellcheck source=scripts/_session_step.sh
source scripts/_session_step.sh   # the working directory is the repository root (cd above)

bench() {
  local density=$1
  step "bench density $density" bench.log 200 "$PY" -m lossless_hc.bench codec --device cuda --numel 134217728 \
    --density "$density" --workers 8 --json "$OUT/bench-$density.json"
}

for s in "${STEPS[@]}"; do
  case "$s" in
    build)
      {
        date -u
        nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv || true
        nvcc --version | tail -2
        "$PY" -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0))"
        "$PY" -c "import cupy; print('cupy', cupy.__version__)" || echo "cupy: not importable (the CuPy path will be skipped)"
        "$PY" -c "import hypothesis, pybind11; print('hypothesis', hypothesis.__version__, 'pybind11', pybind11.__version__)"
      } >> "$OUT/build.log" 2>&1
      step build build.log 300 env LHC_CUDA=1 "$PY" setup.py build_ext --inplace --parallel 8
      step "import" build.log 60 "$PY" -c "import lossless_hc._C_cuda as m, lossless_hc._C; print('kernels:', len(m.kernel_names()), 'SMs:', m.multiprocessors())"
      ;;
    test)
      step "pytest -m gpu" test.log 300 "$PY" -m pytest -q -m gpu tests -rs -p no:cacheprovider
      step "source consistency" test.log 60 "$PY" -m pytest -q tests/test_cuda_sources.py tests/test_header_cuda.py -p no:cacheprovider
      ;;
    sanitize)
      step "memcheck" sanitize.log 150 "$SANITIZER" --tool memcheck --error-exitcode 99 --print-limit 20 \
        "$PY" -m pytest -q -x -p no:cacheprovider tests/test_cuda.py \
        -k "fuzz or every_key or wide_blocks or failure_reports or multilevel_failures or (bitwise and compiled and bloom and 16)"
      step "racecheck" sanitize.log 90 "$SANITIZER" --tool racecheck --error-exitcode 99 --print-limit 20 \
        "$PY" -m pytest -q -x -p no:cacheprovider tests/test_cuda.py -k "wide_blocks or (encode_matches_cpu and bloom-b1 and float32 and compiled)"
      ;;
    thcbench)
      step "thc bench" bench.log 240 "$PY" -m lossless_hc.bench thc --device cuda --numel 67108864 --workers 8 \
        --json "$OUT/thc-bench.json"
      ;;
    thcsanitize)
      step "thc memcheck" sanitize.log 150 "$SANITIZER" --tool memcheck --error-exitcode 99 --print-limit 20 \
        "$PY" -m pytest -q -x -p no:cacheprovider tests/test_cuda_thc.py \
        -k "compiled and (b32 or tiny or b65536 or int64 or corrupted or worst_case or non_finite)"
      step "thc racecheck" sanitize.log 90 "$SANITIZER" --tool racecheck --error-exitcode 99 --print-limit 20 \
        "$PY" -m pytest -q -x -p no:cacheprovider tests/test_cuda_thc.py -k "compiled and steps and (b1024 or b4096 or b65536)"
      ;;
    bench1) bench 0.01 ;;
    bench5) bench 0.05 ;;
    *) echo "unknown step $s (build test thcbench bench1 sanitize bench5 thcsanitize)" | tee -a "$SUMMARY"; FAILED=1 ;;
  esac
done

# The short table last: the tool's reply carries the end of the output.
echo
echo "== summary ($(( $(date +%s) - START ))s)"
cat "$SUMMARY"
grep -hE "passed|failed|error" "$OUT/test.log" 2>/dev/null | tail -4
grep -hE "ERROR SUMMARY|RACECHECK SUMMARY" "$OUT/sanitize.log" 2>/dev/null
grep -hE "^(command|device|device-to-device|encode \(|decode \(|decode ok|support keys|max abs error|bitwise)" \
  "$OUT/bench.log" 2>/dev/null
grep -hE "^(encode, one worker|decode of the aggregate|encode\(out=\)|bits per coordinate|NMSE vs the encoded|same bits as the CPU)" \
  "$OUT/bench.log" 2>/dev/null
exit $FAILED
