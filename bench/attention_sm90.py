"""flash_attn's paths side by side with PyTorch SDPA's cuDNN and FlashAttention-2 backends, in one
process and under one timer (deep_timer.bench_deep: do_bench's method with an 8 GiB flush, so that no
row's host time is counted; do_bench's own figure and the host time a call are logged beside it):
causal bf16, 32 query / 8 kv heads of 128, at B4 S4096, B2 S8192 and B16 S1024 (other shapes as
arguments BxSxD).  TFLOP/s count the causal half: 4 B H S^2 D / 2 for the forward, 3.5 times that for
forward + backward (the backward alone 2.5 times).  kcpp's rows call the built package through its C
ABI (python/kcpp.py), the forward on the path KCPP_FLASH_ATTN_FORWARD names (hopper: wgmma + TMA,
sm_90a; ampere: mma.sync) and the backward on KCPP_FLASH_ATTN_BACKWARD's (hopper | ampere).  Outputs
and gradients are compared with cuDNN's before they are timed.  Every row is timed twice, in order and
then in the reverse order, and its figure is the mean (a forward timed just after a backward at B4 S4096
ran 8% slower: bench/RESULTS.md).

Run on the GPU machine: python3 bench/attention_sm90.py <path to libflash_attn.so of the CUDA variant>
[BxSxD ...] [--bwd=hopper:grouped,hopper:4,ampere] (the backward paths to time, path:order, an order
being keys, heads, grouped or a number of heads a group; default keys, heads, grouped and ampere;
--no-sdpa-flash2 skips that backend; --also=<path to another libflash_attn.so> times that library's
forward + backward too, on the first backward path, in the same process (a build against the one before
it); --kernels prints, for one forward + backward of every row, each GPU kernel's time under
torch.profiler: where a pass's time goes, the peers' included).
"""
import math
import os
import statistics
import sys

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "python"))
sys.path.insert(0, os.path.join(HERE, "..", "bench"))
sys.path.insert(0, HERE)
import kcpp  # noqa: E402
from deep_timer import backward_fresh, bench_deep, host_us, kernel_table  # noqa: E402

lib = sys.argv[1]
shapes = [(4, 4096, 128), (2, 8192, 128), (16, 1024, 128)]  # B, S, head dim
HQ, HKV = 32, 8
bwd_paths = [("hopper", "keys"), ("hopper", "heads"), ("hopper", "grouped"), ("ampere", "")]
sdpa_backends = [("sdpa-cudnn", SDPBackend.CUDNN_ATTENTION), ("sdpa-flash2", SDPBackend.FLASH_ATTENTION)]
given = []
also = []
kernels = False
for a in sys.argv[2:]:
    if a.startswith("--also="):
        also.append(a[len("--also="):])
    elif a == "--kernels":
        kernels = True
    elif a.startswith("--bwd="):
        bwd_paths = [tuple((x + ":").split(":")[:2]) for x in a[len("--bwd="):].split(",")]
    elif a == "--no-sdpa-flash2":
        sdpa_backends = sdpa_backends[:1]
    else:  # BxSxD
        given.append(tuple(int(x) for x in a.split("x")))
shapes = given or shapes
layer = kcpp.Package(lib).layer("FlashAttention")
also_layers = [(f"kcpp@{os.path.basename(os.path.dirname(a)) or a}", kcpp.Package(a).layer("FlashAttention")) for a in also]


def bench(fn, what=""):
    ms = bench_deep(fn)
    print(f"  {what}: deep {ms:.4f} ms, do_bench {triton.testing.do_bench(fn, warmup=25, rep=100, return_mode='median'):.4f} ms,"
          f" host {host_us(fn):.1f} us a call", flush=True)
    return ms


def rel(a, b):
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm()).item()


