"""torch's own DDP compression hooks, made to run on CPU workers over Gloo: the baselines a user
would pick before this library (bf16 and PowerSGD). Not part of the library.

* :func:`bf16_hook`: torch's ``bf16_compress_hook`` unchanged. DDP refuses that function by name
  unless it runs on CUDA with NCCL (or XPU), although Gloo allreduces bfloat16 on CPU.
* :class:`PowerSGDPerBucket`: torch's ``powerSGD_hook`` with one ``PowerSGDState`` and one process
  group per bucket. The hook issues its second and third allreduce (Q after P, and the
  uncompressed tensors) from future callbacks, which Gloo runs on its own threads while the main
  thread issues the next bucket's allreduce: on one process group the ranks can then issue them in
  different orders and pair mismatched collectives (Gloo aborts: "Received data size doesn't match
  expected size"). A group per bucket keeps each bucket's sequence in order; the buckets share one
  iteration counter, so PowerSGD starts on every bucket at the same step, as with one state.
"""
from __future__ import annotations

import torch.distributed as dist


def bf16_hook(process_group, bucket):
    """torch's ``bf16_compress_hook``: the bucket cast to bfloat16 and divided by the world size,
    allreduced, cast back."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    return default_hooks.bf16_compress_hook(process_group, bucket)


class PowerSGDPerBucket:
    """State of :func:`powersgd_hook`: ``PowerSGDState(**options)`` per bucket index, each on its
    own Gloo group (created in the hook, on the main thread, in bucket order on every rank)."""

    def __init__(self, **options):
        self.options, self.states, self.iter = options, {}, 0

    def describe(self) -> str:
        o = self.options
        return (f"PowerSGD rank {o.get('matrix_approximation_rank', 1)}, from iteration "
                f"{o.get('start_powerSGD_iter', 1000)}")


def powersgd_hook(state: PowerSGDPerBucket, bucket):
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState, powerSGD_hook

    idx = bucket.index()
    st = state.states.get(idx)
    if st is None:
        # every rank runs the hook: a group named from the world's shared counter (a local synchronization's
        # name also counts the groups the calling rank belongs to, which ranks need not share)
        group = dist.new_group(ranks=list(range(dist.get_world_size())), backend="gloo")
        st = state.states[idx] = PowerSGDState(process_group=group, **state.options)
    st.iter = state.iter
    fut = powerSGD_hook(st, bucket)
    if bucket.is_last():
        state.iter += 1
    return fut
