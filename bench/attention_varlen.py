"""flash_attn's variable-length packed sequences (cu_seqlens, FlashAttention's varlen API) against the
padded equivalent, in one process and under one timer (deep_timer.bench_deep): issue 23's "varlen with
mixed lengths reported against the padded equivalent".

The sequences: lengths drawn (seed 0) uniformly from [--min, --max] until --tokens are filled, packed
as q [T, 32, 128], k / v [T, 8, 128], bf16, causal within each sequence.  The padded equivalent is the
same sequences zero-padded to the longest, [B, H, S_max, 128], with a causal mask: its outputs on each
sequence's rows are the same, its work is the padding's too.  Rows:
  - kcpp varlen: the package's packed call on each CUDA path (hopper: wgmma + TMA; ampere: mma.sync);
  - kcpp padded: the package on the padded batch (the Hopper forward / backward where they run);
  - SDPA cuDNN and FlashAttention-2 on the padded batch;
  - torch.nn.attention.varlen.varlen_attn where this torch has it (FlashAttention's varlen kernels).
TFLOP/s count the useful work only, for every row: sum over sequences of 4 H L^2 D / 2 forward, 3.5
times that forward + backward.  Outputs and gradients on the sequences' rows are compared with the
padded cuDNN row's before timing.

Run on the GPU machine: python3 bench/attention_varlen.py <libflash_attn.so of the CUDA variant>
Options: --tokens 32768 --min 64 --max 4096
"""
import argparse
import math
import os
import random
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "python"))
sys.path.insert(0, HERE)
import kcpp  # noqa: E402
from deep_timer import backward_fresh, bench_deep  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("lib")
ap.add_argument("--tokens", type=int, default=32768)
ap.add_argument("--min", type=int, default=64)
ap.add_argument("--max", type=int, default=4096)
args = ap.parse_args()
HQ, HKV, D = 32, 8, 128
layer = kcpp.Package(args.lib).layer("FlashAttention")

rng = random.Random(0)
lens = []
while sum(lens) < args.tokens:
    lens.append(min(rng.randint(args.min, args.max), args.tokens - sum(lens)))
T, B, S = sum(lens), len(lens), max(lens)
cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32, device="cuda")
flops = sum(4 * HQ * L * L * D / 2 for L in lens) / 1e12
print(f"{B} sequences, {T} tokens, lengths {min(lens)}..{S}; padded to {B} x {S} = {B * S} rows "
      f"({B * S / T:.2f}x the tokens); useful forward work {flops * 1e3:.1f} GFLOP", flush=True)

torch.manual_seed(0)
q = torch.randn(T, HQ, D, dtype=torch.bfloat16, device="cuda")
k = torch.randn(T, HKV, D, dtype=torch.bfloat16, device="cuda")
v = torch.randn(T, HKV, D, dtype=torch.bfloat16, device="cuda")
do = torch.randn_like(q)


def pad(x):  # [T, H, D] -> [B, H, S, D], zero rows past each sequence
    out = x.new_zeros(B, x.shape[1], S, D)
    for i, L in enumerate(lens):
        out[i, :, :L] = x[cu[i]:cu[i] + L].transpose(0, 1)
    return out


def unpad(x):  # [B, H, S, D] -> [T, H, D]
    return torch.cat([x[i, :, :L].transpose(0, 1) for i, L in enumerate(lens)])


def rel(a, b):
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm()).item()


qp, kp, vp, dop = pad(q), pad(k), pad(v), pad(do)
rows = []


def row(name, f, fb, out, grads):
    err = rel(out, ref_out) if ref_out is not None else 0.0
    gerr = max(rel(a, b) for a, b in zip(grads, ref_grads)) if ref_grads is not None else 0.0
    tf, tfb = bench_deep(f), bench_deep(fb)
    rows.append((name, tf, flops / tf * 1e3, tfb, 3.5 * flops / tfb * 1e3, err, gerr))
    print(rows[-1], flush=True)


ref_out = ref_grads = None
for name, be in (("sdpa cuDNN, padded", SDPBackend.CUDNN_ATTENTION), ("sdpa FA2, padded", SDPBackend.FLASH_ATTENTION)):
    qg, kg, vg = (t.detach().clone().requires_grad_(True) for t in (qp, kp, vp))
    with sdpa_kernel(be):
        try:
            o = F.scaled_dot_product_attention(qg, kg, vg, is_causal=True, enable_gqa=True)
        except RuntimeError as e:
            print(f"!! {name}: {e}", flush=True)
            continue
        o.backward(dop)
        out, grads = unpad(o.detach()), [unpad(t.grad) for t in (qg, kg, vg)]
        if ref_out is None:
            ref_out, ref_grads = out, grads

        def f():
            with torch.no_grad():
                F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, enable_gqa=True)

        def fb():
            backward_fresh(F.scaled_dot_product_attention(qg, kg, vg, is_causal=True, enable_gqa=True), dop, (qg, kg, vg))

        row(name, f, fb, out, grads)
        del qg, kg, vg, o

