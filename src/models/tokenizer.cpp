// Byte-level BPE from tokenizer.json (see tokenizer.h for the pipeline).  The pre-tokenizers' regexes
// run on PCRE2 (UTF and Unicode-property mode), the normalizers and the UTF-8 check on utf8proc;
// everything else is plain C++.
#define PCRE2_CODE_UNIT_WIDTH 8
#include "models/tokenizer.h"
#include "models/utf8.h"

#include <pcre2.h>
#include <utf8proc.h>

#include <algorithm>
#include <array>
#include <climits>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <limits>
#include <nlohmann/json.hpp>
#include <sstream>
#include <unordered_map>

#include "core/error.h"
#include "core/files.h"

namespace kcpp::models {

namespace {

using nlohmann::json;

// GPT-2's pre-tokenization regex (the ByteLevel pre-tokenizer's `use_regex`).
constexpr const char* kGpt2Pattern = R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

// Length of the UTF-8 sequence starting with byte c (1 for a stray continuation byte).
size_t utf8_len(unsigned char c) { return c < 0x80 ? 1 : (c >> 5) == 0x6 ? 2 : (c >> 4) == 0xE ? 3 : (c >> 3) == 0x1E ? 4 : 1; }

// Decodes one code point at s[i] (advancing i); invalid bytes come back as themselves + 0x110000.
uint32_t next_cp(std::string_view s, size_t& i) {
  const auto c = static_cast<unsigned char>(s[i]);
  const size_t n = utf8_len(c);
  if (n == 1 || i + n > s.size()) return ++i, c < 0x80 ? c : c + 0x110000u;
  uint32_t cp = c & (0xFF >> (n + 1));
  for (size_t k = 1; k < n; ++k) cp = (cp << 6) | (static_cast<unsigned char>(s[i + k]) & 0x3F);
  i += n;
  return cp;
}

// Appends `bytes` with each invalid UTF-8 sequence replaced by U+FFFD, as the `tokenizers` library
// decodes (Rust's from_utf8_lossy: one replacement per maximal invalid prefix).
void append_utf8_lossy(std::string& out, std::string_view bytes) {
  for (size_t i = 0; i < bytes.size();) {
    const auto c = static_cast<unsigned char>(bytes[i]);
    const size_t n = c < 0x80 ? 1 : (c >= 0xC2 && c <= 0xDF) ? 2 : (c >= 0xE0 && c <= 0xEF) ? 3 : (c >= 0xF0 && c <= 0xF4) ? 4 : 0;
    size_t k = 1;
    if (n > 1)
      for (; k < n && i + k < bytes.size(); ++k) {
        const auto d = static_cast<unsigned char>(bytes[i + k]);
        // The second byte's narrower ranges exclude overlong forms, surrogates and > U+10FFFF.
        const unsigned lo = k == 1 && c == 0xE0 ? 0xA0 : k == 1 && c == 0xF0 ? 0x90 : 0x80;
        const unsigned hi = k == 1 && c == 0xED ? 0x9F : k == 1 && c == 0xF4 ? 0x8F : 0xBF;
        if (d < lo || d > hi) break;
      }
    if (n != 0 && k == n) {
      out.append(bytes.substr(i, n));
      i += n;
    } else {
      out += "\xEF\xBF\xBD";
      i += n == 0 ? 1 : k;
    }
  }
}

// GPT-2's bytes_to_unicode: printable Latin-1 bytes stand for themselves, the other 68 are moved to
// code points 256, 257, ... in byte order.
struct ByteAlphabet {
  std::array<std::string, 256> sym;
  std::unordered_map<uint32_t, uint8_t> back;
  ByteAlphabet() {
    uint32_t next = 256;
    for (uint32_t b = 0; b < 256; ++b) {
      const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
      const uint32_t cp = printable ? b : next++;
      append_utf8(sym[b], cp);
      back[cp] = static_cast<uint8_t>(b);
    }
  }
};
const ByteAlphabet& alphabet() {
  static const ByteAlphabet a;
  return a;
}

// The byte offset of the first invalid UTF-8 sequence in `s` (a stray or missing continuation byte,
// an overlong form, a surrogate, a code point past U+10FFFF), or npos.
size_t invalid_utf8_at(std::string_view s) {
  const auto* p = reinterpret_cast<const utf8proc_uint8_t*>(s.data());
  for (size_t i = 0; i < s.size();) {
    if (p[i] < 0x80) {
      ++i;
      continue;
    }
    utf8proc_int32_t cp = 0;
    const utf8proc_ssize_t n = utf8proc_iterate(p + i, static_cast<utf8proc_ssize_t>(s.size() - i), &cp);
    if (n <= 0) return i;
    i += static_cast<size_t>(n);
  }
  return std::string_view::npos;
}

// `s` (valid UTF-8) in one Unicode normalization form, given as utf8proc_map's options.
std::string normalize(std::string_view s, int form) {
  utf8proc_uint8_t* dst = nullptr;
  const utf8proc_ssize_t n = utf8proc_map(reinterpret_cast<const utf8proc_uint8_t*>(s.data()), static_cast<utf8proc_ssize_t>(s.size()),
                                          &dst, static_cast<utf8proc_option_t>(form));
  if (n < 0) throw Error(fmt::format("tokenizer: cannot normalize a text of {} bytes: {}", s.size(), utf8proc_errmsg(n)));
  std::string out(reinterpret_cast<const char*>(dst), static_cast<size_t>(n));
  std::free(dst);
  return out;
}

std::string pcre2_message(int code) {
  PCRE2_UCHAR msg[256];
  pcre2_get_error_message(code, msg, sizeof msg);
  return reinterpret_cast<const char*>(msg);
}

struct Regex {
  pcre2_code* code = nullptr;
  std::string where;  // the file and key the pattern came from, for match errors
  Regex() = default;
  Regex(const std::string& pattern, const std::string& where_) : where(where_) {
    int err = 0;
    PCRE2_SIZE off = 0;
    code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(), PCRE2_UTF | PCRE2_UCP, &err, &off, nullptr);
    if (!code) throw Error(fmt::format("{}: regex {:?} does not compile at offset {}: {}", where, pattern, off, pcre2_message(err)));
    pcre2_jit_compile(code, PCRE2_JIT_COMPLETE);  // optional: the interpreter runs when JIT is unavailable
  }
  Regex(Regex&& o) noexcept : code(o.code), where(std::move(o.where)) { o.code = nullptr; }
  Regex& operator=(Regex&& o) noexcept {
    std::swap(code, o.code);
    std::swap(where, o.where);
    return *this;
  }
  ~Regex() {
    if (code) pcre2_code_free(code);
  }

