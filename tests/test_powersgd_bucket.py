"""One PowerSGD bucket's state (lossless_hc.training.powersgd: PowerSGDBucket, PowerSGDPlanner.leave) in one
process: torch's hook run on a 1-rank Gloo group, the error memory it keeps, and what leaving PowerSGD hands
back; the step guard's PowerSGD window's states (PowerSGDPlanner.window_bucket, end_trial). The planner's
decisions and the multi-process DDP runs are in tests/test_planner_powersgd.py."""
import pickle

import numpy as np
import pytest
import torch
import torch.distributed as dist

from lossless_hc.training.planner import SWITCH_MARGIN, Calibration, CostModel, LinkModel
from lossless_hc.training.powersgd import PowerSGDBucket, PowerSGDPlanner, powersgd_layout, powersgd_seed


def _bucket(shapes, members=None, rank=4):
    names = [f"p{i}" for i in range(len(shapes))]
    taken = shapes if members is None else [shapes[i] for i in members]
    return PowerSGDBucket(names, powersgd_layout(taken, rank, 2), rank, 2, 2, 0, 2, {}, members=members)


@pytest.fixture
def one_rank_group(gloo_world_of_one):
    return dist.new_group([0])


def test_a_run_compresses_the_part_on_its_group_and_leaving_hands_back_its_error_memory(one_rank_group):
    """run() makes torch's hook compress from the first call (the planner decides when PowerSGD starts: the
    state's own iteration count would send the first steps uncompressed), on the group it is given, and counts
    the step. On one rank the hook's average is the rank-4 approximation of the matrix (the vector goes
    uncompressed, as it is), and the error memory is what it left out: output + error = input. leave() then
    hands that memory back once (removed from torch's state, the warm-start memories dropped), and records
    the step it left at; a bucket that never ran PowerSGD, or already left, has nothing to hand back."""
    g = torch.Generator().manual_seed(0)
    grads = [torch.randn(64, 32, generator=g), torch.randn(64, generator=g), torch.randn(48, 16, generator=g)]
    chosen = _bucket([tuple(x.shape) for x in grads], members=(0, 1))
    assert chosen.error(5) is None   # before a step
    part = chosen.part(5, grads)
    given = part.buffer().clone()
    out = chosen.run(part, one_rank_group).wait()
    assert chosen.steps == 1 and chosen.state.process_group is one_rank_group
    assert out.data_ptr() == part.buffer().data_ptr()
    matrix, vector = out[:64 * 32], out[64 * 32:]
    assert torch.equal(vector, grads[1])                                   # uncompressed: the 1-rank SUM
    assert not torch.allclose(matrix, grads[0].reshape(-1), atol=1e-2)     # compressed: rank 4 of 32 columns
    assert torch.linalg.matrix_rank(matrix.reshape(64, 32)) == 4
    err = chosen.error(5)
    assert err is not None and err.shape == given.shape
    assert torch.allclose(out + err, given, atol=1e-5)
    assert chosen.state.p_memory_dict and chosen.state.q_memory_dict
    planner = PowerSGDPlanner()
    planner.buckets[5] = chosen
    assert planner.leave(3, 7) is None   # no such bucket
    taken = planner.leave(5, 7)
    assert taken is err and chosen.left_step == 7 and chosen.error(5) is None
    assert not chosen.state.p_memory_dict and not chosen.state.q_memory_dict
    assert planner.leave(5, 8) is None and chosen.left_step == 7   # already left
    assert planner.parameter_names() == frozenset({"p0", "p1"})


