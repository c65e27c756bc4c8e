"""What the store asks of an attention backend: ``AttentionBackend``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

from pagedlm.cache.step import StepBatch

if TYPE_CHECKING:
    from pagedlm.cache.store import KVStore


class AttentionBackend(Protocol):
    """Chosen once per engine (``select_backend``) and handed to its ``KVStore``,
    which stores keys and leaves every ``attend`` to it."""

    name: str
    """``"torch"`` or ``"triton"``: the ``--attention-backend`` it answers to."""
    in_place: bool
    """Attention reads the pools where they lie: the layout then pages every
    layer (sliding ones too) and the pools are laid out for the kernels."""

    def attend(self, store: "KVStore", layer: int, q: torch.Tensor, step: StepBatch, *,
               scale: float) -> torch.Tensor:
        """``[T, H_q, D]``: each row's queries over exactly its own keys in
        ``store`` (written for this step already), causal, bounded by the
        window on sliding layers."""
        ...

    def end_step(self) -> None:
        """Drop what the step kept for its layers (its plan, masks, row tables)."""
        ...

    def can_capture(self, store: "KVStore", step: StepBatch) -> bool:
        """Whether a CUDA graph may capture and replay ``step`` over ``store``:
        its attention reads nothing on the host and launches the same shapes
        whatever the rows' lengths."""
        ...