  // `Isolated` split: every match and every gap between matches is a piece (empty ones dropped).
  // `s` is valid UTF-8 (encode checks the text once), so PCRE2 skips its own check, which would
  // otherwise rescan the rest of the subject at every match.
  void split(std::string_view s, std::vector<std::string>& out) const {
    std::unique_ptr<pcre2_match_data, decltype(&pcre2_match_data_free)> md(pcre2_match_data_create_from_pattern(code, nullptr),
                                                                           &pcre2_match_data_free);
    if (!md) throw OutOfMemory(fmt::format("{}: no memory for a regex match", where));
    size_t pos = 0, last = 0;
    while (pos <= s.size()) {
      const int rc = pcre2_match(code, reinterpret_cast<PCRE2_SPTR>(s.data()), s.size(), pos, PCRE2_NO_UTF_CHECK, md.get(), nullptr);
      if (rc == PCRE2_ERROR_NOMATCH) break;
      if (rc < 0) {
        const bool limit = rc == PCRE2_ERROR_MATCHLIMIT || rc == PCRE2_ERROR_DEPTHLIMIT || rc == PCRE2_ERROR_HEAPLIMIT;
        throw Error(fmt::format("{}: the regex failed on a piece of {} bytes at byte {} of it: {}{}", where, s.size(), pos,
                                pcre2_message(rc), limit ? " (the pattern backtracks too much on this text: simplify it)" : ""));
      }
      const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(md.get());
      const size_t a = ov[0], b = ov[1];
      if (a > last) out.emplace_back(s.substr(last, a - last));
      if (b > a) out.emplace_back(s.substr(a, b - a)), last = b;
      if (b == a) {  // an empty match: step over one character (it joins the next gap)
        if (a >= s.size()) break;
        pos = a + utf8_len(static_cast<unsigned char>(s[a]));
      } else {
        pos = b;
      }
    }
    if (last < s.size()) out.emplace_back(s.substr(last));
  }
};

struct PreStep {
  enum Kind { Split, ByteLevel } kind = Split;
  Regex regex;                   // Split, or ByteLevel's regex when it has one
  bool has_regex = false;
  bool add_prefix_space = false;  // ByteLevel
};

// An added token; lstrip / rstrip: the whitespace before / after it in a text is part of its match
// (not encoded); normalized: matched in the normalized text, as its normalized content (`match`),
// after the tokens that are not normalized have been matched in the raw text. These are the
// `tokenizers` library's AddedToken flags and its AddedVocabulary's two passes.
struct AddedToken {
  std::string content;
  int64_t id = 0;
  bool special = false;
  bool lstrip = false, rstrip = false;
  bool normalized = false;
  std::string match;  // what a text is searched for: content, normalized when `normalized`
};

// Unicode's White_Space property (what Rust's char::is_whitespace, and so the `tokenizers` library's
// lstrip / rstrip, strip).
bool is_white_space(uint32_t cp) {
  return (cp >= 0x09 && cp <= 0x0D) || cp == 0x20 || cp == 0x85 || cp == 0xA0 || cp == 0x1680 || (cp >= 0x2000 && cp <= 0x200A) ||
         cp == 0x2028 || cp == 0x2029 || cp == 0x202F || cp == 0x205F || cp == 0x3000;
}

}  // namespace

