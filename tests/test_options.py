"""Options are checked where they are given: a clear TypeError or ValueError naming the option, one rule
per kind of option (seeds, fractions, devices, thread counts, shapes, flags) behind every entry point,
never a value coerced into a different job (a bool taken as 1, a float truncated, a seed aliased)."""
import pickle

import numpy as np
import pytest
import torch

from lossless_hc import LosslessCodec, THCCodec, plan_layout
from lossless_hc.lhc.sizing import sketch_table_for
from lossless_hc.plugins.ddp import (AutoHookState, LosslessHookState, THCHookState, TopKHookState, auto_hook,
                                     lossless_hook, thc_hook, topk_hook)
from lossless_hc.training.aggregate import TensorAggregator
from lossless_hc.training.auto import AutoSpec
from lossless_hc.training.capacity import CapacityPolicy
from lossless_hc.training.plan_tracker import PlanTracker


def test_world_size_and_block_size_limits():
    LosslessCodec(100, 1, 10)
    c = LosslessCodec(100, 1024, 10)
    assert c.world_size == 1024
    for ws in (0, 1025, -1):
        with pytest.raises(ValueError, match="world_size"):
            LosslessCodec(100, ws, 10)
    for bs in (0, -3):
        with pytest.raises(ValueError, match="block_size"):
            LosslessCodec(100, 2, 10, block_size=bs)
    with pytest.raises(ValueError, match="numel"):
        LosslessCodec(-1, 2, 10)
    with pytest.raises(ValueError, match="max_nnz"):
        LosslessCodec(100, 2, -1)
    with pytest.raises(ValueError, match="index"):
        LosslessCodec(100, 2, 10, index="bitmapp")
    with pytest.raises(TypeError, match="numel must be an int"):
        LosslessCodec(100.0, 2, 10)


def test_layout_sizes_are_ints():
    """numel, world_size, max_nnz and block_size take one check (lhc.layout.check_int) before any size is
    derived from them: a bool (True would pass as 1) or a float (2.0 would pass as 2) is a TypeError
    naming the option, for the planner as for the codec."""
    cases = {"numel": (True, 2, 10, 1), "world_size": (100, 2.0, 10, 1), "max_nnz": (100, 2, True, 1),
             "block_size": (100, 2, 10, 1.0)}
    for name, (numel, world_size, max_nnz, block_size) in cases.items():
        for build in (plan_layout, LosslessCodec):
            with pytest.raises(TypeError, match=f"{name} must be an int, got"):
                build(numel, world_size, max_nnz, block_size=block_size)


def test_lossless_codec_defaults_are_the_documented_ones():
    """LosslessCodec's defaults are its docstring's (block_size 1, seed 0, index "auto", num_threads 0: the
    OpenMP default, union_nnz world_size * max_nnz, rtol 2**-10, verify False): a codec built without
    them plans the payload of one that spells them out, and the default decode options leave the
    layout's fingerprint as plan_layout gives it."""
    plain = LosslessCodec(5000, 3, 40)
    spelled = LosslessCodec(5000, 3, 40, block_size=1, seed=0, device="cpu", index="auto", num_threads=0,
                            union_nnz=120, rtol=2 ** -10, verify=False)
    assert plain.layout == spelled.layout == plan_layout(5000, 3, 40, 1, 0, "auto", 120)
    assert (plain.layout.block, plain.layout.seed, plain.num_threads, plain.rtol, plain.verify) == \
        (1, 0, 0, 2 ** -10, False)


def test_seeds_outside_uint64_are_refused():
    # The hashes take the seed as a uint64: 2^64 would hash as 0, and -1 as 2^64 - 1.
    x = torch.zeros(100)
    x[[3, 50]] = 1.0
    assert not torch.equal(LosslessCodec(100, 2, 10, seed=0).encode(x),
                           LosslessCodec(100, 2, 10, seed=(1 << 64) - 1).encode(x))
    for seed in (-1, 1 << 64, 1 << 70):
        with pytest.raises(ValueError, match=r"seed must be an integer in \[0, 2\*\*64\)"):
            LosslessCodec(100, 2, 10, seed=seed)


