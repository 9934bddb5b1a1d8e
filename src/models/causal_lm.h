// A Llama-family causal language model (llama, mistral, qwen2, qwen3, gemma, phi3, and the
// mixture-of-experts mixtral, qwen3_moe, qwen2_moe, llama4_text) loaded from a Hugging Face folder, its layers in
// nn/ slots so that kernelize() can swap them.  The forward pass follows Transformers' modeling code
// of each family op for op (eager attention):
//
//   h = embed(ids) (* sqrt(hidden) for gemma)
//   per layer:  a = RMSNorm(h);  q, k, v = a Wq^T (+bq), a Wk^T, a Wv^T   (one GEMM: [Wq; Wk; Wv])
//               q, k = RMSNorm_head(q), RMSNorm_head(k)                    (qwen3)
//               q, k = RoPE(q, k)   (inv_freq by the config's rope scaling: linear, dynamic, llama3)
//               h = h + Attention(q, k, v) Wo^T                   (a slot: GQA, causal, window)
//               m = RMSNorm(h);  h = h + down(act(gate(m)) * up(m))          (phi3: fused gate_up)
//                            or h = h + MoE(m)   (mixtral, qwen3_moe, qwen2_moe: the MoE layers, an nn::MoE
//                                                 slot; qwen2_moe's adds sigmoid(m gs^T) shared_expert(m))
//   logits = RMSNorm(h) W_lm^T   (W_lm = embed when tied)
// Llama 4 (llama4_text, Llama4ForCausalLM) differs in the attention and the MLP of each layer:
//               q, k = RoPE(q, k) in interleaved pairs (2j, 2j + 1), then L2Norm_head(q), L2Norm_head(k)
//                                                     (RoPE layers; NoPE layers neither)
//               q = q * (log1p(floor((pos + 1) / floor_scale)) * attn_scale + 1)   (NoPE layers, tuning on)
//               Attention: causal, and on "chunked_attention" layers within the chunk of the query
//               MLP: dense of intermediate_size_mlp, or on MoE layers (nn::MoE, "Llama4TextMoe") the shared
//               expert plus sum_j expert_ej(sigmoid(z_ej) m) over the top-k router logits z
// with its weights named model.layers.N.feed_forward.* (router.weight, experts.gate_up_proj [E, H, 2I],
// experts.down_proj [E, I, H], shared_expert.*, or the dense gate / up / down_proj); a `llama4` folder's
// weights are its language model's, "language_model." + those names (the vision tower is not loaded).
// and the loss is Transformers' ForCausalLMLoss: labels shifted left by one, mean cross-entropy over
// the tokens whose label is not -100; with output_router_logits (MoE families) plus
// router_aux_loss_coef times load_balancing_loss_func over every MoE layer's router logits.
//
// MoE weights: the checkpoint's per-expert matrices (Mixtral's block_sparse_moe.experts.N.w1 / w3 /
// w2, Qwen2-MoE's and Qwen3-MoE's mlp.experts.N.gate_proj / up_proj / down_proj, what Transformers 5
// saves) are stacked at load into Transformers 5's fused parameters mlp.experts.gate_up_proj
// [E, 2I, H] and mlp.experts.down_proj [E, H, I] (folders holding those are read as they are); the
// router is mlp.gate.weight.  parameters(), the gradients and save() use the fused names.  Qwen2-MoE's
// shared expert keeps its checkpoint names (mlp.shared_expert.gate_proj / up_proj / down_proj.weight,
// mlp.shared_expert_gate.weight), gate and up held as one [2Is, H] tensor whose views they are.
#pragma once

#include <filesystem>
#include <functional>
#include <map>
#include <string>
#include <memory>
#include <optional>
#include <vector>

#include "models/config.h"
#include "models/parameter_use.h"
#include "nn/layers.h"

namespace kcpp::models {

// Sampling as Transformers' generate(): temperature 0 = greedy; else softmax(logits / temperature)
// restricted to the top_k tokens (0 = all) and then to the smallest set whose probability reaches
// top_p, sampled with `seed`: drawn on the logits' device by ops::sample_checked (ops/nn/sampling.h),
// keyed by seed + the prompt's index and the position of the new token.
struct Sampling {
  double temperature = 0.0;  // 0 or a positive finite number
  int64_t top_k = 0;         // >= 0
  double top_p = 1.0;        // in (0, 1]
  uint64_t seed = 0;

