"""Serving under contention, at the scheduler: a long prompt costs a short
request a bounded number of steps, decode rows run every step, partial
prefills are bounded, one request's fan-out cannot starve another, and the
default store's live KV and cached prefixes share one budget."""

from __future__ import annotations

import random

import pytest

from pagedlm.batch.engine import LLMEngine
from pagedlm.options import EngineOptions, PagedKvOptions
from pagedlm.params import SamplingParams
from tests.helpers import CharTokenizer, tiny_model

STORES = {"default": {}, "paged": {"paged_kv": PagedKvOptions(block_size=4), "kv_budget_bytes": 1 << 22}}
BUDGET = 32  # tokens per step: a quarter (8) is the default long-prefill cap
PARAMS = SamplingParams(max_tokens=6, ignore_eos=True)


def ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(2, 256) for _ in range(n)]


def engine_for(tiny, store: str, **kw) -> LLMEngine:
    _, model, tok = tiny
    return LLMEngine(model, tok, EngineOptions(max_num_batched_tokens=BUDGET, **STORES[store], **kw))


def first_token_steps(engine: LLMEngine, seqs) -> list[int]:
    """Step until ``seqs`` all have a token; the step count at which each got its first."""
    start, got = engine.num_steps, {}
    while len(got) < len(seqs):
        engine.step()
        for s in seqs:
            if s.output_ids and s.seq_id not in got:
                got[s.seq_id] = engine.num_steps - start
    return [got[s.seq_id] for s in seqs]


@pytest.mark.parametrize("store", STORES)
def test_a_short_request_behind_a_long_prompt_gets_its_first_token_in_the_next_step(tiny, store):
    """The documented bound: a short prompt that waits when a step is
    scheduled, and fits in the budget the capped prefill leaves, samples
    its first token at the end of that step (today: after the whole prefill,
    12 more steps)."""
    engine = engine_for(tiny, store)
    (long,) = engine.add_request(ids(400, seed=1), PARAMS)
    engine.step()  # the long prompt alone: the whole budget
    assert long.num_computed == BUDGET
    (short,) = engine.add_request(ids(6, seed=2), PARAMS)
    assert first_token_steps(engine, [short]) == [1]
    # the capped chunk (8) plus the budget the short prompt left (32 - 8 - 6): nothing idle
    assert long.num_computed == 2 * BUDGET - 6
    # and decode rows every step while the long prompt is still prefilling
    while not short.is_finished:
        before = len(short.output_ids)
        engine.step()
        assert len(short.output_ids) == before + 1 and not long.output_ids
    alone = LLMEngine(tiny[1], tiny[2], EngineOptions(**STORES[store]))
    (solo,) = alone.add_request(ids(6, seed=2), PARAMS)
    while alone.has_unfinished():
        alone.step()
    assert short.output_ids == solo.output_ids


@pytest.mark.parametrize("store", STORES)
def test_many_short_requests_behind_a_long_prompt_are_admitted_as_fast_as_the_budget_allows(tiny, store):
    """Eight 4-token prompts behind a long one: the step after they arrive
    holds the capped chunk (8) and six of them (24 tokens); the next, the
    other two beside six decode rows."""
    engine = engine_for(tiny, store)
    engine.add_request(ids(400, seed=3), PARAMS)
    engine.step()
    shorts = [engine.add_request(ids(4, seed=10 + i), PARAMS)[0] for i in range(8)]
    assert first_token_steps(engine, shorts) == [1] * 6 + [2] * 2


@pytest.mark.parametrize("store", STORES)
def test_at_most_max_num_partial_prefills_prompts_are_partly_computed_at_once(tiny, store):
    for limit in (1, 2):
        engine = engine_for(tiny, store, max_num_partial_prefills=limit)
        a = engine.add_request(ids(200, seed=4), PARAMS)[0]
        b = engine.add_request(ids(200, seed=5), PARAMS)[0]
        c = engine.add_request(ids(5, seed=6), PARAMS)[0]  # short: joins whatever the limit
        rows = dict((s.seq_id, n) for s, n in engine.scheduler.schedule())
        partial = [s for s in (a, b) if 0 < rows.get(s.seq_id, 0) < s.num_tokens]
        assert len(partial) == limit and rows[c.seq_id] == 5
        assert sum(rows.values()) == BUDGET  # the cap never leaves budget idle


