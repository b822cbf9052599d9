"""Corrupted and fuzzed payloads are never decoded as exact: random bits, overwritten header and index
words (the reference reaching the same verdict), negative or disagreeing counters, huge header fields,
noise and non-finite sketch cells give ``report.ok == False`` with a reason, never a crash. The payloads
are tests/test_robustness.py's summed ones (CODECS), which holds the other failures that are never silent."""
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import helpers
from lossless_hc.lhc import reference as reference
from lossless_hc.lhc.layout import (HDR_CONTRIBUTORS, HDR_FP_HI, HDR_FP_LO, HDR_KEYS_HI, HDR_KEYS_LO, HDR_KEYS_MID, HDR_NON_FINITE, HDR_SATURATED, HEADER_FIELDS)
from lossless_hc.lhc.status import DecodeStatus
from test_robustness import CODECS, INDEXES


SPECIAL = [float("nan"), float("inf"), -float("inf"), -1.0, -0.5, 0.5, 1.5, 2.0 ** 22, 2.0 ** 30, 2.0 ** 60,
           3.0e38, -3.0e38, 1e-30]


def decode_no_crash(codec, payload, averaged=False):
    y, rep = codec.decode(payload, averaged=averaged)
    assert y.shape == (codec.numel,) and isinstance(rep.ok, bool)
    assert rep.ok or rep.reason
    return y, rep


@settings(max_examples=50)
@given(index=st.sampled_from(INDEXES), seed=st.integers(0, 2 ** 32 - 1), keep_header=st.booleans(),
       specials=st.floats(0.0, 0.5), averaged=st.booleans())
def test_random_bits_are_rejected(index, seed, keep_header, specials, averaged):
    """Uniformly random 32-bit words (all NaN payloads, Infs, subnormals, huge values included), some
    replaced by special values; optionally with the valid header kept so the index is what fails."""
    codec, _, summed = CODECS[index]
    rng = np.random.default_rng(seed)
    payload = torch.from_numpy(rng.integers(0, 2 ** 32, summed.numel(), dtype=np.uint32).view(np.float32).copy())
    mask = torch.from_numpy(rng.random(summed.numel()) < specials)
    payload[mask] = torch.from_numpy(rng.choice(SPECIAL, int(mask.sum())).astype(np.float32))
    if keep_header:
        payload[:HEADER_FIELDS] = summed[:HEADER_FIELDS] / (codec.world_size if averaged else 1)
        if index == "dense":
            return  # a valid header with arbitrary values is a valid dense payload
    y, rep = decode_no_crash(codec, payload, averaged)
    assert not rep.ok


@settings(max_examples=60)
@given(index=st.sampled_from(["bitmap", "bloom", "multilevel"]), data=st.data())
def test_corrupted_integer_fields_are_rejected_or_harmless(index, data):
    """Overwrite header / index words: a header field that changes value, or an index word that is not a
    valid packed count (NaN, Inf, negative, fractional, too large), must give ok False. A valid-looking
    index word may decode (a digit swap keeping the counts is undetectable) but must not crash."""
    codec, xs, summed = CODECS[index]
    L = codec.layout
    payload = summed.clone()
    positions = data.draw(st.lists(st.integers(0, L.sketch_offset - 1), min_size=1, max_size=4, unique=True))
    header_changed = index_invalid = False
    limit = L.index.base ** L.index.per_word
    for pos in positions:
        v = data.draw(st.sampled_from(SPECIAL) | st.floats(width=32) | st.integers(-5, 5).map(float))
        old = float(payload[pos])
        payload[pos] = v
        v = float(payload[pos])                      # as stored in float32
        if pos < HEADER_FIELDS:
            header_changed |= not (abs(v - old) <= 0.25)
        else:
            index_invalid |= not (math.isfinite(v) and v >= -0.25 and abs(v - round(v)) <= 0.25
                                  and round(v) < limit)
    y, rep = decode_no_crash(codec, payload)
    if header_changed or index_invalid:
        assert not rep.ok, (positions, payload[positions].tolist())
    # differential check: the reference reaches the same verdict on the same (corrupted) counts (OK and
    # INEXACT are one verdict: they read keys from different cells), and ok means the true aggregate
    # (a valid-looking corruption that moves keys must fail the residual check)
    yr, info = reference.decode(L, payload)
    assert helpers.peeled_ok(rep) == helpers.peeled_ok(info), (rep.reason, info["reason"])
    if rep.ok:
        assert rep.support == info["support"]
        helpers.assert_contract(L, xs, y, rep.inexact_keys, codec.rtol)
    if info["ok"]:
        helpers.assert_contract(L, xs, yr, info["inexact_keys"], codec.rtol)


