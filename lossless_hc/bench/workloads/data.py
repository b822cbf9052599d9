"""Offline data sets for the workloads: nothing is downloaded."""
from __future__ import annotations

import collections
import os
import re
import sysconfig

import torch


class ImplicitFeedback:
    """Synthetic implicit feedback with planted structure, for the NCF recommender.

    Items have Zipf-like popularity (item i weighs ``(1 + i) ** -zipf``, as in real interaction
    logs) and users and items each belong to one of ``clusters`` taste groups. A user's interactions
    are items of its own group with probability ``affinity``, else any item, both drawn by
    popularity. A model that learns popularity and then the groups ranks a user's held-out item
    above random ones, so hit rate visibly climbs from its chance level (10/100 for HR@10 among 99
    uniformly drawn negatives).

    Each user has ``per_user`` training interactions and one held-out test item (leave-one-out, as
    in the NCF paper).
    """

    def __init__(self, num_users: int, num_items: int, clusters: int = 32, per_user: int = 16,
                 affinity: float = 0.8, zipf: float = 1.0, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.num_users, self.num_items = num_users, num_items
        self.popularity = (1.0 + torch.arange(num_items, dtype=torch.float64)) ** -zipf
        self.item_group = torch.randint(0, clusters, (num_items,), generator=g)
        self.user_group = torch.randint(0, clusters, (num_users,), generator=g)
        self.train_users = torch.arange(num_users).repeat_interleave(per_user)
        self.train_items = self._sample(self.user_group.repeat_interleave(per_user), affinity, g)
        self.test_items = self._sample(self.user_group, affinity, g)

    def _sample(self, groups: torch.Tensor, affinity: float, g: torch.Generator) -> torch.Tensor:
        items = torch.multinomial(self.popularity, groups.numel(), replacement=True, generator=g)
        in_group = torch.rand(groups.numel(), generator=g) < affinity
        for c in torch.unique(groups[in_group]).tolist():
            rows = torch.nonzero(in_group & (groups == c)).squeeze(1)
            members = torch.nonzero(self.item_group == c).squeeze(1)
            if members.numel():
                pick = torch.multinomial(self.popularity[members], rows.numel(), replacement=True, generator=g)
                items[rows] = members[pick]
        return items

    def batches(self, batch: int, negatives: int, seed: int):
        """Endless (users, items, labels) batches: ``batch`` interactions and ``negatives`` uniformly
        sampled non-interactions per interaction, from a rank-specific stream."""
        g = torch.Generator().manual_seed(seed)
        n = self.train_users.numel()
        while True:
            pick = torch.randint(0, n, (batch,), generator=g)
            users = self.train_users[pick]
            neg_items = torch.randint(0, self.num_items, (batch * negatives,), generator=g)
            yield (torch.cat([users, users.repeat(negatives)]),
                   torch.cat([self.train_items[pick], neg_items]),
                   torch.cat([torch.ones(batch), torch.zeros(batch * negatives)]))

    @torch.no_grad()
    def hit_rate(self, model, users: int = 2000, k: int = 10, candidates: int = 100, seed: int = 1) -> float:
        """HR@k: the fraction of sampled users whose held-out item ranks in the top k among itself
        and ``candidates - 1`` random items."""
        g = torch.Generator().manual_seed(seed)
        u = torch.randint(0, self.num_users, (users,), generator=g)
        items = torch.randint(0, self.num_items, (users, candidates), generator=g)
        items[:, 0] = self.test_items[u]
        scores = model(u[:, None].expand(-1, candidates).reshape(-1), items.reshape(-1)).reshape(users, candidates)
        rank = (scores > scores[:, :1]).sum(dim=1)
        return float((rank < k).float().mean())


_TOKEN = re.compile(r"[A-Za-z_]+|\d+|[^\sA-Za-z_\d]")


def python_source_corpus(max_bytes: int = 4_000_000, vocab: int = 20000):
    """Word-level tokens of the Python standard library's own sources (always on disk), as
    (LongTensor of token ids, vocabulary list); id 0 is <unk>. Deterministic: files in sorted order."""
    root = sysconfig.get_paths()["stdlib"]
    text, size = [], 0
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "test", "idlelib"))
        for name in sorted(filenames):
            if not name.endswith(".py"):
                continue
            try:
                with open(os.path.join(dirpath, name), encoding="utf-8") as f:
                    chunk = f.read()
            except (OSError, UnicodeDecodeError):
                continue
            text.append(chunk)
            size += len(chunk)
            if size >= max_bytes:
                break
        if size >= max_bytes:
            break
    tokens = _TOKEN.findall("\n".join(text))
    common = [w for w, _ in collections.Counter(tokens).most_common(vocab - 1)]
    ids = {w: i + 1 for i, w in enumerate(common)}
    return torch.tensor([ids.get(t, 0) for t in tokens], dtype=torch.long), ["<unk>"] + common


def digits():
    """scikit-learn's bundled 8x8 digits (1797 images) as (images N x 1 x 8 x 8 in [0, 1], labels)."""
    from sklearn.datasets import load_digits

    d = load_digits()
    x = torch.tensor(d.images, dtype=torch.float32).unsqueeze(1) / 16.0
    return x, torch.tensor(d.target, dtype=torch.long)
