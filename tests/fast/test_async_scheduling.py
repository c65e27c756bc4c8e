"""Async scheduling (``--async-scheduling``): each step is scheduled and
launched before the previous step's tokens reach the host. On the CPU it buys
no speed, but it runs the same bookkeeping as on CUDA (pending tokens fed from
the device's tensor, commits before a pending token joins, a sequence that
ends while its next row is in flight), so these tests pin it here: the same
tokens, text and finish reasons as the synchronous engine, the same blocks
free at the end, and no step wasted on a sequence that ends by max_tokens."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedlm.batch.engine import LLMEngine
from pagedlm.batch.sequence import PENDING
from pagedlm.options import (EngineOptions, UnsupportedOption, async_scheduling_on, check_refusals,
                             resolve_engine_options)
from pagedlm.params import SamplingParams
from pagedlm.sampling import TokenRules, pick_on_device, picks_on_device, sample
from tests.fast.kernel_refs import requires_triton
from tests.helpers import (DEVICE, CharTokenizer, Ops, block_bytes, drive, paged, prompts, run_all, tiny_model,
                           tiny_tokenizer)


def _options(base: EngineOptions, on: bool) -> EngineOptions:
    return EngineOptions(**{**base.__dict__, "async_scheduling": on})


def _run_both(model, tok, options: EngineOptions, batch, params, arrive_every=1):
    """The batch through a synchronous and an async engine of ``options``; the
    sequences of each, and whether the async one ever left a step in flight."""
    sync = run_all(LLMEngine(model, tok, _options(options, False)), batch, params, arrive_every)
    engine = LLMEngine(model, tok, _options(options, True))
    overlapped = []
    got = run_all(engine, batch, params, arrive_every, check=lambda e: overlapped.append(e._inflight is not None))
    return sync, got, engine, any(overlapped)


def _same(a, b):
    assert [s.output_ids for s in a] == [s.output_ids for s in b]
    assert [s.text for s in a] == [s.text for s in b]
    assert [s.finish_reason for s in a] == [s.finish_reason for s in b]
    assert all(PENDING not in s.output_ids for s in b)


@pytest.mark.parametrize("store", ["default", "paged"])
def test_async_gives_the_synchronous_tokens_with_chunked_prefill_and_staggered_arrivals(tiny, store):
    family, model, tok = tiny
    base = EngineOptions(max_num_batched_tokens=16) if store == "default" else paged(4, max_num_batched_tokens=16)
    batch = prompts(6, seed=21, lo=3, hi=40)
    sync, got, engine, overlapped = _run_both(model, tok, base, batch, SamplingParams(max_tokens=14, ignore_eos=True))
    assert overlapped
    _same(sync, got)
    assert not engine.has_unfinished() and not engine.store.rows
    if engine.blocks is not None:
        assert engine.blocks.num_free == engine.blocks.num_blocks


def test_a_sequence_ending_by_max_tokens_costs_no_extra_step(tiny):
    """Its last token is still in flight when the next step is scheduled, and
    the scheduler knows it ends the sequence: the async engine runs the model
    exactly as many times as the synchronous one."""
    family, model, tok = tiny
    params = SamplingParams(max_tokens=9, ignore_eos=True)
    for batch in ([prompts(1, seed=22)[0]], prompts(4, seed=23)):
        sync_engine = LLMEngine(model, tok, EngineOptions(async_scheduling=False))
        run_all(sync_engine, batch, params)
        engine = LLMEngine(model, tok, EngineOptions(async_scheduling=True))
        run_all(engine, batch, params)
        assert engine.num_steps == sync_engine.num_steps


def test_stops_end_at_the_same_token_and_text():
    """Stop ids, stop strings and EOS are only known once the token lands: a
    row may run one step past them, thrown away; the output is the same."""
    model, tok = tiny_model("llama"), CharTokenizer()
    (ids,) = prompts(1, seed=12)
    free = run_all(LLMEngine(model, tok), [ids], SamplingParams(max_tokens=12, ignore_eos=True))[0]
    stop_text = tok.decode(free.output_ids[5:7])
    cases = [SamplingParams(max_tokens=12, stop_token_ids=[free.output_ids[4]]),
             SamplingParams(max_tokens=12, stop=[stop_text], ignore_eos=True),
             SamplingParams(max_tokens=12, stop=[stop_text], include_stop_str_in_output=True, ignore_eos=True)]
    for params in cases:
        for store in (EngineOptions(prompt_cache_bytes=1 << 22), paged(4)):  # the prompt cache keeps what ended
            sync, got, _, overlapped = _run_both(model, tok, store, [ids, *prompts(3, seed=13)], params, 0)
            assert overlapped
            _same(sync, got)
            assert got[0].finish_reason == "stop"


def test_rows_that_need_the_host_run_synchronously_beside_greedy_ones(tiny):
    """Seeded sampling, penalties, logprobs, bad_words, min_tokens and a
    static allowed_token_ids set among greedy rows: each step with a row whose
    token needs the host runs synchronously, the others overlap; every output
    is what the synchronous engine gives."""
    family, model, tok = tiny
    rng = random.Random(5)
    kinds = [SamplingParams(max_tokens=10, ignore_eos=True),
             SamplingParams(max_tokens=10, ignore_eos=True, temperature=0.9, seed=3),
             SamplingParams(max_tokens=10, ignore_eos=True, repetition_penalty=1.3),
             SamplingParams(max_tokens=10, ignore_eos=True, logprobs=2),
             SamplingParams(max_tokens=10, ignore_eos=True, min_tokens=4),
             SamplingParams(max_tokens=10, ignore_eos=True, allowed_token_ids=rng.sample(range(2, 256), 12))]
    batch = prompts(len(kinds), seed=31)
    base = paged(4, max_num_batched_tokens=24)
    outs = []
    for engine in (LLMEngine(model, tok, _options(base, False)), LLMEngine(model, tok, _options(base, True))):
        seqs = []
        for ids, params in zip(batch, kinds):
            seqs += engine.add_request(ids, params)
        while engine.has_unfinished():
            engine.step()
        outs.append(seqs)
    _same(*outs)
    assert outs[1][3].logprobs == outs[0][3].logprobs
    allowed = set(kinds[-1].allowed_token_ids)
    assert set(outs[1][-1].output_ids) <= allowed


def test_only_greedy_or_unseeded_static_rows_pick_on_the_device():
    model, tok = tiny_model("llama"), CharTokenizer()
    engine = LLMEngine(model, tok, EngineOptions(async_scheduling=True))
    ids = prompts(1, seed=3)[0]
    on = lambda **kw: picks_on_device(engine.add_request(ids, SamplingParams(**kw))[0])  # noqa: E731
    assert on() and on(allowed_token_ids=[5, 6]) and on(stop=["x"])
    assert on(temperature=0.5, top_p=0.9, top_k=5, min_p=0.1)  # unseeded: drawn on the device
    assert not on(temperature=0.5, seed=1)  # a seed draws on the row's CPU generator
    assert not on(repetition_penalty=1.1) and not on(logit_bias={5: 1.0})
    assert not on(min_tokens=2) and not on(presence_penalty=0.5)


def _reference_probs(logits: torch.Tensor, params: SamplingParams, rules) -> torch.Tensor:
    """What a sampled row draws from, written out on probabilities one token
    at a time: its rules, temperature, its top-k, top-p over what top-k kept
    (best first until the mass reaches p), min-p against the best."""
    p = params
    logits = rules.apply(logits, []) if rules is not None else logits
    probs = torch.softmax(logits.double() / p.temperature, -1)
    order = probs.argsort(descending=True).tolist()
    keep = order[: p.top_k] if 0 < p.top_k < len(order) else order
    kept = torch.zeros_like(probs)
    kept[keep] = probs[keep]
    if p.top_p < 1.0:
        kept, mass, total = torch.zeros_like(probs), 0.0, float(probs[keep].sum())
        for i in keep:
            kept[i], mass = probs[i], mass + float(probs[i]) / total
            if mass >= p.top_p:
                break
    kept = kept / kept.sum()
    if p.min_p > 0.0:
        kept = kept.masked_fill(kept < p.min_p * kept.max(), 0.0)
    return kept / kept.sum()


@pytest.mark.parametrize("fused_pick", [False, pytest.param(True, marks=requires_triton)])
@pytest.mark.parametrize("knobs", [dict(temperature=0.7), dict(temperature=1.3, top_k=12),
                                   dict(temperature=0.9, top_p=0.8), dict(temperature=1.0, min_p=0.05),
                                   dict(temperature=0.8, top_k=30, top_p=0.9, min_p=0.02)])
def test_device_draws_follow_the_samplers_distribution(knobs, fused_pick, monkeypatch):
    """Unseeded sampled rows draw on the device under async scheduling: over
    6,000 draws (rows of one batch, beside a greedy row and a row of other
    knobs), no token outside the support `sample_row` keeps, and the counts
    fit its probabilities (chi-square, fixed seed). ``fused_pick`` (1,500 draws): as on
    CUDA, rows of a temperature alone draw through `fused.gumbel_pick` (here
    interpreted), the others through the torch ops, in one batch."""
    from pagedlm.kernels import fused

    monkeypatch.setattr(fused, "enabled", lambda x: fused_pick)
    launches = []
    gumbel_pick = fused.gumbel_pick
    monkeypatch.setattr(fused, "gumbel_pick", lambda *a: launches.append(a[1].tolist()) or gumbel_pick(*a))
    torch.manual_seed(0)
    vocab, n = 64, 1500 if fused_pick else 6000  # (the interpreter runs a program a row: 1 s per 130)
    base = torch.randn(vocab, generator=torch.Generator().manual_seed(1)) * 2
    rules = TokenRules(banned={0, 5}, allowed=None)
    params = SamplingParams(**knobs)

    class Row:
        def __init__(self, p, r=None):
            self.params, self.rules, self.matcher, self.output_ids, self.tokens = p, r, None, [], []
            self.generator = None if p.temperature == 0 else torch.Generator()

    rows = [Row(params, rules) for _ in range(n)]
    rows += [Row(SamplingParams()), Row(SamplingParams(temperature=2.0, top_k=3))]
    assert all(picks_on_device(r) for r in rows)
    logits = base.expand(len(rows), vocab).clone().to(DEVICE if fused_pick else "cpu")
    drawn = pick_on_device(logits, rows).cpu()
    assert drawn[n] == base.argmax()  # the greedy row beside them
    want = _reference_probs(base.clone(), params, rules)
    counts = torch.bincount(drawn[:n], minlength=vocab).double()
    assert counts[want == 0].sum() == 0  # never outside the support
    assert set(drawn[n + 1 :].tolist()) <= set(base.topk(3).indices.tolist())
    keep = want * n >= 5
    expected = want[keep].double() * n
    chi2 = float(((counts[keep] - expected) ** 2 / expected).sum())
    dof = int(keep.sum()) - 1
    assert chi2 < dof + 6 * (2 * dof) ** 0.5 + 10, (chi2, dof)  # ~6 sigma: a wrong rule fails by far more
    alone = list(knobs) == ["temperature"]
    if fused_pick and alone:  # the kernel took these rows, and only these
        assert launches == [pytest.approx([1 / knobs["temperature"]] * n + [0.0, 0.0])]
    else:
        assert launches == []


def test_unseeded_sampled_rows_overlap_and_keep_their_rules():
    model, tok = tiny_model("llama"), CharTokenizer()
    engine = LLMEngine(model, tok, paged(4, async_scheduling=True))
    allowed = list(range(40, 60))
    params = SamplingParams(max_tokens=12, ignore_eos=True, temperature=1.0, top_p=0.9, allowed_token_ids=allowed)
    overlapped = []
    seqs = run_all(engine, prompts(5, seed=50), params, check=lambda e: overlapped.append(e._inflight is not None))
    assert any(overlapped)
    assert all(len(s.output_ids) == 12 and set(s.output_ids) <= set(allowed) for s in seqs)
    assert len({tuple(s.output_ids) for s in seqs}) > 1  # drawn, not greedy
    assert engine.blocks.num_free == engine.blocks.num_blocks


def test_pick_on_device_is_the_samplers_pick_including_ties_and_bans():
    """Random logits rounded to a coarse grid (many ties, the best often
    banned or outside the allowed set): the device's masked argmax picks the
    token `sample` picks, row by row."""
    tok = tiny_tokenizer()
    vocab = tok.vocab_size
    gen = torch.Generator().manual_seed(0)
    banned = {0, 1, 3, 7}
    rules = [None, TokenRules(banned=banned), TokenRules(banned=banned, allowed=range(3, 40)),
             TokenRules(allowed=[9, 11, 200])]

    class Row:
        def __init__(self, r):
            self.params, self.rules, self.generator, self.output_ids, self.matcher = SamplingParams(), r, None, [], None
            self.tokens = []

    for trial in range(40):
        rows = [Row(rules[(trial + i) % len(rules)]) for i in range(6)]
        if trial % 3 == 0:  # one rules object shared by every row
            rows = [Row(rules[1]) for _ in range(6)]
        logits = torch.round(torch.randn(6, vocab, generator=gen) * 2) / 2
        logits[:, sorted(banned)] += 5  # the raw argmax is often banned
        assert pick_on_device(logits, rows).tolist() == sample(logits, rows)
        # rows whose logits carry their rules already (a grammar row's mask): their rules are not applied again
        ruled = {i for i in range(6) if i % 2}
        plain = [Row(None) if i in ruled else row for i, row in enumerate(rows)]
        assert pick_on_device(logits, rows, ruled=ruled).tolist() == sample(logits, plain)


def test_abort_with_a_token_in_flight_leaves_no_pending_token_and_frees_everything():
    model, tok = tiny_model("llama"), CharTokenizer()
    engine = LLMEngine(model, tok, paged(4, async_scheduling=True))
    a, = engine.add_request(prompts(1, seed=6)[0], SamplingParams(max_tokens=50, ignore_eos=True))
    b, = engine.add_request(prompts(1, seed=7)[0], SamplingParams(max_tokens=50, ignore_eos=True))
    engine.step()
    engine.step()
    assert a.pending and b.pending  # their second tokens are in flight
    engine.abort(a)
    assert a.is_finished and PENDING not in a.output_ids and len(a.output_ids) == 1
    engine.step()
    assert not a.pending and len(a.output_ids) == 1 and len(b.output_ids) == 3 and b.pending
    engine.abort(b)
    while engine.has_unfinished():
        engine.step()
    assert engine.blocks.num_free == engine.blocks.num_blocks and not engine.store.rows


def test_prefix_blocks_committed_under_async_hold_real_tokens():
    """A finished sequence's blocks are findable by the hash of its tokens: a
    second request for its prompt and output reuses them and continues as a
    cold engine would. (A block hashed with a pending token in it would never
    match, or match wrongly.)"""
    model, tok = tiny_model("llama"), CharTokenizer()
    params = SamplingParams(max_tokens=11, ignore_eos=True)
    ids = prompts(1, seed=40, lo=13, hi=13)[0]
    engine = LLMEngine(model, tok, paged(4, async_scheduling=True))
    first = run_all(engine, [ids], params)[0]
    again = run_all(engine, [ids + first.output_ids], params)[0]
    assert again.num_cached >= 20  # 24 tokens: the prompt and output's full blocks but the last token's
    cold = run_all(LLMEngine(model, tok, paged(4, async_scheduling=False)), [ids + first.output_ids], params)[0]
    assert again.output_ids == cold.output_ids


_LLAMA = tiny_model("llama")


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.sampled_from([Ops.ADD, Ops.STEP, Ops.STEP, Ops.ABORT]),
                          st.integers(1, 30), st.integers(1, 12)), min_size=5, max_size=40),
       st.sampled_from([1, 4]))
def test_block_invariants_hold_under_async_scheduling(ops, block_size):
    """Random arrivals, stops, aborts and preemptions (a small pool) with
    steps left in flight: after every step each block is free or owned by one
    live sequence, and at the end every block is free."""
    model, tok = _LLAMA, CharTokenizer()
    engine = LLMEngine(model, tok, paged(block_size, budget=block_bytes(model, block_size) * (48 // block_size),
                                          max_model_len=48, max_num_batched_tokens=16, async_scheduling=True))
    rng = random.Random(0)

    def check():
        running = {s.seq_id for s in engine.scheduler.running}
        engine.blocks.check(running)
        assert set(engine.store.rows) == running
        for s in engine.scheduler.waiting:
            assert not s.pending or engine._inflight is not None

    def add(length, max_tokens):
        stop = [rng.randrange(2, 256)] if rng.random() < 0.5 else []
        return engine.add_request([rng.randrange(2, 256) for _ in range(length)],
                                  SamplingParams(max_tokens=max_tokens, stop_token_ids=stop))

    drive(engine, [(op, (length, max_tokens), length) for op, length, max_tokens in ops], add, check)
    assert engine.blocks.num_free == engine.blocks.num_blocks and not engine.store.rows


def test_the_flag_its_defaults_and_refusals():
    assert resolve_engine_options({}, environ={}).async_scheduling is None
    assert resolve_engine_options({}, environ={"PAGEDLM_ASYNC_SCHEDULING": "1"}).async_scheduling is True
    assert resolve_engine_options({"async_scheduling": False},
                                  environ={"PAGEDLM_ASYNC_SCHEDULING": "1"}).async_scheduling is False
    assert async_scheduling_on(EngineOptions(), "cuda") and not async_scheduling_on(EngineOptions(), "cpu")
    assert async_scheduling_on(EngineOptions(async_scheduling=True), "cpu")
    assert not async_scheduling_on(EngineOptions(speculative="ngram"), "cuda")
    assert not async_scheduling_on(EngineOptions(tensor_parallel_size=2), "cuda")
    with pytest.raises(UnsupportedOption, match="--async-scheduling .* --speculative"):
        resolve_engine_options({"async_scheduling": True, "speculative": "ngram"}, environ={})
    with pytest.raises(UnsupportedOption, match="--tensor-parallel-size"):
        check_refusals({"async_scheduling": True, "tensor_parallel_size": 2})
    assert LLMEngine(_LLAMA, CharTokenizer()).async_scheduling is False  # the CPU's default


def test_n_continuations_sharing_their_prompt_blocks_match_the_synchronous_engine():
    """``n`` sequences over one prompt share its blocks (copy-on-write at the
    first write into a shared block), some ending early on a stop token:
    the async engine's outputs are the synchronous engine's, and every block
    comes back."""
    model, tok = tiny_model("llama"), CharTokenizer()
    ids = prompts(1, seed=60, lo=18, hi=18)[0]
    free = run_all(LLMEngine(model, tok, paged(4)), [ids], SamplingParams(max_tokens=10, ignore_eos=True))[0]
    params = SamplingParams(max_tokens=10, n=3, stop_token_ids=[free.output_ids[6]])
    outs = []
    for on in (False, True):
        engine = LLMEngine(model, tok, paged(4, async_scheduling=on))
        seqs = engine.add_request(ids, params, request_id="r") + engine.add_request(ids[:9], params, request_id="s")
        while engine.has_unfinished():
            engine.step()
        assert engine.blocks.num_free == engine.blocks.num_blocks
        outs.append(seqs)
    _same(*outs)
    assert outs[1][0].finish_reason == "stop"
