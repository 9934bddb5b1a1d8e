// The state-space language models Mamba (`MambaForCausalLM`) and Falcon-Mamba
// (`FalconMambaForCausalLM`) from a Hugging Face folder, their mixers' scan and convolution in nn/
// slots (nn/ssm_layers.h) so that kernelize() swaps them.  The forward follows Transformers' slow
// (PyTorch) path of `models/mamba/modeling_mamba.py` and `models/falcon_mamba/` op for op:
//
//   h = embed(ids)
//   per layer:  a = RMSNorm(h);  x, z = split(a W_in^T (+ b_in))                     [B, D, L] each
//               x = silu(conv1d_causal(x))                                (CausalConv1d slot)
//               dt, B, C = split(x W_x^T)                     (Falcon: dt, B, C RMS-normalised, weight 1)
//               y = scan(x, dt W_dt^T, A = -exp(A_log), B, C, D, z, dt_bias, softplus)  (SelectiveScan slot)
//               h = h + y W_out^T (+ b_out)
//   logits = RMSNorm(h) W_lm^T   (W_lm = embed when tied)
//
// Transformers' residual_in_fp32 (config.json; true for the released models) with 16-bit weights:
// the residual stream h is f32 (the embedding's output widened), each layer's norm reads h rounded to
// the model's dtype, the mixer's output is added in f32, and the final norm runs in f32 with its
// weight widened, its output rounded to the dtype for the head — MambaBlock's and MambaRMSNorm's
// arithmetic on an f32 input.  The final norm then runs through ops::rms_norm_* rather than its slot
// (the RMSNorm contract takes one dtype).  Without the flag, or in f32, h keeps the model's dtype.
//
// Generation keeps per layer the last conv_kernel - 1 inputs of the convolution and the SSM state,
// and decodes through the CausalConv1dUpdate and SelectiveStateUpdate slots; on CUDA in bf16 / f16
// (up to 4 rows) a one-token step runs instead as four launches a layer (ops/nn/mamba_decode.h: the
// norm, in_proj and the convolution; x_proj; dt_proj with the state update; out_proj), the same
// maths with the slots' kernels bypassed as CausalLM's fused decode bypasses its own
// (KCPP_MAMBA_DECODE_FUSED=0 keeps the slots).
#pragma once

#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <nlohmann/json_fwd.hpp>
#include <optional>
#include <string>
#include <vector>

#include "models/causal_lm.h"
#include "nn/layers.h"
#include "nn/ssm_layers.h"

namespace kcpp::models {

// config.json of model_type "mamba" or "falcon_mamba" (Transformers' MambaConfig /
// FalconMambaConfig keys and defaults).
struct MambaConfig {
  std::string model_type;  // "mamba" or "falcon_mamba"
  int64_t vocab_size = 50280, hidden_size = 768, state_size = 16, num_hidden_layers = 32;
  int64_t expand = 2, intermediate_size = 0, conv_kernel = 4, time_step_rank = 0;
  bool use_bias = false, use_conv_bias = true, tie_word_embeddings = true, residual_in_fp32 = true;
  double layer_norm_epsilon = 1e-5;
  std::optional<double> mixer_rms_eps;  // falcon_mamba: the eps of the dt / B / C norms (1e-6 by default)
  std::string hidden_act = "silu";
  int64_t max_position_embeddings = 1 << 20;  // no positional limit; a bound for generate()
  std::string torch_dtype = "float32";
  std::vector<int64_t> bos_token_id, eos_token_id;
  std::optional<int64_t> pad_token_id;

  // Every value in its range, else a kcpp::Error naming `where`, the key, the value and the range.
  void validate(const std::string& where = "config") const;
  // intermediate_size = expand x hidden_size when absent, time_step_rank "auto" = ceil(hidden / 16).
  static MambaConfig from_json(const nlohmann::json& j, const std::string& where = "config.json");
  static MambaConfig from_folder(const std::filesystem::path& folder);
  nlohmann::json to_json() const;
};

// Whether a folder's config.json names a Mamba-family model_type (for the CLI's dispatch).
bool is_mamba_folder(const std::filesystem::path& folder);

class MambaLM : public nn::Module {
 public:
  static std::unique_ptr<MambaLM> from_folder(const std::filesystem::path& folder, DType dtype, Device device,
                                              const LoadOptions& options = {});