rows = []
for B, S, D in shapes:
    torch.manual_seed(0)
    q = torch.randn(B, HQ, S, D, dtype=torch.bfloat16, device="cuda")
    k = torch.randn(B, HKV, S, D, dtype=torch.bfloat16, device="cuda")
    v = torch.randn(B, HKV, S, D, dtype=torch.bfloat16, device="cuda")
    do = torch.randn_like(q)
    fl = 4 * B * HQ * S * S * D / 2 / 1e12
    out, lse = torch.empty_like(q), torch.empty(B, HQ, S, dtype=torch.float32, device="cuda")
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    fa = {"q": q, "k": k, "v": v, "out": out, "lse": lse, "scale": 1 / math.sqrt(D), "causal": 1}
    ba = dict(fa, dout=do, dq=dq, dk=dk, dv=dv)

    # Every implementation is checked first, then timed (below).  impls: (name, forward, forward +
    # backward, out error, grads error).
    impls = []
    # SDPA: grouped heads through enable_gqa where the backend takes it, else K / V repeated (outside the timer).
    qg, kg, vg = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    ke, ve = (t.repeat_interleave(HQ // HKV, dim=1).detach().requires_grad_(True) for t in (k, v))
    ref = grads = None
    for name, be in sdpa_backends:
        with sdpa_kernel(be):
            how = "gqa"
            try:
                with torch.no_grad():
                    o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
                kk_, vv_ = kg, vg
            except RuntimeError:
                how = "repeated kv"
                with torch.no_grad():
                    o = F.scaled_dot_product_attention(q, ke, ve, is_causal=True)
                kk_, vv_ = ke, ve
            gqa = how == "gqa"
            for t in (qg, kk_, vv_):
                t.grad = None
            F.scaled_dot_product_attention(qg, kk_, vv_, is_causal=True, enable_gqa=gqa).backward(do)
            g = [qg.grad.clone()] + [t.grad.clone() if gqa else t.grad.unflatten(1, (HKV, HQ // HKV)).sum(2) for t in (kk_, vv_)]
            if ref is None:
                ref, grads = o, g
            gerr = max(rel(a, b) for a, b in zip(g, grads))

        def f(be=be, kk_=kk_, vv_=vv_, gqa=gqa):
            with sdpa_kernel(be), torch.no_grad():
                F.scaled_dot_product_attention(q, kk_, vv_, is_causal=True, enable_gqa=gqa)

        def fb(be=be, kk_=kk_, vv_=vv_, gqa=gqa):
            with sdpa_kernel(be):
                backward_fresh(F.scaled_dot_product_attention(qg, kk_, vv_, is_causal=True, enable_gqa=gqa), do, (qg, kk_, vv_))

        impls.append((f"{name} ({how})", f, fb, rel(o, ref), gerr))
    os.environ["KCPP_FLASH_ATTN_FORWARD"] = "hopper"
    out.fill_(float("nan"))
    layer.forward(fa)
    torch.cuda.synchronize()
    err = rel(out, ref)
    # The Hopper backward in its block orders (KCPP_FLASH_ATTN_SM90_BWD_ORDER: "keys", each head's
    # key blocks together, "heads", every head's first key blocks first, or "grouped", that in groups of
    # heads), then mma.sync's.  The variables are set at every call (the package reads them then).
    for path, order in bwd_paths:
        def env(path=path, order=order):
            os.environ["KCPP_FLASH_ATTN_BACKWARD"] = path
            os.environ["KCPP_FLASH_ATTN_SM90_BWD_ORDER"] = order
        env()
        label = path + (f" ({order} first)" if order else "")
        for t in (dq, dk, dv):
            t.fill_(float("nan"))
        try:
            layer.backward(ba)
        except kcpp.KcppError as e:
            print(f"!! backward {label}: {e}", flush=True)
            continue
        torch.cuda.synchronize()
        gerr = max(rel(a, b) for a, b in zip((dq, dk, dv), grads))

        def fb(env=env):
            env()
            layer.forward(fa)
            layer.backward(ba)

        # The forward is timed with the first backward path only (it does not depend on it).
        first = not any(n.startswith("kcpp") for n, *_ in impls)
        impls.append((f"kcpp hopper fwd, {label} bwd", (lambda: layer.forward(fa)) if first else None, fb, err, gerr))
        for name, other in also_layers if first else []:
            for t in (dq, dk, dv):
                t.fill_(float("nan"))
            other.forward(fa)
            other.backward(ba)
            torch.cuda.synchronize()
            ogerr = max(rel(a, b) for a, b in zip((dq, dk, dv), grads))

            def ofb(env=env, other=other):
                env()
                other.forward(fa)
                other.backward(ba)

            impls.append((f"{name} {label} bwd", lambda other=other: other.forward(fa), ofb, rel(out, ref), ogerr))

    # The timings in two passes, the second in the reverse order, each figure the mean of its two: what
    # ran just before (a peer's backward heats the GPU, and a forward timed after it runs slower) then
    # weighs on every implementation alike.  Both passes are logged.
    runs = [(i, kind) for i, im in enumerate(impls) for kind in (1, 2) if im[kind] is not None]
    times = {}
    for order_pass in (runs, runs[::-1]):
        for i, kind in order_pass:
            what = f"{impls[i][0]} {'fwd' if kind == 1 else 'fwd+bwd'}"
            times.setdefault((i, kind), []).append(bench(impls[i][kind], what))
    tf = None
    for i, (name, f_, fb_, e1, e2) in enumerate(impls):
        tfi = statistics.mean(times[(i, 1)]) if (i, 1) in times else tf
        if name.startswith("kcpp") and (i, 1) in times:
            tf = tfi
        tfb = statistics.mean(times[(i, 2)])
        rows.append((B, S, D, name, tfi, fl / tfi * 1e3, tfb, 3.5 * fl / tfb * 1e3, e1, e2))
        spread = " / ".join(f"{t:.3f}" for t in times.get((i, 1), [])) + " | " + " / ".join(f"{t:.3f}" for t in times[(i, 2)])
        print(rows[-1], f"passes {spread}", f"backward alone ~{tfb - tfi:.3f} ms, {2.5 * fl / (tfb - tfi) * 1e3:.1f} TFLOP/s",
              flush=True)
    if kernels:  # one forward + backward of each row under the profiler, its kernels by time
        for name, _, fb_, *_ in impls:
            kernel_table(fb_, f"{name} fwd+bwd, B{B} S{S} D{D}")
    for var in ("KCPP_FLASH_ATTN_BACKWARD", "KCPP_FLASH_ATTN_SM90_BWD_ORDER"):
        os.environ.pop(var, None)
    del q, k, v, do, out, dq, dk, dv, qg, kg, vg, ke, ve, ref, impls
    torch.cuda.empty_cache()

print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}; causal bf16, {HQ}/{HKV} heads")
print(f"{'shape':18s} {'impl':32s} {'fwd ms':>8s} {'TFLOP/s':>8s} {'fwd+bwd ms':>11s} {'TFLOP/s':>8s} {'out vs cuDNN':>13s} {'grads vs cuDNN':>15s}")
for B, S, D, name, tf, ff, tfb, ffb, err, gerr in rows:
    print(f"{f'B{B} S{S} D{D}':18s} {name:32s} {tf:8.3f} {ff:8.1f} {tfb:11.3f} {ffb:8.1f} {err:13.2e} {gerr:15.2e}")
