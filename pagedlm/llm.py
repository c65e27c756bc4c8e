"""The offline API, as vLLM users know it: ``LLM(...).generate(prompts, SamplingParams(...))``.

A vLLM script runs with its import changed to ``from pagedlm import LLM,
SamplingParams``: the same prompt forms, the same output shapes, vLLM's
keyword spellings. Where it differs: docs/cli.md, "Offline API".
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import torch

from . import options as opt
from .batch.engine import LLMEngine
from .batch.sequence import Sequence, TokenLogprob
from .options import EngineOptions, OptionError
from .params import SamplingParams, check_token_ids
from .speculative import SpecStats


@dataclass
class Logprob:
    """One token's score at one position (vLLM's ``Logprob``)."""

    logprob: float
    rank: int | None = None  # among the whole vocabulary: 1 = the most likely token
    decoded_token: str | None = None


# One position's scores: token id -> Logprob, the chosen token first, then the top k.
PositionLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    index: int  # which of the request's n continuations
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None  # sum of the chosen tokens' logprobs; None unless logprobs were asked for
    logprobs: list[PositionLogprobs] | None  # one per generated token
    finish_reason: str | None = None  # "stop", "length" or "abort"
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it; None for EOS, length

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None  # None for a prompt given as token ids
    prompt_token_ids: list[int]
    prompt_logprobs: list[PositionLogprobs | None] | None  # None first: the first token has no context
    outputs: list[CompletionOutput]
    finished: bool = True
    num_cached_tokens: int = 0


@dataclass
class KVStats:
    """KV figures of the last ``generate`` call, averaged over its steps.

    ``kv_bytes_allocated``: bytes held by live sequences (blocks, or cache
    buffers); ``kv_bytes_live``: bytes holding tokens they attend to;
    ``kv_bytes_padded``: what a padded batch of the same rows would hold,
    every row reserved at the longest row's prompt + max_tokens.
    ``prompt_tokens``: prompt tokens computed (cached ones not);
    ``prefill_s``: seconds from the call's start to the last sequence's
    first token (decode steps in between included)."""

    steps: int = 0
    kv_bytes_allocated: float = 0.0
    kv_bytes_live: float = 0.0
    kv_bytes_padded: float = 0.0
    peak_kv_bytes_allocated: int = 0
    peak_running: int = 0
    preemptions: int = 0
    prompt_tokens: int = 0
    prefill_s: float = 0.0
    speculation: SpecStats = field(default_factory=SpecStats)  # its counters, acceptance_rate, mean_accepted_length

    @property
    def live_fraction(self) -> float:
        return self.kv_bytes_live / self.kv_bytes_allocated if self.kv_bytes_allocated else 0.0


# vLLM's kv_cache_dtype -> our kv_quant ("int8" is ours; vLLM has no int8 KV).
KV_CACHE_DTYPES = {"auto": "none", "fp8": "fp8", "fp8_e4m3": "fp8", "int8": "int8"}
_PROMPT_FORMS = ("a prompt is a str, a list of token ids (ints), {'prompt': str} or "
                 "{'prompt_token_ids': [int, ...]}; many prompts are a list of these")


class LLM:
    """A model and an engine over it; ``generate`` and ``chat`` run batches to the end.

    ``model``: a built-in name, a .gguf path or a Hugging Face folder, or a
    loaded module (then ``tokenizer=`` too). The keywords are our engine
    options, plus vLLM's spellings where they mean the same thing
    (``enable_prefix_caching``, ``kv_cache_dtype``, ``gpu_memory_utilization``, ``speculative_config``,
    ``seed``, ``served_model_name``, ``tensor_parallel_size``: a module
    handed in with it is left whole, each rank copying its slices);
    ``engine_options=`` gives all the engine's options at once instead."""

    def __init__(
        self,
        model: str | torch.nn.Module = opt.DEFAULT_MODEL,
        *,
        tokenizer=None,
        paged_kv: bool | None = None,
        block_size: int | None = None,
        kv_quant: str | None = None,
        prefix_caching: bool | None = None,
        max_num_seqs: int | None = None,
        max_num_batched_tokens: int | None = None,
        kv_budget_bytes: int | None = None,
        gpu_memory_fraction: float | None = None,
        gpu_memory_utilization: float | None = None,
        max_model_len: int | None = None,
        device: str | None = None,
        dtype: str | None = None,
        quantization: str | None = None,
        attention_backend: str | None = None,
        enforce_eager: bool | None = None,
        compile: bool | None = None,
        async_scheduling: bool | None = None,
        enable_prefix_caching: bool | None = None,
        kv_cache_dtype: str | None = None,
        speculative: str | None = None,
        num_speculative_tokens: int | None = None,
        ngram_min: int | None = None,
        ngram_max: int | None = None,
        draft_model: str | None = None,
        speculative_config: dict | None = None,
        seed: int | None = None,
        served_model_name: str | list[str] | None = None,
        tensor_parallel_size: int = 1,
        distributed_backend: str | None = None,
        engine_options: EngineOptions | None = None,
    ) -> None:
        if isinstance(tokenizer, str):
            raise TypeError("tokenizer= takes a tokenizer object; a name or path is not supported "
                            "(the model's own tokenizer is used by default)")
        quantization = opt.check_quantization(quantization or "none", "quantization")
        if isinstance(model, str):
            dev = opt.resolve_device(device)
        else:
            if tokenizer is None:
                raise OptionError("LLM(model=<module>) needs tokenizer=")
            dev = _check_module(model, device, dtype, quantization)
        keywords = {"paged_kv": paged_kv, "block_size": block_size, "kv_quant": kv_quant,
                    "kv_cache_dtype": kv_cache_dtype, "prefix_caching": prefix_caching,
                    "enable_prefix_caching": enable_prefix_caching, "max_num_seqs": max_num_seqs,
                    "max_num_batched_tokens": max_num_batched_tokens, "kv_budget_bytes": kv_budget_bytes,
                    "gpu_memory_fraction": gpu_memory_fraction, "gpu_memory_utilization": gpu_memory_utilization,
                    "max_model_len": max_model_len, "attention_backend": attention_backend,
                    "enforce_eager": enforce_eager, "compile": compile, "async_scheduling": async_scheduling,
                    "speculative": speculative,
                    "num_speculative_tokens": num_speculative_tokens, "ngram_min": ngram_min,
                    "ngram_max": ngram_max, "draft_model": draft_model, "speculative_config": speculative_config,
                    "distributed_backend": distributed_backend,
                    "tensor_parallel_size": None if tensor_parallel_size == 1 else tensor_parallel_size}
        if engine_options is not None:
            given = [name for name, value in keywords.items() if value is not None]
            if given:
                raise OptionError(f"engine_options= sets the engine's options; drop {', '.join(given)} "
                                  f"(or set them in the EngineOptions)")
            options = engine_options
        else:
            speculation = _speculative_config(keywords)
            flags = {**keywords, **speculation, "paged_kv_block_size": block_size,
                     "kv_quant": _alias(kv_quant, "kv_quant", kv_cache_dtype, "kv_cache_dtype", _kv_cache_dtype),
                     "prefix_caching": _alias(prefix_caching, "prefix_caching", enable_prefix_caching,
                                              "enable_prefix_caching", lambda on: on)}
            options = opt.resolve_engine_options(flags, environ={}, device=dev)
        self._seeds = None if opt.check_seed(seed) is None else random.Random(seed)
        if isinstance(model, str):
            name = model
            model, loaded_tokenizer = _load(model, dev, opt.resolve_dtype(dtype, dev), quantization, options)
            tokenizer = tokenizer or loaded_tokenizer
        else:
            name = None
        if isinstance(served_model_name, list):
            served_model_name = served_model_name[0] if served_model_name else None
        self.served_model_name: str | None = served_model_name or name
        self.engine = LLMEngine(model, tokenizer, options)
        self.model, self.tokenizer = self.engine.model, tokenizer  # over many ranks: the engine's TensorParallelLM
        self.stats = KVStats()
        self._requests = 0  # vLLM's request ids: "0", "1", ... over this LLM's life
        self._token_text: dict[int, str] = {}

    def get_tokenizer(self):
        return self.tokenizer

    def reset_prefix_cache(self) -> bool:
        """Forget the prefixes earlier calls left cached (`LLMEngine.reset_prefix_cache`)."""
        return self.engine.reset_prefix_cache()

    # -- generation ---------------------------------------------------------

    def generate(
        self,
        prompts: str | list[int] | dict | list[str | list[int] | dict],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool | Callable[..., Any] = True,
    ) -> list[RequestOutput]:
        """One output per prompt, in order. A prompt is a string, a list of
        token ids, ``{"prompt": str}`` or ``{"prompt_token_ids": [...]}``;
        anything else raises `TypeError` / `ValueError` before any is queued.
        ``use_tqdm``: a progress bar, or a callable that makes one (as tqdm)."""
        parsed = [self._parse(p, i) for i, p in enumerate(_prompt_list(prompts))]
        params = self._params(sampling_params, len(parsed))
        engine = self.engine
        requests: list[tuple[str, str | None, list[int], list[Sequence]]] = []
        try:
            for i, ((text, ids), p) in enumerate(zip(parsed, params)):
                request_id = str(self._requests)
                try:
                    seqs = engine.add_request(ids, p, request_id)
                except OptionError as e:  # too long for the model or the KV budget: say which
                    raise type(e)(f"prompt {i}: {e}") from None
                self._requests += 1
                requests.append((request_id, text, seqs[0].prompt_ids, seqs))  # (truncate_prompt_tokens cut)
            self._run([seq for *_, seqs in requests for seq in seqs], use_tqdm)
        finally:
            for *_, seqs in requests:  # an exception (or Ctrl-C) leaves nothing running
                for seq in seqs:
                    engine.abort(seq)
        return [self._output(*r) for r in requests]

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool | Callable[..., Any] = True,
        *,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """``generate`` over conversations: one (a list of message dicts) or
        a list of them, each rendered by the tokenizer's chat template (or
        ``chat_template``, a Jinja string); ``tools`` (OpenAI's entries) and
        ``chat_template_kwargs`` reach the template as variables (a template
        without tool support gets the tools in a system preamble). Tool calls
        in the output are left as text, as vLLM leaves them. ``prompt`` is
        the rendered prompt."""
        conversations = _conversations(messages)
        # chat_template_kwargs win over the keywords (vLLM merges them over its own)
        template = dict(add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message,
                        chat_template=chat_template, tools=tools) | (chat_template_kwargs or {})
        tok = self.tokenizer
        prompts = [{"prompt_token_ids": tok.encode_chat(c, **template)} for c in conversations]
        outputs = self.generate(prompts, sampling_params, use_tqdm)
        for out, c in zip(outputs, conversations):
            out.prompt = tok.apply_chat_template(c, **template)
        return outputs

    # -- inputs -------------------------------------------------------------

    def _parse(self, prompt: object, i: int) -> tuple[str | None, list[int]]:
        """(text or None, token ids) of prompt ``i`` in one of vLLM's forms."""
        if isinstance(prompt, dict):
            extra = sorted(set(prompt) - {"prompt", "prompt_token_ids"}, key=str)
            if extra:
                raise ValueError(f"prompt {i}: {', '.join(map(repr, extra))} not supported "
                                 f"(text only: give 'prompt' or 'prompt_token_ids')")
            if len(prompt) != 1:
                raise ValueError(f"prompt {i}: give one of 'prompt' and 'prompt_token_ids' (got {len(prompt)})")
            ((key, prompt),) = prompt.items()
            if key == "prompt" and not isinstance(prompt, str):
                raise TypeError(f"prompt {i}: 'prompt' must be a str (got {type(prompt).__name__})")
            if key == "prompt_token_ids" and not isinstance(prompt, list):
                raise TypeError(f"prompt {i}: 'prompt_token_ids' must be a list of ints "
                                f"(got {type(prompt).__name__})")
        if isinstance(prompt, str):
            text, ids = prompt, self.tokenizer.encode(prompt)
        elif isinstance(prompt, list):
            text, ids = None, self._token_ids(prompt, i)
        else:
            raise TypeError(f"prompt {i} has type {type(prompt).__name__}: {_PROMPT_FORMS}")
        if not ids:
            raise ValueError(f"prompt {i} is empty")
        return text, ids

    def _token_ids(self, ids: list, i: int) -> list[int]:
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, int):
                raise TypeError(f"prompt {i}: token ids must be ints (got {t!r}, a {type(t).__name__})")
        check_token_ids(ids, self.engine.vocab_size, f"prompt {i}")  # an OptionError is a ValueError
        return list(ids)

    def _params(self, given: SamplingParams | list[SamplingParams] | None, n: int) -> list[SamplingParams]:
        """One SamplingParams per prompt. A request without a seed gets the
        next draw of ``LLM(seed=)``'s generator: the same script, the same output."""
        params = list(given) if isinstance(given, (list, tuple)) else [given] * n
        if len(params) != n:
            raise ValueError(f"{len(params)} sampling params for {n} prompts: give one, or one per prompt")
        out = []
        for p in params:
            p = SamplingParams() if p is None else p
            if not isinstance(p, SamplingParams):
                raise TypeError(f"sampling_params must be SamplingParams or a list of them (got {type(p).__name__})")
            if p.seed is None and self._seeds is not None:
                p = replace(p, seed=self._seeds.getrandbits(63))
            out.append(p.validate())  # a bad field is refused before any prompt is queued
        return out

    # -- the run ------------------------------------------------------------

    def _run(self, seqs: list[Sequence], use_tqdm: bool | Callable[..., Any]) -> None:
        from tqdm import tqdm

        engine, stats = self.engine, KVStats()
        preempted = engine.num_preemptions
        speculated = replace(engine.spec_stats)
        make = use_tqdm if callable(use_tqdm) else lambda **kw: tqdm(disable=not use_tqdm, **kw)
        start = shown = time.perf_counter()
        with make(total=len(seqs), desc="generate", unit="seq", dynamic_ncols=True) as bar:
            while engine.has_unfinished():
                outs = engine.step()
                usage = engine.kv_usage()
                stats.steps += 1
                stats.kv_bytes_allocated += usage.allocated
                stats.kv_bytes_live += usage.live
                stats.kv_bytes_padded += engine.padded_kv_bytes()
                stats.peak_kv_bytes_allocated = max(stats.peak_kv_bytes_allocated, usage.allocated)
                stats.peak_running = max(stats.peak_running, engine.num_running())
                now = time.perf_counter()
                show = not bar.disable and (now - shown >= bar.mininterval or not engine.has_unfinished())
                if show:  # each step may move the counts, none may finish a sequence: show them anyway
                    bar.set_postfix_str(_speed(seqs, now - start), refresh=False)
                    shown = now
                if not bar.update(sum(1 for o in outs if o.finish_reason is not None)) and show:
                    bar.refresh()
        if stats.steps:
            for name in ("kv_bytes_allocated", "kv_bytes_live", "kv_bytes_padded"):
                setattr(stats, name, getattr(stats, name) / stats.steps)
        stats.preemptions = engine.num_preemptions - preempted
        stats.speculation = engine.spec_stats.since(speculated)
        stats.prompt_tokens = sum(s.num_prompt - s.num_cached for s in seqs)
        stats.prefill_s = max((s.first_token_at - start for s in seqs if s.first_token_at is not None), default=0.0)
        self.stats = stats

    # -- outputs ------------------------------------------------------------

    def _output(self, request_id: str, prompt: str | None, ids: list[int], seqs: list[Sequence]) -> RequestOutput:
        first = seqs[0]
        prompt_logprobs = None
        if first.prompt_logprobs is not None:
            prompt_logprobs = [None] + [self._position(*s) for s in
                                        zip(ids[1:], first.prompt_logprobs, first.prompt_logprob_ranks)]
        outputs = []
        for i, seq in enumerate(seqs):
            logprobs = cumulative = None
            if seq.logprobs is not None:
                logprobs = [self._position(*s) for s in zip(seq.output_ids, seq.logprobs, seq.logprob_ranks)]
                cumulative = sum(lp for lp, _ in seq.logprobs)
            outputs.append(CompletionOutput(i, seq.text, list(seq.output_ids), cumulative, logprobs,
                                            seq.finish_reason, seq.stop_reason))
        return RequestOutput(request_id, prompt, ids, prompt_logprobs, outputs, True, first.num_cached)

    def _position(self, token: int, scored: TokenLogprob, rank: int) -> PositionLogprobs:
        """vLLM's dict for one position: the token there, then the top k by rank."""
        chosen, top = scored
        out = {token: Logprob(chosen, rank, self._decoded(token))}
        for r, (t, lp) in enumerate(top, 1):
            if t != token:
                out[t] = Logprob(lp, r, self._decoded(t))
        return out

    def _decoded(self, token: int) -> str:
        text = self._token_text.get(token)
        if text is None:
            text = self._token_text[token] = self.tokenizer.decode([token], skip_special_tokens=False)
        return text


