"""kcpp.torch on the GPU: Hugging Face models kernelized through the bridge, against themselves.

  python3 bench/hf_bridge.py parity        # Llama-3.2-1B and Qwen3-0.6B dimensions, random weights
  python3 bench/hf_bridge.py step [CONFIG] # the training step of ../shared/anchors/e2e.py, kernelized
  python3 bench/hf_bridge.py gemma2 [CONFIG] # Gemma 2's step (soft-capped attention) beside its peers

parity (KCPP_PARITY_MODELS: a comma-separated subset): each model with and without kcpp.torch.kernelize (this build's liger and flash_attn; the
attention as attn_implementation="kcpp"): f32 logits (relative L2 over the whole [B, S, V], TF32 off),
then in bf16 the loss and the cosine of every parameter's gradient.  Issue 22's bar: logits within
1e-5, loss within 1e-2, every cosine >= 0.999.  Two bf16 runs differ by their rounding, so each bf16
gradient is also held against Transformers' f32 gradient: "bf16 error vs Transformers' own" is the
smallest, over the parameters, of cos(kcpp bf16, f32) - cos(Transformers bf16, f32) — at or above
-1e-3 when the kernels' bf16 is no further from f32 than Transformers' own bf16 is.  The report's call
counts show which layers ran a kernel.

step: e2e.py's step (LlamaForCausalLM at Llama-3-8B dimensions, 4 layers, 4 x 2048 tokens, bf16,
forward + backward, do_bench median of 10, peak = step's peak minus the weights) with the model
kernelized by kcpp.  CONFIG: kcpp (Liger's defaults: fused linear cross-entropy), kcpp_ce (plain
cross-entropy), kcpp_compile (kcpp, then torch.compile of forward); each in a process of its own.
Lines print as e2e.py prints them, so the two scripts' output reads as one table: run e2e.py's
configurations in the same call for the ratios.

gemma2: Gemma2ForCausalLM at Gemma-2-27B's dimensions (heads of 128, attention logits capped at 50,
final logits at 30, sliding windows of 4096 on alternate layers; KCPP_GEMMA2_DIMS=9b: Gemma-2-9B's,
16 / 8 heads of 256), 4 layers, 4 x 2048 tokens, bf16,
forward + backward, measured as step's.  CONFIG: gemma2_eager (Transformers' eager attention, what
Gemma 2 needs for the cap), gemma2_flex (attn_implementation="flex_attention", the cap as its score
mod), gemma2_kcpp (kernelized: flash_attn with the cap, Liger's defaults for the rest); each in a process
of its own, the loss printed beside the time.

Needs kcpp importable (PYTHONPATH with the built package; on the lent machine .devlibs/python, see
scripts/device-python.sh) and KCPP_PACKAGES_DIR where the built packages are.
"""
import os
import subprocess
import sys
import time

STEP_CONFIGS = ["kcpp", "kcpp_ce", "kcpp_compile"]
GEMMA_CONFIGS = ["gemma2_eager", "gemma2_flex", "gemma2_kcpp"]
LABELS = {"kcpp": "hf + kcpp (default, FLCE)", "kcpp_ce": "hf + kcpp (CE, not FLCE)",
          "kcpp_compile": "hf + kcpp + torch.compile", "gemma2_eager": "gemma2 eager attention",
          "gemma2_flex": "gemma2 flex_attention", "gemma2_kcpp": "gemma2 + kcpp"}
# Gemma-2-27B's config.json, 4 layers.
GEMMA2_27B = dict(hidden_size=4608, intermediate_size=36864, num_hidden_layers=4, num_attention_heads=32,
                  num_key_value_heads=16, head_dim=128, vocab_size=256000, query_pre_attn_scalar=144,
                  sliding_window=4096, attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
                  max_position_embeddings=8192, rms_norm_eps=1e-6)
# Gemma-2-9B's config.json, 4 layers: heads of 256 (flash_attn's Hopper backward at head dim 256).
GEMMA2_9B = dict(hidden_size=3584, intermediate_size=14336, num_hidden_layers=4, num_attention_heads=16,
                 num_key_value_heads=8, head_dim=256, vocab_size=256000, query_pre_attn_scalar=256,
                 sliding_window=4096, attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
                 max_position_embeddings=8192, rms_norm_eps=1e-6)
H, I, V, L, B, S = 4096, 14336, 128256, 4, 4, 2048
DEVICE = os.environ.get("KCPP_BENCH_DEVICE", "cuda")  # parity only; "cpu" for a smoke test

