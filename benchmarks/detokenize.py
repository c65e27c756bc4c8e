"""What streaming a token's text costs: the engine's `IncrementalDetokenizer`
(tokenizers' DecodeStream, one call into Rust a token) against the window
method it replaced (2026-12-06; two `Tokenizer.decode` calls a token over
the ids since the last emission, kept here as the baseline), on the real
tokenizers, over the same ids; and whether the two give the same text.

The ids: three texts' own tokens (accents, CJK, emoji, code) and ``N``
sequences of 60 random ids (byte-fallback pieces, ids past the vocabulary).
Prints one JSON line per tokenizer: microseconds a token each, and how many
sequences' texts differ (0 expected).

Usage: PYTHONPATH=. python benchmarks/detokenize.py [N]
"""

from __future__ import annotations

import json
import random
import sys
import time

from pagedlm.loading import resolve
from pagedlm.tokenizer import Tokenizer

TEXTS = ["Hello, world! Ünïcödé ✓ 日本語 🙂 " * 3, "def f(x):\n    return x**2  # ok\n",
         "  leading spaces and\ttabs\n\nnewlines"]


class WindowDetokenizer:
    """The method before DecodeStream: decode the window since the last
    emission with and without the newest ids, emit the difference unless it
    ends in U+FFFD."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer, self.ids, self.prefix, self.read = tokenizer, [], 0, 0

    def add_token(self, token_id: int, final: bool = False) -> str:
        if not final:
            self.ids.append(token_id)
        before = self.tokenizer.decode(self.ids[self.prefix : self.read])
        text = self.tokenizer.decode(self.ids[self.prefix :])
        if len(text) <= len(before) or (text.endswith("\ufffd") and not final):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return text[len(before) :]

    def finalize(self) -> str:
        return self.add_token(0, final=True)


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 30
    for name in ("smollm2-135m-instruct", "gemma3-270m"):
        tok = Tokenizer.from_folder(resolve(name))
        rng = random.Random(0)
        seqs = [tok.encode(t, add_special_tokens=False) for t in TEXTS]
        seqs += [[rng.randrange(tok.vocab_size + 100) for _ in range(60)] for _ in range(n)]
        spent = {"window": 0.0, "stream": 0.0}
        differ = tokens = 0
        for ids in seqs:
            texts = {}
            for kind, detok in (("window", WindowDetokenizer(tok)), ("stream", tok.detokenizer())):
                t0 = time.perf_counter()
                texts[kind] = "".join(detok.add_token(i) for i in ids) + detok.finalize()
                spent[kind] += time.perf_counter() - t0
            differ += texts["window"] != texts["stream"]
            tokens += len(ids)
        print(json.dumps({"tokenizer": name, "sequences": len(seqs), "tokens": tokens, "differ": differ,
                          **{f"{k}_us_per_token": round(1e6 * v / tokens, 2) for k, v in spent.items()}}))


if __name__ == "__main__":
    main()
