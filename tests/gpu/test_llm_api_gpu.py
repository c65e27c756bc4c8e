"""``LLM(gpu_memory_utilization=)`` on CUDA, as vLLM means it: the process's
share of the whole GPU; the KV cache gets that share less what the process
already holds. Skipped without CUDA; run on the GPU machine."""

import gc

import pytest
import torch

from pagedlm import LLM, SamplingParams
from pagedlm.options import OptionError
from tests.helpers import CharTokenizer, tiny_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def test_gpu_memory_utilization_is_a_share_of_the_whole_gpu_less_what_the_process_holds():
    model = tiny_model("llama").cuda()
    _, total = torch.cuda.mem_get_info()
    held = torch.cuda.memory_allocated()
    llm = LLM(model, tokenizer=CharTokenizer(), gpu_memory_utilization=0.1, paged_kv=True)
    stats = llm.engine.cache_stats()
    assert stats.kv_budget_bytes == int(total * 0.1) - held
    assert 0.9 * stats.kv_budget_bytes < stats.blocks_total * stats.block_bytes <= stats.kv_budget_bytes
    (out,) = llm.generate("hello", SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 4
    del llm, out
    gc.collect()
    torch.cuda.empty_cache()
    held = torch.cuda.memory_allocated()
    with pytest.raises(OptionError, match=r"allows .* GiB .* nothing is left for the KV cache; raise it"):
        LLM(model, tokenizer=CharTokenizer(), gpu_memory_utilization=held / total / 2)
