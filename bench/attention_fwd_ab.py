"""Two builds of flash_attn's forward side by side, forward only, in interleaved rounds: each round times
the first library, the second and cuDNN (SDPA) under deep_timer.bench_deep, in that order and then
reversed, six rounds; the figure is each one's median, with every round's time printed.  Causal bf16,
32 query / 8 kv heads.  For changes of a few percent: bench/attention_sm90.py times every row twice
in reversed orders, which still leaves a forward's figure varying by several percent with what ran
before it (bench/RESULTS.md, 2026-11-29, twenty-ninth session); interleaved rounds spread that over
both builds alike.

Run on the GPU machine: python3 bench/attention_fwd_ab.py NEW.so OLD.so BxSxD [BxSxD ...]
(NEW / OLD: libflash_attn.so of the CUDA variant, e.g. this build's and a copy of an earlier one).
"""
import math
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "python"))
sys.path.insert(0, HERE)

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import kcpp
from deep_timer import bench_deep

HQ, HKV, ROUNDS = 32, 8, 6

if len(sys.argv) < 4:
    sys.exit(__doc__)
os.environ["KCPP_FLASH_ATTN_FORWARD"] = "hopper"
new, old = (kcpp.Package(p).layer("FlashAttention") for p in sys.argv[1:3])
for shape in sys.argv[3:]:
    B, S, D = (int(x) for x in shape.split("x"))
    torch.manual_seed(0)
    q = torch.randn(B, HQ, S, D, dtype=torch.bfloat16, device="cuda")
    k = torch.randn(B, HKV, S, D, dtype=torch.bfloat16, device="cuda")
    v = torch.randn(B, HKV, S, D, dtype=torch.bfloat16, device="cuda")
    out, lse = torch.empty_like(q), torch.empty(B, HQ, S, dtype=torch.float32, device="cuda")
    args = {"q": q, "k": k, "v": v, "out": out, "lse": lse, "scale": 1 / math.sqrt(D), "causal": 1}
    tflop = 4 * B * HQ * S * S * D / 2 / 1e12  # the causal half

    def cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION), torch.no_grad():
            F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    fns = {"new": lambda: new.forward(args), "old": lambda: old.forward(args), "cudnn": cudnn}
    times = {name: [] for name in fns}
    for r in range(ROUNDS):
        for name in (list(fns) if r % 2 == 0 else list(reversed(fns))):
            times[name].append(bench_deep(fns[name]))
    med = {name: statistics.median(t) for name, t in times.items()}
    figures = ", ".join(f"{name} {med[name]:.4f} ms ({tflop / med[name] * 1e3:.1f} TFLOP/s)" for name in fns)
    print(f"B{B} S{S} D{D} forward, medians: {figures}; new / old speed {med['old'] / med['new']:.3f}", flush=True)
    for name, t in times.items():
        print(f"  {name} rounds: {' '.join(f'{x:.4f}' for x in t)}", flush=True)
