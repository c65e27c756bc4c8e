"""Which sequences run in the next step, and with how many new tokens: ``Scheduler``.

Each step has a token budget (``max_num_batched_tokens``) and a row cap
(``max_num_seqs``). A step is filled in four passes:

1. decode rows: every running sequence past its prompt takes its one token,
   oldest first, so decoding never waits behind a prefill;
2. prompt chunks of running sequences (oldest first): the next chunk of the
   prompt, capped at ``long_prefill_token_threshold`` tokens while any
   sequence waits to be admitted;
3. admissions: waiting sequences join into what is left of the budget, the
   request with the fewest sequences running first (ties in arrival order),
   while rows and KV room last. A sequence whose prompt would still be
   incomplete after this step is a partial prefill; at most
   ``max_num_partial_prefills`` sequences are, and one that would make one
   too many is passed over (shorter ones behind it still join);
4. top-up: budget nobody took goes to the prompt chunks of pass 2 and 3, in
   that order (no token of the budget is left idle for a cap).

The bound this gives: a sequence that waits when a step is scheduled, whose
prompt fits in the budget left by the decode rows and the capped chunks
(``max_num_batched_tokens`` - decode rows - ``max_num_partial_prefills`` x
``long_prefill_token_threshold``, less the prompts admitted before it), is
admitted in that step and samples its first token at the end of it, if a
row and KV room are free: behind one long prompt, a short request's first
token comes from the first step scheduled after it arrives.

KV room: the default store reserves each sequence's projected bytes (prompt
plus max_tokens) when it is admitted, so a running sequence never runs out;
the prompt cache holds its entries inside the same budget (what the
reservations leave), and admission evicts them, least recently used first,
to make room. The paged store hands out blocks as tokens arrive; when none
is left for a running row, the most recently admitted sequence not yet in
this step's rows is preempted (its blocks freed, itself put back at the
front of the queue to be recomputed later) until the row fits. A request
that could never fit is refused when added.

Prefix caching (paged store): an admitted sequence takes the cached blocks
that start its tokens and computes only the rest, at least its last token
(for its logits). Admission counts only the blocks it takes off the free
list. A waiting sequence whose next block another running sequence is
computing is passed over until that block is cached.
"""

from __future__ import annotations

import heapq
from collections import deque
from typing import TYPE_CHECKING, Iterator

from pagedlm.cache.kv import STEP
from pagedlm.options import RequestTooLarge

from .sequence import Sequence, SequenceStatus

if TYPE_CHECKING:
    from pagedlm.cache.prompt import PromptCache
    from pagedlm.cache.store import KVStore

    from .block_manager import BlockManager


