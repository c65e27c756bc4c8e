"""Grammars compiled once per constraint, off the step's thread: `GrammarCompiler`.

One compiler serves one tokenizer at one logits width (the engine holds one),
so its LRU, keyed by `Constraint.key`, is keyed by constraint and tokenizer.
`GrammarCompiler.matcher` never blocks: it hands back a `RowMatcher` whose
`ready()` turns true when the pool has compiled the grammar; a second row
with the same constraint shares the first one's compile, finished or not,
and a row never waits for one.

The first compile also builds llguidance's tokenizer (`llguidance_tokenizer`:
every token's bytes, a trie): 0.5 s for SmolLM2's 49k tokens, about 5 s for
Gemma 3's 262k on one CPU core. That call holds the GIL (the rest of a
compile drops it), so the step loop stalls once for it; `warm_up` pays it
at startup instead.
"""

from __future__ import annotations

import functools
import itertools
import os
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

import llguidance

from .constraint import Constraint, one_line
from .matcher import MAX_LANES, RowMatcher

if TYPE_CHECKING:
    from pagedlm.tokenizer import Tokenizer

# Short errors: llguidance's verbose ones quote the parser's state and the whole grammar.
_LIMITS = llguidance.LLParserLimits(verbose_errors=False)

_STRING_CHAR = '[^"\\\\\\x00-\\x1F\\x7F]'  # a character a JSON string holds unescaped
# llguidance's token slices: tokens a regex here matches (each in the first
# that does) are allowed or refused at once where the grammar's lexer allows
# every string the slice does, instead of walking the token trie one by one.
# llguidance's defaults (`LLTokenizer.general_slices`: whitespace, string
# runs of 1-10, 1-30 and any length) apply inside a string with a
# ``maxLength`` only while 10 or more of its characters remain (30 for the
# second): the last 9 of every bounded string, and all of one shorter than
# 10, walked the whole trie. Finer bounds keep such masks mostly sliced.
# The masks are the same (`test_finer_slices_give_llguidance_defaults_masks`);
# a bounded string's steps cost less: two JSON texts of
# `benchmarks/configs/person.schema.json`'s schema, a new row's mask at each
# token, 0.72x and 0.51-0.55x the time (SmolLM2's tokenizer), 0.64x and
# 0.55x (Gemma 3's); the mask bench's wait for 64 rows' masks 0.81x on this
# CPU, 0.86x on an H100's host (RESULTS.md, 2026-12-06). Building the
# tokenizer takes +0.05 / +0.2 s, once.
SLICES = [llguidance.LLTokenizer.general_slices()[0],
          *(f"{_STRING_CHAR}{{1,{n}}}" for n in (2, 4, 6, 10, 15, 20, 30)), f"{_STRING_CHAR}+"]


class _TextTokenizer:
    """What llguidance reads of a tokenizer (`llguidance.TokenizerWrapper`'s
    fields and call): each token's bytes, the special ids (ours:
    `Tokenizer.special_token_ids`), and text tokenized as text
    (`Tokenizer.encode_as_text`).

    Built from tokenizer.json alone, llguidance tokenizes forced text (its
    canonical first token where the grammar forces bytes) with special
    tokens parsed out of it, and counts every added token shaped ``<...>``
    as special: a grammar forcing ``<tool_call>`` (an added token of Qwen's
    tokenizers, not special) or the text ``<|im_start|>`` allowed only that
    token, which it then refused as not the forced text, and the row ended
    "error" at its first token. Here an added token that is not special is
    a token spelling its text. The bytes are llguidance's own (read back
    from a tokenizer it builds from the JSON: +0.15 s for SmolLM2's 49k
    tokens, +1 s for Gemma 3's 262k, once). The call runs on the fill's
    threads, with the GIL, only where a fill meets forced text: its answers
    are cached."""

    def __init__(self, tokenizer: "Tokenizer", width: int) -> None:
        plain = llguidance.LLTokenizer(tokenizer.to_json(), slices=[])
        self.tokens = [plain.decode_bytes([i]) for i in range(tokenizer.vocab_size)]
        self.tokens += [b""] * (width - len(self.tokens))  # a padded embedding's ids: no text, never allowed
        self.special_token_ids = sorted(tokenizer.special_token_ids)
        self.eos_token_id = min(tokenizer.eos_token_ids, default=None)  # (llguidance_tokenizer passes them all)
        self.bos_token_id = None
        self._encode = functools.lru_cache(maxsize=4096)(tokenizer.encode_as_text)

    def __call__(self, text: bytes | str) -> list[int]:
        return list(self._encode(text.decode("utf-8") if isinstance(text, bytes) else text))


