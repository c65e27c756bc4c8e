"""`pagedlm bench throughput`: offline batched throughput, nano-vllm's workload.

``--num-prompts`` prompts of random token ids, input and output lengths each
uniform in ``[--min-len, --max-len]`` (seeded; ``--output-len N`` fixes every
output instead: ``--output-len 1`` makes the run nearly all prefill),
end-of-sequence ignored, all handed to ``LLM.generate`` at once. Reported:
total output tokens / elapsed seconds, (prompt + output tokens) / elapsed
seconds (``total_tok_s``, vLLM's "total tokens/s"), prompt tokens computed /
seconds until the last prompt's first token (``prefill_tok_s``: the prefill
rate of an ``--output-len 1`` run, a lower bound on it when decode steps come
between), the KV figures of the run (mean bytes allocated, mean bytes holding
live tokens, their ratio, preemptions), and the attention backend the
engine ran (``attention_backend``: ``torch`` or ``triton``, as resolved from
``--attention-backend``).

Every configuration runs in the same process, on the same weights and the
same prompts: the default store always; the paged store with ``--paged-kv``
(its row gains ``ratio_vs_default``); with ``--kv-quant int8|fp8`` the paged
store a second time with 8-bit blocks (``paged-int8``, gaining
``ratio_vs_paged``; the ``paged`` row stays unquantized); transformers'
continuous batching with ``--against hf`` (every row gains
``hf_output_tok_s`` and ``ratio_vs_hf``).
With ``--repeats N`` the configurations alternate run by run and the median
is reported, so that ratios hold on a noisy machine; each run starts with
the engine's cached prefixes forgotten (`LLM.reset_prefix_cache`), so no
repeat finds the prompts of the one before (before 2026-12-06 they did:
`--repeats` medians of prompt-heavy rows counted cached prompts).

What is timed: ours, ``LLM.generate`` from the call to its return, after a
small warm-up run on the same engine; transformers, from the first
``add_request`` to the last finished result, inside a started (and, on CUDA,
warmed-up) continuous batching manager, the machinery ``generate_batch``
wraps; it runs each request with its own ``max_new_tokens`` and EOS off,
exactly our workload. Where that API is missing, ``model.generate_batch`` runs
with one ``max_new_tokens`` (the largest) and the row says so
(``hf_api``); its tokens/s then counts the tokens it produced.
"""

from __future__ import annotations

import dataclasses
import gc
import inspect
import json
import platform
import random
import time
from typing import Callable

import torch

from .. import options as opt
from ..cache.layout import token_bytes
from ..llm import LLM
from ..params import SamplingParams
from .common import default_store, fastest_config, hf_model, kernel_compiles, load_for_bench, paged_configs

Workload = list[tuple[list[int], int]]  # (prompt ids, output tokens)


def make_workload(num_prompts: int, min_len: int, max_len: int, seed: int, vocab_size: int,
                  output_len: int | None = None) -> Workload:
    """nano-vllm's bench: token ids uniform in [0, 10000) (or the vocabulary,
    if smaller), input and output lengths each uniform in [min_len, max_len];
    every output ``output_len`` tokens when given (the prompts, and so the
    random draws of their ids, stay the same)."""
    rng = random.Random(seed)
    top = min(10000, vocab_size)
    work = []
    for _ in range(num_prompts):
        n_in = rng.randint(min_len, max_len)
        prompt = [rng.randrange(top) for _ in range(n_in)]
        n_out = rng.randint(min_len, max_len)
        work.append((prompt, n_out if output_len is None else output_len))
    return work


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _release(device: str) -> None:
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


@dataclasses.dataclass
class Run:
    seconds: float
    output_tokens: int
    stats: object = None  # KVStats (ours)
    error: str | None = None
    api: str | None = None
    compiles: int = 0  # Triton kernels compiled inside the timed run (kernel_compiles)

    @property
    def tok_s(self) -> float:
        return self.output_tokens / self.seconds if self.seconds > 0 else 0.0


