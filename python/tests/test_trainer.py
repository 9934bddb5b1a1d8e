"""kcpp.torch under Transformers' Trainer, what users of `TrainingArguments(use_liger_kernel=True)` run:
a kernelized tiny Llama, Qwen3 and Qwen2 (lm_head tied to the embedding) trained by `Trainer` on the
CPU, two micro-batches a step (gradient accumulation), AdamW, a checkpoint at the end.

- The dataset is a torch Dataset of {"input_ids", "labels", "note"}: Trainer keeps only the keys that
  `inspect.signature(model.forward)` names, so the kernelized model's forward must still name
  input_ids (a swapped forward of (*args, labels, **kwargs) made Trainer drop them) and "note" must be
  dropped as for the model without kernels.
- Every logged loss equals the un-kernelized model's under the same Trainer (f32: the kernels and the
  reference agree to rounding), every kernelized layer ran as a kernel, with no fallback.
- The checkpoint Trainer saved loads in Transformers without kcpp (its config keeps no kcpp attention
  implementation) and gives the kernelized model's logits.
- With gradient checkpointing (both of torch.utils.checkpoint's forms) the losses are the same and the
  kernels run in the recomputed forwards too.
- accelerate, which Trainer runs on: its mixed-precision `prepare` and `unwrap_model(keep_fp32_wrapper=
  False)` keep the kernelized forward working; a model dispatched with its device hooks (device_map over
  several devices, disk offload) runs its kernels inside them, the fused loss inside lm_head's.

Skipped where kcpp._core, transformers or accelerate (which Trainer needs; scripts/python-env.sh installs
it) is missing; KCPP_REQUIRE_TORCH (torch, transformers) and KCPP_REQUIRE_TRAINING_LIBS (accelerate, peft),
which CTest sets where they import, make a missing one an error.
"""
import inspect
import os
import tempfile
import unittest
import warnings

from test_torch import COMMON, HAVE, WHY, make_model, training_library  # the same tiny models

if HAVE:
    import torch
    import transformers
    import kcpp.torch as kt
_, HAVE, WHY = training_library("accelerate", HAVE, WHY)  # Trainer's own requirement

STEPS = 3


class Rows(torch.utils.data.Dataset if HAVE else object):
    """Eight rows of nine token ids, the labels the ids with one position unlabelled, and a column no
    model takes."""

    def __len__(self):
        return 8

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(100 + i)
        ids = torch.randint(3, COMMON["vocab_size"], (9,), generator=g)
        labels = ids.clone()
        labels[i % 9] = -100
        return {"input_ids": ids, "labels": labels, "note": torch.tensor(i)}


def train(family, kernels, out, **extra):
    """The model Trainer trained, its logged losses, and the batches' keys its forward received (`extra`:
    more TrainingArguments)."""
    model = make_model(family)
    if kernels:
        kt.kernelize(model)
    seen = []
    model.register_forward_pre_hook(lambda m, args, kwargs: seen.append(sorted(kwargs)), with_kwargs=True)
    args = transformers.TrainingArguments(
        output_dir=out, per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=STEPS,
        learning_rate=1e-3, lr_scheduler_type="constant", optim="adamw_torch", logging_steps=1, save_steps=STEPS,
        report_to=[], use_cpu=True, seed=0, data_seed=0, dataloader_num_workers=0, disable_tqdm=True, **extra)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Rows())
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return model, losses, seen


