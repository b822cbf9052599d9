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
        # .squeeze is a view, and FSDP2 warns about a wrapped module that returns one (an in-place op on
        # it would skip FSDP's pre-backward hook): the copy of one logit per example costs nothing
        return self.out(torch.cat([gmf, mlp], dim=-1)).squeeze(-1).clone()


class LSTMLanguageModel(nn.Module):
    """Word-level LSTM language model. Input and output embeddings are not tied, so the input
    embedding's gradient stays row-sparse (only the batch's tokens) while the decoder's is dense."""

    def __init__(self, vocab: int, dim: int = 128, hidden: int = 256, layers: int = 2, sparse: bool = False):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim, sparse=sparse)
        # Sequence-first: with batch_first=True the LSTM returns its (time, batch) output transposed, a view,
        # which FSDP2 warns about when the LSTM is a wrapped module. Transposing here instead computes the
        # same (batch_first=True transposes the input and the output exactly so) and the decoder gets the
        # same strided tensor.
        self.lstm = nn.LSTM(dim, hidden, num_layers=layers)
        self.decoder = nn.Linear(hidden, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """(batch, time) token ids -> (batch, time, vocab) logits."""
        h, _ = self.lstm(self.embed(tokens).transpose(0, 1))
        return self.decoder(h.transpose(0, 1))


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


class SmallVGG(nn.Module):
    """A small VGG-style CNN for 32x32 RGB inputs (stacks of 3x3 convolutions and max-pooling, then
    a wide fully connected classifier that holds most of the parameters): dense gradients."""

    def __init__(self, classes: int = 10, widths: tuple = (32, 64, 128), hidden: int = 512):
        super().__init__()
        layers, cin = [], 3
        for w in widths:
            layers += [nn.Conv2d(cin, w, 3, padding=1), nn.ReLU(), nn.Conv2d(w, w, 3, padding=1), nn.ReLU(),
                       nn.MaxPool2d(2)]
            cin = w
        self.features = nn.Sequential(*layers)
        side = 32 // 2 ** len(widths)
        self.classifier = nn.Sequential(nn.Flatten(), nn.Linear(cin * side * side, hidden), nn.ReLU(),
                                        nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


class SmallBERT(nn.Module):
    """A small BERT-style encoder (token + position embeddings, ``torch.nn.TransformerEncoder``, a
    masked-token prediction head; logits flattened over batch and position, see ``forward``). The token
    embedding's gradient is row-sparse (the batch's tokens); the encoder's and the head's are dense."""

    def __init__(self, vocab: int = 30_000, dim: int = 256, heads: int = 4, layers: int = 4,
                 max_len: int = 128, sparse: bool = False):
        super().__init__()
        self.tokens = nn.Embedding(vocab, dim, sparse=sparse)
        self.positions = nn.Parameter(torch.zeros(max_len, dim))
        block = nn.TransformerEncoderLayer(dim, heads, dim_feedforward=4 * dim, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.head = nn.Linear(dim, vocab)
        nn.init.normal_(self.positions, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """(batch, time) token ids -> (batch * time, vocab) logits, flattened over batch and position.

        Flat because nn.Linear over a 3-d input returns a view of its 2-d result (the head's output, and
        the model's), which FSDP2 warns about when the head or the model is a wrapped module; the head over
        the flattened hidden states runs the very same addmm, and a (batch, time, vocab) result would be a
        view again or a copy of the largest activation."""
        h = self.tokens(tokens) + self.positions[: tokens.shape[1]]
        return self.head(self.encoder(h).flatten(0, 1))
