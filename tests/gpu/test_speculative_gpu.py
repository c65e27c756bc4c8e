"""Speculative decoding on CUDA with the kernels: verify rows through the
multi-query paged kernel (replayed as CUDA graphs when every row checks k
tokens), a draft's one-token passes replayed as CUDA graphs.

Skipped without CUDA; run on the GPU machine. float32, random weights of the
Qwen3-0.6B shape: the greedy tokens with speculation are the tokens without
it (the verify step's kernel and the decode graph agree to float32 rounding,
and these trajectories have no near-tie).
"""

from pathlib import Path

import pytest
import torch

from pagedlm.batch.engine import LLMEngine
from pagedlm.bench.common import load_random
from pagedlm.options import EngineOptions, PagedKvOptions
from pagedlm.params import SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

CONFIGS = Path(__file__).resolve().parents[2] / "benchmarks" / "configs"
GEN = 40


@pytest.fixture(scope="module")
def loaded():
    return load_random(str(CONFIGS / "qwen3-0.6b"), "cuda", torch.float32)


def _run(model, tokenizer, draft=None, repeat=1, **kw):
    options = EngineOptions(paged_kv=PagedKvOptions(16), kv_budget_bytes=2 << 30, max_model_len=2048,
                            attention_backend="triton", max_num_seqs=8, **kw)
    engine = LLMEngine(model, tokenizer, options, draft=draft)
    replays = {"draft": [], "verify": []}  # rows of each replayed step
    for name, graphs in (("draft", getattr(engine.proposer, "graphs", None)), ("verify", engine.verify_graphs)):
        if graphs is not None:
            graphs.run = lambda step, run=graphs.run, seen=replays[name]: seen.append(len(step.seq_ids)) or run(step)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, tokenizer.vocab_size, (n,), generator=g).tolist() * repeat for n in (600, 200, 33, 1)]
    seqs = [engine.add_request(p, SamplingParams(max_tokens=GEN, ignore_eos=True))[0] for p in prompts]
    while engine.has_unfinished():
        engine.step()
    return engine, [s.output_ids for s in seqs], replays


def test_a_draft_equal_to_the_model_under_graphs_keeps_the_greedy_tokens(loaded):
    model, tokenizer = loaded
    plain_engine, plain, _ = _run(model, tokenizer)
    assert plain_engine.graphs is not None and len(set(plain[0])) > 1
    engine, got, replays = _run(model, tokenizer, draft=model, speculative="draft", num_speculative_tokens=4,
                                draft_model="itself")
    assert engine.proposer.graphs is not None and replays["draft"]  # the draft's one-token passes replayed
    assert replays["verify"]  # and the verify steps of 4 proposed tokens a row
    assert got == plain
    stats = engine.spec_stats
    assert stats.draft_tokens > 0 and stats.accepted_tokens >= 0.95 * stats.draft_tokens, stats
    assert engine.num_steps < plain_engine.num_steps / 2


def test_ngram_verify_rows_on_the_kernels_keep_the_greedy_tokens(loaded):
    model, tokenizer = loaded
    _, plain, _ = _run(model, tokenizer, repeat=2)  # a prompt said twice: the lookup finds what follows
    engine, got, _ = _run(model, tokenizer, repeat=2, speculative="ngram", num_speculative_tokens=3)
    assert got == plain and engine.spec_stats.drafts > 0