@unittest.skipUnless(HAVE, WHY)
class TrainerRuns(unittest.TestCase):
    def test_kernelized_models_train_under_trainer(self):
        for family in ("llama", "qwen3", "qwen2"):
            with self.subTest(family=family), tempfile.TemporaryDirectory() as tmp:
                _, want, plain_seen = train(family, False, os.path.join(tmp, "plain"))
                model, got, seen = train(family, True, os.path.join(tmp, "kernels"))
                self.assertEqual(len(got), STEPS)
                for step, (g, w) in enumerate(zip(got, want)):
                    self.assertAlmostEqual(g, w, delta=1e-4 * abs(w), msg=f"{family}: step {step + 1}'s loss")
                self.assertEqual(seen, plain_seen, family)
                self.assertIn("input_ids", seen[0], f"{family}: Trainer dropped the ids ({seen[0]})")
                self.assertNotIn("note", seen[0], family)
                self.assertEqual(inspect.signature(model.forward),
                                 inspect.signature(type(model).forward.__get__(model)), family)
                for e in kt.report(model).entries:
                    if e["kernel"]:
                        self.assertEqual(e["fallbacks"], 0, f"{family} {e['layer']}: {e['last_refusal']}")
                self.assertGreater(kt.report(model)["RMSNorm"]["kernel_calls"], 0, family)
                self.assertGreater(kt.report(model)["ForCausalLMLoss"]["kernel_calls"], 0, family)
                # The checkpoint, in Transformers alone.
                saved = transformers.AutoModelForCausalLM.from_pretrained(
                    os.path.join(tmp, "kernels", f"checkpoint-{STEPS}"), dtype=torch.float32)
                self.assertNotIn("kcpp", str(saved.config._attn_implementation))
                ids = Rows()[0]["input_ids"][None]
                model.eval()
                with torch.no_grad():
                    torch.testing.assert_close(model(input_ids=ids).logits, saved(input_ids=ids).logits,
                                               rtol=1e-5, atol=1e-5)

    def test_gradient_checkpointing(self):
        # Transformers' activation checkpointing runs each layer's forward again in the backward, the
        # kernels inside it (both torch.utils.checkpoint forms).
        for reentrant in (False, True):
            # Transformers 5.24 renamed the arguments activation_checkpointing*; the older names warn there.
            name = ("activation_checkpointing" if "activation_checkpointing" in transformers.TrainingArguments.__dataclass_fields__
                    else "gradient_checkpointing")
            extra = {name: True, f"{name}_kwargs": {"use_reentrant": reentrant}}
            with self.subTest(use_reentrant=reentrant), tempfile.TemporaryDirectory() as tmp:
                _, want, _ = train("llama", False, os.path.join(tmp, "plain"), **extra)
                model, got, _ = train("llama", True, os.path.join(tmp, "kernels"), **extra)
                for step, (g, w) in enumerate(zip(got, want)):
                    self.assertAlmostEqual(g, w, delta=1e-4 * abs(w), msg=f"use_reentrant={reentrant}: step {step + 1}")
                report = kt.report(model)
                # Each layer's norms, MLP and attention ran twice a micro-batch: the forward and its recomputation.
                micro = 2 * STEPS
                self.assertEqual(report["MLP"]["kernel_calls"], 2 * micro * model.config.num_hidden_layers)
                self.assertEqual(report["MLP"]["fallbacks"], 0)


