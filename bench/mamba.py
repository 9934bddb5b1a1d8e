"""mamba's SelectiveScan forward + backward on the GPU beside Transformers' PyTorch path and a device copy
of the same bytes, in one process and under one timer (deep_timer.bench_deep), at Mamba-1.4B-like
dimensions: d_inner 4096, d_state 16, batch 8 x 2048 positions, bf16 (other shapes as arguments).

Rows:
- kcpp: the built package through its C ABI (python/kcpp), forward in training mode (writing the saved
  states) then backward, with every option Mamba uses (delta_bias + softplus, D, z; --falcon adds the
  B / C norm).
  The default pairs the state-lane forward with the chunked backward; the rows kcpp lanes / chunked /
  legacy run one family both ways (KCPP_SCAN_LANES=1 / KCPP_SCAN_CHUNKED=1 / KCPP_SCAN_LEGACY=1 in the
  environment, read at every call; --paths picks the rows).
- torch (Transformers): `mamba_selective_scan` of transformers/models/mamba/modeling_mamba.py, unwrapped
  to its PyTorch body (the sequential loop over positions that the slow path runs when no hub kernel
  is mapped), forward + autograd backward; an identical loop written here when transformers is absent.
  Timed over --ref-reps calls (it takes seconds).
- mamba-ssm: `selective_scan_fn` of mamba_ssm, the anchor, where it is installed; or its CUDA extension
  `selective_scan_cuda` alone on PYTHONPATH (bench/build_mamba_ssm.py builds it without the package's
  Python dependencies), called through a small autograd wrapper here.
- copy: torch's copy of a buffer of half the bytes below (so that it reads and writes them all).

Bytes counted for forward + backward (each tensor once, at its dtype): forward reads u, delta, z, B, C
and writes out and the saved states (f32); backward reads u, delta, z, B, C, dout and the states and
writes du, ddelta, dz, dB, dC.  A, D, delta_bias and their gradients (under 0.5 MB) are left out.

Outputs and gradients are compared with the PyTorch path's (relative L2 of the difference) before
anything is timed; the PyTorch path runs in f32 (the bf16 one rounds the state at every position).

Run on the GPU machine:
  python3 bench/mamba.py build/release/kernels/mamba/build/kcpp1-cu130-x86_64-linux/libmamba.so
  [--batch 8 --dim 4096 --seqlen 2048 --dstate 16 --falcon --ref-reps 3 --paths default,lanes,chunked --kernels]
"""
import argparse
import inspect
import math
import os
import sys

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "python"))
sys.path.insert(0, HERE)
import kcpp  # noqa: E402
from deep_timer import back_to_back, bench_deep, host_us, kernel_table  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("lib", help="libmamba.so of the CUDA variant")
ap.add_argument("--batch", type=int, default=8)
ap.add_argument("--dim", type=int, default=4096)
ap.add_argument("--seqlen", type=int, default=2048)
ap.add_argument("--dstate", type=int, default=16)
ap.add_argument("--falcon", action="store_true", help="normalise B and C inside the scan (Falcon-Mamba)")
ap.add_argument("--ref-reps", type=int, default=3, help="timed calls of the PyTorch path")
ap.add_argument("--paths", default="default,lanes,chunked",
                help="the CUDA kernels to time, comma-separated: default, lanes (KCPP_SCAN_LANES=1), chunked "
                     "(KCPP_SCAN_CHUNKED=1), legacy (KCPP_SCAN_LEGACY=1); the first is the speed-ups' base")
ap.add_argument("--kernels", action="store_true", help="print each path's kernels by time (one fwd+bwd under torch.profiler)")
args = ap.parse_args()
Bn, D, L, N = args.batch, args.dim, args.seqlen, args.dstate
dev, dt = "cuda", torch.bfloat16
EPS = 1e-6

try:
    from transformers.models.falcon_mamba.modeling_falcon_mamba import FalconMambaWeightlessRMSNorm
    from transformers.models.mamba import modeling_mamba as mm
    hf_scan = inspect.unwrap(mm.mamba_selective_scan)  # the PyTorch body, whatever kernel is mapped
    REF_NAME = "torch (Transformers' mamba_selective_scan)"
except ImportError:
    hf_scan, FalconMambaWeightlessRMSNorm = None, None
    REF_NAME = "torch (the slow path's loop, written here)"


