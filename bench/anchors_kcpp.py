"""kcpp's kernels and Liger-Kernel's under one timer, in one process: both called from PyTorch (ours
through the C ABI with python/kcpp.py, the built `liger` package's CUDA variant), both timed by
do_bench's method with a deeper flush (`bench_deep`: the host's time per call hidden; do_bench's own
figure and the host time printed beside it), at anchors.py's shapes (Llama-3-8B: 8192 tokens,
hidden 4096, intermediate 14336, vocab 128256, bf16) and byte counts.  Each op's result is compared with Liger's before it is timed.

Forward + backward: Liger through autograd (as anchors.py), ours as the two ABI calls a host makes;
our outputs are allocated once outside the timed call (a host's allocator would hand the same
blocks back), Liger's inside.  The copy ceiling is measured the same way (2 GiB device copy).

Run on the GPU machine: KCPP_PACKAGES_DIR=.devlibs/kernels python3 bench/anchors_kcpp.py [ops...]
with Liger's source under .anchors/src (../shared/anchors/README.md).  ops: rms_norm add_rms_norm
layer_norm swiglu rope ce (default all).
"""
import contextlib
import glob
import os
import statistics
import sys
import time

import torch
import triton

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "python"))
sys.path.insert(0, os.environ.get("LIGER_SRC", os.path.join(HERE, "..", ".anchors", "src")))
import kcpp  # noqa: E402

BT, H, I, V = 8192, 4096, 14336, 128256
dev = "cuda"
bf16 = torch.bfloat16


def bench(fn):
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


_FLUSH = None


def bench_deep(fn, warmup=10, rep=40):
    """do_bench's method (zero a buffer to flush the L2, then time one call between events; the
    median) with an 8 GiB buffer instead of 256 MiB: the GPU then spends ~2 ms zeroing before each
    timed call, and a host that takes up to that long to enqueue the call is still ahead of the GPU.
    With do_bench's 256 MiB (~60 us) a call whose host side takes longer than that plus the kernel
    is timed with the GPU idle waiting for it: on the lent machine a Liger autograd call takes
    100-1400 us of host time (measured below), so do_bench figures of short kernels vary with the
    host's speed from one call to the next."""
    global _FLUSH
    if _FLUSH is None:
        _FLUSH = torch.empty(8 * 2**30 // 4, dtype=torch.int32, device=dev)
    for _ in range(warmup):
        fn()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(rep)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(rep)]
    torch.cuda.synchronize()
    for i in range(rep):
        _FLUSH.zero_()
        starts[i].record()
        fn()
        ends[i].record()
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) for a, b in zip(starts, ends))


COPY_GBPS = None


def host_us(fn, n=50):
    """Host time a call takes to enqueue its work (no synchronisation inside the loop): a timed
    figure means the GPU's time only while this stays below it plus do_bench's flush (~60 us)."""
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    t = time.perf_counter() - t
    torch.cuda.synchronize()
    return t / n * 1e6


def row(op, impl, fn, gbytes, no_grad=False):
    """Prints the deep-flush time (the figure compared), do_bench's and the host's time a call."""
    with torch.no_grad() if no_grad else contextlib.nullcontext():
        ms = bench_deep(fn)
        ms_do_bench = bench(fn)
        host = host_us(fn)
    gbps = gbytes / (ms / 1e3)
    print(f"{op:20s} {impl:8s} {ms:9.4f} ms {gbps:8.0f} GB/s {100 * gbps / COPY_GBPS:6.1f}% of copy"
          f"   (do_bench {ms_do_bench:7.4f} ms; host {host:6.1f} us a call)", flush=True)
    return ms


def versus(op, ours, liger):
    print(f"{op:20s} kcpp / liger time: {ours / liger:.3f} (kcpp {liger / ours:.2f}x faster)", flush=True)


