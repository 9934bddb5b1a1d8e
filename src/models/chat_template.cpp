// The chat-template evaluator (chat_template.h): lexer, parser to a small tree, and an interpreter
// with Python's value semantics.
#include "models/chat_template.h"
#include "models/utf8.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <ctime>
#include <fstream>
#include <functional>
#include <limits>
#include <map>
#include <set>
#include <sstream>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "core/error.h"

namespace kcpp::models {

namespace {

using ojson = nlohmann::ordered_json;

// ---------------------------------------------------------------------------------------------
// Text helpers: UTF-8 code points, Python's whitespace.

// The byte length of the code point starting at s[i] (an invalid byte counts as one).
size_t cp_size(std::string_view s, size_t i) {
  const auto c = static_cast<unsigned char>(s[i]);
  size_t n = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 1;
  if (i + n > s.size()) return 1;
  for (size_t k = 1; k < n; ++k)
    if ((static_cast<unsigned char>(s[i + k]) & 0xC0) != 0x80) return 1;
  return n;
}

uint32_t cp_value(std::string_view s, size_t i, size_t n) {
  const auto c = static_cast<unsigned char>(s[i]);
  if (n == 1) return c;
  uint32_t v = c & (0x7F >> n);
  for (size_t k = 1; k < n; ++k) v = (v << 6) | (static_cast<unsigned char>(s[i + k]) & 0x3F);
  return v;
}

// Offsets of each code point, plus the end.
std::vector<size_t> cp_offsets(std::string_view s) {
  std::vector<size_t> off;
  off.reserve(s.size() + 1);
  for (size_t i = 0; i < s.size(); i += cp_size(s, i)) off.push_back(i);
  off.push_back(s.size());
  return off;
}

size_t cp_count(std::string_view s) {
  size_t n = 0;
  for (size_t i = 0; i < s.size(); i += cp_size(s, i)) ++n;
  return n;
}

// str.isspace() of Python.
bool py_space(uint32_t c) {
  return (c >= 0x09 && c <= 0x0D) || (c >= 0x1C && c <= 0x20) || c == 0x85 || c == 0xA0 || c == 0x1680 || (c >= 0x2000 && c <= 0x200A) ||
         c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F || c == 0x3000;
}

// Python's str.strip / lstrip / rstrip, over whitespace (chars == nullptr) or the code points of chars.
std::string py_strip(std::string_view s, const std::string* chars, bool left, bool right) {
  std::vector<uint32_t> set;
  if (chars)
    for (size_t i = 0; i < chars->size();) {
      const size_t n = cp_size(*chars, i);
      set.push_back(cp_value(*chars, i, n));
      i += n;
    }
  auto strip_it = [&](uint32_t c) { return chars ? std::find(set.begin(), set.end(), c) != set.end() : py_space(c); };
  const auto off = cp_offsets(s);
  size_t b = 0, e = off.size() - 1;
  if (left)
    while (b < e && strip_it(cp_value(s, off[b], off[b + 1] - off[b]))) ++b;
  if (right)
    while (e > b && strip_it(cp_value(s, off[e - 1], off[e] - off[e - 1]))) --e;
  return std::string(s.substr(off[b], off[e] - off[b]));
}

// ASCII and Latin-1 / general case mapping is enough for chat templates: ASCII letters, plus the
// two-byte Latin, Greek and Cyrillic ranges handled by their fixed offsets.
uint32_t case_map(uint32_t c, bool upper) {
  if (upper) {
    if (c >= 'a' && c <= 'z') return c - 32;
    if ((c >= 0xE0 && c <= 0xFE && c != 0xF7)) return c - 32;
    if (c >= 0x3B1 && c <= 0x3C9 && c != 0x3C2) return c - 32;
    if (c >= 0x430 && c <= 0x44F) return c - 32;
    if (c >= 0x450 && c <= 0x45F) return c - 80;
  } else {
    if (c >= 'A' && c <= 'Z') return c + 32;
    if ((c >= 0xC0 && c <= 0xDE && c != 0xD7)) return c + 32;
    if (c >= 0x391 && c <= 0x3A9 && c != 0x3A2) return c + 32;
    if (c >= 0x410 && c <= 0x42F) return c + 32;
    if (c >= 0x400 && c <= 0x40F) return c + 80;
  }
  return c;
}

std::string change_case(std::string_view s, int mode /*0 lower, 1 upper, 2 capitalize, 3 title*/) {
  std::string out;
  out.reserve(s.size());
  bool first = true, prev_alnum = false;
  for (size_t i = 0; i < s.size();) {
    const size_t n = cp_size(s, i);
    const uint32_t c = cp_value(s, i, n);
    bool up = mode == 1 || (mode == 2 && first) || (mode == 3 && !prev_alnum);
    const uint32_t m = case_map(c, up);
    if (n == 1 && c >= 0x80)
      out += s[i];  // an invalid byte stays as it is
    else
      append_utf8(out, m);
    const bool alnum = (c < 0x80) ? std::isalnum(static_cast<int>(c)) != 0 : case_map(c, true) != case_map(c, false);
    prev_alnum = alnum || (mode == 3 && c == '\'');
    first = false;
    i += n;
  }
  return out;
}

// Python's repr of a float (the shortest text that reads back, scientific outside [1e-4, 1e16)).
std::string py_float(double d) {
  if (std::isnan(d)) return "nan";
  if (std::isinf(d)) return d < 0 ? "-inf" : "inf";
  char buf[64];
  const auto r = std::to_chars(buf, buf + sizeof buf, d, std::chars_format::scientific);
  const std::string m(buf, r.ptr);
  const size_t e = m.find('e');
  const int exp = std::stoi(m.substr(e + 1));
  std::string digits, out = d < 0 || (d == 0 && std::signbit(d)) ? "-" : "";
  for (char c : m.substr(0, e))
    if (c >= '0' && c <= '9') digits += c;
  while (digits.size() > 1 && digits.back() == '0') digits.pop_back();
  if (exp < -4 || exp >= 16) {
    out += digits[0];
    if (digits.size() > 1) out += "." + digits.substr(1);
    out += exp < 0 ? "e-" : "e+";
    const int ae = std::abs(exp);
    if (ae < 10) out += '0';
    out += std::to_string(ae);
  } else if (exp >= 0) {
    if (static_cast<int>(digits.size()) <= exp + 1)
      out += digits + std::string(exp + 1 - digits.size(), '0') + ".0";
    else
      out += digits.substr(0, exp + 1) + "." + digits.substr(exp + 1);
  } else {
    out += "0." + std::string(-exp - 1, '0') + digits;
  }
  return out;
}

struct Pos {
  int line = 1, col = 1;
};

// ---------------------------------------------------------------------------------------------
// Values.

struct Value;
struct ListData;
struct DictData;
class Interp;
struct CallArgs;
using Builtin = std::function<struct Value(Interp&, CallArgs&)>;

struct Function {
  std::string name;
  Builtin call;
};

struct Value {
  enum class Kind : uint8_t { Undefined, None, Bool, Int, Float, String, List, Dict, Namespace, Function };
  Kind kind = Kind::Undefined;
  bool b = false;
  int64_t i = 0;
  double f = 0;
  std::string s;  // a String's text; an Undefined's error message
  std::shared_ptr<ListData> list;
  std::shared_ptr<DictData> dict;  // Dict and Namespace
  std::shared_ptr<const Function> fn;

  static Value undefined(std::string message) {
    Value v;
    v.s = std::move(message);
    return v;
  }
  static Value none() { return of(Kind::None); }
  static Value boolean(bool x) {
    Value v = of(Kind::Bool);
    v.b = x;
    return v;
  }
  static Value integer(int64_t x) {
    Value v = of(Kind::Int);
    v.i = x;
    return v;
  }
  static Value real(double x) {
    Value v = of(Kind::Float);
    v.f = x;
    return v;
  }
  static Value string(std::string x) {
    Value v = of(Kind::String);
    v.s = std::move(x);
    return v;
  }
  static Value make_list(std::vector<Value> items, bool tuple = false);
  static Value make_dict(std::vector<std::pair<Value, Value>> items, bool ns = false);
  static Value function(std::string name, Builtin call) {
    Value v = of(Kind::Function);
    v.fn = std::make_shared<Function>(Function{std::move(name), std::move(call)});
    return v;
  }

  bool is(Kind k) const { return kind == k; }
  bool is_undefined() const { return kind == Kind::Undefined; }
  bool is_number() const { return kind == Kind::Bool || kind == Kind::Int || kind == Kind::Float; }
  bool is_integral() const { return kind == Kind::Bool || kind == Kind::Int; }
  int64_t as_int() const { return kind == Kind::Bool ? (b ? 1 : 0) : kind == Kind::Int ? i : static_cast<int64_t>(f); }
  double as_double() const { return kind == Kind::Float ? f : static_cast<double>(as_int()); }

 private:
  static Value of(Kind k) {
    Value v;
    v.kind = k;
    return v;
  }
};

struct ListData {
  std::vector<Value> items;
  bool tuple = false;
};

struct DictData {
  std::vector<std::pair<Value, Value>> items;
};

Value Value::make_list(std::vector<Value> items, bool tuple) {
  Value v = of(Kind::List);
  v.list = std::make_shared<ListData>(ListData{std::move(items), tuple});
  return v;
}

Value Value::make_dict(std::vector<std::pair<Value, Value>> items, bool ns) {
  Value v = of(ns ? Kind::Namespace : Kind::Dict);
  v.dict = std::make_shared<DictData>(DictData{std::move(items)});
  return v;
}

const char* type_name(const Value& v) {
  switch (v.kind) {
    case Value::Kind::Undefined:
      return "undefined";
    case Value::Kind::None:
      return "NoneType";
    case Value::Kind::Bool:
      return "bool";
    case Value::Kind::Int:
      return "int";
    case Value::Kind::Float:
      return "float";
    case Value::Kind::String:
      return "str";
    case Value::Kind::List:
      return v.list->tuple ? "tuple" : "list";
    case Value::Kind::Dict:
      return "dict";
    case Value::Kind::Namespace:
      return "Namespace";
    case Value::Kind::Function:
      return "function";
  }
  return "?";
}

bool truthy(const Value& v) {
  switch (v.kind) {
    case Value::Kind::Undefined:
    case Value::Kind::None:
      return false;
    case Value::Kind::Bool:
      return v.b;
    case Value::Kind::Int:
      return v.i != 0;
    case Value::Kind::Float:
      return v.f != 0;
    case Value::Kind::String:
      return !v.s.empty();
    case Value::Kind::List:
      return !v.list->items.empty();
    case Value::Kind::Dict:
      return !v.dict->items.empty();
    default:
      return true;
  }
}

struct CallArgs {
  std::vector<Value> pos;
  std::vector<std::pair<std::string, Value>> kw;
};

// ---------------------------------------------------------------------------------------------
// The syntax tree.

struct Expr;
using ExprP = std::unique_ptr<Expr>;

struct Expr {
  enum class K { Literal, Name, List, Tuple, Dict, Attr, Item, Slice, Call, Filter, Test, Not, Neg, Pos, Binary, Compare, And, Or, Cond };
  K k;
  Pos pos;
  std::string name;  // Name, Attr, Filter, Test, Binary's operator
  Value lit;
  std::vector<ExprP> a;  // operands; Slice: object, start, stop, step (null when absent)
  std::vector<std::pair<std::string, ExprP>> kw;
  std::vector<std::string> ops;  // Compare
  bool negated = false;          // Test
};

struct Node;
using NodeP = std::unique_ptr<Node>;
using Body = std::vector<NodeP>;

struct Node {
  enum class K { Text, Output, If, For, Set, SetBlock, Macro, FilterBlock, Break, Continue, Generation };
  K k;
  Pos pos;
  std::string text;                              // Text; Macro's name; Set's namespace attribute
  ExprP expr;                                    // Output, Set's value, For's iterable
  std::vector<std::string> targets;              // For, Set, SetBlock, Macro parameters
  std::vector<ExprP> defaults;                   // Macro parameters' defaults (null: none)
  std::vector<std::pair<ExprP, Body>> branches;  // If
  Body body, else_body;
  ExprP cond;                  // For's filter
  std::vector<ExprP> filters;  // FilterBlock, SetBlock: Filter expressions with no operand
};

}  // namespace

struct ChatTemplate::Program {
  std::string origin;
  std::string source;
  Body body;
};

namespace {

[[noreturn]] void fail_at(const std::string& origin, Pos p, const std::string& msg) {
  throw Error(fmt::format("{} line {}, column {}: {}", origin, p.line, p.col, msg));
}

// ---------------------------------------------------------------------------------------------
// Lexer.

struct Token {
  enum class T { Text, VarBegin, VarEnd, BlockBegin, BlockEnd, Name, String, Int, Float, Op, Eof };
  T t;
  std::string v;
  Pos pos;
};

const char* token_desc(Token::T t) {
  switch (t) {
    case Token::T::Text:
      return "template text";
    case Token::T::VarBegin:
      return "'{{'";
    case Token::T::VarEnd:
      return "end of print statement";
    case Token::T::BlockBegin:
      return "'{%'";
    case Token::T::BlockEnd:
      return "end of statement block";
    case Token::T::Name:
      return "name";
    case Token::T::String:
      return "string";
    case Token::T::Int:
      return "integer";
    case Token::T::Float:
      return "float";
    case Token::T::Op:
      return "operator";
    case Token::T::Eof:
      return "end of template";
  }
  return "?";
}

class Lexer {
 public:
  Lexer(const std::string& src, const std::string& origin) : src_(src), origin_(origin) {
    line_starts_.push_back(0);
    for (size_t i = 0; i < src_.size(); ++i)
      if (src_[i] == '\n') line_starts_.push_back(i + 1);
  }

  std::vector<Token> run() {
    std::vector<Token> out;
    size_t pos = 0;
    const size_t n = src_.size();
    while (pos <= n) {
      size_t open = pos;
      while (true) {
        open = src_.find('{', open);
        if (open == std::string::npos || open + 1 >= n) {
          open = std::string::npos;
          break;
        }
        const char c = src_[open + 1];
        if (c == '{' || c == '%' || c == '#') break;
        ++open;
      }
      std::string text = src_.substr(pos, open == std::string::npos ? std::string::npos : open - pos);
      if (open != std::string::npos) {
        const char kind = src_[open + 1];
        const char sign = open + 2 < n && (src_[open + 2] == '-' || src_[open + 2] == '+') ? src_[open + 2] : 0;
        if (sign == '-') {
          while (!text.empty() && is_ws(text.back())) text.pop_back();
        } else if (sign != '+' && kind != '{') {  // lstrip_blocks
          const size_t nl = text.rfind('\n');
          const size_t l_pos = nl == std::string::npos ? 0 : nl + 1;
          const bool line_starting = pos == 0 || src_[pos - 1] == '\n';
          if ((l_pos > 0 || line_starting) && text.find_first_not_of(" \t", l_pos) == std::string::npos) text.resize(l_pos);
        }
      }
      if (!text.empty()) out.push_back({Token::T::Text, std::move(text), at(pos)});
      if (open == std::string::npos) break;
      pos = lex_tag(open, out);
    }
    out.push_back({Token::T::Eof, "", at(n)});
    return out;
  }

