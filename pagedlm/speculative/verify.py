"""Which proposed tokens a verify row keeps: ``verify``.

A verify row fed the sequence's last token and ``d`` proposed ones; the
target's logits at those ``1 + d`` positions are the distributions a
non-speculative run would sample from, provided the tokens before each
position are the ones it would have emitted. So the positions are sampled
in order, each exactly as the sampler samples a decode row (the request's
rules, penalties, temperature, top-k/p, the sequence's own generator),
with the sequence extended by the proposed tokens accepted so far; a
position whose sample equals the proposed token accepts it and goes on,
the first that differs emits its sample and ends the row; when every
proposal is accepted the last position's sample is the bonus token.

That is the rejection-sampling rule for a proposal that is one token with
certainty (q one-hot, as prompt lookup's): accept the proposed ``t`` with
probability min(1, p(t) / q(t)) = p(t), and on rejection draw from the
residual max(0, p - q), renormalised, which is p with ``t`` removed; a
draw x ~ p accepts exactly when x = t, and given x != t it is that
residual draw. Greedy rows are the temperature-0 case: accept while the
proposal is the argmax. Each emitted token costs one draw of the
sequence's generator, as without speculation, so a seeded request draws
the same numbers and, whenever the logits agree, emits the same tokens.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from pagedlm.sampling import sample

if TYPE_CHECKING:
    from pagedlm.sampling import Sequence


class _Ahead:
    """A sequence as the sampler would see it after ``extra`` more output tokens."""

    matcher = None  # constrained rows do not speculate

    def __init__(self, seq: "Sequence", extra: list[int]) -> None:
        self.params, self.rules, self.generator = seq.params, seq.rules, seq.generator
        self.output_ids = seq.output_ids + extra
        self._seq, self._extra = seq, extra

    @property
    def tokens(self) -> list[int]:
        return self._seq.tokens + self._extra


def verify(logits: torch.Tensor, seq: "Sequence", draft: list[int], best: list[int] | None = None) -> list[int]:
    """The tokens a verify row emits, in order, from the target's float32
    logits ``[1 + len(draft), V]`` at its positions: the accepted proposals
    (``len(result) - 1`` of them) and then the target's own token. ``best``:
    the argmax of each position, computed already for a row whose token is
    the argmax (`sampling.shares_argmax`), taken where the rules permit it,
    as the sampler takes a shared argmax: one device read for a step's
    greedy verify rows, not one per position."""
    out: list[int] = []
    for proposed in [*draft, None]:  # None: the bonus position, nothing proposed there
        view = _Ahead(seq, list(out)) if out else seq
        j = len(out)
        if best is not None and (seq.rules is None or seq.rules.permits(best[j], view.output_ids)):
            token = best[j]
        else:
            token = sample(logits[j : j + 1], [view])[0]
        out.append(token)
        if token != proposed:
            break
    return out
