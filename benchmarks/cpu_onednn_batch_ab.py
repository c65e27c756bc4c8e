"""Batched decode on the CPU with multi-row products in oneDNN
(``kernels.cpu.ONEDNN_MIN_ROWS`` = 16, the default) against MKL (0): 16
SmolLM2 prompts of 32-96 tokens, 48 new tokens each, one engine, three
alternating rounds; output tok/s per round (prompt steps included).

    PYTHONPATH=. python benchmarks/cpu_onednn_batch_ab.py
"""
import time, statistics, torch
from pagedlm.llm import LLM
from pagedlm.params import SamplingParams
from pagedlm.kernels import cpu
from pagedlm.loading import load
model, tok = load("smollm2-135m-instruct")[:2]
llm = LLM(model, tokenizer=tok)
g = torch.Generator().manual_seed(0)
prompts = [torch.randint(0, 40000, (int(n),), generator=g).tolist() for n in torch.randint(32, 96, (16,), generator=g)]
sp = SamplingParams(max_tokens=48, ignore_eos=True)
got = {16: [], 0: []}
llm.generate(prompts[:4], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
for _ in range(3):
    for rows in (16, 0):
        cpu.ONEDNN_MIN_ROWS = rows
        t = time.perf_counter(); outs = llm.generate(prompts, sp, use_tqdm=False); dt = time.perf_counter() - t
        got[rows].append(16 * 48 / dt)
print({("onednn" if k else "mkl"): [round(x, 1) for x in v] for k, v in got.items()})
