"""kcpp's kernels and Liger-Kernel's under one timer, in one process: both called from PyTorch (ours
through the C ABI with python/kcpp.py, the built `liger` package's CUDA variant), both timed by
do_bench's method with a deeper flush (`bench_deep`: the host's time per call hidden; do_bench's own
figure and the host time printed beside it), at anchors.py's shapes (Llama-3-8B: 8192 tokens,
hidden 4096, intermediate 14336, vocab 128256, bf16) and byte counts.  Each op's result is compared with Liger's before it is timed.

Forward + backward: Liger through autograd (as anchors.py), ours as the two ABI calls a host makes;
our outputs are allocated once outside the timed call (a host's allocator would hand the same
blocks back), Liger's inside.  The copy ceiling is measured the same way (2 GiB device copy).

Run on the GPU machine: KCPP_PACKAGES_DIR=.devlibs/kernels python3 bench/anchors_kcpp.py [ops...]
with Liger-Kernel's source (its src/liger_kernel folder) under the git-ignored .anchors/src, or where
LIGER_SRC points: it is for measuring only, never committed.  ops: rms_norm add_rms_norm
layer_norm swiglu geglu rope ce (default all).
"""
import contextlib
import glob
import os
import sys

import torch
import triton

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "python"))
sys.path.insert(0, os.environ.get("LIGER_SRC", os.path.join(HERE, "..", ".anchors", "src")))
import kcpp  # noqa: E402
from deep_timer import bench_deep, host_us  # noqa: E402

BT, H, I, V = 8192, 4096, 14336, 128256
dev = "cuda"
bf16 = torch.bfloat16


def bench(fn):
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


COPY_GBPS = None


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


def race(op, layer, fwd_args, bwd_args, liger_fwd, liger_fwbw, gb_fwd, gb_fwbw, checks):
    """Runs ours (forward, backward) and Liger's once, compares the pairs in `checks` (name, ours,
    Liger's result as a function, tolerance), then times the forward (if gb_fwd) and forward +
    backward of both.  liger_fwbw clears Liger's gradients and runs its forward and backward."""
    layer.forward(fwd_args)
    layer.backward(bwd_args)
    liger_fwbw()
    for name, ours, theirs, tol in checks:
        close(f"{op} {name}", ours, theirs(), tol)
    if gb_fwd:
        ours = row(f"{op} fwd", "kcpp", lambda: layer.forward(fwd_args, mode="inference"), gb_fwd)
        theirs = row(f"{op} fwd", "liger", liger_fwd, gb_fwd, no_grad=True)
        versus(f"{op} fwd", ours, theirs)

    def ours_fwbw():
        layer.forward(fwd_args)
        layer.backward(bwd_args)

    ours = row(f"{op} fwd+bwd", "kcpp", ours_fwbw, gb_fwbw)
    theirs = row(f"{op} fwd+bwd", "liger", liger_fwbw, gb_fwbw)
    versus(f"{op} fwd+bwd", ours, theirs)


def leaves(*tensors):
    return [t.clone().requires_grad_(True) for t in tensors]


def clear(*tensors):
    for t in tensors:
        t.grad = None


def rms_norm(pkg):
    from liger_kernel.ops.rms_norm import LigerRMSNormFunction
    x, dy = torch.randn(BT, H, dtype=bf16, device=dev), torch.randn(BT, H, dtype=bf16, device=dev)
    w = torch.randn(H, dtype=bf16, device=dev)
    y, rstd, dx, dw = torch.empty_like(x), torch.empty(BT, device=dev), torch.empty_like(x), torch.empty_like(w)
    xl, wl = leaves(x, w)
    out = {}
    liger = lambda: LigerRMSNormFunction.apply(xl, wl, 1e-6, 0.0, "llama", False)

    def liger_fwbw():
        clear(xl, wl)
        out["y"] = liger()
        out["y"].backward(dy)

    unit = BT * H * 2 / 1e9  # forward: read x, write y; backward: read dy, x, write dx
    race("rms_norm", pkg.layer("LigerRMSNorm"), {"x": x, "weight": w, "eps": 1e-6, "y": y, "rstd": rstd},
         {"dy": dy, "x": x, "weight": w, "rstd": rstd, "eps": 1e-6, "dx": dx, "dweight": dw},
         liger, liger_fwbw, 2 * unit, 5 * unit,
         [("y", y, lambda: out["y"], 1e-2), ("dx", dx, lambda: xl.grad, 1e-2), ("dweight", dw, lambda: wl.grad, 1e-2)])


