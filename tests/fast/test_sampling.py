import torch

from pagedlm.batch.sequence import Sequence, StopMatcher
from pagedlm.params import GenerateOptions
from pagedlm.sampling import TokenRules, apply_penalties, sample, sample_row


def Sampler(options, tokens=(2,), output=()):  # noqa: N802 - reads like the sampler it stands for
    """One sequence's next-token draw, with ``tokens`` as its prompt."""
    seq = Sequence(list(tokens), options, set(), None)
    seq.output_ids = list(output)
    return lambda logits: sample_row(logits, seq)


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
    seq = Sequence([0, 1, 1], GenerateOptions(repetition_penalty=2.0), set(), None)
    assert apply_penalties(logits, seq).tolist() == [1.0, -4.0, 1.0]


def test_presence_and_frequency_penalties_count_generated_tokens_only():
    """OpenAI: logit -= frequency * count + presence, over the output, not the prompt."""
    logits = torch.zeros(4)
    seq = Sequence([3, 3], GenerateOptions(presence_penalty=0.5, frequency_penalty=0.25), set(), None)
    seq.output_ids = [1, 1, 2]
    assert apply_penalties(logits, seq).tolist() == [0.0, -1.0, -0.75, 0.0]


def _drawn(probs, seed):
    return int(torch.multinomial(probs, 1, generator=torch.Generator().manual_seed(seed)))


def test_batched_sample_matches_an_independent_reference():
    """Greedy rows share one argmax (kept only where the row's rules permit
    it), the others draw with their own generators; each row checked against
    the textbook formula, not against the sampler's own row path."""
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(3))
    banned_best = int(logits[4].argmax())
    opts = [GenerateOptions(), GenerateOptions(temperature=1.0, seed=1), GenerateOptions(repetition_penalty=1.5),
            GenerateOptions(temperature=0.5, top_k=5, seed=2), GenerateOptions()]
    seen = [int(logits[2].argmax()), 8]  # row 2's prompt: its best token is penalized
    batch = [Sequence(seen if i == 2 else [7, 8], o, set(), None) for i, o in enumerate(opts)]
    batch[4].rules = TokenRules(banned=[banned_best])
    penalized = logits[2].clone()
    penalized[seen] = torch.where(penalized[seen] > 0, penalized[seen] / 1.5, penalized[seen] * 1.5)
    cold = logits[3] / 0.5
    cold[cold < cold.topk(5).values[-1]] = float("-inf")
    expected = [
        int(logits[0].argmax()),
        _drawn(torch.softmax(logits[1], -1), 1),
        int(penalized.argmax()),
        _drawn(torch.softmax(cold, -1), 2),
        int(logits[4].topk(2).indices[1]),  # the best but the banned one
    ]
    assert penalized.argmax() != logits[2].argmax() and expected[4] != banned_best  # the cases are real
    assert sample(logits, batch) == expected


def test_extreme_accepted_values_never_make_nan():
    """A tiny top_p (float32 rounds it to 0) keeps the best token; a tiny
    repetition penalty (positive logits / 1e-38 = inf) still draws a token."""
    logits = torch.tensor([1.0, 3.0, 2.0, -1.0])
    assert {Sampler(GenerateOptions(temperature=1.0, top_p=1e-46, seed=0))(logits) for _ in range(20)} == {1}
    draw = Sampler(GenerateOptions(temperature=1.0, repetition_penalty=1e-45, seed=0), tokens=[0, 1, 2])
    assert torch.isinf(apply_penalties(logits, Sequence([0, 1, 2], GenerateOptions(repetition_penalty=1e-45),
                                                        set(), None))).any()  # the case is real
    assert {draw(logits) for _ in range(20)} <= {0, 1, 2}


def test_stop_matcher_holds_back_a_partial_stop_and_cuts_at_the_stop():
    m = StopMatcher(["</end>"])
    assert m.feed("hello </") == ("hello ", None)
    assert m.feed("e") == ("", None)
    assert m.feed("nd> more") == ("", "</end>")
    m = StopMatcher(["</end>"])
    assert m.feed("a </b") == ("a </b", None)


def test_stop_matcher_flushes_held_text_at_the_end():
    m = StopMatcher(["STOP"])
    assert m.feed("abc ST") == ("abc ", None)
    assert m.flush() == "ST"


def test_stop_matcher_keeps_the_stop_string_with_include_and_names_the_first():
    m = StopMatcher(["END", "</"], include=True)
    assert m.feed("a </b") == ("a </", "</")
    m = StopMatcher(["END"], include=True)
    assert m.feed("x EN") == ("x ", None)
    assert m.feed("D tail") == ("ENDD"[:3], "END")
