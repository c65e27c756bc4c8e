"""Schema fuzzing (schemathesis) of the in-process server on a tiny model:
whatever the schema allows a client to send, the answer is never a 5xx, and
every error is OpenAI's ``{"error": {...}}`` body. Bounded: a few dozen
examples per operation; a 64-token context keeps every generation short."""

from __future__ import annotations

import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error

from conftest import tiny_model, tiny_tokenizer
from test_server_app import make_app

_tokenizer = tiny_tokenizer()
APP, _ = make_app(tiny_model(_tokenizer.vocab_size), _tokenizer, max_model_len=64)
schema = schemathesis.openapi.from_asgi("/openapi.json", APP)


def openai_shaped_errors(ctx, response, case):
    if response.status_code >= 400 and response.status_code != 499:
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}, error
        assert isinstance(error["message"], str) and error["message"]


@schema.parametrize()
@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
def test_no_input_the_schema_allows_gets_a_5xx_or_a_non_openai_error(case):
    response = case.call()
    # Raises (a failure listing the broken checks) on a 5xx or a non-OpenAI error body.
    case.validate_response(response, checks=[not_a_server_error, openai_shaped_errors])
