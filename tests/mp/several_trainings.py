"""Several runs of lossless_hc.bench.workloads.train in one launch, one per compression: the launcher,
the imports, the workers' start and the framework's initialisation are paid once instead of once per
compression.

Usage (under horovodrun, torchrun or scripts/launch_*.sh):
    python several_trainings.py OUT COMPRESSION[,COMPRESSION...] TRAIN_ARGUMENTS...

The framework (``hvd.init`` / ``init_process_group``) is initialised here once; each run is then what a
launch of ``python -m lossless_hc.bench.workloads.train TRAIN_ARGUMENTS --compression C`` does within
it (the same seed, its own model, optimizer and compressor), and rank 0 writes its results to
``OUT.format(compression=C)``.
"""
import sys

from lossless_hc.bench.common import leave
from lossless_hc.bench.workloads import train


def main():
    out, compressions, rest = sys.argv[1], sys.argv[2].split(","), sys.argv[3:]
    runs = [rest + ["--compression", c, "--json", out.format(compression=c)] for c in compressions]
    args = train.parse_args(runs[0])
    framework = train.FRAMEWORKS[args.framework](args)   # the one initialisation the runs share
    for argv in runs:
        train.main(argv)
    framework.shutdown()
    leave()


if __name__ == "__main__":
    main()
