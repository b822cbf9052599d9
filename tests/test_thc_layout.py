"""THC's payload layout (lossless_hc.thc.layout) at its exact boundaries: the documented limits, digits
per word, block grouping, word counts and offsets, each computed here from the formula the module
documents (not from its loops), and the checksum prime's known values."""
import pytest
import torch

from lossless_hc.thc.layout import check_prime, max_world_size, plan_thc_layout


def exact_limit(n, dtype):
    """The documented exact range of an aggregated word: 2^63 - 1 for int64 (SUM), 2^52 // (n + 4) for float64."""
    return (1 << 63) - 1 if dtype == torch.int64 else (1 << 52) // (n + 4)


@pytest.mark.parametrize("granularity,per_word", [(1, 63), (7, 21), (127, 9)])
def test_digits_per_int64_word_reach_the_range_exactly(granularity, per_word):
    """One rank, base g + 1 a power of two 2^(63/p): base^p - 1 is 2^63 - 1, the int64 range itself, so p
    digits fit (the range is inclusive) and p + 1 do not; pinned as digits_per_word too."""
    base = granularity + 1
    assert base ** per_word - 1 == exact_limit(1, torch.int64)
    L = plan_thc_layout(4096, 1, granularity, payload_dtype=torch.int64)
    assert (L.base, L.per_word) == (base, per_word)
    assert plan_thc_layout(4096, 1, granularity, payload_dtype=torch.int64, digits_per_word=per_word).per_word == per_word
    with pytest.raises(ValueError, match="allows at most 0 ranks"):
        plan_thc_layout(4096, 1, granularity, payload_dtype=torch.int64, digits_per_word=per_word + 1)
    assert max_world_size(granularity, torch.int64, per_word) == 1


def test_hadamard_block_limits():
    """hadamard_block is a power of two in [1, MAX_HADAMARD_BLOCK = 2^20]: both ends accepted (the block is
    min(hadamard_block, next power of two >= numel)), 2^21 and non-powers refused."""
    assert plan_thc_layout(1 << 21, 2, 30, hadamard_block=1 << 20).block == 1 << 20
    assert plan_thc_layout(5, 2, 30, hadamard_block=1).block == 1
    for bad in (1 << 21, 0, 3, 1 << 22):
        with pytest.raises(ValueError, match="power of two in \\[1, 1048576\\]"):
            plan_thc_layout(1 << 21, 2, 30, hadamard_block=bad)


@pytest.mark.parametrize("numel,per_word,group_blocks,words", [
    (16, 16, 16, 1),     # 16 one-coordinate blocks fill one word: a group of MAX_GROUP_BLOCKS = 16
    (17, 17, 1, 17),     # 17 would exceed it: each block its own (partly unused) word
    (48, 16, 16, 3),     # three full groups
    (20, 16, 16, 2),     # a full group and a last one of 4 blocks, in a word of its own
])
def test_group_blocks_up_to_sixteen(numel, per_word, group_blocks, words):
    """Blocks of one coordinate (hadamard_block=1): group_blocks = per_word / gcd(per_word, block) = per_word
    while it is at most MAX_GROUP_BLOCKS (16), else 1; words = ceil(group coordinates / per_word) per group."""
    L = plan_thc_layout(numel, 1, 1, hadamard_block=1, digits_per_word=per_word)
    assert (L.block, L.padded, L.per_word, L.group_blocks, L.words) == (1, numel, per_word, group_blocks, words)


