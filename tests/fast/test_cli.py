"""The command line beyond its one-line errors (tests/fast/test_options.py):
--version, --help's defaults, the flags shared with vLLM, and `generate` /
`chat` run on a tiny model (``pagedlm.cli._load`` monkeypatched)."""

from __future__ import annotations

import argparse
import json
import importlib.metadata
import io
import signal

import pytest

from pagedlm import cli
from pagedlm import options as opt
from pagedlm.batch.engine import LLMEngine
from pagedlm.cli import build_parser, main


@pytest.fixture
def tiny_load(monkeypatch, model, tokenizer):
    """`generate` and `chat` load the tiny model of tests/fast/conftest.py."""
    monkeypatch.setattr(cli, "_load", lambda args: (model, tokenizer))
    return model, tokenizer


def _parsers(parser: argparse.ArgumentParser):
    """``parser`` and every subcommand's parser, depth first."""
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _parsers(sub)


def test_version_prints_the_package_version(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out == f"pagedlm {importlib.metadata.version('pagedlm')}\n"


def test_every_option_help_says_its_default(capsys):
    missing = []
    for parser in _parsers(build_parser()):
        formatter = parser._get_formatter()
        for action in parser._actions:
            if not action.option_strings or action.default is argparse.SUPPRESS:  # positionals, --help, --version
                continue
            if "default" not in formatter._expand_help(action):
                missing.append(f"{parser.prog} {action.option_strings[0]}")
    assert not missing, missing
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "most tokens to generate (default: 256)" in out
    assert "(env PAGEDLM_ATTENTION_BACKEND; default auto)" in out
    assert "(env PAGEDLM_ENFORCE_EAGER; default off)" in out


def test_enable_prefix_caching_is_vllms_spelling_of_prefix_caching():
    parse = build_parser().parse_args
    assert parse(["generate", "--enable-prefix-caching", "x"]).prefix_caching is True
    assert parse(["generate", "--no-enable-prefix-caching", "x"]).prefix_caching is False
    assert parse(["serve", "--no-enable-prefix-caching"]).prefix_caching is False


@pytest.mark.parametrize("argv", [["generate", "x"], ["chat"], ["bench", "decode"], ["bench", "throughput"],
                                  ["bench", "memory"], ["bench", "prefix"], ["serve"]])
def test_max_model_len_is_one_engine_flag_of_every_command(argv):
    args = build_parser().parse_args([*argv[:2], "--max-model-len", "96", *argv[2:]])
    if argv[0] == "serve":
        flags = {name: getattr(args, name) for name in vars(args)}
        assert opt.ServerOptions.resolve(flags, {}).engine.max_model_len == 96
    else:
        assert cli._engine_options(args).max_model_len == 96


def test_generate_max_model_len_bounds_the_request(tiny_load, capsys):
    assert main(["generate", "--max-model-len", "16", "--max-tokens", "8", "a longer prompt than that"]) == 2
    assert "exceeds max_model_len (16)" in capsys.readouterr().err


def test_generate_reads_standard_input_as_utf8_whatever_the_locale(tiny_load, monkeypatch):
    _, tokenizer = tiny_load
    seen = []
    monkeypatch.setattr(tokenizer, "encode", lambda text, **kw: seen.append(text) or [ord(c) % 200 for c in text])
    # a Latin-1 locale's sys.stdin would decode the two bytes of "é" as two characters
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO("café".encode()), encoding="latin-1"))
    assert main(["generate", "--max-tokens", "2", "-"]) == 0
    assert seen == ["café"]


def test_generate_says_on_stderr_which_kv_store_runs(tiny_load, capsys):
    assert main(["generate", "--max-tokens", "2", "hi"]) == 0
    assert "pagedlm: per-row KV caches (paging off), attention torch\n" in capsys.readouterr().err  # the CPU default
    assert main(["generate", "--paged-kv", "--paged-kv-block-size", "32", "--no-prefix-caching",
                 "--max-tokens", "2", "hi"]) == 0
    err = capsys.readouterr().err
    assert "pagedlm: paged KV in 32-token blocks (prefix caching off, KV none), attention torch\n" in err


def test_a_long_prefill_shows_its_progress_on_stderr_only(tiny_load, capsys, monkeypatch):
    prompt = "hello world, " * 8
    argv = ["generate", "--max-num-batched-tokens", "8", "--max-tokens", "4", prompt]
    assert main(argv) == 0
    quiet = capsys.readouterr()
    assert "prefill" not in quiet.err  # a prefill under PREFILL_BAR_AFTER_S shows nothing
    monkeypatch.setattr(cli, "PREFILL_BAR_AFTER_S", 0.0)
    assert main(argv) == 0
    shown = capsys.readouterr()
    assert shown.out == quiet.out  # the text on stdout is the same
    assert "prefill:" in shown.err and "tok" in shown.err


