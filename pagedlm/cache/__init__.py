"""The KV manager: where each layer's keys live and the budget's sizing
(``layout``), per-sequence caches behind the ``base.Cache`` protocol, the
paged pools (``paged``) and their block manager (``blocks``), the prompt
cache, the two admission policies (``admission``), and the ``KVStore`` the
model writes to and attends over. (``layout`` and ``admission`` read
``pagedlm.options``, which imports ``kv_quant`` from here: import them by
module, not from this package.)"""

from pagedlm.cache.base import Cache
from pagedlm.cache.kv import STEP, KVCache, RotatingKVCache
from pagedlm.cache.paged import PagedPools
from pagedlm.cache.spec import KVSpec
from pagedlm.cache.step import StepBatch
from pagedlm.cache.store import KVStore

__all__ = ["Cache", "STEP", "KVCache", "RotatingKVCache", "PagedPools", "KVSpec", "KVStore", "StepBatch"]
