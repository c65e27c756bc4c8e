"""Async scheduling on CUDA (the default there): steps launched before the
previous step's tokens reach the host, fed from the device under the
kernels and CUDA graphs, give the synchronous engine's tokens. With room for
every row and no stop, both schedule the same rows each step, so bf16 gives
the same tokens to the bit.

Skipped without CUDA; run on the GPU machine.
"""

import re
from pathlib import Path

import pytest
import torch

from pagedlm.bench.common import load_random
from pagedlm.llm import LLM
from pagedlm.params import SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

CONFIGS = Path(__file__).resolve().parents[2] / "benchmarks" / "configs"


@pytest.fixture(scope="module", params=["qwen3-0.6b", "gemma3-270m"])
def loaded(request):
    return load_random(str(CONFIGS / request.param), "cuda", torch.bfloat16)


def _run(model, tokenizer, params, on: bool):
    llm = LLM(model, tokenizer=tokenizer, kv_budget_bytes=2 << 30, max_num_batched_tokens=512, max_model_len=4096,
              async_scheduling=on)
    assert llm.engine.async_scheduling is on and llm.engine.graphs is not None
    g = torch.Generator().manual_seed(1)
    batch = [torch.randint(0, tokenizer.vocab_size, (n,), generator=g).tolist() for n in (700, 300, 45, 1, 90)]
    in_flight = []
    step = llm.engine.step

    def traced():
        out = step()
        in_flight.append(llm.engine._inflight is not None)
        return out

    llm.engine.step = traced
    outs = llm.generate(batch, params, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outs], llm, sum(in_flight)


def test_async_under_graphs_gives_the_synchronous_tokens(loaded):
    model, tokenizer = loaded
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    expected, _, none = _run(model, tokenizer, params, False)
    got, llm, overlapped = _run(model, tokenizer, params, True)
    assert none == 0 and overlapped > 30
    assert len(set(expected[0][0])) > 1, "degenerate trajectory proves nothing"
    assert got == expected
    assert llm.engine.blocks.num_free == llm.engine.blocks.num_blocks


def test_async_stops_on_a_token_it_learns_a_step_late(loaded):
    model, tokenizer = loaded
    free, _, _ = _run(model, tokenizer, SamplingParams(max_tokens=40, ignore_eos=True), False)
    stop = free[0][0][10]
    params = SamplingParams(max_tokens=40, stop_token_ids=[stop])
    expected, _, _ = _run(model, tokenizer, params, False)
    got, llm, _ = _run(model, tokenizer, params, True)
    # The row that stops: the same tokens up to the stop. (After it, the async engine ran one more
    # step with the row in it, so the other rows' products had another batch size: bf16 may part there.)
    assert expected[0][1] == "stop" and got[0] == expected[0]
    assert llm.engine.blocks.num_free == llm.engine.blocks.num_blocks


def test_grammar_rows_under_async_give_the_synchronous_tokens(loaded):
    """Grammar rows overlap too (each step lands the token in flight, fills
    the masks, copies them from pinned memory and picks on the device): the
    synchronous engine's tokens, every one inside its grammar.
    Regexes that 30 tokens cannot complete: every row ends at the same step in
    both runs (a row ending earlier would change later batches, where bf16 may part)."""
    pytest.importorskip("llguidance", reason="the grammar engine travels as a wheel (gpu_spec_session.sh)")
    from pagedlm.structured import Constraint
    from tests.helpers import tiny_tokenizer

    model, _ = loaded
    tokenizer = tiny_tokenizer()  # a tokenizer.json for llguidance; the model's logits are wider
    patterns = ["[a-z]{200}", "[0-9 ]{200}", "(ab|cd){100}", "[a-f]{50}[0-9]{150}"]
    params = [SamplingParams(max_tokens=30, structured_outputs=Constraint(regex=p)) for p in patterns]
    runs = []
    for on in (False, True):
        llm = LLM(model, tokenizer=tokenizer, kv_budget_bytes=2 << 30, max_model_len=4096, async_scheduling=on)
        assert llm.engine.prefetch_masks  # (on CUDA: a synchronous step's masks fill in the background)
        in_flight = []
        step = llm.engine.step
        llm.engine.step = lambda: (step(), in_flight.append(llm.engine._inflight is not None))[0]
        outs = llm.generate(["Reply: "] * len(patterns), params, use_tqdm=False)
        runs.append(([(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason) for o in outs],
                     sum(in_flight)))
    (expected, none), (got, overlapped) = runs
    assert none == 0 and overlapped >= 25
    assert got == expected
    # "length", not "error": a token outside its grammar would have ended the row
    assert all(finish == "length" and len(ids) == 30 for ids, _, finish in got)
    prefixes = ["[a-z]*", "[0-9 ]*", "(ab|cd)*[ac]?", "[a-f]{0,50}|[a-f]{50}[0-9]*"]
    assert all(re.fullmatch(p, text) for (_, text, _), p in zip(got, prefixes)), got
