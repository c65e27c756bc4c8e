"""Paged KV cache, v1 (one sequence): fixed-size blocks from a per-layer pool.

Keys and values live in pool-wide tensors ``[num_blocks, H_kv, block_size, D]``;
a sequence owns an ordered list of block ids (its block table). Attention
still sees one contiguous ``[1, H, offset, D]`` tensor: ``update_and_fetch``
gathers the sequence's blocks and slices to ``offset``, so the output is
bit-identical to ``KVCache``. The gather is a full copy per step; v1 buys the
allocation abstraction, not speed (batched paging and a fused kernel do).

The cache is deliberately not a ``KVCache`` subclass, so ``isinstance``
gates written for the contiguous cache exclude it.
"""

from __future__ import annotations

import heapq

import torch

from pagedlm.cache.kv import causal_mask


class PagedPoolExhausted(RuntimeError):
    """The pool has fewer free blocks than a write needs."""

    def __init__(self, requested: int, free: int, capacity: int, block_size: int = 0):
        self.requested, self.free, self.capacity = requested, free, capacity
        self.block_size = block_size
        per = f" of {block_size} tokens" if block_size else ""
        super().__init__(
            f"paged KV pool exhausted: needed {requested} block(s){per}, "
            f"{free} free of {capacity}. Size the pool for prompt + max_tokens, "
            f"or lower max_tokens."
        )


def _matches(want, got) -> bool:
    # torch.device("cuda") names any CUDA device; "cuda:0" one of them.
    if isinstance(want, torch.device):
        return want.type == got.type and want.index in (None, got.index)
    return want == got


class BlockPool:
    """Storage and free list for one layer's blocks.

    The block count is fixed at construction. Head count, head dim, dtype and
    device may be given up front (tensors allocated now) or left ``None`` and
    taken from the first write, so a pool can be made before the model has
    produced a single key.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int | None = None,
        head_dim: int | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(
                f"BlockPool needs num_blocks >= 1 and block_size >= 1, "
                f"got {num_blocks} and {block_size}"
            )
        self.num_blocks, self.block_size = num_blocks, block_size
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        self.dtype = dtype
        self.device = torch.device(device) if device is not None else None
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None
        self._free = list(range(num_blocks))  # a min-heap: lowest id first
        self._is_free = [True] * num_blocks
        if num_kv_heads is not None and head_dim is not None and dtype is not None:
            self._allocate(num_kv_heads, head_dim, head_dim, dtype, self.device or "cpu")

    def _allocate(self, heads: int, k_dim: int, v_dim: int, dtype, device) -> None:
        n, bs = self.num_blocks, self.block_size
        self.k = torch.zeros(n, heads, bs, k_dim, dtype=dtype, device=device)
        self.v = torch.zeros(n, heads, bs, v_dim, dtype=dtype, device=device)
        self.num_kv_heads, self.head_dim, self.dtype = heads, k_dim, dtype
        self.device = self.k.device

    def ensure_storage(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Allocate on first write; afterwards refuse writes that do not fit.

        Slice assignment would silently cast dtype or broadcast heads, which
        would break bit-identity with ``KVCache``; refuse instead."""
        H, Dk, Dv = keys.shape[1], keys.shape[3], values.shape[3]
        if self.k is None:
            want = (self.num_kv_heads, self.head_dim, self.dtype, self.device)
            got = (H, Dk, keys.dtype, keys.device)
            for w, g, name in zip(want, got, ("num_kv_heads", "head_dim", "dtype", "device")):
                if w is not None and not _matches(w, g):
                    raise ValueError(f"BlockPool built for {name}={w}, first write has {g}")
            self._allocate(H, Dk, Dv, keys.dtype, keys.device)
            return
        if (H, Dk, Dv) != (self.k.shape[1], self.k.shape[3], self.v.shape[3]):
            raise ValueError(
                f"BlockPool holds heads={self.k.shape[1]}, head_dim=({self.k.shape[3]}, "
                f"{self.v.shape[3]}); write has heads={H}, head_dim=({Dk}, {Dv})"
            )
        if keys.dtype != self.k.dtype or values.dtype != self.v.dtype:
            raise TypeError(
                f"BlockPool holds {self.k.dtype}; write has {keys.dtype}/{values.dtype}"
            )
        if keys.device != self.k.device or values.device != self.v.device:
            raise ValueError(f"BlockPool lives on {self.k.device}; write is on {keys.device}")

    def alloc(self) -> int:
        if not self._free:
            raise PagedPoolExhausted(1, 0, self.num_blocks, self.block_size)
        block = heapq.heappop(self._free)
        self._is_free[block] = False
        return block

    def free(self, block: int) -> None:
        if not 0 <= block < self.num_blocks:
            raise ValueError(f"block {block} is not in this pool (0..{self.num_blocks - 1})")
        if self._is_free[block]:
            raise ValueError(f"block {block} freed twice")
        self._is_free[block] = True
        heapq.heappush(self._free, block)

    def is_free(self, block: int) -> bool:
        return self._is_free[block]

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def capacity(self) -> int:
        return self.num_blocks

    @property
    def block_nbytes(self) -> int:
        """Bytes of K plus V for one block (0 before storage exists)."""
        if self.k is None:
            return 0
        return self.k[0].nbytes + self.v[0].nbytes

    @property
    def nbytes(self) -> int:
        """Bytes of the pool's tensors (0 before storage exists)."""
        if self.k is None:
            return 0
        return self.k.nbytes + self.v.nbytes


