"""PowerSGD as auto(lossy)'s strategy for a DDP bucket (lossless_hc.training.powersgd): its pricing
against torch's own rule and against what ``powerSGD_hook`` sends on a real Gloo group, the bucket's
decision over synthetic statistics, and real DDP training (3 Gloo processes, tests/mp/powersgd_ddp_worker.py):
identical decisions on every rank, error feedback conserved across a top-k -> PowerSGD switch, and
convergence comparable to torch's own PowerSGD hook."""
import json
import os
import sys

import pytest
import torch
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import _should_compress

from lossless_hc.training.auto import AutoSpec
from lossless_hc.training.planner import STRATEGIES, Calibration, CostModel
from lossless_hc.training.powersgd import PowerSGDBucket, PowerSGDLayout, PowerSGDPlanner, powersgd_layout
from lossless_hc.training.strategies import AutoAggregator
from lossless_hc.plugins.ddp import AutoHookState
from helpers import free_port
from processes import run_launcher

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SIZE = 3
SLOW = CostModel(Calibration.default(bandwidth_bits=1e8))
FAST = CostModel(Calibration.default(bandwidth_bits=1e11, latency_s=1e-4))


# -- pricing ---------------------------------------------------------------------------------------------

def test_layout_follows_torchs_matrix_view_and_min_compression_rate():
    shapes = [(512, 512), (512,), (8, 8), (64, 3, 3, 3), (1000, 2), (3, 400), (1,), (16, 16)]
    lay = powersgd_layout(shapes, 4, 2)
    p = q = unc = 0
    compressed = []
    for i, s in enumerate(shapes):
        rows, cols = s[0], torch.Size(s).numel() // s[0]
        r = min(rows, cols, 4)
        if _should_compress(rows, cols, r, 2)[0]:   # torch's own rule
            compressed.append(i)
            p, q = p + rows * r, q + cols * r
        else:
            unc += rows * cols
    # vectors, 8x8, thin matrices and 16x16 (on the rule's tie: (16 + 16) 4 2 = 16 16) stay uncompressed
    assert lay.compressed == tuple(compressed) == (0, 3)
    assert (lay.p_numel, lay.q_numel, lay.uncompressed) == (p, q, unc)
    assert lay.numel == sum(torch.Size(s).numel() for s in shapes)
    # whole counts, as torch's view takes the columns (numel // rows), not floats
    assert all(type(v) is int for v in (lay.numel, lay.uncompressed, lay.p_numel, lay.q_numel, lay.flops))
    assert lay.flops == 6 * 512 * 512 * 4 + 2 * 1024 * 16 + 6 * 64 * 27 * 4 + 2 * 91 * 16
    assert CostModel.powersgd_collectives(lay) == [("allreduce", 4 * unc), ("allreduce", 4 * p), ("allreduce", 4 * q)]
    with pytest.raises(ValueError, match="views each gradient as a matrix"):
        powersgd_layout([()], 4, 2)   # torch's hook cannot view a scalar as a matrix
    # rank 0 "compressed" every matrix into nothing (0 bytes, 0 flops: PowerSGD predicted free), 2.5 ran at 2
    for rank, rate, error in ((0, 2, ValueError), (2.5, 2, TypeError), (True, 2, TypeError),
                              (4, -1, ValueError), (4, 0, ValueError), (4, float("nan"), ValueError)):
        with pytest.raises(error, match="rank|min_compression_rate"):
            powersgd_layout([(512, 512)], rank, rate)


def test_powersgd_prediction_pays_three_latencies_and_its_bytes():
    lay = PowerSGDLayout(numel=100, uncompressed=0, p_numel=0, q_numel=0, flops=0, compressed=())
    c = Calibration.default(bandwidth_bits=1e9, latency_s=1e-4)
    per_coord = c.codec_seconds["powersgd"][0]
    assert CostModel(c).predict_powersgd(lay, 4) == pytest.approx(3 * 6e-4 + 100 * per_coord)
    assert CostModel(c).predict_powersgd(lay, 1) == pytest.approx(100 * per_coord)   # one rank: no collective