def torch_scan(u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False, return_last_state=False):
    """Transformers' slow path (modeling_mamba.mamba_selective_scan's sequential branch), for machines
    without transformers."""
    if delta_bias is not None:
        delta = delta + delta_bias[..., None]
    if delta_softplus:
        delta = F.softplus(delta)
    dA = torch.exp(A[None, :, None, :] * delta[..., None])
    dBu = delta[..., None] * B.transpose(1, 2)[:, None] * u[..., None]
    h = torch.zeros(u.shape[0], u.shape[1], A.shape[1], dtype=u.dtype, device=u.device)
    ys = []
    for i in range(u.shape[2]):
        h = dA[:, :, i] * h + dBu[:, :, i]
        ys.append((h @ C[:, :, i].unsqueeze(-1))[..., 0])
    y = torch.stack(ys, dim=-1)
    if D is not None:
        y = y + u * D[None, :, None]
    if z is not None:
        y = y * F.silu(z)
    return (y, h) if return_last_state else y


ref_scan = hf_scan or torch_scan
try:
    from mamba_ssm.ops.selective_scan_interface import selective_scan_fn as ssm_scan
except ImportError:
    ssm_scan = None
    try:  # mamba-ssm's extension alone (built without the package's Python dependencies), on PYTHONPATH
        import selective_scan_cuda
    except ImportError:
        selective_scan_cuda = None
    if selective_scan_cuda is not None:
        class _SsmScan(torch.autograd.Function):
            """selective_scan_cuda's fwd / bwd with z (out * silu(z)), as mamba-ssm's own wrapper calls them."""

            @staticmethod
            def forward(ctx, u, delta, A, B, C, D, z, delta_bias):
                # B and C as [batch, groups = 1, d_state, seqlen]; fwd returns out, the chunk states, out_z.
                out, x, out_z = selective_scan_cuda.fwd(u, delta, A, B.unsqueeze(1), C.unsqueeze(1), D, z, delta_bias, True)
                ctx.save_for_backward(u, delta, A, B, C, D, z, delta_bias, x, out)
                return out_z

            @staticmethod
            def backward(ctx, dout):
                u, delta, A, B, C, D, z, delta_bias, x, out = ctx.saved_tensors
                du, ddelta, dA, dB, dC, dD, ddelta_bias, dz, *_ = selective_scan_cuda.bwd(
                    u, delta, A, B.unsqueeze(1), C.unsqueeze(1), D, z, delta_bias, dout.contiguous(), x, out, None, True, False)
                return du, ddelta, dA, dB.squeeze(1), dC.squeeze(1), dD, dz, ddelta_bias

        def ssm_scan(u, delta, A, B, C, D, z, delta_bias, delta_softplus):
            assert delta_softplus
            return _SsmScan.apply(u, delta, A, B, C, D, z, delta_bias)


def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def ms(fn, what):
    t = bench_deep(fn)
    print(f"  {what}: {t:.3f} ms (host {host_us(fn, 10):.0f} us a call)", flush=True)
    return t


torch.manual_seed(0)
u = torch.randn(Bn, D, L, dtype=dt, device=dev)
delta = (torch.randn(Bn, D, L, device=dev) * 0.5).to(dt)
z = torch.randn(Bn, D, L, dtype=dt, device=dev)
Bm, Cm = torch.randn(Bn, N, L, dtype=dt, device=dev), torch.randn(Bn, N, L, dtype=dt, device=dev)
A = -torch.arange(1, N + 1, dtype=torch.float32, device=dev).expand(D, N).contiguous()  # Mamba's S4D-real init
Dp = torch.ones(D, device=dev)
step = torch.exp(torch.rand(D, device=dev) * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3))  # Mamba's dt init
bias = step + torch.log(-torch.expm1(-step))  # softplus^-1
dout = torch.randn(Bn, D, L, dtype=dt, device=dev)
chunks = (L + 255) // 256

layer = kcpp.Package(args.lib).layer("SelectiveScan")
out = torch.empty_like(u)
states = torch.empty(Bn, D, chunks, N, dtype=torch.float32, device=dev)
grads = {"du": torch.empty_like(u), "ddelta": torch.empty_like(u), "dz": torch.empty_like(u), "dB": torch.empty_like(Bm),
         "dC": torch.empty_like(Cm), "dA": torch.empty_like(A), "dD": torch.empty_like(Dp), "ddelta_bias": torch.empty_like(bias)}
fa = {"u": u, "delta": delta, "A": A, "B": Bm, "C": Cm, "D": Dp, "z": z, "delta_bias": bias, "delta_softplus": 1,
      "out": out, "states": states}
if args.falcon:
    fa["bc_rms_eps"] = EPS
ba = dict(fa, dout=dout, **grads)
del ba["out"]


def kcpp_fwd():
    layer.forward(fa, mode="training")


