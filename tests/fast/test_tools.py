"""Tool calling's parts without a server (pagedlm.server.tools): the Hermes
``<tool_call>`` parser on hand-written model outputs, whole and streamed in
every split, the grammar that forces calls (matched with llguidance over the
tiny byte-level tokenizer), and what ``tool_choice`` asks. The requests,
answers and errors over HTTP: tests/fast/test_server_structured.py."""

from __future__ import annotations

import json
import random

import llguidance
import pytest

from pagedlm.loading import resolve
from pagedlm.server.protocol import APIError, NamedToolChoice, ToolDefinition
from pagedlm.server.tools import (ToolCallStream, auto_constraint, check_tools, choose, parse_tool_calls,
                                  tool_constraint)
from pagedlm.structured import Constraint, llguidance_tokenizer
from pagedlm.tokenizer import TOOL_CALL_OPEN, Tokenizer, tools_preamble
from tests.helpers import tiny_tokenizer

WEATHER = {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
    "required": ["city"], "additionalProperties": False}}
ADD = {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
    "required": ["a", "b"], "additionalProperties": False}}
TOOLS = [{"type": "function", "function": WEATHER}, {"type": "function", "function": ADD}]


def call(name: str, arguments: dict, spaced: bool = True) -> str:
    body = json.dumps({"name": name, "arguments": arguments})
    return f"<tool_call>\n{body}\n</tool_call>" if spaced else f"<tool_call>{body}</tool_call>"


def calls_of(calls) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in calls]


# -- parsing -------------------------------------------------------------------


def test_one_call_and_the_text_around_it():
    content, calls = parse_tool_calls("Let me look.\n" + call("get_weather", {"city": "Paris"}) + "\nDone.")
    assert content == "Let me look.\n\nDone."
    assert calls_of(calls) == [("get_weather", {"city": "Paris"})]
    assert calls[0].id.startswith("call_") and len(calls[0].id) > 10
    assert calls[0].arguments == '{"city": "Paris"}'  # a JSON string, as OpenAI's arguments are


def test_two_calls_and_nothing_else_is_no_content():
    text = call("get_weather", {"city": "Paris"}) + "\n" + call("add", {"a": 1, "b": 2}, spaced=False) + "\n"
    content, calls = parse_tool_calls(text)
    assert content is None
    assert calls_of(calls) == [("get_weather", {"city": "Paris"}), ("add", {"a": 1, "b": 2})]
    assert calls[0].id != calls[1].id


@pytest.mark.parametrize("block", [
    '<tool_call>\n{"name": "add", "arguments": {"a": 1,}}\n</tool_call>',  # malformed JSON
    '<tool_call>["add", {"a": 1}]</tool_call>',  # not an object
    '<tool_call>{"name": "add"}</tool_call>',  # no arguments
    '<tool_call>{"name": "add", "arguments": "{\\"a\\": 1}"}</tool_call>',  # arguments not an object
    '<tool_call>{"name": "", "arguments": {}}</tool_call>',  # no name
])
def test_a_block_that_is_not_a_call_stays_text(block):
    text = "Sure. " + block + " " + call("add", {"a": 1, "b": 2})
    content, calls = parse_tool_calls(text)
    assert content == "Sure. " + block + " "
    assert calls_of(calls) == [("add", {"a": 1, "b": 2})]


def test_an_output_that_ends_inside_a_block():
    complete = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}'  # the closing tag never came
    assert calls_of(parse_tool_calls(complete)[1]) == [("add", {"a": 1, "b": 2})]
    cut = '<tool_call>\n{"name": "add", "argu'  # max_tokens cut it
    assert parse_tool_calls(cut) == (cut, [])
    closing = complete + "\n</tool_"  # cut inside the closing tag: the JSON is whole
    content, calls = parse_tool_calls(closing)
    assert content is None and calls_of(calls) == [("add", {"a": 1, "b": 2})]


