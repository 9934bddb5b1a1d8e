"""kcpp's second bridge to a package's C ABI (include/kcpp/abi.h): `ctypes` alone, no compiled code.

`import kcpp` uses it where the extension kcpp._core is not built (a source tree without
`pip install .`): it opens a package library file as it is, with no hub and no verification, and
calls its layers the way the extension does.  It is also the baseline the extension's per-call host
overhead is measured against (python/tests/test_hub.py).  A package is one shared library exporting
`kcpp_package_v1`; its layers and ops take named arguments whose tensors are DLPack `DLTensor`s, so
one package binary serves PyTorch, NumPy, JAX or CuPy: a tensor is anything with `__dlpack__` /
`__dlpack_device__` (the Python array API's DLPack protocol).

    from kcpp import _ctypes
    liger = _ctypes.Package("build/release/kernels/liger/build/kcpp1-cu130-x86_64-linux/libliger.so")
    rms = liger.layer("LigerRMSNorm")
    y, rstd = torch.empty_like(x), torch.empty(x.shape[0], device=x.device)
    rms.forward({"x": x, "weight": w, "eps": 1e-6, "y": y, "rstd": rstd}, mode="training")

What the bridge does, per call:
- arguments: a PyTorch tensor is described from its metadata (data pointer, shape, strides, dtype,
  device), any other tensor exported with `__dlpack__` (a legacy "dltensor" capsule, kept alive for
  the call); outputs are written in place, so they must be writable views; None is "not given",
  bool / int / float / str map to the ABI's INT / FLOAT / STRING kinds;
- the stream: for CUDA tensors from PyTorch the current stream of their device (the exporter is told
  it is the consumer's stream, so PyTorch inserts no synchronisation), or the `stream=` given;
- the device: for CUDA tensors from PyTorch their device is made current for the call (packages launch
  on the current device); with other frameworks' tensors the caller keeps their device current;
- the workspace (scratch memory a kernel asks the host for): PyTorch's caching allocator for CUDA
  tensors (freed after the call in stream order, as the ABI requires), host memory for CPU tensors;
- a status other than KCPP_OK raises `InvalidArgument` (also a ValueError), `Unsupported` or
  `KcppError` with the package's message.

Nothing here holds state between calls but the loaded library; a `Package` is safe to share between
threads as far as the package itself is (kernels.cpp's are: they keep no state).
"""
import contextlib
import ctypes
import threading
from ctypes import (CFUNCTYPE, POINTER, Structure, Union, c_char, c_char_p, c_double, c_int, c_int32,
                    c_int64, c_size_t, c_uint8, c_uint16, c_uint32, c_uint64, c_void_p)

ABI_VERSION = 1
PACKAGE_SYMBOL = "kcpp_package_v1"

MODE_INFERENCE, MODE_TRAINING, MODE_GRAPH = 1, 2, 4
_MODES = {"inference": MODE_INFERENCE, "training": MODE_TRAINING}

OK, INVALID_ARGUMENT, UNSUPPORTED, OUT_OF_MEMORY, RUNTIME = 0, 1, 2, 3, 4

DL_CPU, DL_CUDA = 1, 2
_ARG_NONE, _ARG_TENSOR, _ARG_INT, _ARG_FLOAT, _ARG_STRING = 0, 1, 2, 3, 4


# ---- the ABI's structs, field for field -----------------------------------------------------------

class DLDevice(Structure):
    _fields_ = [("device_type", c_int32), ("device_id", c_int32)]


class DLDataType(Structure):
    _fields_ = [("code", c_uint8), ("bits", c_uint8), ("lanes", c_uint16)]


class DLTensor(Structure):
    _fields_ = [("data", c_void_p), ("device", DLDevice), ("ndim", c_int32), ("dtype", DLDataType),
                ("shape", POINTER(c_int64)), ("strides", POINTER(c_int64)), ("byte_offset", c_uint64)]


class _ArgValue(Union):
    _fields_ = [("tensor", c_void_p),  # a DLTensor*, set from an address
                 ("i", c_int64), ("f", c_double), ("s", c_char_p)]


class Arg(Structure):
    _fields_ = [("name", c_char_p), ("kind", c_int32), ("reserved", c_int32), ("value", _ArgValue)]


WorkspaceFn = CFUNCTYPE(c_void_p, c_void_p, c_size_t)


class Context(Structure):
    _fields_ = [("struct_size", c_uint32), ("mode", c_uint32), ("device", DLDevice), ("stream", c_void_p),
                ("deterministic", c_int32), ("reserved", c_int32), ("workspace", WorkspaceFn),
                ("workspace_host", c_void_p), ("error", POINTER(c_char)), ("error_size", c_size_t)]


