"""The storage the model writes to and attends over: ``KVStore``.

A layer asks two things per step, whatever holds its keys:

    kv.write(layer, k, v, step)                  # this step's new [T, H_kv, D]
    out = kv.attend(layer, q, step, scale=s)     # [T, H_q, D]

(or, where ``kv.write_target(layer, step)`` names the pools, a kernel that
makes the keys stores them and the values there itself, in place of ``write``).

and each row's queries see exactly that row's keys: causal, and bounded by
the window on sliding layers. The store stores; the attending is its
attention backend's (``pagedlm.attention``, handed in when the engine
starts: cache/ never imports attention/). Where a layer's keys live is the
layout's (``cache.layout.KVLayout``), decided once:

  - per-row caches (``row_layers``: every layer of the default store, and
    sliding layers unless the backend reads pools in place): a ``KVCache``
    or ``RotatingKVCache`` per sequence and layer, created when the sequence
    is added (or lent by the prompt cache). ``write`` appends to them and
    keeps what ``update_and_fetch`` returned, with the row's mask, for the
    backend to take (``take_fetched``);
  - paged pools (``paged_layers``, with ``--paged-kv``): ``PagedPools``,
    written through the step's slot mapping, read through its block tables.

With prefix caching on the reference path the pools also hold a copy of the
sliding layers' keys (``mirrored_layers``): attention still reads the ring
buffers, but a sequence that starts from cached blocks needs its window of
keys before them, and ``seed_row`` fills its ring buffers from that copy.
(When the backend reads pools in place, those layers are paged already.)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from pagedlm.cache.base import Cache
from pagedlm.cache.kv import KVCache, RotatingKVCache
from pagedlm.cache.spec import KVSpec

if TYPE_CHECKING:
    from pagedlm.cache.layout import KVLayout
    from pagedlm.cache.paged import PagedPools
    from pagedlm.cache.step import StepBatch
    from pagedlm.kernels.paged_attention import KVTarget


def make_row_caches(specs: list[KVSpec], paged_layers: frozenset[int] = frozenset()) -> list[Cache | None]:
    """One sequence's per-layer caches; None for the layers the pools hold."""
    return [
        None if i in paged_layers else KVCache() if s.window is None else RotatingKVCache(s.window)
        for i, s in enumerate(specs)
    ]


class KVStore:
    def __init__(self, layout: "KVLayout", pools: "PagedPools | None", backend) -> None:
        # backend: a pagedlm.attention.AttentionBackend (duck-typed here)
        self.layout, self.pools, self.backend = layout, pools, backend
        self.rows: dict[int, list[Cache | None]] = {}
        self._fetched: dict[int, list] = {}  # layer -> per row (keys, values, mask), write to attend

    # -- rows --------------------------------------------------------------

    def add_row(self, seq_id: int, caches: list[Cache | None] | None = None) -> None:
        """Give a sequence its per-row caches (new, or lent holding a prefix)."""
        self.rows[seq_id] = caches if caches is not None else make_row_caches(self.layout.specs,
                                                                              self.layout.paged_layers)

    def seed_row(self, seq_id: int, table: list[int], length: int) -> None:
        """A sequence whose first ``length`` tokens are cached blocks (``table``):
        give its sliding layers' ring buffers the keys of the window before
        them, from the pools' copy."""
        bs = self.pools.block_size
        for layer in self.layout.mirrored_layers:
            keep = min(length, self.layout.specs[layer].window - 1)
            first = (length - keep) // bs
            blocks = torch.tensor([table[first : -(-length // bs)]], device=self.pools.k[layer].device)
            k, v = self.pools.gather(layer, blocks, length - first * bs)
            self.rows[seq_id][layer].update_and_fetch(k[0, k.shape[1] - keep :], v[0, v.shape[1] - keep :])

    def trim_row(self, seq_id: int, n: int) -> None:
        """Drop the last ``n`` tokens of a sequence's per-row caches (the
        rejected tail of a speculative verify row, written this step). The
        pools' slots are the block manager's to release (``BlockManager.trim``)."""
        caches = self.rows[seq_id]
        for i in self.layout.row_layers:
            if caches[i].trim(n) != n:
                raise RuntimeError(f"layer {i} of sequence {seq_id} cannot drop its last {n} tokens")

    def pop_row(self, seq_id: int) -> list[Cache | None]:
        """Take a sequence's per-row caches away (to dispose or keep)."""
        return self.rows.pop(seq_id)

    def row_bytes(self, seq_id: int) -> int:
        """Bytes of the sequence's own caches (the pools' blocks not included)."""
        caches = self.rows.get(seq_id)
        return sum(caches[i].nbytes for i in self.layout.row_layers) if caches else 0

    # -- the protocol the model sees ---------------------------------------

    def write_target(self, layer: int, step: "StepBatch") -> "KVTarget | None":
        """Where a kernel that makes the layer's keys may store them and the
        values itself, in place of `write` (a paged layer whose pools the
        kernels read); None: call `write`."""
        return self.pools.target(layer, step.slot_mapping) if layer in self.layout.paged_layers else None

    def write(self, layer: int, keys: torch.Tensor, values: torch.Tensor, step: "StepBatch") -> None:
        if layer in self.layout.paged_layers:
            self.pools.write(layer, keys, values, step.slot_mapping)
            return
        if layer in self.layout.mirrored_layers:
            self.pools.write(layer, keys, values, step.slot_mapping)
        fetched = []
        bounds = step.query_start_host
        for r, seq_id in enumerate(step.seq_ids):
            a, b = bounds[r], bounds[r + 1]
            cache = self.rows[seq_id][layer]
            mask = cache.make_mask(b - a, keys.device)
            k, v = cache.update_and_fetch(keys[a:b], values[a:b])
            fetched.append((k, v, mask))
        self._fetched[layer] = fetched

    def reserve_decode(self, step: "StepBatch") -> tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor]:
        """A step of one decode row, every layer row-cached (a compiled
        decode step, ``batch.compiled``): each layer's cache makes room for
        the token (``next_slot``). Returns per layer the keys and values the
        token attends to, its own slot among them not yet written, and those
        slots ``[layers]``: whoever attends writes the token there first."""
        if self.layout.paged_layers or self.layout.mirrored_layers:
            raise RuntimeError("reserve_decode needs every layer in per-row caches")
        (seq_id,) = step.seq_ids
        views, slots = [], []
        for cache in self.rows[seq_id]:
            k, v, slot = cache.next_slot()
            views.append((k, v))
            slots.append(slot)
        return views, torch.tensor(slots, device=step.input_ids.device)

    def attend(self, layer: int, q: torch.Tensor, step: "StepBatch", *, scale: float) -> torch.Tensor:
        return self.backend.attend(self, layer, q, step, scale=scale)

    def take_fetched(self, layer: int) -> list[tuple] | None:
        """A row-cached layer's (keys, values, mask) per row of this step, as
        ``write`` fetched them (taken: once per layer and step); None for a
        paged layer."""
        return self._fetched.pop(layer, None)

    def end_step(self) -> None:
        """Drop what one step kept for its layers (fetched keys here; the
        backend's plan, masks and row tables): nothing of a step outlives it."""
        self._fetched.clear()
        self.backend.end_step()
