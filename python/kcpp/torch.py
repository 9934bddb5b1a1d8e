"""kernelize Hugging Face Transformers models with kernels.cpp packages (PyTorch, Transformers 5.x).

    import kcpp.torch
    model = transformers.AutoModelForCausalLM.from_pretrained(...)
    kcpp.torch.kernelize(model)                      # this build's liger package, Liger's default switches
    loss = model(input_ids, labels=labels).loss; loss.backward()
    print(kcpp.torch.report(model))                  # which kernel each layer got, calls, fallbacks and why
    kcpp.torch.unkernelize(model)                    # the model as it was

Layers are found by what they are, in the model's own modeling module (Llama, Mistral, Qwen2, Qwen3,
Phi-3, Gemma 1 / 2 / 3 text; Gemma's RMSNorm, with its (1 + w), is not swapped yet):
  RMSNorm           the family's RMSNorm modules (`*RMSNorm` with `weight` and `variance_epsilon`)  RMSNorm/1
  MLP               gated MLPs (`gate_proj`, `up_proj`, `down_proj`, `act_fn`): the part between the
                    projections, act(gate) * up                                                    GLU/1
  rotary_pos_emb    the modeling module's `apply_rotary_pos_emb`, inside the model's attention
                    modules                                                                       rotary_pos_emb/1
  CrossEntropyLoss  the causal-LM loss of the logits (the model's `loss_function`)                 CrossEntropyLoss/1
  ForCausalLMLoss   the causal-LM loss fused with `lm_head` (the logits never exist): training
                    calls with labels return no logits, as Liger's                                  ForCausalLMLoss/1
Each swapped forward is a `torch.autograd.Function` whose forward and backward call the package's
layer through the C ABI (kcpp._core); what forward saves for backward is what the layer's contract
(docs/contracts/) names.  Every call first asks the kernel's supports(); a refusal (or a call the
contract cannot express: mixed dtypes, a weight without gradient slot, ...) runs the original forward,
counted, with the reason kept for report().  Packages come through the C++ hub (kcpp.Hub): references,
versions, variants, hashes, signatures and trust are checked there.

Mode: a call that autograd will differentiate runs the kernel in training mode (it saves what backward
needs); any other call (torch.no_grad(), model.eval() generation) in inference mode.  kernelize(mode=)
chooses the kernels the config maps for that mode; by default both modes' kernels are loaded, so
model.train() / model.eval() need no re-kernelize.
"""
import contextvars
import functools
import inspect
import json
import sys
import weakref
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

import kcpp
from . import _core

if _core is None:
    raise ImportError("kcpp.torch needs the extension kcpp._core: pip install . from the repository, or "
                      "scripts/python-env.sh then scripts/build.sh (PYTHONPATH=build/release/python)")

__all__ = ["kernelize", "unkernelize", "report", "Report"]

_MODES = ("training", "inference")

# The contract each layer name's kernels implement.
_CONTRACTS = {"RMSNorm": "RMSNorm/1", "MLP": "GLU/1", "rotary_pos_emb": "rotary_pos_emb/1",
              "CrossEntropyLoss": "CrossEntropyLoss/1", "ForCausalLMLoss": "ForCausalLMLoss/1"}

# The model types whose modeling code kcpp.torch's swaps were checked against (RMSNorm's casting,
# apply_rotary_pos_emb's rotate-half, the *ForCausalLM forward that the fused loss re-implements: body,
# lm_head, optional final logit soft-capping, loss_function).  Other models keep their layers, saying so.
_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma", "gemma2", "gemma3_text")

# Transformers' hidden_act names the GLU/1 contract takes.
_GLU_ACTIVATIONS = {"silu", "swish", "gelu", "gelu_tanh", "gelu_pytorch_tanh", "gelu_new", "gelu_fast", "quick_gelu"}


# ---- slots and their statistics -----------------------------------------------------------------------

