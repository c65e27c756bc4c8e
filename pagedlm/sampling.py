"""Token sampling: greedy, temperature, top-k, top-p, min-p, repetition penalty.

The processors run in the order Hugging Face applies them (penalty,
temperature, top-k, top-p, min-p), so that a request means the same thing
here as there. Each request owns a seeded `torch.Generator`: the same seed
gives the same tokens.
"""

from __future__ import annotations

import torch

from .options import GenerateOptions


class Sampler:
    def __init__(self, options: GenerateOptions, device: torch.device | str = "cpu"):
        self.options = options
        self.greedy = options.temperature == 0
        self.generator: torch.Generator | None = None
        if not self.greedy:
            # Draw on the CPU so that a seed means the same on every device.
            self.generator = torch.Generator("cpu")
            if options.seed is not None:
                self.generator.manual_seed(options.seed)
            else:
                self.generator.seed()

    def __call__(self, logits: torch.Tensor, history: torch.Tensor | None = None) -> int:
        """Pick the next token from float32 logits ``[V]``; ``history`` holds
        the prompt and generated ids, for the repetition penalty."""
        opts = self.options
        if opts.repetition_penalty != 1.0 and history is not None and history.numel():
            logits = apply_repetition_penalty(logits, history, opts.repetition_penalty)
        if self.greedy:
            return int(torch.argmax(logits))
        logits = logits / opts.temperature
        if opts.top_k > 0 and opts.top_k < logits.shape[-1]:
            kth = torch.topk(logits, opts.top_k).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if opts.top_p < 1.0:
            logits = _top_p(logits, opts.top_p)
        probs = torch.softmax(logits, dim=-1)
        if opts.min_p > 0.0:
            probs = probs.masked_fill(probs < opts.min_p * probs.max(), 0.0)
        probs = probs.to("cpu", torch.float32)
        return int(torch.multinomial(probs, 1, generator=self.generator))


def apply_repetition_penalty(
    logits: torch.Tensor, history: torch.Tensor, penalty: float
) -> torch.Tensor:
    """CTRL-style: divide positive logits of seen tokens, multiply negative ones."""
    seen = torch.unique(history.to(logits.device))
    picked = logits.index_select(0, seen)
    picked = torch.where(picked > 0, picked / penalty, picked * penalty)
    return logits.index_copy(0, seen, picked)


def _top_p(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of tokens whose probability reaches top_p."""
    sorted_logits, order = torch.sort(logits, descending=True)
    cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(-1)
    # Drop a token when the mass before it already reaches top_p (the first always stays).
    drop = (cumulative - torch.softmax(sorted_logits, dim=-1)) >= top_p
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(0, order, sorted_logits)


def top_logprobs(logprobs: torch.Tensor, k: int) -> list[tuple[int, float]]:
    """The k most likely tokens and their log-probabilities, best first."""
    if k <= 0:
        return []
    values, ids = torch.topk(logprobs, k)
    return list(zip(ids.tolist(), values.tolist()))
