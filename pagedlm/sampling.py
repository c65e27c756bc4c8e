"""Per-row sampling for a whole step: ``sample``; what a request rules in and
out: ``TokenRules``.

A row with a grammar (its sequence's ``matcher``, `pagedlm.structured`)
first has every token its grammar refuses next set to -inf (one bitmask per
row, applied on the logits' device), and is then sampled like any other row;
a step's unconstrained rows are sampled exactly as in a step without
constrained rows. When nothing is left to sample (the grammar allows no
token, or none that the request's rules permit), the row's token is None and
its matcher is dead: the engine ends the row.

Each row brings its own `SamplingParams`. First its request's `TokenRules`
(vLLM's order, before penalties): ``logit_bias`` is added to the logits (on
greedy rows too: +100 forces a token, -100 bans it); tokens outside
``allowed_token_ids``, banned tokens and this step's bans (the last token of
a bad word whose other tokens the output ends with; EOS and stop token ids
while fewer than ``min_tokens`` are out) go to -inf. Then penalties
(repetition, CTRL-style; presence and frequency, OpenAI-style, over the
generated tokens), then temperature, top-k, top-p, min-p, in the order
Hugging Face applies them, so that a request means the same here as there.
Greedy rows take the argmax. Seeded rows draw with their sequence's own
CPU generator, so a seed gives the same tokens whatever shares the batch
and on any device. Unseeded rows (no penalties, bias or rules that change
with the output) draw from the same distribution all at once on the
logits' device (`pick_on_device`), in the step or, under async
scheduling, before the host sees the token; others row by row.

Special tokens are not text, and by default no row samples one: a special
token (`Tokenizer.special_token_ids`: control tokens such as ``<bos>``,
``<start_of_turn>``, ``<unused0>``, Gemma's ``<start_of_image>``) that is not
an end-of-sequence token is banned, because a model never writes it in text
(sampled at a temperature it would print markup, or vanish from the text).
A request lifts the ban for the tokens it names: in ``allowed_token_ids``,
with a positive ``logit_bias``, or in ``stop_token_ids``; a constrained
request's grammar decides about control tokens (llguidance allows one only
where the grammar names it). (vLLM bans
nothing; its text skips such tokens, ours does too.)

The greedy rows of a step share one argmax, checked against each row's
rules in Python; only a row whose argmax its rules exclude (or with a bias,
penalties or a temperature) is masked and sampled on its own. Rules are
built once per request, their masks once per device.

No accepted value can make a NaN: logits are made finite and shifted so the
best is 0 before dividing by the temperature (a tiny temperature sends the
rest to -inf, never the best), and top-p always keeps the best token.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Collection, Iterable, Protocol

import numpy as np
import torch

from pagedlm.kernels import fused
from pagedlm.kernels.copies import to_device
from pagedlm.options import OptionError
from pagedlm.params import SamplingParams, check_token_ids

if TYPE_CHECKING:
    from pagedlm.structured import RowMatcher
    from pagedlm.tokenizer import Tokenizer


class Sequence(Protocol):
    """What the sampler reads of a row (``batch.sequence.Sequence`` is one)."""

    params: SamplingParams
    rules: "TokenRules | None"
    generator: torch.Generator | None
    output_ids: list[int]
    matcher: "RowMatcher | None"

    @property
    def tokens(self) -> list[int]: ...


class TokenRules:
    """One request's rules on its next token (its ``n`` sequences share them)."""

    def __init__(self, banned: Iterable[int] = (), allowed: Iterable[int] | None = None,
                 bias: dict[int, float] | None = None, bad_words: Iterable[tuple[int, ...]] = (),
                 min_tokens: int = 0, stop_ids: Iterable[int] = ()) -> None:
        self.banned = frozenset(banned)  # never sampled
        self.allowed = None if allowed is None else frozenset(allowed)  # only these are sampled
        self.bias = dict(bias) if bias else None  # token id -> added to its logit
        self.bad_words = tuple(bad_words)  # two tokens or more: the last is banned after the others
        self.min_tokens = min_tokens
        self.stop_ids = sorted(stop_ids)  # banned while fewer than min_tokens are out
        self._tensors: dict[tuple[str, torch.device], torch.Tensor] = {}

    def banned_now(self, output_ids: list[int]) -> list[int]:
        """The tokens banned at this step only, after ``output_ids``."""
        now = [w[-1] for w in self.bad_words
               if len(w) - 1 <= len(output_ids) and tuple(output_ids[len(output_ids) - len(w) + 1 :]) == w[:-1]]
        if len(output_ids) < self.min_tokens:
            now += self.stop_ids
        return now

    def permits(self, token: int, output_ids: list[int]) -> bool:
        """May ``token`` follow ``output_ids`` (the bias aside)?"""
        if token in self.banned or (self.allowed is not None and token not in self.allowed):
            return False
        if not self.bad_words and len(output_ids) >= self.min_tokens:  # nothing banned for now
            return True
        return token not in self.banned_now(output_ids)

    def _tensor(self, name: str, device: torch.device) -> torch.Tensor:
        key = (name, device)
        if key not in self._tensors:
            if name == "bias_values":
                values, dtype = list(self.bias.values()), torch.float32
            else:
                values = list(self.bias) if name == "bias_ids" else sorted(getattr(self, name))
                dtype = torch.long
            self._tensors[key] = torch.tensor(values, dtype=dtype, device=device)
        return self._tensors[key]

    def static(self) -> bool:
        """Its rules do not change with the output (no bad_words, no min_tokens)."""
        return not self.bad_words and not self.min_tokens

    def mask(self, width: int, device: torch.device) -> torch.Tensor:
        """float32 ``[width]``: 0 for the tokens it permits (bias and the step's
        own bans aside), -inf for the rest. Rules that permit the same tokens
        share one tensor a device (made, and copied there, once: a request's
        first step does not wait for a copy of its own)."""
        return _permitted_mask(self.banned, self.allowed, width, torch.device(device))

    def words(self, width: int) -> np.ndarray:
        """int32 ``[ceil(width / 32)]``, read-only: bit ``j`` of word ``i`` set
        where it permits token ``32 * i + j`` (llguidance's bitmask layout; the
        bias and the step's own bans aside). Rules that permit the same tokens
        share one array (`fill_bitmask` applies each array once a step)."""
        return _permitted_words(self.banned, self.allowed, width)

    def apply(self, logits: torch.Tensor, output_ids: list[int]) -> torch.Tensor:
        """One row's float32 logits ``[V]`` under these rules."""
        device, ninf = logits.device, float("-inf")
        if self.bias:
            logits = logits.index_add(0, self._tensor("bias_ids", device), self._tensor("bias_values", device))
        if self.allowed is not None:
            keep = self._tensor("allowed", device)
            logits = torch.full_like(logits, ninf).index_copy_(0, keep, logits.index_select(0, keep))
        if self.banned:
            logits = logits.index_fill(0, self._tensor("banned", device), ninf)
        now = self.banned_now(output_ids)
        if now:
            logits = logits.index_fill(0, torch.tensor(now, device=device), ninf)
        return logits


