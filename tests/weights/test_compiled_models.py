"""The compiled CPU decode step (``--compile``, ``batch/compiled.py``) against
the eager one on the real models: float32 gives the eager greedy tokens with
logits within 1e-4; quantized weights agree except at near ties (the rule of
``test_quant_models.py``). Each test compiles one graph (``max_num_seqs=1``)
or two, tens of seconds on two cores with an empty inductor cache."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from pagedlm.batch.compiled import inductor_options
from pagedlm.batch.engine import LLMEngine
from pagedlm.batch.solo import Solo
from pagedlm.loading import load
from pagedlm.loading.catalog import BUILTINS
from pagedlm.options import EngineOptions, cxx_compiler
from pagedlm.params import SamplingParams

pytestmark = [pytest.mark.weights,
              pytest.mark.skipif(cxx_compiler() is None, reason="--compile needs a C++ compiler")]

NEAR_TIE = 0.25  # as tests/weights/test_quant_models.py: two bfloat16 steps of a quantized head's logits
TEXT = "The history of the printing press begins in the fifteenth century, when movable type changed books. "


def _need(name: str) -> None:
    if BUILTINS[name].locate() is None:
        pytest.skip(BUILTINS[name].install)


def _compiled_run(model, tok, ids: list[int], new: int, max_num_seqs: int = 1):
    """Greedy ``new`` tokens through a compiled engine: the tokens, the
    logits of every compiled step, and how many graphs compiled during it."""
    engine = LLMEngine(model, tok, EngineOptions(compile=True, max_num_seqs=max_num_seqs))
    recorded, run = [], engine.graphs.run
    engine.graphs.run = lambda step: recorded.append(run(step)) or recorded[-1]
    graphs = counters["stats"]["unique_graphs"]
    tokens = [out.token for out in engine.stream(ids, SamplingParams(max_tokens=new, ignore_eos=True))]
    return tokens, [logits[0].float() for logits in recorded], counters["stats"]["unique_graphs"] - graphs


def _eager_along(model, ids: list[int], tokens: list[int]) -> list[torch.Tensor]:
    """Eager logits after each of ``tokens`` but the last, fed after ``ids``."""
    solo = Solo(model)
    solo(ids)
    return [solo([t])[-1].float() for t in tokens[:-1]]


# 250: the default store's keys grow past 256 during the decode; 600: Gemma 3's
# sliding layers (window 512) start from a prompt longer than their window and
# attend over their ring buffers in the graph.
@pytest.mark.parametrize("name,prompt_len", [("smollm2-135m-instruct", 250), ("gemma3-270m", 250),
                                             ("gemma3-270m", 600)])
def test_compiled_float32_decode_gives_eager_tokens_and_logits_without_recompiling(name, prompt_len):
    _need(name)
    model, tok = load(name)
    ids = tok.encode(TEXT * 60)[:prompt_len]
    assert len(ids) == prompt_len
    tokens, compiled, recompiled = _compiled_run(model, tok, ids, 12)
    assert recompiled == 0  # the keys grew, the graph held
    assert len(compiled) == len(tokens) - 1  # every decode step ran compiled
    eager = _eager_along(model, ids, tokens)
    for step, (a, b) in enumerate(zip(compiled, eager)):
        assert int(a.argmax()) == int(b.argmax()) == tokens[step + 1]
        assert (a - b).abs().max().item() <= 1e-4, step


def test_a_compiled_residual_add_rounds_once_after_its_product():
    """Inductor would fold ``x + a @ w`` into ``addmm(x, a, w)``, and MKL then
    rounds the K-major product's partial sums at the residual's magnitude
    (2.9e-2 off here; ``ResidualOutsideGemm``): the compiled sum is the eager one."""
    torch.manual_seed(0)
    x, a, w = torch.randn(1, 576) * 4e3, torch.randn(1, 1536), torch.randn(1536, 576) * 0.05  # w K-major
    residual_add = lambda x, a, w: x + a @ w  # noqa: E731
    torch._dynamo.reset()
    compiled = torch.compile(residual_add, dynamic=False, options=inductor_options(torch.nn.Linear(1, 1)))
    assert torch.equal(compiled(x, a, w), residual_add(x, a, w))


def test_compiled_quantized_gemma_agrees_with_eager_except_at_near_ties():
    """int4 on the Q4_K_M file: int4 layers, int8 head and the Q5/Q6/Q8 tensors."""
    _need("gemma3-270m")
    model, tok = load("gemma3-270m", quantization="int4")
    ids = tok.encode("The capital of France is")
    tokens, compiled, _ = _compiled_run(model, tok, ids, 24)
    eager = _eager_along(model, ids, tokens)
    differ = []
    for step, logits in enumerate(eager):
        top = torch.log_softmax(logits, -1).topk(2)
        if int(top.indices[0]) != tokens[step + 1]:
            differ.append((step, float(top.values[0] - top.values[1])))
    assert len(differ) <= len(eager) // 10, differ
    assert all(margin < NEAR_TIE for _, margin in differ), differ


def test_compiled_batch_of_two_gives_the_eager_engines_tokens():
    """Two rows decode through the graph whose row count is dynamic."""
    _need("smollm2-135m-instruct")
    model, tok = load("smollm2-135m-instruct")
    prompts = [tok.encode("The capital of France is"), tok.encode(TEXT)]
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    outputs = {}
    for compile in (False, True):
        engine = LLMEngine(model, tok, EngineOptions(compile=compile, max_num_seqs=2))
        seqs = [engine.add_request(p, params)[0] for p in prompts]
        while engine.has_unfinished():
            engine.step()
        outputs[compile] = [seq.output_ids for seq in seqs]
    assert outputs[True] == outputs[False]
