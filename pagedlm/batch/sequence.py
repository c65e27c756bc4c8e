"""One request's continuation as the engine sees it: ``Sequence``."""

from __future__ import annotations

import enum
import hashlib
import itertools
from typing import TYPE_CHECKING

import torch

from pagedlm.params import SamplingParams

if TYPE_CHECKING:
    from pagedlm.sampling import TokenRules
    from pagedlm.structured import RowMatcher
    from pagedlm.tokenizer import IncrementalDetokenizer

TokenLogprob = tuple[float, list[tuple[int, float]]]  # (chosen token's logprob, top-k)

# Async scheduling: the output's last entry while its token is sampled on the
# device and not yet known to the host (the next step feeds it from there).
PENDING = -1


def generator_seed(seed: int) -> int:
    """What seeds a row's CPU generator for ``seed`` (-2**63 to 2**64 - 1):
    torch's Mersenne Twister keeps 32 bits of a seed, so seeds 2**32 apart
    would draw alike. Below 2**32 (as an unsigned 64-bit value) the seed
    itself; above, a hash of all 64 bits."""
    unsigned = seed % 2**64
    if unsigned < 2**32:
        return unsigned
    return int.from_bytes(hashlib.blake2b(unsigned.to_bytes(8, "little"), digest_size=4).digest(), "little")


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class StopMatcher:
    """Holds back text that may be the start of a stop string; at a stop
    string, cuts the text before it (or after it, with ``include``)."""

    def __init__(self, stops: list[str], include: bool = False):
        self.stops = [s for s in stops if s]
        self.include = include
        self.pending = ""

    def feed(self, text: str) -> tuple[str, str | None]:
        """Return (text safe to emit, the stop string reached or None); of two,
        the one that starts first."""
        if not self.stops:
            return text, None
        buf = self.pending + text
        hits = [(i, s) for s in self.stops if (i := buf.find(s)) >= 0]
        if hits:
            self.pending = ""
            at, stop = min(hits, key=lambda hit: hit[0])
            return buf[: at + len(stop) if self.include else at], stop
        hold = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(buf)), 0, -1):
                if buf.endswith(s[:n]):
                    hold = max(hold, n)
                    break
        self.pending = buf[len(buf) - hold :]
        return buf[: len(buf) - hold], None

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


class Sequence:
    """Token ids, progress through them, sampling state, text state.

    ``tokens`` is the prompt followed by the output; the first
    ``num_computed`` of them have keys and values in the store. A step feeds
    ``tokens[num_computed:num_computed + n]``; when that reaches the end, the
    last position's logits give the next token. With speculative decoding
    a decode row also feeds ``draft``, tokens proposed after ``tokens``:
    they are not the sequence's until the step's verification accepts
    them, and the keys of those it rejects are dropped. Preemption sets
    ``num_computed`` back to 0: the sequence is recomputed from its tokens,
    output included, and continues where it was.
    """

    _ids = itertools.count()

    def __init__(self, prompt_ids: list[int], params: SamplingParams, eos_ids: set[int],
                 detokenizer: "IncrementalDetokenizer | None", request_id: object = None,
                 rules: "TokenRules | None" = None, matcher: "RowMatcher | None" = None) -> None:
        self.seq_id = next(Sequence._ids)
        self.request_id = request_id
        self.prompt_ids = list(prompt_ids)
        self.output_ids: list[int] = []
        self.params = params
        self.status = SequenceStatus.WAITING
        self.num_computed = 0
        self.num_cached = 0  # prompt tokens whose keys came from a cache
        self.block_hashes: list[bytes] = []  # paged store with prefix caching: its full blocks' hash chain
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None  # vLLM's: the stop string or stop token id that ended it
        self.rules = rules  # what its request rules in and out (sampling.TokenRules); None: nothing
        self.matcher = matcher  # its place in its grammar (structured output); None: unconstrained
        self.stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_ids))
        self.detokenizer = detokenizer
        self.stops = StopMatcher(params.stop, params.include_stop_str_in_output)
        self.text = ""  # everything emitted so far
        self.logprobs: list[TokenLogprob] | None = [] if params.logprobs is not None else None
        self.prompt_logprobs: list[TokenLogprob] | None = [] if params.prompt_logprobs is not None else None
        # vLLM's rank of each scored token (1 = the most likely), one per entry of the two lists above
        self.logprob_ranks: list[int] = []
        self.prompt_logprob_ranks: list[int] = []
        self.generator: torch.Generator | None = None
        if params.temperature > 0:
            # Drawn on the CPU so that a seed means the same on every device
            # and whatever shares the batch.
            self.generator = torch.Generator("cpu")
            if params.seed is not None:
                self.generator.manual_seed(generator_seed(params.seed))
            else:
                self.generator.seed()
        self.draft: list[int] = []  # this step's proposed tokens (speculative decoding)
        self.num_drafts = 0  # verify rows it ran, tokens proposed in them, and accepted
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.first_scheduled: float | None = None
        self.first_token_at: float | None = None

    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def new_tokens(self, n: int) -> list[int]:
        """The next ``n`` tokens to feed (from ``num_computed``), without
        copying the whole sequence: a decode row takes its last token (and
        the ``draft`` past it, for a verify row)."""
        begin, end, p = self.num_computed, self.num_computed + n, len(self.prompt_ids)
        ahead = self.draft[: max(0, end - self.num_tokens)]
        if begin >= p:
            return self.output_ids[begin - p : end - p] + ahead
        return self.prompt_ids[begin:end] + self.output_ids[: max(0, end - p)] + ahead

    @property
    def last_token(self) -> int:
        """What a decode row feeds (`new_tokens(1)` once all but it are computed)."""
        return self.output_ids[-1] if self.output_ids else self.prompt_ids[-1]

    @property
    def pending(self) -> bool:
        """Its last token is sampled on the device, not yet known here (async scheduling)."""
        return bool(self.output_ids) and self.output_ids[-1] == PENDING

    @property
    def ends_when_known(self) -> bool:
        """Its pending token is its last (max_tokens): no step feeds it."""
        return self.pending and len(self.output_ids) >= self.params.max_tokens

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_prompt(self) -> int:
        return len(self.prompt_ids)

    @property
    def max_len(self) -> int:
        """Tokens it may hold at most: its prompt plus max_tokens."""
        return len(self.prompt_ids) + self.params.max_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def __repr__(self) -> str:
        return (f"Sequence(id={self.seq_id}, {self.status.value}, tokens={self.num_tokens}, "
                f"computed={self.num_computed})")
