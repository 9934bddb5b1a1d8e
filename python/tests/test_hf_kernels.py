"""The Hugging Face `kernels` library loading this build's packages (kcpp.hf_kernels, python/hf_noarch/).

Every package carries the `kernels` noarch variants build/torch-cpu/ and build/torch-cuda/ (listed,
hashed, in its manifest); their layers, over the package's library loaded through the C++ hub, equal
the Transformers modules they replace (forward and backward), counted per call.  With the real
`kernels` (0.17.2) and a Transformers that accepts it (5.18 to 5.22): Transformers' `use_kernels`
kernelizes a tiny random Llama with our RMSNorm, rotary embedding and SiLU, and a training step
(forward + backward) and a generate() give what the model gives without kernels, with our layers'
calls counted.

On the CPU, Transformers (5.22) refuses `KernelConfig` for a model on the CPU ("Only devices in
['cuda', 'rocm', 'xpu', 'npu', 'neuron', 'tpu', 'mps'] are supported, got: cpu", asserted below), while
`kernels` 0.17 itself maps "cpu": there the mapping goes to `kernels.use_kernel_mapping` (or
`register_kernel_mapping`), in force while the model is used, since Transformers kernelizes again at
each train() / eval(), and Transformers' `use_kernels` kernelizes under it.  The `KernelConfig(..., use_local_kernel=True)` path
runs on the CPU with "cpu" let into Transformers' device list (everything else as on CUDA), and as it
is where there is a CUDA device (skipped elsewhere).

torch-only parts run wherever kcpp.torch's tests run; the `kernels` parts need the overlay
scripts/python-env.sh installs (build/pyenv-hf; CTest python.hf_kernels, which sets
KCPP_REQUIRE_HF_KERNELS=1 so that a missing library fails instead of skipping).
"""
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import unittest
from pathlib import Path

try:
    import torch
    import transformers
    import kcpp
    from kcpp import hf_kernels
    HAVE_TORCH = kcpp._core is not None
    WHY = "" if HAVE_TORCH else "the extension kcpp._core is not built"
except ImportError as e:
    HAVE_TORCH, WHY = False, str(e)
    if os.environ.get("KCPP_REQUIRE_TORCH") or os.environ.get("KCPP_REQUIRE_HF_KERNELS"):
        raise

HAVE_KERNELS, WHY_KERNELS = False, WHY
if HAVE_TORCH:
    try:
        import kernels
        from transformers.utils.import_utils import is_kernels_available
        HAVE_KERNELS = is_kernels_available()
        WHY_KERNELS = "" if HAVE_KERNELS else (f"kernels {kernels.__version__} is not what transformers "
                                               f"{transformers.__version__} accepts")
    except ImportError as e:
        WHY_KERNELS = f"no `kernels` library ({e})"
    if not HAVE_KERNELS and os.environ.get("KCPP_REQUIRE_HF_KERNELS"):
        raise RuntimeError(f"KCPP_REQUIRE_HF_KERNELS is set but {WHY_KERNELS}")

SEED = int(os.environ.get("KCPP_SEED", "0")) or 1234
NAME = re.compile(r"^[a-z][-a-z0-9]*[a-z0-9]$")  # kernels' KernelName


def packages():
    found = kcpp.local_packages()
    if not found:
        raise unittest.SkipTest("no built packages (KCPP_PACKAGES_DIR)")
    return found


def tiny_llama(seed=SEED):
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(vocab_size=97, bos_token_id=1, eos_token_id=2, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=64, rms_norm_eps=1e-5, hidden_act="silu",
                                      tie_word_embeddings=False)
    config._attn_implementation = "eager"
    return transformers.LlamaForCausalLM(config).float()


def ids_and_labels(seed=SEED, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 97, (2, 11), generator=g)
    labels = ids.clone()
    labels[1, 4] = -100
    return ids.to(device), labels.to(device)


