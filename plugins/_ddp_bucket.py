"""DDP's gradient buckets: each parameter's slice of a bucket, the division to DDP's average, and the
results written back (what :mod:`lossless_hc.plugins.ddp`'s hooks do around the aggregators)."""
from typing import Optional

import torch
import torch.distributed as dist

from lossless_hc.training.strategies import half_payload


def fill_bucket(buffer: torch.Tensor, results, n: Optional[int], in_place_divided: bool = False) -> torch.Tensor:
    """DDP's averaged bucket: each parameter's summed result, in bucket order, divided by ``n`` (None:
    the inputs were divided, see :func:`divide_first`; a result decoded into its own slice of the
    bucket, see :func:`bucket_slices`, is only divided, or left as it is with ``in_place_divided``)."""
    fill_slices(bucket_slices(buffer, results), results, n, in_place_divided)
    return buffer


def fill_slices(slices, results, n: Optional[int], in_place_divided: bool = False) -> None:
    """:func:`fill_bucket` for some of a bucket's gradients: ``results[i]`` into ``slices[i]``, their
    slices of the bucket (:func:`bucket_slices`)."""
    for value, dst in zip(results, slices):
        # copy_ then div_ (not torch.div(out=...)): a gradient with a graph (create_graph) needs the
        # in-place ops, which autograd records.
        in_place = value.data_ptr() == dst.data_ptr()
        if not in_place:
            dst.copy_(value.reshape(-1))
        if n is not None and not (in_place and in_place_divided):
            dst.div_(n)


def divide_first(buffer: torch.Tensor, n: float) -> bool:
    """Divide a float16 bucket by ``n`` in place before it is encoded, as DDP's own hook divides: the
    SUM of its ranks' values can exceed float16's 65504 where their average does not. Every strategy
    then sums x_r / n (a codec exactly, within its contract; a tensor sent as it is in float16, as DDP
    does, or in float32 where a message carries it in its float32 part, rounded once), so the result
    is the average, finite wherever DDP's is. The other dtypes are summed, then divided: bfloat16 and
    float32 have float32's range, and one rounding of the sum is closer than a sum of rounded
    quotients (the exception: a bucket summed as it is at a power-of-two world size,
    :func:`divide_first_exactly`). Returns whether it divided (a sparse bucket: its values). FSDP2's
    replica hook applies the same rule to a shard where FSDP2 leaves it the division (plugins/fsdp.py)."""
    if buffer.dtype != torch.float16:
        return False
    buffer.div_(n)
    return True


def divide_first_exactly(buffer: torch.Tensor, n: int) -> bool:
    """Divide a bucket summed as it is (a plain step: the engine's allreduce of the bare buffer, dense or
    sparse) by ``n`` before the sum where that is the same rounding as after it: ``n`` a power of two,
    2^k. Scaling by 2^-k is exact for every float whose quotient is normal, so it commutes with each
    rounding of the sum: fl(sum_r fl(x_r / n)) == fl(sum_r x_r) / n bit for bit, in any order of the
    sum, unless a quotient is subnormal (below 2^-126 in float32 and bfloat16; a subnormal sum is exact),
    where the two differ by at most n + 1 half-spacings of the subnormals (2^-150 each in float32), or the
    sum overflows (dividing first then gives the finite average). It keeps the future's callback, on the
    engine's communication thread, as light as torch's ``allreduce_hook``'s (which divides first at every
    world size): work there costs the step more than the same work in the hook (docs/BENCHMARKS.md, "What
    the DDP hook itself costs"). Returns whether it divided; other world sizes are summed, then divided
    (one rounding)."""
    if n & (n - 1) or not buffer.is_floating_point():
        return False
    buffer.div_(n)
    return True


def bucket_slices(buffer: torch.Tensor, grads) -> list:
    """Each gradient's own slice of the bucket, consecutive, as :func:`fill_bucket` walks them."""
    # Basic slicing, not torch.split: a gradient with a graph (create_graph) is written in place through its
    # slice (fill_slices), which autograd refuses for one of several views a split returns.
    slices, offset = [], 0
    for g in grads:
        slices.append(buffer[offset:offset + g.numel()])
        offset += g.numel()
    return slices


def allreduce_half(buffer: torch.Tensor, n: int, group, strategy: str, average: bool = True) -> torch.futures.Future:
    """The future of the float32 ``buffer``'s average over ``group`` (``n`` ranks; ``average`` False: its SUM),
    written into it, through one allreduce in half precision: ``"fp16"`` divides by n before the float16 SUM
    (DDP's fp16_compress_hook: a sum past 65504 only where the average is; a SUM multiplies it back by n in
    float32), ``"bf16"`` after the bfloat16 one (float32's range). The bits an fp16 or bf16 plan's plain steps
    give through a message (training.strategies), its copies spared."""
    compressed = half_payload(buffer, strategy, n)
    fut = dist.all_reduce(compressed, group=group, async_op=True).get_future()

    def write_back(fut: torch.futures.Future) -> torch.Tensor:
        out = buffer.copy_(fut.value()[0])
        if strategy == "fp16":
            return out if average else out.mul_(n)
        return out.div_(n) if average else out
    return fut.then(write_back)
