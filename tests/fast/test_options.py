import pytest
import torch

from pagedlm import options as opt
from pagedlm.cli import main


def test_paged_kv_defaults_on_for_cuda_only_and_either_switch_overrides():
    assert opt.resolve_paged_kv(None, None, environ={}) is None
    assert opt.resolve_paged_kv(None, None, environ={}, device="cpu") is None
    assert opt.resolve_paged_kv(None, None, environ={}, device="cuda") == opt.PagedKvOptions()
    assert opt.resolve_paged_kv(None, "64", environ={}, device="cuda") == opt.PagedKvOptions(64)
    assert opt.resolve_paged_kv(False, None, environ={}, device="cuda") is None
    assert opt.resolve_paged_kv(None, None, {"PAGEDLM_PAGED_KV": "0"}, device="cuda") is None
    with pytest.raises(opt.UnsupportedOption, match="default on CUDA only"):
        opt.resolve_paged_kv(None, "64", environ={}, device="cpu")
    cuda = opt.resolve_engine_options({"kv_quant": "fp8"}, environ={}, device="cuda")
    assert cuda.paged_kv == opt.PagedKvOptions() and cuda.kv_quant == "fp8"
    with pytest.raises(opt.UnsupportedOption, match="--kv-quant"):
        opt.resolve_engine_options({"kv_quant": "fp8"}, environ={}, device="cpu")


def test_env_turns_paged_kv_on_and_flag_overrides_env():
    assert opt.resolve_paged_kv(None, None, {"PAGEDLM_PAGED_KV": "1"}) == opt.PagedKvOptions(opt.DEFAULT_BLOCK_SIZE)
    assert opt.resolve_paged_kv(False, None, {"PAGEDLM_PAGED_KV": "1"}) is None
    assert opt.resolve_paged_kv(True, "16", {"PAGEDLM_PAGED_KV": "0"}) == opt.PagedKvOptions(16)
    assert opt.resolve_paged_kv(None, None, {"PAGEDLM_PAGED_KV": "0"}) is None


@pytest.mark.parametrize("bad", ["0", "-4", "abc", "1.5", ""])
def test_bad_block_size_is_an_option_error(bad):
    with pytest.raises(opt.OptionError, match="--paged-kv-block-size must be a positive integer"):
        opt.resolve_paged_kv(True, bad, {})


@pytest.mark.parametrize("bad", ["4", "24", "1000", "2048", "65536", "1000000"])
def test_block_size_must_be_a_power_of_two_from_8_to_1024(bad):
    with pytest.raises(opt.OptionError, match="power of two from 8 to 1024"):
        opt.resolve_paged_kv(True, bad, {})


@pytest.mark.parametrize("good", [8, 16, 256, 1024])
def test_block_sizes_in_bounds_are_accepted(good):
    assert opt.resolve_paged_kv(True, str(good), {}) == opt.PagedKvOptions(good)


def test_bad_env_value_is_an_option_error():
    with pytest.raises(opt.OptionError, match="PAGEDLM_PAGED_KV must be one of 1, 0, true, false, on, off, yes, no"):
        opt.resolve_paged_kv(None, None, {"PAGEDLM_PAGED_KV": "maybe"})


def test_block_size_without_paging_is_refused():
    with pytest.raises(opt.UnsupportedOption, match="needs --paged-kv"):
        opt.resolve_paged_kv(None, "16", {})


def test_server_options_flag_beats_env_beats_default():
    env = {"PAGEDLM_PORT": "9001", "PAGEDLM_MAX_QUEUE": "3"}
    resolved = opt.ServerOptions.resolve({"port": "9002"}, env)
    assert resolved.port == 9002 and resolved.max_queue == 3 and resolved.host == "127.0.0.1"
    with pytest.raises(opt.OptionError, match="--port"):
        opt.ServerOptions.resolve({"port": "70000"}, {})


