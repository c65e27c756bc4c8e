"""`pagedlm bench ppl`: perplexity on real text, ``none`` against a quantized mode.

The text is the Python language reference's prose as every CPython ships it
(``pydoc_data.topics``: ~465k characters of English, the help() pages, in
sorted topic order), so every machine scores the same words and no model
wrote them. It is cut into non-overlapping windows of ``--window`` tokens;
each window starts with BOS (when the model has one) and every text token
in it is scored, given the tokens before it in its window.

``perplexity(model, windows, scorer)`` takes the scorer factory (default
`batch.solo.Solo`: ``scorer(model)(ids)`` gives one fresh sequence's logits
``[L, V]``); ``window_logits`` is the one place that runs the model. With
``--kv-quant`` every window goes through paged pools (`Solo` with
``kv_quant``): ``none`` first, then each asked 8-bit format, so the rows
differ by the KV format alone. The window is one prefill chunk whose
queries read their own keys back from the pools: every key a token attends
to went through the 8-bit round trip, as in the engine's decode.
"""

from __future__ import annotations

import gc
import json
import math
import sys
import time
from dataclasses import asdict, dataclass
from functools import partial
from typing import Callable

import torch

from .. import options as opt
from ..batch.engine import model_context_length
from ..batch.solo import Solo
from ..loading import load


def reference_text() -> str:
    """The Python language reference, as shipped in the standard library."""
    from pydoc_data.topics import topics  # half a megabyte of text: only when asked

    return "\n\n".join(topics[k] for k in sorted(topics))


def window_logits(model, ids: list[int], scorer: Callable = Solo) -> torch.Tensor:
    """float32 logits ``[L, V]`` of one window (prefill only, a fresh
    sequence). The one place this bench runs the model."""
    return scorer(model)(ids).float()


def make_windows(tokenizer, tokens: int, window: int) -> list[list[int]]:
    """``tokens // (window - bos)`` windows of ``window`` ids over the reference text."""
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    ids = tokenizer.encode(reference_text(), add_special_tokens=False)
    step = window - len(bos)
    count = tokens // step
    if count < 1 or count * step > len(ids):
        raise opt.OptionError(f"--tokens must be between {step} and {len(ids) // step * step} "
                              f"for --window {window} (the text has {len(ids)} tokens)")
    return [bos + ids[i * step : (i + 1) * step] for i in range(count)]


@dataclass
class PplResult:
    name: str
    ppl: float
    nll: float  # mean negative log-likelihood per scored token (nats)
    scored_tokens: int
    seconds: float


def perplexity(model, windows: list[list[int]], scorer: Callable = Solo, name: str = "") -> PplResult:
    """Perplexity of every token of every window after the first."""
    total, count = 0.0, 0
    t0 = time.perf_counter()
    for ids in windows:
        logits = window_logits(model, ids, scorer)[:-1]
        target = torch.tensor(ids[1:], device=logits.device)
        total += torch.nn.functional.cross_entropy(logits, target, reduction="sum").item()
        count += len(target)
        del logits
    nll = total / count
    return PplResult(name, math.exp(nll), nll, count, time.perf_counter() - t0)


def run_ppl_bench(args) -> int:
    device = opt.resolve_device(args.device)
    dtype = opt.resolve_dtype(args.dtype, device)
    spec = args.model or opt.DEFAULT_MODEL
    # One run scores several modes (one load each): --quantization int8,int4
    flags = (args.quantization or "").split(",") if args.quantization else [None]
    asked = [opt.resolve_quantization(f.strip() if f else None) for f in flags]
    # ... and several KV formats on each (one load): --kv-quant int8,fp8
    kv_asked = [opt.check_kv_quant(f) for f in args.kv_quant.split(",")] if args.kv_quant else []
    kv_modes = ["none", *(m for m in dict.fromkeys(kv_asked) if m != "none")] if kv_asked else [None]
    window = args.window
    modes = ["none", *(m for m in dict.fromkeys(asked) if m != "none")]
    results: list[tuple[str, str | None, PplResult]] = []
    windows = None
    for mode in modes:
        model, tokenizer = load(spec, device, dtype, quantization=mode)
        if window > (context := model_context_length(model)):  # (positions past it: a model never trained there)
            raise opt.OptionError(f"--window {window} exceeds the model's context ({context} tokens)")
        windows = windows or make_windows(tokenizer, args.tokens, window)
        for kv in kv_modes:
            scorer = Solo if kv is None else partial(Solo, kv_quant=kv, capacity=window)
            results.append((mode, kv, perplexity(model, windows, scorer)))
        del model
        gc.collect()
    base = results[0][2]
    for mode, kv, r in results:
        row = {"model": spec, "device": device, "dtype": str(dtype).removeprefix("torch."),
               "window": window, "windows": len(windows), "quantization": mode,
               "paged_kv": kv is not None, "kv_quant": kv or "none", **asdict(r),
               "ppl_change_vs_none": round(r.ppl / base.ppl - 1, 5)}
        row.pop("name")
        if args.json:
            print(json.dumps(row), flush=True)
        else:
            kv_text = f" kv {kv:4s}" if kv is not None else ""
            print(f"{spec} {mode:5s}{kv_text} ppl {r.ppl:9.4f}  ({row['ppl_change_vs_none']:+.2%} vs none)  "
                  f"{r.scored_tokens} tokens scored in {len(windows)} windows of {window}, {r.seconds:.0f} s",
                  file=sys.stdout, flush=True)
    return 0
