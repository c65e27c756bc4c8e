"""Where a grammar step's time goes in the engine: `pagedlm bench ...` run
in this process with counters added, printed as one JSON line at exit after
the bench's own rows:

- ``fill_rows_ms``: `structured.matcher._fill_live` calls (llguidance's
  fill) by thread (the step's own, or the background prefetch: of a
  synchronous step, or of an async step whose pick it defers) and live row
  count: how many, and their median ms; ``PREFETCH=0`` in the environment
  turns the engine's ``prefetch_masks`` (on by default on CUDA), and so
  the deferred pick, off, ``PREFETCH=1`` on (on the CPU, with
  ``PAGEDLM_ASYNC_SCHEDULING=1``: the CUDA path's host work, its parts
  timed by ``PARTS=1``, without a device to overlap);
- ``parts_ms``: with ``PARTS=1``, the host's parts of the steps that had
  grammar rows (perf_counter around each engine call named: how many a
  step, median ms a call; ``step`` is the whole engine step);
  ``chain`` is the host's critical chain of a deferred pick: from a
  step's `_land` (the token in flight read; on CUDA the device runs the
  step just launched) until the next step's `grammar_masks` returns (its
  masks in hand: the pick launches), the landing, the step's end and the
  next step's scheduling and preparation on the way; ``plain_parts_ms``
  the same calls in the other steps of 64 rows (how many, median ms),
  the unconstrained rows' host work; ``steps64`` each grammar step of 64
  rows, its parts' ms (``names``: ``fill`` the background fill its masks
  came from) and their median, mean, 90th percentile and largest
  (``spread``): which part a slow step's time went to;
- ``step_ms``: those whole steps' median, mean, 90th percentile and
  largest (a median below the bench's mean ms a step: a few slow steps);
  ``plain_step_ms`` the same of the steps without grammar rows (the
  unconstrained runs' and the prefills: whether a tail is the grammar's);
- ``gc_ms``: Python's cyclic collections during them, by generation: how
  many, and their ms in all;
- with ``LANES=N``: N lanes (compiles of a grammar, threads that fill a
  step's masks) instead of the engine's default (half the cores, at most
  8);
- with ``SWITCH=S``: the engine's GIL switch interval S seconds instead of
  `matcher.GIL_SWITCH_S` (0.0001; Python's default is 0.005);
- with ``NO_FORCING=1``: llguidance's forcing off in every grammar
  (``no_forcing``: no call of the tokenizer's Python from the fill's
  threads; ``tokenize_calls`` counts those calls either way);
- with ``PROFILE=FILE``: the step thread's Python under `cProfile` in the
  steps of 64 running rows, those with grammar rows and those without
  apart, as two `pstats` tables (by own time, then by time inside) in FILE;
- with ``TRACE=FILE``: a `torch.profiler` trace (CPU and CUDA, Chrome's
  format) of 30 steps of the first constrained run of 64 rows, from its 20th
  step on, written to FILE (where the device waits for the host, and why);
  the parts ``PARTS=1`` times (but a row's `_append`), and the background
  fill, are ranges of their own in it.

Usage (the bench's arguments after the script; OMP_NUM_THREADS to vary
torch's intra-op threads): PYTHONPATH=. python3 benchmarks/mask_steps.py
bench throughput --random-weights --model DIR --device cuda --json-schema
FILE --structured-batch-sizes 16 64 --json
"""

from __future__ import annotations

import atexit
import cProfile
import gc
import inspect
import io
import json
import os
import pstats
import statistics
import sys
import threading
import time

import torch

import pagedlm.batch.engine as engine_module
import pagedlm.structured.matcher as matcher_module
from pagedlm.cli import main

counts = {"steps": 0}
fills: dict[str, list[float]] = {}
_step, _fill_live = engine_module.LLMEngine.step, getattr(matcher_module, "_fill_live", None)  # (a tree may lack it)


