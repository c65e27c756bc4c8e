"""The batched engine on tiny random-weight models: batched against alone,
paged against default (exact), preemption, aborts, block invariants after
every step, seeds, prompt-cache reuse, refusals, flat memory."""

from __future__ import annotations

import gc
import random
import types
import warnings
import weakref
from collections import deque

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedlm.batch.engine import LLMEngine, model_context_length
from pagedlm.batch.solo import Solo
from pagedlm.options import EngineOptions, OptionError, PagedKvOptions, RequestTooLarge
from pagedlm.params import SamplingParams
from tests.helpers import ATOL, GREEDY, CharTokenizer, Ops, block_bytes, drive, paged, prompts, run_all, tiny_model


def test_batched_matches_alone_with_staggered_arrivals_and_chunked_prefill(tiny):
    """Mixed prompt lengths arriving one per step, prompts chunked (8 tokens a
    step) beside other rows' decode: the same greedy tokens as each prompt
    alone, and every chosen token's logprob and top-3 within ATOL."""
    family, model, tok = tiny
    batch = prompts(6, seed=1)
    alone = [run_all(LLMEngine(model, tok), [ids], GREEDY)[0] for ids in batch]
    engine = LLMEngine(model, tok, EngineOptions(max_num_batched_tokens=8))
    together = run_all(engine, batch, GREEDY, arrive_every=1)
    for a, b in zip(alone, together):
        assert a.output_ids == b.output_ids
        for (lp_a, top_a), (lp_b, top_b) in zip(a.logprobs, b.logprobs):
            assert abs(lp_a - lp_b) <= ATOL
            assert [t for t, _ in top_a] == [t for t, _ in top_b]
            assert max(abs(x - y) for (_, x), (_, y) in zip(top_a, top_b)) <= ATOL


def test_a_step_really_mixes_prefill_and_decode_rows(tiny):
    family, model, tok = tiny
    engine = LLMEngine(model, tok, EngineOptions(max_num_batched_tokens=8))
    engine.add_request(prompts(1, seed=2, lo=5, hi=5)[0], GREEDY)
    engine.step()  # the whole 5-token prompt: now decoding
    engine.add_request(prompts(1, seed=3, lo=30, hi=30)[0], GREEDY)
    rows = engine.scheduler.schedule()
    assert [n for _, n in rows] == [1, 7]  # one decode token, then a 7-token prompt chunk


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_paged_store_is_bit_identical_to_default_store(tiny, block_size):
    """Same prompts, same schedule: the same tokens and the same logprobs, to the bit."""
    family, model, tok = tiny
    batch = prompts(5, seed=4, lo=2, hi=50)
    opts = dict(max_num_batched_tokens=16, max_num_seqs=4)
    default = run_all(LLMEngine(model, tok, EngineOptions(**opts)), batch, GREEDY, arrive_every=2)
    engine = LLMEngine(model, tok, paged(block_size, **opts))
    assert engine.paged_kv and engine.layout.block_size == engine.blocks.block_size == block_size
    got = run_all(engine, batch, GREEDY, arrive_every=2)
    assert engine.num_preemptions == 0  # same schedule: the pool is big enough
    for a, b in zip(default, got):
        assert a.output_ids == b.output_ids
        assert a.logprobs == b.logprobs  # floats compared exactly


def test_preemption_recomputes_and_continues(tiny):
    """A pool too small for every row: the newest is preempted, recomputed
    later, and ends with the tokens it gets with room to spare."""
    family, model, tok = tiny
    batch = prompts(6, seed=5, lo=10, hi=20)
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    roomy = run_all(LLMEngine(model, tok, paged(4)), batch, params)
    engine = LLMEngine(model, tok, paged(4, budget=block_bytes(model, 4) * 24, max_model_len=64))
    tight = run_all(engine, batch, params, check=lambda e: e.blocks.check({s.seq_id for s in e.scheduler.running}))
    assert engine.num_preemptions > 0
    assert [s.output_ids for s in tight] == [s.output_ids for s in roomy]
    assert engine.blocks.num_free == engine.blocks.num_blocks


