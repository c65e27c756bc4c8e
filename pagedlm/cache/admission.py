"""How a sequence gets KV room and gives it back: one interface
(``Admission``), two policies, chosen by the layout.

- ``BlockAdmission`` (the paged store): a sequence starts from the cached
  blocks that begin its tokens (``lookup``), is admitted when the free list
  holds what it takes (``reserve``: new blocks, idle cached ones it
  revives, a copy of a cached block it writes into), takes blocks as its
  tokens arrive (``allocate``, copy-on-write), makes its full blocks
  findable after each step (``commit``) and hands its blocks back
  (``release``). ``allocate`` answers False when the pool is short: the
  scheduler then preempts until the row fits.
- ``ByteAdmission`` (the default store): a sequence is admitted when the
  budget holds its projected bytes (prompt plus max_tokens) beside the
  other reservations, so it never runs short afterwards; the prompt cache
  lends it caches already holding a prefix of its tokens and keeps its
  caches when it ends, inside what the reservations leave of the same
  budget.

The scheduler calls, for a waiting sequence: ``lookup`` (None: wait),
``reserve``, ``attach``; for a running one, ``allocate`` before each step's
tokens; after each step ``commit``; at the end ``release``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from pagedlm.cache.blocks import BlockManager, Tokens
from pagedlm.cache.kv import STEP
from pagedlm.options import RequestTooLarge

if TYPE_CHECKING:
    from pagedlm.cache.base import Cache
    from pagedlm.cache.layout import KVLayout
    from pagedlm.cache.prompt import PromptCache
    from pagedlm.cache.store import KVStore


class Admitted(Tokens, Protocol):
    """What admission reads and sets of a sequence (``batch.sequence.Sequence``)."""

    num_computed: int
    prompt_logprobs: list | None  # None: its prompt is not scored

    @property
    def max_len(self) -> int: ...


@dataclass(frozen=True)
class CachedPrefix:
    """How a waiting sequence would start: its first ``tokens`` tokens have
    keys already, in ``blocks`` (the paged store's cached blocks)."""

    tokens: int
    blocks: tuple[int, ...] = ()


NOTHING_CACHED = CachedPrefix(0)


class Admission(Protocol):
    def check_fits(self, num_prompt: int, max_tokens: int) -> None:
        """Raise `RequestTooLarge` for a sequence that could never run alone."""
        ...

    def lookup(self, seq: Admitted) -> CachedPrefix | None:
        """What ``seq`` would start from; None: wait (another sequence is
        computing its next block)."""
        ...

    def reserve(self, seq: Admitted, prefix: CachedPrefix, n: int) -> bool:
        """Whether ``seq``, starting from ``prefix`` with ``n`` tokens this
        step, has room; when it has, the room is its own until ``attach``."""
        ...

    def attach(self, seq: Admitted, prefix: CachedPrefix, n: int) -> None:
        """Give reserved ``seq`` its storage (a row in the store, its first
        ``n`` tokens' room) and set ``num_computed`` to the tokens it starts with."""
        ...

    def allocate(self, seq: Admitted, n: int) -> bool:
        """Room for running ``seq``'s next ``n`` tokens; False (nothing
        taken) when there is none."""
        ...

    def commit(self, seq: Admitted) -> None:
        """``seq`` has computed ``num_computed`` tokens (after a step)."""
        ...

    def release(self, seq: Admitted, keep: bool) -> None:
        """Free what ``seq`` holds; with ``keep`` its caches may be kept for reuse."""
        ...


def _dispose(caches: list[Cache | None]) -> None:
    for cache in caches:
        if cache is not None:
            cache.dispose()


class BlockAdmission:
    def __init__(self, blocks: BlockManager, store: KVStore) -> None:
        self.blocks, self.store = blocks, store

    def check_fits(self, num_prompt: int, max_tokens: int) -> None:
        """Nothing to refuse: the pool holds one sequence of max_model_len at
        least (``plan_layout`` refuses to start otherwise), and longer
        requests are refused before they get here."""

    def lookup(self, seq: Admitted) -> CachedPrefix | None:
        hit, busy = self.blocks.lookup(seq)
        if busy:
            return None
        if not hit:
            return NOTHING_CACHED
        # All of the hit but the last token (whose logits the sequence
        # needs), and none of the prompt it has yet to score.
        limit = seq.num_tokens - 1
        if seq.prompt_logprobs is not None:
            limit = min(limit, len(seq.prompt_logprobs))
        start = min(len(hit) * self.blocks.block_size, limit)
        return CachedPrefix(start, tuple(hit[: self.blocks.blocks_for(start)]))

    def reserve(self, seq: Admitted, prefix: CachedPrefix, n: int) -> bool:
        cost = self.blocks.admission_cost(prefix.blocks, prefix.tokens, prefix.tokens + n)
        return self.blocks.can_allocate(cost)

    def attach(self, seq: Admitted, prefix: CachedPrefix, n: int) -> None:
        self.blocks.admit(seq, list(prefix.blocks), prefix.tokens)
        seq.num_computed = prefix.tokens
        self.store.add_row(seq.seq_id)
        self.allocate(seq, n)  # (reserve counted it)
        if seq.num_computed:
            self.store.seed_row(seq.seq_id, self.blocks.tables[seq.seq_id], seq.num_computed)

    def allocate(self, seq: Admitted, n: int) -> bool:
        """Blocks for ``seq``'s next ``n`` tokens; a cached or shared block
        they land in is copied first."""
        copies = self.blocks.allocate_slots(seq.seq_id, seq.num_computed + n, write_from=seq.num_computed)
        if copies:
            self.store.pools.copy_blocks([s for s, _ in copies], [d for _, d in copies])
        return copies is not None

    def commit(self, seq: Admitted) -> None:
        self.blocks.commit(seq, seq.num_computed)

    def release(self, seq: Admitted, keep: bool) -> None:
        caches = self.store.pop_row(seq.seq_id)
        self.blocks.free(seq.seq_id)
        _dispose(caches)


class ByteAdmission:
    def __init__(self, layout: KVLayout, store: KVStore, prompt_cache: PromptCache | None,
                 max_num_batched_tokens: int) -> None:
        self.layout, self.store, self.prompt_cache = layout, store, prompt_cache
        self.max_num_batched_tokens = max_num_batched_tokens
        self.reserved_bytes = 0  # projected bytes of the running sequences

    def projected_bytes(self, max_len: int) -> int:
        """The most KV bytes a sequence of up to ``max_len`` tokens holds
        (buffers grow by STEP tokens; a sliding layer keeps its window plus
        one step's tokens)."""
        grown = -(-max_len // STEP) * STEP
        total = 0
        for per_token, spec in zip(self.layout.bytes_per_token, self.layout.specs):
            if spec.window is None:
                total += per_token * grown
            else:
                # a ring buffer grows by STEP slots up to its window; a chunk
                # lands beside the window - 1 keys it keeps
                total += per_token * min(max_len + STEP, spec.window + self.max_num_batched_tokens)
        return total

    def longest_held(self, limit: int) -> int:
        """The most tokens, up to ``limit``, of one sequence the budget holds
        (0: not one growth step's worth)."""
        lo, hi = 0, limit  # projected_bytes grows with the length: bisect
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.projected_bytes(mid) <= self.layout.budget_bytes:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def check_fits(self, num_prompt: int, max_tokens: int) -> None:
        need = self.projected_bytes(num_prompt + max_tokens)
        if need > self.layout.budget_bytes:
            raise RequestTooLarge(
                f"the request needs up to {need} bytes of KV (prompt {num_prompt} + max_tokens "
                f"{max_tokens}); the KV budget is {self.layout.budget_bytes} bytes "
                f"(raise --kv-budget-bytes or lower max_tokens)")

    def lookup(self, seq: Admitted) -> CachedPrefix:
        return NOTHING_CACHED  # a prompt-cache hit is taken in attach, once the room is reserved

    def reserve(self, seq: Admitted, prefix: CachedPrefix, n: int) -> bool:
        need = self.projected_bytes(seq.max_len)
        if self.reserved_bytes + need > self.layout.budget_bytes:
            return False
        self.reserved_bytes += need
        return True

    def attach(self, seq: Admitted, prefix: CachedPrefix, n: int) -> None:
        caches = None
        if self.prompt_cache is not None:
            if seq.prompt_logprobs is None:
                caches, seq.num_computed = self.prompt_cache.take(seq.tokens)
            self.prompt_cache.evict_to(self.layout.budget_bytes - self.reserved_bytes)  # one budget
        self.store.add_row(seq.seq_id, caches)

    def allocate(self, seq: Admitted, n: int) -> bool:
        return True  # reserved at admission

    def commit(self, seq: Admitted) -> None:
        pass

    def release(self, seq: Admitted, keep: bool) -> None:
        caches = self.store.pop_row(seq.seq_id)
        self.reserved_bytes -= self.projected_bytes(seq.max_len)
        if keep and self.prompt_cache is not None:
            self.prompt_cache.put(seq.tokens[: seq.num_computed], caches,
                                  room=self.layout.budget_bytes - self.reserved_bytes)
        else:
            _dispose(caches)
