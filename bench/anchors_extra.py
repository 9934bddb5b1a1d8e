"""Anchors beyond anchors.py (which covers RMSNorm, SwiGLU, RoPE, cross-entropy and Liger): PyTorch
eager and torch.compile at the shapes of bench_kernels.cpp for LayerNorm and AddRMSNorm ([8192, 4096])
and the activation package (silu_and_mul: x [8192, 2 x 14336] -> silu(x[:, :d]) * x[:, d:];
gelu_tanh: [8192, 14336]), bf16 on the GPU.  Forward, and forward + backward through autograd with a
given upstream gradient; bytes counted as bench_kernels.cpp counts them; peak = allocator peak
during the call minus memory before it.  Run: python3 bench/anchors_extra.py
"""
import torch
import torch.nn.functional as F
import triton

N, I = 8192, 14336
UNIT = N * I * 2 / 1e9


def bench(fn):
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


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
        ms = bench(lambda: f(x, res, w))
        print(f"{'add_rms_norm fwd':24s} {impl:10s} {ms:9.4f} ms {4 * unit / (ms / 1e3):8.0f} GB/s")
        xg, rg, wg = x.clone().requires_grad_(True), res.clone().requires_grad_(True), w.clone().requires_grad_(True)

        def fwbw():
            y, r = f(xg, rg, wg)
            torch.autograd.backward((y, r), (dy, dr))
            xg.grad = rg.grad = wg.grad = None

        fwbw()
        ms = bench(fwbw)
        print(f"{'add_rms_norm fwd+bwd':24s} {impl:10s} {ms:9.4f} ms {8 * unit / (ms / 1e3):8.0f} GB/s"
              f"  peak {peak(fwbw):8.1f} MiB")


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
        ms = bench(lambda: f(x, w, b))
        print(f"{'layer_norm fwd':24s} {impl:10s} {ms:9.4f} ms {2 * unit / (ms / 1e3):8.0f} GB/s")
        xg, wg, bg = x.clone().requires_grad_(True), w.clone().requires_grad_(True), b.clone().requires_grad_(True)

        def fwbw():
            f(xg, wg, bg).backward(dy)
            xg.grad = wg.grad = bg.grad = None

        fwbw()
        ms = bench(fwbw)
        print(f"{'layer_norm fwd+bwd':24s} {impl:10s} {ms:9.4f} ms {5 * unit / (ms / 1e3):8.0f} GB/s"
              f"  peak {peak(fwbw):8.1f} MiB")


def main():
    torch.manual_seed(0)
    bench_layer_norm()
    bench_add_rms_norm()
    for name, fn, xw, fb, bb in (("silu_and_mul", silu_and_mul, 2 * I, 3, 5), ("gelu_tanh", gelu_tanh, I, 2, 3)):
        for impl, f in (("eager", fn), ("compile", torch.compile(fn))):
            x = torch.randn(N, xw, dtype=torch.bfloat16, device="cuda")
            dy = torch.randn(N, I, dtype=torch.bfloat16, device="cuda")
            ms = bench(lambda: f(x))
            print(f"{name + ' fwd':24s} {impl:10s} {ms:9.4f} ms {fb * UNIT / (ms / 1e3):8.0f} GB/s")
            xg = x.clone().requires_grad_(True)

            def fwbw():
                f(xg).backward(dy)
                xg.grad = None

            fwbw()
            ms = bench(fwbw)
            print(f"{name + ' fwd+bwd':24s} {impl:10s} {ms:9.4f} ms {(fb + bb) * UNIT / (ms / 1e3):8.0f} GB/s"
                  f"  peak {peak(fwbw):8.1f} MiB")


if __name__ == "__main__":
    main()
