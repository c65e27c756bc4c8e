"""Block-level prefix caching on the paged store: the block manager's
hashing, reference counts, LRU and copy-on-write; the engine serving cached
prefixes with a cold request's tokens (tiny models of both families, the
Gemma one with sliding layers whose ring buffers are refilled from the
pools); n > 1, concurrent and multi-turn sharing; the invariant after every
step of random schedules, contents of cached blocks included."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedlm.batch.block_manager import BlockManager
from pagedlm.cache import kv_quant as kvq
from pagedlm.batch.engine import LLMEngine
from pagedlm.batch.sequence import Sequence
from pagedlm.batch.solo import SOLO, Solo
from pagedlm.cache import PagedPools
from pagedlm.options import EngineOptions, PagedKvOptions, UnsupportedOption, resolve_engine_options
from pagedlm.params import SamplingParams
from tests.conftest import CharTokenizer, tiny_model
from tests.fast.test_engine import ATOL, GREEDY, _Ops, block_bytes, drive, prompts, run_all

SALT = b"s" * 16


def caching(block_size: int = 4, budget: int = 1 << 22, on: bool = True, **kw) -> EngineOptions:
    return EngineOptions(paged_kv=PagedKvOptions(block_size, prefix_caching=on), kv_budget_bytes=budget, **kw)


def seq(tokens: list[int]) -> Sequence:
    return Sequence(tokens, SamplingParams(), set(), None)


def admit(bm: BlockManager, s: Sequence) -> list[tuple[int, int]]:
    """What the scheduler does: take the cached prefix, allocate the rest, compute it."""
    hit, busy = bm.lookup(s)
    assert not busy
    start = min(len(hit) * bm.block_size, s.num_tokens - 1)
    hit = hit[: bm.blocks_for(start)]
    bm.admit(s, hit, start)
    s.num_computed = start
    copies = bm.allocate_slots(s.seq_id, s.num_tokens, write_from=start)
    s.num_computed = s.num_tokens
    bm.commit(s, s.num_tokens)
    return copies


def close(a: Sequence, b: Sequence) -> None:
    """Same greedy tokens; chosen and top-3 logprobs within ATOL."""
    assert a.output_ids == b.output_ids
    for (lp_a, top_a), (lp_b, top_b) in zip(a.logprobs, b.logprobs):
        assert abs(lp_a - lp_b) <= ATOL
        assert [t for t, _ in top_a] == [t for t, _ in top_b]
        assert max(abs(x - y) for (_, x), (_, y) in zip(top_a, top_b)) <= ATOL


# -- BlockManager -------------------------------------------------------------


def test_a_second_sequence_takes_the_first_ones_full_blocks_and_counts_references():
    bm = BlockManager(8, 4, SALT)
    a = seq(list(range(10, 20)))  # 2 full blocks + 2 tokens
    assert admit(bm, a) == []
    b = seq(list(range(10, 18)) + [99, 98, 97])  # the same 2 full blocks, then its own
    hit, busy = bm.lookup(b)
    assert hit == bm.tables[a.seq_id][:2] and not busy
    admit(bm, b)
    assert bm.tables[b.seq_id][:2] == bm.tables[a.seq_id][:2]
    assert bm.tables[b.seq_id][2] != bm.tables[a.seq_id][2]
    assert [bm.ref[x] for x in bm.tables[a.seq_id]] == [2, 2, 1]
    assert bm.num_shared == 2 and bm.num_used == 4 and bm.num_cached == 2
    assert bm.hit_tokens == 8 and bm.queried_tokens == 21
    bm.check({a.seq_id, b.seq_id})
    other = seq(list(range(11, 21)))  # different first block: nothing
    assert bm.lookup(other) == ([], False)


def test_the_salt_and_every_token_of_the_parent_chain_key_a_block():
    tokens = list(range(8))
    assert BlockManager(4, 4, SALT).hashes(seq(tokens)) != BlockManager(4, 4, b"t" * 16).hashes(seq(tokens))
    a, b = BlockManager(4, 4, SALT).hashes(seq(tokens)), BlockManager(4, 4, SALT).hashes(seq([7] + tokens[1:]))
    assert a[0] != b[0] and a[1] != b[1]  # same second-block tokens, different parent


def test_freed_blocks_stay_findable_until_needed_least_recently_freed_first():
    bm = BlockManager(5, 2, SALT)
    a, b = seq([1, 2, 3, 4, 5]), seq([6, 7, 8])
    admit(bm, a)  # [1,2] [3,4] cached, [5] private
    admit(bm, b)  # [6,7] cached, [8] private
    bm.free(a.seq_id)
    bm.free(b.seq_id)
    bm.check(set())
    assert bm.num_free == 5 and bm.num_cached == 3
    again = seq([1, 2, 3, 4, 9])
    assert len(bm.lookup(again)[0]) == 2  # still there after its sequence ended
    # The two private blocks go first; the third block taken evicts the least
    # recently freed cached one: a's tail ([3,4]) went back before its head.
    c = seq([50, 51, 52, 53, 54])
    admit(bm, c)
    assert bm.num_cached == 2 + 2  # [1,2], [6,7], and c's own two
    assert len(bm.lookup(again)[0]) == 1 and len(bm.lookup(seq([6, 7, 0]))[0]) == 1
    bm.check({c.seq_id})


def test_admission_with_too_little_room_takes_nothing():
    bm = BlockManager(3, 2, SALT)
    a = seq([1, 2, 3, 4, 5])
    admit(bm, a)
    assert bm.num_free == 0
    assert bm.allocate_slots(a.seq_id, 7, write_from=5) is None
    assert len(bm.tables[a.seq_id]) == 3
    bm.check({a.seq_id})


def test_a_write_into_a_cached_block_copies_it_first():
    """Prompt of exactly two blocks, cached: the second request recomputes its
    last token, which lands in the last cached block; it gets a copy."""
    bm = BlockManager(6, 4, SALT)
    a = seq(list(range(8)))
    admit(bm, a)
    b = seq(list(range(8)))
    copies = admit(bm, b)
    shared, cached_last = bm.tables[a.seq_id]
    assert copies == [(cached_last, bm.tables[b.seq_id][1])]
    assert bm.tables[b.seq_id][0] == shared and bm.tables[b.seq_id][1] != cached_last
    assert bm.ref[shared] == 2 and bm.ref[cached_last] == 1
    bm.check({a.seq_id, b.seq_id})


def test_a_prefix_being_computed_makes_a_sharer_wait_not_compute_it_twice():
    bm = BlockManager(8, 2, SALT)
    a, b = seq([1, 2, 3, 4, 5]), seq([1, 2, 3, 4, 6])
    bm.admit(a, [], 0)
    assert bm.allocate_slots(a.seq_id, 5, write_from=0) == []
    assert bm.lookup(b) == ([], True)  # a computes [1,2] now
    bm.commit(a, 2)
    hit, busy = bm.lookup(b)
    assert len(hit) == 1 and busy  # [3,4] still being computed
    bm.free(a.seq_id)  # a preempted or aborted: nobody computes it any more
    assert bm.lookup(b)[1] is False
    bm.check(set())


def test_prefix_caching_flag_resolution_and_refusal():
    assert resolve_engine_options({"paged_kv": True}, environ={}).paged_kv.prefix_caching
    off = resolve_engine_options({"paged_kv": True, "prefix_caching": False}, environ={})
    assert off.paged_kv.prefix_caching is False
    env = resolve_engine_options({"paged_kv": True}, environ={"PAGEDLM_PREFIX_CACHING": "0"})
    assert env.paged_kv.prefix_caching is False
    flag_beats_env = resolve_engine_options({"paged_kv": True, "prefix_caching": True},
                                            environ={"PAGEDLM_PREFIX_CACHING": "0"})
    assert flag_beats_env.paged_kv.prefix_caching is True
    with pytest.raises(UnsupportedOption, match="needs --paged-kv"):
        resolve_engine_options({"prefix_caching": True}, environ={})
    assert resolve_engine_options({"prefix_caching": False}, environ={}).paged_kv is None


# -- the engine ---------------------------------------------------------------


def test_a_request_served_from_cached_blocks_equals_it_cold(tiny):
    """A long prompt, then a second sharing most of it (past the Gemma
    model's window of 8): the second computes only its own tokens, and gets
    the cold request's greedy tokens and logprobs."""
    family, model, tok = tiny
    base = prompts(1, seed=20, lo=30, hi=30)[0]
    second = base[:27] + [5, 6, 7]
    engine = LLMEngine(model, tok, caching(4))
    run_all(engine, [base], GREEDY)
    (warm,) = run_all(engine, [second], GREEDY)
    assert warm.num_cached == 24  # six full blocks of 4
    (cold,) = run_all(LLMEngine(model, tok, caching(4, on=False)), [second], GREEDY)
    assert cold.num_cached == 0
    close(warm, cold)


@pytest.mark.parametrize("length", [16, 17])
def test_an_identical_prompt_recomputes_only_its_last_token_and_leaves_the_cache_intact(tiny, length):
    """16 tokens: the last one sits in a cached block, which is copied before
    it is written (copy-on-write); the cached blocks keep their bits."""
    family, model, tok = tiny
    ids = prompts(1, seed=21, lo=length, hi=length)[0]
    engine = LLMEngine(model, tok, caching(4))
    (first,) = run_all(engine, [ids], GREEDY)
    pools, blocks = engine.store.pools, engine.blocks
    cached = dict(blocks.cached)
    before = {h: pools.k[pools.layers[0]][b].clone() for h, b in cached.items()}
    (again,) = run_all(engine, [ids], GREEDY)
    assert again.num_cached == length - 1
    close(again, first)
    for h, b in cached.items():
        assert blocks.cached[h] == b and torch.equal(pools.k[pools.layers[0]][b], before[h])


def test_a_failing_admission_raises_its_own_error_and_leaves_no_block_held(tiny, monkeypatch):
    """A step that raises while admitting (here the copy-on-write of a hit)
    surfaces that error, not a second one from the cleanup, and the abort
    returns every block the sequence took."""
    family, model, tok = tiny
    ids = prompts(1, seed=21, lo=16, hi=16)[0]
    engine = LLMEngine(model, tok, caching(4))
    run_all(engine, [ids], GREEDY)

    def broken(src, dst):
        raise RuntimeError("copy failed")

    monkeypatch.setattr(engine.store.pools, "copy_blocks", broken)
    with pytest.raises(RuntimeError, match="copy failed"):
        for _ in engine.stream(ids, GREEDY):
            pass
    assert not engine.has_unfinished() and engine.blocks.num_used == 0


def test_n_continuations_share_their_prompts_blocks_and_equal_solo_runs(tiny):
    family, model, tok = tiny
    ids = prompts(1, seed=22, lo=21, hi=21)[0]
    (solo,) = run_all(LLMEngine(model, tok, caching(4, on=False)), [ids], GREEDY)
    engine = LLMEngine(model, tok, caching(4))
    seqs = engine.add_request(ids, SamplingParams(max_tokens=12, ignore_eos=True, logprobs=3, n=3))
    shared = 0
    while engine.has_unfinished():
        engine.step()
        shared = max(shared, engine.blocks.num_shared)
    assert shared == 5  # the prompt's 5 full blocks, held once by all three
    assert [s.num_cached for s in seqs] == [0, 20, 20]  # the prompt is computed once
    for s in seqs:
        close(s, solo)


def test_concurrent_shared_prefix_requests_equal_their_solo_outputs_and_hold_the_prefix_once(tiny):
    family, model, tok = tiny
    prefix = prompts(1, seed=23, lo=40, hi=40)[0]
    batch = [prefix + q for q in prompts(6, seed=24, lo=3, hi=9)]
    solo = [run_all(LLMEngine(model, tok, caching(4, on=False)), [ids], GREEDY)[0] for ids in batch]
    peaks = {}
    for on in (True, False):
        engine = LLMEngine(model, tok, caching(4, on=on, max_num_batched_tokens=64))
        seen = {"used": 0, "refs": 0, "shared": 0}

        def watch(e):
            seen["used"] = max(seen["used"], e.blocks.num_used)
            seen["refs"] = max(seen["refs"], max(e.blocks.ref))
            seen["shared"] = max(seen["shared"], e.blocks.num_shared)

        together = run_all(engine, batch, GREEDY, check=watch)
        peaks[on] = seen
        for a, b in zip(together, solo):
            close(a, b)
    # The prefix's 10 blocks, each held once by all six; none shared without caching.
    assert (peaks[True]["refs"], peaks[True]["shared"]) == (6, 10)
    assert (peaks[False]["refs"], peaks[False]["shared"]) == (1, 0)
    assert peaks[True]["used"] < peaks[False]["used"]


def test_a_conversations_next_turn_reuses_the_previous_turns_blocks(tiny):
    family, model, tok = tiny
    engine = LLMEngine(model, tok, caching(4))
    (ids,) = prompts(1, seed=25, lo=18, hi=18)
    (first,) = run_all(engine, [ids], GREEDY)
    turn = ids + first.output_ids + [7, 8, 9]
    (second,) = run_all(engine, [turn], GREEDY)
    # The first computed its prompt and every output token but the last.
    assert second.num_cached == (len(ids) + len(first.output_ids) - 1) // 4 * 4
    (cold,) = run_all(LLMEngine(model, tok, caching(4, on=False)), [turn], GREEDY)
    close(second, cold)


def test_prompt_logprobs_are_scored_even_when_the_prompt_is_cached(tiny):
    family, model, tok = tiny
    (ids,) = prompts(1, seed=26, lo=20, hi=20)
    engine = LLMEngine(model, tok, caching(4))
    run_all(engine, [ids], GREEDY)
    scored = SamplingParams(max_tokens=2, prompt_logprobs=1, ignore_eos=True)
    (warm,) = run_all(engine, [ids], scored)
    (cold,) = run_all(LLMEngine(model, tok, caching(4, on=False)), [ids], scored)
    assert warm.num_cached == 0 and len(warm.prompt_logprobs) == len(ids) - 1
    assert all(abs(a[0] - b[0]) <= ATOL for a, b in zip(warm.prompt_logprobs, cold.prompt_logprobs))


def test_without_prefix_caching_nothing_is_shared(tiny):
    family, model, tok = tiny
    (ids,) = prompts(1, seed=27, lo=20, hi=20)
    engine = LLMEngine(model, tok, caching(4, on=False))
    run_all(engine, [ids, ids], GREEDY)
    (again,) = run_all(engine, [ids], GREEDY)
    assert again.num_cached == 0 and engine.blocks.num_cached == 0 and not engine.blocks.caching
    assert engine.store.mirrored_layers == frozenset()


def test_sliding_layers_keep_a_copy_of_their_keys_in_the_pools_only_with_prefix_caching():
    model, tok = tiny_model("gemma3_text"), CharTokenizer()
    specs = model.kv_spec()
    on = LLMEngine(model, tok, caching(4))
    assert on.store.mirrored_layers == {i for i, s in enumerate(specs) if s.window is not None} != set()
    assert set(on.store.pools.layers) == set(range(len(specs)))
    off = LLMEngine(model, tok, caching(4, on=False))
    assert set(off.store.pools.layers) == off.store.paged_layers


@pytest.mark.parametrize("kv_quant", ["none", "int8", "fp8"])
def test_copy_blocks_copies_every_layer(kv_quant):
    """fp8 too: torch's index_copy_ has no float8 kernel (the H200's 32k
    bench hit that on a prefix hit's copy-on-write)."""
    pools = PagedPools([0, 2], 4, 2, 1, 3, torch.float32, "cpu", kv_quant=kv_quant)
    tensors = [*pools.k.values(), *pools.v.values(), *pools.k_scale.values(), *pools.v_scale.values()]
    for i, t in enumerate(tensors):
        t.copy_(torch.randn(t.shape, generator=torch.Generator().manual_seed(i)).to(t.dtype))
    before = [t.clone() for t in tensors]
    pools.copy_blocks([3, 0], [1, 2])
    assert len(tensors) == (8 if kv_quant != "none" else 4)
    for t, old in zip(tensors, before):
        assert _same_bytes(t[1], old[3]) and _same_bytes(t[2], old[0])
        assert _same_bytes(t[0], old[0]) and _same_bytes(t[3], old[3])


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(kvq.as_bytes(a.reshape(-1)), kvq.as_bytes(b.reshape(-1)))  # float8 has no torch.equal


# -- the invariant after every step --------------------------------------------


_LLAMA = tiny_model("llama")
_PREFIXES = prompts(3, seed=28, lo=6, hi=20)


def _reference_keys(tokens: tuple[int, ...]) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Every layer's keys and values of ``tokens`` computed alone (default store)."""
    solo = Solo(_LLAMA)
    solo(list(tokens), logits=False)
    return {layer: (c.keys[: len(tokens)], c.values[: len(tokens)]) for layer, c in enumerate(solo.store.rows[SOLO])}


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.sampled_from([_Ops.ADD, _Ops.ADD, _Ops.STEP, _Ops.STEP, _Ops.ABORT]),
                          st.integers(0, 4), st.integers(0, 12), st.integers(1, 10)), min_size=5, max_size=40),
       st.sampled_from([1, 2, 4]))
