"""Logit soft-capping (Gemma 2: s = c tanh(scale q.k / c)) on flash_attn's CUDA paths beside
flex_attention, in one process under one timer (deep_timer.bench_deep).

Rows per shape, each forward and forward + backward (forward only where no tensor-core backward takes
the head dim), causal bf16:
  - kcpp hopper and kcpp ampere with the cap (the package through its C ABI, python/kcpp; the paths
    pinned by KCPP_FLASH_ATTN_FORWARD / _BACKWARD), and kcpp hopper without it (what the cap costs);
  - torch's flex_attention, compiled, with the cap as its score_mod and a causal block mask;
  - SDPA's cuDNN backend without the cap (the fastest attention that ignores it).
TFLOP/s count the causal pairs: 4 B Hq D S (S + 1) / 2 for the forward, 3.5 times that for forward +
backward.  Before timing, every output's first batch row and first four query heads are held to an f32
soft-capped attention computed in full, and the gradients to flex_attention's.

Run on the GPU machine: python3 bench/attention_softcap.py <libflash_attn.so of the CUDA variant>
[BxSxHQxHKVxDxCAP ...] (default Gemma 2 27B's attention, 4x4096x32x16x128x50, and 9B's, 2x4096x16x8x256x50).
"""
import math
import os
import sys

import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "python"))
sys.path.insert(0, HERE)
import kcpp  # noqa: E402
from deep_timer import backward_fresh, bench_both_orders, sdpa_cudnn_causal  # noqa: E402

lib = sys.argv[1]
shapes = [tuple(float(x) if i == 5 else int(x) for i, x in enumerate(a.split("x"))) for a in sys.argv[2:]] or [
    (4, 4096, 32, 16, 128, 50.0), (2, 4096, 16, 8, 256, 50.0)]
layer = kcpp.Package(lib).layer("FlashAttention")


def rel(a, b):
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm()).item()


def pin(path):
    os.environ["KCPP_FLASH_ATTN_FORWARD"] = os.environ["KCPP_FLASH_ATTN_BACKWARD"] = path