def _chat(monkeypatch, lines, interrupt_at_step=None):
    """Run `pagedlm chat` on ``lines`` (then Ctrl-C at the prompt); Ctrl-C
    arrives after the engine's step number ``interrupt_at_step``. The
    conversations the model was given, one per reply."""
    feed = iter(lines)

    def fake_input(prompt=""):
        line = next(feed, None)
        if line is None:
            raise KeyboardInterrupt  # Ctrl-C at the >>> prompt
        return line

    monkeypatch.setattr("builtins.input", fake_input)
    steps = [0]
    real_step = LLMEngine.step

    def step(self):
        out = real_step(self)
        steps[0] += 1
        if steps[0] == interrupt_at_step:
            signal.raise_signal(signal.SIGINT)
        return out

    monkeypatch.setattr(LLMEngine, "step", step)
    return steps


def _record_conversations(tokenizer, monkeypatch) -> list:
    """The messages of each turn, as the chat hands them to the template."""
    conversations = []
    real_encode_chat = tokenizer.encode_chat
    monkeypatch.setattr(tokenizer, "encode_chat",
                        lambda messages, *a, **kw: conversations.append(list(messages))
                        or real_encode_chat(messages, *a, **kw))
    return conversations


def test_chat_ctrl_c_stops_the_reply_keeps_the_conversation_and_the_chat(tiny_load, monkeypatch, capsys):
    _, tokenizer = tiny_load
    before = signal.getsignal(signal.SIGINT)  # Python's default_int_handler (ignored where the runner started so)
    conversations = _record_conversations(tokenizer, monkeypatch)
    # step 1 prefills "hello" and samples the first token, step 2 the second: Ctrl-C there
    steps = _chat(monkeypatch, ["hello", "and then?"], interrupt_at_step=2)
    assert main(["chat", "--max-tokens", "40"]) == 0  # Ctrl-C at the prompt still quits, cleanly
    out = capsys.readouterr()
    first_reply = out.out.split("\n")[0]
    assert "prompt: " in out.err and "generation: 2 tokens" in out.err  # the reply stopped after its step
    assert len(conversations) == 2 and steps[0] > 2  # and the chat went on to the next message
    assert conversations[1] == [{"role": "user", "content": "hello"},
                                {"role": "assistant", "content": first_reply},
                                {"role": "user", "content": "and then?"}]
    assert signal.getsignal(signal.SIGINT) is before  # Ctrl-C is Ctrl-C again


def test_chat_reset_says_so_and_starts_over(tiny_load, monkeypatch, capsys):
    _, tokenizer = tiny_load
    conversations = _record_conversations(tokenizer, monkeypatch)
    _chat(monkeypatch, ["hi", "/reset", "yo"])
    assert main(["chat", "--max-tokens", "2", "--system", "be brief"]) == 0
    assert "conversation reset\n" in capsys.readouterr().err
    assert conversations[1] == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "yo"}]


def test_an_empty_system_message_is_a_system_message(tiny_load, monkeypatch):
    """--system '' sends an empty system turn (the template's default system prompt does not
    replace it), as the server does with {"role": "system", "content": ""}."""
    _, tokenizer = tiny_load
    conversations = _record_conversations(tokenizer, monkeypatch)
    _chat(monkeypatch, ["hi", "/reset", "yo"])
    assert main(["chat", "--max-tokens", "2", "--system", ""]) == 0
    assert conversations[1] == [{"role": "system", "content": ""}, {"role": "user", "content": "yo"}]
    assert main(["generate", "--chat", "--max-tokens", "2", "--system", "", "hi"]) == 0
    assert conversations[-1] == [{"role": "system", "content": ""}, {"role": "user", "content": "hi"}]


# ---------------------------------------------------------------- constraints


