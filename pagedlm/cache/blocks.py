"""Which blocks of the paged pools each sequence holds: ``BlockManager``.

One block table per sequence, shared by every paged layer (the pools of all
layers have the same block count, so block ``b`` of a table means slot range
``b * block_size ...`` in each of them).

With prefix caching (a ``salt``), a block is shared, vLLM-style:

- every full block a sequence has computed gets a hash: of its parent
  block's hash (the salt for the first block) and its own token ids. The
  salt names whatever else changes a block's keys (the model, its dtype,
  its KV quantization: ``cache.layout``). blake2b, not Python's
  ``hash``: a collision would hand one request another's keys;
- a block is referenced by every sequence whose table holds it (``ref``); a
  new sequence takes the longest run of cached blocks that starts its
  tokens (``lookup``) instead of computing it;
- a freed block keeps its hash and stays findable until the pool needs it:
  the free list is an LRU, least recently freed first, blocks without a hash
  before any cached one;
- a block that is cached or shared is never written: ``allocate_slots``
  first gives the sequence a copy of it (copy-on-write);
- the full blocks of a prompt being computed are ``pending``: a sequence
  whose next block another one is computing waits for it (``lookup``
  reports it busy) rather than computing it twice. That is how ``n > 1``
  continuations and requests sent together share one prefill.

Speculative decoding writes a verify row's proposed tokens, then ``trim``s
the table back to the tokens it kept. Rejected tokens only ever sit past the
kept ones, in blocks no hash names (``commit`` hashes only blocks the kept
tokens fill), so no sequence can be handed a rejected token's key.

Invariant, checked by ``check``: a block is free (ref 0, on the free list)
or referenced by exactly the live sequences whose tables hold it; the hash
map and the blocks' hashes agree; only live sequences have blocks pending.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from typing import Protocol


class Tokens(Protocol):
    """What the block manager reads of a sequence (``batch.sequence.Sequence``)."""

    seq_id: int
    block_hashes: list[bytes]  # its full blocks' hash chain, extended by ``hashes``

    @property
    def tokens(self) -> list[int]: ...

    @property
    def num_tokens(self) -> int: ...


def block_hash(parent: bytes, tokens: list[int]) -> bytes:
    """The key of a full block: its parent's key and its own token ids."""
    return hashlib.blake2b(parent + array("q", tokens).tobytes(), digest_size=16).digest()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, salt: bytes | None = None) -> None:
        self.num_blocks, self.block_size = num_blocks, block_size
        self.salt = salt  # None: no prefix caching
        self.ref = [0] * num_blocks
        self.hash_of: list[bytes | None] = [None] * num_blocks
        self.cached: dict[bytes, int] = {}  # hash -> block holding it
        self.pending: dict[bytes, int] = {}  # hash -> id of the sequence computing it
        self.free_blocks: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # evicted from the front
        self.tables: dict[int, list[int]] = {}
        self._committed: dict[int, int] = {}  # seq id -> leading blocks whose hashes are settled
        self._promised: dict[int, list[bytes]] = {}  # seq id -> hashes it put in pending
        self.queried_tokens = 0  # tokens of admitted sequences, and how many of them were cached
        self.hit_tokens = 0

    @property
    def caching(self) -> bool:
        return self.salt is not None

    @property
    def num_free(self) -> int:
        return len(self.free_blocks)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self.free_blocks)

    @property
    def num_cached(self) -> int:
        """Blocks findable by hash (in use or free)."""
        return len(self.cached)

    @property
    def num_refs(self) -> int:
        """Blocks in the tables, a block in k tables counted k times."""
        return sum(self.ref)

    @property
    def num_shared(self) -> int:
        """Blocks in more than one table."""
        return sum(1 for r in self.ref if r > 1)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- prefix lookup ------------------------------------------------------

    def hashes(self, seq: Tokens) -> list[bytes]:
        """The hash chain of the sequence's full blocks (extended as it grows)."""
        chain, bs, tokens = seq.block_hashes, self.block_size, None
        while (len(chain) + 1) * bs <= seq.num_tokens:
            tokens = tokens or seq.tokens
            i = len(chain)
            chain.append(block_hash(chain[-1] if chain else self.salt, tokens[i * bs : (i + 1) * bs]))
        return chain

    def lookup(self, seq: Tokens) -> tuple[list[int], bool]:
        """The cached blocks that start the sequence's tokens, and whether the
        block after them is being computed by another sequence (worth waiting for)."""
        if not self.caching:
            return [], False
        hit = []
        chain = self.hashes(seq)
        for h in chain:
            block = self.cached.get(h)
            if block is None:
                break
            hit.append(block)
        busy = len(hit) < len(chain) and self.pending.get(chain[len(hit)], seq.seq_id) != seq.seq_id
        return hit, busy

    def admission_cost(self, hit: list[int], num_computed: int, num_tokens: int) -> int:
        """Free-list blocks a sequence admitted with ``hit`` (its first
        ``num_computed`` tokens cached) takes to hold ``num_tokens``: new
        blocks, idle cached ones it revives, and a copy of a cached block it writes into."""
        revived = sum(1 for b in hit if self.ref[b] == 0)
        copy = 1 if num_computed % self.block_size else 0
        return revived + self.blocks_for(num_tokens) - len(hit) + copy

    def admit(self, seq: Tokens, hit: list[int], num_computed: int) -> None:
        """Give ``seq`` the cached blocks ``hit`` (covering its first
        ``num_computed`` tokens), and mark the full blocks it will compute pending."""
        for block in hit:
            self._take(block)
        self.tables[seq.seq_id] = list(hit)
        self._committed[seq.seq_id] = num_computed // self.block_size
        self.queried_tokens += seq.num_tokens
        self.hit_tokens += num_computed
        if self.caching:
            promised = [h for h in self.hashes(seq)[len(hit):] if h not in self.pending and h not in self.cached]
            self.pending.update(dict.fromkeys(promised, seq.seq_id))
            self._promised[seq.seq_id] = promised

    # -- slots ----------------------------------------------------------------

    def can_allocate(self, n_blocks: int) -> bool:
        return n_blocks <= len(self.free_blocks)

    def allocate_slots(self, seq_id: int, num_tokens: int, write_from: int | None = None) -> list[tuple[int, int]] | None:
        """Make the sequence's table hold ``num_tokens`` tokens. The tokens from
        ``write_from`` on are about to be written: a cached or shared block
        they land in is replaced by a copy first. Returns the (source,
        destination) blocks to copy before writing, or None (and nothing
        taken) when too few blocks are free."""
        table = self.tables.get(seq_id, [])
        first = len(table) if write_from is None else write_from // self.block_size
        cow = first < len(table) and (self.ref[table[first]] > 1 or self.hash_of[table[first]] is not None)
        if max(0, self.blocks_for(num_tokens) - len(table)) + cow > len(self.free_blocks):
            return None
        copies = []
        if cow:
            src = table[first]
            table[first] = self._pop_free()
            copies.append((src, table[first]))
            self._release(src)
        while len(table) < self.blocks_for(num_tokens):
            table.append(self._pop_free())
        self.tables[seq_id] = table
        return copies

    def trim(self, seq_id: int, num_tokens: int) -> None:
        """Shrink the sequence's table to the blocks that ``num_tokens`` tokens
        fill (speculative decoding's rollback: the rejected tail's slots are
        released, and a block that holds none of the kept tokens goes back
        to the free list, unhashed). Only tokens past the committed blocks
        can go: a hashed block never holds a rejected token."""
        table = self.tables[seq_id]
        keep = self.blocks_for(num_tokens)
        assert keep >= self._committed.get(seq_id, 0), "trimming into a committed block"
        while len(table) > keep:
            self._release(table.pop())

    def commit(self, seq: Tokens, num_computed: int) -> None:
        """Hash the blocks that ``num_computed`` tokens have filled, making
        them findable. A block whose hash is already cached elsewhere (two
        sequences computed the same prefix) stays private."""
        if not self.caching:
            return
        table, done = self.tables[seq.seq_id], self._committed[seq.seq_id]
        full = num_computed // self.block_size
        if full <= done:
            return
        chain = self.hashes(seq)
        for i in range(done, full):
            h, block = chain[i], table[i]
            if self.pending.get(h) == seq.seq_id:
                del self.pending[h]
            if h not in self.cached and self.hash_of[block] is None:
                self.cached[h] = block
                self.hash_of[block] = h
        self._committed[seq.seq_id] = full

    def free(self, seq_id: int) -> None:
        """Drop the sequence's references (a no-op for one that holds none);
        the tail of a sequence goes back first, so it is evicted first."""
        for block in reversed(self.tables.pop(seq_id, ())):
            self._release(block)
        self._committed.pop(seq_id, None)
        for h in self._promised.pop(seq_id, ()):
            if self.pending.get(h) == seq_id:
                del self.pending[h]

    def forget_free(self) -> None:
        """Forget the hashes of the blocks no sequence holds (vLLM's
        ``reset_prefix_cache``): a later prompt finds only what running
        sequences hold."""
        for block in self.free_blocks:
            h = self.hash_of[block]
            if h is not None:
                del self.cached[h]
                self.hash_of[block] = None

    # -- blocks ---------------------------------------------------------------

    def _take(self, block: int) -> None:
        if self.ref[block] == 0:
            del self.free_blocks[block]
        self.ref[block] += 1

    def _pop_free(self) -> int:
        """The least recently freed block, its hash forgotten (evicted)."""
        block, _ = self.free_blocks.popitem(last=False)
        h = self.hash_of[block]
        if h is not None:
            del self.cached[h]
            self.hash_of[block] = None
        self.ref[block] = 1
        return block

    def _release(self, block: int) -> None:
        self.ref[block] -= 1
        if self.ref[block] == 0:
            self.free_blocks[block] = None
            if self.hash_of[block] is None:  # nothing to find in it: reuse it first
                self.free_blocks.move_to_end(block, last=False)

    def check(self, live: set[int]) -> None:
        """Raise AssertionError unless each block is free or referenced by
        exactly the live sequences whose tables hold it, and nothing is
        kept for a sequence that is not live."""
        holders = [0] * self.num_blocks
        for seq_id, table in self.tables.items():
            assert seq_id in live, f"sequence {seq_id} holds blocks but is not live"
            assert len(table) == len(set(table)), f"sequence {seq_id} holds a block twice"
            for block in table:
                holders[block] += 1
        for block in range(self.num_blocks):
            assert self.ref[block] == holders[block], \
                f"block {block}: ref {self.ref[block]}, in {holders[block]} tables"
            assert (block in self.free_blocks) == (holders[block] == 0), f"block {block}: free list wrong"
        assert {h: b for b, h in enumerate(self.hash_of) if h is not None} == self.cached, "hash map out of step"
        assert set(self.pending.values()) | set(self._committed) | set(self._promised) <= live, \
            "blocks pending or committed for a sequence that is not live"