EntryFn = CFUNCTYPE(c_int, POINTER(Context), POINTER(Arg), c_int32)


class _Layer(Structure):
    _fields_ = [("struct_size", c_uint32), ("modes", c_uint32), ("devices", c_uint32), ("reserved", c_uint32),
                ("name", c_char_p), ("contract", c_char_p), ("doc", c_char_p),
                ("supports", EntryFn), ("forward", EntryFn), ("backward", EntryFn)]


class _Op(Structure):
    _fields_ = [("struct_size", c_uint32), ("devices", c_uint32), ("name", c_char_p), ("doc", c_char_p),
                ("call", EntryFn)]


class _Package(Structure):
    _fields_ = [("struct_size", c_uint32), ("abi_version", c_uint32), ("name", c_char_p), ("version", c_char_p),
                ("layers", POINTER(_Layer)), ("num_layers", c_int32), ("num_ops", c_int32), ("ops", POINTER(_Op))]


# ---- errors -----------------------------------------------------------------------------------------

from ._errors import InvalidArgument, KcppError, Unsupported  # noqa: E402


def _raise(where, status, message):
    cls = {INVALID_ARGUMENT: InvalidArgument, UNSUPPORTED: Unsupported}.get(status, KcppError)
    raise cls(where, status, message)


# ---- tensors through DLPack ---------------------------------------------------------------------------

_capsule_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_capsule_pointer.restype = c_void_p
_capsule_pointer.argtypes = [ctypes.py_object, c_char_p]


def _is_torch(obj):
    return type(obj).__module__.split(".", 1)[0] == "torch"


def _device_of(obj):
    device_type, device_id = obj.__dlpack_device__()
    return int(device_type), int(device_id)


def _torch_stream(device_id):
    import torch
    return torch.cuda.current_stream(device_id).cuda_stream


def _current_device(device, torch_tensors):
    """The call's CUDA device made current while it runs (PyTorch's tensors: PyTorch keeps cuda:0 current
    for a model on cuda:1); nothing to do otherwise."""
    if device[0] == DL_CUDA and torch_tensors:
        import torch
        return torch.cuda.device(device[1])
    return contextlib.nullcontext()


# PyTorch dtypes as DLPack (code, bits): kDLInt 0, kDLUInt 1, kDLFloat 2, kDLBfloat 4, kDLBool 6.
_TORCH_DTYPES = {"float32": (2, 32), "bfloat16": (4, 16), "float16": (2, 16), "float64": (2, 64),
                 "int64": (0, 64), "int32": (0, 32), "int16": (0, 16), "int8": (0, 8), "uint8": (1, 8),
                 "bool": (6, 8)}
_TORCH_DEVICES = {"cpu": DL_CPU, "cuda": DL_CUDA}


def _describe_torch(t, keep):
    """The DLTensor of a PyTorch tensor, written here from its metadata: what its __dlpack__ would
    say, without the capsule and the exporter's stream handshake.  Through __dlpack__ the bridge's
    calls cost more host time than the kernels they feed (H200 machine, RMSNorm forward + backward
    at [8192, 4096]: 0.155 ms timed with the GPU waiting on the host, 0.108 ms this way, the
    kernels' own time).  None where this path does not apply."""
    code_bits = _TORCH_DTYPES.get(str(t.dtype)[6:])  # "torch.bfloat16" -> "bfloat16"
    device_type = _TORCH_DEVICES.get(t.device.type)
    if code_bits is None or device_type is None or t.is_conj() or t.is_neg():
        return None  # __dlpack__ then exports it, or says why it cannot
    nd = t.dim()
    shape, strides = (c_int64 * nd)(*t.shape), (c_int64 * nd)(*t.stride())
    d = DLTensor(t.data_ptr(), DLDevice(device_type, t.device.index or 0), nd, DLDataType(code_bits[0], code_bits[1], 1),
                 shape, strides, 0)
    keep.append((d, shape, strides))
    return ctypes.addressof(d)


def _export(obj, device, stream):
    """A (capsule, DLTensor pointer) pair for `obj`; the pointer is valid while the capsule lives."""
    if device[0] == DL_CUDA:
        # DLPack's stream convention for CUDA: 1 is the legacy default stream, 0 is not allowed.
        capsule = obj.__dlpack__(stream=stream if stream else 1)
    else:
        capsule = obj.__dlpack__()
    # A legacy capsule holds a DLManagedTensor, whose first member is the DLTensor.
    return capsule, _capsule_pointer(capsule, b"dltensor")


class _Workspace:
    """The context's allocator for one call: memory that stays valid until the call's work is done."""

    def __init__(self):
        self.device, self.torch, self.stream, self.blocks = (DL_CPU, 0), False, None, []

    def allocate(self, nbytes):
        if self.device[0] == DL_CUDA:
            if not self.torch:
                return None  # without PyTorch there is no stream-ordered allocator here
            import torch
            block = torch.empty(max(nbytes, 1), dtype=torch.uint8, device=f"cuda:{self.device[1]}")
            self.blocks.append(block)
            return block.data_ptr()
        block = ctypes.create_string_buffer(max(nbytes, 1) + 255)
        self.blocks.append(block)
        return (ctypes.addressof(block) + 255) & ~255  # the ABI promises 256-byte alignment

    def release(self):
        """Back to the allocator.  PyTorch's reuses a block in the order of the stream it was taken
        on (the current one); a kernel queued on another stream must be waited for first."""
        if self.torch and self.device[0] == DL_CUDA and self.blocks:
            import torch
            if self.stream != torch.cuda.current_stream(self.device[1]).cuda_stream:
                other = torch.cuda.ExternalStream(self.stream, device=self.device[1])
                for block in self.blocks:
                    block.record_stream(other)
        self.blocks = []


class _State(threading.local):
    """Per thread: the context, its error buffer and the workspace of the call in progress (one
    callback for all calls: making a ctypes callback costs more than the rest of a call)."""

    def __init__(self):
        self.workspace = _Workspace()
        self.error = ctypes.create_string_buffer(1024)
        self.ctx = Context(struct_size=ctypes.sizeof(Context), workspace=_workspace_fn, workspace_host=None,
                           error=ctypes.cast(self.error, POINTER(c_char)), error_size=len(self.error))
        self.busy = False


def _allocate(_host, nbytes):
    try:
        return _state.workspace.allocate(nbytes)
    except Exception:  # an exception must not unwind through C: NULL is the ABI's "out of memory"
        return None


_workspace_fn = WorkspaceFn(_allocate)
_no_workspace = WorkspaceFn()  # NULL: a kernel that needs one says so (UNSUPPORTED), naming the bytes
_state = _State()


def _call(where, entry, args, mode, deterministic, stream):
    if not entry:
        raise Unsupported(where, UNSUPPORTED, "the package has no such entry point")
    # "inference", "training", or the KCPP_MODE_* bits themselves (e.g. MODE_TRAINING | MODE_GRAPH).
    mode_bits = _MODES.get(mode) if isinstance(mode, str) else mode
    if not isinstance(mode_bits, int) or isinstance(mode_bits, bool):
        raise ValueError(f"{where}: mode must be 'inference', 'training' or KCPP_MODE_* bits, is {mode!r}")
    keep = []  # capsules and encoded strings alive until the call returns
    array = (Arg * max(len(args), 1))()
    device, torch_tensors = (DL_CPU, 0), False
    # The device and stream come from the first tensor; the package checks that the rest agree.
    for value in args.values():
        if hasattr(value, "__dlpack__"):
            device, torch_tensors = _device_of(value), _is_torch(value)
            break
    if stream is None and device[0] == DL_CUDA and torch_tensors:
        stream = _torch_stream(device[1])
    for i, (name, value) in enumerate(args.items()):
        a = array[i]
        encoded = name.encode()
        keep.append(encoded)
        a.name = encoded
        if value is None:
            a.kind = _ARG_NONE
        elif hasattr(value, "__dlpack__"):
            pointer = _describe_torch(value, keep) if torch_tensors and _is_torch(value) else None
            if pointer is None:
                capsule, pointer = _export(value, _device_of(value), stream)
                keep.append(capsule)
            a.kind, a.value.tensor = _ARG_TENSOR, pointer
        elif isinstance(value, bool) or isinstance(value, int):
            a.kind, a.value.i = _ARG_INT, int(value)
        elif isinstance(value, float):
            a.kind, a.value.f = _ARG_FLOAT, value
        elif isinstance(value, str):
            s = value.encode()
            keep.append(s)
            a.kind, a.value.s = _ARG_STRING, s
        else:
            raise TypeError(f"{where}: argument '{name}' is a {type(value).__name__}; expected a tensor with "
                            "__dlpack__, None, bool, int, float or str")
    state = _state
    if state.busy:  # a workspace callback calling back into a package: not something the ABI has
        raise RuntimeError(f"{where}: called from inside another kcpp call on this thread")
    ctx, workspace = state.ctx, state.workspace
    # GPU memory for the workspace comes from PyTorch's allocator; without PyTorch there is none.
    ctx.workspace = _workspace_fn if device[0] != DL_CUDA or torch_tensors else _no_workspace
    ctx.mode, ctx.device.device_type, ctx.device.device_id = mode_bits, device[0], device[1]
    ctx.stream, ctx.deterministic = stream or None, 1 if deterministic else 0
    workspace.device, workspace.torch, workspace.stream = device, torch_tensors, stream
    state.busy = True
    try:
        with _current_device(device, torch_tensors):
            status = entry(ctypes.byref(ctx), array, len(args))
    finally:
        state.busy = False
        workspace.release()
        del keep
    if status != OK:
        _raise(where, status, state.error.value.decode(errors="replace"))