def test_server_device_dtype_key_and_quantization_values_are_checked_where_they_came_from():
    for env, message in [({"PAGEDLM_DEVICE": "gpu"}, "^PAGEDLM_DEVICE must be auto, cpu or cuda"),
                         ({"PAGEDLM_DTYPE": "int8"}, "^PAGEDLM_DTYPE must be auto"),
                         ({"PAGEDLM_API_KEY": " "}, "^PAGEDLM_API_KEY must not begin or end with whitespace")]:
        with pytest.raises(opt.OptionError, match=message):
            opt.ServerOptions.resolve({}, env)
    with pytest.raises(opt.OptionError, match="^--api-key must not begin or end with whitespace"):
        opt.ServerOptions.resolve({"api_key": "abc "}, {})
    resolved = opt.ServerOptions.resolve({"dtype": "half"}, {"PAGEDLM_QUANTIZATION": "INT8", "PAGEDLM_API_KEY": "k"})
    assert resolved.dtype == "half" and resolved.quantization == "int8" and resolved.api_key == "k"


def test_pools_the_memory_cannot_hold_are_a_one_line_refusal(monkeypatch):
    """A budget beyond the device's memory: the allocator's error becomes an OptionError (one line, exit 2)."""
    from pagedlm.cache import layout as layout_module
    from pagedlm.cache.spec import KVSpec

    def refuse(*args, **kwargs):
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 274877906944 bytes")

    plan = layout_module.plan_layout([KVSpec(2, 8)], opt.EngineOptions(paged_kv=opt.PagedKvOptions(16),
                                                                         kv_budget_bytes=1 << 20), "cpu",
                                     torch.float32, in_place=False, identity="tiny", max_model_len=64)
    monkeypatch.setattr(layout_module, "PagedPools", refuse)
    with pytest.raises(opt.OptionError, match=r"the KV budget \(1048576 bytes\) does not fit in the cpu memory left"):
        layout_module.make_pools(plan, torch.float32, "cpu")


def case(argv, message, env=None, stdin=None):
    """One bad command line: argv, a piece of the one-line error, the
    environment it runs in, the bytes on its standard input."""
    env = env or {}
    return pytest.param(argv, message, env, stdin, id=" ".join([*(f"{k}={v}" for k, v in env.items()), *argv])[:70])


NO_MODEL = ["--model", "/no/such/model"]  # a check made after loading would report the model instead


