"""Schema fuzzing (schemathesis) of the in-process server on a tiny model:
whatever the schema allows a client to send, the answer is never a 5xx, and
every error is OpenAI's ``{"error": {...}}`` body. Bounded: a few dozen
examples per operation; a 64-token context keeps every generation short."""

from __future__ import annotations

import schemathesis
from hypothesis import HealthCheck, settings

from conftest import tiny_model, tiny_tokenizer
from tests.fast.server_helpers import make_app

_tokenizer = tiny_tokenizer()
APP, _ = make_app(tiny_model(_tokenizer.vocab_size), _tokenizer, max_model_len=64)
schema = schemathesis.openapi.from_asgi("/openapi.json", APP)


def assert_openai_shaped_error(response) -> None:
    """An error (4xx; 499 is a client that left) carries OpenAI's body."""
    if response.status_code >= 400 and response.status_code != 499:
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}, error
        assert isinstance(error["message"], str) and error["message"]


@schema.parametrize()
@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
def test_no_input_the_schema_allows_gets_a_5xx_or_a_non_openai_error(case):
    response = case.call()
    assert response.status_code < 500, (case.method, case.path, response.status_code, response.text[:300])
    assert_openai_shaped_error(response)
