"""Decode and prefill in one process: torch's quantized products (the model
loaded with ``PAGEDLM_CPU_QUANT=0``: main's path before issue 24) against
``kernels.cpu_quant``'s, eager and ``--compile``, and llama.cpp on the same
GGUF, on the bench's own runners, interleaved round by round; medians.

    PYTHONPATH=. python benchmarks/cpu_quant_ab.py MODEL int4|int8 [--compile] [--repeats 5]
"""
import argparse
import dataclasses
import json
import os
import statistics
import time

import torch

from pagedlm import options as opt
from pagedlm.bench import decode as D
from pagedlm.bench.common import default_store
from pagedlm.loading import load

parser = argparse.ArgumentParser()
parser.add_argument("model")
parser.add_argument("mode", choices=["int4", "int8"])
parser.add_argument("--compile", action="store_true")
parser.add_argument("--repeats", type=int, default=5)
args = parser.parse_args()
prompts, gen = [64, 512], 32
new, tok = load(args.model, quantization=args.mode)[:2]
os.environ[opt.CPU_QUANT_KERNEL_ENV] = "0"
old = load(args.model, quantization=args.mode)[0]
del os.environ[opt.CPU_QUANT_KERNEL_ENV]
base = default_store(opt.EngineOptions())
configs = {"old": (old, base), "new": (new, base)}
if args.compile:
    compiled = dataclasses.replace(base, compile=True)
    configs |= {"old-compiled": (old, compiled), "new-compiled": (new, compiled)}
runners = {name: D._ours(model, tok, options, gen) for name, (model, options) in configs.items()}
runners["llama.cpp"] = D._llama_cpp(D.gguf_path(args.model), gen, max(prompts) + gen + 8)
for n in prompts:
    ids = D.prompt_ids(tok, n)
    for run in runners.values():  # warm-up
        run(ids[:32])
    timings = {name: D.Timing() for name in runners}
    for _ in range(args.repeats):
        for name, run in runners.items():
            timings[name].add(*run(ids))
    med = {name: (statistics.median(t.prefill_tok_s), statistics.median(t.decode_tok_s)) for name, t in timings.items()}
    print(json.dumps({
        "model": args.model, "quantization": args.mode, "prompt_len": n, "gen_len": gen, "repeats": args.repeats,
        "threads": torch.get_num_threads(), "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "load": os.getloadavg()[0],
        "decode_tok_s": {k: round(v[1], 2) for k, v in med.items()},
        "prefill_tok_s": {k: round(v[0], 1) for k, v in med.items()},
        "decode_vs_llama_cpp": {k: round(v[1] / med["llama.cpp"][1], 3) for k, v in med.items()},
        "decode_all": {k: [round(x, 2) for x in t.decode_tok_s] for k, t in timings.items()}}), flush=True)
