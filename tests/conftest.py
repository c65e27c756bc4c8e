"""Shared fixtures: tiny random-weight models and a character tokenizer, for
engine tests that need a real forward pass but no checkpoint."""

from __future__ import annotations

import os

import torch

# Triton kernels run interpreted on a machine without CUDA (set before any
# kernel is defined: triton reads it when the kernel module is imported).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

from pagedlm.models import build_model
from pagedlm.tokenizer import IncrementalDetokenizer

VOCAB = 256
WINDOW = 8

TINY = {
    "llama": dict(model_type="llama", vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                  num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
                  max_position_embeddings=512, tie_word_embeddings=True),
    "gemma3_text": dict(model_type="gemma3_text", vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                        num_attention_heads=4, num_key_value_heads=1, head_dim=32, num_hidden_layers=4,
                        layer_types=["sliding_attention", "full_attention", "sliding_attention",
                                     "full_attention"],
                        sliding_window=WINDOW, query_pre_attn_scalar=24, max_position_embeddings=512,
                        final_logit_softcapping=30.0),
}


def tiny_model(family: str, seed: int = 0) -> torch.nn.Module:
    """Random weights with spread (norm scales off identity, small embeddings,
    a large final norm) so that greedy picks have margins and trajectories
    wander instead of repeating one token."""
    model = build_model(TINY[family]).eval()
    g = torch.Generator().manual_seed(seed)
    identity = 0.0 if family == "gemma3_text" else 1.0
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name == "model.norm.weight":
                p.copy_(torch.normal(5.0, 0.3, p.shape, generator=g))
            elif "norm" in name:
                p.copy_(torch.normal(identity, 0.3, p.shape, generator=g))
            elif "embed_tokens" in name or "lm_head" in name:
                p.copy_(torch.normal(0.0, 0.03, p.shape, generator=g))
            else:
                p.copy_(torch.normal(0.0, 0.3, p.shape, generator=g))
    return model


class CharTokenizer:
    """One token per character (code points below VOCAB); token 1 is EOS."""

    eos_token_ids = {1}
    special_token_ids = frozenset({1})
    vocab_size = VOCAB

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) % VOCAB for c in text]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(i) for i in ids if not (skip_special_tokens and i in self.special_token_ids))

    def detokenizer(self, skip_special_tokens: bool = True) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self, skip_special_tokens)


@pytest.fixture(scope="module", params=list(TINY))
def tiny(request):
    """(family, model, tokenizer) for each tiny family."""
    return request.param, tiny_model(request.param), CharTokenizer()
