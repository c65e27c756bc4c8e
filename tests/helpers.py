"""What tests share across modules and that is not a fixture: tiny
random-weight models (``tiny_model``), a character tokenizer and a tiny
byte-level one, engine drivers (``run_all``, ``drive``) and the random paged
inputs of the kernel tests. Fixtures live in the conftest files and build on
these; a test module imports from here, never from another test module."""

from __future__ import annotations

import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from tokenizers import Tokenizer as HFTokenizer

from pagedlm.models import build_model
from pagedlm.options import EngineOptions, PagedKvOptions
from pagedlm.params import SamplingParams
from pagedlm.tokenizer import Tokenizer

if TYPE_CHECKING:
    from subprocess import Popen

    from pagedlm.batch.engine import LLMEngine

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# -- tiny models -----------------------------------------------------------------

VOCAB = 256
WINDOW = 8

# Tied embeddings; the Gemma has a window of WINDOW on every other layer.
TINY = {
    "llama": dict(model_type="llama", vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                  num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
                  max_position_embeddings=512, tie_word_embeddings=True),
    "gemma3_text": dict(model_type="gemma3_text", vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                        num_attention_heads=4, num_key_value_heads=1, head_dim=32, num_hidden_layers=4,
                        layer_types=["sliding_attention", "full_attention", "sliding_attention",
                                     "full_attention"],
                        sliding_window=WINDOW, query_pre_attn_scalar=24, max_position_embeddings=512,
                        final_logit_softcapping=30.0),
}

# ``plain=True``: untied; the Gemma has two sliding layers before a full one.
PLAIN = {
    "llama": dict(model_type="llama", vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_hidden_layers=2,
                  rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False),
}
PLAIN["gemma3_text"] = dict(
    PLAIN["llama"], model_type="gemma3_text", num_hidden_layers=3, sliding_window=WINDOW,
    query_pre_attn_scalar=16, layer_types=["sliding_attention", "sliding_attention", "full_attention"],
    rope_local_base_freq=10000.0, hidden_activation="gelu_pytorch_tanh")


def _spread(family: str, name: str) -> tuple[float, float]:
    """(mean, std) of parameter ``name``: norm scales off identity, small
    embeddings, a large final norm, so that greedy picks have margins and
    trajectories wander instead of repeating one token."""
    if name == "model.norm.weight":
        return 5.0, 0.3
    if "norm" in name:
        return (0.0 if family == "gemma3_text" else 1.0), 0.3  # Gemma's norms scale by 1 + weight
    if "embed_tokens" in name or "lm_head" in name:
        return 0.0, 0.03
    return 0.0, 0.3


def tiny_model(family: str = "llama", seed: int = 0, *, vocab_size: int = VOCAB,
               plain: bool = False) -> torch.nn.Module:
    """A `TINY` model of ``family`` with spread random weights (`_spread`),
    float32, CPU, frozen. ``plain``: the `PLAIN` model with every weight
    N(0, 0.1), small and untied: greedy paths that do not loop at once. The
    same arguments give the same weights."""
    if plain:
        torch.manual_seed(seed)
    model = build_model({**(PLAIN if plain else TINY)[family], "vocab_size": vocab_size})
    model.eval().requires_grad_(False)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if plain:
                # The global generator after the build's own draws, in memory
                # order (weights are K-major): what the server tests and the
                # 8-bit KV bounds were set on.
                p.normal_(0.0, 0.1)
            else:
                p.copy_(torch.normal(*_spread(family, name), p.shape, generator=g))
    return model


# -- tokenizers ------------------------------------------------------------------


class CharTokenizer:
    """One token per character (code points below VOCAB); token 1 is EOS."""

    eos_token_ids = {1}
    special_token_ids = frozenset({1})
    vocab_size = VOCAB

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) % VOCAB for c in text]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(i) for i in ids if not (skip_special_tokens and i in self.special_token_ids))

    def detokenizer(self, skip_special_tokens: bool = True) -> "CharDetokenizer":
        return CharDetokenizer(self, skip_special_tokens)


class CharDetokenizer:
    """`CharTokenizer`'s streaming decode: a character a token, nothing held back."""

    def __init__(self, tokenizer: CharTokenizer, skip_special_tokens: bool) -> None:
        self._tokenizer, self._skip = tokenizer, skip_special_tokens

    def add_token(self, token_id: int) -> str:
        return self._tokenizer.decode([token_id], skip_special_tokens=self._skip)

    def finalize(self) -> str:
        return ""


CHATML = (  # SmolLM2's template, without its default system turn
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% endif %}"
)


def byte_level() -> HFTokenizer:
    """Byte-level BPE as the GGUF converter builds it: 3 control tokens, 256
    bytes, a few merges."""
    from pagedlm.loading import gguf as conv  # here: the GPU host's suites run without gguf installed

    alphabet = list(conv.bytes_to_unicode().values())
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *alphabet, "he", "ll", "hell", "hello"]
    md = {
        "general.architecture": "llama",
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [conv.CONTROL] * 3 + [conv.NORMAL] * (len(tokens) - 3),
        "tokenizer.ggml.merges": ["h e", "l l", "he ll", "hell o"],
    }
    return conv.build_tokenizer(conv.GgufFile(Path("x"), md, []))


def tiny_tokenizer() -> Tokenizer:
    """`byte_level` with ChatML's template; EOS <|im_end|>."""
    return Tokenizer(byte_level(), bos_token=None, eos_token="<|im_end|>", add_bos_token=False,
                     chat_template=CHATML)


# -- driving an engine -------------------------------------------------------------

ATOL = 1e-4  # batched vs alone: GEMM shapes change with the batch (see test_models_vs_hf)
GREEDY = SamplingParams(max_tokens=12, ignore_eos=True, logprobs=3)


