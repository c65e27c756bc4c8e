"""One row's place in its grammar (`RowMatcher`) and a step's masks (`masked_logits`).

A matcher's token bitmask is llguidance's: int32 words, bit ``j`` of word
``i`` allows token ``32 * i + j``, filled on the CPU; `masked_logits` moves a
step's bitmasks to the logits' device and expands them there with torch ops
(`mask_bias`), or on CUDA with one Triton kernel (`kernels.fused.masked_logits`).
llguidance.torch's own apply runs through ``torch.compile``:
its first call took 57 s on this project's 2-core CPU, 3 s on an H200 host.

A row whose grammar allows no token, or whose sampled token its grammar
refuses, is dead: `RowMatcher.is_dead`, with `error` saying why and a
warning in the log; the engine ends it. It never waits.
"""

from __future__ import annotations

import logging
import sys
from concurrent.futures import Future, ThreadPoolExecutor

import llguidance
import numpy as np
import torch

from pagedlm.kernels import fused

from .constraint import one_line

logger = logging.getLogger("pagedlm.structured")


class RowMatcher:
    """One sequence's matcher: a copy of its compiled grammar, advanced
    token by token. ``width``: the bitmask's tokens (the logits' width, or the
    tokenizer's vocabulary if that is wider)."""

    def __init__(self, compiled: Future, width: int, label: str = "") -> None:
        self._compiled = compiled  # resolves to the compiler's Grammar
        self._matcher: llguidance.LLMatcher | None = None
        self.lane = 0  # which of the grammar's compiles it copies (`_by_lane`)
        self.width = width
        self.label = label  # names the row in the log (a request id)
        self.error: str | None = None  # why the row is dead
        self.version = 0  # tokens advanced less tokens rolled back: names the state a mask is for
        self._prefetched: tuple[int, Future, int, np.ndarray | None] | None = None  # (version, the fill's
        # future, its row, the permitted words it was filled less: `prefetch_bitmasks`)

    def ready(self) -> bool:
        """Its grammar is compiled (or failed to compile: then it is dead at
        its first `fill`): the row may be scheduled. Never blocks."""
        return self._compiled.done()

    def _live(self, check: bool = True) -> llguidance.LLMatcher | None:
        """The matcher, None once dead; ``check``: ask llguidance whether an
        error reached it since (a fill's lanes need not: `_filled` asks after
        the fill, where a mask's computation can meet one)."""
        if self._matcher is None and self.error is None:
            if not self._compiled.done():
                raise RuntimeError("a row was sampled before its grammar compiled: schedule it once ready()")
            try:
                self._matcher, self.lane = self._compiled.result().copy()
            except Exception as e:  # the compile's error, raised in the pool
                self.fail(f"its grammar did not compile: {e}")
        if check and self._matcher is not None and self.error is None and self._matcher.is_error():
            self.fail(one_line(self._matcher.get_error()))
        return None if self.error is not None else self._matcher

    def fill(self, bitmask_row: torch.Tensor) -> bool:
        """Write the tokens the grammar allows next into ``bitmask_row`` (CPU
        int32, ``ceil(width / 32)`` words); False (and dead) when it allows none."""
        self._settle()
        matcher = self._live()
        if matcher is None:
            return False
        words = (self.width + 31) // 32
        if bitmask_row.dtype != torch.int32 or not bitmask_row.is_cpu or not bitmask_row.is_contiguous() \
                or bitmask_row.numel() != words:
            raise ValueError(f"a bitmask row must be a contiguous CPU int32 tensor of {words} words "
                             f"(got {bitmask_row.dtype}, {bitmask_row.device}, {tuple(bitmask_row.shape)})")
        matcher.unsafe_compute_mask_ptr(bitmask_row.data_ptr(), words * 4)
        return self._filled(bool(bitmask_row.any()))

    def _filled(self, allows_any: bool) -> bool:
        """After llguidance wrote the row (``allows_any``: a bit of it is set):
        is anything allowed (else dead)?"""
        if self._live() is None:  # the mask's computation hit an error (a parser limit)
            return False
        if not allows_any:
            self.fail("the grammar allows no token here")
            return False
        return True

    def advance(self, token: int) -> str | None:
        """The row's sampled ``token`` is part of the output; a token the
        grammar refuses kills the row. How it ends the row: "stop" (the
        output is complete: `is_finished`), "error" (dead: `is_dead`), or
        None (it goes on)."""
        self._settle()
        matcher = self._live(check=False)  # (an error a mask's computation met fails the consume below)
        if matcher is None:
            raise RuntimeError(f"advance on a dead row ({self.error})")
        self.version += 1
        if not matcher.consume_token(token):  # (True: it took the token and is not in error, by its contract)
            self.fail(f"token {token} is outside the grammar: {one_line(matcher.get_error())}")
            return "error"
        return "stop" if matcher.is_stopped() else None

    def rollback(self, n: int) -> None:
        """Forget the last ``n`` advanced tokens (a rejected speculation)."""
        self._settle()
        matcher = self._live()
        if matcher is None or not matcher.rollback(n):
            raise ValueError(f"cannot roll back {n} tokens ({self.error or one_line(matcher.get_error())})")
        self.version -= n

    @property
    def is_finished(self) -> bool:
        """The output is complete: the grammar takes nothing more (the row ends, "stop")."""
        self._settle()
        return self.error is None and self._matcher is not None and self._matcher.is_stopped() \
            and not self._matcher.is_error()

    @property
    def is_dead(self) -> bool:
        """No token can continue the output: the row must end (`error` says why)."""
        self._settle()
        return self._live() is None if self._compiled.done() else False

    def _settle(self) -> None:
        """Wait for a background fill of this row's mask (`prefetch_bitmasks`)
        to finish: llguidance's matcher is not to be used by two threads."""
        if self._prefetched is not None:
            self._prefetched[1].result()

    def fail(self, reason: str) -> None:
        """Kill the row (the sampler: the request's other rules leave nothing the grammar allows)."""
        if self.error is None:
            self.error = reason
            logger.warning("structured output%s dead-ends: %s", f" of {self.label}" if self.label else "", reason)