def kcpp_fwd_bwd():
    layer.forward(fa, mode="training")
    layer.backward(ba)


PATH_ENV = {"default": None, "lanes": "KCPP_SCAN_LANES", "chunked": "KCPP_SCAN_CHUNKED", "legacy": "KCPP_SCAN_LEGACY"}


def use_path(path):
    """Selects a path's kernels for the calls that follow (the package reads the variables at every call)."""
    for var in ("KCPP_SCAN_LANES", "KCPP_SCAN_CHUNKED", "KCPP_SCAN_LEGACY"):
        os.environ.pop(var, None)
    if PATH_ENV[path]:
        os.environ[PATH_ENV[path]] = "1"


paths = []
for path in args.paths.split(","):
    if path not in PATH_ENV:
        sys.exit(f"--paths: unknown path {path!r} (default, lanes, chunked, legacy)")
    paths.append(("kcpp" if path == "default" else f"kcpp {path} ({PATH_ENV[path]}=1)", path))


def ref_inputs(dtype):
    leaves = [t.detach().to(dtype).requires_grad_(True) for t in (u, delta, A, Bm, Cm, Dp, z, bias)]
    return leaves


def ref_call(leaves):
    lu, ld, lA, lB, lC, lD, lz, lb = leaves
    if args.falcon:
        norm = FalconMambaWeightlessRMSNorm(N, eps=EPS) if FalconMambaWeightlessRMSNorm else None
        f = norm if norm else (lambda x: x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + EPS))
        lB, lC = f(lB.transpose(1, 2)).transpose(1, 2), f(lC.transpose(1, 2)).transpose(1, 2)
    return ref_scan(lu, ld, lA, lB, lC, D=lD, z=lz, delta_bias=lb, delta_softplus=True)


print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; selective scan B{Bn} D{D} L{L} N{N} bf16"
      f"{' (Falcon-Mamba B / C norm)' if args.falcon else ''}", flush=True)

# Correctness first: kcpp (each path) against the PyTorch path in f32 (the same bf16 inputs).
leaves = ref_inputs(torch.float32)
y = ref_call(leaves)
y.backward(dout.float())
names = ["du", "ddelta", "dA", "dB", "dC", "dD", "dz", "ddelta_bias"]
for name, path in paths:
    use_path(path)
    for t in [out] + list(grads.values()):
        t.fill_(float("nan"))
    kcpp_fwd_bwd()
    torch.cuda.synchronize()
    errs = {"out": rel(out, y.detach())}
    errs.update({n: rel(grads[n], leaf.grad) for n, leaf in zip(names, leaves)})
    print(f"  {name} vs torch f32 (relative L2): " + ", ".join(f"{k} {v:.2e}" for k, v in errs.items()), flush=True)
use_path("default")
if ssm_scan is not None and not args.falcon:  # the anchor against the same reference
    sl = [t.detach().clone().requires_grad_(True) for t in (u, delta, A, Bm, Cm, Dp, z, bias)]
    ys = ssm_scan(*sl, delta_softplus=True)
    ys.backward(dout)
    errs = {"out": rel(ys, y.detach())}
    errs.update({n: rel(leaf.grad, ref.grad) for n, leaf, ref in zip(names, sl, leaves)})
    print("  mamba-ssm vs torch f32 (relative L2): " + ", ".join(f"{k} {v:.2e}" for k, v in errs.items()), flush=True)
    del sl, ys
del y, leaves
torch.cuda.empty_cache()

rows = []
for name, path in paths:
    use_path(path)
    f, fb = ms(kcpp_fwd, f"{name} fwd"), ms(kcpp_fwd_bwd, f"{name} fwd+bwd")
    rows.append((name, f, fb))
    if args.kernels:
        kernel_table(kcpp_fwd_bwd, f"{name} fwd+bwd")
use_path("default")
t_f, t_fb = rows[0][1], rows[0][2]

# The PyTorch path in the inputs' dtype (what a bf16 model runs), a few calls.
leaves = ref_inputs(dt)


def ref_fwd():
    with torch.no_grad():
        ref_call(leaves)


def ref_fwd_bwd():
    for t in leaves:
        t.grad = None
    ref_call(leaves).backward(dout)



try:
    r_f, r_fb = back_to_back(ref_fwd, args.ref_reps), back_to_back(ref_fwd_bwd, args.ref_reps)
    print(f"  {REF_NAME}: fwd {r_f:.1f} ms, fwd+bwd {r_fb:.1f} ms", flush=True)
    rows.append((REF_NAME, r_f, r_fb))
except torch.cuda.OutOfMemoryError as e:
    print(f"  {REF_NAME}: out of memory ({e})", flush=True)
