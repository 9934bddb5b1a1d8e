// Encoding and decoding arbitrary text and ids (src/models/tokenizer.h) with small valid
// tokenizers: GPT-2's, Llama-3's and Qwen2's pipelines over trimmed vocabularies
// (tests/fixtures/tokenizers) and kcpp's own byte-level one.
//
// Input: byte 0 picks the tokenizer, byte 1 the flags (add / skip special tokens), the rest is the
// text; it is also decoded as a list of 16-bit ids (out-of-vocabulary ones must be a named error).
// Properties: every id encode returns is inside the vocabulary; valid UTF-8 text decodes back to
// itself (byte-level BPE loses nothing) where there is no normalizer and no special token was added
// or skipped.
#include <cstdlib>
#include <string>
#include <vector>

#include "fuzz.h"
#include "models/tokenizer.h"

using namespace kcpp;
using namespace kcpp::models;

namespace {

struct Subject {
  Tokenizer tok;
  bool lossless;  // decode(encode(text)) == text for valid UTF-8 (no normalizer)
};

// tests/fixtures of the source tree, or $KCPP_FUZZ_FIXTURES (a copy elsewhere).
Tokenizer fixture(const char* name) {
  const char* env = std::getenv("KCPP_FUZZ_FIXTURES");
  return Tokenizer::from_file(std::string(env && *env ? env : KCPP_FUZZ_FIXTURES) + "/tokenizers/" + name);
}

std::vector<Subject>& subjects() {
  static std::vector<Subject> s = [] {
    std::vector<Subject> v;
    v.push_back({fixture("gpt2.json"), true});
    v.push_back({fixture("llama3.json"), true});
    v.push_back({fixture("qwen2.json"), false});  // NFC
    v.push_back({Tokenizer::from_json_text(Tokenizer::byte_level_json(256, 257)), true});
    return v;
  }();
  return s;
}

// RFC 3629: no overlong forms, no surrogates, nothing past U+10FFFF.
bool valid_utf8(std::string_view s) {
  for (size_t i = 0; i < s.size();) {
    const auto c = static_cast<unsigned char>(s[i]);
    const size_t n = c < 0x80 ? 1 : (c >= 0xC2 && c <= 0xDF) ? 2 : (c >= 0xE0 && c <= 0xEF) ? 3 : (c >= 0xF0 && c <= 0xF4) ? 4 : 0;
    if (n == 0 || i + n > s.size()) return false;
    for (size_t k = 1; k < n; ++k) {
      const auto d = static_cast<unsigned char>(s[i + k]);
      const unsigned lo = k == 1 && c == 0xE0 ? 0xA0 : k == 1 && c == 0xF0 ? 0x90 : 0x80;
      const unsigned hi = k == 1 && c == 0xED ? 0x9F : k == 1 && c == 0xF4 ? 0x8F : 0xBF;
      if (d < lo || d > hi) return false;
    }
    i += n;
  }
  return true;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 2) return 0;
  const Subject& s = subjects()[data[0] % subjects().size()];
  const bool add_special = data[1] & 1, skip_special = data[1] & 2;
  const std::string_view text = fuzz::text(data + 2, size - 2);
  const int64_t vocab = s.tok.vocab_size();
  try {
    const std::vector<int64_t> ids = s.tok.encode(text, add_special);
    for (int64_t id : ids) KCPP_FUZZ_EXPECT(id >= 0 && id < vocab, "id {} outside the vocabulary ({})", id, vocab);
    const std::string back = s.tok.decode(ids, skip_special);
    if (s.lossless && !add_special && !skip_special && valid_utf8(text))
      KCPP_FUZZ_EXPECT(back == text, "'{}' decodes back as '{}'", text, back);
  } catch (const Error&) {
    KCPP_FUZZ_EXPECT(!valid_utf8(text), "valid UTF-8 text was refused");
  }
  std::vector<int64_t> ids;
  for (size_t i = 2; i + 1 < size; i += 2) ids.push_back(static_cast<int16_t>(data[i] | (data[i + 1] << 8)));
  try {
    (void)s.tok.decode(ids, skip_special);
  } catch (const Error&) {
  }
  return 0;
}
