// Training data files, as `kcpp train --data FILE` (and --eval-data) reads them (src/train/text_data.h):
// read_text_documents (a .jsonl file of TRL's SFT formats: text, prompt + completion, messages; any
// other file: one plain-text document), then tokenize_documents through a tokenizer and a chat template
// with {% generation %} blocks, as the command builds its Encoder.
//
// Input: byte 0 holds flags, the rest is the file:
//   bit 0  the file is data.jsonl (else data.txt)
//   bit 1  the text field is named by the user: "content" (else "text", not named)
//   bit 2  assistant-only loss (the tokens of the template's generation blocks are the targets)
//   bit 3  Qwen2's tokenizer of the fixtures (NFC: it may not spell a conversation back), else kcpp's
//          byte-level one
//
// Properties of data that tokenizes: every id is inside the vocabulary; the labels are none, or one a
// token, each -100 or the token itself; without prompts and assistant-only loss every token is trained.
#include <stdlib.h>

#include <cstdlib>
#include <filesystem>
#include <string>

#include "fuzz.h"
#include "models/chat_template.h"
#include "models/tokenizer.h"
#include "train/text_data.h"

using namespace kcpp;
namespace fs = std::filesystem;

namespace {

models::Tokenizer qwen2() {
  const char* env = std::getenv("KCPP_FUZZ_FIXTURES");
  return models::Tokenizer::from_file(std::string(env && *env ? env : KCPP_FUZZ_FIXTURES) + "/tokenizers/qwen2.json");
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const fuzz::TempFolder folder("data");
  static const models::Tokenizer byte_level =
      models::Tokenizer::from_json_text(models::Tokenizer::byte_level_json(256, 257), "byte-level tokenizer");
  static const models::Tokenizer qwen = qwen2();
  static const models::ChatTemplate chat = [] {
    models::ChatTemplate t = models::ChatTemplate::parse(
        "{% for m in messages %}<|{{ m.role }}|>\n"
        "{% if m.role == 'assistant' %}{% generation %}{{ m.content }}<|end|>{% endgeneration %}"
        "{% else %}{{ m.content | trim }}<|end|>{% endif %}\n{% endfor %}",
        "fuzz template");
    models::ChatTemplate::Limits lim;
    lim.max_output_bytes = 1 << 20;
    lim.max_steps = 200'000;
    t.set_limits(lim);
    return t;
  }();
  if (size == 0) return 0;
  const uint8_t flags = data[0];
  const fs::path file = folder.path / ((flags & 1) ? "data.jsonl" : "data.txt");
  {
    std::FILE* f = std::fopen(file.c_str(), "wb");
    if (!f || std::fwrite(data + 1, 1, size - 1, f) != size - 1 || std::fclose(f) != 0) std::perror("write"), std::abort();
  }
  train::TextDocuments docs;
  try {
    docs = train::read_text_documents(file, (flags & 2) ? "content" : "text", (flags & 2) != 0);
  } catch (const Error&) {
    return 0;
  }
  for (const train::TextDocument& d : docs.docs)
    KCPP_FUZZ_EXPECT(d.line >= 1, "a document from line {}", d.line);
  const models::Tokenizer& tok = (flags & 8) ? qwen : byte_level;
  train::Encoder encoder;
  encoder.encode = [&](std::string_view t, bool special) { return tok.encode(t, special); };
  encoder.eos = tok.vocab_size() - 1;  // the byte-level one's EOS (257); some id of Qwen2's
  encoder.token_bytes = [&](int64_t id) { return tok.token_bytes(id); };
  encoder.assistant_only = (flags & 4) != 0;
  encoder.chat = [&](const nlohmann::ordered_json& messages) {
    models::ChatTemplate::Rendered r = chat.render_with_generation(messages, /*add_generation_prompt=*/false);
    return train::ChatText{std::move(r.text), std::move(r.generation)};
  };
  train::TokenStream s;
  try {
    s = train::tokenize_documents(docs, encoder, file.string());
  } catch (const Error&) {
    return 0;
  }
  for (const int64_t id : s.ids) KCPP_FUZZ_EXPECT(id >= 0 && id < tok.vocab_size(), "token {} of a vocabulary of {}", id, tok.vocab_size());
  KCPP_FUZZ_EXPECT(s.labels.empty() || s.labels.size() == s.ids.size(), "{} labels for {} tokens", s.labels.size(), s.ids.size());
  for (size_t i = 0; i < s.labels.size(); ++i)
    KCPP_FUZZ_EXPECT(s.labels[i] == -100 || s.labels[i] == s.ids[i], "label {} of token {} at {}", s.labels[i], s.ids[i], i);
  const bool masked = docs.count(train::TextDocument::Kind::PromptCompletion) > 0 ||
                      (encoder.assistant_only && docs.count(train::TextDocument::Kind::Messages) > 0);
  KCPP_FUZZ_EXPECT(masked || s.labels.empty(), "labels without prompts or assistant-only loss");
  return 0;
}
