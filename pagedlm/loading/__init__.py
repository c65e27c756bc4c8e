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
):
    """(model, Tokenizer) for ``spec``; raises ModelNotFound with a one-line fix."""
    from pagedlm.tokenizer import Tokenizer

    folder = resolve(spec)
    return load_model(folder, device, dtype), Tokenizer.from_folder(folder)
