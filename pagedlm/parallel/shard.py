"""One rank's shard of a model: built at its local sizes, filled with only its slices.

``build_shard`` makes the family's own model (``models.build_model``) from
the config with this rank's head counts and intermediate size, so every
family shards without a copy of its code, then puts the three parallel
layers in place: ``o_proj`` and ``down_proj`` become ``RowParallelLinear``,
the embedding a ``VocabParallelEmbedding``, an untied ``lm_head`` this
rank's rows of the vocabulary. ``slicing`` says, per tensor, which rows or
columns of the full (fused) tensor the rank keeps; a ``Source`` reads just
those:

- ``FolderSource``: a Hugging Face folder (or a converted GGUF) through
  safetensors' ``get_slice``, q/k/v and gate/up read from their own tensors
  (each rank reads only its slices from the memory-mapped files);
- ``QuantizedSource``: the quantized cache file (``loading.quant``), whose
  stored codes and scales are cut along the same axes (int4 codes two to a
  byte, scales one per group of 32);
- ``TensorSource``: a model already in memory (``LLM(model=<module>)``),
  float weights only.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Protocol

import torch
import torch.nn as nn
from safetensors import safe_open

from pagedlm.kernels.quant import GROUP_SIZE
from pagedlm.loading.errors import LoadError
from pagedlm.loading.hf import check_loaded, fill, open_weights, read_config
from pagedlm.loading.quant import PAD, convert, quantizable, quantized_path, set_stored
from pagedlm.models import build_model
from pagedlm.models.base import Attention, Decoder, DecoderLM
from pagedlm.models.layers import GatedMLP, Linear, projection_parts

from .layers import Comm, RowParallelLinear, VocabParallelEmbedding
from .partition import Partition

Ranges = tuple[tuple[int, int], ...]


@dataclasses.dataclass(frozen=True)
class Slicing:
    """Which part of a full tensor a rank keeps: the ``rows`` ranges (concatenated,
    in order), or the ``cols`` range of a 2-D tensor, or all of it (neither)."""

    rows: Ranges | None = None
    cols: tuple[int, int] | None = None


WHOLE = Slicing()


def model_config(model: DecoderLM) -> dict:
    """A config.json dict that builds ``model``'s family at its sizes."""
    return dataclasses.asdict(model.args)


def local_config(config: dict, part: Partition) -> dict:
    """``config`` at one rank's sizes (head_dim spelled out: it no longer follows from them)."""
    args = build_args(config)
    return {**config, "num_attention_heads": part.num_heads, "num_key_value_heads": part.num_kv_heads,
            "intermediate_size": part.intermediate[1] - part.intermediate[0], "head_dim": args.head_dim}


def build_args(config: dict):
    from pagedlm.models import FAMILIES

    return FAMILIES[config["model_type"]].args_class.from_dict(config)


def build_shard(config: dict, part: Partition, comm: Comm | None) -> DecoderLM:
    """Rank ``part.rank``'s model on the meta device, its parallel layers in place."""
    with torch.device("meta"):
        model = build_model(local_config(config, part))
        hidden = model.args.hidden_size
        for m in list(model.modules()):
            if isinstance(m, Attention):
                o = m.o_proj
                m.o_proj = RowParallelLinear(o.in_features, o.out_features, o.bias is not None and part.rank == 0, comm)
            elif isinstance(m, GatedMLP):
                d = m.down_proj
                m.down_proj = RowParallelLinear(d.in_features, d.out_features, d.bias is not None and part.rank == 0,
                                                comm)
            elif isinstance(m, Decoder):
                a, b = part.vocab
                m.embed_tokens = VocabParallelEmbedding(b - a, hidden, a, comm)
        if hasattr(model, "lm_head"):
            model.lm_head = Linear(hidden, part.vocab[1] - part.vocab[0])
    return model


def slicing(model: DecoderLM, part: Partition, full_args) -> dict[str, Slicing]:
    """Tensor name -> what of the full tensor rank ``part.rank`` keeps, for
    every parameter of its shard ``model`` (``WHOLE`` for the rest)."""
    D, H, KV, inter = full_args.head_dim, full_args.num_attention_heads, full_args.num_key_value_heads, \
        full_args.intermediate_size
    (h0, h1), (k0, k1), (i0, i1) = part.heads, part.kv_heads, part.intermediate
    out: dict[str, Slicing] = {}
    for name, m in model.named_modules():
        p = f"{name}." if name else ""
        if isinstance(m, Attention):
            qkv = Slicing(rows=((h0 * D, h1 * D), ((H + k0) * D, (H + k1) * D), ((H + KV + k0) * D, (H + KV + k1) * D)))
            out.update({f"{p}qkv_proj.weight": qkv, f"{p}qkv_proj.bias": qkv,
                        f"{p}o_proj.weight": Slicing(cols=(h0 * D, h1 * D))})
        elif isinstance(m, GatedMLP):
            gate_up = Slicing(rows=((i0, i1), (inter + i0, inter + i1)))
            out.update({f"{p}gate_up_proj.weight": gate_up, f"{p}gate_up_proj.bias": gate_up,
                        f"{p}down_proj.weight": Slicing(cols=(i0, i1))})
        elif isinstance(m, (VocabParallelEmbedding, Linear)) and name.endswith(("embed_tokens", "lm_head")):
            out[f"{p}weight"] = Slicing(rows=(part.vocab,))
    return out


