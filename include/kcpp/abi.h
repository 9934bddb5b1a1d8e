/* kernels.cpp kernel package ABI, version 1.
 *
 * The one contract between a host (the kcpp runtime, a PyTorch bridge, another engine) and a kernel
 * package (a shared library).  Plain C, so any compiler and any language can speak it; tensors are
 * DLPack `DLTensor`s, so any framework can hand its memory over without a copy.
 *
 * A package exports exactly one symbol:
 *
 *     KCPP_EXPORT const kcpp_package* kcpp_package_v1(void);
 *
 * returning a pointer to a static table (valid until the library is unloaded) that names the
 * package, its version, the layers it implements and the free functions (ops) it exports.
 *
 * Calls.  Every entry point receives a `kcpp_context` (device, stream, workspace allocator,
 * deterministic flag, mode, error buffer) and a small array of named arguments.  The arguments a
 * layer takes are fixed by its *layer contract* (docs/contracts/<Name>.md, e.g. "RMSNorm/1"):
 * names, shapes, dtypes, which tensors are outputs (allocated by the host, written by the kernel),
 * what forward saves for backward and what backward returns.  Kernels hold no state between calls:
 * whatever forward saves for backward is an output tensor of the contract that the host keeps.
 *
 * Status.  Every entry point returns a `kcpp_status`.  On anything but KCPP_OK it writes a readable
 * message naming the argument and the reason into ctx->error (NUL-terminated, truncated to
 * ctx->error_size).  A kernel never aborts, never throws across this boundary and never writes an
 * output after it has reported an error about its inputs.
 *
 * Stability.  Structs only grow at the end; each starts with its own size (`struct_size`) so that a
 * reader can tell which fields the writer knew.  Changing the meaning or order of a field bumps
 * KCPP_ABI_VERSION, the exported symbol name (kcpp_package_v2) and the variant prefix (kcpp2-...).
 * DLTensor is the same struct in DLPack 0.6 and 1.x, so either header may be used.
 */
#ifndef KCPP_ABI_H_
#define KCPP_ABI_H_

#include <stddef.h>
#include <stdint.h>

#include <dlpack/dlpack.h>

