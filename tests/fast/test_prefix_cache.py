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

from pagedlm.attention import select_backend
from pagedlm.batch.engine import LLMEngine
from pagedlm.batch.sequence import Sequence
from pagedlm.batch.solo import SOLO, Solo
from pagedlm.cache import KVSpec, KVStore, PagedPools
from pagedlm.cache import kv_quant as kvq
from pagedlm.cache.admission import BlockAdmission, CachedPrefix
from pagedlm.cache.blocks import BlockManager
from pagedlm.cache.layout import plan_layout
from pagedlm.options import EngineOptions, PagedKvOptions, UnsupportedOption, resolve_engine_options
from pagedlm.params import SamplingParams
from tests.helpers import (ATOL, GREEDY, CharTokenizer, GreedyOracle, Ops, block_bytes, drive, prompts, run_all,
                           tiny_model)

SALT = b"s" * 16


def caching(block_size: int = 4, budget: int = 1 << 22, on: bool = True, **kw) -> EngineOptions:
    return EngineOptions(paged_kv=PagedKvOptions(block_size, prefix_caching=on), kv_budget_bytes=budget, **kw)


def seq(tokens: list[int]) -> Sequence:
    return Sequence(tokens, SamplingParams(), set(), None)


def block_admission(num_blocks: int, block_size: int) -> BlockAdmission:
    """The paged store's admission over ``num_blocks`` blocks of one layer
    (one KV head of two values), its pools and store real, the block
    manager's salt ``SALT``."""
    spec = KVSpec(1, 2)
    budget = num_blocks * PagedPools.bytes_per_block(1, block_size, 1, 2, torch.float32)
    layout = plan_layout([spec], EngineOptions(paged_kv=PagedKvOptions(block_size), kv_budget_bytes=budget), "cpu",
                         torch.float32, in_place=False, identity="one layer", max_model_len=block_size)
    pools = PagedPools(layout.pooled_layers, num_blocks, block_size, 1, 2, torch.float32, "cpu")
    return BlockAdmission(BlockManager(num_blocks, block_size, SALT),
                          KVStore(layout, pools, select_backend("torch", "cpu", paged=True)))


def admit(kv: BlockAdmission, s: Sequence) -> None:
    """What the scheduler asks the admission for a waiting sequence that
    fits, then its whole prompt computed in one step."""
    prefix = kv.lookup(s)
    assert prefix is not None
    assert kv.reserve(s, prefix, s.num_tokens - prefix.tokens)
    kv.attach(s, prefix, s.num_tokens - prefix.tokens)
    s.num_computed = s.num_tokens
    kv.commit(s)


def close(a: Sequence, b: Sequence) -> None:
    """Same greedy tokens; chosen and top-3 logprobs within ATOL."""
    assert a.output_ids == b.output_ids
    for (lp_a, top_a), (lp_b, top_b) in zip(a.logprobs, b.logprobs):
        assert abs(lp_a - lp_b) <= ATOL
        assert [t for t, _ in top_a] == [t for t, _ in top_b]
        assert max(abs(x - y) for (_, x), (_, y) in zip(top_a, top_b)) <= ATOL


# -- BlockManager -------------------------------------------------------------


def test_a_second_sequence_takes_the_first_ones_full_blocks_and_counts_references():
    kv = block_admission(8, 4)
    bm = kv.blocks
    a = seq(list(range(10, 20)))  # 2 full blocks + 2 tokens
    admit(kv, a)
    assert bm.num_used == 3
    b = seq(list(range(10, 18)) + [99, 98, 97])  # the same 2 full blocks, then its own
    assert kv.lookup(b) == CachedPrefix(8, tuple(bm.tables[a.seq_id][:2]))
    admit(kv, b)
    assert bm.tables[b.seq_id][:2] == bm.tables[a.seq_id][:2]
    assert bm.tables[b.seq_id][2] != bm.tables[a.seq_id][2]
    assert [bm.ref[x] for x in bm.tables[a.seq_id]] == [2, 2, 1]
    assert bm.num_shared == 2 and bm.num_used == 4 and bm.num_cached == 2
    assert bm.hit_tokens == 8 and bm.queried_tokens == 21
    bm.check({a.seq_id, b.seq_id})
    other = seq(list(range(11, 21)))  # different first block: nothing
    assert bm.lookup(other) == ([], False) and kv.lookup(other) == CachedPrefix(0)


