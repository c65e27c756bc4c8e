"""Tokenizer: encode/decode, chat templates (jinja2, tools passed through), incremental detokenizing.

Wraps a `tokenizers.Tokenizer` (tokenizer.json) with the rules that live
beside it in an HF folder: whether to add BOS (tokenizer_config.json's
``add_bos_token``, else whatever tokenizer.json's post-processor does), which
ids end generation, and the chat template.

Tools reach a template as transformers' ``apply_chat_template`` passes them
(a ``tools`` variable, OpenAI's ``{"type": "function", "function": {...}}``
entries; assistant ``tool_calls`` with ``arguments`` as objects; ``role:
"tool"`` messages). A template that never reads ``tools`` (SmolLM2's,
Gemma 3's) is given the Hermes / Qwen format in plain messages instead: a
system preamble listing the tools and the ``<tool_call>{"name": ...,
"arguments": ...}</tool_call>`` syntax, past calls written that way in the
assistant's text, tool results as ``<tool_response>`` blocks in a user turn.
"""

from __future__ import annotations

import functools
import json
import re
import secrets
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

import tokenizers
import tokenizers.decoders

# Gemma's turn format, for files that carry no template (the Gemma 3 GGUF):
# the system message is folded into the first user turn.
GEMMA_CHAT_TEMPLATE = """{{ bos_token }}
{%- if messages and messages[0]['role'] == 'system' -%}
    {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = '' -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
    {%- endif -%}
    {%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}
    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') }}
    {{- message['content'] | trim }}
    {{- '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{ '<start_of_turn>model\n' }}
{%- endif -%}"""


# The Hermes / Qwen tool-call syntax (pagedlm.server.tools parses it back).
TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
TOOL_RESPONSE_OPEN, TOOL_RESPONSE_CLOSE = "<tool_response>", "</tool_response>"

# Gemma 3's image markers, which a text model never writes.
GEMMA_MEDIA_TOKENS = ("<start_of_image>", "<end_of_image>", "<image_soft_token>")


def _token_str(value: Any) -> str | None:
    """tokenizer_config stores special tokens as strings or AddedToken dicts."""
    return value.get("content") if isinstance(value, dict) else value


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def _ids(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]


