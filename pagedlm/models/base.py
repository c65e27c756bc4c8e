"""What a model is to the engine (``CausalLM``), and the decoder every family here shares.

The engine, the store and the loaders see a model only as a ``CausalLM``:
``model(input_ids, positions, kv, step)`` gives the hidden states ``[T, d]``
of one flattened step (``StepBatch``), ``compute_logits`` turns the rows
that sample into logits, ``kv_spec`` says what each layer stores,
``sanitize`` maps a checkpoint's tensors onto the modules, ``args`` is the
config. Keys and values go through ``kv`` (``KVAccess``, which the engine's
``cache.store.KVStore`` is), so a model imports nothing from the cache but
the vocabulary it shares with it (``StepBatch``, ``KVSpec``).

The skeleton, ``DecoderLM``: a ``Decoder`` under the checkpoint's ``model.``
prefix (``embed_tokens -> layers -> norm``, one RoPE), then ``lm_head`` or
the tied embedding. Its blocks attend through ``Attention``; what it reads
of config.json, and the few things a family may change, are ``DecoderArgs``.

A new family is one file in this package (``models/__init__`` finds it) that
writes, as ``qwen2.py`` does:
  - ``MODEL_TYPES``: the config.json ``model_type`` values it serves;
  - ``ModelArgs``: a dataclass of the config.json fields it reads, with
    transformers' defaults (a Llama-like family subclasses
    ``llama.ModelArgs``), overriding what differs: ``window(layer)``,
    ``qkv_bias`` / ``o_bias``, ``qk_norm``, ``unit_offset_norms``,
    ``attention_scale``, ``read_rope_parameters``;
  - ``Model``: a ``DecoderLM`` naming its ``args_class`` and ``block_class``
    (a Llama-like family subclasses ``llama.Model``), and its
    ``decoder_class`` or ``compute_logits`` if those differ (``gemma3.py``);
and a test against transformers on a tiny random config
(``tests/fast/test_models_vs_hf.py``).
"""

from __future__ import annotations

from dataclasses import fields
from typing import TYPE_CHECKING, Callable, ClassVar, Protocol, TypeVar

import torch
import torch.nn as nn

from pagedlm.cache.spec import KVSpec
from pagedlm.cache.step import StepBatch
from pagedlm.models.layers import Embedding, Linear, RMSNorm, RoPE, fuse_projections, qk_norm_rope

if TYPE_CHECKING:
    from pagedlm.kernels.paged_attention import KVTarget


class KVAccess(Protocol):
    """Where attention layers put a step's keys and values and attend over
    everything stored for their rows (``cache.store.KVStore``)."""

    def write(self, layer: int, keys: torch.Tensor, values: torch.Tensor, step: StepBatch) -> None:
        """``keys`` and ``values`` ``[T, KV, D]``: the step's new tokens."""

    def write_target(self, layer: int, step: StepBatch) -> "KVTarget | None":
        """Where the kernel that makes the layer's keys may store them and
        the values itself (``kernels.fused.qk_norm_rope``), or None: `write` them."""

    def attend(self, layer: int, q: torch.Tensor, step: StepBatch, *, scale: float) -> torch.Tensor:
        """``q`` ``[T, H, D]`` -> ``[T, H, D]``, causal over each row's keys (and its window)."""


A = TypeVar("A", bound="DecoderArgs")


class DecoderArgs:
    """The config a ``DecoderLM`` reads, and the family's choices.

    A family's ``ModelArgs`` dataclass declares the fields below with
    config.json's names (plus its own); it is built by ``from_dict``. The
    class attributes and methods are the Llama defaults a family overrides.
    """

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    attention_bias: bool
    tie_word_embeddings: bool
    max_position_embeddings: int | None

    qk_norm: ClassVar[bool] = False  # a per-head RMSNorm on q and k (Qwen3, Gemma 3)
    unit_offset_norms: ClassVar[bool] = False  # RMSNorms scale by 1 + w (Gemma; ``layers.RMSNorm``)

    @classmethod
    def from_dict(cls: type[A], config: dict) -> A:
        """Build from a config.json dict; unknown keys are ignored. transformers 5
        spells RoPE as ``rope_parameters``, which ``read_rope_parameters`` reads."""
        names = {f.name for f in fields(cls)}
        args = cls(**{k: v for k, v in config.items() if k in names})
        rope = config.get("rope_parameters")
        if rope:
            args.read_rope_parameters(rope)
        return args

    def read_rope_parameters(self, rope: dict) -> None:
        """transformers 5's ``rope_parameters``: theta and scaling in one dict,
        in place of the classic ``rope_theta`` + ``rope_scaling``."""
        self.rope_theta = rope.get("rope_theta", self.rope_theta)
        self.rope_scaling = rope

    @property
    def qkv_bias(self) -> bool:
        return self.attention_bias

    @property
    def o_bias(self) -> bool:
        return self.attention_bias

    @property
    def attention_scale(self) -> float:
        return self.head_dim**-0.5

    def window(self, layer: int) -> int | None:
        """Sliding-window size of ``layer``, or None for full attention."""
        return None


