"""The multi-GPU training anchor: a Hugging Face LlamaForCausalLM trained under PyTorch FSDP2
(`fully_shard`), one process a GPU, with Liger-Kernel's kernels, kcpp's (through `kcpp.torch`) or none:
what a Transformers user runs instead of `kcpp train --gpus N`.  Tokens/s of the whole group after
warm-up, and each GPU's peak memory.

  torchrun --nproc_per_node 4 bench/fsdp2_step.py --kernels liger --vocab 128256
  python3 bench/fsdp2_step.py ...          # one process, one GPU (FSDP2 over a group of one)

The model is `kcpp train`'s generated Llama for the same --hidden / --layers / --vocab / --seq
(tools/kcpp/train_command.cpp, small_llama: intermediate 3 x hidden, heads of 64, half as many KV
heads), so the two compare at the same dimensions and the same global batch; the data are random
token ids (the speed does not depend on them).  FSDP2 keeps f32 parameters and computes in bf16
(MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=--reduce-dtype)), AdamW fused, the gradients
clipped to norm 1.0: the arithmetic of kcpp's bf16 weights with f32 master copies.  Each decoder layer
is a group of its own and the root holds the embedding, the final norm and lm_head (Liger's fused
linear cross-entropy reads lm_head's weight outside lm_head's forward, which a separately sharded
lm_head would leave sharded).

Liger's source is read from $LIGER_SRC, or from .anchors/src (git-ignored, see bench/RESULTS.md).
"""
import argparse
import os
import sys
import time


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kernels", choices=["none", "liger", "kcpp"], default="liger")
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=4, help="sequences a GPU")
    ap.add_argument("--steps", type=int, default=20, help="timed steps, after 3 of warm-up")
    ap.add_argument("--reduce-dtype", choices=["f32", "bf16"], default="f32")
    ap.add_argument("--lr", type=float, default=3e-4)
    a = ap.parse_args()

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from transformers import LlamaConfig, LlamaForCausalLM

    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local = int(os.environ.get("LOCAL_RANK", 0))
    if "RANK" not in os.environ:  # one process: a group of one
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29511"), RANK="0", WORLD_SIZE="1")
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))

    head_dim = 64 if a.hidden >= 256 else a.hidden // 4
    heads = a.hidden // head_dim
    cfg = LlamaConfig(hidden_size=a.hidden, intermediate_size=3 * a.hidden, vocab_size=a.vocab, num_hidden_layers=a.layers,
                      num_attention_heads=heads, num_key_value_heads=heads // 2, head_dim=head_dim,
                      max_position_embeddings=a.seq, rms_norm_eps=1e-5, tie_word_embeddings=False)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    if a.kernels == "liger":
        sys.path.insert(0, os.environ.get("LIGER_SRC", os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".anchors", "src")))
        from liger_kernel.transformers import apply_liger_kernel_to_llama
        apply_liger_kernel_to_llama()  # its defaults: RoPE, RMSNorm, SwiGLU, the fused linear cross-entropy
    model = LlamaForCausalLM(cfg).to("cuda")
    if a.kernels == "kcpp":
        import kcpp.torch as kt
        kt.kernelize(model)
    mesh = init_device_mesh("cuda", (world,))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                              reduce_dtype=torch.float32 if a.reduce_dtype == "f32" else torch.bfloat16)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=0.01, fused=True)
    g = torch.Generator(device="cuda").manual_seed(1 + rank)
    ids = torch.randint(0, a.vocab, (a.batch, a.seq), device="cuda", generator=g)

    def step():
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    dist.barrier()
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    for _ in range(a.steps):
        loss = step()
    torch.cuda.synchronize()
    dist.barrier()
    seconds = time.perf_counter() - t0
    peak = torch.tensor([torch.cuda.max_memory_allocated() / 2**20], device="cuda")
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    if rank == 0:
        tokens = world * a.batch * a.seq * a.steps
        print(f"FSDP2 {a.kernels:5s} {world} GPU(s), reduce {a.reduce_dtype}: {tokens / seconds:10.0f} tokens/s "
              f"({tokens / seconds / world:8.0f} a GPU), {1e3 * seconds / a.steps:7.1f} ms a step, "
              f"peak {peak.item():7.0f} MiB a GPU, loss {loss.item():.4f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