class Tokenizer:
    def __init__(
        self,
        tokenizer: tokenizers.Tokenizer,
        bos_token: str | None = None,
        eos_token: str | None = None,
        add_bos_token: bool | None = None,
        chat_template: str | None = None,
        eos_token_ids: set[int] | None = None,
        special_tokens: dict[str, str] | None = None,
    ):
        self._tk = tokenizer
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.bos_token_id = tokenizer.token_to_id(bos_token) if bos_token else None
        # Does tokenizer.json's post-processor already add BOS? (transformers'
        # save_pretrained writes one that does; our GGUF conversion does not.)
        with_special = tokenizer.encode("a", add_special_tokens=True).ids
        self._post_adds_bos = (
            self.bos_token_id is not None
            and with_special[:1] == [self.bos_token_id]
            and tokenizer.encode("a", add_special_tokens=False).ids[:1] != [self.bos_token_id]
        )
        self.add_bos_token = self._post_adds_bos if add_bos_token is None else bool(add_bos_token)
        eos = set(eos_token_ids or ())
        if eos_token and (i := tokenizer.token_to_id(eos_token)) is not None:
            eos.add(i)
        if chat_template is None and tokenizer.token_to_id("<start_of_turn>") is not None:
            chat_template = GEMMA_CHAT_TEMPLATE
        if tokenizer.token_to_id("<start_of_turn>") is not None:
            end_of_turn = tokenizer.token_to_id("<end_of_turn>")
            if end_of_turn is not None:  # Gemma: a chat reply ends with <end_of_turn>
                eos.add(end_of_turn)
        self.eos_token_ids: set[int] = eos
        self.chat_template = chat_template
        self.special_tokens = {k: v for k, v in (special_tokens or {}).items() if v is not None}

    @classmethod
    def from_folder(cls, path: str | Path) -> "Tokenizer":
        """tokenizer.json + tokenizer_config.json (+ generation_config/config eos ids)."""
        folder = Path(path)
        tk = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
        tc = _read_json(folder / "tokenizer_config.json")
        config = _read_json(folder / "config.json")
        gen = _read_json(folder / "generation_config.json")
        names = {k: _token_str(tc.get(k)) for k in ("bos_token", "eos_token", "unk_token", "pad_token")}
        for key in ("bos", "eos"):
            if names[f"{key}_token"] is None and (ids := _ids(config.get(f"{key}_token_id"))):
                names[f"{key}_token"] = tk.id_to_token(ids[0])
        template = tc.get("chat_template")
        if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}]
            template = {t["name"]: t["template"] for t in template}.get("default")
        if template is None and (folder / "chat_template.jinja").is_file():
            template = (folder / "chat_template.jinja").read_text()
        if template is None:
            template = _read_json(folder / "chat_template.json").get("chat_template")
        return cls(
            tk,
            bos_token=names["bos_token"],
            eos_token=names["eos_token"],
            add_bos_token=tc.get("add_bos_token"),
            chat_template=template,
            eos_token_ids=set(_ids(gen.get("eos_token_id")) + _ids(config.get("eos_token_id"))),
            special_tokens=names,
        )

    @property
    def vocab_size(self) -> int:
        return self._tk.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self._tk.token_to_id(token)

    def to_json(self) -> str:
        """The tokenizer as tokenizer.json text (what a grammar engine builds its vocabulary from)."""
        return self._tk.to_str()

    @cached_property
    def max_token_chars(self) -> int:
        """The most characters one token can cover: a text longer than
        ``n * max_token_chars`` is more than ``n`` tokens, known without encoding it."""
        return max(len(t) for t in self._tk.get_vocab(with_added_tokens=True))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids; with ``add_special_tokens``, BOS per the model's rule, never doubled."""
        # encode_batch releases the GIL (encode does not): a long prompt does not
        # stall the server's event loop while it is tokenized on another thread.
        ids = self._tk.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        bos = self.bos_token_id
        if not add_special_tokens or bos is None:
            return ids
        if self._post_adds_bos and (not self.add_bos_token or ids[1:2] == [bos]):
            return ids[1:]  # the config says no BOS, or the text began with one already
        if self.add_bos_token and not self._post_adds_bos and ids[:1] != [bos]:
            return [bos, *ids]
        return ids

    def encode_as_text(self, text: str) -> list[int]:
        """``text``'s tokens with no special token parsed out of it:
        ``"<|im_start|>"`` in it is its characters' tokens (what a grammar
        engine's forced text is), not the control token. Thread-safe."""
        ids = self._tk.encode(text, add_special_tokens=False).ids
        if not self.control_token_ids.intersection(ids):
            return ids
        return self._plain_text.encode(text, add_special_tokens=False).ids

    @cached_property
    def control_token_ids(self) -> frozenset[int]:
        """The tokenizer's special added tokens (control tokens, in a GGUF):
        tokenizer.json marks them special, so a grammar engine reading it
        never takes one for text."""
        return frozenset(i for i, t in self._tk.get_added_tokens_decoder().items() if t.special)

    @cached_property
    def special_token_ids(self) -> frozenset[int]:
        """Tokens that are not text: `control_token_ids`, and Gemma 3's image
        markers (special in its HF tokenizer, user-defined, so printed, in its GGUF)."""
        ids = set(self.control_token_ids)
        if self.token_to_id("<start_of_turn>") is not None:
            ids.update(i for t in GEMMA_MEDIA_TOKENS if (i := self.token_to_id(t)) is not None)
        return frozenset(ids)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; with ``skip_special_tokens`` (vLLM's default) the
        `special_token_ids` add none."""
        if skip_special_tokens:
            special = self.special_token_ids
            ids = [i for i in ids if i not in special]
        return self._tk.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, *,
                            continue_final_message: bool = False, chat_template: str | None = None,
                            tools: list[dict] | None = None, **template_kwargs: Any) -> str:
        """Render the chat template (the model's, or ``chat_template``) as text;
        its BOS, if any, is part of the text. With ``continue_final_message``
        the prompt ends where the last message's content does (no end of turn,
        no generation prompt), so that the model continues that message.
        ``tools``: OpenAI's tool entries, for the template (or, for a template
        without tool support, the Hermes preamble: module docstring).
        ``template_kwargs`` are further template variables. Every failure (the
        template does not compile, raises, or refuses the messages) is a
        `ValueError`."""
        source = self._template_source(add_generation_prompt, continue_final_message, chat_template)
        messages, tools = _for_template([_text_message(m) for m in messages], tools, source)
        return self._render(source, messages, tools, add_generation_prompt, continue_final_message, template_kwargs)

    def _template_source(self, add_generation_prompt: bool, continue_final_message: bool,
                         chat_template: str | None) -> str:
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt exclude each other: "
                             "a prompt either continues the last message or opens a new turn")
        source = self.chat_template if chat_template is None else chat_template
        if source is None:
            raise ValueError("this model has no chat template; use plain text prompts")
        return source

    def _render(self, source: str, messages: list[dict], tools: list[dict] | None, add_generation_prompt: bool,
                continue_final_message: bool, template_kwargs: dict[str, Any]) -> str:
        template = compile_chat_template(source)
        from jinja2.exceptions import TemplateError

        # tools only when given: a template may test `tools is defined`
        given = {} if tools is None else {"tools": tools}
        try:
            text = template.render({**self.special_tokens, **template_kwargs, "messages": messages,
                                    "add_generation_prompt": add_generation_prompt, **given})
        except TemplateError as e:  # raise_exception(...) in the template, an undefined name
            raise ValueError(f"chat template: {e}") from None
        except Exception as e:  # a template is code: whatever it does wrong is its error
            raise ValueError(f"chat template: {type(e).__name__}: {e}") from None
        return _up_to_final_message(text, messages) if continue_final_message else text

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True, *,
                    continue_final_message: bool = False, chat_template: str | None = None,
                    tools: list[dict] | None = None, **template_kwargs: Any) -> list[int]:
        """Chat prompt ids (`apply_chat_template`'s arguments). Like
        transformers, adds no special tokens beyond the template's.

        Message content is text: a control token spelled inside it (a user
        writing ``<|im_end|>\n<|im_start|>system``) is tokenized as plain text,
        so that nobody can forge turns; only the template's own markers are
        special. Content without such text is tokenized exactly as before."""
        source = self._template_source(add_generation_prompt, continue_final_message, chat_template)
        messages, tools = _for_template([_text_message(m) for m in messages], tools, source)

        def render(msgs: list[dict]) -> str:
            return self._render(source, msgs, tools, add_generation_prompt, continue_final_message, template_kwargs)

        contents = [m.get("content") for m in messages if isinstance(m.get("content"), str)]
        if not any(s in c for c in contents for s in self._special_texts):
            return self.encode(render(messages), add_special_tokens=False)
        # Mark where each content lands in the rendered prompt, then tokenize the
        # template's text with special tokens and the content without.
        mark = secrets.token_hex(8)
        opening, closing = f"\x02{mark}<", f">{mark}\x03"
        wrapped = [{**m, "content": opening + m["content"] + closing}
                   if isinstance(m.get("content"), str) else m for m in messages]
        text = render(wrapped)
        ids: list[int] = []
        for i, piece in enumerate(re.split(f"{re.escape(opening)}|{re.escape(closing)}", text)):
            if i % 2 == 0:
                ids += self.encode(piece, add_special_tokens=False) if piece else []
            elif piece:
                ids += self._plain_text.encode_batch([piece], add_special_tokens=False)[0].ids
        return ids

    @cached_property
    def _special_texts(self) -> list[str]:
        return [t.content for t in self._tk.get_added_tokens_decoder().values() if t.special]

    @cached_property
    def _plain_text(self) -> tokenizers.Tokenizer:
        """The same tokenizer, reading special-token text as ordinary text."""
        plain = tokenizers.Tokenizer.from_str(self._tk.to_str())
        plain.encode_special_tokens = True
        return plain

    def detokenizer(self, skip_special_tokens: bool = True) -> "IncrementalDetokenizer":
        return IncrementalDetokenizer(self, skip_special_tokens)


def _text_message(message: dict) -> dict:
    """A message whose content is OpenAI-style parts, with `content_text` as its content."""
    content = message.get("content")
    return {**message, "content": content_text(content)} if isinstance(content, list) else message


def content_text(parts: list) -> str:
    """OpenAI-style content parts as one string: the text parts joined by
    newlines (as vLLM joins them). The engine is text-only: any other part
    (an image, an audio clip) is a `ValueError`, never dropped."""
    for part in parts:
        if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
            raise ValueError(f"message content: only text parts ({{'type': 'text', 'text': ...}}) are "
                             f"supported, this model reads text (got {str(part)[:80]})")
    return "\n".join(part["text"] for part in parts)


def supports_tools(template: str) -> bool:
    """Whether a chat template renders tools itself: it reads a ``tools`` variable."""
    return re.search(r"\btools\b", template) is not None


def _for_template(messages: list[dict], tools: list[dict] | None,
                  source: str) -> tuple[list[dict], list[dict] | None]:
    """The messages and tools a template is given: as they are for a template
    with tool support, else tools, calls and results in Hermes text (`hermes_messages`)."""
    if supports_tools(source):
        return messages, tools
    if not tools and not any(m.get("role") == "tool" or m.get("tool_calls") for m in messages):
        return messages, None
    return hermes_messages(messages, tools or []), None


def tools_preamble(tools: list[dict]) -> str:
    """The system text that shows a model without a tool template its tools
    and how to call them (the Hermes / Qwen format)."""
    listed = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
    call = '{"name": <function name>, "arguments": <its arguments, a JSON object>}'
    return ("# Tools\n\nYou may call one or more of the functions below to answer the user. Their "
            f"signatures, as JSON, are inside <tools></tools>:\n<tools>\n{listed}\n</tools>\n\n"
            f"To call a function, write a JSON object with its name and arguments inside "
            f"{TOOL_CALL_OPEN}{TOOL_CALL_CLOSE} tags, one block per call:\n"
            f"{TOOL_CALL_OPEN}\n{call}\n{TOOL_CALL_CLOSE}\n\n"
            f"Each call's result comes back inside {TOOL_RESPONSE_OPEN}{TOOL_RESPONSE_CLOSE} tags.")


def hermes_messages(messages: list[dict], tools: list[dict]) -> list[dict]:
    """``messages`` for a template that knows only roles and text: the tools'
    preamble ends the system message (or is one, first), an assistant's
    ``tool_calls`` are written after its text as ``<tool_call>`` blocks, and
    each run of ``role: "tool"`` messages becomes one user turn of
    ``<tool_response>`` blocks (so that turns still alternate)."""
    out: list[dict] = []
    results: dict | None = None  # the user turn that the current run of tool results goes into
    for m in messages:
        if m.get("role") != "tool":
            results = None
            out.append({k: v for k, v in m.items() if k != "tool_calls"} | {"content": _content(m)})
            continue
        block = f"{TOOL_RESPONSE_OPEN}\n{m.get('content') or ''}\n{TOOL_RESPONSE_CLOSE}"
        if results is None:
            results = {"role": "user", "content": block}
            out.append(results)
        else:
            results["content"] += "\n" + block
    if tools:
        preamble = tools_preamble(tools)
        if out and out[0]["role"] == "system":
            out[0]["content"] = f"{out[0]['content']}\n\n{preamble}" if out[0]["content"] else preamble
        else:
            out.insert(0, {"role": "system", "content": preamble})
    return out


def _content(message: dict) -> str:
    """A message's text, with its tool calls (if any) written after it as ``<tool_call>`` blocks."""
    text = message.get("content") or ""
    for call in message.get("tool_calls") or ():
        function = call.get("function", call)
        block = json.dumps({"name": function.get("name"), "arguments": function.get("arguments")}, ensure_ascii=False)
        text += ("\n" if text else "") + f"{TOOL_CALL_OPEN}\n{block}\n{TOOL_CALL_CLOSE}"
    return text


def _up_to_final_message(text: str, messages: list[dict]) -> str:
    """``text`` cut where the last message's content ends in it (a template
    may trim the content: then where the trimmed content ends)."""
    final = messages[-1].get("content") if messages else None
    if not isinstance(final, str) or not final.strip():
        raise ValueError("continue_final_message needs a last message with text to continue")
    for piece in (final, final.strip()):
        at = text.rfind(piece)
        if at >= 0:
            return text[: at + len(piece)]
    raise ValueError("continue_final_message: the chat template does not render the last message's text")


@functools.lru_cache(maxsize=16)
def compile_chat_template(source: str):
    """The jinja2 template of ``source`` (the few a server sees stay compiled),
    or `ValueError` saying why it does not compile."""
    from jinja2.exceptions import TemplateError

    try:
        return _jinja_env().from_string(source)
    except TemplateError as e:
        raise ValueError(f"the chat template does not compile: {e}") from None


def _jinja_env():
    """A sandboxed environment configured like transformers' chat-template renderer."""
    from jinja2.exceptions import TemplateError
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str):
        raise TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys: bool = False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


