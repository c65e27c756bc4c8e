"""Hugging Face folder -> loaded model: config.json, *.safetensors.

Parameters are created on the meta device and the safetensors tensors are
assigned in place of them (``load_state_dict(assign=True)``), so a load holds
one copy of the weights, not a random init plus the checkpoint.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Iterator

import torch
import torch.nn as nn
from safetensors.torch import load_file


def read_config(folder: str | Path) -> dict:
    return json.loads((Path(folder) / "config.json").read_text())


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Every nn.Parameter registered inside lands on the meta device (no memory,
    no init cost). Unlike ``with torch.device("meta")`` this leaves plain tensors
    a model computes in ``__init__`` (RoPE frequencies) real."""
    original = nn.Module.register_parameter

    def register(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        original(module, name, param)

    def skip_on_meta(init_fn):
        # Random init of a meta tensor does nothing, yet its first call imports
        # torch's reference ops (seconds); skip it.
        return lambda tensor, *a, **k: tensor if tensor.is_meta else init_fn(tensor, *a, **k)

    inits = {name: getattr(nn.init, name) for name in _INIT_FUNCTIONS}
    nn.Module.register_parameter = register
    for name, fn in inits.items():
        setattr(nn.init, name, skip_on_meta(fn))
    try:
        yield
    finally:
        nn.Module.register_parameter = original
        for name, fn in inits.items():
            setattr(nn.init, name, fn)


_INIT_FUNCTIONS = (
    "uniform_", "normal_", "trunc_normal_", "constant_", "ones_", "zeros_",
    "kaiming_uniform_", "kaiming_normal_", "xavier_uniform_", "xavier_normal_",
)


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
    with parameters_on_meta():
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
