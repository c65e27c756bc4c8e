"""vLLM's request fields, each doing what its name says through the engine
(tiny random-weight model, character tokenizer): logit_bias, allowed_token_ids,
bad_words, min_tokens, ignore_eos, stop_token_ids, include_stop_str_in_output,
skip_special_tokens, truncate_prompt_tokens, stop_reason; validate() leaves
the caller's object alone; special tokens are neither sampled nor printed
unless a request asks for them."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from pagedlm.batch.engine import LLMEngine
from pagedlm.loading import gguf as conv
from pagedlm.options import OptionError
from pagedlm.params import SamplingParams
from pagedlm.tokenizer import Tokenizer
from tests.helpers import VOCAB, CharTokenizer, tiny_model

MODEL = tiny_model("llama")
PROMPT = [ord(c) for c in "hello world"]
EOS = 1


class SpecialTokenizer(CharTokenizer):
    """CharTokenizer whose ``special`` ids (EOS among them) print as ``<N>`` unless skipped."""

    def __init__(self, special=(EOS,)):
        self.special_token_ids = frozenset(special)

    def decode(self, ids, skip_special_tokens=True):
        return "".join(f"<{i}>" if i in self.special_token_ids else chr(i)
                       for i in ids if not (skip_special_tokens and i in self.special_token_ids))


def run(params: SamplingParams, prompt=PROMPT, tok=None):
    """The finished sequences of one request."""
    engine = LLMEngine(MODEL, tok or CharTokenizer())
    seqs = engine.add_request(prompt, params)
    while engine.has_unfinished():
        engine.step()
    return seqs


def one(**fields):
    (seq,) = run(SamplingParams(**fields))
    return seq


FREE = one(max_tokens=12, ignore_eos=True).output_ids  # the unconstrained greedy continuation
SAMPLED = dict(temperature=1.0, seed=0)


def test_the_free_continuation_is_varied_text():
    """The cases below need a continuation of several distinct non-space, non-EOS tokens."""
    assert EOS not in FREE and len(set(FREE)) >= 4 and not chr(FREE[0]).isspace()


# ---------------------------------------------------------------- logit_bias


@pytest.mark.parametrize("sampling", [{}, SAMPLED], ids=["greedy", "sampled"])
def test_logit_bias_plus_100_forces_a_token(sampling):
    forced = next(t for t in range(2, VOCAB) if t not in FREE)
    seq = one(max_tokens=6, ignore_eos=True, logit_bias={forced: 100}, **sampling)
    assert seq.output_ids == [forced] * 6


@pytest.mark.parametrize("sampling", [{}, SAMPLED], ids=["greedy", "sampled"])
def test_logit_bias_minus_100_bans_a_token(sampling):
    banned = FREE[0] if not sampling else one(max_tokens=12, ignore_eos=True, **sampling).output_ids[0]
    seq = one(max_tokens=12, ignore_eos=True, logit_bias={banned: -100}, **sampling)
    assert banned not in seq.output_ids and len(seq.output_ids) == 12


def test_a_small_logit_bias_shifts_the_greedy_choice_by_its_value():
    """The bias is added to the logits (not a mask): the runner-up wins by a bias just
    over the gap, not by one just under it."""
    engine = LLMEngine(MODEL, CharTokenizer())
    (probe,) = engine.add_request(PROMPT, SamplingParams(max_tokens=1, ignore_eos=True, logprobs=2))
    while engine.has_unfinished():
        engine.step()
    (_, [(best, lp_best), (second, lp_second)]) = probe.logprobs[0]
    gap = lp_best - lp_second
    assert one(max_tokens=1, logit_bias={second: gap * 1.01 + 1e-4}).output_ids == [second]
    assert one(max_tokens=1, logit_bias={second: gap * 0.99}).output_ids == [best]


# ---------------------------------------------------------------- allowed_token_ids, bad_words


@pytest.mark.parametrize("sampling", [{}, SAMPLED], ids=["greedy", "sampled"])
def test_allowed_token_ids_restricts_every_token(sampling):
    allowed = [ord("a"), ord("b"), ord("c")]
    seq = one(max_tokens=10, ignore_eos=True, allowed_token_ids=allowed, **sampling)
    assert set(seq.output_ids) <= set(allowed) and len(seq.output_ids) == 10


def test_a_one_token_bad_word_is_never_generated():
    word = chr(FREE[0])
    seq = one(max_tokens=12, ignore_eos=True, bad_words=[word])
    assert FREE[0] not in seq.output_ids


def test_a_bad_word_of_several_tokens_bans_its_last_token_after_the_others():
    """vLLM: the last token is banned only where the output ends with the
    word's other tokens; the first token alone stays allowed."""
    i = next(i for i in range(len(FREE) - 1) if not chr(FREE[i]).isspace())
    word = chr(FREE[i]) + chr(FREE[i + 1])
    seq = one(max_tokens=12, ignore_eos=True, bad_words=[word])
    assert seq.output_ids[: i + 1] == FREE[: i + 1]  # the prefix is still generated
    assert seq.output_ids[i + 1] != FREE[i + 1]
    assert all(seq.output_ids[j : j + 2] != FREE[i : i + 2] for j in range(len(seq.output_ids) - 1))


