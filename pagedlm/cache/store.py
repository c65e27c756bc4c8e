"""The storage the model writes to and attends over: ``KVStore``.

A layer asks two things per step, whatever holds its keys:

    kv.write(layer, k, v, step)                  # this step's new [T, H_kv, D]
    out = kv.attend(layer, q, step, scale=s)     # [T, H_q, D]

and each row's queries see exactly that row's keys: causal, and bounded by
the window on sliding layers. Two kinds of storage sit behind it, chosen per
layer when the engine starts:

  - per-row caches (the default store, and sliding layers everywhere): a
    ``KVCache`` or ``RotatingKVCache`` per sequence and layer, created when
    the sequence is added (or lent by the prompt cache);
  - paged pools (``--paged-kv``, full-attention layers): ``PagedPools``,
    written through the step's slot mapping, read through its block tables.

Both hand ``attention.attend_row`` a contiguous ``[S, H_kv, D]`` tensor of
exactly the row's keys, so for the same schedule the paged store gives the
default store's bits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from pagedlm.attention import attend_row
from pagedlm.cache.base import Cache
from pagedlm.cache.kv import KVCache, RotatingKVCache, causal_mask

if TYPE_CHECKING:
    from pagedlm.batch.step import StepBatch
    from pagedlm.cache.paged import PagedPools


@dataclass(frozen=True)
class KVSpec:
    """What one attention layer stores: KV heads, head dim, sliding window (None = full)."""

    num_kv_heads: int
    head_dim: int
    window: int | None = None


def make_row_caches(specs: list[KVSpec], paged_layers: frozenset[int] = frozenset()) -> list[Cache | None]:
    """One sequence's per-layer caches; None for the layers the pools hold."""
    return [
        None if i in paged_layers else KVCache() if s.window is None else RotatingKVCache(s.window)
        for i, s in enumerate(specs)
    ]


class KVStore:
    def __init__(self, specs: list[KVSpec], pools: "PagedPools | None" = None) -> None:
        self.specs = specs
        self.pools = pools
        self.paged_layers = frozenset(pools.layers if pools is not None else ())
        self.rows: dict[int, list[Cache | None]] = {}
        self._fetched: dict[int, list] = {}  # layer -> per row (keys, values, mask), write to attend
        self._masks: dict[int, torch.Tensor | None] = {}  # row -> causal mask, for this step's paged layers
        self._masks_step: "StepBatch | None" = None

    # -- rows --------------------------------------------------------------

    def add_row(self, seq_id: int, caches: list[Cache | None] | None = None) -> None:
        """Give a sequence its per-row caches (new, or lent holding a prefix)."""
        self.rows[seq_id] = caches if caches is not None else make_row_caches(self.specs, self.paged_layers)

    def pop_row(self, seq_id: int) -> list[Cache | None]:
        """Take a sequence's per-row caches away (to dispose or keep)."""
        return self.rows.pop(seq_id)

    def row_bytes(self, seq_id: int) -> int:
        return sum(c.nbytes for c in self.rows.get(seq_id, ()) if c is not None)

    # -- the protocol the model sees ---------------------------------------

    def write(self, layer: int, keys: torch.Tensor, values: torch.Tensor, step: "StepBatch") -> None:
        if layer in self.paged_layers:
            self.pools.write(layer, keys, values, step.slot_mapping)
            return
        fetched = []
        bounds = step.query_start_host
        for r, seq_id in enumerate(step.seq_ids):
            a, b = bounds[r], bounds[r + 1]
            cache = self.rows[seq_id][layer]
            mask = cache.make_mask(b - a, keys.device)
            k, v = cache.update_and_fetch(keys[a:b], values[a:b])
            fetched.append((k, v, mask))
        self._fetched[layer] = fetched

    def attend(self, layer: int, q: torch.Tensor, step: "StepBatch", *, scale: float) -> torch.Tensor:
        bounds = step.query_start_host
        if len(step.seq_ids) == 1 and layer not in self.paged_layers:
            k, v, mask = self._fetched.pop(layer)[0]
            return attend_row(q, k, v, mask, scale)
        out = torch.empty_like(q)
        fetched = self._fetched.pop(layer, None)
        for r in range(len(step.seq_ids)):
            a, b = bounds[r], bounds[r + 1]
            if fetched is None:
                seq_len = step.seq_lens_host[r]
                k, v = self.pools.gather(layer, step.block_tables[r], seq_len)
                mask = self._paged_mask(r, b - a, seq_len, step, q.device)
            else:
                k, v, mask = fetched[r]
            out[a:b] = attend_row(q[a:b], k, v, mask, scale)
        return out

    def _paged_mask(self, row: int, n: int, seq_len: int, step: "StepBatch", device) -> torch.Tensor | None:
        """The causal mask of a full-attention row, built once per step for all paged layers."""
        if n == 1:
            return None
        if self._masks_step is not step:
            self._masks, self._masks_step = {}, step
        if row not in self._masks:
            self._masks[row] = causal_mask(n, seq_len - n, device)
        return self._masks[row]
