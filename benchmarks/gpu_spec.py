"""What a speculative verify step costs on the H200 against a plain decode
step, same engine, same rows (issue 21): random weights, where acceptance
means nothing, so the proposals are forced.

For each shape and batch size B (prompts of ``PROMPT`` random tokens, greedy,
EOS ignored) one engine runs, in turn:

- ``plain``: no proposer; every step decodes one token a row (CUDA graphs).
- ``reject k``: every row proposes k random tokens a step (acceptance ~0):
  each step is a verify step of ``1 + k`` queries a row emitting one token,
  replayed from the graphs an engine with ``--num-speculative-tokens k``
  captures.
- ``ragged k``: every row proposes 0 to k random tokens (prompt lookup's
  uneven proposals): with verify graphs the engine pads them to k, so the
  steps replay.
- ``oracle k``: every row proposes the k tokens the plain run emitted next
  (acceptance near 1 until a near-tie of bf16 makes the paths part).
- ``draft k`` (``DRAFT`` shapes only): a draft model of the target's
  vocabulary proposes, its one-token passes replayed as CUDA graphs, then
  eager (``enforce_eager``): the proposal's cost per step both ways.

Timed: ``STEPS`` steps from the third after every row has its first token, the host synced
by each step's sampling. Reports ms per step, tokens per step, ms per token
and the step's cost over the plain step (``step_ratio``): with acceptance a
per proposed token, a verify step emits ``(1 - a^(k+1)) / (1 - a)`` tokens,
so the speedup at ``a`` is that over ``step_ratio``.

Usage (repository root, GPU machine): PYTHONPATH=. python3 benchmarks/gpu_spec.py
(``SHAPES``, ``BATCHES``, ``KS``, ``PROMPT``, ``SPEC_STEPS``, ``PROFILE=1`` for a profile of the proposals on stderr, ``DEVICE=cpu`` with a tiny config for a smoke run).
"""

from __future__ import annotations

import cProfile
import dataclasses
import json
import os
import pstats
import random
import sys
import time

import torch

from pagedlm.batch.draft import DraftProposer
from pagedlm.batch.engine import LLMEngine
from pagedlm.batch.graphs import DecodeGraphs, capture_graphs
from pagedlm.bench.common import load_random
from pagedlm.options import resolve_engine_options
from pagedlm.params import SamplingParams

DEVICE = os.environ.get("DEVICE", "cuda")
SHAPES = os.environ.get("SHAPES", "gemma3-270m qwen3-0.6b llama-3.1-8b").split()
BATCHES = [int(b) for b in os.environ.get("BATCHES", "1 32").split()]
KS = [int(k) for k in os.environ.get("KS", "1 3 8").split()]
DRAFT = dict(pair.split("=") for pair in os.environ.get("DRAFT", "llama-3.1-8b=llama-3.2-1b").split())  # target shape: a draft shape of its vocabulary
PROMPT, STEPS = int(os.environ.get("PROMPT", "512")), int(os.environ.get("SPEC_STEPS", "48"))
DTYPE = torch.bfloat16 if DEVICE == "cuda" else torch.float32
BUDGET = int(os.environ.get("BUDGET", 8 << 30 if DEVICE == "cuda" else 64 << 20))


def folder(shape: str) -> str:
    return shape if os.path.isdir(shape) else os.path.join("benchmarks", "configs", shape)


class Forced:
    """A proposer of fixed guesses: k random tokens (``ragged``: 0 to k of
    them, as prompt lookup proposes), or the plain run's next k."""

    def __init__(self, k: int, vocab: int, futures: dict[int, list[int]] | None = None, ragged: bool = False) -> None:
        self.num_speculative_tokens, self.vocab, self.futures, self.ragged = k, vocab, futures, ragged
        self.rng = random.Random(0)

    def propose(self, rows):
        out = []
        for seq, k in rows:
            if self.futures is None:
                n = self.rng.randint(0, k) if self.ragged else k
                out.append([self.rng.randrange(self.vocab) for _ in range(n)])
            else:
                future = self.futures[tuple(seq.prompt_ids[:8])]
                at = len(seq.output_ids)
                out.append(future[at : at + k])
        return out

    def release(self, seq_id: int) -> None:
        pass


def verify_graphs(engine: LLMEngine, k: int) -> DecodeGraphs | None:
    """The graphs of verify steps of k proposed tokens a row, as an engine
    with ``--num-speculative-tokens k`` captures them (None without graphs)."""
    return capture_graphs(engine.model, engine.store, engine.options, engine.max_num_seqs, engine.max_model_len,
                          queries=1 + k)


