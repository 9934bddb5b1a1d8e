#include "hub/semver.h"

#include <algorithm>
#include <charconv>

#include "core/error.h"

namespace kcpp::hub {
namespace {

bool is_digits(std::string_view s) {
  return !s.empty() && std::all_of(s.begin(), s.end(), [](char c) { return c >= '0' && c <= '9'; });
}
bool is_ident(std::string_view s) {  // [0-9A-Za-z-]+
  return !s.empty() && std::all_of(s.begin(), s.end(), [](char c) {
    return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '-';
  });
}

std::vector<std::string_view> split(std::string_view s, char sep) {
  std::vector<std::string_view> out;
  size_t start = 0;
  while (true) {
    const size_t at = s.find(sep, start);
    out.push_back(s.substr(start, at - start));
    if (at == std::string_view::npos) break;
    start = at + 1;
  }
  return out;
}

// A numeric field: digits, no leading zero (semver §2), below 2^64 - 1 (so that a constraint's
// upper bound, the field plus one, fits in 64 bits).
std::optional<uint64_t> number(std::string_view s) {
  if (!is_digits(s) || (s.size() > 1 && s[0] == '0')) return std::nullopt;
  uint64_t v = 0;
  auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (ec != std::errc() || p != s.data() + s.size() || v == UINT64_MAX) return std::nullopt;
  return v;
}

// X[.Y[.Z]][-pre][+build] where missing or "x"/"X"/"*" fields are wildcards; `fields` counts the
// numeric fields given (0 for "*").
struct Partial {
  Version v;
  int fields = 0;
};

std::optional<Partial> parse_partial(std::string_view s, std::string* why) {
  Partial p;
  if (!s.empty() && (s[0] == 'v' || s[0] == 'V')) s.remove_prefix(1);
  if (const size_t plus = s.find('+'); plus != std::string_view::npos) {
    p.v.build = std::string(s.substr(plus + 1));
    s = s.substr(0, plus);
  }
  std::string_view pre;
  if (const size_t dash = s.find('-'); dash != std::string_view::npos) {
    pre = s.substr(dash + 1);
    s = s.substr(0, dash);
    if (pre.empty()) return *why = "empty pre-release after '-'", std::nullopt;
    for (std::string_view id : split(pre, '.')) {
      if (!is_ident(id)) return *why = "bad pre-release identifier '" + std::string(id) + "'", std::nullopt;
      if (is_digits(id) && id.size() > 1 && id[0] == '0')
        return *why = "numeric pre-release identifier with a leading zero '" + std::string(id) + "'", std::nullopt;
      p.v.prerelease.emplace_back(id);
    }
  }
  const auto parts = split(s, '.');
  if (parts.size() > 3) return *why = "more than three numeric fields", std::nullopt;
  uint64_t* dst[3] = {&p.v.major, &p.v.minor, &p.v.patch};
  bool wild = false;
  for (size_t i = 0; i < parts.size(); ++i) {
    const std::string_view f = parts[i];
    if (f == "x" || f == "X" || f == "*") {
      wild = true;
      continue;
    }
    if (wild) return *why = "a number after a wildcard field", std::nullopt;
    const auto n = number(f);
    if (!n) return *why = "'" + std::string(f) + "' is not a number (digits, no leading zero, below 2^64 - 1)", std::nullopt;
    *dst[i] = *n;
    p.fields = static_cast<int>(i) + 1;
  }
  if (p.v.is_prerelease() && p.fields < 3) return *why = "a pre-release needs all three fields", std::nullopt;
  return p;
}

int compare_ident(const std::string& a, const std::string& b) {
  const bool na = is_digits(a), nb = is_digits(b);
  if (na && nb) {
    if (a.size() != b.size()) return a.size() < b.size() ? -1 : 1;  // no leading zeros: length orders
    return a.compare(b) < 0 ? -1 : a == b ? 0 : 1;
  }
  if (na != nb) return na ? -1 : 1;
  return a.compare(b) < 0 ? -1 : a == b ? 0 : 1;
}

}  // namespace

std::optional<Version> Version::try_parse(std::string_view text) {
  std::string why;
  auto p = parse_partial(text, &why);
  if (!p || p->fields != 3) return std::nullopt;
  return p->v;
}

Version Version::parse(std::string_view text) {
  std::string why;
  auto p = parse_partial(text, &why);
  if (p && p->fields != 3) why = "a version needs MAJOR.MINOR.PATCH";
  if (!p || p->fields != 3) KCPP_FAIL("bad version '{}': {}", text, why);
  return p->v;
}

std::string Version::str() const {
  std::string s = fmt::format("{}.{}.{}", major, minor, patch);
  for (size_t i = 0; i < prerelease.size(); ++i) s += (i ? "." : "-") + prerelease[i];
  if (!build.empty()) s += "+" + build;
  return s;
}

std::strong_ordering operator<=>(const Version& a, const Version& b) {
  if (auto c = a.major <=> b.major; c != 0) return c;
  if (auto c = a.minor <=> b.minor; c != 0) return c;
  if (auto c = a.patch <=> b.patch; c != 0) return c;
  if (a.prerelease.empty() || b.prerelease.empty())
    return b.prerelease.size() == a.prerelease.size() ? std::strong_ordering::equal
           : a.prerelease.empty()                      ? std::strong_ordering::greater
                                                       : std::strong_ordering::less;
  const size_t n = std::min(a.prerelease.size(), b.prerelease.size());
  for (size_t i = 0; i < n; ++i)
    if (int c = compare_ident(a.prerelease[i], b.prerelease[i]); c != 0)
      return c < 0 ? std::strong_ordering::less : std::strong_ordering::greater;
  return a.prerelease.size() <=> b.prerelease.size();
}

bool is_commit_id(std::string_view t) {
  return t.size() == 40 &&
         std::all_of(t.begin(), t.end(), [](char c) { return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'); });
}

bool looks_like_constraint(std::string_view t) {
  if (t.empty() || is_commit_id(t)) return false;
  const char c = t[0];
  return c == '>' || c == '<' || c == '=' || c == '!' || c == '^' || c == '~' || c == '*' || (c >= '0' && c <= '9');
}

void Constraint::parse_comparator(std::string_view tok, std::string_view whole, Set& out) {
  auto bad = [&](const std::string& why) { KCPP_FAIL("bad version constraint '{}': '{}': {}", whole, tok, why); };
  std::string_view op;
  for (std::string_view o : {"~=", ">=", "<=", "==", "!=", "^", "~", ">", "<", "="})
    if (tok.starts_with(o)) {
      op = o;
      break;
    }
  std::string_view rest = tok.substr(op.size());
  if (rest.empty()) bad("no version after the operator");
  std::string why;
  const auto p = parse_partial(rest, &why);
  if (!p) bad(why);
  const Version& v = p->v;
  const int f = p->fields;
  // A lone wildcard means "any version" only on its own ("*", "x"); after an operator it is not a
  // version to compare with (">=x" would otherwise quietly match everything).
  if (f == 0 && !op.empty())
    bad(fmt::format("'{}' is not a version (after '{}' give at least MAJOR, as in '{}1' or '{}1.2')", rest, op, op,
                    op));
  auto bump = [&](int field) {  // the first version past the wildcard at `field` (0 major, 1 minor, 2 patch)
    Version u;
    u.major = v.major, u.minor = v.minor, u.patch = v.patch;
    if (field == 0) u.major += 1, u.minor = 0, u.patch = 0;
    if (field == 1) u.minor += 1, u.patch = 0;
    if (field == 2) u.patch += 1;
    return u;
  };
  Version low;  // v without build metadata
  low.major = v.major, low.minor = v.minor, low.patch = v.patch, low.prerelease = v.prerelease;

  if (op.empty() || op == "=" || op == "==") {
    if (f == 0) out.push_back({Op::Ge, Version{}});  // "*"
    else if (f == 3) out.push_back({Op::Eq, low});
    else out.push_back({Op::Ge, low}), out.push_back({Op::Lt, bump(f - 1)});
  } else if (op == "!=") {
    if (f != 3) bad("'!=' needs a full version");
    out.push_back({Op::Ne, low});
  } else if (op == ">") {
    out.push_back(f == 3 ? Comparator{Op::Gt, low} : Comparator{Op::Ge, bump(f - 1)});
  } else if (op == ">=") {
    out.push_back({Op::Ge, low});
  } else if (op == "<") {
    out.push_back({Op::Lt, low});
  } else if (op == "<=") {
    out.push_back(f == 3 ? Comparator{Op::Le, low} : Comparator{Op::Lt, bump(f - 1)});
  } else if (op == "^") {
    out.push_back({Op::Ge, low});
    if (v.major > 0 || f == 1) out.push_back({Op::Lt, bump(0)});
    else if (v.minor > 0 || f == 2) out.push_back({Op::Lt, bump(1)});
    else out.push_back({Op::Lt, bump(2)});
  } else if (op == "~") {
    out.push_back({Op::Ge, low});
    out.push_back({Op::Lt, bump(f == 1 ? 0 : 1)});
  } else if (op == "~=") {
    if (f < 2) bad("'~=' needs at least MAJOR.MINOR");
    out.push_back({Op::Ge, low});
    out.push_back({Op::Lt, bump(f - 2)});
  }
}

Constraint Constraint::parse(std::string_view text) {
  Constraint c;
  c.text_ = std::string(text);
  if (text.find_first_not_of(" \t") == std::string_view::npos) KCPP_FAIL("bad version constraint: empty");
  size_t start = 0;
  while (true) {
    const size_t bar = text.find("||", start);
    const std::string_view part = text.substr(start, bar == std::string_view::npos ? bar : bar - start);
    // Tokens split on ',' and blanks; an operator standing alone ("> = 1.2" is not allowed, ">= 1.2" is)
    // joins the token after it.
    std::string squeezed;
    for (char ch : part)
      if (ch != ' ' && ch != '\t') squeezed += ch;
    if (squeezed.starts_with(',') || squeezed.ends_with(',') || squeezed.find(",,") != std::string::npos)
      KCPP_FAIL("bad version constraint '{}': an empty comparator between commas", text);
    std::vector<std::string> toks;
    std::string cur;
    auto flush = [&] {
      if (!cur.empty()) toks.push_back(cur), cur.clear();
    };
    for (char ch : part) {
      if (ch == ',' || ch == ' ' || ch == '\t') flush();
      else cur += ch;
    }
    flush();
    Set set;
    for (size_t i = 0; i < toks.size(); ++i) {
      std::string tok = toks[i];
      const bool op_only = tok.find_first_not_of("<>=!^~") == std::string::npos;
      if (op_only && i + 1 < toks.size()) tok += toks[++i];
      parse_comparator(tok, text, set);
    }
    if (set.empty()) KCPP_FAIL("bad version constraint '{}': an empty alternative", text);
    c.sets_.push_back(std::move(set));
    if (bar == std::string_view::npos) break;
    start = bar + 2;
  }
  return c;
}

bool Constraint::holds(const Comparator& c, const Version& v) {
  const auto o = v <=> c.v;
  switch (c.op) {
    case Op::Eq: return o == 0;
    case Op::Ne: return o != 0;
    case Op::Lt: return o < 0;
    case Op::Le: return o <= 0;
    case Op::Gt: return o > 0;
    case Op::Ge: return o >= 0;
  }
  return false;
}

bool Constraint::matches(const Version& v) const {
  for (const Set& s : sets_) {
    if (!std::all_of(s.begin(), s.end(), [&](const Comparator& c) { return holds(c, v); })) continue;
    if (!v.is_prerelease()) return true;
    for (const Comparator& c : s)
      if (c.v.is_prerelease() && c.v.major == v.major && c.v.minor == v.minor && c.v.patch == v.patch)
        return true;
  }
  return false;
}

std::optional<Version> Constraint::best(const std::vector<Version>& candidates) const {
  std::optional<Version> out;
  for (const Version& v : candidates)
    if (matches(v) && (!out || v > *out)) out = v;
  return out;
}

}  // namespace kcpp::hub
