"""Offline data sets for the workloads: nothing is downloaded."""
from __future__ import annotations

import collections
import os
import re
import sysconfig

import torch


def zipf_weights(n: int, s: float) -> torch.Tensor:
    """Normalized Zipf(s) probabilities of ranks 0..n-1: ``(1 + r) ** -s / sum``, float64."""
    if n < 1 or s < 0:
        raise ValueError(f"zipf_weights needs n >= 1 and s >= 0, got n={n}, s={s}")
    w = (1.0 + torch.arange(n, dtype=torch.float64)) ** -s
    return w / w.sum()


def expected_distinct(weights: torch.Tensor, draws: int) -> float:
    """Expected number of distinct categories among ``draws`` independent draws from the
    probabilities ``weights``: sum_i 1 - (1 - p_i) ** draws."""
    return float((1.0 - torch.exp(draws * torch.log1p(-weights.clamp(max=1 - 1e-16)))).sum())


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

    def batches(self, batch: int, negatives: int, seed: int, skew: float = 0.0):
        """Endless (users, items, labels) batches: ``batch`` interactions and ``negatives`` sampled
        non-interactions per interaction, from a rank-specific stream (``seed``).

        ``skew`` = 0: interactions uniformly (every user equally often), negatives uniform over
        the items. ``skew`` = s > 0: a user is picked with probability proportional to
        ``(1 + r) ** -s`` where r is its place in a fixed random order of the users (the same on
        every rank), then one of its interactions uniformly; negatives are picked with
        probability proportional to ``(1 + i) ** -s`` for item i (popular items first)."""
        if skew < 0:
            raise ValueError(f"skew must be >= 0, got {skew}")
        g = torch.Generator().manual_seed(seed)
        n = self.train_users.numel()
        per_user = n // self.num_users
        if skew > 0:
            user_order = torch.randperm(self.num_users, generator=torch.Generator().manual_seed(0x5eed))
            user_w = torch.empty(self.num_users, dtype=torch.float64)
            user_w[user_order] = zipf_weights(self.num_users, skew)
            item_w = zipf_weights(self.num_items, skew)
        while True:
            if skew > 0:
                users = torch.multinomial(user_w, batch, replacement=True, generator=g)
                pick = users * per_user + torch.randint(0, per_user, (batch,), generator=g)
                neg_items = torch.multinomial(item_w, batch * negatives, replacement=True, generator=g)
            else:
                pick = torch.randint(0, n, (batch,), generator=g)
                neg_items = torch.randint(0, self.num_items, (batch * negatives,), generator=g)
            users = self.train_users[pick]
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