  // Throws kcpp::Error naming the option and the value when one is outside its range (a negative
  // or NaN temperature, a negative top_k, top_p 0 or above 1).
  void validate() const;
};

// Why generate() stopped.
enum class StopReason {
  MaxNewTokens,   // it generated max_new_tokens
  StopToken,      // it generated a token of `stop`
  ContextLength,  // the sequence reached the model's context length (max_position_embeddings)
};

// How CausalLM::from_folder treats the weight files.  A weight the config needs and the files lack
// is always an error naming every such weight.  A tensor of the files the model does not use (the
// layers past num_hidden_layers, stale buffers, another architecture's weights) is an error naming
// them when `strict`, else a warning listing them, as Transformers reports unexpected weights.  A
// tied model's lm_head.weight is taken as Transformers 5 takes it: equal to the embeddings, tied;
// different, used as an untied head (with a warning).
struct LoadOptions {
  bool strict = false;
  std::function<void(const std::string&)> warn;  // receives the warning; empty: printed on stderr
};

class CausalLM : public nn::Module {
 public:
  // Weights converted to `dtype` on `device`; errors name the folder, file and tensor.
  static std::unique_ptr<CausalLM> from_folder(const std::filesystem::path& folder, DType dtype, Device device,
                                               const LoadOptions& options = {});
  // Fresh weights as Transformers initializes them: N(0, initializer_range) for the embedding and
  // every projection, zero biases, norm weights 1 (0 with Gemma's 1 + w).
  static std::unique_ptr<CausalLM> random(const ModelConfig& config, DType dtype, Device device, uint64_t seed,
                                          double initializer_range = 0.02);

  // The keys and values of the tokens seen so far, per layer and after RoPE, for incremental decoding:
  // storage k[l], v[l] [B, kv_heads, capacity, head_dim] whose first `length` positions hold the
  // tokens, so a step writes its keys in place (the storage doubles when full; `reserve` positions
  // are allocated at once when given).
  // A ragged batch (generate_batch) has `rows`: row r of the storage holds rows[r] tokens, and row i
  // of a step's input (one token per row) is storage row active[i] (every row when `active` is empty).
  // A step over a ragged cache writes each row's new keys at its length and attends over them with
  // ops::decode_attention: `step_rows`, `step_positions` and `step_lengths` ([B] i32 on the model's
  // device) are that step's row indices, write positions and lengths, made once for every layer.
  struct KVCache {
    std::vector<Tensor> k, v;
    int64_t length = 0;
    int64_t reserve = 0;
    std::vector<int64_t> rows, active;
    Tensor step_rows, step_positions, step_lengths;
    int64_t step_max_length = 0;
    // Set for the steps of a captured generation (graph_step), eager ones included: the step
    // tensors above were filled in place before the step, nothing in it waits for the device (its
    // ids are the previous picks, not checked again), and the decode attention's launch is sized by
    // the capacity, so that eager and replayed steps compute alike.
    bool step_ready = false;
    void clear() {
      k.clear(), v.clear(), length = 0, rows.clear(), active.clear();
      step_rows = step_positions = step_lengths = Tensor(), step_max_length = 0;
      step_ready = false;
    }
  };

  // logits [B, S, V] in the model's dtype for input_ids [B, S] (i64 / i32), positions 0 .. S-1; with
  // a cache, the new tokens sit at positions cache.length .. and the cache grows by S.
  Tensor forward(const Tensor& input_ids, KVCache* cache = nullptr);
  // The last position's logits [B, V] only (what generation samples from: the head's GEMM for one
  // position instead of S).  With a ragged cache, one token per row at each row's own position.
  Tensor next_token_logits(const Tensor& input_ids, KVCache* cache);

  // prompt + up to max_new_tokens generated with the KV cache; stops after a token of `stop`
  // (default: the config's eos_token_id) or when the sequence holds max_position_embeddings tokens
  // (the model's context length), and says which in `reason` if given.  Batch of one.  Throws
  // kcpp::Error on a prompt that is empty, longer than the context or has an id outside the
  // vocabulary, on invalid sampling options, and when the model's logits are not finite (NaN or
  // infinite: broken weights or config).
  std::vector<int64_t> generate(const std::vector<int64_t>& prompt, int64_t max_new_tokens, const Sampling& sampling = Sampling(),
                                const std::vector<int64_t>* stop = nullptr, StopReason* reason = nullptr);