def test_add_to_adds_the_memory_to_the_gradients_powersgd_takes_only():
    """add_to: a whole bucket's memory goes into its flat buffer; a part's, split over its members in bucket
    order, into their gradients (views into the buffer), the other gradients left as they are."""
    shapes = [(8, 4), (6,), (5, 3)]
    buffer = torch.arange(32 + 6 + 15, dtype=torch.float32)
    grads = [v.view(s) for v, s in zip(torch.split(buffer, [32, 6, 15]), shapes)]
    whole = _bucket(shapes)
    flat = torch.full((53,), 0.5)
    before = buffer.clone()
    whole.add_to(flat, buffer, grads)
    assert torch.equal(buffer, before + 0.5)
    part = _bucket(shapes, members=(0, 2))
    memory = torch.cat([torch.full((32,), 1.0), torch.full((15,), 2.0)])
    before = buffer.clone()
    part.add_to(memory, buffer, grads)
    assert torch.equal(buffer[:32], before[:32] + 1.0)
    assert torch.equal(buffer[32:38], before[32:38])
    assert torch.equal(buffer[38:], before[38:] + 2.0)


def test_a_planner_refuses_a_non_positive_compression_rate_and_a_bucket_that_changed_its_parameters():
    """min_compression_rate must be > 0 (torch's rule would compress nothing, or everything), and below 1 is
    fine (powersgd_layout takes any number > 0); a PowerSGD
    bucket whose DDP bucket later holds other parameters is an error, not an error memory added to the
    wrong gradients."""
    for bad in (0, -1.0, float("nan"), "2", True, None):   # a string or True was taken as float() took it
        with pytest.raises(ValueError, match="min_compression_rate"):
            PowerSGDPlanner(min_compression_rate=bad)
    assert PowerSGDPlanner(min_compression_rate=0.5).min_compression_rate == 0.5   # any rate > 0, as torch's
    planner = PowerSGDPlanner()
    planner.buckets[0] = _bucket([(64, 32), (64,)])
    grads = [torch.zeros(64, 32), torch.zeros(64)]
    buffer = torch.zeros(64 * 33)
    p0, p1 = _Planned("p0", 64 * 32), _Planned("p1", 64)
    assert planner.bucket(0, 9, [p0, p1], grads, buffer, None, 2) is planner.buckets[0]
    with pytest.raises(RuntimeError, match="changed its parameters"):
        planner.bucket(0, 9, [p1, p0], grads, buffer, None, 2)


def test_a_bucket_s_state_takes_torch_s_defaults_and_an_epsilon_that_keeps_columns_unit():
    """The planner's defaults are the module doc's: rank 4, start 2, seed 0 and torch's min_compression_rate (2),
    and the state's orthogonalization epsilon (1e-8) only guards a zero column: a non-zero P still comes out
    of torch's Gram-Schmidt (rank 1 and 2) with columns of unit norm, as with torch's default 0."""
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState, _orthogonalize
    planner = PowerSGDPlanner()
    assert (planner.rank, planner.start, planner.seed) == (4, 2, 0)   # seed 0: the spec's default seed
    assert planner.min_compression_rate == PowerSGDState(process_group=None).min_compression_rate == 2
    bucket = _bucket([(64, 32)], rank=2)
    p = torch.randn(1, 64, 2, generator=torch.Generator().manual_seed(4)) * 3
    _orthogonalize(p, bucket.state.orthogonalization_epsilon)
    assert torch.allclose(p.norm(dim=1), torch.ones(1, 2), atol=1e-6)


def test_powersgd_is_offered_to_dense_float32_buckets_on_more_than_one_rank_and_takes_rank_1():
    """offered(): more than one rank (one rank has nothing to compress for), a dense float32 bucket, and at
    least one gradient, each at least 1-D and non-empty (a single element is enough); a rank of 1 is a valid
    approximation rank."""
    grads = [torch.zeros(64, 32), torch.zeros(64)]
    buffer = torch.zeros(64 * 33)
    assert PowerSGDPlanner.offered(buffer, grads, 2)
    assert not PowerSGDPlanner.offered(buffer, grads, 1)
    assert not PowerSGDPlanner.offered(buffer, [], 2)
    assert not PowerSGDPlanner.offered(buffer.double(), grads, 2)
    assert not PowerSGDPlanner.offered(buffer, [torch.zeros(64, 32), torch.zeros(())], 2)
    # an empty gradient has no matrix view (powersgd_layout would refuse it mid-run); one element is a 1x1 one
    assert not PowerSGDPlanner.offered(buffer, [torch.zeros(64, 32), torch.zeros(0, 5)], 2)
    assert PowerSGDPlanner.offered(torch.zeros(65), [torch.zeros(64), torch.zeros(1)], 2)
    assert PowerSGDPlanner(rank=1).rank == 1
    with pytest.raises(ValueError, match="powersgd_rank"):
        PowerSGDPlanner(rank=0)