def test_word_count_offsets_and_sizes_of_eight_ranks():
    """g = 30, 8 ranks: base 241, 6 digits a float64 word (241^6 - 1 < 2^52 / 12 < 241^7 - 1), groups of
    3 blocks of 1024; 5000 coordinates pad to 5 blocks: one group of 3 (3072 / 6 = 512 words) and a last of 2
    (ceil(2048 / 6) = 342 words). Payload: 4 header words, 8 norm slots, 8 mirrors, then the words."""
    assert 241 ** 6 - 1 <= exact_limit(8, torch.float64) < 241 ** 7 - 1
    L = plan_thc_layout(5000, 8, 30)
    assert (L.block, L.padded, L.base, L.per_word, L.group_blocks, L.words) == (1024, 5120, 241, 6, 3, 512 + 342)
    assert (L.norm_offset, L.mirror_offset, L.words_offset) == (4, 12, 20)
    assert L.payload_numel == 4 + 16 + 854 and L.wire_bytes == 8 * (4 + 16 + 854)
    assert L.bits_per_coordinate == 64 * (4 + 16 + 854) / 5000 and L.lane_bits_per_coordinate == 64 / 6
    assert L.layout_words() == [5000, 5120, 1024, 30, 241, 6, 3, 854]


def test_check_prime_known_values():
    """P is the largest prime below 2^25 (2^25 - 39) while n (P - 1) stays exact, smaller where the float64
    AVERAGE range binds (values from an independent prime search), and 0 when no prime >= 3 fits."""
    assert check_prime(1, torch.float64) == check_prime(8, torch.int64) == (1 << 25) - 39 == 33554393
    assert check_prime(1 << 16, torch.float64) == 1048507
    assert check_prime(100000, torch.float64) == 450311
    assert check_prime(1 << 40, torch.float64) == 0


@pytest.mark.parametrize("n,bound,prime", [(22369619, 10, 7), (13421770, 26, 23), (16777214, 17, 13),
                                           (262142, 65537, 65521), (60000, 1250917, 1250917),
                                           (30011994, 6, 0), (67108862, 2, 0)])
def test_check_prime_is_the_largest_fitting_prime_without_two_to_the_1024_one(n, bound, prime):
    """Where the float64 range binds, P is the largest prime <= 2^52 // (n + 4) // n + 1 (``bound``) with
    2^1024 != 1 (mod P): not the prime square 9 or 25 just below the bound, and not 17 or 65537, whose order
    of 2 divides 1024 (an exponent-bit flip would be a multiple of P); the bound itself where it is such a
    prime (60000 ranks), and 0 where none >= 3 is (3 and 5 have 2^1024 = 1 mod P; 2 is never taken).
    Values from an independent search."""
    assert (1 << 52) // (n + 4) // n + 1 == bound
    assert check_prime(n, torch.float64) == prime


def largest_world_size(granularity, dtype, digits):
    """The largest n meeting the documented limits, scanned n = 1, 2, ...: the header's fingerprint sum
    n (2^20 - 1) and a digit sum ((n g + 1)^digits - 1, or n g with as many digits as fit) within the exact
    range, and the digit base n g + 1 below 2^32 (the kernels' 32 bits)."""
    def fits(n):
        limit, base = exact_limit(n, dtype), n * granularity + 1
        top = base ** digits - 1 if digits else base - 1
        return n * ((1 << 20) - 1) <= limit and top <= limit and base < 1 << 32
    n = 0
    while fits(n + 1):
        n += 1
    return n


@pytest.mark.parametrize("granularity,dtype,digits,want", [(1, torch.float64, None, 65534),
                                                           (30, torch.float64, None, 65534),
                                                           (30, torch.float64, 3, 638), (29, torch.float64, 3, 654),
                                                           (30, torch.float64, 6, 8), (29, torch.float64, 6, 9)])
def test_max_world_size_is_the_largest_n_within_the_documented_limits(granularity, dtype, digits, want):
    """max_world_size against a scan of the documented limits: with as many digits as fit, the fingerprint
    sum binds (65534 ranks, whatever the granularity); with 3 or 6 digits a word, the digit sum. The
    default granularity is 30; one rank more is refused by plan_thc_layout, naming the limit."""
    assert largest_world_size(granularity, dtype, digits) == want
    assert max_world_size(granularity, dtype, digits) == want
    if granularity == 30:
        assert max_world_size(payload_dtype=dtype, digits_per_word=digits) == want
    plan_thc_layout(64, want, granularity, payload_dtype=dtype, digits_per_word=digits)
    with pytest.raises(ValueError, match=f"allows at most {want} ranks"):
        plan_thc_layout(64, want + 1, granularity, payload_dtype=dtype, digits_per_word=digits)