def test_a_message_carries_half_precision_plain_steps_in_parts_of_their_dtype():
    """predict_message prices an fp16 or bf16 plan's plain step as its first payload: the tensor in its half
    dtype, in a part of its own however small (``message_layout``'s ``keep``, as AutoMessage lays it out:
    widened into the float32 part, as message.py's part rule widens a small half-precision gradient, the
    plan would send float32 bytes with half precision's error); a two_phase plan's rows are the one second
    allreduce. (Before, a half plan's every step was a header in the first part and a second allreduce per
    half dtype.)"""
    from lossless_hc.training.plan_stats import TensorStats
    model = CostModel(Calibration.default(bandwidth_bits=1e9, latency_s=1e-4))
    link, n = model.calibration.link, 4

    def stats(numel):
        return TensorStats(numel=numel, row=1, world_size=n, rank_keys=(10,) * n, union_keys=40)
    big, small = stats(1 << 18), stats(1000)
    (_, head), (_, rows) = model.collectives("two_phase", small)

    def local(*plans):
        return sum(model.local_seconds(st, s) for st, s in plans)
    # big: three first parts (float32: two_phase's header and bitmap; bfloat16; float16), then the rows
    assert model.predict_message([("fp16", big), ("bf16", big), ("two_phase", small)]) == pytest.approx(
        link.allreduce(head, n) + 2 * link.allreduce(2 * big.numel, n) + link.allreduce(rows, n)
        + local(("fp16", big), ("bf16", big), ("two_phase", small)))
    # small: the same parts (not widened into the float32 one)
    assert model.predict_message([("fp16", small), ("bf16", small), ("two_phase", small)]) == pytest.approx(
        link.allreduce(head, n) + 2 * link.allreduce(2 * small.numel, n) + link.allreduce(rows, n)
        + local(("fp16", small), ("bf16", small), ("two_phase", small)))
    # alone, a plain step is one collective of its half bytes, as collectives() says
    assert model.predict_message([("fp16", big)]) == pytest.approx(model.predict("fp16", big))


