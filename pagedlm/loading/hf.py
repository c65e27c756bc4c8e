"""Hugging Face folder -> loaded model: config.json, *.safetensors.

Parameters are created on the meta device and the safetensors tensors are
assigned in place of them (``load_state_dict(assign=True)``), so a load holds
one copy of the weights, not a random init plus the checkpoint.

A folder that cannot be loaded (config.json not JSON, a field of the wrong
type, no or unreadable weight files, weights that do not fit the config)
raises ``LoadError``, one line naming the file and what is wrong.
"""

from __future__ import annotations

import json
import types
import typing
from dataclasses import MISSING, fields
from pathlib import Path

import torch
from torch import nn
from safetensors import SafetensorError, safe_open

from .errors import LoadError, error_detail

# Fields that are counts or sizes: a positive int where config.json gives one.
_SIZES = ("hidden_size", "num_hidden_layers", "intermediate_size", "num_attention_heads",
          "num_key_value_heads", "vocab_size", "head_dim", "max_position_embeddings")
# What building or filling a model raises for a config or weights it does not take.
_MODEL_ERRORS = (ValueError, TypeError, KeyError, IndexError, NotImplementedError, RuntimeError)


def read_config(folder: str | Path) -> dict:
    """``folder``'s config.json, checked against its model family (``check_config``)."""
    path = Path(folder) / "config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise LoadError(f"{path}: cannot be read ({e.strerror or e})") from None
    except UnicodeDecodeError as e:
        raise LoadError(f"{path}: not a UTF-8 text file ({error_detail(e)})") from None
    except ValueError as e:
        raise LoadError(f"{path}: not a JSON file ({error_detail(e)})") from None
    check_config(config, path)
    return config


def _fits(value, hint) -> bool:
    """Whether a JSON value is of the type a family's ``args_class`` field declares."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return any(_fits(value, h) for h in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if isinstance(value, bool):
        return hint is bool
    if hint is float:
        return isinstance(value, (int, float))
    if typing.get_origin(hint) is list:
        (item,) = typing.get_args(hint)
        return isinstance(value, list) and all(_fits(v, item) for v in value)
    return isinstance(value, typing.get_origin(hint) or hint)


def _type_name(hint) -> str:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return " or ".join(_type_name(h) for h in typing.get_args(hint))
    if hint is type(None):
        return "null"
    if typing.get_origin(hint) is list:
        return f"a list of {_type_name(typing.get_args(hint)[0])}"
    return {int: "an integer", float: "a number", bool: "true or false", str: "a string",
            dict: "an object"}.get(hint, getattr(hint, "__name__", str(hint)))


def check_config(config, path: Path) -> None:
    """A LoadError unless ``config`` is an object with a supported
    ``model_type``, every field its family's ``args_class`` declares without a
    default, each field it gives of the declared type, and sizes >= 1."""
    from pagedlm.models import FAMILIES

    if not isinstance(config, dict):
        raise LoadError(f"{path}: not a JSON object (a Hugging Face config.json is one)")
    model_type = config.get("model_type")
    family = FAMILIES.get(model_type) if isinstance(model_type, str) else None
    if "model_type" not in config:
        raise LoadError(f"{path}: no model_type (supported: {', '.join(sorted(FAMILIES))})")
    if family is None:
        raise LoadError(f"{path}: model_type {model_type!r} is not supported "
                        f"(supported: {', '.join(sorted(FAMILIES))})")
    hints = typing.get_type_hints(family.args_class)
    for field in fields(family.args_class):
        name, hint = field.name, hints[field.name]
        if name not in config:
            if field.default is MISSING and field.default_factory is MISSING:
                raise LoadError(f"{path}: no {name} (a {model_type} model needs it)")
            continue
        value = config[name]
        if not _fits(value, hint):
            raise LoadError(f"{path}: {name} must be {_type_name(hint)}, not {json.dumps(value)}")
        if name in _SIZES and value is not None and value < 1:
            raise LoadError(f"{path}: {name} must be >= 1, not {value}")


def build_meta(folder: str | Path, config: dict) -> nn.Module:
    """The model for ``folder``'s (checked) config, on the meta device: no
    memory and no init cost; RoPE tables stay on the CPU."""
    from pagedlm.models import build_model

    try:
        with torch.device("meta"):
            return build_model(config)
    except _MODEL_ERRORS as e:
        raise LoadError(f"{Path(folder) / 'config.json'}: cannot build the model ({error_detail(e)})") from None


def weight_files(folder: str | Path) -> list[Path]:
    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise LoadError(f"{folder}: no *.safetensors weight files")
    return files


def open_weights(folder: str | Path) -> list:
    """A ``safe_open`` handle for each weight file of ``folder`` (headers read and checked)."""
    handles = []
    for f in weight_files(folder):
        try:
            handles.append(safe_open(f, "pt"))
        except (SafetensorError, OSError) as e:
            raise LoadError(f"{f}: not a safetensors file pagedlm can read ({error_detail(e)})") from None
    return handles


def load_weights(folder: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of every *.safetensors shard in the folder (memory-mapped)."""
    return {key: h.get_tensor(key) for h in open_weights(folder) for key in h.keys()}


def fill(model: nn.Module, weights: dict[str, torch.Tensor], where: Path | str, strict: bool = True) -> None:
    """``model.load_state_dict(weights, assign=True)``; a LoadError names
    ``where`` if the weights do not fit the model, or leave a tensor unset."""
    try:
        model.load_state_dict(weights, strict=strict, assign=True)
    except _MODEL_ERRORS as e:
        lines = [line.strip() for line in str(e).splitlines() if line.strip()]
        detail = lines[1] if len(lines) > 1 and lines[0].startswith("Error(s) in loading") else error_detail(e)
        raise LoadError(f"{where}: the weights do not fit config.json ({detail})") from None


def check_loaded(model: nn.Module, where: Path | str) -> None:
    missing = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if missing:
        raise LoadError(f"{where}: no weights for {', '.join(missing[:5])}")


def load_model(folder: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32) -> nn.Module:
    """Build the model for ``folder``'s config.json and load its weights (strict)."""
    model = build_meta(folder, read_config(folder))
    try:
        weights = model.sanitize(load_weights(folder))
    except _MODEL_ERRORS as e:
        raise LoadError(f"{folder}: the weights do not fit config.json ({error_detail(e)})") from None
    fill(model, weights, folder)
    del weights
    check_loaded(model, folder)
    model.to(device=device, dtype=dtype)
    model.requires_grad_(False)
    return model.eval()