struct Tokenizer::Impl {
  std::string origin;
  std::unordered_map<std::string, int64_t> vocab;
  std::vector<std::string> id_to_token;  // by id (vocabulary and added tokens)
  struct Merge {
    int rank;
    int64_t result;  // the id of the merged symbol
  };
  std::unordered_map<uint64_t, Merge> merges;  // by the pair's ids, (left << 32) | right
  bool ignore_merges = false;
  bool fuse_unk = false;
  std::optional<int64_t> unk;
  std::vector<int> normalizers;  // utf8proc_map options of each normalization form, in order
  std::vector<PreStep> pre;
  bool byte_level_words = false;  // a ByteLevel step ran: words are in the byte alphabet
  std::vector<AddedToken> added;
  std::vector<const AddedToken*> added_raw, added_normalized;  // by pass, each longest match first
  std::unordered_map<int64_t, const AddedToken*> added_by_id;
  std::vector<int64_t> prefix, suffix;  // the post-processor's special tokens around a sequence

  [[noreturn]] void fail(const std::string& key, const std::string& what) const {
    throw Error(fmt::format("{}: {}: {}", origin, key, what));
  }

  static uint64_t pair_key(int64_t left, int64_t right) { return (static_cast<uint64_t>(left) << 32) | static_cast<uint64_t>(right); }

  // A word's ids: one symbol per character, then the pair of lowest rank merged (the leftmost of
  // equals) until no pair of neighbours has a merge, as the `tokenizers` library's BPE does.
  void bpe(const std::string& word, std::vector<int64_t>& out) const {
    if (ignore_merges) {
      if (auto it = vocab.find(word); it != vocab.end()) return out.push_back(it->second);
    }
    std::vector<int64_t> syms;
    bool last_unk = false;
    for (size_t i = 0; i < word.size();) {
      const size_t n = std::min(utf8_len(static_cast<unsigned char>(word[i])), word.size() - i);
      const std::string c = word.substr(i, n);
      i += n;
      if (auto it = vocab.find(c); it != vocab.end()) {
        syms.push_back(it->second), last_unk = false;
      } else if (unk) {
        if (!(fuse_unk && last_unk)) syms.push_back(*unk);
        last_unk = true;
      } else {
        throw Error(fmt::format("{}: the symbol {:?} is not in the vocabulary and there is no unk_token", origin, c));
      }
    }
    while (syms.size() > 1) {
      const Merge* best = nullptr;
      size_t at = 0;
      for (size_t i = 0; i + 1 < syms.size(); ++i) {
        const auto it = merges.find(pair_key(syms[i], syms[i + 1]));
        if (it != merges.end() && (!best || it->second.rank < best->rank)) best = &it->second, at = i;
      }
      if (!best) break;
      syms[at] = best->result;
      syms.erase(syms.begin() + static_cast<std::ptrdiff_t>(at) + 1);
    }
    out.insert(out.end(), syms.begin(), syms.end());
  }

  std::string normalized(std::string_view text) const {
    std::string s(text);
    for (const int form : normalizers) s = normalize(s, form);
    return s;
  }