@functools.lru_cache(maxsize=64)
def _permitted_words(banned: frozenset[int], allowed: frozenset[int] | None, width: int) -> np.ndarray:
    keep = np.zeros(-(-width // 32) * 32, dtype=bool)
    if allowed is None:
        keep[:width] = True
    else:
        keep[sorted(allowed)] = True
    keep[sorted(banned)] = False
    words = np.packbits(keep, bitorder="little").view("<i4")
    words.flags.writeable = False
    return words


@functools.lru_cache(maxsize=64)
def _permitted_mask(banned: frozenset[int], allowed: frozenset[int] | None, width: int,
                    device: torch.device) -> torch.Tensor:
    """`_permitted_words` as 0 / -inf floats on ``device``."""
    keep = np.unpackbits(_permitted_words(banned, allowed, width).view(np.uint8), bitorder="little")[:width]
    return torch.where(torch.from_numpy(keep.astype(bool)), 0.0, float("-inf")).to(device)


def bad_words_ids(words: Iterable[str], tokenizer: "Tokenizer") -> list[tuple[int, ...]]:
    """vLLM's reading of ``bad_words``: each word's tokens as written (leading
    spaces dropped), and also after a space, when that spells it in as many
    tokens starting with a different one (the word inside a text)."""
    out: list[tuple[int, ...]] = []
    for word in words:
        plain = tuple(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        if plain:
            out.append(plain)
        spaced = tuple(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        if spaced and (not plain or (spaced[0] != plain[0] and len(spaced) == len(plain))):
            out.append(spaced)
    return out


def _asks_rules(params: SamplingParams) -> bool:
    return bool(params.logit_bias or params.allowed_token_ids or params.bad_words or params.min_tokens
                or params.stop_token_ids or params.structured_outputs is not None)


def token_rules(params: SamplingParams, tokenizer: "Tokenizer", vocab_size: int,
                default: TokenRules | None = None) -> TokenRules:
    """The rules of a request with validated ``params`` (``default``, shared,
    when it asks for none); `OptionError` for a token id outside the vocabulary."""
    for name in ("logit_bias", "allowed_token_ids", "stop_token_ids"):
        check_token_ids(getattr(params, name) or (), vocab_size, name)
    if default is not None and not _asks_rules(params):
        return default
    eos = set(tokenizer.eos_token_ids)
    named = (set(params.allowed_token_ids or ()) | set(params.stop_token_ids)
             | {i for i, b in (params.logit_bias or {}).items() if b > 0})
    words = bad_words_ids(params.bad_words or (), tokenizer)
    specials = set(tokenizer.special_token_ids) - eos - named
    if params.structured_outputs is not None:  # its grammar allows a control token only where it names one
        specials -= tokenizer.control_token_ids
    banned = specials | {w[0] for w in words if len(w) == 1}
    stop_ids = eos | set(params.stop_token_ids) if params.min_tokens else ()
    if params.allowed_token_ids and not set(params.allowed_token_ids) - banned - set(stop_ids):
        raise OptionError("allowed_token_ids must hold a token that bad_words and min_tokens leave "
                          f"to sample (got {params.allowed_token_ids})")
    return TokenRules(
        banned={i for i in banned if i < vocab_size}, allowed=params.allowed_token_ids, bias=params.logit_bias,
        bad_words=[w for w in words if len(w) > 1], min_tokens=params.min_tokens,
        stop_ids={i for i in stop_ids if i < vocab_size},
    )


def apply_penalties(logits: torch.Tensor, seq: "Sequence") -> torch.Tensor:
    """One row's logits ``[V]`` after the repetition, presence and frequency penalties."""
    p = seq.params
    if p.repetition_penalty != 1.0:
        seen = torch.unique(torch.tensor(seq.tokens, device=logits.device))
        picked = logits.index_select(0, seen)
        picked = torch.where(picked > 0, picked / p.repetition_penalty, picked * p.repetition_penalty)
        logits = logits.index_copy(0, seen, picked)
    if (p.presence_penalty or p.frequency_penalty) and seq.output_ids:
        ids, counts = torch.unique(torch.tensor(seq.output_ids, device=logits.device), return_counts=True)
        penalty = p.frequency_penalty * counts.to(logits.dtype) + p.presence_penalty
        logits = logits.index_put((ids,), -penalty, accumulate=True)
    return logits


def sample_row(logits: torch.Tensor, seq: "Sequence") -> int | None:
    """Next token of one row from its float32 logits ``[V]``: its rules, its
    penalties, then the argmax or its draw; None for a constrained row whose
    rules leave no token its grammar allows."""
    p = seq.params
    if seq.rules is not None:
        logits = seq.rules.apply(logits, seq.output_ids)
        matcher = seq.matcher
        if matcher is not None and not bool((logits > float("-inf")).any()):
            from pagedlm.structured.matcher import NOTHING_LEFT

            matcher.fail(NOTHING_LEFT)
            return None
    logits = apply_penalties(logits, seq)
    if seq.generator is None:
        return int(torch.argmax(logits))
    probs = _probs(logits[None], [p], logits.device)[0]
    return int(torch.multinomial(probs.to("cpu", torch.float32), 1, generator=seq.generator))


def sample(logits: torch.Tensor, seqs: list["Sequence"]) -> list[int | None]:
    """Tokens for ``seqs`` from their float32 logits ``[B, V]``: the rows
    without a grammar as `_pick` samples them, the rows with one from their
    masked logits (None where nothing is left: that row's matcher is dead)."""
    tokens: list[int | None] = [None] * len(seqs)
    constrained = [i for i, s in enumerate(seqs) if s.matcher is not None]
    if not constrained:
        _pick(logits, seqs, range(len(seqs)), tokens)
        return tokens
    from pagedlm.structured import masked_logits  # llguidance is imported only when a request has a grammar

    # The masks first: host work that overlaps the device's step still in flight
    # (on CUDA the picks below wait for its logits). They hold the rows' static rules
    # too, so that a row they leave nothing is dead here (a draw over nothing was uniform).
    matchers = [seqs[i].matcher for i in constrained]
    filled = grammar_masks([seqs[i] for i in constrained])
    taken = set(constrained)
    _pick(logits, seqs, [i for i in range(len(seqs)) if i not in taken], tokens)
    every = len(constrained) == len(seqs)  # (no gather then: 12.6 MB at 64 rows of a 49k vocabulary)
    masked, live = masked_logits(logits if every else logits[constrained], matchers, filled)
    picked: list[int | None] = [None] * len(constrained)
    _pick(masked, [seqs[i] for i in constrained], [j for j, ok in enumerate(live) if ok], picked)
    for i, t in zip(constrained, picked):
        tokens[i] = t
    return tokens


def argmax_rows(logits: torch.Tensor) -> list[int]:
    """Each row's argmax (its first index where several tie; a NaN counts as
    the largest), as ``torch.argmax``. On the CPU numpy's, vectorised: torch's
    took 240 us over Gemma 3's 262,144 logits, numpy's 20 (2 threads, this
    project's AMD EPYC VM), ~3% of a compiled int4 decode step there."""
    if logits.device.type == "cpu" and logits.dtype in (torch.float32, torch.float64, torch.float16):
        return np.argmax(logits.detach().numpy(), axis=-1).tolist()
    return torch.argmax(logits, dim=-1).tolist()


def _pick(logits: torch.Tensor, seqs: list["Sequence"], rows: "list[int] | range", tokens: list[int | None]) -> None:
    """Sample ``rows`` (of ``logits`` and ``seqs``) into ``tokens``. Rows that
    are greedy, unpenalized and unbiased share one argmax, kept where their
    rules permit it; unseeded sampled rows with static rules draw together
    (`pick_on_device`); the rest go row by row."""
    shared = [i for i in rows if shares_argmax(seqs[i])]
    if shared:
        best = argmax_rows(logits if len(shared) == len(seqs) else logits[shared])
        for i, t in zip(shared, best):
            rules = seqs[i].rules
            if rules is None or rules.permits(t, seqs[i].output_ids):
                tokens[i] = t
    drawn = [i for i in rows if seqs[i].generator is not None and picks_on_device(seqs[i])]
    if drawn:  # unseeded: all at once, on the logits' device (as async scheduling draws them)
        for i, t in zip(drawn, pick_on_device(logits[drawn], [seqs[i] for i in drawn]).tolist()):
            tokens[i] = t
    for i in rows:
        if tokens[i] is None:
            tokens[i] = sample_row(logits[i], seqs[i])


def picks_on_device(seq: "Sequence") -> bool:
    """Whether `pick_on_device` can take the row's token: an unpenalized,
    unbiased row whose rules do not change with its output, and that is
    greedy (the token `sample` picks) or samples without a seed (from the
    same distribution, drawn on the device; a seeded row draws on its CPU
    generator, so that a seed means the same everywhere). A grammar row's
    logits come masked (`grammar_masks`, host work before the pick). Async
    scheduling launches the next step with such a row's token before the
    host knows it."""
    return (not _penalized(seq) and (seq.rules is None or (not seq.rules.bias and seq.rules.static()))
            and (seq.generator is None or seq.params.seed is None))


def pick_on_device(logits: torch.Tensor, seqs: list["Sequence"], ruled: Collection[int] = ()) -> torch.Tensor:
    """The tokens of rows that `picks_on_device`, ``[B]`` on the logits' device,
    with no wait for them. A greedy row's is its argmax among the tokens its
    rules permit: the token `sample` picks (the permitted maximum there too,
    its first index where several tie). A sampled row's is drawn on the
    device from the distribution `sample_row` draws from (`_probs`). Rows
    in ``ruled`` have their rules in their logits already (`grammar_masks`)."""
    width, device = logits.shape[-1], logits.device
    masks = [None if i in ruled or seq.rules is None else seq.rules.mask(width, device) for i, seq in enumerate(seqs)]
    if any(m is not None for m in masks):
        if all(m is masks[0] for m in masks):  # (rules that permit the same tokens share their mask)
            logits = logits + masks[0]
        else:
            keep_all = torch.zeros(width, device=device)
            logits = logits + torch.stack([keep_all if m is None else m for m in masks])
    drawn = [i for i, seq in enumerate(seqs) if seq.generator is not None]
    # the greedy rows' argmax (none: a tensor the draws fill, no pass over the logits for nothing)
    tokens = logits.argmax(-1) if len(drawn) < len(seqs) else torch.empty(len(seqs), dtype=torch.long, device=device)
    if drawn and fused.enabled(logits):  # rows of a temperature alone: one launch (`fused.gumbel_pick`)
        alone = {i for i in drawn if _temperature_alone(seqs[i].params, width)}
        if alone:
            inverse = [1.0 / seq.params.temperature if i in alone else 0.0 for i, seq in enumerate(seqs)]
            seed = int(torch.randint(2**31 - 1, ()))  # (torch's generator: torch.manual_seed repeats the draws)
            tokens = fused.gumbel_pick(logits, to_device(inverse, torch.float32, device), tokens, seed)
            drawn = [i for i in drawn if i not in alone]
    if not drawn:
        return tokens
    if len(drawn) == len(seqs):  # every row drawn by the torch ops: no rows picked out and put back
        return draw(_probs(logits, [seq.params for seq in seqs], device))
    rows = to_device(drawn, torch.long, device)
    probs = _probs(logits.index_select(0, rows), [seqs[i].params for i in drawn], device)
    return tokens.index_copy(0, rows, draw(probs))


def permitted_words(seqs: list["Sequence"]) -> list[np.ndarray | None]:
    """Per grammar row of ``seqs``: the bitmask words its static rules permit
    (`TokenRules.words`; None: no rules), which its masks are filled less
    (`fill_bitmask`, `prefetch_bitmasks`)."""
    return [None if seq.rules is None else seq.rules.words(seq.matcher.width) for seq in seqs]


def grammar_masks(seqs: list["Sequence"], pinned: bool = False) -> tuple[torch.Tensor, list[bool]]:
    """`structured.fill_bitmask` of grammar rows ``seqs`` (CPU int32, pinned
    if ``pinned``), each row less what its rules refuse for good
    (`permitted_words`; a row's bans of the step, `sample_row` applies), and
    whether any token is left (a row with none is dead, as `sample_row`
    kills it). Here so that llguidance is imported only for a grammar."""
    from pagedlm.structured import fill_bitmask  # llguidance is imported only when a request has a grammar

    return fill_bitmask([seq.matcher for seq in seqs], pinned, permitted_words(seqs))


def _probs(logits: torch.Tensor, params: list[SamplingParams], device: torch.device) -> torch.Tensor:
    """What sampled rows draw from: float32 ``logits`` ``[B, V]`` (rules and
    penalties applied) made finite, the best shifted to 0 and divided by the
    row's temperature, then its top-k (the k-th best and all tied with it
    kept), top-p (the smallest set reaching p, the best always), softmax,
    min-p; for all rows at once."""
    width = logits.shape[-1]
    finite = torch.finfo(logits.dtype).max
    logits = logits.nan_to_num(nan=-finite, posinf=finite, neginf=-finite)
    knobs = to_device([[p.temperature, p.top_k if 0 < p.top_k < width else width, p.top_p if p.top_p < 1.0
                        else float("inf"), p.min_p] for p in params], torch.float32, device)
    temperature, top_k, top_p, min_p = knobs.unbind(-1)
    logits = (logits - logits.max(-1, keepdim=True).values) / temperature[:, None]
    if any(0 < p.top_k < width or p.top_p < 1.0 for p in params):
        ordered, order = torch.sort(logits, dim=-1, descending=True)
        kth = ordered.gather(-1, (top_k.long() - 1)[:, None])
        ordered = ordered.masked_fill(ordered < kth, float("-inf"))
        probs = torch.softmax(ordered, dim=-1)
        drop = (probs.cumsum(-1) - probs) >= top_p[:, None]  # a row without top-p: +inf, nothing dropped
        drop[:, 0] = False
        logits = torch.empty_like(logits).scatter_(-1, order, ordered.masked_fill(drop, float("-inf")))
    probs = torch.softmax(logits, dim=-1)
    if any(p.min_p > 0.0 for p in params):
        probs = probs.masked_fill(probs < min_p[:, None] * probs.max(-1, keepdim=True).values, 0.0)
    return probs


DRAW_BLOCK = 1024  # tokens a block of `draw`'s two-level search on the CPU
DRAW_CHUNK_BYTES = 4 << 20  # rows `draw` takes at once on the CPU: at 64 x 151,936 7.9 ms, 33-39 all at once


def draw(probs: torch.Tensor) -> torch.Tensor:
    """A token of each row of ``probs`` ``[B, V]`` (non-negative, a row's sum
    above 0: `_probs`), drawn with torch's generator of their device. On
    CUDA torch.multinomial's own rule for one sample: the argmax of probs /
    E, E ~ Exp(1) a token. On the CPU an exponential a token costs 20 ns (200
    ms at 64 rows of 151,936 tokens, 5 ms a row of Gemma 3's 262,144), so
    there one uniform a row is looked up in the row's cumulative sums, in
    float64: its block of DRAW_BLOCK tokens first, then the token inside it
    (a token of probability 0 has no width: never drawn), DRAW_CHUNK_BYTES
    of rows at a time."""
    if probs.device.type != "cpu":
        return (probs / torch.empty_like(probs).exponential_()).argmax(-1)
    rows, width = probs.shape
    per = max(1, DRAW_CHUNK_BYTES // (width * probs.element_size()))
    if rows > per:  # (a few MB at a time stay in the caches)
        return torch.cat([draw(part) for part in probs.split(per)])
    count = -(-width // DRAW_BLOCK)
    blocks = torch.nn.functional.pad(probs, (0, count * DRAW_BLOCK - width)).view(rows, count, DRAW_BLOCK)
    ends = blocks.sum(-1, dtype=torch.float64).cumsum(-1)  # [B, blocks]: mass up to each block's end
    at = torch.rand(rows, 1, dtype=torch.float64) * ends[:, -1:]
    block = torch.searchsorted(ends, at, right=True).clamp_(max=count - 1)
    at -= torch.where(block > 0, ends.gather(1, (block - 1).clamp(min=0)), 0.0)
    inside = blocks[torch.arange(rows), block[:, 0]].double()  # [B, DRAW_BLOCK]
    token = torch.searchsorted(inside.cumsum(-1), at, right=True)[:, 0]
    # past the block's running sum (its sum may differ in the last bit): its last token that can be drawn
    last = DRAW_BLOCK - 1 - (inside.flip(-1) > 0).int().argmax(-1)
    return (block[:, 0] * DRAW_BLOCK + torch.where(token < DRAW_BLOCK, token, last)).clamp_(max=width - 1)


def _temperature_alone(p: SamplingParams, width: int) -> bool:
    """A sampled row's distribution is softmax(logits / temperature): no
    top-k, top-p or min-p cuts it (`_probs`' other knobs)."""
    return not 0 < p.top_k < width and p.top_p >= 1.0 and p.min_p <= 0.0


def shares_argmax(seq: "Sequence") -> bool:
    """Whether the row's token is the plain argmax of its logits, where its
    rules permit it: greedy, unpenalized, unbiased (a step's such rows share
    one argmax call)."""
    return seq.generator is None and not _penalized(seq) and (seq.rules is None or not seq.rules.bias)


def _penalized(seq: "Sequence") -> bool:
    p = seq.params
    return p.repetition_penalty != 1.0 or bool(p.presence_penalty) or bool(p.frequency_penalty)


def logprobs_of(logits: torch.Tensor, tokens: torch.Tensor, k: int) -> list[tuple[float, list[tuple[int, float]]]]:
    """Per row of ``logits`` ``[N, V]``: the logprob of ``tokens[row]`` and the row's top ``k``."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = logprobs.gather(-1, tokens[:, None])[:, 0].tolist()
    if k <= 0:
        return [(c, []) for c in chosen]
    values, ids = torch.topk(logprobs, k)
    return [(c, list(zip(i, v))) for c, i, v in zip(chosen, ids.tolist(), values.tolist())]


def ranks_of(logits: torch.Tensor, tokens: torch.Tensor) -> list[int]:
    """Per row: vLLM's rank of ``tokens[row]``, 1 + how many tokens have a
    strictly higher logprob (the same log-softmax ``logprobs_of`` reports)."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    return ((logprobs > logprobs.gather(-1, tokens[:, None])).sum(-1) + 1).tolist()
