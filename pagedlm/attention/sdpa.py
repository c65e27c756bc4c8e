"""The SDPA calls every torch attention path ends in: ``attend_row`` (one
sequence's queries) and ``attend_rows`` (one query per sequence)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def attend_row(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
) -> torch.Tensor:
    """Scaled dot-product attention of one sequence's queries, grouped KV heads.

    q: ``[L, H_q, D]``; k, v: ``[S, H_kv, D]`` (token-major, as the stores
    hold them); mask: None (every key visible) or bool ``[L, S]``, True =
    attend. Returns ``[L, H_q, D]``.
    """
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
        attn_mask=mask, scale=scale, enable_gqa=k.shape[1] != q.shape[1],
    )
    return out[0].transpose(0, 1)


def attend_rows(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
) -> torch.Tensor:
    """One query per sequence, many sequences in one call (decode).

    q: ``[B, H_q, D]``; k, v: ``[B, S, H_kv, D]``, each row's keys first and
    finite padding after them; mask: None (no row is padded) or bool
    ``[B, S]``, True for a row's own keys. Returns ``[B, H_q, D]``. Padding
    contributes exactly nothing (its weight is exp(-inf) = 0, times a finite
    value), so two stores that pad the same rows to the same length agree to
    the bit whatever their padding holds.

    The query heads of a KV group become that KV head's queries (query head
    ``h`` reads KV head ``h // group``, as ``enable_gqa`` means it): no copy
    of the keys per query head, and a masked call stays on a fused kernel
    (SDPA falls back to its unfused path for a mask with ``enable_gqa``).
    """
    B, Hq, D = q.shape
    Hkv = k.shape[2]
    out = F.scaled_dot_product_attention(
        q.view(B, Hkv, Hq // Hkv, D), k.transpose(1, 2), v.transpose(1, 2),
        attn_mask=None if mask is None else mask[:, None, None, :], scale=scale,
    )
    return out.reshape(B, Hq, D)


def keep_sdpa_deterministic() -> None:
    """Turn cuDNN's SDPA backend off (called when an engine starts on CUDA).

    It was seen to differ by one ulp between two calls on identical inputs
    (fp16, H200): a paged and a default run could then part ways. Flash,
    memory-efficient and math backends are deterministic here. Done at engine
    start rather than at import, so that importing pagedlm changes nothing
    for the rest of a process that never runs it.
    """
    if torch.backends.cuda.is_built():
        torch.backends.cuda.enable_cudnn_sdp(False)
