"""What the engine asks of a proposer: ``Proposer`` (and what a proposer
reads of a sequence: ``Proposing``); the counters it keeps: ``SpecStats``."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Protocol


class Proposing(Protocol):
    """What a proposer reads of a sequence (``batch.sequence.Sequence``)."""

    seq_id: int
    prompt_ids: list[int]
    output_ids: list[int]

    @property
    def tokens(self) -> list[int]: ...


class Proposer(Protocol):
    """Guesses the tokens that follow sequences; the target model checks them."""

    num_speculative_tokens: int  # the most tokens one proposal holds (k)

    def propose(self, rows: list[tuple[Proposing, int]]) -> list[list[int]]:
        """For each row (a sequence, k): up to ``k`` tokens that may follow its
        tokens (prompt and output so far); fewer, or none, when there is no
        good guess. One call per step for every row that may speculate."""
        ...

    def release(self, seq_id: int) -> None:
        """The sequence has ended: drop whatever is kept for it."""
        ...


@dataclass
class SpecStats:
    """Counters since the engine started (vLLM's ``spec_decode`` counters).

    ``drafts``: verify rows run (rows that proposed at least one token);
    ``draft_tokens``: tokens proposed in them; ``accepted_tokens``: of those,
    the ones the target agreed with; ``emitted_tokens``: tokens the verify
    rows appended (accepted ones, plus the target's own next token, less
    what a stop cut off)."""

    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    emitted_tokens: int = 0

    def since(self, earlier: "SpecStats") -> "SpecStats":
        """What was counted after ``earlier`` (a copy of these counters taken then)."""
        return SpecStats(*(getattr(self, f.name) - getattr(earlier, f.name) for f in fields(self)))

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a verify row emits on average (1 + accepted, as vLLM's mean acceptance length)."""
        return self.emitted_tokens / self.drafts if self.drafts else 0.0
