"""`pagedlm bench decode`: batch-1 prefill and decode speed, medians of repeats.

Every configuration of one invocation runs in the same process on the same
weights, interleaved repeat by repeat, so that the ratios between them hold
even on a noisy machine: the default cache always; the paged cache with
``--paged-kv``; the same model with ``--quantization int8|int4`` weights;
Hugging Face transformers' ``generate`` with ``--against hf``;
llama-cpp-python on the same GGUF file with ``--against llama.cpp``; with
``--speculative ngram`` each store again with speculative decoding (rows
``default-ngram``, ``paged-ngram``, ...), on the same prompts, beside its
plain row; with ``--compile`` the default store's rows (``default`` and the
quantized one) again with the compiled CPU decode step (``default-compiled``,
``int4-compiled``, ...), beside their eager rows.

Prompts: ``--workload filler`` (the default) repeats one paragraph;
``--workload grounded`` asks the model to copy a passage it is given
(stdlib module docstrings, which every Python ships), the input-grounded
work that prompt lookup speeds up: a chat prompt when the model has a
template.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import platform
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from .. import options as opt
from ..batch.engine import LLMEngine
from ..cache.layout import kv_bytes
from ..loading.catalog import BUILTINS
from ..models.layers import Embedding
from ..params import SamplingParams
from ..speculative import SpecStats
from .common import default_store, fastest_config, hf_model, load_for_bench, paged_configs, shared_budget

FILLER = (
    "The history of the printing press begins in the fifteenth century, when movable type "
    "changed how books were made, sold and read across Europe and far beyond. "
)


@dataclass
class Timing:
    prefill_tok_s: list[float] = field(default_factory=list)
    decode_tok_s: list[float] = field(default_factory=list)
    spec: SpecStats | None = None  # our engines: what speculation did in the timed runs
    proposer: object = None  # and who proposed (pagedlm.speculative.Proposer; None: no speculation)

    def add(self, prefill: float, decode: float) -> None:
        self.prefill_tok_s.append(prefill)
        self.decode_tok_s.append(decode)


def prompt_ids(tokenizer, n: int) -> list[int]:
    ids = tokenizer.encode(FILLER * (n // 8 + 8))
    return ids[:n]


PASSAGE_MODULES = ("argparse", "json", "heapq", "inspect", "difflib", "collections")  # docstrings: ~9k characters
COPY_TASK = "Here is a passage:\n\n{passage}\n\nRepeat the passage exactly, word for word."
COPY_START = 6  # words of the passage that begin the reply, so that small models copy rather than summarise


def grounded_ids(tokenizer, n: int) -> list[int]:
    """At most ``n`` tokens asking the model to repeat a passage (as much of
    the stdlib docstrings as fits), its reply begun with the passage's
    first words: through the chat template when there is one."""
    import importlib

    words = " ".join(importlib.import_module(m).__doc__ or "" for m in PASSAGE_MODULES).split()

    def ids(k: int) -> list[int]:
        task, start = COPY_TASK.format(passage=" ".join(words[:k])), " ".join(words[:COPY_START])
        if getattr(tokenizer, "chat_template", None) is None:  # (random weights: a tokenizer without one)
            return tokenizer.encode(f"{task}\n\n{start}")
        return tokenizer.encode_chat([{"role": "user", "content": task}, {"role": "assistant", "content": start}],
                                     add_generation_prompt=False, continue_final_message=True)

    low, high = COPY_START, len(words)  # the most words that fit
    if len(ids(low)) > n:
        raise opt.OptionError(f"--workload grounded: the shortest copy prompt is {len(ids(low))} tokens, "
                              f"more than --prompt-len {n}")
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if len(ids(mid)) <= n else (low, mid - 1)
    return ids(low)


WORKLOADS = {"filler": prompt_ids, "grounded": grounded_ids}
SPECULATION = ("speculative", "num_speculative_tokens", "ngram_min", "ngram_max", "draft_model")


def _ours(model, tokenizer, engine_options: opt.EngineOptions, gen_len: int) -> Callable:
    engine = LLMEngine(model, tokenizer, engine_options)
    options = SamplingParams(max_tokens=gen_len, ignore_eos=True)

    def run(ids: list[int]) -> tuple[float, float]:
        last = None
        for last in engine.stream(ids, options):
            pass
        return last.prompt_tps, last.generation_tps

    run.engine = engine  # its speculative counters, for the report
    return run


def _hf(hf, device: str, gen_len: int) -> Callable:
    """transformers' generate on the same weights: prefill = time to one new
    token; decode = the remaining tokens over the remaining time. On CUDA
    with a static cache, which transformers compiles (``torch.compile``) for
    decoding: the fastest ``generate`` it offers."""
    cuda = device.startswith("cuda")
    extra = {"cache_implementation": "static"} if cuda else {}

    def timed(ids: torch.Tensor, n: int) -> float:
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = hf.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, **extra)
        if cuda:
            torch.cuda.synchronize()
        assert out.shape[1] == ids.shape[1] + n
        return time.perf_counter() - t0

    def run(ids: list[int]) -> tuple[float, float]:
        x = torch.tensor([ids], device=device)
        with torch.inference_mode():
            t1 = timed(x, 1)
            tn = timed(x, gen_len)
        return len(ids) / t1, (gen_len - 1) / max(tn - t1, 1e-9)

    return run


def copy_bandwidth(device: str, nbytes: int = 1 << 30) -> float:
    """Device-to-device copy bandwidth, bytes read + written per second
    (median of 20 copies of ``nbytes``): the roofline's denominator."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    times = []
    for _ in range(25):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del src, dst
    return 2 * nbytes / statistics.median(times[5:])


