"""BytePS worker for the GPU tests of tests/test_plugins_byteps.py, started by scripts/launch_byteps.sh.

Usage: python byteps_worker.py OUT_DIR

Trains the embedding model of models.py on the GPU with byteps.torch.DistributedOptimizer, from the
same seed on the same per-rank batches: with Compression.lossless, with BytePS's own uncompressed
push_pull, and once more with a capacity so small that the first step falls back to the dense sum
(and the grown payload outgrows its first size: the tail path), against its own uncompressed run.
Every rank writes OUT_DIR/rank<r>.json with what the test asserts.

BytePS fixes a name's size at its first push_pull, so every run names its parameters with its own
prefix. The lossless run goes first: its names are declared first, so the key of
Gradient.lhc.<name> is (position of <name> among the sorted parameter names) << 16, which the test
passes to the server as BYTEPS_SERVER_DEBUG_KEY.
"""
import hashlib
import json
import os
import sys
import traceback

import torch

sys.path.insert(0, os.path.dirname(__file__))
import byteps.torch as bps  # noqa: E402
from models import EmbeddingModel, batch, loss_fn  # noqa: E402

from lossless_hc.plugins.byteps import Compression  # noqa: E402

STEPS = 6


def train(prefix, compression, steps=STEPS, lr=0.1, size=32):
    torch.manual_seed(0)
    model = EmbeddingModel().cuda()
    named = [(f"{prefix}.{n}", p) for n, p in model.named_parameters()]
    opt = bps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=lr), named_parameters=named,
                                   compression=compression)
    rank = bps.rank()
    for step in range(steps):
        opt.zero_grad()
        b = batch(step, rank, size=size)
        loss_fn(model, tuple(t.cuda() for t in b)).backward()
        opt.step()
    torch.cuda.synchronize()
    return {n: p.detach().cpu() for n, p in model.named_parameters()}


def max_diff(a, b):
    return max(float((a[n] - b[n]).abs().max()) for n in a)


def digest(params):
    h = hashlib.sha256()
    for n in sorted(params):
        h.update(params[n].contiguous().numpy().tobytes())
    return h.hexdigest()


def main():
    out_dir = sys.argv[1]
    bps.init()
    torch.cuda.set_device(bps.local_rank())
    rank = bps.rank()
    result = {"rank": rank, "size": bps.size(), "device": f"cuda:{torch.cuda.current_device()}",
              "torch": torch.__version__, "gpu": torch.cuda.get_device_name()}
    try:
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
        # Far too small a capacity with many rows per sample: fallback, growth, tail.
        comp_fb = Compression.lossless(max_density=0.0005)
        got_fb = train("fb", comp_fb, size=256)
        ref_fb = train("fbref", Compression.none, size=256)
        result.update(fallback_max_diff=max_diff(ref_fb, got_fb), fallback_stats=comp_fb.stats(),
                      fallback_digest=digest(got_fb))
    except BaseException as e:  # noqa: BLE001 - reported to the test
        result["error"] = f"{type(e).__name__}: {e}"
        result["traceback"] = traceback.format_exc()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps({k: v for k, v in result.items() if k != "traceback"}), flush=True)
    bps.shutdown()
    if "error" in result:
        sys.exit(1)


if __name__ == "__main__":
    main()
