"""The moe package (contract MoE/1, docs/contracts/MoE.md) against Transformers' own modules, in f32 on
the CPU: Mixtral's, Qwen2-MoE's (shared expert with its sigmoid gate), Qwen3-MoE's (with and without
norm_topk_prob) sparse MoE blocks and Llama 4's Llama4TextMoe, each with its weights passed as the
module holds them (Llama 4's [E, H, 2I] as transposed views), the forward and the gradients of the
hidden states, the router and every weight against autograd through the module; the experts interface
(routing given by Transformers' router); and load_balancing_loss_func with its gradient.  Parity:
1e-5 relative (issue 24's bar for the families).

Skipped where torch or transformers cannot be imported (the CTest python.bridge runs with Debian's
python3 and NumPy alone; python.package with the build's environment).
"""
import glob
import os
import sys
import unittest

try:
    import torch
    import transformers  # noqa: F401
except ImportError:  # pragma: no cover
    torch = None

try:
    import kcpp
except ImportError:  # not installed, not on PYTHONPATH: the source tree's package
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    import kcpp

PACKAGES = os.environ.get("KCPP_PACKAGES_DIR", "build/release/kernels")
TOL = 1e-5


def library(name):
    found = sorted(glob.glob(os.path.join(PACKAGES, name, "build", "kcpp1-cpu-*", f"lib{name}.so")))
    if not found:
        raise unittest.SkipTest(f"package {name} has no cpu build under {PACKAGES} (set KCPP_PACKAGES_DIR)")
    return found[0]


def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