  // Splits `text` at the added tokens of `tokens` (longest first): the earliest match, the longest
  // there, with the whitespace its lstrip / rstrip take; `plain` gets each stretch between matches
  // (possibly empty), `token` each match.
  template <class Plain>
  void split_added(std::string_view text, const std::vector<const AddedToken*>& tokens, Plain&& plain, std::vector<int64_t>& out) const {
    // Each token's first occurrence at or after pos, searched again only once pos has passed it:
    // the text is scanned about once per added token, not once per added token and match.
    std::vector<size_t> next(tokens.size());
    for (size_t i = 0; i < tokens.size(); ++i) next[i] = text.find(tokens[i]->match);
    size_t pos = 0;
    while (pos < text.size()) {
      size_t best = std::string_view::npos;
      const AddedToken* hit = nullptr;
      for (size_t i = 0; i < tokens.size(); ++i) {
        if (next[i] != std::string_view::npos && next[i] < pos) next[i] = text.find(tokens[i]->match, pos);
        if (next[i] < best) best = next[i], hit = tokens[i];  // longest first: ties keep the longer
      }
      size_t start = hit ? best : text.size(), end = hit ? best + hit->match.size() : text.size();
      if (hit && hit->lstrip)  // the whitespace between pos and the token, code point by code point from the token back
        while (start > pos) {
          size_t b = start - 1;
          while (b > pos && (static_cast<unsigned char>(text[b]) & 0xC0) == 0x80) --b;
          size_t i = b;
          if (!is_white_space(next_cp(text, i)) || i != start) break;
          start = b;
        }
      plain(text.substr(pos, start - pos));
      if (!hit) break;
      out.push_back(hit->id);
      if (hit->rstrip)
        while (end < text.size()) {
          size_t i = end;
          if (!is_white_space(next_cp(text, i))) break;
          end = i;
        }
      pos = end;
    }
  }

  // Pre-tokenizes and encodes a stretch of normalized text without added tokens.
  void encode_plain(std::string_view text, std::vector<int64_t>& out) const {
    std::vector<std::string> pieces{std::string(text)};
    for (const PreStep& st : pre) {
      std::vector<std::string> next;
      for (std::string& p : pieces) {
        if (st.kind == PreStep::ByteLevel && st.add_prefix_space && (p.empty() || p[0] != ' ')) p.insert(p.begin(), ' ');
        if (st.has_regex) st.regex.split(p, next);
        else next.push_back(std::move(p));
      }
      if (st.kind == PreStep::ByteLevel)
        for (std::string& p : next) {
          std::string mapped;
          for (unsigned char c : p) mapped += alphabet().sym[c];
          p = std::move(mapped);
        }
      pieces = std::move(next);
    }
    for (const std::string& p : pieces)
      if (!p.empty()) bpe(p, out);
  }
};

Tokenizer::Tokenizer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Tokenizer::~Tokenizer() = default;
Tokenizer::Tokenizer(Tokenizer&&) noexcept = default;
Tokenizer& Tokenizer::operator=(Tokenizer&&) noexcept = default;

Tokenizer Tokenizer::from_file(const std::filesystem::path& path) {
  return from_json_text(read_whole_file(path, "the tokenizer"), path.string());
}

