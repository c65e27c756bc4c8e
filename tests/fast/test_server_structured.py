"""Structured output and tool calling at the server, over the tiny model:
which request field becomes which `SamplingParams.structured_outputs` (the
planner's output), every 400 they add, the chat answers' ``tool_calls``
whole and streamed (the shapes fed by hand), and the `openai` client.

The tests named ``test_e2e_*`` generate under a constraint: they need the
engine's wiring of issue 22 (a sequence's matcher built in add_request,
advanced per token, the row ended "stop" when its grammar completes and
"error" when it dead-ends).
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import jsonschema
import openai
import pydantic
import pytest

from pagedlm.params import SamplingParams
from pagedlm.server.planner import Plan
from pagedlm.server.protocol import APIError, ChatRequest, CompletionRequest, parse
from pagedlm.server.responses import ChatShape
from pagedlm.structured import Constraint
from tests.fast.server_helpers import error_of, serving
from tests.helpers import CHATML

# A chat template with tool support that names the tools only: prompts stay
# short for the tiny model (the Hermes preamble of a template without tool
# support is tests/fast/test_tokenizer.py's).
TEMPLATE = "{% for t in tools or [] %}{{ t.function.name }};{% endfor %}" + CHATML
CHAT = [{"role": "user", "content": "hi"}]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
LARK = 'start: "x" /[0-9]{2}/'
ADD = {"type": "function", "function": {"name": "add", "description": "a + b", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                     "b": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["a", "b"], "additionalProperties": False}}}
LOOKUP = {"type": "function", "function": {"name": "lookup", "parameters": {
    "type": "object", "properties": {"key": {"enum": ["red", "green"]}}, "required": ["key"],
    "additionalProperties": False}}}
TOOLS = [ADD, LOOKUP]
NAMED_ADD = {"type": "function", "function": {"name": "add"}}


@pytest.fixture(scope="module")
def served(model, tokenizer):
    with serving(model, tokenizer, max_model_len=512, chat_template=TEMPLATE) as pair:
        yield pair


@pytest.fixture
def client(served):
    return served[0]


@pytest.fixture
def planner(served):
    return served[1]


def plan(planner, path: str, **body) -> Plan:
    if path == "chat":
        return planner.plan_chat(parse(ChatRequest, json.dumps({"messages": CHAT, "max_tokens": 4, **body}).encode()))
    return planner.plan_completion(parse(CompletionRequest, json.dumps({"prompt": "x", **body}).encode()))


# -- request fields -> SamplingParams.structured_outputs ----------------------------

MAPPED = {  # case: (request fields, the constraint they ask for; None: none)
    "response_format text": ({"response_format": {"type": "text"}}, None),
    "response_format json_object": ({"response_format": {"type": "json_object"}}, Constraint(json_object=True)),
    "response_format json_schema": ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "person", "schema": SCHEMA, "strict": True}}}, Constraint(json=SCHEMA)),
    "structured_outputs json": ({"structured_outputs": {"json": SCHEMA}}, Constraint(json=SCHEMA)),
    "structured_outputs json_object": ({"structured_outputs": {"json_object": True}}, Constraint(json_object=True)),
    "structured_outputs regex": ({"structured_outputs": {"regex": "[a-z]+"}}, Constraint(regex="[a-z]+")),
    "structured_outputs choice": ({"structured_outputs": {"choice": ["yes", "no"]}}, Constraint(choice=["yes", "no"])),
    "structured_outputs grammar": ({"structured_outputs": {"grammar": LARK, "disable_fallback": True,
                                                           "whitespace_pattern": None}}, Constraint(grammar=LARK)),
    "guided_json": ({"guided_json": SCHEMA}, Constraint(json=SCHEMA)),
    "guided_json as text": ({"guided_json": json.dumps(SCHEMA)}, Constraint(json=SCHEMA)),
    "guided_regex": ({"guided_regex": "[a-z]+"}, Constraint(regex="[a-z]+")),
    "guided_choice": ({"guided_choice": ["yes", "no"]}, Constraint(choice=["yes", "no"])),
    "guided_grammar": ({"guided_grammar": LARK}, Constraint(grammar=LARK)),
    "guided_decoding_backend guidance": ({"guided_regex": "a", "guided_decoding_backend": "guidance"},
                                         Constraint(regex="a")),
}


@pytest.mark.parametrize("path", ["chat", "completions"])
@pytest.mark.parametrize("case", MAPPED)
def test_each_field_asks_for_its_constraint_in_every_choice(planner, path, case):
    fields, expected = MAPPED[case]
    options = plan(planner, path, n=2, **fields).options
    assert len(options) == 2
    for p in options:
        assert p.structured_outputs == (None if expected is None else expected.validate())


def test_tool_choice_asks_for_parsing_and_forced_calls(planner):
    auto = plan(planner, "chat", tools=TOOLS)
    assert auto.parse_tool_calls and auto.options[0].structured_outputs is None
    none = plan(planner, "chat", tools=TOOLS, tool_choice="none")
    assert not none.parse_tool_calls and none.options[0].structured_outputs is None
    assert none.prompts == auto.prompts  # "none" still shows the tools (vLLM's default)
    assert planner.tokenizer.decode(auto.prompts[0]).startswith("add;lookup;")
    assert not plan(planner, "chat").parse_tool_calls
    assert auto.forced_tool is None and none.forced_tool is None
    required_plan = plan(planner, "chat", tools=TOOLS, tool_choice="required")
    required = required_plan.options[0].structured_outputs
    assert required.kind == "grammar" and r'\"add\"' in required.grammar and r'\"lookup\"' in required.grammar
    named_plan = plan(planner, "chat", tools=TOOLS, tool_choice=NAMED_ADD)
    named = named_plan.options[0].structured_outputs
    assert named.kind == "grammar" and r'\"add\"' in named.grammar and "lookup" not in named.grammar
    assert required_plan.forced_tool == "" and named_plan.forced_tool == "add"
    single = plan(planner, "chat", tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    assert not single.parallel_tool_calls and single.options[0].structured_outputs != required


def test_auto_constrains_only_for_strict_functions_or_a_json_answer(planner):
    """tool_choice "auto": strict functions' calls are checked (the text around them free); a JSON
    response_format beside tools is that answer or calls; a guided regex holds the output as it is."""
    strict = [{"type": "function", "function": {**ADD["function"], "strict": True}}, LOOKUP]
    auto = plan(planner, "chat", tools=strict)
    grammar = auto.options[0].structured_outputs.grammar
    assert auto.parse_tool_calls and auto.forced_tool is None and grammar.startswith("start: text? (call text?)*")
    answer = plan(planner, "chat", tools=TOOLS, response_format={"type": "json_object"})
    assert answer.options[0].structured_outputs.grammar.startswith("start: answer | call")
    regex = plan(planner, "chat", tools=TOOLS, guided_regex="[a-z]+").options[0].structured_outputs
    assert regex == Constraint(regex="[a-z]+").validate()
    with pytest.raises(APIError) as e:
        plan(planner, "chat", tools=strict, guided_regex="[a-z]+")
    assert (e.value.status, e.value.param) == (400, "tools[0].function.strict")


def test_tool_history_renders_through_the_template(planner):
    """A past call's arguments (JSON text on the wire) reach the template as an object, as transformers'."""
    history = [*CHAT, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "3"}]
    template = ("{{ tools | length }} tools|{% for m in messages %}{{ m.role }}:{{ m.content }}"
                "{% for c in m.tool_calls or [] %}{{ c.id }}={{ c.function.name }}{{ c.function.arguments | tojson }}"
                "{% endfor %}{{ m.tool_call_id or '' }}|{% endfor %}")
    ids = planner.plan_chat(parse(ChatRequest, json.dumps(
        {"messages": history, "tools": TOOLS, "chat_template": template, "max_tokens": 2}).encode())).prompts[0]
    assert planner.tokenizer.decode(ids) == '2 tools|user:hi|assistant:call_1=add{"a": 1, "b": 2}|tool:3call_1|'


# -- 400s ----------------------------------------------------------------------------------

_JSON_SCHEMA = {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}
BAD = {  # case: (path, body fields, the param the error names)
    "a schema llguidance cannot follow": ("chat", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "objectx"}}}}, "response_format.json_schema.schema"),
    "json_schema without its schema": ("chat", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x"}}}, "response_format.json_schema.schema"),
    "json_schema without json_schema": ("completions", {"response_format": {"type": "json_schema"}},
                                        "response_format.json_schema"),
    "json_schema without a name": ("chat", {"response_format": {"type": "json_schema", "json_schema": {
        "schema": SCHEMA}}}, "response_format.json_schema.name"),
    "an unknown response_format": ("chat", {"response_format": {"type": "xml"}}, "response_format.type"),
    "guided_json not a schema": ("completions", {"guided_json": {"type": "integer", "not": {}}}, "guided_json"),
    "guided_json text not JSON": ("completions", {"guided_json": "{"}, "guided_json"),
    "guided_regex that does not compile": ("completions", {"guided_regex": "a{3"}, "guided_regex"),
    "guided_grammar that does not compile": ("chat", {"guided_grammar": "start: foo"}, "guided_grammar"),
    "guided_choice empty": ("chat", {"guided_choice": []}, "guided_choice"),
    "structured_outputs regex": ("chat", {"structured_outputs": {"regex": "(?=a)"}}, "structured_outputs.regex"),
    "structured_outputs two kinds": ("chat", {"structured_outputs": {"regex": "a", "choice": ["a"]}},
                                     "structured_outputs"),
    "structured_outputs no kind": ("completions", {"structured_outputs": {}}, "structured_outputs"),
    "structured_outputs whitespace_pattern": ("chat", {"structured_outputs": {
        "json": SCHEMA, "whitespace_pattern": " "}}, "structured_outputs.whitespace_pattern"),
    "structured_outputs structural_tag": ("chat", {"structured_outputs": {"structural_tag": "{}"}},
                                          "structured_outputs.structural_tag"),
    "structured_outputs disable_any_whitespace": ("chat", {"structured_outputs": {
        "json": SCHEMA, "disable_any_whitespace": True}}, "structured_outputs.disable_any_whitespace"),
    "structured_outputs an unknown key": ("chat", {"structured_outputs": {"jsn": SCHEMA}}, "structured_outputs.jsn"),
    "response_format and a guided field": ("completions", {"response_format": {"type": "json_object"},
                                                           "guided_regex": "a"}, "guided_regex"),
    "two guided fields": ("chat", {"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
    "structured_outputs and a guided field": ("chat", {"structured_outputs": {"regex": "a"}, "guided_json": SCHEMA},
                                              "guided_json"),
    "response_format and a forced tool call": ("chat", {"response_format": _JSON_SCHEMA, "tools": TOOLS,
                                                        "tool_choice": "required"}, "tool_choice"),
    "guided_decoding_backend xgrammar": ("chat", {"guided_decoding_backend": "xgrammar"}, "guided_decoding_backend"),
    "guided_whitespace_pattern": ("completions", {"guided_whitespace_pattern": " "}, "guided_whitespace_pattern"),
    "llama.cpp's grammar": ("completions", {"grammar": LARK}, "grammar"),
    "llama.cpp's json_schema": ("completions", {"json_schema": SCHEMA}, "json_schema"),
    # tools
    "tools on completions": ("completions", {"tools": TOOLS}, "tools"),
    "tool_choice on completions": ("completions", {"tool_choice": "auto"}, "tool_choice"),
    "functions": ("chat", {"functions": [ADD["function"]]}, "functions"),
    "function_call": ("chat", {"function_call": "auto"}, "function_call"),
    "a tool that is not a function": ("chat", {"tools": [{"type": "code", "function": {"name": "f"}}]},
                                      "tools[0].type"),
    "a tool without its function": ("chat", {"tools": [{"type": "function"}]}, "tools[0].function"),
    "a function name OpenAI refuses": ("chat", {"tools": [{"type": "function", "function": {"name": "a b"}}]},
                                       "tools[0].function.name"),
    "a function given twice": ("chat", {"tools": [ADD, ADD]}, "tools[1].function.name"),
    "parameters not an object's schema": ("chat", {"tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "string"}}}]}, "tools[0].function.parameters"),
    "parameters without a type": ("chat", {"tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"properties": {}}}}]}, "tools[0].function.parameters"),
    "parameters llguidance cannot follow": ("chat", {"tools": [LOOKUP, {"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {"a": {"not": {}}}}}}], "tool_choice": "required"},
        "tools[1].function.parameters"),
    "tool_choice naming an unknown function": ("chat", {"tools": TOOLS, "tool_choice": {
        "type": "function", "function": {"name": "mul"}}}, "tool_choice"),
    "tool_choice naming a non-function": ("chat", {"tools": TOOLS, "tool_choice": {
        "type": "code", "function": {"name": "add"}}}, "tool_choice.type"),
    "tool_choice required without tools": ("chat", {"tool_choice": "required"}, "tool_choice"),
    "a json_schema beside type json_object": ("chat", {"response_format": {"type": "json_object", "json_schema": {
        "name": "x", "schema": {"type": "object"}}}}, "response_format.json_schema"),
    "a json_schema beside type text": ("chat", {"response_format": {"type": "text", "json_schema": {
        "name": "x", "schema": {"type": "object"}}}}, "response_format.json_schema"),
    "llguidance's lenient option in the schema": ("chat", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"enum": ["a", "b"], "not": {"const": "a"}, "x-guidance": {"lenient": True}}}}},
        "response_format.json_schema.schema"),
    "a json_schema name OpenAI refuses": ("chat", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "a b!", "schema": {"type": "object"}}}}, "response_format.json_schema.name"),
    "tool_choice auto without tools": ("chat", {"tool_choice": "auto"}, "tool_choice"),
    "tool_choice required with no tools": ("chat", {"tools": [], "tool_choice": "required"}, "tool_choice"),
    "a schema nested deeper than llguidance reads": (  # (as text: Python's recursion limit, not the body's)
        "chat", {"guided_json": '{"type": "object", "properties": {"a": ' * 300 + "{}" + "}}" * 300},
        "guided_json"),
    "tool_choice named without tools": ("chat", {"tool_choice": NAMED_ADD}, "tool_choice"),
    "tool_choice of another word": ("chat", {"tools": TOOLS, "tool_choice": "always"}, "tool_choice"),
    "chat_template_kwargs setting tools": ("chat", {"chat_template_kwargs": {"tools": TOOLS}}, "chat_template_kwargs"),
}
BAD_MESSAGES = {  # case: (messages, the param the error names)
    "tool_calls on a user's message": ([{"role": "user", "content": "hi", "tool_calls": [
        {"type": "function", "function": {"name": "add", "arguments": "{}"}}]}], "messages[0].tool_calls"),
    "a past call without its function": ([*CHAT, {"role": "assistant", "tool_calls": [{}]}],
                                         "messages[1].tool_calls[0].function"),
    "a past call whose arguments are not JSON": ([*CHAT, {"role": "assistant", "tool_calls": [
        {"type": "function", "function": {"name": "add", "arguments": "{a: 1}"}}]}],
        "messages[1].tool_calls[0].function.arguments"),
    "a past call that is not a function's": ([*CHAT, {"role": "assistant", "tool_calls": [
        {"type": "code", "function": {"name": "add", "arguments": "{}"}}]}], "messages[1].tool_calls[0].type"),
    "tool_call_id on a user's message": ([{"role": "user", "content": "hi", "tool_call_id": "call_1"}],
                                         "messages[0].tool_call_id"),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_structured_or_tool_input_is_a_400_naming_the_field(client, case):
    path, fields, param = BAD[case]
    body = {"messages": CHAT} if path == "chat" else {"prompt": "x"}
    r = client.post(f"/v1/{'chat/' if path == 'chat' else ''}completions", json={**body, "max_tokens": 2, **fields})
    error = error_of(r, 400, param)
    assert error["type"] == "invalid_request_error"
    assert error["message"].startswith(param.split(".")[0].split("[")[0]) or case.startswith("json_schema without")


@pytest.mark.parametrize("case", BAD_MESSAGES)
def test_bad_tool_history_is_a_400_naming_the_message(client, case):
    messages, param = BAD_MESSAGES[case]
    r = client.post("/v1/chat/completions", json={"messages": messages, "tools": TOOLS, "max_tokens": 2})
    error = error_of(r, 400, param)  # (asserts the status and that the error names param)
    assert error["type"] == "invalid_request_error" and error["message"].startswith(param.split(".")[0])


def test_messages_too_deep_to_render_are_a_400(planner, monkeypatch):
    """A past call's arguments nested nearly as deep as Python's recursion limit parse, then
    overflow the stack as the template renders them (at a depth that depends on the caller's)."""
    def overflow(*args, **kwargs):
        raise RecursionError("maximum recursion depth exceeded")
    monkeypatch.setattr(planner.tokenizer, "encode_chat", overflow)
    with pytest.raises(APIError) as e:
        plan(planner, "chat")
    assert (e.value.status, e.value.param) == (400, "messages") and "too deeply" in e.value.message


def test_fields_that_ask_for_nothing_are_accepted(client):
    for fields in [{"response_format": {"type": "text"}}, {"tool_choice": "none"}, {"tools": [], "tool_choice": "none"},
                   {"tools": [], "tool_choice": "auto"}, {"tools": []}, {"guided_decoding_backend": "auto"},
                   {"structured_outputs": None},
                   {"parallel_tool_calls": False}]:
        r = client.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 1, **fields})
        assert r.status_code == 200, (fields, r.text)
    r = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1, "parallel_tool_calls": True})
    assert r.status_code == 200, r.text


