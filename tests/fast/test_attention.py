"""The attention backends: which one ``select_backend`` picks, what each lets
CUDA graphs capture, that the store hands its ``attend`` and ``end_step``
to its backend, and that an engine on the torch backend never launches a
Triton kernel."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

import pagedlm.cache.paged
from pagedlm.attention import select_backend
from pagedlm.batch.engine import LLMEngine
from pagedlm.cache.layout import plan_layout
from pagedlm.cache.spec import KVSpec
from pagedlm.cache.step import StepBatch
from pagedlm.cache.store import KVStore
from pagedlm.kernels import paged_attention
from pagedlm.options import ATTENTION_BACKENDS, EngineOptions
from pagedlm.params import SamplingParams
from tests.fast.kernel_refs import requires_triton
from tests.helpers import CharTokenizer, paged, prompts, run_all, tiny_model


@pytest.mark.parametrize("name,device,paged_kv,kernels_run,want", [
    ("torch", "cuda", True, True, "torch"),
    ("triton", "cpu", True, False, "triton"),  # (the engine's refusals stop what cannot run)
    ("triton", "cuda", False, True, "torch"),  # the kernels read only pools
    ("auto", "cuda", True, True, "triton"),
    ("auto", "cuda", True, False, "torch"),  # no triton: the reference
    ("auto", "cpu", True, True, "torch"),  # interpreted kernels run on the CPU, but auto never picks them there
    ("auto", "cuda", False, True, "torch"),
])
def test_select_backend_follows_the_rule(monkeypatch, name, device, paged_kv, kernels_run, want):
    monkeypatch.setattr(paged_attention, "available", lambda d: kernels_run)
    backend = select_backend(name, torch.device(device), paged=paged_kv)
    assert backend.name == want
    assert backend.in_place == (want == "triton")


def test_every_backend_the_flag_names_is_selectable_and_nothing_else():
    for name in ATTENTION_BACKENDS:
        if name != "auto":
            assert select_backend(name, "cpu", paged=True).name == name
    with pytest.raises(ValueError, match="unknown attention backend 'flash'"):
        select_backend("flash", "cpu", paged=True)


def step_of(queries: list[int]) -> StepBatch:
    """A step whose rows have these many new tokens (block tables of one block)."""
    starts = [0]
    for n in queries:
        starts.append(starts[-1] + n)
    rows, tokens = len(queries), torch.zeros(starts[-1], dtype=torch.long)
    return StepBatch(
        input_ids=tokens, positions=tokens, seq_lens=torch.tensor(queries), logits_rows=torch.arange(rows),
        slot_mapping=tokens,
        block_tables=torch.zeros(rows, 1, dtype=torch.long), seq_ids=tuple(range(rows)),
        query_start_host=tuple(starts), seq_lens_host=tuple(queries), sampling_rows=tuple(range(rows)),
        max_position=max(queries) - 1,
    )


@pytest.mark.parametrize("queries,triton_captures", [([1], True), ([1, 1, 1], True), ([1, 3], False), ([4], True),
                                                     ([5, 5, 5], True), ([5, 5, 4], False)])
def test_only_the_kernels_steps_of_rows_of_one_length_may_be_captured(queries, triton_captures):
    step, store = step_of(queries), pool_of(blocks=64)
    assert select_backend("triton", "cuda", paged=True).can_capture(store, step) == triton_captures
    assert not select_backend("torch", "cuda", paged=True).can_capture(store, step)


def pool_of(blocks: int, block_size: int = 16) -> SimpleNamespace:
    """What ``can_capture`` reads of a store: its pool's size."""
    return SimpleNamespace(pools=SimpleNamespace(num_blocks=blocks, block_size=block_size))