def _bits(octets: torch.Tensor) -> torch.Tensor:
    """bool ``[..., 8]``: each byte's bits, the lowest first."""
    return ((octets.unsqueeze(-1) >> torch.arange(8, dtype=torch.uint8, device=octets.device)) & 1).bool()


_BYTE_BIAS = torch.where(_bits(torch.arange(256, dtype=torch.uint8)), 0.0, float("-inf"))  # [256, 8]


def mask_bias(bitmask: torch.Tensor, width: int) -> torch.Tensor:
    """float32 ``[rows, width]``: 0 for the tokens int32 bitmask words ``[rows,
    ceil(width / 32)]`` allow, -inf for the rest, on the bitmask's device (its
    words little-endian, as on every torch device). On the CPU one gather from
    a table of the 256 bytes' eight biases (a third of the time of shifting the
    bits out; as fast as xgrammar's C++ kernel); on a GPU the shifts (a tenth
    of the gather's time on an H200)."""
    rows = bitmask.shape[0]
    octets = bitmask.contiguous().view(torch.uint8)
    if bitmask.device.type == "cpu":
        return _BYTE_BIAS.index_select(0, octets.view(-1).long()).view(rows, -1)[:, :width]
    return torch.where(_bits(octets).view(rows, -1)[:, :width], 0.0, float("-inf"))


MAX_LANES = 8  # a grammar's compiles at most, and the threads that fill a step's masks
_executors: dict[int, llguidance.LLExecutor] = {}  # by threads (the lanes a fill's rows are in), made at first use
_background = ThreadPoolExecutor(1, thread_name_prefix="pagedlm-masks")
_pending: Future | None = None  # the background fill in flight (one at a time)


def _by_lane(matchers: list[RowMatcher], rows) -> tuple[llguidance.LLExecutor, list[tuple[llguidance.LLMatcher, int]]]:
    """The live ones of ``matchers[rows]`` (llguidance's matcher, its row),
    grouped by lane, and an executor of a thread a lane among them: it hands
    each thread a run of the rows, so the threads mostly take different
    lanes (rows of one lane share a lock: `Grammar`). One call into it drops
    the GIL once for all the rows; a thread a lane, each calling its own
    single-thread executor, filled as fast alone (H100 host, 64 rows, 8
    lanes: 2.42 against 2.49 ms a step) but twice as slowly on a background
    thread beside the step's Python (1.5-1.6 ms against 0.6-0.67),
    each thread waiting for the GIL to start and to end its call."""
    by_lane: dict[int, list] = {}
    for j in rows:
        if (m := matchers[j]._live(check=False)) is not None:
            by_lane.setdefault(matchers[j].lane, []).append((m, j))
    threads = max(1, len(by_lane))
    if threads not in _executors:
        _executors[threads] = llguidance.LLExecutor(num_threads=threads)
    return _executors[threads], [p for live in by_lane.values() for p in live]


def _fill_rows(bitmask: np.ndarray, matchers: list[RowMatcher], rows) -> set[int]:
    """llguidance's masks of the live ones of ``matchers[rows]`` into those
    rows of ``bitmask``, the lanes at once (`_by_lane`); which rows were live."""
    executor, live = _by_lane(matchers, rows)
    _fill_live(executor, live, bitmask)
    return {j for _, j in live}