# Real dimensions (config.json of meta-llama/Llama-3.2-1B and Qwen/Qwen3-0.6B), random weights.
PARITY_MODELS = {
    "Llama-3.2-1B": ("LlamaConfig", "LlamaForCausalLM",
                     dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                          num_key_value_heads=8, head_dim=64, vocab_size=128256, rms_norm_eps=1e-5,
                          rope_theta=500000.0, max_position_embeddings=131072, tie_word_embeddings=True)),
    "Qwen3-0.6B": ("Qwen3Config", "Qwen3ForCausalLM",
                   dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                        num_key_value_heads=8, head_dim=128, vocab_size=151936, rms_norm_eps=1e-6,
                        rope_theta=1000000.0, max_position_embeddings=40960, tie_word_embeddings=True)),
    # Gemma-2-2B: heads of 256, attention logits capped at 50 (Transformers' reference is then eager).
    "Gemma-2-2B": ("Gemma2Config", "Gemma2ForCausalLM",
                   dict(hidden_size=2304, intermediate_size=9216, num_hidden_layers=26, num_attention_heads=8,
                        num_key_value_heads=4, head_dim=256, vocab_size=256000, query_pre_attn_scalar=256,
                        sliding_window=4096, attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
                        max_position_embeddings=8192, rms_norm_eps=1e-6)),
}


def _kcpp():
    import kcpp.torch as kt
    return kt


def _calls(report):
    return ", ".join(f"{e['layer']} {e['kernel_calls']}k/{e['reference_calls']}r/{e['fallbacks']}f"
                     for e in report.entries)


def parity():
    import torch
    import transformers
    kt = _kcpp()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    ok = True
    only = os.environ.get("KCPP_PARITY_MODELS")  # a comma-separated subset of PARITY_MODELS' names
    for name, (cfg_name, model_name, dims) in PARITY_MODELS.items():
        if only and name not in only.split(","):
            continue
        config = getattr(transformers, cfg_name)(**dims)
        config._attn_implementation = "eager" if dims.get("attn_logit_softcapping") else "sdpa"  # SDPA has no cap
        torch.manual_seed(0)
        model = getattr(transformers, model_name)(config).to(DEVICE, torch.float32)
        gen = torch.Generator(device=DEVICE).manual_seed(1)
        ids = torch.randint(0, dims["vocab_size"], (2, 512), device=DEVICE, generator=gen)
        labels = ids.clone()
        labels[0, :7] = -100

        model.eval()
        with torch.no_grad():
            ref = model(input_ids=ids).logits
            kt.kernelize(model)
            got = model(input_ids=ids).logits
        rel = ((got - ref).norm() / ref.norm()).item()
        calls = _calls(kt.report(model))
        kt.unkernelize(model)
        del ref, got

        def loss_and_grads():
            model.zero_grad(set_to_none=True)
            loss = model(input_ids=ids, labels=labels).loss
            loss.backward()
            return loss.item(), {n: p.grad.float().flatten() for n, p in model.named_parameters() if p.grad is not None}

        # Transformers' f32 gradients: what each bf16 run's own error is measured against.
        model.train()
        _, grads_f32 = loss_and_grads()
        model.zero_grad(set_to_none=True)
        model.to(torch.bfloat16)
        loss_ref, grads_ref = loss_and_grads()
        kt.kernelize(model)
        loss_got, grads_got = loss_and_grads()
        train_calls = _calls(kt.report(model))
        kt.unkernelize(model)
        cos = {n: torch.nn.functional.cosine_similarity(grads_got[n], grads_ref[n], dim=0).item() for n in grads_ref}
        worst = min(cos, key=cos.get)
        missing = sorted(set(grads_ref) - set(grads_got))
        passed = rel <= 1e-5 and abs(loss_got - loss_ref) <= 1e-2 and cos[worst] >= 0.999 and not missing
        ok &= passed
        print(f"{name:13s} f32 logits rel L2 {rel:.2e} (bar 1e-5) | bf16 loss {loss_got:.5f} vs {loss_ref:.5f} "
              f"(|diff| {abs(loss_got - loss_ref):.1e}, bar 1e-2) | min grad cosine {cos[worst]:.6f} at {worst} "
              f"over {len(cos)} grads (bar 0.999) | {'PASS' if passed else 'FAIL'}", flush=True)
        f32_cos = torch.nn.functional.cosine_similarity
        to_f32_kcpp = {n: f32_cos(grads_got[n], grads_f32[n], dim=0).item() for n in grads_ref}
        to_f32_hf = {n: f32_cos(grads_ref[n], grads_f32[n], dim=0).item() for n in grads_ref}
        print(f"{'':13s} at {worst}, against Transformers' f32 gradient: kcpp bf16 "
              f"{to_f32_kcpp[worst]:.6f}, Transformers bf16 {to_f32_hf[worst]:.6f}", flush=True)
        gap = {n: to_f32_kcpp[n] - to_f32_hf[n] for n in grads_ref}
        far = min(gap, key=gap.get)
        lowest_hf = min(to_f32_hf, key=to_f32_hf.get)
        print(f"{'':13s} bf16 error vs Transformers' own: min over {len(gap)} grads of cos(kcpp bf16, f32) - "
              f"cos(Transformers bf16, f32) = {gap[far]:+.2e} at {far} ({'PASS' if gap[far] >= -1e-3 else 'FAIL'}, "
              f"bar -1e-3); Transformers' own bf16 reaches down to {to_f32_hf[lowest_hf]:.6f} at {lowest_hf}",
              flush=True)
        print(f"{'':13s} calls, eval: {calls}", flush=True)
        print(f"{'':13s} calls, train: {train_calls}", flush=True)
        del model, grads_ref, grads_got, grads_f32
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
    return 0 if ok else 1


