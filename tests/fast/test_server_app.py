"""The server in-process on a tiny random-weight model: request planning,
bad input, disconnects, the schema. Seconds, no real weights."""

from __future__ import annotations

import asyncio
import json
import logging

import pytest
from fastapi.testclient import TestClient

from pagedlm.options import PagedKvOptions, ServerOptions
from pagedlm.server import app as app_module
from pagedlm.server.planner import COMPLETION_DEFAULT_MAX_TOKENS

from tests.fast.server_helpers import MAX_MODEL_LEN, error_of, make_app, metric


def complete(client, **body) -> dict:
    r = client.post("/v1/completions", json={"prompt": "hello world", **body})
    assert r.status_code == 200, r.text
    return r.json()


# ---------------------------------------------------------------- sampling values (item 1)


def test_a_temperature_too_small_to_divide_by_answers_greedily(client):
    greedy = complete(client, max_tokens=8, temperature=0)["choices"][0]["text"]
    for tiny in (1e-40, 1e-45, 1e-300):
        assert complete(client, max_tokens=8, temperature=tiny)["choices"][0]["text"] == greedy


@pytest.mark.parametrize("field", ["temperature", "top_p", "min_p", "repetition_penalty"])
def test_an_infinite_sampling_value_is_a_400_naming_it(client, field):
    body = b'{"prompt": "hello", "%s": 1e999}' % field.encode()
    r = client.post("/v1/completions", content=body, headers={"Content-Type": "application/json"})
    assert "finite" in error_of(r, 400, field)["message"]


# ---------------------------------------------------------------- planning (item 13)


def test_max_tokens_defaults_completions_16_chat_the_rest_of_the_context(client, served, tokenizer):
    out = complete(client, ignore_eos=True)
    assert out["usage"]["completion_tokens"] <= COMPLETION_DEFAULT_MAX_TOKENS
    planner = served[1]
    plan = planner.plan_completion(app_module.CompletionRequest(prompt="hello world"))
    assert plan.options[0].max_tokens == COMPLETION_DEFAULT_MAX_TOKENS
    long = [5] * (MAX_MODEL_LEN - 4)
    plan = planner.plan_completion(app_module.CompletionRequest(prompt=long))
    assert plan.options[0].max_tokens == 4  # capped to the context left
    chat = app_module.ChatRequest(messages=[{"role": "user", "content": "hello"}])
    plan = planner.plan_chat(chat)
    assert plan.options[0].max_tokens == MAX_MODEL_LEN - len(tokenizer.encode_chat([{"role": "user",
                                                                                      "content": "hello"}]))


def test_a_batch_of_prompts_gives_one_choice_per_prompt_in_order(client):
    prompts = ["hello world", "the sea", "hello hello"]
    alone = [complete(client, prompt=p, max_tokens=4)["choices"][0]["text"] for p in prompts]
    batch = complete(client, prompt=prompts, max_tokens=4)
    assert [c["index"] for c in batch["choices"]] == [0, 1, 2]
    assert [c["text"] for c in batch["choices"]] == alone
    assert batch["usage"]["completion_tokens"] == 12


def test_a_request_the_kv_budget_can_never_hold_is_a_400_before_it_queues(model, tokenizer, caplog):
    """The default store reserves prompt + max_tokens; a request bigger than
    the whole budget is refused at planning, whole or streamed, with no
    traceback; one that fits still runs."""
    per_token = sum(2 * s.num_kv_heads * s.head_dim * 4 for s in model.kv_spec())
    # Buffers grow by 256 tokens: a budget of 256 holds one request of up to 256.
    app, _ = make_app(model, tokenizer, kv_budget_bytes=per_token * 256, max_model_len=512)
    with TestClient(app) as client, caplog.at_level(logging.INFO, "pagedlm"):
        for stream in (False, True):
            r = client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 300, "stream": stream})
            assert error_of(r, 400, "max_tokens")["code"] == "kv_budget_exceeded"
        assert complete(client, prompt="hello", max_tokens=2)["usage"]["completion_tokens"] == 2
        assert metric(client, "pagedlm_requests_total", endpoint="completions", outcome="error") == 0
    assert not any(r.exc_info for r in caplog.records)


def test_the_paged_server_shares_one_pool_and_frees_it(model, tokenizer):
    app, planner = make_app(model, tokenizer, paged_kv=PagedKvOptions(16), kv_budget_bytes=1 << 20)
    blocks = planner.engine.cache_stats().blocks_total
    with TestClient(app) as client:
        out = complete(client, prompt=["hello world", "the sea"], max_tokens=5)
        assert out["pagedlm"]["paged_kv"] is True and out["usage"]["completion_tokens"] == 10
        assert metric(client, "pagedlm_paged_kv_blocks_free") == blocks > 0
        assert metric(client, "pagedlm_paged_kv_blocks_in_use") == 0


