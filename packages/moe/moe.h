// Dropless mixture-of-experts (package moe, contract "MoE/1", docs/contracts/MoE.md), CPU and CUDA.
//
// Notation: T tokens (rows of x), H hidden, E experts, k = top_k, I the experts' intermediate size,
// S = T k slots; slot s = t k + j is token t's j-th choice.
//
// Router (routing Softmax / Sigmoid):
//   z_t = round(x_t Wr^T)                       Wr = router [E, H]; round = to the dtype (F.linear's output)
//   Softmax: p = softmax(z_t); the k largest p (= the k largest z), descending (ties: lower expert);
//            w_j = p_{e_j}, or p_{e_j} / sum_i p_{e_i} when normalize
//   Sigmoid: the k largest z, descending (ties: lower expert); w_j = sigmoid(z_{e_j})
//   Given:   topk_ids / topk_weights come from the host; an id outside [0, E) marks a slot no expert takes
// Experts, per valid slot s (token t, expert e, weight w; c = w for WeightOn::Output, 1 for Input):
//   x_s = x_t (Output) or round(w x_t) (Input)
//   [g, u] = round(x_s [Wg_e; Wu_e]^T)          Wg_e, Wu_e [I, H] (gate and up rows of gate_up_proj)
//   h_s = round(act(g) * u),  y_s = round(h_s Wd_e^T)        Wd_e = down [H, I]
//   out_t = round(sum_j c_s y_s + sigma_t m_t)  the slots in order j = 0 .. k-1, in f32
//   m_t = round(round(act(g') * u') Wsd^T), [g', u'] = round(x_t [Wsg; Wsu]^T)   (shared expert, optional)
//   sigma_t = sigmoid(x_t . gs) with the shared expert's gate gs [H], else 1
// Every product accumulates in f32; "round" marks where an intermediate that feeds a GEMM (or is
// saved) is rounded to the dtype, as a tensor-core GEMM takes it (identity for f32).
//
// Backward, per valid slot (dout_t the upstream gradient):
//   q_s = dout_t Wd_e,  dh = round(c q_s),  [dg, du] = round([dh * u * act'(g), dh * act(g)])
//   dWd_e += dout_t^T round(c h_s)      dWg_e += dg^T x_s,  dWu_e += du^T x_s
//   dx_s = dg Wg_e + du Wu_e;  dx_t += dx_s (Output) or w dx_s (Input)
//   dw_s = q_s . h_s (Output) or dx_s . x_t (Input)
// the router turns dw into dz (0 off the chosen experts; plus the optional drouter_logits):
//   Softmax: dz = p (dp - p . dp), dp_{e_j} = dw_j;  normalized: dz_{e_j} = w_j (dw_j - sum_i w_i dw_i)
//   Sigmoid: dz_{e_j} = dw_j w_j (1 - w_j)
//   dWr = round(dz)^T x,  dx_t += round(dz_t) Wr
// and the shared expert as an MLP with upstream gradient sigma_t dout_t, its gate's logit getting
//   dl_t = (dout_t . m_t) sigma_t (1 - sigma_t)  (dout . m computed as (dout Wsd) . h'),
//   dgs = sum_t dl_t x_t,  dx_t += dl_t gs.
// dx_t sums its slots in slot order, then the router's and the shared expert's parts.
//
// Permutation: slots grouped by expert, stably (increasing slot order within an expert):
//   offsets[e] = valid slots of lower experts, offsets[E] = valid slots, offsets[E + 1] = S;
//   sorted[p] = the slot at position p (expert e's at [offsets[e], offsets[e+1]), invalid ones last).
// gate_up (optional, saved) holds [g, u] of sorted[p] in row p, [S, 2I]; without it backward
// recomputes the projections.  No result depends on thread timing; nothing synchronizes with the host
// (except the CUDA path's cuBLAS experts: ExpertGemm below).
//
// Backward memory: [dg, du] is formed in place over the [g, u] it is computed from, element by element
// (each is read and then written by one thread): over the recomputed projections in the workspace, or,
// when the host lets it (overwrite_gate_up: the saved gate_up is dead after this call), over the saved
// gate_up itself, whose rows are then [dg, du] by position (CUDA; Padded copies a group of experts'
// rows at a time into padded rows for its products: Padded's groups, below).  The CPU computes
// [dg, du] in f32 over its widened copy of [g, u] and leaves the saved tensor unread after that copy.
//
// CUDA (moe_cuda.cu, moe_gemm.cuh): bf16 / f16 only (tensor-core GEMMs); it also rounds each slot's
// dx_s to the dtype before the per-token sum (the CPU keeps it in f32).  Its cuBLAS paths (ExpertGemm
// below) round q_s to the dtype too (the GEMM's output) before dh and dw are formed from it, and where
// gate and up are not one [2I, H] stack in memory (separate gate_proj / up_proj) dx_s is
// round(round(dg Wg_e) + du Wu_e).
//
// Layout.  x, out, dout, dx: rows of H elements x_stride (...) apart, H contiguous.  Weights: a Matrix
// (below) whose row or column stride is 1, so that both Transformers layouts ([E, 2I, H] and Llama 4's
// [E, H, 2I] seen transposed) are read in place; weight gradients likewise.  router, drouter [E, H]
// and router_logits [T, E] contiguous.
//
// Load-balancing loss (op load_balancing_loss): R rows of logits z_r [E], mask weights m_r:
//   p_r = round(softmax(z_r)) (to the logits' dtype), K_r = the k largest p_r (ties: lower index),
//   Rt = sum_r m_r, f_e = sum_r m_r [e in K_r] / Rt, P_e = sum_r m_r p_{r,e} / Rt,
//   loss = E sum_e f_e P_e,  dz_r = p_r (d_r - p_r . d_r), d_{r,e} = grad_scale E f_e m_r / Rt.
#pragma once

