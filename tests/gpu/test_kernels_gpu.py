"""The Triton paged kernels at full size on CUDA, bf16 included.

Shapes of the benchmark models (Llama-3.1-8B: 32 query heads over 8 KV
heads of 128; Qwen3-0.6B: 16 over 8 of 128; Gemma 3 270M: 4 over 1 of 256
with a 512-token window), long ragged rows, every block size the engine
accepts at both ends. The oracle is float64; bf16 lands between 1e-3 and
1e-2 relative error.
"""

import pytest
import torch

from pagedlm.kernels import paged_attention as pa
from tests.fast.kernel_refs import paged_decode_reference, paged_prefill_reference, write_kv_reference
from tests.helpers import paged_inputs, rel_err

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

SHAPES = {"llama-8b": (32, 8, 128, None), "qwen3-0.6b": (16, 8, 128, None), "gemma3-270m": (4, 1, 256, 512)}


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("block_size", [16, 256])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_decode_full_size(shape, block_size, dtype):
    hq, hkv, d, window = SHAPES[shape]
    lengths = [1, 511, 512, 513, 4097, 8191, 300, 2000]
    q, k_pool, v_pool, tables, seq_lens = paged_inputs(lengths, block_size, hq, hkv, d, dtype, seed=block_size)
    out = pa.paged_decode(q, k_pool, v_pool, tables, seq_lens, d**-0.5, window)
    ref = paged_decode_reference(q, k_pool, v_pool, tables, seq_lens, d**-0.5, window)
    assert not out.isnan().any()
    assert rel_err(out, ref) < 1e-2


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("block_size", [16, 256])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_prefill_full_size(shape, block_size, dtype):
    """Whole prompts, chunks after a cached prefix (some past the window),
    verify-sized rows and a decode row, in one launch."""
    hq, hkv, d, window = SHAPES[shape]
    lengths = [1024, 4097, 700, 2000, 9, 513]
    q_lens = [1024, 512, 300, 5, 9, 1]
    _, k_pool, v_pool, tables, seq_lens = paged_inputs(lengths, block_size, hq, hkv, d, dtype, seed=block_size)
    g = torch.Generator(device="cuda").manual_seed(2)
    q = torch.randn(sum(q_lens), hq, d, device="cuda", generator=g).to(dtype)
    starts = torch.tensor([0, *q_lens], device="cuda").cumsum(0)
    out = pa.paged_prefill(q, k_pool, v_pool, tables, starts, seq_lens, d**-0.5, max(q_lens), window)
    ref = paged_prefill_reference(q, k_pool, v_pool, tables, starts, seq_lens, d**-0.5, window)
    assert not out.isnan().any()
    assert rel_err(out, ref) < 1e-2


@pytest.mark.parametrize("mode", ["int8", "fp8"])
def test_prefill_reads_8bit_blocks_full_size(mode):
    from pagedlm.cache import kv_quant as kvq

    hq, hkv, d, _ = SHAPES["llama-8b"]
    lengths, q_lens = [2048, 600, 7], [2048, 100, 7]
    _, k_pool, v_pool, tables, seq_lens = paged_inputs(lengths, 16, hq, hkv, d, torch.bfloat16)
    q = torch.randn(sum(q_lens), hq, d, device="cuda").bfloat16()
    starts = torch.tensor([0, *q_lens], device="cuda").cumsum(0)
    (kc, ks), (vc, vs) = kvq.quantize_pools(k_pool, v_pool, mode)
    out = pa.paged_prefill(q, kc, vc, tables, starts, seq_lens, d**-0.5, 2048, scales=(ks, vs))
    ref = paged_prefill_reference(q, kvq.dequantize(kc, ks, torch.bfloat16), kvq.dequantize(vc, vs, torch.bfloat16),
                                  tables, starts, seq_lens, d**-0.5)
    assert rel_err(out, ref) < 1e-2


def test_decode_replays_under_a_cuda_graph_bit_for_bit():
    hq, hkv, d, _ = SHAPES["llama-8b"]
    q, k_pool, v_pool, tables, seq_lens = paged_inputs([3000, 17, 900], 16, hq, hkv, d, torch.bfloat16)
    eager = pa.paged_decode(q, k_pool, v_pool, tables, seq_lens, d**-0.5)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = pa.paged_decode(q, k_pool, v_pool, tables, seq_lens, d**-0.5)
    # New lengths, same buffers; each within its row's blocks (a length past them reads a table's -1
    # padding: out of the pool, which this test did until the partials moved, 84bae79).
    seq_lens.copy_(torch.tensor([1500, 5, 620]))
    graph.replay()
    again = pa.paged_decode(q, k_pool, v_pool, tables, seq_lens, d**-0.5)
    assert torch.equal(out, again)
    assert not torch.equal(out, eager)


def test_write_kv_full_size():
    g = torch.Generator(device="cuda").manual_seed(0)
    pool_k = torch.randn(4096, 16, 8, 128, device="cuda", generator=g).bfloat16()
    pool_v = torch.randn_like(pool_k)
    keys = torch.randn(8192, 8, 128, device="cuda", generator=g).bfloat16()
    values = torch.randn_like(keys)
    slots = torch.randperm(4096 * 16, device="cuda", generator=g)[:8192]
    want_k, want_v = pool_k.clone(), pool_v.clone()
    write_kv_reference(keys, values, want_k, want_v, slots)
    pa.write_kv(keys, values, pool_k, pool_v, slots)
    assert torch.equal(pool_k, want_k) and torch.equal(pool_v, want_v)


