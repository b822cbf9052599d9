"""The wire format's known answers: fixed inputs encoded under fixed configurations give these exact
payload bits and fingerprints.

The other tests check that decode inverts encode and that the backends agree (C++ against the
pure-torch reference, CPU against emulated CUDA), so a change that moves them all together -- a hash
constant, a cell's placement, a header field, a table's sizing -- passes them, and payloads of two
builds then no longer mix. Such a change must be deliberate: bump the format's ``LAYOUT_VERSION``
(``lossless_hc.lhc.layout``, docs/DESIGN.md "Layout versions"; ``lossless_hc.thc.layout``) and update
these values in the same commit. The inputs are integer arithmetic, not a generator, so the values do
not depend on torch's random streams.
"""
import hashlib

import pytest
import torch

from lossless_hc import LosslessCodec
from lossless_hc.lhc import reference
from lossless_hc.lhc.layout import LAYOUT_VERSION
from lossless_hc.thc.codec import THCCodec
from lossless_hc.thc.layout import LAYOUT_VERSION as THC_LAYOUT_VERSION


def pattern(numel: int, k: int) -> torch.Tensor:
    """k non-zeros at the coordinates 7919 i mod numel, of values in [-6.25, 6.25] in steps of 1/8."""
    i = torch.arange(k, dtype=torch.int64)
    x = torch.zeros(numel)
    x[(i * 7919) % numel] = ((i * 37) % 101 - 50).to(torch.float32) / 8
    return x


def digest(payload: torch.Tensor) -> str:
    return hashlib.sha256(payload.contiguous().numpy().tobytes()).hexdigest()[:16]


# index -> (fingerprint, payload words, sha256 of the payload's bytes, first 16 hex digits)
LHC_KNOWN = {
    "dense": (1247560, 20011, "bbe3abf96f371fd5"),
    "bitmap": (3800362, 6494, "bd39b28f43ca781a"),
    "bloom": (2235524, 7939, "364901c1fb3b22aa"),
    "multilevel": (4088134, 6482, "b3702a75d09f26dc"),
}


@pytest.mark.parametrize("index", sorted(LHC_KNOWN))
def test_lhc_payloads_are_the_known_answers_of_layout_7(index):
    """20000 coordinates, 4 ranks, 400 non-zeros a rank, seed 123: the payload's words and bits (the C++
    encoder's and the reference's alike) and the layout's fingerprint."""
    assert LAYOUT_VERSION == 7, "a new layout version: update LHC_KNOWN to its payloads"
    codec = LosslessCodec(20000, 4, 400, seed=123, index=index)
    x = pattern(20000, 400)
    payload = codec.encode(x)
    assert (codec.layout.fingerprint, payload.numel(), digest(payload)) == LHC_KNOWN[index]
    assert torch.equal(reference.encode(codec.layout, x), payload)


def test_thc_payload_is_the_known_answer():
    """THC, 4096 coordinates, 4 ranks, rank 1, seed 9, an agreed norm of 8 at the first step: the float64
    payload's words and bits (its header with the fingerprint, the norm slots, the packed indices)."""
    assert THC_LAYOUT_VERSION == 2, "a new THC layout version: update this payload's known answer"
    codec = THCCodec(4096, 4, 1, seed=9, initial_norm=8.0)
    payload = codec.encode(pattern(4096, 300))
    assert (payload.dtype, payload.numel(), digest(payload)) == (torch.float64, 598, "b5571cdd0ea574e0")


# payload dtype -> the header's fingerprint at the first step, seeds 0 to 3 (THC, 4096 coordinates, 4 ranks)
THC_FINGERPRINTS = {torch.float64: [891689, 877295, 925648, 857843], torch.int64: [28063, 362860, 452845, 350479]}


@pytest.mark.parametrize("dtype", sorted(THC_FINGERPRINTS, key=str))
def test_thc_fingerprints_are_the_known_answers(dtype):
    """The THC header's 20-bit fingerprint (its hash fields: the layout version, the word kind -- float64 0,
    int64 1 --, the seed, ...) for both payload dtypes and four seeds: the payload above pins one value only
    (below 2^19, for float64), so a change of the word kind or of the hash's width passed it."""
    from lossless_hc.thc.layout import HDR_FINGERPRINT
    got = [int(THCCodec(4096, 4, 1, seed=seed, initial_norm=8.0, payload_dtype=dtype)
               .encode(pattern(4096, 300))[HDR_FINGERPRINT]) for seed in range(4)]
    assert got == THC_FINGERPRINTS[dtype]


# step -> the THC header's checksum field (4096 coordinates, 4 ranks, rank 1, seed 9, agreed norm 8); the weights'
# step k is re-drawn (k + 1 until coprime to P - 1) at steps 2 to 6, where the first draw is even
THC_CHECKSUMS = [2489883, 27421771, 14296553, 19686463, 18567091, 11022205, 8600068, 3661507]


def test_thc_checksum_fields_of_later_steps_are_the_known_answers():
    """The checksum weights (c0, k) are drawn per step from the seed: the known payload above pins step 0 only,
    whose first k is coprime to P - 1, so a change of how a k sharing a factor with P - 1 is re-drawn passed it.
    The field at steps 0 to 7 (the step set through load_state_dict), five of them re-drawn."""
    from lossless_hc.thc.layout import HDR_CHECKSUM
    codec = THCCodec(4096, 4, 1, seed=9)
    got = []
    for step in range(len(THC_CHECKSUMS)):
        codec.reset()   # no decode of a one-rank payload: the next encode may start at once
        codec.load_state_dict({"step": step, "norm": 8.0, "error": torch.zeros(4096)})
        got.append(int(codec.encode(pattern(4096, 300))[HDR_CHECKSUM]))
    assert got == THC_CHECKSUMS
