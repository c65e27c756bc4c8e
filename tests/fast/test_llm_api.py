"""The offline API as a vLLM script uses it, with only the import changed
(``from pagedlm import LLM, SamplingParams``), on a tiny random-weight model
and a byte-level tokenizer with ChatML's template (tests/fast/conftest.py)."""

from __future__ import annotations

import time

import pytest
from tqdm import tqdm

from pagedlm import LLM, CompletionOutput, Logprob, RequestOutput, SamplingParams
from pagedlm.options import EngineOptions, OptionError, UnsupportedOption, resolve_engine_options

PROMPT = "hello world, hello"
SMALL_POOL = dict(paged_kv=True, kv_budget_bytes=1 << 22)


@pytest.fixture(scope="module")
def llm(model, tokenizer) -> LLM:
    return LLM(model, tokenizer=tokenizer)


def texts(outputs: list[RequestOutput]) -> list[str]:
    return [o.outputs[0].text for o in outputs]


def test_every_vllm_prompt_form_generates_from_its_prompt(llm, tokenizer):
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    ids = tokenizer.encode(PROMPT)
    want = llm.generate(PROMPT, params, use_tqdm=False)[0]
    assert want.prompt == PROMPT and want.prompt_token_ids == ids and len(want.outputs[0].token_ids) == 6
    for form in (ids, {"prompt": PROMPT}, {"prompt_token_ids": ids}):
        (got,) = llm.generate(form, params, use_tqdm=False)
        assert got.prompt_token_ids == ids and got.outputs[0].token_ids == want.outputs[0].token_ids, form
        assert got.prompt == (None if "prompt" not in form and not isinstance(form, str) else PROMPT), form
    other = "world"
    batch = [{"prompt_token_ids": ids}, {"prompt": other}, ids, other]
    outs = llm.generate(batch, params, use_tqdm=False)
    alone = llm.generate(other, params, use_tqdm=False)[0].outputs[0].text
    assert texts(outs) == [want.outputs[0].text, alone, want.outputs[0].text, alone]
    assert [o.prompt for o in outs] == [None, other, None, other]
    assert texts(llm.generate([ids, tokenizer.encode(other)], params, use_tqdm=False)) == texts(outs[2:])


BAD_PROMPTS = [
    ({"prompt": "a", "multi_modal_data": {"image": None}}, ValueError, "'multi_modal_data' not supported"),
    ({"prompt": "a", "prompt_token_ids": [5]}, ValueError, "one of 'prompt' and 'prompt_token_ids'"),
    ({}, ValueError, "one of 'prompt' and 'prompt_token_ids'"),
    ({"prompt": 5}, TypeError, "'prompt' must be a str"),
    ({"prompt_token_ids": "abc"}, TypeError, "'prompt_token_ids' must be a list of ints"),
    ({"prompt_token_ids": [5, 6.0]}, TypeError, r"token ids must be ints \(got 6.0"),
    ([1.5, 2.5], TypeError, "token ids must be ints"),
    ([5, True], TypeError, "token ids must be ints"),
    ([5, 263], ValueError, "prompt 0 holds token id 263, outside the vocabulary"),
    ([-1], ValueError, "prompt 0 holds token id -1, outside the vocabulary"),
    ([], ValueError, "no prompts"),
    ([[]], ValueError, "prompt 0 is empty"),
    ({"prompt_token_ids": []}, ValueError, "prompt 0 is empty"),
    (("hello", "world"), TypeError, "prompt 0 has type tuple"),
    (["hello", ("w",)], TypeError, "prompt 1 has type tuple"),
    (["hello", 5], TypeError, "prompt 1 has type int"),
    (None, TypeError, "prompt 0 has type NoneType"),
]


@pytest.mark.parametrize("prompts, error, message", BAD_PROMPTS)
def test_bad_prompt_forms_are_refused_by_the_api_before_anything_is_queued(llm, monkeypatch, prompts, error,
                                                                            message):
    queued = []
    monkeypatch.setattr(llm.engine, "add_request", lambda *a, **k: queued.append(a))
    with pytest.raises(error, match=message):
        llm.generate(prompts, SamplingParams(max_tokens=2), use_tqdm=False)
    assert queued == []


