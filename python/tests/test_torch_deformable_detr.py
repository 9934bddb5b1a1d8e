"""kcpp.torch on a Deformable DETR: kernelize swaps the forward of Transformers' MultiScaleDeformableAttention
module (the one it marks use_kernel_forward_from_hub("MultiScaleDeformableAttention")) for this build's
deformable_attention package, in the encoder and the decoder.

A tiny random DeformableDetrModel (a small ResNet backbone, no timm; four feature levels of awkward sizes,
7 x 10 down to 1 x 2; a batch of 2 with one image padded) kernelized on the CPU in f32: its outputs and the
gradients of the pixels and of every parameter equal the unkernelized model's; inference (no grad) runs the
kernel too; a call the package's supports() refuses (f64) or the bridge cannot express runs the module's own
forward, counted, with its reason in report(); unkernelize restores the model bit for bit;
torch.compile(fullgraph=True) traces the kernelized model (the kernel a torch.library op) with no graph break,
forward and backward, at two image sizes (the second with dynamic shapes).  Skipped where torch,
transformers, kcpp._core or the built package is missing (CTest's python.package runs it in the project's
environment, scripts/python-env.sh).
"""
import os
import unittest

try:
    import torch
    import transformers
    import kcpp
    import kcpp.torch as kt
    HAVE = kcpp._core is not None and kcpp.local_packages().get("deformable_attention") is not None
    WHY = "" if HAVE else "kcpp._core or this build's deformable_attention package is missing"
except ImportError as e:  # torch / transformers absent
    HAVE, WHY = False, str(e)
    if os.environ.get("KCPP_REQUIRE_TORCH"):
        raise

SEED = int(os.environ.get("KCPP_SEED", "0")) or 1234
# 53 x 75 pixels: the ResNet's stages 2 to 4 give 7 x 10, 4 x 5 and 2 x 3 maps, Deformable DETR's extra
# strided convolution 1 x 2.
HEIGHT, WIDTH = 53, 75
LEVELS = [(7, 10), (4, 5), (2, 3), (1, 2)]
LAYER = "MultiScaleDeformableAttention"


def make_model(seed=SEED, head=False, **overrides):
    torch.manual_seed(seed)
    backbone = transformers.ResNetConfig(num_channels=3, embedding_size=8, hidden_sizes=[8, 12, 16, 16],
                                         depths=[1, 1, 1, 1], layer_type="basic",
                                         out_features=["stage2", "stage3", "stage4"])
    config = transformers.DeformableDetrConfig(
        backbone_config=backbone, use_timm_backbone=False, d_model=64, encoder_layers=2, decoder_layers=2,
        encoder_attention_heads=2, decoder_attention_heads=4, encoder_ffn_dim=40, decoder_ffn_dim=40, num_queries=5,
        num_feature_levels=len(LEVELS), encoder_n_points=3, decoder_n_points=2, dropout=0.0, **overrides)
    cls = transformers.DeformableDetrForObjectDetection if head else transformers.DeformableDetrModel
    model = cls(config).float()
    with torch.no_grad():
        for m in model.modules():
            if type(m).__name__ == "DeformableDetrMultiscaleDeformableAttention":
                # Offsets that depend on the query (Transformers initializes the weight to 0, and the encoder's
                # points then sit on pixel centres): samples anywhere between the pixels.
                m.sampling_offsets.weight.normal_(0, 0.05)
                m.sampling_offsets.bias.add_(torch.randn_like(m.sampling_offsets.bias) * 0.3)
            elif type(m).__name__ == "MultiScaleDeformableAttention":
                m.register_forward_pre_hook(off_the_kinks)
    return model


def off_the_kinks(module, args):
    """Moves a sampling location within 1e-4 pixels of a pixel centre (where the bilinear sample's slope
    jumps) a thousandth of a pixel away: there the kernel and grid_sample, computing the pixel coordinate in
    different orders, may round to different sides and take different (both right) slopes.  Differentiable:
    the gradient reaches the locations unchanged."""
    value, shapes, shapes_list, starts, loc, weights, im2col_step = args
    size = torch.tensor([[w, h] for h, w in shapes_list], dtype=torch.float64)[:, None, :]  # [L, 1, 2]: (W, H)
    x = loc.detach().double() * size - 0.5
    shift = torch.where((x - x.round()).abs() < 1e-4, 1e-3 / size, 0.0).to(loc.dtype)
    return value, shapes, shapes_list, starts, loc + shift, weights, im2col_step