Tokenizer Tokenizer::from_json_text(std::string_view text, const std::string& origin) {
  auto impl = std::make_unique<Impl>();
  Impl& t = *impl;
  t.origin = origin;
  json j;
  try {
    j = json::parse(text);
  } catch (const json::exception& e) {
    throw Error(fmt::format("{}: not valid JSON: {}", origin, e.what()));
  }
  if (!j.is_object()) t.fail("(top level)", "expected an object");
  // A value of the wrong JSON type anywhere below (a number for a string, ...) throws json::exception.
  try {
    // ---- model
    if (!j.contains("model") || !j["model"].is_object()) t.fail("model", "missing");
    const json& m = j["model"];
    const std::string type = m.value("type", "");
    if (type != "BPE") t.fail("model.type", fmt::format("'{}' is not supported (byte-level BPE only)", type));
    if (!m.contains("vocab") || !m["vocab"].is_object()) t.fail("model.vocab", "missing or not an object");
    // Ids are dense: the vocabulary's entries and the added tokens (some of which repeat vocabulary
    // entries) number at least as many as the ids, so every id must lie below their sum.  The id
    // table is sized by the largest id; a file cannot make it larger than itself.
    const json added_json = j.contains("added_tokens") && !j["added_tokens"].is_null() ? j["added_tokens"] : json::array();
    if (!added_json.is_array()) t.fail("added_tokens", "not an array");
    const int64_t id_bound = static_cast<int64_t>(m["vocab"].size() + added_json.size());
    auto check_id = [&](const json& id, const std::string& key) {
      if (!id.is_number_integer()) t.fail(key, fmt::format("the id {} is not an integer", id.dump()));
      const int64_t v = id.get<int64_t>();  // an unsigned id past 2^63 wraps to a negative one
      if (v < 0 || v >= id_bound)
        t.fail(key, fmt::format("the id {} is outside the vocabulary: {} entries and {} added tokens take ids 0 to {}", id.dump(),
                                m["vocab"].size(), added_json.size(), id_bound - 1));
      return v;
    };
    int64_t max_id = -1;
    for (const auto& [tok, id] : m["vocab"].items()) {
      t.vocab[tok] = check_id(id, "model.vocab." + tok);
      max_id = std::max(max_id, t.vocab[tok]);
    }
    for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"})
      if (m.contains(key) && !m[key].is_null() && !(m[key].is_string() && m[key].get<std::string>().empty()))
        t.fail(std::string("model.") + key, "is not supported (byte-level BPE has none: null or \"\")");
    // A merge is two non-empty symbols of the vocabulary whose concatenation is in it too, written
    // "a b" or (since tokenizers 0.20, so that symbols may hold spaces) ["a", "b"].  A pair listed
    // twice keeps its last rank, as the `tokenizers` library builds its merge map.
    if (m.contains("merges") && !m["merges"].is_null()) {
      if (!m["merges"].is_array()) t.fail("model.merges", "not an array");
      const json& ms = m["merges"];
      for (size_t rank = 0; rank < ms.size(); ++rank) {
        const json& e = ms[rank];
        const std::string key = fmt::format("model.merges[{}]", rank);
        std::string left, right;
        if (e.is_string()) {
          const std::string s = e.get<std::string>();
          const size_t sp = s.find(' ');
          if (sp == std::string::npos || s.find(' ', sp + 1) != std::string::npos)
            t.fail(key, fmt::format("{:?} is not two symbols separated by one space", s));
          left = s.substr(0, sp), right = s.substr(sp + 1);
        } else if (e.is_array() && e.size() == 2 && e[0].is_string() && e[1].is_string()) {
          left = e[0].get<std::string>(), right = e[1].get<std::string>();
        } else {
          t.fail(key, fmt::format("expected \"a b\" or [\"a\", \"b\"], got {}", e.dump()));
        }
        if (left.empty() || right.empty()) t.fail(key, fmt::format("{} has an empty symbol", e.dump()));
        int64_t ids[3];
        const std::string parts[3] = {left, right, left + right};
        for (int k = 0; k < 3; ++k) {
          const auto it = t.vocab.find(parts[k]);
          if (it == t.vocab.end())
            t.fail(key, fmt::format("{}the symbol {:?} is not in the vocabulary", k == 2 ? "the merge's result: " : "", parts[k]));
          ids[k] = it->second;
        }
        t.merges.insert_or_assign(Impl::pair_key(ids[0], ids[1]), Impl::Merge{static_cast<int>(rank), ids[2]});
      }
    }
    t.ignore_merges = m.value("ignore_merges", false);
    t.fuse_unk = m.value("fuse_unk", false);
    if (m.value("byte_fallback", false)) t.fail("model.byte_fallback", "byte fallback (sentencepiece-style BPE) is not supported");
    if (m.contains("unk_token") && m["unk_token"].is_string()) {
      const auto it = t.vocab.find(m["unk_token"].get<std::string>());
      if (it == t.vocab.end()) t.fail("model.unk_token", "not in the vocabulary");
      t.unk = it->second;
    }
    // ---- added tokens
    for (size_t i = 0; i < added_json.size(); ++i) {
      const json& a = added_json[i];
      const std::string key = fmt::format("added_tokens[{}]", i);
      if (!a.is_object() || !a.contains("id") || !a.contains("content") || !a["content"].is_string())
        t.fail(key, "an entry without an 'id' and a string 'content'");
      auto flag = [&](const char* name) {
        if (!a.contains(name) || a[name].is_null()) return false;
        if (!a[name].is_boolean()) t.fail(key + "." + name, "not a boolean");
        return a[name].get<bool>();
      };
      AddedToken at{a["content"].get<std::string>(), check_id(a["id"], key + ".id"), flag("special"), flag("lstrip"), flag("rstrip"),
                    flag("normalized"), {}};
      if (at.content.empty()) t.fail(key, "an empty token");
      if (flag("single_word"))
        t.fail(key + ".single_word", "added tokens matched only as whole words are not supported (\"" + at.content + "\")");
      max_id = std::max(max_id, at.id);
      t.added.push_back(std::move(at));
    }
    for (const AddedToken& a : t.added) t.added_by_id[a.id] = &a;
    t.id_to_token.assign(static_cast<size_t>(max_id + 1), std::string());
    for (const auto& [tok, id] : t.vocab) t.id_to_token[static_cast<size_t>(id)] = tok;
    for (const AddedToken& a : t.added) t.id_to_token[static_cast<size_t>(a.id)] = a.content;
    // Sequences of normalizers, pre-tokenizers and post-processors nest (a real file nests one level);
    // the depth is bounded so that a hostile file cannot exhaust the stack.
    constexpr int kMaxSequenceDepth = 16;
    int depth = 0;
    // ---- normalizer: Unicode normalization forms (utf8proc), alone or in a Sequence
    std::function<void(const json&, const std::string&)> add_norm = [&](const json& n, const std::string& key) {
      if (!n.is_object()) t.fail(key, "expected an object");
      const std::string nt = n.value("type", "");
      if (nt == "Sequence") {
        if (!n.contains("normalizers") || !n["normalizers"].is_array()) t.fail(key + ".normalizers", "missing");
        if (++depth > kMaxSequenceDepth) t.fail(key, fmt::format("Sequences nested deeper than {}", kMaxSequenceDepth));
        for (size_t i = 0; i < n["normalizers"].size(); ++i) add_norm(n["normalizers"][i], fmt::format("{}.normalizers[{}]", key, i));
        --depth;
      } else if (nt == "NFC" || nt == "NFD" || nt == "NFKC" || nt == "NFKD") {
        int form = UTF8PROC_STABLE | (nt.back() == 'C' ? UTF8PROC_COMPOSE : UTF8PROC_DECOMPOSE);
        if (nt.size() == 4) form |= UTF8PROC_COMPAT;  // NFKC, NFKD
        t.normalizers.push_back(form);
      } else {
        t.fail(key + ".type", fmt::format("'{}' is not supported (NFC, NFD, NFKC, NFKD, Sequence)", nt));
      }
    };
    if (j.contains("normalizer") && !j["normalizer"].is_null()) add_norm(j["normalizer"], "normalizer");
    for (AddedToken& a : t.added) {
      a.match = a.normalized ? t.normalized(a.content) : a.content;
      if (a.match.empty()) continue;  // normalized to nothing: never matched, as in the `tokenizers` library
      (a.normalized ? t.added_normalized : t.added_raw).push_back(&a);
    }
    for (auto* pass : {&t.added_raw, &t.added_normalized})
      std::stable_sort(pass->begin(), pass->end(), [](const AddedToken* a, const AddedToken* b) { return a->match.size() > b->match.size(); });
    // ---- pre-tokenizer
    std::function<void(const json&, const std::string&)> add_pre = [&](const json& p, const std::string& key) {
      const std::string pt = p.value("type", "");
      if (pt == "Sequence") {
        if (!p.contains("pretokenizers") || !p["pretokenizers"].is_array()) t.fail(key + ".pretokenizers", "missing");
        if (++depth > kMaxSequenceDepth) t.fail(key, fmt::format("Sequences nested deeper than {}", kMaxSequenceDepth));
        for (size_t i = 0; i < p["pretokenizers"].size(); ++i) add_pre(p["pretokenizers"][i], fmt::format("{}.pretokenizers[{}]", key, i));
        --depth;
      } else if (pt == "ByteLevel") {
        PreStep st;
        st.kind = PreStep::ByteLevel;
        st.add_prefix_space = p.value("add_prefix_space", false);
        if (p.value("use_regex", true)) st.regex = Regex(kGpt2Pattern, t.origin + ": " + key), st.has_regex = true;
        t.pre.push_back(std::move(st));
        t.byte_level_words = true;
      } else if (pt == "Split") {
        const std::string behavior = p.value("behavior", "");
        if (behavior != "Isolated") t.fail(key + ".behavior", fmt::format("'{}' is not supported (Isolated)", behavior));
        if (p.value("invert", false)) t.fail(key + ".invert", "an inverted split is not supported");
        if (!p.contains("pattern") || !p["pattern"].is_object()) t.fail(key + ".pattern", "missing");
        const json& pat = p["pattern"];
        std::string re;
        if (pat.contains("Regex") && pat["Regex"].is_string()) {
          re = pat["Regex"].get<std::string>();
        } else if (pat.contains("String") && pat["String"].is_string()) {  // a literal: escape it
          for (char c : pat["String"].get<std::string>()) {
            if (std::string_view("\\^$.|?*+()[]{}").find(c) != std::string_view::npos) re += '\\';
            re += c;
          }
        } else {
          t.fail(key + ".pattern", "expected {\"Regex\": ...} or {\"String\": ...}");
        }
        PreStep st;
        st.regex = Regex(re, t.origin + ": " + key + ".pattern");
        st.has_regex = true;
        t.pre.push_back(std::move(st));
      } else if (pt == "Digits") {
        PreStep st;
        st.regex = Regex(p.value("individual_digits", false) ? R"(\p{N})" : R"(\p{N}+)", t.origin + ": " + key);
        st.has_regex = true;
        t.pre.push_back(std::move(st));
      } else {
        t.fail(key + ".type", fmt::format("'{}' is not supported (ByteLevel, Split, Digits, Sequence)", pt));
      }
    };
    if (j.contains("pre_tokenizer") && !j["pre_tokenizer"].is_null()) add_pre(j["pre_tokenizer"], "pre_tokenizer");
    if (!t.byte_level_words) t.fail("pre_tokenizer", "no ByteLevel step: only byte-level BPE is supported");
    // ---- post-processor
    std::function<void(const json&, const std::string&)> add_post = [&](const json& p, const std::string& key) {
      const std::string pt = p.value("type", "");
      if (pt == "Sequence") {
        if (!p.contains("processors") || !p["processors"].is_array()) t.fail(key + ".processors", "missing");
        if (++depth > kMaxSequenceDepth) t.fail(key, fmt::format("Sequences nested deeper than {}", kMaxSequenceDepth));
        for (size_t i = 0; i < p["processors"].size(); ++i) add_post(p["processors"][i], fmt::format("{}.processors[{}]", key, i));
        --depth;
      } else if (pt == "TemplateProcessing") {
        if (!p.contains("single") || !p["single"].is_array()) t.fail(key + ".single", "missing");
        bool seen_sequence = false;
        for (const json& piece : p["single"]) {
          if (piece.contains("Sequence")) {
            seen_sequence = true;
            continue;
          }
          if (!piece.contains("SpecialToken")) t.fail(key + ".single", "expected SpecialToken or Sequence pieces");
          const std::string name = piece["SpecialToken"].value("id", "");
          const json& sp = p.value("special_tokens", json::object());
          if (!sp.contains(name) || !sp[name].contains("ids") || !sp[name]["ids"].is_array())
            t.fail(key + ".special_tokens", fmt::format("'{}' has no ids", name));
          for (const json& id : sp[name]["ids"]) {
            const std::string id_key = fmt::format("{}.special_tokens.{}", key, name);
            const int64_t v = check_id(id, id_key);
            // The template's ids are emitted as they are: each must name a token of the vocabulary or
            // an added one (the bound above admits gaps when added tokens repeat vocabulary entries).
            if (v >= static_cast<int64_t>(t.id_to_token.size()) ||
                (t.id_to_token[static_cast<size_t>(v)].empty() && !t.added_by_id.count(v)))
              t.fail(id_key, fmt::format("the id {} is neither a vocabulary entry nor an added token", v));
            (seen_sequence ? t.suffix : t.prefix).push_back(v);
          }
        }
      } else if (pt != "ByteLevel" && pt != "RobertaProcessing") {
        t.fail(key + ".type", fmt::format("'{}' is not supported (TemplateProcessing, ByteLevel, Sequence)", pt));
      }
    };
    if (j.contains("post_processor") && !j["post_processor"].is_null()) add_post(j["post_processor"], "post_processor");
    // ---- decoder
    if (j.contains("decoder") && !j["decoder"].is_null()) {
      const json& d = j["decoder"];
      bool byte_level = d.value("type", "") == "ByteLevel";
      if (d.value("type", "") == "Sequence" && d.contains("decoders"))
        for (const json& x : d["decoders"]) byte_level = byte_level || x.value("type", "") == "ByteLevel";
      if (!byte_level) t.fail("decoder.type", "only the ByteLevel decoder is supported");
    }
  } catch (const json::exception& e) {
    throw Error(fmt::format("{}: malformed: {}", origin, e.what()));
  }
  return Tokenizer(std::move(impl));
}

