"""The anchors' timer: triton.testing.do_bench's method (zero a buffer to flush the L2, then time one
call between CUDA events; the median) with an 8 GiB buffer instead of 256 MiB, so that a call whose
host side is slow is still timed by the GPU's work, not by the host (bench/RESULTS.md, "kcpp and
Liger under one timer").  Used by anchors_kcpp.py and anchors_extra.py."""
import statistics
import time

import torch

dev = "cuda"
_FLUSH = None


def bench_deep(fn, warmup=10, rep=40):
    """do_bench's method (zero a buffer to flush the L2, then time one call between events; the
    median) with an 8 GiB buffer instead of 256 MiB: the GPU then spends ~2 ms zeroing before each
    timed call, and a host that takes up to that long to enqueue the call is still ahead of the GPU.
    With do_bench's 256 MiB (~60 us) a call whose host side takes longer than that plus the kernel
    is timed with the GPU idle waiting for it: on the lent machine a Liger autograd call takes
    100-1400 us of host time (anchors_kcpp.py measures it), so do_bench figures of short kernels vary with the
    host's speed from one call to the next."""
    global _FLUSH
    if _FLUSH is None:
        _FLUSH = torch.empty(8 * 2**30 // 4, dtype=torch.int32, device=dev)
    for _ in range(warmup):
        fn()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(rep)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(rep)]
    torch.cuda.synchronize()
    for i in range(rep):
        _FLUSH.zero_()
        starts[i].record()
        fn()
        ends[i].record()
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) for a, b in zip(starts, ends))


def bench_both_orders(fns):
    """bench_deep of each callable of `fns` twice, all in order and then in reverse order (so a call's
    position after another's does not bias one of them); per callable the list of its two figures, or
    None where `fns` has None."""
    times = [[] if f is not None else None for f in fns]
    order = [i for i, f in enumerate(fns) if f is not None]
    for i in order + order[::-1]:
        times[i].append(bench_deep(fns[i]))
    return times


def backward_fresh(out, dout, leaves):
    """out.backward(dout) with the leaves' gradients cleared first, as a training step clears them
    (zero_grad(set_to_none=True)): the gradients are then stored, not added into the previous call's,
    so a timed forward + backward of a peer pays no accumulation adds (about 0.14 ms an attention call
    at B4 S4096, 32 / 8 heads of 128)."""
    for t in leaves:
        t.grad = None
    out.backward(dout)


def sdpa_cudnn_causal(q, k, v, qg, kg, vg, do):
    """The causal cuDNN attention through SDPA (grouped heads), the peer the attention benches time: its
    forward on q, k, v without autograd, and its forward + backward on the leaves qg, kg, vg with dout do."""
    backend = torch.nn.attention.SDPBackend.CUDNN_ATTENTION
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def forward():
        with torch.nn.attention.sdpa_kernel(backend), torch.no_grad():
            sdpa(q, k, v, is_causal=True, enable_gqa=True)

    def forward_backward():
        with torch.nn.attention.sdpa_kernel(backend):
            backward_fresh(sdpa(qg, kg, vg, is_causal=True, enable_gqa=True), do, (qg, kg, vg))
    return forward, forward_backward


def back_to_back(fn, reps):
    """ms a call of `reps` calls timed together between two events, no L2 flush between them (after
    one untimed call): for slow references and for comparing with bench_deep's flushed figure."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def host_us(fn, n=50):
    """Host time a call takes to enqueue its work (no synchronisation inside the loop): a timed
    figure means the GPU's time only while this stays below it plus do_bench's flush (~60 us)."""
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    t = time.perf_counter() - t
    torch.cuda.synchronize()
    return t / n * 1e6


def kernel_table(fn, title, top=8):
    """Prints the GPU kernels of one call of fn (after one unprofiled call), by total time, under
    torch.profiler: where a call's time goes (a single call: figures within a few percent of the timed ones)."""
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    evs = [e for e in prof.key_averages() if str(getattr(e, "device_type", "")).endswith("CUDA") and e.device_time_total > 0]
    total = sum(e.device_time_total for e in evs)
    print(f"  kernels of {title}: {total / 1e3:.3f} ms in all", flush=True)
    for e in sorted(evs, key=lambda e: -e.device_time_total)[:top]:
        print(f"    {e.device_time_total / 1e3:8.3f} ms  x{e.count:<3d} {e.key[:100]}", flush=True)

