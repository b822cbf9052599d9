"""What the torch.distributed adapters (``ddp``, ``fsdp``) share beyond :mod:`lossless_hc.training`."""
import hashlib
from typing import Optional

import torch
import torch.distributed as dist

from lossless_hc.training.aggregate import ConfigurationMismatch


def check_same_configuration(config: str, group: Optional[dist.ProcessGroup], who: str) -> None:
    """Raise :class:`ConfigurationMismatch` on every rank of ``group`` unless all of them pass the same
    ``config`` string (payload sizes would not match).

    One blocking MAX allreduce of ``(h, -h)`` for a 48-bit hash ``h`` of ``config``: all ranks agree
    iff both maxima equal their own values. Every rank of ``group`` must call it at the same point."""
    h = int.from_bytes(hashlib.sha256(config.encode()).digest()[:6], "little")
    t = torch.tensor([h, -h], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    if t.tolist() != [h, -h]:
        raise ConfigurationMismatch(f"{who} differs across ranks (world size or options); this rank has {config}")