def test_the_salt_and_every_token_of_the_parent_chain_key_a_block():
    tokens = list(range(8))
    assert BlockManager(4, 4, SALT).hashes(seq(tokens)) != BlockManager(4, 4, b"t" * 16).hashes(seq(tokens))
    a, b = BlockManager(4, 4, SALT).hashes(seq(tokens)), BlockManager(4, 4, SALT).hashes(seq([7] + tokens[1:]))
    assert a[0] != b[0] and a[1] != b[1]  # same second-block tokens, different parent


def test_freed_blocks_stay_findable_until_needed_least_recently_freed_first():
    kv = block_admission(5, 2)
    bm = kv.blocks
    a, b = seq([1, 2, 3, 4, 5]), seq([6, 7, 8])
    admit(kv, a)  # [1,2] [3,4] cached, [5] private
    admit(kv, b)  # [6,7] cached, [8] private
    kv.release(a, keep=True)
    kv.release(b, keep=True)
    bm.check(set())
    assert bm.num_free == 5 and bm.num_cached == 3
    again = seq([1, 2, 3, 4, 9])
    assert kv.lookup(again).tokens == 4  # still there after its sequence ended
    # The two private blocks go first; the third block taken evicts the least
    # recently freed cached one: a's tail ([3,4]) went back before its head.
    c = seq([50, 51, 52, 53, 54])
    admit(kv, c)
    assert bm.num_cached == 2 + 2  # [1,2], [6,7], and c's own two
    assert kv.lookup(again).tokens == 2 and kv.lookup(seq([6, 7, 0])).tokens == 2
    bm.check({c.seq_id})


def test_admission_with_too_little_room_takes_nothing():
    kv = block_admission(3, 2)
    bm = kv.blocks
    a = seq([1, 2, 3, 4, 5])
    admit(kv, a)
    assert bm.num_free == 0
    b = seq([1, 2, 3, 4, 6])  # a's two full blocks, and one of its own: none is free
    assert kv.lookup(b).tokens == 4 and not kv.reserve(b, kv.lookup(b), 1)
    assert not kv.allocate(a, 2)  # a's next two tokens: a fourth block
    assert len(bm.tables[a.seq_id]) == 3 and bm.num_free == 0
    bm.check({a.seq_id})


def test_a_write_into_a_cached_block_copies_it_first():
    """Prompt of exactly two blocks, cached: the second request recomputes its
    last token, which lands in the last cached block; it gets a copy."""
    kv = block_admission(6, 4)
    bm, pools = kv.blocks, kv.store.pools
    a = seq(list(range(8)))
    admit(kv, a)
    shared, cached_last = bm.tables[a.seq_id]
    pools.k[0][cached_last] = 7.0
    b = seq(list(range(8)))
    admit(kv, b)
    copy = bm.tables[b.seq_id][1]
    assert bm.tables[b.seq_id][0] == shared and copy != cached_last
    assert (pools.k[0][copy] == 7.0).all()  # copied before it is written
    assert bm.ref[shared] == 2 and bm.ref[cached_last] == 1
    bm.check({a.seq_id, b.seq_id})