def _alias(ours: object, our_name: str, vllms: object, vllm_name: str, convert: Callable) -> object:
    """One option given by our name or by vLLM's, not both."""
    if vllms is None:
        return ours
    if ours is not None:
        raise OptionError(f"{our_name}= and {vllm_name}= (vLLM's name) are one option: give one")
    return convert(vllms)


# vLLM's speculative_config keys -> our options ("method": "draft_model" is vLLM's name of "draft")
_SPECULATIVE_CONFIG = {"method": "speculative", "num_speculative_tokens": "num_speculative_tokens",
                       "prompt_lookup_min": "ngram_min", "prompt_lookup_max": "ngram_max", "model": "draft_model"}


def _speculative_config(keywords: dict) -> dict:
    """vLLM's ``speculative_config`` dict as our options (given alone: not beside ours)."""
    config = keywords.pop("speculative_config")
    if config is None:
        return {}
    if not isinstance(config, dict) or set(config) - set(_SPECULATIVE_CONFIG):
        raise OptionError(f"speculative_config takes a dict of {', '.join(_SPECULATIVE_CONFIG)} (got {config!r})")
    ours = {_SPECULATIVE_CONFIG[key]: value for key, value in config.items()}
    if ours.get("speculative") == "draft_model":
        ours["speculative"] = "draft"
    clash = [name for name in ours if keywords.get(name) is not None]
    if clash:
        raise OptionError(f"speculative_config and {', '.join(f'{n}=' for n in clash)} set one option: give one")
    return ours


def _kv_cache_dtype(name: object) -> str:
    if name not in KV_CACHE_DTYPES:
        raise OptionError(f"kv_cache_dtype must be {', '.join(KV_CACHE_DTYPES)} (got {name!r})")
    return KV_CACHE_DTYPES[name]


def _check_module(model: torch.nn.Module, device: str | None, dtype: str | None, quantization: str) -> str:
    """A loaded module runs where and as it is: device=, dtype= and
    quantization= may only say what it already is. Its device, resolved."""
    param = next(model.parameters())
    if device not in (None, "", "auto") and torch.device(opt.resolve_device(device)).type != param.device.type:
        raise OptionError(f"device={device!r}, but the model given is on {param.device}: move it first")
    if dtype not in (None, "", "auto") and opt.resolve_dtype(dtype, param.device.type) != param.dtype:
        raise OptionError(f"dtype={dtype!r}, but the model given is {param.dtype}: convert it first")
    if quantization != "none":
        raise OptionError(f"quantization={quantization!r} applies when LLM loads the model by name; quantize "
                          f"a loaded module first (pagedlm.loading.quant.quantize_model)")
    return param.device.type


def _load(spec: str, device: str, dtype: torch.dtype, quantization: str, options: EngineOptions):
    """(model, tokenizer) for a name or folder: over the ranks of
    ``options.tensor_parallel_size``, each loading only its slices."""
    if options.tensor_parallel_size > 1:
        from .parallel import load_parallel

        return load_parallel(spec, device, dtype, quantization, options)
    from .loading import load

    return load(spec, device, dtype, quantization)


