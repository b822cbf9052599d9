# Sourced by the one-call GPU session scripts (gpu_session.sh, byteps_gpu_session.sh).
#
# step NAME LOG LIMIT CMD...: run CMD with at most LIMIT seconds (less if the call's deadline is
# nearer), appending its output to $OUT/LOG and one line to $SUMMARY; sets FAILED=1 on failure.
# Returns CMD's status (1 when skipped for lack of time). The caller sets OUT, SUMMARY, DEADLINE,
# FAILED and, optionally, SKIP_HINT (what to run to do a skipped step later; "$name" is expanded) and
# STEP_MIN (seconds below which the step is skipped rather than started and cut; default 20: a
# benchmark cut by its limit measures nothing, so its caller asks for more).
step() {
  local name=$1 log=$2 limit=$3
  shift 3
  local left=$((DEADLINE - $(date +%s) - 5))
  if [ "$left" -lt "${STEP_MIN:-20}" ]; then
    echo "$name: SKIPPED (no time left in this call${SKIP_HINT:+; run: ${SKIP_HINT//\$name/$name}})" | tee -a "$SUMMARY"
    FAILED=1
    return 1
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  local t0=$(date +%s)
  echo "=== $name: $* (limit ${limit}s)" >> "$OUT/$log"
  timeout --kill-after=10 "$limit" "$@" >> "$OUT/$log" 2>&1
  local rc=$?
  local verdict=ok
  [ $rc -ne 0 ] && verdict="FAILED (rc=$rc$([ $rc -eq 124 ] && echo ', timed out'))" && FAILED=1
  echo "$name: $verdict in $(( $(date +%s) - t0 ))s (log: $log)" | tee -a "$SUMMARY"
  return $rc
}

# session_pack NAME: move everything under $OUT but summary.txt and earlier archives into the archive
# $OUT/NAME.tgz (NAME-2.tgz, ... when a script ran twice into one $OUT): the device tool brings back 8
# files at most, two folders deep.
session_pack() {
  local name=$1.tgz n=1
  while [ -e "$OUT/$name" ]; do n=$((n + 1)); name=$1-$n.tgz; done
  (cd "$OUT" && find . -mindepth 1 -maxdepth 1 ! -name summary.txt ! -name '*.tgz' -print0 > /tmp/session_pack.list \
     && tar czf "/tmp/$name" --null -T /tmp/session_pack.list \
     && xargs -0 rm -rf < /tmp/session_pack.list && mv "/tmp/$name" "$OUT/$name")
}
