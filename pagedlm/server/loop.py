"""The engine loop: one thread steps the `LLMEngine`; requests join and leave between steps.

Each HTTP request that generates becomes a `Job`: its plan's prompts become
sequences in the engine (added by the loop thread, between two steps), and
every step's responses go back to the request through an asyncio queue fed
with ``loop.call_soon_threadsafe``. A request cancels its job by setting a
flag (its client went away, or its task was cancelled); the loop aborts the
job's sequences before the next step, so their KV is freed within one step
and a long prefill stops between two chunks. The request looks for its
client each time it has taken everything a step delivered, however fast
tokens flow, so a departed client costs at most one more step. Nothing here
awaits in a ``finally``, so cancellation of the request's task cannot wedge
the loop.

Limits at submission (`EngineLoop.submit`), counted in sequences (prompts x
n), before anything queues: more prompts than ``max_prompts`` or more
sequences than ``max_queue`` could ever hold is a 400 naming the limit;
more than the queue holds now is `QueueFull` (503). A job's sequences share
one request id in the engine, whose scheduler admits the request with the
fewest sequences running first, so one client's fan-out cannot starve the
others.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable

from pagedlm.options import OptionError

from .protocol import APIError

if TYPE_CHECKING:
    from pagedlm.batch.engine import LLMEngine
    from pagedlm.batch.sequence import Sequence

    from .planner import Plan
    from .metrics import Metrics

log = logging.getLogger("pagedlm.server")

_DONE = object()


class QueueFull(Exception):
    """The queue (``max_queue`` sequences waiting to be admitted) cannot take
    all of a request's sequences now."""


class Job:
    """One request's sequences, from the request's side and the loop's."""

    def __init__(self, plan: "Plan", loop: asyncio.AbstractEventLoop, label: str = "") -> None:
        self.plan = plan
        self.label = label  # the response's id: the engine's log names the request by it
        self.created = time.perf_counter()
        self.seqs: list["Sequence"] = []
        self.index_of: dict[int, int] = {}  # seq id -> the choice it answers
        self.last_token_at: dict[int, float] = {}
        self._loop = loop
        self._events: asyncio.Queue = asyncio.Queue()
        self._cancelled = threading.Event()

    def __str__(self) -> str:
        return self.label or "a request"

    # -- the loop's side --------------------------------------------------

    def emit(self, item: Any) -> None:
        """Hand ``item`` to the request (an exception is raised there)."""
        try:
            self._loop.call_soon_threadsafe(self._events.put_nowait, item)
        except RuntimeError:  # the event loop is gone (shutdown): nobody listens
            pass

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    # -- the request's side -----------------------------------------------

    def cancel(self) -> None:
        self._cancelled.set()

    async def events(self, is_disconnected: Callable[[], Any] | None = None,
                     poll_s: float = 0.25) -> AsyncIterator[Any]:
        """Everything the job emits, until it is done. ``is_disconnected`` is
        asked each time everything delivered so far has been taken (once per
        engine step while tokens flow) and every ``poll_s`` while nothing
        arrives; a disconnect cancels the job. Leaving early (break,
        exception, task cancellation) cancels it too."""
        try:
            while True:
                if is_disconnected is not None and self._events.empty() and await is_disconnected():
                    self.cancel()
                    return
                try:
                    item = await asyncio.wait_for(self._events.get(), poll_s)
                except asyncio.TimeoutError:
                    continue
                if item is _DONE:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            self.cancel()  # a no-op when the job already finished