def llguidance_tokenizer(tokenizer: "Tokenizer", vocab_size: int) -> llguidance.LLTokenizer:
    """llguidance's view of ``tokenizer`` for logits ``vocab_size`` wide
    (`_TextTokenizer`): ids past its vocabulary (a model's padded
    embedding) never allowed, its end-of-sequence ids allowed where the
    output may end, with the token slices `SLICES`."""
    width = max(vocab_size, tokenizer.vocab_size)
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_TextTokenizer(tokenizer, width)),
                                  eos_token=sorted(tokenizer.eos_token_ids), slices=SLICES)


def default_lanes(device: str) -> int:
    """How many lanes a compiled grammar gets on ``device``'s host: one on
    the CPU (the forward pass takes every core), else half the cores this
    process may run on, at most `MAX_LANES` (the rest stay with the step's
    own thread and torch's)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1  # (Linux)
    return 1 if device == "cpu" else max(1, min(MAX_LANES, cores // 2))


class Grammar:
    """One constraint compiled ``lanes`` times: llguidance's copies of a
    matcher (`deep_copy`) share its lexer behind one lock, so rows copied from
    one compile fill their masks one at a time however many threads fill them
    (on the H200 host: 64 rows 7.7 ms on one thread, 7.2-9.5 on 2-16).
    Rows copy the compiles in turn, and `fill_bitmask` fills them with an
    executor of a thread a lane, the rows grouped by lane (`matcher._by_lane`).
    A compile takes ~1 ms (SmolLM2, Gemma 3)."""

    def __init__(self, compiles: list[llguidance.LLMatcher]) -> None:
        self._compiles = compiles
        self._turn = itertools.count()  # next() is atomic under the GIL

    def copy(self) -> tuple[llguidance.LLMatcher, int]:
        """A new row's matcher and its lane."""
        lane = next(self._turn) % len(self._compiles)
        return self._compiles[lane].deep_copy(), lane


class GrammarCompiler:
    """Compiles constraints for ``tokenizer`` in a thread pool, each once
    (``lanes`` times: `Grammar`) while it stays among the ``capacity`` most
    recently used."""

    def __init__(self, tokenizer: "Tokenizer", vocab_size: int, *, capacity: int = 128, lanes: int = 1) -> None:
        if not 1 <= lanes <= MAX_LANES:
            raise ValueError(f"lanes must be 1-{MAX_LANES} (got {lanes})")
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.width = max(vocab_size, tokenizer.vocab_size)  # tokens per bitmask row
        self.capacity = capacity
        self.lanes = lanes
        self.compiles = 0  # grammars compiled (or being compiled) so far
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="pagedlm-grammar")  # compiles drop the GIL
        self._lock = threading.Lock()
        self._tokenizer: Future | None = None
        self._grammars: OrderedDict[str, Future] = OrderedDict()

    def matcher(self, constraint: Constraint, label: str = "") -> RowMatcher:
        """A new row's matcher for a validated ``constraint`` (its compile
        starts now unless one has; ``label`` names the row in the log)."""
        return RowMatcher(self._grammar(constraint), self.width, label)

    def warm_up(self) -> None:
        """Build llguidance's tokenizer now (blocks), so that no step stalls for it later."""
        self._llg_tokenizer().result()

    def _llg_tokenizer(self) -> Future:
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = self._pool.submit(llguidance_tokenizer, self.tokenizer, self.vocab_size)
            return self._tokenizer

    def _grammar(self, constraint: Constraint) -> Future:
        key = constraint.key
        tokenizer = self._llg_tokenizer()
        with self._lock:
            future = self._grammars.get(key)
            if future is not None:
                self._grammars.move_to_end(key)
                return future
            future = self._pool.submit(_compile, tokenizer, constraint.llguidance_grammar(), self.lanes)
            self.compiles += 1
            self._grammars[key] = future
            while len(self._grammars) > self.capacity:  # rows holding an evicted one keep it
                self._grammars.popitem(last=False)
            return future


def _compile(tokenizer: Future, grammar: str, lanes: int = 1) -> Grammar:
    """``grammar`` compiled ``lanes`` times; `ValueError` if it fails."""
    compiles = []
    for _ in range(lanes):
        matcher = llguidance.LLMatcher(tokenizer.result(), grammar, log_level=0, limits=_LIMITS)
        if matcher.is_error():
            raise ValueError(one_line(matcher.get_error()))
        compiles.append(matcher)
    return Grammar(compiles)
