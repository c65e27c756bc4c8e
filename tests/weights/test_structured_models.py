"""Structured output on the real models (CPU, float32): every constrained
output of SmolLM2-135M-Instruct and Gemma 3 270M ends by its grammar or the
model's end-of-sequence token (finish_reason "stop") and parses and
validates against its schema, greedy and sampled (a seed per row); regex
and choice outputs match exactly. A row that reaches MAX_TOKENS is a failure.

One batched call per model covers the whole corpus (tests/schemas.py) in
both modes, as a server's rows share steps: rows of different grammars,
greedy beside sampled, on the paged store with prefix caching (the worked
examples are one shared prefix, prefilled once).

The prompts show worked examples, then the row's own schema (or regex, or
choices). SmolLM2 is an instruct model and gets its chat template; Gemma 3
270M here is the base model and gets them as plain text, each answer on the
line after a label.

How the rows sample, and why: sampled rows use llama.cpp's default sampler
(temperature 0.8, top-k 40, top-p 0.95, min-p 0.05); every row, greedy or
sampled, a frequency penalty of 1. Models this small loop inside what a
schema allows and nothing in the grammar ends (engines do not bound free
strings, arrays without maxItems or recursion: docs/design/structured-output.md,
"Bounds that make a row end"): greedy SmolLM2 nested a linked list forever,
greedy Gemma counted `[1, 2, 3, ...`, and at temperature 1 both wrote
strings of noise. With the penalty on greedy rows only, 4 (SmolLM2) and 5
(Gemma) of the 142 rows ran to MAX_TOKENS; the prompts' header and examples
were also written against these outputs (the header's email example came
after a sampled SmolLM2 row wrote a URL where an email was due). No output is filtered: each
one stops and validates, or fails. The longest that stopped took 133 tokens.
"""

from __future__ import annotations

import json
import re
from typing import Any, Callable, NamedTuple

import jsonschema
import pytest

from pagedlm.llm import LLM
from pagedlm.params import SamplingParams
from tests.schemas import CHOICES, REGEXES, SCHEMAS

pytestmark = pytest.mark.weights

MODELS = ["smollm2-135m-instruct", "gemma3-270m"]
CHAT_MODELS = {"smollm2-135m-instruct"}
MAX_TOKENS = 192
FREQUENCY_PENALTY = 1.0
GREEDY = {"temperature": 0.0}
SAMPLED = {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05}  # llama.cpp's default sampler
FORMATS = jsonschema.Draft202012Validator.FORMAT_CHECKER


class Task(NamedTuple):
    """What a prompt asks for: no worked example is a schema, regex or choice list of the corpus."""

    header: str
    ask: Callable[[Any], str]  # the question about one item
    label: str  # in plain text, the answer follows this line
    shots: list[tuple[Any, str]]  # (item, answer) worked examples


JSON_TASK = Task("Answer with one short JSON value that matches the schema: strings of a word or two (an email "
                 "like a@b.org), arrays of one to three items, null where the schema allows it.",
                 lambda schema: "Schema: " + json.dumps(schema, separators=(",", ":")), "JSON:",
                 [({"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}}},
                   '{"name": "Ann", "age": 31}'),
                  ({"type": "array", "items": {"type": "number"}}, "[2.5, 7]"),
                  ({"type": "string", "minLength": 2}, '"hello"'),
                  ({"type": "object", "properties": {"mail": {"type": "string", "format": "email"},
                                                     "parts": {"type": "array", "items": {"type": "string"}}}},
                   '{"mail": "bo@x.org", "parts": ["lid", "cap"]}'),
                  ({"type": "object", "properties": {"id": {"type": "integer"},
                                                     "parent": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}}},
                   '{"id": 4, "parent": null}')])
REGEX_TASK = Task("Answer with a short text that the regular expression matches in full.",
                  lambda regex: "Regex: " + regex, "Text:",
                  [(r"[a-z]{3}[0-9]", "abc1"), (r"(red|blue) car", "red car"), (r"[A-F]{2}-[0-9]+", "CA-12")])
CHOICE_TASK = Task("Answer with exactly one of the options.",
                   lambda options: "Options: " + " | ".join(json.dumps(o, ensure_ascii=False) for o in options),
                   "Answer:", [(["up", "down"], "down"), (["cold", "warm", "hot"], "warm"), (["1", "22"], "22")])


class Row(NamedTuple):
    task: Task
    item: Any  # a schema, a regex or a list of choices
    schema: dict | None  # what a JSON row's output must validate against
    params: SamplingParams


