"""`pagedlm generate | chat | serve | bench | models`.

Errors a user can act on (a missing model, a bad flag value, a refused
combination) are one line on stderr and exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Sequence

from . import options as opt


class CliError(Exception):
    """A one-line error for the user."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line instead of usage + message
        raise CliError(f"{self.prog}: {message}")


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help=f"built-in name, .gguf file or HF folder (default {opt.DEFAULT_MODEL})")
    p.add_argument("--device", default=None, help="auto (default), cpu or cuda")
    p.add_argument("--dtype", default=None, help="auto (float32 on CPU, bfloat16 on CUDA), float32, bfloat16, float16")
    _add_quantization_arg(p)


def _add_quantization_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quantization", default=None, metavar="{" + ",".join(opt.QUANTIZATIONS) + "}",
                   help=f"weight-only quantization of linear layers and embedding "
                        f"(env {opt.QUANTIZATION_ENV}; default {opt.DEFAULT_QUANTIZATION})")


def _add_paged_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--paged-kv", action=argparse.BooleanOptionalAction, default=None,
                   help=f"page full-attention KV caches (env {opt.PAGED_KV_ENV}=1|0; default off)")
    p.add_argument("--paged-kv-block-size", default=None, metavar="N",
                   help=f"tokens per KV block (default {opt.DEFAULT_BLOCK_SIZE})")


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temp", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="pagedlm", description="Run and serve language models, with an optional paged KV cache.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    g = sub.add_parser("generate", help="stream a completion of PROMPT to stdout")
    _add_model_args(g)
    _add_sampling_args(g)
    _add_paged_args(g)
    g.add_argument("--chat", action="store_true", help="wrap PROMPT in the model's chat template")
    g.add_argument("--system", default=None, help="system message (with --chat)")
    g.add_argument("prompt", help="the prompt; - reads standard input")

    c = sub.add_parser("chat", help="interactive chat that keeps the conversation's KV cache")
    _add_model_args(c)
    _add_sampling_args(c)
    _add_paged_args(c)
    c.add_argument("--system", default=None, help="system message")

    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    for row in opt.SERVER_FLAGS:
        s.add_argument("--" + row.name.replace("_", "-"), dest=row.name, default=None,
                       help=f"{row.help} (env {row.env})")
    _add_paged_args(s)

    b = sub.add_parser("bench", help="measure speed")
    bsub = b.add_subparsers(dest="bench", required=True, parser_class=_Parser)
    d = bsub.add_parser("decode", help="batch-1 prefill and decode tok/s "
                        "(with --paged-kv: paged and default caches, interleaved)")
    _add_model_args(d)
    _add_paged_args(d)
    d.add_argument("--prompt-len", type=int, nargs="+", default=[256], help="one or more prompt lengths")
    d.add_argument("--gen-len", type=int, default=64)
    d.add_argument("--repeats", type=int, default=3, help="runs per configuration; medians are reported")
    d.add_argument("--against", choices=["hf", "llama.cpp"], default=None,
                   help="also time transformers' generate on the same weights (hf) or "
                        "llama-cpp-python on the same GGUF (llama.cpp), interleaved")
    d.add_argument("--random-weights", action="store_true",
                   help="--model is a folder with a config.json: random weights of that shape")
    d.add_argument("--json", action="store_true", help="one JSON object per configuration")

    pp = bsub.add_parser("ppl", help="perplexity on real text (the Python language reference), "
                         "none against --quantization")
    _add_model_args(pp)
    pp.set_defaults(quantization_help="comma list allowed: int8,int4")
    pp.add_argument("--tokens", default=20480, help="text tokens to score (default 20480)")
    pp.add_argument("--window", default=1024, help="tokens per window, BOS included (default 1024)")
    pp.add_argument("--json", action="store_true", help="one JSON object per quantization mode")

    sub.add_parser("models", help="list built-in models")
    return parser


def _sampling_options(args, paged: opt.PagedKvOptions | None) -> opt.GenerateOptions:
    options = opt.GenerateOptions(
        max_tokens=args.max_tokens, temperature=args.temp, top_p=args.top_p, top_k=args.top_k,
        min_p=args.min_p, repetition_penalty=args.repetition_penalty, seed=args.seed, paged_kv=paged,
    )
    options.validate()
    return options


