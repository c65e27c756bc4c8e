"""`pagedlm bench memory`: what short requests pay beside long ones.

``--num-long`` requests of ``--long-len`` random prompt tokens and
``--num-short`` of ``--short-len`` (long ones first, so that they are
admitted and the short ones fill what room is left), each generating
``--max-tokens`` tokens (end-of-sequence ignored), run under one KV budget
(``--kv-budget-bytes``; by default four rows of the longest request) through
the default store and the paged store, one after the other in one process on
the same weights. Three rows:

- ``default``: each sequence's own contiguous buffers (grown 256 tokens at a
  time); admitted while the projected bytes of prompt + max_tokens fit;
- ``paged``: blocks from one pool sized by the budget, taken as tokens
  arrive; admitted while free blocks last (preempting when they run out);
- ``padded``: a padded batch (what a static-batching server holds), computed
  from the paged run's schedule: at every step, every running row reserved
  at the longest running row's prompt + max_tokens (``KVStats.kv_bytes_padded``);
  its admitted count is the budget over one row at the longest request's
  prompt + max_tokens;
- with ``--kv-quant int8|fp8``, a fourth: ``paged-int8`` (or ``-fp8``), the
  paged store again with 8-bit blocks under the same budget (the ``paged``
  row stays unquantized), with ``admitted_vs_paged``.

Figures, as means over the steps of the run: ``kv_bytes_allocated`` (held by
live sequences), ``kv_bytes_live`` (holding tokens they attend to),
``kv_live_fraction``, and ``bytes_per_live_token`` = allocated / live * the
KV bytes of one token across all layers (for a model without sliding-window
layers: exactly bytes allocated per live token). ``admitted``: the most
sequences running at once (peak), with ``preemptions``. Each store's row
names the attention backend its engine ran (``attention_backend``).
"""

from __future__ import annotations

import dataclasses
import json
import platform
import random

import torch

from .. import options as opt
from ..batch.engine import model_context_length
from ..cache.kv import STEP as KV_STEP
from ..cache.layout import kv_bytes, token_bytes
from ..llm import LLM
from ..params import SamplingParams
from .common import default_store, load_for_bench, refuse_given


MAX_STEP_TOKENS = 16384


def _check(args) -> None:
    if args.short_len > args.long_len:
        raise opt.OptionError(f"--short-len ({args.short_len}) must be <= --long-len ({args.long_len})")


