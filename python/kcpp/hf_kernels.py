"""kernels.cpp packages as the Hugging Face `kernels` library loads them.

Every package built here carries, beside its kcpp variants, the `kernels` library's noarch variants
build/torch-cpu/ and build/torch-cuda/ (cmake/KcppPackage.cmake writes them from python/hf_noarch/):
an `__init__.py`, a `layers.py` and a `metadata.json`.  So the real `kernels` library, and
Transformers' `use_kernels` over it, load our packages with nothing kcpp-specific on the user's side:

    from transformers import AutoModelForCausalLM, KernelConfig
    config = KernelConfig(kernel_mapping={"RMSNorm": "/path/to/kernels/liger:LigerRMSNorm",
                                          "rotary_pos_emb": "/path/to/kernels/liger:LigerRotaryEmbedding",
                                          "SiLU": "/path/to/kernels/activation:SiLU"},
                          use_local_kernel=True)
    model = AutoModelForCausalLM.from_pretrained(..., use_kernels=True, kernel_config=config)

This module is what those files call.  `layers_for(layers_py)` loads the package whose noarch folder
holds `layers_py` through the C++ hub (kcpp.Hub: the library's sha256 against the manifest, the
signature and trust, the lock file; nothing is verified here) and returns one torch layer class per
package layer whose contract has a Transformers counterpart, named as the package names it
(`LigerRMSNorm`), with the aliases kernels-community's repos use (`Silu`, `Gelu`,
`apply_rotary_transformers`).  The classes follow the `kernels` rules for layers: stateless
`nn.Module`s, no constructor, only `forward` (plus `has_backward` / `can_torch_compile`), with the
forward signature of the Transformers module they replace, reading that module's attributes
(`self.weight`, `self.variance_epsilon`).

Where the package comes from decides the trust rule: a package folder (`manifest.json` two levels
above the noarch folder) was named by the user (`use_local_kernel=True`, `LOCAL_KERNELS`), which the
`kernels` library treats as trusted, so the hub loads it unsigned too (allow_all_kernels), still
checking every hash and refusing a signature that does not verify; a copy in the Hugging Face cache
(`kernels--org--repo/snapshots/<commit>/`) is loaded as the reference `org/repo@<commit>` under the
environment's trust settings (the trust store, KCPP_ALLOW_ALL_KERNELS), exactly as kcpp loads it.

Each call runs the kernel when the package's layer runs on the tensors' device, in the call's mode
(training when autograd will differentiate it), and its supports() accepts; otherwise the module's
own forward runs.  `stats()` counts both, per layer, with the last reason a kernel was not used.
"""
import re
import threading
from dataclasses import dataclass
from pathlib import Path

import kcpp

__all__ = ["layers_for", "package_reference", "load_package", "stats", "reset_stats", "LAYER_CONTRACTS"]

# Contract -> exported layer classes' forward signature, by Transformers module (see _FACTORIES).
LAYER_CONTRACTS = ("RMSNorm/1", "rotary_pos_emb/1", "SiLU/1", "GeLU/1", "GeluTanh/1", "FastGELU/1", "NewGELU/1",
                   "QuickGELU/1", "SiluAndMul/1", "GeluAndMul/1", "GeluTanhAndMul/1", "MultiScaleDeformableAttention/1")

# Other names a layer is exported under: the layer names of kernels-community's repos that
# Transformers' default mapping uses for the same layers.
_ALIASES = {"SiLU": ("Silu",), "GeLU": ("Gelu",), "LigerRotaryEmbedding": ("apply_rotary_transformers",)}

# A Hugging Face cache snapshot: <cache>/<type>s--<org>--<repo>/snapshots/<commit>
_SNAPSHOT = re.compile(r"/(?:kernels|models)--(?P<org>[^/]+?)--(?P<repo>[^/]+)/snapshots/(?P<commit>[0-9a-f]{40})$")