def test_a_prefix_being_computed_makes_a_sharer_wait_not_compute_it_twice():
    kv = block_admission(8, 2)
    bm = kv.blocks
    a, b = seq([1, 2, 3, 4, 5]), seq([1, 2, 3, 4, 6])
    prefix = kv.lookup(a)
    assert kv.reserve(a, prefix, 5)
    kv.attach(a, prefix, 5)
    assert bm.lookup(b) == ([], True) and kv.lookup(b) is None  # a computes [1,2] now: b waits
    a.num_computed = 2
    kv.commit(a)
    hit, busy = bm.lookup(b)
    assert len(hit) == 1 and busy and kv.lookup(b) is None  # [3,4] still being computed
    kv.release(a, keep=False)  # a preempted or aborted: nobody computes it any more
    assert kv.lookup(b) == CachedPrefix(2, tuple(hit))
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
            stats = e.cache_stats()  # what bench prefix reads
            assert stats.block_refs == sum(len(t) for t in e.blocks.tables.values())
            assert (stats.blocks_used, stats.blocks_shared) == (e.blocks.num_used, e.blocks.num_shared)
            seen["table_entries"] = max(seen.get("table_entries", 0), stats.block_refs)

        together = run_all(engine, batch, GREEDY, check=watch)
        peaks[on] = seen
        for a, b in zip(together, solo):
            close(a, b)
    # The prefix's 10 blocks, each held once by all six; none shared without caching.
    assert (peaks[True]["refs"], peaks[True]["shared"]) == (6, 10)
    assert (peaks[False]["refs"], peaks[False]["shared"]) == (1, 0)
    assert peaks[True]["used"] < peaks[False]["used"]
    assert peaks[True]["table_entries"] > peaks[True]["used"]  # shared blocks counted once per holder


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


@pytest.mark.parametrize("store", ["paged", "default"])
def test_reset_prefix_cache_forgets_what_no_running_sequence_holds(tiny, store):
    """`reset_prefix_cache` (a bench's repeats, vLLM's call of that name): a
    finished request's prompt is found again until the reset, not after it,
    and the output is the same; a prefix that a running sequence holds stays
    findable (the call says so: False). The prompt and its one output token
    stay inside the Gemma model's window of 8, where the default store's
    prompt cache can take an entry back to a prefix."""
    family, model, tok = tiny
    (ids,) = prompts(1, seed=28, lo=6, hi=6)
    one = SamplingParams(max_tokens=1, ignore_eos=True)
    options = caching(4) if store == "paged" else EngineOptions(prompt_cache_bytes=1 << 22)
    engine = LLMEngine(model, tok, options)
    (first,) = run_all(engine, [ids], one)
    (again,) = run_all(engine, [ids], one)
    assert first.num_cached == 0 and again.num_cached > 0
    assert engine.reset_prefix_cache()
    (after,) = run_all(engine, [ids], one)
    assert after.num_cached == 0 and after.output_ids == first.output_ids
    if store == "paged":
        engine.add_request(ids, SamplingParams(max_tokens=8, ignore_eos=True), "held")
        engine.step()  # prefilled: its full block is committed and in its table
        assert not engine.reset_prefix_cache() and engine.blocks.num_cached > 0


def test_without_prefix_caching_nothing_is_shared(tiny):
    family, model, tok = tiny
    (ids,) = prompts(1, seed=27, lo=20, hi=20)
    engine = LLMEngine(model, tok, caching(4, on=False))
    run_all(engine, [ids, ids], GREEDY)
    (again,) = run_all(engine, [ids], GREEDY)
    assert again.num_cached == 0 and engine.blocks.num_cached == 0 and not engine.blocks.caching
    assert engine.layout.mirrored_layers == frozenset()


def test_sliding_layers_keep_a_copy_of_their_keys_in_the_pools_only_with_prefix_caching():
    model, tok = tiny_model("gemma3_text"), CharTokenizer()
    specs = model.kv_spec()
    on = LLMEngine(model, tok, caching(4))
    assert on.layout.mirrored_layers == {i for i, s in enumerate(specs) if s.window is not None} != set()
    assert set(on.store.pools.layers) == set(on.layout.pooled_layers) == set(range(len(specs)))
    off = LLMEngine(model, tok, caching(4, on=False))
    assert set(off.store.pools.layers) == off.layout.paged_layers


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


