"""The payload layout of the lossless codec: what a payload holds and where.

A :class:`PayloadLayout` is a pure function of the configuration (numel, world size, capacity, block
size, seed; see :mod:`lossless_hc.lhc.sizing` for how big each table is), so every rank derives the
same layout and the same payload shape without communicating.

Payload (float32, ``payload_numel`` elements)::

    [ header: HEADER_FIELDS ints ][ index words ][ fine tables (multilevel only) ]
        [ value sketch: cells x block floats ][ mass: cells floats ]

* header -- small integers each rank contributes (contributor count 1, configuration fingerprint,
  its number of non-zero keys, overload/non-finite/saturation flags, the index checksum). Their SUM
  tells the decoder how many ranks contributed and whether they agree on the configuration; the
  index checksum -- per rank ``(sum over its non-zero keys k of part_f(k)) mod p_f`` for the primes
  ``INDEX_CHECK_PRIMES`` -- lets it check the decoded support's per-key counts: their
  ``sum_k count(k) part_f(k) mod p_f`` must equal the aggregated field's, which a support that differs
  from the true one fails but with probability ``1 / (2039 * 2029) < 2**-21.9`` (see csrc/lhc_layout.h).
* index -- which keys are non-zero on at least one rank, summable by plain SUM:
  ``bitmap``: one counter per key; ``bloom``: a counting Bloom filter whose counters are peeled
  exactly (see ``bloom_table_for``); ``multilevel``: a counting bitmap over nodes of keys, then signed
  fine tables of the nodes' child patterns peeled exactly in integers (see ``multilevel_plan``);
  ``dense``: no index, the raw values follow the header.
* sketch -- a Count Sketch of the values: key ``k`` adds ``w_j(k) * x[k]`` into cell ``h_j(k)`` for
  j = 0, 1, 2, with signs ``w_j(k)`` = +-1 (+-1, +-2 in a small weighted table) (see csrc/lhc_layout.h for the hash family and the segmented table).
* mass -- one float per sketch cell: key ``k`` adds ``|w_j(k)| * max_l |x[k, l]|`` (its block's largest
  magnitude) into cell ``h_j(k)``. Sums of non-negative terms do not cancel, so the aggregated mass
  is an upper bound (up to a relative ``(deg + n) 2^-24``) on what every coordinate of the cell
  summed in absolute value: the decoder's per-key error bound and residual check are built on it
  (see ``LosslessCodec``). The ``dense`` kind has none.

Integer fields are packed as digits, ``per_word`` digits of base ``base`` per float32 word with
``base ** per_word <= 2**22``: the sum over ranks of a digit never reaches ``base`` (the base is
one more than the largest possible aggregate), so no digit carries into the next, and the whole word
stays below ``2**22``, where float32 sums are exact and an average is invertible (see
``INT_FIELD_BITS``).
"""
from __future__ import annotations

import numbers

from dataclasses import dataclass, field
from typing import Optional

HEADER_FIELDS = 11
INT_FIELD_BITS = 22
INT_FIELD_LIMIT = 1 << INT_FIELD_BITS
CHUNK_BITS = 11
MAX_WORLD_SIZE = 1024           # 11-bit header chunks summed over ranks stay below 2**21
# Key positions are 32-bit in the peeling tables; the headroom keeps the CPU decoder's 32-bit loops over
# keys (chunks of 4096, csrc/cpu/peel.cpp) and its bitmap scan's positions in a last word past the final
# key (csrc/cpu/support.cpp) from wrapping.
MAX_KEYS = (1 << 32) - (1 << 12)
LAYOUT_VERSION = 7             # joins every fingerprint; history in docs/DESIGN.md ("Layout versions")

# Header field positions (mirror csrc/lhc_layout.h).
HDR_CONTRIBUTORS, HDR_FP_LO, HDR_FP_HI, HDR_KEYS_LO, HDR_KEYS_MID, HDR_KEYS_HI = range(6)
HDR_OVERLOADED, HDR_NON_FINITE, HDR_SATURATED = 6, 7, 8
HDR_INDEX_CHECK0, HDR_INDEX_CHECK1 = 9, 10
INDEX_CHECK_PRIMES = (2039, 2029)   # lhc::index_check_prime

INDEX_KINDS = ("dense", "bitmap", "bloom", "multilevel")
INDEX_KIND_CODE = {"dense": 0, "bitmap": 1, "bloom": 2, "multilevel": 3}

