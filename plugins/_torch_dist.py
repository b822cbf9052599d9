"""What the torch.distributed adapters (``ddp``, ``fsdp``) share beyond :mod:`lossless_hc.training`."""
import hashlib
from typing import Optional

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


def new_gloo_group(process_group: Optional[dist.ProcessGroup]):
    """A new Gloo group of ``process_group``'s ranks, created from a hook (every member calls it at the
    same point of the same step). Over the whole world, as every rank creates groups (named from the
    world's shared counter). A subgroup's non-members never run its hooks, so there it is created with
    ``use_local_synchronization``, whose name torch derives from the ranks and from how many groups the
    calling rank belongs to: the members must belong to equally many groups (else they wait on
    different names for ever, as a rank-0-only group beside the default one would make them)."""
    ranks = dist.get_process_group_ranks(process_group or dist.group.WORLD)
    return dist.new_group(ranks=ranks, backend="gloo", use_local_synchronization=len(ranks) < dist.get_world_size())


def when_all(futures, device: torch.device) -> torch.futures.Future:
    """A future of ``[f.wait() for f in futures]`` once every one of them completed (the first error
    raised by a ``wait()`` is its error), CUDA-aware where ``device`` is a CUDA device: its callbacks run
    on streams that wait for every future's work, and whoever takes its (or a ``then``'s) value waits for
    the kernels those callbacks enqueued. ``torch.futures.collect_all``'s own future is not CUDA-aware: a
    ``then`` of it ran its callback on whichever stream the last future's completion left current, and
    DDP read the bucket a hook returned through it before the decode's kernels had run."""
    result = torch.futures.Future(devices=[device]) if device.type == "cuda" else torch.futures.Future()

    def done(all_done: torch.futures.Future) -> None:
        try:
            # wait() makes this thread's current streams wait for each future's events; set_result then
            # records the events that the result's users wait for
            result.set_result([f.wait() for f in all_done.value()])
        except Exception as e:   # a collective's error
            result.set_exception(e)

    torch.futures.collect_all(futures).add_done_callback(done)
    return result


def allreduce_parts(parts, group, device: torch.device) -> torch.futures.Future:
    """A future of ``parts`` (on ``device``) SUMmed in place across ``group``: one allreduce per part (a
    message's parts, :mod:`lossless_hc.training.message`), all issued at once, in the same order on every
    rank; CUDA-aware on a CUDA device (:func:`when_all`)."""
    works = [dist.all_reduce(part, group=group, async_op=True).get_future() for part in parts]
    return when_all(works, device).then(lambda fut: [summed[0] for summed in fut.value()])