def test_abort_frees_everything_before_the_next_step(tiny):
    family, model, tok = tiny
    for options in (EngineOptions(), paged(4)):
        engine = LLMEngine(model, tok, options)
        (a,) = engine.add_request(prompts(1, seed=6)[0], SamplingParams(max_tokens=50, ignore_eos=True))
        (b,) = engine.add_request(prompts(1, seed=7)[0], SamplingParams(max_tokens=50, ignore_eos=True))
        engine.step()
        engine.abort(a)
        assert a.is_finished and a.finish_reason == "abort"
        assert a.seq_id not in engine.store.rows
        if engine.blocks is not None:
            assert a.seq_id not in engine.blocks.tables
        rows = engine.scheduler.schedule()
        assert [s for s, _ in rows] == [b]
        engine.abort(b)
        assert not engine.has_unfinished() and not engine.store.rows
        if engine.blocks is not None:
            assert engine.blocks.num_free == engine.blocks.num_blocks
        else:
            assert engine.admission.reserved_bytes == 0


_LLAMA = tiny_model("llama")


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.sampled_from([Ops.ADD, Ops.STEP, Ops.STEP, Ops.ABORT]),
                          st.integers(1, 30), st.integers(1, 12)), min_size=5, max_size=40),
       st.sampled_from([1, 2, 4]))
