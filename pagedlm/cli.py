"""`pagedlm generate | chat | serve | bench | models`.

Errors a user can act on (a missing model, a bad flag value, a refused
combination) are one line on stderr and exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Iterator, Sequence

from . import __version__
from . import options as opt
from .params import SamplingParams, check_structured_outputs


CHAT_PROMPT_CACHE_BYTES = 1 << 62  # one conversation: keep all of it
PREFILL_BAR_AFTER_S = 2.0  # a prefill that has taken longer shows its progress on stderr


class CliError(Exception):
    """A one-line error for the user."""


class _HelpFormatter(argparse.HelpFormatter):
    """Every option's help ends with its default, unless the help says it already."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if not action.option_strings or "default" in text or action.default is argparse.SUPPRESS:
            return text
        return f"{text} (default: {_shown(action.default)})".lstrip().replace("%", "%%")


def _shown(value: object) -> str:
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, (list, tuple)):
        return ", ".join(map(str, value))
    return str(value)


class _Parser(argparse.ArgumentParser):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, formatter_class=_HelpFormatter, **kwargs)

    def error(self, message: str) -> None:  # one line instead of usage + message
        raise CliError(f"{self.prog}: {message}")


class _AtLeast(argparse.Action):
    """An integer option (each value, with nargs) of at least ``low``."""

    def __init__(self, *args, low: int = 1, **kwargs) -> None:
        super().__init__(*args, type=int, **kwargs)
        self.low = low

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        for value in values if isinstance(values, list) else [values]:
            if value < self.low:
                raise argparse.ArgumentError(None, f"{option_string} must be >= {self.low} (got {value})")
        setattr(namespace, self.dest, values)


def _row_help(row: opt.Flag, defaults: object) -> str:
    """A row's help, its environment variable, and its default unless the help says it."""
    if "default" in row.help:
        return f"{row.help} (env {row.env})"
    return f"{row.help} (env {row.env}; default {_shown(getattr(defaults, row.name))})"


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help=f"built-in name, .gguf file or HF folder (default {opt.DEFAULT_MODEL})")
    p.add_argument("--device", default=None, help="auto (default: CUDA when present), cpu or cuda")
    p.add_argument("--dtype", default=None,
                   help="auto (default: float32 on CPU, bfloat16 on CUDA), float32, bfloat16, float16")
    _add_quantization_arg(p)


def _add_quantization_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quantization", default=None, metavar="{" + ",".join(opt.QUANTIZATIONS) + "}",
                   help=f"weight-only quantization of linear layers and embedding "
                        f"(env {opt.QUANTIZATION_ENV}; default {opt.DEFAULT_QUANTIZATION})")


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--paged-kv", action=argparse.BooleanOptionalAction, default=None,
                   help=f"page the KV cache in blocks (env {opt.PAGED_KV_ENV}=1|0; default on for CUDA, "
                        f"off on the CPU)")
    p.add_argument("--paged-kv-block-size", default=None, metavar="N",
                   help=f"tokens per KV block (default {opt.DEFAULT_BLOCK_SIZE})")
    p.add_argument("--prefix-caching", "--enable-prefix-caching", dest="prefix_caching",
                   action=argparse.BooleanOptionalAction, default=None,
                   help=f"paged KV: share the blocks of common prefixes between requests "
                        f"(env {opt.PREFIX_CACHING_ENV}=1|0; default on with --paged-kv)")
    for row in opt.ENGINE_FLAGS:
        p.add_argument(opt.flag_name(row.name), dest=row.name, default=None,
                       action=argparse.BooleanOptionalAction if row.switch else "store",
                       help=_row_help(row, opt.EngineOptions()))


def _add_random_weights(p: argparse.ArgumentParser) -> None:
    p.add_argument("--random-weights", action="store_true",
                   help="--model is a folder with a config.json: random weights of that shape")


