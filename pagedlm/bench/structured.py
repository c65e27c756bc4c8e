"""`pagedlm bench throughput --json-schema FILE`: what grammar masks cost a step.

For each batch size B of ``--structured-batch-sizes`` (default 1, 16, 64) the
same B prompts (each gives the schema's text and asks for one JSON object
valid against it, numbered so that no two are the same) run on one
engine, alternately with every row constrained to the schema and
unconstrained, ``--repeats`` times each; medians are reported. Constrained
rows generate up to ``--structured-max-tokens`` tokens and end when
their grammar completes, greedily or, with ``--structured-temperature``,
sampled without a seed (as their twins are). With random weights the model
all but ignores its prompt: greedy rows write a handful of texts between
them (6 distinct of 64 in a run on a CPU), so their grammars meet each costly
state together, the lanes filling the same mask at once; sampled rows
differ, as the requests of many clients do; each unconstrained row then generates exactly as
many tokens as its constrained twin did, end-of-sequence ignored. So both
runs have the same rows, lengths and steps, and differ by the masks alone
(a run to a fixed length would time the unconstrained rows over longer
contexts). A warm-up on the same engine first runs the largest batch a few
tokens, unconstrained and constrained: it compiles the grammar (and builds
llguidance's tokenizer), so no compile is timed (the engine's LRU serves
every later row), and meets that batch's first costs (every lane's first
states, a kernel's first launch at that size) outside the timed runs.

Timed: the decode steps, from the step after every row has its first token
to the last (prefill is reported apart: ``prefill_steps``, ``prefill_s``), by
driving `LLMEngine` in-process. Unless ``--max-num-batched-tokens`` is given,
the engine's token budget holds the largest batch's prompts, so that each
batch prefills in one step and decodes all its rows together. ``kernel_compiles_in_runs``: the Triton kernels each run compiled in
those steps (a compile there costs about a second: the run's figures are
then not the step's). A row's ``ms_per_step`` is those seconds over
those steps; ``mean_batch`` the tokens they sampled over the steps (below B
once constrained rows finish early); ``sample_ms_per_step`` the part spent in
`pagedlm.sampling.sample`, where the masks are filled and applied (on CUDA,
waiting for the step's logits too: nothing synchronizes for the clock), and
``mask_fill_ms_per_step`` the time the step spends in `fill_bitmask`: filling
the bitmasks, or waiting for what is left of the fill the engine started on
a background thread as the previous step ended (on CUDA), which overlaps
the host's step and the device's. The
constrained row gains ``mask_overhead``: its ms per step over the
unconstrained row's, minus 1, run by run (each pair back to back), the
median of ``all_mask_overhead``; and ``sample_overhead_share``: the extra
sampling time per step over the unconstrained step, the masks' cost less
the machine's noise (it leaves out the grammar's advance by each token,
outside `sample`).
"""

from __future__ import annotations

import contextlib
import json
import math
import platform
import statistics
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from .. import options as opt
from .. import structured as structured_module
from ..batch import engine as engine_module
from ..batch.engine import LLMEngine
from ..params import SamplingParams
from .common import kernel_compiles, load_for_bench

DEFAULT_BATCH_SIZES = (1, 16, 64)
DEFAULT_MAX_TOKENS = 64


@dataclass
class BatchRun:
    """One timed batch: its decode steps and what each row wrote."""

    decode_s: float
    decode_steps: int
    decode_tokens: int  # tokens sampled in the decode steps
    sample_s: float  # of decode_s, inside `sample`
    fill_s: float  # of sample_s, filling grammar bitmasks
    prefill_s: float
    prefill_steps: int
    output_tokens: int
    preemptions: int
    output_lengths: list[int]
    texts: list[str]
    finish_reasons: list[str | None]
    compiles: int = 0  # Triton kernels compiled inside its decode steps (`kernel_compiles`)

    @property
    def ms_per_step(self) -> float:
        return 1000 * self.decode_s / self.decode_steps if self.decode_steps else 0.0


class _Clock:
    """Adds up the seconds spent in ``module.name`` while active: the callers
    look the name up at call time (the engine calls `sample` by the name it
    imported; `sample` imports `fill_bitmask` when a step has a grammar), so
    that name is swapped, and put back on exit. Nothing synchronizes: on
    CUDA, `sample` includes waiting for the step's logits, and the masks'
    fill, host work before that wait, overlaps the device's step."""

    def __init__(self, module, name: str) -> None:
        self.seconds = 0.0
        self._module, self._name = module, name
        self._inner = getattr(module, name)

    def _timed(self, *args):
        t0 = time.perf_counter()
        try:
            return self._inner(*args)
        finally:
            self.seconds += time.perf_counter() - t0

    def __enter__(self) -> "_Clock":
        setattr(self._module, self._name, self._timed)
        return self

    def __exit__(self, *exc) -> None:
        setattr(self._module, self._name, self._inner)


