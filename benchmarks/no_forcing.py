"""llguidance's forcing off in every grammar the engine compiles from here on
(``no_forcing``: a mask then allows every token the grammar allows where it
forces text, not only the forced text's canonical first token, and
llguidance never calls the tokenizer). For measurements only: the engine
keeps forcing on (`benchmarks/forcing_outputs.py` says why)."""

from __future__ import annotations

import json

import pagedlm.structured.compiler as compiler_module


def turn_forcing_off() -> None:
    compile_ = compiler_module._compile

    def compile_without_forcing(tokenizer, grammar, lanes=1):
        top = json.loads(grammar) if grammar.lstrip().startswith("{") else {"grammars": [{"lark_grammar": grammar}]}
        for g in top["grammars"]:
            if g.get("lark_grammar") is not None:
                g["lark_grammar"] = '%llguidance {"no_forcing": true}\n' + g["lark_grammar"]
        return compile_(tokenizer, json.dumps(top), lanes)
    compiler_module._compile = compile_without_forcing