# -- the bucket's decision rule, on set predictions --------------------------------------------------------------

class _Planned:
    """What PowerSGDPlanner.bucket reads of a parameter's AutoAggregator: its name, its plan count and
    current plan (here the plan's statistics are the gradient's numel; None before its first plan), and
    the lossy memory it adds to its gradient when the bucket goes to PowerSGD."""

    def __init__(self, name, numel, planned=True):
        self.name, self.numel, self.plans, self.given = name, numel, int(planned), None

    def current_plan(self):
        return "dense", (self.numel if self.plans else None)

    def add_lossy_memory_to(self, grad):
        self.given = grad


class _Priced(CostModel):
    """A cost model with set predictions: PowerSGD's step by the layout's numel, a message's as the sum of
    its plans' (by their numel; an empty message costs 0), and a first allreduce's latency of 0.5 s at 2
    ranks (alpha 0.25 s, free bytes). A layout or plan it has no price for is a test error."""

    def __init__(self, psgd, plans):
        super().__init__(Calibration(LinkModel(0.25, 0.0)))
        self.psgd, self.plans = psgd, plans

    def predict_powersgd(self, layout, world_size, element_bytes=4):
        assert world_size == 2 and layout.numel in self.psgd, f"no price for a layout of {layout.numel}"
        return self.psgd[layout.numel]

    def predict_message(self, plans):
        return sum(self.plans[numel] for _, numel in plans)


def _decide(shapes, psgd, plans, planner=None, planned=True):
    grads = [torch.zeros(s) for s in shapes]
    aggs = [_Planned(f"p{i}", g.numel(), planned) for i, g in enumerate(grads)]
    planner = planner if planner is not None else PowerSGDPlanner()
    model = _Priced(psgd, plans)
    assert model.calibration.link.latency(2) == 0.5
    chosen = planner.bucket(0, 2, aggs, grads, torch.cat([g.reshape(-1) for g in grads]), model, 2)
    return planner, chosen, aggs


