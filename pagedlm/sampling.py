"""Per-row sampling for a whole step: ``sample``.

Each row brings its own `SamplingParams`: penalties (repetition, CTRL-style;
presence and frequency, OpenAI-style, over the generated tokens), then
temperature, top-k, top-p, min-p, in the order Hugging Face applies them, so
that a request means the same here as there. Greedy rows take the argmax.
Sampled rows draw with their sequence's own seeded CPU generator, so a seed
gives the same tokens whatever shares the batch.

No accepted value can make a NaN: logits are made finite and shifted so the
best is 0 before dividing by the temperature (a tiny temperature sends the
rest to -inf, never the best), and top-p always keeps the best token.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from pagedlm.batch.sequence import Sequence


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


def _top_p(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of tokens whose probability reaches top_p (the best always)."""
    sorted_logits, order = torch.sort(logits, descending=True)
    probs = torch.softmax(sorted_logits, dim=-1)
    drop = (probs.cumsum(-1) - probs) >= top_p
    drop[0] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(0, order, sorted_logits)


def sample_row(logits: torch.Tensor, seq: "Sequence") -> int:
    """Next token of one row from its float32 logits ``[V]``."""
    p = seq.params
    logits = apply_penalties(logits, seq)
    if seq.generator is None:
        return int(torch.argmax(logits))
    finite = torch.finfo(logits.dtype).max
    logits = logits.nan_to_num(nan=-finite, posinf=finite, neginf=-finite)
    logits = (logits - logits.max()) / p.temperature
    if 0 < p.top_k < logits.shape[-1]:
        kth = torch.topk(logits, p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if p.top_p < 1.0:
        logits = _top_p(logits, p.top_p)
    probs = torch.softmax(logits, dim=-1)
    if p.min_p > 0.0:
        probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
    return int(torch.multinomial(probs.to("cpu", torch.float32), 1, generator=seq.generator))


def sample(logits: torch.Tensor, seqs: list["Sequence"]) -> list[int]:
    """Tokens for ``seqs`` from their float32 logits ``[B, V]``. Rows that
    are greedy and unpenalized share one argmax; the rest go row by row."""
    plain = [i for i, s in enumerate(seqs) if s.generator is None and not _penalized(s)]
    plain_set = set(plain)
    tokens = [0] * len(seqs)
    if plain:
        best = torch.argmax(logits if len(plain) == len(seqs) else logits[plain], dim=-1).tolist()
        for i, t in zip(plain, best):
            tokens[i] = t
    for i, seq in enumerate(seqs):
        if i not in plain_set:
            tokens[i] = sample_row(logits[i], seq)
    return tokens


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
