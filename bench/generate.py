"""Decoding speed: `kcpp generate` beside Transformers' generate() on the same random weights.

  python3 bench/generate.py [--models qwen3,llama,mamba,falcon_mamba] [--batches 1,8,32] [--new 128] [--kcpp .devlibs/bin/kcpp]

For each model's real dimensions (Qwen3-0.6B, Llama-3.2-1B; Mamba-1.4B and Falcon-Mamba-7B without the
static cache and the prefill row; random weights saved once as a bf16
Hugging Face folder) and each batch size: prompts of 16 random token ids, greedy, exactly --new new
tokens (end-of-sequence ignored), then
  - Transformers eager (dynamic cache, SDPA),
  - Transformers with a static cache (generate() compiles its decoding step itself),
  - kcpp generate (its default kernels), batch > 1 through --prompt-ids-file,
each timed on its second run (the first warms compilation and allocators; kcpp's --warmup does the
same in its process).  Then the parity of greedy ids in f32: kcpp's against Transformers' eager
generate() for 32 tokens, up to each row's first step where Transformers' own top-1 margin is below
1e-3 (after a near tie either pick is right and the rows may part); and a --prefill-token prompt
(2,048) to its first token beside Transformers' forward, against the bf16 GEMM ceiling measured in
the same call.  Decode tokens/s counts
the tokens after each row's first; the memory roofline is (weight bytes + KV bytes read per step, or
the state-space models' states read and written) / copy bandwidth, printed as a ceiling in tokens/s
for the batch.  Ratios hold within one call only.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

MODELS = {
    "qwen3": ("Qwen3-0.6B", "Qwen3Config", "Qwen3ForCausalLM",
              dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                   num_key_value_heads=8, head_dim=128, vocab_size=151936, rms_norm_eps=1e-6, rope_theta=1000000.0,
                   max_position_embeddings=40960, tie_word_embeddings=True)),
    "llama": ("Llama-3.2-1B", "LlamaConfig", "LlamaForCausalLM",
              dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                   num_key_value_heads=8, head_dim=64, vocab_size=128256, rms_norm_eps=1e-5, rope_theta=500000.0,
                   max_position_embeddings=131072, tie_word_embeddings=True)),
    # State-space models (no static cache, no prefill row): Mamba-1.4B's and Falcon-Mamba-7B's dimensions.
    "mamba": ("Mamba-1.4B", "MambaConfig", "MambaForCausalLM",
              dict(hidden_size=2048, expand=2, num_hidden_layers=48, state_size=16, conv_kernel=4,
                   time_step_rank=128, vocab_size=50280, layer_norm_epsilon=1e-5, tie_word_embeddings=True)),
    "falcon_mamba": ("Falcon-Mamba-7B", "FalconMambaConfig", "FalconMambaForCausalLM",
                     dict(hidden_size=4096, expand=2, num_hidden_layers=64, state_size=16, conv_kernel=4,
                          time_step_rank=256, vocab_size=65024, layer_norm_epsilon=1e-5, tie_word_embeddings=False,
                          mixer_rms_eps=1e-6)),
}
SSM = ("mamba", "falcon_mamba")
PROMPT = 16


def copy_gbps(torch):
    x = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(20):
        y.copy_(x)
    torch.cuda.synchronize()
    return 2 * 20 * x.numel() / (time.perf_counter() - t) / 1e9


def hf_run(model, ids, new, static):
    import torch
    kw = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
    if static:
        kw["cache_implementation"] = "static"
    model.generate(ids, **kw)  # warm-up (compilation for the static cache)
    torch.cuda.synchronize()
    t = time.perf_counter()
    out = model.generate(ids, **kw)
    torch.cuda.synchronize()
    return time.perf_counter() - t, out


def kcpp_run(kcpp, folder, rows, new, dtype="bf16", env=None):
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
        for r in rows:
            f.write(",".join(str(i) for i in r) + "\n")
        path = f.name
    cmd = [kcpp, "generate", "--model", folder, "--dtype", dtype, "--max-new-tokens", str(new), "--ignore-eos",
           "--stats-json", path + ".json", "--prompt-ids-file", path, "--warmup"]
    r = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, **(env or {})))
    if r.returncode != 0:
        return None, r.stderr.strip().splitlines()[-1] if r.stderr.strip() else f"exit {r.returncode}"
    with open(path + ".json") as f:
        return json.load(f), None


def gemm_tflops(torch):
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    b = torch.randn_like(a)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(10):
        a @ b
    torch.cuda.synchronize()
    return 10 * 2 * 8192**3 / (time.perf_counter() - t) / 1e12


def prefill(kcpp, model, folder, name, dims, tokens, ceiling, variants=""):
    """One prompt of `tokens` tokens to its first new token: Transformers' forward (last logits only)
    beside kcpp's time to first token (the median of three runs, each its own process after a
    warm-up prefill; the three listed), as tokens/s and as a share of the bf16 GEMM ceiling; then
    kcpp once with each of `variants` (as --variants gives them)."""
    import torch
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, dims["vocab_size"], (1, tokens), generator=g)
    layers, h, inter = dims["num_hidden_layers"], dims["hidden_size"], dims["intermediate_size"]
    hq, hkv, d = dims["num_attention_heads"], dims["num_key_value_heads"], dims["head_dim"]
    per_token = 2 * layers * (h * (hq + 2 * hkv) * d + hq * d * h + 3 * h * inter) + 2 * h * dims["vocab_size"] / tokens
    flops = per_token * tokens + layers * 4 * hq * d * tokens * tokens / 2  # causal attention: half the scores
    with torch.no_grad():
        model(input_ids=ids.cuda(), logits_to_keep=1)
        torch.cuda.synchronize()
        t = time.perf_counter()
        model(input_ids=ids.cuda(), logits_to_keep=1)
        torch.cuda.synchronize()
        hf = time.perf_counter() - t
    line = (f"{name:13s} prefill {tokens} | GEMM ceiling {ceiling:5.0f} TFLOP/s | hf {tokens / hf:8.0f} tok/s "
            f"({flops / hf / 1e12:5.0f} TFLOP/s)")
    times, err = [], None
    for _ in range(3):
        stats, err = kcpp_run(kcpp, folder, ids.tolist(), 1)
        if stats is None:
            break
        times.append(stats["first_token_seconds"])
    if len(times) < 3:
        line += f" | kcpp failed: {err}"
    else:
        s = sorted(times)[1]
        line += (f" | kcpp {tokens / s:8.0f} tok/s ({flops / s / 1e12:5.0f} TFLOP/s = "
                 f"{100 * flops / s / 1e12 / ceiling:4.1f}% of the ceiling; first token {1e3 * s:6.2f} ms, the median of "
                 + ", ".join(f"{1e3 * t:.2f}" for t in times) + ")")
        for label, _, settings in [v.partition(":") for v in filter(None, variants.split(","))]:
            env = dict(setting.partition("=")[::2] for setting in filter(None, settings.split("+")))
            u, verr = kcpp_run(kcpp, folder, ids.tolist(), 1, env=env)
            if u is None:
                line += f" | {label} failed: {verr}"
            else:
                s = u["first_token_seconds"]
                line += f" | {label} {100 * flops / s / 1e12 / ceiling:4.1f}% ({1e3 * s:5.2f} ms)"
    print(line, flush=True)


def parity(kcpp, folder, name, vocab, rows=4, new=32, margin=1e-3):
    """kcpp's f32 greedy ids against Transformers' f32 eager generate(), over the clear steps."""
    import torch
    import transformers
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).to("cuda").eval()
    g = torch.Generator().manual_seed(1234)
    ids = torch.randint(0, vocab, (rows, PROMPT), generator=g)
    with torch.no_grad():
        out = model.generate(ids.cuda(), max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0,
                             output_scores=True, return_dict_in_generate=True)
    top2 = torch.stack([s.float().topk(2, dim=-1).values for s in out.scores], 1)  # [rows, new, 2]
    clear = (top2[..., 0] - top2[..., 1] >= margin).cpu()
    del model
    torch.cuda.empty_cache()
    stats, err = kcpp_run(kcpp, folder, ids.tolist(), new, "f32")
    if stats is None:
        print(f"{name:13s} f32 parity: kcpp failed: {err}", flush=True)
        return
    same, steps = 0, 0
    for r in range(rows):
        n = int(clear[r].long().cumprod(0).sum())  # steps before the first unclear one
        steps += n
        hf_new = out.sequences[r, PROMPT:PROMPT + n].tolist()
        same += stats["ids"][r][PROMPT:PROMPT + n] == hf_new
    print(f"{name:13s} f32 parity: {same}/{rows} rows identical to Transformers over their clear steps "
          f"({steps} of {rows * new} steps have a top-1 margin >= {margin:g})", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="qwen3,llama")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--kcpp", default=os.path.join(os.path.dirname(__file__), "..", ".devlibs", "bin", "kcpp"))
    ap.add_argument("--skip-static", action="store_true")
    ap.add_argument("--skip-parity", action="store_true")
    ap.add_argument("--skip-hf", action="store_true", help="no Transformers generate() rows (kcpp's and its variants only): "
                    "the weights are made on the GPU, which takes seconds where the CPU takes a minute at 7B")
    ap.add_argument("--prefill", type=int, default=2048, help="prompt tokens of the prefill run (0: none)")
    ap.add_argument("--variants", default="", help="also time kcpp with these settings, e.g. "
                    "unfused:KCPP_DECODE_FUSED=0,cublas:KCPP_GEMV=0+KCPP_PDL=0 ('+' joins the settings of one variant; "
                    "marked '(ids differ)' where its greedy ids are not the default run's)")
    a = ap.parse_args()
    import torch
    import transformers
    gbps = copy_gbps(torch)
    ceiling = gemm_tflops(torch) if a.prefill else 0.0
    print(f"{torch.cuda.get_device_name()}: copy {gbps:.0f} GB/s; torch {torch.__version__}, transformers "
          f"{transformers.__version__}; {PROMPT}-token prompts, {a.new} new tokens, greedy, bf16", flush=True)
    for key in a.models.split(","):
        name, cfg_name, model_name, dims = MODELS[key]
        config = getattr(transformers, cfg_name)(**dims)
        if key not in SSM:
            config._attn_implementation = "sdpa"
        torch.manual_seed(0)
        if a.skip_hf:
            with torch.device("cuda"):
                model = getattr(transformers, model_name)(config).to(torch.bfloat16).eval()
        else:
            model = getattr(transformers, model_name)(config).to("cuda", torch.bfloat16).eval()
        folder = tempfile.mkdtemp(prefix=f"kcpp-{key}-")
        model.save_pretrained(folder)
        weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        ssm = key in SSM
        state_per_row = 0
        if ssm:  # per step and row: the SSM state (f32) and the conv state (bf16) read and written, whatever the length
            kv_per_token = 0
            d_inner = dims["expand"] * dims["hidden_size"]
            state_per_row = 2 * dims["num_hidden_layers"] * d_inner * (4 * dims["state_size"] + 2 * (dims["conv_kernel"] - 1))
        else:
            kv_per_token = 2 * dims["num_hidden_layers"] * dims["num_key_value_heads"] * dims["head_dim"] * 2
        for batch in (int(b) for b in a.batches.split(",")):
            g = torch.Generator().manual_seed(batch)
            ids = torch.randint(0, dims["vocab_size"], (batch, PROMPT), generator=g)
            avg_len = PROMPT + a.new / 2
            roof = gbps * 1e9 / (weight_bytes + batch * (avg_len * kv_per_token + state_per_row)) * batch
            line = f"{name:13s} batch {batch:4d} | roofline {roof:8.0f} tok/s"
            out_eager = None
            with torch.no_grad():
                if not a.skip_hf:
                    secs, out_eager = hf_run(model, ids.cuda(), a.new, False)
                    line += f" | hf eager {batch * a.new / secs:8.0f}"
                if not a.skip_hf and not a.skip_static and not ssm:
                    try:
                        secs, _ = hf_run(model, ids.cuda(), a.new, True)
                        line += f" | hf static+compile {batch * a.new / secs:8.0f}"
                    except Exception as e:  # noqa: BLE001  (reported, the others still run)
                        line += f" | hf static failed: {str(e).splitlines()[0][:80]}"
            stats, err = kcpp_run(a.kcpp, folder, ids.tolist(), a.new)
            if stats is None:
                line += f" | kcpp failed: {err}"
            else:
                total = stats["new_tokens"] / stats["seconds"]
                decode = stats["decode_tokens"] / max(stats["decode_seconds"], 1e-9)
                line += (f" | kcpp {total:8.0f} (decode {decode:8.0f} = {100 * decode / roof:5.1f}% of roofline; "
                         f"first token {1e3 * stats['first_token_seconds']:6.1f} ms; "
                         f"{stats.get('graph_replays', 0)} graph replays)")
                for variant in filter(None, a.variants.split(",")):  # the same run with a switch of kcpp's set
                    label, _, settings = variant.partition(":")
                    env = dict(setting.partition("=")[::2] for setting in settings.split("+"))
                    u, verr = kcpp_run(a.kcpp, folder, ids.tolist(), a.new, env=env)
                    if u is not None:
                        line += f" | {label} decode {u['decode_tokens'] / max(u['decode_seconds'], 1e-9):8.0f}"
                        line += "" if u["ids"] == stats["ids"] else " (ids differ)"
                    else:
                        line += f" | {label} failed: {verr}"
                # In bf16 near ties part the rows early; the f32 parity below is the check.
                if out_eager is not None:
                    same = sum(1 for r in range(batch) if stats["ids"][r] == out_eager[r].tolist())
                    line += f" | bf16 rows equal to hf eager: {same}/{batch}"
            print(line, flush=True)
        if a.prefill and not ssm:
            prefill(a.kcpp, model, folder, name, dims, a.prefill, ceiling, a.variants)
        del model
        torch.cuda.empty_cache()
        if not a.skip_parity:
            parity(a.kcpp, folder, name, dims["vocab_size"], rows=4)
    return 0


if __name__ == "__main__":
    sys.exit(main())
