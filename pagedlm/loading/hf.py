"""Hugging Face folder -> loaded model: config.json, *.safetensors.

Parameters are created on the meta device and the safetensors tensors are
assigned in place of them (``load_state_dict(assign=True)``), so a load holds
one copy of the weights, not a random init plus the checkpoint.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn
from safetensors.torch import load_file


def read_config(folder: str | Path) -> dict:
    return json.loads((Path(folder) / "config.json").read_text())


def load_weights(folder: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of every *.safetensors shard in the folder (memory-mapped)."""
    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {folder}")
    weights: dict[str, torch.Tensor] = {}
    for f in files:
        weights.update(load_file(f))
    return weights


def load_model(folder: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32) -> nn.Module:
    """Build the model for ``folder``'s config.json and load its weights (strict)."""
    from pagedlm.models import build_model

    config = read_config(folder)
    with torch.device("meta"):  # no memory and no init cost; RoPE tables stay on the CPU
        model = build_model(config)
    weights = model.sanitize(load_weights(folder))
    model.load_state_dict(weights, strict=True, assign=True)
    del weights
    missing = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if missing:
        raise RuntimeError(f"{folder}: no weights loaded for {', '.join(missing[:5])}")
    model.to(device=device, dtype=dtype)
    model.requires_grad_(False)
    return model.eval()
