// config.json of a model folder: the transformer families' (src/models/config.h) and the Mamba
// families' (src/models/mamba.h: MambaConfig); each input is given to both readers.
//
// Properties of a config that reads: the derived sizes are positive (head_dim, the rotary
// dimension), and what to_json writes (`kcpp train --save`) reads back to the same sizes.
#include <nlohmann/json.hpp>

#include "fuzz.h"
#include "models/config.h"
#include "models/mamba.h"

using namespace kcpp;
using namespace kcpp::models;

namespace {

void mamba(const nlohmann::json& j) {
  MambaConfig c;
  try {
    c = MambaConfig::from_json(j, "fuzz");
  } catch (const Error&) {
    return;
  }
  KCPP_FUZZ_EXPECT(c.intermediate_size == c.expand * c.hidden_size && c.time_step_rank >= 1, "intermediate_size {}, time_step_rank {}",
                   c.intermediate_size, c.time_step_rank);
  MambaConfig back;
  try {
    back = MambaConfig::from_json(c.to_json(), "fuzz (written back)");
  } catch (const Error& e) {
    KCPP_FUZZ_EXPECT(false, "to_json wrote a Mamba config that does not read back: {}", e.what());
  }
  KCPP_FUZZ_EXPECT(back.model_type == c.model_type && back.vocab_size == c.vocab_size && back.hidden_size == c.hidden_size &&
                       back.state_size == c.state_size && back.num_hidden_layers == c.num_hidden_layers &&
                       back.expand == c.expand && back.intermediate_size == c.intermediate_size &&
                       back.conv_kernel == c.conv_kernel && back.time_step_rank == c.time_step_rank &&
                       back.use_bias == c.use_bias && back.use_conv_bias == c.use_conv_bias &&
                       back.tie_word_embeddings == c.tie_word_embeddings && back.layer_norm_epsilon == c.layer_norm_epsilon &&
                       back.mixer_rms_eps == c.mixer_rms_eps && back.bos_token_id == c.bos_token_id &&
                       back.eos_token_id == c.eos_token_id && back.pad_token_id == c.pad_token_id,
                   "to_json wrote a Mamba config that reads back different: {}", c.to_json().dump());
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const nlohmann::json j = nlohmann::json::parse(fuzz::text(data, size), nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return 0;  // not JSON: from_folder's own error, nothing of config.cpp runs
  mamba(j);
  ModelConfig c;
  try {
    c = ModelConfig::from_json(j, "fuzz");
  } catch (const Error&) {
    return 0;
  }
  const int64_t rotary = c.rotary_dim();
  KCPP_FUZZ_EXPECT(c.head_dim > 0 && rotary > 0 && rotary <= c.head_dim, "head_dim {}, rotary_dim {}", c.head_dim, rotary);
  ModelConfig back;
  try {
    back = ModelConfig::from_json(c.to_json(), "fuzz (written back)");
  } catch (const Error& e) {
    KCPP_FUZZ_EXPECT(false, "to_json wrote a config that does not read back: {}", e.what());
  }
  KCPP_FUZZ_EXPECT(back.vocab_size == c.vocab_size && back.hidden_size == c.hidden_size &&
                       back.intermediate_size == c.intermediate_size && back.num_hidden_layers == c.num_hidden_layers &&
                       back.num_attention_heads == c.num_attention_heads &&
                       back.num_key_value_heads == c.num_key_value_heads && back.head_dim == c.head_dim &&
                       back.rotary_dim() == rotary && back.hidden_act == c.hidden_act &&
                       back.sliding_window == c.sliding_window,
                   "to_json wrote a config that reads back different: {}", c.to_json().dump());
  return 0;
}
