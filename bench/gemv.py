"""The decode projections' peer: PyTorch's F.linear (cuBLAS) with a few rows, at the shapes of
kcpp_bench_kernels --only gemv (Qwen3-0.6B and Llama-3.2-1B, bf16).

  python3 bench/gemv.py

Traffic is the weight read once; GB/s and the share of the copy rate measured here are printed as
kcpp_bench_kernels prints them.  Both run in one device call so that the ratios hold.
"""
import torch
import torch.nn.functional as F

from decode_attention import copy_rate, timed

SHAPES = [(1, 4096, 1024, "qwen3 qkv"), (1, 1024, 2048, "qwen3 o"), (1, 6144, 1024, "qwen3 gate_up"),
          (1, 1024, 3072, "qwen3 down"), (1, 151936, 1024, "qwen3 lm_head"), (1, 3072, 2048, "llama qkv"),
          (1, 16384, 2048, "llama gate_up"), (1, 2048, 8192, "llama down"), (8, 6144, 1024, "qwen3 gate_up"),
          (8, 16384, 2048, "llama gate_up")]


def main():
    copy = copy_rate()
    for m, n, k, what in SHAPES:
        a = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
        w = torch.randn(n, k, dtype=torch.bfloat16, device="cuda")
        ms = timed(lambda: F.linear(a, w))
        gbps = 2 * n * k / (ms * 1e-3) / 1e9
        name = f"gemv m{m} {n}x{k} {what}"
        print(f"{name:34s} torch-cublas {ms:9.4f} ms {gbps:8.0f} GB/s {100 * gbps / copy:5.1f}% of copy", flush=True)


if __name__ == "__main__":
    main()
