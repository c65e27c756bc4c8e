"""Qwen2: the Llama decoder with a bias on q, k and v and none on o
(transformers hard-codes both, whatever ``attention_bias`` says), and
sliding windows on the layers config.json picks (``window``)."""

from __future__ import annotations

from dataclasses import dataclass

from pagedlm.models import llama

MODEL_TYPES = ("qwen2",)


@dataclass
class ModelArgs(llama.ModelArgs):
    qkv_bias, o_bias = True, False

    def window(self, layer: int) -> int | None:
        """Only with ``use_sliding_window``: the ``layer_types`` marked
        sliding, or else every layer from ``max_window_layers`` up."""
        if self.sliding_window is None or not self.use_sliding_window:
            return None
        if self.layer_types is not None:
            sliding = self.layer_types[layer] == "sliding_attention"
        else:
            sliding = layer >= (self.max_window_layers or 0)
        return self.sliding_window if sliding else None


class Model(llama.Model):
    args_class = ModelArgs
