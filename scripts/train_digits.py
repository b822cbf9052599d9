#!/usr/bin/env python
"""Small CNN on scikit-learn's bundled 8x8 digits, the case for top-k with error feedback; reports test accuracy.

    scripts/launch_horovod.sh 2 scripts/train_digits.py --compression lossless          # Horovod, Gloo
    scripts/launch_mpirun.sh 2 scripts/train_digits.py --compression topk               # Horovod, MPI
    scripts/launch_torchrun.sh 2 scripts/train_digits.py --framework ddp --compression lossless

--compression none|fp16|lossless|topk, --framework horovod|ddp; --help lists the rest. Rank 0 prints
loss and accuracy, bytes sent per step vs dense, step time and fallbacks.
"""
import sys

from lossless_hc.bench.workloads.train import main

if __name__ == "__main__":
    main(sys.argv[1:], default_model="digits")