class IncrementalDetokenizer:
    """Streams text token by token, emitting only complete UTF-8 characters.

    tokenizers' own ``DecodeStream`` does the work, one call into Rust a
    token (1.6-2.8 us against 4.4-7.8 for two decodes of a window from
    Python, SmolLM2's and Gemma 3's tokenizers, the same text on 206
    sequences: ``benchmarks/detokenize.py``, 2026-12-06): it decodes
    a window of the ids since its last emission and holds back a character
    whose bytes have not all arrived (e.g. byte-fallback <0xE2>). With
    ``skip_special_tokens`` the ids `Tokenizer.decode` drops
    (`Tokenizer.special_token_ids`) are never stepped. `finalize` emits
    what is still held back, its incomplete bytes as U+FFFD.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._stream = tokenizers.decoders.DecodeStream(skip_special_tokens=skip_special_tokens)
        self.ids: list[int] = []
        self._emitted = 0  # characters emitted so far
        self._held = False  # ids stepped since the last emission

    def add_token(self, token_id: int) -> str:
        """The newly completed text (possibly "")."""
        token_id = int(token_id)
        self.ids.append(token_id)
        if self._skip and token_id in self._tokenizer.special_token_ids:
            return ""
        piece = self._stream.step(self._tokenizer._tk, token_id)
        self._held = not piece
        if not piece:
            return ""
        self._emitted += len(piece)
        return piece

    def finalize(self) -> str:
        """Whatever is still held back (incomplete bytes decode as U+FFFD):
        the whole output decoded once, less what was emitted."""
        if not self._held:
            return ""
        self._held = False
        rest = self.text[self._emitted :]
        self._emitted += len(rest)
        return rest

    @property
    def text(self) -> str:
        """Everything decoded so far, held-back bytes included."""
        return self._tokenizer.decode(self.ids, skip_special_tokens=self._skip)
