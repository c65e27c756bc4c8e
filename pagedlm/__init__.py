"""pagedlm: run and serve language models, with an optional paged KV cache.

    from pagedlm import LLM, SamplingParams   # as a vLLM script imports them
    llm = LLM("gemma3-270m", paged_kv=True)
    outputs = llm.generate(["The capital of France is"], SamplingParams(max_tokens=16))
    print(outputs[0].outputs[0].text)

One request at a time: ``model, tokenizer = pagedlm.load(...)`` and
``pagedlm.generate(model, tokenizer, prompt)`` / ``stream_generate``.
"""

import importlib.metadata

try:
    __version__ = importlib.metadata.version("pagedlm")
except importlib.metadata.PackageNotFoundError:  # a source tree that was never installed
    __version__ = "unknown (not installed)"

from .batch.engine import GenerationResponse, LLMEngine
from .generate import generate, stream_generate
from .llm import LLM, CompletionOutput, Logprob, RequestOutput
from .loading import load
from .options import EngineOptions, PagedKvOptions
from .params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob", "LLMEngine",
           "EngineOptions", "load", "generate", "stream_generate", "PagedKvOptions",
           "GenerationResponse", "__version__"]
