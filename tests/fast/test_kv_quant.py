"""Quantized KV blocks (``--kv-quant int8|fp8``): the quantize/dequantize
math against float64, the pools' byte accounting, the engine against the
same engine unquantized, and the refusals. The write/gather path with
ragged rows and several block sizes is in ``test_paged_kv.py`` (its pool
and store tests run for every mode)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedlm import options as opt
from pagedlm.params import SamplingParams
from pagedlm.batch.engine import LLMEngine
from pagedlm.batch.solo import Solo
from pagedlm.cache import KVSpec, PagedPools
from pagedlm.cache import kv_quant as kvq
from pagedlm.kernels import paged_attention as pa
from pagedlm.cache.layout import token_bytes
from pagedlm.cli import main
from pagedlm.llm import LLM
from tests.helpers import CharTokenizer, tiny_model

MODES = ["int8", "fp8"]


def random_rows(seed: int, rows: int, dim: int, log10_lo: float, log10_span: float) -> torch.Tensor:
    """Random float32 rows, never zero, each row at its own magnitude
    (10^lo .. 10^(lo + span)) with a few outlier channels, as real keys have."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, dim, generator=g, dtype=torch.float64)
    x = torch.where(x.abs() < 1e-3, torch.full_like(x, 1e-3), x)  # never zero
    x[:, : max(1, dim // 16)] *= 8  # outlier channels
    mag = 10 ** (log10_lo + log10_span * torch.rand(rows, 1, generator=g, dtype=torch.float64))
    return (x * mag).float()


KEY_ROWS = st.builds(random_rows, st.integers(0, 2**20), st.integers(1, 64), st.sampled_from([1, 3, 16, 64, 256]),
                     st.floats(-6, 3), st.floats(0, 3))


@settings(deadline=None, max_examples=60)
@given(x=KEY_ROWS)
def test_int8_error_is_at_most_half_a_step_of_the_rows_scale(x):
    rows = x.shape[0]
    q, scale = kvq.quantize(x, "int8")
    assert q.dtype == torch.int8 and scale.dtype == kvq.SCALE_DTYPE and scale.shape == (rows,)
    x64, s64 = x.double(), scale.double()
    amax = x64.abs().amax(-1)
    # The stored scale is max|x| / 127 rounded to bfloat16 (relative error <= 2^-9).
    assert ((s64 - amax / 127).abs() <= amax / 127 * 2**-8).all()
    err = (x64 - q.double() * s64[:, None]).abs()
    assert (err <= s64[:, None] / 2 * (1 + 1e-6)).all(), err.max()
    # The whole code range is used: the largest value of a row maps to +-127
    # (+-126 when the scale rounded up).
    assert (q.abs().amax(-1) >= 126).all()
    deq = kvq.dequantize(q, scale, torch.float32)
    assert deq.dtype == torch.float32 and torch.allclose(deq.double(), q.double() * s64[:, None], rtol=2**-23)


@settings(deadline=None, max_examples=60)
@given(x=KEY_ROWS)
def test_fp8_error_is_at_most_half_an_e4m3_ulp(x):
    q, scale = kvq.quantize(x, "fp8")
    assert q.dtype == torch.float8_e4m3fn and scale.shape == x.shape[:1]
    x64, s64 = x.double(), scale.double()[:, None]
    err = (x64 - q.double() * s64).abs()
    # e4m3: 3 mantissa bits, half an ulp <= 2^-4 of the value in the normal
    # range; subnormal codes are 2^-9 apart (in units of the scale).
    bound = torch.maximum(x64.abs() * 2**-4, s64 * 2**-10) * (1 + 1e-6)
    assert (err <= bound).all(), (err / bound).max()
    assert (q.double().abs().amax(-1) >= 416).all()  # the row's largest value lands near 448


@pytest.mark.parametrize("mode", MODES)
def test_an_all_zero_row_quantizes_to_zero_with_a_finite_scale(mode):
    x = torch.zeros(3, 2, 8)
    x[1, 0] = torch.linspace(-1, 1, 8)
    q, scale = kvq.quantize(x, mode)
    deq = kvq.dequantize(q, scale, torch.float32)
    assert torch.isfinite(scale.float()).all() and (scale > 0).all()
    assert torch.equal(deq[0], x[0]) and torch.equal(deq[2], x[2])
    assert (deq[1, 0] - x[1, 0]).abs().max() <= 1 / 127 / 2 * 1.01


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dequantize_returns_the_models_dtype(dtype):
    q, scale = kvq.quantize(random_rows(0, 4, 16, -1, 2), "int8")
    assert kvq.dequantize(q, scale, dtype).dtype == dtype


# -- byte accounting ----------------------------------------------------------


@pytest.mark.parametrize("mode,head_bytes", [("none", 64 * 4), ("int8", 64 + 2), ("fp8", 64 + 2)])
def test_pool_bytes_count_codes_and_scales(mode, head_bytes):
    assert kvq.head_bytes(64, torch.float32, mode) == head_bytes
    per_block = PagedPools.bytes_per_block(3, 16, 2, 64, torch.float32, mode)
    assert per_block == 2 * 3 * 16 * 2 * head_bytes
    p = PagedPools([0, 2, 5], 7, 16, 2, 64, torch.float32, "cpu", mode)
    assert p.nbytes == 7 * per_block  # what the tensors really hold
    assert len(p.k_scale) == len(p.v_scale) == (0 if mode == "none" else 3)


# fp8 through the fused write is checked on the H200 only: Triton's
# interpreter rounds float8 casts its own way (a code or two per token moves).
@pytest.mark.parametrize("mode,fused", [("int8", True), ("int8", False), ("fp8", False)])
def test_8bit_pools_read_back_what_was_written_in_either_memory_order(mode, fused):
    """Pools the kernels read (``fused``) are head-major: keys [blocks, H,
    block_size, D], values [blocks, H, D, block_size], scales [blocks, H,
    block_size] (what the decode kernel's wide loads need); the torch path's
    stay token-major. The logical view, and a write then a gather, are the
    same either way."""
    if fused and not pa.available("cpu"):
        pytest.skip("the fused write needs triton (interpreted here)")
    blocks, bs, h, d = 5, 8, 2, 16
    p = PagedPools([0], blocks, bs, h, d, torch.float32, "cpu", mode, fused=fused)
    assert p.k[0].shape == p.v[0].shape == (blocks, bs, h, d) and p.k_scale[0].shape == (blocks, bs, h)
    if fused:
        assert p.k[0].stride() == (h * bs * d, d, bs * d, 1)
        assert p.v[0].stride() == (h * d * bs, 1, d * bs, bs)
        assert p.k_scale[0].stride() == p.v_scale[0].stride() == (h * bs, 1, bs)
    else:
        assert p.k[0].is_contiguous() and p.v[0].is_contiguous() and p.k_scale[0].is_contiguous()
    g = torch.Generator().manual_seed(4)
    keys, values = torch.randn(6, h, d, generator=g), torch.randn(6, h, d, generator=g)
    slots = torch.tensor([9, 3, 31, 16, 8, 24])
    p.write(0, keys, values, slots)
    table = torch.tensor([[1, 0, 3, 2]])  # tokens 0..31 of one row: slots 8..15, 0..7, 24..31, 16..23
    k, v = p.gather(0, table, 32)
    row = {9: 1, 3: 8 + 3, 31: 16 + 7, 16: 24, 8: 0, 24: 16}  # slot -> the row's token index
    for i, s in enumerate(slots.tolist()):
        for x, got in ((keys, k), (values, v)):
            want = kvq.dequantize(*kvq.quantize(x[i], mode), torch.float32)
            assert torch.equal(got[0, row[s]], want), (i, s)


def test_int8_holds_at_least_1_9x_the_tokens_of_bfloat16_even_at_head_dim_64():
    for d in (64, 128, 256):
        ratio = kvq.head_bytes(d, torch.bfloat16, "none") / kvq.head_bytes(d, torch.bfloat16, "int8")
        assert ratio >= 1.9, (d, ratio)


def test_token_bytes_quantize_only_the_full_attention_layers():
    specs = [KVSpec(2, 16, window=8), KVSpec(2, 16), KVSpec(1, 32)]
    assert token_bytes(specs, torch.float32) == [2 * 2 * 16 * 4, 2 * 2 * 16 * 4, 2 * 32 * 4]
    assert token_bytes(specs, torch.float32, "int8") == [2 * 2 * 16 * 4, 2 * 2 * 18, 2 * 34]


@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
def test_the_engine_sizes_its_pool_and_stats_from_8_bit_blocks(family):
    model, tok = tiny_model(family, plain=True), CharTokenizer()
    budget = 1 << 20
    engines = {m: LLMEngine(model, tok, opt.EngineOptions(paged_kv=opt.PagedKvOptions(16), kv_budget_bytes=budget,
                                                          kv_quant=m, max_model_len=256)) for m in ("none", "int8")}
    plain, quant = engines["none"], engines["int8"]
    assert quant.store.pools.k[quant.store.pools.layers[0]].dtype == torch.int8
    for e in engines.values():
        assert e.store.pools.nbytes <= budget
        assert e.kv_usage().capacity == e.store.pools.nbytes
    pools = quant.store.pools
    spec = model.kv_spec()[pools.layers[0]]
    per_block = PagedPools.bytes_per_block(len(pools.layers), 16, spec.num_kv_heads, spec.head_dim, torch.float32,
                                           "int8")
    assert quant.blocks.num_blocks == budget // per_block
    assert quant.blocks.num_blocks >= 3.5 * plain.blocks.num_blocks  # float32: 4 * D bytes -> D + 2
    # Live bytes: a running sequence's tokens at 8-bit bytes on the pooled layers.
    (seq,) = quant.add_request(list(range(5, 45)), SamplingParams(max_tokens=4, ignore_eos=True))
    quant.step()
    usage = quant.kv_usage()
    full = [i for i, s in enumerate(model.kv_spec()) if s.window is None]
    window = [i for i, s in enumerate(model.kv_spec()) if s.window is not None]
    n, per_token = seq.num_computed, quant.layout.bytes_per_token
    want_live = sum(per_token[i] for i in full) * n + sum(
        per_token[i] * min(n, model.kv_spec()[i].window) for i in window)
    assert usage.live == want_live
    assert usage.allocated - quant.store.row_bytes(seq.seq_id) == 3 * per_block  # 40 tokens: 3 blocks of 16
    for i in full:
        assert per_token[i] == 2 * model.kv_spec()[i].num_kv_heads * (model.kv_spec()[i].head_dim + 2)


# -- numerics through the model -----------------------------------------------

# Bounds on |logprob(8-bit KV) - logprob(float32 KV)| on the small random
# models; the observed worst differences are under a third of these (int8
# 0.009, fp8 0.042, both on the small Gemma). A store
# that dropped or misplaced a token, or a scale off by a bit, moves them by
# 1e-1 or more.
LOGPROB_BOUND = {"int8": 0.03, "fp8": 0.15}


def greedy_run(model, tok, kv_quant: str, batch: list[list[int]], block_size: int):
    engine = LLMEngine(model, tok, opt.EngineOptions(
        paged_kv=opt.PagedKvOptions(block_size), kv_budget_bytes=1 << 22, kv_quant=kv_quant,
        max_num_batched_tokens=16, max_num_seqs=4, max_model_len=512))
    params = SamplingParams(max_tokens=10, ignore_eos=True, logprobs=3)
    seqs = [s for ids in batch for s in engine.add_request(ids, params)]
    while engine.has_unfinished():
        engine.step()
    return seqs


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
@pytest.mark.parametrize("block_size", [1, 8])
def test_quantized_engine_stays_close_to_the_unquantized_one(family, mode, block_size):
    """Ragged prompts, chunked prefill beside decode rows, several rows per
    step: each generated position whose prefix both runs share (every row's
    first, and the rest until the greedy tokens part) has its chosen
    logprob and its top-3 logprobs (by rank) within the mode's bound, and
    not all equal (the 8-bit path ran)."""
    model, tok = tiny_model(family, plain=True), CharTokenizer()
    batch = [[(7 * i + 3 * j) % 250 + 2 for j in range(n)] for i, n in enumerate([3, 21, 40, 9, 57])]
    plain = greedy_run(model, tok, "none", batch, block_size)
    quant = greedy_run(model, tok, mode, batch, block_size)
    worst, compared = 0.0, 0
    for a, b in zip(plain, quant):
        for i, ((lp_a, top_a), (lp_b, top_b)) in enumerate(zip(a.logprobs, b.logprobs)):
            # The k-th best logprob moves no more than any logprob does; a
            # near-tie may swap ids, so values are compared by rank.
            worst = max(worst, *(abs(x - y) for (_, x), (_, y) in zip(top_a, top_b)))
            if a.output_ids[i] == b.output_ids[i]:
                worst = max(worst, abs(lp_a - lp_b))
            compared += 1
            if a.output_ids[i] != b.output_ids[i]:
                break
    assert compared >= 2 * len(batch)
    assert 0 < worst <= LOGPROB_BOUND[mode], worst


@pytest.mark.parametrize("mode", MODES)
def test_solo_scores_through_quantized_pools_chunk_by_chunk(mode):
    """What `bench ppl` runs: a prompt chunk, then tokens one a call (decode),
    through the pools; close to the default store, not equal to it."""
    model = tiny_model("gemma3_text", plain=True)
    ids = [(5 * j) % 250 + 2 for j in range(40)]
    want = Solo(model)(ids)
    solo = Solo(model, kv_quant=mode, capacity=len(ids), block_size=8)
    got = torch.cat([solo(ids[:30])] + [solo(ids[j : j + 1]) for j in range(30, 40)])
    diff = (torch.log_softmax(got, -1) - torch.log_softmax(want, -1)).abs().max().item()
    assert 0 < diff <= LOGPROB_BOUND[mode], diff
    with pytest.raises(opt.OptionError, match="hold 40 tokens"):
        solo([3])
    assert torch.equal(Solo(model, kv_quant="none", capacity=40)(ids), want)


# -- flags and refusals -------------------------------------------------------


def test_kv_quant_resolves_flag_over_env_over_default():
    paged = {"paged_kv": True}
    assert opt.resolve_engine_options({}, environ={}).kv_quant == "none"
    assert opt.resolve_engine_options(paged, environ={"PAGEDLM_KV_QUANT": "int8"}).kv_quant == "int8"
    assert opt.resolve_engine_options({**paged, "kv_quant": "fp8"}, environ={"PAGEDLM_KV_QUANT": "int8"}).kv_quant \
        == "fp8"
    with pytest.raises(opt.OptionError, match="--kv-quant must be none, int8, fp8"):
        opt.resolve_engine_options({**paged, "kv_quant": "int4"}, environ={})


@pytest.mark.parametrize("mode", MODES)
def test_kv_quant_without_paging_is_refused_everywhere(mode):
    with pytest.raises(opt.UnsupportedOption, match="needs --paged-kv"):
        opt.resolve_engine_options({"kv_quant": mode}, environ={})
    with pytest.raises(opt.UnsupportedOption, match="needs --paged-kv"):
        opt.ServerOptions.resolve({}, {"PAGEDLM_KV_QUANT": mode, "PAGEDLM_DEVICE": "cpu"})
    model, tok = tiny_model(plain=True), CharTokenizer()
    with pytest.raises(opt.UnsupportedOption, match="needs --paged-kv"):
        LLM(model, tokenizer=tok, kv_quant=mode)
    with pytest.raises(opt.UnsupportedOption, match="needs --paged-kv"):
        LLMEngine(model, tok, opt.EngineOptions(kv_quant=mode))
    assert LLM(model, tokenizer=tok, paged_kv=True, kv_quant=mode).engine.store.pools.kv_quant == mode


def test_cli_refuses_kv_quant_without_paging_in_one_line(capsys):
    assert main(["generate", "--kv-quant", "int8", "hi"]) == 2
    err = capsys.readouterr().err
    assert "--kv-quant quantizes the paged store's blocks; it needs --paged-kv" in err and err.count("\n") == 1
    assert main(["generate", "--paged-kv", "--kv-quant", "int3", "hi"]) == 2
    assert "--kv-quant must be none, int8, fp8" in capsys.readouterr().err
