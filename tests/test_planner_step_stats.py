"""What an auto aggregator's steps count and time (lossless_hc.training.strategies, run in-process as
tests/test_planner.py runs them): the aggregation stats every step adds (a tensor sent dense or compressed,
a step no rank sends a row of, the plain step's input checked), the encode and decode seconds and the
measured seconds per strategy (an EWMA, a plain step timed to when its sum arrived), each second a
difference of the clock. The plans over steps: tests/test_planner_replan.py."""
import types

import pytest
import torch

import lossless_hc.training.plan_tracker as plan_tracker
import lossless_hc.training.strategies as strategies
from lossless_hc.training.strategies import AutoAggregator
from test_planner import run_step, sparse_rows
from test_planner_cost import MODEL


def fake_clock(monkeypatch, perf_counter) -> None:
    """The aggregators' clock (their steps' and plans' modules) replaced by ``perf_counter``."""
    for module in (strategies, plan_tracker):
        monkeypatch.setattr(module, "time", types.SimpleNamespace(perf_counter=perf_counter))


def test_measured_seconds_are_an_ewma_of_each_step_s_encode_to_result_time(monkeypatch):
    """plan_stats' measured seconds per strategy: the first step's encode-to-result time, then
    0.75 old + 0.25 new at every step (a clock that moves only when told to)."""
    now = [0.0]
    fake_clock(monkeypatch, lambda: now[0])
    n = 2
    aggs = [AutoAggregator("w", (64,), torch.float32, n, r, MODEL, allowed=("dense",)) for r in range(n)]
    for seconds in (1.0, 2.0, 4.0):
        now[0] = 0.0
        encoded = [a.encode(torch.ones(64)) for a in aggs]
        summed = torch.stack([p for p, _ in encoded]).sum(0)
        now[0] = seconds
        for a, (_, ctx) in zip(aggs, encoded):
            a.decode(summed.clone(), ctx)
    assert aggs[0].plan_stats()["measured_seconds"] == {"dense": 0.75 * (0.75 * 1.0 + 0.25 * 2.0) + 0.25 * 4.0}


def test_a_plain_step_recorded_later_is_timed_to_when_its_sum_arrived(monkeypatch):
    """record_plain_step(ended=...): the DDP hook accounts a plain step on the main thread after its future's
    callback noted the time its sum arrived; the step is timed to that time, not to when it is accounted,
    and counted as a step and its bytes as sent."""
    now = [100.0]
    fake_clock(monkeypatch, lambda: now[0])
    agg = AutoAggregator("w", (64,), torch.float32, 2, 0, MODEL, allowed=("dense",))
    agg.record_plain_step(10.0, ended=12.5)
    agg.record_plain_step(20.0, ended=21.0)
    st = agg.plan_stats()
    assert st["measured_seconds"] == {"dense": 0.75 * 2.5 + 0.25 * 1.0}
    assert st["steps"] == 2 and st["plain_steps"] == 2 and st["bytes_sent"] == 2 * 64 * 4
    agg.record_plain_step(99.0)   # no end given: now
    assert agg.plan_stats()["measured_seconds"]["dense"] == 0.75 * (0.75 * 2.5 + 0.25 * 1.0) + 0.25 * 1.0


def test_encode_plain_refuses_a_gradient_of_another_shape_or_dtype():
    """The step guard's plain step checks its input as encode does: a tensor of another shape or dtype
    than the aggregator's is a ValueError, not a payload of the wrong size in the engine's allreduce."""
    agg = AutoAggregator("w", (8, 4), torch.float32, 2, 0, MODEL)
    for strategy in ("dense", "bf16", "fp16"):
        with pytest.raises(ValueError, match="expected torch.float32"):
            agg.encode_plain(torch.zeros(33), strategy)
        with pytest.raises(ValueError, match="expected torch.float32"):
            agg.encode_plain(torch.zeros(8, 4, dtype=torch.float64), strategy)
    assert agg.steps == 0 and agg.stats.tensors == 0


def test_every_step_counts_one_tensor_sent_dense_or_compressed():
    """AggregationStats: ``tensors`` counts every encode/decode pair, ``sent_dense`` those sent as the dense
    tensor (a dense plan's statistics and plain steps, the guard's plain dense step), ``compressed`` the others
    (an allgather plan's step, a half-precision plain step)."""
    n = 2
    rng = torch.Generator().manual_seed(2)
    dense = [AutoAggregator("d", (64, 8), torch.float32, n, r, MODEL, allowed=("dense",)) for r in range(n)]
    for _ in range(2):   # the first step carries the statistics, the second is plain
        run_step(dense, [sparse_rows(rng, 64, 8, 4) for _ in range(n)])
    st = dense[0].stats
    assert (st.tensors, st.sent_dense, st.compressed) == (2, 2, 0)
    gathered = [AutoAggregator("g", (64, 8), torch.float32, n, r, MODEL, first="allgather", allowed=("allgather",))
                for r in range(n)]
    for _ in range(3):
        run_step(gathered, [sparse_rows(rng, 64, 8, 4) for _ in range(n)])
    st = gathered[0].stats
    assert (st.tensors, st.sent_dense, st.compressed) == (3, 0, 3)
    gathered[0].encode_plain(torch.zeros(64, 8), "bf16")
    gathered[0].encode_plain(torch.zeros(64, 8), "dense")
    assert (st.tensors, st.sent_dense, st.compressed) == (5, 1, 4)


