import numpy as np
import pytest
import torch

from pagedlm.batch.sequence import Sequence, StopMatcher
from pagedlm.params import SamplingParams
from pagedlm.sampling import TokenRules, apply_penalties, argmax_rows, sample, sample_row


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
    assert Sampler(SamplingParams(temperature=0))(logits) == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_the_batched_greedy_argmax_is_torchs_with_ties_nans_and_dead_rows(dtype):
    """The greedy rows' shared argmax (numpy's on the CPU): torch.argmax's
    index on every row, the first of tied maxima, a NaN as the largest, 0 on a
    row of -inf, on a strided selection of rows too."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(7, 1000, generator=g).to(dtype)
    logits[1, [10, 500, 999]] = 50.0  # tied maxima
    logits[2, 700] = float("nan")
    logits[2, 900] = float("nan")
    logits[3] = float("-inf")
    logits[4, 0] = float("inf")
    logits[4, 5] = float("inf")
    for rows in (logits, logits[[6, 1, 2, 3]], logits[:, ::3]):
        assert argmax_rows(rows) == torch.argmax(rows, dim=-1).tolist()
    assert argmax_rows(logits)[1:5] == [10, 700, 0, 0]


def test_same_seed_same_tokens_and_other_seed_differs():
    a = _draws(SamplingParams(temperature=1.0, seed=7))
    b = _draws(SamplingParams(temperature=1.0, seed=7))
    c = _draws(SamplingParams(temperature=1.0, seed=8))
    assert a == b and a != c


def test_top_k_only_draws_from_the_k_best():
    logits = torch.randn(100, generator=torch.Generator().manual_seed(0))
    best = set(torch.topk(logits, 3).indices.tolist())
    assert set(_draws(SamplingParams(temperature=5.0, top_k=3, seed=1), 200)) <= best


def test_top_p_keeps_the_smallest_set_reaching_p():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    sampler = Sampler(SamplingParams(temperature=1.0, top_p=0.7, seed=0))
    assert {sampler(logits) for _ in range(300)} == {0, 1}


def test_min_p_drops_tokens_below_a_fraction_of_the_best():
    logits = torch.log(torch.tensor([0.6, 0.3, 0.05, 0.05]))
    sampler = Sampler(SamplingParams(temperature=1.0, min_p=0.2, seed=0))
    assert {sampler(logits) for _ in range(300)} == {0, 1}


def test_repetition_penalty_divides_positive_and_multiplies_negative():
    logits = torch.tensor([2.0, -2.0, 1.0])
    seq = Sequence([0, 1, 1], SamplingParams(repetition_penalty=2.0), set(), None)
    assert apply_penalties(logits, seq).tolist() == [1.0, -4.0, 1.0]


def test_presence_and_frequency_penalties_count_generated_tokens_only():
    """OpenAI: logit -= frequency * count + presence, over the output, not the prompt."""
    logits = torch.zeros(4)
    seq = Sequence([3, 3], SamplingParams(presence_penalty=0.5, frequency_penalty=0.25), set(), None)
    seq.output_ids = [1, 1, 2]
    assert apply_penalties(logits, seq).tolist() == [0.0, -1.0, -0.75, 0.0]


def _top_k(probs: torch.Tensor, k: int) -> torch.Tensor:
    """The ``k`` most likely tokens' probabilities, zeros elsewhere."""
    kept = torch.zeros_like(probs)
    best = probs.topk(k).indices
    kept[best] = probs[best]
    return kept


def _top_p(probs: torch.Tensor, p: float) -> torch.Tensor:
    """The most likely tokens' probabilities, best first until their mass reaches ``p``, zeros elsewhere."""
    kept, mass = torch.zeros_like(probs), 0.0
    for i in probs.argsort(descending=True).tolist():
        kept[i], mass = probs[i], mass + float(probs[i])
        if mass >= p:
            return kept
    return kept


