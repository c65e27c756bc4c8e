"""KVCache and RotatingKVCache (one sequence, one layer, token-major
``[tokens, H_kv, D]``): storage, masks, and attention through
``attention.sdpa.attend_row`` against a brute-force reference that keeps the
whole history."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedlm.attention.sdpa import attend_row
from pagedlm.cache import STEP, Cache, KVCache, RotatingKVCache

H, D = 2, 8
HQ = 4  # GQA: two query heads per kv head


def kv(L: int, dtype=torch.float32, gen=None):
    k = torch.randn(L, H, D, generator=gen, dtype=torch.float32).to(dtype)
    v = torch.randn(L, H, D, generator=gen, dtype=torch.float32).to(dtype)
    return k, v


def brute_attention(q, k, v, visible):
    """Loop-free but explicit attention, float64, no SDPA: q [L, Hq, D],
    k/v [S, Hkv, D], visible bool [L, S]. Query head h reads kv head h // group."""
    group = q.shape[1] // k.shape[1]
    k = k.double().repeat_interleave(group, dim=1)
    v = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("lhd,shd->hls", q.double(), k) * q.shape[-1] ** -0.5
    scores = scores.masked_fill(~visible[None], float("-inf"))
    return torch.einsum("hls,shd->lhd", scores.softmax(-1), v)


# -- KVCache ---------------------------------------------------------------


CAUSAL_3 = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 1, 1]], dtype=torch.bool)
TOKEN_BYTES = 2 * H * D * 4  # keys and values of one token, float32


@pytest.mark.parametrize("make,held", [
    (KVCache, (STEP, STEP)),  # buffers of STEP tokens from the first update
    (lambda: RotatingKVCache(8), (3, 8)),  # exactly the chunk, then grown to the window
], ids=["KVCache", "RotatingKVCache"])
def test_caches_keep_the_protocol(make, held):
    """One script through the protocol's members only (what the store and the
    prompt cache use), the same answers from each cache: prefill, decode,
    trim and rewrite, dispose. ``held``: tokens the buffers hold after the
    prefill and after the decode token."""
    cache: Cache = make()
    assert isinstance(cache, Cache)
    assert (cache.offset, cache.nbytes) == (0, 0)
    gen = torch.Generator().manual_seed(0)
    k, v = kv(3, gen=gen)
    assert torch.equal(cache.make_mask(3, "cpu"), CAUSAL_3)
    k_all, v_all = cache.update_and_fetch(k, v)
    assert torch.equal(k_all, k) and torch.equal(v_all, v)
    assert cache.offset == 3 and cache.nbytes == held[0] * TOKEN_BYTES
    k1, v1 = kv(1, gen=gen)
    assert cache.make_mask(1) is None  # one query sees every fetched key
    k_all, v_all = cache.update_and_fetch(k1, v1)
    assert torch.equal(k_all, torch.cat([k, k1])) and torch.equal(v_all, torch.cat([v, v1]))
    assert cache.offset == 4 and cache.nbytes == held[1] * TOKEN_BYTES
    assert cache.is_trimmable() and cache.trim(2) == 2 and cache.offset == 2
    k2, v2 = kv(2, gen=gen)
    assert cache.make_mask(2).tolist() == [[True, True, True, False], [True, True, True, True]]
    k_all, v_all = cache.update_and_fetch(k2, v2)
    assert torch.equal(k_all, torch.cat([k[:2], k2])) and torch.equal(v_all, torch.cat([v[:2], v2]))
    assert cache.trim(10) == 4 and cache.offset == 0  # at most what it holds
    cache.dispose()
    assert (cache.offset, cache.nbytes) == (0, 0)


def test_kvcache_grows_in_steps_and_fetch_equals_concatenation():
    torch.manual_seed(0)
    c, ks, vs = KVCache(), [], []
    for L, capacity in [(1, 256), (100, 256), (155, 256), (1, 512), (43, 512), (300, 768)]:
        k, v = kv(L)
        ks.append(k)
        vs.append(v)
        k_all, v_all = c.update_and_fetch(k, v)
        assert c.offset == sum(x.shape[0] for x in ks)
        assert c.keys.shape == (capacity, H, D) and capacity % STEP == 0
        assert k_all.shape == (c.offset, H, D)
        assert torch.equal(k_all, torch.cat(ks))
        assert torch.equal(v_all, torch.cat(vs))
        assert c.nbytes == 2 * H * capacity * D * 4


