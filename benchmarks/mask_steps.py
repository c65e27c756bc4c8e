"""Where a grammar step's fill time goes in the engine: `pagedlm bench ...`
run in this process with two counters added, printed as one JSON line at
exit after the bench's own rows:

- ``deferred``: steps that left their pick to the next step, their grammar
  rows' masks filling in the background meanwhile (`InFlight.logits`), out
  of ``steps``; ``DEFER=0`` in the environment picks in the step instead
  (the engine's ``prefetch_masks`` off), for an A/B in one tree;
- ``fill_rows_ms``: `structured.matcher._fill_rows` calls by thread (the
  step's own, or the background prefetch) and row count: how many, and
  their median ms (the rows' fill itself, without waiting for a prefetch).

``PROFILE=N``: the main thread under cProfile, its N costliest functions
(own time, then cumulative) printed at exit (the host's share of a step,
relative: cProfile slows Python code more than the calls into C it makes).

Usage (the bench's arguments after the script; OMP_NUM_THREADS to vary
torch's intra-op threads): PYTHONPATH=. python3 benchmarks/mask_steps.py
bench throughput --random-weights --model DIR --device cuda --json-schema
FILE --structured-batch-sizes 16 64 --json
"""

from __future__ import annotations

import atexit
import cProfile
import io
import json
import os
import pstats
import statistics
import sys
import threading
import time

import pagedlm.batch.engine as engine_module
import pagedlm.structured.matcher as matcher_module
from pagedlm.cli import main

counts = {"steps": 0, "deferred": 0}
fills: dict[str, list[float]] = {}
_step, _fill_rows = engine_module.LLMEngine.step, matcher_module._fill_rows


def step(self):
    if os.environ.get("DEFER") == "0":
        self.prefetch_masks = False
    out = _step(self)
    counts["steps"] += 1
    counts["deferred"] += self._inflight is not None and self._inflight.logits is not None
    return out


def fill_rows(bitmask, matchers, rows):
    rows = list(rows)
    t0 = time.perf_counter()
    try:
        return _fill_rows(bitmask, matchers, rows)
    finally:
        key = f"{threading.current_thread().name.split('_')[0]}:{len(rows)} rows"
        fills.setdefault(key, []).append(time.perf_counter() - t0)


profiler = cProfile.Profile() if os.environ.get("PROFILE") else None


@atexit.register
def report() -> None:
    by_thread = {k: [len(v), round(1000 * statistics.median(v), 3)] for k, v in sorted(fills.items())}
    print(json.dumps({**counts, "defer": os.environ.get("DEFER") != "0", "fill_rows_ms": by_thread}), flush=True)
    if profiler is not None:
        profiler.disable()
        for order in ("tottime", "cumulative"):
            text = io.StringIO()
            pstats.Stats(profiler, stream=text).sort_stats(order).print_stats(int(os.environ["PROFILE"]))
            print(f"profile by {order}, {counts['steps']} steps:")
            print("\n".join(line for line in text.getvalue().splitlines()[6:] if line.strip()), flush=True)


if __name__ == "__main__":
    engine_module.LLMEngine.step = step
    matcher_module._fill_rows = fill_rows
    if profiler is not None:
        profiler.enable()
    sys.exit(main(sys.argv[1:]))