SEEDED = {
    "LosslessCodec": lambda s: LosslessCodec(100, 2, 10, seed=s),
    "THCCodec": lambda s: THCCodec(100, 2, 0, seed=s),
    "sketch_table_for": lambda s: sketch_table_for(10, s),
    "LosslessHookState": lambda s: LosslessHookState(seed=s),
    "AutoHookState": lambda s: AutoHookState(seed=s),
}


@pytest.mark.parametrize("entry", sorted(SEEDED))
def test_every_seed_takes_one_rule(entry):
    # One check (lhc.layout.check_uint64) behind every entry point: the bounds as ValueError, a non-int
    # (a bool or float would otherwise pass as a number) as TypeError, and the extremes accepted.
    make = SEEDED[entry]
    for seed in (0, (1 << 64) - 1):
        make(seed)
    for seed in (-1, 1 << 64):
        with pytest.raises(ValueError, match=r"must be an integer in \[0, 2\*\*64\)"):
            make(seed)
    for seed in (True, 1.0, "0"):
        with pytest.raises(TypeError, match="must be an int, got"):
            make(seed)


FRACTIONS = {   # every option that is a fraction in (0, 1]: the built object's value of it
    "LosslessHookState max_density": lambda v: LosslessHookState(max_density=v).spec.max_density,
    "TopKHookState ratio": lambda v: TopKHookState(ratio=v).spec.ratio,
    "AutoHookState topk_ratio": lambda v: AutoHookState(lossy=True, topk_ratio=v).spec.topk_ratio,
    "TensorAggregator max_density": lambda v: TensorAggregator("t", (64,), torch.float32, 2, v).capacity / 64,
    "CapacityPolicy alpha": lambda v: CapacityPolicy(alpha=v).alpha,
}


@pytest.mark.parametrize("entry", sorted(FRACTIONS))
def test_every_fraction_takes_one_rule(entry):
    """One check (lhc.layout.check_fraction): a real number in (0, 1], NumPy's scalars included (a
    np.float32 was refused as "must be in (0, 1], got 0.01"), kept as a Python float; bools (True passed
    as 1.0 in TensorAggregator and CapacityPolicy), strings, NaN and values outside refused."""
    make = FRACTIONS[entry]
    for v in (0.25, np.float32(0.25), np.float64(0.25), 1, np.int64(1)):
        got = make(v)
        assert type(got) is float and got == float(v), (v, got)
    for v in (True, np.True_, "0.5", float("nan"), 0, 0.0, 1.5, -0.1, None):
        with pytest.raises(ValueError, match="must be a number in \\(0, 1\\], got"):
            make(v)


@pytest.mark.parametrize("make", [lambda v: PlanTracker(1000, 10, 2, interval=v).interval,
                                  lambda v: AutoSpec(interval=v).interval], ids=["PlanTracker", "AutoSpec"])
def test_a_re_plan_interval_is_a_positive_int(make):
    """PlanTracker took ``int(interval)``: 2.5 re-planned every 2 steps, silently. 1 (a plan at every step) is
    the least interval."""
    assert make(3) == 3 and make(1) == 1
    for v in (2.5, 0, -1, True, "4", None):
        with pytest.raises(ValueError, match="interval must be a positive integer"):
            make(v)


def test_a_plan_tracker_checks_its_sizes():
    """PlanTracker(row=0) was built and raised ZeroDivisionError at its first decision; 2.5 coordinates
    were truncated to 2."""
    for bad, error in ((dict(row=0), ValueError), (dict(world_size=0), ValueError), (dict(numel=-1), ValueError),
                       (dict(numel=2.5), TypeError), (dict(row=True), TypeError)):
        with pytest.raises(error, match="numel|row|world_size"):
            PlanTracker(**{**dict(numel=1000, row=10, world_size=2), **bad})
    tr = PlanTracker(1000, 10, 2)
    tr.observe((3, 4), 5)
    assert tr.stats().rank_keys == (3, 4)


@pytest.mark.parametrize("hook,state", [(lossless_hook, LosslessHookState), (topk_hook, TopKHookState),
                                        (thc_hook, THCHookState), (auto_hook, AutoHookState)])
