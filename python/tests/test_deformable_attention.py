"""Package deformable_attention against Transformers' own PyTorch path, on the CPU in f32:
`MultiScaleDeformableAttention.forward` of models/deformable_detr/modeling_deformable_detr.py (the
`grid_sample`-based reference that the hub mapping replaces), with the gradients autograd takes through
it.  The layer is called through the C ABI (kcpp.Package over the built library).  Skipped where torch or
transformers is missing (CTest python.bridge's interpreter); run by CTest python.package in the project's
environment (scripts/python-env.sh).

Run: KCPP_PACKAGES_DIR=build/release/kernels python3 -m unittest python/tests/test_deformable_attention.py
"""
import glob
import os
import sys
import unittest

try:
    import torch
    from transformers.models.deformable_detr.modeling_deformable_detr import MultiScaleDeformableAttention
    HAVE, WHY = True, ""
except ImportError as e:
    HAVE, WHY = False, str(e)

try:
    import kcpp
except ImportError:
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    import kcpp

PACKAGES = os.environ.get("KCPP_PACKAGES_DIR", "build/release/kernels")


def library():
    found = sorted(glob.glob(os.path.join(PACKAGES, "deformable_attention", "build", "kcpp1-cpu-*",
                                          "libdeformable_attention.so")))
    if not found:
        raise FileNotFoundError(f"package deformable_attention has no cpu build under {PACKAGES} (set KCPP_PACKAGES_DIR)")
    return found[0]


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


@unittest.skipUnless(HAVE, WHY)
class DeformableAttentionAgainstTransformers(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.pkg = kcpp.Package(library())

    def setUp(self):
        torch.manual_seed(int(os.environ.get("KCPP_SEED", "0")) or 1234)

    def check(self, b, q, m, c, p, levels, edges=False):
        shapes_list = list(levels)
        shapes = torch.tensor(shapes_list, dtype=torch.int64)
        sizes = [h * w for h, w in shapes_list]
        starts = torch.tensor([0] + sizes[:-1], dtype=torch.int64).cumsum(0)
        l = len(shapes_list)
        value = torch.randn(b, sum(sizes), m, c)
        loc = torch.empty(b, q, m, l, p, 2).uniform_(-0.2, 1.2)
        if edges:  # borders, pixel centres and the half-pixel fade of every level
            w = shapes[:, 1].view(1, 1, 1, l, 1).double()
            h = shapes[:, 0].view(1, 1, 1, l, 1).double()
            special = torch.tensor([0.0, 1.0, 0.5, -0.5, 1.5, -0.25, 1.25])
            pick = torch.randint(0, 2 * len(special), loc.shape[:-1] + (2,))
            cand = special[pick.clamp_max(len(special) - 1)]
            # -0.5 / 1.5 become half a pixel outside (x = -1, W); -0.25 / 1.25 a quarter.
            scale = torch.stack([w, h], -1).expand_as(loc)
            cand = torch.where(cand < 0, cand / scale * 2, torch.where(cand > 1, 1 + (cand - 1) / scale * 2, cand))
            loc = torch.where(pick < len(special), cand.float(), loc)
            # A pixel coordinate within rounding of an integer (not exactly one) lands on either side of the
            # kink in the slope depending on how it is computed (f32 here, 2 loc - 1 first in grid_sample):
            # such points move away.  Exact integers stay; both sides agree on them.
            x = loc.double() * scale - 0.5
            off = (x - x.round()).abs()
            loc = torch.where((off > 0) & (off < 1e-4), torch.full_like(loc, 0.37), loc)
        attn = torch.softmax(torch.randn(b, q, m, l * p), -1).view(b, q, m, l, p)
        leaves = [t.clone().requires_grad_(True) for t in (value, loc, attn)]
        ref = MultiScaleDeformableAttention()(leaves[0], shapes, shapes_list, starts, leaves[1], leaves[2], 64)
        dout = torch.randn_like(ref)
        (ref * dout).sum().backward()

        layer = self.pkg.layer("MultiScaleDeformableAttention")
        args = {"value": value, "value_spatial_shapes": shapes, "value_level_start_index": starts,
                "sampling_locations": loc, "attention_weights": attn, "im2col_step": 64}
        out = torch.empty(b, q, m * c)
        layer.forward(dict(args, out=out), mode="training")
        self.assertLess(rel(out, ref.detach()), 1e-5)
        grads = {"dvalue": torch.empty_like(value), "dsampling_locations": torch.empty_like(loc),
                 "dattention_weights": torch.empty_like(attn)}
        layer.backward(dict(args, dout=dout, **grads))
        for name, leaf in zip(grads, leaves):
            with self.subTest(grad=name):
                self.assertLess(rel(grads[name], leaf.grad), 1e-5)

    def test_detr_like(self):
        self.check(b=2, q=40, m=8, c=32, p=4, levels=[(12, 17), (6, 9), (3, 5), (2, 3)])

    def test_awkward(self):
        self.check(b=1, q=1, m=3, c=5, p=3, levels=[(1, 1), (3, 7)])
        self.check(b=2, q=9, m=2, c=13, p=2, levels=[(5, 4)])

    def test_on_borders_and_pixel_centres(self):
        self.check(b=2, q=30, m=2, c=7, p=4, levels=[(4, 8), (2, 2), (1, 1), (3, 5)], edges=True)

    def test_bad_spatial_shapes_are_refused_by_name(self):
        value = torch.randn(1, 10, 2, 4)
        args = {"value": value, "value_spatial_shapes": torch.tensor([[3, 3], [2, 2]]),
                "value_level_start_index": torch.tensor([0, 9]),
                "sampling_locations": torch.rand(1, 3, 2, 2, 1, 2), "attention_weights": torch.rand(1, 3, 2, 2, 1),
                "out": torch.empty(1, 3, 8)}
        with self.assertRaisesRegex(Exception, "level 1 .* does not fit in the 10 rows"):
            self.pkg.layer("MultiScaleDeformableAttention").forward(args, mode="inference")
        with self.assertRaisesRegex(Exception, "value_spatial_shapes.*int64"):
            self.pkg.layer("MultiScaleDeformableAttention").forward(
                dict(args, value_spatial_shapes=torch.tensor([[3, 3], [1, 1]], dtype=torch.int32)), mode="inference")


if __name__ == "__main__":
    unittest.main()
