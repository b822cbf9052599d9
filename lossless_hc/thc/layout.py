"""The THC payload layout: header words, per-rank norm slots and their mirrors, and the integer levels
of the rotated blocks packed as digits into 64-bit words (``plan_thc_layout``), with the exactness
limits of SUM and AVERAGE aggregation (``max_world_size``) and the prime of the payload's checksum
(``check_prime``). Pure functions of the configuration, identical on every rank.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Optional

import torch

# Payload header fields (one 64-bit word each), before the norm slots and the packed levels.
HDR_CONTRIBUTORS = 0   # 1 per rank: the aggregate says how many ranks contributed (and SUM vs AVERAGE)
HDR_FINGERPRINT = 1    # a 20-bit hash of the configuration, the step and the scale M every rank used
HDR_NON_FINITE = 2     # 1 if this rank's x + e held NaN/Inf
HDR_CHECKSUM = 3       # sum over the level words of c_w * word_w mod P (see THCLayout), in [0, P)
HEADER_FIELDS = 4
FINGERPRINT_BITS = 20
LAYOUT_VERSION = 2
CHECK_PRIME_MAX = 1 << 25   # P < 2^25: residue products stay below 2^50, exact in float64 and int64

WORD_KINDS = {torch.float64: 0, torch.int64: 1}
MAX_HADAMARD_BLOCK = 1 << 20
MAX_GROUP_BLOCKS = 16     # blocks packed together (bounded: a group's floats stay in L2)

# Integers an aggregated float64 word may reach and still be recovered exactly from an AVERAGE.
# An engine averages a sum S of n words as fl(S / n) or fl(S * fl(1/n)) after an exact sum of integers
# (error <= 2 u S with the decoder's fl(avg * n); u = 2^-53), or, with Horovod's gradient_predivide_factor
# f, scales each word by fl(1/f) before summing and the sum by fl(f/n) after: two roundings per word, n - 1
# additions of non-integers, two for the postscale and the decoder's one, at most (n + 4) u S (1 + O(u)).
# S <= 2^52 / (n + 4) keeps that at 1/2: rounding recovers S exactly unless every rounding errs the same
# way at its largest; a word recovered off by one even then fails the payload checksum (THCLayout:
# any change of one word by d != 0 mod P), so the decode is refused. A plain SUM is exact
# (integers below 2^53, in any order).
def _exact_limit(world_size: int, payload_dtype: torch.dtype) -> int:
    if payload_dtype == torch.int64:
        return (1 << 63) - 1          # SUM only; no partial sum of non-negative terms exceeds the total
    return (1 << 52) // (world_size + 4)


def _digits_per_word(base: int, limit: int) -> int:
    """Largest p with base**p - 1 <= limit (0 if not even one digit fits)."""
    p, power = 0, 1
    while power * base - 1 <= limit:
        power *= base
        p += 1
    return p


def _is_prime(p: int) -> bool:
    if p < 2:
        return False
    i = 2
    while i * i <= p:
        if p % i == 0:
            return False
        i += 1
    return True


@functools.lru_cache(maxsize=64)
def check_prime(world_size: int, payload_dtype: torch.dtype) -> int:
    """P of the payload checksum: the largest prime below CHECK_PRIME_MAX whose aggregate n (P - 1)
    stays exact (after SUM, and AVERAGE for float64), and for which 2^1024 != 1 (mod P), so that no
    2^m - 1 with m = 2^j <= 1024 is a multiple of P (the order of 2 mod P does not divide 1024): flipping
    exponent bit j of a float64 word that stays an integer, S -> S 2^(+-m), changes it by a
    non-multiple of P unless S is one. (Other m <= 1024 can have 2^m = 1 (mod P): for world sizes from
    20,772 up, some chosen primes do; no exponent-bit flip multiplies by those.) 0 if none fits."""
    p = min(CHECK_PRIME_MAX - 1, _exact_limit(world_size, payload_dtype) // world_size + 1)
    while p >= 3:
        if _is_prime(p) and pow(2, 1024, p) != 1:
            return p
        p -= 1
    return 0


def _layout_error(world_size: int, granularity: int, payload_dtype: torch.dtype,
                  digits_per_word: Optional[int]) -> Optional[str]:
    """Why (world_size, granularity, payload_dtype, digits_per_word) cannot be exact, or None."""
    limit = _exact_limit(world_size, payload_dtype)
    base = world_size * granularity + 1
    if world_size * ((1 << FINGERPRINT_BITS) - 1) > limit:
        return "the header's fingerprint sum would not stay exact"
    if check_prime(world_size, payload_dtype) == 0:
        return "the header's checksum sum would not stay exact"
    if base >= 1 << 32:   # the kernels hold the digit base in 32 bits (csrc/lhc_layout.h, ThcLayout)
        return f"the digit base n*g+1 = {base} does not fit the kernels' 32 bits"
    if digits_per_word is None:
        if _digits_per_word(base, limit) < 1:
            return f"a single digit of base n*g+1 = {base} exceeds the exact range {limit}"
        return None
    if base ** digits_per_word - 1 > limit:
        return (f"{digits_per_word} digits of base n*g+1 = {base} reach {base ** digits_per_word - 1:.4g}, past the "
                f"exact range {limit:.4g} of a {payload_dtype} word")
    return None


def max_world_size(granularity: int = 30, payload_dtype: torch.dtype = torch.float64,
                   digits_per_word: Optional[int] = None) -> int:
    """The largest world size for which the payload stays exact (no digit carries into the next,
    every word recoverable after SUM, and after AVERAGE for float64). With ``digits_per_word=None``
    the codec picks as many digits per word as fit, so the limit is far away (header and one digit);
    pinning ``digits_per_word`` (a fixed wire size) gives the limit of that lane width, e.g.
    granularity 30 with 6 digits per float64 word allows 8 ranks."""
    if _layout_error(1, granularity, payload_dtype, digits_per_word) is not None:
        return 0
    lo, hi = 1, 1
    while _layout_error(hi * 2, granularity, payload_dtype, digits_per_word) is None and hi < (1 << 40):
        hi *= 2
    hi *= 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if _layout_error(mid, granularity, payload_dtype, digits_per_word) is None:
            lo = mid
        else:
            hi = mid
    return lo


# The layout ABI (csrc/lhc_layout.h ThcLayoutWord): what every backend's kernels read of a THCLayout, one
# uint64 word per name in this order (THCLayout.layout_words).
LAYOUT_WORDS = ("numel", "padded", "block", "granularity", "base", "per_word", "group_blocks", "words")


@dataclass(frozen=True)
class THCLayout:
    """The payload layout, a pure function of the configuration (identical on every rank).

    Payload: ``payload_numel`` words of ``payload_dtype``::

        [ header: 4 words ][ norm slots: world_size ][ mirrors: world_size ][ levels: words ]

    Rank r writes its norm into slot r and its negation into mirror r (the others write 0 there);
    IEEE rounding is symmetric in sign, so after any SUM or AVERAGE mirror r is exactly -slot r, and
    a corrupted slot or mirror shows. The checksum field holds, per rank, C = sum_w c_w q_w mod P over
    its level words q_w (w counted from the first level word), with c_w = 1 + ((c0 + w k) mod (P - 1))
    and (c0, k) drawn per step from the seed (the same on every rank): the aggregate's checksum field
    must be congruent to sum_w c_w S_w (mod P) over the aggregated words S_w (the check is linear, so
    it survives the SUM). Any change of one word by d != 0 (mod P) -- e.g. any single-bit flip of an
    integer word -- breaks it with certainty; a swap of two words less than P - 1 positions
    apart too, unless their values differ by a multiple of P.

    numel      coordinates of the input.
    block      Hadamard block (a power of two): min(hadamard_block, next power of two >= numel).
    padded     numel rounded up to whole blocks; every padded coordinate is transmitted.
    base       n g + 1: one more than the largest aggregated level, so digit sums never carry.
    per_word   digits of base ``base`` per word (base**per_word - 1 within the exact range).
    group_blocks  blocks packed together: the fewest whose coordinates fill whole words
               (per_word / gcd(per_word, block), e.g. 3 blocks of 1024 for 6 digits per word; 1 if
               that exceeds MAX_GROUP_BLOCKS). A group is encoded and decoded in one cache-resident
               pass; only the last group's last word may be partly unused (with group_blocks 1 for want of a
               fitting group, every block's last word may be).
    words      ceil(group coordinates / per_word) summed over the groups.
    """

    numel: int
    world_size: int
    granularity: int
    block: int
    padded: int
    base: int
    per_word: int
    group_blocks: int
    words: int
    payload_dtype: torch.dtype
    check_prime: int

    @property
    def norm_offset(self) -> int:
        return HEADER_FIELDS

    @property
    def mirror_offset(self) -> int:
        return HEADER_FIELDS + self.world_size

    @property
    def words_offset(self) -> int:
        return HEADER_FIELDS + 2 * self.world_size

    @property
    def payload_numel(self) -> int:
        return HEADER_FIELDS + 2 * self.world_size + self.words

    def layout_words(self) -> list:
        """This layout as the layout ABI: one word per name of :data:`LAYOUT_WORDS` (every backend's)."""
        return [int(getattr(self, w)) for w in LAYOUT_WORDS]

    @property
    def wire_bytes(self) -> int:
        return 8 * self.payload_numel

    @property
    def bits_per_coordinate(self) -> float:
        """Payload bits per input coordinate, header, norm slots and padding included."""
        return 8.0 * self.wire_bytes / self.numel

    @property
    def lane_bits_per_coordinate(self) -> float:
        """64 / per_word: the cost of the packed levels alone."""
        return 64.0 / self.per_word


def plan_thc_layout(numel: int, world_size: int, granularity: int, hadamard_block: int = 1024,
                    payload_dtype: torch.dtype = torch.float64, digits_per_word: Optional[int] = None) -> THCLayout:
    if not isinstance(numel, int) or isinstance(numel, bool) or numel < 1:
        raise ValueError(f"numel must be a positive integer (an empty tensor has nothing to compress), got {numel!r}")
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
    if payload_dtype not in WORD_KINDS:
        raise ValueError(f"payload_dtype must be torch.float64 (SUM and AVERAGE) or torch.int64 (SUM only), "
                         f"got {payload_dtype}")
    if (not isinstance(hadamard_block, int) or isinstance(hadamard_block, bool) or hadamard_block < 1
            or hadamard_block > MAX_HADAMARD_BLOCK or hadamard_block & (hadamard_block - 1)):
        raise ValueError(f"hadamard_block must be a power of two in [1, {MAX_HADAMARD_BLOCK}], got {hadamard_block!r}")
    if digits_per_word is not None and (not isinstance(digits_per_word, int) or isinstance(digits_per_word, bool)
                                        or digits_per_word < 1):
        raise ValueError(f"digits_per_word must be None (as many as fit) or a positive integer, got {digits_per_word!r}")
    why = _layout_error(world_size, granularity, payload_dtype, digits_per_word)
    if why is not None:
        limit = max_world_size(granularity, payload_dtype, digits_per_word)
        raise ValueError(f"world_size={world_size} is too large for granularity={granularity} with "
                         f"{'as many digits as fit' if digits_per_word is None else f'digits_per_word={digits_per_word}'}"
                         f" in {payload_dtype} words: {why}. This configuration allows at most {limit} ranks; "
                         "lower granularity or digits_per_word")
    block = min(hadamard_block, 1 << (numel - 1).bit_length())
    padded = -(-numel // block) * block
    base = world_size * granularity + 1
    per_word = digits_per_word or _digits_per_word(base, _exact_limit(world_size, payload_dtype))
    group_blocks = per_word // math.gcd(per_word, block)
    if group_blocks > MAX_GROUP_BLOCKS:
        group_blocks = 1
    blocks = padded // block
    full, rest = divmod(blocks, group_blocks)
    words = full * -(-group_blocks * block // per_word) + -(-rest * block // per_word)
    return THCLayout(numel, world_size, granularity, block, padded, base, per_word, group_blocks, words,
                     payload_dtype, check_prime(world_size, payload_dtype))