def test_a_bucket_takes_powersgd_only_when_predicted_more_than_the_switch_margin_faster():
    """The rule of CostModel.choose: PowerSGD is taken when ``t - c < (1 - SWITCH_MARGIN)(t_plans - c)``, ``c``
    the first allreduce's latency (0.5 s here), strictly: plans of 5.5 s (5 s beyond c) and PowerSGD at 4.5 s
    (4 s beyond c, exactly 20% faster) keep the plans; at 4.25 s PowerSGD is taken. A bucket PowerSGD
    compresses nothing of is never taken. The 64x32 matrix alone (100 s) beats no plan, so no part of the
    bucket is priced; a bucket of one matrix that PowerSGD would take whole is priced whole only."""
    assert SWITCH_MARGIN == 0.2
    shapes, plans = [(64, 32), (16,)], {2048: 5.0, 16: 0.5}
    planner, chosen, _ = _decide(shapes, {2048: 100.0, 2064: 4.5}, plans)
    assert chosen is None and planner.buckets == {}
    assert planner.stats() == {0: {"strategy": "per_parameter", "step": 2, "parameters": ["p0", "p1"],
                                   "predicted_seconds": {"powersgd": 4.5, "per_parameter": 5.5}, "compressed": 1}}
    planner, chosen, _ = _decide(shapes, {2048: 100.0, 2064: 4.25}, plans)
    assert isinstance(chosen, PowerSGDBucket) and chosen.members is None and planner.buckets == {0: chosen}
    assert planner.stats()[0]["strategy"] == "powersgd"
    assert chosen.predicted == {"powersgd": 4.25, "per_parameter": 5.5}
    # the margin is of the time beyond c: 4.4375 s is 20% under the plans only once c is taken off both
    planner, chosen, _ = _decide(shapes, {2048: 100.0, 2064: 4.4375}, plans)
    assert isinstance(chosen, PowerSGDBucket)
    # a bucket of vectors, which PowerSGD sends uncompressed, keeps its plans however cheap PowerSGD is priced
    planner, chosen, _ = _decide([(16,), (8,)], {24: 0.0}, {16: 5.0, 8: 5.0})
    assert chosen is None and planner.stats()[0]["strategy"] == "per_parameter"
    assert planner.stats()[0]["compressed"] == 0
    # one matrix, its share (3 s less three latencies) below its plan's 5 s beyond one: a member, but the
    # whole bucket, so no part is priced
    planner, chosen, _ = _decide([(64, 32)], {2048: 3.0}, {2048: 5.5})
    assert isinstance(chosen, PowerSGDBucket) and chosen.members is None
    assert planner.stats()[0]["predicted_seconds"] == {"powersgd": 3.0, "per_parameter": 5.5}


def test_a_matrix_joins_the_part_only_when_its_share_is_below_its_plan_beyond_a_latency():
    """_members: a compressed matrix's share (PowerSGD on it alone less the three allreduces' latencies,
    3c) against its plan less one (c), strictly: the 64x32 matrix at 3 s (share 1.5 s) against its 2 s plan
    (1.5 s beyond c) is not a member; the 32x16 one at 4.75 s (share 3.25 s) against its 4 s plan (3.5 s)
    is, by half a latency. The part is priced as PowerSGD on that member with the others' plans."""
    planner, chosen, _ = _decide([(64, 32), (32, 16), (16,)], {2048: 3.0, 512: 4.75, 2576: 50.0},
                                 {2048: 2.0, 512: 4.0, 16: 0.5})
    assert chosen is None
    d = planner.stats()[0]
    assert d["strategy"] == "per_parameter" and d["compressed"] == 1   # the cheaper of the two: the part
    assert d["predicted_seconds"] == {"powersgd": 50.0, "per_parameter": 6.5, "powersgd_part": 4.75 + 2.0 + 0.5}


def test_a_part_is_taken_only_when_cheaper_than_powersgd_on_the_whole_bucket():
    """The 32x16 matrix is the part (its share 0.5 s against its 10 s plan; the 64x32 one's 5.5 s against
    2 s is not): at a tie with the whole bucket (4.5 s each) PowerSGD takes the whole bucket; when the
    whole costs more (4.75 s), the part, and only its parameter's lossy memory is added to its gradient."""
    shapes, plans = [(64, 32), (32, 16), (16,)], {2048: 2.0, 512: 10.0, 16: 0.5}
    planner, chosen, aggs = _decide(shapes, {2048: 7.0, 512: 2.0, 2576: 4.5}, plans)
    assert isinstance(chosen, PowerSGDBucket) and chosen.members is None and chosen.names == ["p0", "p1", "p2"]
    assert planner.stats()[0]["strategy"] == "powersgd"
    assert chosen.predicted == {"powersgd": 4.5, "per_parameter": 12.5, "powersgd_part": 4.5}
    assert all(a.given is not None for a in aggs)
    planner, chosen, aggs = _decide(shapes, {2048: 7.0, 512: 2.0, 2576: 4.75}, plans)
    assert isinstance(chosen, PowerSGDBucket) and chosen.members == (1,) and chosen.names == ["p1"]
    assert chosen.layout == powersgd_layout([(32, 16)], 4, 2) and chosen.bucket_names == ["p0", "p1", "p2"]
    assert planner.stats()[0]["strategy"] == "powersgd_part"
    assert [a.given is not None for a in aggs] == [False, True, False]