@pytest.mark.parametrize("mode", ["int8", "fp8"])
def test_decode_reads_8bit_blocks_full_size(mode):
    from pagedlm.cache import kv_quant as kvq

    hq, hkv, d, _ = SHAPES["llama-8b"]
    q, k_pool, v_pool, tables, seq_lens = paged_inputs([1, 513, 8191, 2000], 16, hq, hkv, d, torch.bfloat16)
    (kc, ks), (vc, vs) = kvq.quantize_pools(k_pool, v_pool, mode)
    out = pa.paged_decode(q, kc, vc, tables, seq_lens, d**-0.5, scales=(ks, vs))
    flat = [t.contiguous() for t in (kc, vc, ks, vs)]  # the same codes token-major: the same bits
    assert torch.equal(pa.paged_decode(q, flat[0], flat[1], tables, seq_lens, d**-0.5, scales=(flat[2], flat[3])), out)
    ref = paged_decode_reference(q, kvq.dequantize(kc, ks, torch.bfloat16), kvq.dequantize(vc, vs, torch.bfloat16),
                                 tables, seq_lens, d**-0.5)
    assert rel_err(out, ref) < 1e-2


@pytest.mark.parametrize("mode", ["int8", "fp8"])
def test_write_kv_quantizes_as_the_reference_full_size(mode):
    from pagedlm.cache import kv_quant as kvq

    g = torch.Generator(device="cuda").manual_seed(1)
    keys = (torch.randn(4096, 8, 128, device="cuda", generator=g) * 3).bfloat16()
    values = torch.randn_like(keys)
    slots = torch.randperm(1024 * 16, device="cuda", generator=g)[:4096]
    pools = [kvq.zeros((1024, 16, 8, 128), order, kvq.STORAGE[mode], "cuda") for order in (kvq.KEY_ORDER, kvq.VALUE_ORDER)]
    scales = [kvq.zeros((1024, 16, 8), kvq.SCALE_ORDER, kvq.SCALE_DTYPE, "cuda") for _ in range(2)]
    pa.write_kv(keys, values, pools[0], pools[1], slots, tuple(scales), fmt=mode, qmax=kvq.QMAX[mode])
    at = (slots // 16, slots % 16)
    for x, pool, scale in ((keys, pools[0], scales[0]), (values, pools[1], scales[1])):
        codes, s = kvq.quantize(x, mode)
        assert torch.equal(scale[at], s)
        assert torch.equal(kvq.as_bytes(pool)[at], kvq.as_bytes(codes))


@pytest.mark.parametrize("mode", ["none", "fp8"])
def test_decode_row_is_the_same_alone_and_in_a_full_batch(mode):
    """Alone, a 9,000-token row gets many programs and 3 pipeline stages; in
    a batch of 40 rows it gets one program and 2 stages. Its bits must not
    move (each split is its own partial, merged in split order)."""
    from pagedlm.cache import kv_quant as kvq

    hq, hkv, d, _ = SHAPES["llama-8b"]
    lengths = [9000] + [700 + 37 * i for i in range(39)]
    q, k_pool, v_pool, tables, seq_lens = paged_inputs(lengths, 16, hq, hkv, d, torch.bfloat16)
    scales = None
    if mode != "none":
        (k_pool, ks), (v_pool, vs) = kvq.quantize_pools(k_pool, v_pool, mode)
        scales = (ks, vs)
    batch = pa.paged_decode(q, k_pool, v_pool, tables, seq_lens, d**-0.5, scales=scales)
    alone = pa.paged_decode(q[:1], k_pool, v_pool, tables[:1], seq_lens[:1], d**-0.5, scales=scales)
    assert pa.decode_programs(1, hkv, q.device) > pa.decode_programs(40, hkv, q.device)
    assert torch.equal(batch[:1], alone)


def test_bench_counts_kernels_compiled_inside_a_run():
    """`bench throughput`'s ``kernel_compiles_in_runs``: a kernel meeting a
    new specialization inside the block is counted (a first call, then a
    pointer 8 bytes off 16-byte alignment: the case ``prepare_step`` pads
    against); a call that reuses a compiled kernel is not."""
    import triton
    import triton.language as tl

    from pagedlm.bench.common import kernel_compiles

    @triton.jit
    def copy(src, dst, n, BLOCK: tl.constexpr):
        i = tl.arange(0, BLOCK)
        tl.store(dst + i, tl.load(src + i, mask=i < n), mask=i < n)

    x = torch.arange(64, device="cuda", dtype=torch.int64)
    y = torch.empty_like(x)
    with kernel_compiles() as first:
        copy[(1,)](x, y, 32, BLOCK=64)
    with kernel_compiles() as again:
        copy[(1,)](x[2:], y, 32, BLOCK=64)  # 16 bytes in: still aligned
    with kernel_compiles() as shifted:
        copy[(1,)](x[1:], y, 32, BLOCK=64)  # 8 bytes in
    torch.cuda.synchronize()
    assert (first, again, shifted) == (["copy"], [], ["copy"])
    assert torch.equal(y[:32], x[1:33])
