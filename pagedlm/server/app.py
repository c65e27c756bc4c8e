"""The FastAPI app: routes, authentication, body limits, errors, streaming.

Both generation endpoints run one path (`_generate`): parse the body into
the endpoint's pydantic request, let the planner check and tokenize it into a
`Plan` (every bad input is an `APIError` here, before anything queues),
hand it to the engine loop, then answer whole or as server-sent events.
Every error leaves as OpenAI's ``{"error": {...}}`` body, never a traceback.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
from typing import TYPE_CHECKING, AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.middleware.cors import CORSMiddleware
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from pagedlm import __version__
from pagedlm.options import OptionError, ServerOptions

from .loop import EngineLoop, Job, QueueFull
from .metrics import Metrics, outcome_of
from .protocol import (
    APIError,
    ChatCompletion,
    ChatRequest,
    Completion,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorResponse,
    ModelCard,
    ModelList,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
    VersionResponse,
    parse,
)
from .responses import ChatShape, CompletionShape, Shape

if TYPE_CHECKING:
    from .planner import Planner

log = logging.getLogger("pagedlm.server")

MAX_BODY_BYTES = 8 * 1024 * 1024
BODY_TIMEOUT_S = ServerOptions.body_timeout  # --body-timeout's default; `run` sets app.state.body_timeout_s
RETRY_AFTER_S = 1
ENDPOINTS = {"/v1/completions": "completions", "/v1/chat/completions": "chat"}
PUBLIC = frozenset({"/health", "/ping", "/version", "/openapi.json"})  # no API key needed


def _sse(payload: dict | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n"


class ClientGone(Exception):
    """The client closed the connection before its request was read: a
    cancelled request, not a server error."""


async def read_body(request: Request) -> bytes:
    """The request body, refused with 413 past ``MAX_BODY_BYTES`` without
    reading more than that, and with 408 (and the connection closed) when
    the whole body has not arrived within ``--body-timeout`` seconds of the
    first read (``app.state.body_timeout_s``; a deadline for the body, not
    per piece, so a trickle cannot stretch it)."""
    too_big = APIError(413, f"the request body exceeds {MAX_BODY_BYTES} bytes", code="body_too_large")
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > MAX_BODY_BYTES:
        raise too_big
    timeout_s = getattr(request.app.state, "body_timeout_s", BODY_TIMEOUT_S)
    deadline = asyncio.get_running_loop().time() + timeout_s
    body = bytearray()
    chunks = request.stream().__aiter__()
    while True:
        try:
            chunk = await asyncio.wait_for(chunks.__anext__(), deadline - asyncio.get_running_loop().time())
        except StopAsyncIteration:
            return bytes(body)
        except ClientDisconnect:
            raise ClientGone() from None
        except asyncio.TimeoutError:
            raise APIError(408, f"the request body did not arrive within {timeout_s:g}s (--body-timeout)",
                           code="request_timeout", headers={"Connection": "close"}) from None
        body += chunk
        if len(body) > MAX_BODY_BYTES:
            raise too_big


def generation_error(e: Exception) -> APIError:
    """What a failure during generation tells the client: a request the
    engine refused (e.g. more KV than the budget can ever hold) is the
    client's 400; anything else is a 500, logged."""
    if isinstance(e, OptionError):
        return APIError(400, str(e), code="invalid_request")
    log.error("generation failed", exc_info=e)
    return APIError(500, f"generation failed: {type(e).__name__}: {e}", type="server_error")


class RequireKey:
    """ASGI middleware: every route but ``PUBLIC`` needs ``Authorization:
    Bearer KEY``. It runs before routing, so a protected path answers 401
    whatever the method (not 405, which would tell a stranger what exists)."""

    def __init__(self, app, api_key: str, metrics: Metrics) -> None:
        self.app, self.key, self.metrics = app, api_key.encode(), metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"] not in PUBLIC and not self._authorized(scope):
            err = APIError(401, "missing or wrong API key: send 'Authorization: Bearer KEY'",
                           code="invalid_api_key")
            self.metrics.record(ENDPOINTS.get(scope["path"], "other"), outcome_of(err.status))
            await JSONResponse(err.body(), status_code=err.status)(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def _authorized(self, scope) -> bool:
        header = dict(scope["headers"]).get(b"authorization", b"")
        scheme, _, token = header.partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.key)