class Attention(nn.Module):
    """One layer's self-attention: fused q/k/v, the per-head norm of q and k
    (if ``qk_norm``) fused with RoPE and, on CUDA over pools the kernels
    read, with the store's write; the store's attend, o_proj."""

    def __init__(self, args: DecoderArgs, layer: int):
        super().__init__()
        self.layer = layer
        self.n_heads = args.num_attention_heads
        self.n_kv_heads = args.num_key_value_heads
        self.head_dim = D = args.head_dim
        self.scale = args.attention_scale
        self.qkv_heads = (self.n_heads, self.n_kv_heads, self.n_kv_heads)
        self.qkv_proj = Linear(args.hidden_size, sum(self.qkv_heads) * D, bias=args.qkv_bias)
        self.o_proj = Linear(self.n_heads * D, args.hidden_size, bias=args.o_bias)
        self.q_norm = self.k_norm = None
        if args.qk_norm:
            self.q_norm = RMSNorm(D, args.rms_norm_eps, unit_offset=args.unit_offset_norms)
            self.k_norm = RMSNorm(D, args.rms_norm_eps, unit_offset=args.unit_offset_norms)

    def forward(self, x: torch.Tensor, rope_rows: tuple[torch.Tensor, torch.Tensor], kv: KVAccess,
                step: StepBatch) -> torch.Tensor:
        T = x.shape[0]
        qk, v = self.qkv_proj(x).view(T, -1, self.head_dim).split((self.n_heads + self.n_kv_heads, self.n_kv_heads), 1)
        q, k = qk_norm_rope(qk, self.n_heads, rope_rows, self.q_norm, self.k_norm, v, kv.write_target(self.layer, step))
        if k is not None:  # (else the kernel stored the keys and values)
            kv.write(self.layer, k, v, step)
        out = kv.attend(self.layer, q, step, scale=self.scale)
        return self.o_proj(out.reshape(T, -1))


class Decoder(nn.Module):
    """``embed_tokens -> layers -> norm``, every layer rotated by one RoPE:
    what a checkpoint keeps under ``model.``."""

    def __init__(self, args: DecoderArgs, block: Callable[[DecoderArgs, int], nn.Module]):
        super().__init__()
        self.rope = RoPE(args.head_dim, args.rope_theta, args.rope_scaling)
        self.embed_tokens = Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(block(args, i) for i in range(args.num_hidden_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps, unit_offset=args.unit_offset_norms)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv: KVAccess, step: StepBatch) -> torch.Tensor:
        h = self.embed_tokens(input_ids)
        rope_rows = self.rope.rows(positions, step.max_position, h.dtype)
        return self.run_layers(h, lambda layer: rope_rows, kv, step)

    def run_layers(self, h: torch.Tensor, rope_rows: Callable[[nn.Module], tuple[torch.Tensor, torch.Tensor]],
                   kv: KVAccess, step: StepBatch) -> torch.Tensor:
        """The blocks over the residual stream ``h``, then the final norm.
        A block takes its input already normed and the stream, and returns
        the next block's normed input (its ``then``, the next block's
        ``input_layernorm`` or the final norm) with the new stream: the
        residual add that ends a block and the norm that starts the next
        are one kernel on CUDA (``RMSNorm.add``; Gemma's ``RMSNorm.norm_add``
        with ``then``), the same bits as the two."""
        layers = list(self.layers)
        normed = layers[0].input_layernorm(h) if layers else self.norm(h)
        for layer, then in zip(layers, [*(layer.input_layernorm for layer in layers[1:]), self.norm]):
            normed, h = layer(normed, h, rope_rows(layer), kv, step, then)
        return normed


class CausalLM(Protocol):
    """A model as the engine, the store and the loaders use it (an ``nn.Module``,
    called as ``model(input_ids, positions, kv, step)``)."""

    args: DecoderArgs

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv: KVAccess, step: StepBatch) -> torch.Tensor:
        """Hidden states ``[T, d]`` of one flattened step: ``input_ids`` and
        ``positions`` ``[T]``, keys and values through ``kv``."""

    def compute_logits(self, h: torch.Tensor) -> torch.Tensor:
        """Logits ``[S, vocab]`` of the hidden states ``[S, d]`` of the rows that need them."""

    def kv_spec(self) -> list[KVSpec]:
        """What each attention layer stores, layer by layer."""

    def sanitize(self, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A checkpoint's tensors (transformers' names) as the modules hold them."""


class DecoderLM(nn.Module):
    """The ``CausalLM`` of every family here: its ``decoder_class`` of
    ``block_class`` layers under ``model.``, then the output head: ``lm_head``,
    or the embedding itself when ``tie_word_embeddings``."""

    args_class: ClassVar[type[DecoderArgs]]
    block_class: ClassVar[Callable[[DecoderArgs, int], nn.Module]]
    decoder_class: ClassVar[type[Decoder]] = Decoder

    def __init__(self, args: DecoderArgs):
        super().__init__()
        self.args = args
        self.model = self.decoder_class(args, self.block_class)
        if not args.tie_word_embeddings:
            self.lm_head = Linear(args.hidden_size, args.vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv: KVAccess, step: StepBatch) -> torch.Tensor:
        return self.model(input_ids, positions, kv, step)

    def compute_logits(self, h: torch.Tensor) -> torch.Tensor:
        """Logits of the hidden states of the rows that need them (a prefill
        needs only its last: the output head is the biggest matmul)."""
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
            and "rotary_emb" not in k
        })

    def kv_spec(self) -> list[KVSpec]:
        a = self.args
        return [KVSpec(a.num_key_value_heads, a.head_dim, a.window(i)) for i in range(a.num_hidden_layers)]
