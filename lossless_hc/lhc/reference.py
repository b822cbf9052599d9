"""Pure-torch reference implementation of the lossless codec: the test oracle.

Nothing here runs inside ``LosslessCodec``; the tests compare the C++ kernels against it. It is
written to be obviously correct rather than fast: whole-tensor integer operations for the hash
family, explicit per-rank digit arithmetic for the index, and round-based peeling.

What is reproduced bit for bit (given the same :class:`~lossless_hc.lhc.layout.PayloadLayout`):

* :func:`key_cells` -- ``lhc::key_cells`` / ``mix64`` / ``reduce32`` of ``csrc/lhc_layout.h``, on
  int64 tensors (:mod:`lossless_hc.lhc.hashing`, which the planner also checks tables with).
* :func:`encode` -- the whole payload of ``lhc::cpu::encode`` (and of the dense path in
  ``codec.py``): header, index words, and **the value sketch, bit for bit**. The C++ adds the
  contributions of a cell in increasing key order, each addition rounded to float32, starting from
  +0.0. The reference reproduces that exactly without a Python loop over keys: it sorts the
  (cell, key) contributions by cell, keeping key order, and then performs "round r" = the r-th
  addition of every cell at once (a cell appears at most once per round), so every cell sees the
  same sequence of float32 roundings as in C++. (``dst -= src`` in C++ equals ``dst + (-src)`` in
  IEEE-754, signed zeros included.)

What is *not* bit-exact by design:

* :func:`decode` peels in rounds (every key pure at the start of a round is resolved in that round),
  in float64, reading each key from the lowest of its pure cells, then solves the two-key stopping
  sets left (:func:`solvable_pairs`). The C++ and CUDA decoders read every key from the same cell
  and subtract in the same order, but round their cell bounds up to float32 after each update (this
  reference keeps float64 bounds), so a key at the edge of rtol may get the other verdict, and
  values agree up to float rounding. The *integer* parts --
  candidates, the exact Bloom counts, false positives, support, the ok/failure verdict -- are order
  independent (peeling always ends at the 2-core) and must agree exactly.
"""
from __future__ import annotations

from typing import Optional

import torch

from lossless_hc.lhc.hashing import key_cells, lsr as _lsr, mix64, s64 as _s64
from lossless_hc.lhc.reference_peel import (cell_error_bound, pair_cells, pair_numerators, peel_rounds,
                                            solvable_pairs, solve_pair, verification_bound, within_rtol)
from lossless_hc.lhc.layout import (CHUNK_BITS, HDR_CONTRIBUTORS, HDR_FP_HI, HDR_FP_LO, HDR_KEYS_HI, HDR_KEYS_LO, HDR_KEYS_MID, HDR_NON_FINITE, HDR_OVERLOADED, HDR_INDEX_CHECK0, HDR_SATURATED, HEADER_FIELDS, INDEX_CHECK_PRIMES, PayloadLayout,
                                    index_check_stream)

# lhc::kMaxCellDegree (csrc/lhc_layout.h): a support that puts more keys in one value-sketch cell fails to peel.
MAX_CELL_DEGREE = 255


def index_check_parts(layout: PayloadLayout, keys: torch.Tensor) -> torch.Tensor:
    """``lhc::index_check_parts`` of every key: ``[N, 2]`` int64, ``(h mod 2**32) mod 2039`` and
    ``(h >> 32) mod 2029`` for ``h = mix64(key ^ index_check_stream)``."""
    h = mix64(torch.as_tensor(keys, dtype=torch.int64).reshape(-1) ^ _s64(index_check_stream(layout)))
    return torch.stack([(h & 0xFFFFFFFF) % INDEX_CHECK_PRIMES[0], _lsr(h, 32) % INDEX_CHECK_PRIMES[1]], dim=1)


