"""The paged store's pools: one block pool per full-attention layer, shared by every sequence.

Each pool holds keys and values as ``[num_blocks, block_size, H_kv, D]``,
token-major: a block is ``block_size`` consecutive token rows of
``H_kv * D`` values. That layout makes the write one ``index_copy_`` of the
step's ``[T, H_kv, D]`` keys into the pool viewed as ``[slots, H_kv, D]``
(slot = block * block_size + offset, the step's ``slot_mapping``), and it is
what the fused decode kernel wants: one block of one KV head is a strided
tile of ``block_size`` rows of ``D`` contiguous values, loaded once for every
query head of the group. The pools are allocated once, from a byte budget;
which blocks a sequence owns is the block manager's business
(``batch.block_manager``), not the pool's.

On this reference path ``gather`` copies rows' blocks into one contiguous
``[rows, length, H_kv, D]`` tensor (one prompt-chunk row at its length, or
every decode row at the longest): the same shapes, strides and (unmasked)
values as the default store's ``KVCache`` fetches, hence the same attention
bits.
"""

from __future__ import annotations

import torch


class PagedPools:
    def __init__(
        self,
        layers: list[int],
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        if num_blocks < 1:
            raise ValueError(f"a paged pool needs at least one block (got {num_blocks})")
        self.layers = list(layers)
        self.num_blocks, self.block_size = num_blocks, block_size
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        # zeros, not empty: a batched decode reads the slots past a row's end
        # as padding, which attention masks out; a masked weight is exactly 0,
        # and 0 times a finite value adds nothing, but 0 * NaN (uninitialized
        # memory) would poison the row. Written slots hold finite keys.
        self.k = {i: torch.zeros(shape, dtype=dtype, device=device) for i in layers}
        self.v = {i: torch.zeros(shape, dtype=dtype, device=device) for i in layers}

    @staticmethod
    def bytes_per_block(n_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                        dtype: torch.dtype) -> int:
        return 2 * n_layers * block_size * num_kv_heads * head_dim * torch.finfo(dtype).bits // 8

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.k.values()) + sum(t.nbytes for t in self.v.values())

    def write(self, layer: int, keys: torch.Tensor, values: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Store ``[T, H_kv, D]`` keys/values at ``slot_mapping`` ``[T]``: one indexed copy each."""
        k, v = self.k[layer], self.v[layer]
        k.view(-1, *k.shape[2:]).index_copy_(0, slot_mapping, keys)
        v.view(-1, *v.shape[2:]).index_copy_(0, slot_mapping, values)

    def gather(self, layer: int, block_tables: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows' keys/values, ``[rows, length, H_kv, D]``, contiguous: each row's
        blocks (``block_tables`` ``[rows, W]``) in order, cut at ``length``
        (one row's own length, or the longest row's). Past a row's own end the
        values are stale or zero (finite: see __init__), for the caller's mask
        to hide; padded table entries (-1) read block 0."""
        rows = block_tables.shape[0]
        n_blocks = -(-length // self.block_size)
        table = block_tables[:, :n_blocks].clamp(min=0).reshape(-1)
        k, v = self.k[layer], self.v[layer]
        keys = k.index_select(0, table).view(rows, -1, *k.shape[2:])[:, :length].contiguous()
        values = v.index_select(0, table).view(rows, -1, *v.shape[2:])[:, :length].contiguous()
        return keys, values

    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        """Copy blocks ``src[i]`` onto ``dst[i]`` in every layer (copy-on-write:
        a sequence about to write into a block others read gets its own copy)."""
        s = torch.tensor(src, dtype=torch.long, device=next(iter(self.k.values())).device)
        d = s.new_tensor(dst)
        for pool in (*self.k.values(), *self.v.values()):
            pool.index_copy_(0, d, pool.index_select(0, s))