# ---------------------------------------------------------------- min_tokens, ignore_eos, stops


def test_min_tokens_defers_eos():
    assert one(max_tokens=8, logit_bias={EOS: 100}).output_ids == [EOS]  # EOS is what it wants
    seq = one(max_tokens=8, logit_bias={EOS: 100}, min_tokens=5)
    assert seq.output_ids[5:] == [EOS] and EOS not in seq.output_ids[:5]
    assert seq.finish_reason == "stop" and seq.stop_reason is None


def test_min_tokens_defers_stop_token_ids_and_stop_strings():
    t = FREE[0]
    seq = one(max_tokens=8, logit_bias={t: 100}, stop_token_ids=[t], min_tokens=3)
    assert seq.output_ids[3:] == [t] and t not in seq.output_ids[:3] and seq.stop_reason == t
    seq = one(max_tokens=8, ignore_eos=True, logit_bias={t: 100}, stop=[chr(t)], min_tokens=3)
    assert seq.output_ids == [t] * 4 and seq.text == chr(t) * 3 and seq.stop_reason == chr(t)


def test_ignore_eos_keeps_going_past_eos_and_prints_nothing_for_it():
    seq = one(max_tokens=4, ignore_eos=True, logit_bias={EOS: 100})
    assert seq.output_ids == [EOS] * 4 and seq.finish_reason == "length" and seq.text == ""


def test_stop_token_ids_end_the_sequence_without_their_text_by_default():
    t = FREE[3]
    first = FREE.index(t)
    seq = one(max_tokens=12, stop_token_ids=[t])
    assert seq.output_ids == FREE[: first + 1] and seq.finish_reason == "stop" and seq.stop_reason == t
    assert seq.text == "".join(map(chr, FREE[:first]))
    kept = one(max_tokens=12, stop_token_ids=[t], include_stop_str_in_output=True)
    assert kept.text == "".join(map(chr, FREE[: first + 1]))


def test_include_stop_str_in_output_keeps_the_stop_string():
    free_text = "".join(map(chr, FREE))
    stop = free_text[3:5]
    at = free_text.find(stop)
    cut = one(max_tokens=12, ignore_eos=True, stop=[stop])
    kept = one(max_tokens=12, ignore_eos=True, stop=[stop], include_stop_str_in_output=True)
    assert cut.text == free_text[:at] and kept.text == free_text[: at + len(stop)]
    assert cut.stop_reason == kept.stop_reason == stop


def test_stop_reason_is_none_for_eos_and_length():
    assert one(max_tokens=3, logit_bias={EOS: 100}).stop_reason is None
    seq = one(max_tokens=3, ignore_eos=True)
    assert seq.finish_reason == "length" and seq.stop_reason is None


# ---------------------------------------------------------------- prompt, validation


def test_truncate_prompt_tokens_keeps_the_last_k():
    (seq,) = run(SamplingParams(max_tokens=6, ignore_eos=True, truncate_prompt_tokens=4))
    (tail,) = run(SamplingParams(max_tokens=6, ignore_eos=True), prompt=PROMPT[-4:])
    assert seq.prompt_ids == PROMPT[-4:] and seq.output_ids == tail.output_ids != FREE[:6]


def test_validate_returns_a_validated_copy_and_leaves_the_callers_object():
    mine = SamplingParams(top_k=-1, stop="x", temperature=1e-9, logit_bias={5: 500.0, 6: -1e9})
    before = dataclasses.replace(mine)
    checked = mine.validate()
    assert mine == before and checked is not mine
    assert checked.top_k == 0 and checked.stop == ["x"] and checked.temperature == 0.0
    assert checked.logit_bias == {5: 100.0, 6: -100.0}  # OpenAI's clamp


