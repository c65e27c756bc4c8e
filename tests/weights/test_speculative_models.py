"""Speculative decoding on the real models (CPU, float32): greedy prompt
lookup emits exactly the tokens of a run without it, on both stores, at
block sizes 16 and 256, with 1, 3 and 8 proposed tokens a step.

The prompts ask for a passage again (text the stdlib ships), so that
prompt lookup proposes and the model accepts long runs; one row stops on a
stop string that falls inside an accepted proposal, one continues free
text (mostly rejected proposals, their keys crossing block boundaries).
All rows go through one generate call, so verify rows share steps with
plain decode rows.
"""

import json

import pytest

from pagedlm.llm import LLM
from pagedlm.params import SamplingParams

pytestmark = pytest.mark.weights

MODELS = ["gemma3-270m", "smollm2-135m-instruct"]
GEN = 24
# (store, block size, k): each store and block size, each k, twice over
RUNS = [("default", None, 1), ("default", None, 8), ("paged", 16, 3), ("paged", 16, 8), ("paged", 256, 1),
        ("paged", 256, 3)]


@pytest.fixture(scope="module", params=MODELS)
def loaded(request, float32_model):
    model, tokenizer = float32_model(request.param)  # shared, read only (tests/weights/conftest.py)
    return request.param, model, tokenizer


WORDS = json.__doc__.split()[:40]  # the json module's docstring: prose, then code
STOP = " ".join(WORDS[16:18])  # met as the second row copies on (it starts from word 12)


def _prompts(tokenizer) -> list[list[int]]:
    again = " ".join(WORDS) + "\n\nThe same text, copied word for word:\n\n"
    return [tokenizer.encode(again + " ".join(WORDS[:6])), tokenizer.encode(again + " ".join(WORDS[:12])),
            tokenizer.encode("Once upon a time, in a small village by the sea, there lived")]


def _generate(model, tokenizer, params, **kw):
    llm = LLM(model, tokenizer=tokenizer, kv_budget_bytes=1 << 28, max_model_len=512, **kw)
    outs = llm.generate(_prompts(tokenizer), params, use_tqdm=False)
    return llm, [o.outputs[0] for o in outs]


def test_greedy_prompt_lookup_emits_the_plain_tokens_on_both_stores(loaded):
    name, model, tokenizer = loaded
    greedy = SamplingParams(max_tokens=GEN, ignore_eos=True)
    params = [greedy, SamplingParams(max_tokens=GEN, stop=[STOP], ignore_eos=True), greedy]
    _, plain = _generate(model, tokenizer, params)
    assert plain[1].finish_reason == "stop" and 2 < len(plain[1].token_ids) < GEN  # the model copies
    for store, block_size, k in RUNS:
        paging = dict(paged_kv=True, block_size=block_size) if store == "paged" else {}
        llm, spec = _generate(model, tokenizer, params, speculative="ngram", num_speculative_tokens=k, **paging)
        where = f"{name}, {store} {block_size or ''}, k={k}"
        for s, p in zip(spec, plain, strict=True):
            assert (s.token_ids, s.text, s.finish_reason) == (p.token_ids, p.text, p.finish_reason), where
        stats = llm.stats.speculation
        assert 0 < stats.accepted_tokens < stats.draft_tokens, where
        blocks = llm.engine.blocks
        assert blocks is None or blocks.num_free == blocks.num_blocks
