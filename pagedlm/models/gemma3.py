"""Gemma 3 text model (model_type ``gemma3_text``).

What sets it apart from the Llama family:
  - interleaved layers: most slide over a window of ``sliding_window`` keys,
    every few are global (``kv_spec``); the pattern comes
    from ``layer_types`` or, in older configs, ``sliding_window_pattern``;
  - two RoPE bases: ``rope_theta`` (1e6, plus ``rope_scaling`` if any) on global
    layers, ``rope_local_base_freq`` (1e4, unscaled) on sliding ones;
  - four RMSNorms per block and per-head RMSNorm on q and k, all of the
    ``(1 + w)``, float32 kind;
  - embeddings scaled by sqrt(hidden_size) rounded to the model dtype;
  - in float16, a float32 residual stream (``residual_dtype``);
  - attention scale ``query_pre_attn_scalar ** -0.5``; GELU-tanh MLP; tied
    embeddings; optional final logit soft-capping.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from functools import lru_cache

import torch
import torch.nn as nn

from pagedlm.cache.spec import KVSpec
from pagedlm.cache.store import KVStore
from pagedlm.models.layers import Embedding, GatedMLP, Linear, RMSNorm, RoPE, fuse_projections, norm_rope

SLIDING, FULL = "sliding_attention", "full_attention"


@dataclass
class ModelArgs:
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

    @classmethod
    def from_dict(cls, config: dict) -> "ModelArgs":
        """Build from a config.json dict; unknown keys are ignored.

        Accepts the classic ``rope_theta`` / ``rope_local_base_freq`` /
        ``rope_scaling`` keys and transformers 5's ``rope_parameters``
        (one dict per layer type).
        """
        names = {f.name for f in fields(cls)}
        args = cls(**{k: v for k, v in config.items() if k in names})
        rope = config.get("rope_parameters") or {}
        if rope.get(FULL):
            args.rope_theta = float(rope[FULL].get("rope_theta", args.rope_theta))
            args.rope_scaling = rope[FULL]
        if rope.get(SLIDING):
            args.rope_local_base_freq = float(rope[SLIDING].get("rope_theta", args.rope_local_base_freq))
            args.rope_local_scaling = rope[SLIDING]
        return args

    def __post_init__(self) -> None:
        if self.use_bidirectional_attention:
            raise NotImplementedError("Gemma 3 with use_bidirectional_attention is not supported")
        if self.layer_types is None:
            # Older configs: every sliding_window_pattern-th layer is global.
            p = self.sliding_window_pattern
            self.layer_types = [FULL if (i + 1) % p == 0 else SLIDING for i in range(self.num_hidden_layers)]
        self.rope_theta = float(self.rope_theta)
        self.rope_local_base_freq = float(self.rope_local_base_freq)


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


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, layer: int):
        super().__init__()
        self.layer = layer
        self.n_heads = args.num_attention_heads
        self.n_kv_heads = args.num_key_value_heads
        self.head_dim = D = args.head_dim
        self.scale = args.query_pre_attn_scalar**-0.5
        bias = args.attention_bias
        self.qkv_heads = (self.n_heads, self.n_kv_heads, self.n_kv_heads)
        self.qkv_proj = Linear(args.hidden_size, sum(self.qkv_heads) * D, bias=bias)
        self.o_proj = Linear(self.n_heads * D, args.hidden_size, bias=bias)
        self.q_norm = RMSNorm(D, args.rms_norm_eps, unit_offset=True)
        self.k_norm = RMSNorm(D, args.rms_norm_eps, unit_offset=True)

    def forward(self, x: torch.Tensor, rope_rows, kv: KVStore, step) -> torch.Tensor:
        T = x.shape[0]
        q, k, v = self.qkv_proj(x).view(T, -1, self.head_dim).split(self.qkv_heads, dim=1)
        q = norm_rope(q, rope_rows, self.q_norm)
        k = norm_rope(k, rope_rows, self.k_norm)
        kv.write(self.layer, k, v, step)
        out = kv.attend(self.layer, q, step, scale=self.scale)
        return self.o_proj(out.reshape(T, -1))


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

    def forward(self, x: torch.Tensor, rope_rows, kv: KVStore, step) -> torch.Tensor:
        # x, the residual stream, may be wider than the layers (``residual_dtype``):
        # the sub-layers take their dtype, the norms after them give back x's.
        dtype = self.input_layernorm.weight.dtype
        attn = self.self_attn(self.input_layernorm(x).to(dtype), rope_rows, kv, step)
        h = x + self.post_attention_layernorm(attn.to(x.dtype))
        mlp = self.mlp(self.pre_feedforward_layernorm(h).to(dtype))
        return h + self.post_feedforward_layernorm(mlp.to(h.dtype))


class Gemma3Model(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.ropes = {
            SLIDING: RoPE(args.head_dim, args.rope_local_base_freq, args.rope_local_scaling),
            FULL: RoPE(args.head_dim, args.rope_theta, args.rope_scaling),
        }
        self.embed_tokens = Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(TransformerBlock(args, i) for i in range(args.num_hidden_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps, unit_offset=True)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv: KVStore, step) -> torch.Tensor:
        h = self.embed_tokens(input_ids)
        dtype = h.dtype
        h = (h * _embed_scale(self.args.hidden_size, dtype)).to(residual_dtype(dtype))
        rope_rows = {t: rope.rows(positions, step.max_position, dtype) for t, rope in self.ropes.items()}
        for layer in self.layers:
            h = layer(h, rope_rows[layer.layer_type], kv, step)
        return self.norm(h).to(dtype)


class Model(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model = Gemma3Model(args)
        if not args.tie_word_embeddings:
            self.lm_head = Linear(args.hidden_size, args.vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv: KVStore, step) -> torch.Tensor:
        """Hidden states ``[T, d]`` of one flattened step (``batch.step.StepBatch``):
        ``input_ids`` and ``positions`` ``[T]``, keys and values through ``kv``."""
        return self.model(input_ids, positions, kv, step)

    def compute_logits(self, h: torch.Tensor) -> torch.Tensor:
        """Logits of the hidden states of the rows that need them (a prefill
        needs only its last: the 262k-wide head is the biggest matmul)."""
        if self.args.tie_word_embeddings:
            logits = self.model.embed_tokens.as_linear(h)
        else:
            logits = self.lm_head(h)
        cap = self.args.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def sanitize(self, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Drop what the module does not own (a tied lm_head, old RoPE
        buffers); fuse q/k/v and gate/up as the modules hold them."""
        return fuse_projections({
            k: v
            for k, v in weights.items()
            if not (self.args.tie_word_embeddings and k == "lm_head.weight")
            and "rotary_emb" not in k
        })

    def kv_spec(self) -> list[KVSpec]:
        a = self.args
        return [
            KVSpec(a.num_key_value_heads, a.head_dim, a.sliding_window if t == SLIDING else None)
            for t in a.layer_types
        ]