def test_ddp_hooks_refuse_compiled_autograd_s_per_parameter_calls(hook, state):
    """Compiled autograd's python_reducer (torch._dynamo.config.optimize_ddp) calls a comm hook with
    (grad, param), per parameter, to trace it; the hooks need DDP's buckets: a TypeError naming the
    mode and what to use, not an AttributeError from inside the hook."""
    param = torch.nn.Parameter(torch.zeros(4))
    with pytest.raises(TypeError, match="takes DDP's GradBucket, got tuple: compiled autograd's python_reducer"):
        hook(state(), (torch.zeros(4), param))
    with pytest.raises(TypeError, match="needs a"):   # the state is checked first
        hook(object(), (torch.zeros(4), param))


def test_union_nnz_is_an_int_or_none():
    assert plan_layout(4096, 2, 40, union_nnz=None).payload_numel == plan_layout(4096, 2, 40).payload_numel
    plan_layout(4096, 2, 40, union_nnz=60)
    for bad in (True, 60.0, "60"):
        with pytest.raises(TypeError, match="union_nnz must be an int or None, got"):
            plan_layout(4096, 2, 40, union_nnz=bad)
    # its range: 0 (no rank holds a key) up; a negative count is a ValueError naming it
    assert plan_layout(4096, 2, 40, union_nnz=0).union_keys == 0
    with pytest.raises(ValueError, match="union_nnz must be >= 0, got -1"):
        plan_layout(4096, 2, 40, union_nnz=-1)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present: device='cuda' works (tests/test_cuda.py)")
def test_cuda_device_without_a_gpu_is_a_clear_error():
    with pytest.raises(RuntimeError, match="CUDA device"):
        LosslessCodec(100, 2, 10, device="cuda")


@pytest.mark.parametrize("device", ["meta", "tpu", "tpu:0", 3.5])
def test_unknown_device_is_a_clear_error(device):
    """A device torch knows but the codecs do not ("meta"), and one torch cannot parse ("tpu"): the
    same ValueError from every codec, naming the devices that work."""
    for make in (lambda: LosslessCodec(100, 2, 10, device=device), lambda: THCCodec(100, 2, device=device),
                 lambda: TensorAggregator("w", (100,), torch.float32, 2, 0.1, device=device)):
        with pytest.raises(ValueError, match="unsupported device .*expected 'cpu' or 'cuda'"):
            make()


@pytest.mark.parametrize("num_threads, error", [(-1, ValueError), (4097, ValueError), (1.5, TypeError),
                                                (True, TypeError), ("2", TypeError)])
def test_bad_num_threads_is_a_clear_error(num_threads, error):
    """num_threads is checked where the codec is built (a float used to reach the kernels' binding,
    a negative count ran with the OpenMP default) and where it is set afterwards (100,000 crashed the
    encode), for both codecs; 0 (the default) and 1 work, and a refused value leaves the old one."""
    for make in (lambda t: LosslessCodec(5000, 2, 50, num_threads=t), lambda t: THCCodec(5000, 2, num_threads=t)):
        with pytest.raises(error, match="num_threads"):
            make(num_threads)
        assert make(0).num_threads == 0 and make(1).num_threads == 1
        codec = make(1)
        with pytest.raises(error, match="num_threads"):
            codec.num_threads = num_threads
        assert codec.num_threads == 1
        codec.num_threads = 2
        assert codec.num_threads == 2 and pickle.loads(pickle.dumps(codec)).num_threads == 2


def test_num_threads_up_to_its_limit_is_accepted():
    """The documented range is [0, 4096] (lossless_hc.backends.MAX_THREADS) inclusive: 4096 itself is a
    count both codecs take, at construction and set afterwards; one more is refused (above)."""
    for make in (lambda t: LosslessCodec(5000, 2, 50, num_threads=t), lambda t: THCCodec(5000, 2, num_threads=t)):
        assert make(4096).num_threads == 4096
        codec = make(0)
        codec.num_threads = 4096
        assert codec.num_threads == 4096


@pytest.mark.parametrize("shape, world_size, error, match", [
    ((-3, 4), 2, ValueError, "sizes >= 0"), ((2.5,), 2, TypeError, "shape"), ((True, 3), 2, TypeError, "shape"),
    (7, 2, TypeError, "sequence"), ((100,), 2.5, TypeError, "world_size"), ((100,), 0, ValueError, "world_size")])