def build_app(planner: "Planner", lane: EngineLoop, metrics: Metrics, options: "ServerOptions") -> FastAPI:
    app = FastAPI(title="pagedlm", docs_url=None, redoc_url=None, openapi_url="/openapi.json")
    started = int(time.time())
    # Added last, so outermost: a preflight is answered, and every answer (a
    # 401 too) carries the CORS headers a browser needs to read it.
    if options.api_key is not None:
        app.add_middleware(RequireKey, api_key=options.api_key, metrics=metrics)
    if options.allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(options.allowed_origins),
                           allow_methods=list(options.allowed_methods),
                           allow_headers=list(options.allowed_headers))

    # -- errors -----------------------------------------------------------

    def error_response(request: Request, err: APIError) -> JSONResponse:
        metrics.record(ENDPOINTS.get(request.url.path, "other"), outcome_of(err.status))
        return JSONResponse(err.body(), status_code=err.status, headers=err.headers)

    @app.exception_handler(APIError)
    async def on_api_error(request: Request, err: APIError) -> JSONResponse:
        return error_response(request, err)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, err: StarletteHTTPException) -> JSONResponse:
        message = {404: f"no route {request.method} {request.url.path}",
                   405: f"method {request.method} is not allowed on {request.url.path}"}
        return error_response(request, APIError(
            err.status_code, message.get(err.status_code, str(err.detail)),
            code="not_found" if err.status_code == 404 else None, headers=dict(err.headers or {})))

    @app.exception_handler(ClientGone)
    async def on_client_gone(request: Request, err: ClientGone) -> Response:
        log.info("%s %s: the client left before sending its whole body", request.method,
                 request.url.path)
        metrics.record(ENDPOINTS.get(request.url.path, "other"), "cancelled")
        return Response(status_code=499)  # nobody reads it

    @app.exception_handler(Exception)
    async def on_unexpected(request: Request, err: Exception) -> JSONResponse:
        log.exception("unexpected error on %s %s", request.method, request.url.path)
        return error_response(request, APIError(500, f"internal error: {type(err).__name__}",
                                                type="server_error"))

    # -- routes -----------------------------------------------------------

    @app.get("/health")
    @app.head("/health")  # load balancers probe with HEAD
    async def health() -> dict:
        return {"status": "ok", "model": planner.model_id}

    @app.get("/ping")
    @app.post("/ping")  # vLLM's (SageMaker's) probe
    async def ping() -> dict:
        return await health()

    @app.get("/version", response_model=VersionResponse)
    async def version() -> dict:
        return {"version": __version__}

    @app.get("/metrics", response_class=PlainTextResponse,
             responses={200: {"description": "Prometheus text exposition format",
                              "content": {"text/plain": {"schema": {"type": "string"}}}}})
    async def get_metrics() -> Response:
        return Response(metrics.render(), media_type=metrics.content_type)

    def card(model_id: str) -> ModelCard:
        return ModelCard(id=model_id, created=started, max_model_len=planner.max_model_len)

    @app.get("/v1/models", response_model=ModelList)
    async def models() -> dict:
        return ModelList(data=[card(name) for name in planner.model_ids]).model_dump(mode="json")

    @app.get("/v1/models/{model_id:path}", response_model=ModelCard, responses={404: {"model": ErrorResponse}})
    async def model(model_id: str) -> dict:
        return card(planner.check_model(model_id)).model_dump(mode="json")

    @app.post("/tokenize", **_documented((TokenizeCompletionRequest, TokenizeChatRequest), TokenizeResponse))
    async def tokenize(request: Request) -> dict:
        body = await read_body(request)

        def run() -> dict:
            req = parse(TokenizeChatRequest if _has_key(body, "messages") else TokenizeCompletionRequest, body)
            planner.check_model(req.model)
            if isinstance(req, TokenizeChatRequest):
                ids = planner.chat_prompt(req)
            else:
                ids = planner.tokenize_text(req.prompt, req.add_special_tokens is not False)
            return TokenizeResponse(tokens=ids, count=len(ids), max_model_len=planner.max_model_len).model_dump()

        return await run_in_threadpool(run)

    @app.post("/detokenize", **_documented(DetokenizeRequest, DetokenizeResponse))
    async def detokenize(request: Request) -> dict:
        req = parse(DetokenizeRequest, await read_body(request))
        planner.check_model(req.model)
        return DetokenizeResponse(prompt=planner.detokenize(req.tokens)).model_dump()

    @app.post("/v1/completions", **_documented(CompletionRequest, Completion))
    async def completions(request: Request) -> Response:
        return await _generate(request, "completions", CompletionRequest, planner.plan_completion,
                               CompletionShape)

    @app.post("/v1/chat/completions", **_documented(ChatRequest, ChatCompletion))
    async def chat_completions(request: Request) -> Response:
        return await _generate(request, "chat", ChatRequest, planner.plan_chat, ChatShape)

    # -- the one generation path -------------------------------------------

    async def _generate(request: Request, endpoint: str, request_model, plan_of: Callable,
                        shape_cls: type[Shape]) -> Response:
        body = await read_body(request)
        # Parsing and tokenizing a large body takes a while: off the event loop.
        plan = await run_in_threadpool(lambda: plan_of(parse(request_model, body)))
        shape = shape_cls(plan, planner.tokenizer, plan.model)
        try:
            job = lane.submit(plan, shape.id)
        except QueueFull as e:
            raise APIError(503, str(e), type="server_error", code="queue_full",
                           headers={"Retry-After": str(RETRY_AFTER_S)}) from None
        headers = {"x-pagedlm-paged-kv": "1" if plan.paged else "0"}
        if plan.stream:
            return StreamingResponse(_stream(request, endpoint, job, shape), headers=headers,
                                     media_type="text/event-stream")
        try:
            async for index, resp in job.events(request.is_disconnected):
                shape.add(index, resp)
        except Exception as e:
            raise generation_error(e) from None
        if not shape.finished:  # the client went away; nobody reads this
            metrics.record(endpoint, "cancelled")
            return Response(status_code=499)
        metrics.record(endpoint, "ok")
        return JSONResponse(shape.response(), headers=headers)

    async def _stream(request: Request, endpoint: str, job: Job, shape: Shape) -> AsyncIterator[str]:
        # A client that disconnects cancels this generator's task (or is seen
        # by polling); either way job.events() cancels the job on the way out.
        outcome = "cancelled"
        try:
            async for index, resp in job.events(request.is_disconnected):
                yield _sse(shape.chunk(index, resp))
            if shape.finished:
                if shape.plan.include_usage:
                    yield _sse(shape.usage_chunk())
                yield _sse("[DONE]")
                outcome = "ok"
        except Exception as e:
            err = generation_error(e)
            outcome = outcome_of(err.status)
            yield _sse(err.body())
            yield _sse("[DONE]")
        finally:
            metrics.record(endpoint, outcome)

    _add_request_schemas(app)
    return app


