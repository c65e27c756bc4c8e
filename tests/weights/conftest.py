"""Fixtures of the real-model suites."""

from __future__ import annotations

from typing import Callable

import pytest
import torch

from pagedlm.loading import load


@pytest.fixture(scope="session")
def float32_model() -> Callable[[str], tuple]:
    """``load(name, "cpu", torch.float32)``, once per model per session: Gemma 3
    270M takes seconds to load on two cores, and several suites read the same
    float32 weights. Only for tests that never change the model (no in-place
    cast, no method patched and left behind); a test that does loads its own."""
    loaded: dict[str, tuple] = {}

    def get(name: str) -> tuple:
        if name not in loaded:
            loaded[name] = load(name, "cpu", torch.float32)
        return loaded[name]

    yield get
    loaded.clear()
