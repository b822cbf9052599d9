"""The launcher the torch.distributed (Gloo) workers share:
``python <worker>.py SIZE PORT OUT_DIR NAMES`` spawns SIZE ranks; each joins a Gloo group on
127.0.0.1:PORT, runs the comma-separated scenarios NAMES one after the other through the worker's
``scenario(name) -> dict`` and writes OUT_DIR/<name>.rank<r>.json (the result with ``size`` added), then
ends the rank (:func:`lossless_hc.bench.common.end_gloo_rank`, as the FSDP2 worker's own launcher does):
the exit status then reports the scenarios alone."""
import json
import os
import sys

import torch
import torch.distributed as dist

import lossless_hc._C
from lossless_hc.bench.common import end_gloo_rank

from models import DEVICE


def _rank(rank, size, port, out_dir, names, scenario):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=size)
    torch.set_num_threads(1)
    if DEVICE.type == "cuda":
        torch.cuda.set_device(0)
    for name in names:
        result = scenario(name)
        result["size"] = size
        result["extension"] = os.path.realpath(lossless_hc._C.__file__)   # which build ran
        with open(os.path.join(out_dir, f"{name}.rank{rank}.json"), "w") as f:
            json.dump(result, f)
    end_gloo_rank()


def main(scenario) -> None:
    """Spawn the ranks from the command line; ``scenario`` must be a module-level function (pickled
    into every rank)."""
    size, port, out_dir, names = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4].split(",")
    torch.multiprocessing.spawn(_rank, args=(size, port, out_dir, names, scenario), nprocs=size)