def test_the_paged_server_reports_cached_prompt_tokens_and_the_prefix_hit_rate(model, tokenizer):
    app, _ = make_app(model, tokenizer, paged_kv=PagedKvOptions(16), kv_budget_bytes=1 << 20)
    prompt = "the quick brown fox jumps over the lazy dog."
    n = len(tokenizer.encode(prompt))
    with TestClient(app) as client:
        assert metric(client, "pagedlm_prefix_cache_hit_rate") == 0
        cold = complete(client, prompt=prompt, max_tokens=2)
        assert cold["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
        warm = complete(client, prompt=prompt, max_tokens=2)
        cached = min(n // 16 * 16, n - 1)  # whole blocks, never the last token
        assert warm["usage"]["prompt_tokens_details"] == {"cached_tokens": cached} and cached >= 32
        assert warm["choices"][0]["text"] == cold["choices"][0]["text"]
        assert metric(client, "pagedlm_prefix_cache_hit_tokens_total") == cached
        assert metric(client, "pagedlm_prefix_cache_hit_rate") == pytest.approx(cached / (2 * n))
        assert metric(client, "pagedlm_paged_kv_blocks_cached") >= n // 16
        assert metric(client, "pagedlm_paged_kv_blocks_shared") == 0  # nothing running now
        assert metric(client, "pagedlm_paged_kv_blocks_in_use") == 0


def test_a_prompt_too_long_for_the_context_is_refused_before_it_is_tokenized(served, monkeypatch):
    client, planner = served
    monkeypatch.setattr(planner.tokenizer, "encode", lambda *a, **k: pytest.fail("tokenized"))
    monkeypatch.setattr(planner.tokenizer, "encode_chat", lambda *a, **k: pytest.fail("tokenized"))
    text = "x" * (MAX_MODEL_LEN * planner.tokenizer.max_token_chars + 1)
    r = client.post("/v1/completions", json={"prompt": text})
    assert error_of(r, 400, "prompt")["code"] == "context_length_exceeded"
    r = client.post("/v1/completions", json={"prompt": ["hi", text]})
    assert error_of(r, 400, "prompt")["code"] == "context_length_exceeded"
    half = text[: len(text) // 2 + 1]
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "system", "content": half},
                                                               {"role": "user", "content": half}]})
    assert error_of(r, 400, "messages")["code"] == "context_length_exceeded"


# ---------------------------------------------------------------- echo and scoring (item 16)


def test_echo_with_max_tokens_0_scores_the_prompt_and_generates_nothing(client, tokenizer):
    prompt = "hello world, the sea"
    scored = complete(client, prompt=prompt, max_tokens=0, echo=True, logprobs=2)
    one = complete(client, prompt=prompt, max_tokens=1, echo=True, logprobs=2)
    choice = scored["choices"][0]
    n = len(tokenizer.encode(prompt))
    assert choice["text"] == prompt and choice["finish_reason"] == "length"
    assert scored["usage"] == {"prompt_tokens": n, "completion_tokens": 0, "total_tokens": n,
                               "prompt_tokens_details": {"cached_tokens": 0}}
    lp, lp1 = choice["logprobs"], one["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == n and lp["token_logprobs"][0] is None
    assert lp["tokens"] == lp1["tokens"][:n] and lp["token_logprobs"] == lp1["token_logprobs"][:n]
    # Without logprobs it is the prompt alone; without echo it stays a 400.
    bare = complete(client, prompt=prompt, max_tokens=0, echo=True)["choices"][0]
    assert bare["text"] == prompt and bare["logprobs"] is None
    r = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 0})
    error_of(r, 400, "max_tokens")


def test_echoed_top_logprobs_hold_the_actual_token_even_outside_the_top_k(client, tokenizer):
    prompt = "hello world, the sea is deep"
    lp = complete(client, prompt=prompt, max_tokens=0, echo=True, logprobs=1)["choices"][0]["logprobs"]
    outside = 0
    for token, token_lp, top in zip(lp["tokens"][1:], lp["token_logprobs"][1:], lp["top_logprobs"][1:]):
        assert top[token] == token_lp
        outside += len(top) == 2  # the actual token beside a better one
    assert outside > 0, "every prompt token was the top one: the case is not exercised"


# ---------------------------------------------------------------- wire shape (item 7), schema (item 6)


