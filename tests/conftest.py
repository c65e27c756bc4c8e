"""Fixtures shared by every suite (the models and tokenizers they build on are
in tests/helpers.py)."""

from __future__ import annotations

import os

import torch

# Triton kernels run interpreted on a machine without CUDA (set before any
# kernel is defined: triton reads it when the kernel module is imported).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

from tests.helpers import TINY, CharTokenizer, tiny_model


@pytest.fixture(scope="module", params=list(TINY))
def tiny(request):
    """(family, model, tokenizer) for each tiny family."""
    return request.param, tiny_model(request.param), CharTokenizer()
