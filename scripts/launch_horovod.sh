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
# A bad NP is refused here: horovodrun -np 0 exits 0 having run nothing, torchrun and mpirun answer with
# a traceback or a page of text.
usage="usage: launch_horovod.sh NP SCRIPT_OR_-m_MODULE [ARGS...]  (NP: workers in all, a positive integer)"
if [ $# -lt 1 ]; then
  echo "$usage" >&2; exit 2
elif ! [[ $1 =~ ^[1-9][0-9]*$ ]]; then
  echo "launch_horovod.sh: error: NP must be a positive integer, got '$1'" >&2; echo "$usage" >&2; exit 2
elif [ $# -lt 2 ]; then
  echo "launch_horovod.sh: error: no SCRIPT (or -m MODULE) to run" >&2; echo "$usage" >&2; exit 2
fi
NP=$1
shift
HOSTS=${HOSTS:-localhost:$NP}
extra=()
[ -n "${NICS:-}" ] && extra+=(--network-interface "$NICS")
exec horovodrun --gloo -np "$NP" -H "$HOSTS" "${extra[@]}" "$PY" "$@"
