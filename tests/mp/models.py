"""Tiny models and batches shared by the multi-process workers (Horovod and DDP).

``LHC_TEST_DEVICE=cuda``: batches are made on GPU 0 (the DDP workers' GPU runs: every rank on the one
GPU, through Gloo, since NCCL refuses two ranks on one device)."""
import math
import os

import torch
from torch import nn

DEVICE = torch.device(os.environ.get("LHC_TEST_DEVICE", "cpu"))


def confirm_every_guard_look() -> None:
    """Turn the step guard's decisive look off in this worker: the forced-verdict scenarios count a
    confirmation round's steps, which a decisive first look (the plans measured at most half the dense
    step, as they may be on loopback) would skip. tests/test_guard.py covers the decisive path."""
    import lossless_hc.training.guard as guard
    guard.GUARD_DECISIVE = 0.0


class EmbeddingModel(nn.Module):
    """Two embedding tables (row-sparse gradients) and dense layers (dense gradients)."""

    def __init__(self, sparse: bool = False, users: int = 5000, items: int = 3000, dim: int = 8, hidden: int = 16):
        super().__init__()
        self.users = nn.Embedding(users, dim, sparse=sparse)
        self.items = nn.Embedding(items, dim)
        self.fc1 = nn.Linear(2 * dim, hidden)
        self.fc2 = nn.Linear(hidden, 1)

    def forward(self, u, i):
        h = torch.relu(self.fc1(torch.cat([self.users(u), self.items(i)], dim=-1)))
        return self.fc2(h).squeeze(-1)


def batch(step: int, rank: int, size: int = 32, users: int = 5000, items: int = 3000):
    """Rank- and step-specific random batch (different supports on every rank)."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    b = (torch.randint(0, users, (size,), generator=g), torch.randint(0, items, (size,), generator=g),
         torch.rand(size, generator=g))
    return tuple(t.to(DEVICE) for t in b)


def loss_fn(model, b):
    u, i, y = b
    # A half-precision model's output widened here, as mse_loss widens it on the CPU: CUDA's mse_loss
    # backward refuses a bfloat16 input beside a float32 target (torch 2.11).
    return torch.nn.functional.mse_loss(model(u, i).float(), y)


def param_digest(model: nn.Module) -> str:
    """Hash of the parameters' bits: replicas that decode identically stay bit-identical."""
    import hashlib

    h = hashlib.sha256()
    for p in model.parameters():
        t = p.detach().cpu().contiguous()
        h.update((t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy().tobytes())   # numpy has no bfloat16
    return h.hexdigest()


def max_param_diff(a: nn.Module, b: nn.Module) -> float:
    return max(float((p.detach() - q.detach()).abs().max()) for p, q in zip(a.parameters(), b.parameters()))


class LinearLoss(nn.Module):
    """loss(C) = sum(W * C) for a ``shape`` weight: the gradient is C, whatever W is, so the reduced
    gradients of every step can be compared with the sum of what the ranks computed."""

    def __init__(self, shape, device="cpu"):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(*shape, device=device))

    def forward(self, c):
        return (self.weight * c).sum()


class BagModel(nn.Module):
    """A sparse bag-of-rows table (nn.EmbeddingBag(sparse=True): DDP hands its gradient to the hook as a
    COO tensor of rows) and a dense layer; an empty bag contributes no row."""

    def __init__(self, rows: int = 3000, dim: int = 8):
        super().__init__()
        self.table = nn.EmbeddingBag(rows, dim, mode="sum", sparse=True)
        self.fc = nn.Linear(dim, 1)

    def forward(self, rows, offsets):
        return self.fc(torch.tanh(self.table(rows, offsets))).squeeze(-1)


def own_gradients(model: nn.Module, hidden: int, b) -> list:
    """This rank's own gradient of batch ``b`` for an EmbeddingModel's parameters (flat float64 each): the
    same backward on a plain copy of ``model``, outside any engine."""
    own = EmbeddingModel(hidden=hidden).to(DEVICE)
    own.load_state_dict(model.state_dict())
    loss_fn(own, b).backward()
    return [q.grad.detach().double().reshape(-1) for q in own.parameters()]


def residual_copies(held: list, params: list) -> list:
    """Each parameter's top-k residual ``held`` (None: it holds none) as a flat float64 copy (the engines
    update it in place), zeros where it holds none: the books' ``before`` and ``after``."""
    return [h.detach().double().clone() if h is not None
            else torch.zeros(p.numel(), dtype=torch.float64, device=p.device) for h, p in zip(held, params)]


def books(grads: list, before: list, after: list) -> torch.Tensor:
    """A rank's error-feedback books, ``(2, d)`` float64, to be summed over ranks for :func:`books_check`:
    g + residual_before - residual_after, and the mass |g| + |residual_before|, per coordinate."""
    return torch.stack([torch.cat([g + b - a for g, b, a in zip(grads, before, after)]),
                        torch.cat([g.abs() + b.abs() for g, b in zip(grads, before)])])


