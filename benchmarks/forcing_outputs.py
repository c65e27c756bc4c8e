"""What llguidance's forcing does to a trained model's structured outputs:
SmolLM2-135M-Instruct (real weights, this machine's CPU), greedy, eight chat
requests under two JSON schemas (`benchmarks/configs/person.schema.json`
and a small record of a title, a year and tags), run once with forcing (the
engine's grammars as they are) and once without (`no_forcing.py`). Prints a
JSON line a request: whether the two outputs are the same tokens, their
finish reasons, whether each parses, and both texts.

Forcing is what a grammar's forced text (an object's next key, ``": "``)
costs the fill at 64 rows (`benchmarks/RESULTS.md`); without it a mask
allows every spelling of that text, not only its canonical first token.

Usage: PYTHONPATH=. python3 benchmarks/forcing_outputs.py [MAX_TOKENS]
"""

from __future__ import annotations

import json
import sys

from no_forcing import turn_forcing_off

from pagedlm import LLM, SamplingParams

RECORD = {"type": "object", "required": ["title", "year", "tags"],
          "properties": {"title": {"type": "string"}, "year": {"type": "integer"},
                         "tags": {"type": "array", "items": {"type": "string"}}}}
PERSON = json.load(open("benchmarks/configs/person.schema.json"))
ASKS = [("Describe a person who lives in Paris.", PERSON), ("Invent a software engineer from Tokyo.", PERSON),
        ("Give me a fictional teacher's profile.", PERSON), ("Make up a retired sailor.", PERSON),
        ("Describe a classic film.", RECORD), ("Describe a novel you like.", RECORD),
        ("Describe a music album.", RECORD), ("Describe a video game.", RECORD)]


def outputs(max_tokens: int) -> list:
    llm = LLM("smollm2-135m-instruct", device="cpu")  # (a new engine: its grammars compiled now)
    runs = []
    for ask, schema in ASKS:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, structured_outputs={"json": schema})
        runs.append(llm.chat([{"role": "user", "content": ask}], params, use_tqdm=False)[0].outputs[0])
    return runs


def parses(text: str) -> bool:
    try:
        json.loads(text)
        return True
    except ValueError:
        return False


def main() -> None:
    max_tokens = int(sys.argv[1]) if len(sys.argv) > 1 else 150
    forced = outputs(max_tokens)
    turn_forcing_off()
    free = outputs(max_tokens)
    for (ask, _), a, b in zip(ASKS, forced, free):
        print(json.dumps({"ask": ask, "same_tokens": list(a.token_ids) == list(b.token_ids),
                          "finish": [a.finish_reason, b.finish_reason], "parses": [parses(a.text), parses(b.text)],
                          "tokens": [len(a.token_ids), len(b.token_ids)], "forcing": a.text, "no_forcing": b.text}))


if __name__ == "__main__":
    main()
