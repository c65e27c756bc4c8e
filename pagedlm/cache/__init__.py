"""Per-layer KV caches behind one protocol (see ``base.Cache``)."""

from pagedlm.cache.base import Cache
from pagedlm.cache.kv import STEP, KVCache, RotatingKVCache
from pagedlm.cache.paged import BlockPool, PagedKVCache, PagedPoolExhausted

__all__ = [
    "Cache",
    "STEP",
    "KVCache",
    "RotatingKVCache",
    "BlockPool",
    "PagedKVCache",
    "PagedPoolExhausted",
]