del leaves
torch.cuda.empty_cache()

if ssm_scan is not None and not args.falcon:
    su, sd, sA, sB, sC, sD, sz, sb = (t.detach().clone().requires_grad_(True) for t in (u, delta, A, Bm, Cm, Dp, z, bias))

    def ssm_fwd():
        with torch.no_grad():
            ssm_scan(su, sd, sA, sB, sC, sD, sz, sb, delta_softplus=True)

    def ssm_fwd_bwd():
        for t in (su, sd, sA, sB, sC, sD, sz, sb):
            t.grad = None
        ssm_scan(su, sd, sA, sB, sC, sD, sz, sb, delta_softplus=True).backward(dout)

    rows.append(("mamba-ssm selective_scan_fn", ms(ssm_fwd, "mamba-ssm fwd"), ms(ssm_fwd_bwd, "mamba-ssm fwd+bwd")))
else:
    print("  mamba-ssm: not installed here (the anchor row is missing)", flush=True)

e16, e32 = 2, 4
seq = Bn * D * L * e16
bc = Bn * N * L * e16
st = Bn * D * chunks * N * e32
fwd_bytes = 3 * seq + 2 * bc + seq + st
bwd_bytes = 4 * seq + 2 * bc + st + 3 * seq + 2 * bc
total = fwd_bytes + bwd_bytes
src = torch.empty(total // 2, dtype=torch.uint8, device=dev)
dst = torch.empty_like(src)
t_copy = ms(lambda: dst.copy_(src), f"copy of {total / 2**30:.2f} GiB moved")
t_copy_f = t_copy * fwd_bytes / total
rows.append(("copy of the same bytes", t_copy_f, t_copy))

# One decoding step of a mixer (its conv update and state update) at this batch and width.
step_layer, conv_layer = kcpp.Package(args.lib).layer("SelectiveStateUpdate"), kcpp.Package(args.lib).layer("CausalConv1dUpdate")
ssm_state = torch.randn(Bn, D, N, device=dev)
conv_state = torch.randn(Bn, D, 4, dtype=dt, device=dev)
xs, zs, dts = u[:, :, 0].contiguous(), z[:, :, 0].contiguous(), delta[:, :, 0].contiguous()
Bs, Cs = Bm[:, :, 0].contiguous(), Cm[:, :, 0].contiguous()
conv_w, conv_b = torch.randn(D, 4, dtype=dt, device=dev), torch.randn(D, dtype=dt, device=dev)
xo, yo = torch.empty_like(xs), torch.empty_like(xs)
sa = {"state": ssm_state, "x": xo, "dt": dts, "A": A, "B": Bs, "C": Cs, "D": Dp, "z": zs, "dt_bias": bias, "dt_softplus": 1, "out": yo}
ca = {"x": xs, "conv_state": conv_state, "weight": conv_w, "bias": conv_b, "activation": "silu", "out": xo}


def kcpp_step():
    conv_layer.forward(ca, mode="inference")
    step_layer.forward(sa, mode="inference")


t_step = ms(kcpp_step, "kcpp decoding step (CausalConv1dUpdate + SelectiveStateUpdate)")
if hf_scan is not None:
    hf_step, hf_conv = inspect.unwrap(mm.mamba_selective_state_update), inspect.unwrap(mm.causal_conv1d_update)
    xs3 = xs.unsqueeze(-1)

    def torch_step():
        xc = hf_conv(xs3, conv_state, conv_w, conv_b, activation="silu")
        hf_step(ssm_state, xc[..., 0], dts, A, Bs, Cs, Dp, dt_bias=bias, dt_softplus=True, z=zs)

    t_tstep = ms(torch_step, "torch decoding step (Transformers' causal_conv1d_update + mamba_selective_state_update)")
    print(f"  decoding step of one mixer at batch {Bn}: kcpp {t_step * 1e3:.1f} us, torch {t_tstep * 1e3:.1f} us", flush=True)

print(f"\nbytes: forward {fwd_bytes / 1e9:.3f} GB, forward + backward {total / 1e9:.3f} GB; copy bandwidth {total / t_copy / 1e6:.0f} GB/s")
print(f"{'impl':44s} {'fwd ms':>9s} {'fwd+bwd ms':>11s} {'GB/s':>7s} {'of copy':>8s} {'kcpp speed-up':>14s}")
for name, f, fb in rows:
    print(f"{name:44s} {f:9.3f} {fb:11.3f} {total / fb / 1e6:7.0f} {t_copy / fb:8.0%} {fb / t_fb:13.1f}x")
