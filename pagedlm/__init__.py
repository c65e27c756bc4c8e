"""pagedlm: run and serve language models, with an optional paged KV cache.

    import pagedlm
    model, tokenizer = pagedlm.load("gemma3-270m")
    print(pagedlm.generate(model, tokenizer, "The capital of France is"))
"""

from .generate import GenerationResponse, generate, stream_generate
from .loading import load
from .options import GenerateOptions, PagedKvOptions

__all__ = ["load", "generate", "stream_generate", "GenerateOptions", "PagedKvOptions",
           "GenerationResponse"]
