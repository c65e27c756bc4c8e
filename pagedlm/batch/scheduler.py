"""Which sequences run in the next step, and with how many new tokens: ``Scheduler``.

Each step has a token budget (``max_num_batched_tokens``) and a row cap
(``max_num_seqs``). Running sequences come first, in admission order: a
decode row takes one token, a row still in its prompt takes the next chunk
of it, so a long prompt is prefilled over several steps while the others
keep decoding. Waiting sequences are then admitted in arrival order while
budget, rows and KV room last.

KV room: the default store reserves each sequence's projected bytes (prompt
plus max_tokens) when it is admitted, so a running sequence never runs out.
The paged store hands out blocks as tokens arrive; when none is left for a
running row, the most recently admitted sequence is preempted (its blocks
freed, itself put back at the front of the queue to be recomputed later)
until the row fits. A request that could never fit is refused when added.

Prefix caching (paged store): an admitted sequence takes the cached blocks
that start its tokens and computes only the rest, at least its last token
(for its logits). Admission counts only the blocks it takes off the free
list. A waiting sequence whose next block another running sequence is
computing is passed over until that block is cached.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

from pagedlm.cache.kv import STEP
from pagedlm.options import RequestTooLarge

from .sequence import Sequence, SequenceStatus

if TYPE_CHECKING:
    from pagedlm.cache.prompt import PromptCache
    from pagedlm.cache.store import KVStore

    from .block_manager import BlockManager


class Scheduler:
    def __init__(
        self,
        store: "KVStore",
        max_num_seqs: int,
        max_num_batched_tokens: int,
        kv_budget_bytes: int,
        bytes_per_token: list[int],
        blocks: "BlockManager | None" = None,
        prompt_cache: "PromptCache | None" = None,
    ) -> None:
        self.store = store
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.kv_budget_bytes = kv_budget_bytes
        self.bytes_per_token = bytes_per_token  # per layer
        self.blocks = blocks
        self.prompt_cache = prompt_cache
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admission order
        self.reserved_bytes = 0  # default store: projected bytes of the running sequences
        self.num_preemptions = 0

    # -- admission arithmetic ----------------------------------------------

    def projected_bytes(self, max_len: int) -> int:
        """Default store: the most KV bytes a sequence of up to ``max_len``
        tokens holds (buffers grow by STEP tokens; a sliding layer keeps its
        window plus one step's tokens)."""
        grown = -(-max_len // STEP) * STEP
        total = 0
        for per_token, spec in zip(self.bytes_per_token, self.store.specs):
            if spec.window is None:
                total += per_token * grown
            else:
                total += per_token * min(max_len, spec.window + self.max_num_batched_tokens)
        return total

    def check_fits(self, num_prompt: int, max_tokens: int) -> None:
        """Raise `RequestTooLarge` for a sequence that could never run alone.
        (The paged pool holds one sequence of max_model_len at least: the
        engine refuses to start otherwise, and longer requests are refused
        before they get here.)"""
        if self.blocks is not None:
            return
        need = self.projected_bytes(num_prompt + max_tokens)
        if need > self.kv_budget_bytes:
            raise RequestTooLarge(
                f"the request needs up to {need} bytes of KV (prompt {num_prompt} + max_tokens "
                f"{max_tokens}); the KV budget is {self.kv_budget_bytes} bytes "
                f"(raise --kv-budget-bytes or lower max_tokens)")

    # -- the queue ----------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        self.check_fits(seq.num_prompt, seq.params.max_tokens)
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[tuple[Sequence, int]]:
        """This step's rows: (sequence, new tokens), running ones first."""
        budget = self.max_num_batched_tokens
        rows: list[tuple[Sequence, int]] = []
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_tokens - seq.num_computed, budget)
            if self.blocks is not None:
                while self._allocate(seq, n) is None:
                    preempted = True
                    victim = self.running[-1]
                    self.preempt(victim)
                    if victim is seq:
                        break
                if seq.status is not SequenceStatus.RUNNING:
                    break  # it preempted itself: it was the last running
            rows.append((seq, n))
            budget -= n
            i += 1
        # No admissions in a step that had to preempt: room is short already.
        w = 0
        while w < len(self.waiting) and budget > 0 and len(self.running) < self.max_num_seqs and not preempted:
            seq = self.waiting[w]
            hit, busy = self.blocks.lookup(seq) if self.blocks is not None else ([], False)
            if busy:  # another sequence is computing its next block: take it cached, later
                w += 1
                continue
            start = self._cached_start(seq, hit)
            hit = hit[: self.blocks.blocks_for(start)] if hit else hit
            if not self._reserve(seq, hit, start, min(seq.num_tokens - start, budget)):
                break
            del self.waiting[w]
            # Running before its storage is attached: if attaching raises, an
            # abort finds it where it is and releases what it got.
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            self._attach(seq, hit, start)
            n = min(seq.num_tokens - seq.num_computed, budget)  # a prompt-cache hit shortens it
            if self.blocks is not None:
                self._allocate(seq, n)
                if seq.num_computed:
                    self.store.seed_row(seq.seq_id, self.blocks.tables[seq.seq_id], seq.num_computed)
            rows.append((seq, n))
            budget -= n
        return rows

    def _allocate(self, seq: Sequence, n: int) -> list[tuple[int, int]] | None:
        """Blocks for ``seq``'s next ``n`` tokens; a cached or shared block they
        land in is copied first. None when the pool is short."""
        copies = self.blocks.allocate_slots(seq.seq_id, seq.num_computed + n, write_from=seq.num_computed)
        if copies:
            self.store.pools.copy_blocks([s for s, _ in copies], [d for _, d in copies])
        return copies

    def _cached_start(self, seq: Sequence, hit: list[int]) -> int:
        """How many of ``seq``'s tokens the cached blocks ``hit`` spare: all
        but the last (whose logits it needs), and none it has yet to score."""
        limit = seq.num_tokens - 1
        if seq.prompt_logprobs is not None:
            limit = min(limit, len(seq.prompt_logprobs))
        return min(len(hit) * self.blocks.block_size, limit) if hit else 0

    def _reserve(self, seq: Sequence, hit: list[int], start: int, n: int) -> bool:
        if self.blocks is not None:
            return self.blocks.can_allocate(self.blocks.admission_cost(hit, start, start + n))
        need = self.projected_bytes(seq.max_len)
        if self.reserved_bytes + need > self.kv_budget_bytes:
            return False
        self.reserved_bytes += need
        return True

    def _attach(self, seq: Sequence, hit: list[int], start: int) -> None:
        """Give an admitted sequence its storage: cached blocks covering its
        first ``start`` tokens (paged), or per-row caches that a prompt-cache
        hit lends already holding a prefix of its tokens (default store)."""
        caches = None
        if self.blocks is not None:
            self.blocks.admit(seq, hit, start)
            seq.num_computed = start
        elif self.prompt_cache is not None and seq.prompt_logprobs is None:
            caches, seq.num_computed = self.prompt_cache.take(seq.tokens)
        if not seq.output_ids:  # a first admission (a recompute after preemption is not a cache hit)
            seq.num_cached = seq.num_computed
        self.store.add_row(seq.seq_id, caches)

    def _detach(self, seq: Sequence, keep: bool) -> None:
        """Release everything ``seq`` holds; with ``keep`` its caches go to the prompt cache."""
        caches = self.store.pop_row(seq.seq_id)
        if self.blocks is not None:
            self.blocks.free(seq.seq_id)
        else:
            self.reserved_bytes -= self.projected_bytes(seq.max_len)
        if keep and self.prompt_cache is not None:
            self.prompt_cache.put(seq.tokens[: seq.num_computed], caches)
        else:
            for cache in caches:
                if cache is not None:
                    cache.dispose()

    # -- state changes -------------------------------------------------------

    def preempt(self, seq: Sequence) -> None:
        """Free ``seq``'s storage and queue it first, to be recomputed from its tokens."""
        self.running.remove(seq)
        self._detach(seq, keep=False)
        seq.status = SequenceStatus.WAITING
        seq.num_computed = 0
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """End ``seq`` (``stop``, ``length`` or ``abort``) and release what it holds."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
            self._detach(seq, keep=reason != "abort")
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    def abort(self, seq: Sequence) -> None:
        if not seq.is_finished:
            self.finish(seq, "abort")
