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

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from pagedlm.options import OptionError

from .loop import EngineLoop, Job, QueueFull
from .metrics import Metrics, outcome_of
from .protocol import (
    APIError,
    ChatCompletion,
    ChatRequest,
    Completion,
    CompletionRequest,
    ErrorResponse,
    ModelCard,
    ModelList,
    parse,
)
from .responses import ChatShape, CompletionShape, Shape

if TYPE_CHECKING:
    from pagedlm.options import ServerOptions

    from .engine import Engine

log = logging.getLogger("pagedlm.server")

MAX_BODY_BYTES = 8 * 1024 * 1024
BODY_TIMEOUT_S = 30  # longest wait for the next piece of a request body
RETRY_AFTER_S = 1
ENDPOINTS = {"/v1/completions": "completions", "/v1/chat/completions": "chat"}


def _sse(payload: dict | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n"


class ClientGone(Exception):
    """The client closed the connection before its request was read: a
    cancelled request, not a server error."""


async def read_body(request: Request) -> bytes:
    """The request body, refused with 413 past ``MAX_BODY_BYTES`` without
    reading more than that, and with 408 when the client stops sending for
    ``BODY_TIMEOUT_S`` (a body shorter than its Content-Length)."""
    too_big = APIError(413, f"the request body exceeds {MAX_BODY_BYTES} bytes", code="body_too_large")
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > MAX_BODY_BYTES:
        raise too_big
    body = bytearray()
    chunks = request.stream().__aiter__()
    while True:
        try:
            chunk = await asyncio.wait_for(chunks.__anext__(), BODY_TIMEOUT_S)
        except StopAsyncIteration:
            return bytes(body)
        except ClientDisconnect:
            raise ClientGone() from None
        except asyncio.TimeoutError:
            raise APIError(408, f"the request body did not arrive within {BODY_TIMEOUT_S}s",
                           code="request_timeout") from None
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


def build_app(engine: "Engine", lane: EngineLoop, metrics: Metrics, options: "ServerOptions") -> FastAPI:
    app = FastAPI(title="pagedlm", docs_url=None, redoc_url=None, openapi_url="/openapi.json")
    started = int(time.time())

    async def require_key(request: Request) -> None:
        if options.api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(),
                                                                 options.api_key.encode()):
            raise APIError(401, "missing or wrong API key: send 'Authorization: Bearer KEY'",
                           code="invalid_api_key")

    api = APIRouter(dependencies=[Depends(require_key)])

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
    async def health() -> dict:
        return {"status": "ok", "model": engine.model_id}

    @api.get("/metrics")
    async def get_metrics() -> Response:
        return Response(metrics.render(), media_type=metrics.content_type)

    @api.get("/v1/models")
    async def models() -> dict:
        card = ModelCard(id=engine.model_id, created=started, max_model_len=engine.max_model_len)
        return ModelList(data=[card]).model_dump(mode="json")

    @api.post("/v1/completions", **_documented(CompletionRequest, Completion))
    async def completions(request: Request) -> Response:
        return await _generate(request, "completions", CompletionRequest, engine.plan_completion,
                               CompletionShape)

    @api.post("/v1/chat/completions", **_documented(ChatRequest, ChatCompletion))
    async def chat_completions(request: Request) -> Response:
        return await _generate(request, "chat", ChatRequest, engine.plan_chat, ChatShape)

    # -- the one generation path -------------------------------------------

    async def _generate(request: Request, endpoint: str, request_model, plan_of: Callable,
                        shape_cls: type[Shape]) -> Response:
        body = await read_body(request)
        # Parsing and tokenizing a large body takes a while: off the event loop.
        plan = await run_in_threadpool(lambda: plan_of(parse(request_model, body)))
        try:
            job = lane.submit(plan)
        except QueueFull as e:
            raise APIError(503, str(e), type="server_error", code="queue_full",
                           headers={"Retry-After": str(RETRY_AFTER_S)}) from None
        shape = shape_cls(plan, engine.tokenizer, engine.model_id)
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

    app.include_router(api)
    _add_request_schemas(app)
    return app


# -- /openapi.json ------------------------------------------------------------
# The generation routes read their bodies themselves (size limit, timeout,
# strict parsing off the event loop), so the request and response models are
# declared here for the schema.

ERRORS = {400: "bad input", 401: "missing or wrong API key", 404: "unknown model or route",
          408: "body too slow", 413: "body too large", 503: "queue full"}


def _documented(request_model, response_model) -> dict:
    body = {"$ref": f"#/components/schemas/{request_model.__name__}"}
    return {
        "openapi_extra": {"requestBody": {"required": True, "content": {"application/json": {"schema": body}}}},
        "responses": {
            200: {"model": response_model, "description": "the completion, or with stream: server-sent "
                  "events of chunks", "content": {"text/event-stream": {}}},
            **{status: {"model": ErrorResponse, "description": why} for status, why in ERRORS.items()},
        },
    }


def _add_request_schemas(app: FastAPI) -> None:
    from pydantic.json_schema import models_json_schema

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = FastAPI.openapi(app)
            _, defs = models_json_schema([(CompletionRequest, "validation"), (ChatRequest, "validation")],
                                         ref_template="#/components/schemas/{model}")
            schema.setdefault("components", {}).setdefault("schemas", {}).update(defs["$defs"])
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi
