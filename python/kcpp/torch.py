"""kernelize Hugging Face Transformers models with kernels.cpp packages (PyTorch, Transformers 5.x).

    import kcpp.torch
    model = transformers.AutoModelForCausalLM.from_pretrained(...)
    kcpp.torch.kernelize(model)                      # this build's liger + flash_attn, Liger's default switches
    loss = model(input_ids, labels=labels).loss; loss.backward()
    print(kcpp.torch.report(model))                  # which kernel each layer got, calls, fallbacks and why
    kcpp.torch.unkernelize(model)                    # the model as it was
    torch.compile(model, fullgraph=True)             # the kernels are torch.library ops: no graph break

Layers are found by what they are, in the model's own modeling module (Llama, Mistral, Qwen2, Qwen3,
Phi-3, Gemma 1 / 2 / 3 text, Mixtral, Qwen2-MoE, Qwen3-MoE):
  RMSNorm           every `*RMSNorm` of the family: Llama's casting, or Gemma's (1 + w) in f32
                    (offset 1, casting "gemma"); Qwen3's / Gemma 3's q / k norms included     RMSNorm/1
  MLP               gated MLPs (`gate_proj`, `up_proj`, `down_proj`, `act_fn`): the part between the
                    projections, act(gate) * up; Phi-3's (`gate_up_proj`, `down_proj`,
                    `activation_fn`): the same on the projection's halves, read in place      GLU/1
  rotary_pos_emb    the modeling module's `apply_rotary_pos_emb`, inside the model's attention
                    modules                                                                       rotary_pos_emb/1
  Attention         the attention function, registered in Transformers' AttentionInterface as
                    "kcpp" (kernelize selects it; `attn_implementation="kcpp"` in
                    from_pretrained too): causal / sliding-window masks, Gemma 2's logit
                    soft-capping; packed sequences (cu_seq_lens_q / _k, as FlashAttention's
                    varlen API) through its varlen call; a padding or custom mask or dropout
                    runs Transformers' own function                                             Attention/1
  CrossEntropyLoss  the causal-LM loss of the logits (the model's `loss_function`)                 CrossEntropyLoss/1
  ForCausalLMLoss   the causal-LM loss fused with `lm_head` (the logits never exist): training
                    calls with labels return no logits, as Liger's                                  ForCausalLMLoss/1

and in a Deformable DETR (DeformableDetrModel, DeformableDetrForObjectDetection; by default this build's
deformable_attention package):
  MultiScaleDeformableAttention   the forward of Transformers' MultiScaleDeformableAttention module (the
                    one it marks use_kernel_forward_from_hub("MultiScaleDeformableAttention")): the
                    bilinear multi-level sampling of the encoder's and decoder's deformable
                    attention, forward and backward                              MultiScaleDeformableAttention/1

Every kernel is a torch.library custom op (`torch.ops.kcpp.*`: forward and backward, each with a fake
implementation, the forward's gradient registered with register_autograd), so torch.compile (also
fullgraph=True, and mode="reduce-overhead": the CUDA graph bit is set while a stream is capturing)
traces through kernelized layers.  Outside torch.compile the same implementations are called
directly (a torch.autograd.Function where autograd needs the call), which keeps a layer call's host
time to a few microseconds.  What forward saves for backward is what the layer's contract
(docs/contracts/) names.

Fallbacks: a call the contract cannot express (mixed dtypes, a weight without a gradient slot, an
attention mask that is not causal / sliding-window, ...) or that the kernel's supports() refuses
runs the original forward, counted, with the reason kept for report().  supports() is asked once
per kind of call: the dtypes, devices and feature sizes (hidden, head, vocabulary), with the token
dimensions (batch, sequence) standing for any size; the answer is kept.  So a compiled graph does
not specialize on sequence lengths, and a kernel's supports() must decide from those (it is given
tensors whose data pointers point at no memory).  Under torch.compile the choice is made when the
graph is traced, and a fallback is counted then, once; kernel calls are counted as they run
(not on CUDA graph replays).  Outside torch.compile a refusal the forward itself returns (one the
sizes cause) also falls back.  A contract violation (tensors of one call on different devices, a
dtype the contract does not take) is a kcpp.InvalidArgument / ValueError naming the layer, the
argument and the reason.  Packages come through the C++ hub (kcpp.Hub): references, versions,
variants, hashes, signatures and trust are checked there.

Sharded training: under FSDP2 (fully_shard) and DeepSpeed ZeRO-3 a module's parameters are whole inside
its forward, where its kernels run.  The fused loss reads lm_head's weight outside lm_head's forward,
so where lm_head holds a shard it runs as lm_head's forward, inside the hooks that gather the weight
(eager and under torch.compile).  A DTensor argument (tensor or sequence parallelism) is refused, with
that reason: the reference runs it through DTensor's own operators.

Mode: a call that autograd will differentiate runs the kernel in training mode (it saves what backward
needs); any other call (torch.no_grad(), model.eval() generation) in inference mode.  kernelize(mode=)
chooses the kernels the config maps for that mode; by default both modes' kernels are loaded, so
model.train() / model.eval() need no re-kernelize.
"""
import contextvars
import ctypes
import functools
import inspect
import itertools
import json
import math
import operator
import os
import sys
import warnings
import weakref
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

try:
    from torch.distributed.tensor import DTensor as _DTensor
except ImportError:  # a torch without torch.distributed: no DTensor exists
    _DTensor = ()
try:
    from torch.distributed.fsdp import FSDPModule as _FSDPModule
except ImportError:  # a torch without FSDP2
    _FSDPModule = ()

import kcpp
from . import _core

if _core is None:
    raise ImportError("kcpp.torch needs the extension kcpp._core: pip install . from the repository, or "
                      "scripts/python-env.sh then scripts/build.sh (PYTHONPATH=build/release/python)")

__all__ = ["kernelize", "unkernelize", "report", "Report", "ATTENTION_NAME"]

_MODES = ("training", "inference")
_INFERENCE, _TRAINING, _GRAPH = kcpp.MODE_INFERENCE, kcpp.MODE_TRAINING, kcpp.MODE_GRAPH

# The name of the attention function in Transformers' AttentionInterface (attn_implementation=).  Not
# "kcpp-flash": Transformers takes every name containing "flash" for a flash-attn package or a hub
# kernel (utils.generic.is_flash_attention_requested) and tries to import one.
ATTENTION_NAME = "kcpp"

# The contract each layer name's kernels implement: the causal LMs' layers, and Deformable DETR's one.
_CONTRACTS = {"RMSNorm": "RMSNorm/1", "MLP": "GLU/1", "rotary_pos_emb": "rotary_pos_emb/1", "Attention": "Attention/1",
              "CrossEntropyLoss": "CrossEntropyLoss/1", "ForCausalLMLoss": "ForCausalLMLoss/1"}
_DEFORMABLE_CONTRACTS = {"MultiScaleDeformableAttention": "MultiScaleDeformableAttention/1"}

# The model types whose modeling code kcpp.torch's swaps were checked against (RMSNorm's casting,
# apply_rotary_pos_emb's rotate-half, the attention call's arguments, the *ForCausalLM forward that the
# fused loss re-implements: body, lm_head, optional final logit soft-capping, loss_function).  Other
# models keep their layers, saying so.
_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma", "gemma2", "gemma3_text", "mixtral", "qwen2_moe",
                "qwen3_moe")
# The model types whose MultiScaleDeformableAttention module was checked (its forward's arguments, its
# grid_sample maths): their only kernelized layer.  Other detection models copy the module (Grounding DINO,
# OmDet-Turbo, RT-DETR, ...) but are not checked here.
_DEFORMABLE_MODEL_TYPES = ("deformable_detr",)

# Transformers' hidden_act names the GLU/1 contract takes.
_GLU_ACTIVATIONS = {"silu", "swish", "gelu", "gelu_tanh", "gelu_pytorch_tanh", "gelu_new", "gelu_fast", "quick_gelu"}

# The RMSNorm classes computing (x / rms(x)) * (1 + w) in f32 (Transformers' Gemma 1 / 2 / 3 text).
_GEMMA_NORMS = ("GemmaRMSNorm", "Gemma2RMSNorm", "Gemma3RMSNorm")


# ---- slots and their statistics -----------------------------------------------------------------------

@dataclass(eq=False)
class _Slot:
    layer_name: str
    contract: str
    kernels: dict = field(default_factory=dict)  # mode -> kcpp.Layer (absent: the reference in that mode)
    ids: dict = field(default_factory=dict)      # mode -> the kernel's id in _LAYERS (the ops' `layer`)
    reason: str = "not kernelized"
    modules: int = 0
    kernel_calls: int = 0
    reference_calls: int = 0
    fallbacks: int = 0
    last_refusal: str = ""
    decisions: dict = field(default_factory=dict)  # (training, op, description) -> (id or -1, refusal)
    loader: object = None                           # loads the kernels at the first call (the default attention)
    sid: int = -1                                   # the slot's id in _SLOTS

    def __post_init__(self):
        self.sid = next(_NEXT_ID)
        _SLOTS[self.sid] = self

    def add_kernel(self, mode, layer):
        self.kernels[mode] = layer
        self.ids[mode] = _register_layer(layer, self)

    def __deepcopy__(self, memo):
        raise TypeError(_NO_COPY)

    def __reduce__(self):
        raise TypeError(_NO_COPY)

    def refuse(self, why):
        self.fallbacks += 1
        self.reference_calls += 1
        self.last_refusal = why

    def release(self):
        for i in self.ids.values():
            _LAYERS.pop(i, None)
        self.ids.clear()
        self.kernels.clear()
        self.decisions.clear()


_NO_COPY = ("kcpp.torch: a kernelized model cannot be deep-copied or pickled (its layers hold loaded kernels): copy it "
            "before kernelize, or kcpp.torch.unkernelize(model), copy, and kernelize each copy; to save it, save its "
            "state_dict()")

# id -> (kcpp.Layer, _Slot): the kernels the ops call (an op's `layer` argument is such an id, an int a
# traced graph can hold).  unkernelize removes a model's; a graph compiled before names a missing id.
_LAYERS = {}
_NEXT_ID = itertools.count()
# id -> _Slot: what _decide / _refuse count into (torch.compile passes them constants, not objects).
_SLOTS = weakref.WeakValueDictionary()


def _register_layer(layer, slot):
    i = next(_NEXT_ID)
    _LAYERS[i] = (layer, slot)
    return i


def _kernel(layer_id):
    try:
        return _LAYERS[layer_id]
    except KeyError:
        raise RuntimeError(f"kcpp.torch: kernel {layer_id} is gone (its model was unkernelized); a graph compiled "
                           "before unkernelize must be compiled again") from None


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

    def __deepcopy__(self, memo):
        raise TypeError(_NO_COPY)

    def __reduce__(self):
        raise TypeError(_NO_COPY)


def _holds_a_shard(module):
    """Whether `module`'s parameters are sharded outside its own forward: FSDP2 (fully_shard made it an
    FSDPModule: DTensor parameters, gathered by hooks around its forward) or DeepSpeed ZeRO-3
    (partitioned parameters, gathered the same way).  A module whose parameters are DTensors of tensor
    parallelism (parallelize_module) holds them so in its forward too: not a shard in this sense."""
    if isinstance(module, _FSDPModule):
        return True
    return any(hasattr(p, "ds_id") for p in module.parameters(recurse=False))


def _as_forward_of(module, fn, *args):
    """fn(*args) run as `module`'s forward: the hooks a framework keeps around it run too, so the
    parameters fn reads from `module` are whole inside fn and their gradients reach the framework's
    post-backward hooks (FSDP2 reduce-scatters them; ZeRO-3 partitions them again)."""
    attribute = _forward_attribute(module)  # inside accelerate's hook: it moves args and loads the weights
    had = attribute in module.__dict__
    previous = module.__dict__.get(attribute)
    setattr(module, attribute, fn)
    try:
        return module(*args)
    finally:
        if had:
            setattr(module, attribute, previous)
        else:
            delattr(module, attribute)


# Why the reference runs a call instead of the kernel, where more than one place refuses for the same reason
# (report() shows it as the last refusal).
_WHY_EMPTY = "an empty tensor: the reference handles it"


def _needs_grad(*tensors):
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _contig(t):
    return t if t.is_contiguous() else t.contiguous()


def _last_contig(t):
    return t if t.stride(-1) == 1 else t.contiguous()


# ---- probes: a call's description for supports() ----------------------------------------------------------
#
# A kernel's choice is made from a description of the call, not from its tensors: (shape, dtype,
# device) of each tensor and every other argument as it is, one cached answer per description.
# While torch.compile traces, the description is made of constants (its token dimensions written as
# 1 when they are 1, else as _ANY, so that the graph need not specialize on sequence lengths), and
# the choice is made then (_decide is `assume_constant_result`).  supports() sees tensors of those
# shapes whose data pointers point at no memory (_Probe), built by the op's own argument builder over
# meta tensors.

_ANY = 2  # the size a token dimension stands at in a description (the kernel may not depend on it)

# DLPack's (type code, bits) of the dtypes a probe can describe (dlpack.h: kDLInt 0, kDLUInt 1, kDLFloat 2,
# kDLBfloat 4, kDLBool 6).
_DL_DTYPE = {torch.float32: (2, 32), torch.float16: (2, 16), torch.bfloat16: (4, 16), torch.float64: (2, 64),
             torch.int64: (0, 64), torch.int32: (0, 32), torch.int16: (0, 16), torch.int8: (0, 8), torch.uint8: (1, 8),
             torch.bool: (6, 8)}
_DTYPES = {str(d): d for d in _DL_DTYPE}

# The dtype of a DTensor's description: a tensor distributed over a device mesh (tensor or sequence
# parallelism, a parameter FSDP2 keeps sharded) is refused, and the reference runs it through DTensor's
# own operators.  A kernel takes the whole tensor, which a DTensor's local part need not be.
_DTENSOR = "DTensor"
_WHY_DTENSOR = ("is a DTensor (distributed over a device mesh): kcpp kernels take whole, local tensors; a "
                "module sharded by FSDP2 (fully_shard) has whole parameters inside its forward")


def _desc(t, traced, features=(-1,)):
    """A tensor's description: (shape, dtype, device); while torch.compile traces (`traced`), the dims in
    `features` at their size and the others 1 or _ANY.  A DTensor's: ((), _DTENSOR, its device)."""
    if isinstance(t, _DTensor):
        return (), _DTENSOR, str(t.device)
    if not traced:
        return t.shape, t.dtype, t.device
    n = t.dim()
    keep = {d % n for d in features} if n else set()
    shape = tuple(operator.index(s) if d in keep else (1 if s == 1 else _ANY) for d, s in enumerate(t.shape))
    return shape, str(t.dtype), str(t.device)


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int32), ("dtype", _DLDataType),
                ("shape", ctypes.POINTER(ctypes.c_int64)), ("strides", ctypes.POINTER(ctypes.c_int64)),
                ("byte_offset", ctypes.c_uint64)]


class _DLManagedTensor(ctypes.Structure):  # DLPack's (unversioned) DLManagedTensor; no deleter
    _fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", ctypes.c_void_p)]


_capsule_new = ctypes.pythonapi.PyCapsule_New
_capsule_new.restype = ctypes.py_object
_capsule_new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
_DLTENSOR_NAME = b"dltensor"


class _Probe:
    """A tensor's shape, strides, dtype and device as DLPack, over no memory: what supports() decides from."""

    def __init__(self, meta, device, address):
        n = meta.dim()
        self._shape = (ctypes.c_int64 * max(n, 1))(*meta.shape)
        self._strides = (ctypes.c_int64 * max(n, 1))(*meta.stride())
        code, bits = _DL_DTYPE[meta.dtype]
        dev = _DLDevice(1, 0) if device.type == "cpu" else _DLDevice(2, device.index or 0)
        tensor = _DLTensor(address, dev, n, _DLDataType(code, bits, 1), self._shape, self._strides, 0)
        self._mt = _DLManagedTensor(tensor, None, None)

    def __dlpack__(self, stream=None, max_version=None, dl_device=None, copy=None):
        if max_version is not None:
            raise TypeError("a probe exports an unversioned DLPack capsule")  # the importer asks again without
        return _capsule_new(ctypes.addressof(self._mt), _DLTENSOR_NAME, None)

    def __dlpack_device__(self):
        return (self._mt.dl_tensor.device.device_type, self._mt.dl_tensor.device.device_id)


def _ask(slot, training, op, desc, where):
    """(id of the kernel to call, "") or (-1, why the reference runs; "" when no kernel is mapped)."""
    mode = "training" if training else "inference"
    if slot.loader is not None:
        slot.loader(slot)
    if mode not in slot.ids:
        return -1, ""
    layer = slot.kernels[mode]
    inputs, device, first = [], None, None
    for name, d in zip(op.arg_names, desc):
        if isinstance(d, tuple):  # a tensor's (shape, dtype, device)
            shape, dtype, dev = d
            if dtype == _DTENSOR:
                return -1, f"argument '{name}' {_WHY_DTENSOR}"
            dtype = dtype if isinstance(dtype, torch.dtype) else _DTYPES.get(dtype)
            if dtype not in _DL_DTYPE:
                return -1, f"argument '{name}' is {d[1]}, which no kernel takes"
            if device is None:
                device, first = torch.device(dev), name
            elif torch.device(dev) != device:
                raise kcpp.InvalidArgument(
                    f"kcpp.torch: {where} ({slot.layer_name}, {layer.package_name}:{layer.name}): argument '{name}' "
                    f"is on {dev} but '{first}' is on {device}: the tensors of one call must be on one device")
            inputs.append(torch.empty(shape, dtype=dtype, device="meta"))
        else:
            inputs.append(d)
    if device.type not in ("cpu", "cuda"):
        return -1, f"tensors on {device}: kcpp kernels run on cpu / cuda"
    if not layer.runs_on(1 if device.type == "cpu" else 2):
        return -1, f"{layer.package_name}:{layer.name} does not run on {device.type}"
    args = op.build(*inputs, slot.ids[mode], training)
    probes, k = {}, 0
    for name, v in args.items():
        if isinstance(v, torch.Tensor):
            k += 1
            v = _Probe(v, device, k << 36)  # distinct, aligned, never dereferenced
        probes[name] = v
    try:
        ok, why = layer.supports(probes, mode)
    except kcpp.KcppError as e:  # the contract is broken: the message names the argument
        raise type(e)(f"kcpp.torch: {where} ({slot.layer_name}): {e}") from None
    return (slot.ids[mode], "") if ok else (-1, why)


@torch.compiler.assume_constant_result
def _decide(sid, training, op_name, desc, where):
    """The id of the kernel for this call, or -1 (the reference runs; a refusal is counted, with its reason).
    Under torch.compile it runs once, while the graph is traced: its answer is a constant of the graph."""
    slot = _SLOTS[sid]
    key = (training, op_name, desc)
    d = slot.decisions.get(key)
    if d is None:
        if len(slot.decisions) >= 4096:  # eager descriptions have exact shapes: a bound on the lengths kept
            slot.decisions.clear()
        d = slot.decisions[key] = _ask(slot, training, _OPS[op_name], desc, where)
    if d[0] < 0:
        if d[1]:
            slot.refuse(d[1])
        else:
            slot.reference_calls += 1
    return d[0]


@torch.compiler.assume_constant_result
def _refuse(sid, why):
    """A call the bridge cannot express: the reference runs, counted (once per trace under torch.compile)."""
    _SLOTS[sid].refuse(why)
    return 0


@torch.compiler.assume_constant_result
def _reference_call(sid):
    """A call with no kernel for its mode: the reference runs, counted."""
    _SLOTS[sid].reference_calls += 1
    return 0


# ---- the ops ------------------------------------------------------------------------------------------
#
# Each op allocates its outputs (the contract's shapes) and calls one entry point of a kernel, named
# by its id.  `build(*inputs)` makes the entry point's argument dict; the same function serves the
# real call, the fake implementation (torch.compile's tracing) and the probes (meta tensors).

_LIB = torch.library.Library("kcpp", "FRAGMENT")
_OPS = {}


class _Op:
    """One entry point as a torch.library op.  `outputs(args, light)`: the op's outputs from the argument
    dict (light: None for those the call did not make, outside the dispatcher); `result(outputs)`: what
    the layer's caller takes."""

    def __init__(self, name, schema, build, outputs, result=None, backward_entry=False, setup=None, backward=None):
        self.name, self.build, self.outputs, self.backward_entry = name, build, outputs, backward_entry
        self.result = result or (lambda o: o[0])
        self.setup, self.formula = setup, backward
        _LIB.define(f"{name}{schema}")
        self.arg_names = [a.split()[-1] for a in schema[1:schema.index(")")].split(", ")]
        _LIB.impl(name, self.impl, "CompositeExplicitAutograd")
        torch.library.register_fake(f"kcpp::{name}", self.fake, lib=_LIB)
        if setup is not None:
            torch.library.register_autograd(f"kcpp::{name}", self.autograd_backward, setup_context=setup, lib=_LIB)
        self.overload = getattr(torch.ops.kcpp, name).default
        _OPS[name] = self

    def impl(self, *inputs):
        return self.outputs(self.run(inputs), False)

    def run(self, inputs):
        args = self.build(*inputs)
        layer, slot = _kernel(inputs[-1] if self.backward_entry else inputs[-2])
        if self.backward_entry:
            layer.backward(args)
        else:
            training = inputs[-1]
            mode = _TRAINING if training else _INFERENCE
            if inputs[0].is_cuda and torch.cuda.is_current_stream_capturing():
                mode |= _GRAPH
            layer.forward(args, mode)
            slot.kernel_calls += 1
        return args

    def fake(self, *inputs):
        return self.outputs(self.build(*inputs), False)

    def autograd_backward(self, ctx, *grads):
        return self.formula(ctx, False, *grads)


class _EagerFn(torch.autograd.Function):
    """An op outside torch.compile where autograd needs it: its implementation and its registered
    gradient, without the dispatcher's per-call cost."""

    @staticmethod
    def forward(ctx, op, *inputs):
        out = op.impl(*inputs)
        op.setup(ctx, inputs, out)
        ctx.kcpp_op = op
        return out

    @staticmethod
    @once_differentiable  # the kernels' backward is not itself differentiable: a second order raises
    def backward(ctx, *grads):
        return (None, *ctx.kcpp_op.formula(ctx, True, *grads))


def _invoke(op, training, traced, *inputs):
    """The op's result: the torch.library op while torch.compile traces, else its implementation."""
    if traced:
        return op.result(op.overload(*inputs))
    if training:
        return op.result(_EagerFn.apply(op, *inputs))
    return op.result(op.outputs(op.run(inputs), True))


def _kernel_or_reference(slot, training, traced, op_name, desc, where, op, inputs, reference):
    """The call through the kernel the slot chose (`op` over `inputs`, then the kernel id and whether
    it trains), or `reference()` where none is chosen or the package refuses the call's sizes
    (outside torch.compile; the refusal counted with its reason)."""
    lid = _decide(slot.sid, training, op_name, desc, where)
    if lid < 0:
        return reference()
    try:
        return _invoke(op, training, traced, *inputs, lid, training)
    except kcpp.Unsupported as e:
        _refuse(slot.sid, str(e))
        return reference()


def _needs(ctx, eager, i):
    return ctx.needs_input_grad[i + 1 if eager else i]


def _call(op, eager, *inputs):
    return op.impl(*inputs) if eager else op.overload(*inputs)


def _f32(shape, device):
    return torch.empty(shape, dtype=torch.float32, device=device)


def _made(t, like, light):
    """An output the call made, or (an op returns tensors only) an empty one; None for a light call."""
    return t if t is not None else None if light else like.new_empty(0, dtype=torch.float32)


# RMSNorm/1
def _rms_norm_build(x, weight, eps, offset, casting, layer, training):
    rows = x.numel() // x.shape[-1]
    return {"x": x, "weight": weight, "eps": eps, "offset": offset, "casting": casting,
            "y": torch.empty_like(x), "rstd": _f32(rows, x.device) if training else None}


def _rms_norm_setup(ctx, inputs, output):
    x, weight, eps, offset, casting, layer, training = inputs
    ctx.save_for_backward(x, weight, output[1])
    ctx.kcpp = (eps, offset, casting, layer)
    ctx.mark_non_differentiable(output[1])
    ctx.set_materialize_grads(False)


def _rms_norm_backward(ctx, eager, dy, _drstd):
    x, weight, rstd = ctx.saved_tensors
    eps, offset, casting, layer = ctx.kcpp
    if dy is None:
        return (None,) * 7
    need_dw = _needs(ctx, eager, 1)
    dx, dw = _call(_RMS_NORM_BWD, eager, _contig(dy), x, weight, rstd, eps, offset, casting, need_dw, layer)
    return dx, (dw if need_dw else None), None, None, None, None, None


def _rms_norm_bwd_build(dy, x, weight, rstd, eps, offset, casting, dweight, layer):
    return {"dy": dy, "x": x, "weight": weight, "rstd": rstd, "eps": eps, "offset": offset, "casting": casting,
            "dx": torch.empty_like(x),
            "dweight": torch.empty_like(weight) if dweight else None}


_RMS_NORM = _Op("rms_norm", "(Tensor x, Tensor weight, float eps, float offset, str casting, int layer, bool training)"
                " -> (Tensor, Tensor)", _rms_norm_build,
                lambda a, light: (a["y"], _made(a["rstd"], a["x"], light)),
                setup=_rms_norm_setup, backward=_rms_norm_backward)
_RMS_NORM_BWD = _Op("rms_norm_backward", "(Tensor dy, Tensor x, Tensor weight, Tensor rstd, float eps, float offset, "
                    "str casting, bool dweight, int layer) -> (Tensor, Tensor)", _rms_norm_bwd_build,
                    lambda a, light: (a["dx"], _made(a["dweight"], a["x"], light)),
                    backward_entry=True)


# GLU/1
def _glu_setup(ctx, inputs, output):
    gate, up, activation, layer, training = inputs
    ctx.save_for_backward(gate, up)
    ctx.kcpp = (activation, layer)


def _glu_backward(ctx, eager, dout):
    gate, up = ctx.saved_tensors
    activation, layer = ctx.kcpp
    dgate, dup = _call(_GLU_BWD, eager, _contig(dout), gate, up, activation, layer)
    return dgate, dup, None, None, None


_GLU = _Op("glu", "(Tensor gate, Tensor up, str activation, int layer, bool training) -> Tensor",
           lambda gate, up, activation, layer, training: {
               "gate": gate, "up": up, "activation": activation,
               "out": torch.empty_like(gate)},
           lambda a, light: a["out"], result=lambda o: o, setup=_glu_setup, backward=_glu_backward)
_GLU_BWD = _Op("glu_backward", "(Tensor dout, Tensor gate, Tensor up, str activation, int layer) -> (Tensor, Tensor)",
               lambda dout, gate, up, activation, layer: {
                   "dout": dout, "gate": gate, "up": up, "activation": activation,
                   "dgate": torch.empty_like(gate), "dup": torch.empty_like(up)},
               lambda a, light: (a["dgate"], a["dup"]), backward_entry=True)


# GLU/1 over a packed [..., 2I] gate_up (Phi-3's MLP): the kernel reads the halves in place and writes
# the gradient into the halves of one [..., 2I] buffer, so neither direction copies.
class _Args(dict):
    """A call's arguments, with `made`: an output the caller takes that is no argument itself."""
    made = None


def _halves(t):
    i = t.shape[-1] // 2
    return t[..., :i], t[..., i:]


