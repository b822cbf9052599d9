"""DDP communication hook with real torch.distributed (Gloo, world size 2 and 3, real processes and
sockets). Each launch runs every scenario of tests/mp/ddp_worker.py: the same training with DDP's
default allreduce and with the lossless hook, from the same seed on the same batches."""
import json
import os
import sys

import pytest

from helpers import free_port
from processes import run_launcher

pytestmark = pytest.mark.multiprocess
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
WORKER = os.path.join(HERE, "mp", "ddp_worker.py")
EXACT = ["average", "small_buckets", "fallback"]
ERRORS = {"config_mismatch": "ConfigurationMismatch", "sparse": "TypeError",
          "thc_exact_mismatch": "ConfigurationMismatch", "thc_exact_unmatched": "ValueError",
          "restored_apart": "ValueError", "restored_other_size": "ValueError"}
# what each error says (the check that raised it, not an error from further on)
MESSAGES = {"config_mismatch": "LosslessHookState differs across ranks", "sparse": "got a sparse gradient bucket",
            "thc_exact_mismatch": "THCHookState's exact parameters differs across ranks",
            "thc_exact_unmatched": "not parameters this DDP model reduces",
            "restored_apart": "unpickled apart from its DDP model",
            "restored_other_size": "were built for world size"}
TOL = 1e-6


def run(args, timeout=600, device="cpu"):
    """Run a worker command; ``device="cuda"``: the DDP workers put every rank's model on GPU 0."""
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1", LHC_TEST_DEVICE=device)
    proc = run_launcher(args, cwd=ROOT, env=env, timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(args)} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"


@pytest.fixture(scope="module", params=[2, 3], ids=["world2", "world3"])
def ddp_run(request, tmp_path_factory):
    size = request.param
    out = tmp_path_factory.mktemp(f"ddp{size}")
    run([sys.executable, WORKER, str(size), str(free_port()), str(out),
         ",".join(EXACT + ["unused_accumulation", "half_precision", "float16_large", "uneven", "ddp_options",
                           "policy", "topk", "thc", "thc_exact", "thc_amp", "exact_amp", "lossy_amp", "pickle",
                           "pickle_one_parameter", "restored_on_one_rank", "inexact"]
                  + list(ERRORS) + ["rank0_group", "close"])])
    return out, size


def results(out, name, size):
    return [json.load(open(os.path.join(out, f"{name}.rank{r}.json"))) for r in range(size)]


def test_a_group_of_rank_0_alone_does_not_hang_the_hooks(ddp_run):
    """The hooks' own Gloo groups (fallback, PowerSGD) are created from the first step's hooks. With
    use_local_synchronization torch named them from how many groups the calling rank belongs to: one
    group of rank 0 alone (all ranks create it) and every rank waited on its own name for ever. Over
    the whole world they are now created as every rank creates groups, and the step is exact."""
    out, size = ddp_run
    for r in results(out, "rank0_group", size):
        assert r["max_diff"] <= TOL and r["stats"]["compressed"] > 0, r


def test_closing_a_state_releases_its_groups_and_training_goes_on(ddp_run):
    """Every hook state makes a Gloo group per bucket, which torch keeps (threads, sockets) after the state
    is gone: a process training one model after another gained ~5 descriptors per bucket and training.
    close() destroys them (the descriptors are back to what they were before the first step), and the
    steps after it make them again and stay exact."""
    out, size = ddp_run
    for r in results(out, "close", size):
        assert r["max_diff"] <= TOL and r["groups"] >= 2 and r["groups_again"] == r["groups"], r
        before, after = r["descriptors"]
        assert after <= before, r


def test_saving_the_ddp_model_keeps_a_usable_hook_state(ddp_run):
    """torch.save(ddp_model) after training with the hook: the process groups are left out (as
    torch's PowerSGDState does), the per-parameter aggregators are kept, and the restored state
    answers on the default group."""
    out, size = ddp_run
    for r in results(out, "pickle", size):
        assert r["error"] is None, r
        if r["restored_state"] == "NoneType":
            pytest.skip("this torch's DDP does not pickle the comm-hook state")
        assert r["restored_state"] == "LosslessHookState" and r["aggregators"] > 0 and r["group_dropped"], r
        assert r["world_size"] == size
        assert r["tensors_after_restore"] > 0, r   # the restored model's step went through the hook


