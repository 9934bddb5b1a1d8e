// A model's tokenizer from its Hugging Face `tokenizer.json`: byte-level BPE, as GPT-2, Llama-3,
// Qwen2 / Qwen3 and Mistral-Nemo use it.
//
// Encoding, in the order of the `tokenizers` library:
//   1. added tokens (`added_tokens`: <|begin_of_text|>, <|im_start|>, ...) are cut out of the text
//      first, the earliest match and the longest there, and map to their ids unchanged (`lstrip` /
//      `rstrip` take the whitespace beside them along); those with `normalized: false` cut the raw
//      text, then
//   2. the normalizer: `null`, a Unicode normalization form (`NFC`, `NFD`, `NFKC`, `NFKD`, on
//      utf8proc) or a `Sequence` of these, normalizes each stretch left, in which the added tokens
//      with `normalized: true` are cut out as their normalized content;
//   3. the pre-tokenizer splits the rest into words: `ByteLevel` (GPT-2's regex when `use_regex`,
//      `add_prefix_space`), `Split` with a regex pattern (behaviour `Isolated`: matches and the gaps
//      between them are words), `Digits`, or a `Sequence` of these; the regexes run on PCRE2 with
//      Unicode properties (\p{L}, \p{N}, \s); every word's bytes are then mapped to GPT-2's
//      printable byte alphabet;
//   4. the BPE model merges each word's symbols by rank (lowest first, as `merges` lists them);
//      with `ignore_merges` a word that is itself in the vocabulary is emitted whole (Llama-3);
//   5. the post-processor (`TemplateProcessing`'s single template, `ByteLevel`, or none) adds the
//      special tokens when asked (`add_special_tokens`).
// Decoding concatenates the tokens, maps the byte alphabet back to bytes (`ByteLevel` decoder) and
// writes added tokens as their text (special ones dropped on request).
// Anything else in the file (a WordPiece / Unigram model, another normalizer or pre-tokenizer, a
// regex PCRE2 rejects) is an error naming the key, and so is what the `tokenizers` library rejects:
// a merge that is not two symbols of the vocabulary merging into a third, an id outside the
// vocabulary (ids are dense: below the number of vocabulary entries plus added tokens).
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace kcpp::models {

class Tokenizer {
 public:
  // Throws kcpp::Error naming the file and the key on anything missing, malformed or unsupported.
  static Tokenizer from_file(const std::filesystem::path& tokenizer_json);
  static Tokenizer from_json_text(std::string_view json_text, const std::string& origin = "tokenizer.json");
  ~Tokenizer();
  Tokenizer(Tokenizer&&) noexcept;
  Tokenizer& operator=(Tokenizer&&) noexcept;

  // `text` must be UTF-8 (an error names the first invalid byte).
  std::vector<int64_t> encode(std::string_view text, bool add_special_tokens = false) const;
  std::string decode(const std::vector<int64_t>& ids, bool skip_special_tokens = false) const;
  // The bytes of the text token `id` stands for (an added token's content; a vocabulary entry's
  // bytes through the byte alphabet), not made valid UTF-8: a character may span several tokens.
  // Concatenated over encode(t) they give t back wherever encoding kept the text as it was (no
  // normalization that changed it, no added prefix space, no whitespace an added token stripped).
  std::string token_bytes(int64_t id) const;

  int64_t vocab_size() const;  // the largest id + 1 (vocabulary and added tokens)
  std::optional<int64_t> token_to_id(std::string_view token) const;
  std::string id_to_token(int64_t id) const;  // "" for an unknown id

  // A tokenizer.json for kcpp's byte-level tokenizer (train/corpus.h: byte b is id b, then BOS and
  // EOS): a BPE model without merges over GPT-2's byte alphabet, so a model `kcpp train --save`
  // writes is loadable with its tokenizer by Transformers and by this class.
  static std::string byte_level_json(int64_t bos_id, int64_t eos_id, const std::string& bos = "<|bos|>",
                                     const std::string& eos = "<|eos|>");

 private:
  struct Impl;
  explicit Tokenizer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace kcpp::models
