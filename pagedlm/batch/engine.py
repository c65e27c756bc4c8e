"""The engine: many sequences, one flattened forward pass per step (``LLMEngine``).

    seq = engine.add_request(prompt_ids, SamplingParams(...))
    while engine.has_unfinished():
        for out in engine.step():      # GenerationResponse per sequence that moved
            ...

A step: the scheduler picks rows and their new tokens, ``prepare_step``
flattens them, the model runs once over all of them, the rows that reached
the end of their tokens get logits and a sampled token, and each sampled
token is appended, detokenized and checked against the stops. One request
alone is a batch of one: the CLI, ``stream_generate`` and the server all run
through here.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Iterator

import torch

from pagedlm.attention import keep_sdpa_deterministic
from pagedlm.cache.paged import PagedPools
from pagedlm.cache.prompt import PromptCache
from pagedlm.cache.store import KVStore, kv_bytes, token_bytes
from pagedlm.kernels import paged_attention
from pagedlm.options import DEVICE_DEFAULTS, EngineOptions, OptionError, check_refusals
from pagedlm.params import SamplingParams
from pagedlm.sampling import logprobs_of, ranks_of, sample, token_rules

from .block_manager import BlockManager
from .graphs import DecodeGraphs
from .scheduler import Scheduler
from .sequence import Sequence, TokenLogprob
from .step import prepare_step

if TYPE_CHECKING:
    from pagedlm.tokenizer import Tokenizer

DEFAULT_MAX_MODEL_LEN = 8192  # when a config names no max_position_embeddings


@dataclass
class GenerationResponse:
    """What one step did for one sequence."""

    text: str  # newly completed text (may be empty while UTF-8 or a stop string is pending)
    token: int | None  # the sampled token; None when the sequence ends without one
    logprob: TokenLogprob | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" on the last response
    prompt_tokens: int = 0
    generation_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens whose keys were reused (prompt cache, or cached blocks)
    prompt_tps: float = 0.0
    generation_tps: float = 0.0
    paged_kv: bool = False
    prompt_logprobs: list[TokenLogprob] | None = field(default=None, repr=False)
    seq: Sequence | None = field(default=None, repr=False, compare=False)


@dataclass
class KVUsage:
    """KV bytes right now: ``allocated`` (held by live sequences: their blocks,
    or their cache buffers) and ``live`` (holding tokens they attend to)."""

    allocated: int
    live: int
    capacity: int  # the pool (paged) or the budget (default)


@dataclass(frozen=True)
class CacheStats:
    """The KV caches' counters, read by metrics and benches (``LLMEngine.cache_stats``)."""

    kv_budget_bytes: int
    prompt_cache_entries: int | None  # None: no prompt cache
    prompt_cache_bytes: int
    prompt_cache_hits: int
    prompt_cache_misses: int
    blocks_total: int | None  # None: the default store (no pools)
    blocks_used: int
    blocks_free: int
    block_bytes: int  # one block across every pooled layer, scales included (0 without pools)
    prefix_caching: bool
    blocks_cached: int
    blocks_shared: int
    prefix_queried_tokens: int
    prefix_hit_tokens: int


def model_context_length(model: torch.nn.Module) -> int:
    return int(getattr(model.args, "max_position_embeddings", None) or DEFAULT_MAX_MODEL_LEN)