def test_a_saved_model_with_a_single_parameter_keeps_its_hook_state(ddp_run):
    """A restored state is refused only when none of its aggregators is the model's: a DDP model of one
    parameter, saved and loaded with its hook state, matches that one and trains on."""
    out, size = ddp_run
    for r in results(out, "pickle_one_parameter", size):
        if r["restored_state"] == "NoneType":
            pytest.skip("this torch's DDP does not pickle the comm-hook state")
        assert r["aggregators"] == 1 and r["grad"] == [[2.0] * 4] and r["tensors"] == 2, r


def test_a_state_restored_with_its_model_on_one_rank_only_is_refused_on_every_rank(ddp_run):
    """Whether a restored state's aggregators matched the model is compared across ranks first: rank 0 loads
    the model with its state, the others register a copy of the state pickled alone (none of its aggregators
    is the loaded model's) -- a ConfigurationMismatch on every rank at that step, not a ValueError on the
    others while rank 0 waits in an allreduce they never issue."""
    out, size = ddp_run
    for r in results(out, "restored_on_one_rank", size):
        if r.get("restored_state") == "NoneType":
            pytest.skip("this torch's DDP does not pickle the comm-hook state")
        assert r["error"] == "ConfigurationMismatch", r
        assert "LosslessHookState restored differs across ranks" in r["message"], r


def test_inexact_keys_are_reaggregated_alone_and_exactly(ddp_run):
    """Gradients whose small keys share sketch cells with 2**30 (tests/mp/inexact_case.py): the decoder
    reports those keys inexact, the hook re-aggregates just their coordinates (in the bucket's fallback
    SUM, not densely), and every gradient equals the exact dense average bit for bit at every
    coordinate, identically on every rank, at every step."""
    out, size = ddp_run
    rs = results(out, "inexact", size)
    for r in rs:
        assert [s["differing"] for s in r["steps"]] == [0] * len(r["steps"]), r["steps"]
        st = r["stats"]
        assert st["partial_fallbacks"] >= 1 and st["inexact_keys"] >= st["partial_fallbacks"], st
        assert st["fallbacks"] == 0 and st["inexact_decodes"] == st["partial_fallbacks"], st
    assert len({json.dumps([s["digest"] for s in r["steps"]]) for r in rs}) == 1


def check_lossless(rs):
    """Every rank equals DDP's allreduce to float rounding, compressed, with the same capacity and fallbacks."""
    for r in rs:
        assert r["max_diff"] <= TOL, r
        assert r["stats"]["compressed"] > 0 and r["stats"]["payload_bytes"] < r["stats"]["dense_bytes"], r
    assert len({json.dumps([r["capacity"], r["stats"]["fallbacks"]]) for r in rs}) == 1


def check_topk(rs):
    """Top-k compresses and keeps a residual; at the checked step what the hook returned is every rank's
    gradient plus its residual before, less its residual after, averaged (tests/mp/models.py
    books_check: within the codec's rtol of the selections' mass plus float32 rounding; measured
    ~0.002 of that bound), on some coordinates and not all (a selection); the replicas stay bit-identical."""
    for r in rs:
        assert r["stats"]["compressed"] > 0 and r["stats"]["payload_bytes"] < r["stats"]["dense_bytes"]
        assert r["residual_norms"] and max(r["residual_norms"]) > 0
        c = r["conservation"]
        assert c["over_bound"] <= 1.0, c
        assert 0 < c["applied_nonzero"] < c["numel"] and c["max_expected"] > 0, c
    assert len({r["digest"] for r in rs}) == 1, [r["digest"] for r in rs]


def check_thc(rs):
    assert len({r["digest"] for r in rs}) == 1
    # decoded into the bucket or copied into it: the same parameters
    assert all(r["digest_copied"] == r["digest"] for r in rs)
    assert rs[0]["stats"]["compressed"] > 0
    assert rs[0]["stats"]["payload_bytes"] < 0.5 * rs[0]["stats"]["dense_bytes"]
    assert rs[0]["cosine"] > 0.9, rs[0]["cosine"]


@pytest.mark.parametrize("name", EXACT)
def test_lossless_hook_matches_default_allreduce(ddp_run, name):
    out, size = ddp_run
    rs = results(out, name, size)
    check_lossless(rs)
    if name == "average":
        assert rs[0]["stats"]["fallbacks"] == 0, rs[0]["stats"]["last_failure"]
    else:  # capacity 0.1%: the embedding tables overload, fall back exactly, and grow
        assert rs[0]["stats"]["fallbacks"] >= 1 and rs[0]["stats"]["capacity_growths"] >= 1