def index_check(layout: PayloadLayout, keys: torch.Tensor, counts: Optional[torch.Tensor] = None) -> list:
    """The index checksum of ``keys`` held ``counts`` times each (default once): ``[sum_k count(k)
    part_f(k) mod p_f for f = 0, 1]`` -- one rank's header fields, or what an aggregate's must sum to."""
    parts = index_check_parts(layout, keys)
    if counts is not None:
        parts = parts * torch.as_tensor(counts, dtype=torch.int64).reshape(-1, 1)
    return [int(parts[:, f].sum()) % p for f, p in enumerate(INDEX_CHECK_PRIMES)]


# -- encode ------------------------------------------------------------------------------------------

def _flat_float32(layout: PayloadLayout, x: torch.Tensor) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.numel() != layout.numel:
        raise ValueError(f"x has {x.numel()} elements, the layout is for numel={layout.numel}")
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"x has dtype {x.dtype}; expected float32, float16 or bfloat16")
    return x.detach().reshape(-1).to(device="cpu", dtype=torch.float32).contiguous()


def nonzero_keys(layout: PayloadLayout, flat: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """Increasing keys with a coordinate that is not +-0 (NaN/Inf count as non-zero), and whether
    ``flat`` holds a NaN or Inf."""
    bits = flat.view(torch.int32)
    nonzero = (bits & 0x7FFFFFFF) != 0
    non_finite = bool(((bits & 0x7F800000) == 0x7F800000).any())
    pad = layout.num_keys * layout.block - layout.numel
    nonzero = torch.cat([nonzero, torch.zeros(pad, dtype=torch.bool)])
    keys = nonzero.reshape(layout.num_keys, layout.block).any(dim=1).nonzero().reshape(-1)
    return keys, non_finite


def pack_digits(layout: PayloadLayout, digits: torch.Tensor) -> torch.Tensor:
    """Pack int64 digits (each < base) as float32 words ``sum_i digit_i * base**i`` (exact: < 2**22)."""
    P = layout.index
    padded = torch.zeros(P.words * P.per_word, dtype=torch.int64)
    padded[: digits.numel()] = digits
    powers = torch.tensor([P.base ** i for i in range(P.per_word)], dtype=torch.int64)
    words = (padded.reshape(P.words, P.per_word) * powers).sum(dim=1)
    if words.numel() and int(words.max()) >= (1 << 24):
        raise ValueError("index word does not fit float32 exactly: digits >= base?")
    return words.to(torch.float32)


def sketch_cells_float32(layout: PayloadLayout, flat: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """The value sketch ``[cells, block]`` float32, accumulated exactly as the C++ does: per cell,
    the keys' weighted blocks added in increasing key order, each addition rounded to float32 (the
    products with weights +-1, +-2 are exact)."""
    B, C = layout.block, layout.sketch.cells
    sketch = torch.zeros(C, B, dtype=torch.float32)
    if keys.numel() == 0:
        return sketch
    padded = torch.zeros(layout.num_keys * B, dtype=torch.float32)
    padded[: layout.numel] = flat
    blocks = padded.reshape(layout.num_keys, B)[keys]                       # [K, B]
    cells, weights = key_cells(layout.sketch, keys)                        # [K, 3]
    cell = cells.reshape(-1)                                               # key-major: key order kept
    val = (blocks.unsqueeze(1) * weights.unsqueeze(2).to(torch.float32)).reshape(-1, B)
    order = torch.sort(cell, stable=True).indices                          # by cell, then key
    cell, val = cell[order], val[order]
    first = torch.searchsorted(cell, cell, right=False)                    # first entry of its cell
    rank = torch.arange(cell.numel()) - first                              # position within the cell
    for r in range(int(rank.max()) + 1):
        m = rank == r
        c = cell[m]
        sketch[c] = sketch[c] + val[m]                                     # one float32 rounding each
    return sketch


def node_patterns(layout: PayloadLayout, level: int, keys: torch.Tensor, counts: Optional[torch.Tensor] = None):
    """``(nodes, words)`` of multilevel fine level ``level`` for increasing ``keys``: the non-zero
    nodes (increasing) and each node's pattern words ``[len(nodes), words_per_group]`` int64 -- child
    ``c`` holding a key adds ``count * base**(c % w)`` to word ``c // w`` once (count 1 unless
    ``counts``, per distinct child, is given)."""
    m = layout.multilevel
    lv = m.levels[level]
    below = m.levels[level + 1].span if level + 1 < len(m.levels) else 1
    keys = torch.as_tensor(keys, dtype=torch.int64).reshape(-1)
    child_ids = torch.unique(keys // below)                                 # distinct children, increasing
    nodes, inv = torch.unique(child_ids // lv.children, return_inverse=True)
    c = child_ids % lv.children
    powers = torch.tensor([layout.index.base ** j for j in range(lv.digits_per_word)], dtype=torch.int64)
    cnt = torch.ones_like(c) if counts is None else torch.as_tensor(counts, dtype=torch.int64).reshape(-1)
    words = torch.zeros(nodes.numel() * lv.words_per_group, dtype=torch.int64)
    words.index_add_(0, inv * lv.words_per_group + c // lv.digits_per_word, cnt * powers[c % lv.digits_per_word])
    return nodes, words.reshape(nodes.numel(), lv.words_per_group)


def multilevel_fine_words(layout: PayloadLayout, keys: torch.Tensor) -> torch.Tensor:
    """The multilevel fine tables one rank writes (float32, coarsest level first): each non-zero
    node's pattern times its sign in the cell (+-1; fine tables are never weighted) added (as an
    integer, converted once) into its three cells."""
    out = []
    for level, lv in enumerate(layout.multilevel.levels):
        acc = torch.zeros(lv.table.cells, lv.words_per_group, dtype=torch.int64)
        if keys.numel():
            nodes, words = node_patterns(layout, level, keys)
            cells, signs = key_cells(lv.table, nodes)
            for j in range(3):
                acc.index_add_(0, cells[:, j], signs[:, j:j + 1] * words)
        out.append(acc.reshape(-1))
    return torch.cat(out).to(torch.float32)


def mass_cells_float32(layout: PayloadLayout, flat: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """The mass channel ``[cells]`` float32 as the C++ accumulates it: per cell, ``|w| * max |block|``
    of its keys added in increasing key order, each addition rounded to float32 (the max and the
    products by |w| = 1, 2 are exact; NaN lanes do not count)."""
    B = layout.block
    padded = torch.zeros(layout.num_keys * B, dtype=torch.float32)
    padded[: layout.numel] = flat
    # NaN lanes are skipped, as std::max(m, NaN) and fmaxf do (such a rank is flagged non-finite).
    mag = padded.abs().nan_to_num(nan=0.0, posinf=float("inf"))
    block_max = mag.reshape(layout.num_keys, B).amax(dim=1, keepdim=True)
    sketch = torch.zeros(layout.sketch.cells, dtype=torch.float32)
    if keys.numel() == 0:
        return sketch
    cells, weights = key_cells(layout.sketch, keys)
    cell = cells.reshape(-1)
    val = (block_max[keys] * weights.abs().to(torch.float32)).reshape(-1)
    order = torch.sort(cell, stable=True).indices
    cell, val = cell[order], val[order]
    first = torch.searchsorted(cell, cell, right=False)
    rank = torch.arange(cell.numel()) - first
    for r in range(int(rank.max()) + 1):
        m = rank == r
        sketch[cell[m]] = sketch[cell[m]] + val[m]
    return sketch


def encode(layout: PayloadLayout, x: torch.Tensor) -> torch.Tensor:
    """The float32 payload ``lhc::cpu::encode`` (or the dense path of ``LosslessCodec.encode``)
    writes for ``x``; bit-for-bit identical to it."""
    flat = _flat_float32(layout, x)
    L = layout
    payload = torch.zeros(L.payload_numel, dtype=torch.float32)
    mask = (1 << CHUNK_BITS) - 1
    header = [0] * HEADER_FIELDS
    header[HDR_CONTRIBUTORS] = 1
    header[HDR_FP_LO] = L.fingerprint & mask
    header[HDR_FP_HI] = L.fingerprint >> CHUNK_BITS
    if L.index_kind == "dense":
        header[HDR_NON_FINITE] = int(not bool(torch.isfinite(flat).all())) if flat.numel() else 0
        payload[:HEADER_FIELDS] = torch.tensor(header, dtype=torch.float32)
        payload[HEADER_FIELDS:] = flat
        return payload

    keys, non_finite = nonzero_keys(L, flat)
    nkeys = keys.numel()
    header[HDR_KEYS_LO] = nkeys & mask
    header[HDR_KEYS_MID] = (nkeys >> CHUNK_BITS) & mask
    header[HDR_KEYS_HI] = (nkeys >> (2 * CHUNK_BITS)) & mask
    header[HDR_OVERLOADED] = int(nkeys > L.capacity)
    header[HDR_NON_FINITE] = int(non_finite)
    header[HDR_INDEX_CHECK0:HDR_INDEX_CHECK0 + 2] = index_check(L, keys)

    if L.index_kind == "bitmap":
        digits = torch.zeros(L.num_keys, dtype=torch.int64)
        digits[keys] = 1
    elif L.index_kind == "bloom":
        bcells, _ = key_cells(L.bloom, keys)
        digits = torch.bincount(bcells.reshape(-1), minlength=L.bloom.cells).to(torch.int64)
        if bool((digits > L.digit_cap).any()):
            header[HDR_SATURATED] = 1
        digits = digits.clamp(max=L.digit_cap)
    elif L.index_kind == "multilevel":
        payload[L.fine_offset: L.sketch_offset] = multilevel_fine_words(L, keys)
        digits = torch.zeros(L.index.digits, dtype=torch.int64)
        digits[torch.unique(keys // L.multilevel.levels[0].span)] = 1
    else:
        raise ValueError(f"unknown index kind {L.index_kind!r}")
    payload[L.index_offset: L.fine_offset] = pack_digits(L, digits)
    payload[L.sketch_offset:L.mass_offset] = sketch_cells_float32(L, flat, keys).reshape(-1)
    payload[L.mass_offset:] = mass_cells_float32(L, flat, keys)
    payload[:HEADER_FIELDS] = torch.tensor(header, dtype=torch.float32)
    return payload


# -- decode (the peeling machinery and the bounds: reference_peel.py) -------------------------------

def _fail(info: dict, reason: str):
    info["ok"], info["reason"] = False, reason
    return info


def _read_int_fields(values: torch.Tensor, scale: float, limit: Optional[int] = None) -> Optional[torch.Tensor]:
    """float32 fields times ``scale`` as exact non-negative integers, or None: a summed field must be
    an integer, an averaged one within 1/2 of one after scaling back (as lhc::read_word and
    LosslessCodec._read_header)."""
    v = values.to(torch.float64) * scale
    if not bool(torch.isfinite(v).all()):
        return None
    r = torch.round(v)
    tolerance = 0.0 if scale == 1.0 else 0.5
    if bool(((v - r).abs() > tolerance).any()) or bool((r < 0).any()):
        return None
    if bool((r.abs() >= 2.0 ** 53).any()) or (limit is not None and bool((r >= limit).any())):
        return None
    return r.to(torch.int64)


def unpack_digits(layout: PayloadLayout, words: torch.Tensor) -> torch.Tensor:
    """The digits (int64, ``words * per_word`` of them) of exact integer index words."""
    P = layout.index
    powers = torch.tensor([P.base ** i for i in range(P.per_word)], dtype=torch.int64)
    return ((words.unsqueeze(1) // powers) % P.base).reshape(-1)


def _multilevel_support(L: PayloadLayout, digits: torch.Tensor, payload: torch.Tensor, scale: float, n: int,
                        total: int):
    """``(support keys, None)`` or ``(None, reason)``: the coarse digits give the non-zero nodes of
    the coarsest fine level exactly; each fine table is peeled in integers (round based) over the
    non-zero nodes found above it, a pure cell holding its node's pattern times the node's sign
    there, then its two-node stopping sets are solved as the value sketch's pairs are
    (:func:`pair_cells`); a node's pattern digits are its children's counts."""
    m = L.multilevel
    nn = L.index.digits
    if bool((digits[nn:] != 0).any()) or bool((digits > n).any()):
        return None, "index corrupt: coarse digit out of range"
    coarse = digits[:nn]
    if int(coarse.sum()) > total:
        return None, "index corrupt: more non-zero nodes than keys"
    nodes = coarse.nonzero().reshape(-1)
    counts = coarse[nodes]
    offsets = L.level_offsets
    for level, lv in enumerate(m.levels):
        raw = payload[offsets[level]: offsets[level] + lv.numel].to(torch.float64) * scale
        if not bool(torch.isfinite(raw).all()):
            return None, "index corrupt: a fine word is not finite"
        r = torch.round(raw)
        tol = 0.0 if scale == 1.0 else 0.5
        if bool(((raw - r).abs() > tol).any()):
            return None, "index corrupt: a fine word is not an integer"
        if bool((r.abs() >= (1 << 22)).any()):
            return None, "index overflow: a fine word reached 2**22 in magnitude"
        val = r.to(torch.int64).reshape(lv.table.cells, lv.words_per_group).clone()
        fc, fs = key_cells(lv.table, nodes)
        rounds, resolved = peel_rounds(fc, lv.table.cells)
        word_limit = L.index.base ** lv.digits_per_word
        pattern = torch.zeros(nodes.numel(), lv.words_per_group, dtype=torch.int64)
        for idx, pj in rounds:
            pat = val[fc[idx, pj]] * fs[idx, pj].unsqueeze(1)             # [R, wpg]
            if bool((pat < 0).any()) or bool((pat >= word_limit).any()):
                return None, "index corrupt: a pure fine cell is not a node pattern"
            pattern[idx] = pat
            val.index_add_(0, fc[idx].reshape(-1), -(fs[idx].reshape(-1, 1) * pat.repeat_interleave(3, dim=0)))
        for a, b in solvable_pairs(fc, fs, resolved).tolist():
            num_a, num_b, det = pair_numerators(val, fc[a], fs[a], fs[b])
            pa, pb = torch.div(num_a, det, rounding_mode="floor"), torch.div(num_b, det, rounding_mode="floor")
            consistent = bool((pa * det == num_a).all()) and bool((pb * det == num_b).all())
            for x in (pa, pb):
                consistent &= bool((x >= 0).all()) and bool((x < word_limit).all())
            for j in range(3):
                consistent &= bool((val[fc[a, j]] == fs[a, j] * pa + fs[b, j] * pb).all())
            if not consistent:
                return None, "index corrupt: a solved fine pair is not a pair of node patterns"
            pattern[a], pattern[b] = pa, pb
            val[fc[a]] = 0
            resolved[a] = resolved[b] = True
        if not bool(resolved.all()):
            return None, "index peeling failed"
        if bool((val != 0).any()):
            return None, "index corrupt: fine words left after peeling"
        powers = torch.tensor([L.index.base ** j for j in range(lv.digits_per_word)], dtype=torch.int64)
        cnt = ((pattern.unsqueeze(2) // powers) % L.index.base).reshape(nodes.numel(), lv.children)
        if bool((cnt > counts.unsqueeze(1)).any()) or bool((cnt.sum(dim=1) < counts).any()):
            return None, "index corrupt: child counts disagree with their node's count"
        below = m.levels[level + 1].span if level + 1 < len(m.levels) else 1
        ni, c = cnt.nonzero(as_tuple=True)
        children = nodes[ni] * lv.children + c
        if bool((children >= -(-L.num_keys // below)).any()):
            return None, "index corrupt: a child past the last"
        if int(cnt.sum()) > total:
            return None, "index corrupt: more non-zero children than keys"
        nodes, counts = children, cnt[ni, c]
    if int(counts.sum()) != total:
        return None, "index corrupt: counts disagree with the header"
    return (nodes, counts), None



def decode(layout: PayloadLayout, payload: torch.Tensor, averaged: bool = False, rtol: float = 2.0 ** -10,
           verify: bool = False):
    """Decode an aggregated payload: ``(y, info)``, y a float64 tensor of ``numel`` values (the sum,
    or the average if ``averaged``), info a dict with ok, reason, contributors, total_keys,
    overloaded_ranks, candidates, false_positives, support (number of keys), support_keys (the
    keys), peeled, and trace = (keys, cells): the support keys in peeling order (round by round)
    and the cell each was read from, like ``DecodeReport.trace``; once peeled, error_bound (per
    support key, in support order: the rigorous bound on its float64 value's error, built from
    the mass channel along the peel as ``LosslessCodec`` states) and inexact_keys (sorted keys whose
    bound exceeds ``rtol``; with ``verify`` also those whose verification bound
    (:func:`verification_bound`) does, and the keys of solved pairs: then ok is False with reason
    "inexact"). A cell left non-zero beyond its bound after peeling fails with "sketch corrupt".

    Peeling is round based in float64 (see the module docstring). A Bloom index is first peeled
    exactly in integers, so every false-positive candidate gets count 0 and is dropped before the
    value sketch is peeled.
    """
    L = layout
    if not isinstance(payload, torch.Tensor):
        raise TypeError(f"payload must be a torch.Tensor, got {type(payload).__name__}")
    if payload.dtype != torch.float32:
        raise TypeError(f"payload must be float32, got {payload.dtype}")
    if payload.dim() != 1 or payload.numel() != L.payload_numel:
        raise ValueError(f"payload must be 1-D with {L.payload_numel} elements, got {tuple(payload.shape)}")
    n = L.world_size
    scale = float(n) if averaged else 1.0
    y = torch.zeros(L.numel, dtype=torch.float64)
    info = dict(ok=False, reason=None, contributors=0, total_keys=0, overloaded_ranks=0, candidates=0,
                false_positives=0, support=0, support_keys=torch.zeros(0, dtype=torch.int64), peeled=0,
                trace=None, inexact_keys=torch.zeros(0, dtype=torch.int64), error_bound=None)

    hdr = _read_int_fields(payload[:HEADER_FIELDS], scale)
    if hdr is None:
        return y, _fail(info, "header fields are not non-negative integers")
    hdr = [int(v) for v in hdr]
    info["contributors"] = hdr[HDR_CONTRIBUTORS]
    if hdr[HDR_CONTRIBUTORS] != n:
        return y, _fail(info, f"payload aggregates {hdr[HDR_CONTRIBUTORS]} contributions, expected {n}")
    mask = (1 << CHUNK_BITS) - 1
    if hdr[HDR_FP_LO] != n * (L.fingerprint & mask) or hdr[HDR_FP_HI] != n * (L.fingerprint >> CHUNK_BITS):
        return y, _fail(info, "configuration mismatch")
    total = hdr[HDR_KEYS_LO] + (hdr[HDR_KEYS_MID] << CHUNK_BITS) + (hdr[HDR_KEYS_HI] << (2 * CHUNK_BITS))
    info["total_keys"], info["overloaded_ranks"] = total, hdr[HDR_OVERLOADED]
    if hdr[HDR_NON_FINITE]:
        return y, _fail(info, "non-finite input")
    if hdr[HDR_SATURATED]:
        return y, _fail(info, "index counter saturated")

    if L.index_kind == "dense":
        y = payload[HEADER_FIELDS:].to(torch.float64)
        if not bool(torch.isfinite(y).all()):
            return y, _fail(info, "sketch overflow: a dense value is NaN/Inf")
        nz = int(torch.count_nonzero(y))
        info.update(candidates=nz, support=nz, peeled=nz, ok=True)
        return y, info

    limit = L.index.base ** L.index.per_word
    words = _read_int_fields(payload[L.index_offset: L.fine_offset], scale, limit)
    if words is None:
        return y, _fail(info, "index corrupt: a word is not a valid packed count")
    digits = unpack_digits(L, words)
    if L.index_kind == "bitmap":
        if bool((digits[L.num_keys:] != 0).any()) or bool((digits > n).any()):
            return y, _fail(info, "index corrupt: digit out of range")
        if int(digits.sum()) != total:
            return y, _fail(info, "index corrupt: counts disagree with the header")
        support = digits[: L.num_keys].nonzero().reshape(-1)
        support_counts = digits[support]
        info["candidates"] = support.numel()
    elif L.index_kind == "bloom":
        bc = L.bloom.cells
        if bool((digits[bc:] != 0).any()) or bool((digits > n * L.digit_cap).any()):
            return y, _fail(info, "index corrupt: digit out of range")
        count = digits[:bc].clone()
        if int(count.sum()) != 3 * total:
            return y, _fail(info, "index corrupt: counts disagree with the header")
        all_keys = torch.arange(L.num_keys, dtype=torch.int64)
        kc, _ = key_cells(L.bloom, all_keys)
        cand = all_keys[(count[kc] != 0).all(dim=1)]
        info["candidates"] = cand.numel()
        cc = kc[cand]
        rounds, resolved = peel_rounds(cc, bc)
        key_count = torch.zeros(cand.numel(), dtype=torch.int64)
        for idx, pj in rounds:
            c = count[cc[idx, pj]]
            if bool((c > n).any()):
                return y, _fail(info, "index corrupt: a key held by more than world_size ranks")
            count.index_add_(0, cc[idx].reshape(-1), (-c).repeat_interleave(3))
            if bool((count < 0).any()):
                return y, _fail(info, "index corrupt: negative counter while peeling")
            key_count[idx] = c
        if not bool(resolved.all()):
            return y, _fail(info, "index peeling failed")
        if bool((count != 0).any()):
            return y, _fail(info, "index corrupt: counters left after peeling")
        support, support_counts = cand[key_count > 0], key_count[key_count > 0]
        info["false_positives"] = int((key_count == 0).sum())
    elif L.index_kind == "multilevel":
        found, reason = _multilevel_support(L, digits, payload, scale, n, total)
        if reason is not None:
            return y, _fail(info, reason)
        support, support_counts = found
        info["candidates"] = support.numel()
    else:
        raise ValueError(f"unknown index kind {L.index_kind!r}")
    # The index checksum (lhc::index_check_matches): the decoded counts must give the header's sums.
    if index_check(L, support, support_counts) != [hdr[HDR_INDEX_CHECK0 + f] % p for f, p in enumerate(INDEX_CHECK_PRIMES)]:
        return y, _fail(info, "index corrupt: the index checksum disagrees with the decoded support")
    info["support"], info["support_keys"] = support.numel(), support

    B = L.block
    val = payload[L.sketch_offset:L.mass_offset].to(torch.float64).reshape(L.sketch.cells, B).clone()
    mass = payload[L.mass_offset:].to(torch.float64)   # an average's mass bounds the average's rounding
    if not bool(torch.isfinite(val).all()) or not bool(torch.isfinite(mass).all()):
        # every rank's input was finite (header), so the float32 aggregate overflowed or was corrupted
        return y, _fail(info, "sketch overflow: a sketch cell is NaN/Inf")
    sc, ss = key_cells(L.sketch, support)
    deg = torch.bincount(sc.reshape(-1), minlength=L.sketch.cells)
    if deg.numel() and int(deg.max()) > MAX_CELL_DEGREE:
        return y, _fail(info, f"sketch peeling failed: a cell holds {int(deg.max())} support keys, more than "
                              f"{MAX_CELL_DEGREE}")
    # Each cell's error bound (lhc::cell_error_bound), then, along the peel, the bounds of the keys
    # subtracted from it; -1 marks a cell a key was read from (nothing left to check there).
    acc = cell_error_bound(mass, deg, n)
    mass_bad = bool(((deg > 0) != (mass > 0)).any())
    rounds, resolved = peel_rounds(sc, L.sketch.cells)
    blocks = torch.zeros(support.numel(), B, dtype=torch.float64)
    err = torch.zeros(support.numel(), dtype=torch.float64)
    trace_keys, trace_cells = [], []
    for idx, pj in rounds:
        pure_cell = sc[idx, pj]
        trace_keys.append(support[idx])
        trace_cells.append(pure_cell)
        w = ss[idx, pj].to(torch.float64)
        v = val[pure_cell] / w.unsqueeze(1)                                 # [R, B]; exact (w = +-1, +-2)
        blocks[idx] = v
        err[idx] = acc[pure_cell] / w.abs()
        acc[pure_cell] = -1.0
        other = torch.ones(idx.numel(), 3, dtype=torch.bool)
        other[torch.arange(idx.numel()), pj] = False
        oc = sc[idx][other]                                                 # [2R]
        os_ = ss[idx][other].to(torch.float64)
        val.index_add_(0, oc, -(os_.unsqueeze(1) * v.repeat_interleave(2, dim=0)))
        acc.index_add_(0, oc, os_.abs() * err[idx].repeat_interleave(2))
    # Peeling stalled: solve the two-key stopping sets (each pair's cells hold just the pair); the
    # third cell keeps w_r(a) v_a + w_r(b) v_b, subtracted for the residual check. One check cannot
    # verify two values: with verify a solved pair's keys are listed inexact; its cells verify
    # nothing (-2).
    paired = torch.zeros(support.numel(), dtype=torch.bool)
    for a, b in solvable_pairs(sc, ss, resolved).tolist():
        blocks[a], blocks[b] = solve_pair(val, sc[a], ss[a], ss[b])
        wa, wb = ss[a].tolist(), ss[b].tolist()
        p, q, det = pair_cells(wa, wb)
        r = 3 - p - q
        ap, aq = float(acc[sc[a, p]]), float(acc[sc[a, q]])
        err[a] = (abs(wb[q]) * ap + abs(wb[p]) * aq) / abs(det)
        err[b] = (abs(wa[p]) * aq + abs(wa[q]) * ap) / abs(det)
        acc[sc[a, p]] = acc[sc[a, q]] = -2.0
        acc[sc[a, r]] += abs(wa[r]) * err[a] + abs(wb[r]) * err[b]
        paired[a] = paired[b] = True
        val[sc[a, r]] -= wa[r] * blocks[a] + wb[r] * blocks[b]
        resolved[a] = resolved[b] = True
        trace_keys.append(support[[a, b]])
        trace_cells.append(sc[[a, b], 0])
    info["peeled"] = int(resolved.sum())
    info["trace"] = (torch.cat(trace_keys) if trace_keys else torch.zeros(0, dtype=torch.int64),
                     torch.cat(trace_cells) if trace_cells else torch.zeros(0, dtype=torch.int64))
    padded = torch.zeros(L.num_keys * B, dtype=torch.float64)
    pv = padded.reshape(L.num_keys, B)
    pv[support[resolved]] = blocks[resolved]
    y = padded[: L.numel].clone()
    if not bool(resolved.all()):
        return y, _fail(info, "sketch peeling failed")
    if info["overloaded_ranks"]:
        return y, _fail(info, f"overloaded: {info['overloaded_ranks']} rank(s) over capacity")
    checked = acc >= 0
    if mass_bad or bool((val[checked].abs() > acc[checked].unsqueeze(1)).any()):
        return y, _fail(info, "sketch corrupt: a cell is not zero within its bound after peeling")
    info["error_bound"] = err
    if verify:
        bound = torch.maximum(err, verification_bound(sc, ss, rounds, acc, val, err))
        inexact = ~within_rtol(blocks, bound.unsqueeze(1), rtol).all(dim=1) | paired
    else:
        inexact = ~within_rtol(blocks, err.unsqueeze(1), rtol).all(dim=1)
    info["inexact_keys"] = torch.sort(support[inexact]).values
    if bool(inexact.any()):
        return y, _fail(info, "inexact")
    info["ok"] = True
    return y, info
