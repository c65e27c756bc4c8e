"""OpenAI-shaped request and response models, and the error every refusal raises.

Requests are validated strictly (``"5"`` is not an integer, ``1`` is not a
boolean): a wrong type is the client's bug and gets a 400 naming the field.
Unknown fields are ignored, as OpenAI-compatible clients send extras. Value
ranges of the sampling fields are checked by ``GenerateOptions.validate``,
the one place they live.
"""

from __future__ import annotations

import functools
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_serializer

# ---------------------------------------------------------------------------
# Errors


class APIError(Exception):
    """A refusal with an HTTP status and OpenAI's error body."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message = status, message
        self.type, self.param, self.code = type, param, code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return ErrorResponse(
            error=ErrorDetail(message=self.message, type=self.type, param=self.param, code=self.code)
        ).model_dump(mode="json")


def validation_error(e: ValidationError) -> APIError:
    """The first problem pydantic found, as a 400 naming the field."""
    first = e.errors(include_url=False)[0]
    if first["type"] == "json_invalid":
        return APIError(400, f"the request body is not valid JSON: {first['msg']}", code="invalid_json")
    param = ""
    for part in first["loc"]:
        # Union branches show up in loc as type names ("str", "list[int]"): keep
        # only field names and list indexes.
        if isinstance(part, int):
            param += f"[{part}]"
        elif part in _field_names():
            param += f".{part}" if param else part
    param = param or None
    where = f"{param}: " if param else ""
    return APIError(400, f"{where}{first['msg']}", param=param, code="invalid_type"
                    if first["type"].endswith("_type") else "invalid_value")


@functools.cache
def _field_names() -> frozenset[str]:
    names: set[str] = set()
    pending: list[type[BaseModel]] = [_Request]
    while pending:
        cls = pending.pop()
        names.update(cls.model_fields)
        pending += cls.__subclasses__()
    return frozenset(names)


def parse(model: type[BaseModel], body: bytes) -> Any:
    try:
        return model.model_validate_json(body)
    except ValidationError as e:
        raise validation_error(e) from None


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


# ---------------------------------------------------------------------------
# Requests


class _Request(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Request):
    include_usage: bool | None = None


class _GenerationRequest(_Request):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # -1 (vLLM's "off") is accepted as 0
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None  # accepted only as 0: not implemented
    frequency_penalty: float | None = None  # accepted only as 0: not implemented
    seed: int | None = Field(default=None, ge=-(2**63), lt=2**64)
    stop: str | list[str] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    n: int | None = None
    user: str | None = None


class CompletionRequest(_GenerationRequest):
    # A string, a list of strings (a batch), token ids, or a batch of token ids.
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool | None = None
    logprobs: int | None = None  # the top-k count (0..20)


class ContentPart(_Request):
    type: str
    text: str | None = None


class ChatMessage(_Request):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None


class ChatRequest(_GenerationRequest):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None


# ---------------------------------------------------------------------------
# Responses


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: dict[str, int] | None = None  # {"cached_tokens": n}


class PagedlmInfo(BaseModel):
    """pagedlm's extension: how the request ran."""

    paged_kv: bool
    cached_tokens: int


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None = None


class _WithExtension(BaseModel):
    """Leaves out pagedlm's extension field where it has nothing to say."""

    @model_serializer(mode="wrap")
    def _omit_empty_extension(self, handler) -> dict[str, Any]:
        data = handler(self)
        if data.get("pagedlm", 0) is None:
            del data["pagedlm"]
        return data


class Completion(_WithExtension):
    """A whole completion, or (streaming) one chunk of it: OpenAI uses one shape."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    pagedlm: PagedlmInfo | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob]


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None = None


class ChatCompletion(_WithExtension):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    pagedlm: PagedlmInfo | None = None


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None

    @model_serializer
    def _present_fields_only(self) -> dict[str, Any]:
        return {k: v for k, v in (("role", self.role), ("content", self.content)) if v is not None}


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "pagedlm"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