def add_rms_norm(pkg):
    from liger_kernel.ops.fused_add_rms_norm import LigerFusedAddRMSNormFunction
    x, res, dy, dr = (torch.randn(BT, H, dtype=bf16, device=dev) for _ in range(4))
    w = torch.randn(H, dtype=bf16, device=dev)
    y, r, rstd = torch.empty_like(x), torch.empty_like(x), torch.empty(BT, device=dev)
    dx, dw = torch.empty_like(x), torch.empty_like(w)
    xl, rl, wl = leaves(x, res, w)
    out = {}
    liger = lambda: LigerFusedAddRMSNormFunction.apply(xl, rl, wl, 1e-6, 0.0, "llama", False)

    def liger_fwbw():
        clear(xl, rl, wl)
        out["y"], out["r"] = liger()
        torch.autograd.backward((out["y"], out["r"]), (dy, dr))

    unit = BT * H * 2 / 1e9  # forward: read x, residual; write r, y. backward: read dy, dr, r; write dx
    race("add_rms_norm", pkg.layer("LigerAddRMSNorm"),
         {"x": x, "residual": res, "weight": w, "eps": 1e-6, "y": y, "residual_out": r, "rstd": rstd},
         {"dy": dy, "dresidual_out": dr, "residual_out": r, "weight": w, "rstd": rstd, "eps": 1e-6, "dx": dx,
          "dweight": dw},
         liger, liger_fwbw, 4 * unit, 8 * unit,
         [("y", y, lambda: out["y"], 1e-2), ("r", r, lambda: out["r"], 1e-2), ("dx", dx, lambda: xl.grad, 1e-2),
          ("dweight", dw, lambda: wl.grad, 1e-2)])


def layer_norm(pkg):
    from liger_kernel.ops.layer_norm import LigerLayerNormFunction
    x, dy = torch.randn(BT, H, dtype=bf16, device=dev), torch.randn(BT, H, dtype=bf16, device=dev)
    w, b = torch.randn(H, dtype=bf16, device=dev), torch.randn(H, dtype=bf16, device=dev)
    y, mean, rstd = torch.empty_like(x), torch.empty(BT, device=dev), torch.empty(BT, device=dev)
    dx, dw, db = torch.empty_like(x), torch.empty_like(w), torch.empty_like(b)
    xl, wl, bl = leaves(x, w, b)
    out = {}
    liger = lambda: LigerLayerNormFunction.apply(xl, wl, bl, 1e-5)

    def liger_fwbw():
        clear(xl, wl, bl)
        out["y"] = liger()
        out["y"].backward(dy)

    unit = BT * H * 2 / 1e9  # as RMSNorm: forward 2 units, backward 3
    race("layer_norm", pkg.layer("LigerLayerNorm"),
         {"x": x, "weight": w, "bias": b, "eps": 1e-5, "y": y, "mean": mean, "rstd": rstd},
         {"dy": dy, "x": x, "weight": w, "mean": mean, "rstd": rstd, "eps": 1e-5, "dx": dx, "dweight": dw, "dbias": db},
         liger, liger_fwbw, 2 * unit, 5 * unit,
         [("y", y, lambda: out["y"], 1e-2), ("dx", dx, lambda: xl.grad, 1e-2), ("dweight", dw, lambda: wl.grad, 1e-2),
          ("dbias", db, lambda: bl.grad, 1e-2)])


