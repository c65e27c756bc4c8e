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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.unit_offset:
            return (h * (1.0 + self.weight.float())).to(x.dtype)
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


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class RoPE:
    """Rotary position embedding (the "rotate half" layout of HF checkpoints).

    A plain object, not a module: it holds no weights, so it never shows up in
    a state dict, is never cast by ``model.to(dtype)``, and one instance can be
    shared by every layer that uses the same frequencies. cos/sin tables are
    cached per (device, dtype) and grown by doubling, so a decode step only
    slices them. Each row equals what transformers computes for that position:
    ``float(pos) * inv_freq`` in float32, halves duplicated, cos/sin, cast.
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
            table = (emb.cos().to(dtype), emb.sin().to(dtype))
            self._tables[key] = table
        return table

    def __call__(self, x: torch.Tensor, offset: int) -> torch.Tensor:
        """Rotate ``x`` ``[B, H, L, D]`` as positions ``offset .. offset+L-1``."""
        L = x.shape[2]
        cos, sin = self._table(offset + L, x.device, x.dtype)
        cos, sin = cos[offset : offset + L], sin[offset : offset + L]
        return (x * cos) + (rotate_half(x) * sin)


ACTIVATIONS = {
    "silu": F.silu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


class GatedMLP(nn.Module):
    """``down(act(gate(x)) * up(x))``: SiLU for the Llama family, GELU-tanh for Gemma."""

    def __init__(self, dim: int, hidden_dim: int, activation: str, bias: bool = False):
        super().__init__()
        if activation not in ACTIVATIONS:
            raise NotImplementedError(f"activation {activation!r} is not supported")
        self.gate_proj = nn.Linear(dim, hidden_dim, bias=bias)
        self.up_proj = nn.Linear(dim, hidden_dim, bias=bias)
        self.down_proj = nn.Linear(hidden_dim, dim, bias=bias)
        self.act = ACTIVATIONS[activation]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))
