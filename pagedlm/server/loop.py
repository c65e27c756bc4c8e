"""The engine loop: one thread steps the `LLMEngine`; requests join and leave between steps.

Each HTTP request that generates becomes a `Job`: its plan's prompts become
sequences in the engine (added by the loop thread, between two steps), and
every step's responses go back to the request through an asyncio queue fed
with ``loop.call_soon_threadsafe``. A request cancels its job by setting a
flag (its client went away, or its task was cancelled); the loop aborts the
job's sequences before the next step, so their KV is freed within one step
and a long prefill stops between two chunks. Nothing here awaits in a
``finally``, so cancellation of the request's task cannot wedge the loop.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable

from pagedlm.options import OptionError

if TYPE_CHECKING:
    from pagedlm.batch.engine import LLMEngine
    from pagedlm.batch.sequence import Sequence

    from .engine import Plan
    from .metrics import Metrics

log = logging.getLogger("pagedlm.server")

_DONE = object()


class QueueFull(Exception):
    """``max_queue`` sequences already wait to be admitted."""


class Job:
    """One request's sequences, from the request's side and the loop's."""

    def __init__(self, plan: "Plan", loop: asyncio.AbstractEventLoop) -> None:
        self.plan = plan
        self.created = time.perf_counter()
        self.seqs: list["Sequence"] = []
        self.last_token_at: dict[int, float] = {}
        self._loop = loop
        self._events: asyncio.Queue = asyncio.Queue()
        self._cancelled = threading.Event()

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
        """Everything the job emits, until it is done. While nothing arrives,
        ``is_disconnected`` is polled every ``poll_s``; a disconnect cancels
        the job. Leaving early (break, exception, task cancellation) cancels
        it too."""
        try:
            while True:
                try:
                    item = await asyncio.wait_for(self._events.get(), poll_s)
                except asyncio.TimeoutError:
                    if is_disconnected is not None and await is_disconnected():
                        self.cancel()
                        return
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

    def __init__(self, engine: "LLMEngine", max_queue: int, metrics: "Metrics | None" = None) -> None:
        self.engine = engine
        self.max_queue = max_queue
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
        return inbox + len(self.engine.scheduler.waiting)

    @property
    def running(self) -> int:
        return len(self.engine.scheduler.running)

    def submit(self, plan: "Plan") -> Job:
        """Queue ``plan`` for the engine, or raise `QueueFull`. Must be called
        from the event loop."""
        job = Job(plan, asyncio.get_running_loop())
        with self._cond:
            waiting = self.depth
            if waiting and waiting + len(plan.prompts) > self.max_queue:
                raise QueueFull(f"the server is busy: {waiting} sequence(s) already wait to be "
                                f"admitted (--max-queue {self.max_queue}); retry later")
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
                (seq,) = self.engine.add_request(ids, params, request_id=(job, index))
                job.seqs.append(seq)
        except OptionError as e:  # e.g. a request the KV budget can never hold
            job.emit(e)
            self._end(job)
            return
        self._jobs.append(job)

    def _deliver(self, outputs) -> None:
        now = time.perf_counter()
        for out in outputs:
            job, index = out.seq.request_id
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
                self.metrics.prompt_tokens.inc(sum(s.num_prompt for s in job.seqs))
                self.metrics.generation_tokens.inc(sum(len(s.output_ids) for s in job.seqs))
            log.info("request: %d sequence(s), prompts %s tokens, %d generated, %s",
                     len(job.seqs), "/".join(str(s.num_prompt) for s in job.seqs),
                     sum(len(s.output_ids) for s in job.seqs),
                     "cancelled" if job.cancelled else "finished")
        job.emit(_DONE)
