// A model's chat template: the Jinja template of its tokenizer_config.json ("chat_template"),
// rendered over a conversation as Transformers' `apply_chat_template(..., tokenize=False)` does.
//
// Transformers renders with jinja2's ImmutableSandboxedEnvironment(trim_blocks=True,
// lstrip_blocks=True) and the loopcontrols extension, with `raise_exception(msg)` and
// `strftime_now(format)` as globals and its own `tojson` (json.dumps: ensure_ascii=False, no HTML
// escaping, `indent`, `separators`, `sort_keys`).  The context is `messages`,
// `add_generation_prompt`, `tools` and `documents` (none unless given), the special tokens of
// tokenizer_config.json (`bos_token`, `eos_token`, `unk_token`, `pad_token`; a string or an
// AddedToken's {"content": ...}; absent or null ones stay undefined) and the extra keyword arguments
// (`enable_thinking`, `date_string`, `tools`, ...), which win over everything else.
//
// The language is the subset of Jinja that chat templates use, evaluated with Python's semantics:
//   - `{{ }}`, `{% %}`, `{# #}`, whitespace control (`{%-`, `-%}`, `{{-`, `-}}`, `{%+`, `+%}`),
//     trim_blocks and lstrip_blocks as Jinja applies them, one trailing newline of the source
//     dropped, newlines normalized to "\n";
//   - statements: if / elif / else, for (tuple targets, `if` filter, `else`, `loop.index`,
//     `index0`, `revindex`, `revindex0`, `first`, `last`, `length`, `previtem`, `nextitem`,
//     `cycle`), break / continue, set (names, tuples, `ns.attr`, block set with filters), macro
//     (positional, keyword and default arguments), filter blocks, `generation` (rendered as is;
//     render_with_generation says where);
//   - expressions: none / true / false literals (either case), ints, floats, strings with Python
//     escapes, lists, tuples, dicts, attributes and subscripts (Jinja's getattr / getitem order),
//     slices, calls with keyword arguments, `not and or`, chained comparisons, `in`, `not in`,
//     `is [not] test`, `~`, `+ - * / // % **`, `a if c else b`, filters;
//   - filters: abs, attr, capitalize, count, default (d), escape (e), first, float, indent, int,
//     items, join, last, length, list, lower, map, max, min, reject, rejectattr, replace, reverse,
//     round, safe, select, selectattr, sort, string, sum, title, tojson, trim, unique, upper;
//   - tests: defined, undefined, none, boolean, true, false, integer, float, number, string,
//     mapping, iterable, sequence, callable, sameas, eq / equalto / ==, ne / !=, lt / lessthan / <,
//     le / <=, gt / greaterthan / >, ge / >=, in, odd, even, divisibleby, lower, upper;
//   - methods: str.strip / lstrip / rstrip / startswith / endswith / split / replace / upper /
//     lower / title / capitalize / find / count / join, dict.items / keys / values / get;
//   - globals: range (at most 100000 items, as the sandbox), namespace, dict, raise_exception,
//     strftime_now.
// Undefined values behave as Jinja's default Undefined: falsy, rendered empty, iterable as empty,
// length 0; an attribute, item, call or arithmetic of one is an error naming it.  String length,
// indexing and slicing count code points, as Python does.
//
// Every error, in parsing or rendering, is a kcpp::Error naming the template, the line and column
// and what was expected or what failed; raise_exception's message is quoted in it.  Hostile
// templates are bounded: nesting depth, macro recursion, output and string size, and the number
// of evaluation steps (Limits).  Macros' `caller`, `{% call %}`, `{% include %}`, recursive loops
// and the `%` string formatting operator are not supported (an error says so).
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

namespace kcpp::models {

class ChatTemplate {
 public:
  struct Limits {
    size_t max_output_bytes = size_t{16} << 20;  // the rendered text and every string value
    int64_t max_steps = 10'000'000;              // expression evaluations, loop iterations, ...
    int max_depth = 256;                         // nesting of statements / expressions / values
    int max_macro_depth = 64;                    // macro calls inside macro calls
  };

  // The "chat_template" of a tokenizer_config.json: a string, or a list of {"name", "template"}
  // of which "default" is used; without one, the folder's chat_template.jinja (as Transformers
  // saves it since 4.43).  The special tokens come from the same file.
  static ChatTemplate from_tokenizer_config(const std::filesystem::path& tokenizer_config_json);
  // A template's source; `origin` names it in error messages.
  static ChatTemplate parse(std::string source, std::string origin = "chat template");

  // The prompt: `messages` is a list of {"role", "content", ...}; `extra` an object of further
  // template variables (tools, enable_thinking, ...) or null.  Object key order is kept (it shows
  // in `tojson` and `items()`), hence ordered_json; an nlohmann::json converts to it.
  std::string render(const nlohmann::ordered_json& messages, bool add_generation_prompt,
                     const nlohmann::ordered_json& extra = nullptr) const;
  // render, and the byte ranges [begin, end) of the text that `{% generation %}` blocks rendered
  // (the assistant's turns in templates written for Transformers' return_assistant_tokens_mask),
  // in order; a generation block that renders inside a set, filter or macro block is an error.
  struct Rendered {
    std::string text;
    std::vector<std::pair<size_t, size_t>> generation;
  };
  Rendered render_with_generation(const nlohmann::ordered_json& messages, bool add_generation_prompt,
                                  const nlohmann::ordered_json& extra = nullptr) const;

  const std::string& source() const;
  // bos_token, eos_token, unk_token, pad_token as strings, those the tokenizer config gives.
  const nlohmann::ordered_json& special_tokens() const;
  void set_special_tokens(nlohmann::ordered_json tokens);
  void set_limits(const Limits& limits);

  struct Program;

 private:
  std::string render_impl(const nlohmann::ordered_json& messages, bool add_generation_prompt, const nlohmann::ordered_json& extra,
                          std::vector<std::pair<size_t, size_t>>* spans) const;
  std::shared_ptr<const Program> program_;
  nlohmann::ordered_json special_tokens_ = nlohmann::ordered_json::object();
  Limits limits_;
};

}  // namespace kcpp::models
