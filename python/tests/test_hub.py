"""The package's hub (kcpp.Hub, the C++ kcpp::hub::Hub through kcpp._core) on this build's packages, the
DLPack crossing of PyTorch tensors, and the host time of a layer call against the ctypes bridge.

Skipped where the extension is not built (the source tree alone: CTest python.bridge); CTest
python.package runs it with the extension (PYTHONPATH=build/release/python).
"""
import glob
import os
import shutil
import tempfile
import time
import unittest

import numpy as np

try:
    import kcpp
    HAVE_CORE = kcpp._core is not None
except ImportError:
    HAVE_CORE = False

try:
    import torch
except ImportError:
    torch = None


@unittest.skipUnless(HAVE_CORE, "the extension kcpp._core is not built")
class HubLoads(unittest.TestCase):
    def setUp(self):
        self.packages = kcpp.local_packages()

    def test_local_packages_are_this_builds(self):
        for name in ("liger", "activation", "flash_attn"):
            self.assertIn(name, self.packages)
            self.assertTrue(os.path.isfile(os.path.join(self.packages[name], "manifest.json")))

    def test_unsigned_needs_allow_all_kernels(self):
        with self.assertRaisesRegex(kcpp.KcppError, "not signed.*allow_all_kernels"):
            kcpp.Hub(allow_all_kernels=False).load(self.packages["liger"])
        p = kcpp.Hub(allow_all_kernels=True).load(self.packages["liger"])
        self.assertTrue(p.verified)
        self.assertEqual(p.name, "liger")
        import pathlib  # a folder as a path object too
        self.assertEqual(kcpp.Hub(allow_all_kernels=True).load(pathlib.Path(self.packages["liger"])).name, "liger")
        self.assertRegex(p.info["manifest_sha256"], "^[0-9a-f]{64}$")
        self.assertRegex(p.info["variant"], r"^kcpp1-(cpu|cu\d+)-")
        self.assertIn("LigerRMSNorm", p.layers)

    def test_reference_with_a_layer(self):
        p = kcpp.load(self.packages["activation"] + ":SiluAndMul", allow_all_kernels=True)
        self.assertEqual(p.default_layer, "SiluAndMul")
        self.assertEqual(p.layer(p.default_layer).contract, "SiluAndMul/1")
        with self.assertRaisesRegex(kcpp.KcppError, "NoSuchLayer"):
            kcpp.load(self.packages["activation"] + ":NoSuchLayer", allow_all_kernels=True)

    def test_a_changed_library_is_refused(self):
        # Every load checks every file of the variant against the manifest's sha256 (in C++).
        with tempfile.TemporaryDirectory() as tmp:
            copy = os.path.join(tmp, "liger")
            shutil.copytree(self.packages["liger"], copy, symlinks=False)
            libs = glob.glob(os.path.join(copy, "build", "kcpp1-*", "libliger.so"))
            self.assertTrue(libs, f"no variant of liger under {copy}/build")
            for lib in libs:  # every variant: whichever this machine picks is changed
                with open(lib, "r+b") as f:
                    f.seek(4096)
                    b = f.read(1)
                    f.seek(4096)
                    f.write(bytes([b[0] ^ 1]))
            with self.assertRaisesRegex(kcpp.KcppError, "sha256"):
                kcpp.Hub(allow_all_kernels=True).load(copy)

    def test_hub_options_and_bad_references(self):
        with tempfile.TemporaryDirectory() as tmp:
            hub = kcpp.Hub(cache_dir=tmp, offline=True, allow_all_kernels=True, lock_file="")
            self.assertEqual(hub.cache_dir, tmp)
            self.assertTrue(hub.offline)
            self.assertIsNone(hub.lock_file)
            with self.assertRaisesRegex(kcpp.KcppError, "not in the cache|offline|cache"):
                hub.load("kernels-community/liger@^0.1")
            with self.assertRaisesRegex(kcpp.KcppError, "reference|repo"):
                hub.load("not a reference")
            with self.assertRaises(kcpp.HubDisabled):
                kcpp.Hub(enabled=False, allow_all_kernels=True).load(self.packages["liger"])

    def test_kernel_config_is_the_cpp_one(self):
        config = kcpp.KernelConfig('{"RMSNorm": {"cuda": "acme/norm:Fast", "cpu": ""}, '
                                   '"MLP": {"cuda": {"inference": "acme/mlp@>=1.0,<2", "training": "acme/mlp-train"}}}')
        self.assertEqual(config.select("RMSNorm", "training", "cuda")[0], "acme/norm:Fast")
        self.assertEqual(config.select("RMSNorm", "inference", "cpu")[0], "")
        self.assertEqual(config.select("MLP", "inference", "cuda")[0], "acme/mlp@>=1.0,<2")
        self.assertEqual(config.select("MLP", "training", "cuda")[0], "acme/mlp-train")
        self.assertIsNone(config.select("rotary_pos_emb", "training", "cpu")[0])
        liger = self.packages["liger"]
        local = kcpp.KernelConfig('{"RMSNorm": "%s:LigerRMSNorm"}' % liger, True)
        self.assertEqual(local.select("RMSNorm", "training", "cpu")[0], liger + ":LigerRMSNorm")
        with self.assertRaisesRegex(kcpp.KcppError, "use_local_kernel"):
            kcpp.KernelConfig('{"RMSNorm": "acme/norm"}', True)
        with self.assertRaisesRegex(kcpp.KcppError, "kernel_mapping.*Nope"):
            kcpp.KernelConfig('{"Nope": "acme/x"}')
        # The mapping as a dict, as Transformers' KernelConfig takes it.
        as_dict = kcpp.KernelConfig({"RMSNorm": {"cuda": "acme/norm:Fast", "cpu": ""}})
        self.assertEqual(as_dict.select("RMSNorm", "training", "cuda")[0], "acme/norm:Fast")


