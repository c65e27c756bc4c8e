"""A Llama-3.1-8B-shaped GGUF of random Q4_K_M-style blocks, to check that an
8B Q4 file loads and runs with ``--quantization int4`` on a 24 GB machine
(no real 8B checkpoint is installed here).

    python benchmarks/make_q4_gguf.py /tmp/llama8b-q4km.gguf   # ~4.6 GB, a few minutes

Shapes from ``benchmarks/configs/llama-3.1-8b`` (32 layers, hidden 4096,
FFN 14336, 32 query / 8 KV heads), but the tokenizer (and so the vocabulary,
49,152 rather than 128,256 tokens) is SmolLM2's, copied from its GGUF, since
a tokenizer needs real merges. Types as llama.cpp's Q4_K_M mostly picks
them: Q4_K for every matrix but ``attn_v`` / ``ffn_down`` of every other
layer and the output head, which are Q6_K. Block bytes are random with the
super-block scales set small (weights within about +-0.2), so the model
computes finite nonsense: the check is memory and that it runs.
"""

from __future__ import annotations

import sys

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q

from pagedlm.loading.catalog import BUILTINS
from pagedlm.loading.gguf import read_gguf

HIDDEN, FFN, LAYERS, HEADS, KV_HEADS, HEAD_DIM = 4096, 14336, 32, 32, 8, 128


def random_blocks(rows: int, cols: int, qtype: Q, rng) -> np.ndarray:
    """``[rows, bytes]`` of valid ``qtype`` blocks: random codes, small scales."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    if qtype == Q.Q4_K:  # d, dmin: float16 at bytes 0..3
        raw[..., 0:4] = np.array([2e-4, 2e-4], dtype=np.float16).view(np.uint8)
    else:  # Q6_K: int8 sub-scales at 192..207, d: float16 at 208..209
        raw[..., 192:208] = rng.integers(-64, 64, (rows, cols // block, 16), dtype=np.int8).view(np.uint8)
        raw[..., 208:210] = np.array([5e-5], dtype=np.float16).view(np.uint8)
    return raw.reshape(rows, -1)


def main(path: str) -> int:
    rng = np.random.default_rng(0)
    source = read_gguf(BUILTINS["smollm2-135m-instruct"].locate()).metadata
    vocab = len(source["tokenizer.ggml.tokens"])
    w = gguf.GGUFWriter(path, "llama")
    w.add_block_count(LAYERS)
    w.add_context_length(8192)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(500000.0)
    w.add_rope_dimension_count(HEAD_DIM)
    w.add_tokenizer_model(source["tokenizer.ggml.model"])
    w.add_token_list(source["tokenizer.ggml.tokens"])
    w.add_token_types(source["tokenizer.ggml.token_type"])
    w.add_token_merges(source["tokenizer.ggml.merges"])
    w.add_bos_token_id(source["tokenizer.ggml.bos_token_id"])
    w.add_eos_token_id(source["tokenizer.ggml.eos_token_id"])
    ones = np.ones(HIDDEN, dtype=np.float32)
    w.add_tensor("token_embd.weight", random_blocks(vocab, HIDDEN, Q.Q4_K, rng), raw_dtype=Q.Q4_K)
    w.add_tensor("output_norm.weight", ones)
    w.add_tensor("output.weight", random_blocks(vocab, HIDDEN, Q.Q6_K, rng), raw_dtype=Q.Q6_K)
    for i in range(LAYERS):
        wide = Q.Q6_K if i % 2 == 0 else Q.Q4_K
        for name, rows, cols, qtype in [("attn_q", HEADS * HEAD_DIM, HIDDEN, Q.Q4_K),
                                        ("attn_k", KV_HEADS * HEAD_DIM, HIDDEN, Q.Q4_K),
                                        ("attn_v", KV_HEADS * HEAD_DIM, HIDDEN, wide),
                                        ("attn_output", HIDDEN, HEADS * HEAD_DIM, Q.Q4_K),
                                        ("ffn_gate", FFN, HIDDEN, Q.Q4_K), ("ffn_up", FFN, HIDDEN, Q.Q4_K),
                                        ("ffn_down", HIDDEN, FFN, wide)]:
            w.add_tensor(f"blk.{i}.{name}.weight", random_blocks(rows, cols, qtype, rng), raw_dtype=qtype)
        w.add_tensor(f"blk.{i}.attn_norm.weight", ones)
        w.add_tensor(f"blk.{i}.ffn_norm.weight", ones)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file(progress=True)
    w.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
