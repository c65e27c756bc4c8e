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

import functools
import sys
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Callable, Iterator

import torch

from pagedlm.attention import select_backend
from pagedlm.attention.sdpa import keep_sdpa_deterministic
from pagedlm.cache.admission import BlockAdmission, ByteAdmission
from pagedlm.cache.blocks import BlockManager
from pagedlm.cache.layout import PoolTooSmall, kv_bytes, make_pools, model_share, plan_layout
from pagedlm.cache.prompt import PromptCache
from pagedlm.cache.store import KVStore
from pagedlm.kernels.copies import to_device
from pagedlm.options import (DEFAULT_NUM_SPECULATIVE_TOKENS, DEVICE_DEFAULTS, EngineOptions, OptionError,
                             async_scheduling_on, check_refusals)
from pagedlm.params import SamplingParams
from pagedlm.sampling import (grammar_masks, logprobs_of, permitted_words, pick_on_device, picks_on_device, ranks_of,
                              sample, shares_argmax, token_rules)
from pagedlm.speculative import NgramProposer, SpecStats, verify

from .graphs import capture_graphs
from .scheduler import Scheduler
from .sequence import PENDING, Sequence, SequenceStatus, TokenLogprob
from .step import prepare_step

if TYPE_CHECKING:
    from pagedlm.structured import GrammarCompiler
    from pagedlm.tokenizer import Tokenizer

DEFAULT_MAX_MODEL_LEN = 8192  # when a config names no max_position_embeddings


@dataclass
class GenerationResponse:
    """What one step did for one sequence."""

    text: str  # newly completed text (may be empty while UTF-8 or a stop string is pending)
    token: int | None  # the sampled token; None when the sequence ends without one
    logprob: TokenLogprob | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" (a grammar dead-ends) on the last
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
    block_refs: int  # blocks in the sequences' tables: one shared by k sequences counts k times
    block_bytes: int  # one block across every pooled layer, scales included (0 without pools)
    prefix_caching: bool
    blocks_cached: int
    blocks_shared: int
    prefix_queried_tokens: int
    prefix_hit_tokens: int


@dataclass
class InFlight:
    """A step launched under async scheduling whose tokens the host has not
    read yet: the next step feeds them to its rows from the device."""

    sampled: list[Sequence]  # the sequences it samples, in order
    index: dict[int, int]  # sequence id -> its token's place in ``tokens``
    tokens: torch.Tensor | None  # [S] on the device (None until a deferred pick runs)
    host: torch.Tensor | None  # [S] their copy to the host, done once ``ready`` is
    ready: "torch.cuda.Event | None" = None
    # A step with grammar rows defers its pick: its logits wait, the rows' masks fill in the
    # background, and the next step picks once it has prepared its inputs (`LLMEngine._picked`).
    logits: torch.Tensor | None = None


# `LLMEngine._append`'s default: the row's matcher takes the appended token there (else it took it before).
ADVANCE = object()

# Verify steps of up to this many rows replay graphs (larger ones run eagerly): the graphs hold
# every token's logits, 256 rows of 1 + 8 tokens over Gemma 3's 262,144 would be 1.2 GB of bf16.
MAX_VERIFY_GRAPH_ROWS = 64


def model_context_length(model: torch.nn.Module) -> int:
    return int(getattr(model.args, "max_position_embeddings", None) or DEFAULT_MAX_MODEL_LEN)


