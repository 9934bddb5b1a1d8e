// The kernel packages' entry points (packages/*: the CPU variants, every layer's supports(), forward()
// and backward() and every op) called through the C ABI with argument lists built from the input:
// what a host passes on a user's behalf (the Python bridge hands users' tensors over as they are).
//
// A package answers a bad call with a status and a message; anything else is a finding: a crash, an
// address or UB sanitizer report (each tensor lies in an allocation of exactly the bytes its shape and
// strides reach, so a read or write past what the arguments describe is caught), a hang, or a broken
// property: a call that fails leaves a message, and every message is NUL-terminated inside the buffer.
//
// Input: byte 0 picks the layer or op (over every package's table, in order), byte 1 the entry point
// (supports / forward / backward) and the mode (inference / training, graph); then arguments until
// the input ends, each:
//   name: a byte < kNames picks from the argument names the contracts use, else a name of
//         (byte - kNames) % 8 + 1 further bytes;
//   kind: none, int (8 bytes), float (8 bytes, a double), string (a byte picks one of the contracts'
//         option values), tensor;
//   tensor: dtype byte, ndim byte (0 to 5), one byte a dim (extent 0 to 9), a layout byte (contiguous,
//         the last two dims swapped, strides from the following bytes, a broadcast dim of stride 0),
//         and whether it shares the previous tensor's allocation (outputs over inputs).
// Tensor elements are small values cycled from the input (floats as floats, integers in [-2, 9]).
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "kcpp/abi.h"

extern "C" {
const kcpp_package* kcpp_package_v1_example(void);
const kcpp_package* kcpp_package_v1_liger(void);
const kcpp_package* kcpp_package_v1_activation(void);
const kcpp_package* kcpp_package_v1_flash_attn(void);
const kcpp_package* kcpp_package_v1_moe(void);
const kcpp_package* kcpp_package_v1_mamba(void);
const kcpp_package* kcpp_package_v1_deformable_attention(void);
}

namespace {

// The argument names of the contracts (docs/contracts/), as the packages read them.
constexpr const char* kNames[] = {
    "x", "y", "dy", "dx", "weight", "dweight", "bias", "dbias", "eps", "offset", "casting", "rstd", "mean", "residual",
    "residual_out", "dresidual_out", "gate", "up", "out", "dout", "dgate", "dup", "activation", "q", "k", "v", "q_out",
    "k_out", "dq_out", "dk_out", "dq", "dk", "dv", "cos", "sin", "layout", "style", "logits", "targets", "loss", "grad",
    "lse", "bad_targets", "ignore_index", "label_smoothing", "reduction", "lse_square_scale", "softcap", "token_weight",
    "class_weight", "dlogits", "dloss", "hidden", "dhidden", "grad_scale", "accumulate", "accum_dtype", "chunk_rows",
    "scale", "causal", "window", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k", "routing",
    "apply_router_weight", "normalize", "top_k", "router_weight", "router_logits", "drouter_weight", "drouter_logits",
    "gate_up_proj", "gate_proj", "up_proj", "down_proj", "dgate_up_proj", "dgate_proj", "dup_proj", "ddown_proj",
    "shared_gate_up_proj", "shared_gate_proj", "shared_up_proj", "shared_down_proj", "shared_expert_gate",
    "dshared_gate_up_proj", "dshared_gate_proj", "dshared_up_proj", "dshared_down_proj", "dshared_expert_gate",
    "topk_ids", "topk_weights", "dtopk_weights", "expert_offsets", "sorted_slots", "overwrite_gate_up", "gate_up",
    "attention_mask", "u", "delta", "A", "B", "C", "D", "z", "delta_bias", "delta_softplus", "bc_rms_eps", "states",
    "last_state", "du", "ddelta", "dA", "dB", "dC", "dD", "dz", "ddelta_bias", "state", "dt", "dt_bias", "dt_softplus",
    "conv_state", "value", "value_spatial_shapes", "value_level_start_index", "sampling_locations", "attention_weights",
    "im2col_step", "dvalue", "dsampling_locations", "dattention_weights", "alpha"};
constexpr int kNameCount = static_cast<int>(sizeof kNames / sizeof kNames[0]);

// The contracts' option values (and a few that are not).
constexpr const char* kStrings[] = {"llama", "gemma",   "none",     "silu",  "swish",  "gelu",       "gelu_tanh",
                                    "quick_gelu", "bhsd", "bshd", "rotate_half", "interleaved", "mean", "sum",
                                    "same", "f32", "softmax", "sigmoid", "given", "output", "input", "", "relu"};
constexpr int kStringCount = static_cast<int>(sizeof kStrings / sizeof kStrings[0]);

constexpr DLDataType kDtypes[] = {{kDLFloat, 32, 1}, {kDLBfloat, 16, 1}, {kDLFloat, 16, 1}, {kDLInt, 32, 1},
                                  {kDLInt, 64, 1},   {kDLFloat, 64, 1},  {kDLUInt, 8, 1},   {kDLInt, 8, 1},
                                  {kDLFloat, 32, 2}};

class Bytes {
 public:
  Bytes(const uint8_t* d, size_t n) : d_(d), n_(n) {}
  bool empty() const { return i_ >= n_; }
  uint8_t byte() { return i_ < n_ ? d_[i_++] : 0; }
  template <typename T> T value() {
    T v{};
    unsigned char raw[sizeof(T)] = {};
    for (size_t k = 0; k < sizeof(T); ++k) raw[k] = byte();
    std::memcpy(&v, raw, sizeof(T));
    return v;
  }

