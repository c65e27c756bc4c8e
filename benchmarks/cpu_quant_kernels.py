"""One-row products on the CPU: float32 (kernels.cpu.linear) against torch's int8 / int4
weight-only kernels, float32 and bfloat16 activations, interleaved; best of 5 rounds.

    PYTHONPATH=. python benchmarks/cpu_quant_kernels.py [gemma_head smol_gu ...]
"""
import torch, time, sys
from pagedlm.kernels import cpu
torch.manual_seed(0)
shapes = {"gemma_head": (262144, 640), "gemma_qkv": (1536, 640), "gemma_o": (640, 1024), "gemma_gu": (4096, 640), "gemma_down": (640, 2048),
          "smol_head": (49152, 576), "smol_qkv": (960, 576), "smol_o": (576, 576), "smol_gu": (3072, 576), "smol_down": (576, 1536)}
only = sys.argv[1:] or list(shapes)
def quant4(w, g):
    N, K = w.shape
    wg = w.view(N, K//g, g); mn = wg.amin(-1); mx = wg.amax(-1)
    s = ((mx-mn)/15).clamp_min(1e-8); q = ((wg - mn[...,None])/s[...,None]).round().clamp(0,15).int().view(N,K)
    zero = mn + 8*s
    return torch._convert_weight_to_int4pack_for_cpu(q, 2), torch.stack([s.t(), zero.t()], -1).contiguous()
for name in only:
    N, K = shapes[name]
    w = torch.randn(N, K) * 0.02
    wk = w.t().contiguous().t()
    s8 = w.abs().amax(1)/127; q8 = (w/s8[:,None]).round().to(torch.int8)
    fns = {"f32": lambda x: cpu.linear(x, wk)}
    for dt, tag in ((torch.float32, "f32"), (torch.bfloat16, "bf16")):
        s = s8.to(dt)
        fns[f"i8_{tag}"] = (lambda s, dt: lambda x: torch._weight_int8pack_mm(x.to(dt), q8, s).float())(s, dt)
        for g in (32, 64, 128):
            if K % g: continue
            p, sz = quant4(w, g); sz = sz.to(dt)
            fns[f"i4g{g}_{tag}"] = (lambda p, sz, g, dt: lambda x: torch._weight_int4pack_mm_for_cpu(x.to(dt), p, g, sz).float())(p, sz, g, dt)
    x = torch.randn(1, K)
    reps = max(3, int(2e8 // (N*K*4)))
    res = {k: [] for k in fns}
    for f in fns.values(): f(x)
    for r in range(5):
        for k, f in fns.items():
            t = time.perf_counter()
            for _ in range(reps): f(x)
            res[k].append((time.perf_counter()-t)/reps*1e3)
    base = min(res["f32"])
    print(name, f"{N}x{K}", "  ".join(f"{k}={min(v):.3f}ms({base/min(v):.2f}x)" for k, v in res.items()), flush=True)