def package_reference(variant_dir):
    """(reference, local) of the package whose noarch variant folder is `variant_dir`: the package folder
    itself when it holds manifest.json (local), else `org/repo@commit` for a Hugging Face cache snapshot."""
    variant_dir = Path(variant_dir).absolute()
    root = variant_dir.parent.parent
    if (root / "manifest.json").is_file():
        return str(root), True
    m = _SNAPSHOT.search(root.as_posix())
    if m:
        return f"{m['org']}/{m['repo']}@{m['commit']}", False
    raise ImportError(f"{variant_dir}: not the noarch folder of a kernels.cpp package (no manifest.json in {root}, "
                      "and not a Hugging Face cache snapshot kernels--org--repo/snapshots/<commit>)")


_packages = {}
_packages_lock = threading.Lock()


def load_package(variant_dir):
    """The package of a noarch folder, loaded once per process through the C++ hub."""
    reference, local = package_reference(variant_dir)
    with _packages_lock:
        if reference not in _packages:
            hub = kcpp.Hub(allow_all_kernels=True) if local else kcpp.Hub()
            _packages[reference] = hub.load(reference)
        return _packages[reference]


# ---- statistics ---------------------------------------------------------------------------------------------

@dataclass
class _Counts:
    kernel_calls: int = 0
    fallbacks: int = 0
    last_refusal: str = ""


_counts = {}


def stats():
    """{"package:Layer": {"kernel_calls", "fallbacks", "last_refusal"}} since the last reset_stats()."""
    return {k: dict(vars(c)) for k, c in _counts.items()}


def reset_stats():
    for c in _counts.values():
        c.kernel_calls, c.fallbacks, c.last_refusal = 0, 0, ""


# ---- the layer classes ----------------------------------------------------------------------------------------

def layers_for(layers_py):
    """{name: torch layer class} for the package whose noarch folder holds `layers_py` (layers.py's
    `globals().update(layers_for(__file__))`)."""
    package = load_package(Path(layers_py).parent)
    out = {}
    for name in package.layers:
        layer = package.layer(name)
        factory = _FACTORIES.get(layer.contract)
        if factory is None:
            continue
        cls = _layer_class(name, package.name, layer, factory)
        out[name] = cls
        for alias in _ALIASES.get(name, ()):
            out.setdefault(alias, cls)
    return out


def _layer_class(name, package_name, layer, factory):
    import torch

    counts = _counts.setdefault(f"{package_name}:{name}", _Counts())
    call = _Call(layer, counts)
    forward = factory(call)
    forward._kcpp_call = call
    forward.__name__ = forward.__qualname__ = "forward"
    forward.__doc__ = f"{package_name}'s {name} ({layer.contract}) through kernels.cpp; the module's own forward " \
                      "where the kernel does not take the call."
    return type(name, (torch.nn.Module,), {
        "__module__": __name__,
        "__doc__": f"{layer.doc} (kernels.cpp package {package_name}, {layer.contract})",
        "forward": forward,
        "has_backward": bool(layer.has_backward),
        # An autograd.Function over a C extension: a graph break under torch.compile.
        "can_torch_compile": False,
    })


class _Call:
    """One exported layer: decides per call whether the kernel runs, counting."""

    _DL = {"cpu": 1, "cuda": 2}

    def __init__(self, layer, counts):
        self.layer, self.counts = layer, counts
        self.modes = layer.modes

    def choose(self, args, training, device):
        """The mode to run the kernel in, or None (the module's forward runs; counted with the reason)."""
        mode = "training" if training else "inference"
        why = None
        dl = self._DL.get(device.type)
        if dl is None or not self.layer.runs_on(dl):
            why = f"{self.layer.name} does not run on {device.type}"
        elif not self.modes & (kcpp.MODE_TRAINING if training else kcpp.MODE_INFERENCE):
            why = f"{self.layer.name} is not built for {mode}"
        elif training and not self.layer.has_backward:
            why = f"{self.layer.name} has no backward"
        elif any(v.numel() == 0 for v in args.values() if hasattr(v, "numel")):
            why = "an empty tensor"
        else:
            try:
                ok, reason = self.layer.supports(args, mode)
            except (kcpp.KcppError, ValueError, TypeError) as e:  # a call the contract cannot express
                ok, reason = False, str(e)
            if not ok:
                why = reason
        if why is not None:
            self.counts.fallbacks += 1
            self.counts.last_refusal = why
            return None
        self.counts.kernel_calls += 1
        return mode


