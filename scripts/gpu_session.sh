#!/usr/bin/env bash
# One call on a lent GPU machine: everything the CUDA backend needs checked and measured there.
#
#   bash scripts/gpu_session.sh [STEP ...]      STEP: build test horovod thcbench topkbench bench1 bench1b bench1m
#                                               bench1v bench5 bench5b bench5m planbench sanitize thcsanitize topksanitize,
#                                               or several
#                                               joined by '+' (run at the same time, e.g. test+sanitize: for
#                                               checks, never for timings); default: the whole issue-#22 run,
#                                               build test+sanitize+thcsanitize+topksanitize bench1v bench1
#                                               thcbench topkbench bench1m bench5b bench5m planbench: the checks first
#                                               (kernels changed since the last GPU run have only run in
#                                               emulation), then the benchmarks while the call's time lasts;
#                                               the summary names the skipped ones, for a second call while
#                                               the machine is warm (its build is kept)
#
# Run from the repository root on the GPU machine (the device tool: `run` with this command; the
# machine has python3 with torch (CUDA), CuPy, pybind11, pytest, hypothesis and nvcc, no network).
#   build     LHC_CUDA=1 python3 setup.py build_ext --inplace: lossless_hc._C and _C_cuda (nvcc missing
#             is an error), the lossless_hc/plugins link (the package is not installed there), and a look
#             at the GPU (nvidia-smi, versions)
#   test      pytest -m gpu (tests/test_cuda.py, test_cuda_thc.py, test_topk.py, both the compiled and the
#             CuPy/NVRTC kernels; the DDP, planner and FSDP2 hooks on CUDA tensors through Gloo), with
#             pytest-xdist where it is installed, and the source-consistency tests
#   horovod   scripts/setup_horovod.sh (Gloo only, with CUDA: the wheel carried in .horovod-carry when it was
#             built against this torch, else built there from the carried sdist; carry [".horovod-carry"],
#             filled here by `scripts/fill_gpu_carry.sh`), then the Horovod compressors on
#             CUDA tensors, 2 and 3 ranks through Gloo (tests/test_plugins_horovod.py -m gpu)
#   byteps    scripts/byteps_gpu_session.sh in the rest of this call (BytePS from .byteps-carry, filled here by
#             `scripts/fill_gpu_carry.sh`; its GPU run): `build horovod byteps` with carry
#             [".horovod-carry", ".byteps-carry"] runs both engines' GPU checks in one call; its logs in $OUT/byteps
#   thcbench  python -m lossless_hc.bench thc --device cuda --numel 134217728 --workers 8 --repeat 10 --no-cpu-check:
#             THC encode/decode time on the GPU and NMSE (the bit-for-bit CPU lockstep is the tests' job)
#   topkbench python -m lossless_hc.bench topk --device cuda --numel 134217728 --ratio 0.01: the selection
#             against a device-to-device copy and torch.topk, indices checked against the CPU backend's
#   bench1    python -m lossless_hc.bench codec --device cuda --numel 134217728 --density 0.01 --workers 8
#             (index auto: bitmap there); bench1b with --index bitmap, bench1m with --index multilevel
#   bench5, bench5b, bench5m  the same at density 0.05 (auto sends 5% of 8 ranks dense)
#   bench1v   bench1b decoding with verify=True (lhc_verify_values' ancestry walks)
#   planbench python -m lossless_hc.bench plan --device cuda: auto's strategies' local work per step and rank,
#             an embedding table (2^24 in rows of 64, 2%) and rows of 1 (2^22, 1%), against a clone
#   sanitize  compute-sanitizer memcheck (and racecheck) on the fuzzing and overflow tests
#   thcsanitize, topksanitize  the same on THC's and top-k's CUDA tests
# Logs go to $OUT (the device tool's output folder; ./gpu-session-out when unset): summary.txt, build.log,
# test.log, sanitize.log, thc-sanitize.log, topk-sanitize.log (one per sanitizer step, which may run at the
# same time), bench.log and one JSON per benchmark (bench-<density>-<index>.json,
# bench-0.01-bitmap-verify.json, thc-bench.json, topk-bench.json, plan-*.json); under the device tool (OUT set) all but summary.txt end up in gpu-session.tgz.
# The whole run keeps within LHC_SESSION_SECONDS (default 560 s, under the tool's 10-minute limit) or
# until LHC_SESSION_DEADLINE (seconds since the epoch) when set: a step that would not fit is skipped and
# says so, with the command for a second call (which builds first: the machine may be a fresh one by then).
set -uo pipefail
cd "$(dirname "$0")/.."
# The device tool brings back at most 8 files from its $OUT: there, everything but summary.txt is packed
# into one archive at the end (session_pack in _session_step.sh).
PACK=${OUT:+1}
OUT=${OUT:-$PWD/gpu-session-out}
mkdir -p "$OUT"
PY=${PY:-python3}
export PYTHONUNBUFFERED=1
START=$(date +%s)
DEADLINE=${LHC_SESSION_DEADLINE:-$((START + ${LHC_SESSION_SECONDS:-560}))}
SUMMARY="$OUT/summary.txt"
STEPS=("$@")
[ ${#STEPS[@]} -eq 0 ] && STEPS=(build test+sanitize+thcsanitize+topksanitize bench1v bench1 thcbench topkbench
                                  bench1m bench5b bench5m planbench)
FAILED=0
SANITIZER=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer /usr/local/cuda-*/bin/compute-sanitizer \
  2>/dev/null | head -1)