def test_valid_looking_index_corruption_is_caught():
    """The case the property test above found (bitmap index word 22: 5120 -> 2, which moves keys while
    the key total still matches): the index checksum (issue #19) rejects it on the CPU and on the
    reference as INDEX_CORRUPT, before the value peel (the residual check caught it before the
    checksum existed)."""
    codec, xs, summed = CODECS["bitmap"]
    payload = summed.clone()
    word = codec.layout.index_offset + 22
    assert payload[word] == 5120.0
    payload[word] = 2.0
    y, rep = decode_no_crash(codec, payload)
    yr, info = reference.decode(codec.layout, payload)
    assert not rep.ok and rep.status == DecodeStatus.INDEX_CORRUPT, rep.reason
    assert not info["ok"] and "index checksum" in info["reason"], info["reason"]


@pytest.mark.parametrize("index", ["bitmap", "bloom", "multilevel"])
@pytest.mark.parametrize("value", [-1.0, -2.0, -1e6])
def test_negative_counters_are_rejected(index, value):
    codec, xs, summed = CODECS[index]
    L = codec.layout
    for w in range(L.index_offset, L.sketch_offset, max(1, (L.sketch_offset - L.index_offset) // 7)):
        payload = summed.clone()
        payload[w] = value
        assert not decode_no_crash(codec, payload)[1].ok


@pytest.mark.parametrize("index", ["bitmap", "bloom", "multilevel"])
def test_counts_disagreeing_with_the_header_are_rejected(index):
    codec, xs, summed = CODECS[index]
    for field, delta in ((HDR_KEYS_LO, 1.0), (HDR_KEYS_LO, -1.0), (HDR_KEYS_MID, 1.0), (HDR_KEYS_HI, 1.0)):
        payload = summed.clone()
        payload[field] += delta
        y, rep = decode_no_crash(codec, payload)
        assert not rep.ok and "index" in rep.reason, rep.reason


@pytest.mark.parametrize("index", INDEXES)
@pytest.mark.parametrize("field", range(HEADER_FIELDS))
@pytest.mark.parametrize("value", [2.0 ** 30, 2.0 ** 40, 2.0 ** 52, 2.0 ** 60, 1e38])
def test_huge_header_fields_are_rejected(index, field, value):
    """No header field can legitimately exceed world_size * 2047. The fields a decoder relies on must
    make it fail; a field it ignores (the dense decoder ignores the key counts and the overload flag)
    may leave it ok only with the untouched, exact answer."""
    codec, xs, summed = CODECS[index]
    clean, _ = codec.decode(summed)
    payload = summed.clone()
    payload[field] = value
    y, rep = decode_no_crash(codec, payload)
    if index != "dense" or field in (HDR_CONTRIBUTORS, HDR_FP_LO, HDR_FP_HI, HDR_NON_FINITE, HDR_SATURATED):
        assert not rep.ok
    else:
        assert not rep.ok or torch.equal(y, clean)


@pytest.mark.parametrize("index", ["bitmap", "bloom", "multilevel"])
def test_huge_key_count_header_is_rejected(index):
    codec, xs, summed = CODECS[index]
    payload = summed.clone()
    payload[HDR_KEYS_HI] = 2.0 ** 50
    assert not decode_no_crash(codec, payload)[1].ok


@settings(max_examples=40)
@given(index=st.sampled_from(INDEXES), sigma=st.floats(2.0, 1e30), seed=st.integers(0, 2 ** 32 - 1))
def test_noisy_payloads_are_rejected(index, sigma, seed):
    codec, xs, summed = CODECS[index]
    g = torch.Generator().manual_seed(seed)
    noisy = summed + (torch.randn(summed.numel(), generator=g, dtype=torch.float64) * sigma).to(torch.float32)
    assert not decode_no_crash(codec, noisy)[1].ok


@settings(max_examples=30)
@given(index=st.sampled_from(INDEXES), rel=st.floats(1e-9, 1e-2), seed=st.integers(0, 2 ** 32 - 1))
def test_small_sketch_noise_never_crashes(index, rel, seed):
    # Value noise is indistinguishable from other values (the sketch has no checksum): only no crash.
    codec, xs, summed = CODECS[index]
    g = torch.Generator().manual_seed(seed)
    noisy = summed.clone()
    start = HEADER_FIELDS if index == "dense" else codec.layout.sketch_offset
    noisy[start:] *= 1 + rel * torch.randn(summed.numel() - start, generator=g)
    decode_no_crash(codec, noisy)


@pytest.mark.parametrize("index", ["bitmap", "bloom", "multilevel"])
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_sketch_cell_is_rejected(index, value):
    codec, xs, summed = CODECS[index]
    L = codec.layout
    tk, tc = codec.decode(summed, trace=True)[1].trace
    payload = summed.clone()
    payload[L.sketch_offset + int(tc[0]) * L.block] = value       # a cell the decoder reads
    y, rep = decode_no_crash(codec, payload)
    assert not rep.ok and ("NaN" in rep.reason or "overflow" in rep.reason), rep.reason
