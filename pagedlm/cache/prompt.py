"""Prompt cache: reuse a previous request's KV caches by longest common token prefix.

Whole entries, LRU under a byte cap (``max_bytes``) and, on the engine's
default store, inside its KV budget: the byte admission
(``cache.admission.ByteAdmission``) passes the room its running sequences
leave (``put(..., room=)``, ``evict_to``), so that live KV and cached
prefixes together never exceed the one budget, cached prefixes going first
(least recently used) when an admission needs the room. A request
``take``s the entry that shares the longest prefix with its prompt; the
entry leaves the LRU (the request owns it now, so nothing else can mutate
it), is trimmed back to that prefix, and only the rest of the prompt is
prefilled. When the request is done it ``put``s its caches back, keyed by
exactly the tokens they hold. A multi-turn chat therefore reuses the
previous turn: the new prompt starts with the old prompt and the old reply.

Only contiguous caches (``KVCache``, ``RotatingKVCache``) are stored: the
engine keeps a prompt cache only on the default store (the paged store
shares prefixes by blocks, ``cache.blocks``), and ``put`` refuses anything
else with ``TypeError``.

Not thread-safe: one user at a time (the engine's scheduler, on the thread
that steps it). ``nbytes``, ``hits`` and ``misses`` are plain ints, safe to
read from another thread for metrics.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Sequence

from pagedlm.cache.base import Cache
from pagedlm.cache.kv import STEP, KVCache, RotatingKVCache

STORABLE = (KVCache, RotatingKVCache)


@dataclass
class _Entry:
    tokens: list[int]
    cache: list[Cache]
    nbytes: int


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token lists."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def _shrink(cache: Cache) -> None:
    """Let a trimmed cache hold no more than a fresh one with its tokens
    would (a ``KVCache`` grows by ``STEP`` slots; a ring buffer that has
    not wrapped holds its tokens), so that the new owner's KV projection
    bounds it."""
    if cache.keys is None:
        return
    keep = -(-cache.offset // STEP) * STEP if isinstance(cache, KVCache) else cache.offset
    if 0 < keep < cache.keys.shape[0]:
        cache.keys, cache.values = cache.keys[:keep].clone(), cache.values[:keep].clone()


def dispose(cache: list[Cache]) -> None:
    for layer_cache in cache:
        layer_cache.dispose()


class PromptCache:
    """LRU of per-layer KV caches keyed by the tokens they hold.

    ``max_bytes`` bounds the sum of the stored caches' ``nbytes``; 0 turns the
    cache off (every ``take`` misses, every ``put`` disposes)."""

    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0 (got {max_bytes})")
        self.max_bytes = max_bytes
        self._entries: OrderedDict[int, _Entry] = OrderedDict()  # oldest first
        self._next_key = 0
        self.nbytes = 0
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._entries)

    def take(self, tokens: Sequence[int]) -> tuple[list[Cache] | None, int]:
        """Remove and return the entry sharing the longest prefix with
        ``tokens``, trimmed to hold a proper prefix of them (so at least one
        token is left to prefill), and how many tokens it holds; or
        ``(None, 0)`` on a miss. The caller owns the returned caches."""
        best_key, best_len = None, 0
        for key, entry in self._entries.items():  # oldest first: ">=" prefers the newest
            n = common_prefix(entry.tokens, tokens)
            if n >= best_len and n > 0:
                best_key, best_len = key, n
        keep = min(best_len, len(tokens) - 1)
        if best_key is None or keep <= 0:
            self.misses += 1
            return None, 0
        entry = self._entries.pop(best_key)
        self.nbytes -= entry.nbytes
        excess = len(entry.tokens) - keep
        if excess > 0 and not all(c.is_trimmable() for c in entry.cache):
            # e.g. a RotatingKVCache that has wrapped: the tokens to drop are gone.
            dispose(entry.cache)
            self.misses += 1
            return None, 0
        for layer_cache in entry.cache:
            if excess > 0 and layer_cache.trim(excess) != excess:
                dispose(entry.cache)
                self.misses += 1
                return None, 0
            if excess > 0:
                _shrink(layer_cache)
        self.hits += 1
        return entry.cache, keep

    def put(self, tokens: Sequence[int], cache: list[Cache], room: int | None = None) -> None:
        """Store ``cache``, which holds exactly ``tokens`` (after
        a finished sequence: the prompt and every generated token but the
        last), keeping the total under ``max_bytes`` and ``room`` (the part of
        a shared budget nobody else holds). Takes ownership: evicted or
        unstorable entries are disposed."""
        for layer_cache in cache:
            if not isinstance(layer_cache, STORABLE):
                raise TypeError(
                    f"the prompt cache stores KVCache/RotatingKVCache layers only, got "
                    f"{type(layer_cache).__name__} (paged requests bypass the prompt cache)"
                )
            if layer_cache.offset != len(tokens):
                raise ValueError(
                    f"a layer cache holds {layer_cache.offset} tokens; put was given {len(tokens)}"
                )
        size = sum(c.nbytes for c in cache)
        limit = self.max_bytes if room is None else min(self.max_bytes, room)
        if not tokens or size > limit:
            dispose(cache)
            return
        self.evict_to(limit - size)
        self._entries[self._next_key] = _Entry(list(tokens), cache, size)
        self._next_key += 1
        self.nbytes += size

    def evict_to(self, max_bytes: int) -> None:
        """Dispose entries, least recently used first, until at most ``max_bytes`` are kept."""
        while self._entries and self.nbytes > max_bytes:
            _, old = self._entries.popitem(last=False)
            self.nbytes -= old.nbytes
            dispose(old.cache)

    def clear(self) -> None:
        """Dispose every entry."""
        while self._entries:
            _, old = self._entries.popitem(last=False)
            dispose(old.cache)
        self.nbytes = 0
