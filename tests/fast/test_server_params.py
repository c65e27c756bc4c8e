"""Request fields, routes, flags and metrics of the server, each through
plain HTTP on the tiny model: every field either does what vLLM / OpenAI
say it does, or is a 400 naming it. Forced tokens (``logit_bias`` +100)
make the tiny model's output predictable where a test needs it."""

from __future__ import annotations

import logging

import pytest
from fastapi.testclient import TestClient

from pagedlm.options import OptionError, ServerOptions
from pagedlm.server import _setup_logging, check_tls
from pagedlm.server.protocol import IGNORED

from tests.fast.server_helpers import error_of, make_app, metric

CHAT = [{"role": "user", "content": "hello"}]
EOS = 2  # <|im_end|> of the tiny tokenizer
IM_START = 1  # a special (control) token


@pytest.fixture(scope="module")
def z(tokenizer) -> int:
    (token,) = tokenizer.encode("z", add_special_tokens=False)
    return token


def complete(client, **body) -> dict:
    r = client.post("/v1/completions", json={"prompt": "hello world", "max_tokens": 4, **body})
    assert r.status_code == 200, r.text
    return r.json()


def chat(client, **body) -> dict:
    r = client.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 2, **body})
    assert r.status_code == 200, r.text
    return r.json()


def text(out: dict) -> str:
    return out["choices"][0]["text"]


def force(token: int) -> dict:
    return {"logit_bias": {str(token): 100}}


# ---------------------------------------------------------------- sampling fields


def test_logit_bias_plus_100_forces_a_token_and_minus_100_bans_one(client, z, tokenizer):
    assert text(complete(client, **force(z))) == "zzzz"
    (y,) = tokenizer.encode("y", add_special_tokens=False)
    assert text(complete(client, allowed_token_ids=[y, z], logit_bias={str(z): -100})) == "yyyy"
    assert text(complete(client, allowed_token_ids=[y, z], logit_bias={str(y): -100})) == "zzzz"


@pytest.mark.parametrize("bias, why", [({"z": 1}, "token ids"), ({"1.0": 1}, "token ids"),
                                       ({"100000": 1}, "outside the vocabulary"),
                                       ({"-1": 1}, "outside the vocabulary")])
def test_logit_bias_with_a_key_that_is_no_token_id_is_a_400(client, bias, why):
    r = client.post("/v1/completions", json={"prompt": "hi", "logit_bias": bias})
    assert why in error_of(r, 400, "logit_bias")["message"]


def test_min_tokens_holds_back_the_end_of_sequence(client):
    assert complete(client, **force(EOS))["usage"]["completion_tokens"] == 1
    out = complete(client, **force(EOS), min_tokens=3)
    assert out["usage"]["completion_tokens"] == 4 and out["choices"][0]["finish_reason"] == "stop"


def test_ignore_eos_generates_past_the_end_of_sequence(client):
    assert complete(client, **force(EOS), ignore_eos=False)["usage"]["completion_tokens"] == 1
    out = complete(client, **force(EOS), ignore_eos=True)
    assert out["usage"]["completion_tokens"] == 4 and out["choices"][0]["finish_reason"] == "length"


