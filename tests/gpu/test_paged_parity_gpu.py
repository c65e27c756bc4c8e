"""The parity gate on CUDA: bf16, random weights with real shapes.

Skipped without CUDA; run on the GPU machine. Random weights are fine here:
the claim is that paging changes storage, not arithmetic, so both paths must
give the same greedy tokens on any weights.
"""

from pathlib import Path

import pytest
import torch

from pagedlm.bench.decode import load_random
from pagedlm.generate import make_cache, maybe_page_kv, stream_generate
from pagedlm.options import GenerateOptions, PagedKvOptions

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

CONFIGS = Path(__file__).resolve().parents[2] / "benchmarks" / "configs"
GEN = 48


@pytest.fixture(scope="module", params=["qwen3-0.6b", "gemma3-270m"])
def loaded(request):
    model, tokenizer = load_random(str(CONFIGS / request.param), "cuda", torch.bfloat16)
    return model, tokenizer


def _greedy(model, tokenizer, ids, paged=None, cache=None):
    options = GenerateOptions(max_tokens=GEN, ignore_eos=True, paged_kv=paged)
    return [r.token for r in stream_generate(model, tokenizer, ids, options, cache=cache)]


def _prompt(vocab: int, n: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(1)).tolist()


def test_paged_bf16_trajectory_equals_default(loaded):
    model, tokenizer = loaded
    ids = _prompt(tokenizer.vocab_size, 700)
    expected = _greedy(model, tokenizer, ids)
    assert len(set(expected)) > 1, "degenerate trajectory proves nothing"
    for block_size in (16, 64, 256):
        assert _greedy(model, tokenizer, ids, PagedKvOptions(block_size)) == expected, block_size


def test_paged_bf16_trim_then_continue_matches_default(loaded):
    model, tokenizer = loaded
    ids = _prompt(tokenizer.vocab_size, 300)
    runs = []
    for paged in (None, PagedKvOptions(16)):
        cache = make_cache(model)
        if paged:
            assert maybe_page_kv(cache, paged, len(ids) + 2 * GEN, model), "nothing was paged"
        first = _greedy(model, tokenizer, ids, cache=cache)
        for c in cache:
            assert c.trim(7) == 7
        second = _greedy(model, tokenizer, ids + first[: GEN - 7], cache=cache)
        runs.append((first, second))
        for c in cache:
            c.dispose()
    assert runs[0] == runs[1]


def test_paged_requests_leave_no_memory_behind(loaded):
    model, tokenizer = loaded
    ids = _prompt(tokenizer.vocab_size, 500)
    _greedy(model, tokenizer, ids, PagedKvOptions(16))
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    for _ in range(3):
        _greedy(model, tokenizer, ids, PagedKvOptions(16))
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == before
