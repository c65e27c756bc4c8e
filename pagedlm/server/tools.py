"""Tool calling on /v1/chat/completions: the request's ``tools`` checked
(`check_tools`), what its ``tool_choice`` asks (`choose`: whether to parse
calls, and for ``"required"`` or a named function the `Constraint` that
forces them), and the model's calls parsed back, whole (`parse_tool_calls`)
or as they stream (`ToolCallStream`).

The call syntax is Hermes / Qwen's, which the chat template shows the model
(its own tool rendering, or the preamble `pagedlm.tokenizer` writes for a
template without one)::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

A block whose JSON is not an object with a ``name`` and an object of
``arguments`` is not a call: it stays in the content as the model wrote it.
``tool_choice: "none"`` renders the tools and parses nothing, as vLLM does
by default (``--exclude-tools-when-tool-choice-none`` off).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pagedlm.options import OptionError
from pagedlm.tokenizer import TOOL_CALL_CLOSE, TOOL_CALL_OPEN

from .protocol import APIError, MessageToolCall, NamedToolChoice, ToolDefinition

if TYPE_CHECKING:
    from pagedlm.structured import Constraint

FUNCTION_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")  # OpenAI's rule
NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}
ANY_OBJECT = {"type": "object"}  # a non-strict function's arguments beside strict ones (tool_choice "auto")
KEY_NAME, KEY_ARGUMENTS = json.dumps('"name"'), json.dumps('"arguments"')  # (Lark string literals)


@dataclass(frozen=True)
class ToolCall:
    """One call the model made: ``arguments`` is the JSON text of an object."""

    name: str
    arguments: str
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")


# -- the request ---------------------------------------------------------------


def check_tools(tools: list[ToolDefinition] | None) -> list[dict] | None:
    """The request's tools as a chat template takes them (OpenAI's entries,
    as sent), None for none; `APIError` naming the entry: a type other than
    ``function``, a name OpenAI would refuse or given twice, ``parameters``
    that are not an object's schema."""
    if not tools:
        return None
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if tool.type != "function":
            raise APIError(400, f'{where}.type must be "function" (got {tool.type!r})', param=f"{where}.type")
        name = check_name(tool.function.name, f"{where}.function.name")
        if name in seen:
            raise APIError(400, f"{where}.function.name {name!r} is given twice", param=f"{where}.function.name")
        seen.add(name)
        parameters = tool.function.parameters
        if parameters is not None and parameters.get("type") != "object":
            raise APIError(400, f'{where}.function.parameters must be the JSON schema of an object ("type": '
                           f'"object"; got "type": {json.dumps(parameters.get("type"))})',
                           param=f"{where}.function.parameters")
    return [tool.model_dump(exclude_none=True, by_alias=True) for tool in tools]


def check_name(name: str, where: str) -> str:
    """``name`` if OpenAI takes it as a function's (or a response format's) name; else a 400 naming ``where``."""
    if not FUNCTION_NAME.fullmatch(name):
        raise APIError(400, f"{where} must be 1 to 64 letters, digits, _ or - (got {name!r})", param=where)
    return name


def history_calls(calls: list[MessageToolCall], where: str) -> list[dict]:
    """An assistant message's past calls as templates take them
    (transformers' shape: ``arguments`` an object, as vLLM passes them);
    `APIError` naming a call whose type is not ``function`` or whose
    arguments are not JSON."""
    out = []
    for j, call in enumerate(calls):
        if call.type not in (None, "function"):
            raise APIError(400, f'{where}[{j}].type must be "function" (got {call.type!r})',
                           param=f"{where}[{j}].type")
        try:
            arguments = json.loads(call.function.arguments)
        except (ValueError, RecursionError) as e:  # (nested past Python's recursion limit)
            raise APIError(400, f"{where}[{j}].function.arguments is not JSON ({e})",
                           param=f"{where}[{j}].function.arguments") from None
        entry = {"type": "function", "function": {"name": call.function.name, "arguments": arguments}}
        out.append({"id": call.id, **entry} if call.id is not None else entry)
    return out


def choose(tools: list[dict] | None, tool_choice: str | NamedToolChoice | None,
           parallel: bool = True) -> tuple[bool, "Constraint | None"]:
    """What ``tool_choice`` asks, given the checked ``tools``: (parse the
    output's calls?, the validated constraint that forces calls, or None).
    Unset: ``"auto"`` with tools, else ``"none"``. ``"required"`` forces one
    call or more (one without ``parallel``), a named function one call of it.
    `APIError` for a choice that needs tools without any, or names a
    function not among them."""
    choice = tool_choice if tool_choice is not None else ("auto" if tools else "none")
    if choice == "none":
        return False, None
    if not tools:
        if choice == "auto":
            return False, None
        raise APIError(400, "tool_choice asks for a tool call, but the request has no tools", param="tool_choice")
    functions = [tool["function"] for tool in tools]
    if choice == "auto":
        return True, None
    if choice == "required":
        return True, tool_constraint(functions, list(range(len(functions))), many=parallel)
    if choice.type != "function":
        raise APIError(400, f'tool_choice.type must be "function" (got {choice.type!r})', param="tool_choice.type")
    names = [f["name"] for f in functions]
    if choice.function.name not in names:
        raise APIError(400, f"tool_choice names the function {choice.function.name!r}, which is not among the "
                       f"tools ({', '.join(map(repr, names))})", param="tool_choice")
    return True, tool_constraint(functions, [names.index(choice.function.name)], many=False)