def _rows() -> list[Row]:
    """The corpus in both modes: every schema (and a json_object row), regex and choice list."""
    rows = []
    for sampled in (False, True):
        def params(constraint: dict, seed: int) -> SamplingParams:
            return SamplingParams(max_tokens=MAX_TOKENS, **(SAMPLED if sampled else GREEDY), seed=seed,
                                  frequency_penalty=FREQUENCY_PENALTY, structured_outputs=constraint)

        rows += [Row(JSON_TASK, s, s, params({"json": s}, i)) for i, s in enumerate(SCHEMAS)]
        rows.append(Row(JSON_TASK, {"type": "object"}, {"type": "object"}, params({"json_object": True}, 0)))
        rows += [Row(REGEX_TASK, r, None, params({"regex": r}, i)) for i, r in enumerate(REGEXES)]
        rows += [Row(CHOICE_TASK, c, None, params({"choice": c}, i)) for i, c in enumerate(CHOICES)]
    return rows


def _prompt(name: str, task: Task, item):
    """A conversation (chat models) or a text: the header, the worked examples, then ``item``."""
    if name in CHAT_MODELS:
        messages = [{"role": "system", "content": task.header}]
        for shot, answer in task.shots:
            messages += [{"role": "user", "content": task.ask(shot)}, {"role": "assistant", "content": answer}]
        return messages + [{"role": "user", "content": task.ask(item)}]
    shots = "".join(f"{task.ask(shot)}\n{task.label}\n{answer}\n\n" for shot, answer in task.shots)
    return f"{task.header}\n\n{shots}{task.ask(item)}\n{task.label}\n"


def _run(name: str, model, tokenizer) -> tuple[LLM, list[Row], list]:
    """(the LLM, the rows, each row's completion) of one batched call over every row."""
    rows = _rows()
    llm = LLM(model, tokenizer=tokenizer, paged_kv=True, max_num_seqs=len(rows))
    run = llm.chat if name in CHAT_MODELS else llm.generate
    outputs = run([_prompt(name, r.task, r.item) for r in rows], [r.params for r in rows], use_tqdm=False)
    return llm, rows, [out.outputs[0] for out in outputs]


@pytest.fixture(scope="module", params=MODELS)
def served(request, float32_model) -> tuple[str, LLM, list[Row], list]:
    # the float32 model shared, read only (tests/weights/conftest.py)
    return request.param, *_run(request.param, *float32_model(request.param))


def _problem(row: Row, out) -> str | None:
    """Why ``out`` does not answer ``row``, or None."""
    if out.finish_reason != "stop":
        return f"finish_reason {out.finish_reason!r}"
    if row.task is REGEX_TASK:
        return None if re.fullmatch(row.item, out.text) else "does not match"
    if row.task is CHOICE_TASK:
        return None if out.text in row.item else "is not a choice"
    try:
        jsonschema.validate(json.loads(out.text), row.schema, format_checker=FORMATS)
    except (ValueError, jsonschema.ValidationError) as e:
        return f"{type(e).__name__}: {str(e).splitlines()[0]}"
    return None


def _failures(rows: list[Row], outputs: list, keep: Callable[[Row], bool]) -> tuple[int, list[str]]:
    """(rows kept, one line per kept row whose output fails)."""
    kept = [(i, row, out) for i, (row, out) in enumerate(zip(rows, outputs)) if keep(row)]
    lines = [f"row {i} {json.dumps(row.item, ensure_ascii=False)[:100]}: {problem} after {len(out.token_ids)} "
             f"tokens: {out.text[:160]!r}" for i, row, out in kept if (problem := _problem(row, out)) is not None]
    return len(kept), lines


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_every_json_output_stops_and_validates(served, sampled):
    name, llm, rows, outputs = served
    assert llm.engine.paged_kv and llm.engine.cache_stats().prefix_hit_tokens > 0  # the examples prefilled once
    n, failures = _failures(rows, outputs, lambda r: r.task is JSON_TASK and (r.params.temperature > 0) == sampled)
    assert n == len(SCHEMAS) + 1
    assert not failures, f"{name}, {len(failures)} of {n} rows:\n" + "\n".join(failures)


def test_regex_and_choice_outputs_match_exactly(served):
    """Greedy and sampled rows of every regex and choice list."""
    name, llm, rows, outputs = served
    n, failures = _failures(rows, outputs, lambda r: r.task is not JSON_TASK)
    assert n == 2 * (len(REGEXES) + len(CHOICES))
    assert not failures, f"{name}, {len(failures)} of {n} rows:\n" + "\n".join(failures)