@dataclass
class _Slot:
    layer_name: str
    contract: str
    kernels: dict = field(default_factory=dict)  # mode -> kcpp.Layer (absent: the reference in that mode)
    reason: str = "not kernelized"
    modules: int = 0
    kernel_calls: int = 0
    reference_calls: int = 0
    fallbacks: int = 0
    last_refusal: str = ""

    def kernel(self, training):
        return self.kernels.get("training" if training else "inference")

    def refuse(self, why):
        """The call runs the original forward: counted, with the reason."""
        self.fallbacks += 1
        self.reference_calls += 1
        self.last_refusal = why
        return None

    def choose(self, training, args):
        """The kernel for this call, or None (the reference runs): no kernel in this mode, or its
        supports() refused (counted, reason kept)."""
        k = self.kernel(training)
        if k is None:
            self.reference_calls += 1
            return None
        if any(isinstance(v, torch.Tensor) and v.numel() == 0 for v in args.values()):
            return self.refuse("an empty tensor: the reference handles it")
        try:
            ok, why = k.supports(args, "training" if training else "inference")
        except (kcpp.KcppError, ValueError, TypeError) as e:  # a call the contract cannot express (an empty tensor, ...)
            ok, why = False, str(e)
        if not ok:
            return self.refuse(why)
        self.kernel_calls += 1
        return k


@dataclass
class Report:
    """Per layer name: how many places of the model have it, the kernel or why none, and calls since
    kernelize (kernel, reference, fallbacks with the last refusal)."""
    entries: list

    def __str__(self):
        lines = []
        for e in self.entries:
            kernel = e["kernel"] or "reference"
            lines.append(f"{e['layer']}: {e['modules']} x {kernel} ({e['reason']}); calls: {e['kernel_calls']} kernel, "
                         f"{e['reference_calls']} reference, {e['fallbacks']} fallbacks"
                         + (f" (last: {e['last_refusal']})" if e["last_refusal"] else ""))
        return "\n".join(lines)

    def __getitem__(self, layer):
        for e in self.entries:
            if e["layer"] == layer:
                return e
        raise KeyError(f"no layer {layer!r} in the report; it has {[e['layer'] for e in self.entries]}")


class _State:
    """What kernelize did to one model, so unkernelize can undo it exactly."""

    def __init__(self):
        self.slots = {}
        self.restore = []  # callables, run in reverse order


def _needs_grad(*tensors):
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _contig(t):
    return t if t.is_contiguous() else t.contiguous()


# ---- RMSNorm/1 ------------------------------------------------------------------------------------------

class _RMSNormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, layer, args):
        layer.forward(args, "training")
        ctx.save_for_backward(args["x"], weight, args["rstd"])
        ctx.layer, ctx.eps = layer, args["eps"]
        return args["y"]

    @staticmethod
    def backward(ctx, dy):
        x, weight, rstd = ctx.saved_tensors
        dx = torch.empty_like(x)
        dweight = torch.empty_like(weight) if ctx.needs_input_grad[1] else None
        ctx.layer.backward({"dy": _contig(dy), "x": x, "weight": weight, "rstd": rstd, "eps": ctx.eps,
                            "dx": dx, "dweight": dweight})
        return dx, dweight, None, None


def _rms_norm_forward(module, slot, original, hidden_states):
    x, weight = hidden_states, module.weight
    training = _needs_grad(x, weight)
    if slot.kernel(training) is None:
        slot.reference_calls += 1
        return original(hidden_states)
    if x.dtype != weight.dtype:
        slot.refuse(f"x is {x.dtype} and weight {weight.dtype}: RMSNorm/1 takes one dtype")
        return original(hidden_states)
    x = _contig(x)
    rows = x.numel() // max(x.shape[-1], 1)
    args = {"x": x, "weight": weight, "eps": float(module.variance_epsilon), "casting": "llama",
            "y": torch.empty_like(x),
            "rstd": torch.empty(rows, dtype=torch.float32, device=x.device) if training else None}
    layer = slot.choose(training, args)
    if layer is None:
        return original(hidden_states)
    if not training:
        layer.forward(args, "inference")
        return args["y"]
    return _RMSNormFn.apply(x, weight, layer, args)


