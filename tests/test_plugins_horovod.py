"""Horovod plugin with real Horovod: horovodrun (Gloo) with 2 and 3 workers, and mpirun once.

Each launch runs every scenario of tests/mp/horovod_worker.py: the same training with Horovod's own
uncompressed allreduce and with our compressor, from the same seed on the same batches."""
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig

import pytest

from processes import run_launcher

pytestmark = pytest.mark.multiprocess
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
WORKER = os.path.join(HERE, "mp", "horovod_worker.py")
# Horovod's own test suite (not shipped in its sdist) exercises these too: 2-D-only (Muon-style)
# optimizers, broadcast_optimizer_state, groups=, backward_passes_per_step, sparse gradients.
EXACT = ["average", "sum", "sparse_as_dense", "groups", "backward_passes", "matrices_only", "broadcast_state"]
JOIN = ["join", "join_sum", "join_auto", "join_auto_sum"]
JOIN_TOPK = ["join_topk", "join_topk_sum"]
ERRORS = {"adasum": "ValueError", "sparse_without_dense": "ValueError", "sparse_beside_one": "ValueError",
          "sparse_only": "ValueError",
          "seed_mismatch": "ConfigurationMismatch", "op_max": "ValueError", "shared_compressor": "ValueError",
          "process_set_type": "TypeError"}
# what each error says (the check that raised it, not another error of the same type from further on)
MESSAGES = {"adasum": "Adasum is non-linear (it is not a sum)",
            "sparse_without_dense": "has a sparse gradient, which Horovod sends uncompressed",
            "sparse_beside_one": "has a sparse gradient, which Horovod sends uncompressed",
            "sparse_only": "a sparse gradient reached the compressor",
            "seed_mismatch": "ranks built the codec with different",
            "op_max": "lossless_hc compression sums payloads: op=",
            "shared_compressor": "one lossless_hc compressor serves one hvd.DistributedOptimizer at a time",
            "process_set_type": "process_set must be a horovod ProcessSet"}
# Float tolerance for parameters after a few SGD steps: sums in a different order differ by rounding.
TOL = 1e-6


def _horovod_bin(name):
    """Horovod's launcher beside this interpreter (the venv's), or where pip put it for a user install
    (an environment it could not write to, as on the GPU machine's image), or on PATH."""
    for folder in (os.path.dirname(sys.executable), sysconfig.get_path("scripts", f"{os.name}_user")):
        if os.path.exists(os.path.join(folder, name)):
            return os.path.join(folder, name)
    path = shutil.which(name)
    if path is None:
        pytest.fail(f"{name} not found beside {sys.executable} nor on PATH: run `make setup` (scripts/setup_horovod.sh)")
    return path


