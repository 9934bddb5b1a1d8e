"""The Python bridge against the packages this build made: tables, calls through the ABI on NumPy
arrays (CPU) and PyTorch tensors (CUDA, where a GPU and torch exist), errors.  Whichever `kcpp`
imports is tested: the package with its extension kcpp._core (PYTHONPATH=build/release/python, CTest
`python.package`), else the source tree's python/kcpp, whose calls go through kcpp._ctypes (CTest
`python.bridge`, with Debian's python3 and NumPy alone).

Run: KCPP_PACKAGES_DIR=build/release/kernels KCPP_HUB_FIXTURES=build/release/tests/hub \
     python3 -m unittest discover -s python/tests
Results are checked against float64 references with the project's rule (docs/DESIGN.md "Numerics
and testing"): at most twice the error of the same maths run in the kernel's precision, here NumPy's
float32 composition.
"""
import glob
import os
import sys
import unittest

import numpy as np

try:
    import kcpp
except ImportError:  # not installed, not on PYTHONPATH: the source tree's package
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    import kcpp

PACKAGES = os.environ.get("KCPP_PACKAGES_DIR", "build/release/kernels")
FIXTURES = os.environ.get("KCPP_HUB_FIXTURES", "build/release/tests/hub")
SEED = int(os.environ.get("KCPP_SEED", "0")) or np.random.SeedSequence().entropy % 2**32


def library(name, variant="cpu"):
    found = sorted(glob.glob(os.path.join(PACKAGES, name, "build", f"kcpp1-{variant}-*", f"lib{name}.so")))
    if not found:
        raise FileNotFoundError(f"package {name} has no {variant} build under {PACKAGES} (set KCPP_PACKAGES_DIR)")
    return found[0]


def rms_norm_f64(x, w, eps):
    x64 = x.astype(np.float64)
    rstd = 1.0 / np.sqrt((x64 * x64).mean(-1, keepdims=True) + eps)
    return x64 * rstd * w.astype(np.float64), rstd[..., 0]


def rms_norm_f32(x, w, eps):
    rstd = np.float32(1) / np.sqrt((x * x).mean(-1, keepdims=True, dtype=np.float32) + np.float32(eps))
    return (x * rstd) * w


def rms_norm_backward_f64(dy, x, w, eps):
    """dx, dweight and the magnitudes of the terms that form them."""
    x64, w64, dy64 = x.astype(np.float64), w.astype(np.float64), dy.astype(np.float64)
    rstd = 1.0 / np.sqrt((x64 * x64).mean(-1, keepdims=True) + eps)
    n, g = x64 * rstd, dy64 * w64
    dx = rstd * (g - n * (g * n).mean(-1, keepdims=True))
    dx_mag = rstd * (np.abs(g) + np.abs(n) * np.abs(g * n).mean(-1, keepdims=True))
    return dx, (dy64 * n).sum(0), dx_mag, np.abs(dy64 * n).sum(0)


def rms_norm_backward_f32(dy, x, w, eps):
    rstd = np.float32(1) / np.sqrt((x * x).mean(-1, keepdims=True, dtype=np.float32) + np.float32(eps))
    n, g = x * rstd, dy * w
    dx = rstd * (g - n * (g * n).mean(-1, keepdims=True, dtype=np.float32))
    return dx, (dy * n).sum(0, dtype=np.float32)


class Bound:
    """The project's rule as the C++ tests apply it (tests/test_util.h): errors in L2 relative to
    the magnitude of the terms that form each result (where terms cancel, as in dx of a one-element
    row, a result's own size says nothing about the rounding it carries), at most twice the f32
    composition's plus two roundings."""

    def __init__(self, case):
        self.case = case

    def check(self, what, got, ref32, exact, magnitude=None):
        magnitude = np.abs(exact) if magnitude is None else magnitude
        norm = max(np.linalg.norm(magnitude), np.finfo(np.float64).tiny)
        got, ref32 = np.asarray(got, np.float64), np.asarray(ref32, np.float64)
        self.case.assertTrue(np.all(np.isfinite(got)), f"{what}: non-finite result")
        err, ref_err = np.linalg.norm(got - exact) / norm, np.linalg.norm(ref32 - exact) / norm
        self.case.assertLessEqual(err, 2 * ref_err + 2 * np.finfo(np.float32).eps,
                                  f"{what}: error {err:.3g} against the f32 composition's {ref_err:.3g} (seed {SEED})")


