"""Tensor parallelism on the CPU (gloo, float32) against one rank, on tiny
random models: the split (partition), the logits and greedy tokens of the
default and paged stores with prefix caching, the prompt cache and
preemption, each rank's resident weight bytes, loading by slices from a
folder (float, int8, int4), the refusals. Faults and shutdown are in
``test_tensor_parallel_faults.py``.

Ranks are processes: a module-scoped model per size is started once and
reused by every engine (one at a time, as the engine requires)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from pagedlm.batch.engine import LLMEngine
from pagedlm.bench.common import unfuse
from pagedlm.loading.hf import load_model
from pagedlm.loading.quant import load_quantized, weight_bytes
from pagedlm.models import build_model
from pagedlm.options import EngineOptions, PagedKvOptions, UnsupportedOption, resolve_engine_options
from pagedlm.params import SamplingParams
from pagedlm.parallel import parallelize
from pagedlm.parallel.partition import partition
from pagedlm.parallel.store import MirroredStore
from tests.helpers import CharTokenizer, block_bytes, prompts, run_all

TOL = 1e-5  # the bar: partial sums over ranks reorder float32 additions, nothing else
# KV heads that 4 does not divide: 2 ranks take whole KV groups (2 + 1), 4 ranks split
# the query heads (2, 2, 1, 1), sharing KV head 2; biases on q/k/v and o, untied head.
GQA = dict(model_type="llama", vocab_size=256, hidden_size=64, intermediate_size=96, num_attention_heads=6,
           num_key_value_heads=3, head_dim=16, num_hidden_layers=2, max_position_embeddings=512,
           tie_word_embeddings=False, attention_bias=True)
# Gemma 3: sliding and full layers, q/k norms, one KV head (replicated), tied head, soft-capping.
GEMMA = dict(model_type="gemma3_text", vocab_size=256, hidden_size=64, intermediate_size=128,
             num_attention_heads=4, num_key_value_heads=1, head_dim=16, num_hidden_layers=3,
             layer_types=["sliding_attention", "full_attention", "sliding_attention"], sliding_window=8,
             query_pre_attn_scalar=16, max_position_embeddings=512, final_logit_softcapping=30.0)
PARAMS = SamplingParams(max_tokens=8, ignore_eos=True)


def random_model(config: dict, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = build_model(config).eval().requires_grad_(False)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0.0, 0.1) if "norm" not in name else p.normal_(0.0, 0.3)
    return model


class Logits:
    """Records what ``model.compute_logits`` returns (an instance attribute over the method)."""

    def __init__(self, model) -> None:
        self.model, self.seen, self._f = model, [], model.compute_logits
        model.compute_logits = self

    def __call__(self, h):
        out = self._f(h)
        self.seen.append(out.clone())
        return out

    def close(self) -> list[torch.Tensor]:
        del self.model.compute_logits
        return self.seen


def run(model, options: EngineOptions, batch, params=PARAMS, arrive_every: int = 0, sequential: bool = False):
    """(output ids per prompt, logits of every call, the engine)."""
    rec = Logits(model)
    engine = LLMEngine(model, CharTokenizer(), options)
    try:
        if sequential:  # one after another: each may reuse the last one's caches
            seqs = [run_all(engine, [ids], params)[0] for ids in batch]
        else:
            seqs = run_all(engine, batch, params, arrive_every)
    finally:
        logits = rec.close()
    return [s.output_ids for s in seqs], logits, engine


def assert_same(ref, got) -> None:
    (ref_ids, ref_logits, _), (ids, logits, _) = ref, got
    assert ids == ref_ids
    assert len(logits) == len(ref_logits)
    assert max((a - b).abs().max().item() for a, b in zip(ref_logits, logits)) <= TOL


@pytest.fixture
def ops_seen(monkeypatch) -> list[str]:
    """The kinds of store ops rank 0 sends its workers (``parallel.store``), in order."""
    seen, take = [], MirroredStore.take_ops

    def recording(self):
        ops = take(self)
        seen.extend(op[0] for op in ops)
        return ops

    monkeypatch.setattr(MirroredStore, "take_ops", recording)
    return seen


@pytest.fixture(scope="module")
def gqa():
    return random_model(GQA)


@pytest.fixture(scope="module", params=[2, 4], ids=["tp2", "tp4"])
def gqa_tp(request, gqa):
    model = parallelize(gqa, EngineOptions(tensor_parallel_size=request.param))
    yield model
    model.close()


# -- the split ---------------------------------------------------------------------


def test_kv_groups_go_whole_to_ranks_while_there_are_enough():
    # SmolLM2-135M's heads: 9 query heads over 3 KV heads.
    two = partition(9, 3, 1536, 49152, 2)
    assert [(p.heads, p.kv_heads) for p in two] == [((0, 6), (0, 2)), ((6, 9), (2, 3))]
    four = partition(9, 3, 1536, 49152, 4)
    assert sorted(p.heads for p in four) == [(0, 3), (3, 5), (5, 7), (7, 9)]
    assert four[0].kv_heads == (1, 3)  # the rank holding two KV heads is rank 0: it sizes the budget
    assert [p.intermediate for p in four] == [(0, 384), (384, 768), (768, 1152), (1152, 1536)]


def test_fewer_kv_heads_than_ranks_are_replicated():
    assert [(p.heads, p.kv_heads) for p in partition(4, 1, 2048, 262144, 4)] == \
        [((r, r + 1), (0, 1)) for r in range(4)]


def test_sizes_the_heads_cannot_take_are_refused():
    with pytest.raises(UnsupportedOption, match="exceeds the model's attention heads"):
        partition(4, 1, 64, 256, 8)
    with pytest.raises(UnsupportedOption, match="runs of different lengths"):
        partition(8, 2, 64, 256, 3)  # rank 1 would read KV head 0 once and KV head 1 twice


def test_flag_refusals():
    with pytest.raises(UnsupportedOption, match="on the CPU use gloo"):
        resolve_engine_options({"tensor_parallel_size": "2", "distributed_backend": "nccl"}, environ={},
                               device="cpu")
    with pytest.raises(UnsupportedOption, match="give both or neither"):
        resolve_engine_options({"distributed_backend": "gloo"}, environ={}, device="cpu")
    opts = resolve_engine_options({}, environ={"PAGEDLM_TENSOR_PARALLEL_SIZE": "2"}, device="cpu")
    assert opts.tensor_parallel_size == 2


# -- against one rank --------------------------------------------------------------


def test_default_store_matches_one_rank(gqa, gqa_tp):
    batch = prompts(5, seed=1, hi=24)
    assert_same(run(gqa, EngineOptions(), batch, arrive_every=2), run(gqa_tp, EngineOptions(), batch, arrive_every=2))


def test_paged_store_with_prefix_caching_and_copy_on_write_matches_one_rank(gqa, gqa_tp, ops_seen):
    shared = prompts(1, seed=2, lo=16, hi=16)[0]  # four whole blocks: a repeat writes into the last
    batch = [shared + p for p in prompts(4, seed=3, lo=1, hi=6)] + [shared, shared[:9]]
    options = EngineOptions(paged_kv=PagedKvOptions(4), kv_budget_bytes=1 << 20)
    ref, got = run(gqa, options, batch, arrive_every=1), run(gqa_tp, options, batch, arrive_every=1)
    assert_same(ref, got)
    assert got[2].blocks.hit_tokens > 0  # prefixes were shared
    assert "copy" in ops_seen  # and a cached block copied before a write, on every rank


def test_preemption_matches_one_rank(gqa, gqa_tp):
    batch = prompts(6, seed=4, lo=10, hi=20)
    params = SamplingParams(max_tokens=16, ignore_eos=True)

    def options(model):  # the same 20 blocks of 4 tokens whatever a rank's KV heads
        return EngineOptions(paged_kv=PagedKvOptions(4, prefix_caching=False), max_model_len=64,
                             kv_budget_bytes=block_bytes(model, 4) * 20)

    ref, got = run(gqa, options(gqa), batch, params), run(gqa_tp, options(gqa_tp), batch, params)
    assert_same(ref, got)
    assert got[2].num_preemptions > 0


def test_prompt_cache_reuse_matches_one_rank(gqa, gqa_tp, ops_seen):
    base = prompts(1, seed=5, lo=12, hi=12)[0]
    batch = [base, base + [7, 8, 9], base[:6] + [3], base + [7, 8, 9, 10]]
    options = EngineOptions(prompt_cache_bytes=1 << 20)
    ref, got = run(gqa, options, batch, sequential=True), run(gqa_tp, options, batch, sequential=True)
    assert_same(ref, got)
    assert got[2].prompt_cache.hits >= 2  # lent, trimmed, lent again: the workers' caches followed
    assert ops_seen.count("lend") >= 2


def test_two_engines_stepping_in_turn_over_the_same_ranks_each_match_one_rank(gqa, gqa_tp):
    batch = prompts(3, seed=8, hi=16)
    stores = [EngineOptions(), EngineOptions(paged_kv=PagedKvOptions(4), kv_budget_bytes=1 << 20)]

    def interleaved(model):
        engines = [LLMEngine(model, CharTokenizer(), o) for o in stores]
        seqs = [[s for ids in batch for s in e.add_request(ids, PARAMS)] for e in engines]
        while any(e.has_unfinished() for e in engines):
            for e in engines:
                e.step()
        return [[s.output_ids for s in row] for row in seqs]

    assert interleaved(gqa_tp) == interleaved(gqa)


def test_gemma_sliding_layers_seeded_from_cached_blocks_match_one_rank(ops_seen):
    model = random_model(GEMMA, seed=1)
    shared = prompts(1, seed=6, lo=21, hi=21)[0]
    batch = [shared + [5], shared + [6, 7], shared + [8]]
    options = EngineOptions(paged_kv=PagedKvOptions(4), kv_budget_bytes=1 << 20)
    ref = run(model, options, batch, sequential=True)
    tp = parallelize(model, EngineOptions(tensor_parallel_size=2))
    try:
        got = run(tp, options, batch, sequential=True)
        assert_same(ref, got)
        assert got[2].blocks.hit_tokens >= 2 * 20  # later prompts started from cached blocks
        assert "seed" in ops_seen  # their ring buffers filled from the pools' copy, on every rank
        # Each rank holds half of what is split; the norms and the one KV head (k and v) are on both.
        replicated = sum(p.numel() * 4 for n, p in model.named_parameters() if "norm" in n)
        replicated += GEMMA["num_hidden_layers"] * 2 * GEMMA["head_dim"] * GEMMA["hidden_size"] * 4
        for rank_bytes in tp.weight_bytes:
            assert rank_bytes == (weight_bytes(model) - replicated) // 2 + replicated
    finally:
        tp.close()


def test_each_rank_holds_its_share_of_the_weights(gqa, gqa_tp):
    sizes = gqa_tp.weight_bytes
    n = len(sizes)
    norms = sum(p.numel() * 4 for name, p in gqa.named_parameters() if "norm" in name)
    assert max(sizes) < (weight_bytes(gqa) - norms) / n * 1.5 + norms  # uneven KV groups: within one group
    assert sum(sizes) >= weight_bytes(gqa)  # all of it somewhere; replicated parts more than once


# -- loading by slices ---------------------------------------------------------------


@pytest.fixture(scope="module")
def folder(tmp_path_factory, gqa):
    path = tmp_path_factory.mktemp("gqa")
    (path / "config.json").write_text(json.dumps(GQA))
    save_file({k: v.contiguous() for k, v in unfuse(gqa.state_dict(), GQA).items()}, str(path / "model.safetensors"))
    return path


def start_from(folder, size: int, quantization: str = "none"):
    """Rank 0 over a folder without a tokenizer (``load_parallel`` reads one too)."""
    from pagedlm.parallel.driver import start

    return start(folder, size=size, backend="gloo", device="cpu", dtype=torch.float32, quantization=quantization)


def test_loading_from_a_folder_reads_slices_and_matches_one_rank(folder):
    batch = prompts(3, seed=7, hi=16)
    ref = run(load_model(folder), EngineOptions(), batch)
    tp = start_from(folder, 2)
    try:
        assert_same(ref, run(tp, EngineOptions(), batch))
    finally:
        tp.close()


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantized_shards_are_slices_of_the_stored_weights(folder, mode, tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDLM_CACHE_DIR", str(tmp_path))  # the workers inherit it
    monkeypatch.setenv("PAGEDLM_CPU_QUANT", "0")  # torch's layouts, which this test slices
    whole = load_quantized(folder, mode, "cpu", torch.float32)
    tp = start_from(folder, 2, mode)
    try:
        part = partition(6, 3, 96, 256, 2)[0]
        (h0, h1), (k0, k1) = part.heads, part.kv_heads
        D, H, KV = GQA["head_dim"], 6, 3
        rows = [*range(h0 * D, h1 * D), *range((H + k0) * D, (H + k1) * D),
                *range((H + KV + k0) * D, (H + KV + k1) * D)]
        mine, full = tp.shard.model.layers[0].self_attn, whole.model.layers[0].self_attn
        if mode == "int8":  # qweight [N, K]: q/k/v cut by rows, o by columns
            assert torch.equal(mine.qkv_proj.quant.qweight, full.qkv_proj.quant.qweight[rows])
            assert torch.equal(mine.o_proj.quant.qweight, full.o_proj.quant.qweight[:, h0 * D : h1 * D])
        else:  # scales and zeros [K / 32, N, 2]: rows are the second axis, groups of K the first
            assert torch.equal(mine.qkv_proj.quant.scales_and_zeros, full.qkv_proj.quant.scales_and_zeros[:, rows])
            assert torch.equal(mine.o_proj.quant.scales_and_zeros,
                               full.o_proj.quant.scales_and_zeros[h0 * D // 32 : h1 * D // 32])
        v0, v1 = part.vocab  # the embedding keeps its stored codes for row lookups, int4 too
        assert torch.equal(tp.shard.model.embed_tokens.quant.qweight, whole.model.embed_tokens.quant.qweight[v0:v1])
        (seq,) = run_all(LLMEngine(tp, CharTokenizer()), [[5, 6, 7]], SamplingParams(max_tokens=3, ignore_eos=True))
        assert len(seq.output_ids) == 3
    finally:
        tp.close()