def _engine_options(args, **fixed) -> opt.EngineOptions:
    flags = {name: getattr(args, name) for name in
             list(opt.PAGED_FLAGS) + [row.name for row in opt.ENGINE_FLAGS]}
    return opt.resolve_engine_options(flags, device=opt.resolve_device(args.device), **fixed)


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", action=_AtLeast, default=256, help="most tokens to generate")
    p.add_argument("--temp", type=float, default=0.0, help="sampling temperature; 0 (or below 1e-5) is greedy")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling, in (0, 1]; 1 is off")
    p.add_argument("--top-k", type=int, default=0, help="keep the K most likely tokens; 0 is off")
    p.add_argument("--min-p", type=float, default=0.0,
                   help="drop tokens below P times the best token's probability; 0 is off")
    p.add_argument("--repetition-penalty", type=float, default=1.0,
                   help="CTRL-style penalty on tokens already seen; 1 is off")
    p.add_argument("--seed", type=int, default=None,
                   help="seeds the request's own generator: same seed, same output (default: random)")
    constraint = p.add_mutually_exclusive_group()
    constraint.add_argument("--json-schema", metavar="FILE", default=None,
                            help="constrain the output to JSON valid against the JSON schema in FILE")
    constraint.add_argument("--regex", metavar="PATTERN", default=None,
                            help="constrain the whole output to match PATTERN (Rust regex syntax)")
    constraint.add_argument("--choice", metavar="TEXT", action="append", default=None,
                            help="constrain the output to exactly one TEXT (repeat the flag for each choice)")
    constraint.add_argument("--grammar", metavar="FILE", default=None,
                            help="constrain the output to the grammar in FILE: Lark (llguidance's dialect) or GBNF")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="pagedlm", description="Run and serve language models, with an optional paged KV cache.")
    parser.add_argument("--version", action="version", version=f"pagedlm {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    g = sub.add_parser("generate", help="stream a completion of PROMPT to stdout")
    _add_model_args(g)
    _add_sampling_args(g)
    _add_engine_args(g)
    g.add_argument("--chat", action="store_true", help="wrap PROMPT in the model's chat template")
    g.add_argument("--system", default=None, help="system message (needs --chat)")
    g.add_argument("prompt", help="the prompt; - reads standard input")

    c = sub.add_parser("chat", help="interactive chat that keeps the conversation's KV cache")
    _add_model_args(c)
    _add_sampling_args(c)
    _add_engine_args(c)
    c.add_argument("--system", default=None, help="system message")

    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    for row in opt.SERVER_FLAGS:
        s.add_argument(opt.flag_name(row.name), dest=row.name, default=None, nargs=row.nargs,
                       help=_row_help(row, opt.ServerOptions()))
    _add_engine_args(s)

    b = sub.add_parser("bench", help="measure speed")
    bsub = b.add_subparsers(dest="bench", required=True, parser_class=_Parser)
    d = bsub.add_parser("decode", help="batch-1 prefill and decode tok/s "
                        "(with --paged-kv: paged and default caches, interleaved)")
    _add_model_args(d)
    _add_engine_args(d)
    d.add_argument("--prompt-len", action=_AtLeast, nargs="+", default=[256], help="one or more prompt lengths")
    d.add_argument("--gen-len", action=_AtLeast, low=2, default=64,
                   help="tokens generated per run (end-of-sequence ignored)")
    d.add_argument("--repeats", action=_AtLeast, default=3, help="runs per configuration; medians are reported")
    d.add_argument("--workload", choices=["filler", "grounded"], default="filler",
                   help="prompts: filler (one paragraph repeated) or grounded (copy a passage of stdlib docstrings, "
                        "at most --prompt-len tokens: what --speculative ngram speeds up)")
    d.add_argument("--against", choices=["hf", "llama.cpp"], default=None,
                   help="also time transformers' generate on the same weights (hf) or "
                        "llama-cpp-python on the same GGUF (llama.cpp), interleaved")
    _add_random_weights(d)
    d.add_argument("--json", action="store_true", help="one JSON object per configuration")

    t = bsub.add_parser("throughput", help="offline batched output tok/s on random prompts (nano-vllm's "
                        "workload); with --paged-kv: paged and default stores; --against hf: transformers' "
                        "continuous batching, same run")
    _add_model_args(t)
    _add_engine_args(t)
    t.add_argument("--num-prompts", action=_AtLeast, default=256, help="prompts in the batch")
    t.add_argument("--min-len", action=_AtLeast, default=100, help="shortest prompt and output, tokens")
    t.add_argument("--max-len", action=_AtLeast, default=1024, help="longest prompt and output, tokens")
    t.add_argument("--output-len", action=_AtLeast, default=None, metavar="N",
                   help="every output N tokens (default: uniform like the prompts); 1: a prefill-heavy run")
    t.add_argument("--seed", type=int, default=0, help="seeds the prompts and lengths")
    t.add_argument("--repeats", action=_AtLeast, default=1,
                   help="runs per configuration, interleaved; medians reported")
    t.add_argument("--stores", choices=["both", "paged"], default="both",
                   help="with --paged-kv: run the default store too (both, the default) or only the paged one")
    t.add_argument("--against", choices=["hf"], default=None,
                   help="also run transformers' continuous batching on the same weights and prompts")
    t.add_argument("--hf-num-prompts", action=_AtLeast, default=None, metavar="N",
                   help="give transformers only the first N prompts, when it is too slow for all (default: all)")
    t.add_argument("--hf-timeout", type=float, default=None, metavar="S",
                   help="give up on transformers' run after S seconds, reported as an error (default: no limit)")
    t.add_argument("--json-schema", metavar="FILE", default=None,
                   help="instead of the stores: each batch size's prompts unconstrained and constrained to the "
                        "JSON schema in FILE, interleaved; per decode step: ms, sampling ms, mask_overhead")
    t.add_argument("--structured-batch-sizes", action=_AtLeast, nargs="+", default=None, metavar="B",
                   help="with --json-schema: the batch sizes (default: 1 16 64)")
    t.add_argument("--structured-max-tokens", action=_AtLeast, default=None, metavar="N",
                   help="with --json-schema: tokens each row generates at most (default: 64)")
    t.add_argument("--structured-temperature", type=float, default=None, metavar="T",
                   help="with --json-schema: every row (constrained and unconstrained) samples at T, unseeded, "
                        "so rows differ (default: 0, greedy)")
    _add_random_weights(t)
    t.add_argument("--json", action="store_true", help="one JSON object per configuration")

    m = bsub.add_parser("memory", help="KV bytes per live token and sequences admitted at a fixed budget: "
                        "default store, paged store, padded batch")
    _add_model_args(m)
    _add_engine_args(m)
    m.add_argument("--short-len", action=_AtLeast, default=50, help="prompt tokens of a short request")
    m.add_argument("--long-len", action=_AtLeast, default=4000, help="prompt tokens of a long request")
    m.add_argument("--num-short", action=_AtLeast, default=64, help="short requests")
    m.add_argument("--num-long", action=_AtLeast, default=2, help="long requests")
    m.add_argument("--max-tokens", action=_AtLeast, default=8, help="tokens each request generates")
    m.add_argument("--seed", type=int, default=0, help="seeds the prompts")
    _add_random_weights(m)
    m.add_argument("--json", action="store_true", help="one JSON object per store")

    px = bsub.add_parser("prefix", help="prefix caching on the paged store, on and off: requests sharing a "
                         "system prompt (KV bytes, time to first token, total time), a full prefix hit against "
                         "a cold request, a multi-turn chat (prefill tokens per turn)")
    _add_model_args(px)
    _add_engine_args(px)
    px.add_argument("--num-requests", action=_AtLeast, default=32, help="requests sharing the system prompt")
    px.add_argument("--prefix-len", action=_AtLeast, default=2000, help="tokens of the shared system prompt")
    px.add_argument("--question-len", action=_AtLeast, default=50, help="tokens of each request's own question "
                    "(and of each chat turn's user message)")
    px.add_argument("--max-tokens", action=_AtLeast, default=8, help="tokens each shared request generates")
    px.add_argument("--repeats", action=_AtLeast, default=3, help="cold / hit pairs timed alone; medians reported")
    px.add_argument("--turns", action=_AtLeast, default=10, help="chat turns")
    px.add_argument("--chat-system-len", action=_AtLeast, default=500, help="tokens of the chat's system prompt")
    px.add_argument("--reply-len", action=_AtLeast, default=32, help="tokens of each chat reply")
    px.add_argument("--seed", type=int, default=0, help="seeds the token ids")
    _add_random_weights(px)
    px.add_argument("--json", action="store_true", help="one JSON object per row")

    ct = bsub.add_parser("contention", help="short requests' time to first token beside a long prompt, "
                         "against the same requests on an idle engine (in-process, no HTTP)")
    _add_model_args(ct)
    _add_engine_args(ct)
    ct.add_argument("--long-len", action=_AtLeast, default=6000, help="tokens of the long prompt")
    ct.add_argument("--long-max-tokens", action=_AtLeast, default=4, help="tokens the long prompt generates")
    ct.add_argument("--num-short", action=_AtLeast, default=32, help="short requests, added a step after it")
    ct.add_argument("--short-len", action=_AtLeast, default=16, help="prompt tokens of each short request")
    ct.add_argument("--short-min-tokens", action=_AtLeast, default=4, help="fewest tokens a short request generates")
    ct.add_argument("--short-max-tokens", action=_AtLeast, default=16, help="most tokens a short request generates")
    ct.add_argument("--long-alone", action="store_true", help="also time the long prompt alone")
    ct.add_argument("--seed", type=int, default=0, help="seeds the token ids and output lengths")
    _add_random_weights(ct)
    ct.add_argument("--json", action="store_true", help="one JSON object")

    pp = bsub.add_parser("ppl", help="perplexity on real text (the Python language reference), "
                         "none against --quantization and/or --kv-quant")
    _add_model_args(pp)
    pp.add_argument("--kv-quant", default=None, metavar="{int8,fp8}[,...]",
                    help="also score through paged pools of these KV formats, against unquantized pools "
                         "(comma list allowed: int8,fp8)")
    pp.add_argument("--tokens", action=_AtLeast, default=20480, help="text tokens to score")
    pp.add_argument("--window", action=_AtLeast, low=16, default=1024, help="tokens per window, BOS included")
    pp.add_argument("--json", action="store_true", help="one JSON object per quantization mode")

    sub.add_parser("models", help="list built-in models")
    return parser


def _sampling_options(args) -> SamplingParams:
    return SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temp, top_p=args.top_p, top_k=args.top_k,
        min_p=args.min_p, repetition_penalty=args.repetition_penalty, seed=opt.check_seed(args.seed, "--seed"),
        structured_outputs=_constraint(args),
    ).validate()