def run(engine: LLMEngine, prompts: list[list[int]], max_tokens: int, proposer=None) -> dict:
    """Every prompt at once; the steps after all have a token timed."""
    engine.proposer = proposer
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
    seqs = [engine.add_request(p, params)[0] for p in prompts]
    while not all(s.output_ids for s in seqs):
        engine.step()
    for _ in range(2):  # a draft catches up with the prompts here
        engine.step()
    spent, before = 0.0, sum(len(s.output_ids) for s in seqs)
    stats0 = dataclasses.replace(engine.spec_stats)
    clock = _clock(proposer)
    t0, steps = time.perf_counter(), 0
    while steps < STEPS and engine.has_unfinished():
        engine.step()
        steps += 1
    elapsed = time.perf_counter() - t0
    if clock is not None and clock.profile is not None:  # PROFILE=1: where the proposals' time went
        pstats.Stats(clock.profile, stream=sys.stderr).sort_stats("cumtime").print_stats(25)
    spent = clock.seconds if clock else 0.0
    tokens = sum(len(s.output_ids) for s in seqs) - before
    if proposer is not None:  # the plain run goes to the end: its outputs are the oracle's
        for s in seqs:
            engine.abort(s)
    while engine.has_unfinished():
        engine.step()
    stats = engine.spec_stats.since(stats0)
    engine.proposer = None
    return {"steps": steps, "ms_per_step": round(1000 * elapsed / steps, 4),
            "tokens_per_step": round(tokens / steps, 3), "ms_per_token": round(1000 * elapsed / tokens, 4),
            "propose_ms_per_step": round(1000 * spent / steps, 4), "acceptance": round(stats.acceptance_rate, 3),
            "verify_graphs": engine.verify_graphs is not None,
            "outputs": {tuple(s.prompt_ids[:8]): list(s.output_ids) for s in seqs}}


def _clock(proposer):
    """Seconds in ``proposer.propose`` (None without one)."""
    if proposer is None:
        return None
    inner = proposer.propose

    class Clock:
        seconds = 0.0

    profile = cProfile.Profile() if os.environ.get("PROFILE") else None

    def timed(rows):
        t = time.perf_counter()
        try:
            return inner(rows) if profile is None else profile.runcall(inner, rows)
        finally:
            Clock.seconds += time.perf_counter() - t

    Clock.profile = profile

    proposer.propose = timed
    return Clock


def main() -> None:
    for shape in SHAPES:
        model, tokenizer = load_random(folder(shape), DEVICE, DTYPE)
        vocab = int(model.args.vocab_size)
        options = resolve_engine_options({"max_num_seqs": max(BATCHES), "max_model_len": PROMPT + 4 * STEPS + 64,
                                          "kv_budget_bytes": BUDGET},  # room left for a draft's pools
                                         environ={}, device=DEVICE)  # the device's defaults: paged, kernels, graphs
        engine = LLMEngine(model, tokenizer, options)
        if DEVICE == "cuda" and engine.graphs is None:
            raise SystemExit(f"{shape}: no CUDA graphs ({engine.attention_backend}, paged {engine.paged_kv})")
        draft = None
        if shape in DRAFT:
            draft, _ = load_random(folder(DRAFT[shape]), DEVICE, DTYPE)
        g = torch.Generator().manual_seed(0)
        for batch in BATCHES:
            prompts = [torch.randint(0, vocab, (PROMPT,), generator=g).tolist() for _ in range(batch)]
            max_tokens = 3 * STEPS
            base = {"shape": shape, "batch": batch, "prompt": PROMPT, "device": DEVICE,
                    "dtype": str(DTYPE).removeprefix("torch."), "store": "paged" if engine.paged_kv else "default",
                    "backend": engine.attention_backend, "graphs": engine.graphs is not None}
            run(engine, prompts, 8)  # warm-up: kernels compiled for these shapes
            plain = run(engine, prompts, max_tokens)
            rows = [{"name": "plain", "k": 0, **plain}]
            for k in KS:
                engine.verify_graphs = verify_graphs(engine, k)
                rows.append({"name": f"reject {k}", "k": k, **run(engine, prompts, max_tokens, Forced(k, vocab))})
                rows.append({"name": f"oracle {k}", "k": k,
                             **run(engine, prompts, max_tokens, Forced(k, vocab, plain["outputs"]))})
                rows.append({"name": f"ragged {k}", "k": k,
                             **run(engine, prompts, max_tokens, Forced(k, vocab, ragged=True))})
            if draft is not None:
                k = max(KS) // 2 or 1
                engine.verify_graphs = verify_graphs(engine, k)
                for eager in (False, True):
                    proposer = DraftProposer(draft, k, vocab, engine.layout,
                                             dataclasses.replace(options, enforce_eager=eager), engine.max_model_len,
                                             engine.max_num_batched_tokens, engine.max_num_seqs)
                    run(engine, prompts, 16, proposer)  # warm-up: the draft's kernels compile untimed
                    row = run(engine, prompts, max_tokens, proposer)
                    rows.append({"name": f"draft {k} {'eager' if eager else 'graphs'}", "k": k,
                                 "draft": DRAFT[shape], "draft_graphs": proposer.graphs is not None, **row})
                    del proposer
            engine.verify_graphs = None
            for row in rows:
                row.pop("outputs")
                row["step_ratio"] = round(row["ms_per_step"] / plain["ms_per_step"], 3)
                print(json.dumps({**base, **row}), flush=True)
        del engine, model, draft
        if DEVICE == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