def test_sampling_params_are_checked_before_anything_is_queued(llm, monkeypatch):
    queued = []
    real = llm.engine.add_request
    monkeypatch.setattr(llm.engine, "add_request", lambda *a, **k: queued.append(a) or real(*a, **k))
    with pytest.raises(ValueError, match="2 sampling params for 3 prompts"):
        llm.generate(["a", "b", "c"], [SamplingParams(), SamplingParams()], use_tqdm=False)
    with pytest.raises(TypeError, match="sampling_params must be SamplingParams"):
        llm.generate("a", {"max_tokens": 3}, use_tqdm=False)
    with pytest.raises(OptionError, match="temperature must be >= 0"):
        llm.generate(["a", "b"], [SamplingParams(), SamplingParams(temperature=-1.0)], use_tqdm=False)
    assert queued == []
    # What only the engine can judge (length against max_model_len) names the prompt;
    # what was queued before it is taken back.
    with pytest.raises(OptionError, match=r"prompt 1: the prompt \(8200 tokens\) plus max_tokens \(2\) exceeds"):
        llm.generate(["a", "x" * 8200], SamplingParams(max_tokens=2), use_tqdm=False)
    assert len(queued) == 2 and not llm.engine.has_unfinished()


def test_truncated_prompts_report_the_prompt_that_ran(llm, tokenizer):
    """truncate_prompt_tokens: prompt_token_ids and prompt_logprobs are the kept tokens' (as vLLM's)."""
    ids = tokenizer.encode(PROMPT)
    params = SamplingParams(max_tokens=3, ignore_eos=True, prompt_logprobs=0)
    (cut,) = llm.generate(ids, SamplingParams(max_tokens=3, ignore_eos=True, prompt_logprobs=0,
                                              truncate_prompt_tokens=4), use_tqdm=False)
    (tail,) = llm.generate(ids[-4:], params, use_tqdm=False)
    assert cut.prompt_token_ids == ids[-4:] == tail.prompt_token_ids
    assert cut.prompt_logprobs == tail.prompt_logprobs and list(cut.prompt_logprobs[1]) == [ids[-3]]
    assert cut.outputs[0].token_ids == tail.outputs[0].token_ids


def test_vllms_defaults_of_none(llm, tokenizer):
    """max_tokens=None generates up to the model's length; stop=None and
    stop_token_ids=None are no stops; a tuple of params is one per prompt."""
    (out,) = llm.generate(PROMPT, SamplingParams(max_tokens=None, ignore_eos=True, stop=None, stop_token_ids=None),
                          use_tqdm=False)
    assert len(out.prompt_token_ids) + len(out.outputs[0].token_ids) == llm.engine.max_model_len
    assert out.outputs[0].finish_reason == "length"
    with pytest.raises(OptionError, match="leaves no room|exceeds"):
        llm.generate([5] * llm.engine.max_model_len, SamplingParams(max_tokens=None), use_tqdm=False)
    two = llm.generate(["a", "b"], (SamplingParams(max_tokens=2), SamplingParams(max_tokens=3)), use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in two] == [2, 3]
    with pytest.raises(OptionError, match="stop_token_ids holds token id 99999, outside the vocabulary"):
        llm.generate("a", SamplingParams(stop_token_ids=[99999]), use_tqdm=False)


def test_logprobs_are_vllms_dicts_with_rank_and_decoded_token(llm, tokenizer):
    ids = tokenizer.encode(PROMPT)
    params = SamplingParams(max_tokens=8, ignore_eos=True, logprobs=3, prompt_logprobs=2)
    (out,) = llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids)
    completion = out.outputs[0]
    assert isinstance(completion, CompletionOutput) and len(completion.logprobs) == 8
    scored = ((ids[1:], out.prompt_logprobs[1:], 2), (completion.token_ids, completion.logprobs, 3))
    for tokens, positions, k in scored:
        for token, position in zip(tokens, positions):
            assert next(iter(position)) == token  # the token there first, then the top k
            assert all(isinstance(lp, Logprob) for lp in position.values())
            assert {t: lp.decoded_token for t, lp in position.items()} == {
                t: tokenizer.decode([t], skip_special_tokens=False) for t in position}
            top = sorted((lp for t, lp in position.items() if lp.rank <= k), key=lambda lp: lp.rank)
            assert [lp.rank for lp in top] == list(range(1, k + 1))
            assert all(a.logprob >= b.logprob for a, b in zip(top, top[1:]))
            chosen = position[token]
            if chosen.rank <= k:  # one of the top k: ranked among them
                assert chosen.rank == 1 + sum(lp.logprob > chosen.logprob for lp in top) and len(position) == k
            else:  # after all of them
                assert all(lp.logprob > chosen.logprob for lp in top) and len(position) == k + 1
    # greedy: each generated token is the most likely one but for special tokens, which are not sampled
    for token, position in zip(completion.token_ids, completion.logprobs):
        assert {t for t, lp in position.items() if lp.rank < position[token].rank} <= tokenizer.special_token_ids


