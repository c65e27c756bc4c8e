"""Fixtures of the generation and server tests: the tiny byte-level tokenizer,
a plain tiny model over its vocabulary, the server app over both."""

from __future__ import annotations

import pytest
import torch

from pagedlm.tokenizer import Tokenizer
from tests import helpers


@pytest.fixture(scope="session")
def tokenizer() -> Tokenizer:
    return helpers.tiny_tokenizer()


@pytest.fixture(scope="session")
def model(tokenizer) -> torch.nn.Module:
    return helpers.tiny_model(vocab_size=tokenizer.vocab_size, plain=True)


@pytest.fixture(scope="module")
def served(model, tokenizer):
    """(client, planner) of the server app over the tiny model (tests.fast.server_helpers.make_app)."""
    from tests.fast.server_helpers import serving

    with serving(model, tokenizer) as pair:
        yield pair


@pytest.fixture
def client(served):
    return served[0]