def ours(model, tokenizer, options: opt.EngineOptions, work: Workload, device: str) -> Callable[[], Run]:
    """One engine for every repeat; warmed up on two tiny batches."""
    llm = LLM(model, tokenizer=tokenizer, engine_options=options)
    prompts = [p for p, _ in work]
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for _, n in work]
    for n in (16, 64):  # warm-up: the kernels' short and full tiles (SHORT_QUERIES) compile here, not in a
        # timed run; reversed prompt ids, so that no timed prompt finds a warm-up block in the prefix cache
        llm.generate([p[::-1][:n] for p in prompts[:4]], SamplingParams(max_tokens=4, ignore_eos=True),
                     use_tqdm=False)

    def run() -> Run:
        llm.reset_prefix_cache()  # each repeat computes its prompts: none finds the last repeat's blocks
        _sync(device)
        with kernel_compiles() as compiled:
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            _sync(device)
            dt = time.perf_counter() - t0
        produced = sum(len(o.outputs[0].token_ids) for o in outs)
        expected = sum(n for _, n in work)
        if produced != expected:
            raise RuntimeError(f"the engine produced {produced} output tokens, {expected} were asked for")
        return Run(dt, produced, llm.stats, compiles=len(compiled))

    run.llm = llm  # type: ignore[attr-defined]
    return run


# ---------------------------------------------------------------------------
# transformers