def launch(cmd, out_dir, timeout=600, device="cpu"):
    # Three ranks share CI's two cores with pytest: under that load a rank was twice seen to miss a
    # collective for longer than Gloo's default 30 s receive timeout (np3, `groups` and `thc_sum`;
    # the same runs pass when repeated). 300 s rides out such stalls; a real deadlock still fails,
    # within the launch timeout.
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1", HOROVOD_GLOO_TIMEOUT_SECONDS="300",
               LHC_TEST_DEVICE=device)
    proc = run_launcher(cmd, cwd=ROOT, env=env, timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"


def results(out_dir, name, size):
    return [json.load(open(os.path.join(out_dir, f"{name}.rank{r}.json"))) for r in range(size)]


@pytest.fixture(scope="module", params=[2, 3], ids=["np2", "np3"])
def horovod_run(request, tmp_path_factory):
    size = request.param
    out = tmp_path_factory.mktemp(f"hvd{size}")
    # Error scenarios last: they leave Horovod operations in flight (under names no later run uses).
    # torch.compile at np2 only: its graphs do not depend on the world size, and three ranks compiling
    # them on CI's two cores took 15 of the np3 launch's ~70 s.
    names = (EXACT + ["fallback", "policy", "topk", "thc", "thc_sum", "inexact", "bfloat16", "float16_auto",
                      "abandoned_step"]
             + (["compiled"] if size == 2 else []) + JOIN + JOIN_TOPK + ["join_thc"] + list(ERRORS))
    launch([_horovod_bin("horovodrun"), "--gloo", "-np", str(size), "-H", f"localhost:{size}",
            sys.executable, WORKER, str(out), ",".join(names)], out)
    return out, size


@pytest.mark.parametrize("horovod_run", [2], ids=["np2"], indirect=True)   # the np2 launch's (above)
def test_compressors_under_torch_compile_equal_horovod_s_own_allreduce(horovod_run):
    """``torch.compile(model)`` (inductor): Horovod's gradient hooks, and so the compressors, run from the
    compiled backward; lossless and auto (allgather plans for the tables on a given slow link) compress
    and train as Horovod's uncompressed eager run does, to float rounding."""
    out, size = horovod_run
    for r in results(out, "compiled", size):
        for name in ("lossless", "auto"):
            assert r[name]["max_diff"] <= TOL and r[name]["stats"]["compressed"] > 0, (name, r[name])
        assert any(v["strategy"] != "dense" for v in r["auto"]["stats"]["plan"].values()), r["auto"]["stats"]["plan"]


def test_bfloat16_models_train_although_horovod_has_no_bfloat16_allreduce(horovod_run):
    """Horovod refuses bfloat16 tensors; the plugin carries the ones it sends as they are (dense, a
    fallback's, inexact keys') as float32 and rounds the sum back once. The exact compressors stay within
    rtol plus bfloat16's roundings of the float64 average (bound: horovod_worker.half_training),
    dense fallbacks and inexact keys included; the lossy ones train and stay finite; auto refuses to
    plan bf16. The stats count what each step handed Horovod (the carried float32 bytes: they counted
    bfloat16's, half of a fallback step's bytes)."""
    out, size = horovod_run
    for r in results(out, "bfloat16", size):
        for kind in ("lossless", "fallback", "topk", "thc", "auto_lossy"):
            got = r[kind]
            assert got["finite"] and got["dtypes"] == ["torch.bfloat16"], (kind, got)
            assert got["stats"]["compressed"] > 0 or kind == "auto_lossy", (kind, got["stats"])
            # the stats count every step's bytes as sent: the bfloat16 ones carried as float32 included
            assert got["payload_bytes"] == got["sent"], (kind, got["payload_bytes"], got["sent"])
        for kind in ("lossless", "fallback"):
            assert r[kind]["error_over_bound"] <= 1.0 and r[kind]["zeros_exact"], (kind, r[kind])
        # the bytes check above covered plans with a second collective (allgather) and top-k's
        assert {v["strategy"] for v in r["auto_lossy"]["stats"]["plan"].values()} - {"dense"}, r["auto_lossy"]["stats"]
        assert r["fallback"]["stats"]["fallbacks"] > 0, r["fallback"]["stats"]
        assert r["auto_bf16"]["error"] == "ValueError" and "bfloat16" in r["auto_bf16"]["message"], r["auto_bf16"]


def test_auto_sends_a_float16_gradient_s_plain_steps_as_float16(horovod_run):
    """Compression.auto on a float16 model, every tensor planned dense: the first step carries the
    statistics in float32, the seven plain ones go as float16 (what Horovod's own allreduce sends),
    so 8 steps send (4 + 7 x 2) / (8 x 2) = 1.125 of the float16 bytes plus the headers (before,
    every step went as float32: 2x); within rtol plus float16's roundings of the float64 average."""
    out, size = horovod_run
    for r in results(out, "float16_auto", size):
        st = r["stats"]
        assert 1.0 < st["payload_bytes"] / st["dense_bytes"] < 1.2, st
        assert r["error_over_bound"] <= 1.0 and r["zeros_exact"] and r["finite"], r
        assert {p["plain_steps"] for p in st["plan"].values()} == {7}, st["plan"]


def test_inexact_keys_are_reaggregated_alone_and_exactly(horovod_run):
    """Gradients whose small keys share sketch cells with 2**30 (tests/mp/inexact_case.py): the decoder
    reports those keys inexact, the compressor re-aggregates just their coordinates (a named Horovod
    allreduce at the step's end, no deadlock), and every gradient equals the exact dense aggregate bit
    for bit at every coordinate, identically on every rank, at every step (Average with 2 ranks, so
    the re-aggregated sums are divided too; Sum with 3)."""
    out, size = horovod_run
    rs = results(out, "inexact", size)
    for r in rs:
        assert [s["differing"] for s in r["steps"]] == [0] * len(r["steps"]), r["steps"]
        st = r["stats"]
        assert st["partial_fallbacks"] >= 1 and st["inexact_keys"] >= st["partial_fallbacks"], st
        assert st["fallbacks"] == 0 and st["inexact_decodes"] == st["partial_fallbacks"], st
    assert len({json.dumps([s["digest"] for s in r["steps"]]) for r in rs}) == 1


def test_capacity_policy_adapts_identically_and_stays_exact(horovod_run):
    """CapacityPolicy under Horovod: every rank rebuilds the same codecs at the same steps (payload
    shapes match, or the allreduce would fail), the embedding tables' capacity shrinks from 5% to
    what the batches use, and training equals the uncompressed run."""
    out, size = horovod_run
    rs = results(out, "policy", size)
    for r in rs:
        assert r["max_diff"] <= TOL, r
        assert r["stats"]["fallbacks"] == 0, r["stats"]["last_failure"]
    assert len({json.dumps([r["history"], r["capacity"], r["union_capacity"], r["index"]]) for r in rs}) == 1
    hist = rs[0]["history"]
    assert any(len(h) >= 1 for h in hist), hist
    fixed = results(out, "average", size)[0]["stats"]
    assert rs[0]["stats"]["wire_ratio"] < fixed["wire_ratio"], (rs[0]["stats"], fixed)


@pytest.mark.parametrize("name", EXACT + ["fallback"])
def test_lossless_training_matches_uncompressed(horovod_run, name):
    out, size = horovod_run
    rs = results(out, name, size)
    for r in rs:
        assert r["size"] == size
        assert r["max_diff"] <= TOL, r
        assert r["stats"]["compressed"] > 0 and r["stats"]["payload_bytes"] < r["stats"]["dense_bytes"]
    # Every rank took the same decisions (capacities, fallbacks, dense/compressed per tensor).
    assert len({json.dumps([r["capacity"], r["compressed"], r["stats"]["fallbacks"]]) for r in rs}) == 1
    if name == "fallback":
        assert rs[0]["stats"]["fallbacks"] >= 1 and rs[0]["stats"]["capacity_growths"] >= 1
        assert "overloaded" in rs[0]["stats"]["last_failure"]
    else:
        assert rs[0]["stats"]["fallbacks"] == 0, rs[0]["stats"]["last_failure"]


def test_the_aggregators_take_the_optimizer_s_parameter_names(horovod_run):
    """Each parameter's aggregator (its stats, its fallback's Horovod operation name) is named as the
    optimizer's named_parameters name it, not by its position among the compressed tensors."""
    out, size = horovod_run
    expected = sorted(["users.weight", "items.weight", "fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"])
    for r in results(out, "average", size):
        assert sorted(re.sub(r"^run\d+\.", "", n) for n in r["capacity"]) == expected, r["capacity"]


def test_topk_keeps_error_feedback_per_parameter(horovod_run):
    """Top-k per parameter compresses and keeps a residual; at the checked step what Horovod applied is
    every rank's gradient plus its residual before, less its residual after, averaged (tests/mp/models.py
    books_check: within the codec's rtol of the selections' mass plus float32 rounding; measured
    ~0.005 of that bound), on some coordinates and not all (a selection); the replicas stay bit-identical."""
    out, size = horovod_run
    rs = results(out, "topk", size)
    for r in rs:
        assert r["stats"]["compressed"] > 0
        assert r["stats"]["payload_bytes"] < r["stats"]["dense_bytes"]
        # Tensors sent through top-k keep what was not sent (zero for a table whose few non-zero
        # rows all fit in k); a dense layer with more than k non-zeros always leaves something.
        norms = [v for v in r["residual_norms"].values() if v is not None]
        assert norms and max(norms) > 0
        c = r["conservation"]
        assert c["over_bound"] <= 1.0, c
        assert 0 < c["applied_nonzero"] < c["numel"] and c["max_expected"] > 0, c
    assert len({r["digest"] for r in rs}) == 1, [r["digest"] for r in rs]


@pytest.mark.parametrize("name", ["thc", "thc_sum"])
def test_thc_replicas_stay_identical_and_train(horovod_run, name):
    """Compression.thc under op=Average and op=Sum: every rank decodes the same bits (so parameters
    stay bit-identical across ranks), the payload (headers included) is a third of dense or less, and
    the parameters move the way the uncompressed run moves them."""
    out, size = horovod_run
    rs = results(out, name, size)
    assert len({r["digest"] for r in rs}) == 1
    r = rs[0]
    assert any(r["compressed"].values())
    # Headers, norm slots and the one dense bias included: measured 0.256 of dense (np2), 0.293 (np3);
    # every compressed layer alone is at most 0.328 (np3's 512-element ones).
    assert r["stats"]["payload_bytes"] <= r["stats"]["dense_bytes"] / 3, r["stats"]
    assert r["cosine"] > 0.9, r["cosine"]


@pytest.mark.parametrize("name", JOIN)
def test_uneven_inputs_with_hvd_join_equal_horovod_s_own_allreduce(horovod_run, name):
    """Rank r trains 6 - r steps, then calls hvd.join(); the ranks still training reduce with the joined
    ones' zeros, and Horovod divides an AVERAGE by the world size all the same. Under op=Average and
    op=Sum, lossless (its sketch cannot be decoded with ranks missing: a dense fallback of the ranks
    still training) and auto with dense plans (statistics every other step) give what Horovod's own
    allreduce gives. Before the compressors took the op from the optimizer, both misread a SUM of fewer
    ranks as an AVERAGE (and the reverse) from the payload's contributor word. (auto with a plan that is
    not dense refuses joined ranks: tests/test_planner.py.)"""
    out, size = horovod_run
    for r in results(out, name, size):
        assert r["max_diff"] <= TOL, r
    if name.startswith("join_auto"):
        return
    rank0 = results(out, name, size)[0]
    assert rank0["stats"]["fallbacks"] >= 1 and "contributions" in rank0["stats"]["last_failure"], rank0["stats"]


@pytest.mark.parametrize("name", JOIN_TOPK)
def test_topk_error_feedback_conserves_every_coordinate_under_hvd_join(horovod_run, name):
    """Top-k under uneven inputs (rank r computes 6 - r gradients of a linear loss, then joins), Average
    and Sum: on rank 0, which took every step, what Horovod applied equals every rank's gradients summed
    (divided by n under Average) less the residuals the ranks still hold; the join steps fell back to a
    dense sum of what the ranks selected. (The joined ranks skip the steps after their join, as under
    Horovod's own allreduce.)"""
    out, size = horovod_run
    r = results(out, name, size)[0]
    assert r["max_diff"] <= 1e-4 * max(1.0, r["max_applied"]), r
    assert r["held"] > 0 and r["stats"]["compressed"] > 0, r
    assert r["stats"]["fallbacks"] >= 1 and "contributions" in r["stats"]["last_failure"], r["stats"]


def test_thc_under_hvd_join_is_a_clear_error_on_the_ranks_still_training(horovod_run):
    """THC under uneven inputs (rank r trains 6 - r steps, then joins): its digits cannot be decoded from
    a sum missing a rank, so the ranks still training raise ConfigurationMismatch naming hvd.join() at
    the first step after a rank joined (then join themselves, as a loop that stops would); the rank that
    joined, the one with the fewest steps, returns from its join."""
    out, size = horovod_run
    rs = results(out, "join_thc", size)
    for r in rs[:-1]:
        assert r["error"] == "ConfigurationMismatch" and "hvd.join()" in r["message"], r
        assert f"aggregates {size - 1} contributions" in r["message"], r
    assert rs[-1]["error"] is None, rs[-1]


def test_a_step_whose_handles_were_dropped_does_not_hold_back_the_next(horovod_run):
    """optimizer.load_state_dict() between backward and step (a roll-back) drops the step's Horovod
    handles: that step is never decompressed. The compressor counted its tensors as outstanding for
    ever, so later steps never ended and their fallbacks were read before they were summed (6.4e-4 off
    with lossless); now such a step is forgotten, and the run equals Compression.none's through the
    same roll-back."""
    out, size = horovod_run
    for r in results(out, "abandoned_step", size):
        assert r["max_diff"] <= TOL and r["stats"]["fallbacks"] >= 1, r


@pytest.mark.parametrize("name", list(ERRORS))
def test_misuse_is_a_clear_error_on_every_rank(horovod_run, name):
    """op_max: op=hvd.Max (its dense tensors a MAX, its fallbacks a SUM); shared_compressor: one
    compressor for two optimizers of one model (one's step ended after the other read its gradients);
    process_set_type: Compression.auto(process_set="all"); seed_mismatch: each rank's own seed (the codecs'
    fingerprints disagree at the first decode). Each by the check that refuses it (its message)."""
    out, size = horovod_run
    for r in results(out, name, size):
        assert r["error"] == ERRORS[name] and MESSAGES[name] in r["message"], r


@pytest.mark.parametrize("name, table", [("sparse_without_dense", "users.weight"), ("sparse_beside_one", "emb")])
def test_a_sparse_gradient_is_refused_by_name_before_any_payload_is_decoded(horovod_run, name, table):
    """A table's sparse gradient went around the compressor (Horovod's allgather), so the step is refused
    at the first compressed tensor's decompress, naming that parameter -- also when that tensor is the
    optimizer's only compressed one (sparse_beside_one) -- not only when Horovod hands the sparse output
    itself to decompress (ctx None), after the dense ones were decoded."""
    out, size = horovod_run
    for r in results(out, name, size):
        assert re.match(rf"parameter 'run\d+\.{re.escape(table)}' has a sparse gradient", r["message"]), r
        assert "sparse_as_dense=True" in r["message"], r


def test_process_set(tmp_path):
    """Ranks 0 and 1 of 3 train in a process set; auto trains on ranks 1 and 2. Its own launch: after a
    process set, Horovod 0.28.1 stalls a later sparse (allgather) allreduce of the global set."""
    size = 3
    launch([_horovod_bin("horovodrun"), "--gloo", "-np", str(size), "-H", f"localhost:{size}",
            sys.executable, WORKER, str(tmp_path), "process_set"], tmp_path)
    rs = results(tmp_path, "process_set", size)
    assert [r["included"] for r in rs] == [True, True] + [False] * (size - 2)
    for r in rs[:2]:
        assert r["max_diff"] <= TOL and r["stats"]["compressed"] > 0
    # auto on ranks 1 and 2: its configuration check's and step guard's broadcasts take the set's first
    # rank as root (Horovod wants a global rank: root 0 was "invalid root rank" at construction), exact.
    # A launch of its own: after the first set's training Horovod 0.28.1 stalls the second set's.
    auto_out = tmp_path / "auto"
    auto_out.mkdir()
    launch([_horovod_bin("horovodrun"), "--gloo", "-np", str(size), "-H", f"localhost:{size}",
            sys.executable, WORKER, str(auto_out), "auto_process_set"], auto_out)
    rs = results(auto_out, "auto_process_set", size)
    assert [r["included"] for r in rs] == [False, True, True]
    for r in rs[1:]:
        assert r["max_diff"] == 0.0 and r["stats"]["tensors"] > 0, r
        assert r["stats"]["guard"]["verdict"] is not None, r["stats"]["guard"]   # broadcast from rank 1
        # rank 1's own medians on both ranks: the verdict broadcast is the set's first rank's, not another's
        assert [r["stats"]["guard"][k] for k in ("plan_ms", "dense_ms")] == rs[1]["own_ms"], (r, rs[1]["own_ms"])


def test_mpirun_launcher(tmp_path):
    """scripts/launch_mpirun.sh starts the MPI build of Horovod (as root too)."""
    launch(["bash", os.path.join(ROOT, "scripts", "launch_mpirun.sh"), "2", WORKER, str(tmp_path), "average"],
           tmp_path)
    for r in results(tmp_path, "average", 2):
        assert r["max_diff"] <= TOL and r["stats"]["compressed"] > 0


def test_digits_cnn_converges_with_topk_and_thc(tmp_path):
    """Top-k (1%) with error feedback, and THC (4 bits), reach the uncompressed accuracy within noise (the
    three trainings one after another in one launch and one hvd.init: tests/mp/several_trainings.py)."""
    comps = ("none", "topk", "thc")
    launch([_horovod_bin("horovodrun"), "--gloo", "-np", "2", "-H", "localhost:2", sys.executable,
            os.path.join(HERE, "mp", "several_trainings.py"), str(tmp_path / "{compression}.json"), ",".join(comps),
            "--model", "digits"], tmp_path)
    acc = {comp: json.load(open(tmp_path / f"{comp}.json")) for comp in comps}
    assert acc["none"]["value"] > 0.9
    assert acc["topk"]["value"] >= acc["none"]["value"] - 0.05, acc
    assert acc["topk"]["bytes_per_step"] < 0.5 * acc["none"]["bytes_per_step"]
    assert acc["thc"]["value"] >= acc["none"]["value"] - 0.05, acc
    assert acc["thc"]["bytes_per_step"] < 0.5 * acc["none"]["bytes_per_step"]


# The scenarios whose models train on the worker's device (tests/mp/horovod_worker.py).
CUDA_SCENARIOS = EXACT + ["fallback", "policy", "auto", "topk", "thc", "thc_sum", "bfloat16", "float16_auto"]


@pytest.mark.gpu
@pytest.mark.parametrize("size", [2, 3])
def test_compressors_on_cuda_tensors_through_gloo(tmp_path, size):
    """Every rank's model on GPU 0, so that the payloads are encoded and decoded by the CUDA kernels:
    Horovod built with CUDA but without GPU operations (NCCL refuses two ranks on one GPU) copies each
    CUDA tensor to the host, reduces it through Gloo and copies it back, ordered after the kernels that
    wrote it by a CUDA event. The CPU launches' assertions hold as they are: lossless and its fallbacks
    equal Horovod's own allreduce, the capacity policy adapts identically on every rank, top-k keeps its
    residuals, THC's replicas stay bit-identical, bfloat16 models within their bound; and ``auto`` (its
    tables off dense on a given slow link) equals Horovod's own allreduce too."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA: run on the GPU machine (scripts/gpu_session.sh build horovod)")
    try:
        import horovod.torch  # noqa: F401
    except ImportError:
        pytest.skip("needs Horovod built against this torch: scripts/setup_horovod.sh (scripts/gpu_session.sh horovod)")
    launch([_horovod_bin("horovodrun"), "--gloo", "-np", str(size), "-H", f"localhost:{size}",
            sys.executable, WORKER, str(tmp_path), ",".join(CUDA_SCENARIOS)], tmp_path, device="cuda")
    run = (tmp_path, size)
    assert {r["device"] for name in CUDA_SCENARIOS for r in results(tmp_path, name, size)} == {"cuda"}
    for name in EXACT + ["fallback"]:
        test_lossless_training_matches_uncompressed(run, name)
    test_capacity_policy_adapts_identically_and_stays_exact(run)
    test_topk_keeps_error_feedback_per_parameter(run)
    for name in ("thc", "thc_sum"):
        test_thc_replicas_stay_identical_and_train(run, name)
    test_bfloat16_models_train_although_horovod_has_no_bfloat16_allreduce(run)
    test_auto_sends_a_float16_gradient_s_plain_steps_as_float16(run)
    for r in results(tmp_path, "auto", size):
        assert r["max_diff"] <= TOL and any(v["strategy"] != "dense" for v in r["stats"]["plan"].values()), r


def test_horovod_build_has_gloo_and_mpi():
    """The PyTorch extension of the set-up's Horovod has both controllers: what `horovodrun --check-build`
    reports, asked of the extension once (--check-build spawns an interpreter per question)."""
    _horovod_bin("horovodrun")   # fails, saying so, where the set-up's Horovod is missing
    code = "import horovod.torch as hvd; print(bool(hvd.mpi_built()), bool(hvd.gloo_built()))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "True"], out.stdout