@unittest.skipIf(torch is None, "needs torch and transformers")
class MoeAgainstTransformers(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.pkg = kcpp.Package(library("moe"))
        cls.layer = cls.pkg.layer("MegaBlocksMoeMLP")
        cls.llama4 = cls.pkg.layer("Llama4TextMoe")
        torch.manual_seed(int(os.environ.get("KCPP_SEED", "0")) % 2**31 or 1234)

    def run_block(self, layer, args, t, h, e, k, inter, shared=None):
        """Forward (training) and backward through the package; returns out, router_logits and the grads."""
        f32 = torch.float32
        out = torch.full((t, h), float("nan"))
        saved = {"router_logits": torch.empty(t, e), "topk_ids": torch.empty(t, k, dtype=torch.int32),
                 "topk_weights": torch.empty(t, k, dtype=f32), "expert_offsets": torch.empty(e + 2, dtype=torch.int32),
                 "sorted_slots": torch.empty(t * k, dtype=torch.int32), "gate_up": torch.empty(t * k, 2 * inter)}
        layer.forward(dict(args, out=out, **saved), mode="training")
        dout = torch.randn(t, h)
        grads = {"dhidden": torch.full((t, h), float("nan")), "drouter_weight": torch.full((e, h), float("nan")),
                 "ddown_proj": torch.full(args["down_proj"].shape, float("nan"))}
        if "gate_up_proj" in args:
            grads["dgate_up_proj"] = torch.full(args["gate_up_proj"].shape, float("nan"))
        if shared:
            grads.update({f"d{n}": torch.full(args[n].shape, float("nan")) for n in shared})
        # The saved gate_up is read by this backward alone: the package may write over it.
        layer.backward(dict(args, dout=dout, **saved, **grads, overwrite_gate_up=1))
        return out, saved, grads, dout

    def check(self, what, ours, ref):
        err = rel(ours, ref)
        self.assertLessEqual(err, TOL, f"{what}: relative error {err:.3g}")

    def sparse_block(self, family, normalize):
        t, h, e, k, inter = 13, 32, 6, 2, 24
        if family == "mixtral":
            from transformers.models.mixtral.configuration_mixtral import MixtralConfig
            from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock as Block
            cfg = MixtralConfig(hidden_size=h, intermediate_size=inter, num_local_experts=e, num_experts_per_tok=k)
        else:
            from transformers.models.qwen3_moe.configuration_qwen3_moe import Qwen3MoeConfig
            from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock as Block
            cfg = Qwen3MoeConfig(hidden_size=h, moe_intermediate_size=inter, num_experts=e, num_experts_per_tok=k,
                                 norm_topk_prob=normalize)
        cfg._experts_implementation = "eager"
        block = Block(cfg)
        with torch.no_grad():
            for p in block.parameters():
                p.normal_(0, 0.3)
        x = torch.randn(1, t, h, requires_grad=True)
        ref = block(x)
        args = {"hidden": x.detach().view(t, h), "router_weight": block.gate.weight.detach(), "routing": "softmax",
                "top_k": k, "normalize": int(normalize), "gate_up_proj": block.experts.gate_up_proj.detach(),
                "down_proj": block.experts.down_proj.detach()}
        out, saved, grads, dout = self.run_block(self.layer, args, t, h, e, k, inter)
        self.check(f"{family} out", out, ref.view(t, h))
        logits = torch.nn.functional.linear(x.detach().view(t, h), block.gate.weight.detach())
        self.check(f"{family} router_logits", saved["router_logits"], logits)
        (ref.view(t, h) * dout).sum().backward()
        self.check(f"{family} dhidden", grads["dhidden"], x.grad.view(t, h))
        self.check(f"{family} drouter_weight", grads["drouter_weight"], block.gate.weight.grad)
        self.check(f"{family} dgate_up_proj", grads["dgate_up_proj"], block.experts.gate_up_proj.grad)
        self.check(f"{family} ddown_proj", grads["ddown_proj"], block.experts.down_proj.grad)

    def test_mixtral(self):
        self.sparse_block("mixtral", True)

    def test_qwen3_moe(self):
        for normalize in (True, False):
            self.sparse_block("qwen3_moe", normalize)

    def test_qwen2_moe_shared_expert(self):
        from transformers.models.qwen2_moe.configuration_qwen2_moe import Qwen2MoeConfig
        from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock
        t, h, e, k, inter, si = 9, 24, 5, 2, 16, 20
        cfg = Qwen2MoeConfig(hidden_size=h, moe_intermediate_size=inter, shared_expert_intermediate_size=si,
                             num_experts=e, num_experts_per_tok=k, norm_topk_prob=False)
        cfg._experts_implementation = "eager"
        block = Qwen2MoeSparseMoeBlock(cfg)
        with torch.no_grad():
            for p in block.parameters():
                p.normal_(0, 0.3)
        x = torch.randn(1, t, h, requires_grad=True)
        ref = block(x)
        se = block.shared_expert
        args = {"hidden": x.detach().view(t, h), "router_weight": block.gate.weight.detach(), "top_k": k,
                "gate_up_proj": block.experts.gate_up_proj.detach(), "down_proj": block.experts.down_proj.detach(),
                "shared_gate_proj": se.gate_proj.weight.detach(), "shared_up_proj": se.up_proj.weight.detach(),
                "shared_down_proj": se.down_proj.weight.detach(),
                "shared_expert_gate": block.shared_expert_gate.weight.detach()}
        shared = ("shared_gate_proj", "shared_up_proj", "shared_down_proj", "shared_expert_gate")
        out, _, grads, dout = self.run_block(self.layer, args, t, h, e, k, inter, shared)
        self.check("qwen2_moe out", out, ref.view(t, h))
        (ref.view(t, h) * dout).sum().backward()
        self.check("qwen2_moe dhidden", grads["dhidden"], x.grad.view(t, h))
        self.check("qwen2_moe drouter_weight", grads["drouter_weight"], block.gate.weight.grad)
        self.check("qwen2_moe dgate_up_proj", grads["dgate_up_proj"], block.experts.gate_up_proj.grad)
        for n, p in (("shared_gate_proj", se.gate_proj), ("shared_up_proj", se.up_proj), ("shared_down_proj", se.down_proj),
                     ("shared_expert_gate", block.shared_expert_gate)):
            self.check(f"qwen2_moe d{n}", grads[f"d{n}"], p.weight.grad)

    def test_llama4_text_moe(self):
        from transformers.models.llama4.configuration_llama4 import Llama4TextConfig
        from transformers.models.llama4.modeling_llama4 import Llama4TextMoe
        t, h, e, k, inter = 11, 32, 4, 1, 16
        cfg = Llama4TextConfig(hidden_size=h, intermediate_size=inter, num_local_experts=e, num_experts_per_tok=k,
                               hidden_act="silu")
        block = Llama4TextMoe(cfg)
        with torch.no_grad():
            for p in block.parameters():
                p.normal_(0, 0.3)
        x = torch.randn(t, h, requires_grad=True)
        ref, ref_logits = block(x)
        se = block.shared_expert
        # Llama 4 stores [E, H, 2I] and [E, I, H]: the contract's [E, 2I, H] / [E, H, I] as transposed views.
        args = {"hidden": x.detach(), "router_weight": block.router.weight.detach(), "routing": "sigmoid", "top_k": k,
                "apply_router_weight": "input", "gate_up_proj": block.experts.gate_up_proj.detach().transpose(1, 2),
                "down_proj": block.experts.down_proj.detach().transpose(1, 2),
                "shared_gate_proj": se.gate_proj.weight.detach(), "shared_up_proj": se.up_proj.weight.detach(),
                "shared_down_proj": se.down_proj.weight.detach()}
        shared = ("shared_gate_proj", "shared_up_proj", "shared_down_proj")
        out, saved, grads, dout = self.run_block(self.llama4, args, t, h, e, k, inter, shared)
        self.check("llama4 out", out, ref)
        self.check("llama4 router_logits", saved["router_logits"], ref_logits)
        (ref * dout).sum().backward()
        self.check("llama4 dhidden", grads["dhidden"], x.grad)
        self.check("llama4 drouter_weight", grads["drouter_weight"], block.router.weight.grad)
        self.check("llama4 dgate_up_proj", grads["dgate_up_proj"].transpose(1, 2), block.experts.gate_up_proj.grad)
        self.check("llama4 ddown_proj", grads["ddown_proj"].transpose(1, 2), block.experts.down_proj.grad)
        for n, p in (("shared_gate_proj", se.gate_proj), ("shared_up_proj", se.up_proj), ("shared_down_proj", se.down_proj)):
            self.check(f"llama4 d{n}", grads[f"d{n}"], p.weight.grad)

    def test_experts_interface(self):
        """routing 'given': Transformers' router decides, the package runs the experts, and the routing
        weights' gradient goes back into the router through autograd."""
        from transformers.models.qwen3_moe.configuration_qwen3_moe import Qwen3MoeConfig
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts, Qwen3MoeTopKRouter
        t, h, e, k, inter = 10, 16, 5, 3, 12
        cfg = Qwen3MoeConfig(hidden_size=h, moe_intermediate_size=inter, num_experts=e, num_experts_per_tok=k)
        cfg._experts_implementation = "eager"
        experts, router = Qwen3MoeExperts(cfg), Qwen3MoeTopKRouter(cfg)
        with torch.no_grad():
            for p in list(experts.parameters()) + list(router.parameters()):
                p.normal_(0, 0.3)
        x = torch.randn(t, h)
        _, w, ids = router(x)
        ref = experts(x, ids, w)
        dout = torch.randn(t, h)
        wg = w.detach().requires_grad_(True)
        xg = x.clone().requires_grad_(True)
        (experts(xg, ids, wg) * dout).sum().backward()
        args = {"hidden": x, "routing": "given", "topk_ids": ids, "topk_weights": w.detach(),
                "gate_up_proj": experts.gate_up_proj.detach(), "down_proj": experts.down_proj.detach()}
        out = torch.empty(t, h)
        offsets, sorted_slots = torch.empty(e + 2, dtype=torch.int32), torch.empty(t * k, dtype=torch.int32)
        self.layer.forward(dict(args, out=out, expert_offsets=offsets, sorted_slots=sorted_slots), mode="training")
        self.check("experts out", out, ref)
        dx, dw = torch.empty(t, h), torch.empty(t, k)
        self.layer.backward(dict(args, expert_offsets=offsets, sorted_slots=sorted_slots, dout=dout, dhidden=dx,
                                 dtopk_weights=dw))
        self.check("experts dhidden", dx, xg.grad)
        self.check("experts dtopk_weights", dw, wg.grad)

    def test_load_balancing_loss(self):
        from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func
        layers, b, s, e, k = 3, 2, 5, 8, 2
        op = self.pkg.op("load_balancing_loss")
        for masked in (False, True):
            logits = torch.randn(layers, b * s, e, requires_grad=True)
            mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]]) if masked else None
            ref = load_balancing_loss_func(tuple(logits[i] for i in range(layers)), e, k, mask)
            ref.backward()
            loss, dz = torch.empty(1), torch.empty(layers, b * s, e)
            op({"router_logits": logits.detach(), "top_k": k, "attention_mask": mask, "loss": loss, "drouter_logits": dz})
            self.check(f"load_balancing_loss masked={masked}", loss[0], ref.detach())
            self.check(f"its gradient masked={masked}", dz, logits.grad)


if __name__ == "__main__":
    unittest.main()
