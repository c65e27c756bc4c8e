"""The server's request planning: check and tokenize a request into a `Plan`
(one prompt and `SamplingParams` per choice) before it queues, so that bad
input is refused with a 4xx and never reaches the engine. Running the plan
is the engine loop's business (``loop.EngineLoop``).

Chat and completions share everything below: each endpoint only says how its
request becomes prompts and options (``plan_chat`` / ``plan_completion``).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pagedlm.options import OptionError, SamplingParams

from .protocol import APIError, ChatRequest, CompletionRequest, _GenerationRequest

if TYPE_CHECKING:
    from pagedlm.batch.engine import LLMEngine

log = logging.getLogger("pagedlm.server")

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat: the rest of the context
MAX_STOP_STRINGS = 16
SAMPLING_FIELDS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                   "frequency_penalty", "seed")
MAX_N = 16
CHAT_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


@dataclass
class Plan:
    """A checked, tokenized request: one prompt (and options) per choice."""

    prompts: list[list[int]]  # one per choice: a prompt repeated n times for n > 1
    options: list[SamplingParams]
    stream: bool
    include_usage: bool
    paged: bool
    echo_texts: list[str] | None = None  # completions with echo: each choice's prompt text


class Engine:
    """Request planning over an `LLMEngine` (it reads the model's limits, it runs nothing)."""

    def __init__(self, llm: "LLMEngine", model_id: str) -> None:
        self.llm = llm
        self.tokenizer, self.model_id = llm.tokenizer, model_id
        self.max_model_len = llm.max_model_len
        self.paged = llm.paged
        self.vocab_size = getattr(llm.model.args, "vocab_size", None) or self.tokenizer.vocab_size

    # -- planning (event loop) -------------------------------------------

    def plan_completion(self, req: CompletionRequest) -> Plan:
        self._check_common(req)
        prompts, texts = self._completion_prompts(req.prompt)
        prompt_logprobs = req.logprobs if req.echo else None
        if req.echo and req.max_tokens == 0:  # score the prompt only (lm-eval, legacy API)
            prompt_logprobs = req.logprobs or 0
        options = self._options(req, req.logprobs, prompt_logprobs)
        return self._plan(req, prompts, options, req.max_tokens, "max_tokens",
                          COMPLETION_DEFAULT_MAX_TOKENS, texts if req.echo else None)

    def plan_chat(self, req: ChatRequest) -> Plan:
        self._check_common(req)
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        options = self._options(req, logprobs, None, rename={"logprobs": "top_logprobs"})
        prompt = self._chat_prompt(req)
        if req.max_completion_tokens is not None:
            max_tokens, param = req.max_completion_tokens, "max_completion_tokens"
        else:
            max_tokens, param = req.max_tokens, "max_tokens"
        return self._plan(req, [prompt], options, max_tokens, param, None, None)

    def _check_common(self, req: _GenerationRequest) -> None:
        if req.model is not None and req.model != self.model_id:
            raise APIError(404, f"the model {req.model!r} does not exist; this server serves "
                           f"{self.model_id!r}", param="model", code="model_not_found")
        if req.n is not None and not 1 <= req.n <= MAX_N:
            raise APIError(400, f"n must be in [1, {MAX_N}] (got {req.n})", param="n")

    def _options(self, req: _GenerationRequest, logprobs: int | None,
                 prompt_logprobs: int | None, rename: dict[str, str] | None = None) -> SamplingParams:
        """The request's sampling options; unset fields keep the engine's defaults."""
        stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        if len(stop) > MAX_STOP_STRINGS:
            raise APIError(400, f"stop takes at most {MAX_STOP_STRINGS} strings", param="stop")
        given = {name: getattr(req, name) for name in SAMPLING_FIELDS if getattr(req, name) is not None}
        if given.get("top_k") == -1:
            given["top_k"] = 0
        options = SamplingParams(
            max_tokens=1,  # resolved per prompt in _plan
            stop=stop, logprobs=logprobs, prompt_logprobs=prompt_logprobs, **given,
        )
        try:
            options.validate()
        except OptionError as e:  # "<field> must be ...": name the request's field
            message = str(e)
            field_name = message.split()[0]
            param = (rename or {}).get(field_name, field_name)
            raise APIError(400, param + message[len(field_name):], param=param) from None
        return options

    def _plan(self, req, prompts, options, max_tokens, max_param, default_max, echo_texts) -> Plan:
        scoring = max_tokens == 0 and echo_texts is not None
        if max_tokens is not None and max_tokens < 1 and not scoring:
            raise APIError(400, f"{max_param} must be >= 1 (got {max_tokens}); 0 only with echo",
                           param=max_param)
        limit = self.max_model_len
        n = req.n or 1
        choices, per_choice = [], []
        for ids in prompts:
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
            try:
                self.llm.scheduler.check_fits(len(ids), budget)
            except OptionError as e:
                raise APIError(400, str(e), param=max_param, code="kv_budget_exceeded") from None
            # OpenAI's choice order: prompt by prompt, n each
            for params in dataclasses.replace(options, max_tokens=budget, n=n).continuations():
                choices.append(ids)
                per_choice.append(params)
        stream = bool(req.stream)
        include_usage = stream and bool(req.stream_options and req.stream_options.include_usage)
        echo = [t for t in echo_texts for _ in range(n)] if echo_texts is not None else None
        return Plan(choices, per_choice, stream, include_usage, self.paged, echo)

    def _completion_prompts(self, prompt) -> tuple[list[list[int]], list[str]]:
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
                ids = self.tokenizer.encode(p) if p else []
                text = p
            else:
                ids = list(p)
                bad = [t for t in ids if not 0 <= t < self.vocab_size]
                if bad:
                    raise APIError(400, f"{param} holds token id {bad[0]}, outside the vocabulary "
                                   f"[0, {self.vocab_size})", param="prompt")
                text = self.tokenizer.decode(ids) if ids else ""
            if not ids:
                raise APIError(400, f"{param} is empty", param="prompt")
            ids_list.append(ids)
            texts.append(text)
        return ids_list, texts

    def _check_text_length(self, chars: int, param: str) -> None:
        """Refuse text that cannot fit the context, before tokenizing it: no
        token covers more than ``max_token_chars`` characters."""
        if chars > self.max_model_len * self.tokenizer.max_token_chars:
            raise APIError(400, f"{param} is {chars} characters, more than this model's context "
                           f"length of {self.max_model_len} tokens can hold",
                           param="messages" if param == "messages" else "prompt",
                           code="context_length_exceeded")

    def _chat_prompt(self, req: ChatRequest) -> list[int]:
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
                content = "".join(part.text for part in content)
            messages.append({"role": CHAT_ROLES[m.role], "content": content})
        self._check_text_length(sum(len(m["content"]) for m in messages), "messages")
        try:
            ids = self.tokenizer.encode_chat(messages)
        except ValueError as e:  # the model's template refused them (raise_exception), or has none
            log.info("chat template refused a request: %s", e)
            raise APIError(400, f"the model's chat template refused the messages: {e}",
                           param="messages") from None
        if not ids:
            raise APIError(400, "the messages render to an empty prompt", param="messages")
        return ids