def test_a_bucket_is_not_compared_before_every_parameter_has_a_plan():
    """A parameter without a plan yet (its statistics None) leaves the bucket on its plans, with no
    decision recorded and nothing priced; once every parameter is planned the bucket is compared."""
    shapes = [(64, 32), (16,)]
    psgd, plans = {2048: 100.0, 2064: 4.25}, {2048: 5.0, 16: 0.5}
    planner, chosen, _ = _decide(shapes, psgd, plans, planned=False)
    assert chosen is None and planner.stats() == {} and planner.buckets == {}
    planner, chosen, _ = _decide(shapes, psgd, plans, planner=planner)
    assert isinstance(chosen, PowerSGDBucket) and planner.stats()[0]["strategy"] == "powersgd"


# -- the step guard's PowerSGD window (window_bucket, end_trial) ---------------------------------------------------

class _Lossy(_Planned):
    """A planned parameter whose lossy error feedback (THC's or top-k's) holds ``memory``: added to its gradient
    once, as AutoAggregator.add_lossy_memory_to takes it."""

    def __init__(self, name, memory):
        super().__init__(name, memory.numel())
        self.memory = memory

    def add_lossy_memory_to(self, grad):
        if self.memory is not None:
            grad.add_(self.memory.reshape(grad.shape))
        self.memory = None


def _window_bucket(shapes, fill=1.0):
    buffer = torch.full((sum(torch.Size(s).numel() for s in shapes),), fill)
    grads = [v.view(s) for v, s in zip(torch.split(buffer, [torch.Size(s).numel() for s in shapes]), shapes)]
    return buffer, grads


def test_the_window_runs_a_trial_state_per_bucket_kept_until_the_trial_ends():
    """window_bucket without a verdict: a whole-bucket PowerSGD state of the trial's own (the planner's seed, error
    feedback on), the same one at every window of the trial (its memories kept between them) and not the
    bucket's plan; None where PowerSGD is not offered; a bucket whose parameters changed is an error. end_trial
    hands back its error memory once and drops it: the next trial starts a fresh state."""
    shapes = [(64, 32), (16,)]
    buffer, grads = _window_bucket(shapes)
    aggs = [_Planned("p0", 2048), _Planned("p1", 16)]
    planner = PowerSGDPlanner(seed=(1 << 33) + 5)
    assert planner.window_bucket(0, 9, aggs, grads, buffer, 1, False) is None           # one rank
    assert planner.window_bucket(0, 9, aggs, grads, buffer.double(), 2, False) is None  # not float32
    assert planner.trials == {} and planner.end_trial(0) is None
    trial = planner.window_bucket(0, 9, aggs, grads, buffer, 2, False)
    assert isinstance(trial, PowerSGDBucket) and trial.members is None and trial.names == ["p0", "p1"]
    assert planner.trials == {0: trial} and planner.buckets == {} and planner.decisions == {}
    assert trial.layout == powersgd_layout(shapes, 4, 2) and trial.state.use_error_feedback
    assert trial.state.rng.randint(1 << 30) == np.random.RandomState(powersgd_seed(planner.seed)).randint(1 << 30)
    assert planner.window_bucket(0, 11, aggs, grads, buffer, 2, False) is trial          # the trial's next window
    assert aggs[0].given is None and torch.equal(buffer, torch.ones_like(buffer))        # nothing added
    with pytest.raises(RuntimeError, match="during the step guard's trial"):
        planner.window_bucket(0, 13, aggs[::-1], grads, buffer, 2, False)
    memory = torch.arange(2048 + 16, dtype=torch.float32)
    trial.state.error_dict[0] = memory
    assert planner.end_trial(0) is memory and planner.trials == {}
    assert planner.end_trial(0) is None
    fresh = planner.window_bucket(0, 20, aggs, grads, buffer, 2, False)
    assert fresh is not trial and fresh.error(0) is None