#ifdef __cplusplus
extern "C" {
#endif

#define KCPP_ABI_VERSION 1

#if defined(_WIN32)
#define KCPP_EXPORT __declspec(dllexport)
#else
#define KCPP_EXPORT __attribute__((visibility("default")))
#endif

/* ---- status ------------------------------------------------------------------------------------- */

typedef enum kcpp_status {
  KCPP_OK = 0,
  KCPP_ERROR_INVALID_ARGUMENT = 1, /* the call breaks the contract (shape, dtype, missing argument) */
  KCPP_ERROR_UNSUPPORTED = 2,      /* a valid call this kernel does not handle; the host falls back */
  KCPP_ERROR_OUT_OF_MEMORY = 3,    /* the workspace allocator returned NULL */
  KCPP_ERROR_RUNTIME = 4           /* a device runtime error (launch failure, ...) */
} kcpp_status;

/* ---- modes and devices ------------------------------------------------------------------------ */

/* Bits of kcpp_layer.modes (what a kernel is fit for) and the value of kcpp_context.mode (what the
 * host is doing now).  INFERENCE and TRAINING exclude each other in a context; GRAPH may be added to
 * either: the call is being captured into a CUDA graph, so the kernel must not synchronise with the
 * host and must not allocate except through the workspace allocator. */
#define KCPP_MODE_INFERENCE 1u
#define KCPP_MODE_TRAINING 2u
#define KCPP_MODE_GRAPH 4u

/* Bit of kcpp_layer.devices / kcpp_op.devices for a DLPack device type, e.g. KCPP_DEVICE_BIT(kDLCUDA). */
#define KCPP_DEVICE_BIT(dl_device_type) (1u << (unsigned)(dl_device_type))

/* ---- arguments -------------------------------------------------------------------------------- */

typedef enum kcpp_arg_kind {
  KCPP_ARG_NONE = 0,   /* present but empty: an optional argument the host passes as "not given" */
  KCPP_ARG_TENSOR = 1, /* value.tensor: borrowed for the duration of the call */
  KCPP_ARG_INT = 2,    /* value.i (also booleans: 0 / 1) */
  KCPP_ARG_FLOAT = 3,  /* value.f */
  KCPP_ARG_STRING = 4  /* value.s: NUL-terminated UTF-8, borrowed for the call */
} kcpp_arg_kind;

typedef struct kcpp_arg {
  const char* name; /* the contract's argument name, e.g. "x", "weight", "eps" */
  int32_t kind;     /* kcpp_arg_kind */
  int32_t reserved; /* 0 */
  union {
    DLTensor* tensor;
    int64_t i;
    double f;
    const char* s;
  } value;
} kcpp_arg;

/* ---- call context ----------------------------------------------------------------------------- */

/* Device memory for the duration of one call, from the host's allocator (so the host's memory
 * accounting sees every byte).  Returns NULL when it cannot allocate.  The memory stays valid until
 * the entry point returns *and* the work it queued on ctx->stream has completed; the host frees it
 * in stream order.  Alignment: at least 256 bytes. */
typedef void* (*kcpp_workspace_fn)(void* host, size_t bytes);

typedef struct kcpp_context {
  uint32_t struct_size;  /* sizeof(kcpp_context) as the host compiled it */
  uint32_t mode;         /* KCPP_MODE_* bits: what the host is doing */
  DLDevice device;       /* where the call's tensors live */
  void* stream;          /* cudaStream_t / hipStream_t for GPU devices; NULL = the default stream */
  int32_t deterministic; /* 1: results must be bitwise reproducible run to run (no float atomics) */
  int32_t reserved;
  kcpp_workspace_fn workspace; /* may be NULL: then a kernel needing a workspace is UNSUPPORTED */
  void* workspace_host;        /* first argument of workspace() */
  char* error;                 /* message buffer for a failed call */
  size_t error_size;           /* bytes of `error`, including the terminating NUL */
} kcpp_context;

/* An entry point: forward, backward, an op's call, or supports(). */
typedef kcpp_status (*kcpp_entry_fn)(kcpp_context* ctx, const kcpp_arg* args, int32_t num_args);

/* ---- the package table -------------------------------------------------------------------------- */

typedef struct kcpp_layer {
  uint32_t struct_size; /* sizeof(kcpp_layer) */
  uint32_t modes;       /* KCPP_MODE_* bits the kernel is fit for */
  uint32_t devices;     /* KCPP_DEVICE_BIT(...) of each device it runs on */
  uint32_t reserved;
  const char* name;     /* what `org/repo:Layer` selects, e.g. "LigerRMSNorm" */
  const char* contract; /* the layer contract it implements, "Name/version", e.g. "RMSNorm/1" */
  const char* doc;      /* one line for `kcpp show` */
  /* Can this kernel take this (contract-valid) call?  KCPP_OK, or KCPP_ERROR_UNSUPPORTED with the
   * reason in ctx->error (dtype, head dim, alignment, ...).  Cheap and free of side effects. */
  kcpp_entry_fn supports;
  kcpp_entry_fn forward;
  kcpp_entry_fn backward; /* NULL for an inference-only kernel */
} kcpp_layer;

typedef struct kcpp_op {
  uint32_t struct_size; /* sizeof(kcpp_op) */
  uint32_t devices;     /* KCPP_DEVICE_BIT(...) */
  const char* name;     /* e.g. "silu_and_mul" */
  const char* doc;      /* arguments and maths in one line, for `kcpp show` */
  kcpp_entry_fn call;
} kcpp_op;

typedef struct kcpp_package {
  uint32_t struct_size; /* sizeof(kcpp_package) */
  uint32_t abi_version; /* KCPP_ABI_VERSION the package was built against */
  const char* name;     /* e.g. "liger"; equals the manifest's name */
  const char* version;  /* semantic version, e.g. "1.2.0"; equals the manifest's version */
  const kcpp_layer* layers;
  int32_t num_layers;
  int32_t num_ops;
  const kcpp_op* ops;
} kcpp_package;

/* The symbol every package exports. */
typedef const kcpp_package* (*kcpp_package_v1_fn)(void);
#define KCPP_PACKAGE_SYMBOL_V1 "kcpp_package_v1"

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* KCPP_ABI_H_ */
