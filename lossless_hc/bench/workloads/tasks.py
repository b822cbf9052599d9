"""The training tasks of :mod:`lossless_hc.bench.workloads.train`: model, per-rank batches, loss and
evaluation for each ``--model``.

Every task builds its model and data once and draws each rank's batches from its own stream
(``batches_for(rank)``), so one process can also produce the batches of several ranks (the replay
recorder, :mod:`lossless_hc.bench.workloads.replay`).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from lossless_hc.bench.workloads import data, models


class Workload:
    name = ""
    metric = ""
    higher_is_better = True  # direction of ``metric`` (time-to-accuracy targets: reach >= or <=)

    def __init__(self, args, rank: int):
        self.args, self.rank = args, rank

    def finish_init(self) -> None:
        """Called by subclasses once model and data exist: this rank's batch stream."""
        self.batches = self.batches_for(self.rank)

    def rank_seed(self, rank: int) -> int:
        return self.args.seed * 1000 + rank + 1

    def batches_for(self, rank: int):
        """An endless iterator of rank ``rank``'s batches (tuples of tensors)."""
        raise NotImplementedError

    def loss(self, model, batch) -> torch.Tensor:
        raise NotImplementedError

    def evaluate(self, model) -> float:
        raise NotImplementedError


class NCFWorkload(Workload):
    """NCF on :class:`data.ImplicitFeedback`. ``--skew s`` (s > 0) draws each batch's users from a
    Zipf(s) law over a fixed random order of the users and its negative items from Zipf(s) over the
    items' popularity order (hot users and items recur across ranks, so the ranks' embedding
    supports overlap); s = 0 keeps uniform users and negatives."""
    name, metric = "ncf", "hit_rate@10"
    sparse_grads = True

    def __init__(self, args, rank):
        super().__init__(args, rank)
        self.data = data.ImplicitFeedback(args.users, args.items, seed=args.seed)
        self.model = models.NCF(args.users, args.items, dim=args.dim, sparse=args.sparse_embeddings)
        self.finish_init()

    def batches_for(self, rank):
        return self.data.batches(self.args.batch, negatives=1, seed=self.rank_seed(rank),
                                 skew=getattr(self.args, "skew", 0.0))

    def loss(self, model, batch):
        users, items, labels = batch
        return F.binary_cross_entropy_with_logits(model(users, items), labels)

    def evaluate(self, model):
        # held-out interactions of users drawn as the training batches draw them (uniform or Zipf)
        return self.data.hit_rate(model, skew=getattr(self.args, "skew", 0.0))


class LSTMWorkload(Workload):
    """Word-level language model on real text: the Python standard library's own sources
    (:func:`data.python_source_corpus`), so the input embedding's gradient rows follow the token
    frequencies of real code."""
    name, metric = "lstm", "perplexity"
    higher_is_better = False
    seq = 35
    eval_windows = 64

    def __init__(self, args, rank):
        super().__init__(args, rank)
        every = getattr(args, "held_out_files", 0)
        if every:  # validation on whole held-out files, vocabulary from the training files
            self.train_ids, self.test_ids, vocab, _ = data.python_source_split(vocab=args.vocab, held_out_every=every)
            self.eval_windows = getattr(args, "eval_windows", self.eval_windows)
        else:      # the last 5% of the token stream
            ids, vocab = data.python_source_corpus(vocab=args.vocab)
            split = int(0.95 * ids.numel())
            self.train_ids, self.test_ids = ids[:split], ids[split:]
        self.model = models.LSTMLanguageModel(len(vocab), sparse=args.sparse_embeddings)
        self.finish_init()

    def batches_for(self, rank):
        gen = torch.Generator().manual_seed(self.rank_seed(rank))
        while True:
            start = torch.randint(0, self.train_ids.numel() - self.seq - 1, (self.args.batch,), generator=gen)
            window = torch.stack([self.train_ids[s:s + self.seq + 1] for s in start.tolist()])
            yield window[:, :-1], window[:, 1:]

    def loss(self, model, batch):
        x, y = batch
        logits = model(x)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))

    @torch.no_grad()
    def evaluate(self, model):
        n = (self.test_ids.numel() - 1) // self.seq * self.seq
        x = self.test_ids[:n].reshape(-1, self.seq)[:self.eval_windows]
        y = self.test_ids[1:n + 1].reshape(-1, self.seq)[:self.eval_windows]
        return float(math.exp(self.loss(model, (x, y))))


