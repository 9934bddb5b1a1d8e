"""kcpp.torch: kernelize a tiny random Hugging Face causal LM on the CPU, through this build's packages.

The logits, the loss and every parameter's gradient with the kernels equal the model's own within the
f32 tolerance; unkernelize restores the model bit for bit; a call a kernel refuses falls back to the
original forward and is reported.  Skipped where torch, transformers or the extension kcpp._core is
missing (CTest's python.package runs it in the project's environment, scripts/python-env.sh).
"""
import os
import unittest

try:
    import torch
    import transformers
    import kcpp
    import kcpp.torch as kt
    HAVE = kcpp._core is not None
    WHY = "" if HAVE else "the extension kcpp._core is not built"
except ImportError as e:  # torch / transformers absent
    HAVE, WHY = False, str(e)
    if os.environ.get("KCPP_REQUIRE_TORCH"):
        raise

SEED = int(os.environ.get("KCPP_SEED", "0")) or 1234

# The fixture models' dimensions (tests/fixtures/make_fixtures.py): small, with grouped-query heads.
COMMON = dict(vocab_size=97, bos_token_id=1, eos_token_id=2, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5,
              rope_theta=10000.0, tie_word_embeddings=False)
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(head_dim=8, sliding_window=None)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=16)),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(rope_scaling=None, pad_token_id=0, partial_rotary_factor=0.5)),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", dict(head_dim=8, tie_word_embeddings=True,
                                                      hidden_activation="gelu_pytorch_tanh")),
    # A soft cap small enough to matter for these logits.
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(head_dim=8, final_logit_softcapping=0.05)),
}


def make_model(family, seed=SEED):
    cfg_name, model_name, extra = FAMILIES[family]
    torch.manual_seed(seed)
    config = getattr(transformers, cfg_name)(**{**COMMON, **extra})
    config._attn_implementation = "eager"
    return getattr(transformers, model_name)(config).float()


def batch(seed=SEED):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, COMMON["vocab_size"], (2, 9), generator=g)
    labels = ids.clone()
    labels[0, 3] = -100
    return ids, labels


def run(model, ids, labels):
    """Logits (no labels), then loss and every parameter's gradient (labels, backward)."""
    model.zero_grad(set_to_none=True)
    with torch.no_grad():
        logits = model(input_ids=ids).logits.clone()
    out = model(input_ids=ids, labels=labels)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return logits, out.loss.detach(), grads