def test_one_more_rank_than_the_fingerprint_allows_is_refused_as_such():
    """65535 ranks: 65535 (2^20 - 1) exceeds 2^52 // 65539, so the header's fingerprint sum would not stay
    exact (every other limit holds at granularity 1)."""
    assert 65534 * ((1 << 20) - 1) <= exact_limit(65534, torch.float64) < 65535 * ((1 << 20) - 1)
    with pytest.raises(ValueError, match="fingerprint sum would not stay exact"):
        plan_thc_layout(64, 65535, 1)


def test_a_digit_base_of_exactly_two_to_the_32_is_refused():
    """The digit base n g + 1 must stay below 2^32: g = 65535 = (2^32 - 1) / 65537 allows 65536 int64 ranks
    (base 2^32 - 65535), and at 65537 ranks the base is 2^32 itself, refused."""
    assert 65537 * 65535 + 1 == 1 << 32
    assert plan_thc_layout(64, 65536, 65535, payload_dtype=torch.int64).base == (1 << 32) - 65535
    with pytest.raises(ValueError, match="does not fit the kernels' 32 bits"):
        plan_thc_layout(64, 65537, 65535, payload_dtype=torch.int64)
    assert max_world_size(65535, torch.int64) == 65536


def test_a_layout_is_an_immutable_value():
    """A THCLayout is a value (frozen): its fields cannot be reassigned under the codec that sized its
    buffers from them, and equal configurations give equal, hashable layouts."""
    import dataclasses
    L = plan_thc_layout(5000, 8, 30)
    with pytest.raises(dataclasses.FrozenInstanceError):
        L.words = 1
    assert L == plan_thc_layout(5000, 8, 30) and hash(L) == hash(plan_thc_layout(5000, 8, 30))
    assert len({L, plan_thc_layout(5000, 8, 30), plan_thc_layout(5000, 8, 29)}) == 2


@pytest.mark.parametrize("numel,block", [(1, 1), (3, 4), (100, 128), (1024, 1024), (1025, 1024), (3000, 1024)])
def test_block_is_the_next_power_of_two_up_to_hadamard_block(numel, block):
    """block = min(hadamard_block, next power of two >= numel) and padded = numel rounded up to whole blocks."""
    L = plan_thc_layout(numel, 2, 30)
    assert (L.block, L.padded) == (block, -(-numel // block) * block)


def test_one_digit_per_word_is_a_valid_lane_width():
    """digits_per_word is any positive integer: 1 gives one level a word (words = padded coordinates) and
    allows every world size the fingerprint allows at granularity 1; 0 is refused, not taken as None."""
    L = plan_thc_layout(3000, 2, 30, digits_per_word=1)
    assert (L.per_word, L.group_blocks, L.words) == (1, 1, 3072)
    assert max_world_size(1, torch.float64, 1) == 65534
    for bad in (0, -1):   # not "as many as fit" (that is None)
        with pytest.raises(ValueError, match="digits_per_word must be None \\(as many as fit\\) or a positive integer"):
            plan_thc_layout(3000, 2, 30, digits_per_word=bad)


def test_an_int64_fingerprint_sum_is_refused_only_past_its_own_limit():
    """int64 words hold the fingerprint sum n (2^20 - 1) up to 2^63 - 1: 2^43 ranks (2^43 (2^20 - 1) < 2^63) are
    refused for their digit base, past the kernels' 32 bits, not for the fingerprint; the first n whose sum
    exceeds 2^63 - 1 is refused for the fingerprint."""
    fits = ((1 << 63) - 1) // ((1 << 20) - 1)
    assert (1 << 43) < fits and fits * ((1 << 20) - 1) <= (1 << 63) - 1
    with pytest.raises(ValueError, match="does not fit the kernels' 32 bits"):
        plan_thc_layout(64, 1 << 43, 1, payload_dtype=torch.int64)
    with pytest.raises(ValueError, match="fingerprint sum would not stay exact"):
        plan_thc_layout(64, fits + 1, 1, payload_dtype=torch.int64)