def test_shared_block_invariants_hold_after_every_step(ops, block_size):
    """Random arrivals (most sharing one of three prefixes, some repeating an
    earlier sequence's tokens), finishes, aborts
    and (a small pool) preemptions: after every scheduler step a block is free
    or referenced by exactly the live sequences whose tables hold it, and
    every cached block holds the keys and values of its tokens; at the end
    every block is free."""
    tok = CharTokenizer()
    engine = LLMEngine(_LLAMA, tok, caching(block_size, budget=block_bytes(_LLAMA, block_size) * (48 // block_size),
                                            max_model_len=48, max_num_batched_tokens=16))
    blocks, pools = engine.blocks, engine.store.pools
    added, rng = [], random.Random(0)
    prefix_of: dict[bytes, tuple[int, ...]] = {}  # block hash -> every token up to the block's end
    reference: dict[tuple[int, ...], dict] = {}

    def check():
        for s in added:  # what every hash stands for, outputs included
            for i, h in enumerate(blocks.hashes(s)):
                prefix_of[h] = tuple(s.tokens[: (i + 1) * block_size])
        running = {s.seq_id for s in engine.scheduler.running}
        blocks.check(running)
        assert set(engine.store.rows) == running
        for s in engine.scheduler.running:
            assert len(blocks.tables[s.seq_id]) >= blocks.blocks_for(s.num_computed)
        for h, b in blocks.cached.items():
            tokens = prefix_of[h]
            if tokens not in reference:
                reference[tokens] = _reference_keys(tokens)
            begin = len(tokens) - block_size
            for layer, (k, v) in reference[tokens].items():
                assert torch.allclose(pools.k[layer][b], k[begin:], atol=ATOL), f"block {b} layer {layer}"
                assert torch.allclose(pools.v[layer][b], v[begin:], atol=ATOL)

    def add(which, extra, max_tokens):
        ids = (_PREFIXES[which] if which < 3 else []) + [rng.randrange(2, 256) for _ in range(extra + 1)]
        if which == 4 and added:  # an earlier sequence's tokens in whole blocks: copy-on-write
            earlier = added[extra % len(added)].tokens
            ids = earlier[: min(len(earlier), 48 - max_tokens) // block_size * block_size] or ids
        seqs = engine.add_request(ids, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
        added.extend(seqs)
        return seqs

    drive(engine, [(op, (which, extra, max_tokens), extra) for op, which, extra, max_tokens in ops], add, check)
    assert blocks.num_free == blocks.num_blocks and not engine.store.rows