def test_unused_parameters_and_no_sync_accumulation_stay_exact(ddp_run):
    """find_unused_parameters=True (a layer never used, a table used every other step) with three
    micro-batches per step, the first two under no_sync: equal to DDP's allreduce to float rounding."""
    out, size = ddp_run
    rs = results(out, "unused_accumulation", size)
    check_lossless(rs)
    assert rs[0]["stats"]["fallbacks"] == 0, rs[0]["stats"]["last_failure"]


def test_half_precision_models_stay_within_their_rounding(ddp_run):
    """A bfloat16 and a float16 model (DDP's buckets in that dtype) through the lossless hook:
    compressed, no fallback, and every reduced gradient within the contract's rtol plus the
    roundings to the dtype (the sum's and the average's, and each addition's where a tensor went
    dense) of the float64 average (the bound: ddp_worker.half_precision); untouched coordinates
    exactly zero. With large dense layers (sent as they are), a step sends fewer bytes than DDP's own
    bucket (they travel in the model's dtype)."""
    out, size = ddp_run
    check_half_precision(results(out, "half_precision", size))


def test_float16_sums_beyond_its_range_average_like_ddp(ddp_run):
    """A float16 model whose gradients are 40000 on every rank (ddp_worker.LargeGradients): their SUM
    overflows float16 (65504), their average does not. DDP's own hook divides first and gets 40000;
    so must every hook (each divides a float16 bucket first): the exact ones within the half-precision
    bound of the average, the lossy ones finite."""
    out, size = ddp_run
    check_float16_large(results(out, "float16_large", size))


def check_float16_large(rs):
    for r in rs:
        assert r["none"] == {"error_over_bound": 0.0, "finite": True}, r["none"]   # the scenario's premise
        for hook in ("lossless", "auto", "topk", "thc"):
            assert r[hook]["finite"], (hook, r[hook])
        for hook in ("lossless", "auto"):
            assert r[hook]["error_over_bound"] <= 1.0, (hook, r[hook])


def check_half_precision(rs):
    for r in rs:
        for dtype in ("bfloat16", "float16"):
            got = r[dtype]
            assert got["grad_dtype"] == f"torch.{dtype}" and got["zeros_exact"], got
            assert got["error_over_bound"] <= 1.0, (dtype, got["error_over_bound"])
            st = got["stats"]
            assert st["compressed"] > 0 and st["fallbacks"] == 0 and st["payload_bytes"] < st["dense_bytes"], st
        # Dense layers of 139k coordinates, sent as they are after the first step's capacity growth, travel
        # in the model's dtype (the step then sends less than DDP's own bucket; widened to float32 they
        # made it ~1.5x), within the bound.
        for dtype in ("bfloat16", "float16"):
            got = r[f"{dtype}_wide"]
            assert got["error_over_bound"] <= 1.0 and got["zeros_exact"], (dtype, got["error_over_bound"])
            assert got["stats"]["fallbacks"] >= 1, got["stats"]   # the dense layers grew to dense
            # the stats count what was sent: parts, widening, the fallbacks' float32 values (step 0); the
            # first step also sends the configuration check (two int64, plugins/_torch_dist.py)
            unaccounted = [s - p for s, p in zip(got["sent_bytes"], got["payload_bytes"])]
            assert unaccounted == [16, 0, 0, 0], (dtype, got["payload_bytes"], got["sent_bytes"])
            assert all(b < got["bucket_bytes"] for b in got["sent_bytes"][1:]), (dtype, got["sent_bytes"],
                                                                                 got["bucket_bytes"])


def test_uneven_inputs_under_join_equal_ddp_s_allreduce(ddp_run):
    """``ddp.join()`` with rank r running out of batches 2 r steps early: a joined rank shadows the
    others' collectives through the hook with zero gradients, so the messages still match. lossless and
    auto (allgather plans on a given slow link) train as DDP's own allreduce under the same join does
    (its default ``divide_by_initial_world_size=True``; with False DDP divides by the ranks still
    training, which no comm hook is told, torch's own included)."""
    out, size = ddp_run
    for r in results(out, "uneven", size):
        for name in ("lossless", "auto"):
            assert r[name]["max_diff"] <= TOL and r[name]["stats"]["compressed"] > 0, (name, r[name])