 private:
  static bool is_ws(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\v' || c == '\f'; }

  Pos at(size_t off) const {
    const auto it = std::upper_bound(line_starts_.begin(), line_starts_.end(), off) - 1;
    Pos p;
    p.line = static_cast<int>(it - line_starts_.begin()) + 1;
    p.col = static_cast<int>(cp_count(std::string_view(src_).substr(*it, off - *it))) + 1;
    return p;
  }

  [[noreturn]] void fail(size_t off, const std::string& msg) const { fail_at(origin_, at(off), msg); }

  // After a tag's end: `-` strips all following whitespace, otherwise (blocks and comments)
  // trim_blocks removes one newline, unless `+`.
  size_t after_end(size_t p, char sign, bool trim) const {
    if (sign == '-') {
      while (p < src_.size() && is_ws(src_[p])) ++p;
    } else if (trim && sign != '+' && p < src_.size() && src_[p] == '\n') {
      ++p;
    }
    return p;
  }

  size_t lex_tag(size_t open, std::vector<Token>& out) {
    const char kind = src_[open + 1];
    size_t p = open + 2;
    if (p < src_.size() && (src_[p] == '-' || src_[p] == '+')) ++p;
    if (kind == '#') {
      const size_t close = src_.find("#}", p);
      if (close == std::string::npos) fail(open, "missing end of comment tag '#}'");
      const char sign = close > p && (src_[close - 1] == '-' || src_[close - 1] == '+') ? src_[close - 1] : 0;
      return after_end(close + 2, sign, true);
    }
    const bool var = kind == '{';
    out.push_back({var ? Token::T::VarBegin : Token::T::BlockBegin, "", at(open)});
    int balance = 0;  // open brackets: as in Jinja, '}}' inside {...} closes a dict, not the tag
    while (true) {
      while (p < src_.size() && is_ws(src_[p])) ++p;
      if (p >= src_.size())
        fail(open, fmt::format("unexpected end of template: the '{}' opened here is never closed ('{}' expected)", var ? "{{" : "{%",
                               var ? "}}" : "%}"));
      const std::string_view rest = std::string_view(src_).substr(p);
      const std::string_view close = var ? "}}" : "%}";
      char sign = 0;
      bool closing = false;
      if (balance > 0) {
      } else if (rest.substr(0, 2) == close) {
        closing = true;
      } else if ((rest[0] == '-' || (!var && rest[0] == '+')) && rest.substr(1, 2) == close) {
        closing = true;
        sign = rest[0];
      }
      if (closing) {
        out.push_back({var ? Token::T::VarEnd : Token::T::BlockEnd, "", at(p)});
        return after_end(p + (sign ? 3 : 2), sign, !var);
      }
      p = lex_token(p, out);
      const Token& t = out.back();
      if (t.t == Token::T::Op && (t.v == "(" || t.v == "[" || t.v == "{")) ++balance;
      if (t.t == Token::T::Op && (t.v == ")" || t.v == "]" || t.v == "}") && balance > 0) --balance;
    }
  }

  size_t lex_token(size_t p, std::vector<Token>& out) {
    const size_t start = p;
    const char c = src_[p];
    auto is_name_start = [](char ch) { return std::isalpha(static_cast<unsigned char>(ch)) || ch == '_'; };
    auto is_name_char = [](char ch) { return std::isalnum(static_cast<unsigned char>(ch)) || ch == '_'; };
    auto is_digit = [](char ch) { return ch >= '0' && ch <= '9'; };
    if (is_name_start(c)) {
      while (p < src_.size() && is_name_char(src_[p])) ++p;
      out.push_back({Token::T::Name, src_.substr(start, p - start), at(start)});
      return p;
    }
    if (is_digit(c)) {
      while (p < src_.size() && (is_digit(src_[p]) || (src_[p] == '_' && p + 1 < src_.size() && is_digit(src_[p + 1])))) ++p;
      bool is_float = false;
      if (p + 1 < src_.size() && src_[p] == '.' && is_digit(src_[p + 1])) {
        is_float = true;
        ++p;
        while (p < src_.size() && (is_digit(src_[p]) || (src_[p] == '_' && p + 1 < src_.size() && is_digit(src_[p + 1])))) ++p;
      }
      if (p < src_.size() && (src_[p] == 'e' || src_[p] == 'E')) {
        size_t q = p + 1;
        if (q < src_.size() && (src_[q] == '+' || src_[q] == '-')) ++q;
        if (q < src_.size() && is_digit(src_[q])) {
          is_float = true;
          p = q;
          while (p < src_.size() && is_digit(src_[p])) ++p;
        }
      }
      std::string digits;
      for (size_t k = start; k < p; ++k)
        if (src_[k] != '_') digits += src_[k];
      out.push_back({is_float ? Token::T::Float : Token::T::Int, digits, at(start)});
      return p;
    }
    if (c == '\'' || c == '"') return lex_string(p, out);
    static const char* const ops[] = {"//", "**", "==", "!=", ">=", "<=", "+", "-", "*", "/", "%", "~", "<",
                                      ">",  "(",  ")",  "[",  "]",  "{",  "}", ",", ".", ":", "|", "=", ";"};
    for (const char* op : ops) {
      const size_t len = std::char_traits<char>::length(op);
      if (src_.compare(p, len, op) == 0) {
        out.push_back({Token::T::Op, op, at(start)});
        return p + len;
      }
    }
    fail(p, fmt::format("unexpected character '{}'", std::string(1, c)));
  }

  size_t lex_string(size_t p, std::vector<Token>& out) {
    const size_t start = p;
    const char quote = src_[p++];
    std::string v;
    auto hex = [&](size_t at_, size_t digits) -> uint32_t {
      uint32_t x = 0;
      for (size_t k = 0; k < digits; ++k) {
        const char h = at_ + k < src_.size() ? src_[at_ + k] : 0;
        const int d = h >= '0' && h <= '9' ? h - '0' : h >= 'a' && h <= 'f' ? h - 'a' + 10 : h >= 'A' && h <= 'F' ? h - 'A' + 10 : -1;
        if (d < 0) fail(at_ - 2, fmt::format("truncated \\{} escape in a string", src_[at_ - 1]));
        x = x * 16 + static_cast<uint32_t>(d);
      }
      return x;
    };
    while (true) {
      if (p >= src_.size()) fail(start, "unterminated string");
      const char c = src_[p];
      if (c == quote) break;
      if (c != '\\') {
        v += c;
        ++p;
        continue;
      }
      if (p + 1 >= src_.size()) fail(start, "unterminated string");
      const char e = src_[p + 1];
      p += 2;
      switch (e) {
        case 'n':
          v += '\n';
          break;
        case 't':
          v += '\t';
          break;
        case 'r':
          v += '\r';
          break;
        case 'b':
          v += '\b';
          break;
        case 'f':
          v += '\f';
          break;
        case 'v':
          v += '\v';
          break;
        case 'a':
          v += '\a';
          break;
        case '\\':
          v += '\\';
          break;
        case '\'':
          v += '\'';
          break;
        case '"':
          v += '"';
          break;
        case '\n':
          break;
        case 'x':
          append_utf8(v, hex(p, 2)), p += 2;
          break;
        case 'u':
          append_utf8(v, hex(p, 4)), p += 4;
          break;
        case 'U': {
          const uint32_t cp = hex(p, 8);
          if (cp > 0x10FFFF) fail(p - 2, "\\U escape outside Unicode");
          append_utf8(v, cp);
          p += 8;
          break;
        }
        default:
          if (e >= '0' && e <= '7') {
            uint32_t x = static_cast<uint32_t>(e - '0');
            for (int k = 0; k < 2 && p < src_.size() && src_[p] >= '0' && src_[p] <= '7'; ++k)
              x = x * 8 + static_cast<uint32_t>(src_[p++] - '0');
            append_utf8(v, x);
          } else {
            v += '\\';
            v += e;
          }
      }
    }
    out.push_back({Token::T::String, std::move(v), at(start)});
    return p + 1;
  }

  const std::string& src_;
  const std::string& origin_;
  std::vector<size_t> line_starts_;
};

// ---------------------------------------------------------------------------------------------
// Parser.

const std::set<std::string, std::less<>>& known_filters() {
  static const std::set<std::string, std::less<>> f = {
      "abs",    "attr",   "capitalize", "count",   "d",       "default", "e",    "escape", "first",      "float",
      "indent", "int",    "items",      "join",    "last",    "length",  "list", "lower",  "map",        "max",
      "min",    "reject", "rejectattr", "replace", "reverse", "round",   "safe", "select", "selectattr", "sort",
      "string", "sum",    "title",      "tojson",  "trim",    "unique",  "upper"};
  return f;
}

const std::set<std::string, std::less<>>& known_tests() {
  static const std::set<std::string, std::less<>> t = {
      "defined", "undefined", "none",     "boolean",  "true",     "false",  "integer",     "float",   "number",
      "string",  "mapping",   "iterable", "sequence", "callable", "sameas", "eq",          "equalto", "==",
      "ne",      "!=",        "lt",       "lessthan", "<",        "le",     "<=",          "gt",      "greaterthan",
      ">",       "ge",        ">=",       "in",       "odd",      "even",   "divisibleby", "lower",   "upper"};
  return t;
}

class Parser {
 public:
  Parser(std::vector<Token> toks, const std::string& origin, int max_depth) : t_(std::move(toks)), origin_(origin), max_depth_(max_depth) {}

  Body parse_template() {
    std::string end;
    Body b = parse_body({}, end);
    return b;
  }

 private:
  struct DepthGuard {
    Parser& p;
    explicit DepthGuard(Parser& parser) : p(parser) {
      if (++p.depth_ > p.max_depth_) p.fail(p.cur().pos, fmt::format("nested more than {} levels deep", p.max_depth_));
    }
    ~DepthGuard() { --p.depth_; }
  };

  const Token& cur() const { return t_[i_]; }
  const Token& peek(size_t k = 1) const { return t_[std::min(i_ + k, t_.size() - 1)]; }
  Token next() { return i_ + 1 < t_.size() ? t_[i_++] : t_[i_]; }
  [[noreturn]] void fail(Pos p, const std::string& msg) const { fail_at(origin_, p, msg); }

  static std::string describe(const Token& t) {
    if (t.t == Token::T::Name || t.t == Token::T::Op) return "'" + t.v + "'";
    return token_desc(t.t);
  }
  bool is_op(const char* op) const { return cur().t == Token::T::Op && cur().v == op; }
  bool is_name(const char* n) const { return cur().t == Token::T::Name && cur().v == n; }
  bool skip_op(const char* op) {
    if (!is_op(op)) return false;
    next();
    return true;
  }
  bool skip_name(const char* n) {
    if (!is_name(n)) return false;
    next();
    return true;
  }
  void expect_op(const char* op) {
    if (!skip_op(op)) fail(cur().pos, fmt::format("expected '{}', got {}", op, describe(cur())));
  }
  std::string expect_name(const char* what) {
    if (cur().t != Token::T::Name) fail(cur().pos, fmt::format("expected {}, got {}", what, describe(cur())));
    return next().v;
  }
  void expect_block_end(const char* tag) {
    if (cur().t != Token::T::BlockEnd)
      fail(cur().pos, fmt::format("expected end of statement block ('%}}') after '{}', got {}", tag, describe(cur())));
    next();
  }

  // Statements until a `{% name %}` with name in `ends` (left after the name) or the end.
  Body parse_body(const std::vector<std::string>& ends, std::string& end_found, const char* opener = nullptr, Pos opened = {}) {
    DepthGuard guard(*this);
    Body body;
    while (true) {
      const Token& t = cur();
      if (t.t == Token::T::Eof) {
        if (ends.empty()) return body;
        fail(t.pos, fmt::format("unexpected end of template: expected '{}' to close the '{}' at line {}", ends.back(),
                                opener ? opener : "block", opened.line));
      }
      if (t.t == Token::T::Text) {
        auto n = std::make_unique<Node>();
        n->k = Node::K::Text;
        n->pos = t.pos;
        n->text = t.v;
        body.push_back(std::move(n));
        next();
      } else if (t.t == Token::T::VarBegin) {
        auto n = std::make_unique<Node>();
        n->k = Node::K::Output;
        n->pos = t.pos;
        next();
        n->expr = parse_tuple(true);
        if (cur().t != Token::T::VarEnd) fail(cur().pos, fmt::format("expected end of print statement ('}}}}'), got {}", describe(cur())));
        next();
        body.push_back(std::move(n));
      } else if (t.t == Token::T::BlockBegin) {
        const Token& name = peek();
        if (name.t != Token::T::Name) fail(name.pos, fmt::format("expected a statement name after '{{%', got {}", describe(name)));
        if (std::find(ends.begin(), ends.end(), name.v) != ends.end()) {
          next();
          next();
          end_found = name.v;
          return body;
        }
        if (name.v.rfind("end", 0) == 0 || name.v == "elif" || name.v == "else") {
          if (ends.empty()) fail(name.pos, fmt::format("unexpected '{}': no block is open", name.v));
          fail(name.pos, fmt::format("unexpected '{}': expected '{}' to close the '{}' at line {}", name.v, ends.back(),
                                     opener ? opener : "block", opened.line));
        }
        next();
        body.push_back(parse_statement());
      } else {
        fail(t.pos, fmt::format("unexpected {}", describe(t)));
      }
    }
  }

