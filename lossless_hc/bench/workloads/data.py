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

    def user_weights(self, skew: float) -> torch.Tensor:
        """Probability of each user under ``skew`` s > 0: Zipf(s) over a fixed random order of the
        users (the same on every rank and every seed)."""
        user_order = torch.randperm(self.num_users, generator=torch.Generator().manual_seed(0x5eed))
        user_w = torch.empty(self.num_users, dtype=torch.float64)
        user_w[user_order] = zipf_weights(self.num_users, skew)
        return user_w

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
            user_w = self.user_weights(skew)
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

    def held_out_candidates(self, users: int = 2000, candidates: int = 100, seed: int = 1,
                            skew: float = 0.0) -> tuple:
        """The NCF paper's leave-one-out protocol: (users, items), items ``users x candidates`` with
        column 0 the user's held-out test item and columns 1.. ``candidates - 1`` negatives drawn
        uniformly among the items the user never interacted with (neither in training nor the test
        item). Users are drawn (without replacement) among those whose test item is not also one of
        their training items, so that every positive is unseen in training: uniformly, or with
        ``skew`` > 0 by the training batches' user law (:meth:`user_weights`: the active users'
        held-out interactions, those the model is trained to rank). Deterministic in ``seed``."""
        if candidates < 2 or users < 1:
            raise ValueError(f"need users >= 1 and candidates >= 2, got {users}, {candidates}")
        per_user = self.train_users.numel() // self.num_users
        seen = self.train_items.view(self.num_users, per_user)
        eligible = torch.nonzero(~(seen == self.test_items[:, None]).any(dim=1)).squeeze(1)
        g = torch.Generator().manual_seed(seed)
        if skew > 0:
            pick = torch.multinomial(self.user_weights(skew)[eligible], min(users, eligible.numel()),
                                     replacement=False, generator=g)
        else:
            pick = torch.randperm(eligible.numel(), generator=g)[:users]
        u = eligible[pick]
        item_w = zipf_weights(self.num_items, skew) if skew > 0 else None

        def negatives(count: int) -> torch.Tensor:
            if item_w is None:
                return torch.randint(0, self.num_items, (count,), generator=g)
            return torch.multinomial(item_w, count, replacement=True, generator=g)
        items = negatives(u.numel() * candidates).view(u.numel(), candidates)
        items[:, 0] = self.test_items[u]
        known = torch.cat([seen[u], self.test_items[u, None]], dim=1)
        for _ in range(100):  # redraw negatives that hit a known item
            bad = (items[:, 1:, None] == known[:, None, :]).any(dim=2)
            if not bad.any():
                break
            items[:, 1:][bad] = negatives(int(bad.sum()))
        else:
            raise RuntimeError("could not draw negatives outside the users' interactions")
        return u, items

    @torch.no_grad()
    def hit_rate(self, model, users: int = 2000, k: int = 10, candidates: int = 100, seed: int = 1,
                 skew: float = 0.0) -> float:
        """HR@k on :meth:`held_out_candidates`: the fraction of users whose held-out item scores
        among the top k of itself and ``candidates - 1`` unseen items (chance: k / candidates)."""
        u, items = self.held_out_candidates(users, candidates, seed, skew)
        scores = model(u[:, None].expand(-1, candidates).reshape(-1), items.reshape(-1)).reshape(u.numel(), candidates)
        return hit_rate_at_k(scores, k)


def hit_rate_at_k(scores: torch.Tensor, k: int) -> float:
    """Fraction of rows of ``scores`` (rows x candidates, column 0 the positive) whose positive
    ranks in the top ``k``: fewer than ``k`` candidates score strictly higher (ties favour the
    positive, as a stable sort placing it first would)."""
    if scores.dim() != 2 or scores.shape[1] < 1 or k < 1:
        raise ValueError(f"hit_rate_at_k needs a rows x candidates matrix and k >= 1, got {tuple(scores.shape)}, {k}")
    rank = (scores > scores[:, :1]).sum(dim=1)
    return float((rank < k).float().mean())


_TOKEN = re.compile(r"[A-Za-z_]+|\d+|[^\sA-Za-z_\d]")


def _stdlib_sources(max_bytes: int):
    """(relative path, text) of the standard library's .py files in sorted order (no tests, no
    idlelib, no site-packages), until ``max_bytes`` characters are read."""
    root = sysconfig.get_paths()["stdlib"]
    size = 0
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
            yield os.path.relpath(os.path.join(dirpath, name), root), chunk
            size += len(chunk)
            if size >= max_bytes:
                return


def _vocabulary(tokens: list, vocab: int) -> list:
    return ["<unk>"] + [w for w, _ in collections.Counter(tokens).most_common(vocab - 1)]


def _ids(tokens: list, words: list) -> torch.Tensor:
    ids = {w: i for i, w in enumerate(words)}
    return torch.tensor([ids.get(t, 0) for t in tokens], dtype=torch.long)


def python_source_corpus(max_bytes: int = 4_000_000, vocab: int = 20000):
    """Word-level tokens of the Python standard library's own sources (always on disk), as
    (LongTensor of token ids, vocabulary list); id 0 is <unk>. Deterministic: files in sorted order."""
    tokens = _TOKEN.findall("\n".join(text for _, text in _stdlib_sources(max_bytes)))
    words = _vocabulary(tokens, vocab)
    return _ids(tokens, words), words


def python_source_split(max_bytes: int = 4_000_000, vocab: int = 20000, held_out_every: int = 10):
    """Like :func:`python_source_corpus` but split by file: every ``held_out_every``-th file (in
    sorted order, starting with the last of each group) is held out for validation; the
    vocabulary comes from the training files only (validation words it lacks are <unk>).
    Returns (train ids, validation ids, vocabulary, (train files, validation files))."""
    if held_out_every < 2:
        raise ValueError(f"held_out_every must be >= 2, got {held_out_every}")
    train, valid = [], []
    for i, (path, text) in enumerate(_stdlib_sources(max_bytes)):
        (valid if i % held_out_every == held_out_every - 1 else train).append((path, text))
    train_tokens = _TOKEN.findall("\n".join(t for _, t in train))
    valid_tokens = _TOKEN.findall("\n".join(t for _, t in valid))
    words = _vocabulary(train_tokens, vocab)
    return (_ids(train_tokens, words), _ids(valid_tokens, words), words,
            ([p for p, _ in train], [p for p, _ in valid]))


def digits():
    """scikit-learn's bundled 8x8 digits (1797 images) as (images N x 1 x 8 x 8 in [0, 1], labels)."""
    from sklearn.datasets import load_digits

    d = load_digits()
    x = torch.tensor(d.images, dtype=torch.float32).unsqueeze(1) / 16.0
    return x, torch.tensor(d.target, dtype=torch.long)
