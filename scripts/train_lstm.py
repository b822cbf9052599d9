#!/usr/bin/env python
"""Word-level LSTM language model on the Python standard library's own sources; reports test perplexity.

    scripts/launch_horovod.sh 2 scripts/train_lstm.py --compression lossless          # Horovod, Gloo
    scripts/launch_mpirun.sh 2 scripts/train_lstm.py --compression topk               # Horovod, MPI
    scripts/launch_torchrun.sh 2 scripts/train_lstm.py --framework ddp --compression lossless
    scripts/launch_torchrun.sh 4 scripts/train_lstm.py --framework fsdp --shards 2 --compression lossless  # HSDP

--framework: horovod under launch_horovod.sh / launch_mpirun.sh, ddp or fsdp under launch_torchrun.sh
(ddp there when not given; a framework under the other launcher is refused), local for no aggregation.
--compression: the modes each framework takes are listed by --help (default lossless), as are the other
options. Rank 0 prints loss and perplexity, bytes sent per step vs dense, step time and fallbacks.
"""
import sys

from lossless_hc.bench.workloads.train import leave, main

if __name__ == "__main__":
    main(sys.argv[1:], default_model="lstm")
    leave()   # as `python -m lossless_hc.bench.workloads.train`: no SIGABRT from torch's threads at finalization