  NodeP parse_statement() {
    const Token tag = next();
    auto n = std::make_unique<Node>();
    n->pos = tag.pos;
    const std::string& s = tag.v;
    if (s == "if") {
      n->k = Node::K::If;
      ExprP cond = parse_expression(true);
      expect_block_end("if");
      while (true) {
        std::string end;
        Body b = parse_body({"elif", "else", "endif"}, end, "if", tag.pos);
        n->branches.emplace_back(std::move(cond), std::move(b));
        if (end == "elif") {
          cond = parse_expression(true);
          expect_block_end("elif");
          continue;
        }
        if (end == "else") {
          expect_block_end("else");
          n->else_body = parse_body({"endif"}, end, "if", tag.pos);
        }
        expect_block_end("endif");
        break;
      }
    } else if (s == "for") {
      n->k = Node::K::For;
      do {
        n->targets.push_back(expect_name("a loop variable name"));
      } while (skip_op(","));
      if (!skip_name("in")) fail(cur().pos, fmt::format("expected 'in' in the for statement, got {}", describe(cur())));
      n->expr = parse_tuple(false);
      if (skip_name("if")) n->cond = parse_expression(true);
      if (is_name("recursive")) fail(cur().pos, "recursive loops are not supported");
      expect_block_end("for");
      ++loops_;
      std::string end;
      n->body = parse_body({"else", "endfor"}, end, "for", tag.pos);
      --loops_;
      if (end == "else") {
        expect_block_end("else");
        n->else_body = parse_body({"endfor"}, end, "for", tag.pos);
      }
      expect_block_end("endfor");
    } else if (s == "set") {
      n->targets.push_back(expect_name("a variable name"));
      if (skip_op(".")) {
        n->text = expect_name("an attribute name");
      } else {
        while (skip_op(",")) n->targets.push_back(expect_name("a variable name"));
      }
      if (skip_op("=")) {
        n->k = Node::K::Set;
        n->expr = parse_tuple(true);
        expect_block_end("set");
      } else {
        if (n->targets.size() != 1 || !n->text.empty()) fail(cur().pos, fmt::format("expected '=', got {}", describe(cur())));
        n->k = Node::K::SetBlock;
        while (skip_op("|")) n->filters.push_back(parse_filter(nullptr));
        expect_block_end("set");
        std::string end;
        n->body = parse_body({"endset"}, end, "set", tag.pos);
        expect_block_end("endset");
      }
    } else if (s == "macro") {
      n->k = Node::K::Macro;
      n->text = expect_name("a macro name");
      expect_op("(");
      while (!is_op(")")) {
        n->targets.push_back(expect_name("a parameter name"));
        n->defaults.push_back(skip_op("=") ? parse_expression(true) : nullptr);
        if (!skip_op(",")) break;
      }
      expect_op(")");
      expect_block_end("macro");
      const int loops = std::exchange(loops_, 0);
      std::string end;
      n->body = parse_body({"endmacro"}, end, "macro", tag.pos);
      loops_ = loops;
      if (cur().t == Token::T::Name) next();  // {% endmacro name %}
      expect_block_end("endmacro");
    } else if (s == "filter") {
      n->k = Node::K::FilterBlock;
      do {
        n->filters.push_back(parse_filter(nullptr));
      } while (skip_op("|"));
      expect_block_end("filter");
      std::string end;
      n->body = parse_body({"endfilter"}, end, "filter", tag.pos);
      expect_block_end("endfilter");
    } else if (s == "generation") {  // Transformers' assistant-mask tag: renders its body, noting where
      n->k = Node::K::Generation;
      expect_block_end("generation");
      std::string end;
      n->body = parse_body({"endgeneration"}, end, "generation", tag.pos);
      expect_block_end("endgeneration");
    } else if (s == "break" || s == "continue") {
      if (loops_ == 0) fail(tag.pos, fmt::format("'{}' outside of a loop", s));
      n->k = s == "break" ? Node::K::Break : Node::K::Continue;
      expect_block_end(s.c_str());
    } else {
      static const std::set<std::string, std::less<>> unsupported = {"call",  "include", "import", "from", "extends",
                                                                     "block", "with",    "raw",    "do",   "autoescape"};
      if (unsupported.count(s)) fail(tag.pos, fmt::format("the '{}' statement is not supported in chat templates", s));
      fail(tag.pos, fmt::format("unknown statement '{}' (expected if, for, set, macro, filter, break, continue or an end tag)", s));
    }
    return n;
  }

  ExprP make(Expr::K k, Pos p) {
    auto e = std::make_unique<Expr>();
    e->k = k;
    e->pos = p;
    return e;
  }

  // An expression, or a tuple of them without parentheses (`{{ a, b }}`, `set x = 1, 2`, `for x in a, b`).
  ExprP parse_tuple(bool with_condexpr) {
    const Pos p = cur().pos;
    ExprP first = parse_expression(with_condexpr);
    if (!is_op(",")) return first;
    auto t = make(Expr::K::Tuple, p);
    t->a.push_back(std::move(first));
    while (skip_op(",")) {
      if (cur().t == Token::T::VarEnd || cur().t == Token::T::BlockEnd || is_name("if")) break;
      t->a.push_back(parse_expression(with_condexpr));
    }
    return t;
  }

  ExprP parse_expression(bool with_condexpr) {
    DepthGuard guard(*this);
    ExprP e = parse_or();
    if (!with_condexpr) return e;
    while (is_name("if")) {
      const Pos p = next().pos;
      auto c = make(Expr::K::Cond, p);
      c->a.push_back(std::move(e));
      c->a.push_back(parse_or());
      c->a.push_back(skip_name("else") ? parse_expression(true) : nullptr);
      e = std::move(c);
    }
    return e;
  }

  ExprP parse_or() {
    ExprP l = parse_and();
    while (is_name("or")) {
      auto e = make(Expr::K::Or, next().pos);
      e->a.push_back(std::move(l));
      e->a.push_back(parse_and());
      l = std::move(e);
    }
    return l;
  }
  ExprP parse_and() {
    ExprP l = parse_not();
    while (is_name("and")) {
      auto e = make(Expr::K::And, next().pos);
      e->a.push_back(std::move(l));
      e->a.push_back(parse_not());
      l = std::move(e);
    }
    return l;
  }
  ExprP parse_not() {
    if (is_name("not")) {
      DepthGuard guard(*this);
      auto e = make(Expr::K::Not, next().pos);
      e->a.push_back(parse_not());
      return e;
    }
    return parse_compare();
  }
  ExprP parse_compare() {
    const Pos p = cur().pos;
    ExprP first = parse_math1();
    ExprP cmp;
    while (true) {
      std::string op;
      if (cur().t == Token::T::Op &&
          (cur().v == "==" || cur().v == "!=" || cur().v == "<" || cur().v == ">" || cur().v == "<=" || cur().v == ">=")) {
        op = next().v;
      } else if (is_name("in")) {
        next();
        op = "in";
      } else if (is_name("not") && peek().t == Token::T::Name && peek().v == "in") {
        next();
        next();
        op = "not in";
      } else {
        break;
      }
      if (!cmp) {
        cmp = make(Expr::K::Compare, p);
        cmp->a.push_back(std::move(first));
      }
      cmp->ops.push_back(op);
      cmp->a.push_back(parse_math1());
    }
    return cmp ? std::move(cmp) : std::move(first);
  }
  ExprP binary(const std::string& op, Pos p, ExprP l, ExprP r) {
    auto e = make(Expr::K::Binary, p);
    e->name = op;
    e->a.push_back(std::move(l));
    e->a.push_back(std::move(r));
    return e;
  }
  ExprP parse_math1() {
    ExprP l = parse_concat();
    while (is_op("+") || is_op("-")) {
      const Token op = next();
      l = binary(op.v, op.pos, std::move(l), parse_concat());
    }
    return l;
  }
  ExprP parse_concat() {
    ExprP l = parse_math2();
    while (is_op("~")) {
      const Token op = next();
      l = binary("~", op.pos, std::move(l), parse_math2());
    }
    return l;
  }
  ExprP parse_math2() {
    ExprP l = parse_pow();
    while (is_op("*") || is_op("/") || is_op("//") || is_op("%")) {
      const Token op = next();
      l = binary(op.v, op.pos, std::move(l), parse_pow());
    }
    return l;
  }
  ExprP parse_pow() {
    ExprP l = parse_unary(true);
    while (is_op("**")) {
      const Token op = next();
      l = binary("**", op.pos, std::move(l), parse_unary(true));
    }
    return l;
  }
  ExprP parse_unary(bool with_filter) {
    DepthGuard guard(*this);
    ExprP e;
    if (is_op("-") || is_op("+")) {
      const Token op = next();
      e = make(op.v == "-" ? Expr::K::Neg : Expr::K::Pos, op.pos);
      e->a.push_back(parse_unary(false));
    } else {
      e = parse_primary();
    }
    e = parse_postfix(std::move(e));
    if (with_filter) e = parse_filter_expr(std::move(e));
    return e;
  }

  ExprP parse_primary() {
    const Token& t = cur();
    if (t.t == Token::T::Name) {
      const Token n = next();
      if (n.v == "true" || n.v == "True") return literal(Value::boolean(true), n.pos);
      if (n.v == "false" || n.v == "False") return literal(Value::boolean(false), n.pos);
      if (n.v == "none" || n.v == "None") return literal(Value::none(), n.pos);
      auto e = make(Expr::K::Name, n.pos);
      e->name = n.v;
      return e;
    }
    if (t.t == Token::T::String) {
      const Pos p = t.pos;
      std::string s;
      while (cur().t == Token::T::String) s += next().v;
      return literal(Value::string(std::move(s)), p);
    }
    if (t.t == Token::T::Int) {
      const Token n = next();
      int64_t v = 0;
      const auto r = std::from_chars(n.v.data(), n.v.data() + n.v.size(), v);
      if (r.ec != std::errc()) fail(n.pos, fmt::format("integer literal {} is out of range", n.v));
      return literal(Value::integer(v), n.pos);
    }
    if (t.t == Token::T::Float) {
      const Token n = next();
      double v = 0;
      std::from_chars(n.v.data(), n.v.data() + n.v.size(), v);
      if (std::isinf(v)) v = HUGE_VAL;
      return literal(Value::real(v), n.pos);
    }
    if (is_op("(")) {
      const Pos p = next().pos;
      if (skip_op(")")) return make(Expr::K::Tuple, p);
      ExprP first = parse_expression(true);
      if (skip_op(")")) return first;
      auto tup = make(Expr::K::Tuple, p);
      tup->a.push_back(std::move(first));
      while (skip_op(",")) {
        if (is_op(")")) break;
        tup->a.push_back(parse_expression(true));
      }
      expect_op(")");
      return tup;
    }
    if (is_op("[")) {
      auto l = make(Expr::K::List, next().pos);
      while (!is_op("]")) {
        l->a.push_back(parse_expression(true));
        if (!skip_op(",")) break;
      }
      expect_op("]");
      return l;
    }
    if (is_op("{")) {
      auto d = make(Expr::K::Dict, next().pos);
      while (!is_op("}")) {
        d->a.push_back(parse_expression(true));
        expect_op(":");
        d->a.push_back(parse_expression(true));
        if (!skip_op(",")) break;
      }
      expect_op("}");
      return d;
    }
    fail(t.pos, fmt::format("expected an expression, got {}", describe(t)));
  }

  ExprP literal(Value v, Pos p) {
    auto e = make(Expr::K::Literal, p);
    e->lit = std::move(v);
    return e;
  }

  ExprP parse_postfix(ExprP e) {
    while (true) {
      if (is_op(".")) {
        const Pos p = next().pos;
        if (cur().t == Token::T::Int) {  // x.0 is x[0]
          auto it = make(Expr::K::Item, p);
          it->a.push_back(std::move(e));
          it->a.push_back(parse_primary());
          e = std::move(it);
          continue;
        }
        auto at = make(Expr::K::Attr, p);
        at->name = expect_name("an attribute name after '.'");
        at->a.push_back(std::move(e));
        e = std::move(at);
      } else if (is_op("[")) {
        e = parse_subscript(std::move(e));
      } else if (is_op("(")) {
        e = parse_call(std::move(e));
      } else {
        return e;
      }
    }
  }

  ExprP parse_subscript(ExprP obj) {
    DepthGuard guard(*this);
    const Pos p = next().pos;
    ExprP parts[3];
    bool slice = false;
    int k = 0;
    while (true) {
      if (is_op(":")) {
        next();
        slice = true;
        if (++k > 2) fail(cur().pos, "a slice has at most three parts");
        continue;
      }
      if (is_op("]")) break;
      if (parts[k]) fail(cur().pos, fmt::format("expected ']' or ':', got {}", describe(cur())));
      parts[k] = parse_expression(true);
    }
    expect_op("]");
    if (!slice) {
      if (!parts[0]) fail(p, "empty subscript");
      auto it = make(Expr::K::Item, p);
      it->a.push_back(std::move(obj));
      it->a.push_back(std::move(parts[0]));
      return it;
    }
    auto s = make(Expr::K::Slice, p);
    s->a.push_back(std::move(obj));
    for (auto& part : parts) s->a.push_back(std::move(part));
    return s;
  }

  void parse_call_args(Expr& e) {
    DepthGuard guard(*this);
    expect_op("(");
    while (!is_op(")")) {
      if (cur().t == Token::T::Name && peek().t == Token::T::Op && peek().v == "=") {
        std::string k = next().v;
        next();
        e.kw.emplace_back(std::move(k), parse_expression(true));
      } else {
        if (!e.kw.empty()) fail(cur().pos, "a positional argument follows a keyword argument");
        e.a.push_back(parse_expression(true));
      }
      if (!skip_op(",")) break;
    }
    expect_op(")");
  }

  ExprP parse_call(ExprP callee) {
    auto c = make(Expr::K::Call, callee->pos);
    c->a.push_back(std::move(callee));
    parse_call_args(*c);
    return c;
  }

  // `| name(args)`; operand null for filter blocks (the body is the operand).
  ExprP parse_filter(ExprP operand) {
    const Pos p = cur().pos;
    const std::string name = expect_name("a filter name");
    if (!known_filters().count(name)) fail(p, fmt::format("no filter named '{}'", name));
    auto f = make(Expr::K::Filter, p);
    f->name = name;
    f->a.push_back(std::move(operand));
    if (is_op("(")) parse_call_args(*f);
    return f;
  }

  ExprP parse_filter_expr(ExprP e) {
    while (true) {
      if (is_op("|")) {
        next();
        e = parse_filter(std::move(e));
      } else if (is_name("is")) {
        const Pos p = next().pos;
        auto t = make(Expr::K::Test, p);
        t->negated = skip_name("not");
        const Pos np = cur().pos;
        if (cur().t == Token::T::Name) {
          t->name = next().v;
        } else if (cur().t == Token::T::Op && known_tests().count(cur().v)) {
          t->name = next().v;
        } else {
          fail(np, fmt::format("expected a test name after 'is', got {}", describe(cur())));
        }
        if (!known_tests().count(t->name)) fail(np, fmt::format("no test named '{}'", t->name));
        t->a.push_back(std::move(e));
        if (is_op("(")) {
          parse_call_args(*t);
        } else if ((cur().t == Token::T::Name || cur().t == Token::T::String || cur().t == Token::T::Int || cur().t == Token::T::Float ||
                    is_op("(") || is_op("[") || is_op("{")) &&
                   !is_name("else") && !is_name("or") && !is_name("and")) {
          if (is_name("is")) fail(cur().pos, "tests cannot be chained with 'is'");
          DepthGuard guard(*this);
          t->a.push_back(parse_postfix(parse_primary()));
        }
        e = std::move(t);
      } else if (is_op("(")) {
        e = parse_call(std::move(e));
      } else {
        return e;
      }
    }
  }

