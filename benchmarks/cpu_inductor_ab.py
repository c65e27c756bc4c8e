"""Two compiled CPU engines in one process, the second with inductor options
changed (``OPTIONS``, JSON, added to ``batch.compiled.inductor_options``'s),
decode tok/s of one row in alternating rounds at prompt 64 and 512; medians.

    PYTHONPATH=. python benchmarks/cpu_inductor_ab.py smollm2-135m-instruct int4 '{"size_asserts": true}'
"""
import dataclasses
import json
import statistics
import sys
import time

from pagedlm import options as opt
from pagedlm.batch import compiled
from pagedlm.bench import decode as D
from pagedlm.bench.common import default_store
from pagedlm.loading import load

name, quantization, changed = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
rounds = int(sys.argv[4]) if len(sys.argv) > 4 else 6
model, tok = load(name, quantization=quantization)[:2]
options = dataclasses.replace(default_store(opt.EngineOptions()), compile=True)
runs = {"main": D._ours(model, tok, options, 64)}
main_options = compiled.inductor_options
compiled.inductor_options = lambda m: main_options(m) | changed
runs["changed"] = D._ours(model, tok, options, 64)
compiled.inductor_options = main_options
for n in (64, 512):
    ids = D.prompt_ids(tok, n)
    for run in runs.values():
        run(ids)
    tps = {k: [] for k in runs}
    for _ in range(rounds):
        for k, run in runs.items():
            tps[k].append(run(ids)[1])
    print(json.dumps({"model": name, "quantization": quantization, "changed": changed, "prompt_len": n,
                      "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                      "decode_tok_s": {k: round(statistics.median(v), 1) for k, v in tps.items()},
                      "rounds": {k: [round(x, 1) for x in v] for k, v in tps.items()}}), flush=True)
