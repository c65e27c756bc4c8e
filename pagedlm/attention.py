"""One attention entry point for every model."""

from __future__ import annotations

import torch
import torch.nn.functional as F

# cuDNN's SDPA backend was seen to differ by one ulp between two calls on
# identical inputs (fp16, H200): a paged and a default run could then part
# ways. Flash, memory-efficient and math backends are deterministic here.
if torch.backends.cuda.is_built():
    torch.backends.cuda.enable_cudnn_sdp(False)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
) -> torch.Tensor:
    """Scaled dot-product attention with grouped KV heads.

    q: [B, Hq, L, D]; k, v: [B, Hkv, S, D]; mask: None or bool [L, S]
    (True = attend). Returns [B, Hq, L, D].
    """
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, scale=scale, enable_gqa=k.shape[1] != q.shape[1]
    )
