"""Structured output (pagedlm.structured) through the batched sampler, with
the two built-in models' real tokenizers and a random "model": every output
a grammar lets a random walk write must parse and validate.

The walk's logits come from a fixed bank of seeded random rows; the rows
bias the tokens that close a string, an object or an array (a real model's
outputs end; a uniform random walk through a string would not soon). The
tokenizers come from the models' converted folders (`resolve` converts a
model once per machine, as tests/weights do); no weights are loaded.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import re
import threading
import time

import jsonschema
import pytest
import torch

from pagedlm.batch.sequence import Sequence
from pagedlm.loading import resolve
from pagedlm.params import SamplingParams
from pagedlm.sampling import sample, token_rules
from pagedlm.structured import Constraint, GrammarCompiler, mask_bias, masked_logits
from pagedlm.tokenizer import Tokenizer
from tests.helpers import tiny_tokenizer
from tests.schemas import CHOICES, INT, NUM, REGEXES, SCHEMAS, STR

MODELS = ["smollm2-135m-instruct", "gemma3-270m"]
PAD = 37  # logits wider than the vocabulary (a padded embedding): the extra ids are never allowed
MAX_TOKENS = 400

LARK_EXPR = """
start: term (("+" | "-") term)*
term: NUMBER | "(" NUMBER (("*" | "/") NUMBER)* ")"
NUMBER: /[0-9]{1,3}/
"""
GBNF_LIST = 'root ::= "[" item ("," item)* "]"\nitem ::= [a-z]{1,4}'


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Row-sized ops on one thread: on a loaded two-core machine, splitting a
    49k-float op across two threads costs milliseconds of waiting for each other."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module", params=MODELS)
def setup(request):
    """(tokenizer, compiler) of a model, logits ``PAD`` wider than its vocabulary."""
    tokenizer = Tokenizer.from_folder(resolve(request.param))
    compiler = GrammarCompiler(tokenizer, tokenizer.vocab_size + PAD)
    compiler.warm_up()
    return tokenizer, compiler


def row(tokenizer, compiler, constraint: Constraint | None, sampled: bool, seed: int = 0, **params) -> Sequence:
    """A sequence as the engine makes one (its request's rules; a matcher when constrained)."""
    params.setdefault("temperature", 1.0 if sampled else 0.0)
    p = SamplingParams(max_tokens=MAX_TOKENS, seed=seed, **params).validate()
    seq = Sequence([1], p, tokenizer.eos_token_ids, tokenizer.detokenizer(), None,
                   token_rules(p, tokenizer, compiler.vocab_size))
    if constraint is not None:
        seq.matcher = compiler.matcher(constraint.validate(), label=f"row {seed}")
    return seq


def closers(tokenizer, vocab: int, sampled: bool) -> dict[int, float]:
    """A bias for the tokens that end a string, an object, an array or the
    output (and "@", which an email needs): a sampled row draws one about
    twice as often as all other tokens together; a greedy row picks one when
    its own logit is above about 0 (the best of the others is about 4)."""
    ids = {tokenizer.encode(t, add_special_tokens=False)[0] for t in ['"', "}", "]", '"}', '"]', "}}", "@"]}
    return {i: math.log(vocab) + 1 if sampled else 4.0 for i in ids | set(tokenizer.eos_token_ids)}


@functools.lru_cache(maxsize=2)
def bank(vocab: int) -> torch.Tensor:
    """The random model's logits: 31 seeded rows (read only)."""
    return torch.randn(31, vocab, generator=torch.Generator().manual_seed(0))


def walk(seqs: list[Sequence], logits_bank: torch.Tensor) -> None:
    """Sample every row until its matcher finishes (or dies, or MAX_TOKENS),
    as the engine will: advance the matcher with each token. Row ``r`` at a
    step reads a bank row drawn for it (not a cycle: a greedy walk would loop)."""
    for seq in seqs:
        wait_ready(seq)
    picks = torch.randint(len(logits_bank), (len(seqs), MAX_TOKENS), generator=torch.Generator().manual_seed(1))
    active = list(range(len(seqs)))
    for step in range(MAX_TOKENS):
        if not active:
            return
        tokens = sample(logits_bank[picks[active, step]], [seqs[r] for r in active])
        still = []
        for r, token in zip(active, tokens):
            if token is None:
                continue
            seqs[r].output_ids.append(token)
            seqs[r].matcher.advance(token)
            if not (seqs[r].matcher.is_finished or seqs[r].matcher.is_dead):
                still.append(r)
        active = still


def text_of(tokenizer, seq: Sequence) -> str:
    assert seq.matcher.is_finished, (seq.matcher.error, tokenizer.decode(seq.output_ids))
    return tokenizer.decode(seq.output_ids)


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_json_outputs_validate_against_their_schemas(setup, sampled):
    tokenizer, compiler = setup
    vocab = compiler.vocab_size
    bias = closers(tokenizer, vocab, sampled)
    seqs = [row(tokenizer, compiler, Constraint(json=s), sampled, seed=i, logit_bias=bias)
            for i, s in enumerate(SCHEMAS)]
    seqs.append(row(tokenizer, compiler, Constraint(json_object=True), sampled, seed=len(SCHEMAS), logit_bias=bias))
    walk(seqs, bank(vocab))
    for schema, seq in zip(SCHEMAS + [{"type": "object"}], seqs):
        value = json.loads(text_of(tokenizer, seq))
        jsonschema.validate(value, schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)
        assert all(t < tokenizer.vocab_size for t in seq.output_ids)  # the padded ids never come out


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_regex_choice_and_grammar_outputs_match(setup, sampled):
    tokenizer, compiler = setup
    bias = closers(tokenizer, compiler.vocab_size, sampled) if sampled else None  # greedy: the shared argmax
    constraints = ([Constraint(regex=r) for r in REGEXES] + [Constraint(choice=c) for c in CHOICES]
                   + [Constraint(grammar=LARK_EXPR), Constraint(grammar=GBNF_LIST)])
    seqs = [row(tokenizer, compiler, c, sampled, seed=i, logit_bias=bias) for i, c in enumerate(constraints)]
    walk(seqs, bank(compiler.vocab_size))
    texts = [text_of(tokenizer, s) for s in seqs]
    for pattern, text in zip(REGEXES, texts):
        assert re.fullmatch(pattern, text), (pattern, text)
    for choices, text in zip(CHOICES, texts[len(REGEXES):]):
        assert text in choices
    expr, listing = texts[-2:]
    term = r"([0-9]{1,3}|\([0-9]{1,3}([*/][0-9]{1,3})*\))"
    assert re.fullmatch(f"{term}([+-]{term})*", expr), expr
    assert re.fullmatch(r"\[[a-z]{1,4}(,[a-z]{1,4})*\]", listing), listing


def test_unconstrained_rows_are_unchanged_beside_constrained_ones(setup):
    """Same tokens, step after step, with and without constrained rows in the
    batch: greedy, sampled, penalized, biased and rule-bound rows."""
    tokenizer, compiler = setup
    vocab = compiler.vocab_size
    plain = [dict(), dict(temperature=0.8, top_p=0.9), dict(temperature=1.0, top_k=50),
             dict(repetition_penalty=1.3, presence_penalty=0.5), dict(logit_bias={5: 3.0}),
             dict(allowed_token_ids=list(range(100, 200)))]

    def rows(with_constrained: bool) -> list[Sequence]:
        out = []
        for i, kw in enumerate(plain):
            out.append(row(tokenizer, compiler, None, kw.get("temperature", 0.0) > 0, seed=i, **kw))
            if with_constrained:
                out.append(row(tokenizer, compiler, Constraint(json=SCHEMAS[30]), i % 2 == 1, seed=i))
        return out

    alone, mixed = rows(False), rows(True)
    for seq in mixed[1::2]:
        wait_ready(seq)
    logits_bank = bank(vocab)
    for step in range(8):
        logits = logits_bank[[(r + step) % 31 for r in range(len(mixed))]]
        before = logits.clone()
        got = sample(logits, mixed)
        assert torch.equal(logits, before)  # masks apply to a copy: logprobs read the model's logits
        want = sample(logits[0::2].contiguous(), alone)
        assert got[0::2] == want
        for seq, token in zip(mixed + alone, got + want):
            matcher = getattr(seq, "matcher", None)
            if matcher is None or not (matcher.is_finished or matcher.is_dead):
                seq.output_ids.append(token)
                if matcher is not None:
                    matcher.advance(token)


def test_every_kind_compiles_and_bad_input_is_a_value_error():
    for constraint in [Constraint(json=SCHEMAS[30]), Constraint(json=json.dumps(SCHEMAS[30])),
                       Constraint(json_object=True), Constraint(regex=REGEXES[0]), Constraint(choice=["a", "b"]),
                       Constraint(grammar=LARK_EXPR), Constraint(grammar=GBNF_LIST)]:
        assert constraint.validate().llguidance_grammar()
    bad = [
        (dict(json={"type": "objectx"}), r"^json is not a JSON schema pagedlm can follow: Invalid type: objectx$"),
        (dict(json='{"type": '), r"^json must be a JSON schema: its text is not JSON"),
        (dict(json=[1]), r"^json must be a JSON schema object"),
        (dict(json={"enum": [{1, 2}]}), r"^json must be a JSON schema: Object of type set is not JSON serializable$"),
        (dict(json={"type": "integer", "minimum": 5, "maximum": 1}), "minimum \\(5\\) is greater than maximum"),
        (dict(json={"type": "string", "pattern": "(?=a)"}), r"follow: regex /\(\?=a\)/: look-around.*not supported$"),
        (dict(json={"not": STR}), r"Unimplemented keys: \[\"not\"\]"),
        (dict(regex="a{3"), r"^regex 'a\{3' does not compile: unclosed counted repetition$"),
        (dict(regex="(ab"), r"^regex '\(ab' does not compile: unclosed group$"),
        (dict(regex=3), r"^regex must be a string"),
        (dict(grammar="start: foo"), r'^grammar does not compile: at 1\(8\): unknown name: "foo"$'),
        (dict(grammar="root ::= ( "), r"^grammar does not compile: Failed to convert the grammar from GBNF"),
        (dict(grammar="  "), r"^grammar must not be empty$"),
        (dict(choice=[]), r"^choice must hold at least one string \(got \[\]\)$"),
        (dict(choice=["a", 1]), r"^choice must be a list of strings"),
        (dict(choice="ab"), r"^choice must be a list of strings"),
        (dict(json=STR, regex="a"), r"^a constraint must set exactly one of .* \(got json, regex\)$"),
        (dict(), r"\(got none\)$"),
        (dict(json_object="yes"), r"^json_object must be true or false"),
    ]
    for kwargs, message in bad:
        with pytest.raises(ValueError, match=message) as e:
            Constraint(**kwargs).validate()
        assert "\n" not in str(e.value)


def test_a_constraint_is_checked_once_however_spelled(monkeypatch):
    """llguidance checks each distinct constraint once (milliseconds a
    schema, which every request bringing it paid): the same schema in
    another key order or as JSON text is not checked again; a refusal
    still comes every time, and a different constraint is checked."""
    from pagedlm.structured import constraint as module

    module._grammar_error.cache_clear()
    checks = []
    real = module.llguidance.LLMatcher.validate_grammar
    monkeypatch.setattr(module.llguidance.LLMatcher, "validate_grammar",
                        lambda grammar: checks.append(grammar) or real(grammar))
    schema = {"type": "object", "properties": {"a": INT, "b": STR}, "required": ["a"]}
    first = Constraint(json=schema).validate()
    after_one = len(checks)
    assert after_one == 2  # the schema alone, then the grammar it is wrapped in
    reordered = {"required": ["a"], "properties": {"b": STR, "a": INT}, "type": "object"}
    for again in (Constraint(json=reordered), Constraint(json=json.dumps(schema))):
        assert again.validate() == first
    assert len(checks) == after_one
    for _ in range(2):
        with pytest.raises(ValueError, match="does not compile: unclosed group"):
            Constraint(regex="(ab").validate()
    Constraint(regex="(ab)").validate()
    assert len(checks) == after_one + 2


@pytest.fixture(scope="module")
def tiny():
    """A compiler of the tests' 263-token byte-level tokenizer (built in milliseconds)."""
    compiler = GrammarCompiler(tiny_tokenizer(), 300, capacity=2)
    compiler.warm_up()
    return compiler


def takes(tiny, schema: dict, text: str, then_eos: bool = False) -> str:
    """What ``schema``'s grammar says after ``text``, byte by byte (then the
    end-of-sequence token): "refused", "stopped" (nothing may follow),
    "complete" (it may end here or go on) or "incomplete"."""
    matcher = tiny.matcher(Constraint(json=schema).validate())
    wait_ready_matcher(matcher)
    tokens = tiny.tokenizer.encode(text, add_special_tokens=False)
    for token in tokens + (sorted(tiny.tokenizer.eos_token_ids)[:1] if then_eos else []):
        matcher.advance(token)
        if matcher.is_dead:
            return "refused"
    if matcher.is_finished:
        return "stopped"
    return "complete" if matcher._matcher.is_accepting() else "incomplete"


def test_json_numbers_objects_whitespace_and_times_are_bounded(tiny):
    """At most 16 digits, and 10 of fraction, where the schema sets no bound
    (its own bounds and values kept); objects closed; one space, or a newline and 20 of indent, after the value,
    and the end-of-sequence token then ends it; a time's fraction of at most 9 digits."""
    nine, many = "9" * 16, "9" * 17
    assert takes(tiny, INT, nine) == takes(tiny, INT, "-" + nine) == "complete"
    assert takes(tiny, INT, many) == takes(tiny, {"type": "array", "items": INT}, f"[1, {many}") == "refused"
    assert takes(tiny, {"type": "integer", "minimum": 1000}, many) == "refused"
    assert takes(tiny, {"type": "integer", "maximum": 10**18}, "9" * 18) == "complete"  # its own bound
    assert takes(tiny, {"type": "integer", "minimum": 10**17}, "9" * 18) == "complete"  # beyond ours: unbounded
    assert takes(tiny, {"type": "integer", "enum": [10**17, 1]}, str(10**17)) == "complete"
    assert takes(tiny, {"type": ["number", "string"]}, many) == "refused"
    assert takes(tiny, {"type": ["number", "string"]}, '"' + many + '"') == "complete"
    assert takes(tiny, NUM, "-12.5") == takes(tiny, NUM, "3.1415926535") == "complete"
    assert takes(tiny, NUM, many + ".5") == takes(tiny, NUM, "1e5") == "refused"  # bounded: no exponent
    assert takes(tiny, NUM, "3.14159265358") == takes(tiny, {"type": "number", "maximum": 1}, "0.00000000001") \
        == "refused"  # 11 digits of fraction
    assert takes(tiny, {"type": "number", "multipleOf": 0.5}, "2.5") == "complete"  # its own multipleOf

    obj = {"type": "object", "properties": {"a": INT}}
    assert takes(tiny, obj, '{"a": 1}') == takes(tiny, obj, '{"a": 1}\n') == "complete"
    assert takes(tiny, obj, '{"a": 1}\n' + " " * 20) == takes(tiny, obj, '{"a": 1} ') == "stopped"
    assert takes(tiny, obj, '{"a": 1}\n', then_eos=True) == takes(tiny, INT, "7", then_eos=True) == "stopped"
    assert takes(tiny, obj, '{"a": 1}\n\n') == takes(tiny, obj, '{"a": 1}  ') == takes(tiny, obj, ' {') == "refused"

    # Objects that list their properties take no others (vLLM's default backend's rule), unless the
    # schema says so, or intersects schemas (allOf: closed branches would leave nothing).
    assert takes(tiny, obj, '{"a": 1, "b"') == "refused"
    assert takes(tiny, {**obj, "additionalProperties": STR}, '{"a": 1, "b": "x"}') == "complete"
    assert takes(tiny, {"type": "object"}, '{"a": 1, "b": {"c": [1]}}') == "complete"
    assert takes(tiny, {"allOf": [obj, {"type": "object", "properties": {"b": STR}}]}, '{"a": 1, "b": "x", "c": 2}') \
        == "complete"
    time_ = {"type": "string", "format": "time"}
    assert takes(tiny, time_, '"12:00:00.123456789Z"') == takes(tiny, time_, '"01:02:03+05:30"') == "complete"
    assert takes(tiny, time_, '"12:00:00.1234567890') == takes(tiny, time_, '"23:59:60Z"') == "refused"
    for schema in (INT, NUM, time_, SCHEMAS[-1]):  # the schema itself is unchanged (the key is its own)
        assert Constraint(json=schema).validate().json == schema


def test_equal_constraints_compile_once_and_a_row_never_waits(tiny):
    schema = {"type": "object", "properties": {"b": INT, "a": STR}, "required": ["a"]}
    respelled = json.dumps({"required": ["a"], "properties": {"a": STR, "b": INT}, "type": "object"})
    assert Constraint(json=schema).validate().key == Constraint(json=respelled).validate().key
    gate = threading.Event()
    tiny._pool.submit(gate.wait)  # the one worker is busy: every compile below queues behind it
    try:
        before = tiny.compiles
        start = time.perf_counter()
        first = tiny.matcher(Constraint(json=schema).validate())
        second = tiny.matcher(Constraint(json=respelled).validate())
        assert time.perf_counter() - start < 1.0  # handed back at once, compiled later
        assert not (first.ready() or second.ready())
        assert tiny.compiles == before + 1  # the respelled schema joins the first one's compile
    finally:
        gate.set()
    for m in (first, second):
        wait_ready_matcher(m)
    tiny.matcher(Constraint(json=respelled).validate())
    assert tiny.compiles == before + 1  # cached


def test_lru_evicts_the_least_recently_used(tiny):
    a, b, c = (Constraint(regex=r).validate() for r in ("a+", "b+", "c+"))
    before = tiny.compiles
    for constraint in (a, b, a, c):  # capacity 2: c evicts b, the least recently used
        tiny.matcher(constraint)
    assert tiny.compiles == before + 3
    tiny.matcher(a)
    assert tiny.compiles == before + 3
    tiny.matcher(b)
    assert tiny.compiles == before + 4


def test_dead_ends_are_reported_not_hung(setup, caplog):
    tokenizer, compiler = setup
    vocab = compiler.vocab_size
    logits = bank(vocab)[:1]
    caplog.set_level(logging.WARNING, logger="pagedlm.structured")
    # A token outside the grammar (a speculative proposal, a bug) kills the row.
    seq = row(tokenizer, compiler, Constraint(choice=["yes"]), False, seed=1)
    wait_ready(seq)
    assert seq.matcher.advance(tokenizer.encode("no", add_special_tokens=False)[0]) == "error"
    assert seq.matcher.is_dead and "outside the grammar" in seq.matcher.error
    # The request's own rules leave nothing the grammar allows: no token, dead.
    seq = row(tokenizer, compiler, Constraint(choice=["yes"]), False, seed=2,
              allowed_token_ids=tokenizer.encode("no", add_special_tokens=False))
    wait_ready(seq)
    assert sample(logits, [seq]) == [None] and seq.matcher.is_dead
    assert "allowed_token_ids" in seq.matcher.error
    # ... the same for rows that sample without a seed (drawn together on the logits' device), where
    # a draw over nothing was uniform over the vocabulary: the row got a token its grammar refuses.
    for rules in [dict(allowed_token_ids=tokenizer.encode("no", add_special_tokens=False)), dict(bad_words=["yes"])]:
        seq = row(tokenizer, compiler, Constraint(choice=["yes"]), True, seed=None, **rules)
        wait_ready(seq)
        assert sample(logits, [seq]) == [None] and seq.matcher.is_dead and "leave no token" in seq.matcher.error
    # A grammar that compiles without a tokenizer but not with this one dies at its first mask.
    seq = row(tokenizer, compiler, Constraint(grammar='start: <|no_such_token|> "a"'), True, seed=3)
    wait_ready(seq)
    assert sample(logits, [seq]) == [None] and seq.matcher.is_dead
    assert "did not compile" in seq.matcher.error and "no_such_token" in seq.matcher.error
    assert len([r for r in caplog.records if "dead-ends" in r.getMessage()]) == 5


@pytest.mark.parametrize("ahead", [False, True], ids=["filled-now", "filled-ahead"])
def test_a_parser_limit_met_inside_a_mask_kills_the_row_with_that_error(monkeypatch, ahead):
    """A live row whose mask's computation meets a parser limit (llguidance's
    error, raised inside the fill, not an empty mask) dies with that error,
    whether the step fills its masks or takes them from a fill ahead; the
    fill's other row, of another grammar, goes on."""
    import llguidance

    from pagedlm.structured import compiler as compiler_module
    from pagedlm.structured import fill_bitmask
    from pagedlm.structured.matcher import prefetch_bitmasks

    monkeypatch.setattr(compiler_module, "_LIMITS", llguidance.LLParserLimits(verbose_errors=False, step_max_items=32))
    tokenizer = tiny_tokenizer()
    compiler = GrammarCompiler(tokenizer, 300)
    nested, word = compiler.matcher(Constraint(json_object=True)), compiler.matcher(Constraint(regex="[a-z]+"))
    while not (nested.ready() and word.ready()):
        time.sleep(0.001)
    letter = tokenizer.encode_as_text("a")[0]
    for step, token in enumerate(tokenizer.encode_as_text('{"a": [1, [2, [3, [4, [5]]]]]}')):
        if ahead:
            prefetch_bitmasks([nested, word])
        _, live = fill_bitmask([nested, word])
        assert live[1] and word.error is None
        if not live[0]:
            break
        assert nested.advance(token) is None and word.advance(letter) is None
    assert step > 0 and nested.is_dead and "Too many items" in nested.error  # live, then the limit


def test_a_parser_limit_met_by_a_fill_ahead_kills_the_row_at_its_next_token(monkeypatch):
    """A fill ahead whose mask's computation meets a parser limit, its mask
    never taken: the row's next token (`RowMatcher.advance`, which does not
    ask llguidance for an error first) ends it "error", with that limit's
    error, not a token taken into a broken parser."""
    import llguidance

    from pagedlm.structured import compiler as compiler_module
    from pagedlm.structured.matcher import prefetch_bitmasks

    monkeypatch.setattr(compiler_module, "_LIMITS", llguidance.LLParserLimits(verbose_errors=False, step_max_items=32))
    tokenizer = tiny_tokenizer()
    nested = GrammarCompiler(tokenizer, 300).matcher(Constraint(json_object=True))
    while not nested.ready():
        time.sleep(0.001)
    ends = []
    for token in tokenizer.encode_as_text('{"a": [1, [2, [3, [4, [5]]]]]}'):
        prefetch_bitmasks([nested])
        ends.append(nested.advance(token))
        if ends[-1] is not None:
            break
    assert ends[0] is None and ends[-1] == "error" and nested.is_dead and "Too many items" in nested.error


def test_the_rules_cut_from_a_bitmask_are_each_rows_words_anded():
    """`_permit` (one pass over the bitmask, the words the rules refuse in cut
    out and put back) leaves exactly the bitmask and verdicts of the plain
    reading: each filled row's words ANDed with its rules' words; whether a
    row allowed a token before, and after. Random bitmasks, rules of a few
    refused words, of every word, and none; rows sharing arrays, rows
    without rules, rows not filled, the filled ones named in any order."""
    import numpy as np

    from pagedlm.structured.matcher import _permit

    rng = np.random.default_rng(0)
    for _ in range(300):
        rows, width = int(rng.integers(1, 9)), int(rng.integers(1, 40))
        dense = rng.random()
        bitmask = np.where(rng.random((rows, width)) < dense,
                           rng.integers(-2 ** 31, 2 ** 31 - 1, (rows, width), dtype=np.int32), 0).astype(np.int32)
        arrays = [np.full(width, -1, dtype=np.int32) for _ in range(3)] + [np.zeros(width, dtype=np.int32)]
        for words in arrays[:3]:
            at = rng.choice(width, int(rng.integers(0, width + 1)), replace=False)
            words[at] = rng.integers(-2 ** 31, 2 ** 31 - 1, len(at), dtype=np.int32)
        permitted = [None if rng.random() < 0.3 else arrays[int(rng.integers(0, 4))] for _ in range(rows)]
        filled = [int(j) for j in rng.permutation(rows) if rng.random() < 0.8]  # (in any order)
        want = bitmask.copy()
        allows = want.any(axis=1)
        for j in filled:
            if permitted[j] is not None:
                want[j] &= permitted[j]
        got_allows, got_left = _permit(bitmask, filled, permitted)
        assert np.array_equal(bitmask, want)
        assert np.array_equal(got_allows, allows) and np.array_equal(got_left, want.any(axis=1))
    # Every row under one array (the whole bitmask's path), named out of order; rows whose tokens are all
    # in the words the rules refuse tokens in (allowed, nothing left), elsewhere (both), nowhere (neither).
    bitmask = np.zeros((5, 4), dtype=np.int32)
    bitmask[0, 1], bitmask[1, 0], bitmask[3, 3], bitmask[4, 2] = 5, 7, 9, 11
    rules = np.array([-1, 0, -1, 0], dtype=np.int32)
    allows, left = _permit(bitmask, [4, 2, 0, 3, 1], [rules] * 5)
    assert allows.tolist() == [True, True, False, True, True] and left.tolist() == [False, True, False, False, True]
    assert bitmask[:, [1, 3]].sum() == 0 and bitmask[1, 0] == 7 and bitmask[4, 2] == 11


def test_rollback_returns_to_an_earlier_state(setup):
    tokenizer, compiler = setup
    seq = row(tokenizer, compiler, Constraint(choice=["hello world", "hello there"]), False)
    wait_ready(seq)
    ids = tokenizer.encode("hello world", add_special_tokens=False)
    assert [seq.matcher.advance(t) for t in ids] == [None] * (len(ids) - 1) + ["stop"]  # how each token ends it
    assert seq.matcher.is_finished
    seq.matcher.rollback(len(ids) - 1)
    assert not seq.matcher.is_finished
    for t in tokenizer.encode("hello there", add_special_tokens=False)[1:]:
        seq.matcher.advance(t)
    assert seq.matcher.is_finished and not seq.matcher.is_dead
    with pytest.raises(ValueError, match="cannot roll back"):
        seq.matcher.rollback(100)


def test_a_row_sampled_before_its_grammar_compiled_is_an_error(tiny):
    gate = threading.Event()
    tiny._pool.submit(gate.wait)
    try:
        seq = row(tiny.tokenizer, tiny, Constraint(regex="q{2,3}z"), False)
        with pytest.raises(RuntimeError, match="before its grammar compiled"):
            sample(torch.zeros(1, tiny.vocab_size), [seq])
    finally:
        gate.set()


@pytest.mark.parametrize("device", ["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"])
def test_masks_expand_the_same_on_every_device(setup, device):
    """mask_bias against the bitmask read bit by bit; masked_logits on
    ``device`` keeps exactly those logits and sets the rest to -inf."""
    tokenizer, compiler = setup
    vocab = compiler.vocab_size
    seqs = [row(tokenizer, compiler, Constraint(json=s), False, seed=i) for i, s in enumerate(SCHEMAS[28:32])]
    for s in seqs:
        wait_ready(s)
    bitmask = torch.zeros((len(seqs), (compiler.width + 31) // 32), dtype=torch.int32)
    for j, s in enumerate(seqs):
        assert s.matcher.fill(bitmask[j])
    words = bitmask.tolist()
    want = torch.tensor([[(words[j][t // 32] >> (t % 32)) & 1 for t in range(vocab)] for j in range(len(seqs))],
                        dtype=torch.bool)
    assert 0 < int(want.sum()) < want.numel()
    assert torch.equal(mask_bias(bitmask.to(device), vocab).cpu(), torch.where(want, 0.0, float("-inf")))
    logits = bank(vocab)[: len(seqs)].to(device)
    masked, live = masked_logits(logits, [s.matcher for s in seqs])
    assert live == [True] * len(seqs) and masked.device == logits.device
    assert torch.equal(masked.cpu(), torch.where(want, logits.cpu(), float("-inf")))


def test_a_mask_filled_ahead_is_taken_only_for_the_state_it_was_filled_for(setup):
    """`prefetch_bitmasks` then `fill_bitmask`: rows that have not moved take
    the background fill (the same bits as filling now); a row advanced since
    is filled again for its new state."""
    from pagedlm.structured.matcher import fill_bitmask, prefetch_bitmasks

    tokenizer, compiler = setup
    seqs = [row(tokenizer, compiler, Constraint(json=s), False, seed=i) for i, s in enumerate(SCHEMAS[40:43])]
    for s in seqs:
        wait_ready(s)
    matchers = [s.matcher for s in seqs]
    fresh, _ = fill_bitmask(matchers)
    prefetch_bitmasks(matchers)
    first = fresh[2].numpy().view("uint8")
    token = next(t for t in range(compiler.vocab_size) if (first[t // 8] >> (t % 8)) & 1 and t > 0)
    matchers[2].advance(token)  # moved after the prefetch: its row must be filled again
    got, live = fill_bitmask(matchers)
    assert live == [True] * 3 and all(m._prefetched is None for m in matchers)
    assert torch.equal(got[:2], fresh[:2])
    again, _ = fill_bitmask(matchers)
    assert torch.equal(got[2], again[2]) and not torch.equal(got[2], fresh[2])
    prefetch_bitmasks(matchers)  # nothing moves: the step takes the background fill as it is
    whole = matchers[0]._prefetched[1].result()[0]
    took, live = fill_bitmask(matchers)
    assert took is whole and torch.equal(took, again) and live == [True] * 3


def test_a_mask_filled_ahead_holds_the_rules_it_was_filled_with(setup):
    """`prefetch_bitmasks` with rows' ``permitted`` words (their rules) ANDs
    them in the background: `fill_bitmask` with the same arrays takes the
    rows as they are (the bits of filling now, less the rules); with another
    array a row is filled again for it; a row whose rules refuse every token
    its grammar allows is dead with `NOTHING_LEFT`, taken ahead or not."""
    import numpy as np

    from pagedlm.structured.matcher import NOTHING_LEFT, fill_bitmask, prefetch_bitmasks

    tokenizer, compiler = setup
    seqs = [row(tokenizer, compiler, Constraint(json=s), False, seed=i) for i, s in enumerate(SCHEMAS[40:43])]
    for s in seqs:
        wait_ready(s)
    matchers = [s.matcher for s in seqs]
    fresh = fill_bitmask(matchers)[0].numpy().copy()
    words = fresh.shape[1]
    odd = np.full(words, 0x55555555, dtype=np.int32)  # every other token
    even = np.full(words, -0x55555556, dtype=np.int32)  # the others (0xAAAAAAAA)
    rules = [odd, None, even]
    want = fresh & np.stack([odd, np.full(words, -1, dtype=np.int32), even])
    prefetch_bitmasks(matchers, permitted=rules)
    whole = matchers[0]._prefetched[1].result()[0]
    took, live = fill_bitmask(matchers, permitted=rules)
    assert took is whole and np.array_equal(took.numpy(), want) and live == [True] * 3
    prefetch_bitmasks(matchers, permitted=rules)
    swapped = [odd, None, odd]  # the last row's rules are another array: filled again for them
    got, live = fill_bitmask(matchers, permitted=swapped)
    assert np.array_equal(got.numpy()[:2], want[:2]) and np.array_equal(got.numpy()[2], fresh[2] & odd)
    assert live == [True] * 3
    nothing = ~fresh[1]  # refuses exactly what row 1's grammar allows
    for ahead in (True, False):
        again = [row(tokenizer, compiler, Constraint(json=SCHEMAS[41]), False, seed=9)]
        wait_ready(again[0])
        if ahead:
            prefetch_bitmasks([again[0].matcher], permitted=[nothing])
        mask, live = fill_bitmask([again[0].matcher], permitted=[nothing])
        assert live == [False] and again[0].matcher.error == NOTHING_LEFT and not mask.numpy().any()


def test_rows_in_lanes_fill_the_masks_one_compile_fills(setup):
    """A grammar compiled in three lanes (rows copy the compiles in turn and
    an executor of a thread a lane fills them) gives every row the bits
    that rows of one compile get, step after step, rows of two constraints
    and a dead row among them, and each row's own `fill` agrees."""
    import numpy as np

    from pagedlm.structured.matcher import fill_bitmask

    tokenizer, one = setup
    three = GrammarCompiler(tokenizer, one.vocab_size, lanes=3)
    constraints = [Constraint(json=SCHEMAS[i % 2]).validate() for i in range(7)]
    rows = {c: [c.matcher(k, label=str(i)) for i, k in enumerate(constraints)] for c in (one, three)}
    for m in rows[one] + rows[three]:
        wait_ready_matcher(m)
    rng = np.random.default_rng(0)
    for step in range(12):
        got = {c: fill_bitmask(ms) for c, ms in rows.items()}
        if step == 0:
            assert [m.lane for m in rows[three]] == [0, 0, 1, 1, 2, 2, 0]  # each grammar in turn
            assert {m.lane for m in rows[one]} == {0}
        assert torch.equal(got[one][0], got[three][0]) and got[one][1] == got[three][1]
        for j, m in enumerate(rows[three]):
            own = torch.zeros_like(got[three][0][j])
            assert m.fill(own) == got[three][1][j] and torch.equal(own, got[three][0][j])
        for j, live in enumerate(got[one][1]):
            if step == 5 and j == 3:  # one row dies (in both): its lane's other rows go on
                for c in rows:
                    rows[c][j].fail("test")
            elif live and not rows[one][j].is_finished:
                bits = np.unpackbits(got[one][0][j].numpy().view(np.uint8), bitorder="little")
                token = int(rng.choice(np.flatnonzero(bits)))
                for c in rows:
                    rows[c][j].advance(token)
    assert not got[three][1][3] and any(got[three][1])


def walk_in_step(tokenizers: list, schema: dict, width: int, steps: int, choose) -> None:
    """One schema's matchers over each of ``tokenizers`` (llguidance's), walked
    together: at each state ``choose`` gets every matcher's allowed ids and
    answers the token all of them take (None: stop)."""
    import llguidance
    import numpy as np

    words = (width + 31) // 32
    grammar = Constraint(json=schema).validate().llguidance_grammar()
    matchers = [llguidance.LLMatcher(t, grammar, log_level=0) for t in tokenizers]
    for _ in range(steps):
        masks = [np.zeros(words, dtype=np.int32) for _ in matchers]
        for m, mask in zip(matchers, masks):
            m.unsafe_compute_mask_ptr(mask.ctypes.data, words * 4)
        token = choose([np.flatnonzero(np.unpackbits(mask.view(np.uint8), bitorder="little")) for mask in masks])
        if token is None or any(m.is_stopped() for m in matchers):
            return
        assert all(m.consume_token(token) for m in matchers)


def test_finer_slices_give_llguidance_defaults_masks(setup):
    """The token slices this engine gives llguidance (`compiler.SLICES`:
    more length bounds than its defaults, so that a string near its
    ``maxLength`` still takes its masks from slices) change no bit of any
    mask: strings with and without bounds, walked by random allowed tokens
    (long ones first fill the bounded strings), against a tokenizer with
    llguidance's own slices, state by state."""
    import llguidance
    import numpy as np

    from pagedlm.structured.compiler import SLICES

    tokenizer, compiler = setup
    ours = compiler._llg_tokenizer().result()  # (built for the fixture's compiles)
    theirs = ours.with_slices(llguidance.LLTokenizer.general_slices())
    assert SLICES != llguidance.LLTokenizer.general_slices()
    bounded = {"type": "object", "properties": {"a": {"type": "string", "maxLength": 12},
                                                "b": {"type": "string", "minLength": 2, "maxLength": 25},
                                                "c": {"type": "array", "items": STR, "maxItems": 2}},
               "required": ["a", "b", "c"], "additionalProperties": False}
    length = np.array([len(ours.decode_bytes([t]).strip()) for t in range(ours.vocab_size)])  # whitespace aside
    rng = np.random.default_rng(0)

    def choose(allowed):
        assert np.array_equal(*allowed)
        if not len(allowed[0]):
            return None
        longest = allowed[0][length[allowed[0]] >= np.sort(length[allowed[0]])[-min(len(allowed[0]), 50)]]
        return int(rng.choice(longest))

    for schema in (bounded, json.loads(open("benchmarks/configs/person.schema.json").read()), SCHEMAS[0]):
        walk_in_step([ours, theirs], schema, compiler.width, 60, choose)


def test_forced_text_that_spells_an_added_token_is_written_as_text(setup):
    """llguidance built from tokenizer.json alone tokenized the text a grammar
    forces with special tokens parsed out of it, and took every added token
    shaped ``<...>`` for special: a row that had to write ``<|im_start|>``
    (SmolLM2's control token), or ``<b>`` (an added token of Gemma 3's that
    is text, as Qwen's ``<tool_call>`` is), ended "error" at its first token."""
    tokenizer, compiler = setup
    im_start = tokenizer.token_to_id("<|im_start|>")
    if im_start is not None:  # SmolLM2's: parsed out of text, but not out of forced text
        assert tokenizer.encode("<|im_start|>", add_special_tokens=False) == [im_start]
        spelled = tokenizer.encode_as_text("<|im_start|>")
        assert im_start not in spelled and tokenizer.decode(spelled) == "<|im_start|>"
    texts = ["<|im_start|>x", "<b>x</b>", "a<|im_end|>"]
    constraints = [Constraint(regex=re.escape(t)) for t in texts] + [Constraint(choice=["<b>", "<|im_end|>"])]
    seqs = [row(tokenizer, compiler, c, False, seed=i) for i, c in enumerate(constraints)]
    walk(seqs, bank(compiler.vocab_size))
    assert [text_of(tokenizer, s) for s in seqs[:3]] == texts and text_of(tokenizer, seqs[3]) in ("<b>", "<|im_end|>")
    assert not any(t in tokenizer.special_token_ids for s in seqs for t in s.output_ids)


def test_a_required_tool_call_writes_qwens_tool_call_token(tmp_path):
    """Qwen's tokenizers add ``<tool_call>`` and ``</tool_call>`` as tokens that
    are text (not special): a row constrained to a tool call (``tool_choice``
    "required") opens it with that token, and completes (it ended "error" at
    its first token when llguidance took the token for a special one)."""
    from pagedlm.server.tools import tool_constraint

    folder = resolve("smollm2-135m-instruct")
    spec = json.loads(Tokenizer.from_folder(folder).to_json())
    base = len(spec["model"]["vocab"])
    spec["added_tokens"] += [{"id": base + i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
                              "normalized": False, "special": False}
                             for i, t in enumerate(["<tool_call>", "</tool_call>"])]
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
    (tmp_path / "tokenizer_config.json").write_text((folder / "tokenizer_config.json").read_text())
    tokenizer = Tokenizer.from_folder(tmp_path)
    compiler = GrammarCompiler(tokenizer, tokenizer.vocab_size)
    city = {"type": "string", "maxLength": 10}
    parameters = {"type": "object", "properties": {"city": city}, "required": ["city"]}
    weather = [{"name": "weather", "parameters": parameters}]
    bias = closers(tokenizer, compiler.vocab_size, True)
    seqs = [row(tokenizer, compiler, tool_constraint(weather, [0], many=False), True, seed=i, logit_bias=bias)
            for i in range(3)]
    walk(seqs, bank(compiler.vocab_size))
    for seq in seqs:
        text = text_of(tokenizer, seq)
        assert seq.output_ids[0] == base  # the token (forced, its canonical tokenization), not its spelling
        call = json.loads(text.removeprefix("<tool_call>").removesuffix("</tool_call>"))
        assert call["name"] == "weather" and isinstance(call["arguments"]["city"], str)


def test_masks_are_llguidances_own_but_for_added_tokens_that_are_text(setup):
    """The tokenizer this engine gives llguidance (`compiler._TextTokenizer`)
    against the one llguidance builds from tokenizer.json, state by state
    over random walks of JSON schemas: the same masks, but for added tokens
    tokenizer.json marks as text that llguidance took for special (Gemma 3's
    ``<b>``, ``<table>``...), which are allowed now where their text is."""
    import llguidance
    import numpy as np

    from pagedlm.structured.compiler import SLICES

    tokenizer, compiler = setup
    ours = compiler._llg_tokenizer().result()  # (built for the fixture's compiles)
    theirs = llguidance.LLTokenizer(tokenizer.to_json(), n_vocab=compiler.width,
                                    eos_token=sorted(tokenizer.eos_token_ids), slices=SLICES)
    text_tokens = {i for i in range(tokenizer.vocab_size) if theirs.is_special_token(i)
                   and i not in tokenizer.special_token_ids}
    assert bool(text_tokens) == (tokenizer.token_to_id("<b>") is not None)  # Gemma 3's, not SmolLM2's
    rng = np.random.default_rng(0)
    differed = 0

    def choose(allowed):
        nonlocal differed
        ours_, theirs_ = (set(a.tolist()) for a in allowed)
        assert ours_ - theirs_ <= text_tokens and theirs_ <= ours_
        differed += ours_ != theirs_
        return int(rng.choice(allowed[1])) if len(allowed[1]) else None

    for schema in (json.loads(open("benchmarks/configs/person.schema.json").read()), *SCHEMAS[:3]):
        walk_in_step([ours, theirs], schema, compiler.width, 40, choose)
    assert differed or not text_tokens  # inside strings Gemma 3's tags are text now


def wait_ready(seq: Sequence) -> None:
    wait_ready_matcher(seq.matcher)


def wait_ready_matcher(matcher) -> None:
    deadline = time.monotonic() + 30
    while not matcher.ready() and time.monotonic() < deadline:
        time.sleep(0.001)
    assert matcher.ready()


def test_a_validated_constraint_is_not_walked_again(monkeypatch):
    """The engine validates each continuation's params again as it admits them: a 5 MB schema's
    walk, dump and compare once cost ~0.7 s a sequence on the engine's thread. Validated once, a
    constraint is taken as it is; an equal one built anew is checked again (cached by its key)."""
    import pagedlm.structured.constraint as module

    schema = {"type": "object", "properties": {"a": {"type": "integer", "examples": [{"x": i} for i in range(50)]}}}
    checked = Constraint(json=schema).validate()
    monkeypatch.setattr(module, "_depth", lambda value: pytest.fail("walked the schema again"))
    assert checked.validate() is checked
    assert SamplingParams(structured_outputs=checked).validate().structured_outputs is checked
    with pytest.raises(pytest.fail.Exception):
        Constraint(json=schema).validate()