class _Entry:
    def __init__(self, package, name):
        self.package, self.name = package, name

    def __repr__(self):
        return f"<kcpp {type(self).__name__.lower()} {self.package.name}:{self.name}>"


class Layer(_Entry):
    """One layer of a package: `supports`, `forward` and `backward` over a dict of named arguments."""

    def __init__(self, package, table):
        super().__init__(package, table.name.decode())
        self.contract = table.contract.decode()
        self.doc = (table.doc or b"").decode()
        self.modes, self.devices = table.modes, table.devices
        # Read once: each read of a function-pointer field makes a new ctypes object.
        self._supports, self._forward, self._backward = table.supports, table.forward, table.backward

    @property
    def has_backward(self):
        return bool(self._backward)

    def supports(self, args, mode="training", deterministic=False, stream=None):
        """(True, "") when this kernel takes the call, else (False, the package's reason)."""
        try:
            _call(f"{self.name}.supports", self._supports, args, mode, deterministic, stream)
        except Unsupported as e:
            return False, e.message
        return True, ""

    def forward(self, args, mode="training", deterministic=False, stream=None):
        _call(f"{self.name}.forward", self._forward, args, mode, deterministic, stream)

    def backward(self, args, deterministic=False, stream=None):
        _call(f"{self.name}.backward", self._backward, args, "training", deterministic, stream)


class Op(_Entry):
    """A free function of a package (e.g. the activation package's `silu_and_mul`)."""

    def __init__(self, package, table):
        super().__init__(package, table.name.decode())
        self.doc = (table.doc or b"").decode()
        self.devices = table.devices
        self._call = table.call

    def __call__(self, args, mode="inference", deterministic=False, stream=None):
        _call(self.name, self._call, args, mode, deterministic, stream)


class Package:
    """A loaded kernel package: its name, version, layers and ops, after the ABI checks a host makes.

    Loading runs the library's initialisers: load only packages you trust (the kcpp CLI's `verify`
    checks hashes and signatures first)."""

    def __init__(self, path):
        self.path = str(path)
        self._lib = ctypes.CDLL(self.path, mode=ctypes.RTLD_LOCAL)
        try:
            symbol = getattr(self._lib, PACKAGE_SYMBOL)
        except AttributeError:
            raise ImportError(f"{self.path}: not a kernels.cpp package (no symbol {PACKAGE_SYMBOL})") from None
        symbol.restype = POINTER(_Package)
        symbol.argtypes = []
        table = symbol()
        if not table:
            raise ImportError(f"{self.path}: {PACKAGE_SYMBOL}() returned NULL")
        t = table.contents
        if t.abi_version != ABI_VERSION:
            raise ImportError(f"{self.path}: built for kcpp ABI {t.abi_version}, this bridge speaks {ABI_VERSION}")
        if t.struct_size < ctypes.sizeof(_Package):
            raise ImportError(f"{self.path}: package table of {t.struct_size} bytes, expected >= {ctypes.sizeof(_Package)}")
        self.name, self.version = t.name.decode(), t.version.decode()
        self.layers, self.ops = {}, {}
        for i in range(t.num_layers):
            entry = t.layers[i]
            if entry.struct_size < ctypes.sizeof(_Layer):
                raise ImportError(f"{self.path}: layer {i} table of {entry.struct_size} bytes")
            self.layers[entry.name.decode()] = Layer(self, entry)
        for i in range(t.num_ops):
            entry = t.ops[i]
            if entry.struct_size < ctypes.sizeof(_Op):
                raise ImportError(f"{self.path}: op {i} table of {entry.struct_size} bytes")
            self.ops[entry.name.decode()] = Op(self, entry)

    def layer(self, name):
        try:
            return self.layers[name]
        except KeyError:
            raise KeyError(f"package {self.name} has no layer {name!r}; it has {sorted(self.layers)}") from None

    def op(self, name):
        try:
            return self.ops[name]
        except KeyError:
            raise KeyError(f"package {self.name} has no op {name!r}; it has {sorted(self.ops)}") from None

    def __repr__(self):
        return f"<kcpp package {self.name} {self.version}: {len(self.layers)} layers, {len(self.ops)} ops>"