  std::vector<Token> t_;
  size_t i_ = 0;
  const std::string& origin_;
  int max_depth_;
  int depth_ = 0;
  int loops_ = 0;
};

}  // namespace

namespace {

// ---------------------------------------------------------------------------------------------
// The interpreter.

enum class Flow { Normal, Break, Continue };

using Frame = std::unordered_map<std::string, Value>;

class Interp {
 public:
  Interp(const ChatTemplate::Program& prog, const ChatTemplate::Limits& lim) : prog_(prog), lim_(lim) {}
  Interp(const Interp&) = delete;
  Interp& operator=(const Interp&) = delete;
  // Lists and dicts are immutable in the sandbox, so a reference cycle can only pass through a
  // namespace's attributes (`{% set ns.me = ns %}`). Every namespace is made by this render and none
  // outlives it (the render returns text), so emptying them here frees any cycle.
  ~Interp() {
    for (const auto& d : namespaces_) d->items.clear();
  }
  void own_namespace(const Value& ns) { namespaces_.push_back(ns.dict); }

  // The prompt; with `spans`, the [begin, end) byte ranges of it that generation blocks rendered.
  std::string run(Frame globals, std::vector<std::pair<size_t, size_t>>* spans = nullptr) {
    frames_.push_back(std::move(globals));
    std::string out;
    top_ = &out;
    spans_ = spans;
    exec(prog_.body, out);
    return out;
  }

  // ---- errors and budgets
  [[noreturn]] void fail(const std::string& msg) const { fail_at(prog_.origin, pos_, msg); }
  void tick(int64_t n = 1) {
    steps_ += n;
    if (steps_ > lim_.max_steps) fail(fmt::format("rendering takes more than {} steps", lim_.max_steps));
  }
  void check_size(size_t n) const {
    if (n > lim_.max_output_bytes) fail(fmt::format("output or string larger than {} bytes", lim_.max_output_bytes));
  }
  struct Nest {
    Interp& in;
    explicit Nest(Interp& i) : in(i) {
      if (++in.depth_ > in.lim_.max_depth) in.fail(fmt::format("values nested more than {} levels deep", in.lim_.max_depth));
    }
    ~Nest() { --in.depth_; }
  };
  [[noreturn]] void undefined_error(const Value& v) const { fail(v.s.empty() ? "undefined value" : v.s); }

  // ---- conversions
  void repr(const Value& v, std::string& out) {
    Nest nest(*this);
    tick();
    check_size(out.size());
    switch (v.kind) {
      case Value::Kind::String: {
        const char q = v.s.find('\'') != std::string::npos && v.s.find('"') == std::string::npos ? '"' : '\'';
        out += q;
        for (char c : v.s) {
          if (c == q || c == '\\')
            out += '\\', out += c;
          else if (c == '\n')
            out += "\\n";
          else if (c == '\r')
            out += "\\r";
          else if (c == '\t')
            out += "\\t";
          else if ((static_cast<unsigned char>(c) < 0x20) || c == 0x7f)
            out += fmt::format("\\x{:02x}", static_cast<unsigned char>(c));
          else
            out += c;
        }
        out += q;
        return;
      }
      case Value::Kind::List: {
        const bool tuple = v.list->tuple;
        out += tuple ? '(' : '[';
        for (size_t k = 0; k < v.list->items.size(); ++k) {
          if (k) out += ", ";
          repr(v.list->items[k], out);
        }
        if (tuple && v.list->items.size() == 1) out += ',';
        out += tuple ? ')' : ']';
        return;
      }
      case Value::Kind::Dict:
      case Value::Kind::Namespace: {
        if (v.kind == Value::Kind::Namespace) out += "<Namespace ";
        out += '{';
        bool first = true;
        for (const auto& [k, x] : v.dict->items) {
          if (!first) out += ", ";
          first = false;
          repr(k, out);
          out += ": ";
          repr(x, out);
        }
        out += '}';
        if (v.kind == Value::Kind::Namespace) out += '>';
        return;
      }
      default:
        out += str(v);
    }
  }

  // Python's str().
  std::string str(const Value& v) {
    switch (v.kind) {
      case Value::Kind::Undefined:
        return "";
      case Value::Kind::None:
        return "None";
      case Value::Kind::Bool:
        return v.b ? "True" : "False";
      case Value::Kind::Int:
        return std::to_string(v.i);
      case Value::Kind::Float:
        return py_float(v.f);
      case Value::Kind::String:
        return v.s;
      case Value::Kind::Function:
        return "<function " + v.fn->name + ">";
      default: {
        std::string out;
        repr(v, out);
        return out;
      }
    }
  }