def test_decode_rows_that_share_more_keys_than_the_pool_holds_run_eager():
    """A graph's decode partials are bounded by the pool (rows of distinct
    blocks); rows that share a long prefix's blocks can need more, and the
    step then runs eager instead of overflowing the captured buffer."""
    triton = select_backend("triton", "cuda", paged=True)
    step = step_of([1] * 8)
    prefix = 12 * paged_attention.SPLIT  # each of 8 rows has 12 splits of SPLIT keys: 96 splits in all
    assert paged_attention.row_splits(prefix) == 12 and paged_attention.SHORT_SPLITS == 8
    shared = dataclasses.replace(step, seq_lens_host=(prefix,) * 8)
    # the pool's bound: its tokens // SPLIT, plus SHORT_SPLITS a row
    assert triton.can_capture(pool_of(blocks=prefix // 16 + 8), shared) is False  # 12 + 8 * 8 = 76 < 96
    assert triton.can_capture(pool_of(blocks=8 * prefix // 16), shared) is True  # 96 + 8 * 8


class Recorder:
    """A backend that records what the store hands it."""

    name, in_place = "recorder", False

    def __init__(self) -> None:
        self.calls = []

    def attend(self, store, layer, q, step, *, scale):
        self.calls.append(("attend", store, layer, q, step, scale, store.take_fetched(layer)))
        return q * 2

    def end_step(self):
        self.calls.append(("end_step",))

    def can_capture(self, store, step):
        return False


def test_the_store_hands_attend_and_end_step_to_its_backend():
    """The store stores (here: the row caches' fetches, with their masks) and
    hands the rest to its backend; a step's fetches do not outlive it."""
    specs = (KVSpec(2, 8), KVSpec(2, 8, window=4))
    layout = plan_layout(specs, EngineOptions(kv_budget_bytes=1 << 20), "cpu", torch.float32, in_place=False,
                         identity="test", max_model_len=64)
    backend = Recorder()
    store = KVStore(layout, None, backend)
    store.add_row(0)
    step = step_of([3])
    k, q = torch.randn(3, 2, 8), torch.randn(3, 4, 8)
    store.write(0, k, -k, step)
    assert torch.equal(store.attend(0, q, step, scale=0.5), q * 2)
    ((_, got_store, layer, got_q, got_step, scale, fetched),) = backend.calls
    assert got_store is store and layer == 0 and got_q is q and got_step is step and scale == 0.5
    ((keys, values, mask),) = fetched
    assert torch.equal(keys, k) and torch.equal(values, -k)
    assert torch.equal(mask, torch.ones(3, 3, dtype=torch.bool).tril())  # causal
    assert store.take_fetched(0) is None  # taken once
    store.write(1, k, k, step)
    store.end_step()
    assert backend.calls[-1] == ("end_step",)
    assert store.take_fetched(1) is None


@pytest.fixture
def no_kernels(monkeypatch):
    """Every Triton entry point raises."""
    def refuse(*args, **kwargs):
        raise AssertionError("a Triton kernel ran")

    monkeypatch.setattr(paged_attention, "write_kv", refuse)
    monkeypatch.setattr(paged_attention, "paged_decode", refuse)
    monkeypatch.setattr(pagedlm.cache.paged, "write_kv", refuse, raising=False)  # imported by name there


SHARED = list(range(2, 20))
BATCH = prompts(2, seed=2, lo=2, hi=12) + [SHARED + [30], SHARED + [40]]
SIX = SamplingParams(max_tokens=6, ignore_eos=True)


def engine_on(name: str) -> LLMEngine:
    return LLMEngine(tiny_model("gemma3_text"), CharTokenizer(), paged(8, attention_backend=name, kv_quant="int8"))


@pytest.mark.parametrize("name", ["torch", "auto"])
def test_an_engine_on_the_torch_backend_never_launches_a_kernel(no_kernels, name):
    """The torch backend, asked for or what auto is on the CPU, runs a whole
    batch (8-bit blocks, a prefix from cached blocks) with every kernel
    refusing to run."""
    engine = engine_on(name)
    assert engine.attention_backend == "torch"
    assert [len(s.output_ids) for s in run_all(engine, BATCH, SIX, arrive_every=1)] == [6] * 4
    assert engine.cache_stats().prefix_hit_tokens >= 16


@requires_triton
def test_the_refusals_stop_the_kernels_backend(no_kernels):
    """The control: the refusals sit where the kernels are called."""
    engine = engine_on("triton")
    assert engine.attention_backend == "triton"
    with pytest.raises(AssertionError, match="a Triton kernel ran"):
        run_all(engine, BATCH, SIX)