def close(what, ours, theirs, tol):
    d = (ours.float() - theirs.float()).abs().max().item()
    scale = theirs.float().abs().max().item()
    status = "ok" if d <= tol * max(scale, 1.0) else "!! DIFFERS"
    print(f"{what:20s} max |kcpp - liger| = {d:.3g} (scale {scale:.3g}) {status}", flush=True)


def package():
    root = os.environ.get("KCPP_PACKAGES_DIR", os.path.join(HERE, "..", ".devlibs", "kernels"))
    found = sorted(glob.glob(os.path.join(root, "liger", "build", "kcpp1-cu*", "libliger.so")))
    if not found:
        sys.exit(f"no CUDA build of package liger under {root} (set KCPP_PACKAGES_DIR)")
    return kcpp.Package(found[0])


def copy_ceiling():
    global COPY_GBPS
    n = 2 * 2**30
    a = torch.empty(n, dtype=torch.uint8, device=dev)
    b = torch.empty_like(a)
    ms = bench(lambda: b.copy_(a))
    COPY_GBPS = 2 * n / 1e9 / (ms / 1e3)
    print(f"{'copy d2d 2GiB':20s} {'torch':8s} {ms:9.4f} ms {COPY_GBPS:8.0f} GB/s", flush=True)


def rms_norm(pkg):
    from liger_kernel.ops.rms_norm import LigerRMSNormFunction
    layer = pkg.layer("LigerRMSNorm")
    x = torch.randn(BT, H, dtype=bf16, device=dev)
    w = torch.randn(H, dtype=bf16, device=dev)
    dy = torch.randn_like(x)
    y, rstd = torch.empty_like(x), torch.empty(BT, device=dev)
    dx, dw = torch.empty_like(x), torch.empty_like(w)
    fwd_args = {"x": x, "weight": w, "eps": 1e-6, "y": y, "rstd": rstd}
    bwd_args = {"dy": dy, "x": x, "weight": w, "rstd": rstd, "eps": 1e-6, "dx": dx, "dweight": dw}
    xl, wl = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    liger = lambda: LigerRMSNormFunction.apply(xl, wl, 1e-6, 0.0, "llama", False)
    layer.forward(fwd_args)
    layer.backward(bwd_args)
    yl = liger()
    yl.backward(dy)
    close("rms_norm y", y, yl, 1e-2)
    close("rms_norm dx", dx, xl.grad, 1e-2)
    close("rms_norm dweight", dw, wl.grad, 1e-2)
    fb, bb = 2 * BT * H * 2 / 1e9, 3 * BT * H * 2 / 1e9
    ours = row("rms_norm fwd", "kcpp", lambda: layer.forward(fwd_args, mode="inference"), fb)
    theirs = row("rms_norm fwd", "liger", liger, fb, no_grad=True)
    versus("rms_norm fwd", ours, theirs)

    def ours_fwbw():
        layer.forward(fwd_args)
        layer.backward(bwd_args)

    def liger_fwbw():
        xl.grad = wl.grad = None
        liger().backward(dy)

    ours = row("rms_norm fwd+bwd", "kcpp", ours_fwbw, fb + bb)
    theirs = row("rms_norm fwd+bwd", "liger", liger_fwbw, fb + bb)
    versus("rms_norm fwd+bwd", ours, theirs)


