"""Where a batch-1 decode step's time goes on the GPU (issue 9): the CUDA
graph's replay alone (device events) against the whole engine step, and the
host parts of a step (perf_counter around each), on random weights.

Usage (repository root, GPU machine): PYTHONPATH=. python3 benchmarks/gpu_profile.py [config ...]
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

from pagedlm.batch import engine as engine_mod
from pagedlm.bench.decode import load_random
from pagedlm.batch.engine import LLMEngine
from pagedlm.options import EngineOptions, PagedKvOptions, SamplingParams

ROOT = Path(__file__).resolve().parent


def timed(fn, parts, name):
    def wrapper(*a, **k):
        t0 = time.perf_counter()
        out = fn(*a, **k)
        parts.setdefault(name, []).append(time.perf_counter() - t0)
        return out
    return wrapper


def profile(config: str) -> None:
    model, tok = load_random(str(ROOT / "configs" / config), "cuda", torch.bfloat16)
    engine = LLMEngine(model, tok, EngineOptions(paged_kv=PagedKvOptions(16), kv_budget_bytes=8 << 30,
                                                 max_model_len=4096, attention_backend="triton"))
    g = engine.graphs.graphs[1][0]
    for _ in range(10):
        g.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(100):
        g.replay()
    end.record()
    end.synchronize()
    replay_ms = start.elapsed_time(end) / 100

    parts: dict[str, list[float]] = {}
    engine.scheduler.schedule = timed(engine.scheduler.schedule, parts, "schedule")
    engine_mod.prepare_step = timed(engine_mod.prepare_step, parts, "prepare_step")
    engine.graphs.run = timed(engine.graphs.run, parts, "graph_run (copies + replay launch)")
    engine_mod.sample = timed(engine_mod.sample, parts, "sample (waits for the GPU)")
    engine._append = timed(engine._append, parts, "append")
    ids = torch.randint(0, model.args.vocab_size, (512,)).tolist()
    for _ in range(2):
        steps = []
        for out in engine.stream(ids, SamplingParams(max_tokens=128, ignore_eos=True)):
            steps.append(time.perf_counter())
    step_ms = statistics.median([b - a for a, b in zip(steps[1:], steps[2:])]) * 1e3
    print(f"{config}: graph replay {replay_ms:.3f} ms; engine step {step_ms:.3f} ms")
    for name, xs in parts.items():
        print(f"    {name:40s} {statistics.median(xs[-100:]) * 1e3:.3f} ms")


if __name__ == "__main__":
    for cfg in sys.argv[1:] or ["qwen3-0.6b", "llama-3.1-8b"]:
        profile(cfg)