def test_stop_token_ids_end_the_choice_and_are_its_stop_reason(client, z):
    choice = complete(client, **force(z), stop_token_ids=[z])["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == z and choice["text"] == ""
    r = client.post("/v1/completions", json={"prompt": "hi", "stop_token_ids": [10**6]})
    error_of(r, 400, "stop_token_ids")


def test_include_stop_str_in_output_keeps_the_stop_string(client, z):
    assert text(complete(client, **force(z), stop=["z"])) == ""
    choice = complete(client, **force(z), stop=["z"], include_stop_str_in_output=True)["choices"][0]
    assert choice["text"] == "z" and choice["stop_reason"] == "z"


def test_skip_special_tokens_false_keeps_their_text(client):
    assert text(complete(client, **force(IM_START))) == ""
    assert text(complete(client, **force(IM_START), skip_special_tokens=False)) == "<|im_start|>" * 4


def test_allowed_token_ids_and_bad_words_restrict_what_is_sampled(client, z):
    assert text(complete(client, allowed_token_ids=[z])) == "zzzz"
    banned = text(complete(client, **force(z), bad_words=["z"]))
    assert len(banned) >= 1 and "z" not in banned


def test_truncate_prompt_tokens_keeps_the_last_k(client, tokenizer):
    ids = tokenizer.encode("the quick brown fox jumps over", add_special_tokens=False)
    out = complete(client, prompt=ids, truncate_prompt_tokens=5)
    assert out["usage"]["prompt_tokens"] == 5
    assert text(out) == text(complete(client, prompt=ids[-5:]))
    everything = complete(client, prompt=ids, truncate_prompt_tokens=-1)  # -1: the whole context
    assert everything["usage"]["prompt_tokens"] == len(ids)
    r = client.post("/v1/completions", json={"prompt": ids, "truncate_prompt_tokens": 0})
    error_of(r, 400, "truncate_prompt_tokens")


def test_prompt_logprobs_in_vllms_shape_on_both_endpoints(client, tokenizer):
    ids = tokenizer.encode("hello world", add_special_tokens=False)
    choice = complete(client, prompt=ids, max_tokens=1, prompt_logprobs=2)["choices"][0]
    lps = choice["prompt_logprobs"]
    assert len(lps) == len(ids) and lps[0] is None
    for token, entry in zip(ids[1:], lps[1:]):
        assert str(token) in entry and 2 <= len(entry) <= 3
        ranks = sorted(e["rank"] for e in entry.values())
        assert ranks[:2] == [1, 2] and entry[str(token)]["rank"] >= 1
        assert entry[str(token)]["decoded_token"] == tokenizer.decode([token])
    # the same scores as echo's, which reads the same pass
    echo = complete(client, prompt=ids, max_tokens=1, echo=True, logprobs=1, prompt_logprobs=2)
    assert echo["choices"][0]["logprobs"]["token_logprobs"][1:len(ids)] == pytest.approx(
        [e[str(t)]["logprob"] for t, e in zip(ids[1:], lps[1:])])
    assert all(len(top) <= 2 for top in echo["choices"][0]["logprobs"]["top_logprobs"][1:len(ids)])
    whole = chat(client, prompt_logprobs=0)
    assert whole["prompt_logprobs"][0] is None
    assert len(whole["prompt_logprobs"]) == whole["usage"]["prompt_tokens"]
    r = client.post("/v1/completions", json={"prompt": "hi", "prompt_logprobs": 1, "stream": True})
    error_of(r, 400, "prompt_logprobs")


def test_best_of_is_accepted_only_equal_to_n(client):
    assert len(complete(client, n=2, best_of=2)["choices"]) == 2
    r = client.post("/v1/completions", json={"prompt": "hi", "best_of": 3})
    assert "best_of" in error_of(r, 400, "best_of")["message"]


def test_n_choices_count_their_prompt_once_in_usage(client, tokenizer):
    n_prompt = len(tokenizer.encode("hello world"))
    out = complete(client, n=3, max_tokens=2)
    assert out["usage"]["prompt_tokens"] == n_prompt
    assert out["usage"]["completion_tokens"] == 6 and out["usage"]["total_tokens"] == n_prompt + 6
    batch = complete(client, prompt=["hello world", "hi"], n=2, max_tokens=1)
    assert batch["usage"]["prompt_tokens"] == n_prompt + len(tokenizer.encode("hi"))
    assert chat(client, n=2)["usage"]["prompt_tokens"] == chat(client)["usage"]["prompt_tokens"]


# ---------------------------------------------------------------- chat template fields


def test_add_generation_prompt_false_leaves_out_the_assistant_turn(client, tokenizer):
    opened = chat(client)["usage"]["prompt_tokens"]
    closed = chat(client, add_generation_prompt=False)["usage"]["prompt_tokens"]
    assert opened - closed == len(tokenizer.encode("<|im_start|>assistant\n", add_special_tokens=False))


def test_continue_final_message_ends_the_prompt_inside_the_last_message(client, tokenizer):
    messages = CHAT + [{"role": "assistant", "content": "Hel"}]
    body = {"messages": messages, "continue_final_message": True, "add_generation_prompt": False}
    ids = client.post("/tokenize", json=body).json()["tokens"]
    assert tokenizer.decode(ids, skip_special_tokens=False).endswith("<|im_start|>assistant\nHel")
    out = chat(client, messages=messages, continue_final_message=True)  # the generation prompt goes off
    assert out["usage"]["prompt_tokens"] == len(ids)
    r = client.post("/v1/chat/completions", json={**body, "add_generation_prompt": True})
    error_of(r, 400, "continue_final_message")
    r = client.post("/v1/chat/completions", json={"messages": CHAT, "continue_final_message": True})
    error_of(r, 400, "continue_final_message")  # the last message is the user's


def test_chat_template_and_its_kwargs_replace_the_models_template(client, tokenizer):
    template = "{{ greeting | default('') }}{% for m in messages %}{{ m['content'] }}{% endfor %}!"
    out = chat(client, chat_template=template)
    assert out["usage"]["prompt_tokens"] == len(tokenizer.encode("hello!", add_special_tokens=False))
    greeted = chat(client, chat_template=template, chat_template_kwargs={"greeting": "dear "})
    assert greeted["usage"]["prompt_tokens"] == len(tokenizer.encode("dear hello!", add_special_tokens=False))
    r = client.post("/v1/chat/completions", json={"messages": CHAT, "chat_template": "{% for %}"})
    assert "compile" in error_of(r, 400, "chat_template")["message"]
    r = client.post("/v1/chat/completions", json={"messages": CHAT, "chat_template": "{{ 1 // 0 }}"})
    error_of(r, 400, "chat_template")
    r = client.post("/v1/chat/completions", json={"messages": CHAT, "chat_template_kwargs": {"messages": []}})
    error_of(r, 400, "chat_template_kwargs")


# ---------------------------------------------------------------- refused and ignored fields


@pytest.mark.parametrize("path, field, value", [
    ("/v1/completions", "suffix", "the end"),
    ("/v1/completions", "guided_decoding_backend", "xgrammar"),
    ("/v1/completions", "guided_whitespace_pattern", " "),
    ("/v1/completions", "grammar", "root ::= 'a'"),
    ("/v1/completions", "json_schema", {"type": "object"}),
    ("/v1/completions", "tools", [{"type": "function", "function": {"name": "f"}}]),
    ("/v1/completions", "tool_choice", "auto"),
    ("/v1/chat/completions", "function_call", "auto"),
    ("/v1/chat/completions", "functions", [{"name": "f"}]),
    ("/v1/completions", "use_beam_search", True),
    ("/v1/chat/completions", "echo", True),
    ("/v1/chat/completions", "add_special_tokens", True),
    ("/v1/completions", "priority", 5),
    ("/v1/completions", "spaces_between_special_tokens", False),
])
def test_a_field_not_implemented_is_a_400_naming_it(client, path, field, value):
    body = {"prompt": "hi"} if path == "/v1/completions" else {"messages": CHAT}
    r = client.post(path, json={**body, field: value})
    assert error_of(r, 400, field)["code"] == "unsupported_parameter"


def test_an_unknown_field_is_a_400_naming_it_but_metadata_and_nulls_are_accepted(client):
    """Unknown fields are refused, nested ones too; what clients send without
    asking for anything is not: metadata, nulls, an assistant message read
    back from an OpenAI response, text output."""
    r = client.post("/v1/completions", json={"prompt": "hi", "temprature": 0.5})
    assert error_of(r, 400, "temprature")["code"] == "unknown_parameter"
    r = client.post("/v1/completions", json={"prompt": "hi", "stream_options": {"include_usage": True, "x": 1}})
    error_of(r, 400, "stream_options.x")
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi", "tool_calls": [{}]}]})
    error_of(r, 400, "messages[0].tool_calls[0].function")
    base = complete(client)
    extras = {name: "x" if name == "user" else None for name in IGNORED}
    extras |= {"metadata": {"k": "v"}, "store": False, "suffix": None, "tools": None,
               "response_format": {"type": "text"}, "best_of": 1, "temprature": None}
    assert text(complete(client, **extras)) == text(base)
    echoed = {"role": "assistant", "content": "hi", "refusal": None, "tool_calls": None, "annotations": [],
              "audio": None, "function_call": None}
    chat(client, messages=CHAT + [echoed, {"role": "user", "content": "again"}], tool_choice="none",
         parallel_tool_calls=True, modalities=["text"])


@pytest.mark.parametrize("field", ["max_tokens", "n", "top_k", "seed", "min_tokens"])
def test_integer_fields_take_1_0_but_not_1_5_a_string_or_a_boolean(client, field):
    value = 2.0 if field == "n" else 1.0
    assert complete(client, **{field: value})["choices"]
    for bad in (1.5, "1", True):
        r = client.post("/v1/completions", json={"prompt": "hi", field: bad})
        error_of(r, 400, field)


# ---------------------------------------------------------------- routes


def test_head_health_and_ping_answer_200(client):
    assert client.head("/health").status_code == 200
    assert client.get("/ping").status_code == 200 and client.post("/ping").status_code == 200


def test_version_route(client):
    assert client.get("/version").json() == {"version": "0.1.0"}


def test_tokenize_and_detokenize_round_trip(client, tokenizer):
    r = client.post("/tokenize", json={"prompt": "hello world"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["tokens"] == tokenizer.encode("hello world") and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == 64
    assert client.post("/detokenize", json={"tokens": body["tokens"]}).json() == {"prompt": "hello world"}
    chat_ids = client.post("/tokenize", json={"messages": CHAT}).json()
    assert chat_ids["count"] == chat(client)["usage"]["prompt_tokens"]
    error_of(client.post("/detokenize", json={"tokens": [10**6]}), 400, "tokens")
    error_of(client.post("/tokenize", json={"prompt": "x", "model": "other"}), 404, "model")
    error_of(client.post("/tokenize", json={"messages": CHAT, "add_special_tokens": True}), 400,
             "add_special_tokens")
    # messages: null is no messages (a field sent as null is a field not sent)
    assert client.post("/tokenize", json={"prompt": "hello world", "messages": None}).json()["tokens"] == body["tokens"]
    # text parts join with newlines, as vLLM joins them
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    joined = [{"role": "user", "content": "a\nb"}]
    assert client.post("/tokenize", json={"messages": parts}).json() == \
        client.post("/tokenize", json={"messages": joined}).json()


def test_models_by_id(client):
    card = client.get("/v1/models/tiny")
    assert card.status_code == 200 and card.json()["id"] == "tiny" and card.json()["object"] == "model"
    assert error_of(client.get("/v1/models/other"), 404, "model")["code"] == "model_not_found"


def test_openapi_declares_metrics_as_prometheus_text_and_the_new_routes(client):
    schema = client.get("/openapi.json").json()
    content = schema["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    assert list(content) == ["text/plain"]
    assert {"/tokenize", "/detokenize", "/version", "/ping", "/v1/models/{model_id}"} <= set(schema["paths"])
    assert "head" in schema["paths"]["/health"]
    assert schema["components"]["schemas"]["CompletionRequest"]["additionalProperties"] is False


def test_a_protected_route_answers_401_before_405(model, tokenizer):
    app, _ = make_app(model, tokenizer, api_key="secret")
    with TestClient(app) as client:
        for method, path in (("GET", "/v1/completions"), ("DELETE", "/v1/models"), ("PUT", "/metrics")):
            r = client.request(method, path)
            assert error_of(r, 401, None)["code"] == "invalid_api_key", (method, path)
        auth = {"Authorization": "Bearer secret"}
        assert client.get("/v1/completions", headers=auth).status_code == 405
        assert client.head("/health").status_code == 200 and client.get("/version").status_code == 200
        assert client.post("/tokenize", json={"prompt": "x"}).status_code == 401
        assert client.post("/tokenize", json={"prompt": "x"}, headers=auth).status_code == 200


# ---------------------------------------------------------------- flags


def test_served_model_names_are_the_ids_clients_send(model, tokenizer):
    app, _ = make_app(model, tokenizer, served_model_name=("first", "second"))
    with TestClient(app) as client:
        assert [m["id"] for m in client.get("/v1/models").json()["data"]] == ["first", "second"]
        assert complete(client)["model"] == "first"
        assert complete(client, model="second")["model"] == "second"
        assert client.get("/v1/models/second").status_code == 200
        r = client.post("/v1/completions", json={"prompt": "hi", "model": "tiny"})  # --model's string
        assert error_of(r, 404, "model")["code"] == "model_not_found"
    options = ServerOptions.resolve({"served_model_name": ["a", "b"]}, {})
    assert options.model_names == ("a", "b")
    assert ServerOptions.resolve({}, {"PAGEDLM_SERVED_MODEL_NAME": "a,b"}).model_names == ("a", "b")
    assert ServerOptions.resolve({"model": "m"}, {}).model_names == ("m",)


def test_the_chat_template_flag_reads_a_file_and_refuses_a_bad_one(model, tokenizer, tmp_path):
    good = tmp_path / "t.jinja"
    good.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    options = ServerOptions.resolve({"chat_template": str(good)}, {})
    app, _ = make_app(model, tokenizer, chat_template=options.chat_template)
    with TestClient(app) as client:
        assert chat(client)["usage"]["prompt_tokens"] == len(tokenizer.encode("hello", add_special_tokens=False))
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for m in messages %}")
    binary = tmp_path / "bin.jinja"
    binary.write_bytes(b"\xff\xfe")
    for path, why in ((tmp_path / "none.jinja", "No such file"), (bad, "compile"), (binary, "codec")):
        with pytest.raises(OptionError, match=why) as e:
            ServerOptions.resolve({"chat_template": str(path)}, {})
        assert "\n" not in str(e.value) and "--chat-template" in str(e.value)


def test_the_seed_flag_makes_unseeded_requests_reproducible(model, tokenizer):
    sample = {"temperature": 1.0, "max_tokens": 8}
    app, _ = make_app(model, tokenizer, seed=7)
    with TestClient(app) as client:
        outs = {text(complete(client, **sample)) for _ in range(3)}
        assert len(outs) == 1
        assert outs == {text(complete(client, **sample, seed=7))}
        assert text(complete(client, **sample, seed=8)) not in outs  # a request's own seed wins
    with pytest.raises(OptionError, match="--seed"):
        ServerOptions.resolve({"seed": "soon"}, {})


def test_cors_preflight_and_headers_for_the_allowed_origins(model, tokenizer):
    app, _ = make_app(model, tokenizer, api_key="secret", allowed_origins=("http://ok.example",))
    preflight = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization"}
    with TestClient(app) as client:
        r = client.options("/v1/completions", headers={"Origin": "http://ok.example", **preflight})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://ok.example"
        r = client.options("/v1/completions", headers={"Origin": "http://evil.example", **preflight})
        assert r.status_code == 400 and "access-control-allow-origin" not in r.headers
        r = client.get("/v1/models", headers={"Origin": "http://ok.example"})  # a 401 a browser can read
        assert r.status_code == 401 and r.headers["access-control-allow-origin"] == "http://ok.example"
    assert ServerOptions.resolve({"allowed_origins": '["http://a", "http://b"]'}, {}).allowed_origins == \
        ("http://a", "http://b")
    assert ServerOptions.resolve({"allowed_origins": "http://a,http://b"}, {}).allowed_origins == \
        ("http://a", "http://b")
    with pytest.raises(OptionError, match="--allowed-origins"):
        ServerOptions.resolve({"allowed_methods": "GET"}, {})
    app, _ = make_app(model, tokenizer)  # no origins: no CORS
    with TestClient(app) as client:
        r = client.options("/v1/completions", headers={"Origin": "http://ok.example", **preflight})
        assert "access-control-allow-origin" not in r.headers


def test_log_level_sets_pagedlms_logger(monkeypatch):
    assert ServerOptions.resolve({"log_level": "WARNING"}, {}).log_level == "warning"
    with pytest.raises(OptionError, match="--log-level"):
        ServerOptions.resolve({"log_level": "loud"}, {})
    logger = logging.getLogger("pagedlm")
    monkeypatch.setattr(logger, "level", logger.level)
    _setup_logging("error")
    assert logger.getEffectiveLevel() == logging.ERROR


def test_tls_needs_both_files_and_files_that_load(tmp_path):
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    key.write_text("not a key")
    cert.write_text("not a certificate")
    with pytest.raises(OptionError, match="go together"):
        ServerOptions.resolve({"ssl_keyfile": str(key)}, {})
    with pytest.raises(OptionError, match="--ssl-certfile"):
        ServerOptions.resolve({"ssl_keyfile": str(key), "ssl_certfile": str(tmp_path / "missing.pem")}, {})
    options = ServerOptions.resolve({"ssl_keyfile": str(key), "ssl_certfile": str(cert)}, {})
    with pytest.raises(OptionError, match="cannot load"):
        check_tls(options.ssl_keyfile, options.ssl_certfile)


# ---------------------------------------------------------------- metrics


def test_per_request_metrics_have_vllms_names_and_move(client):
    before = {name: metric(client, name, model_name="tiny") for name in (
        "pagedlm_e2e_request_latency_seconds_count", "pagedlm_request_queue_time_seconds_count",
        "pagedlm_request_prefill_time_seconds_count", "pagedlm_request_decode_time_seconds_count",
        "pagedlm_request_prompt_tokens_count", "pagedlm_request_generation_tokens_count")}
    length = metric(client, "pagedlm_request_success_total", finished_reason="length", model_name="tiny")
    stop = metric(client, "pagedlm_request_success_total", finished_reason="stop", model_name="tiny")
    generated = metric(client, "pagedlm_request_generation_tokens_sum", model_name="tiny")
    complete(client, n=2, max_tokens=3)
    complete(client, **force(EOS))
    for name, value in before.items():
        assert metric(client, name, model_name="tiny") == value + 3, name
    assert metric(client, "pagedlm_request_success_total", finished_reason="length", model_name="tiny") == length + 2
    assert metric(client, "pagedlm_request_success_total", finished_reason="stop", model_name="tiny") == stop + 1
    assert metric(client, "pagedlm_request_generation_tokens_sum", model_name="tiny") == generated + 7
    assert 0 <= metric(client, "pagedlm_kv_cache_usage_perc", model_name="tiny") <= 1
