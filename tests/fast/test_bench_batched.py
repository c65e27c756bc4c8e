"""`pagedlm bench throughput` and `bench memory` end to end on a tiny random-weight model.

Rows and their sanity (live <= allocated, padded >= paged, ...), never timings.
`bench throughput --json-schema` needs a real tokenizer: a tiny model folder
with the tests' byte-level one.
"""

from __future__ import annotations

import json

import pytest
import torch

from pagedlm.cli import main

TINY = {
    "model_type": "qwen3", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 512,
    "max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
    "tie_word_embeddings": True, "attention_bias": False, "hidden_act": "silu",
}


@pytest.fixture
def tiny(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    return str(tmp_path)


def _rows(capsys) -> list[dict]:
    out = capsys.readouterr().out
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def test_throughput_json_rows(tiny, capsys):
    argv = ["bench", "throughput", "--model", tiny, "--random-weights", "--device", "cpu",
            "--num-prompts", "6", "--min-len", "4", "--max-len", "20", "--paged-kv",
            "--paged-kv-block-size", "16", "--kv-budget-bytes", "8M", "--json"]
    assert main(argv) == 0
    rows = _rows(capsys)
    assert [r["store"] for r in rows] == ["default", "paged"]
    for r in rows:
        for key in ("output_tok_s", "kv_bytes_allocated", "kv_bytes_live", "kv_live_fraction", "preemptions",
                    "model", "device", "dtype", "num_prompts", "min_len", "max_len", "store", "elapsed_s"):
            assert key in r, key
        assert r["num_prompts"] == 6 and r["device"] == "cpu" and r["dtype"] == "float32"
        assert r["output_tokens"] == r["requested_output_tokens"] > 0
        assert r["output_tok_s"] > 0
        assert 0 < r["kv_bytes_live"] <= r["kv_bytes_allocated"]
        assert 0 < r["kv_live_fraction"] <= 1
        assert r["preemptions"] == 0
    default, paged = rows
    assert paged["block_size"] == 16 and paged["ratio_vs_default"] > 0
    assert paged["kv_bytes_live"] == default["kv_bytes_live"]  # the same tokens, the same schedule
    assert paged["kv_bytes_allocated"] < default["kv_bytes_allocated"]  # 16-token blocks vs 256-token growth


def test_throughput_against_hf_same_weights(tiny, capsys):
    pytest.importorskip("transformers")
    argv = ["bench", "throughput", "--model", tiny, "--random-weights", "--device", "cpu",
            "--num-prompts", "3", "--min-len", "4", "--max-len", "8", "--kv-budget-bytes", "4M",
            "--against", "hf", "--json"]
    assert main(argv) == 0
    (row,) = _rows(capsys)
    assert row.get("hf_error") is None, row.get("hf_error")
    assert row["hf_output_tok_s"] > 0 and row["ratio_vs_hf"] > 0
    assert row["hf_num_prompts"] == 3


def test_unfuse_inverts_fuse():
    from pagedlm.bench.common import unfuse
    from pagedlm.models import build_model
    from pagedlm.models.layers import fuse_projections

    model = build_model(TINY)
    state = model.state_dict()
    hf = unfuse(state, TINY)
    assert "model.layers.0.self_attn.k_proj.weight" in hf and "model.layers.1.mlp.up_proj.weight" in hf
    assert hf["model.layers.0.self_attn.k_proj.weight"].shape == (2 * 16, 64)
    back = fuse_projections(hf)
    assert back.keys() == state.keys()
    assert all(torch.equal(back[k], state[k]) for k in state)


def test_memory_json_rows(tiny, capsys):
    argv = ["bench", "memory", "--model", tiny, "--random-weights", "--device", "cpu",
            "--long-len", "300", "--short-len", "20", "--num-long", "2", "--num-short", "12",
            "--max-tokens", "4", "--paged-kv", "--paged-kv-block-size", "16", "--json"]
    assert main(argv) == 0
    rows = {r["store"]: r for r in _rows(capsys)}
    assert rows.keys() == {"default", "paged", "padded"}
    budget = rows["paged"]["kv_budget_bytes"]
    for r in rows.values():
        assert r["kv_budget_bytes"] == budget
        assert 0 < r["kv_bytes_live"] <= r["kv_bytes_allocated"]
        assert r["bytes_per_live_token"] >= r["kv_bytes_per_token"]
        assert r["admitted"] >= 1
    paged, padded, default = rows["paged"], rows["padded"], rows["default"]
    assert padded["kv_bytes_allocated"] >= paged["kv_bytes_allocated"]
    assert padded["admitted"] == budget // padded["padded_row_bytes"]
    assert paged["admitted"] >= default["admitted"] >= padded["admitted"]
    assert paged["peak_kv_bytes_allocated"] <= budget


def test_memory_rows_with_kv_quant_admit_more_at_the_same_budget(tiny, capsys):
    """A budget that binds (short requests only, room for a few unquantized):
    int8 blocks hold 16 + 2 bytes per KV head and token against float32's 64,
    so the pool admits more than 1.9x the sequences, and what each live
    token costs counts the scales."""
    argv = ["bench", "memory", "--model", tiny, "--random-weights", "--device", "cpu",
            "--long-len", "60", "--short-len", "60", "--num-long", "1", "--num-short", "40",
            "--max-tokens", "4", "--paged-kv", "--paged-kv-block-size", "16", "--kv-quant", "int8",
            "--kv-budget-bytes", str(8 * 2 * 2 * 2 * 16 * 4 * 64), "--json"]  # 8 rows of 64 tokens, float32
    assert main(argv) == 0
    rows = {r["name"]: r for r in _rows(capsys)}
    assert rows.keys() == {"default", "paged", "paged-int8", "padded"}
    paged, quant = rows["paged"], rows["paged-int8"]
    assert quant["kv_quant"] == "int8" and paged["kv_quant"] == "none" and quant["store"] == "paged"
    assert quant["kv_bytes_per_token"] == 2 * 2 * 2 * (16 + 2)  # layers x (K, V) x KV heads x (codes + scale)
    assert paged["kv_bytes_per_token"] == 2 * 2 * 2 * 16 * 4
    assert quant["kv_bytes_per_token"] <= quant["bytes_per_live_token"] < paged["bytes_per_live_token"] / 3
    assert paged["admitted"] == 8  # 32 blocks; a request of 64 tokens takes 4
    assert quant["admitted"] >= 1.9 * paged["admitted"] and quant["admitted_vs_paged"] >= 1.9
    assert quant["peak_kv_bytes_allocated"] <= quant["kv_budget_bytes"]


def test_throughput_output_len_makes_a_prefill_heavy_run(tiny, capsys):
    """``--output-len 1``: the same prompts, one output token each; the rows
    count prompt tokens in ``total_tok_s``."""
    rows = _paged_throughput_rows(tiny, capsys, "--output-len", "1")
    (row,) = rows
    assert row["output_tokens"] == row["requested_output_tokens"] == 4 and row["output_len"] == 1
    assert row["total_tok_s"] / row["output_tok_s"] == pytest.approx((row["input_tokens"] + 4) / 4, rel=1e-3)
    # the prompts over the seconds to their last first token, which come before the run's end
    elapsed = row["output_tokens"] / row["output_tok_s"]  # elapsed_s is rounded to the millisecond
    assert row["prefill_tok_s"] >= row["input_tokens"] / elapsed * 0.999
    (free,) = _paged_throughput_rows(tiny, capsys)
    assert free["input_tokens"] == row["input_tokens"]  # the same prompts
    assert free["output_tokens"] > 4 and free["output_len"] is None


def _paged_throughput_rows(tiny, capsys, *flags) -> list[dict]:
    """`bench throughput` of 4 short prompts on the paged store only, plus ``flags``."""
    argv = ["bench", "throughput", "--model", tiny, "--random-weights", "--device", "cpu", "--num-prompts", "4",
            "--min-len", "4", "--max-len", "12", "--paged-kv", "--stores", "paged", "--kv-budget-bytes", "8M",
            "--json", *flags]
    assert main(argv) == 0
    return _rows(capsys)


def test_throughput_rows_with_kv_quant(tiny, capsys):
    rows = _paged_throughput_rows(tiny, capsys, "--kv-quant", "fp8")
    assert [(r["name"], r["kv_quant"]) for r in rows] == [("pagedlm-paged", "none"), ("pagedlm-paged-fp8", "fp8")]
    quant = rows[1]
    assert quant["output_tokens"] == quant["requested_output_tokens"] and quant["ratio_vs_paged"] > 0
    assert quant["kv_bytes_allocated"] < rows[0]["kv_bytes_allocated"] / 3
    assert quant["kv_capacity_bytes"] <= 8 * 2**20


@pytest.mark.parametrize("flag, value, last", [
    ("--kv-quant", "int8", ("pagedlm-paged-int8", True, "int8", "none")),
    ("--quantization", "int4", ("pagedlm-int4", True, "none", "int4")),  # quantized weights: the paged store too
])
def test_decode_rows_with_a_quantized_mode(tiny, capsys, flag, value, last):
    argv = ["bench", "decode", "--model", tiny, "--random-weights", "--device", "cpu", "--prompt-len", "40",
            "--gen-len", "3", "--repeats", "1", "--paged-kv", flag, value, "--kv-budget-bytes", "8M", "--json"]
    assert main(argv) == 0
    rows = _rows(capsys)
    assert [(r["name"], r["paged_kv"], r["kv_quant"], r["quantization"]) for r in rows] == [
        ("pagedlm-default", False, "none", "none"), ("pagedlm-paged", True, "none", "none"), last]
    assert rows[2]["decode_ratio_vs_default"] > 0 and rows[2]["block_size"] == 16
    # repeats send one prompt: with prefix caching "prefill" would time a hit
    assert [r["prefix_caching"] for r in rows] == [None, False, False]


@pytest.mark.parametrize("argv, message", [
    (["bench", "throughput", "--min-len", "9", "--max-len", "3"], "--min-len"),
    (["bench", "throughput", "--num-prompts", "0"], "--num-prompts"),
    (["bench", "throughput", "--hf-num-prompts", "4"], "--against hf"),
    (["bench", "memory", "--short-len", "900", "--long-len", "100"], "--short-len"),
    (["bench", "memory", "--num-long", "-1"], "--num-long"),
    (["bench", "memory", "--kv-quant", "int8"], "needs --paged-kv"),
    (["bench", "ppl", "--kv-quant", "int4"], "--kv-quant must be none, int8, fp8"),
    (["bench", "memory", "--no-paged-kv"], "bench memory runs the default and the paged store"),
    (["bench", "prefix", "--no-paged-kv"], "--no-paged-kv does not apply"),
    (["bench", "prefix", "--no-prefix-caching"], "--no-prefix-caching does not apply"),
    (["bench", "decode", "--paged-kv", "--prefix-caching"], "--prefix-caching does not apply"),
])
def test_bad_input_is_one_line_exit_2(argv, message, capsys):
    assert main(argv + ["--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and message in err


def test_a_ppl_window_past_the_models_context_is_refused(monkeypatch, model, tokenizer, capsys):
    """(It scored positions the model never saw in training, silently.) The tiny model: 8192, the default."""
    monkeypatch.setattr("pagedlm.bench.ppl.load", lambda *args, **kwargs: (model, tokenizer))
    assert main(["bench", "ppl", "--device", "cpu", "--window", "8193", "--tokens", "9000"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "--window 8193 exceeds the model's context (8192 tokens)" in err


def test_prefix_json_rows(tiny, capsys):
    """Sharing holds the prefix once and computes it once; the chat computes
    only each new turn (whole blocks) with caching, everything without."""
    argv = ["bench", "prefix", "--model", tiny, "--random-weights", "--device", "cpu", "--num-requests", "4",
            "--prefix-len", "64", "--question-len", "5", "--max-tokens", "3", "--repeats", "1", "--turns", "3",
            "--chat-system-len", "20", "--reply-len", "4", "--json"]
    assert main(argv) == 0
    rows = _rows(capsys)
    assert [r["name"] for r in rows] == ["shared", "shared", "single"] + ["chat"] * 6
    on, off = rows[0], rows[1]
    assert (on["prefix_caching"], off["prefix_caching"]) == (True, False)
    assert on["prompt_tokens_computed"] == 64 + 4 * 5 and off["prompt_tokens_computed"] == 4 * 69
    assert on["kv_pool_bytes_peak"] < on["kv_pool_bytes_unshared_peak"]
    per_token = on["one_copy_pool_bytes"] / (64 + 4 * (5 + 3))
    # one copy, plus at most one partly filled block for the prefix and for each request
    assert on["one_copy_pool_bytes"] <= on["kv_pool_bytes_peak"] <= on["one_copy_pool_bytes"] + 5 * 16 * per_token
    assert off["kv_pool_bytes_peak"] == off["kv_pool_bytes_unshared_peak"] and off["preemptions"] == 0
    assert on["ttft_mean_s"] > 0 and on["total_s"] > 0 and rows[2]["ttft_hit_s"] > 0
    chat_on = [r["prefill_tokens_computed"] for r in rows[3:6]]
    chat_off = [r["prefill_tokens_computed"] for r in rows[6:9]]
    assert chat_off == [r["prompt_tokens"] for r in rows[6:9]] == [25, 34, 43]
    assert chat_on[0] == 25 and all(n < 5 + 4 + 16 for n in chat_on[1:])


@pytest.mark.parametrize("tied", [True, False])
def test_decode_step_bytes_are_what_the_products_read(tiny, tied, tmp_path):
    """Weights a batch-1 step reads: every float weight, except an untied
    embedding (a lookup reads a row); quantized, the kernels' buffers only
    (not a tied embedding's row copy)."""
    from pagedlm.bench.common import load_random
    from pagedlm.bench.decode import bytes_per_decode_step
    from pagedlm.loading.quant import quantize_model, quantizable
    from pagedlm.models.layers import Embedding

    (tmp_path / "config.json").write_text(json.dumps({**TINY, "tie_word_embeddings": tied}))
    model = load_random(str(tmp_path), "cpu", torch.float32)[0]
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    table = 512 * 64 * 4
    assert bytes_per_decode_step(model, 0) == params - (0 if tied else table)
    quantize_model(model, "int4")
    kernels = sum(b.numel() * b.element_size() for m in quantizable(model).values()
                  if tied or not isinstance(m, Embedding) for b in m.quant.linear_buffers())
    floats = sum(p.numel() * p.element_size() for p in model.parameters())  # norms
    assert bytes_per_decode_step(model, 0) == kernels + floats


def test_throughput_quantized_row_beside_its_float_store(tiny, capsys):
    rows = _paged_throughput_rows(tiny, capsys, "--quantization", "int8")
    assert [(r["name"], r["store"], r["quantization"]) for r in rows] == [
        ("pagedlm-paged", "paged", "none"), ("pagedlm-int8", "paged", "int8")]
    assert rows[1]["output_tokens"] == rows[1]["requested_output_tokens"] and rows[1]["ratio_vs_unquantized"] > 0
    assert "ratio_vs_unquantized" not in rows[0]


def test_a_default_store_row_drops_the_paged_backend():
    """`--attention-backend triton` is refused without paging: a bench's
    default-store row must not carry it (nor 8-bit KV) over."""
    from pagedlm.bench.common import default_store
    from pagedlm.options import EngineOptions, PagedKvOptions

    options = EngineOptions(paged_kv=PagedKvOptions(16), attention_backend="triton", kv_quant="int8", max_num_seqs=3)
    assert default_store(options) == EngineOptions(max_num_seqs=3)


@pytest.mark.parametrize("bench", ["throughput", "memory"])
def test_the_throughput_and_memory_benches_run_exactly_the_options_given(tiny, capsys, monkeypatch, bench):
    """`bench throughput/memory --attention-backend torch --enforce-eager` used
    to rebuild the engine from a few keywords and run `auto` (the kernels on
    CUDA): every engine a bench builds holds the options it was given, and
    its rows name the backend that ran."""
    from pagedlm.batch.engine import LLMEngine

    built = []
    init = LLMEngine.__init__

    def recording(self, model, tokenizer, options=None):
        init(self, model, tokenizer, options)
        built.append(options)

    monkeypatch.setattr(LLMEngine, "__init__", recording)
    sizes = {"throughput": ["--num-prompts", "3", "--min-len", "4", "--max-len", "8"],
             "memory": ["--long-len", "40", "--short-len", "8", "--num-long", "1", "--num-short", "3",
                        "--max-tokens", "2"]}[bench]
    argv = ["bench", bench, "--model", tiny, "--random-weights", "--device", "cpu", *sizes, "--paged-kv",
            "--paged-kv-block-size", "16", "--no-prefix-caching", "--attention-backend", "torch",
            "--enforce-eager", "--long-prefill-token-threshold", "8", "--kv-budget-bytes", "4M", "--json"]
    assert main(argv) == 0
    rows = [r for r in _rows(capsys) if r["store"] == "paged"]
    assert rows and all(r["attention_backend"] == "torch" for r in rows)
    paged = [o for o in built if o.paged_kv is not None]
    assert paged and all(o.attention_backend == "torch" and o.enforce_eager and o.long_prefill_token_threshold == 8
                         and o.paged_kv.prefix_caching is False for o in paged)


def test_contention_rows_on_both_stores(tiny, capsys):
    """Short requests behind a long prompt start within the scheduler's bound;
    the long prompt alone is computed, not answered from the prefix cache
    (a first version timed the same ids again: one step, whatever its length)."""
    for store in ("--no-paged-kv", "--paged-kv"):
        argv = ["bench", "contention", "--model", tiny, "--random-weights", "--device", "cpu", store,
                "--max-num-batched-tokens", "64", "--long-len", "200", "--num-short", "6", "--short-len", "4",
                "--short-min-tokens", "2", "--short-max-tokens", "3", "--long-alone", "--json"]
        assert main(argv) == 0
        (row,) = _rows(capsys)
        assert row["paged_kv"] is (store == "--paged-kv")
        assert row["long_prefill_token_threshold"] == 16  # a quarter of the budget
        # 6 x 4 tokens fit beside the capped chunk: every short request's first token in one step
        assert row["idle"]["ttft_steps_max"] == row["contended"]["ttft_steps_max"] == 1
        assert row["long_alone_ttft_steps"] == -(-200 // 64)
        assert row["long_ttft_steps"] >= row["long_alone_ttft_steps"]


# A schema whose every output is short: with at most 22 characters of
# whitespace between tokens (constraint.JSON_WHITESPACE), under 256 bytes.
FLAG_SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"},
                                               "n": {"type": "integer", "minimum": 0, "maximum": 9}},
               "required": ["ok", "n"], "additionalProperties": False}


@pytest.fixture
def tiny_folder(tmp_path):
    """A loadable folder: a plain tiny llama over the byte-level tokenizer's vocabulary."""
    from safetensors.torch import save_file

    from tests.helpers import PLAIN, byte_level, tiny_model

    tk = byte_level()
    config = {**PLAIN["llama"], "vocab_size": tk.get_vocab_size()}
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    model = tiny_model("llama", vocab_size=config["vocab_size"], plain=True)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, folder / "model.safetensors")
    tk.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    (tmp_path / "flag.schema.json").write_text(json.dumps(FLAG_SCHEMA))
    return folder


def test_structured_rows_say_how_many_kernels_compiled_in_their_runs(tiny_folder, capsys, monkeypatch):
    """``kernel_compiles_in_runs``: per timed run of the row, the kernels
    compiled in its decode steps (a compile there is ~1 s of a run's time).
    The counter is faked: timed run ``k`` of the bench "compiles" ``k`` kernels; the warm-ups
    are not counted (nor said on stderr as compiles in a timed run)."""
    import contextlib

    from pagedlm.bench import structured

    calls = []

    @contextlib.contextmanager
    def counting():
        calls.append(None)
        yield ["kernel"] * (len(calls) - 1)

    monkeypatch.setattr(structured, "kernel_compiles", counting)
    argv = ["bench", "throughput", "--model", str(tiny_folder), "--device", "cpu", "--json-schema",
            str(tiny_folder.parent / "flag.schema.json"), "--structured-batch-sizes", "1", "--repeats", "2", "--json"]
    assert main(argv) == 0
    free, constrained = _rows(capsys)
    assert len(calls) == 4  # constrained and unconstrained runs in turn (the two warm-ups: none)
    assert constrained["kernel_compiles_in_runs"] == [0, 2] and free["kernel_compiles_in_runs"] == [1, 3]


def _recorded_runs(monkeypatch) -> list:
    """The structured bench's batches from now on, as (requests, BatchRun) pairs."""
    from pagedlm.bench import structured

    runs = []
    run_batch = structured.run_batch

    def recording(engine, requests, timed=True):
        runs.append((requests, run_batch(engine, requests, timed)))
        return runs[-1][1]

    monkeypatch.setattr(structured, "run_batch", recording)
    return runs


def test_throughput_json_schema_rows_unconstrained_against_constrained(tiny_folder, capsys, monkeypatch):
    """Per batch size an unconstrained and a constrained row, the grammar
    compiled once; every constrained row ends by its grammar with JSON valid
    against the schema, and its unconstrained twin runs as many tokens and
    steps."""
    jsonschema = pytest.importorskip("jsonschema")
    runs = _recorded_runs(monkeypatch)
    schema = str(tiny_folder.parent / "flag.schema.json")
    argv = ["bench", "throughput", "--model", str(tiny_folder), "--device", "cpu", "--json-schema", schema,
            "--structured-batch-sizes", "1", "3", "--structured-max-tokens", "256", "--repeats", "2", "--json"]
    assert main(argv) == 0
    rows = _rows(capsys)
    assert [(r["structured"], r["batch"]) for r in rows] == [(False, 1), (True, 1), (False, 3), (True, 3)]
    for r in rows:
        assert r["ms_per_step"] > 0 and r["steps"] >= 1 and 0 < r["mean_batch"] <= r["batch"]
        assert 0 < r["sample_ms_per_step"] < r["ms_per_step"] and 0 < r["sample_share"] < 1
        assert (r["mask_fill_ms_per_step"] > 0) == r["structured"]  # only constrained steps fill masks
        assert r["mask_fill_ms_per_step"] < r["sample_ms_per_step"]  # the fill is part of `sample`
        assert r["schema"] == schema and r["max_tokens"] == 256 and r["preemptions"] == 0
        assert len(r["all_ms_per_step"]) == 2
        assert r["prefill_steps"] == 1  # the token budget holds the 3 prompts (over 512 tokens) at once
    for free, constrained in (rows[0:2], rows[2:4]):
        assert "mask_overhead" not in free
        pairs = [c / u - 1 for c, u in zip(constrained["all_ms_per_step"], free["all_ms_per_step"])]
        assert constrained["all_mask_overhead"] == pytest.approx(pairs, abs=2e-3)
        assert constrained["mask_overhead"] == pytest.approx(sum(pairs) / 2, abs=2e-3)  # the median of two
        assert constrained["sample_overhead_share"] == pytest.approx(
            constrained["sample_overhead_ms"] / free["ms_per_step"], abs=2e-3)
        assert constrained["output_tokens"] < 256 * constrained["batch"]  # the grammar ends each row early
        assert (free["output_tokens"], free["steps"], free["mean_batch"]) == (
            constrained["output_tokens"], constrained["steps"], constrained["mean_batch"])
        assert constrained["grammar_finished"] == constrained["json_parsed"] == constrained["batch"]
        assert constrained["grammar_errors"] == 0 and constrained["grammar_compiles"] == 1
    warm, timed = runs[:2], runs[2:]
    assert [[p.max_tokens for _, p in q] for q, _ in warm] == [[4, 4, 4], [4, 4, 4]]  # the largest batch
    assert [(len(q), q[0][1].structured_outputs is not None) for q, _ in timed] == [
        (1, True), (1, False)] * 2 + [(3, True), (3, False)] * 2
    for (_, constrained), (twins, free) in zip(timed[0::2], timed[1::2]):
        assert constrained.finish_reasons == ["stop"] * len(constrained.texts)
        for text in constrained.texts:
            jsonschema.validate(json.loads(text), FLAG_SCHEMA)
        assert [p.max_tokens for _, p in twins] == constrained.output_lengths == free.output_lengths
        assert constrained.decode_steps == free.decode_steps == max(free.output_lengths) - 1


def test_json_schema_on_random_weights_reads_the_folders_tokenizer(tiny_folder, capsys):
    """``--random-weights`` over a folder with a tokenizer.json: grammars
    compile over its vocabulary and every constrained row ends valid; a
    tokenizer with more tokens than the config's vocab_size is refused."""
    schema = str(tiny_folder.parent / "flag.schema.json")
    argv = ["bench", "throughput", "--model", str(tiny_folder), "--random-weights", "--device", "cpu",
            "--json-schema", schema, "--structured-batch-sizes", "2", "--structured-max-tokens", "256",
            "--repeats", "1", "--json"]
    assert main(argv) == 0
    rows = _rows(capsys)
    assert [r["structured"] for r in rows] == [False, True]
    assert rows[1]["grammar_finished"] == rows[1]["json_parsed"] == 2
    config = json.loads((tiny_folder / "config.json").read_text())
    (tiny_folder / "config.json").write_text(json.dumps({**config, "vocab_size": 100}))
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "tokens, more than the config's vocab_size (100)" in err, err


@pytest.mark.parametrize("write, extra, message", [
    (None, [], "cannot read it (No such file or directory)"),
    ("{not json", [], "is not JSON (Expecting property name"),
    ('{"type": "objectx"}', [], "json is not a JSON schema pagedlm can follow: "),
    (json.dumps(FLAG_SCHEMA), ["--random-weights"], "with --random-weights, a tokenizer.json in the config's folder"),
    (json.dumps(FLAG_SCHEMA), ["--against", "hf"], "not with --against"),
    (json.dumps(FLAG_SCHEMA), ["--structured-batch-sizes", "0"], "--structured-batch-sizes must be >= 1"),
    (json.dumps(FLAG_SCHEMA), ["--structured-temperature", "-0.5"],
     "--structured-temperature must be a finite number >= 0 (got -0.5)"),
    (json.dumps(FLAG_SCHEMA), ["--structured-temperature", "nan"],
     "--structured-temperature must be a finite number >= 0 (got nan)"),
])
def test_bad_json_schema_file_is_one_line_exit_2(tmp_path, capsys, write, extra, message):
    path = tmp_path / "s.json"
    if write is not None:
        path.write_text(write)
    argv = ["bench", "throughput", "--device", "cpu", "--json-schema", str(path), *extra]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and message in err, err
    if write is None or extra == []:
        assert err.startswith(f"pagedlm bench throughput: --json-schema {path}")


@pytest.mark.parametrize("flag", [["--structured-batch-sizes", "4"], ["--structured-temperature", "1"]])
def test_structured_flags_need_a_json_schema(capsys, flag):
    assert main(["bench", "throughput", "--device", "cpu", *flag]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "need --json-schema" in err


def test_structured_temperature_samples_both_twins(tiny_folder, capsys, monkeypatch):
    """--structured-temperature: the constrained rows and their unconstrained
    twins (and the warm-ups) sample at it, unseeded, and the rows say so;
    the constrained outputs still end valid."""
    jsonschema = pytest.importorskip("jsonschema")
    runs = _recorded_runs(monkeypatch)
    argv = ["bench", "throughput", "--model", str(tiny_folder), "--device", "cpu", "--json-schema",
            str(tiny_folder.parent / "flag.schema.json"), "--structured-batch-sizes", "3",
            "--structured-max-tokens", "256", "--structured-temperature", "0.8", "--repeats", "1", "--json"]
    assert main(argv) == 0
    rows = _rows(capsys)
    assert [(r["structured"], r["temperature"]) for r in rows] == [(False, 0.8), (True, 0.8)]
    assert len(runs) == 4  # two warm-ups, then the constrained rows and their twins
    for requests, _ in runs:
        assert all(p.temperature == 0.8 and p.seed is None for _, p in requests)
    (_, constrained), (twins, free) = runs[2:]
    assert [p.structured_outputs is None for _, p in twins] == [True] * 3
    assert [p.max_tokens for _, p in twins] == constrained.output_lengths == free.output_lengths
    assert constrained.finish_reasons == ["stop"] * 3
    for text in constrained.texts:
        jsonschema.validate(json.loads(text), FLAG_SCHEMA)


def test_engines_alive_at_once_on_cuda_share_one_kv_budget(monkeypatch):
    """bench decode keeps every row's engine through the rounds: on CUDA each
    gets an equal share of the fraction of free memory, computed before any
    pool exists; a budget the user gave stands, and the CPU is left alone."""
    from pagedlm import options as opt
    from pagedlm.bench.common import shared_budget

    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (100 << 30, 141 << 30))
    base = opt.EngineOptions()
    assert shared_budget(base, "cuda", 4).kv_budget_bytes == int((100 << 30) * 0.9) // 4
    half = opt.EngineOptions(gpu_memory_fraction=0.5)
    shared = shared_budget(half, "cuda", 2)
    assert shared.kv_budget_bytes == (100 << 30) // 4 and shared.gpu_memory_fraction is None
    given = opt.EngineOptions(kv_budget_bytes=1 << 30)
    assert shared_budget(given, "cuda", 4) == given
    assert shared_budget(base, "cpu", 4) == base


def test_bench_errors_name_the_benchs_own_flags(tiny, capsys):
    """(They named the warm-up's prompt, a --max-model-len never given, and refused the memory
    bench's own default budget below one 256-token allocation a row.)"""
    common = ["--model", tiny, "--random-weights", "--device", "cpu"]
    assert main(["bench", "decode", *common, "--prompt-len", "64", "--gen-len", "8", "--max-model-len", "16"]) == 2
    assert capsys.readouterr().err.strip().endswith("--prompt-len 64 plus --gen-len 8 exceeds max_model_len (16)")
    context = TINY["max_position_embeddings"]
    assert main(["bench", "memory", *common, "--long-len", str(context), "--short-len", "4", "--max-tokens", "2"]) == 2
    assert capsys.readouterr().err.strip().endswith(f"--long-len {context} plus --max-tokens 2 exceeds the model's "
                                                    f"context ({context} tokens)")
    assert main(["bench", "memory", *common, "--long-len", "40", "--short-len", "10", "--num-short", "4",
                 "--max-tokens", "8", "--json"]) == 0