def _original(module, call):
    """The forward of the module's own class, which a call the kernel does not take runs (the `kernels`
    library replaces only the instance's forward)."""
    forward = type(module).forward
    if getattr(forward, "_kcpp_call", None) is call:  # an instance of the exported class itself
        raise RuntimeError(f"{type(module).__name__}: the kernel does not take this call "
                           f"({call.counts.last_refusal}) and the layer has no module forward to fall back to")
    return forward.__get__(module)


def _grad(*tensors):
    import torch
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _functions():
    """The autograd Functions (built on first use, so that importing this module needs no torch)."""
    global _F
    if _F is not None:
        return _F
    import torch

    class RMSNorm(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, weight, layer, args):
            layer.forward(args, "training")
            ctx.save_for_backward(args["x"], weight, args["rstd"])
            ctx.layer, ctx.extra = layer, {k: args[k] for k in ("eps", "offset", "casting")}
            return args["y"]

        @staticmethod
        def backward(ctx, dy):
            x, weight, rstd = ctx.saved_tensors
            dx = torch.empty_like(x)
            dweight = torch.empty_like(weight) if ctx.needs_input_grad[1] else None
            ctx.layer.backward({"dy": dy.contiguous(), "x": x, "weight": weight, "rstd": rstd, "dx": dx,
                                "dweight": dweight, **ctx.extra})
            return dx, dweight, None, None

    class Rotary(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, layer, args):
            layer.forward(args, "training")
            ctx.save_for_backward(args["cos"], args["sin"])
            ctx.layer, ctx.layout = layer, args["layout"]
            ctx.shapes = (q.shape, q.dtype, k.shape)
            return args["q_out"], args["k_out"]

        @staticmethod
        def backward(ctx, dq_out, dk_out):
            cos, sin = ctx.saved_tensors
            (qs, dtype, ks) = ctx.shapes
            dq_out = torch.zeros(qs, dtype=dtype, device=cos.device) if dq_out is None else dq_out.contiguous()
            dk_out = torch.zeros(ks, dtype=dtype, device=cos.device) if dk_out is None else dk_out.contiguous()
            dq, dk = torch.empty_like(dq_out), torch.empty_like(dk_out)
            ctx.layer.backward({"dq_out": dq_out, "dk_out": dk_out, "cos": cos, "sin": sin, "layout": ctx.layout,
                                "style": "rotate_half", "dq": dq, "dk": dk})
            return dq, dk, None, None

    class Activation(torch.autograd.Function):
        """Plain (y = act(x)) and gated (y = act(x[..., :d]) * x[..., d:]) activations: backward from x."""

        @staticmethod
        def forward(ctx, x, layer, args):
            layer.forward(args, "training")
            ctx.save_for_backward(args["x"])
            ctx.layer = layer
            return args["y"]

        @staticmethod
        def backward(ctx, dy):
            (x,) = ctx.saved_tensors
            dx = torch.empty_like(x)
            ctx.layer.backward({"dy": dy.contiguous(), "x": x, "dx": dx})
            return dx, None, None

    class Msda(torch.autograd.Function):
        """MultiScaleDeformableAttention/1: the gradients of value, the sampling locations and the attention
        weights (the level shapes and starts are indices)."""

        @staticmethod
        def forward(ctx, value, loc, weights, layer, args):
            layer.forward(args, "training")
            ctx.save_for_backward(args["value"], args["value_spatial_shapes"], args["value_level_start_index"],
                                  args["sampling_locations"], args["attention_weights"])
            ctx.layer, ctx.im2col_step = layer, args["im2col_step"]
            return args["out"]

        @staticmethod
        def backward(ctx, dout):
            value, shapes, starts, loc, weights = ctx.saved_tensors
            grads = {"dvalue": torch.empty_like(value), "dsampling_locations": torch.empty_like(loc),
                     "dattention_weights": torch.empty_like(weights)}
            ctx.layer.backward({"dout": dout.contiguous(), "value": value, "value_spatial_shapes": shapes,
                                "value_level_start_index": starts, "sampling_locations": loc,
                                "attention_weights": weights, "im2col_step": ctx.im2col_step, **grads})
            return grads["dvalue"], grads["dsampling_locations"], grads["dattention_weights"], None, None

    _F = {"RMSNorm": RMSNorm, "Rotary": Rotary, "Activation": Activation, "Msda": Msda}
    return _F


