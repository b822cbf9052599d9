#!/usr/bin/env bash
# Start NP Horovod workers with mpirun (Debian's OpenMPI; Horovod built with MPI by setup_horovod.sh).
#
#   scripts/launch_mpirun.sh NP SCRIPT_OR_-m_MODULE [ARGS...]
#
# Several machines: HOSTS="host1:2,host2:2" (mpirun -H syntax, passwordless ssh, same venv path).
# OpenMPI refuses to run as root unless told; containers and CI often run as root, so we tell it.
set -euo pipefail
source "$(dirname "$0")/_env.sh"
check_np_and_script launch_mpirun.sh "workers in all" "$@"
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