@unittest.skipUnless(HAVE, WHY)
class AccelerateRuns(unittest.TestCase):
    def test_unwrap_model_without_the_fp32_wrapper(self):
        # accelerate's mixed-precision prepare wraps the model's forward (autocast, outputs to f32) around
        # forward.__func__ and binds it again; unwrap_model(keep_fp32_wrapper=False) binds the innermost
        # function back to the model. The kernelized model's loss stays the model's through both.
        import accelerate
        from test_torch import batch
        ids, labels = batch()
        plain = make_model("llama")
        want = plain(input_ids=ids, labels=labels).loss.item()
        model = make_model("llama")
        kt.kernelize(model)
        try:
            acc = accelerate.Accelerator(mixed_precision="bf16", cpu=True)
            prepared = acc.prepare(model)
            prepared(input_ids=ids, labels=labels).loss.backward()  # under bf16 autocast
            unwrapped = acc.unwrap_model(prepared, keep_fp32_wrapper=False)
            calls = kt.report(unwrapped)["ForCausalLMLoss"]["kernel_calls"]
            got = unwrapped(input_ids=ids, labels=labels).loss.item()  # no autocast: the f32 model's loss
            self.assertAlmostEqual(got, want, delta=1e-5 * abs(want))
            self.assertEqual(kt.report(unwrapped)["ForCausalLMLoss"]["kernel_calls"], calls + 1)
            self.assertEqual(inspect.signature(unwrapped.forward), inspect.signature(type(plain).forward.__get__(plain)))
        finally:
            accelerate.state.AcceleratorState._reset_state(True)

    def test_kernels_run_inside_accelerates_device_hooks(self):
        # from_pretrained(device_map="auto") over several devices, or with CPU / disk offload, dispatches the
        # model with accelerate's hooks on every module (they move the inputs to the module's device and load
        # offloaded weights, then call the module's own forward): kernelize swaps that inner forward and keeps
        # the hooks.  Here every block's device is the CPU (force_hooks); in the second case the embedding's,
        # a layer's and lm_head's weights are offloaded to disk (the model's first parameter on the meta
        # device: kernelize takes the hook's execution device), trained through (the loss, as offloaded
        # weights are loaded anew at each call and keep no gradient).
        import accelerate
        from test_torch import batch, rel_l2
        ids, labels = batch()
        plain = make_model("llama")
        with torch.no_grad():
            want_logits = plain(input_ids=ids).logits
        want = plain(input_ids=ids, labels=labels).loss
        want.backward()
        layers = plain.config.num_hidden_layers
        for offload in (False, True):
            with self.subTest(offload=offload), tempfile.TemporaryDirectory() as tmp:
                model = make_model("llama")
                far = "disk" if offload else "cpu"
                device_map = {"model.embed_tokens": far, "model.rotary_emb": "cpu", "model.norm": "cpu", "lm_head": far,
                              **{f"model.layers.{i}": far if i == 0 else "cpu" for i in range(layers)}}
                accelerate.dispatch_model(model, device_map=device_map, main_device="cpu", force_hooks=True, offload_dir=tmp)
                self.assertIsNotNone(getattr(model.model.norm, "_hf_hook", None))
                with warnings.catch_warnings():
                    warnings.simplefilter("error")  # no module left alone
                    kt.kernelize(model)
                with torch.no_grad():
                    got_logits = model(input_ids=ids).logits
                self.assertLess(rel_l2(got_logits, want_logits), 1e-5)
                # Training through the hooks: the fused loss inside lm_head's.
                loss = model(input_ids=ids, labels=labels).loss
                loss.backward()
                self.assertAlmostEqual(loss.item(), want.item(), delta=1e-5 * abs(want.item()))
                if not offload:
                    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
                        self.assertLess(rel_l2(p.grad, q.grad), 1e-4, name)
                report = kt.report(model)
                for layer in ("RMSNorm", "MLP", "Attention", "ForCausalLMLoss"):
                    self.assertGreater(report[layer]["kernel_calls"], 0, layer)
                    self.assertEqual(report[layer]["fallbacks"], 0, f"{layer}: {report[layer]['last_refusal']}")
                kt.unkernelize(model)
                norm = model.model.norm
                self.assertEqual(norm._old_forward, type(norm).forward.__get__(norm))
                with torch.no_grad():
                    self.assertLess(rel_l2(model(input_ids=ids).logits, want_logits), 1e-5)

    def test_hooks_added_or_removed_around_kernelize(self):
        # dispatch_model after kernelize wraps the swapped forwards; unkernelize then gives the hooks the
        # modules' own forwards back.  remove_hook_from_module leaves each module's own forward bound on the
        # instance, which kernelize swaps as any other (not a wrapper to leave alone).
        import accelerate
        from accelerate.hooks import remove_hook_from_module
        from test_torch import batch, rel_l2
        ids, labels = batch()
        plain = make_model("llama")
        want = plain(input_ids=ids, labels=labels).loss.item()
        layers = plain.config.num_hidden_layers
        device_map = {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.norm": "cpu", "lm_head": "cpu",
                      **{f"model.layers.{i}": "cpu" for i in range(layers)}}
        model = kt.kernelize(make_model("llama"))
        accelerate.dispatch_model(model, device_map=device_map, main_device="cpu", force_hooks=True)
        self.assertAlmostEqual(model(input_ids=ids, labels=labels).loss.item(), want, delta=1e-5 * abs(want))
        self.assertGreater(kt.report(model)["RMSNorm"]["kernel_calls"], 0)
        kt.unkernelize(model)
        norm = model.model.norm
        self.assertIsNotNone(norm._hf_hook)
        self.assertEqual(norm._old_forward, type(norm).forward.__get__(norm))
        self.assertIsNot(vars(norm)["forward"], norm._old_forward)  # the hook's wrapper kept
        self.assertAlmostEqual(model(input_ids=ids, labels=labels).loss.item(), want, delta=1e-5 * abs(want))
        remove_hook_from_module(model, recurse=True)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no module left alone
            kt.kernelize(model)
        self.assertAlmostEqual(model(input_ids=ids, labels=labels).loss.item(), want, delta=1e-5 * abs(want))
        report = kt.report(model)
        for layer, modules in (("RMSNorm", 2 * layers + 1), ("MLP", layers), ("ForCausalLMLoss", 1)):
            self.assertEqual(report[layer]["modules"], modules, layer)
            self.assertGreater(report[layer]["kernel_calls"], 0, layer)
            self.assertEqual(report[layer]["fallbacks"], 0, f"{layer}: {report[layer]['last_refusal']}")

    @unittest.skipUnless(HAVE and torch.cuda.device_count() >= 2, "needs two CUDA devices")
    def test_device_map_over_two_gpus(self):
        # The layers split over cuda:0 and cuda:1 as device_map="auto" splits a model too large for one GPU:
        # each kernel runs on its module's GPU, the fused loss on lm_head's (cuda:1), the loss back on cuda:0.
        import accelerate
        from test_torch import batch, rel_l2
        ids, labels = (t.cuda(0) for t in batch())
        plain = make_model("llama", attn="sdpa").cuda(0)
        want = plain(input_ids=ids, labels=labels).loss
        want.backward()
        model = make_model("llama", attn="sdpa")
        layers = model.config.num_hidden_layers
        device_map = {"model.embed_tokens": 0, "model.rotary_emb": 0, "model.norm": 1, "lm_head": 1,
                      **{f"model.layers.{i}": 0 if i < layers // 2 else 1 for i in range(layers)}}
        accelerate.dispatch_model(model, device_map=device_map)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            kt.kernelize(model)
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        self.assertEqual(loss.device, ids.device)
        self.assertAlmostEqual(loss.item(), want.item(), delta=1e-4 * abs(want.item()))
        for (name, p), q in zip(model.named_parameters(), plain.parameters()):
            self.assertLess(rel_l2(p.grad.to(q.device), q.grad), 1e-4, name)
        self.assertEqual(model.lm_head.weight.device, torch.device("cuda", 1))
        report = kt.report(model)
        for layer in ("RMSNorm", "MLP", "Attention", "ForCausalLMLoss"):
            self.assertGreater(report[layer]["kernel_calls"], 0, layer)
            self.assertEqual(report[layer]["fallbacks"], 0, f"{layer}: {report[layer]['last_refusal']}")


if __name__ == "__main__":
    unittest.main()
