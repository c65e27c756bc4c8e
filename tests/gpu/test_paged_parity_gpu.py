"""The parity gates on CUDA: bf16, random weights with real shapes.

Skipped without CUDA; run on the GPU machine. Random weights are fine here:
the claims are that paging changes storage, not arithmetic (the torch path:
the same tokens and logprobs as the default store, to the bit), and that
the Triton kernels under CUDA graphs compute what the torch path computes
(the same greedy tokens, bf16).
"""

from pathlib import Path

import pytest
import torch

from pagedlm.bench.common import load_random
from pagedlm.kernels import launch
from pagedlm.llm import LLM
from pagedlm.params import SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

CONFIGS = Path(__file__).resolve().parents[2] / "benchmarks" / "configs"
GEN = 48
BUDGET = 2 << 30
MAX_MODEL_LEN = 4096  # the pool must hold one sequence of it


@pytest.fixture(scope="module", params=["qwen3-0.6b", "gemma3-270m"])
def config(request):
    return request.param


@pytest.fixture(scope="module")
def loaded(config):
    return load_random(str(CONFIGS / config), "cuda", torch.bfloat16)


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (700, 300, 45, 1)]


def _run(model, tokenizer, logprobs=1, **kw):
    llm = LLM(model, tokenizer=tokenizer, kv_budget_bytes=BUDGET, max_num_batched_tokens=512,
              max_model_len=MAX_MODEL_LEN, **kw)
    outs = llm.generate(_prompts(tokenizer.vocab_size),
                        SamplingParams(max_tokens=GEN, ignore_eos=True, logprobs=logprobs), use_tqdm=False)
    return llm, [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


def test_paged_bf16_batch_equals_default_exactly(loaded):
    model, tokenizer = loaded
    _, expected = _run(model, tokenizer, paged_kv=False)  # paging is the default on CUDA: the default store asked for
    assert len(set(expected[0][0])) > 1, "degenerate trajectory proves nothing"
    for block_size in (16, 64, 256):
        llm, got = _run(model, tokenizer, paged_kv=True, block_size=block_size, attention_backend="torch")
        assert llm.engine.paged_kv and llm.stats.preemptions == 0
        assert got == expected, block_size


NEAR_TIE = 0.1  # nats: bf16 attention rounds differently in the kernel and in SDPA


def _divergences(expected, got):
    """(prompt, step, the reference's top-1 minus its logprob of the token the
    kernels chose) at each trajectory's first differing token."""
    out = []
    for p, ((ids_want, lp_want), (ids_got, _)) in enumerate(zip(expected, got)):
        i = next((i for i, (a, b) in enumerate(zip(ids_want, ids_got)) if a != b), None)
        if i is not None:
            top = lp_want[i]  # {token: Logprob}: the chosen token, then the top 5
            chosen = top[ids_got[i]].logprob if ids_got[i] in top else float("-inf")
            out.append((p, i, round(top[ids_want[i]].logprob - chosen, 4)))
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_fused_under_graphs_gives_the_reference_greedy_tokens(config, dtype):
    """The kernels (decode in place, replayed as CUDA graphs) against the
    paged torch path. float32: the same greedy tokens and logprobs within
    1e-3. bf16: the two paths round attention differently (the kernel's
    softmax and products against SDPA's), and random weights have
    near-flat logits; a trajectory may part only at a near-tie, where the
    reference itself ranks the kernels' token within NEAR_TIE of its own."""
    model, tokenizer = load_random(str(CONFIGS / config), "cuda", dtype)
    _, expected = _run(model, tokenizer, paged_kv=True, block_size=16, attention_backend="torch", logprobs=5)
    for block_size in (16, 256):
        llm, got = _run(model, tokenizer, paged_kv=True, block_size=block_size, attention_backend="triton",
                        logprobs=5)
        assert llm.engine.attention_backend == "triton" and llm.engine.graphs is not None
        assert llm.stats.preemptions == 0
        parted = _divergences(expected, got)
        print(f"{config} {dtype} block {block_size}: divergences (prompt, step, margin) {parted}")
        if dtype == torch.float32:
            assert not parted
            for (ids, lp_want), (_, lp_got) in zip(expected, got):
                assert max(abs(a[t].logprob - b[t].logprob) for t, a, b in zip(ids, lp_want, lp_got)) < 1e-3
        else:
            assert all(margin < NEAR_TIE for _, _, margin in parted), parted


def test_programmatic_dependent_launch_changes_no_bit(loaded, monkeypatch):
    """On Hopper each kernel launches as a programmatic dependent of the one
    before and waits for it before it reads or writes
    (`kernels.launch.await_inputs`): the engine on the kernels under CUDA
    graphs gives the same tokens and logprobs, to the bit, with it off. A
    kernel that read an input or wrote an output before its wait would race
    the kernel before it. Batch 4 and batch 1 (the one-row product, which
    reads its first weight tile before the wait)."""
    if not launch.pdl_on(torch.device("cuda")):
        pytest.skip("programmatic dependent launch needs compute capability 9.0")
    model, tokenizer = loaded
    prompts = _prompts(tokenizer.vocab_size)
    results = []
    for pdl in (True, False):
        monkeypatch.setattr(launch, "PDL", pdl)
        llm = LLM(model, tokenizer=tokenizer, kv_budget_bytes=BUDGET, max_num_batched_tokens=512,
                  max_model_len=MAX_MODEL_LEN, paged_kv=True, attention_backend="triton")
        assert llm.engine.graphs is not None
        params = SamplingParams(max_tokens=GEN, ignore_eos=True, logprobs=1)
        outs = llm.generate(prompts, params, use_tqdm=False) + llm.generate(prompts[:1], params, use_tqdm=False)
        results.append([(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs])
        del llm
    assert results[0] == results[1]


def test_paged_requests_leave_no_memory_behind(loaded):
    model, tokenizer = loaded
    llm = LLM(model, tokenizer=tokenizer, kv_budget_bytes=BUDGET, paged_kv=True, block_size=16,
              max_model_len=MAX_MODEL_LEN, attention_backend="triton")
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    llm.generate(_prompts(tokenizer.vocab_size), params, use_tqdm=False)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    for _ in range(3):
        llm.generate(_prompts(tokenizer.vocab_size), params, use_tqdm=False)
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == before
    stats = llm.engine.cache_stats()
    assert stats.blocks_free == stats.blocks_total
