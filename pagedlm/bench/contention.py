"""`pagedlm bench contention`: short requests' time to first token beside a long prompt.

Drives `LLMEngine` in-process (no HTTP), on one engine and the same weights:

- ``idle``: ``--num-short`` short prompts (``--short-len`` random token ids
  each, ``--short-min-tokens``..``--short-max-tokens`` output tokens, seeded)
  added at once to an idle engine;
- ``contended``: a ``--long-len``-token prompt is added and runs one step
  alone, then as many short requests (other ids, the same lengths) are
  added. Reported: the short requests' time to first token, p50 and p99,
  in engine steps from their arrival and in seconds, the same for the idle
  run, their ratio, and the long prompt's own time to first token.

With ``--long-alone`` the long prompt also runs alone, for its TTFT
without company. The scheduler's bound (``docs/design/batching.md``): a
short prompt that fits in the budget the capped prefill leaves samples its
first token in the first step scheduled after it arrives; the rest of the
32 follow as fast as the token budget admits them.
"""

from __future__ import annotations

import json
import platform
import random
import statistics
import time

import torch

from .. import options as opt
from ..batch.engine import LLMEngine
from ..params import SamplingParams
from .common import load_for_bench


def _percentile(values: list[float], q: float) -> float:
    """The nearest-rank ``q`` percentile."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, -(-len(ordered) * q // 100) - 1))]


def _ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(vocab) for _ in range(n)]


def _shorts(args, rng: random.Random, vocab: int) -> list[tuple[list[int], SamplingParams]]:
    return [(_ids(rng, args.short_len, vocab),
             SamplingParams(max_tokens=rng.randint(args.short_min_tokens, args.short_max_tokens),
                                ignore_eos=True))
            for _ in range(args.num_short)]


def _add(engine, requests) -> list[tuple[object, float, int]]:
    """Add ``requests`` now: (sequence, arrival time, arrival step) each."""
    t0, s0 = time.perf_counter(), engine.num_steps
    return [(engine.add_request(ids, params)[0], t0, s0) for ids, params in requests]


def _step(engine, arrivals, firsts: dict, until_done: bool = True) -> None:
    """Step (once, or until nothing is left), recording for each arrival the
    steps and seconds from its arrival to its first token."""
    while engine.has_unfinished():
        engine.step()
        for seq, t0, s0 in arrivals:
            if seq.first_token_at is not None and seq.seq_id not in firsts:
                firsts[seq.seq_id] = (engine.num_steps - s0, seq.first_token_at - t0)
        if not until_done:
            return


def _run(engine, requests) -> list[tuple[int, float]]:
    arrivals, firsts = _add(engine, requests), {}
    _step(engine, arrivals, firsts)
    return [firsts[seq.seq_id] for seq, _, _ in arrivals]


def _summary(firsts: list[tuple[int, float]]) -> dict:
    steps, seconds = [s for s, _ in firsts], [t for _, t in firsts]
    return {"ttft_steps_p50": _percentile(steps, 50), "ttft_steps_p99": _percentile(steps, 99),
            "ttft_steps_max": max(steps),
            "ttft_s_p50": round(_percentile(seconds, 50), 4), "ttft_s_p99": round(_percentile(seconds, 99), 4),
            "ttft_s_mean": round(statistics.fmean(seconds), 4)}


def run_contention_bench(args, engine_options: opt.EngineOptions) -> int:
    if args.short_min_tokens > args.short_max_tokens:
        raise opt.OptionError("--short-min-tokens must be <= --short-max-tokens")
    model, tokenizer, device, dtype, spec = load_for_bench(args)
    engine = LLMEngine(model, tokenizer, engine_options)
    if args.long_len + args.long_max_tokens > engine.max_model_len:
        raise opt.OptionError(f"--long-len {args.long_len} plus --long-max-tokens {args.long_max_tokens} exceeds "
                              f"max_model_len ({engine.max_model_len})")
    vocab = int(model.args.vocab_size)
    rng = random.Random(args.seed)
    long = (_ids(rng, args.long_len, vocab), SamplingParams(max_tokens=args.long_max_tokens, ignore_eos=True))
    _run(engine, [(_ids(random.Random(-1), 8, vocab), SamplingParams(max_tokens=2))])  # warm-up
    idle = _summary(_run(engine, _shorts(args, rng, vocab)))

    contended_shorts = _shorts(args, rng, vocab)
    arrivals, firsts = _add(engine, [long]), {}
    _step(engine, arrivals, firsts, until_done=False)  # the long prompt arrives first and runs a step alone
    shorts = _add(engine, contended_shorts)
    _step(engine, arrivals + shorts, firsts)
    contended = _summary([firsts[seq.seq_id] for seq, _, _ in shorts])
    long_steps, long_s = firsts[arrivals[0][0].seq_id]
    row = {
        "bench": "contention", "model": spec, "device": device, "dtype": str(dtype).removeprefix("torch."),
        "paged_kv": engine.paged_kv, "random_weights": bool(args.random_weights),
        "max_num_batched_tokens": engine.max_num_batched_tokens,
        "long_prefill_token_threshold": engine.long_prefill_token_threshold,
        "max_num_partial_prefills": engine_options.max_num_partial_prefills,
        "long_len": args.long_len, "num_short": args.num_short, "short_len": args.short_len,
        "short_tokens": [args.short_min_tokens, args.short_max_tokens],
        "idle": idle, "contended": contended,
        "p99_ttft_s_ratio": round(contended["ttft_s_p99"] / idle["ttft_s_p99"], 2) if idle["ttft_s_p99"] else None,
        "long_ttft_steps": long_steps, "long_ttft_s": round(long_s, 4),
        "threads": torch.get_num_threads(), "machine": platform.machine(), "date": time.strftime("%Y-%m-%d"),
    }
    if args.long_alone:  # other ids of the same length: a cached prefix of the first would answer at once
        alone = (_ids(rng, args.long_len, vocab), long[1])
        ((steps, seconds),) = _run(engine, [alone])
        row["long_alone_ttft_steps"], row["long_alone_ttft_s"] = steps, round(seconds, 4)
    if args.json:
        print(json.dumps(row))
    else:
        _print(row)
    return 0


def _print(row: dict) -> None:
    store = "paged" if row["paged_kv"] else "default"
    print(f"contention: {row['model']} on {row['device']} ({store} store), a {row['long_len']}-token prompt, "
          f"then {row['num_short']} x {row['short_len']}-token requests a step later "
          f"(budget {row['max_num_batched_tokens']} tokens/step, long-prefill cap "
          f"{row['long_prefill_token_threshold']}, partial prefills {row['max_num_partial_prefills']})")
    for name in ("idle", "contended"):
        r = row[name]
        print(f"  short TTFT {name:9s}: p50 {r['ttft_steps_p50']} steps / {r['ttft_s_p50']:.3f} s, "
              f"p99 {r['ttft_steps_p99']} steps / {r['ttft_s_p99']:.3f} s (max {r['ttft_steps_max']} steps)")
    print(f"  p99 contended / idle: {row['p99_ttft_s_ratio']}x")
    print(f"  long prompt TTFT: {row['long_ttft_steps']} steps / {row['long_ttft_s']} s" + (
        f" (alone: {row['long_alone_ttft_steps']} steps / {row['long_alone_ttft_s']} s)"
        if "long_alone_ttft_s" in row else ""))
