"""The batched engine: sequences, blocks, scheduler, step, engine."""

from .engine import GenerationResponse, KVUsage, LLMEngine
from .sequence import Sequence, SequenceStatus
from .step import prepare_step

__all__ = ["GenerationResponse", "KVUsage", "LLMEngine", "Sequence", "SequenceStatus", "prepare_step"]