def inputs(seed=SEED, dtype=None):
    g = torch.Generator().manual_seed(seed)
    pixels = torch.randn(2, 3, HEIGHT, WIDTH, generator=g).to(dtype or torch.float32)
    mask = torch.ones(2, HEIGHT, WIDTH, dtype=torch.long)
    mask[1, 37:, :] = 0  # the second image is 37 x 61, padded
    mask[1, :, 61:] = 0
    return pixels, mask


OUTPUTS = ("last_hidden_state", "encoder_last_hidden_state", "intermediate_hidden_states",
           "intermediate_reference_points")


def run(model, pixels, mask, grad=True):
    """The outputs, and (grad) the gradients of the pixels and of every parameter of a fixed random
    projection of them."""
    model.zero_grad(set_to_none=True)
    pixels = pixels.clone().requires_grad_(grad)
    with torch.set_grad_enabled(grad):
        out = model(pixel_values=pixels, pixel_mask=mask)
    outs = {k: getattr(out, k) for k in OUTPUTS}
    if not grad:
        return {k: v.clone() for k, v in outs.items()}, {}
    g = torch.Generator().manual_seed(SEED + 1)
    loss = sum((v * torch.randn(v.shape, generator=g, dtype=v.dtype)).sum() for v in outs.values())
    loss.backward()
    grads = {n.removeprefix("_orig_mod."): p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    grads["pixel_values"] = pixels.grad.clone()
    return {k: v.detach().clone() for k, v in outs.items()}, grads


def rel_l2(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


@unittest.skipUnless(HAVE, WHY)
class DeformableDetr(unittest.TestCase):
    TOL = 2e-5  # f32: the kernel against grid_sample, a few roundings through two encoder and decoder layers

    def assert_close(self, got, ref, what):
        for k, v in ref[0].items():
            self.assertLess(rel_l2(got[0][k], v), self.TOL, f"{what}: {k}")
        self.assertEqual(set(got[1]), set(ref[1]), what)
        for name, g in ref[1].items():
            if name.endswith("self_attn.k_proj.bias"):
                # The decoder's self-attention: softmax takes nothing from a constant added to all of one query's
                # scores, so this gradient is 0 but for rounding, on both sides; small against the weight's.
                weight = ref[1][name.removesuffix("bias") + "weight"].norm().item()
                for side in (got[1][name], g):
                    self.assertLess(side.norm().item(), 1e-3 * weight, f"{what}: gradient of {name}")
                continue
            self.assertLess(rel_l2(got[1][name], g), self.TOL, f"{what}: gradient of {name}")

    def assert_equal(self, got, ref, what):
        for k, v in ref[0].items():
            self.assertTrue(torch.equal(got[0][k], v), f"{what}: {k}")
        self.assertEqual(set(got[1]), set(ref[1]), what)
        for name, g in ref[1].items():
            self.assertTrue(torch.equal(got[1][name], g), f"{what}: gradient of {name}")

    def test_the_levels_are_awkward(self):
        model = make_model()
        seen = []
        hook = model.encoder.layers[0].self_attn.attn.register_forward_pre_hook(
            lambda m, args: seen.append(args[2]))
        with torch.no_grad():
            model(pixel_values=inputs()[0])
        hook.remove()
        self.assertEqual([tuple(s) for s in seen[0]], LEVELS)

    def test_training_matches_the_model(self):
        model = make_model()
        pixels, mask = inputs()
        ref = run(model, pixels, mask)
        kt.kernelize(model)
        got = run(model, pixels, mask)
        self.assert_close(got, ref, "kernelized")
        self.assertGreater(len(got[1]), 50)  # the backbone's, the encoder's and the decoder's parameters
        e = kt.report(model)[LAYER]
        self.assertEqual(e["modules"], 4, str(e))  # 2 encoder, 2 decoder layers
        self.assertIn("deformable_attention", e["kernel"], str(e))
        self.assertEqual((e["kernel_calls"], e["fallbacks"], e["reference_calls"]), (4, 0, 0), str(e))
        # The report holds Deformable DETR's layer alone.
        self.assertEqual([x["layer"] for x in kt.report(model).entries], [LAYER])

    def test_inference_matches_the_model(self):
        model = make_model().eval()
        pixels, mask = inputs()
        ref = run(model, pixels, mask, grad=False)
        kt.kernelize(model, mode="inference")
        self.assert_close(run(model, pixels, mask, grad=False), ref, "inference")
        e = kt.report(model)[LAYER]
        self.assertEqual((e["kernel_calls"], e["fallbacks"]), (4, 0), str(e))
        self.assertIn("inference: deformable_attention", e["reason"])
        self.assertNotIn("training:", e["reason"])
        # A call that needs gradients has no kernel in this mode: the reference, counted, not a refusal.
        run(model, pixels, mask)
        e = kt.report(model)[LAYER]
        self.assertEqual((e["kernel_calls"], e["reference_calls"], e["fallbacks"]), (4, 4, 0), str(e))

    def test_object_detection(self):
        # DeformableDetrForObjectDetection: the same modules under the detection heads (the model type is the same).
        model = make_model(head=True).eval()
        pixels, mask = inputs()
        with torch.no_grad():
            ref = model(pixel_values=pixels, pixel_mask=mask)
            kt.kernelize(model)
            got = model(pixel_values=pixels, pixel_mask=mask)
        for k in ("logits", "pred_boxes"):
            self.assertLess(rel_l2(getattr(got, k), getattr(ref, k)), self.TOL, k)
        e = kt.report(model)[LAYER]
        self.assertEqual((e["modules"], e["kernel_calls"], e["fallbacks"]), (4, 4, 0), str(e))

    def test_a_refused_call_falls_back_and_is_reported(self):
        # f64: the package takes f32 / bf16 / f16, so supports() refuses; the module's own forward runs.
        model = make_model().double()
        pixels, mask = inputs(dtype=torch.float64)
        ref = run(model, pixels, mask)
        kt.kernelize(model)
        self.assert_equal(run(model, pixels, mask), ref, "f64")
        e = kt.report(model)[LAYER]
        self.assertEqual((e["kernel_calls"], e["fallbacks"]), (0, 4), str(e))
        self.assertRegex(e["last_refusal"], r"tensor 'value' has dtype f64", str(e))
        self.assertIn("fallbacks (last: ", str(kt.report(model)))

    def test_a_call_the_bridge_cannot_express_falls_back(self):
        # int32 index tensors: the contract takes int64 (the reference reads the levels from the list).
        model = kt.kernelize(make_model())
        attn = model.encoder.layers[0].self_attn.attn
        g = torch.Generator().manual_seed(SEED)
        shapes_list = [(3, 4), (1, 2)]
        value = torch.randn(2, 14, 2, 16, generator=g)
        loc = torch.rand(2, 6, 2, 2, 3, 2, generator=g)
        weights = torch.softmax(torch.randn(2, 6, 2, 6, generator=g), -1).view(2, 6, 2, 2, 3)
        shapes, starts = torch.tensor(shapes_list), torch.tensor([0, 12])
        with torch.no_grad():
            got = attn(value, shapes, shapes_list, starts, loc, weights, 64)
            e = kt.report(model)[LAYER]
            self.assertEqual((e["kernel_calls"], e["fallbacks"]), (1, 0), str(e))
            same = attn(value, shapes.int(), shapes_list, starts.int(), loc, weights, 64)
        self.assertLess(rel_l2(same, got), 1e-6)
        e = kt.report(model)[LAYER]
        self.assertEqual((e["kernel_calls"], e["fallbacks"]), (1, 1), str(e))
        self.assertRegex(e["last_refusal"], r"torch\.int32.*takes int64", str(e))
        # An empty batch: the reference.
        with torch.no_grad():
            attn(value[:0], shapes, shapes_list, starts, loc[:0], weights[:0], 64)
        self.assertRegex(kt.report(model)[LAYER]["last_refusal"], "empty")

    def test_a_contract_violation_names_the_layer_and_the_argument(self):
        # Levels that do not fit in the value rows: the package checks the index tensors on the CPU.
        model = kt.kernelize(make_model())
        attn = model.decoder.layers[1].encoder_attn.attn
        value = torch.randn(1, 10, 2, 16)
        with torch.no_grad(), self.assertRaisesRegex(kcpp.KcppError, r"MultiScaleDeformableAttention.*level 1 .*"
                                                                     r"does not fit in the 10 rows"):
            attn(value, torch.tensor([[3, 3], [2, 2]]), [(3, 3), (2, 2)], torch.tensor([0, 9]),
                 torch.rand(1, 3, 2, 2, 1, 2), torch.rand(1, 3, 2, 2, 1), 64)

    def test_unkernelize_restores_bit_exactly(self):
        model = make_model()
        pixels, mask = inputs()
        before = run(model, pixels, mask)
        forwards = {n: m.__dict__.get("forward") for n, m in model.named_modules()}
        kt.kernelize(model)
        self.assertIn("forward", model.encoder.layers[0].self_attn.attn.__dict__)
        run(model, pixels, mask)
        kt.unkernelize(model)
        self.assertEqual({n: m.__dict__.get("forward") for n, m in model.named_modules()}, forwards)
        self.assert_equal(run(model, pixels, mask), before, "unkernelized")
        self.assertEqual(str(kt.report(model)), "")

    def test_a_kernel_mapping(self):
        # Transformers' own layer name, mapped to this build's package; "" keeps the reference.
        folder = kcpp.local_packages()["deformable_attention"]
        for mapping, kernel in (({LAYER: f"{folder}:{LAYER}"}, True), ({LAYER: {"cpu": ""}}, False)):
            with self.subTest(mapping=mapping):
                model = kt.kernelize(make_model(), kernel_config=transformers.KernelConfig(
                    kernel_mapping=mapping, use_local_kernel=True), allow_all_kernels=True)
                with torch.no_grad():
                    model(pixel_values=inputs()[0])
                e = kt.report(model)[LAYER]
                self.assertEqual(e["kernel_calls"], 4 if kernel else 0, str(e))
                self.assertEqual(e["modules"], 4, str(e))

    def test_torch_compile_fullgraph(self):
        # Eval mode (in training mode the encoder layer checks its output for infinities on the host, a graph
        # break of Transformers' own), with gradients: the training kernel and its backward in one graph,
        # traced by dynamo with no graph break (fullgraph=True raises on one) and differentiated by AOTAutograd.
        # A second image size compiles again, with dynamic shapes (levels of 8 x 6 down to 1 x 1): still one graph.
        model = kt.kernelize(make_model().eval())
        ops = set()

        def backend(gm, example_inputs):
            ops.update(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
            from torch._dynamo.backends.debugging import aot_eager
            return aot_eager(gm, example_inputs)
        torch._dynamo.reset()
        compiled = torch.compile(model, backend=backend, fullgraph=True)
        other = torch.randn(2, 3, 61, 47, generator=torch.Generator().manual_seed(SEED)), \
            torch.ones(2, 61, 47, dtype=torch.long)
        for p, m in (inputs(), other):
            size = tuple(p.shape[2:])
            with self.subTest(size=size):
                eager = run(model, p, m)
                before = kt.report(model)[LAYER]["kernel_calls"]
                self.assert_close(run(compiled, p, m), eager, f"compiled, {size}")
                e = kt.report(model)[LAYER]
                self.assertEqual((e["kernel_calls"] - before, e["fallbacks"]), (4, 0), str(e))
        self.assertIn("kcpp.multi_scale_deformable_attention.default", ops)

    def test_a_refusal_is_decided_while_tracing(self):
        # f64 under torch.compile: supports() refuses while the graph is traced, so the module's own forward is
        # in the graph; the refusal is counted then, once per module, not at every call.
        model = kt.kernelize(make_model().double().eval())
        pixels, mask = inputs(dtype=torch.float64)
        torch._dynamo.reset()
        compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
        with torch.no_grad():
            eager = model(pixel_values=pixels, pixel_mask=mask).last_hidden_state
            for _ in range(2):
                got = compiled(pixel_values=pixels, pixel_mask=mask).last_hidden_state
                self.assertLess(rel_l2(got, eager), 1e-12)
        e = kt.report(model)[LAYER]
        self.assertEqual((e["kernel_calls"], e["fallbacks"]), (0, 4 + 4), str(e))  # eager 4, traced 4
        self.assertRegex(e["last_refusal"], "f64", str(e))


if __name__ == "__main__":
    unittest.main()
