"""What filling a step's grammar bitmasks costs on this host, by lanes:
``B`` rows under one JSON schema, each taking a random token its grammar
allows after every fill (what random weights do under a constraint: new
grammar states every step, strings that run on), ``STEPS`` steps.

Reported per lane count (`structured.compiler.Grammar`: the schema compiled
that many times, rows copying the compiles in turn, a thread a lane): ms
per step of `structured.fill_bitmask` (the engine's call: the fill, then each
row's liveness check), the process's CPU time in it (all threads: above the
wall time only where lanes fill in parallel), and the fill alone again on
states it has just seen (what llguidance caches between two fills of one
state). One lane is what every row copying one compile gets: llguidance's
copies share its lexer behind a lock, so more threads did not help them.

Usage: PYTHONPATH=. python3 benchmarks/mask_fill.py TOKENIZER_FOLDER VOCAB [B] [SCHEMA]
(LANES="1 2 4 8" and FILL_STEPS in the environment).
"""

from __future__ import annotations

import json
import os
import random
import sys
import time

import numpy as np

from pagedlm.structured import Constraint, GrammarCompiler, fill_bitmask
from pagedlm.structured import matcher as matcher_module
from pagedlm.tokenizer import Tokenizer


def main() -> None:
    folder, vocab = sys.argv[1], int(sys.argv[2])
    rows = int(sys.argv[3]) if len(sys.argv) > 3 else 64
    schema = json.load(open(sys.argv[4] if len(sys.argv) > 4 else "benchmarks/configs/person.schema.json"))
    steps = int(os.environ.get("FILL_STEPS", "30"))
    tokenizer = Tokenizer.from_folder(folder)
    constraint = Constraint(json=schema)
    for lanes in [int(n) for n in os.environ.get("LANES", "1 2 4 8").split()]:
        compiler = GrammarCompiler(tokenizer, vocab, lanes=lanes)
        matchers = [compiler.matcher(constraint) for _ in range(rows)]
        while not all(m.ready() for m in matchers):
            time.sleep(0.01)
        rng = random.Random(0)
        fresh = again = cpu = 0.0
        for _ in range(steps):
            t0, c0 = time.perf_counter(), time.process_time()
            bitmask, live = fill_bitmask(matchers)
            fresh += time.perf_counter() - t0
            cpu += time.process_time() - c0
            scratch = np.zeros(bitmask.shape, dtype=np.int32)
            t0 = time.perf_counter()
            matcher_module._fill_rows(scratch, matchers, range(rows))
            again += time.perf_counter() - t0
            allowed = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, bitorder="little")[:, :vocab]
            for j, m in enumerate(matchers):  # (numpy: torch's CPU threads would spin beside llguidance's)
                if live[j] and not m.is_finished:
                    m.advance(rng.choice(np.flatnonzero(allowed[j]).tolist()))
        print(json.dumps({"rows": rows, "lanes": lanes, "vocab": vocab, "steps": steps,
                          "fill_ms_per_step": round(1000 * fresh / steps, 3),
                          "fill_cpu_ms_per_step": round(1000 * cpu / steps, 3),  # all threads: > wall if parallel
                          "fill_again_ms_per_step": round(1000 * again / steps, 3),
                          "cpus": os.cpu_count(), "affinity": len(os.sched_getaffinity(0))}), flush=True)


if __name__ == "__main__":
    main()
