"""8-bit KV blocks on the real models, through the engine: prompt logprobs of
real text (argparse's source, three prompts batched, prefill chunked beside
the others) with int8 and fp8 pools against unquantized pools.

The perplexity figures over 20k tokens come from `pagedlm bench ppl
--kv-quant int8,fp8` (benchmarks/RESULTS.md); this is the same claim on a
sample small enough for the test tier, with bounds that a misplaced token,
a wrong scale or a lost block would break by orders of magnitude.
"""

import argparse
import inspect
import math

import pytest

from pagedlm.llm import LLM
from pagedlm.params import SamplingParams

pytestmark = pytest.mark.weights

MODELS = ["gemma3-270m", "smollm2-135m-instruct"]
# The perplexity targets, as the relative change of the mean
# negative log-likelihood against unquantized pools (measured on this sample:
# SmolLM2 int8 -0.01%, fp8 -0.11%; Gemma 3 int8 -0.04%, fp8 +0.25%).
NLL_CHANGE = {"int8": 0.005, "fp8": 0.015}
# Mean |change| of one token's logprob, nats: about three times the largest
# measured (SmolLM2 int8 0.030, fp8 0.072; Gemma 3 int8 0.071, fp8 0.050).
# Single tokens move more (p99 0.19-0.55), in both directions, which is why
# the mean NLL barely moves.
MEAN_TOKEN_CHANGE = {"int8": 0.2, "fp8": 0.2}


@pytest.fixture(scope="module", params=MODELS)
def loaded(request, float32_model):
    model, tokenizer = float32_model(request.param)  # shared, read only (tests/weights/conftest.py)
    return request.param, model, tokenizer


def _prompt_logprobs(model, tokenizer, kv_quant: str) -> list[float]:
    ids = tokenizer.encode(inspect.getsource(argparse))
    prompts = [ids[:700], ids[3000:3300], ids[6000:6200]]  # the first past Gemma's 512-token window
    llm = LLM(model, tokenizer=tokenizer, paged_kv=True, kv_quant=kv_quant, kv_budget_bytes=1 << 30,
              max_num_batched_tokens=256, max_model_len=4096)
    outs = llm.generate(prompts, SamplingParams(max_tokens=0, prompt_logprobs=0), use_tqdm=False)
    return [lp[t].logprob for o in outs for t, lp in zip(o.prompt_token_ids[1:], o.prompt_logprobs[1:])]


@pytest.fixture(scope="module")
def plain(loaded) -> list[float]:
    """The reference: the prompt logprobs with unquantized pools, once per model for both modes."""
    _, model, tokenizer = loaded
    return _prompt_logprobs(model, tokenizer, "none")


@pytest.mark.parametrize("mode", ["int8", "fp8"])
def test_8_bit_blocks_change_real_text_logprobs_little(loaded, plain, mode):
    name, model, tokenizer = loaded
    quant = _prompt_logprobs(model, tokenizer, mode)
    assert len(plain) == len(quant) == 699 + 299 + 199
    nll_plain, nll_quant = -sum(plain) / len(plain), -sum(quant) / len(quant)
    change = nll_quant / nll_plain - 1
    moved = sum(abs(a - b) for a, b in zip(plain, quant)) / len(plain)
    assert all(math.isfinite(x) for x in quant)
    assert abs(change) <= NLL_CHANGE[mode], f"{name} {mode}: mean NLL {change:+.3%}"
    assert 0 < moved <= MEAN_TOKEN_CHANGE[mode], f"{name} {mode}: logprobs moved {moved:.4f} nats on average"
