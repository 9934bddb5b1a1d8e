// kcpp._core: the Python package's bindings to the C++ hub and to the kernel ABI (include/kcpp/abi.h).
//
// The hub (references, versions, variants, manifests, sha256, signatures, trust, lock files, the cache)
// is the C++ one, kcpp::hub::Hub; Python only passes its configuration and gets a loaded, verified
// package back.  Calls go straight to the package's entry points: the binding is the host here.
//
// A call's arguments are a dict {name: value}.  Values: None (KCPP_ARG_NONE), bool / int (INT), float
// (FLOAT), str (STRING), or a tensor:
//   - an object whose type carries DLPack's C exchange API (`__dlpack_c_exchange_api__`, DLPack 1.3:
//     PyTorch >= 2.10) is described by its `dltensor_from_py_object_no_sync`: a borrowed DLTensor,
//     no capsule, no Python call (the per-call host cost this bridge exists to keep small); the CUDA
//     stream is the framework's current one (`current_work_stream`);
//   - anything else with `__dlpack__` (NumPy, JAX, CuPy, ...) is imported by nanobind's ndarray
//     caster (the DLPack protocol, versioned or not), kept alive for the call.
// The call's device and stream are those of the first tensor (that device current for the call); the
// package checks that the rest agree.
// The GIL is released while a kernel runs (the arguments are kept alive by references held here).
//
// Workspace (scratch memory a kernel asks for): host memory for CPU calls; for CUDA calls the
// Python hook kcpp._workspace (PyTorch's caching allocator, stream-ordered on the current stream),
// called with the GIL re-acquired.  Blocks go back when the call returns, as the ABI allows.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/filesystem.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/map.h>
#include <nanobind/stl/vector.h>

#include <cstdlib>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "core/cuda_runtime.h"
#include "core/error.h"
#include "hub/hub.h"
#include "hub/package.h"
#include "kcpp/abi.h"
#include "nn/kernel_config.h"
#include "nn/module.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace {

// ---- DLPack's C exchange API (DLPack 1.3, dlpack.h: DLPackExchangeAPI) ------------------------------
// Declared here from the specification because the system's dlpack.h (0.6) predates it.  A type
// exposes it as the class attribute `__dlpack_c_exchange_api__`, a capsule named
// "dlpack_exchange_api" holding a DLPackExchangeAPI*; a consumer checks the major version.

struct DLPackVersionV {
  uint32_t major, minor;
};
struct ExchangeApiHeader {
  DLPackVersionV version;
  ExchangeApiHeader* prev_api;
};
struct ExchangeApi {
  ExchangeApiHeader header;
  void* managed_tensor_allocator;
  void* managed_tensor_from_py_object_no_sync;
  void* managed_tensor_to_py_object_no_sync;
  // Fills a non-owning DLTensor (shape / strides borrowed from the object); 0, or -1 with an exception set.
  int (*dltensor_from_py_object_no_sync)(void* py_object, DLTensor* out);
  // The framework's current stream for a device; 0, or -1 with an exception set.
  int (*current_work_stream)(int32_t device_type, int32_t device_id, void** out_stream);
};

// What the bridge knows of a tensor type, looked up once per type.
struct TypeInfo {
  // The type's exchange API (nullptr: none, or one whose major version this bridge does not speak,
  // or without dltensor_from_py_object_no_sync).
  const ExchangeApi* api = nullptr;
  // PyTorch's: a tensor may carry the negative or conjugate bit (a lazy negation / conjugation that
  // the exchange API's DLTensor does not show), which the bridge must refuse.
  bool torch = false;
};

const TypeInfo& type_info(PyTypeObject* type) {
  static std::unordered_map<PyTypeObject*, TypeInfo> cache;
  if (auto it = cache.find(type); it != cache.end()) return it->second;
  TypeInfo info;
  PyObject* capsule = PyObject_GetAttrString(reinterpret_cast<PyObject*>(type), "__dlpack_c_exchange_api__");
  if (capsule && PyCapsule_IsValid(capsule, "dlpack_exchange_api")) {
    auto* a = static_cast<const ExchangeApi*>(PyCapsule_GetPointer(capsule, "dlpack_exchange_api"));
    if (a && a->header.version.major == 1 && a->dltensor_from_py_object_no_sync && a->current_work_stream) info.api = a;
  }
  if (!capsule) PyErr_Clear();
  Py_XDECREF(capsule);
  for (PyTypeObject* t = type; t; t = t->tp_base) {
    if (std::strcmp(t->tp_name, "torch._C.TensorBase") == 0 || std::strcmp(t->tp_name, "torch._C._TensorBase") == 0) {
      info.torch = true;
      break;
    }
  }
  // A type with an API is held, so that the API's pointer stays valid.
  if (info.api) Py_INCREF(reinterpret_cast<PyObject*>(type));
  return cache.emplace(type, info).first->second;
}

