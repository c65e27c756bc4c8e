"""Where the GPU fast path's time goes (issue 9), on random weights.

batch 1: the CUDA graph's replay alone (device events) against the whole
engine step, and the host parts of a step (perf_counter around each).
workload: nano-vllm's 256 prompts (Qwen3-0.6B shape) through ``LLM.generate``,
its wall time split into decode steps that replay a graph, steps that run
eagerly (prompt chunks), and within them the host parts.
kernels: the same workload under ``torch.profiler`` for PROFILE_STEPS engine steps
from step SKIP (mid-run: ~130 rows decoding), the device time by kernel
(graph replays included), per step; KV=fp8 (or int8) for 8-bit pools;
PREFILL=1: the prompt-heavy row's workload instead (256 prompts of
1,024-4,096 tokens, one output token each: steps of prompt chunks).

ASYNC=1|0 in the environment turns async scheduling on or off (default: the
device's default, on). Under it the host waits for the GPU in ``land`` (the
step before's tokens), not in ``sample``; each engine step's time is then
the host's own work plus whatever wait is left.

Usage (repository root, GPU machine):
    PYTHONPATH=. python3 benchmarks/gpu_profile.py [config ...]      # batch 1
    PYTHONPATH=. python3 benchmarks/gpu_profile.py --workload
    KERNELS=1 PYTHONPATH=. python3 benchmarks/gpu_profile.py [config ...]     # ... and the replay's kernels
    KV=fp8 SKIP=300 PROFILE_STEPS=20 PYTHONPATH=. python3 benchmarks/gpu_profile.py --kernels
    PREFILL=1 SKIP=20 PROFILE_STEPS=10 PYTHONPATH=. python3 benchmarks/gpu_profile.py --kernels
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path

import torch

from pagedlm.batch import engine as engine_mod
from pagedlm.bench.common import load_random
from pagedlm.batch.engine import LLMEngine
from pagedlm.options import EngineOptions, PagedKvOptions
from pagedlm.params import SamplingParams

ROOT = Path(__file__).resolve().parent
ASYNC = None if os.environ.get("ASYNC") is None else os.environ["ASYNC"] == "1"


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
                                                 max_model_len=4096, attention_backend="triton",
                                                 async_scheduling=ASYNC))
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
    if os.environ.get("KERNELS") == "1":  # the replay's kernels by device time
        from torch.profiler import ProfilerActivity, profile as torch_profile
        with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(20):
                g.replay()
            torch.cuda.synchronize()
        print_kernels(prof, 20, f"{config} batch-1 graph replay")

    parts: dict[str, list[float]] = {}
    engine.scheduler.schedule = timed(engine.scheduler.schedule, parts, "schedule")
    engine_mod.prepare_step = timed(engine_mod.prepare_step, parts, "prepare_step")
    engine.graphs.run = timed(engine.graphs.run, parts, "graph_run (copies + replay launch)")
    engine_mod.sample = timed(engine_mod.sample, parts, "sample (waits for the GPU)")
    engine._append = timed(engine._append, parts, "append")
    engine._land = timed(engine._land, parts, "land (waits for the step before; async)")
    ids = torch.randint(0, model.args.vocab_size, (512,)).tolist()
    for _ in range(2):
        steps = []
        for out in engine.stream(ids, SamplingParams(max_tokens=128, ignore_eos=True)):
            steps.append(time.perf_counter())
    step_ms = statistics.median([b - a for a, b in zip(steps[1:], steps[2:])]) * 1e3
    print(f"{config}: graph replay {replay_ms:.3f} ms; engine step {step_ms:.3f} ms; "
          f"async scheduling {engine.async_scheduling}")
    for name, xs in parts.items():
        print(f"    {name:40s} {statistics.median(xs[-100:]) * 1e3:.3f} ms")


def workload_llm(kv_quant: str = "none", prefill: bool = False):
    """The 256-prompt workload's LLM (warmed up), its prompts and their
    parameters; ``prefill``: the prompt-heavy row's (1,024-4,096 tokens in, 1 out)."""
    from pagedlm.bench.throughput import make_workload
    from pagedlm.llm import LLM

    model, tok = load_random(str(ROOT / "configs" / "qwen3-0.6b"), "cuda", torch.bfloat16)
    work = make_workload(256, *((1024, 4096) if prefill else (100, 1024)), 0, model.args.vocab_size,
                         output_len=1 if prefill else None)
    llm = LLM(model, tokenizer=tok, paged_kv=True, block_size=16, attention_backend="triton",
              gpu_memory_fraction=0.5, async_scheduling=ASYNC, kv_quant=kv_quant)
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for _, n in work]
    llm.generate([p for p, _ in work[:8]], params[:8], use_tqdm=False)  # warm-up
    llm.reset_prefix_cache()  # (the run finds none of the warm-up's prompts)
    return llm, [p for p, _ in work], params


