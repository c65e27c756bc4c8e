"""Products of a few rows by a weight matrix on CUDA (Triton): decode's GEMVs.

A decode step of a small batch reads every weight once and does almost no
arithmetic with it: each product is bound by how fast its weight streams
in. cuBLAS runs the small ones well below the copy rate (an H100, in a CUDA
graph over weights L2 cannot hold: Qwen3-0.6B's o and down products 5.8
and 7.5 us for 4 and 6 MB; `benchmarks/gemv_sweep.py`, RESULTS.md), and
between two products the model launches small kernels of its own: the
gated activation is one a layer.

``linear(x, weight, bias, act=)`` takes ``x`` ``[M, K]`` with ``M <=
ROWS`` and a row-major ``[N, K]`` weight. A program owns a few output
columns and walks K in tiles; sums are float32 and the result is rounded
once to the input dtype, the bias added before the round (cuBLAS's
epilogue). One row (batch-1 decode) multiplies each weight tile by the row
element by element and sums (``_row_kernel``: many narrow programs, the
weight in registers); two rows or more go through the tensor cores
(``_rows_kernel``: the rows padded to ``ROWS``, float32 weights in IEEE
float32). The tiles are ``config``'s, measured on an H100 (RESULTS.md).

With ``act`` the weight is a fused gate/up ``[2n, K]`` and the result
``[M, n]`` is ``act(gate) * up``, rounded as ``fused.act_mul`` rounds the
product's output: a program takes gate's columns and up's same columns,
so the activation's launch folds into the product that makes its input.

Rows of the tensor-core kernel are independent: a row's result is the same
bits whatever the other rows and however many (2 to 16). The one-row
kernel sums in another order, and cuBLAS (17 rows or more) in another.
"""

from __future__ import annotations

import torch

from pagedlm.kernels.launch import launch_options, pdl_on
from pagedlm.kernels.paged_attention import triton

ROWS = 16  # the most rows a product takes here (tl.dot's smallest side); more go to cuBLAS
MAX_BYTES = 64 << 20  # bigger weights go to cuBLAS (the 8B's MLP and the heads: as fast or faster there) ...
PDL_MAX_BYTES = 256 << 20  # ... unless launched as programmatic dependents: then the 8B's MLP too (not the heads)
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
ACTS = {None: 0, "silu": 1, "gelu_pytorch_tanh": 2}