// True when a PyTorch tensor's values are not what its memory holds (negative or conjugate bit).
bool torch_lazy_view(PyObject* t, const DLTensor& d) {
  static PyObject* is_neg = PyUnicode_InternFromString("is_neg");
  static PyObject* is_conj = PyUnicode_InternFromString("is_conj");
  for (PyObject* name : {is_neg, is_conj}) {
    if (name == is_conj && d.dtype.code != kDLComplex) continue;  // only complex tensors have it
    PyObject* r = PyObject_CallMethodNoArgs(t, name);
    if (!r) throw nb::python_error();
    bool set = r == Py_True;
    Py_DECREF(r);
    if (set) return true;
  }
  return false;
}

// ---- errors --------------------------------------------------------------------------------------------

// The exception classes of kcpp/_errors.py (shared with the ctypes bridge).
struct Errors {
  nb::object kcpp_error, invalid_argument, unsupported, hub_disabled;
};
Errors& errors() {
  static Errors* e = [] {
    nb::module_ m = nb::module_::import_("kcpp._errors");
    return new Errors{m.attr("KcppError"), m.attr("InvalidArgument"), m.attr("Unsupported"), m.attr("HubDisabled")};
  }();
  return *e;
}

[[noreturn]] void raise_status(const std::string& where, int status, const char* message) {
  nb::object cls = status == KCPP_ERROR_INVALID_ARGUMENT ? errors().invalid_argument
                   : status == KCPP_ERROR_UNSUPPORTED    ? errors().unsupported
                                                         : errors().kcpp_error;
  nb::object e = cls(nb::str(where.c_str()), status, nb::str(message));
  PyErr_SetObject(cls.ptr(), e.ptr());
  throw nb::python_error();
}

[[noreturn]] void raise_type(const char* type, const std::string& message) {
  PyErr_SetString(std::strcmp(type, "value") == 0 ? PyExc_ValueError : PyExc_TypeError, message.c_str());
  throw nb::python_error();
}

// ---- one call --------------------------------------------------------------------------------------------

constexpr int kMaxArgs = 48;

// Host memory for a CPU call's workspace, or PyTorch's (through kcpp._workspace) for a CUDA call.
struct Workspace {
  DLDevice device{kDLCPU, 0};
  bool python = false;                       // CUDA: blocks from the Python hook
  std::vector<void*> host_blocks;            // CPU blocks, freed after the call
  std::vector<nb::object> python_blocks;     // CUDA blocks (tensors), released after the call
  std::string why;                           // why a request failed (added to the kernel's message)

  static void* allocate(void* self, size_t bytes) {
    auto* w = static_cast<Workspace*>(self);
    size_t n = ((bytes ? bytes : 1) + 255) / 256 * 256;
    if (w->device.device_type == kDLCPU) {
      void* p = std::aligned_alloc(256, n);
      if (p) w->host_blocks.push_back(p);
      else w->why = "host memory exhausted";
      return p;
    }
    if (!w->python) {
      w->why = "kcpp gives device workspace through PyTorch's allocator, and this call's tensors are not PyTorch's";
      return nullptr;
    }
    nb::gil_scoped_acquire gil;
    return w->python_block(n);
  }

  // A block from kcpp._workspace (with the GIL held).  The device is passed as plain ints: DLDeviceType
  // is a C enum nanobind has no caster for.
  void* python_block(size_t n) {
    try {
      nb::object hook = nb::module_::import_("kcpp").attr("_workspace");
      nb::object block = hook(n, static_cast<int>(device.device_type), static_cast<int>(device.device_id));
      void* p = reinterpret_cast<void*>(nb::cast<uintptr_t>(block.attr("data_ptr")()));
      python_blocks.push_back(std::move(block));
      return p;
    } catch (nb::python_error& e) {
      // No exception may cross the ABI: NULL is "out of memory" and the kernel reports it; the reason
      // (the exception's type and message, not its traceback) is added to its message after the call.
      why = nb::cast<std::string>(nb::str(e.type().attr("__name__"))) + ": " + nb::cast<std::string>(nb::str(e.value()));
      return nullptr;
    } catch (const std::exception& e) {
      why = e.what();
      PyErr_Clear();
      return nullptr;
    }
  }

  void release() {
    for (void* p : host_blocks) std::free(p);
    host_blocks.clear();
    python_blocks.clear();  // with the GIL held (called after the call, GIL re-acquired)
  }
};

struct CallState {
  kcpp_arg args[kMaxArgs];
  DLTensor tensors[kMaxArgs];
  PyObject* held[2 * kMaxArgs];    // strong references to every name and value for the call
  nb::ndarray<> arrays[kMaxArgs];  // DLPack imports of non-exchange-API tensors
  int n = 0, n_arrays = 0;
  DLDevice device{kDLCPU, 0};
  bool have_device = false;
  const ExchangeApi* device_api = nullptr;  // the API of the first tensor (its framework's stream)

