"""The batched engine: sequences, scheduler, step, CUDA graphs, engine (the KV it runs on is cache/'s)."""

from .engine import GenerationResponse, KVUsage, LLMEngine
from .sequence import Sequence, SequenceStatus
from .step import prepare_step

__all__ = ["GenerationResponse", "KVUsage", "LLMEngine", "Sequence", "SequenceStatus", "prepare_step"]
