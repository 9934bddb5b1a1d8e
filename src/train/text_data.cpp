#include "train/text_data.h"

#include <fstream>
#include <sstream>

#include "core/error.h"
#include "core/files.h"

namespace kcpp::train {

size_t TextDocuments::count(TextDocument::Kind kind) const {
  size_t n = 0;
  for (const TextDocument& d : docs) n += d.kind == kind;
  return n;
}

namespace {

// One .jsonl line's document, by the fields it has.
TextDocument document_of(const nlohmann::json& j, const std::string& where, const std::string& field, bool field_given) {
  KCPP_CHECK(j.is_object(), "{}: a JSON {}, not an object (with a '{}' string, 'prompt' and 'completion', or 'messages')", where,
             j.type_name(), field);
  auto string_of = [&](const char* name) {
    const auto& v = j.at(name);
    KCPP_CHECK(v.is_string(), "{}: '{}' is a JSON {}, not a string", where, name, v.type_name());
    return v.get<std::string>();
  };
  TextDocument d;
  if (j.contains(field) || field_given) {
    KCPP_CHECK(j.contains(field), "{}: no '{}' field (the text field is chosen with --text-field)", where, field);
    d.text = string_of(field.c_str());
  } else if (j.contains("prompt") || j.contains("completion")) {
    KCPP_CHECK(j.contains("prompt") && j.contains("completion"), "{}: a prompt-completion line needs both 'prompt' and "
               "'completion'", where);
    d.kind = TextDocument::Kind::PromptCompletion;
    d.text = string_of("prompt");
    d.completion = string_of("completion");
  } else if (j.contains("messages")) {
    const auto& m = j["messages"];
    KCPP_CHECK(m.is_array() && !m.empty(), "{}: 'messages' must be a non-empty list of {{\"role\", \"content\"}} objects", where);
    for (size_t i = 0; i < m.size(); ++i)
      KCPP_CHECK(m[i].is_object() && m[i].contains("role") && m[i]["role"].is_string(),
                 "{}: messages[{}] is not an object with a string 'role'", where, i);
    d.kind = TextDocument::Kind::Messages;
    d.messages = m;
  } else {
    KCPP_FAIL("{}: no '{}' field, nor 'prompt' and 'completion', nor 'messages' (the text field is chosen with --text-field)",
              where, field);
  }
  return d;
}

}  // namespace

TextDocuments read_text_documents(const std::filesystem::path& file, const std::string& field, bool field_given) {
  check_readable_file(file, "the text");
  std::ifstream in(file, std::ios::binary);
  KCPP_CHECK(in.good(), "{}: cannot open the training data", file.string());
  TextDocuments out;
  const bool jsonl = file.extension() == ".jsonl";
  if (!jsonl) {
    std::stringstream ss;
    ss << in.rdbuf();
    KCPP_CHECK(!in.bad(), "{}: cannot read the training data", file.string());
    out.docs.push_back({TextDocument::Kind::Text, ss.str(), {}, nullptr, 1});
  } else {
    std::string line;
    for (int64_t n = 1; std::getline(in, line); ++n) {
      if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
      const std::string where = fmt::format("{}:{}", file.string(), n);
      const auto j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
      KCPP_CHECK(!j.is_discarded(), "{}: not a JSON value (a .jsonl file holds one JSON object a line)", where);
      TextDocument d = document_of(j, where, field, field_given);
      d.line = n;
      out.docs.push_back(std::move(d));
    }
    KCPP_CHECK(!in.bad(), "{}: cannot read the training data", file.string());
  }
  bool any = false;
  for (const TextDocument& d : out.docs) any = any || !d.text.empty() || !d.completion.empty() || d.kind == TextDocument::Kind::Messages;
  KCPP_CHECK(any, "{}: no text to train on{}", file.string(), jsonl ? fmt::format(" (no '{}' with text)", field) : "");
  return out;
}

TokenStream tokenize_documents(const TextDocuments& docs, const Encoder& encoder, const std::string& origin) {
  TokenStream s;
  const bool masked = docs.count(TextDocument::Kind::PromptCompletion) > 0 ||
                      (encoder.assistant_only && docs.count(TextDocument::Kind::Messages) > 0);
  // `trained(i)`: whether token i of `ids` is a target.
  auto append = [&](const std::vector<int64_t>& ids, const std::function<bool(size_t)>& trained) {
    s.ids.insert(s.ids.end(), ids.begin(), ids.end());
    if (!masked) return;
    for (size_t i = 0; i < ids.size(); ++i) s.labels.push_back(trained(i) ? ids[i] : -100);
  };
  const auto all = [](size_t) { return true; };
  for (const TextDocument& d : docs.docs) {
    try {
      switch (d.kind) {
        case TextDocument::Kind::Text: {
          std::vector<int64_t> ids = encoder.encode(d.text, true);
          if (encoder.eos) ids.push_back(*encoder.eos);
          append(ids, all);
          break;
        }
        case TextDocument::Kind::PromptCompletion: {
          const size_t prompt = encoder.encode(d.text, true).size();
          std::vector<int64_t> ids = encoder.encode(d.text + d.completion, true);
          if (encoder.eos) ids.push_back(*encoder.eos);
          append(ids, [&](size_t i) { return i >= prompt; });
          break;
        }
        case TextDocument::Kind::Messages: {
          KCPP_CHECK(encoder.chat, "a conversation ('messages') needs the model's chat template (tokenizer_config.json's "
                     "chat_template, or chat_template.jinja, in the model folder)");
          const ChatText chat = encoder.chat(d.messages);
          const std::vector<int64_t> ids = encoder.encode(chat.text, false);
          if (!encoder.assistant_only) {
            append(ids, all);
            break;
          }
          KCPP_CHECK(!chat.generation.empty(), "the chat template marked none of this conversation as the assistant's: "
                     "assistant-only loss needs a template whose assistant turns are in {{% generation %}} blocks (as "
                     "Transformers' return_assistant_tokens_mask)");
          // Each token's bytes in the rendered text, then the tokens that overlap a marked range.
          std::vector<std::pair<size_t, size_t>> at;
          size_t pos = 0;
          for (const int64_t id : ids) {
            const std::string b = encoder.token_bytes(id);
            KCPP_CHECK(pos + b.size() <= chat.text.size() && chat.text.compare(pos, b.size(), b) == 0, "the tokenizer does not spell the rendered conversation back "
                       "at byte {} (it normalized the text, or added a space), so the assistant's tokens cannot be placed; "
                       "train on every token instead", pos);
            at.emplace_back(pos, pos + b.size());
            pos += b.size();
          }
          KCPP_CHECK(pos == chat.text.size(), "the tokenizer does not spell the rendered conversation back ({} of its {} "
                     "bytes), so the assistant's tokens cannot be placed; train on every token instead", pos, chat.text.size());
          append(ids, [&](size_t i) {
            for (const auto& [b, e] : chat.generation)
              if (b < at[i].second && at[i].first < e) return true;
            return false;
          });
          break;
        }
      }
    } catch (const Error& e) {
      KCPP_FAIL("{}:{}: {}", origin, d.line, e.what());
    }
  }
  return s;
}

}  // namespace kcpp::train