SALT_SKETCH = 0x5CE7C4A11
SALT_BLOOM = 0xB100F11
SALT_FINE = 0xF1E7AB1E
SALT_INDEX_CHECK = 0x1DC4EC5     # the index checksum's stream: stream_seed(sketch stream, this salt)
# Segments are at most this long: the decoders pack a cell's offset and its 2-bit weight code into
# 32 bits (lhc::kMaxSegLen).
MAX_SEG_LEN = 1 << 30

_MASK64 = (1 << 64) - 1


def mix64(z: int) -> int:
    """splitmix64's finalizer on Python ints; identical to ``lhc::mix64``."""
    z &= _MASK64
    z ^= z >> 30
    z = (z * 0xBF58476D1CE4E5B9) & _MASK64
    z ^= z >> 27
    z = (z * 0x94D049BB133111EB) & _MASK64
    z ^= z >> 31
    return z


def stream_seed(seed: int, salt: int) -> int:
    return mix64((seed & _MASK64) ^ mix64(salt))


def index_check_stream(layout: "PayloadLayout") -> int:
    """The index checksum's hash stream of ``layout`` (``lhc::index_check_stream``)."""
    return stream_seed(layout.sketch.stream, SALT_INDEX_CHECK)


@dataclass(frozen=True)
class SegmentedTable:
    """``seg_count = 3 * groups`` segments of ``seg_len`` cells; a key hashes to one group and hits
    one cell in each of its three segments (one group: the classic three sub-tables)."""

    seg_len: int
    seg_count: int
    stream: int
    weighted: bool = False   # value sketch only: weights +-1, +-2 instead of signs (sketch_table_for)

    @property
    def cells(self) -> int:
        return self.seg_len * self.seg_count


