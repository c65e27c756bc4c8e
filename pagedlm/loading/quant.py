"""Quantized weights: converted once into the cache, loaded layer by layer.

A model folder's float weights are quantized once (``kernels.quant``) into
``$PAGEDLM_CACHE_DIR/quantized/<key>/<mode>-g<group>-v<version>.safetensors``
(``key``: a hash of the folder's path and its weight files' names, sizes and
mtimes). The conversion reads one layer's tensors at a time and the load one
module's, so neither ever holds the float model: an 8B Q4 GGUF, whose float32
shards take 30 GB of disk, loads in 8 GB of memory (``benchmarks/RESULTS.md``).

Which weights are quantized is the model's business, not this file's: every
``models.layers.Linear`` and ``Embedding`` (so the tied output head too);
norms and biases stay float.

What each mode stores, by where a weight comes from (``_stored``):

- ``int8``: every weight int8 per output channel (``kernels.quant.quantize``).
- ``int4``, from a float folder (safetensors, or a GGUF's F32/F16/BF16
  tensors): int4 in groups of 32, min/max of each group.
- ``int4``, from a GGUF's Q4_0 / Q4_1 / Q4_K tensor: that tensor's own
  codes, scales and mins, so the stored weight is the file's bit for bit.
  Re-deriving them from min/max of the floats misaligns the grid wherever
  a block does not use both codes 0 and 15 (Q4_K's fitted scales often
  do not): +2% perplexity on Gemma 3 270M, against +0.03% for the file's own.
- ``int4``, from a GGUF tensor stored in more bits (Q5_*, Q6_K, Q8_*): int8,
  as llama.cpp runs such a tensor in its own type. Pushed to int4 they cost
  Gemma 3 270M +23% (its Q5_0/Q6_K/Q8_0 linears) and +8.5% (its Q8_0
  embedding, the tied head).
- Fused q/k/v and gate/up take the int4 form only if every part does, and
  int8 if any part is wider than 4 bits.
- Other GGUF types (fewer bits, non-linear grids) go as from a float folder.

The file is a safetensors file in which every tensor's data starts at a
multiple of ``kernels.quant.ALIGN`` (64) bytes from the file's start
(``save_aligned``); safetensors maps the file from its first byte, so the
loaded views start aligned too, whatever the header holds (its metadata
names the source folder, so its length varies with a path's).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
from safetensors import safe_open

from pagedlm.kernels.quant import ALIGN, GROUP_SIZE, QuantizedWeight, int4_fits, pack_int4, quantize
from pagedlm.options import cache_dir

from .catalog import converted_from
from .errors import LoadError
from .hf import build_meta, check_loaded, fill, open_weights, read_config, weight_files

QUANT_VERSION = 3  # bump when the stored format or its derivation changes, so stale files are redone
_PARTS = ("qweight", "scales", "mins")
PAD = "__pad__."  # name prefix of the filler tensors between aligned tensors (``save_aligned``)
_SAFETENSORS_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
                       torch.int8: "I8", torch.uint8: "U8", torch.int16: "I16", torch.int32: "I32",
                       torch.int64: "I64", torch.bool: "BOOL"}


def quantizable(model: nn.Module) -> dict[str, nn.Module]:
    """Module name -> module, for every layer whose weight is quantized."""
    from pagedlm.models.layers import Embedding, Linear

    return {name: m for name, m in model.named_modules() if isinstance(m, (Linear, Embedding))}


def quantized_path(folder: str | Path, mode: str) -> Path:
    """Where ``folder``'s ``mode`` weights are (or will be) cached."""
    folder = Path(folder).resolve()
    digest = hashlib.sha256(str(folder).encode())
    for f in [folder / "config.json", *weight_files(folder)]:
        st = f.stat()
        digest.update(f"|{f.name}|{st.st_size}|{st.st_mtime_ns}".encode())
    return cache_dir() / "quantized" / digest.hexdigest()[:16] / f"{mode}-g{GROUP_SIZE}-v{QUANT_VERSION}.safetensors"


def _layer_of(name: str) -> str:
    """Group key: ``model.layers.7.`` for a block's tensors, "" for the rest."""
    parts = name.split(".")
    if len(parts) > 3 and parts[1] == "layers":
        return ".".join(parts[:3]) + "."
    return ""


def _source(folder: Path):
    """The GGUF ``folder`` was converted from (``gguf.SourceWeights``), None for a float folder."""
    path = converted_from(folder)
    if path is None:
        return None
    if not path.is_file():
        raise LoadError(f"{folder} was converted from {path}, which is gone: int4 reads that file's "
                                "4-bit blocks (reinstall it, or load the .gguf again)")
    from .gguf import SourceWeights

    return SourceWeights(path, read_config(folder))


def _stored(key: str, w: torch.Tensor, mode: str, source) -> dict[str, torch.Tensor]:
    """The stored tensors of weight ``key`` (float ``w``) in ``mode``; see the module doc."""
    if mode != "int4" or source is None:
        return quantize(w, mode)
    from pagedlm.models.layers import projection_parts

    from .gguf import FOUR_BIT_BLOCKS, WIDER_THAN_4_BITS

    parts = projection_parts(key)
    types = [source.qtype(part) for part in parts]
    if all(t in FOUR_BIT_BLOCKS for t in types) and int4_fits(tuple(w.shape)):
        blocks = [source.four_bit(part) for part in parts]
        return pack_int4(*(torch.from_numpy(np.concatenate([b[name] for b in blocks]))
                           for name in ("codes", "scales", "mins")))
    return quantize(w, "int8" if any(t in WIDER_THAN_4_BITS for t in types) else "int4")


