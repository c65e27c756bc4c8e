"""KVCache and RotatingKVCache: storage, masks, and attention against a
brute-force reference that keeps the whole history."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedlm.cache import STEP, Cache, KVCache, RotatingKVCache

H, D = 2, 8


def kv(L: int, B: int = 1, dtype=torch.float32, gen=None):
    k = torch.randn(B, H, L, D, generator=gen, dtype=torch.float32).to(dtype)
    v = torch.randn(B, H, L, D, generator=gen, dtype=torch.float32).to(dtype)
    return k, v


# -- KVCache ---------------------------------------------------------------


def test_caches_satisfy_the_protocol():
    assert isinstance(KVCache(), Cache)
    assert isinstance(RotatingKVCache(4), Cache)


def test_kvcache_grows_in_steps_and_fetch_equals_concatenation():
    torch.manual_seed(0)
    c, ks, vs = KVCache(), [], []
    for L, capacity in [(1, 256), (100, 256), (155, 256), (1, 512), (43, 512), (300, 768)]:
        k, v = kv(L, B=2)
        ks.append(k)
        vs.append(v)
        k_all, v_all = c.update_and_fetch(k, v)
        assert c.offset == sum(x.shape[2] for x in ks)
        assert c.keys.shape[2] == capacity and capacity % STEP == 0
        assert torch.equal(k_all, torch.cat(ks, dim=2))
        assert torch.equal(v_all, torch.cat(vs, dim=2))
        assert c.nbytes == 2 * 2 * H * capacity * D * 4


def test_kvcache_trim_rewinds_and_new_tokens_overwrite():
    torch.manual_seed(0)
    c = KVCache()
    k, v = kv(300)
    c.update_and_fetch(k, v)
    assert c.is_trimmable()
    assert c.trim(50) == 50 and c.offset == 250
    k2, v2 = kv(10)
    k_all, v_all = c.update_and_fetch(k2, v2)
    assert k_all.shape[2] == 260
    assert torch.equal(k_all, torch.cat([k[:, :, :250], k2], dim=2))
    assert torch.equal(v_all, torch.cat([v[:, :, :250], v2], dim=2))
    assert c.trim(1000) == 260 and c.offset == 0


def test_kvcache_mask_is_none_for_one_query_else_causal_from_offset():
    c = KVCache()
    assert c.make_mask(1) is None
    m = c.make_mask(3)
    assert torch.equal(m, torch.tensor([[1, 0, 0], [1, 1, 0], [1, 1, 1]], dtype=torch.bool))
    c.update_and_fetch(*kv(2))
    m = c.make_mask(3)
    assert m.shape == (3, 5) and m.dtype == torch.bool
    expected = torch.tensor(
        [[1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 1, 1, 1, 1]], dtype=torch.bool
    )
    assert torch.equal(m, expected)
    assert c.make_mask(1) is None


def test_kvcache_dispose_releases_buffers():
    c = KVCache()
    c.update_and_fetch(*kv(5))
    assert c.nbytes > 0
    c.dispose()
    assert c.nbytes == 0 and c.offset == 0


def test_kvcache_keeps_dtype_and_value_head_dim():
    c = KVCache()
    k = torch.randn(1, H, 3, D, dtype=torch.bfloat16)
    v = torch.randn(1, H, 3, D + 4, dtype=torch.bfloat16)
    k_all, v_all = c.update_and_fetch(k, v)
    assert k_all.dtype == torch.bfloat16 and v_all.shape == (1, H, 3, D + 4)
    assert torch.equal(v_all, v)


# -- RotatingKVCache against a whole-history reference ---------------------


def window_reference(q, k_hist, v_hist, start: int, window: int):
    """Attention of queries at positions start.. over the full history with
    transformers' sliding-window mask: key j visible iff 0 <= p - j < window."""
    p = torch.arange(start, start + q.shape[2])[:, None]
    j = torch.arange(k_hist.shape[2])[None, :]
    mask = (p - j >= 0) & (p - j < window)
    return F.scaled_dot_product_attention(q, k_hist, v_hist, attn_mask=mask)