def test_a_forced_call_cut_short_is_a_call_with_the_arguments_so_far():
    """tool_choice "required" or a named function, max_tokens reached inside the call: OpenAI and
    vLLM answer with the call, its arguments cut; text outside a call is none (the grammar forced it)."""
    partial = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b'
    for forced in ("", "add"):
        content, (cut,) = parse_tool_calls(partial, forced)
        assert content is None and (cut.name, cut.arguments) == ("add", '{"a": 1, "b')
    before_arguments = '<tool_call>\n{"name": "ad'
    content, (named,) = parse_tool_calls(before_arguments, "add")  # the request named the function
    assert content is None and (named.name, named.arguments) == ("add", "")
    assert parse_tool_calls(before_arguments, "") == (None, [])  # "required": no function named yet
    whole = call("add", {"a": 1, "b": 2}) + "\n" + partial  # a whole call, then one cut
    assert [(c.name, c.arguments) for c in parse_tool_calls(whole, "")[1]] == [
        ("add", '{"a": 1, "b": 2}'), ("add", '{"a": 1, "b')]
    assert parse_tool_calls(partial) == (partial, [])  # tool_choice "auto": a cut block is text


def test_text_without_calls_is_left_alone():
    for text in ["plain text", "a < b and <tool", "<tool_calls> is not the tag", "x </tool_call> y"]:
        assert parse_tool_calls(text) == (text, [])
    assert parse_tool_calls("  \n") == (None, [])


OUTPUTS = [
    "Let me look.\n" + call("get_weather", {"city": "Paris"}) + "\nDone.",
    call("get_weather", {"city": "Paris"}) + "\n" + call("add", {"a": 1, "b": 2}),
    "\n\n" + call("add", {"a": 1, "b": 2}) + "\n",
    "Sure. <tool_call>{not json}</tool_call> and <tool" + "_call>" + '{"name": "add", "arguments": {}}',
    "a < b, <tool_ and <tool_call {x} done",
    "\n  hello",
    "",
]


@pytest.mark.parametrize("text", OUTPUTS)
def test_a_stream_in_any_split_says_what_the_whole_output_says(text):
    want_content, want_calls = parse_tool_calls(text)
    rng = random.Random(0)
    splits = [[text[i: i + 1] for i in range(len(text))]]  # one character at a time
    for _ in range(20):
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(1, 6))))
        splits.append([text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])])
    for pieces in splits:
        stream, content, calls = ToolCallStream(), "", []
        for piece in pieces:
            sent, made = stream.feed(piece)
            content, calls = content + sent, calls + made
        sent, made = stream.finish()
        content, calls = content + sent, calls + made
        assert (content or None) == want_content and calls_of(calls) == calls_of(want_calls), pieces


def test_a_stream_holds_back_only_what_may_begin_a_tag_or_a_block():
    stream = ToolCallStream()
    assert stream.feed("Hi <too") == ("Hi ", [])  # "<too" may begin <tool_call>
    assert stream.feed("th") == ("<tooth", [])  # it did not
    assert stream.feed(' <tool_call>{"name": "add", ') == (" ", [])
    sent, made = stream.feed('"arguments": {"a": 1}}</tool_call> ok')
    assert sent == " ok" and calls_of(made) == [("add", {"a": 1})]
    assert stream.finish() == ("", [])


def test_whitespace_before_the_first_call_is_no_content_in_a_stream_too():
    stream = ToolCallStream()
    assert stream.feed("\n\n") == ("", [])
    sent, made = stream.feed(call("add", {"a": 1, "b": 2}) + "\n")
    assert sent == "" and len(made) == 1
    assert stream.finish() == ("", [])


# -- the grammar that forces calls -------------------------------------------------


@pytest.fixture(scope="module")
def ll_tokenizer():
    tok = tiny_tokenizer()
    return tok, llguidance_tokenizer(tok, tok.vocab_size)


def accepts(ll_tokenizer, constraint, text: str) -> bool:
    """Whether the constraint's grammar takes ``text`` whole (token by token, then EOS)."""
    tok, ll = ll_tokenizer
    matcher = llguidance.LLMatcher(ll, constraint.llguidance_grammar(), log_level=0)
    for token in tok.encode(text, add_special_tokens=False):
        if not matcher.consume_token(token):
            return False
    return matcher.is_accepting() and not matcher.is_error()


