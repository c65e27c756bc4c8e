"""Llama family: Llama (2, 3, 3.1), SmolLM2, Mistral, Qwen2, Qwen3.

One pre-norm decoder. The members differ in four switches, read from the
checkpoint's config.json:
  - Qwen2: bias on q/k/v (not on o);
  - Qwen3: per-head RMSNorm on q and k, head_dim given explicitly;
  - Mistral (and Qwen with ``use_sliding_window``): sliding-window layers,
    whose keys a ``RotatingKVCache`` bounds (``kv_spec``);
  - Llama 3.1: "llama3" RoPE scaling.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
import torch.nn as nn

from pagedlm.cache.spec import KVSpec
from pagedlm.cache.store import KVStore
from pagedlm.models.layers import Embedding, GatedMLP, Linear, RMSNorm, RoPE, fuse_projections, norm_rope

MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


@dataclass
class ModelArgs:
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
    sliding_window: int | None = None
    use_sliding_window: bool = False
    max_window_layers: int | None = None
    layer_types: list[str] | None = None

    @classmethod
    def from_dict(cls, config: dict) -> "ModelArgs":
        """Build from a config.json dict; unknown keys are ignored.

        Accepts both RoPE spellings: the classic ``rope_theta`` + ``rope_scaling``
        and transformers 5's ``rope_parameters`` (theta and scaling in one dict).
        """
        names = {f.name for f in fields(cls)}
        args = cls(**{k: v for k, v in config.items() if k in names})
        rope = config.get("rope_parameters")
        if rope:
            args.rope_theta = rope.get("rope_theta", args.rope_theta)
            args.rope_scaling = rope
        return args

    def __post_init__(self) -> None:
        if self.model_type not in MODEL_TYPES:
            raise ValueError(f"llama.py does not handle model_type {self.model_type!r}")
        self.rope_theta = float(self.rope_theta)
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            # Qwen3's config class defaults head_dim to 128, not hidden / heads.
            default = 128 if self.model_type == "qwen3" else None
            self.head_dim = default or self.hidden_size // self.num_attention_heads

    @property
    def qkv_bias(self) -> bool:
        return self.attention_bias or self.model_type == "qwen2"

    @property
    def o_bias(self) -> bool:
        return self.attention_bias and self.model_type != "qwen2"

    def window(self, layer: int) -> int | None:
        """Sliding-window size of ``layer``, or None for full attention.

        Mistral slides on every layer when ``sliding_window`` is set; Qwen only
        when ``use_sliding_window``, on ``layer_types`` or else on layers from
        ``max_window_layers`` up; Llama never (transformers ignores the key).
        """
        if self.sliding_window is None or self.model_type == "llama":
            return None
        if self.model_type == "mistral":
            return self.sliding_window
        if not self.use_sliding_window:
            return None
        if self.layer_types is not None:
            sliding = self.layer_types[layer] == "sliding_attention"
        else:
            sliding = layer >= (self.max_window_layers or 0)
        return self.sliding_window if sliding else None


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, layer: int):
        super().__init__()
        self.layer = layer
        self.n_heads = args.num_attention_heads
        self.n_kv_heads = args.num_key_value_heads
        self.head_dim = D = args.head_dim
        self.scale = D**-0.5
        self.qkv_heads = (self.n_heads, self.n_kv_heads, self.n_kv_heads)
        self.qkv_proj = Linear(args.hidden_size, sum(self.qkv_heads) * D, bias=args.qkv_bias)
        self.o_proj = Linear(self.n_heads * D, args.hidden_size, bias=args.o_bias)
        self.qk_norm = args.model_type == "qwen3"
        if self.qk_norm:
            self.q_norm = RMSNorm(D, args.rms_norm_eps)
            self.k_norm = RMSNorm(D, args.rms_norm_eps)

    def forward(self, x: torch.Tensor, rope_rows, kv: KVStore, step) -> torch.Tensor:
        T = x.shape[0]
        q, k, v = self.qkv_proj(x).view(T, -1, self.head_dim).split(self.qkv_heads, dim=1)
        q = norm_rope(q, rope_rows, self.q_norm if self.qk_norm else None)
        k = norm_rope(k, rope_rows, self.k_norm if self.qk_norm else None)
        kv.write(self.layer, k, v, step)
        out = kv.attend(self.layer, q, step, scale=self.scale)
        return self.o_proj(out.reshape(T, -1))


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs, layer: int):
        super().__init__()
        self.self_attn = Attention(args, layer)
        self.mlp = GatedMLP(args.hidden_size, args.intermediate_size, args.hidden_act, args.mlp_bias)
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def forward(self, x: torch.Tensor, rope_rows, kv: KVStore, step) -> torch.Tensor:
        h = x + self.self_attn(self.input_layernorm(x), rope_rows, kv, step)
        return h + self.mlp(self.post_attention_layernorm(h))


class LlamaModel(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.rope = RoPE(args.head_dim, args.rope_theta, args.rope_scaling)
        self.embed_tokens = Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(TransformerBlock(args, i) for i in range(args.num_hidden_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv: KVStore, step) -> torch.Tensor:
        h = self.embed_tokens(input_ids)
        rope_rows = self.rope.rows(positions, step.max_position, h.dtype)
        for layer in self.layers:
            h = layer(h, rope_rows, kv, step)
        return self.norm(h)


class Model(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model = LlamaModel(args)
        if not args.tie_word_embeddings:
            self.lm_head = Linear(args.hidden_size, args.vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv: KVStore, step) -> torch.Tensor:
        """Hidden states ``[T, d]`` of one flattened step (``batch.step.StepBatch``):
        ``input_ids`` and ``positions`` ``[T]``, keys and values through ``kv``."""
        return self.model(input_ids, positions, kv, step)

    def compute_logits(self, h: torch.Tensor) -> torch.Tensor:
        """Logits of the hidden states of the rows that need them."""
        if self.args.tie_word_embeddings:
            return self.model.embed_tokens.as_linear(h)
        return self.lm_head(h)

    def sanitize(self, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Drop what the module does not own (a tied lm_head, old RoPE
        buffers); fuse q/k/v and gate/up as the modules hold them."""
        return fuse_projections({
            k: v
            for k, v in weights.items()
            if not (self.args.tie_word_embeddings and k == "lm_head.weight")
            and "rotary_emb.inv_freq" not in k
        })

    def kv_spec(self) -> list[KVSpec]:
        a = self.args
        return [KVSpec(a.num_key_value_heads, a.head_dim, a.window(i)) for i in range(a.num_hidden_layers)]
