"""Which blocks of the paged pools each sequence owns: ``BlockManager``.

One block table per sequence, shared by every paged layer (the pools of all
layers have the same block count, so block ``b`` of a table means slot range
``b * block_size ...`` in each of them). Blocks come from a free list and go
back to it when the sequence finishes, is aborted or preempted. Invariant,
checked by ``check``: every block is free, or in exactly one live table.
"""

from __future__ import annotations

from collections import deque


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks, self.block_size = num_blocks, block_size
        self.free_blocks: deque[int] = deque(range(num_blocks))
        self.tables: dict[int, list[int]] = {}

    @property
    def num_free(self) -> int:
        return len(self.free_blocks)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self.free_blocks)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def missing(self, seq_id: int, num_tokens: int) -> int:
        """Blocks the sequence still needs to hold ``num_tokens`` tokens."""
        return max(0, self.blocks_for(num_tokens) - len(self.tables.get(seq_id, ())))

    def can_allocate(self, n_blocks: int) -> bool:
        return n_blocks <= len(self.free_blocks)

    def allocate_slots(self, seq_id: int, num_tokens: int) -> bool:
        """Grow the sequence's table to hold ``num_tokens`` tokens; False (and
        nothing taken) when too few blocks are free."""
        need = self.missing(seq_id, num_tokens)
        if need > len(self.free_blocks):
            return False
        table = self.tables.setdefault(seq_id, [])
        table.extend(self.free_blocks.popleft() for _ in range(need))
        return True

    def free(self, seq_id: int) -> None:
        """Return every block of the sequence (a no-op for one that holds none)."""
        self.free_blocks.extend(self.tables.pop(seq_id, ()))

    def check(self, live: set[int]) -> None:
        """Raise AssertionError unless each block is free or owned by exactly one live sequence."""
        owners: dict[int, int] = {}
        for seq_id, table in self.tables.items():
            assert seq_id in live, f"sequence {seq_id} holds blocks but is not live"
            for block in table:
                assert block not in owners, f"block {block} in tables of {owners[block]} and {seq_id}"
                owners[block] = seq_id
        free = list(self.free_blocks)
        assert len(free) == len(set(free)), "a block is on the free list twice"
        assert not owners.keys() & set(free), "a block is both free and owned"
        assert len(owners) + len(free) == self.num_blocks, "a block is neither free nor owned"