def add_rms_norm(pkg):
    from liger_kernel.ops.fused_add_rms_norm import LigerFusedAddRMSNormFunction
    layer = pkg.layer("LigerAddRMSNorm")
    x, res = torch.randn(BT, H, dtype=bf16, device=dev), torch.randn(BT, H, dtype=bf16, device=dev)
    w = torch.randn(H, dtype=bf16, device=dev)
    dy, dr = torch.randn_like(x), torch.randn_like(x)
    y, r, rstd = torch.empty_like(x), torch.empty_like(x), torch.empty(BT, device=dev)
    dx, dw = torch.empty_like(x), torch.empty_like(w)
    fwd_args = {"x": x, "residual": res, "weight": w, "eps": 1e-6, "y": y, "residual_out": r, "rstd": rstd}
    bwd_args = {"dy": dy, "dresidual_out": dr, "residual_out": r, "weight": w, "rstd": rstd, "eps": 1e-6,
                "dx": dx, "dweight": dw}
    xl, rl, wl = (t.clone().requires_grad_(True) for t in (x, res, w))
    liger = lambda: LigerFusedAddRMSNormFunction.apply(xl, rl, wl, 1e-6, 0.0, "llama", False)
    layer.forward(fwd_args)
    layer.backward(bwd_args)
    yl, sl = liger()
    torch.autograd.backward((yl, sl), (dy, dr))
    close("add_rms_norm y", y, yl, 1e-2)
    close("add_rms_norm r", r, sl, 1e-2)
    close("add_rms_norm dx", dx, xl.grad, 1e-2)
    close("add_rms_norm dweight", dw, wl.grad, 1e-2)
    unit = BT * H * 2 / 1e9  # forward: read x, residual; write r, y. backward: read dy, dr, r; write dx
    ours = row("add_rms_norm fwd", "kcpp", lambda: layer.forward(fwd_args, mode="inference"), 4 * unit)
    theirs = row("add_rms_norm fwd", "liger", liger, 4 * unit, no_grad=True)
    versus("add_rms_norm fwd", ours, theirs)

    def ours_fwbw():
        layer.forward(fwd_args)
        layer.backward(bwd_args)

    def liger_fwbw():
        xl.grad = rl.grad = wl.grad = None
        torch.autograd.backward(liger(), (dy, dr))

    ours = row("add_rms_norm fwd+bwd", "kcpp", ours_fwbw, 8 * unit)
    theirs = row("add_rms_norm fwd+bwd", "liger", liger_fwbw, 8 * unit)
    versus("add_rms_norm fwd+bwd", ours, theirs)


def layer_norm(pkg):
    from liger_kernel.ops.layer_norm import LigerLayerNormFunction
    layer = pkg.layer("LigerLayerNorm")
    x = torch.randn(BT, H, dtype=bf16, device=dev)
    w, b = torch.randn(H, dtype=bf16, device=dev), torch.randn(H, dtype=bf16, device=dev)
    dy = torch.randn_like(x)
    y, mean, rstd = torch.empty_like(x), torch.empty(BT, device=dev), torch.empty(BT, device=dev)
    dx, dw, db = torch.empty_like(x), torch.empty_like(w), torch.empty_like(b)
    fwd_args = {"x": x, "weight": w, "bias": b, "eps": 1e-5, "y": y, "mean": mean, "rstd": rstd}
    bwd_args = {"dy": dy, "x": x, "weight": w, "mean": mean, "rstd": rstd, "eps": 1e-5, "dx": dx,
                "dweight": dw, "dbias": db}
    xl, wl, bl = (t.clone().requires_grad_(True) for t in (x, w, b))
    liger = lambda: LigerLayerNormFunction.apply(xl, wl, bl, 1e-5)
    layer.forward(fwd_args)
    layer.backward(bwd_args)
    yl = liger()
    yl.backward(dy)
    close("layer_norm y", y, yl, 1e-2)
    close("layer_norm dx", dx, xl.grad, 1e-2)
    close("layer_norm dweight", dw, wl.grad, 1e-2)
    close("layer_norm dbias", db, bl.grad, 1e-2)
    fb, bb = 2 * BT * H * 2 / 1e9, 3 * BT * H * 2 / 1e9
    ours = row("layer_norm fwd", "kcpp", lambda: layer.forward(fwd_args, mode="inference"), fb)
    theirs = row("layer_norm fwd", "liger", liger, fb, no_grad=True)
    versus("layer_norm fwd", ours, theirs)

    def ours_fwbw():
        layer.forward(fwd_args)
        layer.backward(bwd_args)

    def liger_fwbw():
        xl.grad = wl.grad = bl.grad = None
        liger().backward(dy)

    ours = row("layer_norm fwd+bwd", "kcpp", ours_fwbw, fb + bb)
    theirs = row("layer_norm fwd+bwd", "liger", liger_fwbw, fb + bb)
    versus("layer_norm fwd+bwd", ours, theirs)


