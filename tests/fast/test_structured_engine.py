"""Structured output through the engine: the grammar's masks in the batched
step, its end as the row's end, its compile off the step (pagedlm.structured
holds the machinery; test_structured.py tests it alone)."""

from __future__ import annotations

import dataclasses
import json
import re
import sys

import jsonschema
import pytest

from pagedlm.batch.engine import LLMEngine
from pagedlm.batch.sequence import PENDING
from pagedlm.options import EngineOptions, PagedKvOptions
from pagedlm.params import SamplingParams
from pagedlm.structured import Constraint
from pagedlm.structured.matcher import GIL_SWITCH_S

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
          "required": ["name", "n", "tags"], "additionalProperties": False}
STORES = {
    "default": EngineOptions(),
    "paged": EngineOptions(paged_kv=PagedKvOptions(block_size=16, prefix_caching=False)),
    "paged-caching": EngineOptions(paged_kv=PagedKvOptions(block_size=16, prefix_caching=True)),
}


def run(engine: LLMEngine, requests: list[tuple[list[int], SamplingParams]]) -> list[list]:
    """Every request's sequences at their end, in order."""
    seqs = [engine.add_request(ids, params, request_id=f"r{i}") for i, (ids, params) in enumerate(requests)]
    while engine.has_unfinished():
        engine.step()
    return seqs


def constrained(kind: dict, **params) -> SamplingParams:
    return SamplingParams(max_tokens=200, structured_outputs=Constraint(**kind), **params)


def _async(options: EngineOptions, on: bool) -> EngineOptions:
    return dataclasses.replace(options, async_scheduling=on)


