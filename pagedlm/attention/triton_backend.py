"""The kernels' backend (``--attention-backend triton``): ``TritonBackend``.

Attention reads the pools in place (``in_place``): the layout pages every
layer, sliding ones too (the kernel bounds them by their window; their
blocks are not reclaimed behind it), and decode rows attend where their
keys lie through ``kernels.paged_attention.paged_decode``. A step whose
rows all decode is then nothing but fixed-shape launches over the step's
device tensors, nothing read on the host: those are the steps a CUDA graph
may capture (``can_capture``). Prompt chunks still gather their blocks and
call SDPA, as the reference backend does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from pagedlm.attention.torch_backend import TorchBackend
from pagedlm.cache.step import StepBatch
from pagedlm.kernels import paged_attention

if TYPE_CHECKING:
    from pagedlm.cache.store import KVStore


class TritonBackend(TorchBackend):
    name = "triton"
    in_place = True

    def attend(self, store: "KVStore", layer: int, q: torch.Tensor, step: StepBatch, *,
               scale: float) -> torch.Tensor:
        if self.can_capture(step):  # every row decodes: the kernel alone, no plan
            return self._in_place(store, layer, q, step.block_tables, step.seq_lens, scale)
        return super().attend(store, layer, q, step, scale=scale)

    def can_capture(self, step: StepBatch) -> bool:
        return step.num_tokens == len(step.seq_ids)

    def _decode(self, store, layer, q, plan, fetched, scale) -> torch.Tensor:
        """The step's decode rows, in place beside its prompt chunks."""
        return self._in_place(store, layer, q, plan.decode_tables, plan.decode_seq_lens, scale)

    def _in_place(self, store, layer, q, block_tables, seq_lens, scale) -> torch.Tensor:
        """Decode rows reading their blocks where they lie (``paged_decode``)."""
        pools = store.pools
        return paged_attention.paged_decode(q, pools.k[layer], pools.v[layer], block_tables, seq_lens, scale,
                                            store.layout.specs[layer].window, pools.scales(layer))