  ~CallState() {
    for (int i = 0; i < 2 * n; ++i) Py_XDECREF(held[i]);
    for (int i = 0; i < n_arrays; ++i) arrays[i] = nb::ndarray<>();
  }
};

uint32_t parse_mode(nb::handle mode, const std::string& where) {
  if (PyUnicode_Check(mode.ptr())) {
    Py_ssize_t len = 0;
    const char* s = PyUnicode_AsUTF8AndSize(mode.ptr(), &len);
    if (s && std::strcmp(s, "training") == 0) return KCPP_MODE_TRAINING;
    if (s && std::strcmp(s, "inference") == 0) return KCPP_MODE_INFERENCE;
  } else if (PyLong_Check(mode.ptr()) && !PyBool_Check(mode.ptr())) {
    long v = PyLong_AsLong(mode.ptr());
    if (v > 0 && v < 8) return static_cast<uint32_t>(v);
  }
  raise_type("value", where + ": mode must be 'inference', 'training' or KCPP_MODE_* bits, is " +
                          nb::cast<std::string>(nb::repr(mode)));
}

// Builds the kcpp_arg array of `args` into `st`.
void build_args(CallState& st, nb::handle args, const std::string& where) {
  if (!PyDict_Check(args.ptr())) raise_type("type", where + ": arguments must be a dict {name: value}");
  Py_ssize_t pos = 0;
  PyObject *key, *value;
  while (PyDict_Next(args.ptr(), &pos, &key, &value)) {
    if (st.n == kMaxArgs) raise_type("value", where + ": more than " + std::to_string(kMaxArgs) + " arguments");
    if (!PyUnicode_Check(key)) raise_type("type", where + ": argument names must be str");
    kcpp_arg& a = st.args[st.n];
    a.name = PyUnicode_AsUTF8AndSize(key, nullptr);
    if (!a.name) throw nb::python_error();
    a.reserved = 0;
    Py_INCREF(key);  // the name is borrowed from the key object
    Py_INCREF(value);
    st.held[2 * st.n] = key;
    st.held[2 * st.n + 1] = value;
    ++st.n;
    if (value == Py_None) {
      a.kind = KCPP_ARG_NONE;
      a.value.i = 0;
    } else if (PyBool_Check(value)) {
      a.kind = KCPP_ARG_INT;
      a.value.i = value == Py_True ? 1 : 0;
    } else if (PyLong_Check(value)) {
      int overflow = 0;
      long long v = PyLong_AsLongLongAndOverflow(value, &overflow);
      if (overflow) raise_type("value", where + ": argument '" + a.name + "' does not fit in 64 bits");
      a.kind = KCPP_ARG_INT;
      a.value.i = v;
    } else if (PyFloat_Check(value)) {
      a.kind = KCPP_ARG_FLOAT;
      a.value.f = PyFloat_AS_DOUBLE(value);
    } else if (PyUnicode_Check(value)) {
      a.kind = KCPP_ARG_STRING;
      a.value.s = PyUnicode_AsUTF8AndSize(value, nullptr);
      if (!a.value.s) throw nb::python_error();
    } else {
      DLTensor& t = st.tensors[st.n - 1];
      const TypeInfo& type = type_info(Py_TYPE(value));
      const ExchangeApi* api = type.api;
      if (api) {
        if (api->dltensor_from_py_object_no_sync(value, &t) != 0) {
          // The framework's message (its first line: PyTorch appends a C++ trace), naming the argument.
          nb::python_error e;
          std::string m = e.what();
          m = m.substr(0, m.find('\n'));
          raise_type("value", where + ": argument '" + a.name + "': " + m);
        }
        if (type.torch && torch_lazy_view(value, t))
          raise_type("value", where + ": argument '" + a.name + "' is a lazily negated or conjugated view "
                                  "(PyTorch's neg / conj bit): pass t.resolve_neg().resolve_conj()");
      } else {
        if (!PyObject_HasAttrString(value, "__dlpack__"))
          raise_type("type", where + ": argument '" + a.name + "' is a " + Py_TYPE(value)->tp_name +
                                 "; expected a tensor with __dlpack__, None, bool, int, float or str");
        nb::ndarray<>& arr = st.arrays[st.n_arrays];
        if (!nb::try_cast(nb::handle(value), arr, false))
          raise_type("type", where + ": argument '" + a.name + "': its __dlpack__ export failed");
        ++st.n_arrays;
        t = DLTensor{};
        t.data = arr.data();
        t.device = DLDevice{static_cast<DLDeviceType>(arr.device_type()), arr.device_id()};
        t.ndim = static_cast<int32_t>(arr.ndim());
        t.dtype = DLDataType{arr.dtype().code, arr.dtype().bits, arr.dtype().lanes};
        t.shape = const_cast<int64_t*>(arr.shape_ptr());
        t.strides = const_cast<int64_t*>(arr.stride_ptr());
        t.byte_offset = 0;
      }
      a.kind = KCPP_ARG_TENSOR;
      a.value.tensor = &t;
      if (!st.have_device) {
        st.device = t.device;
        st.have_device = true;
        st.device_api = api;
      }
    }
  }
}

