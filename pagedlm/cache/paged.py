"""The paged store's pools: one block pool per pooled layer (``KVLayout.pooled_layers``), shared by every sequence.

Each pool holds keys and values as ``[num_blocks, block_size, H_kv, D]``,
token-major: a block is ``block_size`` consecutive token rows of
``H_kv * D`` values. That layout makes the write one ``index_copy_`` of the
step's ``[T, H_kv, D]`` keys into the pool viewed as ``[slots, H_kv, D]``
(slot = block * block_size + offset, the step's ``slot_mapping``), and it is
what the fused decode kernel wants: one block of one KV head is a strided
tile of ``block_size`` rows of ``D`` contiguous values, loaded once for every
query head of the group. The pools are allocated once, from a byte budget;
which blocks a sequence owns is the block manager's business
(``cache.blocks``), not the pool's; how many blocks and which layers, the
layout's (``cache.layout``).

Writes go through ``kernels.paged_attention.write_kv`` (keys and values in
one launch) when the pools are ``fused``, that is when attention reads them
in place (``KVLayout.in_place``: the Triton kernels); else through two
``index_copy_``.

On the reference path ``gather`` copies rows' blocks into one contiguous
``[rows, length, H_kv, D]`` tensor (one prompt-chunk row at its length, or
every decode row at the longest): the same shapes, strides and (unmasked)
values as the default store's ``KVCache`` fetches, hence the same attention
bits.

With ``kv_quant`` (``int8`` or ``fp8``) the pools hold 8-bit codes plus one
scale per token and KV head (``k_scale``, ``v_scale``: ``[num_blocks,
block_size, H_kv]``, the same slots): ``write`` quantizes before its copy and
``gather`` dequantizes what it gathered to ``dtype``. Their shapes are the
same; when the kernels read them (``fused``) their memory is head-major
(values tokens innermost): the kernels' write addresses it by strides, and
``gather`` selects whole blocks where they lie. Unfused pools (the only
ones ``write``'s indexed copies touch) stay token-major. The math, the
formats and the layouts are in ``cache.kv_quant``.
"""

from __future__ import annotations

import torch