  // Many prompts at once, each with its own length and stop: every prompt is prefilled alone (its
  // keys written into its row of one cache), then all unfinished rows decode together, one token per
  // row a step (the GEMMs batched; attention row by row over each row's own length).  A row stops at
  // a token of `stop` (default: eos_token_id), after max_new_tokens, or at the context length.
  // Greedy rows pick on the device (only the ids come back); sampled rows read their logits, with
  // row i's draws seeded by sampling.seed + i.  `on_token(row, token)` sees every new token as it
  // is chosen (streaming).  Prompts are prefilled in groups of similar length (right-padded) and
  // decoded together.  Results equal generate() of each prompt alone, up to the rounding of a
  // batched GEMM.  Throws as generate() does, naming the prompt.
  struct Generated {
    std::vector<int64_t> ids;  // the prompt and its new tokens
    StopReason reason = StopReason::MaxNewTokens;
  };
  struct GenerationStats {
    double prefill_seconds = 0;      // every prompt's prefill, to its first new token
    double first_token_seconds = 0;  // from the call to the first new token of any prompt
    int64_t prefills = 0;            // forwards the prefill took (prompts of similar length share one)
    double decode_seconds = 0;       // the batched steps after the prefills
    int64_t decode_tokens = 0;       // tokens those steps made
    int64_t graph_replays = 0;       // of those steps, how many replayed a captured CUDA graph
  };
  std::vector<Generated> generate_batch(const std::vector<std::vector<int64_t>>& prompts, int64_t max_new_tokens,
                                        const Sampling& sampling = Sampling(), const std::vector<int64_t>* stop = nullptr,
                                        const std::function<void(size_t, int64_t)>& on_token = {},
                                        GenerationStats* stats = nullptr);
  // ForCausalLMLoss of forward(input_ids) against labels [B, S] (f32 scalar).
  Tensor loss(const Tensor& input_ids, const Tensor& labels);

  // The loss and the gradient of `dloss * loss` with respect to every parameter, by the names of
  // the model's safetensors ("model.layers.0.self_attn.q_proj.weight"; a tied lm_head's share is in
  // the embedding's).  What the forward keeps for the backward is set by checkpoint_layers below.
  struct Gradients {
    Tensor loss;
    std::map<std::string, Tensor> grads;
    // With sparse_embedding_gradient (and an untied head): the gradient of the embedding's output,
    // [B * S, H] (row i that of token input_ids.view({-1})[i]), in place of the embedding's gradient
    // embedding_backward(embedding_rows, input_ids, vocab_size); undefined otherwise.
    Tensor embedding_rows;
  };
  // `reduction` Sum: the loss summed over the labelled tokens (for gradient accumulation, where the
  // caller divides by the tokens of the whole accumulated batch through `dloss`).
  // `ready`, when given, is called with each parameter's gradient as soon as the backward has made
  // it whole: the final norm's and an untied head's first, then each layer's (the last layer first:
  // its MLP's, post-attention norm's and o_proj's before the attention's backward, the rest after it),
  // the embedding last; the order is the same on every call (data
  // parallelism reduces gradients in buckets while the backward goes on).  Every gradient is also in
  // the result.
  using GradientReady = std::function<void(const std::string& name, const Tensor& grad)>;
  Gradients loss_and_gradients(const Tensor& input_ids, const Tensor& labels, double dloss = 1.0,
                               ops::Reduction reduction = ops::Reduction::Mean, const GradientReady& ready = {});
  // Sparse embedding gradient (data parallelism sums the ranks' rows instead of their dense [V, H]
  // gradients, train/data_parallel.h): when set and the head is untied, loss_and_gradients returns
  // the embedding's output gradient in Gradients::embedding_rows and leaves the embedding out of
  // `grads` and of `ready`.  A tied head adds a dense gradient to the embedding's: there it is unused.
  bool sparse_embedding_gradient = false;
  // Activation checkpointing per layer: the forward of loss_and_gradients keeps only each layer's
  // input and the backward runs the layer again (a second forward's time for a layer's activations).
  bool checkpoint_layers = false;