def test_batched_sample_matches_an_independent_reference():
    """Every kind of row in one batch, 20 steps: greedy rows that share the
    batch's argmax, kept only where the row's rules permit it (a ban, an
    allowed set, a bad word's last token, a stop id before min_tokens send
    the row to its best permitted token); greedy rows that leave the shared
    argmax (a bias, a penalty); sampled rows, each drawing from its own
    seeded generator (top-k, top-p, min-p). Each row is checked against the
    textbook formula, not against the sampler's own row path, in a mixed
    batch whose shared rows are not contiguous, and in a batch of shared
    rows only (one argmax over the whole batch)."""
    logits = torch.randn(12, 50, generator=torch.Generator().manual_seed(3))
    order = logits.argsort(-1, descending=True)  # order[i, 0]: row i's best token
    first = [int(order[i, 0]) for i in range(len(logits))]
    second = [int(order[i, 1]) for i in range(len(logits))]
    last = int(order[6, -1])
    penalized = logits[7].clone()
    seen = [first[7], second[7]]
    penalized[seen] = torch.where(penalized[seen] > 0, penalized[seen] / 1.5, penalized[seen] * 1.5)
    allowed = {int(t) for t in order[3, 1:6]}  # its best token is not allowed
    probs = torch.softmax(logits, -1)
    cold = _top_k(torch.softmax(logits[9] / 0.5, -1), 5)
    min_p = probs[11].masked_fill(probs[11] < 0.3 * probs[11].max(), 0.0)
    greedy = SamplingParams()
    # (params, prompt, output, rules, the token every step, or what the row's own generator draws from)
    rows = [
        (greedy, [7], [], None, first[0]),
        (greedy, [7], [], TokenRules(banned=[second[1]]), first[1]),
        (greedy, [7], [], TokenRules(banned=[first[2]]), second[2]),
        (greedy, [7], [], TokenRules(allowed=allowed), max(allowed, key=lambda t: logits[3, t])),
        (greedy, [7], [9], TokenRules(bad_words=[(9, first[4])]), second[4]),
        (greedy, [7], [9], TokenRules(min_tokens=2, stop_ids=[first[5]]), second[5]),
        (greedy, [7], [], TokenRules(bias={last: 100.0}), last),
        (SamplingParams(repetition_penalty=1.5), seen, [], None, int(penalized.argmax())),
        (SamplingParams(temperature=1.0, seed=1), [7], [], None, probs[8]),
        (SamplingParams(temperature=0.5, top_k=5, seed=2), [7], [], None, cold),
        (SamplingParams(temperature=1.0, top_p=0.3, seed=3), [7], [], None, _top_p(probs[10], 0.3)),
        (SamplingParams(temperature=1.0, min_p=0.3, seed=4), [7], [], None, min_p),
    ]
    assert int(penalized.argmax()) != first[7] and last != first[6]  # the cases are real
    assert 2 < int((_top_p(probs[10], 0.3) > 0).sum()) < 50 and 1 < int((min_p > 0).sum()) < 50

    def batch(picked):
        seqs = []
        for i in picked:
            params, prompt, output, rules, _ = rows[i]
            seq = Sequence(prompt, params, set(), None, rules=rules)
            seq.output_ids = list(output)
            seqs.append(seq)
        return seqs

    mixed = [8, 0, 6, 1, 9, 2, 7, 3, 10, 4, 11, 5]
    seqs = batch(mixed)
    draws = {i: torch.Generator().manual_seed(rows[i][0].seed) for i in mixed if rows[i][0].seed is not None}
    for _ in range(20):
        want = [int(torch.multinomial(rows[i][4], 1, generator=draws[i])) if i in draws else rows[i][4]
                for i in mixed]
        assert sample(logits[mixed], seqs) == want
    shared = [5, 3, 0, 4, 2, 1]
    assert sample(logits[shared], batch(shared)) == [rows[i][4] for i in shared]


def test_extreme_accepted_values_never_make_nan():
    """A tiny top_p (float32 rounds it to 0) keeps the best token; a tiny
    repetition penalty (positive logits / 1e-38 = inf) still draws a token."""
    logits = torch.tensor([1.0, 3.0, 2.0, -1.0])
    assert {Sampler(SamplingParams(temperature=1.0, top_p=1e-46, seed=0))(logits) for _ in range(20)} == {1}
    draw = Sampler(SamplingParams(temperature=1.0, repetition_penalty=1e-45, seed=0), tokens=[0, 1, 2])
    assert torch.isinf(apply_penalties(logits, Sequence([0, 1, 2], SamplingParams(repetition_penalty=1e-45),
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


@pytest.mark.parametrize("allowed", [None, [0, 5, 31, 32, 63, 99]])
def test_rule_words_are_the_rule_mask_in_llguidances_bit_layout(allowed):
    """`TokenRules.words` (what async grammar rows AND into their bitmasks)
    and `TokenRules.mask` (what the sampler adds) permit exactly the tokens
    the rules do: bit j of int32 word i is token 32 i + j, past the
    vocabulary nothing; the mask 0 there and -inf elsewhere."""
    banned = [1, 32, 70, 99]
    rules = TokenRules(banned=banned, allowed=allowed)
    width = 100
    permitted = [t not in banned and (allowed is None or t in allowed) for t in range(width)]
    words = rules.words(width)
    assert words.dtype == np.int32 and words.shape == (4,)
    bits = np.unpackbits(words.view(np.uint8), bitorder="little").astype(bool)
    assert bits[:width].tolist() == permitted and not bits[width:].any()
    mask = rules.mask(width, torch.device("cpu"))
    assert mask.dtype == torch.float32 and mask.tolist() == [0.0 if p else float("-inf") for p in permitted]
    # another request's rules that permit the same tokens share both (a step applies each once)
    same, other = TokenRules(banned=[99, 70, 32, 1], allowed=allowed), TokenRules(banned=[1, 32, 70], allowed=allowed)
    assert same.words(width) is words and same.mask(width, "cpu") is rules.mask(width, torch.device("cpu"))
    assert other.words(width) is not words and not np.array_equal(other.words(width), words)
    assert not words.flags.writeable  # shared: nobody may change it in place


def test_draw_on_the_cpu_follows_probs_across_blocks():
    """`draw` on the CPU (a uniform a row looked up in the row's cumulative
    sums, block first): over 12,000 rows of one distribution spanning two
    blocks and a part (tokens of probability 0 among them, heavy ones in
    the last part), no token of probability 0, and counts that fit the
    probabilities (chi-square, fixed seed)."""
    from pagedlm.sampling import DRAW_BLOCK, draw

    torch.manual_seed(0)
    width, n = 2 * DRAW_BLOCK + 300, 12_000
    probs = torch.rand(width, generator=torch.Generator().manual_seed(3)) ** 4
    probs[::5] = 0.0
    probs[2 * DRAW_BLOCK + 100 : 2 * DRAW_BLOCK + 110] = 40.0  # about half the mass, past the second block
    counts = torch.bincount(draw(probs.expand(n, width).contiguous()), minlength=width).double()
    want = probs.double() / probs.sum()
    assert counts[want == 0].sum() == 0
    assert counts.shape == (width,)  # nothing past the row
    keep = want * n >= 5
    expected = want[keep] * n
    chi2 = float(((counts[keep] - expected) ** 2 / expected).sum())
    dof = int(keep.sum()) - 1
    assert chi2 < dof + 6 * (2 * dof) ** 0.5 + 10, (chi2, dof)
    assert counts[2 * DRAW_BLOCK :].sum() > 0.3 * n  # the last part's heavy tokens are drawn
