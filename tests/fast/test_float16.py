"""Gemma 3 in float16 (issue 27: `--dtype float16` printed only a newline).

Gemma's residual stream outgrows float16's range (1.04e5 against 65504 in
Gemma 3 270M's middle layers), so it overflowed to inf and the logits were
NaN; the residual now stays float32 while the layers compute in float16
(``models.gemma3.residual_dtype``). A tiny Gemma with two outlier channels
(large post-feedforward norm scales, as the real model's outliers) grows a
residual past 65504 the same way.
"""

from __future__ import annotations

import copy

import torch

from pagedlm.batch.solo import Solo
from tests.helpers import tiny_model

PROMPT = [3, 17, 42, 99, 5, 200, 64, 11, 128, 7]
FLOAT16_MAX = torch.finfo(torch.float16).max


def _outlier_gemma():
    model = tiny_model("gemma3_text")
    with torch.no_grad():
        for layer in model.model.layers:
            layer.post_feedforward_layernorm.weight[:2] = 4e4
    return model


def _logits(model, dtype):
    return Solo(copy.deepcopy(model).to(dtype))(PROMPT).float()


def test_the_tiny_gemma_residual_outgrows_float16():
    """The premise of the test below: in float32 the residual passes 65504."""
    model = _outlier_gemma()
    peaks = []
    for layer in model.model.layers:  # a block returns (the next block's normed input, the stream)
        layer.register_forward_hook(lambda module, args, out: peaks.append(out[1].abs().max().item()))
    Solo(model)(PROMPT)
    assert max(peaks) > FLOAT16_MAX


def test_float16_gemma_is_finite_and_at_least_as_close_to_float32_as_bfloat16():
    """float16 has 3 more mantissa bits than bfloat16: where nothing overflows,
    its logits are the nearer to float32's, and greedy picks the same tokens."""
    model = _outlier_gemma()
    reference = _logits(model, torch.float32)
    half = _logits(model, torch.float16)
    assert torch.isfinite(half).all()
    assert torch.equal(half.argmax(-1), reference.argmax(-1))
    assert (half - reference).abs().max() < (_logits(model, torch.bfloat16) - reference).abs().max()
