"""The paged store's pieces: ``PagedPools`` (slot writes, block-table
gathers), ``BlockManager`` (who owns which block), ``prepare_step`` (slot
mapping, row bounds), and ``KVStore`` paged against default: bit-identical
for the same schedule, and both equal to brute-force attention over each
row's whole history."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedlm.attention import select_backend
from pagedlm.batch.step import prepare_step
from pagedlm.cache import KVSpec, KVStore, PagedPools
from pagedlm.cache import kv_quant as kvq
from pagedlm.cache.blocks import BlockManager
from pagedlm.cache.layout import plan_layout
from pagedlm.options import EngineOptions, PagedKvOptions

HKV, HQ, D = 2, 4, 8  # GQA: two query heads per kv head
CPU = torch.device("cpu")


@dataclass
class FakeSeq:
    """What ``prepare_step`` reads of a ``Sequence``."""

    seq_id: int
    tokens: list[int]
    num_computed: int = 0
    history: dict = field(default_factory=dict)  # layer -> (keys, values) written so far

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    def new_tokens(self, n: int) -> list[int]:
        return self.tokens[self.num_computed : self.num_computed + n]

    @property
    def last_token(self) -> int:
        return self.tokens[-1]


UNWRITTEN = 7.0


def pools(layers, num_blocks, block_size, dtype=torch.float32, kv_quant="none") -> PagedPools:
    p = PagedPools(layers, num_blocks, block_size, HKV, D, dtype, CPU, kv_quant)
    for t in [*p.k.values(), *p.v.values(), *p.k_scale.values(), *p.v_scale.values()]:
        # A gather that reads an unwritten slot as a key shows up in every
        # comparison; finite, because decode reads them as masked padding.
        if t.dtype == torch.float8_e4m3fn:
            kvq.as_bytes(t).fill_(0x48)  # e4m3 code of 3.0
        else:
            t.fill_(UNWRITTEN)
    return p


def stored(x: torch.Tensor, kv_quant: str) -> torch.Tensor:
    """What a pool of ``kv_quant`` gives back for ``x``: ``x``, or its 8-bit round trip."""
    return x if kv_quant == "none" else kvq.dequantize(*kvq.quantize(x, kv_quant), x.dtype)


KV_QUANT = ["none", "int8", "fp8"]


# -- PagedPools ---------------------------------------------------------------


@pytest.mark.parametrize("kv_quant", KV_QUANT)
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_pools_write_then_gather_returns_each_rows_keys_in_order(block_size, kv_quant):
    """Ragged rows written in interleaved chunks through hand-built tables:
    each row's keys come back in order (8-bit pools: exactly their round trip)."""
    gen = torch.Generator().manual_seed(block_size)
    lengths = [1, 7, 16, 33, 5]
    per_row = [-(-n // block_size) for n in lengths]
    total = sum(per_row)
    p = pools([0, 3], total + 2, block_size, kv_quant=kv_quant)  # two blocks never used
    # Hand-built, non-contiguous tables: blocks handed out from the top down,
    # round-robin across rows, so neighbouring blocks belong to different rows.
    free = list(range(total + 2))[::-1]
    tables: list[list[int]] = [[] for _ in lengths]
    while any(len(t) < n for t, n in zip(tables, per_row)):
        for t, n in zip(tables, per_row):
            if len(t) < n:
                t.append(free.pop(0))
    width = max(per_row)
    padded = torch.tensor([t + [-1] * (width - len(t)) for t in tables])

    def slots(row: int, positions: range) -> torch.Tensor:
        return torch.tensor([tables[row][q // block_size] * block_size + q % block_size
                             for q in positions])

    written = {layer: [[torch.zeros(0, HKV, D), torch.zeros(0, HKV, D)] for _ in lengths]
               for layer in (0, 3)}
    # Write in chunks of up to 3 tokens, interleaving rows, one row per write.
    done = [0] * len(lengths)
    while done != lengths:
        for r, n in enumerate(lengths):
            if done[r] == n:
                continue
            m = min(3, n - done[r])
            for layer in (0, 3):
                k = torch.randn(m, HKV, D, generator=gen)
                v = torch.randn(m, HKV, D, generator=gen)
                p.write(layer, k, v, slots(r, range(done[r], done[r] + m)))
                w = written[layer][r]
                w[0], w[1] = torch.cat([w[0], k]), torch.cat([w[1], v])
            done[r] += m
    # One more write of several rows at once (a step's worth): one token each.
    for layer in (0, 3):
        k = torch.randn(len(lengths), HKV, D, generator=gen)
        v = torch.randn(len(lengths), HKV, D, generator=gen)
        mapping = torch.cat([slots(r, range(n, n + 1)) if n % block_size else torch.tensor([-1])
                             for r, n in enumerate(lengths)])
        keep = mapping >= 0  # only rows whose last block has room
        p.write(layer, k[keep], v[keep], mapping[keep])
        for r in keep.nonzero().flatten().tolist():
            w = written[layer][r]
            w[0], w[1] = torch.cat([w[0], k[r : r + 1]]), torch.cat([w[1], v[r : r + 1]])
    for layer in (0, 3):
        for r in range(len(lengths)):
            want_k, want_v = written[layer][r]
            got_k, got_v = (t[0] for t in p.gather(layer, padded[r : r + 1], want_k.shape[0]))
            assert got_k.shape == (want_k.shape[0], HKV, D) and got_k.is_contiguous()
            assert got_k.dtype == torch.float32
            assert torch.equal(got_k, stored(want_k, kv_quant)) and torch.equal(got_v, stored(want_v, kv_quant))
        # Decode's gather: every row at once, cut at the longest.
        got_k, _ = p.gather(layer, padded, max(lengths) + 1)
        for r in range(len(lengths)):
            want_k = stored(written[layer][r][0], kv_quant)
            assert torch.equal(got_k[r, : want_k.shape[0]], want_k)
            assert torch.isfinite(got_k[r, want_k.shape[0] :]).all()


def test_pools_layers_are_independent_and_sized_from_the_budget_formula():
    p = pools([1, 2], 3, 4)
    assert set(p.k) == set(p.v) == {1, 2}
    assert p.k[1].shape == (3, 4, HKV, D)
    assert p.nbytes == PagedPools.bytes_per_block(2, 4, HKV, D, torch.float32) * 3
    assert PagedPools.bytes_per_block(2, 4, HKV, D, torch.bfloat16) == 2 * 2 * 4 * HKV * D * 2
    k = torch.ones(2, HKV, D)
    p.write(1, k, k, torch.tensor([5, 6]))
    assert (p.k[2] == UNWRITTEN).all(), "a write to one layer leaves the others alone"
    with pytest.raises(ValueError):
        PagedPools([0], 0, 4, HKV, D, torch.float32, CPU)


# -- BlockManager -------------------------------------------------------------


def test_block_manager_allocates_by_tokens_and_frees_everything():
    bm = BlockManager(8, 4)
    assert (bm.num_free, bm.num_used) == (8, 0)
    assert bm.allocate_slots(1, 5) == []
    assert len(bm.tables[1]) == 2 and (bm.num_free, bm.num_used) == (6, 2)
    assert bm.allocate_slots(1, 8) == [] and len(bm.tables[1]) == 2, "still fits in two blocks"
    assert bm.allocate_slots(1, 9) == [] and len(bm.tables[1]) == 3
    assert bm.allocate_slots(2, 1) == [] and len(bm.tables[2]) == 1
    assert not set(bm.tables[1]) & set(bm.tables[2])
    assert bm.num_used == 4 and bm.num_free == 4
    bm.check({1, 2})
    bm.free(1)
    assert 1 not in bm.tables and (bm.num_free, bm.num_used) == (7, 1)
    bm.free(1)  # no-op
    bm.free(99)
    assert bm.num_free == 7
    bm.check({2})
    bm.free(2)
    assert bm.num_free == 8 and sorted(bm.free_blocks) == list(range(8))
    bm.check(set())


def test_allocate_slots_when_short_returns_none_and_takes_nothing():
    bm = BlockManager(5, 4)
    assert bm.allocate_slots(1, 12) == []  # 3 blocks
    before = (list(bm.free_blocks), {s: list(t) for s, t in bm.tables.items()})
    assert not bm.can_allocate(3)
    assert bm.allocate_slots(1, 21) is None  # needs 3 more, 2 free
    assert bm.allocate_slots(2, 9) is None  # a new sequence needing 3
    assert (list(bm.free_blocks), dict(bm.tables)) == before
    bm.check({1, 2})
    assert bm.allocate_slots(2, 8) == [] and bm.num_free == 0  # exactly the 2 left
    assert bm.allocate_slots(2, 9) is None and len(bm.tables[2]) == 2
    assert bm.allocate_slots(3, 0) == []  # nothing needed: succeeds
    bm.check({1, 2, 3})


def corrupt(kind: str) -> tuple[BlockManager, set[int]]:
    bm = BlockManager(6, 2)
    bm.allocate_slots(1, 4)
    bm.allocate_slots(2, 3)
    bm.check({1, 2})
    if kind == "shared":  # a block in two tables, counted once
        bm.tables[2].append(bm.tables[1][0])
    elif kind == "free_and_owned":
        bm.free_blocks[bm.tables[1][0]] = None
    elif kind == "lost":  # neither free nor owned
        bm.free_blocks.popitem(last=False)
    elif kind == "twice":
        bm.tables[1].append(bm.tables[1][0])
    elif kind == "dead_owner":
        return bm, {1}
    elif kind == "stale_hash":
        bm.cached[b"x" * 16] = bm.tables[1][0]
    elif kind == "dead_pending":  # a block promised by a sequence that has ended
        bm.pending[b"y" * 16] = 3
    return bm, {1, 2}


@pytest.mark.parametrize("kind,message", [
    ("shared", "ref 1, in 2 tables"),
    ("free_and_owned", "free list wrong"),
    ("lost", "free list wrong"),
    ("twice", "holds a block twice"),
    ("dead_owner", "not live"),
    ("stale_hash", "hash map out of step"),
    ("dead_pending", "pending or committed for a sequence that is not live"),
])
def test_check_raises_on_a_corrupted_state(kind, message):
    bm, live = corrupt(kind)
    with pytest.raises(AssertionError, match=message):
        bm.check(live)


@settings(deadline=None, max_examples=100)
@given(
    num_blocks=st.integers(1, 12),
    block_size=st.sampled_from([1, 2, 4]),
    ops=st.lists(st.tuples(st.booleans(), st.integers(0, 3), st.integers(0, 20)), max_size=40),
)
def test_random_allocations_and_frees_keep_the_accounting(num_blocks, block_size, ops):
    bm = BlockManager(num_blocks, block_size)
    held = {}  # seq -> tokens its table covers (the largest successful request)
    for grow, seq, n in ops:
        if grow:
            target = max(held.get(seq, 0), n)
            need = -(-target // block_size) - len(bm.tables.get(seq, ()))
            free_before = bm.num_free
            ok = bm.allocate_slots(seq, target) is not None
            assert ok == (need <= free_before)
            if ok:
                held[seq] = target
                assert bm.num_free == free_before - need
            else:
                assert bm.num_free == free_before
        else:
            bm.free(seq)
            held.pop(seq, None)
        bm.check(set(held))
        for s, t in held.items():
            assert len(bm.tables.get(s, ())) == -(-t // block_size)
        assert bm.num_used == sum(len(t) for t in bm.tables.values())


# -- prepare_step -------------------------------------------------------------


def test_slot_mapping_follows_a_hand_built_table():
    bm = BlockManager(8, 4)
    del bm.free_blocks[5], bm.free_blocks[2]
    bm.ref[5] = bm.ref[2] = 1
    bm.tables[7] = [5, 2]
    bm.check({7})
    seq = FakeSeq(7, list(range(100, 107)))
    step = prepare_step([(seq, 7)], CPU, bm)
    assert step.slot_mapping.tolist() == [20, 21, 22, 23, 8, 9, 10]
    assert step.block_tables.tolist() == [[5, 2]]
    # The same sequence later: a decode token at position 7 lands in slot 11.
    seq.num_computed, seq.tokens = 7, seq.tokens + [200]
    step = prepare_step([(seq, 1)], CPU, bm)
    assert step.slot_mapping.tolist() == [11] and step.positions.tolist() == [7]


def test_mixed_step_rows_bounds_and_sampling():
    a = FakeSeq(0, list(range(10, 20)))  # prompt of 10, first chunk of 4: no sample
    b = FakeSeq(1, list(range(30, 36)), num_computed=5)  # decode
    c = FakeSeq(2, list(range(50, 57)), num_computed=3)  # last chunk of its prompt
    bm = BlockManager(16, 2)
    bm.tables[0] = [9, 8, 7]
    for block in bm.tables[0]:
        del bm.free_blocks[block]
        bm.ref[block] = 1
    for s, n in ((b, 6), (c, 7)):
        assert bm.allocate_slots(s.seq_id, n) == []
    bm.check({0, 1, 2})
    step = prepare_step([(a, 4), (b, 1), (c, 4)], CPU, bm)
    assert step.input_ids.tolist() == [10, 11, 12, 13, 35, 53, 54, 55, 56]
    assert step.positions.tolist() == [0, 1, 2, 3, 5, 3, 4, 5, 6]
    assert step.query_start_host == (0, 4, 5, 9)
    assert step.seq_lens.tolist() == [4, 6, 7] and step.seq_lens_host == (4, 6, 7)
    assert step.logits_rows.tolist() == [4, 8]
    assert step.sampling_rows == (1, 2)
    assert step.seq_ids == (0, 1, 2)
    assert step.num_tokens == 9 and step.max_position == 6
    tb, tc = bm.tables[1], bm.tables[2]
    assert step.block_tables.tolist() == [[9, 8, 7, -1], tb + [-1], tc]
    want = [9 * 2, 9 * 2 + 1, 8 * 2, 8 * 2 + 1,  # a: positions 0..3
            tb[2] * 2 + 1,  # b: position 5
            tc[1] * 2 + 1, tc[2] * 2, tc[2] * 2 + 1, tc[3] * 2]  # c: positions 3..6
    assert step.slot_mapping.tolist() == want
    no_blocks = prepare_step([(a, 4), (b, 1), (c, 4)], CPU)
    assert no_blocks.slot_mapping is None and no_blocks.block_tables is None
    assert no_blocks.positions.tolist() == step.positions.tolist()


@pytest.mark.parametrize("shape", [((4, 1, 4), 3), ((1,), 1), ((3, 1), 2), ((2, 2, 1, 1, 5), 4)])
def test_step_tensors_start_16_byte_aligned(shape):
    """Every tensor of a step starts at a multiple of 16 bytes, whatever the
    row and token counts: Triton compiles a kernel again for a pointer that
    is only 8-byte aligned, so a step whose counts put a piece 8 bytes off
    would recompile the kernels it feeds in the middle of a run."""
    news, prompt = shape
    bm = BlockManager(num_blocks=64, block_size=2)
    rows = []
    for i, n in enumerate(news):
        seq = FakeSeq(i, list(range(10 * i, 10 * i + prompt + n)), num_computed=prompt)
        assert bm.allocate_slots(seq.seq_id, seq.num_computed + n) == []
        rows.append((seq, n))
    step = prepare_step(rows, CPU, bm)
    tensors = {name: getattr(step, name) for name in ("input_ids", "positions", "seq_lens", "logits_rows",
                                                       "slot_mapping", "block_tables")}
    assert {name: t.data_ptr() % 16 for name, t in tensors.items()} == dict.fromkeys(tensors, 0)
    assert step.seq_lens.tolist() == [prompt + n for n in news]
    assert step.slot_mapping.numel() == step.input_ids.numel() == sum(news)


# -- KVStore: paged against default against brute force -----------------------

WINDOW = 5
SPECS = [KVSpec(HKV, D), KVSpec(HKV, D, window=WINDOW), KVSpec(HKV, D)]
PAGED_LAYERS = [0, 2]


def store(pool: PagedPools | None = None) -> KVStore:
    """A store over ``SPECS`` on the torch backend: the default one, or the
    paged one over ``pool`` (in the layout ``plan_layout`` gives it)."""
    paging = PagedKvOptions(pool.block_size, prefix_caching=False) if pool is not None else None
    options = EngineOptions(paged_kv=paging, kv_budget_bytes=pool.nbytes if pool is not None else 1 << 20,
                            kv_quant=pool.kv_quant if pool is not None else "none")
    layout = plan_layout(SPECS, options, CPU, pool.dtype if pool is not None else torch.float32, in_place=False,
                         identity="test", max_model_len=pool.block_size if pool is not None else 1)
    assert layout.pooled_layers == (tuple(pool.layers) if pool is not None else ())
    assert layout.num_blocks == (pool.num_blocks if pool is not None else 0)
    return KVStore(layout, pool, select_backend("torch", CPU, paged=pool is not None))


def brute_force(q, k, v, start: int, window: int | None) -> torch.Tensor:
    """float64 attention of queries at positions start.. over the row's whole
    history k/v [S, Hkv, D]: causal, and 0 <= p - j < window on local layers."""
    group = q.shape[1] // k.shape[1]
    k = k.double().repeat_interleave(group, dim=1)
    v = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("lhd,shd->hls", q.double(), k) * D**-0.5
    p = torch.arange(start, start + q.shape[0])[:, None]
    j = torch.arange(k.shape[0])[None, :]
    visible = (p - j >= 0) if window is None else (p - j >= 0) & (p - j < window)
    scores = scores.masked_fill(~visible[None], float("-inf"))
    return torch.einsum("hls,shd->lhd", scores.softmax(-1), v)


# A schedule: ("add", name, prompt_len) | ("step", [(name, n_new), ...])
# | ("finish", name) | ("preempt", name). A row whose new tokens reach the end
# of its tokens samples (a token is appended after the step).
SCHEDULE = [
    ("add", "a", 9), ("add", "b", 1), ("add", "c", 13),
    ("step", [("a", 4), ("b", 1)]),  # prefill chunk + first-token row
    ("step", [("a", 5), ("b", 1), ("c", 3)]),  # last chunk, decode, first chunk
    ("step", [("c", 10)]),  # one row, a paged layer through the pools alone
    ("step", [("a", 1), ("b", 1), ("c", 1)]),  # all decode
    ("finish", "b"),  # its blocks go back and are handed out again
    ("add", "d", 11),
    ("step", [("d", 6), ("a", 1), ("c", 1)]),
    ("preempt", "a"),  # recomputed from its tokens, new blocks
    ("step", [("c", 1), ("a", 7), ("d", 5)]),
    ("step", [("a", 4), ("d", 1), ("c", 1)]),
    ("step", [("d", 1)]),
    ("step", [("a", 1), ("c", 1), ("d", 1)]),
    ("add", "e", 258),  # longer than KVCache.STEP: the default store regrows
    ("step", [("e", 200), ("a", 1), ("c", 1)]),
    ("step", [("d", 1), ("e", 58)]),
    ("step", [("a", 1), ("e", 1), ("c", 1), ("d", 1)]),
]


def assert_schedule_matches_default_and_reference(schedule, block_size: int, num_blocks: int, dtype, seed: int, kv_quant: str = "none") -> int:
    """Run ``schedule`` through the default and the paged store: equal to the
    bit (``kv_quant`` none), and both equal to brute force over each row's
    history (8-bit pools: over the round trip of its keys on paged layers)."""
    gen = torch.Generator().manual_seed(seed)
    default = store()
    paged = store(pools(PAGED_LAYERS, num_blocks, block_size, dtype, kv_quant))
    bm = BlockManager(num_blocks, block_size)
    # A free list in shuffled order, as after many frees: tables are not
    # ascending, so a gather that ignored the table order would show.
    bm.free_blocks = OrderedDict.fromkeys(torch.randperm(num_blocks, generator=gen).tolist())
    seqs: dict[str, FakeSeq] = {}
    next_id = 0
    rows_checked = 0
    for event in schedule:
        kind = event[0]
        if kind == "add":
            _, name, n = event
            seqs[name] = FakeSeq(next_id, list(range(1000 + next_id, 1000 + next_id + n)))
            next_id += 1
            default.add_row(seqs[name].seq_id)
            paged.add_row(seqs[name].seq_id)
        elif kind in ("finish", "preempt"):
            s = seqs[event[1]]
            bm.free(s.seq_id)
            for kv in (default, paged):
                for c in kv.pop_row(s.seq_id):
                    if c is not None:
                        c.dispose()
            if kind == "finish":
                del seqs[event[1]]
            else:
                s.num_computed, s.history = 0, {}
                default.add_row(s.seq_id)
                paged.add_row(s.seq_id)
        else:
            rows = [(seqs[name], n) for name, n in event[1]]
            for s, n in rows:
                assert bm.allocate_slots(s.seq_id, s.num_computed + n) == []
            bm.check({s.seq_id for s in seqs.values()})
            step_d = prepare_step(rows, CPU)
            step_p = prepare_step(rows, CPU, bm)
            T = step_p.num_tokens
            for layer, spec in enumerate(SPECS):
                k = torch.randn(T, HKV, D, generator=gen).to(dtype)
                v = torch.randn(T, HKV, D, generator=gen).to(dtype)
                q = torch.randn(T, HQ, D, generator=gen).to(dtype)
                default.write(layer, k, v, step_d)
                paged.write(layer, k, v, step_p)
                out_d = default.attend(layer, q, step_d, scale=D**-0.5)
                out_p = paged.attend(layer, q, step_p, scale=D**-0.5)
                assert out_d.shape == out_p.shape == (T, HQ, D) and out_p.dtype == dtype
                if kv_quant == "none" or layer not in PAGED_LAYERS:
                    assert torch.equal(out_d, out_p), f"layer {layer}, rows {event[1]}"
                else:
                    assert not torch.equal(out_d, out_p), "an 8-bit pool changed nothing"
                mode = kv_quant if layer in PAGED_LAYERS else "none"
                bounds = step_p.query_start_host
                for r, (s, n) in enumerate(rows):
                    a, b = bounds[r], bounds[r + 1]
                    hk, hv = s.history.get(layer, (k[:0], v[:0]))
                    hk, hv = torch.cat([hk, stored(k[a:b], mode)]), torch.cat([hv, stored(v[a:b], mode)])
                    s.history[layer] = (hk, hv)
                    want = brute_force(q[a:b], hk, hv, s.num_computed, spec.window)
                    tol = 1e-5 if dtype == torch.float32 else 2e-2
                    torch.testing.assert_close(out_p[a:b].double(), want, rtol=0, atol=tol)
                    rows_checked += 1
            for s, n in rows:
                s.num_computed += n
                if s.num_computed == s.num_tokens:
                    s.tokens.append(2000 + len(s.tokens))
    return rows_checked


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_paged_store_is_bit_identical_to_default_and_matches_brute_force(block_size, dtype):
    # Room for every row at its longest (< 400 tokens together), plus slack.
    num_blocks = -(-400 // block_size) + 4
    assert assert_schedule_matches_default_and_reference(SCHEDULE, block_size, num_blocks, dtype, seed=block_size) > 0


@pytest.mark.parametrize("kv_quant", ["int8", "fp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_quantized_paged_store_attends_over_exactly_the_round_trip_of_each_rows_keys(block_size, dtype, kv_quant):
    """The whole schedule (ragged rows, chunked prefill beside decode, a
    preemption, blocks reused) through 8-bit pools: brute force over each
    row's dequantized history, within float32 (or bfloat16) rounding."""
    num_blocks = -(-400 // block_size) + 4
    assert assert_schedule_matches_default_and_reference(SCHEDULE, block_size, num_blocks, dtype, seed=block_size, kv_quant=kv_quant) > 0


def test_store_windowed_layer_stays_per_row_in_both_stores():
    paged = store(pools(PAGED_LAYERS, 4, 4))
    paged.add_row(0)
    kinds = [type(c).__name__ if c is not None else None for c in paged.rows[0]]
    assert kinds == [None, "RotatingKVCache", None]
    default = store()
    default.add_row(0)
    assert [type(c).__name__ for c in default.rows[0]] == ["KVCache", "RotatingKVCache", "KVCache"]


@settings(deadline=None, max_examples=25)
@given(data=st.data(), block_size=st.sampled_from([1, 3, 4]), seed=st.integers(0, 2**16))
def test_random_schedules_paged_equals_default(data, block_size, seed):
    """Random prompts, chunk sizes and row subsets (one to three rows)."""
    prompts = data.draw(st.lists(st.integers(1, 12), min_size=1, max_size=3))
    names = [str(i) for i in range(len(prompts))]
    schedule = [("add", n, p) for n, p in zip(names, prompts)]
    left = dict(zip(names, prompts))  # prompt tokens not yet computed
    for _ in range(data.draw(st.integers(1, 8))):
        chosen = data.draw(st.lists(st.sampled_from(names), min_size=1, max_size=3, unique=True))
        rows = []
        for n in chosen:
            take = data.draw(st.integers(1, left[n])) if left[n] else 1
            left[n] -= take if left[n] else 0
            rows.append((n, take))
        schedule.append(("step", rows))
    num_blocks = len(prompts) * -(-(12 + 8) // block_size)
    assert_schedule_matches_default_and_reference(schedule, block_size, num_blocks, torch.float32, seed)