def bytes_per_decode_step(model, context: int) -> int:
    """The fewest bytes one batch-1 decode step reads: every weight a product
    reads, once (a quantized layer's kernel buffers, not its row copy; an
    embedding only as the tied head: a lookup reads one row), and the keys
    and values of ``context`` tokens (a sliding layer's window at most)."""
    tied = bool(getattr(model.args, "tie_word_embeddings", False))
    seen = set()  # storages counted, or that no product reads
    for m in model.modules():
        if isinstance(m, Embedding):
            held = [m.weight] if m.quant is None else list(m.quant.buffers())
            read = ([m.weight] if m.quant is None else m.quant.linear_buffers()) if tied else []
            seen |= _storages(held) - _storages(read)
    weights = 0
    for t in [*model.parameters(), *model.buffers()]:
        if t.untyped_storage().data_ptr() not in seen:
            seen.add(t.untyped_storage().data_ptr())
            weights += t.untyped_storage().nbytes()
    specs = model.kv_spec()
    elem = next(model.parameters()).element_size()  # the model dtype (norms stay float when quantized)
    per_token = [2 * sp.num_kv_heads * sp.head_dim * elem for sp in specs]
    return weights + kv_bytes(specs, per_token, [context])


def _storages(tensors) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in tensors}


def gguf_path(spec: str):
    """The GGUF file behind a built-in name or a .gguf path, else None."""
    if spec in BUILTINS:
        return BUILTINS[spec].locate()
    path = Path(spec).expanduser()
    return path if path.is_file() and path.suffix == ".gguf" else None


def _llama_cpp(path, gen_len: int, n_ctx: int) -> Callable:
    """llama-cpp-python on the GGUF file itself, greedy, on the same prompt ids:
    prefill = one eval of the prompt; decode = gen_len - 1 single-token evals."""
    import numpy as np
    from llama_cpp import Llama

    llm = Llama(model_path=str(path), n_ctx=n_ctx, n_batch=n_ctx, n_threads=torch.get_num_threads(),
                n_threads_batch=torch.get_num_threads(), verbose=False)

    def run(ids: list[int]) -> tuple[float, float]:
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(ids)
        token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        t1 = time.perf_counter()
        for _ in range(gen_len - 1):
            llm.eval([token])
            token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        t2 = time.perf_counter()
        return len(ids) / (t1 - t0), (gen_len - 1) / (t2 - t1)

    return run


