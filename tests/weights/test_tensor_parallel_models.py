"""Tensor parallelism on the real models (CPU, gloo, float32) against one rank:
the same greedy tokens, logits within 1e-4 (float32: 5e-5..7e-5 measured; in
float64 within 1e-9, measured 0.0), default and paged stores
(prefix caching on), each rank loading only its slices and holding about
1/N of the weights; `pagedlm serve --tensor-parallel-size 2` streaming to 16
clients at once what one rank generates.

SmolLM2-135M's 9 query heads over 3 KV heads split 6 + 3 over 2 ranks (whole
KV groups) and 3 + 2 + 2 + 2 over 4 (KV heads shared where a group spans
ranks); Gemma 3 270M's single KV head is on every rank. Kept short: the CI
box has two cores."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from pathlib import Path

import openai
import pytest
import torch

from pagedlm.llm import LLM
from pagedlm.loading import load
from pagedlm.loading.quant import weight_bytes
from pagedlm.params import SamplingParams
from tests.helpers import ATOL, start_server

pytestmark = pytest.mark.weights

# The tiny models of tests/fast/test_tensor_parallel.py meet the 1e-5 (by 100x). Over 30
# layers the ranks' reordered float32 sums (o_proj and down_proj add N partial products) drift
# further: 5e-5 on SmolLM2's logits over 2 ranks, magnitude ~20. The bar is then the project's
# own for reordered float32 sums of the same math, batched against alone (tests/helpers.ATOL).
TOL = ATOL
SMOLLM, GEMMA = "smollm2-135m-instruct", "gemma3-270m"
GEN = 8
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a land far away,",
           "The three laws of motion are"]


class Logits:
    def __init__(self, model) -> None:
        self.model, self.seen, self._f = model, [], model.compute_logits
        model.compute_logits = lambda h: self.seen.append(self._f(h).clone()) or self.seen[-1]

    def close(self) -> list[torch.Tensor]:
        del self.model.compute_logits
        return self.seen


def _generate(llm: LLM, prompts) -> tuple[list[list[int]], list[torch.Tensor]]:
    rec = Logits(llm.engine.model)
    try:
        outs = llm.generate(prompts, SamplingParams(max_tokens=GEN, ignore_eos=True), use_tqdm=False)
    finally:
        logits = rec.close()
    return [o.outputs[0].token_ids for o in outs], logits


OPTIONS = dict(max_model_len=1024, kv_budget_bytes=1 << 28)
_REFERENCE: dict[str, tuple] = {}


def _reference(name: str, stores: tuple[bool, ...], float32_model):
    """(prompts, tokenizer, one rank's (ids, logits) per store (paged or not), weight bytes) of ``name``, once."""
    if name not in _REFERENCE:
        model, tokenizer = float32_model(name)  # shared (tests/weights/conftest.py); Logits puts it back
        shared = tokenizer.decode(tokenizer.encode(" ".join(PROMPTS) * 3))  # a shared prefix of several blocks
        prompts = PROMPTS + [shared + " first", shared + " second"]
        expected = {paged: _generate(LLM(model, tokenizer=tokenizer, paged_kv=paged, **OPTIONS), prompts)
                    for paged in stores}
        _REFERENCE[name] = prompts, tokenizer, expected, weight_bytes(model)
    return _REFERENCE[name]


# Gemma's 262144-token head makes each of its runs cost SmolLM2's four: the paged store only (it
# is the one with prefix caching; the default store is SmolLM2's to check).
@pytest.mark.parametrize("name,size,stores", [(SMOLLM, 2, (False, True)), (SMOLLM, 4, (False, True)),
                                              (GEMMA, 2, (True,))])
def test_ranks_match_one_rank(name, size, stores, float32_model):
    prompts, tokenizer, expected, full = _reference(name, stores, float32_model)
    tp = LLM(name, tensor_parallel_size=size, **OPTIONS)  # each rank reads only its slices
    try:
        for paged in stores:
            llm = LLM(tp.engine.model, tokenizer=tokenizer, paged_kv=paged, **OPTIONS)
            ids, logits = _generate(llm, prompts)
            assert ids == expected[paged][0], f"{name} over {size} ranks, paged={paged}"
            diff = max((a - b).abs().max().item() for a, b in zip(expected[paged][1], logits))
            print(f"{name} over {size} ranks, paged={paged}: max logit difference {diff:.2e}")
            assert diff <= TOL, f"{name} over {size} ranks, paged={paged}: logits differ by {diff}"
        assert llm.engine.blocks.hit_tokens > 0  # the paged run shared its prompts' prefix
        # Each rank about 1/N: what is replicated (norms, shared KV heads) is small beside it.
        assert max(tp.engine.model.weight_bytes) < full / size * 1.25
    finally:
        tp.engine.model.close()


def test_ranks_in_float64_match_one_rank_within_1e_9():
    """The split itself is exact math: in float64 SmolLM2 over 2 ranks gives one
    rank's logits within 1e-9 (measured: 0.0), so the 5e-5 of float32 above is
    the rounding of o_proj's and down_proj's partial sums added in another order."""
    model, tokenizer = load(SMOLLM, "cpu", torch.float32)
    model = model.double()
    prompts = PROMPTS[:2]
    one_ids, one = _generate(LLM(model, tokenizer=tokenizer, **OPTIONS), prompts)
    tp = LLM(model, tokenizer=tokenizer, tensor_parallel_size=2, **OPTIONS)  # every rank copies its slices
    try:
        ids, logits = _generate(tp, prompts)
    finally:
        tp.engine.model.close()
    assert ids == one_ids and len(logits) == len(one) == GEN
    diff = max((a - b).abs().max().item() for a, b in zip(one, logits))
    print(f"{SMOLLM} over 2 ranks, float64: max logit difference {diff:.2e}")
    assert diff <= 1e-9


def test_torchrun_ranks_serve_as_the_engines_workers(tmp_path):
    script = tmp_path / "run.py"
    script.write_text(
        "import os\n"
        "from pagedlm import LLM, SamplingParams\n"
        "if __name__ == '__main__':\n"
        f"    llm = LLM({SMOLLM!r}, tensor_parallel_size=2, max_model_len=256)\n"
        f"    out = llm.generate({PROMPTS[0]!r}, SamplingParams(max_tokens={GEN}, ignore_eos=True), use_tqdm=False)\n"
        "    print('rank', os.environ['RANK'], out[0].outputs[0].token_ids, flush=True)\n")
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
                          str(script)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = [line for line in run.stdout.splitlines() if line.startswith("rank ")]
    want = LLM(SMOLLM, max_model_len=256).generate(PROMPTS[0], SamplingParams(max_tokens=GEN, ignore_eos=True),
                                                  use_tqdm=False)[0].outputs[0].token_ids
    assert lines == [f"rank 0 {want}"]  # rank 1 served as a worker and printed nothing


# -- the server ------------------------------------------------------------------


def test_server_over_two_ranks_streams_one_ranks_greedy_output_to_16_clients():
    prompts = [f"{p} ({i})" for i in range(4) for p in PROMPTS]  # 16
    max_tokens = 12
    ref = LLM(SMOLLM, max_model_len=512).generate(prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                                                  use_tqdm=False)
    expected = [o.outputs[0].text for o in ref]
    server = start_server("--model", SMOLLM, "--tensor-parallel-size", "2", "--max-model-len", "512", timeout=240.0)
    proc, url = server.proc, server.url
    try:
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)

        async def stream(prompt: str) -> str:
            chunks = await client.completions.create(model=SMOLLM, prompt=prompt, max_tokens=max_tokens,
                                                     temperature=0, stream=True,
                                                     extra_body={"ignore_eos": True})
            return "".join([c.choices[0].text async for c in chunks])

        async def all_of_them():
            return await asyncio.gather(*(stream(p) for p in prompts))

        assert asyncio.run(all_of_them()) == expected
        workers = _children(proc.pid)
        assert len(workers) == 1  # rank 1
    finally:
        proc.terminate()  # uvicorn drains, then re-raises SIGTERM: the status is -15
        proc.wait(timeout=30)
    deadline = time.monotonic() + 5
    while any(Path(f"/proc/{pid}").exists() for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in workers if Path(f"/proc/{pid}").exists()], "an orphaned worker"


def _children(pid: int) -> list[int]:
    """Processes whose parent is ``pid`` (from /proc), but for multiprocessing's resource tracker."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(") ", 1)[1].split()
            cmdline = (stat.parent / "cmdline").read_bytes()
        except OSError:
            continue
        if int(fields[1]) == pid and b"resource_tracker" not in cmdline:
            out.append(int(stat.parent.name))
    return out