thread_local char t_error[2048];

// Calls `fn` with `args`; returns the status (messages in t_error).  Raises for bad Python input.
int call_entry(kcpp_entry_fn fn, nb::handle args, uint32_t mode, bool deterministic, nb::handle stream,
               const std::string& where) {
  if (!fn) raise_status(where, KCPP_ERROR_UNSUPPORTED, "the package has no such entry point");
  CallState st;
  build_args(st, args, where);
  void* s = nullptr;
  if (!stream.is_none()) {
    s = reinterpret_cast<void*>(nb::cast<uintptr_t>(stream));
  } else if (st.device.device_type != kDLCPU && st.device_api) {
    if (st.device_api->current_work_stream(st.device.device_type, st.device.device_id, &s) != 0)
      throw nb::python_error();
  }
  Workspace ws;
  ws.device = st.device;
  ws.python = st.device_api != nullptr;  // PyTorch's allocator for PyTorch's CUDA tensors
  kcpp_context ctx{};
  ctx.struct_size = sizeof(kcpp_context);
  ctx.mode = mode;
  ctx.device = st.device;
  ctx.stream = s;
  ctx.deterministic = deterministic ? 1 : 0;
  ctx.workspace = st.device.device_type == kDLCPU || ws.python ? &Workspace::allocate : nullptr;
  ctx.workspace_host = &ws;
  t_error[0] = 0;
  ctx.error = t_error;
  ctx.error_size = sizeof t_error;
  int status;
  {
#if KCPP_WITH_CUDA
    // The tensors' device is current for the call, as for the C++ runtime's calls (nn/kernel_call.cpp):
    // packages launch on the current device, and PyTorch leaves cuda:0 current for a model on cuda:1 or
    // spread over several GPUs by accelerate's device_map.
    std::optional<kcpp::cuda::DeviceGuard> guard;
    if (st.device.device_type == kDLCUDA) guard.emplace(static_cast<int>(st.device.device_id));
#endif
    nb::gil_scoped_release nogil;
    status = fn(&ctx, st.args, st.n);
  }
  if (!ws.python_blocks.empty() && !stream.is_none()) {
    // A kernel queued on a stream other than PyTorch's current one: the blocks must wait for it.
    nb::module_::import_("kcpp").attr("_workspace_done")(nb::cast(ws.python_blocks), stream);
  }
  ws.release();
  if (status != KCPP_OK && !ws.why.empty()) {
    // The kernel said it had no workspace; say why.
    const size_t used = std::strlen(t_error);
    std::snprintf(t_error + used, sizeof t_error - used, " (workspace: %s)", ws.why.c_str());
  }
  return status;
}

// kcpp._core._workspace_block(nbytes, device_type, device_id): one request through the path a CUDA
// call's workspace takes (kcpp._workspace), for tests: the block's address, or the reason it failed.
std::pair<uintptr_t, std::string> workspace_block(size_t nbytes, int device_type, int device_id) {
  Workspace ws;
  ws.device = DLDevice{static_cast<DLDeviceType>(device_type), device_id};
  ws.python = true;
  void* p = ws.python_block(nbytes);
  return {reinterpret_cast<uintptr_t>(p), ws.why};
}

// ---- packages, layers, ops -------------------------------------------------------------------------------

struct PackageObj;

struct LayerObj {
  std::shared_ptr<const kcpp::hub::LoadedPackage> package;
  const kcpp_layer* layer;
  std::string name, where_supports, where_forward, where_backward;

  LayerObj(std::shared_ptr<const kcpp::hub::LoadedPackage> p, const kcpp_layer* l)
      : package(std::move(p)), layer(l), name(l->name) {
    where_supports = name + ".supports";
    where_forward = name + ".forward";
    where_backward = name + ".backward";
  }