  // The model's parameters in groups that a pass uses one after the other (models/parameter_use.h).
  using ParameterGroup = models::ParameterGroup;
  // When set (ZeRO-3, train/data_parallel.h, gathers a group's parameters before its use and releases
  // them after), called around each use of a group, in parameter_use.h's order.  A forward with a KV
  // cache (generation) is refused while it is set.  Unset: nothing is called.
  ParameterUse parameter_use;
  // The labelled tokens of `labels` after the shift (what a mean divides by).
  static int64_t labelled_tokens(const Tensor& labels);

  void visit_slots(const std::function<void(nn::Slot&)>& fn) override;

  // Every parameter by its safetensors name (handles: writing into one, copy_, updates the model;
  // a tied lm_head is the embedding and is listed once).
  std::vector<std::pair<std::string, Tensor>> parameters() const;
  // A Hugging Face folder Transformers loads: config.json (torch_dtype = the model's dtype) and
  // model.safetensors with every parameter.
  void save(const std::filesystem::path& folder) const;

  const ModelConfig& config() const { return cfg_; }
  // The tensors of the weight files from_folder left unused (see LoadOptions), in name order.
  const std::vector<std::string>& unused_weights() const { return unused_weights_; }
  DType dtype() const { return dtype_; }
  Device device() const { return device_; }

  struct Layer {
    std::unique_ptr<nn::RMSNorm> input_norm, post_norm, q_norm, k_norm;
    // q, k and v come from one GEMM with wqkv = [wq; wk; wv] ([(Hq + 2 Hkv) D, H]): phi3's checkpoint
    // holds it; the other families' three weights are concatenated at load and wq, wk, wv (bq, bk, bv)
    // become views of wqkv (bqkv), so that parameters() and the gradients keep the checkpoint's names.
    Tensor wq, wk, wv, wo, bq, bk, bv, wqkv, bqkv;
    bool qkv_from_parts = false;                 // wqkv concatenated here (not a checkpoint tensor)
    // Likewise gate and up: one GEMM with w_gate_up = [w_gate; w_up] ([2I, H]), phi3's checkpoint
    // tensor or concatenated at load (w_gate and w_up then views of it).
    Tensor w_gate, w_up, w_down, w_gate_up;
    bool gate_up_from_parts = false;             // w_gate_up concatenated here
    std::unique_ptr<nn::RotaryEmbedding> rope;
    std::unique_ptr<nn::Attention> attn;
    std::unique_ptr<nn::MLP> mlp;
    std::unique_ptr<nn::MoE> moe;  // the MoE layers' MLP (mlp is then null)
    // Llama 4: whether the layer rotates q and k (false: a NoPE layer), its L2 q/k norm (an RMSNorm
    // slot of weight 1 after RoPE: no parameter), whether it tunes the attention temperature (NoPE
    // layers), and the checkpoint's expert stacks feed_forward.experts.gate_up_proj [E, H, 2I] and
    // down_proj [E, I, H], whose transposed views moe holds.
    bool use_rope = true, temperature = false;
    std::unique_ptr<nn::RMSNorm> l2_norm;
    Tensor experts_gate_up, experts_down;
  };

