"""Our model files against Hugging Face transformers, the numerics oracle.

Each family gets a tiny random-weight config. transformers builds the model
from a fixed seed and saves it as safetensors; ours loads that state dict
through ``sanitize`` + ``load_state_dict(strict=True)``. Then:
  (a) full-sequence float32 logits agree within ATOL;
  (b) greedy trajectories agree token for token: ours runs incrementally on
      its caches (whole prompt, or the prompt in chunks, then one token per
      step), transformers runs ``generate(do_sample=False)``.
The registry finds each family by the ``model_type`` transformers writes,
and a new Llama-like family (Phi-3) is one file dropped into the package.

transformers runs with attn_implementation="sdpa": the same
``scaled_dot_product_attention`` kernel family that ``pagedlm.attention``
calls, so the comparison measures our model code, not eager-vs-fused
attention arithmetic. (Gemma 3 would need "eager" only for attention
soft-capping, which transformers' Gemma 3 never applies.)
"""

from __future__ import annotations

import copy
import json
import sys

import pytest
import torch
from safetensors.torch import load_file

import transformers  # test-only oracle

from pagedlm.batch.solo import Solo
from pagedlm.kernels import cpu
from pagedlm.models import build_model
from pagedlm.models.layers import rope_inv_freq

# Two float32 implementations of one network are not bit-identical in general:
# the same math reaches kernels in different shapes (a whole prompt vs one
# token vs a chunk of 5; SDPA with is_causal vs an explicit mask, enable_gqa vs
# packed GQA heads), and shape changes GEMM blocking and summation order, so
# each op differs by a few float32 ulps and that noise grows through layers.
# Measured here (logits up to ~6): our one-shot forward happens to equal
# transformers' bit for bit; our incremental path differs by <= ~1e-5, and
# transformers' own cached generate() differs from its own one-shot forward by
# up to ~2e-5. 1e-4 sits above that noise and orders of magnitude below any
# real mistake (an off-by-one sliding window, a missing RoPE scaling or a wrong
# attention scale each move logits by 0.8 to 6 on these weights).
ATOL = 1e-4

WINDOW = 8  # sliding window: prompts and generations run well past it
NEW_TOKENS = 32
VOCAB = 256

COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=0,
)


def hf_config(family: str):
    """A tiny transformers config per family, each switching on its quirks."""
    T = transformers
    if family == "llama":  # Llama 3.1 RoPE scaling (bites: original context 16), tied embeddings
        rope = dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
                    high_freq_factor=4.0, original_max_position_embeddings=16)
        return T.LlamaConfig(**COMMON, num_hidden_layers=2, rope_parameters=rope, tie_word_embeddings=True)
    if family == "qwen2":  # q/k/v bias; sliding window on layers >= max_window_layers
        return T.Qwen2Config(**COMMON, num_hidden_layers=3, use_sliding_window=True,
                             sliding_window=WINDOW, max_window_layers=1)
    if family == "qwen3":  # per-head q/k RMSNorm, head_dim not hidden/heads
        return T.Qwen3Config(**COMMON, num_hidden_layers=2, head_dim=32)
    if family == "mistral":  # sliding window on every layer
        return T.MistralConfig(**COMMON, num_hidden_layers=2, sliding_window=WINDOW)
    if family == "gemma3_text":
        return T.Gemma3TextConfig(
            **{**COMMON, "num_key_value_heads": 1}, head_dim=32, num_hidden_layers=4,
            layer_types=["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"],
            sliding_window=WINDOW, query_pre_attn_scalar=24,
            rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
                             "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}},
            final_logit_softcapping=30.0,
        )
    raise AssertionError(family)


# model_type -> the file of pagedlm/models that serves it
FAMILIES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "mistral": "mistral", "gemma3_text": "gemma3"}


def randomize_(model: torch.nn.Module, gemma: bool) -> None:
    """Weights with spread, so that the test can tell mistakes apart: norm
    scales away from their identity (w vs 1 + w shows), biases non-zero.
    Small embeddings and a large final-norm scale keep the tied embedding from
    making every token predict itself (random nets otherwise loop on one
    token), and give greedy picks clear margins (checked in the test)."""
    identity = 0.0 if gemma else 1.0
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name == "model.norm.weight":
                p.normal_(5.0, 0.3)
            elif "norm" in name:
                p.normal_(identity, 0.3)
            elif "embed_tokens" in name or "lm_head" in name:
                p.normal_(0.0, 0.03)
            else:  # projections and biases
                p.normal_(0.0, 0.3)