  nb::tuple supports(nb::handle args, nb::handle mode, bool deterministic, nb::handle stream) const {
    int s = call_entry(layer->supports, args, parse_mode(mode, where_supports), deterministic, stream, where_supports);
    if (s == KCPP_OK) return nb::make_tuple(true, "");
    if (s == KCPP_ERROR_UNSUPPORTED) return nb::make_tuple(false, nb::str(t_error));
    raise_status(where_supports, s, t_error);
  }
  void forward(nb::handle args, nb::handle mode, bool deterministic, nb::handle stream) const {
    int s = call_entry(layer->forward, args, parse_mode(mode, where_forward), deterministic, stream, where_forward);
    if (s != KCPP_OK) raise_status(where_forward, s, t_error);
  }
  void backward(nb::handle args, bool deterministic, nb::handle stream) const {
    int s = call_entry(layer->backward, args, KCPP_MODE_TRAINING, deterministic, stream, where_backward);
    if (s != KCPP_OK) raise_status(where_backward, s, t_error);
  }
  std::string repr() const { return "<kcpp layer " + std::string(package->table().name) + ":" + name + ">"; }
};

struct OpObj {
  std::shared_ptr<const kcpp::hub::LoadedPackage> package;
  const kcpp_op* op;
  std::string name;
  void call(nb::handle args, nb::handle mode, bool deterministic, nb::handle stream) const {
    int s = call_entry(op->call, args, parse_mode(mode, name), deterministic, stream, name);
    if (s != KCPP_OK) raise_status(name, s, t_error);
  }
};

struct PackageObj {
  std::shared_ptr<const kcpp::hub::LoadedPackage> package;
  std::optional<kcpp::hub::PackageInfo> info;  // absent for a library file opened unverified
  std::string default_layer;                   // the reference's :Layer, or ""
  std::string substituted;                     // the default loader's note when this build's package stood in

  std::string name() const { return package->table().name; }
  std::string version() const { return package->table().version; }
  nb::dict layers() const {
    nb::dict d;
    const auto& t = package->table();
    for (int i = 0; i < t.num_layers; ++i) d[t.layers[i].name] = LayerObj(package, &t.layers[i]);
    return d;
  }
  nb::dict ops() const {
    nb::dict d;
    const auto& t = package->table();
    for (int i = 0; i < t.num_ops; ++i) d[t.ops[i].name] = OpObj{package, &t.ops[i], t.ops[i].name};
    return d;
  }
  std::vector<std::string> layer_names() const {
    std::vector<std::string> v;
    const auto& t = package->table();
    for (int i = 0; i < t.num_layers; ++i) v.push_back(t.layers[i].name);
    return v;
  }
  LayerObj layer(const std::string& n) const {
    if (const kcpp_layer* l = package->layer(n)) return LayerObj(package, l);
    std::string have;
    for (const auto& s : layer_names()) have += (have.empty() ? "'" : ", '") + s + "'";
    PyErr_SetString(PyExc_KeyError,
                    ("package " + name() + " has no layer '" + n + "'; it has [" + have + "]").c_str());
    throw nb::python_error();
  }
  LayerObj layer_by_contract(const std::string& contract) const {
    if (const kcpp_layer* l = package->layer_by_contract(contract)) return LayerObj(package, l);
    PyErr_SetString(PyExc_KeyError, ("package " + name() + " has no layer implementing " + contract).c_str());
    throw nb::python_error();
  }
  OpObj op(const std::string& n) const {
    if (const kcpp_op* o = package->op(n)) return OpObj{package, o, n};
    PyErr_SetString(PyExc_KeyError, ("package " + name() + " has no op '" + n + "'").c_str());
    throw nb::python_error();
  }
  nb::dict info_dict() const {
    nb::dict d;
    d["origin"] = package->origin();
    if (!info) return d;
    d["reference"] = info->ref.str();
    d["folder"] = info->folder.string();
    d["revision"] = info->resolved.revision;
    d["commit"] = info->resolved.commit;
    d["manifest_sha256"] = info->manifest_sha256;
    d["variant"] = info->variant.chosen;
    d["variant_reason"] = info->variant.why;
    d["publisher"] = info->trust.publisher;
    d["trust"] = info->trust.detail;
    return d;
  }
};

// ---- the hub ----------------------------------------------------------------------------------------

struct HubObj {
  std::shared_ptr<kcpp::hub::Hub> hub;

  PackageObj load(const std::string& reference) {
    kcpp::hub::LoadedKernel k;
    {
      nb::gil_scoped_release nogil;
      k = hub->load(kcpp::hub::Reference::parse(reference));
    }
    PackageObj p{k.package, k.info, k.layer ? std::string(k.layer->name) : std::string(), ""};
    return p;
  }
  nb::dict inspect(const std::string& reference) {
    kcpp::hub::PackageInfo info;
    {
      nb::gil_scoped_release nogil;
      info = hub->inspect(kcpp::hub::Reference::parse(reference));
    }
    nb::dict d;
    d["name"] = info.manifest.name;
    d["version"] = info.manifest.version;
    d["folder"] = info.folder.string();
    d["revision"] = info.resolved.revision;
    d["commit"] = info.resolved.commit;
    d["manifest_sha256"] = info.manifest_sha256;
    d["variant"] = info.variant.chosen;
    d["publisher"] = info.trust.publisher;
    d["trust"] = info.trust.detail;
    return d;
  }
};

