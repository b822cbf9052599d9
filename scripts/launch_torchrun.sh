#!/usr/bin/env bash
# Start NP torch.distributed workers on this machine with torchrun (the training script picks Gloo on
# CPU; NCCL when it trains on GPUs).
#
#   scripts/launch_torchrun.sh NP SCRIPT_OR_-m_MODULE [ARGS...]
#   scripts/launch_torchrun.sh 2 -m lossless_hc.bench.workloads.train --framework ddp --model ncf
#
# Several machines: NNODES=2 NODE_RANK=0|1 MASTER=host1:29500 on each machine.
set -euo pipefail
source "$(dirname "$0")/_env.sh"
# A bad NP is refused here: horovodrun -np 0 exits 0 having run nothing, torchrun and mpirun answer with
# a traceback or a page of text.
usage="usage: launch_torchrun.sh NP SCRIPT_OR_-m_MODULE [ARGS...]  (NP: workers on this machine, a positive integer)"
if [ $# -lt 1 ]; then
  echo "$usage" >&2; exit 2
elif ! [[ $1 =~ ^[1-9][0-9]*$ ]]; then
  echo "launch_torchrun.sh: error: NP must be a positive integer, got '$1'" >&2; echo "$usage" >&2; exit 2
elif [ $# -lt 2 ]; then
  echo "launch_torchrun.sh: error: no SCRIPT (or -m MODULE) to run" >&2; echo "$usage" >&2; exit 2
fi
NP=$1
shift
if [ -n "${MASTER:-}" ]; then
  rdzv=(--nnodes "${NNODES:?set NNODES}" --node-rank "${NODE_RANK:?set NODE_RANK}" --rdzv-backend c10d
        --rdzv-endpoint "$MASTER")
else
  rdzv=(--standalone)
fi
exec "$PY" -m torch.distributed.run "${rdzv[@]}" --nproc-per-node "$NP" "$@"
