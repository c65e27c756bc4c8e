"""Model folders pagedlm cannot load: one line naming the file and what is
wrong, exit 2 on the CLI, a ``LoadError`` from the API; never a traceback
(issue 27: a folder of junk files, a config.json with wrong types)."""

from __future__ import annotations

import json

import pytest
from safetensors.torch import save_file

from pagedlm.cli import main
from pagedlm.loading import LoadError, load
from tests.helpers import TINY, byte_level, tiny_model

JUNK = bytes(range(256)) * 8  # not UTF-8, not JSON, not a safetensors header


def _good_folder(path, family="llama"):
    path.mkdir()
    (path / "config.json").write_text(json.dumps(TINY[family]))
    model = tiny_model(family)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, path / "model.safetensors")
    byte_level().save(str(path / "tokenizer.json"))
    return path


def _config(**changes):
    """Write config.json as the tiny llama's with ``changes`` (None: drop the key)."""
    def write(folder):
        config = {k: v for k, v in {**TINY["llama"], **changes}.items() if v is not None}
        (folder / "config.json").write_text(json.dumps(config))
    return write


def _write(name, data):
    return lambda folder: (folder / name).write_bytes(data)


def _junk_folder(folder):
    for f in folder.iterdir():
        f.write_bytes(JUNK)


def _weights(change):
    def write(folder):
        weights = dict(tiny_model("llama").state_dict())
        change(weights)
        save_file({k: v.contiguous() for k, v in weights.items()}, folder / "model.safetensors")
    return write


# (what is broken, what the message must name)
BROKEN = {
    "every file junk": (_junk_folder, ["config.json", "not a UTF-8 text file"]),
    "config not JSON": (_write("config.json", b"{model_type: llama"), ["config.json", "not a JSON file"]),
    "config a list": (_write("config.json", b"[1, 2]"), ["config.json", "not a JSON object"]),
    "hidden_size a string": (_config(hidden_size="big"), ["config.json", "hidden_size must be an integer", '"big"']),
    "layers a list": (_config(num_hidden_layers=[2]), ["config.json", "num_hidden_layers must be an integer"]),
    "hidden_size a float": (_config(hidden_size=64.5), ["hidden_size must be an integer", "64.5"]),
    "hidden_size negative": (_config(hidden_size=-64), ["hidden_size must be >= 1"]),
    "context negative": (_config(max_position_embeddings=-5), ["max_position_embeddings must be >= 1"]),
    "context zero": (_config(max_position_embeddings=0), ["max_position_embeddings must be >= 1"]),  # (was 8192)
    "eps a string": (_config(rms_norm_eps="small"), ["rms_norm_eps must be a number"]),
    "tie a string": (_config(tie_word_embeddings="yes"), ["tie_word_embeddings must be true or false"]),
    "no hidden_size": (_config(hidden_size=None), ["config.json", "no hidden_size"]),
    "no model_type": (_config(model_type=None), ["config.json", "no model_type"]),
    "unknown model_type": (_config(model_type="bert"), ["config.json", "'bert' is not supported"]),
    "rope_scaling unknown": (_config(rope_scaling={"rope_type": "yarn-ish"}), ["config.json", "yarn-ish"]),
    "weights junk": (_write("model.safetensors", JUNK), ["model.safetensors", "not a safetensors file"]),
    "weights truncated": (lambda f: (f / "model.safetensors").write_bytes((f / "model.safetensors").read_bytes()[:-100]),
                          ["model.safetensors", "not a safetensors file"]),
    "no weights": (lambda f: (f / "model.safetensors").unlink(), ["no *.safetensors weight files"]),
    "weights of another shape": (_config(num_attention_heads=8), ["weights do not fit config.json", "size mismatch"]),
    "a weight missing": (_weights(lambda w: w.pop("model.norm.weight")), ["weights do not fit", "model.norm.weight"]),
    "tokenizer junk": (_write("tokenizer.json", JUNK), ["cannot read its tokenizer"]),
}


def _broken(tmp_path, case):
    folder = _good_folder(tmp_path / "model")
    BROKEN[case][0](folder)
    return folder


def test_the_good_folder_loads_and_generates(tmp_path, capsys):
    """The cases below break one thing each in this folder."""
    assert main(["generate", "--model", str(_good_folder(tmp_path / "model")), "--max-tokens", "2", "hi"]) == 0


@pytest.mark.parametrize("case", list(BROKEN))
def test_cli_says_what_is_wrong_in_one_line_and_exits_2(case, tmp_path, capsys):
    folder = _broken(tmp_path, case)
    assert main(["generate", "--model", str(folder), "--max-tokens", "2", "hi"]) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if not line.startswith("pagedlm: ")]  # progress lines
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
    for part in BROKEN[case][1]:
        assert part in lines[0], lines[0]


@pytest.mark.parametrize("case", ["hidden_size a string", "weights junk", "weights of another shape",
                                  "a weight missing"])
@pytest.mark.parametrize("quantization", ["none", "int8"])
def test_api_raises_load_error(case, quantization, tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDLM_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.raises(LoadError, match="|".join(map(str, BROKEN[case][1]))):
        load(str(_broken(tmp_path, case)), quantization=quantization)


def test_config_errors_come_before_anything_is_loaded(tmp_path, capsys):
    """A bad config.json is found when the spec is resolved: no "loading" line first."""
    folder = _broken(tmp_path, "hidden_size a string")
    assert main(["generate", "--model", str(folder), "hi"]) == 2
    assert capsys.readouterr().err.count("\n") == 1