def test_the_default_max_tokens_is_vllms():
    assert SamplingParams().max_tokens == 16
    assert len(one(ignore_eos=True).output_ids) == 16


@pytest.mark.parametrize("fields,name", [
    (dict(max_tokens=0), "max_tokens"), (dict(temperature=-1.0), "temperature"), (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"), (dict(top_k=-2), "top_k"), (dict(min_p=2.0), "min_p"),
    (dict(repetition_penalty=0.0), "repetition_penalty"), (dict(logprobs=21), "logprobs"),
    (dict(min_tokens=-1), "min_tokens"), (dict(max_tokens=4, min_tokens=5), "min_tokens"),
    (dict(logit_bias={"5": 1.0}), "logit_bias"), (dict(logit_bias={5: float("inf")}), "logit_bias"),
    (dict(logit_bias={5: float("nan")}), "logit_bias"), (dict(logit_bias=[5]), "logit_bias"),
    (dict(allowed_token_ids=[]), "allowed_token_ids"), (dict(allowed_token_ids=[-1]), "allowed_token_ids"),
    (dict(bad_words=[" "]), "bad_words"), (dict(bad_words=[3]), "bad_words"),
    (dict(truncate_prompt_tokens=0), "truncate_prompt_tokens"), (dict(stop_token_ids=[-2]), "stop_token_ids"),
    (dict(seed=2**64), "seed"), (dict(seed=-(2**63) - 1), "seed"), (dict(seed=1.5), "seed"),
    # wrong types, named (not a TypeError from deep inside, nor a value taken as another)
    (dict(max_tokens=2.5), "max_tokens"), (dict(n=2.0), "n"), (dict(top_k=1.5), "top_k"),
    (dict(logprobs=True), "logprobs"), (dict(logprobs=1.0), "logprobs"),
    (dict(prompt_logprobs=True), "prompt_logprobs"),
    (dict(min_tokens=None), "min_tokens"), (dict(temperature=None), "temperature"),
    (dict(temperature="0.5"), "temperature"), (dict(top_p=True), "top_p"), (dict(stop=[""]), "stop"),
    (dict(stop=["a", ""]), "stop"), (dict(stop=5), "stop"),
])
def test_validate_names_the_bad_field_first(fields, name):
    with pytest.raises(OptionError, match=f"^{name} must"):
        SamplingParams(**fields).validate()


def test_vllms_nones_mean_its_defaults():
    """vLLM's SamplingParams defaults stop and stop_token_ids to None, and
    max_tokens None means up to the model's length (the engine resolves it)."""
    p = SamplingParams(stop=None, stop_token_ids=None, max_tokens=None, min_tokens=3).validate()
    assert p.stop == [] and p.stop_token_ids == [] and p.max_tokens is None


@pytest.mark.parametrize("field", ["temperature", "top_p", "min_p", "repetition_penalty"])
@pytest.mark.parametrize("value", [float("inf"), float("-inf"), float("nan")])
def test_non_finite_sampling_values_are_refused_naming_the_field(field, value):
    with pytest.raises(OptionError, match=f"^{field} must be a finite number"):
        SamplingParams(**{field: value}).validate()


@pytest.mark.parametrize("tiny", [1e-40, 1e-45, 1e-300, 5e-324, 9.9e-6])
def test_a_temperature_too_small_to_divide_by_is_greedy(tiny):
    assert SamplingParams(temperature=tiny).validate().temperature == 0.0


def test_a_small_but_usable_temperature_is_kept():
    assert SamplingParams(temperature=1e-5).validate().temperature == 1e-5


@pytest.mark.parametrize("name", ["logit_bias", "allowed_token_ids"])
def test_token_ids_outside_the_vocabulary_are_refused_naming_the_field(name):
    value = {VOCAB: 1.0} if name == "logit_bias" else [VOCAB]
    with pytest.raises(OptionError, match=f"^{name} holds token id {VOCAB}, outside the vocabulary"):
        run(SamplingParams(**{name: value}))


def test_the_largest_seeds_run_with_n_continuations():
    seqs = run(SamplingParams(n=2, seed=2**64 - 1, temperature=1.0, max_tokens=3, ignore_eos=True))
    assert len(seqs) == 2 and seqs[0].output_ids != seqs[1].output_ids


def test_seeds_2_to_the_32_apart_draw_differently():
    """torch's CPU generator keeps 32 bits of a seed: seeds of 2**32 and more (a negative one read
    as its unsigned 64-bit value, as torch reads it) are hashed into 32 bits, smaller ones kept."""
    def first_draws(seed):
        (seq,) = run(SamplingParams(seed=seed, temperature=1.0, max_tokens=1, ignore_eos=True))
        return seq.generator.initial_seed(), torch.rand(8, generator=seq.generator).tolist()

    assert first_draws(7)[0] == 7 and first_draws(2**32 - 1)[0] == 2**32 - 1
    assert first_draws(-1) == first_draws(2**64 - 1)  # one 64-bit value
    seeds = [2**64 - 1, 2**63 - 1, 2**63, -(2**62), 5 + 2**32, 5 + 2**33]
    draws = [first_draws(seed) for seed in seeds]
    assert all(s < 2**32 for s, _ in draws) and len({s for s, _ in draws}) == len(seeds)
    assert len({tuple(d) for _, d in draws}) == len(seeds)
    assert first_draws(2**63 - 1) == draws[1]  # still the same seed, the same draws


# ---------------------------------------------------------------- special tokens


def test_special_tokens_are_not_sampled_unless_the_request_names_them():
    best = FREE[0]
    tok = SpecialTokenizer({EOS, best})  # the model's favourite is now a special token
    banned = run(SamplingParams(max_tokens=12, ignore_eos=True), tok=tok)[0]
    assert banned.output_ids[0] != best and best not in banned.output_ids
    for fields in (dict(allowed_token_ids=[best]), dict(logit_bias={best: 0.01}), dict(stop_token_ids=[best])):
        (seq,) = run(SamplingParams(max_tokens=12, ignore_eos=True, **fields), tok=tok)
        assert seq.output_ids[0] == best, fields


def test_special_tokens_are_not_sampled_at_a_temperature():
    special = set(range(2, VOCAB, 2))  # every other token
    seq = run(SamplingParams(max_tokens=40, ignore_eos=True, temperature=5.0, seed=1),
              tok=SpecialTokenizer(special | {EOS}))[0]
    assert not special & set(seq.output_ids)


def test_eos_is_never_banned_as_a_special_token():
    seq = run(SamplingParams(max_tokens=8, logit_bias={EOS: 100}), tok=SpecialTokenizer({EOS}))[0]
    assert seq.output_ids == [EOS] and seq.finish_reason == "stop"


def test_skip_special_tokens_false_keeps_their_text():
    special = FREE[0]
    fields = dict(max_tokens=3, ignore_eos=True, logit_bias={special: 100})
    tok = SpecialTokenizer({EOS, special})
    assert run(SamplingParams(**fields), tok=tok)[0].text == ""
    assert run(SamplingParams(**fields, skip_special_tokens=False), tok=tok)[0].text == f"<{special}>" * 3


def _gemma_like() -> Tokenizer:
    """A GGUF vocabulary as Gemma 3's lays it out: control tokens, and
    user-defined ones that are text (<table>) or an image marker."""
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>", "<start_of_image>",
              "<table>", "\u2581", "a", "b"]
    types = [conv.CONTROL] * 6 + [conv.USER_DEFINED] * 2 + [conv.NORMAL] * 3
    md = {"general.architecture": "gemma3", "tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens,
          "tokenizer.ggml.token_type": types, "tokenizer.ggml.scores": [0.0] * len(tokens),
          "tokenizer.ggml.unknown_token_id": 3}
    return Tokenizer(conv.build_tokenizer(conv.GgufFile(Path("x"), md, [])), bos_token="<bos>", eos_token="<eos>")


