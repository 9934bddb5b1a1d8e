"""Package mamba against Transformers' own PyTorch paths, on the CPU in f32: the functions that
models/mamba/modeling_mamba.py (and falcon_mamba's copy) call when no hub kernel is mapped
(`mamba_selective_scan`, `mamba_selective_state_update`, `causal_conv1d_fn`, `causal_conv1d_update`),
with the gradients autograd takes through them; Falcon-Mamba's B / C norm is its
FalconMambaWeightlessRMSNorm applied first.  The layers are called through the C ABI (kcpp.Package
over the built library).  Skipped where torch or transformers is missing (CTest python.bridge's
interpreter); run by CTest python.package in the project's environment (scripts/python-env.sh).

Run: KCPP_PACKAGES_DIR=build/release/kernels python3 -m unittest python/tests/test_mamba.py
"""
import glob
import os
import sys
import unittest

try:
    import torch
    from transformers.models.falcon_mamba.modeling_falcon_mamba import FalconMambaWeightlessRMSNorm
    from transformers.models.mamba import modeling_mamba as mm
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
    found = sorted(glob.glob(os.path.join(PACKAGES, "mamba", "build", "kcpp1-cpu-*", "libmamba.so")))
    if not found:
        raise FileNotFoundError(f"package mamba has no cpu build under {PACKAGES} (set KCPP_PACKAGES_DIR)")
    return found[0]


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


@unittest.skipUnless(HAVE, WHY)
class MambaAgainstTransformers(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.pkg = kcpp.Package(library())

    def setUp(self):
        torch.manual_seed(int(os.environ.get("KCPP_SEED", "0")) or 1234)

    def scan_inputs(self, b=2, d=6, l=300, n=16):
        u, delta, z = torch.randn(b, d, l), torch.randn(b, d, l), torch.randn(b, d, l)
        A = -torch.exp(torch.empty(d, n).uniform_(-4, 1.5))
        B, C = torch.randn(b, n, l), torch.randn(b, n, l)
        D, bias = torch.randn(d), torch.randn(d) * 0.5 - 1
        return u, delta, A, B, C, D, z, bias

    def check_scan(self, falcon):
        u, delta, A, B, C, D, z, bias = self.scan_inputs()
        eps = 1e-6
        leaves = [t.clone().requires_grad_(True) for t in (u, delta, A, B, C, D, z, bias)]
        lu, ld, lA, lB, lC, lD, lz, lbias = leaves
        Bh, Ch = lB, lC
        if falcon:  # Transformers normalises B and C over N before the scan ([batch, L, N] there)
            norm = FalconMambaWeightlessRMSNorm(B.shape[1], eps=eps)
            Bh, Ch = norm(lB.transpose(1, 2)).transpose(1, 2), norm(lC.transpose(1, 2)).transpose(1, 2)
        ref, ref_last = mm.mamba_selective_scan(lu, ld, lA, Bh, Ch, D=lD, z=lz, delta_bias=lbias, delta_softplus=True,
                                                return_last_state=True)
        dout = torch.randn_like(ref)
        (ref * dout).sum().backward()

        layer = self.pkg.layer("SelectiveScan")
        out, last = torch.empty_like(u), torch.empty(u.shape[0], u.shape[1], A.shape[1])
        states = torch.empty(u.shape[0], u.shape[1], (u.shape[2] + 255) // 256, A.shape[1])
        args = {"u": u, "delta": delta, "A": A, "B": B, "C": C, "D": D, "z": z, "delta_bias": bias, "delta_softplus": 1}
        if falcon:
            args["bc_rms_eps"] = eps
        layer.forward(dict(args, out=out, last_state=last, states=states), mode="training")
        self.assertLess(rel(out, ref.detach()), 1e-5)
        self.assertLess(rel(last, ref_last.detach()), 1e-5)
        grads = {k: torch.empty_like(v) for k, v in (("du", u), ("ddelta", delta), ("dA", A), ("dB", B), ("dC", C), ("dD", D),
                                                      ("dz", z), ("ddelta_bias", bias))}
        layer.backward(dict(args, dout=dout, states=states, **grads))
        for name, leaf in zip(grads, leaves):
            with self.subTest(falcon=falcon, grad=name):
                self.assertLess(rel(grads[name], leaf.grad), 2e-5)

    def test_selective_scan(self):
        self.check_scan(falcon=False)

    def test_selective_scan_falcon_norm(self):
        self.check_scan(falcon=True)

    def test_selective_state_update(self):
        b, d, n = 3, 8, 16
        state = torch.randn(b, d, n)
        x, dt, z = torch.randn(b, d), torch.randn(b, d), torch.randn(b, d)
        A = -torch.exp(torch.empty(d, n).uniform_(-4, 1.5))
        B, C, D, bias = torch.randn(b, n), torch.randn(b, n), torch.randn(d), torch.randn(d) * 0.5 - 1
        ref_state = state.clone()
        ref = mm.mamba_selective_state_update(ref_state, x, dt, A, B, C, D, dt_bias=bias, dt_softplus=True, z=z)
        out = torch.empty(b, d)
        self.pkg.layer("SelectiveStateUpdate").forward(
            {"state": state, "x": x, "dt": dt, "A": A, "B": B, "C": C, "D": D, "z": z, "dt_bias": bias, "dt_softplus": 1,
             "out": out}, mode="inference")
        self.assertLess(rel(out, ref), 1e-5)
        self.assertLess(rel(state, ref_state), 1e-5)

    def test_causal_conv1d(self):
        b, d, l, w = 2, 7, 45, 4
        x, weight, bias = torch.randn(b, d, l), torch.randn(d, w) * 0.5, torch.randn(d)
        lx, lw, lb = (t.clone().requires_grad_(True) for t in (x, weight, bias))
        ref = mm.causal_conv1d_fn(lx, lw, lb, activation="silu")
        dout = torch.randn_like(ref)
        (ref * dout).sum().backward()
        layer = self.pkg.layer("CausalConv1d")
        out = torch.empty_like(x)
        args = {"x": x, "weight": weight, "bias": bias, "activation": "silu"}
        layer.forward(dict(args, out=out), mode="training")
        self.assertLess(rel(out, ref.detach()), 1e-6)
        dx, dw, db = torch.empty_like(x), torch.empty_like(weight), torch.empty_like(bias)
        layer.backward(dict(args, dout=dout, dx=dx, dweight=dw, dbias=db))
        self.assertLess(rel(dx, lx.grad), 1e-6)
        self.assertLess(rel(dw, lw.grad), 1e-6)
        self.assertLess(rel(db, lb.grad), 1e-6)

    def test_causal_conv1d_update(self):
        b, d, w = 2, 7, 4
        x, state = torch.randn(b, d, 1), torch.randn(b, d, w)  # Transformers' cache keeps W positions
        weight, bias = torch.randn(d, w) * 0.5, torch.randn(d)
        ref_state = state.clone()
        ref = mm.causal_conv1d_update(x, ref_state, weight, bias, activation="silu")
        out = torch.empty_like(x)
        self.pkg.layer("CausalConv1dUpdate").forward(
            {"x": x, "conv_state": state, "weight": weight, "bias": bias, "activation": "silu", "out": out}, mode="inference")
        self.assertLess(rel(out, ref), 1e-6)
        self.assertTrue(torch.equal(state, ref_state))


if __name__ == "__main__":
    unittest.main()