def step(self):
    if os.environ.get("PREFETCH") in ("0", "1"):
        self.prefetch_masks = os.environ["PREFETCH"] == "1"
    running = rows_running[0] = len(self.scheduler.running)
    in_grammar_step[0] = any(seq.matcher is not None for seq in self.scheduler.running)
    if os.environ.get("TRACE") and in_grammar_step[0] and len(self.scheduler.running) == 64:
        trace(counts.setdefault("traced", 0))
        counts["traced"] += 1
    profile = profiles.setdefault(in_grammar_step[0], cProfile.Profile()) if PROFILE and running == 64 else None
    current.clear()
    t0 = time.perf_counter()
    if profile is not None:
        profile.enable()
    out = _step(self)
    if profile is not None:
        profile.disable()
    if in_grammar_step[0]:
        parts.setdefault("step", []).append(time.perf_counter() - t0)
        if running == 64 and os.environ.get("PARTS") == "1":
            steps64.append({**current, "step": parts["step"][-1]})
    elif running:
        plain_steps.append(time.perf_counter() - t0)
        if running == 64 and os.environ.get("PARTS") == "1":
            plain_parts.setdefault("step", []).append(plain_steps[-1])
    counts["steps"] += 1
    return out


_profiler = []
PROFILE = os.environ.get("PROFILE")
TRACED = bool(os.environ.get("TRACE"))
profiles: dict[bool, cProfile.Profile] = {}  # PROFILE: grammar steps (True) and plain ones (False) of 64 rows


def trace(n: int) -> None:
    """Start the profiler at the 20th 64-row grammar step, write its trace 30 steps later."""
    if n == 20:
        _profiler.append(torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                            torch.profiler.ProfilerActivity.CUDA]))
        _profiler[0].__enter__()
    elif n == 50:
        _profiler[0].__exit__(None, None, None)
        _profiler[0].export_chrome_trace(os.environ["TRACE"])


def fill_live(executor, live, bitmask):
    t0 = time.perf_counter()
    try:
        if TRACED:
            with torch.profiler.record_function(f"fill {len(live)} rows"):
                return _fill_live(executor, live, bitmask)
        return _fill_live(executor, live, bitmask)
    finally:
        key = f"{threading.current_thread().name.split('_')[0]}:{len(live)} rows"
        fills.setdefault(key, []).append(time.perf_counter() - t0)
        last_fill[0] = fills[key][-1]


parts: dict[str, list[float]] = {}  # PARTS=1: engine calls' times during grammar steps,
plain_parts: dict[str, list[float]] = {}  # and during the other steps of 64 rows
PARTS = ("_land", "_launch", "_append", "_advance")  # (those a tree has; a deferred pick's _launch is in prepare_step)
in_grammar_step = [False]


def timed(name, fn):
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            if TRACED and name != "_append":  # the part a range of its own in the trace (not a row's)
                with torch.profiler.record_function(name):
                    return fn(*args, **kwargs)
            return fn(*args, **kwargs)
        finally:
            t1 = time.perf_counter()
            if not in_grammar_step[0]:
                if rows_running[0] == 64:
                    plain_parts.setdefault(name, []).append(t1 - t0)
            else:
                parts.setdefault(name, []).append(t1 - t0)
                current[name] = current.get(name, 0.0) + t1 - t0
                if name == "_land":
                    landed[0] = t0
                elif name == "grammar_masks":
                    current["fill"] = last_fill[0]
                    if landed[0] is not None:  # the host's chain, in ``chain``
                        parts.setdefault("chain", []).append(t1 - landed[0])
                        current["chain"] = t1 - landed[0]
                        landed[0] = None
    return wrapper


landed: list[float | None] = [None]  # when the last grammar step's `_land` began
rows_running = [0]  # in the step under way
current: dict[str, float] = {}  # PARTS=1: the step under way's parts (s), and the fill its masks came from
steps64: list[dict[str, float]] = []  # those of each grammar step of 64 rows
last_fill = [0.0]  # the last fill's seconds (the background thread's)


plain_steps: list[float] = []  # the steps with rows running, none with a grammar (the unconstrained runs', prefills)


def spread(seconds) -> list[float]:
    """Median, mean, 90th percentile and largest of step times, ms."""
    whole = sorted(seconds) or [0.0]
    return [round(1000 * v, 3) for v in (statistics.median(whole), statistics.mean(whole),
                                         whole[int(0.9 * len(whole))], whole[-1])]


