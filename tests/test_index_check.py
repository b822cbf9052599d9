"""The index checksum (issue #19; csrc/lhc_layout.h, "The index checksum"): a decoded support whose
per-key counts are not the ranks' is reported as INDEX_CORRUPT, never as OK or INEXACT, and a valid
payload never trips the check.

Each rank writes ``(sum over its non-zero keys k of part_f(k)) mod p_f`` (p_0 = 2039, p_1 = 2029) into
two header fields; the decoders compare the aggregated fields, mod p_f, with the decoded support's
``sum_k count(k) part_f(k) mod p_f``. A wrong support passes with probability 1 / (p_0 p_1) < 2**-21.9
over the seed, so no flip of these small cases may get through.
"""
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import helpers
from lossless_hc import LosslessCodec
from lossless_hc.lhc import reference
from lossless_hc.lhc.layout import (CHUNK_BITS, HDR_INDEX_CHECK0, HDR_KEYS_HI, HDR_KEYS_LO, HDR_KEYS_MID,
                                    INDEX_CHECK_PRIMES)
from lossless_hc.lhc.status import DecodeStatus

EXACT_CLAIMS = (DecodeStatus.OK, DecodeStatus.INEXACT)


def positive_case(index: str, n: int, pattern: str, numel: int = 200, k: int = 8, seed: int = 0):
    """A codec, ``n`` inputs of positive values (no sum cancels to 0: the true support is where the sum
    is non-zero) on the ``pattern`` supports, and the true per-key counts."""
    rng = np.random.default_rng(helpers.stable_seed(index, n, pattern, seed))
    codec = LosslessCodec(numel, n, k, seed=seed, index=index, num_threads=1)
    xs = [x.abs() for x in helpers.make_inputs(rng, numel, 1, n, k, pattern, "normal")]
    counts = sum((x != 0).to(torch.int64) for x in xs)
    return codec, xs, counts, rng


def flip(payload: torch.Tensor, word: int, bit: int) -> torch.Tensor:
    p = payload.clone()
    w = p.view(torch.int32)
    w[word] ^= (1 << bit) if bit < 31 else -(1 << 31)
    return p