if triton is not None:
    import triton.language as tl

    from pagedlm.kernels.fused import _round, act_mul_of
    from pagedlm.kernels.launch import await_inputs

    @triton.jit
    def _finish(acc, acc_up, B, n, n_ok, N, ACT: tl.constexpr, HAS_BIAS: tl.constexpr, DTYPE: tl.constexpr):
        """The output tile from the float32 sums (gate's and up's with ACT):
        the bias added, rounded to DTYPE; with ACT, ``act(gate) * up`` of the
        rounded products (``fused.act_mul_of``, as ``fused.act_mul`` rounds it)."""
        if HAS_BIAS:
            acc += tl.load(B + n, mask=n_ok, other=0.0).to(tl.float32)
            if ACT != 0:
                acc_up += tl.load(B + N + n, mask=n_ok, other=0.0).to(tl.float32)
        if ACT == 0:
            return acc.to(DTYPE)
        return act_mul_of(_round(acc, DTYPE), _round(acc_up, DTYPE), ACT == 2, DTYPE)

    @triton.jit
    def _weight_tile(rows, up, k, K, n_ok, ACT: tl.constexpr, EVEN: tl.constexpr):
        """The weight's columns ``k`` of the program's rows (and up's, ``up``
        further, with ACT; else gate's again), zeros past K."""
        mask = n_ok[:, None] if EVEN else n_ok[:, None] & (k[None, :] < K)
        w = tl.load(rows + k[None, :], mask=mask, other=0.0)
        if ACT != 0:
            return w, tl.load(rows + up + k[None, :], mask=mask, other=0.0)
        return w, w

    @triton.jit
    def _row_kernel(X, W, B, Out, N, K, stride_wn, ACT: tl.constexpr, HAS_BIAS: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN: tl.constexpr, PDL: tl.constexpr):
        """One row: ``Out[n] = sum_k X[k] * W[n, k]`` for the program's
        BLOCK_N columns (and ``W[N + n, k]``'s with ACT), products summed in
        a [BLOCK_N, BLOCK_K] float32 tile, reduced once at the end. The first
        weight tile is read before ``await_inputs`` (no kernel of a step
        writes a weight): under PDL it streams in while the kernel before
        drains. Each next tile is read after the one in hand is summed."""
        n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < N
        rows = W + n[:, None].to(tl.int64) * stride_wn
        w, w_up = _weight_tile(rows, N * stride_wn, tl.arange(0, BLOCK_K), K, n_ok, ACT, EVEN)
        await_inputs(PDL)
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            if EVEN:
                x = tl.load(X + k).to(tl.float32)[None, :]
            else:
                x = tl.load(X + k, mask=k < K, other=0.0).to(tl.float32)[None, :]
            acc += w.to(tl.float32) * x
            if ACT != 0:
                acc_up += w_up.to(tl.float32) * x
            w, w_up = _weight_tile(rows, N * stride_wn, k + BLOCK_K, K, n_ok, ACT, False)
        y = _finish(tl.sum(acc, 1), tl.sum(acc_up, 1), B, n, n_ok, N, ACT, HAS_BIAS, Out.dtype.element_ty)
        tl.store(Out + n, y, mask=n_ok)

    @triton.jit
    def _rows_kernel(X, W, B, Out, M, N, K, stride_xm, stride_wn, stride_om, ACT: tl.constexpr,
                     HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN: tl.constexpr,
                     IEEE: tl.constexpr, ROWS: tl.constexpr, PDL: tl.constexpr):
        """Rows ``m < M`` (at most ROWS): ``Out[m, n] = sum_k X[m, k] * W[n, k]``
        on the tensor cores, the rows padded to ROWS (and ``W[N + n, k]``'s with ACT)."""
        await_inputs(PDL)
        n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        m = tl.arange(0, ROWS)
        m_ok = m < M
        n_ok = n < N
        acc = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
        acc_up = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
        x_rows = X + m[:, None] * stride_xm
        w_rows = W + n[:, None].to(tl.int64) * stride_wn
        for k0 in range(0, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            if EVEN:
                x_mask = m_ok[:, None]
                w_mask = n_ok[:, None]
            else:
                x_mask = m_ok[:, None] & (k[None, :] < K)
                w_mask = n_ok[:, None] & (k[None, :] < K)
            x = tl.load(x_rows + k[None, :], mask=x_mask, other=0.0)
            w = tl.load(w_rows + k[None, :], mask=w_mask, other=0.0)
            acc += tl.dot(x, tl.trans(w), input_precision="ieee" if IEEE else None)
            if ACT != 0:
                w_up = tl.load(w_rows + N * stride_wn + k[None, :], mask=w_mask, other=0.0)
                acc_up += tl.dot(x, tl.trans(w_up), input_precision="ieee" if IEEE else None)
        y = _finish(acc, acc_up, B, n[None, :], n_ok[None, :], N, ACT, HAS_BIAS, Out.dtype.element_ty)
        tl.store(Out + m[:, None] * stride_om + n[None, :], y, mask=m_ok[:, None] & n_ok[None, :])


def max_bytes(device: torch.device) -> int:
    """The largest weight ``linear`` takes on ``device``: `MAX_BYTES`, or
    `PDL_MAX_BYTES` where its kernels launch as programmatic dependents. On
    an H100 the 8B's MLP products (224 and 112 MiB) alone ran 1.0-1.1x
    cuBLAS's time, and the 8B decoded 1.03x slower with them here; with
    PDL, 0.934x (6.029 -> 5.631 ms a token, 84.0% -> 89.8% of the
    roofline; RESULTS.md, 2026-12-06): cuBLAS's kernels break the chain of
    dependent launches. The heads (297 MiB and up) stay with cuBLAS."""
    return PDL_MAX_BYTES if pdl_on(device) else MAX_BYTES


def usable(x: torch.Tensor, weight: torch.Tensor | None) -> bool:
    """Whether ``linear`` takes this product: a CUDA float weight (not
    quantized) of at most ``max_bytes`` and at most ``ROWS`` rows of the same dtype."""
    return (triton is not None and weight is not None and x.is_cuda and weight.dtype == x.dtype
            and weight.dtype in DTYPES and x.numel() <= ROWS * x.shape[-1] and weight.stride(-1) == 1
            and weight.numel() * weight.element_size() <= max_bytes(x.device))


def config(n: int, k: int, rows: int, dtype: torch.dtype) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, warps, stages) for ``rows`` rows by an ``[n, k]``
    weight (``n``: output columns), from `benchmarks/gemv_sweep.py` on an
    H100 (RESULTS.md): one row, 4 columns a program and 512-1024 of K a
    tile; more rows, tiles of 8192 weights (16 KB in bf16), wider for wider
    products, K's tile dividing K where one can."""
    if rows == 1:
        if k <= 1024 and k & (k - 1) == 0:
            return 4, min(512, k), 4, 1
        return 4, min(1024, triton.next_power_of_2(k)), 8, 1
    block_n = 16 if n <= 1024 else 32 if n <= 4096 else 64
    tile = 8192 if dtype.itemsize <= 2 else 4096
    block_k = next((b for b in (512, 256, 128, 64) if b * block_n <= tile and k % b == 0),
                   min(128, triton.next_power_of_2(max(k, 16))))
    return block_n, block_k, 4, 3 if block_k >= 512 else 4


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           act: str | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for ``x`` ``[..., K]`` of at most ``ROWS``
    rows (``usable``); with ``act`` (an activation ``models.layers.ACTIVATIONS``
    names), ``fused.act_mul`` of that product: ``[..., N / 2]``. ``weight``
    is a model's: with PDL one row's product reads its first tile before it
    waits for the kernel launched before it (``_row_kernel``), so no kernel
    still running may write it."""
    n, k = weight.shape
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    if rows.shape[1] != k or rows.shape[0] > ROWS or (act and n % 2):
        raise ValueError(f"gemv.linear: {tuple(x.shape)} by a {tuple(weight.shape)} weight: at most {ROWS} rows "
                         f"of {k}{', an even number of output rows for ' + act if act else ''}")
    n_out = n // 2 if act else n
    out = torch.empty((rows.shape[0], n_out), dtype=x.dtype, device=x.device)
    if rows.shape[0]:
        launch(rows, weight, bias, out, act, *config(n_out, k, rows.shape[0], weight.dtype))
    return out.view(*x.shape[:-1], n_out)


def launch(rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor,
           act: str | None, block_n: int, block_k: int, warps: int, stages: int) -> None:
    """One launch with the tiles given (``linear`` takes ``config``'s;
    ``benchmarks/gemv_sweep.py`` tries others): ``out`` ``[M, N']`` where
    N' is the weight's rows, or half of them with ``act``."""
    m, n = out.shape
    k = weight.shape[1]
    common = dict(ACT=ACTS[act], HAS_BIAS=bias is not None, BLOCK_N=block_n, BLOCK_K=block_k,
                  EVEN=k % block_k == 0, num_warps=warps, **launch_options(rows.device))
    b = weight if bias is None else bias
    grid = (triton.cdiv(n, block_n),)
    if m == 1:
        _row_kernel[grid](rows, weight, b, out, n, k, weight.stride(0), **common)
    else:
        _rows_kernel[grid](rows, weight, b, out, m, n, k, rows.stride(0), weight.stride(0), out.stride(0),
                           IEEE=weight.dtype == torch.float32, ROWS=ROWS, num_stages=stages, **common)
