"""`pagedlm bench prefix`: what block-level prefix caching buys on the paged store.

Three measurements, each with prefix caching on and off on the same weights
in one process (random token ids, seeded; end-of-sequence ignored):

- ``shared``: ``--num-requests`` requests sharing a ``--prefix-len``-token
  system prompt, each with its own ``--question-len``-token question, all
  added at once, each generating ``--max-tokens``. Reported: KV bytes at the
  peak (the pool's blocks in use, and everything including sliding layers'
  ring buffers), the pool bytes one copy of the prefix plus every request's
  own tokens would take (``one_copy_pool_bytes``), time to first token of
  each request from the moment all were added (mean, median, max), the
  prompt tokens computed, and the total time.
- ``single``: one request alone, cold (a prefix never seen) and then on a
  full prefix hit (the same prefix, a new question): time to first token of
  each, median of ``--repeats`` prefixes, and their ratio.
- ``chat``: a ``--turns``-turn conversation (token ids, no chat template):
  a ``--chat-system-len``-token system prompt, then per turn a
  ``--question-len``-token user message and a ``--reply-len``-token reply,
  each prompt the whole conversation so far. Per turn: prompt tokens, the
  prefill tokens computed, time to first token.

The KV budget defaults to what every shared request needs without sharing,
so that neither run preempts.
"""

from __future__ import annotations

import dataclasses
import json
import platform
import random
import statistics
import time

from .. import options as opt
from ..batch.engine import LLMEngine, model_context_length
from ..params import SamplingParams
from .common import load_for_bench, refuse_given


def _engine(model, tokenizer, options: opt.EngineOptions, caching: bool) -> LLMEngine:
    paged = dataclasses.replace(options.paged_kv, prefix_caching=caching)
    return LLMEngine(model, tokenizer, dataclasses.replace(options, paged_kv=paged))


