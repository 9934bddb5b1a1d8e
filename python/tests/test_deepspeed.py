"""kcpp.torch under DeepSpeed ZeRO-3, on the CPU with two gloo processes.

A kernelized Llama wrapped by `deepspeed.initialize` with ZeRO stage 3 (f32, no bf16/fp16) trains one
step, each rank on its row of the batch: the loss and every parameter's full gradient (gathered with
`deepspeed.utils.safe_get_full_grad`) equal those of the unsharded model without kernels on the whole
batch, and the fused linear cross-entropy ran as a kernel on every rank, with no fallbacks — ZeRO-3
partitions every parameter (lm_head's weight included) and gathers it only in hooks around its
module's forward, so a loss fused with lm_head called outside lm_head's forward would see an empty
partition.

On the CPU DeepSpeed needs: DS_ACCELERATOR=cpu (set here before deepspeed is imported, in the ranks
only; without it DeepSpeed picks CUDA wherever a GPU is visible), the gloo backend (its CPU
accelerator asks for oneCCL's "ccl" when oneccl_bindings_for_pytorch is importable, so the backend is
named explicitly), and a torch optimizer as the client optimizer with `zero_force_ds_cpu_optimizer`
off, so that no DeepSpeed C++ op (cpu_adam) is JIT-built.  The optimizer never steps: the gradients
are read after the backward.  Skipped where deepspeed, torch.distributed's gloo backend, transformers
or kcpp._core is missing (scripts/python-env.sh installs DeepSpeed into build/pyenv).
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

from test_fsdp import full_batch, spawn_ranks, whole_batch_reference  # noqa: E402  (test_fsdp.py's batch and ranks)
from test_torch import make_model, rel_l2  # noqa: E402

WORLD = 2


def rank_main(rank, port, out_dir):
    os.environ["DS_ACCELERATOR"] = "cpu"
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(WORLD), LOCAL_WORLD_SIZE=str(WORLD))
    import deepspeed
    from deepspeed.utils import safe_get_full_grad
    # Every op reported incompatible: DeepSpeed's communication backend would JIT-build its shared-memory
    # all-reduce (deepspeed_shm_comm, a minute of g++) for the CPU; gloo does every collective instead.
    deepspeed.ops.__compatible_ops__ = {}
    deepspeed.init_distributed(dist_backend="gloo", rank=rank, world_size=WORLD)
    try:
        torch.set_num_threads(1)
        model = make_model("llama")
        kt.kernelize(model)  # Liger's defaults: the fused linear cross-entropy included
        config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
                  # Every parameter partitioned, however small (the default keeps those under 1e5 elements
                  # whole on every rank: all of this tiny model's), and none fetched ahead of its module.
                  "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                        "stage3_prefetch_bucket_size": 0},
                  "zero_force_ds_cpu_optimizer": False,
                  "bf16": {"enabled": False}, "fp16": {"enabled": False}, "steps_per_print": 1 << 30}
        engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=0.0),
                                          config=config)
        weight = model.lm_head.weight  # partitioned: empty outside lm_head's forward, a shard on each rank
        partitioned = (weight.numel(), weight.ds_tensor.numel(), weight.ds_numel)
        ids, labels = full_batch()
        out = engine(input_ids=ids[rank:rank + 1], labels=labels[rank:rank + 1])
        engine.backward(out.loss)
        loss = out.loss.detach().clone()
        dist.all_reduce(loss)
        grads = {}
        for n, p in engine.module.named_parameters():
            g = safe_get_full_grad(p)  # a collective: every rank asks for every parameter
            if g is not None:
                grads[n] = g.detach().clone()
        # DeepSpeed's safety net: a partitioned parameter read outside its module's forward is gathered
        # by its getter and registered as an "external parameter" of the module whose forward runs (then
        # gathered around every forward of that module).  The fused loss must not need it: it runs as
        # lm_head's forward, where lm_head's own hooks gathered its weight.
        external = sorted(f"{m_name or 'the model'}: {p_name}" for m_name, m in model.named_modules()
                          for p in getattr(m, "_external_params", {}).values()
                          for p_name, q in model.named_parameters() if q is p)
        saved = {"report": kt.report(model)["ForCausalLMLoss"], "partitioned": partitioned, "external": external}
        if rank == 0:
            saved.update(loss=loss / WORLD, grads=grads)
        torch.save(saved, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@unittest.skipUnless(HAVE, WHY)
class DeepSpeedZero3(unittest.TestCase):
    def test_a_kernelized_llama_trains_under_zero3(self):
        ref, out, want = whole_batch_reference()
        ranks = spawn_ranks(rank_main)
        for r, saved in enumerate(ranks):
            numel, shard, whole = saved["partitioned"]
            self.assertEqual(whole, ref.lm_head.weight.numel())
            self.assertTrue(numel == 0 and 0 < shard < whole, f"rank {r}: lm_head's weight is not partitioned: "
                            f"{numel} elements outside its forward, a shard of {shard} of {whole}")
            self.assertEqual(saved["external"], [], f"rank {r}: parameters read outside their module's forward")
            rep = saved["report"]
            self.assertGreater(rep["kernel_calls"], 0, f"rank {r}: the fused loss did not run as a kernel: {rep}")
            self.assertEqual(rep["fallbacks"], 0, f"rank {r}: {rep}")
        got = ranks[0]
        self.assertLess(abs(got["loss"].item() - out.loss.item()) / out.loss.item(), 2e-5)
        self.assertEqual(set(got["grads"]), set(want))
        for name, g in want.items():
            self.assertEqual(got["grads"][name].shape, g.shape, name)
            self.assertLess(rel_l2(got["grads"][name], g), 2e-5, f"gradient of {name}")


if __name__ == "__main__":
    unittest.main()