def _constraint(args):
    """The validated constraint of --json-schema, --regex, --choice or
    --grammar (argparse lets one through; `bench throughput` has only
    --json-schema), or None; a `CliError` naming the flag for a file that
    cannot be read, a schema that is not JSON, a constraint that does not
    compile."""
    where = " ".join(["pagedlm", args.command] + ([args.bench] if args.command == "bench" else []))
    if args.json_schema is not None:
        flag, text = f"--json-schema {args.json_schema}", _read(args.json_schema, f"{where}: --json-schema")
        try:
            asked = {"json": json.loads(text)}
        except (ValueError, RecursionError) as e:  # (nested past Python's recursion limit)
            raise CliError(f"{where}: {flag} is not JSON ({e})") from None
    elif getattr(args, "grammar", None) is not None:
        flag, asked = f"--grammar {args.grammar}", {"grammar": _read(args.grammar, f"{where}: --grammar")}
    elif getattr(args, "regex", None) is not None:
        flag, asked = "--regex", {"regex": args.regex}
    elif getattr(args, "choice", None) is not None:
        flag, asked = "--choice", {"choice": args.choice}
    else:
        return None
    try:
        return check_structured_outputs(asked)
    except opt.OptionError as e:  # "structured_outputs.<kind> ...": name the flag
        raise CliError(f"{where}: {flag}: {str(e).removeprefix('structured_outputs.')}") from None


