"""The offline API, as vLLM users know it: ``LLM(...).generate(prompts, SamplingParams(...))``."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import options as opt
from .batch.engine import LLMEngine
from .batch.sequence import Sequence, TokenLogprob
from .cache.store import kv_bytes
from .options import SamplingParams


@dataclass
class CompletionOutput:
    index: int  # which of the request's n continuations
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[TokenLogprob] | None = None


@dataclass
class RequestOutput:
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    prompt_logprobs: list[TokenLogprob] | None = None
    num_cached_tokens: int = 0


@dataclass
class KVStats:
    """KV figures of the last ``generate`` call, averaged over its steps.

    ``kv_bytes_allocated``: bytes held by live sequences (blocks, or cache
    buffers); ``kv_bytes_live``: bytes holding tokens they attend to;
    ``kv_bytes_padded``: what a padded batch of the same rows would hold,
    every row reserved at the longest row's prompt + max_tokens."""

    steps: int = 0
    kv_bytes_allocated: float = 0.0
    kv_bytes_live: float = 0.0
    kv_bytes_padded: float = 0.0
    peak_kv_bytes_allocated: int = 0
    peak_running: int = 0
    preemptions: int = 0

    @property
    def live_fraction(self) -> float:
        return self.kv_bytes_live / self.kv_bytes_allocated if self.kv_bytes_allocated else 0.0


class LLM:
    def __init__(
        self,
        model: str | torch.nn.Module = opt.DEFAULT_MODEL,
        *,
        tokenizer=None,
        paged_kv: bool = False,
        block_size: int | None = None,
        kv_quant: str | None = None,
        prefix_caching: bool | None = None,
        max_num_seqs: int | None = None,
        max_num_batched_tokens: int | None = None,
        kv_budget_bytes: int | None = None,
        gpu_memory_fraction: float | None = None,
        max_model_len: int | None = None,
        device: str | None = None,
        dtype: str | None = None,
        attention_backend: str | None = None,
        enforce_eager: bool | None = None,
    ) -> None:
        if isinstance(model, str):
            from .loading import load

            dev = opt.resolve_device(device)
            model, tokenizer = load(model, dev, opt.resolve_dtype(dtype, dev))
        elif tokenizer is None:
            raise opt.OptionError("LLM(model=<module>) needs tokenizer=")
        flags = {"paged_kv": paged_kv, "paged_kv_block_size": block_size, "kv_quant": kv_quant,
                 "prefix_caching": prefix_caching, "max_num_seqs": max_num_seqs,
                 "max_num_batched_tokens": max_num_batched_tokens, "kv_budget_bytes": kv_budget_bytes,
                 "gpu_memory_fraction": gpu_memory_fraction, "attention_backend": attention_backend,
                 "enforce_eager": enforce_eager}
        options = opt.resolve_engine_options(flags, environ={}, max_model_len=max_model_len)
        self.model, self.tokenizer = model, tokenizer
        self.engine = LLMEngine(model, tokenizer, options)
        self.stats = KVStats()

    def generate(
        self,
        prompts: str | list[str] | list[int] | list[list[int]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """One output per prompt, in order. Prompts are strings or token-id lists."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise opt.OptionError(f"{len(params)} sampling params for {len(prompts)} prompts")
        engine = self.engine
        requests: list[tuple[str | None, list[int], list[Sequence]]] = []
        try:
            for prompt, p in zip(prompts, params):
                ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
                requests.append((prompt if isinstance(prompt, str) else None, ids,
                                 engine.add_request(ids, p or SamplingParams())))
            self._run(sum(len(r[2]) for r in requests), use_tqdm)
        finally:
            for _, _, seqs in requests:  # an exception (or Ctrl-C) leaves nothing running
                for seq in seqs:
                    engine.abort(seq)
        return [self._output(*r) for r in requests]

    def _run(self, total: int, use_tqdm: bool) -> None:
        from tqdm import tqdm

        engine, stats = self.engine, KVStats()
        preempted = engine.num_preemptions
        with tqdm(total=total, desc="generate", unit="seq", disable=not use_tqdm) as bar:
            while engine.has_unfinished():
                outs = engine.step()
                usage = engine.kv_usage()
                running = engine.scheduler.running
                stats.steps += 1
                stats.kv_bytes_allocated += usage.allocated
                stats.kv_bytes_live += usage.live
                stats.kv_bytes_padded += self._padded_bytes(running)
                stats.peak_kv_bytes_allocated = max(stats.peak_kv_bytes_allocated, usage.allocated)
                stats.peak_running = max(stats.peak_running, len(running))
                bar.update(sum(1 for o in outs if o.finish_reason is not None))
        if stats.steps:
            for name in ("kv_bytes_allocated", "kv_bytes_live", "kv_bytes_padded"):
                setattr(stats, name, getattr(stats, name) / stats.steps)
        stats.preemptions = engine.num_preemptions - preempted
        self.stats = stats

    def _padded_bytes(self, running: list[Sequence]) -> int:
        """A padded batch of these rows: each reserved at the longest row's full length."""
        if not running:
            return 0
        longest = max(seq.max_len for seq in running)
        return kv_bytes(self.engine.specs, self.engine.bytes_per_token, [longest]) * len(running)

    def _output(self, prompt, ids, seqs: list[Sequence]) -> RequestOutput:
        outputs = [CompletionOutput(i, seq.text, list(seq.output_ids), seq.finish_reason, seq.logprobs)
                   for i, seq in enumerate(seqs)]
        return RequestOutput(prompt, ids, outputs, seqs[0].prompt_logprobs, seqs[0].num_cached)


__all__ = ["LLM", "RequestOutput", "CompletionOutput", "KVStats"]