def test_a_message_pays_one_first_allreduce_per_part():
    """predict_message prices the first payloads in message_layout's parts: THC's float64 words and a
    dense plan's 64 Ki+ float32 coordinates are two allreduces (before: one, a latency short); a small
    float32 payload joins the float64 part, widened (its bytes doubled, no second latency), unless the link
    is so slow that its widened bytes cost more than a latency (message_layout's link)."""
    from lossless_hc.training.planner import LinkModel
    from lossless_hc.training.plan_stats import TensorStats
    model = CostModel(Calibration.default(bandwidth_bits=1e9, latency_s=1e-4))
    link, n = model.calibration.link, 4

    def stats(numel):
        return TensorStats(numel=numel, row=1, world_size=n, rank_keys=(numel,) * n, union_keys=numel)
    big, small = stats(1 << 17), stats(1000)
    thc = 8 * -(-model.collectives("thc", big)[0][1] // 8)   # whole float64 words (its header is float64 too)
    local = model.local_seconds("thc", big)
    dense_big, dense_small = model.collectives("dense", big)[0][1], model.collectives("dense", small)[0][1]
    assert model.predict_message([("thc", big), ("dense", big)]) == pytest.approx(
        link.allreduce(thc, n) + link.allreduce(dense_big, n) + local + model.local_seconds("dense", big))
    assert model.predict_message([("thc", big), ("dense", small)]) == pytest.approx(
        link.allreduce(thc + 2 * dense_small, n) + local + model.local_seconds("dense", small))
    assert model.predict_message([("dense", big), ("dense", small)]) == pytest.approx(
        link.allreduce(dense_big + dense_small, n) + model.local_seconds("dense", big)
        + model.local_seconds("dense", small))
    # on a 10 Mbit/s link the small payload's widened bytes cost more than a latency: a part of its own
    slow = CostModel(Calibration(LinkModel(1e-4, 8 / 10e6)))
    assert slow.predict_message([("thc", big), ("dense", small)]) == pytest.approx(
        slow.calibration.link.allreduce(thc, n) + slow.calibration.link.allreduce(dense_small, n) + local
        + model.local_seconds("dense", small))


def test_calibration_carries_powersgd_constants():
    c = Calibration.default()
    assert "powersgd" in c.codec_seconds and Calibration.from_list(c.as_list()) == c
    assert len(c.as_list()) == 4 + 2 * (len(STRATEGIES) + 1)   # alpha, the three betas, then (per coordinate, per key)


# -- the bucket's decision -----------------------------------------------------------------------------------

def planned(shapes, model, n=2, lossy=True, rows=None, **kw):
    """Every rank's aggregators for a bucket of ``shapes``, after one dense step of random dense
    gradients (in-process SUM), and the gradients of the next step. ``rows[i]``: tensor i's gradients
    have that many non-zero rows (random), where given."""
    g = torch.Generator().manual_seed(0)
    aggs = [[AutoAggregator(f"p{i}", s, torch.float32, n, r, model, lossy=lossy, interval=2, **kw)
             for i, s in enumerate(shapes)] for r in range(n)]

    def gradient(i):
        x = torch.randn(shapes[i], generator=g)
        if rows is not None and rows[i] is not None:
            x[torch.randperm(shapes[i][0], generator=g)[rows[i]:]] = 0
        return x

    for i in range(len(shapes)):
        xs = [gradient(i) for _ in range(n)]
        enc = [aggs[r][i].encode(xs[r]) for r in range(n)]
        summed = torch.stack([p for p, _ in enc]).sum(0)
        for r in range(n):
            assert aggs[r][i].decode(summed.clone(), enc[r][1]).request is None
    grads = [[gradient(i) for i in range(len(shapes))] for _ in range(n)]
    return aggs, grads


def decide(planners, aggs, grads, model, step=2, n=2):
    return [pl.bucket(0, step, aggs[r], grads[r], torch.cat([x.reshape(-1) for x in grads[r]]), model, n)
            for r, pl in enumerate(planners)]


def test_large_matrices_on_a_slow_link_go_to_powersgd_on_every_rank():
    shapes = [(1024, 1024), (1024,)]
    # top-k allgathered (1%: 84 KB per rank, PowerSGD's 37 KB) is predicted within SWITCH_MARGIN of PowerSGD at 2
    # ranks, and keeps the bucket per parameter; without it the per-parameter plans lose by more
    with_gather, grads = planned(shapes, SLOW)
    assert with_gather[0][0].strategy == "topk_allgather"
    assert decide([PowerSGDPlanner() for _ in range(2)], with_gather, grads, SLOW) == [None, None]
    aggs, grads = planned(shapes, SLOW, allowed=tuple(s for s in STRATEGIES if s != "topk_allgather"))
    planners = [PowerSGDPlanner() for _ in range(2)]
    assert decide(planners, aggs, grads, SLOW, step=1) == [None, None]   # before step index 2: never
    chosen = decide(planners, aggs, grads, SLOW)
    assert all(isinstance(c, PowerSGDBucket) for c in chosen)
    assert planners[0].stats() == planners[1].stats()
    d = planners[0].stats()[0]
    assert d["strategy"] == "powersgd" and d["predicted_seconds"]["powersgd"] < d["predicted_seconds"]["per_parameter"]
    assert chosen[0].wire_bytes() == 4 * (1024 + 1024 * 4 + 1024 * 4)
    # sticky: the same state at every later step, whatever the plans do
    assert decide(planners, aggs, grads, SLOW, step=9)[0] is chosen[0]
    plan = planners[0].plan_stats({"p0": {"strategy": "fp16", "changes": []}})
    assert plan["p0"]["strategy"] == "powersgd" and plan["p0"]["changes"] == [(2, "powersgd")]


def test_powersgd_takes_the_matrices_of_a_bucket_and_leaves_a_sparse_table_to_its_own_plan():
    """A table with a few rows per step beside dense matrices: PowerSGD of the whole bucket would compress
    the table too (its products cost as much as the matrices' and its P and Q more than its rows); the
    bucket sends the matrices through PowerSGD and the table (and the bias) through their plans."""
    shapes = [(8192, 256), (1024, 1024), (1024,), (512, 1024)]
    aggs, grads = planned(shapes, SLOW, rows=[8, None, None, None], allowed=("dense", "allgather"))
    assert [a.strategy for a in aggs[0]] == ["allgather", "dense", "dense", "dense"]
    planners = [PowerSGDPlanner() for _ in range(2)]
    chosen = decide(planners, aggs, grads, SLOW)
    assert planners[0].stats() == planners[1].stats()
    d = planners[0].stats()[0]
    p = d["predicted_seconds"]
    assert d["strategy"] == "powersgd_part" and p["powersgd_part"] < min(p["powersgd"], p["per_parameter"]), d
    assert chosen[0].members == (1, 3) and d["powersgd_parameters"] == ["p1", "p3"]
    assert chosen[0].of_others(["a", "b", "c", "d"]) == ["a", "c"]
    assert chosen[0].layout == powersgd_layout([(1024, 1024), (512, 1024)], 4, 2)
    assert chosen[0].wire_bytes() == 4 * (0 + (1024 + 512) * 4 + (1024 + 1024) * 4)
    assert p["powersgd_part"] == pytest.approx(SLOW.predict_powersgd(chosen[0].layout, 2) + SLOW.predict_message(
        [a.current_plan() for a in (aggs[0][0], aggs[0][2])]))
    plan = planners[0].plan_stats({f"p{i}": {"strategy": a.strategy, "changes": []} for i, a in enumerate(aggs[0])})
    assert [plan[f"p{i}"]["strategy"] for i in range(4)] == ["allgather", "powersgd", "dense", "powersgd"]
    # the part a PowerSGD step runs on: a copy of the members, views of it as their gradients
    sub = chosen[0].part(0, grads[0])
    assert [tuple(t.shape) for t in sub.gradients()] == [(1024, 1024), (512, 1024)]
    assert torch.equal(sub.buffer(), torch.cat([grads[0][1].reshape(-1), grads[0][3].reshape(-1)]))
    assert sub.gradients()[1].data_ptr() == sub.buffer()[1024 * 1024:].data_ptr() and sub.index() == 0
    # the same matrices without the table: PowerSGD takes the whole bucket, as before
    aggs, grads = planned(shapes[1:], SLOW, allowed=("dense", "allgather"))
    planners = [PowerSGDPlanner() for _ in range(2)]
    chosen = decide(planners, aggs, grads, SLOW)
    assert chosen[0].members is None and chosen[0].names == ["p0", "p1", "p2"]
    # a step's counters: the two matrices compressed, the bias sent as it is, the three allreduces' bytes
    planners[0].count_step(chosen[0], grads[0])
    st = planners[0].agg_stats
    assert (st.tensors, st.compressed, st.sent_dense) == (3, 2, 1)
    assert (st.dense_bytes, st.payload_bytes) == (4 * (1024 * 1024 + 1024 + 512 * 1024), chosen[0].wire_bytes())


def test_a_matrix_is_a_member_when_its_share_beats_its_plan_beyond_the_latencies_the_bucket_pays_once():
    """_members prices a matrix alone on PowerSGD less its three allreduces' latencies (the bucket pays them
    once) against its own plan less the first allreduce's: on a 1 Gbit/s link with 1 ms per hop a 512x256
    matrix beside a sparse table is a member (its share 0.7 ms, its dense plan 4.3 ms beyond the latency),
    so PowerSGD on the part is priced, though the per-parameter plans stay cheapest here."""
    model = CostModel(Calibration.default(bandwidth_bits=1e9, latency_s=1e-3))
    shapes = [(8192, 256), (512, 256)]
    aggs, grads = planned(shapes, model, rows=[8, None], allowed=("dense", "allgather"))
    planners = [PowerSGDPlanner() for _ in range(2)]
    assert decide(planners, aggs, grads, model) == [None, None]
    p = planners[0].stats()[0]["predicted_seconds"]
    part = powersgd_layout(shapes[1:], 4, 2)
    assert p["powersgd_part"] == pytest.approx(model.predict_powersgd(part, 2) + model.predict_message(
        [aggs[0][0].current_plan()]))


def test_a_seed_beyond_32_bits_seeds_powersgd_too():
    """The spec's seed is a uint64; torch's PowerSGDState seeds numpy's RandomState with it, which takes only
    [0, 2**32): the bucket's switch to PowerSGD raised "Seed must be between 0 and 2**32 - 1" mid-run. It
    gets the seed's halves XORed (a seed below 2**32 as it is); a seed that is not a uint64 is refused."""
    aggs, grads = planned([(1024, 1024), (1024,)], SLOW, allowed=tuple(s for s in STRATEGIES if s != "topk_allgather"))
    seed = (1 << 40) + 7
    chosen = decide([PowerSGDPlanner(seed=seed) for _ in range(2)], aggs, grads, SLOW)
    assert all(isinstance(c, PowerSGDBucket) for c in chosen)
    assert chosen[0].state.rng.randint(1 << 30) == chosen[1].state.rng.randint(1 << 30)   # every rank alike
    from lossless_hc.training.powersgd import powersgd_seed
    assert powersgd_seed(seed) == 256 + 7 and powersgd_seed(5) == 5 and powersgd_seed((1 << 64) - 1) == 0
    assert AutoHookState(lossy=True, seed=seed)._powersgd.seed == seed
    for bad, error in ((1.5, TypeError), (-1, ValueError), (1 << 64, ValueError)):
        with pytest.raises(error, match="seed"):
            PowerSGDPlanner(seed=bad)


def test_a_bucket_pickled_before_parts_existed_restores_as_a_whole_bucket():
    bucket = PowerSGDBucket(["w", "b"], powersgd_layout([(64, 32), (64,)], 4, 2), 4, 2, 2, 0, 2, {}, members=[0])
    assert bucket.names == ["w"] and bucket.bucket_names == ["w", "b"] and bucket.members == (0,)
    old = dict(bucket.__dict__)
    del old["members"], old["bucket_names"]
    old["names"] = ["w", "b"]
    restored = PowerSGDBucket.__new__(PowerSGDBucket)
    restored.__setstate__(old)
    assert restored.members is None and restored.bucket_names == ["w", "b"]
    assert restored.of_members(["gw", "gb"]) == ["gw", "gb"]


def test_small_or_vector_buckets_and_fast_links_keep_their_per_parameter_plans():
    for shapes, model in (([(1024, 1024), (1024,)], FAST), ([(16, 16), (16,)], SLOW), ([(4096,)], SLOW)):
        aggs, grads = planned(shapes, model)
        planners = [PowerSGDPlanner() for _ in range(2)]
        assert decide(planners, aggs, grads, model) == [None, None], shapes
        assert planners[0].stats()[0]["strategy"] == "per_parameter"
        # no matrix beats its own plan here: no part of the bucket is priced
        assert "powersgd_part" not in planners[0].stats()[0]["predicted_seconds"]
        assert planners[0].stats() == planners[1].stats()


def test_a_bucket_is_compared_again_only_after_a_re_plan():
    aggs, grads = planned([(1024, 1024)], FAST)
    planner = PowerSGDPlanner()
    assert decide([planner], aggs[:1], grads[:1], FAST) == [None]
    assert decide([planner], aggs[:1], grads[:1], SLOW) == [None]   # no re-plan since: not compared again
    aggs[0][0]._plan()                                               # a re-plan (here: on the same statistics)
    assert isinstance(decide([planner], aggs[:1], grads[:1], SLOW)[0], PowerSGDBucket)


def test_the_switch_sends_the_per_parameter_error_feedback():
    """A parameter on top-k holds a residual; the bucket going to PowerSGD adds it to the gradient."""
    shapes = [(512, 256)]
    aggs, grads = planned(shapes, SLOW, first="topk", allowed=("topk",))
    assert aggs[0][0].strategy == "topk" and aggs[0][0]._topk.residual.abs().sum() > 0
    residual = aggs[0][0]._topk.residual.reshape(shapes[0]).clone()
    before = grads[0][0].clone()
    decide([PowerSGDPlanner()], aggs[:1], grads[:1], SLOW)
    assert torch.equal(grads[0][0], before + residual) and aggs[0][0].take_lossy_memory() is None


def test_powersgd_is_offered_only_with_lossy_and_only_by_the_ddp_hook():
    assert AutoHookState(lossy=True)._powersgd is not None
    assert AutoHookState(lossy=False)._powersgd is None                          # exact: never
    assert AutoHookState(lossy=True, strategies=("fp16", "thc"))._powersgd is None
    st = AutoHookState(lossy=True, strategies=("powersgd",))
    assert st._powersgd is not None and st.spec.strategies == ("dense",)
    with pytest.raises(ValueError, match="lossy=True"):
        AutoHookState(strategies=("dense", "powersgd"))
    with pytest.raises(ValueError, match="strategies must be a non-empty subset of"):
        AutoSpec(lossy=True, strategies=("powersgd",))   # Compression.auto, AutoFSDPState: no bucket to give it
    with pytest.raises(ValueError, match="powersgd_start must be an integer >= 2"):
        AutoHookState(lossy=True, powersgd_start=1)       # torch's minimum with error feedback
    with pytest.raises(ValueError, match="powersgd_rank"):
        AutoHookState(lossy=False, powersgd_rank=-3)      # checked with PowerSGD off too (it was ignored)
    assert AutoHookState(lossy=True, strategies=iter(["powersgd", "thc"])).spec.strategies == ("thc",)
    assert "powersgd(rank=4" in repr(AutoHookState(lossy=True))   # part of the cross-rank configuration check
    assert not PowerSGDPlanner.offered(torch.zeros(3), [torch.zeros(())], 2)   # a scalar gradient
    assert not PowerSGDPlanner.offered(torch.zeros(3, dtype=torch.float64), [torch.zeros(3, dtype=torch.float64)], 2)


# -- real DDP, 3 Gloo processes ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("powersgd_ddp")
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    names = ("choice", "switch_guard_dense", "switch_guard_plan", "part", "part_guard_powersgd", "part_guard_plan",
             "part_half", "converge", "resume", "resume_mid_trial")
    proc = run_launcher([sys.executable, os.path.join(HERE, "mp", "powersgd_ddp_worker.py"), str(SIZE),
                         str(free_port()), str(out), ",".join(names)], cwd=ROOT, env=env, timeout=600)
    assert proc.returncode == 0, f"{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return {name: [json.load(open(os.path.join(out, f"{name}.rank{r}.json"))) for r in range(SIZE)] for name in names}


@pytest.mark.multiprocess
def test_ddp_auto_lossy_takes_powersgd_identically_and_sends_what_it_predicts(run):
    rs = run["choice"]
    for r in rs:
        # the digest is of the lossy run's trained replica: it moved off its seed-0 start, identically
        assert (r["plan"], r["buckets"], r["digest"]) == (rs[0]["plan"], rs[0]["buckets"], rs[0]["digest"])
        assert r["moved"] > 1e-3, r["moved"]   # max |trained - initial| measured 0.0100 (8 SGD steps)
    buckets = rs[0]["buckets"]
    psgd = [i for i, b in buckets.items() if b["strategy"] == "powersgd"]
    assert psgd and "powersgd" in rs[0]["plan"].values()
    for r in rs:
        assert r["per_step"][0] == r["per_step"][1] == {}   # steps 0, 1: the per-parameter plans
        for step in r["per_step"][2:]:
            # exactly powerSGD_hook's three allreduces on the bucket's group, of the predicted sizes
            assert step == r["predicted_bytes"], (step, r["predicted_bytes"])
    for i in psgd:
        assert buckets[i]["wire_bytes_per_step"] == sum(rs[0]["predicted_bytes"][i])
    # the counters take every gradient of every step, PowerSGD's included: 8 steps of the MLP's float32 bytes
    numel = 64 * 256 + 256 + 256 * 256 + 256 + 256 * 16 + 16
    assert all(r["dense_bytes"] == 8 * 4 * numel for r in rs), [r["dense_bytes"] for r in rs]
    assert "powersgd" not in rs[0]["exact_plan"].values() and rs[0]["exact_buckets"] == {}   # lossy=False


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", ["switch_guard_dense", "switch_guard_plan"])
def test_a_switch_from_top_k_to_powersgd_and_the_step_guard_conserve_the_error_feedback(run, name):
    """n x (sum of the averaged outputs) + every rank's PowerSGD memory = sum of every gradient: top-k's
    residual at the switch (large) went into PowerSGD's input, nothing was dropped. The step guard's trial
    then weighs the PowerSGD bucket (PowerSGD at steps 3 and 4, allreduced in place at 5 and 6 with its
    memory kept); on a dense verdict (forced) the bucket leaves PowerSGD at step 7 and its memory goes out
    with that step (none is left); a look for the plans is confirmed (PowerSGD at 7 and 8, in place at 9 and
    10) and it keeps PowerSGD."""
    rs = run[name]
    dense = name == "switch_guard_dense"
    for r in rs:
        assert r["plan"] == rs[0]["plan"] and r["digest"] == rs[0]["digest"]
        assert r["since_step"] == 2 and r["residual_before"] > 1.0 and not r["left"]
        g = r["guard"]
        assert g == rs[0]["guard"], (g, rs[0]["guard"])   # rank 0's verdict and medians
        assert (g["trials"], g["window"], g["verdict"]) == (1, 3, "dense" if dense else "plan"), g
        bucket = r["buckets"]["0"] if "0" in r["buckets"] else r["buckets"][0]
        # PowerSGD ran at 2 to 4, then (plans kept after the confirmation round: PowerSGD at 7 and 8, in place
        # at 9 and 10, the verdict at 11) at 7, 8 and 11: never in a dense window (steps 5, 6, 9, 10)
        assert bucket["steps"] == (3 if dense else 6) and bucket["left_step"] == (7 if dense else None), bucket
        assert r["memory_left"] == (not dense), r
        assert r["conservation_error"] <= 1e-5 * r["scale"] * r["steps"], r
    assert list(rs[0]["plan"].values())[0] == ["powersgd", [[2, "powersgd"]]]


@pytest.mark.multiprocess
def test_a_model_saved_with_powersgd_buckets_resumes_them_after_ddp_rebuilds_its_buckets(run):
    """torch.save(ddp) of a model whose bucket runs PowerSGD, loaded and trained on: the loaded model's first
    step has its bucket in registration order (it raised "changed its parameters after going to PowerSGD"),
    so it goes in place with the memory kept; from the next, rebuilt as saved, PowerSGD carries on with its
    memory, and nothing is lost: n x (sum of the averaged gradients) + every rank's memory = every gradient."""
    rs = run["resume"]
    for r in rs:
        assert (r["after"], r["digest"]) == (rs[0]["after"], rs[0]["digest"])
        before, after = r["before"]["0"], r["after"]["0"]
        assert before["strategy"] == after["strategy"] == "powersgd" and before["steps"] == 3   # steps 2 to 4
        assert after["steps"] == 7 and after["since_step"] == 2   # and 6 to 9 (5: the loaded model's first)
        assert after["powersgd_parameters"] == before["powersgd_parameters"]
        assert r["conservation_error"] <= 1e-5 * r["scale"] * r["steps"], r


@pytest.mark.multiprocess
def test_powersgd_takes_the_dense_weight_of_a_bucket_and_leaves_the_table_to_its_allgather(run):
    """One bucket, a table with a few rows per step and a dense weight: PowerSGD runs on the weight alone
    (its three allreduces of the weight's sizes, on its own group), the table's average is exact at every step
    of its plan and of the dense window, and the error feedback is conserved through the step guard's trial
    and its dense verdict: the trial's PowerSGD window (torch's hook on the whole bucket at steps 7 and 8, the
    table too) keeps a memory of its own, which goes out with step 9 beside the weight's part's."""
    rs = run["part"]
    for r in rs:
        assert (r["plan"], r["buckets"], r["digest"], r["guard"]) == (rs[0]["plan"], rs[0]["buckets"],
                                                                        rs[0]["digest"], rs[0]["guard"])
        errors = r["table_errors"]
        assert [e for t, e in enumerate(errors) if t not in (7, 8, 9)] == [0.0] * 7, errors
        assert min(errors[7:10]) > 0.1, errors   # PowerSGD's approximation, then its memory, of the table
        # PowerSGD's part at steps 2 to 4 (the dense window at 5 and 6, the whole bucket at 7 and 8): the weight's
        # sizes only on the part's group
        assert r["per_step"] == [[], [], *[r["predicted_bytes"]] * 3, *[[]] * 5], r["per_step"]
        assert r["predicted_bytes"] == [0, 4 * 256 * 4, 4 * 192 * 4]
        g = r["guard"]
        assert g["verdict"] == "dense" and g["windows"] == ["plan", "dense", "powersgd"], g
        assert g["powersgd_ms"] > 0 and not r["memory_left"] and r["trials_left"] == 0
        assert r["conservation_error"] <= 1e-5 * r["scale"] * r["steps"], r
        assert r["table_conservation_error"] <= 1e-5 * 8 * r["steps"], r
    bucket = rs[0]["buckets"]["0"] if "0" in rs[0]["buckets"] else rs[0]["buckets"][0]
    assert bucket["strategy"] == "powersgd_part" and bucket["steps"] == 3 and bucket["left_step"] == 9, bucket
    assert bucket["powersgd_parameters"] == ["param0(256, 192)"], bucket
    p = bucket["predicted_seconds"]
    assert p["powersgd_part"] < min(p["powersgd"], p["per_parameter"]), p
    assert rs[0]["plan"] == {"param0(256, 192)": "powersgd", "param1(2000, 64)": "allgather"}, rs[0]["plan"]


@pytest.mark.multiprocess
def test_a_powersgd_verdict_of_the_step_guard_moves_the_whole_bucket_to_powersgd_and_conserves_every_memory(run):
    """The step guard's third window runs torch's hook on the whole bucket (the table too); a verdict for it
    (forced; a first look confirmed by a second round) makes the bucket run that PowerSGD for good, with the
    weight's part memory handed to it: every rank's averaged outputs times n plus every rank's memory equal
    the sum of every gradient, the table's and the weight's, through the plans, every window and the switch."""
    rs = run["part_guard_powersgd"]
    for r in rs:
        assert (r["plan"], r["buckets"], r["digest"], r["guard"]) == (rs[0]["plan"], rs[0]["buckets"],
                                                                        rs[0]["digest"], rs[0]["guard"])
        windows = ["plan"] * 2 + ["dense"] * 2 + ["powersgd"] * 2
        assert r["phases"] == ["plan"] * 3 + windows * 2 + ["powersgd"] * 3, r["phases"]
        g = r["guard"]
        assert (g["verdict"], g["rounds"], g["trials"]) == ("powersgd", 2, 1), g
        errors = r["table_errors"]
        assert [errors[t] for t in (0, 1, 2, 3, 4, 5, 6, 9, 10, 11, 12)] == [0.0] * 11, errors   # exact: plans, dense
        assert min(errors[t] for t in (7, 8, 13, 14, 15, 16, 17)) > 0.1, errors   # PowerSGD's approximations
        assert r["whole"] and r["since_step"] == 15 and r["trials_left"] == 0, r
        assert r["powersgd_steps"] == 7, r   # the trial's state: steps 7, 8, 13, 14, then 15 to 17
        for key, err in r["conservation_errors"].items():
            assert err <= 1e-5 * r["scale"] * r["steps"], (key, r)
    assert rs[0]["plan"] == {"param0(256, 192)": "powersgd", "param1(2000, 64)": "powersgd"}, rs[0]["plan"]
    bucket = rs[0]["buckets"]["0"] if "0" in rs[0]["buckets"] else rs[0]["buckets"][0]
    assert bucket["strategy"] == "powersgd" and bucket["step_guard"] and bucket["since_step"] == 15, bucket


@pytest.mark.multiprocess
def test_the_trial_s_powersgd_memory_sent_after_a_verdict_for_the_plans_is_not_counted_as_statistics(run):
    """After a verdict for the plans (forced, confirmed: at step 15) the trial's PowerSGD memory of the bucket,
    the table's rows of its PowerSGD steps among it, goes out with that step (the table's sum is exact and
    none is left); the table's allgather plan does not count those rows as statistics: its per-rank count and
    peak stay at the 16 rows each step has (a peak of the memory's rows priced allgather by it, and moved
    NCF's tables to top-k allgathered: docs/BENCHMARKS.md)."""
    rs = run["part_guard_plan"]
    for r in rs:
        assert r["guard"]["verdict"] == "plan" and r["guard"]["rounds"] == 2, r["guard"]
        windows = ["plan"] * 2 + ["dense"] * 2 + ["powersgd"] * 2
        assert r["phases"] == ["plan"] * 3 + windows * 2 + ["plan"] * 2, r["phases"]
        assert r["trials_left"] == 0 and r["plan"]["param1(2000, 64)"] == "allgather", r
        assert all(count == 16 and peak <= 16 for count, peak in r["counts"]), r["counts"]
        assert r["table_conservation_error"] <= 1e-5 * 8 * 17, r


@pytest.mark.multiprocess
def test_a_model_saved_inside_the_guard_s_powersgd_window_keeps_its_trial_memory(run):
    """torch.save(ddp) after the first step of the step guard's PowerSGD window, on a link fast enough that the
    planner gave no bucket PowerSGD: the loaded model's first step goes in place (its bucket in registration
    order; the trial's memory waits), the verdict (dense, forced) then sends that memory: every rank's averages
    times n equal the sum of every gradient, the table's and the weight's, with no memory left."""
    rs = run["resume_mid_trial"]
    for r in rs:
        assert (r["buckets"], r["digest"], r["guard"]) == (rs[0]["buckets"], rs[0]["digest"], rs[0]["guard"])
        assert r["trials_saved"] == [0] and r["trials_left"] == 0, r
        assert r["guard"]["verdict"] == "dense" and r["guard"]["windows"] == ["plan", "dense", "powersgd"], r["guard"]
        errors = r["table_errors"]
        assert errors[7] > 0.1 and errors[9] > 0.1, errors   # PowerSGD at 7; the memories out at 9
        assert [errors[t] for t in (0, 1, 2, 3, 4, 5, 6, 8, 10, 11)] == [0.0] * 10, errors   # 8: in place
        for key, err in r["conservation_errors"].items():
            assert err <= 1e-5 * r["scale"] * r["steps"], (key, r)
    assert rs[0]["plan"] == {"param0(256, 192)": "dense", "param1(2000, 64)": "allgather"}, rs[0]["plan"]
    assert all(b["strategy"] == "per_parameter" for b in rs[0]["buckets"].values()), rs[0]["buckets"]


@pytest.mark.multiprocess
def test_a_half_precision_plan_beside_a_powersgd_part_leaves_the_part_alone(run):
    """One bucket: PowerSGD on the weight (from step 2), a long vector planned fp16. The vector's plain
    half-precision step is sent with the bucket's other gradients, not as the whole bucket in fp16 (which
    would drop PowerSGD's result and leave its error feedback unbalanced): the weight's error feedback is
    conserved up to the float16 rounding of its step before PowerSGD (its fp16 plan at step 1, which keeps
    no memory), where the whole bucket in fp16 misses by the size of the gradients."""
    rs = run["part_half"]
    for r in rs:
        assert (r["plan"], r["buckets"], r["digest"]) == (rs[0]["plan"], rs[0]["buckets"], rs[0]["digest"])
        assert r["conservation_error"] <= 2.0 ** -10 * r["scale"] * r["steps"], r
    assert rs[0]["plan"] == {"param0(256, 192)": "powersgd", "param1(100000,)": "fp16"}, rs[0]["plan"]
    bucket = rs[0]["buckets"]["0"]
    assert bucket["strategy"] == "powersgd_part" and bucket["steps"] == 4, bucket
    assert bucket["powersgd_parameters"] == ["param0(256, 192)"], bucket


@pytest.mark.multiprocess
def test_training_with_auto_lossy_converges_like_torchs_powersgd(run):
    rs = run["converge"]
    losses = rs[0]["losses"]
    assert "powersgd" in rs[0]["plan"].values()
    assert all(r["plan"] == rs[0]["plan"] for r in rs)
    first, none, torch_psgd, auto = (losses["none"][0], losses["none"][-1], losses["torch_powersgd"][-1],
                                     losses["auto_lossy"][-1])
    assert auto < 0.1 * first                     # it trains
    assert auto <= 1.25 * torch_psgd, losses      # as well as torch's own PowerSGD hook (same rank, start)
    assert auto <= 2.0 * none, losses


def test_a_zero_gradient_matrix_stays_finite_at_low_rank():
    """torch's Gram-Schmidt (ranks 1, 2) divides by a column's norm: the state's epsilon keeps an
    all-zero gradient finite (with torch's default 0 it turns NaN)."""
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import _orthogonalize

    lay = powersgd_layout([(64, 32)], 1, 2)
    bucket = PowerSGDBucket(["w"], lay, 1, 2, 2, 0, 2, {})
    p = torch.zeros(1, 64, 1)
    _orthogonalize(p, bucket.state.orthogonalization_epsilon)
    assert torch.isfinite(p).all()
    _orthogonalize(p.zero_(), 0)
    assert not torch.isfinite(p).all()


def test_a_message_batches_its_second_allreduces_per_gradient_dtype_and_splits_a_narrow_dense_body():
    """predict_message: the second collectives as decode_message batches them, one allreduce per request
    dtype (the gradient's) summing its tensors' rows; and a dense plan of a gradient narrower than its
    float32 header sends the header in the float32 part and the body in the gradient's width (its plain
    steps'), a part of its own (bfloat16, at the half slope) when large."""
    from lossless_hc.training.planner import LinkModel
    from lossless_hc.training.plan_stats import TensorStats, stats_header_words
    model = CostModel(Calibration(LinkModel(1e-4, 8e-9, 16e-9, 12e-9)))
    link, n = model.calibration.link, 4

    def stats(keys, element_bytes=4, numel=1 << 16, row=16):
        return TensorStats(numel, row, n, (keys,) * n, 3 * keys, element_bytes=element_bytes)
    a, b, c = stats(100), stats(50), stats(50, element_bytes=8)
    (_, ha), (_, ra) = model.collectives("two_phase", a)
    (_, hb), (_, rb) = model.collectives("two_phase", b)
    (_, hc), (_, rc) = model.collectives("two_phase", c)
    assert ra == 4 * 300 * 16 and rb == rc == 4 * 150 * 16

    def local(*ss):
        return sum(model.local_seconds("two_phase", s) for s in ss)
    assert model.predict_message([("two_phase", a), ("two_phase", b)]) == pytest.approx(
        link.allreduce(ha + hb, n) + link.allreduce(ra + rb, n) + local(a, b), rel=1e-12)
    assert model.predict_message([("two_phase", a), ("two_phase", b), ("two_phase", c)]) == pytest.approx(
        link.allreduce(ha + hb + hc, n) + link.allreduce(ra + rb, n) + link.allreduce(rc, n) + local(a, b, c),
        rel=1e-12)
    half = stats(10, element_bytes=2, numel=1 << 18, row=1)
    assert model.collectives("dense", half) == [("allreduce", 4 * stats_header_words(n) + 2 * half.numel)]
    assert model.predict_message([("dense", half)]) == pytest.approx(
        link.allreduce(4 * stats_header_words(n), n) + link.allreduce(2 * half.numel, n, half=True)
        + model.local_seconds("dense", half), rel=1e-12)
