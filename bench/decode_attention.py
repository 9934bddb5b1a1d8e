"""Decoding attention's peers: PyTorch SDPA with one query per row over a KV cache, at the shapes of
kcpp_bench_kernels --only decode_attention (Llama-3-8B heads: 32 query / 8 kv heads of 128, bf16).

  python3 bench/decode_attention.py

Traffic is K and V read once; GB/s and the share of the copy rate measured here are printed beside
the time, as kcpp_bench_kernels prints them.  Both run in one device call so that the ratios hold.
"""
import torch
import torch.nn.functional as F

SHAPES = [(1, 1024), (1, 4096), (1, 16384), (1, 65536), (8, 4096), (32, 1024), (32, 4096), (128, 1024)]


def timed(fn, reps=50):
    for _ in range(10):
        fn()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    times.sort()
    return times[len(times) // 2]


def copy_rate():
    """The device copy rate in GB/s (bytes read and written), printed with the device's name."""
    x = torch.empty(2**31, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    copy = 2 * x.numel() / (timed(lambda: y.copy_(x), 20) * 1e-3) / 1e9
    del x, y
    print(f"{torch.cuda.get_device_name()}: copy {copy:.0f} GB/s, torch {torch.__version__}")
    return copy


def main():
    copy = copy_rate()
    for b, ctx in SHAPES:
        q = torch.randn(b, 32, 1, 128, dtype=torch.bfloat16, device="cuda")
        k = torch.randn(b, 8, ctx, 128, dtype=torch.bfloat16, device="cuda")
        v = torch.randn_like(k)
        gb = 2 * b * 8 * ctx * 128 * 2 / 1e9
        for name, backend in (("sdpa-flash", torch.nn.attention.SDPBackend.FLASH_ATTENTION),
                              ("sdpa-cudnn", torch.nn.attention.SDPBackend.CUDNN_ATTENTION),
                              ("sdpa-efficient", torch.nn.attention.SDPBackend.EFFICIENT_ATTENTION)):
            try:
                with torch.nn.attention.sdpa_kernel(backend):
                    ms = timed(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True))
                print(f"decode_attn b{b} ctx{ctx:<6d} {name:15s} {ms:9.4f} ms {gb / (ms * 1e-3):8.0f} GB/s "
                      f"{100 * gb / (ms * 1e-3) / copy:5.1f}% of copy")
            except Exception as e:  # noqa: BLE001  (a backend that refuses the shape is reported)
                print(f"decode_attn b{b} ctx{ctx:<6d} {name:15s} unavailable: {str(e).splitlines()[0][:70]}")
        del q, k, v
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