std::vector<int64_t> Tokenizer::encode(std::string_view text, bool add_special_tokens) const {
  const Impl& t = *impl_;
  if (const size_t bad = invalid_utf8_at(text); bad != std::string_view::npos)
    throw Error(fmt::format("{}: the text to encode is not valid UTF-8: byte {} (0x{:02X}) does not begin a valid sequence; "
                            "convert the text to UTF-8", t.origin, bad, static_cast<unsigned char>(text[bad])));
  std::vector<int64_t> out;
  if (add_special_tokens) out = t.prefix;
  // The tokens that are not normalized split the raw text; each stretch between them is normalized
  // and split by the normalized tokens; what is left is pre-tokenized and encoded.
  t.split_added(
      text, t.added_raw,
      [&](std::string_view raw) {
        if (raw.empty()) return;
        const std::string norm = t.normalized(raw);
        t.split_added(norm, t.added_normalized, [&](std::string_view piece) {
          if (!piece.empty()) t.encode_plain(piece, out);
        }, out);
      },
      out);
  if (add_special_tokens) out.insert(out.end(), t.suffix.begin(), t.suffix.end());
  return out;
}

namespace {

// The bytes vocabulary symbols stand for: each character of the byte alphabet its byte, any other
// character itself (UTF-8).
std::string symbol_bytes(std::string_view symbols) {
  std::string bytes;
  for (size_t i = 0; i < symbols.size();) {
    const uint32_t cp = next_cp(symbols, i);
    const auto it = alphabet().back.find(cp);
    if (it != alphabet().back.end()) bytes += static_cast<char>(it->second);
    else if (cp < 0x110000u) append_utf8(bytes, cp);
  }
  return bytes;
}

}  // namespace