def hf_limits(engine, device: str) -> dict[str, int]:
    """transformers' continuous batching sized like our engine on the CPU (the
    same KV bytes, tokens per step and rows per step); there it would otherwise
    size its cache from most of the machine's RAM. On CUDA it keeps its own
    defaults (a share of free GPU memory, its own step sizes)."""
    if device.startswith("cuda"):
        return {}
    page = 256
    per_block = page * sum(token_bytes(engine.model.kv_spec(), engine.dtype))  # its cache is not quantized
    return {"page_size": page, "num_blocks": max(1, engine.cache_stats().kv_budget_bytes // per_block),
            "max_batch_tokens": engine.max_num_batched_tokens, "max_requests_per_batch": engine.max_num_seqs}


def hf_runner(hf, work: Workload, device: str, timeout: float | None = None,
              limits: dict[str, int] | None = None) -> Callable[[], Run]:
    from transformers import GenerationConfig

    max_new = max(n for _, n in work)

    def cb_config():
        if not limits:
            return None
        from transformers import ContinuousBatchingConfig

        known = inspect.signature(ContinuousBatchingConfig).parameters
        return ContinuousBatchingConfig(**{k: v for k, v in limits.items() if k in known})

    def config() -> GenerationConfig:
        return GenerationConfig(do_sample=False, max_new_tokens=max_new, eos_token_id=-1, pad_token_id=0)

    def per_request() -> Run:
        kwargs = {"generation_config": config(), "block": True, "timeout": 60}
        params = inspect.signature(hf.continuous_batching_context_manager).parameters
        if "warmup" in params:
            kwargs["warmup"] = True  # builds the cache (and captures CUDA graphs) before the clock starts
        if limits and "continuous_batching_config" in params:
            kwargs["continuous_batching_config"] = cb_config()
        # no_grad, not inference_mode: transformers' generation thread updates
        # in place tensors made here, which inference tensors refuse.
        with torch.no_grad(), hf.continuous_batching_context_manager(**kwargs) as manager:
            _sync(device)
            t0 = time.perf_counter()
            ids = [manager.add_request(p, max_new_tokens=n, eos_token_id=-1) for p, n in work]
            if any(i is None for i in ids):
                raise RuntimeError("transformers' manager dropped a request")
            done: dict[str, object] = {}
            try:
                wait(manager, ids, done, t0)
            except BaseException:
                if "hard_stop" in inspect.signature(manager.stop).parameters:
                    manager.stop(block=False, hard_stop=True)
                raise
            _sync(device)
            dt = time.perf_counter() - t0
        produced = sum(len(done[i].generated_tokens) for i in ids)
        return Run(dt, produced, api="continuous_batching_manager")

    def wait(manager, ids, done, t0) -> None:
        while len(done) < len(ids):
            if timeout is not None and time.perf_counter() - t0 > timeout:
                raise TimeoutError(f"--hf-timeout: {len(done)}/{len(ids)} requests finished in {timeout:g} s")
            result = manager.get_result(timeout=1)
            if result is None:
                if not manager.is_running():
                    raise RuntimeError(f"transformers' generation thread stopped after "
                                       f"{len(done)}/{len(ids)} requests")
                continue
            if result.is_finished():
                if getattr(result, "error", None):
                    raise RuntimeError(f"transformers' request failed: {result.error}")
                done[result.request_id] = result

    def whole_batch() -> Run:
        _sync(device)
        t0 = time.perf_counter()
        with torch.no_grad():
            extra = {"continuous_batching_config": cb_config()} if limits else {}
            results = hf.generate_batch([p for p, _ in work], generation_config=config(), max_new_tokens=max_new,
                                        **extra)
        _sync(device)
        dt = time.perf_counter() - t0
        produced = sum(len(r.generated_tokens) for r in results.values())
        return Run(dt, produced, api=f"generate_batch(max_new_tokens={max_new} for all)")

    use = [per_request if hasattr(hf, "continuous_batching_context_manager") else whole_batch]

    def run() -> Run:
        try:
            return use[0]()
        except Exception as e:  # noqa: BLE001 - reported in the row, the bench goes on
            if use[0] is per_request and isinstance(e, (AttributeError, TypeError, NotImplementedError)):
                use[0] = whole_batch
                try:
                    r = whole_batch()
                    r.api += f" (per-request API failed: {type(e).__name__}: {str(e)[:200]})"
                    return r
                except Exception as e2:  # noqa: BLE001
                    e = e2
            return Run(0.0, 0, error=f"{type(e).__name__}: {str(e)[:300]}")

    return run


# ---------------------------------------------------------------------------


def _check(args) -> None:
    if args.min_len > args.max_len:
        raise opt.OptionError(f"--min-len ({args.min_len}) must be <= --max-len ({args.max_len})")
    if args.hf_timeout is not None and not args.hf_timeout > 0:
        raise opt.OptionError(f"--hf-timeout must be > 0 seconds (got {args.hf_timeout})")
    for flag in ("hf_num_prompts", "hf_timeout"):
        if getattr(args, flag) is not None and args.against != "hf":
            raise opt.OptionError(f"{opt.flag_name(flag)} needs --against hf")


def run_throughput_bench(args, engine_options: opt.EngineOptions) -> int:
    _check(args)
    model, tokenizer, device, dtype, spec = load_for_bench(args, quantization="none")
    vocab = model.args.vocab_size if hasattr(model.args, "vocab_size") else 10000
    work = make_workload(args.num_prompts, args.min_len, args.max_len, args.seed, vocab, args.output_len)
    hf_work = work[: args.hf_num_prompts] if args.hf_num_prompts else work

    paged = engine_options.paged_kv
    if args.stores == "paged" and paged is None:
        raise opt.OptionError("--stores paged needs --paged-kv")
    configs: dict[str, opt.EngineOptions] = {}
    unquantized = dataclasses.replace(engine_options, kv_quant="none")
    if paged is None or args.stores == "both":
        configs["default"] = default_store(engine_options)
    configs.update(paged_configs(unquantized, device))
    if engine_options.kv_quant != "none":
        configs[f"paged-{engine_options.kv_quant}"] = engine_options
    models = dict.fromkeys(configs, model)
    quantization = opt.resolve_quantization(args.quantization)
    if quantization != "none":  # quantized weights against the same store's float row
        configs[quantization] = fastest_config(engine_options, device)
        models[quantization] = load_for_bench(args, quantization=quantization)[0]
    runs: dict[str, list[Run]] = {name: [] for name in configs}
    ran: dict[str, dict] = {}  # name -> what its engine ran with: attention backend, KV capacity
    # One engine at a time: on CUDA the paged pool takes most free memory, and
    # transformers' cache wants it after us.
    engines = {}
    limits: dict[str, int] = {}
    hf_run = None
    interrupted = False
    try:  # Ctrl-C or SIGINT (a time limit): report what was measured
        for name, options in configs.items():
            engines[name] = ours(models[name], tokenizer, options, work, device)
            engine = engines[name].llm.engine
            ran[name] = {"attention_backend": engine.attention_backend,
                         "kv_capacity_bytes": engine.kv_usage().capacity,
                         "async_scheduling": engine.async_scheduling}
            limits = hf_limits(engine, device)
            del engine  # on CUDA the pool goes with engines[name], below
            if device.startswith("cuda"):
                for _ in range(args.repeats):
                    runs[name].append(engines[name]())
                del engines[name]
                _release(device)
        if args.against == "hf":
            try:
                hf = hf_model(spec, args.random_weights, model, device, dtype)
                hf_run = hf_runner(hf, hf_work, device, args.hf_timeout, limits)
                runs["hf"] = []
            except Exception as e:  # noqa: BLE001 - reported, the bench goes on
                runs["hf"] = [Run(0.0, 0, error=f"{type(e).__name__}: {str(e)[:300]}")]
        for _ in range(args.repeats):  # CPU: interleaved, run by run
            for name, run in engines.items():
                runs[name].append(run())
            if hf_run is not None:
                runs["hf"].append(hf_run())
    except KeyboardInterrupt:
        interrupted = True
        if args.against == "hf" and not runs.get("hf"):
            runs["hf"] = [Run(0.0, 0, error="interrupted before transformers finished")]
    _report(args, spec, device, dtype, configs, work, hf_work, runs, ran, limits if hf_run else None,
            interrupted)
    return 130 if interrupted else 0


def _median_run(runs: list[Run]) -> Run:
    ok = [r for r in runs if r.error is None]
    if not ok:
        return runs[0]
    ok.sort(key=lambda r: r.tok_s)
    return ok[(len(ok) - 1) // 2]


def _report(args, spec, device, dtype, configs, work, hf_work, runs, ran, limits, interrupted=False) -> None:
    base = {
        "model": spec, "random_weights": bool(args.random_weights), "device": device,
        "dtype": str(dtype).removeprefix("torch."), "num_prompts": len(work),
        "min_len": args.min_len, "max_len": args.max_len, "output_len": args.output_len, "seed": args.seed,
        "input_tokens": sum(len(p) for p, _ in work), "requested_output_tokens": sum(n for _, n in work),
        "repeats": args.repeats, "threads": torch.get_num_threads(), "machine": platform.machine(),
    }
    hf = None
    if "hf" in runs:
        hf = _median_run(runs["hf"])
    rows = []
    if interrupted:
        base["interrupted"] = True
    for name, options in configs.items():
        store = "default" if options.paged_kv is None else "paged"
        if not runs.get(name):
            rows.append({"name": f"pagedlm-{name}", **base, "store": store, "error": "interrupted"})
            continue
        r = _median_run(runs[name])
        s = r.stats
        row = {"name": f"pagedlm-{name}", **base, "store": store,
               "block_size": options.paged_kv.block_size if options.paged_kv else None,
               "attention_backend": ran[name]["attention_backend"],
               "kv_quant": options.kv_quant, "quantization": name if name in opt.QUANTIZATIONS else "none",
               "compiled": options.compile, "async_scheduling": ran[name]["async_scheduling"],
               "output_tok_s": round(r.tok_s, 2), "elapsed_s": round(r.seconds, 3),
               "total_tok_s": round((base["input_tokens"] + r.output_tokens) / r.seconds, 2),
               "prefill_tok_s": round(s.prompt_tokens / s.prefill_s, 2) if s.prefill_s > 0 else None,
               "output_tokens": r.output_tokens,
               "all_output_tok_s": [round(x.tok_s, 2) for x in runs[name]],
               "kernel_compiles_in_runs": [x.compiles for x in runs[name]],
               "kv_bytes_allocated": round(s.kv_bytes_allocated), "kv_bytes_live": round(s.kv_bytes_live),
               "kv_live_fraction": round(s.live_fraction, 4),
               "kv_bytes_padded": round(s.kv_bytes_padded),
               "peak_kv_bytes_allocated": s.peak_kv_bytes_allocated,
               "kv_capacity_bytes": ran[name]["kv_capacity_bytes"],
               "peak_running": s.peak_running, "steps": s.steps, "preemptions": s.preemptions}
        if name != "default" and runs.get("default"):
            row["ratio_vs_default"] = round(r.tok_s / _median_run(runs["default"]).tok_s, 3)
        paged = next((k for k, o in configs.items() if o.paged_kv and o.kv_quant == "none" and runs.get(k)), None)
        if options.kv_quant != "none" and paged is not None:
            row["ratio_vs_paged"] = round(r.tok_s / _median_run(runs[paged]).tok_s, 3)
        same_store = next((k for k, o in configs.items() if o == options and k != name and runs.get(k)), None)
        if name in opt.QUANTIZATIONS and same_store is not None:
            row["ratio_vs_unquantized"] = round(r.tok_s / _median_run(runs[same_store]).tok_s, 3)
        if hf is not None:
            row["hf_output_tok_s"] = round(hf.tok_s, 2) if hf.error is None else None
            row["hf_elapsed_s"] = round(hf.seconds, 3) if hf.error is None else None
            row["hf_num_prompts"] = len(hf_work)
            row["ratio_vs_hf"] = round(r.tok_s / hf.tok_s, 3) if hf.error is None and hf.tok_s else None
            if hf.api:
                row["hf_api"] = hf.api
            if limits:
                row["hf_cb_config"] = limits
            if hf.error:
                row["hf_error"] = hf.error
        rows.append(row)
    if hf is not None and hf.error is not None and not rows:
        rows.append({"name": "hf", **base, "hf_error": hf.error})
    for row in rows:
        if args.json:
            print(json.dumps(row), flush=True)
            continue
        if "error" in row:
            print(f"{row['name']:16s} {row['error']}", flush=True)
            continue
        line = (f"{row['name']:16s} {row['num_prompts']} prompts, lengths {args.min_len}..{args.max_len}: "
                f"{row['output_tokens']} output tokens in {row['elapsed_s']:.2f} s = "
                f"{row['output_tok_s']:.1f} tok/s ({row['total_tok_s']:.0f} tok/s with the prompts, "
                f"prefill {row['prefill_tok_s'] or 0:.0f} tok/s) | KV live {100 * row['kv_live_fraction']:.1f}% of "
                f"{row['kv_bytes_allocated'] / 2**20:.1f} MiB allocated (mean), "
                f"preemptions {row['preemptions']}")
        if "ratio_vs_default" in row:
            line += f" | x{row['ratio_vs_default']} vs default"
        if "ratio_vs_paged" in row:
            line += f" | x{row['ratio_vs_paged']} vs paged"
        if "ratio_vs_unquantized" in row:
            line += f" | x{row['ratio_vs_unquantized']} vs unquantized weights"
        if "hf_output_tok_s" in row:
            if row["hf_output_tok_s"] is None:
                line += f" | transformers failed: {row.get('hf_error')}"
            else:
                note = "" if row["hf_num_prompts"] == row["num_prompts"] else f" on {row['hf_num_prompts']} prompts"
                line += (f" | transformers {row['hf_output_tok_s']:.1f} tok/s{note}: x{row['ratio_vs_hf']}")
        print(line, flush=True)