def test_the_rank_of_a_token_outside_the_top_k_is_its_rank_in_the_vocabulary(llm):
    """Sampled hot, the chosen token is often outside the top 1: its rank
    (counted over the whole vocabulary) is where the top 20 of the same run
    put it."""
    def run(k):
        params = SamplingParams(max_tokens=24, ignore_eos=True, temperature=3.0, seed=11, logprobs=k)
        return llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0]

    narrow, wide = run(1), run(20)
    assert narrow.token_ids == wide.token_ids
    outside = 0
    for token, a, b in zip(narrow.token_ids, narrow.logprobs, wide.logprobs):
        assert a[token].rank == b[token].rank and a[token].logprob == pytest.approx(b[token].logprob, abs=1e-6)
        if b[token].rank > 1:
            outside += 1
            assert [t for t, lp in b.items() if lp.rank == b[token].rank] == [token]
    assert outside >= 3


def test_cumulative_logprob_is_the_sum_of_the_chosen_tokens_logprobs(llm):
    params = SamplingParams(max_tokens=7, ignore_eos=True, temperature=1.0, seed=3, logprobs=0, n=2)
    (out,) = llm.generate(PROMPT, params, use_tqdm=False)
    ids = out.prompt_token_ids
    for c in out.outputs:
        assert c.cumulative_logprob < 0 and all(len(lp) == 1 for lp in c.logprobs)
        # the same tokens scored again as a prompt (another path: prompt logprobs of one forward pass)
        (again,) = llm.generate({"prompt_token_ids": ids + c.token_ids},
                                SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
        scored = again.prompt_logprobs[len(ids):]
        assert c.cumulative_logprob == pytest.approx(sum(pl[t].logprob for t, pl in zip(c.token_ids, scored)),
                                                     abs=1e-4 * len(scored))
    (plain,) = llm.generate(PROMPT, SamplingParams(max_tokens=3), use_tqdm=False)
    assert plain.outputs[0].cumulative_logprob is None and plain.outputs[0].logprobs is None
    assert plain.prompt_logprobs is None


def test_request_ids_finished_finish_and_stop_reasons(model, tokenizer):
    llm = LLM(model, tokenizer=tokenizer)
    free = llm.generate(PROMPT, SamplingParams(max_tokens=10, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    stop_id = free.token_ids[4]
    first = free.token_ids.index(stop_id)
    stop_text = free.text[2:4]
    outs = llm.generate([PROMPT] * 3, [SamplingParams(max_tokens=10, ignore_eos=True),
                                       SamplingParams(max_tokens=10, ignore_eos=True, stop_token_ids=[stop_id]),
                                       SamplingParams(max_tokens=10, ignore_eos=True, stop=[stop_text])],
                        use_tqdm=False)
    assert [o.request_id for o in outs] == ["1", "2", "3"]  # "0" was the first call's
    assert all(o.finished and o.outputs[0].finished() for o in outs)
    length, by_id, by_text = (o.outputs[0] for o in outs)
    assert (length.finish_reason, length.stop_reason) == ("length", None)
    assert (by_id.finish_reason, by_id.stop_reason) == ("stop", stop_id)
    assert by_id.token_ids == free.token_ids[: first + 1]
    assert (by_text.finish_reason, by_text.stop_reason) == ("stop", stop_text)
    assert by_text.text == free.text[: free.text.index(stop_text)]


def test_chat_renders_each_conversation_through_the_template(llm, tokenizer):
    conversation = [{"role": "user", "content": "hello"}]
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    (out,) = llm.chat(conversation, params, use_tqdm=False)
    ids = tokenizer.encode_chat(conversation)
    assert out.prompt_token_ids == ids
    assert out.prompt == "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"
    assert out.outputs[0].token_ids == llm.generate(ids, params, use_tqdm=False)[0].outputs[0].token_ids
    two = llm.chat([conversation, conversation + [{"role": "assistant", "content": "hi"}]], params,
                   use_tqdm=False)
    assert len(two) == 2 and two[0].outputs[0].text == out.outputs[0].text
    (bare,) = llm.chat(conversation, params, use_tqdm=False, add_generation_prompt=False)
    assert bare.prompt == "<|im_start|>user\nhello<|im_end|>\n"
    template = "{{ greeting }}{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
    (custom,) = llm.chat(conversation, params, use_tqdm=False, chat_template=template,
                         chat_template_kwargs={"greeting": "hey"})
    assert custom.prompt == "hey[hello]"
    (cont,) = llm.chat(conversation + [{"role": "assistant", "content": "hel"}], params, use_tqdm=False,
                       add_generation_prompt=False, continue_final_message=True)
    assert cont.prompt.endswith("<|im_start|>assistant\nhel")
    assert llm.get_tokenizer() is tokenizer
    # chat_template_kwargs win over the keywords, as vLLM merges them
    (merged,) = llm.chat(conversation, params, use_tqdm=False, chat_template_kwargs={"add_generation_prompt": False})
    assert merged.prompt == bare.prompt
    # content parts: text joined with newlines (vLLM), anything else refused, never dropped
    parts = [{"role": "user", "content": [{"type": "text", "text": "hel"}, {"type": "text", "text": "lo"}]}]
    joined = "<|im_start|>user\nhel\nlo<|im_end|>\n<|im_start|>assistant\n"
    assert llm.chat(parts, params, use_tqdm=False)[0].prompt == joined
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    with pytest.raises(ValueError, match="only text parts"):
        llm.chat(image, params, use_tqdm=False)
    with pytest.raises(TypeError, match="conversation 0, message 0 is a str"):
        llm.chat(["hello"], params, use_tqdm=False)
    with pytest.raises(TypeError, match="messages must be a conversation"):
        llm.chat([], params, use_tqdm=False)


def test_llm_seed_makes_a_script_reproducible_across_instances(model, tokenizer):
    params = SamplingParams(max_tokens=8, temperature=1.0, ignore_eos=True)
    prompts = [PROMPT, "world", PROMPT]

    def script(**kw) -> list[str]:
        llm = LLM(model, tokenizer=tokenizer, **kw)
        return texts(llm.generate(prompts, params, use_tqdm=False)) + texts(llm.generate(prompts, params,
                                                                                       use_tqdm=False))

    first = script(seed=7)
    assert script(seed=7) == first
    assert len(set(first)) == len(first)  # each request draws its own seed
    assert script(seed=8) != first
    assert script() != script()  # unseeded: fresh randomness
    own = SamplingParams(max_tokens=8, temperature=1.0, ignore_eos=True, seed=5)
    a = LLM(model, tokenizer=tokenizer, seed=1).generate(PROMPT, own, use_tqdm=False)
    b = LLM(model, tokenizer=tokenizer, seed=2).generate(PROMPT, own, use_tqdm=False)
    assert texts(a) == texts(b)  # a request's own seed wins
    assert params.seed is None and own.seed == 5


def test_one_shared_sampling_params_is_not_mutated(model, tokenizer):
    params = SamplingParams(max_tokens=4, temperature=1e-9, top_k=-1, stop="\x00")
    before = repr(params)
    outs = LLM(model, tokenizer=tokenizer, seed=3).generate([PROMPT, "world"], params, use_tqdm=False)
    assert len(outs) == 2 and repr(params) == before


@pytest.mark.parametrize("name, ours", [("auto", "none"), ("fp8", "fp8"), ("fp8_e4m3", "fp8"), ("int8", "int8")])
def test_kv_cache_dtype_is_vllms_spelling_of_kv_quant(model, tokenizer, name, ours):
    llm = LLM(model, tokenizer=tokenizer, kv_cache_dtype=name, **SMALL_POOL)
    same = LLM(model, tokenizer=tokenizer, kv_quant=ours, **SMALL_POOL)
    assert llm.engine.options.kv_quant == ours
    # the pools are stored in that format: 8-bit blocks are a third of float32's or less
    assert llm.engine.cache_stats().block_bytes == same.engine.cache_stats().block_bytes
    unquantized = LLM(model, tokenizer=tokenizer, **SMALL_POOL).engine.cache_stats().block_bytes
    assert (3 * llm.engine.cache_stats().block_bytes <= unquantized) is (ours != "none")


def test_kv_cache_dtype_refusals(model, tokenizer):
    with pytest.raises(OptionError, match="kv_cache_dtype must be .*got 'fp8_e5m2'"):
        LLM(model, tokenizer=tokenizer, kv_cache_dtype="fp8_e5m2", **SMALL_POOL)
    with pytest.raises(OptionError, match="kv_quant= and kv_cache_dtype= .* give one"):
        LLM(model, tokenizer=tokenizer, kv_cache_dtype="fp8", kv_quant="fp8", **SMALL_POOL)
    with pytest.raises(UnsupportedOption, match="needs --paged-kv"):
        LLM(model, tokenizer=tokenizer, kv_cache_dtype="fp8")


def test_enable_prefix_caching_is_vllms_spelling_of_prefix_caching(model, tokenizer):
    for on in (True, False):
        llm = LLM(model, tokenizer=tokenizer, enable_prefix_caching=on, **SMALL_POOL)
        assert llm.engine.options.paged_kv.prefix_caching is on
        assert llm.engine.cache_stats().prefix_caching is on
    with pytest.raises(OptionError, match="give one"):
        LLM(model, tokenizer=tokenizer, enable_prefix_caching=True, prefix_caching=True, **SMALL_POOL)
    with pytest.raises(UnsupportedOption, match="needs --paged-kv"):
        LLM(model, tokenizer=tokenizer, enable_prefix_caching=True)


def test_stats_count_the_prompt_tokens_computed_and_the_seconds_to_the_last_first_token(model, tokenizer):
    """``LLM.stats`` after ``generate``: the prompt tokens the run computed
    (a cached prefix is not computed again) and the seconds until every
    sequence had its first token, within the call's own time."""
    llm = LLM(model, tokenizer=tokenizer, enable_prefix_caching=True, **SMALL_POOL)
    prompts = [[5 + i % 40 for i in range(70)], [7 + i % 30 for i in range(33)]]
    t0 = time.perf_counter()
    llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=6), use_tqdm=False)
    elapsed = time.perf_counter() - t0
    assert llm.stats.prompt_tokens == 70 + 33
    assert 0 < llm.stats.prefill_s < elapsed
    llm.generate([{"prompt_token_ids": prompts[0]}], SamplingParams(max_tokens=6), use_tqdm=False)
    block = llm.engine.options.paged_kv.block_size
    assert llm.stats.prompt_tokens == 70 - (70 - 1) // block * block  # the full blocks came from the cache


def test_engine_options_give_every_engine_option_at_once(model, tokenizer):
    options = EngineOptions(max_num_seqs=3, max_num_batched_tokens=40, kv_budget_bytes=1 << 22)
    llm = LLM(model, tokenizer=tokenizer, engine_options=options)
    assert llm.engine.options is options and llm.engine.max_num_seqs == 3
    assert texts(llm.generate([PROMPT] * 5, SamplingParams(max_tokens=3), use_tqdm=False))
    with pytest.raises(OptionError, match="engine_options= sets the engine's options; drop max_num_seqs"):
        LLM(model, tokenizer=tokenizer, engine_options=options, max_num_seqs=4)
    with pytest.raises(OptionError, match="drop kv_cache_dtype"):
        LLM(model, tokenizer=tokenizer, engine_options=options, kv_cache_dtype="auto")


def test_gpu_memory_utilization_is_refused_on_the_cpu_and_beside_another_budget(model, tokenizer):
    with pytest.raises(UnsupportedOption, match="--gpu-memory-utilization sizes the KV budget from CUDA memory"):
        LLM(model, tokenizer=tokenizer, gpu_memory_utilization=0.5)
    with pytest.raises(UnsupportedOption, match="--gpu-memory-utilization sizes the KV budget from CUDA memory"):
        LLM(model, tokenizer=tokenizer, engine_options=EngineOptions(gpu_memory_utilization=0.5))
    with pytest.raises(UnsupportedOption, match="PAGEDLM_GPU_MEMORY_UTILIZATION=0.5"):
        resolve_engine_options({}, environ={"PAGEDLM_GPU_MEMORY_UTILIZATION": "0.5"}, device="cpu")
    for other in ({"kv_budget_bytes": "1G"}, {"gpu_memory_fraction": "0.5"}):
        with pytest.raises(UnsupportedOption, match="each size the KV budget; give one"):
            resolve_engine_options({"gpu_memory_utilization": "0.9", **other}, environ={}, device="cuda")
    with pytest.raises(OptionError, match=r"--gpu-memory-utilization must be in \(0, 1\]"):
        resolve_engine_options({"gpu_memory_utilization": "1.5"}, environ={})
    assert resolve_engine_options({"gpu_memory_utilization": "0.8"}, environ={},
                                  device="cuda").gpu_memory_utilization == 0.8


def test_other_vllm_keywords_are_honoured_or_refused_by_name(model, tokenizer):
    assert LLM(model, tokenizer=tokenizer, tensor_parallel_size=1, served_model_name=["tiny", "alias"],
               max_model_len=64).engine.max_model_len == 64
    assert LLM(model, tokenizer=tokenizer, served_model_name=["tiny"]).served_model_name == "tiny"
    with pytest.raises(OptionError, match="--tensor-parallel-size must be a positive integer"):
        LLM(model, tokenizer=tokenizer, tensor_parallel_size=0)  # (2 and more: tests/fast/test_tensor_parallel.py)
    with pytest.raises(OptionError, match="quantization must be none, int8, int4 .*got 'awq'"):
        LLM("no-such-model", quantization="awq")  # refused before any loading
    with pytest.raises(OptionError, match="quantization='int8' applies when LLM loads the model by name"):
        LLM(model, tokenizer=tokenizer, quantization="int8")
    with pytest.raises(OptionError, match="dtype='bfloat16', but the model given is torch.float32"):
        LLM(model, tokenizer=tokenizer, dtype="bfloat16")
    LLM(model, tokenizer=tokenizer, dtype="float32", device="cpu")  # what it is: fine
    with pytest.raises(TypeError, match="tokenizer= takes a tokenizer object"):
        LLM(model, tokenizer="some/path")
    with pytest.raises(TypeError, match="trust_remote_code"):
        LLM(model, tokenizer=tokenizer, trust_remote_code=True)


class Recorder(tqdm):
    """A bar that keeps every postfix it is given (vLLM's use_tqdm may be a tqdm factory)."""

    def __init__(self, **kw):
        super().__init__(mininterval=0, disable=False, file=open("/dev/null", "w"), **kw)
        self.postfixes: list[str] = []
        Recorder.last = self

    def set_postfix_str(self, s="", refresh=True):
        self.postfixes.append(s)
        super().set_postfix_str(s, refresh)


def test_the_bar_shows_prompt_tokens_moving_during_a_long_prefill(model, tokenizer):
    llm = LLM(model, tokenizer=tokenizer, max_num_batched_tokens=32)
    ids = [(7 * i) % 250 + 3 for i in range(200)]
    (out,) = llm.generate(ids, SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=Recorder)
    bar = Recorder.last
    assert bar.n == 1 and len(out.outputs[0].token_ids) == 4
    prefill = [p for p in bar.postfixes if "output 0 toks" in p]
    inputs = [int(p.split("input ")[1].split(" toks")[0]) for p in prefill]
    assert len(prefill) >= 5 and inputs == sorted(inputs) and inputs[0] == 32 and 0 < inputs[-1] < 200
    assert bar.postfixes[-1].startswith("input 200 toks (") and "output 4 toks (" in bar.postfixes[-1]
    assert "toks/s" in bar.postfixes[-1]


def test_the_default_bar_prints_token_counts(model, tokenizer, capsys):
    LLM(model, tokenizer=tokenizer).generate(PROMPT, SamplingParams(max_tokens=3, ignore_eos=True))
    err = capsys.readouterr().err
    assert "1/1" in err and f"input {len(tokenizer.encode(PROMPT))} toks" in err and "output 3 toks" in err
