"""Weight-only quantization on a real model: int8 greedy tokens equal none's
on a short prompt (a smoke test of the whole path: cache conversion, tied
head, embedding lookup). Perplexity figures: `pagedlm bench ppl`."""

from __future__ import annotations

import pytest
from pagedlm.batch.solo import Solo
from pagedlm.loading import load
from pagedlm.loading.catalog import BUILTINS

pytestmark = pytest.mark.weights


def _greedy(model, ids: list[int], n: int) -> list[int]:
    """Greedy continuation, one sequence through `Solo` (prompt, then a token a call)."""
    solo = Solo(model)
    logits = solo(ids)[-1]
    out: list[int] = []
    for _ in range(n):
        out.append(int(logits.argmax()))
        logits = solo([out[-1]])[-1]
    return out


def test_int8_greedy_tokens_match_none_on_smollm2():
    if BUILTINS["smollm2-135m-instruct"].locate() is None:
        pytest.skip(BUILTINS["smollm2-135m-instruct"].install)
    model, tok = load("smollm2-135m-instruct")
    ids = tok.encode("The capital of France is")
    expected = _greedy(model, ids, 8)
    qmodel, _ = load("smollm2-135m-instruct", quantization="int8")
    assert _greedy(qmodel, ids, 8) == expected