_F = None


# Each factory takes a _Call and returns the forward of a layer class, with the signature of the
# Transformers module's forward it replaces (the `kernels` library compares the two).

def _rms_norm(call):
    # LlamaRMSNorm and the families that copy it (Mistral, Qwen2, Qwen3 and its q / k norms, Phi-3):
    # `weight` and `variance_epsilon`, statistics in f32, the normalized row rounded to the dtype and
    # then scaled ("llama" casting).
    def forward(self, hidden_states):
        import torch
        weight, eps = getattr(self, "weight", None), getattr(self, "variance_epsilon", None)
        x = hidden_states
        if not isinstance(weight, torch.Tensor) or eps is None or x.dtype != weight.dtype:
            why = (f"{type(self).__name__} has no weight / variance_epsilon (not Llama's RMSNorm)"
                   if eps is None or not isinstance(weight, torch.Tensor)
                   else f"x is {x.dtype} and weight {weight.dtype}: RMSNorm/1 takes one dtype")
            call.counts.fallbacks += 1
            call.counts.last_refusal = why
            return _original(self, call)(hidden_states)
        training = _grad(x, weight)
        x = x.contiguous()
        rows = x.numel() // max(x.shape[-1], 1)
        args = {"x": x, "weight": weight, "eps": float(eps), "offset": 0.0, "casting": "llama",
                "y": torch.empty_like(x),
                "rstd": torch.empty(rows, dtype=torch.float32, device=x.device) if training else None}
        mode = call.choose(args, training, x.device)
        if mode is None:
            return _original(self, call)(hidden_states)
        if not training:
            call.layer.forward(args, mode)
            return args["y"]
        return _functions()["RMSNorm"].apply(x, weight, call.layer, args)
    return forward


def _rotary(call):
    # Transformers' apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1): rotate-half, cos / sin
    # [batch, seq, dim] broadcast over the heads (unsqueeze_dim 1: q, k [B, H, S, D]; 2: [B, S, H, D]).
    def forward(self, q, k, cos, sin, unsqueeze_dim=1):
        import torch
        layout = {1: "bhsd", 2: "bshd"}.get(unsqueeze_dim)
        if layout is None or q.dim() != 4 or k.dim() != 4 or cos.dim() not in (2, 3) or _grad(cos, sin):
            call.counts.fallbacks += 1
            call.counts.last_refusal = ("cos / sin need gradients" if _grad(cos, sin) else
                                        f"unsqueeze_dim {unsqueeze_dim} with q {tuple(q.shape)}, cos {tuple(cos.shape)}")
            return _original(self, call)(q, k, cos, sin, unsqueeze_dim)
        training = _grad(q, k)
        args = {"q": q, "k": k, "cos": cos.contiguous(), "sin": sin.contiguous(), "layout": layout,
                "style": "rotate_half", "q_out": torch.empty(q.shape, dtype=q.dtype, device=q.device),
                "k_out": torch.empty(k.shape, dtype=k.dtype, device=k.device)}
        mode = call.choose(args, training, q.device)
        if mode is None:
            return _original(self, call)(q, k, cos, sin, unsqueeze_dim)
        if not training:
            call.layer.forward(args, mode)
            return args["q_out"], args["k_out"]
        return _functions()["Rotary"].apply(q, k, call.layer, args)
    return forward