def _request_of(seq: Sequence) -> object:
    return seq.request_id if seq.request_id is not None else ("sequence", seq.seq_id)


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
        long_prefill_token_threshold: int = 0,
        max_num_partial_prefills: int = 1,
    ) -> None:
        self.store = store
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.kv_budget_bytes = kv_budget_bytes
        self.bytes_per_token = bytes_per_token  # per layer
        self.blocks = blocks
        self.prompt_cache = prompt_cache
        # 0: no cap (a chunk takes what the budget has left)
        self.long_prefill_token_threshold = long_prefill_token_threshold or max_num_batched_tokens
        self.max_num_partial_prefills = max_num_partial_prefills
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
                # a ring buffer grows by STEP slots up to its window; a chunk
                # lands beside the window - 1 keys it keeps
                total += per_token * min(max_len + STEP, spec.window + self.max_num_batched_tokens)
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
        """This step's rows: (sequence, new tokens), in the four passes of the module's note."""
        self._budget = self.max_num_batched_tokens
        self._preempted = False
        rows: list[list] = []  # [sequence, new tokens]
        scheduled: set[int] = set()
        cap = self.long_prefill_token_threshold if self.waiting else self.max_num_batched_tokens
        decoding, prefilling = [], []
        for seq in self.running:
            (decoding if seq.num_tokens - seq.num_computed == 1 else prefilling).append(seq)
        first_prompt_row = None  # rows before it decode (one token each)
        for seq in decoding + prefilling:  # passes 1 and 2
            if self._budget == 0:
                break
            if first_prompt_row is None and seq.num_tokens - seq.num_computed > 1:
                first_prompt_row = len(rows)
            if seq.status is SequenceStatus.RUNNING:  # not preempted for an earlier row
                self._add_row(rows, scheduled, seq, min(seq.num_tokens - seq.num_computed, self._budget, cap))
        if first_prompt_row is None:
            first_prompt_row = len(rows)
        planned = {seq.seq_id: n for seq, n in rows[first_prompt_row:]}
        partial = sum(1 for s in prefilling if s.status is SequenceStatus.RUNNING
                      and s.num_tokens - s.num_computed > planned.get(s.seq_id, 0))
        if not self._preempted:  # no admissions in a step that had to preempt: room is short already
            self._admit(rows, scheduled, partial)
        # pass 4: the budget nobody took, to the prompt rows (decode rows, first, take exactly 1)
        for row in rows[first_prompt_row:] if self._budget else ():
            seq, n = row
            extra = min(seq.num_tokens - seq.num_computed - n, self._budget)
            if extra > 0 and (self.blocks is None or self._allocate(seq, n + extra) is not None):
                row[1] += extra
                self._budget -= extra
        return [(seq, n) for seq, n in rows]

    def _add_row(self, rows: list, scheduled: set[int], seq: Sequence, n: int) -> None:
        """Schedule ``n`` tokens of running ``seq``; on the paged store, make
        room by preempting the newest running sequences without a row yet
        (``seq`` itself last)."""
        if self.blocks is not None:
            while self._allocate(seq, n) is None:
                victim = next(s for s in reversed(self.running) if s.seq_id not in scheduled)
                self.preempt(victim)
                self._preempted = True
                if victim is seq:
                    return
        rows.append([seq, n])
        scheduled.add(seq.seq_id)
        self._budget -= n

    def _admit(self, rows: list, scheduled: set[int], partial: int) -> None:
        """Pass 3: waiting sequences into the budget left, in `_admission_order`."""
        for seq in self._admission_order():
            if self._budget == 0 or len(self.running) >= self.max_num_seqs:
                return
            hit, busy = self.blocks.lookup(seq) if self.blocks is not None else ([], False)
            if busy:  # another sequence is computing its next block: take it cached, later
                continue
            start = self._cached_start(seq, hit)
            hit = hit[: self.blocks.blocks_for(start)] if hit else hit
            cap = self.long_prefill_token_threshold if len(self.waiting) > 1 else self.max_num_batched_tokens
            n = min(seq.num_tokens - start, self._budget, cap)
            incomplete = n < seq.num_tokens - start  # (a prompt-cache hit may still complete it)
            if incomplete and partial >= self.max_num_partial_prefills:
                continue
            if not self._reserve(seq, hit, start, n):
                return  # no overtaking for KV room: the next one to fit is this one
            self.waiting.remove(seq)
            # Running before its storage is attached: if attaching raises, an
            # abort finds it where it is and releases what it got.
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            self._attach(seq, hit, start)
            n = min(seq.num_tokens - seq.num_computed, n)  # a prompt-cache hit shortens it
            partial += n < seq.num_tokens - seq.num_computed
            if self.blocks is not None:
                self._allocate(seq, n)
                if seq.num_computed:
                    self.store.seed_row(seq.seq_id, self.blocks.tables[seq.seq_id], seq.num_computed)
            rows.append([seq, n])
            scheduled.add(seq.seq_id)
            self._budget -= n

    def _admission_order(self) -> Iterator[Sequence]:
        """The waiting sequences, the request with the fewest sequences running
        first (ties: the request whose first sequence waits longest), one
        sequence of a request at a time. A sequence without a request id is
        a request of its own. Lazy: the requests with nothing running come
        first in arrival order, so a queue of distinct requests costs only
        the sequences admitted."""
        waiting = list(self.waiting)
        running: dict[object, int] = {}
        for seq in self.running:
            key = _request_of(seq)
            running[key] = running.get(key, 0) + 1
        given: set[int] = set()
        first_of: set[object] = set()
        for seq in waiting:  # round one: each request with nothing running, its first sequence
            key = _request_of(seq)
            if key not in first_of:
                first_of.add(key)
                if key not in running:
                    given.add(seq.seq_id)
                    yield seq
        groups: dict[object, deque[Sequence]] = {}
        for seq in waiting:
            if seq.seq_id not in given:
                groups.setdefault(_request_of(seq), deque()).append(seq)
        heap = [(running.get(key, 0) + (key not in running), i, key) for i, key in enumerate(groups)]
        heapq.heapify(heap)
        while heap:
            count, i, key = heapq.heappop(heap)
            group = groups[key]
            yield group.popleft()
            if group:
                heapq.heappush(heap, (count + 1, i, key))

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
        elif self.prompt_cache is not None:
            if seq.prompt_logprobs is None:
                caches, seq.num_computed = self.prompt_cache.take(seq.tokens)
            self.prompt_cache.evict_to(self.kv_budget_bytes - self.reserved_bytes)  # one budget
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
            self.prompt_cache.put(seq.tokens[: seq.num_computed], caches,
                                  room=self.kv_budget_bytes - self.reserved_bytes)
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
