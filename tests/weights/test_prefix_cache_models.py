"""Prefix caching on the real models (CPU, float32): a request served from
cached blocks gives the cold request's greedy tokens, with every chosen and
top-5 logprob within 1e-4; n > 1 continuations and concurrent requests that
share a prefix give their solo outputs the same way. The shared prefix is
longer than Gemma's 512-token sliding window, so its sliding layers start
from ring buffers refilled out of the pools."""

import argparse
import inspect

import pytest

from pagedlm.llm import LLM
from pagedlm.params import SamplingParams

pytestmark = pytest.mark.weights

MODELS = ["gemma3-270m", "smollm2-135m-instruct"]
ATOL = 1e-4
PARAMS = SamplingParams(max_tokens=12, ignore_eos=True, logprobs=5)


@pytest.fixture(scope="module", params=MODELS)
def loaded(request, float32_model):
    model, tokenizer = float32_model(request.param)  # shared, read only (tests/weights/conftest.py)
    return request.param, model, tokenizer


def _workload(tokenizer) -> tuple[list[int], list[list[int]]]:
    ids = tokenizer.encode(inspect.getsource(argparse))
    return ids[:600], [ids[3000 + 40 * i : 3000 + 40 * i + 25 + 3 * i] for i in range(3)]


def _llm(model, tokenizer, caching: bool) -> LLM:
    return LLM(model, tokenizer=tokenizer, paged_kv=True, block_size=16, prefix_caching=caching,
               kv_budget_bytes=1 << 30, max_num_batched_tokens=256, max_model_len=4096)


def _same(got, want, what: str) -> None:
    assert got.token_ids == want.token_ids, what
    for a, b in zip(got.logprobs, want.logprobs):  # {token: Logprob}: the chosen token, then the top 5
        assert list(a) == list(b), what
        assert max(abs(a[t].logprob - b[t].logprob) for t in a) <= ATOL, what


def test_a_cached_prefix_gives_the_cold_requests_tokens_and_logprobs(loaded):
    name, model, tokenizer = loaded
    prefix, questions = _workload(tokenizer)
    warm_llm = _llm(model, tokenizer, caching=True)
    warm_llm.generate(prefix + questions[0], PARAMS, use_tqdm=False)
    (warm,) = warm_llm.generate(prefix + questions[1], PARAMS, use_tqdm=False)
    assert warm.num_cached_tokens == len(prefix) // 16 * 16
    (cold,) = _llm(model, tokenizer, caching=False).generate(prefix + questions[1], PARAMS, use_tqdm=False)
    assert cold.num_cached_tokens == 0
    _same(warm.outputs[0], cold.outputs[0], name)


def test_n_continuations_and_concurrent_sharers_equal_their_solo_outputs(loaded):
    name, model, tokenizer = loaded
    prefix, questions = _workload(tokenizer)
    prompts = [prefix + q for q in questions]
    solo_llm = _llm(model, tokenizer, caching=False)
    solo = [solo_llm.generate(p, PARAMS, use_tqdm=False)[0].outputs[0] for p in prompts]
    llm = _llm(model, tokenizer, caching=True)
    params = [PARAMS, SamplingParams(max_tokens=12, ignore_eos=True, logprobs=5, n=2), PARAMS]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.num_cached_tokens for o in outs] == [0] + [len(prefix) // 16 * 16] * 2  # computed once
    assert len(outs[1].outputs) == 2
    for out, want in zip(outs, solo):
        for got in out.outputs:
            _same(got, want, name)