def _activation(gated):
    def factory(call):
        # Transformers' activation modules (SiLUActivation, GELUActivation, ...: forward(self, input)) and
        # the gated x -> act(x[..., :d]) * x[..., d:] of kernels-community's SiluAndMul (forward(self, x)).
        def run(self, x):
            import torch
            training = _grad(x)
            x = x.contiguous()
            shape = (*x.shape[:-1], x.shape[-1] // 2) if gated else x.shape
            args = {"x": x, "y": torch.empty(shape, dtype=x.dtype, device=x.device)}
            if gated and x.shape[-1] % 2:
                mode = None
                call.counts.fallbacks += 1
                call.counts.last_refusal = f"the last dim {x.shape[-1]} is odd"
            else:
                mode = call.choose(args, training, x.device)
            if mode is None:
                return _original(self, call)(x)
            if not training:
                call.layer.forward(args, mode)
                return args["y"]
            return _functions()["Activation"].apply(x, call.layer, args)

        if gated:
            def forward(self, x):
                return run(self, x)
        else:
            def forward(self, input):  # noqa: A002 (Transformers' parameter name)
                return run(self, input)
        return forward
    return factory


def _msda(call):
    # Transformers' MultiScaleDeformableAttention (Deformable DETR's sampling step, marked
    # use_kernel_forward_from_hub("MultiScaleDeformableAttention")): value [B, S, M, C], the levels' shapes
    # [L, 2] and starts [L] (int64) with their list, sampling_locations [B, Q, M, L, P, 2], attention_weights
    # [B, Q, M, L, P] -> [B, Q, M C].  The kernel reads the levels from the two index tensors.
    def forward(self, value, value_spatial_shapes, value_spatial_shapes_list, level_start_index, sampling_locations,
                attention_weights, im2col_step):
        import torch

        def own():
            return _original(self, call)(value, value_spatial_shapes, value_spatial_shapes_list, level_start_index,
                                         sampling_locations, attention_weights, im2col_step)
        tensors = (value, value_spatial_shapes, level_start_index, sampling_locations, attention_weights)
        why = None
        if not all(isinstance(t, torch.Tensor) for t in tensors) or not isinstance(im2col_step, int):
            why = "arguments of other types than MultiScaleDeformableAttention/1's"
        elif value.dim() != 4 or sampling_locations.dim() != 6 or attention_weights.dim() != 5:
            why = (f"value {tuple(value.shape)}, sampling_locations {tuple(sampling_locations.shape)}: "
                   "MultiScaleDeformableAttention/1 takes [B, S, M, C] and [B, Q, M, L, P, 2]")
        elif sampling_locations.dtype != value.dtype or attention_weights.dtype != value.dtype:
            why = "MultiScaleDeformableAttention/1 takes one dtype for value, locations and weights"
        if why is not None:
            call.counts.fallbacks += 1
            call.counts.last_refusal = why
            return own()
        training = _grad(value, sampling_locations, attention_weights)
        v, loc, w = value.contiguous(), sampling_locations.contiguous(), attention_weights.contiguous()
        b, _, m, c = v.shape
        args = {"value": v, "value_spatial_shapes": value_spatial_shapes.contiguous(),
                "value_level_start_index": level_start_index.contiguous(), "sampling_locations": loc,
                "attention_weights": w, "im2col_step": im2col_step,
                "out": torch.empty((b, loc.shape[1], m * c), dtype=v.dtype, device=v.device)}
        mode = call.choose(args, training, v.device)
        if mode is None:
            return own()
        if not training:
            call.layer.forward(args, mode)
            return args["out"]
        return _functions()["Msda"].apply(v, loc, w, call.layer, args)
    return forward


_FACTORIES = {"RMSNorm/1": _rms_norm, "rotary_pos_emb/1": _rotary, "MultiScaleDeformableAttention/1": _msda,
              **{c: _activation(False) for c in ("SiLU/1", "GeLU/1", "GeluTanh/1", "FastGELU/1", "NewGELU/1",
                                                  "QuickGELU/1")},
              **{c: _activation(True) for c in ("SiluAndMul/1", "GeluAndMul/1", "GeluTanhAndMul/1")}}
