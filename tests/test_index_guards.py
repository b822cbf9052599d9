"""The index stage's consistency checks that neither the key total nor the index checksum stands in
for: each payload below is a valid SUM of N ranks with one inconsistency forged into its index and,
where the key total or the checksum would see it, the header forged to agree with the index's digits
and the support it decodes to, so that only the check under test can tell. The two bounds on how many
nodes an index may list come before the fine tables are peeled: without them those payloads fail as
INDEX_PEEL_FAILED, a capacity status. The CPU decoder reports INDEX_CORRUPT and the reference that
check's own reason."""
import numpy as np
import torch

import helpers
from lossless_hc import LosslessCodec
from lossless_hc.lhc import reference
from lossless_hc.lhc.layout import HDR_INDEX_CHECK0, HDR_KEYS_LO, INDEX_CHECK_PRIMES
from lossless_hc.lhc.sizing import build_layout
from lossless_hc.lhc.status import DecodeStatus

N = 2


def with_header(L, payload: torch.Tensor, count: int, key=None) -> torch.Tensor:
    """``payload`` (a SUM of N ranks) with ``count`` more keys in the header's key total (``count`` may
    be negative) and, given ``key``, ``count`` more holders of it in the index checksum."""
    p = payload.clone()
    p[HDR_KEYS_LO] += count
    if key is not None:
        parts = reference.index_check_parts(L, torch.tensor([key]))[0].tolist()
        for f, prime in enumerate(INDEX_CHECK_PRIMES):
            p[HDR_INDEX_CHECK0 + f] = (int(p[HDR_INDEX_CHECK0 + f]) + count * parts[f]) % prime
    return p


def assert_index_corrupt(codec, payload, reason):
    _, rep = codec.decode(payload)
    _, info = reference.decode(codec.layout, payload)
    assert info["reason"] == reason, info["reason"]
    assert rep.status == DecodeStatus.INDEX_CORRUPT, rep.reason


# -- multilevel: a node's pattern digits are its children's counts ------------------------------------

def multilevel_case(numel=20_000):
    """One fine level (nodes of 11 keys; the last holds 2); rank 0 holds key 0 and the last two keys,
    rank 1 key 0: node 0 and key 0 have count 2, the last node and its two keys count 1."""
    L = build_layout("multilevel", numel, N, 40, 1, 3, None, (1,))
    assert len(L.multilevel.levels) == 1 and L.num_keys % L.multilevel.levels[0].span == 2
    codec = helpers.codec_for(L)
    xs = [torch.zeros(numel) for _ in range(N)]
    xs[0][[0, L.num_keys - 2, L.num_keys - 1]] = torch.tensor([1.0, 2.0, 5.0])
    xs[1][0] = 3.0
    payload = sum(codec.encode(x) for x in xs)
    _, rep = codec.decode(payload)
    assert rep.ok, rep.reason
    return codec, payload


def shift_count(L, payload: torch.Tensor, key: int, delta: int) -> torch.Tensor:
    """``payload`` with ``key``'s count in its node's pattern moved by ``delta``: its digit's power added
    to the pattern word, times the node's sign, in each of the node's three fine cells (any node
    sharing them keeps its own pattern). ``key`` may lie past the last key."""
    lv = L.multilevel.levels[0]
    node, child = divmod(key, lv.span)
    word, digit = divmod(child, lv.digits_per_word)
    cells, signs = reference.key_cells(lv.table, torch.tensor([node]))
    p = payload.clone()
    for c, s in zip(cells[0].tolist(), signs[0].tolist()):
        p[L.level_offsets[0] + c * lv.words_per_group + word] += s * delta * L.index.base ** digit
    return p


def test_a_child_held_by_more_ranks_than_its_node_is_corrupt():
    """The last key counted twice under a node one rank holds: a child's ranks all hold its node."""
    codec, payload = multilevel_case()
    L = codec.layout
    p = with_header(L, shift_count(L, payload, L.num_keys - 1, 1), 1, L.num_keys - 1)
    assert_index_corrupt(codec, p, "index corrupt: child counts disagree with their node's count")


def test_children_fewer_than_their_node_s_count_are_corrupt():
    """Key 0 counted once under a node both ranks hold (each of them holds some key under it). The last
    node's two keys sum to more than its count, as they may, so the nodes' counts stay within the total."""
    codec, payload = multilevel_case()
    L = codec.layout
    p = with_header(L, shift_count(L, payload, 0, -1), -1, 0)
    assert_index_corrupt(codec, p, "index corrupt: child counts disagree with their node's count")


def test_a_child_past_the_last_key_is_corrupt():
    """A count for key num_keys, a digit of the last node's pattern that names no key (it would reach
    the value peel and the output past their ends)."""
    codec, payload = multilevel_case()
    L = codec.layout
    assert L.num_keys % L.multilevel.levels[0].span
    p = with_header(L, shift_count(L, payload, L.num_keys, 1), 1, L.num_keys)
    assert_index_corrupt(codec, p, "index corrupt: a child past the last")



def test_more_non_zero_nodes_than_keys_is_corrupt():
    """Coarse digits of 1 at every node (1,819) under a key total of 4: each rank's non-zero nodes are at
    most its keys. INDEX_CORRUPT, not the peel failure so many nodes cause in the fine table (a capacity
    status, for which the training policy would grow the codec)."""
    codec, payload = multilevel_case()
    L = codec.layout
    p = payload.clone()
    for word in range(L.index.words):
        digits = min(L.index.per_word, L.index.digits - word * L.index.per_word)
        p[L.index_offset + word] = (L.index.base ** digits - 1) // (L.index.base - 1)   # digits of 1
    assert_index_corrupt(codec, p, "index corrupt: more non-zero nodes than keys")