def books_check(applied, expected, mass, rtol) -> dict:
    """Top-k's error feedback conserved: ``applied`` (what the engine applied, the average) against
    ``expected`` = sum_r (g_r + residual_before_r - residual_after_r) / n, coordinate by coordinate.
    The bound is the codec's contract on the sum of the ranks' selections (each value within ``rtol``
    of their mass) plus float32 rounding (of g + residual in the selection, of the sum and the division),
    with ``mass`` = sum_r (|g_r| + |residual_before_r|) / n, which bounds the selections' mass."""
    err = (applied - expected).abs()
    bound = (rtol + 2.0 ** -20) * mass
    return {"over_bound": float((err / bound.clamp_min(1e-300)).max()), "max_error": float(err.max()),
            "max_expected": float(expected.abs().max()), "rtol": rtol,
            "applied_nonzero": int((applied != 0).sum()), "expected_nonzero": int((expected != 0).sum()),
            "numel": applied.numel()}


def half_precision_error(got: torch.Tensor, ref_sum: torch.Tensor, mag_sum: torch.Tensor, n: int, dtype) -> tuple:
    """``(worst, zeros_exact)`` for a reduced gradient ``got`` of a model in ``dtype`` (bfloat16 or
    float16), given the float64 sums over the n ranks of their local gradients (``ref_sum``) and of
    their magnitudes (``mag_sum``). Allowed at a coordinate, with m = mag_sum / n and u the dtype's unit
    roundoff: ``(2^-10 + (n + 1) u) m + (n + 1) tiny eps / 2``, the contract's rtol plus n + 1
    roundings to the dtype and as many half spacings of its subnormals (a float16 gradient of ~1e-7
    is one), which bounds a dense allreduce in that dtype too (it rounds at every addition).
    ``worst``: the largest error over its allowance (<= 1 passes; a NaN counts as out of bound);
    ``zeros_exact``: every coordinate no rank touched is an exact zero."""
    info = torch.finfo(dtype)
    rel, absolute = 2.0 ** -10 + (n + 1) * info.eps / 2, (n + 1) * info.tiny * info.eps / 2
    got = got.double()
    touched = mag_sum > 0
    zeros_exact = bool((got[~touched] == 0).all())
    if not touched.any():
        return 0.0, zeros_exact
    ratio = (got - ref_sum / n).abs()[touched] / (rel * mag_sum[touched] / n + absolute)
    return float(torch.nan_to_num(ratio, nan=math.inf).max()), zeros_exact


def bag_batch(step: int, rank: int, bags: int = 6, rows: int = 3000):
    """Rank 0's bags are empty (its gradient lists no row); ranks 1.. share hot rows 0..19 and draw the
    rest from disjoint ranges (rank r: rows from 1000 r on)."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    if rank == 0:
        return torch.zeros(0, dtype=torch.int64), torch.zeros(bags, dtype=torch.int64), torch.rand(bags, generator=g)
    per_bag = 5
    hot = torch.randint(0, 20, (bags, 2), generator=g)
    own = 1000 * rank + torch.randint(0, 900, (bags, per_bag - 2), generator=g)
    ids = torch.cat([hot, own], dim=1).reshape(-1)
    return ids, torch.arange(0, bags * per_bag, per_bag), torch.rand(bags, generator=g)


def bag_loss(model, b):
    ids, offsets, y = b
    return torch.nn.functional.mse_loss(model(ids, offsets), y)


class CountedCollectives:
    """While active, records each call of the torch.distributed collectives ``names`` (``all_reduce``,
    ``all_gather``, ``all_to_all_single``: the FSDP2 plugin's reduce-scatter, ``reduce_scatter_single`` or
    ``reduce_scatter_tensor``: FSDP2's own, as the plugin calls it in the step guard's dense window; names
    this torch lacks are left out) as ``[name, input dtype,
    input bytes]`` in ``calls``: what our hooks put on the wire (DDP's and FSDP2's own C++ collectives
    do not go through these functions)."""

    # the input tensor's position
    INPUT = {"all_reduce": 0, "all_gather": 1, "all_to_all_single": 1, "reduce_scatter_single": 1,
             "reduce_scatter_tensor": 1}

    def __init__(self, *names: str):
        self.names, self.calls, self._saved = names, [], {}

    def __enter__(self):
        import torch.distributed as dist
        for name in self.names:
            if not hasattr(dist, name):
                continue
            self._saved[name] = original = getattr(dist, name)
            setattr(dist, name, self._counting(name, original))
        return self

    def __exit__(self, *exc):
        import torch.distributed as dist
        for name, original in self._saved.items():
            setattr(dist, name, original)

    def _counting(self, name, original):
        def call(*args, **kw):
            t = args[self.INPUT[name]]
            self.calls.append([name, str(t.dtype), t.numel() * t.element_size()])
            return original(*args, **kw)
        return call

    def bytes(self, name: str = "all_reduce") -> int:
        return sum(nbytes for n, _, nbytes in self.calls if n == name)
