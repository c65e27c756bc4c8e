"""`pagedlm serve`: an OpenAI-compatible HTTP server over the batched engine.

``run(options)`` loads the model, logs the effective configuration and
serves until interrupted. The server's dependencies (fastapi, uvicorn,
pydantic, prometheus-client) are imported here and below, never by the
engine core.
"""

from __future__ import annotations

import logging
import socket
import sys
import time
from typing import TYPE_CHECKING

from pagedlm.attention import describe_store
from pagedlm.options import OptionError, ServerOptions, resolve_device, resolve_dtype

if TYPE_CHECKING:
    from pagedlm.batch.engine import LLMEngine

log = logging.getLogger("pagedlm.server")

LOOPBACK = ("127.0.0.1", "localhost", "::1")


def _setup_logging(level: str = "info") -> None:
    """pagedlm's logs at ``level`` (uvicorn's are set by its config)."""
    root = logging.getLogger("pagedlm")
    if not root.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(levelname)s:     %(message)s"))
        root.addHandler(handler)
    root.setLevel(level.upper())


def check_tls(keyfile: str | None, certfile: str | None) -> None:
    """A key and certificate that do not load are refused before the model loads."""
    if keyfile is None:
        return
    import ssl

    try:
        ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(certfile, keyfile)
    except (ssl.SSLError, OSError) as e:
        raise OptionError(f"--ssl-certfile {certfile} / --ssl-keyfile {keyfile}: cannot load them "
                          f"({getattr(e, 'reason', None) or e})") from None


def effective_config(options: ServerOptions, device: str, dtype, engine: "LLMEngine") -> list[str]:
    """One ``name = value`` line per setting, secrets masked."""
    caches = engine.cache_stats()
    paged = describe_store(engine)
    return [
        f"model = {options.model}",
        f"served_model_name = {', '.join(options.model_names)}",
        "chat_template = " + ("from --chat-template" if options.chat_template is not None else "the model's"),
        f"seed = {options.seed if options.seed is not None else 'none (requests without one are random)'}",
        f"cors = {'origins ' + ', '.join(options.allowed_origins) if options.allowed_origins else 'off'}",
        f"tls = {'on' if options.ssl_certfile else 'off'}",
        f"log_level = {options.log_level}",
        f"host = {options.host}",
        f"port = {options.port}",
        f"device = {device}",
        f"dtype = {str(dtype).removeprefix('torch.')}",
        f"quantization = {options.quantization}",
        f"kv_store = {paged}",
        f"kv_quant = {options.engine.kv_quant}",
        f"prompt_cache_bytes = {options.prompt_cache_bytes}"
        + (" (off)" if caches.prompt_cache_entries is None else ""),
        f"max_queue = {options.max_queue}",
        f"max_prompts_per_request = {options.max_prompts_per_request}",
        f"header_timeout = {options.header_timeout:g}s, body_timeout = {options.body_timeout:g}s, "
        f"max_connections = {options.max_connections}",
        f"api_key = {'set' if options.api_key else 'not set (no authentication)'}",
        f"max_model_len = {engine.max_model_len}",
        f"max_num_seqs = {engine.max_num_seqs}",
        f"max_num_batched_tokens = {engine.max_num_batched_tokens}",
        f"kv_budget_bytes = {caches.kv_budget_bytes}"
        + (f" ({caches.blocks_total} blocks)" if caches.blocks_total is not None else ""),
    ]


def bind(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port``, or `OptionError`: a bad address or a
    port in use is found before the model loads, not after."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
    except (OSError, UnicodeError) as e:
        raise OptionError(f"cannot listen on {host}:{port}: {getattr(e, 'strerror', None) or e}") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does
        sock.bind(address)
    except OSError as e:
        sock.close()
        raise OptionError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock


def uvicorn_config(app, options: ServerOptions):
    """uvicorn's configuration for ``app``: the address, TLS, and the slow-client
    limits (header and body deadlines, the connection cap: `http.protocol`)."""
    import uvicorn

    from .http import protocol

    app.state.body_timeout_s = options.body_timeout  # read_body's deadline
    return uvicorn.Config(app, host=options.host, port=options.port, log_level=options.log_level,
                          http=protocol(options.header_timeout, options.body_timeout, options.max_connections),
                          timeout_graceful_shutdown=5, ssl_keyfile=options.ssl_keyfile,
                          ssl_certfile=options.ssl_certfile)


def run(options: ServerOptions) -> int:
    """Load the model and serve until interrupted. Returns an exit status."""
    import uvicorn

    from pagedlm.batch.engine import LLMEngine
    from pagedlm.loading import load

    from .app import build_app
    from .loop import EngineLoop
    from .metrics import Metrics
    from .planner import Planner

    _setup_logging(options.log_level)
    device = resolve_device(options.device)
    dtype = resolve_dtype(options.dtype, device)
    check_tls(options.ssl_keyfile, options.ssl_certfile)
    sock = bind(options.host, options.port)
    log.info("loading %s on %s", options.model, device)
    if options.engine.tensor_parallel_size > 1:  # every rank reads only its slices
        from pagedlm.parallel import load_parallel

        model, tokenizer = load_parallel(options.model, device, dtype, options.quantization, options.engine)
    else:
        model, tokenizer = load(options.model, device, dtype, quantization=options.quantization)
    engine = LLMEngine(model, tokenizer, options.engine)
    started = time.perf_counter()  # llguidance's view of the tokenizer holds the GIL while it is built: now,
    engine.grammars.warm_up()  # not under the first constrained request, while other streams wait
    log.info("structured output ready (llguidance's tokenizer built in %.1f s)", time.perf_counter() - started)
    metrics = Metrics(model_name=options.model_names[0])
    lane = EngineLoop(engine, options.max_queue, metrics, options.max_prompts_per_request)
    planner = Planner(engine, list(options.model_names), default_seed=options.seed,
                      chat_template=options.chat_template)
    metrics.bind(engine, lambda: lane.depth)
    app = build_app(planner, lane, metrics, options)

    log.info("pagedlm serve, effective configuration:")
    for line in effective_config(options, device, dtype, engine):
        log.info("  %s", line)
    if options.api_key is None and options.host not in LOOPBACK:
        log.warning("listening on %s without --api-key: anyone who can reach it can use it",
                    options.host)
    config = uvicorn_config(app, options)
    try:
        uvicorn.Server(config).run(sockets=[sock])
    finally:
        lane.close()
        sock.close()
    return 0


__all__ = ["run"]
