"""CUDA backend of the top-k selection: the launch sequence of ``csrc/cuda/topk_kernels.cuh``.

Loaded like the codecs' kernels (:mod:`lossless_hc.backends.cuda_runtime`: the compiled module or NVRTC
through CuPy) and queued on ``torch.cuda.current_stream()`` without synchronising. The indices are the
CPU backend's (``csrc/cpu/topk_cpu.h`` defines them: the ``min(k, n)`` largest ``|x|``, ties to the lower
index, ascending); tests/test_topk.py checks it on the host (emulated).
"""
from __future__ import annotations

from typing import Optional

import torch

from lossless_hc.backends import cuda_runtime

THREADS = 256        # kTopkThreads
BINS = 2048          # kTopkBins
STATE_BYTES = 32     # sizeof(lhc::gpu::TopkState)
PASSES = 3           # 11 + 11 + 10 key bits


def _sms(device: torch.device) -> int:
    # A CPU device is the host emulation, where every CUDA thread is an OS thread: small grids.
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


def topk_select(x: torch.Tensor, k: int, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Queue the selection of ``min(k, x.numel())`` indices (int64, ascending) of ``x`` (contiguous float32
    on the device); returns ``out[:count]`` (a new tensor unless ``out`` is given)."""
    n = x.numel()
    count = min(int(k), n)
    device = x.device
    if out is None:
        out = torch.empty(count, dtype=torch.int64, device=device)
    if count == n:   # everything (k >= n, or n == 0)
        torch.arange(n, out=out[:n])
        return out[:count]
    if count == 0:
        return out[:0]
    launch = cuda_runtime.active_launcher()
    sms = _sms(device)
    grid = max(1, min(-(-n // THREADS), 16 * sms))
    # Contiguous ranges per block; at most 2^31 keys per block so per-thread counts stay 32-bit.
    blocks = max(1, min(-(-n // (16 * THREADS)), 32 * sms))
    blocks = max(blocks, -(-n // (1 << 31)))
    per_block = -(-n // blocks)
    with cuda_runtime.device_scope(device):
        stream = cuda_runtime.stream_handle(device)
        a = cuda_runtime.Arena({"state": STATE_BYTES, "hist": 8 * BINS, "counts": 16 * blocks}, device)
        state = a.view("state", torch.int64)
        state.zero_()   # prefix 0, then remaining k: fill_ from a Python int, where a copy_ from a host
        state[1].fill_(count)   # tensor would synchronise the stream
        a.view("hist").zero_()
        st, hist, counts, xp = a.ptr("state"), a.ptr("hist"), a.ptr("counts"), x.data_ptr()
        for p in range(PASSES):
            launch.launch("topk_hist", grid, THREADS, [xp, n, st, p, hist], stream)
            launch.launch("topk_pick", 1, 32, [hist, st, p], stream)
        launch.launch("topk_count", blocks, THREADS, [xp, n, st, per_block, counts], stream)
        launch.launch("topk_offsets", 1, 32, [counts, blocks, st], stream)
        launch.launch("topk_write", blocks, THREADS, [xp, n, st, per_block, counts, out.data_ptr()], stream)
    return out[:count]


def topk_feedback(x: torch.Tensor, e: torch.Tensor, k: int, out: torch.Tensor, values: torch.Tensor) -> int:
    """The CPU backend's ``topk_feedback`` on the device: ``e <- x + e`` (topk_accumulate), the selection
    over ``e`` into ``out``, then ``values[j] = e[out[j]]`` and those coordinates of ``e`` zeroed
    (topk_take). Queued without synchronising; returns the count ``min(k, numel)``."""
    n = x.numel()
    count = min(int(k), n)
    launch = cuda_runtime.active_launcher()
    sms = _sms(x.device)
    with cuda_runtime.device_scope(x.device):
        stream = cuda_runtime.stream_handle(x.device)
        if n:
            launch.launch("topk_accumulate", max(1, min(-(-n // THREADS), 16 * sms)), THREADS,
                          [x.data_ptr(), e.data_ptr(), n], stream)
        idx = topk_select(e, count, out)
        if count:
            launch.launch("topk_take", max(1, min(-(-count // THREADS), 16 * sms)), THREADS,
                          [e.data_ptr(), idx.data_ptr(), count, values.data_ptr(), 1], stream)
    return count