def test_aggregator_bad_shape_or_world_size_is_a_clear_error(shape, world_size, error, match):
    """A TensorAggregator's shape and world size are checked where it is built: (-3, 4) used to give
    numel -12, and world_size 2.5 was truncated to 2, a codec for a different job."""
    with pytest.raises(error, match=match):
        TensorAggregator("w", shape, torch.float32, world_size, 0.1)
    assert TensorAggregator("w", torch.Size([10, 10]), torch.float32, 2, 0.1).numel == 100


@pytest.mark.parametrize("flag", ["averaged", "trace", "error_bounds"])
@pytest.mark.parametrize("value", ["no", 1, None])
def test_decode_flags_must_be_bools(flag, value):
    """decode's flags are bools: averaged="no" used to decode a summed payload as an average (a
    truthy string), and error_bounds="x" attached bounds. THCCodec.decode's averaged too."""
    codec = LosslessCodec(100, 2, 10)
    x = torch.zeros(100)
    x[3] = 1.0
    p = codec.encode(x)
    with pytest.raises(TypeError, match=f"decode's {flag} must be a bool"):
        codec.decode(p + p, **{flag: value})
    y, rep = codec.decode(p + p, **{flag: False})
    assert rep.ok and y[3] == 2.0
    if flag == "averaged":
        thc = THCCodec(100, 2)
        tp = thc.encode(x)
        with pytest.raises(TypeError, match="decode's averaged must be a bool"):
            thc.decode(tp, averaged=value)


@pytest.mark.parametrize("value", ["no", 1, 0, None])
def test_lossless_codec_verify_must_be_a_bool(value):
    """LosslessCodec's verify is a bool, checked where the codec is built: 1 is not taken as True (nor 0
    as False), and the same codec with True builds."""
    with pytest.raises(TypeError, match="verify must be a bool, got"):
        LosslessCodec(100, 2, 10, verify=value)
    assert LosslessCodec(100, 2, 10, verify=True).verify is True


@pytest.mark.parametrize("value", ["no", 0, None])
def test_thc_flags_must_be_bools(value):
    """THCCodec's error_feedback and symmetric_table, and encode's interleaved, are bools:
    error_feedback="no" (a truthy string) would keep the error memory on, and symmetric_table="no" pick
    the symmetric table. Each is a TypeError naming it; False and True still work."""
    for flag in ("error_feedback", "symmetric_table"):
        with pytest.raises(TypeError, match=f"{flag} must be a bool"):
            THCCodec(1024, 2, **{flag: value})
    assert THCCodec(1024, 2, error_feedback=False).error is None
    thc = THCCodec(1024, 2, initial_norm=1.0)
    with pytest.raises(TypeError, match="encode's interleaved must be a bool"):
        thc.encode(torch.ones(1024), interleaved=value)
    assert thc.encode(torch.ones(1024), interleaved=True).numel() == thc.payload_numel


@pytest.mark.parametrize("factory", ["lossless", "topk", "thc", "auto"])
def test_an_uncalled_factory_passed_as_compression_says_so(factory):
    """compression=Compression.lossless (not called): the engine calls .compress from its backward hooks,
    where "'function' object has no attribute 'compress'" named no cause; now a TypeError does."""
    import torch
    from lossless_hc.plugins.byteps import Compression
    with pytest.raises(TypeError, match=f"Compression.{factory} is a factory: pass Compression.{factory}"):
        getattr(Compression, factory).compress(torch.zeros(4))


def test_auto_options_tell_apart_every_configuration_that_plans_differently():
    """The adapters' configuration check compares the spec's repr, built from options(): two auto specs that
    differ in any option, a given calibration's numbers included, must differ there (ranks that disagreed on
    lossy_min_bytes or on the calibration planned different collectives unnoticed)."""
    from lossless_hc.training.planner import Calibration
    base = dict(lossy=True, calibration=Calibration.default(1e9))
    variants = [dict(lossy=False), dict(interval=8), dict(alpha=0.5), dict(first="dense"), dict(strategies=("dense",)),
                dict(calibration=Calibration.default(1e10)), dict(calibration=None), dict(topk_ratio=0.02),
                dict(thc_bits=2), dict(seed=1), dict(partial=False), dict(lossy_min_bytes=0), dict(max_interval=64)]
    reprs = [repr(AutoSpec(**{**base, **v})) for v in variants]
    assert len(set(reprs + [repr(AutoSpec(**base))])) == len(variants) + 1, reprs
    assert repr(AutoSpec(**base)) == repr(AutoSpec(lossy=True, calibration=Calibration.default(1e9)))


