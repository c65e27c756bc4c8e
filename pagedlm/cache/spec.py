"""What a model says it stores per attention layer: ``KVSpec``."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KVSpec:
    """What one attention layer stores: KV heads, head dim, sliding window (None = full)."""

    num_kv_heads: int
    head_dim: int
    window: int | None = None