def _load(args):
    from .loading import load

    device = opt.resolve_device(args.device)
    dtype = opt.resolve_dtype(args.dtype, device)
    quantization = opt.resolve_quantization(args.quantization)
    return load(args.model or opt.DEFAULT_MODEL, device, dtype, quantization=quantization)


def cmd_generate(args) -> int:
    from .generate import stream_generate

    paged = opt.resolve_paged_kv(args.paged_kv, args.paged_kv_block_size)
    options = _sampling_options(args, paged)
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    if not prompt:
        raise CliError("pagedlm generate: the prompt is empty")
    model, tokenizer = _load(args)
    if args.chat:
        messages = ([{"role": "system", "content": args.system}] if args.system else [])
        ids = tokenizer.encode_chat(messages + [{"role": "user", "content": prompt}])
    else:
        ids = tokenizer.encode(prompt)
    last = None
    for last in stream_generate(model, tokenizer, ids, options):
        sys.stdout.write(last.text)
        sys.stdout.flush()
    sys.stdout.write("\n")
    sys.stdout.flush()
    _print_stats(last)
    return 0


def _print_stats(r) -> None:
    if r is None:
        return
    paged = " (paged KV)" if r.paged_kv else ""
    print(
        f"prompt: {r.prompt_tokens} tokens, {r.prompt_tps:.1f} tok/s | "
        f"generation: {r.generation_tokens} tokens, {r.generation_tps:.1f} tok/s{paged}",
        file=sys.stderr,
    )


def cmd_chat(args) -> int:
    from .cache.prompt import PromptCache
    from .generate import make_cache, stream_generate

    paged = opt.resolve_paged_kv(args.paged_kv, args.paged_kv_block_size)
    options = _sampling_options(args, paged)
    model, tokenizer = _load(args)
    # One entry: the conversation so far. Paged turns re-prefill (no reuse in v1).
    kept = PromptCache(max_bytes=0 if paged else 1 << 62)
    messages = [{"role": "system", "content": args.system}] if args.system else []
    print("Type a message; Ctrl-D or /exit quits, /reset starts over.", file=sys.stderr)
    while True:
        try:
            line = input(">>> ")
        except (EOFError, KeyboardInterrupt):
            print(file=sys.stderr)
            return 0
        if line.strip() in ("/exit", "/quit"):
            return 0
        if line.strip() == "/reset":
            messages = messages[:1] if args.system else []
            kept = PromptCache(max_bytes=0 if paged else 1 << 62)
            continue
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line})
        ids = tokenizer.encode_chat(messages)
        cache, _ = kept.take(ids)
        cache = cache or make_cache(model)
        reply, tokens, last = [], [], None
        for last in stream_generate(model, tokenizer, ids, options, cache=cache):
            sys.stdout.write(last.text)
            sys.stdout.flush()
            reply.append(last.text)
            tokens.append(last.token)
        sys.stdout.write("\n")
        sys.stdout.flush()
        _print_stats(last)
        messages.append({"role": "assistant", "content": "".join(reply)})
        if not paged:
            kept.put(ids + tokens[:-1], cache)


def cmd_serve(args) -> int:
    from .server import run

    flags = {row.name: getattr(args, row.name) for row in opt.SERVER_FLAGS}
    flags["paged_kv"] = args.paged_kv
    flags["paged_kv_block_size"] = args.paged_kv_block_size
    options = opt.ServerOptions.resolve(flags)
    opt.resolve_device(options.device)
    return run(options) or 0


def cmd_bench(args) -> int:
    from .bench.decode import run_decode_bench

    if args.bench == "ppl":
        from .bench.ppl import run_ppl_bench

        return run_ppl_bench(args)
    paged = opt.resolve_paged_kv(args.paged_kv, args.paged_kv_block_size)
    return run_decode_bench(args, paged)


def cmd_models(args) -> int:
    from .loading.catalog import list_models

    for entry in list_models():
        print(f"{entry.name:24s} {'installed' if entry.installed else 'not installed':14s} {entry.description}")
    return 0


COMMANDS = {"generate": cmd_generate, "chat": cmd_chat, "serve": cmd_serve,
            "bench": cmd_bench, "models": cmd_models}


def main(argv: Sequence[str] | None = None) -> int:
    from .loading import ModelNotFound

    try:
        args = build_parser().parse_args(argv)
        return COMMANDS[args.command](args)
    except (CliError, opt.OptionError, ModelNotFound) as e:
        print(f"error: {e}" if not str(e).startswith("pagedlm") else str(e), file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
