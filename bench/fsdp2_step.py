"""The multi-GPU training anchor: a Hugging Face LlamaForCausalLM trained under PyTorch FSDP2
(`fully_shard`), one process a GPU, with Liger-Kernel's kernels, kcpp's (through `kcpp.torch`) or none:
what a Transformers user runs instead of `kcpp train --gpus N`.  Tokens/s of the whole group after
warm-up, and each GPU's peak memory.  bench/deepspeed_step.py is the same under DeepSpeed ZeRO-3.

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

KERNELS = ["none", "liger", "liger_ce", "kcpp"]


def arguments(description, reduce_default="f32"):
    """The options both anchors take (the model's dimensions, the batch a GPU, the kernels)."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--kernels", choices=KERNELS, default="liger",
                    help="liger: Liger's defaults (RoPE, RMSNorm, SwiGLU, the fused linear cross-entropy); "
                         "liger_ce: the same with its plain cross-entropy; kcpp: kcpp.torch.kernelize")
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=4, help="sequences a GPU")
    ap.add_argument("--steps", type=int, default=20, help="timed steps, after 3 of warm-up")
    ap.add_argument("--reduce-dtype", choices=["f32", "bf16"], default=reduce_default)
    ap.add_argument("--lr", type=float, default=3e-4)
    return ap


def ranks():
    """(rank, world size, local rank) from the launcher's variables; one process is a group of one."""
    if "RANK" not in os.environ:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29511"), RANK="0",
                          WORLD_SIZE="1", LOCAL_RANK="0")
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", 0))


def build_model(a):
    """kcpp train's generated Llama on the current GPU, in f32, with the kernels --kernels names."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    head_dim = 64 if a.hidden >= 256 else a.hidden // 4
    heads = a.hidden // head_dim
    cfg = LlamaConfig(hidden_size=a.hidden, intermediate_size=3 * a.hidden, vocab_size=a.vocab, num_hidden_layers=a.layers,
                      num_attention_heads=heads, num_key_value_heads=heads // 2, head_dim=head_dim,
                      max_position_embeddings=a.seq, rms_norm_eps=1e-5, tie_word_embeddings=False)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    if a.kernels.startswith("liger"):
        sys.path.insert(0, os.environ.get("LIGER_SRC", os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".anchors", "src")))
        from liger_kernel.transformers import apply_liger_kernel_to_llama
        fused = a.kernels == "liger"
        apply_liger_kernel_to_llama(fused_linear_cross_entropy=fused, cross_entropy=not fused)
    model = LlamaForCausalLM(cfg).to("cuda")
    if a.kernels == "kcpp":
        import kcpp.torch as kt
        kt.kernelize(model)
    return model


def timed(a, step, rank, world, what):
    """Runs step() 3 times, then --steps times under the timer; rank 0 prints tokens/s and the peak memory."""
    import torch
    import torch.distributed as dist
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
        print(f"{what} {a.kernels:8s} {world} GPU(s), reduce {a.reduce_dtype}: {tokens / seconds:10.0f} tokens/s "
              f"({tokens / seconds / world:8.0f} a GPU), {1e3 * seconds / a.steps:7.1f} ms a step, "
              f"peak {peak.item():7.0f} MiB a GPU, loss {loss.item():.4f}", flush=True)


def main():
    a = arguments(__doc__.split("\n\n")[0]).parse_args()
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    rank, world, local = ranks()
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    model = build_model(a)
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

    timed(a, step, rank, world, "FSDP2")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
