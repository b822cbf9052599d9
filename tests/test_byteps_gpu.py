"""BytePS for real (``-m gpu``): 1 scheduler, 1 server and 2 workers sharing one GPU, started by
scripts/launch_byteps.sh running tests/mp/byteps_worker.py; skipped, visibly, without CUDA or BytePS
(scripts/byteps_gpu_session.sh runs it on the GPU machine). The CPU tests of the plugin, on simulated
workers, are tests/test_plugins_byteps.py, tests/test_plugins_byteps_training.py and
tests/test_plugins_byteps_engine.py.

``test_worker_dry_run_on_simulated_byteps`` (CPU, every run) runs the same worker, unchanged, on two
threads over tests/byteps_sim.py and applies the GPU tests' checks of its results (not the server's
logs): a GPU call, rare and short, then finds the worker and the checks already working.
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

from processes import run_launcher

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
    # The workers' own limit ends before this test's, so a hang leaves the launcher time to stop the job and
    # each worker's log its Python threads' stacks (tests/mp/byteps_worker.py) and, at BytePS's TRACE level,
    # the stage each push reached (a few MB a run); a healthy run takes well under a minute.
    worker_timeout = int(os.environ.get("LHC_BYTEPS_TIMEOUT", "240"))
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="2",
               LHC_TEST_DEVICE="cuda", LHC_BYTEPS_TIMEOUT=str(worker_timeout),
               LHC_BYTEPS_LOG_DIR=logs, PS_KEY_LOG="1", BYTEPS_LOG_LEVEL="TRACE",
               BYTEPS_SERVER_DEBUG="1", BYTEPS_SERVER_DEBUG_KEY=str(_emb_key()))
    cmd = ["bash", os.path.join(ROOT, "scripts", "launch_byteps.sh"), "--workers", "2", "--servers", "1", "--",
           sys.executable, os.path.join(HERE, "mp", "byteps_worker.py"), str(out)]
    proc = run_launcher(cmd, cwd=ROOT, env=env, timeout=worker_timeout + 60)
    if proc.returncode != 0:
        with open(os.path.join(logs, "launch.out"), "w") as f:
            f.write(proc.stdout + "\n--- stderr ---\n" + proc.stderr)
    for r in range(2):   # beside the logs: what docs/BYTEPS.md reports (losses, bytes per step)
        if os.path.exists(out / f"rank{r}.json"):
            shutil.copy(out / f"rank{r}.json", logs)
    # A phase that failed is reported by its own test (each rank's JSON records it); no JSON at all is a
    # launch that failed.
    missing = [r for r in range(2) if not os.path.exists(out / f"rank{r}.json")]
    assert not missing, (f"{' '.join(cmd)} failed, no result from ranks {missing} (logs in {logs}):\n"
                         f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return out, logs


def _ranks(out, phase, device="cuda"):
    """Both ranks' results, after checking that ``phase`` of tests/mp/byteps_worker.py ran without error."""
    rs = [json.load(open(os.path.join(out, f"rank{r}.json"))) for r in range(2)]
    for r in rs:
        assert phase in r["finished"], (f"rank {r['rank']}: phase {phase} did not finish (the launch timed out or "
                                        f"a process died: see the logs); finished: {r['finished']}")
        err = r["errors"].get(phase)
        assert err is None, f"rank {r['rank']}, phase {phase}: {err['error']}\n{err['traceback']}"
        assert r["size"] == 2 and r["device"].startswith(device)
    return rs


def check_lossless(out, device="cuda"):
    """The embedding model with Compression.lossless equals BytePS's uncompressed run, on both replicas."""
    rs = _ranks(out, "lossless", device)
    for r in rs:
        assert r["max_diff"] <= 1e-5, r
        assert r["stats"]["compressed"] > 0 and r["stats"]["payload_bytes"] < r["stats"]["dense_bytes"]
    assert rs[0]["digest"] == rs[1]["digest"], "replicas drifted"


def check_fallback(out, device="cuda"):
    """A capacity far too small: the dense fallback and the grown payload's tail, still exact."""
    rs = _ranks(out, "fallback", device)
    for r in rs:
        assert r["fallback_max_diff"] <= 1e-5 and r["fallback_stats"]["fallbacks"] >= 1, r
    assert rs[0]["fallback_digest"] == rs[1]["fallback_digest"], "replicas drifted"


@pytest.mark.gpu
def test_byteps_gpu_server_summed_the_payloads(byteps_run):
    """Server-side evidence: the server's own log (PS_KEY_LOG=1) shows each worker pushing the payload's
    bytes (not the gradient's) for the embedding's key, through the ordinary push handler (no C++
    compressor registered), and BYTEPS_SERVER_DEBUG shows it adding the payloads' first elements (the
    header's contributor field, 1 per worker) into 2 in every round."""
    out, logs = byteps_run
    r0 = _ranks(out, "lossless")[0]
    server = open(os.path.join(logs, "server0.log")).read()
    worker = open(os.path.join(logs, "worker0.log")).read()
    name = r0["emb_tensor_name"]
    m = re.search(rf"{re.escape(name)} partitioned to (\d+) part\(s\), total_len=(\d+), key_range=\[(\d+), (\d+)\]",
                  worker)
    assert m, f"no partition line for {name} in worker0.log (BYTEPS_LOG_LEVEL=DEBUG or TRACE)"
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


def check_compressors(out, device="cuda"):
    """none, lossless, topk and thc on both models: lossless equal to the uncompressed run, every
    compressor's replicas bit-identical, topk and thc pushing fewer bytes than dense and still training
    (finite losses; thc's loss falls on the dense model)."""
    rs = _ranks(out, "compressors", device)
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


@pytest.mark.gpu
def test_byteps_gpu_lossless_matches_uncompressed(byteps_run):
    check_lossless(byteps_run[0])


@pytest.mark.gpu
def test_byteps_gpu_fallback_and_tail_match_uncompressed(byteps_run):
    check_fallback(byteps_run[0])


@pytest.mark.gpu
def test_byteps_gpu_compressors_on_embedding_and_dense_models(byteps_run):
    """The compressors through the real BytePS (check_compressors)."""
    check_compressors(byteps_run[0])


def test_worker_dry_run_on_simulated_byteps(tmp_path):
    """tests/mp/byteps_worker.py, unchanged, on two threads over the simulated BytePS (on CPU), with
    BytePS 0.2.5's synchronize() as it is (every parameter gets the last handle's ctx): every phase
    finishes and passes the GPU tests' checks."""
    code = (f"import sys; sys.path[:0] = [{HERE!r}, {os.path.join(HERE, 'mp')!r}]\n"
            "from byteps_sim import SimulatedBytePS, byteps_modules, run_workers\n"
            "sim = SimulatedBytePS(2)\n"
            "sys.modules.update(byteps_modules(sim))\n"
            "import byteps_worker\n"
            f"run_workers(sim, lambda rank, engine: byteps_worker.run({str(tmp_path)!r}), timeout=600)\n")
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), LHC_TEST_DEVICE="cpu")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    check_lossless(tmp_path, "cpu")
    check_fallback(tmp_path, "cpu")
    check_compressors(tmp_path, "cpu")
