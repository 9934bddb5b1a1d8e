"""One MoE experts layer, the moe package beside Transformers' experts implementations, in one process and
under one timer (deep_timer.bench_deep): issue 24's bar.

Dimensions: Qwen3-30B-A3B (hidden 2048, 128 experts, top-8, expert intermediate 768) and Mixtral-8x7B
(hidden 4096, 8 experts, top-2, intermediate 14336), 8192 tokens, bf16; forward, and forward + backward
(the gradients of the hidden states, both expert weights and the routing weights).  TFLOP/s count
6 H I per routed token for the forward and three times that for forward + backward.  The routing is
fixed beforehand (a softmax top-k of random logits, renormalized, in bf16, as Qwen3-MoE's router gives
it), so every row runs the same experts layer:
  - Transformers `eager` (the loop over experts of Qwen3MoeExperts.forward) and `grouped_mm`
    (torch's grouped GEMM), and `sonicmoe` where it can be loaded (kernels-community/sonic-moe);
  - Liger-Kernel's fused MoE (LigerFusedMoEFunction, Triton grouped GEMMs) where liger_kernel can be
    imported (LIGER_SRC names a folder holding its source, e.g. .anchors/src; never committed here);
  - kcpp: the package's MegaBlocksMoeMLP through its C ABI with routing "given" (the same work), and
    "kcpp block": the whole block with the router (routing "softmax", normalize), the router's GEMM
    and routing included in its time (FLOPs counted as the others');
  - the dense bf16 GEMM 8192^3 in the same run (the ceiling the Mixtral figures are held against): one
    GEMM a timed call (1.4 ms between 8 GiB L2 flushes), and twenty back to back (~28 ms, as long as
    Mixtral's forward + backward: a GEMM that long runs at the GPU's power cap, its clocks lowered).
The kcpp rows run once for each path of the experts' GEMMs (--gemm, each set as KCPP_MOE_GEMM before
its calls: the package reads it on every call): "kernel" (the package's mma.sync GEMM), "loop"
(cuBLAS, one GEMM per expert), "grouped" (one cuBLAS grouped GEMM per projection), "padded" (one
cuBLAS strided-batched GEMM per projection over the experts zero-padded to the largest count), "auto"
(the package's own choice: on Hopper the forward on the package's Hopper GEMM where it runs, else loop,
padded or grouped by the experts' counts).  "kernel" runs the Hopper GEMM (moe_gemm_sm90.cuh) where
the device and shapes take it, the mma.sync one elsewhere.  A value may carry settings for its rows
after a colon, e.g. "auto:KCPP_MOE_SM90=0" (the cuBLAS paths for the forward too) or
"kernel:KCPP_MOE_SM90=1" (the Hopper GEMM required: a product it cannot take fails the call).
Peak memory is the PyTorch allocator's peak during one forward + backward above what was allocated
before it (the package's workspace comes from that allocator).  The kcpp rows' gradients and saved
tensors are allocated before (the peers' gradients were too, from their previous call, and are freed
and allocated again within theirs; their saved activations are within their peak): the row "gate_up
saved" holds the forward's gate_up [S, 2I] outside its peak (printed below the table), which its
backward may write over (overwrite_gate_up, as nn::MoE's host passes it); the row "gate_up
recomputed" (--gate-up, what kcpp.torch's experts backend runs) holds nothing of that size.  Outputs and gradients are compared
with eager's before they are timed.  Decode-sized inputs (1, 16, 64 tokens) are timed forward.

Run on the GPU machine:
  python3 bench/moe.py build/release/kernels/moe/build/kcpp1-cu130-x86_64-linux/libmoe.so
Options: --configs qwen3,mixtral  --tokens 8192  --decode 1,16,64  --gemm kernel,loop,grouped,padded,auto
--no-peers (the kcpp rows only)  --device cpu (a smoke run at small sizes, for the script itself; its
timings mean nothing).
"""
import argparse
import os
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "python"))
sys.path.insert(0, HERE)
import kcpp  # noqa: E402
from transformers.models.qwen3_moe.configuration_qwen3_moe import Qwen3MoeConfig  # noqa: E402
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts  # noqa: E402

