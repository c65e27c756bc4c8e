"""One sequence through the model, chunk by chunk, outside the engine: ``Solo``.

For what needs every position's logits of one sequence (perplexity, the
tests against transformers) rather than sampling: the same model call and
default store as the engine, with no scheduler around them. With
``kv_quant`` (``"none"`` included) the full-attention layers live in paged
pools of that format instead, the row owning blocks ``0 .. capacity /
block_size`` in order: how `bench ppl` scores quantized KV blocks.
"""

from __future__ import annotations

import torch

from pagedlm.attention import select_backend
from pagedlm.cache.layout import make_pools, plan_layout
from pagedlm.cache.paged import PagedPools
from pagedlm.cache.step import StepBatch
from pagedlm.cache.store import KVStore
from pagedlm.options import DEFAULT_BLOCK_SIZE, EngineOptions, OptionError, PagedKvOptions

SOLO = 0  # the row's id in its own store


class Solo:
    def __init__(self, model: torch.nn.Module, kv_quant: str | None = None, capacity: int = 0,
                 block_size: int = DEFAULT_BLOCK_SIZE) -> None:
        self.model = model
        param = next(model.parameters())
        self.device = param.device
        specs = model.kv_spec()
        self.table, self.capacity = None, None
        full = [s for s in specs if s.window is None]
        options = EngineOptions(kv_budget_bytes=0)
        if kv_quant is not None and full:
            n_blocks = -(-capacity // block_size)  # PagedPools refuses 0: give a capacity
            per_block = PagedPools.bytes_per_block(len(full), block_size, full[0].num_kv_heads, full[0].head_dim,
                                                   param.dtype, kv_quant)
            options = EngineOptions(paged_kv=PagedKvOptions(block_size=block_size, prefix_caching=False),
                                    kv_budget_bytes=n_blocks * per_block, kv_quant=kv_quant)
            self.table = torch.arange(n_blocks, device=self.device)[None]
            self.capacity = n_blocks * block_size
        layout = plan_layout(specs, options, self.device, param.dtype, in_place=False, identity="solo",
                             max_model_len=self.capacity or 0)
        pools = make_pools(layout, param.dtype, self.device)
        self.store = KVStore(layout, pools, select_backend("torch", self.device, paged=pools is not None))
        self.store.add_row(SOLO)
        self.offset = 0

    @torch.inference_mode()
    def __call__(self, ids: list[int] | torch.Tensor, logits: bool = True) -> torch.Tensor:
        """Feed ``ids`` after what was fed before; their logits ``[L, V]``
        (or hidden states ``[L, d]`` with ``logits=False``)."""
        ids = torch.as_tensor(ids, dtype=torch.long).to(self.device)
        n, start = ids.shape[0], self.offset
        if self.capacity is not None and start + n > self.capacity:
            raise OptionError(f"Solo's pools hold {self.capacity} tokens; {start + n} were fed")
        positions = torch.arange(start, start + n, device=self.device)  # also the slots: blocks 0, 1, ...
        step = StepBatch(
            input_ids=ids,
            positions=positions,
            seq_lens=torch.tensor([start + n], device=self.device),
            logits_rows=torch.tensor([n - 1], device=self.device),
            slot_mapping=None if self.table is None else positions,
            block_tables=self.table,
            seq_ids=(SOLO,), query_start_host=(0, n), seq_lens_host=(start + n,),
            sampling_rows=(0,), max_position=start + n - 1,
        )
        hidden = self.model(ids, step.positions, self.store, step)
        self.offset += n
        return self.model.compute_logits(hidden) if logits else hidden