kcpp::hub::HubConfig hub_config(kcpp::hub::HubConfig c, std::optional<std::string> endpoint,
                                std::optional<std::string> cache_dir, std::optional<bool> offline,
                                std::optional<bool> allow_all_kernels, std::optional<std::string> trust_store,
                                std::optional<std::string> lock_file, std::optional<bool> enabled) {
  if (endpoint) c.endpoint = *endpoint;
  if (cache_dir) c.cache_dir = *cache_dir;
  if (offline) c.offline = *offline;
  if (allow_all_kernels) c.allow_all_kernels = *allow_all_kernels;
  if (enabled) c.enabled = *enabled;
  if (lock_file) {
    if (lock_file->empty()) c.lock_file.reset();
    else c.lock_file = *lock_file;
  }
  if (trust_store) {  // this file alone (plus KCPP_TRUSTED_PUBLISHERS is not read): explicit wins
    c.trust = kcpp::hub::TrustStore();
    if (!trust_store->empty()) c.trust.load_file(*trust_store);
  }
  c.http.progress = false;
  return c;
}

HubObj make_hub(std::optional<std::string> endpoint, std::optional<std::string> cache_dir, std::optional<bool> offline,
                std::optional<bool> allow_all_kernels, std::optional<std::string> trust_store,
                std::optional<std::string> lock_file, std::optional<bool> enabled) {
  return HubObj{std::make_shared<kcpp::hub::Hub>(hub_config(kcpp::hub::HubConfig::from_env(), endpoint, cache_dir, offline,
                                                            allow_all_kernels, trust_store, lock_file, enabled))};
}

// The default mapping's loader (nn::default_loader): this project's org on the hub, else this
// build's packages (`local`: {name: folder}, kcpp.local_packages()).
struct DefaultLoaderObj {
  kcpp::nn::KernelLoader loader;

  PackageObj load(const std::string& reference) {
    kcpp::hub::LoadedKernel k;
    {
      nb::gil_scoped_release nogil;
      k = loader(kcpp::hub::Reference::parse(reference));
    }
    return PackageObj{k.package, k.info, k.layer ? std::string(k.layer->name) : std::string(), k.substituted};
  }
};

PackageObj open_library(const std::string& path) {
  return PackageObj{kcpp::hub::LoadedPackage::open_file(path), std::nullopt, "", ""};
}

// ---- KernelConfig --------------------------------------------------------------------------------------

struct KernelConfigObj {
  kcpp::nn::KernelConfig config;

  // The reference text for `layer` in `mode` on `device`: None when the config names nothing, ""
  // when it keeps the reference implementation; with the key that matched.
  std::pair<std::optional<std::string>, std::string> select(const std::string& layer, const std::string& mode,
                                                            const std::string& device, int cc_major,
                                                            int cc_minor) const {
    std::string why;
    auto e = config.select(layer, kcpp::nn::parse_mode(mode), kcpp::hub::parse_backend(device), cc_major, cc_minor, &why);
    if (!e) return {std::nullopt, why};
    return {e->ref ? e->ref->str() : std::string(), why};
  }
};

}  // namespace