LigerMoE = None
if os.environ.get("LIGER_SRC"):
    sys.path.insert(0, os.environ["LIGER_SRC"])
    try:
        from liger_kernel.ops.fused_moe import LigerFusedMoEFunction as LigerMoE  # noqa: E402
    except Exception as e:  # noqa: BLE001
        print(f"liger_kernel's fused MoE could not be imported from LIGER_SRC: {type(e).__name__}: {e}", flush=True)

CONFIGS = {"qwen3": ("Qwen3-30B-A3B", 2048, 128, 8, 768), "mixtral": ("Mixtral-8x7B", 4096, 8, 2, 14336)}
SMALL = {"qwen3": ("Qwen3-like (small)", 128, 16, 4, 48), "mixtral": ("Mixtral-like (small)", 256, 8, 2, 512)}

ap = argparse.ArgumentParser()
ap.add_argument("lib", help="libmoe.so of the package's CUDA variant (the CPU one with --device cpu)")
ap.add_argument("--configs", default="qwen3,mixtral")
ap.add_argument("--tokens", type=int, default=8192)
ap.add_argument("--decode", default="1,16,64")
ap.add_argument("--device", default="cuda")
ap.add_argument("--gemm", default="kernel,loop,grouped,padded,auto", help="KCPP_MOE_GEMM values, one set of kcpp rows each")
ap.add_argument("--no-peers", action="store_true", help="skip Transformers' implementations (eager still gives the reference)")
ap.add_argument("--gate-up", default="saved", help="kcpp rows with routing given: saved (the backward overwrites it), recomputed")
ap.add_argument("--liger", default="qwen3", help="configs where Liger's fused MoE runs (at Mixtral's dims it takes minutes)")
ap.add_argument("--profile", action="store_true", help="print the kernels of the kcpp rows' forward + backward (torch.profiler)")
opt = ap.parse_args()
dev = opt.device
cuda = dev == "cuda"
dtype = torch.bfloat16 if cuda else torch.float32
if cuda:
    from deep_timer import back_to_back, bench_deep  # noqa: E402
layer = kcpp.Package(opt.lib).layer("MegaBlocksMoeMLP")