class DigitsWorkload(Workload):
    """The small CNN on scikit-learn's digits: a fixed held-out test set of 360 images (20%, the
    same for every seed), training batches drawn from the other 1437."""
    name, metric = "digits", "accuracy"
    test_size = 360

    def __init__(self, args, rank):
        super().__init__(args, rank)
        x, y = data.digits()
        perm = torch.randperm(x.shape[0], generator=torch.Generator().manual_seed(0))
        test, train = perm[:self.test_size], perm[self.test_size:]
        self.test_index, self.train_index = test, train
        self.test = x[test], y[test]
        self.train = x[train], y[train]
        self.model = models.DigitsCNN()
        self.finish_init()

    def batches_for(self, rank):
        gen = torch.Generator().manual_seed(self.rank_seed(rank))
        x, y = self.train
        while True:
            pick = torch.randint(0, x.shape[0], (self.args.batch,), generator=gen)
            yield x[pick], y[pick]

    def loss(self, model, batch):
        x, y = batch
        return F.cross_entropy(model(x), y)

    @torch.no_grad()
    def evaluate(self, model):
        x, y = self.test
        return float((model(x).argmax(dim=1) == y).float().mean())


class VGGWorkload(Workload):
    name, metric = "vgg", "accuracy"

    def __init__(self, args, rank):
        super().__init__(args, rank)
        self.model = models.SmallVGG()
        # Random images labelled by a fixed random linear teacher: learnable, nothing downloaded.
        self.teacher = torch.randn(3 * 32 * 32, 10, generator=torch.Generator().manual_seed(args.seed))
        self.finish_init()

    def _batch(self, n, gen):
        x = torch.randn(n, 3, 32, 32, generator=gen)
        return x, (x.flatten(1) @ self.teacher).argmax(dim=1)

    def batches_for(self, rank):
        gen = torch.Generator().manual_seed(self.rank_seed(rank))
        while True:
            yield self._batch(self.args.batch, gen)

    def loss(self, model, batch):
        x, y = batch
        return F.cross_entropy(model(x), y)

    @torch.no_grad()
    def evaluate(self, model):
        x, y = self._batch(256, torch.Generator().manual_seed(12345))
        return float((model(x).argmax(dim=1) == y).float().mean())


class BERTWorkload(Workload):
    """Masked-token prediction on random tokens drawn from a Zipf-like distribution (the loss can
    fall to the distribution's entropy: that is what there is to learn)."""
    name, metric = "bert", "mlm_loss"
    higher_is_better = False
    seq, mask_fraction = 64, 0.15

    def __init__(self, args, rank):
        super().__init__(args, rank)
        self.vocab = args.vocab
        self.model = models.SmallBERT(vocab=self.vocab, max_len=self.seq, sparse=args.sparse_embeddings)
        self.weights = (1.0 + torch.arange(self.vocab, dtype=torch.float64)) ** -1.0
        self.finish_init()

    def _batch(self, n, gen):
        tokens = torch.multinomial(self.weights, n * self.seq, replacement=True, generator=gen).view(n, self.seq)
        masked = torch.rand(n, self.seq, generator=gen) < self.mask_fraction
        inputs = tokens.masked_fill(masked, 0)  # token 0 doubles as [MASK]
        return inputs, tokens.masked_fill(~masked, -100)

    def batches_for(self, rank):
        gen = torch.Generator().manual_seed(self.rank_seed(rank))
        while True:
            yield self._batch(self.args.batch, gen)

    def loss(self, model, batch):
        x, y = batch
        logits = model(x)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), ignore_index=-100)

    @torch.no_grad()
    def evaluate(self, model):
        return float(self.loss(model, self._batch(32, torch.Generator().manual_seed(12345))))


WORKLOADS = {w.name: w for w in (NCFWorkload, LSTMWorkload, DigitsWorkload, VGGWorkload, BERTWorkload)}
DEFAULTS = {  # per model: batch, optimizer, lr, steps
    "ncf": dict(batch=512, optimizer="sgd", lr=0.3, steps=150),
    "lstm": dict(batch=16, optimizer="adam", lr=0.002, steps=100),
    "digits": dict(batch=32, optimizer="sgd", lr=0.05, steps=300),
    "vgg": dict(batch=32, optimizer="sgd", lr=0.02, steps=100),
    "bert": dict(batch=16, optimizer="adam", lr=0.0005, steps=100),
}
OPTIMIZERS = {"sgd": lambda params, lr: torch.optim.SGD(params, lr=lr, momentum=0.9),
              "adam": lambda params, lr: torch.optim.Adam(params, lr=lr)}


def coalesce_sparse_state(opt: torch.optim.Optimizer) -> None:
    """Coalesce every sparse tensor in ``opt``'s state (after ``opt.step()``). torch's SGD keeps the
    momentum of a sparse gradient (``nn.Embedding(sparse=True)``) as a sparse buffer that
    ``mul_().add_()`` extends by every step's rows without summing duplicates, so its size, and the
    step's time, grow with the step count (NCF's compute-only step went from 9 to 63 ms over 100
    steps); coalesced, it holds each row touched so far once. Same values (sums of the same terms)."""
    for state in opt.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.is_sparse and not value.is_coalesced():
                state[key] = value.coalesce()
