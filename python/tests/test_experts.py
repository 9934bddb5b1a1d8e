"""kcpp.torch's experts backend: experts_implementation "kcpp" sends Transformers' MoE experts (Mixtral,
Qwen2-MoE, Qwen3-MoE) to this build's moe package, with Transformers' own router choosing.  A tiny random model's
logits, loss and every parameter's gradient (the router's included, through the routing weights) equal
the model with its eager experts; a call the package does not take runs Transformers' batched_mm
experts, counted.  Skipped where torch, transformers, the experts interface or kcpp._core is missing.
"""
import os
import unittest

try:
    import torch
    import transformers
    import kcpp
    import kcpp.torch as kt
    from transformers.integrations.moe import ExpertsInterface  # noqa: F401
    HAVE = kcpp._core is not None and kcpp.local_packages().get("moe") is not None
    WHY = "" if HAVE else "kcpp._core or this build's moe package is missing"
except ImportError as e:
    HAVE, WHY = False, str(e)
    if os.environ.get("KCPP_REQUIRE_TORCH"):
        raise

SEED = int(os.environ.get("KCPP_SEED", "0")) or 1234
COMMON = dict(vocab_size=61, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=32, rms_norm_eps=1e-5, tie_word_embeddings=False)
FAMILIES = {
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(intermediate_size=24, num_local_experts=5, num_experts_per_tok=2)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(moe_intermediate_size=24, intermediate_size=48, num_experts=6,
                                                                num_experts_per_tok=3, norm_topk_prob=True, head_dim=8)),
    # Layer 0 dense (mlp_only_layers), layer 1 sparse with the shared expert and its sigmoid gate (Transformers'
    # own modules: only the routed experts go to the package).
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", dict(moe_intermediate_size=24, intermediate_size=40, num_experts=5,
                                                                num_experts_per_tok=3, shared_expert_intermediate_size=20,
                                                                mlp_only_layers=[0])),
}


def make(family, experts):
    cfg_name, model_name, extra = FAMILIES[family]
    torch.manual_seed(SEED)
    config = getattr(transformers, cfg_name)(**COMMON, **extra)
    config._attn_implementation = "eager"
    model = getattr(transformers, model_name)(config).float()
    with torch.no_grad():  # weights large enough that the experts' outputs matter
        for n, p in model.named_parameters():
            if "experts" in n or "gate" in n:
                p.normal_(0, 0.3)
    model.config._experts_implementation = experts
    return model


def run(model, ids):
    model.zero_grad(set_to_none=True)
    with torch.no_grad():
        logits = model(input_ids=ids).logits.clone()
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    return logits, out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


@unittest.skipUnless(HAVE, WHY)
class Experts(unittest.TestCase):
    def test_the_moe_package_as_the_experts_backend(self):
        ids = torch.randint(0, COMMON["vocab_size"], (2, 7), generator=torch.Generator().manual_seed(SEED))
        for family in FAMILIES:
            before = kt.experts_report()["kernel_calls"]
            ref = run(make(family, "eager"), ids)
            got = run(make(family, kt.EXPERTS_NAME), ids)
            r = kt.experts_report()
            self.assertGreater(r["kernel_calls"], before, f"{family}: the package did not run: {r}")
            self.assertIn("moe", r["kernel"], str(r))
            self.assertLess(rel(got[0], ref[0]), 2e-5, f"{family}: logits")
            self.assertLess(abs(got[1].item() - ref[1].item()) / abs(ref[1].item()), 2e-5, f"{family}: loss")
            self.assertEqual(set(got[2]), set(ref[2]), family)
            for name, g in ref[2].items():
                self.assertLess(rel(got[2][name], g), 2e-5, f"{family}: gradient of {name}")

    def test_kernelize_takes_the_moe_families(self):
        """kernelize on Mixtral, Qwen2-MoE and Qwen3-MoE: the norms, RoPE, attention and the fused loss from liger /
        flash_attn, the experts from moe; the same logits, loss and gradients; unkernelize restores."""
        ids = torch.randint(0, COMMON["vocab_size"], (2, 7), generator=torch.Generator().manual_seed(SEED + 1))
        for family in FAMILIES:
            model = make(family, "eager")
            ref = run(model, ids)
            before = kt.experts_report()["kernel_calls"]
            kt.kernelize(model)
            self.assertEqual(model.config._experts_implementation, kt.EXPERTS_NAME)
            got = run(model, ids)
            r = kt.report(model)
            for layer in ("RMSNorm", "rotary_pos_emb", "Attention", "ForCausalLMLoss"):
                self.assertGreater(r[layer]["kernel_calls"], 0, f"{family} {layer}: {r}")
                self.assertEqual(r[layer]["fallbacks"], 0, f"{family} {layer}: {r}")
            self.assertGreater(kt.experts_report()["kernel_calls"], before, family)
            self.assertLess(rel(got[0], ref[0]), 2e-5, f"{family}: logits")
            self.assertLess(abs(got[1].item() - ref[1].item()) / abs(ref[1].item()), 2e-5, f"{family}: loss")
            for name, g in ref[2].items():
                self.assertLess(rel(got[2][name], g), 2e-5, f"{family}: gradient of {name}")
            kt.unkernelize(model)
            self.assertEqual(model.config._experts_implementation, "eager")

    def test_the_router_loss_keeps_the_models_own_loss(self):
        """output_router_logits adds the load-balancing loss to the model's loss: the fused loss (which has
        none) gives way, so the loss is the model's own."""
        model = make("mixtral", "eager")
        model.config.output_router_logits = True
        ids = torch.randint(0, COMMON["vocab_size"], (1, 6), generator=torch.Generator().manual_seed(SEED + 2))
        want = model(input_ids=ids, labels=ids).loss.item()
        kt.kernelize(model)
        got = model(input_ids=ids, labels=ids).loss.item()
        self.assertLess(abs(got - want) / abs(want), 2e-5)
        self.assertIn("output_router_logits", kt.report(model)["ForCausalLMLoss"]["last_refusal"])

    def test_a_call_the_package_does_not_take_runs_batched_mm(self):
        model = make("mixtral", kt.EXPERTS_NAME)
        model.config.hidden_act = "relu"  # no GLU activation of MoE/1's
        before = kt.experts_report()["fallbacks"]
        ids = torch.randint(0, COMMON["vocab_size"], (1, 5), generator=torch.Generator().manual_seed(SEED))
        with torch.no_grad():
            model(input_ids=ids)
        r = kt.experts_report()
        self.assertGreater(r["fallbacks"], before, str(r))
        self.assertIn("activation 'relu'", r["last_refusal"])


if __name__ == "__main__":
    unittest.main()
