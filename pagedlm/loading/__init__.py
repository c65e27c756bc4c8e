"""Loading models: every spec resolves to a Hugging Face-style folder.

    model, tokenizer = load("gemma3-270m", "cpu", torch.float32)

A spec is a built-in short name (``catalog.BUILTINS``), a .gguf file
(converted once into the cache, see ``catalog``), or an HF folder.
"""

from __future__ import annotations

import torch

from .catalog import DEFAULT_MODEL, list_models, resolve
from .errors import LoadError, ModelNotFound, error_detail
from .hf import load_model

__all__ = ["load", "load_tokenizer", "resolve", "list_models", "load_model", "ModelNotFound", "LoadError", "DEFAULT_MODEL"]


def load(
    spec: str = DEFAULT_MODEL,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    quantization: str = "none",
):
    """(model, Tokenizer) for ``spec``; raises ModelNotFound with a one-line fix
    (a LoadError for files that are there but cannot be loaded).

    ``quantization`` ("none", "int8", "int4"; ``options.resolve_quantization``
    turns flags and the environment into one) stores the linear layers and
    the embedding quantized (``loading.quant``)."""
    from pagedlm.options import check_quantization

    check_quantization(quantization)
    folder = resolve(spec)
    tokenizer = load_tokenizer(folder)  # first: it fails in a second where the weights take longer
    if quantization == "none":
        model = load_model(folder, device, dtype)
    else:
        from .quant import load_quantized

        model = load_quantized(folder, quantization, device, dtype)
    return model, tokenizer


def load_tokenizer(folder):
    """The Tokenizer of a resolved model folder; a LoadError if it cannot be read."""
    from pagedlm.tokenizer import Tokenizer

    try:
        return Tokenizer.from_folder(folder)
    except Exception as e:  # the tokenizers library raises a bare Exception for a file it cannot parse
        raise LoadError(f"{folder}: cannot read its tokenizer ({error_detail(e)})") from None
