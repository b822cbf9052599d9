"""Several runs of lossless_hc.bench.workloads.train in one launch, one per compression: the launcher,
the imports and the workers' start are paid once instead of once per compression.

Usage (under horovodrun, torchrun or scripts/launch_*.sh):
    python several_trainings.py OUT COMPRESSION[,COMPRESSION...] TRAIN_ARGUMENTS...

Each run is what a launch of ``python -m lossless_hc.bench.workloads.train TRAIN_ARGUMENTS --compression C``
does: it initialises the framework (``hvd.init`` / ``init_process_group``), trains from the same seed and
shuts the framework down; rank 0 writes its results to ``OUT.format(compression=C)``.
"""
import sys

from lossless_hc.bench.workloads import train


def main():
    out, compressions, rest = sys.argv[1], sys.argv[2].split(","), sys.argv[3:]
    for compression in compressions:
        train.main(rest + ["--compression", compression, "--json", out.format(compression=compression)])
    train.leave()


if __name__ == "__main__":
    main()