def test_auto_times_the_half_allreduce_only_where_a_plan_may_go_half():
    """AutoSpec.measure times a float16 allreduce where a plan may send half precision (lossy, fp16 or bf16
    among the strategies) and nowhere else: it costs two large collectives at start-up. Rank 1 of 2 here,
    which times the link and takes rank 0's calibration from the broadcast."""
    from lossless_hc.training.planner import Calibration
    sent = Calibration.default()

    def broadcast(t):
        t.copy_(torch.tensor(sent.as_list(), dtype=torch.float64))
    for options, half in ((dict(), False), (dict(lossy=True), True), (dict(lossy=True, strategies=("dense", "thc")), False)):
        spec = AutoSpec(**options)
        spec.measure(lambda t: None, lambda t: None, broadcast, 1, 2, "cpu", largest_bytes=1 << 16)
        assert spec.calibration == sent
        assert ("allreduce_half" in {k for k, _, _ in spec.calibration_stats()["link_samples"]}) == half, options


def test_auto_sends_plain_steps_in_the_dtypes_its_engine_carries():
    """An adapter whose engine carries float16 as it is (``AutoSpec.native_plain_dtypes``) gets aggregators
    whose plain steps go in the gradient's float16, not the float32 wire dtype (twice the bytes, and priced
    so); a bfloat16 gradient the engine does not carry, and any gradient of a spec without them, in float32."""
    from lossless_hc.training.aggregate import AggregationStats
    from lossless_hc.training.planner import Calibration
    spec = AutoSpec(calibration=Calibration.default())

    def plain(dtype):
        return spec.make("w", torch.zeros(64, dtype=dtype), 2, 0, AggregationStats(), torch.device("cpu")).plain_dtype
    assert plain(torch.float16) == torch.float32
    spec.native_plain_dtypes = (torch.float16,)
    assert (plain(torch.float16), plain(torch.bfloat16)) == (torch.float16, torch.float32)


def test_auto_times_the_link_only_up_to_the_largest_tensor_it_knows():
    """AutoSpec.measure with ``largest_bytes`` (the adapter knows the model) times the link at
    calibration.link_sizes of it, not at every size up to 4 MiB (which a model of small tensors never sends),
    and without it at link_sizes of 4 MiB; its top-k steps (lossy) on calibration.topk_numel_for of it."""
    from lossless_hc.training.planner import Calibration
    sent = Calibration.default()

    def broadcast(t):
        t.copy_(torch.tensor(sent.as_list(), dtype=torch.float64))
    for largest, sizes in ((1 << 16, [1 << 10, 1 << 16]), (None, [1 << 10, 1 << 20, 1 << 22])):
        spec = AutoSpec()
        spec.measure(lambda t: None, lambda t: None, broadcast, 1, 2, "cpu", largest_bytes=largest)
        assert spec.calibration_stats()["link_sizes"] == sizes
        assert sorted({b for _, b, _ in spec.calibration_stats()["link_samples"]}) == sizes
        assert spec.calibration_stats()["topk_numel"] is None   # exact: top-k is no candidate, not timed
    # rank 0 times the codecs: top-k's steps on the model's largest tensor (within bounds), here 2^16 / 4
    for largest, numel in ((1 << 16, 1 << 14), (None, 1 << 20)):
        spec = AutoSpec(lossy=True)
        spec.measure(lambda t: None, lambda t: None, lambda t: None, 0, 1, "cpu", largest_bytes=largest)
        assert spec.calibration_stats()["topk_numel"] == numel


def test_auto_passes_integer_tensors_through():
    """An integer tensor (a step counter, an index buffer) gets the pass-through TensorAggregator, which the
    engine sums or averages itself, not a planned AutoAggregator."""
    from lossless_hc.training.aggregate import AggregationStats
    from lossless_hc.training.planner import Calibration
    from lossless_hc.training.strategies import AutoAggregator
    spec = AutoSpec(lossy=True, calibration=Calibration.default())
    for dtype in (torch.int64, torch.int32):
        agg = spec.make("n", torch.zeros(64, dtype=dtype), 2, 0, AggregationStats(), torch.device("cpu"))
        assert isinstance(agg, TensorAggregator) and not isinstance(agg, AutoAggregator) and agg.codec is None