def prompts(n: int, seed: int = 0, lo: int = 3, hi: int = 40) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, 256) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def run_all(engine: LLMEngine, batch: list[list[int]], params: SamplingParams, arrive_every: int = 0,
            check=None) -> list:
    """Add ``batch`` (one every ``arrive_every`` steps, 0 = all at once), step to
    the end; the finished sequences in prompt order."""
    seqs, pending, steps = [], list(batch), 0
    while pending or engine.has_unfinished():
        if pending and (arrive_every == 0 or steps % arrive_every == 0):
            for ids in pending if arrive_every == 0 else pending[:1]:
                seqs += engine.add_request(ids, params)
            pending = [] if arrive_every == 0 else pending[1:]
        engine.step()
        steps += 1
        if check is not None:
            check(engine)
    return seqs


def paged(block_size: int = 4, budget: int = 1 << 22, **kw) -> EngineOptions:
    return EngineOptions(paged_kv=PagedKvOptions(block_size), kv_budget_bytes=budget, **kw)


def block_bytes(model, block_size: int) -> int:
    """Bytes of one block of the pools with prefix caching: every layer (sliding
    ones keep a copy of their keys there), float32."""
    spec = model.kv_spec()
    return 2 * len(spec) * block_size * spec[0].num_kv_heads * spec[0].head_dim * 4


class Ops:
    """The operations `drive` plays."""

    ADD, STEP, ABORT = range(3)


def drive(engine: LLMEngine, ops, add, check) -> None:
    """Hypothesis's operations against ``engine``: (op, add's arguments, a
    number picking whom to abort); ``check`` after every one, then after
    every step to the end."""
    live = []
    for op, args, pick in ops:
        if op == Ops.ADD:
            live += add(*args)
        elif op == Ops.ABORT and live:
            engine.abort(live.pop(pick % len(live)))
        else:
            engine.step()
        check()
    while engine.has_unfinished():
        engine.step()
        check()


class GreedyOracle:
    """A proposer (`pagedlm.speculative.Proposer`) that knows the answer: the
    model's own greedy continuation (recomputed alone, `Solo`), with the
    token at a random position of each proposal (or none) changed, so that
    the target accepts a random number of its tokens (0 to k)."""

    def __init__(self, model, num_speculative_tokens: int, seed: int = 0, exact: bool = False) -> None:
        self.model, self.num_speculative_tokens = model, num_speculative_tokens
        self.rng, self.exact = random.Random(seed), exact

    def propose(self, rows) -> list[list[int]]:
        return [self.one(seq.tokens, k) for seq, k in rows]

    def release(self, seq_id: int) -> None:
        pass

    def one(self, tokens: list[int], k: int) -> list[int]:
        from pagedlm.batch.solo import Solo

        solo, out = Solo(self.model), []
        logits = solo(tokens)[-1]
        for _ in range(k):
            out.append(int(logits.argmax()))
            logits = solo([out[-1]])[-1]
        wrong = k if self.exact else self.rng.randint(0, k)
        if wrong < k:
            out[wrong] = (out[wrong] + 1 + self.rng.randrange(VOCAB - 1)) % VOCAB
        return out


# -- paged-attention kernel inputs ------------------------------------------------------


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref).norm() / ref.norm()).item()


def paged_inputs(lengths, block_size, hq, hkv, d, dtype, seed=0, spare_blocks=3):
    """Pools with every block random (stale slots included), rows given
    shuffled, non-contiguous blocks, tables padded with -1; on `DEVICE`."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-n // block_size) for n in lengths]
    num_blocks = sum(need) + spare_blocks
    shape = (num_blocks, block_size, hkv, d)
    k_pool = torch.randn(shape, generator=g).to(dtype)
    v_pool = torch.randn(shape, generator=g).to(dtype)
    order = torch.randperm(num_blocks, generator=g).tolist()
    width = max(need) + 1
    tables = torch.full((len(lengths), width), -1, dtype=torch.long)
    for r, n in enumerate(need):
        tables[r, :n] = torch.tensor([order.pop() for _ in range(n)])
    q = torch.randn(len(lengths), hq, d, generator=g).to(dtype)
    seq_lens = torch.tensor(lengths)
    to = lambda t: t.to(DEVICE)  # noqa: E731
    return to(q), to(k_pool), to(v_pool), to(tables), to(seq_lens)


# -- a `pagedlm serve` process ------------------------------------------------------


@dataclass
class Server:
    url: str
    proc: "Popen"
    log: Path

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")


def start_server(*args: str, timeout: float = 180.0) -> Server:
    """Start `pagedlm serve ARGS` on a free port, without the caller's
    ``PAGEDLM_*`` settings (the conversion cache's folder kept), and wait
    until /health answers; a server that exits or does not come up fails
    the test with the end of its log."""
    import socket
    import subprocess
    import sys
    import tempfile
    import time

    import httpx
    import pytest

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PAGEDLM_") or k == "PAGEDLM_CACHE_DIR"}
    log = Path(tempfile.mkstemp(prefix="pagedlm-serve-", suffix=".log")[1])
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "pagedlm.cli", "serve", "--port", str(port), *args],
                                stdout=out, stderr=subprocess.STDOUT, env=env)
    server = Server(f"http://127.0.0.1:{port}", proc, log)
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            pytest.fail(f"the server exited with {proc.returncode}:\n{server.log_text()[-3000:]}")
        try:
            if httpx.get(server.url + "/health", timeout=1).status_code == 200:
                return server
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"the server did not come up in {timeout}s:\n{server.log_text()[-3000:]}")
        time.sleep(0.2)