@pytest.fixture(scope="module", params=list(FAMILIES))
def pair(request, tmp_path_factory):
    """(transformers model, our model) with the same weights, both float32."""
    family = request.param
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(hf_config(family), attn_implementation="sdpa")
    randomize_(hf, gemma=family == "gemma3_text")
    hf.eval()
    folder = tmp_path_factory.mktemp(family)
    hf.save_pretrained(folder)

    config = json.loads((folder / "config.json").read_text())
    ours = build_model(config)
    weights = load_file(folder / "model.safetensors")
    ours.load_state_dict(ours.sanitize(weights), strict=True)
    ours.eval()
    return family, hf, ours


def run_ours(model, prompt: list[int], chunks: list[int] | None, n_new: int):
    """Greedy-decode incrementally: the prompt in ``chunks`` (sizes; None = all
    at once), then one token per step. Returns (new tokens, logits of every
    position fed, [L, V])."""
    solo = Solo(model)
    sizes = chunks or [len(prompt)]
    assert sum(sizes) == len(prompt)
    logits, start = [], 0
    for size in sizes:
        logits.append(solo(prompt[start : start + size]))
        start += size
    tokens = []
    for _ in range(n_new):
        tokens.append(int(logits[-1][-1].argmax()))
        if len(tokens) < n_new:
            logits.append(solo([tokens[-1]]))
    return tokens, torch.cat(logits)


PROMPT_LONG = [(7 * i + 3) % VOCAB for i in range(21)]  # > WINDOW: rotating caches wrap in prefill
PROMPT_SHORT = PROMPT_LONG[:5]  # < WINDOW: wraps only during decode

CASES = {
    "short-prompt": (PROMPT_SHORT, None),
    "long-prompt": (PROMPT_LONG, None),
    # multi-token updates after the window has wrapped
    "chunks-of-5": (PROMPT_LONG, [5, 5, 5, 5, 1]),
    # multi-token chunk bigger than the window, single tokens while the
    # rotating cache is linear, then a multi-token chunk onto a ring
    "mixed-chunks": (PROMPT_LONG, [3, 9, 1, 1, 7]),
}


@torch.no_grad()
def test_full_sequence_logits_match_transformers(pair):
    family, hf, ours = pair
    ids = torch.tensor([[(11 * i + 5) % VOCAB for i in range(40)]])
    expected = hf(ids).logits[0]
    got = Solo(ours)(ids[0])
    assert got.shape == expected.shape
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)


@torch.no_grad()
def test_bfloat16_logits_bit_identical_to_transformers(pair):
    """Same casts in the same order as transformers (Llama's ``w * x.to(dtype)``
    vs Gemma's ``(x * (1 + w)).to(dtype)``, RoPE tables cast after cos/sin,
    sqrt(hidden) rounded to bf16), so on the same CPU kernels the bfloat16
    logits are equal bit for bit; a cast-order slip costs whole bf16 ulps.
    transformers' ``.to(bfloat16)`` would also round its RoPE ``inv_freq``
    buffers (which ``from_pretrained(dtype=...)`` keeps in float32), so
    they are put back in float32 first."""
    family, hf, ours = pair
    hf, ours = copy.deepcopy(hf), copy.deepcopy(ours)
    inv_freqs = {n: b for n, b in hf.named_buffers() if n.endswith("inv_freq")}
    hf.to(torch.bfloat16)
    ours.to(torch.bfloat16)
    for name, buffer in inv_freqs.items():
        module, attr = name.rsplit(".", 1)
        setattr(hf.get_submodule(module), attr, buffer)
    ids = torch.tensor([[(11 * i + 5) % VOCAB for i in range(40)]])
    expected = hf(ids).logits[0]
    got = Solo(ours)(ids[0])
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, expected), (got.float() - expected.float()).abs().max()


def assert_greedy_matches(hf, ours, case: str) -> None:
    """Ours, decoding ``CASES[case]`` incrementally, picks the tokens of
    transformers' ``generate``; every step's logits match transformers'
    one-shot forward over the same sequence, and the picks had clear
    margins, so token equality is not luck on a near-tie."""
    prompt, chunks = CASES[case]
    ids = torch.tensor([prompt])
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                      do_sample=False, eos_token_id=None, pad_token_id=0)
    tokens, logits = run_ours(ours, prompt, chunks, NEW_TOKENS)
    assert tokens == out[0, len(prompt) :].tolist()
    reference = hf(out[:, :-1]).logits[0]
    torch.testing.assert_close(logits, reference, atol=ATOL, rtol=0)
    top2 = reference[len(prompt) - 1 :].topk(2, dim=-1).values
    margin = (top2[:, 0] - top2[:, 1]).min()
    assert margin > 2 * ATOL, f"near-tie ({margin:.2e}) in the test weights: pick another seed"