def test_a_bucket_on_powersgd_whole_runs_its_own_state_in_the_window():
    """A bucket the plans gave PowerSGD whole runs that state in the window (no trial state), and must still hold
    its parameters; one that left PowerSGD, or runs it on a part, gets a trial state of the whole bucket."""
    shapes = [(64, 32), (16,)]
    buffer, grads = _window_bucket(shapes)
    aggs = [_Planned("p0", 2048), _Planned("p1", 16)]
    planner = PowerSGDPlanner()
    own = planner.buckets[0] = _bucket(shapes)
    assert planner.window_bucket(0, 9, aggs, grads, buffer, 2, False) is own and planner.trials == {}
    assert planner.window_bucket(0, 9, aggs, grads, buffer, 2, True) is own and planner.buckets == {0: own}
    with pytest.raises(RuntimeError, match="changed its parameters after going to PowerSGD"):
        planner.window_bucket(0, 9, aggs[::-1], grads, buffer, 2, False)
    own.left_step = 8
    assert planner.window_bucket(0, 9, aggs, grads, buffer, 2, False) is planner.trials[0] is not own
    planner = PowerSGDPlanner()
    part = planner.buckets[0] = _bucket(shapes, members=(0,))
    trial = planner.window_bucket(0, 9, aggs, grads, buffer, 2, False)
    assert trial is not part and trial.members is None and planner.trials == {0: trial}


def test_a_verdict_for_powersgd_makes_the_trial_state_the_bucket_s_with_every_memory_in_its_gradients():
    """The window's verdict step: the trial's state becomes the bucket's for good (its decision recorded as the
    step guard's, from that step), and what the plans had not sent yet goes into the gradients PowerSGD now
    takes: each parameter's lossy error feedback, and the error memory of a PowerSGD part of the bucket, which
    leaves it."""
    shapes = [(64, 32), (6,)]
    buffer, grads = _window_bucket(shapes)
    aggs = [_Lossy("p0", torch.full((64, 32), 0.5)), _Lossy("p1", torch.full((6,), 0.25))]
    planner = PowerSGDPlanner()
    part = planner.buckets[0] = _bucket(shapes, members=(0,))
    part.state.error_dict[0] = torch.full((2048,), 2.0)   # the part's memory: over its member only
    trial = planner.window_bucket(0, 9, aggs, grads, buffer, 2, False)
    assert planner.window_bucket(0, 15, aggs, grads, buffer, 2, True) is trial
    assert planner.buckets == {0: trial} and planner.trials == {} and trial.since_step == 15
    assert part.left_step == 15 and part.error(0) is None
    assert torch.equal(grads[0], torch.full((64, 32), 1.0 + 0.5 + 2.0))   # the gradient, its lossy and part memories
    assert torch.equal(grads[1], torch.full((6,), 1.25))
    assert all(a.memory is None for a in aggs)
    d = planner.stats()[0]
    assert (d["strategy"], d["step"], d["since_step"], d["step_guard"]) == ("powersgd", 15, 15, True)
    assert d["parameters"] == d["powersgd_parameters"] == ["p0", "p1"] and d["compressed"] == 1
    assert planner.parameter_names() == frozenset({"p0", "p1"})


def test_a_planner_pickled_before_the_guard_s_powersgd_window_restores_with_no_trial():
    planner = PowerSGDPlanner()
    old = dict(planner.__dict__)
    del old["trials"]
    restored = PowerSGDPlanner.__new__(PowerSGDPlanner)
    restored.__setstate__(old)
    restored = pickle.loads(pickle.dumps(restored))
    assert restored.trials == {} and restored.end_trial(0) is None
    buffer, grads = _window_bucket([(64, 32)])
    assert isinstance(restored.window_bucket(0, 9, [_Planned("p0", 2048)], grads, buffer, 2, False), PowerSGDBucket)
