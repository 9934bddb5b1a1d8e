#include "hub/reference.h"

#include <nlohmann/json.hpp>

#include "core/error.h"

namespace kcpp::hub {
namespace {

bool is_identifier(std::string_view s) {
  if (s.empty() || (s[0] >= '0' && s[0] <= '9')) return false;
  for (char c : s)
    if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_')) return false;
  return true;
}

}  // namespace

std::string repo_part_problem(std::string_view part, std::string_view what) {
  if (part.empty()) return fmt::format("empty {}", what);
  if (part.size() > 96) return fmt::format("{} longer than 96 characters", what);
  for (char c : part)
    if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '-' || c == '_' ||
          c == '.'))
      return fmt::format("{} '{}' has the character '{}' (allowed: letters, digits, '-', '_', '.')", what, part, c);
  if (part.front() == '-' || part.front() == '.' || part.back() == '-' || part.back() == '.')
    return fmt::format("{} '{}' starts or ends with '-' or '.'", what, part);
  if (part.find("--") != std::string_view::npos || part.find("..") != std::string_view::npos)
    return fmt::format("{} '{}' contains '--' or '..'", what, part);
  return "";
}

std::string revision_problem(std::string_view rev) {
  if (rev.empty()) return "empty revision after '@'";
  if (rev.size() > 255) return "revision longer than 255 characters";
  for (char c : rev)
    if (static_cast<unsigned char>(c) < 0x20 || c == 0x7f || c == ' ' || c == '~' || c == '^' || c == ':' ||
        c == '?' || c == '*' || c == '[' || c == '\\')
      return fmt::format("revision '{}' has the character '{}'", rev, c == ' ' ? std::string("space") : std::string(1, c));
  if (rev.find("..") != std::string_view::npos || rev.find("@{") != std::string_view::npos ||
      rev.front() == '-' || rev.front() == '/' || rev.back() == '/' || rev.back() == '.' || rev.ends_with(".lock"))
    return fmt::format("'{}' is not a valid tag or branch name", rev);
  return "";
}

void validate_repo_id(std::string_view repo) {
  const size_t slash = repo.find('/');
  if (slash == std::string_view::npos || repo.find('/', slash + 1) != std::string_view::npos)
    KCPP_FAIL("bad repo id '{}': expected exactly one '/', as in 'org/repo'", repo);
  for (auto [part, what] : {std::pair{repo.substr(0, slash), "organization"}, {repo.substr(slash + 1), "repo name"}})
    if (auto p = repo_part_problem(part, what); !p.empty()) KCPP_FAIL("bad repo id '{}': {}", repo, p);
}

Reference Reference::parse(std::string_view text) {
  Reference r;
  r.text = std::string(text);
  auto bad = [&](const std::string& why) { KCPP_FAIL("bad kernel reference '{}': {}", text, why); };
  const size_t b = text.find_first_not_of(" \t"), e = text.find_last_not_of(" \t");
  if (b == std::string_view::npos) bad("empty (an empty mapping value disables the layer; a reference cannot be empty)");
  std::string_view s = text.substr(b, e - b + 1);
  if (s.find('\0') != std::string_view::npos) bad("contains a NUL character");

  // ":Layer" at the end (neither paths we accept, revisions nor constraints contain ':' elsewhere
  // except local paths, whose last ':' is taken only when an identifier follows it).
  if (const size_t colon = s.rfind(':'); colon != std::string_view::npos) {
    const std::string_view layer = s.substr(colon + 1);
    if (is_identifier(layer)) {
      r.layer = std::string(layer);
      s = s.substr(0, colon);
    } else if (s[0] != '/') {
      bad(layer.empty() ? std::string("empty layer name after ':'")
                        : fmt::format("layer name '{}' is not an identifier", layer));
    }
  }

  if (s.empty()) bad("no repo or path before ':'");
  if (s[0] == '/') {
    r.kind = Kind::Local;
    r.path = std::string(s);
    return r;
  }
  if (s[0] == '.' || s[0] == '~') bad("local package paths must be absolute (start with '/')");

  std::string_view repo = s, rev;
  if (const size_t at = s.find('@'); at != std::string_view::npos) {
    repo = s.substr(0, at);
    rev = s.substr(at + 1);
    if (rev.empty()) bad("nothing after '@' (a tag, branch or version constraint)");
  }
  try {
    validate_repo_id(repo);
  } catch (const Error& err) {
    bad(err.what());
  }
  r.repo = std::string(repo);
  if (rev.empty()) {
    r.revision = "main";
  } else if (looks_like_constraint(rev)) {
    try {
      r.constraint = Constraint::parse(rev);
    } catch (const Error& err) {
      const bool hex = rev.size() >= 7 && rev.find_first_not_of("0123456789abcdef") == std::string_view::npos;
      bad(hex ? fmt::format("{} (a commit must be given in full: 40 hex digits)", err.what()) : err.what());
    }
  } else {
    if (auto p = revision_problem(rev); !p.empty()) bad(p);
    r.revision = std::string(rev);
  }
  return r;
}

