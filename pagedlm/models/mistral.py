"""Mistral: the Llama decoder with a sliding window on every layer when
config.json sets ``sliding_window`` (a ``RotatingKVCache`` or the paged
store bounds its keys: ``kv_spec``)."""

from __future__ import annotations

from dataclasses import dataclass

from pagedlm.models import llama

MODEL_TYPES = ("mistral",)


@dataclass
class ModelArgs(llama.ModelArgs):
    def window(self, layer: int) -> int | None:
        return self.sliding_window


class Model(llama.Model):
    args_class = ModelArgs
