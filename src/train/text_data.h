// Training text from a file, for `kcpp train --data FILE`:
//   *.jsonl  one JSON object a line (blank lines skipped), each one document of one of the formats
//            of TRL's SFTTrainer, by the fields it has:
//              `field` ("text" by default)      language modelling: every token trained;
//              "prompt" and "completion"        the completion's tokens trained, not the prompt's;
//              "messages" ([{"role", "content"}, ...])  a conversation rendered by the model's chat
//                                               template, every token trained;
//   else     the whole file is one plain-text document.
// The documents become one token stream:
//   text:        encode(text, special tokens) + EOS
//   prompt:      encode(prompt + completion, special tokens) + EOS, the first |encode(prompt)| tokens
//                not trained (labels -100), as TRL's completion-only loss masks them
//   messages:    encode(chat_template(messages), no special tokens: the template writes them)
// (EOS: the model's end-of-sequence token, when it has one), concatenated; training windows are then
// drawn from the stream (TokenWindows), as Transformers' language-modelling examples pack texts.
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace kcpp::train {

struct TextDocument {
  enum class Kind { Text, PromptCompletion, Messages };
  Kind kind = Kind::Text;
  std::string text;        // Text: the text; PromptCompletion: the prompt
  std::string completion;  // PromptCompletion
  nlohmann::ordered_json messages;  // Messages
  int64_t line = 1;        // the line it came from (1-based; 1 for a plain text file)
};

struct TextDocuments {
  std::vector<TextDocument> docs;
  size_t count(TextDocument::Kind kind) const;
};

// Throws kcpp::Error naming the file (and line) for: a file that cannot be read, a line that is not
// a JSON object of one of the formats above (`field_given`: the text field was named by the user,
// so a line without it is an error rather than another format), and a file with no text at all.
TextDocuments read_text_documents(const std::filesystem::path& file, const std::string& field = "text", bool field_given = false);

struct Encoder {
  std::function<std::vector<int64_t>(std::string_view text, bool add_special_tokens)> encode;
  std::function<std::string(const nlohmann::ordered_json& messages)> chat;  // empty: no chat template
  std::optional<int64_t> eos;
};

struct TokenStream {
  std::vector<int64_t> ids;
  std::vector<int64_t> labels;  // the target of each position (-100: not trained); empty: the ids
};

// The token stream of `docs`.  An error of the encoder (invalid UTF-8, a template error, ...) is
// rethrown naming `origin` and the line; a conversation without a chat template is an error.
TokenStream tokenize_documents(const TextDocuments& docs, const Encoder& encoder, const std::string& origin);

}  // namespace kcpp::train