 private:
  CausalLM() = default;
  // Builds the layers from a weight source: `get(name, shape)` returns the tensor.
  // `has(name)` says whether the source holds a tensor (empty: it holds every name build asks for).
  void build(const std::function<Tensor(const std::string&, std::vector<int64_t>)>& get,
             const std::function<bool(const std::string&)>& has = {});
  struct Tape;       // what the forward keeps for the backward
  struct LayerTape;  // ... of one layer
  // `temp_scales`: Llama 4's attention temperature per position, [B, 1, S, 1] f32 (NoPE layers).
  Tensor layer_forward(size_t li, Tensor h, const ops::RopeCosSin& cs, LayerTape* t, KVCache* cache,
                       const Tensor& temp_scales = {});
  // Attention of one token per row against each row's own cached length (a ragged cache).
  Tensor ragged_attention(size_t li, const Tensor& q, const Tensor& k, const Tensor& v, KVCache& cache);
  // ... of q [B, Hq, D] against the cache, this step's keys already written.
  Tensor cached_attention(size_t li, const Tensor& q, KVCache& cache);
  // Layer li's attention scale (its option, else 1 / sqrt(head dim)).
  double attention_scale(size_t li) const;
  // A decode step's layers (one token per row of a ragged cache, no tape) through the fused decode
  // ops (ops/nn/decode_fused.h): h [B, H] embedded; returns the final norm's output [B, H].
  Tensor decode_layers(const Tensor& h, const ops::RopeCosSin& cs, KVCache& cache);
  // ... as one persistent kernel (ops/nn/decode_persistent.h): (x, delta) before the final norm, or
  // nothing where the layers or the call are not ones it covers.
  std::optional<std::pair<Tensor, Tensor>> decode_layers_persistent(const Tensor& h, const ops::RopeCosSin& cs, KVCache& cache);
  // index [2, b * s] i32: each token's cache row, then its position.
  Tensor prefill_layers(const Tensor& h, int64_t b, int64_t s, const ops::RopeCosSin& cs, const Tensor& index, KVCache& cache);
  bool decode_fused_possible() const;
  // Before a ragged step: doubles every layer's storage when a row is full, and makes the step's
  // row, position and length tensors (overwritten in place when they exist for b rows: a captured
  // graph reads them there).
  void prepare_ragged_step(KVCache& cache, int64_t b);
  // Whether decode steps on this model may be captured as CUDA graphs (see generate_batch).
  bool graph_decode_possible() const;
  struct DecodeGraphs;  // the captured steps of one generate_batch, by batch size
  // One decode step of the rows cache.active with input `ids` through g's graph for that many rows
  // (run eagerly the first time, captured the second, replayed after): the logits [rows, V].
  Tensor graph_step(DecodeGraphs& g, KVCache& cache, const std::vector<int64_t>& ids, int64_t& replays);
  // Whether graph_step would replay a captured graph for `a` rows now (the storage unchanged and the
  // rows' new keys fitting it).
  bool graph_replays_next(const DecodeGraphs& g, const KVCache& cache, int64_t a) const;
  // Replays the captured step of `a` rows over the inputs as they are on the device (graph_step's
  // last part, and a pipelined step's whole): the logits.
  Tensor replay_step(DecodeGraphs& g, KVCache& cache, int64_t a, int64_t& replays);
  // The token each row picks from its logits [R, V], on their device (argmax when greedy, else
  // ops::sample_checked); non-finite logits are an error naming the row's position (and prompt when
  // `many`).  rows: each row's prompt index; positions: the position of each row's last token.
  std::vector<int64_t> pick_tokens(const Tensor& logits, const Sampling& sampling, bool many,
                                   const std::vector<size_t>& rows, const std::vector<int64_t>& positions);
  // A group in use (parameter_use) from acquire() to release() or the end of its scope.
  struct InUse : GroupInUse {
    InUse(const CausalLM& model, ParameterGroup::Kind kind, size_t layer = 0) : GroupInUse(model.parameter_use, kind, layer) {}
  };
  // [B, S, H], final norm applied; the head group in use from the final norm on, held by `head` when
  // given (its caller reads the lm_head after), else released on return.
  Tensor hidden_states(const Tensor& input_ids, Tape* tape = nullptr, KVCache* cache = nullptr, InUse* head = nullptr);
  Tensor shifted_targets(const Tensor& labels) const;
  Tensor inv_freq(int64_t seq_len) const;
  // inv_freq(seq_len), made once where it does not depend on seq_len (every scaling but dynamic).
  Tensor rope_inv_freq(int64_t seq_len);
  Tensor inv_freq_fixed_;
  // The auxiliary loss's part: with output_router_logits, router_aux_loss_coef * load-balancing loss
  // of the MoE layers' logits (and its gradient, rows in layer order, for an upstream `dloss`).
  // (Llama 4: Transformers' Llama4ForCausalLM adds no auxiliary loss.)
  bool aux_loss_on() const { return cfg_.output_router_logits && cfg_.num_experts > 0 && !cfg_.is_llama4(); }
  nn::LoadBalancingLoss aux_loss(const std::vector<Tensor>& router_logits, double dloss) const;
  std::vector<Tensor>* router_logits_ = nullptr;  // while set, each MoE layer's forward appends its logits

  ModelConfig cfg_;
  DType dtype_ = DType::f32;
  Device device_ = Device::cpu();
  Tensor embed_, lm_head_;
  std::vector<Layer> layers_;
  std::unique_ptr<nn::RMSNorm> final_norm_;
  std::unique_ptr<nn::ForCausalLMLoss> loss_;
  std::vector<std::string> unused_weights_;
};

}  // namespace kcpp::models
