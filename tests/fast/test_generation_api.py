"""Generation through the public API only (`pagedlm.stream_generate` /
`pagedlm.generate` with `SamplingParams`), on tiny random-weight models:
what was reached only through real weights before. Written against the API,
not the loop, so that they hold for any engine behind it."""

from __future__ import annotations

import pytest

import pagedlm
from pagedlm import SamplingParams
from pagedlm.batch.engine import LLMEngine
from pagedlm.options import DEVICE_DEFAULTS, EngineOptions
from tests.helpers import tiny_tokenizer

CHUNK = DEVICE_DEFAULTS["cpu"]["max_num_batched_tokens"]  # prompt tokens per step of a lone request


def run(model, tokenizer, prompt, **kw):
    """(tokens, text, finish_reason, last response) of one request."""
    steps = list(pagedlm.stream_generate(model, tokenizer, prompt, SamplingParams(**kw)))
    tokens = [s.token for s in steps if s.token is not None]
    return tokens, "".join(s.text for s in steps), steps[-1].finish_reason, steps[-1]


def prompt_ids(n: int, seed: int = 0) -> list[int]:
    return [(7 * i * i + 13 * i + seed) % 250 + 3 for i in range(n)]  # no control tokens


def test_prompt_logprobs_across_prefill_chunk_boundaries_match_shorter_prompts(model, tokenizer):
    ids = prompt_ids(2 * CHUNK + 40)
    steps = list(pagedlm.stream_generate(model, tokenizer, ids,
                                         SamplingParams(max_tokens=1, prompt_logprobs=1)))
    scored = steps[0].prompt_logprobs
    assert len(scored) == len(ids) - 1  # every prompt token after the first
    # scored[p - 1] is about ids[p] given ids[:p]; its top-1 is the top-1 of
    # the first token generated after the prompt ids[:p] (a prompt of one chunk
    # or less where p <= CHUNK). (Not the token greedy picks: special tokens
    # are scored but not sampled.)
    for p in (CHUNK - 1, CHUNK, CHUNK + 1, 2 * CHUNK - 1, 2 * CHUNK, 2 * CHUNK + 1):
        chosen_lp, top = scored[p - 1]
        first = list(pagedlm.stream_generate(model, tokenizer, ids[:p],
                                             SamplingParams(max_tokens=1, logprobs=1)))[0]
        ((want_id, want_lp),) = first.logprob[1]
        assert top[0][0] == want_id, p
        assert top[0][1] == pytest.approx(want_lp, abs=1e-4), p
        assert chosen_lp <= top[0][1] + 1e-6


def test_length_stop_id_and_stop_string_each_end_the_request_where_they_should(model, tokenizer):
    prompt = prompt_ids(20, seed=1)
    free, free_text, finish, last = run(model, tokenizer, prompt, max_tokens=16, ignore_eos=True)
    assert finish == "length" and len(free) == 16 and last.generation_tokens == 16
    assert free_text == tokenizer.decode(free)

    # A stop id: the request ends on its first occurrence; its text is not emitted.
    # (Picked after whole characters: bytes of a character still incomplete at a
    # stop id are dropped today, while at length they flush as U+FFFD.)
    k = next(i for i in range(3, 16)
             if free[i] not in free[:i] and not tokenizer.decode(free[:i]).endswith("\ufffd"))
    tokens, text, finish, _ = run(model, tokenizer, prompt, max_tokens=16, ignore_eos=True,
                                  stop_token_ids=[free[k]])
    assert finish == "stop" and tokens == free[: k + 1]
    assert text == tokenizer.decode(free[:k])

    # A stop string: the text ends just before it.
    stop = next(free_text[i : i + 2] for i in range(4, len(free_text) - 2)
                if free_text[i : i + 2].isascii() and free_text.find(free_text[i : i + 2]) == i)
    tokens, text, finish, _ = run(model, tokenizer, prompt, max_tokens=16, ignore_eos=True, stop=[stop])
    assert finish == "stop" and text == free_text[: free_text.index(stop)]
    assert tokens == free[: len(tokens)] and len(tokens) < 16

    # Length wins when neither comes first.
    tokens, _, finish, _ = run(model, tokenizer, prompt, max_tokens=5, ignore_eos=True,
                               stop_token_ids=[free[k]] if k >= 5 else [], stop=["\x00never"])
    assert finish == "length" and tokens == free[:5]


def test_eos_ends_the_request_unless_ignore_eos(model):
    prompt = prompt_ids(20, seed=2)
    base = tiny_tokenizer()
    free, *_ = run(model, base, prompt, max_tokens=12, ignore_eos=True)
    k = next(i for i in range(2, 12) if free[i] not in free[:i])
    eos_at_k = tiny_tokenizer()
    eos_at_k.eos_token_ids = {free[k]}
    tokens, _, finish, _ = run(model, eos_at_k, prompt, max_tokens=12)
    assert finish == "stop" and tokens == free[: k + 1]
    tokens, _, finish, _ = run(model, eos_at_k, prompt, max_tokens=12, ignore_eos=True)
    assert finish == "length" and tokens == free


def test_a_cache_holding_a_prefix_is_reused_and_changes_nothing(model, tokenizer):
    """The engine's prompt cache lends the first request's KV to a second
    prompt sharing 30 tokens with it (trimmed back to them): only the rest
    is prefilled, and the tokens are those of a cold run."""
    engine = LLMEngine(model, tokenizer, EngineOptions(prompt_cache_bytes=1 << 24))
    first = prompt_ids(40, seed=1)
    run_1 = list(pagedlm.stream_generate(model, tokenizer, first,
                                         SamplingParams(max_tokens=6, ignore_eos=True), engine=engine))
    second = first[:30] + prompt_ids(15, seed=2)
    steps = list(pagedlm.stream_generate(model, tokenizer, second,
                                         SamplingParams(max_tokens=8, ignore_eos=True), engine=engine))
    cold, *_ = run(model, tokenizer, second, max_tokens=8, ignore_eos=True)
    assert steps[-1].cached_tokens == 30 and steps[-1].prompt_tokens == 45
    assert [s.token for s in steps] == cold
    assert len(run_1) == 6 and engine.cache_stats().prompt_cache_hits == 1


def test_two_requests_streamed_side_by_side_on_one_model_each_get_what_they_get_alone(model, tokenizer):
    """Each call runs its own engine: stepping one stream never steps (and
    drops the responses of) the other."""
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    first, second = prompt_ids(12, seed=3), prompt_ids(9, seed=4)
    alone = [run(model, tokenizer, p, max_tokens=6, ignore_eos=True)[:2] for p in (first, second)]
    a, b = (pagedlm.stream_generate(model, tokenizer, p, params) for p in (first, second))
    got = {"a": [], "b": []}
    for name, gen in [("a", a), ("b", b)] * 8:
        got[name] += [r for r in [next(gen, None)] if r is not None]
    for steps, (tokens, text) in zip(got.values(), alone):
        assert [s.token for s in steps if s.token is not None] == tokens
        assert "".join(s.text for s in steps) == text
