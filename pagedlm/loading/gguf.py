"""GGUF file -> Hugging Face-style folder.

Every load goes through the HF-folder path, so a GGUF is converted once:
dequantized to float32 with HF tensor names, plus config.json,
tokenizer.json, tokenizer_config.json and generation_config.json.
llama.cpp's storage quirks are undone here and nowhere else:

- Llama-family q/k rows are permuted for llama.cpp's interleaved RoPE
  (``unpermute_qk``);
- Gemma norm weights are stored as ``w + 1`` (HF stores ``w``);
- Gemma 3's local RoPE base and sliding pattern are not in the file.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import gguf
from gguf import GGMLQuantizationType, GGUFReader
from tokenizers import AddedToken, Tokenizer, decoders, normalizers, pre_tokenizers
from tokenizers.models import BPE
from tqdm import tqdm

SUPPORTED_ARCHS = ("llama", "gemma3")
# llama.cpp token types (llama_token_type)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6


@dataclass
class GgufFile:
    path: Path
    metadata: dict[str, Any]
    tensors: list  # gguf ReaderTensor, data memory-mapped

    @property
    def arch(self) -> str:
        return self.metadata["general.architecture"]

    def key(self, name: str, default: Any = None) -> Any:
        """An architecture-scoped key, e.g. key("block_count") -> "llama.block_count"."""
        return self.metadata.get(f"{self.arch}.{name}", default)


def read_gguf(path: str | Path) -> GgufFile:
    """Parse header, metadata and tensor table (tensor data stays memory-mapped)."""
    reader = GGUFReader(path)
    metadata = {
        name: field.contents() for name, field in reader.fields.items() if not name.startswith("GGUF.")
    }
    return GgufFile(Path(path), metadata, list(reader.tensors))


# ---------------------------------------------------------------- tensors


def dequantize(data: np.ndarray, qtype: GGMLQuantizationType, ggml_shape) -> np.ndarray:
    """Raw GGUF tensor data -> float32 array in torch order.

    ggml lists dimensions fastest-moving first, torch the other way round, so
    a [640, 262144] GGUF embedding becomes [262144, 640]."""
    values = gguf.quants.dequantize(data, qtype)
    shape = tuple(int(d) for d in reversed(list(ggml_shape)))
    return np.ascontiguousarray(values, dtype=np.float32).reshape(shape)


def permute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """HF (rotate-half) q/k rows -> llama.cpp's interleaved-pair order.

    Same as llama.cpp's convert_hf_to_gguf.py ``permute``; kept for the
    round-trip test and for writing GGUFs."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of ``permute_qk``: llama.cpp q/k rows back to HF order."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_TOP_LEVEL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_BLOCK = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLOCK_BY_ARCH = {
    "llama": {"ffn_norm": "post_attention_layernorm"},
    "gemma3": {
        "post_attention_norm": "post_attention_layernorm",
        "ffn_norm": "pre_feedforward_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
    },
}


def hf_tensor_name(name: str, arch: str) -> str:
    """GGUF tensor name -> HF name ("blk.3.attn_q.weight" -> "model.layers.3.self_attn.q_proj.weight")."""
    stem, suffix = name.rsplit(".", 1)
    if stem in _TOP_LEVEL:
        return f"{_TOP_LEVEL[stem]}.{suffix}"
    parts = stem.split(".")
    table = {**_BLOCK, **_BLOCK_BY_ARCH[arch]}
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in table:
        return f"model.layers.{parts[1]}.{table[parts[2]]}.{suffix}"
    raise ValueError(f"GGUF tensor {name!r} has no Hugging Face name for architecture {arch!r}")


def _hf_rows(g: GgufFile, name: str, rows: np.ndarray, config: dict) -> np.ndarray:
    """Rows of GGUF tensor ``name`` (weights, or anything indexed by output row) in HF order."""
    if g.arch == "llama" and (".attn_q." in name or ".attn_k." in name):
        heads = config["num_attention_heads"] if ".attn_q." in name else config["num_key_value_heads"]
        rows = unpermute_qk(rows, heads)
    return np.ascontiguousarray(rows)


