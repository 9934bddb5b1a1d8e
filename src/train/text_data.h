// Training text from a file, for `kcpp train --data FILE`:
//   *.jsonl  one JSON object a line, its `field` ("text" by default, as the datasets library's text
//            column) one document; blank lines are skipped;
//   else     the whole file is one document (plain UTF-8 text).
// The documents become one token stream: each encoded by the caller's tokenizer (with the special
// tokens its post-processor adds, e.g. Llama-3's <|begin_of_text|>), followed by the end-of-sequence
// token when there is one, and concatenated; training windows are then drawn from the stream
// (TokenWindows), as Transformers' language-modelling examples pack texts into blocks.
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace kcpp::train {

struct TextDocuments {
  std::vector<std::string> texts;
  std::vector<int64_t> lines;  // the line each came from (1-based; 1 for a plain text file)
};

// Throws kcpp::Error naming the file (and line) for: a file that cannot be read, a line that is not
// a JSON object with a string `field`, and a file with no text at all.
TextDocuments read_text_documents(const std::filesystem::path& file, const std::string& field = "text");

using Encode = std::function<std::vector<int64_t>(std::string_view)>;

// The token stream of `docs`: encode(text) then `eos` (when given) for each.  An error of `encode`
// (invalid UTF-8, ...) is rethrown naming the file and line.
std::vector<int64_t> tokenize_documents(const TextDocuments& docs, const Encode& encode, std::optional<int64_t> eos,
                                        const std::string& origin);

}  // namespace kcpp::train