def _prompt_list(prompts: object) -> list:
    """vLLM's batching: one prompt (a string, token ids, a dict), or a list of them."""
    if isinstance(prompts, list):
        if not prompts:
            raise ValueError("no prompts: give a prompt or a non-empty list of them")
        if isinstance(prompts[0], (int, float)):  # token ids (a float among them is refused as one)
            return [prompts]
        return prompts
    return [prompts]


def _conversations(messages: object) -> list[list[dict]]:
    """One conversation (a list of message dicts) or a list of them."""
    if isinstance(messages, list) and messages and not isinstance(messages[0], list):
        messages = [messages]
    if not isinstance(messages, list) or not messages:
        raise TypeError("messages must be a conversation (a non-empty list of message dicts) or a list of them")
    for i, conversation in enumerate(messages):
        if not isinstance(conversation, list) or not conversation:
            raise TypeError(f"conversation {i} must be a non-empty list of message dicts")
        for j, message in enumerate(conversation):
            if not isinstance(message, dict):
                raise TypeError(f"conversation {i}, message {j} is a {type(message).__name__}: a message is a "
                                f"dict with 'role' and 'content'")
    return messages


def _speed(seqs: list[Sequence], seconds: float) -> str:
    """Prompt tokens computed and tokens generated so far, and their rates:
    a long prefill shows progress before any sequence finishes."""
    prompt = sum(min(s.num_computed, s.num_prompt) for s in seqs)
    output = sum(len(s.output_ids) for s in seqs)
    seconds = max(seconds, 1e-9)
    return (f"input {prompt} toks ({prompt / seconds:.0f} toks/s), "
            f"output {output} toks ({output / seconds:.0f} toks/s)")


__all__ = ["LLM", "RequestOutput", "CompletionOutput", "Logprob", "KVStats"]