def bitmap_counts(codec: LosslessCodec, payload: torch.Tensor, averaged: bool):
    """The bitmap index's per-key counts as the words say, if every word is a valid packed count and
    they sum to the header's key total (a "valid-looking" index), else None."""
    L = codec.layout
    n = L.world_size
    scale = n if averaged else 1
    v = payload[:L.sketch_offset].double() * scale
    r = v.round()
    tol = 0.5 if averaged else 0.0
    if not bool(((v - r).abs() <= tol).all()) or bool((r < 0).any()):
        return None
    words = r[L.index_offset:].to(torch.int64)
    if bool((words >= L.index.base ** L.index.per_word).any()):
        return None
    digits = torch.stack([(words // L.index.base ** i) % L.index.base for i in range(L.index.per_word)], 1).reshape(-1)
    hdr = r[:L.index_offset].to(torch.int64).tolist()
    total = hdr[HDR_KEYS_LO] + (hdr[HDR_KEYS_MID] << CHUNK_BITS) + (hdr[HDR_KEYS_HI] << (2 * CHUNK_BITS))
    if bool((digits[L.num_keys:] != 0).any()) or bool((digits > n).any()) or int(digits.sum()) != total:
        return None
    return digits[:L.num_keys]


def assert_no_wrong_support_claimed(codec, xs, counts, payload, averaged, what):
    """The report claims exactness (OK, or INEXACT outside its listed keys) only with the true support."""
    y, rep = codec.decode(payload, averaged=averaged)
    if rep.status not in EXACT_CLAIMS:
        return rep.status
    true = counts > 0
    assert rep.support == int(true.sum()), (what, rep.status, rep.support, int(true.sum()))
    claimed = torch.ones_like(true)
    claimed[rep.inexact_keys] = False
    assert torch.equal((y != 0)[claimed], true[claimed]), (what, rep.status)
    return rep.status


@pytest.mark.parametrize("index", ["bitmap", "bloom", "multilevel"])
@pytest.mark.parametrize("n", [3, 7])
@pytest.mark.parametrize("averaged", [False, True])
def test_every_index_bit_flip_is_caught_or_harmless(index, n, averaged):
    """Every bit of every index word (the multilevel fine tables included) of small SUM and AVERAGE
    payloads, on overlapping supports (keys held by several ranks: counts above 1) and disjoint ones: no
    decode claims exactness with a support other than the true one. For the bitmap, the flips that
    leave a valid-looking index (every word a packed count, digits summing to the header's total) with
    wrong counts are all INDEX_CORRUPT; under AVERAGE they exist (a flip changes an averaged word by
    2^m, the integer by n 2^m, which in base n + 1 can keep the digit sum: keys move by a position)."""
    sneaky = 0
    for pattern in ("clustered", "disjoint"):
        codec, xs, counts, rng = positive_case(index, n, pattern)
        L = codec.layout
        payload = helpers.sum_payloads([codec.encode(x) for x in xs], rng)
        if averaged:
            payload = helpers.average_payloads(payload, n)
        assert codec.decode(payload, averaged=averaged)[1].status in EXACT_CLAIMS
        for word in range(L.index_offset, L.sketch_offset):
            for bit in range(32):
                p = flip(payload, word, bit)
                status = assert_no_wrong_support_claimed(codec, xs, counts, p, averaged, (pattern, word, bit))
                if index == "bitmap":
                    c = bitmap_counts(codec, p, averaged)
                    if c is not None and not torch.equal(c, counts):
                        sneaky += 1
                        assert status == DecodeStatus.INDEX_CORRUPT, (pattern, word, bit, status)
    if index == "bitmap" and averaged:
        assert sneaky > 0   # the class the checksum is for was exercised


@pytest.mark.parametrize("index", ["bitmap", "bloom", "multilevel"])
def test_flips_agree_with_the_reference(index):
    """The reference decoder (the oracle) reaches the CPU's verdict on a sample of index flips."""
    codec, xs, counts, rng = positive_case(index, 3, "random", numel=300, k=10, seed=1)
    L = codec.layout
    payload = helpers.sum_payloads([codec.encode(x) for x in xs], rng)
    words = range(L.index_offset, L.sketch_offset)
    for i in range(60):
        p = flip(payload, words[(i * 7919) % len(words)], (i * 13) % 32)
        y, rep = codec.decode(p)
        yr, info = reference.decode(L, p)
        assert helpers.peeled_ok(rep) == helpers.peeled_ok(info), (i, rep.reason, info["reason"])
        if "checksum" in (info["reason"] or ""):
            assert rep.status == DecodeStatus.INDEX_CORRUPT, (i, rep.reason)


@pytest.mark.parametrize("index", ["bitmap", "bloom", "multilevel"])
@pytest.mark.parametrize("averaged", [False, True])
def test_a_key_moved_to_another_position_is_caught(index, averaged):
    """A key's ranks moved to a key no rank holds (the key total kept: what a flip does when it moves a
    count by a position), forged as a valid index -- the index words of the moved inputs under the
    true header and sketch: INDEX_CORRUPT on the CPU and the reference, from the checksum; with the
    header's checksum forged to match the moved support, the index passes (the check is what caught
    it)."""
    n = 3
    codec, xs, counts, rng = positive_case(index, n, "clustered", seed=2)
    L = codec.layout
    held = torch.nonzero(counts > 1).reshape(-1)
    a, b = int(held[0]), int(torch.nonzero(counts == 0).reshape(-1)[0])
    moved_xs = []
    for x in xs:
        m = x.clone()
        m[b], m[a] = m[a], 0.0
        moved_xs.append(m)
    scale = n if averaged else 1
    payload = torch.stack([codec.encode(x) for x in xs]).sum(0) / scale
    moved = torch.stack([codec.encode(x) for x in moved_xs]).sum(0) / scale
    # the headers differ in the checksum alone (the key total is kept)
    differ = torch.nonzero(payload[:L.index_offset] != moved[:L.index_offset]).reshape(-1).tolist()
    assert set(differ) <= {HDR_INDEX_CHECK0, HDR_INDEX_CHECK0 + 1}, differ
    p = payload.clone()
    p[L.index_offset:L.sketch_offset] = moved[L.index_offset:L.sketch_offset]
    y, rep = codec.decode(p, averaged=averaged)
    yr, info = reference.decode(L, p, averaged=averaged)
    assert rep.status == DecodeStatus.INDEX_CORRUPT, rep.reason
    assert not info["ok"] and "checksum" in info["reason"], info["reason"]
    p[HDR_INDEX_CHECK0:HDR_INDEX_CHECK0 + 2] = moved[HDR_INDEX_CHECK0:HDR_INDEX_CHECK0 + 2]
    y, rep = codec.decode(p, averaged=averaged)
    assert rep.status != DecodeStatus.INDEX_CORRUPT, rep.reason
    assert "checksum" not in (reference.decode(L, p, averaged=averaged)[1]["reason"] or "")


@settings(max_examples=40, deadline=None, derandomize=True)
@given(seed=st.integers(0, 2**31 - 1), averaged=st.booleans(), index=st.sampled_from(["bitmap", "bloom", "multilevel"]),
       pattern=st.sampled_from(helpers.PATTERNS), block=st.sampled_from([1, 3]))
def test_valid_payloads_never_trip_the_check(seed, averaged, index, pattern, block):
    """Random world sizes, sizes, densities, supports, summation orders, SUM and AVERAGE: the header's
    checksum is the decoded support's (the CPU never says INDEX_CORRUPT, nor does the reference), and
    each rank's fields are its keys' checksum, below p_f."""
    rng = np.random.default_rng(seed)
    n, numel, density = helpers.draw_sizes(rng, max_n=9, max_numel=900)
    num_keys = -(-numel // block)
    k = max(1, int(density * num_keys))
    codec = LosslessCodec(numel, n, k * block, block_size=block, seed=seed % 1000, index=index)
    L = codec.layout
    xs = helpers.make_inputs(rng, numel, block, n, k, pattern, "normal")
    payloads = [codec.encode(x) for x in xs]
    for x, p in zip(xs, payloads):
        keys = torch.from_numpy(helpers.nonzero_keys(x, block)).to(torch.int64)
        fields = p[HDR_INDEX_CHECK0:HDR_INDEX_CHECK0 + 2].tolist()
        assert fields == reference.index_check(L, keys)
        assert all(0 <= f < prime for f, prime in zip(fields, INDEX_CHECK_PRIMES))
    payload = helpers.sum_payloads(payloads, rng, how=str(rng.choice(["sequential", "tree", "stack"])))
    if averaged:
        payload = helpers.average_payloads(payload, n, how=str(rng.choice(["divide", "reciprocal"])))
    y, rep = codec.decode(payload, averaged=averaged)
    assert rep.status != DecodeStatus.INDEX_CORRUPT, rep.reason
    yr, info = reference.decode(L, payload, averaged=averaged)
    assert "checksum" not in (info["reason"] or ""), info["reason"]
