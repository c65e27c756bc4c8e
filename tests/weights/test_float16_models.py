"""Gemma 3 270M in float16 (issue 27): its residual stream reaches 1.04e5,
past float16's 65504, which made every logit NaN; with the residual kept in
float32 (``models.gemma3.residual_dtype``) its float16 logits are the nearer
to float32's, as float16's 3 more mantissa bits than bfloat16 should make them."""

import pytest
import torch

from pagedlm.batch.solo import Solo
from pagedlm.loading import load

pytestmark = pytest.mark.weights

TEXT = "The capital of France is a city on the Seine, and its most famous tower"


def test_gemma_float16_logits_are_finite_and_nearer_float32_than_bfloat16(float32_model):
    logits = {}
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        if dtype == torch.float32:  # the suites' shared model, read only (tests/weights/conftest.py)
            model, tokenizer = float32_model("gemma3-270m")
        else:
            model, tokenizer = load("gemma3-270m", "cpu", dtype)
        logits[dtype] = Solo(model)(tokenizer.encode(TEXT)).float()
        del model
    reference, half = logits[torch.float32], logits[torch.float16]
    assert torch.isfinite(half).all()
    assert torch.equal(half.argmax(-1), reference.argmax(-1))
    assert (half - reference).abs().max() < (logits[torch.bfloat16] - reference).abs().max()
