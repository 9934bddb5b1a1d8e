"""PyTorch eager and torch.compile beside our kernels, bf16 on the GPU, at the shapes of
bench_kernels.cpp: LayerNorm and AddRMSNorm ([8192, 4096]), the activation package's kernels (gated:
x [8192, 2 x 14336] -> act(x[:, :d]) * x[:, d:]; plain: [8192, 14336]), GeGLU exact and tanh on
separate gate and up [8192, 14336], and, with `all` (or the section `anchors`), also
what anchors.py covers (RMSNorm [8192, 4096], SwiGLU [8192, 14336], RoPE q [4, 32, 2048, 128] and
k [4, 8, 2048, 128], cross-entropy [4096, 128256]) under this timer: anchors.py's do_bench figures
of torch.compile's forward + backward were host-bound on the lent machine.  Forward, and forward + backward through autograd with a
given upstream gradient; bytes counted as bench_kernels.cpp counts them; peak = allocator peak
during the call minus memory before it.  Timed with deep_timer.bench_deep (do_bench's method with an
8 GiB flush, so a slow host does not show in the figure); do_bench's own figure and the host time a
call are printed beside it.  Run: python3 bench/anchors_extra.py [all | sections...] (see main())
"""
import sys

import torch
import torch.nn.functional as F
import triton

from deep_timer import bench_deep, host_us

N, I = 8192, 14336
UNIT = N * I * 2 / 1e9


def bench(fn):
    """The deep-flush time in ms (the figure quoted) and a note with do_bench's and the host's."""
    ms = bench_deep(fn)
    ms_do_bench = triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
    return ms, f"(do_bench {ms_do_bench:7.4f} ms; host {host_us(fn):6.1f} us a call)"


def peak(fn):
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def silu_and_mul(x):
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]


def gelu_tanh(x):
    return F.gelu(x, approximate="tanh")


def gelu_and_mul(x, approximate):
    d = x.shape[-1] // 2
    return F.gelu(x[..., :d], approximate=approximate) * x[..., d:]


def quick_gelu(x):  # Transformers' QuickGELUActivation
    return x * torch.sigmoid(1.702 * x)


def add_rms_norm(x, res, w, eps=1e-6):
    r = x + res
    h = r.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return w * h.to(r.dtype), r


def bench_add_rms_norm():
    n, hdim = 8192, 4096
    unit = n * hdim * 2 / 1e9  # forward: read x, residual; write r, y. backward: read dy, dr, r; write dx
    for impl, f in (("eager", add_rms_norm), ("compile", torch.compile(add_rms_norm))):
        x = torch.randn(n, hdim, dtype=torch.bfloat16, device="cuda")
        res = torch.randn_like(x)
        w = torch.randn(hdim, dtype=torch.bfloat16, device="cuda")
        dy, dr = torch.randn_like(x), torch.randn_like(x)
        ms, note = bench(lambda: f(x, res, w))
        print(f"{'add_rms_norm fwd':24s} {impl:10s} {ms:9.4f} ms {4 * unit / (ms / 1e3):8.0f} GB/s  {note}")
        xg, rg, wg = x.clone().requires_grad_(True), res.clone().requires_grad_(True), w.clone().requires_grad_(True)

        def fwbw():
            y, r = f(xg, rg, wg)
            torch.autograd.backward((y, r), (dy, dr))
            xg.grad = rg.grad = wg.grad = None

        fwbw()
        ms, note = bench(fwbw)
        print(f"{'add_rms_norm fwd+bwd':24s} {impl:10s} {ms:9.4f} ms {8 * unit / (ms / 1e3):8.0f} GB/s"
              f"  peak {peak(fwbw):8.1f} MiB  {note}")


