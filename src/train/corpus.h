// The main job's embedded data: a corpus generated from a small English grammar (seeded, so every
// run and machine sees the same text; nothing to download) and a byte-level tokenizer (a token per
// byte, plus BOS and EOS).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace kcpp::train {

// About `bytes` of sentences ("the small robot carries a red box to the old harbor.") from the
// seeded grammar: subjects, verbs, objects, places and a few clause shapes.
std::string generated_corpus(size_t bytes, uint64_t seed = 2026);

// Byte-level tokens: 0..255 are the bytes; 256 is BOS, 257 EOS.
struct ByteTokenizer {
  static constexpr int64_t kBos = 256, kEos = 257, kVocab = 258;
  std::vector<int64_t> encode(std::string_view text, bool bos = true) const;
  std::string decode(const std::vector<int64_t>& ids) const;  // BOS / EOS dropped
};

}  // namespace kcpp::train
