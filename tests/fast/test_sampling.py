import torch

from pagedlm.generate import StopMatcher
from pagedlm.options import GenerateOptions
from pagedlm.sampling import Sampler, apply_repetition_penalty


def _draws(options, n=50):
    logits = torch.randn(100, generator=torch.Generator().manual_seed(0))
    sampler = Sampler(options)
    return [sampler(logits) for _ in range(n)]


def test_greedy_is_argmax():
    logits = torch.tensor([0.1, 3.0, -1.0, 2.9])
    assert Sampler(GenerateOptions(temperature=0))(logits) == 1


def test_same_seed_same_tokens_and_other_seed_differs():
    a = _draws(GenerateOptions(temperature=1.0, seed=7))
    b = _draws(GenerateOptions(temperature=1.0, seed=7))
    c = _draws(GenerateOptions(temperature=1.0, seed=8))
    assert a == b and a != c


def test_top_k_only_draws_from_the_k_best():
    logits = torch.randn(100, generator=torch.Generator().manual_seed(0))
    best = set(torch.topk(logits, 3).indices.tolist())
    assert set(_draws(GenerateOptions(temperature=5.0, top_k=3, seed=1), 200)) <= best


def test_top_p_keeps_the_smallest_set_reaching_p():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    sampler = Sampler(GenerateOptions(temperature=1.0, top_p=0.7, seed=0))
    assert {sampler(logits) for _ in range(300)} == {0, 1}


def test_min_p_drops_tokens_below_a_fraction_of_the_best():
    logits = torch.log(torch.tensor([0.6, 0.3, 0.05, 0.05]))
    sampler = Sampler(GenerateOptions(temperature=1.0, min_p=0.2, seed=0))
    assert {sampler(logits) for _ in range(300)} == {0, 1}


def test_repetition_penalty_divides_positive_and_multiplies_negative():
    logits = torch.tensor([2.0, -2.0, 1.0])
    out = apply_repetition_penalty(logits, torch.tensor([0, 1, 1]), 2.0)
    assert out.tolist() == [1.0, -4.0, 1.0]


def test_stop_matcher_holds_back_a_partial_stop_and_cuts_at_the_stop():
    m = StopMatcher(["</end>"])
    assert m.feed("hello </") == ("hello ", False)
    assert m.feed("e") == ("", False)
    assert m.feed("nd> more") == ("", True)
    m = StopMatcher(["</end>"])
    assert m.feed("a </b") == ("a </b", False)


def test_stop_matcher_flushes_held_text_at_the_end():
    m = StopMatcher(["STOP"])
    assert m.feed("abc ST") == ("abc ", False)
    assert m.flush() == "ST"