# -- the answers' tool_calls (the shapes, fed by hand) ------------------------------------


def shaped(tokenizer, steps: list[str], finish: str = "stop", **plan_fields) -> tuple[dict, list[dict]]:
    """(the whole response, the stream's chunks) of one choice whose steps
    produced ``steps``, the last one finishing ``finish``."""
    fields = dict(prompts=[[5]], options=[SamplingParams().validate()], stream=False, include_usage=False,
                  paged=False, parse_tool_calls=True) | plan_fields
    whole, streamed = ChatShape(Plan(**fields), tokenizer, "tiny"), ChatShape(Plan(**fields), tokenizer, "tiny")
    chunks = []
    for i, text in enumerate(steps):
        last = i == len(steps) - 1
        resp = SimpleNamespace(text=text, token=0, logprob=None, prompt_tokens=1, generation_tokens=i + 1,
                               cached_tokens=0, paged_kv=False, finish_reason=finish if last else None,
                               prompt_logprobs=None, seq=SimpleNamespace(stop_reason=None))
        whole.add(0, resp)
        chunks.append(streamed.chunk(0, resp))
    return whole.response(), chunks


def reassembled(chunks: list[dict]) -> tuple[str, list[dict], str]:
    """(content, tool calls, finish_reason) as the openai SDK's stream helpers put them together."""
    content, calls, finish = "", {}, None
    for chunk in chunks:
        (choice,) = chunk["choices"]
        delta = choice["delta"]
        content += delta.get("content") or ""
        for d in delta.get("tool_calls") or []:
            call = calls.setdefault(d["index"], {"id": d["id"], "type": d["type"],
                                                 "function": {"name": "", "arguments": ""}})
            call["function"]["name"] += d["function"]["name"]
            call["function"]["arguments"] += d["function"]["arguments"]
        finish = choice["finish_reason"] or finish
    return content, [calls[i] for i in sorted(calls)], finish