def test_kvcache_trim_rewinds_and_new_tokens_overwrite():
    torch.manual_seed(0)
    c = KVCache()
    k, v = kv(300)
    c.update_and_fetch(k, v)
    assert c.is_trimmable()
    assert c.trim(50) == 50 and c.offset == 250
    k2, v2 = kv(10)
    k_all, v_all = c.update_and_fetch(k2, v2)
    assert k_all.shape == (260, H, D)
    assert torch.equal(k_all, torch.cat([k[:250], k2]))
    assert torch.equal(v_all, torch.cat([v[:250], v2]))
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


@pytest.mark.parametrize("lengths", [[1, 1, 1], [7, 1, 1, 5, 1], [300, 1, 20]])
def test_kvcache_attention_matches_brute_force_causal(lengths):
    """Chunked prefill and decode through the cache: each chunk's queries over
    (fetched keys, make_mask) equal causal attention over the whole history."""
    gen = torch.Generator().manual_seed(len(lengths))
    c = KVCache()
    k_hist, v_hist = torch.zeros(0, H, D), torch.zeros(0, H, D)
    for L in lengths:
        k, v = kv(L, gen=gen)
        q = torch.randn(L, HQ, D, generator=gen)
        start = c.offset
        mask = c.make_mask(L)
        k_all, v_all = c.update_and_fetch(k, v)
        k_hist, v_hist = torch.cat([k_hist, k]), torch.cat([v_hist, v])
        got = attend_row(q, k_all, v_all, mask, D**-0.5)
        p = torch.arange(start, start + L)[:, None]
        j = torch.arange(k_hist.shape[0])[None, :]
        want = brute_attention(q, k_hist, v_hist, j <= p)
        assert got.shape == (L, HQ, D)
        torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-5)


def test_kvcache_dispose_releases_buffers():
    c = KVCache()
    c.update_and_fetch(*kv(5))
    assert c.nbytes > 0
    c.dispose()
    assert c.nbytes == 0 and c.offset == 0


def test_kvcache_keeps_dtype_and_value_head_dim():
    c = KVCache()
    k = torch.randn(3, H, D, dtype=torch.bfloat16)
    v = torch.randn(3, H, D + 4, dtype=torch.bfloat16)
    k_all, v_all = c.update_and_fetch(k, v)
    assert k_all.dtype == torch.bfloat16 and v_all.shape == (3, H, D + 4)
    assert torch.equal(k_all, k) and torch.equal(v_all, v)


# -- RotatingKVCache against a whole-history reference ---------------------


def window_visible(start: int, L: int, S: int, window: int) -> torch.Tensor:
    """transformers' sliding-window mask over the whole history: query at
    position p sees key j iff 0 <= p - j < window."""
    p = torch.arange(start, start + L)[:, None]
    j = torch.arange(S)[None, :]
    return (p - j >= 0) & (p - j < window)


def assert_rotating_matches_reference(window: int, lengths: list[int], seed: int = 0) -> None:
    """Feed ``lengths`` to a RotatingKVCache; after each update the attention
    over (fetched keys, make_mask) must equal the whole-history reference."""
    gen = torch.Generator().manual_seed(seed)
    c = RotatingKVCache(window)
    k_hist = torch.zeros(0, H, D, dtype=torch.float64)
    v_hist = torch.zeros(0, H, D, dtype=torch.float64)
    for L in lengths:
        k, v = kv(L, dtype=torch.float64, gen=gen)
        q = torch.randn(L, HQ, D, generator=gen, dtype=torch.float64)
        start = c.offset
        mask = c.make_mask(L)
        k_all, v_all = c.update_and_fetch(k, v)
        k_hist, v_hist = torch.cat([k_hist, k]), torch.cat([v_hist, v])
        assert c.offset == start + L
        assert k_all.shape[1:] == (H, D)
        if L == 1:
            assert k_all.shape[0] == min(start + 1, window)
        if mask is not None:
            assert mask.shape == (L, k_all.shape[0])
        got = attend_row(q, k_all, v_all, mask, D**-0.5)
        want = brute_attention(q, k_hist, v_hist, window_visible(start, L, k_hist.shape[0], window))
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
        (8, [1] * 11 + [3] + [1] * 5 + [2, 2]),  # multi-token mid-ring, back to ring
        (1, [1, 1, 4, 1, 1, 3]),  # window of one: each token sees itself
        (300, [200, 1, 150, 1, 1]),  # linear buffer grows by STEP, then wraps
    ],
)
def test_rotating_attention_matches_whole_history_window(window, lengths):
    assert_rotating_matches_reference(window, lengths)


