#!/usr/bin/env bash
# Start NP torch.distributed workers on this machine with torchrun (the training script picks Gloo on
# CPU; NCCL when it trains on GPUs).
#
#   scripts/launch_torchrun.sh NP SCRIPT_OR_-m_MODULE [ARGS...]
#   scripts/launch_torchrun.sh 2 -m lossless_hc.bench.workloads.train --framework ddp --model ncf
#
# Several machines: NNODES=2 NODE_RANK=0|1 MASTER=host1:29500 on each machine. MASTER's port must be free
# on host1: where another program holds it, torchrun joins it as a client and waits out its rendezvous
# timeout. Alone (no MASTER), --standalone picks a free port itself.
set -euo pipefail
source "$(dirname "$0")/_env.sh"
check_np_and_script launch_torchrun.sh "workers on this machine" "$@"
NP=$1
shift
if [ -n "${MASTER:-}" ]; then
  rdzv=(--nnodes "${NNODES:?set NNODES}" --node-rank "${NODE_RANK:?set NODE_RANK}" --rdzv-backend c10d
        --rdzv-endpoint "$MASTER")
else
  rdzv=(--standalone)
fi
exec "$PY" -m torch.distributed.run "${rdzv[@]}" --nproc-per-node "$NP" "$@"
