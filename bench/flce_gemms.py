"""The GEMMs of fused linear cross-entropy's chunks, one by one, against the same GEMMs unchunked:
where the fused loss's time above its three GEMMs goes (issue 23: within 1.05x of them).

Shapes: hidden X [N, H], weight W [V, H], the loss gradient G [N, V] (bf16), at the Llama-3-8B head
(N 8192, H 4096, V 128256) and chunks of C rows:
  logits  L_c = X_c W^T        [C, V],  K = H
  dX      dX_c = G_c W         [C, H],  K = V
  dW      dW += G_c^T X_c      [V, H],  K = C   (beta 1: dW read and written every chunk)
each timed alone (torch's cuBLAS / cuBLASLt, CUDA events, median of 20), summed over the N / C chunks,
beside the unchunked three (C = N, dW with beta 0).  Run on the GPU machine: python3 bench/flce_gemms.py
"""
import torch

N, H, V = 8192, 4096, 128256


def timed(fn, reps=20):
    for _ in range(3):
        fn()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b))
    return sorted(ts)[len(ts) // 2]


def main():
    torch.manual_seed(0)
    dt = torch.bfloat16
    X = torch.randn(N, H, device="cuda", dtype=dt)
    W = torch.randn(V, H, device="cuda", dtype=dt) * 0.02
    dW = torch.zeros(V, H, device="cuda", dtype=dt)
    print(f"{torch.cuda.get_device_name()}: N {N}, H {H}, V {V}, bf16")
    for C in (N, 4096, 2048, 1024, 512):
        G = torch.randn(C, V, device="cuda", dtype=dt) * 1e-3
        Xc = X[:C]
        L = torch.empty(C, V, device="cuda", dtype=dt)
        dX = torch.empty(C, H, device="cuda", dtype=dt)
        t_l = timed(lambda: torch.mm(Xc, W.t(), out=L))
        t_x = timed(lambda: torch.mm(G, W, out=dX))
        t_w1 = timed(lambda: dW.addmm_(G.t(), Xc))
        t_w0 = timed(lambda: torch.mm(G.t(), Xc, out=dW))
        k = N // C
        fl = 2.0 * C * V * H
        tot = k * (t_l + t_x + t_w1)
        print(f"C {C:5d} x{k:<2d} | logits {t_l:7.3f} ms ({fl / t_l / 1e9:5.0f} TFLOP/s) | dX {t_x:7.3f} ({fl / t_x / 1e9:5.0f}) "
              f"| dW beta1 {t_w1:7.3f} ({fl / t_w1 / 1e9:5.0f}) beta0 {t_w0:7.3f} ({fl / t_w0 / 1e9:5.0f}) "
              f"| sum over chunks {tot:7.2f} ms", flush=True)
        del G, L, dX
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