def timed(fn):
    if cuda:
        return bench_deep(fn)
    fn()
    times = []
    for _ in range(3):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def peak_mb(fn):
    if not cuda:
        return float("nan")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def profile(what, fn, reps=3):
    """The CUDA kernels of `reps` calls of fn, by total time (ms a call), the 14 longest."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile
    print(f"profile {what}: back to back (no L2 flush between calls) {back_to_back(fn, reps):.3f} ms a call", flush=True)
    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    stats, spans = {}, []
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            n, t = stats.get(ev.name, (0, 0.0))
            stats[ev.name] = (n + 1, t + ev.device_time_total / 1e3)
            spans.append((ev.time_range.start, ev.time_range.end, ev.name))
    total = sum(t for _, t in stats.values()) / reps
    spans.sort()
    wall = (spans[-1][1] - spans[0][0]) / 1e3 / reps if spans else 0.0
    print(f"profile {what}: {total:.3f} ms of kernels a call, {wall:.3f} ms from the first one's start to the last one's end",
          flush=True)
    for kname, (n, t) in sorted(stats.items(), key=lambda kv: -kv[1][1])[:14]:
        print(f"  {t / reps:8.3f} ms {n // reps:5d}x  {kname[:110]}", flush=True)
    gaps = sorted(((b[0] - a[1], a[2], b[2]) for a, b in zip(spans, spans[1:])), reverse=True)
    print(f"  idle between kernels: {sum(g for g, _, _ in gaps if g > 0) / 1e3 / reps:.3f} ms a call; the longest:", flush=True)
    for g, a, b in gaps[:8]:
        print(f"  {g:8.1f} us after {a[:60]} before {b[:60]}", flush=True)


def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def make(h, e, k, inter, t):
    cfg = Qwen3MoeConfig(hidden_size=h, moe_intermediate_size=inter, num_experts=e, num_experts_per_tok=k,
                         hidden_act="silu")
    cfg._experts_implementation = "eager"
    experts = Qwen3MoeExperts(cfg).to(dev, dtype)
    router = torch.randn(e, h, device=dev, dtype=dtype) / h**0.5
    with torch.no_grad():
        experts.gate_up_proj.normal_(0, h**-0.5)
        experts.down_proj.normal_(0, inter**-0.5)
    x = torch.randn(t, h, device=dev, dtype=dtype)
    probs = torch.nn.functional.linear(x, router).float().softmax(-1)
    w, ids = probs.topk(k, dim=-1)
    w = (w / w.sum(-1, keepdim=True)).to(dtype)
    return cfg, experts, router, x, ids, w


rows, decode_rows, held = [], [], {}
for key in opt.configs.split(","):
    name, h, e, k, inter = (CONFIGS if cuda else SMALL)[key]
    t = opt.tokens if cuda else 64
    torch.manual_seed(0)
    cfg, experts, router, x, ids, w = make(h, e, k, inter, t)
    fl = 6 * h * inter * t * k / 1e12
    dout = torch.randn_like(x)

    # Transformers' implementations: references for the checks, then timed.
    ref = ref_grads = None
    for impl in ("eager",) if opt.no_peers else ("eager", "grouped_mm", "sonicmoe"):
        cfg._experts_implementation = impl
        xg, wg = x.detach().clone().requires_grad_(True), w.detach().clone().requires_grad_(True)

        def fwd():
            with torch.no_grad():
                return experts(x, ids, w)

        def fwdbwd():
            experts.gate_up_proj.grad = experts.down_proj.grad = xg.grad = wg.grad = None
            experts(xg, ids, wg).backward(dout)

        try:
            out = fwd()
            fwdbwd()
        except Exception as err:  # sonicmoe needs the kernels library and CuteDSL
            print(f"{name} {impl}: not run ({type(err).__name__}: {str(err)[:160]})", flush=True)
            continue
        grads = [xg.grad, experts.gate_up_proj.grad, experts.down_proj.grad, wg.grad]
        grads = [g.detach().clone() for g in grads]
        if ref is None:
            ref, ref_grads = out.detach().clone(), grads
        err, gerr = rel(out, ref), max(rel(a, b) for a, b in zip(grads, ref_grads))
        if opt.no_peers:
            continue
        tf, tfb = timed(fwd), timed(fwdbwd)
        rows.append((name, f"transformers {impl}", tf, fl / tf * 1e3, tfb, 3 * fl / tfb * 1e3, peak_mb(fwdbwd), err, gerr))
        print(rows[-1], flush=True)
        for td in ([int(v) for v in opt.decode.split(",") if v] if cuda else []):
            def dfwd(td=td):
                with torch.no_grad():
                    experts(x[:td], ids[:td], w[:td])
            decode_rows.append((name, td, f"transformers {impl}", timed(dfwd)))
    cfg._experts_implementation = "eager"
    experts.gate_up_proj.grad = experts.down_proj.grad = None

    # Liger-Kernel's fused MoE: the same weights (its layout is Transformers': [E, 2I, H] gate then up,
    # [E, H, I]) and routing.
    if cuda and not opt.no_peers and LigerMoE is not None and key in opt.liger.split(","):
        gl = experts.gate_up_proj.detach().clone().requires_grad_(True)
        dl = experts.down_proj.detach().clone().requires_grad_(True)
        ids32 = ids.to(torch.int32)
        xl, wl = x.detach().clone().requires_grad_(True), w.detach().clone().requires_grad_(True)

        def lfwd():
            with torch.no_grad():
                return LigerMoE.apply(x, gl, dl, ids32, w)

        def lfwdbwd():
            gl.grad = dl.grad = xl.grad = wl.grad = None
            LigerMoE.apply(xl, gl, dl, ids32, wl).backward(dout)

        try:
            out = lfwd()
            lfwdbwd()
            err = rel(out, ref)
            gerr = max(rel(a, b) for a, b in zip([xl.grad, gl.grad, dl.grad, wl.grad], ref_grads))
            tf, tfb = timed(lfwd), timed(lfwdbwd)
            rows.append((name, "liger fused_moe", tf, fl / tf * 1e3, tfb, 3 * fl / tfb * 1e3, peak_mb(lfwdbwd), err, gerr))
            print(rows[-1], flush=True)
        except Exception as err:
            print(f"{name} liger fused_moe: not run ({type(err).__name__}: {str(err)[:160]})", flush=True)
        del gl, dl

    # kcpp, routing given: the same experts layer.
    gu, dn = experts.gate_up_proj.detach(), experts.down_proj.detach()
    out = torch.full_like(x, float("nan"))
    offsets = torch.empty(e + 2, dtype=torch.int32, device=dev)
    sorted_slots = torch.empty(t * k, dtype=torch.int32, device=dev)
    saved = torch.empty(t * k, 2 * inter, dtype=dtype, device=dev)
    dx, dgu, ddn = torch.empty_like(x), torch.empty_like(gu), torch.empty_like(dn)
    dw = torch.empty(t, k, dtype=torch.float32, device=dev)
    base = {"hidden": x, "routing": "given", "topk_ids": ids, "topk_weights": w, "gate_up_proj": gu, "down_proj": dn}
    fa = dict(base, out=out)
    ta = dict(fa, expert_offsets=offsets, sorted_slots=sorted_slots, gate_up=saved)
    ba = dict(base, expert_offsets=offsets, sorted_slots=sorted_slots, gate_up=saved, overwrite_gate_up=1, dout=dout,
              dhidden=dx, dgate_up_proj=dgu, ddown_proj=ddn, dtopk_weights=dw)
    modes = {"saved": (ta, ba)}
    if "recomputed" in opt.gate_up.split(","):
        modes["recomputed"] = ({k_: v for k_, v in ta.items() if k_ != "gate_up"},
                               {k_: v for k_, v in ba.items() if k_ not in ("gate_up", "overwrite_gate_up")})
    ok, why = layer.supports(ta, mode="training")
    if not ok:
        print(f"{name} kcpp: refused ({why})", flush=True)
        continue
    held[name] = saved.numel() * saved.element_size() / 2**20
    logits = torch.empty(t, e, dtype=dtype, device=dev)
    ids32, w32 = torch.empty(t, k, dtype=torch.int32, device=dev), torch.empty(t, k, dtype=torch.float32, device=dev)
    dr = torch.empty_like(router)
    blk = {"hidden": x, "router_weight": router, "routing": "softmax", "top_k": k, "normalize": 1, "gate_up_proj": gu,
           "down_proj": dn}
    bt = dict(blk, out=out, router_logits=logits, topk_ids=ids32, topk_weights=w32, expert_offsets=offsets,
              sorted_slots=sorted_slots, gate_up=saved)
    bb = dict(blk, router_logits=logits, topk_ids=ids32, topk_weights=w32, expert_offsets=offsets,
              sorted_slots=sorted_slots, gate_up=saved, overwrite_gate_up=1, dout=dout, dhidden=dx, drouter_weight=dr,
              dgate_up_proj=dgu, ddown_proj=ddn)
    for gemm in [g for g in opt.gemm.split(",") if g]:
        path, _, setting = gemm.partition(":")  # e.g. auto:KCPP_MOE_SM90=0
        os.environ["KCPP_MOE_GEMM"] = path
        for kv in filter(None, setting.split(";")):
            os.environ[kv.split("=", 1)[0]] = kv.split("=", 1)[1]
        # kcpp, routing given: the same experts layer.
        for mode, (mta, mba) in modes.items():
            for buf in (out, dx, dgu, ddn, dw):
                buf.fill_(float("nan"))
            layer.forward(mta, mode="training")
            layer.backward(mba)
            if cuda:
                torch.cuda.synchronize()
            err = rel(out, ref)
            gerr = max(rel(a, b) for a, b in zip((dx, dgu, ddn, dw), ref_grads))

            def kfwdbwd(mta=mta, mba=mba):
                layer.forward(mta, mode="training")
                layer.backward(mba)

            tf, tfb = timed(lambda: layer.forward(fa, mode="inference")), timed(kfwdbwd)
            if opt.profile and cuda:
                profile(f"{name} gemm={gemm} forward (inference)", lambda: layer.forward(fa, mode="inference"))
                profile(f"{name} gate_up {mode} gemm={gemm} forward + backward", kfwdbwd)
            rows.append((name, f"kcpp moe (routing given, gate_up {mode}) gemm={gemm}", tf, fl / tf * 1e3, tfb,
                         3 * fl / tfb * 1e3, peak_mb(kfwdbwd), err, gerr))
            print(rows[-1], flush=True)
        for td in ([int(v) for v in opt.decode.split(",") if v] if cuda else []):
            da = {"hidden": x[:td], "routing": "given", "topk_ids": ids[:td], "topk_weights": w[:td], "gate_up_proj": gu,
                  "down_proj": dn, "out": out[:td]}
            decode_rows.append((name, td, f"kcpp moe (routing given) gemm={gemm}",
                                timed(lambda da=da: layer.forward(da, mode="inference"))))

        # kcpp, the whole block: router GEMM, softmax top-k renormalized, experts.
        layer.forward(bt, mode="training")
        if cuda:
            torch.cuda.synchronize()
        same = (ids32.long() == ids).float().mean().item()

        def bfwd():
            layer.forward(dict(blk, out=out), mode="inference")

        def bfwdbwd():
            layer.forward(bt, mode="training")
            layer.backward(bb)

        tf, tfb = timed(bfwd), timed(bfwdbwd)
        rows.append((name, f"kcpp moe block gemm={gemm} (router; ids as above {same:.1%})", tf, fl / tf * 1e3, tfb,
                     3 * fl / tfb * 1e3, peak_mb(bfwdbwd), rel(out, ref), float("nan")))
        print(rows[-1], flush=True)
        for kv in filter(None, setting.split(";")):
            os.environ.pop(kv.split("=", 1)[0], None)
    os.environ.pop("KCPP_MOE_GEMM", None)
    del experts, x, out, saved, dx, dgu, ddn, gu, dn
    if cuda:
        torch.cuda.empty_cache()

ceiling = sustained_ceiling = float("nan")
if cuda:
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device=dev)
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device=dev)
    ms = timed(lambda: a @ b)
    ceiling = 2 * 8192**3 / ms / 1e9

    def sustained():  # ~28 ms of GEMMs back to back, as long as Mixtral's forward + backward
        for _ in range(20):
            a @ b

    sustained_ceiling = 2 * 8192**3 * 20 / timed(sustained) / 1e9
    del a, b

where = torch.cuda.get_device_name() if cuda else "cpu (smoke run: sizes small, timings meaningless)"
print(f"\n{where}, torch {torch.__version__}; {opt.tokens if cuda else 64} tokens, {dtype}; "
      f"dense bf16 GEMM 8192^3: {ceiling:.1f} TFLOP/s one at a time, {sustained_ceiling:.1f} twenty back to back")
print(f"{'dimensions':22s} {'implementation':58s} {'fwd ms':>8s} {'TFLOP/s':>8s} {'f+b ms':>8s} {'TFLOP/s':>8s} "
      f"{'peak MiB':>9s} {'out err':>9s} {'grad err':>9s}")
for name, impl, tf, ff, tfb, ffb, mem, err, gerr in rows:
    print(f"{name:22s} {impl:58s} {tf:8.3f} {ff:8.1f} {tfb:8.3f} {ffb:8.1f} {mem:9.0f} {err:9.2e} {gerr:9.2e}")
for name, mib in held.items():
    print(f"{name}: the kcpp rows with gate_up saved hold it from forward to backward, {mib:.0f} MiB outside their peak")
if decode_rows:
    print("\ndecode-sized forward (ms)")
    for name, td, impl, ms in decode_rows:
        print(f"{name:22s} {td:5d} tokens  {impl:48s} {ms:8.4f}")