def test_block_invariants_hold_after_every_step(ops, block_size):
    """Random arrivals, finishes, aborts and (a small pool) preemptions: after
    every scheduler step each block is free or owned by exactly one live
    sequence; when all have ended, every block is free and no row is left."""
    model, tok = _LLAMA, CharTokenizer()
    engine = LLMEngine(model, tok, paged(block_size, budget=block_bytes(model, block_size) * (48 // block_size),
                                          max_model_len=48, max_num_batched_tokens=16))
    rng = random.Random(0)

    def check():
        running = {s.seq_id for s in engine.scheduler.running}
        engine.blocks.check(running)
        assert set(engine.store.rows) == running
        for s in engine.scheduler.running:  # a running row holds blocks for what it stored
            assert len(engine.blocks.tables.get(s.seq_id, [])) >= engine.blocks.blocks_for(s.num_computed)

    def add(length, max_tokens):
        return engine.add_request([rng.randrange(2, 256) for _ in range(length)],
                                  SamplingParams(max_tokens=max_tokens, ignore_eos=True))

    drive(engine, [(op, (length, max_tokens), length) for op, length, max_tokens in ops], add, check)
    assert engine.blocks.num_free == engine.blocks.num_blocks and not engine.store.rows


def test_a_seeded_request_draws_the_same_tokens_whatever_shares_its_batch(tiny):
    family, model, tok = tiny
    seeded = SamplingParams(max_tokens=10, temperature=0.8, top_p=0.95, top_k=50, seed=1234, ignore_eos=True)
    (ids,) = prompts(1, seed=8)
    alone = run_all(LLMEngine(model, tok), [ids], seeded)[0].output_ids
    engine = LLMEngine(model, tok)
    others = [engine.add_request(p, SamplingParams(max_tokens=10, temperature=1.0, ignore_eos=True))
              for p in prompts(3, seed=9)]
    (mine,) = engine.add_request(ids, seeded)
    while engine.has_unfinished():
        engine.step()
    assert others and mine.output_ids == alone
    unseeded = run_all(LLMEngine(model, tok), [ids], SamplingParams(max_tokens=10, temperature=0.8, seed=99,
                                                                    ignore_eos=True))[0].output_ids
    assert unseeded != alone  # the seed matters (else this test could not fail)


def test_n_sequences_share_a_prompt_and_differ_by_seed(tiny):
    family, model, tok = tiny
    engine = LLMEngine(model, tok)
    seqs = engine.add_request(prompts(1, seed=10)[0], SamplingParams(max_tokens=8, temperature=1.0, seed=5, n=3,
                                                                     ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    assert len(seqs) == 3 and len({tuple(s.output_ids) for s in seqs}) > 1


def test_penalties_change_what_is_sampled_and_never_make_nan(tiny):
    """OpenAI's presence/frequency penalties push repeated tokens down; extreme
    accepted values (tiny temperature, tiny top_p, tiny repetition penalty)
    still give tokens, never NaN probabilities."""
    family, model, tok = tiny
    (ids,) = prompts(1, seed=11)
    plain = run_all(LLMEngine(model, tok), [ids], SamplingParams(max_tokens=16, ignore_eos=True))[0]
    penal = run_all(LLMEngine(model, tok), [ids], SamplingParams(max_tokens=16, ignore_eos=True,
                                                                 frequency_penalty=2.0, presence_penalty=2.0))[0]
    assert len(set(penal.output_ids)) >= len(set(plain.output_ids))
    assert penal.output_ids != plain.output_ids
    for extreme in (dict(temperature=1e-30), dict(temperature=0.7, top_p=1e-30),
                    dict(temperature=0.7, repetition_penalty=1e-30), dict(temperature=50.0, min_p=1.0)):
        out = run_all(LLMEngine(model, tok), [ids], SamplingParams(max_tokens=4, seed=0, ignore_eos=True,
                                                                   **extreme))[0]
        assert len(out.output_ids) == 4 and all(0 <= t < 256 for t in out.output_ids)


def test_stop_ids_strings_and_length():
    model, tok = _LLAMA, CharTokenizer()
    (ids,) = prompts(1, seed=12)
    free = run_all(LLMEngine(model, tok), [ids], SamplingParams(max_tokens=12, ignore_eos=True))[0]
    assert free.finish_reason == "length" and len(free.output_ids) == 12
    stop_id = free.output_ids[4]
    by_id = run_all(LLMEngine(model, tok), [ids], SamplingParams(max_tokens=12, stop_token_ids=[stop_id]))[0]
    first = free.output_ids.index(stop_id)
    assert by_id.finish_reason == "stop" and by_id.output_ids == free.output_ids[: first + 1]
    stop_text = tok.decode(free.output_ids[5:7])
    by_text = run_all(LLMEngine(model, tok), [ids], SamplingParams(max_tokens=12, stop=[stop_text],
                                                                   ignore_eos=True))[0]
    assert by_text.finish_reason == "stop"
    assert by_text.text == free.text[: free.text.index(stop_text)]


def test_prompt_logprobs_across_chunks_equal_a_one_shot_forward(tiny):
    """Prompt logprobs computed chunk by chunk inside mixed steps equal the
    log-softmax of one forward over the whole prompt (within ATOL)."""
    family, model, tok = tiny
    (ids,) = prompts(1, seed=13, lo=30, hi=30)
    engine = LLMEngine(model, tok, EngineOptions(max_num_batched_tokens=7))
    engine.add_request(prompts(1, seed=14)[0], SamplingParams(max_tokens=6, ignore_eos=True))
    (seq,) = engine.add_request(ids, SamplingParams(max_tokens=2, prompt_logprobs=2, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    reference = torch.log_softmax(Solo(model)(ids).float(), dim=-1)
    assert len(seq.prompt_logprobs) == len(ids) - 1
    for p, (lp, top) in enumerate(seq.prompt_logprobs):
        assert abs(lp - reference[p, ids[p + 1]].item()) <= ATOL
        assert [t for t, _ in top] == reference[p].topk(2).indices.tolist()


def test_prompt_cache_reuses_a_finished_prefix_with_the_same_output(tiny):
    family, model, tok = tiny
    engine = LLMEngine(model, tok, EngineOptions(prompt_cache_bytes=1 << 24))
    (ids,) = prompts(1, seed=15, lo=20, hi=20)
    first = run_all(engine, [ids], GREEDY)[0]
    turn = ids + first.output_ids + [7, 8, 9]  # a next turn: all of the first, then more
    second = run_all(engine, [turn], GREEDY)[0]
    # The first stored its prompt and every generated token but the last (never fed).
    assert second.num_cached == len(ids) + len(first.output_ids) - 1
    cold = run_all(LLMEngine(model, tok), [turn], GREEDY)[0]
    assert second.output_ids == cold.output_ids
    assert engine.prompt_cache.hits == 1


def test_requests_that_can_never_fit_are_refused_when_added(tiny):
    family, model, tok = tiny
    engine = LLMEngine(model, tok, paged(4, budget=1 << 16, max_model_len=64))
    capacity = engine.blocks.num_blocks * 4
    assert capacity < 512
    with pytest.raises(OptionError, match="max_model_len"):
        engine.add_request([5] * 60, SamplingParams(max_tokens=10))
    one_step = LLMEngine(model, tok).admission.projected_bytes(256)  # the room of a sequence's first 256 tokens
    default = LLMEngine(model, tok, EngineOptions(kv_budget_bytes=one_step, max_model_len=512))
    assert default.max_model_len == 512  # the user's length stays; what the budget cannot hold is refused
    with pytest.raises(RequestTooLarge, match=f"KV budget is {one_step} bytes"):
        default.add_request([5] * 10, SamplingParams(max_tokens=300))
    default.add_request([5] * 10, SamplingParams(max_tokens=246))
    assert not engine.has_unfinished() and default.has_unfinished()


def test_the_default_store_lowers_the_models_context_to_what_its_budget_holds(tiny, capsys):
    """As the paged store does: the model's context was only a default, so a
    chat without max_tokens (all the context left) still fits; a budget that
    holds no sequence is refused at startup."""
    family, model, tok = tiny
    assert model_context_length(model) == 512
    one_step = LLMEngine(model, tok).admission.projected_bytes(256)
    engine = LLMEngine(model, tok, EngineOptions(kv_budget_bytes=one_step))
    assert engine.max_model_len == 256
    assert "max_model_len lowered from the model's 512 to 256 tokens" in capsys.readouterr().err
    engine.check_fits(6, 250)
    with pytest.raises(OptionError, match="max_model_len"):
        engine.check_fits(6, 251)
    with pytest.raises(OptionError, match=r"the KV budget \(4096 bytes\) holds no sequence"):
        LLMEngine(model, tok, EngineOptions(kv_budget_bytes=4096))


def test_a_budget_smaller_than_one_max_length_sequence_is_refused_at_startup(tiny):
    family, model, tok = tiny
    with pytest.raises(OptionError, match="fewer than one sequence of max_model_len"):
        LLMEngine(model, tok, paged(4, budget=block_bytes(model, 4) - 1))  # not one block
    with pytest.raises(OptionError, match="fewer than one sequence of max_model_len 512 needs"):
        LLMEngine(model, tok, paged(4, budget=block_bytes(model, 4) * 20, max_model_len=512))  # asked for


def test_a_default_max_model_len_past_the_budget_is_lowered_to_what_fits(tiny, capsys):
    """The model's context (512 here) was not asked for: the engine starts with
    what the pools hold, says so in one line, and refuses longer requests."""
    family, model, tok = tiny
    engine = LLMEngine(model, tok, paged(4, budget=block_bytes(model, 4) * 20))
    assert engine.max_model_len == 80 == engine.blocks.num_blocks * 4
    assert "max_model_len lowered from the model's 512 to 80 tokens" in capsys.readouterr().err
    with pytest.raises(OptionError, match=r"exceeds max_model_len \(80\)"):
        engine.add_request(prompts(1, seed=1, lo=70, hi=70)[0], SamplingParams(max_tokens=20))
    assert run_all(engine, prompts(2, seed=2, lo=20, hi=30), SamplingParams(max_tokens=8, ignore_eos=True))


_OPAQUE = (type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType, types.MethodType, torch.Tensor)


def held(engine: LLMEngine) -> tuple[int, int]:
    """What the engine holds: the objects reachable from it through
    containers and instances (not through classes, modules or functions;
    the model's weights and the tokenizer left out) that the garbage
    collector tracks, and the entries of those that are containers (a dict
    keyed by sequence ids, say, that is never emptied)."""
    seen, stack, objects, entries = {id(engine.model), id(engine.tokenizer)}, [engine], 0, 0
    while stack:
        o = stack.pop()
        container = isinstance(o, (dict, list, tuple, set, deque))  # (untracked when they hold only ints)
        if id(o) not in seen and (container or gc.is_tracked(o)):  # not ints or bytes: counters change
            seen.add(id(o))
            objects += 1
            entries += len(o) if container else 0
            if not isinstance(o, _OPAQUE):
                stack.extend(gc.get_referents(o))
    return objects, entries


def live_tensors() -> int:
    gc.collect()
    with warnings.catch_warnings():  # isinstance on every object pokes deprecated torch attributes
        warnings.simplefilter("ignore")
        return sum(1 for o in gc.get_objects() if isinstance(o, torch.Tensor))


@pytest.mark.parametrize("options", [
    EngineOptions(max_num_seqs=8),
    EngineOptions(paged_kv=PagedKvOptions(4, prefix_caching=False), kv_budget_bytes=1 << 22, max_num_seqs=8),
    # a pool of 8 blocks: preemptions, and cached blocks evicted as they are needed
    paged(4, budget=block_bytes(_LLAMA, 4) * 8, max_model_len=32, max_num_seqs=8),
], ids=["default", "paged", "paged-caching-tight"])
def test_memory_stays_flat_round_after_round_of_requests(options):
    """Rounds of the same mix of requests (new tokens each round; some share
    a prefix, some fan out to n=2, every seventh is aborted after a step,
    queued behind 8 rows): after each round no sequence is alive, nothing
    is left behind, and from the second round on the engine holds no more
    objects, and the process no more tensors, than after it."""
    engine = LLMEngine(_LLAMA, CharTokenizer(), options)
    held_after, tensors_after = [], []
    for round_ in range(4):
        shapes, rng = random.Random(0), random.Random(round_ + 1)
        prefix = [rng.randrange(2, 256) for _ in range(9)]
        seqs = []
        for i in range(24):
            n = shapes.randint(1, 12)
            ids = (prefix[:n] if i % 3 == 0 else []) + [rng.randrange(2, 256) for _ in range(n)]
            seqs += engine.add_request(ids, SamplingParams(max_tokens=shapes.randint(1, 6), n=1 + (i % 10 == 0),
                                                           ignore_eos=True))
        engine.step()
        for seq in seqs[::7]:
            engine.abort(seq)
        while engine.has_unfinished():
            engine.step()
        gone = [weakref.ref(seq) for seq in seqs]
        del seqs, seq
        gc.collect()
        assert all(ref() is None for ref in gone), "a finished sequence is still referenced"
        assert not engine.store.rows
        if engine.blocks is not None:
            assert engine.blocks.num_free == engine.blocks.num_blocks and not engine.blocks.tables
        else:
            assert engine.admission.reserved_bytes == 0
        held_after.append(held(engine))
        tensors_after.append(live_tensors() if round_ in (1, 3) else None)
    (objects, entries) = held_after[1]
    assert all(o <= objects and e <= entries for o, e in held_after[2:]), held_after
    assert tensors_after[3] <= tensors_after[1], tensors_after
    if engine.blocks is not None and engine.blocks.caching:
        assert engine.num_preemptions > 0 and engine.blocks.hit_tokens > 0


def test_the_engine_kept_for_pagedlm_generate_goes_with_its_model():
    import pagedlm

    model = tiny_model("llama")
    assert len(pagedlm.generate(model, CharTokenizer(), "hello", SamplingParams(max_tokens=2, ignore_eos=True))) >= 1
    gone = weakref.ref(model)
    del model
    gc.collect()
    assert gone() is None


def test_new_tokens_are_the_next_ones_across_the_prompt_output_boundary():
    from pagedlm.batch.sequence import Sequence

    seq = Sequence([10, 11, 12], SamplingParams(), set(), None)
    seq.output_ids = [20, 21]
    for computed in range(5):
        for n in range(1, 6 - computed):
            seq.num_computed = computed
            assert seq.new_tokens(n) == seq.tokens[computed : computed + n]


class _HoldingTokenizer(CharTokenizer):
    """Its detokenizer holds every character back until finalize, as a
    byte-level one holds the bytes of an unfinished character."""

    def detokenizer(self, skip_special_tokens=True):
        class Holding:
            def __init__(self, tok):
                self.tok, self.ids, self.sent = tok, [], 0

            def add_token(self, token):
                self.ids.append(token)
                return ""

            def finalize(self):
                text, self.sent = self.tok.decode(self.ids[self.sent:]), len(self.ids)
                return text

        return Holding(self)


def test_text_held_back_is_flushed_when_a_stop_id_ends_the_sequence():
    model, tok = _LLAMA, _HoldingTokenizer()
    (ids,) = prompts(1, seed=16)
    free = run_all(LLMEngine(model, tok), [ids], SamplingParams(max_tokens=8, ignore_eos=True))[0]
    stop = free.output_ids[3]
    first = free.output_ids.index(stop)
    out = run_all(LLMEngine(model, tok), [ids], SamplingParams(max_tokens=8, stop_token_ids=[stop]))[0]
    assert out.finish_reason == "stop"
    assert out.text == CharTokenizer().decode(free.output_ids[:first])


def test_nothing_of_a_step_outlives_it(tiny, monkeypatch):
    """After a step returns, no reference to its StepBatch is left (the
    store's per-step plan held its masks and tables until the next step:
    memory that grew or shrank with whatever step came last)."""

    from pagedlm.batch import engine as engine_mod

    family, model, tok = tiny
    engine = LLMEngine(model, tok, paged(8, max_num_batched_tokens=8))
    made = []

    def spy(*args, **kw):
        step = engine_mod.prepare_step.__wrapped__(*args, **kw)
        made.append(weakref.ref(step))
        return step

    spy.__wrapped__ = engine_mod.prepare_step
    monkeypatch.setattr(engine_mod, "prepare_step", spy)
    engine.add_request(prompts(1, seed=8, lo=20, hi=20)[0], GREEDY)
    engine.step()  # a prompt chunk: masks and tables built for the layers
    gc.collect()
    assert made and all(ref() is None for ref in made)