  // Per layer: conv [B, D, conv_kernel - 1] (the last inputs of the convolution, oldest first) and
  // ssm [B, D, N] f32 (the state after the last token).
  struct Cache {
    std::vector<Tensor> conv, ssm;
    // Each layer's A = -exp(A_log), made at the first decoding step, and the final norm's weight
    // widened to f32 (residual_in_fp32), made at the first forward: the weights do not change while a
    // cache decodes, so a step does not launch them again.
    std::vector<Tensor> A;
    Tensor final_weight_f32;
    int64_t length = 0;
    // One-token steps that ran as the fused step (ops/nn/mamba_decode.h), counted on the host: a CUDA
    // graph's capture counts once, its replays not at all.
    int64_t fused_steps = 0;
    // The next forward's ids are the model's own picks (in range by construction): the embedding skips
    // its range check, which waits for the device and so cannot be captured in a CUDA graph.
    bool picked_ids = false;
    void clear() {
      conv.clear(), ssm.clear(), A.clear(), final_weight_f32 = Tensor(), length = 0, fused_steps = 0, picked_ids = false;
    }
  };

  // logits [B, S, V] for input_ids [B, S]; with a cache, continuing the tokens it holds.
  Tensor forward(const Tensor& input_ids, Cache* cache = nullptr);
  // As CausalLM::generate (batch of one; greedy or sampled; stops at a token of `stop`, default the
  // config's eos_token_id).  On CUDA the first one-token step runs eagerly and every later one
  // replays a CUDA graph (KCPP_DECODE_GRAPHS=0: every step eager).  `stats`: the prompt's forward to
  // the first new token, then the one-token steps after it (CausalLM's fields; one prefill).
  std::vector<int64_t> generate(const std::vector<int64_t>& prompt, int64_t max_new_tokens, const Sampling& sampling = Sampling(),
                                const std::vector<int64_t>* stop = nullptr, StopReason* reason = nullptr,
                                CausalLM::GenerationStats* stats = nullptr);
  // Several prompts, as CausalLM::generate_batch: each prompt's forward alone (no padding enters a
  // state), then one-token steps for all rows together (a CUDA graph a batch size), a finished row
  // keeping its place (its picks dropped) until half the batch has finished, when the live rows'
  // states are kept and the rest dropped.  Row i samples with seed
  // sampling.seed + i, so it makes the tokens generate() makes for it alone with that seed, up to the
  // batched products' roundings.  on_token(row, token) sees each new token as it is picked.  Stats:
  // prefills counts the prompts; the first token comes after every prompt's forward.
  std::vector<CausalLM::Generated> generate_batch(const std::vector<std::vector<int64_t>>& prompts, int64_t max_new_tokens,
                                                  const Sampling& sampling = Sampling(), const std::vector<int64_t>* stop = nullptr,
                                                  const std::function<void(size_t, int64_t)>& on_token = {},
                                                  CausalLM::GenerationStats* stats = nullptr);
  // ForCausalLMLoss of forward(input_ids) against labels [B, S].
  Tensor loss(const Tensor& input_ids, const Tensor& labels);
  // The loss (the labelled tokens' mean, or with Reduction::Sum their sum: no NaN for a batch without
  // labels) times dloss, and every parameter's gradient by its safetensors name
  // ("backbone.layers.0.mixer.A_log").  `ready`, if set, is called with each gradient as soon as the
  // backward has made it whole: an untied head's and the final norm's first, then each layer's (the
  // last layer first), the embedding last; the same order on every call (data parallelism sums
  // buckets during the backward).  Every gradient is also in the result.
  CausalLM::Gradients loss_and_gradients(const Tensor& input_ids, const Tensor& labels, double dloss = 1.0,
                                         ops::Reduction reduction = ops::Reduction::Mean,
                                         const CausalLM::GradientReady& ready = {});
  // As CausalLM's (models/parameter_use.h): set by ZeRO-3 (train/data_parallel.h) and, with the
  // parameters' all-gather deferred into the next forward, by ZeRO-1 / 2; called around each use of a
  // group in that order.  A forward with a cache (generation) is refused while it is set.
  ParameterUse parameter_use;
  // Activation checkpointing per layer, as CausalLM's: the forward of loss_and_gradients keeps only
  // each layer's input and the backward runs the layer's forward again (the same slots, so the same
  // values) before its backward: one layer's activations at a time for an extra forward.
  bool checkpoint_layers = false;

