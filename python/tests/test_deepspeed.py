"""kcpp.torch under DeepSpeed ZeRO-3, on the CPU with two gloo processes.

Kernelized Llama and Qwen3 models wrapped by `deepspeed.initialize` with ZeRO stage 3 (f32, no
bf16/fp16) train a few SGD steps, each rank on its row of the batch: every step's loss, the first
step's full gradients (gathered with `deepspeed.utils.safe_get_full_grad`) and every parameter's
update (`safe_get_full_fp32_param`) equal those of the same model trained under ZeRO-3 without
kernels, and those of one process training the model without kernels on the whole batch (test_fsdp's
checks).  Every kernelized layer ran as a kernel on every rank in every step, with no fallback and no
reference call — ZeRO-3 partitions every parameter (lm_head's weight included) and gathers it only in
hooks around its module's forward, so a loss fused with lm_head called outside lm_head's forward would
see an empty partition; and no parameter was read outside its module's forward.

On the CPU DeepSpeed needs: DS_ACCELERATOR=cpu (set here before deepspeed is imported, in the ranks
only; without it DeepSpeed picks CUDA wherever a GPU is visible), the gloo backend (its CPU
accelerator asks for oneCCL's "ccl" when oneccl_bindings_for_pytorch is importable, so the backend is
named explicitly), and a torch optimizer as the client optimizer with `zero_force_ds_cpu_optimizer`
off, so that no DeepSpeed C++ op (cpu_adam) is JIT-built.  Skipped where deepspeed, torch.distributed's
gloo backend, transformers or kcpp._core is missing (scripts/python-env.sh installs DeepSpeed into
build/pyenv).
"""
import importlib.util
import os
import unittest

try:
    import torch
    import torch.distributed as dist
    import transformers  # noqa: F401
    import kcpp
    import kcpp.torch as kt
    HAVE = kcpp._core is not None and dist.is_available() and dist.is_gloo_available()
    WHY = "" if HAVE else "kcpp._core or torch.distributed's gloo is missing"
except ImportError as e:
    HAVE, WHY = False, str(e)
    if os.environ.get("KCPP_REQUIRE_TORCH"):
        raise
if HAVE and importlib.util.find_spec("deepspeed") is None:
    # Imported in the ranks only (below): DeepSpeed picks its accelerator when imported.
    HAVE, WHY = False, "deepspeed is not installed (scripts/python-env.sh installs it into build/pyenv)"

# test_fsdp.py's batch, ranks, training and checks
from test_fsdp import (FAMILIES, LR, MOMENTUM, STEPS, WORLD, check_kernels_ran, check_trained_alike,  # noqa: E402
                       full_batch, one_process, spawn_ranks)
from test_torch import make_model  # noqa: E402


def zero3(deepspeed, family, kernels, rank):
    """`family` trained under ZeRO-3, with or without kernels: as test_fsdp.train() returns, and how lm_head's
    weight is partitioned, the parameters read outside their module's forward, the report."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_grad
    model = make_model(family)
    if kernels:
        kt.kernelize(model)  # Liger's defaults: the fused linear cross-entropy included
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
              # Every parameter partitioned, however small (the default keeps those under 1e5 elements
              # whole on every rank: all of these tiny models'), and none fetched ahead of its module.
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                    "stage3_prefetch_bucket_size": 0},
              "zero_force_ds_cpu_optimizer": False,
              "zero_allow_untested_optimizer": True,  # torch's SGD: DeepSpeed vouches for Adam(W), LAMB, ... only
              "gradient_clipping": 0.0,  # plain SGD's update
              "bf16": {"enabled": False}, "fp16": {"enabled": False}, "steps_per_print": 1 << 30}
    engine, *_ = deepspeed.initialize(model=model, config=config,
                                      optimizer=torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM))
    weight = model.lm_head.weight  # partitioned: empty outside lm_head's forward, a shard on each rank
    partitioned = (weight.numel(), weight.ds_tensor.numel(), weight.ds_numel)
    ids, labels = full_batch()
    mine = slice(rank, rank + 1)
    losses, grads = [], None
    for step in range(STEPS):
        out = engine(input_ids=ids[mine], labels=labels[mine])
        engine.backward(out.loss)
        if step == 0:  # safe_get_full_grad is a collective: every rank asks for every parameter
            grads = {n: safe_get_full_grad(p).detach().clone() for n, p in engine.module.named_parameters()}
        engine.step()
        loss = out.loss.detach().clone()
        dist.all_reduce(loss)
        losses.append(loss / WORLD)
    params = {n: safe_get_full_fp32_param(p).detach().clone() for n, p in engine.module.named_parameters()}
    # DeepSpeed's safety net: a partitioned parameter read outside its module's forward is gathered by its
    # getter and registered as an "external parameter" of the module whose forward runs (then gathered
    # around every forward of that module).  The fused loss must not need it: it runs as lm_head's
    # forward, where lm_head's own hooks gathered its weight.
    external = sorted(f"{m_name or 'the model'}: {p_name}" for m_name, m in model.named_modules()
                      for p in getattr(m, "_external_params", {}).values()
                      for p_name, q in model.named_parameters() if q is p)
    return {"losses": torch.stack(losses), "grads": grads, "params": params, "partitioned": partitioned,
            "external": external, "report": kt.report(model).entries if kernels else None}


def rank_main(rank, port, out_dir):
    os.environ["DS_ACCELERATOR"] = "cpu"
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(WORLD), LOCAL_WORLD_SIZE=str(WORLD))
    import deepspeed
    # Every op reported incompatible: DeepSpeed's communication backend would JIT-build its shared-memory
    # all-reduce (deepspeed_shm_comm, a minute of g++) for the CPU; gloo does every collective instead.
    deepspeed.ops.__compatible_ops__ = {}
    deepspeed.init_distributed(dist_backend="gloo", rank=rank, world_size=WORLD)
    try:
        torch.set_num_threads(1)
        saved = {(family, kernels): zero3(deepspeed, family, kernels, rank)
                 for family in FAMILIES for kernels in (True, False)}
        torch.save(saved, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@unittest.skipUnless(HAVE, WHY)
class DeepSpeedZero3(unittest.TestCase):
    def test_kernelized_models_train_under_zero3(self):
        ranks = spawn_ranks(rank_main)
        for family in FAMILIES:
            initial, whole = one_process(family)
            plain = ranks[0][(family, False)]
            check_trained_alike(self, plain, whole, initial, f"{family} under ZeRO-3 without kernels")
            got = ranks[0][(family, True)]
            check_trained_alike(self, got, plain, initial, f"{family} under ZeRO-3, kernels against none")
            check_trained_alike(self, got, whole, initial, f"{family} under ZeRO-3, kernels against one process")
            for r, saved in enumerate(ranks):
                what = f"{family}, rank {r}"
                numel, shard, whole_numel = saved[(family, True)]["partitioned"]
                self.assertEqual(whole_numel, initial["lm_head.weight"].numel(), what)
                self.assertTrue(numel == 0 and 0 < shard < whole_numel,
                                f"{what}: lm_head's weight is not partitioned: {numel} elements outside its "
                                f"forward, a shard of {shard} of {whole_numel}")
                self.assertEqual(saved[(family, True)]["external"], [],
                                 f"{what}: parameters read outside their module's forward")
                check_kernels_ran(self, saved[(family, True)]["report"], what)


if __name__ == "__main__":
    unittest.main()
