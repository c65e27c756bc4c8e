"""float32 prompt processing on the CPU with multi-row products in oneDNN
(``kernels.cpu.ONEDNN_MIN_ROWS``, the default) against MKL (0), one engine,
alternating rounds: prefill tok/s of a PROMPT-token prompt (and the decode
that follows, which takes one-row products either way); medians.

    PYTHONPATH=. python benchmarks/cpu_onednn_ab.py gemma3-270m [PROMPT] [ROUNDS]
"""
import json
import statistics
import sys
import time

from pagedlm import options as opt
from pagedlm.bench import decode as D
from pagedlm.bench.common import default_store
from pagedlm.kernels import cpu
from pagedlm.loading import load

name = sys.argv[1]
prompt = int(sys.argv[2]) if len(sys.argv) > 2 else 512
rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 5
model, tok = load(name)[:2]
run = D._ours(model, tok, default_store(opt.EngineOptions()), 8)
ids = D.prompt_ids(tok, prompt)
variants = {"onednn": cpu.ONEDNN_MIN_ROWS, "mkl": 0}
for rows in variants.values():  # warm-up
    cpu.ONEDNN_MIN_ROWS = rows
    run(ids)
got = {k: [] for k in variants}
for _ in range(rounds):
    for k, rows in variants.items():
        cpu.ONEDNN_MIN_ROWS = rows
        got[k].append(run(ids))
print(json.dumps({"model": name, "prompt_len": prompt, "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                  "prefill_tok_s": {k: round(statistics.median(p for p, _ in v), 1) for k, v in got.items()},
                  "decode_tok_s": {k: round(statistics.median(d for _, d in v), 1) for k, v in got.items()},
                  "rounds_prefill": {k: [round(p, 1) for p, _ in v] for k, v in got.items()}}), flush=True)
