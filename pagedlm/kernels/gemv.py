"""Products of a few rows by a weight matrix on CUDA (Triton): decode's GEMVs.

A decode step of a small batch reads every weight once and does almost no
arithmetic with it: each product is bound by how fast its weight streams
in. cuBLAS runs those products at about half the copy rate on Qwen3-0.6B's
shapes (an H100: 0.77 ms of a 1.32 ms batch-1 step for 1.19 GB of weights,
RESULTS.md), and between two products the model launches small kernels of
its own: the gated activation is one a layer.

``linear(x, weight, bias, act=)`` takes ``x`` ``[M, K]`` with ``M <=
ROWS`` and a row-major ``[N, K]`` weight. Each program owns ``BLOCK_N``
output columns and walks K in tiles, the tile's rows times the weight tile
on the tensor cores (``tl.dot``; float32 weights in IEEE float32), float32
sums, the result rounded once to the input dtype (with the bias added
before the round, as cuBLAS's epilogue adds it). With ``act`` the input is
a fused gate/up product ``[M, 2K]`` and each tile is ``act(gate) * up``,
rounded as ``fused.act_mul`` rounds it: the activation's launch folds into
the product that reads it.

The rows are padded to ``ROWS`` in every launch and the tile sizes depend
on the weight's shape only, so a row's result is the same bits whatever
the other rows and however many there are (one row of a batch of 16 as
alone); against cuBLAS the last bits differ (another order of sums).
"""

from __future__ import annotations

import torch

from pagedlm.kernels.paged_attention import triton

ROWS = 16  # the most rows a product takes here (tl.dot's smallest side); more go to cuBLAS
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
ACTS = {None: 0, "silu": 1, "gelu_pytorch_tanh": 2}

if triton is not None:
    import triton.language as tl

    from pagedlm.kernels.fused import _round, _tanh

    @triton.jit
    def _gemv_kernel(X, W, B, Out, M, N, K, stride_xm, stride_wn, stride_om,
                     ACT: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     EVEN: tl.constexpr, IEEE: tl.constexpr):
        """``Out[m, n] = sum_k X[m, k] * W[n, k] (+ B[n])`` for ``m < M``, the
        program's BLOCK_N columns; with ACT, ``X[m, k]`` is ``act(X[m, k]) *
        X[m, K + k]`` rounded to Out's dtype (``fused._act_mul_kernel``)."""
        pid = tl.program_id(0)
        n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        m = tl.arange(0, 16)
        m_ok = m < M
        n_ok = n < N
        acc = tl.zeros((16, BLOCK_N), dtype=tl.float32)
        x_rows = X + m[:, None] * stride_xm
        w_rows = W + n[:, None].to(tl.int64) * stride_wn
        for k0 in range(0, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            if EVEN:  # K a multiple of BLOCK_K: only the rows are masked
                x_mask = m_ok[:, None]
                w = tl.load(w_rows + k[None, :], mask=n_ok[:, None], other=0.0)
            else:
                x_mask = m_ok[:, None] & (k[None, :] < K)
                w = tl.load(w_rows + k[None, :], mask=n_ok[:, None] & (k[None, :] < K), other=0.0)
            if ACT == 0:
                x = tl.load(x_rows + k[None, :], mask=x_mask, other=0.0)
            else:
                gate = tl.load(x_rows + k[None, :], mask=x_mask, other=0.0).to(tl.float32)
                up = tl.load(x_rows + K + k[None, :], mask=x_mask, other=0.0).to(tl.float32)
                if ACT == 2:  # gelu(approximate="tanh")
                    a = 0.5 * gate * (1.0 + _tanh(0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)))
                else:  # silu
                    a = gate / (1.0 + tl.exp(-gate))
                x = (_round(a, Out.dtype.element_ty) * up).to(Out.dtype.element_ty)
            if IEEE:
                acc += tl.dot(x, tl.trans(w), input_precision="ieee")
            else:
                acc += tl.dot(x, tl.trans(w))
        if HAS_BIAS:
            acc += tl.load(B + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(Out + m[:, None] * stride_om + n[None, :], acc.to(Out.dtype.element_ty),
                 mask=m_ok[:, None] & n_ok[None, :])


def usable(x: torch.Tensor, weight: torch.Tensor | None) -> bool:
    """Whether ``linear`` takes this product: a CUDA float weight (not
    quantized) and at most ``ROWS`` rows of the same dtype."""
    return (triton is not None and weight is not None and x.is_cuda and weight.dtype == x.dtype
            and weight.dtype in DTYPES and x.numel() <= ROWS * x.shape[-1] and weight.stride(-1) == 1)


def config(n: int, k: int) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, warps, stages) for an ``[n, k]`` weight: enough
    programs to cover the GPU's SMs twice where the columns allow it, tiles of 8 KB or more."""
    block_n = 16
    while block_n < 128 and n // (2 * block_n) >= 264:
        block_n *= 2
    block_k = 256 if k >= 256 else triton.next_power_of_2(max(k, 16))
    return block_n, block_k, 4, 3


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           act: str | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for ``x`` ``[..., K]`` of at most ``ROWS``
    rows (``usable``); with ``act`` (an activation ``models.layers.ACTIVATIONS``
    names) ``x`` is ``[..., 2K]`` and the product is ``F.linear(act(gate) * up, ...)``
    as ``fused.act_mul`` rounds it."""
    n, k = weight.shape
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    if rows.shape[1] != (2 * k if act else k) or rows.shape[0] > ROWS:
        raise ValueError(f"gemv.linear: {tuple(x.shape)} rows by a {tuple(weight.shape)} weight"
                         f"{' after ' + act if act else ''}: at most {ROWS} rows of {2 * k if act else k}")
    out = torch.empty((rows.shape[0], n), dtype=x.dtype, device=x.device)
    if rows.shape[0]:
        launch(rows, weight, bias, out, act, *config(n, k))
    return out.view(*x.shape[:-1], n)


def launch(rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor,
           act: str | None, block_n: int, block_k: int, warps: int, stages: int) -> None:
    """One launch of the kernel with the tiles given (``linear`` takes
    ``config``'s; ``benchmarks/gemv_sweep.py`` tries others)."""
    n, k = weight.shape
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        rows, weight, weight if bias is None else bias, out, rows.shape[0], n, k, rows.stride(0),
        weight.stride(0), out.stride(0), ACT=ACTS[act], HAS_BIAS=bias is not None, BLOCK_N=block_n,
        BLOCK_K=block_k, EVEN=k % block_k == 0, IEEE=weight.dtype == torch.float32, num_warps=warps,
        num_stages=stages)