from pagedlm.cache import kv_quant as kvq
from pagedlm.kernels.copies import to_device
from pagedlm.kernels.paged_attention import KVTarget, write_kv


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
        kv_quant: str = "none",
        fused: bool = False,
    ) -> None:
        if num_blocks < 1:
            raise ValueError(f"a paged pool needs at least one block (got {num_blocks})")
        self.layers = list(layers)
        self.fused = fused
        self.num_blocks, self.block_size = num_blocks, block_size
        self.dtype, self.kv_quant = dtype, kv_quant  # dtype: what gather returns
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        # zeros, not empty: a batched decode reads the slots past a row's end
        # as padding, which attention masks out; a masked weight is exactly 0,
        # and 0 times a finite value adds nothing, but 0 * NaN (uninitialized
        # memory) would poison the row. Written slots hold finite keys.
        store = kvq.storage_dtype(kv_quant, dtype)
        quantized = kv_quant != "none"
        # Memory orders: head-major for 8-bit pools the kernels read (kv_quant
        # says why), token-major for the rest (the torch gather's own order).
        self.orders = kvq.HEAD_MAJOR if quantized and fused else kvq.TOKEN_MAJOR
        k_order, v_order, s_order = self.orders
        self.k = {i: kvq.zeros(shape, k_order, store, device) for i in layers}
        self.v = {i: kvq.zeros(shape, v_order, store, device) for i in layers}
        # Empty unless quantized; zero scales dequantize unwritten slots to 0.
        scaled = layers if quantized else []
        self.k_scale = {i: kvq.zeros(shape[:-1], s_order, kvq.SCALE_DTYPE, device) for i in scaled}
        self.v_scale = {i: kvq.zeros(shape[:-1], s_order, kvq.SCALE_DTYPE, device) for i in scaled}

    @staticmethod
    def bytes_per_block(n_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                        dtype: torch.dtype, kv_quant: str = "none") -> int:
        """Keys and values of ``n_layers`` layers, scales included."""
        return 2 * n_layers * block_size * num_kv_heads * kvq.head_bytes(head_dim, dtype, kv_quant)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for d in (self.k, self.v, self.k_scale, self.v_scale) for t in d.values())

    def write(self, layer: int, keys: torch.Tensor, values: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Store ``[T, H_kv, D]`` keys/values at ``slot_mapping`` ``[T]``: one
        launch for both when ``fused``, else one indexed copy each (quantized
        first, and their scales copied beside them, with ``kv_quant``)."""
        if self.fused:  # (on CUDA the model's norm + RoPE launch writes them instead: `target`)
            t = self.target(layer, slot_mapping)
            write_kv(keys, values, t.k_pool, t.v_pool, t.slots, t.scales, fmt=t.fmt, qmax=t.qmax)
            return
        self._put(self.k[layer], self.k_scale.get(layer), keys, slot_mapping)
        self._put(self.v[layer], self.v_scale.get(layer), values, slot_mapping)

    def target(self, layer: int, slot_mapping: torch.Tensor) -> KVTarget | None:
        """Where a kernel may write ``layer``'s new keys and values itself, as
        `write` would (fused pools only; else None: call `write`)."""
        if not self.fused:
            return None
        return KVTarget(self.k[layer], self.v[layer], slot_mapping, self.scales(layer), self.kv_quant,
                        kvq.QMAX.get(self.kv_quant, 0.0))

    def scales(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The layer's key and value scales, or None when not quantized."""
        return (self.k_scale[layer], self.v_scale[layer]) if layer in self.k_scale else None

    def _put(self, pool: torch.Tensor, scales: torch.Tensor | None, x: torch.Tensor, slots: torch.Tensor) -> None:
        if scales is None:
            pool.view(-1, *pool.shape[2:]).index_copy_(0, slots, x)
            return
        q, s = kvq.quantize(x, self.kv_quant)
        kvq.as_bytes(pool).view(-1, *pool.shape[2:]).index_copy_(0, slots, kvq.as_bytes(q))
        scales.view(-1, scales.shape[-1]).index_copy_(0, slots, s)

    def gather(self, layer: int, block_tables: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows' keys/values, ``[rows, length, H_kv, D]``, contiguous: each row's
        blocks (``block_tables`` ``[rows, W]``) in order, cut at ``length``
        (one row's own length, or the longest row's). Past a row's own end the
        values are stale or zero (finite: see __init__), for the caller's mask
        to hide; padded table entries (-1) read block 0. Quantized pools
        return them dequantized to ``dtype``, row by row of ``D``."""
        n_blocks = -(-length // self.block_size)
        table = block_tables[:, :n_blocks].clamp(min=0).reshape(-1)
        rows = block_tables.shape[0]
        k_order, v_order, _ = self.orders
        keys = self._take(self.k[layer], self.k_scale.get(layer), k_order, table, rows, length)
        values = self._take(self.v[layer], self.v_scale.get(layer), v_order, table, rows, length)
        return keys, values

    def _take(self, pool: torch.Tensor, scales: torch.Tensor | None, order: tuple[int, ...], table: torch.Tensor,
              rows: int, length: int) -> torch.Tensor:
        if scales is None:
            return pool.index_select(0, table).view(rows, -1, *pool.shape[2:])[:, :length].contiguous()
        q = kvq.select_blocks(kvq.as_bytes(pool), order, table).reshape(rows, -1, *pool.shape[2:])
        s = kvq.select_blocks(scales, self.orders[2], table).reshape(rows, -1, scales.shape[-1])
        return kvq.dequantize(q[:, :length].view(pool.dtype), s[:, :length], self.dtype)

    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        """Copy blocks ``src[i]`` onto ``dst[i]`` in every layer, scales too
        (copy-on-write: a sequence about to write into a block others read
        gets its own copy)."""
        s, d = to_device([src, dst], torch.long, next(iter(self.k.values())).device)
        for pools in (self.k, self.v, self.k_scale, self.v_scale):
            for pool in pools.values():
                raw = kvq.as_bytes(pool) if pool.element_size() == 1 else pool  # index_copy_ has no float8 kernels
                raw.index_copy_(0, d, raw.index_select(0, s))
