"""Speculative decoding on tiny random models: prompt lookup, verification
(greedy and rejection sampling), rollback in both stores, the counters."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from pagedlm.batch import engine as engine_module
from pagedlm.batch.engine import LLMEngine
from pagedlm.batch.sequence import Sequence
from pagedlm.options import EngineOptions, OptionError, UnsupportedOption, resolve_engine_options
from pagedlm.params import SamplingParams
from pagedlm.sampling import sample_row
from pagedlm.speculative import NgramProposer, verify
from tests.helpers import ATOL, CharTokenizer, GreedyOracle, block_bytes, paged, prompts, run_all, tiny_model

_MODELS = {family: tiny_model(family) for family in ("llama", "gemma3_text")}


# -- prompt lookup ------------------------------------------------------------------


def test_ngram_proposes_what_followed_the_latest_occurrence_of_the_longest_suffix():
    p = NgramProposer(3, ngram_min=1, ngram_max=3)
    #         0  1  2  3  4  5  6  7  8  9
    tokens = [5, 6, 7, 8, 1, 6, 7, 9, 4, 6, 7]
    # suffix [6, 7] occurs at 1-2 and 5-6 (the latest wins): what followed 5-6 is 9, 4, 6
    assert p.lookup(tokens, 3) == [9, 4, 6]
    # a longer match beats a later shorter one: [5, 6, 7] only at 0-2
    assert p.lookup(tokens[:10] + [5, 6, 7], 2) == [8, 1]
    assert p.lookup(tokens, 1) == [9]
    assert p.lookup([1, 2, 3], 3) == []  # nothing repeats
    assert NgramProposer(3, ngram_min=3, ngram_max=3).lookup(tokens, 3) == []  # only 2 tokens match
    assert p.lookup([4, 4], 3) == [4]  # the proposal may run into the suffix itself, never past the end


def test_ngram_keeps_each_sequences_tokens_between_steps_and_drops_them_at_release():
    """The proposer extends its copy of a sequence's tokens by what was
    appended (its buffer regrown as needed): every step it proposes what a
    lookup over the whole token list proposes."""
    p, rng = NgramProposer(3, ngram_min=1, ngram_max=3), random.Random(0)
    seq = Sequence([5, 6, 7, 8, 1, 6, 7], SamplingParams(), set(), None)
    for _ in range(100):
        assert p.propose([(seq, 3)]) == [p.lookup(seq.tokens, 3)]
        seq.output_ids += [rng.randrange(1, 9) for _ in range(rng.randint(1, 4))]
    p.release(seq.seq_id)
    assert not p._arrays


def test_speculation_flags_and_their_refusals():
    opts = resolve_engine_options({"speculative": "ngram", "num_speculative_tokens": "8", "ngram_max": "2"}, {})
    assert (opts.speculative, opts.num_speculative_tokens, opts.ngram_max) == ("ngram", 8, 2)
    assert resolve_engine_options({}, {"PAGEDLM_SPECULATIVE": "ngram"}).speculative == "ngram"
    for flags, reason in [({"num_speculative_tokens": "3"}, "need --speculative"),
                          ({"speculative": "ngram", "ngram_min": "4", "ngram_max": "2"}, "must not exceed"),
                          ({"draft_model": "x"}, "--draft-model proposes"),
                          ({"speculative": "draft"}, "needs --draft-model"),
                          ({"speculative": "draft", "draft_model": "x", "ngram_max": "3"}, "need --speculative ngram")]:
        with pytest.raises(UnsupportedOption, match=reason):
            resolve_engine_options(flags, {})
    with pytest.raises(UnsupportedOption, match="need --speculative"):  # options built by hand: the engine checks
        LLMEngine(_MODELS["llama"], CharTokenizer(), EngineOptions(ngram_min=2))
    with pytest.raises(ValueError, match="--speculative must be ngram, draft"):
        resolve_engine_options({"speculative": "eagle"}, {})


# -- greedy: the tokens of a run without speculation ----------------------------------


def _run(family: str, options: EngineOptions, batch, params, proposer=None):
    """``batch`` through one engine; after every step, each running row holds
    exactly the blocks and row-cache keys of the tokens it kept (nothing of
    a rejected tail), and no proposal outlives its step; at the end nothing
    is held."""
    engine = LLMEngine(_MODELS[family], CharTokenizer(), options)
    if proposer is not None:
        engine.proposer = proposer

    def check(e):
        running = {s.seq_id for s in e.scheduler.running}
        if e.blocks is not None:
            e.blocks.check(running)
        for s in e.scheduler.running:
            assert not s.draft
            if e.blocks is not None:
                assert len(e.blocks.tables[s.seq_id]) == e.blocks.blocks_for(s.num_computed)
            for i in e.layout.row_layers:
                assert e.store.rows[s.seq_id][i].offset == s.num_computed

    seqs = run_all(engine, batch, params, check=check)
    assert not engine.store.rows
    if engine.blocks is not None:
        assert engine.blocks.num_free == engine.blocks.num_blocks
    return engine, seqs


def _options(store: str, block_size: int = 4, **kw) -> EngineOptions:
    return paged(block_size, **kw) if store == "paged" else EngineOptions(**kw)


def _same(spec, plain, logprobs: bool = True) -> None:
    for s, p in zip(spec, plain, strict=True):
        assert s.output_ids == p.output_ids
        assert (s.text, s.finish_reason, s.stop_reason) == (p.text, p.finish_reason, p.stop_reason)
        if logprobs and p.logprobs is not None:
            for (a, top_a), (b, top_b) in zip(s.logprobs, p.logprobs, strict=True):
                assert abs(a - b) <= ATOL and [t for t, _ in top_a] == [t for t, _ in top_b]


@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
@pytest.mark.parametrize("store,block_size", [("default", 0), ("paged", 4), ("paged", 16)])
@pytest.mark.parametrize("k", [1, 3, 8])
def test_greedy_speculation_emits_the_tokens_of_a_run_without_it(family, store, block_size, k):
    """Proposals right up to a random position (the oracle), rows of mixed
    lengths arriving together, prompts crossing blocks and Gemma's window
    of 8: the same tokens, text and finish as without speculation; the
    logprobs within the batched-vs-alone bound; after every step each row
    holds exactly the keys (row caches) and blocks of the tokens it kept."""
    batch = [p * 2 for p in prompts(4, seed=3, lo=3, hi=12)]
    params = SamplingParams(max_tokens=20, ignore_eos=True, logprobs=2)
    _, plain = _run(family, _options(store, block_size), batch, params)
    engine, spec = _run(family, _options(store, block_size, speculative="ngram", num_speculative_tokens=k),
                        batch, params, GreedyOracle(_MODELS[family], k, seed=k))
    _same(spec, plain)
    stats = engine.spec_stats
    assert stats.drafts > 0 and 0 < stats.accepted_tokens < stats.draft_tokens  # some accepted, some rejected
    assert stats.emitted_tokens == stats.drafts + stats.accepted_tokens
    assert sum(len(s.output_ids) for s in spec) == 4 * 20


@pytest.mark.parametrize("store", ["default", "paged"])
def test_prompt_lookup_keeps_the_tokens_and_an_exact_proposal_is_accepted_whole(store):
    batch = prompts(3, seed=5, lo=4, hi=10)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    _, plain = _run("llama", _options(store, 4), batch, params)
    engine, lookup = _run("llama", _options(store, 4, speculative="ngram", num_speculative_tokens=4), batch, params)
    _same(lookup, plain)
    assert engine.spec_stats.drafts > 0
    engine, oracle = _run("llama", _options(store, 4, speculative="ngram", num_speculative_tokens=5),
                          batch, params, GreedyOracle(_MODELS["llama"], 5, exact=True))
    _same(oracle, plain)
    stats = engine.spec_stats
    assert stats.accepted_tokens == stats.draft_tokens > 0 and stats.mean_accepted_length > 5
    assert engine.num_steps < 12  # 24 tokens at up to 6 a step, after the prefill
    assert all(s.num_accepted_tokens == s.num_draft_tokens for s in oracle)


@pytest.mark.parametrize("store", ["default", "paged"])
def test_stops_inside_an_accepted_proposal_cut_the_output_where_a_plain_run_stops(store):
    """A stop string, a stop id and max_tokens that fall among the tokens a
    verify row accepts: the output, text and finish as without speculation,
    and the keys past the stop are dropped (the store's checks)."""
    tok = CharTokenizer()
    (ids,) = prompts(1, seed=12)
    free = _run("llama", _options(store, 4), [ids], SamplingParams(max_tokens=16, ignore_eos=True))[1][0]
    oracle = GreedyOracle(_MODELS["llama"], 6, exact=True)
    stops = [SamplingParams(max_tokens=16, stop=[tok.decode(free.output_ids[3:5])], ignore_eos=True),
             SamplingParams(max_tokens=16, stop=[tok.decode(free.output_ids[2:4])], ignore_eos=True,
                            include_stop_str_in_output=True),
             SamplingParams(max_tokens=16, stop_token_ids=[free.output_ids[3]])]
    for params in stops + [SamplingParams(max_tokens=5, ignore_eos=True, logprobs=1)]:
        plain = _run("llama", _options(store, 4), [ids], params)[1]
        engine, spec = _run("llama", _options(store, 4, speculative="ngram", num_speculative_tokens=6),
                            [ids], params, oracle)
        _same(spec, plain)
        stats = engine.spec_stats
        if params.max_tokens == 5:  # the first token, then one proposal of 3 (no more fit), all taken
            assert (stats.drafts, stats.draft_tokens, stats.emitted_tokens) == (1, 3, 4)
        else:  # the proposal of 6 was taken whole, and a stop cut what it emitted short
            assert stats.accepted_tokens == stats.draft_tokens and stats.emitted_tokens < 7 * stats.drafts


def test_prefix_caching_under_speculation_keeps_the_tokens_and_hits_again():
    """A pool of few blocks (preemptions, evictions), proposals mostly wrong:
    the same tokens as without speculation, and a second round of the same
    prompts is served from the cached blocks with the same tokens again.
    (That no cached block holds a rejected token's keys is the property
    test's: test_prefix_cache.py.)"""
    model = _MODELS["llama"]
    batch = [p * 2 for p in prompts(6, seed=9, lo=4, hi=9)]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    tight = dict(budget=block_bytes(model, 4) * 24, max_model_len=40, max_num_batched_tokens=16)
    _, plain = _run("llama", _options("paged", 4, **tight), batch, params)
    engine = LLMEngine(model, CharTokenizer(), _options("paged", 4, speculative="ngram", num_speculative_tokens=3,
                                                        **tight))
    engine.proposer = GreedyOracle(model, 3, seed=1)
    for _ in range(2):
        spec = run_all(engine, batch, params, check=lambda e: e.blocks.check({s.seq_id for s in e.scheduler.running}))
        _same(spec, plain)
    assert engine.spec_stats.accepted_tokens > 0 and engine.num_preemptions > 0
    assert engine.blocks.hit_tokens > 0 and engine.blocks.num_free == engine.blocks.num_blocks


def test_a_thousand_speculative_requests_with_aborts_leave_nothing_behind():
    """125 rounds of 8 requests (prompts over a small alphabet, so that
    lookups propose), a third of them aborted after two steps, a pool of 12
    blocks (preemptions): after every step the block invariants hold, after
    each round no row is left and every block is free."""
    options = _options("paged", 4, speculative="ngram", num_speculative_tokens=3,
                       budget=block_bytes(_MODELS["llama"], 4) * 12, max_model_len=40, max_num_seqs=6)
    engine = LLMEngine(_MODELS["llama"], CharTokenizer(), options)
    rng = random.Random(0)
    for round_ in range(125):
        seqs = []
        for i in range(8):
            ids = [rng.randrange(2, 9) for _ in range(rng.randint(2, 10))]
            seqs += engine.add_request(ids * 2, SamplingParams(max_tokens=rng.randint(1, 12), ignore_eos=True))
        for _ in range(2):
            engine.step()
        for seq in seqs[round_ % 3 :: 3]:
            engine.abort(seq)
        while engine.has_unfinished():
            engine.step()
            engine.blocks.check({s.seq_id for s in engine.scheduler.running})
        assert not engine.store.rows and engine.blocks.num_free == engine.blocks.num_blocks
    stats = engine.spec_stats
    assert stats.drafts > 200 and 0 < stats.accepted_tokens < stats.draft_tokens and engine.num_preemptions > 0


# -- sampled rows ---------------------------------------------------------------------


@pytest.mark.parametrize("store", ["default", "paged"])
def test_a_seeded_sampled_request_draws_the_same_tokens_with_speculation(store):
    """One draw of the sequence's generator per emitted token, in order, with
    or without speculation: a seed gives the same output (penalties and
    top-p included, which read the accepted tokens)."""
    batch = [p * 2 for p in prompts(3, seed=4, lo=3, hi=10)]
    params = SamplingParams(max_tokens=16, temperature=0.8, top_p=0.95, repetition_penalty=1.2, seed=7,
                            ignore_eos=True)
    _, plain = _run("llama", _options(store, 4), batch, params)
    engine, spec = _run("llama", _options(store, 4, speculative="ngram", num_speculative_tokens=4), batch, params,
                        GreedyOracle(_MODELS["llama"], 4, seed=2))
    _same(spec, plain)
    assert engine.spec_stats.accepted_tokens > 0


class _Row:
    """The sampler's view of a row: params, a generator, no rules."""

    def __init__(self, params: SamplingParams, seed: int) -> None:
        self.params, self.rules, self.matcher = params, None, None
        self.generator = torch.Generator().manual_seed(seed)
        self.output_ids: list[int] = []
        self.tokens = [0]


def _wrong_verify(logits, seq, draft):
    """A wrong rule: on rejection the correction is drawn from p again, the
    proposed token included (the residual must leave it out)."""
    out = []
    for proposed in [*draft, None]:
        token = sample_row(logits[len(out)], seq)
        if proposed is not None and token != proposed:
            out.append(sample_row(logits[len(out)], seq))
            break
        out.append(token)
        if proposed is None:
            break
    return out


@pytest.mark.parametrize("rule,passes", [(verify, True), (_wrong_verify, False)])
def test_rejection_sampling_emits_the_target_distribution(rule, passes):
    """A vocabulary of 6, proposals of the target's likeliest tokens: the
    first emitted token's frequencies over 6,000 rows match p0, and those
    of the second, where the first was the proposed one, match p1 (a
    chi-square bound of ~p = 1e-4); the rule that draws its correction from
    p itself over-emits the proposed token and fails it."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 6, generator=g) * 1.5
    p = torch.softmax(logits, -1)
    draft = p.argmax(-1)[:2].tolist()
    params = SamplingParams(temperature=1.0)
    n, first, second = 6000, torch.zeros(6), torch.zeros(6)
    for i in range(n):
        out = rule(logits, _Row(params, i), draft)
        first[out[0]] += 1
        if out[0] == draft[0] and len(out) > 1:
            second[out[1]] += 1

    def chi2(counts, probs):
        expected = counts.sum() * probs
        return float(((counts - expected) ** 2 / expected).sum())

    bound = 25.7  # chi-square with 5 degrees of freedom, p = 1e-4
    ok = chi2(first, p[0]) < bound and chi2(second, p[1]) < bound
    assert ok == passes, (chi2(first, p[0]), chi2(second, p[1]))


def test_constrained_rows_do_not_speculate_and_plain_rows_beside_them_do():
    engine = LLMEngine(_MODELS["llama"], CharTokenizer(),
                       EngineOptions(speculative="ngram", num_speculative_tokens=3))
    engine.proposer = GreedyOracle(_MODELS["llama"], 3, exact=True)
    (ids,) = prompts(1, seed=2)
    plain, constrained = (engine.add_request(ids, SamplingParams(max_tokens=8, ignore_eos=True))[0]
                          for _ in range(2))
    engine.step()  # both prefilled: decode rows now
    constrained.matcher = object()  # under a grammar (as far as proposing goes)
    engine._propose()
    assert len(plain.draft) == 3 and constrained.draft == []


# -- counters -------------------------------------------------------------------------


def test_the_counters_reach_llm_stats_and_metrics():
    from prometheus_client.parser import text_string_to_metric_families

    from pagedlm import LLM
    from pagedlm.server.metrics import Metrics

    model = _MODELS["llama"]
    llm = LLM(model, tokenizer=CharTokenizer(),
              speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2})
    assert (llm.engine.options.speculative, llm.engine.options.ngram_max) == ("ngram", 2)
    llm.engine.proposer = GreedyOracle(model, 3, seed=5)
    batch = prompts(2, seed=6)
    for _ in range(2):  # the stats are the last call's
        llm.generate([{"prompt_token_ids": ids} for ids in batch], SamplingParams(max_tokens=10, ignore_eos=True),
                     use_tqdm=False)
    stats, total = llm.stats.speculation, llm.engine.spec_stats
    assert 0 < stats.drafts < total.drafts and stats.emitted_tokens == stats.drafts + stats.accepted_tokens
    assert 0 < stats.acceptance_rate < 1 and 1 < stats.mean_accepted_length <= 4
    metrics = Metrics("tiny")
    metrics.bind(llm.engine, lambda: 0)
    seen = {s.name: s.value for f in text_string_to_metric_families(metrics.render().decode()) for s in f.samples}
    assert seen["pagedlm_spec_decode_num_drafts_total"] == total.drafts
    assert seen["pagedlm_spec_decode_num_draft_tokens_total"] == total.draft_tokens
    assert seen["pagedlm_spec_decode_num_accepted_tokens_total"] == total.accepted_tokens
    assert seen["pagedlm_spec_decode_num_emitted_tokens_total"] == total.emitted_tokens
    assert seen["pagedlm_spec_decode_acceptance_rate"] == pytest.approx(total.acceptance_rate)
    with pytest.raises(ValueError, match="set one option"):
        LLM(model, tokenizer=CharTokenizer(), speculative="ngram", speculative_config={"method": "ngram"})
    plain = Metrics("tiny")
    plain.bind(LLMEngine(model, CharTokenizer()), lambda: 0)
    assert b"spec_decode" not in plain.render()


class _NeverReplays:
    """Stands in for an engine's verify graphs on the CPU (their presence
    turns padding on; they replay nothing)."""

    def can_run(self, step) -> bool:
        return False


@pytest.mark.parametrize("store", ["default", "paged"])
def test_proposals_padded_to_k_for_verify_graphs_keep_the_tokens(store):
    """With verify graphs, every asking row's proposal is padded to its k
    once any row proposes (prompt lookup proposes unevenly, some rows
    nothing): the same greedy and seeded-sampled tokens as without
    speculation, every verify row k long unless max_tokens leaves less room."""
    batch = [p * 2 for p in prompts(4, seed=5, lo=3, hi=12)] + prompts(2, seed=6, lo=5, hi=9)
    for params in [SamplingParams(max_tokens=18, ignore_eos=True),
                   SamplingParams(max_tokens=18, temperature=0.8, seed=11, ignore_eos=True)]:
        _, plain = _run("llama", _options(store, 4), batch, params)
        engine = LLMEngine(_MODELS["llama"], CharTokenizer(),
                           _options(store, 4, speculative="ngram", num_speculative_tokens=3))
        engine.verify_graphs = _NeverReplays()
        lengths = []
        propose = engine._propose

        def recorded():
            propose()
            lengths.append([(len(s.draft), min(3, s.params.max_tokens - len(s.output_ids) - 1))
                            for s in engine.scheduler.running if s.draft or s.num_tokens - s.num_computed == 1])
        engine._propose = recorded
        _same(run_all(engine, batch, params), plain)
        padded = [step for step in lengths if any(d for d, _ in step)]
        assert padded and all(d == room for step in padded for d, room in step)
        stats = engine.spec_stats
        assert stats.drafts > 0 and stats.emitted_tokens == stats.drafts + stats.accepted_tokens


# -- the draft proposer -----------------------------------------------------------------


@pytest.mark.parametrize("store", ["default", "paged"])
def test_a_draft_equal_to_the_model_has_every_greedy_proposal_accepted(store):
    """The draft keeps its own KV in a store of the same kind; what it proposes
    is its greedy continuation, so a draft that is the model itself is right
    every time (k + 1 tokens a step), and the output is the plain one."""
    model = _MODELS["llama"]
    batch = prompts(3, seed=8, lo=3, hi=30)
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    _, plain = _run("llama", _options(store, 4), batch, params)
    engine = LLMEngine(model, CharTokenizer(), _options(store, 4, speculative="draft", num_speculative_tokens=4,
                                                        draft_model="itself"), draft=model)
    spec = run_all(engine, batch, params)
    _same(spec, plain)
    stats = engine.spec_stats
    assert stats.draft_tokens > 0 and stats.accepted_tokens == stats.draft_tokens
    # 20 tokens: the prefill's, then 5 a step three times, then the 4 that are left
    assert (stats.drafts, stats.emitted_tokens, engine.num_steps) == (12, 57, 5)
    draft = engine.proposer
    assert not draft.fed and not draft.store.rows  # released as the rows ended
    assert draft.blocks is None or draft.blocks.num_free == draft.blocks.num_blocks


@pytest.mark.parametrize("store", ["default", "paged"])
def test_another_draft_keeps_the_tokens_greedy_and_seeded(store):
    """A different draft (another seed's weights: mostly wrong), windowed
    Gemma layers under the draft's own rollback: greedy and seeded sampled
    output as without speculation."""
    model, draft = _MODELS["gemma3_text"], tiny_model("gemma3_text", seed=1)
    batch = [p * 2 for p in prompts(3, seed=4, lo=3, hi=12)]
    for params in [SamplingParams(max_tokens=16, ignore_eos=True),
                   SamplingParams(max_tokens=16, temperature=0.9, seed=3, ignore_eos=True)]:
        _, plain = _run("gemma3_text", _options(store, 4), batch, params)
        options = _options(store, 4, speculative="draft", num_speculative_tokens=3, draft_model="another")
        engine = LLMEngine(model, CharTokenizer(), options, draft=draft)
        _same(run_all(engine, batch, params), plain)
        assert engine.spec_stats.draft_tokens > engine.spec_stats.accepted_tokens


@pytest.mark.parametrize("draft_family", ["llama", "gemma3_text"])
def test_the_draft_s_keys_come_out_of_the_one_kv_budget(draft_family):
    """With a draft, ``--kv-budget-bytes`` is split between the two stores in
    proportion to a token's bytes in each: both pools hold as many blocks,
    and together they stay within the budget (the model's pools used to
    take all of it, and the draft as much again: twice the memory asked
    for, an out-of-memory on a GPU sized by --gpu-memory-utilization). A
    Gemma draft on the torch path keeps its sliding layers' ring buffers
    outside its pools."""
    model = _MODELS["llama"]
    draft = tiny_model(draft_family, vocab_size=model.args.vocab_size, seed=2)
    budget = 200 * block_bytes(model, 4)
    options = paged(4, budget=budget, speculative="draft", draft_model="d", max_model_len=64)
    engine = LLMEngine(model, CharTokenizer(), options, draft=draft)
    mine, theirs = engine.store.pools, engine.proposer.store.pools
    assert mine.num_blocks == theirs.num_blocks == engine.proposer.blocks.num_blocks
    used = mine.nbytes + theirs.nbytes
    assert used <= budget
    if draft_family == "llama":  # every layer pooled: the budget is spent on the two pools
        assert used > budget * 0.95
    with pytest.raises(OptionError, match=r"holds \d+ blocks .* the draft model's keys take the rest"):
        LLMEngine(model, CharTokenizer(), dataclasses.replace(options, max_model_len=512), draft=draft)


def test_a_draft_of_another_vocabulary_is_refused_at_startup():
    with pytest.raises(UnsupportedOption, match="vocabulary of 128 tokens and the model 256"):
        LLMEngine(_MODELS["llama"], CharTokenizer(), EngineOptions(speculative="draft", draft_model="small"),
                  draft=tiny_model("llama", vocab_size=128))


def test_bench_decode_runs_each_store_again_speculating_on_the_same_prompt(tmp_path, capsys):
    import json

    from pagedlm.cli import main

    config = dict(model_type="llama", vocab_size=512, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                  num_key_value_heads=2, num_hidden_layers=2, max_position_embeddings=512, tie_word_embeddings=True)
    (tmp_path / "config.json").write_text(json.dumps(config))
    argv = ["bench", "decode", "--model", str(tmp_path), "--random-weights", "--device", "cpu", "--prompt-len", "300",
            "--gen-len", "6", "--repeats", "1", "--paged-kv", "--kv-budget-bytes", "8M", "--speculative", "ngram",
            "--num-speculative-tokens", "3", "--workload", "grounded", "--json"]
    assert main(argv) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert [r["name"] for r in rows] == ["pagedlm-default", "pagedlm-paged", "pagedlm-default-ngram",
                                         "pagedlm-paged-ngram"]
    assert len({r["prompt_len"] for r in rows}) == 1 and 250 < rows[0]["prompt_len"] <= 300  # as much as fits
    assert all("speculative" not in r for r in rows[:2]) and all(r["workload"] == "grounded" for r in rows)
    for row in rows[2:]:
        assert (row["speculative"], row["num_speculative_tokens"], row["ngram_max"]) == ("ngram", 3, 4)
        assert row["decode_ratio_vs_plain"] > 0 and 0 <= row["acceptance_rate"] <= 1
        assert row["mean_accepted_length"] >= 1 or row["acceptance_rate"] == 0
    argv[argv.index("300")] = "20"
    assert main(argv) == 2 and "the shortest copy prompt is" in capsys.readouterr().err


def test_a_draft_catches_up_a_long_prompt_over_several_steps_within_the_budget():
    """A step budget of 8 tokens: the draft feeds what the rows gained 8
    tokens a step across rows (proposing nothing until a row has caught
    up), then proposes; every proposal of a draft equal to the model is
    taken and the output is the plain one."""
    model = _MODELS["llama"]
    batch = [p * 3 for p in prompts(2, seed=11, lo=10, hi=14)]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    _, plain = _run("llama", _options("paged", 4, max_num_batched_tokens=8), batch, params)
    options = _options("paged", 4, max_num_batched_tokens=8, speculative="draft", num_speculative_tokens=3,
                       draft_model="itself")
    engine = LLMEngine(model, CharTokenizer(), options, draft=model)
    proposed = []
    original = engine.proposer.propose
    engine.proposer.propose = lambda rows: proposed.append(original(rows)) or proposed[-1]
    _same(run_all(engine, batch, params), plain)
    assert [] in proposed[0] and any(all(p) for p in proposed)  # nothing while catching up, then proposals
    stats = engine.spec_stats
    assert stats.accepted_tokens == stats.draft_tokens > 0


@pytest.mark.parametrize("store", ["default", "paged"])
def test_rules_that_depend_on_the_output_so_far_hold_at_every_verified_position(store):
    """min_tokens bans a stop id that the proposals hold early, a bad word
    bans a token after another: each position is checked against the output
    as it would be there (the accepted proposals before it), greedy and
    sampled, and the output is the plain one."""
    tok = CharTokenizer()
    (ids,) = prompts(1, seed=12)
    free = _run("llama", _options(store, 4), [ids], SamplingParams(max_tokens=16, ignore_eos=True))[1][0]
    oracle = GreedyOracle(_MODELS["llama"], 5, exact=True)  # proposes what the rules do not allow
    bad = tok.decode(free.output_ids[3:5])  # inside the first proposal (tokens 1 to 5)
    for params in [SamplingParams(max_tokens=16, min_tokens=8, stop_token_ids=[free.output_ids[3]]),
                   SamplingParams(max_tokens=16, bad_words=[bad], ignore_eos=True),
                   SamplingParams(max_tokens=16, min_tokens=8, stop_token_ids=[free.output_ids[3]], temperature=0.7,
                                  seed=1)]:
        plain = _run("llama", _options(store, 4), [ids], params)[1]
        engine, spec = _run("llama", _options(store, 4, speculative="ngram", num_speculative_tokens=5), [ids],
                            params, oracle)
        _same(spec, plain)
        assert engine.spec_stats.accepted_tokens < engine.spec_stats.draft_tokens, params  # the rule rejected some
