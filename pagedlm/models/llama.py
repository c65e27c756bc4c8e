"""Llama (2, 3, 3.1) and SmolLM2: the pre-norm decoder the Llama-like
families (``mistral.py``, ``qwen2.py``, ``qwen3.py``) subclass.

Its ``ModelArgs`` holds the config.json fields of all of them, so that each
one's config is read and checked alike; they differ in ``DecoderArgs``
overrides only. Llama itself keeps the defaults: bias on q/k/v and o as
``attention_bias`` says, no q/k norm, and no sliding window even where
config.json has a ``sliding_window`` (transformers ignores the key).
Llama 3.1's "llama3" RoPE scaling is ``layers.rope_inv_freq``'s.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from pagedlm.cache.step import StepBatch
from pagedlm.models.base import Attention, DecoderArgs, DecoderLM, KVAccess
from pagedlm.models.layers import GatedMLP, RMSNorm

MODEL_TYPES = ("llama",)


@dataclass
class ModelArgs(DecoderArgs):
    model_type: str
    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    num_attention_heads: int
    vocab_size: int
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    max_position_embeddings: int | None = None
    hidden_act: str = "silu"
    # Sliding windows: Mistral reads sliding_window, Qwen all four (their ``window``).
    sliding_window: int | None = None
    use_sliding_window: bool = False
    max_window_layers: int | None = None
    layer_types: list[str] | None = None

    def __post_init__(self) -> None:
        self.rope_theta = float(self.rope_theta)
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs, layer: int):
        super().__init__()
        self.self_attn = Attention(args, layer)
        self.mlp = GatedMLP(args.hidden_size, args.intermediate_size, args.hidden_act, args.mlp_bias)
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def forward(self, normed: torch.Tensor, x: torch.Tensor, rope_rows: tuple[torch.Tensor, torch.Tensor],
                kv: KVAccess, step: StepBatch, then: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
        """``normed``: ``input_layernorm(x)``; returns ``(then(s), s)`` for the
        stream ``s`` this block leaves (``Decoder.run_layers``)."""
        normed, h = self.post_attention_layernorm.add(self.self_attn(normed, rope_rows, kv, step), x)
        return then.add(self.mlp(normed), h)


class Model(DecoderLM):
    args_class = ModelArgs
    block_class = TransformerBlock
