"""Loading models: every spec resolves to a Hugging Face-style folder.

    model, tokenizer = load("gemma3-270m", "cpu", torch.float32)

A spec is a built-in short name (``catalog.BUILTINS``), a .gguf file
(converted once into the cache, see ``catalog``), or an HF folder.
"""

from __future__ import annotations

import torch

from .catalog import DEFAULT_MODEL, LoadError, ModelNotFound, list_models, resolve
from .hf import load_model

__all__ = ["load", "resolve", "list_models", "load_model", "ModelNotFound", "LoadError", "DEFAULT_MODEL"]


def load(
    spec: str = DEFAULT_MODEL,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    quantization: str = "none",
):
    """(model, Tokenizer) for ``spec``; raises ModelNotFound with a one-line fix.

    ``quantization`` ("none", "int8", "int4"; ``options.resolve_quantization``
    turns flags and the environment into one) stores the linear layers and
    the embedding quantized (``loading.quant``)."""
    from pagedlm.options import check_quantization
    from pagedlm.tokenizer import Tokenizer

    check_quantization(quantization)
    folder = resolve(spec)
    if quantization == "none":
        model = load_model(folder, device, dtype)
    else:
        from .quant import load_quantized

        model = load_quantized(folder, quantization, device, dtype)
    return model, Tokenizer.from_folder(folder)