def _has_key(body: bytes, key: str) -> bool:
    """Whether ``body`` is a JSON object with ``key`` not null (a body that
    is not JSON is left for `parse` to refuse)."""
    try:
        data = json.loads(body)
    except ValueError:
        return False
    return isinstance(data, dict) and data.get(key) is not None


# -- /openapi.json ------------------------------------------------------------
# The generation routes read their bodies themselves (size limit, timeout,
# strict parsing off the event loop), so the request and response models are
# declared here for the schema.

ERRORS = {400: "bad input", 401: "missing or wrong API key", 404: "unknown model or route",
          408: "body too slow", 413: "body too large", 503: "queue full"}


REQUEST_MODELS = (CompletionRequest, ChatRequest, TokenizeCompletionRequest, TokenizeChatRequest,
                  DetokenizeRequest)


def _documented(request_models, response_model) -> dict:
    """The route's request body (one model, or a tuple: any of them) and answers."""
    models = request_models if isinstance(request_models, tuple) else (request_models,)
    refs = [{"$ref": f"#/components/schemas/{m.__name__}"} for m in models]
    body = refs[0] if len(refs) == 1 else {"anyOf": refs}
    ok = {"model": response_model, "description": "the answer"}
    if response_model in (Completion, ChatCompletion):
        ok = {**ok, "description": "the completion, or with stream: server-sent events of chunks",
              "content": {"text/event-stream": {}}}
    return {
        "openapi_extra": {"requestBody": {"required": True, "content": {"application/json": {"schema": body}}}},
        "responses": {
            200: ok,
            **{status: {"model": ErrorResponse, "description": why} for status, why in ERRORS.items()},
        },
    }


def _add_request_schemas(app: FastAPI) -> None:
    from pydantic.json_schema import models_json_schema

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = FastAPI.openapi(app)
            _, defs = models_json_schema([(m, "validation") for m in REQUEST_MODELS],
                                         ref_template="#/components/schemas/{model}")
            schema.setdefault("components", {}).setdefault("schemas", {}).update(defs["$defs"])
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi
