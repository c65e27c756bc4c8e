"""The serial generation loop: one request, batch 1, prefill then decode.

Data flow: token ids -> `make_cache` -> `maybe_page_kv` (only with
``--paged-kv``) -> chunked prefill -> sample / decode until a stop ->
caches disposed. With no paged option no paged code runs at all.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterator, Sequence

import torch

from .cache.base import Cache
from .cache.kv import KVCache
from .options import GenerateOptions, OptionError, PagedKvOptions
from .sampling import Sampler, top_logprobs

if TYPE_CHECKING:
    from .tokenizer import Tokenizer

PREFILL_CHUNK = 512  # prompt tokens per forward: bounds activation and logits memory

TokenLogprob = tuple[float, list[tuple[int, float]]]  # (chosen token's logprob, top-k)


@dataclass
class GenerationResponse:
    """One step of a streamed generation."""

    text: str  # newly completed text (may be empty while UTF-8 or a stop string is pending)
    token: int | None  # the sampled token, None on a final flush
    logprob: TokenLogprob | None = None
    finish_reason: str | None = None  # "stop" | "length" on the last response
    prompt_tokens: int = 0
    generation_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens reused from a cache handed in
    prompt_tps: float = 0.0
    generation_tps: float = 0.0
    paged_kv: bool = False
    prompt_logprobs: list[TokenLogprob] | None = field(default=None, repr=False)


def make_cache(model: torch.nn.Module) -> list[Cache]:
    return model.make_cache()


def maybe_page_kv(
    cache: list[Cache],
    options: PagedKvOptions | None,
    capacity_tokens: int,
    model: torch.nn.Module,
) -> bool:
    """Swap each EMPTY plain `KVCache` for a `PagedKVCache` over a pool sized
    for ``capacity_tokens``. Sliding-window caches stay as they are. Returns
    whether anything was paged. Runs once, before prefill."""
    if options is None:
        return False
    from .cache.paged import BlockPool, PagedKVCache  # only paged requests import it

    param = next(model.parameters())
    num_blocks = -(-capacity_tokens // options.block_size)
    paged = False
    for i, layer_cache in enumerate(cache):
        if type(layer_cache) is KVCache and layer_cache.offset == 0:
            pool = BlockPool(
                num_blocks,
                options.block_size,
                model.args.num_key_value_heads,
                model.args.head_dim,
                param.dtype,
                param.device,
            )
            cache[i] = PagedKVCache(pool)
            paged = True
    return paged


def _logprobs_of(logits: torch.Tensor, tokens: torch.Tensor, k: int) -> list[TokenLogprob]:
    """Per row: the logprob of ``tokens[row]`` and the row's top ``k``."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = logprobs.gather(-1, tokens[:, None])[:, 0].tolist()
    return [(c, top_logprobs(row, k)) for c, row in zip(chosen, logprobs)]


def prefill(
    model: torch.nn.Module,
    ids: torch.Tensor,
    cache: list[Cache],
    prompt_logprobs: int | None = None,
) -> tuple[torch.Tensor, list[TokenLogprob] | None]:
    """Run the prompt through the model in chunks; return the last position's
    float32 logits and, if asked, the logprob of every prompt token after the
    first given its prefix."""
    scored: list[TokenLogprob] | None = [] if prompt_logprobs is not None else None
    last = None
    for start in range(0, ids.shape[0], PREFILL_CHUNK):
        chunk = ids[start : start + PREFILL_CHUNK]
        logits = model(chunk[None], cache, last_only=scored is None)[0]
        if scored is not None:
            targets = ids[start + 1 : start + 1 + chunk.shape[0]]
            scored += _logprobs_of(logits[: targets.shape[0]], targets, prompt_logprobs)
        last = logits[-1]
    return last.float(), scored