class LLMEngine:
    def __init__(self, model: torch.nn.Module, tokenizer: "Tokenizer",
                 options: EngineOptions | None = None) -> None:
        options = options or EngineOptions()
        param = next(model.parameters())
        self.model, self.tokenizer, self.options = model, tokenizer, options
        self.vocab_size = int(model.args.vocab_size)  # the logits' width
        self.default_rules = token_rules(SamplingParams(), tokenizer, self.vocab_size)  # shared by plain requests
        self.device, self.dtype = param.device, param.dtype
        kind = self.device.type
        check_refusals({"device": kind, "gpu_memory_fraction": options.gpu_memory_fraction,
                        "gpu_memory_utilization": options.gpu_memory_utilization,
                        "kv_budget_bytes": options.kv_budget_bytes,
                        "attention_backend": options.attention_backend, "kv_quant": options.kv_quant,
                        "paged_kv": options.paged_kv is not None})
        if kind == "cuda":
            keep_sdpa_deterministic()
        self.kernels = options.paged_kv is not None and (
            options.attention_backend == "triton"
            or (options.attention_backend == "auto" and kind == "cuda" and paged_attention.available(self.device)))
        defaults = DEVICE_DEFAULTS.get(kind, DEVICE_DEFAULTS["cpu"])
        self.max_num_seqs = options.max_num_seqs or defaults["max_num_seqs"]
        self.max_num_batched_tokens = options.max_num_batched_tokens or defaults["max_num_batched_tokens"]
        self.long_prefill_token_threshold = (options.long_prefill_token_threshold
                                             if options.long_prefill_token_threshold is not None
                                             else max(1, self.max_num_batched_tokens // 4))
        context = model_context_length(model)
        self.max_model_len = options.max_model_len or context
        if self.max_model_len > context:
            raise OptionError(f"--max-model-len {self.max_model_len} exceeds the model's context "
                              f"length ({context} tokens)")
        self.specs = model.kv_spec()
        self.bytes_per_token = token_bytes(self.specs, self.dtype, options.kv_quant, sliding_pooled=self.kernels)
        self.kv_budget_bytes = self._budget(options, defaults)
        self.blocks: BlockManager | None = None
        pools = None
        if options.paged_kv is not None:
            bs = options.paged_kv.block_size
            paged = [i for i, s in enumerate(self.specs) if s.window is None or self.kernels]
            spec = self.specs[paged[0]] if paged else self.specs[0]
            caching = options.paged_kv.prefix_caching and paged
            if caching and not self.kernels:  # the pools keep the sliding layers' keys too: a cached prefix needs them
                paged = self._pooled_for_caching(spec)
            per_block = PagedPools.bytes_per_block(len(paged), bs, spec.num_kv_heads, spec.head_dim, self.dtype,
                                                   options.kv_quant)
            num_blocks = self.kv_budget_bytes // per_block if paged else 0
            need = -(-self.max_model_len // bs)
            if paged and num_blocks < need:
                raise OptionError(
                    f"the KV budget ({self.kv_budget_bytes} bytes) holds {num_blocks} blocks of {bs} tokens, "
                    f"fewer than one sequence of max_model_len {self.max_model_len} needs ({need}); "
                    f"raise --kv-budget-bytes or lower --max-model-len")
            if paged:
                pools = PagedPools(paged, num_blocks, bs, spec.num_kv_heads, spec.head_dim, self.dtype,
                                   self.device, options.kv_quant, fused=self.kernels)
                self.blocks = BlockManager(num_blocks, bs, self._salt(options.kv_quant) if caching else None)
        self.store = KVStore(self.specs, pools)
        self.graphs = None
        if self.kernels and kind == "cuda" and not options.enforce_eager:
            self.graphs = DecodeGraphs(model, self.store, self.max_num_seqs,
                                       -(-self.max_model_len // options.paged_kv.block_size),
                                       options.paged_kv.block_size, self.device)
        self.prompt_cache = (PromptCache(options.prompt_cache_bytes)
                             if pools is None and options.prompt_cache_bytes > 0 else None)
        self.scheduler = Scheduler(self.store, self.max_num_seqs, self.max_num_batched_tokens,
                                   self.kv_budget_bytes, self.bytes_per_token, self.blocks, self.prompt_cache,
                                   self.long_prefill_token_threshold, options.max_num_partial_prefills)
        self.paged_kv = pools is not None
        self.attention_backend = "triton" if self.kernels else "torch"
        self._steps = 0

    def _pooled_for_caching(self, spec) -> list[int]:
        """Every layer, when the sliding ones store keys shaped like the full ones."""
        for s in self.specs:
            if (s.num_kv_heads, s.head_dim) != (spec.num_kv_heads, spec.head_dim):
                raise OptionError("prefix caching keeps every layer's keys in one pool, and this model's "
                                  "layers differ in KV heads or head size; use --no-prefix-caching")
        return list(range(len(self.specs)))

    def _salt(self, kv_quant: str) -> bytes:
        """What the keys of a block depend on besides its tokens: the model, the
        KV dtype and its 8-bit format."""
        identity = repr((type(self.model).__qualname__, getattr(self.model, "args", None), str(self.dtype),
                         kv_quant))
        return hashlib.blake2b(identity.encode(), digest_size=16).digest()

    def _budget(self, options: EngineOptions, defaults: dict) -> int:
        if options.kv_budget_bytes is not None:
            return options.kv_budget_bytes
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            if options.gpu_memory_utilization is not None:
                return self._utilization_budget(options.gpu_memory_utilization, free, total)
            fraction = options.gpu_memory_fraction or defaults["gpu_memory_fraction"]
            return int(free * fraction)
        return defaults["kv_budget_bytes"]

    def _utilization_budget(self, utilization: float, free: int, total: int) -> int:
        """vLLM's meaning: this process may hold ``utilization`` of the GPU's
        total memory; the KV cache gets that less what the process holds now
        (the weights). Other processes' memory is not this process's share,
        but it must leave room for the budget."""
        gib, used = 1024**3, torch.cuda.memory_allocated(self.device)
        budget = int(total * utilization) - used
        available = free + torch.cuda.memory_reserved(self.device) - used  # torch's cached blocks are ours
        name = f"--gpu-memory-utilization {utilization}"
        if budget <= 0:
            raise OptionError(f"{name} allows {total * utilization / gib:.2f} GiB of the GPU's {total / gib:.2f} "
                              f"GiB, and this process already holds {used / gib:.2f} GiB (weights included): "
                              f"nothing is left for the KV cache; raise it")
        if budget > available:
            raise OptionError(f"{name} leaves {budget / gib:.2f} GiB for the KV cache, but only "
                              f"{available / gib:.2f} GiB of the GPU are free (other processes hold the rest); "
                              f"lower it")
        return budget

    # -- requests -----------------------------------------------------------

    def add_request(self, prompt_ids: list[int], params: SamplingParams | None = None,
                    request_id: object = None) -> list[Sequence]:
        """Queue ``params.n`` sequences continuing ``prompt_ids``; raises
        `OptionError` (`RequestTooLarge`) for what can never run."""
        params = (params or SamplingParams()).validate()
        ids = list(prompt_ids)
        if params.truncate_prompt_tokens is not None:
            ids = ids[-params.truncate_prompt_tokens :]
        if not ids:
            raise OptionError("the prompt is empty")
        if len(ids) + params.max_tokens > self.max_model_len:  # (the budget is the scheduler's check)
            self.check_fits(len(ids), params.max_tokens)
        rules = token_rules(params, self.tokenizer, self.vocab_size, self.default_rules)
        seqs = []
        for p in params.continuations():
            seq = Sequence(ids, p, self.tokenizer.eos_token_ids, self.tokenizer.detokenizer(p.skip_special_tokens),
                           request_id, rules)
            self.scheduler.add(seq)
            seqs.append(seq)
        return seqs

    def abort(self, seq: Sequence) -> None:
        """End ``seq`` now and free what it holds (call between steps)."""
        self.scheduler.abort(seq)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def check_fits(self, num_prompt: int, max_tokens: int) -> None:
        """Raise `OptionError` (`RequestTooLarge`) unless a sequence of
        ``num_prompt`` prompt tokens and up to ``max_tokens`` more could run."""
        if num_prompt + max_tokens > self.max_model_len:
            raise OptionError(f"the prompt ({num_prompt} tokens) plus max_tokens ({max_tokens}) "
                              f"exceeds max_model_len ({self.max_model_len})")
        self.scheduler.check_fits(num_prompt, max_tokens)

    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_steps(self) -> int:
        """Steps run so far (each ran the model once)."""
        return self._steps

    # -- the step -----------------------------------------------------------

    def step(self) -> list[GenerationResponse]:
        rows = self.scheduler.schedule()
        if not rows:
            return []
        now = time.perf_counter()
        for seq, _ in rows:
            if seq.first_scheduled is None:
                seq.first_scheduled = now
        step = prepare_step(rows, self.device, self.blocks)
        sampled = [rows[r][0] for r in step.sampling_rows]
        tokens: list[int] = []
        logits = None
        with torch.inference_mode():
            if self.graphs is not None and self.graphs.can_run(step):
                logits = self.graphs.run(step).float()  # every row decodes: nothing to score
            else:
                hidden = self.model(step.input_ids, step.positions, self.store, step)
                for r, (seq, n) in enumerate(rows):
                    if seq.prompt_logprobs is not None:
                        self._score_prompt(seq, n, hidden[step.query_start_host[r] : step.query_start_host[r + 1]])
                if sampled:
                    logits = self.model.compute_logits(hidden[step.logits_rows]).float()
            if sampled:
                tokens = sample(logits, sampled)
        self.store.end_step()
        self._steps += 1
        for seq, n in rows:
            seq.num_computed += n
            if self.blocks is not None:
                self.blocks.commit(seq, seq.num_computed)
        outputs = []
        for i, seq in enumerate(sampled):
            logprob = None
            if seq.params.logprobs is not None and seq.params.max_tokens > 0:
                chosen = torch.tensor([tokens[i]], device=logits.device)
                logprob = logprobs_of(logits[i : i + 1], chosen, seq.params.logprobs)[0]
                seq.logprob_ranks += ranks_of(logits[i : i + 1], chosen)
            outputs.append(self._append(seq, tokens[i], logprob))
        return outputs

    def _score_prompt(self, seq: Sequence, n: int, hidden: torch.Tensor) -> None:
        """Logprobs of the prompt tokens this chunk predicts that are not scored
        yet (a recompute after preemption scores nothing twice)."""
        begin = seq.num_computed
        first = max(begin, len(seq.prompt_logprobs))  # position whose logits predict token first + 1
        last = min(begin + n, seq.num_prompt - 1)
        if first >= last:
            return
        logits = self.model.compute_logits(hidden[first - begin : last - begin]).float()
        targets = torch.tensor(seq.prompt_ids[first + 1 : last + 1], device=logits.device)
        seq.prompt_logprobs += logprobs_of(logits, targets, seq.params.prompt_logprobs)
        seq.prompt_logprob_ranks += ranks_of(logits, targets)

    def _append(self, seq: Sequence, token: int, logprob: TokenLogprob | None) -> GenerationResponse:
        """Add ``token`` to ``seq``; decide whether it ends it; the text it completes."""
        first = seq.first_token_at is None
        if first:
            seq.first_token_at = time.perf_counter()
        if seq.params.max_tokens == 0:  # score the prompt, generate nothing
            self.scheduler.finish(seq, "length")
            return self._response(seq, "", None, None, "length", first)
        seq.output_ids.append(token)
        finish = None
        stopping = len(seq.output_ids) > seq.params.min_tokens  # vLLM: no stop within the first min_tokens
        if stopping and token in seq.stop_ids:
            # The stop token's own text is emitted only with include_stop_str_in_output; what is held back is.
            piece = seq.detokenizer.add_token(token) if seq.params.include_stop_str_in_output else ""
            text, finish = seq.stops.feed(piece + seq.detokenizer.finalize())[0] + seq.stops.flush(), "stop"
            seq.stop_reason = token if token in seq.params.stop_token_ids else None  # None: EOS
        else:
            piece = seq.detokenizer.add_token(token)
            text, hit = seq.stops.feed(piece) if stopping else (piece, None)
            if hit is not None:
                finish, seq.stop_reason = "stop", hit
            elif len(seq.output_ids) >= seq.params.max_tokens or seq.num_tokens >= self.max_model_len:
                text += seq.stops.feed(seq.detokenizer.finalize())[0] + seq.stops.flush()
                finish = "length"
        seq.text += text
        if logprob is not None:
            seq.logprobs.append(logprob)
        if finish is not None:
            self.scheduler.finish(seq, finish)
        return self._response(seq, text, token, logprob, finish, first)

    def _response(self, seq, text, token, logprob, finish, first) -> GenerationResponse:
        now = time.perf_counter()
        prefill_s = max(seq.first_token_at - seq.first_scheduled, 1e-9)
        n_out = len(seq.output_ids)
        return GenerationResponse(
            text=text, token=token, logprob=logprob, finish_reason=finish,
            prompt_tokens=seq.num_prompt, generation_tokens=n_out, cached_tokens=seq.num_cached,
            prompt_tps=(seq.num_prompt - seq.num_cached) / prefill_s,
            generation_tps=(n_out - 1) / (now - seq.first_token_at) if n_out > 1 else 0.0,
            paged_kv=self.paged_kv,
            prompt_logprobs=seq.prompt_logprobs if first else None,
            seq=seq,
        )

    # -- one request alone --------------------------------------------------

    def stream(self, prompt_ids: list[int], params: SamplingParams | None = None, *,
               before_step: Callable[[Sequence], bool] | None = None) -> Iterator[GenerationResponse]:
        """Run one sequence to its end, yielding its responses. Closing the
        iterator early aborts it. ``before_step(seq)`` runs before each step
        (progress, a stop request): False ends the sequence there (aborted)."""
        (seq,) = self.add_request(prompt_ids, _single(params))
        try:
            while not seq.is_finished and (before_step is None or before_step(seq)):
                for out in self.step():
                    if out.seq is seq:
                        yield out
        finally:
            self.abort(seq)

    # -- figures ------------------------------------------------------------

    def kv_usage(self) -> KVUsage:
        running = self.scheduler.running
        live = kv_bytes(self.specs, self.bytes_per_token, [seq.num_computed for seq in running])
        rows = sum(self.store.row_bytes(seq.seq_id) for seq in running)
        if self.blocks is not None:
            per_block = self.store.pools.nbytes // self.blocks.num_blocks
            return KVUsage(rows + self.blocks.num_used * per_block, live, self.store.pools.nbytes)
        return KVUsage(rows, live, self.kv_budget_bytes)

    def kv_bytes(self, lengths: list[int]) -> int:
        """KV bytes that sequences of these lengths attend to."""
        return kv_bytes(self.specs, self.bytes_per_token, lengths)

    def padded_kv_bytes(self) -> int:
        """What a padded batch of the running rows would hold: each reserved
        at the longest row's full length (prompt plus max_tokens)."""
        running = self.scheduler.running
        if not running:
            return 0
        return self.kv_bytes([max(seq.max_len for seq in running)]) * len(running)

    def cache_stats(self) -> CacheStats:
        pc, blocks = self.prompt_cache, self.blocks
        return CacheStats(
            kv_budget_bytes=self.kv_budget_bytes,
            prompt_cache_entries=len(pc) if pc is not None else None,
            prompt_cache_bytes=pc.nbytes if pc is not None else 0,
            prompt_cache_hits=pc.hits if pc is not None else 0,
            prompt_cache_misses=pc.misses if pc is not None else 0,
            blocks_total=blocks.num_blocks if blocks is not None else None,
            blocks_used=blocks.num_used if blocks is not None else 0,
            blocks_free=blocks.num_free if blocks is not None else 0,
            block_bytes=self.store.pools.nbytes // blocks.num_blocks if blocks is not None else 0,
            prefix_caching=blocks is not None and blocks.caching,
            blocks_cached=blocks.num_cached if blocks is not None else 0,
            blocks_shared=blocks.num_shared if blocks is not None else 0,
            prefix_queried_tokens=blocks.queried_tokens if blocks is not None else 0,
            prefix_hit_tokens=blocks.hit_tokens if blocks is not None else 0,
        )

    @property
    def num_preemptions(self) -> int:
        return self.scheduler.num_preemptions


def _single(params: SamplingParams | None) -> SamplingParams:
    params = params or SamplingParams()
    if params.n != 1:
        raise OptionError(f"one stream runs one sequence (got n={params.n})")
    return params