class LLMEngine:
    def __init__(self, model: torch.nn.Module, tokenizer: "Tokenizer",
                 options: EngineOptions | None = None, draft: torch.nn.Module | None = None) -> None:
        """``draft``: the draft model of ``--speculative draft`` when it is
        loaded already (else ``options.draft_model`` is loaded by name)."""
        options = options or EngineOptions()
        if options.tensor_parallel_size > 1 and not hasattr(model, "make_store"):
            from pagedlm.parallel import parallelize  # a model in memory: every rank copies its slices

            model = parallelize(model, options)
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
                        "compile": options.compile, "enforce_eager": options.enforce_eager,
                        "paged_kv": options.paged_kv is not None, "speculative": options.speculative,
                        "num_speculative_tokens": options.num_speculative_tokens, "ngram_min": options.ngram_min,
                        "ngram_max": options.ngram_max, "async_scheduling": options.async_scheduling,
                        "tensor_parallel_size": options.tensor_parallel_size,
                        "draft_model": options.draft_model or (draft is not None and "the module given") or None})
        if kind == "cuda":
            keep_sdpa_deterministic()
        backend = select_backend(options.attention_backend, self.device, paged=options.paged_kv is not None)
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
        identity = repr((type(model).__qualname__, getattr(model, "args", None)))
        sizing = options
        if options.speculative == "draft":  # loaded before the pools are sized: its weights and keys share the budget
            if draft is None:
                from pagedlm.loading import load

                draft = load(options.draft_model, str(self.device), self.dtype)[0]
            sizing = model_share(options, self.device, self.dtype, model.kv_spec(), draft.kv_spec(),
                                 in_place=backend.in_place)
        plan = functools.partial(plan_layout, model.kv_spec(), sizing, self.device, self.dtype,
                                 in_place=backend.in_place, identity=identity)
        try:
            try:
                self.layout = layout = plan(max_model_len=self.max_model_len)
            except PoolTooSmall as e:
                if options.max_model_len is not None or e.tokens == 0:  # the user's length: refused with the numbers
                    raise
                self._lower_max_model_len(e.tokens)
                self.layout = layout = plan(max_model_len=self.max_model_len)
        except OptionError as e:
            if sizing is options:
                raise
            raise OptionError(f"{e} (the model's part of the budget: the draft model's keys take the rest)") from None
        # The cache package's objects, from the layout: pools and blocks, or a prompt cache.
        self.blocks, self.prompt_cache = None, None
        pools = make_pools(layout, self.dtype, self.device)
        if pools is not None:
            self.blocks = BlockManager(layout.num_blocks, layout.block_size, layout.prefix_salt)
        elif options.prompt_cache_bytes > 0:
            self.prompt_cache = PromptCache(options.prompt_cache_bytes)
        # A tensor-parallel model (pagedlm.parallel) makes a store its workers mirror.
        self.store = getattr(model, "make_store", KVStore)(layout, pools, backend)
        self.admission = (BlockAdmission(self.blocks, self.store) if self.blocks is not None
                          else ByteAdmission(layout, self.store, self.prompt_cache, self.max_num_batched_tokens))
        if self.blocks is None and (held := self.admission.longest_held(self.max_model_len)) < self.max_model_len:
            if held == 0:
                raise OptionError(f"the KV budget ({layout.budget_bytes} bytes) holds no sequence: a "
                                  f"sequence's first keys take {self.admission.projected_bytes(1)} bytes; "
                                  f"raise --kv-budget-bytes")
            if options.max_model_len is None:  # (the user's length stays: longer requests are refused one by one)
                self._lower_max_model_len(held)
        self.graphs = capture_graphs(model, self.store, options, self.max_num_seqs, self.max_model_len)
        self.verify_graphs = None
        if self.graphs is not None and options.speculative is not None:  # verify steps: every row checks k tokens
            k = options.num_speculative_tokens or DEFAULT_NUM_SPECULATIVE_TOKENS
            rows = min(self.max_num_seqs, MAX_VERIFY_GRAPH_ROWS)
            self.verify_graphs = capture_graphs(model, self.store, options, rows, self.max_model_len, queries=1 + k)
        if self.graphs is None and options.compile:  # the CPU's counterpart: decode steps compiled (same can_run / run)
            from .compiled import CompiledDecode

            self.graphs = CompiledDecode(model, self.store, self.max_num_seqs, self.max_model_len)
        self.scheduler = Scheduler(self.admission, self.max_num_seqs, self.max_num_batched_tokens,
                                   self.long_prefill_token_threshold, options.max_num_partial_prefills)
        self.paged_kv = pools is not None
        self.attention_backend = backend.name
        self.proposer = self._proposer(draft)  # None: no speculative decoding
        self.spec_stats = SpecStats()
        self._steps = 0
        self._grammars = None  # GrammarCompiler, at the first constrained request
        # Grammar rows' next masks filled on a background thread as each step ends, overlapping the
        # host's next step and the device's forward pass (on the CPU the forward takes every core).
        self.prefetch_masks = kind == "cuda"
        # Async scheduling: step N+1 is scheduled and launched before step N's tokens reach the host.
        self.async_scheduling = async_scheduling_on(options, kind)
        self._inflight: InFlight | None = None

    def _lower_max_model_len(self, tokens: int) -> None:
        """The model's context was only the default: lower it to the ``tokens``
        one sequence of the KV budget holds (vLLM refuses; a bench or server on
        a smaller GPU, or on the CPU's default budget, then runs with default
        flags, and a chat without max_tokens fits)."""
        print(f"pagedlm: max_model_len lowered from the model's {self.max_model_len} to {tokens} "
              f"tokens, what the KV budget holds (--max-model-len or --kv-budget-bytes to choose)",
              file=sys.stderr, flush=True)
        self.max_model_len = tokens

    def _proposer(self, draft: torch.nn.Module | None):
        """The ``--speculative`` proposer: prompt lookup, or the draft model's."""
        options = self.options
        if options.speculative is None:
            return None
        if options.speculative == "ngram":
            return NgramProposer.from_options(options)
        from .draft import DraftProposer

        return DraftProposer(draft, options.num_speculative_tokens or DEFAULT_NUM_SPECULATIVE_TOKENS,
                             self.vocab_size, self.layout, options, self.max_model_len, self.max_num_batched_tokens,
                             self.max_num_seqs)

    # -- requests -----------------------------------------------------------

    def add_request(self, prompt_ids: list[int], params: SamplingParams | None = None,
                    request_id: object = None) -> list[Sequence]:
        """Queue ``params.n`` sequences continuing ``prompt_ids`` (``max_tokens``
        None: up to max_model_len); raises `OptionError` (`RequestTooLarge`)
        for what can never run."""
        params = (params or SamplingParams()).validate()
        ids = list(prompt_ids)
        if params.truncate_prompt_tokens is not None:
            ids = ids[-params.truncate_prompt_tokens :]
        if not ids:
            raise OptionError("the prompt is empty")
        if params.max_tokens is None:  # vLLM's: up to the model's length
            self.check_fits(len(ids), 1)  # (no room at all: refused with the numbers)
            params = replace(params, max_tokens=self.max_model_len - len(ids)).validate()
        if len(ids) + params.max_tokens > self.max_model_len:  # (the budget is the scheduler's check)
            self.check_fits(len(ids), params.max_tokens)
        rules = token_rules(params, self.tokenizer, self.vocab_size, self.default_rules)
        constraint = params.structured_outputs if params.max_tokens > 0 else None
        seqs = []
        for p in params.continuations():
            matcher = None if constraint is None else self.grammars.matcher(constraint, label=str(request_id or ""))
            seq = Sequence(ids, p, self.tokenizer.eos_token_ids, self.tokenizer.detokenizer(p.skip_special_tokens),
                           request_id, rules, matcher)
            self.scheduler.add(seq)
            seqs.append(seq)
        return seqs

    @property
    def grammars(self) -> "GrammarCompiler":
        """The structured-output compiler, made at the first constrained
        request (llguidance is imported only then)."""
        if self._grammars is None:
            from pagedlm.structured import GrammarCompiler
            from pagedlm.structured.compiler import default_lanes
            from pagedlm.structured.matcher import hand_off_the_gil_quickly

            self._grammars = GrammarCompiler(self.tokenizer, self.vocab_size, lanes=default_lanes(self.device.type))
            if self.prefetch_masks:  # the fill in the background overlaps the step's Python work
                hand_off_the_gil_quickly()
        return self._grammars

    def abort(self, seq: Sequence) -> None:
        """End ``seq`` now and free what it holds (call between steps); a
        token of it still on its way is dropped."""
        if not seq.is_finished and self.proposer is not None:
            self.proposer.release(seq.seq_id)
        if not seq.is_finished and seq.pending:
            seq.output_ids.pop()
        self.scheduler.abort(seq)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self._inflight is not None

    def check_fits(self, num_prompt: int, max_tokens: int) -> None:
        """Raise `OptionError` (`RequestTooLarge`) unless a sequence of
        ``num_prompt`` prompt tokens and up to ``max_tokens`` more could run."""
        if num_prompt + max_tokens > self.max_model_len:
            raise OptionError(f"the prompt ({num_prompt} tokens) plus max_tokens ({max_tokens}) "
                              f"exceeds max_model_len ({self.max_model_len})")
        self.admission.check_fits(num_prompt, max_tokens)

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
        """Run one step; the responses of the sequences that moved.

        Async scheduling (``options.async_scheduling``): when every row that
        samples can take its token on the device (`picks_on_device`: greedy,
        or unseeded sampling drawn there; no logprobs), the step is launched
        and left in flight; the next call
        schedules and launches its successor, which feeds those tokens from
        the device, and only then reads them and answers for them. So the
        host's scheduling, input preparation and text overlap the device's
        step, and a sequence ends one step after the one that sampled its
        last token (a row that step gave it is computed and discarded; one
        that ends by max_tokens is not scheduled again). A step with grammar
        rows lands its predecessor before it picks (their masks need that
        token), after launching its forward pass; with ``prefetch_masks`` (on
        CUDA) it then leaves its pick to the next step, its rows' masks
        filling in the background meanwhile: the next step schedules and
        prepares, picks (the fill overlapped that host work and the device's
        forward pass), then launches. Without it the masks are filled and
        the pick launched in the step. The tokens are the same either way."""
        inflight, self._inflight = self._inflight, None
        dead: list[GenerationResponse] = []  # rows of a deferred pick whose grammar allowed nothing
        if self.proposer is not None:
            self._propose()
        rows = self.scheduler.schedule()
        if not rows:
            if inflight is None:
                return []
            self._picked(inflight, dead)
            return self._end(dead, {}) + self._land(inflight, {})
        now = time.perf_counter()
        for seq, _ in rows:
            if seq.first_scheduled is None:
                seq.first_scheduled = now
        step = prepare_step(rows, self.device, self.blocks,
                            None if inflight is None else (inflight.index, lambda: self._picked(inflight, dead)))
        if inflight is not None:  # (a step that fed none of its tokens picks them here)
            self._picked(inflight, dead)
        sampled = [rows[r][0] for r in step.sampling_rows]
        overlap = self.async_scheduling and self._may_overlap(rows, sampled)
        logits = launched = None
        with torch.inference_mode():
            replay = next((g for g in (self.graphs, self.verify_graphs) if g is not None and g.can_run(step)), None)
            if replay is not None:  # every row decodes, or verifies k proposed tokens: nothing to score
                logits = replay.run(step).float()
            else:
                hidden = self.model(step.input_ids, step.positions, self.store, step)
                for r, (seq, n) in enumerate(rows):
                    if seq.prompt_logprobs is not None:
                        self._score_prompt(seq, n, hidden[step.query_start_host[r] : step.query_start_host[r + 1]])
                if sampled:
                    logits = self.model.compute_logits(hidden[step.logits_rows]).float()
            self.store.end_step()
            self._steps += 1
            current = dict(rows)
            outputs = self._end(dead, {})  # (their rows in this step hold no token of theirs: not counted)
            # An overlapped step launches its picks, then lands the step in flight; but a grammar row's
            # mask needs that step's token: then it lands first (the device runs the forward meanwhile).
            grammar = [seq for seq in sampled if seq.matcher is not None]
            land_first = not overlap or bool(grammar)
            deferred = overlap and bool(grammar) and self.prefetch_masks  # the pick waits for a background fill
            if deferred:
                from pagedlm.structured.matcher import prefetch_bitmasks

                def prefetch(ended: set[int]) -> None:  # once the matchers hold the landed tokens
                    going = [seq for seq in grammar if not seq.is_finished and seq.seq_id not in ended]
                    prefetch_bitmasks([seq.matcher for seq in going], logits.is_cuda, permitted_words(going))
            if inflight is not None and land_first:
                outputs += self._land(inflight, current, prefetch if deferred else None)
            elif deferred:
                prefetch(set())
            if overlap:
                if deferred:
                    launched = InFlight(sampled, {seq.seq_id: i for i, seq in enumerate(sampled)}, None, None,
                                        logits=logits)
                elif sampled:
                    launched, ended = self._launch(logits, sampled)
                    outputs += self._end(ended, current)
                if inflight is not None and not land_first:
                    outputs += self._land(inflight, current)
                self._advance(rows, sampled)
                self._inflight = launched
            else:
                emitted, first = self._pick(logits, sampled)  # per sampled row: its tokens, its first logits row
                outputs += self._settle(rows, sampled, emitted, first, logits)
        if self._grammars is not None and self.prefetch_masks and self._inflight is None:
            from pagedlm.structured.matcher import prefetch_bitmasks

            going = [seq for seq in self.scheduler.running if seq.matcher is not None
                     and seq.matcher.ready() and seq.num_tokens - seq.num_computed == 1]
            prefetch_bitmasks([seq.matcher for seq in going], self.device.type == "cuda", permitted_words(going))
        return outputs

    def _may_overlap(self, rows: list[tuple[Sequence, int]], sampled: list[Sequence]) -> bool:
        """The step may be left in flight: its tokens are picked on the device
        and nothing reads its logits or hidden states afterwards."""
        return (all(seq.prompt_logprobs is None for seq, _ in rows)
                and all(picks_on_device(seq) and seq.params.logprobs is None and seq.params.max_tokens > 0
                        for seq in sampled))

    def _picked(self, inflight: InFlight, dead: list[GenerationResponse]) -> torch.Tensor:
        """``inflight``'s tokens on the device, picked now if its pick was
        deferred (the responses of rows that die then join ``dead``)."""
        if inflight.logits is not None:
            launched, ended = self._launch(inflight.logits, inflight.sampled)
            inflight.tokens, inflight.host, inflight.ready, inflight.logits = (launched.tokens, launched.host,
                                                                               launched.ready, None)
            dead += ended
        return inflight.tokens

    def _launch(self, logits: torch.Tensor, sampled: list[Sequence]) -> tuple[InFlight, list[GenerationResponse]]:
        """Pick the step's tokens on the device and start their copy to the
        host; grammar rows pick within their masks, filled now (their matchers
        hold every token before this step's). Also the responses of the rows
        whose grammar allows nothing (they end, "error"; a token the step's
        successor holds for them, `PENDING`, is dropped)."""
        constrained = [i for i, seq in enumerate(sampled) if seq.matcher is not None and not seq.is_finished]
        dead = []
        if constrained:
            from pagedlm.structured import masked_logits

            bitmask, live = grammar_masks([sampled[i] for i in constrained], pinned=logits.is_cuda)
            filled = (bitmask.to(logits.device, non_blocking=True), live)  # (from pinned memory: no wait)
            matchers = [sampled[i].matcher for i in constrained]
            if len(constrained) == len(sampled):  # every row has a grammar (as a structured workload's steps)
                logits, live = masked_logits(logits, matchers, filled)
            else:
                rows = to_device(constrained, torch.long, logits.device)
                masked, live = masked_logits(logits.index_select(0, rows), matchers, filled)
                logits = logits.index_copy(0, rows, masked)
            for i, ok in zip(constrained, live):
                if not ok:
                    if sampled[i].pending:
                        sampled[i].output_ids.pop()
                    dead.append(self._end_without_token(sampled[i], "error"))
        tokens = pick_on_device(logits, sampled, ruled=set(constrained))  # (grammar_masks folded their rules in)
        ready = None
        if tokens.is_cuda:
            host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            host.copy_(tokens, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record()
        else:
            host = tokens
        return InFlight(sampled, {seq.seq_id: i for i, seq in enumerate(sampled)}, tokens, host, ready), dead

    def _advance(self, rows: list[tuple[Sequence, int]], sampled: list[Sequence]) -> None:
        """After launching an overlapped step: its rows' keys count as computed,
        and each sampling row's token is `PENDING` until the next step lands it."""
        for seq, n in rows:
            if not seq.is_finished:  # (one the last step ended counted this step's keys already)
                seq.num_computed += n
                self.admission.commit(seq)  # before PENDING joins the tokens: blocks hash real tokens only
        for seq in sampled:
            if not seq.is_finished:
                seq.output_ids.append(PENDING)

    def _land(self, inflight: InFlight, current: dict[Sequence, int],
              advanced: Callable[[set[int]], None] | None = None) -> list[GenerationResponse]:
        """Read an in-flight step's tokens, answer for them and end the
        sequences they end (`_end`; ``current``: the step launched since, a
        row per sequence). With ``advanced``: the grammar rows' matchers take
        their tokens first, then ``advanced`` is called with the ids of the
        sequences whose grammar those tokens end, before the rest (text,
        responses): a background fill of the next masks overlaps that work."""
        if inflight.ready is not None:
            inflight.ready.synchronize()
        tokens = inflight.host.tolist()
        ends: dict[int, str | None] = {}  # sequence id -> how its grammar took its token (`RowMatcher.advance`)
        if advanced is not None:
            for seq, token in zip(inflight.sampled, tokens):
                if seq.matcher is not None and not seq.is_finished and not self._stop_token(seq, token):
                    ends[seq.seq_id] = seq.matcher.advance(token)
            advanced({i for i, end in ends.items() if end is not None})
        outputs = []
        for seq, token in zip(inflight.sampled, tokens):
            if seq.is_finished:  # aborted since
                continue
            seq.output_ids.pop()  # PENDING
            outputs.append(self._append(seq, token, None, ends.get(seq.seq_id, ADVANCE)))
        return self._end(outputs, current)

    def _end(self, outputs: list[GenerationResponse], current: dict[Sequence, int]) -> list[GenerationResponse]:
        """End the sequences of ``outputs`` that finish, outside a synchronous
        step's settling. One with a row in the ``current`` step, launched
        already, counts that row's keys as computed before its storage is
        released: they are its tokens', and the step writes them before
        anything after it can reuse the storage."""
        for out in outputs:
            if out.finish_reason is not None:
                seq = out.seq
                if seq in current and seq.status is SequenceStatus.RUNNING:
                    seq.num_computed += current[seq]
                    self.admission.commit(seq)
                self.scheduler.finish(seq, out.finish_reason)
        return outputs

    def _settle(self, rows: list[tuple[Sequence, int]], sampled: list[Sequence], emitted: list, first: list[int],
                logits: torch.Tensor | None) -> list[GenerationResponse]:
        """A step run synchronously: append each sampled row's tokens, drop a
        verify row's rejected keys, count the rows' keys, end what ended.
        Rows of sequences that ended before (an in-flight step landed) are skipped."""
        outputs: list[GenerationResponse] = []
        kept = {}  # verify rows: tokens fed whose keys stay
        for i, seq in enumerate(sampled):
            if seq.is_finished:
                continue
            if emitted[i] is None:  # its grammar dead-ends (the matcher logged why)
                outputs.append(self._end_without_token(seq, "error"))
                continue
            for j, token in enumerate(emitted[i]):
                logprob = None
                if seq.params.logprobs is not None and seq.params.max_tokens > 0:
                    at = logits[first[i] + j : first[i] + j + 1]
                    chosen = torch.tensor([token], device=logits.device)
                    logprob = logprobs_of(at, chosen, seq.params.logprobs)[0]
                    seq.logprob_ranks += ranks_of(at, chosen)
                outputs.append(self._append(seq, token, logprob))
                if outputs[-1].finish_reason is not None:
                    break
            if seq.draft:
                kept[seq.seq_id] = j + 1  # the last token and the accepted proposals the output holds now
                self._count_verified(seq, len(emitted[i]) - 1, j + 1)
        for seq, n in rows:
            if seq.is_finished:
                continue
            if seq.seq_id in kept:  # a verify row: drop the rejected tail's keys
                rejected = n - kept[seq.seq_id]
                n -= rejected
                if rejected:
                    self.store.trim_row(seq.seq_id, rejected)
                    if self.blocks is not None:
                        self.blocks.trim(seq.seq_id, seq.num_computed + n)
            seq.draft = []
            seq.num_computed += n
            self.admission.commit(seq)
        for out in outputs:  # after the commits: a finished sequence's blocks are findable first
            if out.finish_reason is not None:
                self.scheduler.finish(out.seq, out.finish_reason)
                if self.proposer is not None:
                    self.proposer.release(out.seq.seq_id)
        return outputs

    def _pick(self, logits: torch.Tensor | None, sampled: list[Sequence]) -> tuple[list, list[int]]:
        """The tokens each sampled row emits (None: its grammar allows none)
        and where its logits start: one row each, or a verify row's ``1 + d``."""
        first, at = [], 0
        for seq in sampled:
            first.append(at)
            at += 1 + len(seq.draft)
        if not sampled:
            return [], first
        if at == len(sampled):  # nothing proposed: one call for the whole step, as without speculation
            return [[t] if t is not None else None for t in sample(logits, sampled)], first
        plain = [i for i, seq in enumerate(sampled) if not seq.draft]
        emitted: list = [None] * len(sampled)
        if plain:
            for i, t in zip(plain, sample(logits[[first[i] for i in plain]], [sampled[i] for i in plain])):
                emitted[i] = [t] if t is not None else None
        verifying = [i for i, seq in enumerate(sampled) if seq.draft]
        greedy = [i for i in verifying if shares_argmax(sampled[i])]
        best: dict[int, list[int]] = {}
        if greedy:  # one argmax, one read, for every greedy verify row's positions
            at = [j for i in greedy for j in range(first[i], first[i] + 1 + len(sampled[i].draft))]
            picked = logits[at].argmax(-1).tolist()
            for i in greedy:
                best[i], picked = picked[: 1 + len(sampled[i].draft)], picked[1 + len(sampled[i].draft) :]
        for i in verifying:
            seq = sampled[i]
            emitted[i] = verify(logits[first[i] : first[i] + 1 + len(seq.draft)], seq, seq.draft, best.get(i))
        return emitted, first

    def _propose(self) -> None:
        """Give each running decode row that may speculate its proposal
        (``seq.draft``; the scheduler may shorten or drop it). Constrained
        rows do not speculate; a proposal never runs past max_tokens or
        max_model_len (a verify row emits up to 1 + d tokens).

        With verify graphs (CUDA), once any row proposes, every asking row's
        proposal is padded to its k with its last token: a step whose rows
        all check k tokens replays a graph (1.2-1.5x a decode step on the
        H200) where uneven proposals would run eagerly (4-15x). Exact: a
        padded token is one more proposal the verify rule judges."""
        k = self.proposer.num_speculative_tokens
        asking, rows = [], []
        for seq in self.scheduler.running:
            seq.draft = []
            room = min(seq.params.max_tokens - len(seq.output_ids), self.max_model_len - seq.num_tokens) - 1
            if seq.num_tokens - seq.num_computed == 1 and seq.matcher is None and room > 0:
                asking.append(seq)
                rows.append((seq, min(k, room)))
        drafts = self.proposer.propose(rows) if rows else []
        if self.verify_graphs is not None and any(drafts):
            drafts = [d + [(d or seq.tokens)[-1]] * (n - len(d)) for (seq, n), d in zip(rows, drafts)]
        for seq, draft in zip(asking, drafts):
            seq.draft = draft

    def _count_verified(self, seq: Sequence, accepted: int, emitted: int) -> None:
        d = len(seq.draft)
        seq.num_drafts += 1
        seq.num_draft_tokens += d
        seq.num_accepted_tokens += accepted
        stats = self.spec_stats
        stats.drafts += 1
        stats.draft_tokens += d
        stats.accepted_tokens += accepted
        stats.emitted_tokens += emitted

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

    @staticmethod
    def _stop_token(seq: Sequence, token: int) -> bool:
        """``token`` ends ``seq`` as a stop token (EOS or ``stop_token_ids``;
        vLLM: none within the first min_tokens), ``seq.output_ids`` holding
        its place already (the token, or `PENDING`)."""
        return len(seq.output_ids) > seq.params.min_tokens and token in seq.stop_ids

    def _append(self, seq: Sequence, token: int, logprob: TokenLogprob | None,
                grammar_end: str | None | object = ADVANCE) -> GenerationResponse:
        """Add ``token`` to ``seq``; decide whether it ends it (the step ends
        it, after committing its blocks); the text it completes.
        ``grammar_end``: `ADVANCE` (its matcher takes the token here, if
        neither a stop token nor a stop string ends it first), else what
        its matcher's `advance` gave for it already."""
        first = seq.first_token_at is None
        if first:
            seq.first_token_at = time.perf_counter()
        if seq.params.max_tokens == 0:  # score the prompt, generate nothing
            return self._response(seq, "", None, None, "length", first)
        seq.output_ids.append(token)
        finish = None
        stopping = len(seq.output_ids) > seq.params.min_tokens  # vLLM: no stop within the first min_tokens
        if self._stop_token(seq, token):
            # The stop token's own text is emitted only with include_stop_str_in_output; what is held back is.
            piece = seq.detokenizer.add_token(token) if seq.params.include_stop_str_in_output else ""
            text, finish = seq.stops.feed(piece + seq.detokenizer.finalize())[0] + seq.stops.flush(), "stop"
            seq.stop_reason = token if token in seq.params.stop_token_ids else None  # None: EOS
        else:
            piece = seq.detokenizer.add_token(token)
            text, hit = seq.stops.feed(piece) if stopping else (piece, None)
            if hit is not None:
                finish, seq.stop_reason = "stop", hit
            elif seq.matcher is not None and (end := seq.matcher.advance(token) if grammar_end is ADVANCE
                                              else grammar_end) is not None:  # "stop", "error"
                text += seq.stops.feed(seq.detokenizer.finalize())[0] + seq.stops.flush()
                finish = end
            elif len(seq.output_ids) >= seq.params.max_tokens or seq.num_tokens >= self.max_model_len:
                text += seq.stops.feed(seq.detokenizer.finalize())[0] + seq.stops.flush()
                finish = "length"
        seq.text += text
        if logprob is not None:
            seq.logprobs.append(logprob)
        return self._response(seq, text, token, logprob, finish, first)

    def _end_without_token(self, seq: Sequence, reason: str) -> GenerationResponse:
        """``seq`` ends with nothing sampled (its grammar allows no token): the text held back is emitted."""
        first = seq.first_token_at is None
        if first:
            seq.first_token_at = time.perf_counter()
        text = seq.stops.feed(seq.detokenizer.finalize())[0] + seq.stops.flush()
        seq.text += text
        return self._response(seq, text, None, None, reason, first)

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
        live = self.kv_bytes([seq.num_computed for seq in running])
        rows = sum(self.store.row_bytes(seq.seq_id) for seq in running)
        if self.blocks is not None:
            per_block = self.store.pools.nbytes // self.blocks.num_blocks
            return KVUsage(rows + self.blocks.num_used * per_block, live, self.store.pools.nbytes)
        return KVUsage(rows, live, self.layout.budget_bytes)

    def kv_bytes(self, lengths: list[int]) -> int:
        """KV bytes that sequences of these lengths attend to."""
        return kv_bytes(self.layout.specs, self.layout.bytes_per_token, lengths)

    def padded_kv_bytes(self) -> int:
        """What a padded batch of the running rows would hold: each reserved
        at the longest row's full length (prompt plus max_tokens)."""
        running = self.scheduler.running
        if not running:
            return 0
        return self.kv_bytes([max(seq.max_len for seq in running)]) * len(running)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix that no running sequence holds: the
        paged store's free blocks' hashes, the default store's prompt cache
        (a bench's next repeat then computes its prompts again). True when
        nothing stays findable (no sequence running holds a cached block)."""
        if self.prompt_cache is not None:
            self.prompt_cache.clear()
        if self.blocks is not None:
            self.blocks.forget_free()
            return self.blocks.num_cached == 0
        return True

    def cache_stats(self) -> CacheStats:
        pc, blocks = self.prompt_cache, self.blocks
        return CacheStats(
            kv_budget_bytes=self.layout.budget_bytes,
            prompt_cache_entries=len(pc) if pc is not None else None,
            prompt_cache_bytes=pc.nbytes if pc is not None else 0,
            prompt_cache_hits=pc.hits if pc is not None else 0,
            prompt_cache_misses=pc.misses if pc is not None else 0,
            blocks_total=blocks.num_blocks if blocks is not None else None,
            blocks_used=blocks.num_used if blocks is not None else 0,
            blocks_free=blocks.num_free if blocks is not None else 0,
            block_refs=blocks.num_refs if blocks is not None else 0,
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
