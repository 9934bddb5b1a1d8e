"""flash_attn's forward + backward in variants side by side with cuDNN (SDPA), in interleaved rounds:
each round times every variant and cuDNN under deep_timer.bench_deep, in order and then reversed, six
rounds; the figure is each one's median, with every round's time printed.  Causal bf16, 32 query / 8 kv
heads.  A variant is a library and the KCPP_* settings its calls run under, so that two builds, or two
settings of one build, are timed in one process; gradients are checked against cuDNN's first.  For
changes of a few percent (bench/attention_fwd_ab.py does the same for the forward alone).

Run on the GPU machine:
  python3 bench/attention_bwd_ab.py LIB NAME[@LIB2][:VAR=VALUE[,VAR=VALUE...]] ... -- BxSxD [BxSxD ...] [--fwd]
e.g. python3 bench/attention_bwd_ab.py NEW.so new old@OLD.so heads:KCPP_FLASH_ATTN_SM90_BWD_ORDER=heads -- 2x8192x64
(LIB: libflash_attn.so of the CUDA variant; a variant's @LIB2 names another library for it.)
TFLOP/s count the causal half, forward + backward 3.5 times the forward's 4 B H S^2 D / 2.  --fwd also
times each one's forward alone in the same rounds and prints the backward alone (the medians' difference,
2.5 times the forward's FLOP).
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
from deep_timer import backward_fresh, bench_deep

HQ, HKV, ROUNDS = 32, 8, 6

if "--" not in sys.argv or len(sys.argv) < 5:
    sys.exit(__doc__)
cut = sys.argv.index("--")
lib, specs, shapes = sys.argv[1], sys.argv[2:cut], [a for a in sys.argv[cut + 1:] if a != "--fwd"]
with_fwd = "--fwd" in sys.argv[cut + 1:]
layers = {}
variants = []  # (name, layer, {VAR: value})
for spec in specs:
    head, _, settings = spec.partition(":")
    name, _, path = head.partition("@")
    path = path or lib
    if path not in layers:
        layers[path] = kcpp.Package(path).layer("FlashAttention")
    env = dict(s.split("=", 1) for s in settings.split(",") if s)
    variants.append((name, layers[path], env))
known = sorted({var for _, _, env in variants for var in env})
os.environ["KCPP_FLASH_ATTN_FORWARD"] = "hopper"
os.environ["KCPP_FLASH_ATTN_BACKWARD"] = "hopper"


def rel(a, b):
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm()).item()


for shape in shapes:
    B, S, D = (int(x) for x in shape.split("x"))
    torch.manual_seed(0)
    q = torch.randn(B, HQ, S, D, dtype=torch.bfloat16, device="cuda")
    k = torch.randn(B, HKV, S, D, dtype=torch.bfloat16, device="cuda")
    v = torch.randn(B, HKV, S, D, dtype=torch.bfloat16, device="cuda")
    do = torch.randn_like(q)
    out, lse = torch.empty_like(q), torch.empty(B, HQ, S, dtype=torch.float32, device="cuda")
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    fa = {"q": q, "k": k, "v": v, "out": out, "lse": lse, "scale": 1 / math.sqrt(D), "causal": 1}
    ba = dict(fa, dout=do, dq=dq, dk=dk, dv=dv)
    tflop = 3.5 * 4 * B * HQ * S * S * D / 2 / 1e12
    qg, kg, vg = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        F.scaled_dot_product_attention(qg, kg, vg, is_causal=True, enable_gqa=True).backward(do)
    grads = [qg.grad.clone(), kg.grad.clone(), vg.grad.clone()]

    def cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            backward_fresh(F.scaled_dot_product_attention(qg, kg, vg, is_causal=True, enable_gqa=True), do, (qg, kg, vg))

    def cudnn_fwd():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION), torch.no_grad():
            F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    fns, fwds = {}, {}
    for name, layer, env in variants:
        def setenv(env=env):
            for var in known:
                os.environ.pop(var, None)
            os.environ.update(env)

        def fb(layer=layer, setenv=setenv):
            setenv()
            layer.forward(fa)
            layer.backward(ba)

        for t in (dq, dk, dv):
            t.fill_(float("nan"))
        fb()
        torch.cuda.synchronize()
        print(f"B{B} S{S} D{D} {name}: grads vs cuDNN {max(rel(a, b) for a, b in zip((dq, dk, dv), grads)):.2e}", flush=True)
        fns[name] = fb

        def fwd(layer=layer, setenv=setenv):
            setenv()
            layer.forward(fa)

        fwds[name + " fwd"] = fwd
    fns["cudnn"] = cudnn
    fwds["cudnn fwd"] = cudnn_fwd
    pairs = list(fns.items()) + (list(fwds.items()) if with_fwd else [])
    times = {name: [] for name, _ in pairs}
    for r in range(ROUNDS):
        for name, fn in (pairs if r % 2 == 0 else pairs[::-1]):
            times[name].append(bench_deep(fn))
    med = {name: statistics.median(t) for name, t in times.items()}
    figures = ", ".join(f"{name} {med[name]:.4f} ms ({tflop / med[name] * 1e3:.1f} TFLOP/s, {med['cudnn'] / med[name]:.3f}x cuDNN)"
                        for name in fns)
    print(f"B{B} S{S} D{D} forward + backward, medians: {figures}", flush=True)
    if with_fwd:  # the backward alone: the medians' difference, 2.5 / 3.5 of the forward + backward's FLOP
        bwd = {name: med[name] - med[name + " fwd"] for name in fns}
        figures = ", ".join(f"{name} {bwd[name]:.4f} ms ({tflop * 2.5 / 3.5 / bwd[name] * 1e3:.1f} TFLOP/s, "
                            f"{bwd['cudnn'] / bwd[name]:.3f}x cuDNN; forward {med[name + ' fwd']:.4f})" for name in fns)
        print(f"B{B} S{S} D{D} backward alone, medians' difference: {figures}", flush=True)
    for name, t in times.items():
        print(f"  {name} rounds: {' '.join(f'{x:.4f}' for x in t)}", flush=True)
    for var in known:
        os.environ.pop(var, None)
    del q, k, v, do, out, dq, dk, dv, qg, kg, vg, grads
    torch.cuda.empty_cache()