def test_a_named_function_is_one_call_of_it_with_valid_arguments(ll_tokenizer):
    forced = tool_constraint([WEATHER, ADD], [1], many=False)
    assert accepts(ll_tokenizer, forced, call("add", {"a": 1, "b": 2}))
    assert accepts(ll_tokenizer, forced, call("add", {"a": -5, "b": 0}, spaced=False))
    pretty = '<tool_call>\n{\n  "name": "add",\n  "arguments": {"a": 1, "b": 2}\n}\n</tool_call>'
    assert accepts(ll_tokenizer, forced, pretty)
    for wrong in [call("get_weather", {"city": "Paris"}),  # another function
                  call("add", {"a": 1}),  # a required argument missing
                  call("add", {"a": "1", "b": 2}),  # a string for an integer
                  call("add", {"a": 1, "b": 2, "c": 3}),  # additionalProperties: false
                  "Sure. " + call("add", {"a": 1, "b": 2}),  # text before
                  call("add", {"a": 1, "b": 2}) + "\n" + call("add", {"a": 1, "b": 2})]:  # two calls
        assert not accepts(ll_tokenizer, forced, wrong), wrong
    # a run of whitespace is bounded (a model cannot wander in it forever)
    wide = '<tool_call>{"name": "add", "arguments": {"a": 1,' + " " * 30 + '"b": 2}}</tool_call>'
    assert not accepts(ll_tokenizer, forced, wide)


def test_required_is_one_call_or_more_of_any_listed_function(ll_tokenizer):
    required = tool_constraint([WEATHER, ADD], [0, 1], many=True)
    one = call("get_weather", {"city": "Paris", "unit": "C"})
    two = one + "\n" + call("add", {"a": 1, "b": 2})
    assert accepts(ll_tokenizer, required, one) and accepts(ll_tokenizer, required, two)
    assert not accepts(ll_tokenizer, required, "")
    assert not accepts(ll_tokenizer, required, call("mul", {"a": 1}))
    assert not accepts(ll_tokenizer, required, call("get_weather", {"city": "Paris", "unit": "K"}))
    single = tool_constraint([WEATHER, ADD], [0, 1], many=False)  # parallel_tool_calls: false
    assert accepts(ll_tokenizer, single, one) and not accepts(ll_tokenizer, single, two)


