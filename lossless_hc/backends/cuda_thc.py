"""CUDA backend of the THC codec: the launch sequence of the kernels in ``csrc/cuda/thc_kernels.cuh``.

The kernels are loaded the way the lossless codec's are (:mod:`lossless_hc.backends.cuda`): from the compiled
module ``lossless_hc._C_cuda``, whose kernel table holds them, or compiled at run time by NVRTC through
CuPy. Everything runs stream-ordered on ``torch.cuda.current_stream()``; scratch comes from torch's
caching allocator. Encode never synchronises (the norm slot and the non-finite flag are written by a
kernel); decode synchronises once, to read the count of invalid words.

The kernels compute the same bits as the CPU backend (``csrc/cpu/thc_cpu.cpp``): payload words, norm
slot, error memory and decoded output, for the same inputs, seed, rank and step (see
``csrc/thc_math.h``). tests/test_cuda_thc_emulated.py checks that on the host, tests/test_cuda_thc.py
on a GPU.
"""
from __future__ import annotations

import torch

from lossless_hc.backends import cuda_runtime

THREADS = 256          # kThcThreads
TILE = 4096            # kThcTile: Hadamard blocks up to this size run in shared memory
NORM_CHUNK = 1024      # kThcNormChunk
TREE_WIDTH = 1024      # kThcTreeWidth
STATE_BYTES = 32       # sizeof(lhc::gpu::ThcState)
_STATE_SUM_OFFSET = 8  # ThcState::sum_squares
_STATE_BAD_INDEX = 2   # ThcState::bad_words as an int64 index
_STATE_CHECK_INDEX = 3  # ThcState::checksum as an int64 index