def test_a_long_prefill_threshold_of_zero_is_no_cap(tiny):
    engine = engine_for(tiny, "default", long_prefill_token_threshold=0)
    (long,) = engine.add_request(ids(400, seed=1), PARAMS)
    engine.step()
    engine.add_request(ids(40, seed=2), PARAMS)
    engine.step()  # no cap: the running prompt takes the whole budget first
    assert long.num_computed == 2 * BUDGET


@pytest.mark.parametrize("store", STORES)
def test_a_requests_fan_out_does_not_starve_another_request(tiny, store):
    """Rows for four: a request of eight sequences, then a request of one. The
    one is admitted at the first free row, before the fan-out's other four
    (strict arrival order would admit all eight first). Sent together, the
    two would share the first step's rows (fewest running first)."""
    engine = engine_for(tiny, store, max_num_seqs=4)
    big = [engine.add_request(ids(5, seed=20 + i), PARAMS, request_id="big")[0] for i in range(8)]
    engine.step()  # four of them take the rows
    (small,) = engine.add_request(ids(5, seed=30), PARAMS, request_id="small")
    while not small.output_ids:
        engine.step()
    started = [s for s in big if s.first_scheduled is not None and s.first_scheduled < small.first_scheduled]
    assert started == big[:4]  # only those that held the rows when it arrived
    assert big[7].first_scheduled is None


def held_bytes(engine: LLMEngine) -> int:
    """KV bytes the default store holds: running sequences' buffers and the prompt cache."""
    return sum(engine.store.row_bytes(s.seq_id) for s in engine.scheduler.running) + engine.prompt_cache.nbytes


@pytest.mark.parametrize("family, count", [("llama", 200), ("gemma3_text", 60)])
def test_live_kv_and_cached_prefixes_stay_inside_one_budget_over_a_soak(family, count):
    """~200 distinct requests (60 on Gemma's shape, slower; some sharing a long prefix, so that cached
    entries are trimmed and reused) through a budget that holds a few
    sequences, with a prompt-cache cap far above it: after every step the
    KV held (running + cached) is within the budget, and every request ran
    (admission evicts cached prefixes to make room)."""
    model, tok = tiny_model(family), CharTokenizer()
    opts = dict(max_num_batched_tokens=128, prompt_cache_bytes=1 << 30)
    one = LLMEngine(model, tok, EngineOptions(**opts)).admission.projected_bytes(264 + 8)
    engine = LLMEngine(model, tok, EngineOptions(**opts, kv_budget_bytes=2 * one))
    budget = engine.cache_stats().kv_budget_bytes
    rng = random.Random(7)
    shared = ids(264, seed=8)  # past one 256-token growth step: a trimmed entry must shrink
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    seqs, peak_cache = [], 0
    for i in range(count):
        prompt = shared + ids(rng.randint(1, 8), seed=100 + i) if i % 20 == 0 else \
            shared[: rng.randint(10, 40)] + ids(rng.randint(1, 30), seed=1000 + i)
        seqs += engine.add_request(prompt, params)
        for _ in range(rng.randint(0, 3)):
            engine.step()
            assert held_bytes(engine) <= budget
            assert engine.admission.reserved_bytes + engine.prompt_cache.nbytes <= budget
            peak_cache = max(peak_cache, engine.prompt_cache.nbytes)
    while engine.has_unfinished():
        engine.step()
        assert held_bytes(engine) <= budget
    assert all(s.finish_reason == "length" for s in seqs)
    assert peak_cache > 0  # the cache was used, inside the budget
    if family == "llama":  # (Gemma's window-8 ring buffers wrap: a shorter prefix of them is gone)
        assert engine.prompt_cache.hits > 0
    assert held_bytes(engine) == engine.prompt_cache.nbytes <= budget


def test_the_scheduling_flags_resolve_from_flags_and_environment():
    from pagedlm.options import OptionError, resolve_engine_options

    env = {"PAGEDLM_LONG_PREFILL_TOKEN_THRESHOLD": "64", "PAGEDLM_MAX_NUM_PARTIAL_PREFILLS": "3"}
    opts = resolve_engine_options({}, env)
    assert (opts.long_prefill_token_threshold, opts.max_num_partial_prefills) == (64, 3)
    assert resolve_engine_options({"long_prefill_token_threshold": "0"}, env).long_prefill_token_threshold == 0
    with pytest.raises(OptionError, match="--max-num-partial-prefills"):
        resolve_engine_options({"max_num_partial_prefills": "0"}, {})
