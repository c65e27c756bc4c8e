"""What filling a step's grammar bitmasks costs on this host, by lanes:
``B`` rows under one JSON schema, each taking a random token its grammar
allows after every fill (what random weights do under a constraint: new
grammar states every step, strings that run on), ``STEPS`` steps.

Reported per lane count (`structured.compiler.Grammar`: the schema compiled
that many times, rows copying the compiles in turn, an executor of a thread a lane): ms
per step of `structured.fill_bitmask` (the engine's call: the fill, then each
row's liveness check), the process's CPU time in it (all threads: above the
wall time only where lanes fill in parallel), and the fill alone again on
states it has just seen (what llguidance caches between two fills of one
state). One lane is what every row copying one compile gets: llguidance's
copies share its lexer behind a lock, so more threads did not help them.

``WALK=text``: each row writes the tokens of a plausible person instead
(`_people`: names, ages, addresses, cities and hobbies from short lists,
compact JSON, the default schema), what a trained model's outputs look
like to the grammar: states recur from row to row and step to step.

``BESIDE="0 1.5"``: with a value above 0, the fill runs on a background
thread while the calling thread runs that many ms of pure Python (a step's
host work; the GIL handed off within 0.1 ms, as the engine has it), and its
time is from its start to its end there.

Usage: PYTHONPATH=. python3 benchmarks/mask_fill.py TOKENIZER_FOLDER VOCAB [B] [SCHEMA]
(LANES="1 2 4 8", BESIDE, WALK=random|text and FILL_STEPS in the environment).
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
from concurrent.futures import ThreadPoolExecutor

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
    walk = os.environ.get("WALK", "random")
    texts = [tokenizer.encode(t, add_special_tokens=False) for t in _people(rows)] if walk == "text" else None
    if texts:
        steps = min(steps, min(len(t) for t in texts))
    for lanes, beside in [(int(n), float(b)) for n in os.environ.get("LANES", "1 2 4 8").split()
                          for b in os.environ.get("BESIDE", "0").split()]:
        if beside:
            matcher_module.hand_off_the_gil_quickly()
        compiler = GrammarCompiler(tokenizer, vocab, lanes=lanes)
        matchers = [compiler.matcher(constraint) for _ in range(rows)]
        while not all(m.ready() for m in matchers):
            time.sleep(0.01)
        rng = random.Random(0)
        fresh = again = cpu = 0.0
        for step in range(steps):
            t0, c0 = time.perf_counter(), time.process_time()
            if beside:  # on a background thread, the calling thread running Python meanwhile
                done = pool.submit(lambda: (fill_bitmask(matchers), time.perf_counter()))
                python_for(beside / 1000)
                (bitmask, live), t1 = done.result()
            else:
                bitmask, live = fill_bitmask(matchers)
                t1 = time.perf_counter()
            fresh += t1 - t0
            cpu += time.process_time() - c0
            scratch = np.zeros(bitmask.shape, dtype=np.int32)
            t0 = time.perf_counter()
            matcher_module._fill_rows(scratch, matchers, range(rows))
            again += time.perf_counter() - t0
            allowed = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, bitorder="little")[:, :vocab]
            for j, m in enumerate(matchers):  # (numpy: torch's CPU threads would spin beside llguidance's)
                if live[j] and not m.is_finished:
                    m.advance(texts[j][step] if texts else rng.choice(np.flatnonzero(allowed[j]).tolist()))
        print(json.dumps({"rows": rows, "lanes": lanes, "beside_ms": beside, "walk": walk, "vocab": vocab,
                          "steps": steps,
                          "dead": sum(m.is_dead for m in matchers),
                          "fill_ms_per_step": round(1000 * fresh / steps, 3),
                          "fill_cpu_ms_per_step": round(1000 * cpu / steps, 3),  # all threads: > wall if parallel
                          "fill_again_ms_per_step": round(1000 * again / steps, 3),
                          "cpus": os.cpu_count(), "affinity": len(os.sched_getaffinity(0))}), flush=True)


pool = ThreadPoolExecutor(1)


def python_for(seconds: float) -> None:
    """Pure Python work (it holds the GIL) for ``seconds``: a step's scheduling and bookkeeping."""
    end, d = time.perf_counter() + seconds, {}
    while time.perf_counter() < end:
        for i in range(50):
            d[i] = [i] * 3


def _people(n: int) -> list[str]:
    """``n`` people of the default schema as compact JSON, no two alike."""
    first = ["Ada", "Alan", "Grace", "Linus", "Edsger", "Barbara", "Donald", "Margaret", "Dennis", "Frances"]
    last = ["Lovelace", "Turing", "Hopper", "Torvalds", "Dijkstra", "Liskov", "Knuth", "Hamilton", "Ritchie"]
    cities = ["London", "Paris", "Berlin", "New York", "Tokyo", "Madrid", "Toronto", "Sydney", "Lisbon"]
    hobbies = ["chess", "hiking", "reading", "cooking", "cycling", "painting", "music", "gardening"]
    rng = random.Random(1)
    out = []
    for i in range(n):
        f, surname = rng.choice(first), rng.choice(last)
        out.append(json.dumps({"name": f"{f} {surname}", "age": rng.randint(18, 90),
                               "email": f"{f.lower()}.{surname.lower()}{i}@example.com", "city": rng.choice(cities),
                               "hobbies": rng.sample(hobbies, rng.randint(1, 3))}, separators=(",", ":")))
    return out


if __name__ == "__main__":
    main()