# ---- GLU/1 (the gated MLP's activation times up) ------------------------------------------------------------

class _GLUFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up, layer, args):
        layer.forward(args, "training")
        ctx.save_for_backward(args["gate"], args["up"])
        ctx.layer, ctx.activation = layer, args["activation"]
        return args["out"]

    @staticmethod
    def backward(ctx, dout):
        gate, up = ctx.saved_tensors
        dgate, dup = torch.empty_like(gate), torch.empty_like(up)
        ctx.layer.backward({"dout": _contig(dout), "gate": gate, "up": up, "activation": ctx.activation,
                            "dgate": dgate, "dup": dup})
        return dgate, dup, None, None


def _mlp_forward(module, slot, original, activation, x):
    training = _needs_grad(x, module.gate_proj.weight, module.up_proj.weight)
    if slot.kernel(training) is None:
        slot.reference_calls += 1
        return original(x)
    if activation is None:
        slot.refuse(f"activation {module.act_fn.__class__.__name__} is not one GLU/1 takes")
        return original(x)
    gate, up = _contig(module.gate_proj(x)), _contig(module.up_proj(x))
    args = {"gate": gate, "up": up, "activation": activation, "out": torch.empty_like(gate)}
    layer = slot.choose(training, args)
    if layer is None:
        return module.down_proj(module.act_fn(gate) * up)
    if not training:
        layer.forward(args, "inference")
        return module.down_proj(args["out"])
    return module.down_proj(_GLUFn.apply(gate, up, layer, args))


# ---- rotary_pos_emb/1 -------------------------------------------------------------------------------------

class _RopeFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, layer, args):
        layer.forward(args, "training")
        ctx.save_for_backward(args["cos"], args["sin"])
        ctx.layer = layer
        return args["q_out"], args["k_out"]

    @staticmethod
    def backward(ctx, dq_out, dk_out):
        cos, sin = ctx.saved_tensors
        dq_out, dk_out = _contig(dq_out), _contig(dk_out)
        dq, dk = torch.empty_like(dq_out), torch.empty_like(dk_out)
        ctx.layer.backward({"dq_out": dq_out, "dk_out": dk_out, "cos": cos, "sin": sin, "layout": "bhsd",
                            "dq": dq, "dk": dk})
        return dq, dk, None, None


# The model whose attention module is running (set by the attention wrappers): the patched
# apply_rotary_pos_emb of a modeling module serves kernelized models only.
_ROPE_SLOT = contextvars.ContextVar("kcpp_rope_slot", default=None)
# modeling module name -> [original apply_rotary_pos_emb, number of kernelized models using the patch]
_ROPE_PATCHES = {}


