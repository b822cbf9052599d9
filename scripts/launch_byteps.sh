#!/usr/bin/env bash
# Start a BytePS job: a scheduler, servers and workers, with the DMLC_* variables BytePS reads.
#
# Local (everything on this machine; workers share the visible GPUs round-robin, one GPU each):
#   scripts/launch_byteps.sh [--workers N] [--servers S] [--port P] -- COMMAND [ARGS...]
#   e.g. scripts/launch_byteps.sh --workers 2 --servers 1 -- python train.py
#   BYTEPS_LHC_COMPRESSOR=lossless BYTEPS_LHC_MAX_DENSITY=0.01 scripts/launch_byteps.sh -- python train.py
#
# One role of a multi-machine job (run once per process, on its machine; docs/BYTEPS.md):
#   DMLC_PS_ROOT_URI=<scheduler ip> DMLC_PS_ROOT_PORT=1234 DMLC_NUM_WORKER=2 DMLC_NUM_SERVER=2 \
#     scripts/launch_byteps.sh --role scheduler|server
#   ... DMLC_WORKER_ID=<i> scripts/launch_byteps.sh --role worker -- COMMAND [ARGS...]
#
# Each local worker is its own BytePS "machine" (DMLC_WORKER_ID=i, BYTEPS_LOCAL_SIZE=1), so two of them
# can share one GPU; BYTEPS_SHM_PREFIX (added by scripts/setup_byteps.sh's patches) and
# BYTEPS_SOCKET_PATH keep their shared-memory buffers and local sockets apart. Logs: $LHC_BYTEPS_LOG_DIR (default ./byteps-logs): scheduler.log,
# server<i>.log, worker<i>.log. Exit status: the first failing worker's, 124 on timeout
# (LHC_BYTEPS_TIMEOUT seconds, default 600). Scheduler and servers are stopped when the workers end; when
# one of them fails first (a status other than 0), the workers are stopped (143) and its log's end printed.
set -euo pipefail
source "$(dirname "$0")/_env.sh"

WORKERS=2 SERVERS=1 PORT=${DMLC_PS_ROOT_PORT:-$((20000 + RANDOM % 20000))} ROLE=local PORT_GIVEN=false
while [ $# -gt 0 ]; do
  case "$1" in
    --workers) WORKERS=$2; shift 2 ;;
    --servers) SERVERS=$2; shift 2 ;;
    --port) PORT=$2; PORT_GIVEN=true; shift 2 ;;
    --role) ROLE=$2; shift 2 ;;
    --) shift; break ;;
    -h|--help) sed -n 2,18p "$0"; exit 0 ;;
    *) break ;;
  esac
done
SERVER_CMD=("$PY" -c "import byteps.server")
export PYTHONUNBUFFERED=1

case "$ROLE" in
  scheduler|server|worker)
    # Every role of a multi-machine job must meet on one port: a random one per process would leave the
    # scheduler, servers and workers waiting for each other until a timeout.
    if [ -z "${DMLC_PS_ROOT_PORT:-}" ] && ! $PORT_GIVEN; then
      echo "launch_byteps: --role $ROLE needs the scheduler's port: set DMLC_PS_ROOT_PORT (or pass --port)," \
           "the same on every machine" >&2
      exit 2
    fi
    ;;
esac
case "$ROLE" in
  scheduler|server)
    : "${DMLC_PS_ROOT_URI:?set DMLC_PS_ROOT_URI to the address of the scheduler}" "${DMLC_NUM_WORKER:?}" "${DMLC_NUM_SERVER:?}"
    export DMLC_ROLE=$ROLE DMLC_PS_ROOT_PORT=$PORT
    exec "${SERVER_CMD[@]}"
    ;;
  worker)
    : "${DMLC_PS_ROOT_URI:?}" "${DMLC_NUM_WORKER:?}" "${DMLC_NUM_SERVER:?}" "${DMLC_WORKER_ID:?}"
    [ $# -gt 0 ] || { echo "launch_byteps: --role worker needs -- COMMAND" >&2; exit 2; }
    # One process per local GPU, as bpslaunch does.
    ngpu=$(echo "${CUDA_VISIBLE_DEVICES:-0}" | tr ',' '\n' | wc -l)
    export DMLC_ROLE=worker DMLC_PS_ROOT_PORT=$PORT BYTEPS_LOCAL_SIZE=$ngpu
    pids=()
    for ((g = 0; g < ngpu; g++)); do
      BYTEPS_LOCAL_RANK=$g "$@" &
      pids+=($!)
    done
    rc=0
    for p in "${pids[@]}"; do wait "$p" || rc=$?; done
    exit $rc
    ;;
  local) ;;
  *) echo "launch_byteps: unknown --role $ROLE (scheduler, server, worker; none for a local run)" >&2; exit 2 ;;
