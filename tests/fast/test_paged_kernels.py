"""The Triton paged kernels against their float64 references, and the
engine on them against the torch backend.

On a machine without CUDA they run under ``TRITON_INTERPRET=1`` (set by
tests/conftest.py) at small sizes; tests/gpu runs them at full size in bf16.
The interpreter cannot hold bfloat16, so here the inputs are float32 and
float16. Inputs are random, never zeros; outputs are poisoned with NaN first,
so an element the kernel forgets to write fails the comparison.
"""

from __future__ import annotations

import pytest
import torch

from pagedlm.batch.engine import LLMEngine
from pagedlm.kernels import gemv, launch
from pagedlm.kernels import paged_attention as pa
from pagedlm.params import SamplingParams
from tests.fast.kernel_refs import (paged_decode_reference, paged_prefill_reference, requires_triton,
                                   write_kv_reference)
from tests.helpers import DEVICE, WINDOW, CharTokenizer, paged, paged_inputs, prompts, rel_err, run_all, tiny_model

pytestmark = requires_triton
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def test_triton_imports_where_the_test_extra_installs_it():
    """The test extra installs triton on Linux: a broken install fails here
    (every other kernel test would fail too, but this one says why)."""
    assert pa.triton is not None, "triton is in the test extra but does not import"
    assert pa.available(DEVICE), f"the kernels cannot run on {DEVICE} (TRITON_INTERPRET unset without CUDA?)"


@pytest.mark.parametrize("major,hip,switch,want", [
    (9, None, True, True),     # Hopper
    (10, None, True, True),    # Blackwell
    (8, None, True, False),    # Ampere: no griddepcontrol
    (9, "6.2", True, False),   # ROCm devices are "cuda" to torch; Triton's CUDA intrinsics are not theirs
    (9, None, False, False),   # switched off
])
def test_kernels_launch_as_programmatic_dependents_on_nvidia_hopper_on(monkeypatch, major, hip, switch, want):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (major, 0))
    monkeypatch.setattr(torch.version, "hip", hip)
    monkeypatch.setattr(launch, "PDL", switch)
    launch._pdl_capable.cache_clear()
    try:
        assert launch.launch_options(torch.device("cuda", 0)) == {"PDL": want, "launch_pdl": want}
        assert launch.launch_options(torch.device("cpu")) == {"PDL": False, "launch_pdl": False}
        # with PDL the few-row products take the 8B's MLP (its gate/up, 224 MiB) but no vocabulary head
        # (Qwen3-0.6B's, 297 MiB, the least of the three shapes'); without, neither
        gate_up_8b, head_qwen3 = 2 * 14336 * 4096 * 2, 151936 * 1024 * 2
        cap = gemv.max_bytes(torch.device("cuda", 0))
        assert (gate_up_8b <= cap) == want and head_qwen3 > cap
    finally:
        launch._pdl_capable.cache_clear()