def _rope_dispatch(original, q, k, cos, sin, *args, **kwargs):
    slot = _ROPE_SLOT.get()
    if slot is None:
        return original(q, k, cos, sin, *args, **kwargs)
    training = _needs_grad(q, k)
    if slot.kernel(training) is None:
        slot.reference_calls += 1
        return original(q, k, cos, sin, *args, **kwargs)
    unsqueeze_dim = args[0] if args else kwargs.get("unsqueeze_dim", 1)
    if unsqueeze_dim != 1 or set(kwargs) - {"unsqueeze_dim"} or len(args) > 1:
        slot.refuse(f"apply_rotary_pos_emb called with unsqueeze_dim={unsqueeze_dim} or other arguments")
        return original(q, k, cos, sin, *args, **kwargs)
    if _needs_grad(cos, sin):
        slot.refuse("cos / sin require gradients (rotary_pos_emb/1 has none for them)")
        return original(q, k, cos, sin, *args, **kwargs)
    if q.dim() != 4 or k.dim() != 4 or q.dtype != cos.dtype:
        slot.refuse(f"q {tuple(q.shape)} {q.dtype}, cos {cos.dtype}: rotary_pos_emb/1 takes 4-D q, k in cos's dtype")
        return original(q, k, cos, sin, *args, **kwargs)
    if q.stride(-1) != 1:
        q = q.contiguous()
    if k.stride(-1) != 1:
        k = k.contiguous()
    args_ = {"q": q, "k": k, "cos": _contig(cos), "sin": _contig(sin), "layout": "bhsd",
             "q_out": torch.empty(q.shape, dtype=q.dtype, device=q.device),
             "k_out": torch.empty(k.shape, dtype=k.dtype, device=k.device)}
    layer = slot.choose(training, args_)
    if layer is None:
        return original(q, k, cos, sin, *args, **kwargs)
    if not training:
        layer.forward(args_, "inference")
        return args_["q_out"], args_["k_out"]
    return _RopeFn.apply(q, k, layer, args_)


def _patch_rope(modeling):
    name = modeling.__name__
    if name not in _ROPE_PATCHES:
        original = modeling.apply_rotary_pos_emb
        patched = functools.wraps(original)(functools.partial(_rope_dispatch, original))
        patched._kcpp_original = original
        modeling.apply_rotary_pos_emb = patched
        _ROPE_PATCHES[name] = [original, 0]
    _ROPE_PATCHES[name][1] += 1

    def unpatch():
        entry = _ROPE_PATCHES[name]
        entry[1] -= 1
        if entry[1] == 0:
            modeling.apply_rotary_pos_emb = entry[0]
            del _ROPE_PATCHES[name]
    return unpatch


def _attention_forward(slot, original, *args, **kwargs):
    token = _ROPE_SLOT.set(slot)
    try:
        return original(*args, **kwargs)
    finally:
        _ROPE_SLOT.reset(token)


# ---- CrossEntropyLoss/1 (the model's loss_function over the logits) -------------------------------------------

class _CrossEntropyFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, layer, args):
        layer.forward(args, "training")
        ctx.save_for_backward(args["grad"])
        ctx.layer = layer
        return args["loss"]

    @staticmethod
    def backward(ctx, dloss):
        (grad,) = ctx.saved_tensors
        dlogits = torch.empty_like(grad)
        ctx.layer.backward({"dloss": dloss.reshape(1).float().contiguous(), "grad": grad, "dlogits": dlogits})
        return dlogits, None, None


def _shifted_targets(labels, ignore_index, shift_labels, device):
    """Transformers' ForCausalLMLoss shift: token t's logits predict label t + 1."""
    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    return shift_labels.reshape(-1).to(device=device, dtype=torch.int64).contiguous()


def _causal_lm_loss(slot, original, logits, labels, vocab_size, num_items_in_batch=None, ignore_index=-100,
                    shift_labels=None, **kwargs):
    training = _needs_grad(logits)

    def reference():
        return original(logits, labels, vocab_size, num_items_in_batch=num_items_in_batch,
                        ignore_index=ignore_index, shift_labels=shift_labels, **kwargs)
    if slot.kernel(training) is None:
        slot.reference_calls += 1
        return reference()
    logits2d = _contig(logits).view(-1, vocab_size)
    reduction = "mean" if num_items_in_batch is None else "sum"
    args = {"logits": logits2d, "targets": _shifted_targets(labels, ignore_index, shift_labels, logits.device),
            "ignore_index": int(ignore_index), "reduction": reduction,
            "loss": torch.empty((), dtype=torch.float32, device=logits.device),
            "grad": torch.empty_like(logits2d) if training else None}
    layer = slot.choose(training, args)
    if layer is None:
        return reference()
    if training:
        loss = _CrossEntropyFn.apply(logits2d, layer, args)
    else:
        layer.forward(args, "inference")
        loss = args["loss"]
    if num_items_in_batch is not None:
        loss = loss / (num_items_in_batch.to(loss.device) if torch.is_tensor(num_items_in_batch) else num_items_in_batch)
    return loss