def test_the_tokenizer_knows_control_tokens_and_gemmas_image_markers_are_special():
    tok = _gemma_like()
    image, table, a = tok.token_to_id("<start_of_image>"), tok.token_to_id("<table>"), tok.token_to_id("a")
    assert {0, 1, 2, 4, 5, image} <= tok.special_token_ids and table not in tok.special_token_ids
    ids = [a, image, table, a]
    assert tok.decode(ids) == "a<table>a"
    assert tok.decode(ids, skip_special_tokens=False) == "a<start_of_image><table>a"
    for skip, expected in ((True, "a<table>a"), (False, "a<start_of_image><table>a")):
        detok = tok.detokenizer(skip)
        assert "".join(detok.add_token(i) for i in ids) + detok.finalize() == expected


@pytest.mark.parametrize("fields", [dict(allowed_token_ids=[ord("a")], bad_words=["a"]),
                                    dict(allowed_token_ids=[EOS], min_tokens=2)])
def test_allowed_token_ids_that_leave_nothing_to_sample_are_refused(fields):
    with pytest.raises(OptionError, match="^allowed_token_ids must"):
        run(SamplingParams(**fields))


# ---------------------------------------------------------------- structured_outputs


def test_structured_outputs_become_a_validated_constraint():
    from pagedlm.structured import Constraint

    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    assert SamplingParams(structured_outputs={"json": schema}).validate().structured_outputs == Constraint(json=schema)
    assert SamplingParams(structured_outputs={"choice": ["a", "b"], "regex": None, "json_object": False,
                                              "disable_fallback": True}).validate().structured_outputs \
        == Constraint(choice=("a", "b"))
    given = Constraint(regex="[0-9]+")
    assert SamplingParams(structured_outputs=given).validate().structured_outputs == given
    assert SamplingParams().validate().structured_outputs is None
    assert SamplingParams(structured_outputs={"grammar": 'start: "a"'}, n=2).validate().continuations()[1] \
        .structured_outputs == Constraint(grammar='start: "a"')


