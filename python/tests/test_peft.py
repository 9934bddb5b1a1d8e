"""kcpp.torch with PEFT's LoRA, the usual way to fine-tune with Liger's kernels: a tiny Llama, Qwen3 and
Phi-3 with LoRA adapters on every projection, kernelized before get_peft_model or after it (kernelize
then swaps the base model's layers), give the loss and every trainable gradient of the same PEFT model
without kernels.  The MLP's swapped forward calls the adapted projections, so it stays a kernel; the
fused linear cross-entropy reads only lm_head's weight, so an adapted lm_head (LoRA on it, or
modules_to_save) makes it fall back, with the reason, instead of leaving the adapter out.

Skipped where kcpp._core, transformers or peft (scripts/python-env.sh installs it) is missing;
KCPP_REQUIRE_TORCH (torch, transformers) and KCPP_REQUIRE_TRAINING_LIBS (accelerate, peft), which CTest sets
where they import, make a missing one an error.
"""
import unittest

from test_torch import HAVE, WHY, batch, make_model, training_library  # the same tiny models and batch

if HAVE:
    import torch
    import kcpp.torch as kt
peft, HAVE, WHY = training_library("peft", HAVE, WHY)


def lora(**kw):
    # init_lora_weights=False: B is random too, so the adapters change the output from the first step.
    return peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, init_lora_weights=False, **kw)


def loss_and_grads(model, ids, labels):
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=labels).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@unittest.skipUnless(HAVE, WHY)
class Lora(unittest.TestCase):
    def run_case(self, family, config, kernelize_first):
        """(reference loss, its gradients), (kcpp's), the report."""
        torch.manual_seed(7)
        ref = peft.get_peft_model(make_model(family), config)
        base = make_model(family)
        if kernelize_first:
            kt.kernelize(base)
        got = peft.get_peft_model(base, config)
        got.load_state_dict(ref.state_dict())  # the same adapters
        if not kernelize_first:
            kt.kernelize(got)
        ids, labels = batch()
        want, got_ = loss_and_grads(ref, ids, labels), loss_and_grads(got, ids, labels)
        return want, got_, kt.report(base if kernelize_first else got)

    def check(self, what, want, got):
        (lw, gw), (lg, gg) = want, got
        self.assertLess(abs(lg.item() - lw.item()), 1e-5 * abs(lw.item()), what)
        self.assertEqual(sorted(gg), sorted(gw), what)
        self.assertTrue(any("lora_" in n for n in gw), what)
        for n, g in gw.items():
            err = ((gg[n] - g).norm() / g.norm()).item()
            self.assertLess(err, 1e-4, f"{what}: {n}'s gradient, relative error {err:.2e}")

    def test_adapters_on_every_projection(self):
        for family in ("llama", "qwen3", "phi3"):
            for first in (True, False):
                what = f"{family}, kernelize {'before' if first else 'after'} get_peft_model"
                want, got, report = self.run_case(family, lora(target_modules="all-linear"), first)
                self.check(what, want, got)
                for layer in ("RMSNorm", "MLP", "ForCausalLMLoss"):
                    self.assertGreater(report[layer]["kernel_calls"], 0, f"{what}: {layer}")
                    self.assertEqual(report[layer]["fallbacks"], 0, f"{what}: {layer}")

    def test_an_adapted_lm_head_falls_back(self):
        for name, config in (("LoRA on lm_head", lora(target_modules=["q_proj", "lm_head"])),
                             ("modules_to_save", lora(target_modules=["q_proj"], modules_to_save=["lm_head"]))):
            for first in (True, False):
                what = f"{name}, kernelize {'before' if first else 'after'} get_peft_model"
                want, got, report = self.run_case("llama", config, first)
                self.check(what, want, got)
                flce = report["ForCausalLMLoss"]
                self.assertEqual(flce["kernel_calls"], 0, what)
                self.assertEqual(flce["fallbacks"], 1, what)
                self.assertIn("not a Linear: the fused loss reads only its weight", flce["last_refusal"], what)

    def test_one_state_through_the_wrapper(self):
        # kernelize before get_peft_model, then kernelize / report / unkernelize through the PEFT model: one
        # state, the base model's.
        base = kt.kernelize(make_model("llama"))
        wrapped = peft.get_peft_model(base, lora(target_modules=["q_proj"]))
        self.assertEqual(kt.report(wrapped).entries, kt.report(base).entries)
        kt.kernelize(wrapped)
        ids, labels = batch()
        wrapped(input_ids=ids, labels=labels).loss.backward()
        self.assertEqual(kt.report(wrapped)["MLP"]["kernel_calls"], 2)
        self.assertEqual(kt.report(base)["MLP"]["kernel_calls"], 2)
        kt.unkernelize(wrapped)
        self.assertEqual(kt.report(base).entries, [])
        self.assertEqual([n for n, m in base.named_modules() if "forward" in vars(m)], [])

    def test_modules_to_save_of_a_swapped_module(self):
        # PEFT wraps the MLP in a ModulesToSaveWrapper (which passes attribute reads through): the two MLPs
        # inside it are swapped, the wrapper is not.  (Before kernelize only: PEFT deep-copies the module,
        # which a kernelized module refuses.)
        config = lora(target_modules=["q_proj"], modules_to_save=["mlp"])
        torch.manual_seed(7)
        ref = peft.get_peft_model(make_model("llama"), config)
        got = peft.get_peft_model(make_model("llama"), config)
        got.load_state_dict(ref.state_dict())
        kt.kernelize(got)
        layers = ref.config.num_hidden_layers
        self.assertEqual(kt.report(got)["MLP"]["modules"], 2 * layers)
        ids, labels = batch()
        self.check("modules_to_save=['mlp']", loss_and_grads(ref, ids, labels), loss_and_grads(got, ids, labels))
        self.assertEqual(kt.report(got)["MLP"]["kernel_calls"], layers)


if __name__ == "__main__":
    unittest.main()