def step(model, ids, labels):
    """Loss and every parameter's gradient of one forward + backward."""
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=labels).loss
    loss.backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def calls(name):
    return hf_kernels.stats().get(name, {}).get("kernel_calls", 0)


@unittest.skipUnless(HAVE_TORCH, WHY)
class NoarchLayout(unittest.TestCase):
    """What kcpp_add_package writes for the `kernels` library, and what the manifest says of it."""

    def test_every_package_has_noarch_variants_in_its_manifest(self):
        for name, folder in packages().items():
            manifest = json.loads((Path(folder) / "manifest.json").read_text())
            self.assertEqual(sorted(manifest.get("noarch", {})), ["torch-cpu", "torch-cuda"], name)
            for variant, entry in manifest["noarch"].items():
                vdir = Path(folder) / "build" / variant
                for f in ("__init__.py", "layers.py", "metadata.json"):
                    self.assertIn(f"build/{variant}/{f}", entry["files"], (name, variant))
                for path, h in entry["files"].items():
                    data = (Path(folder) / path).read_bytes()
                    self.assertEqual(hashlib.sha256(data).hexdigest(), h["sha256"], path)
                    self.assertEqual(len(data), h["size"], path)
                meta = json.loads((vdir / "metadata.json").read_text())
                self.assertRegex(meta["name"], NAME)
                self.assertEqual(meta["name"].replace("-", "_"), name)
                self.assertEqual(meta["backend"]["type"], variant.split("-", 1)[1])
                self.assertEqual(meta["version"], int(manifest["version"].split(".")[0]))
                self.assertEqual(meta["python-depends"], [])

    def test_package_reference(self):
        liger = packages()["liger"]
        self.assertEqual(hf_kernels.package_reference(Path(liger) / "build" / "torch-cpu"), (liger, True))
        commit = "0123456789abcdef0123456789abcdef01234567"
        snap = f"/cache/hub/kernels--kernels-cpp--liger/snapshots/{commit}/build/torch-cuda"
        self.assertEqual(hf_kernels.package_reference(snap), (f"kernels-cpp/liger@{commit}", False))
        with tempfile.TemporaryDirectory() as d:
            with self.assertRaisesRegex(ImportError, "not the noarch folder of a kernels.cpp package"):
                hf_kernels.package_reference(Path(d) / "build" / "torch-cpu")

    def test_exported_layers_follow_the_kernels_rules(self):
        liger = hf_kernels.layers_for(Path(packages()["liger"]) / "build" / "torch-cpu" / "layers.py")
        act = hf_kernels.layers_for(Path(packages()["activation"]) / "build" / "torch-cpu" / "layers.py")
        self.assertIn("LigerRMSNorm", liger)
        self.assertIs(liger["apply_rotary_transformers"], liger["LigerRotaryEmbedding"])
        for n in ("SiLU", "GeLU", "GeluTanh", "FastGELU", "NewGELU", "QuickGELU", "SiluAndMul", "GeluAndMul",
                  "GeluTanhAndMul"):
            self.assertIn(n, act)
        self.assertIs(act["Silu"], act["SiLU"])
        base = {n for n in dir(torch.nn.Module)}
        for cls in (*liger.values(), *act.values()):
            self.assertTrue(issubclass(cls, torch.nn.Module))
            self.assertIs(cls.__init__, torch.nn.Module.__init__)
            self.assertLessEqual(set(dir(cls)) - base, {"has_backward", "can_torch_compile"}, cls)