def bench_layer_norm():
    n, hdim = 8192, 4096
    unit = n * hdim * 2 / 1e9  # as RMSNorm: forward 2 units, backward 3

    def ln(x, w, b):
        return F.layer_norm(x, (hdim,), w, b, 1e-5)

    for impl, f in (("eager", ln), ("compile", torch.compile(ln))):
        x = torch.randn(n, hdim, dtype=torch.bfloat16, device="cuda")
        w = torch.randn(hdim, dtype=torch.bfloat16, device="cuda")
        b = torch.randn(hdim, dtype=torch.bfloat16, device="cuda")
        dy = torch.randn_like(x)
        ms, note = bench(lambda: f(x, w, b))
        print(f"{'layer_norm fwd':24s} {impl:10s} {ms:9.4f} ms {2 * unit / (ms / 1e3):8.0f} GB/s  {note}")
        xg, wg, bg = x.clone().requires_grad_(True), w.clone().requires_grad_(True), b.clone().requires_grad_(True)

        def fwbw():
            f(xg, wg, bg).backward(dy)
            xg.grad = wg.grad = bg.grad = None

        fwbw()
        ms, note = bench(fwbw)
        print(f"{'layer_norm fwd+bwd':24s} {impl:10s} {ms:9.4f} ms {5 * unit / (ms / 1e3):8.0f} GB/s"
              f"  peak {peak(fwbw):8.1f} MiB  {note}")


def fwd_and_fwbw(name, impl, f, inputs, grads, upstream, fwd_gb, fwbw_gb):
    """Times f(*inputs) and its forward + backward (autograd, `upstream` given) and prints both."""
    ms, note = bench(lambda: f(*inputs))
    print(f"{name + ' fwd':24s} {impl:10s} {ms:9.4f} ms {fwd_gb / (ms / 1e3):8.0f} GB/s  {note}")
    leaves = [t.clone().requires_grad_(True) if g else t for t, g in zip(inputs, grads)]

    def fwbw():
        f(*leaves).backward(upstream)
        for t in leaves:
            t.grad = None

    fwbw()
    ms, note = bench(fwbw)
    print(f"{name + ' fwd+bwd':24s} {impl:10s} {ms:9.4f} ms {fwbw_gb / (ms / 1e3):8.0f} GB/s"
          f"  peak {peak(fwbw):8.1f} MiB  {note}")


def rms_norm(x, w, eps=1e-6):  # Llama's: the statistics in f32, the product in the input's dtype
    h = x.float()
    return w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def swiglu(a, b):
    return F.silu(a) * b


def rope(q, k, cos, sin):  # rotate-half (Llama / NeoX), q and k [b, heads, s, d], cos / sin [1, 1, s, d]
    def rot(t):
        h = t.shape[-1] // 2
        return torch.cat((-t[..., h:], t[..., :h]), dim=-1)
    return torch.cat(((q * cos + rot(q) * sin).flatten(), (k * cos + rot(k) * sin).flatten()))


def cross_entropy(logits, target):
    return F.cross_entropy(logits.float(), target)


def bench_anchors_ops():
    bf = dict(dtype=torch.bfloat16, device="cuda")
    unit = 8192 * 4096 * 2 / 1e9
    x, w = torch.randn(8192, 4096, **bf), torch.randn(4096, **bf)
    for impl, f in (("eager", rms_norm), ("compile", torch.compile(rms_norm))):
        fwd_and_fwbw("rms_norm", impl, f, (x, w), (True, True), torch.randn_like(x), 2 * unit, 5 * unit)
    a, b = torch.randn(N, I, **bf), torch.randn(N, I, **bf)
    for impl, f in (("eager", swiglu), ("compile", torch.compile(swiglu))):
        fwd_and_fwbw("swiglu", impl, f, (a, b), (True, True), torch.randn_like(a), 3 * UNIT, 8 * UNIT)
    del a, b
    q, k = torch.randn(4, 32, 2048, 128, **bf), torch.randn(4, 8, 2048, 128, **bf)
    ang = torch.randn(1, 1, 2048, 128, device="cuda")
    cos, sin = ang.cos().to(torch.bfloat16), ang.sin().to(torch.bfloat16)
    qk = (q.numel() + k.numel()) * 2 / 1e9  # bytes as anchors.py counts them: q and k read and written
    up = torch.randn(q.numel() + k.numel(), **bf)
    for impl, f in (("eager", rope), ("compile", torch.compile(rope))):
        fwd_and_fwbw("rope", impl, f, (q, k, cos, sin), (True, True, False, False), up, 2 * qk, 4 * qk)
    del q, k
    logits = torch.randn(4096, 128256, **bf)
    tgt = torch.randint(0, 128256, (4096,), device="cuda")
    lb = logits.numel() * 2 / 1e9  # forward + backward: read the logits once, write the gradient once
    for impl, f in (("eager", cross_entropy), ("compile", torch.compile(cross_entropy))):
        fwd_and_fwbw("ce", impl, f, (logits, tgt), (True, False), torch.ones((), device="cuda"), lb, 2 * lb)


