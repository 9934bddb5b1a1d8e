"""Sliding-window and head-dim-64 attention on flash_attn's Hopper paths beside its mma.sync (ampere)
paths and PyTorch's peers, in one process under one timer (deep_timer.bench_deep).

Rows, each forward and forward + backward, causal bf16, 32 query / 8 kv heads:
  - kcpp hopper and kcpp ampere with the window (the package through its C ABI, python/kcpp.py; the
    paths pinned by KCPP_FLASH_ATTN_FORWARD / _BACKWARD);
  - torch's flex_attention, compiled, with a sliding-window causal block mask (the peer that skips the
    window's empty blocks as we do);
  - SDPA's cuDNN backend on the full causal attention (no window: what a user without a windowed
    kernel runs), and kcpp hopper the same (window 0).
TFLOP/s count the visible (query, key) pairs: 4 B Hq D pairs for the forward, 3.5 times that for forward
+ backward.  Outputs and gradients are compared with flex_attention's before they are timed, and every
output's first batch row and first four heads with an f32 SDPA (math backend) under the explicit mask.

Run on the GPU machine: python3 bench/attention_window.py <libflash_attn.so of the CUDA variant>
[BxSxDxW ...] (default 4x4096x128x1024, 2x8192x128x4096, 4x4096x64x1024, 4x4096x64x0).
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
shapes = [tuple(int(x) for x in a.split("x")) for a in sys.argv[2:]] or [
    (4, 4096, 128, 1024), (2, 8192, 128, 4096), (4, 4096, 64, 1024), (4, 4096, 64, 0)]
HQ, HKV = 32, 8
layer = kcpp.Package(lib).layer("FlashAttention")


def rel(a, b):
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm()).item()


rows = []
for B, S, D, W in shapes:
    torch.manual_seed(0)
    q = torch.randn(B, HQ, S, D, dtype=torch.bfloat16, device="cuda")
    k = torch.randn(B, HKV, S, D, dtype=torch.bfloat16, device="cuda")
    v = torch.randn(B, HKV, S, D, dtype=torch.bfloat16, device="cuda")
    do = torch.randn_like(q)
    pairs = sum(min(i + 1, W) if W > 0 else i + 1 for i in range(S))
    fl = 4 * B * HQ * pairs * D / 1e12

    win = W if W > 0 else S  # a window of S keys hides nothing

    def window_mask(b, h, qi, ki):
        return (qi >= ki) & (qi - ki < win)

    # Compiled afresh for each shape: a compiled flex_attention reused across masks whose functions
    # differ only in a captured value may keep the first mask's element-wise code.
    torch._dynamo.reset()
    flex = torch.compile(flex_attention, dynamic=False)
    bm = create_block_mask(window_mask, None, None, S, S, device="cuda")
    # The explicit mask's reference on batch row 0, heads 0-3 (kv head 0), in f32.
    i_ = torch.arange(S, device="cuda")
    dense = (i_[:, None] >= i_[None, :]) & (i_[:, None] - i_[None, :] < win)
    exact = torch.nn.functional.scaled_dot_product_attention(
        q[0, :4].float(), k[0, :1].float().expand(4, S, D), v[0, :1].float().expand(4, S, D), attn_mask=dense)

    def slice_err(o):
        return rel(o[0, :4], exact)

    qg, kg, vg = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    o_ref = flex(qg, kg, vg, block_mask=bm, enable_gqa=True)
    o_ref.backward(do)
    g_ref = [t.grad.clone() for t in (qg, kg, vg)]
    o_ref = o_ref.detach()
    print(f"B{B} S{S} D{D} W{W}: flex_attention's output against the explicit mask's (slice): {slice_err(o_ref):.2e}", flush=True)

    def flex_f():
        with torch.no_grad():
            flex(q, k, v, block_mask=bm, enable_gqa=True)

    def flex_fb():
        backward_fresh(flex(qg, kg, vg, block_mask=bm, enable_gqa=True), do, (qg, kg, vg))

    impls = [("flex_attention (compiled)", flex_f, flex_fb, 0.0, 0.0)]
    out, lse = torch.empty_like(q), torch.empty(B, HQ, S, dtype=torch.float32, device="cuda")
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    for path, window in [("hopper", W), ("ampere", W)] + ([("hopper", 0)] if W > 0 else []):
        fa = {"q": q, "k": k, "v": v, "out": out, "lse": lse, "scale": 1 / math.sqrt(D), "causal": 1, "window": window}
        ba = dict(fa, dout=do, dq=dq, dk=dk, dv=dv)

        def env(path=path):
            os.environ["KCPP_FLASH_ATTN_FORWARD"] = os.environ["KCPP_FLASH_ATTN_BACKWARD"] = path
        env()
        try:
            layer.forward(fa)
            layer.backward(ba)
        except kcpp.KcppError as e:
            print(f"!! kcpp {path} window {window}: {e}", flush=True)
            continue
        torch.cuda.synchronize()
        print(f"  kcpp {path} window {window}: output against the explicit mask's (slice) {slice_err(out):.2e}", flush=True)
        err = rel(out, o_ref) if window == W else float("nan")
        gerr = max(rel(a, b) for a, b in zip((dq, dk, dv), g_ref)) if window == W else float("nan")

        def f(fa=fa, env=env):
            env()
            layer.forward(fa)

        def fb(fa=fa, ba=ba, env=env):
            env()
            layer.forward(fa)
            layer.backward(ba)
        impls.append((f"kcpp {path}" + (" (no window)" if window != W else ""), f, fb, err, gerr))
    cudnn_f, cudnn_fb = sdpa_cudnn_causal(q, k, v, qg, kg, vg, do)
    impls.append(("sdpa-cudnn" + (" (no window)" if W > 0 else ""), cudnn_f, cudnn_fb, float("nan"), float("nan")))
    # Two passes, the second in reverse order; each figure the mean of its two.
    passes = bench_both_orders([fn for impl in impls for fn in impl[1:3]])
    times = {(i, kind): passes[2 * i + kind - 1] for i in range(len(impls)) for kind in (1, 2)}
    for i, (name, _, _, e1, e2) in enumerate(impls):
        tf, tfb = (sum(times[(i, kk)]) / 2 for kk in (1, 2))
        flp = 4 * B * HQ * (S * (S + 1) // 2) * D / 1e12 if "(no window)" in name else fl
        rows.append((B, S, D, W, name, tf, flp / tf * 1e3, tfb, 3.5 * flp / tfb * 1e3, e1, e2))
        print(rows[-1], "passes", " / ".join(f"{t:.3f}" for t in times[(i, 1)] + times[(i, 2)]), flush=True)
    for var in ("KCPP_FLASH_ATTN_FORWARD", "KCPP_FLASH_ATTN_BACKWARD"):
        os.environ.pop(var, None)
    del q, k, v, do, out, dq, dk, dv, qg, kg, vg, impls
    torch.cuda.empty_cache()

print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}; causal bf16, {HQ}/{HKV} heads; TFLOP/s of the visible pairs")
print(f"{'shape':22s} {'impl':28s} {'fwd ms':>8s} {'TFLOP/s':>8s} {'f+b ms':>8s} {'TFLOP/s':>8s} {'out err':>9s} {'grad err':>9s}")
for B, S, D, W, name, tf, ff, tfb, ffb, e1, e2 in rows:
    print(f"{f'B{B} S{S} D{D} W{W}':22s} {name:28s} {tf:8.3f} {ff:8.1f} {tfb:8.3f} {ffb:8.1f} {e1:9.2e} {e2:9.2e}")
