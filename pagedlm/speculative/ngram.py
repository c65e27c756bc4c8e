"""Prompt lookup: ``NgramProposer`` (vLLM's ``[ngram]``, transformers'
``prompt_lookup_num_tokens``).

The last ``n`` tokens of a sequence, for ``n`` from ``ngram_max`` down to
``ngram_min``, are looked up in the sequence itself (prompt and output);
the tokens that followed their most recent earlier occurrence are the
proposal. The longest suffix that occurs earlier wins; among its
occurrences, the latest. Free of a second model, and right whenever the
output copies its input: edits, quotes, code, summaries that reuse words.
"""

from __future__ import annotations

import numpy as np

from pagedlm import options as opt

from .base import Proposing


class NgramProposer:
    def __init__(self, num_speculative_tokens: int, ngram_min: int = 1, ngram_max: int = 4) -> None:
        if not 1 <= ngram_min <= ngram_max:
            raise ValueError(f"ngram sizes must satisfy 1 <= min <= max (got {ngram_min}, {ngram_max})")
        self.num_speculative_tokens = num_speculative_tokens
        self.ngram_min, self.ngram_max = ngram_min, ngram_max
        self._arrays: dict[int, tuple[np.ndarray, int]] = {}  # seq id -> its tokens so far (buffer, length)

    @classmethod
    def from_options(cls, options: opt.EngineOptions) -> "NgramProposer":
        """``--num-speculative-tokens``, ``--ngram-min``, ``--ngram-max`` (one
        given alone moves the other's default so that they fit)."""
        low = options.ngram_min or opt.DEFAULT_NGRAM_MIN
        return cls(options.num_speculative_tokens or opt.DEFAULT_NUM_SPECULATIVE_TOKENS, low,
                   options.ngram_max or max(opt.DEFAULT_NGRAM_MAX, low))

    def propose(self, rows: list[tuple[Proposing, int]]) -> list[list[int]]:
        return [self.lookup(self._tokens(seq), k) for seq, k in rows]

    def release(self, seq_id: int) -> None:
        self._arrays.pop(seq_id, None)

    def _tokens(self, seq: Proposing) -> np.ndarray:
        """The sequence's tokens as an array, kept between steps and extended
        by what it appended (a sequence's tokens only grow): a step costs
        the new tokens, not the whole sequence."""
        buf, n = self._arrays.get(seq.seq_id, (None, 0))
        total = len(seq.prompt_ids) + len(seq.output_ids)
        if buf is None or total > len(buf):
            grown = np.empty(2 * total, dtype=np.int64)
            grown[:n] = buf[:n] if buf is not None else []
            buf = grown
        if n == 0:
            buf[: len(seq.prompt_ids)] = seq.prompt_ids
            n = len(seq.prompt_ids)
        buf[n:total] = seq.output_ids[n - len(seq.prompt_ids) :]
        self._arrays[seq.seq_id] = (buf, total)
        return buf[:total]

    def lookup(self, tokens: list[int] | np.ndarray, k: int) -> list[int]:
        """Up to ``k`` tokens that followed the latest earlier occurrence of
        the longest suffix of ``tokens`` (``ngram_min`` to ``ngram_max`` long)."""
        n_tokens = len(tokens)
        if k <= 0 or n_tokens <= self.ngram_min:
            return []
        arr = np.asarray(tokens, dtype=np.int64)
        # Candidate ends: earlier positions holding the last token (never the last one itself).
        ends = np.flatnonzero(arr[:-1] == arr[-1])
        if ends.size == 0:
            return []
        # Grow the match one token back at a time while some candidate still matches.
        length, max_n = 1, min(self.ngram_max, n_tokens - 1)
        while length < max_n:
            ok = ends >= length
            ok[ok] = arr[ends[ok] - length] == arr[n_tokens - 1 - length]
            if not ok.any():
                break
            ends, length = ends[ok], length + 1
        if length < self.ngram_min:
            return []
        start = int(ends[-1]) + 1  # the latest occurrence of the longest suffix found
        return arr[start : start + k].tolist()
