"""Schema fuzzing (schemathesis) of the in-process server on a tiny model:
whatever the schema allows a client to send, the answer is never a 5xx, and
every error is OpenAI's ``{"error": {...}}`` body. Bounded: a few dozen
examples per operation; a 64-token context keeps every generation short."""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, settings

from tests.fast.server_helpers import make_app


@pytest.fixture(scope="module")
def fuzzed_schema(model, tokenizer):
    """The app's schema, over an engine loop started for this module and stopped after it."""
    app, _ = make_app(model, tokenizer, max_model_len=64)
    yield schemathesis.openapi.from_asgi("/openapi.json", app)
    app.state.engine_loop.close()


schema = schemathesis.pytest.from_fixture("fuzzed_schema")


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
