"""PromptCache: longest-prefix reuse, trimming, LRU byte budget, refusals."""

from __future__ import annotations

import pytest
import torch

from pagedlm.cache.kv import KVCache, RotatingKVCache
from pagedlm.cache.prompt import PromptCache, common_prefix

H, D = 2, 4


def kv_for(tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Synthetic token-major ``[L, H, D]`` keys/values that depend on each
    token and its position."""
    t = torch.tensor(tokens, dtype=torch.float32)
    pos = torch.arange(len(tokens), dtype=torch.float32)
    k = (t * 10 + pos)[:, None, None].expand(len(tokens), H, D).contiguous()
    return k, -k


def filled(tokens: list[int], layers: int = 2, make=KVCache) -> list:
    cache = [make() for _ in range(layers)]
    for c in cache:
        c.update_and_fetch(*kv_for(tokens))
    return cache


def test_common_prefix():
    assert common_prefix([1, 2, 3], [1, 2, 4]) == 2
    assert common_prefix([1, 2], [1, 2, 3]) == 2
    assert common_prefix([], [1]) == 0
    assert common_prefix([5], [1]) == 0


def test_empty_cache_misses():
    pc = PromptCache(1 << 20)
    assert pc.take([1, 2, 3]) == (None, 0)
    assert (pc.hits, pc.misses) == (0, 1)


def test_extension_reuses_whole_entry_and_removes_it_from_the_lru():
    pc = PromptCache(1 << 20)
    cache = filled([1, 2, 3])
    pc.put([1, 2, 3], cache)
    assert len(pc) == 1 and pc.nbytes == sum(c.nbytes for c in cache) > 0
    got, n = pc.take([1, 2, 3, 4, 5])
    assert got is cache and n == 3
    assert all(c.offset == 3 for c in got)
    assert len(pc) == 0 and pc.nbytes == 0
    assert (pc.hits, pc.misses) == (1, 0)


def test_identical_prompt_leaves_one_token_to_prefill():
    pc = PromptCache(1 << 20)
    pc.put([1, 2, 3, 4], filled([1, 2, 3, 4]))
    got, n = pc.take([1, 2, 3])
    assert n == 2 and all(c.offset == 2 for c in got)


def test_divergent_prompt_trims_to_common_prefix_and_matches_a_fresh_cache():
    pc = PromptCache(1 << 20)
    pc.put([1, 2, 3, 4, 5], filled([1, 2, 3, 4, 5]))
    got, n = pc.take([1, 2, 9, 9])
    assert n == 2
    fresh = filled([1, 2])
    k_new, v_new = kv_for([1, 2, 9, 9])
    for reused, ref in zip(got, fresh):
        a = reused.update_and_fetch(k_new[2:], v_new[2:])
        b = ref.update_and_fetch(k_new[2:], v_new[2:])
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_longest_prefix_wins_and_the_others_stay():
    pc = PromptCache(1 << 20)
    short, longer, other = filled([1, 2]), filled([1, 2, 3, 4]), filled([7, 8, 9])
    pc.put([1, 2], short)
    pc.put([1, 2, 3, 4], longer)
    pc.put([7, 8, 9], other)
    got, n = pc.take([1, 2, 3, 4, 6])
    assert got is longer and n == 4
    assert len(pc) == 2


def test_no_common_prefix_is_a_miss_and_keeps_entries():
    pc = PromptCache(1 << 20)
    pc.put([1, 2], filled([1, 2]))
    assert pc.take([3, 4]) == (None, 0)
    assert len(pc) == 1 and pc.misses == 1


def test_single_token_prompt_cannot_reuse_anything():
    pc = PromptCache(1 << 20)
    pc.put([1, 2], filled([1, 2]))
    assert pc.take([1]) == (None, 0)
    assert len(pc) == 1


def test_lru_evicts_oldest_entries_to_stay_under_budget():
    one = sum(c.nbytes for c in filled([1]))
    pc = PromptCache(2 * one)
    a, b, c = filled([1]), filled([2]), filled([3])
    pc.put([1], a)
    pc.put([2], b)
    pc.put([3], c)
    assert len(pc) == 2 and pc.nbytes == 2 * one
    assert a[0].keys is None, "the evicted entry is disposed"
    assert b[0].keys is not None and c[0].keys is not None
    assert pc.take([1, 5]) == (None, 0)
    got, _ = pc.take([2, 5])
    assert got is b


def test_taking_refreshes_recency():
    one = sum(c.nbytes for c in filled([1]))
    pc = PromptCache(2 * one)
    a, b = filled([1]), filled([2])
    pc.put([1], a)
    pc.put([2], b)
    got, _ = pc.take([1, 9])
    pc.put([1], got)  # back in as the newest entry
    pc.put([3], filled([3]))
    assert b[0].keys is None and a[0].keys is not None


def test_entry_larger_than_budget_is_disposed_not_stored():
    big = filled([1, 2, 3])
    pc = PromptCache(sum(c.nbytes for c in big) - 1)
    pc.put([1, 2, 3], big)
    assert len(pc) == 0 and pc.nbytes == 0 and big[0].keys is None


def test_zero_budget_disables():
    pc = PromptCache(0)
    cache = filled([1, 2])
    pc.put([1, 2], cache)
    assert len(pc) == 0 and cache[0].keys is None
    assert pc.take([1, 2, 3]) == (None, 0)


def test_wrapped_rotating_cache_needing_trim_is_disposed_as_a_miss():
    pc = PromptCache(1 << 20)
    tokens = [1, 2, 3, 4, 5, 6]
    cache = filled(tokens, make=lambda: RotatingKVCache(4))
    assert not cache[0].is_trimmable()
    pc.put(tokens, cache)
    assert pc.take([1, 2, 3, 9]) == (None, 0)
    assert len(pc) == 0 and cache[0].keys is None and pc.misses == 1


def test_wrapped_rotating_cache_needing_no_trim_is_reused():
    pc = PromptCache(1 << 20)
    tokens = [1, 2, 3, 4, 5, 6]
    cache = filled(tokens, make=lambda: RotatingKVCache(4))
    pc.put(tokens, cache)
    got, n = pc.take(tokens + [7, 8])
    assert got is cache and n == 6


def test_unwrapped_rotating_cache_is_trimmed():
    pc = PromptCache(1 << 20)
    cache = filled([1, 2, 3], make=lambda: RotatingKVCache(8))
    pc.put([1, 2, 3], cache)
    got, n = pc.take([1, 2, 7])
    assert n == 2 and all(c.offset == 2 for c in got)


@pytest.mark.parametrize("bad", [None, "not a cache", object()])
def test_put_refuses_none_and_foreign_layers_and_keeps_nothing(bad):
    """The paged store's row caches hold None for the layers in the pools;
    such a list (or any non-KVCache/RotatingKVCache layer) must be refused."""
    pc = PromptCache(1 << 20)
    good = filled([1, 2])
    with pytest.raises(TypeError, match="paged requests bypass"):
        pc.put([1, 2], [good[0], bad, good[1]])
    assert len(pc) == 0 and pc.nbytes == 0
    assert pc.take([1, 2, 3]) == (None, 0)


def test_put_refuses_a_token_count_the_cache_does_not_hold():
    pc = PromptCache(1 << 20)
    with pytest.raises(ValueError, match="holds 2 tokens"):
        pc.put([1, 2, 3], filled([1, 2]))


def test_clear_disposes_everything():
    pc = PromptCache(1 << 20)
    a = filled([1, 2])
    pc.put([1, 2], a)
    pc.clear()
    assert len(pc) == 0 and pc.nbytes == 0 and a[0].keys is None