def run_decode_bench(args, engine_options: opt.EngineOptions) -> int:
    device = opt.resolve_device(args.device)
    spec = args.model or opt.DEFAULT_MODEL
    quantization = opt.resolve_quantization(args.quantization)
    if args.against == "llama.cpp":
        if importlib.util.find_spec("llama_cpp") is None:
            raise opt.OptionError("--against llama.cpp needs llama-cpp-python, which is not installed "
                                  "(pip install llama-cpp-python; it builds from source, ~11 minutes on 2 cores)")
        if args.random_weights or gguf_path(spec) is None:
            raise opt.OptionError("--against llama.cpp needs a GGUF model (a built-in name or a .gguf file)")
        if device != "cpu":
            raise opt.OptionError("--against llama.cpp runs on the CPU: add --device cpu")
    if args.prefix_caching or opt.env_flag(opt.PREFIX_CACHING_ENV):
        raise opt.OptionError("bench decode prefills each repeat cold (every repeat sends the same prompt): "
                              "--prefix-caching does not apply")
    if engine_options.paged_kv is not None:  # every repeat sends the same prompt: a prefix hit
        # would make "prefill" one token's step, so each repeat prefills cold
        engine_options = dataclasses.replace(
            engine_options, paged_kv=dataclasses.replace(engine_options.paged_kv, prefix_caching=False))
    model, tokenizer, device, dtype, spec = load_for_bench(args, quantization="none")
    speculation = {name: getattr(engine_options, name) for name in SPECULATION}
    method = speculation["speculative"]
    compiled = engine_options.compile
    engine_options = dataclasses.replace(engine_options, **dict.fromkeys(SPECULATION),  # the plain rows: eager
                                         compile=False)
    kv_quant = engine_options.kv_quant
    unquantized = dataclasses.replace(engine_options, kv_quant="none")
    store_options = {"default": default_store(engine_options), **paged_configs(unquantized, device)}
    configs = dict(store_options)
    if method is not None:  # each store again, speculating, beside its plain row
        configs.update({f"{name}-{method}": dataclasses.replace(options, **speculation)
                        for name, options in store_options.items()})
    if kv_quant != "none":  # 8-bit blocks against the unquantized paged store, same run
        configs[f"paged-{kv_quant}"] = engine_options
    models = dict.fromkeys(configs, model)
    if quantization != "none":
        models[quantization] = load_for_bench(args, quantization=quantization)[0]
        configs[quantization] = fastest_config(unquantized, device)
    if compiled:  # the default store's rows again, compiled, beside their eager rows
        for name in ["default"] + [quantization] * (quantization != "none"):
            configs[f"{name}-compiled"] = dataclasses.replace(configs[name], compile=True)
            models[f"{name}-compiled"] = models[name]
    alive = len(configs) + (args.against == "hf")  # every runner lives through the rounds
    configs = {name: shared_budget(options, device, alive) for name, options in configs.items()}  # before any pool
    runners: dict[str, Callable] = {name: _ours(models[name], tokenizer, options, args.gen_len)
                                    for name, options in configs.items()}
    if args.against == "hf":
        runners["hf"] = _hf(hf_model(spec, args.random_weights, model, device, dtype), device, args.gen_len)
    if args.against == "llama.cpp":
        runners["llama.cpp"] = _llama_cpp(gguf_path(spec), args.gen_len, max(args.prompt_len) + args.gen_len + 8)
    bandwidth = copy_bandwidth(device) if device.startswith("cuda") else None

    for name, run in runners.items():  # (the warm-up's shorter prompt would be named instead)
        if hasattr(run, "engine") and max(args.prompt_len) + args.gen_len > run.engine.max_model_len:
            raise opt.OptionError(f"--prompt-len {max(args.prompt_len)} plus --gen-len {args.gen_len} exceeds "
                                  f"max_model_len ({run.engine.max_model_len})")
    for n in args.prompt_len:
        ids = WORKLOADS[args.workload](tokenizer, n)
        if len(ids) < n and args.workload == "filler":
            raise opt.OptionError(f"could not build a {n}-token prompt")
        for name, run in runners.items():  # warm-up: allocator, caches, kernels, compilation
            run(ids if name == "hf" else ids[: min(n, 32)])
        timings = {name: Timing() for name in runners}
        before = {name: dataclasses.replace(run.engine.spec_stats) for name, run in runners.items()
                  if hasattr(run, "engine")}
        for _ in range(args.repeats):
            for name, run in runners.items():
                timings[name].add(*run(ids))
        for name, start in before.items():  # the timed runs' speculation counters
            timings[name].proposer = runners[name].engine.proposer
            timings[name].spec = runners[name].engine.spec_stats.since(start)
        roofline = None
        if bandwidth is not None:  # per row: a quantized model reads fewer bytes
            step_bytes = {name: bytes_per_decode_step(models.get(name, model), n + args.gen_len // 2)
                          for name in runners}
            roofline = {"copy_bandwidth_gb_s": round(bandwidth / 1e9, 1), "bytes_per_step": step_bytes,
                        "roofline_ms": {k: b / bandwidth * 1e3 for k, b in step_bytes.items()}}
        _report(args, spec, device, dtype, len(ids), engine_options.paged_kv, timings, roofline, speculation)
    return 0


KV_QUANT_ROWS = tuple(f"paged-{m}" for m in opt.KV_QUANT_MODES if m != "none")


def _report(args, spec, device, dtype, n, paged, timings: dict[str, Timing], roofline: dict | None,
            speculation: dict) -> None:
    med = {k: (statistics.median(t.prefill_tok_s), statistics.median(t.decode_tok_s))
           for k, t in timings.items()}
    base = {
        "model": spec, "random_weights": bool(args.random_weights), "device": device,
        "dtype": str(dtype).removeprefix("torch."), "prompt_len": n, "gen_len": args.gen_len,
        "repeats": args.repeats, "threads": torch.get_num_threads(), "machine": platform.machine(),
        "workload": args.workload,
    }
    if device.startswith("cuda"):
        base["gpu"] = torch.cuda.get_device_name(device)
    if roofline is not None:
        base["copy_bandwidth_gb_s"] = roofline["copy_bandwidth_gb_s"]
    rows = []
    against = next((k for k in ("hf", "llama.cpp") if k in med), None)
    tag = {"hf": "hf", "llama.cpp": "llama_cpp"}.get(against)
    for name in med:
        if name == against:
            continue
        method = speculation["speculative"]
        plain = name.removesuffix(f"-{method}") if method and name.endswith(f"-{method}") else None
        eager = name.removesuffix("-compiled")
        paged_row = name.startswith("paged") or (name in opt.QUANTIZATIONS and paged is not None)
        row = {"name": f"pagedlm-{name}", **base,
               "prefill_tok_s": round(med[name][0], 2), "decode_tok_s": round(med[name][1], 2),
               "decode_ms_per_token": round(1e3 / med[name][1], 3),
               "paged_kv": paged_row,
               "block_size": paged.block_size if paged_row else None,
               "prefix_caching": paged.prefix_caching if paged_row else None,
               "kv_quant": name.removeprefix("paged-") if name in KV_QUANT_ROWS else "none",
               "quantization": eager if eager in opt.QUANTIZATIONS else "none", "compiled": eager != name}
        if plain is not None:  # a speculating row: what it proposed and kept, and its speedup on the same prompt
            stats, proposer = timings[name].spec, timings[name].proposer
            row.update(speculative=method, num_speculative_tokens=proposer.num_speculative_tokens,
                       acceptance_rate=round(stats.acceptance_rate, 3),
                       mean_accepted_length=round(stats.mean_accepted_length, 3),
                       decode_ratio_vs_plain=round(med[name][1] / med[plain][1], 3))
            if method == "ngram":
                row.update(ngram_min=proposer.ngram_min, ngram_max=proposer.ngram_max)
        if roofline is not None:
            row.update(bytes_per_step=roofline["bytes_per_step"][name],
                       roofline_ms_per_token=round(roofline["roofline_ms"][name], 4),
                       roofline_fraction=round(roofline["roofline_ms"][name] * med[name][1] / 1e3, 3))
        if eager != name:  # a compiled row against its eager row, same run
            row["decode_ratio_vs_eager"] = round(med[name][1] / med[eager][1], 3)
            row["prefill_ratio_vs_eager"] = round(med[name][0] / med[eager][0], 3)
        if name != "default":
            row["decode_ratio_vs_default"] = round(med[name][1] / med["default"][1], 3)
            row["prefill_ratio_vs_default"] = round(med[name][0] / med["default"][0], 3)
        if against:
            row[f"{tag}_prefill_tok_s"] = round(med[against][0], 2)
            row[f"{tag}_decode_tok_s"] = round(med[against][1], 2)
            row[f"{tag}_decode_ms_per_token"] = round(1e3 / med[against][1], 3)
            if roofline is not None:
                row[f"{tag}_roofline_fraction"] = round(roofline["roofline_ms"][against] * med[against][1] / 1e3, 3)
            row[f"prefill_ratio_vs_{tag}"] = round(med[name][0] / med[against][0], 3)
            row[f"decode_ratio_vs_{tag}"] = round(med[name][1] / med[against][1], 3)
        rows.append(row)
    for row in rows:
        if args.json:
            print(json.dumps(row), flush=True)
        else:
            extra = "".join(
                f"  {k}={row[k]}" for k in ("decode_ratio_vs_default", "decode_ratio_vs_eager", "decode_ratio_vs_plain",
                                            "acceptance_rate", "mean_accepted_length", "roofline_fraction",
                                            f"{tag}_decode_tok_s",
                                            f"decode_ratio_vs_{tag}") if k in row)
            print(f"{row['name']:20s} prompt {n:5d}  prefill {row['prefill_tok_s']:9.1f} tok/s  "
                  f"decode {row['decode_tok_s']:7.2f} tok/s{extra}", file=sys.stdout, flush=True)
