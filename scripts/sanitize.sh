#!/usr/bin/env bash
# Build lossless_hc._C with AddressSanitizer + UndefinedBehaviorSanitizer into a scratch copy of the
# package and run the codec tests, and the planner's multi-process DDP scenarios, against it. The
# regular editable build in the repo is untouched.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-$PWD/.venv/bin/python}
OUT=build-sanitize
rm -rf "$OUT"
mkdir -p "$OUT"
LHC_SANITIZE=1 "$PY" setup.py -q build_ext --build-temp "$OUT/tmp" --build-lib "$OUT/lib" >/dev/null
# A self-contained package tree: the python sources (subpackages included) beside the sanitized extension.
(cd lossless_hc && find . -path ./plugins -prune -o -name __pycache__ -prune -o \( -name '*.py' -o -name '*.json' \) \
  -print | xargs cp --parents -t "../$OUT/lib/lossless_hc/")
mkdir -p "$OUT/lib/lossless_hc/plugins"
cp plugins/*.py "$OUT/lib/lossless_hc/plugins/"
# The CUDA sources beside the package, as in the repo (the CUDA module and NVRTC path read the headers).
cp -r csrc "$OUT/lib/"
ASAN_LIB=$(gcc -print-file-name=libasan.so)
UBSAN_LIB=$(gcc -print-file-name=libubsan.so)
for lib in "$ASAN_LIB" "$UBSAN_LIB"; do
  if [ ! -e "$lib" ]; then
    echo "sanitize: $lib not found (install gcc's libasan/libubsan); cannot run the sanitizer build" >&2
    exit 1
  fi
done
export LD_PRELOAD="$ASAN_LIB $UBSAN_LIB"
# Python's allocator and torch are not instrumented; leaks in the interpreter are not ours.
export ASAN_OPTIONS=detect_leaks=0:abort_on_error=1:halt_on_error=1
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
export LHC_EXPECT_SANITIZED=1
# Run from inside the scratch tree so `import lossless_hc` resolves to it, not to the repo's build.
cd "$OUT/lib"
"$PY" -c "import lossless_hc._C as c, sys; assert '$OUT' in c.__file__, c.__file__; print('sanitized module:', c.__file__)"
# The host emulation of the CUDA kernels (built without the sanitizers; its fibers switch stacks) is not
# what this build checks. Of the multi-process tests, the planner's DDP scenarios (3 Gloo ranks: every
# strategy, dense and sparse gradients, the kernels called from DDP's hook) run against it too; the
# workers import this build (tests/test_planner_mp.py checks which one each rank loaded).
# The single-process tests on TEST_JOBS pytest-xdist workers, OpenMP's waiting threads asleep (as `make test`).
# --capture=sys: a sanitizer writes its report to file descriptor 2 and ends the process at once, so under
# pytest's default capture of the descriptors (--capture=fd) the report would go to a capture file that is
# never printed, leaving only "node down" or an exit status; Python's own output is still captured.
OMP_WAIT_POLICY=passive "$PY" -m pytest -q -x -p no:cacheprovider --capture=sys -n "${TEST_JOBS:-2}" --rootdir=../.. \
  ../../tests -k "not sizing and not emulated" -m "not multiprocess" "$@"
"$PY" -m pytest -q -x -p no:cacheprovider --capture=sys --rootdir=../.. ../../tests/test_planner_mp.py -k ddp "$@"