def kernels() -> None:
    """Device time by kernel over PROFILE_STEPS engine steps from step SKIP of the workload."""
    from torch.profiler import ProfilerActivity, profile as torch_profile, schedule

    skip, steps = int(os.environ.get("SKIP", 300)), int(os.environ.get("PROFILE_STEPS", 20))
    prefill = os.environ.get("PREFILL") == "1"
    llm, prompts, params = workload_llm(os.environ.get("KV", "none"), prefill)
    engine = llm.engine
    step, rows = engine.step, []
    window = schedule(wait=skip, warmup=2, active=steps, repeat=1)
    with torch_profile(activities=[ProfilerActivity.CUDA], schedule=window) as prof:
        def profiled_step():
            out = step()
            if skip + 2 <= len(rows) < skip + 2 + steps:
                running = engine.scheduler.running
                rows.append((len(running), sum(seq.num_tokens for seq in running)))
            else:
                rows.append(None)
            prof.step()
            return out
        engine.step = profiled_step
        llm.generate(prompts, params, use_tqdm=False)
    seen = [r for r in rows if r is not None]
    args = engine.model.args
    token_bytes = 2 * args.num_hidden_layers * args.num_key_value_heads * args.head_dim * \
        (2 if os.environ.get("KV", "none") == "none" else 1)  # (8-bit: scales not counted)
    print_kernels(prof, steps, f"{'prompt-heavy' if prefill else 'workload'}, KV {os.environ.get('KV', 'none')}, "
                               f"steps {skip + 2}..{skip + 2 + steps} "
                               f"(running rows {seen[0][0]}..{seen[-1][0]}, keys a step "
                               f"{statistics.mean(t for _, t in seen):.0f}: "
                               f"{statistics.mean(t for _, t in seen) * token_bytes / 1e9:.2f} GB of KV)")


def print_kernels(prof, steps: int, title: str, top: int = 30) -> None:
    """The profiled kernels by device time, per step."""
    events = [e for e in prof.key_averages() if e.device_time_total > 0]
    total = sum(e.device_time_total for e in events)
    print(f"kernels: {title}: {sum(e.count for e in events) / steps:.0f} kernels, "
          f"device time {total / steps / 1e3:.3f} ms a step")
    for e in sorted(events, key=lambda e: -e.device_time_total)[:top]:
        print(f"    {e.device_time_total / steps / 1e3:8.3f} ms  {e.count / steps:6.1f}x  "
              f"{100 * e.device_time_total / total:5.1f}%  {e.key[:110]}")


def workload() -> None:
    llm, prompts, params = workload_llm()
    engine = llm.engine
    parts: dict[str, list[float]] = {}
    engine.scheduler.schedule = timed(engine.scheduler.schedule, parts, "schedule")
    engine_mod.prepare_step = timed(engine_mod.prepare_step, parts, "prepare_step")
    engine_mod.sample = timed(engine_mod.sample, parts, "sample (waits for the GPU)")
    engine._append = timed(engine._append, parts, "append (per row)")
    engine._land = timed(engine._land, parts, "land (waits for the step before, appends; async)")
    can_run = engine.graphs.can_run
    step = engine.step
    kinds: dict[str, list[float]] = {"graph": [], "eager": []}

    def traced_step():
        t0 = time.perf_counter()
        out = step()
        kinds["graph" if last[0] else "eager"].append(time.perf_counter() - t0)
        return out

    last = [False]

    def traced_can_run(s):
        last[0] = can_run(s)
        return last[0]

    engine.graphs.can_run = traced_can_run
    engine.step = traced_step
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    print(f"workload: {tokens} tokens in {wall:.2f} s = {tokens / wall:.0f} tok/s; "
          f"async scheduling {engine.async_scheduling}")
    for k, xs in kinds.items():
        print(f"    {k:10s} steps {len(xs):5d}  total {sum(xs):7.3f} s  median {statistics.median(xs) * 1e3:.3f} ms")
    for name, xs in parts.items():
        print(f"    {name:40s} total {sum(xs):7.3f} s over {len(xs)} calls")


if __name__ == "__main__":
    if "--workload" in sys.argv:
        workload()
    elif "--kernels" in sys.argv:
        kernels()
    else:
        for cfg in sys.argv[1:] or ["qwen3-0.6b", "llama-3.1-8b"]:
            profile(cfg)
