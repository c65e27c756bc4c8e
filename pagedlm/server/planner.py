"""The server's request planning: check and tokenize a request into a `Plan`
(one prompt and `SamplingParams` per choice) before it queues, so that bad
input is refused with a 4xx and never reaches the engine. Running the plan
is the engine loop's business (``loop.EngineLoop``).

Chat and completions share everything below: each endpoint only says how its
request becomes prompts and options (``plan_chat`` / ``plan_completion``).
A request constrains its output by at most one field (`Planner._constraint`):
``response_format``, ``structured_outputs``, a ``guided_*`` field, or (chat)
a ``tool_choice`` that forces a call (`tools.choose`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pagedlm.options import OptionError
from pagedlm.params import SamplingParams, check_structured_outputs, check_token_ids
from pagedlm.tokenizer import compile_chat_template, content_text

from .protocol import APIError, ChatRequest, CompletionRequest, NamedToolChoice, _ChatTemplateFields, _GenerationRequest
from .tools import auto_constraint, check_name, check_tools, choose, history_calls

if TYPE_CHECKING:
    from pagedlm.batch.engine import LLMEngine
    from pagedlm.structured import Constraint

log = logging.getLogger("pagedlm.server")

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat: the rest of the context
MAX_STOP_STRINGS = 16
# Request fields that are `SamplingParams` fields of the same name and meaning.
SAMPLING_FIELDS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                   "frequency_penalty", "seed", "min_tokens", "ignore_eos", "include_stop_str_in_output",
                   "skip_special_tokens", "bad_words", "truncate_prompt_tokens")
TOKEN_ID_FIELDS = ("stop_token_ids", "allowed_token_ids")  # lists of ids, checked against the vocabulary
MAX_N = 16
# encode_chat's own arguments, which chat_template_kwargs cannot set
TEMPLATE_ARGUMENTS = frozenset({"messages", "add_generation_prompt", "continue_final_message", "chat_template",
                                "tools"})
CHAT_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}
# vLLM's older request fields -> the `Constraint` kind each one sets
GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
_TOKEN_ID = re.compile(r"-?[0-9]+")


@dataclass
class Plan:
    """A checked, tokenized request: one prompt (and options) per choice."""

    prompts: list[list[int]]  # one per choice: a prompt repeated n times for n > 1
    options: list[SamplingParams]
    stream: bool
    include_usage: bool
    paged: bool
    echo_texts: list[str] | None = None  # completions with echo: each choice's prompt text
    n: int = 1  # choices per prompt (usage counts each prompt once)
    model: str = ""  # the served name the response reports
    echo_logprobs: int | None = None  # completions with echo + logprobs: top k of the echoed prompt
    prompt_logprobs: int | None = None  # vLLM's prompt_logprobs field: top k, answered in its shape
    parse_tool_calls: bool = False  # chat with tools: the output's <tool_call> blocks become tool_calls
    parallel_tool_calls: bool = True  # false: a choice keeps only its first call
    forced_tool: str | None = None  # tool_choice "required" ("") or the named function: a call cut short is one


class Planner:
    """Checks, tokenizes and plans requests for an `LLMEngine`: it reads the
    engine's limits (context length, vocabulary, whether a request could ever
    fit its KV budget) and runs nothing.

    ``model_ids``: the names clients may send as ``model`` (the first is
    reported by default); ``default_seed`` seeds requests that give none;
    ``chat_template`` replaces the model's (a request's own wins)."""

    def __init__(self, engine: "LLMEngine", model_ids: str | list[str], *, default_seed: int | None = None,
                 chat_template: str | None = None) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.model_ids = [model_ids] if isinstance(model_ids, str) else list(model_ids)
        self.model_id = self.model_ids[0]
        self.default_seed, self.chat_template = default_seed, chat_template
        self.max_model_len = engine.max_model_len
        self.paged = engine.paged_kv
        self.vocab_size = engine.vocab_size

    # -- planning (event loop) -------------------------------------------

    def plan_completion(self, req: CompletionRequest) -> Plan:
        self._check_common(req)
        prompts, texts = self._completion_prompts(req.prompt, req.add_special_tokens is not False)
        echo_logprobs = req.logprobs if req.echo else None
        if req.echo and req.max_tokens == 0:  # score the prompt only (lm-eval, legacy API)
            echo_logprobs = req.logprobs or 0
        options = self._options(req, req.logprobs, echo_logprobs, self._constraint(req))
        return self._plan(req, prompts, options, req.max_tokens, "max_tokens",
                          COMPLETION_DEFAULT_MAX_TOKENS, texts if req.echo else None, echo_logprobs)

    def plan_chat(self, req: ChatRequest) -> Plan:
        self._check_common(req)
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        parallel = req.parallel_tool_calls is not False
        if req.tool_choice not in (None, "none") and req.tools is None:  # (vLLM's refusal; OpenAI's too)
            raise APIError(400, "tool_choice is only allowed when the request has tools", param="tool_choice")
        tools = check_tools(req.tools)
        parse_calls, forced = choose(tools, req.tool_choice, parallel)
        constraint = self._constraint(req, ("tool_choice", forced))
        if parse_calls and forced is None:  # "auto": strict functions, or an answer beside calls
            constraint = auto_constraint(tools, constraint, parallel)
        options = self._options(req, logprobs, None, constraint)
        prompt = self.chat_prompt(req)
        if req.max_completion_tokens is not None:
            max_tokens, param = req.max_completion_tokens, "max_completion_tokens"
        else:
            max_tokens, param = req.max_tokens, "max_tokens"
        plan = self._plan(req, [prompt], options, max_tokens, param, None, None, None,
                          rename={"logprobs": "top_logprobs"})
        plan.parse_tool_calls, plan.parallel_tool_calls = parse_calls, parallel
        if forced is not None:
            plan.forced_tool = req.tool_choice.function.name if isinstance(req.tool_choice, NamedToolChoice) else ""
        return plan

    def check_model(self, model: str | None) -> str:
        """The served name a request reports: its own ``model`` (404 when this
        server does not serve it), else the first."""
        if model is not None and model not in self.model_ids:
            raise APIError(404, f"the model {model!r} does not exist; this server serves "
                           f"{', '.join(map(repr, self.model_ids))}", param="model", code="model_not_found")
        return model or self.model_id

    def _check_common(self, req: _GenerationRequest) -> None:
        self.check_model(req.model)
        if req.n is not None and not 1 <= req.n <= MAX_N:
            raise APIError(400, f"n must be in [1, {MAX_N}] (got {req.n})", param="n")
        if req.best_of is not None and req.best_of != (req.n or 1):
            raise APIError(400, f"best_of must equal n (got best_of {req.best_of}, n {req.n or 1}): every "
                           "sequence generated is returned, none is ranked away", param="best_of")
        if req.prompt_logprobs is not None and req.stream:
            raise APIError(400, "prompt_logprobs cannot be streamed: ask without stream",
                           param="prompt_logprobs")
        if req.stream_options is not None and not req.stream:  # (as vLLM and OpenAI)
            raise APIError(400, "stream_options is only for a streamed response (stream: true)",
                           param="stream_options")

    def _constraint(self, req: _GenerationRequest,
                    tool_call: tuple[str, "Constraint | None"] = ("", None)) -> "Constraint | None":
        """The one validated constraint the request asks for, or None; a 400
        naming the field: a constraint that does not validate, a json_schema
        response format without its schema, two fields that constrain at once.
        ``tool_call``: (its field, the constraint a tool_choice forces)."""
        given: list[tuple[str, Constraint | dict]] = []  # (the field, what it asks)
        fmt = req.response_format
        if fmt is not None and fmt.type != "json_schema" and fmt.json_schema is not None:
            raise APIError(400, f'response_format.json_schema is read only with "type": "json_schema" (got '
                           f'{fmt.type!r})', param="response_format.json_schema")
        if fmt is not None and fmt.json_schema is not None:
            check_name(fmt.json_schema.name, "response_format.json_schema.name")
        if fmt is not None and fmt.type == "json_object":
            given.append(("response_format", {"json_object": True}))
        elif fmt is not None and fmt.type == "json_schema":
            if fmt.json_schema is None:
                raise APIError(400, 'response_format of type "json_schema" needs a json_schema',
                               param="response_format.json_schema")
            if fmt.json_schema.schema_ is None:
                raise APIError(400, "response_format.json_schema needs a schema",
                               param="response_format.json_schema.schema")
            given.append(("response_format.json_schema.schema", {"json": fmt.json_schema.schema_}))
        if req.structured_outputs is not None:
            given.append(("structured_outputs", req.structured_outputs))
        given += [(name, {kind: getattr(req, name)}) for name, kind in GUIDED.items() if getattr(req, name) is not None]
        if tool_call[1] is not None:
            given.append(tool_call)
        if len(given) > 1:  # (response_format, the one field with a dotted param, comes first)
            (first, _), (second, _) = given[:2]
            raise APIError(400, f"{second} and {first.split('.')[0]} both constrain the output: send one",
                           param=second)
        if not given:
            return None
        param, asked = given[0]
        if param == "tool_choice":  # tools.choose validated it
            return asked
        try:
            return check_structured_outputs(asked)
        except OptionError as e:  # "structured_outputs[.<kind>] ...": name the request's field
            message = str(e)
            if param == "structured_outputs":
                named = message.split()[0]
                raise APIError(400, message, param=named) from None
            for prefix in [f"structured_outputs.{kind} " for kind in ("json", "regex", "choice", "grammar")]:
                if message.startswith(prefix):
                    raise APIError(400, f"{param} {message[len(prefix):]}", param=param) from None
            raise APIError(400, f"{param}: {message}", param=param) from None

    def _options(self, req: _GenerationRequest, logprobs: int | None,
                 echo_logprobs: int | None, constraint: "Constraint | None") -> SamplingParams:
        """The request's sampling options (validated per prompt in `_plan`);
        unset fields keep the engine's defaults."""
        stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        if len(stop) > MAX_STOP_STRINGS:
            raise APIError(400, f"stop takes at most {MAX_STOP_STRINGS} strings", param="stop")
        given = {name: getattr(req, name) for name in SAMPLING_FIELDS if getattr(req, name) is not None}
        if given.get("top_k") == -1:
            given["top_k"] = 0
        keep = given.get("truncate_prompt_tokens")
        if keep == -1:  # vLLM's: as many as the context holds
            given["truncate_prompt_tokens"] = self.max_model_len
        elif keep is not None and keep < 1:  # the planner truncates before SamplingParams validates
            raise APIError(400, f"truncate_prompt_tokens must be >= 1, or -1 for the context length "
                           f"(got {keep})", param="truncate_prompt_tokens")
        if "seed" not in given and self.default_seed is not None:
            given["seed"] = self.default_seed
        for name in TOKEN_ID_FIELDS:
            ids = getattr(req, name)
            if ids is not None:
                self._check_ids(ids, name)
                given[name] = list(ids)
        if req.logit_bias is not None:
            given["logit_bias"] = self._logit_bias(req.logit_bias)
        # One prompt scoring serves both asks: echo's (the top k of the echoed
        # logprobs) and vLLM's prompt_logprobs field; each reads its own k.
        asked = [k for k in (echo_logprobs, req.prompt_logprobs) if k is not None]
        return SamplingParams(
            max_tokens=1,  # resolved per prompt in _plan
            stop=stop, logprobs=logprobs, prompt_logprobs=max(asked) if asked else None,
            structured_outputs=constraint, **given,
        )

    def _check_ids(self, ids: list[int], param: str, what: str | None = None) -> None:
        try:
            check_token_ids(ids, self.vocab_size, what or param)
        except OptionError as e:
            raise APIError(400, str(e), param=param) from None

    def _logit_bias(self, bias: dict[str, float]) -> dict[int, float]:
        """OpenAI's logit_bias (token ids as string keys, as JSON spells them)
        keyed by ids; `SamplingParams.validate` checks and clamps the biases."""
        for key in bias:
            if not _TOKEN_ID.fullmatch(key):
                raise APIError(400, f"logit_bias keys are token ids, integers written as strings "
                               f"(got {key!r})", param="logit_bias")
        ids = {int(key): value for key, value in bias.items()}
        self._check_ids(list(ids), "logit_bias")
        return ids

    @staticmethod
    def _validated(options: SamplingParams, rename: dict[str, str]) -> SamplingParams:
        try:
            return options.validate()
        except OptionError as e:  # "<field> must be ...": name the request's field
            message = str(e)
            field_name = message.split()[0]
            param = rename.get(field_name, field_name)
            raise APIError(400, param + message[len(field_name):], param=param) from None

    def _plan(self, req, prompts, options, max_tokens, max_param, default_max, echo_texts,
              echo_logprobs, rename: dict[str, str] | None = None) -> Plan:
        """Per prompt: truncate, check it fits, resolve max_tokens, validate;
        ``rename``: request fields that `SamplingParams` calls otherwise."""
        scoring = max_tokens == 0 and echo_texts is not None
        if max_tokens is not None and max_tokens < 1 and not scoring:
            raise APIError(400, f"{max_param} must be >= 1 (got {max_tokens})"
                           + ("; 0 only with echo" if isinstance(req, CompletionRequest) else ""), param=max_param)
        limit = self.max_model_len
        n = req.n or 1
        keep = options.truncate_prompt_tokens
        choices, per_choice = [], []
        for p, ids in enumerate(prompts):
            if keep is not None and len(ids) > keep:  # vLLM's truncation: the last k tokens
                ids = ids[-keep:]
                if echo_texts is not None:
                    echo_texts[p] = self.tokenizer.decode(ids)  # as a prompt of token ids echoes
            room = limit - len(ids)
            if room < (0 if scoring else 1):
                raise APIError(400, f"the prompt has {len(ids)} tokens; this model's context length "
                               f"is {limit} tokens, which leaves no room to generate",
                               param="messages" if isinstance(req, ChatRequest) else "prompt",
                               code="context_length_exceeded")
            if max_tokens is not None and max_tokens > room:
                raise APIError(400, f"the prompt ({len(ids)} tokens) plus {max_param} ({max_tokens}) "
                               f"exceeds this model's context length of {limit} tokens",
                               param=max_param, code="context_length_exceeded")
            budget = max_tokens if max_tokens is not None else min(room, default_max or room)
            params = self._validated(dataclasses.replace(options, max_tokens=budget, n=n), rename or {})
            try:
                self.engine.check_fits(len(ids), budget)
            except OptionError as e:
                raise APIError(400, str(e), param=max_param, code="kv_budget_exceeded") from None
            # OpenAI's choice order: prompt by prompt, n each
            for one in params.continuations():
                choices.append(ids)
                per_choice.append(one)
        stream = bool(req.stream)
        include_usage = stream and bool(req.stream_options and req.stream_options.include_usage)
        echo = [t for t in echo_texts for _ in range(n)] if echo_texts is not None else None
        return Plan(choices, per_choice, stream, include_usage, self.paged, echo, n=n,
                    model=self.check_model(req.model), echo_logprobs=echo_logprobs,
                    prompt_logprobs=req.prompt_logprobs)

    def _completion_prompts(self, prompt, add_special_tokens: bool = True) -> tuple[list[list[int]], list[str]]:
        """Token ids and text of each prompt in a completion request."""
        batch = prompt if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int) \
            else [prompt]
        params = ["prompt" if len(batch) == 1 else f"prompt[{i}]" for i in range(len(batch))]
        for p, param in zip(batch, params):  # every one, before tokenizing any
            if isinstance(p, str):
                self._check_text_length(len(p), param)
        ids_list, texts = [], []
        for p, param in zip(batch, params):
            if isinstance(p, str):
                ids = self.tokenizer.encode(p, add_special_tokens=add_special_tokens) if p else []
                text = p
            else:
                ids = list(p)
                self._check_ids(ids, "prompt", param)
                text = self.tokenizer.decode(ids) if ids else ""
            if not ids:
                raise APIError(400, f"{param} is empty", param="prompt")
            ids_list.append(ids)
            texts.append(text)
        return ids_list, texts

    def tokenize_text(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self._check_text_length(len(text), "prompt")
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens) if text else []

    def detokenize(self, ids: list[int]) -> str:
        self._check_ids(ids, "tokens")
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def _check_text_length(self, chars: int, param: str) -> None:
        """Refuse text that cannot fit the context, before tokenizing it: no
        token covers more than ``max_token_chars`` characters."""
        if chars > self.max_model_len * self.tokenizer.max_token_chars:
            raise APIError(400, f"{param} is {chars} characters, more than this model's context "
                           f"length of {self.max_model_len} tokens can hold",
                           param="messages" if param == "messages" else "prompt",
                           code="context_length_exceeded")

    def chat_prompt(self, req: _ChatTemplateFields) -> list[int]:
        """The prompt ids of a chat request's messages (also /tokenize's)."""
        if not req.messages:
            raise APIError(400, "messages is empty", param="messages")
        messages = []
        for i, m in enumerate(req.messages):
            if m.role not in CHAT_ROLES:
                raise APIError(400, f"messages[{i}].role {m.role!r} is not supported; expected one "
                               f"of {', '.join(CHAT_ROLES)}", param=f"messages[{i}].role")
            content = m.content or ""
            if isinstance(content, list):
                if any(part.type != "text" or part.text is None for part in content):
                    raise APIError(400, f"messages[{i}].content: only text parts are supported",
                                   param=f"messages[{i}].content")
                content = content_text([{"type": "text", "text": part.text} for part in content])
            message = {"role": CHAT_ROLES[m.role], "content": content}
            if m.name is not None:
                message["name"] = m.name
            if m.tool_calls:
                if m.role != "assistant":
                    raise APIError(400, f"messages[{i}].tool_calls: only an assistant's message makes tool calls "
                                   f"(this one is the {m.role}'s)", param=f"messages[{i}].tool_calls")
                message["tool_calls"] = history_calls(m.tool_calls, f"messages[{i}].tool_calls")
            if m.tool_call_id is not None:
                if m.role != "tool":
                    raise APIError(400, f"messages[{i}].tool_call_id: only a tool's message answers a call "
                                   f"(this one is the {m.role}'s)", param=f"messages[{i}].tool_call_id")
                message["tool_call_id"] = m.tool_call_id
            messages.append(message)
        tools = check_tools(req.tools)
        self._check_text_length(sum(len(m["content"]) + len(json.dumps(m.get("tool_calls", ""))) for m in messages)
                                + len(json.dumps(tools or "")), "messages")
        continue_final = bool(req.continue_final_message)
        add_generation_prompt = req.add_generation_prompt if req.add_generation_prompt is not None \
            else not continue_final
        if continue_final and add_generation_prompt:
            raise APIError(400, "continue_final_message and add_generation_prompt cannot both be true: "
                           "send add_generation_prompt: false", param="continue_final_message")
        if continue_final and messages[-1]["role"] != "assistant":
            raise APIError(400, "continue_final_message continues the last message, which must be the "
                           f"assistant's (got {messages[-1]['role']!r})", param="continue_final_message")
        reserved = sorted(set(req.chat_template_kwargs or {}) & TEMPLATE_ARGUMENTS)
        if reserved:
            raise APIError(400, f"chat_template_kwargs cannot set {', '.join(reserved)}: "
                           "they are request fields of their own", param="chat_template_kwargs")
        template = req.chat_template if req.chat_template is not None else self.chat_template
        if req.chat_template is not None:
            try:
                compile_chat_template(req.chat_template)
            except ValueError as e:
                raise APIError(400, str(e), param="chat_template") from None
        try:
            ids = self.tokenizer.encode_chat(messages, add_generation_prompt,
                                             continue_final_message=continue_final, chat_template=template,
                                             tools=tools, **(req.chat_template_kwargs or {}))
        except ValueError as e:  # the template refused them (raise_exception), failed, or there is none
            log.info("chat template refused a request: %s", e)
            raise APIError(400, f"the chat template refused the messages: {e}",
                           param="chat_template" if req.chat_template is not None else "messages") from None
        except RecursionError:  # (a tool call's arguments nested nearly as deep as Python's limit)
            raise APIError(400, "the messages nest too deeply to render", param="messages") from None
        if not ids:
            raise APIError(400, "the messages render to an empty prompt", param="messages")
        return ids
