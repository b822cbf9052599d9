#!/usr/bin/env bash
# Start NP Horovod workers with horovodrun over Gloo (no MPI, no ssh for local runs).
#
#   scripts/launch_horovod.sh NP SCRIPT_OR_-m_MODULE [ARGS...]
#   scripts/launch_horovod.sh 2 -m lossless_hc.bench.workloads.train --model ncf --compression lossless
#
# Several machines: HOSTS="host1:2,host2:2" (horovodrun -H syntax; passwordless ssh between them,
# the same venv path on each, and optionally NICS=eth0 to pick the interface).
set -euo pipefail
source "$(dirname "$0")/_env.sh"
check_np_and_script launch_horovod.sh "workers in all" "$@"
NP=$1
shift
HOSTS=${HOSTS:-localhost:$NP}
extra=()
[ -n "${NICS:-}" ] && extra+=(--network-interface "$NICS")
exec horovodrun --gloo -np "$NP" -H "$HOSTS" "${extra[@]}" "$PY" "$@"