def _longest_runs(prefixes: set[tuple[int, ...]]) -> dict[tuple[int, ...], tuple[int, ...]]:
    """Each token prefix -> a longest one that starts with it (the keys of a
    prefix are the first keys of any longer run: attention is causal)."""
    runs: list[tuple[int, ...]] = []
    for p in sorted(prefixes, key=len, reverse=True):
        if not any(r[: len(p)] == p for r in runs):
            runs.append(p)
    return {p: next(r for r in runs if r[: len(p)] == p) for p in prefixes}


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.sampled_from([Ops.ADD, Ops.ADD, Ops.STEP, Ops.STEP, Ops.ABORT]),
                          st.integers(0, 4), st.integers(0, 12), st.integers(1, 10)), min_size=5, max_size=40),
       st.sampled_from([1, 2, 4]), st.sampled_from([3, 0, 1]))
def test_shared_block_invariants_hold_after_every_step(ops, block_size, k):
    """Random arrivals (most sharing one of three prefixes, some repeating an
    earlier sequence's tokens), finishes, aborts, (a small pool)
    preemptions and (``k`` > 0) speculative decoding with proposals right
    up to a random position: after every scheduler step a block is free or
    referenced by exactly the live sequences whose tables hold it, and a
    cached block holds what it held when it was first seen cached (nothing
    writes into a cached block), which is the keys and values of its tokens
    computed alone (never a rejected token's); at the end every block is free."""
    tok = CharTokenizer()
    spec = dict(speculative="ngram", num_speculative_tokens=k) if k else {}
    engine = LLMEngine(_LLAMA, tok, caching(block_size, budget=block_bytes(_LLAMA, block_size) * (48 // block_size),
                                            max_model_len=48, max_num_batched_tokens=16, **spec))
    if k:
        engine.proposer = GreedyOracle(_LLAMA, k)
    blocks, pools = engine.blocks, engine.store.pools
    added, rng = [], random.Random(0)
    prefix_of: dict[bytes, tuple[int, ...]] = {}  # block hash -> every token up to the block's end
    first_seen: dict[tuple[bytes, int], tuple[tuple[int, ...], list[torch.Tensor]]] = {}  # (hash, block) -> ...

    def contents(block: int) -> list[torch.Tensor]:
        return [t[block].clone() for layer in pools.layers for t in (pools.k[layer], pools.v[layer])]

    def check():
        for s in added:  # what every hash stands for, outputs included
            for i, h in enumerate(blocks.hashes(s)):
                prefix_of[h] = tuple(s.tokens[: (i + 1) * block_size])
        running = {s.seq_id for s in engine.scheduler.running}
        blocks.check(running)
        assert set(engine.store.rows) == running
        for s in engine.scheduler.running:
            assert len(blocks.tables[s.seq_id]) >= blocks.blocks_for(s.num_computed)
            assert not s.draft  # a proposal lives within its step
        for h, b in blocks.cached.items():
            tokens, then = first_seen.setdefault((h, b), (prefix_of[h], contents(b)))
            # (within ATOL: a block evicted, then computed again from the same tokens in
            # another batch, comes back under its hash with last bits that may differ)
            assert all(torch.allclose(x, y, atol=ATOL) for x, y in zip(contents(b), then)), f"cached block {b} changed"

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
    # What each block held when first seen cached: its tokens' keys, computed alone.
    runs = _longest_runs({tokens for tokens, _ in first_seen.values()})
    reference = {run: _reference_keys(run) for run in set(runs.values())}
    for (_, b), (tokens, then) in first_seen.items():
        keys = reference[runs[tokens]]
        begin, end = len(tokens) - block_size, len(tokens)
        want = [t[begin:end] for layer in pools.layers for t in keys[layer]]
        assert all(torch.allclose(x, y, atol=ATOL) for x, y in zip(then, want)), f"block {b} of {tokens}"
