#!/usr/bin/env bash
# Start NP Horovod workers with mpirun (Debian's OpenMPI; Horovod built with MPI by setup_horovod.sh).
#
#   scripts/launch_mpirun.sh NP SCRIPT_OR_-m_MODULE [ARGS...]
#
# Several machines: HOSTS="host1:2,host2:2" (mpirun -H syntax, passwordless ssh, same venv path).
# OpenMPI refuses to run as root unless told; containers and CI often run as root, so we tell it.
set -euo pipefail
source "$(dirname "$0")/_env.sh"
# A bad NP is refused here: horovodrun -np 0 exits 0 having run nothing, torchrun and mpirun answer with
# a traceback or a page of text.
usage="usage: launch_mpirun.sh NP SCRIPT_OR_-m_MODULE [ARGS...]  (NP: workers in all, a positive integer)"
if [ $# -lt 1 ]; then
  echo "$usage" >&2; exit 2
elif ! [[ $1 =~ ^[1-9][0-9]*$ ]]; then
  echo "launch_mpirun.sh: error: NP must be a positive integer, got '$1'" >&2; echo "$usage" >&2; exit 2
elif [ $# -lt 2 ]; then
  echo "launch_mpirun.sh: error: no SCRIPT (or -m MODULE) to run" >&2; echo "$usage" >&2; exit 2
fi
NP=$1
shift
HOSTS=${HOSTS:-localhost:$NP}
extra=()
[ "$(id -u)" = 0 ] && extra+=(--allow-run-as-root)
# Forward the environment the workers need (only what is set: mpirun warns about the rest).
for var in PATH PYTHONPATH LD_LIBRARY_PATH OMP_NUM_THREADS; do
  [ -n "${!var:-}" ] && extra+=(-x "$var")
done
# -bind-to none: the workers set their own thread counts.
exec mpirun "${extra[@]}" -np "$NP" -H "$HOSTS" -bind-to none -map-by slot "$PY" "$@"