# ---- ForCausalLMLoss/1 (the loss fused with lm_head) --------------------------------------------------------

class _FusedLinearCEFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, layer, args):
        layer.forward(args, "training")  # computes the gradients too (the logits are never kept)
        ctx.save_for_backward(args["dhidden"], args["dweight"] if args["dweight"] is not None else hidden.new_empty(0))
        ctx.layer, ctx.has_dweight, ctx.shape = layer, args["dweight"] is not None, hidden.shape
        return args["loss"]

    @staticmethod
    def backward(ctx, dloss):
        dhidden, dweight = ctx.saved_tensors
        dweight = dweight if ctx.has_dweight else None
        ctx.layer.backward({"dloss": dloss.reshape(1).float().contiguous(), "dhidden": dhidden, "dweight": dweight})
        return dhidden.view(ctx.shape), dweight, None, None


def _causal_lm_forward(model, slot, original, *args, labels=None, logits_to_keep=0, **kwargs):
    """*ForCausalLM.forward with the loss fused with lm_head where its kernel takes the call: a training
    call with labels returns the loss and no logits (the logits never exist), as Liger's."""
    if args:  # positional arguments by their names in the model's forward
        names = [p for p in inspect.signature(original).parameters][:len(args)]
        kwargs.update(zip(names, args))
        args = ()
    training = slot.kernel(True) is not None and torch.is_grad_enabled()
    if labels is None or not training:
        if labels is not None:
            slot.reference_calls += 1
        return original(*args, labels=labels, logits_to_keep=logits_to_keep, **kwargs)
    lm_head = model.get_output_embeddings()
    num_items_in_batch = kwargs.pop("num_items_in_batch", None)
    ignore_index = kwargs.pop("ignore_index", -100)
    shift_labels = kwargs.pop("shift_labels", None)
    outputs = model.model(**kwargs)
    hidden = outputs.last_hidden_state
    weight = lm_head.weight
    if not _needs_grad(hidden, weight):
        slot.refuse("neither the hidden states nor lm_head's weight need gradients")
        return _finish_reference(model, outputs, labels, logits_to_keep, num_items_in_batch, ignore_index, shift_labels)
    if getattr(lm_head, "bias", None) is not None or hidden.dtype != weight.dtype:
        slot.refuse("lm_head has a bias, or its weight's dtype is not the hidden states'")
        return _finish_reference(model, outputs, labels, logits_to_keep, num_items_in_batch, ignore_index, shift_labels)
    hidden2d = _contig(hidden).view(-1, hidden.shape[-1])
    fargs = {"hidden": hidden2d, "weight": weight,
             "targets": _shifted_targets(labels, ignore_index, shift_labels, hidden.device),
             "ignore_index": int(ignore_index), "reduction": "mean" if num_items_in_batch is None else "sum",
             "loss": torch.empty((), dtype=torch.float32, device=hidden.device),
             "dhidden": torch.empty_like(hidden2d),
             "dweight": torch.empty_like(weight) if weight.requires_grad else None}
    softcap = getattr(model.config, "final_logit_softcapping", None)  # Gemma 2 / 3: cap * tanh(logits / cap)
    if softcap:
        fargs["softcap"] = float(softcap)
    layer = slot.choose(True, fargs)
    if layer is None:
        return _finish_reference(model, outputs, labels, logits_to_keep, num_items_in_batch, ignore_index, shift_labels)
    loss = _FusedLinearCEFn.apply(hidden2d, weight, layer, fargs)
    if num_items_in_batch is not None:
        loss = loss / (num_items_in_batch.to(loss.device) if torch.is_tensor(num_items_in_batch) else num_items_in_batch)
    from transformers.modeling_outputs import CausalLMOutputWithPast
    return CausalLMOutputWithPast(loss=loss, logits=None, past_key_values=outputs.past_key_values,
                                  hidden_states=outputs.hidden_states, attentions=outputs.attentions)


