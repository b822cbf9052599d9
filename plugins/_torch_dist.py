"""What the torch.distributed adapters (``ddp``, ``fsdp``) share beyond :mod:`lossless_hc.training`."""
import hashlib

import torch
import torch.distributed as dist

from lossless_hc.training.aggregate import ConfigurationMismatch


def check_same_configuration(config: str, groups, who: str, device="cpu") -> None:
    """Raise :class:`ConfigurationMismatch` on every rank unless all of them pass the same ``config``
    string (payload sizes would not match).

    ``groups``: one process group (None: the default group), or a sequence of groups that together
    connect the ranks like the dimensions of a device mesh (every rank calls with the same sequence).
    A MAX allreduce of ``(h, -h)`` for a 48-bit hash ``h`` of ``config``, over each group in turn:
    after the last one every rank holds the maxima over all ranks (a max over the rows, then over the
    columns, of a grid is the max of the grid), so all ranks agree iff both maxima equal their own
    values, and every rank sees the same verdict. Blocking; every rank must call it at the same point.
    ``device``: where the groups' backend reduces (a CUDA device for NCCL)."""
    if groups is None or isinstance(groups, dist.ProcessGroup):
        groups = [groups]
    h = int.from_bytes(hashlib.sha256(config.encode()).digest()[:6], "little")
    t = torch.tensor([h, -h], dtype=torch.int64, device=device)
    for group in groups:
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    if t.tolist() != [h, -h]:
        raise ConfigurationMismatch(f"{who} differs across ranks (world size or options); this rank has {config}")
