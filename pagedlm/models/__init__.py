"""Model families, one file each; ``build_model`` picks one by ``model_type``."""

from __future__ import annotations

import torch.nn as nn

from pagedlm.models import gemma3, llama

FAMILIES = {
    "gemma3_text": gemma3,
    "llama": llama,  # also SmolLM2
    "mistral": llama,
    "qwen2": llama,
    "qwen3": llama,
}


def build_model(config: dict) -> nn.Module:
    """An un-loaded model for a Hugging Face config.json dict.

    Weights are random; load them with ``model.load_state_dict(model.sanitize(w))``.
    """
    model_type = config.get("model_type")
    family = FAMILIES.get(model_type)
    if family is None:
        supported = ", ".join(sorted(FAMILIES))
        raise ValueError(f"unsupported model_type {model_type!r} (supported: {supported})")
    return family.Model(family.ModelArgs.from_dict(config))