@pytest.mark.parametrize(
    "argv,message,env,stdin",
    [
        case(["generate", "--paged-kv", "--paged-kv-block-size", "0", "hi"], "positive integer"),
        case(["generate", "--paged-kv-block-size", "16", "hi"], "needs --paged-kv"),
        # the CLI cannot score a prompt: its message does not offer max_tokens 0
        case(["generate", "--max-tokens", "0", "hi"], "pagedlm generate: --max-tokens must be >= 1 (got 0)\n"),
        case(["chat", "--max-tokens", "-3"], "pagedlm chat: --max-tokens must be >= 1 (got -3)\n"),
        case(["generate", "--temp", "inf", "hi"], "temperature must be a finite number"),
        case(["generate", "--top-p", "nan", "hi"], "top_p must be a finite number"),
        case(["generate", "--paged-kv", "--paged-kv-block-size", "65536", "hi"], "power of two"),
        case(["generate", "--temp", "abc", "hi"], "invalid float value"),
        case(["generate", "--model", "/no/such/model", "hi"], "/no/such/model"),
        case(["frobnicate"], "invalid choice"),
        case(["generate", "--attention-backend", "triton", "hi"], "add --paged-kv"),
        case(["generate", "--attention-backend", "flash", "--paged-kv", "hi"], "--attention-backend must be"),
        # torch.Generator.manual_seed's range, checked before the model loads (greedy or not)
        case(["generate", *NO_MODEL, "--seed", "999999999999999999999999", "hi"],
             "--seed must be an integer from -2**63 to 2**64 - 1 (got 999999999999999999999999)"),
        case(["generate", *NO_MODEL, "--temp", "0.7", "--seed", str(2**64), "hi"], "--seed must be an integer"),
        case(["generate", *NO_MODEL, "-"], "standard input is not UTF-8 text (byte 0xe9 at offset 3)",
             stdin=b"caf\xe9 au lait"),
        case(["generate", *NO_MODEL, "caf\udce9"], "the prompt is not UTF-8 text"),  # argv bytes that are not UTF-8
        case(["generate", *NO_MODEL, "--system", "be brief", "hi"], "--system is a chat message: it needs --chat"),
        case(["generate", *NO_MODEL, "--max-model-len", "0", "hi"], "--max-model-len must be a positive integer"),
        case(["bench", "decode", *NO_MODEL, "--repeats", "0"], "pagedlm bench decode: --repeats must be >= 1 (got 0)"),
        case(["bench", "decode", *NO_MODEL, "--prompt-len", "64", "0"], "--prompt-len must be >= 1 (got 0)"),
        case(["bench", "decode", *NO_MODEL, "--gen-len", "1"], "--gen-len must be >= 2 (got 1)"),
        case(["bench", "throughput", *NO_MODEL, "--num-prompts", "0"], "--num-prompts must be >= 1 (got 0)"),
        case(["bench", "memory", *NO_MODEL, "--num-long", "-1"], "--num-long must be >= 1 (got -1)"),
        case(["bench", "prefix", *NO_MODEL, "--turns", "0"], "--turns must be >= 1 (got 0)"),
        case(["bench", "ppl", *NO_MODEL, "--tokens", "0"], "--tokens must be >= 1 (got 0)"),
        # environment values are named by their variable, and say what they may be
        case(["generate", *NO_MODEL, "hi"],
             "PAGEDLM_PREFIX_CACHING must be one of 1, 0, true, false, on, off, yes, no (got 'maybe')",
             env={"PAGEDLM_PREFIX_CACHING": "maybe"}),
        case(["generate", *NO_MODEL, "hi"], "PAGEDLM_PREFIX_CACHING=yes: --prefix-caching shares paged KV blocks",
             env={"PAGEDLM_PREFIX_CACHING": "yes"}),
        case(["generate", *NO_MODEL, "hi"], "error: PAGEDLM_MAX_NUM_SEQS must be a positive integer (got 'lots')",
             env={"PAGEDLM_MAX_NUM_SEQS": "lots"}),
        case(["serve", *NO_MODEL], "error: PAGEDLM_MAX_NUM_SEQS must be a positive integer (got 'lots')",
             env={"PAGEDLM_MAX_NUM_SEQS": "lots"}),
        case(["generate", *NO_MODEL, "hi"], "PAGEDLM_KV_QUANT=int8: --kv-quant quantizes",
             env={"PAGEDLM_KV_QUANT": "int8"}),
    ],
)
def test_cli_errors_are_one_line_and_exit_2(argv, message, env, stdin, capsys, monkeypatch):
    import io

    for name, value in env.items():
        monkeypatch.setenv(name, value)
    if stdin is not None:
        monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(stdin), encoding="utf-8"))
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_serve_checks_its_address_before_loading_the_model(capsys):
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        # The model does not exist: if it were loaded first, that would be the error.
        assert main(["serve", "--model", "/no/such/model", "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert f"cannot listen on 127.0.0.1:{port}" in err and err.count("\n") == 1
    assert main(["serve", "--model", "/no/such/model", "--host", "no.such.host.invalid"]) == 2
    assert "cannot listen on no.such.host.invalid" in capsys.readouterr().err


def test_triton_attention_off_cuda_is_refused_unless_interpreted(monkeypatch):
    flags = {"paged_kv": True, "attention_backend": "triton"}
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(opt.UnsupportedOption, match="needs CUDA"):
        opt.resolve_engine_options(flags, environ={}, device="cpu")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert opt.resolve_engine_options(flags, environ={}, device="cpu").attention_backend == "triton"


def test_enforce_eager_is_a_switch_with_an_env_variable():
    assert opt.resolve_engine_options({}, environ={}).enforce_eager is False
    assert opt.resolve_engine_options({}, environ={"PAGEDLM_ENFORCE_EAGER": "1"}).enforce_eager is True
    assert opt.resolve_engine_options({"enforce_eager": False},
                                      environ={"PAGEDLM_ENFORCE_EAGER": "1"}).enforce_eager is False
    with pytest.raises(opt.OptionError, match="PAGEDLM_ENFORCE_EAGER must be one of 1, 0, "):
        opt.resolve_engine_options({}, environ={"PAGEDLM_ENFORCE_EAGER": "maybe"})


def test_cors_details_without_origins_are_refused_naming_where_they_came_from():
    from pagedlm.options import ServerOptions

    with pytest.raises(opt.UnsupportedOption, match="need --allowed-origins"):
        ServerOptions.resolve({"allowed_methods": ["GET"]}, {})
    with pytest.raises(opt.UnsupportedOption, match="^PAGEDLM_ALLOWED_HEADERS=x: "):
        ServerOptions.resolve({}, {"PAGEDLM_ALLOWED_HEADERS": "x"})
    assert ServerOptions.resolve({"allowed_origins": ["*"], "allowed_methods": ["GET"]}, {}).allowed_methods == ("GET",)


def test_every_refusal_has_its_row_in_the_cli_docs():
    """docs/cli.md mirrors options.REFUSALS row for row: as many rows as refusals."""
    from pathlib import Path

    from pagedlm.options import REFUSALS

    text = (Path(__file__).parents[2] / "docs" / "cli.md").read_text()
    table = text[text.index("### Refusals"):].split("\n\n")[2]
    rows = [line for line in table.splitlines()[2:] if line.startswith("| ")]  # past the header
    # + the engine-start rows (a paged pool smaller than one sequence, a default-store budget that holds none)
    assert len(rows) - 2 == len(REFUSALS)


def test_dtype_takes_vllms_spellings_and_torch_dtypes():
    import torch

    assert opt.resolve_dtype("half", "cpu") is torch.float16 and opt.resolve_dtype("float", "cpu") is torch.float32
    assert opt.resolve_dtype(torch.bfloat16, "cpu") is torch.bfloat16
    assert opt.resolve_dtype(None, "cuda") is torch.bfloat16
    for bad in ("double", torch.float64, 16):
        with pytest.raises(opt.OptionError, match="--dtype must be auto, float32, bfloat16, float16, float, half"):
            opt.resolve_dtype(bad, "cpu")


def test_the_tensor_parallel_timeout_is_read_when_the_ranks_start_and_checked():
    """A bad PAGEDLM_TP_TIMEOUT once crashed every command at import (even --version)."""
    import os
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-m", "pagedlm.cli", "--version"], capture_output=True, text=True,
                         env={**os.environ, "PAGEDLM_TP_TIMEOUT": "abc"})
    assert run.returncode == 0 and run.stderr == ""
    assert opt.tp_timeout({}) == 120.0 and opt.tp_timeout({"PAGEDLM_TP_TIMEOUT": "30"}) == 30.0
    for bad in ("abc", "inf", "nan", "0", "-5"):
        with pytest.raises(opt.OptionError, match="PAGEDLM_TP_TIMEOUT must be a number of seconds > 0"):
            opt.tp_timeout({"PAGEDLM_TP_TIMEOUT": bad})


def test_a_byte_count_takes_suffixes_and_refuses_what_no_machine_has():
    assert opt._byte_count("4G", "--kv-budget-bytes") == 4 << 30 and opt._byte_count("1024T", "x") == 1024**5
    for bad, says in [("0", "must be > 0"), ("4X", "byte count such as"), ("1025T", "at most 1024T"),
                      ("100000000T", "at most 1024T")]:  # (the last: torch's size overflow, a traceback before)
        with pytest.raises(opt.OptionError, match=says):
            opt._byte_count(bad, "--kv-budget-bytes")


def test_a_prompt_cache_for_the_paged_store_is_refused():
    """(serve --paged-kv --prompt-cache-bytes N started, the cache logged as off.)"""
    with pytest.raises(opt.UnsupportedOption, match="--prompt-cache-bytes sizes the default store's prompt cache"):
        opt.ServerOptions.resolve({"paged_kv": True, "prompt_cache_bytes": "1024"}, {})
    with pytest.raises(opt.UnsupportedOption, match="PAGEDLM_PROMPT_CACHE_BYTES=1024: --prompt-cache-bytes"):
        opt.ServerOptions.resolve({"paged_kv": True}, {"PAGEDLM_PROMPT_CACHE_BYTES": "1024"})
    assert opt.ServerOptions.resolve({"prompt_cache_bytes": "1024", "device": "cpu"}, {}).prompt_cache_bytes == 1024
    assert opt.ServerOptions.resolve({"paged_kv": True}, {}).paged_kv is not None  # the default cache: no refusal
