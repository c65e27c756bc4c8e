"""OpenAI-shaped request and response models, and the error every refusal raises.

Requests are validated strictly (``"5"`` is not an integer, ``1`` is not a
boolean; ``1.0`` is one, as JSON Schema counts it): a wrong type is the
client's bug and gets a 400 naming the field. No field is silently ignored:
besides the fields declared here, a request may carry only the metadata of
``IGNORED`` (accepted, documented as ignored) and, with a value that asks for
nothing, the fields of ``REFUSED`` (OpenAI's or vLLM's, not implemented:
anything else in them is a 400 naming the field and why). Any other field is
refused as unknown, as OpenAI's own API does (vLLM logs and ignores it).
A field sent as null is a field not sent. Value ranges of the sampling
fields are checked by ``SamplingParams.validate``, the one place they live.
"""

from __future__ import annotations

import functools
from typing import Annotated, Any, Callable, ClassVar, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, model_serializer
from pydantic_core import PydanticCustomError

from pagedlm.options import SEED_MAX, SEED_MIN

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
        names.update(f.alias for f in cls.model_fields.values() if f.alias)  # errors name a field by its alias
        pending += cls.__subclasses__()
    return frozenset(names)


def parse(model: type["_Request"], body: bytes) -> Any:
    """The request in ``body``, or the `APIError` of its first problem."""
    try:
        request = model.model_validate_json(body)
    except ValidationError as e:
        raise validation_error(e) from None
    request.refuse_extras()
    return request


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


# ---------------------------------------------------------------------------
# Requests


def _integral(value: Any) -> Any:
    return int(value) if isinstance(value, float) and value.is_integer() else value


# An integer field: a JSON integer, or a number with no fractional part (1.0);
# never 1.5, "1" or true.
Int = Annotated[int, BeforeValidator(_integral)]


def _seed_range(value: int) -> int:
    if not SEED_MIN <= value <= SEED_MAX:  # (pydantic's own bound prints 2**64 - 1 as a float)
        raise PydanticCustomError("out_of_range", "Input should be an integer from -2**63 to 2**64 - 1")
    return value


Seed = Annotated[Int, AfterValidator(_seed_range)]


def _off(*noop: Any) -> Callable[[Any], bool]:
    """A REFUSED rule: the value asks for nothing when it is one of ``noop``
    (null always does)."""
    return lambda value: value in noop


# Metadata a request may carry; accepted and ignored (docs/server-config.md).
# (parallel_tool_calls: chat declares it; a completion has no tools to call.)
IGNORED = frozenset({"user", "metadata", "store", "service_tier", "parallel_tool_calls",
                     "prompt_cache_key", "safety_identifier"})

# Fields OpenAI or vLLM define and this server does not implement: each is
# accepted only with a value that asks for nothing, else refused with its reason.
REFUSED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "suffix": (_off(""), "suffix (fill-in-the-middle) is not supported"),
    "guided_decoding_backend": (_off("auto", "guidance"), "this server's one grammar engine is llguidance "
                                "(vLLM's \"guidance\")"),
    "guided_whitespace_pattern": (_off(), "JSON whitespace is fixed here: a space, or a newline and up to 20 "
                                  "spaces or tabs"),
    "grammar": (_off(), "send a grammar as guided_grammar or structured_outputs.grammar"),
    "json_schema": (_off(), "send a JSON schema as response_format or guided_json"),
    "tools": (_off([]), "tools are a /v1/chat/completions field"),  # chat declares them
    "tool_choice": (_off("none"), "tool_choice is a /v1/chat/completions field"),
    "functions": (_off([]), "functions is the deprecated form of tools: send tools"),
    "function_call": (_off("none"), "function_call is the deprecated form of tool_choice: send tool_choice"),
    "use_beam_search": (_off(False), "beam search is not supported"),
    "echo": (_off(False), "echo is a /v1/completions field; a chat cannot echo its prompt here"),
    "add_special_tokens": (_off(False), "add_special_tokens on a chat is not supported: the chat "
                           "template adds the special tokens"),
    "spaces_between_special_tokens": (_off(True), "special tokens are decoded as the tokenizer "
                                      "spells them; spaces_between_special_tokens: false is not supported"),
    "documents": (_off([]), "documents (retrieval templates) are not supported"),
    "priority": (_off(0), "priority scheduling is not supported: requests run in arrival order"),
    "return_tokens_as_token_ids": (_off(False), "return_tokens_as_token_ids is not supported"),
    "modalities": (_off(["text"]), "only text output is supported"),
    "audio": (_off(), "only text output is supported"),
    "prediction": (_off(), "predicted outputs are not supported"),
    "reasoning_effort": (_off(), "reasoning_effort is not supported"),
    "web_search_options": (_off(), "web search is not supported"),
}


