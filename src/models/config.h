// A Llama-family model's configuration, read from a Hugging Face `config.json`.
//
// Families (model_type): llama (Llama 2 / 3), mistral, qwen2, qwen3 (q/k norm), gemma (offset norm,
// GeGLU-tanh, embeddings scaled by sqrt(hidden)), phi3 (fused qkv and gate_up), and the
// mixture-of-experts families mixtral (Mistral with an MoE MLP in every layer), qwen3_moe (Qwen3
// with MoE MLPs in the layers decoder_sparse_step and mlp_only_layers pick) and qwen2_moe (Qwen2's
// attention, q/k/v biases by qkv_bias, MoE MLPs picked likewise, each with a shared expert scaled by
// a sigmoid gate), and llama4_text (Llama 4's language model: MoE layers every interleave_moe_layer_step
// or as moe_layers lists, sigmoid routing weights on the experts' inputs and a shared expert, dense
// MLPs of intermediate_size_mlp elsewhere; NoPE layers, RoPE in interleaved pairs with an L2 q/k norm,
// chunked attention and attention temperature tuning; a `llama4` folder's text_config is read as
// one).  Keys and defaults
// follow Transformers' configuration classes of those families; what a family fixes (Gemma's norm
// offset, Qwen2's q/k/v bias) is set here, so the model code reads one struct.
#pragma once

#include <cstdint>
#include <filesystem>
#include <nlohmann/json_fwd.hpp>
#include <optional>
#include <string>
#include <vector>

namespace kcpp::models {

// RoPE scaling as the config's "rope_scaling" says (Transformers' rope_type): none, linear (positions
// divided by factor), dynamic (NTK: theta grows with the sequence past the original length), llama3
// (frequencies scaled by wavelength band).
struct RopeScaling {
  enum class Type { None, Linear, Dynamic, Llama3 };
  Type type = Type::None;
  double factor = 1.0;
  double low_freq_factor = 1.0, high_freq_factor = 4.0;  // llama3
  int64_t original_max_position_embeddings = 0;          // llama3, dynamic (0: max_position_embeddings)

  // factor finite and >= 1; llama3: both frequency factors finite and positive, high above low, an
  // original length; the error names `where` and the key.
  void validate(const std::string& where) const;
};

struct ModelConfig {
  std::string model_type;  // "llama", "mistral", "qwen2", "qwen3", "gemma", "phi3", "mixtral", "qwen3_moe", "qwen2_moe",
                           // "llama4_text"
  int64_t vocab_size = 0, hidden_size = 0, intermediate_size = 0, num_hidden_layers = 0;
  int64_t num_attention_heads = 0, num_key_value_heads = 0, head_dim = 0;
  int64_t max_position_embeddings = 2048;
  double rms_norm_eps = 1e-6, rope_theta = 10000.0, partial_rotary_factor = 1.0;
  RopeScaling rope_scaling;
  std::string hidden_act = "silu";  // "silu", "gelu", "gelu_pytorch_tanh", ...
  bool tie_word_embeddings = false;
  bool attention_bias = false;      // q/k/v (and o) projections have bias (qwen2: q/k/v always)
  bool qkv_bias_only = false;       // qwen2: bias on q/k/v, none on o; qwen2_moe: as its qkv_bias says
  bool mlp_bias = false;
  bool qk_norm = false;             // qwen3: RMSNorm on each head of q and k
  double norm_offset = 0.0;         // gemma: (1 + w)
  bool scale_embeddings = false;    // gemma: embeddings times sqrt(hidden_size)
  bool fused_qkv = false, fused_gate_up = false;  // phi3
  // Sliding-window attention as each family's Transformers 5 code applies it (from_json): a layer of
  // type "sliding_attention" sees the last `sliding_window` keys (its own included), one of type
  // "full_attention" all of them.  mistral, phi3: every layer slides when sliding_window is set
  // (Mistral's default is 4096, Phi-3's none); qwen2, qwen3: the window is set only with
  // use_sliding_window, and the layers from max_window_layers on slide, unless the config lists
  // layer_types itself; qwen2_moe: likewise with use_sliding_window, but the layers that slide are
  // those below max_window_layers with an even index (Qwen2MoeConfig's rule); llama, gemma: none.
  // Empty layer_types: every layer slides when the window is set.
  std::optional<int64_t> sliding_window;
  std::vector<std::string> layer_types;
  bool use_sliding_window = false;  // qwen2, qwen3, qwen2_moe: kept to write the config back
  int64_t max_window_layers = 28;   // qwen2, qwen3, qwen2_moe: likewise
  // Mixture of experts (mixtral, qwen3_moe, qwen2_moe; num_experts 0 for the dense families): the MoE
  // layers' MLP is a router over num_experts experts of moe_intermediate_size (mixtral:
  // intermediate_size), each token through its num_experts_per_tok best, their outputs weighted by
  // the softmax probabilities (renormalized over the chosen ones: mixtral always, the Qwen families
  // with norm_topk_prob).  qwen3_moe, qwen2_moe: layer i is MoE when it is not in mlp_only_layers and
  // (i + 1) % decoder_sparse_step == 0, the others a dense MLP of intermediate_size.  qwen2_moe: each
  // MoE layer also has a shared expert, a gated MLP of shared_expert_intermediate_size whose output
  // is scaled by sigmoid(x . shared_expert_gate) and added (0: none, the other families).  With
  // output_router_logits, training adds router_aux_loss_coef times Transformers'
  // load_balancing_loss_func over the MoE layers to the loss.
  int64_t num_experts = 0, num_experts_per_tok = 0, moe_intermediate_size = 0, decoder_sparse_step = 1;
  int64_t shared_expert_intermediate_size = 0;
  bool norm_topk_prob = false, output_router_logits = false;
  std::vector<int64_t> mlp_only_layers;
  double router_aux_loss_coef = 0.001;
  // Llama 4 (llama4_text; Llama4TextConfig's keys).  num_experts is num_local_experts, the experts and
  // the shared expert of intermediate_size, the dense layers' MLP of intermediate_size_mlp; layer i is
  // MoE when moe_layers lists it (default: every interleave_moe_layer_step-th layer, i + 1 a multiple
  // of it).  Routing: the num_experts_per_tok largest router logits, each expert's input scaled by
  // sigmoid(logit), plus the shared expert (no gate).  no_rope_layers[i] is 1 for a RoPE layer, 0 for
  // a NoPE one (default: NoPE where i + 1 is a multiple of no_rope_layer_interval).  RoPE layers
  // rotate interleaved pairs (2j, 2j + 1) and, with use_qk_norm (l2_qk_norm), L2-normalize each head
  // of q and k after it (RMS norm without a weight, eps rms_norm_eps); a layer of type
  // "chunked_attention" (default: the RoPE layers when attention_chunk_size is set) sees only the
  // keys of its own chunk of attention_chunk_size positions, causally.  NoPE layers with
  // attn_temperature_tuning scale q at position p by log1p(floor((p + 1) / floor_scale)) * attn_scale + 1.
  // Transformers' Llama 4 adds no auxiliary loss: output_router_logits is read and kept, nothing more.
  // `multimodal`: read from a `llama4` folder (Llama4ForConditionalGeneration), whose text_config this
  // is and whose language model's weights are named "language_model." + the text model's names.
  int64_t intermediate_size_mlp = 0, interleave_moe_layer_step = 1, no_rope_layer_interval = 4;
  std::vector<int64_t> moe_layers, no_rope_layers;
  std::optional<int64_t> attention_chunk_size;
  bool l2_qk_norm = false, attn_temperature_tuning = false, multimodal = false;
  double floor_scale = 8192.0, attn_scale = 0.1;
  std::string torch_dtype = "float32";
  std::vector<int64_t> bos_token_id, eos_token_id;
  std::optional<int64_t> pad_token_id;

