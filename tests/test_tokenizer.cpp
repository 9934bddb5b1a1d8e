// The byte-level BPE tokenizer (models/tokenizer.h) against Hugging Face's `tokenizers` library:
// tests/fixtures/tokenizers/ holds three tokenizer.json files configured as GPT-2, Llama-3 and Qwen2
// configure theirs (trained small by make_tokenizer_fixtures.py) and the ids `tokenizers` gives for
// awkward texts (contractions, digit runs, whitespace runs, CRLF, accents, CJK, emoji, special tokens
// inside the text), with and without the post-processor's special tokens, and their decodings.
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "models/tokenizer.h"
#include "test_util.h"

namespace kcpp {
namespace {

using models::Tokenizer;

std::filesystem::path dir() { return std::filesystem::path(test::fixtures_dir()) / "tokenizers"; }

// Every row of `expected` (text, ids with and without special tokens, decodings) against `tok`.
void check_rows(const Tokenizer& tok, const nlohmann::json& expected) {
  ASSERT_FALSE(expected.empty());
  for (const auto& row : expected) {
    const std::string text = row["text"];
    SCOPED_TRACE(text);
    EXPECT_EQ(tok.encode(text, false), row["ids"].get<std::vector<int64_t>>());
    EXPECT_EQ(tok.encode(text, true), row["ids_special"].get<std::vector<int64_t>>());
    EXPECT_EQ(tok.decode(row["ids"].get<std::vector<int64_t>>()), row["decoded"].get<std::string>());
    EXPECT_EQ(tok.decode(row["ids_special"].get<std::vector<int64_t>>(), true), row["decoded_skip"].get<std::string>());
  }
}

TEST(Tokenizer, MatchesHuggingFaceTokenizers) {
  std::ifstream in(dir() / "expected.json");
  ASSERT_TRUE(in) << (dir() / "expected.json");
  const auto expected = nlohmann::json::parse(in);
  for (const char* name : {"gpt2", "llama3", "qwen2"}) {
    SCOPED_TRACE(name);
    check_rows(Tokenizer::from_file(dir() / (std::string(name) + ".json")), expected[name]);
  }
}

// A real vocabulary (Llama-3's 128k, ...) where one is at hand: KCPP_REAL_TOKENIZER_DIR holds its
// tokenizer.json and the expected.json that expect_real_tokenizer.py writes (not committed).
TEST(Tokenizer, RealVocabulary) {
  const char* env = std::getenv("KCPP_REAL_TOKENIZER_DIR");
  if (!env || !*env) GTEST_SKIP() << "skipped: set KCPP_REAL_TOKENIZER_DIR (tests/fixtures/tokenizers/expect_real_tokenizer.py)";
  const std::filesystem::path d(env);
  std::ifstream in(d / "expected.json");
  ASSERT_TRUE(in) << (d / "expected.json");
  check_rows(Tokenizer::from_file(d / "tokenizer.json"), nlohmann::json::parse(in));
}

TEST(Tokenizer, ByteLevelJsonRoundTrips) {
  const Tokenizer tok = Tokenizer::from_json_text(Tokenizer::byte_level_json(256, 257), "byte-level");
  EXPECT_EQ(tok.vocab_size(), 258);
  const std::string text = "The café\n\t 東京 🙂";
  std::vector<int64_t> bytes;
  for (unsigned char c : text) bytes.push_back(c);
  EXPECT_EQ(tok.encode(text), bytes);  // no merges: one token per byte, byte b is id b
  std::vector<int64_t> with_bos = bytes;
  with_bos.insert(with_bos.begin(), 256);
  EXPECT_EQ(tok.encode(text, true), with_bos);
  EXPECT_EQ(tok.decode(with_bos, true), text);
  EXPECT_EQ(tok.decode({256, 84, 257}), "<|bos|>T<|eos|>");
  EXPECT_EQ(tok.token_to_id("<|eos|>"), 257);
  EXPECT_EQ(tok.id_to_token(32), "\xC4\xA0");  // GPT-2's alphabet: the space byte is U+0120
  // Invalid UTF-8 among the decoded bytes becomes U+FFFD, one per maximal invalid prefix.
  EXPECT_EQ(tok.decode({72, 0xFF, 105, 0xE6, 0x9D, 33}), "H\xEF\xBF\xBDi\xEF\xBF\xBD!");
}

TEST(Tokenizer, BadFilesAreErrorsNamingTheKey) {
  auto fails = [](const std::string& text, const std::string& needle) {
    try {
      Tokenizer::from_json_text(text, "t.json");
      ADD_FAILURE() << "accepted: " << text;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  fails("{", "not valid JSON");
  fails(R"({"model": {"type": "WordPiece", "vocab": {}}})", "model.type");
  fails(R"({"model": {"type": "BPE"}})", "model.vocab");
  fails(R"({"model": {"type": "BPE", "vocab": {"a": -1}}})", "model.vocab.a");
  fails(R"({"model": {"type": "BPE", "vocab": {"a": 0}, "merges": [3]}, "pre_tokenizer": {"type": "ByteLevel"}})", "model.merges[0]");
  fails(R"({"model": {"type": "BPE", "vocab": {"a": 0}}, "pre_tokenizer": {"type": "Whitespace"}})", "pre_tokenizer.type");
  fails(R"({"model": {"type": "BPE", "vocab": {"a": 0}}})", "no ByteLevel step");
  fails(R"({"model": {"type": "BPE", "vocab": {"a": 0}}, "normalizer": {"type": "Lowercase"}, "pre_tokenizer": {"type": "ByteLevel"}})",
        "normalizer.type");
  fails(R"({"model": {"type": "BPE", "vocab": {"a": 0}}, "pre_tokenizer": {"type": "Sequence", "pretokenizers": [)"
        R"({"type": "Split", "pattern": {"Regex": "(unclosed"}, "behavior": "Isolated"}, {"type": "ByteLevel"}]}})",
        "pre_tokenizer.pretokenizers[0].pattern");
  fails(R"({"model": {"type": "BPE", "vocab": {"a": 0}}, "pre_tokenizer": {"type": "ByteLevel"}, "decoder": {"type": "WordPiece"}})",
        "decoder.type");
  EXPECT_THROW(Tokenizer::from_file(dir() / "missing.json"), Error);
  const Tokenizer tok = Tokenizer::from_file(dir() / "gpt2.json");
  EXPECT_THROW(tok.decode({1 << 30}), Error);
  EXPECT_THROW(tok.encode("bad \xFF utf-8"), Error);
}

}  // namespace
}  // namespace kcpp