def swiglu(pkg):
    from liger_kernel.ops.swiglu import LigerSiLUMulFunction
    layer = pkg.layer("LigerGLU")
    a, b = torch.randn(BT, I, dtype=bf16, device=dev), torch.randn(BT, I, dtype=bf16, device=dev)
    dc = torch.randn_like(a)
    out, da, db = torch.empty_like(a), torch.empty_like(a), torch.empty_like(b)
    fwd_args = {"gate": a, "up": b, "activation": "silu", "out": out}
    bwd_args = {"dout": dc, "gate": a, "up": b, "activation": "silu", "dgate": da, "dup": db}
    al, bl = a.clone().requires_grad_(True), b.clone().requires_grad_(True)
    layer.forward(fwd_args)
    layer.backward(bwd_args)
    cl = LigerSiLUMulFunction.apply(al, bl)
    cl.backward(dc)
    close("swiglu out", out, cl, 1e-2)
    close("swiglu dgate", da, al.grad, 1e-2)
    close("swiglu dup", db, bl.grad, 1e-2)
    unit = BT * I * 2 / 1e9
    ours = row("swiglu fwd", "kcpp", lambda: layer.forward(fwd_args, mode="inference"), 3 * unit)
    theirs = row("swiglu fwd", "liger", lambda: LigerSiLUMulFunction.apply(al, bl), 3 * unit, no_grad=True)
    versus("swiglu fwd", ours, theirs)

    def ours_fwbw():
        layer.forward(fwd_args)
        layer.backward(bwd_args)

    def liger_fwbw():
        al.grad = bl.grad = None
        LigerSiLUMulFunction.apply(al, bl).backward(dc)

    ours = row("swiglu fwd+bwd", "kcpp", ours_fwbw, 8 * unit)
    theirs = row("swiglu fwd+bwd", "liger", liger_fwbw, 8 * unit)
    versus("swiglu fwd+bwd", ours, theirs)


def rope(pkg):
    from liger_kernel.ops.rope import LigerRopeFunction
    layer = pkg.layer("LigerRotaryEmbedding")
    B, S, NH, NKV, D = BT // 2048, 2048, 32, 8, 128
    q = torch.randn(B, NH, S, D, dtype=bf16, device=dev)
    k = torch.randn(B, NKV, S, D, dtype=bf16, device=dev)
    inv = 1.0 / (500000 ** (torch.arange(0, D, 2, device=dev).float() / D))
    emb = torch.cat([torch.outer(torch.arange(S, device=dev).float(), inv)] * 2, -1)
    cos, sin = emb.cos()[None].to(bf16), emb.sin()[None].to(bf16)
    dq, dk = torch.randn_like(q), torch.randn_like(k)
    qo, ko, dqi, dki = torch.empty_like(q), torch.empty_like(k), torch.empty_like(q), torch.empty_like(k)
    fwd_args = {"q": q, "k": k, "cos": cos, "sin": sin, "layout": "bhsd", "style": "rotate_half",
                "q_out": qo, "k_out": ko}
    bwd_args = {"dq_out": dq, "dk_out": dk, "cos": cos, "sin": sin, "layout": "bhsd", "style": "rotate_half",
                "dq": dqi, "dk": dki}
    ql, kl = q.clone().requires_grad_(True), k.clone().requires_grad_(True)
    layer.forward(fwd_args)
    layer.backward(bwd_args)
    oq, ok = LigerRopeFunction.apply(ql, kl, cos, sin)
    torch.autograd.backward([oq, ok], [dq, dk])
    close("rope q_out", qo, oq, 1e-2)
    close("rope k_out", ko, ok, 1e-2)
    close("rope dq", dqi, ql.grad, 1e-2)
    close("rope dk", dki, kl.grad, 1e-2)
    nbytes = 2 * (q.numel() + k.numel()) * 2 / 1e9
    ours = row("rope fwd", "kcpp", lambda: layer.forward(fwd_args, mode="inference"), nbytes)
    theirs = row("rope fwd", "liger", lambda: LigerRopeFunction.apply(ql, kl, cos, sin), nbytes, no_grad=True)
    versus("rope fwd", ours, theirs)

    def ours_fwbw():
        layer.forward(fwd_args)
        layer.backward(bwd_args)

    def liger_fwbw():
        ql.grad = kl.grad = None
        a, b = LigerRopeFunction.apply(ql, kl, cos, sin)
        torch.autograd.backward([a, b], [dq, dk])

    ours = row("rope fwd+bwd", "kcpp", ours_fwbw, 2 * nbytes)
    theirs = row("rope fwd+bwd", "liger", liger_fwbw, 2 * nbytes)
    versus("rope fwd+bwd", ours, theirs)