class Source(Protocol):
    def read(self, name: str, how: Slicing) -> torch.Tensor:
        """The part ``how`` of the full model's tensor ``name``."""


def _cut(t: torch.Tensor, how: Slicing) -> torch.Tensor:
    """``how`` of an in-memory (or memory-mapped) tensor, as its own contiguous copy."""
    if how.rows is not None:
        return torch.cat([t[a:b] for a, b in how.rows]).contiguous()
    if how.cols is not None:
        return t[:, how.cols[0] : how.cols[1]].contiguous()
    return t.clone()


class TensorSource:
    """A float model's own tensors (its ``state_dict``)."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors

    def read(self, name: str, how: Slicing) -> torch.Tensor:
        return _cut(self.tensors[name], how)


class FolderSource:
    """A folder's safetensors files, read by slices; a fused tensor's rows
    come from its parts (``projection_parts``: q/k/v, gate/up) in order."""

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)
        self.where = {key: h for h in open_weights(folder) for key in h.keys()}

    def read(self, name: str, how: Slicing) -> torch.Tensor:
        parts = projection_parts(name)
        if how.cols is not None:
            a, b = how.cols
            return self.where[name].get_slice(name)[:, a:b].contiguous()
        slices = [self.where[p].get_slice(p) for p in parts]
        if how.rows is None:
            return torch.cat([s[:] for s in slices]).contiguous()
        out, offsets, at = [], [], 0
        for s in slices:
            offsets.append(at)
            at += s.get_shape()[0]
        for a, b in how.rows:
            for s, start in zip(slices, offsets):
                lo, hi = max(a, start), min(b, start + s.get_shape()[0])
                if lo < hi:
                    out.append(s[lo - start : hi - start])
        return torch.cat(out).contiguous()


class QuantizedSource:
    """The quantized cache file of a folder (made first if missing): fused
    names; a quantized layer's ``qweight`` / ``scales`` / ``mins`` cut along
    its weight's axes."""

    def __init__(self, folder: str | Path, mode: str) -> None:
        path = quantized_path(folder, mode)
        if not path.is_file():
            convert(folder, mode, path)
        self.path = path
        self.file = safe_open(path, "pt")
        self.keys = {k for k in self.file.keys() if not k.startswith(PAD)}

    def read(self, name: str, how: Slicing) -> torch.Tensor:
        return _cut_slice(self.file.get_slice(name), how)

    def stored(self, module: str, how: Slicing) -> dict[str, torch.Tensor]:
        """A quantized layer's stored tensors, cut as ``how`` cuts its ``[N, K]`` weight."""
        int4 = f"{module}.mins" in self.keys
        out = {}
        for part in ("qweight", "scales", "mins"):
            key = f"{module}.{part}"
            if key not in self.keys:
                continue
            cut = how
            if how.cols is not None:
                a, b = how.cols
                if part == "qweight":
                    cut = Slicing(cols=(a // 2, b // 2)) if int4 else how
                else:  # int8: one scale per row, whole; int4: one per group of K
                    cut = Slicing(cols=(a // GROUP_SIZE, b // GROUP_SIZE)) if int4 else WHOLE
            out[part] = _cut_slice(self.file.get_slice(key), cut)
        return out


def _cut_slice(s, how: Slicing) -> torch.Tensor:
    if how.rows is not None:
        return torch.cat([s[a:b] for a, b in how.rows]).contiguous()
    if how.cols is not None:
        return s[:, how.cols[0] : how.cols[1]].contiguous()
    return s[:]


def load_shard(config: dict, part: Partition, comm: Comm | None, source: Source, device: torch.device,
               dtype: torch.dtype, where: str) -> DecoderLM:
    """Rank ``part.rank``'s shard, filled from ``source``, on ``device`` in ``dtype``."""
    full_args = build_args(config)
    model = build_shard(config, part, comm)
    how = slicing(model, part, full_args)
    quantized = quantizable(model) if isinstance(source, QuantizedSource) else {}
    skip = {f"{name}.weight" for name in quantized}
    tensors = {name: source.read(name, how.get(name, WHOLE))
               for name, _ in [*model.named_parameters(), *model.named_buffers()] if name not in skip}
    fill(model, tensors, where, strict=not quantized)
    del tensors
    tied = full_args.tie_word_embeddings
    for name, module in quantized.items():
        set_stored(module, name, source.stored(name, how.get(f"{name}.weight", WHOLE)), tied, device, dtype, where)
    check_loaded(model, where)
    model.to(device=device, dtype=dtype)
    model.requires_grad_(False)
    return model.eval()


def source_for(spec: object, quantization: str) -> tuple[dict, Source, str]:
    """(config, source, name for errors) of a folder path, or of a model's
    tensors (``("tensors", config, state_dict)``)."""
    if isinstance(spec, tuple):
        _, config, state = spec
        return config, TensorSource(state), "the model's tensors"
    folder = Path(spec)
    config = read_config(folder)
    if quantization == "none":
        return config, FolderSource(folder), str(folder)
    return config, QuantizedSource(folder, quantization), str(folder)


def check_float(model: nn.Module) -> None:
    """A LoadError for a loaded model with quantized layers: its int4 kernel
    layout cannot be cut; load it by name to shard its stored weights."""
    if any(getattr(m, "quant", None) is not None for m in model.modules()):
        raise LoadError("a quantized model in memory cannot be split across ranks: give its name or folder "
                        "(with quantization=) and each rank loads its own slices")