NB_MODULE(_core, m) {
  m.doc() = "kernels.cpp: the C++ hub and the kernel ABI, for Python (see kcpp/__init__.py)";
  // Packages and layers held by module-level caches (kcpp.hf_kernels, the `kernels` library's layer
  // cache) live until the interpreter exits, when Python does not promise to free them: not leaks.
  nb::set_leak_warnings(false);
  m.attr("ABI_VERSION") = KCPP_ABI_VERSION;
  m.attr("MODE_INFERENCE") = KCPP_MODE_INFERENCE;
  m.attr("MODE_TRAINING") = KCPP_MODE_TRAINING;
  m.attr("MODE_GRAPH") = KCPP_MODE_GRAPH;
#ifdef KCPP_BUILD_PACKAGES_DIR
  m.attr("BUILD_PACKAGES_DIR") = KCPP_BUILD_PACKAGES_DIR;
#else
  m.attr("BUILD_PACKAGES_DIR") = "";
#endif

  // C++ errors (the hub's: a bad reference, a hash mismatch, an untrusted package) as kcpp.KcppError.
  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const kcpp::hub::HubDisabled& e) {
      PyErr_SetObject(errors().hub_disabled.ptr(), errors().hub_disabled(nb::str(e.what())).ptr());
    } catch (const kcpp::Error& e) {
      PyErr_SetObject(errors().kcpp_error.ptr(), errors().kcpp_error(nb::str(e.what())).ptr());
    }
  });

  nb::class_<LayerObj>(m, "Layer", "One layer of a package: supports / forward / backward over a dict of arguments.")
      .def_prop_ro("name", [](const LayerObj& l) { return l.name; })
      .def_prop_ro("contract", [](const LayerObj& l) { return std::string(l.layer->contract); })
      .def_prop_ro("doc", [](const LayerObj& l) { return std::string(l.layer->doc ? l.layer->doc : ""); })
      .def_prop_ro("modes", [](const LayerObj& l) { return l.layer->modes; })
      .def_prop_ro("devices", [](const LayerObj& l) { return l.layer->devices; })
      .def_prop_ro("has_backward", [](const LayerObj& l) { return l.layer->backward != nullptr; })
      .def_prop_ro("package_name", [](const LayerObj& l) { return std::string(l.package->table().name); })
      .def_prop_ro("package_version", [](const LayerObj& l) { return std::string(l.package->table().version); })
      .def("runs_on", [](const LayerObj& l, int device_type) { return (l.layer->devices >> device_type) & 1u; },
           "dl_device_type"_a)
      .def("supports", &LayerObj::supports, "args"_a, "mode"_a = "training", "deterministic"_a = false,
           "stream"_a = nb::none(),
           "(True, '') when the kernel takes this call, else (False, the kernel's reason): the host falls back")
      .def("forward", &LayerObj::forward, "args"_a, "mode"_a = "training", "deterministic"_a = false,
           "stream"_a = nb::none())
      .def("backward", &LayerObj::backward, "args"_a, "deterministic"_a = false, "stream"_a = nb::none())
      .def("__repr__", &LayerObj::repr);

  nb::class_<OpObj>(m, "Op", "A free function of a package (e.g. activation's silu_and_mul).")
      .def_prop_ro("name", [](const OpObj& o) { return o.name; })
      .def_prop_ro("doc", [](const OpObj& o) { return std::string(o.op->doc ? o.op->doc : ""); })
      .def_prop_ro("devices", [](const OpObj& o) { return o.op->devices; })
      .def("__call__", &OpObj::call, "args"_a, "mode"_a = "inference", "deterministic"_a = false,
           "stream"_a = nb::none());

  nb::class_<PackageObj>(m, "Package", "A loaded kernel package (verified by the hub, or a library opened as it is).")
      .def_prop_ro("name", &PackageObj::name)
      .def_prop_ro("version", &PackageObj::version)
      .def_prop_ro("origin", [](const PackageObj& p) { return p.package->origin(); })
      .def_prop_ro("verified", [](const PackageObj& p) { return p.info.has_value(); })
      .def_prop_ro("default_layer", [](const PackageObj& p) { return p.default_layer; })
      .def_prop_ro("substituted", [](const PackageObj& p) { return p.substituted; },
                   "Set when the default loader loaded this build's package instead of the hub's: what and why")
      .def_prop_ro("info", &PackageObj::info_dict)
      .def_prop_ro("layers", &PackageObj::layers)
      .def_prop_ro("ops", &PackageObj::ops)
      .def("layer", &PackageObj::layer, "name"_a)
      .def("layer_by_contract", &PackageObj::layer_by_contract, "contract"_a)
      .def("op", &PackageObj::op, "name"_a)
      .def("__repr__", [](const PackageObj& p) {
        const auto& t = p.package->table();
        return "<kcpp package " + p.name() + " " + p.version() + ": " + std::to_string(t.num_layers) + " layers, " +
               std::to_string(t.num_ops) + " ops" + (p.info ? "" : ", unverified") + ">";
      });

  m.def("open_library", &open_library, "path"_a,
        "Opens a package library file as it is, without the hub's verification (tests, benchmarks).");

  nb::class_<HubObj>(m, "Hub", "The C++ hub: resolve, inspect, fetch, verify and load package references.")
      .def("__init__",
           [](HubObj* self, std::optional<std::string> endpoint, std::optional<std::string> cache_dir,
              std::optional<bool> offline, std::optional<bool> allow_all_kernels, std::optional<std::string> trust_store,
              std::optional<std::string> lock_file, std::optional<bool> enabled) {
             new (self) HubObj(make_hub(endpoint, cache_dir, offline, allow_all_kernels, trust_store, lock_file, enabled));
           },
           "endpoint"_a = nb::none(), "cache_dir"_a = nb::none(), "offline"_a = nb::none(),
           "allow_all_kernels"_a = nb::none(), "trust_store"_a = nb::none(), "lock_file"_a = nb::none(),
           "enabled"_a = nb::none())
      .def("load", &HubObj::load, "reference"_a)
      .def(  // a local package folder as a path object
          "load", [](HubObj& h, const std::filesystem::path& folder) { return h.load(folder.string()); }, "reference"_a)
      .def("inspect", &HubObj::inspect, "reference"_a)
      .def_prop_ro("endpoint", [](const HubObj& h) { return h.hub->config().endpoint; })
      .def_prop_ro("cache_dir", [](const HubObj& h) { return h.hub->config().cache_dir.string(); })
      .def_prop_ro("offline", [](const HubObj& h) { return h.hub->config().offline; })
      .def_prop_ro("enabled", [](const HubObj& h) { return h.hub->config().enabled; })
      .def_prop_ro("allow_all_kernels", [](const HubObj& h) { return h.hub->config().allow_all_kernels; })
      .def_prop_ro("lock_file", [](const HubObj& h) -> std::optional<std::string> {
        const auto& f = h.hub->config().lock_file;
        return f ? std::optional<std::string>(f->string()) : std::nullopt;
      })
      .def_prop_ro("machine", [](const HubObj& h) { return h.hub->config().machine.str(); });

  nb::class_<KernelConfigObj>(m, "KernelConfig",
                              "Transformers' kernel_mapping, parsed and looked up by the C++ KernelConfig.")
      .def("__init__",
           [](KernelConfigObj* self, const std::string& json_text, bool use_local_kernel) {
             new (self) KernelConfigObj{kcpp::nn::KernelConfig::parse_text(json_text, use_local_kernel)};
           },
           "kernel_mapping_json"_a, "use_local_kernel"_a = false)
      .def("__init__",  // the mapping as a dict, as Transformers' KernelConfig(kernel_mapping=...) takes it
           [](KernelConfigObj* self, const nb::dict& mapping, bool use_local_kernel) {
             const std::string text = nb::cast<std::string>(nb::module_::import_("json").attr("dumps")(mapping));
             new (self) KernelConfigObj{kcpp::nn::KernelConfig::parse_text(text, use_local_kernel)};
           },
           "kernel_mapping"_a, "use_local_kernel"_a = false)
      .def("select", &KernelConfigObj::select, "layer"_a, "mode"_a, "device"_a, "cc_major"_a = 0, "cc_minor"_a = 0)
      .def_prop_ro("layers", [](const KernelConfigObj& k) { return k.config.layers(); })
      .def_prop_ro("use_local_kernel", [](const KernelConfigObj& k) { return k.config.use_local_kernel(); });

  m.def(
      "liger_kernel_config",
      [](const std::string& switches_json, const std::string& package, bool use_local_kernel, const std::string& attention) {
        auto s = kcpp::nn::LigerSwitches::parse(nlohmann::json::parse(switches_json));
        return KernelConfigObj{kcpp::nn::liger_kernel_config(s, package, use_local_kernel, attention)};
      },
      "switches_json"_a, "package"_a, "use_local_kernel"_a = false, "attention"_a = "",
      "Liger's switches (rope, rms_norm, swiglu, cross_entropy, fused_linear_cross_entropy) as a KernelConfig "
      "over the liger package.");
  m.def("known_layer_names", &kcpp::nn::known_layer_names);
  m.def("_workspace_block", &workspace_block, "nbytes"_a, "device_type"_a, "device_id"_a,
        "One device workspace request as a call makes it (tests): (address or 0, why it failed).");

  m.attr("DEFAULT_KERNEL_ORG") = kcpp::nn::kDefaultKernelOrg;
  m.def("default_kernel_mapping_json", [] { return kcpp::nn::default_kernel_mapping().dump(); },
        "The mapping use_kernels gets with no config (nn::default_kernel_mapping), as JSON text.");
  nb::class_<DefaultLoaderObj>(m, "DefaultLoader",
                               "The default mapping's loader: this project's packages on the hub, else this build's.")
      .def("__init__",
           [](DefaultLoaderObj* self, std::map<std::string, std::string> local, std::optional<std::string> endpoint,
              std::optional<std::string> cache_dir, std::optional<bool> offline, std::optional<bool> allow_all_kernels,
              std::optional<std::string> trust_store, std::optional<std::string> lock_file, std::optional<bool> enabled) {
             auto hub = std::make_shared<kcpp::hub::Hub>(hub_config(kcpp::nn::default_hub_config(), endpoint, cache_dir,
                                                                    offline, allow_all_kernels, trust_store, lock_file,
                                                                    enabled));
             auto finder = [local = std::move(local)](const std::string& name) -> std::optional<std::filesystem::path> {
               const auto it = local.find(name);
               if (it == local.end()) return std::nullopt;
               return std::filesystem::path(it->second);
             };
             new (self) DefaultLoaderObj{kcpp::nn::default_loader(std::move(hub), std::move(finder))};
           },
           "local_packages"_a, "endpoint"_a = nb::none(), "cache_dir"_a = nb::none(), "offline"_a = nb::none(),
           "allow_all_kernels"_a = nb::none(), "trust_store"_a = nb::none(), "lock_file"_a = nb::none(),
           "enabled"_a = nb::none())
      .def("load", &DefaultLoaderObj::load, "reference"_a);
}