  int64_t rotary_dim() const { return static_cast<int64_t>(static_cast<double>(head_dim) * partial_rotary_factor); }
  // Whether layer `layer`'s MLP is a mixture of experts.
  bool moe_layer(int64_t layer) const;
  // The attention window of layer `layer`: the number of keys it sees, 0 for all of them.
  int64_t attention_window(int64_t layer) const;
  // Whether layer `layer` rotates q and k (llama4_text: no_rope_layers; every layer of the others).
  bool rope_layer(int64_t layer) const;
  // The attention chunk of layer `layer` (llama4_text's "chunked_attention" layers), 0 for none.
  int64_t attention_chunk(int64_t layer) const;
  bool is_llama4() const { return model_type == "llama4_text"; }

  // Every value within its range, else a kcpp::Error naming `where`, the key, the value and the
  // range allowed: sizes in [1, 2^24] (heads x head_dim too, so that no weight's element count
  // overflows), num_key_value_heads dividing num_attention_heads, eps, rope_theta and RoPE scaling
  // factors finite and positive, token ids inside the vocabulary, layer_types one per layer; MoE
  // families: num_experts in [1, 2^16], num_experts_per_tok in [1, num_experts], sizes as above,
  // decoder_sparse_step >= 1, mlp_only_layers inside [0, num_hidden_layers), router_aux_loss_coef
  // finite and >= 0; qwen2_moe: shared_expert_intermediate_size in [1, 2^24], partial_rotary_factor 1
  // (its attention rotates the whole head); llama4_text: intermediate_size_mlp in [1, 2^24], moe_layers
  // and no_rope_layers inside the layers (no_rope_layers one 0 / 1 per layer), attention_chunk_size
  // >= 1 where a layer is chunked, floor_scale and attn_scale finite and positive, and no feature it
  // does not run (attention_bias, partial rotary, router jitter, attention dropout).
  // from_json checks every config it reads; CausalLM::random checks the ones built in code.
  void validate(const std::string& where = "config") const;

  // Throws kcpp::Error naming the file and the key: missing or malformed config.json, an unknown
  // model_type, a missing or mistyped key, a value out of its range (validate()).
  static ModelConfig from_json(const nlohmann::json& j, const std::string& where = "config.json");
  static ModelConfig from_folder(const std::filesystem::path& folder);
  nlohmann::json to_json() const;  // what Transformers reads back
};

}  // namespace kcpp::models
