"""Structured output: constrain a row's tokens to a JSON schema, a regex, a
list of choices or a grammar, with llguidance (docs/design/structured-output.md).

    compiler = GrammarCompiler(tokenizer, vocab_size)        # one per engine
    matcher = compiler.matcher(Constraint(json=schema).validate())
    # schedule the row once matcher.ready(); the sampler masks its logits
    # (sampling.sample reads seq.matcher); after each token: matcher.advance(t)
    # says whether it ends the row ("stop": complete; "error": dead; None).

`Constraint` (constraint.py) is the request's value; `GrammarCompiler`
(compiler.py) compiles once per constraint in a thread pool; `RowMatcher`
and `masked_logits` (matcher.py) are a row's state and a step's masks.
"""

from .compiler import GrammarCompiler, llguidance_tokenizer
from .constraint import Constraint
from .matcher import RowMatcher, fill_bitmask, mask_bias, masked_logits

__all__ = ["Constraint", "GrammarCompiler", "RowMatcher", "fill_bitmask", "llguidance_tokenizer", "mask_bias",
           "masked_logits"]