def _glu_packed_build(gate_up, activation, layer, training):
    gate, up = _halves(gate_up)
    return {"gate": gate, "up": up, "activation": activation,
            "out": gate_up.new_empty(gate_up.shape[:-1] + (gate_up.shape[-1] // 2,))}


def _glu_packed_bwd_build(dout, gate_up, activation, layer):
    gate, up = _halves(gate_up)
    dgu = torch.empty_like(gate_up)
    dgate, dup = _halves(dgu)
    a = _Args(dout=dout, gate=gate, up=up, activation=activation, dgate=dgate, dup=dup)
    a.made = dgu
    return a


def _glu_packed_setup(ctx, inputs, output):
    gate_up, activation, layer, training = inputs
    ctx.save_for_backward(gate_up)
    ctx.kcpp = (activation, layer)


def _glu_packed_backward(ctx, eager, dout):
    gate_up, = ctx.saved_tensors
    activation, layer = ctx.kcpp
    return _call(_GLU_PACKED_BWD, eager, _contig(dout), gate_up, activation, layer), None, None, None


_GLU_PACKED = _Op("glu_packed", "(Tensor gate_up, str activation, int layer, bool training) -> Tensor",
                  _glu_packed_build, lambda a, light: a["out"], result=lambda o: o, setup=_glu_packed_setup,
                  backward=_glu_packed_backward)
_GLU_PACKED_BWD = _Op("glu_packed_backward", "(Tensor dout, Tensor gate_up, str activation, int layer) -> Tensor",
                      _glu_packed_bwd_build, lambda a, light: a.made, result=lambda o: o, backward_entry=True)


# rotary_pos_emb/1
def _rope_setup(ctx, inputs, output):
    q, k, cos, sin, layer, training = inputs
    ctx.save_for_backward(cos, sin)
    ctx.kcpp = layer
    ctx.set_materialize_grads(False)


def _rope_backward(ctx, eager, dq_out, dk_out):
    cos, sin = ctx.saved_tensors
    if dq_out is None or dk_out is None:  # one of q_out / k_out unused: its gradient is zero
        like = dk_out if dq_out is None else dq_out
        dq_out = torch.zeros_like(like) if dq_out is None else dq_out
        dk_out = torch.zeros_like(like) if dk_out is None else dk_out
    dq, dk = _call(_ROPE_BWD, eager, _last_contig(dq_out), _last_contig(dk_out), cos, sin, ctx.kcpp)
    return dq, dk, None, None, None, None


_ROPE = _Op("rotary_pos_emb", "(Tensor q, Tensor k, Tensor cos, Tensor sin, int layer, bool training) "
            "-> (Tensor, Tensor)",
            lambda q, k, cos, sin, layer, training: {
                "q": q, "k": k, "cos": cos, "sin": sin, "layout": "bhsd",
                "q_out": torch.empty(q.shape, dtype=q.dtype, device=q.device),
                "k_out": torch.empty(k.shape, dtype=k.dtype, device=k.device)},
            lambda a, light: (a["q_out"], a["k_out"]), result=lambda o: o, setup=_rope_setup, backward=_rope_backward)
_ROPE_BWD = _Op("rotary_pos_emb_backward", "(Tensor dq_out, Tensor dk_out, Tensor cos, Tensor sin, int layer) "
                "-> (Tensor, Tensor)",
                lambda dq_out, dk_out, cos, sin, layer: {
                    "dq_out": dq_out, "dk_out": dk_out, "cos": cos, "sin": sin, "layout": "bhsd",
                    "dq": torch.empty(dq_out.shape, dtype=dq_out.dtype, device=dq_out.device),
                    "dk": torch.empty(dk_out.shape, dtype=dk_out.dtype, device=dk_out.device)},
                lambda a, light: (a["dq"], a["dk"]), backward_entry=True)


# Attention/1: q [B, Hq, Sq, D], k / v [B, Hkv, Skv, D] (D contiguous); the output is made [B, Sq, Hq, D], what
# Transformers' attention functions return, and handed to the kernel as its [B, Hq, Sq, D] view.
def _attention_build(q, k, v, scale, causal, window, softcap, layer, training):
    b, h, s, d = q.shape
    out = torch.empty((b, s, h, d), dtype=q.dtype, device=q.device)
    return {"q": q, "k": k, "v": v, "scale": scale, "causal": int(causal), "window": window, "softcap": softcap,
            "out": out.transpose(1, 2), "lse": _f32((b, h, s), q.device) if training else None}


def _attention_setup(ctx, inputs, output):
    q, k, v, scale, causal, window, softcap, layer, training = inputs
    ctx.save_for_backward(q, k, v, output[0], output[1])
    ctx.kcpp = (scale, causal, window, softcap, layer)
    ctx.mark_non_differentiable(output[1])
    ctx.set_materialize_grads(False)


def _attention_backward(ctx, eager, dout, _dlse):
    q, k, v, out, lse = ctx.saved_tensors
    scale, causal, window, softcap, layer = ctx.kcpp
    if dout is None:
        return (None,) * 9
    dq, dk, dv = _call(_ATTENTION_BWD, eager, _last_contig(dout), q, k, v, out, lse, scale, causal, window, softcap,
                       layer)
    return (dq, dk, dv) + (None,) * 6


# softcap: Gemma 2's logit soft-capping, 0.0 for none (the argument the contract added in flash_attn 0.2.0).
_ATTENTION = _Op("attention", "(Tensor q, Tensor k, Tensor v, float scale, bool causal, int window, float softcap, "
                 "int layer, bool training) -> (Tensor, Tensor)", _attention_build,
                 lambda a, light: (a["out"].transpose(1, 2), _made(a["lse"], a["q"], light)),
                 setup=_attention_setup, backward=_attention_backward)
_ATTENTION_BWD = _Op("attention_backward", "(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
                     "float scale, bool causal, int window, float softcap, int layer) -> (Tensor, Tensor, Tensor)",
                     lambda dout, q, k, v, out, lse, scale, causal, window, softcap, layer: {
                         "dout": dout.transpose(1, 2), "q": q, "k": k, "v": v, "out": out.transpose(1, 2), "lse": lse,
                         "scale": scale, "causal": int(causal), "window": window, "softcap": softcap,
                         "dq": torch.empty(q.shape, dtype=q.dtype, device=q.device),
                         "dk": torch.empty(k.shape, dtype=k.dtype, device=k.device),
                         "dv": torch.empty(v.shape, dtype=v.dtype, device=v.device)},
                     lambda a, light: (a["dq"], a["dk"], a["dv"]), backward_entry=True)


# Attention/1 with variable-length packed sequences (FlashAttention's varlen API): q [Tq, Hq, D], k / v
# [Tk, Hkv, D] (D contiguous), cu_seqlens_q / cu_seqlens_k [B + 1] i32 and max_seqlen_q / max_seqlen_k as the
# contract names them; out [Tq, Hq, D] (what Transformers' attention functions return, [B, S, H, D], once
# the batch row is put back) and lse [Hq, Tq].  The package checks the cu_seqlens (their entries on the CPU).
def _attention_varlen_build(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal, window, softcap, layer, training):
    return {"q": q, "k": k, "v": v, "cu_seqlens_q": cu_q, "cu_seqlens_k": cu_k, "max_seqlen_q": max_q,
            "max_seqlen_k": max_k, "scale": scale, "causal": int(causal), "window": window, "softcap": softcap,
            "out": torch.empty(q.shape, dtype=q.dtype, device=q.device),
            "lse": _f32((q.shape[1], q.shape[0]), q.device) if training else None}


def _attention_varlen_setup(ctx, inputs, output):
    q, k, v, cu_q, cu_k, max_q, max_k, scale, causal, window, softcap, layer, training = inputs
    ctx.save_for_backward(q, k, v, output[0], output[1], cu_q, cu_k)
    ctx.kcpp = (max_q, max_k, scale, causal, window, softcap, layer)
    ctx.mark_non_differentiable(output[1])
    ctx.set_materialize_grads(False)


def _attention_varlen_backward(ctx, eager, dout, _dlse):
    q, k, v, out, lse, cu_q, cu_k = ctx.saved_tensors
    max_q, max_k, scale, causal, window, softcap, layer = ctx.kcpp
    if dout is None:
        return (None,) * 13
    dq, dk, dv = _call(_ATTENTION_VARLEN_BWD, eager, _last_contig(dout), q, k, v, out, lse, cu_q, cu_k, max_q, max_k,
                       scale, causal, window, softcap, layer)
    return (dq, dk, dv) + (None,) * 10


_ATTENTION_VARLEN = _Op("attention_varlen", "(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, "
                        "int max_seqlen_q, int max_seqlen_k, float scale, bool causal, int window, float softcap, "
                        "int layer, bool training) -> (Tensor, Tensor)", _attention_varlen_build,
                        lambda a, light: (a["out"], _made(a["lse"], a["q"], light)),
                        setup=_attention_varlen_setup, backward=_attention_varlen_backward)
_ATTENTION_VARLEN_BWD = _Op(
    "attention_varlen_backward", "(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
    "Tensor cu_seqlens_q, Tensor cu_seqlens_k, int max_seqlen_q, int max_seqlen_k, float scale, bool causal, "
    "int window, float softcap, int layer) -> (Tensor, Tensor, Tensor)",
    lambda dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, scale, causal, window, softcap, layer: {
        "dout": dout, "q": q, "k": k, "v": v, "out": out, "lse": lse, "cu_seqlens_q": cu_q, "cu_seqlens_k": cu_k,
        "max_seqlen_q": max_q, "max_seqlen_k": max_k, "scale": scale, "causal": int(causal), "window": window,
        "softcap": softcap,
        "dq": torch.empty(q.shape, dtype=q.dtype, device=q.device),
        "dk": torch.empty(k.shape, dtype=k.dtype, device=k.device),
        "dv": torch.empty(v.shape, dtype=v.dtype, device=v.device)},
    lambda a, light: (a["dq"], a["dk"], a["dv"]), backward_entry=True)


# CrossEntropyLoss/1: the gradient is made by forward (the logits are read once) and scaled by backward.
def _ce_setup(ctx, inputs, output):
    ctx.save_for_backward(output[1])
    ctx.kcpp = inputs[-2]
    ctx.mark_non_differentiable(output[1])
    ctx.set_materialize_grads(False)


def _ce_backward(ctx, eager, dloss, _dgrad):
    (grad,) = ctx.saved_tensors
    if dloss is None:
        return (None,) * 6
    return _call(_CE_BWD, eager, dloss, grad, ctx.kcpp), None, None, None, None, None


_CE = _Op("cross_entropy", "(Tensor logits, Tensor targets, int ignore_index, str reduction, int layer, bool training)"
          " -> (Tensor, Tensor)",
          lambda logits, targets, ignore_index, reduction, layer, training: {
              "logits": logits, "targets": targets, "ignore_index": ignore_index, "reduction": reduction,
              "loss": _f32((), logits.device),
              "grad": torch.empty(logits.shape, dtype=logits.dtype, device=logits.device) if training else None},
          lambda a, light: (a["loss"], _made(a["grad"], a["logits"], light)),
          setup=_ce_setup, backward=_ce_backward)
_CE_BWD = _Op("cross_entropy_backward", "(Tensor dloss, Tensor grad, int layer) -> Tensor",
              lambda dloss, grad, layer: {"dloss": dloss.reshape(1).float(), "grad": grad,
                                          "dlogits": torch.empty(grad.shape, dtype=grad.dtype, device=grad.device)},
              lambda a, light: a["dlogits"], backward_entry=True)


# ForCausalLMLoss/1: the gradients of hidden and weight are made by forward (the logits never exist);
# backward scales them in place by the loss's gradient.
def _flce_build(hidden, weight, targets, ignore_index, reduction, softcap, dweight, layer, training):
    return {"hidden": hidden, "weight": weight, "targets": targets, "ignore_index": ignore_index,
            "reduction": reduction, "softcap": softcap, "loss": _f32((), hidden.device),
            "dhidden": torch.empty(hidden.shape, dtype=hidden.dtype, device=hidden.device),
            "dweight": torch.empty_like(weight) if dweight else None}


def _flce_setup(ctx, inputs, output):
    loss, dhidden, dweight = output
    ctx.save_for_backward(dhidden, dweight)
    ctx.kcpp = (inputs[6], inputs[7])
    ctx.mark_non_differentiable(dhidden, dweight)
    ctx.set_materialize_grads(False)


def _flce_backward(ctx, eager, dloss, _dh, _dw):
    dhidden, dweight = ctx.saved_tensors
    has_dweight, layer = ctx.kcpp
    if dloss is None:
        return (None,) * 9
    _call(_FLCE_BWD, eager, dloss, dhidden, dweight, layer)
    return dhidden, (dweight if has_dweight else None), None, None, None, None, None, None, None


_FLCE = _Op("fused_linear_cross_entropy", "(Tensor hidden, Tensor weight, Tensor targets, int ignore_index, "
            "str reduction, float softcap, bool dweight, int layer, bool training) -> (Tensor, Tensor, Tensor)",
            _flce_build, lambda a, light: (a["loss"], a["dhidden"], _made(a["dweight"], a["hidden"], light)),
            setup=_flce_setup, backward=_flce_backward)
_FLCE_BWD = _Op("fused_linear_cross_entropy_backward", "(Tensor dloss, Tensor(a!) dhidden, Tensor(b!) dweight, "
                "int layer) -> ()",
                lambda dloss, dhidden, dweight, layer: {"dloss": dloss.reshape(1).float(), "dhidden": dhidden,
                                                        "dweight": dweight if dweight.numel() else None},
                lambda a, light: None, backward_entry=True)


# ---- RMSNorm/1 --------------------------------------------------------------------------------------------

def _rms_norm_forward(where, module, slot, original, spec, hidden_states):
    x, weight = hidden_states, module.weight
    training = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
    if x.dtype != weight.dtype:
        _refuse(slot.sid, f"x is {x.dtype} and weight {weight.dtype}: RMSNorm/1 takes one dtype")
        return original(hidden_states)
    if x.numel() == 0:
        _refuse(slot.sid, _WHY_EMPTY)
        return original(hidden_states)
    # RMSNorm/1's rows may be strided but must be one stride apart (Gemma 3's q / k norms get transposed views).
    x = _last_contig(x) if x.dim() <= 2 else _contig(x)
    eps, offset, casting = spec
    traced = torch.compiler.is_compiling()
    return _kernel_or_reference(slot, training, traced, "rms_norm",
                                (_desc(x, traced), _desc(weight, traced), eps, offset, casting), where, _RMS_NORM,
                                (x, weight, eps, offset, casting), lambda: original(hidden_states))


def _rms_norm_spec(m):
    """(eps, offset, casting) of a Transformers RMSNorm module, or None when it is not one checked here."""
    name = type(m).__name__
    if not (name.endswith("RMSNorm") and isinstance(getattr(m, "weight", None), torch.nn.Parameter)
            and m.weight.dim() == 1 and getattr(_modeling_module(m), "__name__", "").startswith("transformers.models.")):
        return None
    if name in _GEMMA_NORMS and isinstance(getattr(m, "eps", None), float):
        return float(m.eps), 1.0, "gemma"  # (x / rms(x)) * (1 + w), all in f32
    if hasattr(m, "variance_epsilon") and name not in _GEMMA_NORMS:
        return float(m.variance_epsilon), 0.0, "llama"  # w * (x / rms(x)).to(dtype)
    return None


# ---- GLU/1 (the gated MLP's activation times up) ------------------------------------------------------------

def _mlp_forward(where, module, slot, original, activation, x):
    if activation is None:
        _refuse(slot.sid, f"activation {module.act_fn.__class__.__name__} is not one GLU/1 takes")
        return original(x)
    gate, up = module.gate_proj(x), module.up_proj(x)
    training = _needs_grad(gate, up)
    if gate.dtype != up.dtype or gate.numel() == 0:
        _refuse(slot.sid, f"gate {gate.dtype} {tuple(gate.shape)}, up {up.dtype}: GLU/1 takes one dtype, non-empty")
        return module.down_proj(module.act_fn(gate) * up)
    gate, up = _contig(gate), _contig(up)
    traced = torch.compiler.is_compiling()
    lid = _decide(slot.sid, training, "glu", (_desc(gate, traced), _desc(up, traced), activation), where)
    if lid < 0:
        return module.down_proj(module.act_fn(gate) * up)
    try:
        out = _invoke(_GLU, training, traced, gate, up, activation, lid, training)
    except kcpp.Unsupported as e:
        _refuse(slot.sid, str(e))
        return module.down_proj(module.act_fn(gate) * up)
    return module.down_proj(out)


def _packed_mlp_forward(where, module, slot, original, activation, x):
    """Phi-3's MLP, down_proj(up * act(gate)) with gate, up = gate_up_proj(x).chunk(2, -1), its
    activation through GLU/1 on the halves in place."""
    gate_up = module.gate_up_proj(x)

    def reference():
        gate, up = gate_up.chunk(2, dim=-1)
        return module.down_proj(up * module.activation_fn(gate))
    if activation is None:
        _refuse(slot.sid, f"activation {module.activation_fn.__class__.__name__} is not one GLU/1 takes")
        return reference()
    if gate_up.numel() == 0 or gate_up.shape[-1] % 2:
        _refuse(slot.sid, f"gate_up {tuple(gate_up.shape)}: GLU/1 takes two non-empty halves")
        return reference()
    training = _needs_grad(gate_up)
    gate_up = _contig(gate_up)
    traced = torch.compiler.is_compiling()
    lid = _decide(slot.sid, training, "glu_packed", (_desc(gate_up, traced), activation), where)
    if lid < 0:
        return reference()
    try:
        out = _invoke(_GLU_PACKED, training, traced, gate_up, activation, lid, training)
    except kcpp.Unsupported as e:
        _refuse(slot.sid, str(e))
        return reference()
    return module.down_proj(out)


def _glu_activation(m):
    """The GLU/1 activation of a gated MLP, or None when its act_fn is not one the contract has."""
    config = getattr(m, "config", None)
    name = getattr(config, "hidden_act", None) or getattr(config, "hidden_activation", None)
    if name not in _GLU_ACTIVATIONS:
        return None
    return {"swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh", "gelu_fast": "gelu_tanh"}.get(name, name)


# ---- rotary_pos_emb/1 -------------------------------------------------------------------------------------

# The model whose attention module is running (set by the attention wrappers): the patched
# apply_rotary_pos_emb of a modeling module serves kernelized models only.  A context variable in
# eager calls (threads keep theirs); a plain variable while torch.compile traces (it cannot trace a
# context variable's changes).
_ROPE_SLOT = contextvars.ContextVar("kcpp_rope_slot", default=None)
_ROPE_TRACED = None
# modeling module name -> [original apply_rotary_pos_emb, number of kernelized models using the patch]
_ROPE_PATCHES = {}


def _rope_dispatch(original, q, k, cos, sin, *args, **kwargs):
    traced = torch.compiler.is_compiling()
    slot = _ROPE_TRACED if traced else _ROPE_SLOT.get()
    if slot is None:
        return original(q, k, cos, sin, *args, **kwargs)
    training = _needs_grad(q, k)
    unsqueeze_dim = args[0] if args else kwargs.get("unsqueeze_dim", 1)
    if (q.dtype in (torch.bfloat16, torch.float16) and k.dtype == q.dtype and cos.dtype == sin.dtype == torch.float32
            and torch.is_autocast_enabled(q.device.type) and not _needs_grad(cos, sin)):
        # torch.autocast over f32 weights: q and k come 16-bit from autocast's Linear, cos / sin stay f32.
        # They are rounded to q's dtype, as a model with 16-bit weights has them (its rotary embedding
        # returns them in the hidden states' dtype), so the rotation and the attention after it run as
        # kernels (Transformers' own rotation promotes q and k to f32 beside a 16-bit v).
        cos, sin = cos.to(q.dtype), sin.to(q.dtype)
    why = None
    if unsqueeze_dim != 1 or set(kwargs) - {"unsqueeze_dim"} or len(args) > 1:
        why = f"apply_rotary_pos_emb called with unsqueeze_dim={unsqueeze_dim} or other arguments"
    elif _needs_grad(cos, sin):
        why = "cos / sin require gradients (rotary_pos_emb/1 has none for them)"
    elif q.dim() != 4 or k.dim() != 4 or cos.dim() not in (2, 3) or q.dtype != cos.dtype or k.dtype != q.dtype \
            or sin.dtype != q.dtype:
        why = (f"q {tuple(q.shape)} {q.dtype}, k {k.dtype}, cos {cos.dtype}: rotary_pos_emb/1 takes 4-D q, k in "
               "cos's dtype")
    elif q.numel() == 0 or k.numel() == 0:
        why = _WHY_EMPTY
    if why is not None:
        _refuse(slot.sid, why)
        return original(q, k, cos, sin, *args, **kwargs)
    q, k, cos, sin = _last_contig(q), _last_contig(k), _contig(cos), _contig(sin)
    desc = (_desc(q, traced, (1, 3)), _desc(k, traced, (1, 3)), _desc(cos, traced), _desc(sin, traced))
    return _kernel_or_reference(slot, training, traced, "rotary_pos_emb", desc, "apply_rotary_pos_emb", _ROPE,
                                (q, k, cos, sin), lambda: original(q, k, cos, sin, *args, **kwargs))


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


def _attention_module_forward(slot, original, *args, **kwargs):
    global _ROPE_TRACED
    if torch.compiler.is_compiling():
        previous = _ROPE_TRACED
        _ROPE_TRACED = slot
        try:
            return original(*args, **kwargs)
        finally:
            _ROPE_TRACED = previous
    token = _ROPE_SLOT.set(slot)
    try:
        return original(*args, **kwargs)
    finally:
        _ROPE_SLOT.reset(token)


# ---- Attention/1 (Transformers' attention function "kcpp") ---------------------------------------------

def _load_local(slot, package_name, how):
    """A slot's kernels from this build's own package `package_name` (loaded at the first call, as
    kernelize loads them): the layer of the slot's contract, for inference and, with a backward, training."""
    slot.loader = None
    folder = kcpp.local_packages().get(package_name)
    if folder is None:
        slot.reason = f"no {package_name} package built with this kcpp (kcpp.local_packages())"
        return
    package = kcpp.Hub(allow_all_kernels=True).load(folder)
    layer = package.layer_by_contract(slot.contract)
    slot.add_kernel("inference", layer)
    if layer.has_backward:
        slot.add_kernel("training", layer)
    slot.reason = f"{package.name} {package.version}: {layer.name} ({slot.contract}), {how}"


def _load_default_attention(slot):
    """The kernels of a model that selects "kcpp" without kernelize: this build's flash_attn."""
    _load_local(slot, "flash_attn", f"attn_implementation={ATTENTION_NAME!r}")


# The slot of models that select "kcpp" without being kernelized.
_DEFAULT_ATTENTION = _Slot("Attention", "Attention/1", reason="loaded at the first call",
                           loader=_load_default_attention)


def _kcpp_mask(*args, **kwargs):
    """The mask function of "kcpp": None for a causal mask (with or without a sliding window) that has no
    padding, cache or custom part, so the attention function takes the pattern from `is_causal` and
    `sliding_window` (which the checked families pass: Llama, Mistral, Qwen2 / 3, Phi-3, Gemma 2 / 3);
    otherwise SDPA's boolean mask.  Transformers' own SDPA mask keeps a full mask while tracing (some
    versions, e.g. 5.17), which would send every compiled call to the reference."""
    from transformers.masking_utils import sdpa_mask
    if not args and _plain_causal(**kwargs):
        return None
    return sdpa_mask(*args, **kwargs)


def _plain_causal(q_length=None, kv_length=None, q_offset=0, kv_offset=0, attention_mask=None,
                  allow_is_causal_skip=True, config=None, **kwargs):
    return (allow_is_causal_skip and getattr(config, "model_type", None) in _MODEL_TYPES
            and isinstance(q_length, int) and isinstance(q_offset, int) and isinstance(kv_offset, int)
            and q_offset == 0 and kv_offset == 0 and q_length == kv_length
            and (attention_mask is None or (not torch.compiler.is_compiling() and bool(attention_mask.all()))))


def _causal_window_mask(q_len, kv_len, window, device):
    """[q_len, kv_len] booleans: query i (at position i + kv_len - q_len) sees key j <= it, within the window."""
    pos = torch.arange(q_len, device=device)[:, None] + (kv_len - q_len)
    j = torch.arange(kv_len, device=device)[None, :]
    keep = j <= pos
    if window:
        keep = keep & (pos - j < window)
    return keep


def _reference_attention(module, query, key, value, attention_mask, dropout, scaling, is_causal, sliding_window,
                         softcap, kwargs, implementation):
    """Transformers' own attention for a call the kernel does not take: the model's implementation before
    kernelize, "sdpa" or "eager" (the modeling module's; also for soft-capping, which SDPA has not), over
    the mask "kcpp" made (SDPA's booleans; none for a causal / sliding-window mask)."""
    q_len, kv_len = query.shape[2], key.shape[2]
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    eager = implementation == "eager" or softcap is not None
    if attention_mask is None and causal:
        if q_len > 1 and kv_len > q_len:  # SDPA's reading of no mask: the first q_len keys
            key, value, kv_len = key[:, :, :q_len], value[:, :, :q_len], q_len
        if eager or (sliding_window and kv_len > sliding_window):
            attention_mask = _causal_window_mask(q_len, kv_len, sliding_window or 0, query.device)[None, None]
    if not eager:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    if attention_mask is not None and attention_mask.dtype == torch.bool:  # eager's masks are additive
        attention_mask = torch.zeros(attention_mask.shape, dtype=query.dtype, device=query.device).masked_fill(
            ~attention_mask, torch.finfo(query.dtype).min)
    eager_attention = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward")
    extra = {"softcap": softcap} if softcap is not None else {}
    return eager_attention(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                           sliding_window=sliding_window, **extra, **kwargs)


def _attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None,
               sliding_window=None, softcap=None, **kwargs):
    """Transformers' attention function "kcpp": the Attention/1 kernel of the module's model
    (kernelize), or this build's flash_attn; (output [B, Sq, Hq, D], None)."""
    slot, where, implementation = getattr(module, "_kcpp_attention", None) or \
        (_DEFAULT_ATTENTION, type(module).__name__, "sdpa")

    def reference():
        return _reference_attention(module, query, key, value, attention_mask, dropout, scaling, is_causal,
                                    sliding_window, softcap, kwargs, implementation)
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    if kwargs.get("cu_seq_lens_q") is not None or kwargs.get("cu_seq_lens_k") is not None:
        return _packed_attention(module, query, key, value, attention_mask, dropout, scaling, causal, is_causal,
                                 sliding_window, softcap, kwargs, slot, where, implementation)
    if attention_mask is not None:
        why = "an attention mask (padding, packed sequences, a cache or a custom mask): Attention/1 takes causal and " \
              "sliding-window masks"
    else:
        why = _attention_features_missing(dropout, kwargs) or \
            _attention_shapes_missing(query, key, value, causal, sliding_window)
    if why is not None:
        _refuse(slot.sid, why)
        return reference()
    q_len, kv_len = query.shape[2], key.shape[2]
    if causal and q_len > 1 and kv_len > q_len:  # no mask and more keys: SDPA's reading, the first q_len keys
        key, value = key[:, :, :q_len], value[:, :, :q_len]
    q, k, v = _last_contig(query), _last_contig(key), _last_contig(value)
    scale = float(scaling) if scaling is not None else 1.0 / math.sqrt(q.shape[-1])
    window = operator.index(sliding_window) if sliding_window else 0
    cap = float(softcap) if softcap else 0.0
    training = _needs_grad(q, k, v)
    traced = torch.compiler.is_compiling()
    desc = (_desc(q, traced, (1, 3)), _desc(k, traced, (1, 3)), _desc(v, traced, (1, 3)), scale, bool(causal), window,
            cap)
    lid = _decide(slot.sid, training, "attention", desc, where)
    if lid < 0:
        return reference()
    try:
        return _invoke(_ATTENTION, training, traced, q, k, v, scale, bool(causal), window, cap, lid, training), None
    except kcpp.Unsupported as e:
        _refuse(slot.sid, str(e))
        return reference()


# ---- packed sequences (Transformers' cu_seq_lens_q / cu_seq_lens_k / max_length_q / max_length_k) ------
#
# DataCollatorWithFlattening(return_flash_attn_kwargs=True) and the models that pack sequences pass these
# keyword arguments to the attention function, as FlashAttention's varlen API takes them: the tokens of
# all batch rows, in order, are B sequences end to end, sequence b owning tokens
# [cu_seq_lens_q[b], cu_seq_lens_q[b + 1]) of the queries and [cu_seq_lens_k[b], cu_seq_lens_k[b + 1]) of the
# keys, each an attention of its own (causal aligning its queries to the end of its keys; the sliding
# window within it).  "kcpp" hands them to Attention/1's varlen arguments as they are (the package checks
# them: i32, [B + 1], entries that start at 0, do not decrease and end at the token counts, no sequence
# longer than max_length); the max lengths, when not given, are read from the cu_seq_lens.
#
# As with FlashAttention, the cu_seq_lens say which tokens attend to which; an attention mask can only
# take more away.  The call computes the attention over the packing's mask and the call's mask together.
# The kernel takes it when the call has no mask, or one that takes nothing from the packing's (the mask
# Transformers makes from packed position_ids, or a plain causal one; checked by one comparison, not
# while torch.compile traces: there a mask sends the call to the reference).  Otherwise, or when the
# package refuses the call, Transformers' attention runs over the rows' tokens flattened into one row
# with the two masks combined: the same per-sequence result.  (A mask that is not boolean [B, 1, Sq, Skv]
# runs the reference over that mask as it is.)

def _packed_mask(cu_q, cu_k, q_len, kv_len, causal, window, device):
    """[q_len, kv_len] booleans of packed sequences: query token t of sequence b (at position
    t - cu_q[b] + len_k(b) - len_q(b) of its keys) sees key token u of the same sequence (causal / window
    as Attention/1).  Entries past the cu_seq_lens are clamped (the package checks them where it runs)."""
    cu_q = cu_q.reshape(-1).to(device=device, dtype=torch.int64)
    cu_k = cu_k.reshape(-1).to(device=device, dtype=torch.int64)
    n = min(cu_q.numel(), cu_k.numel()) - 1
    if n < 1:  # no sequence
        return torch.zeros(q_len, kv_len, dtype=torch.bool, device=device)
    tq, tk = torch.arange(q_len, device=device), torch.arange(kv_len, device=device)
    bq = torch.searchsorted(cu_q[1:n + 1].contiguous(), tq, right=True).clamp_(max=n - 1)
    bk = torch.searchsorted(cu_k[1:n + 1].contiguous(), tk, right=True).clamp_(max=n - 1)
    pos = tq - cu_q[bq] + (cu_k[bq + 1] - cu_k[bq]) - (cu_q[bq + 1] - cu_q[bq])
    j = tk - cu_k[bk]
    see = bq[:, None] == bk[None, :]
    if causal:
        see = see & (j[None, :] <= pos[:, None])
    if window:
        see = see & (pos[:, None] - j[None, :] < window)
    return see


def _packed_max(max_len, cu, traced):
    """max_length_q / max_length_k as an int: given (an int, or a one-element tensor read on the host), or
    the longest of the cu_seq_lens; None when that would read a tensor while torch.compile traces."""
    if isinstance(max_len, int):
        return max_len
    if traced:
        return None
    if max_len is not None:
        return int(max_len)
    if cu is None:  # the package names what is missing
        return 0
    cu = cu.reshape(-1)
    return int((cu[1:] - cu[:-1]).max()) if cu.numel() > 1 else 0


def _flat_mask(mask, q_len, kv_len):
    """A boolean [B, 1, Sq, Skv] mask as [B Sq, B Skv] over the rows' tokens flattened (a token sees none of
    another row's); None for any other mask."""
    if mask is None or mask.dtype != torch.bool or mask.dim() != 4 or mask.shape[1] != 1:
        return None
    if mask.shape[0] == 1:
        m = mask[0, 0]
    else:
        m = torch.block_diag(*mask[:, 0])
    return m if tuple(m.shape) == (q_len, kv_len) else None


def _attention_features_missing(dropout, kwargs):
    """Why Attention/1 cannot take a call for what it asks beyond the mask and soft-capping (None when it can)."""
    if dropout:
        return f"dropout {dropout}: Attention/1 has none"
    if kwargs.get("s_aux") is not None or kwargs.get("position_bias") is not None:
        return "attention sinks or a position bias: Attention/1 has none"
    return None


def _is_bhsd(query, key, value):
    """Whether q, k, v have Attention/1's padded layout, [B, H, S, D] (k and v of one shape)."""
    return query.dim() == 4 and key.dim() == 4 and value.shape == key.shape


def _attention_shapes_missing(query, key, value, causal, sliding_window):
    """Why Attention/1 cannot take a call for its tensors' shapes or its mask pattern (None when it can)."""
    if not _is_bhsd(query, key, value):
        return f"q {tuple(query.shape)}, k {tuple(key.shape)}, v {tuple(value.shape)}: Attention/1 takes [B, H, S, D]"
    if not query.dtype == key.dtype == value.dtype:  # e.g. under torch.autocast after a RoPE left in f32
        return f"q {query.dtype}, k {key.dtype}, v {value.dtype}: Attention/1 takes one dtype"
    if not causal and sliding_window:
        return "a sliding window without the causal mask"
    if query.numel() == 0 or key.numel() == 0:
        return _WHY_EMPTY
    return None


def _packed_attention(module, query, key, value, attention_mask, dropout, scaling, causal, is_causal, sliding_window,
                      softcap, kwargs, slot, where, implementation):
    """The attention function "kcpp" for packed sequences: Attention/1's varlen call, or the reference."""
    # Attention/1's cu_seqlens are i32; Transformers' may be int64 (torch.tensor's default).
    cu_q, cu_k = (c.to(torch.int32) if c is not None and c.dtype == torch.int64 else c
                  for c in (kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")))
    traced = torch.compiler.is_compiling()
    four_d = _is_bhsd(query, key, value)
    window = operator.index(sliding_window) if sliding_window else 0

    def flat(t):  # [B, H, S, D] -> [B S, H, D]: every row's tokens, in order (FlashAttention's reading)
        return t.transpose(1, 2).reshape(-1, t.shape[1], t.shape[3])

    def reference():
        """Transformers' own attention over the packing's mask and the call's, the rows flattened into one;
        over the call's mask as it is where it has no boolean [B, 1, Sq, Skv] form or the cu_seq_lens are
        not both given."""
        own = None
        if four_d and cu_q is not None and cu_k is not None:
            q_len, kv_len = query.shape[0] * query.shape[2], key.shape[0] * key.shape[2]
            given = _flat_mask(attention_mask, q_len, kv_len)
            if attention_mask is None or given is not None:
                own = _packed_mask(cu_q, cu_k, q_len, kv_len, causal, window, query.device)
                own = own if given is None else own & given.to(own.device)
        if own is None:
            return _reference_attention(module, query, key, value, attention_mask, dropout, scaling, is_causal,
                                        sliding_window, softcap, kwargs, implementation)
        q1, k1, v1 = (flat(t).transpose(0, 1).unsqueeze(0) for t in (query, key, value))
        out, weights = _reference_attention(module, q1, k1, v1, own[None, None], dropout, scaling, is_causal,
                                            sliding_window, softcap, kwargs, implementation)
        return out.reshape(query.shape[0], query.shape[2], *out.shape[2:]), weights

    def fall_back(why):
        _refuse(slot.sid, why)
        return reference()

    why = _attention_features_missing(dropout, kwargs)
    if why is None and any(kwargs.get(n) is not None for n in ("block_table", "k_cache", "v_cache")):
        why = "a paged cache (block_table): Attention/1 has none"
    why = why or _attention_shapes_missing(query, key, value, causal, sliding_window)
    if why is not None:
        return fall_back(why)
    q, k, v = (_last_contig(flat(t)) for t in (query, key, value))
    max_q = _packed_max(kwargs.get("max_length_q"), cu_q, traced)
    max_k = _packed_max(kwargs.get("max_length_k"), cu_k, traced)
    if max_q is None or max_k is None:
        return fall_back("packed sequences without max_length_q / max_length_k as ints while torch.compile traces "
                         "(reading them from the cu_seq_lens would read a tensor)")
    scale = float(scaling) if scaling is not None else 1.0 / math.sqrt(q.shape[-1])
    cap = float(softcap) if softcap else 0.0
    training = _needs_grad(q, k, v)
    desc = (_desc(q, traced, (1, 2)), _desc(k, traced, (1, 2)), _desc(v, traced, (1, 2)),
            cu_q if cu_q is None else _desc(cu_q, traced, ()), cu_k if cu_k is None else _desc(cu_k, traced, ()),
            _ANY, _ANY, scale, bool(causal), window, cap)
    lid = _decide(slot.sid, training, "attention_varlen", desc, where)  # a refusal is counted here
    if lid < 0:
        return reference()
    if attention_mask is not None:
        if traced:
            return fall_back("packed sequences with an attention mask while torch.compile traces (whether it takes "
                             "anything from the packing's would read tensors)")
        given = _flat_mask(attention_mask, q.shape[0], k.shape[0])
        if given is None or bool((_packed_mask(cu_q, cu_k, q.shape[0], k.shape[0], causal, window, given.device)
                                  & ~given).any()):
            return fall_back("packed sequences with an attention mask that takes keys from the packing's (padding "
                             "or a custom mask)")
    try:
        out = _invoke(_ATTENTION_VARLEN, training, traced, q, k, v, cu_q, cu_k, max_q, max_k, scale, bool(causal),
                      window, cap, lid, training)
    except kcpp.Unsupported as e:
        return fall_back(str(e))
    return out.reshape(query.shape[0], query.shape[2], *out.shape[1:]), None


def _register_attention():
    """`attn_implementation="kcpp"`: the attention function and its mask function."""
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError:  # no transformers: kernelize is not usable anyway
        return
    AttentionInterface.register(ATTENTION_NAME, _attention)
    AttentionMaskInterface.register(ATTENTION_NAME, _kcpp_mask)


_register_attention()


# ---- MoE/1 as Transformers' experts backend ("kcpp" in the ExpertsInterface) ------------------------------------
#
# Transformers 5's MoE blocks route with their own router and call the experts module through the
# ExpertsInterface: experts(hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k]) -> [T, H].
# experts_implementation="kcpp" (or config._experts_implementation) sends that call to the moe package's
# MoE/1 layer with routing "given": the grouped expert GEMMs and, in training, the gradients of the
# hidden states, the routing weights (back into Transformers' router through autograd) and the fused
# gate_up_proj [E, 2I, H] / down_proj [E, H, I].

EXPERTS_NAME = "kcpp"
_EXPERT_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh",
                       "gelu_new": "gelu_tanh", "gelu_fast": "gelu_tanh"}


def _experts_build(hidden, topk_ids, topk_weights, gate_up_proj, down_proj, activation, layer, training):
    e = gate_up_proj.shape[0]
    return {"hidden": hidden, "routing": "given", "topk_ids": topk_ids, "topk_weights": topk_weights,
            "gate_up_proj": gate_up_proj, "down_proj": down_proj, "activation": activation,
            "out": torch.empty(hidden.shape, dtype=hidden.dtype, device=hidden.device),
            "expert_offsets": torch.empty(e + 2, dtype=torch.int32, device=hidden.device),
            "sorted_slots": torch.empty(topk_ids.numel(), dtype=torch.int32, device=hidden.device)}


def _experts_setup(ctx, inputs, output):
    hidden, topk_ids, topk_weights, gate_up_proj, down_proj, activation, layer, _training = inputs
    _out, offsets, slots = output
    ctx.save_for_backward(hidden, topk_ids, topk_weights, gate_up_proj, down_proj, offsets, slots)
    ctx.kcpp = (activation, layer)
    ctx.mark_non_differentiable(offsets, slots)
    ctx.set_materialize_grads(False)


def _experts_backward(ctx, eager, dout, _do, _ds):
    hidden, topk_ids, topk_weights, gate_up_proj, down_proj, offsets, slots = ctx.saved_tensors
    activation, layer = ctx.kcpp
    if dout is None:
        return (None,) * 8
    dweights = _needs(ctx, eager, 3) or _needs(ctx, eager, 4)
    dh, dw, dgu, dd = _call(_EXPERTS_BWD, eager, _contig(dout), hidden, topk_ids, topk_weights, gate_up_proj, down_proj,
                            offsets, slots, activation, dweights, layer)
    return (dh, None, dw.to(topk_weights.dtype) if _needs(ctx, eager, 2) else None,
            dgu if _needs(ctx, eager, 3) else None, dd if _needs(ctx, eager, 4) else None, None, None, None)


def _experts_bwd_build(dout, hidden, topk_ids, topk_weights, gate_up_proj, down_proj, offsets, slots, activation, dweights,
                       layer):
    return {"dout": dout, "hidden": hidden, "routing": "given", "topk_ids": topk_ids, "topk_weights": topk_weights,
            "gate_up_proj": gate_up_proj, "down_proj": down_proj, "activation": activation, "expert_offsets": offsets,
            "sorted_slots": slots, "dhidden": torch.empty(hidden.shape, dtype=hidden.dtype, device=hidden.device),
            "dtopk_weights": _f32(topk_ids.shape, hidden.device),
            "dgate_up_proj": torch.empty_like(gate_up_proj, memory_format=torch.contiguous_format) if dweights else None,
            "ddown_proj": torch.empty_like(down_proj, memory_format=torch.contiguous_format) if dweights else None}


_EXPERTS = _Op("moe_experts", "(Tensor hidden, Tensor topk_ids, Tensor topk_weights, Tensor gate_up_proj, "
               "Tensor down_proj, str activation, int layer, bool training) -> (Tensor, Tensor, Tensor)",
               _experts_build,
               lambda a, light: (a["out"], a["expert_offsets"], a["sorted_slots"]),
               setup=_experts_setup, backward=_experts_backward)
_EXPERTS_BWD = _Op("moe_experts_backward", "(Tensor dout, Tensor hidden, Tensor topk_ids, Tensor topk_weights, "
                   "Tensor gate_up_proj, Tensor down_proj, Tensor expert_offsets, Tensor sorted_slots, str activation, "
                   "bool dweights, int layer) -> (Tensor, Tensor, Tensor, Tensor)",
                   _experts_bwd_build,
                   lambda a, light: (a["dhidden"], a["dtopk_weights"], _made(a["dgate_up_proj"], a["hidden"], light),
                                     _made(a["ddown_proj"], a["hidden"], light)),
                   backward_entry=True)


def _load_default_experts(slot):
    """The kernels of a model that selects experts_implementation "kcpp": this build's moe package."""
    _load_local(slot, "moe", f"experts_implementation={EXPERTS_NAME!r}")


_DEFAULT_EXPERTS = _Slot("MegaBlocksMoeMLP", "MoE/1", reason="loaded at the first call", loader=_load_default_experts)


def experts_report():
    """The experts backend's counts: kernel, kernel_calls, reference_calls, fallbacks, last_refusal."""
    s = _DEFAULT_EXPERTS
    kernel = s.kernels.get("inference")
    return {"kernel": f"{kernel.package_name}:{kernel.name}" if kernel else "", "reason": s.reason,
            "kernel_calls": s.kernel_calls, "reference_calls": s.reference_calls, "fallbacks": s.fallbacks,
            "last_refusal": s.last_refusal}


def _experts(module, hidden_states, top_k_index, top_k_weights):
    """Transformers' experts function "kcpp": the moe package over the router's choice; Transformers'
    batched_mm experts for a call the package does not take."""
    slot, where = _DEFAULT_EXPERTS, type(module).__name__

    def reference():
        from transformers.integrations.moe import batched_mm_experts_forward
        return batched_mm_experts_forward(module, hidden_states, top_k_index, top_k_weights)
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    act = _EXPERT_ACTIVATIONS.get(getattr(getattr(module, "config", None), "hidden_act", None))
    why = None
    if not isinstance(gate_up, torch.Tensor) or not isinstance(down, torch.Tensor) or not getattr(module, "has_gate", True):
        why = "no fused gate_up_proj and down_proj: MoE/1 here takes Transformers 5's fused expert weights"
    elif getattr(module, "has_bias", False) or getattr(module, "has_post_expert_norm", False):
        why = "expert biases or a post-expert norm: MoE/1 has none"
    elif getattr(module, "is_transposed", False) or not getattr(module, "is_concatenated", True):
        why = "transposed or interleaved expert weights"
    elif act is None:
        why = f"activation {getattr(getattr(module, 'config', None), 'hidden_act', None)!r}: MoE/1 takes silu and the gelus"
    elif hidden_states.dim() != 2 or hidden_states.numel() == 0 or top_k_index.shape != top_k_weights.shape:
        why = f"hidden {tuple(hidden_states.shape)}, top_k_index {tuple(top_k_index.shape)}: MoE/1 takes [T, H] and [T, k]"
    elif getattr(module, "_is_expert_parallel", False):
        why = "expert parallelism"
    if why is not None:
        _refuse(slot.sid, why)
        return reference()
    hidden = _contig(hidden_states)
    ids, w = _contig(top_k_index), _contig(top_k_weights)
    training = _needs_grad(hidden, w, gate_up, down)
    traced = torch.compiler.is_compiling()
    desc = (_desc(hidden, traced), _desc(ids, traced, (1,)), _desc(w, traced, (1,)), _desc(gate_up, traced, (0, 1, 2)),
            _desc(down, traced, (0, 1, 2)), act)
    return _kernel_or_reference(slot, training, traced, "moe_experts", desc, where, _EXPERTS,
                                (hidden, ids, w, gate_up, down, act), reference)


def _register_experts():
    """`experts_implementation="kcpp"`: the moe package as Transformers' experts backend."""
    try:
        from transformers.integrations.moe import ExpertsInterface
    except ImportError:  # a Transformers without the experts interface
        return
    ExpertsInterface.register(EXPERTS_NAME, _experts)


_register_experts()


# ---- CrossEntropyLoss/1 (the model's loss_function over the logits) -------------------------------------------

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
    if logits.numel() == 0:
        _refuse(slot.sid, _WHY_EMPTY)
        return reference()
    logits2d = _contig(logits).view(-1, vocab_size)
    targets = _shifted_targets(labels, ignore_index, shift_labels, logits.device)
    reduction = "mean" if num_items_in_batch is None else "sum"
    traced = torch.compiler.is_compiling()
    desc = (_desc(logits2d, traced), _desc(targets, traced, ()), int(ignore_index), reduction)
    lid = _decide(slot.sid, training, "cross_entropy", desc, "loss_function")
    if lid < 0:
        return reference()
    try:
        loss = _invoke(_CE, training, traced, logits2d, targets, int(ignore_index), reduction, lid, training)
    except kcpp.Unsupported as e:
        _refuse(slot.sid, str(e))
        return reference()
    if num_items_in_batch is not None:
        loss = loss / (num_items_in_batch.to(loss.device) if torch.is_tensor(num_items_in_batch) else num_items_in_batch)
    return loss


# ---- ForCausalLMLoss/1 (the loss fused with lm_head) --------------------------------------------------------

def _causal_lm_forward(model, slot, original, names, output_class, has_training, *args, labels=None, logits_to_keep=0,
                       **kwargs):
    """*ForCausalLM.forward with the loss fused with lm_head where its kernel takes the call: a training
    call with labels returns the loss and no logits (the logits never exist), as Liger's."""
    if args:  # positional arguments by their names in the model's forward
        kwargs.update(zip(names, args))
    if labels is None or not has_training or not torch.is_grad_enabled():
        if labels is not None:
            _reference_call(slot.sid)
        return original(labels=labels, logits_to_keep=logits_to_keep, **kwargs)
    if getattr(model.config, "output_router_logits", False) or kwargs.get("output_router_logits"):
        _refuse(slot.sid, "the router's auxiliary loss (output_router_logits): the fused loss does not add it")
        return original(labels=labels, logits_to_keep=logits_to_keep, **kwargs)
    lm_head = model.get_output_embeddings()
    hooked = _in_accelerate_hook(lm_head)
    if type(lm_head).forward is not torch.nn.Linear.forward or _replaced_forward(lm_head) or (hooked and not _moves_only(lm_head)):
        # A PEFT adapter (LoRA on lm_head, modules_to_save), a forward replaced on the instance by a wrapper
        # other than accelerate's device hook, an accelerate hook that may transform lm_head's output, or
        # another module whose output may not be x W^T of its `weight`: the fused loss, which reads only
        # that weight, would leave the rest out.
        what = ("not a Linear" if type(lm_head).forward is not torch.nn.Linear.forward else
                "its forward replaced" if _replaced_forward(lm_head) else
                f"inside an accelerate hook ({type(lm_head._hf_hook).__name__}) that may change its output")
        _refuse(slot.sid, f"lm_head is a {type(lm_head).__module__}.{type(lm_head).__qualname__}, {what}: the fused "
                          "loss reads only its weight")
        return original(labels=labels, logits_to_keep=logits_to_keep, **kwargs)
    num_items_in_batch = kwargs.pop("num_items_in_batch", None)
    ignore_index = kwargs.pop("ignore_index", -100)
    shift_labels = kwargs.pop("shift_labels", None)
    outputs = model.model(**kwargs)
    hidden = outputs.last_hidden_state
    if _holds_a_shard(lm_head) or hooked:
        # lm_head's weight is whole only inside its own forward (FSDP2, ZeRO-3), or on its device and loaded
        # there (accelerate's device_map / offload hook, which also moves the hidden states to it): the fused
        # loss runs there, and a fallback computes the logits with lm_head's own forward (its hooks are
        # already running).  Under torch.compile too: FSDP2's hooks run outside the graph, and `inside` is
        # traced on its own.
        def inside(h):
            return _fused_loss(model, slot, output_class, outputs, h, lm_head, lambda x: type(lm_head).forward(lm_head, x),
                               labels, logits_to_keep, num_items_in_batch, ignore_index, shift_labels)
        return _as_forward_of(lm_head, inside, hidden)
    return _fused_loss(model, slot, output_class, outputs, hidden, lm_head, lm_head, labels, logits_to_keep,
                       num_items_in_batch, ignore_index, shift_labels)


def _fused_loss(model, slot, output_class, outputs, hidden, lm_head, head, labels, logits_to_keep, num_items_in_batch,
                ignore_index, shift_labels):
    """The loss of `hidden` through `lm_head`'s weight by the fused kernel where it takes the call, else the
    logits by `head` and the model's loss_function."""
    weight = lm_head.weight

    def reference():
        return _finish_reference(model, output_class, outputs, hidden, head, labels, logits_to_keep, num_items_in_batch,
                                 ignore_index, shift_labels)
    if not _needs_grad(hidden, weight):
        _refuse(slot.sid, "neither the hidden states nor lm_head's weight need gradients")
        return reference()
    if getattr(lm_head, "bias", None) is not None or hidden.dtype != weight.dtype or hidden.numel() == 0:
        _refuse(slot.sid, "lm_head has a bias, its weight's dtype is not the hidden states', or no tokens")
        return reference()
    hidden2d = _contig(hidden).view(-1, hidden.shape[-1])
    targets = _shifted_targets(labels, ignore_index, shift_labels, hidden.device)
    reduction = "mean" if num_items_in_batch is None else "sum"
    softcap = float(getattr(model.config, "final_logit_softcapping", None) or 0.0)  # Gemma 2 / 3: cap * tanh(z / cap)
    dweight = weight.requires_grad
    traced = torch.compiler.is_compiling()
    desc = (_desc(hidden2d, traced), _desc(weight, traced, (0, 1)), _desc(targets, traced, ()), int(ignore_index),
            reduction, softcap, dweight)
    lid = _decide(slot.sid, True, "fused_linear_cross_entropy", desc, "lm_head")
    if lid < 0:
        return reference()
    try:
        loss = _invoke(_FLCE, True, traced, hidden2d, weight, targets, int(ignore_index), reduction, softcap, dweight,
                       lid, True)
    except kcpp.Unsupported as e:
        _refuse(slot.sid, str(e))
        return reference()
    if num_items_in_batch is not None:
        loss = loss / (num_items_in_batch.to(loss.device) if torch.is_tensor(num_items_in_batch) else num_items_in_batch)
    return _output(output_class, outputs, loss, None)


def _finish_reference(model, output_class, outputs, hidden, head, labels, logits_to_keep, num_items_in_batch,
                      ignore_index, shift_labels):
    """The rest of *ForCausalLM.forward as Transformers runs it, after the body has run once: the logits of
    `hidden` (the body's last hidden state) by `head` (lm_head), the soft cap, the loss."""
    keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
    logits = head(hidden[:, keep, :])
    softcap = getattr(model.config, "final_logit_softcapping", None)
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    loss = model.loss_function(logits=logits, labels=labels, vocab_size=model.config.vocab_size,
                               num_items_in_batch=num_items_in_batch, ignore_index=ignore_index,
                               shift_labels=shift_labels)
    return _output(output_class, outputs, loss, logits)


def _output(output_class, outputs, loss, logits):
    """*ForCausalLM's output from the body's `outputs`: the cache goes by the name the output classes have —
    `cache` since Transformers 5.24 (reading or passing `past_key_values` there warns of its deprecation),
    `past_key_values` before."""
    fields = getattr(output_class, "__dataclass_fields__", {})
    cache = {name: getattr(outputs, name, None) for name in ("cache", "past_key_values") if name in fields}
    return output_class(loss=loss, logits=logits, hidden_states=outputs.hidden_states, attentions=outputs.attentions,
                        **dict(list(cache.items())[:1]))


# ---- MultiScaleDeformableAttention/1 (Deformable DETR's sampling core) -------------------------------------------
#
# Transformers' MultiScaleDeformableAttention module (models/deformable_detr/modeling_deformable_detr.py, the
# class it marks use_kernel_forward_from_hub("MultiScaleDeformableAttention")) is the sampling step of every
# DeformableDetrMultiscaleDeformableAttention, the encoder's self-attention and the decoder's cross-attention:
#   forward(value [B, S, M, C], value_spatial_shapes [L, 2] int64, value_spatial_shapes_list [(H_l, W_l)] * L,
#           level_start_index [L] int64, sampling_locations [B, Q, M, L, P, 2], attention_weights [B, Q, M, L, P],
#           im2col_step) -> [B, Q, M*C]
# its maths grid_sample(bilinear, zero padding, align_corners=False) per level, the contract's.  kernelize
# swaps that forward.  The kernel reads the levels from the two index tensors (as Deformable DETR's original
# op does), the reference from the list; the model makes them from the same feature maps.  Forward saves
# nothing: backward reads the inputs again.

# The forward's arguments after self, as the modules checked here have them; a module named
# MultiScaleDeformableAttention with others is not swapped.
_MSDA_ARGUMENTS = ("value", "value_spatial_shapes", "value_spatial_shapes_list", "level_start_index",
                   "sampling_locations", "attention_weights", "im2col_step")


def _msda_build(value, shapes, starts, loc, weights, im2col_step, layer, training):
    b, _, m, c = value.shape
    return {"value": value, "value_spatial_shapes": shapes, "value_level_start_index": starts,
            "sampling_locations": loc, "attention_weights": weights, "im2col_step": im2col_step,
            "out": torch.empty((b, loc.shape[1], m * c), dtype=value.dtype, device=value.device)}


def _msda_setup(ctx, inputs, output):
    value, shapes, starts, loc, weights, im2col_step, layer, _training = inputs
    ctx.save_for_backward(value, shapes, starts, loc, weights)
    ctx.kcpp = (im2col_step, layer)
    ctx.set_materialize_grads(False)


def _msda_backward(ctx, eager, dout):
    if dout is None:
        return (None,) * 8
    value, shapes, starts, loc, weights = ctx.saved_tensors
    im2col_step, layer = ctx.kcpp
    dvalue, dloc, dweights = _call(_MSDA_BWD, eager, _contig(dout), value, shapes, starts, loc, weights, im2col_step,
                                   layer)
    return (dvalue if _needs(ctx, eager, 0) else None, None, None, dloc if _needs(ctx, eager, 3) else None,
            dweights if _needs(ctx, eager, 4) else None, None, None, None)


def _msda_bwd_build(dout, value, shapes, starts, loc, weights, im2col_step, layer):
    return {"dout": dout, "value": value, "value_spatial_shapes": shapes, "value_level_start_index": starts,
            "sampling_locations": loc, "attention_weights": weights, "im2col_step": im2col_step,
            "dvalue": torch.empty(value.shape, dtype=value.dtype, device=value.device),
            "dsampling_locations": torch.empty(loc.shape, dtype=loc.dtype, device=loc.device),
            "dattention_weights": torch.empty(weights.shape, dtype=weights.dtype, device=weights.device)}


_MSDA = _Op("multi_scale_deformable_attention", "(Tensor value, Tensor value_spatial_shapes, "
            "Tensor value_level_start_index, Tensor sampling_locations, Tensor attention_weights, int im2col_step, "
            "int layer, bool training) -> Tensor", _msda_build, lambda a, light: a["out"], result=lambda o: o,
            setup=_msda_setup, backward=_msda_backward)
_MSDA_BWD = _Op("multi_scale_deformable_attention_backward", "(Tensor dout, Tensor value, Tensor value_spatial_shapes, "
                "Tensor value_level_start_index, Tensor sampling_locations, Tensor attention_weights, int im2col_step, "
                "int layer) -> (Tensor, Tensor, Tensor)", _msda_bwd_build,
                lambda a, light: (a["dvalue"], a["dsampling_locations"], a["dattention_weights"]), backward_entry=True)


def _msda_missing(value, shapes, starts, loc, weights, im2col_step):
    """Why the bridge cannot hand this call to MultiScaleDeformableAttention/1 (None when it can)."""
    given = {"value": value, "value_spatial_shapes": shapes, "level_start_index": starts, "sampling_locations": loc,
             "attention_weights": weights}
    if not_tensors := [name for name, t in given.items() if not isinstance(t, torch.Tensor)]:
        return f"{', '.join(not_tensors)} not tensors: MultiScaleDeformableAttention/1 takes tensors"
    if value.dim() != 4 or loc.dim() != 6 or weights.dim() != 5:
        return (f"value {tuple(value.shape)}, sampling_locations {tuple(loc.shape)}, attention_weights "
                f"{tuple(weights.shape)}: MultiScaleDeformableAttention/1 takes [B, S, M, C], [B, Q, M, L, P, 2], "
                "[B, Q, M, L, P]")
    if loc.dtype != value.dtype or weights.dtype != value.dtype:
        return (f"value {value.dtype}, sampling_locations {loc.dtype}, attention_weights {weights.dtype}: "
                "MultiScaleDeformableAttention/1 takes one dtype")
    if shapes.dtype != torch.int64 or starts.dtype != torch.int64:
        return (f"value_spatial_shapes {shapes.dtype}, level_start_index {starts.dtype}: "
                "MultiScaleDeformableAttention/1 takes int64")
    if not isinstance(im2col_step, int):
        return f"im2col_step {im2col_step!r}: MultiScaleDeformableAttention/1 takes an int"
    if value.numel() == 0 or loc.numel() == 0:
        return _WHY_EMPTY
    return None


def _msda_forward(where, slot, original, value, value_spatial_shapes, value_spatial_shapes_list, level_start_index,
                  sampling_locations, attention_weights, im2col_step):
    """MultiScaleDeformableAttention.forward through the kernel where it takes the call, else the module's own."""
    def reference():
        return original(value, value_spatial_shapes, value_spatial_shapes_list, level_start_index, sampling_locations,
                        attention_weights, im2col_step)
    why = _msda_missing(value, value_spatial_shapes, level_start_index, sampling_locations, attention_weights,
                        im2col_step)
    if why is not None:
        _refuse(slot.sid, why)
        return reference()
    value, loc, weights = _contig(value), _contig(sampling_locations), _contig(attention_weights)
    shapes, starts = _contig(value_spatial_shapes), _contig(level_start_index)
    training = _needs_grad(value, loc, weights)
    traced = torch.compiler.is_compiling()
    # The token dimensions: batch, value rows (the images' size), queries; the others are the model's.
    desc = (_desc(value, traced, (2, 3)), _desc(shapes, traced, (0, 1)), _desc(starts, traced, (0,)),
            _desc(loc, traced, (2, 3, 4, 5)), _desc(weights, traced, (2, 3, 4)), im2col_step)
    return _kernel_or_reference(slot, training, traced, "multi_scale_deformable_attention", desc, where, _MSDA,
                                (value, shapes, starts, loc, weights, im2col_step), reference)


def _is_msda(m):
    """Whether `m` is a Transformers MultiScaleDeformableAttention module whose forward is the one checked here."""
    if type(m).__name__ != "MultiScaleDeformableAttention" or \
            not getattr(_modeling_module(m), "__name__", "").startswith("transformers.models."):
        return False
    try:
        names = tuple(inspect.signature(type(m).forward).parameters)[1:]
    except (TypeError, ValueError):
        return False
    return names == _MSDA_ARGUMENTS


def _swap_deformable(model, state):
    """Every MultiScaleDeformableAttention module of a Deformable DETR model through the slot's kernels."""
    slot = state.slots["MultiScaleDeformableAttention"]
    names = {m: n for n, m in model.named_modules()}
    hooked = []
    for module in model.modules():
        if not _is_msda(module):
            continue
        if _replaced_forward(module):
            hooked.append(names.get(module) or "model")
            continue
        slot.modules += 1
        if slot.kernels:
            _set_forward(state, module, functools.partial(_msda_forward, names.get(module) or "model", slot,
                                                          _own_forward(module)))
    _warn_hooked(hooked, stacklevel=5)  # kernelize -> _swap -> here


# ---- finding the layers -------------------------------------------------------------------------------------

def _modeling_module(module):
    return sys.modules.get(type(module).__module__)


def _is_gated_mlp(m):
    """The families' gated MLP: gate_proj, up_proj and down_proj modules (Linear, or a PEFT adapter around
    one: the swapped forward calls them, reading no weight) and act_fn."""
    return all(isinstance(m._modules.get(n), torch.nn.Module) for n in ("gate_proj", "up_proj", "down_proj")) \
        and hasattr(m, "act_fn")


def _is_packed_gated_mlp(m):
    """Phi-3's MLP: one gate_up_proj module of 2 I outputs, down_proj, activation_fn."""
    return all(isinstance(m._modules.get(n), torch.nn.Module) for n in ("gate_up_proj", "down_proj")) \
        and hasattr(m, "activation_fn")


def _is_attention(m):
    modeling = _modeling_module(m)
    return type(m).__name__.endswith("Attention") and callable(getattr(modeling, "apply_rotary_pos_emb", None)) \
        and getattr(modeling, "__name__", "").startswith("transformers.models.")


def _swap_experts(model, state):
    """A mixture-of-experts model's experts through the moe package: experts_implementation "kcpp" (Transformers'
    router still chooses; section "MoE/1 as Transformers' experts backend")."""
    config = getattr(model, "config", None)
    has_experts = any(isinstance(getattr(m, "gate_up_proj", None), torch.Tensor) and hasattr(m, "num_experts")
                      for m in model.modules())
    if not has_experts or not hasattr(config, "_experts_implementation"):
        return
    previous = config._experts_implementation
    config._experts_implementation = EXPERTS_NAME

    def undo():
        config._experts_implementation = previous
    state.restore.append(undo)


def _target(model):
    """The model kernelize works on: the model inside torch.nn.DataParallel or DistributedDataParallel
    (which call it), then a PEFT model's base model (get_peft_model wraps it; its adapters stay inside the
    base model's modules), else the model itself."""
    if isinstance(model, (torch.nn.DataParallel, torch.nn.parallel.DistributedDataParallel)):
        model = model.module
    base = getattr(model, "get_base_model", None)
    return base() if callable(base) else model


def _state_of(model):
    """kernelize's state of `model` (of its base model for a PEFT model), None if not kernelized."""
    return vars(_target(model)).get("_kcpp_state")


def _default_device(model):
    """Where `model` runs: the execution device of accelerate's hook on it (dispatch_model; its offloaded
    parameters are on the meta device until their module runs), else its first parameter's device that is
    not the meta device, else the meta device (no data yet) or, without parameters, the CPU."""
    execution = getattr(getattr(model, "_hf_hook", None), "execution_device", None)
    if execution is not None:
        return torch.device("cuda", execution) if isinstance(execution, int) else torch.device(execution)
    devices = [p.device for p in model.parameters()]
    return next((d for d in devices if d.type != "meta"), devices[0] if devices else torch.device("cpu"))


def _in_accelerate_hook(module):
    """Whether `module`'s forward is accelerate's hook around the module's own forward (add_hook_to_module,
    which dispatch_model uses for device_map="auto" over several devices and for CPU / disk offload): the
    hook moves the inputs to the module's execution device, loads offloaded weights, then calls
    `module._old_forward`, the forward it wrapped.  kernelize swaps that inner forward and keeps the hook."""
    return (getattr(module, "_hf_hook", None) is not None and "forward" in vars(module)
            and _is_own_forward(vars(module).get("_old_forward"), module))


def _is_own_forward(f, module):
    """Whether `f` is the module's own forward, bound to it (what accelerate's remove_hook_from_module leaves
    on the instance)."""
    return getattr(f, "__func__", None) is type(module).forward and getattr(f, "__self__", None) is module


def _replaced_forward(module):
    """Whether `module`'s forward is replaced on the instance by a wrapper kernelize does not know (neither
    accelerate's hook around the module's own forward nor that forward itself): kernelize leaves such a
    module as it is."""
    forward = vars(module).get("forward")
    return forward is not None and not _in_accelerate_hook(module) and not _is_own_forward(forward, module)


def _moves_only(module):
    """Whether the accelerate hook of `module` only moves tensors and loads weights (AlignDevicesHook,
    CpuOffload, a SequentialHook of those): the fused loss may run inside lm_head's hook, which then passes
    on the model's output instead of lm_head's logits.  Another ModelHook may transform lm_head's output."""
    hook = getattr(module, "_hf_hook", None)
    hooks = getattr(hook, "hooks", None) if type(hook).__name__ == "SequentialHook" else (hook,)
    return bool(hooks) and all(type(h).__name__ in ("AlignDevicesHook", "CpuOffload")
                               and type(h).__module__.startswith("accelerate.") for h in hooks)


def _forward_attribute(module):
    """The attribute that holds the forward kernelize swaps: accelerate's `_old_forward` inside its hook,
    else `forward`."""
    return "_old_forward" if _in_accelerate_hook(module) else "forward"


def _own_forward(module):
    """The module's own forward, bound: what a swapped forward falls back to."""
    return type(module).forward.__get__(module)


class _SwappedForward:
    """A swapped forward bound to its module, as the class's own forward is: called with the module's
    arguments, it calls `forward`; `__func__` (a function of the module and those arguments) and `__self__`
    (the module) are what frameworks that wrap a model's forward take apart and bind again (accelerate's
    mixed-precision `prepare` wraps `forward.__func__` and binds the wrapper; `unwrap_model(
    keep_fp32_wrapper=False)` binds the innermost function back).  A plain callable there would be bound as
    a method and receive the model as its first argument.  `__signature__` is what inspect.signature
    answers.  Like the rest of kernelize's state it refuses deep copies and pickling (a copy of the module
    would run the original module's forward), and `__func__` refuses a module other than its own (a copy
    made of a forward bound again)."""
    __slots__ = ("__func__", "__self__", "__signature__", "_kcpp_forward")

    def __init__(self, func, module, signature, forward):
        self.__func__, self.__self__, self.__signature__, self._kcpp_forward = func, module, signature, forward

    def __call__(self, *args, **kwargs):
        return self._kcpp_forward(*args, **kwargs)

    def __deepcopy__(self, memo):
        raise TypeError(_NO_COPY)

    def __reduce__(self):
        raise TypeError(_NO_COPY)


def _rebound(forward, module, replica):
    """`forward` (a functools.partial of one of the swapped forwards) for `replica` instead of `module`: the
    arguments naming the module name the replica, and the module's own forward is the replica's."""
    def swap(a):
        return replica if a is module else _own_forward(replica) if _is_own_forward(a, module) else a
    return functools.partial(forward.func, *map(swap, forward.args), **{k: swap(v) for k, v in forward.keywords.items()})


def _signatures(module, forward):
    """(what inspect.signature answers for the swapped forward, the same with a leading `self` for its
    `__func__`), or (None, None): the module's own forward's where `forward` takes any call (*args,
    **kwargs: the model's), else `forward`'s.  Frameworks read it (Transformers' Trainer keeps only the
    dataset columns model.forward names; (*args, labels, **kwargs) made it drop input_ids)."""
    try:
        signature = inspect.signature(forward)
        kinds = {p.kind for p in signature.parameters.values()}
        if {inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD} <= kinds:
            signature = inspect.signature(_own_forward(module))
    except (TypeError, ValueError):  # no signature to keep (a builtin)
        return None, None
    self_ = inspect.Parameter("self", inspect.Parameter.POSITIONAL_ONLY)
    return signature, signature.replace(parameters=[self_, *signature.parameters.values()])


def _bind(module, attribute, forward, signatures):
    """`forward` bound to `module` as its `attribute` (_SwappedForward, answering `signatures`, _signatures);
    returns what was set."""
    def func(self, *args, **kwargs):
        if self is not module:
            raise TypeError(_NO_COPY)
        return forward(*args, **kwargs)

    if signatures[1] is not None:
        func.__signature__ = signatures[1]
    func.__name__ = func.__qualname__ = "forward"
    bound = _SwappedForward(func, module, signatures[0], forward)
    setattr(module, attribute, bound)
    return bound


def _set_forward(state, module, forward):
    """Installs `forward` (a callable of the module's arguments) as `module.forward` (as the `_old_forward`
    inside accelerate's hook, _in_accelerate_hook) bound to the module (_SwappedForward, _bind), undone by
    state.restore."""
    attribute = _forward_attribute(module)
    had = attribute in module.__dict__
    previous = module.__dict__.get(attribute)

    signatures = _signatures(module, forward)
    bound = _bind(module, attribute, forward, signatures)
    if attribute == "forward" and isinstance(forward, functools.partial):
        # torch.nn.DataParallel's replicas (made at every call) copy the module's __dict__, this forward with
        # it, which would run the module (its weights on the first GPU) instead of the replica: each replica
        # gets it bound anew.
        def replicate_for_data_parallel():
            replica = type(module)._replicate_for_data_parallel(module)
            _bind(replica, "forward", _rebound(forward, module, replica), signatures)
            del replica._replicate_for_data_parallel  # the module's, copied with its __dict__
            return replica
        module._replicate_for_data_parallel = replicate_for_data_parallel

    def undo():
        d = vars(module)
        d.pop("_replicate_for_data_parallel", None)
        if d.get(attribute) is bound:
            if had:
                setattr(module, attribute, previous)
            else:
                delattr(module, attribute)
        elif d.get("_old_forward") is bound:
            # a hook added after kernelize (dispatch_model) wraps the swapped forward: it gets the module's own
            module._old_forward = _own_forward(module)
        elif d.get("forward") is bound:
            # accelerate's remove_hook_from_module made the swapped inner forward the module's forward
            del module.forward
        # else another wrapper replaced it since: left as it is, with what it wraps
    state.restore.append(undo)


# ---- the config ---------------------------------------------------------------------------------------------

# Liger's switches (the arguments of its apply_liger_kernel_to_<model>) for the model types here: the
# gated MLP's is `geglu` for Gemma and `swiglu` for the others; a switch the model's function does not
# take is ignored, as Liger's _apply_liger_kernel_to_instance filters them by the function's signature.
_LIGER_DEFAULTS = {"rope": True, "cross_entropy": False, "fused_linear_cross_entropy": True, "rms_norm": True}


def _liger_switches(model_type, liger_kernel_config):
    """(the switches for the C++ liger_kernel_config, a note on the switches ignored) under Liger's rules."""
    glu = "geglu" if model_type in ("gemma", "gemma2", "gemma3_text") else "swiglu"
    given = dict(liger_kernel_config or {})
    if not all(isinstance(k, str) for k in given):
        raise TypeError(f"liger_kernel_config: expected a dict of switch names, got {liger_kernel_config!r}")
    taken = {**_LIGER_DEFAULTS, glu: True}
    ignored = sorted(k for k in given if k not in taken)
    for k in taken:
        if k in given:
            v = given[k]
            if not isinstance(v, bool):
                raise TypeError(f"liger_kernel_config[{k!r}]: expected True or False, got {v!r}")
            taken[k] = v
    if taken["cross_entropy"] and taken["fused_linear_cross_entropy"]:
        raise ValueError("liger_kernel_config: cross_entropy and fused_linear_cross_entropy cannot both be True "
                         "(fused_linear_cross_entropy is on unless set to False), as in Liger")
    switches = {"rope": taken["rope"], "rms_norm": taken["rms_norm"], "swiglu": taken[glu],
                "cross_entropy": taken["cross_entropy"],
                "fused_linear_cross_entropy": taken["fused_linear_cross_entropy"]}
    note = f"liger_kernel_config: {', '.join(ignored)} not switches of {model_type} (ignored, as Liger)" \
        if ignored else ""
    return switches, note


def _kernel_config(model_type, kernel_config, use_liger_kernel, liger_kernel_config, attention, allow_all_kernels):
    """(kcpp.KernelConfig or None, hub options, a note for the report) for kernelize's arguments."""
    if kernel_config is not None:
        if isinstance(kernel_config, _core.KernelConfig):
            return kernel_config, {"allow_all_kernels": allow_all_kernels}, ""
        mapping, local = kernel_config, False
        if hasattr(kernel_config, "kernel_mapping"):  # Transformers' KernelConfig
            mapping, local = kernel_config.kernel_mapping, bool(getattr(kernel_config, "use_local_kernel", False))
        if not isinstance(mapping, dict):
            raise TypeError(f"kernel_config: expected a dict kernel_mapping, a transformers.KernelConfig or a "
                            f"kcpp.KernelConfig, got {type(kernel_config).__name__}")
        return _core.KernelConfig(json.dumps(mapping), local), {"allow_all_kernels": allow_all_kernels}, ""
    if model_type in _DEFORMABLE_MODEL_TYPES:  # no Liger layers: this build's deformable_attention
        folder = kcpp.local_packages().get("deformable_attention")
        if folder is None:
            raise kcpp.KcppError("kernelize: this kcpp has no built deformable_attention package "
                                 "(kcpp.local_packages() has none); pass kernel_config, or set KCPP_PACKAGES_DIR to a "
                                 "build's kernels/ folder")
        mapping = {"MultiScaleDeformableAttention": f"{folder}:MultiScaleDeformableAttention"}
        note = f"liger_kernel_config: not read ({model_type} has no Liger layers)" if liger_kernel_config else ""
        return _core.KernelConfig(json.dumps(mapping), True), {"allow_all_kernels": True}, note
    if not use_liger_kernel:
        return None, {}, ""
    switches, note = _liger_switches(model_type, liger_kernel_config)
    packages = kcpp.local_packages()
    liger = packages.get("liger")
    if liger is None:
        raise kcpp.KcppError("use_liger_kernel: this kcpp has no built liger package (kcpp.local_packages() is empty); "
                             "pass kernel_config, or set KCPP_PACKAGES_DIR to a build's kernels/ folder")
    flash = packages.get("flash_attn", "") if attention else ""
    config = _core.liger_kernel_config(json.dumps(switches), liger, True, f"{flash}:FlashAttention" if flash else "")
    # This build's own packages (unsigned, as every local build's): loaded as `kcpp train` loads them.
    return config, {"allow_all_kernels": True}, note


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
            try:  # the C++ hub: resolution, hashes, signatures, trust, lock file
                loaded[ref] = hub.load(ref)
            except kcpp.KcppError as e:
                raise type(e)(f"kernelize: {slot.layer_name} ({slot.contract}) -> {ref}: {e}") from None
        package = loaded[ref]
        try:
            layer = package.layer(package.default_layer) if package.default_layer else package.layer_by_contract(slot.contract)
        except KeyError as e:
            raise kcpp.KcppError(f"kernelize: {slot.layer_name} ({slot.contract}) -> {ref}: {e.args[0]}; name a package "
                                 f"that implements {slot.contract}, or a layer of it as {ref}:LAYER") from None
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
        slot.add_kernel(mode, layer)
        reasons.append(f"{mode}: {package.name} {package.version}: {layer.name} ({layer.contract})")
    slot.reason = "; ".join(reasons)


# ---- the API ----------------------------------------------------------------------------------------------

def kernelize(model, mode=None, kernel_config=None, use_liger_kernel=True, liger_kernel_config=None, device=None,
              allow_all_kernels=False, hub=None, attention=True):
    """Swaps the layers of a Transformers causal-LM `model` (Llama, Mistral, Qwen2, Qwen3, Phi-3, Gemma 1 /
    2 / 3 text, Mixtral, Qwen2-MoE, Qwen3-MoE), or the MultiScaleDeformableAttention modules of a Deformable
    DETR (DeformableDetrModel, DeformableDetrForObjectDetection), for kernels, in place; returns the model.

    mode: "training", "inference", or None (both: each call picks by whether autograd needs it).
    kernel_config: Transformers' kernel_mapping (a dict, a transformers.KernelConfig, or a
      kcpp.KernelConfig); None: `use_liger_kernel` with `liger_kernel_config` over this build's liger
      package, as Transformers' Trainer passes them to Liger's _apply_liger_kernel_to_instance: the
      switches rope, rms_norm, swiglu (geglu for Gemma), cross_entropy, fused_linear_cross_entropy,
      Liger's defaults for those not given (cross_entropy off, the others on), a switch the model
      type does not have ignored, cross_entropy with fused_linear_cross_entropy an error.  For a
      Deformable DETR, which has no Liger layers, None is this build's deformable_attention package
      (use_liger_kernel, liger_kernel_config and attention do not apply).
    attention: with use_liger_kernel, also this build's flash_attn for the attention, selected as
      attn_implementation="kcpp" (unkernelize restores the model's).  A kernel_config maps
      "Attention" itself.
    device: where the model runs (default: its parameters' device).
    allow_all_kernels: load unsigned packages and packages of untrusted publishers named by
      kernel_config (this build's own packages always load).
    hub: a kcpp.Hub to load through (default: one from the environment with allow_all_kernels)."""
    if _state_of(model) is not None:
        unkernelize(model)
    if mode not in (None, "training", "inference"):
        raise ValueError(f"mode must be 'training', 'inference' or None, is {mode!r}")
    modes = _MODES if mode is None else (mode,)
    device = torch.device(_default_device(model) if device is None else device)
    if device.type == "meta":
        raise ValueError("kcpp.torch.kernelize: the model is on the meta device (no data yet): pass the device it will "
                         "run on (device='cuda' or 'cpu'), or kernelize after its weights are loaded (to_empty / "
                         "from_pretrained)")
    model_type = getattr(getattr(_target(model), "config", None), "model_type", None)
    config, hub_options, note = _kernel_config(model_type, kernel_config, use_liger_kernel, liger_kernel_config,
                                               attention, allow_all_kernels)

    state = _State()
    for name, contract in (_DEFORMABLE_CONTRACTS if model_type in _DEFORMABLE_MODEL_TYPES else _CONTRACTS).items():
        state.slots[name] = _Slot(name, contract)
    if kernel_config is not None and config is not None:  # the user's mapping: a layer it names that no slot takes
        unused = [layer for layer in config.layers if layer not in state.slots]
        if unused:
            warnings.warn(f"kcpp.torch.kernelize: kernel_config maps {', '.join(unused)}, which kcpp.torch does not swap "
                          f"in this model (it swaps {', '.join(state.slots)}); those entries are unused", stacklevel=2)
    try:
        if config is not None:
            hub = hub if hub is not None else kcpp.Hub(**hub_options)
            loaded = {}
            for slot in state.slots.values():
                _load_slot(slot, config, hub, loaded, modes, device)
                if note:
                    slot.reason += f"; {note}"
        else:
            for slot in state.slots.values():
                slot.reason = "no kernel config (use_liger_kernel=False)"
        _swap(model, state)
    except BaseException:
        for undo in reversed(state.restore):
            undo()
        for slot in state.slots.values():
            slot.release()
        raise
    object.__setattr__(_target(model), "_kcpp_state", state)
    return model


def _swap(model, state):
    slots = state.slots
    # A PEFT model (get_peft_model): its base model's layers and loss, the adapters inside them called as
    # they are.
    model = _target(model)
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type in _DEFORMABLE_MODEL_TYPES:
        _swap_deformable(model, state)
        return
    if model_type not in _MODEL_TYPES:
        for slot in slots.values():
            slot.release()
            slot.reason = (f"model type {model_type!r}: kcpp.torch kernelizes {', '.join(_MODEL_TYPES)}, "
                           f"{', '.join(_DEFORMABLE_MODEL_TYPES)} (their modeling code is what its swaps were checked "
                           "against)")
        return
    names = {m: n for n, m in model.named_modules()}
    patched_modeling = set()
    attention_modules = []
    # A module inside accelerate's device hook (device_map over several devices, CPU / disk offload) gets its
    # inner forward swapped, the hook kept; one whose forward another wrapper replaced on the instance is
    # left as it is: a swapped forward would run without that wrapper.
    hooked = []
    for module in model.modules():
        where = names.get(module, type(module).__name__) or "model"
        if _replaced_forward(module):
            if _rms_norm_spec(module) is not None or _is_gated_mlp(module) or _is_packed_gated_mlp(module) \
                    or _is_attention(module):
                hooked.append(where)
            continue
        spec = _rms_norm_spec(module)
        if spec is not None:
            slots["RMSNorm"].modules += 1
            if slots["RMSNorm"].kernels:
                original = _own_forward(module)
                _set_forward(state, module, functools.partial(_rms_norm_forward, where, module, slots["RMSNorm"],
                                                              original, spec))
        elif _is_gated_mlp(module):
            slots["MLP"].modules += 1
            if slots["MLP"].kernels:
                original = _own_forward(module)
                _set_forward(state, module, functools.partial(_mlp_forward, where, module, slots["MLP"], original,
                                                              _glu_activation(module)))
        elif _is_packed_gated_mlp(module):
            slots["MLP"].modules += 1
            if slots["MLP"].kernels:
                original = _own_forward(module)
                _set_forward(state, module, functools.partial(_packed_mlp_forward, where, module, slots["MLP"], original,
                                                              _glu_activation(module)))
        elif _is_attention(module):
            attention_modules.append(module)
            slots["rotary_pos_emb"].modules += 1
            if slots["rotary_pos_emb"].kernels:
                modeling = _modeling_module(module)
                if modeling.__name__ not in patched_modeling:
                    patched_modeling.add(modeling.__name__)
                    # Undone by unkernelize, or when the model is collected without it.
                    state.restore.append(weakref.finalize(model, _patch_rope(modeling)))
                original = _own_forward(module)
                _set_forward(state, module, functools.partial(_attention_module_forward, slots["rotary_pos_emb"],
                                                              original))
    _swap_attention(model, state, attention_modules)
    _swap_experts(model, state)
    is_causal_lm = hasattr(model, "lm_head") and hasattr(model, "model") and hasattr(type(model), "loss_function")
    for name in ("CrossEntropyLoss", "ForCausalLMLoss"):
        slots[name].modules = 1 if is_causal_lm else 0
    if not is_causal_lm:
        _warn_hooked(hooked)
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
    if flce.kernels and _replaced_forward(model):
        hooked.append("the model (its loss fused with lm_head)")
    elif flce.kernels:
        from transformers.modeling_outputs import CausalLMOutputWithPast
        original = _own_forward(model)
        names = [p for p in inspect.signature(original).parameters]
        _set_forward(state, model, functools.partial(_causal_lm_forward, model, flce, original, names,
                                                     CausalLMOutputWithPast, "training" in flce.ids))
    _warn_hooked(hooked)


def _warn_hooked(hooked, stacklevel=4):
    """Says which modules kernelize left as they are because their forward is replaced on the instance
    (`stacklevel`: the caller of kernelize, from the function that calls this)."""
    if hooked:
        warnings.warn(f"kcpp.torch.kernelize: {len(hooked)} module(s) have a forward replaced on the instance "
                      f"by a wrapper other than accelerate's device hook, and keep it, without kernels: "
                      f"{', '.join(hooked[:6])}{' ...' if len(hooked) > 6 else ''}", stacklevel=stacklevel)


def _swap_attention(model, state, modules):
    """Links the attention modules to the model's Attention kernels and selects "kcpp"."""
    slot = state.slots["Attention"]
    slot.modules = len(modules)
    if not slot.kernels or not modules:
        return
    config = model.config
    previous = config._attn_implementation
    can = getattr(model, "_can_set_attn_implementation", lambda: True)()
    if not can:
        slot.release()
        slot.reason = f"{type(model).__name__} cannot change its attention implementation (keeps {previous!r})"
        return
    # The fallback: the implementation the model had (SDPA for one that had "kcpp" or another).
    reference = previous if previous in ("eager", "sdpa") else ("sdpa" if getattr(model, "_supports_sdpa", True)
                                                                else "eager")
    names = {m: n for n, m in model.named_modules()}
    for module in modules:
        module._kcpp_attention = (slot, names.get(module, type(module).__name__), reference)

        def unlink(module=module):
            module.__dict__.pop("_kcpp_attention", None)
        state.restore.append(unlink)
    if previous != ATTENTION_NAME:
        model.set_attn_implementation(ATTENTION_NAME)
        state.restore.append(lambda: model.set_attn_implementation(previous))
    slot.reason += f"; attn_implementation {previous!r} -> {ATTENTION_NAME!r}"


def unkernelize(model):
    """Restores every forward, function, loss and attention implementation kernelize swapped; the model is
    as it was."""
    state = _state_of(model)
    if state is None:
        return model
    for undo in reversed(state.restore):
        undo()
    for slot in state.slots.values():
        slot.release()
    object.__delattr__(_target(model), "_kcpp_state")
    return model


def _entry(s, kernels):
    return {"layer": s.layer_name, "contract": s.contract, "modules": s.modules, "kernel": ", ".join(kernels),
            "reason": s.reason, "kernel_calls": s.kernel_calls, "reference_calls": s.reference_calls,
            "fallbacks": s.fallbacks, "last_refusal": s.last_refusal}


def report(model):
    """What each layer name got and its calls since kernelize (a Report; str() prints it).  A model that
    selects "kcpp" without kernelize reports the process's default Attention kernels."""
    state = _state_of(model)
    if state is None:
        if getattr(getattr(model, "config", None), "_attn_implementation", None) == ATTENTION_NAME:
            s = _DEFAULT_ATTENTION
            kernels = sorted({f"{k.package_name} {k.package_version}: {k.name} ({k.contract})" for k in s.kernels.values()})
            return Report([_entry(s, kernels)])
        return Report([])
    entries = []
    for s in state.slots.values():
        kernels = sorted({f"{k.package_name} {k.package_version}: {k.name} ({k.contract})" for k in s.kernels.values()})
        entries.append(_entry(s, kernels))
    return Report(entries)