def rel_l2(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


@unittest.skipUnless(HAVE, WHY)
class Kernelize(unittest.TestCase):
    TOL = 2e-5  # f32: a few roundings of relative L2, summed over a 2-layer model's compositions

    def check_family(self, family, **kernelize_args):
        model = make_model(family)
        ids, labels = batch()
        ref_logits, ref_loss, ref_grads = run(model, ids, labels)
        kt.kernelize(model, **kernelize_args)
        logits, loss, grads = run(model, ids, labels)
        self.assertLess(rel_l2(logits, ref_logits), self.TOL, f"{family}: logits")
        self.assertLess(abs(loss.item() - ref_loss.item()) / abs(ref_loss.item()), self.TOL, f"{family}: loss")
        for name, g in ref_grads.items():
            self.assertLess(rel_l2(grads[name], g), self.TOL, f"{family}: gradient of {name}")
        return model

    def test_llama_liger_defaults_match_the_model(self):
        model = self.check_family("llama")
        r = kt.report(model)
        # Every kernelized layer ran its kernel and nothing fell back.
        for layer, modules in (("RMSNorm", 5), ("MLP", 2), ("rotary_pos_emb", 2), ("ForCausalLMLoss", 1)):
            e = r[layer]
            self.assertEqual(e["modules"], modules, str(r))
            self.assertIn("liger", e["kernel"], str(r))
            self.assertGreater(e["kernel_calls"], 0, str(r))
            self.assertEqual(e["fallbacks"], 0, str(r))
        self.assertEqual(r["CrossEntropyLoss"]["kernel"], "", str(r))  # Liger's default: the fused loss instead

    def test_llama_cross_entropy_over_the_logits(self):
        model = self.check_family("llama", liger_kernel_config={"cross_entropy": True,
                                                                "fused_linear_cross_entropy": False})
        e = kt.report(model)["CrossEntropyLoss"]
        self.assertGreater(e["kernel_calls"], 0, str(kt.report(model)))

    def test_num_items_in_batch(self):
        # The Trainer's gradient accumulation: the loss summed, divided by the batch's labelled tokens.
        for config in ({}, {"cross_entropy": True, "fused_linear_cross_entropy": False}):
            with self.subTest(config=config):
                model = make_model("llama")
                ids, labels = batch()
                n = torch.tensor(40.0)
                ref = model(input_ids=ids, labels=labels, num_items_in_batch=n).loss
                ref.backward()
                ref_grads = {k: p.grad.clone() for k, p in model.named_parameters()}
                model.zero_grad(set_to_none=True)
                kt.kernelize(model, liger_kernel_config=config)
                got = model(input_ids=ids, labels=labels, num_items_in_batch=n).loss
                got.backward()
                self.assertLess(abs(got.item() - ref.item()) / abs(ref.item()), self.TOL)
                for k, p in model.named_parameters():
                    self.assertLess(rel_l2(p.grad, ref_grads[k]), self.TOL, k)

    def test_llama_inference_mode_only(self):
        model = self.check_family("llama", mode="inference")
        r = kt.report(model)
        self.assertGreater(r["RMSNorm"]["kernel_calls"], 0)  # the no-grad logits
        self.assertGreater(r["RMSNorm"]["reference_calls"], 0)  # the training call: no training kernel

    def test_other_families(self):
        for family in ("mistral", "qwen2", "qwen3", "phi3", "gemma", "gemma2"):
            with self.subTest(family=family):
                model = self.check_family(family)
                r = kt.report(model)
                self.assertGreater(r["ForCausalLMLoss"]["kernel_calls"], 0, str(r))
                self.assertGreater(r["rotary_pos_emb"]["kernel_calls"], 0, str(r))
                if not family.startswith("gemma"):  # Gemma's (1 + w) RMSNorm is not swapped yet
                    self.assertGreater(r["RMSNorm"]["kernel_calls"], 0, str(r))

    def test_an_unknown_model_type_keeps_its_layers(self):
        model = make_model("llama")
        model.config.model_type = "llama_like_but_unchecked"
        ids, labels = batch()
        ref = run(model, ids, labels)
        kt.kernelize(model)
        got = run(model, ids, labels)
        self.assertTrue(torch.equal(ref[1], got[1]))
        r = kt.report(model)
        self.assertEqual(r["RMSNorm"]["kernel_calls"], 0)
        self.assertRegex(r["RMSNorm"]["reason"], "llama_like_but_unchecked")

    def test_a_transformers_kernel_mapping(self):
        liger = kcpp.local_packages()["liger"]
        mapping = {"RMSNorm": f"{liger}:LigerRMSNorm", "MLP": {"cpu": ""}}
        config = transformers.KernelConfig(kernel_mapping=mapping, use_local_kernel=True) \
            if hasattr(transformers, "KernelConfig") else mapping
        model = make_model("llama")
        with self.assertRaisesRegex(kcpp.KcppError, "not signed.*allow_all_kernels"):
            kt.kernelize(model, kernel_config=mapping if isinstance(config, dict) else config)
        self.check_family("llama", kernel_config=config, allow_all_kernels=True)

    def test_unkernelize_restores_bit_exactly(self):
        model = make_model("llama")
        ids, labels = batch()
        before = run(model, ids, labels)
        forwards = {n: m.__dict__.get("forward") for n, m in model.named_modules()}
        import gc
        import transformers.models.llama.modeling_llama as modeling
        gc.collect()  # models of other tests, kernelized and dropped: their patch goes with them
        rope = modeling.apply_rotary_pos_emb
        self.assertFalse(hasattr(rope, "_kcpp_original"))
        kt.kernelize(model)
        self.assertIsNot(modeling.apply_rotary_pos_emb, rope)
        run(model, ids, labels)
        kt.unkernelize(model)
        self.assertIs(modeling.apply_rotary_pos_emb, rope)
        self.assertEqual({n: m.__dict__.get("forward") for n, m in model.named_modules()}, forwards)
        self.assertNotIn("_loss_function", model.__dict__)
        after = run(model, ids, labels)
        self.assertTrue(torch.equal(before[0], after[0]))
        self.assertTrue(torch.equal(before[1], after[1]))
        for name in before[2]:
            self.assertTrue(torch.equal(before[2][name], after[2][name]), name)
        self.assertEqual(str(kt.report(model)), "")

    def test_a_refused_call_falls_back_and_is_reported(self):
        # f64: liger's kernels take f32 / bf16 / f16, so supports() refuses every call; the model
        # runs its own forwards and the report says why.
        model = make_model("llama").double()
        ids, labels = batch()
        ref = run(model, ids, labels)
        kt.kernelize(model)
        got = run(model, ids, labels)
        self.assertTrue(torch.equal(ref[0], got[0]))
        self.assertTrue(torch.equal(ref[1], got[1]))
        r = kt.report(model)
        for layer in ("RMSNorm", "MLP", "rotary_pos_emb", "ForCausalLMLoss"):
            self.assertEqual(r[layer]["kernel_calls"], 0, str(r))
            self.assertGreater(r[layer]["fallbacks"], 0, str(r))
            self.assertRegex(r[layer]["last_refusal"], "f64", str(r))
        self.assertIn("fallbacks", str(r))

    def test_a_mixed_dtype_call_falls_back(self):
        model = make_model("llama")
        kt.kernelize(model)
        norm = model.model.norm
        x = torch.randn(3, COMMON["hidden_size"], dtype=torch.float64)
        with torch.no_grad():
            y = norm(x)
        self.assertEqual(y.dtype, torch.float64)
        self.assertRegex(kt.report(model)["RMSNorm"]["last_refusal"], "one dtype")

    def test_an_empty_input_falls_back(self):
        model = make_model("llama")
        kt.kernelize(model)
        with torch.no_grad():
            y = model.model.norm(torch.empty(0, COMMON["hidden_size"]))
        self.assertEqual(tuple(y.shape), (0, COMMON["hidden_size"]))
        self.assertEqual(kt.report(model)["RMSNorm"]["fallbacks"], 1)

    def test_bad_arguments(self):
        with self.assertRaisesRegex(ValueError, "mode must be"):
            kt.kernelize(make_model("llama"), mode="train")
        with self.assertRaisesRegex(TypeError, "kernel_config"):
            kt.kernelize(make_model("llama"), kernel_config=["RMSNorm"])
        with self.assertRaisesRegex(kcpp.KcppError, "kernel_mapping"):
            kt.kernelize(make_model("llama"), kernel_config={"NoSuchLayer": "acme/x"})


if __name__ == "__main__":
    unittest.main()
