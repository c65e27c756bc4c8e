"""``--compile`` (the compiled CPU decode step): the flag, its environment
variable and its refusals, before any model loads. What the compiled step
computes is tested on the real models (``tests/weights/test_compiled_models.py``)."""

from __future__ import annotations

import pytest

import pagedlm.options as opt
from pagedlm.cli import main

NO_MODEL = ["--model", "/no/such/model"]  # a refusal must come before the model would load


def test_compile_is_off_unless_asked_and_follows_flag_then_environment():
    assert opt.resolve_engine_options({}, environ={}, device="cpu").compile is False
    assert opt.resolve_engine_options({}, environ={"PAGEDLM_COMPILE": "1"}, device="cpu").compile is True
    assert opt.resolve_engine_options({"compile": False}, environ={"PAGEDLM_COMPILE": "1"},
                                      device="cpu").compile is False


@pytest.mark.parametrize("argv,message", [
    (["--device", "cuda", "--compile"], "--compile compiles the CPU decode step; on CUDA"),
    (["--device", "cpu", "--compile", "--enforce-eager"], "--compile and --enforce-eager contradict each other"),
    (["--device", "cpu", "--compile", "--paged-kv"], "--compile runs the default store's decode step"),
])
def test_compile_refusals_are_one_line_and_exit_2(argv, message, capsys, monkeypatch):
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)  # --device cuda passes its own check
    assert main(["generate", *NO_MODEL, *argv, "hi"]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err


def test_compile_without_a_cxx_compiler_is_refused(monkeypatch):
    monkeypatch.setenv("CXX", "no-such-compiler-here")
    with pytest.raises(opt.UnsupportedOption, match="no C\\+\\+ compiler was found"):
        opt.resolve_engine_options({"compile": True}, environ={}, device="cpu")
    monkeypatch.delenv("CXX")
    if opt.cxx_compiler() is not None:  # this machine has g++: the same options pass
        assert opt.resolve_engine_options({"compile": True}, environ={}, device="cpu").compile is True


def test_compile_with_tensor_parallelism_is_refused():
    with pytest.raises(opt.UnsupportedOption, match="--tensor-parallel-size N > 1 runs eagerly"):
        opt.resolve_engine_options({"compile": True, "tensor_parallel_size": "2"}, environ={}, device="cpu")


@pytest.mark.skipif(opt.cxx_compiler() is None, reason="--compile needs a C++ compiler")
def test_bench_decode_compile_adds_compiled_rows_beside_the_eager_ones(tmp_path, capsys):
    """The one fast test that compiles (a tiny random model, the one-row graph
    only): ``bench decode --compile`` times each default-store row eagerly and
    compiled, in one run."""
    import json

    from tests.fast.test_bench_batched import TINY

    (tmp_path / "config.json").write_text(json.dumps(TINY))
    argv = ["bench", "decode", "--model", str(tmp_path), "--random-weights", "--device", "cpu", "--prompt-len", "8",
            "--gen-len", "3", "--repeats", "1", "--compile", "--max-num-seqs", "1", "--json"]
    assert main(argv) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert [(r["name"], r["compiled"]) for r in rows] == [("pagedlm-default", False), ("pagedlm-default-compiled", True)]
    assert rows[1]["decode_ratio_vs_eager"] > 0 and "decode_ratio_vs_eager" not in rows[0]


@pytest.mark.skipif(opt.cxx_compiler() is None, reason="--compile needs a C++ compiler")
def test_bench_throughput_rows_say_whether_they_ran_compiled(tmp_path, capsys):
    import json

    from tests.fast.test_bench_batched import TINY

    (tmp_path / "config.json").write_text(json.dumps(TINY))
    argv = ["bench", "throughput", "--model", str(tmp_path), "--random-weights", "--device", "cpu",
            "--num-prompts", "2", "--min-len", "4", "--max-len", "8", "--max-num-seqs", "1", "--json"]
    for flag, compiled in (([], False), (["--compile"], True)):
        assert main(argv + flag) == 0
        rows = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
        assert rows and all(r["compiled"] is compiled for r in rows)


def test_compiled_graph_cache_keys_on_the_whole_package(monkeypatch):
    """A cached compiled step carries the guards its trace added; code that
    changes only a guard (a row count tested before a branch not taken)
    leaves the traced graph as it was. So the cache key hashes every module
    the step's trace runs through (the products in kernels.cpu, the layers),
    not compiled.py alone: a stale guard otherwise failed the warm-up."""
    from pagedlm.batch import compiled

    hashed = []
    monkeypatch.setattr(compiled, "get_hash_for_files", lambda files: hashed.extend(files) or b"h")
    compiled._package_hash.cache_clear()
    try:
        assert compiled.ResidualOutsideGemm().uuid() == b"h"
    finally:
        compiled._package_hash.cache_clear()
    names = {"/".join(f.split("/")[-3:]) for f in hashed}
    assert {"pagedlm/kernels/cpu.py", "pagedlm/models/layers.py", "pagedlm/batch/compiled.py"} <= names
