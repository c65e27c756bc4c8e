"""The KV manager's decisions, without a model: ``plan_layout`` (which layers
are paged, mirrored or cached per row on a Gemma-like model, on the torch
path and in place; the budget from each flag; block counts; the refusals;
the prefix salt) and the two admission policies through their one
interface (``cache.admission``)."""

from __future__ import annotations

import pytest
import torch

from pagedlm.attention import select_backend
from pagedlm.batch.sequence import Sequence
from pagedlm.cache import KVSpec, KVStore, PagedPools
from pagedlm.cache.admission import NOTHING_CACHED, BlockAdmission, ByteAdmission, CachedPrefix
from pagedlm.cache.blocks import BlockManager
from pagedlm.cache.kv import STEP
from pagedlm.cache.layout import kv_bytes, plan_layout, token_bytes
from pagedlm.cache.prompt import PromptCache
from pagedlm.options import EngineOptions, OptionError, PagedKvOptions, RequestTooLarge
from pagedlm.params import SamplingParams

# Gemma 3's shape: sliding layers (window 8) around full-attention ones, one KV head of 32.
GEMMA = [KVSpec(1, 32, window=8), KVSpec(1, 32), KVSpec(1, 32, window=8), KVSpec(1, 32)]
SLIDING, FULL = frozenset({0, 2}), frozenset({1, 3})
F32 = 2 * 32 * 4  # one token of one layer: keys and values, float32
MiB = 1 << 20


def plan(specs=GEMMA, *, paged: bool = True, caching: bool = False, in_place: bool = False, block_size: int = 4,
         budget: int | None = MiB, max_model_len: int = 64, device: str = "cpu", identity: str = "gemma",
         dtype: torch.dtype = torch.float32, **options):
    paging = PagedKvOptions(block_size, prefix_caching=caching) if paged else None
    return plan_layout(specs, EngineOptions(paged_kv=paging, kv_budget_bytes=budget, **options), device, dtype,
                       in_place=in_place, identity=identity, max_model_len=max_model_len)


# -- placement ----------------------------------------------------------------


def test_the_default_store_caches_every_layer_per_row():
    layout = plan(paged=False)
    assert (layout.block_size, layout.num_blocks, layout.pooled_layers) == (None, 0, ())
    assert layout.paged_layers == layout.mirrored_layers == frozenset()
    assert layout.row_layers == (0, 1, 2, 3) and layout.prefix_salt is None and not layout.in_place
    assert layout.bytes_per_token == (F32,) * 4 and layout.budget_bytes == MiB


def test_the_torch_path_pages_full_layers_and_keeps_ring_buffers_for_sliding_ones():
    layout = plan()
    assert layout.pooled_layers == (1, 3) and layout.paged_layers == FULL
    assert layout.mirrored_layers == frozenset() and layout.row_layers == (0, 2)
    assert layout.block_size == 4 and layout.prefix_salt is None


def test_prefix_caching_on_the_torch_path_mirrors_the_sliding_layers_into_the_pools():
    """A sequence starting from cached blocks needs its window of keys
    before them: the pools keep a copy; attention still reads the ring buffers."""
    layout = plan(caching=True)
    assert layout.pooled_layers == (0, 1, 2, 3)
    assert layout.paged_layers == FULL and layout.mirrored_layers == SLIDING
    assert layout.row_layers == (0, 2) and len(layout.prefix_salt) == 16


@pytest.mark.parametrize("caching", [False, True])
def test_in_place_attention_pages_every_layer_sliding_ones_too(caching):
    layout = plan(caching=caching, in_place=True)
    assert layout.in_place and layout.pooled_layers == (0, 1, 2, 3)
    assert layout.paged_layers == FULL | SLIDING and layout.mirrored_layers == frozenset()
    assert layout.row_layers == ()
    assert (layout.prefix_salt is not None) is caching


