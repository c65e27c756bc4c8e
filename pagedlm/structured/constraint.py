"""What a request constrains its output to: `Constraint` (vLLM's
``structured_outputs`` shape), checked once and turned into an llguidance grammar.

Exactly one kind per constraint:

- ``json``: a JSON schema (a dict, or its JSON text); llguidance's dialect
  (draft 2020-12 with ``$ref``/``$defs``, ``anyOf``/``oneOf``, bounds, lengths,
  ``pattern``, ``format``, ``enum``/``const``, ``additionalProperties``); a
  keyword it does not implement (``not``, ``if``/``then``, ``uniqueItems``, ...)
  is refused rather than ignored, so that every output validates;
- ``json_object``: any JSON object (OpenAI's ``response_format: json_object``);
- ``regex``: the whole output matches it (Rust ``regex`` syntax: no look-around,
  no backreferences);
- ``choice``: the output is one of these strings, exactly;
- ``grammar``: a Lark grammar in llguidance's dialect (``start:`` rule,
  ``/regex/`` terminals, ``%json {...}`` inlined schemas; see llguidance's
  docs/syntax.md), or a llama.cpp GBNF grammar (``root ::= ...``), which
  llguidance translates to Lark; the two are told apart by their syntax.

JSON output may put a space, or a newline and up to 20 spaces or tabs of
indent, between tokens (llama.cpp's rule): compact and pretty-printed JSON both
fit, and a model cannot wander into whitespace forever.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields, replace

import llguidance

from pagedlm.options import OptionError

KINDS = ("json", "json_object", "regex", "choice", "grammar")
JSON_WHITESPACE = r"(?: |\n[ \t]{0,20})?"


@dataclass(frozen=True)
class Constraint:
    """One of the five kinds (see the module docstring); `validate` checks it."""

    json: dict | str | None = None  # a JSON schema
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | list[str] | None = None
    grammar: str | None = None  # Lark (llguidance's dialect) or GBNF

    @property
    def kind(self) -> str | None:
        """The one kind set (None while there are two or none: `validate` refuses those)."""
        kinds = self._kinds()
        return kinds[0] if len(kinds) == 1 else None

    def _kinds(self) -> list[str]:
        return [f.name for f in fields(self) if getattr(self, f.name) not in (None, False)]

    def validate(self) -> "Constraint":
        """A checked copy in one spelling (a schema as a dict, choices as a
        tuple); `OptionError` (a `ValueError`) naming the field and why, in one
        line: two kinds or none, a value of the wrong type, an empty choice
        list, a schema, regex or grammar llguidance cannot compile."""
        kinds = self._kinds()
        if len(kinds) != 1:
            got = ", ".join(kinds) if kinds else "none"
            raise OptionError(f"a constraint must set exactly one of {', '.join(KINDS)} (got {got})")
        kind = kinds[0]
        checked = self
        if kind == "json":
            checked = replace(self, json=_schema(self.json))
        elif kind == "json_object" and self.json_object is not True:
            raise OptionError(f"json_object must be true or false (got {self.json_object!r})")
        elif kind in ("regex", "grammar") and not isinstance(getattr(self, kind), str):
            raise OptionError(f"{kind} must be a string (got {getattr(self, kind)!r})")
        elif kind == "grammar" and not self.grammar.strip():
            raise OptionError("grammar must not be empty")
        elif kind == "choice":
            if not isinstance(self.choice, (list, tuple)) or not all(isinstance(c, str) for c in self.choice):
                raise OptionError(f"choice must be a list of strings (got {self.choice!r})")
            if not self.choice:
                raise OptionError("choice must hold at least one string (got [])")
            checked = replace(self, choice=tuple(self.choice))
        error = llguidance.LLMatcher.validate_grammar(checked.llguidance_grammar())
        if error:
            raise OptionError(_refusal(checked, error))
        return checked

    @property
    def key(self) -> str:
        """The canonical form of a validated constraint: equal constraints,
        however spelled (key order in a schema), have equal keys."""
        kind = self.kind
        if kind == "json":
            return "json:" + json.dumps(self.json, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
        if kind == "json_object":
            return "json_object"
        if kind == "choice":
            return "choice:" + json.dumps(list(self.choice), ensure_ascii=False)
        return f"{kind}:{getattr(self, kind)}"

    def llguidance_grammar(self) -> str:
        """The grammar llguidance compiles (its JSON grammar format)."""
        kind = self.kind
        if kind in ("json", "json_object"):
            schema = self.json if kind == "json" else {"type": "object"}
            return llguidance.LLMatcher.grammar_from_json_schema(
                schema, defaults={"whitespace_pattern": JSON_WHITESPACE})
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(self.regex)
        if kind == "choice":
            return llguidance.grammar_from("choice", list(self.choice))
        try:
            return llguidance.grammar_from("grammar", self.grammar)
        except ValueError as e:  # GBNF that does not translate
            raise OptionError(f"grammar does not compile: {one_line(str(e))}") from None


def _schema(value: object) -> dict:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise OptionError(f"json must be a JSON schema: its text is not JSON ({e})") from None
    if not isinstance(value, dict):
        raise OptionError(f"json must be a JSON schema object (got {value!r:.80})")
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError) as e:  # a set, an object, a NaN: not JSON
        raise OptionError(f"json must be a JSON schema: {e}") from None
    return value


def _refusal(constraint: Constraint, error: str) -> str:
    kind = constraint.kind
    if kind == "regex":
        return f"regex {constraint.regex!r} does not compile: {_reason(error)}"
    if kind == "json":
        return f"json is not a JSON schema pagedlm can follow: {one_line(error)}"
    if kind == "choice":
        return f"choice does not compile: {one_line(error)}"
    return f"grammar does not compile: {one_line(error)}"


def _reason(error: str) -> str:
    """The ``error: ...`` line of a Rust regex error, else its first line."""
    lines = [line.strip() for line in error.splitlines() if line.strip()]
    return next((line[len("error:"):].strip() for line in lines if line.startswith("error:")), lines[0])


def one_line(error: str) -> str:
    """llguidance's message in one line of at most 300 characters (one lists
    every special token: 6,000 for Gemma): its first line, and for a regex
    error (a schema's ``pattern``, a grammar's terminal) the pattern and why."""
    line = _first_line(error)
    return line if len(line) <= 300 else line[:299] + "…"


def _first_line(error: str) -> str:
    lines = [line.strip() for line in error.splitlines() if line.strip()]
    if not lines:
        return "llguidance gave no reason"
    first = lines[0]
    if first == "regex parse error:" and len(lines) > 1:  # Rust's regex crate: the pattern, a caret, "error: why"
        return f"regex /{lines[1]}/: {_reason(error)}"
    if first.endswith(" regex parse error:"):  # a grammar's terminal: the first line names the regex
        return f"{first[: -len(' regex parse error:')]} {_reason(error)}"
    return first
