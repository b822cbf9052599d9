"""The engine-neutral adapter (lossless_hc.training.adapter) as a plugin sees it: the optimizer frame a
compressor finds, the options it reads through to its spec, the collectives a plugin must supply, and the
repr the DDP states' configuration check compares."""
import pytest
import torch

from lossless_hc.plugins.ddp import LosslessHookState, THCHookState, TopKHookState
from lossless_hc.training.aggregate import ConfigurationMismatch
from lossless_hc.training.adapter import (AggregatorSpec, CompressionFactory, CompressorAdapter,
                                          require_optimizer_frame)


class Optimizer:
    """What Horovod's and BytePS's optimizers have that the search looks for: ``_parameter_names``."""
    _parameter_names: dict = {}

    def synchronize(self, p, compressor, helpers: int):
        """``compressor.compress(p)`` with ``helpers`` frames between this one and compress's."""
        return through(helpers, compressor, p) if helpers else compressor.compress(p)


def through(helpers, compressor, grad):
    return through(helpers - 1, compressor, grad) if helpers > 1 else compressor.compress(grad)


class Compressor:
    def compress(self, grad):
        return require_optimizer_frame(self, "Optimizer(compression=...)")


@pytest.mark.parametrize("helpers", [0, 3])
def test_the_optimizer_frame_is_found_up_to_four_frames_above_compress(helpers):
    """The search starts at compress's caller and looks 4 frames up: it finds the optimizer's ``self`` and
    ``p`` through three helper frames between them and compress."""
    opt, p = Optimizer(), torch.zeros(3)
    found_p, found_opt = opt.synchronize(p, Compressor(), helpers)
    assert found_p is p and found_opt is opt


def test_an_optimizer_frame_beyond_four_frames_is_not_found():
    with pytest.raises(RuntimeError, match=r"Compressor must be used as Optimizer\(compression=\.\.\.\): it keeps "
                                           "per-parameter state"):
        Optimizer().synchronize(torch.zeros(3), Compressor(), 4)


def test_a_compressor_reads_its_spec_s_options_and_nothing_else():
    """The spec's options read as the compressor's own; any other name (another kind's option, a private
    one) is Python's AttributeError naming it, as for any object (hasattr is False)."""
    comp = CompressionFactory.topk(ratio=0.05, seed=2)
    assert (comp.ratio, comp.seed, comp.index) == (0.05, 2, "auto")
    for name in ("max_density", "bits", "_ratio"):
        with pytest.raises(AttributeError, match=rf"'CompressorAdapter' object has no attribute '{name}'"):
            getattr(comp, name)
        assert not hasattr(comp, name)


def test_the_collectives_a_plugin_supplies_are_not_implemented_in_the_base():
    """A plugin that leaves out one of the collectives fails loudly (NotImplementedError) rather than
    returning a rank's own tensor as the sum; a spec kind must define make and options."""
    comp = CompressorAdapter(CompressionFactory.topk().spec)
    agg, t = object(), torch.zeros(4)
    for call in (lambda: comp._start_fallback(agg, t), lambda: comp._start_partial(agg, t),
                 lambda: comp._wait_fallback(None), lambda: AggregatorSpec().options(),
                 lambda: AggregatorSpec().make("w", t, 2, 0, None, t.device)):
        with pytest.raises(NotImplementedError):
            call()


@pytest.mark.parametrize("state, options, want", [
    (LosslessHookState, dict(max_density=0.05, block_size=4, seed=3, index="bitmap"),
     "LosslessHookState(lossless(max_density=0.05, block_size=4, seed=3, index='bitmap', policy=None))"),
    (TopKHookState, dict(ratio=0.02, seed=3, index="bitmap"),
     "TopKHookState(topk(ratio=0.02, seed=3, index='bitmap', policy=None))"),
    (THCHookState, dict(bits=2, granularity=10, overflow_freq=16, seed=3, non_finite="propagate"),
     "THCHookState(thc(bits=2, granularity=10, overflow_freq=16, seed=3, non_finite='propagate'))"),
])
def test_a_hook_state_s_repr_names_every_option_of_its_spec(state, options, want):
    """The DDP states' configuration check compares repr(state), which is the spec's options(): each option
    with its value, so ranks that differ in any one of them see a mismatch."""
    assert repr(state(**options)) == want


class Recording(CompressorAdapter):
    """The base adapter, counting the step ends it reaches (``_after_step``)."""

    def __init__(self, spec):
        super().__init__(spec)
        self.step_ends = 0

    def _after_step(self) -> None:
        self.step_ends += 1


def assert_a_step_ends_at_its_last_decode(comp, aggs):
    encoded = [comp.encode(a, torch.ones(4)) for a in aggs]
    before = comp.step_ends
    for i, (payload, enc) in enumerate(encoded):
        comp.decode(payload.clone(), enc)
        assert comp.step_ends == before + (i == len(encoded) - 1), i


def test_a_step_ends_at_its_last_decode_after_a_dropped_step_a_failed_decode_or_a_stray_one():
    """The adapter ends a step (its fallbacks waited for, ``_after_step``) when the step's last outstanding
    tensor is decoded, and only then: also after a dropped step (drop_step with tensors outstanding), a stray
    decode with nothing outstanding (a tensor encoded before drop_step), a decode that raised (a THC payload
    that does not decode) and a stray one that raised."""
    comp = Recording(CompressionFactory.thc().spec)
    small = [comp.aggregator(k, k, torch.ones(4), 2, 0) for k in ("a", "b")]   # sent dense: decoded as they come
    big = comp.aggregator("w", "w", torch.ones(4096), 2, 0)
    assert big.compressed and not any(a.compressed for a in small)
    assert_a_step_ends_at_its_last_decode(comp, small)
    stray = [comp.encode(a, torch.ones(4)) for a in small]
    comp.drop_step()
    assert_a_step_ends_at_its_last_decode(comp, small)
    comp.decode(stray[0][0].clone(), stray[0][1])   # decoded after all, with nothing outstanding
    assert_a_step_ends_at_its_last_decode(comp, small)
    payload, enc = comp.encode(big, torch.ones(4096))
    with pytest.raises(ConfigurationMismatch):   # the step's only tensor
        comp.decode(torch.zeros_like(payload), enc)
    assert_a_step_ends_at_its_last_decode(comp, small)
    with pytest.raises(RuntimeError, match="without a preceding encode"):   # again, nothing outstanding
        comp.decode(torch.zeros_like(payload), enc)
    assert_a_step_ends_at_its_last_decode(comp, small)