def test_static_graph_and_gradient_as_bucket_view(ddp_run):
    """DDP's ``static_graph`` and ``gradient_as_bucket_view`` (the gradients are views of the buckets,
    into which the hooks write their results; THC decodes into them): lossless and auto (allgather plans
    on a given slow link) equal DDP's allreduce with the same option; THC's parameters are bit for bit
    those of a run without the option."""
    out, size = ddp_run
    for r in results(out, "ddp_options", size):
        for option in ("static_graph", "gradient_as_bucket_view"):
            for name in ("lossless", "auto"):
                got = r[f"{option}_{name}"]
                assert got["max_diff"] <= TOL and got["stats"]["compressed"] > 0, (option, name, got)
        assert r["thc_view_digests"][0] == r["thc_view_digests"][1]


def test_hooks_under_torch_compile_equal_eager_ddp(tmp_path):
    """``torch.compile(ddp_model)`` (inductor; DDPOptimizer splits the graph at the two buckets' boundary,
    the hooks run from the compiled backward's gradients): the lossless hook (which compresses, and
    grows the dense layers' capacity after a fallback) and auto (allgather plans for the tables on a
    given slow link) train as eager DDP's own allreduce does, to float rounding."""
    run([sys.executable, WORKER, "2", str(free_port()), str(tmp_path), "compiled"])
    for r in results(str(tmp_path), "compiled", 2):
        for name in ("lossless", "auto"):
            assert r[name]["max_diff"] <= TOL, (name, r[name])
            assert r[name]["stats"]["compressed"] > 0, (name, r[name]["stats"])
        plans = {k: v["strategy"] for k, v in r["auto"]["stats"]["plan"].items()}
        assert any(s != "dense" for s in plans.values()), plans


def test_two_ddp_groups_in_one_world_are_independent(tmp_path):
    """Four ranks as two DDP groups configured differently (tests/mp/ddp_worker.py, subgroups): one
    over capacity at every step, whose fallback groups its two ranks make alone, then auto; the other
    within capacity; then auto on each. Each equals DDP's allreduce on its own group, and nothing waits for
    the other; a group all four ranks make afterwards sums over all four (the hooks' groups, made by one DDP
    group's members alone, leave the world's group naming alike on every rank). Auto's calibration is
    measured on its own group and broadcast from that group's rank 0 (global rank 2 for the second group,
    which global rank 0 is not in): a fit, identical within the group, not the zeros the other ranks hold."""
    run([sys.executable, WORKER, "4", str(free_port()), str(tmp_path), "subgroups"])
    rs = results(str(tmp_path), "subgroups", 4)
    for r in rs:
        assert r["world_sum"] == 4.0, r
        for key in ("first", "second"):
            assert r[key]["max_diff"] <= TOL, (r["group"], key, r[key])
        st = r["first"]["stats"]
        assert st["compressed"] > 0 and (st["fallbacks"] > 0) == (r["group"] == 0), (r["group"], st)
        cal = r["second"]["stats"]["calibration"]
        assert cal["source"] == "measured" and cal["seconds_per_byte"] > 0, (r["group"], cal)
    for a, b in (rs[0:2], rs[2:4]):   # ranks {0, 1} and {2, 3}
        links = [{k: v for k, v in r["second"]["stats"]["calibration"].items()
                  if k in ("alpha_s", "seconds_per_byte", "allgather_seconds_per_byte")} for r in (a, b)]
        assert links[0] == links[1], links


def test_capacity_policy_adapts_identically_and_stays_exact(ddp_run):
    """CapacityPolicy: every rank rebuilds the same codecs at the same steps (payload shapes match,
    or the allreduce would fail), the embedding tables' capacity shrinks from 5% to what the batches
    use, and training equals DDP's default allreduce."""
    out, size = ddp_run
    rs = results(out, "policy", size)
    for r in rs:
        assert r["max_diff"] <= TOL, r
    assert len({json.dumps([r["history"], r["capacity"], r["union_capacity"], r["index"]]) for r in rs}) == 1
    hist = rs[0]["history"]
    assert any(len(h) >= 1 for h in hist), hist
    # the embedding tables (first two aggregators: 5000 and 3000 rows) shrank below the initial 5%
    for h, rows in zip(hist[:2], (5000, 3000)):
        assert h and h[-1][1] < 0.05 * rows * 8, h
    fixed = results(out, "average", size)[0]["stats"]
    assert rs[0]["stats"]["wire_ratio"] < fixed["wire_ratio"], (rs[0]["stats"], fixed)