SANITIZER=${SANITIZER:-compute-sanitizer}

# shellcheck source=scripts/_session_step.sh
source scripts/_session_step.sh   # the working directory is the repository root (cd above)

bench() {  # density index [--verify]
  local density=$1 index=$2 verify=${3:-}
  STEP_MIN=90 step "bench density $density index $index${verify:+ $verify}" bench.log 150 "$PY" -m lossless_hc.bench codec --device cuda \
    --numel 134217728 --density "$density" --workers 8 --index "$index" $verify \
    --json "$OUT/bench-$density-$index${verify:+-verify}.json"
}

# One step; returns non-zero when it (or one of its commands) failed. FAILED is local here, so a step
# run in the background (a '+' group) reports through its exit status.
run_step() {
  local FAILED=0
  # A second call may find a fresh machine (the first one's build gone): the hint builds first.
  local SKIP_HINT="LHC_CUDA_ARCHS='${LHC_CUDA_ARCHS:-80;90}' bash scripts/gpu_session.sh build $1"
  case "$1" in
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
      # lossless_hc.plugins is plugins/ (setup.py maps it when installed); without installing, a link does it.
      [ -e lossless_hc/plugins ] || ln -s ../plugins lossless_hc/plugins
      step "import" build.log 60 "$PY" -c "import lossless_hc._C_cuda as m, lossless_hc._C; print('kernels:', len(m.kernel_names()), 'SMs:', m.multiprocessors())"
      ;;
    test)
      local xdist=()
      "$PY" -c "import xdist" 2>/dev/null && xdist=(-n 6)
      # -v: one line per finished test, so a run cut by its limit still says which passed.
      # BytePS's GPU run is scripts/byteps_gpu_session.sh's (up to 420 s of its own where BytePS is installed).
      step "pytest -m gpu" test.log 420 "$PY" -m pytest -v -m gpu tests -rs -p no:cacheprovider --continue-on-collection-errors \
        --ignore=tests/test_byteps_gpu.py "${xdist[@]}"
      step "source consistency" test.log 60 "$PY" -m pytest -q tests/test_cuda_sources.py tests/test_header_cuda.py -p no:cacheprovider
      ;;
    horovod)
      step "install Horovod" build.log 300 env HOROVOD_WITHOUT_MPI=1 bash scripts/setup_horovod.sh "$PY"
      step "pytest -m gpu tests/test_plugins_horovod.py" test.log 300 "$PY" -m pytest -v -rs -m gpu -p no:cacheprovider \
        tests/test_plugins_horovod.py
      ;;
    byteps)
      local left=$((DEADLINE - $(date +%s) - 10))
      STEP_MIN=180 step "BytePS (scripts/byteps_gpu_session.sh)" byteps.log "$left" env LHC_SESSION_SECONDS="$left" OUT="$OUT/byteps" \
        bash scripts/byteps_gpu_session.sh
      ;;
    sanitize)
      step "memcheck" sanitize.log 240 "$SANITIZER" --tool memcheck --error-exitcode 99 --print-limit 20 \
        "$PY" -m pytest -q -x -p no:cacheprovider tests/test_cuda.py tests/test_cuda_multilevel.py \
        -k "fuzz or every_key or wide_blocks or failure_reports or multilevel_failures or (bitwise and compiled and bloom and 16)"
      step "racecheck" sanitize.log 90 "$SANITIZER" --tool racecheck --error-exitcode 99 --print-limit 20 \
        "$PY" -m pytest -q -x -p no:cacheprovider tests/test_cuda.py -k "wide_blocks or (encode_matches_cpu and bloom-b1 and float32 and compiled)"
      ;;
    thcbench)
      STEP_MIN=90 step "thc bench" bench.log 150 "$PY" -m lossless_hc.bench thc --device cuda --numel 134217728 --workers 8 \
        --repeat 10 --no-cpu-check --json "$OUT/thc-bench.json"
      ;;
    topkbench)
      STEP_MIN=60 step "topk bench" bench.log 90 "$PY" -m lossless_hc.bench topk --device cuda --numel 134217728 --ratio 0.01 \
        --repeat 20 --json "$OUT/topk-bench.json"
      ;;
    topksanitize)
      step "topk memcheck" topk-sanitize.log 150 "$SANITIZER" --tool memcheck --error-exitcode 99 --print-limit 20 \
        "$PY" -m pytest -q -x -p no:cacheprovider tests/test_topk.py -k gpu_equals_cpu
      step "topk racecheck" topk-sanitize.log 120 "$SANITIZER" --tool racecheck --error-exitcode 99 --print-limit 20 \
        "$PY" -m pytest -q -x -p no:cacheprovider tests/test_topk.py -k "gpu_equals_cpu and normal"
      ;;
    thcsanitize)
      step "thc memcheck" thc-sanitize.log 150 "$SANITIZER" --tool memcheck --error-exitcode 99 --print-limit 20 \
        "$PY" -m pytest -q -x -p no:cacheprovider tests/test_cuda_thc.py \
        -k "compiled and (b32 or tiny or b65536 or int64 or corrupted or worst_case or non_finite)"
      step "thc racecheck" thc-sanitize.log 150 "$SANITIZER" --tool racecheck --error-exitcode 99 --print-limit 20 \
        "$PY" -m pytest -q -x -p no:cacheprovider tests/test_cuda_thc.py -k "compiled and steps and (b1024 or b4096 or b65536)"
      ;;
    bench1) bench 0.01 auto ;;
    bench1b) bench 0.01 bitmap ;;
    bench5) bench 0.05 auto ;;
    bench5b) bench 0.05 bitmap ;;
    bench1m) bench 0.01 multilevel ;;
    bench1v) bench 0.01 bitmap --verify ;;
    bench5m) bench 0.05 multilevel ;;
    planbench)
      STEP_MIN=60 step "plan bench, a table" bench.log 120 "$PY" -m lossless_hc.bench plan --device cuda --numel 16777216 \
        --row 64 --density 0.02 --strategies dense,sketch,allgather,two_phase --json "$OUT/plan-table.json"
      STEP_MIN=60 step "plan bench, rows of 1" bench.log 120 "$PY" -m lossless_hc.bench plan --device cuda --numel 4194304 \
        --density 0.01 --strategies sketch,allgather,two_phase,thc,topk --json "$OUT/plan-rows1.json"
      ;;
    *) echo "unknown step $1 (see the header of scripts/gpu_session.sh)" | tee -a "$SUMMARY"; FAILED=1 ;;
  esac
  return $FAILED
}