def test_auto_defaults_are_the_documented_ones_and_reach_every_aggregator():
    """AutoSpec() plans as docs/DESIGN.md says ("Re-planning": every ``interval`` (16) steps, EWMAs of weight
    ``alpha`` = 0.25; exact, partial re-aggregation, lossy_min_bytes 64 KiB), and make() hands those options to
    each tensor's aggregator (its plan tracker). A default of 17 passed every other test."""
    from lossless_hc.training.aggregate import AggregationStats
    from lossless_hc.training.planner import Calibration
    spec = AutoSpec()
    assert (spec.lossy, spec.interval, spec.alpha, spec.partial, spec.lossy_min_bytes) == (False, 16, 0.25, True, 1 << 16)
    assert spec.max_interval == 256   # 16 intervals
    spec.set_calibration(Calibration.default())
    agg = spec.make("w", torch.zeros(4096), 2, 0, AggregationStats(), torch.device("cpu"))
    assert (agg.tracker.interval, agg.tracker.alpha, agg.partial, agg.tracker.max_interval) == (16, 0.25, True, 256)
    spec = AutoSpec(interval=5, alpha=0.5, calibration=Calibration.default())
    agg = spec.make("w", torch.zeros(4096), 2, 0, AggregationStats(), torch.device("cpu"))
    assert (agg.tracker.interval, agg.tracker.alpha, agg.tracker.max_interval) == (5, 0.5, 80)
    spec = AutoSpec(interval=5, max_interval=20, calibration=Calibration.default())
    agg = spec.make("w", torch.zeros(4096), 2, 0, AggregationStats(), torch.device("cpu"))
    assert agg.tracker.max_interval == 20


def test_auto_given_a_calibration_measures_nothing():
    """AutoSpec.measure with a given calibration returns at once: no collective at start-up (every rank plans
    with the calibration it was given), and calibration_stats says it was given, with no measuring cost, and
    reports the link and local costs it plans with."""
    from lossless_hc.training.planner import Calibration
    given = Calibration.default(1e9)
    spec = AutoSpec(calibration=given)

    def refuse(*args):
        raise AssertionError("a collective was issued")
    spec.measure(refuse, refuse, refuse, 0, 2, "cpu", largest_bytes=1 << 16)
    stats = spec.calibration_stats()
    assert spec.calibration is given and stats["source"] == "given" and "seconds" not in stats
    # the link every rank plans with, and the local costs (before a calibration: none of them)
    link = given.link
    assert (stats["alpha_s"], stats["seconds_per_byte"], stats["allgather_seconds_per_byte"],
            stats["half_seconds_per_byte"]) == (link.alpha_s, link.seconds_per_byte, link.allgather_seconds_per_byte,
                                                link.half_seconds_per_byte)
    assert stats["codec_seconds"] == {s: list(v) for s, v in given.codec_seconds.items()} and stats["codec_seconds"]
    assert AutoSpec().calibration_stats() == {"source": "pending"}


def test_auto_reports_the_seconds_its_calibration_took(monkeypatch):
    """calibration_stats()["seconds"]: the time from the start of AutoSpec.measure to the end of its
    calibration, on this rank's clock (here a fake one that reads 100 s, then 102.5 s)."""
    import types

    import lossless_hc.training.auto as auto
    from lossless_hc.training.planner import Calibration
    sent = Calibration.default()

    def broadcast(t):
        t.copy_(torch.tensor(sent.as_list(), dtype=torch.float64))
    ticks = iter([100.0, 102.5])
    monkeypatch.setattr(auto, "time", types.SimpleNamespace(perf_counter=lambda: next(ticks)))
    spec = AutoSpec()
    spec.measure(lambda t: None, lambda t: None, broadcast, 1, 2, "cpu", largest_bytes=1 << 16)
    assert spec.calibration_stats()["seconds"] == 2.5 and spec.calibration_stats()["source"] == "measured"
