"""The DDP hooks' bucket helpers (plugins/_ddp_bucket.py) in one process: which buckets are divided
before their sum, and the averaged bucket written back from the summed results."""
import itertools

import pytest
import torch

from lossless_hc.plugins._ddp_bucket import (bucket_slices, divide_first, divide_first_exactly, fill_bucket,
                                             fill_slices)


@pytest.mark.parametrize("dtype, first", [(torch.float16, True), (torch.bfloat16, False), (torch.float32, False)])
def test_only_a_float16_bucket_is_divided_before_its_sum(dtype, first):
    """divide_first divides a float16 bucket in place (its ranks' sum may pass 65504 where the average
    does not) and leaves bfloat16 and float32 buckets, which have float32's range, to be divided after
    the sum: the average of three bfloat16 ranks is then their sum rounded once, then divided."""
    ranks = [torch.tensor([1.0, 255.0, 3.0], dtype=dtype), torch.tensor([1.0, 255.0, 5.0], dtype=dtype),
             torch.tensor([1.0, 255.0, 7.0], dtype=dtype)]
    buckets = [x.clone() for x in ranks]
    divided = [divide_first(b, 3) for b in buckets]
    assert divided == [first] * 3
    for b, x in zip(buckets, ranks):
        assert torch.equal(b, x / 3 if first else x)
    summed = torch.stack(buckets).sum(0)   # the engine's SUM, in the bucket's dtype
    out = torch.empty_like(summed)
    fill_bucket(out, [summed], None if first else 3)
    want = sum(x / 3 for x in ranks) if first else sum(ranks) / 3
    assert torch.equal(out, want)


def test_fill_bucket_writes_each_result_into_its_slice_and_divides_it_once():
    """Each gradient's result goes to its own consecutive slice of the bucket; one decoded into its slice
    already is divided there (or left as it is with in_place_divided)."""
    grads = [torch.zeros(2, 3), torch.zeros(4), torch.zeros(1)]
    buffer = torch.full((11,), -1.0)
    slices = bucket_slices(buffer, grads)
    assert [(s.data_ptr() - buffer.data_ptr()) // 4 for s in slices] == [0, 6, 10]
    results = [torch.arange(6.0).reshape(2, 3), torch.arange(4.0) + 10, torch.tensor([20.0])]
    fill_bucket(buffer, results, 2)
    assert torch.equal(buffer, torch.cat([r.reshape(-1) for r in results]) / 2)
    # a result decoded into its slice (THC's in-place output): divided there, once
    buffer = torch.cat([r.reshape(-1) for r in results])
    in_place = [r if i != 1 else bucket_slices(buffer, grads)[1] for i, r in enumerate(results)]
    fill_bucket(buffer, in_place, 2)
    assert torch.equal(buffer, torch.cat([r.reshape(-1) for r in results]) / 2)
    buffer = torch.cat([r.reshape(-1) for r in results])
    in_place = [r if i != 1 else bucket_slices(buffer, grads)[1].div_(2) for i, r in enumerate(results)]
    fill_bucket(buffer, in_place, 2, in_place_divided=True)
    assert torch.equal(buffer, torch.cat([r.reshape(-1) for r in results]) / 2)


def test_fill_bucket_returns_the_bucket_it_filled():
    """DDP's comm hook returns fill_bucket's value as its future's result: the bucket buffer itself,
    filled and divided (not a copy, not None)."""
    buffer = torch.zeros(3)
    assert fill_bucket(buffer, [torch.tensor([2.0, 4.0]), torch.tensor([6.0])], 2) is buffer
    assert torch.equal(buffer, torch.tensor([1.0, 2.0, 3.0]))


def test_fill_slices_divides_a_result_decoded_in_place_unless_told_it_was():
    """fill_slices' in_place_divided defaults to False: a result decoded into its own slice is divided there
    like any other; only with in_place_divided=True is it left as it is."""
    grads = [torch.zeros(2), torch.zeros(2)]
    for flag, want in ((None, [1.0, 2.0, 3.0, 4.0]), (True, [1.0, 2.0, 6.0, 8.0])):
        buffer = torch.tensor([0.0, 0.0, 6.0, 8.0])
        slices = bucket_slices(buffer, grads)
        results = [torch.tensor([2.0, 4.0]), slices[1]]   # the second one decoded in place
        fill_slices(slices, results, 2, **({} if flag is None else {"in_place_divided": flag}))
        assert torch.equal(buffer, torch.tensor(want)), flag


def test_allreduce_half_averages_unless_told_to_sum(gloo_world_of_one):
    """allreduce_half's average defaults to True (DDP's hook calls it so for a bucket's average): on a 1-rank
    Gloo group told n = 4 ranks, the buffer comes back divided by 4, in either half precision."""
    from lossless_hc.plugins._ddp_bucket import allreduce_half

    x = torch.tensor([4.0, -8.0, 1000.0, 0.5])
    for half in ("bf16", "fp16"):
        buffer = x.clone()
        assert allreduce_half(buffer, 4, None, half).wait() is buffer
        assert torch.equal(buffer, x / 4), half


@pytest.mark.parametrize("n", [1, 2, 3, 4, 6, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_plain_bucket_is_divided_first_only_where_that_is_the_same_rounding(n, dtype):
    """divide_first_exactly divides a bucket summed as it is before the sum only at a power-of-two world
    size, where every order of the ranks' sum of x_r / n gives the bits of their sum divided by n (values
    far from the subnormal range: gradients of magnitude 2^-40 to 2^40, signs mixed, cancellations
    included); at n = 3 and 6 the two round differently, so the bucket is left to be divided after."""
    g = torch.Generator().manual_seed(n)
    ranks = [(torch.randn(4096, generator=g) * 2.0 ** torch.randint(-40, 40, (4096,), generator=g)).to(dtype)
             for _ in range(n)]
    ranks[0][:64] = -ranks[-1][:64]   # exact cancellations
    buckets = [x.clone() for x in ranks]
    divided = [divide_first_exactly(b, n) for b in buckets]
    power_of_two = n & (n - 1) == 0
    assert divided == [power_of_two] * n
    if not power_of_two:   # left as it is: dividing first would round differently here
        assert all(torch.equal(b, x) for b, x in zip(buckets, ranks))
        assert not torch.equal(sum(x / n for x in ranks), sum(ranks) / n)
        return
    for order in itertools.islice(itertools.permutations(range(n)), 0, 350, 7):   # orders of the engine's sum
        first, after = buckets[order[0]].clone(), ranks[order[0]].clone()
        for r in order[1:]:
            first += buckets[r]
            after += ranks[r]   # in the bucket's dtype, then divided
        assert torch.equal(first, after / n)


def test_divide_first_exactly_divides_a_sparse_bucket_s_values_and_leaves_integers():
    """A sparse gradient's bucket (Gloo's sparse allreduce then coalesces it): its values divided in place,
    duplicates and all, which sums to the same bits; an integer buffer is never divided."""
    sparse = torch.sparse_coo_tensor(torch.tensor([[0, 0, 3]]), torch.tensor([[1.0, 3.0], [2.0, 2.0], [5.0, -5.0]]),
                                     (4, 2), check_invariants=True)
    before = sparse.coalesce().to_dense()
    assert divide_first_exactly(sparse, 4)
    assert torch.equal(sparse.coalesce().to_dense(), before / 4)
    ints = torch.tensor([4, 8])
    assert not divide_first_exactly(ints, 2) and torch.equal(ints, torch.tensor([4, 8]))
