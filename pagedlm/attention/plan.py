"""What every layer of one step shares: ``StepPlan``.

A backend builds one per step (when its first layer attends) and drops it
in ``end_step``; its tensors are built on first use, so a backend pays only
for what it reads.
"""

from __future__ import annotations

import functools

import torch

from pagedlm.cache.kv import causal_mask
from pagedlm.cache.step import StepBatch
from pagedlm.kernels.copies import to_device


class Planned:
    """A backend that builds one ``StepPlan`` per step, when the step's first
    layer attends, and drops it in ``end_step``."""

    def __init__(self) -> None:
        self._plan: StepPlan | None = None

    def end_step(self) -> None:
        self._plan = None

    def _plan_for(self, step: StepBatch, device) -> "StepPlan":
        if self._plan is None or self._plan.step is not step:
            self._plan = StepPlan(step, device)
        return self._plan


class StepPlan:
    """Which rows decode (one query) and which prefill, and their masks, built once."""

    def __init__(self, step: StepBatch, device) -> None:
        self.step, self.device = step, device
        bounds = step.query_start_host
        n_rows = len(step.seq_ids)
        self.decode = tuple(r for r in range(n_rows) if bounds[r + 1] - bounds[r] == 1)
        self.prefill = tuple(r for r in range(n_rows) if bounds[r + 1] - bounds[r] > 1)
        self.decode_lens = tuple(step.seq_lens_host[r] for r in self.decode)
        self.max_query_len = max(b - a for a, b in zip(bounds, bounds[1:]))
        self._masks: dict = {}

    @functools.cached_property
    def decode_tokens(self) -> torch.Tensor:
        """Where the decode rows' queries lie in the step."""
        bounds = self.step.query_start_host
        return to_device([bounds[r] for r in self.decode], torch.long, self.device)

    @functools.cached_property
    def query_start(self) -> torch.Tensor:
        """Where each row's queries start in the step, and the end ``[B + 1]``
        (int32, on the device: the multi-query kernel finds its rows there)."""
        if self.step.query_start is not None:
            return self.step.query_start
        return to_device(self.step.query_start_host, torch.int32, self.step.seq_lens.device)

    @functools.cached_property
    def decode_tables(self) -> torch.Tensor:
        """The decode rows' block tables (paged layers)."""
        return self.step.block_tables.index_select(0, self._decode_rows)

    @functools.cached_property
    def decode_seq_lens(self) -> torch.Tensor:
        """The decode rows' lengths, on the device (the kernels read them there)."""
        return self.step.seq_lens.index_select(0, self._decode_rows)

    @functools.cached_property
    def _decode_rows(self) -> torch.Tensor:
        return to_device(self.decode, torch.long, self.step.seq_lens.device)

    def causal(self, row: int, n: int, seq_len: int, window: int | None = None) -> torch.Tensor:
        """A prompt chunk's causal mask (bounded by a sliding ``window``),
        once per step for every paged layer."""
        key = ("causal", row, window)
        if key not in self._masks:
            self._masks[key] = causal_mask(n, seq_len - n, self.device, window)
        return self._masks[key]

    def padding(self, lengths: tuple[int, ...]) -> torch.Tensor | None:
        """Key-padding mask ``[rows, max(lengths)]``; None when no row is padded."""
        longest = max(lengths)
        if all(n == longest for n in lengths):
            return None
        if lengths not in self._masks:
            lens = to_device(lengths, torch.long, self.device)
            self._masks[lengths] = torch.arange(longest, device=self.device)[None, :] < lens[:, None]
        return self._masks[lengths]