def _fill_live(executor: llguidance.LLExecutor, live: list[tuple[llguidance.LLMatcher, int]],
               bitmask: np.ndarray) -> None:
    """``executor``'s fill of the ``live`` rows (`_by_lane`) of ``bitmask``: one call."""
    if live:  # (llguidance refuses an empty list)
        executor.unsafe_compute_mask_ptr(live, bitmask.ctypes.data, bitmask.shape[1] * 4, len(bitmask))


def _new_bitmask(matchers: list[RowMatcher], pinned: bool) -> torch.Tensor:
    """An unset CPU int32 bitmask, a row per matcher (which must share a
    width), pinned if ``pinned``: llguidance writes its live rows whole, and
    `_zero_all_but` clears the rest."""
    width = matchers[0].width
    if any(m.width != width for m in matchers):
        raise ValueError(f"one step's matchers must share a width (got {sorted({m.width for m in matchers})})")
    return torch.empty((len(matchers), (width + 31) // 32), dtype=torch.int32, pin_memory=pinned)


def _zero_all_but(bitmask: np.ndarray, filled: set[int]) -> None:
    """Clear the rows of ``bitmask`` not in ``filled`` (a dead row allows nothing)."""
    for j in set(range(len(bitmask))) - filled:
        bitmask[j] = 0


GIL_SWITCH_S = 1e-4


def hand_off_the_gil_quickly() -> None:
    """Let a thread that waits for the GIL have it within `GIL_SWITCH_S`
    (Python's default: 5 ms). A background fill needs it for moments (to
    start its calls into llguidance, which then drop it): with the default
    it waits out the step thread's Python work instead of overlapping it.
    Here (2 cores, 64 rows, SmolLM2's tokenizer), a prefetch beside 3 ms of
    Python on the step's thread finished after 4.5-4.8 ms with the default,
    3.1 ms with 0.1 ms (alone: 1.8-2.4).
    Process-wide (Python has no other knob); never raises the interval."""
    sys.setswitchinterval(min(sys.getswitchinterval(), GIL_SWITCH_S))


# A row's grammar allows tokens, but its request's static rules (`fill_bitmask`'s ``permitted``) refuse them all.
NOTHING_LEFT = "the request's allowed_token_ids, bad_words or min_tokens leave no token the grammar allows"


def _permit(bitmask: np.ndarray, rows, permitted: list[np.ndarray | None]) -> tuple[np.ndarray, np.ndarray]:
    """Whether each row of ``bitmask`` allows a token (its grammar's verdict),
    then ``rows`` of it less what their ``permitted`` words refuse (rows
    sharing an array at once), and whether each row still allows one. One
    pass over the whole bitmask: a request's rules refuse tokens in a few
    words (a grammar row's: the special tokens), so only those words are cut
    out, ANDed and put back, and the pass reads the rest. On this project's
    2-core machine, 64 rows of 151,936 tokens: 63 us on the fill's thread,
    against ~136 for the three passes (two of them writing) and the row by
    row grouping before it. Host work in numpy, which drops the GIL for each pass."""
    arrays = {id(permitted[j]): permitted[j] for j in rows}
    arrays.pop(id(None), None)
    if not arrays:
        allows = bitmask.any(axis=1)
        return allows, allows
    cut = []  # per array: its rows, its words where it refuses tokens, those words' place and the rows' words there
    for words in arrays.values():
        js = [j for j in rows if permitted[j] is words]
        cols = np.flatnonzero(words != -1)
        sel = slice(None) if len(js) == len(bitmask) else np.array(js)  # (every row: in order, no index)
        at = (sel if isinstance(sel, slice) else sel[:, None], cols)
        cut.append((sel, words[cols], at, bitmask[at]))
        bitmask[at] = 0
    allows = bitmask.any(axis=1)  # (a token outside those words: allowed, and left by the rules)
    left = allows.copy()
    for sel, kept, at, words in cut:
        allows[sel] |= words.any(axis=1)
        words &= kept
        bitmask[at] = words
        left[sel] |= words.any(axis=1)
    return allows, left


def prefetch_bitmasks(matchers: list[RowMatcher], pinned: bool = False,
                      permitted: list[np.ndarray | None] | None = None) -> None:
    """Start filling ``matchers``' next bitmasks on a background thread, in
    pinned memory if ``pinned``, less what ``permitted`` refuses (as
    `fill_bitmask`): the engine calls it once a step's tokens
    have advanced them, so that the fill overlaps the host's next step (and
    the device's forward pass). The rows are picked out here, on the
    calling thread: the background thread only calls llguidance and numpy,
    which drop the GIL (its Python beside the step's cost the step more than
    the fill it moved, 2026-12-06). `fill_bitmask` takes a row from it while
    its matcher has not moved since (and its ``permitted`` is the same
    array); a matcher's own calls (advance, rollback, is_finished, is_dead,
    fill) wait for the fill first."""
    global _pending
    if not matchers:
        return
    if _pending is not None:
        _pending.result()
    permitted = permitted or [None] * len(matchers)
    out = _new_bitmask(matchers, pinned)
    bitmask = out.numpy()
    executor, live = _by_lane(matchers, range(len(matchers)))
    filled = {j for _, j in live}
    _zero_all_but(bitmask, filled)

    def fill() -> tuple[torch.Tensor, set[int], np.ndarray, np.ndarray]:
        _fill_live(executor, live, bitmask)
        return out, filled, *_permit(bitmask, filled, permitted)
    _pending = future = _background.submit(fill)
    for j, m in enumerate(matchers):
        m._prefetched = (m.version, future, j, permitted[j])


def fill_bitmask(matchers: list[RowMatcher], pinned: bool = False,
                 permitted: list[np.ndarray | None] | None = None) -> tuple[torch.Tensor, list[bool]]:
    """The step's bitmask, a CPU int32 row per matcher (its `RowMatcher.fill`,
    by an llguidance executor of a thread a lane: `Grammar`; a row
    `prefetch_bitmasks` filled for the matcher's state is taken from there),
    each row less the tokens its ``permitted`` words refuse (a row's request's
    static rules, `TokenRules.words`; None: none), and per row whether any
    token is allowed (False: dead, `NOTHING_LEFT` where the rules refused
    every token the grammar allows). ``pinned``: in pinned memory
    (llguidance writes there: a copy to a GPU then leaves without a wait and
    without a staging copy; 1.2 MB at 64 rows of a 152k vocabulary).

    Host work in numpy, not torch: a torch op on the CPU this size wakes
    torch's intra-op threads, which spin for a while beside llguidance's (a
    `benchmarks/mask_fill.py` whose own bookkeeping ran in torch filled 16
    rows in 2.4 ms on this 2-core machine, 1.2 ms with one torch thread)."""
    global _pending
    if _pending is not None:  # one fill at a time on the executors
        _pending.result()
        _pending = None
    permitted = permitted or [None] * len(matchers)
    ahead = [m._prefetched for m in matchers]
    for m in matchers:
        m._prefetched = None
    prefetched = ahead[0][1].result() if ahead[0] is not None else None
    if prefetched is not None and len(prefetched[0]) == len(matchers) and prefetched[0].is_pinned() == pinned \
            and all(a is not None and a[1] is ahead[0][1] and a[2] == j and a[0] == m.version and a[3] is p
                    for j, (a, m, p) in enumerate(zip(ahead, matchers, permitted))):
        out, filled, allows, left = prefetched  # the prefetch, row for row: taken as it is
    else:
        out = _new_bitmask(matchers, pinned)
        bitmask = out.numpy()
        allows, left = np.zeros(len(matchers), dtype=bool), np.zeros(len(matchers), dtype=bool)
        filled, todo = set(), []
        for j, (a, m) in enumerate(zip(ahead, matchers)):
            if a is not None and a[0] == m.version and a[3] is permitted[j]:
                rows, live, allowed, kept = a[1].result()
                bitmask[j] = rows[a[2]].numpy()
                allows[j], left[j] = allowed[a[2]], kept[a[2]]
                if a[2] in live:
                    filled.add(j)
            else:
                todo.append(j)
        done = _fill_rows(bitmask, matchers, todo)
        _zero_all_but(bitmask, filled | done)
        allows[todo], left[todo] = (v[todo] for v in _permit(bitmask, done, permitted))
        filled |= done
    live = [j in filled and m._filled(allowed) for j, (m, allowed) in enumerate(zip(matchers, allows.tolist()))]
    for j, kept in enumerate(left.tolist()):
        if live[j] and not kept:
            matchers[j].fail(NOTHING_LEFT)
            live[j] = False
    return out, live


def masked_logits(logits: torch.Tensor, matchers: list[RowMatcher],
                  filled: tuple[torch.Tensor, list[bool]] | None = None) -> tuple[torch.Tensor, list[bool]]:
    """``logits`` ``[rows, V]`` (a row per matcher) with the tokens each
    grammar refuses at -inf (a new tensor: the engine's logprobs read the
    model's own), and per row whether any token is allowed (False: dead). A
    NaN (a refused token's +inf logit plus -inf, or the model's) becomes -inf.
    ``filled``: what `fill_bitmask` gave for ``matchers`` already."""
    vocab = logits.shape[-1]
    if matchers[0].width < vocab:
        raise ValueError(f"the bitmasks ({matchers[0].width} tokens) must cover the {vocab} logits")
    bitmask, live = filled if filled is not None else fill_bitmask(matchers)
    bitmask = bitmask.to(logits.device)
    if fused.enabled(logits) and logits.dtype == torch.float32:
        return fused.masked_logits(logits, bitmask), live
    masked = mask_bias(bitmask, vocab).add_(logits)
    return masked.nan_to_num_(nan=float("-inf"), posinf=float("inf"), neginf=float("-inf")), live