@pytest.mark.parametrize("case", list(CASES))
@torch.no_grad()
def test_greedy_trajectory_matches_transformers_generate(pair, case):
    family, hf, ours = pair
    assert_greedy_matches(hf, ours, case)


def counted(monkeypatch, owner, name: str) -> list:
    """Wrap ``owner.name`` for the test; the list grows by one a call."""
    calls, fn = [], getattr(owner, name)
    monkeypatch.setattr(owner, name, lambda *a: calls.append(1) or fn(*a))
    return calls


def assert_generates(hf, prompt: list[int], tokens: list[int], logits: torch.Tensor) -> None:
    """Our greedy ``tokens`` after ``prompt`` are transformers' ``generate``'s,
    and our ``logits`` along them are within ATOL of its."""
    ids = torch.tensor([prompt])
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                      do_sample=False, eos_token_id=None, pad_token_id=0)
    assert tokens == out[0, len(prompt) :].tolist()
    torch.testing.assert_close(logits, hf(out[:, :-1]).logits[0], atol=ATOL, rtol=0)


@torch.no_grad()
def test_threaded_one_row_products_match_transformers(pair, monkeypatch):
    """Decode through ``kernels.cpu.linear``'s threaded path on every
    projection (the real models only take it for weights of a megabyte or
    more): same greedy tokens, logits within ATOL, and the path really ran."""
    family, hf, ours = pair
    prompt, chunks = CASES["mixed-chunks"]
    monkeypatch.setattr(cpu, "SPLIT_MIN_BYTES", 0)
    calls = counted(monkeypatch, torch, "bmm")
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        tokens, logits = run_ours(ours, prompt, chunks, NEW_TOKENS)
        again, logits_again = run_ours(ours, prompt, chunks, NEW_TOKENS)
    finally:
        torch.set_num_threads(threads)
    n_linear = sum(isinstance(m, torch.nn.Linear) for m in ours.modules()) + 1  # + tied head
    assert len(calls) >= 2 * (NEW_TOKENS - 1) * (n_linear - 1)
    assert tokens == again and torch.equal(logits, logits_again)  # deterministic
    assert_generates(hf, prompt, tokens, logits)


@torch.no_grad()
def test_multi_row_products_in_onednn_match_transformers(pair, monkeypatch):
    """Prompt chunks through ``kernels.cpu.linear``'s oneDNN path (every
    product of two rows or more here; the real models take it from
    ``ONEDNN_MIN_ROWS``): same greedy tokens, logits within ATOL, and the
    path really ran (on x86, where it is taken)."""
    family, hf, ours = pair
    prompt, chunks = CASES["mixed-chunks"]
    monkeypatch.setattr(cpu, "ONEDNN_MIN_ROWS", 2)
    calls = counted(monkeypatch, cpu, "_onednn_linear")
    tokens, logits = run_ours(ours, prompt, chunks, NEW_TOKENS)
    assert len(calls) > 0 or not cpu._ONEDNN
    assert_generates(hf, prompt, tokens, logits)


def test_weights_are_k_major_for_float32_cpu_only(pair):
    """Projection and embedding weights keep their HF shapes ``[out, in]``;
    in float32 on the CPU they live K-major (``[in, out]`` in memory), in any
    other dtype row-major as checkpoints store them. The layout follows the
    model through ``.to()`` and through ``load_model``'s
    ``load_state_dict(assign=True)`` + ``.to()``; q/k/v and gate/up are fused
    under their own names."""
    family, hf, ours = pair
    names = set(ours.state_dict())
    assert "model.layers.0.self_attn.qkv_proj.weight" in names
    assert "model.layers.0.mlp.gate_up_proj.weight" in names
    assert not any(".q_proj." in n or ".gate_proj." in n for n in names)

    def matrices(model):
        return [(n, p) for n, p in model.named_parameters() if p.dim() == 2]

    assert all(cpu.is_k_major(p) for _, p in matrices(ours))
    half = copy.deepcopy(ours).to(torch.bfloat16)
    assert all(p.is_contiguous() for _, p in matrices(half))
    assert all(cpu.is_k_major(p) for _, p in matrices(half.float()))

    with torch.device("meta"):
        loaded = build_model(json.loads(hf.config.to_json_string()))
    weights = {k: v.clone() for k, v in hf.state_dict().items()}
    loaded.load_state_dict(loaded.sanitize(weights), strict=True, assign=True)
    loaded.to("cpu", torch.float32)
    assert all(cpu.is_k_major(p) for _, p in matrices(loaded))
    for (name, a), (_, b) in zip(matrices(loaded), matrices(ours)):
        assert torch.equal(a, b), name


