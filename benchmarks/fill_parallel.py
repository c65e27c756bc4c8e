"""Does llguidance fill a step's rows in parallel on this host? 64 rows under
`benchmarks/configs/person.schema.json` (the Qwen3-0.6B shape's 151,936-token
rows), each advanced by a random token its grammar allows after every fill
(new states each step), 30 steps; per (lanes, threads): llguidance's
executor over all rows, or a Python thread a part calling each row's own
fill (both drop the GIL). Prints ms a step and the process's CPU ms a step
(above the wall time only where threads overlap).

Usage: PYTHONPATH=. python3 benchmarks/fill_parallel.py TOKENIZER_FOLDER
"""

from __future__ import annotations

import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import llguidance
import numpy as np

from pagedlm.structured import compiler
from pagedlm.structured.constraint import Constraint
from pagedlm.tokenizer import Tokenizer

WIDTH, ROWS, STEPS = 151936, 64, 30


def run(tokenizer, grammar: str, lanes: int, threads: int, mode: str) -> dict:
    words = (WIDTH + 31) // 32
    compiles = [llguidance.LLMatcher(tokenizer, grammar, log_level=0) for _ in range(lanes)]
    matchers = [compiles[i % lanes].deep_copy() for i in range(ROWS)]
    order = sorted(range(ROWS), key=lambda i: i % lanes)  # grouped by lane, as the engine hands them over
    parts = [[i for i in order if i % lanes % threads == t] for t in range(threads)]
    bitmask = np.zeros((ROWS, words), dtype=np.int32)
    executor, pool, rng = llguidance.LLExecutor(num_threads=threads), ThreadPoolExecutor(threads), np.random.default_rng(1)

    def fill(rows):
        for i in rows:
            matchers[i].unsafe_compute_mask_ptr(bitmask[i].ctypes.data, words * 4)
    wall = cpu = 0.0
    for _ in range(STEPS):
        t0, c0 = time.perf_counter(), time.process_time()
        if mode == "executor":
            executor.unsafe_compute_mask_ptr([(matchers[i], i) for i in order], bitmask.ctypes.data, words * 4, ROWS)
        else:
            list(pool.map(fill, parts))
        wall, cpu = wall + time.perf_counter() - t0, cpu + time.process_time() - c0
        for i, m in enumerate(matchers):
            allowed = np.flatnonzero(np.unpackbits(bitmask[i].view(np.uint8), bitorder="little"))
            m.consume_token(int(rng.choice(allowed)))
    return {"lanes": lanes, "threads": threads, "mode": mode, "ms_per_step": round(1000 * wall / STEPS, 3),
            "cpu_ms_per_step": round(1000 * cpu / STEPS, 3)}


def main() -> None:
    tokenizer = compiler.llguidance_tokenizer(Tokenizer.from_folder(sys.argv[1]), WIDTH)
    with open("benchmarks/configs/person.schema.json") as f:
        grammar = Constraint(json=json.load(f)).llguidance_grammar()
    print(json.dumps({"cpus": os.cpu_count(), "affinity": len(os.sched_getaffinity(0))}), flush=True)
    for lanes, threads in ((1, 1), (8, 1), (8, 8), (16, 16), (8, 2)):
        for mode in ("executor", "threads"):
            print(json.dumps(run(tokenizer, grammar, lanes, threads, mode)), flush=True)


if __name__ == "__main__":
    main()
