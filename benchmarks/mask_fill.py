"""What filling a step's grammar bitmasks costs on this host, by thread count:
``B`` rows under one JSON schema, each taking a random token its grammar
allows after every fill (what random weights do under a constraint: new
grammar states every step, strings that run on), ``STEPS`` steps.

Reported per thread count of llguidance's executor: ms per step of
`structured.fill_bitmask` (the engine's call: the executor, then each row's
liveness check), the process's CPU time in it (all threads: above the wall
time only where the rows are filled in parallel), and the executor alone on
states it has just seen (what llguidance caches between two fills of one
state).

Rows' matchers: ``copy`` (the engine's: deep copies of one compiled
grammar) or ``fresh`` (each row compiles the grammar itself: whether copies
share state that threads contend on), or ``split``: copies, filled by as
many Python threads as the thread count, each with a one-thread executor of
its own over a slice of the rows (whether llguidance's pool is what fails
to scale).

Usage: PYTHONPATH=. python3 benchmarks/mask_fill.py TOKENIZER_FOLDER VOCAB [B] [SCHEMA]
(THREADS="1 4 12", MATCHERS="copy fresh" and FILL_STEPS in the environment).
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor

import llguidance
import numpy as np
import torch

from pagedlm.structured import Constraint, GrammarCompiler, fill_bitmask
from pagedlm.structured import compiler as compiler_module
from pagedlm.structured import matcher as matcher_module
from pagedlm.tokenizer import Tokenizer


def main() -> None:
    folder, vocab = sys.argv[1], int(sys.argv[2])
    rows = int(sys.argv[3]) if len(sys.argv) > 3 else 64
    schema = json.load(open(sys.argv[4] if len(sys.argv) > 4 else "benchmarks/configs/person.schema.json"))
    steps = int(os.environ.get("FILL_STEPS", "30"))
    compiler = GrammarCompiler(Tokenizer.from_folder(folder), vocab)
    constraint = Constraint(json=schema)
    kinds = os.environ.get("MATCHERS", "copy").split()
    for kind, threads in [(k, int(t)) for k in kinds for t in os.environ.get("THREADS", f"1 4 {os.cpu_count()}").split()]:
        matcher_module._executor = llguidance.LLExecutor(num_threads=threads)
        matchers = [compiler.matcher(constraint) for _ in range(rows)]
        if kind == "fresh":
            for m in matchers:
                m._compiled = Future()
                m._compiled.set_result(compiler_module._compile(compiler._llg_tokenizer(), constraint.llguidance_grammar()))
        while not all(m.ready() for m in matchers):
            time.sleep(0.01)
        split = _split_fill(threads) if kind == "split" else None
        rng = random.Random(0)
        fresh = again = cpu = 0.0
        words = (matchers[0].width + 31) // 32
        for _ in range(steps):
            t0, c0 = time.perf_counter(), time.process_time()
            if split:
                bitmask = np.zeros((rows, words), dtype=np.int32)
                split([(m._live(), j) for j, m in enumerate(matchers)], bitmask)
                live = [bool(r.any()) for r in bitmask]
                bitmask = torch.from_numpy(bitmask)
            else:
                bitmask, live = fill_bitmask(matchers)
            fresh += time.perf_counter() - t0
            cpu += time.process_time() - c0
            scratch = np.zeros(bitmask.shape, dtype=np.int32)
            pairs = [(m._live(), j) for j, m in enumerate(matchers)]
            t0 = time.perf_counter()
            if split:
                split(pairs, scratch)
            else:
                matcher_module._executor.unsafe_compute_mask_ptr(pairs, scratch.ctypes.data, words * 4, rows)
            again += time.perf_counter() - t0
            allowed = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, bitorder="little")[:, :vocab]
            for j, m in enumerate(matchers):  # (numpy: torch's CPU threads would spin beside llguidance's)
                if live[j] and not m.is_finished:
                    m.advance(rng.choice(np.flatnonzero(allowed[j]).tolist()))
        print(json.dumps({"rows": rows, "threads": threads, "matchers": kind, "vocab": vocab, "steps": steps,
                          "fill_ms_per_step": round(1000 * fresh / steps, 3),
                          "fill_cpu_ms_per_step": round(1000 * cpu / steps, 3),  # all threads: > wall if parallel
                          "executor_again_ms_per_step": round(1000 * again / steps, 3),
                          "cpus": os.cpu_count(), "affinity": len(os.sched_getaffinity(0))}), flush=True)


def _split_fill(threads: int):
    """fill(pairs, bitmask): ``threads`` one-thread executors, each on its own
    Python thread (llguidance drops the GIL), over interleaved slices of the rows."""
    executors = [llguidance.LLExecutor(num_threads=1) for _ in range(threads)]
    pool = ThreadPoolExecutor(threads)

    def fill(pairs, bitmask: np.ndarray) -> None:
        rows, words = bitmask.shape
        parts = [pool.submit(e.unsafe_compute_mask_ptr, pairs[i::threads], bitmask.ctypes.data, words * 4, rows)
                 for i, e in enumerate(executors) if pairs[i::threads]]
        for p in parts:
            p.result()
    return fill


if __name__ == "__main__":
    main()