def _read(path: str, what: str) -> str:
    if not path:  # (Path("") is the current folder)
        raise CliError(f"{what}: the path is empty")
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise CliError(f"{what} {path}: cannot read it ({getattr(e, 'strerror', None) or e})") from None


def _load(args):
    from .loading import load, resolve

    device = opt.resolve_device(args.device)
    dtype = opt.resolve_dtype(args.dtype, device)
    spec = args.model or opt.DEFAULT_MODEL
    quantization = opt.resolve_quantization(args.quantization)
    folder = resolve(spec)  # a first run converts the GGUF here, with progress bars
    print(f"pagedlm: loading {spec} on {device} ...", file=sys.stderr, flush=True)
    parallel = _engine_options(args)  # --tensor-parallel-size: every rank loads only its slices
    if parallel.tensor_parallel_size > 1:
        from .parallel import load_parallel

        return load_parallel(str(folder), device, dtype, quantization, parallel)
    return load(str(folder), device, dtype, quantization=quantization)


def _prompt(args) -> str:
    """The prompt argument, or standard input for ``-``: UTF-8 text, not empty."""
    if args.prompt == "-":
        data = sys.stdin.buffer.read()
        try:
            prompt = data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise CliError(f"pagedlm generate: standard input is not UTF-8 text "
                           f"(byte {data[e.start]:#04x} at offset {e.start})") from None
    elif not _is_utf8(args.prompt):
        raise CliError("pagedlm generate: the prompt is not UTF-8 text")
    else:
        prompt = args.prompt
    if not prompt:
        raise CliError("pagedlm generate: the prompt is empty")
    return prompt


