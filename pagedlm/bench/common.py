"""What the benches share: the model a bench runs (``load_for_bench``: real
weights, or random ones of a config's shape), the engine configurations
they compare (``default_store``, ``paged_configs``, ``fastest_config``),
and transformers' model on the same weights (``hf_model``).

Each bench module imports from here and from no other bench module.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import sys
from pathlib import Path

import torch

from .. import options as opt
from ..loading import load, resolve
from ..loading.hf import read_config
from ..loading.quant import quantize_model
from ..models import build_model
from ..models.layers import FUSED_PROJECTIONS
from ..tokenizer import Tokenizer

# -- the model -------------------------------------------------------------------


class _SyntheticTokenizer:
    """For random weights: fixed pseudo-random prompt ids, no end-of-sequence,
    no text. Speed does not depend on what the tokens say."""

    eos_token_ids: set[int] = set()
    special_token_ids: frozenset[int] = frozenset()

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size

    def encode(self, text: str) -> list[int]:
        g = torch.Generator().manual_seed(0)
        return torch.randint(0, self.vocab_size, (len(text),), generator=g).tolist()

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return ""

    def detokenizer(self, skip_special_tokens: bool = True):
        return self

    def add_token(self, token: int) -> str:
        return ""

    def finalize(self) -> str:
        return ""


def refuse_given(args, engine_options: opt.EngineOptions, bench: str, why: str,
                 flags: tuple[str, ...] = ("gpu_memory_fraction", "gpu_memory_utilization"),
                 paged: bool = False, caching: bool = False) -> None:
    """An `OptionError` for an option a bench sets itself (``why``: how),
    given by flag or environment: ``flags`` (engine options), ``--no-paged-kv``
    (``paged``: the bench pages), ``--[no-]prefix-caching`` (``caching``)."""
    given = [opt.flag_name(name) for name in flags if getattr(engine_options, name, None) is not None]
    if paged and (args.paged_kv is False or opt.env_flag(opt.PAGED_KV_ENV) is False):
        given.append("--no-paged-kv")
    on = args.prefix_caching if args.prefix_caching is not None else opt.env_flag(opt.PREFIX_CACHING_ENV)
    if caching and on is not None:
        given.append("--prefix-caching" if on else "--no-prefix-caching")
    if given:
        raise opt.OptionError(f"bench {bench} {why}: {given[0]} does not apply")


def load_random(folder: str, device: str, dtype: torch.dtype):
    """A model with random weights from a folder's config.json: matrices
    normal(0, 0.02), vectors (norm weights, biases) normal(0, 1) so that a
    greedy trajectory wanders instead of repeating one token. With a
    tokenizer.json beside the config, that tokenizer (a bench whose work
    depends on the vocabulary, grammar masks, needs real tokens); else
    synthetic prompt ids."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise opt.OptionError(f"--random-weights needs a folder with a config.json (got {folder!r})")
    config = read_config(folder)  # (checked as a model's own: a LoadError names what is wrong)
    with torch.device(device):
        model = build_model(config).to(dtype).eval()
    g = torch.Generator(device).manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02 if p.dim() >= 2 else 1.0, generator=g)
    if (Path(folder) / "tokenizer.json").is_file():
        tokenizer = Tokenizer.from_folder(folder)
        if tokenizer.vocab_size > config["vocab_size"]:
            raise opt.OptionError(f"{folder}/tokenizer.json has {tokenizer.vocab_size} tokens, more than "
                                  f"the config's vocab_size ({config['vocab_size']})")
        return model, tokenizer
    return model, _SyntheticTokenizer(config["vocab_size"])


def load_for_bench(args, quantization: str | None = None):
    """``(model, tokenizer, device, dtype, spec)`` for a bench's ``--model``,
    ``--device``, ``--dtype``, ``--random-weights``, ``--tensor-parallel-size`` and ``--quantization``
    (``quantization`` overrides the flag; random weights are quantized after
    they are drawn)."""
    device = opt.resolve_device(args.device)
    dtype = opt.resolve_dtype(args.dtype, device)
    spec = args.model or opt.DEFAULT_MODEL
    if quantization is None:
        quantization = opt.resolve_quantization(getattr(args, "quantization", None))
    parallel = opt.resolve_engine_options({"tensor_parallel_size": getattr(args, "tensor_parallel_size", None),
                                           "distributed_backend": getattr(args, "distributed_backend", None)},
                                          device=device)
    if args.random_weights:
        model, tokenizer = load_random(spec, device, dtype)
        if quantization != "none":
            quantize_model(model, quantization)
        if parallel.tensor_parallel_size > 1:
            from pagedlm.parallel import parallelize

            model = parallelize(model, parallel)
    elif parallel.tensor_parallel_size > 1:
        from pagedlm.parallel import load_parallel

        model, tokenizer = load_parallel(spec, device, dtype, quantization, parallel)
    else:
        model, tokenizer = load(spec, device, dtype, quantization=quantization)
    return model, tokenizer, device, dtype, spec


# -- the engine configurations a bench compares -------------------------------------


def default_store(engine_options: opt.EngineOptions) -> opt.EngineOptions:
    """The default-store row of a bench: no paging (so no paged attention
    backend and no KV quantization), everything else as asked."""
    return dataclasses.replace(engine_options, paged_kv=None, attention_backend="auto", kv_quant="none")


def paged_configs(engine_options: opt.EngineOptions, device: str) -> dict[str, opt.EngineOptions]:
    """The paged configurations a bench compares: on CUDA with the backend
    left to ``auto``, the gather path and the in-place kernels side by side
    ("paged-gather", "paged-fused"); else the one asked for ("paged")."""
    if engine_options.paged_kv is None:
        return {}
    if engine_options.attention_backend == "auto" and device.startswith("cuda"):
        return {"paged-gather": dataclasses.replace(engine_options, attention_backend="torch"),
                "paged-fused": dataclasses.replace(engine_options, attention_backend="triton")}
    return {"paged": engine_options}


