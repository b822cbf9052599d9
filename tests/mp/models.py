"""Tiny models and batches shared by the multi-process workers (Horovod and DDP)."""
import torch
from torch import nn


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
    return (torch.randint(0, users, (size,), generator=g), torch.randint(0, items, (size,), generator=g),
            torch.rand(size, generator=g))


def loss_fn(model, b):
    u, i, y = b
    return torch.nn.functional.mse_loss(model(u, i), y)


def param_digest(model: nn.Module) -> str:
    """Hash of the parameters' bits: replicas that decode identically stay bit-identical."""
    import hashlib

    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def max_param_diff(a: nn.Module, b: nn.Module) -> float:
    return max(float((p.detach() - q.detach()).abs().max()) for p, q in zip(a.parameters(), b.parameters()))
