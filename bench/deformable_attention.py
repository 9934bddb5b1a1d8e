"""deformable_attention's MultiScaleDeformableAttention on the GPU beside Transformers' PyTorch path, in
one process and under one timer (deep_timer.bench_deep), at Deformable DETR's encoder dimensions: the
four feature levels of an 800 x 1,333 image after backbone strides 8 / 16 / 32 / 64 (100 x 167, 50 x 84,
25 x 42, 13 x 21: S = 22,223 positions), queries = every position (the encoder's self-attention),
batch 8, 8 heads x 32 channels (d_model 256), 4 points a level; f32 (Deformable DETR trains in f32) and
bf16 (other shapes as arguments).

Rows, for each dtype:
- kcpp: the built package through its C ABI (python/kcpp), forward, then forward + backward (dvalue,
  dsampling_locations, dattention_weights), with the default CUDA kernels (the grouped ones).
- kcpp legacy: the same calls with KCPP_MSDA_LEGACY=1 (the lane-per-channel kernels), in the same run.
- torch (Transformers): `MultiScaleDeformableAttention.forward` of
  transformers/models/deformable_detr/modeling_deformable_detr.py (grid_sample per level, the path run
  when no hub kernel is mapped), forward under no_grad, and forward + autograd backward.

Before timing, kcpp's output and gradients (both kernel sets) are compared with the PyTorch path's in f32
(relative L2).  The last line gives the forward's gather rate: the corner bytes it reads (B Q M L P x 4
corners x C x element size, the same in both kernel sets) over its time.

Run on the GPU machine:
  python3 bench/deformable_attention.py \
      build/release/kernels/deformable_attention/build/kcpp1-cu130-x86_64-linux/libdeformable_attention.so
  [--batch 8 --heads 8 --channels 32 --points 4 --height 800 --width 1333 --queries 0 (0: all positions)
   --kernels grouped,legacy]
"""
import argparse
import math
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "python"))
sys.path.insert(0, HERE)
import kcpp  # noqa: E402
from deep_timer import bench_deep, host_us  # noqa: E402
from transformers.models.deformable_detr.modeling_deformable_detr import MultiScaleDeformableAttention  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("lib", help="libdeformable_attention.so of the CUDA variant")
ap.add_argument("--batch", type=int, default=8)
ap.add_argument("--heads", type=int, default=8)
ap.add_argument("--channels", type=int, default=32, help="channels a head")
ap.add_argument("--points", type=int, default=4)
ap.add_argument("--height", type=int, default=800)
ap.add_argument("--width", type=int, default=1333)
ap.add_argument("--queries", type=int, default=0, help="0: every position (the encoder); 300 / 900: the decoder")
ap.add_argument("--dtypes", default="float32,bfloat16")
ap.add_argument("--kernels", default="grouped,legacy", help="kcpp's CUDA kernels to time: grouped (default), legacy")
args = ap.parse_args()
dev = "cuda"
B, M, C, P = args.batch, args.heads, args.channels, args.points
levels = [(math.ceil(args.height / s), math.ceil(args.width / s)) for s in (8, 16, 32, 64)]
L = len(levels)
S = sum(h * w for h, w in levels)
Q = args.queries or S
shapes = torch.tensor(levels, dtype=torch.int64, device=dev)
starts = torch.tensor([0] + [h * w for h, w in levels][:-1], dtype=torch.int64, device=dev).cumsum(0)
ref_layer = MultiScaleDeformableAttention()

layer = kcpp.Package(args.lib).layer("MultiScaleDeformableAttention")


def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def ms(fn, what):
    t = bench_deep(fn)
    print(f"  {what}: {t:.3f} ms (host {host_us(fn, 10):.0f} us a call)", flush=True)
    return t


def inputs(dt):
    g = torch.Generator(device=dev).manual_seed(0)
    value = torch.randn(B, S, M, C, device=dev, generator=g).to(dt)
    # Reference points spread over the image plus small offsets, as the encoder's are.
    loc = (torch.rand(B, Q, M, 1, 1, 2, device=dev, generator=g) + 0.02 * torch.randn(B, Q, M, L, P, 2, device=dev, generator=g))
    attn = torch.softmax(torch.randn(B, Q, M, L * P, device=dev, generator=g), -1).view(B, Q, M, L, P)
    dout = torch.randn(B, Q, M * C, device=dev, generator=g).to(dt)
    return value, loc.to(dt).contiguous(), attn.to(dt), dout


KERNELS = args.kernels.split(",")
for k in KERNELS:
    if k not in ("grouped", "legacy"):
        sys.exit(f"--kernels: unknown '{k}' (grouped, legacy)")


