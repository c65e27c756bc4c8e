"""Options, flag/environment resolution and startup refusals: the one place for them.

Every flag the CLI and the server accept is resolved here, every value the
engine cannot use raises `OptionError`, and every combination the engine
cannot honour is refused by `check_refusals` with `UnsupportedOption`: a
one-line reason, a non-zero exit, never a silent downgrade. `docs/cli.md`
mirrors `REFUSALS` row for row.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
from pathlib import Path
import re
import shutil
from dataclasses import dataclass, field
from typing import Callable, Mapping

import torch


DEFAULT_MODEL = "gemma3-270m"
DEFAULT_BLOCK_SIZE = 16  # vLLM's: a row wastes under 16 tokens (99% of KV bytes live on the 256-prompt workload)
# Paged KV kernels index blocks by shifts and tile them: powers of two only, and
# bounded, because a request's pool holds at least one block per paged layer.
MIN_BLOCK_SIZE, MAX_BLOCK_SIZE = 8, 1024
PAGED_KV_ENV = "PAGEDLM_PAGED_KV"
PREFIX_CACHING_ENV = "PAGEDLM_PREFIX_CACHING"
PAGED_FLAGS = ("paged_kv", "paged_kv_block_size", "prefix_caching")  # resolved by resolve_paged_kv
QUANTIZATION_ENV = "PAGEDLM_QUANTIZATION"
# "0": the CPU's int8 / int4 products stay torch's kernels and layouts instead of the
# integer kernel built at first use (kernels.cpu_quant): an escape hatch, and main's
# path for same-process comparisons (benchmarks/cpu_quant_ab.py).
CPU_QUANT_KERNEL_ENV = "PAGEDLM_CPU_QUANT"
QUANTIZATIONS = ("none", "int8", "int4")  # weight-only formats (kernels.quant)
KV_QUANT_MODES = ("none", "int8", "fp8")  # KV block formats (cache.kv_quant)
DEFAULT_QUANTIZATION = "none"
# Attention over the paged pools: "torch" gathers a row's blocks and calls
# SDPA (any device); "triton" reads the blocks in place (kernels.paged_attention)
# and pages sliding-window layers too, so that the decode step can run as a
# CUDA graph; "auto" is triton on CUDA when triton imports, else torch.
ATTENTION_BACKENDS = ("auto", "torch", "triton")
KV_QUANT_ENV = "PAGEDLM_KV_QUANT"
DISTRIBUTED_BACKENDS = ("gloo", "nccl")  # torch.distributed backends of tensor parallelism
SPECULATIVE_METHODS = ("ngram", "draft")  # pagedlm.speculative's proposers
DEFAULT_NUM_SPECULATIVE_TOKENS, DEFAULT_NGRAM_MIN, DEFAULT_NGRAM_MAX = 4, 1, 4


class OptionError(ValueError):
    """A flag, environment or request value the engine cannot use."""


class UnsupportedOption(OptionError):
    """A combination of options that is refused at startup."""


class RequestTooLarge(OptionError):
    """A request that could never fit the KV budget, refused when it is added."""


@dataclass(frozen=True)
class PagedKvOptions:
    """Turns on the paged KV cache for full-attention layers."""

    block_size: int = DEFAULT_BLOCK_SIZE
    prefix_caching: bool = True  # share the blocks of common prefixes (copy-on-write)


# ---------------------------------------------------------------------------
# Parsing helpers shared by the CLI, the environment and the server.


def flag_name(name: str) -> str:
    """The command-line spelling of an option: max_num_seqs -> --max-num-seqs."""
    return "--" + name.replace("_", "-")


def positive_int(text: str | int, name: str) -> int:
    try:
        value = int(text)
    except (TypeError, ValueError):
        raise OptionError(f"{name} must be a positive integer (got {text!r})") from None
    if value <= 0 or str(value) != str(text).strip().lstrip("+"):
        raise OptionError(f"{name} must be a positive integer (got {text!r})")
    return value


SWITCH_ON, SWITCH_OFF = ("1", "true", "on", "yes"), ("0", "false", "off", "no")  # any case


def env_flag(name: str, environ: Mapping[str, str] | None = None) -> bool | None:
    """An explicit environment switch (`SWITCH_ON` / `SWITCH_OFF`); None when unset."""
    raw = (os.environ if environ is None else environ).get(name)
    if raw is None or raw == "":
        return None
    low = raw.strip().lower()
    if low in SWITCH_ON:
        return True
    if low in SWITCH_OFF:
        return False
    spellings = ", ".join(x for pair in zip(SWITCH_ON, SWITCH_OFF) for x in pair)
    raise OptionError(f"{name} must be one of {spellings} (got {raw!r})")


# torch.Generator.manual_seed's range, and the server's `seed` field's.
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1


def check_seed(seed: object, name: str = "seed") -> int | None:
    """None, or an integer torch.Generator.manual_seed accepts; else `OptionError`."""
    if seed is None:
        return None
    if isinstance(seed, bool) or not isinstance(seed, int) or not SEED_MIN <= seed <= SEED_MAX:
        raise OptionError(f"{name} must be an integer from -2**63 to 2**64 - 1 (got {seed!r})")
    return seed


def resolve_paged_kv(
    flag: bool | None,
    block_size: int | str | None,
    environ: Mapping[str, str] | None = None,
    prefix_caching: bool | None = None,
    device: str | None = None,
) -> PagedKvOptions | None:
    """Explicit CLI flag > explicit PAGEDLM_PAGED_KV (PAGEDLM_PREFIX_CACHING)
    > the device's default: paging on CUDA (where the kernels read the pools
    in place and the decode step replays as a CUDA graph), off elsewhere
    (the CPU's row caches are as fast and need no block tables); prefix
    caching on with paging."""
    env = os.environ if environ is None else environ
    on = flag if flag is not None else env_flag(PAGED_KV_ENV, env)
    if on is None:
        on = device is not None and device.startswith("cuda")
    set_by = {}
    if prefix_caching is None:
        prefix_caching = env_flag(PREFIX_CACHING_ENV, env)
        if prefix_caching is not None:
            set_by["prefix_caching"] = f"{PREFIX_CACHING_ENV}={env[PREFIX_CACHING_ENV]}"
    if block_size is not None:
        block_size = check_block_size(positive_int(block_size, "--paged-kv-block-size"))
    check_refusals({"paged_kv": bool(on), "paged_kv_block_size": block_size, "prefix_caching": prefix_caching},
                   set_by)
    if not on:
        return None
    return PagedKvOptions(block_size=block_size or DEFAULT_BLOCK_SIZE, prefix_caching=prefix_caching is not False)


def check_block_size(block_size: int) -> int:
    """A power of two in [MIN_BLOCK_SIZE, MAX_BLOCK_SIZE], else `OptionError`."""
    if not (MIN_BLOCK_SIZE <= block_size <= MAX_BLOCK_SIZE and block_size & (block_size - 1) == 0):
        raise OptionError(f"--paged-kv-block-size must be a power of two from {MIN_BLOCK_SIZE} "
                          f"to {MAX_BLOCK_SIZE} (got {block_size})")
    return block_size


def check_quantization(mode: object, name: str = "--quantization") -> str:
    mode = mode.strip().lower() if isinstance(mode, str) else mode
    if mode not in QUANTIZATIONS:
        raise OptionError(f"{name} must be {', '.join(QUANTIZATIONS)} (got {mode!r})")
    return mode


def check_kv_quant(mode: object, name: str = "--kv-quant") -> str:
    mode = mode.strip().lower() if isinstance(mode, str) else mode
    if mode not in KV_QUANT_MODES:
        raise OptionError(f"{name} must be {', '.join(KV_QUANT_MODES)} (got {mode!r})")
    return mode


def resolve_quantization(flag: str | None, environ: Mapping[str, str] | None = None) -> str:
    """Explicit --quantization > explicit PAGEDLM_QUANTIZATION > default ("none").
    Checks the CPU kernel's switch (`CPU_QUANT_KERNEL_ENV`) too: read while
    the weights load, a bad value would read as the weights' error."""
    env_flag(CPU_QUANT_KERNEL_ENV, environ)
    if flag is not None:
        return check_quantization(flag)
    raw = (os.environ if environ is None else environ).get(QUANTIZATION_ENV)
    if raw:
        return check_quantization(raw, QUANTIZATION_ENV)
    return DEFAULT_QUANTIZATION


def resolve_device(device: str | None) -> str:
    if device in (None, "", "auto"):
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device not in ("cpu", "cuda") and not device.startswith("cuda:"):
        raise OptionError(f"--device must be auto, cpu or cuda (got {device!r})")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise OptionError("--device cuda was asked for but CUDA is not available")
    return device


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_DTYPE_ALIASES = {"float": "float32", "half": "float16"}  # vLLM's spellings


def resolve_dtype(dtype: str | torch.dtype | None, device: str) -> torch.dtype:
    """float32 on the CPU, bfloat16 on CUDA, unless asked otherwise (a name,
    vLLM's ``half`` and ``float`` too, or a torch dtype)."""
    if dtype in (None, "", "auto"):
        return torch.float32 if device == "cpu" else torch.bfloat16
    if isinstance(dtype, torch.dtype) and dtype in _DTYPES.values():
        return dtype
    name = _DTYPE_ALIASES.get(dtype, dtype) if isinstance(dtype, str) else None
    if name not in _DTYPES:
        raise OptionError(f"--dtype must be auto, {', '.join(_DTYPES)}, {', '.join(_DTYPE_ALIASES)} (got {dtype!r})")
    return _DTYPES[name]


# ---------------------------------------------------------------------------
# Startup refusals. Each row: (what it refuses, predicate over the resolved
# settings, the one-line reason). A row is removed when the capability that
# lifts it lands.

Settings = Mapping[str, object]


@dataclass(frozen=True)
class Refusal:
    name: str
    applies: Callable[[Settings], bool]
    reason: str


REFUSALS: tuple[Refusal, ...] = (
    Refusal(
        "block size without paging",
        lambda s: not s.get("paged_kv") and s.get("paged_kv_block_size") is not None,
        "--paged-kv-block-size needs --paged-kv (or PAGEDLM_PAGED_KV=1; paging is the default on CUDA only)",
    ),
    Refusal(
        "prefix caching without paging",
        lambda s: s.get("prefix_caching") is True and not s.get("paged_kv"),
        "--prefix-caching shares paged KV blocks: it needs --paged-kv (the default store reuses "
        "prompts through --prompt-cache-bytes)",
    ),
    Refusal(
        "a prompt cache for the paged store",
        lambda s: s.get("prompt_cache_bytes") is not None and s.get("paged_kv"),
        "--prompt-cache-bytes sizes the default store's prompt cache; the paged store (the default on CUDA) "
        "shares prefixes through --prefix-caching: give --no-paged-kv, or drop it",
    ),
    Refusal(
        "two KV budgets",
        lambda s: s.get("kv_budget_bytes") is not None and s.get("gpu_memory_fraction") is not None,
        "--kv-budget-bytes and --gpu-memory-fraction both size the KV budget; give one",
    ),
    Refusal(
        "GPU memory fraction off CUDA",
        lambda s: s.get("device") == "cpu" and s.get("gpu_memory_fraction") is not None,
        "--gpu-memory-fraction sizes the KV budget from CUDA memory; on the CPU give --kv-budget-bytes",
    ),
    Refusal(
        "GPU memory utilization with another KV budget",
        lambda s: s.get("gpu_memory_utilization") is not None
        and (s.get("kv_budget_bytes") is not None or s.get("gpu_memory_fraction") is not None),
        "--gpu-memory-utilization, --kv-budget-bytes and --gpu-memory-fraction each size the KV budget; give one",
    ),
    Refusal(
        "GPU memory utilization off CUDA",
        lambda s: s.get("device") == "cpu" and s.get("gpu_memory_utilization") is not None,
        "--gpu-memory-utilization sizes the KV budget from CUDA memory; on the CPU give --kv-budget-bytes",
    ),
    Refusal(
        "half of TLS",
        lambda s: (s.get("ssl_keyfile") is None) != (s.get("ssl_certfile") is None),
        "--ssl-keyfile and --ssl-certfile go together: give both for TLS, or neither",
    ),
    Refusal(
        "CORS details without origins",
        lambda s: not s.get("allowed_origins") and ("allowed_methods" in s or "allowed_headers" in s),
        "--allowed-methods and --allowed-headers need --allowed-origins (CORS is off without it)",
    ),
    Refusal(
        "triton attention without paging",
        lambda s: s.get("attention_backend") == "triton" and not s.get("paged_kv"),
        "--attention-backend triton reads the paged pools; add --paged-kv (the default on CUDA; --no-paged-kv turns it off)",
    ),
    Refusal(
        "triton attention without triton",
        lambda s: s.get("attention_backend") == "triton" and importlib.util.find_spec("triton") is None,
        "--attention-backend triton needs the triton package (pip install triton)",
    ),
    Refusal(
        "triton attention off CUDA",
        lambda s: (s.get("attention_backend") == "triton" and s.get("device") == "cpu"
                   and os.environ.get("TRITON_INTERPRET") != "1"),
        "--attention-backend triton needs CUDA (TRITON_INTERPRET=1 runs it on the CPU, slowly, for tests)",
    ),
    Refusal(
        "speculation details without speculation",
        lambda s: not s.get("speculative") and any(s.get(k) is not None for k in
                                                   ("num_speculative_tokens", "ngram_min", "ngram_max")),
        "--num-speculative-tokens, --ngram-min and --ngram-max need --speculative ngram (or draft)",
    ),
    Refusal(
        "n-gram sizes without the n-gram proposer",
        lambda s: s.get("speculative") == "draft" and (s.get("ngram_min") is not None
                                                       or s.get("ngram_max") is not None),
        "--ngram-min and --ngram-max size prompt lookup: they need --speculative ngram",
    ),
    Refusal(
        "n-gram sizes out of order",
        lambda s: s.get("ngram_min") is not None and s.get("ngram_max") is not None
        and s["ngram_min"] > s["ngram_max"],
        "--ngram-min must not exceed --ngram-max (one given alone moves the other's default)",
    ),
    Refusal(
        "a draft model without the draft proposer",
        lambda s: s.get("draft_model") is not None and s.get("speculative") != "draft",
        "--draft-model proposes tokens for --speculative draft; add it (or drop --draft-model)",
    ),
    Refusal(
        "the draft proposer without a draft model",
        lambda s: s.get("speculative") == "draft" and s.get("draft_model") is None,
        "--speculative draft needs --draft-model M: a smaller model of the same tokenizer",
    ),
    Refusal(
        "a distributed backend without tensor parallelism",
        lambda s: s.get("distributed_backend") is not None and s.get("tensor_parallel_size", 1) == 1,
        "--distributed-backend connects the ranks of --tensor-parallel-size N > 1; give both or neither",
    ),
    Refusal(
        "NCCL off CUDA",
        lambda s: s.get("distributed_backend") == "nccl" and s.get("device") == "cpu",
        "--distributed-backend nccl connects GPUs; on the CPU use gloo (the default there)",
    ),
    Refusal(
        "more ranks than GPUs",
        lambda s: (s.get("tensor_parallel_size", 1) > 1 and str(s.get("device", "")).startswith("cuda")
                   and s["tensor_parallel_size"] > torch.cuda.device_count()),
        "--tensor-parallel-size puts one rank on each GPU: it exceeds the GPUs this machine has",
    ),
    Refusal(
        "more ranks than attention heads",
        lambda s: s.get("num_attention_heads") is not None
        and s.get("tensor_parallel_size", 1) > s["num_attention_heads"],
        "--tensor-parallel-size exceeds the model's attention heads: every rank needs one at least",
    ),
    Refusal(
        "KV groups that do not split",
        lambda s: s.get("uneven_kv_runs") is True,
        "--tensor-parallel-size splits this model's query heads so that a rank reads its KV heads in runs "
        "of different lengths (grouped-query attention cannot); use a size that divides the KV heads, "
        "or that they divide",
    ),
    Refusal(
        "tensor parallelism under CUDA graphs",
        lambda s: (s.get("tensor_parallel_size", 1) > 1 and str(s.get("device", "")).startswith("cuda")
                   and not s.get("enforce_eager")),
        "--tensor-parallel-size on CUDA runs eagerly for now (decode graphs do not capture the all-reduces "
        "yet): add --enforce-eager",
    ),
    Refusal(
        "compilation off the CPU",
        lambda s: s.get("compile") is True and str(s.get("device", "")).startswith("cuda"),
        "--compile compiles the CPU decode step; on CUDA the decode step replays CUDA graphs "
        "(--enforce-eager turns them off)",
    ),
    Refusal(
        "compilation and eager mode",
        lambda s: s.get("compile") is True and s.get("enforce_eager") is True,
        "--compile and --enforce-eager contradict each other; give one",
    ),
    Refusal(
        "compilation with the paged store",
        lambda s: s.get("compile") is True and bool(s.get("paged_kv")),
        "--compile runs the default store's decode step; --paged-kv on the CPU runs eagerly for now",
    ),
    Refusal(
        "compilation with tensor parallelism",
        lambda s: s.get("compile") is True and s.get("tensor_parallel_size", 1) > 1,
        "--compile compiles one process's decode step; --tensor-parallel-size N > 1 runs eagerly",
    ),
    Refusal(
        "compilation without a C++ compiler",
        lambda s: s.get("compile") is True and cxx_compiler() is None,
        "--compile builds C++ code and no C++ compiler was found (install g++, or set CXX to one); "
        "run without --compile",
    ),
    Refusal(
        "asynchronous scheduling with speculative decoding",
        lambda s: s.get("async_scheduling") is True and s.get("speculative") is not None,
        "--async-scheduling schedules a step before the last one's tokens are known; --speculative needs "
        "them to propose: give one (with --speculative the default is --no-async-scheduling)",
    ),
    Refusal(
        "asynchronous scheduling with tensor parallelism",
        lambda s: s.get("async_scheduling") is True and s.get("tensor_parallel_size", 1) > 1,
        "--async-scheduling runs one process's steps; --tensor-parallel-size N > 1 schedules synchronously",
    ),
    Refusal(
        "KV quantization without paging",
        lambda s: s.get("kv_quant", "none") != "none" and not s.get("paged_kv"),
        "--kv-quant quantizes the paged store's blocks; it needs --paged-kv (or PAGEDLM_PAGED_KV=1; the default on CUDA)",
    ),
)


def cxx_compiler() -> str | None:
    """The C++ compiler torch.compile's CPU backend builds with (``$CXX``, else
    g++, as inductor picks it), or None when it is not on the PATH."""
    return shutil.which(os.environ.get("CXX") or "g++")


def check_refusals(settings: Settings, set_by: Mapping[str, str] | None = None) -> None:
    """Raise `UnsupportedOption` for the first refused combination. ``set_by``:
    the settings an environment variable gave (name -> "VAR=value"), which the
    reason names where it names their flag: the user may not know they are set."""
    for refusal in REFUSALS:
        if refusal.applies(settings):
            sources = [source for name, source in (set_by or {}).items()
                       if re.search(re.escape(flag_name(name)) + r"(?![\w-])", refusal.reason)]
            raise UnsupportedOption(", ".join(sources) + ": " + refusal.reason if sources else refusal.reason)


# ---------------------------------------------------------------------------
# Engine options: how the batched engine schedules and stores KV. One row per
# flag, shared by `generate`, `chat`, `bench` and `serve`.


MAX_BYTES = 1024**5  # a byte count's largest: 1024T


def _byte_count(text: str | int, name: str) -> int:
    """An integer byte count, with an optional K/M/G/T suffix (powers of 1024)."""
    raw = str(text).strip()
    scale = 1
    if raw and raw[-1].upper() in "KMGT":
        scale = 1024 ** ("KMGT".index(raw[-1].upper()) + 1)
        raw = raw[:-1]
    try:
        value = int(raw) * scale
    except ValueError:
        raise OptionError(f"{name} must be a byte count such as 4294967296 or 4G (got {text!r})") from None
    if value <= 0:
        raise OptionError(f"{name} must be > 0 (got {text!r})")
    if value > MAX_BYTES:  # (beyond it torch's size arithmetic overflows before any allocator can refuse)
        raise OptionError(f"{name} must be at most 1024T bytes (got {text!r})")
    return value


def _fraction(text: str | float, name: str) -> float:
    try:
        value = float(text)
    except (TypeError, ValueError):
        value = float("nan")
    if not 0 < value <= 1:
        raise OptionError(f"{name} must be in (0, 1] (got {text!r})")
    return value


@dataclass(frozen=True)
class EngineOptions:
    """Scheduling and KV storage of one `LLMEngine`; None means the device's default."""

    paged_kv: PagedKvOptions | None = None
    max_num_seqs: int | None = None  # rows per step
    max_num_batched_tokens: int | None = None  # new tokens per step (prefill chunks included)
    long_prefill_token_threshold: int | None = None  # a chunk's cap while others wait; None: budget // 4, 0: none
    max_num_partial_prefills: int = 1  # sequences whose prompt may be partly computed at once
    kv_budget_bytes: int | None = None  # KV bytes all live sequences may hold
    gpu_memory_fraction: float | None = None  # CUDA: budget = fraction of memory free after weights
    gpu_memory_utilization: float | None = None  # CUDA (vLLM's): budget = total * it - memory in use after weights
    max_model_len: int | None = None  # prompt + max_tokens; default: the model's context
    prompt_cache_bytes: int = 0  # default store: keep finished sequences' KV for prefix reuse
    attention_backend: str = "auto"  # ATTENTION_BACKENDS
    enforce_eager: bool = False  # CUDA: never capture the decode step as a graph
    compile: bool = False  # CPU: the decode step as torch.compile graphs (batch/compiled.py)
    async_scheduling: bool | None = None  # schedule step N+1 while step N runs (None: the device's default)
    kv_quant: str = "none"  # paged store: none, int8 or fp8 blocks (cache/kv_quant.py)
    tensor_parallel_size: int = 1  # ranks the model is split across (pagedlm.parallel)
    distributed_backend: str | None = None  # DISTRIBUTED_BACKENDS; None: nccl on CUDA, gloo on the CPU
    speculative: str | None = None  # SPECULATIVE_METHODS; None: no speculative decoding
    num_speculative_tokens: int | None = None  # tokens a row proposes per step (DEFAULT_NUM_SPECULATIVE_TOKENS)
    ngram_min: int | None = None  # prompt lookup's shortest and longest suffix matched (DEFAULT_NGRAM_MIN/MAX)
    ngram_max: int | None = None
    draft_model: str | None = None  # --speculative draft: the model that proposes


# Device defaults: a CPU step is compute-bound well before 512 tokens; a GPU
# step wants thousands of tokens and hundreds of rows to fill the device.
DEVICE_DEFAULTS = {
    "cpu": {"max_num_seqs": 64, "max_num_batched_tokens": 512, "kv_budget_bytes": 2 * 1024**3,
            "async_scheduling": False},
    "cuda": {"max_num_seqs": 256, "max_num_batched_tokens": 8192, "gpu_memory_fraction": 0.9,
             "async_scheduling": True},
}


def async_scheduling_on(options: EngineOptions, device: str) -> bool:
    """Whether an engine on ``device`` (its type) schedules asynchronously:
    the flag, else the device's default (on for CUDA, where the host's step
    then overlaps the device's; off on the CPU, where one processor does
    both), which speculative decoding and tensor parallelism turn off (they
    are refused beside an explicit ``--async-scheduling``)."""
    if options.async_scheduling is not None:
        return options.async_scheduling
    return (DEVICE_DEFAULTS.get(device, DEVICE_DEFAULTS["cpu"])["async_scheduling"]
            and options.speculative is None and options.tensor_parallel_size == 1)


@dataclass(frozen=True)
class Flag:
    """One option: its attribute name, environment variable, parser and help.
    A ``switch`` is a --name / --no-name flag (1/0 in its environment variable)."""

    name: str
    env: str
    parse: Callable[[str], object]
    help: str
    switch: bool = False
    nargs: str | None = None  # argparse's: "+" takes one or more values (a list reaches parse)


def _switch(name: str) -> Callable[[str | bool], bool]:
    return lambda t: t if isinstance(t, bool) else env_flag(name, {name: t})


def _backend(text: str) -> str:
    if text not in ATTENTION_BACKENDS:
        raise OptionError(f"--attention-backend must be {', '.join(ATTENTION_BACKENDS)} (got {text!r})")
    return text


def _distributed_backend(text: str) -> str:
    if text not in DISTRIBUTED_BACKENDS:
        raise OptionError(f"--distributed-backend must be {', '.join(DISTRIBUTED_BACKENDS)} (got {text!r})")
    return text


def _speculative(text: str) -> str:
    if text not in SPECULATIVE_METHODS:
        raise OptionError(f"--speculative must be {', '.join(SPECULATIVE_METHODS)} (got {text!r})")
    return text


ENGINE_FLAGS: tuple[Flag, ...] = (
    Flag("max_num_seqs", "PAGEDLM_MAX_NUM_SEQS", lambda t: positive_int(t, "--max-num-seqs"),
               "sequences per step (default: 64 on CPU, 256 on CUDA)"),
    Flag("max_num_batched_tokens", "PAGEDLM_MAX_NUM_BATCHED_TOKENS",
               lambda t: positive_int(t, "--max-num-batched-tokens"),
               "new tokens per step; longer prompts prefill in chunks (default: 512 on CPU, 8192 on CUDA)"),
    Flag("long_prefill_token_threshold", "PAGEDLM_LONG_PREFILL_TOKEN_THRESHOLD",
         lambda t: _nonneg_int(t, "--long-prefill-token-threshold"),
         "while other sequences wait, a prompt chunk takes at most this many tokens of a step "
         "(default: a quarter of --max-num-batched-tokens; 0: no cap)"),
    Flag("max_num_partial_prefills", "PAGEDLM_MAX_NUM_PARTIAL_PREFILLS",
         lambda t: positive_int(t, "--max-num-partial-prefills"),
         "sequences whose prompt may be partly prefilled at once; shorter prompts still join (default 1)"),
    Flag("kv_budget_bytes", "PAGEDLM_KV_BUDGET_BYTES", lambda t: _byte_count(t, "--kv-budget-bytes"),
               "KV bytes for all live sequences, e.g. 4G (default: 2G on CPU; on CUDA see --gpu-memory-fraction)"),
    Flag("gpu_memory_fraction", "PAGEDLM_GPU_MEMORY_FRACTION",
               lambda t: _fraction(t, "--gpu-memory-fraction"),
               "CUDA: KV budget as a fraction of the memory free after loading weights (default 0.9)"),
    Flag("gpu_memory_utilization", "PAGEDLM_GPU_MEMORY_UTILIZATION",
         lambda t: _fraction(t, "--gpu-memory-utilization"),
         "CUDA, vLLM's meaning: the fraction of the GPU's total memory this process may use, weights "
         "included; the KV budget is what of it is left after loading the weights"),
    Flag("attention_backend", "PAGEDLM_ATTENTION_BACKEND", _backend,
         "paged attention: auto (triton on CUDA), torch (gather + SDPA) or triton (in-place kernels)"),
    Flag("enforce_eager", "PAGEDLM_ENFORCE_EAGER", _switch("PAGEDLM_ENFORCE_EAGER"),
         "CUDA: run the decode step eagerly instead of replaying CUDA graphs", switch=True),
    Flag("compile", "PAGEDLM_COMPILE", _switch("PAGEDLM_COMPILE"),
         "CPU: run decode steps of up to 32 rows as compiled graphs (torch.compile; built when the engine "
         "starts, 30-50 s the first time, 6-13 s once cached in ~/.cache/pagedlm/inductor; default off)", switch=True),
    Flag("async_scheduling", "PAGEDLM_ASYNC_SCHEDULING", _switch("PAGEDLM_ASYNC_SCHEDULING"),
         "schedule and launch each step before the previous step's tokens reach the host, so the host's "
         "work overlaps the device's (vLLM's async scheduling; default on for CUDA, off on the CPU)",
         switch=True),
    Flag("max_model_len", "PAGEDLM_MAX_MODEL_LEN", lambda t: positive_int(t, "--max-model-len"),
         "context length limit (prompt + max_tokens; default: the model's)"),
    Flag("kv_quant", KV_QUANT_ENV, check_kv_quant,
         "paged store: keys and values as none, int8 or fp8 (e4m3) blocks with a scale per token and "
         "KV head (default none)"),
    Flag("speculative", "PAGEDLM_SPECULATIVE", _speculative,
         "speculative decoding: ngram (propose what followed the last tokens' latest earlier match in the "
         "prompt and output) or draft (the greedy continuation of --draft-model); default off"),
    Flag("num_speculative_tokens", "PAGEDLM_NUM_SPECULATIVE_TOKENS",
         lambda t: positive_int(t, "--num-speculative-tokens"),
         f"with --speculative: tokens a row proposes per step (default {DEFAULT_NUM_SPECULATIVE_TOKENS})"),
    Flag("ngram_min", "PAGEDLM_NGRAM_MIN", lambda t: positive_int(t, "--ngram-min"),
         f"--speculative ngram: the shortest suffix looked up (default {DEFAULT_NGRAM_MIN})"),
    Flag("ngram_max", "PAGEDLM_NGRAM_MAX", lambda t: positive_int(t, "--ngram-max"),
         f"--speculative ngram: the longest suffix looked up; longer matches win (default {DEFAULT_NGRAM_MAX})"),
    Flag("draft_model", "PAGEDLM_DRAFT_MODEL", str,
         "--speculative draft: the proposing model, of the target's tokenizer (default none)"),
    Flag("tensor_parallel_size", "PAGEDLM_TENSOR_PARALLEL_SIZE",
         lambda t: positive_int(t, "--tensor-parallel-size"),
         "split the model across N ranks (tensor parallelism: one process per rank, one GPU each on CUDA; "
         "default 1)"),
    Flag("distributed_backend", "PAGEDLM_DISTRIBUTED_BACKEND", _distributed_backend,
         "the ranks' torch.distributed backend: gloo or nccl (default: nccl on CUDA, gloo on the CPU)"),
)


def resolve_engine_options(
    flags: Mapping[str, object],
    environ: Mapping[str, str] | None = None,
    device: str | None = None,
    **fixed: object,
) -> EngineOptions:
    """Explicit flag > environment variable > the device default (applied by
    the engine). ``flags`` also carries the ``PAGED_FLAGS``;
    ``device`` (resolved) lets device refusals fire before a model loads;
    ``fixed`` sets fields that have no flag here (the prompt cache)."""
    env = os.environ if environ is None else environ
    values, set_by = _flags_or_env(ENGINE_FLAGS, flags, env)
    paged = resolve_paged_kv(flags.get("paged_kv"), flags.get("paged_kv_block_size"), env,
                             flags.get("prefix_caching"), device)
    check_refusals({**values, "device": device, "paged_kv": paged is not None}, set_by)
    return EngineOptions(paged_kv=paged, **values, **fixed)


def _flags_or_env(
    rows: tuple[Flag, ...], flags: Mapping[str, object], env: Mapping[str, str],
) -> tuple[dict[str, object], dict[str, str]]:
    """Explicit flag > environment variable, for the rows given either: their
    parsed values, and which came from a variable (name -> "VAR=value"). A bad
    value is named by where it came from: the flag or the variable."""
    values: dict[str, object] = {}
    set_by: dict[str, str] = {}
    for row in rows:
        if flags.get(row.name) is not None:
            values[row.name] = row.parse(flags[row.name])
        elif env.get(row.env):
            try:
                values[row.name] = row.parse(env[row.env])
            except OptionError as e:
                raise type(e)(str(e).replace(flag_name(row.name), row.env)) from None
            set_by[row.name] = f"{row.env}={env[row.env]}"
    return values, set_by


# ---------------------------------------------------------------------------
# Server options: one row per option, with its flag, environment variable and
# default, so that the CLI, the startup log and docs/server-config.md agree.


def _seconds(text: str | float, name: str) -> float:
    try:
        value = float(text)
    except (TypeError, ValueError):
        value = float("nan")
    if not 0 < value < math.inf:
        raise OptionError(f"{name} must be a number of seconds > 0 (got {text!r})")
    return value


def cache_dir() -> Path:
    """Where pagedlm keeps what it builds once (conversions, quantized weights,
    kernels, compiled code): ``PAGEDLM_CACHE_DIR``, unset or empty
    ``~/.cache/pagedlm``."""
    return Path(os.environ.get("PAGEDLM_CACHE_DIR") or Path.home() / ".cache" / "pagedlm")


def tp_timeout(environ: Mapping[str, str] | None = None) -> float:
    """Seconds a tensor-parallel collective may wait for the other ranks:
    ``PAGEDLM_TP_TIMEOUT`` (default 120), read when the ranks start."""
    raw = (os.environ if environ is None else environ).get("PAGEDLM_TP_TIMEOUT", "")
    return _seconds(raw, "PAGEDLM_TP_TIMEOUT") if raw.strip() else 120.0


def _nonneg_int(text: str | int, name: str) -> int:
    try:
        value = int(text)
    except (TypeError, ValueError):
        raise OptionError(f"{name} must be an integer >= 0 (got {text!r})") from None
    if value < 0:
        raise OptionError(f"{name} must be an integer >= 0 (got {text!r})")
    return value


def _checked(text: str, resolve: Callable[[str], object]) -> str:
    """``text`` as given, once ``resolve`` takes it (its error names the flag,
    which `_flags_or_env` turns into the variable's name where it came from there)."""
    resolve(text)
    return text


def _api_key(text: str) -> str | None:
    if text != text.strip():  # HTTP trims a header's value: no client could send it
        raise OptionError("--api-key must not begin or end with whitespace")
    return text or None


def _port(text: str | int) -> int:
    value = positive_int(text, "--port")
    if value > 65535:
        raise OptionError(f"--port must be <= 65535 (got {text!r})")
    return value


SERVER_FLAGS: tuple[Flag, ...] = (
    Flag("model", "PAGEDLM_MODEL", str, "model: built-in name, .gguf path or HF folder"),
    Flag("host", "PAGEDLM_HOST", str, "address to bind (loopback by default)"),
    Flag("port", "PAGEDLM_PORT", _port, "port to listen on"),
    Flag("device", "PAGEDLM_DEVICE", lambda t: _checked(t, resolve_device), "auto, cpu or cuda"),
    Flag("dtype", "PAGEDLM_DTYPE", lambda t: _checked(t, lambda d: resolve_dtype(d, "cpu")),
         "auto, float32, bfloat16 or float16"),
    Flag("quantization", QUANTIZATION_ENV, check_quantization,
         "weight-only quantization: none, int8 or int4"),
    Flag("prompt_cache_bytes", "PAGEDLM_PROMPT_CACHE_BYTES",
               lambda t: _nonneg_int(t, "--prompt-cache-bytes"),
               "bytes of KV the prompt cache may keep (0 turns it off)"),
    Flag("max_queue", "PAGEDLM_MAX_QUEUE", lambda t: positive_int(t, "--max-queue"),
               "sequences (prompts x n) that may wait for the engine to admit them; past it, 503"),
    Flag("max_prompts_per_request", "PAGEDLM_MAX_PROMPTS_PER_REQUEST",
         lambda t: positive_int(t, "--max-prompts-per-request"),
         "prompts one completion request may list; more is a 400 (default 64)"),
    Flag("header_timeout", "PAGEDLM_HEADER_TIMEOUT", lambda t: _seconds(t, "--header-timeout"),
         "seconds a connection has to send a request's headers; then it is closed (default 10)"),
    Flag("body_timeout", "PAGEDLM_BODY_TIMEOUT", lambda t: _seconds(t, "--body-timeout"),
         "seconds a request has to send its whole body; then 408 and the connection is closed (default 60)"),
    Flag("max_connections", "PAGEDLM_MAX_CONNECTIONS", lambda t: positive_int(t, "--max-connections"),
         "open connections; one more is answered 503 and closed (default 512)"),
    Flag("api_key", "PAGEDLM_API_KEY", _api_key,
               "require Authorization: Bearer KEY (empty: no authentication)"),
    Flag("served_model_name", "PAGEDLM_SERVED_MODEL_NAME", lambda t: _names(t, "--served-model-name"),
         "the model ids clients may send (the first is reported; default: --model as given)", nargs="+"),
    Flag("chat_template", "PAGEDLM_CHAT_TEMPLATE", lambda t: _chat_template_file(t, "--chat-template"),
         "a jinja2 chat template file used instead of the model's (default: the model's)"),
    Flag("seed", "PAGEDLM_SEED", lambda t: check_seed(_parse_int(t, "--seed"), "--seed"),
         "seed of every request that gives none: the same request, the same output (default: random)"),
    Flag("allowed_origins", "PAGEDLM_ALLOWED_ORIGINS", lambda t: _names(t, "--allowed-origins"),
         "CORS: origins browsers may call from, a JSON list or comma list; * for any (default: none, CORS off)"),
    Flag("allowed_methods", "PAGEDLM_ALLOWED_METHODS", lambda t: _names(t, "--allowed-methods"),
         "CORS: methods allowed (needs --allowed-origins)"),
    Flag("allowed_headers", "PAGEDLM_ALLOWED_HEADERS", lambda t: _names(t, "--allowed-headers"),
         "CORS: request headers allowed (needs --allowed-origins)"),
    Flag("log_level", "PAGEDLM_LOG_LEVEL", lambda t: _choice(t, LOG_LEVELS, "--log-level"),
         "debug, info, warning, error or critical: pagedlm's and uvicorn's logs"),
    Flag("ssl_keyfile", "PAGEDLM_SSL_KEYFILE", lambda t: _readable_file(t, "--ssl-keyfile"),
         "TLS: the private key file (PEM); needs --ssl-certfile"),
    Flag("ssl_certfile", "PAGEDLM_SSL_CERTFILE", lambda t: _readable_file(t, "--ssl-certfile"),
         "TLS: the certificate file (PEM); needs --ssl-keyfile"),
)

LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


def _parse_int(text: str | int, name: str) -> int:
    try:
        return int(text)
    except (TypeError, ValueError):
        raise OptionError(f"{name} must be an integer (got {text!r})") from None


def _choice(text: str, choices: tuple[str, ...], name: str) -> str:
    if str(text).strip().lower() not in choices:
        raise OptionError(f"{name} must be {', '.join(choices)} (got {text!r})")
    return str(text).strip().lower()


def _names(value: str | list[str], name: str) -> tuple[str, ...]:
    """One or more names: argparse's list, or one string holding a JSON list
    or a comma-separated list (an environment variable, vLLM's CORS flags)."""
    items = value if isinstance(value, list) else None
    if items is None and str(value).strip().startswith("["):
        try:
            items = json.loads(value)
        except ValueError:
            items = None
        if not (isinstance(items, list) and all(isinstance(i, str) for i in items)):
            raise OptionError(f"{name} must be a JSON list of strings or a comma list (got {value!r})")
    if items is None:
        items = str(value).split(",")
    names = tuple(i.strip() for i in items if i.strip())
    if not names:
        raise OptionError(f"{name} needs at least one name (got {value!r})")
    return names


def _readable_file(path: str, name: str) -> str:
    try:
        with open(path, "rb"):
            return path
    except OSError as e:
        raise OptionError(f"{name} {path}: {e.strerror or e}") from None


def _chat_template_file(path: str, name: str) -> str:
    """The text of a chat template file, checked to compile."""
    from pagedlm.tokenizer import compile_chat_template

    _readable_file(path, name)
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
        compile_chat_template(text)
    except (UnicodeDecodeError, ValueError) as e:
        raise OptionError(f"{name} {path}: {e}") from None
    return text


@dataclass
class ServerOptions:
    model: str = DEFAULT_MODEL
    host: str = "127.0.0.1"
    port: int = 8000
    device: str = "auto"
    dtype: str = "auto"
    quantization: str = DEFAULT_QUANTIZATION
    prompt_cache_bytes: int = 2 * 1024**3
    max_queue: int = 256
    max_prompts_per_request: int = 64  # a quarter of the default --max-queue, with n = 1
    header_timeout: float = 10.0
    body_timeout: float = 60.0  # 8 MiB (the body limit) at 140 KB/s
    max_connections: int = 512  # twice CUDA's max_num_seqs; under the usual 1024 file descriptors
    api_key: str | None = None
    served_model_name: tuple[str, ...] | None = None
    chat_template: str | None = None  # the text of --chat-template's file
    seed: int | None = None
    allowed_origins: tuple[str, ...] = ()
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    log_level: str = "info"
    ssl_keyfile: str | None = None
    ssl_certfile: str | None = None
    engine: EngineOptions = field(default_factory=EngineOptions)

    @property
    def paged_kv(self) -> PagedKvOptions | None:
        return self.engine.paged_kv

    @property
    def model_names(self) -> tuple[str, ...]:
        """The model ids the API serves, the reported one first."""
        return self.served_model_name or (self.model,)

    @classmethod
    def resolve(
        cls,
        flags: Mapping[str, object],
        environ: Mapping[str, str] | None = None,
    ) -> "ServerOptions":
        """Explicit flag > environment variable > default, for every option."""
        env = os.environ if environ is None else environ
        opts = cls()
        values, set_by = _flags_or_env(SERVER_FLAGS, flags, env)
        for name, value in values.items():
            setattr(opts, name, value)
        env_flag(CPU_QUANT_KERNEL_ENV, env)  # (read while the weights load: checked here, named as itself)
        opts.engine = resolve_engine_options(flags, env, resolve_device(opts.device),
                                             prompt_cache_bytes=opts.prompt_cache_bytes)
        check_refusals({**values, "allowed_origins": opts.allowed_origins,
                        "paged_kv": opts.engine.paged_kv is not None}, set_by)
        return opts
