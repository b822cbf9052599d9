"""BytePS worker for the GPU tests of tests/test_byteps_gpu.py, started by scripts/launch_byteps.sh.

Usage: python byteps_worker.py OUT_DIR

Trains the embedding model of models.py on LHC_TEST_DEVICE (the GPU test sets cuda; the CPU dry run in
tests/test_byteps_gpu.py runs it on tests/byteps_sim.py's simulated BytePS) with
byteps.torch.DistributedOptimizer, from the same seed on the same per-rank batches: with
Compression.lossless, with BytePS's own uncompressed push_pull, and once more with a capacity so small that
the first step falls back to the dense sum (and the grown payload outgrows its first size: the tail path),
against its own uncompressed run.
Then the embedding model and a small dense model (an MLP) with none, lossless, topk and thc: each
run's losses, parameter digest, largest difference from the uncompressed run and payload bytes pushed
per step. Every rank writes OUT_DIR/rank<r>.json with what the test asserts.

BytePS fixes a name's size at its first push_pull, so every run names its parameters with its own
prefix. The lossless run goes first: its names are declared first, so the key of
Gradient.lhc.<name> is (position of <name> among the sorted parameter names) << 16, which the test
passes to the server as BYTEPS_SERVER_DEBUG_KEY.
"""
import faulthandler
import hashlib
import json
import os
import signal
import sys
import threading
import traceback

import torch

sys.path.insert(0, os.path.dirname(__file__))
import byteps.torch as bps  # noqa: E402
from models import DEVICE, EmbeddingModel, batch, loss_fn  # noqa: E402

from lossless_hc.plugins.byteps import Compression  # noqa: E402

STEPS = 6


class DenseModel(torch.nn.Module):
    """A small MLP: every gradient dense (what topk and thc are for)."""

    def __init__(self, width=64, hidden=512):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(width, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, hidden),
                                       torch.nn.ReLU(), torch.nn.Linear(hidden, 1))

    def forward(self, x):
        return self.net(x).squeeze(-1)


def dense_batch(step, rank, size=64, width=64):
    g = torch.Generator().manual_seed(7000 + 1000 * step + rank)
    x = torch.randn(size, width, generator=g)
    return x, x[:, :8].sum(dim=1)


# The initial parameters come from the global generator: workers run as threads of one process (the CPU
# dry run, tests/test_byteps_gpu.py) seed and draw it one at a time, so that every rank starts alike.
_INIT = threading.Lock()


def train(prefix, compression, steps=STEPS, lr=0.1, size=32, model_name="embedding", losses=None):
    with _INIT:
        torch.manual_seed(0)
        model = (EmbeddingModel() if model_name == "embedding" else DenseModel()).to(DEVICE)
    named = [(f"{prefix}.{n}", p) for n, p in model.named_parameters()]
    opt = bps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=lr), named_parameters=named,
                                   compression=compression)
    rank = bps.rank()
    for step in range(steps):
        opt.zero_grad()
        if model_name == "embedding":
            loss = loss_fn(model, batch(step, rank, size=size))
        else:
            x, y = (t.to(DEVICE) for t in dense_batch(step, rank))
            loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        if losses is not None:
            losses.append(float(loss.detach()))
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()
    return {n: p.detach().cpu() for n, p in model.named_parameters()}


def compare_compressors(steps=10):
    """none, lossless, topk, thc on both models: what the test and docs/BYTEPS.md report."""
    out = {}
    for model_name, lr in (("embedding", 0.1), ("dense", 0.01)):
        runs = {}
        for kind in ("none", "lossless", "topk", "thc"):
            comp = {"none": Compression.none, "lossless": Compression.lossless(max_density=0.05),
                    "topk": Compression.topk(ratio=0.05), "thc": Compression.thc(bits=4)}[kind]
            losses = []
            params = train(f"{model_name}-{kind}", comp, steps=steps, lr=lr, model_name=model_name, losses=losses)
            st = comp.stats() if kind != "none" else {}
            dense_bytes = sum(p.numel() * 4 for p in params.values())
            runs[kind] = {"params": params, "losses": losses, "digest": digest(params), "stats": st,
                          "dense_bytes_per_step": dense_bytes,
                          "payload_bytes_per_step": (st["payload_bytes"] / steps) if st else dense_bytes}
        ref = runs["none"]["params"]
        for r in runs.values():
            r["max_diff"] = max_diff(ref, r.pop("params"))
        out[model_name] = runs
    return out


def max_diff(a, b):
    return max(float((a[n] - b[n]).abs().max()) for n in a)


def digest(params):
    h = hashlib.sha256()
    for n in sorted(params):
        h.update(params[n].contiguous().numpy().tobytes())
    return h.hexdigest()


def lossless_phase(result):
    comp = Compression.lossless(max_density=0.05)
    got = train("lhc", comp)
    ref = train("ref", Compression.none)
    agg = comp.aggregators()["lhc.items.weight"]
    result.update(max_diff=max_diff(ref, got), digest=digest(got), stats=comp.stats(),
                  compressed={n: a.compressed for n, a in comp.aggregators().items()},
                  emb_tensor_name="byteps.Gradient.lhc.items.weight",
                  emb_payload_bytes=agg.codec.payload_numel * 4 if agg.compressed else None,
                  emb_dense_bytes=agg.numel * 4,
                  partition_bytes=int(os.environ.get("BYTEPS_PARTITION_BYTES", 4096000)))


def fallback_phase(result):
    # Far too small a capacity with many rows per sample: fallback, growth, tail.
    comp_fb = Compression.lossless(max_density=0.0005)
    got_fb = train("fb", comp_fb, size=256)
    ref_fb = train("fbref", Compression.none, size=256)
    result.update(fallback_max_diff=max_diff(ref_fb, got_fb), fallback_stats=comp_fb.stats(),
                  fallback_digest=digest(got_fb))


def compressors_phase(result):
    result["compressors"] = compare_compressors()


# Each phase trains under its own names, so one that fails (on every rank alike: the same code on the same
# data) leaves the next ones their own keys: a GPU call reports every phase's failure, not only the first.
PHASES = {"lossless": lossless_phase, "fallback": fallback_phase, "compressors": compressors_phase}


def run(out_dir):
    """Every phase, each rank's results in OUT_DIR/rank<r>.json (rewritten after each phase); returns them."""
    bps.init()
    cuda = DEVICE.type == "cuda"
    if cuda:
        torch.cuda.set_device(bps.local_rank())
    rank = bps.rank()
    result = {"rank": rank, "size": bps.size(), "device": f"cuda:{torch.cuda.current_device()}" if cuda else "cpu",
              "torch": torch.__version__, "gpu": torch.cuda.get_device_name() if cuda else None, "errors": {},
              "finished": []}
    for name, phase in PHASES.items():
        try:
            phase(result)
        except Exception as e:  # noqa: BLE001 - reported to the test, phase by phase
            result["errors"][name] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
        result["finished"].append(name)
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:   # after each phase: a hang keeps the rest
            json.dump(result, f, indent=1)
    print(json.dumps({k: v for k, v in result.items() if k != "errors"}), flush=True)
    for name, err in result["errors"].items():
        print(f"rank {rank}, phase {name}: {err['traceback']}", flush=True)
    bps.shutdown()
    return result


def main():
    # A hang ends with the launcher's SIGTERM (LHC_BYTEPS_TIMEOUT): the log then shows where every Python thread
    # was waiting (BytePS's own threads are C++: its TRACE log level says which stage each push reached).
    faulthandler.register(signal.SIGTERM, all_threads=True, chain=True)
    if run(sys.argv[1])["errors"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
