"""The structured-output test corpus: 50+ JSON schemas (scalars with bounds,
lengths, patterns and formats; enums and consts; unions; arrays; nested,
closed and partly required objects; $ref, recursion, allOf), regexes and
choice lists. Used by tests/fast/test_structured.py (a random walk through
each grammar); kept apart so that a real-model test can share it (issue 22).
"""

STR = {"type": "string"}
INT = {"type": "integer"}
NUM = {"type": "number"}
BOOL = {"type": "boolean"}
# Not "format": "date": llguidance's is a regex that takes a February 29 of any year.
DATE = {"type": "string", "pattern": "^[0-9]{4}-(0[1-9]|1[0-2])-(0[1-9]|1[0-9]|2[0-8])$"}


def obj(properties: dict, required=None, **more) -> dict:
    """An object schema; every property required unless ``required`` says otherwise."""
    return {"type": "object", "properties": properties,
            "required": list(properties) if required is None else required, **more}


CLOSED = {"additionalProperties": False}

SCHEMAS = [
    STR, INT, NUM, BOOL, {"type": "null"}, {},
    {"type": "integer", "minimum": 0, "maximum": 9},
    {"type": "integer", "minimum": -50, "maximum": -10},
    {"type": "integer", "exclusiveMinimum": 100, "exclusiveMaximum": 105},
    {"type": "integer", "minimum": 1000},
    {"type": "number", "minimum": 0.5, "maximum": 1.5},
    {"type": "number", "exclusiveMinimum": -1, "exclusiveMaximum": 1},
    {"type": "number", "minimum": 1e3},
    {"type": "string", "minLength": 3, "maxLength": 8},
    {"type": "string", "maxLength": 1},
    {"type": "string", "pattern": "^[a-z]{2,5}-[0-9]{3}$"},
    {"type": "string", "pattern": "^(yes|no)$"},
    {"type": "string", "format": "time"},
    {"type": "string", "format": "email"},
    {"type": "string", "format": "uuid"},
    {"type": "string", "format": "ipv4"},
    {"enum": ["red", "green", "blue"]},
    {"enum": [1, "two", None, True, 3.5]},
    {"const": {"kind": "fixed", "n": [1, 2]}},
    {"type": ["string", "null"]},
    {"anyOf": [INT, {"type": "string", "maxLength": 4}]},
    {"oneOf": [{"type": "integer", "maximum": -1}, {"type": "string", "maxLength": 3}]},
    {"type": "array", "items": INT},
    {"type": "array", "items": STR, "minItems": 2, "maxItems": 4},
    {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 0},
    {"type": "array", "prefixItems": [INT, STR, BOOL], "items": False},
    {"type": "array", "items": {"type": "array", "items": {"type": "number", "minimum": 0}, "maxItems": 3}},
    obj({"name": STR}),
    obj({"name": STR, "age": {"type": "integer", "minimum": 0, "maximum": 150}}, **CLOSED),
    obj({"a": INT, "b": STR, "c": BOOL}, required=["b"], **CLOSED),
    obj({"a": INT, "b": STR}, required=[]),
    obj({"id": {"type": "string", "format": "uuid"}, "tags": {"type": "array", "items": STR, "maxItems": 3}}, **CLOSED),
    obj({"point": obj({"x": NUM, "y": NUM}, **CLOSED)}, **CLOSED),
    obj({"a": obj({"b": obj({"c": obj({"d": {"type": "integer", "minimum": 7, "maximum": 7}})})})}),
    obj({"items": {"type": "array", "items": obj({"sku": STR, "qty": {"type": "integer", "minimum": 1}}, **CLOSED),
                   "minItems": 1}}, **CLOSED),
    obj({"status": {"enum": ["ok", "error"]}, "code": {"type": "integer", "minimum": 100, "maximum": 599}}, **CLOSED),
    obj({"price": {"type": "number", "minimum": 0, "exclusiveMaximum": 1000}, "currency": {"const": "EUR"}}, **CLOSED),
    obj({"when": DATE, "note": {"type": ["string", "null"]}}, **CLOSED),
    obj({"x": {}}, **CLOSED),
    obj({"value": {"anyOf": [INT, STR, {"type": "null"}]}}, **CLOSED),
    obj({"shape": {"oneOf": [obj({"circle": {"type": "number", "minimum": 0}}, **CLOSED),
                             obj({"square": {"type": "number", "minimum": 0}}, **CLOSED)]}}),
    obj({"matrix": {"type": "array", "items": {"type": "array", "items": INT, "minItems": 2, "maxItems": 2},
                    "minItems": 2, "maxItems": 2}}, **CLOSED),
    obj({"name": STR}, additionalProperties=INT),
    obj({"name": {"type": "string", "minLength": 1, "maxLength": 20}, "email": {"type": "string", "format": "email"},
         "age": {"type": "integer", "minimum": 18, "maximum": 99}, "admin": BOOL},
        required=["name", "email"], **CLOSED),
    obj({"flag": BOOL, "count": {"type": "integer", "minimum": 0},
         "ratio": {"type": "number", "minimum": 0, "maximum": 1},
         "label": {"type": "string", "pattern": "^[A-Z][a-z]+$"}}, **CLOSED),
    obj({"tool": {"const": "search"}, "arguments": obj({"query": STR, "limit": {"type": "integer", "minimum": 1,
                                                                                "maximum": 10}}, **CLOSED)}, **CLOSED),
    {"type": "object", "minProperties": 1, "maxProperties": 2, "additionalProperties": INT},
    {"$defs": {"pos": {"type": "integer", "minimum": 1}}, **obj({"a": {"$ref": "#/$defs/pos"},
                                                                  "b": {"$ref": "#/$defs/pos"}}, **CLOSED)},
    {"$defs": {"node": {"type": "object", "properties": {"v": INT, "next": {"anyOf": [{"$ref": "#/$defs/node"},
                                                                                         {"type": "null"}]}},
                        "required": ["v", "next"], "additionalProperties": False}}, "$ref": "#/$defs/node"},
    {"allOf": [obj({"a": INT}), obj({"b": STR})]},
    obj({"events": {"type": "array", "maxItems": 3, "items": obj({
        "type": {"enum": ["click", "view"]}, "at": DATE,
        "meta": obj({"k": STR}, required=[], **CLOSED)}, **CLOSED)}}, **CLOSED),
]

REGEXES = [r"[0-9]{3}-[0-9]{4}", r"(cat|dog|bird)s?", r"[A-Z][a-z]{1,8}( [A-Z][a-z]{1,8})?", r"-?[1-9][0-9]{0,3}",
           r"[a-f0-9]{8}", r"(ab)+c", r"(true|false)", r"[a-z]{2,6}@[a-z]{2,6}\.(com|org)"]
CHOICES = [["yes", "no"], ["positive", "negative", "neutral"], ["a", "ab", "abc"], ["日本", "中文", "한국어"],
           ["Paris", "Paris, France"], ["with space", "with\nnewline", 'with "quote"']]
