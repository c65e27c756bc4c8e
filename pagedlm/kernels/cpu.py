"""One-row float32 products on the CPU, spread over the intra-op threads.

A decode step reads every weight once and is bound by memory bandwidth. MKL
runs a matrix-vector product on one thread whatever ``torch.set_num_threads``
says, and one core does not saturate the memory bus. A K-major weight
(``models.layers``: ``[in, out]`` in memory) cut into ``threads`` row blocks
is a contiguous ``[threads, in / threads, out]`` view of the same storage, and
``torch.bmm`` runs the blocks in parallel, each thread streaming its own
contiguous slab: ``x`` split the same way gives ``threads`` partial products,
which are then summed. Same input, same thread count: the same bits on every
run; against the one-thread product the last bits differ (two partial sums).

Measured on 2 cores (AMD EPYC, MKL), a 30-layer SmolLM2-shaped stack of
projections 40 -> 28 ms per token; Gemma 3's 262144 x 640 lm_head 43 -> 33 ms.

Products of ``ONEDNN_MIN_ROWS`` rows or more (prompt chunks, batched decode)
run in oneDNN (torch's ``mkldnn`` ops) on x86 instead of MKL: on this AMD
EPYC it did the models' shapes in 0.70-0.94x MKL's time on one thread (16
to 512 rows, K-major weights as they are, no reorder).
"""

from __future__ import annotations

import platform

import torch
import torch.nn.functional as F

SPLIT_MIN_BYTES = 1 << 20  # smaller weights do not repay the fork/join
ONEDNN_MIN_ROWS = 16  # float32 products of this many rows or more run in oneDNN; 0: never
_ONEDNN = platform.machine() in ("x86_64", "AMD64") and torch.backends.mkldnn.is_available()


def is_k_major(weight: torch.Tensor) -> bool:
    """``[out, in]`` weight stored as ``[in, out]`` rows."""
    return weight.dim() == 2 and weight.stride() == (1, weight.shape[0])


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``; one row times a big K-major float32 CPU
    weight runs in ``torch.get_num_threads()`` parallel slabs, except in a
    compiled step (``batch.compiled``): there inductor would turn the slabs'
    one-row ``bmm`` into a reduction loop of its own, 3-10x slower than the
    library's product, and MKL's one-row product is what it calls instead."""
    out_features, in_features = weight.shape
    # Compiling first: testing a traced row count would guard the compiled graph on it.
    if torch.compiler.is_compiling() or weight.dtype != torch.float32 or weight.device.type != "cpu":
        return F.linear(x, weight, bias)
    n_rows = x.numel() // in_features
    if _ONEDNN and 0 < ONEDNN_MIN_ROWS <= n_rows and x.dtype == torch.float32:
        return _onednn_linear(x, weight, bias)
    if n_rows != 1 or weight.numel() * 4 < SPLIT_MIN_BYTES or not is_k_major(weight):
        return F.linear(x, weight, bias)  # several rows: a GEMM, threaded already
    blocks = torch.get_num_threads()
    if blocks < 2 or in_features % blocks:
        return F.linear(x, weight, bias)
    rows = in_features // blocks
    slabs = weight.as_strided((blocks, rows, out_features), (rows * out_features, out_features, 1))
    partial = torch.bmm(x.reshape(blocks, 1, rows), slabs)
    y = partial[0]
    for p in partial[1:]:  # fixed order; faster than sum(0) over 262144 logits
        y = y + p
    y = y.view(*x.shape[:-1], out_features)
    return y if bias is None else y + bias


def _onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear`` by oneDNN (the op inductor's CPU fusions call), reading the weight as laid out."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