rows = []
for B, S, HQ, HKV, D, CAP in shapes:
    torch.manual_seed(0)
    # Queries of standard deviation 4: scale q.k spreads over several units, where a cap of 50 bends the
    # largest few and caps below it bend most.
    q = 4 * torch.randn(B, HQ, S, D, dtype=torch.bfloat16, device="cuda")
    k = torch.randn(B, HKV, S, D, dtype=torch.bfloat16, device="cuda")
    v = torch.randn(B, HKV, S, D, dtype=torch.bfloat16, device="cuda")
    do = torch.randn_like(q)
    scale = 1 / math.sqrt(D)
    fl = 4 * B * HQ * (S * (S + 1) // 2) * D / 1e12
    backward = D in (64, 128, 256)  # the tensor-core backwards' head dims

    # The f32 reference on batch row 0, query heads 0-3 (their kv heads), in full.
    group = HQ // HKV
    kh = torch.arange(4, device="cuda") // group
    s32 = q[0, :4].float() @ k[0, kh].float().transpose(-1, -2) * scale
    s32 = CAP * torch.tanh(s32 / CAP)
    s32 = s32.masked_fill(torch.ones(S, S, dtype=torch.bool, device="cuda").triu(1), float("-inf"))
    exact = torch.softmax(s32, -1) @ v[0, kh].float()
    del s32

    def slice_err(o):
        return rel(o[0, :4], exact)

    def softcap_mod(score, b, h, qi, ki):
        return CAP * torch.tanh(score / CAP)

    def causal(b, h, qi, ki):
        return qi >= ki

    torch._dynamo.reset()
    flex = torch.compile(flex_attention, dynamic=False)
    bm = create_block_mask(causal, None, None, S, S, device="cuda")
    qg, kg, vg = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    impls = []
    g_ref = None
    try:
        o_ref = flex(qg, kg, vg, score_mod=softcap_mod, block_mask=bm, enable_gqa=True)
        if backward:
            o_ref.backward(do)
            g_ref = [t.grad.clone() for t in (qg, kg, vg)]
        print(f"B{B} S{S} {HQ}/{HKV} D{D} cap {CAP}: flex_attention against the f32 reference (slice) "
              f"{slice_err(o_ref.detach()):.2e}", flush=True)

        def flex_f():
            with torch.no_grad():
                flex(q, k, v, score_mod=softcap_mod, block_mask=bm, enable_gqa=True)

        def flex_fb():
            backward_fresh(flex(qg, kg, vg, score_mod=softcap_mod, block_mask=bm, enable_gqa=True), do, (qg, kg, vg))
        impls.append(("flex_attention (compiled)", flex_f, flex_fb if backward else None, float("nan")))
    except Exception as e:  # noqa: BLE001 (a peer that cannot run this shape is reported, not fatal)
        print(f"!! flex_attention B{B} S{S} D{D}: {type(e).__name__}: {str(e)[:200]}", flush=True)

    out, lse = torch.empty_like(q), torch.empty(B, HQ, S, dtype=torch.float32, device="cuda")
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    for path, cap in (("hopper", CAP), ("ampere", CAP), ("hopper", 0.0)):
        if path == "ampere" and D not in (64, 128):
            continue
        fa = {"q": q, "k": k, "v": v, "out": out, "lse": lse, "scale": scale, "causal": 1, "softcap": cap}
        ba = dict(fa, dout=do, dq=dq, dk=dk, dv=dv)
        pin(path)
        try:
            layer.forward(fa)
            if backward:
                layer.backward(ba)
        except kcpp.KcppError as e:
            print(f"!! kcpp {path} cap {cap}: {e}", flush=True)
            continue
        torch.cuda.synchronize()
        gerr = max(rel(a, b) for a, b in zip((dq, dk, dv), g_ref)) if cap and g_ref else float("nan")
        if cap:
            print(f"  kcpp {path}: output against the f32 reference (slice) {slice_err(out):.2e}, gradients against "
                  f"flex_attention's {gerr:.2e}", flush=True)

        def f(fa=fa, path=path):
            pin(path)
            layer.forward(fa)

        def fb(fa=fa, ba=ba, path=path):
            pin(path)
            layer.forward(fa)
            layer.backward(ba)
        impls.append((f"kcpp {path}" + ("" if cap else " (no cap)"), f, fb if backward else None, gerr))

    cudnn_f, cudnn_fb = sdpa_cudnn_causal(q, k, v, qg, kg, vg, do)
    impls.append(("sdpa-cudnn (no cap)", cudnn_f, cudnn_fb if backward else None, float("nan")))
    # Two passes, the second in reverse order; each figure the mean of its two.
    passes = bench_both_orders([fn for impl in impls for fn in impl[1:3]])
    for i, (name, _, _, gerr) in enumerate(impls):
        tf = sum(passes[2 * i]) / 2
        tfb = sum(passes[2 * i + 1]) / 2 if passes[2 * i + 1] is not None else float("nan")
        rows.append((B, S, HQ, HKV, D, CAP, name, tf, fl / tf * 1e3, tfb, 3.5 * fl / tfb * 1e3, gerr))
        print(rows[-1], flush=True)
    for var in ("KCPP_FLASH_ATTN_FORWARD", "KCPP_FLASH_ATTN_BACKWARD"):
        os.environ.pop(var, None)
    del q, k, v, do, out, dq, dk, dv, qg, kg, vg, impls
    torch.cuda.empty_cache()

print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}; causal bf16; TFLOP/s of the causal pairs")
print(f"{'shape':30s} {'impl':26s} {'fwd ms':>8s} {'TFLOP/s':>8s} {'f+b ms':>8s} {'TFLOP/s':>8s} {'grad err':>9s}")
for B, S, HQ, HKV, D, CAP, name, tf, ff, tfb, ffb, gerr in rows:
    print(f"{f'B{B} S{S} {HQ}/{HKV} D{D} cap {CAP:g}':30s} {name:26s} {tf:8.3f} {ff:8.1f} {tfb:8.3f} {ffb:8.1f} {gerr:9.2e}")