def test_config_spellings_give_transformers_rope_frequencies():
    """config.json in either spelling (classic rope_theta/rope_scaling/
    rope_local_base_freq, or transformers 5's rope_parameters) gives the
    inverse frequencies transformers uses."""
    from pagedlm.models import gemma3, llama

    scaling = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=16)
    classic = dict(COMMON, model_type="llama", num_hidden_layers=1, rope_theta=500000.0, rope_scaling=scaling)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{k: v for k, v in classic.items() if k != "model_type"}))
    for cfg in (classic, hf.config.to_dict()):
        args = llama.ModelArgs.from_dict(cfg)
        got = rope_inv_freq(args.head_dim, args.rope_theta, args.rope_scaling)
        assert torch.equal(got, hf.model.rotary_emb.inv_freq)

    classic = dict(COMMON, model_type="gemma3_text", num_hidden_layers=7, head_dim=32, rope_theta=1e6,
                   rope_local_base_freq=1e4, rope_scaling={"rope_type": "linear", "factor": 8.0},
                   sliding_window_pattern=6)
    hf = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(**{k: v for k, v in classic.items() if k != "model_type"}))
    rotary = hf.model.rotary_emb
    for cfg in (classic, hf.config.to_dict()):
        args = gemma3.ModelArgs.from_dict(cfg)
        assert args.layer_types == hf.config.layer_types
        assert torch.equal(rope_inv_freq(args.head_dim, args.rope_theta, args.rope_scaling),
                           rotary.full_attention_inv_freq)
        assert torch.equal(rope_inv_freq(args.head_dim, args.rope_local_base_freq, args.rope_local_scaling),
                           rotary.sliding_attention_inv_freq)


def test_each_family_is_found_by_model_type_and_an_unknown_one_refused_by_name():
    """The registry holds exactly the families checked above against
    transformers, each served by its own file for the config.json
    transformers writes; a model_type no file serves is refused by name."""
    from pagedlm import models

    assert sorted(models.FAMILIES) == sorted(FAMILIES)
    for model_type, file in FAMILIES.items():
        assert type(build_model(hf_config(model_type).to_dict())).__module__ == f"pagedlm.models.{file}"
    phi3 = transformers.Phi3Config(**COMMON, num_hidden_layers=1).to_dict()
    with pytest.raises(ValueError, match=r"model_type 'phi3' \(supported: gemma3_text, llama, mistral, qwen2, qwen3\)"):
        build_model(phi3)


# All that a new Llama-like family writes (``models.base``): Phi-3, which
# transformers has and pagedlm does not, and which took 4-6 files before.
PHI3_FILE = '''"""Phi-3: the Llama decoder (its checkpoints store q/k/v and gate/up
fused already) with a sliding window on every layer if config.json sets one."""

from dataclasses import dataclass

from pagedlm.models import llama

MODEL_TYPES = ("phi3",)


@dataclass
class ModelArgs(llama.ModelArgs):
    def window(self, layer: int) -> int | None:
        return self.sliding_window


class Model(llama.Model):
    args_class = ModelArgs
'''


@pytest.fixture
def phi3_file(tmp_path, monkeypatch):
    """PHI3_FILE as a file of pagedlm/models (in a second folder of the
    package), found as the package finds its families; gone after the test."""
    from pagedlm import models

    (tmp_path / "phi3.py").write_text(PHI3_FILE)
    monkeypatch.setattr(models, "__path__", [*models.__path__, str(tmp_path)])
    monkeypatch.setattr(models, "FAMILIES", models.find_families())
    yield
    del sys.modules["pagedlm.models.phi3"], models.phi3


@torch.no_grad()
def test_a_new_llama_like_family_is_one_file(phi3_file, tmp_path):
    """With that one file and nothing else edited, the loader takes a
    transformers Phi-3 checkpoint (its own config.json and fused tensors),
    and the model matches transformers: logits, sliding window, greedy
    decoding over the window."""
    from pagedlm.loading import load_model

    torch.manual_seed(0)
    config = transformers.Phi3Config(**COMMON, num_hidden_layers=2, sliding_window=WINDOW)
    hf = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    randomize_(hf, gemma=False)
    hf.eval()
    hf.save_pretrained(tmp_path / "phi3-tiny")
    ours = load_model(tmp_path / "phi3-tiny")
    assert type(ours).__module__ == "pagedlm.models.phi3"
    assert [s.window for s in ours.kv_spec()] == [WINDOW, WINDOW]
    ids = torch.tensor([[(11 * i + 5) % VOCAB for i in range(40)]])
    torch.testing.assert_close(Solo(ours)(ids[0]), hf(ids).logits[0], atol=ATOL, rtol=0)
    assert_greedy_matches(hf, ours, "mixed-chunks")
