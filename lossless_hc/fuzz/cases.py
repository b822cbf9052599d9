"""Random cases for the lossless codec, and their verdicts against the contract.

A *group* is one configuration and one set of per-rank inputs, drawn from ``(seed, group)`` alone
(so any group can be replayed by its number, whatever the process that ran it); it yields
:data:`CASES_PER_GROUP` decodes, the *cases*:

0. the plain SUM of the payloads, in a random order of ranks (any engine's order);
1. the same payloads aggregated another way: an AVERAGE (SUM then divide, as BytePS and Horovod's
   Average do), or a pairwise-tree SUM (a ring/tree allreduce's order);
2. and 3. the SUM corrupted once each: a bit flipped in an index word or a sketch word, the sketch
   zeroed (a no-op where no rank holds a key), a sketch word off by a value (a wrong sum), or the
   key count's low header field off by one. A ``dense``
   payload carries its values raw, with nothing redundant to check them by (exactly like a dense
   allreduce), so its corruptions are confined to the header.

Plain aggregates decode with the codec's defaults (the contract for sums of valid payloads); the
corrupted ones with ``verify=True`` (the contract for one corrupted word), and so does case 1 of
every :data:`VERIFY_PLAIN_EVERY`-th group (verify must not break plain decodes either).

Configurations cover every index kind (``bitmap``, ``bloom``, ``multilevel``, ``dense``, and
``auto``), block sizes 1, 2, 3, 4, 8, 16 and 32 (:data:`BLOCKS`), world sizes 2 to 64
(log-uniform), capacities met and exceeded, supports independent, shared, hot or disjoint, and values: Gaussian, log-uniform over dynamic
ranges up to 1e30 with random signs, small integers, many small values plus a few huge ones in the
same tensor (the cross-key rounding case), exact cancellation (+v and -v on two ranks, or three ranks
whose float64 values sum to 0, leaving the float32 roundings' residue as the true sum) and
near-cancellation, float16/bfloat16 inputs (in float16, values beyond its 65504 become infinities),
and now and then a NaN or Inf.

Verdicts (:func:`run_group`, one per case): the decode's status name, and whether it broke the
contract (:mod:`lossless_hc.lhc.contract`): ``ok_but_wrong`` (ok=True with a coordinate outside the
contract) or ``inexact_but_wrong`` (INEXACT with a coordinate outside the contract at a key it did
not report); and on the plain cases ``outside_its_bound`` (a coordinate farther from the true sum
than the bound E(k) the decoder reports for its key, ``decode(..., error_bounds=True)``), ``proven_but_wrong``
(a coordinate of a listed key outside the contract that
:func:`~lossless_hc.lhc.contract.unproven_coordinates` leaves out, i.e. that a re-aggregation would keep) or
``refused_clean`` (refused with a status that says the payload is not a plain sum or average,
:data:`CORRUPTION_STATUSES`, though it is one and no rank was overloaded). Any other refusal
(ok=False) is never wrong.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import List, Optional

import torch

from lossless_hc.lhc.codec import LosslessCodec, key_coordinates
from lossless_hc.lhc.layout import CHUNK_BITS, HDR_FP_HI, HDR_FP_LO, HDR_KEYS_LO, HEADER_FIELDS
from lossless_hc.lhc.status import DecodeStatus
from lossless_hc.lhc.contract import (claimed_outside_contract, outside_bounds, outside_contract, truth,
                                      unproven_coordinates)

CASES_PER_GROUP = 4
INDEX_CHOICES = ("bitmap", "bloom", "multilevel", "dense", "auto")
BLOCKS = (1, 1, 1, 2, 3, 4, 8, 16, 32)
SUPPORTS = ("independent", "shared", "hot", "disjoint")
VALUES = ("normal", "range", "integers", "big_small", "cancel", "near_cancel")
CORRUPTIONS = ("index_bit", "sketch_bit", "zero_sketch", "wrong_sum", "header_keys")
DENSE_CORRUPTIONS = ("header_keys", "header_bit")
VERIFY_PLAIN_EVERY = 4   # case 1 of every 4th group decodes with verify=True
# The statuses that name a payload that is not a plain sum or average of the codec's payloads (corrupted, or
# aggregated otherwise: csrc/lhc_status.h): a false alarm on a plain aggregate without an overloaded rank.
CORRUPTION_STATUSES = frozenset((DecodeStatus.INDEX_CORRUPT, DecodeStatus.SKETCH_CORRUPT, DecodeStatus.HEADER_CORRUPT,
                                 DecodeStatus.WRONG_CONTRIBUTORS, DecodeStatus.CONFIGURATION_MISMATCH,
                                 DecodeStatus.KEY_COUNT_CORRUPT))


@dataclass
class Verdict:
    """One case: what was decoded and what the decoder said."""

    group: int
    case: int
    how: str                 # "sum", "average", "tree", or the corruption
    status: str              # DecodeStatus name
    wrong: Optional[str]     # None, "ok_but_wrong", "inexact_but_wrong", "outside_its_bound", "proven_but_wrong",
    #                          "refused_clean"
    detail: str = ""
    clean: bool = True       # a plain aggregate (False: a corrupted one)


@dataclass
class Group:
    """One configuration and its inputs (everything a case needs, drawn from ``(seed, group)``)."""

    seed: int
    group: int
    numel: int
    block: int
    world_size: int
    index: str
    max_nnz: int
    keys_per_rank: int
    support: str
    values: str
    dtype: torch.dtype
    non_finite: bool
    range_decades: float
    xs: List[torch.Tensor] = field(default_factory=list, repr=False)
    cancel_ranks: int = 0    # "cancel" / "near_cancel": the ranks that cancel on rank 0's support (2 or 3)

    def describe(self) -> str:
        return (f"group {self.group} (seed {self.seed}): numel={self.numel} block={self.block} n={self.world_size} "
                f"index={self.index} max_nnz={self.max_nnz} keys/rank={self.keys_per_rank} support={self.support} "
                f"values={self.values}{f' over {self.cancel_ranks} ranks' if self.cancel_ranks else ''} "
                f"range=1e{self.range_decades:.0f} dtype={self.dtype} non_finite={self.non_finite}")


def group_rng(seed: int, group: int) -> random.Random:
    """The group's generator: a function of ``(seed, group)`` only."""
    return random.Random(f"lossless_hc.fuzz/{seed}/{group}")