# kcpp padded: the batched call.
outp, lsep = torch.empty_like(qp), torch.empty(B, HQ, S, dtype=torch.float32, device="cuda")
dqp, dkp, dvp = torch.empty_like(qp), torch.empty_like(kp), torch.empty_like(vp)
fa = {"q": qp, "k": kp, "v": vp, "out": outp, "lse": lsep, "scale": 1 / math.sqrt(D), "causal": 1}
ba = dict(fa, dout=dop, dq=dqp, dk=dkp, dv=dvp)
layer.forward(fa)
layer.backward(ba)
torch.cuda.synchronize()
row("kcpp, padded", lambda: layer.forward(fa), lambda: (layer.forward(fa), layer.backward(ba)),
    unpad(outp), [unpad(t) for t in (dqp, dkp, dvp)])

# kcpp varlen: the packed call.
out, lse = torch.empty_like(q), torch.empty(HQ, T, dtype=torch.float32, device="cuda")
dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
va = {"q": q, "k": k, "v": v, "out": out, "lse": lse, "scale": 1 / math.sqrt(D), "causal": 1,
      "cu_seqlens_q": cu, "cu_seqlens_k": cu, "max_seqlen_q": S, "max_seqlen_k": S}
vb = dict(va, dout=do, dq=dq, dk=dk, dv=dv)
# Each path pinned (KCPP_FLASH_ATTN_FORWARD / _BACKWARD), fresh outputs; the Hopper backward in both
# block orders (KCPP_FLASH_ATTN_SM90_BWD_ORDER).
for path, order in (("hopper", "keys"), ("hopper", "heads"), ("hopper", "grouped"), ("ampere", "")):
    os.environ["KCPP_FLASH_ATTN_FORWARD"] = os.environ["KCPP_FLASH_ATTN_BACKWARD"] = path
    os.environ["KCPP_FLASH_ATTN_SM90_BWD_ORDER"] = order
    for t in (out, dq, dk, dv):
        t.fill_(float("nan"))
    try:
        layer.forward(va)
        layer.backward(vb)
    except kcpp.KcppError as e:
        print(f"!! kcpp varlen {path}: {e}", flush=True)
        continue
    torch.cuda.synchronize()
    row(f"kcpp, varlen, {path}" + (f" ({order})" if order else ""), lambda: layer.forward(va), lambda: (layer.forward(va), layer.backward(vb)), out, [dq, dk, dv])
del os.environ["KCPP_FLASH_ATTN_FORWARD"], os.environ["KCPP_FLASH_ATTN_BACKWARD"], os.environ["KCPP_FLASH_ATTN_SM90_BWD_ORDER"]

try:  # its keywords changed between torch versions: causal as is_causal or window_size (-1, 0)
    import inspect

    from torch.nn.attention.varlen import varlen_attn
    params = inspect.signature(varlen_attn).parameters
    kw = {"is_causal": True} if "is_causal" in params else {"window_size": (-1, 0)}
    kv = (k, v)
    if "enable_gqa" in params:
        kw["enable_gqa"] = True
    else:  # K / V repeated to the query heads (outside the timer)
        kv = tuple(t.repeat_interleave(HQ // HKV, dim=1) for t in (k, v))
    qg, kg, vg = (t.detach().clone().requires_grad_(True) for t in (q,) + kv)
    o = varlen_attn(qg, kg, vg, cu, cu, S, S, **kw)
    o.backward(do)
    g = [qg.grad] + [t.grad if "enable_gqa" in params else t.grad.unflatten(1, (HKV, HQ // HKV)).sum(2) for t in (kg, vg)]

    def f():
        with torch.no_grad():
            varlen_attn(q, kv[0], kv[1], cu, cu, S, S, **kw)

    def fb():
        backward_fresh(varlen_attn(qg, kg, vg, cu, cu, S, S, **kw), do, (qg, kg, vg))

    row("torch varlen_attn", f, fb, o.detach(), g)
except Exception as e:  # not in this torch, or these arguments refused
    print(f"!! torch varlen_attn: {type(e).__name__}: {e}", flush=True)

print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}; causal bf16, {HQ}/{HKV} heads of {D}; "
      f"{B} sequences, {T} tokens, max {S}")
print(f"{'impl':30s} {'fwd ms':>8s} {'TFLOP/s':>8s} {'fwd+bwd ms':>11s} {'TFLOP/s':>8s} {'out vs cuDNN':>13s} {'grads vs cuDNN':>15s}")
for name, tf, ff, tfb, ffb, err, gerr in rows:
    print(f"{name:30s} {tf:8.3f} {ff:8.1f} {tfb:11.3f} {ffb:8.1f} {err:13.2e} {gerr:15.2e}")
