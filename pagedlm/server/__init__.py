"""`pagedlm serve`: an OpenAI-compatible HTTP server over the serial lane.

``run(options)`` loads the model, logs the effective configuration and
serves until interrupted. The server's dependencies (fastapi, uvicorn,
pydantic, prometheus-client) are imported here and below, never by the
engine core.
"""

from __future__ import annotations

import json
import logging
import sys

from pagedlm.options import OptionError, ServerOptions, resolve_device, resolve_dtype

log = logging.getLogger("pagedlm.server")

DEFAULT_MAX_MODEL_LEN = 8192  # when a config names no max_position_embeddings
LOOPBACK = ("127.0.0.1", "localhost", "::1")


def _setup_logging() -> None:
    root = logging.getLogger("pagedlm")
    if not root.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(levelname)s:     %(message)s"))
        root.addHandler(handler)
        root.setLevel(logging.INFO)


def model_context_length(model, spec: str) -> int:
    """The model's trained context: ``max_position_embeddings`` of its config."""
    value = getattr(model.args, "max_position_embeddings", None)
    if value is None:
        from pagedlm.loading import resolve

        config = json.loads((resolve(spec) / "config.json").read_text())
        value = config.get("max_position_embeddings")
    return int(value or DEFAULT_MAX_MODEL_LEN)


def effective_config(options: ServerOptions, device: str, dtype, max_model_len: int) -> list[str]:
    """One ``name = value`` line per setting, secrets masked."""
    paged = (f"on, block size {options.paged_kv.block_size}" if options.paged_kv else "off")
    return [
        f"model = {options.model}",
        f"host = {options.host}",
        f"port = {options.port}",
        f"device = {device}",
        f"dtype = {str(dtype).removeprefix('torch.')}",
        f"quantization = {options.quantization}",
        f"paged_kv = {paged}",
        f"prompt_cache_bytes = {options.prompt_cache_bytes}"
        + (" (off)" if options.prompt_cache_bytes == 0 else ""),
        f"max_queue = {options.max_queue}",
        f"api_key = {'set' if options.api_key else 'not set (no authentication)'}",
        f"max_model_len = {max_model_len}",
    ]


def run(options: ServerOptions) -> int:
    """Load the model and serve until interrupted. Returns an exit status."""
    import uvicorn

    from pagedlm.cache.prompt import PromptCache
    from pagedlm.loading import load

    from .app import build_app
    from .engine import Engine
    from .lane import SerialLane
    from .metrics import Metrics

    _setup_logging()
    device = resolve_device(options.device)
    dtype = resolve_dtype(options.dtype, device)
    model, tokenizer = load(options.model, device, dtype, quantization=options.quantization)
    context = model_context_length(model, options.model)
    max_model_len = options.max_model_len or context
    if max_model_len > context:
        raise OptionError(f"--max-model-len {max_model_len} exceeds the model's context "
                          f"length ({context} tokens)")

    metrics = Metrics()
    lane = SerialLane(options.max_queue)
    prompt_cache = PromptCache(options.prompt_cache_bytes)
    engine = Engine(model, tokenizer, options.model, max_model_len, prompt_cache,
                    options.paged_kv, metrics)
    metrics.bind(engine, lane)
    app = build_app(engine, lane, metrics, options)

    log.info("pagedlm serve, effective configuration:")
    for line in effective_config(options, device, dtype, max_model_len):
        log.info("  %s", line)
    if options.api_key is None and options.host not in LOOPBACK:
        log.warning("listening on %s without --api-key: anyone who can reach it can use it",
                    options.host)
    try:
        uvicorn.run(app, host=options.host, port=options.port, log_level="info",
                    timeout_graceful_shutdown=5)
    finally:
        lane.close()
    return 0


__all__ = ["run"]
