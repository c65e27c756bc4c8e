"""The server's serial lane and request parsing, without a model."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from pagedlm.server.lane import QueueFull, SerialLane
from pagedlm.server.protocol import APIError, ChatRequest, CompletionRequest, parse


def run(coro):
    return asyncio.run(coro)


async def collect(job) -> list:
    return [item async for item in job.events()]


def test_jobs_run_one_at_a_time_in_arrival_order():
    lane = SerialLane(max_queue=8)
    order, active, overlap = [], [0], [False]

    def work(i):
        def go(job):
            active[0] += 1
            overlap[0] |= active[0] > 1
            time.sleep(0.02)
            order.append(i)
            job.emit(i)
            active[0] -= 1
        return go

    async def main():
        jobs = [lane.submit(work(i)) for i in range(4)]
        return [await collect(j) for j in jobs]

    assert run(main()) == [[0], [1], [2], [3]]
    assert order == [0, 1, 2, 3] and not overlap[0]
    lane.close()


def test_queue_full_when_busy_and_max_queue_wait():
    lane = SerialLane(max_queue=1)
    release = threading.Event()

    async def main():
        running = lane.submit(lambda job: release.wait(5))
        while not lane.busy:
            await asyncio.sleep(0.005)
        waiting = lane.submit(lambda job: None)
        assert lane.depth == 1
        with pytest.raises(QueueFull, match="--max-queue 1"):
            lane.submit(lambda job: None)
        release.set()
        await collect(running)
        await collect(waiting)
        lane.submit(lambda job: None)  # room again

    run(main())
    lane.close()


def test_zero_queue_admits_only_when_idle():
    lane = SerialLane(max_queue=0)
    release = threading.Event()

    async def main():
        first = lane.submit(lambda job: release.wait(5))
        with pytest.raises(QueueFull):
            lane.submit(lambda job: None)
        release.set()
        await collect(first)

    run(main())
    lane.close()


def test_a_job_cancelled_while_queued_never_runs_and_frees_its_place():
    lane = SerialLane(max_queue=1)
    release = threading.Event()
    ran = []

    async def main():
        running = lane.submit(lambda job: release.wait(5))
        while not lane.busy:
            await asyncio.sleep(0.005)
        queued = lane.submit(lambda job: ran.append("queued"))
        queued.cancel()
        assert lane.depth == 0
        after = lane.submit(lambda job: ran.append("after"))
        release.set()
        await collect(running)
        assert await collect(queued) == []
        await collect(after)

    run(main())
    assert ran == ["after"]
    lane.close()


def test_leaving_the_event_stream_cancels_the_running_job():
    lane = SerialLane(max_queue=1)
    steps = []

    def work(job):
        for i in range(500):
            if job.cancelled:
                return
            steps.append(i)
            job.emit(i)
            time.sleep(0.002)

    async def main():
        job = lane.submit(work)
        async for item in job.events():
            if item == 2:
                break
        while lane.busy:
            await asyncio.sleep(0.005)

    run(main())
    assert 3 <= len(steps) < 500
    lane.close()


def test_an_exception_in_the_job_is_raised_to_the_request():
    lane = SerialLane(max_queue=1)

    def work(job):
        job.emit("first")
        raise RuntimeError("boom")

    async def main():
        got = []
        with pytest.raises(RuntimeError, match="boom"):
            async for item in lane.submit(work).events():
                got.append(item)
        return got

    assert run(main()) == ["first"]
    lane.close()


def test_disconnect_polling_cancels_a_silent_job():
    lane = SerialLane(max_queue=1)
    seen = threading.Event()

    def work(job):
        while not job.cancelled:
            time.sleep(0.005)
        seen.set()

    async def gone():
        return True

    async def main():
        assert [x async for x in lane.submit(work).events(gone, poll_s=0.01)] == []

    run(main())
    assert seen.wait(2)
    lane.close()


@pytest.mark.parametrize("model, body, param", [
    (CompletionRequest, b'{"prompt": null}', "prompt"),
    (CompletionRequest, b'{"prompt": "x", "max_tokens": "5"}', "max_tokens"),
    (CompletionRequest, b'{"prompt": "x", "stream": 1}', "stream"),
    (ChatRequest, b'{"messages": [{"role": "user", "content": [{"type": 3}]}]}', "messages[0].content"),
    (ChatRequest, b'{"messages": [{"content": "x"}]}', "messages[0].role"),
    (ChatRequest, b'{"messages": [], "stream_options": {"include_usage": "y"}}',
     "stream_options.include_usage"),
])
def test_parse_names_the_offending_field(model, body, param):
    with pytest.raises(APIError) as e:
        parse(model, body)
    assert e.value.status == 400 and e.value.param == param
    assert e.value.body()["error"]["param"] == param


def test_parse_refuses_malformed_json():
    with pytest.raises(APIError) as e:
        parse(CompletionRequest, b'{"prompt": ')
    assert e.value.code == "invalid_json" and e.value.param is None


def test_parse_accepts_every_prompt_form_and_ignores_unknown_fields():
    for prompt in ('"x"', '["x", "y"]', "[1, 2]", "[[1], [2, 3]]"):
        parse(CompletionRequest, f'{{"prompt": {prompt}, "best_of": 1}}'.encode())