class ThcCudaLayout:
    """A THC layout on one device: the layout words and the rounding table in device memory. The
    device may be a CPU device only under the host emulation of the tests (tests/cuda_emulation)."""

    def __init__(self, layout, device: torch.device, lo: torch.Tensor, width: torch.Tensor, inv_width: torch.Tensor):
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        if layout.block > TILE and (layout.block % TILE or layout.block // TILE > TILE):
            raise ValueError(f"the CUDA THC kernels take Hadamard blocks up to {TILE * TILE}, got {layout.block}")
        self.layout = layout
        self.device = device
        self.words = torch.tensor(layout.layout_words(), dtype=torch.int64, device=device)   # the layout ABI
        self.table = torch.cat([lo, width, inv_width]).to(torch.float32).to(device).contiguous()
        self.level_bytes = 1 if layout.granularity <= 255 else 4
        self.in_shared = layout.block <= TILE
        # A CPU device is the host emulation, where every CUDA thread is an OS thread: small grids.
        self.sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1

    @property
    def tiles(self) -> int:
        """Work items of the in-shared kernels: tiles of TILE coordinates (TILE / block Hadamard blocks)."""
        return -(-self.layout.padded // TILE)

    @property
    def nchunks(self) -> int:
        return -(-self.layout.padded // NORM_CHUNK)


def _grid(items: int, sms: int) -> int:
    """Blocks of THREADS for a grid-stride loop over ``items`` elements."""
    return max(1, min(-(-items // THREADS), 16 * sms))


def _blocks(items: int, sms: int) -> int:
    """Blocks for a loop with one CUDA block per item (Hadamard block, tile, chunk)."""
    return max(1, min(items, 32 * sms))


def _f64(x: float) -> int:
    return cuda_runtime.f64_bits(x)


def encode(native: ThcCudaLayout, quantize: bool, scale: float, threshold: float, dequant_a: float, dequant_b: float,
           sign_stream: int, round_stream: int, x: torch.Tensor, e, word_kind: int, payload: torch.Tensor,
           words_offset: int, norm_slot: int, mirror_slot: int, check: tuple) -> None:
    """Queue the encode of ``x`` (contiguous float32, numel) with error memory ``e`` (float32 numel, or
    None) into ``payload``, whose header and norm slots the caller zeroed (and wrote header fields 0
    and 1 of): written here are the level words, the norm slot ``norm_slot``, its negation in
    ``mirror_slot`` and the words' checksum (``check`` = (P, c0, k)), or the non-finite flag with
    everything after it zeroed).
    With ``quantize`` False (the norm-only round) the words must already be zero.
    The scalars are those the CPU backend's ``thc_encode`` takes (as float32 there, converted the same
    way here). Asynchronous on the current stream."""
    L = native.layout
    launch = cuda_runtime.active_launcher()
    with cuda_runtime.device_scope(native.device):
        stream = cuda_runtime.stream_handle(native.device)
        sms = native.sms
        nchunks = native.nchunks
        tree = -(-nchunks // TREE_WIDTH)
        sizes = {"state": STATE_BYTES, "partials": 8 * nchunks, "tree0": 8 * tree, "tree1": 8 * tree}
        if quantize:
            sizes["levels"] = native.level_bytes * L.padded
        if not native.in_shared:
            sizes["y"] = 4 * L.padded
        a = cuda_runtime.Arena(sizes, native.device)
        a.view("state").zero_()
        st, lay, xp = a.ptr("state"), native.words.data_ptr(), x.data_ptr()
        ep = e.data_ptr() if e is not None else 0
        levels = a.ptr("levels") if quantize else 0
        lb = native.level_bytes
        table = native.table.data_ptr()
        sc, th, da, db = _f64(scale), _f64(threshold), _f64(dequant_a), _f64(dequant_b)
        launch.launch("thc_check_finite", _grid(L.numel, sms), THREADS, [xp, L.numel, st], stream)
        if native.in_shared:
            in_blocks = L.block >= NORM_CHUNK
            if not in_blocks:
                launch.launch("thc_norm_chunks", _blocks(nchunks, sms), THREADS, [lay, xp, ep, a.ptr("partials"), st],
                              stream)
            launch.launch("thc_encode_blocks", _blocks(native.tiles, sms), THREADS,
                          [lay, xp, ep, table, sc, th, da, db, sign_stream, round_stream, int(bool(quantize)), levels, lb,
                           a.ptr("partials") if in_blocks else 0, st], stream)
        else:
            y = a.ptr("y")
            tiles = L.padded // TILE
            launch.launch("thc_norm_chunks", _blocks(nchunks, sms), THREADS, [lay, xp, ep, a.ptr("partials"), st],
                          stream)
            if quantize:
                launch.launch("thc_rht_tiles", _blocks(tiles, sms), THREADS, [lay, xp, ep, sign_stream, y, st], stream)
                launch.launch("thc_fwht_columns", _blocks(tiles, sms), THREADS, [lay, y], stream)
                launch.launch("thc_quantize_coords", _grid(L.padded, sms), THREADS,
                              [lay, y, table, sc, th, da, db, round_stream, levels, lb, int(e is not None), st], stream)
                if e is not None:
                    launch.launch("thc_fwht_tiles", _blocks(tiles, sms), THREADS, [y, L.padded], stream)
                    launch.launch("thc_fwht_columns", _blocks(tiles, sms), THREADS, [lay, y], stream)
                    launch.launch("thc_feedback_coords", _grid(L.numel, sms), THREADS, [lay, xp, ep, y, sign_stream, st],
                                  stream)
            elif e is not None:
                launch.launch("thc_accumulate", _grid(L.numel, sms), THREADS, [xp, ep, L.numel, st], stream)
        prime, c0, k = (int(v) for v in check)
        if quantize:
            launch.launch("thc_pack_words", _grid(L.words, sms), THREADS,
                          [lay, levels, lb, int(word_kind), payload.data_ptr() + 8 * words_offset, prime, c0, k, st],
                          stream)
        # ||x + e||^2: the 1024-wide tree over the chunk partials, level by level, into state.sum_squares.
        n, src, bufs = nchunks, a.ptr("partials"), (a.ptr("tree0"), a.ptr("tree1"))
        level = 0
        while True:
            groups = -(-n // TREE_WIDTH)
            dst = st + _STATE_SUM_OFFSET if groups == 1 else bufs[level % 2]
            launch.launch("thc_tree_pass", _blocks(groups, sms), THREADS, [src, n, dst], stream)
            if groups == 1:
                break
            n, src, level = groups, dst, level + 1
        launch.launch("thc_encode_finish", _grid(max(L.numel, payload.numel()), sms), THREADS,
                      [payload.data_ptr(), payload.numel(), int(norm_slot), int(mirror_slot), prime, int(word_kind), ep,
                       L.numel, st], stream)


def decode(native: ThcCudaLayout, sign_stream: int, word_kind: int, words: torch.Tensor, multiplier: float, a: float,
           b: float, out: torch.Tensor, check: tuple) -> tuple:
    """``out[0, numel) = RHT^{-1}(digit * a + b)`` of the aggregated ``words`` (the payload's level
    words, contiguous, on the device), as the CPU backend's ``thc_decode``. Returns the number of
    invalid words and the words' checksum mod P (``check`` = (P, c0, k); synchronises once)."""
    L = native.layout
    launch = cuda_runtime.active_launcher()
    with cuda_runtime.device_scope(native.device):
        stream = cuda_runtime.stream_handle(native.device)
        sms = native.sms
        sizes = {"state": STATE_BYTES}
        if not native.in_shared:
            sizes["y"] = 4 * L.padded
        ar = cuda_runtime.Arena(sizes, native.device)
        ar.view("state").zero_()
        st, lay, wp, op = ar.ptr("state"), native.words.data_ptr(), words.data_ptr(), out.data_ptr()
        kind, mult, fa, fb = int(word_kind), _f64(multiplier), _f64(a), _f64(b)
        prime, c0, k = (int(v) for v in check)
        if native.in_shared:
            launch.launch("thc_decode_blocks", _blocks(native.tiles, sms), THREADS,
                          [lay, wp, kind, mult, fa, fb, sign_stream, op, prime, c0, k, st], stream)
        else:
            y = ar.ptr("y")
            tiles = L.padded // TILE
            launch.launch("thc_unpack_words", _grid(L.words, sms), THREADS,
                          [lay, wp, kind, mult, fa, fb, y, prime, c0, k, st], stream)
            launch.launch("thc_fwht_tiles", _blocks(tiles, sms), THREADS, [y, L.padded], stream)
            launch.launch("thc_fwht_columns", _blocks(tiles, sms), THREADS, [lay, y], stream)
            launch.launch("thc_rht_output", _grid(L.numel, sms), THREADS, [lay, y, sign_stream, op], stream)
        state = ar.view("state", torch.int64)[_STATE_BAD_INDEX:_STATE_CHECK_INDEX + 1].tolist()
        return state[0], state[1] % prime


def interleave(x: torch.Tensor, nb: int, block: int, out: torch.Tensor) -> None:
    """out[j * block + r] = x[r * nb + j], zero past x's end: the padded x seen as a (block, nb) matrix,
    transposed, copied straight from x (its full rows, then the partial one) without materialising the
    padded tensor. A GPU copies a transposed view at close to its bandwidth, so no kernel of ours."""
    numel = x.numel()
    full, rest = divmod(numel, nb)             # full rows of the (block, nb) matrix, and the partial row
    o = out.view(nb, block)
    o[:, :full].copy_(x[:full * nb].view(full, nb).t())
    if full < block:
        o[:rest, full].copy_(x[full * nb:])
        o[rest:, full].zero_()
        o[:, full + 1:].zero_()


def deinterleave(y: torch.Tensor, nb: int, block: int, out: torch.Tensor) -> None:
    """The inverse of :func:`interleave`: out[i] = y[(i % nb) * block + i // nb] for i < out.numel()."""
    full, rest = divmod(out.numel(), nb)
    o = y.view(nb, block)
    out[:full * nb].view(full, nb).copy_(o[:, :full].t())
    if rest:
        out[full * nb:].copy_(o[:rest, full])
