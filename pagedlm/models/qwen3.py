"""Qwen3: the Llama decoder with a per-head RMSNorm on q and k, ``head_dim``
128 unless config.json gives one, and Qwen2's sliding windows."""

from __future__ import annotations

from dataclasses import dataclass

from pagedlm.models import llama, qwen2

MODEL_TYPES = ("qwen3",)


@dataclass
class ModelArgs(llama.ModelArgs):
    qk_norm = True
    window = qwen2.ModelArgs.window

    def __post_init__(self) -> None:
        if self.head_dim is None:  # transformers' Qwen3Config default, not hidden / heads
            self.head_dim = 128
        super().__post_init__()


class Model(llama.Model):
    args_class = ModelArgs