#include <cstddef>
#include <cstdint>

#include "kcpp/kernel/activation.h"
#include "kcpp/kernel/types.h"

#if KCPP_WITH_CUDA
#include <cuda_runtime.h>
#endif

// The layout rules below run on the host and, in the CUDA forward, on the device too.
#if defined(__CUDACC__)
#define KCPP_MOE_HD __host__ __device__
#else
#define KCPP_MOE_HD
#endif

namespace kcpp::moe {

enum class Routing : int32_t { Softmax = 0, Sigmoid = 1, Given = 2 };
enum class WeightOn : int32_t { Output = 0, Input = 1 };

// A stack of per-expert matrices: element (r, c) of expert e at
//   data + e * expert_stride + r * row_stride + c * col_stride   (elements of the call's dtype),
// with row_stride == 1 or col_stride == 1.  For a single matrix (the shared expert) expert_stride is unused.
struct Matrix {
  void* data = nullptr;  // read-only where the matrix is an input
  int64_t expert_stride = 0, row_stride = 0, col_stride = 1;
};

// The storage order of a rows x cols matrix with strides (rs, cs): false = rows of contiguous
// elements (ld = rs), true = contiguous columns (ld = cs).  A dim of extent 1 may have any stride
// (ld is then the other extent).  Returns false when neither stride is 1 or the lines overlap.
inline bool matrix_storage(int64_t rows, int64_t cols, int64_t rs, int64_t cs, bool* col_major, int64_t* ld) {
  if (cs == 1 || cols <= 1) {
    *col_major = false;
    *ld = rows <= 1 ? (cols > 1 ? cols : 1) : rs;
    return rows <= 1 || rs >= cols;
  }
  if (rs == 1 || rows <= 1) {
    *col_major = true;
    *ld = cols <= 1 ? (rows > 1 ? rows : 1) : cs;
    return cols <= 1 || cs >= rows;
  }
  return false;
}

// How the CUDA path runs the experts' GEMMs (moe_cuda.cu):
//   Kernel   the package's grouped GEMMs, the gated activation and the backward's GLU in their
//            epilogues; the group sizes stay on the device (no host sync).  On compute capability 9.0
//            (a build with sm_90a) the forward's two products run on a Hopper kernel
//            (moe_gemm_sm90.cuh: TMA, wgmma, persistent warp-specialized blocks) over the token rows
//            gathered by position, where the weights are contiguous along K with 16-byte strides
//            (KCPP_MOE_SM90=0 turns it off; =1 requires it, a product it cannot take failing the call);
//            everything else on mma.sync (moe_gemm.cuh).
//   Loop     cuBLAS, one cublasGemmEx per expert that received tokens.
//   Grouped  cuBLAS, one cublasGemmGroupedBatchedEx per projection (experts with equal counts form
//            one group of the call).
//   Padded   cuBLAS, one cublasGemmStridedBatchedEx per projection over the experts first .. last
//            that received tokens (padded_layout below), each given M rows: its rows, then rows of
//            zeros (an expert in that range without tokens: M rows of zeros, so its weight gradient
//            comes out exactly 0).  Zero rows add nothing to a weight gradient's sum over rows, and
//            the kernels between the products write 0 into the padding rows of h, dgu and c h (no
//            activation is evaluated there); the routing weights, combine and dw read real rows only.
//            The workspace holds padded_rows_cap(S, E, asked) rows (workspace_padded_rows: none under
//            Auto where its rule never takes Padded); a call whose layout needs more runs Grouped.
//   Auto     the environment's KCPP_MOE_GEMM (kernel, loop, grouped, padded or auto) when set; else
//            for the forward on compute capability 9.0, Kernel on its Hopper kernel up to
//            kSm90AutoRows slots an expert on average, where no Loop rule below holds whatever the
//            counts (bench/RESULTS.md has the sizes it is ahead at); else
//            choose_expert_gemm() from the counts read back:
//            Loop when one expert's GEMM has at least one 128 x 128 tile per multiprocessor, counting
//            either its average rows against min(H, I) or its weight's H x I (a few large experts,
//            each filling the GPU on its own, or, at decode sizes, streaming weights large enough to);
//            else Padded when its rows exceed the routed rows by at most 15%: the padded products do
//            that much more arithmetic, in one strided launch per product whose tiles all have the
//            same shape, where Grouped runs one small kernel per group of equal counts (many at
//            many small experts); more padding (a skewed routing, or at decode sizes a range of
//            experts mostly without tokens, whose weights the padded call would still stream) is
//            left to Grouped.
// The cuBLAS paths read the expert offsets back to the host (one wait for that copy a call, while
// the forward's token rows and the backward's dout rows are gathered over the same layout decided on
// the device by these functions; the backward synchronizes the stream instead where x by row must
// pass through dout's buffer first); offsets that are no grouping of the S slots
// (expert_offsets[0] != 0, decreasing, expert_offsets[E] > S) are refused there, the device's plan
// gathering nothing for them meanwhile, and so is a layout that needs more rows than the workspace
// holds.
// While the stream is being captured into a CUDA graph that is not allowed: every choice runs Kernel.
enum class ExpertGemm : int32_t { Auto = 0, Kernel = 1, Loop = 2, Grouped = 3, Padded = 4 };

// Auto's forward takes the Hopper kernel up to this many slots an expert on average (S <= 512 E:
// 8,192 tokens top-8 over 128 experts; measured on an H200 at Qwen3-30B-A3B's dims it is ahead of
// cuBLAS's paths from 1 to 4,096 tokens and level at 8,192).  So the forward's workspace
// (moe_workspace) depends, as Padded's rows do, on the current device and the environment
// (KCPP_MOE_SM90, KCPP_MOE_GEMM): size it on the device and with the settings of the call.
constexpr int64_t kSm90AutoRows = 512;

// Padded's rows per expert are a multiple of this (16-byte aligned rows of every buffer).
constexpr int64_t kPaddedRowMultiple = 8;

// The padded layout of a call's expert counts (offsets [E + 1], increasing): the experts first ..
// first + experts - 1 (the first and the last that received slots), each `rows` rows (the largest
// count rounded up to kPaddedRowMultiple); all 0 when no expert received a slot.
struct PaddedLayout {
  int64_t first = 0, experts = 0, rows = 0;
};
KCPP_MOE_HD inline PaddedLayout padded_layout(const int32_t* offsets, int64_t experts) {
  PaddedLayout l;
  int64_t first = -1, last = -1, most = 0;
  for (int64_t e = 0; e < experts; ++e) {
    const int64_t n = static_cast<int64_t>(offsets[e + 1]) - offsets[e];
    if (n <= 0) continue;
    if (first < 0) first = e;
    last = e, most = most > n ? most : n;
  }
  if (first < 0) return l;
  l.first = first, l.experts = last - first + 1;
  l.rows = (most + kPaddedRowMultiple - 1) / kPaddedRowMultiple * kPaddedRowMultiple;
  return l;
}
// The rows of the padded buffers in the workspace.  The count M is known only after the read-back,
// while the workspace is sized before the call: this bound is what a call may use.  Padded asked for
// (`asked`): S + S / 4 + 16 E (the routed rows, a quarter more, and 16 per expert for the rounding and
// for small calls); under Auto: floor(23 S / 20), exactly what Auto's rule takes (at most 15% over the
// routed rows, which are at most S), so that the default costs no memory it cannot use.
KCPP_MOE_HD inline int64_t padded_rows_cap(int64_t slots, int64_t experts, bool asked) {
  return asked ? slots + slots / 4 + 16 * experts : slots * 23 / 20;
}
// Whether Auto's rule takes Loop whatever the counts: one expert's weight H x I alone has at least one
// 128 x 128 tile per multiprocessor (Mixtral-8x7B's 4096 x 14336 on any current GPU).
KCPP_MOE_HD inline bool auto_always_loop(int64_t hidden, int64_t inter, int64_t sms) {
  return ((hidden + 127) / 128) * ((inter + 127) / 128) >= sms;
}
// Whether the expert offsets group the S slots: expert_offsets[0] = 0, never decreasing,
// expert_offsets[E] <= S.  The host refuses other offsets once read back; the planning kernel
// gathers no rows for them meanwhile.
template <typename I> KCPP_MOE_HD inline bool offsets_group_slots(const I* offsets, int64_t experts, int64_t slots) {
  if (offsets[0] != 0 || offsets[experts] > slots) return false;
  for (int64_t e = 0; e < experts; ++e)
    if (offsets[e + 1] < offsets[e]) return false;
  return true;
}
// The cuBLAS path of a call (a pure function of the counts: the host runs it on the counts read back,
// the planning kernel on the device's, testable on the host): `asked` Loop or Grouped as
// is; Padded when the layout fits padded_rows_cap(.., true), else Grouped; Auto by the rule above
// (sms: the device's multiprocessors).  Returns Loop, Grouped or Padded.
KCPP_MOE_HD inline ExpertGemm choose_expert_gemm(ExpertGemm asked, const int32_t* offsets, int64_t experts, int64_t hidden,
                                                 int64_t inter, int64_t slots, int64_t sms) {
  if (asked != ExpertGemm::Padded && asked != ExpertGemm::Auto) return asked == ExpertGemm::Loop ? asked : ExpertGemm::Grouped;
  const PaddedLayout l = padded_layout(offsets, experts);
  const int64_t padded = l.experts * l.rows;
  const bool fits = padded <= padded_rows_cap(slots, experts, asked == ExpertGemm::Padded);
  if (asked == ExpertGemm::Padded) return fits ? ExpertGemm::Padded : ExpertGemm::Grouped;
  int64_t used = 0;
  for (int64_t e = 0; e < experts; ++e) used += offsets[e + 1] > offsets[e];
  if (used == 0) return ExpertGemm::Loop;  // nothing to run
  const int64_t valid = static_cast<int64_t>(offsets[experts]) - offsets[0];
  const int64_t avg = valid / used, narrow = hidden < inter ? hidden : inter;
  if (((avg + 127) / 128) * ((narrow + 127) / 128) >= sms || auto_always_loop(hidden, inter, sms)) return ExpertGemm::Loop;
  return fits && padded * 20 <= valid * 23 ? ExpertGemm::Padded : ExpertGemm::Grouped;
}
// The rows of Padded's buffers a CUDA call's workspace holds (0: none, the buffers by row hold S):
// padded_rows_cap(S, E, true) for Padded asked for, for Auto padded_rows_cap(S, E, false) unless
// auto_always_loop (then Padded is never taken and nothing is held for it), 0 for Kernel, Loop, Grouped.
int64_t workspace_padded_rows(ExpertGemm asked, int64_t slots, int64_t experts, int64_t hidden, int64_t inter, int64_t sms);
// Loop's smaller buffers.  Where a call's path is Loop whatever the counts (Loop asked for, or Auto
// where auto_always_loop), a few large experts make the [rows, I] buffers the largest part of the
// workspace; there they hold a slice no larger than half of the [rows, H] buffer it holds anyway:
//   the training forward (gate_up saved) forms h = round(act(g) u) window_rows at a time, an expert's
//     rows in windows (rows independent: the same values);
//   the backward forms q, c h and dW_down chunk_cols columns of I at a time (dW_down's columns are
//     whole sums over the rows; q . h's row sums add the chunks' sums in order).
// Mixtral-8x7B (H 4096, I 14336, 16,384 slots): windows of 2,336 rows, chunks of 2,048 columns, 64
// MiB each where [S, I] is 448.  Under CUDA graph capture (every path then runs the package's GEMM,
// which needs whole buffers) a call with such a workspace, or with Padded's groups (below), is
// refused by name: a call to be captured sizes its workspace with ExpertGemm::Kernel, as the
// package's forward and backward do on a capturing stream.
// loop_window_rows: rows when I <= H / 2, else rows * H / (2 I) rounded down to a multiple of 8, at
// least 8, at most rows;
// loop_chunk_cols: with c = H / 2 rounded down to a multiple of 8 (at least 8), I when I <= c, else I
// in n = ceil(I / c) chunks of ceil(I / n) rounded up to a multiple of 8.
int64_t loop_window_rows(int64_t rows, int64_t hidden, int64_t inter);
int64_t loop_chunk_cols(int64_t hidden, int64_t inter);
// Padded's groups.  Where Padded may run (workspace_padded_rows > 0) with gate_up saved, the training
// forward forms [g, u] and h (its [rows, 2I] buffer), and the backward with overwrite_gate_up its
// [dg, du] by padded row, for a group of consecutive experts of the padded range at a time: as many
// as padded_group_rows hold (at least one), one strided-batched product a group.  [dg, du] is then
// formed over the saved gate_up by position and copied a group at a time into padded rows (without
// overwrite_gate_up it has padded rows of its own, and the products run by the same groups).  A call
// whose padded rows of one expert are more than a group holds runs Grouped instead of Padded.  The
// training forward on any path but Padded then forms h an expert's rows at a time in windows of
// 2 padded_group_rows rows (Loop's windows, above).  Qwen3-30B-A3B (8192 tokens, top-8, I 768): groups of 18,848 rows, 55 MiB where
// [rows, 2I] was 221.
// padded_group_rows: a quarter of the padded rows, rounded up to a multiple of 8.
int64_t padded_group_rows(int64_t padded_rows);

struct MoeParams {
  kernel::DType dtype = kernel::DType::bf16;
  int64_t tokens = 0, hidden = 0, experts = 0, top_k = 0, inter = 0;
  int64_t shared_inter = 0;  // Is; 0: no shared expert
  Routing routing = Routing::Softmax;
  bool normalize = false;
  WeightOn weight_on = WeightOn::Output;
  kernel::Activation act = kernel::Activation::Silu;