  void visit_slots(const std::function<void(nn::Slot&)>& fn) override;
  // Every parameter by its safetensors name (handles: writing into one updates the model; a tied
  // lm_head is the embedding and is listed once).
  std::vector<std::pair<std::string, Tensor>> parameters() const;
  // A Hugging Face folder Transformers loads: config.json (dtype = the model's) and model.safetensors.
  void save(const std::filesystem::path& folder) const;

  const MambaConfig& config() const { return cfg_; }
  const std::vector<std::string>& unused_weights() const { return unused_weights_; }
  DType dtype() const { return dtype_; }
  Device device() const { return device_; }

  struct Layer {
    std::unique_ptr<nn::RMSNorm> norm;
    Tensor w_in, b_in, conv_w, conv_b, w_x, w_dt, b_dt, A_log, D, w_out, b_out;
    Tensor conv_w3;  // conv1d.weight as stored, [D, 1, W]; conv_w is its [D, W] view
    std::unique_ptr<nn::RMSNorm> dt_norm;  // falcon_mamba: weight 1 over time_step_rank
    std::unique_ptr<nn::CausalConv1d> conv;
    std::unique_ptr<nn::CausalConv1dUpdate> conv_update;
    std::unique_ptr<nn::SelectiveScan> scan;
    std::unique_ptr<nn::SelectiveStateUpdate> state_update;
  };

 private:
  MambaLM() = default;
  struct LayerTape;
  Tensor layer_forward(size_t li, const Tensor& h, LayerTape* t, Cache* cache);
  // The fused one-token step (the header comment) over every layer, from the residual h [B, 1, H]:
  // returns the residual after the last layer.  decode_fused_possible: whether it takes `rows` rows.
  Tensor decode_layers_fused(const Tensor& h, Cache& cache);
  bool decode_fused_possible(int64_t rows) const;
  // Layer li's A = -exp(A_log), made once a cache (the weights do not change while it decodes).
  const Tensor& cached_A(Cache& cache, size_t li) const;
  // tapes: every layer's saved activations; inputs: only each layer's input (checkpointing).
  // The head group in use from the final norm on, held by `head` when given (its caller reads the
  // lm_head after), else released on return.
  Tensor hidden_states(const Tensor& input_ids, std::vector<LayerTape>* tapes, nn::RMSNorm::Saved* final_saved, Cache* cache,
                       std::vector<Tensor>* inputs = nullptr, GroupInUse* head = nullptr);
  Tensor shifted_targets(const Tensor& labels) const;
  // residual_in_fp32 in effect: the flag with 16-bit weights (the header comment).
  bool f32_residual() const { return cfg_.residual_in_fp32 && dtype_ != DType::f32 && !layers_.empty(); }
  // The final norm of h (the residual stream), and its backward, in either mode.
  Tensor final_norm_forward(const Tensor& h, nn::RMSNorm::Saved* saved, Cache* cache);
  nn::RMSNorm::Grads final_norm_backward(const Tensor& dy, const nn::RMSNorm::Saved& saved);

  MambaConfig cfg_;
  DType dtype_ = DType::f32;
  Device device_ = Device::cpu();
  Tensor embed_, lm_head_;
  std::vector<Layer> layers_;
  std::unique_ptr<nn::RMSNorm> final_norm_;
  std::unique_ptr<nn::ForCausalLMLoss> loss_;
  std::vector<std::string> unused_weights_;
};

}  // namespace kcpp::models