def step(which):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    kt = _kcpp()

    cfg = LlamaConfig(hidden_size=H, intermediate_size=I, vocab_size=V, num_hidden_layers=L,
                      num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
                      rope_theta=500000.0)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    ids = torch.randint(0, V, (B, S), device="cuda")
    model = LlamaForCausalLM(cfg).to("cuda", torch.bfloat16)
    if which == "kcpp_ce":
        kt.kernelize(model, liger_kernel_config={"fused_linear_cross_entropy": False, "cross_entropy": True})
    else:
        kt.kernelize(model)
    if which.endswith("compile"):
        model.forward = torch.compile(model.forward)

    _time_step(model, ids, LABELS[which], kt, show_loss=False)
    return 0


def _time_step(model, ids, label, kt, show_loss):
    """Times the training step of `model` on `ids` (labels = ids): three warm-up steps, do_bench's median of
    10, then the step's peak memory beyond what was allocated before it; prints e2e.py's line (with the
    first step's loss when `show_loss`) and, with `kt`, the report's call counts."""
    import torch
    import triton
    losses = []

    def one():
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        losses.append(loss.detach())
        model.zero_grad(set_to_none=True)

    t0 = time.time()
    for _ in range(3):
        one()
    torch.cuda.synchronize()
    warm = time.time() - t0
    ms = triton.testing.do_bench(one, warmup=1, rep=10, return_mode="median")
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    one()
    torch.cuda.synchronize()
    mib = (torch.cuda.max_memory_allocated() - base) / 2**20
    loss = f"  loss {losses[0].item():.5f}" if show_loss else ""
    print(f"{label:28s} {ms:8.1f} ms  {B * S / (ms / 1e3):8.0f} tok/s  peak {mib:8.0f} MiB{loss}"
          f"  (warm-up {warm:.0f} s)", flush=True)
    if kt is not None:
        print(f"{'':28s} calls: {_calls(kt.report(model))}", flush=True)


def gemma2_step(which):
    import torch
    from transformers import Gemma2Config, Gemma2ForCausalLM
    kt = _kcpp()

    dims = {"27b": GEMMA2_27B, "9b": GEMMA2_9B}.get(os.environ.get("KCPP_GEMMA2_DIMS", "27b"))
    if dims is None:
        sys.exit("KCPP_GEMMA2_DIMS is 27b or 9b")
    cfg = Gemma2Config(**dims)
    cfg._attn_implementation = "flex_attention" if which == "gemma2_flex" else "eager"
    torch.manual_seed(0)
    v = dims["vocab_size"]
    ids = torch.randint(0, v, (B, S), device="cuda")
    model = Gemma2ForCausalLM(cfg).to("cuda", torch.bfloat16)
    kernelized = which == "gemma2_kcpp"
    if kernelized:
        kt.kernelize(model)
    _time_step(model, ids, LABELS[which], kt if kernelized else None, show_loss=True)
    return 0


def main(argv):
    if not argv or argv[0] not in ("parity", "step", "gemma2"):
        sys.exit("usage: hf_bridge.py parity | step [" + " | ".join(STEP_CONFIGS) + "] | gemma2 ["
                 + " | ".join(GEMMA_CONFIGS) + "]")
    if argv[0] == "parity":
        return parity()
    configs = GEMMA_CONFIGS if argv[0] == "gemma2" else STEP_CONFIGS
    run_one = gemma2_step if argv[0] == "gemma2" else step
    if len(argv) > 1:
        if argv[1] not in configs:
            sys.exit(f"unknown configuration {argv[1]!r}; one of: {', '.join(configs)}")
        return run_one(argv[1])
    rc = 0
    for c in configs:
        r = subprocess.run([sys.executable, os.path.abspath(__file__), argv[0], c])
        if r.returncode != 0:
            print(f"{LABELS[c]:28s} failed (exit {r.returncode})", flush=True)
            rc = 1
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
