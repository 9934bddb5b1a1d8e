// tokenizer_config.json as `kcpp generate --chat` reads it (src/models/chat_template.h:
// ChatTemplate::from_tokenizer_config): "chat_template" as a string or a list of {"name",
// "template"}, and the special tokens (bos / eos / unk / pad: a string or an AddedToken's
// {"content"}); the template is then rendered over a short conversation under tight limits.  The
// template language itself is the chat_template target's.
//
// Properties of a config that reads: each special token is the string the file gives (or the
// "content" of its object), and no other key is one; a render stays within the output limit.
#include <nlohmann/json.hpp>

#include "fuzz.h"
#include "models/chat_template.h"

using namespace kcpp;
using namespace kcpp::models;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static fuzz::MemFile file;
  static const nlohmann::ordered_json messages = nlohmann::ordered_json::parse(R"([
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello."}])");
  ChatTemplate t;
  try {
    t = ChatTemplate::from_tokenizer_config(file.write(fuzz::text(data, size)));
  } catch (const Error&) {
    return 0;
  }
  const nlohmann::json cfg = nlohmann::json::parse(fuzz::text(data, size));  // it read: the file is JSON
  for (const auto& [name, value] : t.special_tokens().items()) {
    KCPP_FUZZ_EXPECT(name == "bos_token" || name == "eos_token" || name == "unk_token" || name == "pad_token",
                     "special token '{}'", name);
    KCPP_FUZZ_EXPECT(value.is_string(), "{} is {}", name, value.type_name());
    const nlohmann::json& given = cfg.at(name);
    const nlohmann::json& text = given.is_object() ? given.at("content") : given;
    KCPP_FUZZ_EXPECT(text == value, "{} is '{}', the file says {}", name, value.get<std::string>(), given.dump());
  }
  ChatTemplate::Limits lim;
  lim.max_output_bytes = 1 << 20;
  lim.max_steps = 200'000;
  t.set_limits(lim);
  try {
    const std::string out = t.render(messages, true);
    KCPP_FUZZ_EXPECT(out.size() <= lim.max_output_bytes, "output of {} bytes past the limit", out.size());
  } catch (const Error&) {
  }
  return 0;
}
