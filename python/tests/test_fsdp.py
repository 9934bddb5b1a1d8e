"""kcpp.torch under PyTorch FSDP2 (fully_shard), on the CPU with two gloo processes.

A kernelized Llama whose decoder layers, lm_head and root are each sharded over two ranks trains one
step, each rank on its row of the batch: the loss and every parameter's (gathered) gradient equal
those of the unsharded model without kernels on the whole batch, and the fused linear cross-entropy
ran as a kernel on every rank — with lm_head sharded on its own, the case where a loss fused with
lm_head, called outside lm_head's forward, would see only a shard of its weight.  Skipped where
torch.distributed's gloo backend, transformers or kcpp._core is missing.
"""
import os
import socket
import tempfile
import unittest

try:
    import torch
    import torch.distributed as dist
    import torch.multiprocessing as mp
    import transformers  # noqa: F401
    import kcpp
    import kcpp.torch as kt
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.device_mesh import init_device_mesh
    HAVE = kcpp._core is not None and dist.is_available() and dist.is_gloo_available()
    WHY = "" if HAVE else "kcpp._core or torch.distributed's gloo is missing"
except ImportError as e:
    HAVE, WHY = False, str(e)
    if os.environ.get("KCPP_REQUIRE_TORCH"):
        raise

from test_torch import batch, make_model, rel_l2  # noqa: E402  (the same tiny models and batch)

WORLD = 2


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def full_batch():
    """test_torch's batch with every token labelled: the ranks' mean losses then average to the batch's."""
    ids, labels = batch()
    labels[0, 3] = ids[0, 3]
    return ids, labels


def whole_batch_reference():
    """The unsharded model without kernels on the whole batch: the model, its output and every gradient."""
    ids, labels = full_batch()
    ref = make_model("llama")
    out = ref(input_ids=ids, labels=labels)
    out.loss.backward()
    return ref, out, {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}


def spawn_ranks(rank_main):
    """rank_main(rank, port, folder) in WORLD processes; what each saved as folder/rank<r>.pt, by rank."""
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(rank_main, args=(free_port(), d), nprocs=WORLD, join=True)
        return [torch.load(os.path.join(d, f"rank{r}.pt")) for r in range(WORLD)]


def rank_main(rank, port, out_dir):
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        torch.set_num_threads(1)
        model = make_model("llama")
        kt.kernelize(model)  # Liger's defaults: the fused linear cross-entropy included
        mesh = init_device_mesh("cpu", (WORLD,))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model.lm_head, mesh=mesh)
        fully_shard(model, mesh=mesh)
        ids, labels = full_batch()
        out = model(input_ids=ids[rank:rank + 1], labels=labels[rank:rank + 1])
        out.loss.backward()
        loss = out.loss.detach().clone()
        dist.all_reduce(loss)
        grads = {n: p.grad.full_tensor() for n, p in model.named_parameters() if p.grad is not None}
        r = kt.report(model)["ForCausalLMLoss"]
        if rank == 0:
            torch.save({"loss": loss / WORLD, "grads": grads, "report": r}, os.path.join(out_dir, "rank0.pt"))
        else:
            torch.save({"report": r}, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@unittest.skipUnless(HAVE, WHY)
class Fsdp2(unittest.TestCase):
    def test_a_kernelized_llama_trains_under_fully_shard(self):
        _, out, want = whole_batch_reference()
        ranks = spawn_ranks(rank_main)
        got, reports = ranks[0], [saved["report"] for saved in ranks]
        for r, rep in enumerate(reports):
            self.assertGreater(rep["kernel_calls"], 0, f"rank {r}: the fused loss did not run as a kernel: {rep}")
            self.assertEqual(rep["fallbacks"], 0, f"rank {r}: {rep}")
        self.assertLess(abs(got["loss"].item() - out.loss.item()) / out.loss.item(), 2e-5)
        self.assertEqual(set(got["grads"]), set(want))
        for name, g in want.items():
            self.assertLess(rel_l2(got["grads"][name], g), 2e-5, f"gradient of {name}")


if __name__ == "__main__":
    unittest.main()