@unittest.skipUnless(HAVE_CORE and torch is not None, "needs the extension and PyTorch")
class TorchTensors(unittest.TestCase):
    """PyTorch tensors cross by DLPack's C exchange API: views, requires_grad, errors naming the argument."""

    @classmethod
    def setUpClass(cls):
        cls.rms = kcpp.load(kcpp.local_packages()["liger"], allow_all_kernels=True).layer("LigerRMSNorm")

    def test_views_and_requires_grad(self):
        base = torch.randn(6, 40)
        x = base[:, 3:36]  # strided rows, last dim contiguous
        w = torch.randn(33, requires_grad=True)
        y, rstd = torch.full((6, 33), float("nan")), torch.empty(6)
        self.rms.forward({"x": x, "weight": w, "y": y, "rstd": rstd})
        ref = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w.detach()
        torch.testing.assert_close(y, ref, rtol=2e-6, atol=2e-6)

    def test_bad_tensors_name_the_argument(self):
        x = torch.randn(4, 8)
        with self.assertRaisesRegex(kcpp.InvalidArgument, "LigerRMSNorm.forward.*'weight'"):
            self.rms.forward({"x": x, "weight": torch.ones(8, dtype=torch.float64), "y": torch.empty_like(x)},
                             mode="inference")
        with self.assertRaisesRegex(kcpp.KcppError, "'x'.*contiguous"):
            self.rms.forward({"x": x.t(), "weight": torch.ones(4), "y": torch.empty(8, 4)}, mode="inference")
        with self.assertRaisesRegex(kcpp.InvalidArgument, "'y'"):
            self.rms.forward({"x": x, "weight": torch.ones(8), "y": torch.empty(4, 7)}, mode="inference")
        with self.assertRaisesRegex(TypeError, "'eps' is a list"):
            self.rms.forward({"x": x, "weight": torch.ones(8), "y": x, "eps": [1.0]}, mode="inference")
        with self.assertRaisesRegex(ValueError, "'x'.*neg / conj bit"):  # its values are not its memory's
            self.rms.forward({"x": torch._neg_view(x), "weight": torch.ones(8), "y": torch.empty_like(x)},
                             mode="inference")
        with self.assertRaisesRegex(ValueError, "'y'.*meta"):  # no memory: the framework's reason, named
            self.rms.forward({"x": x, "weight": torch.ones(8), "y": torch.empty(4, 8, device="meta")},
                             mode="inference")
        with self.assertRaisesRegex(TypeError, "dict"):
            self.rms.forward([("x", x)], mode="inference")


def _per_call_us(fn, args, mode, calls=20000, repeats=5):
    for _ in range(200):
        fn(args, mode)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(calls):
            fn(args, mode)
        best = min(best, (time.perf_counter() - t) / calls)
    return best * 1e6


@unittest.skipUnless(HAVE_CORE and torch is not None, "needs the extension and PyTorch")
class HostOverhead(unittest.TestCase):
    """The host time of one layer call, this extension against the ctypes bridge: supports() (the whole
    argument crossing and the package's checks, no kernel work) and forward, RMSNorm on a [1, 8] f32
    CPU tensor, 4 arguments (x, weight, eps, y), best of 5 runs of 20000 calls.  Printed; the test
    asserts only that the extension is the faster (machines differ)."""

    def test_per_call_host_time(self):
        from kcpp import _ctypes
        folder = kcpp.local_packages()["liger"]
        lib = sorted(glob.glob(os.path.join(folder, "build", "kcpp1-cpu-*", "libliger.so")))[0]
        layers = {"nanobind": kcpp.load(folder, allow_all_kernels=True).layer("LigerRMSNorm"),
                  "ctypes": _ctypes.Package(lib).layer("LigerRMSNorm")}
        results = {}
        for kind in ("torch", "numpy"):
            if kind == "torch":
                x, w = torch.randn(1, 8), torch.ones(8)
            else:
                x, w = np.random.randn(1, 8).astype(np.float32), np.ones(8, np.float32)
            args = {"x": x, "weight": w, "eps": 1e-6, "y": x * 0}
            for name, layer in layers.items():
                results[kind, name, "supports"] = _per_call_us(layer.supports, args, "inference")
                results[kind, name, "forward"] = _per_call_us(layer.forward, args, "inference")
        for (kind, name, entry), us in sorted(results.items()):
            print(f"host time per call: {kind:5s} {name:8s} {entry:8s} {us:7.2f} us")
        self.assertLess(results["torch", "nanobind", "supports"], results["torch", "ctypes", "supports"])


if __name__ == "__main__":
    unittest.main()
