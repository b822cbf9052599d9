"""index="auto" picks the smallest payload, the Bloom and multilevel indexes priced with their slower
decoders (cost_model.decode_price_bytes); wire sizes are what the payload really is; tensors too dense
to compress go dense."""
import itertools

import numpy as np
import pytest
import torch

import helpers
from lossless_hc import LosslessCodec, plan_layout
from lossless_hc.lhc import cost_model as cost_model
from lossless_hc.lhc.layout import HEADER_FIELDS, INDEX_KINDS

GRID = list(itertools.product(
    [1, 10, 100, 1000, 10_000, 1_000_000],       # numel
    [1, 2, 8, 64, 1024],                          # world size
    [0.0, 0.001, 0.01, 0.1, 0.5, 1.0],             # max_nnz / numel
    [1, 4, 32],                                   # block size
))


def explicit_layouts(numel, n, max_nnz, block):
    out = {}
    for kind in INDEX_KINDS:
        L = plan_layout(numel, n, max_nnz, block, 0, kind)
        if L.index_kind == kind:              # a kind that does not apply falls back to dense
            out[kind] = L
    return out


@pytest.mark.parametrize("numel,n,frac,block", GRID)
def test_auto_is_the_smallest(numel, n, frac, block):
    max_nnz = int(frac * numel)
    auto = plan_layout(numel, n, max_nnz, block, 0, "auto")
    layouts = explicit_layouts(numel, n, max_nnz, block)
    assert "dense" in layouts
    flat = {k: L for k, L in layouts.items() if k != "multilevel"}
    # the single-level kinds by wire bytes plus the Bloom decoder's price; ties go to the cheaper decoder:
    # dense, then bitmap, then bloom
    best = min(cost_model.priced_bytes(L) for L in flat.values())
    best_layout = [flat[k] for k in INDEX_KINDS if k in flat and cost_model.priced_bytes(flat[k]) == best][0]
    ml = layouts.get("multilevel")
    if ml is not None and cost_model.multilevel_pays_off(best_layout, ml):
        # the slower multilevel decoder only where it saves enough per node it peels
        assert auto.index_kind == "multilevel" and auto.payload_numel == ml.payload_numel
        assert ml.wire_bytes + cost_model.decode_price_bytes(ml) <= best
    else:
        assert auto.index_kind == best_layout.index_kind and auto.payload_numel == best_layout.payload_numel
        if auto.index_kind != "bloom" and "bloom" in flat:   # a Bloom index kept out by its decode alone
            assert flat["bloom"].wire_bytes + cost_model.BLOOM_BYTES_PER_CELL * flat["bloom"].bloom.cells >= \
                auto.wire_bytes
    assert layouts[auto.index_kind].fingerprint == auto.fingerprint
    assert auto.wire_bytes == 4 * auto.payload_numel
    assert auto.payload_numel <= numel + HEADER_FIELDS          # never worse than dense + header


@pytest.mark.parametrize("index", ["auto", "bitmap", "bloom", "dense"])
@pytest.mark.parametrize("numel,n,max_nnz,block", [(1000, 4, 10, 1), (5000, 16, 50, 5), (7, 2, 7, 3), (0, 3, 0, 1)])
def test_wire_bytes_match_the_payload(index, numel, n, max_nnz, block):
    codec = LosslessCodec(numel, n, max_nnz, block_size=block, index=index)
    p = codec.encode(torch.zeros(numel))
    assert p.dtype == torch.float32 and p.dim() == 1
    assert p.numel() == codec.payload_numel == codec.layout.payload_numel
    assert codec.wire_bytes == 4 * p.numel()
    assert codec.dense_bytes == 4 * numel
    if numel:
        assert codec.compression_ratio == codec.wire_bytes / codec.dense_bytes
    else:   # nothing dense to send: the header is priced against one byte, never a ZeroDivisionError
        assert codec.compression_ratio == codec.wire_bytes > 1
    assert repr(codec).startswith("LosslessCodec(")


