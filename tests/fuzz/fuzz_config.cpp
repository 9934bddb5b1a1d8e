// config.json of a model folder (src/models/config.h).
//
// Properties of a config that reads: the derived sizes are positive (head_dim, the rotary
// dimension), and what to_json writes (`kcpp train --save`) reads back to the same sizes.
#include <nlohmann/json.hpp>

#include "fuzz.h"
#include "models/config.h"

using namespace kcpp;
using namespace kcpp::models;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const nlohmann::json j = nlohmann::json::parse(fuzz::text(data, size), nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return 0;  // not JSON: from_folder's own error, nothing of config.cpp runs
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
