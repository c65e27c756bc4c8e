"""What one request asks of generation: `SamplingParams` (vLLM's names and meanings).

The engine's own options, flags and refusals are in `options.py`; these are
per request, given by the offline API, the server's request fields and the
CLI's sampling flags, and checked in one place, `SamplingParams.validate`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Mapping

from pagedlm.options import OptionError, check_seed

if TYPE_CHECKING:
    from pagedlm.structured import Constraint

# Below this a temperature means greedy: logits divided by 1e-38 overflow
# float32 (inf - inf = NaN probabilities), and sampling that cold is the argmax.
GREEDY_BELOW_TEMPERATURE = 1e-5

# A structured_outputs dict: the kinds of a `Constraint` (exactly one set), and
# vLLM's other StructuredOutputsParams keys, accepted only with a value that
# asks for nothing (null or false), else refused with the reason.
CONSTRAINT_KINDS = ("json", "json_object", "regex", "choice", "grammar")
VLLM_ONLY_KEYS = {
    "whitespace_pattern": "JSON whitespace is fixed here: a space, or a newline and up to 20 spaces or tabs "
                          "(docs/design/structured-output.md)",
    "structural_tag": "structural tags are not supported: send a grammar",
    "disable_any_whitespace": "JSON output may hold whitespace between tokens (a space, or a newline and an "
                              "indent); it cannot be turned off",
}
# What the grammar always does (docs/design/structured-output.md): an object
# schema that lists properties and says nothing of others takes no others.
CLOSED_OBJECTS = ("an object schema that lists its properties takes no others unless it says so "
                  "(additionalProperties: true or a schema)")


@dataclass
class SamplingParams:
    """Everything one request asks of generation (vLLM's field names).

    ``n`` continuations of one prompt run as ``n`` sequences. ``logprobs`` /
    ``prompt_logprobs``: None for none, k >= 0 for the chosen token's logprob
    plus the top k.
    """

    # vLLM's default; 0 with prompt_logprobs: score the prompt, generate nothing; None: up to max_model_len
    max_tokens: int | None = 16
    temperature: float = 0.0  # 0 = greedy (vLLM's default is 1.0); validate() makes < GREEDY_BELOW_TEMPERATURE 0
    top_k: int = 0  # 0 = off (-1 is accepted as off too, as vLLM spells it)
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] | None = field(default_factory=list)
    stop_token_ids: list[int] | None = field(default_factory=list)
    ignore_eos: bool = False  # keep going past end-of-sequence tokens (benchmarks)
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    n: int = 1
    # Until this many tokens are out: EOS and stop_token_ids are never sampled, stop strings not matched.
    min_tokens: int = 0
    # Token id -> added to its logit before anything else (validate() clamps to OpenAI's [-100, 100]).
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None  # only these may be sampled
    bad_words: list[str] | None = None  # never generated (tokenized as vLLM does: sampling.bad_words_ids)
    include_stop_str_in_output: bool = False  # keep the stop string (or stop token's text) at the end
    skip_special_tokens: bool = True  # special tokens add no text
    truncate_prompt_tokens: int | None = None  # keep only the prompt's last k tokens
    # Constrain the output (vLLM's name): a `pagedlm.structured.Constraint`, or a
    # dict with exactly one of json, json_object, regex, choice, grammar;
    # validate() makes it a checked Constraint.
    structured_outputs: "Constraint | dict[str, Any] | None" = None

    def validate(self) -> "SamplingParams":
        """A validated copy (the caller's object is left as it is): raise
        `OptionError` naming the first bad field ("<field> must ..."); spell
        each value one way (top_k -1 -> 0, a stop string -> a list, logit_bias
        clamped, a temperature too small to divide by -> 0, greedy), so that
        every sampler sees one meaning of it."""
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                     "frequency_penalty"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and not isinstance(value, bool)) or not math.isfinite(value):
                raise OptionError(f"{name} must be a finite number (got {value!r})")
        for name in ("max_tokens", "top_k", "n", "min_tokens", "logprobs", "prompt_logprobs",
                     "truncate_prompt_tokens"):
            value = getattr(self, name)
            if not (_int(value) or (value is None and name not in ("top_k", "n", "min_tokens"))):
                raise OptionError(f"{name} must be an integer (got {value!r})")
        top_k = 0 if self.top_k == -1 else self.top_k
        if not isinstance(self.stop, (str, list, tuple, type(None))):
            raise OptionError(f"stop must be a string or a list of strings (got {self.stop!r})")
        stop = [] if self.stop is None else [self.stop] if isinstance(self.stop, str) else list(self.stop)
        most = math.inf if self.max_tokens is None else self.max_tokens  # None: up to the model's length
        checks: list[tuple[bool, str]] = [
            (most >= 1 or (self.max_tokens == 0 and self.prompt_logprobs is not None),
             f"max_tokens must be >= 1, or 0 to only score the prompt (got {self.max_tokens})"),
            (self.temperature >= 0, f"temperature must be >= 0 (got {self.temperature})"),
            (top_k >= 0, f"top_k must be >= 0 (got {self.top_k})"),
            (0 < self.top_p <= 1, f"top_p must be in (0, 1] (got {self.top_p})"),
            (0 <= self.min_p <= 1, f"min_p must be in [0, 1] (got {self.min_p})"),
            (self.repetition_penalty > 0,
             f"repetition_penalty must be > 0 (got {self.repetition_penalty})"),
            (-2 <= self.presence_penalty <= 2,
             f"presence_penalty must be in [-2, 2] (got {self.presence_penalty})"),
            (-2 <= self.frequency_penalty <= 2,
             f"frequency_penalty must be in [-2, 2] (got {self.frequency_penalty})"),
            (self.logprobs is None or 0 <= self.logprobs <= 20,
             f"logprobs must be in [0, 20] (got {self.logprobs})"),
            (self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= 20,
             f"prompt_logprobs must be in [0, 20] (got {self.prompt_logprobs})"),
            (self.n >= 1, f"n must be >= 1 (got {self.n})"),
            (all(isinstance(s, str) for s in stop), f"stop must be a string or a list of strings (got {self.stop!r})"),
            ("" not in stop, "stop must not hold an empty string (it would end every output at once)"),
            (self.stop_token_ids is None or _token_ids(self.stop_token_ids),
             f"stop_token_ids must be a list of token ids (integers >= 0) (got {self.stop_token_ids!r})"),
            (0 <= self.min_tokens <= most,
             f"min_tokens must be an integer from 0 to max_tokens ({self.max_tokens}) (got {self.min_tokens!r})"),
            (self.allowed_token_ids is None or (_token_ids(self.allowed_token_ids) and self.allowed_token_ids),
             f"allowed_token_ids must be a non-empty list of token ids (integers >= 0) "
             f"(got {self.allowed_token_ids!r})"),
            (self.bad_words is None or (isinstance(self.bad_words, (list, tuple))
                                        and all(isinstance(w, str) and w.strip() for w in self.bad_words)),
             f"bad_words must be a list of non-blank strings (got {self.bad_words!r})"),
            (self.truncate_prompt_tokens is None or self.truncate_prompt_tokens >= 1,
             f"truncate_prompt_tokens must be an integer >= 1 (got {self.truncate_prompt_tokens!r})"),
        ]
        for ok, message in checks:
            if not ok:
                raise OptionError(message)
        check_seed(self.seed)
        return replace(
            self, top_k=top_k, stop=stop, stop_token_ids=list(self.stop_token_ids or ()),
            structured_outputs=check_structured_outputs(self.structured_outputs),
            temperature=0.0 if self.temperature < GREEDY_BELOW_TEMPERATURE else self.temperature,
            logit_bias=_clamped_bias(self.logit_bias),
            allowed_token_ids=None if self.allowed_token_ids is None else list(self.allowed_token_ids),
            bad_words=None if self.bad_words is None else list(self.bad_words),
        )

    def continuations(self) -> list["SamplingParams"]:
        """One single-sequence copy per continuation; with a seed, continuation
        ``i`` draws with ``seed + i`` (modulo 2**64, which seeds torch's
        generator the same): n different outputs, each reproducible."""
        if self.n == 1:
            return [self]
        return [replace(self, n=1, seed=None if self.seed is None else (self.seed + i) % 2**64)
                for i in range(self.n)]


def check_structured_outputs(value: object) -> "Constraint | None":
    """``structured_outputs`` as a validated `Constraint` (None stays None), or
    `OptionError` saying "structured_outputs[.<key>] ..." and why: a key that is
    not a kind, a vLLM-only key that asks for something, or what
    `Constraint.validate` refuses (two kinds or none, a schema, regex or
    grammar that does not compile). llguidance is imported only here."""
    if value is None:
        return None
    from pagedlm.structured import Constraint

    if isinstance(value, Mapping):
        for key, given in value.items():
            if key in CONSTRAINT_KINDS or (key in VLLM_ONLY_KEYS and given in (None, False)):
                continue
            if key == "disable_additional_properties":  # true is what the grammar does; false cannot be honoured
                if given in (None, True):
                    continue
                raise OptionError(f"structured_outputs.disable_additional_properties must be true or null "
                                  f"(got {given!r}): {CLOSED_OBJECTS}")
            if key == "disable_fallback":  # pagedlm has one grammar engine: it never falls back
                if isinstance(given, bool) or given is None:
                    continue
                raise OptionError(f"structured_outputs.disable_fallback must be true or false (got {given!r})")
            if key in VLLM_ONLY_KEYS:
                raise OptionError(f"structured_outputs.{key} is not supported: {VLLM_ONLY_KEYS[key]}")
            raise OptionError(f"structured_outputs.{key} is not a structured output field: give exactly one of "
                              f"{', '.join(CONSTRAINT_KINDS)}")
        value = Constraint(**{k: v for k, v in value.items() if k in CONSTRAINT_KINDS and v is not None})
    elif not isinstance(value, Constraint):
        raise OptionError(f"structured_outputs must be a Constraint or a dict with one of "
                          f"{', '.join(CONSTRAINT_KINDS)} (got {type(value).__name__})")
    try:
        return value.validate()
    except OptionError as e:  # "<kind> ..." or "a constraint must ...": name this field
        message = str(e)
        if message.startswith("a constraint "):
            raise OptionError("structured_outputs " + message[len("a constraint "):]) from None
        raise OptionError(f"structured_outputs.{message}") from None


def _int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _token_ids(ids: object) -> bool:
    return isinstance(ids, (list, tuple)) and all(_int(i) and i >= 0 for i in ids)


def check_token_ids(ids, vocab_size: int, what: str) -> None:
    """`OptionError` naming ``what`` for the first id outside [0, vocab_size): a
    prompt's ids, or a field's (the offline API, the server and the engine
    check with this one rule)."""
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise OptionError(f"{what} holds token id {bad}, outside the vocabulary [0, {vocab_size})")


def _clamped_bias(bias: object) -> dict[int, float] | None:
    """logit_bias as token id -> a finite bias in [-100, 100] (OpenAI clamps), else `OptionError`."""
    if bias is None:
        return None
    if not isinstance(bias, Mapping):
        raise OptionError(f"logit_bias must map token ids to biases (got {bias!r})")
    out = {}
    for token, value in bias.items():
        if not (_int(token) and token >= 0):
            raise OptionError(f"logit_bias must have token ids (integers >= 0) as keys (got {token!r})")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise OptionError(f"logit_bias must have finite numbers as values (got {value!r} for {token})")
        out[token] = float(min(100.0, max(-100.0, value)))
    return out
