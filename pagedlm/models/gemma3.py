"""Gemma 3 text model (model_type ``gemma3_text``).

What sets it apart from the Llama family, each an override of the skeleton
(``models.base``):
  - interleaved layers: most slide over a window of ``sliding_window`` keys,
    every few are global (``ModelArgs.window``); the pattern comes
    from ``layer_types`` or, in older configs, ``sliding_window_pattern``;
  - two RoPE bases: ``rope_theta`` (1e6, plus ``rope_scaling`` if any) on global
    layers, ``rope_local_base_freq`` (1e4, unscaled) on sliding ones
    (``Gemma3Model``);
  - four RMSNorms per block (``TransformerBlock``) and per-head RMSNorm on
    q and k, all of the ``(1 + w)``, float32 kind;
  - embeddings scaled by sqrt(hidden_size) rounded to the model dtype;
  - in float16, a float32 residual stream (``residual_dtype``);
  - attention scale ``query_pre_attn_scalar ** -0.5``; GELU-tanh MLP; tied
    embeddings; optional final logit soft-capping (``Model.compute_logits``).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch
import torch.nn as nn

from pagedlm.cache.step import StepBatch
from pagedlm.models.base import Attention, Decoder, DecoderArgs, DecoderLM, KVAccess
from pagedlm.models.layers import GatedMLP, RMSNorm, RoPE

MODEL_TYPES = ("gemma3_text",)
SLIDING, FULL = "sliding_attention", "full_attention"


@dataclass
class ModelArgs(DecoderArgs):
    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    model_type: str = "gemma3_text"
    # Defaults below are transformers' Gemma3TextConfig defaults.
    head_dim: int = 256
    rms_norm_eps: float = 1e-6
    query_pre_attn_scalar: float = 256
    sliding_window: int = 4096
    sliding_window_pattern: int = 6
    layer_types: list[str] | None = None
    rope_theta: float = 1_000_000.0
    rope_scaling: dict | None = None  # global layers only
    rope_local_base_freq: float = 10_000.0
    rope_local_scaling: dict | None = None  # only via transformers 5's rope_parameters
    hidden_activation: str = "gelu_pytorch_tanh"
    final_logit_softcapping: float | None = None
    # transformers' Gemma 3 never applies it (it is not passed to attention),
    # and released checkpoints set it to null; read, and ignored likewise.
    attn_logit_softcapping: float | None = None
    attention_bias: bool = False
    use_bidirectional_attention: bool = False
    tie_word_embeddings: bool = True
    max_position_embeddings: int | None = None

    qk_norm = True
    unit_offset_norms = True

    def __post_init__(self) -> None:
        if self.use_bidirectional_attention:
            raise NotImplementedError("Gemma 3 with use_bidirectional_attention is not supported")
        if self.layer_types is None:
            # Older configs: every sliding_window_pattern-th layer is global.
            p = self.sliding_window_pattern
            self.layer_types = [FULL if (i + 1) % p == 0 else SLIDING for i in range(self.num_hidden_layers)]
        self.rope_theta = float(self.rope_theta)
        self.rope_local_base_freq = float(self.rope_local_base_freq)

    def read_rope_parameters(self, rope: dict) -> None:
        """transformers 5's ``rope_parameters``: one dict per layer type."""
        if rope.get(FULL):
            self.rope_theta = float(rope[FULL].get("rope_theta", self.rope_theta))
            self.rope_scaling = rope[FULL]
        if rope.get(SLIDING):
            self.rope_local_base_freq = float(rope[SLIDING].get("rope_theta", self.rope_local_base_freq))
            self.rope_local_scaling = rope[SLIDING]

    @property
    def attention_scale(self) -> float:
        return self.query_pre_attn_scalar**-0.5

    def window(self, layer: int) -> int | None:
        return self.sliding_window if self.layer_types[layer] == SLIDING else None


@lru_cache
def _embed_scale(hidden_size: int, dtype: torch.dtype) -> float:
    """sqrt(hidden_size) rounded as transformers rounds it: to float32, then to
    the model dtype (bfloat16 turns sqrt(640) = 25.298 into 25.25)."""
    return torch.tensor(hidden_size**0.5).to(dtype).item()


def residual_dtype(dtype: torch.dtype) -> torch.dtype:
    """The residual stream's dtype for a model in ``dtype``: float32 for
    float16, whose range (65504) Gemma's residual outgrows (1.04e5 in Gemma 3
    270M's middle layers on a six-token prompt: inf, then NaN logits); the
    layers still compute in float16, on inputs the norms bring back to size.
    transformers keeps it in float16, and overflows likewise."""
    return torch.float32 if dtype == torch.float16 else dtype


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs, layer: int):
        super().__init__()
        dim, eps = args.hidden_size, args.rms_norm_eps
        self.layer_type = args.layer_types[layer]
        self.self_attn = Attention(args, layer)
        self.mlp = GatedMLP(dim, args.intermediate_size, args.hidden_activation)
        self.input_layernorm = RMSNorm(dim, eps, unit_offset=True)
        self.post_attention_layernorm = RMSNorm(dim, eps, unit_offset=True)
        self.pre_feedforward_layernorm = RMSNorm(dim, eps, unit_offset=True)
        self.post_feedforward_layernorm = RMSNorm(dim, eps, unit_offset=True)

    def forward(self, normed: torch.Tensor, x: torch.Tensor, rope_rows: tuple[torch.Tensor, torch.Tensor],
                kv: KVAccess, step: StepBatch, then: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
        """``normed``: ``input_layernorm(x)``; returns ``(then(s), s)`` for the
        stream ``s`` this block leaves (``Decoder.run_layers``)."""
        # x, the residual stream, may be wider than the layers (``residual_dtype``):
        # the sub-layers take their dtype, the norms after them give back x's.
        dtype = self.input_layernorm.weight.dtype
        attn = self.self_attn(normed.to(dtype), rope_rows, kv, step)
        normed, h = self.post_attention_layernorm.norm_add(attn.to(x.dtype), x, then=self.pre_feedforward_layernorm)
        mlp = self.mlp(normed.to(dtype))
        return self.post_feedforward_layernorm.norm_add(mlp.to(h.dtype), h, then=then)


class Gemma3Model(Decoder):
    """The decoder with Gemma's scaled embeddings, its residual dtype, and the
    sliding layers' own RoPE (``self.rope`` rotates the global ones)."""

    def __init__(self, args: ModelArgs, block):
        super().__init__(args, block)
        self.hidden_size = args.hidden_size
        self.ropes = {
            SLIDING: RoPE(args.head_dim, args.rope_local_base_freq, args.rope_local_scaling),
            FULL: self.rope,
        }

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv: KVAccess, step: StepBatch) -> torch.Tensor:
        h = self.embed_tokens(input_ids)
        dtype = h.dtype
        h = (h * _embed_scale(self.hidden_size, dtype)).to(residual_dtype(dtype))
        rope_rows = {t: rope.rows(positions, step.max_position, dtype) for t, rope in self.ropes.items()}
        return self.run_layers(h, lambda layer: rope_rows[layer.layer_type], kv, step).to(dtype)


class Model(DecoderLM):
    args_class = ModelArgs
    block_class = TransformerBlock
    decoder_class = Gemma3Model

    def compute_logits(self, h: torch.Tensor) -> torch.Tensor:
        """The head's logits, soft-capped by ``final_logit_softcapping``."""
        logits = super().compute_logits(h)
        cap = self.args.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits
