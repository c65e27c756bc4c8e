"""Turns the engine's steps into OpenAI's response shapes.

One `Shape` accumulates every choice of a request, whether it is answered
whole or streamed; `CompletionShape` and `ChatShape` differ only in how a
choice, a chunk and a list of token logprobs look on the wire. A chat with
tools (`Plan.parse_tool_calls`) splits each choice's text into content and
``tool_calls`` (`tools.parse_tool_calls`; streamed: `tools.ToolCallStream`),
and a choice that stopped after making calls finishes ``"tool_calls"``.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatDelta,
    ChatLogprobs,
    ChatTokenLogprob,
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    FunctionCallOut,
    PagedlmInfo,
    PromptLogprob,
    PromptLogprobs,
    ToolCallDelta,
    ToolCallOut,
    TopLogprob,
    Usage,
)
from .tools import ToolCall, ToolCallStream, parse_tool_calls

if TYPE_CHECKING:
    from pagedlm.batch.engine import GenerationResponse
    from pagedlm.tokenizer import Tokenizer

    from .planner import Plan

# (token id, its logprob or None for a first prompt token, top-k [(id, logprob)] or None)
Item = tuple[int, float | None, list[tuple[int, float]] | None]


@dataclass
class _Choice:
    text: list[str] = field(default_factory=list)
    items: list[Item] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: PromptLogprobs | None = None  # vLLM's field, when asked
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    paged: bool = False
    started: bool = False
    offset: int = 0  # characters of text sent so far (completions' text_offset)
    calls: int = 0  # tool calls streamed so far


class Shape:
    id_prefix = ""

    def __init__(self, plan: "Plan", tokenizer: "Tokenizer", model_id: str) -> None:
        self.plan, self.tokenizer, self.model_id = plan, tokenizer, model_id
        self.id = f"{self.id_prefix}{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.choices = [_Choice() for _ in plan.prompts]
        self.logprobs = plan.options[0].logprobs
        self._strings: dict[int, str] = {}

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.choices)

    def token_str(self, token: int) -> str:
        s = self._strings.get(token)
        if s is None:
            s = self._strings[token] = self.tokenizer.decode([token], skip_special_tokens=False)
        return s

    def add(self, index: int, resp: GenerationResponse) -> tuple[str, list[Item]]:
        """Record one step of choice ``index``; return its new text and logprob items."""
        c = self.choices[index]
        text, items = resp.text, []
        if self.logprobs is not None and resp.logprob is not None:
            items.append((resp.token, resp.logprob[0], resp.logprob[1]))
        if not c.started:
            c.started = True
            text, items = self._first(index, resp, text, items)
        c.text.append(text)
        c.items += items
        c.prompt_tokens, c.completion_tokens = resp.prompt_tokens, resp.generation_tokens
        c.cached_tokens, c.paged = resp.cached_tokens, resp.paged_kv
        if resp.finish_reason is not None:
            c.finish_reason, c.stop_reason = resp.finish_reason, resp.seq.stop_reason
        return text, items

    def _first(self, index, resp, text, items) -> tuple[str, list[Item]]:
        k = self.plan.prompt_logprobs
        if k is not None and resp.prompt_logprobs is not None:
            self.choices[index].prompt_logprobs = self._prompt_logprobs(
                self.plan.prompts[index], resp.prompt_logprobs, resp.seq.prompt_logprob_ranks, k)
        return text, items

    def _prompt_logprobs(self, prompt: list[int], scored, ranks: list[int], k: int) -> PromptLogprobs:
        """vLLM's shape: per prompt token, its id -> logprob, rank, text, and the top k's."""
        out: PromptLogprobs = [None]  # nothing predicts the first token
        for token, (lp, top), rank in zip(prompt[1:], scored, ranks):
            entry = {str(t): PromptLogprob(logprob=v, rank=r, decoded_token=self.token_str(t))
                     for r, (t, v) in enumerate(top[:k], 1)}
            entry[str(token)] = PromptLogprob(logprob=lp, rank=rank, decoded_token=self.token_str(token))
            out.append(entry)
        return out

    def usage(self) -> Usage:
        """OpenAI's: each prompt counts once, however many choices it has."""
        firsts = self.choices[:: self.plan.n]
        prompt = sum(c.prompt_tokens for c in firsts)
        completion = sum(c.completion_tokens for c in self.choices)
        cached = sum(c.cached_tokens for c in firsts)
        return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                     prompt_tokens_details={"cached_tokens": cached})

    def info(self) -> PagedlmInfo:
        return PagedlmInfo(paged_kv=any(c.paged for c in self.choices),
                           cached_tokens=sum(c.cached_tokens for c in self.choices))

    # -- what the endpoints answer ---------------------------------------

    def response(self) -> dict[str, Any]:
        """The whole response, after every step was added."""
        raise NotImplementedError

    def chunk(self, index: int, resp: GenerationResponse) -> dict[str, Any]:
        """Add one step and return it as a stream chunk."""
        raise NotImplementedError

    def usage_chunk(self) -> dict[str, Any]:
        raise NotImplementedError


class CompletionShape(Shape):
    id_prefix = "cmpl-"

    def _first(self, index, resp, text, items):
        text, items = super()._first(index, resp, text, items)
        if self.plan.echo_texts is None:
            return text, items
        prompt, k = self.plan.prompts[index], self.plan.echo_logprobs
        echoed: list[Item] = []
        if self.logprobs is not None and resp.prompt_logprobs is not None:
            echoed.append((prompt[0], None, None))  # nothing predicts the first token
            echoed += [(t, lp, top[:k]) for t, (lp, top) in zip(prompt[1:], resp.prompt_logprobs)]
        return self.plan.echo_texts[index] + text, echoed + items

    def _logprobs(self, c: _Choice, items: list[Item]) -> CompletionLogprobs | None:
        if self.logprobs is None:
            return None
        tokens = [self.token_str(t) for t, _, _ in items]
        offsets = []
        for s in tokens:
            offsets.append(c.offset)
            c.offset += len(s)
        return CompletionLogprobs(
            tokens=tokens,
            token_logprobs=[lp for _, lp, _ in items],
            # As vLLM: the actual token is among its alternatives even when it is
            # not in the top k, so that a scorer can read it there.
            top_logprobs=[None if top is None else {self.token_str(t): lp, **{self.token_str(i): v for i, v in top}}
                          for t, lp, top in items],
            text_offset=offsets,
        )

    def response(self) -> dict[str, Any]:
        choices = [
            CompletionChoice(index=i, text="".join(c.text), logprobs=self._logprobs(c, c.items),
                             finish_reason=c.finish_reason, stop_reason=c.stop_reason,
                             prompt_logprobs=c.prompt_logprobs)
            for i, c in enumerate(self.choices)
        ]
        return Completion(id=self.id, created=self.created, model=self.model_id, choices=choices,
                          usage=self.usage(), pagedlm=self.info()).model_dump(mode="json")

    def chunk(self, index: int, resp: GenerationResponse) -> dict[str, Any]:
        text, items = self.add(index, resp)
        c = self.choices[index]
        choice = CompletionChoice(index=index, text=text, logprobs=self._logprobs(c, items),
                                  finish_reason=resp.finish_reason, stop_reason=c.stop_reason)
        return Completion(id=self.id, created=self.created, model=self.model_id,
                          choices=[choice]).model_dump(mode="json")

    def usage_chunk(self) -> dict[str, Any]:
        return Completion(id=self.id, created=self.created, model=self.model_id, choices=[],
                          usage=self.usage()).model_dump(mode="json")


class ChatShape(Shape):
    id_prefix = "chatcmpl-"

    def __init__(self, plan: "Plan", tokenizer: "Tokenizer", model_id: str) -> None:
        super().__init__(plan, tokenizer, model_id)
        self.streams = [ToolCallStream(plan.forced_tool) for _ in plan.prompts] if plan.parse_tool_calls else None

    def _finish(self, c: _Choice, made_calls: bool) -> str | None:
        """OpenAI's: a choice that stopped after making calls finishes "tool_calls",
        unless the request named the function (then "stop", as vLLM answers)."""
        named = bool(self.plan.forced_tool)
        return "tool_calls" if made_calls and c.finish_reason == "stop" and not named else c.finish_reason

    def _logprobs(self, items: list[Item]) -> ChatLogprobs | None:
        if self.logprobs is None:
            return None

        def top(t: int, lp: float) -> TopLogprob:
            s = self.token_str(t)
            return TopLogprob(token=s, logprob=lp, bytes=list(s.encode()))

        return ChatLogprobs(content=[
            ChatTokenLogprob(**top(t, lp).model_dump(), top_logprobs=[top(i, v) for i, v in tops or []])
            for t, lp, tops in items
        ])

    def response(self) -> dict[str, Any]:
        choices = []
        for i, c in enumerate(self.choices):
            content, calls = "".join(c.text), []
            if self.plan.parse_tool_calls:
                content, calls = parse_tool_calls(content, self.plan.forced_tool)
                calls = calls if self.plan.parallel_tool_calls else calls[:1]
            message = AssistantMessage(content=content, tool_calls=[_call_out(call) for call in calls] or None)
            choices.append(ChatChoice(index=i, message=message, logprobs=self._logprobs(c.items),
                                      finish_reason=self._finish(c, bool(calls)), stop_reason=c.stop_reason))
        return ChatCompletion(id=self.id, created=self.created, model=self.model_id, choices=choices,
                              usage=self.usage(), prompt_logprobs=self.choices[0].prompt_logprobs,
                              pagedlm=self.info()).model_dump(mode="json")

    def chunk(self, index: int, resp: GenerationResponse) -> dict[str, Any]:
        c = self.choices[index]
        first = not c.started
        text, items = self.add(index, resp)
        calls: list[ToolCall] = []
        if self.streams is not None:
            text, calls = self.streams[index].feed(text)
            if resp.finish_reason is not None:
                rest, more = self.streams[index].finish()
                text, calls = text + rest, calls + more
            if not self.plan.parallel_tool_calls:
                calls = calls[: max(0, 1 - c.calls)]
        deltas = [ToolCallDelta(index=c.calls + k, **_call_out(call).model_dump()) for k, call in enumerate(calls)]
        c.calls += len(calls)
        delta = ChatDelta(role="assistant" if first else None, content=text if text or not deltas else None,
                          tool_calls=deltas or None)
        finish = self._finish(c, c.calls > 0) if resp.finish_reason is not None else None
        choice = ChatChunkChoice(index=index, delta=delta, logprobs=self._logprobs(items),
                                 finish_reason=finish, stop_reason=c.stop_reason)
        return ChatCompletionChunk(id=self.id, created=self.created, model=self.model_id,
                                   choices=[choice]).model_dump(mode="json")

    def usage_chunk(self) -> dict[str, Any]:
        return ChatCompletionChunk(id=self.id, created=self.created, model=self.model_id, choices=[],
                                   usage=self.usage()).model_dump(mode="json")


def _call_out(call: ToolCall) -> ToolCallOut:
    return ToolCallOut(id=call.id, function=FunctionCallOut(name=call.name, arguments=call.arguments))
