// A chat template (src/models/chat_template.*): parsed, then rendered over a small conversation
// with tools, under tight limits.  Seeds: the committed fixture templates and small pieces of the
// language (make_corpus.py).
//
// Properties: a template that parses renders or fails with a kcpp::Error, within the limits (the
// output is no larger than max_output_bytes); rendering twice gives the same text.
#include <nlohmann/json.hpp>

#include "fuzz.h"
#include "models/chat_template.h"

using namespace kcpp;
using namespace kcpp::models;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const nlohmann::ordered_json messages = nlohmann::ordered_json::parse(R"([
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi, café 🙂"},
    {"role": "assistant", "content": "<think>\nhm\n</think>\n\nHello.", "tool_calls": [
      {"type": "function", "function": {"name": "f", "arguments": {"a": 1, "b": [true, null, 2.5]}}, "id": "abcdefghi"}]},
    {"role": "tool", "content": "{\"ok\": 1}", "tool_call_id": "abcdefghi"},
    {"role": "user", "content": ["not", "a", "string"]}])");
  static const nlohmann::ordered_json extra = nlohmann::ordered_json::parse(R"({
    "tools": [{"type": "function", "function": {"name": "f", "description": "d",
               "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}],
    "enable_thinking": false, "date_string": "26 Jul 2024", "bos_token": "<s>", "eos_token": "</s>"})");
  ChatTemplate t;
  try {
    t = ChatTemplate::parse(std::string(fuzz::text(data, size)));
  } catch (const Error&) {
    return 0;
  }
  ChatTemplate::Limits lim;
  lim.max_output_bytes = 1 << 20;
  lim.max_steps = 200'000;
  t.set_limits(lim);
  for (bool gen : {false, true}) {
    std::string first;
    try {
      first = t.render(messages, gen, extra);
    } catch (const Error&) {
      continue;
    }
    KCPP_FUZZ_EXPECT(first.size() <= lim.max_output_bytes, "output of {} bytes past the limit", first.size());
    std::string second;
    try {
      second = t.render(messages, gen, extra);
    } catch (const Error& e) {
      KCPP_FUZZ_EXPECT(false, "the second render failed where the first did not: {}", e.what());
    }
    if (fuzz::text(data, size).find("strftime_now") == std::string_view::npos)  // the clock may tick between
      KCPP_FUZZ_EXPECT(first == second, "two renders differ: {} bytes vs {}", first.size(), second.size());
  }
  return 0;
}
