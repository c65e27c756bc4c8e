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
indent, between tokens and once after the value (llama.cpp's ``space`` rule):
compact and pretty-printed JSON both fit, a model may end its line before its
end-of-sequence token, and it cannot wander into whitespace forever. Integers,
and the integer part of numbers, have at most 16 digits where the schema does
not bound them (llama.cpp's bound), fractions at most 10: a small model's run
of zeros must end. An object schema that lists its properties and says
nothing of others takes no others (vLLM's default backend's rule). All of it
in `bounded_schema`: what the grammar is compiled from, never the request's
schema, which every output still validates against.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, fields, replace

import llguidance

from pagedlm.options import OptionError

KINDS = ("json", "json_object", "regex", "choice", "grammar")
CHECKED = 256  # distinct constraints whose llguidance check is remembered (`_grammar_error`)
JSON_SPACE = r"(?: |\n[ \t]{0,20})"  # llama.cpp's space: one space, or a newline and an indent
JSON_WHITESPACE = JSON_SPACE + "?"  # between two tokens of a JSON value
WHITESPACE_OPTIONS = frozenset({"whitespace_flexible", "whitespace_pattern"})  # a schema's own x-guidance
MAX_DEPTH = 128  # a schema's nesting, as llguidance's own JSON parser takes it
NUMBER_BOUND = 10**16 - 1  # |an integer| with at most 16 digits (llama.cpp's json-schema-to-grammar)
# A number's fraction: at most 10 digits (llama.cpp: 16). As a multipleOf, the one way llguidance
# takes it; it refuses 1e-12 (a float it reads as 9999999999999998e-28: "too many digits").
FRACTION_STEP = 1e-10
# RFC 3339's full-time with at most 9 digits of a second's fraction (llama.cpp: 3) and no leap second
# (jsonschema's check refuses 23:59:60): llguidance's "time" takes any number of digits.
TIME_PATTERN = r"^([01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](\.[0-9]{1,9})?([Zz]|[+-]([01][0-9]|2[0-3]):[0-5][0-9])$"


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
        if self.__dict__.get("_checked"):  # (validated already: a large schema costs its walk once)
            return self
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
        error = _grammar_error(checked)
        if error:
            raise OptionError(_refusal(checked, error))
        checked.__dict__["_checked"] = True  # (not a field: equality, hash and replace() ignore it)
        return checked

    def __hash__(self) -> int:
        """Its canonical key's (a validated constraint's: a dict field makes
        the dataclass's own hash fail), so equal constraints, however
        spelled, share a cache entry (`_grammar_error`)."""
        return hash(self.key)

    @functools.cached_property
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
            return json_grammar(self.json if kind == "json" else {"type": "object"})
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(self.regex)
        if kind == "choice":
            return llguidance.grammar_from("choice", list(self.choice))
        try:
            return llguidance.grammar_from("grammar", self.grammar)
        except ValueError as e:  # GBNF that does not translate
            raise OptionError(f"grammar does not compile: {one_line(str(e))}") from None


def json_grammar(schema: dict) -> str:
    """A Lark grammar (llguidance's) of one JSON value valid against
    ``schema`` (compiled from `bounded_schema`), then at most one
    `JSON_SPACE`: a newline (and indent) or a space may end the output, the
    end-of-sequence token may follow the value or that space."""
    return llguidance.grammar_from("lark", f"start: value TRAIL?\nvalue: %json {json_rule(schema)}\n"
                                           f"TRAIL: /{JSON_SPACE}/")


def json_rule(schema: dict) -> str:
    """``schema`` as the text after a Lark ``%json``: `bounded_schema`,
    `JSON_WHITESPACE` between tokens unless its own
    ``x-guidance`` options say otherwise."""
    options = {"whitespace_pattern": JSON_WHITESPACE, **schema.get("x-guidance", {})}
    return json.dumps({**bounded_schema(schema), "x-guidance": options}, ensure_ascii=False)


# Keywords whose value is a subschema, a list of them, or a map of names to them.
_ONE_SCHEMA = ("additionalProperties", "items", "additionalItems", "contains", "not", "if", "then", "else",
               "propertyNames", "unevaluatedItems", "unevaluatedProperties")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems", "items")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def bounded_schema(schema: object) -> object:
    """``schema`` as the grammar is compiled from it: `_bounded`, its objects
    closed (`_closed`) unless something in it intersects schemas (``allOf``,
    a ``$ref`` beside other keywords), which closed branches would empty."""
    return _bounded(schema, close=not _intersects(schema))


def _intersects(schema: object) -> bool:
    """Whether llguidance would intersect two schemas somewhere in ``schema``."""
    if isinstance(schema, list):
        return any(_intersects(s) for s in schema)
    if not isinstance(schema, dict):
        return False
    if "allOf" in schema or ("$ref" in schema and len(set(schema) - {"$ref", "$defs", "definitions"}) > 0):
        return True
    return any(_intersects(v) for k, v in schema.items() if k not in ("enum", "const", "default", "examples"))


def _closed(schema: dict) -> bool:
    """An object schema that lists its ``properties``, says nothing of
    others and requires none beyond them: vLLM's xgrammar backend (its
    default; xgrammar's ``strict_mode``) and outlines take no other keys
    there, and so do we (a small model otherwise adds keys forever)."""
    required = schema.get("required", [])
    return isinstance(schema.get("properties"), dict) and not {
        "additionalProperties", "patternProperties", "unevaluatedProperties", "propertyNames", "maxProperties",
        "minProperties"} & set(schema) and isinstance(required, list) and set(required) <= set(schema["properties"])


def _bounded(schema: object, close: bool) -> object:
    """``schema`` with every ``integer`` or ``number`` it types given the
    bounds +-`NUMBER_BOUND` it lacks (a bound the schema sets, or a value it
    lists, is kept as is) and every ``number`` a ``multipleOf`` of
    `FRACTION_STEP` unless it has one: what a model writes then has at most
    16 digits before a decimal point and 10 after it, and no exponent
    (llguidance writes a bounded number without one); and a ``"format":
    "time"`` without a ``pattern`` written as `TIME_PATTERN`. Every output
    still validates against ``schema``."""
    if not isinstance(schema, dict):  # true / false, or a keyword's non-schema value
        return schema
    out = {}
    for key, value in schema.items():
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            value = {name: _bounded(sub, close) for name, sub in value.items()}
        elif key in _SCHEMA_LISTS and isinstance(value, list):
            value = [_bounded(sub, close) for sub in value]
        elif key in _ONE_SCHEMA:
            value = _bounded(value, close)
        out[key] = value
    if close and _closed(schema):
        out["additionalProperties"] = False
    if out.get("format") == "time" and "pattern" not in out:
        del out["format"]
        out["pattern"] = TIME_PATTERN
    types = schema.get("type")
    types = [types] if isinstance(types, str) else types if isinstance(types, list) else []
    if {"integer", "number"} & set(types) and "enum" not in schema and "const" not in schema:
        low = _number(schema.get("minimum"), schema.get("exclusiveMinimum"))
        high = _number(schema.get("maximum"), schema.get("exclusiveMaximum"))
        if not {"maximum", "exclusiveMaximum"} & set(schema) and (low is None or low < NUMBER_BOUND):
            out["maximum"] = NUMBER_BOUND
        if not {"minimum", "exclusiveMinimum"} & set(schema) and (high is None or high > -NUMBER_BOUND):
            out["minimum"] = -NUMBER_BOUND
        if "number" in types and "multipleOf" not in schema:
            out["multipleOf"] = FRACTION_STEP
    return out


def _number(*bounds: object) -> float | None:
    """The first of a schema's bounds that is a number (not a bool), else None."""
    return next((b for b in bounds if isinstance(b, (int, float)) and not isinstance(b, bool)), None)


def _schema(value: object) -> dict:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except (ValueError, RecursionError) as e:  # (nested past Python's recursion limit)
            raise OptionError(f"json must be a JSON schema: its text is not JSON ({e})") from None
    if not isinstance(value, dict):
        raise OptionError(f"json must be a JSON schema object (got {value!r:.80})")
    options = value.get("x-guidance", {})  # llguidance's options, read from the schema's top level
    if not isinstance(options, dict) or set(options) - WHITESPACE_OPTIONS:
        raise OptionError("json must be a JSON schema whose x-guidance sets at most "
                          f"{', '.join(sorted(WHITESPACE_OPTIONS))} (got {json.dumps(options)[:80]}): others let "
                          "the output fail the schema (lenient) or not be JSON (separators)")
    if (depth := _depth(value)) > MAX_DEPTH:  # (before anything walks it recursively)
        raise OptionError(f"json must be a JSON schema of at most {MAX_DEPTH} nested objects and arrays "
                          f"(got {depth})")
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError) as e:  # a set, an object, a NaN: not JSON
        raise OptionError(f"json must be a JSON schema: {e}") from None
    return value


def _depth(value: object) -> int:
    """How deeply ``value``'s dicts and lists nest (an object of scalars: 1), without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            deepest = max(deepest, depth)
            stack += [(v, depth + 1) for v in (item.values() if isinstance(item, dict) else item)]
    return deepest


@functools.lru_cache(maxsize=CHECKED)
def _grammar_error(constraint: Constraint) -> str:
    """What llguidance finds wrong with the (otherwise checked) ``constraint``
    ("" if it compiles), checked once per distinct constraint: a check takes
    milliseconds (a small schema: ~3 ms on an H100 machine's host), which
    every request that brings the constraint would pay again."""
    # A schema alone first: its error then reads as the schema's, not as the Lark wrapper's.
    error = constraint.kind == "json" and llguidance.LLMatcher.validate_grammar(
        llguidance.LLMatcher.grammar_from_json_schema(json.dumps(bounded_schema(constraint.json))))
    return error or llguidance.LLMatcher.validate_grammar(constraint.llguidance_grammar())


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