@pytest.mark.parametrize("value,message", [
    ({"regex": "a{3"}, "structured_outputs.regex 'a{3' does not compile"),
    ({"json": {"type": "objectx"}}, "structured_outputs.json is not a JSON schema pagedlm can follow"),
    ({"choice": []}, "structured_outputs.choice must hold at least one string"),
    ({"regex": "a", "choice": ["a"]}, "structured_outputs must set exactly one of json, json_object, regex, choice, "
                                      "grammar \\(got regex, choice\\)"),
    ({}, "structured_outputs must set exactly one of .* \\(got none\\)"),
    ({"whitespace_pattern": "[ ]*", "json_object": True}, "structured_outputs.whitespace_pattern is not supported"),
    ({"structural_tag": {"x": 1}, "json_object": True}, "structured_outputs.structural_tag is not supported"),
    ({"disable_any_whitespace": True, "json_object": True},
     "structured_outputs.disable_any_whitespace is not supported"),
    ({"disable_additional_properties": False, "json_object": True},
     "structured_outputs.disable_additional_properties must be true or null"),
    ({"disable_fallback": "yes", "json_object": True}, "structured_outputs.disable_fallback must be true or false"),
    ({"backend": "xgrammar", "json_object": True}, "structured_outputs.backend is not a structured output field"),
    ("a+", "structured_outputs must be a Constraint or a dict"),
])
def test_bad_structured_outputs_are_refused_naming_the_key(value, message):
    with pytest.raises(OptionError, match=f"^{message}"):
        SamplingParams(structured_outputs=value).validate()


def test_disable_additional_properties_true_is_what_the_grammar_does():
    for given in (True, None):
        params = SamplingParams(structured_outputs={"json": {"type": "object"}, "disable_additional_properties": given})
        assert params.validate().structured_outputs.json == {"type": "object"}


def test_a_constrained_request_leaves_control_tokens_to_its_grammar():
    from pagedlm.sampling import token_rules
    from tests.helpers import tiny_tokenizer

    tok = tiny_tokenizer()
    start = tok.token_to_id("<|im_start|>")
    assert start in tok.control_token_ids and start != tok.token_to_id("<|im_end|>")
    plain = token_rules(SamplingParams().validate(), tok, tok.vocab_size)
    constrained = token_rules(SamplingParams(structured_outputs={"grammar": 'start: <|im_start|> "a"'}).validate(),
                              tok, tok.vocab_size)
    assert start in plain.banned and start not in constrained.banned


def test_e2e_llm_generate_follows_structured_outputs(model, tokenizer):
    """Needs the engine's wiring of issue 22."""
    from pagedlm import LLM

    llm = LLM(model, tokenizer=tokenizer, max_model_len=256)
    params = [SamplingParams(max_tokens=20, structured_outputs={"choice": ["alpha", "beta"]}),
              SamplingParams(max_tokens=20, structured_outputs={"regex": "[0-9]{4}"})]
    first, second = llm.generate(["x", "y"], params, use_tqdm=False)
    assert first.outputs[0].text in ("alpha", "beta") and first.outputs[0].finish_reason == "stop"
    assert len(second.outputs[0].text) == 4 and second.outputs[0].text.isdigit()
