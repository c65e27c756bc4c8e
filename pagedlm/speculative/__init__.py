"""Speculative decoding: proposers guess a row's next tokens, the target
model scores them all in one step, and ``verify`` keeps what the target
would have emitted anyway (``docs/design/speculative.md``).

The engine sees one interface, `Proposer`, and picks the proposer once
from its options (``--speculative ngram|draft``): `NgramProposer` here, the
draft model's in ``batch.draft`` (it runs a model through the step
machinery).
"""

from __future__ import annotations

from .base import Proposer, Proposing, SpecStats
from .ngram import NgramProposer
from .verify import verify

__all__ = ["Proposer", "Proposing", "SpecStats", "NgramProposer", "verify"]