def ce(pkg):
    from liger_kernel.ops.cross_entropy import LigerCrossEntropyFunction
    layer = pkg.layer("LigerCrossEntropy")
    n = BT // 2
    logits = torch.randn(n, V, dtype=bf16, device=dev)
    tgt = torch.randint(0, V, (n,), device=dev)
    loss, grad = torch.empty(1, device=dev), torch.empty_like(logits)
    fwd_args = {"logits": logits, "targets": tgt, "reduction": "mean", "loss": loss, "grad": grad}
    bwd_args = {"dloss": 1.0, "grad": grad, "dlogits": grad}  # dloss 1 into grad itself: nothing to do
    ll = logits.clone().requires_grad_(True)
    liger = lambda: LigerCrossEntropyFunction.apply(ll, tgt, None, -100, 0.0, 0.0, "mean", None, False)[0]
    layer.forward(fwd_args)
    layer.backward(bwd_args)
    lossl = liger()
    lossl.backward()
    exact = torch.nn.functional.cross_entropy(logits.double(), tgt)  # Liger returns the loss in bf16
    print(f"{'ce loss':20s} kcpp {loss.item():.6f}, liger {lossl.item():.6f} (bf16), f64 {exact.item():.6f}")
    close("ce loss vs f64", loss.double(), exact.reshape(1), 1e-6)
    close("ce dlogits", grad, ll.grad, 1e-2)

    def ours_fwbw():
        layer.forward(fwd_args)
        layer.backward(bwd_args)

    def liger_fwbw():
        ll.grad = None
        liger().backward()

    gb = 2 * n * V * 2 / 1e9
    ours = row("ce fwd+bwd", "kcpp", ours_fwbw, gb)
    theirs = row("ce fwd+bwd", "liger", liger_fwbw, gb)
    versus("ce fwd+bwd", ours, theirs)


def main():
    ops = {"rms_norm": rms_norm, "add_rms_norm": add_rms_norm, "layer_norm": layer_norm, "swiglu": swiglu, "rope": rope, "ce": ce}
    wanted = sys.argv[1:] or list(ops)
    unknown = [o for o in wanted if o not in ops]
    if unknown:
        sys.exit(f"unknown op(s) {unknown}; choose from {list(ops)}")
    torch.manual_seed(0)
    pkg = package()
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, {pkg}",
          flush=True)
    copy_ceiling()
    for name in wanted:
        try:
            ops[name](pkg)
        except Exception as e:  # one op's failure must not hide the others' figures
            print(f"!! {name}: {type(e).__name__}: {e}", flush=True)


if __name__ == "__main__":
    main()
