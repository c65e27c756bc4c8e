"""The serial lane: one generation at a time on a worker thread, a bounded queue.

Each HTTP request that generates becomes a `Job`. The lane's one worker
thread runs jobs in arrival order (torch releases the GIL, so the event loop
keeps serving while a job runs). A job talks back to its request through an
asyncio queue fed with ``loop.call_soon_threadsafe``; the request cancels it
by setting a flag, which the job checks after every decode step. A job
cancelled while it waits is dropped without running. Nothing here awaits in
a ``finally``, so cancellation of the request's task cannot wedge the lane.
"""

from __future__ import annotations

import asyncio
import collections
import threading
import time
from typing import Any, AsyncIterator, Callable

_DONE = object()


class QueueFull(Exception):
    """The lane is busy and ``max_queue`` requests already wait."""


class Job:
    """One request's work, run on the lane's thread."""

    def __init__(self, work: Callable[["Job"], None], loop: asyncio.AbstractEventLoop) -> None:
        self.work = work
        self.created = time.perf_counter()
        self._loop = loop
        self._events: asyncio.Queue = asyncio.Queue()
        self._cancelled = threading.Event()

    # -- the worker's side ----------------------------------------------

    def emit(self, item: Any) -> None:
        """Hand ``item`` to the request (an exception is raised there)."""
        try:
            self._loop.call_soon_threadsafe(self._events.put_nowait, item)
        except RuntimeError:  # the event loop is gone (shutdown): nobody listens
            pass

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    # -- the request's side ---------------------------------------------

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


class SerialLane:
    """Runs `Job`s one at a time; at most ``max_queue`` wait behind the running one."""

    def __init__(self, max_queue: int) -> None:
        self.max_queue = max_queue
        self._pending: collections.deque[Job] = collections.deque()
        self._cond = threading.Condition()
        self._busy = False
        self._closed = False
        self._thread = threading.Thread(target=self._work, name="pagedlm-lane", daemon=True)
        self._thread.start()

    @property
    def depth(self) -> int:
        """Jobs waiting (not counting the running one, nor cancelled ones)."""
        return sum(1 for job in list(self._pending) if not job.cancelled)

    @property
    def busy(self) -> bool:
        return self._busy

    def submit(self, work: Callable[[Job], None]) -> Job:
        """Queue ``work`` (called on the lane thread with its `Job`), or raise
        `QueueFull`. Must be called from the event loop."""
        job = Job(work, asyncio.get_running_loop())
        with self._cond:
            live = self.depth  # cancelled jobs still queued do not count
            if (self._busy or live) and live >= self.max_queue:
                raise QueueFull(
                    f"the server is busy: {live} request(s) already wait "
                    f"(--max-queue {self.max_queue}); retry later"
                )
            self._pending.append(job)
            self._cond.notify()
        return job

    def _work(self) -> None:
        while True:
            with self._cond:
                while not self._pending and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                job = self._pending.popleft()
                self._busy = not job.cancelled
            try:
                if not job.cancelled:
                    job.work(job)
            except BaseException as e:  # handed to the request, which answers for it
                job.emit(e)
            finally:
                self._busy = False
                job.emit(_DONE)

    def close(self) -> None:
        """Stop the worker after the running job; waiting jobs are dropped."""
        with self._cond:
            self._closed = True
            for job in self._pending:
                job.cancel()
                job.emit(_DONE)
            self._pending.clear()
            self._cond.notify()
