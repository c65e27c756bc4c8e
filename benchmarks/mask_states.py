"""Which grammar states cost llguidance the most: a bench row's tokens replayed
through two fresh matchers of one compile, each state's first mask timed
(a matcher keeps its last mask: a second fill of one state is not timed).

The structured bench's first prompt is generated greedily on the engine (the
model and the schema of `pagedlm bench throughput --json-schema`); then, token
by token, matcher ``a`` and matcher ``b`` each fill their mask for the state
and take the token. Printed per token: its index, a's and b's first fill (us;
b after a, in the same state: whether anything is shared between matchers),
the tokens the mask allows, and the token. A step of the bench whose rows sit
in costly states waits for the fill of all of them (`fill_bitmask`).

Usage: PYTHONPATH=. python benchmarks/mask_states.py MODEL_DIR [SCHEMA] [MAX_TOKENS]
(MODEL_DIR: a config with a tokenizer, weights random, as --random-weights;
SCHEMA: benchmarks/configs/person.schema.json; MAX_TOKENS: 64)
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np
import torch

from pagedlm.batch.engine import LLMEngine
from pagedlm.bench.common import load_for_bench
from pagedlm.bench.structured import make_prompts
from pagedlm.cli import build_parser
from pagedlm.params import SamplingParams
from pagedlm.structured.constraint import Constraint


def main(model_dir: str, schema_path: str = "benchmarks/configs/person.schema.json", max_tokens: int = 64) -> None:
    args = build_parser().parse_args(["bench", "throughput", "--random-weights", "--model", model_dir,
                                      "--device", "cpu"])
    model, tokenizer, *_ = load_for_bench(args)
    schema = json.loads(open(schema_path).read())
    constraint = Constraint(json=schema).validate()
    engine = LLMEngine(model, tokenizer)
    (seq,) = engine.add_request(make_prompts(tokenizer, schema, 1)[0],
                                SamplingParams(max_tokens=max_tokens, ignore_eos=True, structured_outputs=constraint))
    while engine.has_unfinished():
        engine.step()
    a, b = engine.grammars.matcher(constraint), engine.grammars.matcher(constraint)
    while not (a.ready() and b.ready()):
        time.sleep(0.001)
    row = torch.zeros((a.width + 31) // 32, dtype=torch.int32)
    for i, token in enumerate(seq.output_ids):
        first = []
        for m in (a, b):
            t0 = time.perf_counter()
            m.fill(row)
            first.append(1e6 * (time.perf_counter() - t0))
        allowed = int(np.unpackbits(row.numpy().view(np.uint8)).sum())
        print(f"{i:3d} {first[0]:8.1f} {first[1]:8.1f} us {allowed:7d} allowed  next {tokenizer.decode([token])!r}")
        a.advance(token)
        b.advance(token)
    print(json.dumps({"text": seq.text}))


if __name__ == "__main__":
    main(sys.argv[1], *sys.argv[2:3], *[int(x) for x in sys.argv[3:4]])