  // json.dumps as Transformers' tojson calls it.
  struct JsonStyle {
    bool pretty = false;
    std::string indent, item_sep = ", ", key_sep = ": ";
    bool ensure_ascii = false, sort_keys = false;
  };
  void json_string(const std::string& s, bool ensure_ascii, std::string& out) {
    out += '"';
    for (size_t i = 0; i < s.size();) {
      const size_t n = cp_size(s, i);
      const unsigned char c = static_cast<unsigned char>(s[i]);
      if (n == 1) {
        switch (c) {
          case '"':
            out += "\\\"";
            break;
          case '\\':
            out += "\\\\";
            break;
          case '\n':
            out += "\\n";
            break;
          case '\r':
            out += "\\r";
            break;
          case '\t':
            out += "\\t";
            break;
          case '\b':
            out += "\\b";
            break;
          case '\f':
            out += "\\f";
            break;
          default:
            if (c < 0x20 || (ensure_ascii && c >= 0x7f))
              out += fmt::format("\\u{:04x}", c);
            else
              out += static_cast<char>(c);
        }
      } else if (ensure_ascii) {
        uint32_t cp = cp_value(s, i, n);
        if (cp >= 0x10000) {
          cp -= 0x10000;
          out += fmt::format("\\u{:04x}\\u{:04x}", 0xD800 + (cp >> 10), 0xDC00 + (cp & 0x3FF));
        } else {
          out += fmt::format("\\u{:04x}", cp);
        }
      } else {
        out.append(s, i, n);
      }
      i += n;
    }
    out += '"';
  }
  void json(const Value& v, const JsonStyle& st, int level, std::string& out) {
    Nest nest(*this);
    tick();
    check_size(out.size());
    auto newline = [&](int lv) {
      if (!st.pretty) return;
      out += '\n';
      for (int k = 0; k < lv; ++k) out += st.indent;
    };
    switch (v.kind) {
      case Value::Kind::None:
        out += "null";
        return;
      case Value::Kind::Bool:
        out += v.b ? "true" : "false";
        return;
      case Value::Kind::Int:
        out += std::to_string(v.i);
        return;
      case Value::Kind::Float:
        out += std::isnan(v.f) ? "NaN" : std::isinf(v.f) ? (v.f < 0 ? "-Infinity" : "Infinity") : py_float(v.f);
        return;
      case Value::Kind::String:
        json_string(v.s, st.ensure_ascii, out);
        return;
      case Value::Kind::List: {
        if (v.list->items.empty()) {
          out += "[]";
          return;
        }
        out += '[';
        for (size_t k = 0; k < v.list->items.size(); ++k) {
          if (k) out += st.item_sep;
          newline(level + 1);
          json(v.list->items[k], st, level + 1, out);
        }
        newline(level);
        out += ']';
        return;
      }
      case Value::Kind::Dict: {
        if (v.dict->items.empty()) {
          out += "{}";
          return;
        }
        std::vector<std::pair<std::string, const Value*>> items;
        for (const auto& [k, x] : v.dict->items) {
          std::string key;
          if (k.is(Value::Kind::String))
            key = k.s;
          else if (k.is(Value::Kind::None))
            key = "null";
          else if (k.is(Value::Kind::Bool))
            key = k.b ? "true" : "false";
          else if (k.is_number())
            key = str(k);
          else
            fail(fmt::format("keys must be str, int, float, bool or None, not {}", type_name(k)));
          items.emplace_back(std::move(key), &x);
        }
        if (st.sort_keys) std::stable_sort(items.begin(), items.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
        out += '{';
        for (size_t k = 0; k < items.size(); ++k) {
          if (k) out += st.item_sep;
          newline(level + 1);
          json_string(items[k].first, st.ensure_ascii, out);
          out += st.key_sep;
          json(*items[k].second, st, level + 1, out);
        }
        newline(level);
        out += '}';
        return;
      }
      default:
        fail(fmt::format("Object of type {} is not JSON serializable", type_name(v)));
    }
  }

  // ---- comparisons
  bool equal(const Value& a, const Value& b) {
    tick();
    if (a.is_number() && b.is_number()) {
      if (a.is(Value::Kind::Float) || b.is(Value::Kind::Float)) return a.as_double() == b.as_double();
      return a.as_int() == b.as_int();
    }
    if (a.kind != b.kind) return false;
    switch (a.kind) {
      case Value::Kind::Undefined:
      case Value::Kind::None:
        return true;
      case Value::Kind::String:
        return a.s == b.s;
      case Value::Kind::List: {
        if (a.list == b.list) return true;
        if (a.list->tuple != b.list->tuple || a.list->items.size() != b.list->items.size()) return false;
        Nest nest(*this);
        for (size_t k = 0; k < a.list->items.size(); ++k)
          if (!equal(a.list->items[k], b.list->items[k])) return false;
        return true;
      }
      case Value::Kind::Dict: {
        if (a.dict == b.dict) return true;
        if (a.dict->items.size() != b.dict->items.size()) return false;
        Nest nest(*this);
        for (const auto& [k, x] : a.dict->items) {
          const Value* y = find_key(b, k);
          if (!y || !equal(x, *y)) return false;
        }
        return true;
      }
      case Value::Kind::Namespace:
        return a.dict == b.dict;
      case Value::Kind::Function:
        return a.fn == b.fn;
      default:
        return false;
    }
  }
  const Value* find_key(const Value& d, const Value& key) {
    for (const auto& [k, x] : d.dict->items) {
      if (k.is(Value::Kind::String) && key.is(Value::Kind::String)) {
        tick();
        if (k.s == key.s) return &x;
      } else if (equal(k, key)) {
        return &x;
      }
    }
    return nullptr;
  }
  const Value* find_key(const Value& d, const std::string& key) {
    for (const auto& [k, x] : d.dict->items)
      if (k.is(Value::Kind::String) && k.s == key) return &x;
    return nullptr;
  }
  // a < b with Python's rules (numbers, strings, lists / tuples of the same kind).
  bool less(const Value& a, const Value& b) {
    tick();
    if (a.is_number() && b.is_number()) {
      if (a.is(Value::Kind::Float) || b.is(Value::Kind::Float)) return a.as_double() < b.as_double();
      return a.as_int() < b.as_int();
    }
    if (a.is(Value::Kind::String) && b.is(Value::Kind::String)) return a.s < b.s;
    if (a.is(Value::Kind::List) && b.is(Value::Kind::List) && a.list->tuple == b.list->tuple) {
      Nest nest(*this);
      const auto& x = a.list->items;
      const auto& y = b.list->items;
      for (size_t k = 0; k < x.size() && k < y.size(); ++k) {
        if (equal(x[k], y[k])) continue;
        return less(x[k], y[k]);
      }
      return x.size() < y.size();
    }
    if (a.is_undefined()) undefined_error(a);
    if (b.is_undefined()) undefined_error(b);
    fail(fmt::format("'<' not supported between instances of '{}' and '{}'", type_name(a), type_name(b)));
  }
  bool contains(const Value& container, const Value& item) {
    switch (container.kind) {
      case Value::Kind::String:
        if (!item.is(Value::Kind::String)) fail(fmt::format("'in <string>' requires string as left operand, not {}", type_name(item)));
        tick(static_cast<int64_t>(container.s.size() / 64));
        return container.s.find(item.s) != std::string::npos;
      case Value::Kind::List:
        for (const auto& x : container.list->items)
          if (equal(x, item)) return true;
        return false;
      case Value::Kind::Dict:
        return find_key(container, item) != nullptr;
      case Value::Kind::Undefined:
        return false;
      default:
        fail(fmt::format("argument of type '{}' is not iterable", type_name(container)));
    }
  }

  // The items a for loop, list() or a filter walks over.
  std::vector<Value> iterate(const Value& v) {
    switch (v.kind) {
      case Value::Kind::Undefined:
        return {};
      case Value::Kind::List:
        return v.list->items;
      case Value::Kind::Dict: {
        std::vector<Value> keys;
        for (const auto& kv : v.dict->items) keys.push_back(kv.first);
        return keys;
      }
      case Value::Kind::String: {
        std::vector<Value> chars;
        for (size_t i = 0; i < v.s.size();) {
          const size_t n = cp_size(v.s, i);
          chars.push_back(Value::string(v.s.substr(i, n)));
          i += n;
        }
        return chars;
      }
      default:
        fail(fmt::format("'{}' object is not iterable", type_name(v)));
    }
  }

  int64_t length(const Value& v) {
    switch (v.kind) {
      case Value::Kind::Undefined:
        return 0;
      case Value::Kind::String:
        return static_cast<int64_t>(cp_count(v.s));
      case Value::Kind::List:
        return static_cast<int64_t>(v.list->items.size());
      case Value::Kind::Dict:
      case Value::Kind::Namespace:
        return static_cast<int64_t>(v.dict->items.size());
      default:
        fail(fmt::format("object of type '{}' has no len()", type_name(v)));
    }
  }

  // ---- attribute and item access (Jinja's getattr: attribute first; getitem: item first)
  Value method(const Value& self, const std::string& name);

  Value get_attr(const Value& obj, const std::string& name) {
    if (obj.is_undefined()) undefined_error(obj);
    Value m = method(obj, name);
    if (!m.is_undefined()) return m;
    if ((obj.is(Value::Kind::Dict) || obj.is(Value::Kind::Namespace)))
      if (const Value* x = find_key(obj, name)) return *x;
    return Value::undefined(fmt::format("'{}' has no attribute '{}'", obj_desc(obj), name));
  }
  std::string obj_desc(const Value& obj) {
    if (obj.is(Value::Kind::None)) return "None";
    return fmt::format("{} object", type_name(obj));
  }

  Value get_item(const Value& obj, const Value& key) {
    if (obj.is_undefined()) undefined_error(obj);
    if ((obj.is(Value::Kind::List) || obj.is(Value::Kind::String)) && key.is_integral()) {
      const int64_t n = length(obj);
      int64_t k = key.as_int();
      if (k < 0) k += n;
      if (k < 0 || k >= n) return Value::undefined(fmt::format("{} index {} out of range", type_name(obj), key.as_int()));
      if (obj.is(Value::Kind::List)) return obj.list->items[static_cast<size_t>(k)];
      if (obj.s.size() == static_cast<size_t>(n)) return Value::string(obj.s.substr(static_cast<size_t>(k), 1));
      const auto off = cp_offsets(obj.s);
      return Value::string(obj.s.substr(off[k], off[k + 1] - off[k]));
    }
    if (obj.is(Value::Kind::Dict))
      if (const Value* x = find_key(obj, key)) return *x;
    if (key.is(Value::Kind::String)) {
      Value m = method(obj, key.s);
      if (!m.is_undefined()) return m;
      if (obj.is(Value::Kind::Namespace))
        if (const Value* x = find_key(obj, key.s)) return *x;
    }
    std::string k;
    repr(key, k);
    return Value::undefined(fmt::format("'{}' has no item {}", obj_desc(obj), k));
  }

  Value slice(const Value& obj, const Value* start, const Value* stop, const Value* step) {
    if (obj.is_undefined()) undefined_error(obj);
    if (!obj.is(Value::Kind::List) && !obj.is(Value::Kind::String)) fail(fmt::format("'{}' object is not subscriptable", type_name(obj)));
    auto get = [&](const Value* v, const char* what) -> std::optional<int64_t> {
      if (!v || v->is(Value::Kind::None)) return std::nullopt;
      if (!v->is_integral()) fail(fmt::format("slice {} must be an integer or none, not {}", what, type_name(*v)));
      return v->as_int();
    };
    const int64_t n = length(obj);
    const int64_t st = get(step, "step").value_or(1);
    if (st == 0) fail("slice step cannot be zero");
    auto clamp = [&](std::optional<int64_t> x, int64_t dflt) {
      if (!x) return dflt;
      int64_t v = *x;
      if (v < 0) v = std::max<int64_t>(v + n, st < 0 ? -1 : 0);
      return std::min(v, st < 0 ? n - 1 : n);
    };
    const int64_t b = clamp(get(start, "start"), st < 0 ? n - 1 : 0);
    const int64_t e = clamp(get(stop, "stop"), st < 0 ? -1 : n);
    std::vector<int64_t> idx;
    for (int64_t k = b; st > 0 ? k < e : k > e; k += st) {
      idx.push_back(k);
      tick();
    }
    if (obj.is(Value::Kind::List)) {
      std::vector<Value> items;
      for (int64_t k : idx) items.push_back(obj.list->items[static_cast<size_t>(k)]);
      return Value::make_list(std::move(items), obj.list->tuple);
    }
    const auto off = cp_offsets(obj.s);
    std::string s;
    for (int64_t k : idx) s.append(obj.s, off[k], off[k + 1] - off[k]);
    return Value::string(std::move(s));
  }

  // ---- arithmetic
  Value arith(const std::string& op, const Value& a, const Value& b) {
    if (op == "~") {
      std::string s = str(a) + str(b);
      check_size(s.size());
      return Value::string(std::move(s));
    }
    if (a.is_undefined()) undefined_error(a);
    if (b.is_undefined()) undefined_error(b);
    if (a.is_number() && b.is_number()) {
      const bool fl = a.is(Value::Kind::Float) || b.is(Value::Kind::Float);
      if (op == "/") {
        if (b.as_double() == 0) fail("division by zero");
        return Value::real(a.as_double() / b.as_double());
      }
      if (fl) {
        const double x = a.as_double(), y = b.as_double();
        if (op == "+") return Value::real(x + y);
        if (op == "-") return Value::real(x - y);
        if (op == "*") return Value::real(x * y);
        if (op == "**") return Value::real(std::pow(x, y));
        if (y == 0) fail("float division by zero");
        if (op == "//") return Value::real(std::floor(x / y));
        if (op == "%") {
          double r = std::fmod(x, y);
          if (r != 0 && ((r < 0) != (y < 0))) r += y;
          return Value::real(r);
        }
      } else {
        const int64_t x = a.as_int(), y = b.as_int();
        int64_t r = 0;
        if (op == "+" && !__builtin_add_overflow(x, y, &r)) return Value::integer(r);
        if (op == "-" && !__builtin_sub_overflow(x, y, &r)) return Value::integer(r);
        if (op == "*" && !__builtin_mul_overflow(x, y, &r)) return Value::integer(r);
        if (op == "**") {
          if (y < 0) return Value::real(std::pow(static_cast<double>(x), static_cast<double>(y)));
          r = 1;
          for (int64_t k = 0; k < y; ++k) {
            if (__builtin_mul_overflow(r, x, &r)) fail("integer overflow in '**'");
            if (r == 0 || r == 1) break;
            tick();
          }
          if (x == -1) r = (y % 2) ? -1 : 1;
          return Value::integer(r);
        }
        if (op == "//" || op == "%") {
          if (y == 0) fail("integer division or modulo by zero");
          if (x == std::numeric_limits<int64_t>::min() && y == -1) fail("integer overflow");
          int64_t q = x / y, m = x % y;
          if (m != 0 && ((m < 0) != (y < 0))) --q, m += y;
          return Value::integer(op == "//" ? q : m);
        }
        fail(fmt::format("integer overflow in '{}'", op));
      }
    }
    if (op == "+" && a.is(Value::Kind::String) && b.is(Value::Kind::String)) {
      check_size(a.s.size() + b.s.size());
      return Value::string(a.s + b.s);
    }
    if (op == "+" && a.is(Value::Kind::List) && b.is(Value::Kind::List) && a.list->tuple == b.list->tuple) {
      check_size((a.list->items.size() + b.list->items.size()) * 16);
      std::vector<Value> items = a.list->items;
      items.insert(items.end(), b.list->items.begin(), b.list->items.end());
      tick(static_cast<int64_t>(items.size()));
      return Value::make_list(std::move(items), a.list->tuple);
    }
    if (op == "*" && (a.is_integral() || b.is_integral()) &&
        (a.is(Value::Kind::String) || b.is(Value::Kind::String) || a.is(Value::Kind::List) || b.is(Value::Kind::List))) {
      const Value& seq = a.is_integral() ? b : a;
      const int64_t times = std::max<int64_t>(0, (a.is_integral() ? a : b).as_int());
      if (seq.is(Value::Kind::String)) {
        if (times > 0 && seq.s.size() > 0) check_size(seq.s.size() * static_cast<size_t>(std::min<int64_t>(times, int64_t{1} << 40)));
        std::string s;
        for (int64_t k = 0; k < times && !seq.s.empty(); ++k) s += seq.s;
        return Value::string(std::move(s));
      }
      if (times > 0 && !seq.list->items.empty())
        check_size(seq.list->items.size() * 16 * static_cast<size_t>(std::min<int64_t>(times, int64_t{1} << 40)));
      std::vector<Value> items;
      for (int64_t k = 0; k < times && !seq.list->items.empty(); ++k)
        items.insert(items.end(), seq.list->items.begin(), seq.list->items.end());
      tick(static_cast<int64_t>(items.size()));
      return Value::make_list(std::move(items), seq.list->tuple);
    }
    if (op == "%" && a.is(Value::Kind::String)) fail("the '%' string formatting operator is not supported");
    fail(fmt::format("unsupported operand type(s) for {}: '{}' and '{}'", op, type_name(a), type_name(b)));
  }

  std::string replace(const std::string& s, const std::string& old, const std::string& with, int64_t count) {
    std::string out;
    int64_t done = 0;
    if (old.empty()) {
      const auto off = cp_offsets(s);
      for (size_t k = 0; k + 1 < off.size(); ++k) {
        if (count < 0 || done < count) out += with, ++done;
        out.append(s, off[k], off[k + 1] - off[k]);
        check_size(out.size());
      }
      if (count < 0 || done < count) out += with;
      return out;
    }
    size_t b = 0;
    while (true) {
      const size_t at = (count >= 0 && done >= count) ? std::string::npos : s.find(old, b);
      if (at == std::string::npos) break;
      out.append(s, b, at - b);
      out += with;
      check_size(out.size());
      b = at + old.size();
      ++done;
    }
    out.append(s, b, std::string::npos);
    return out;
  }

  // ---- evaluation
  Value lookup(const std::string& name) {
    for (auto it = frames_.rbegin(); it != frames_.rend(); ++it) {
      const auto f = it->find(name);
      if (f != it->end()) return f->second;
    }
    return Value::undefined(fmt::format("'{}' is undefined", name));
  }

  Value eval(const Expr& e);
  Value call(const Value& callee, CallArgs& args);
  Value filter(const std::string& name, const Value& v, CallArgs& args);
  bool test(const std::string& name, const Value& v, CallArgs& args);
  Value call_macro(const Node& m, CallArgs& args);
  Flow exec(const Body& body, std::string& out);
  void assign(const std::vector<std::string>& targets, const Value& v);

  void args_of(const Expr& e, size_t first, CallArgs& args) {
    for (size_t k = first; k < e.a.size(); ++k) args.pos.push_back(eval(*e.a[k]));
    for (const auto& [name, x] : e.kw) args.kw.emplace_back(name, eval(*x));
  }

  const ChatTemplate::Program& prog_;
  const ChatTemplate::Limits& lim_;
  std::vector<Frame> frames_;
  Pos pos_;
  int64_t steps_ = 0;
  int depth_ = 0;
  int macro_depth_ = 0;
  std::vector<std::shared_ptr<DictData>> namespaces_;
  const std::string* top_ = nullptr;                     // the prompt being rendered
  std::vector<std::pair<size_t, size_t>>* spans_ = nullptr;  // generation blocks' ranges in it, when asked
};

// Positional and keyword arguments by parameter names, with defaults (null: required).
struct Params {
  Interp& in;
  const char* fn;
  CallArgs& args;
  std::vector<Value> vals;
  Params(Interp& i, const char* f, CallArgs& a, std::initializer_list<const char*> names, std::vector<Value> defaults, size_t required = 0)
      : in(i), fn(f), args(a) {
    std::vector<const char*> ns(names);
    if (args.pos.size() > ns.size()) in.fail(fmt::format("{}() takes at most {} arguments ({} given)", fn, ns.size(), args.pos.size()));
    vals = std::move(defaults);
    vals.resize(ns.size());
    std::vector<bool> given(ns.size(), false);
    for (size_t k = 0; k < args.pos.size(); ++k) vals[k] = args.pos[k], given[k] = true;
    for (auto& kw : args.kw) {
      const auto& name = kw.first;
      const auto& v = kw.second;
      const auto it = std::find_if(ns.begin(), ns.end(), [&name](const char* n) { return name == n; });
      if (it == ns.end()) in.fail(fmt::format("{}() got an unexpected keyword argument '{}'", fn, name));
      const size_t k = static_cast<size_t>(it - ns.begin());
      if (given[k]) in.fail(fmt::format("{}() got multiple values for argument '{}'", fn, name));
      vals[k] = v;
      given[k] = true;
    }
    for (size_t k = 0; k < required; ++k)
      if (!given[k]) in.fail(fmt::format("{}() missing required argument '{}'", fn, ns[k]));
  }
  const Value& operator[](size_t k) const { return vals[k]; }
  std::string string(size_t k) {
    if (!vals[k].is(Value::Kind::String)) in.fail(fmt::format("{}(): argument {} must be a string, not {}", fn, k + 1, type_name(vals[k])));
    return vals[k].s;
  }
};

Value Interp::method(const Value& self, const std::string& name) {
  auto bind = [&](Builtin f) { return Value::function(name, std::move(f)); };
  if (self.is(Value::Kind::String)) {
    const std::string s = self.s;
    if (name == "strip" || name == "lstrip" || name == "rstrip")
      return bind([s, name](Interp& in, CallArgs& a) {
        Params p(in, name.c_str(), a, {"chars"}, {Value::none()});
        const std::string chars = p[0].is(Value::Kind::None) ? "" : p.string(0);
        return Value::string(py_strip(s, p[0].is(Value::Kind::None) ? nullptr : &chars, name != "rstrip", name != "lstrip"));
      });
    if (name == "startswith" || name == "endswith")
      return bind([s, name](Interp& in, CallArgs& a) {
        Params p(in, name.c_str(), a, {"prefix"}, {}, 1);
        std::vector<Value> options = p[0].is(Value::Kind::List) ? p[0].list->items : std::vector<Value>{p[0]};
        for (const auto& o : options) {
          if (!o.is(Value::Kind::String)) in.fail(fmt::format("{}() argument must be str or a tuple of str, not {}", name, type_name(o)));
          const bool hit = name == "startswith" ? s.compare(0, o.s.size(), o.s) == 0
                                                : s.size() >= o.s.size() && s.compare(s.size() - o.s.size(), o.s.size(), o.s) == 0;
          if (hit) return Value::boolean(true);
        }
        return Value::boolean(false);
      });
    if (name == "split")
      return bind([s](Interp& in, CallArgs& a) {
        Params p(in, "split", a, {"sep", "maxsplit"}, {Value::none(), Value::integer(-1)});
        const int64_t maxsplit = p[1].as_int();
        std::vector<Value> parts;
        if (p[0].is(Value::Kind::None)) {
          const auto off = cp_offsets(s);
          size_t k = 0;
          const size_t n = off.size() - 1;
          auto space = [&](size_t at) { return py_space(cp_value(s, off[at], off[at + 1] - off[at])); };
          while (true) {
            while (k < n && space(k)) ++k;
            if (k >= n) break;
            if (maxsplit >= 0 && static_cast<int64_t>(parts.size()) >= maxsplit) {
              size_t e = n;
              while (e > k && space(e - 1)) --e;
              parts.push_back(Value::string(s.substr(off[k], off[e] - off[k])));
              break;
            }
            size_t b = k;
            while (k < n && !space(k)) ++k;
            parts.push_back(Value::string(s.substr(off[b], off[k] - off[b])));
            in.tick();
          }
        } else {
          const std::string sep = p.string(0);
          if (sep.empty()) in.fail("split(): empty separator");
          size_t b = 0;
          while (true) {
            const size_t at = (maxsplit >= 0 && static_cast<int64_t>(parts.size()) >= maxsplit) ? std::string::npos : s.find(sep, b);
            if (at == std::string::npos) {
              parts.push_back(Value::string(s.substr(b)));
              break;
            }
            parts.push_back(Value::string(s.substr(b, at - b)));
            b = at + sep.size();
            in.tick();
          }
        }
        return Value::make_list(std::move(parts));
      });
    if (name == "replace")
      return bind([s](Interp& in, CallArgs& a) {
        Params p(in, "replace", a, {"old", "new", "count"}, {Value(), Value(), Value::integer(-1)}, 2);
        return Value::string(in.replace(s, p.string(0), p.string(1), p[2].as_int()));
      });
    if (name == "upper" || name == "lower" || name == "title" || name == "capitalize")
      return bind([s, name](Interp& in, CallArgs& a) {
        Params p(in, name.c_str(), a, {}, {});
        return Value::string(change_case(s, name == "lower" ? 0 : name == "upper" ? 1 : name == "capitalize" ? 2 : 3));
      });
    if (name == "find" || name == "count")
      return bind([s, name](Interp& in, CallArgs& a) {
        Params p(in, name.c_str(), a, {"sub"}, {}, 1);
        const std::string sub = p.string(0);
        if (name == "find") {
          const size_t at = s.find(sub);
          return Value::integer(at == std::string::npos ? -1 : static_cast<int64_t>(cp_count(std::string_view(s).substr(0, at))));
        }
        if (sub.empty()) return Value::integer(static_cast<int64_t>(cp_count(s)) + 1);
        int64_t n = 0;
        for (size_t at = s.find(sub); at != std::string::npos; at = s.find(sub, at + sub.size())) ++n;
        return Value::integer(n);
      });
    if (name == "join")
      return bind([s](Interp& in, CallArgs& a) {
        Params p(in, "join", a, {"iterable"}, {}, 1);
        std::string out;
        bool first = true;
        for (const auto& x : in.iterate(p[0])) {
          if (!x.is(Value::Kind::String)) in.fail(fmt::format("join(): expected str items, found {}", type_name(x)));
          if (!first) out += s;
          first = false;
          out += x.s;
          in.check_size(out.size());
        }
        return Value::string(std::move(out));
      });
    return Value::undefined("");
  }
  if (self.is(Value::Kind::Dict)) {
    const Value d = self;
    if (name == "items" || name == "keys" || name == "values")
      return bind([d, name](Interp& in, CallArgs& a) {
        Params p(in, name.c_str(), a, {}, {});
        std::vector<Value> out;
        for (const auto& [k, v] : d.dict->items) out.push_back(name == "items" ? Value::make_list({k, v}, true) : name == "keys" ? k : v);
        return Value::make_list(std::move(out));
      });
    if (name == "get")
      return bind([d](Interp& in, CallArgs& a) {
        Params p(in, "get", a, {"key", "default"}, {Value(), Value::none()}, 1);
        const Value* x = in.find_key(d, p[0]);
        return x ? *x : p[1];
      });
    static const std::set<std::string, std::less<>> unsafe = {"pop", "popitem", "update", "clear", "setdefault"};
    if (unsafe.count(name))
      return bind(
          [name](Interp& in, CallArgs&) -> Value { in.fail(fmt::format("dict.{}() modifies the dict, which the sandbox forbids", name)); });
  }
  if (self.is(Value::Kind::List) && (name == "append" || name == "extend" || name == "pop" || name == "insert" || name == "remove" ||
                                     name == "sort" || name == "reverse" || name == "clear"))
    return bind(
        [name](Interp& in, CallArgs&) -> Value { in.fail(fmt::format("list.{}() modifies the list, which the sandbox forbids", name)); });
  return Value::undefined("");
}

}  // namespace

namespace {

Value Interp::eval(const Expr& e) {
  tick();
  Nest nest(*this);
  pos_ = e.pos;
  switch (e.k) {
    case Expr::K::Literal:
      return e.lit;
    case Expr::K::Name:
      return lookup(e.name);
    case Expr::K::List:
    case Expr::K::Tuple: {
      std::vector<Value> items;
      for (const auto& x : e.a) items.push_back(eval(*x));
      return Value::make_list(std::move(items), e.k == Expr::K::Tuple);
    }
    case Expr::K::Dict: {
      std::vector<std::pair<Value, Value>> items;
      for (size_t k = 0; k + 1 < e.a.size(); k += 2) {
        Value key = eval(*e.a[k]);
        Value v = eval(*e.a[k + 1]);
        if (key.is(Value::Kind::List) && !key.list->tuple) fail("unhashable type: 'list'");
        if (key.is(Value::Kind::Dict)) fail("unhashable type: 'dict'");
        const auto it = std::find_if(items.begin(), items.end(), [&](const auto& kv) { return equal(kv.first, key); });
        if (it != items.end())
          it->second = std::move(v);
        else
          items.emplace_back(std::move(key), std::move(v));
      }
      return Value::make_dict(std::move(items));
    }
    case Expr::K::Attr: {
      Value obj = eval(*e.a[0]);
      pos_ = e.pos;
      return get_attr(obj, e.name);
    }
    case Expr::K::Item: {
      Value obj = eval(*e.a[0]);
      Value key = eval(*e.a[1]);
      pos_ = e.pos;
      return get_item(obj, key);
    }
    case Expr::K::Slice: {
      Value obj = eval(*e.a[0]);
      Value parts[3];
      for (int k = 0; k < 3; ++k)
        if (e.a[k + 1]) parts[k] = eval(*e.a[k + 1]);
      pos_ = e.pos;
      return slice(obj, e.a[1] ? &parts[0] : nullptr, e.a[2] ? &parts[1] : nullptr, e.a[3] ? &parts[2] : nullptr);
    }
    case Expr::K::Call: {
      Value callee = eval(*e.a[0]);
      CallArgs args;
      args_of(e, 1, args);
      pos_ = e.pos;
      return call(callee, args);
    }
    case Expr::K::Filter: {
      Value v = eval(*e.a[0]);
      CallArgs args;
      args_of(e, 1, args);
      pos_ = e.pos;
      return filter(e.name, v, args);
    }
    case Expr::K::Test: {
      Value v = eval(*e.a[0]);
      CallArgs args;
      args_of(e, 1, args);
      pos_ = e.pos;
      return Value::boolean(test(e.name, v, args) != e.negated);
    }
    case Expr::K::Not:
      return Value::boolean(!truthy(eval(*e.a[0])));
    case Expr::K::Neg:
    case Expr::K::Pos: {
      Value v = eval(*e.a[0]);
      pos_ = e.pos;
      if (v.is_undefined()) undefined_error(v);
      if (!v.is_number()) fail(fmt::format("bad operand type for unary {}: '{}'", e.k == Expr::K::Neg ? '-' : '+', type_name(v)));
      if (e.k == Expr::K::Pos) return v.is(Value::Kind::Bool) ? Value::integer(v.as_int()) : v;
      if (v.is(Value::Kind::Float)) return Value::real(-v.f);
      if (v.as_int() == std::numeric_limits<int64_t>::min()) fail("integer overflow in unary '-'");
      return Value::integer(-v.as_int());
    }
    case Expr::K::Binary: {
      Value a = eval(*e.a[0]);
      Value b = eval(*e.a[1]);
      pos_ = e.pos;
      return arith(e.name, a, b);
    }
    case Expr::K::Compare: {
      Value left = eval(*e.a[0]);
      for (size_t k = 0; k < e.ops.size(); ++k) {
        Value right = eval(*e.a[k + 1]);
        pos_ = e.pos;
        const std::string& op = e.ops[k];
        bool r;
        if (op == "==")
          r = equal(left, right);
        else if (op == "!=")
          r = !equal(left, right);
        else if (op == "<")
          r = less(left, right);
        else if (op == ">")
          r = less(right, left);
        else if (op == "<=")
          r = !less(right, left);
        else if (op == ">=")
          r = !less(left, right);
        else if (op == "in")
          r = contains(right, left);
        else
          r = !contains(right, left);
        if (!r) return Value::boolean(false);
        left = std::move(right);
      }
      return Value::boolean(true);
    }
    case Expr::K::And: {
      Value a = eval(*e.a[0]);
      return truthy(a) ? eval(*e.a[1]) : a;
    }
    case Expr::K::Or: {
      Value a = eval(*e.a[0]);
      return truthy(a) ? a : eval(*e.a[1]);
    }
    case Expr::K::Cond:
      if (truthy(eval(*e.a[1]))) return eval(*e.a[0]);
      return e.a[2] ? eval(*e.a[2]) : Value::undefined("the conditional expression's 'else' branch is undefined");
  }
  fail("unknown expression");
}

Value Interp::call(const Value& callee, CallArgs& args) {
  if (callee.is_undefined()) undefined_error(callee);
  if (!callee.is(Value::Kind::Function)) fail(fmt::format("'{}' object is not callable", type_name(callee)));
  return callee.fn->call(*this, args);
}

// A filter's or test's item accessor for dotted attribute paths ("a.b", "0").
Value attr_path(Interp& in, const Value& v, const std::string& path) {
  Value cur = v;
  size_t b = 0;
  while (true) {
    const size_t dot = path.find('.', b);
    const std::string part = path.substr(b, dot == std::string::npos ? std::string::npos : dot - b);
    int64_t idx = 0;
    const auto r = std::from_chars(part.data(), part.data() + part.size(), idx);
    Value key = (!part.empty() && r.ec == std::errc() && r.ptr == part.data() + part.size()) ? Value::integer(idx) : Value::string(part);
    cur = cur.is_undefined() ? cur : in.get_item(cur, key);
    if (dot == std::string::npos) return cur;
    b = dot + 1;
  }
}

Value Interp::filter(const std::string& name, const Value& v, CallArgs& args) {
  const char* fn = name.c_str();
  auto strip_undefined = [&](const Value& x) { return x.is_undefined() ? std::string() : str(x); };
  if (name == "default" || name == "d") {
    Params p(*this, fn, args, {"default_value", "boolean"}, {Value::string(""), Value::boolean(false)});
    return (v.is_undefined() || (truthy(p[1]) && !truthy(v))) ? p[0] : v;
  }
  if (name == "length" || name == "count") {
    Params p(*this, fn, args, {}, {});
    return Value::integer(length(v));
  }
  if (name == "string" || name == "safe") {
    Params p(*this, fn, args, {}, {});
    return v.is(Value::Kind::String) ? v : Value::string(str(v));
  }
  if (name == "trim") {
    Params p(*this, fn, args, {"chars"}, {Value::none()});
    const std::string chars = p[0].is(Value::Kind::None) ? "" : p.string(0);
    return Value::string(py_strip(strip_undefined(v), p[0].is(Value::Kind::None) ? nullptr : &chars, true, true));
  }
  if (name == "upper" || name == "lower" || name == "capitalize" || name == "title") {
    Params p(*this, fn, args, {}, {});
    return Value::string(change_case(strip_undefined(v), name == "lower" ? 0 : name == "upper" ? 1 : name == "capitalize" ? 2 : 3));
  }
  if (name == "replace") {
    Params p(*this, fn, args, {"old", "new", "count"}, {Value(), Value(), Value::none()}, 2);
    return Value::string(replace(strip_undefined(v), p.string(0), p.string(1), p[2].is(Value::Kind::None) ? -1 : p[2].as_int()));
  }
  if (name == "escape" || name == "e") {
    Params p(*this, fn, args, {}, {});
    std::string out;
    for (char c : strip_undefined(v)) {
      switch (c) {
        case '&':
          out += "&amp;";
          break;
        case '<':
          out += "&lt;";
          break;
        case '>':
          out += "&gt;";
          break;
        case '"':
          out += "&#34;";
          break;
        case '\'':
          out += "&#39;";
          break;
        default:
          out += c;
      }
    }
    return Value::string(std::move(out));
  }
  if (name == "tojson") {
    Params p(*this, fn, args, {"indent", "ensure_ascii", "separators", "sort_keys"},
             {Value::none(), Value::boolean(false), Value::none(), Value::boolean(false)});
    JsonStyle st;
    if (p[0].is_integral()) {
      st.pretty = true;
      st.indent = std::string(static_cast<size_t>(std::clamp<int64_t>(p[0].as_int(), 0, 64)), ' ');
    } else if (p[0].is(Value::Kind::String)) {
      st.pretty = true;
      st.indent = p[0].s;
    } else if (!p[0].is(Value::Kind::None)) {
      fail(fmt::format("tojson(): indent must be an integer or a string, not {}", type_name(p[0])));
    }
    if (st.pretty) st.item_sep = ",";
    if (!p[2].is(Value::Kind::None)) {
      if (!p[2].is(Value::Kind::List) || p[2].list->items.size() != 2 || !p[2].list->items[0].is(Value::Kind::String) ||
          !p[2].list->items[1].is(Value::Kind::String))
        fail("tojson(): separators must be a pair of strings");
      st.item_sep = p[2].list->items[0].s;
      st.key_sep = p[2].list->items[1].s;
    }
    st.ensure_ascii = truthy(p[1]);
    st.sort_keys = truthy(p[3]);
    std::string out;
    json(v, st, 0, out);
    return Value::string(std::move(out));
  }
  if (name == "first" || name == "last") {
    Params p(*this, fn, args, {}, {});
    if (v.is_undefined()) return Value::undefined(fmt::format("no {} item of an undefined value", name));
    auto items = iterate(v);
    if (items.empty()) return Value::undefined(fmt::format("no {} item, the sequence is empty", name));
    return name == "first" ? items.front() : items.back();
  }
  if (name == "list") {
    Params p(*this, fn, args, {}, {});
    return Value::make_list(iterate(v));
  }
  if (name == "items") {
    Params p(*this, fn, args, {}, {});
    if (v.is_undefined()) return Value::make_list({});
    if (!v.is(Value::Kind::Dict)) fail(fmt::format("items(): expected a mapping, got {}", type_name(v)));
    std::vector<Value> out;
    for (const auto& [k, x] : v.dict->items) out.push_back(Value::make_list({k, x}, true));
    return Value::make_list(std::move(out));
  }
  if (name == "join") {
    Params p(*this, fn, args, {"d", "attribute"}, {Value::string(""), Value::none()});
    const std::string sep = str(p[0]);
    std::string out;
    bool first = true;
    for (const auto& x : iterate(v)) {
      if (!first) out += sep;
      first = false;
      out += str(p[1].is(Value::Kind::None) ? x : attr_path(*this, x, str(p[1])));
      check_size(out.size());
    }
    return Value::string(std::move(out));
  }
  if (name == "reverse") {
    Params p(*this, fn, args, {}, {});
    if (v.is(Value::Kind::String)) {
      auto chars = iterate(v);
      std::string out;
      for (auto it = chars.rbegin(); it != chars.rend(); ++it) out += it->s;
      return Value::string(std::move(out));
    }
    auto items = iterate(v);
    std::reverse(items.begin(), items.end());
    return Value::make_list(std::move(items));
  }
  if (name == "abs") {
    Params p(*this, fn, args, {}, {});
    if (v.is(Value::Kind::Float)) return Value::real(std::fabs(v.f));
    if (v.is_integral() && v.as_int() != std::numeric_limits<int64_t>::min()) return Value::integer(std::llabs(v.as_int()));
    fail(fmt::format("bad operand type for abs(): '{}'", type_name(v)));
  }
  if (name == "int" || name == "float") {
    Params p(*this, fn, args, {"default"}, {name == "int" ? Value::integer(0) : Value::real(0)});
    if (v.is_number())
      return name == "int"
                 ? Value::integer(v.is(Value::Kind::Float) ? (std::isfinite(v.f) && std::fabs(v.f) < 9.2e18 ? static_cast<int64_t>(v.f) : 0)
                                                           : v.as_int())
                 : Value::real(v.as_double());
    if (v.is(Value::Kind::String)) {
      const std::string t = py_strip(v.s, nullptr, true, true);
      double d = 0;
      const auto r = std::from_chars(t.data(), t.data() + t.size(), d);
      if (r.ec == std::errc() && r.ptr == t.data() + t.size() && !t.empty())
        return name == "int" ? (std::fabs(d) < 9.2e18 ? Value::integer(static_cast<int64_t>(d)) : p[0]) : Value::real(d);
    }
    return p[0];
  }
  if (name == "round") {
    Params p(*this, fn, args, {"precision", "method"}, {Value::integer(0), Value::string("common")});
    if (!v.is_number()) fail(fmt::format("round(): expected a number, got {}", type_name(v)));
    const double scale = std::pow(10.0, static_cast<double>(std::clamp<int64_t>(p[0].as_int(), -300, 300)));
    const std::string method = str(p[1]);
    double x = v.as_double() * scale;
    x = method == "floor" ? std::floor(x) : method == "ceil" ? std::ceil(x) : std::round(x);
    return Value::real(x / scale);
  }
  if (name == "attr") {
    Params p(*this, fn, args, {"name"}, {}, 1);
    return get_attr(v, p.string(0));
  }
  if (name == "sum") {
    Params p(*this, fn, args, {"attribute", "start"}, {Value::none(), Value::integer(0)});
    Value total = p[1];
    for (const auto& x : iterate(v)) total = arith("+", total, p[0].is(Value::Kind::None) ? x : attr_path(*this, x, str(p[0])));
    return total;
  }
  auto fold_case = [&](const Value& x, bool case_sensitive) {
    return (!case_sensitive && x.is(Value::Kind::String)) ? Value::string(change_case(x.s, 0)) : x;
  };
  if (name == "sort" || name == "unique" || name == "min" || name == "max") {
    const bool sort = name == "sort";
    Params p(*this, fn, args,
             sort ? std::initializer_list<const char*>{"reverse", "case_sensitive", "attribute"}
                  : std::initializer_list<const char*>{"case_sensitive", "attribute"},
             sort ? std::vector<Value>{Value::boolean(false), Value::boolean(false), Value::none()}
                  : std::vector<Value>{Value::boolean(false), Value::none()});
    const bool cs = truthy(p[sort ? 1 : 0]);
    const Value& attribute = p[sort ? 2 : 1];
    auto key = [&](const Value& x) { return fold_case(attribute.is(Value::Kind::None) ? x : attr_path(*this, x, str(attribute)), cs); };
    auto items = iterate(v);
    if (name == "unique") {
      std::vector<Value> out, seen;
      for (const auto& x : items) {
        const Value k = key(x);
        if (std::none_of(seen.begin(), seen.end(), [&](const Value& s) { return equal(s, k); })) {
          seen.push_back(k);
          out.push_back(x);
        }
      }
      return Value::make_list(std::move(out));
    }
    if (sort) {
      const bool rev = truthy(p[0]);
      std::stable_sort(items.begin(), items.end(),
                       [&](const Value& a, const Value& b) { return rev ? less(key(b), key(a)) : less(key(a), key(b)); });
      return Value::make_list(std::move(items));
    }
    if (items.empty()) return Value::undefined(fmt::format("no {} item, the sequence is empty", name));
    size_t best = 0;
    for (size_t k = 1; k < items.size(); ++k)
      if (name == "min" ? less(key(items[k]), key(items[best])) : less(key(items[best]), key(items[k]))) best = k;
    return items[best];
  }
  if (name == "select" || name == "reject" || name == "selectattr" || name == "rejectattr") {
    const bool by_attr = name.size() > 6;
    const bool keep = name[0] == 's';
    if (by_attr && args.pos.empty()) fail(fmt::format("{}() needs an attribute name", name));
    const std::string attribute = by_attr ? str(args.pos[0]) : "";
    const size_t first = by_attr ? 1 : 0;
    std::string test_name;
    if (args.pos.size() > first) {
      test_name = str(args.pos[first]);
      if (!known_tests().count(test_name)) fail(fmt::format("no test named '{}'", test_name));
    }
    CallArgs targs;
    for (size_t k = first + 1; k < args.pos.size(); ++k) targs.pos.push_back(args.pos[k]);
    targs.kw = args.kw;
    std::vector<Value> out;
    for (const auto& x : iterate(v)) {
      const Value t = by_attr ? attr_path(*this, x, attribute) : x;
      CallArgs a = targs;
      const bool r = test_name.empty() ? truthy(t) : test(test_name, t, a);
      if (r == keep) out.push_back(x);
    }
    return Value::make_list(std::move(out));
  }
  if (name == "map") {
    const auto attr_kw = std::find_if(args.kw.begin(), args.kw.end(), [](const auto& kv) { return kv.first == "attribute"; });
    std::vector<Value> out;
    if (attr_kw != args.kw.end()) {
      const auto def = std::find_if(args.kw.begin(), args.kw.end(), [](const auto& kv) { return kv.first == "default"; });
      for (const auto& x : iterate(v)) {
        Value y = attr_path(*this, x, str(attr_kw->second));
        if (y.is_undefined() && def != args.kw.end()) y = def->second;
        out.push_back(std::move(y));
      }
      return Value::make_list(std::move(out));
    }
    if (args.pos.empty()) fail("map() needs a filter name or attribute=");
    const std::string f = str(args.pos[0]);
    if (!known_filters().count(f)) fail(fmt::format("no filter named '{}'", f));
    for (const auto& x : iterate(v)) {
      CallArgs a;
      a.pos.assign(args.pos.begin() + 1, args.pos.end());
      a.kw = args.kw;
      out.push_back(filter(f, x, a));
    }
    return Value::make_list(std::move(out));
  }
  if (name == "indent") {
    Params p(*this, fn, args, {"width", "first", "blank"}, {Value::integer(4), Value::boolean(false), Value::boolean(false)});
    const std::string ind =
        p[0].is(Value::Kind::String) ? p[0].s : std::string(static_cast<size_t>(std::clamp<int64_t>(p[0].as_int(), 0, 256)), ' ');
    const std::string s = strip_undefined(v) + "\n";
    std::vector<std::string> lines;  // str.splitlines()
    size_t b = 0;
    for (size_t i = 0; i < s.size();) {
      const size_t n = cp_size(s, i);
      const uint32_t c = cp_value(s, i, n);
      if (c == '\n' || c == '\r' || c == '\v' || c == '\f' || c == 0x1c || c == 0x1d || c == 0x1e || c == 0x85 || c == 0x2028 ||
          c == 0x2029) {
        lines.push_back(s.substr(b, i - b));
        size_t next = i + n;
        if (c == '\r' && next < s.size() && s[next] == '\n') ++next;
        b = i = next;
      } else {
        i += n;
      }
    }
    if (b < s.size()) lines.push_back(s.substr(b));
    std::string out;
    for (size_t k = 0; k < lines.size(); ++k) {
      if (k) out += '\n';
      if (k && (truthy(p[2]) || !lines[k].empty())) out += ind;
      out += lines[k];
      check_size(out.size());
    }
    if (truthy(p[1])) out = ind + out;
    return Value::string(std::move(out));
  }
  fail(fmt::format("no filter named '{}'", name));
}

bool Interp::test(const std::string& name, const Value& v, CallArgs& args) {
  using K = Value::Kind;
  const char* fn = name.c_str();
  auto one = [&]() -> Value {
    Params p(*this, fn, args, {"other"}, {}, 1);
    return p[0];
  };
  auto none_args = [&]() { Params p(*this, fn, args, {}, {}); };
  if (name == "defined") return none_args(), !v.is_undefined();
  if (name == "undefined") return none_args(), v.is_undefined();
  if (name == "none") return none_args(), v.is(K::None);
  if (name == "boolean") return none_args(), v.is(K::Bool);
  if (name == "true") return none_args(), v.is(K::Bool) && v.b;
  if (name == "false") return none_args(), v.is(K::Bool) && !v.b;
  if (name == "integer") return none_args(), v.is(K::Int);
  if (name == "float") return none_args(), v.is(K::Float);
  if (name == "number") return none_args(), v.is_number();
  if (name == "string") return none_args(), v.is(K::String);
  if (name == "mapping") return none_args(), v.is(K::Dict);
  if (name == "iterable") return none_args(), v.is(K::Undefined) || v.is(K::String) || v.is(K::List) || v.is(K::Dict);
  if (name == "sequence") return none_args(), v.is(K::Undefined) || v.is(K::String) || v.is(K::List) || v.is(K::Dict);
  if (name == "callable") return none_args(), v.is(K::Function);
  if (name == "lower" || name == "upper") {
    none_args();
    if (!v.is(K::String)) return false;
    const std::string s = v.s;
    bool cased = false;
    for (size_t i = 0; i < s.size();) {
      const size_t n = cp_size(s, i);
      const uint32_t c = cp_value(s, i, n);
      const uint32_t lo = case_map(c, false), up = case_map(c, true);
      if (lo != up) {
        cased = true;
        if (c != (name == "lower" ? lo : up)) return false;
      }
      i += n;
    }
    return cased;
  }
  if (name == "odd" || name == "even") {
    none_args();
    if (!v.is_integral()) fail(fmt::format("the '{}' test needs an integer, got {}", name, type_name(v)));
    return (v.as_int() % 2 != 0) == (name == "odd");
  }
  if (name == "divisibleby") {
    const Value d = one();
    if (!v.is_integral() || !d.is_integral()) fail("the 'divisibleby' test needs integers");
    if (d.as_int() == 0) fail("integer division or modulo by zero");
    if (d.as_int() == -1) return true;
    return v.as_int() % d.as_int() == 0;
  }
  if (name == "sameas") {
    const Value o = one();
    if (v.kind != o.kind) return false;
    switch (v.kind) {
      case K::None:
      case K::Undefined:
        return true;
      case K::Bool:
        return v.b == o.b;
      case K::Int:
        return v.i == o.i && v.i >= -5 && v.i <= 256;
      case K::List:
        return v.list == o.list;
      case K::Dict:
      case K::Namespace:
        return v.dict == o.dict;
      case K::Function:
        return v.fn == o.fn;
      default:
        return false;
    }
  }
  if (name == "eq" || name == "equalto" || name == "==") return equal(v, one());
  if (name == "ne" || name == "!=") return !equal(v, one());
  if (name == "lt" || name == "lessthan" || name == "<") return less(v, one());
  if (name == "le" || name == "<=") return !less(one(), v);
  if (name == "gt" || name == "greaterthan" || name == ">") return less(one(), v);
  if (name == "ge" || name == ">=") return !less(v, one());
  if (name == "in") return contains(one(), v);
  fail(fmt::format("no test named '{}'", name));
}

void Interp::assign(const std::vector<std::string>& targets, const Value& v) {
  if (targets.size() == 1) {
    frames_.back()[targets[0]] = v;
    return;
  }
  if (!v.is(Value::Kind::List) && !v.is(Value::Kind::String) && !v.is(Value::Kind::Dict))
    fail(fmt::format("cannot unpack a {} into {} names", type_name(v), targets.size()));
  const auto items = iterate(v);
  if (items.size() != targets.size()) fail(fmt::format("{} values to unpack into {} names", items.size(), targets.size()));
  for (size_t k = 0; k < targets.size(); ++k) frames_.back()[targets[k]] = items[k];
}

Value Interp::call_macro(const Node& m, CallArgs& args) {
  if (macro_depth_ >= lim_.max_macro_depth) fail(fmt::format("macro calls nested more than {} deep", lim_.max_macro_depth));
  if (args.pos.size() > m.targets.size())
    fail(fmt::format("macro '{}' takes {} arguments, {} given", m.text, m.targets.size(), args.pos.size()));
  Frame f;
  std::vector<bool> given(m.targets.size(), false);
  for (size_t k = 0; k < args.pos.size(); ++k) f[m.targets[k]] = args.pos[k], given[k] = true;
  for (auto& [name, v] : args.kw) {
    const auto it = std::find(m.targets.begin(), m.targets.end(), name);
    if (it == m.targets.end()) fail(fmt::format("macro '{}' has no parameter '{}'", m.text, name));
    const size_t k = static_cast<size_t>(it - m.targets.begin());
    if (given[k]) fail(fmt::format("macro '{}' got two values for parameter '{}'", m.text, name));
    f[name] = v;
    given[k] = true;
  }
  // The macro's scope: the template's top level and its own arguments.
  std::vector<Frame> saved(std::make_move_iterator(frames_.begin() + 1), std::make_move_iterator(frames_.end()));
  frames_.resize(1);
  frames_.push_back(std::move(f));
  ++macro_depth_;
  std::string out;
  try {
    for (size_t k = 0; k < m.targets.size(); ++k)
      if (!given[k])
        frames_.back()[m.targets[k]] =
            m.defaults[k] ? eval(*m.defaults[k]) : Value::undefined(fmt::format("'{}' is undefined", m.targets[k]));
    exec(m.body, out);
  } catch (...) {
    --macro_depth_;
    frames_.resize(1);
    for (auto& fr : saved) frames_.push_back(std::move(fr));
    throw;
  }
  --macro_depth_;
  frames_.resize(1);
  for (auto& fr : saved) frames_.push_back(std::move(fr));
  return Value::string(std::move(out));
}

Flow Interp::exec(const Body& body, std::string& out) {
  Nest nest(*this);
  for (const auto& np : body) {
    const Node& n = *np;
    tick();
    pos_ = n.pos;
    switch (n.k) {
      case Node::K::Text:
        out += n.text;
        check_size(out.size());
        break;
      case Node::K::Output: {
        const Value v = eval(*n.expr);
        if (v.is(Value::Kind::String))
          out += v.s;
        else
          out += str(v);
        check_size(out.size());
        break;
      }
      case Node::K::If: {
        bool done = false;
        for (const auto& [cond, b] : n.branches) {
          if (truthy(eval(*cond))) {
            const Flow f = exec(b, out);
            if (f != Flow::Normal) return f;
            done = true;
            break;
          }
        }
        if (!done) {
          const Flow f = exec(n.else_body, out);
          if (f != Flow::Normal) return f;
        }
        break;
      }
      case Node::K::For: {
        const Value seq = eval(*n.expr);
        pos_ = n.pos;
        std::vector<Value> items = iterate(seq);
        if (n.cond) {
          std::vector<Value> kept;
          for (const auto& x : items) {
            frames_.emplace_back();
            assign(n.targets, x);
            const bool keep = truthy(eval(*n.cond));
            frames_.pop_back();
            if (keep) kept.push_back(x);
          }
          items = std::move(kept);
        }
        const int64_t len = static_cast<int64_t>(items.size());
        const Value cycle = Value::function("cycle", [](Interp& in, CallArgs& a) {
          if (a.pos.empty()) in.fail("loop.cycle() needs at least one argument");
          const int64_t k = in.get_attr(in.lookup("loop"), "index0").as_int();
          return a.pos[static_cast<size_t>(k) % a.pos.size()];
        });
        for (int64_t k = 0; k < len; ++k) {
          tick();
          frames_.emplace_back();
          std::vector<std::pair<Value, Value>> loop = {
              {Value::string("index"), Value::integer(k + 1)},
              {Value::string("index0"), Value::integer(k)},
              {Value::string("revindex"), Value::integer(len - k)},
              {Value::string("revindex0"), Value::integer(len - k - 1)},
              {Value::string("first"), Value::boolean(k == 0)},
              {Value::string("last"), Value::boolean(k == len - 1)},
              {Value::string("length"), Value::integer(len)},
              {Value::string("depth"), Value::integer(1)},
              {Value::string("depth0"), Value::integer(0)},
              {Value::string("previtem"), k > 0 ? items[k - 1] : Value::undefined("there is no previous item")},
              {Value::string("nextitem"), k + 1 < len ? items[k + 1] : Value::undefined("there is no next item")},
              {Value::string("cycle"), cycle}};
          frames_.back()["loop"] = Value::make_dict(std::move(loop));
          Flow f;
          try {
            assign(n.targets, items[k]);
            f = exec(n.body, out);
          } catch (...) {
            frames_.pop_back();
            throw;
          }
          frames_.pop_back();
          if (f == Flow::Break) break;
        }
        if (len == 0) {
          const Flow f = exec(n.else_body, out);
          if (f != Flow::Normal) return f;
        }
        break;
      }
      case Node::K::Set: {
        Value v = eval(*n.expr);
        pos_ = n.pos;
        if (!n.text.empty()) {
          Value ns = lookup(n.targets[0]);
          if (!ns.is(Value::Kind::Namespace))
            fail(fmt::format("cannot assign attribute '{}' on '{}', which is not a namespace()", n.text, n.targets[0]));
          auto& items = ns.dict->items;
          const auto it = std::find_if(items.begin(), items.end(), [&](const auto& kv) { return kv.first.s == n.text; });
          if (it != items.end())
            it->second = std::move(v);
          else
            items.emplace_back(Value::string(n.text), std::move(v));
        } else {
          assign(n.targets, v);
        }
        break;
      }
      case Node::K::SetBlock:
      case Node::K::FilterBlock: {
        std::string inner;
        frames_.emplace_back();
        Flow f;
        try {
          f = exec(n.body, inner);
        } catch (...) {
          frames_.pop_back();
          throw;
        }
        frames_.pop_back();
        Value v = Value::string(std::move(inner));
        for (const auto& fe : n.filters) {
          CallArgs args;
          args_of(*fe, 1, args);
          pos_ = fe->pos;
          v = filter(fe->name, v, args);
        }
        if (n.k == Node::K::SetBlock) {
          assign(n.targets, v);
        } else {
          out += str(v);
          check_size(out.size());
        }
        if (f != Flow::Normal) return f;
        break;
      }
      case Node::K::Macro: {
        const Node* m = &n;
        frames_.back()[n.text] = Value::function(n.text, [m](Interp& in, CallArgs& a) { return in.call_macro(*m, a); });
        break;
      }
      case Node::K::Generation: {
        // Where its text lands in the prompt is known only when it renders into the prompt itself.
        if (spans_ && &out != top_)
          fail("a generation block inside a set, filter or macro block: where its text lands in the prompt is not known");
        const size_t start = out.size();
        const Flow f = exec(n.body, out);
        if (spans_ && out.size() > start) spans_->emplace_back(start, out.size());
        if (f != Flow::Normal) return f;
        break;
      }
      case Node::K::Break:
        return Flow::Break;
      case Node::K::Continue:
        return Flow::Continue;
    }
  }
  return Flow::Normal;
}

Value from_json(const ojson& j, int depth = 0) {
  if (depth > 512) throw Error("chat template: the messages are nested more than 512 levels deep");
  switch (j.type()) {
    case ojson::value_t::null:
      return Value::none();
    case ojson::value_t::boolean:
      return Value::boolean(j.get<bool>());
    case ojson::value_t::number_integer:
      return Value::integer(j.get<int64_t>());
    case ojson::value_t::number_unsigned: {
      const uint64_t u = j.get<uint64_t>();
      return u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()) ? Value::real(static_cast<double>(u))
                                                                            : Value::integer(static_cast<int64_t>(u));
    }
    case ojson::value_t::number_float:
      return Value::real(j.get<double>());
    case ojson::value_t::string:
      return Value::string(j.get<std::string>());
    case ojson::value_t::array: {
      std::vector<Value> items;
      for (const auto& x : j) items.push_back(from_json(x, depth + 1));
      return Value::make_list(std::move(items));
    }
    case ojson::value_t::object: {
      std::vector<std::pair<Value, Value>> items;
      for (const auto& [k, x] : j.items()) items.emplace_back(Value::string(k), from_json(x, depth + 1));
      return Value::make_dict(std::move(items));
    }
    default:
      throw Error("chat template: binary JSON values cannot be rendered");
  }
}

Frame globals() {
  Frame g;
  g["range"] = Value::function("range", [](Interp& in, CallArgs& a) {
    if (!a.kw.empty() || a.pos.empty() || a.pos.size() > 3) in.fail("range() takes 1 to 3 positional arguments");
    for (const auto& x : a.pos)
      if (!x.is_integral()) in.fail(fmt::format("range(): '{}' object cannot be interpreted as an integer", type_name(x)));
    const int64_t start = a.pos.size() > 1 ? a.pos[0].as_int() : 0;
    const int64_t stop = a.pos.size() > 1 ? a.pos[1].as_int() : a.pos[0].as_int();
    const int64_t step = a.pos.size() > 2 ? a.pos[2].as_int() : 1;
    if (step == 0) in.fail("range() arg 3 must not be zero");
    const double n = std::ceil((static_cast<double>(stop) - static_cast<double>(start)) / static_cast<double>(step));
    if (n > 100000) in.fail("range() too big: the sandbox allows at most 100000 items");
    std::vector<Value> items;
    for (int64_t k = 0; k < static_cast<int64_t>(std::max(0.0, n)); ++k) items.push_back(Value::integer(start + k * step));
    in.tick(static_cast<int64_t>(items.size()));
    return Value::make_list(std::move(items));
  });
  auto make_dict = [](bool ns) {
    return [ns](Interp& in, CallArgs& a) {
      std::vector<std::pair<Value, Value>> items;
      if (a.pos.size() > 1) in.fail(fmt::format("{}() takes at most one positional argument", ns ? "namespace" : "dict"));
      auto put = [&](Value k, Value v) {
        const auto it = std::find_if(items.begin(), items.end(), [&](const auto& kv) { return in.equal(kv.first, k); });
        if (it != items.end())
          it->second = std::move(v);
        else
          items.emplace_back(std::move(k), std::move(v));
      };
      if (!a.pos.empty()) {
        const Value& src = a.pos[0];
        if (src.is(Value::Kind::Dict) || src.is(Value::Kind::Namespace)) {
          for (const auto& kv : src.dict->items) put(kv.first, kv.second);
        } else {
          for (const auto& x : in.iterate(src)) {
            if (!x.is(Value::Kind::List) || x.list->items.size() != 2) in.fail("dict(): each item must be a pair");
            put(x.list->items[0], x.list->items[1]);
          }
        }
      }
      for (auto& [k, v] : a.kw) put(Value::string(k), v);
      Value made = Value::make_dict(std::move(items), ns);
      if (ns) in.own_namespace(made);
      return made;
    };
  };
  g["namespace"] = Value::function("namespace", make_dict(true));
  g["dict"] = Value::function("dict", make_dict(false));
  g["raise_exception"] = Value::function("raise_exception", [](Interp& in, CallArgs& a) -> Value {
    in.fail("raise_exception: " + (a.pos.empty() ? std::string() : in.str(a.pos[0])));
  });
  g["strftime_now"] = Value::function("strftime_now", [](Interp& in, CallArgs& a) {
    Params p(in, "strftime_now", a, {"format"}, {}, 1);
    const std::string f = p.string(0);
    const std::time_t t = std::time(nullptr);
    std::tm tm{};
    localtime_r(&t, &tm);
    std::string buf(256 + f.size() * 16, '\0');
    const size_t n = f.empty() ? 0 : std::strftime(buf.data(), buf.size(), f.c_str(), &tm);
    buf.resize(n);
    return Value::string(buf);
  });
  return g;
}

std::string token_text(const nlohmann::json& t) {
  if (t.is_string()) return t.get<std::string>();
  if (t.is_object() && t.contains("content") && t["content"].is_string()) return t["content"].get<std::string>();
  return {};
}

}  // namespace

ChatTemplate ChatTemplate::parse(std::string source, std::string origin) {
  // Jinja's lexer: newlines normalized to "\n", one trailing newline dropped.
  std::string src;
  src.reserve(source.size());
  for (size_t i = 0; i < source.size(); ++i) {
    if (source[i] == '\r') {
      src += '\n';
      if (i + 1 < source.size() && source[i + 1] == '\n') ++i;
    } else {
      src += source[i];
    }
  }
  if (!src.empty() && src.back() == '\n') src.pop_back();
  auto prog = std::make_shared<Program>();
  prog->origin = std::move(origin);
  prog->source = std::move(source);
  Limits lim;
  Lexer lexer(src, prog->origin);
  Parser parser(lexer.run(), prog->origin, lim.max_depth);
  prog->body = parser.parse_template();
  ChatTemplate t;
  t.program_ = std::move(prog);
  return t;
}

ChatTemplate ChatTemplate::from_tokenizer_config(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  KCPP_CHECK(in, "{}: cannot open the file", path.string());
  std::stringstream ss;
  ss << in.rdbuf();
  nlohmann::json cfg;
  try {
    cfg = nlohmann::json::parse(ss.str());
  } catch (const nlohmann::json::exception& e) {
    KCPP_FAIL("{}: not valid JSON: {}", path.string(), e.what());
  }
  KCPP_CHECK(cfg.is_object(), "{}: expected a JSON object", path.string());
  std::string source, origin = path.string() + " chat_template";
  const auto it = cfg.find("chat_template");
  if (it != cfg.end() && !it->is_null()) {
    if (it->is_string()) {
      source = it->get<std::string>();
    } else if (it->is_array()) {
      bool found = false;
      for (const auto& t : *it) {
        KCPP_CHECK(t.is_object() && t.contains("name") && t.contains("template") && t["name"].is_string() && t["template"].is_string(),
                   "{}: chat_template: each entry of the list must be {{\"name\": string, \"template\": string}}", path.string());
        if (t["name"] == "default") {
          source = t["template"].get<std::string>();
          found = true;
        }
      }
      KCPP_CHECK(found, "{}: chat_template: the list has no template named \"default\"", path.string());
      origin = path.string() + " chat_template 'default'";
    } else {
      KCPP_FAIL("{}: chat_template: expected a string or a list of {{\"name\", \"template\"}}, got {}", path.string(), it->type_name());
    }
  } else {
    const auto jinja = path.parent_path() / "chat_template.jinja";
    std::ifstream j(jinja, std::ios::binary);
    KCPP_CHECK(j, "{}: no chat_template, and no chat_template.jinja beside it", path.string());
    std::stringstream js;
    js << j.rdbuf();
    source = js.str();
    origin = jinja.string();
  }
  ChatTemplate t = parse(std::move(source), std::move(origin));
  for (const char* name : {"bos_token", "eos_token", "unk_token", "pad_token"}) {
    if (!cfg.contains(name)) continue;
    const std::string s = token_text(cfg[name]);
    if (!s.empty() || cfg[name].is_string()) t.special_tokens_[name] = s;
  }
  return t;
}

std::string ChatTemplate::render(const nlohmann::ordered_json& messages, bool add_generation_prompt,
                                 const nlohmann::ordered_json& extra) const {
  return render_impl(messages, add_generation_prompt, extra, nullptr);
}

ChatTemplate::Rendered ChatTemplate::render_with_generation(const nlohmann::ordered_json& messages, bool add_generation_prompt,
                                                            const nlohmann::ordered_json& extra) const {
  Rendered r;
  r.text = render_impl(messages, add_generation_prompt, extra, &r.generation);
  return r;
}

std::string ChatTemplate::render_impl(const nlohmann::ordered_json& messages, bool add_generation_prompt,
                                      const nlohmann::ordered_json& extra, std::vector<std::pair<size_t, size_t>>* spans) const {
  KCPP_CHECK(program_, "chat template: render() on an empty ChatTemplate");
  KCPP_CHECK(extra.is_null() || extra.is_object(), "{}: the extra variables must be a JSON object, got {}", program_->origin,
             extra.type_name());
  Frame g = globals();
  g["messages"] = from_json(messages);
  g["add_generation_prompt"] = Value::boolean(add_generation_prompt);
  g["tools"] = Value::none();
  g["documents"] = Value::none();
  for (const auto& [k, v] : special_tokens_.items()) g[k] = from_json(v);
  if (extra.is_object())
    for (const auto& [k, v] : extra.items()) g[k] = from_json(v);
  Interp in(*program_, limits_);
  return in.run(std::move(g), spans);
}

const std::string& ChatTemplate::source() const {
  static const std::string empty;
  return program_ ? program_->source : empty;
}
const nlohmann::ordered_json& ChatTemplate::special_tokens() const { return special_tokens_; }
void ChatTemplate::set_special_tokens(nlohmann::ordered_json tokens) {
  KCPP_CHECK(tokens.is_object(), "chat template: special tokens must be a JSON object");
  special_tokens_ = std::move(tokens);
}
void ChatTemplate::set_limits(const Limits& limits) { limits_ = limits; }

}  // namespace kcpp::models
