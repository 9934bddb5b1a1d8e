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
//   messages:    encode(chat_template(messages), no special tokens: the template writes them), every
//                token trained, or with `assistant_only` those overlapping the text the template's
//                {% generation %} blocks rendered (TRL's assistant_only_loss, through the ranges
//                Transformers' return_assistant_tokens_mask reads)
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

// A conversation rendered, with the byte ranges [begin, end) its generation blocks rendered.
struct ChatText {
  std::string text;
  std::vector<std::pair<size_t, size_t>> generation;
};

struct Encoder {
  std::function<std::vector<int64_t>(std::string_view text, bool add_special_tokens)> encode;
  std::function<ChatText(const nlohmann::ordered_json& messages)> chat;  // empty: no chat template
  std::function<std::string(int64_t id)> token_bytes;  // what a token stands for; for assistant_only
  std::optional<int64_t> eos;
  bool assistant_only = false;
};

struct TokenStream {
  std::vector<int64_t> ids;
  std::vector<int64_t> labels;  // the target of each position (-100: not trained); empty: the ids
};

// The token stream of `docs`.  An error of the encoder (invalid UTF-8, a template error, ...) is
// rethrown naming `origin` and the line; so are a conversation without a chat template and, with
// assistant_only, one whose template marks no text or whose tokens do not spell its text back (the
// tokenizer normalized it), so that no token can be placed.
TokenStream tokenize_documents(const TextDocuments& docs, const Encoder& encoder, const std::string& origin);

}  // namespace kcpp::train