class PackageTable(unittest.TestCase):
    def test_liger_names_its_layers_and_contracts(self):
        p = kcpp.Package(library("liger"))
        self.assertEqual(p.name, "liger")
        self.assertRegex(p.version, r"^\d+\.\d+\.\d+")
        self.assertEqual(p.layer("LigerRMSNorm").contract, "RMSNorm/1")
        self.assertEqual(p.layer("LigerCrossEntropy").contract, "CrossEntropyLoss/1")
        self.assertTrue(p.layer("LigerRMSNorm").has_backward)
        with self.assertRaisesRegex(KeyError, "no layer 'RMSNorm'.*LigerRMSNorm"):
            p.layer("RMSNorm")

    def test_a_library_without_the_symbol_is_refused(self):
        with self.assertRaisesRegex(ImportError, "not a (kernels.cpp|kcpp) package"):
            kcpp.Package(os.path.join(FIXTURES, "libkcpp_fixture_no_symbol.so"))

    def test_another_abi_version_is_refused(self):
        with self.assertRaisesRegex(ImportError, "ABI (version )?99"):
            kcpp.Package(os.path.join(FIXTURES, "libkcpp_fixture_abi99.so"))


class CpuCalls(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.liger = kcpp.Package(library("liger"))
        cls.rms = cls.liger.layer("LigerRMSNorm")

    def setUp(self):
        self.rng = np.random.default_rng(SEED)

    def test_rms_norm_forward_and_backward_within_the_bound(self):
        bound = Bound(self)
        for rows, h in ((1, 1), (3, 7), (13, 111), (5, 4097)):
            x = self.rng.standard_normal((rows, h), np.float32)
            w = self.rng.standard_normal(h, np.float32)
            dy = self.rng.standard_normal((rows, h), np.float32)
            y, rstd = np.full_like(x, np.nan), np.full(rows, np.nan, np.float32)
            self.rms.forward({"x": x, "weight": w, "eps": 1e-6, "y": y, "rstd": rstd})
            exact, exact_rstd = rms_norm_f64(x, w, 1e-6)
            bound.check(f"y [{rows}, {h}]", y, rms_norm_f32(x, w, 1e-6), exact)
            np.testing.assert_allclose(rstd, exact_rstd, rtol=4e-7)
            dx, dw = np.full_like(x, np.nan), np.full_like(w, np.nan)
            self.rms.backward({"dy": dy, "x": x, "weight": w, "rstd": rstd, "eps": 1e-6, "dx": dx, "dweight": dw})
            exact_dx, exact_dw, dx_mag, dw_mag = rms_norm_backward_f64(dy, x, w, 1e-6)
            ref_dx, ref_dw = rms_norm_backward_f32(dy, x, w, 1e-6)
            bound.check(f"dx [{rows}, {h}]", dx, ref_dx, exact_dx, dx_mag)
            bound.check(f"dweight [{rows}, {h}]", dw, ref_dw, exact_dw, dw_mag)

    def test_backward_without_dweight_uses_the_workspace(self):
        # dweight absent: the package sums it into host memory it asks the bridge for.
        x = self.rng.standard_normal((9, 64), np.float32)
        w = self.rng.standard_normal(64, np.float32)
        dy = self.rng.standard_normal((9, 64), np.float32)
        y, rstd, dx = np.empty_like(x), np.empty(9, np.float32), np.empty_like(x)
        self.rms.forward({"x": x, "weight": w, "y": y, "rstd": rstd}, mode="training")
        self.rms.backward({"dy": dy, "x": x, "weight": w, "rstd": rstd, "dx": dx})
        exact_dx, _, dx_mag, _ = rms_norm_backward_f64(dy, x, w, 1e-6)
        Bound(self).check("dx", dx, rms_norm_backward_f32(dy, x, w, 1e-6)[0], exact_dx, dx_mag)

    def test_strided_rows_and_in_place_output(self):
        base = self.rng.standard_normal((6, 40), np.float32)
        tail = base[:, 33:].copy()
        x = base[:, :33]  # rows 40 elements apart, last dim contiguous: the contract allows it
        x0, w = x.copy(), self.rng.standard_normal(33, np.float32)
        self.rms.forward({"x": x, "weight": w, "y": x}, mode="inference")  # y may be x
        Bound(self).check("in place", x, rms_norm_f32(x0, w, 1e-6), rms_norm_f64(x0, w, 1e-6)[0])
        np.testing.assert_array_equal(base[:, 33:], tail, "wrote outside the rows")

    def test_bad_input_is_an_error_naming_it_and_writes_nothing(self):
        x = self.rng.standard_normal((4, 8), np.float32)
        y = np.full_like(x, 7.0)
        with self.assertRaisesRegex(kcpp.InvalidArgument, "'weight' has 5 elements"):
            self.rms.forward({"x": x, "weight": np.ones(5, np.float32), "y": y}, mode="inference")
        with self.assertRaisesRegex(ValueError, "'weight'"):  # InvalidArgument is a ValueError
            self.rms.forward({"x": x, "weight": np.ones(8, np.float64), "y": y}, mode="inference")
        with self.assertRaisesRegex(kcpp.InvalidArgument, "'rstd'.*training"):
            self.rms.forward({"x": x, "weight": np.ones(8, np.float32), "y": y}, mode="training")
        with self.assertRaisesRegex(kcpp.InvalidArgument, "missing tensor argument 'y'"):
            self.rms.forward({"x": x, "weight": np.ones(8, np.float32)}, mode="inference")
        np.testing.assert_array_equal(y, 7.0)
        with self.assertRaisesRegex(TypeError, "argument 'eps' is a list"):
            self.rms.forward({"x": x, "weight": np.ones(8, np.float32), "y": y, "eps": [1e-6]}, mode="inference")
        with self.assertRaisesRegex(ValueError, "mode must be"):
            self.rms.forward({"x": x, "weight": np.ones(8, np.float32), "y": y}, mode="train")

    def test_supports_gives_the_reason(self):
        x = self.rng.standard_normal((4, 8), np.float32)
        ok, reason = self.rms.supports({"x": x, "weight": np.ones(8, np.float32), "y": np.empty_like(x)},
                                       mode="inference")
        self.assertTrue(ok, reason)
        xi = np.ones((4, 8), np.int32)
        ok, reason = self.rms.supports({"x": xi, "weight": np.ones(8, np.int32), "y": np.empty_like(xi)},
                                       mode="inference")
        self.assertFalse(ok)
        self.assertRegex(reason, "'x'.*i32")  # an unsupported dtype: the host falls back
        with self.assertRaises(kcpp.Unsupported):
            self.rms.forward({"x": xi, "weight": np.ones(8, np.int32), "y": np.empty_like(xi)}, mode="inference")

    def test_an_op(self):
        scale = kcpp.Package(library("example")).op("scale")
        x = self.rng.standard_normal(10, np.float32)
        y = np.empty_like(x)
        scale({"x": x, "y": y, "alpha": 2.5})
        np.testing.assert_array_equal(y, np.float32(2.5) * x)
        with self.assertRaisesRegex(kcpp.InvalidArgument, "'alpha'"):
            scale({"x": x, "y": y})


@unittest.skipUnless(getattr(kcpp, "_core", None) is not None, "the extension kcpp._core is not built")
class DeviceWorkspace(unittest.TestCase):
    """The path a CUDA call's workspace takes (C++ -> kcpp._workspace -> PyTorch), run on any machine:
    where CUDA is missing the request fails with PyTorch's reason, never with a failed conversion."""

    @classmethod
    def setUpClass(cls):
        try:
            import torch  # noqa: F401  (the hook's allocator)
        except ImportError:
            raise unittest.SkipTest("PyTorch is not installed")

    def test_a_request_reaches_the_hook(self):
        import torch
        address, why = kcpp._core._workspace_block(1000, 2, 0)  # kDLCUDA, device 0
        if torch.cuda.is_available():
            self.assertNotEqual(address, 0, why)
            self.assertEqual(why, "")
        else:
            self.assertEqual(address, 0)
            self.assertNotRegex(why, "cast|convert|incompatible function arguments")
            self.assertRegex(why, "(?i)cuda|nvidia|driver")

    def test_another_device_type_is_refused_by_name(self):
        address, why = kcpp._core._workspace_block(64, 1, 0)  # kDLCPU: not a workspace the hook gives
        self.assertEqual(address, 0)
        self.assertIn("no workspace allocator for DLPack device type 1", why)


class CudaCalls(unittest.TestCase):
    """PyTorch CUDA tensors through the cu variant: the stream, the workspace, bf16.  Skipped where
    there is no GPU (CI); run on the lent one."""

    @classmethod
    def setUpClass(cls):
        try:
            import torch
        except ImportError:
            raise unittest.SkipTest("PyTorch is not installed")
        if not torch.cuda.is_available():
            raise unittest.SkipTest("no CUDA device")
        cls.torch = torch
        cls.liger = kcpp.Package(library("liger", "cu*"))

    def test_rms_norm_bf16_on_a_side_stream(self):
        torch = self.torch
        g = torch.Generator(device="cuda").manual_seed(SEED)
        rms = self.liger.layer("LigerRMSNorm")
        for rows, h in ((1, 7), (989, 4097), (64, 4096)):
            x = torch.randn(rows, h, device="cuda", generator=g).to(torch.bfloat16)
            w = torch.randn(h, device="cuda", generator=g).to(torch.bfloat16)
            dy = torch.randn(rows, h, device="cuda", generator=g).to(torch.bfloat16)
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # the bridge must queue on the current stream
                y, rstd = torch.empty_like(x), torch.empty(rows, device="cuda")
                dx, dw = torch.empty_like(x), torch.empty_like(w)
                rms.forward({"x": x, "weight": w, "y": y, "rstd": rstd})
                rms.backward({"dy": dy, "x": x, "weight": w, "rstd": rstd, "dx": dx, "dweight": dw},
                             deterministic=True)
            side.synchronize()
            # The reference: the eager bf16 composition (Llama casting) and its autograd.
            xr, wr = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
            xf = xr.float()
            ref = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(torch.bfloat16) * wr
            ref.backward(dy)
            x64, w64, dy64 = x.double(), w.double(), dy.double()
            r64 = torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6)
            n, gn = x64 * r64, dy64 * w64
            exact = {"y": n * w64, "dx": r64 * (gn - n * (gn * n).mean(-1, keepdim=True)), "dweight": (dy64 * n).sum(0)}
            for name, got, reference in (("y", y, ref), ("dx", dx, xr.grad), ("dweight", dw, wr.grad)):
                err = (got.double() - exact[name]).abs().max().item()
                ref_err = (reference.double() - exact[name]).abs().max().item()
                self.assertLessEqual(err, 2 * ref_err, f"{name} [{rows}, {h}]: {err:.3g} against eager's {ref_err:.3g} "
                                     f"(seed {SEED})")

    def test_bad_device_mix_is_an_error(self):
        torch = self.torch
        x = torch.randn(4, 8, device="cuda")
        with self.assertRaises(kcpp.KcppError):
            self.liger.layer("LigerRMSNorm").forward({"x": x, "weight": torch.ones(8), "y": torch.empty_like(x)},
                                                     mode="inference")


if __name__ == "__main__":
    unittest.main()