@pytest.mark.parametrize("n", [1, 2, 8, 128])
def test_too_dense_goes_dense(n):
    numel = 4096
    codec = LosslessCodec(numel, n, numel)               # every coordinate may be non-zero
    assert codec.index_kind == "dense"
    assert codec.wire_bytes <= codec.dense_bytes + 4 * HEADER_FIELDS
    rng = np.random.default_rng(n)
    xs = [torch.from_numpy(helpers.values(rng, "normal", numel)) for _ in range(min(n, 8))]
    if len(xs) < n:
        xs += [torch.zeros(numel)] * (n - len(xs))
    y, rep = codec.decode(helpers.sum_payloads([codec.encode(x) for x in xs], rng))
    helpers.assert_lossless(codec.layout, xs, y, rep)


def test_sparse_tensors_compress():
    """The point of the codec: at 1% density and 8 ranks the payload is far below dense."""
    codec = LosslessCodec(1 << 20, 8, (1 << 20) // 100)
    assert codec.index_kind in ("bitmap", "bloom", "multilevel")
    # 0.37 since layout version 6: the mass channel doubles the value sketch at block 1 (docs/DESIGN.md "Exactness")
    assert codec.compression_ratio < 0.4, codec
    emb = LosslessCodec(1 << 20, 8, (1 << 20) // 100, block_size=64)     # row-sparse embedding gradient
    assert emb.compression_ratio < 0.2, emb


@pytest.mark.parametrize("device", ["cpu", "cuda-ops-on-cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_the_dense_index_copies_and_counts_in_one_pass(device):
    """The backend's dense_copy (the dense index's encode and decode) against torch's element-wise
    tests: -0.0 is zero, the smallest subnormal is not; NaN and both infinities are non-finite; at every
    thread count (a tensor large enough for three threads) and without a destination. "cuda-ops-on-cpu":
    the CUDA backend's torch operations on CPU tensors."""
    from lossless_hc.backends import backend_for
    from lossless_hc.backends.cuda import CudaBackend
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    backend = CudaBackend() if device == "cuda-ops-on-cpu" else backend_for(device)
    device = "cpu" if device == "cuda-ops-on-cpu" else device
    n = (1 << 18) + 5
    gen = torch.Generator().manual_seed(3)
    x = torch.zeros(n)
    x[torch.randperm(n, generator=gen)[:5000]] = torch.randn(5000, generator=gen)
    x[:6] = torch.tensor([-0.0, float("nan"), float("inf"), float("-inf"), 3e38, -1.0])
    x.view(torch.int32)[6] = 1                       # the smallest subnormal
    x[n - 1] = 2.0                                   # the last word
    want = [int(torch.count_nonzero(x)), int((~torch.isfinite(x)).sum())]
    assert want[1] == 3
    x = x.to(device)
    for threads in (1, 2, 3):
        dst = torch.full((n,), 7.0, device=device)
        counts = backend.dense_copy(x, dst, threads)
        assert counts.dtype == torch.int64 and counts.tolist() == want, threads
        assert torch.equal(dst.view(torch.int32), x.view(torch.int32))   # bit for bit, NaN and -0.0 too
        assert backend.dense_copy(x, None, threads).tolist() == want
    # keys of `block` elements (the decode's support): 7 does not divide n, the last key is partial; the
    # blocks holding only a -0.0 or a zero are not counted, a block holding NaN is
    for block in (4, 7):
        padded = torch.cat([x.cpu(), torch.zeros(-n % block)]).view(-1, block)
        keys = int(((padded != 0) | torch.isnan(padded)).any(1).sum())
        assert keys < want[0]
        for threads in (1, 2, 3):
            assert backend.dense_copy(x, None, threads, block).tolist() == [keys, want[1]], (block, threads)
    assert backend.dense_copy(x[:0], None).tolist() == [0, 0]
    for bad in (0, True, 2.0):
        with pytest.raises(ValueError, match="block must be an int >= 1"):
            backend.dense_copy(x, None, 0, bad)
    with pytest.raises(TypeError, match="contiguous float32"):
        backend.dense_copy(x.double(), None)
    with pytest.raises(TypeError, match="contiguous float32"):
        backend.dense_copy(x, torch.empty(2 * n, device=device)[::2])
    with pytest.raises(ValueError, match="must hold"):
        backend.dense_copy(x, torch.empty(n - 1, device=device))