def test_stream_chunks_leave_out_the_empty_extension_field(client):
    whole = complete(client, max_tokens=3)
    assert whole["pagedlm"] == {"paged_kv": False, "cached_tokens": whole["pagedlm"]["cached_tokens"]}
    for path, body in (("/v1/completions", {"prompt": "hello"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hello"}]})):
        with client.stream("POST", path, json={**body, "max_tokens": 3, "stream": True,
                                                "stream_options": {"include_usage": True}}) as s:
            chunks = [json.loads(line[5:]) for line in s.iter_lines()
                      if line.startswith("data:") and line != "data: [DONE]"]
        assert len(chunks) >= 2 and all("pagedlm" not in c for c in chunks), path


def test_openapi_json_describes_the_routes_and_their_request_bodies(client):
    schema = client.get("/openapi.json").json()
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics"} <= set(schema["paths"])
    for path, model in (("/v1/completions", "CompletionRequest"), ("/v1/chat/completions", "ChatRequest")):
        op = schema["paths"][path]["post"]
        ref = op["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        assert ref == f"#/components/schemas/{model}"
        assert "400" in op["responses"] and "200" in op["responses"]
    components = schema["components"]["schemas"]
    assert "prompt" in components["CompletionRequest"]["required"]
    assert "messages" in components["ChatRequest"]["required"]


# ---------------------------------------------------------------- auth (item 5)


def test_an_empty_api_key_means_no_authentication(model, tokenizer):
    assert ServerOptions.resolve({"api_key": ""}, {}).api_key is None
    assert ServerOptions.resolve({"api_key": ""}, {"PAGEDLM_API_KEY": "secret"}).api_key is None
    assert ServerOptions.resolve({}, {"PAGEDLM_API_KEY": ""}).api_key is None
    app, _ = make_app(model, tokenizer, api_key=ServerOptions.resolve({"api_key": ""}, {}).api_key)
    with TestClient(app) as client:
        assert client.get("/v1/models").status_code == 200
        assert client.get("/v1/models", headers={"Authorization": "Bearer "}).status_code == 200


# ---------------------------------------------------------------- request bodies (item 2)


def _asgi(app, receive_messages, timeout_s=None):
    """Drive the ASGI app with a body that arrives as ``receive_messages``
    (then nothing more); returns the response status."""
    sent = []

    async def main():
        queue = list(receive_messages)

        async def receive():
            if queue:
                return queue.pop(0)
            await asyncio.sleep(3600)  # a client that stops sending

        async def send(message):
            sent.append(message)

        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
                 "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions",
                 "query_string": b"", "root_path": "", "server": ("test", 80), "client": ("test", 1),
                 "headers": [(b"content-type", b"application/json"), (b"content-length", b"1000")]}
        await app(scope, receive, send)

    asyncio.run(asyncio.wait_for(main(), 30))  # a guard: a hang fails instead of blocking the suite
    return next(m["status"] for m in sent if m["type"] == "http.response.start")


def test_a_client_that_leaves_mid_body_is_cancelled_not_an_error(model, tokenizer, caplog):
    app, _ = make_app(model, tokenizer)
    with caplog.at_level(logging.INFO, "pagedlm"):
        status = _asgi(app, [{"type": "http.request", "body": b'{"prompt": ', "more_body": True},
                             {"type": "http.disconnect"}])
    assert status == 499
    assert not any(r.exc_info or r.levelno >= logging.ERROR for r in caplog.records)
    with TestClient(app) as client:
        assert metric(client, "pagedlm_requests_total", endpoint="completions", outcome="cancelled") == 1
        assert metric(client, "pagedlm_requests_total", endpoint="completions", outcome="error") == 0


def test_a_body_shorter_than_its_content_length_times_out_with_408(model, tokenizer, monkeypatch):
    monkeypatch.setattr(app_module, "BODY_TIMEOUT_S", 0.05)
    app, _ = make_app(model, tokenizer)
    status = _asgi(app, [{"type": "http.request", "body": b'{"prompt": ', "more_body": True}])
    assert status == 408


# ---------------------------------------------------------------- bad requests (issue 27)

_CHAT = [{"role": "user", "content": "x"}]

BAD = {  # case: (path, body, status, the param the error names)
    "max_tokens 2.5": ("/v1/completions", {"prompt": "x", "max_tokens": 2.5}, 400, "max_tokens"),
    "n as a string": ("/v1/completions", {"prompt": "x", "n": "2"}, 400, "n"),
    "n as a boolean": ("/v1/completions", {"prompt": "x", "n": True}, 400, "n"),
    "seed 1.5": ("/v1/completions", {"prompt": "x", "seed": 1.5}, 400, "seed"),
    "logit_bias key not an id": ("/v1/completions", {"prompt": "x", "logit_bias": {"abc": 1}}, 400, "logit_bias"),
    "logit_bias id outside the vocabulary": ("/v1/completions", {"prompt": "x", "logit_bias": {"99999": 1}},
                                             400, "logit_bias"),
    "logit_bias infinite": ("/v1/completions", b'{"prompt": "x", "logit_bias": {"5": 1e999}}', 400, "logit_bias"),
    "logit_bias a list": ("/v1/completions", {"prompt": "x", "logit_bias": [1]}, 400, "logit_bias"),
    "suffix": ("/v1/completions", {"prompt": "x", "suffix": "y"}, 400, "suffix"),
    "best_of above n": ("/v1/completions", {"prompt": "x", "best_of": 2}, 400, "best_of"),
    "response_format xml": ("/v1/chat/completions", {"messages": _CHAT, "response_format": {"type": "xml"}},
                            400, "response_format.type"),
    "tools": ("/v1/chat/completions", {"messages": _CHAT, "tools": [{"type": "function"}]}, 400, "tools[0].function"),
    "tool_choice required": ("/v1/chat/completions", {"messages": _CHAT, "tool_choice": "required"}, 400,
                             "tool_choice"),
    "guided_json": ("/v1/completions", {"prompt": "x", "guided_json": {"type": "objectx"}}, 400, "guided_json"),
    "an unknown field": ("/v1/completions", {"prompt": "x", "frobnicate": 1}, 400, "frobnicate"),
    "an unknown nested field": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x", "x": 1}]},
                                400, "messages[0].x"),
    "prompt_logprobs streamed": ("/v1/completions", {"prompt": "x", "prompt_logprobs": 1, "stream": True}, 400,
                                 "prompt_logprobs"),
    "prompt_logprobs 21": ("/v1/completions", {"prompt": "x", "prompt_logprobs": 21}, 400, "prompt_logprobs"),
    "min_tokens above max_tokens": ("/v1/completions", {"prompt": "x", "max_tokens": 2, "min_tokens": 3}, 400,
                                    "min_tokens"),
    "stop_token_ids outside the vocabulary": ("/v1/completions", {"prompt": "x", "stop_token_ids": [-1]}, 400,
                                              "stop_token_ids"),
    "allowed_token_ids empty": ("/v1/completions", {"prompt": "x", "allowed_token_ids": []}, 400,
                                "allowed_token_ids"),
    "bad_words blank": ("/v1/completions", {"prompt": "x", "bad_words": [" "]}, 400, "bad_words"),
    "truncate_prompt_tokens 0": ("/v1/completions", {"prompt": "x", "truncate_prompt_tokens": 0}, 400,
                                 "truncate_prompt_tokens"),
    "chat_template that does not compile": ("/v1/chat/completions", {"messages": _CHAT, "chat_template": "{{"},
                                            400, "chat_template"),
    "chat_template that raises": ("/v1/chat/completions",
                                  {"messages": _CHAT, "chat_template": "{{ raise_exception('no') }}"}, 400,
                                  "chat_template"),
    "chat_template_kwargs not an object": ("/v1/chat/completions", {"messages": _CHAT, "chat_template_kwargs": [1]},
                                           400, "chat_template_kwargs"),
    "continue_final_message with add_generation_prompt": (
        "/v1/chat/completions", {"messages": _CHAT + [{"role": "assistant", "content": "y"}],
                                 "continue_final_message": True, "add_generation_prompt": True},
        400, "continue_final_message"),
    "stream_options without stream": ("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}},
                                      400, "stream_options"),
    "stream_options with stream false": ("/v1/chat/completions", {"messages": _CHAT, "stream": False,
                                                                  "stream_options": {"include_usage": True}},
                                         400, "stream_options"),
    "tokenize without prompt or messages": ("/tokenize", {}, 400, "prompt"),
    "tokenize an unknown model": ("/tokenize", {"prompt": "x", "model": "gpt-9"}, 404, "model"),
    "detokenize a token outside the vocabulary": ("/detokenize", {"tokens": [10**6]}, 400, "tokens"),
    "detokenize strings": ("/detokenize", {"tokens": ["a"]}, 400, "tokens[0]"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_is_a_400_naming_the_field(client, case):
    path, body, status, param = BAD[case]
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = client.post(path, content=content, headers={"Content-Type": "application/json"})
    assert error_of(r, status, param)["message"]


def test_a_seed_out_of_range_is_refused_with_the_range(client):
    for seed in (2**64, -(2**63) - 1):
        r = client.post("/v1/completions", json={"prompt": "x", "seed": seed})
        assert "an integer from -2**63 to 2**64 - 1" in error_of(r, 400, "seed")["message"]


def test_max_tokens_0_mentions_echo_only_where_echo_exists(client):
    r = client.post("/v1/chat/completions", json={"messages": _CHAT, "max_tokens": 0})
    assert "echo" not in error_of(r, 400, "max_tokens")["message"]
    r = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 0})
    assert "0 only with echo" in error_of(r, 400, "max_tokens")["message"]