class _Request(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow", json_schema_extra={"additionalProperties": False})
    _ignored: ClassVar[frozenset[str]] = frozenset()
    _refused: ClassVar[dict[str, tuple[Callable[[Any], bool], str]]] = {}

    def _checks_extras(self) -> bool:
        return True

    def refuse_extras(self, path: str = "") -> None:
        """Raise the `APIError` of the first field (here or in a nested object)
        that is neither declared, nor ignored metadata, nor a refused field
        that asks for nothing."""
        if self._checks_extras():
            for name, value in (self.model_extra or {}).items():
                where = f"{path}.{name}" if path else name
                if value is None or name in self._ignored:
                    continue
                rule = self._refused.get(name)
                if rule is None:
                    raise APIError(400, f"{where} is not a field this server knows: unknown fields are "
                                   f"refused, not ignored (docs/server-config.md lists the fields)",
                                   param=where, code="unknown_parameter")
                if not rule[0](value):
                    raise APIError(400, f"{where}: {rule[1]}", param=where, code="unsupported_parameter")
        for name in type(self).model_fields:
            value = getattr(self, name)
            where = f"{path}.{name}" if path else name
            for i, child in enumerate(value) if isinstance(value, list) else [(None, value)]:
                if isinstance(child, _Request):
                    child.refuse_extras(where if i is None else f"{where}[{i}]")


class StreamOptions(_Request):
    include_usage: bool | None = None


class JsonSchemaFormat(_Request):
    name: str
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None  # accepted: the output follows the schema either way (as vLLM)


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class _GenerationRequest(_Request):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    _ignored = IGNORED
    _refused = REFUSED

    model: str | None = None
    max_tokens: Int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: Int | None = None  # -1 (vLLM's "off") is accepted as 0
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: Seed | None = None
    stop: str | list[str] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    n: Int | None = None
    best_of: Int | None = None  # only equal to n: every sequence generated is returned
    # Keys are token ids written as strings (JSON object keys); biases are
    # added to the logits, clamped to [-100, 100].
    logit_bias: dict[str, float] | None = None
    # vLLM's sampling extensions
    min_tokens: Int | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[Int] | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    prompt_logprobs: Int | None = None
    truncate_prompt_tokens: Int | None = None  # keep the prompt's last k tokens; -1: max_model_len
    allowed_token_ids: list[Int] | None = None
    bad_words: list[str] | None = None
    # Structured output (at most one of these; planner.Planner._constraint)
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None  # vLLM's; checked by SamplingParams.validate
    guided_json: dict[str, Any] | str | None = None  # vLLM's older fields
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None


class CompletionRequest(_GenerationRequest):
    # A string, a list of strings (a batch), token ids, or a batch of token ids.
    prompt: str | list[str] | list[Int] | list[list[Int]]
    echo: bool | None = None
    logprobs: Int | None = None  # the top-k count (0..20)
    add_special_tokens: bool | None = None  # vLLM's: BOS per the model's rule (default true)


class ContentPart(_Request):
    type: str
    text: str | None = None

    def _checks_extras(self) -> bool:
        return self.type == "text"  # other parts are refused whole by the planner


# Fields an assistant message read back from an OpenAI response carries (null or empty there).
_ECHOED = {"function_call": (_off(), "function_call is the deprecated form of tool_calls: send tool_calls"),
           **{name: (_off([]), f"{name} is not supported") for name in ("refusal", "audio", "annotations")}}


class FunctionCall(_Request):
    name: str
    arguments: str  # JSON text (OpenAI's)


class MessageToolCall(_Request):
    """A call in an assistant message of the history."""

    id: str | None = None
    type: str | None = None  # "function"
    function: FunctionCall


class ChatMessage(_Request):
    _refused = _ECHOED

    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None  # passed to the chat template, as vLLM does
    tool_calls: list[MessageToolCall] | None = None  # an assistant's
    tool_call_id: str | None = None  # a tool's result answers this call


class FunctionDefinition(_Request):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # the JSON schema of an object
    strict: bool | None = None  # true: under "auto" too, calls follow the schema ("required" and named always do)


class ToolDefinition(_Request):
    type: str  # "function"
    function: FunctionDefinition


class FunctionName(_Request):
    name: str


class NamedToolChoice(_Request):
    type: str  # "function"
    function: FunctionName


class _ChatTemplateFields(_Request):
    """How messages become a prompt (chat, and /tokenize with messages)."""

    messages: list[ChatMessage]
    tools: list[ToolDefinition] | None = None  # rendered by the chat template
    add_generation_prompt: bool | None = None  # default true: open the assistant's turn
    continue_final_message: bool | None = None  # end the prompt inside the last message
    chat_template: str | None = None  # a jinja2 template instead of the model's
    chat_template_kwargs: dict[str, Any] | None = None  # further template variables


class ChatRequest(_GenerationRequest, _ChatTemplateFields):
    max_completion_tokens: Int | None = None
    logprobs: bool | None = None
    top_logprobs: Int | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None  # false: at most one call (the first), as vLLM


class TokenizeCompletionRequest(_Request):
    model: str | None = None
    prompt: str
    add_special_tokens: bool | None = None  # default true


class TokenizeChatRequest(_ChatTemplateFields):
    _refused = {"add_special_tokens": REFUSED["add_special_tokens"]}

    model: str | None = None


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[Int]


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


class PromptLogprob(BaseModel):
    """vLLM's shape of one token's logprob in ``prompt_logprobs``."""

    logprob: float
    rank: int  # among the whole vocabulary: 1 = the most likely
    decoded_token: str


# One entry per prompt token, keyed by token id: the token itself and the top k;
# the first is null (nothing predicts it).
PromptLogprobs = list[dict[str, PromptLogprob] | None]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length", "error"] | None = None  # error: the grammar dead-ended
    stop_reason: int | str | None = None  # vLLM's: the stop token id or string that ended it
    prompt_logprobs: PromptLogprobs | None = None


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


class FunctionCallOut(BaseModel):
    name: str
    arguments: str  # JSON text of an object


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class ToolCallDelta(ToolCallOut):
    index: int  # the call's place among the choice's calls


ChatFinish = Literal["stop", "length", "tool_calls", "error"]  # error: the grammar dead-ended


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None  # None: only tool calls
    tool_calls: list[ToolCallOut] | None = None

    @model_serializer(mode="wrap")
    def _calls_only_when_made(self, handler) -> dict[str, Any]:
        data = handler(self)
        if data["tool_calls"] is None:
            del data["tool_calls"]
        return data


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: ChatFinish | None = None
    stop_reason: int | str | None = None


class ChatCompletion(_WithExtension):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: PromptLogprobs | None = None  # vLLM's: of the rendered chat prompt
    pagedlm: PagedlmInfo | None = None


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None

    @model_serializer(mode="wrap")
    def _present_fields_only(self, handler) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: ChatFinish | None = None
    stop_reason: int | str | None = None


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


class TokenizeResponse(BaseModel):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeResponse(BaseModel):
    prompt: str


class VersionResponse(BaseModel):
    version: str