  const void* x = nullptr;  // [T, H]
  int64_t x_stride = 0;
  const void* router = nullptr;  // [E, H] contiguous (Softmax, Sigmoid)
  Matrix gate, up;               // E x [I, H]
  Matrix down;                   // E x [H, I]
  Matrix shared_gate, shared_up;  // [Is, H]
  Matrix shared_down;             // [H, Is]
  const void* shared_expert_gate = nullptr;  // [H] contiguous, optional

  // Forward outputs; saved for backward (inputs there).
  void* out = nullptr;  // [T, H]
  int64_t out_stride = 0;
  void* router_logits = nullptr;  // [T, E], dtype; forward: optional (then workspace)
  void* topk_ids = nullptr;       // [S]: i32 written by the router; Given: read, i32 or i64
  bool ids_i64 = false;
  void* topk_weights = nullptr;  // [S]: f32 written by the router; Given: read, f32 or the dtype
  bool weights_f32 = true;
  int32_t* expert_offsets = nullptr;  // [E + 2]; forward: optional (then workspace)
  int32_t* sorted_slots = nullptr;    // [S]; forward: optional (then workspace)
  void* gate_up = nullptr;            // [S, 2I], dtype, optional
  // Backward: the saved gate_up is dead after this call, and may be written over (its contents are
  // then unspecified).  Needs gate_up.  On CUDA the workspace (moe_workspace()) then holds no [dg, du]
  // rows of its own, only a group's padded rows where Padded may run (Padded's groups, above).
  bool overwrite_gate_up = false;