def run_batch(engine: LLMEngine, requests: list[tuple[list[int], SamplingParams]], timed: bool = True) -> BatchRun:
    """Run ``requests`` (prompt ids, params) at once to the end; time the decode steps apart from the prefill.
    ``timed``: the kernels its decode steps compile are counted (and each said on stderr); a warm-up's are not."""
    preempted = engine.num_preemptions
    seqs = [engine.add_request(ids, params)[0] for ids, params in requests]
    with _Clock(engine_module, "sample") as clock, _Clock(structured_module, "fill_bitmask") as fill:
        t0, s0 = time.perf_counter(), engine.num_steps
        while engine.has_unfinished() and not all(s.output_ids or s.is_finished for s in seqs):
            engine.step()
        t1, s1 = time.perf_counter(), engine.num_steps
        before, clock.seconds, fill.seconds = sum(len(s.output_ids) for s in seqs), 0.0, 0.0
        with kernel_compiles() if timed else contextlib.nullcontext([]) as compiled:
            while engine.has_unfinished():
                engine.step()
        t2 = time.perf_counter()
    produced = sum(len(s.output_ids) for s in seqs)
    return BatchRun(decode_s=t2 - t1, decode_steps=engine.num_steps - s1, decode_tokens=produced - before,
                    sample_s=clock.seconds, fill_s=fill.seconds, prefill_s=t1 - t0, prefill_steps=s1 - s0, output_tokens=produced,
                    preemptions=engine.num_preemptions - preempted,
                    output_lengths=[len(s.output_ids) for s in seqs], texts=[s.text for s in seqs],
                    finish_reasons=[s.finish_reason for s in seqs], compiles=len(compiled))


def make_prompts(tokenizer, schema: dict, n: int) -> list[list[int]]:
    """``n`` different requests for one JSON object valid against ``schema``
    (through the chat template, when the tokenizer has one)."""
    prompts = []
    for i in range(n):
        text = (f"A JSON schema:\n{json.dumps(schema)}\n"  # first: a prefix cache can share it
                f"Write example number {i + 1} of a JSON object valid against it, and nothing else.")
        if getattr(tokenizer, "chat_template", None):
            prompts.append(tokenizer.encode_chat([{"role": "user", "content": text}]))
        else:
            prompts.append(tokenizer.encode(text))
    return prompts


def _one_step_prefill(options: opt.EngineOptions, prompts: list[list[int]], device: str) -> opt.EngineOptions:
    """Unless ``--max-num-batched-tokens`` says otherwise, a token budget
    that prefills all ``prompts`` in one step, uncapped: every row then
    decodes from the same step on. (Prefilled in chunks, the first rows of
    64 were nearly done when the last began: "batch 64" decoded 36 rows.)"""
    if options.max_num_batched_tokens is not None:
        return options
    default = opt.DEVICE_DEFAULTS["cuda" if device.startswith("cuda") else "cpu"]["max_num_batched_tokens"]
    threshold = options.long_prefill_token_threshold
    return replace(options, max_num_batched_tokens=max(default, sum(map(len, prompts))),
                   long_prefill_token_threshold=0 if threshold is None else threshold)


def _check(args) -> None:
    if args.against is not None:
        raise opt.OptionError("--json-schema measures pagedlm's masks alone: not with --against")
    if args.random_weights and not (Path(args.model or "") / "tokenizer.json").is_file():
        raise opt.OptionError("--json-schema needs a tokenizer (grammars are compiled over its vocabulary): "
                              "with --random-weights, a tokenizer.json in the config's folder")
    temperature = args.structured_temperature
    if temperature is not None and not (math.isfinite(temperature) and temperature >= 0):
        raise opt.OptionError(f"--structured-temperature must be a finite number >= 0 (got {temperature})")


