"""Random THC cases: a corrupted aggregate must be refused or decode to what the clean one gives.

THC is lossy, so its contract here is integrity, not accuracy: a decode of the plain SUM (or
AVERAGE) of the ranks' payloads must succeed, and a decode of a corrupted one must raise
``ValueError`` or return exactly the clean decode's bits (a change nothing reads, such as the sign of
a zero). A *THC group* (drawn from ``(seed, group)`` apart from the LHC groups) is a configuration
(2 to 64 ranks, 1 to 4096 coordinates, 2 to 8 bits, float64 or int64 words), one step of Gaussian
inputs of a random scale quantized from an agreed ``initial_norm``, and
:data:`CASES_PER_GROUP` decodes: the clean aggregate, then corruptions (a bit flipped in any word:
header, norm slot, its mirror or a level word; a level word off by a value; a norm slot set to
1e300; the level words zeroed). Every decode runs on a fresh rank-0 codec that encoded the same
input, so one case cannot change another's state.
"""
from __future__ import annotations

import math
import random
from typing import List

import torch

from lossless_hc.thc import THCCodec
from lossless_hc.fuzz.cases import Verdict

CASES_PER_GROUP = 4
CORRUPTIONS = ("word_bit", "level_off", "norm_huge", "zero_levels")


def _rng(seed: int, group: int) -> random.Random:
    return random.Random(f"lossless_hc.fuzz.thc/{seed}/{group}")


def _flip(payload: torch.Tensor, i: int, rng: random.Random) -> None:
    bits = 8 * payload.element_size()
    words = payload.view(torch.int64 if bits == 64 else torch.int32)
    bit = rng.randrange(bits)
    words[i] ^= (1 << bit) if bit < bits - 1 else -(1 << (bits - 1))


def _corrupt(how: str, summed: torch.Tensor, codec: THCCodec, rng: random.Random) -> torch.Tensor:
    L = codec.layout
    p = summed.clone()
    if how == "word_bit":
        _flip(p, rng.randrange(p.numel()), rng)
    elif how == "level_off":
        i = rng.randrange(L.words_offset, p.numel())
        p[i] += rng.choice((1, -1)) * rng.randint(1, 1 << 20)   # an integer: exact in either word type
    elif how == "norm_huge":
        i = L.norm_offset + rng.randrange(codec.world_size)
        if p.dtype == torch.float64:
            p[i] = 1e300
        else:   # int64 words carry the norm's float64 bits
            p[i:i + 1].view(torch.float64)[0] = 1e300
    elif how == "zero_levels":
        p[L.words_offset:] = 0
    return p


def run_thc_group(seed: int, group: int, device: str = "cpu") -> List[Verdict]:
    rng = _rng(seed, group)
    n = min(64, int(math.exp(rng.uniform(math.log(2), math.log(65)))))
    numel = rng.randint(1, 4096 if n <= 16 else 1024)
    averaged = rng.random() < 0.3   # int64 words survive a SUM only
    kw = dict(bits=rng.choice((2, 3, 4, 4, 4, 8)), seed=rng.getrandbits(64),
              payload_dtype=torch.float64 if averaged or rng.random() < 0.7 else torch.int64)
    gen = torch.Generator().manual_seed(rng.getrandbits(63))
    scale = 10.0 ** rng.uniform(-6, 6)
    xs = [torch.randn(numel, generator=gen) * scale for _ in range(n)]
    norm = max(float(x.double().norm()) for x in xs) or 1.0

    def codec(rank: int) -> THCCodec:
        return THCCodec(numel, n, rank=rank, initial_norm=norm, device=device, **kw)

    payloads = [codec(r).encode(x.to(device)).cpu() for r, x in enumerate(xs)]
    summed = payloads[0].clone()
    for q in payloads[1:]:
        summed += q
    if averaged:
        summed = summed / n

    def decode(payload):
        c = codec(0)
        c.encode(xs[0].to(device))
        try:
            return c.decode(payload.to(device), averaged=averaged).cpu()
        except (ValueError, FloatingPointError):   # refused: a corrupted word can also claim a non-finite input
            return None

    clean = decode(summed)
    verdicts = [Verdict(group, 0, "thc_average" if averaged else "thc_sum", "OK" if clean is not None else "REFUSED",
                        None if clean is not None else "refused_clean", "", clean=True)]
    for case in range(1, CASES_PER_GROUP):
        how = rng.choice(CORRUPTIONS)
        c = codec(0)
        y = decode(_corrupt(how, summed, c, rng))
        wrong = None
        if y is not None and clean is not None and not torch.equal(y, clean):
            wrong = "ok_but_wrong"
        detail = f"thc group {group}: n={n} numel={numel} {kw} averaged={averaged}" if wrong else ""
        verdicts.append(Verdict(group, case, f"thc_{how}", "OK" if y is not None else "REFUSED", wrong, detail,
                                clean=False))
    return verdicts
