"""The Cache protocol every per-sequence, per-layer KV cache satisfies.

The default store (``cache.store.KVStore``) asks a sequence's cache two
questions per layer and step, and nothing else (a compiled decode step asks ``cache.next_slot()`` instead,
and writes the new key and value into the slot itself):

    mask = cache.make_mask(n_new, device)  # before the update
    k, v = cache.update_and_fetch(k, v)    # [L, H, D] in, [S, H, D] out

A new storage scheme is a new class with these members; code that can only
handle some classes (the prompt cache) gates on ``isinstance`` and refuses
the rest.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class Cache(Protocol):
    offset: int
    """Tokens stored so far (the position of the next token)."""

    def update_and_fetch(
        self, keys: torch.Tensor, values: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ``[L, H, D]`` keys/values; return every key/value that the
        new queries attend to, as ``[S, H, D]``."""
        ...

    def make_mask(self, n_queries: int, device: torch.device | str | None = None) -> torch.Tensor | None:
        """Mask for the next ``n_queries`` positions, called before the update.

        Returns ``None`` when every fetched key is visible to every query,
        else a bool tensor ``[n_queries, S]`` (True = may attend) matching the
        keys that ``update_and_fetch`` will return."""
        ...

    def next_slot(self) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Room for one more token after the first update, which the caller
        writes (a compiled decode step writes it inside its graph): every
        key/value that token attends to, as ``[S, H, D]`` views of the
        storage, and its slot among them; ``offset`` counts it already."""
        ...

    def is_trimmable(self) -> bool: ...

    def trim(self, n: int) -> int:
        """Drop the last ``n`` tokens (at most ``offset``); return how many went."""
        ...

    @property
    def nbytes(self) -> int: ...

    def dispose(self) -> None:
        """Release storage. The cache must not be used afterwards."""
        ...