def _first_token_s(engine, ids: list[int], max_tokens: int = 1):
    """Run one request alone: (its sequence, seconds from add to first token)."""
    t0 = time.perf_counter()
    (seq,) = engine.add_request(ids, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    return seq, seq.first_token_at - t0


def _shared(engine, prefix: list[int], questions: list[list[int]], max_tokens: int) -> dict:
    per_block = engine.cache_stats().block_bytes
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    seqs = [engine.add_request(prefix + q, params)[0] for q in questions]
    peak_blocks = peak_refs = peak_all = 0
    while engine.has_unfinished():
        engine.step()
        peak_blocks = max(peak_blocks, engine.cache_stats().blocks_used)
        peak_refs = max(peak_refs, engine.cache_stats().block_refs)
        peak_all = max(peak_all, engine.kv_usage().allocated)
    total = time.perf_counter() - t0
    ttft = [s.first_token_at - t0 for s in seqs]
    return {"kv_pool_bytes_peak": peak_blocks * per_block, "kv_bytes_peak": peak_all,
            "kv_pool_bytes_unshared_peak": peak_refs * per_block,  # the same tables, each block counted per holder
            "ttft_mean_s": round(statistics.mean(ttft), 4), "ttft_median_s": round(statistics.median(ttft), 4),
            "ttft_max_s": round(max(ttft), 4), "total_s": round(total, 3),
            "prompt_tokens_computed": sum(s.num_prompt - s.num_cached for s in seqs),
            "preemptions": engine.num_preemptions}


def _print(row: dict, as_json: bool) -> None:
    if as_json:
        print(json.dumps(row), flush=True)
    elif row["name"] == "shared":
        print(f"shared  caching {'on ' if row['prefix_caching'] else 'off'}: KV pool peak "
              f"{row['kv_pool_bytes_peak'] / 2**20:8.1f} MiB (all KV {row['kv_bytes_peak'] / 2**20:8.1f} MiB), "
              f"TTFT mean {row['ttft_mean_s']:.3f} s median {row['ttft_median_s']:.3f} s, "
              f"total {row['total_s']:.2f} s, prompt tokens computed {row['prompt_tokens_computed']}", flush=True)
    elif row["name"] == "single":
        print(f"single: TTFT cold {row['ttft_cold_s']:.4f} s, full prefix hit {row['ttft_hit_s']:.4f} s "
              f"({100 * row['ttft_hit_vs_cold']:.1f}% of cold)", flush=True)
    else:
        print(f"chat caching {'on ' if row['prefix_caching'] else 'off'} turn {row['turn']:2d}: prompt "
              f"{row['prompt_tokens']:5d} tokens, computed {row['prefill_tokens_computed']:5d}, "
              f"TTFT {row['ttft_s']:.3f} s", flush=True)


def run_prefix_bench(args, engine_options: opt.EngineOptions) -> int:
    refuse_given(args, engine_options, "prefix", "runs the paged store with prefix caching on and off, at one KV "
                 "budget (--kv-budget-bytes, else what its requests need)", paged=True, caching=True)
    model, tokenizer, device, dtype, spec = load_for_bench(args)
    paged = engine_options.paged_kv or opt.PagedKvOptions()
    specs = model.kv_spec()
    token_bytes = sum(2 * s.num_kv_heads * s.head_dim * dtype.itemsize for s in specs)  # every layer pooled
    longest = max(args.prefix_len + args.question_len + args.max_tokens,
                  args.chat_system_len + args.turns * (args.question_len + args.reply_len))
    if engine_options.max_model_len is None and longest > (context := model_context_length(model)):
        raise opt.OptionError(f"the longest request ({longest} tokens: --prefix-len + --question-len + "
                              f"--max-tokens, or --chat-system-len + --turns x (--question-len + --reply-len)) "
                              f"exceeds the model's context ({context} tokens)")
    budget = engine_options.kv_budget_bytes or token_bytes * (longest + paged.block_size) * max(args.num_requests, 2)
    options = dataclasses.replace(engine_options, paged_kv=paged, kv_budget_bytes=budget, gpu_memory_fraction=None,
                                  max_model_len=engine_options.max_model_len or longest)

    rng = random.Random(args.seed)
    top = min(10000, model.args.vocab_size)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(top) for _ in range(n)]

    prefix = tokens(args.prefix_len)
    questions = [tokens(args.question_len) for _ in range(args.num_requests)]
    base = {"model": spec, "random_weights": bool(args.random_weights), "device": device,
            "dtype": str(dtype).removeprefix("torch."), "block_size": paged.block_size, "kv_budget_bytes": budget,
            "machine": platform.machine(), "date": time.strftime("%Y-%m-%d")}
    shared = {}
    for caching in (True, False):
        engine = _engine(model, tokenizer, options, caching)
        _first_token_s(engine, tokens(16), max_tokens=2)  # warm-up
        shared[caching] = _shared(engine, prefix, questions, args.max_tokens)
        if caching:
            one_copy = args.prefix_len + args.num_requests * (args.question_len + args.max_tokens)
            per_token = engine.cache_stats().block_bytes // paged.block_size
            shared[caching]["one_copy_pool_bytes"] = one_copy * per_token
        del engine
    on, off = shared[True], shared[False]
    rows = [{"name": "shared", "prefix_caching": caching, **base, "num_requests": args.num_requests,
             "prefix_len": args.prefix_len, "question_len": args.question_len, "max_tokens": args.max_tokens, **row}
            for caching, row in shared.items()]
    rows[0].update({
        "pool_bytes_vs_one_copy": round(on["kv_pool_bytes_peak"] / on["one_copy_pool_bytes"], 3),
        "kv_bytes_peak_ratio_vs_off": round(on["kv_bytes_peak"] / off["kv_bytes_peak"], 3),
        "ttft_mean_ratio_vs_off": round(on["ttft_mean_s"] / off["ttft_mean_s"], 3),
        "total_ratio_vs_off": round(on["total_s"] / off["total_s"], 3)})
    for row in rows:
        _print(row, args.json)
    if not args.json:
        print(f"(one copy of the prefix plus every request's own tokens: "
              f"{on['one_copy_pool_bytes'] / 2**20:.1f} MiB of pool; caching on/off: KV peak "
              f"x{rows[0]['kv_bytes_peak_ratio_vs_off']}, TTFT mean x{rows[0]['ttft_mean_ratio_vs_off']}, "
              f"total x{rows[0]['total_ratio_vs_off']})", flush=True)

    engine = _engine(model, tokenizer, options, True)
    _first_token_s(engine, tokens(16), max_tokens=2)
    cold, hit = [], []
    for _ in range(args.repeats):
        p = tokens(args.prefix_len)
        cold.append(_first_token_s(engine, p + tokens(args.question_len))[1])
        seq, seconds = _first_token_s(engine, p + tokens(args.question_len))
        assert seq.num_cached >= args.prefix_len // paged.block_size * paged.block_size, "no full prefix hit"
        hit.append(seconds)
    _print({"name": "single", **base, "prefix_len": args.prefix_len, "question_len": args.question_len,
            "repeats": args.repeats, "ttft_cold_s": round(statistics.median(cold), 4),
            "ttft_hit_s": round(statistics.median(hit), 4),
            "ttft_hit_vs_cold": round(statistics.median(hit) / statistics.median(cold), 3)}, args.json)
    del engine

    system = tokens(args.chat_system_len)
    users = [tokens(args.question_len) for _ in range(args.turns)]
    for caching in (True, False):
        engine = _engine(model, tokenizer, options, caching)
        _first_token_s(engine, tokens(16), max_tokens=2)
        history = system
        for turn, user in enumerate(users, 1):
            seq, seconds = _first_token_s(engine, history + user, max_tokens=args.reply_len)
            history = seq.tokens
            _print({"name": "chat", "prefix_caching": caching, **base, "turn": turn,
                    "prompt_tokens": seq.num_prompt, "prefill_tokens_computed": seq.num_prompt - seq.num_cached,
                    "ttft_s": round(seconds, 4)}, args.json)
        del engine

    return 0
