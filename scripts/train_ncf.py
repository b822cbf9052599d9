#!/usr/bin/env python
"""NCF-style recommender (user/item embeddings + MLP) on synthetic implicit feedback with planted taste groups; reports hit rate@10.

    scripts/launch_horovod.sh 2 scripts/train_ncf.py --compression lossless          # Horovod, Gloo
    scripts/launch_mpirun.sh 2 scripts/train_ncf.py --compression topk               # Horovod, MPI
    scripts/launch_torchrun.sh 2 scripts/train_ncf.py --framework ddp --compression lossless

--compression none|fp16|lossless|topk, --framework horovod|ddp; --help lists the rest. Rank 0 prints
loss and hit rate, bytes sent per step vs dense, step time and fallbacks.
"""
import sys

from lossless_hc.bench.workloads.train import main

if __name__ == "__main__":
    main(sys.argv[1:], default_model="ncf")