def run_memory_bench(args, engine_options: opt.EngineOptions) -> int:
    _check(args)
    refuse_given(args, engine_options, "memory", "runs the default and the paged store at one KV budget "
                 "(--kv-budget-bytes, else 4 padded rows)", paged=True)
    model, tokenizer, device, dtype, spec = load_for_bench(args)

    specs = model.kv_spec()
    bytes_per_token = token_bytes(specs, dtype)
    longest = args.long_len + args.max_tokens
    if engine_options.max_model_len is None and longest > (context := model_context_length(model)):
        raise opt.OptionError(f"--long-len {args.long_len} plus --max-tokens {args.max_tokens} exceeds the model's "
                              f"context ({context} tokens)")
    padded_row = kv_bytes(specs, bytes_per_token, [longest])
    # (four rows, each at least the default store's first allocation)
    budget = engine_options.kv_budget_bytes or 4 * kv_bytes(specs, bytes_per_token, [max(longest, KV_STEP)])
    paged = engine_options.paged_kv or opt.PagedKvOptions()
    num_requests = args.num_short + args.num_long
    # Neither the row cap nor prefill chunking should limit concurrency here,
    # only the KV budget: by default every request may run, and one step may
    # take the whole workload's prompts (at most MAX_STEP_TOKENS).
    step_tokens = min(MAX_STEP_TOKENS, args.num_long * args.long_len + args.num_short * args.short_len)
    base_options = dataclasses.replace(
        engine_options, kv_budget_bytes=budget, gpu_memory_fraction=None,
        max_num_seqs=engine_options.max_num_seqs or num_requests,
        max_num_batched_tokens=engine_options.max_num_batched_tokens or step_tokens,
        max_model_len=engine_options.max_model_len or longest)

    rng = random.Random(args.seed)
    top = min(10000, model.args.vocab_size)
    prompts = ([[rng.randrange(top) for _ in range(args.long_len)] for _ in range(args.num_long)]
               + [[rng.randrange(top) for _ in range(args.short_len)] for _ in range(args.num_short)])
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)

    kv_quant = engine_options.kv_quant
    runs = {"default": default_store(base_options),
            "paged": dataclasses.replace(base_options, paged_kv=paged, kv_quant="none")}
    if kv_quant != "none":
        runs[f"paged-{kv_quant}"] = dataclasses.replace(base_options, paged_kv=paged)
    stats, backends = {}, {}
    for name, options in runs.items():
        llm = LLM(model, tokenizer=tokenizer, engine_options=options)
        llm.generate(prompts, params, use_tqdm=False)
        stats[name], backends[name] = llm.stats, llm.engine.attention_backend
        del llm
        if device.startswith("cuda"):
            torch.cuda.empty_cache()

    base = {
        "model": spec, "random_weights": bool(args.random_weights), "device": device,
        "dtype": str(dtype).removeprefix("torch."), "num_short": args.num_short, "short_len": args.short_len,
        "num_long": args.num_long, "long_len": args.long_len, "max_tokens": args.max_tokens,
        "kv_budget_bytes": budget, "padded_row_bytes": padded_row,
        "max_num_seqs": base_options.max_num_seqs, "max_num_batched_tokens": base_options.max_num_batched_tokens,
        "machine": platform.machine(),
    }

    def per_live_token(allocated: float, live: float, per_token: int) -> float | None:
        return round(allocated / live * per_token, 1) if live else None

    rows = []
    for name, options in runs.items():
        s = stats[name]
        per_token = sum(token_bytes(specs, dtype, options.kv_quant))
        rows.append({"name": name, "store": "default" if options.paged_kv is None else "paged", **base,
                     "block_size": paged.block_size if options.paged_kv else None,
                     "attention_backend": backends[name], "kv_quant": options.kv_quant, "kv_bytes_per_token": per_token,
                     "kv_bytes_allocated": round(s.kv_bytes_allocated), "kv_bytes_live": round(s.kv_bytes_live),
                     "kv_live_fraction": round(s.live_fraction, 4),
                     "bytes_per_live_token": per_live_token(s.kv_bytes_allocated, s.kv_bytes_live, per_token),
                     "peak_kv_bytes_allocated": s.peak_kv_bytes_allocated,
                     "admitted": s.peak_running, "preemptions": s.preemptions, "steps": s.steps})
        if options.kv_quant != "none":
            rows[-1]["admitted_vs_paged"] = round(s.peak_running / stats["paged"].peak_running, 3)
    s = stats["paged"]
    token_bytes_none = sum(bytes_per_token)
    rows.append({"name": "padded", "store": "padded", **base, "block_size": None, "attention_backend": None,
                 "kv_quant": "none", "kv_bytes_per_token": token_bytes_none,
                 "kv_bytes_allocated": round(s.kv_bytes_padded), "kv_bytes_live": round(s.kv_bytes_live),
                 "kv_live_fraction": round(s.kv_bytes_live / s.kv_bytes_padded, 4) if s.kv_bytes_padded else 0.0,
                 "bytes_per_live_token": per_live_token(s.kv_bytes_padded, s.kv_bytes_live, token_bytes_none),
                 "peak_kv_bytes_allocated": None,
                 "admitted": min(num_requests, budget // padded_row), "preemptions": 0, "steps": s.steps,
                 "schedule": "the paged run's: every running row at the longest running row's prompt + max_tokens"})
    padded_admitted = rows[-1]["admitted"]
    for row in rows:
        row["admitted_vs_padded"] = round(row["admitted"] / padded_admitted, 3) if padded_admitted else None

    for row in rows:
        if args.json:
            print(json.dumps(row), flush=True)
            continue
        block = f" (block {row['block_size']})" if row["block_size"] else ""
        print(f"{row['name'] + block:18s} {row['bytes_per_live_token'] or 0:10.0f} bytes per live token "
              f"(live {100 * row['kv_live_fraction']:5.1f}% of {row['kv_bytes_allocated'] / 2**20:8.1f} MiB, "
              f"ideal {row['kv_bytes_per_token']} B)  admitted {row['admitted']:4d} of {num_requests} at "
              f"{budget / 2**20:.0f} MiB (x{row['admitted_vs_padded']} padded), "
              f"preemptions {row['preemptions']}", flush=True)
    if not args.json:
        print(f"({args.num_long} x {args.long_len}-token and {args.num_short} x {args.short_len}-token prompts, "
              f"{args.max_tokens} tokens each; padded: the paged run's schedule, every running row reserved at "
              f"the longest running row's prompt + max_tokens; admitted: peak running sequences, padded: "
              f"budget // one row of {longest} tokens)", flush=True)
    return 0