esac

[ $# -gt 0 ] || { echo "usage: launch_byteps.sh [--workers N] [--servers S] [--port P] -- COMMAND [ARGS...]" >&2; exit 2; }
LOGS=${LHC_BYTEPS_LOG_DIR:-$PWD/byteps-logs}
mkdir -p "$LOGS"
IFS=',' read -r -a GPUS <<< "${CUDA_VISIBLE_DEVICES:-0}"
export DMLC_NUM_WORKER=$WORKERS DMLC_NUM_SERVER=$SERVERS DMLC_PS_ROOT_URI=127.0.0.1 DMLC_PS_ROOT_PORT=$PORT \
       DMLC_NODE_HOST=127.0.0.1

bg=() roles=()   # the scheduler's and servers' pids, and their names (their logs' names)
cleanup() {
  for p in "${bg[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
}
trap cleanup EXIT

DMLC_ROLE=scheduler "${SERVER_CMD[@]}" > "$LOGS/scheduler.log" 2>&1 &
bg+=($!) roles+=(scheduler)
for ((s = 0; s < SERVERS; s++)); do
  DMLC_ROLE=server "${SERVER_CMD[@]}" > "$LOGS/server$s.log" 2>&1 &
  bg+=($!) roles+=("server$s")
done
workers=()
for ((w = 0; w < WORKERS; w++)); do
  mkdir -p "/tmp/lhc-byteps-$PORT-w$w"
  DMLC_ROLE=worker DMLC_WORKER_ID=$w BYTEPS_LOCAL_RANK=0 BYTEPS_LOCAL_SIZE=1 BYTEPS_SHM_PREFIX="lhc${PORT}w${w}_" \
  BYTEPS_SOCKET_PATH="/tmp/lhc-byteps-$PORT-w$w" \
  CUDA_VISIBLE_DEVICES=${GPUS[$((w % ${#GPUS[@]}))]} \
    timeout --kill-after=10 "${LHC_BYTEPS_TIMEOUT:-600}" "$@" > "$LOGS/worker$w.log" 2>&1 &
  workers+=($!)
done
# Workers wait forever on a scheduler or server that died (a segmentation fault, say): stop them then.
# One that ends with status 0 is shutting down with the workers (ps-lite's Finalize).
died=
declare -A ended=()
while [ -z "$died" ] && [ -n "$(jobs -rp | grep -xF -f <(printf '%s\n' "${workers[@]}"))" ]; do
  for i in "${!bg[@]}"; do
    [ -n "${ended[$i]:-}" ] || kill -0 "${bg[$i]}" 2>/dev/null && continue
    st=0; wait "${bg[$i]}" || st=$?
    ended[$i]=$st
    [ "$st" -ne 0 ] && { died=${roles[$i]}; break; }
  done
  [ -z "$died" ] && sleep 1
done
if [ -n "$died" ]; then
  echo "launch_byteps: the $died failed (status $st) while workers were running; stopping them" \
       "(log: $LOGS/$died.log)" >&2
  tail -20 "$LOGS/$died.log" >&2
  for p in "${workers[@]}"; do kill "$p" 2>/dev/null || true; done
fi
rc=0
for ((w = 0; w < WORKERS; w++)); do
  st=0
  wait "${workers[$w]}" || st=$?
  if [ $st -ne 0 ]; then
    echo "launch_byteps: worker $w exited with $st (log: $LOGS/worker$w.log)" >&2
    tail -20 "$LOGS/worker$w.log" >&2
    [ $rc -eq 0 ] && rc=$st
  fi
done
[ -n "$died" ] && [ $rc -eq 0 ] && rc=1
echo "launch_byteps: $WORKERS worker(s), $SERVERS server(s) done (rc=$rc; logs in $LOGS)"
exit $rc
