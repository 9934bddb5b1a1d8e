// The reference ("eager") primitives: what PyTorch eager runs, one pass per primitive, every
// intermediate materialized, on the CPU and on CUDA.  They are the fallback when no kernel applies,
// the baseline every kernel is benchmarked against, and, run in f64 on the CPU, a second oracle.
//
// Conventions (all ops):
//  - Floating dtypes f32, bf16, f16 everywhere, f64 on the CPU.  16-bit inputs are computed in f32
//    and each op's result is rounded to the input dtype, as PyTorch does.
//  - Inputs may be non-contiguous views; outputs are new contiguous tensors on the inputs' device.
//  - Binary ops broadcast (numpy rules) and need one dtype and one device.
//  - Bad arguments throw kcpp::Error naming the op, the argument and what was expected.
//  - Ops that check data (indices in range) synchronize with the device to report the error.
#pragma once

#include <cstdint>
#include <vector>

#include "core/tensor.h"

namespace kcpp::ops {

// ---- elementwise ----------------------------------------------------------------------------
enum class Unary : uint8_t {
  Neg, Exp, Log, Sqrt, Rsqrt, Square, Abs, Recip, Sin, Cos, Tanh, Sigmoid,
  Silu,       // x * sigmoid(x)
  Gelu,       // 0.5 x (1 + erf(x / sqrt 2))
  GeluTanh,   // 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
  Scale,      // alpha * x
  AddScalar,  // x + alpha
};
enum class Binary : uint8_t {
  Add, Sub, Mul, Div,
  SiluGrad,      // (g, x) -> g * silu'(x)
  GeluGrad,      // (g, x) -> g * gelu'(x), exact
  GeluTanhGrad,  // (g, x) -> g * gelu_tanh'(x)
};

Tensor unary(Unary op, const Tensor& x, double alpha = 0.0);
Tensor binary(Binary op, const Tensor& a, const Tensor& b);

inline Tensor neg(const Tensor& x) { return unary(Unary::Neg, x); }
inline Tensor exp(const Tensor& x) { return unary(Unary::Exp, x); }
inline Tensor log(const Tensor& x) { return unary(Unary::Log, x); }
inline Tensor sqrt(const Tensor& x) { return unary(Unary::Sqrt, x); }
inline Tensor rsqrt(const Tensor& x) { return unary(Unary::Rsqrt, x); }
inline Tensor square(const Tensor& x) { return unary(Unary::Square, x); }
inline Tensor sin(const Tensor& x) { return unary(Unary::Sin, x); }
inline Tensor cos(const Tensor& x) { return unary(Unary::Cos, x); }
inline Tensor tanh(const Tensor& x) { return unary(Unary::Tanh, x); }
inline Tensor sigmoid(const Tensor& x) { return unary(Unary::Sigmoid, x); }
inline Tensor silu(const Tensor& x) { return unary(Unary::Silu, x); }
inline Tensor gelu(const Tensor& x, bool tanh_approx = false) {
  return unary(tanh_approx ? Unary::GeluTanh : Unary::Gelu, x);
}
inline Tensor scale(const Tensor& x, double alpha) { return unary(Unary::Scale, x, alpha); }
inline Tensor add_scalar(const Tensor& x, double alpha) { return unary(Unary::AddScalar, x, alpha); }
inline Tensor add(const Tensor& a, const Tensor& b) { return binary(Binary::Add, a, b); }
inline Tensor sub(const Tensor& a, const Tensor& b) { return binary(Binary::Sub, a, b); }
inline Tensor mul(const Tensor& a, const Tensor& b) { return binary(Binary::Mul, a, b); }
inline Tensor div(const Tensor& a, const Tensor& b) { return binary(Binary::Div, a, b); }
inline Tensor silu_backward(const Tensor& grad, const Tensor& x) { return binary(Binary::SiluGrad, grad, x); }
inline Tensor gelu_backward(const Tensor& grad, const Tensor& x, bool tanh_approx = false) {
  return binary(tanh_approx ? Binary::GeluTanhGrad : Binary::GeluGrad, grad, x);
}
// A cast is a copy into another dtype (returns x itself when the dtype already matches).
inline Tensor cast(const Tensor& x, DType t) { return x.to(t); }

// ---- reductions over the last dimension (f32 accumulation for 16-bit dtypes) --------------------
enum class Reduce : uint8_t { Sum, Mean, Max };
Tensor reduce_last(Reduce op, const Tensor& x, bool keepdim = false);
inline Tensor sum(const Tensor& x, bool keepdim = false) { return reduce_last(Reduce::Sum, x, keepdim); }
inline Tensor mean(const Tensor& x, bool keepdim = false) { return reduce_last(Reduce::Mean, x, keepdim); }
inline Tensor max(const Tensor& x, bool keepdim = false) { return reduce_last(Reduce::Max, x, keepdim); }
// Per row of x [R, V] (float): the index of its largest value (the first on ties) and the index of its
// first non-finite value (-1 when all are finite), as i64 [R, 2] — what greedy decoding reads instead
// of the logits.  NaN and infinities never win the argmax (column 1 reports them).
Tensor argmax_checked(const Tensor& x);
// Sum over dimension `dim` (moved last, then reduced).
Tensor sum_dim(const Tensor& x, int64_t dim, bool keepdim = false);
// Sum over every dimension but the last: [..., H] -> [H] (weight gradients).
Tensor sum_leading(const Tensor& x);

// Softmax family over the last dimension; backward ops take the forward's output y.
enum class Softmax : uint8_t { Softmax, LogSoftmax };
Tensor softmax(const Tensor& x);
Tensor log_softmax(const Tensor& x);
Tensor softmax_backward(const Tensor& dy, const Tensor& y);      // y * (dy - sum(dy * y))
Tensor log_softmax_backward(const Tensor& dy, const Tensor& y);  // dy - exp(y) * sum(dy)

// ---- matrix products --------------------------------------------------------------------------
// a: [..., M, K] ([..., K, M] when trans_a), b: [..., K, N] ([..., N, K] when trans_b), or b 2-D and
// shared by every batch.  Leading dims of a and b must match.  Result [..., M, N] in a's dtype,
// accumulated in f32 (f64 for f64) through OpenBLAS on the CPU and cuBLAS on CUDA (no TF32).
Tensor matmul(const Tensor& a, const Tensor& b, bool trans_a = false, bool trans_b = false);

// ---- indexing ---------------------------------------------------------------------------------
// weight [V, H], ids [...] (i32 or i64, each in [0, V)) -> [..., H].  An id out of range throws;
// on CUDA that check waits for the device, and check_ids = false skips the wait (for a CUDA graph,
// with ids known to be good): a bad id's row is then NaN.  The CPU always checks.
Tensor embedding(const Tensor& weight, const Tensor& ids, bool check_ids = true);
// grad [..., H], ids [...] -> grad_weight [V, H] in grad's dtype (f32 accumulation, deterministic:
// each row's terms are added in a fixed order, on the CPU token order, on CUDA token order within
// tiles of 16 to 64 rows sorted by id and the tiles' sums in a fixed tree).  An id out of range
// throws; on CUDA that check waits for the device, and check_ids = false skips the wait (ids known
// to be good): a bad id's terms are then left out.  The CPU always checks.
Tensor embedding_backward(const Tensor& grad, const Tensor& ids, int64_t num_embeddings, bool check_ids = true);
// x [N, V], idx [N] -> [N] with x[i, idx[i]], and 0 where idx[i] == ignore_index.
Tensor gather_last(const Tensor& x, const Tensor& idx, int64_t ignore_index);
// values [N], idx [N] -> [N, V] of zeros with values[i] at [i, idx[i]] (rows with ignore_index stay 0).
Tensor scatter_last(const Tensor& values, const Tensor& idx, int64_t num_classes, int64_t ignore_index);
// idx [N] -> [N] in `dtype`: 1 where idx != ignore_index, else 0.
Tensor valid_mask(const Tensor& idx, int64_t ignore_index, DType dtype);

// ---- shapes -----------------------------------------------------------------------------------
// Concatenation along `dim`; every tensor has one dtype, one device and equal other dims.
Tensor cat(const std::vector<Tensor>& xs, int64_t dim);
// Additive attention mask [q_len, kv_len]: 0 where query i (at absolute position
// i + kv_len - q_len) may see key j, -inf elsewhere.  causal: j <= pos(i); window > 0: also
// pos(i) - j < window (Mistral's sliding window); chunk > 0: also j / chunk == pos(i) / chunk (Llama 4's
// chunked attention, positions counted from key 0).
Tensor attention_mask(int64_t q_len, int64_t kv_len, bool causal, int64_t window, DType dtype, Device device,
                      int64_t chunk = 0);

}  // namespace kcpp::ops