std::string Tokenizer::decode(const std::vector<int64_t>& ids, bool skip_special_tokens) const {
  const Impl& t = *impl_;
  std::string out, pending;
  auto flush = [&] {
    append_utf8_lossy(out, symbol_bytes(pending));
    pending.clear();
  };
  for (int64_t id : ids) {
    if (id < 0 || id >= static_cast<int64_t>(t.id_to_token.size()))
      throw Error(fmt::format("{}: token id {} is outside the vocabulary (size {})", t.origin, id, t.id_to_token.size()));
    if (const auto a = t.added_by_id.find(id); a != t.added_by_id.end()) {
      flush();
      if (!(skip_special_tokens && a->second->special)) out += a->second->content;
      continue;
    }
    pending += t.id_to_token[static_cast<size_t>(id)];
  }
  flush();
  return out;
}

std::string Tokenizer::token_bytes(int64_t id) const {
  const Impl& t = *impl_;
  if (id < 0 || id >= static_cast<int64_t>(t.id_to_token.size()))
    throw Error(fmt::format("{}: token id {} is outside the vocabulary (size {})", t.origin, id, t.id_to_token.size()));
  if (const auto a = t.added_by_id.find(id); a != t.added_by_id.end()) return a->second->content;
  return symbol_bytes(t.id_to_token[static_cast<size_t>(id)]);
}