def stream_generate(
    model: torch.nn.Module,
    tokenizer: "Tokenizer",
    prompt: str | Sequence[int],
    options: GenerateOptions,
    cache: list[Cache] | None = None,
) -> Iterator[GenerationResponse]:
    """Generate from ``prompt`` (text, or token ids), yielding as text completes.

    ``cache``, when given, is owned by the caller and may already hold a
    prefix of the prompt (``cache[0].offset`` tokens): only the rest is
    prefilled. Afterwards it holds the prompt and every generated token but
    the last. A cache made here is disposed here.
    """
    options.validate()
    ids = tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
    if not ids:
        raise OptionError("the prompt is empty")
    device = next(model.parameters()).device
    own_cache = cache is None
    if cache is None:
        cache = make_cache(model)
    reused = cache[0].offset if cache else 0
    if reused >= len(ids):
        raise ValueError(f"the cache holds {reused} tokens; the prompt has {len(ids)}")
    if options.prompt_logprobs is not None and reused:
        raise ValueError("prompt logprobs need a cache that holds nothing yet")
    t_start = time.perf_counter()  # pool allocation counts as prefill, as KVCache growth does
    paged = reused == 0 and maybe_page_kv(
        cache, options.paged_kv, len(ids) + options.max_tokens, model
    )
    try:
        yield from _generate_loop(
            model, tokenizer, ids, reused, options, cache, device, paged, t_start
        )
    finally:
        if own_cache or paged:
            for layer_cache in cache:
                layer_cache.dispose()


def _generate_loop(model, tokenizer, ids, reused, options, cache, device, paged, t0):
    sampler = Sampler(options, device)
    stop_ids = set(options.stop_token_ids)
    if not options.ignore_eos:
        stop_ids |= set(tokenizer.eos_token_ids)
    detok = tokenizer.detokenizer()
    stops = StopMatcher(options.stop)
    history = torch.tensor(ids, dtype=torch.long) if options.repetition_penalty != 1.0 else None
    generated: list[int] = []

    def response(text, token, **kw):
        now = time.perf_counter()
        decode_s = now - t_first
        return GenerationResponse(
            text=text,
            token=token,
            prompt_tokens=len(ids),
            generation_tokens=len(generated),
            cached_tokens=reused,
            prompt_tps=(len(ids) - reused) / prefill_s,
            generation_tps=(len(generated) - 1) / decode_s if len(generated) > 1 else 0.0,
            paged_kv=paged,
            **kw,
        )

    with torch.inference_mode():
        prompt = torch.tensor(ids[reused:], dtype=torch.long, device=device)
        logits, prompt_scores = prefill(model, prompt, cache, options.prompt_logprobs)
        token = sampler(logits, history)
        t_first = time.perf_counter()
        prefill_s = max(t_first - t0, 1e-9)
        while True:
            generated.append(token)
            logprob = None
            if options.logprobs is not None:
                logprob = _logprobs_of(logits[None], torch.tensor([token], device=logits.device),
                                       options.logprobs)[0]
            finish = None
            if token in stop_ids:
                text, finish = stops.flush(), "stop"
            else:
                text, hit = stops.feed(detok.add_token(token))
                if hit:
                    finish = "stop"
                elif len(generated) >= options.max_tokens:
                    text += stops.feed(detok.finalize())[0] + stops.flush()
                    finish = "length"
            yield response(text, token, logprob=logprob, finish_reason=finish,
                           prompt_logprobs=prompt_scores if len(generated) == 1 else None)
            if finish is not None:
                return
            step = torch.tensor([[token]], dtype=torch.long, device=device)
            logits = model(step, cache, last_only=True)[0, -1].float()
            if history is not None:
                history = torch.cat([history, torch.tensor([token])])
            token = sampler(logits, history)


class StopMatcher:
    """Holds back text that may be the start of a stop string."""

    def __init__(self, stops: Sequence[str]):
        self.stops = [s for s in stops if s]
        self.pending = ""

    def feed(self, text: str) -> tuple[str, bool]:
        """Return (text safe to emit, whether a stop string was reached)."""
        if not self.stops:
            return text, False
        buf = self.pending + text
        hits = [i for i in (buf.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.pending = ""
            return buf[: min(hits)], True
        hold = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(buf)), 0, -1):
                if buf.endswith(s[:n]):
                    hold = max(hold, n)
                    break
        self.pending = buf[len(buf) - hold :]
        return buf[: len(buf) - hold], False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


def generate(
    model: torch.nn.Module,
    tokenizer: "Tokenizer",
    prompt: str | Sequence[int],
    options: GenerateOptions | None = None,
) -> str:
    """The whole completion as one string."""
    return "".join(r.text for r in stream_generate(model, tokenizer, prompt, options or GenerateOptions()))