class EngineLoop:
    """Steps ``engine`` on its own thread while any job has work."""

    def __init__(self, engine: "LLMEngine", max_queue: int, metrics: "Metrics | None" = None,
                 max_prompts: int | None = None) -> None:
        self.engine = engine
        self.max_queue = max_queue
        self.max_prompts = max_prompts  # per request; None: no limit
        self.metrics = metrics
        self._inbox: collections.deque[Job] = collections.deque()
        self._jobs: list[Job] = []  # jobs whose sequences are in the engine
        self._cond = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._work, name="pagedlm-engine", daemon=True)
        self._thread.start()

    @property
    def depth(self) -> int:
        """Sequences waiting to be admitted (not counting cancelled submissions)."""
        inbox = sum(len(job.plan.prompts) for job in list(self._inbox) if not job.cancelled)
        return inbox + self.engine.num_waiting()

    def submit(self, plan: "Plan", label: str = "") -> Job:
        """Queue ``plan`` for the engine (``label``: the request's name in the
        log); raise `APIError` (400) for a request over the limits,
        `QueueFull` when the queue cannot take all of its sequences now.
        Must be called from the event loop."""
        wanted, n = len(plan.prompts), max(1, plan.n)
        if self.max_prompts is not None and wanted // n > self.max_prompts:
            raise APIError(400, f"the request has {wanted // n} prompts; this server takes at most "
                           f"{self.max_prompts} per request (--max-prompts-per-request)",
                           param="prompt", code="too_many_prompts")
        if wanted > self.max_queue:
            raise APIError(400, f"the request asks for {wanted} sequences (prompts x n = {wanted // n} x {n}); "
                           f"at most {self.max_queue} may wait to be admitted (--max-queue)",
                           param="n" if n > 1 else "prompt", code="too_many_sequences")
        job = Job(plan, asyncio.get_running_loop(), label)
        with self._cond:
            waiting = self.depth
            if waiting + wanted > self.max_queue:
                raise QueueFull(f"the server is busy: {waiting} sequence(s) already wait to be "
                                f"admitted and this request adds {wanted} (--max-queue {self.max_queue}); "
                                f"retry later")
            self._inbox.append(job)
            self._cond.notify()
        return job

    def close(self) -> None:
        """Stop the loop after the running step; every job ends."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join(timeout=30)

    # -- the loop thread ----------------------------------------------------

    def _work(self) -> None:
        while True:
            with self._cond:
                while not self._closed and not self._inbox and not self._jobs:
                    self._cond.wait()
                if self._closed:
                    break
                new = list(self._inbox)
                self._inbox.clear()
            for job in new:
                self._admit(job)
            for job in [j for j in self._jobs if j.cancelled]:
                self._end(job)
            if not self.engine.has_unfinished():
                continue
            try:
                outputs = self.engine.step()
            except Exception as e:  # the step failed: its jobs fail, the server goes on
                log.exception("engine step failed")
                for job in list(self._jobs):
                    job.emit(e)
                    self._end(job)
                continue
            self._deliver(outputs)
        for job in list(self._inbox) + list(self._jobs):
            self._end(job)

    def _admit(self, job: Job) -> None:
        if job.cancelled:
            job.emit(_DONE)
            return
        try:
            for index, (ids, params) in enumerate(zip(job.plan.prompts, job.plan.options)):
                (seq,) = self.engine.add_request(ids, params, request_id=job)  # one request to the scheduler
                job.seqs.append(seq)
                job.index_of[seq.seq_id] = index
        except OptionError as e:  # e.g. a request the KV budget can never hold
            job.emit(e)
            self._end(job)
            return
        self._jobs.append(job)

    def _deliver(self, outputs) -> None:
        now = time.perf_counter()
        for out in outputs:
            job = out.seq.request_id
            index = job.index_of[out.seq.seq_id]
            if self.metrics is not None:
                last = job.last_token_at.get(index)
                (self.metrics.ttft if last is None else self.metrics.itl).observe(
                    now - (job.created if last is None else last))
            job.last_token_at[index] = now
            job.emit((index, out))
        for job in [j for j in self._jobs if all(s.is_finished for s in j.seqs)]:
            self._end(job)

    def _end(self, job: Job) -> None:
        """Abort what is left of ``job``, count it, tell the request it is over."""
        for seq in job.seqs:
            self.engine.abort(seq)
        if job in self._jobs:
            self._jobs.remove(job)
            if self.metrics is not None:
                self.metrics.observe_request(job.created, job.seqs)
            lengths = [s.num_prompt for s in job.seqs] or [0]
            log.info("request: %d sequence(s), prompt tokens min %d / max %d / total %d, %d generated, %s",
                     len(job.seqs), min(lengths), max(lengths), sum(lengths),
                     sum(len(s.output_ids) for s in job.seqs),
                     "cancelled" if job.cancelled else "finished")
        job.emit(_DONE)
