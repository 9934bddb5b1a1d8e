"""use_kernels with no config, from Python: kcpp.default_kernel_mapping() is the C++ runtime's default
(this project's packages in the hub org kernels-cpp, at this build's version ranges), and
kcpp.default_loader() loads them from the hub — here `kcpp serve` on loopback over this build's
packages, published as kernels-cpp/<name> at their version tags — or, offline or with the hub
unreachable, this build's own packages, saying so in `substituted`.

Needs the extension kcpp._core, the built packages and the kcpp binary (beside them: <build>/bin/kcpp,
or KCPP_BINARY); skipped where one is missing.
"""
import os
import re
import shutil
import subprocess
import tempfile
import threading
import time
import unittest
from pathlib import Path

try:
    import kcpp
    HAVE = kcpp._core is not None
    WHY = "" if HAVE else "the extension kcpp._core is not built"
except ImportError as e:  # python.bridge: a Python without the package on its path
    if os.environ.get("KCPP_REQUIRE_CORE"):
        raise
    HAVE, WHY = False, str(e)


def kcpp_binary():
    if os.environ.get("KCPP_BINARY"):
        return Path(os.environ["KCPP_BINARY"])
    built = kcpp._core.BUILD_PACKAGES_DIR if HAVE else ""
    return Path(built).parent / "bin" / "kcpp" if built else None


class Serve:
    """`kcpp serve FOLDER` on loopback (an ephemeral port) for a test class: `endpoint` once it has printed
    its address (within 60 s, else the server is killed and the start fails); stop() ends it."""

    def __init__(self, exe, folder, cwd=None):
        self.process = subprocess.Popen([str(exe), "serve", str(folder), "--port", "0", "--quiet"],
                                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=cwd)
        timer = threading.Timer(60, self.process.kill)  # a server that never prints its address ends the read
        timer.start()
        try:
            line = self.process.stdout.readline()
        finally:
            timer.cancel()
        m = re.search(r"http://127\.0\.0\.1:\d+", line)
        if not m:
            self.stop()
            raise RuntimeError(f"kcpp serve did not start: {line!r}")
        self.endpoint = m.group(0)

    def stop(self):
        self.process.terminate()
        self.process.wait(timeout=10)
        self.process.stdout.close()


@unittest.skipUnless(HAVE, WHY)
class DefaultMapping(unittest.TestCase):
    def test_the_mapping_is_the_runtimes(self):
        m = kcpp.default_kernel_mapping()
        self.assertEqual(kcpp.DEFAULT_KERNEL_ORG, kcpp._core.DEFAULT_KERNEL_ORG)
        self.assertEqual(m["RMSNorm"], "kernels-cpp/liger@^0.1:LigerRMSNorm")
        self.assertEqual(m["Attention"], {"cuda": "kernels-cpp/flash_attn@^0.2:FlashAttention", "cpu": ""})
        self.assertEqual(m["MultiScaleDeformableAttention"],
                         "kernels-cpp/deformable_attention@^0.1:MultiScaleDeformableAttention")
        config = kcpp.default_kernel_config()
        self.assertEqual(sorted(config.layers), sorted(m))
        self.assertEqual(config.select("SiLU", "inference", "cpu")[0], "kernels-cpp/activation@^0.1:SiLU")


@unittest.skipUnless(HAVE, WHY)
class DefaultLoaderAgainstServe(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.packages = kcpp.local_packages()
        exe = kcpp_binary()
        if not cls.packages or exe is None or not exe.is_file():
            raise unittest.SkipTest(f"needs the built packages and the kcpp binary ({exe})")
        cls.tmp = tempfile.TemporaryDirectory()
        root = Path(cls.tmp.name)
        # This build's packages as the org publishes them: kernels-cpp/<name>/v<version>/.
        for name in ("liger", "activation"):
            version = kcpp.Hub(allow_all_kernels=True).inspect(cls.packages[name])["version"]
            shutil.copytree(cls.packages[name], root / "hub" / "kernels-cpp" / name / f"v{version}")
        cls.server = Serve(exe, root / "hub")
        cls.endpoint = cls.server.endpoint

    @classmethod
    def tearDownClass(cls):
        cls.server.stop()
        cls.tmp.cleanup()

    def cache(self):
        d = tempfile.mkdtemp(dir=self.tmp.name)
        return d

    def test_served_packages_load_from_the_hub(self):
        loader = kcpp.default_loader(endpoint=self.endpoint, cache_dir=self.cache(), allow_all_kernels=True,
                                     lock_file="")
        p = loader.load("kernels-cpp/liger@^0.1:LigerRMSNorm")
        self.assertEqual(p.substituted, "")
        self.assertEqual(p.info["reference"], "kernels-cpp/liger@^0.1:LigerRMSNorm")
        self.assertTrue(p.info["revision"].startswith("v0.1"))
        self.assertEqual(p.default_layer, "LigerRMSNorm")
        # flash_attn is not published here: this build's stands in (where it was built).
        if "flash_attn" in self.packages:
            fa = loader.load("kernels-cpp/flash_attn@^0.2:FlashAttention")
            self.assertIn("this build's flash_attn", fa.substituted)
            self.assertIn("not found", fa.substituted)

    def test_offline_and_unreachable_fall_back_to_this_builds(self):
        cache = self.cache()
        offline = kcpp.default_loader(endpoint=self.endpoint, cache_dir=cache, offline=True, allow_all_kernels=True,
                                      lock_file="")
        p = offline.load("kernels-cpp/activation@^0.1:SiLU")
        self.assertIn("this build's activation", p.substituted)
        self.assertIn("HF_HUB_OFFLINE", p.substituted)
        self.assertEqual(p.info["folder"], self.packages["activation"])
        # Downloaded once, the cache serves the hub's copy offline.
        kcpp.default_loader(endpoint=self.endpoint, cache_dir=cache, allow_all_kernels=True,
                            lock_file="").load("kernels-cpp/activation@^0.1:SiLU")
        cached = kcpp.default_loader(endpoint=self.endpoint, cache_dir=cache, offline=True, allow_all_kernels=True,
                                     lock_file="").load("kernels-cpp/activation@^0.1:SiLU")
        self.assertEqual(cached.substituted, "")
        # A port nothing listens on.
        closed = self.endpoint.rsplit(":", 1)[0] + ":1"
        start = time.monotonic()
        down = kcpp.default_loader(endpoint=closed, cache_dir=self.cache(), lock_file="").load("kernels-cpp/liger@^0.1")
        self.assertIn("this build's liger", down.substituted)
        self.assertLess(time.monotonic() - start, 5.0)  # one attempt, no retries

    def test_untrusted_is_replaced_and_other_references_are_the_hubs(self):
        # The served packages are unsigned: without allow_all_kernels the hub's copy is not loaded.
        p = kcpp.default_loader(endpoint=self.endpoint, cache_dir=self.cache(), allow_all_kernels=False,
                                lock_file="").load("kernels-cpp/liger@^0.1:LigerRMSNorm")
        self.assertIn("refusing to load", p.substituted)
        # Other references are the hub's alone: no stand-in for them.
        with self.assertRaises(kcpp.KcppError):
            kcpp.default_loader(endpoint=self.endpoint, cache_dir=self.cache(), allow_all_kernels=True,
                                lock_file="").load("acme/liger@^0.1")


if __name__ == "__main__":
    unittest.main()
