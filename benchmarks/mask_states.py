"""Which grammar states cost llguidance the most, and what xgrammar pays there.

The structured bench's first prompt is generated greedily on the engine (the
model and the schema of `pagedlm bench throughput --json-schema`); then, token
by token, two fresh matchers of one compile (``a`` and ``b``, b after a in the
same state: whether anything is shared between matchers) each fill their mask
for the state and take the token. A matcher keeps its last mask, so each
state's first mask is the one timed. Printed per token: its index, a's and
b's fill (us, through `RowMatcher.fill`, which adds ~5-10 us of checks and a
torch ``any()`` to llguidance's call), the tokens the mask allows, the token.
A step of the bench whose rows sit in costly states waits for the fill of all
of them (`fill_bitmask`).

With ``XGRAMMAR=1``: an xgrammar matcher of the same schema
(`compile_json_schema`, any whitespace: its JSON grammar differs from ours
there, so the tokens allowed differ in whitespace states) fills its mask
first in each state, timed and printed after the two; its compile time is
printed at the end; it stops where xgrammar refuses a token. xgrammar is not
a dependency of pagedlm: ``pip install xgrammar`` (apache-tvm-ffi,
transformers, ...), in a separate environment; the tokenizer goes to it as
transformers' ``PreTrainedTokenizerFast`` of the folder's tokenizer.json.
With ``XGRAMMAR=lark``: xgrammar compiles the engine's own grammar
(`Constraint.llguidance_grammar`: Lark with an inline ``%json``) over the
engine's token view (llguidance's bytes of each token, `_TextTokenizer`),
and each state's two masks are compared bit for bit: a state where they
differ prints how many tokens only each allows (``SHOW=I``: state I's
tokens themselves); ``states_same`` / ``states_differ`` at the end.

Usage: [XGRAMMAR=1|lark [SHOW=I]] PYTHONPATH=. python benchmarks/mask_states.py MODEL_DIR [SCHEMA] [MAX_TOKENS]
(MODEL_DIR: a config with a tokenizer.json, weights random, as --random-weights;
SCHEMA: benchmarks/configs/person.schema.json; MAX_TOKENS: 64)
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

from pagedlm.batch.engine import LLMEngine
from pagedlm.bench.common import load_for_bench
from pagedlm.bench.structured import make_prompts
from pagedlm.cli import build_parser
from pagedlm.params import SamplingParams
from pagedlm.structured.compiler import _TextTokenizer
from pagedlm.structured.constraint import Constraint


def _bits(words: np.ndarray) -> list[int]:
    """The token ids whose bits are set in bitmask ``words``."""
    return np.flatnonzero(np.unpackbits(words.view(np.uint8), bitorder="little")).tolist()


def allowed(words: torch.Tensor) -> int:
    return len(_bits(words.numpy()))


def timed_fill(fill, *args) -> float:
    t0 = time.perf_counter()
    fill(*args)
    return 1e6 * (time.perf_counter() - t0)


def xgrammar_matcher(model_dir: str, schema: dict, vocab_size: int, ours: Constraint | None = None,
                     view: _TextTokenizer | None = None, stops: list[int] | None = None):
    """(xgrammar's matcher of ``schema``, its bitmask, its compile ms); with
    ``ours``, of that constraint's own Lark grammar over our token ``view``
    (``stops``: the end-of-sequence ids)."""
    import xgrammar

    t0 = time.perf_counter()
    if ours is not None:
        info = xgrammar.TokenizerInfo(view.tokens, xgrammar.VocabType.RAW, vocab_size=len(view.tokens),
                                      stop_token_ids=stops)
        compiled = xgrammar.GrammarCompiler(info, max_threads=1).compile_grammar(
            xgrammar.Grammar.from_lark(ours.llguidance_grammar()))
    else:
        from transformers import PreTrainedTokenizerFast

        info = xgrammar.TokenizerInfo.from_huggingface(
            PreTrainedTokenizerFast(tokenizer_file=str(Path(model_dir) / "tokenizer.json")), vocab_size=vocab_size)
        compiled = xgrammar.GrammarCompiler(info, max_threads=1).compile_json_schema(json.dumps(schema),
                                                                                     any_whitespace=True)
    compile_ms = 1e3 * (time.perf_counter() - t0)
    return xgrammar.GrammarMatcher(compiled), xgrammar.allocate_token_bitmask(1, info.vocab_size), compile_ms


def main(model_dir: str, schema_path: str = "benchmarks/configs/person.schema.json", max_tokens: int = 64) -> None:
    args = build_parser().parse_args(["bench", "throughput", "--random-weights", "--model", model_dir,
                                      "--device", "cpu"])
    model, tokenizer, *_ = load_for_bench(args)
    schema = json.loads(Path(schema_path).read_text())
    constraint = Constraint(json=schema).validate()
    engine = LLMEngine(model, tokenizer)
    (seq,) = engine.add_request(make_prompts(tokenizer, schema, 1)[0],
                                SamplingParams(max_tokens=max_tokens, ignore_eos=True, structured_outputs=constraint))
    while engine.has_unfinished():
        engine.step()
    mode = os.environ.get("XGRAMMAR")
    view = _TextTokenizer(tokenizer, engine.vocab_size) if mode == "lark" else None
    theirs = None
    if mode in ("1", "lark"):
        theirs = xgrammar_matcher(model_dir, schema, engine.vocab_size, constraint if view else None, view,
                                  sorted(tokenizer.eos_token_ids))
    same = differ = 0
    a, b = engine.grammars.matcher(constraint), engine.grammars.matcher(constraint)
    while not (a.ready() and b.ready()):
        time.sleep(0.001)
    row = torch.zeros((a.width + 31) // 32, dtype=torch.int32)
    for i, token in enumerate(seq.output_ids):
        other = f"  xgrammar {timed_fill(theirs[0].fill_next_token_bitmask, theirs[1]):7.1f} us" if theirs else ""
        first = [timed_fill(m.fill, row) for m in (a, b)]
        line = f"{i:3d} {first[0]:8.1f} {first[1]:8.1f} us {allowed(row):7d} allowed"
        if theirs:
            line += f"{other} ({allowed(theirs[1]):6d})"
        if mode == "lark":  # the same grammar: bit for bit
            ours, other_words = row.numpy().view(np.uint32), theirs[1][0].numpy().view(np.uint32)[: row.numel()]
            only = [_bits(ours & ~other_words), _bits(other_words & ~ours)]
            same, differ = same + (not any(only)), differ + any(only)
            line += f"  {'same' if not any(only) else f'{len(only[0])} only ours, {len(only[1])} only xgrammar'}"
            if os.environ.get("SHOW") == str(i):
                line += f"\n  only ours: {[view.tokens[k] for k in only[0]][:60]}" \
                        f"\n  only xgrammar: {[view.tokens[k] for k in only[1]][:60]}"
        print(f"{line}  next {tokenizer.decode([token])!r}")
        if theirs and not theirs[0].accept_token(token):
            print("xgrammar refuses the token: its JSON grammar differs here")
            break
        a.advance(token)
        b.advance(token)
    print(json.dumps({"text": seq.text, **({"xgrammar_compile_ms": round(theirs[2], 1)} if theirs else {}),
                      **({"states_same": same, "states_differ": differ} if mode == "lark" else {})}))


if __name__ == "__main__":
    main(sys.argv[1], *sys.argv[2:3], *[int(x) for x in sys.argv[3:4]])