int64_t Tokenizer::vocab_size() const { return static_cast<int64_t>(impl_->id_to_token.size()); }

std::optional<int64_t> Tokenizer::token_to_id(std::string_view token) const {
  for (const AddedToken& a : impl_->added)
    if (a.content == token) return a.id;
  if (const auto it = impl_->vocab.find(std::string(token)); it != impl_->vocab.end()) return it->second;
  return std::nullopt;
}

std::string Tokenizer::id_to_token(int64_t id) const {
  if (id < 0 || id >= vocab_size()) return "";
  return impl_->id_to_token[static_cast<size_t>(id)];
}

std::string Tokenizer::byte_level_json(int64_t bos_id, int64_t eos_id, const std::string& bos, const std::string& eos) {
  json vocab = json::object();
  for (int b = 0; b < 256; ++b) vocab[alphabet().sym[static_cast<size_t>(b)]] = b;
  auto added = [](int64_t id, const std::string& content) {
    return json{{"id", id}, {"content", content}, {"single_word", false}, {"lstrip", false}, {"rstrip", false},
                {"normalized", false}, {"special", true}};
  };
  const json byte_level = {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", true}, {"use_regex", true}};
  json j = {
      {"version", "1.0"},
      {"truncation", nullptr},
      {"padding", nullptr},
      {"added_tokens", json::array({added(bos_id, bos), added(eos_id, eos)})},
      {"normalizer", nullptr},
      {"pre_tokenizer", byte_level},
      {"post_processor",
       {{"type", "TemplateProcessing"},
        {"single", json::array({{{"SpecialToken", {{"id", bos}, {"type_id", 0}}}}, {{"Sequence", {{"id", "A"}, {"type_id", 0}}}}})},
        {"pair", json::array({{{"SpecialToken", {{"id", bos}, {"type_id", 0}}}},
                              {{"Sequence", {{"id", "A"}, {"type_id", 0}}}},
                              {{"Sequence", {{"id", "B"}, {"type_id", 1}}}}})},
        {"special_tokens", {{bos, {{"id", bos}, {"ids", json::array({bos_id})}, {"tokens", json::array({bos})}}}}}}},
      {"decoder", byte_level},
      {"model",
       {{"type", "BPE"},
        {"dropout", nullptr},
        {"unk_token", nullptr},
        {"continuing_subword_prefix", nullptr},
        {"end_of_word_suffix", nullptr},
        {"fuse_unk", false},
        {"byte_fallback", false},
        {"ignore_merges", false},
        {"vocab", vocab},
        {"merges", json::array()}}},
  };
  return j.dump(2) + "\n";
}

}  // namespace kcpp::models
