"""llguidance (the engine's) against xgrammar on the same row's grammar states.

The structured bench's first prompt is generated greedily on the engine
(the model and schema of `pagedlm bench throughput --json-schema`); then,
token by token, an xgrammar matcher of the same schema
(`compile_json_schema`, any whitespace) and a fresh `RowMatcher` each fill
their mask for the state (timed) and take the token. Printed per token: each
engine's fill (us) and the tokens its mask allows (the two JSON grammars
differ in their whitespace: llama.cpp's rule here, any run of it there), and
the token; then xgrammar's compile time. Stops where xgrammar refuses a token.

xgrammar is not a dependency of pagedlm: it needs ``pip install xgrammar``
(with its own dependencies: apache-tvm-ffi, transformers, ...), here in a
separate environment; the tokenizer goes to it through transformers'
``PreTrainedTokenizerFast`` of the model folder's tokenizer.json.

Usage: PYTHONPATH=. python benchmarks/mask_engines.py MODEL_DIR [SCHEMA]
(MODEL_DIR: a config with a tokenizer.json, weights random; SCHEMA:
benchmarks/configs/person.schema.json)
"""

from __future__ import annotations

import json
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
from pagedlm.structured.constraint import Constraint


def allowed(words: torch.Tensor) -> int:
    return int(np.unpackbits(words.numpy().view(np.uint8)).sum())


def main(model_dir: str, schema_path: str = "benchmarks/configs/person.schema.json") -> None:
    import xgrammar
    from transformers import PreTrainedTokenizerFast

    args = build_parser().parse_args(["bench", "throughput", "--random-weights", "--model", model_dir,
                                      "--device", "cpu"])
    model, tokenizer, *_ = load_for_bench(args)
    schema = json.loads(Path(schema_path).read_text())
    constraint = Constraint(json=schema).validate()
    engine = LLMEngine(model, tokenizer)
    (seq,) = engine.add_request(make_prompts(tokenizer, schema, 1)[0],
                                SamplingParams(max_tokens=64, ignore_eos=True, structured_outputs=constraint))
    while engine.has_unfinished():
        engine.step()
    t0 = time.perf_counter()
    info = xgrammar.TokenizerInfo.from_huggingface(
        PreTrainedTokenizerFast(tokenizer_file=str(Path(model_dir) / "tokenizer.json")),
        vocab_size=engine.vocab_size)
    compiled = xgrammar.GrammarCompiler(info, max_threads=1).compile_json_schema(json.dumps(schema),
                                                                                 any_whitespace=True)
    compile_ms = 1e3 * (time.perf_counter() - t0)
    theirs, mask = xgrammar.GrammarMatcher(compiled), xgrammar.allocate_token_bitmask(1, info.vocab_size)
    ours = engine.grammars.matcher(constraint)
    while not ours.ready():
        time.sleep(0.001)
    row = torch.zeros((ours.width + 31) // 32, dtype=torch.int32)
    for i, token in enumerate(seq.output_ids):
        t0 = time.perf_counter()
        theirs.fill_next_token_bitmask(mask)
        t1 = time.perf_counter()
        ours.fill(row)
        t2 = time.perf_counter()
        print(f"{i:3d} llguidance {1e6 * (t2 - t1):7.1f} us ({allowed(row):6d})  "
              f"xgrammar {1e6 * (t1 - t0):7.1f} us ({allowed(mask):6d})  next {tokenizer.decode([token])!r}")
        if not theirs.accept_token(token):
            print("xgrammar refuses the token: its JSON grammar differs here")
            break
        ours.advance(token)
    print(json.dumps({"xgrammar_compile_ms": round(compile_ms, 1), "text": seq.text}))


if __name__ == "__main__":
    main(*sys.argv[1:3])