def test_encode_and_decode_seconds_grow_with_every_call(monkeypatch):
    """AggregationStats' encode_seconds and decode_seconds add every call's time: encode (statistics and plain
    steps, encode_plain), decode, and finish after a request (a clock that ticks one second per reading)."""
    ticks = iter(range(1, 1_000_000))
    fake_clock(monkeypatch, lambda: float(next(ticks)))
    n = 2
    rng = torch.Generator().manual_seed(3)
    for strategy, steps in (("dense", 3), ("allgather", 2), ("bf16", 3)):
        aggs = [AutoAggregator("w", (64, 8), torch.float32, n, r, MODEL, lossy=True, lossy_min_bytes=0,
                               first=strategy, allowed=(strategy,), interval=3) for r in range(n)]
        st = aggs[0].stats
        for step in range(steps):
            before = (st.encode_seconds, st.decode_seconds)
            encoded = [a.encode(x) for a, x in zip(aggs, [sparse_rows(rng, 64, 8, 4) for _ in range(n)])]
            assert st.encode_seconds > before[0], (strategy, step)
            summed = torch.stack([p.double() for p, _ in encoded]).sum(0).to(encoded[0][0].dtype)
            outcomes = [a.decode(summed.clone(), ctx) for a, (_, ctx) in zip(aggs, encoded)]
            after_decode = st.decode_seconds
            assert after_decode > before[1], (strategy, step)
            if outcomes[0].request is not None:   # the second collective, as run_in_process does it
                reqs = [o.request.tensor for o in outcomes]
                result = (torch.stack(reqs) if outcomes[0].request.kind == "allgather"
                          else torch.stack([t.double() for t in reqs]).sum(0).to(reqs[0].dtype))
                for a, (_, ctx) in zip(aggs, encoded):
                    a.finish(ctx, result.clone())
                assert st.decode_seconds > after_decode, (strategy, step)
        before = st.encode_seconds
        aggs[0].encode_plain(torch.zeros(64, 8), "dense")
        assert st.encode_seconds > before


def test_seconds_are_differences_of_the_clock_so_a_clock_that_stands_still_adds_nothing(monkeypatch):
    """Every second counted is a difference of two clock readings (``perf_counter() - started``): where the
    clock stands still (here at 1000 s), encode_seconds, decode_seconds and the measured seconds stay 0, on
    statistics steps, plain steps and steps with a request alike."""
    fake_clock(monkeypatch, lambda: 1000.0)
    n = 2
    rng = torch.Generator().manual_seed(4)
    for strategy in ("dense", "allgather", "bf16"):
        aggs = [AutoAggregator("w", (64, 8), torch.float32, n, r, MODEL, lossy=True, lossy_min_bytes=0,
                               first=strategy, allowed=(strategy,), interval=3) for r in range(n)]
        for _ in range(3):
            run_step(aggs, [sparse_rows(rng, 64, 8, 4) for _ in range(n)])
        aggs[0].encode_plain(torch.zeros(64, 8), "dense")
        st = aggs[0].stats
        assert (st.encode_seconds, st.decode_seconds) == (0.0, 0.0), strategy
        assert aggs[0].plan_stats()["measured_seconds"] == {strategy: 0.0}


@pytest.mark.parametrize("strategy", ["allgather", "two_phase"])
def test_a_step_no_rank_sends_a_row_of_is_counted_and_observed(strategy):
    """A step where no rank holds a non-zero row needs no second collective (no slot to gather, an empty
    union), yet it is a step like any other: counted, timed, and its statistics (every count 0) observed and
    planned on, as on every rank alike."""
    n = 2
    aggs = [AutoAggregator("w", (64, 8), torch.float32, n, r, MODEL, first=strategy, allowed=(strategy,),
                           interval=1) for r in range(n)]
    for step in (1, 2):
        for y in run_step(aggs, [torch.zeros(64, 8) for _ in range(n)]):
            assert torch.equal(y, torch.zeros(64, 8))
        for a in aggs:
            assert (a.steps, a.tracker.steps, a.plans) == (step, step, step)
            assert a.tracker.rank_keys == [0.0, 0.0] and a.plan_input.rank_keys == (0, 0)
            assert a.tracker.union == 0.0 and a.plan_input.union_keys == 0   # no row in the union either
            assert strategy in a.plan_stats()["measured_seconds"]
