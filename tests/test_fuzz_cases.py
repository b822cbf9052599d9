"""What the fuzzer's case generators draw (lossless_hc.fuzz.cases, lossless_hc.fuzz.thc_cases): a kind of case
they stop drawing, or draw from a smaller range than their docs say, passes every other test while the fuzz
runs check less."""
import random

import torch

from lossless_hc.fuzz import thc_cases
from lossless_hc.fuzz.thc_cases import run_thc_group
from lossless_hc.thc import THCCodec


def test_a_thc_word_bit_flips_one_bit_of_one_word_and_reaches_every_bit_and_word():
    """THC's "word_bit" corruption changes exactly one bit of one 64-bit word, of a copy, in either word type;
    over 2000 draws every word and every bit, the sign bit included, is reached."""
    for dtype in (torch.float64, torch.int64):
        codec = THCCodec(3, 2, initial_norm=1.0, payload_dtype=dtype)
        clean = torch.arange(9, dtype=dtype) * 3
        kept = clean.clone()
        rng, words, bits = random.Random(0), set(), set()
        for _ in range(2000):
            diff = thc_cases._corrupt("word_bit", clean, codec, rng).view(torch.int64) ^ clean.view(torch.int64)
            changed = diff.nonzero().flatten().tolist()
            assert len(changed) == 1, changed
            flipped = int(diff[changed[0]]) % 2 ** 64
            assert flipped & (flipped - 1) == 0
            words.add(changed[0])
            bits.add(flipped.bit_length() - 1)
        assert torch.equal(clean, kept)
        assert words == set(range(9)) and bits == set(range(64)), dtype


def test_thc_sums_draw_both_word_types_and_averages_float64_words(monkeypatch):
    """A THC group's SUM runs on float64 or int64 words, an AVERAGE on float64 only (int64 words survive a SUM
    only): the first 60 groups draw all three."""
    dtypes, seen = [], set()
    monkeypatch.setattr(thc_cases, "THCCodec", lambda *a, **kw: dtypes.append(kw["payload_dtype"]) or THCCodec(*a, **kw))
    for group in range(60):
        dtypes.clear()
        how = run_thc_group(0, group)[0].how
        seen |= {(how, dtype) for dtype in dtypes}
    assert seen == {("thc_sum", torch.float64), ("thc_sum", torch.int64), ("thc_average", torch.float64)}


def test_a_thc_norm_huge_sets_one_norm_slot_and_reaches_each():
    """THC's "norm_huge" corruption sets one rank's norm slot (layout.norm_offset + r, nothing before or after
    it) to 1e300, as a float64 word or as an int64 word's float64 bits; over 200 draws every rank's slot."""
    for dtype in (torch.float64, torch.int64):
        codec = THCCodec(3, 5, initial_norm=1.0, payload_dtype=dtype)
        first = codec.layout.norm_offset
        clean = torch.zeros(codec.layout.words_offset + 2, dtype=dtype)
        rng, slots = random.Random(0), set()
        for _ in range(200):
            changed = (thc_cases._corrupt("norm_huge", clean, codec, rng) != clean).nonzero().flatten().tolist()
            assert len(changed) == 1 and first <= changed[0] < first + 5, changed
            slots.add(changed[0])
        assert slots == set(range(first, first + 5))
        p = thc_cases._corrupt("norm_huge", clean, codec, random.Random(1))
        assert float(p[first:first + 5].view(torch.float64).max()) == 1e300


def test_a_thc_groups_clean_aggregate_sums_every_rank_quantized_from_the_largest_norm(monkeypatch):
    """A THC group's ranks quantize from the agreed initial_norm, the largest of their inputs' norms, and its
    clean case decodes the SUM of every rank's payload (an AVERAGE: divided by n), once each."""
    log = []

    class Recording(THCCodec):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            log.append(("codec", kwargs["initial_norm"]))

        def encode(self, x, *args, **kwargs):
            log.append(("encode", float(x.double().norm()), super().encode(x, *args, **kwargs).clone()))
            return log[-1][2]

        def decode(self, payload, averaged=False, out=None):
            log.append(("decode", payload.clone(), averaged))
            return super().decode(payload, averaged=averaged, out=out)
    monkeypatch.setattr(thc_cases, "THCCodec", Recording)
    for group in range(8):
        log.clear()
        clean = run_thc_group(0, group)[0]
        ranks = []
        for entry in log:
            if entry[0] == "decode":
                break
            if entry[0] == "encode":
                ranks.append(entry)
        decoded = next(entry for entry in log if entry[0] == "decode")
        n = len(ranks) - 1   # and rank 0 again, on the codec that decodes
        total = ranks[0][2].clone()
        for entry in ranks[1:n]:
            total += entry[2]
        assert decoded[2] == (clean.how == "thc_average")
        assert torch.equal(decoded[1], total / n if decoded[2] else total), group
        assert {entry[1] for entry in log if entry[0] == "codec"} == {max(entry[1] for entry in ranks[:n]) or 1.0}