def test_topk_hook_keeps_error_feedback(ddp_run):
    """topk_hook's average conserves error feedback (what the hook returned is what the ranks selected:
    their gradients and residuals, less what they still hold) and the replicas stay identical."""
    out, size = ddp_run
    check_topk(results(out, "topk", size))


def test_thc_hook_replicas_stay_identical_and_train(ddp_run):
    out, size = ddp_run
    check_thc(results(out, "thc", size))


@pytest.mark.parametrize("exact, message", [("w", "got a str"), ("param", "got a Parameter"),
                                             ("list with a name", "must hold parameters, got a str")])
def test_thc_exact_must_be_a_sequence_of_parameters(exact, message):
    """THCHookState(exact=model.out.weight) iterated the weight's rows, which match no parameter: the
    layer went through THC without a word. Now a TypeError; a list or a generator of parameters works."""
    import torch
    from lossless_hc.plugins.ddp import THCHookState
    w = torch.nn.Parameter(torch.zeros(3, 4))
    bad = {"w": "w", "param": w, "list with a name": [w, "out.weight"]}[exact]
    with pytest.raises(TypeError, match=message):
        THCHookState(exact=bad)
    assert THCHookState(exact=(p for p in [w]))._is_exact(w) and not THCHookState()._is_exact(w)


def test_thc_exact_parameters_are_the_dense_average(ddp_run):
    """THCHookState(exact=[users.weight, fc1.weight]): those two gradients equal the dense average of the
    ranks' local gradients (to float rounding of the sum), every step, the norm-only first step included;
    the THC'd fc-sized ones do not; stats()["thc"] says how each parameter was sent."""
    out, size = ddp_run
    for r in results(out, "thc_exact", size):
        for step, diffs in enumerate(r["diffs"]):
            assert diffs["users.weight"] <= TOL and diffs["fc1.weight"] <= TOL, (step, diffs)
            assert diffs["items.weight"] > 0, (step, diffs)   # THC: the norm-only round at step 0, noise after
        sent = sorted(d["sent_as"] for d in r["stats"]["thc"])
        assert sent.count("dense (exact=)") == 2 and "thc-interleaved" in sent, sent
        assert r["stats"]["sent_dense"] >= 2 * len(r["diffs"])


def test_thc_propagate_lets_grad_scaler_skip_the_step_on_every_rank(ddp_run):
    """#19 item 4: THCHookState(non_finite="propagate") under torch.amp.GradScaler. One rank's gradient
    holds Inf at step 3: no exception, every rank's reduced gradient is non-finite at that step (and
    only then), every rank's scaler skips it (the parameters do not move, the scale halves once), the
    next steps train (the parameters move), and the replicas stay bit-identical."""
    out, size = ddp_run
    check_grad_scaler_skips_once(results(out, "thc_amp", size))


def test_exact_hooks_let_grad_scaler_skip_the_step_without_growing(ddp_run):
    """The same with lossless and auto (allgather plans on a given slow link): the step with an Inf on
    one rank falls back to an exact dense SUM (Inf everywhere), the scaler skips it on every rank, and
    lossless keeps its capacity there (it doubled every compressed tensor's before: 2 growths here)."""
    out, size = ddp_run
    rs = results(out, "exact_amp", size)
    for name in ("lossless", "auto"):
        check_grad_scaler_skips_once([r[name] for r in rs])
    for r in rs:
        growths = r["lossless"]["growths"]   # the dense layers grow at the first step (a real overload)
        assert r["lossless"]["stats"]["fallbacks"] >= 3 and growths[3] == growths[2], growths


def test_error_feedback_lets_grad_scaler_skip_one_step_only(ddp_run):
    """The same with top-k's error feedback (topk_hook, and auto's top-k plans) and auto's THC plans: the
    step with an Inf on one rank is skipped on every rank and the next steps train. Before, top-k's
    residual kept the Inf, so every later step was non-finite and the scale halved for ever (auto's
    top-k: one more skipped step), and auto's THC raised FloatingPointError from the hook."""
    out, size = ddp_run
    rs = results(out, "lossy_amp", size)
    for name in ("topk", "auto_thc", "auto_topk"):
        check_grad_scaler_skips_once([r[name] for r in rs])
    for r in rs:
        for name in ("auto_thc", "auto_topk"):
            plans = {v["strategy"] for v in r[name]["stats"]["plan"].values()}
            assert name[5:] in plans, (name, plans)