def auto_constraint(tools: list[dict], own: "Constraint | None", many: bool) -> "Constraint | None":
    """The constraint of a ``tool_choice: "auto"`` row, given the request's
    ``own`` (``response_format``, ``structured_outputs``, ``guided_*``): with
    a function that asks for ``strict`` arguments, or a JSON answer asked
    for, `tool_constraint` of every listed function (its text then that
    answer, and strict functions' arguments valid against their
    parameters); else ``own`` as it is. `APIError` for strict functions
    beside a regex, choice or grammar, which no call could follow."""
    functions = [tool["function"] for tool in tools]
    strict = [i for i, f in enumerate(functions) if f.get("strict")]
    if own is not None and own.kind not in ("json", "json_object"):
        if strict:
            where = f"tools[{strict[0]}].function.strict"
            raise APIError(400, f"{where}: a strict function's calls cannot follow the request's {own.kind} "
                           "constraint: send one", param=where)
        return own
    if own is None and not strict:
        return None
    answer = None if own is None else own.json if own.kind == "json" else {"type": "object"}
    return tool_constraint(functions, list(range(len(functions))), many=many, checked=strict, answer=answer,
                           text=own is None)


def tool_constraint(functions: list[dict], chosen: list[int], *, many: bool, checked: list[int] | None = None,
                    answer: dict | None = None, text: bool = False) -> "Constraint":
    """A Lark grammar (llguidance's dialect) for ``<tool_call>`` blocks of
    the ``chosen`` functions, each a JSON object of the function's name and
    arguments, valid against its ``parameters`` (only those of ``checked``,
    if given; the others' any object): one block, or with ``many`` one or
    more (the output is complete after them: the row ends "stop"); or,
    ``answer`` (a JSON schema), those calls or that JSON value; or, with
    ``text``, free text in which a ``<tool_call>`` tag can only begin such a
    call (tool_choice "auto" with strict functions: `auto_constraint`;
    without ``many``, the one call ends the output).
    `APIError` naming a function whose parameters llguidance cannot follow."""
    from pagedlm.structured import Constraint
    from pagedlm.structured.constraint import JSON_SPACE, json_rule

    rules = []
    for i in chosen:
        parameters = functions[i].get("parameters") or NO_PARAMETERS
        if checked is not None and i not in checked:
            parameters = ANY_OBJECT
        where = f"tools[{i}].function.parameters"
        try:
            Constraint(json=parameters).validate()
        except OptionError as e:  # "json is not a JSON schema ...": name the field
            raise APIError(400, where + str(e).removeprefix("json"), param=where) from None
        # The call's object is written out here, its arguments a JSON value of their own: the
        # parameters stay the root of their schema, which their "#..." references resolve against.
        name = json.dumps(json.dumps(functions[i]["name"]))
        rules.append(f'fn{i}: "{{" WS? {KEY_NAME} WS? ":" WS? {name} WS? "," WS? {KEY_ARGUMENTS} WS? ":" WS? '
                     f'args{i} WS? "}}"')
        rules.append(f"args{i}: %json {json_rule(parameters)}")  # numbers bounded, whitespace as in json rows
    rules.append(f"WS: /{JSON_SPACE}/")  # (as between the tokens of a JSON value)
    calls = 'call ("\\n"? call)*' if many else "call"
    if text:  # each "<" begins a lexeme of its own, so that the tag is never inside a longer one
        # (one call ends the output: were text allowed after it, a second tag, which no call may
        # begin there, would lex as text: "<tool_cal" then "l>...")
        start = "start: text? (call text?)*" if many else "start: text? (call WS?)?"
        rules += ["text: (TEXT | ANGLED)+", "TEXT: /[^<]+/", f"ANGLED: /<[^<]*/ & ~/{re.escape(TOOL_CALL_OPEN)}[^<]*/"]
    elif answer is not None:
        start = f"start: answer | {calls}"
        rules.append(f"answer: %json {json_rule(answer)} WS?")  # (as a json row: one space may end it)
    else:
        start = f"start: {calls}"
    call = (f'call: {json.dumps(TOOL_CALL_OPEN)} "\\n"? ({" | ".join(f"fn{i}" for i in chosen)}) "\\n"? '
            f"{json.dumps(TOOL_CALL_CLOSE)}")
    try:
        return Constraint(grammar="\n".join([start, call, *rules])).validate()
    except OptionError as e:
        raise APIError(400, f"tools: {e}", param="tools") from None