@settings(deadline=None, max_examples=100)
@given(
    window=st.integers(1, 12),
    lengths=st.lists(st.one_of(st.just(1), st.integers(1, 20)), min_size=1, max_size=25),
    seed=st.integers(0, 2**16),
)
def test_rotating_any_update_sequence_matches_reference(window, lengths, seed):
    assert_rotating_matches_reference(window, lengths, seed)


@settings(deadline=None, max_examples=50)
@given(lengths=st.lists(st.integers(1, 40), min_size=1, max_size=12), seed=st.integers(0, 2**16))
def test_kvcache_any_update_sequence_fetches_the_whole_history(lengths, seed):
    gen = torch.Generator().manual_seed(seed)
    c, hist = KVCache(), torch.zeros(0, H, D)
    for L in lengths:
        k, v = kv(L, gen=gen)
        hist = torch.cat([hist, k])
        k_all, v_all = c.update_and_fetch(k, v)
        assert torch.equal(k_all, hist) and torch.equal(v_all[-L:], v)
        assert c.keys.shape[0] == -(-hist.shape[0] // STEP) * STEP


def test_rotating_decode_holds_exactly_the_window_in_memory():
    c = RotatingKVCache(16)
    c.update_and_fetch(*kv(40))  # multi-token: returns kept + new
    assert c.keys.shape[0] == 40
    for _ in range(50):
        k_all, _ = c.update_and_fetch(*kv(1))
        assert k_all.shape[0] == 16
    assert c.keys.shape == (16, H, D) and c.nbytes == 2 * H * 16 * D * 4


def test_rotating_single_token_fetch_is_exactly_the_window_as_a_set():
    """After wrap, a single-token fetch is the last ``window`` keys, in ring
    order (order is irrelevant without a mask, but the set must be exact)."""
    torch.manual_seed(0)
    c, hist = RotatingKVCache(5), []
    for _ in range(13):
        k, v = kv(1)
        hist.append(k)
        k_all, _ = c.update_and_fetch(k, v)
    want = torch.cat(hist[-5:])
    got = k_all
    assert got.shape == want.shape
    key = lambda t: sorted(t.reshape(t.shape[0], -1).tolist())  # noqa: E731
    assert key(got) == key(want)


def test_rotating_multi_token_after_wrap_returns_window_minus_one_plus_new():
    torch.manual_seed(0)
    c, hist = RotatingKVCache(8), []
    for _ in range(12):
        k, v = kv(1)
        hist.append(k)
        c.update_and_fetch(k, v)
    mask = c.make_mask(5)
    k_new, v_new = kv(5)
    k_all, _ = c.update_and_fetch(k_new, v_new)
    assert k_all.shape == (7 + 5, H, D) and mask.shape == (5, 12)
    # Temporal order: the 7 newest old tokens, then the new ones.
    assert torch.equal(k_all, torch.cat(hist[-7:] + [k_new]))
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
    assert torch.equal(k_all, torch.cat([k[:4], k2]))
    for _ in range(4):
        c.update_and_fetch(*kv(1))
    assert c.offset == 9 and not c.is_trimmable()
    assert c.trim(1) == 0 and c.offset == 9


def test_rotating_trim_after_single_token_decode_then_multi_token_update():
    """Trim after decode steps (still linear), then a chunk: the fetch is the
    kept prefix and the chunk, in order."""
    torch.manual_seed(0)
    c = RotatingKVCache(8)
    k, v = kv(3)
    c.update_and_fetch(k, v)
    extra = [kv(1) for _ in range(2)]
    for e in extra:
        c.update_and_fetch(*e)
    assert c.trim(3) == 3 and c.offset == 2
    k2, v2 = kv(4)
    k_all, v_all = c.update_and_fetch(k2, v2)
    assert torch.equal(k_all, torch.cat([k[:2], k2])) and torch.equal(v_all, torch.cat([v[:2], v2]))


def test_rotating_dispose_releases_buffers():
    c = RotatingKVCache(4)
    c.update_and_fetch(*kv(6))
    c.dispose()
    assert c.nbytes == 0 and c.offset == 0
    with pytest.raises(ValueError):
        RotatingKVCache(0)