class PagedKVCache:
    """One sequence's keys/values in blocks of a ``BlockPool``."""

    def __init__(self, pool: BlockPool) -> None:
        self.pool = pool
        self.block_table: list[int] = []
        self.offset = 0
        self._table_t: torch.Tensor | None = None  # device copy of block_table

    def _blocks_for(self, n_tokens: int) -> int:
        return -(-n_tokens // self.pool.block_size)

    def update_and_fetch(
        self, keys: torch.Tensor, values: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if keys.shape[0] != 1:
            raise NotImplementedError(
                f"PagedKVCache v1 holds one sequence (batch 1); got batch {keys.shape[0]}"
            )
        pool, bs = self.pool, self.pool.block_size
        pool.ensure_storage(keys, values)
        L = keys.shape[2]
        # Allocate every block the write needs before touching anything, so
        # exhaustion leaves the cache as it was.
        needed = self._blocks_for(self.offset + L) - len(self.block_table)
        if needed > pool.num_free:
            raise PagedPoolExhausted(needed, pool.num_free, pool.capacity, bs)
        if needed > 0:
            self.block_table.extend(pool.alloc() for _ in range(needed))
            self._table_t = None

        pos, src = self.offset, 0
        while src < L:
            block, within = self.block_table[pos // bs], pos % bs
            n = min(bs - within, L - src)
            pool.k[block, :, within : within + n] = keys[0, :, src : src + n]
            pool.v[block, :, within : within + n] = values[0, :, src : src + n]
            pos, src = pos + n, src + n
        self.offset = pos
        return self._gather(pool.k), self._gather(pool.v)

    def _gather(self, storage: torch.Tensor) -> torch.Tensor:
        """``storage[table]`` -> ``[1, H, offset, D]`` (a copy; exactly offset keys)."""
        if self._table_t is None:
            self._table_t = torch.tensor(self.block_table, dtype=torch.long, device=storage.device)
        blocks = storage.index_select(0, self._table_t)  # [nb, H, bs, D]
        nb, H, bs, D = blocks.shape
        flat = blocks.permute(1, 0, 2, 3).reshape(1, H, nb * bs, D)
        return flat[:, :, : self.offset]

    def make_mask(
        self, n_queries: int, device: torch.device | str | None = None
    ) -> torch.Tensor | None:
        """Same as ``KVCache.make_mask``: ``None`` for one query, else causal."""
        if n_queries == 1:
            return None
        return causal_mask(n_queries, self.offset, device or self.pool.device)

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        """Rewind ``n`` tokens and give now-empty tail blocks back to the pool.

        Bytes past ``offset`` in the kept tail block are stale but never read:
        fetch slices to ``offset`` and writes cover exact ranges."""
        n = min(self.offset, n)
        self.offset -= n
        self._release(self._blocks_for(self.offset))
        return n

    def _release(self, keep: int) -> None:
        if keep >= len(self.block_table):
            return
        for block in reversed(self.block_table[keep:]):
            self.pool.free(block)
        del self.block_table[keep:]
        self._table_t = None

    @property
    def nbytes(self) -> int:
        return len(self.block_table) * self.pool.block_nbytes

    def dispose(self) -> None:
        """Return every block to the pool. Safe to call more than once."""
        self._release(0)
        self.offset = 0