def run_structured_bench(args, engine_options: opt.EngineOptions, constraint) -> int:
    """The rows of ``bench throughput --json-schema`` for a validated ``constraint``."""
    _check(args)
    batch_sizes = args.structured_batch_sizes or list(DEFAULT_BATCH_SIZES)
    max_tokens = args.structured_max_tokens or DEFAULT_MAX_TOKENS
    model, tokenizer, device, dtype, spec = load_for_bench(args)
    prompts = make_prompts(tokenizer, constraint.json, max(batch_sizes))
    engine = LLMEngine(model, tokenizer, _one_step_prefill(engine_options, prompts, device))
    if max(batch_sizes) > engine.max_num_seqs:
        raise opt.OptionError(f"--structured-batch-sizes {max(batch_sizes)} exceeds the engine's "
                              f"--max-num-seqs ({engine.max_num_seqs}): that batch would not run as one")
    temperature = args.structured_temperature or 0.0
    constrained = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=temperature,
                                 structured_outputs=constraint)
    for warm in (None, constraint):  # the second compiles the grammar: no timed row waits for it
        run_batch(engine, [(ids, replace(constrained, max_tokens=4, structured_outputs=warm))
                           for ids in prompts[:max(batch_sizes)]], timed=False)
    base = {"model": spec, "device": device, "dtype": str(dtype).removeprefix("torch."),
            "schema": args.json_schema, "max_tokens": max_tokens, "temperature": temperature,
            "repeats": args.repeats,
            "store": "paged" if engine.paged_kv else "default", "attention_backend": engine.attention_backend,
            "max_num_batched_tokens": engine.max_num_batched_tokens,
            "threads": torch.get_num_threads(), "machine": platform.machine()}
    interrupted = False
    try:
        for batch in batch_sizes:
            runs: dict[bool, list[BatchRun]] = {False: [], True: []}
            for _ in range(args.repeats):  # interleaved, run by run
                run = run_batch(engine, [(ids, constrained) for ids in prompts[:batch]])
                runs[True].append(run)
                twins = [(ids, replace(constrained, max_tokens=max(1, n), structured_outputs=None))
                         for ids, n in zip(prompts, run.output_lengths)]
                runs[False].append(run_batch(engine, twins))
            for row in _rows(base, batch, runs, engine.grammars.compiles):
                _print(row, args.json)
    except KeyboardInterrupt:  # a time limit: the batch sizes done are printed
        interrupted = True
        _print({**base, "interrupted": True}, args.json)
    return 130 if interrupted else 0


def _median(runs: list[BatchRun]) -> BatchRun:
    ordered = sorted(runs, key=lambda r: r.ms_per_step)
    return ordered[(len(ordered) - 1) // 2]


def _rows(base: dict, batch: int, runs: dict[bool, list[BatchRun]], compiles: int) -> list[dict]:
    rows = []
    for structured in (False, True):
        r = _median(runs[structured])
        row = {"name": "structured-json" if structured else "unconstrained", **base, "structured": structured,
               "batch": batch, "ms_per_step": round(r.ms_per_step, 4), "steps": r.decode_steps,
               "output_tokens": r.output_tokens,
               "mean_batch": round(r.decode_tokens / r.decode_steps, 2) if r.decode_steps else 0.0,
               "sample_ms_per_step": round(1000 * r.sample_s / r.decode_steps, 3) if r.decode_steps else 0.0,
               "sample_share": round(r.sample_s / r.decode_s, 4) if r.decode_s else 0.0,
               "mask_fill_ms_per_step": round(1000 * r.fill_s / r.decode_steps, 4) if r.decode_steps else 0.0,
               "prefill_steps": r.prefill_steps, "prefill_s": round(r.prefill_s, 3), "preemptions": r.preemptions,
               "all_ms_per_step": [round(x.ms_per_step, 4) for x in runs[structured]],
               "kernel_compiles_in_runs": [x.compiles for x in runs[structured]]}
        if structured:
            free = rows[0]
            # Run by run: each pair ran back to back, under the same load from the rest of the machine.
            paired = [c.ms_per_step / u.ms_per_step - 1 for c, u in zip(runs[True], runs[False]) if u.ms_per_step]
            row["mask_overhead"] = round(statistics.median(paired), 4) if paired else None
            row["all_mask_overhead"] = [round(x, 4) for x in paired]
            row["sample_overhead_ms"] = round(row["sample_ms_per_step"] - free["sample_ms_per_step"], 3)
            row["sample_overhead_share"] = (round(row["sample_overhead_ms"] / free["ms_per_step"], 4)
                                            if free["ms_per_step"] else None)
            finished = [t for t, f in zip(r.texts, r.finish_reasons) if f == "stop"]
            row["grammar_finished"] = len(finished)  # rows the grammar ended, the rest ran to max_tokens
            row["json_parsed"] = sum(_parses(t) for t in finished)
            row["grammar_errors"] = sum(f == "error" for f in r.finish_reasons)
            row["grammar_compiles"] = compiles
        rows.append(row)
    return rows


def _parses(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def _print(row: dict, as_json: bool) -> None:
    if as_json:
        print(json.dumps(row), flush=True)
    elif "interrupted" in row:
        print("interrupted", flush=True)
    else:
        line = (f"{row['name']:16s} batch {row['batch']:3d}: {row['ms_per_step']:.2f} ms/step over "
                f"{row['steps']} decode steps (mean batch {row['mean_batch']}), sampling "
                f"{row['sample_ms_per_step']:.2f} ms/step")
        if row["structured"]:
            overhead = row["mask_overhead"]
            line += (f" | mask overhead {100 * overhead:+.1f}%" if overhead is not None else "")
            line += f" | {row['json_parsed']}/{row['grammar_finished']} finished rows parse as JSON"
        print(line, flush=True)