ACTIVATIONS = {  # name: (function of x, width of x in units of I, forward units, backward units)
    "silu_and_mul": (silu_and_mul, 2, 3, 5),
    "gelu_and_mul": (lambda x: gelu_and_mul(x, "none"), 2, 3, 5),
    "gelu_tanh_and_mul": (lambda x: gelu_and_mul(x, "tanh"), 2, 3, 5),
    "silu": (F.silu, 1, 2, 3),
    "gelu": (F.gelu, 1, 2, 3),
    "gelu_tanh": (gelu_tanh, 1, 2, 3),
    "quick_gelu": (quick_gelu, 1, 2, 3),
}


def bench_activations(names):
    """The activation package's kernels (FastGELU and NewGELU are gelu_tanh): x [N, I] or, gated,
    [N, 2 I] -> [N, I]; forward reads x and writes y, backward reads dy and x and writes dx."""
    for name in names:
        fn, xw, fb, bb = ACTIVATIONS[name]
        for impl, f in (("eager", fn), ("compile", torch.compile(fn))):
            x = torch.randn(N, xw * I, dtype=torch.bfloat16, device="cuda")
            dy = torch.randn(N, I, dtype=torch.bfloat16, device="cuda")
            fwd_and_fwbw(name, impl, f, (x,), (True,), dy, fb * UNIT, (fb + bb) * UNIT)
            del x, dy


def bench_geglu():
    """GeGLU on separate gate and up [N, I] (Liger's layout): forward 3 units, forward + backward 8."""
    bf = dict(dtype=torch.bfloat16, device="cuda")
    a, b = torch.randn(N, I, **bf), torch.randn(N, I, **bf)
    for name, approx in (("geglu", "none"), ("geglu_tanh", "tanh")):
        fn = lambda g, u, approx=approx: F.gelu(g, approximate=approx) * u  # noqa: E731
        for impl, f in (("eager", fn), ("compile", torch.compile(fn))):
            fwd_and_fwbw(name, impl, f, (a, b), (True, True), torch.randn_like(a), 3 * UNIT, 8 * UNIT)


SECTIONS = ("anchors", "layer_norm", "add_rms_norm", "activations", "geglu")


def main():
    """Sections (arguments): anchors layer_norm add_rms_norm activations geglu; `all` runs every one;
    no argument runs all but anchors.  `activations=silu,gelu` runs those activations only."""
    torch.manual_seed(0)
    args = sys.argv[1:]
    acts = list(ACTIVATIONS)
    for a in args:
        if a.startswith("activations="):
            acts = a.split("=", 1)[1].split(",")
    names = [a.split("=", 1)[0] for a in args]
    wanted = set(SECTIONS) if "all" in names else set(names) if names else set(SECTIONS) - {"anchors"}
    unknown = wanted - set(SECTIONS) or set(acts) - set(ACTIVATIONS)
    if unknown:
        sys.exit(f"unknown section(s) {sorted(unknown)}; choose from {SECTIONS} and activations {list(ACTIVATIONS)}")
    if "anchors" in wanted:
        bench_anchors_ops()
    if "layer_norm" in wanted:
        bench_layer_norm()
    if "add_rms_norm" in wanted:
        bench_add_rms_norm()
    if "activations" in wanted:
        bench_activations(acts)
    if "geglu" in wanted:
        bench_geglu()


if __name__ == "__main__":
    main()