@atexit.register
def report() -> None:
    if PROFILE and profiles:
        text = io.StringIO()
        for grammar, profile in sorted(profiles.items()):
            text.write(f"==== steps of 64 rows {'with' if grammar else 'without'} grammar rows\n")
            for order in ("tottime", "cumulative"):
                pstats.Stats(profile, stream=text).sort_stats(order).print_stats(40)
        with open(PROFILE, "w") as f:
            f.write(text.getvalue())
    step_ms, plain_ms = spread(parts.get("step", ())), spread(plain_steps)
    by_thread = {k: [len(v), round(1000 * statistics.median(v), 3)] for k, v in sorted(fills.items())}
    steps = len(parts.get("step", ())) or 1
    timed_parts = {k: [round(len(v) / steps, 2), round(1000 * statistics.median(v), 3)] for k, v in parts.items()}
    plain_timed = {k: [len(v), round(1000 * statistics.median(v), 3)] for k, v in plain_parts.items()}
    names = sorted({k for row in steps64 for k in row})
    by_step = {"names": names, "ms": [[round(1000 * row.get(k, 0.0), 3) for k in names] for row in steps64],
               "spread": {k: spread([row.get(k, 0.0) for row in steps64]) for k in names}}
    print(json.dumps({**counts, "prefetch": {"0": False, "1": True}.get(os.environ.get("PREFETCH"), "default"), "lanes": os.environ.get("LANES"),
                      "switch": os.environ.get("SWITCH"),
                      "no_forcing": os.environ.get("NO_FORCING") == "1",
                      "fill_rows_ms": by_thread,
                      **({"parts_ms": timed_parts, "step_ms": step_ms, "plain_parts_ms": plain_timed, "steps64": by_step}
                         if parts else {}), "plain_step_ms": plain_ms,
                      "gc_ms": {g: [len(v), round(1000 * sum(v), 3)] for g, v in sorted(collections.items())}}),
          flush=True)


collections: dict[int, list[float]] = {}  # generation -> each cyclic collection's seconds, in grammar steps
_gc_start = [0.0]


def on_gc(phase: str, info: dict) -> None:
    if phase == "start":
        _gc_start[0] = time.perf_counter()
    elif in_grammar_step[0]:
        collections.setdefault(info["generation"], []).append(time.perf_counter() - _gc_start[0])


if __name__ == "__main__":
    engine_module.LLMEngine.step = step
    import pagedlm.structured.compiler as compiler_module
    _tokenize = compiler_module._TextTokenizer.__call__

    def tokenize(self, text):
        counts["tokenize_calls"] = counts.get("tokenize_calls", 0) + 1
        return _tokenize(self, text)
    compiler_module._TextTokenizer.__call__ = tokenize
    if os.environ.get("NO_FORCING") == "1":
        from no_forcing import turn_forcing_off  # (benchmarks/, the script's folder, is on sys.path)
        turn_forcing_off()
    if os.environ.get("SWITCH"):
        matcher_module.GIL_SWITCH_S = float(os.environ["SWITCH"])
    if os.environ.get("LANES"):
        lanes = int(os.environ["LANES"])
        compiler_module.MAX_LANES = max(compiler_module.MAX_LANES, lanes)
        compiler_module.default_lanes = lambda device: lanes
    gc.callbacks.append(on_gc)
    if _fill_live is not None:
        matcher_module._fill_live = fill_live
    if os.environ.get("PARTS") == "1":
        for name in PARTS:
            if hasattr(engine_module.LLMEngine, name):
                wrapped = timed(name, getattr(engine_module.LLMEngine, name))
                static = isinstance(inspect.getattr_static(engine_module.LLMEngine, name), staticmethod)
                setattr(engine_module.LLMEngine, name, staticmethod(wrapped) if static else wrapped)
        for name in ("prepare_step", "grammar_masks", "to_device", "pick_on_device"):
            setattr(engine_module, name, timed(name, getattr(engine_module, name)))
        import pagedlm.structured as structured_module
        structured_module.masked_logits = timed("masked_logits", structured_module.masked_logits)
        import pagedlm.batch.scheduler as scheduler_module
        scheduler_module.Scheduler.schedule = timed("schedule", scheduler_module.Scheduler.schedule)
    sys.exit(main(sys.argv[1:]))