# -- the model's output --------------------------------------------------------


def parse_tool_calls(text: str, forced: str | None = None) -> tuple[str | None, list[ToolCall]]:
    """A whole output's content (the text outside the calls; None when it is
    only whitespace) and calls: what `ToolCallStream` streams, joined."""
    stream = ToolCallStream(forced)
    content, calls = stream.feed(text)
    rest, more = stream.finish()
    content += rest
    return content or None, calls + more


class ToolCallStream:
    """Splits an output, piece by piece, into content and calls: text that
    may still begin a ``<tool_call>`` tag, and a block until its closing tag,
    are held back; so is content that is only whitespace so far (content of
    only whitespace is none, so that a stream says what the whole response
    does). ``forced``: the output is forced to calls (`Plan.forced_tool`: the
    named function, or "" for "required"): a call the output ends inside
    (``max_tokens``) is still a call, its arguments the text written so far,
    as OpenAI and vLLM answer a forced call cut short."""

    def __init__(self, forced: str | None = None) -> None:
        self._forced = forced
        self._pending = ""  # undecided text: a possible start of the opening tag, or a block's body
        self._in_block = False
        self._blank = ""  # content of only whitespace, not yet sent
        self._spoke = False  # some content that is not whitespace was sent

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        """The content to send now and the calls completed by ``text``."""
        self._pending += text
        content: list[str] = []
        calls: list[ToolCall] = []
        while True:
            if self._in_block:
                end = self._pending.find(TOOL_CALL_CLOSE)
                if end < 0:
                    break
                body, self._pending = self._pending[:end], self._pending[end + len(TOOL_CALL_CLOSE):]
                self._in_block = False
                call = _call(body)
                if call is None:
                    content.append(TOOL_CALL_OPEN + body + TOOL_CALL_CLOSE)
                else:
                    calls.append(call)
                continue
            start = self._pending.find(TOOL_CALL_OPEN)
            if start < 0:
                keep = _tag_prefix(self._pending)
                content.append(self._pending[: len(self._pending) - keep])
                self._pending = self._pending[len(self._pending) - keep:]
                break
            content.append(self._pending[:start])
            self._pending = self._pending[start + len(TOOL_CALL_OPEN):]
            self._in_block = True
        return self._sent("".join(content)), calls

    def finish(self) -> tuple[str, list[ToolCall]]:
        """What is held back, at the end of the output: a block the output
        ended inside is a call if its JSON is complete (no closing tag)."""
        calls: list[ToolCall] = []
        content = self._pending
        if self._in_block:
            body = self._pending[: len(self._pending) - _tag_prefix(self._pending, TOOL_CALL_CLOSE)]
            call = _call(body) or (_cut_call(body, self._forced) if self._forced is not None else None)
            if call is not None:
                content, calls = "", [call]
            elif self._forced is None:
                content = TOOL_CALL_OPEN + self._pending
            else:  # (cut before the function's name, which "required" does not know: no call yet)
                content = ""
        self._pending, self._in_block = "", False
        return self._sent(content), calls

    def _sent(self, text: str) -> str:
        if self._spoke:
            return text
        self._blank += text
        if not self._blank.strip():
            return ""
        self._spoke = True
        text, self._blank = self._blank, ""
        return text


def _tag_prefix(text: str, tag: str = TOOL_CALL_OPEN) -> int:
    """How many characters at the end of ``text`` may begin ``tag``."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


CUT_CALL = re.compile(rf'\s*\{{\s*"name"\s*:\s*"({FUNCTION_NAME.pattern})"\s*,\s*"arguments"\s*:\s*(.*)',
                      re.DOTALL)


def _cut_call(body: str, name: str) -> ToolCall | None:
    """A forced call the output ended inside (`tool_constraint`'s shape, cut
    short): its name and the arguments' text so far; ``name`` (the named
    function; "" for "required") where the output ended before its
    arguments began; None when no name is known."""
    if (cut := CUT_CALL.match(body)) is not None:
        return ToolCall(cut[1], cut[2].rstrip())
    return ToolCall(name, "") if name else None


def _call(body: str) -> ToolCall | None:
    """The call a block's JSON makes: an object with a string ``name`` and
    an object of ``arguments``; None for anything else."""
    try:
        value: Any = json.loads(body)
    except (ValueError, RecursionError):  # (a model can nest past Python's recursion limit)
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"] \
            or not isinstance(value.get("arguments"), dict):
        return None
    return ToolCall(value["name"], json.dumps(value["arguments"], ensure_ascii=False))