@pytest.mark.parametrize("name", ["smollm2-135m-instruct", "gemma3-270m"])
def test_the_real_tokenizers_spell_the_tags_as_text_and_their_templates_get_the_hermes_format(name):
    """Neither built-in vocabulary has a <tool_call> token (the tags are text,
    which the sampler never bans), and neither template reads tools."""
    tok = Tokenizer.from_folder(resolve(name))
    assert tok.token_to_id("<tool_call>") is None and tok.token_to_id("</tool_call>") is None
    forced = tool_constraint([WEATHER, ADD], [1], many=False)
    assert accepts((tok, llguidance_tokenizer(tok, tok.vocab_size)), forced, call("add", {"a": 1, "b": 2}))
    history = [{"role": "user", "content": "1 + 2?"},
               {"role": "assistant", "content": "", "tool_calls": [
                   {"type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}]},
               {"role": "tool", "content": "3"}]
    text = tok.apply_chat_template(history, tools=TOOLS)
    assert tools_preamble(TOOLS) in text and call("add", {"a": 1, "b": 2}) in text
    assert "<tool_response>\n3\n</tool_response>" in text


def test_parameters_with_defs_keep_their_references(ll_tokenizer):
    """A pydantic model's schema (what the openai SDK sends) refers to its $defs."""
    point = {"name": "move", "parameters": {
        "type": "object", "$defs": {"Point": {"type": "object", "properties": {"x": {"type": "integer"}},
                                             "required": ["x"], "additionalProperties": False}},
        "properties": {"to": {"$ref": "#/$defs/Point"}}, "required": ["to"], "additionalProperties": False}}
    forced = tool_constraint([point], [0], many=False)
    assert accepts(ll_tokenizer, forced, call("move", {"to": {"x": 3}}))
    assert not accepts(ll_tokenizer, forced, call("move", {"to": {"y": 3}}))


def test_parameters_references_resolve_against_the_parameters(ll_tokenizer):
    """"#" and "#/properties/..." are the parameters' own root, as in the function's schema
    (they once resolved against the call's object around it, and checked the wrong thing)."""
    alias = {"name": "f", "parameters": {"type": "object", "properties": {
        "name": {"type": "integer"}, "b": {"$ref": "#/properties/name"}}, "required": ["name", "b"]}}
    forced = tool_constraint([alias], [0], many=False)
    assert accepts(ll_tokenizer, forced, call("f", {"name": 3, "b": 4}))
    assert not accepts(ll_tokenizer, forced, call("f", {"name": 3, "b": "f"}))
    tree = {"name": "tree", "parameters": {"type": "object", "properties": {
        "v": {"type": "integer"}, "child": {"$ref": "#"}}, "required": ["v"]}}
    forced = tool_constraint([tree], [0], many=False)
    assert accepts(ll_tokenizer, forced, call("tree", {"v": 1, "child": {"v": 2}}))
    assert not accepts(ll_tokenizer, forced, call("tree", {"v": 1, "child": {"name": "tree", "arguments": {"v": 2}}}))


def test_auto_with_a_strict_function_leaves_text_free_and_checks_the_calls(ll_tokenizer):
    """tool_choice "auto", a function with strict: true: the model writes what it likes, but a
    <tool_call> tag can only begin a call of a listed function, a strict one's arguments valid
    (the openai SDK's pydantic_function_tool sends strict: true)."""
    tools = [{"type": "function", "function": {**ADD, "strict": True}}, {"type": "function", "function": WEATHER}]
    auto = auto_constraint(tools, None, many=True)
    for text in ["", "Hello.", "3 < 4 and a <b>tag</b>, <tool <tool_cal <<", "Sure. " + call("add", {"a": 1, "b": 2}),
                 call("add", {"a": 1, "b": 2}) + " and " + call("get_weather", {"anything": [1]}) + " done"]:
        assert accepts(ll_tokenizer, auto, text), text
    for text in [call("add", {"a": "1", "b": 2}),  # a strict function's arguments checked
                 call("mul", {"a": 1}),  # only listed functions
                 "Sure <tool_call>junk</tool_call>"]:  # a tag that begins no call
        assert not accepts(ll_tokenizer, auto, text), text
    single = auto_constraint(tools, None, many=False)  # parallel_tool_calls: false
    assert accepts(ll_tokenizer, single, "a " + call("add", {"a": 1, "b": 2}))
    assert not accepts(ll_tokenizer, single, call("add", {"a": 1, "b": 2}) + call("add", {"a": 1, "b": 2}))
    assert not accepts(ll_tokenizer, single, call("add", {"a": 1, "b": 2}) + "<tool_call>junk")
    assert auto_constraint(TOOLS, None, many=True) is None  # no strict function: nothing to constrain


def test_auto_beside_a_json_answer_is_that_answer_or_calls(ll_tokenizer):
    """response_format (a JSON schema or object) with tools under "auto": the output is the
    answer or calls, as OpenAI's; the constraint alone would leave no room for a call."""
    answer = Constraint(json={"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]})
    for own in (answer.validate(), Constraint(json_object=True).validate()):
        both = auto_constraint(TOOLS, own, many=True)
        assert accepts(ll_tokenizer, both, '{"ok": true}')
        assert accepts(ll_tokenizer, both, call("add", {"a": 1, "b": 2}))
        assert not accepts(ll_tokenizer, both, "Sure.") and not accepts(ll_tokenizer, both, '[1]')
    assert not accepts(ll_tokenizer, auto_constraint(TOOLS, answer.validate(), many=True), '{"ok": 1}')
    regex = Constraint(regex="[a-z]+").validate()
    assert auto_constraint(TOOLS, regex, many=True) is regex  # a regex holds the output, as without tools
    strict = [{"type": "function", "function": {**ADD, "strict": True}}]
    with pytest.raises(APIError) as e:
        auto_constraint(strict, regex, many=True)
    assert e.value.param == "tools[0].function.strict"


def test_a_function_without_parameters_takes_an_empty_object(ll_tokenizer):
    forced = tool_constraint([{"name": "now"}], [0], many=False)
    assert accepts(ll_tokenizer, forced, call("now", {}))
    assert not accepts(ll_tokenizer, forced, call("now", {"tz": "UTC"}))


def test_parameters_llguidance_cannot_follow_are_a_400_naming_the_function():
    odd = {"name": "odd", "parameters": {"type": "object", "properties": {"a": {"not": {"type": "string"}}}}}
    with pytest.raises(APIError) as e:
        tool_constraint([WEATHER, odd], [0, 1], many=True)
    assert e.value.param == "tools[1].function.parameters"
    assert e.value.message.startswith("tools[1].function.parameters is not a JSON schema pagedlm can follow")


# -- tool_choice ----------------------------------------------------------------


def test_what_each_tool_choice_asks():
    tools = check_tools([ToolDefinition.model_validate(t) for t in TOOLS])
    assert tools == TOOLS  # as sent: what the chat template gets
    assert choose(tools, None) == (True, None)  # auto, when there are tools
    assert choose(tools, "auto") == (True, None)
    assert choose(tools, "none") == (False, None)  # the template still shows the tools (vLLM's default)
    assert choose(None, None) == (False, None) and choose(None, "auto") == (False, None)
    parse, forced = choose(tools, "required")
    assert parse and forced.kind == "grammar" and '"\\"get_weather\\""' in forced.grammar
    assert '"\\"add\\""' in forced.grammar and 'call ("\\n"? call)*' in forced.grammar
    assert "call ("not in choose(tools, "required", parallel=False)[1].grammar
    parse, forced = choose(tools, NamedToolChoice.model_validate({"type": "function", "function": {"name": "add"}}))
    assert parse and '"\\"add\\""' in forced.grammar and "get_weather" not in forced.grammar


def test_llm_chat_renders_tools(model, tokenizer):
    from pagedlm import LLM
    from pagedlm.params import SamplingParams

    llm = LLM(model, tokenizer=tokenizer, max_model_len=1024)
    (out,) = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=2), use_tqdm=False, tools=TOOLS)
    assert out.prompt.startswith(f"<|im_start|>system\n{tools_preamble(TOOLS)}<|im_end|>\n<|im_start|>user\nhi")
    assert out.prompt_token_ids == tokenizer.encode_chat([{"role": "user", "content": "hi"}], tools=TOOLS)


def test_text_under_strict_auto_is_what_the_model_writes_without_it(model, tokenizer):
    """Greedy rows of the tiny model, "<" pushed up so that their text is full of them: with a
    strict function under "auto" the text is token for token what it is without the grammar
    (the grammar only binds a <tool_call> tag, which none of these writes). The rows keep to
    ASCII tokens: the grammar's text is UTF-8, and the random model strews lone bytes."""
    from pagedlm import LLM
    from pagedlm.params import SamplingParams

    llm = LLM(model, tokenizer=tokenizer, max_model_len=1024)
    tools = [{"type": "function", "function": {**ADD, "strict": True}}]
    strict = auto_constraint(tools, None, many=True)
    (lt,) = tokenizer.encode("<", add_special_tokens=False)
    prompts = [[5 + i, 17, 3 * i + 1] for i in range(4)]
    ascii = [i for i in range(tokenizer.vocab_size) if (t := tokenizer.decode([i])) and t.isascii()]
    free, bound = ([SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, logit_bias={lt: bias},
                                   allowed_token_ids=ascii, structured_outputs=c) for bias in (0.0, 4.0)]
                   for c in (None, strict))
    outs = [llm.generate([{"prompt_token_ids": p} for p in prompts for _ in range(2)], params, use_tqdm=False)
            for params in ([q for _ in prompts for q in free], [q for _ in prompts for q in bound])]
    texts = [o.outputs[0].text for o in outs[0]]
    assert sum(t.count("<") for t in texts) >= 10 and not any(TOOL_CALL_OPEN in t for t in texts)
    assert [o.outputs[0].token_ids for o in outs[1]] == [o.outputs[0].token_ids for o in outs[0]]