LayerMapping LayerMapping::parse(const nlohmann::json& value, std::string_view context) {
  LayerMapping m;
  auto one_ref = [&](const nlohmann::json& v, const std::string& where) -> std::optional<Reference> {
    if (!v.is_string()) KCPP_FAIL("{}: expected a kernel reference string, got {}", where, v.type_name());
    const std::string s = v.get<std::string>();
    if (s.find_first_not_of(" \t") == std::string::npos) return std::nullopt;  // "" = disabled
    try {
      return Reference::parse(s);
    } catch (const Error& e) {
      KCPP_FAIL("{}: {}", where, e.what());
    }
  };
  if (value.is_string()) {
    m.any_device_ = true;
    m.entries_.push_back({Backend::CPU, std::nullopt, one_ref(value, std::string(context))});
    return m;
  }
  if (!value.is_object())
    KCPP_FAIL("{}: expected a kernel reference or a table keyed by device, got {}", context, value.type_name());
  for (const auto& [key, v] : value.items()) {
    const std::string where = fmt::format("{}.{}", context, key);
    Backend dev;
    try {
      dev = parse_backend(key);
    } catch (const Error& e) {
      KCPP_FAIL("{}: {}", context, e.what());
    }
    auto add_entry = [&](const nlohmann::json& ent, const std::string& w) {
      if (ent.is_string()) {
        m.entries_.push_back({dev, std::nullopt, one_ref(ent, w)});
        return;
      }
      if (!ent.is_object()) KCPP_FAIL("{}: expected a reference or {{\"ref\": ..., \"capability\": ...}}", w);
      for (const auto& [k, _] : ent.items())
        if (k != "ref" && k != "capability") KCPP_FAIL("{}: unknown key '{}' (expected 'ref', 'capability')", w, k);
      if (!ent.contains("ref")) KCPP_FAIL("{}: missing 'ref'", w);
      MappingEntry me{dev, std::nullopt, one_ref(ent["ref"], w + ".ref")};
      if (ent.contains("capability")) {
        if (dev != Backend::CUDA) KCPP_FAIL("{}: 'capability' applies to CUDA entries only", w);
        if (!ent["capability"].is_string()) KCPP_FAIL("{}.capability: expected a string such as \">=9.0\"", w);
        try {
          me.capability = Constraint::parse(ent["capability"].get<std::string>());
        } catch (const Error& e) {
          KCPP_FAIL("{}.capability: {}", w, e.what());
        }
      }
      m.entries_.push_back(std::move(me));
    };
    if (v.is_array()) {
      if (v.empty()) KCPP_FAIL("{}: empty list", where);
      for (size_t i = 0; i < v.size(); ++i) add_entry(v[i], fmt::format("{}[{}]", where, i));
    } else {
      add_entry(v, where);
    }
  }
  return m;
}

const MappingEntry* LayerMapping::select(Backend device, int cc_major, int cc_minor) const {
  if (any_device_) return entries_.empty() ? nullptr : &entries_[0];
  for (const MappingEntry& e : entries_) {
    if (e.device != device) continue;
    if (e.capability) {
      Version cc;
      cc.major = static_cast<uint64_t>(cc_major), cc.minor = static_cast<uint64_t>(cc_minor);
      if (!e.capability->matches(cc)) continue;
    }
    return &e;
  }
  return nullptr;
}

}  // namespace kcpp::hub