for s in "${STEPS[@]}"; do
  if [[ "$s" == *+* ]]; then   # a group: its steps at the same time, each with its own log lines
    pids=()
    for part in ${s//+/ }; do run_step "$part" & pids+=($!); done
    for pid in "${pids[@]}"; do wait "$pid" || FAILED=1; done
  else
    run_step "$s" || FAILED=1
  fi
done

# The short table last: the tool's reply carries the end of the output.
echo
echo "== summary ($(( $(date +%s) - START ))s)"
cat "$SUMMARY"
grep -hE "passed|failed|error" "$OUT/test.log" 2>/dev/null | tail -4
# Per-test lines (-v): what finished even when the step was cut by its limit.
[ -f "$OUT/test.log" ] && echo "tests finished: $(grep -c ' PASSED' "$OUT/test.log") PASSED, $(grep -c ' FAILED' "$OUT/test.log") FAILED" \
  && grep -h ' FAILED' "$OUT/test.log" | head -20
grep -hE "ERROR SUMMARY|RACECHECK SUMMARY" "$OUT"/*sanitize.log 2>/dev/null
# One line per benchmark JSON: the ratios against the copy in the same run.
"$PY" - "$OUT" <<'PYEOF' 2>/dev/null || true
import glob, json, os, sys
for path in sorted(glob.glob(os.path.join(sys.argv[1], "*.json"))):
    r = json.load(open(path))
    t, name = r.get("timing", {}), os.path.basename(path)
    if "encode_over_copy" in t:
        c = r["correctness"]
        print(f"{name}: encode {t['encode']['median_s'] * 1e3:.3f} ms ({t['encode_over_copy']:.3f} of copy), decode "
              f"{t['decode']['median_s'] * 1e3:.3f} ms ({t['decode_over_copy']:.3f}), ok {c['ok']}, "
              f"mismatch {c['support_mismatch_beyond_rounding']}, deterministic {c['deterministic']}")
    elif "copy_prealloc" in t:
        print(f"{name}: encode {t['encode_reused_out']['median_s'] * 1e3:.3f} ms, decode "
              f"{t['decode_reused_out']['median_s'] * 1e3:.3f} ms, copy {t['copy_prealloc']['median_s'] * 1e3:.3f} ms "
              f"(enc+dec = {t['reused_over_copy']:.2f}x copy), nmse {r['accuracy']['nmse']:.4g}")
        for phase in ("encode", "decode") if t.get("kernels_ms") else ():
            top = sorted(t["kernels_ms"][phase].items(), key=lambda kv: -kv[1])[:4]
            print(f"  {phase} kernels: " + ", ".join(f"{k} {v:.3f} ms" for k, v in top))
    elif "strategies" in r and "clone_s" in r:
        print(f"{name}: clone {r['clone_s'] * 1e3:.2f} ms; " + ", ".join(
            f"{s} {v['step_s'] * 1e3:.2f} ms{'' if v['equals_sum'] or not v['exact'] else ' NOT EXACT'}"
            for s, v in r["strategies"].items()))
    elif "topk_select" in t:
        print(f"{name}: select {t['topk_select']['median_s'] * 1e3:.3f} ms = {r['ratios']['topk_select']:.2f}x copy, "
              f"torch.topk {r['ratios']['torch_topk']:.2f}x copy, exact {r['exact']}")
PYEOF
[ -n "$PACK" ] && session_pack gpu-session
exit $FAILED