 private:
  const uint8_t* d_;
  size_t n_, i_ = 0;
};

struct TensorArg {
  DLTensor t{};
  std::vector<int64_t> shape, strides;
};

// One element of `dt` from the seed byte s: a small float, or an integer in [-2, 9].
void put(void* at, DLDataType dt, uint8_t s) {
  const float f = (static_cast<int>(s) - 128) / 32.0f;
  const int64_t i = static_cast<int64_t>(s % 12) - 2;
  if (dt.code == kDLFloat && dt.bits == 32) *static_cast<float*>(at) = f;
  else if (dt.code == kDLFloat && dt.bits == 64) *static_cast<double*>(at) = f;
  else if (dt.bits == 16) {  // bf16 / f16: the top half of an f32, a valid value of either
    uint32_t u;
    std::memcpy(&u, &f, 4);
    const uint16_t h = static_cast<uint16_t>(u >> 16);
    std::memcpy(at, &h, 2);
  } else if (dt.bits == 32) *static_cast<int32_t*>(at) = static_cast<int32_t>(i);
  else if (dt.bits == 64) *static_cast<int64_t*>(at) = i;
  else *static_cast<uint8_t*>(at) = static_cast<uint8_t>(s & 1);
}

void* workspace(void* host, size_t bytes) {
  auto* held = static_cast<std::vector<std::unique_ptr<unsigned char[]>>*>(host);
  if (bytes > (size_t{256} << 20)) return nullptr;  // past the fuzzer's memory limit: the package must cope
  held->emplace_back(new unsigned char[std::max<size_t>(bytes, 1)]);
  return held->back().get();
}

struct Entry {
  const char* name;
  kcpp_entry_fn supports, forward, backward;
};

const std::vector<Entry>& entries() {
  static const std::vector<Entry> all = [] {
    std::vector<Entry> v;
    for (auto* get : {kcpp_package_v1_example, kcpp_package_v1_liger, kcpp_package_v1_activation, kcpp_package_v1_flash_attn,
                      kcpp_package_v1_moe, kcpp_package_v1_mamba, kcpp_package_v1_deformable_attention}) {
      const kcpp_package* p = get();
      for (int32_t i = 0; i < p->num_layers; ++i)
        v.push_back({p->layers[i].name, p->layers[i].supports, p->layers[i].forward, p->layers[i].backward});
      for (int32_t i = 0; i < p->num_ops; ++i) v.push_back({p->ops[i].name, nullptr, p->ops[i].call, nullptr});
    }
    return v;
  }();
  return all;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 2) return 0;
  Bytes in(data, size);
  const std::vector<Entry>& all = entries();
  const Entry& e = all[in.byte() % all.size()];
  const uint8_t how = in.byte();
  const kcpp_entry_fn fn = (how % 3 == 0 && e.supports) ? e.supports : (how % 3 == 2 && e.backward) ? e.backward : e.forward;
  const uint32_t mode = ((how >> 2) & 1 ? KCPP_MODE_TRAINING : KCPP_MODE_INFERENCE) | ((how >> 3) & 1 ? KCPP_MODE_GRAPH : 0u);