@unittest.skipUnless(HAVE_TORCH, WHY)
class NoarchLayers(unittest.TestCase):
    """The exported layers bound to Transformers' modules, as the `kernels` library binds them."""

    @classmethod
    def setUpClass(cls):
        cls.liger = hf_kernels.layers_for(Path(packages()["liger"]) / "build" / "torch-cpu" / "layers.py")
        cls.act = hf_kernels.layers_for(Path(packages()["activation"]) / "build" / "torch-cpu" / "layers.py")

    def bind(self, module, layer):
        import types
        module.forward = types.MethodType(layer.forward, module)
        return module

    def test_rms_norm_forward_backward(self):
        from transformers.models.llama.modeling_llama import LlamaRMSNorm
        torch.manual_seed(SEED)
        ref = LlamaRMSNorm(33, eps=1e-5)
        ref.weight.data.normal_()
        ours = self.bind(LlamaRMSNorm(33, eps=1e-5), self.liger["LigerRMSNorm"])
        ours.weight.data.copy_(ref.weight.data)
        x = torch.randn(3, 5, 33, requires_grad=True)
        x2 = x.detach().clone().requires_grad_()
        before = calls("liger:LigerRMSNorm")
        y, y2 = ref(x), ours(x2)
        torch.testing.assert_close(y2, y, rtol=1e-5, atol=1e-6)
        dy = torch.randn_like(y)
        y.backward(dy)
        y2.backward(dy)
        torch.testing.assert_close(x2.grad, x.grad, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(ours.weight.grad, ref.weight.grad, rtol=1e-4, atol=1e-5)
        with torch.no_grad():
            torch.testing.assert_close(ours(x2), ref(x), rtol=1e-5, atol=1e-6)
        self.assertEqual(calls("liger:LigerRMSNorm"), before + 2)

    def test_rms_norm_falls_back_on_mixed_dtypes(self):
        from transformers.models.llama.modeling_llama import LlamaRMSNorm
        ours = self.bind(LlamaRMSNorm(8), self.liger["LigerRMSNorm"])
        x = torch.randn(2, 8, dtype=torch.float64)
        stats = hf_kernels.stats()["liger:LigerRMSNorm"]
        y = ours(x)  # the module's own forward: f32 weight times an f64 row
        self.assertEqual(y.dtype, torch.float64)
        after = hf_kernels.stats()["liger:LigerRMSNorm"]
        self.assertEqual(after["fallbacks"], stats["fallbacks"] + 1)
        self.assertIn("RMSNorm/1 takes one dtype", after["last_refusal"])

    def test_rotary_forward_backward(self):
        from transformers.models.llama import modeling_llama as ml
        rot = self.liger["LigerRotaryEmbedding"]()  # a stateless module; its forward has the function's signature
        torch.manual_seed(SEED)
        q = torch.randn(2, 4, 7, 16).transpose(1, 2).contiguous().transpose(1, 2).requires_grad_()
        k = torch.randn(2, 2, 7, 16, requires_grad=True)
        ang = torch.randn(2, 7, 8)
        cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
        func = ml.apply_rotary_pos_emb  # kernels' function module: forward(q, k, cos, sin, unsqueeze_dim=1)
        qa, ka = func(q, k, cos, sin)
        q2, k2 = q.detach().clone().requires_grad_(), k.detach().clone().requires_grad_()
        before = calls("liger:LigerRotaryEmbedding")
        qb, kb = rot(q2, k2, cos, sin)
        torch.testing.assert_close(qb, qa, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(kb, ka, rtol=1e-5, atol=1e-6)
        (qa.square().sum() + ka.sum()).backward()
        (qb.square().sum() + kb.sum()).backward()
        torch.testing.assert_close(q2.grad, q.grad, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(k2.grad, k.grad, rtol=1e-5, atol=1e-6)
        self.assertEqual(calls("liger:LigerRotaryEmbedding"), before + 1)

    def test_activations(self):
        from transformers import activations as A
        torch.manual_seed(SEED)
        for name, module in (("SiLU", A.SiLUActivation()), ("GeLU", A.GELUActivation()),
                             ("NewGELU", A.NewGELUActivation()), ("FastGELU", A.FastGELUActivation()),
                             ("QuickGELU", A.QuickGELUActivation())):
            x = torch.randn(3, 37, requires_grad=True)
            y = module(x)
            ours = self.bind(type(module)(), self.act[name])
            x2 = x.detach().clone().requires_grad_()
            before = calls(f"activation:{name}")
            y2 = ours(x2)
            torch.testing.assert_close(y2, y, rtol=1e-5, atol=1e-6, msg=name)
            y.sum().backward()
            y2.sum().backward()
            torch.testing.assert_close(x2.grad, x.grad, rtol=1e-5, atol=1e-6, msg=name)
            self.assertEqual(calls(f"activation:{name}"), before + 1, name)
        gated = self.act["SiluAndMul"]()
        x = torch.randn(4, 2 * 19)
        torch.testing.assert_close(gated(x), torch.nn.functional.silu(x[:, :19]) * x[:, 19:], rtol=1e-5, atol=1e-6)


    def test_multi_scale_deformable_attention(self):
        # Deformable DETR's module with the deformable_attention package's layer bound to it: forward and
        # the gradients of value, locations and weights against the module's own grid_sample path.
        from transformers.models.deformable_detr.modeling_deformable_detr import MultiScaleDeformableAttention
        layer = hf_kernels.layers_for(Path(packages()["deformable_attention"]) / "build" / "torch-cpu" / "layers.py")
        ours = self.bind(MultiScaleDeformableAttention(), layer["MultiScaleDeformableAttention"])
        torch.manual_seed(SEED)
        shapes_list = [(6, 5), (3, 3), (2, 1)]
        shapes = torch.tensor(shapes_list, dtype=torch.int64)
        starts = torch.cat([torch.zeros(1, dtype=torch.int64), (shapes[:, 0] * shapes[:, 1]).cumsum(0)[:-1]])
        b, q, m, c, p = 2, 7, 2, 8, 3
        value = torch.randn(b, int((shapes[:, 0] * shapes[:, 1]).sum()), m, c, requires_grad=True)
        loc = torch.rand(b, q, m, len(shapes_list), p, 2).mul(1.2).sub(0.1).requires_grad_()  # some outside
        weights = torch.rand(b, q, m, len(shapes_list), p).softmax(-1).requires_grad_()
        leaves = [t.detach().clone().requires_grad_() for t in (value, loc, weights)]
        before = calls("deformable_attention:MultiScaleDeformableAttention")
        ref = MultiScaleDeformableAttention()(value, shapes, shapes_list, starts, loc, weights, 64)
        got = ours(leaves[0], shapes, shapes_list, starts, leaves[1], leaves[2], 64)
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
        dout = torch.randn_like(ref)
        ref.backward(dout)
        got.backward(dout)
        for mine, theirs, name in zip(leaves, (value, loc, weights), ("value", "locations", "weights")):
            torch.testing.assert_close(mine.grad, theirs.grad, rtol=1e-4, atol=1e-5, msg=name)
        self.assertEqual(calls("deformable_attention:MultiScaleDeformableAttention"), before + 1)


@unittest.skipUnless(HAVE_KERNELS, WHY_KERNELS)
class WithTheKernelsLibrary(unittest.TestCase):
    """The real `kernels` library and Transformers' use_kernels."""

    def mapping(self):
        p = packages()
        return {"RMSNorm": f"{p['liger']}:LigerRMSNorm", "rotary_pos_emb": f"{p['liger']}:LigerRotaryEmbedding",
                "SiLU": f"{p['activation']}:SiLU"}

    def test_get_local_kernel_loads_our_package(self):
        module = kernels.get_local_kernel(Path(packages()["liger"]))
        self.assertTrue(hasattr(module.layers, "LigerRMSNorm"))
        # The variant kernels chose for this torch (torch-cuda for a CUDA build of torch, even without a GPU).
        backend = "cuda" if torch.version.cuda else "cpu"
        self.assertIn(f"torch-{backend}", Path(module.__file__).parts)

    def test_transformers_kernel_config_refuses_the_cpu(self):
        # Transformers' KernelConfig knows no "cpu" device; if this starts to pass, test_use_kernels_cpu can use it.
        model = tiny_llama()
        config = transformers.KernelConfig(kernel_mapping=self.mapping(), use_local_kernel=True)
        with self.assertRaisesRegex(ValueError, "supported, got: cpu"):
            model.set_use_kernels(True, config)

    def tearDown(self):
        # kernels swaps the forward of the modeling module's one apply_rotary_pos_emb function module
        # (shared by every model of the family): give it back its own.
        from transformers.models.llama import modeling_llama
        vars(modeling_llama.apply_rotary_pos_emb).pop("forward", None)

    def reference_run(self, device):
        """Loss, gradients and greedy tokens of the model without kernels (before anything is kernelized:
        the rotary function module is shared by every Llama)."""
        reference = tiny_llama().to(device)
        ids, labels = ids_and_labels(device=device)
        reference.train()
        loss, grads = step(reference, ids, labels)
        reference.eval()
        with torch.no_grad():
            tokens = reference.generate(ids[:1, :5], max_new_tokens=6, do_sample=False, pad_token_id=0)
        return ids, labels, loss, grads, tokens.tolist()

    def check_train_and_generate(self, model, ids, labels, loss_ref, grads_ref, tokens_ref):
        names = ("liger:LigerRMSNorm", "liger:LigerRotaryEmbedding", "activation:SiLU")
        model.train()
        before = {n: calls(n) for n in names}
        loss, grads = step(model, ids, labels)
        # Every RMSNorm (2 per layer + the final one), every layer's rotary embedding and MLP activation.
        self.assertEqual(calls("liger:LigerRMSNorm") - before["liger:LigerRMSNorm"], 5)
        self.assertEqual(calls("liger:LigerRotaryEmbedding") - before["liger:LigerRotaryEmbedding"], 2)
        self.assertEqual(calls("activation:SiLU") - before["activation:SiLU"], 2)
        torch.testing.assert_close(loss, loss_ref, rtol=1e-5, atol=1e-6)
        for n, g in grads_ref.items():
            torch.testing.assert_close(grads[n], g, rtol=1e-4, atol=1e-5, msg=n)
        model.eval()
        before = {n: calls(n) for n in names}
        with torch.no_grad():
            tokens = model.generate(ids[:1, :5], max_new_tokens=6, do_sample=False, pad_token_id=0)
        self.assertEqual(tokens.tolist(), tokens_ref)
        for n in names:  # at least once per step of the generation (the prompt, then each new token)
            self.assertGreaterEqual(calls(n) - before[n], 6, n)

    def test_use_kernels_cpu(self):
        ids, labels, loss, grads, tokens = self.reference_run("cpu")
        model = tiny_llama()
        mapping = {name: {"cpu": kernels.LocalLayerRepository(repo_path=Path(ref.split(":")[0]),
                                                              layer_name=ref.split(":")[1])}
                   for name, ref in self.mapping().items()}
        model.train()
        # The mapping for as long as the model is used: Transformers kernelizes again at each train() / eval().
        with kernels.use_kernel_mapping(mapping):
            model.set_use_kernels(True)
            self.assertTrue(model.use_kernels)
            self.check_train_and_generate(model, ids, labels, loss, grads, tokens)

    def test_kernel_config_path_with_the_cpu_let_in(self):
        # The KernelConfig(use_local_kernel=True) path as CUDA takes it (sanitize, create_compatible_mapping,
        # LocalLayerRepository, kernelize again at train() / eval()), on the CPU with "cpu" added to the
        # device list Transformers checks: all that differs on CUDA is the device.
        from unittest import mock
        from transformers.utils import kernel_config as kc
        ids, labels, loss, grads, tokens = self.reference_run("cpu")
        model = tiny_llama()
        model.train()
        with mock.patch.object(kc, "KERNELS_SUPPORTED_DEVICE_TYPES", [*kc.KERNELS_SUPPORTED_DEVICE_TYPES, "cpu"]):
            model.set_use_kernels(True, transformers.KernelConfig(kernel_mapping=self.mapping(), use_local_kernel=True))
        self.check_train_and_generate(model, ids, labels, loss, grads, tokens)

    @unittest.skipUnless(HAVE_TORCH and torch.cuda.is_available(), "skipped: no CUDA device")
    def test_use_kernels_cuda_kernel_config(self):
        ids, labels, loss, grads, tokens = self.reference_run("cuda")
        model = tiny_llama().cuda()
        model.train()
        model.set_use_kernels(True, transformers.KernelConfig(kernel_mapping=self.mapping(), use_local_kernel=True))
        self.check_train_and_generate(model, ids, labels, loss, grads, tokens)


# What the subprocess of FromAHub runs: kernels.get_kernel over HF_ENDPOINT, then the exported RMSNorm
# against Transformers' own; a JSON line of what happened.
_GET_KERNEL = r"""
import json, sys, torch, kernels
from kcpp import hf_kernels
from transformers.models.llama.modeling_llama import LlamaRMSNorm
try:
    module = kernels.get_kernel(sys.argv[1], revision=sys.argv[2], trust_remote_code=True)
except Exception as e:  # the refusal travels back as text
    print(json.dumps({"error": f"{type(e).__name__}: {e}"}))
    sys.exit(0)
torch.manual_seed(0)
ref = LlamaRMSNorm(24, eps=1e-5)
ref.weight.data.normal_()
ours = LlamaRMSNorm(24, eps=1e-5)
ours.weight.data.copy_(ref.weight.data)
ours.forward = module.layers.LigerRMSNorm.forward.__get__(ours)
x = torch.randn(4, 24)
with torch.no_grad():
    diff = (ours(x) - ref(x)).abs().max().item()
print(json.dumps({"file": module.__file__, "diff": diff, "calls": hf_kernels.stats()}))
"""


@unittest.skipUnless(HAVE_KERNELS, WHY_KERNELS)
class FromAHub(unittest.TestCase):
    """`kernels.get_kernel("org/repo", revision=...)` from a hub: `kcpp serve` on loopback over this build's
    liger package, published as kernels-cpp/liger at v<version> (the Hub's kernel repositories' routes,
    /api/kernels/...).  The `kernels` library picks the noarch variant and downloads it into its cache;
    its layers.py loads the package by reference through kcpp's C++ hub, which verifies it as any load:
    unsigned, or signed by a publisher not trusted, it is refused; signed and trusted, the layer runs and
    equals Transformers' RMSNorm.  Each load runs in a process of its own (huggingface_hub reads
    HF_ENDPOINT when imported)."""

    @classmethod
    def setUpClass(cls):
        from test_default_mapping import kcpp_binary
        cls.exe = kcpp_binary()
        if cls.exe is None or not cls.exe.is_file():
            if os.environ.get("KCPP_REQUIRE_HF_KERNELS"):
                raise RuntimeError(f"KCPP_REQUIRE_HF_KERNELS is set but the kcpp binary is missing ({cls.exe})")
            raise unittest.SkipTest(f"needs the kcpp binary ({cls.exe})")
        cls.tmp = tempfile.TemporaryDirectory()
        cls.server = None
        try:
            cls.start()
        except BaseException:
            cls.tearDownClass()
            raise

    @classmethod
    def start(cls):
        from test_default_mapping import Serve
        root = Path(cls.tmp.name)
        cls.version = kcpp.Hub(allow_all_kernels=True).inspect(packages()["liger"])["version"]
        cls.env = {k: v for k, v in os.environ.items()
                   if k not in ("KCPP_ALLOW_ALL_KERNELS", "KCPP_TRUSTED_PUBLISHERS", "HF_HUB_OFFLINE", "HF_TOKEN",
                                "HF_HUB_DISABLE_TELEMETRY")}
        # (HF_HUB_DISABLE_TELEMETRY=1 makes huggingface_hub 2.4 send a User-Agent ending in "; ", which
        # httpx refuses to send; the telemetry would go to the loopback server anyway.)  The lock file:
        # none is named, and the processes run in the scratch folder, where no ./kcpp.lock is.
        cls.env.update(KCPP_TRUST_STORE=str(root / "trusted_publishers.json"), KCPP_LOCK_FILE="",
                       PYTHONPATH=os.pathsep.join(p for p in sys.path if p), HF_HUB_DISABLE_XET="1")
        run = dict(env=cls.env, cwd=root, check=True, capture_output=True, timeout=120)
        # v<version>: signed by kcpp-test; liger-unsigned: the same package without a signature.
        subprocess.run([str(cls.exe), "keygen", "--publisher", "kcpp-test", "--out", str(root / "keys")], **run)
        signed = root / "hub" / "kernels-cpp" / "liger" / f"v{cls.version}"
        shutil.copytree(packages()["liger"], signed)
        subprocess.run([str(cls.exe), "package", "sign", str(signed), "--key", str(root / "keys" / "kcpp-test.key")], **run)
        shutil.copytree(packages()["liger"], root / "hub" / "kernels-cpp" / "liger-unsigned" / f"v{cls.version}")
        cls.server = Serve(cls.exe, root / "hub", cwd=root)
        cls.env["HF_ENDPOINT"] = cls.server.endpoint

    @classmethod
    def tearDownClass(cls):
        if cls.server is not None:
            cls.server.stop()
        cls.tmp.cleanup()

    def get_kernel(self, repo):
        """A fresh process and fresh caches (the `kernels` library's and kcpp's): what get_kernel gave."""
        caches = tempfile.mkdtemp(dir=self.tmp.name)
        env = dict(self.env, HF_HOME=os.path.join(caches, "hf"), KCPP_CACHE=os.path.join(caches, "kcpp"))
        out = subprocess.run([sys.executable, "-c", _GET_KERNEL, repo, f"v{self.version}"], env=env, cwd=caches,
                             capture_output=True, text=True, timeout=300)
        self.assertEqual(out.returncode, 0, out.stderr[-3000:])
        return json.loads(out.stdout.strip().splitlines()[-1])

    def trust(self, trusted):
        store = Path(self.env["KCPP_TRUST_STORE"])
        store.unlink(missing_ok=True)
        if trusted:
            subprocess.run([str(self.exe), "trust", "add", str(Path(self.tmp.name) / "keys" / "kcpp-test.pub")],
                           env=self.env, cwd=self.tmp.name, check=True, capture_output=True, timeout=120)

    def test_a_signed_package_of_a_trusted_publisher_loads_and_runs(self):
        self.trust(True)
        got = self.get_kernel("kernels-cpp/liger")
        self.assertNotIn("error", got, got.get("error"))
        backend = "cuda" if torch.version.cuda else "cpu"
        self.assertRegex(got["file"], rf"kernels--kernels-cpp--liger/snapshots/[0-9a-f]{{40}}/build/torch-{backend}/")
        self.assertLess(got["diff"], 1e-5)
        self.assertEqual(got["calls"]["liger:LigerRMSNorm"]["kernel_calls"], 1)

    def test_verification_stays_on(self):
        self.trust(False)
        got = self.get_kernel("kernels-cpp/liger")
        self.assertRegex(got.get("error", ""), "signed by 'kcpp-test'.*a publisher not in the trust store")
        got = self.get_kernel("kernels-cpp/liger-unsigned")
        self.assertRegex(got.get("error", ""), "the manifest is not signed")


if __name__ == "__main__":
    unittest.main()
