"""The engine loop (many requests stepping together, joining and leaving
between steps) on a tiny random-weight model, and request parsing."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import socket
import threading
import time

import pytest

from pagedlm.batch.engine import LLMEngine
from pagedlm.options import EngineOptions
from pagedlm.params import SamplingParams
from pagedlm.server.planner import Plan
from pagedlm.server.loop import EngineLoop, QueueFull
from pagedlm.server.protocol import APIError, ChatRequest, CompletionRequest, parse


def plan(*prompts: list[int], max_tokens: int = 6) -> Plan:
    params = [SamplingParams(max_tokens=max_tokens, ignore_eos=True) for _ in prompts]
    return Plan(list(prompts), params, stream=False, include_usage=False, paged=False)


def loop_for(model, tokenizer, max_queue: int = 8, **options) -> EngineLoop:
    return EngineLoop(LLMEngine(model, tokenizer, EngineOptions(**options)), max_queue)


async def collect(job) -> list:
    return [item async for item in job.events()]


def test_concurrent_requests_step_together(model, tokenizer):
    """Two requests submitted together advance in the same steps: their
    tokens interleave instead of one request running to its end first."""
    loop = loop_for(model, tokenizer)
    order = []

    async def main():
        a, b = loop.submit(plan([5, 6, 7], max_tokens=8)), loop.submit(plan([9, 10], max_tokens=8))

        async def drain(job, name):
            async for _index, resp in job.events():
                order.append(name)
        await asyncio.gather(drain(a, "a"), drain(b, "b"))

    asyncio.run(main())
    loop.close()
    assert sorted(order) == ["a"] * 8 + ["b"] * 8
    assert order.index("b") < order.index("a") + 8 - 1  # b's first token came before a's last
    assert not loop.engine.has_unfinished()


def test_queue_full_when_max_queue_sequences_wait(model, tokenizer):
    loop = loop_for(model, tokenizer, max_queue=1, max_num_seqs=1)

    async def main():
        running = loop.submit(plan([5, 6], max_tokens=40))
        events = running.events()
        await events.__anext__()  # it runs
        waiting = loop.submit(plan([7, 8], max_tokens=2))
        while loop.depth != 1:
            await asyncio.sleep(0.005)
        with pytest.raises(QueueFull, match="--max-queue 1"):
            loop.submit(plan([1]))
        running.cancel()
        await events.aclose()
        assert len(await collect(waiting)) == 2

    asyncio.run(main())
    loop.close()


def test_a_job_cancelled_while_queued_never_runs(model, tokenizer):
    loop = loop_for(model, tokenizer, max_num_seqs=1)

    async def main():
        first = loop.submit(plan([5, 6], max_tokens=20))
        queued = loop.submit(plan([7, 8], max_tokens=20))
        queued.cancel()
        await collect(first)
        assert await collect(queued) == []
        return queued

    queued = asyncio.run(main())
    loop.close()
    assert all(s.finish_reason == "abort" and not s.output_ids for s in queued.seqs)


def _run_and_drain(loop, the_plan, client):
    """Submit ``the_plan``, let ``client(job)`` read its events, wait until the
    engine has nothing left, close the loop; the job and its sequences. (That
    an aborted sequence's KV is freed is the engine's, test_engine.py.)"""

    async def main():
        job = loop.submit(the_plan)
        await client(job)
        while loop.engine.has_unfinished():
            await asyncio.sleep(0.005)
        return job

    job = asyncio.run(main())
    loop.close()
    return job, job.seqs


def test_leaving_the_event_stream_aborts_the_sequences_and_frees_them(model, tokenizer):
    loop = loop_for(model, tokenizer)

    async def leave(job):
        async for _ in job.events():
            break  # the client left after one token

    job, (seq,) = _run_and_drain(loop, plan([5, 6, 7], max_tokens=200), leave)
    assert seq.finish_reason == "abort" and len(seq.output_ids) < 200


def test_an_engine_refusal_is_raised_to_the_request(model, tokenizer):
    loop = loop_for(model, tokenizer, max_model_len=16)

    async def main():
        with pytest.raises(Exception, match="exceeds max_model_len"):
            await collect(loop.submit(plan([5] * 10, max_tokens=10)))
        assert len(await collect(loop.submit(plan([5, 6], max_tokens=3)))) == 3  # still serving

    asyncio.run(main())
    loop.close()


def test_disconnect_polling_cancels_a_job_that_waits_silently(model, tokenizer):
    loop = loop_for(model, tokenizer, max_num_seqs=1)

    async def gone():
        return True

    async def main():
        busy = loop.submit(plan([5, 6], max_tokens=30))
        silent = loop.submit(plan([7, 8], max_tokens=30))
        assert [x async for x in silent.events(gone, poll_s=0.01)] == []
        await collect(busy)
        return silent

    silent = asyncio.run(main())
    loop.close()
    assert silent.cancelled and all(s.finish_reason == "abort" for s in silent.seqs)


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


def test_parse_accepts_every_prompt_form():  # (unknown fields: test_server_app.py)
    for prompt, expected in (('"x"', "x"), ('["x", "y"]', ["x", "y"]), ("[1, 2]", [1, 2]),
                             ("[[1], [2, 3]]", [[1], [2, 3]])):
        req = parse(CompletionRequest, f'{{"prompt": {prompt}, "max_tokens": 3}}'.encode())
        assert req.prompt == expected and req.max_tokens == 3


# -- contention: departed clients, fan-out, fairness, slow clients -------------


def test_a_departed_client_is_noticed_while_tokens_flow_and_aborted_within_one_step(model, tokenizer):
    """A steady stream never pauses long enough for a timeout-based poll: the
    request must look for its client between steps anyway."""
    loop = loop_for(model, tokenizer)
    state = {"gone": False, "tokens_then": None}

    async def is_disconnected():
        return state["gone"]

    async def read_then_leave(job):
        got = 0
        async for _ in job.events(is_disconnected, poll_s=60):  # a poll by timeout would never fire
            got += 1
            if got == 3:
                state["gone"], state["tokens_then"] = True, len(job.seqs[0].output_ids)

    job, (seq,) = _run_and_drain(loop, plan([5, 6, 7], max_tokens=400), read_then_leave)
    assert job.cancelled and seq.finish_reason == "abort"
    # the step that delivered the third token may be followed by one already running
    assert len(seq.output_ids) <= state["tokens_then"] + 1


def fan_out(count: int, n: int = 1) -> Plan:
    p = plan(*([[5 + i, 6]] * n for i in range(count)), max_tokens=2)
    p.prompts = [ids for group in p.prompts for ids in group]
    p.options = [SamplingParams(max_tokens=2, ignore_eos=True) for _ in p.prompts]
    p.n = n
    return p


def test_a_fan_out_over_the_limits_is_refused_without_touching_the_queue(model, tokenizer):
    loop = EngineLoop(LLMEngine(model, tokenizer, EngineOptions(max_num_seqs=2)), max_queue=8, max_prompts=3)

    async def main():
        busy = loop.submit(plan([5, 6], max_tokens=30))
        events = busy.events()
        await events.__anext__()  # someone is being served
        for request, limit in ((fan_out(4), "--max-prompts-per-request"), (fan_out(3, n=3), "--max-queue")):
            with pytest.raises(APIError, match=limit) as e:
                loop.submit(request)
            assert e.value.status == 400
            assert loop.depth == 0 and loop.engine.num_waiting() == 0
        ok = loop.submit(fan_out(2, n=4))  # 8 sequences: all the queue, while nothing waits
        with pytest.raises(QueueFull, match="adds 1"):
            loop.submit(plan([1]))
        rest = [item async for item in events]
        assert len(rest) == 29  # the busy request was served to its end meanwhile
        assert len(await collect(ok)) == 8 * 2

    asyncio.run(main())
    loop.close()


def test_one_requests_fan_out_does_not_starve_a_later_request(model, tokenizer):
    """Two rows, a request of eight sequences first, then a request of one:
    the later request is admitted at the first free row, not after the eight."""
    loop = loop_for(model, tokenizer, max_queue=16, max_num_seqs=2)
    firsts: dict[str, list[float]] = {"big": [], "small": []}

    async def main():
        big = loop.submit(fan_out(8))
        small = loop.submit(plan([9, 10], max_tokens=2))

        async def drain(job, name):
            seen = set()
            async for index, resp in job.events():
                if index not in seen:
                    seen.add(index)
                    firsts[name].append(resp.seq.first_scheduled)
        await asyncio.gather(drain(big, "big"), drain(small, "small"))

    asyncio.run(main())
    loop.close()
    (small_at,) = firsts["small"]
    assert sum(t < small_at for t in firsts["big"]) <= 2  # only the two that held the rows


def test_the_request_log_line_summarises_prompt_lengths(model, tokenizer, caplog):
    loop = loop_for(model, tokenizer, max_queue=64)

    async def main():
        with caplog.at_level(logging.INFO, "pagedlm.server"):
            await collect(loop.submit(fan_out(40)))

    asyncio.run(main())
    loop.close()
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("request:")]
    assert "min 2 / max 2 / total 80" in line and len(line) < 200


@contextlib.contextmanager
def slow_client_server(**limits):
    """A real uvicorn server on 127.0.0.1 with `pagedlm.server.uvicorn_config`
    (``limits``: ServerOptions fields) over a route that reads its body as
    the generation routes do."""
    import uvicorn
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    from pagedlm.options import ServerOptions
    from pagedlm.server import bind, uvicorn_config
    from pagedlm.server.app import read_body

    async def on_api_error(request, err):
        return JSONResponse(err.body(), status_code=err.status, headers=err.headers)

    async def echo(request):
        return JSONResponse({"bytes": len(await read_body(request))})

    app = Starlette(routes=[Route("/echo", echo, methods=["POST"])], exception_handlers={APIError: on_api_error})

    sock = bind("127.0.0.1", 0)
    options = ServerOptions(port=sock.getsockname()[1], **limits)
    server = uvicorn.Server(uvicorn_config(app, options))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    try:
        yield options.port
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


def closed_after(conn: socket.socket, trickle: bytes, every_s: float, limit_s: float = 5.0) -> tuple[float, bytes]:
    """Send ``trickle`` a byte every ``every_s`` until the server closes the
    connection; how long that took and what it answered."""
    start, answer = time.monotonic(), b""
    conn.settimeout(every_s)
    for byte in itertools.cycle(trickle):
        if time.monotonic() - start > limit_s:
            raise AssertionError(f"still open after {limit_s}s")
        try:
            conn.sendall(bytes([byte]))
            chunk = conn.recv(4096)
        except socket.timeout:
            continue
        except (BrokenPipeError, ConnectionResetError):
            break
        if not chunk:
            break
        answer += chunk
    return time.monotonic() - start, answer


def test_a_client_whose_headers_never_finish_is_cut_at_the_header_deadline():
    with slow_client_server(header_timeout=0.5) as port:
        with socket.create_connection(("127.0.0.1", port)) as conn:
            conn.sendall(b"POST /echo HTTP/1.1\r\nhost: x\r\n")
            took, answer = closed_after(conn, b"x-slow: aaaaaaaaaa\r\n", 0.1)
    assert 0.4 <= took < 2.5 and answer == b""


def test_a_trickled_body_gets_408_and_is_cut_at_the_body_deadline_not_per_byte():
    with slow_client_server(header_timeout=0.5, body_timeout=0.5) as port:
        with socket.create_connection(("127.0.0.1", port)) as conn:
            conn.sendall(b"POST /echo HTTP/1.1\r\nhost: x\r\ncontent-length: 1000\r\n\r\n")
            took, answer = closed_after(conn, b"{", 0.1)  # a byte every 0.1 s: each pause is short
    assert 0.4 <= took < 2.5
    assert answer.startswith(b"HTTP/1.1 408") and b"--body-timeout" in answer


def test_a_kept_alive_connection_owes_its_next_headers_by_the_deadline():
    with slow_client_server(header_timeout=0.5) as port:
        with socket.create_connection(("127.0.0.1", port)) as conn:
            conn.sendall(b"POST /echo HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\n\r\n{}")
            assert conn.recv(4096).startswith(b"HTTP/1.1 200")
            conn.sendall(b"POST /echo HTTP/1.1\r\n")
            took, _ = closed_after(conn, b"x-slow: a\r\n", 0.1)
    assert took < 2.5


def test_connections_past_the_cap_are_answered_503_and_closed():
    with slow_client_server(header_timeout=30, max_connections=2) as port:
        held = [socket.create_connection(("127.0.0.1", port)) for _ in range(2)]
        time.sleep(0.1)
        with socket.create_connection(("127.0.0.1", port)) as extra:
            extra.settimeout(5)
            answer = extra.recv(4096)
            assert answer.startswith(b"HTTP/1.1 503") and b"--max-connections" in answer
            assert extra.recv(4096) == b""
        for conn in held:
            conn.close()
        time.sleep(0.1)
        with socket.create_connection(("127.0.0.1", port)) as conn:  # room again
            conn.settimeout(5)
            conn.sendall(b"POST /echo HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\n\r\n{}")
            assert conn.recv(4096).startswith(b"HTTP/1.1 200")


def test_metrics_export_the_one_kv_budget(model, tokenizer):
    from prometheus_client.parser import text_string_to_metric_families

    from pagedlm.server.metrics import Metrics

    loop = loop_for(model, tokenizer, kv_budget_bytes=1 << 24, prompt_cache_bytes=1 << 30)
    metrics = Metrics(model_name="tiny")
    metrics.bind(loop.engine, lambda: loop.depth)
    loop.close()
    values = {s.name: s.value for f in text_string_to_metric_families(metrics.render().decode()) for s in f.samples}
    assert values["pagedlm_kv_budget_bytes"] == 1 << 24
