// tokenizer.json (src/models/tokenizer.h): the model, vocabulary, merges, added tokens, normalizer,
// pre-tokenizers (with their regexes), post-processor and decoder.
//
// A tokenizer that loads is then used as generate uses it: a few texts encoded (every id inside
// the vocabulary) and decoded, and every id decoded.
#include <optional>
#include <string>

#include "fuzz.h"
#include "models/tokenizer.h"

using namespace kcpp;
using namespace kcpp::models;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::optional<Tokenizer> loaded;
  try {
    loaded.emplace(Tokenizer::from_json_text(fuzz::text(data, size), "fuzz"));
  } catch (const Error&) {
    return 0;
  }
  const Tokenizer& tok = *loaded;
  const int64_t vocab = tok.vocab_size();
  for (const char* text : {"", "Hello world", " 12345 x\n\n\tdone", "caf\xC3\xA9 \xE2\x80\x94 \xF0\x9F\x99\x82", "\xFF\xFE",
                           "<|endoftext|><|begin_of_text|>"}) {
    for (bool special : {false, true}) {
      try {
        const std::vector<int64_t> ids = tok.encode(text, special);
        for (int64_t id : ids) KCPP_FUZZ_EXPECT(id >= 0 && id < vocab, "'{}' encodes to id {} (vocabulary {})", text, id, vocab);
        (void)tok.decode(ids, special);
      } catch (const Error&) {
      }
    }
  }
  std::vector<int64_t> all;
  for (int64_t id = 0; id < std::min<int64_t>(vocab, 4096); ++id) {
    all.push_back(id);
    (void)tok.token_to_id(tok.id_to_token(id));
  }
  (void)tok.decode(all, false);
  (void)tok.decode(all, true);
  return 0;
}
