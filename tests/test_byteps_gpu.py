"""BytePS for real (``-m gpu``): 1 scheduler, 1 server and 2 workers sharing one GPU, started by
scripts/launch_byteps.sh running tests/mp/byteps_worker.py; skipped, visibly, without CUDA or BytePS
(scripts/byteps_gpu_session.sh runs it on the GPU machine). The CPU tests of the plugin, on simulated
workers, are tests/test_plugins_byteps.py.
"""
from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def _emb_key() -> int:
    """The BytePS key of Gradient.lhc.items.weight in tests/mp/byteps_worker.py: its optimizer is the
    first, and declares its Gradient.* names sorted, so the key is that name's position << 16."""
    sys.path.insert(0, os.path.join(HERE, "mp"))
    from models import EmbeddingModel as WorkerModel

    names = sorted(n for n, _ in WorkerModel().named_parameters())
    return names.index("items.weight") << 16


def _byteps_available() -> bool:
    return importlib.util.find_spec("byteps") is not None


@pytest.fixture(scope="module")
def byteps_run(tmp_path_factory):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA (BytePS workers need a GPU): run on the GPU machine, scripts/byteps_gpu_session.sh")
    if not _byteps_available():
        pytest.skip("needs BytePS: scripts/setup_byteps.sh (docs/BYTEPS.md)")
    out = tmp_path_factory.mktemp("byteps")
    logs = os.environ.get("LHC_BYTEPS_LOG_DIR") or str(out / "logs")
    os.makedirs(logs, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="2",
               LHC_BYTEPS_LOG_DIR=logs, PS_KEY_LOG="1", BYTEPS_LOG_LEVEL="DEBUG",
               BYTEPS_SERVER_DEBUG="1", BYTEPS_SERVER_DEBUG_KEY=str(_emb_key()))
    cmd = ["bash", os.path.join(ROOT, "scripts", "launch_byteps.sh"), "--workers", "2", "--servers", "1", "--",
           sys.executable, os.path.join(HERE, "mp", "byteps_worker.py"), str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=420)
    if proc.returncode != 0:
        with open(os.path.join(logs, "launch.out"), "w") as f:
            f.write(proc.stdout + "\n--- stderr ---\n" + proc.stderr)
    for r in range(2):   # beside the logs: what docs/BYTEPS.md reports (losses, bytes per step)
        if os.path.exists(out / f"rank{r}.json"):
            shutil.copy(out / f"rank{r}.json", logs)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed (logs in {logs}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return out, logs


@pytest.mark.gpu
def test_byteps_gpu_lossless_matches_uncompressed(byteps_run):
    out, _ = byteps_run
    rs = [json.load(open(os.path.join(out, f"rank{r}.json"))) for r in range(2)]
    for r in rs:
        assert "error" not in r, r.get("traceback")
        assert r["size"] == 2 and r["device"].startswith("cuda")
        assert r["max_diff"] <= 1e-5, r
        assert r["stats"]["compressed"] > 0 and r["stats"]["payload_bytes"] < r["stats"]["dense_bytes"]
        assert r["fallback_max_diff"] <= 1e-5 and r["fallback_stats"]["fallbacks"] >= 1, r
    assert rs[0]["digest"] == rs[1]["digest"], "replicas drifted"


@pytest.mark.gpu
def test_byteps_gpu_server_summed_the_payloads(byteps_run):
    """Server-side evidence: the server's own log (PS_KEY_LOG=1) shows each worker pushing the payload's
    bytes (not the gradient's) for the embedding's key, through the ordinary push handler (no C++
    compressor registered), and BYTEPS_SERVER_DEBUG shows it adding the payloads' first elements (the
    header's contributor field, 1 per worker) into 2 in every round."""
    out, logs = byteps_run
    r0 = json.load(open(os.path.join(out, "rank0.json")))
    server = open(os.path.join(logs, "server0.log")).read()
    worker = open(os.path.join(logs, "worker0.log")).read()
    name = r0["emb_tensor_name"]
    m = re.search(rf"{re.escape(name)} partitioned to (\d+) part\(s\), total_len=(\d+), key_range=\[(\d+), (\d+)\]",
                  worker)
    assert m, f"no partition line for {name} in worker0.log (BYTEPS_LOG_LEVEL=DEBUG)"
    total_len, k0 = int(m.group(2)), int(m.group(3))
    assert total_len == r0["emb_payload_bytes"] < r0["emb_dense_bytes"]
    assert k0 == _emb_key(), (k0, _emb_key())
    pushes = [int(s) for k, s in re.findall(r"push key=(\d+)\s+sender=\d+\s+size=(\d+)", server) if int(k) == k0]
    assert pushes and set(pushes) == {min(total_len, r0["partition_bytes"])}, pushes[:10]
    assert "register compressor" not in server
    # BYTEPS_SERVER_DEBUG_KEY=k0: the server prints the first element of what it receives for this key and,
    # from its engine thread, of its store after adding the second worker's push (the first one's was copied
    # in before, on the same thread), i.e. the payload header's contributor count: 1 from each worker, 2 summed.
    recved = [float(v) for v in re.findall(r"(?:FIRST_WORKER_RECV|OTHER_WORKER_SUM).*?recved: ([-\d.e+]+)", server)]
    summed = [float(v) for v in re.findall(r"ENGINE_SUM_RECV_AFTER\s+dst: ([-\d.e+]+)", server)]
    assert recved and summed, "no BYTEPS_SERVER_DEBUG lines in server0.log"
    assert set(recved) == {1.0} and set(summed) == {2.0}, (recved[:10], summed[:10])
    assert len(summed) == len(recved) // 2, (len(summed), len(recved))   # one sum per round of two pushes


@pytest.mark.gpu
def test_byteps_gpu_compressors_on_embedding_and_dense_models(byteps_run):
    """none, lossless, topk and thc through the real BytePS on both models: lossless equal to the
    uncompressed run, every compressor's replicas bit-identical, topk and thc pushing fewer bytes than
    dense and still training (finite losses; thc's loss falls on the dense model)."""
    out, _ = byteps_run
    rs = [json.load(open(os.path.join(out, f"rank{r}.json"))) for r in range(2)]
    for r in rs:
        assert "error" not in r, r.get("traceback")
    for model in ("embedding", "dense"):
        runs = [r["compressors"][model] for r in rs]
        for kind in ("none", "lossless", "topk", "thc"):
            assert runs[0][kind]["digest"] == runs[1][kind]["digest"], f"{model}/{kind}: replicas drifted"
            assert all(math.isfinite(v) for v in runs[0][kind]["losses"]), (model, kind, runs[0][kind]["losses"])
        assert runs[0]["lossless"]["max_diff"] <= 1e-5, (model, runs[0]["lossless"]["max_diff"])
        for kind in ("topk", "thc"):
            r = runs[0][kind]
            assert r["stats"]["compressed"] > 0 and r["payload_bytes_per_step"] < r["dense_bytes_per_step"], (model, kind, r)
    losses = runs[0]["thc"]["losses"]   # the dense model's
    assert sum(losses[-3:]) / 3 < losses[0], losses