def _finish_reference(model, outputs, labels, logits_to_keep, num_items_in_batch, ignore_index, shift_labels):
    """The rest of *ForCausalLM.forward as Transformers runs it, after the body has run once."""
    from transformers.modeling_outputs import CausalLMOutputWithPast
    hidden = outputs.last_hidden_state
    keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
    logits = model.get_output_embeddings()(hidden[:, keep, :])
    softcap = getattr(model.config, "final_logit_softcapping", None)
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    loss = model.loss_function(logits=logits, labels=labels, vocab_size=model.config.vocab_size,
                               num_items_in_batch=num_items_in_batch, ignore_index=ignore_index,
                               shift_labels=shift_labels)
    return CausalLMOutputWithPast(loss=loss, logits=logits, past_key_values=outputs.past_key_values,
                                  hidden_states=outputs.hidden_states, attentions=outputs.attentions)


# ---- finding the layers -------------------------------------------------------------------------------------

def _modeling_module(module):
    return sys.modules.get(type(module).__module__)


def _is_rms_norm(m):
    return (type(m).__name__.endswith("RMSNorm") and isinstance(getattr(m, "weight", None), torch.nn.Parameter)
            and hasattr(m, "variance_epsilon") and m.weight.dim() == 1
            and getattr(_modeling_module(m), "__name__", "").startswith("transformers.models."))


def _is_gated_mlp(m):
    return all(isinstance(getattr(m, n, None), torch.nn.Linear) for n in ("gate_proj", "up_proj", "down_proj")) \
        and hasattr(m, "act_fn")


def _glu_activation(m):
    """The GLU/1 activation of a gated MLP, or None when its act_fn is not one the contract has."""
    config = getattr(m, "config", None)
    name = getattr(config, "hidden_act", None) or getattr(config, "hidden_activation", None)
    if name not in _GLU_ACTIVATIONS:
        return None
    return {"swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh", "gelu_fast": "gelu_tanh"}.get(name, name)


def _is_rope_attention(m):
    modeling = _modeling_module(m)
    return type(m).__name__.endswith("Attention") and callable(getattr(modeling, "apply_rotary_pos_emb", None)) \
        and getattr(modeling, "__name__", "").startswith("transformers.models.")


def _set_forward(state, module, forward):
    had = "forward" in module.__dict__
    previous = module.__dict__.get("forward")
    module.forward = forward

    def undo():
        if had:
            module.forward = previous
        else:
            del module.forward
    state.restore.append(undo)


# ---- the config ---------------------------------------------------------------------------------------------

def _kernel_config(kernel_config, use_liger_kernel, liger_kernel_config, allow_all_kernels):
    """(kcpp.KernelConfig, hub options) for kernelize's arguments."""
    if kernel_config is not None:
        if isinstance(kernel_config, _core.KernelConfig):
            return kernel_config, {"allow_all_kernels": allow_all_kernels}
        mapping, local = kernel_config, False
        if hasattr(kernel_config, "kernel_mapping"):  # Transformers' KernelConfig
            mapping, local = kernel_config.kernel_mapping, bool(getattr(kernel_config, "use_local_kernel", False))
        if not isinstance(mapping, dict):
            raise TypeError(f"kernel_config: expected a dict kernel_mapping, a transformers.KernelConfig or a "
                            f"kcpp.KernelConfig, got {type(kernel_config).__name__}")
        return _core.KernelConfig(json.dumps(mapping), local), {"allow_all_kernels": allow_all_kernels}
    if not use_liger_kernel:
        return None, {}
    liger = kcpp.local_packages().get("liger")
    if liger is None:
        raise kcpp.KcppError("use_liger_kernel: this kcpp has no built liger package (kcpp.local_packages() is empty); "
                             "pass kernel_config, or set KCPP_PACKAGES_DIR to a build's kernels/ folder")
    config = _core.liger_kernel_config(json.dumps(liger_kernel_config or {}), liger, True)
    # This build's own packages (unsigned, as every local build's): loaded as `kcpp train` loads them.
    return config, {"allow_all_kernels": True}


