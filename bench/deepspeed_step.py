"""The multi-GPU training anchor under DeepSpeed ZeRO-3: bench/fsdp2_step.py's Hugging Face
LlamaForCausalLM, kernels and timer, wrapped by `deepspeed.initialize` with every parameter, gradient
and optimizer state partitioned (stage 3), one process a GPU: what a Transformers user of DeepSpeed runs
instead of `kcpp train --gpus N --zero 3`.

  torchrun --nproc_per_node 4 bench/deepspeed_step.py --kernels kcpp --vocab 128256
  python3 bench/deepspeed_step.py ...      # one process, one GPU (ZeRO-3 over a group of one)

DeepSpeed computes in bf16 over f32 master partitions ("bf16": enabled), sums the gradients in
--reduce-dtype ("communication_data_type"), clips them to norm 1.0 and steps torch's fused AdamW as a
client optimizer (no DeepSpeed op is JIT-built); overlap_comm and contiguous_gradients on, the bucket
sizes DeepSpeed's defaults.  Liger's fused linear cross-entropy reads lm_head's weight outside
lm_head's forward, where ZeRO-3 holds only a partition: DeepSpeed's getter gathers it as an "external
parameter" of the model (printed when it happens); kcpp's fused loss runs as lm_head's forward.
"""
from fsdp2_step import arguments, build_model, ranks, timed


def main():
    a = arguments(__doc__.split("\n\n")[0], reduce_default="bf16").parse_args()
    import torch
    import torch.distributed as dist
    import deepspeed

    rank, world, local = ranks()
    torch.cuda.set_device(local)
    deepspeed.init_distributed(dist_backend="nccl")
    model = build_model(a)
    config = {"train_micro_batch_size_per_gpu": a.batch, "gradient_accumulation_steps": 1,
              "bf16": {"enabled": True},
              "communication_data_type": "fp32" if a.reduce_dtype == "f32" else "bf16",
              "zero_optimization": {"stage": 3, "overlap_comm": True, "contiguous_gradients": True},
              "gradient_clipping": 1.0,
              "zero_force_ds_cpu_optimizer": False, "zero_allow_untested_optimizer": True,
              "steps_per_print": 1 << 30}
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=0.01, fused=True)
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=config)
    g = torch.Generator(device="cuda").manual_seed(1 + rank)
    ids = torch.randint(0, a.vocab, (a.batch, a.seq), device="cuda", generator=g)

    def step():
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        return loss

    timed(a, step, rank, world, "ZeRO-3")
    if rank == 0:
        external = sorted(f"{m_name or 'the model'}: {p_name}" for m_name, m in model.named_modules()
                          for p in getattr(m, "_external_params", {}).values()
                          for p_name, q in model.named_parameters() if q is p)
        if external:
            print(f"ZeRO-3 {a.kernels}: parameters gathered outside their module's forward: {', '.join(external)}")
        if a.kernels == "kcpp":
            import kcpp.torch as kt
            for e in kt.report(model).entries:  # every call a kernel: no fallback under ZeRO-3's partitions
                print(f"ZeRO-3 kcpp {e['layer']}: {e['kernel_calls']} kernel calls, {e['reference_calls']} reference, "
                      f"{e['fallbacks']} fallbacks" + (f" (last: {e['last_refusal']})" if e["last_refusal"] else ""))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