def swiglu(pkg, activation="silu"):
    """SwiGLU against Liger's LigerSiLUMulFunction, or with activation="gelu_tanh" GeGLU against its
    LigerGELUMulFunction (tanh GELU, Liger's only form)."""
    from liger_kernel.ops.geglu import LigerGELUMulFunction
    from liger_kernel.ops.swiglu import LigerSiLUMulFunction
    fn = LigerSiLUMulFunction if activation == "silu" else LigerGELUMulFunction
    op = "swiglu" if activation == "silu" else "geglu_tanh"
    a, b, dc = (torch.randn(BT, I, dtype=bf16, device=dev) for _ in range(3))
    c, da, db = torch.empty_like(a), torch.empty_like(a), torch.empty_like(b)
    al, bl = leaves(a, b)
    out = {}
    liger = lambda: fn.apply(al, bl)

    def liger_fwbw():
        clear(al, bl)
        out["c"] = liger()
        out["c"].backward(dc)

    unit = BT * I * 2 / 1e9  # forward: read a, b, write c; backward: read dc, a, b, write da, db
    race(op, pkg.layer("LigerGLU"), {"gate": a, "up": b, "activation": activation, "out": c},
         {"dout": dc, "gate": a, "up": b, "activation": activation, "dgate": da, "dup": db},
         liger, liger_fwbw, 3 * unit, 8 * unit,
         [("out", c, lambda: out["c"], 1e-2), ("dgate", da, lambda: al.grad, 1e-2), ("dup", db, lambda: bl.grad, 1e-2)])


def rope(pkg):
    from liger_kernel.ops.rope import LigerRopeFunction
    B, S, NH, NKV, D = BT // 2048, 2048, 32, 8, 128
    q, dq = (torch.randn(B, NH, S, D, dtype=bf16, device=dev) for _ in range(2))
    k, dk = (torch.randn(B, NKV, S, D, dtype=bf16, device=dev) for _ in range(2))
    inv = 1.0 / (500000 ** (torch.arange(0, D, 2, device=dev).float() / D))
    emb = torch.cat([torch.outer(torch.arange(S, device=dev).float(), inv)] * 2, -1)
    cos, sin = emb.cos()[None].to(bf16), emb.sin()[None].to(bf16)
    qo, ko, dqi, dki = torch.empty_like(q), torch.empty_like(k), torch.empty_like(q), torch.empty_like(k)
    ql, kl = leaves(q, k)
    out = {}
    liger = lambda: LigerRopeFunction.apply(ql, kl, cos, sin)

    def liger_fwbw():
        clear(ql, kl)
        out["q"], out["k"] = liger()
        torch.autograd.backward([out["q"], out["k"]], [dq, dk])

    gb = 2 * (q.numel() + k.numel()) * 2 / 1e9  # read q, k; write them rotated
    style = {"cos": cos, "sin": sin, "layout": "bhsd", "style": "rotate_half"}
    race("rope", pkg.layer("LigerRotaryEmbedding"), {"q": q, "k": k, **style, "q_out": qo, "k_out": ko},
         {"dq_out": dq, "dk_out": dk, **style, "dq": dqi, "dk": dki},
         liger, liger_fwbw, gb, 2 * gb,
         [("q_out", qo, lambda: out["q"], 1e-2), ("k_out", ko, lambda: out["k"], 1e-2),
          ("dq", dqi, lambda: ql.grad, 1e-2), ("dk", dki, lambda: kl.grad, 1e-2)])


def ce(pkg):
    from liger_kernel.ops.cross_entropy import LigerCrossEntropyFunction
    n = BT // 2
    logits = torch.randn(n, V, dtype=bf16, device=dev)
    tgt = torch.randint(0, V, (n,), device=dev)
    loss, grad = torch.empty(1, device=dev), torch.empty_like(logits)
    (ll,) = leaves(logits)
    out = {}

    def liger_fwbw():
        clear(ll)
        out["loss"] = LigerCrossEntropyFunction.apply(ll, tgt, None, -100, 0.0, 0.0, "mean", None, False)[0]
        out["loss"].backward()

    exact = torch.nn.functional.cross_entropy(logits.double(), tgt).reshape(1)  # Liger's loss is bf16
    # Forward + backward only (as anchors.py): read the logits once, write the gradient once; our
    # backward with dloss 1 into grad itself has nothing to do.
    race("ce", pkg.layer("LigerCrossEntropy"),
         {"logits": logits, "targets": tgt, "reduction": "mean", "loss": loss, "grad": grad},
         {"dloss": 1.0, "grad": grad, "dlogits": grad},
         None, liger_fwbw, None, 2 * n * V * 2 / 1e9,
         [("loss vs f64", loss, lambda: exact, 1e-6), ("dlogits", grad, lambda: ll.grad, 1e-2)])


def main():
    ops = {"rms_norm": rms_norm, "add_rms_norm": add_rms_norm, "layer_norm": layer_norm, "swiglu": swiglu,
           "geglu": lambda pkg: swiglu(pkg, "gelu_tanh"), "rope": rope, "ce": ce}
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