def check_grad_scaler_skips_once(rs):
    for r in rs:
        assert r["error"] is None, r
        assert r["non_finite"] == [False] * 3 + [True] + [False] * 4, r["non_finite"]
        assert r["scales"] == [1024.0] * 3 + [512.0] * 5, r["scales"]
        assert r["moved"][3] == 0.0 and all(m > 0.0 for i, m in enumerate(r["moved"]) if i not in (0, 3)), r["moved"]
        assert r["finite"] and r["stats"]["compressed"] > 0
    assert len({r["digest"] for r in rs}) == 1


@pytest.mark.parametrize("name", list(ERRORS))
def test_misuse_is_a_clear_error_on_every_rank(ddp_run, name):
    """restored_other_size: a state pickled at this world size, registered on a group of one rank
    fewer (the last rank is not in it); restored_apart: a state unpickled without its DDP model."""
    out, size = ddp_run
    rs = [r for r in results(out, name, size) if not r.get("not_member")]
    assert len(rs) >= size - 1
    for r in rs:
        assert r["error"] == ERRORS[name] and MESSAGES[name] in r["message"], r


def test_digits_cnn_converges_with_topk_and_thc_under_torchrun(tmp_path):
    """scripts/launch_torchrun.sh with the DDP top-k and THC hooks reaches the uncompressed accuracy (the
    three trainings one after another in one launch: tests/mp/several_trainings.py)."""
    comps = ("none", "topk", "thc")
    run(["bash", os.path.join(ROOT, "scripts", "launch_torchrun.sh"), "2", os.path.join(HERE, "mp", "several_trainings.py"),
         str(tmp_path / "{compression}.json"), ",".join(comps), "--framework", "ddp", "--model", "digits"])
    acc = {comp: json.load(open(tmp_path / f"{comp}.json")) for comp in comps}
    assert acc["none"]["value"] > 0.9
    assert acc["topk"]["value"] >= acc["none"]["value"] - 0.05, acc
    assert acc["topk"]["bytes_per_step"] < 0.5 * acc["none"]["bytes_per_step"]
    assert acc["thc"]["value"] >= acc["none"]["value"] - 0.05, acc
    assert acc["thc"]["bytes_per_step"] < 0.5 * acc["none"]["bytes_per_step"]


@pytest.mark.gpu
@pytest.mark.parametrize("size", [2, 3])
def test_hooks_on_cuda_tensors_through_gloo(tmp_path, size):
    """Issue #22 on a GPU: the lossless, top-k and THC hooks over a model on GPU 0 for every rank (Gloo
    carries the CUDA tensors; NCCL refuses two ranks on one device). The lossless hook equals DDP's own
    allreduce to float rounding, with the same capacity and fallback decisions on every rank; top-k keeps
    its residual; THC's replicas stay bit-identical and train; bfloat16 and float16 models keep their
    bound and send their dense layers in their dtype (the message's parts on the device), and float16
    sums beyond 65504 average as DDP's do."""
    import torch
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    run([sys.executable, WORKER, str(size), str(free_port()), str(tmp_path),
         ",".join(EXACT + ["topk", "thc", "half_precision", "float16_large"])], device="cuda")
    for name in EXACT:
        check_lossless(results(tmp_path, name, size))
    check_half_precision(results(tmp_path, "half_precision", size))
    check_float16_large(results(tmp_path, "float16_large", size))
    check_topk(results(tmp_path, "topk", size))
    check_thc(results(tmp_path, "thc", size))


def test_when_all_keeps_order_and_raises_the_first_error():
    """The hooks' join of their collectives' futures (plugins/_torch_dist.when_all): every future's value
    in the order given, once all completed (one still pending keeps it pending), and a future's error is
    the join's, raised by its value() and by a ``then`` of it."""
    import torch
    from lossless_hc.plugins._torch_dist import when_all
    a, b = torch.futures.Future(), torch.futures.Future()
    joined = when_all([a, b], torch.device("cpu"))
    b.set_result(torch.tensor([2.0]))
    assert not joined.done()
    a.set_result(torch.tensor([1.0]))
    assert [t.tolist() for t in joined.wait()] == [[1.0], [2.0]]
    assert when_all([], torch.device("cpu")).wait() == []
    c, d = torch.futures.Future(), torch.futures.Future()
    failed = when_all([c, d], torch.device("cpu")).then(lambda fut: fut.value())
    c.set_result(torch.tensor([1.0]))
    d.set_exception(RuntimeError("a collective failed"))
    with pytest.raises(RuntimeError, match="a collective failed"):
        failed.wait()
