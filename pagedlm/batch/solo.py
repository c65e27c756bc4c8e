"""One sequence through the model, chunk by chunk, outside the engine: ``Solo``.

For what needs every position's logits of one sequence (perplexity, the
tests against transformers) rather than sampling: the same model call and
default store as the engine, with no scheduler around them.
"""

from __future__ import annotations

import torch

from pagedlm.cache.store import KVStore

from .step import StepBatch

SOLO = 0  # the row's id in its own store


class Solo:
    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.device = next(model.parameters()).device
        self.store = KVStore(model.kv_spec())
        self.store.add_row(SOLO)
        self.offset = 0

    @torch.inference_mode()
    def __call__(self, ids: list[int] | torch.Tensor, logits: bool = True) -> torch.Tensor:
        """Feed ``ids`` after what was fed before; their logits ``[L, V]``
        (or hidden states ``[L, d]`` with ``logits=False``)."""
        ids = torch.as_tensor(ids, dtype=torch.long).to(self.device)
        n, start = ids.shape[0], self.offset
        step = StepBatch(
            input_ids=ids,
            positions=torch.arange(start, start + n, device=self.device),
            query_start=torch.tensor([0, n], device=self.device),
            seq_lens=torch.tensor([start + n], device=self.device),
            logits_rows=torch.tensor([n - 1], device=self.device),
            slot_mapping=None, block_tables=None,
            seq_ids=(SOLO,), query_start_host=(0, n), seq_lens_host=(start + n,),
            sampling_rows=(0,), max_position=start + n - 1,
        )
        hidden = self.model(ids, step.positions, self.store, step)
        self.offset += n
        return self.model.compute_logits(hidden) if logits else hidden
