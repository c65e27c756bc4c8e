"""One forward pass's worth of work, flattened: ``StepBatch``.

Every row (sequence) contributes its new tokens, one for a decode row, a
chunk of its prompt for a prefill row; the model sees them concatenated as
``T`` tokens and never pads. Which tokens belong to which row, where their
keys go and which hidden states need logits are all in the step. The
engine builds it (``batch.step.prepare_step``); the model, the store and the
attention backend read it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class StepBatch:
    input_ids: torch.Tensor  # [T] the new tokens of every row, row after row
    positions: torch.Tensor  # [T] each token's position in its sequence
    seq_lens: torch.Tensor  # [B] keys of row r after this step
    logits_rows: torch.Tensor  # [S] index into T of the last token of each row that samples (a verify row: its 1 + d)
    slot_mapping: torch.Tensor | None  # [T] paged store: pool slot of each new key/value
    block_tables: torch.Tensor | None  # [B, W] paged store: each row's blocks, padded with -1
    # Host copies, for the reference paths (no device reads per layer).
    seq_ids: tuple[int, ...]
    query_start_host: tuple[int, ...]
    seq_lens_host: tuple[int, ...]
    sampling_rows: tuple[int, ...]  # rows (indices into seq_ids) that sample a token
    max_position: int
    # [B + 1] int32 on the device: where each row's queries start, when the step's
    # builder holds it there already (a CUDA graph's static buffer; else the
    # attention backend copies query_start_host over).
    query_start: torch.Tensor | None = None
    # A CUDA graph's step: lengths change at every replay (seq_lens_host is empty),
    # so what attention sizes by them is sized for any step the graph may replay.
    replayed: bool = False

    @property
    def num_tokens(self) -> int:
        return self.query_start_host[-1]