def test_8_bit_blocks_shrink_only_the_layers_the_pools_hold_for_attention():
    int8 = 2 * (32 + 2)  # 32 codes and a bfloat16 scale, keys and values
    assert plan(kv_quant="int8").bytes_per_token == (F32, int8, F32, int8)
    # mirrored sliding layers are read from their float ring buffers
    assert plan(kv_quant="int8", caching=True).bytes_per_token == (F32, int8, F32, int8)
    assert plan(kv_quant="int8", in_place=True).bytes_per_token == (int8,) * 4
    assert token_bytes(GEMMA, torch.float32, "int8", sliding_pooled=True) == [int8] * 4


def test_kv_bytes_counts_a_sliding_layer_up_to_its_window():
    layout = plan(paged=False)
    assert kv_bytes(layout.specs, layout.bytes_per_token, [3, 20]) == F32 * (2 * 23 + 2 * (3 + 8))


# -- sizing -------------------------------------------------------------------


def test_the_pools_take_the_whole_budget_in_blocks_of_every_pooled_layer():
    budget = 10 * MiB + 123
    for kw, layers in ((dict(), 2), (dict(caching=True), 4), (dict(in_place=True), 4)):
        layout = plan(budget=budget, block_size=16, **kw)
        per_block = PagedPools.bytes_per_block(layers, 16, 1, 32, torch.float32)
        assert per_block == layers * 16 * F32
        assert layout.num_blocks == budget // per_block and layout.budget_bytes == budget


def test_a_budget_of_exactly_one_max_length_sequence_starts_and_one_byte_less_is_refused():
    one = 16 * PagedPools.bytes_per_block(2, 4, 1, 32, torch.float32)  # 64 tokens in blocks of 4
    assert plan(budget=one, max_model_len=64).num_blocks == 16
    with pytest.raises(OptionError, match="holds 15 blocks of 4 tokens, fewer than one sequence of "
                                          "max_model_len 64 needs"):
        plan(budget=one - 1, max_model_len=64)
    assert plan(paged=False, budget=1, max_model_len=64).budget_bytes == 1  # the default store: per request


def test_the_budget_defaults_to_the_devices():
    assert plan(budget=None).budget_bytes == 2 * 1024**3  # the CPU's


@pytest.fixture
def gpu(monkeypatch):
    """A CUDA device as the budget sees it: 80 GiB, 60 free, this process
    holding 10 (weights) of the 12 it has reserved."""
    gib = 1024**3
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (60 * gib, 80 * gib))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: 10 * gib)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 12 * gib)
    return gib


def test_the_budget_on_cuda_from_the_free_memory_or_the_total(gpu):
    assert plan(budget=None, device="cuda").budget_bytes == int(60 * gpu * 0.9)  # the default fraction
    assert plan(budget=None, device="cuda", gpu_memory_fraction=0.5).budget_bytes == 30 * gpu
    # vLLM's utilization: a share of the total, less what this process holds
    assert plan(budget=None, device="cuda", gpu_memory_utilization=0.5).budget_bytes == 40 * gpu - 10 * gpu
    assert plan(budget=MiB, device="cuda").budget_bytes == MiB


def test_a_utilization_that_leaves_nothing_or_more_than_is_free_is_refused(gpu):
    with pytest.raises(OptionError, match="nothing is left for the KV cache; raise it"):
        plan(budget=None, device="cuda", gpu_memory_utilization=0.1)  # 8 GiB < the 10 held
    with pytest.raises(OptionError, match="only 62.00 GiB of the GPU are free"):
        plan(budget=None, device="cuda", gpu_memory_utilization=0.95)  # 66 GiB > 60 free + 2 cached


# -- the prefix cache's refusal and salt ---------------------------------------


def test_prefix_caching_on_the_torch_path_refuses_layers_whose_keys_differ_in_shape():
    mixed = [KVSpec(2, 16, window=8), KVSpec(1, 32)]
    with pytest.raises(OptionError, match="differ in KV heads or head size; use --no-prefix-caching"):
        plan(mixed, caching=True)
    assert plan(mixed).pooled_layers == (1,)  # nothing mirrored: nothing to refuse


