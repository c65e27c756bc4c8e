"""The parity gate: the paged store gives the default store's tokens and
logprobs, exactly, for the same schedule.

Paging changes where keys and values are stored, not the arithmetic, so the
bar is tolerance 0. Several prompts share each step (continuous batching);
they span several blocks at every block size, and one is longer than
Gemma's 512-token sliding window, so its ring buffers wrap while the global
layers are paged.
"""

import argparse
import inspect

import pytest

from pagedlm.cache.kv import RotatingKVCache
from pagedlm.llm import LLM
from pagedlm.params import SamplingParams

pytestmark = pytest.mark.weights

MODELS = ["gemma3-270m", "smollm2-135m-instruct"]
GEN = 16
BUDGET = 1 << 30
MAX_MODEL_LEN = 4096  # the pool must hold one sequence of it; with prefix caching Gemma's pool keeps every layer


@pytest.fixture(scope="module", params=MODELS)
def loaded(request, float32_model):
    model, tokenizer = float32_model(request.param)  # shared, read only (tests/weights/conftest.py)
    return request.param, model, tokenizer


def _prompts(tokenizer) -> list[list[int]]:
    ids = tokenizer.encode(inspect.getsource(argparse))
    return [ids[:640], ids[1000:1100], ids[2000:2037]]  # > 2 blocks at 256, > Gemma's window


def _run(model, tokenizer, **kw):
    llm = LLM(model, tokenizer=tokenizer, kv_budget_bytes=BUDGET, max_num_batched_tokens=256,
              max_model_len=MAX_MODEL_LEN, **kw)
    params = SamplingParams(max_tokens=GEN, ignore_eos=True, logprobs=2)
    outs = llm.generate(_prompts(tokenizer), params, use_tqdm=False)
    assert llm.stats.preemptions == 0
    return llm, [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


def test_paged_store_equals_default_store_exactly_at_every_block_size(loaded):
    name, model, tokenizer = loaded
    _, expected = _run(model, tokenizer)
    assert all(len(tokens) == GEN for tokens, _ in expected)
    for block_size in (16, 64, 256):
        llm, got = _run(model, tokenizer, paged_kv=True, block_size=block_size)
        assert llm.engine.paged_kv
        assert got == expected, f"{name}: block size {block_size} diverged"  # logprob floats too


def test_only_full_attention_layers_are_paged(loaded):
    name, model, tokenizer = loaded
    llm = LLM(model, tokenizer=tokenizer, paged_kv=True, block_size=16, kv_budget_bytes=BUDGET,
              max_model_len=MAX_MODEL_LEN)
    specs = model.kv_spec()
    store = llm.engine.store
    assert llm.engine.layout.paged_layers == {i for i, s in enumerate(specs) if s.window is None}
    store.add_row(-1)
    row = store.pop_row(-1)
    assert [c is None for c in row] == [s.window is None for s in specs]
    assert all(isinstance(c, RotatingKVCache) for c in row if c is not None)
    if name.startswith("gemma3"):
        assert any(s.window for s in specs) and any(s.window is None for s in specs)  # the mixed shape
