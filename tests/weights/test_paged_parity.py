"""The parity gate: paged and default caches give the same greedy tokens, exactly.

Paging changes where keys and values are stored, not the arithmetic, so the
bar is tolerance 0. Prompts span several blocks at every block size, and the
Gemma prompt is longer than its 512-token sliding window, so its ring
buffers wrap while the global layers are paged.
"""

import argparse
import inspect

import pytest
import torch

from pagedlm.generate import make_cache, maybe_page_kv, stream_generate
from pagedlm.loading import load
from pagedlm.options import GenerateOptions, PagedKvOptions

pytestmark = pytest.mark.weights

MODELS = ["gemma3-270m", "smollm2-135m-instruct"]
GEN = 32


@pytest.fixture(scope="module", params=MODELS)
def loaded(request):
    model, tokenizer = load(request.param, "cpu", torch.float32)
    return request.param, model, tokenizer


def _prompt(tokenizer, n: int) -> list[int]:
    ids = tokenizer.encode(inspect.getsource(argparse))[:n]
    assert len(ids) == n
    return ids


def _greedy(model, tokenizer, ids, paged=None, cache=None) -> list[int]:
    options = GenerateOptions(max_tokens=GEN, ignore_eos=True, paged_kv=paged)
    out = [r.token for r in stream_generate(model, tokenizer, ids, options, cache=cache)]
    assert len(out) == GEN
    return out


def test_paged_greedy_trajectory_equals_default_at_every_block_size(loaded):
    name, model, tokenizer = loaded
    ids = _prompt(tokenizer, 640)  # > 2 blocks at 256, > Gemma's 512-token window
    expected = _greedy(model, tokenizer, ids)
    for block_size in (16, 64, 256):
        got = _greedy(model, tokenizer, ids, PagedKvOptions(block_size))
        assert got == expected, f"{name}: block size {block_size} diverged"


def test_paging_replaces_only_full_attention_caches(loaded):
    name, model, _ = loaded
    cache = make_cache(model)
    kinds_before = [type(c).__name__ for c in cache]
    assert maybe_page_kv(cache, PagedKvOptions(16), 100, model)
    for before, after in zip(kinds_before, cache):
        expected = "PagedKVCache" if before == "KVCache" else before
        assert type(after).__name__ == expected
    if name.startswith("gemma3"):
        assert "RotatingKVCache" in kinds_before  # the mixed shape is the normal one
    for c in cache:
        c.dispose()


def test_trim_then_continue_matches_default(loaded):
    """Generate, roll back 5 tokens, continue: same tokens with and without paging.

    The prompt stays inside Gemma's window so that its ring buffers are still
    trimmable; at block size 16 the rollback crosses a block boundary."""
    _, model, tokenizer = loaded
    ids = _prompt(tokenizer, 300)
    trajectories = []
    for paged in (None, PagedKvOptions(16)):
        cache = make_cache(model)
        if paged:
            assert maybe_page_kv(cache, paged, len(ids) + 2 * GEN, model)
        first = _greedy(model, tokenizer, ids, cache=cache)
        assert cache[0].offset == len(ids) + GEN - 1
        for c in cache:
            assert c.trim(5) == 5
        kept = ids + first[: GEN - 5]  # the cache holds all but its last token
        second = _greedy(model, tokenizer, kept, cache=cache)
        trajectories.append((first, second))
        for c in cache:
            c.dispose()
    assert trajectories[0] == trajectories[1]
