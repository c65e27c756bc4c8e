"""`pagedlm serve` end to end: real servers on free loopback ports, real models,
the official `openai` client for the happy paths, raw httpx for bad input.

Server A: smollm2-135m-instruct with an API key, --max-queue 1,
--max-num-seqs 1 (one running sequence, so that the queue fills) and
--max-model-len 512. Server B: the default model (gemma3-270m) with
--paged-kv, batching freely. Generations are kept short: the CI box has two
cores.
"""

from __future__ import annotations

import json
import socket
import subprocess
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pagedlm.server.app import MAX_BODY_BYTES
from tests.helpers import Server, start_server

pytestmark = pytest.mark.weights

KEY = "test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
SMOLLM = "smollm2-135m-instruct"
MAX_MODEL_LEN = 512


def _start(*args: str, timeout: float = 180.0):
    """Start `pagedlm serve` (``tests.helpers.start_server``), stop it after the test."""
    server = start_server(*args, timeout=timeout)
    proc = server.proc
    try:
        yield server
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
        server.log.unlink(missing_ok=True)


@pytest.fixture(scope="module")
def a():
    yield from _start("--model", SMOLLM, "--api-key", KEY, "--max-queue", "1", "--max-num-seqs", "1",
                      "--max-model-len", str(MAX_MODEL_LEN))


@pytest.fixture(scope="module")
def b():
    yield from _start("--paged-kv")


@pytest.fixture(scope="module")
def client(a):
    return openai.OpenAI(base_url=a.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


def metric(server: Server, name: str, **labels: str) -> float:
    return _sample(httpx.get(server.url + "/metrics", headers=AUTH, timeout=10).text, name, **labels)


def _sample(text: str, name: str, **labels: str) -> float:
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    raise AssertionError(f"{name} {labels} is not in /metrics")


def wait_for(predicate, timeout: float = 10.0, step: float = 0.05) -> float:
    """Seconds until ``predicate()`` held; fails after ``timeout``."""
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"condition not met within {timeout}s")
        time.sleep(step)
    return time.monotonic() - start


# ---------------------------------------------------------------------------
# The openai client: completions and chat, whole and streamed


def test_models_lists_the_served_model(client):
    models = client.models.list()
    assert [m.id for m in models.data] == [SMOLLM]


