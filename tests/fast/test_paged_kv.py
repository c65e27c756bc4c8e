"""PagedKVCache and BlockPool: block bookkeeping, and fetches bit-identical to
a plain KVCache fed the same keys and values."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedlm.cache import BlockPool, Cache, KVCache, PagedKVCache, PagedPoolExhausted

H, D = 2, 8


def kv(L: int, dtype=torch.float32, gen=None):
    k = torch.randn(1, H, L, D, generator=gen).to(dtype)
    v = torch.randn(1, H, L, D, generator=gen).to(dtype)
    return k, v


def pool(num_blocks: int, block_size: int, dtype=torch.float32) -> BlockPool:
    return BlockPool(num_blocks, block_size, num_kv_heads=H, head_dim=D, dtype=dtype)


def test_paged_cache_satisfies_the_protocol_but_is_not_a_kvcache():
    c = PagedKVCache(pool(2, 4))
    assert isinstance(c, Cache) and not isinstance(c, KVCache)


# -- block bookkeeping -------------------------------------------------------


def test_update_crossing_block_boundary_allocates_the_next_block():
    p = pool(4, 4)
    c = PagedKVCache(p)
    c.update_and_fetch(*kv(3))
    assert c.block_table == [0] and p.num_free == 3
    c.update_and_fetch(*kv(1))  # fills block 0 exactly
    assert c.block_table == [0] and c.offset == 4
    c.update_and_fetch(*kv(2))  # crosses into block 1
    assert c.block_table == [0, 1] and c.offset == 6 and p.num_free == 2


def test_one_update_spanning_three_blocks_writes_each_piece_in_place():
    torch.manual_seed(0)
    p = pool(4, 4)
    c = PagedKVCache(p)
    c.update_and_fetch(*kv(2))
    k, v = kv(8)  # 2 into block 0, 4 into block 1, 2 into block 2
    k_all, v_all = c.update_and_fetch(k, v)
    assert c.block_table == [0, 1, 2] and c.offset == 10
    assert torch.equal(p.k[0, :, 2:4], k[0, :, 0:2])
    assert torch.equal(p.k[1], k[0, :, 2:6])
    assert torch.equal(p.v[2, :, 0:2], v[0, :, 6:8])
    assert k_all.shape == (1, H, 10, D) and torch.equal(k_all[:, :, 2:], k)


def test_trim_across_block_boundary_frees_tail_blocks():
    p = pool(4, 4)
    c = PagedKVCache(p)
    c.update_and_fetch(*kv(10))
    assert c.block_table == [0, 1, 2]
    assert c.trim(5) == 5 and c.offset == 5
    assert c.block_table == [0, 1] and p.num_free == 2 and p.is_free(2)
    assert c.trim(1) == 1 and c.block_table == [0] and p.is_free(1)
    assert c.trim(100) == 4 and c.offset == 0 and c.block_table == []
    assert p.num_free == 4


def test_trim_within_a_block_keeps_the_block():
    p = pool(4, 4)
    c = PagedKVCache(p)
    c.update_and_fetch(*kv(7))
    assert c.trim(2) == 2 and c.block_table == [0, 1] and p.num_free == 2


def test_trim_then_regrowth_reallocates_and_matches_reference():
    torch.manual_seed(0)
    p = pool(6, 4)
    c, ref = PagedKVCache(p), KVCache()
    for L in (9, 3):
        k, v = kv(L)
        c.update_and_fetch(k, v)
        ref.update_and_fetch(k, v)
    assert c.block_table == [0, 1, 2]
    c.trim(7)
    ref.trim(7)
    assert c.block_table == [0, 1]
    k, v = kv(9)  # regrow past the trimmed boundary: needs two fresh blocks
    got_k, got_v = c.update_and_fetch(k, v)
    want_k, want_v = ref.update_and_fetch(k, v)
    assert c.block_table == [0, 1, 2, 3] and c.offset == 14
    assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)


def test_free_list_reuses_blocks_freed_by_another_cache():
    p = pool(4, 4)
    a, b = PagedKVCache(p), PagedKVCache(p)
    a.update_and_fetch(*kv(8))
    b.update_and_fetch(*kv(4))
    assert a.block_table == [0, 1] and b.block_table == [2]
    a.trim(8)
    assert p.num_free == 3
    b.update_and_fetch(*kv(5))
    assert b.block_table == [2, 0, 1]  # lowest free ids first
    assert p.num_free == 1


def test_exhaustion_raises_typed_error_and_leaves_cache_unchanged():
    torch.manual_seed(0)
    p = pool(3, 4)
    c = PagedKVCache(p)
    k, v = kv(5)
    c.update_and_fetch(k, v)
    with pytest.raises(PagedPoolExhausted) as err:
        c.update_and_fetch(*kv(8))  # needs 13 tokens = 4 blocks; holds 2, 1 free
    e = err.value
    assert (e.requested, e.free, e.capacity) == (2, 1, 3)
    assert "2 block(s)" in str(e) and "1 free of 3" in str(e) and "max_tokens" in str(e)
    assert c.offset == 5 and c.block_table == [0, 1] and p.num_free == 1
    k2, v2 = kv(3)  # still fits
    got, _ = c.update_and_fetch(k2, v2)
    assert torch.equal(got, torch.cat([k, k2], 2))


def test_pool_alloc_when_empty_raises_with_requested_one():
    p = pool(2, 4)
    assert [p.alloc(), p.alloc()] == [0, 1]
    with pytest.raises(PagedPoolExhausted) as err:
        p.alloc()
    assert (err.value.requested, err.value.free, err.value.capacity) == (1, 0, 2)


def test_pool_refuses_double_free_and_foreign_ids():
    p = pool(2, 4)
    b = p.alloc()
    p.free(b)
    with pytest.raises(ValueError, match="twice"):
        p.free(b)
    with pytest.raises(ValueError):
        p.free(2)


def test_dispose_returns_every_block_and_is_idempotent():
    p = pool(8, 4)
    a, b = PagedKVCache(p), PagedKVCache(p)
    a.update_and_fetch(*kv(13))
    b.update_and_fetch(*kv(6))
    assert p.num_free == 2
    a.dispose()
    assert p.num_free == 6 and a.nbytes == 0 and a.offset == 0
    a.dispose()
    b.dispose()
    assert p.num_free == 8 and all(p.is_free(i) for i in range(8))


def test_nbytes_counts_held_blocks():
    p = pool(4, 4)
    c = PagedKVCache(p)
    assert c.nbytes == 0
    c.update_and_fetch(*kv(5))
    block = 2 * H * 4 * D * 4  # K and V, float32
    assert p.block_nbytes == block and c.nbytes == 2 * block
    assert p.nbytes == 4 * block


def test_batch_above_one_is_refused():
    c = PagedKVCache(pool(2, 4))
    with pytest.raises(NotImplementedError, match="batch"):
        c.update_and_fetch(torch.zeros(2, H, 1, D), torch.zeros(2, H, 1, D))


def test_lazy_pool_takes_shape_and_dtype_from_first_write():
    p = BlockPool(3, 4)
    assert p.nbytes == 0
    c = PagedKVCache(p)
    k = torch.randn(1, 3, 2, 16, dtype=torch.bfloat16)
    got, _ = c.update_and_fetch(k, k)
    assert p.k.shape == (3, 3, 4, 16) and p.k.dtype == torch.bfloat16
    assert torch.equal(got, k)


def test_pool_refuses_writes_that_would_cast_or_broadcast():
    c = PagedKVCache(pool(2, 4, dtype=torch.bfloat16))
    with pytest.raises(TypeError):
        c.update_and_fetch(*kv(1))  # float32 into a bf16 pool
    one_head = torch.zeros(1, 1, 1, D, dtype=torch.bfloat16)
    with pytest.raises(ValueError):
        c.update_and_fetch(one_head, one_head)
    assert c.offset == 0 and c.block_table == []


def test_mask_is_none_for_one_query_else_causal_over_every_stored_token():
    c = PagedKVCache(pool(4, 4))
    c.update_and_fetch(*kv(5))  # five tokens stored, across a block boundary
    assert c.make_mask(1) is None
    # Query i (position 5 + i) sees keys 0 .. 5 + i.
    want = torch.tensor([[True] * 6 + [False] * 2,
                         [True] * 7 + [False] * 1,
                         [True] * 8])
    assert torch.equal(c.make_mask(3), want)


# -- bit-identity with KVCache ------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [1, 16, 256])
def test_fetch_is_bit_identical_to_kvcache(block_size, dtype):
    gen = torch.Generator().manual_seed(block_size)
    lengths = [37, 1, 1, 15, 1, 256, 3, 1, 300, 1, 1, 40]
    blocks = -(-sum(lengths) // block_size)
    c, ref = PagedKVCache(pool(blocks, block_size, dtype)), KVCache()
    for L in lengths:
        k, v = kv(L, dtype, gen)
        got_k, got_v = c.update_and_fetch(k, v)
        want_k, want_v = ref.update_and_fetch(k, v)
        assert got_k.shape == want_k.shape == (1, H, c.offset, D)
        assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)
    assert len(c.block_table) == blocks


# -- property: shared pool, random operations -------------------------------

# (verb, which cache, tokens); updates weighted up so that pools fill and run out.
op = st.tuples(
    st.sampled_from(["update", "update", "update", "trim", "dispose"]),
    st.integers(0, 2),
    st.integers(1, 20),
)


@settings(deadline=None, max_examples=100)
@given(
    block_size=st.sampled_from([1, 3, 4, 16]),
    num_blocks=st.integers(1, 24),
    n_caches=st.integers(2, 3),
    prefill=st.lists(st.integers(1, 30), min_size=3, max_size=3),
    ops=st.lists(op, min_size=1, max_size=40),
    seed=st.integers(0, 2**16),
)
def test_random_operations_on_a_shared_pool_keep_blocks_owned_once(
    block_size, num_blocks, n_caches, prefill, ops, seed
):
    gen = torch.Generator().manual_seed(seed)
    p = pool(num_blocks, block_size)
    caches = [PagedKVCache(p) for _ in range(n_caches)]
    refs = [KVCache() for _ in range(n_caches)]
    ops = [("update", i, n) for i, n in enumerate(prefill[:n_caches])] + ops
    for name, i, n in ops:
        i %= n_caches
        c = caches[i]
        if name == "update":
            k, v = kv(n, gen=gen)
            needed = -(-(c.offset + n) // block_size) - len(c.block_table)
            if needed > p.num_free:
                before = (c.offset, list(c.block_table), p.num_free)
                with pytest.raises(PagedPoolExhausted) as err:
                    c.update_and_fetch(k, v)
                assert (err.value.requested, err.value.free) == (needed, p.num_free)
                assert (c.offset, c.block_table, p.num_free) == before
            else:
                got_k, got_v = c.update_and_fetch(k, v)
                want_k, want_v = refs[i].update_and_fetch(k, v)
                assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)
        elif name == "trim":
            assert c.trim(n) == refs[i].trim(n)
        else:
            c.dispose()
            refs[i] = KVCache()

        # Invariant: every block is free, or in exactly one table, once.
        owners = [b for cache in caches for b in cache.block_table]
        assert len(owners) == len(set(owners))
        for b in range(num_blocks):
            assert p.is_free(b) != (b in owners)
        assert p.num_free == num_blocks - len(owners)
        for cache, ref in zip(caches, refs):
            assert cache.offset == ref.offset
            assert len(cache.block_table) == -(-cache.offset // block_size)
