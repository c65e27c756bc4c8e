"""The reference backend (``--attention-backend torch``): ``TorchBackend``.

Every row's keys become one contiguous ``[S, H_kv, D]`` tensor of exactly
that row's keys, and SDPA (``sdpa``) attends over it: a row-cached layer
hands over what its cache's ``update_and_fetch`` returned when the store
wrote it; a paged layer gathers the row's blocks (``PagedPools.gather``).
Both give the same shapes, strides and values, so for the same schedule
the paged store gives the default store's bits. A prompt chunk (several
queries) attends on its own with its causal mask; the step's decode rows
(one query each) attend together in one call, their keys padded with
zeros to the longest row under a key-padding mask.

Masks and gathers are sized from the step's host copies of the lengths:
nothing here can be captured by a CUDA graph.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch.nn.utils.rnn import pad_sequence

from pagedlm.attention.plan import Planned
from pagedlm.attention.sdpa import attend_row, attend_rows
from pagedlm.cache.step import StepBatch

if TYPE_CHECKING:
    from pagedlm.cache.store import KVStore


class TorchBackend(Planned):
    name = "torch"
    in_place = False

    def attend(self, store: "KVStore", layer: int, q: torch.Tensor, step: StepBatch, *,
               scale: float) -> torch.Tensor:
        plan = self._plan_for(step, q.device)
        fetched = store.take_fetched(layer)  # None: a paged layer
        if len(step.seq_ids) == 1:  # one row: its output is the whole output
            if plan.decode:
                return self._decode(store, layer, q, plan, fetched, scale)
            return self._attend_one(store, layer, q, plan, 0, fetched, scale)
        out = torch.empty_like(q)
        if plan.decode:
            out[plan.decode_tokens] = self._decode(store, layer, q[plan.decode_tokens], plan, fetched, scale)
        bounds = step.query_start_host
        for r in plan.prefill:
            a, b = bounds[r], bounds[r + 1]
            out[a:b] = self._attend_one(store, layer, q[a:b], plan, r, fetched, scale)
        return out

    def can_capture(self, store: "KVStore", step: StepBatch) -> bool:
        return False

    def _attend_one(self, store, layer, q, plan, r, fetched, scale) -> torch.Tensor:
        """A row with several queries (a prompt chunk): its keys, its mask, SDPA."""
        if fetched is not None:
            k, v, mask = fetched[r]
        else:
            step = plan.step
            seq_len = step.seq_lens_host[r]
            k, v = store.pools.gather(layer, step.block_tables[r : r + 1], seq_len)
            k, v = k[0], v[0]
            mask = plan.causal(r, q.shape[0], seq_len, store.layout.specs[layer].window)
        return attend_row(q, k, v, mask, scale)

    def _decode(self, store, layer, q, plan, fetched, scale) -> torch.Tensor:
        """Every row with one query (decode) in one SDPA call: keys padded with
        zeros to the longest row, a key-padding mask when lengths differ."""
        if fetched is not None:
            keys = [fetched[r][0] for r in plan.decode]
            values = [fetched[r][1] for r in plan.decode]
            lengths = tuple(k.shape[0] for k in keys)
            if len(keys) == 1:
                k, v = keys[0][None], values[0][None]
            else:
                k, v = pad_sequence(keys, batch_first=True), pad_sequence(values, batch_first=True)
        else:
            lengths = plan.decode_lens
            k, v = store.pools.gather(layer, plan.decode_tables, max(lengths))
        return attend_rows(q, k, v, plan.padding(lengths), scale)