  // Backward.
  const void* dout = nullptr;  // [T, H]
  int64_t dout_stride = 0;
  const void* drouter_logits = nullptr;  // [T, E], optional, f32 or the dtype
  bool drouter_logits_f32 = true;
  void* dx = nullptr;  // [T, H]
  int64_t dx_stride = 0;
  void* drouter = nullptr;  // [E, H] contiguous, optional
  Matrix dgate, dup, ddown;  // optional (data null): the shapes of gate, up, down
  Matrix dshared_gate, dshared_up, dshared_down;
  void* dshared_expert_gate = nullptr;  // [H], optional
  float* dtopk_weights = nullptr;       // [S], optional

  ExpertGemm expert_gemm = ExpertGemm::Auto;  // CUDA only
  void* workspace = nullptr;  // moe_workspace() bytes, 256-byte aligned
};

inline int64_t moe_slots(const MoeParams& p) { return p.tokens * p.top_k; }

// Checks the params (shapes, strides, options); nullptr or the message.
const char* moe_check(const MoeParams& p, bool backward);
// Workspace bytes of a forward or backward call (on CUDA when `cuda`).
size_t moe_workspace(const MoeParams& p, bool backward, bool cuda);

const char* moe_forward_cpu(const MoeParams& p);
const char* moe_backward_cpu(const MoeParams& p);
// Why the CUDA path cannot take this (valid) call, or nullptr: f32 (the GEMMs are bf16 / f16 tensor-core
// ones), more than 1024 experts, gate and up (or their gradients) given with different strides, more
// than ~8M slots.  The host runs its reference then.
const char* moe_cuda_unsupported(const MoeParams& p, bool backward);
#if KCPP_WITH_CUDA
const char* moe_forward_cuda(const MoeParams& p, cudaStream_t stream);
const char* moe_backward_cuda(const MoeParams& p, cudaStream_t stream);
size_t moe_workspace_cuda(const MoeParams& p, bool backward);
// Null when the forward's Hopper grouped GEMM can run on the current device (a build with its sm_90a
// code, compute capability 9.0, the driver's tensor-map encoder), KCPP_MOE_SM90 aside; else why not.
const char* moe_sm90_unavailable();
#endif

// ---- the auxiliary loss --------------------------------------------------------------------------

enum class MaskType : int32_t { None = 0, U8 = 1, I32 = 2, I64 = 3, F32 = 4 };

struct LoadBalancingParams {
  kernel::DType dtype = kernel::DType::bf16;  // of the logits
  int64_t rows = 0, experts = 0, top_k = 0;
  const void* logits = nullptr;  // [rows, E]
  int64_t logits_stride = 0;
  const void* mask = nullptr;  // [mask_len]; row r reads mask[r % mask_len]
  MaskType mask_type = MaskType::None;
  int64_t mask_len = 0;
  float grad_scale = 1.0f;
  float* loss = nullptr;     // [1]
  void* dlogits = nullptr;   // [rows, E] contiguous, optional
  bool dlogits_f32 = true;   // else the logits' dtype
  void* workspace = nullptr;  // load_balancing_workspace() bytes
};

const char* load_balancing_check(const LoadBalancingParams& p);
size_t load_balancing_workspace(const LoadBalancingParams& p, bool cuda);
const char* load_balancing_cpu(const LoadBalancingParams& p);
const char* load_balancing_cuda_unsupported(const LoadBalancingParams& p);  // more than 1024 experts
#if KCPP_WITH_CUDA
const char* load_balancing_cuda(const LoadBalancingParams& p, cudaStream_t stream);
size_t load_balancing_workspace_cuda(const LoadBalancingParams& p);
#endif

}  // namespace kcpp::moe
