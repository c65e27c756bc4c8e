"""Fused elementwise kernels for CUDA (Triton): RMSNorm, RMSNorm + RoPE, gated activation.

A decode step of a small model is a chain of tiny kernels; under a CUDA
graph the launches are free but every kernel still costs its few
microseconds of start and drain. In torch, one RMSNorm is eight kernels
(cast, square, sum, divide, add, rsqrt, multiply, cast) and one RoPE four:
Qwen3-0.6B's 28 layers ran some 1,500 kernels a token. Here each is one.

Each kernel rounds where the torch ops it replaces round (``models.layers``
keeps those ops, and the CPU runs them): products and sums of bf16/fp16
values are taken in float32 and rounded to the input dtype at the same
points, so a fused layer differs from the torch one only where float32
reductions add in another order (the norm's sum of squares).

``enabled(x)`` says whether the layers use them: CUDA tensors with triton
installed (a check on every norm of an eager step, so it reads two
attributes and nothing more). The tests call them directly on the CPU
under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import torch

from pagedlm.kernels.paged_attention import triton

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _round(x, DTYPE: tl.constexpr):
        """Round float32 ``x`` to the model dtype and back (what a torch op on
        that dtype stores)."""
        return x.to(DTYPE).to(tl.float32)

    @triton.jit
    def _rms_norm_kernel(X, W, Out, stride_x, stride_o, n, eps,
                         UNIT_OFFSET: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        offs = tl.arange(0, BLOCK)
        m = offs < n
        x = tl.load(X + row * stride_x + offs, mask=m, other=0.0).to(tl.float32)
        w = tl.load(W + offs, mask=m, other=0.0).to(tl.float32)
        h = x * tl.math.rsqrt(tl.math.div_rn(tl.sum(x * x, 0), n * 1.0) + eps)
        if UNIT_OFFSET:  # Gemma: (h * (1 + w)) in float32, then the cast
            y = h * (w + 1.0)
        else:  # Llama: w * h.to(dtype), a product of two rounded values
            y = w * _round(h, Out.dtype.element_ty)
        tl.store(Out + row * stride_o + offs, y.to(Out.dtype.element_ty), mask=m)

    @triton.jit
    def _norm_rope_kernel(X, W, Cos, Sin, Out, stride_xt, stride_xh, stride_ct, stride_ot, stride_oh,
                          eps, NORM: tl.constexpr, UNIT_OFFSET: tl.constexpr, D: tl.constexpr):
        t = tl.program_id(0)
        h = tl.program_id(1)
        d = tl.arange(0, D)
        rolled = (d + D // 2) % D  # x.roll(D // 2)[d] = x[d - D/2] = x[(d + D/2) % D]
        base = X + t * stride_xt + h * stride_xh
        x = tl.load(base + d).to(tl.float32)
        xr = tl.load(base + rolled).to(tl.float32)
        if NORM:
            scale = tl.math.rsqrt(tl.math.div_rn(tl.sum(x * x, 0), D * 1.0) + eps)
            w = tl.load(W + d).to(tl.float32)
            wr = tl.load(W + rolled).to(tl.float32)
            if UNIT_OFFSET:
                x = _round(x * scale * (w + 1.0), Out.dtype.element_ty)
                xr = _round(xr * scale * (wr + 1.0), Out.dtype.element_ty)
            else:
                x = _round(w * _round(x * scale, Out.dtype.element_ty), Out.dtype.element_ty)
                xr = _round(wr * _round(xr * scale, Out.dtype.element_ty), Out.dtype.element_ty)
        cos = tl.load(Cos + t * stride_ct + d).to(tl.float32)
        sin = tl.load(Sin + t * stride_ct + d).to(tl.float32)
        y = _round(x * cos, Out.dtype.element_ty) + _round(xr * sin, Out.dtype.element_ty)
        tl.store(Out + t * stride_ot + h * stride_oh + d, y.to(Out.dtype.element_ty))

    @triton.jit
    def _tanh(x):
        return 2.0 / (1.0 + tl.exp(-2.0 * x)) - 1.0

    @triton.jit
    def _act_mul_kernel(X, Out, stride_x, stride_o, n, GELU: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = offs < n
        gate = tl.load(X + row * stride_x + offs, mask=m, other=0.0).to(tl.float32)
        up = tl.load(X + row * stride_x + n + offs, mask=m, other=0.0).to(tl.float32)
        if GELU:  # gelu(approximate="tanh")
            act = 0.5 * gate * (1.0 + _tanh(0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)))
        else:  # silu
            act = gate / (1.0 + tl.exp(-gate))
        y = _round(act, Out.dtype.element_ty) * up
        tl.store(Out + row * stride_o + offs, y.to(Out.dtype.element_ty), mask=m)


def enabled(x: torch.Tensor) -> bool:
    """Use the fused kernels for ``x``: on CUDA when triton is installed."""
    return x.is_cuda and triton is not None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool) -> torch.Tensor:
    """``models.layers.RMSNorm`` over the last dimension, one kernel."""
    n = x.shape[-1]
    rows = x.reshape(-1, n)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty((rows.shape[0], n), dtype=x.dtype, device=x.device)
    if rows.shape[0]:
        _rms_norm_kernel[(rows.shape[0],)](rows, weight, out, rows.stride(0), out.stride(0), n, eps,
                                           UNIT_OFFSET=unit_offset, BLOCK=triton.next_power_of_2(n))
    return out.view(x.shape)


def norm_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, weight: torch.Tensor | None = None,
              eps: float = 0.0, unit_offset: bool = False) -> torch.Tensor:
    """``apply_rope(RMSNorm(x), (cos, sin))`` per head (the norm optional):
    ``x`` ``[T, H, D]`` (heads and dims contiguous within a token), ``cos``
    and ``sin`` ``[T, 1, D]``; a new contiguous ``[T, H, D]``."""
    T, H, D = x.shape
    if x.stride(2) != 1:
        x = x.contiguous()
    cos, sin = cos.reshape(T, D), sin.reshape(T, D)
    out = torch.empty((T, H, D), dtype=x.dtype, device=x.device)
    if T:
        _norm_rope_kernel[(T, H)](x, weight if weight is not None else x, cos, sin, out,
                                  x.stride(0), x.stride(1), cos.stride(0), out.stride(0), out.stride(1), eps,
                                  NORM=weight is not None, UNIT_OFFSET=unit_offset, D=D)
    return out


def act_mul(x: torch.Tensor, activation: str) -> torch.Tensor:
    """``act(gate) * up`` of a fused gate_up product ``[T, 2n]``; ``activation``
    is a ``models.layers.ACTIVATIONS`` name (silu, or gelu_pytorch_tanh)."""
    T, two_n = x.shape
    n = two_n // 2
    if x.stride(1) != 1:
        x = x.contiguous()
    out = torch.empty((T, n), dtype=x.dtype, device=x.device)
    block = min(1024, triton.next_power_of_2(n))
    if T:
        _act_mul_kernel[(T, triton.cdiv(n, block))](x, out, x.stride(0), out.stride(0), n,
                                                    GELU=activation == "gelu_pytorch_tanh", BLOCK=block)
    return out
