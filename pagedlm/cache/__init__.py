"""KV storage: per-sequence caches behind the ``base.Cache`` protocol, the
paged pools, and the ``KVStore`` the model writes to and attends over."""

from pagedlm.cache.base import Cache
from pagedlm.cache.kv import STEP, KVCache, RotatingKVCache
from pagedlm.cache.paged import PagedPools
from pagedlm.cache.spec import KVSpec
from pagedlm.cache.step import StepBatch
from pagedlm.cache.store import KVStore

__all__ = ["Cache", "STEP", "KVCache", "RotatingKVCache", "PagedPools", "KVSpec", "KVStore", "StepBatch"]