@pytest.mark.parametrize("block_size,lengths,hq,hkv,d", [
    (16, [1, 17, 300], 4, 4, 64),        # GQA 1, a one-token row, a partial last block
    (16, [513, 40], 16, 1, 64),          # GQA 16, five splits of 128 keys beside one
    (64, [257, 256, 255], 8, 2, 128),    # lengths at a split boundary
    (128, [600, 3], 6, 2, 256),          # GQA 3 (not a power of two), head dim 256
    (256, [700, 1000, 31], 8, 1, 128),   # big blocks, two splits a block
    (8, [2100, 70], 4, 2, 64),           # 32 blocks a split of SPLIT keys
    (512, [1100, 40], 4, 2, 64),         # a block holds two splits: a split reads the middle of its block
    (16, [512, 513, 1024, 1025], 4, 2, 64),  # where the split size doubles: 8 splits of 64, 5 of 128, 8, 5 of 256
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_decode_matches_float64_reference(block_size, lengths, hq, hkv, d, dtype):
    q, k_pool, v_pool, tables, seq_lens = paged_inputs(lengths, block_size, hq, hkv, d, dtype)
    scale = d ** -0.5
    out = pa.paged_decode(q, k_pool, v_pool, tables, seq_lens, scale)
    ref = paged_decode_reference(q, k_pool, v_pool, tables, seq_lens, scale)
    assert not out.isnan().any()
    assert rel_err(out, ref) < TOL[dtype]


@pytest.mark.parametrize("window", [1, 5, 256, 300])
def test_decode_sliding_window_skips_old_keys(window):
    lengths = [700, 260, 4]
    q, k_pool, v_pool, tables, seq_lens = paged_inputs(lengths, 16, 4, 1, 64, torch.float32, seed=window)
    out = pa.paged_decode(q, k_pool, v_pool, tables, seq_lens, 0.125, window=window)
    ref = paged_decode_reference(q, k_pool, v_pool, tables, seq_lens, 0.125, window=window)
    full = paged_decode_reference(q, k_pool, v_pool, tables, seq_lens, 0.125)
    assert rel_err(out, ref) < 1e-5
    assert rel_err(out[:2], full[:2]) > 1e-2  # the window really changed the long rows


@pytest.mark.parametrize("window", [None, 300])
def test_decode_row_ignores_neighbours_table_width_and_program_count(window):
    """A row's bits do not depend on who shares its batch, on how wide the
    block table is padded (a CUDA graph pads it to the longest context), nor
    on how many programs share its splits (that follows the batch size)."""
    q, k_pool, v_pool, tables, seq_lens = paged_inputs([4200, 20, 333], 16, 8, 2, 64, torch.float32, seed=3)
    together = pa.paged_decode(q, k_pool, v_pool, tables, seq_lens, 0.125, window)
    wide = torch.cat([tables, torch.full((3, 500), -1, device=tables.device)], dim=1)
    padded = pa.paged_decode(q, k_pool, v_pool, wide, seq_lens, 0.125, window)
    alone = pa.paged_decode(q[2:], k_pool, v_pool, tables[2:, :21], seq_lens[2:], 0.125, window)
    ref = paged_decode_reference(q, k_pool, v_pool, tables, seq_lens, 0.125, window)
    assert rel_err(together, ref) < 1e-5  # 17 splits for the long row
    assert torch.equal(together, padded)
    assert torch.equal(together[2:], alone)
    for programs in (1, 3, 16):  # a program takes 17, 5-6 or 1-2 of the long row's splits
        assert torch.equal(pa.paged_decode(q, k_pool, v_pool, tables, seq_lens, 0.125, window,
                                           programs=programs), together)


def test_decode_partials_hold_the_rows_splits_and_no_more():
    """The buffer of partials holds the step's splits, row after row: sized
    to exactly the rows' splits (the long row in the middle, so a row's first
    partial depends on the rows before it) the bits are those of the table's
    most; rows of distinct blocks never need more than the pool's bound."""
    lengths = [20, 4200, 333, 1]
    q, k_pool, v_pool, tables, seq_lens = paged_inputs(lengths, 16, 8, 2, 64, torch.float32, seed=4)
    # a row of up to 8 splits of 64 keys, then of 128, then of 256 however long
    assert [pa.split_len(n) for n in (1, 512, 513, 1024, 1025, 10**6)] == [64, 64, 128, 128, 256, 256]
    exact = sum(map(pa.row_splits, lengths))
    assert exact == 1 + 17 + 6 + 1
    assert pa.decode_partials(4, tables.shape[1], 16) >= 4 * 17
    roomy = pa.paged_decode(q, k_pool, v_pool, tables, seq_lens, 0.125)
    tight = pa.paged_decode(q, k_pool, v_pool, tables, seq_lens, 0.125, partials=exact)
    assert rel_err(roomy, paged_decode_reference(q, k_pool, v_pool, tables, seq_lens, 0.125)) < 1e-5
    assert torch.equal(tight, roomy)
    for width in range(1, 300):  # a table's bound is its rows' most over every length it holds (blocks of 16)
        assert pa.decode_partials(1, width, 16) == max(map(pa.row_splits, range(1, 16 * width + 1)))
    g = torch.Generator().manual_seed(0)
    for _ in range(200):  # rows cut from a pool of 64 blocks of 16: their splits fit the pool's bound
        blocks = torch.randint(1, 20, (8,), generator=g).tolist()
        while sum(blocks) > 64:
            blocks.pop()
        lens = [16 * n - int(torch.randint(0, 16, (1,), generator=g)) for n in blocks]
        assert sum(map(pa.row_splits, lens)) <= pa.pool_partials(len(lens), 64 * 16)


@pytest.mark.parametrize("lengths,window", [([20, 1100, 333, 1, 2049, 64, 65], None), ([1100, 700, 3000], 300)])
def test_decode_writes_each_split_its_rule_counts_in_order(lengths, window):
    """The split kernel cuts each row as ``row_splits`` counts (a row's
    splits by its own length), row after row: into a buffer of exactly that
    many partials poisoned with NaN, every partial in the window is written
    and its log-sum-exp is finite; a split the kernel skipped, or one it
    placed where the host does not count it, leaves a NaN or writes out of
    bounds. Each partial is its split's own softmax: checked against the
    keys its split holds."""
    q, k_pool, v_pool, tables, seq_lens = paged_inputs(lengths, 16, 4, 2, 64, torch.float32, seed=6)
    n = sum(map(pa.row_splits, lengths))
    part = torch.full((n, 4, 64), float("nan"), device=q.device)
    lse = torch.full((n, 4), float("nan"), device=q.device)
    pa.decode_splits(q, k_pool, v_pool, tables, seq_lens, 0.125, window, None, 3, part, lse)
    first = 0
    for row, length in enumerate(lengths):
        size = pa.split_len(length)
        for s in range(pa.row_splits(length)):
            lo, hi = max(s * size, length - (window or length)), min((s + 1) * size, length)
            if lo >= hi:  # before the window: not computed
                continue
            keys = torch.zeros(length, dtype=torch.bool)
            keys[lo:hi] = True
            want = paged_decode_reference(q[row:row + 1], k_pool, v_pool, tables[row:row + 1],
                                          seq_lens[row:row + 1], 0.125, keys=keys)
            assert lse[first + s].isfinite().all(), (row, s)
            assert rel_err(part[first + s], want[0]) < 1e-5, (row, s)
        first += pa.row_splits(length)


def varlen_queries(q_lens, hq, d, dtype, seed=0):
    """``[sum(q_lens), hq, d]`` random queries and their ``query_start``, on `DEVICE`."""
    g = torch.Generator().manual_seed(seed + 100)
    q = torch.randn(sum(q_lens), hq, d, generator=g).to(dtype).to(DEVICE)
    starts = torch.tensor([0, *q_lens]).cumsum(0).to(DEVICE)
    return q, starts


def poisoned(q):
    return torch.full_like(q, float("nan"))


@pytest.mark.parametrize("block_size,lengths,q_lens,hq,hkv,d", [
    (16, [40, 1, 300, 17], [40, 1, 70, 5], 8, 2, 64),  # a whole prompt, a decode row, chunks after a prefix
    (8, [100, 9], [100, 2], 4, 4, 64),                 # GQA 1, a verify-sized row
    (64, [257, 130], [257, 3], 16, 1, 64),             # GQA 16: a tile is 8 queries of 16 heads
    (128, [600, 64], [200, 64], 6, 2, 256),            # GQA 3 (padded to 4), head dim 256
    (256, [700, 31], [129, 31], 8, 1, 128),            # big blocks
    (512, [1100, 40], [90, 40], 4, 2, 64),             # a chunk whose keys start mid-block
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_prefill_matches_float64_reference(block_size, lengths, q_lens, hq, hkv, d, dtype):
    _, k_pool, v_pool, tables, seq_lens = paged_inputs(lengths, block_size, hq, hkv, d, dtype)
    q, starts = varlen_queries(q_lens, hq, d, dtype)
    out = pa.paged_prefill(q, k_pool, v_pool, tables, starts, seq_lens, d**-0.5, max(q_lens), out=poisoned(q))
    ref = paged_prefill_reference(q, k_pool, v_pool, tables, starts, seq_lens, d**-0.5)
    assert not out.isnan().any()
    assert rel_err(out, ref) < TOL[dtype]


@pytest.mark.parametrize("window", [1, 5, 64, 300])
def test_prefill_sliding_window_skips_old_keys(window):
    lengths, q_lens = [700, 260, 30], [150, 260, 7]
    _, k_pool, v_pool, tables, seq_lens = paged_inputs(lengths, 16, 4, 1, 64, torch.float32, seed=window)
    q, starts = varlen_queries(q_lens, 4, 64, torch.float32, seed=window)
    out = pa.paged_prefill(q, k_pool, v_pool, tables, starts, seq_lens, 0.125, 260, window=window)
    ref = paged_prefill_reference(q, k_pool, v_pool, tables, starts, seq_lens, 0.125, window=window)
    full = paged_prefill_reference(q, k_pool, v_pool, tables, starts, seq_lens, 0.125)
    assert rel_err(out, ref) < 1e-5
    assert rel_err(out[:150], full[:150]) > 1e-2  # the window really changed the long row


def test_prefill_one_query_rows_agree_with_the_decode_kernel():
    """A row of one query is a decode row: both kernels give it the same
    attention (within float32 rounding: they split its keys differently)."""
    q, k_pool, v_pool, tables, seq_lens = paged_inputs([1, 300, 700], 16, 8, 2, 64, torch.float32, seed=4)
    starts = torch.arange(4, device=DEVICE)
    out = pa.paged_prefill(q, k_pool, v_pool, tables, starts, seq_lens, 0.125, 1)
    assert rel_err(out, pa.paged_decode(q, k_pool, v_pool, tables, seq_lens, 0.125).double()) < 1e-6


def test_prefill_row_ignores_neighbours_and_table_width():
    """A row's bits do not depend on the rows beside it in the step nor on
    how wide its table is padded, and rows below ``min_queries`` are left
    exactly as they were (the decode kernel writes them)."""
    lengths, q_lens = [500, 33, 90], [100, 1, 90]
    _, k_pool, v_pool, tables, seq_lens = paged_inputs(lengths, 16, 8, 2, 64, torch.float32, seed=6)
    q, starts = varlen_queries(q_lens, 8, 64, torch.float32, seed=6)
    together = pa.paged_prefill(q, k_pool, v_pool, tables, starts, seq_lens, 0.125, 100)
    wide = torch.cat([tables, torch.full((3, 300), -1, device=tables.device)], dim=1)
    assert torch.equal(pa.paged_prefill(q, k_pool, v_pool, wide, starts, seq_lens, 0.125, 100), together)
    last = pa.paged_prefill(q[101:], k_pool, v_pool, tables[2:], starts[2:] - 101, seq_lens[2:], 0.125, 100)
    assert torch.equal(last, together[101:])
    skipped = pa.paged_prefill(q, k_pool, v_pool, tables, starts, seq_lens, 0.125, 100, out=poisoned(q),
                               min_queries=2)
    assert skipped[100].isnan().all() and torch.equal(skipped[:100], together[:100])
    assert torch.equal(skipped[101:], together[101:])


def test_prefill_tiles_taken_last_to_first_give_the_same_bits(monkeypatch):
    """``PREFILL_HEAVY_FIRST`` only reorders the programs: each tile's
    queries, keys and sums are its own, so every output bit is the same."""
    lengths, q_lens = [500, 33, 90, 260], [100, 1, 90, 200]
    _, k_pool, v_pool, tables, seq_lens = paged_inputs(lengths, 16, 8, 2, 64, torch.float32, seed=8)
    q, starts = varlen_queries(q_lens, 8, 64, torch.float32, seed=8)
    first_to_last = pa.paged_prefill(q, k_pool, v_pool, tables, starts, seq_lens, 0.125, 200, out=poisoned(q))
    monkeypatch.setattr(pa, "PREFILL_HEAVY_FIRST", not pa.PREFILL_HEAVY_FIRST)
    pa.prefill_constants.cache_clear()  # (the constants are cached by shape)
    try:
        last_to_first = pa.paged_prefill(q, k_pool, v_pool, tables, starts, seq_lens, 0.125, 200, out=poisoned(q))
    finally:
        monkeypatch.undo()
        pa.prefill_constants.cache_clear()
    assert not first_to_last.isnan().any() and torch.equal(last_to_first, first_to_last)


@pytest.mark.parametrize("block_size", [8, 16, 64])
def test_prefill_reads_int8_blocks_in_registers(block_size):
    """On 8-bit codes and their scales (head-major, as the store lays them)
    the kernel attends over exactly what the reference path dequantizes."""
    lengths, q_lens = [300, 45, 9], [60, 45, 3]
    _, k_pool, v_pool, tables, seq_lens = paged_inputs(lengths, block_size, 8, 2, 64, torch.float32, seed=8)
    q, starts = varlen_queries(q_lens, 8, 64, torch.float32, seed=8)
    (kc, ks, k_deq), (vc, vs, v_deq) = quantized_pools(k_pool, v_pool, "int8")
    out = pa.paged_prefill(q, kc, vc, tables, starts, seq_lens, 0.125, 60, scales=(ks, vs))
    ref = paged_prefill_reference(q, k_deq, v_deq, tables, starts, seq_lens, 0.125)
    assert rel_err(out, ref) < 1e-5
    exact = paged_prefill_reference(q, k_pool, v_pool, tables, starts, seq_lens, 0.125)
    assert 1e-5 < rel_err(out, exact) < 2e-2  # int8 noise, not nothing and not garbage


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_write_kv_fills_exactly_the_mapped_slots(dtype):
    g = torch.Generator().manual_seed(7)
    T, H, D, blocks, bs = 9, 2, 64, 6, 16
    k_pool = torch.randn(blocks, bs, H, D, generator=g).to(dtype).to(DEVICE)
    v_pool = torch.randn(blocks, bs, H, D, generator=g).to(dtype).to(DEVICE)
    # keys as a slice of a fused projection (strided over tokens), values contiguous
    fused = torch.randn(T, 3 * H, D, generator=g).to(dtype).to(DEVICE)
    keys, values = fused[:, H : 2 * H], torch.randn(T, H, D, generator=g).to(dtype).to(DEVICE)
    slots = torch.tensor([5, 17, 95, -1, 0, 40, 41, -1, 63], device=DEVICE)
    want_k, want_v = k_pool.clone(), v_pool.clone()
    write_kv_reference(keys, values, want_k, want_v, slots)
    pa.write_kv(keys, values, k_pool, v_pool, slots)
    assert torch.equal(k_pool, want_k) and torch.equal(v_pool, want_v)
    flat = k_pool.view(-1, H, D)
    assert torch.equal(flat[95], keys[2]) and torch.equal(flat[63], keys[8])


def test_engine_with_kernels_matches_the_torch_path(tiny):
    """The whole engine on the kernels (sliding layers paged and bounded in
    the kernel; decode rows in place, beside prompt chunks and alone; a
    prefix from cached blocks) against the torch backend: the same greedy
    tokens, logprobs within 1e-4 (float32)."""
    assert_kernels_match_torch_path(*tiny[1:], "none")


def test_engine_with_kernels_on_int8_blocks_matches_the_torch_path():
    """8-bit blocks quantized in the kernels' write and read in registers,
    against the torch path's quantize and gather-dequantize. (Llama only:
    on Gemma the kernels page, hence quantize, the sliding layers that the
    torch path keeps in float row caches.)"""
    assert_kernels_match_torch_path(tiny_model("llama"), CharTokenizer(), "int8")


FEW = SamplingParams(max_tokens=4, ignore_eos=True, logprobs=3)  # interpreted kernels: few steps


def assert_kernels_match_torch_path(model, tok, kv_quant):
    shared = list(range(2, 26))  # three full blocks of 8 that the later prompt finds cached
    batch = prompts(1, seed=11, lo=5, hi=5) + [shared + [40, 41], shared + list(range(50, 56))]
    opts = dict(max_num_batched_tokens=16, max_num_seqs=4, kv_quant=kv_quant)
    want = run_all(LLMEngine(model, tok, paged(8, attention_backend="torch", **opts)), batch, FEW, arrive_every=1)
    engine = LLMEngine(model, tok, paged(8, attention_backend="triton", **opts))
    layout = engine.store.layout
    assert engine.attention_backend == "triton" and layout.in_place
    assert layout.paged_layers == frozenset(range(len(layout.specs)))
    queries = record_queries(engine)
    got = run_all(engine, batch, FEW, arrive_every=1)
    # What the run went through: one-query rows beside a prompt chunk (the
    # plan's decode tables), steps of one-query rows alone (the kernel on
    # the step's own tables), rows past the window, a prefix from the cache.
    assert any(q.count(1) >= 2 and max(q) > 1 for q in queries), queries
    assert any(len(q) >= 2 and max(q) == 1 for q in queries), queries
    assert max(len(s.prompt_ids) + len(s.output_ids) for s in got) > 2 * WINDOW
    assert engine.cache_stats().prefix_hit_tokens >= 24
    for a, b in zip(want, got):
        assert a.output_ids == b.output_ids
        assert max(abs(x[0] - y[0]) for x, y in zip(a.logprobs, b.logprobs)) <= 1e-4


def record_queries(engine: LLMEngine) -> list[list[int]]:
    """Each step's queries per row, as the engine's scheduler hands them out."""
    queries, schedule = [], engine.scheduler.schedule

    def recorded():
        rows = schedule()
        queries.append([n for _, n in rows])
        return rows

    engine.scheduler.schedule = recorded
    return queries


def quantized_pools(k_pool, v_pool, mode):
    """8-bit pools and their scales, quantized by the reference
    (``cache.kv_quant``) and laid out head-major as ``PagedPools`` lays
    them, and what they dequantize to."""
    from pagedlm.cache import kv_quant as kvq

    return [(codes, scale, kvq.dequantize(codes, scale, k_pool.dtype))
            for codes, scale in kvq.quantize_pools(k_pool, v_pool, mode)]


@pytest.mark.parametrize("block_size,lengths,hq,hkv,d", [
    (16, [1, 300, 40], 8, 2, 64),
    (64, [700, 129], 4, 1, 128),
    (8, [2100, 70], 4, 2, 64),     # 32 blocks a split: the split's block numbers are read ahead of its tiles
    (8, [300, 70], 4, 2, 64),      # 8 blocks a split of 64 keys: the read-ahead stops at the split's end
    (512, [1100, 40], 4, 2, 64),   # two splits a block: a split starts mid-block
])
def test_decode_reads_int8_blocks_in_registers(block_size, lengths, hq, hkv, d):
    """The kernel on 8-bit codes and their scales computes attention over
    exactly the values the reference path dequantizes."""
    q, k_pool, v_pool, tables, seq_lens = paged_inputs(lengths, block_size, hq, hkv, d, torch.float32, seed=5)
    (kc, ks, k_deq), (vc, vs, v_deq) = quantized_pools(k_pool, v_pool, "int8")
    out = pa.paged_decode(q, kc, vc, tables, seq_lens, d**-0.5, scales=(ks, vs))
    ref = paged_decode_reference(q, k_deq, v_deq, tables, seq_lens, d**-0.5)
    assert rel_err(out, ref) < 1e-5
    exact = paged_decode_reference(q, k_pool, v_pool, tables, seq_lens, d**-0.5)
    assert 1e-5 < rel_err(out, exact) < 2e-2  # int8 noise, not nothing and not garbage


@pytest.mark.parametrize("block_size", [8, 16, 64])
def test_decode_reads_8bit_blocks_the_same_in_either_layout(block_size):
    """Head-major 8-bit pools (values tokens innermost: the kernel treats a
    block's tokens as runs of adjacent bytes) and the same codes stored
    token-major (no runs) give the same bits; a stride or run taken wrongly
    in either would not. Block 8 makes runs of 8, shorter than the hint's 16."""
    q, k_pool, v_pool, tables, seq_lens = paged_inputs([1, 300, 45], block_size, 8, 2, 64, torch.float32, seed=8)
    (kc, ks, _), (vc, vs, _) = quantized_pools(k_pool, v_pool, "int8")
    assert pa._token_run(kc, vc, (ks, vs)) == min(block_size, 16)
    flat = [t.contiguous() for t in (kc, vc, ks, vs)]
    assert pa._token_run(flat[0], flat[1], (flat[2], flat[3])) == 1
    head_major = pa.paged_decode(q, kc, vc, tables, seq_lens, 0.125, scales=(ks, vs))
    token_major = pa.paged_decode(q, flat[0], flat[1], tables, seq_lens, 0.125, scales=(flat[2], flat[3]))
    assert torch.equal(head_major, token_major)
    assert not head_major.isnan().any()


def test_write_kv_quantizes_as_the_reference_does():
    from pagedlm.cache import kv_quant as kvq

    g = torch.Generator().manual_seed(9)
    T, H, D, blocks, bs = 7, 3, 64, 4, 16
    keys = (torch.randn(T, H, D, generator=g) * torch.logspace(-3, 2, T)[:, None, None]).to(DEVICE)
    values = torch.randn(T, H, D, generator=g).to(DEVICE)
    keys[2] = 0.0  # an all-zero token: scale 1, codes 0
    slots = torch.tensor([3, 17, 40, -1, 0, 63, 20], device=DEVICE)
    pools = [kvq.zeros((blocks, bs, H, D), order, torch.int8, DEVICE) for order in (kvq.KEY_ORDER, kvq.VALUE_ORDER)]
    scales = [kvq.zeros((blocks, bs, H), kvq.SCALE_ORDER, kvq.SCALE_DTYPE, DEVICE) for _ in range(2)]
    pa.write_kv(keys, values, pools[0], pools[1], slots, (scales[0], scales[1]), fmt="int8",
                qmax=kvq.QMAX["int8"])
    keep = slots >= 0
    at = (slots[keep] // bs, slots[keep] % bs)
    for x, pool, scale in ((keys, pools[0], scales[0]), (values, pools[1], scales[1])):
        codes, s = kvq.quantize(x[keep], "int8")
        assert torch.equal(pool[at], codes)
        assert torch.equal(scale[at], s)
        assert int(pool.ne(0).sum()) == int(codes.ne(0).sum())  # nothing written anywhere else
    assert pools[0][2, 8].eq(0).all() and scales[0][2, 8].eq(1).all()  # slot 40: the all-zero token


def test_write_kv_refuses_a_format_that_disagrees_with_its_scales():
    keys, slots = torch.ones(2, 1, 16, device=DEVICE), torch.tensor([0, 1], device=DEVICE)
    pool = torch.zeros(1, 4, 1, 16, dtype=torch.int8, device=DEVICE)
    scales = (torch.zeros(1, 4, 1, device=DEVICE), torch.zeros(1, 4, 1, device=DEVICE))
    for kwargs in (dict(scales=scales), dict(fmt="int8", qmax=127.0), dict(scales=scales, fmt="int4", qmax=7.0)):
        with pytest.raises(ValueError, match="format"):
            pa.write_kv(keys, keys, pool, pool, slots, **kwargs)
    assert not pool.any()
