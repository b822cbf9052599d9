"""Data-parallel training driver for the examples, `make demo` and the tests.

    horovodrun -np 2 -H localhost:2 --gloo python -m lossless_hc.workloads.train --model ncf \
        --framework horovod --compression lossless
    torchrun --standalone --nproc_per_node 2 -m lossless_hc.workloads.train --model ncf --framework ddp ...

Every rank builds the same model from the same seed and draws its own batches; rank 0 prints loss,
accuracy, bytes sent per step vs dense, step time and fallbacks, and optionally writes them as JSON
(``--json``) and the final parameters (``--save-params``) for comparisons between runs.
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from . import data, models

COMPRESSIONS = ("none", "fp16", "lossless", "topk", "thc")


# -- workloads: model, batches, loss, evaluation ---------------------------------------------------
class Workload:
    name = ""
    metric = ""

    def __init__(self, args, rank: int):
        self.args, self.rank = args, rank

    def loss(self, model, batch) -> torch.Tensor:
        raise NotImplementedError

    def evaluate(self, model) -> float:
        raise NotImplementedError


class NCFWorkload(Workload):
    name, metric = "ncf", "hit_rate@10"
    sparse_grads = True

    def __init__(self, args, rank):
        super().__init__(args, rank)
        self.data = data.ImplicitFeedback(args.users, args.items, seed=args.seed)
        self.model = models.NCF(args.users, args.items, dim=args.dim, sparse=args.sparse_embeddings)
        self.batches = self.data.batches(args.batch, negatives=1, seed=args.seed * 1000 + rank + 1)

    def loss(self, model, batch):
        users, items, labels = batch
        return F.binary_cross_entropy_with_logits(model(users, items), labels)

    def evaluate(self, model):
        return self.data.hit_rate(model)


class LSTMWorkload(Workload):
    name, metric = "lstm", "perplexity"

    def __init__(self, args, rank):
        super().__init__(args, rank)
        ids, vocab = data.python_source_corpus(vocab=args.vocab)
        split = int(0.95 * ids.numel())
        self.train_ids, self.test_ids = ids[:split], ids[split:]
        self.model = models.LSTMLanguageModel(len(vocab), sparse=args.sparse_embeddings)
        self.gen = torch.Generator().manual_seed(args.seed * 1000 + rank + 1)
        self.seq = 35
        self.batches = self._batches()

    def _batches(self):
        while True:
            start = torch.randint(0, self.train_ids.numel() - self.seq - 1, (self.args.batch,), generator=self.gen)
            window = torch.stack([self.train_ids[s:s + self.seq + 1] for s in start.tolist()])
            yield window[:, :-1], window[:, 1:]

    def loss(self, model, batch):
        x, y = batch
        logits = model(x)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))

    @torch.no_grad()
    def evaluate(self, model):
        n = (self.test_ids.numel() - 1) // self.seq * self.seq
        x = self.test_ids[:n].reshape(-1, self.seq)[:64]
        y = self.test_ids[1:n + 1].reshape(-1, self.seq)[:64]
        return float(math.exp(self.loss(model, (x, y))))


class DigitsWorkload(Workload):
    name, metric = "digits", "accuracy"

    def __init__(self, args, rank):
        super().__init__(args, rank)
        x, y = data.digits()
        perm = torch.randperm(x.shape[0], generator=torch.Generator().manual_seed(0))
        test, train = perm[:360], perm[360:]
        self.test = x[test], y[test]
        self.train = x[train], y[train]
        self.model = models.DigitsCNN()
        self.gen = torch.Generator().manual_seed(args.seed * 1000 + rank + 1)
        self.batches = self._batches()

    def _batches(self):
        x, y = self.train
        while True:
            pick = torch.randint(0, x.shape[0], (self.args.batch,), generator=self.gen)
            yield x[pick], y[pick]

    def loss(self, model, batch):
        x, y = batch
        return F.cross_entropy(model(x), y)

    @torch.no_grad()
    def evaluate(self, model):
        x, y = self.test
        return float((model(x).argmax(dim=1) == y).float().mean())


WORKLOADS = {w.name: w for w in (NCFWorkload, LSTMWorkload, DigitsWorkload)}
DEFAULTS = {  # per model: batch, optimizer, lr, steps
    "ncf": dict(batch=512, optimizer="sgd", lr=0.3, steps=150),
    "lstm": dict(batch=16, optimizer="adam", lr=0.002, steps=100),
    "digits": dict(batch=32, optimizer="sgd", lr=0.05, steps=300),
}
OPTIMIZERS = {"sgd": lambda params, lr: torch.optim.SGD(params, lr=lr, momentum=0.9),
              "adam": lambda params, lr: torch.optim.Adam(params, lr=lr)}


# -- frameworks ------------------------------------------------------------------------------------
class Horovod:
    def __init__(self, args):
        import horovod.torch as hvd

        self.hvd = hvd
        hvd.init()
        self.rank, self.size = hvd.rank(), hvd.size()
        self.compressor = None

    def wrap(self, model, opt, args):
        hvd = self.hvd
        from lossless_hc.plugins.horovod import Compression

        if args.compression == "lossless":
            self.compressor = Compression.lossless(max_density=args.max_density)
        elif args.compression == "topk":
            self.compressor = Compression.topk(ratio=args.topk_ratio)
        elif args.compression == "thc":
            self.compressor = Compression.thc(bits=args.thc_bits)
        comp = {"none": Compression.none, "fp16": Compression.fp16}.get(args.compression, self.compressor)
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(), compression=comp,
                                       op=hvd.Average, sparse_as_dense=args.sparse_embeddings)
        return model, opt

    def stats(self):
        return self.compressor.stats() if self.compressor else None

    def shutdown(self):
        self.hvd.shutdown()


class DDP:
    def __init__(self, args):
        import torch.distributed as dist

        self.dist = dist
        # Gloo between CPU workers; NCCL when each worker trains on its own GPU.
        dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
        self.rank, self.size = dist.get_rank(), dist.get_world_size()
        self.state = None

    def wrap(self, model, opt, args):
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        from torch.nn.parallel import DistributedDataParallel

        from lossless_hc.plugins.ddp import LosslessHookState, lossless_hook, thc_hook

        ddp = DistributedDataParallel(model, device_ids=[torch.cuda.current_device()] if args.device == "cuda" else None)
        if args.compression == "fp16":
            ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
        elif args.compression in ("lossless", "topk"):
            topk = args.topk_ratio if args.compression == "topk" else None
            self.state = LosslessHookState(max_density=args.max_density, topk_ratio=topk)
            ddp.register_comm_hook(self.state, lossless_hook)
        elif args.compression == "thc":
            self.state = LosslessHookState(codec="thc", bits=args.thc_bits)
            ddp.register_comm_hook(self.state, thc_hook)
        return ddp, opt

    def stats(self):
        return self.state.stats() if self.state else None

    def shutdown(self):
        self.dist.destroy_process_group()


# -- the loop --------------------------------------------------------------------------------------
def parse_args(argv=None, default_model="ncf"):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=sorted(WORKLOADS), default=default_model)
    p.add_argument("--framework", choices=("horovod", "ddp"), default="horovod")
    p.add_argument("--compression", choices=COMPRESSIONS, default="lossless")
    p.add_argument("--steps", type=int, help="training steps (default per model)")
    p.add_argument("--batch", type=int, help="per-rank batch (default per model)")
    p.add_argument("--optimizer", choices=sorted(OPTIMIZERS), help="default per model")
    p.add_argument("--lr", type=float, help="learning rate (default per model)")
    p.add_argument("--max-density", type=float, default=0.03, help="lossless: initial capacity per tensor")
    p.add_argument("--topk-ratio", type=float, default=0.01, help="topk: fraction of each tensor sent")
    p.add_argument("--thc-bits", type=int, default=4, help="thc: bits per coordinate (table of 2^bits levels)")
    p.add_argument("--sparse-embeddings", action="store_true",
                   help="nn.Embedding(sparse=True) (Horovod: aggregated with sparse_as_dense=True)")
    p.add_argument("--users", type=int, default=50_000)
    p.add_argument("--items", type=int, default=50_000)
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--vocab", type=int, default=20_000)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cuda: one GPU per worker (LOCAL_RANK), NCCL for DDP")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=25)
    p.add_argument("--json", help="rank 0 writes the results here")
    p.add_argument("--save-params", help="rank 0 saves the final parameters here (torch.save)")
    args = p.parse_args(argv)
    for key, value in DEFAULTS[args.model].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


def dense_grad_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)


def main(argv=None, default_model="ncf") -> dict:
    args = parse_args(argv, default_model)
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", os.environ.get("HOROVOD_LOCAL_RANK", "0"))))
    fw = Horovod(args) if args.framework == "horovod" else DDP(args)
    # Leave each rank its share of the cores: oversubscribed intra-op threads swamp step times.
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // fw.size))
    torch.manual_seed(args.seed)
    work = WORKLOADS[args.model](args, fw.rank)
    model = work.model.to(args.device)

    def evaluate() -> float:  # the data sets live on the CPU
        return work.evaluate(model if args.device == "cpu" else copy.deepcopy(model).cpu())
    opt = OPTIMIZERS[args.optimizer](model.parameters(), args.lr)
    wrapped, opt = fw.wrap(model, opt, args)
    say = print if fw.rank == 0 else (lambda *a, **k: None)
    dense_bytes = dense_grad_bytes(model)
    say(f"{args.model} on {fw.size} {args.framework} worker(s), compression={args.compression}: "
        f"{sum(p.numel() for p in model.parameters()):,} parameters, {dense_bytes / 2**20:.1f} MiB of gradients "
        f"per step; {work.metric} before training {evaluate():.4f}")

    step_times, losses = [], []
    for step in range(1, args.steps + 1):
        batch = tuple(t.to(args.device) for t in next(work.batches))
        t0 = time.perf_counter()
        opt.zero_grad()  # set_to_none=True, torch 2.x default (Horovod 0.28 takes no arguments)
        loss = work.loss(wrapped, batch)
        loss.backward()
        opt.step()
        step_times.append(time.perf_counter() - t0)
        losses.append(float(loss.detach()))
        if step % args.log_every == 0 or step == args.steps:
            say(f"step {step:5d}  loss {statistics.fmean(losses[-args.log_every:]):.4f}  "
                f"step {1e3 * statistics.median(step_times[-args.log_every:]):.1f} ms")

    stats = fw.stats()
    sent = {"none": dense_bytes, "fp16": dense_bytes / 2}.get(args.compression)
    if sent is None:
        sent = stats["payload_bytes"] / args.steps
    result = {
        "model": args.model, "framework": args.framework, "compression": args.compression,
        "workers": fw.size, "steps": args.steps, "final_loss": statistics.fmean(losses[-10:]),
        "metric": work.metric, "value": evaluate(),
        "bytes_per_step": sent, "dense_bytes_per_step": dense_bytes,
        "step_ms_median": 1e3 * statistics.median(step_times[1:] or step_times),
        "fallbacks": stats["fallbacks"] if stats else 0, "stats": stats,
    }
    say(f"{work.metric} {result['value']:.4f}; sent {sent / 2**20:.2f} MiB per step "
        f"({sent / dense_bytes:.3f} of dense); median step {result['step_ms_median']:.1f} ms; "
        f"fallbacks {result['fallbacks']}")
    if fw.rank == 0:
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=2)
        if args.save_params:
            torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, args.save_params)
    fw.shutdown()
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
