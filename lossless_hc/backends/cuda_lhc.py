"""The lossless codec on CUDA: the launch sequence of the kernels in
``csrc/cuda/codec_kernels.cuh``, loaded and launched by :mod:`.cuda_runtime`.

Everything is stream-ordered on ``torch.cuda.current_stream()``: scratch memory comes from torch's
caching allocator, memsets are torch ops, kernels take raw addresses (``data_ptr()``) and 64-bit
argument words. Encode never synchronises; decode synchronises once, to read the header and the
kernels' counters together (``DecodeRun.finish``).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from lossless_hc.backends.cuda_runtime import Arena, active_launcher, device_scope, f64_bits, stream_handle
from lossless_hc.lhc.layout import HEADER_FIELDS, LAYOUT_WORDS, PayloadLayout, layout_words


# The value sketch's and the Bloom table's four words (seg_len, seg_count, stream, weighted) are a
# table of their own to the peeling kernels: they take the first word's address.
_SKETCH_TABLE_WORD = LAYOUT_WORDS.index("sketch_seg_len")
_BLOOM_TABLE_WORD = LAYOUT_WORDS.index("bloom_seg_len")

THREADS = 256               # block size of the grid-stride kernels and of the tile kernels
TILE_ITEMS = 256 * 8        # kTileItems
SCAN_THREADS = 1024         # lhc_scan_tiles runs as one block of this size
NOT_PEELED = 0xFFFFFFFF
PAIR_ROUND = 0xFFFFFFFE          # kPairRound: a key solved as part of a two-key stopping set
MAX_POSITIONS = (1 << 32) // 3 - 1   # Bloom candidate positions: 32-bit, 3 x count < 2^32
WEIGHT_CODE_BITS = 2                 # lhc::kWeightCodeBits
# Support key positions of the value peel: its adjacency packs (position << WEIGHT_CODE_BITS) | weight
# code into 32 bits (lhc::gpu::kAdjCodeMask), so positions stay below 2^30 (and 3 x count < 2^32).
MAX_PEEL_POSITIONS = 1 << (32 - WEIGHT_CODE_BITS)

# The lhc::gpu::DecodeFlag bits some kernels take as an argument (the flag they raise). The flags'
# meaning, the status, is decided on the device (lhc_decode_status).
FLAG_CAND_OVERFLOW = 1 << 2
FLAG_COUNT_UNRESOLVED = 1 << 4
FLAG_SUPPORT_OVERFLOW = 1 << 6
FLAG_DEGREE_OVERFLOW = 1 << 7
# The flags of a failed index, which DecodeRun.finish reads to report the CPU backend's counts: the
# words (not packed integers, or digits not summing to the header's total), the Bloom count peel
# (every way it fails), and the index checksum.
FLAG_INDEX_WORD = 1 << 0
FLAG_INDEX_TOTAL = 1 << 1
FLAG_COUNT_BAD = 1 << 3
FLAG_COUNT_LEFTOVER = 1 << 5
FLAG_INDEX_CHECK = 1 << 12
_COUNT_PEEL_FAILED = FLAG_CAND_OVERFLOW | FLAG_COUNT_BAD | FLAG_COUNT_UNRESOLVED | FLAG_COUNT_LEFTOVER

# lhc::gpu::DecodeCounters: 7 uint64 fields, then flags, abort, status and padding (uint32 each, paired
# into int64 words as the host reads them), then the index checksum's 4 uint64 and 2 more = 120 bytes.
_DECODE_COUNTERS = ("index_total", "expected_total", "candidates", "support", "peeled", "count_resolved",
                    "list_count", "flags_abort", "status_pad", "check0", "check1", "expected_check0",
                    "expected_check1", "list_total", "support_total")
_DECODE_COUNTERS_BYTES = 120
# lhc::gpu::MlState: 7 uint64 fields, then 6 uint32 (paired into int64 words as the host reads them).
_ML_STATE = ("coarse_sum", "child_total", "nodes", "prev_nodes", "resolved", "support", "candidates",
             "status_mode", "words_inconsistent", "expand_replay")
_ML_STATE_BYTES = 80
_ENCODE_COUNTERS_BYTES = 32   # lhc::gpu::EncodeCounters
_PEEL_CONTROL_BYTES = 64      # lhc::gpu::PeelControl (40 bytes, padded)

_MASK64 = (1 << 64) - 1


# ------------------------------------------------------------------------------------------------
# layout and scratch
# ------------------------------------------------------------------------------------------------
def _grid(items: int, sms: int) -> int:
    """Blocks of THREADS for a grid-stride loop over ``items``: enough to fill the GPU, no more."""
    return max(1, min(-(-items // THREADS), 16 * sms))


def _tiles(items: int) -> int:
    return max(1, -(-items // TILE_ITEMS))


class CudaLayout:
    """A codec layout on one CUDA device: its layout words (the layout ABI,
    :func:`lossless_hc.lhc.layout.layout_words`) in device memory, and the sizes that the kernels'
    scratch buffers are planned from."""

    def __init__(self, layout: PayloadLayout, device: torch.device):
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.layout = layout
        self.device = device
        L = layout
        self.sketch_cells = L.sketch.cells
        self.bloom_cells = L.bloom.cells if L.bloom is not None else 0
        levels = L.multilevel.levels if L.multilevel is not None else ()
        self.fine_cells = [lv.table.cells for lv in levels]
        if max(self.sketch_cells, self.bloom_cells, *self.fine_cells) >= (1 << 32) - 1:
            raise ValueError("the CUDA backend indexes table cells with 32 bits; this layout has more cells")
        # Keys one decode can hold: the value peel cannot resolve more keys than it has cells (each
        # peel step consumes a pure cell), the count peel likewise. The value peel's adjacency packs a
        # key position with its 2-bit weight code: a sketch that could peel more keys than 2^30
        # positions is refused here rather than failing its decodes at its design load.
        if min(L.num_keys, self.sketch_cells) > MAX_PEEL_POSITIONS:
            raise ValueError(f"the CUDA backend's value peel holds at most {MAX_PEEL_POSITIONS} support keys (key "
                             f"positions packed with a {WEIGHT_CODE_BITS}-bit weight code in 32 bits); this layout's "
                             f"sketch has {self.sketch_cells} cells for {L.num_keys} keys")
        self.key_cap = min(L.num_keys, self.sketch_cells, MAX_PEEL_POSITIONS)
        self.cand_cap = min(L.num_keys, self.bloom_cells, MAX_POSITIONS)
        # Multilevel: the node list of each fine level, likewise bounded by its table's cells (a level
        # with more non-zero nodes cannot peel; the kernels decide its status without the list).
        self.node_caps = [min(lv.num_nodes, lv.table.cells) for lv in levels]
        self.words = torch.tensor(layout_words(L), dtype=torch.int64, device=device)
        # The host emulation (a CPU device) runs every CUDA thread as a host thread: keep grids small.
        self.sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 2

    @property
    def words_ptr(self) -> int:
        return self.words.data_ptr()

    @property
    def sketch_table_ptr(self) -> int:
        return self.words.data_ptr() + 8 * _SKETCH_TABLE_WORD

    @property
    def bloom_table_ptr(self) -> int:
        return self.words.data_ptr() + 8 * _BLOOM_TABLE_WORD

    @property
    def ml_encode_scratch_bytes(self) -> int:
        """The multilevel encode's scratch (lhc::gpu::ml_encode_key_bits / _acc / _flags): a bit per key
        (32-bit words, rounded up to 8 bytes), a 64-bit accumulator per fine word (signed sums, two's
        complement), then a byte per node of every level."""
        L = self.layout
        key_words = -(-L.num_keys // 32)
        return 4 * (-(-key_words // 2) * 2) + 8 * L.fine_numel + sum(lv.num_nodes for lv in L.multilevel.levels)


def decode_scratch_sizes(native: CudaLayout) -> dict:
    """Bytes of every scratch buffer of one decode (see decode)."""
    L = native.layout
    B = L.block
    cells, kcap = native.sketch_cells, native.key_cap
    sizes = {"counters": _DECODE_COUNTERS_BYTES, "control_count": _PEEL_CONTROL_BYTES,
             "control_value": _PEEL_CONTROL_BYTES, "keys": 4 * kcap}
    tiles = [_tiles(cells), _tiles(L.index.words)]
    if L.index_kind == "bloom":
        bcells, ccap = native.bloom_cells, native.cand_cap
        tiles += [_tiles(L.num_keys), _tiles(ccap)]
        for name in ("bcount", "bdeg", "bxr", "bpure0", "bpure1"):
            sizes[name] = 4 * bcells
        for name in ("cand", "csrc", "cround", "ccount", "clist0", "clist1"):
            sizes[name] = 4 * ccap
    elif L.index_kind == "multilevel":
        levels = L.multilevel.levels
        ncap = max(native.node_caps)
        fcells = max(native.fine_cells)
        tiles += [_tiles(ncap)]
        sizes["ml_state"] = _ML_STATE_BYTES
        sizes["ml_control"] = _PEEL_CONTROL_BYTES
        # Two node lists (a level's and its parents'), alternating by level parity.
        for b in (0, 1):
            sizes[f"ml_nodes{b}"] = 4 * ncap
            sizes[f"ml_counts{b}"] = 4 * ncap
            sizes[f"ml_pat{b}"] = 4 * max(c * lv.words_per_group for c, lv in zip(native.node_caps, levels))
        for name in ("ml_src", "ml_round", "ml_list0", "ml_list1"):
            sizes[name] = 4 * ncap
        for name in ("ml_deg", "ml_xr", "ml_pure0", "ml_pure1"):
            sizes[name] = 4 * fcells
        sizes["ml_val"] = 8 * max(lv.table.cells * lv.words_per_group for lv in levels)
        # A claim bit per node, for a level whose non-zero nodes outnumber its cells (peeled by id).
        sizes["ml_claim"] = 4 * max(-(-lv.num_nodes // 32) if lv.num_nodes > lv.table.cells else 0 for lv in levels)
    sizes["tiles"] = 8 * max(tiles)
    for name in ("deg", "xr", "cursor", "stamp", "pure0", "pure1", "dirty0", "dirty1", "reader"):
        sizes[name] = 4 * cells
    sizes["offsets"] = 4 * (cells + 1)
    for name in ("src", "round", "list0", "list1", "order"):
        sizes[name] = 4 * kcap
    sizes["round_start"] = 4 * (kcap + 2)   # rounds <= keys + 1
    sizes["adj"] = 4 * 3 * kcap
    sizes["key_val"] = 8 * kcap * B
    sizes["val"] = 8 * cells * B
    # The error bounds: per cell (acc), per key (key_err, and key_ver: |w| times its verification
    # bound), and the keys failing rtol (inexact flags).
    sizes["acc"] = 8 * cells
    sizes["key_err"] = 8 * kcap
    sizes["key_ver"] = 8 * kcap
    sizes["inexact"] = 4 * kcap
    return sizes


def decode_scratch_bytes(native: CudaLayout) -> int:
    """Device memory one decode borrows from torch's caching allocator."""
    return sum(-(-max(n, 1) // 256) * 256 for n in decode_scratch_sizes(native).values())


def _peel_grid(launch, kernel: str, sms: int) -> int:
    """Blocks of a cooperative (grid-barrier) kernel: all resident at once. A few per SM: enough
    memory parallelism, few enough that a barrier stays cheap. LHC_PEEL_BLOCKS_PER_SM overrides."""
    resident = max(1, launch.resident_blocks(kernel, THREADS))
    wanted = int(os.environ.get("LHC_PEEL_BLOCKS_PER_SM", "4"))
    return sms * max(1, min(resident, wanted))


# ------------------------------------------------------------------------------------------------
# encode
# ------------------------------------------------------------------------------------------------
def encode(native: CudaLayout, x: torch.Tensor, payload: torch.Tensor) -> None:
    """Encode ``x`` (contiguous float32, layout.numel, on the codec's device) into ``payload``
    (contiguous float32, layout.payload_numel). Asynchronous on the current stream."""
    L = native.layout
    launch = active_launcher()
    with device_scope(native.device):
        stream = stream_handle(native.device)
        sms = native.sms
        sizes = {"counters": _ENCODE_COUNTERS_BYTES}
        # The index's own scratch: Bloom's per-rank counters, or the multilevel index's key flags,
        # fine-word accumulators and node flags.
        if L.index_kind == "bloom":
            sizes["index_scratch"] = 4 * native.bloom_cells
        elif L.index_kind == "multilevel":
            sizes["index_scratch"] = native.ml_encode_scratch_bytes
        if L.block > 1:
            sizes["key_flag"] = 4 * L.num_keys
        arena = Arena(sizes, native.device)
        arena.view("counters").zero_()
        payload.zero_()
        scratch = 0
        if "index_scratch" in sizes:
            arena.view("index_scratch").zero_()
            scratch = arena.ptr("index_scratch")
        lay, xp, pp, cnt = native.words_ptr, x.data_ptr(), payload.data_ptr(), arena.ptr("counters")
        if L.block == 1:
            launch.launch("lhc_encode_scan_b1", _grid(-(-L.numel // 4), sms), THREADS, [lay, xp, pp, scratch, cnt],
                          stream)
        else:
            arena.view("key_flag").zero_()
            flags = arena.ptr("key_flag")
            launch.launch("lhc_encode_flag_blocks", _grid(L.numel, sms), THREADS, [lay, xp, flags, cnt], stream)
            launch.launch("lhc_encode_keys", _grid(L.num_keys, sms), THREADS, [lay, xp, flags, pp, scratch, cnt],
                          stream)
            launch.launch("lhc_encode_scatter_blocks", _grid(L.numel, sms), THREADS, [lay, xp, flags, pp], stream)
        if L.index_kind == "bloom":
            launch.launch("lhc_encode_bloom_pack", _grid(L.index.words, sms), THREADS, [lay, scratch, pp, cnt], stream)
        elif L.index_kind == "multilevel":
            nodes = sum(lv.num_nodes for lv in L.multilevel.levels)
            launch.launch("lhc_ml_encode_keys", _grid(-(-L.num_keys // 32), sms), THREADS, [lay, scratch], stream)
            launch.launch("lhc_ml_encode_nodes", _grid(nodes, sms), THREADS, [lay, scratch, pp], stream)
            launch.launch("lhc_ml_encode_pack", _grid(L.fine_numel, sms), THREADS, [lay, scratch, pp], stream)
        launch.launch("lhc_encode_header", 1, 32, [lay, pp, cnt], stream)


# ------------------------------------------------------------------------------------------------
# decode
# ------------------------------------------------------------------------------------------------
@dataclass
class DecodeStats:
    """What the CUDA decode found (the fields of the CPU backend's DecodeStats)."""

    status: int
    candidates: int
    false_positives: int
    support_keys: int
    peeled: int
    index_total: int
    flags: int


class DecodeRun:
    """A decode whose kernels are queued; ``finish`` reads header and counters with one sync."""

    def __init__(self, native: CudaLayout, payload: torch.Tensor, arena: Arena):
        self.native, self.payload, self.arena = native, payload, arena

    def finish(self):
        """(header field values as floats, DecodeStats). Synchronises the stream once."""
        kind = self.native.layout.index_kind
        parts = [self.payload[:HEADER_FIELDS].to(torch.float64), self.arena.view("counters", torch.int64)]
        if kind == "multilevel":
            parts.append(self.arena.view("ml_state", torch.int64))
        # Every counter is below 2^53: exact as float64, and one transfer.
        summary = torch.cat([t.to(torch.float64) for t in parts]).tolist()
        header = summary[:HEADER_FIELDS]
        values = [int(v) for v in summary[HEADER_FIELDS:]]
        c = dict(zip(_DECODE_COUNTERS, values))
        flags = c["flags_abort"] & 0xFFFFFFFF
        status = c["status_pad"] & 0xFFFFFFFF     # lhc_decode_status's verdict
        support, peeled = c["support_total"], c["peeled"]   # the CPU's count, beyond the peel's list too
        candidates = c["candidates"]
        false_positives = max(0, candidates - support) if kind == "bloom" else 0
        if kind == "multilevel":
            ml = dict(zip(_ML_STATE, values[len(_DECODE_COUNTERS):]))
            failed = ml["status_mode"] & 0xFFFFFFFF or flags & FLAG_INDEX_CHECK
            # As the CPU backend: a failed index (its checksum included) reports no support (and
            # candidates only once the support is known, i.e. for the last checks, the key total and
            # the checksum); the support count is exact even where the value peel's list overflowed.
            candidates = ml["candidates"]
            support = 0 if failed else ml["support"]
            peeled = 0 if failed else peeled
        elif flags & (FLAG_INDEX_WORD | FLAG_INDEX_TOTAL | _COUNT_PEEL_FAILED | FLAG_INDEX_CHECK):
            # As the CPU backend: a failed index reports no support; candidates only where every word
            # was valid (Bloom: and the digits summed to the header's total, checked first there);
            # false positives only after a complete count peel (then the index checksum failed).
            support = peeled = 0
            if flags & (FLAG_INDEX_WORD | (FLAG_INDEX_TOTAL if kind == "bloom" else 0)):
                candidates = 0
            if flags & (FLAG_INDEX_WORD | FLAG_INDEX_TOTAL | _COUNT_PEEL_FAILED):
                false_positives = 0
        st = DecodeStats(status=status, candidates=candidates, false_positives=false_positives,
                         support_keys=support, peeled=peeled, index_total=c["index_total"], flags=flags)
        return header, st

    def inexact_keys(self, support: int) -> torch.Tensor:
        """The keys whose error bound exceeds rtol (sorted int64, on the CPU); synchronises."""
        a = self.arena
        n = min(support, self.native.key_cap)
        keys = a.view("keys", torch.int32)[:n].to(torch.int64) & 0xFFFFFFFF
        flagged = a.view("inexact", torch.int32)[:n] != 0
        return torch.sort(keys[flagged]).values.cpu()

    def error_bounds(self, support: int):
        """(keys, E): the support keys (sorted int64) and each one's error bound (float64, key_err), CPU
        tensors; meaningful after a decode that recovered every key. Synchronises."""
        a = self.arena
        n = min(support, self.native.key_cap)
        keys = a.view("keys", torch.int32)[:n].to(torch.int64) & 0xFFFFFFFF
        bounds = a.view("key_err", torch.float64)[:n]
        order = torch.argsort(keys)
        return keys[order].cpu(), bounds[order].cpu()

    def trace(self, support: int):
        """(keys, cells) of the peeled keys, in an order in which they can be peeled: by round, then
        key. A key read in round r from cell c had every other key of c peeled in an earlier round;
        the keys of solved pairs (round ``PAIR_ROUND``) come last, with their first cell."""
        a = self.arena
        n = min(support, self.native.key_cap)
        keys = a.view("keys", torch.int32)[:n].to(torch.int64) & 0xFFFFFFFF
        rounds = a.view("round", torch.int32)[:n].to(torch.int64) & 0xFFFFFFFF
        cells = a.view("src", torch.int32)[:n].to(torch.int64) & 0xFFFFFFFF
        done = rounds != NOT_PEELED
        keys, rounds, cells = keys[done], rounds[done], cells[done]
        # By round, then key: one int64 sort key, round * 2^32 + key. PAIR_ROUND (0xFFFFFFFE) would
        # overflow it and sort the pairs first; rounds stay below 2^30 (at most one per support key),
        # so the pairs' round becomes 2^31 - 1, above them and within int64.
        rounds = torch.where(rounds == PAIR_ROUND, torch.full_like(rounds, (1 << 31) - 1), rounds)
        order = torch.argsort(rounds * (1 << 32) + keys)
        return keys[order].cpu(), cells[order].cpu()


def decode(native: CudaLayout, scale: float, world_size: int, payload: torch.Tensor, out: torch.Tensor,
           rtol: float = 0.0, verify: bool = False) -> DecodeRun:
    """Queue the decode of ``payload`` (contiguous float32 on the codec's device) into ``out``
    (contiguous float32, numel; overwritten: zeros outside the recovered support, NaN for support
    keys the peel could not recover). Nothing here waits for the device; ``DecodeRun.finish``
    does, once. The kernels never read the header's claims as sizes: every buffer is planned from
    the layout, so any payload (corrupted, fuzzed) is safe to decode."""
    L = native.layout
    launch = active_launcher()
    with device_scope(native.device):
        stream = stream_handle(native.device)
        sms = native.sms
        a = Arena(decode_scratch_sizes(native), native.device)
        # lhc_scan_tiles runs as one block of any multiple of 32 threads up to 1024; a launcher may ask
        # for fewer (the host emulation of the tests, where every thread is an OS thread).
        scan_threads = getattr(launch, "scan_threads", SCAN_THREADS)
        P = lambda name: a.ptr(name)  # noqa: E731
        a.view("counters").zero_()
        a.view("control_count").zero_()
        a.view("control_value").zero_()
        out.zero_()
        lay, pp, cnt = native.words_ptr, payload.data_ptr(), P("counters")
        n = int(world_size)
        s = f64_bits(scale)
        kcap, cells, B = native.key_cap, native.sketch_cells, L.block

        # 1. The support: keys non-zero on at least one rank, in increasing order, in `keys`.
        if L.index_kind == "bitmap":
            tiles = _tiles(L.index.words)
            launch.launch("lhc_bitmap_count", tiles, THREADS, [lay, pp, s, n, P("tiles"), cnt], stream)
            launch.launch("lhc_scan_tiles", 1, scan_threads, [P("tiles"), tiles, kcap, FLAG_SUPPORT_OVERFLOW, cnt, 1],
                          stream)
            launch.launch("lhc_bitmap_write", tiles, THREADS, [lay, pp, s, n, P("tiles"), P("keys"), kcap, cnt], stream)
            launch.launch("lhc_support_ready", 1, 32, [cnt, 1], stream)
        elif L.index_kind == "bloom":
            bcells, ccap = native.bloom_cells, native.cand_cap
            a.view("bcount").zero_()
            launch.launch("lhc_bloom_unpack", _grid(L.index.words, sms), THREADS, [lay, pp, s, n, P("bcount"), cnt],
                          stream)
            tiles = _tiles(L.num_keys)
            launch.launch("lhc_bloom_cand_count", tiles, THREADS, [lay, P("bcount"), P("tiles")], stream)
            launch.launch("lhc_scan_tiles", 1, scan_threads, [P("tiles"), tiles, ccap, FLAG_CAND_OVERFLOW, cnt, 1],
                          stream)
            launch.launch("lhc_bloom_cand_write", tiles, THREADS, [lay, P("bcount"), P("tiles"), P("cand"), ccap, cnt],
                          stream)
            # Exact integer peel of the counters: every candidate's count (false positives: 0).
            a.view("bdeg").zero_()
            a.view("bxr").zero_()
            a.view("csrc").fill_(255)
            a.view("cround").fill_(255)
            a.view("ccount").zero_()
            launch.launch("lhc_build_states", _grid(ccap, sms), THREADS,
                          [native.bloom_table_ptr, P("cand"), P("bdeg"), P("bxr"), cnt, FLAG_COUNT_UNRESOLVED, 1], stream)
            launch.launch("lhc_seed_pure", _grid(bcells, sms), THREADS,
                          [P("bdeg"), bcells, P("bpure0"), P("control_count"), cnt], stream)
            launch.launch("lhc_peel_counts", _peel_grid(launch, "lhc_peel_counts", sms), THREADS,
                          [native.bloom_table_ptr, P("cand"), P("bcount"), P("bdeg"), P("bxr"), P("csrc"), P("cround"),
                           P("ccount"), P("bpure0"), P("bpure1"), P("clist0"), P("clist1"), P("control_count"), cnt, n],
                          stream, cooperative=True)
            launch.launch("lhc_count_check", _grid(max(ccap, bcells), sms), THREADS,
                          [P("bcount"), bcells, P("cround"), cnt], stream)
            launch.launch("lhc_count_verdict", 1, 32, [cnt], stream)
            ftiles = _tiles(ccap)
            launch.launch("lhc_found_count", ftiles, THREADS, [lay, P("cand"), P("ccount"), P("tiles"), cnt], stream)
            launch.launch("lhc_scan_tiles", 1, scan_threads, [P("tiles"), ftiles, kcap, FLAG_SUPPORT_OVERFLOW, cnt, 0],
                          stream)
            launch.launch("lhc_found_write", ftiles, THREADS,
                          [P("cand"), P("ccount"), P("tiles"), P("keys"), kcap, cnt], stream)
            launch.launch("lhc_support_ready", 1, 32, [cnt, 0], stream)
        elif L.index_kind == "multilevel":
            _decode_multilevel(native, launch, stream, a, pp, s, n, scan_threads)
        else:
            raise ValueError(f"the CUDA decode kernels handle bitmap, Bloom and multilevel indexes, not "
                             f"{L.index_kind!r}")

        # 2. The value peel over the support.
        a.view("deg").zero_()   # (xr needs no zeroing: lhc_sort_adjacency writes it for every cell)
        a.view("cursor").zero_()
        a.view("stamp").fill_(255)
        a.view("src").fill_(255)
        a.view("round").fill_(255)
        tbl = native.sketch_table_ptr
        launch.launch("lhc_build_states", _grid(kcap, sms), THREADS,
                      [tbl, P("keys"), P("deg"), P("xr"), cnt, FLAG_DEGREE_OVERFLOW, 0], stream)
        launch.launch("lhc_abort_if", 1, 32, [cnt, FLAG_DEGREE_OVERFLOW], stream)
        dtiles = _tiles(cells)
        launch.launch("lhc_degree_tiles", dtiles, THREADS, [P("deg"), cells, P("tiles")], stream)
        launch.launch("lhc_scan_tiles", 1, scan_threads, [P("tiles"), dtiles, _MASK64, 0, cnt, 0], stream)
        launch.launch("lhc_degree_offsets", dtiles, THREADS, [P("deg"), cells, P("tiles"), P("offsets"), cnt], stream)
        launch.launch("lhc_fill_adjacency", _grid(kcap, sms), THREADS,
                      [tbl, P("keys"), P("offsets"), P("cursor"), P("adj"), cnt], stream)
        launch.launch("lhc_sort_adjacency", _grid(cells, sms), THREADS,
                      [P("offsets"), P("deg"), cells, P("adj"), P("xr"), cnt], stream)
        launch.launch("lhc_load_cells", _grid(cells * B, sms), THREADS, [lay, pp, P("val"), cnt], stream)
        launch.launch("lhc_load_bounds", _grid(cells, sms), THREADS, [lay, pp, P("deg"), n, P("acc"), cnt], stream)
        a.view("inexact").zero_()
        rt = f64_bits(rtol)
        launch.launch("lhc_seed_pure", _grid(cells, sms), THREADS, [P("deg"), cells, P("pure0"), P("control_value"), cnt],
                      stream)
        launch.launch("lhc_peel_values", _peel_grid(launch, "lhc_peel_values", sms), THREADS,
                      [tbl, B, P("keys"), P("val"), P("deg"), P("xr"), P("src"), P("round"), P("key_val"), P("offsets"),
                       P("adj"), P("stamp"), P("pure0"), P("pure1"), P("list0"), P("list1"), P("dirty0"), P("dirty1"),
                       P("control_value"), cnt, P("acc"), P("key_err"), P("order"), P("round_start"), P("inexact"),
                       rt], stream, cooperative=True)
        # Peeling stalled or not: the two-key stopping sets it leaves are solved here.
        launch.launch("lhc_solve_pairs", _grid(cells, sms), THREADS,
                      [tbl, B, P("keys"), P("val"), P("deg"), P("src"), P("round"), P("key_val"), P("offsets"),
                       P("adj"), cnt, P("acc"), P("key_err"), P("inexact"), rt, int(bool(verify))], stream)
        launch.launch("lhc_mark_read", _grid(kcap, sms), THREADS,
                      [tbl, P("keys"), P("src"), P("round"), P("deg"), P("acc"), P("reader"), cnt], stream)
        launch.launch("lhc_write_output", _grid(kcap * B, sms), THREADS,
                      [lay, P("keys"), P("round"), P("key_val"), out.data_ptr(), cnt], stream)
        launch.launch("lhc_residual_check", _grid(cells, sms), THREADS,
                      [B, cells, P("val"), P("deg"), P("acc"), cnt], stream)
        # With verify, the verification bound per key: the peel's rounds walked back (the control block
        # still holds their count).
        if verify:
            launch.launch("lhc_verify_values", _peel_grid(launch, "lhc_verify_values", sms), THREADS,
                          [tbl, B, P("keys"), P("src"), P("key_val"), P("order"), P("round_start"), P("reader"),
                           P("acc"), P("key_err"), P("key_ver"), P("inexact"), P("control_value"), cnt, rt,
                           P("offsets"), P("adj"), P("round")], stream,
                          cooperative=True)
        launch.launch("lhc_overflow_finite", _grid(cells * B, sms), THREADS, [lay, pp, cnt], stream)
        ml = P("ml_state") if L.index_kind == "multilevel" else 0
        # Last: the status, from every stage's flags (the CPU backend's precedence, on the device).
        launch.launch("lhc_decode_status", 1, 32, [lay, cnt, ml], stream)
        return DecodeRun(native, payload, a)


def _decode_multilevel(native: CudaLayout, launch, stream: int, a: Arena, pp: int, s: int, n: int,
                       scan_threads: int) -> None:
    """Queue the multilevel index's stages (see "Decode: multilevel index" in codec_kernels.cuh): the
    coarse level's nodes, then per fine level its peel (two cooperative launches: the peel's rounds,
    then its pairs and the level's status, replaying the CPU's order where that decides) and the
    expansion of its nodes into the next level's (at the finest level: the support keys, into
    ``keys``). Every stage skips its work once an earlier one failed."""
    L = native.layout
    levels = L.multilevel.levels
    sms = native.sms
    P = a.ptr
    lay, cnt, ml, ctl = native.words_ptr, P("counters"), P("ml_state"), P("ml_control")
    a.view("ml_state").zero_()
    caps = native.node_caps
    words = L.index.words
    tiles = _tiles(words)
    launch.launch("lhc_ml_coarse_count", tiles, THREADS, [lay, pp, s, n, P("tiles"), cnt, ml], stream)
    # Uncapped scan: the verdict compares the exact node count with the list's capacity.
    launch.launch("lhc_scan_tiles", 1, scan_threads, [P("tiles"), tiles, _MASK64, 0, cnt, 0], stream)
    launch.launch("lhc_ml_verdict", 1, 32, [1, 0, caps[0], cnt, ml, ctl], stream)
    launch.launch("lhc_ml_coarse_write", tiles, THREADS,
                  [lay, pp, s, n, P("tiles"), P("ml_nodes0"), P("ml_counts0"), caps[0], cnt], stream)
    for level in range(len(levels)):
        cur, up = level % 2, 1 - level % 2   # this level's list, and its parents' (then its children's)
        nodes, counts, pat = P(f"ml_nodes{cur}"), P(f"ml_counts{cur}"), P(f"ml_pat{cur}")
        launch.launch("lhc_ml_peel_level", _peel_grid(launch, "lhc_ml_peel_level", sms), THREADS,
                      [lay, level, pp, s, nodes, P("ml_val"), P("ml_deg"), P("ml_xr"), P("ml_src"), P("ml_round"), pat,
                       P("ml_pure0"), P("ml_pure1"), P("ml_list0"), P("ml_list1"), P("ml_claim"), ctl, cnt, ml,
                       P(f"ml_nodes{up}"), P(f"ml_pat{up}")], stream, cooperative=True)
        # The pairs the peel left, the level's verdict, and the CPU-order replay where it decides.
        launch.launch("lhc_ml_settle_level", _peel_grid(launch, "lhc_ml_settle_level", sms), THREADS,
                      [lay, level, pp, s, nodes, P("ml_val"), P("ml_deg"), P("ml_xr"), P("ml_round"), pat,
                       P("ml_pure0"), P("ml_claim"), ctl, cnt, ml, P(f"ml_nodes{up}"), P(f"ml_pat{up}")], stream,
                      cooperative=True)
        etiles = _tiles(caps[level])
        launch.launch("lhc_ml_expand_count", etiles, THREADS,
                      [lay, level, nodes, counts, pat, P("tiles"), cnt, ml], stream)
        launch.launch("lhc_scan_tiles", 1, scan_threads, [P("tiles"), etiles, _MASK64, 0, cnt, 0], stream)
        finest = level == len(levels) - 1
        next_cap = native.key_cap if finest else caps[level + 1]
        launch.launch("lhc_ml_verdict", 1, 32, [0, int(finest), next_cap, cnt, ml, ctl], stream)
        out_nodes, out_counts = (P("keys"), 0) if finest else (P(f"ml_nodes{up}"), P(f"ml_counts{up}"))
        launch.launch("lhc_ml_expand_write", etiles, THREADS,
                      [lay, level, nodes, counts, pat, P("tiles"), out_nodes, out_counts, next_cap, cnt, ml], stream)


class PendingDecode:
    """A queued CUDA decode (the backend interface's pending decode): ``header`` and the kernels'
    counters were read with one synchronisation; ``finish`` only reports them."""

    def __init__(self, run: DecodeRun):
        self.run = run
        self.header, self.stats = run.finish()

    def finish(self, total_keys: int, trace: bool = False, bounds: bool = False):
        # The kernels read the key total from the header themselves; the codec has checked it. The
        # bounds stay on the device until error_bounds asks for them.
        return self.stats, (self.run.trace(self.stats.support_keys) if trace else None)

    def error_bounds(self):
        return self.run.error_bounds(self.stats.support_keys)

    def inexact_keys(self) -> torch.Tensor:
        return self.run.inexact_keys(self.stats.support_keys)
