"""Which sequences run in the next step, and with how many new tokens: ``Scheduler``.

Each step has a token budget (``max_num_batched_tokens``) and a row cap
(``max_num_seqs``). A step is filled in four passes:

1. decode rows: every running sequence past its prompt takes its one token,
   oldest first, so decoding never waits behind a prefill; with speculative
   decoding, once pass 2 has run, also the tokens proposed after it
   (``Sequence.draft``) as far as the budget goes, and none when its KV
   room is not free (a proposal preempts no one);
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

Structured output: a waiting sequence whose grammar is still compiling (on
the compiler's threads) is passed over until it is ready; nothing waits for it.

The two kinds of KV room are two policies behind one interface
(``cache.admission``); the scheduler holds one and never asks which.
"""

from __future__ import annotations

import heapq
from collections import deque
from typing import TYPE_CHECKING, Iterator

from .sequence import Sequence, SequenceStatus

if TYPE_CHECKING:
    from pagedlm.cache.admission import Admission


def _request_of(seq: Sequence) -> object:
    return seq.request_id if seq.request_id is not None else ("sequence", seq.seq_id)


class Scheduler:
    def __init__(
        self,
        admission: Admission,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        long_prefill_token_threshold: int = 0,
        max_num_partial_prefills: int = 1,
    ) -> None:
        self.admission = admission
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        # 0: no cap (a chunk takes what the budget has left)
        self.long_prefill_token_threshold = long_prefill_token_threshold or max_num_batched_tokens
        self.max_num_partial_prefills = max_num_partial_prefills
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admission order
        self.num_preemptions = 0

    # -- the queue ----------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        self.admission.check_fits(seq.num_prompt, seq.params.max_tokens)
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
            if not seq.ends_when_known:  # (async scheduling: its last token is on its way)
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
        self._add_drafts(rows[:first_prompt_row])
        planned = {seq.seq_id: n for seq, n in rows[first_prompt_row:]}
        partial = sum(1 for s in prefilling if s.status is SequenceStatus.RUNNING
                      and s.num_tokens - s.num_computed > planned.get(s.seq_id, 0))
        if not self._preempted:  # no admissions in a step that had to preempt: room is short already
            self._admit(rows, scheduled, partial)
        # pass 4: the budget nobody took, to the prompt rows (decode rows, first, take exactly 1)
        for row in rows[first_prompt_row:] if self._budget else ():
            seq, n = row
            extra = min(seq.num_tokens - seq.num_computed - n, self._budget)
            if extra > 0 and self.admission.allocate(seq, n + extra):
                row[1] += extra
                self._budget -= extra
        return [(seq, n) for seq, n in rows]

    def _add_drafts(self, decode_rows: list) -> None:
        """Pass 1b, after the prompt chunks: each decode row also feeds the
        tokens proposed after it (``seq.draft``), as far as the budget goes
        and only when its room is free (a proposal preempts no one); the
        rest of a draft is dropped."""
        for row in decode_rows:
            seq = row[0]
            del seq.draft[self._budget :]
            if seq.draft and self.admission.allocate(seq, 1 + len(seq.draft)):
                row[1] += len(seq.draft)
                self._budget -= len(seq.draft)
            else:
                seq.draft.clear()

    def _add_row(self, rows: list, scheduled: set[int], seq: Sequence, n: int) -> None:
        """Schedule ``n`` tokens of running ``seq``; when they have no room
        (the paged store's pool is short), make it by preempting the newest
        running sequences without a row yet (``seq`` itself last)."""
        while not self.admission.allocate(seq, n):
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
            if seq.matcher is not None and not seq.matcher.ready():  # its grammar compiles: others go first
                continue
            prefix = self.admission.lookup(seq)
            if prefix is None:  # another sequence is computing its next block: take it cached, later
                continue
            start = prefix.tokens
            cap = self.long_prefill_token_threshold if len(self.waiting) > 1 else self.max_num_batched_tokens
            n = min(seq.num_tokens - start, self._budget, cap)
            incomplete = n < seq.num_tokens - start  # (a prompt-cache hit may still complete it)
            if incomplete and partial >= self.max_num_partial_prefills:
                continue
            if not self.admission.reserve(seq, prefix, n):
                return  # no overtaking for KV room: the next one to fit is this one
            self.waiting.remove(seq)
            # Running before its storage is attached: if attaching raises, an
            # abort finds it where it is and releases what it got.
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            self.admission.attach(seq, prefix, n)
            if not seq.output_ids:  # a first admission (a recompute after preemption is not a cache hit)
                seq.num_cached = seq.num_computed
            n = min(seq.num_tokens - seq.num_computed, n)  # a prompt-cache hit shortens it
            partial += n < seq.num_tokens - seq.num_computed
            rows.append([seq, n])
            scheduled.add(seq.seq_id)
            self._budget -= n

    def _admission_order(self) -> Iterator[Sequence]:
        """The waiting sequences, the request with the fewest sequences running
        first (ties: the request whose first sequence waits longest), one
        sequence of a request at a time. A sequence without a request id is
        a request of its own. Lazy: the requests with nothing running come
        first in arrival order, so a queue of distinct requests costs only
        the sequences admitted (and an empty queue nothing: the running
        sequences are counted only when some wait)."""
        if not self.waiting:
            return
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

    # -- state changes -------------------------------------------------------

    def preempt(self, seq: Sequence) -> None:
        """Free ``seq``'s storage and queue it first, to be recomputed from its tokens."""
        self.running.remove(seq)
        self.admission.release(seq, keep=False)
        seq.draft.clear()
        seq.status = SequenceStatus.WAITING
        seq.num_computed = 0
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """End ``seq`` (``stop``, ``length`` or ``abort``) and release what it holds."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
            self.admission.release(seq, keep=reason != "abort")
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    def abort(self, seq: Sequence) -> None:
        if not seq.is_finished:
            self.finish(seq, "abort")