def use_kernels(k):
    """The package reads KCPP_MSDA_LEGACY at each call."""
    if k == "legacy":
        os.environ["KCPP_MSDA_LEGACY"] = "1"
    else:
        os.environ.pop("KCPP_MSDA_LEGACY", None)


def kcpp_calls(value, loc, attn, dout):
    out = torch.empty(B, Q, M * C, dtype=value.dtype, device=dev)
    grads = {"dvalue": torch.empty_like(value), "dsampling_locations": torch.empty_like(loc),
             "dattention_weights": torch.empty_like(attn)}
    a = {"value": value, "value_spatial_shapes": shapes, "value_level_start_index": starts, "sampling_locations": loc,
         "attention_weights": attn, "im2col_step": 64}
    fa, ba = dict(a, out=out), dict(a, dout=dout, **grads)

    def fwd():
        layer.forward(fa, mode="training")

    def fwd_bwd():
        layer.forward(fa, mode="training")
        layer.backward(ba)

    return out, grads, fwd, fwd_bwd


def ref_calls(value, loc, attn, dout):
    leaves = [t.detach().clone().requires_grad_(True) for t in (value, loc, attn)]

    def call():
        return ref_layer(leaves[0], shapes, levels, starts, leaves[1], leaves[2], 64)

    def fwd():
        with torch.no_grad():
            call()

    def fwd_bwd():
        for t in leaves:
            t.grad = None
        call().backward(dout)

    return leaves, call, fwd, fwd_bwd


print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; MultiScaleDeformableAttention B{B} Q{Q} S{S} "
      f"heads {M} x {C} channels, levels {levels}, {P} points", flush=True)

# Correctness first, in f32.
value, loc, attn, dout = inputs(torch.float32)
leaves, call, _, _ = ref_calls(value, loc, attn, dout)
y = call()
y.backward(dout)
torch.cuda.synchronize()
for k in KERNELS:
    use_kernels(k)
    out, grads, kf, kfb = kcpp_calls(value, loc, attn, dout)
    kfb()
    torch.cuda.synchronize()
    errs = {"out": rel(out, y.detach()), "dvalue": rel(grads["dvalue"], leaves[0].grad),
            "dsampling_locations": rel(grads["dsampling_locations"], leaves[1].grad),
            "dattention_weights": rel(grads["dattention_weights"], leaves[2].grad)}
    print(f"  kcpp {k} vs torch f32 (relative L2): " + ", ".join(f"{n} {v:.2e}" for n, v in errs.items()), flush=True)
    del out, grads, kf, kfb
del y, leaves, call
torch.cuda.empty_cache()

rows = []
for name in args.dtypes.split(","):
    dt = getattr(torch, name)
    value, loc, attn, dout = inputs(dt)
    times = {}
    for k in KERNELS:
        use_kernels(k)
        _, _, kf, kfb = kcpp_calls(value, loc, attn, dout)
        times[k] = (ms(kf, f"kcpp {k} {name} fwd"), ms(kfb, f"kcpp {k} {name} fwd+bwd"))
        del kf, kfb
    use_kernels("grouped")
    try:
        _, _, rf, rfb = ref_calls(value, loc, attn, dout)
        r_f, r_fb = ms(rf, f"torch {name} fwd"), ms(rfb, f"torch {name} fwd+bwd")
        del rf, rfb
    except torch.cuda.OutOfMemoryError as e:
        print(f"  torch {name}: out of memory ({e})", flush=True)
        r_f = r_fb = float("nan")
    for k in KERNELS:
        rows.append((name, k, *times[k], r_f, r_fb, value.element_size()))
    del value, loc, attn, dout
    torch.cuda.empty_cache()

print()
print("| dtype | kcpp kernels | kcpp fwd ms | kcpp fwd+bwd ms | torch fwd ms | torch fwd+bwd ms | speed-up fwd | speed-up fwd+bwd |")
print("|---|---|---|---|---|---|---|---|")
for name, k, t_f, t_fb, r_f, r_fb, _ in rows:
    print(f"| {name} | {k} | {t_f:.3f} | {t_fb:.3f} | {r_f:.3f} | {r_fb:.3f} | {r_f / t_f:.1f}x | {r_fb / t_fb:.1f}x |")
print()
gathered = B * Q * M * L * P * 4 * C
for name, k, t_f, _, _, _, esize in rows:
    print(f"  {name} {k} forward: {gathered * esize / 1e6:.0f} MB of corners in {t_f:.3f} ms = "
          f"{gathered * esize / t_f / 1e9:.2f} TB/s gathered")
