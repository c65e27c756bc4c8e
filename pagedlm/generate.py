"""One request at a time, through the engine: ``stream_generate`` and ``generate``.

A thin wrapper: a request here is a batch of one in an `LLMEngine`, by
default a default-store engine of its own (one costs microseconds to make
and holds nothing between requests; one per call lets two requests on one
model run side by side, each stepping only itself). Pass ``engine`` for
another, for example a paged one or one with a prompt cache. Many requests
at once: `pagedlm.LLM` or the engine.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterator, Sequence

import torch

from .batch.engine import GenerationResponse, LLMEngine
from .options import OptionError
from .params import SamplingParams

if TYPE_CHECKING:
    from .tokenizer import Tokenizer


def stream_generate(
    model: torch.nn.Module,
    tokenizer: "Tokenizer",
    prompt: str | Sequence[int],
    options: SamplingParams | None = None,
    *,
    engine: LLMEngine | None = None,
) -> Iterator[GenerationResponse]:
    """Generate from ``prompt`` (text, or token ids), yielding as text completes."""
    ids = tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
    if not ids:
        raise OptionError("the prompt is empty")
    engine = engine or LLMEngine(model, tokenizer)
    yield from engine.stream(ids, options)


def generate(
    model: torch.nn.Module,
    tokenizer: "Tokenizer",
    prompt: str | Sequence[int],
    options: SamplingParams | None = None,
    *,
    engine: LLMEngine | None = None,
) -> str:
    """The whole completion as one string."""
    return "".join(r.text for r in stream_generate(model, tokenizer, prompt, options, engine=engine))


__all__ = ["stream_generate", "generate"]