  std::vector<kcpp_arg> args;
  std::vector<std::unique_ptr<TensorArg>> tensors;
  std::vector<std::unique_ptr<unsigned char[]>> buffers;
  std::vector<std::string> names;
  names.reserve(64);
  size_t last_bytes = 0;
  unsigned char* last = nullptr;
  while (!in.empty() && args.size() < 24) {
    kcpp_arg a{};
    const uint8_t nb = in.byte();
    if (nb < kNameCount) {
      a.name = kNames[nb];
    } else {
      std::string n;
      for (int k = 0; k < (nb - kNameCount) % 8 + 1; ++k) n += static_cast<char>(in.byte());
      names.push_back(n);
      a.name = names.back().c_str();
    }
    switch (in.byte() % 5) {
      case 0: a.kind = KCPP_ARG_NONE; break;
      case 1: a.kind = KCPP_ARG_INT, a.value.i = in.value<int64_t>(); break;
      case 2: a.kind = KCPP_ARG_FLOAT, a.value.f = in.value<double>(); break;
      case 3: a.kind = KCPP_ARG_STRING, a.value.s = kStrings[in.byte() % kStringCount]; break;
      default: {
        auto t = std::make_unique<TensorArg>();
        const DLDataType dt = kDtypes[in.byte() % (sizeof kDtypes / sizeof kDtypes[0])];
        const int nd = in.byte() % 6;
        for (int d = 0; d < nd; ++d) t->shape.push_back(in.byte() % 10);
        t->strides.assign(nd, 0);
        int64_t s = 1;
        for (int d = nd - 1; d >= 0; --d) t->strides[d] = s, s *= std::max<int64_t>(t->shape[d], 1);
        const uint8_t layout = in.byte();
        if (layout % 4 == 1 && nd >= 2) {  // the last two dims swapped (a transposed view)
          std::swap(t->shape[nd - 1], t->shape[nd - 2]);
          std::swap(t->strides[nd - 1], t->strides[nd - 2]);
        } else if (layout % 4 == 2) {  // strides from the input, non-negative
          for (int d = 0; d < nd; ++d) t->strides[d] = in.byte() % 40;
        } else if (layout % 4 == 3 && nd >= 1) {  // one broadcast dim
          t->strides[in.byte() % nd] = 0;
        }
        // The allocation: exactly the elements the shape and strides reach.
        int64_t numel = 1, reach = 0;
        for (int d = 0; d < nd; ++d) numel *= t->shape[d], reach += (t->shape[d] - 1) * t->strides[d];
        const int64_t elems = numel == 0 ? 0 : reach + 1;
        const size_t esize = (dt.bits * dt.lanes + 7) / 8;
        const size_t bytes = static_cast<size_t>(elems) * esize;
        unsigned char* base;
        if ((layout & 0x80) && last && last_bytes >= bytes) {
          base = last;  // over the previous tensor's allocation
        } else {
          buffers.emplace_back(new unsigned char[std::max<size_t>(bytes, 1)]);
          base = buffers.back().get();
          const uint8_t seed = in.byte();
          for (int64_t k = 0; k < elems; ++k)
            put(base + k * esize, dt, static_cast<uint8_t>(seed + 37 * k + (k >> 3)));
          if (bytes > 0) last = base, last_bytes = bytes;
        }
        t->t.data = bytes > 0 ? base : nullptr;
        t->t.device = {kDLCPU, 0};
        t->t.ndim = nd;
        t->t.dtype = dt;
        t->t.shape = t->shape.data();
        t->t.strides = (layout & 0x40) && layout % 4 == 0 ? nullptr : t->strides.data();  // NULL: row-major
        t->t.byte_offset = 0;
        a.kind = KCPP_ARG_TENSOR;
        a.value.tensor = &t->t;
        tensors.push_back(std::move(t));
      }
    }
    args.push_back(a);
  }

  char error[256];
  std::memset(error, 'x', sizeof error);
  error[0] = '\0';
  std::vector<std::unique_ptr<unsigned char[]>> held;
  kcpp_context ctx{};
  ctx.struct_size = sizeof ctx;
  ctx.mode = mode;
  ctx.device = {kDLCPU, 0};
  ctx.workspace = workspace;
  ctx.workspace_host = &held;
  ctx.error = error;
  ctx.error_size = sizeof error;
  const kcpp_status st = fn(&ctx, args.data(), static_cast<int32_t>(args.size()));
  if (std::memchr(error, '\0', sizeof error) == nullptr) {
    std::fprintf(stderr, "fuzz property failed: %s left an unterminated message\n", e.name);
    std::abort();
  }
  if (st != KCPP_OK && error[0] == '\0') {
    std::fprintf(stderr, "fuzz property failed: %s failed (status %d) without a message\n", e.name, static_cast<int>(st));
    std::abort();
  }
  return 0;
}