def test_the_salt_names_the_model_its_dtype_and_its_kv_format():
    salt = plan(caching=True).prefix_salt
    assert plan(caching=True).prefix_salt == salt
    for other in (dict(identity="another model"), dict(dtype=torch.bfloat16), dict(kv_quant="int8")):
        assert plan(caching=True, **other).prefix_salt != salt, other


# -- admission, both policies through the one interface -------------------------

H, D = 1, 4  # one full layer
BLOCK = 4


def torch_store(layout, pools=None) -> KVStore:
    """The store of ``layout``, attending with the torch backend."""
    return KVStore(layout, pools, select_backend("torch", "cpu", paged=pools is not None))


def byte_admission(budget: int, prompt_cache: PromptCache | None = None, batch: int = 64) -> ByteAdmission:
    layout = plan([KVSpec(H, D)], paged=False, budget=budget)
    return ByteAdmission(layout, torch_store(layout), prompt_cache, batch)


def block_admission(num_blocks: int, caching: bool = True) -> BlockAdmission:
    per_block = PagedPools.bytes_per_block(1, BLOCK, H, D, torch.float32)
    layout = plan([KVSpec(H, D)], budget=num_blocks * per_block, block_size=BLOCK, caching=caching,
                  max_model_len=BLOCK)
    pools = PagedPools(layout.pooled_layers, num_blocks, BLOCK, H, D, torch.float32, "cpu")
    return BlockAdmission(BlockManager(num_blocks, BLOCK, layout.prefix_salt), torch_store(layout, pools))


def seq(n: int, max_tokens: int = 4, first: int = 10, **params) -> Sequence:
    return Sequence(list(range(first, first + n)), SamplingParams(max_tokens=max_tokens, **params), set(), None)


def admitted(kv, s: Sequence) -> bool:
    """The scheduler's admission of a waiting sequence (its whole prompt this step)."""
    prefix = kv.lookup(s)
    if prefix is None or not kv.reserve(s, prefix, s.num_tokens - prefix.tokens):
        return False
    kv.attach(s, prefix, s.num_tokens - prefix.tokens)
    return True


def compute(kv, s: Sequence) -> None:
    """``s`` computed its tokens; it samples one more."""
    s.num_computed = s.num_tokens
    kv.commit(s)
    s.output_ids.append(99)


def idle(kv) -> bool:
    """Nothing held: no row in the store, no reservation or block in use."""
    held = kv.reserved_bytes if isinstance(kv, ByteAdmission) else kv.blocks.num_used
    return not kv.store.rows and held == 0


@pytest.mark.parametrize("policy", ["bytes", "blocks"])
def test_a_sequence_admitted_grown_and_released_leaves_the_policy_as_it_was(policy):
    kv = byte_admission(MiB) if policy == "bytes" else block_admission(8)
    s = seq(6)
    assert kv.lookup(s) == NOTHING_CACHED
    assert admitted(kv, s) and set(kv.store.rows) == {s.seq_id} and not idle(kv)
    for _ in range(3):
        compute(kv, s)
        assert kv.allocate(s, 1)
    kv.release(s, keep=False)
    assert idle(kv)


@pytest.mark.parametrize("policy", ["bytes", "blocks"])
def test_when_room_runs_out_admission_says_no_and_takes_nothing(policy):
    if policy == "bytes":
        kv = byte_admission(byte_admission(MiB).projected_bytes(10 + 4))  # one sequence's projection exactly
    else:
        kv = block_admission(4)  # 16 tokens
    a, b = seq(10), seq(10, first=50)
    assert admitted(kv, a)
    assert not admitted(kv, b) and set(kv.store.rows) == {a.seq_id}
    kv.release(a, keep=False)
    assert idle(kv) and admitted(kv, b)


