"""The kernels' backend (``--attention-backend triton``): ``TritonBackend``.

Attention reads the pools in place (``in_place``): the layout pages every
layer, sliding ones too (the kernels bound them by their window; their
blocks are not reclaimed behind it). Two kernels of
``kernels.paged_attention`` serve every row, reading its blocks where they
lie:

- a step whose rows all decode (one query each) is ``paged_decode`` alone,
  fixed-shape launches over the step's device tensors with nothing read on
  the host;
- any other step (prompt chunks, chunks after a cached prefix, verify rows of
  a few queries) is one ``paged_prefill`` launch per layer for every row of
  several queries, plus one ``paged_decode`` for the step's decode rows when
  it has some: a fixed number of launches, whatever the rows.

A CUDA graph may capture a step whose rows all feed as many tokens
(``can_capture``): decode steps, and verify steps of one proposal length.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from pagedlm.attention.plan import Planned
from pagedlm.cache.step import StepBatch
from pagedlm.kernels import paged_attention

if TYPE_CHECKING:
    from pagedlm.cache.store import KVStore


class TritonBackend(Planned):
    name = "triton"
    in_place = True

    def attend(self, store: "KVStore", layer: int, q: torch.Tensor, step: StepBatch, *,
               scale: float) -> torch.Tensor:
        pools, window = store.pools, store.layout.specs[layer].window
        k, v, scales = pools.k[layer], pools.v[layer], pools.scales(layer)
        if step.num_tokens == len(step.seq_ids):  # every row decodes: the decode kernel alone, no plan
            partials = (self._graph_partials(store, len(step.seq_ids), step.block_tables.shape[1]) if step.replayed
                        else sum(map(paged_attention.row_splits, step.seq_lens_host)))
            return paged_attention.paged_decode(q, k, v, step.block_tables, step.seq_lens, scale, window, scales,
                                                partials=partials)
        plan = self._plan_for(step, q.device)
        out = paged_attention.paged_prefill(q, k, v, step.block_tables, plan.query_start, step.seq_lens, scale,
                                            plan.max_query_len, window, scales, min_queries=2 if plan.decode else 1)
        if plan.decode:  # one-query rows beside the chunks: split over their keys, as when they decode alone
            out[plan.decode_tokens] = paged_attention.paged_decode(
                q[plan.decode_tokens], k, v, plan.decode_tables, plan.decode_seq_lens, scale, window, scales,
                partials=sum(map(paged_attention.row_splits, plan.decode_lens)))
        return out

    @staticmethod
    def _pool_tokens(store: "KVStore") -> int:
        return store.pools.num_blocks * store.pools.block_size

    def _graph_partials(self, store: "KVStore", rows: int, table_width: int) -> int:
        """A graph's decode partials: as many as any ``rows`` rows of its table
        over the pool's distinct blocks hold (``can_capture`` keeps steps
        that need more eager)."""
        return min(paged_attention.decode_partials(rows, table_width, store.pools.block_size),
                   paged_attention.pool_partials(rows, self._pool_tokens(store)))

    def can_capture(self, store: "KVStore", step: StepBatch) -> bool:
        """Rows that all feed as many tokens: decode rows (the decode kernel),
        or verify rows of one proposal length (the multi-query kernel, whose
        launch depends on the shapes and that length only); decode rows whose
        splits fit a graph's partials (rows that share a long prefix's blocks
        can hold more keys than the pool has slots)."""
        bounds = step.query_start_host
        q = bounds[1] - bounds[0]
        if not all(b - a == q for a, b in zip(bounds, bounds[1:])):
            return False
        return q > 1 or (sum(map(paged_attention.row_splits, step.seq_lens_host))
                         <= paged_attention.pool_partials(len(step.seq_ids), self._pool_tokens(store)))