def _is_utf8(text: str) -> bool:
    """False for text holding bytes that are not UTF-8 (Python keeps them as lone surrogates)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def cmd_generate(args) -> int:
    from .attention import describe_store
    from .batch.engine import LLMEngine

    if args.system is not None and not args.chat:
        raise CliError("pagedlm generate: --system is a chat message: it needs --chat")
    engine_options = _engine_options(args)
    options = _sampling_options(args)
    prompt = _prompt(args)
    model, tokenizer = _load(args)
    engine = LLMEngine(model, tokenizer, engine_options)
    print(f"pagedlm: {describe_store(engine)}", file=sys.stderr)
    if args.chat:
        messages = [{"role": "system", "content": args.system}] if args.system is not None else []  # ('' too)
        ids = _chat_ids(tokenizer, messages + [{"role": "user", "content": prompt}], "pagedlm generate: --chat")
    else:
        ids = tokenizer.encode(prompt)
    last = None
    for last in _stream(engine, ids, options):
        sys.stdout.write(last.text)
        sys.stdout.flush()
    sys.stdout.write("\n")
    sys.stdout.flush()
    _print_stats(last)
    if last is not None and last.finish_reason == "error":  # (the engine logged why)
        print("pagedlm generate: the output's constraint allowed no further token: the output is incomplete",
              file=sys.stderr)
        return 1
    return 0


def _chat_ids(tokenizer, messages: list[dict], where: str) -> list[int]:
    """``messages`` through the chat template; a `CliError` when the model has
    none, or its template fails or refuses them (``raise_exception``)."""
    try:
        return tokenizer.encode_chat(messages)
    except ValueError as e:
        raise CliError(f"{where}: {e}") from None


class _PrefillBar:
    """A sequence's prefill progress on stderr, once it has taken PREFILL_BAR_AFTER_S."""

    def __init__(self) -> None:
        self.started, self.bar = time.perf_counter(), None

    def update(self, seq) -> None:
        if seq.num_computed >= seq.num_prompt:
            self.close()
            return
        if self.bar is None and time.perf_counter() - self.started >= PREFILL_BAR_AFTER_S:
            from tqdm import tqdm

            self.bar = tqdm(total=seq.num_prompt, initial=seq.num_computed, desc="prefill", unit="tok",
                            file=sys.stderr, leave=False)
        if self.bar is not None:
            self.bar.update(seq.num_computed - self.bar.n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


class _Interrupt:
    """While active, Ctrl-C asks the reply to stop after the engine's current
    step (never mid-step); a second Ctrl-C interrupts as usual."""

    def __init__(self) -> None:
        self.hit = False

    def __enter__(self) -> "_Interrupt":
        self.previous = signal.signal(signal.SIGINT, self._on_sigint)
        return self

    def _on_sigint(self, signum, frame) -> None:
        self.hit = True
        signal.signal(signal.SIGINT, self.previous)

    def __exit__(self, *exc) -> None:
        signal.signal(signal.SIGINT, self.previous)


def _stream(engine, ids: list[int], options: SamplingParams,
            interrupt: _Interrupt | None = None) -> Iterator:
    """`LLMEngine.stream` with a prefill bar; stops (aborting the sequence) when ``interrupt`` is hit."""
    bar = _PrefillBar()

    def before_step(seq) -> bool:
        bar.update(seq)
        return interrupt is None or not interrupt.hit

    try:
        yield from engine.stream(ids, options, before_step=before_step)
    finally:
        bar.close()


def _print_stats(r) -> None:
    if r is None:
        return
    paged = " (paged KV)" if r.paged_kv else ""
    seq = r.seq
    speculated = (f" | speculative: {seq.num_accepted_tokens}/{seq.num_draft_tokens} proposed tokens accepted"
                  if seq is not None and seq.num_drafts else "")
    print(
        f"prompt: {r.prompt_tokens} tokens, {r.prompt_tps:.1f} tok/s | "
        f"generation: {r.generation_tokens} tokens, {r.generation_tps:.1f} tok/s{paged}{speculated}",
        file=sys.stderr,
    )


def cmd_chat(args) -> int:
    from .attention import describe_store
    from .batch.engine import LLMEngine

    # Each turn reuses the conversation's KV: the prompt cache on the default
    # store, cached blocks on the paged store (unless --no-prefix-caching).
    engine_options = _engine_options(args, prompt_cache_bytes=CHAT_PROMPT_CACHE_BYTES)
    options = _sampling_options(args)
    model, tokenizer = _load(args)
    engine = LLMEngine(model, tokenizer, engine_options)
    print(f"pagedlm: {describe_store(engine)}", file=sys.stderr)
    messages = [{"role": "system", "content": args.system}] if args.system is not None else []  # ('' too)
    print("Type a message; Ctrl-C stops a reply, Ctrl-D or /exit quits, /reset starts over.", file=sys.stderr)
    while True:
        try:
            line = input(">>> ")
        except (EOFError, KeyboardInterrupt):
            print(file=sys.stderr)
            return 0
        except UnicodeDecodeError:  # a strict locale's standard input
            line = None
        if line is None or not _is_utf8(line):
            print("pagedlm: that line is not UTF-8 text", file=sys.stderr)
            continue
        if line.strip() in ("/exit", "/quit"):
            return 0
        if line.strip() == "/reset":
            messages = messages[:1] if args.system is not None else []
            print("conversation reset", file=sys.stderr)
            continue
        if not line.strip():
            continue
        turn = messages + [{"role": "user", "content": line}]
        reply, last = [], None
        try:
            with _Interrupt() as interrupt:  # Ctrl-C stops this reply; what was shown stays in the conversation
                for last in _stream(engine, _chat_ids(tokenizer, turn, "pagedlm chat"), options, interrupt):
                    sys.stdout.write(last.text)
                    sys.stdout.flush()
                    reply.append(last.text)
        except (opt.OptionError, CliError) as e:  # e.g. the conversation outgrew max_model_len: say so, keep it
            print(f"error: {e}", file=sys.stderr)
            continue
        sys.stdout.write("\n")
        sys.stdout.flush()
        _print_stats(last)
        if reply or not interrupt.hit:  # a reply stopped before its first word leaves no turn
            messages = turn + [{"role": "assistant", "content": "".join(reply)}]


def cmd_serve(args) -> int:
    from .server import run

    flags = {row.name: getattr(args, row.name) for row in opt.SERVER_FLAGS}
    for name in list(opt.PAGED_FLAGS) + [row.name for row in opt.ENGINE_FLAGS]:
        flags[name] = getattr(args, name)
    options = opt.ServerOptions.resolve(flags)
    return run(options) or 0


# bench throughput's flags for the stores' workload, which --json-schema replaces
STORES_WORKLOAD = ("num_prompts", "min_len", "max_len", "output_len", "seed", "stores", "hf_num_prompts", "hf_timeout")


def cmd_bench(args) -> int:
    if args.bench == "throughput" and args.json_schema is not None:
        defaults = build_parser().parse_args(["bench", "throughput"])
        for flag in STORES_WORKLOAD:
            if getattr(args, flag) != getattr(defaults, flag):
                raise CliError(f"pagedlm bench throughput: {opt.flag_name(flag)} shapes the stores' workload, which "
                               "--json-schema replaces: its rows are --structured-batch-sizes, "
                               "--structured-max-tokens and --structured-temperature")
        constraint = _constraint(args)  # a bad FILE is refused before the model loads
        from .bench.structured import run_structured_bench

        return run_structured_bench(args, _engine_options(args), constraint)
    if args.bench == "throughput":
        if any(getattr(args, f"structured_{name}") is not None
               for name in ("batch_sizes", "max_tokens", "temperature")):
            raise CliError("pagedlm bench throughput: --structured-batch-sizes, --structured-max-tokens and "
                           "--structured-temperature need --json-schema")
        from .bench.throughput import run_throughput_bench

        return run_throughput_bench(args, _engine_options(args))
    if args.bench == "memory":
        from .bench.memory import run_memory_bench

        return run_memory_bench(args, _engine_options(args))
    if args.bench == "prefix":
        from .bench.prefix import run_prefix_bench

        return run_prefix_bench(args, _engine_options(args))
    if args.bench == "contention":
        from .bench.contention import run_contention_bench

        return run_contention_bench(args, _engine_options(args))
    if args.bench == "ppl":
        from .bench.ppl import run_ppl_bench

        return run_ppl_bench(args)
    from .bench.decode import run_decode_bench

    return run_decode_bench(args, _engine_options(args))


def cmd_models(args) -> int:
    from .loading.catalog import list_models

    for entry in list_models():
        print(f"{entry.name:24s} {'installed' if entry.installed else 'not installed':14s} {entry.description}")
    return 0


COMMANDS = {"generate": cmd_generate, "chat": cmd_chat, "serve": cmd_serve,
            "bench": cmd_bench, "models": cmd_models}


def main(argv: Sequence[str] | None = None) -> int:
    from .loading import ModelNotFound
    from .parallel import TensorParallelError

    try:
        args = build_parser().parse_args(argv)
        return COMMANDS[args.command](args)
    except (CliError, opt.OptionError, ModelNotFound) as e:  # LoadError is a ModelNotFound
        print(f"error: {e}" if not str(e).startswith("pagedlm") else str(e), file=sys.stderr)
        return 2
    except TensorParallelError as e:  # a rank failed mid-request: said in one line, then out
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
