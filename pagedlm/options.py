"""Options, flag/environment resolution and startup refusals: the one place for them.

Every flag the CLI and the server accept is resolved here, every value the
engine cannot use raises `OptionError`, and every combination the engine
cannot honour is refused by `check_refusals` with `UnsupportedOption`: a
one-line reason, a non-zero exit, never a silent downgrade. `docs/cli.md`
mirrors `REFUSALS` row for row.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Callable, Mapping

import torch

from pagedlm.kernels.quant import MODES

DEFAULT_MODEL = "gemma3-270m"
DEFAULT_BLOCK_SIZE = 256  # = KVCache.STEP: v1's growth granularity, permuted into reusable slots
PAGED_KV_ENV = "PAGEDLM_PAGED_KV"
QUANTIZATION_ENV = "PAGEDLM_QUANTIZATION"
QUANTIZATIONS = MODES  # none, int8, int4
DEFAULT_QUANTIZATION = "none"


class OptionError(ValueError):
    """A flag, environment or request value the engine cannot use."""


class UnsupportedOption(OptionError):
    """A combination of options that is refused at startup."""


@dataclass(frozen=True)
class PagedKvOptions:
    """Turns on the paged KV cache for full-attention layers."""

    block_size: int = DEFAULT_BLOCK_SIZE


@dataclass
class GenerateOptions:
    """Everything one generation request asks for."""

    max_tokens: int = 256
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    logprobs: int | None = None  # None: none; k >= 0: the chosen token's plus the top k
    prompt_logprobs: int | None = None  # same, for every prompt token after the first
    ignore_eos: bool = False  # keep going past end-of-sequence tokens (benchmarks)
    paged_kv: PagedKvOptions | None = None

    def validate(self) -> None:
        """Raise `OptionError` naming the first bad field."""
        checks: list[tuple[bool, str]] = [
            (self.max_tokens >= 1, f"max_tokens must be >= 1 (got {self.max_tokens})"),
            (self.temperature >= 0, f"temperature must be >= 0 (got {self.temperature})"),
            (self.top_k >= 0, f"top_k must be >= 0 (got {self.top_k})"),
            (0 < self.top_p <= 1, f"top_p must be in (0, 1] (got {self.top_p})"),
            (0 <= self.min_p <= 1, f"min_p must be in [0, 1] (got {self.min_p})"),
            (self.repetition_penalty > 0,
             f"repetition_penalty must be > 0 (got {self.repetition_penalty})"),
            (self.logprobs is None or 0 <= self.logprobs <= 20,
             f"logprobs must be in [0, 20] (got {self.logprobs})"),
            (self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= 20,
             f"prompt_logprobs must be in [0, 20] (got {self.prompt_logprobs})"),
        ]
        for ok, message in checks:
            if not ok:
                raise OptionError(message)


# ---------------------------------------------------------------------------
# Parsing helpers shared by the CLI, the environment and the server.


def positive_int(text: str | int, name: str) -> int:
    try:
        value = int(text)
    except (TypeError, ValueError):
        raise OptionError(f"{name} must be a positive integer (got {text!r})") from None
    if value <= 0 or str(value) != str(text).strip().lstrip("+"):
        raise OptionError(f"{name} must be a positive integer (got {text!r})")
    return value


def env_flag(name: str, environ: Mapping[str, str] | None = None) -> bool | None:
    """An explicit 1/0 (true/false, on/off) environment switch; None when unset."""
    raw = (os.environ if environ is None else environ).get(name)
    if raw is None or raw == "":
        return None
    low = raw.strip().lower()
    if low in ("1", "true", "on", "yes"):
        return True
    if low in ("0", "false", "off", "no"):
        return False
    raise OptionError(f"{name} must be 1 or 0 (got {raw!r})")


def resolve_paged_kv(
    flag: bool | None,
    block_size: int | str | None,
    environ: Mapping[str, str] | None = None,
) -> PagedKvOptions | None:
    """Explicit CLI flag > explicit PAGEDLM_PAGED_KV > default (off)."""
    on = flag if flag is not None else env_flag(PAGED_KV_ENV, environ)
    if block_size is not None:
        block_size = positive_int(block_size, "--paged-kv-block-size")
    check_refusals({"paged_kv": bool(on), "paged_kv_block_size": block_size})
    if not on:
        return None
    return PagedKvOptions(block_size=block_size or DEFAULT_BLOCK_SIZE)


def check_quantization(mode: object, name: str = "--quantization") -> str:
    if mode not in QUANTIZATIONS:
        raise OptionError(f"{name} must be {', '.join(QUANTIZATIONS)} (got {mode!r})")
    return mode


def resolve_quantization(flag: str | None, environ: Mapping[str, str] | None = None) -> str:
    """Explicit --quantization > explicit PAGEDLM_QUANTIZATION > default ("none")."""
    if flag is not None:
        return check_quantization(flag)
    raw = (os.environ if environ is None else environ).get(QUANTIZATION_ENV)
    if raw:
        return check_quantization(raw.strip().lower(), QUANTIZATION_ENV)
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


def resolve_dtype(dtype: str | None, device: str) -> torch.dtype:
    """float32 on the CPU, bfloat16 on CUDA, unless asked otherwise."""
    if dtype in (None, "", "auto"):
        return torch.float32 if device == "cpu" else torch.bfloat16
    if dtype not in _DTYPES:
        raise OptionError(f"--dtype must be auto, {', '.join(_DTYPES)} (got {dtype!r})")
    return _DTYPES[dtype]


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
        "--paged-kv-block-size needs --paged-kv (or PAGEDLM_PAGED_KV=1)",
    ),
)


def check_refusals(settings: Settings) -> None:
    """Raise `UnsupportedOption` for the first refused combination."""
    for refusal in REFUSALS:
        if refusal.applies(settings):
            raise UnsupportedOption(refusal.reason)


# ---------------------------------------------------------------------------
# Server options: one row per option, with its flag, environment variable and
# default, so that the CLI, the startup log and docs/server-config.md agree.


@dataclass(frozen=True)
class ServerFlag:
    name: str  # attribute of ServerOptions
    env: str
    parse: Callable[[str], object]
    help: str


def _nonneg_int(text: str | int, name: str) -> int:
    try:
        value = int(text)
    except (TypeError, ValueError):
        raise OptionError(f"{name} must be an integer >= 0 (got {text!r})") from None
    if value < 0:
        raise OptionError(f"{name} must be an integer >= 0 (got {text!r})")
    return value


def _port(text: str | int) -> int:
    value = positive_int(text, "--port")
    if value > 65535:
        raise OptionError(f"--port must be <= 65535 (got {text!r})")
    return value


SERVER_FLAGS: tuple[ServerFlag, ...] = (
    ServerFlag("model", "PAGEDLM_MODEL", str, "model: built-in name, .gguf path or HF folder"),
    ServerFlag("host", "PAGEDLM_HOST", str, "address to bind (loopback by default)"),
    ServerFlag("port", "PAGEDLM_PORT", _port, "port to listen on"),
    ServerFlag("device", "PAGEDLM_DEVICE", str, "auto, cpu or cuda"),
    ServerFlag("dtype", "PAGEDLM_DTYPE", str, "auto, float32, bfloat16 or float16"),
    ServerFlag("quantization", QUANTIZATION_ENV, check_quantization,
               "weight-only quantization: none, int8 or int4"),
    ServerFlag("prompt_cache_bytes", "PAGEDLM_PROMPT_CACHE_BYTES",
               lambda t: _nonneg_int(t, "--prompt-cache-bytes"),
               "bytes of KV the prompt cache may keep (0 turns it off)"),
    ServerFlag("max_queue", "PAGEDLM_MAX_QUEUE", lambda t: _nonneg_int(t, "--max-queue"),
               "requests that may wait behind the running one; past it, 503"),
    ServerFlag("api_key", "PAGEDLM_API_KEY", str, "require Authorization: Bearer KEY"),
    ServerFlag("max_model_len", "PAGEDLM_MAX_MODEL_LEN",
               lambda t: positive_int(t, "--max-model-len"),
               "context length limit (prompt + max_tokens); default: the model's"),
)


@dataclass
class ServerOptions:
    model: str = DEFAULT_MODEL
    host: str = "127.0.0.1"
    port: int = 8000
    device: str = "auto"
    dtype: str = "auto"
    quantization: str = DEFAULT_QUANTIZATION
    prompt_cache_bytes: int = 2 * 1024**3
    max_queue: int = 16
    api_key: str | None = None
    max_model_len: int | None = None
    paged_kv: PagedKvOptions | None = None

    @classmethod
    def resolve(
        cls,
        flags: Mapping[str, object],
        environ: Mapping[str, str] | None = None,
    ) -> "ServerOptions":
        """Explicit flag > environment variable > default, for every option."""
        env = os.environ if environ is None else environ
        opts = cls()
        for row in SERVER_FLAGS:
            value = flags.get(row.name)
            if value is None and env.get(row.env):
                value = env[row.env]
            if value is not None:
                setattr(opts, row.name, row.parse(value))
        opts.paged_kv = resolve_paged_kv(
            flags.get("paged_kv"), flags.get("paged_kv_block_size"), env
        )
        return opts