def draw_group(seed: int, group: int) -> Group:
    rng = group_rng(seed, group)
    n = min(64, int(math.exp(rng.uniform(math.log(2), math.log(65)))))
    block = rng.choice(BLOCKS)
    numel = rng.randint(1, 4096 if n <= 16 else 1024)
    num_keys = -(-numel // block)
    cap_keys = rng.randint(1, max(1, min(num_keys, int(rng.choice((0.02, 0.1, 0.3, 1.0)) * num_keys) or 1)))
    overload = rng.random() < 0.05
    k = min(num_keys, cap_keys + rng.randint(1, 1 + cap_keys) if overload else rng.randint(0, cap_keys))
    g = Group(seed, group, numel, block, n, rng.choice(INDEX_CHOICES), cap_keys * block, k, rng.choice(SUPPORTS),
              rng.choice(VALUES), rng.choices((torch.float32, torch.float16, torch.bfloat16), (8, 1, 1))[0],
              rng.random() < 0.01, rng.uniform(0.0, 30.0))
    g.xs = _inputs(g, rng, num_keys)
    return g


def _supports(g: Group, rng: random.Random, num_keys: int) -> List[List[int]]:
    k, n = g.keys_per_rank, g.world_size
    if g.support == "shared":
        keys = rng.sample(range(num_keys), k)
        return [keys] * n
    if g.support == "hot":   # drawn from a pool twice the per-rank count: heavy overlap
        pool = rng.sample(range(num_keys), min(num_keys, 2 * k))
        return [rng.sample(pool, k) for _ in range(n)]
    if g.support == "disjoint":
        perm = rng.sample(range(num_keys), num_keys)
        per = min(k, num_keys // n)
        return [perm[r * per:(r + 1) * per] for r in range(n)]
    return [rng.sample(range(num_keys), k) for _ in range(n)]


def _values(g: Group, rng: random.Random, size: int, gen: torch.Generator) -> torch.Tensor:
    kind = g.values
    if kind == "normal":
        return torch.randn(size, generator=gen, dtype=torch.float64)
    if kind == "integers":
        return torch.randint(-8, 9, (size,), generator=gen).to(torch.float64)
    signs = torch.randint(0, 2, (size,), generator=gen).to(torch.float64) * 2 - 1
    if kind == "big_small":   # ones everywhere, a few huge values: small keys share cells with them
        v = torch.ones(size, dtype=torch.float64) * signs
        big = torch.rand(size, generator=gen, dtype=torch.float64) < 0.02
        return torch.where(big, signs * 10.0 ** (4 + g.range_decades / 2), v)
    # "range", and the base values of the cancelling kinds: log-uniform over range_decades decades
    lo = -g.range_decades / 2
    exps = lo + g.range_decades * torch.rand(size, generator=gen, dtype=torch.float64)
    return signs * 10.0 ** exps


def _inputs(g: Group, rng: random.Random, num_keys: int) -> List[torch.Tensor]:
    gen = torch.Generator().manual_seed(rng.getrandbits(63))
    b, numel = g.block, g.numel
    xs = []
    for keys in _supports(g, rng, num_keys):
        x = torch.zeros(numel, dtype=torch.float64)
        if keys:
            idx, _ = key_coordinates(torch.tensor(keys, dtype=torch.int64), b, numel)
            x[idx] = _values(g, rng, idx.numel(), gen)
        xs.append(x)
    if g.values in ("cancel", "near_cancel") and g.world_size >= 2:
        # Rank 1 holds minus rank 0 on rank 0's support (exactly, or off by a relative 2^-20); or, in half of
        # the groups of 3 ranks or more, ranks 1 and 2 share minus rank 0 with rank 1 up to 3x rank 0 either
        # way: the float64 sum is 0 (or 2^-20 of rank 0) and the true sum of the float32 inputs the
        # roundings' residue, a key far below its mass and mostly not 0. Drawn from `gen`, after the values:
        # `rng`'s stream, and so every group's configuration and supports, stay as they were.
        factor = 1.0 if g.values == "cancel" else 1.0 + 2.0 ** -20
        mask = xs[0] != 0
        g.cancel_ranks = 3 if g.world_size >= 3 and bool(torch.rand((), generator=gen) < 0.5) else 2
        if g.cancel_ranks == 2:
            xs[1] = torch.where(mask, -factor * xs[0], xs[1])
        else:
            share = xs[0] * (6.0 * torch.rand(numel, generator=gen, dtype=torch.float64) - 3.0)
            xs[1] = torch.where(mask, share, xs[1])
            xs[2] = torch.where(mask, -factor * xs[0] - share, xs[2])
    # float32 (or the chosen dtype) values; float32's range caps the magnitudes
    out = [x.clamp(-1e30, 1e30).to(g.dtype) for x in xs]
    if g.non_finite:
        r, i = rng.randrange(g.world_size), rng.randrange(numel)
        out[r][i] = rng.choice((float("nan"), float("inf"), float("-inf")))
    return out


# -- aggregation and corruption ----------------------------------------------------------------------

def _sum(payloads: List[torch.Tensor], rng: random.Random) -> torch.Tensor:
    order = rng.sample(range(len(payloads)), len(payloads))
    acc = payloads[order[0]].clone()
    for r in order[1:]:
        acc += payloads[r]
    return acc


def _tree_sum(payloads: List[torch.Tensor]) -> torch.Tensor:
    level = list(payloads)
    while len(level) > 1:
        level = [level[i] + level[i + 1] if i + 1 < len(level) else level[i] for i in range(0, len(level), 2)]
    return level[0].clone()


def _restamped(summed: torch.Tensor, codec: LosslessCodec, to: LosslessCodec) -> torch.Tensor:
    """``summed`` (a SUM of ``codec``'s payloads) as the ranks would have sent it with ``to``'s options:
    the same words except the header's fingerprint (the decode options join it; exact small integers)."""
    p = summed.clone()
    n, fp, mask = codec.world_size, to.layout.fingerprint, (1 << CHUNK_BITS) - 1
    p[HDR_FP_LO] += float(n * (fp & mask)) - float(n * (codec.layout.fingerprint & mask))
    p[HDR_FP_HI] += float(n * (fp >> CHUNK_BITS)) - float(n * (codec.layout.fingerprint >> CHUNK_BITS))
    return p


def _flip(payload: torch.Tensor, i: int, bit: int) -> None:
    words = payload.view(torch.int32)
    words[i] ^= (1 << bit) if bit < 31 else -(1 << 31)


def _corrupt(how: str, summed: torch.Tensor, codec: LosslessCodec, rng: random.Random) -> torch.Tensor:
    L = codec.layout
    p = summed.clone()
    lo, hi = (HEADER_FIELDS, L.sketch_offset) if how == "index_bit" else (L.sketch_offset, L.payload_numel)
    if how == "header_bit":
        _flip(p, rng.randrange(HEADER_FIELDS), rng.randrange(32))
    elif hi <= lo:
        pass
    elif how in ("index_bit", "sketch_bit"):
        _flip(p, rng.randrange(lo, hi), rng.randrange(32))
    elif how == "zero_sketch":
        p[lo:hi] = 0.0
    elif how == "wrong_sum":
        i = rng.randrange(lo, hi)
        p[i] += rng.choice((1.0, -1.0)) * 10.0 ** rng.uniform(-6, 6) * max(1.0, float(p[i].abs()))
    if how == "header_keys":
        p[HDR_KEYS_LO] += rng.choice((1.0, -1.0))
    return p


# -- one group ------------------------------------------------------------------------------------------

def _verdict(g: Group, case: int, how: str, codec: LosslessCodec, payload: torch.Tensor, averaged: bool,
             s: torch.Tensor, a: torch.Tensor, rtol: float) -> Verdict:
    clean = how in ("sum", "average", "tree")
    # The reported bounds hold only for sums of valid payloads: checked on the clean cases.
    y, report = codec.decode(payload, averaged=averaged, shape=(g.numel,), dtype=g.dtype, error_bounds=clean)
    status = DecodeStatus(report.status)
    if clean and status in CORRUPTION_STATUSES and not report.overloaded_ranks:
        return Verdict(g.group, case, how, status.name, "refused_clean", report.reason or "", clean=clean)
    if averaged:
        s, a = s / g.world_size, a / g.world_size
    wrong, detail = None, ""
    bad = claimed_outside_contract(y, report, s, a, g.world_size, rtol, g.block, averaged)
    if bool(bad.any()):
        wrong = "ok_but_wrong" if report.ok else "inexact_but_wrong"
    if wrong is None and report.error_bounds is not None:
        bad = outside_bounds(y, s, a, g.world_size, report.error_bounds, g.block)
        if bool(bad.any()):
            wrong = "outside_its_bound"
    if wrong is None and report.error_bounds is not None and status == DecodeStatus.INEXACT:
        # the listed keys' coordinates a re-aggregation leaves as decoded, because their bounds prove them
        proven = torch.zeros(g.numel, dtype=torch.bool)
        proven[key_coordinates(report.inexact_keys.to(torch.int64), g.block, g.numel)[0]] = True
        proven[unproven_coordinates(y, report, g.block, codec.rtol, codec.verify).cpu()] = False
        bad = proven & outside_contract(y, s, a, g.world_size, rtol, averaged)
        if bool(bad.any()):
            wrong = "proven_but_wrong"
    if wrong is not None:
        i = int(bad.nonzero()[0])
        detail = f"coordinate {i}: decoded {float(y.reshape(-1)[i])!r}, true sum {float(s[i])!r}, mass {float(a[i])!r}"
    return Verdict(g.group, case, how, status.name, wrong, detail, clean=clean)


def codec_rtol(codec: LosslessCodec, rtol: Optional[float]) -> float:
    """The tolerance the contract is checked with: ``rtol`` if given, else the codec's own."""
    if rtol is not None:
        return float(rtol)
    own = getattr(codec, "rtol", None)
    if own is None:
        raise RuntimeError("this LosslessCodec states no rtol; pass --rtol")
    return float(own)


def group_cases(seed: int, group: int, device: str = "cpu"):
    """Group ``group``'s inputs and its :data:`CASES_PER_GROUP` aggregates, as :func:`run_group` decodes
    them: ``(g, plain codec, [(case, how, codec, payload, averaged)])``, payloads on the CPU."""
    g = draw_group(seed, group)
    rng = group_rng(seed, group + (1 << 40))   # the aggregation's choices, apart from the inputs'
    args = dict(seed=rng.getrandbits(64), index=g.index, device=device)
    codec = LosslessCodec(g.numel, g.world_size, g.max_nnz, g.block, **args)
    verified = LosslessCodec(g.numel, g.world_size, g.max_nnz, g.block, verify=True, **args)
    payloads = [codec.encode(x.to(device)).cpu() for x in g.xs]
    summed = _sum(payloads, rng)
    cases = [(0, "sum", codec, summed, False)]
    second = verified if group % VERIFY_PLAIN_EVERY == 0 else codec
    if rng.random() < 0.5:
        cases.append((1, "average", second, _restamped(summed, codec, second) / g.world_size, True))
    else:
        cases.append((1, "tree", second, _restamped(_tree_sum(payloads), codec, second), False))
    for case in (2, 3):
        how = rng.choice(DENSE_CORRUPTIONS if codec.index_kind == "dense" else CORRUPTIONS)
        cases.append((case, how, verified, _corrupt(how, _restamped(summed, codec, verified), verified, rng), False))
    return g, codec, cases


def run_group(seed: int, group: int, rtol: Optional[float] = None, device: str = "cpu") -> List[Verdict]:
    """The :data:`CASES_PER_GROUP` verdicts of group ``group`` (see the module doc)."""
    g, codec, cases = group_cases(seed, group, device)
    tol = codec_rtol(codec, rtol)
    s, a = truth(g.xs)
    return [_verdict(g, case, how, c, p.to(device), averaged, s, a, tol) for case, how, c, p, averaged in cases]