def test_bytes_reserve_each_sequences_projection_and_refuse_what_never_fits():
    kv = byte_admission(MiB, batch=16)
    # a full layer grows by STEP tokens: 300 tokens hold 512
    assert kv.projected_bytes(300) == 2 * H * D * 4 * 2 * STEP
    a = seq(100, max_tokens=200)
    assert admitted(kv, a) and kv.reserved_bytes == kv.projected_bytes(300)
    assert kv.allocate(a, 1000)  # reserved at admission: a running sequence never runs short
    kv.check_fits(100, 200)
    with pytest.raises(RequestTooLarge, match=f"the KV budget is {MiB} bytes"):
        kv.check_fits(100, MiB)


def test_a_sliding_layers_projection_is_its_window_and_a_steps_tokens():
    layout = plan([KVSpec(H, D, window=8)], paged=False)
    kv = ByteAdmission(layout, torch_store(layout), None, 16)
    assert kv.projected_bytes(5) == 2 * H * D * 4 * (8 + 16)
    assert kv.projected_bytes(1000) == kv.projected_bytes(5)


def test_bytes_lend_the_prompt_caches_prefix_and_keep_it_inside_the_budget():
    cache = PromptCache(1 << 30)
    kv = byte_admission(MiB, cache)
    first = seq(20)
    assert admitted(kv, first) and first.num_computed == 0
    row = kv.store.rows[first.seq_id][0]
    row.update_and_fetch(torch.ones(20, H, D), torch.ones(20, H, D))  # what the model writes
    first.num_computed = 20
    kv.release(first, keep=True)
    assert len(cache) == 1 and kv.reserved_bytes == 0
    scored = seq(30, prompt_logprobs=0)  # the same 20 tokens, then more; its prompt is to be scored
    assert admitted(kv, scored) and scored.num_computed == 0 and len(cache) == 1
    again = seq(30)
    assert admitted(kv, again) and again.num_computed == 20 and kv.store.rows[again.seq_id][0] is row
    assert len(cache) == 0
    kv.release(again, keep=False)
    assert row.keys is None  # not kept: disposed


def test_bytes_evict_cached_prefixes_to_make_room_for_an_admission():
    one = byte_admission(MiB).projected_bytes(20 + 4)
    cache = PromptCache(1 << 30)
    kv = byte_admission(2 * one - 1, cache)  # one sequence and its cached prefix, less a byte
    kept = seq(20, first=100)
    assert admitted(kv, kept)
    kv.store.rows[kept.seq_id][0].update_and_fetch(torch.ones(20, H, D), torch.ones(20, H, D))
    kept.num_computed = 20
    kv.release(kept, keep=True)
    assert cache.nbytes == one  # 20 tokens of a buffer grown to STEP, as projected
    assert admitted(kv, seq(20, first=200))  # no common prefix: a miss, and the entry goes
    assert cache.nbytes == 0 and kv.reserved_bytes == one


def test_blocks_start_from_the_cached_blocks_of_a_prefix_but_compute_the_last_token():
    kv = block_admission(8)
    a = seq(8)
    assert admitted(kv, a)
    compute(kv, a)
    twin = seq(8)
    prefix = kv.lookup(twin)
    assert prefix == CachedPrefix(7, tuple(kv.blocks.tables[a.seq_id]))  # the last token's logits are needed
    assert kv.reserve(twin, prefix, 1)
    kv.attach(twin, prefix, 1)
    assert twin.num_computed == 7 and kv.blocks.tables[twin.seq_id][1] != kv.blocks.tables[a.seq_id][1]  # a copy
    scored = seq(8, prompt_logprobs=0)
    assert kv.lookup(scored) == NOTHING_CACHED  # nothing cached spares a prompt still to score


def test_blocks_without_prefix_caching_share_nothing():
    kv = block_admission(8, caching=False)
    a = seq(8)
    assert admitted(kv, a)
    compute(kv, a)
    assert kv.lookup(seq(8)) == NOTHING_CACHED and kv.blocks.num_cached == 0
    kv.check_fits(8, 10**6)  # the pool holds max_model_len: nothing to refuse here