@pytest.mark.parametrize("store", list(STORES))
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_regex_and_choice_outputs_hold_their_constraint(model, tokenizer, store, temperature):
    engine = LLMEngine(model, tokenizer, STORES[store])
    prompt = tokenizer.encode("Reply: ")
    kinds = [dict(json=SCHEMA), dict(json_object=True), dict(regex=r"[a-c]{2,4}-[0-9]{1,3}"),
             dict(choice=["left", "right", "up"])]
    requests = [(prompt, constrained(k, temperature=temperature, seed=i, n=2)) for i, k in enumerate(kinds)]
    outputs = run(engine, requests)
    for kind, seqs in zip(kinds, outputs):
        for seq in seqs:
            assert seq.finish_reason == "stop", (kind, seq.text)
            if "json" in kind:
                jsonschema.validate(json.loads(seq.text), SCHEMA)
            elif "json_object" in kind:
                assert isinstance(json.loads(seq.text), dict)
            elif "regex" in kind:
                assert re.fullmatch(kind["regex"], seq.text), seq.text
            else:
                assert seq.text in kind["choice"]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_masks_filled_ahead_on_a_background_thread_give_the_same_tokens(model, tokenizer, monkeypatch, temperature):
    """``prefetch_masks`` (on by default on CUDA): each step's end starts the
    grammar rows' next masks on a background thread, the sampler takes them
    while the row has not moved; the same tokens as filling them in the
    step, rows arriving at different steps, most masks taken from ahead."""
    import pagedlm.structured as structured

    prompt = tokenizer.encode("Reply: ")
    kinds = [dict(json=SCHEMA), dict(regex=r"[a-c]{2,4}-[0-9]{1,3}"), dict(json_object=True)]
    fill = structured.fill_bitmask

    def outputs(prefetch: bool):
        engine = LLMEngine(model, tokenizer, STORES["paged"])
        engine.prefetch_masks = prefetch
        seqs = [engine.add_request(prompt, constrained(kinds[0], temperature=temperature, seed=1, n=2))]
        taken = []

        def counting(matchers, pinned=False, permitted=None):
            taken.extend(m._prefetched is not None and m._prefetched[0] == m.version for m in matchers)
            return fill(matchers, pinned, permitted)
        monkeypatch.setattr(structured, "fill_bitmask", counting)  # the name `sample` imports
        steps = 0
        while engine.has_unfinished():
            engine.step()
            steps += 1
            if steps in (2, 5):  # late arrivals: their first masks are filled in the step
                seqs.append(engine.add_request(prompt, constrained(kinds[steps // 3], temperature=temperature,
                                                                   seed=steps)))
        return [[(s.output_ids, s.finish_reason) for s in group] for group in seqs], taken

    switch = sys.getswitchinterval()
    try:
        plain, none_ahead = outputs(False)
        assert sys.getswitchinterval() == switch  # no background fill: the GIL is left as it was
        ahead, taken = outputs(True)
        assert sys.getswitchinterval() == pytest.approx(min(switch, GIL_SWITCH_S))  # the fill gets the GIL in 0.1 ms
    finally:
        sys.setswitchinterval(switch)
    assert ahead == plain and not any(none_ahead)
    assert sum(taken) > len(taken) / 2 and not all(taken)


def test_a_constrained_row_leaves_its_neighbours_alone(model, tokenizer):
    plain = [(tokenizer.encode(p), SamplingParams(max_tokens=16, temperature=t, seed=3, ignore_eos=True))
             for p, t in (("abc", 0.0), ("hello there", 1.0))]
    alone = [s.output_ids for (s,) in run(LLMEngine(model, tokenizer), plain)]
    mixed = plain[:1] + [(tokenizer.encode("x"), constrained(dict(json=SCHEMA)))] + plain[1:]
    beside = run(LLMEngine(model, tokenizer), mixed)
    assert [beside[0][0].output_ids, beside[2][0].output_ids] == alone
    jsonschema.validate(json.loads(beside[1][0].text), SCHEMA)


@pytest.mark.parametrize("on", [False, True], ids=["sync", "async"])
def test_a_grammar_that_dead_ends_ends_the_row_with_error(model, tokenizer, caplog, on):
    """allowed_token_ids that the grammar never allows: nothing can be
    sampled (under async scheduling the rules clear the mask's bits on the host)."""
    engine = LLMEngine(model, tokenizer, _async(EngineOptions(), on))
    digit = tokenizer.encode("7")
    params = constrained(dict(regex="[a-z]+"), allowed_token_ids=digit)
    (seq,), (other,) = run(engine, [(tokenizer.encode("q"), params),
                                    (tokenizer.encode("q"), SamplingParams(max_tokens=3, ignore_eos=True))])
    assert seq.finish_reason == "error" and seq.output_ids == []
    assert "dead-ends" in caplog.text
    assert other.finish_reason == "length" and len(other.output_ids) == 3
    assert not engine.has_unfinished()


def test_a_row_waits_for_its_compile_without_holding_others(model, tokenizer, monkeypatch):
    engine = LLMEngine(model, tokenizer)
    (seq,) = engine.add_request(tokenizer.encode("q"), constrained(dict(regex="[a-z]{3}")))
    (other,) = engine.add_request(tokenizer.encode("q"), SamplingParams(max_tokens=2, ignore_eos=True))
    monkeypatch.setattr(seq.matcher, "ready", lambda: False)  # still compiling
    engine.step()
    assert seq.num_computed == 0 and other.num_computed > 0  # passed over, the other admitted
    monkeypatch.undo()
    while engine.has_unfinished():
        engine.step()
    assert re.fullmatch("[a-z]{3}", seq.text) and seq.finish_reason == "stop"


def test_an_invalid_constraint_is_refused_when_added(model, tokenizer):
    engine = LLMEngine(model, tokenizer)
    with pytest.raises(ValueError, match="regex"):
        engine.add_request(tokenizer.encode("q"), SamplingParams(structured_outputs=Constraint(regex="(")))
    assert not engine.has_unfinished()


def _engine(model, tokenizer, options: EngineOptions, on: bool, deferred: bool = False) -> LLMEngine:
    """An engine with async scheduling ``on``; ``deferred``: its grammar steps
    leave their picks to the next step, masks filled in the background (as on CUDA)."""
    engine = LLMEngine(model, tokenizer, _async(options, on))
    engine.prefetch_masks = deferred
    return engine


@pytest.mark.parametrize("store,deferred", [("default", False), ("paged-caching", False), ("paged-caching", True)])
def test_grammar_rows_overlap_under_async_scheduling_with_the_synchronous_tokens(model, tokenizer, monkeypatch,
                                                                                store, deferred):
    """Async scheduling with grammar rows: each step lands the token in flight
    before its picks, fills the masks from it and picks on the device (or,
    ``deferred``, fills them in the background and leaves the pick to the
    next step, once that step has prepared its inputs: most masks are then
    taken from the background fill); the outputs (greedy JSON, regex and
    choice rows beside a plain one, a late arrival, rows ending on their
    grammar mid-batch) are the synchronous engine's, and steps were left in
    flight (their picks deferred) while grammar rows ran."""
    import pagedlm.structured as structured

    prompt = tokenizer.encode("Reply: ")
    kinds = [dict(json=SCHEMA), dict(regex=r"[a-c]{2,4}-[0-9]{1,3}"), dict(choice=["left", "right", "up"])]
    fill, taken = structured.fill_bitmask, []

    def counting(matchers, pinned=False, permitted=None):
        taken.extend(m._prefetched is not None and m._prefetched[0] == m.version for m in matchers)
        return fill(matchers, pinned, permitted)
    monkeypatch.setattr(structured, "fill_bitmask", counting)  # the name `grammar_masks` imports

    def outputs(on: bool):
        engine = _engine(model, tokenizer, STORES[store], on, deferred=on and deferred)
        seqs = [engine.add_request(prompt, constrained(k, n=2 if i == 0 else 1)) for i, k in enumerate(kinds)]
        seqs.append(engine.add_request(tokenizer.encode("abc"), SamplingParams(max_tokens=20, ignore_eos=True)))
        overlapped, waited, steps = [], [], 0
        while engine.has_unfinished():
            engine.step()
            steps += 1
            # a step in flight with grammar rows (the first steps may have none, their grammars compiling)
            inflight = engine._inflight
            overlapped.append(inflight is not None and any(s.matcher is not None for s in inflight.sampled))
            waited.append(inflight is not None and inflight.logits is not None)  # its pick deferred
            if steps == 3:
                seqs.append(engine.add_request(prompt, constrained(dict(json=SCHEMA))))
        return [[(s.output_ids, s.text, s.finish_reason) for s in group] for group in seqs], overlapped, waited

    sync, never, _ = outputs(False)
    taken.clear()
    got, overlapped, waited = outputs(True)
    assert got == sync and any(overlapped) and not any(never)
    assert all(w == (deferred and o) for w, o in zip(waited, overlapped))
    assert all(finish == "stop" for group in got[:3] for _, _, finish in group)
    assert (sum(taken) > len(taken) / 2) if deferred else not any(taken)


def test_grammar_rows_ended_by_a_stop_string_or_stop_token_under_deferred_picks(model, tokenizer):
    """With deferred picks a landing advances the grammar rows' matchers before
    their text (so the next masks start filling early): rows that a stop
    string or a stop token ends there end as synchronously (same tokens,
    text, reason), and a stop token is not fed to the grammar (a token a
    stop string ends the row at is: its matcher is not used again)."""
    prompt = tokenizer.encode("Reply: ")
    digits = [t for t in range(tokenizer.vocab_size) if tokenizer.decode([t]) in set("0123456789")]
    requests = [(prompt, constrained(dict(regex=r"[a-c]{2,4}-[0-9]{1,3}"), stop=["-"])),
                (prompt, constrained(dict(regex=r"[a-c]{2,4}-[0-9]{1,3}"), stop_token_ids=digits)),
                (prompt, constrained(dict(json=SCHEMA)))]

    def outputs(on: bool):
        seqs = run(_engine(model, tokenizer, STORES["paged"], on, deferred=on), requests)
        return [(s.output_ids, s.text, s.finish_reason, s.stop_reason) for (s,) in seqs], seqs[1][0].matcher.version

    sync, _ = outputs(False)
    deferred, taken = outputs(True)
    assert sync == deferred
    (ids, text, finish, reason), (ids2, text2, finish2, reason2) = sync[:2]
    assert finish == "stop" and reason == "-" and re.fullmatch("[a-c]{2,4}", text)
    assert finish2 == "stop" and reason2 == ids2[-1] and ids2[-1] in digits
    assert taken == len(ids2) - 1  # the grammar took every token but the stop token


@pytest.mark.parametrize("deferred", [False, True], ids=["picked", "deferred"])
def test_a_row_dead_at_its_mask_under_async_scheduling_ends_as_synchronously(model, tokenizer, monkeypatch, deferred):
    """A grammar row whose mask allows nothing at a step in flight (a parser
    limit, here forced) ends "error" with the tokens it had, as without async
    scheduling (``deferred``: found by the next step's pick, after that step
    gave the row a token to come); its neighbours go on."""
    import numpy as np

    import pagedlm.structured as structured

    fill = structured.fill_bitmask

    def outputs(on: bool):
        engine = _engine(model, tokenizer, STORES["paged"], on, deferred=on and deferred)
        (dies,) = engine.add_request(tokenizer.encode("q"), constrained(dict(regex="[a-z]{12}")))
        (lives,) = engine.add_request(tokenizer.encode("q"), constrained(dict(regex="[a-z]{12}")))

        def dead_at_four(matchers, pinned=False, permitted=None):
            bitmask, live = fill(matchers, pinned, permitted)
            for j, m in enumerate(matchers):
                if m is dies.matcher and m.version == 4:
                    bitmask.numpy()[j] = np.zeros_like(bitmask.numpy()[j])
                    live[j] = m._filled(False)
            return bitmask, live
        monkeypatch.setattr(structured, "fill_bitmask", dead_at_four)
        while engine.has_unfinished():
            engine.step()
        monkeypatch.undo()
        assert engine.blocks.num_free == engine.blocks.num_blocks and not engine.store.rows
        assert dies.num_computed <= dies.num_tokens  # no key counted for a token it never had
        return [(s.output_ids, s.text, s.finish_reason) for s in (dies, lives)]

    sync = outputs(False)
    assert sync == outputs(True)
    assert len(sync[0][0]) == 4 and sync[0][2] == "error"
    assert sync[1][2] == "stop" and re.fullmatch("[a-z]{12}", sync[1][1])


@pytest.mark.parametrize("deferred", [False, True], ids=["picked", "deferred"])
def test_grammar_rows_that_need_the_host_stay_synchronous_under_async(model, tokenizer, deferred):
    """Greedy grammar rows pick on the device, a one-token bad word cleared
    from the bitmask on the host; seeded or penalized grammar rows, and
    grammar rows with min_tokens, sample on the host (their steps run
    synchronously): the synchronous engine's outputs either way, and an
    aborted grammar row with a token in flight leaves nothing behind."""
    from pagedlm.sampling import picks_on_device

    prompt = tokenizer.encode("Reply: ")
    kinds = [constrained(dict(json=SCHEMA)), constrained(dict(json=SCHEMA), temperature=0.8, seed=4),
             constrained(dict(regex=r"[a-c]{2,9}"), repetition_penalty=1.2),
             constrained(dict(regex=r"[a-c]{2,9}"), bad_words=["b"]),
             constrained(dict(regex=r"[a-c ]{2,9}"), min_tokens=3)]

    def outputs(on: bool):
        engine = _engine(model, tokenizer, STORES["paged-caching"], on, deferred=on and deferred)
        seqs = [engine.add_request(prompt, p)[0] for p in kinds]
        doomed = engine.add_request(prompt, constrained(dict(json=SCHEMA)))[0]
        on_device = [picks_on_device(s) for s in seqs]
        while engine.has_unfinished():
            engine.step()
            if doomed.output_ids and not doomed.is_finished:
                engine.abort(doomed)
        assert PENDING not in doomed.output_ids and doomed.finish_reason == "abort"
        assert engine.blocks.num_free == engine.blocks.num_blocks and not engine.store.rows
        return [(s.output_ids, s.text, s.finish_reason) for s in seqs], on_device

    sync, _ = outputs(False)
    got, on_device = outputs(True)
    assert got == sync and on_device == [True, False, False, True, False]
    assert "b" not in got[3][1] and len(got[3][1]) >= 2
