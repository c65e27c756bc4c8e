"""Tiny random-weight models and a tiny tokenizer, for tests of generation and
of the server without real weights (seconds each)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer as HFTokenizer

from pagedlm.loading import gguf as conv
from pagedlm.models import build_model
from pagedlm.tokenizer import Tokenizer

CHATML = (  # SmolLM2's template, without its default system turn
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% endif %}"
)


def byte_level() -> HFTokenizer:
    """Byte-level BPE as the GGUF converter builds it: 3 control tokens, 256
    bytes, a few merges."""
    alphabet = list(conv.bytes_to_unicode().values())
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *alphabet, "he", "ll", "hell", "hello"]
    md = {
        "general.architecture": "llama",
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [conv.CONTROL] * 3 + [conv.NORMAL] * (len(tokens) - 3),
        "tokenizer.ggml.merges": ["h e", "l l", "he ll", "hell o"],
    }
    return conv.build_tokenizer(conv.GgufFile(Path("x"), md, []))


def tiny_tokenizer() -> Tokenizer:
    """`byte_level` with ChatML's template; EOS <|im_end|>."""
    return Tokenizer(byte_level(), bos_token=None, eos_token="<|im_end|>", add_bos_token=False,
                     chat_template=CHATML)


def tiny_model(vocab_size: int, family: str = "llama", seed: int = 0) -> torch.nn.Module:
    """Random weights, float32, CPU. ``family`` "gemma3_text" mixes sliding
    (window 8) and full-attention layers."""
    config = dict(model_type=family, vocab_size=vocab_size, hidden_size=64, intermediate_size=128,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_hidden_layers=2,
                  rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False)
    if family == "gemma3_text":
        config.update(num_hidden_layers=3, sliding_window=8, query_pre_attn_scalar=16,
                      layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                      rope_local_base_freq=10000.0, hidden_activation="gelu_pytorch_tanh")
    torch.manual_seed(seed)
    model = build_model(config)
    with torch.no_grad():  # untied, small weights: greedy paths that do not loop at once
        for p in model.parameters():
            p.normal_(0, 0.1)
    return model.eval().requires_grad_(False)


@pytest.fixture(scope="session")
def tokenizer() -> Tokenizer:
    return tiny_tokenizer()


@pytest.fixture(scope="session")
def model(tokenizer) -> torch.nn.Module:
    return tiny_model(tokenizer.vocab_size)


@pytest.fixture(scope="module")
def served(model, tokenizer):
    """(client, planner) of the server app over the tiny model (tests.fast.server_helpers.make_app)."""
    from fastapi.testclient import TestClient

    from tests.fast.server_helpers import make_app

    app, engine = make_app(model, tokenizer)
    with TestClient(app) as client:
        yield client, engine


@pytest.fixture
def client(served):
    return served[0]