def save_aligned(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str]) -> None:
    """A safetensors file of ``tensors`` in which each one's data starts at a
    multiple of ``ALIGN`` bytes from the file's start. The format stores the
    tensors back to back (a gap is an invalid offset), so uint8 ``PAD``
    tensors fill the space before each one, and the header is padded with
    spaces (as the format allows) so that the data starts aligned too."""
    header: dict = {"__metadata__": metadata}
    chunks: list[torch.Tensor] = []
    offset = 0
    for name, t in tensors.items():
        if offset % ALIGN:
            gap = -offset % ALIGN
            header[f"{PAD}{len(header)}"] = {"dtype": "U8", "shape": [gap], "data_offsets": [offset, offset + gap]}
            chunks.append(torch.zeros(gap, dtype=torch.uint8))
            offset += gap
        data = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
        header[name] = {"dtype": _SAFETENSORS_DTYPES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + data.numel()]}
        chunks.append(data)
        offset += data.numel()
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-(8 + len(blob)) % ALIGN)
    with open(path, "wb") as f:
        f.write(len(blob).to_bytes(8, "little") + blob)
        for data in chunks:
            f.write(data.numpy().data)


def convert(folder: str | Path, mode: str, out: Path) -> None:
    """Quantize ``folder``'s weights into the safetensors file ``out``, one
    layer's float tensors in memory at a time."""
    source = _source(Path(folder)) if mode == "int4" else None
    model = build_meta(folder, read_config(folder))
    targets = {f"{name}.weight" for name in quantizable(model)}
    handles = open_weights(folder)
    where = {key: h for h in handles for key in h.keys()}
    groups: dict[str, list[str]] = {}
    for key in where:
        groups.setdefault(_layer_of(key), []).append(key)
    print(f"pagedlm: quantizing {Path(folder).name} to {mode} (once; the result is cached)", file=sys.stderr)
    stored: dict[str, torch.Tensor] = {}
    for group in groups.values():
        weights = model.sanitize({key: where[key].get_tensor(key) for key in group})
        for key, w in weights.items():
            if key in targets:
                stem = key.removesuffix("weight")
                stored.update({stem + part: t.contiguous() for part, t in _stored(key, w, mode, source).items()})
            else:
                stored[key] = w.contiguous()
        del weights
    tmp = out.with_suffix(f".{os.getpid()}.tmp")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        save_aligned(stored, tmp, metadata={"format": "pt", "quantization": mode, "group_size": str(GROUP_SIZE),
                                            "source": str(Path(folder).resolve())})
        os.replace(tmp, out)  # atomic: a file under its final name is complete
    except OSError as e:
        raise LoadError(f"cannot write the quantized weights' cache {out.parent}: {e.strerror or e} "
                        "(set PAGEDLM_CACHE_DIR to a writable folder)") from None
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)


def load_quantized(folder: str | Path, mode: str, device: str | torch.device, dtype: torch.dtype) -> nn.Module:
    """The model for ``folder`` with its Linear / Embedding weights in ``mode``,
    converting them into the cache first if needed."""
    path = quantized_path(folder, mode)
    if not path.is_file():
        convert(folder, mode, path)
    model = build_meta(folder, read_config(folder))
    layers = quantizable(model)
    tied = model.args.tie_word_embeddings
    with safe_open(path, "pt") as f:
        keys = {k for k in f.keys() if not k.startswith(PAD)}
        quantized = {k for k in keys if k.rsplit(".", 1)[0] in layers and k.rsplit(".", 1)[1] in _PARTS}
        fill(model, {k: f.get_tensor(k) for k in keys - quantized}, path, strict=False)
        for name, module in layers.items():
            tensors = {p: f.get_tensor(f"{name}.{p}") for p in _PARTS if f"{name}.{p}" in keys}
            set_stored(module, name, tensors, tied, device, dtype, folder)
    check_loaded(model, path)
    model.to(device=device, dtype=dtype)  # norms and biases; quantized buffers stay as built
    model.requires_grad_(False)
    return model.eval()


def set_stored(module: nn.Module, name: str, tensors: dict[str, torch.Tensor], tied: bool,
               device: str | torch.device, dtype: torch.dtype, where: str | Path) -> None:
    """Give ``module`` (a ``quantizable`` layer named ``name``) its stored
    tensors (``qweight``, ``scales``, ``mins``) as a ``QuantizedWeight``; a
    LoadError names ``where`` for tensors that are missing or do not fit."""
    from pagedlm.models.layers import Embedding

    if "qweight" not in tensors:
        raise LoadError(f"{where}: no quantized weight for {name}")
    is_embedding = isinstance(module, Embedding)
    try:
        quant = QuantizedWeight.from_stored(tensors, tuple(module.weight.shape), device,
                                            rows=is_embedding, linear=not is_embedding or tied)
    except ValueError as e:
        raise LoadError(f"{where}: the weights do not fit config.json ({name}: {e})") from None
    module.set_quantized(quant, dtype)


def weight_bytes(model: nn.Module) -> int:
    """Bytes of parameters and buffers the model holds (quantized or not)."""
    return sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])


def quantize_model(model: nn.Module, mode: str) -> nn.Module:
    """Quantize a loaded float model in place (random-weight benches, tests);
    real models are converted once through the cache by ``load_quantized``."""
    from pagedlm.models.layers import Embedding

    tied = model.args.tie_word_embeddings
    for module in quantizable(model).values():
        w = module.weight.detach()
        is_embedding = isinstance(module, Embedding)
        quant = QuantizedWeight.from_stored(quantize(w, mode), tuple(w.shape), w.device, rows=is_embedding,
                                            linear=not is_embedding or tied)  # on w's device: fast on a GPU
        module.set_quantized(quant, w.dtype)
    return model
