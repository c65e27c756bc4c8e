"""What the server does with a request: check and tokenize it (on the event
loop, so that bad input is refused before it queues), then run it on the
serial lane's thread with the prompt cache around ``stream_generate``.

Chat and completions share everything below: each endpoint only says how its
request becomes prompts and options (``plan_chat`` / ``plan_completion``).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from pagedlm.cache.base import Cache
from pagedlm.cache.prompt import PromptCache, dispose
from pagedlm.generate import GenerationResponse, make_cache, prefill, stream_generate
from pagedlm.options import GenerateOptions, OptionError, PagedKvOptions

from .protocol import APIError, ChatRequest, CompletionRequest, _GenerationRequest

if TYPE_CHECKING:
    from pagedlm.tokenizer import Tokenizer

    from .lane import Job
    from .metrics import Metrics

log = logging.getLogger("pagedlm.server")

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat: the rest of the context
MAX_STOP_STRINGS = 16
SAMPLING_FIELDS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "seed")
CHAT_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


@dataclass
class Plan:
    """A checked, tokenized request: one prompt (and options) per choice."""

    prompts: list[list[int]]
    options: list[GenerateOptions]
    stream: bool
    include_usage: bool
    paged: bool
    echo_texts: list[str] | None = None  # completions with echo: each prompt's text


class Engine:
    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: "Tokenizer",
        model_id: str,
        max_model_len: int,
        prompt_cache: PromptCache,
        paged_kv: PagedKvOptions | None,
        metrics: "Metrics",
    ) -> None:
        self.model, self.tokenizer, self.model_id = model, tokenizer, model_id
        self.max_model_len = max_model_len
        self.prompt_cache = prompt_cache
        self.paged_kv = paged_kv
        self.metrics = metrics
        self.vocab_size = getattr(model.args, "vocab_size", None) or tokenizer.vocab_size
        self.live: list[Cache] | None = None  # the running request's caches, for metrics

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
        if req.n is not None and req.n != 1:
            raise APIError(400, f"n must be 1 (got {req.n}): one sequence per request until "
                           "batching lands", param="n", code="unsupported_value")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(req, name) not in (None, 0, 0.0):
                raise APIError(400, f"{name} is not supported (use repetition_penalty)",
                               param=name, code="unsupported_value")

    def _options(self, req: _GenerationRequest, logprobs: int | None,
                 prompt_logprobs: int | None, rename: dict[str, str] | None = None) -> GenerateOptions:
        """The request's sampling options; unset fields keep the engine's defaults."""
        stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        if len(stop) > MAX_STOP_STRINGS:
            raise APIError(400, f"stop takes at most {MAX_STOP_STRINGS} strings", param="stop")
        given = {name: getattr(req, name) for name in SAMPLING_FIELDS if getattr(req, name) is not None}
        if given.get("top_k") == -1:
            given["top_k"] = 0
        options = GenerateOptions(
            max_tokens=1,  # resolved per prompt in _plan
            stop=stop, logprobs=logprobs, prompt_logprobs=prompt_logprobs, paged_kv=self.paged_kv,
            **given,
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
        per_prompt = []
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
            n = max_tokens if max_tokens is not None else min(room, default_max or room)
            per_prompt.append(dataclasses.replace(options, max_tokens=n))
        stream = bool(req.stream)
        include_usage = stream and bool(req.stream_options and req.stream_options.include_usage)
        return Plan(prompts, per_prompt, stream, include_usage, self.paged_kv is not None, echo_texts)

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

    # -- running (lane thread) -------------------------------------------

    def run(self, plan: Plan, job: "Job") -> None:
        for index, (ids, options) in enumerate(zip(plan.prompts, plan.options)):
            if job.cancelled:
                return
            if options.max_tokens == 0:
                self._score_prompt(index, ids, options, job)
            else:
                self._run_one(index, ids, options, job)

    def _score_prompt(self, index: int, ids: list[int], options: GenerateOptions, job: "Job") -> None:
        """max_tokens 0 (echo): one prefill for the prompt's logprobs, nothing generated."""
        cache = make_cache(self.model)
        self.live = cache
        try:
            with torch.inference_mode():
                prompt = torch.tensor(ids, dtype=torch.long, device=next(self.model.parameters()).device)
                _, scores = prefill(self.model, prompt, cache, options.prompt_logprobs)
        finally:
            self.live = None
            dispose(cache)
        self.metrics.prompt_tokens.inc(len(ids))
        job.emit((index, GenerationResponse(text="", token=None, finish_reason="length",
                                            prompt_tokens=len(ids), prompt_logprobs=scores)))

    def _run_one(self, index: int, ids: list[int], options: GenerateOptions, job: "Job") -> None:
        """One choice. The prompt cache lends a cache holding a prefix of the
        prompt; afterwards the cache (prompt + generated[:-1]) goes back into
        it. Paged requests and prompt-logprob requests bypass it (a paged
        cache is disposed by stream_generate; prompt logprobs need a full
        prefill)."""
        bypass = (options.paged_kv is not None or options.prompt_logprobs is not None
                  or self.prompt_cache.max_bytes == 0)
        cache, reused = (None, 0) if bypass else self.prompt_cache.take(ids)
        cache = cache or make_cache(self.model)
        self.live = cache
        tokens: list[int] = []
        finished = False
        start = job.created if index == 0 else time.perf_counter()
        last = start
        steps = stream_generate(self.model, self.tokenizer, ids, options, cache=cache)
        try:
            for resp in steps:
                now = time.perf_counter()
                (self.metrics.ttft if not tokens else self.metrics.itl).observe(now - last)
                last = now
                tokens.append(resp.token)
                job.emit((index, resp))
                if resp.finish_reason is not None:
                    finished = True
                    break
                if job.cancelled:
                    break
        finally:
            steps.close()  # its finally disposes what it owns (paged caches)
            self.live = None
            self.metrics.prompt_tokens.inc(len(ids))
            self.metrics.generation_tokens.inc(len(tokens))
            if finished and not bypass:
                self.prompt_cache.put(ids + tokens[:-1], cache)
            else:
                dispose(cache)
        log.info("choice %d: prompt %d tokens (%d reused), %d generated, %s%s", index, len(ids),
                 reused, len(tokens), "finished" if finished else "cancelled",
                 ", paged KV" if options.paged_kv else "")
