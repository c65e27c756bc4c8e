"""Weight-only quantization on a real model: the whole path (cache
conversion, tied head, embedding lookup) against the float model, teacher
forced along the float model's own greedy text. Perplexity figures:
`pagedlm bench ppl`."""

from __future__ import annotations

import pytest
import torch

from pagedlm.batch.solo import Solo
from pagedlm.loading import load
from pagedlm.loading.catalog import BUILTINS

pytestmark = pytest.mark.weights

# torch's weight-only kernels return bfloat16, so a quantized head's logits
# are bfloat16 values (a step of 0.125 at 20-30): two candidates closer than
# that can tie and swap. 0.25 nats is two such steps.
NEAR_TIE = 0.25


def _forced_top2(model, ids: list[int], follow: list[int]) -> list[tuple[int, float]]:
    """Fed ``ids`` then ``follow`` one token at a time: at each step the
    argmax and the log-probability margin between the two best tokens."""
    solo = Solo(model)
    logits = solo(ids)[-1]
    steps = []
    for token in follow:
        top = torch.log_softmax(logits.float(), -1).topk(2)
        steps.append((int(top.indices[0]), float(top.values[0] - top.values[1])))
        logits = solo([token])[-1]
    return steps


@pytest.fixture(scope="module")
def float_smollm2() -> tuple[list[int], list[int], list[tuple[int, float]]]:
    """(prompt ids, the float model's greedy text, its forced top-2 along it): the
    reference of both modes below, computed once."""
    if BUILTINS["smollm2-135m-instruct"].locate() is None:
        pytest.skip(BUILTINS["smollm2-135m-instruct"].install)
    model, tok = load("smollm2-135m-instruct")
    ids = tok.encode("The capital of France is")
    solo, text = Solo(model), []
    logits = solo(ids)[-1]
    for _ in range(48):  # the float model's greedy continuation
        text.append(int(logits.argmax()))
        logits = solo([text[-1]])[-1]
    return ids, text, _forced_top2(model, ids, text)


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantized_smollm2_agrees_with_float_except_at_near_ties(float_smollm2, mode):
    ids, text, want = float_smollm2
    got = _forced_top2(load("smollm2-135m-instruct", quantization=mode)[0], ids, text)
    differ = [(i, margin) for i, ((a, margin), (b, _)) in enumerate(zip(want, got)) if a != b]
    assert len(differ) <= len(text) // 10, differ
    assert all(margin < NEAR_TIE for _, margin in differ), differ


@pytest.mark.parametrize("name, mode", [("smollm2-135m-instruct", "int4"), ("smollm2-135m-instruct", "int8"),
                                        ("gemma3-270m", "int4")])
def test_integer_cpu_kernel_agrees_with_torch_products_except_at_near_ties(name, mode, monkeypatch):
    """``kernels.cpu_quant`` (8-bit activations) against torch's products
    (bfloat16 activations) on the same stored weights, teacher forced along
    torch's greedy text: the same argmax except at near ties."""
    from pagedlm.kernels import cpu_quant

    if cpu_quant.library() is None:
        pytest.skip("no integer CPU kernel on this machine")
    if BUILTINS[name].locate() is None:
        pytest.skip(BUILTINS[name].install)
    model, tok = load(name, quantization=mode)
    monkeypatch.setenv("PAGEDLM_CPU_QUANT", "0")
    reference = load(name, quantization=mode)[0]
    assert any(hasattr(m, "tiles") for m in model.modules())
    assert not any(hasattr(m, "tiles") for m in reference.modules())
    ids = tok.encode("The capital of France is")
    solo, text = Solo(reference), []
    logits = solo(ids)[-1]
    for _ in range(48):
        text.append(int(logits.argmax()))
        logits = solo([text[-1]])[-1]
    want, got = _forced_top2(reference, ids, text), _forced_top2(model, ids, text)
    differ = [(i, margin) for i, ((a, margin), (b, _)) in enumerate(zip(want, got)) if a != b]
    assert len(differ) <= len(text) // 10, differ
    assert all(margin < NEAR_TIE for _, margin in differ), differ