@pytest.mark.parametrize("command", [["generate"], ["chat"]])
def test_constraint_flags_are_exclusive_and_choice_repeats(command, capsys):
    prompt = ["x"] if command == ["generate"] else []
    args = build_parser().parse_args([*command, "--choice", "yes", "--choice", "no", *prompt])
    assert args.choice == ["yes", "no"]
    assert main([*command, "--regex", "a+", "--json-schema", "s.json", *prompt]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--json-schema: not allowed with argument --regex" in err


@pytest.mark.parametrize("flag,content,message", [
    ("--json-schema", None, "--json-schema {path}: cannot read it (No such file or directory)"),
    ("--grammar", None, "--grammar {path}: cannot read it (No such file or directory)"),
    ("--json-schema", "{not json", "--json-schema {path} is not JSON (Expecting property name"),
    ("--json-schema", '{"type": "objectx"}', "--json-schema {path}: json is not a JSON schema pagedlm can follow"),
    ("--grammar", "start: foo", "--grammar {path}: grammar does not compile"),
    ("--regex", None, "--regex: regex 'a{{3' does not compile"),
    pytest.param("--json-schema", "", "--json-schema: the path is empty", id="an empty path"),
    pytest.param("--json-schema", "[" * 5000 + "]" * 5000, "--json-schema {path} is not JSON (maximum recursion depth",
                 id="json nested past Python's recursion limit"),
])
def test_a_bad_constraint_is_one_line_and_exit_2_before_loading(tmp_path, monkeypatch, capsys, flag, content,
                                                                message):
    monkeypatch.setattr(cli, "_load", lambda args: pytest.fail("loaded the model"))
    path = tmp_path / "c.txt"
    if content is not None:
        path.write_text(content)
    value = "a{3" if flag == "--regex" else "" if content == "" else str(path)
    assert main(["generate", flag, value, "x"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("pagedlm generate: " + message.format(path=path)), err


def test_e2e_generate_follows_each_constraint_flag(tiny_load, tmp_path, capsys):
    """Needs the engine's wiring of issue 22."""
    schema = tmp_path / "s.json"
    schema.write_text('{"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"], '
                      '"additionalProperties": false}')
    grammar = tmp_path / "g.lark"
    grammar.write_text('start: "id-" /[0-9]{3}/')
    runs = {("--choice", "yes", "--choice", "no"): lambda out: out in ("yes", "no"),
            ("--regex", "[a-c]{5}"): lambda out: len(out) == 5 and set(out) <= set("abc"),
            ("--grammar", str(grammar)): lambda out: out.startswith("id-") and out[3:].isdigit() and len(out) == 6,
            ("--json-schema", str(schema)): lambda out: isinstance(json.loads(out)["n"], int)}
    for flags, ok in runs.items():
        assert main(["generate", "--max-tokens", "200", *flags, "x"]) == 0
        out = capsys.readouterr().out.removesuffix("\n")
        assert ok(out), (flags, out)


def test_generate_exits_1_when_the_constraint_dead_ends(tiny_load, tmp_path, capsys):
    """A grammar naming a special token the tokenizer lacks compiles only with it: the row dies
    at its first mask ("error"), and the output is not what was asked for."""
    grammar = tmp_path / "g.lark"
    grammar.write_text('start: <|no_such_token|> "x"')
    assert main(["generate", "--max-tokens", "5", "--grammar", str(grammar), "x"]) == 1
    assert "the output's constraint allowed no further token" in capsys.readouterr().err


def test_a_chat_template_that_refuses_is_one_line(tiny_load, monkeypatch, capsys):
    """(A model without a template, or one whose template raises: the same ValueError.) generate
    exits 2; chat says so and keeps the conversation."""
    def refuse(messages, *args, **kwargs):
        raise ValueError("chat template: System role not supported")
    monkeypatch.setattr(tiny_load[1], "encode_chat", refuse)
    assert main(["generate", "--chat", "--system", "s", "x"]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == \
        "pagedlm generate: --chat: chat template: System role not supported"
    _chat(monkeypatch, ["hi", "again"])
    assert main(["chat", "--system", "s"]) == 0
    err = capsys.readouterr().err
    assert err.count("error: pagedlm chat: chat template: System role not supported\n") == 2 and "Traceback" not in err


def test_random_weights_read_the_config_as_a_model_folder_does(tmp_path, capsys):
    """--random-weights once built straight from config.json: a field of the wrong type was a traceback."""
    (tmp_path / "config.json").write_text('{"model_type": "qwen3", "hidden_size": "abc"}')
    assert main(["bench", "decode", "--random-weights", "--model", str(tmp_path), "--device", "cpu",
                 "--prompt-len", "8", "--gen-len", "2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{tmp_path}/config.json: " in err and "Traceback" not in err


@pytest.mark.parametrize("flags,says", [
    (["--json-schema", "benchmarks/configs/person.schema.json", "--num-prompts", "8"],
     "--num-prompts shapes the stores' workload, which --json-schema replaces"),
    (["--json-schema", "benchmarks/configs/person.schema.json", "--stores", "paged"], "--stores shapes"),
    (["--hf-timeout", "5"], "--hf-timeout needs --against hf"),
])
def test_bench_throughput_refuses_flags_its_run_would_ignore(monkeypatch, capsys, flags, says):
    monkeypatch.setattr(cli, "_load", lambda args: pytest.fail("loaded the model"))
    assert main(["bench", "throughput", "--model", "/nonexistent", "--device", "cpu", *flags]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and says in err, err