def hf_tensor(g: GgufFile, tensor, config: dict) -> tuple[str, np.ndarray]:
    """One GGUF tensor as (HF name, float32 array), llama.cpp storage quirks undone."""
    w = dequantize(tensor.data, tensor.tensor_type, tensor.shape)
    if g.arch == "gemma3" and tensor.name.endswith("norm.weight"):
        w = w - np.float32(1.0)  # llama.cpp stores Gemma's (1 + w); HF stores w
    return hf_tensor_name(tensor.name, g.arch), _hf_rows(g, tensor.name, w, config)


# Types whose every 32-weight block is ``w = q * scale + min``, q in 0..15.
FOUR_BIT_BLOCKS = (GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q4_K)


def four_bit_blocks(data: np.ndarray, qtype: GGMLQuantizationType, ggml_shape) -> dict[str, np.ndarray]:
    """A 4-bit tensor's own numbers, in torch order: ``codes`` uint8 ``[N, K]``
    (0..15), ``scales`` and ``mins`` float32 ``[N, K / 32]``, such that
    ``codes * scale + min`` (in float32) is exactly what ``dequantize`` returns
    (bit for bit, but for Q4_0's ``-0.0`` from a negative ``d``, which comes back ``+0.0``).

    Q4_0: ``d * (q - 8)``; Q4_1: ``d * q + m``; Q4_K: super-blocks of 256
    whose eight 32-blocks have ``scale = d * sc``, ``min = -dmin * m`` (6-bit
    ``sc``, ``m``). Each product is exact in float32, so no value moves."""
    if qtype not in FOUR_BIT_BLOCKS:
        raise ValueError(f"{qtype.name} is not a 4-bit type of 32-weight blocks")
    n, k = (int(d) for d in reversed(list(ggml_shape)))
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    blocks = np.asarray(data).view(np.uint8).reshape(-1, type_size)
    if qtype == GGMLQuantizationType.Q4_K:
        d, dmin = _half(blocks[:, 0:2]), _half(blocks[:, 2:4])
        sc, m = gguf.quants.Q4_K.get_scale_min(blocks[:, 4 : 4 + gguf.quants.Q4_K.K_SCALE_SIZE])
        scales, mins = d * sc.astype(np.float32), -(dmin * m.astype(np.float32))
        qs = blocks[:, 4 + gguf.quants.Q4_K.K_SCALE_SIZE :].reshape(-1, 4, 1, 32)  # 64 weights per 32 bytes
    else:
        scales = _half(blocks[:, 0:2])
        mins = _half(blocks[:, 2:4]) if qtype == GGMLQuantizationType.Q4_1 else np.float32(-8) * scales
        qs = blocks[:, (4 if qtype == GGMLQuantizationType.Q4_1 else 2) :].reshape(-1, 1, 1, 16)
    codes = (qs >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & np.uint8(15)
    return {"codes": codes.reshape(n, k), "scales": scales.reshape(n, k // 32), "mins": mins.reshape(n, k // 32)}


def _half(raw: np.ndarray) -> np.ndarray:
    """Two bytes a block -> the float16 they hold, as float32 ``[blocks, 1]``."""
    return raw.copy().view(np.float16).astype(np.float32)


# Quantized types with more than 4 bits a weight: ``--quantization int4`` keeps them at int8.
WIDER_THAN_4_BITS = tuple(GGMLQuantizationType[n] for n in ("Q5_0", "Q5_1", "Q5_K", "Q6_K", "Q8_0", "Q8_1", "Q8_K"))


class SourceWeights:
    """The GGUF a folder was converted from, as ``loading.quant`` asks it: a
    weight's storage type, and a 4-bit weight's own numbers, by HF name."""

    def __init__(self, path: str | Path, config: dict):
        self.g, self.config = read_gguf(path), config
        self.tensors = {hf_tensor_name(t.name, self.g.arch): t for t in self.g.tensors}

    def qtype(self, name: str) -> GGMLQuantizationType | None:
        tensor = self.tensors.get(name)
        return None if tensor is None else tensor.tensor_type

    def four_bit(self, name: str) -> dict[str, np.ndarray]:
        """``four_bit_blocks`` of weight ``name``, rows in HF order."""
        t = self.tensors[name]
        blocks = four_bit_blocks(t.data, t.tensor_type, t.shape)
        return {part: _hf_rows(self.g, t.name, a, self.config) for part, a in blocks.items()}


# ---------------------------------------------------------------- config


def _f32(x: float) -> float:
    """A float32 metadata value as its shortest decimal (1e-06, not 9.99999997e-07)."""
    return float(str(np.float32(x)))


def hf_config(g: GgufFile) -> dict:
    """config.json for the file, with the keys Hugging Face uses for this model type."""
    if g.arch not in SUPPORTED_ARCHS:
        raise ValueError(f"GGUF architecture {g.arch!r} is not supported (supported: {', '.join(SUPPORTED_ARCHS)})")
    md = g.metadata
    n_head = g.key("attention.head_count")
    n_kv = g.key("attention.head_count_kv", n_head)
    hidden = g.key("embedding_length")
    head_dim = g.key("attention.key_length") or g.key("rope.dimension_count") or hidden // n_head
    names = {t.name for t in g.tensors}
    rope_theta = _f32(g.key("rope.freq_base", 10000.0))
    config = {
        "vocab_size": len(md["tokenizer.ggml.tokens"]),
        "hidden_size": hidden,
        "intermediate_size": g.key("feed_forward_length"),
        "num_hidden_layers": g.key("block_count"),
        "num_attention_heads": n_head,
        "num_key_value_heads": n_kv,
        "head_dim": head_dim,
        "max_position_embeddings": g.key("context_length"),
        "rms_norm_eps": _f32(g.key("attention.layer_norm_rms_epsilon")),
        "rope_theta": rope_theta,
        "rope_scaling": None,
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": "blk.0.attn_q.bias" in names,
        "bos_token_id": md.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": md.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": md.get("tokenizer.ggml.padding_token_id"),
        "torch_dtype": "float32",
    }
    if g.key("rope.scaling.type") not in (None, "none"):
        config["rope_scaling"] = {"rope_type": g.key("rope.scaling.type"), "factor": _f32(g.key("rope.scaling.factor"))}
    if g.arch == "llama":
        if "rope_freqs.weight" in names:
            raise ValueError("Llama 3.1-style rope_freqs scaling is not supported yet")
        config.update(model_type="llama", architectures=["LlamaForCausalLM"], hidden_act="silu", mlp_bias=False)
        config["rope_parameters"] = {"rope_type": "default", "rope_theta": rope_theta, **(config["rope_scaling"] or {})}
    else:
        config.update(_gemma3_config(g, config))
    return config


def _gemma3_config(g: GgufFile, config: dict) -> dict:
    """Gemma 3 facts llama.cpp hard-codes instead of storing (llama-model.cpp, LLM_ARCH_GEMMA3)."""
    n_layer, head_dim = config["num_hidden_layers"], config["head_dim"]
    pattern = g.key("attention.sliding_window_pattern", 6)
    if isinstance(pattern, list):  # newer files: one bool per layer, True = sliding
        sliding = [bool(p) for p in pattern]
    else:  # every pattern-th layer is global
        sliding = [(i + 1) % pattern != 0 for i in range(n_layer)]
    # llama.cpp: 27B (62 layers) scales queries by hidden/heads, every other size by head_dim.
    scalar = config["hidden_size"] // config["num_attention_heads"] if n_layer == 62 else head_dim
    rope_local = 10000.0
    full_rope = {"rope_type": "default", "rope_theta": config["rope_theta"], **(config["rope_scaling"] or {})}
    extra = {
        "model_type": "gemma3_text",
        "architectures": ["Gemma3ForCausalLM"],
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": scalar,
        "sliding_window": g.key("attention.sliding_window"),
        "layer_types": ["sliding_attention" if s else "full_attention" for s in sliding],
        "rope_local_base_freq": rope_local,
        "rope_parameters": {
            "full_attention": full_rope,
            "sliding_attention": {"rope_type": "default", "rope_theta": rope_local},
        },
        "final_logit_softcapping": None,
        "attn_logit_softcapping": None,
    }
    if not isinstance(pattern, list):
        extra["sliding_window_pattern"] = pattern
    return extra


def generation_config(g: GgufFile) -> dict:
    """EOS ids to stop on. Gemma's chat turns end with <end_of_turn>, which HF lists too."""
    tokens = g.metadata["tokenizer.ggml.tokens"]
    eos = [g.metadata["tokenizer.ggml.eos_token_id"]]
    if g.arch == "gemma3" and "<end_of_turn>" in tokens:
        eos.append(tokens.index("<end_of_turn>"))
    out = {"bos_token_id": g.metadata.get("tokenizer.ggml.bos_token_id"), "eos_token_id": eos}
    if (pad := g.metadata.get("tokenizer.ggml.padding_token_id")) is not None:
        out["pad_token_id"] = pad
    return out


# ---------------------------------------------------------------- tokenizer


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table for byte-level BPE vocabularies."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def derive_merges(tokens: list[str], rank: dict[str, float]) -> list[tuple[str, str]]:
    """BPE merges implied by a SentencePiece vocabulary: every split of a token into
    two vocabulary pieces, best-ranked token first, longer left piece first."""
    vocab = {t: i for i, t in enumerate(tokens)}
    found = []
    for token, score in rank.items():
        for i in range(1, len(token)):
            left, right = token[:i], token[i:]
            if left in vocab and right in vocab:
                found.append((score, i, len(token) - i, left, right))
    found.sort(key=lambda m: m[:3], reverse=True)  # stable, like transformers' generate_merges
    return [(m[3], m[4]) for m in found]


def build_tokenizer(g: GgufFile) -> Tokenizer:
    """A `tokenizers` Tokenizer from the GGUF vocabulary (no BOS post-processor:
    BOS is the Tokenizer class's job, from tokenizer_config's add_bos_token)."""
    md = g.metadata
    kind = md["tokenizer.ggml.model"]
    tokens = list(md["tokenizer.ggml.tokens"])
    types = md.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens)
    alphabet = None
    if kind == "llama":  # SentencePiece BPE with byte fallback
        # Gemma stores whitespace-run tokens as real spaces; the model spells them with U+2581.
        tokens = ["\u2581" * len(t) if " " in t and not t.strip() else t for t in tokens]
        if g.arch.startswith("gemma"):  # Gemma's merge order is its vocabulary order
            rank = {t: -i for i, t in enumerate(tokens)}
        else:
            rank = dict(zip(tokens, md["tokenizer.ggml.scores"]))
        vocab = {t: i for i, t in enumerate(tokens)}
        unk = tokens[md.get("tokenizer.ggml.unknown_token_id", 0)]
        tk = Tokenizer(BPE(vocab, derive_merges(tokens, rank), unk_token=unk, fuse_unk=True, byte_fallback=True))
        steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
        if md.get("tokenizer.ggml.add_space_prefix", False):
            tk.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first", split=False)
            steps.append(decoders.Strip(" ", 1, 0))
        else:
            tk.normalizer = normalizers.Replace(" ", "\u2581")
        tk.decoder = decoders.Sequence(steps)
    elif kind == "gpt2":  # byte-level BPE with merges
        spelling = bytes_to_unicode()
        alphabet = set(spelling.values())
        tokens = [t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode()) for t in tokens]
        vocab = {t: i for i, t in enumerate(tokens)}
        merges = [tuple(m.split(" ", 1)) for m in md["tokenizer.ggml.merges"]]
        tk = Tokenizer(BPE(vocab, merges, fuse_unk=False, byte_fallback=False))
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        if md.get("tokenizer.ggml.pre") == "smollm":  # llama.cpp/HF SmolLM: digits split one by one
            tk.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
        else:
            tk.pre_tokenizer = byte_level
        tk.decoder = decoders.ByteLevel()
    else:
        raise ValueError(f"GGUF tokenizer model {kind!r} is not supported (supported: llama, gpt2)")
    # Control tokens stay whole and are special; user-defined ones stay whole but print.
    # Skipped, as transformers does: a byte-level "control" token spelled outside the
    # byte alphabet (a llama.cpp mislabel), and user-defined tokens we had to respell.
    originals = md["tokenizer.ggml.tokens"]
    tk.add_special_tokens([
        AddedToken(t, special=True, normalized=False)
        for t, orig, ty in zip(tokens, originals, types)
        if ty == CONTROL and (alphabet is None or set(orig) <= alphabet)
    ])
    tk.add_tokens([
        AddedToken(t, special=False, normalized=False)
        for t, orig, ty in zip(tokens, originals, types)
        if ty == USER_DEFINED and t == orig
    ])
    return tk


def tokenizer_config(g: GgufFile) -> dict:
    md = g.metadata
    tokens = md["tokenizer.ggml.tokens"]

    def token(key: str) -> str | None:
        i = md.get(f"tokenizer.ggml.{key}")
        return tokens[i] if i is not None else None

    config = {
        "bos_token": token("bos_token_id"),
        "eos_token": token("eos_token_id"),
        "unk_token": token("unknown_token_id"),
        "pad_token": token("padding_token_id"),
        # llama.cpp adds BOS to a SentencePiece vocabulary that does not say otherwise
        "add_bos_token": bool(md.get("tokenizer.ggml.add_bos_token", md["tokenizer.ggml.model"] == "llama")),
        "add_eos_token": bool(md.get("tokenizer.ggml.add_eos_token", False)),
    }
    if "tokenizer.chat_template" in md:
        config["chat_template"] = md["tokenizer.chat_template"]
    return config


# ---------------------------------------------------------------- writing


SHARD_BYTES = 2 << 30  # float32 shards of at most this much (a bigger tensor has one alone)


def write_float32_shards(folder: Path, shapes: dict[str, tuple[int, ...]], arrays) -> None:
    """float32 safetensors files written one tensor at a time: ``arrays``
    yields (name, array) pairs in ``shapes``' order. ``safetensors`` writes
    only from a dict of every tensor (32 GB of float32 for an 8B model), and
    one 32 GB file cannot be memory-mapped privately on a 24 GB machine, so
    the tensors go into shards of ``SHARD_BYTES`` (``model.safetensors`` when
    one is enough, else ``model-00001-of-0000N.safetensors``, ...), each
    written header first (names, shapes, offsets), then data as it comes."""
    shards: list[dict[str, tuple[int, ...]]] = [{}]
    size = 0
    for name, shape in shapes.items():
        nbytes = 4 * int(np.prod(shape, dtype=np.int64))
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards.append({})
            size = 0
        shards[-1][name] = shape
        size += nbytes
    arrays = iter(arrays)
    for i, shard in enumerate(shards):
        name = "model.safetensors" if len(shards) == 1 else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        _write_shard(folder / name, shard, arrays)


def _write_shard(path: Path, shapes: dict[str, tuple[int, ...]], arrays) -> None:
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, shape in shapes.items():
        nbytes = 4 * int(np.prod(shape, dtype=np.int64))
        header[name] = {"dtype": "F32", "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(len(blob).to_bytes(8, "little") + blob)
        for expected, shape in shapes.items():
            name, array = next(arrays)
            if name != expected or array.shape != shape:
                raise ValueError(f"tensor {name} {array.shape} arrived where {expected} {shape} was declared")
            f.write(np.ascontiguousarray(array, dtype=np.float32).data)


def convert(gguf_path: str | Path, out_dir: str | Path) -> None:
    """Write an HF-style folder for ``gguf_path`` into ``out_dir`` (must exist)."""
    out = Path(out_dir)
    print(f"pagedlm: reading {Path(gguf_path).name} (once; the converted folder is cached)", file=sys.stderr)
    g = read_gguf(gguf_path)
    config = hf_config(g)
    shapes = {hf_tensor_name(t.name, g.arch): tuple(int(d) for d in reversed(list(t.shape))) for t in g.tensors}
    tensors = tqdm(g.tensors, desc="dequantizing", unit="tensor", file=sys.stderr)
    write_float32_shards(out, shapes, (hf_tensor(g, t, config) for t in tensors))
    with tqdm(total=1, desc="building tokenizer", file=sys.stderr) as bar:
        build_tokenizer(g).save(str(out / "tokenizer.json"))
        bar.update()
    for name, content in [
        ("config.json", config),
        ("tokenizer_config.json", tokenizer_config(g)),
        ("generation_config.json", generation_config(g)),
    ]:
        (out / name).write_text(json.dumps(content, indent=2, ensure_ascii=False) + "\n")