def test_completion_and_its_stream_agree(client):
    kw = dict(model=SMOLLM, prompt="The capital of France is", max_tokens=6, temperature=0)
    whole = client.completions.create(**kw)
    choice = whole.choices[0]
    assert choice.finish_reason == "length" and choice.text
    assert whole.usage.completion_tokens == 6
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + 6
    chunks = list(client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6


def test_chat_and_its_stream_agree_with_logprobs(client):
    kw = dict(model=SMOLLM, messages=[{"role": "user", "content": "Name a fruit."}],
              max_tokens=5, temperature=0, logprobs=True, top_logprobs=2)
    whole = client.chat.completions.create(**kw)
    choice = whole.choices[0]
    assert choice.message.role == "assistant" and choice.message.content
    content = choice.logprobs.content
    assert len(content) == whole.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert entry.logprob == entry.top_logprobs[0].logprob  # greedy picks the top token
    chunks = list(client.chat.completions.create(**kw, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == choice.message.content
    streamed = [e.logprob for c in chunks if c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    # The second request reuses the first's prompt cache and prefills one token
    # instead of all: float32 matmuls of another shape change the last bits.
    assert streamed == pytest.approx([e.logprob for e in content], abs=1e-4)
    assert chunks[-1].choices[0].finish_reason == choice.finish_reason


def test_echo_with_prompt_logprobs_scores_like_lm_eval(client):
    """lm-eval's local-completions loglikelihood request and its parsing."""
    first = client.completions.create(model=SMOLLM, prompt="The capital of France is",
                                      max_tokens=1, temperature=0, logprobs=1)
    greedy_lp = first.choices[0].logprobs.token_logprobs[0]
    from pagedlm.loading import resolve
    from pagedlm.tokenizer import Tokenizer

    tok = Tokenizer.from_folder(resolve(SMOLLM))
    context = tok.encode("The capital of France is")
    continuation = tok.encode(first.choices[0].text, add_special_tokens=False)
    assert len(continuation) == 1
    out = client.completions.create(model=SMOLLM, prompt=[context + continuation], max_tokens=1,
                                    temperature=0, logprobs=1, echo=True, seed=1234)
    lp = out.choices[0].logprobs
    n = len(context) + 1
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == n + 1
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(x <= 0 for x in lp.token_logprobs[1:])
    # lm-eval: sum(token_logprobs[ctxlen:-1]), greedy iff each equals its top-1.
    scored = lp.token_logprobs[len(context):-1]
    tops = lp.top_logprobs[len(context):-1]
    assert scored[0] == pytest.approx(greedy_lp, abs=1e-4)
    assert all(t == pytest.approx(max(top.values()), abs=1e-6) for t, top in zip(scored, tops))
    assert out.choices[0].text.startswith(tok.decode(context + continuation))


def test_stop_string_ends_the_choice_before_it(client):
    kw = dict(model=SMOLLM, prompt="List: one, two, three, four,", max_tokens=8, temperature=0)
    free = client.completions.create(**kw).choices[0].text
    stop = free.strip().split()[1]
    cut = client.completions.create(**kw, stop=[stop]).choices[0]
    assert cut.finish_reason == "stop"
    assert cut.text == free[: free.index(stop)]


def test_seeded_sampling_repeats(client):
    kw = dict(model=SMOLLM, prompt="Once upon a time", max_tokens=6, temperature=1.0, top_p=0.9,
              seed=7, extra_body={"top_k": 50, "min_p": 0.01})
    assert client.completions.create(**kw).choices[0].text == client.completions.create(**kw).choices[0].text


# ---------------------------------------------------------------------------
# Prompt cache


def test_prompt_cache_hit_gives_identical_greedy_output(a, client):
    hits = metric(a, "pagedlm_prompt_cache_hits_total")
    kw = dict(model=SMOLLM, prompt="Quokka notes: the quokka is a small", max_tokens=6, temperature=0)
    miss = client.completions.create(**kw)
    hit = client.completions.create(**kw)
    assert miss.usage.prompt_tokens_details.cached_tokens == 0
    assert hit.usage.prompt_tokens_details.cached_tokens == hit.usage.prompt_tokens - 1
    assert hit.choices[0].text == miss.choices[0].text
    assert metric(a, "pagedlm_prompt_cache_hits_total") == hits + 1


def test_multi_turn_chat_reuses_the_previous_turn(a, client):
    turn1 = [{"role": "user", "content": "Name three colors."}]
    r1 = client.chat.completions.create(model=SMOLLM, messages=turn1, max_tokens=8, temperature=0)
    turn2 = turn1 + [{"role": "assistant", "content": r1.choices[0].message.content},
                     {"role": "user", "content": "Now three animals."}]
    r2 = client.chat.completions.create(model=SMOLLM, messages=turn2, max_tokens=6, temperature=0)
    assert r2.usage.prompt_tokens_details.cached_tokens >= r1.usage.prompt_tokens
    # The same prompt without the cache: echo + prompt logprobs always prefill everything.
    from pagedlm.loading import resolve
    from pagedlm.tokenizer import Tokenizer

    tok = Tokenizer.from_folder(resolve(SMOLLM))
    ids = tok.encode_chat(turn2)
    assert len(ids) == r2.usage.prompt_tokens
    cold = client.completions.create(model=SMOLLM, prompt=ids, max_tokens=6, temperature=0,
                                     echo=True, logprobs=0)
    assert cold.usage.prompt_tokens_details.cached_tokens == 0
    assert cold.choices[0].text[len(tok.decode(ids)):] == r2.choices[0].message.content


# ---------------------------------------------------------------------------
# The engine loop: disconnects and the bounded queue


def _long_stream(http: httpx.Client):
    # Counting goes on and on under greedy decoding: no early EOS.
    body = {"model": SMOLLM, "prompt": "1, 2, 3, 4, 5, 6, 7, 8,", "max_tokens": 300,
            "temperature": 0, "stream": True}
    return http.stream("POST", "/v1/completions", json=body, headers=AUTH)


def test_disconnect_mid_stream_stops_the_generation(a):
    cancelled = metric(a, "pagedlm_requests_total", endpoint="completions", outcome="cancelled")
    generated = metric(a, "pagedlm_generation_tokens_total")
    with httpx.Client(base_url=a.url, timeout=60) as http:
        with _long_stream(http) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data:"))
    wait_for(lambda: metric(a, "pagedlm_requests_total", endpoint="completions",
                            outcome="cancelled") == cancelled + 1)
    wait_for(lambda: metric(a, "pagedlm_running") == 0, timeout=5)
    after = metric(a, "pagedlm_generation_tokens_total")
    assert after - generated < 100, "the generation ran on after the client left"
    time.sleep(0.5)
    assert metric(a, "pagedlm_generation_tokens_total") == after
    assert metric(a, "pagedlm_kv_bytes", holder="running") == 0
    r = httpx.post(a.url + "/v1/completions", headers=AUTH, timeout=60,
                   json={"prompt": "Hi", "max_tokens": 1})
    assert r.status_code == 200


def test_queue_overflow_is_503_with_retry_after(a):
    with httpx.Client(base_url=a.url, timeout=60) as http:
        with _long_stream(http) as running:
            lines = running.iter_lines()
            next(line for line in lines if line.startswith("data:"))  # it runs
            with _long_stream(http) as waiting:
                assert waiting.status_code == 200
                wait_for(lambda: metric(a, "pagedlm_queue_depth") == 1)
                r = http.post("/v1/completions", headers=AUTH, json={"prompt": "Hi", "max_tokens": 1})
                assert r.status_code == 503
                assert r.headers["retry-after"] == "1"
                assert r.json()["error"]["code"] == "queue_full"
    wait_for(lambda: metric(a, "pagedlm_running") == 0 and metric(a, "pagedlm_queue_depth") == 0)
    assert metric(a, "pagedlm_requests_total", endpoint="completions", outcome="rejected") >= 1


# ---------------------------------------------------------------------------
# Authentication and bad input


def test_auth(a):
    assert httpx.get(a.url + "/health").status_code == 200
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        for method, path in (("GET", "/v1/models"), ("POST", "/v1/completions"), ("GET", "/metrics")):
            r = httpx.request(method, a.url + path, headers=headers, json={"prompt": "x"})
            assert r.status_code == 401, (headers, path)
            assert r.json()["error"]["code"] == "invalid_api_key"


def _too_long_prompt():
    return {"prompt": [100] * (MAX_MODEL_LEN + 1)}


BAD = {
    "malformed json": ("/v1/completions", b'{"prompt": "x",', 400, None),
    "json array": ("/v1/completions", [1, 2], 400, None),
    "missing prompt": ("/v1/completions", {"max_tokens": 2}, 400, "prompt"),
    "null prompt": ("/v1/completions", {"prompt": None}, 400, "prompt"),
    "prompt of dicts": ("/v1/completions", {"prompt": [{"a": 1}]}, 400, "prompt"),
    "string max_tokens": ("/v1/completions", {"prompt": "x", "max_tokens": "5"}, 400, "max_tokens"),
    "float max_tokens": ("/v1/completions", {"prompt": "x", "max_tokens": 2.5}, 400, "max_tokens"),
    "string stream": ("/v1/completions", {"prompt": "x", "stream": "yes"}, 400, "stream"),
    "string temperature": ("/v1/completions", {"prompt": "x", "temperature": "hot"}, 400, "temperature"),
    "messages not a list": ("/v1/chat/completions", {"messages": "hi"}, 400, "messages"),
    "unknown model": ("/v1/completions", {"prompt": "x", "model": "gpt-9"}, 404, "model"),
    "empty prompt": ("/v1/completions", {"prompt": ""}, 400, "prompt"),
    "empty prompt list": ("/v1/completions", {"prompt": []}, 400, "prompt"),
    "empty token list": ("/v1/completions", {"prompt": [[]]}, 400, "prompt"),
    "token outside vocab": ("/v1/completions", {"prompt": [10**9]}, 400, "prompt"),
    "negative token": ("/v1/completions", {"prompt": [-1]}, 400, "prompt"),
    "empty messages": ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    "unknown role": ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]},
                     400, "messages[0].role"),
    "image content": ("/v1/chat/completions",
                      {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
                      400, "messages[0].content"),
    "prompt beyond context": ("/v1/completions", _too_long_prompt(), 400, "prompt"),
    "max_tokens 0": ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    "max_tokens negative": ("/v1/completions", {"prompt": "x", "max_tokens": -3}, 400, "max_tokens"),
    "max_tokens beyond context": ("/v1/completions", {"prompt": "x", "max_tokens": MAX_MODEL_LEN},
                                  400, "max_tokens"),
    "max_completion_tokens 0": ("/v1/chat/completions",
                                {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0},
                                400, "max_completion_tokens"),
    "negative temperature": ("/v1/completions", {"prompt": "x", "temperature": -1}, 400, "temperature"),
    "top_p 0": ("/v1/completions", {"prompt": "x", "top_p": 0}, 400, "top_p"),
    "top_p above 1": ("/v1/completions", {"prompt": "x", "top_p": 1.5}, 400, "top_p"),
    "top_k negative": ("/v1/completions", {"prompt": "x", "top_k": -5}, 400, "top_k"),
    "min_p above 1": ("/v1/completions", {"prompt": "x", "min_p": 2}, 400, "min_p"),
    "logprobs above 20": ("/v1/completions", {"prompt": "x", "logprobs": 21}, 400, "logprobs"),
    "top_logprobs without logprobs": ("/v1/chat/completions",
                                      {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
                                      400, "top_logprobs"),
    "top_logprobs above 20": ("/v1/chat/completions",
                              {"messages": [{"role": "user", "content": "x"}], "logprobs": True,
                               "top_logprobs": 30}, 400, "top_logprobs"),
    "n 17": ("/v1/completions", {"prompt": "x", "n": 17}, 400, "n"),
    "n 0": ("/v1/completions", {"prompt": "x", "n": 0}, 400, "n"),
    "presence penalty 3": ("/v1/completions", {"prompt": "x", "presence_penalty": 3}, 400, "presence_penalty"),
    "frequency penalty -3": ("/v1/completions", {"prompt": "x", "frequency_penalty": -3}, 400,
                             "frequency_penalty"),
    "seed too large": ("/v1/completions", {"prompt": "x", "seed": 2**70}, 400, "seed"),
    "too many stops": ("/v1/completions", {"prompt": "x", "stop": ["a"] * 17}, 400, "stop"),
    "oversized body": ("/v1/completions", b"x" * (MAX_BODY_BYTES + 1), 413, None),
    "unknown route": ("/v1/nothing", {}, 404, None),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_is_a_clean_4xx(a, case):
    path, body, status, param = BAD[case]
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(a.url + path, content=content, headers={**AUTH, "Content-Type": "application/json"},
                   timeout=30)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    if case.endswith("beyond context"):
        assert error["code"] == "context_length_exceeded"


@pytest.mark.parametrize("framing", [b"Content-Length: -5\r\n", b"Content-Length: x\r\n"])
def test_broken_http_framing_is_a_json_400(a, framing):
    """uvicorn refuses these before the app sees them; the answer is still OpenAI's error shape."""
    host, port = a.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n" + framing + b"\r\n")
        raw = b""
        while chunk := s.recv(65536):
            raw += chunk
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400") and b"application/json" in head.lower()
    error = json.loads(body)["error"]
    assert error["type"] == "invalid_request_error" and "malformed HTTP request" in error["message"]


def test_wrong_method_is_405(a):
    r = httpx.get(a.url + "/v1/completions", headers=AUTH)
    assert r.status_code == 405 and "error" in r.json()


def test_still_serving_after_everything_and_no_tracebacks(a, client):
    out = client.completions.create(model=SMOLLM, prompt="Hello", max_tokens=2)
    assert out.usage.completion_tokens == 2
    for endpoint in ("completions", "chat", "other"):
        try:
            errors = metric(a, "pagedlm_requests_total", endpoint=endpoint, outcome="error")
        except AssertionError:
            errors = 0
        assert errors == 0
    assert metric(a, "pagedlm_requests_total", endpoint="completions", outcome="invalid") >= 20
    text = httpx.get(a.url + "/metrics", headers=AUTH).text
    for name in ("pagedlm_time_to_first_token_seconds_bucket", "pagedlm_inter_token_latency_seconds_bucket",
                 "pagedlm_prompt_tokens_total", "pagedlm_generation_tokens_total",
                 "pagedlm_prompt_cache_misses_total", 'pagedlm_kv_bytes{holder="prompt_cache"}'):
        assert name in text
    assert "pagedlm_paged_kv_blocks_in_use" not in text
    log = a.log_text()
    assert "Traceback" not in log and "effective configuration" in log


# ---------------------------------------------------------------------------
# Server B: the default model, paged


def test_default_model_paged_completion_bypasses_the_prompt_cache(b):
    c = openai.OpenAI(base_url=b.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    models = c.models.list()
    assert [m.id for m in models.data] == ["gemma3-270m"]
    kw = dict(model="gemma3-270m", prompt="The capital of France is", max_tokens=6, temperature=0)
    raw = c.completions.with_raw_response.create(**kw)
    assert raw.headers["x-pagedlm-paged-kv"] == "1"
    first = raw.parse()
    assert first.choices[0].text and first.usage.completion_tokens == 6
    assert first.model_extra["pagedlm"]["paged_kv"] is True
    again = c.completions.create(**kw)
    assert again.choices[0].text == first.choices[0].text
    assert again.usage.prompt_tokens_details.cached_tokens == 0
    text = httpx.get(b.url + "/metrics", timeout=10).text
    assert "pagedlm_prompt_cache_entries" not in text and "pagedlm_prompt_cache_hits" not in text
    assert "kv_store = paged KV in 16-token blocks (prefix caching on, KV none), attention torch" in b.log_text()
    assert "prompt_cache_bytes = 2147483648 (off)" in b.log_text()


def _pool_blocks(server: Server) -> int:
    """The pool's block count, from the startup log ("kv_budget_bytes = B (N blocks)")."""
    line = next(line for line in server.log_text().splitlines() if "kv_budget_bytes =" in line)
    return int(line.split("(")[1].split()[0])


def test_paged_blocks_are_in_use_while_running_and_freed_after(b):
    total = _pool_blocks(b)
    assert metric(b, "pagedlm_paged_kv_blocks_free") == total
    body = {"prompt": "1, 2, 3, 4, 5, 6, 7, 8,", "max_tokens": 300, "stream": True}
    with httpx.Client(base_url=b.url, timeout=60) as http:
        with http.stream("POST", "/v1/completions", json=body) as r:
            assert r.headers["x-pagedlm-paged-kv"] == "1"
            lines = r.iter_lines()  # kept: a dropped line iterator closes the connection
            next(line for line in lines if line.startswith("data:"))
            # One block table for all 3 global layers; blocks are taken as tokens
            # arrive: 24 prompt tokens + up to 300 generated need 2 to 21 blocks of 16.
            text = httpx.get(b.url + "/metrics", timeout=10).text
            used = _sample(text, "pagedlm_paged_kv_blocks_in_use")
            assert 2 <= used <= 21
            assert _sample(text, "pagedlm_paged_kv_blocks_free") == total - used
            assert metric(b, "pagedlm_kv_bytes", holder="running") > 0
    wait_for(lambda: metric(b, "pagedlm_running") == 0)
    assert metric(b, "pagedlm_paged_kv_blocks_in_use") == 0
    assert metric(b, "pagedlm_paged_kv_blocks_free") == total
    assert metric(b, "pagedlm_kv_bytes", holder="running") == 0


def test_concurrent_streams_match_their_batch_of_one_output(b):
    """16 clients at once against the paged server: every stream completes
    with the greedy tokens the same prompt gets alone."""
    import concurrent.futures

    prompts = [f"Fact {i}: the {w} is" for i, w in enumerate(
        "sun moon river forest ocean desert mountain city road bridge tower garden castle island "
        "valley cloud".split())]
    body = {"max_tokens": 8, "temperature": 0}

    def alone(prompt: str) -> str:
        r = httpx.post(b.url + "/v1/completions", json={**body, "prompt": prompt}, timeout=120)
        return r.json()["choices"][0]["text"]

    def streamed(prompt: str) -> str:
        text = []
        with httpx.stream("POST", b.url + "/v1/completions", json={**body, "prompt": prompt, "stream": True},
                          timeout=300) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    text += [c["text"] for c in json.loads(line[6:])["choices"]]
        return "".join(text)

    expected = [alone(p) for p in prompts]
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        got = list(pool.map(streamed, prompts))
    assert got == expected
    assert metric(b, "pagedlm_paged_kv_blocks_free") == _pool_blocks(b)


def test_n_choices_run_as_separate_sequences(b):
    kw = {"prompt": "Once upon a time", "max_tokens": 6, "temperature": 1.0, "seed": 3, "n": 3}
    r = httpx.post(b.url + "/v1/completions", json=kw, timeout=120).json()
    texts = [c["text"] for c in r["choices"]]
    assert [c["index"] for c in r["choices"]] == [0, 1, 2]
    assert r["usage"]["completion_tokens"] == 18
    assert len(set(texts)) > 1  # seeds seed + 0, 1, 2: different draws
    again = httpx.post(b.url + "/v1/completions", json=kw, timeout=120).json()
    assert [c["text"] for c in again["choices"]] == texts