def _load_slot(slot, config, hub, loaded, modes, device):
    """Gives `slot` the kernel the config names for each mode, or keeps the reference with the reason."""
    backend = device.type
    cc = torch.cuda.get_device_capability(device) if backend == "cuda" else (0, 0)
    reasons = []
    for mode in modes:
        ref, why = config.select(slot.layer_name, mode, backend, cc[0], cc[1])
        if ref is None:
            reasons.append(f"{mode}: no mapping for {slot.layer_name} on {backend}")
            continue
        if ref == "":
            reasons.append(f"{mode}: disabled by the config ({why})")
            continue
        if ref not in loaded:
            loaded[ref] = hub.load(ref)  # the C++ hub: resolution, hashes, signatures, trust, lock file
        package = loaded[ref]
        layer = package.layer(package.default_layer) if package.default_layer else package.layer_by_contract(slot.contract)
        if layer.contract != slot.contract:
            raise kcpp.KcppError(f"{slot.layer_name}: {ref} names {layer.name}, which implements {layer.contract}; "
                                 f"this slot takes {slot.contract}")
        dl_device = {"cpu": 1, "cuda": 2}.get(backend, -1)
        if dl_device < 0 or not layer.runs_on(dl_device):
            reasons.append(f"{mode}: {package.name}:{layer.name} does not run on {backend}")
            continue
        if mode == "training" and not layer.has_backward:
            reasons.append(f"training: {package.name}:{layer.name} has no backward")
            continue
        slot.kernels[mode] = layer
        reasons.append(f"{mode}: {package.name} {package.version}: {layer.name} ({layer.contract})")
    slot.reason = "; ".join(reasons)


# ---- the API ----------------------------------------------------------------------------------------------

def kernelize(model, mode=None, kernel_config=None, use_liger_kernel=True, liger_kernel_config=None, device=None,
              allow_all_kernels=False, hub=None):
    """Swaps the layers of a Transformers causal-LM `model` (Llama, Mistral, Qwen2, Qwen3) for kernels,
    in place; returns the model.

    mode: "training", "inference", or None (both: each call picks by whether autograd needs it).
    kernel_config: Transformers' kernel_mapping (a dict, a transformers.KernelConfig, or a
      kcpp.KernelConfig); None: `use_liger_kernel` with `liger_kernel_config` (Liger's switches: rope,
      rms_norm, swiglu, cross_entropy, fused_linear_cross_entropy) over this build's liger package.
    device: where the model runs (default: its parameters' device).
    allow_all_kernels: load unsigned packages and packages of untrusted publishers named by
      kernel_config (this build's own packages always load).
    hub: a kcpp.Hub to load through (default: one from the environment with allow_all_kernels)."""
    if getattr(model, "_kcpp_state", None) is not None:
        unkernelize(model)
    if mode not in (None, "training", "inference"):
        raise ValueError(f"mode must be 'training', 'inference' or None, is {mode!r}")
    modes = _MODES if mode is None else (mode,)
    if device is None:
        param = next(model.parameters(), None)
        device = param.device if param is not None else torch.device("cpu")
    device = torch.device(device)
    config, hub_options = _kernel_config(kernel_config, use_liger_kernel, liger_kernel_config, allow_all_kernels)

    state = _State()
    for name, contract in _CONTRACTS.items():
        state.slots[name] = _Slot(name, contract)
    if config is not None:
        hub = hub if hub is not None else kcpp.Hub(**hub_options)
        loaded = {}
        for slot in state.slots.values():
            _load_slot(slot, config, hub, loaded, modes, device)
    else:
        for slot in state.slots.values():
            slot.reason = "no kernel config (use_liger_kernel=False)"

    try:
        _swap(model, state)
    except BaseException:
        for undo in reversed(state.restore):
            undo()
        raise
    object.__setattr__(model, "_kcpp_state", state)
    return model