def run_rotating(window: int, lengths: list[int], seed: int = 0) -> None:
    """Feed ``lengths`` to a RotatingKVCache; after each update the attention
    over (fetched keys, make_mask) must equal the whole-history reference."""
    gen = torch.Generator().manual_seed(seed)
    c = RotatingKVCache(window)
    k_hist = torch.zeros(1, H, 0, D, dtype=torch.float64)
    v_hist = torch.zeros(1, H, 0, D, dtype=torch.float64)
    for L in lengths:
        k, v = kv(L, dtype=torch.float64, gen=gen)
        q = torch.randn(1, H, L, D, generator=gen, dtype=torch.float64)
        start = c.offset
        mask = c.make_mask(L)
        k_all, v_all = c.update_and_fetch(k, v)
        k_hist, v_hist = torch.cat([k_hist, k], 2), torch.cat([v_hist, v], 2)
        assert c.offset == start + L
        if L == 1:
            assert k_all.shape[2] == min(start + 1, window)
        if mask is not None:
            assert mask.shape == (L, k_all.shape[2])
        got = F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask)
        want = window_reference(q, k_hist, v_hist, start, window)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


@pytest.mark.parametrize(
    "window,lengths",
    [
        (8, [1] * 30),  # decode only, wraps several times
        (8, [5] + [1] * 20),  # short prefill, then wrap by single tokens
        (8, [20] + [1] * 12),  # prefill longer than the window
        (8, [8] + [1] * 3 + [4] + [1] * 10),  # multi-token update after wrap
        (8, [3, 3, 3, 3, 3, 1, 1, 7, 1]),  # chunked prefill across the wrap
        (8, [7, 1, 1, 30, 2, 1]),  # chunk bigger than the window after wrap
        (1, [1, 1, 4, 1, 1, 3]),  # window of one: each token sees itself
        (300, [200, 1, 150, 1, 1]),  # linear buffer grows by STEP, then wraps
    ],
)
def test_rotating_attention_matches_whole_history_window(window, lengths):
    run_rotating(window, lengths)


@settings(deadline=None, max_examples=100)
@given(
    window=st.integers(1, 12),
    lengths=st.lists(st.one_of(st.just(1), st.integers(1, 20)), min_size=1, max_size=25),
)
def test_rotating_any_update_sequence_matches_reference(window, lengths):
    run_rotating(window, lengths)


def test_rotating_decode_holds_exactly_the_window_in_memory():
    c = RotatingKVCache(16)
    c.update_and_fetch(*kv(40))  # multi-token: returns kept + new
    assert c.keys.shape[2] == 40
    for _ in range(50):
        k_all, _ = c.update_and_fetch(*kv(1))
        assert k_all.shape[2] == 16
    assert c.keys.shape[2] == 16 and c.nbytes == 2 * H * 16 * D * 4


def test_rotating_multi_token_after_wrap_returns_window_minus_one_plus_new():
    c = RotatingKVCache(8)
    for _ in range(12):
        c.update_and_fetch(*kv(1))
    mask = c.make_mask(5)
    k_all, _ = c.update_and_fetch(*kv(5))
    assert k_all.shape[2] == 7 + 5 and mask.shape == (5, 12)
    # First query sees all 7 kept tokens and itself; last sees the window ending at it.
    assert mask[0].tolist() == [True] * 8 + [False] * 4
    assert mask[4].tolist() == [False] * 4 + [True] * 8


def test_rotating_trims_only_before_the_window_fills():
    torch.manual_seed(0)
    c = RotatingKVCache(8)
    k, v = kv(6)
    c.update_and_fetch(k, v)
    assert c.is_trimmable() and c.trim(2) == 2 and c.offset == 4
    k2, v2 = kv(1)
    k_all, _ = c.update_and_fetch(k2, v2)
    assert torch.equal(k_all, torch.cat([k[:, :, :4], k2], 2))
    for _ in range(4):
        c.update_and_fetch(*kv(1))
    assert c.offset == 9 and not c.is_trimmable()
    assert c.trim(1) == 0 and c.offset == 9


def test_rotating_dispose_releases_buffers():
    c = RotatingKVCache(4)
    c.update_and_fetch(*kv(6))
    c.dispose()
    assert c.nbytes == 0 and c.offset == 0
    with pytest.raises(ValueError):
        RotatingKVCache(0)