def shared_budget(engine_options: opt.EngineOptions, device: str, engines: int) -> opt.EngineOptions:
    """For a bench that keeps ``engines`` engines (transformers' counted as
    one) alive at once on CUDA: each its equal share of the fraction of free
    memory (``--gpu-memory-fraction``, default 0.9) as an explicit KV budget.
    Left to themselves, the first would take 0.9 of the free memory and each
    next one 0.9 of what is left, starving the last of room for its CUDA
    graphs. An explicit --kv-budget-bytes or --gpu-memory-utilization stands."""
    if (not device.startswith("cuda") or engine_options.kv_budget_bytes is not None
            or engine_options.gpu_memory_utilization is not None):
        return engine_options
    fraction = engine_options.gpu_memory_fraction or opt.DEVICE_DEFAULTS["cuda"]["gpu_memory_fraction"]
    free, _ = torch.cuda.mem_get_info(device)
    return dataclasses.replace(engine_options, kv_budget_bytes=int(free * fraction) // engines,
                               gpu_memory_fraction=None)


def fastest_config(engine_options: opt.EngineOptions, device: str) -> opt.EngineOptions:
    """Where a bench's quantized-weights row runs: the fastest store asked
    for (the last of ``paged_configs``, else the default store), with
    unquantized KV, so that it differs from that row by the weights alone."""
    unquantized = dataclasses.replace(engine_options, kv_quant="none")
    return [default_store(engine_options), *paged_configs(unquantized, device).values()][-1]


# -- transformers on the same weights ----------------------------------------------


def unfuse(state: dict[str, torch.Tensor], config: dict) -> dict[str, torch.Tensor]:
    """Our state dict under Hugging Face's names: split the fused q/k/v and
    gate/up projections (``models/layers.py::FUSED_PROJECTIONS``) back apart."""
    heads, kv_heads = config["num_attention_heads"], config.get("num_key_value_heads", config["num_attention_heads"])
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    sizes = {"self_attn.qkv_proj": [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim],
             "mlp.gate_up_proj": [config["intermediate_size"]] * 2}
    out: dict[str, torch.Tensor] = {}
    for key, tensor in state.items():
        for fused, parts in FUSED_PROJECTIONS.items():
            marker = f".{fused}."
            if marker in key:
                prefix, suffix = key.split(marker)
                for part, piece in zip(parts, torch.split(tensor, sizes[fused], dim=0)):
                    out[f"{prefix}.{part}.{suffix}"] = piece.contiguous()
                break
        else:
            out[key] = tensor
    return out


def hf_model(spec: str, random_weights: bool, ours_model, device: str, dtype: torch.dtype):
    """transformers' model on the same weights: the same folder, or for
    ``--random-weights`` the same config with our tensors copied in."""
    from transformers import AutoConfig, AutoModelForCausalLM  # an optional dependency (--against hf)

    if not random_weights:
        return AutoModelForCausalLM.from_pretrained(resolve(spec), dtype=dtype).to(device).eval()
    config_dict = json.loads((Path(spec) / "config.json").read_text())
    config = AutoConfig.from_pretrained(spec)
    with torch.device(device):
        hf = AutoModelForCausalLM.from_config(config, dtype=dtype)
    state = unfuse({k: v for k, v in ours_model.state_dict().items()}, config_dict)
    missing, unexpected = hf.load_state_dict(state, strict=False)
    missing = [m for m in missing if not (m == "lm_head.weight" and config_dict.get("tie_word_embeddings"))]
    if missing or unexpected:
        raise RuntimeError(f"weights do not map onto transformers' model: missing {missing[:4]}, "
                           f"unexpected {unexpected[:4]}")
    if config_dict.get("tie_word_embeddings"):
        hf.tie_weights()
    return hf.eval()


# -- kernel compiles inside a timed run ------------------------------------------------


@contextlib.contextmanager
def kernel_compiles():
    """The Triton kernels compiled (or loaded from triton's disk cache) while
    the block runs, by name: a timed run should compile nothing, and a
    kernel that meets a new specialization mid-run (a pointer 8 bytes off
    its usual 16-byte alignment, a length of 1) costs about a second there.
    Each compile is also written to stderr in full (argument types and
    specializations), so the run says what to warm up. Empty without triton."""
    seen: list[str] = []
    try:
        from triton import knobs
    except ImportError:
        yield seen
        return
    before = knobs.runtime.jit_post_compile_hook

    def hook(*, fn, compile, **_):  # noqa: A002 - triton's keyword
        name = fn.name.rsplit(".", 1)[-1]  # a qualified name: the function's own
        seen.append(name)
        try:  # which specialization: triton's internals, read for the message only
            args = list(compile["signature"])
            aligned = sorted(args[k[0]] for k, a in compile["configs"][0].items() if ["tt.divisibility", 16] in a)
            fixed = {args[k[0]]: v for k, v in compile["constants"].items()
                     if not fn.jit_function.params[k[0]].is_constexpr}
            detail = f"; 16-aligned or divisible by 16: {', '.join(aligned)}; specialized to constants: {fixed}"
        except Exception:  # noqa: BLE001 - another triton's layout: the name alone
            detail = ""
        print(f"bench: a kernel compiled inside a timed run: {name}{detail}", file=sys.stderr)

    knobs.runtime.jit_post_compile_hook = hook
    try:
        yield seen
    finally:
        knobs.runtime.jit_post_compile_hook = before
