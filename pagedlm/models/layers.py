"""Building blocks the model files share: RMSNorm, rotary embedding, gated MLP.

The numerics follow Hugging Face transformers op for op (same float32 upcasts,
same order of operations, same casts back), so that float32 logits agree with
the test oracle to rounding noise and a divergence means a real bug.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from pagedlm.kernels import cpu, fused, gemv
from pagedlm.kernels.quant import QuantizedWeight


class RMSNorm(nn.Module):
    """RMS normalisation over the last dimension, computed in float32.

    ``unit_offset=False`` (Llama family): ``w * norm(x).to(dtype)``.
    ``unit_offset=True`` (Gemma): the checkpoint stores ``w`` but the scale is
    ``1 + w``, and the product is taken in float32 before the cast back.
    """

    def __init__(self, dim: int, eps: float = 1e-6, unit_offset: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim) if unit_offset else torch.ones(dim))
        self.eps = eps
        self.unit_offset = unit_offset
        # Python scalars cost a conversion per op (~5 us at batch 1, over a
        # hundred norms a step); 0-dim float32 CPU tensors act as the same
        # scalars on any device. mean() is sum().div_(n) inside torch.
        self._n, self._eps, self._one = (torch.tensor(v, dtype=torch.float32, device="cpu") for v in (dim, eps, 1.0))

    def add(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``s = x + residual`` and this norm of it: (the norm, ``s``); one
        kernel on CUDA (``kernels.fused.rms_norm`` with a residual, the same bits)."""
        if fused.enabled(x):
            return fused.rms_norm(x, self.weight, self.eps, self.unit_offset, residual)
        s = x + residual
        return self(s), s

    def norm_add(self, y: torch.Tensor, residual: torch.Tensor,
                 then: "RMSNorm | None" = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """``s = residual + self(y)`` (Gemma's norm after a sub-layer), and
        with ``then``, its norm of ``s``: ``(then(s), s)``; one kernel on CUDA
        (the same bits)."""
        if then is not None and (then.eps, then.unit_offset) != (self.eps, self.unit_offset):
            raise ValueError("norm_add: the two norms must share eps and offset")
        if fused.enabled(y):
            return fused.rms_norm(y, None if then is None else then.weight, self.eps, self.unit_offset, residual,
                                  pre_weight=self.weight)
        s = residual + self(y)
        return s if then is None else (then(s), s)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if fused.enabled(x):
            return fused.rms_norm(x, self.weight, self.eps, self.unit_offset)
        h = x.float()
        h = h * h.pow(2).sum(-1, keepdim=True).div_(self._n).add_(self._eps).rsqrt_()
        if self.unit_offset:
            return (h * (self.weight.float() + self._one)).to(x.dtype)
        return self.weight * h.to(x.dtype)


def rope_inv_freq(head_dim: int, base: float, scaling: dict | None = None) -> torch.Tensor:
    """Inverse frequencies in float32, as transformers computes them.

    ``scaling`` is a Hugging Face ``rope_scaling`` dict: ``None`` / "default",
    "linear" (divide by ``factor``) or "llama3" (Llama 3.1's band-wise scaling).
    """
    # device="cpu" so that building a model under `with torch.device("meta")`
    # still gets real frequencies.
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv_freq = 1.0 / (base**exponent)
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_context = scaling["original_max_position_embeddings"]
        low_freq_wavelen = old_context / low
        high_freq_wavelen = old_context / high
        wavelen = 2 * math.pi / inv_freq
        # Long wavelengths are divided by factor, short ones kept, the band
        # between them interpolated smoothly.
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_context / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
        return torch.where(is_medium, smoothed, scaled)
    raise NotImplementedError(f"rope_scaling type {kind!r} is not supported")


class RoPE:
    """Rotary position embedding (the "rotate half" layout of HF checkpoints).

    A plain object, not a module: it holds no weights, so it never shows up in
    a state dict, is never cast by ``model.to(dtype)``, and one instance can be
    shared by every layer that uses the same frequencies. The cos/sin table
    per (device, dtype) only grows (by doubling); a step looks its positions
    up once (``rows``) and every layer of that step only multiplies
    (``apply_rope``). Each row equals what transformers computes for that
    position: ``float(pos) * inv_freq`` in float32, halves duplicated,
    cos/sin, cast.

    transformers rotates as ``x * cos + rotate_half(x) * sin`` with
    ``rotate_half(x) = cat(-x2, x1)``. Here the minus sign lives in the sin
    table instead (``sin`` with its first half negated) and ``x`` is rolled by
    half: the products are the same numbers, exactly, in two fewer ops.
    """

    def __init__(self, head_dim: int, base: float, scaling: dict | None = None):
        self.head_dim = head_dim
        self.inv_freq = rope_inv_freq(head_dim, base, scaling)
        self._tables: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    def _table(self, n: int, device: torch.device, dtype: torch.dtype):
        key = (device, dtype)
        table = self._tables.get(key)
        if table is None or table[0].shape[0] < n:
            size = max(n, 1024, 2 * table[0].shape[0] if table is not None else 0)
            inv_freq = self.inv_freq.to(device)
            positions = torch.arange(size, device=device).float()
            freqs = positions[:, None] * inv_freq
            emb = torch.cat((freqs, freqs), dim=-1)
            sin = emb.sin()
            signed_sin = torch.cat((-sin[:, : self.head_dim // 2], sin[:, self.head_dim // 2 :]), dim=-1)
            table = (emb.cos().to(dtype), signed_sin.to(dtype))
            self._tables[key] = table  # one assignment: a reader sees the old or the new table
        return table

    def rows(self, positions: torch.Tensor, max_position: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin for ``positions`` ``[T]``, as ``[T, 1, D]``;
        ``max_position`` (a host int) bounds them, so that no device value is read."""
        cos, sin = self._table(max_position + 1, positions.device, dtype)
        return cos[positions][:, None], sin[positions][:, None]


def apply_rope(x: torch.Tensor, rows: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Rotate ``x`` ``[T, H, D]`` by the rows ``RoPE.rows`` looked up for its tokens."""
    cos, sin = rows
    return (x * cos) + (x.roll(x.shape[-1] // 2, dims=-1) * sin)


def qk_norm_rope(qk: torch.Tensor, num_q: int, rows: tuple[torch.Tensor, torch.Tensor],
                 q_norm: "RMSNorm | None" = None, k_norm: "RMSNorm | None" = None, v: torch.Tensor | None = None,
                 target=None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``apply_rope(norm(x), rows)`` of q and k (the per-head norms of Qwen3
    and Gemma 3, or none), whose heads ``qk`` ``[T, Hq + Hkv, D]`` holds in
    that order (``num_q`` of q): one kernel for both on CUDA
    (``kernels.fused``), the ops above elsewhere. With a ``target``
    (``KVAccess.write_target``) that kernel also stores k and the values
    ``v`` in the pools, and k is None; elsewhere the caller writes them."""
    if fused.enabled(qk):
        norms = () if q_norm is None else (q_norm.weight, k_norm.weight, q_norm.eps, q_norm.unit_offset)
        return fused.qk_norm_rope(qk, num_q, *rows, *norms, v=v, target=target)
    q, k = qk[:, :num_q], qk[:, num_q:]
    if q_norm is not None:
        q, k = q_norm(q), k_norm(k)
    return apply_rope(q, rows), apply_rope(k, rows)


def _lay_out_for_device(param: nn.Parameter) -> None:
    """K-major (``[in, out]`` in memory) for float32 on the CPU, else row-major.

    Batch-1 decode is one matrix-vector product per weight and is bound by
    memory bandwidth. With MKL, ``x @ W.T`` over a row-major ``W`` (a "T"
    GEMV) streams ~11 GB/s on one core here, the K-major ("N") GEMV ~20 GB/s:
    the lm_head of Gemma 3 (262144 x 640) takes 33 ms instead of 60. The
    parameter keeps the checkpoint's shape ``[out, in]``, so state dicts and
    every caller are unchanged; only its strides differ. Other dtypes and
    devices keep the checkpoint's layout: on the CPU, bfloat16 GEMMs over a
    K-major weight round differently from transformers' in the last bit.
    Changing ``.data`` keeps the Parameter object, so ties hold.
    """
    if param is None:  # quantized: the weight lives in ``quant``
        return
    w = param.data
    if w.dim() != 2 or w.is_meta:
        return
    if w.device.type == "cpu" and w.dtype == torch.float32:
        if w.stride() != (1, w.shape[0]):
            param.data = w.t().contiguous().t()
    elif not w.is_contiguous():
        param.data = w.contiguous()


class _DeviceLayout:
    """Mixin: lay the weight out for its device when built and on every move.

    ``load_state_dict`` copies into the laid-out weight, but with
    ``assign=True`` it installs the checkpoint's tensor as is: the
    ``model.to(device, dtype)`` that follows (``loading.hf.load_model``)
    lays it out again.
    """

    weight: nn.Parameter

    def _init_layout(self) -> None:
        _lay_out_for_device(self.weight)

    def _apply(self, fn, recurse=True):  # .to(), .cuda(), .float(), ...
        super()._apply(fn, recurse)
        _lay_out_for_device(self.weight)
        return self


class _Quantizable:
    """Mixin: the weight may be replaced by a ``QuantizedWeight`` (``quantize``),
    after which the module has no float ``weight`` and its products and
    lookups read the quantized bytes."""

    def set_quantized(self, quant: QuantizedWeight, dtype: torch.dtype) -> None:
        """``dtype``: the model's activations (what an embedding lookup returns)."""
        if tuple(quant.shape) != (self.weight.shape[0], self.weight.shape[1]):
            raise ValueError(f"quantized weight {quant.shape} does not fit {tuple(self.weight.shape)}")
        self.quant = quant  # a submodule: it shows in the model's repr and buffers
        self.quant_dtype = dtype
        self.weight = None  # nn.Module keeps the name registered, with no tensor


class Linear(_DeviceLayout, _Quantizable, nn.Linear):
    """``nn.Linear`` whose weight is K-major on the CPU (``_lay_out_for_device``),
    or quantized (``set_quantized``)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__(in_features, out_features, bias=bias)
        self.quant: QuantizedWeight | None = None
        self._init_layout()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quant is not None:
            return self.quant.linear(x, self.bias)
        if gemv.usable(x, self.weight):
            return gemv.linear(x, self.weight, self.bias)
        return cpu.linear(x, self.weight, self.bias)


class Embedding(_DeviceLayout, _Quantizable, nn.Embedding):
    """``nn.Embedding`` that doubles as a tied output head (``as_linear``).

    Its ``[vocab, dim]`` table is K-major on the CPU too: the head's GEMV is
    the biggest read of a decode step, while a lookup only gathers a few
    strided columns (2 ms for a 512-token prompt of Gemma 3).
    """

    def __init__(self, num_embeddings: int, embedding_dim: int):
        super().__init__(num_embeddings, embedding_dim)
        self.quant: QuantizedWeight | None = None
        self._init_layout()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.quant is not None:  # dequantize only the looked-up rows
            return self.quant.rows(input_ids, self.quant_dtype)
        return super().forward(input_ids)

    def as_linear(self, x: torch.Tensor) -> torch.Tensor:
        if self.quant is not None:
            return self.quant.linear(x)
        if gemv.usable(x, self.weight):
            return gemv.linear(x, self.weight)
        return cpu.linear(x, self.weight)


FUSED_PROJECTIONS = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}


def projection_parts(name: str) -> list[str]:
    """The HF tensor names a tensor of a fused module was made from (``[name]`` if none)."""
    for fused, parts in FUSED_PROJECTIONS.items():
        if f".{fused}." in name:
            prefix, suffix = name.split(f".{fused}.")
            return [f"{prefix}.{part}.{suffix}" for part in parts]
    return [name]


def fuse_projections(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Concatenate HF's q/k/v and gate/up tensors (weights and biases) along
    the output dimension, under the fused modules' names.

    One bigger GEMV instead of three or two: decode on the CPU pays a fixed
    cost per GEMV (a call, a cold start on each weight), which fusing saves.
    Each output column is still computed from its own row of weights.
    """
    out = dict(weights)
    for fused, parts in FUSED_PROJECTIONS.items():
        for key in weights:
            if f".{parts[0]}." in key:
                fused_key = key.replace(f".{parts[0]}.", f".{fused}.")
                out[fused_key] = torch.cat([out.pop(name) for name in projection_parts(fused_key)])
    return out


ACTIVATIONS = {
    "silu": F.silu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


class GatedMLP(nn.Module):
    """``down(act(gate(x)) * up(x))``: SiLU for the Llama family, GELU-tanh for Gemma.

    gate and up are one fused ``gate_up_proj`` (see ``fuse_projections``)."""

    def __init__(self, dim: int, hidden_dim: int, activation: str, bias: bool = False):
        super().__init__()
        if activation not in ACTIVATIONS:
            raise NotImplementedError(f"activation {activation!r} is not supported")
        self.gate_up_proj = Linear(dim, 2 * hidden_dim, bias=bias)
        self.down_proj = Linear(hidden_dim, dim, bias=bias)
        self.activation = activation  # an ACTIVATIONS name: the fused kernel takes it too

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if gemv.usable(x, self.gate_up_proj.weight):  # few rows on CUDA: the activation inside the product
            return self.down_proj(gemv.linear(x, self.gate_up_proj.weight, self.gate_up_proj.bias, self.activation))
        gate_up = self.gate_up_proj(x)
        if fused.enabled(gate_up) and gate_up.dim() == 2:
            return self.down_proj(fused.act_mul(gate_up, self.activation))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(ACTIVATIONS[self.activation](gate) * up)