@dataclass(frozen=True)
class DigitPacking:
    """``digits`` counters of base ``base``, ``per_word`` of them per float32 word."""

    base: int
    per_word: int
    digits: int

    @property
    def words(self) -> int:
        return -(-self.digits // self.per_word) if self.digits else 0


def digit_packing(max_aggregate: int, digits: int) -> DigitPacking:
    """Pack counters whose aggregate never exceeds ``max_aggregate`` as densely as exactness allows."""
    base = max_aggregate + 1
    if base > INT_FIELD_LIMIT:
        raise ValueError(f"a counter of up to {max_aggregate} does not fit an exact float32 field")
    per_word = 0
    while base ** (per_word + 1) <= INT_FIELD_LIMIT:
        per_word += 1
    return DigitPacking(base=base, per_word=per_word, digits=digits)

MAX_FINE_LEVELS = 4             # fine tables of a multilevel index (mirrors lhc::kMaxFineLevels)


@dataclass(frozen=True)
class FineLevel:
    """One fine table of a multilevel index: a node covers ``span`` consecutive keys and has
    ``digits_per_word * words_per_group`` children (keys at the finest level, else nodes of the next
    finer level), one base-(n+1) digit each."""

    digits_per_word: int     # w: pattern digits per fine word
    words_per_group: int     # fine words per cell (one node's pattern)
    span: int                # keys under one node
    num_nodes: int           # ceil(num_keys / span)
    planned_nodes: int       # non-zero nodes the table is sized for
    load_cap: int            # non-zero nodes per cell the word headroom allows
    table: SegmentedTable

    @property
    def children(self) -> int:
        return self.digits_per_word * self.words_per_group

    @property
    def numel(self) -> int:
        return self.table.cells * self.words_per_group


@dataclass(frozen=True)
class MultilevelPlan:
    """Shape of a multilevel index (see :func:`multilevel_plan`): a coarse counting bitmap over the
    nodes of ``levels[0]``, then the fine tables, coarsest first; the last one's children are keys."""

    levels: tuple
    coarse: DigitPacking

    # The finest level's shape (the common one-level case reads these).
    @property
    def group_keys(self) -> int:
        return self.levels[-1].children

    @property
    def digits_per_word(self) -> int:
        return self.levels[-1].digits_per_word

    @property
    def words_per_group(self) -> int:
        return self.levels[-1].words_per_group

    @property
    def load_cap(self) -> int:
        return self.levels[-1].load_cap

    @property
    def fine(self) -> SegmentedTable:
        return self.levels[-1].table

    @property
    def num_groups(self) -> int:
        return self.coarse.digits

    @property
    def fine_numel(self) -> int:
        return sum(lv.numel for lv in self.levels)

@dataclass(frozen=True)
class PayloadLayout:
    """The complete, rank-independent description of one codec's payload."""

    numel: int
    block: int
    num_keys: int
    world_size: int
    capacity: int            # non-zero keys per rank the codec is sized for
    union_keys: int          # keys the sketch is sized for: min(num_keys, world_size * capacity), or
                             # min(num_keys, ceil(union_nnz / block)) when union_nnz is given
    index_kind: str
    seed: int
    sketch: SegmentedTable
    bloom: Optional[SegmentedTable]
    index: DigitPacking
    digit_cap: int
    fingerprint: int = field(default=0)
    multilevel: Optional[MultilevelPlan] = None   # index_kind "multilevel" only (index = its coarse level)
    # Which hash stream each table took where the seed's own had an unsolvable pair
    # (sizing.with_solvable_streams): the attempt of the sketch, then of each fine level, coarsest
    # first; () where every table kept the seed's stream.
    reseeded: tuple = ()

    @property
    def index_offset(self) -> int:
        return HEADER_FIELDS

    @property
    def fine_offset(self) -> int:
        """First word of the multilevel fine table (= sketch_offset for the other kinds)."""
        return HEADER_FIELDS + self.index.words

    @property
    def fine_numel(self) -> int:
        return self.multilevel.fine_numel if self.multilevel is not None else 0

    @property
    def level_offsets(self) -> tuple:
        """First word of each multilevel fine table (coarsest first)."""
        out, off = [], self.fine_offset
        for lv in (self.multilevel.levels if self.multilevel is not None else ()):
            out.append(off)
            off += lv.numel
        return tuple(out)

    @property
    def sketch_offset(self) -> int:
        return HEADER_FIELDS + self.index.words + self.fine_numel

    @property
    def mass_offset(self) -> int:
        """First word of the mass channel: one float per sketch cell, after the value sketch."""
        return self.sketch_offset + self.sketch.cells * self.block

    @property
    def payload_numel(self) -> int:
        if self.index_kind == "dense":
            return HEADER_FIELDS + self.numel
        return self.mass_offset + self.sketch.cells

    @property
    def wire_bytes(self) -> int:
        return 4 * self.payload_numel


def _fingerprint(*values: int) -> int:
    h = 0x1A5E_55_C0DEC
    for v in values:
        h = mix64(h ^ (v & _MASK64))
    return h & ((1 << (2 * CHUNK_BITS)) - 1)


def layout_fingerprint(L: PayloadLayout) -> int:
    bloom, m = L.bloom, L.multilevel
    values = [LAYOUT_VERSION, L.numel, L.block, L.world_size, L.capacity, INDEX_KIND_CODE[L.index_kind], L.seed,
              L.sketch.seg_len, L.sketch.seg_count, bloom.cells if bloom else 0, L.index.base, L.digit_cap,
              int(L.sketch.weighted)]
    if m is not None:  # the multilevel shape joins the hash (other kinds keep their fingerprints)
        values += [L.union_keys, len(m.levels)]
        for lv in m.levels:
            values += [lv.span, lv.digits_per_word, lv.words_per_group, lv.table.seg_len, lv.table.seg_count]
    # Other streams than the seed's join the hash (the layouts that keep them keep their fingerprints):
    # a rank that did not re-seed a table then fails the header's check instead of adding other cells.
    values += list(L.reseeded)
    return _fingerprint(*values)


def options_fingerprint(fingerprint: int, *options: int) -> int:
    """A layout's fingerprint with decode options mixed in (a codec's, when its options are not the
    defaults): payloads of ranks configured differently then fail the header's fingerprint check."""
    return _fingerprint(fingerprint, *options)


def check_uint64(value, name: str) -> int:
    """``value`` (a seed or hash stream, the kernels' ``uint64_t``), else TypeError unless it is an int
    (bool refused) and ValueError outside [0, 2**64): one outside would alias one inside (s and
    s + 2**64 hash alike), so ranks that meant different seeds would silently agree. The one check of
    every codec's and adapter's seeds."""
    check_int(value, name)
    if not 0 <= value < (1 << 64):
        raise ValueError(f"{name} must be an integer in [0, 2**64), got {value!r}")
    return value


def check_int(value, name: str, none: bool = False, least: Optional[int] = None) -> None:
    """TypeError unless ``value`` is an int (bool refused: True would pass as 1 silently), or None
    where ``none`` allows it; ValueError below ``least``, where given."""
    if none and value is None:
        return
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name} must be an int{' or None' if none else ''}, got {type(value).__name__}")
    if least is not None and value < least:
        raise ValueError(f"{name} must be an integer >= {least}, got {value}")