def test_more_non_zero_children_than_keys_is_corrupt():
    """Two fine levels; the first level's patterns taken from inputs in which each rank holds a key
    under every child of the nodes it holds: every count fits its node's, but the children (~11 per
    node) outnumber the keys. INDEX_CORRUPT, not the next level's peel failure (a capacity status)."""
    numel, k = 50_000, 40
    codec = LosslessCodec(numel, N, k, index="multilevel", seed=1)
    L = codec.layout
    lv = L.multilevel.levels
    assert len(lv) == 2 and lv[0].children == 11
    rng = np.random.default_rng(helpers.stable_seed("more children than keys"))
    xs = helpers.make_inputs(rng, numel, 1, N, k, "random", "normal")
    spread = []
    for x in xs:
        s = torch.zeros(numel)
        for node in set((torch.nonzero(x).reshape(-1) // lv[0].span).tolist()):
            under = node * lv[0].span + lv[1].span * torch.arange(lv[0].children)
            s[under[under < numel]] = 1.0
        spread.append(s)
    payload = sum(codec.encode(x) for x in xs)
    first = slice(L.level_offsets[0], L.level_offsets[1])
    p = payload.clone()
    p[first] = sum(codec.encode(s) for s in spread)[first]
    assert_index_corrupt(codec, p, "index corrupt: more non-zero children than keys")


# -- Bloom: counters of the keys' three cells, peeled in integers ------------------------------------

def bloom_case(share=None):
    """A Bloom index (3 x 1,169 counters) and N ranks holding the same keys (count N each): four keys
    whose counters are all their own, or with ``share`` (a key) three keys, each sharing one of
    ``share``'s counters and no other. Returns (codec, the SUM, the keys, every key's counters)."""
    codec = LosslessCodec(20_000, N, 40, index="bloom", seed=5)
    L = codec.layout
    cells = reference.key_cells(L.bloom, torch.arange(L.num_keys))[0].numpy()
    used = set() if share is None else set(cells[share].tolist())
    keys = []
    for j in range(3) if share is not None else [None] * 4:
        for k in range(L.num_keys):
            own = [c for s, c in enumerate(cells[k].tolist()) if s != j]
            if k != share and (j is None or cells[k, j] == cells[share, j]) and not used & set(own):
                used |= set(cells[k].tolist())
                keys.append(k)
                break
    x = torch.zeros(L.numel)
    x[keys] = torch.arange(1.0, len(keys) + 1.0)
    payload = sum(codec.encode(x) for _ in range(N))
    _, rep = codec.decode(payload)
    assert rep.ok and rep.support == len(keys), rep.reason
    return codec, payload, keys, cells


def add_counters(L, payload: torch.Tensor, cells, delta: int) -> torch.Tensor:
    """``payload`` with ``delta`` added to each Bloom counter in ``cells`` (no carry: it stays a digit)."""
    p = payload.clone()
    for cell in cells:
        word, digit = divmod(int(cell), L.index.per_word)
        p[L.index_offset + word] += delta * L.index.base ** digit
    return p


def test_a_bloom_key_held_by_more_ranks_than_there_are_is_corrupt():
    """One more on each of a key's three counters: a count of N + 1."""
    codec, payload, keys, cells = bloom_case()
    L = codec.layout
    p = with_header(L, add_counters(L, payload, cells[keys[0]], 1), 1, keys[0])
    assert_index_corrupt(codec, p, "index corrupt: a key held by more than world_size ranks")


def test_a_bloom_counter_going_negative_is_corrupt():
    """One less on each counter of key 0, whose three counters each hold another key (count N): key 0
    stays a candidate (N - 1 in each) and the counts solve as -1 for it, +N for the others; peeling
    the others first takes its counters below 0."""
    share = 0
    codec, payload, keys, cells = bloom_case(share)
    L = codec.layout
    p = with_header(L, add_counters(L, payload, cells[share], -1), -1, share)
    assert_index_corrupt(codec, p, "index corrupt: negative counter while peeling")


def test_bloom_counters_left_after_peeling_are_corrupt():
    """3 more on a counter a key is not read from (its first counter is read: all are its own), and the
    key total one more: the same keys and counts, and 3 left in that counter."""
    codec, payload, keys, cells = bloom_case()
    L = codec.layout
    p = with_header(L, add_counters(L, payload, [cells[keys[0], 1]], 3), 1)
    assert_index_corrupt(codec, p, "index corrupt: counters left after peeling")


def test_a_bloom_digit_past_the_last_counter_is_corrupt():
    """3 in a digit of the last index word that is no counter (the key total one more)."""
    codec, payload, keys, cells = bloom_case()
    L = codec.layout
    assert L.bloom.cells % L.index.per_word
    p = with_header(L, add_counters(L, payload, [L.bloom.cells], 3), 1)
    assert_index_corrupt(codec, p, "index corrupt: digit out of range")


def test_a_bitmap_digit_past_the_last_key_is_corrupt():
    """A count for key num_keys, a digit of the last index word that names no key."""
    codec = LosslessCodec(20_000, N, 40, index="bitmap", seed=5)
    L = codec.layout
    assert L.num_keys % L.index.per_word
    x = torch.zeros(L.numel)
    x[[3, 19_999]] = 1.0
    payload = sum(codec.encode(x) for _ in range(N))
    word, digit = divmod(L.num_keys, L.index.per_word)
    payload[L.index_offset + word] += L.index.base ** digit
    assert_index_corrupt(codec, with_header(L, payload, 1, L.num_keys), "index corrupt: digit out of range")
