"""Models for the examples and benchmarks (random init, torch.nn only)."""
from __future__ import annotations

import torch
from torch import nn


class NCF(nn.Module):
    """Neural collaborative filtering (He et al. 2017): a GMF branch and an MLP branch over user and
    item embeddings, fused into one logit. The embedding tables hold most parameters and their
    gradients are non-zero only in the rows of a batch's users and items: naturally sparse."""

    def __init__(self, num_users: int, num_items: int, dim: int = 32, mlp: tuple = (64, 32, 16),
                 sparse: bool = False, init_std: float = 0.3):
        super().__init__()
        self.user_gmf = nn.Embedding(num_users, dim, sparse=sparse)
        self.item_gmf = nn.Embedding(num_items, dim, sparse=sparse)
        self.user_mlp = nn.Embedding(num_users, dim, sparse=sparse)
        self.item_mlp = nn.Embedding(num_items, dim, sparse=sparse)
        layers, width = [], 2 * dim
        for h in mlp:
            layers += [nn.Linear(width, h), nn.ReLU()]
            width = h
        self.mlp = nn.Sequential(*layers)
        self.out = nn.Linear(dim + width, 1)
        for emb in (self.user_gmf, self.item_gmf, self.user_mlp, self.item_mlp):
            # Wider than the paper's 0.01 so that plain SGD (cheap, sparse-friendly) learns in a few
            # hundred steps; Adam would spend most of a step updating every row of every table.
            nn.init.normal_(emb.weight, std=init_std)

    def forward(self, users: torch.Tensor, items: torch.Tensor) -> torch.Tensor:
        gmf = self.user_gmf(users) * self.item_gmf(items)
        mlp = self.mlp(torch.cat([self.user_mlp(users), self.item_mlp(items)], dim=-1))
        return self.out(torch.cat([gmf, mlp], dim=-1)).squeeze(-1)


class LSTMLanguageModel(nn.Module):
    """Word-level LSTM language model. Input and output embeddings are not tied, so the input
    embedding's gradient stays row-sparse (only the batch's tokens) while the decoder's is dense."""

    def __init__(self, vocab: int, dim: int = 128, hidden: int = 256, layers: int = 2, sparse: bool = False):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim, sparse=sparse)
        self.lstm = nn.LSTM(dim, hidden, num_layers=layers, batch_first=True)
        self.decoder = nn.Linear(hidden, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h, _ = self.lstm(self.embed(tokens))
        return self.decoder(h)


class DigitsCNN(nn.Module):
    """A small CNN for 8x8 digit images (scikit-learn's bundled digits): dense gradients, the case
    for top-k with error feedback."""

    def __init__(self, classes: int = 10):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2))
        self.classifier = nn.Sequential(nn.Flatten(), nn.Linear(64 * 2 * 2, 128), nn.ReLU(), nn.Linear(128, classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))