def _swap(model, state):
    slots = state.slots
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type not in _MODEL_TYPES:
        for slot in slots.values():
            slot.kernels.clear()
            slot.reason = (f"model type {model_type!r}: kcpp.torch kernelizes {', '.join(_MODEL_TYPES)} "
                           "(their modeling code is what its swaps were checked against)")
        return
    patched_modeling = set()
    for module in model.modules():
        if _is_rms_norm(module):
            slots["RMSNorm"].modules += 1
            if slots["RMSNorm"].kernels:
                original = type(module).forward.__get__(module)
                _set_forward(state, module, functools.partial(_rms_norm_forward, module, slots["RMSNorm"], original))
        elif _is_gated_mlp(module):
            slots["MLP"].modules += 1
            if slots["MLP"].kernels:
                original = type(module).forward.__get__(module)
                _set_forward(state, module, functools.partial(_mlp_forward, module, slots["MLP"], original,
                                                              _glu_activation(module)))
        elif _is_rope_attention(module):
            slots["rotary_pos_emb"].modules += 1
            if slots["rotary_pos_emb"].kernels:
                modeling = _modeling_module(module)
                if modeling.__name__ not in patched_modeling:
                    patched_modeling.add(modeling.__name__)
                    # Undone by unkernelize, or when the model is collected without it.
                    state.restore.append(weakref.finalize(model, _patch_rope(modeling)))
                original = type(module).forward.__get__(module)
                _set_forward(state, module, functools.partial(_attention_forward, slots["rotary_pos_emb"], original))
    is_causal_lm = hasattr(model, "lm_head") and hasattr(model, "model") and hasattr(type(model), "loss_function")
    for name in ("CrossEntropyLoss", "ForCausalLMLoss"):
        slots[name].modules = 1 if is_causal_lm else 0
    if not is_causal_lm:
        return
    ce = slots["CrossEntropyLoss"]
    if ce.kernels:
        had = "_loss_function" in model.__dict__
        previous = model.__dict__.get("_loss_function")
        model.loss_function = functools.partial(_causal_lm_loss, ce, model.loss_function)

        def undo_loss():
            if had:
                model._loss_function = previous
            else:
                del model._loss_function
        state.restore.append(undo_loss)
    flce = slots["ForCausalLMLoss"]
    if flce.kernels:
        original = type(model).forward.__get__(model)
        _set_forward(state, model, functools.partial(_causal_lm_forward, model, flce, original))


def unkernelize(model):
    """Restores every forward, function and loss kernelize swapped; the model is as it was."""
    state = getattr(model, "_kcpp_state", None)
    if state is None:
        return model
    for undo in reversed(state.restore):
        undo()
    object.__delattr__(model, "_kcpp_state")
    return model


def report(model):
    """What each layer name got and its calls since kernelize (a Report; str() prints it)."""
    state = getattr(model, "_kcpp_state", None)
    if state is None:
        return Report([])
    entries = []
    for s in state.slots.values():
        kernels = sorted({f"{k.package_name} {k.package_version}: {k.name} ({k.contract})" for k in s.kernels.values()})
        entries.append({"layer": s.layer_name, "contract": s.contract, "modules": s.modules,
                        "kernel": ", ".join(kernels), "reason": s.reason, "kernel_calls": s.kernel_calls,
                        "reference_calls": s.reference_calls, "fallbacks": s.fallbacks,
                        "last_refusal": s.last_refusal})
    return Report(entries)