TWO_CALLS = ["Let me", " add.\n<tool", '_call>\n{"name": "add", "arguments": {"a": 1, ', '"b": 2}}\n</tool_call>',
             '\n<tool_call>{"name": "lookup", "arguments": {"key": "red"}}</tool_call>', "\n"]


def test_calls_are_tool_calls_and_finish_tool_calls_whole_and_streamed(tokenizer):
    whole, chunks = shaped(tokenizer, TWO_CALLS)
    (choice,) = whole["choices"]
    message = choice["message"]
    assert choice["finish_reason"] == "tool_calls"
    assert message["content"] == "Let me add.\n\n\n"  # the text outside the blocks, as written
    assert [(c["type"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]] \
        == [("function", "add", {"a": 1, "b": 2}), ("function", "lookup", {"key": "red"})]
    assert all(c["id"].startswith("call_") for c in message["tool_calls"])
    content, calls, finish = reassembled(chunks)
    assert finish == "tool_calls" and content == message["content"]
    assert [c["function"] for c in calls] == [c["function"] for c in message["tool_calls"]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert [c["choices"][0]["finish_reason"] for c in chunks[:-1]] == [None] * (len(chunks) - 1)
    # each call is one delta, sent when its block closes
    with_calls = [c["choices"][0]["delta"]["tool_calls"] for c in chunks if "tool_calls" in c["choices"][0]["delta"]]
    assert [[d["index"] for d in ds] for ds in with_calls] == [[0], [1]]


def test_only_calls_is_null_content(tokenizer):
    whole, chunks = shaped(tokenizer, ["\n<tool", *TWO_CALLS[2:]])
    assert whole["choices"][0]["message"]["content"] is None
    assert reassembled(chunks)[0] == ""


def test_parallel_tool_calls_false_keeps_the_first_call(tokenizer):
    whole, chunks = shaped(tokenizer, TWO_CALLS, parallel_tool_calls=False)
    assert [c["function"]["name"] for c in whole["choices"][0]["message"]["tool_calls"]] == ["add"]
    assert [c["function"]["name"] for c in reassembled(chunks)[1]] == ["add"]


def test_a_choice_cut_by_length_stays_length_and_keeps_its_cut_block_as_text(tokenizer):
    steps = [*TWO_CALLS[:4], '\n<tool_call>{"name": "lookup", "argu']
    whole, chunks = shaped(tokenizer, steps, finish="length")
    (choice,) = whole["choices"]
    assert choice["finish_reason"] == "length"
    assert [c["function"]["name"] for c in choice["message"]["tool_calls"]] == ["add"]
    assert choice["message"]["content"] == 'Let me add.\n\n<tool_call>{"name": "lookup", "argu'
    content, calls, finish = reassembled(chunks)
    assert content == choice["message"]["content"] and finish == "length"
    assert [c["function"]["name"] for c in calls] == ["add"]


def test_a_named_call_finishes_stop_and_a_forced_call_cut_short_is_still_a_call(tokenizer):
    """vLLM's answers (OpenAI's too): a named function's call finishes "stop"; a forced call that
    max_tokens cut is a call whose arguments are cut, the choice "length"."""
    whole, chunks = shaped(tokenizer, ["<tool", *TWO_CALLS[2:4]], forced_tool="add")
    (choice,) = whole["choices"]
    assert choice["finish_reason"] == "stop" and choice["message"]["tool_calls"][0]["function"]["name"] == "add"
    assert reassembled(chunks)[2] == "stop"
    for forced in ("add", ""):
        whole, chunks = shaped(tokenizer, ["<tool_call>\n", '{"name": "add", "arguments": {"a": 1, '],
                               finish="length", forced_tool=forced)
        (choice,) = whole["choices"]
        assert choice["finish_reason"] == "length" and choice["message"]["content"] is None
        (call,) = choice["message"]["tool_calls"]
        assert (call["function"]["name"], call["function"]["arguments"]) == ("add", '{"a": 1,')
        content, calls, finish = reassembled(chunks)
        assert (content, finish) == ("", "length") and [c["function"] for c in calls] == [call["function"]]


def test_malformed_calls_and_requests_without_tools_are_text(tokenizer):
    broken = ['Sure <tool_call>{"name": "add", "arguments": {"a": 1,}}</tool_call>']
    whole, chunks = shaped(tokenizer, broken)
    assert whole["choices"][0]["message"] == {"role": "assistant", "content": broken[0]}  # no tool_calls key
    assert whole["choices"][0]["finish_reason"] == "stop" and reassembled(chunks)[:2] == (broken[0], [])
    whole, chunks = shaped(tokenizer, TWO_CALLS, parse_tool_calls=False)  # no tools, or tool_choice "none"
    assert whole["choices"][0]["message"] == {"role": "assistant", "content": "".join(TWO_CALLS)}
    assert whole["choices"][0]["finish_reason"] == "stop" and reassembled(chunks) == ("".join(TWO_CALLS), [], "stop")


# -- end to end: these need the engine's wiring (issue 22) ---------------------------------


def chat_choice(client, **body) -> dict:
    r = client.post("/v1/chat/completions", json={"messages": CHAT, **body})
    assert r.status_code == 200, r.text
    (choice,) = r.json()["choices"]
    return choice


def test_e2e_each_kind_constrains_the_output(client):
    assert chat_choice(client, guided_choice=["yes", "no"], max_tokens=20)["message"]["content"] in ("yes", "no")
    text = client.post("/v1/completions", json={"prompt": "x", "guided_regex": "[a-d]{3}-[0-9]{2}",
                                                "max_tokens": 20}).json()["choices"][0]
    assert text["finish_reason"] == "stop" and len(text["text"]) == 6 and text["text"][3] == "-"
    out = chat_choice(client, structured_outputs={"grammar": LARK}, max_tokens=20)["message"]["content"]
    assert out[0] == "x" and out[1:].isdigit() and len(out) == 3
    for fields in ({"response_format": _JSON_SCHEMA}, {"guided_json": SCHEMA}):
        choice = chat_choice(client, max_tokens=300, **fields)
        assert choice["finish_reason"] == "stop"
        jsonschema.validate(json.loads(choice["message"]["content"]), SCHEMA)
    anything = chat_choice(client, response_format={"type": "json_object"}, max_tokens=300, temperature=1.0, seed=3)
    assert anything["finish_reason"] == "stop" and isinstance(json.loads(anything["message"]["content"]), dict)


def test_e2e_n_choices_each_follow_the_constraint(client):
    r = client.post("/v1/completions", json={"prompt": "x", "guided_choice": ["alpha", "beta", "gamma"], "n": 3,
                                             "temperature": 1.0, "seed": 0, "max_tokens": 10})
    assert {c["text"] for c in r.json()["choices"]} <= {"alpha", "beta", "gamma"}


def test_e2e_a_grammar_may_name_a_control_token(client):
    """The sampler leaves control tokens to a constrained row's grammar."""
    choice = chat_choice(client, guided_grammar='start: <|im_start|> "ok"', skip_special_tokens=False, max_tokens=5)
    assert choice["message"]["content"] == "<|im_start|>ok" and choice["finish_reason"] == "stop"


def test_e2e_a_grammar_that_dead_ends_finishes_error(client, caplog):
    """allowed_token_ids leave nothing the grammar allows: the choice ends, "error", never a
    hang, and the log names the request by its response's id."""
    z = client.post("/tokenize", json={"prompt": "z", "add_special_tokens": False}).json()["tokens"]
    with caplog.at_level("WARNING", logger="pagedlm.structured"):
        r = client.post("/v1/chat/completions", json={"messages": CHAT, "guided_choice": ["yes"],
                                                      "allowed_token_ids": z, "max_tokens": 5})
    (choice,) = r.json()["choices"]
    assert choice["finish_reason"] == "error" and choice["message"]["content"] == ""
    assert any(r.json()["id"] in record.getMessage() and "dead-ends" in record.getMessage()
               for record in caplog.records)


def test_e2e_a_named_function_is_called_whole_and_streamed_alike(client):
    body = {"messages": CHAT, "tools": TOOLS, "tool_choice": NAMED_ADD, "max_tokens": 300}
    (choice,) = client.post("/v1/chat/completions", json=body).json()["choices"]
    assert choice["finish_reason"] == "stop" and choice["message"]["content"] is None
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "add"
    jsonschema.validate(json.loads(call["function"]["arguments"]), ADD["function"]["parameters"])
    chunks = [json.loads(line[6:]) for line in client.post("/v1/chat/completions", json={**body, "stream": True})
              .text.splitlines() if line.startswith("data: {")]
    content, calls, finish = reassembled(chunks)
    assert (content, finish) == ("", "stop") and [c["function"] for c in calls] == [call["function"]]


def test_e2e_required_calls_listed_functions_with_valid_arguments(client):
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    choice = chat_choice(client, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, max_tokens=300,
                         temperature=1.0, seed=1)
    assert choice["finish_reason"] == "tool_calls" and len(choice["message"]["tool_calls"]) == 1
    many = chat_choice(client, tools=TOOLS, tool_choice="required", max_tokens=300, temperature=1.0, seed=2)
    assert many["message"]["tool_calls"]
    for call in choice["message"]["tool_calls"] + many["message"]["tool_calls"]:
        jsonschema.validate(json.loads(call["function"]["arguments"]), schemas[call["function"]["name"]])


@pytest.fixture
def sdk(client):
    return openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=client, max_retries=0)


def test_e2e_the_openai_client_gets_a_required_tool_call_whole_and_streamed(sdk):
    asked = dict(model="tiny", messages=CHAT, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
                 max_tokens=300)
    out = sdk.chat.completions.create(**asked)
    (call,) = out.choices[0].message.tool_calls
    assert out.choices[0].finish_reason == "tool_calls" and call.type == "function"
    schema = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}[call.function.name]
    jsonschema.validate(json.loads(call.function.arguments), schema)
    names, arguments = {}, {}
    for chunk in sdk.chat.completions.create(**asked, stream=True):
        for d in chunk.choices[0].delta.tool_calls or []:
            names[d.index] = names.get(d.index, "") + (d.function.name or "")
            arguments[d.index] = arguments.get(d.index, "") + (d.function.arguments or "")
    assert names == {0: call.function.name} and arguments == {0: call.function.arguments}


def test_e2e_the_openai_client_parses_a_pydantic_response_format(sdk):
    class Person(pydantic.BaseModel):
        name: str = pydantic.Field(max_length=6)
        age: int = pydantic.Field(ge=0, le=120)

    out = sdk.chat.completions.parse(model="tiny", messages=CHAT, response_format=Person, max_tokens=300)
    person = out.choices[0].message.parsed
    assert isinstance(person, Person) and len(person.name) <= 6 and 0 <= person.age <= 120


def test_e2e_the_openai_client_sends_vllms_fields_in_extra_body(sdk):
    out = sdk.completions.create(model="tiny", prompt="x", max_tokens=10, extra_body={"guided_choice": ["up", "down"]})
    assert out.choices[0].text in ("up", "down")
    with pytest.raises(openai.BadRequestError) as e:
        sdk.completions.create(model="tiny", prompt="x", max_tokens=10,
                               extra_body={"guided_regex": "a", "guided_choice": ["a"]})
    assert e.value.body["param"] == "guided_choice"