def is_real(value) -> bool:
    """Whether ``value`` is a real number (int, float, NumPy's scalars: ``numbers.Real``), bool refused
    (True would pass as 1 silently): the type test of every numeric option whose range its caller
    checks, and which it then takes as ``float(value)``."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def check_fraction(what: str, v) -> float:
    """``v`` as a float, else ValueError unless it is a real number in (0, 1] (bool refused)."""
    if not is_real(v) or not 0.0 < v <= 1.0:
        raise ValueError(f"{what} must be a number in (0, 1], got {v!r}")
    return float(v)


def check_args(numel, world_size, max_nnz, block_size, seed, union_nnz) -> None:
    for name, value in (("numel", numel), ("world_size", world_size), ("max_nnz", max_nnz),
                        ("block_size", block_size)):
        check_int(value, name)
    check_uint64(seed, "seed")
    check_int(union_nnz, "union_nnz", none=True)
    if numel < 0:
        raise ValueError(f"numel must be >= 0, got {numel}")
    if not 1 <= world_size <= MAX_WORLD_SIZE:
        raise ValueError(f"world_size must be in [1, {MAX_WORLD_SIZE}], got {world_size}")
    if max_nnz < 0:
        raise ValueError(f"max_nnz must be >= 0, got {max_nnz}")
    if union_nnz is not None and union_nnz < 0:
        raise ValueError(f"union_nnz must be >= 0, got {union_nnz}")
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    num_keys = -(-numel // block_size)
    if num_keys > MAX_KEYS:
        raise ValueError(f"numel / block_size = {num_keys} keys exceeds the supported {MAX_KEYS}")


# The layout ABI (lhc::LayoutWord, csrc/lhc_layout.h): every backend's kernels receive a layout as
# these uint64 words, in this order -- the codec's, then FINE_LEVEL_WORDS per multilevel fine level
# for MAX_FINE_LEVELS levels.
FINE_LEVEL_WORDS = ("seg_len", "seg_count", "stream", "span", "digits", "words", "offset")
LAYOUT_WORDS = (("numel", "num_keys", "block", "index_kind", "sketch_seg_len", "sketch_seg_count", "sketch_stream",
                 "sketch_weighted", "bloom_seg_len", "bloom_seg_count", "bloom_stream", "bloom_weighted",
                 "index_base", "index_per_word", "index_digits", "digit_cap", "capacity", "fingerprint",
                 "index_offset", "sketch_offset", "payload_numel", "fine_levels")
                + tuple(f"fine{level}_{word}" for level in range(MAX_FINE_LEVELS) for word in FINE_LEVEL_WORDS))


def _table_words(t: Optional[SegmentedTable]) -> tuple:
    # A missing table (no Bloom filter) is the shape (1, 3, 0, unweighted), which no kernel reads.
    return (t.seg_len, t.seg_count, t.stream, int(t.weighted)) if t is not None else (1, 3, 0, 0)


def layout_words(L: PayloadLayout) -> list:
    """``L`` as the layout ABI: one uint64 word per name of LAYOUT_WORDS, each given as its int64 bit
    pattern (two's complement), so that a torch.int64 tensor carries it to the kernels unchanged."""
    levels = L.multilevel.levels if L.multilevel is not None else ()
    words = [L.numel, L.num_keys, L.block, INDEX_KIND_CODE[L.index_kind], *_table_words(L.sketch),
             *_table_words(L.bloom), L.index.base, L.index.per_word, L.index.digits, L.digit_cap, L.capacity,
             L.fingerprint, L.index_offset, L.sketch_offset, L.payload_numel, len(levels)]
    for i in range(MAX_FINE_LEVELS):
        if i < len(levels):
            lv = levels[i]
            words += [*_table_words(lv.table)[:3], lv.span, lv.digits_per_word, lv.words_per_group,
                      L.level_offsets[i]]
        else:   # placeholder levels: never read
            words += [1, 3, 0, 1, 1, 1, L.sketch_offset]
    assert len(words) == len(LAYOUT_WORDS)
    return [w - (1 << 64) if w >= 1 << 63 else w for w in (w & _MASK64 for w in words)]
