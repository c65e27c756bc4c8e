"""Weight-only int4 on CUDA: torch's int4 kernel against the weight it
stands for, and a quantized model decoding under CUDA graphs.

Skipped without CUDA; run on the GPU machine.
"""

from pathlib import Path

import pytest
import torch

from pagedlm.bench.common import load_random
from pagedlm.kernels.quant import QuantizedWeight, dequantize, quantize
from pagedlm.llm import LLM
from pagedlm.loading.quant import quantize_model
from pagedlm.params import SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

CONFIGS = Path(__file__).resolve().parents[2] / "benchmarks" / "configs"
KERNEL_REL = 4 * 2.0**-9  # bf16 roundings: the activations, the scales and zeros, the output


@pytest.mark.parametrize("shape", [(4096, 1024), (1024, 3072)])
@pytest.mark.parametrize("rows", [1, 16])
def test_int4_linear_on_cuda_is_the_dequantized_product(shape, rows):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(shape, generator=g) * 0.02
    stored = quantize(w, "int4")
    x = torch.randn(rows, shape[1], generator=g).to("cuda", torch.bfloat16)
    w_deq = dequantize(stored).cuda()
    ref = x.float() @ w_deq.T
    bound = KERNEL_REL * (x.float().abs() @ w_deq.abs().T) + 1e-6
    y = QuantizedWeight.from_stored(stored, shape, "cuda").linear(x)
    assert y.dtype == torch.bfloat16 and ((y.float() - ref).abs() <= bound).all()
    swapped = {**stored, "qweight": (stored["qweight"] >> 4) | (stored["qweight"] << 4)}  # a nibble-order slip
    wrong = QuantizedWeight.from_stored(swapped, shape, "cuda").linear(x)
    assert ((wrong.float() - ref).abs() > bound).any()


def _greedy(llm, vocab: int):
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (700, 300, 45, 1)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=32, ignore_eos=True, logprobs=1), use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


def test_int4_model_decodes_the_same_under_graphs_as_eager():
    """CUDA graphs replay what an eager step computes: tokens and logprobs
    equal to the bit (the int4 products, like the attention kernel, do not
    depend on the padded rows of a graph's batch)."""
    model, tokenizer = load_random(str(CONFIGS / "qwen3-0.6b"), "cuda", torch.bfloat16)
    quantize_model(model, "int4")
    kw = dict(tokenizer=tokenizer, kv_budget_bytes=1 << 30, max_num_batched_tokens=512, max_model_len=2048,
              paged_kv=True, block_size=16, attention_backend="triton")
    eager = _greedy(LLM(model, enforce_eager=True, **kw), tokenizer.vocab_size)
    llm = LLM(model, **kw)
    assert llm.engine.graphs is not None
    assert len(set(eager[0][0])) > 1, "degenerate trajectory proves nothing"
    assert _greedy(llm, tokenizer.vocab_size) == eager
