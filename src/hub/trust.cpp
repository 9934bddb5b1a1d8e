#include "hub/trust.h"

#include <algorithm>

#include "core/error.h"
#include "hub/fs.h"

namespace kcpp::hub {

const char* trust_level_name(TrustLevel t) {
  switch (t) {
    case TrustLevel::Trusted: return "trusted";
    case TrustLevel::Untrusted: return "untrusted";
    case TrustLevel::Unsigned: return "unsigned";
    case TrustLevel::BadSignature: return "bad signature";
  }
  return "?";
}

std::filesystem::path TrustStore::default_path() {
  if (const char* p = std::getenv("KCPP_TRUST_STORE"); p && *p) return p;
  if (const char* x = std::getenv("XDG_CONFIG_HOME"); x && *x)
    return std::filesystem::path(x) / "kcpp" / "trusted_publishers.json";
  const char* home = std::getenv("HOME");
  return std::filesystem::path(home && *home ? home : "/") / ".config" / "kcpp" / "trusted_publishers.json";
}

void TrustStore::add(const std::string& publisher, const PublicKey& key) {
  validate_publisher(publisher);
  auto& v = keys_[publisher];
  if (std::find(v.begin(), v.end(), key) == v.end()) v.push_back(key);
}

void TrustStore::load_file(const std::filesystem::path& file) {
  auto j = nlohmann::json::parse(read_file(file), nullptr, false);
  auto bad = [&](const std::string& why) {
    KCPP_FAIL("trust store {}: {} (expected {{\"publishers\": {{\"NAME\": [\"ed25519:BASE64\"]}}}})", file.string(),
              why);
  };
  if (j.is_discarded()) bad("not valid JSON");
  if (!j.is_object() || !j.contains("publishers") || !j["publishers"].is_object()) bad("no 'publishers' object");
  for (const auto& [name, keys] : j["publishers"].items()) {
    if (!keys.is_array()) bad(fmt::format("publisher '{}': expected a list of keys", name));
    for (const auto& k : keys) {
      if (!k.is_string()) bad(fmt::format("publisher '{}': keys are strings", name));
      try {
        add(name, PublicKey::parse(k.get<std::string>(), fmt::format("publisher '{}'", name)));
      } catch (const Error& e) {
        bad(e.what());
      }
    }
  }
}

TrustStore TrustStore::from_env() {
  TrustStore s;
  const auto path = default_path();
  if (std::filesystem::exists(path)) s.load_file(path);
  if (const char* env = std::getenv("KCPP_TRUSTED_PUBLISHERS"); env && *env) s.add_list(env);
  return s;
}

void TrustStore::add_list(std::string_view list) {
  std::string_view rest(list);
  while (!rest.empty()) {
    const size_t sep = rest.find_first_of(";,");
    std::string_view item = rest.substr(0, sep);
    rest = sep == std::string_view::npos ? std::string_view() : rest.substr(sep + 1);
    while (!item.empty() && item.front() == ' ') item.remove_prefix(1);
    while (!item.empty() && item.back() == ' ') item.remove_suffix(1);
    if (item.empty()) continue;
    const size_t eq = item.find('=');
    if (eq == std::string_view::npos)
      KCPP_FAIL("KCPP_TRUSTED_PUBLISHERS: '{}' is not NAME=ed25519:BASE64", item);
    add(std::string(item.substr(0, eq)),
        PublicKey::parse(item.substr(eq + 1), fmt::format("KCPP_TRUSTED_PUBLISHERS ({})", item.substr(0, eq))));
  }
}

void TrustStore::add_to_file(const std::filesystem::path& file, const std::string& publisher, const PublicKey& key) {
  TrustStore s;
  if (std::filesystem::exists(file)) s.load_file(file);
  s.add(publisher, key);
  nlohmann::json j = {{"publishers", nlohmann::json::object()}};
  for (const auto& [name, keys] : s.keys_)
    for (const auto& k : keys) j["publishers"][name].push_back(k.str());
  write_file_atomic(file, j.dump(2) + "\n");
}

TrustVerdict TrustStore::verify(const Manifest& m) const {
  TrustVerdict v;
  if (!m.signature) {
    v.level = TrustLevel::Unsigned;
    v.detail = "the manifest is not signed";
    return v;
  }
  const Signature& sig = *m.signature;
  v.publisher = sig.publisher;
  const std::string bytes = m.canonical_bytes();
  // Does the signature verify under the key it names?  If not, the manifest was altered after
  // signing (or the signature was): refuse whatever the trust store says.
  PublicKey named;
  try {
    named = PublicKey::parse(sig.public_key, "signature.public_key");
  } catch (const Error& e) {
    v.level = TrustLevel::BadSignature;
    v.detail = e.what();
    return v;
  }
  if (!verify_signature(named, bytes, sig.value)) {
    v.level = TrustLevel::BadSignature;
    v.detail = fmt::format("the signature by '{}' does not match the manifest (altered after signing?)", sig.publisher);
    return v;
  }
  const auto it = keys_.find(sig.publisher);
  if (it == keys_.end()) {
    v.level = TrustLevel::Untrusted;
    v.detail = fmt::format("signed by '{}' ({}), a publisher not in the trust store", sig.publisher, named.str());
    return v;
  }
  for (const PublicKey& k : it->second)
    if (k == named) {
      v.level = TrustLevel::Trusted;
      v.detail = fmt::format("signed by trusted publisher '{}'", sig.publisher);
      return v;
    }
  v.level = TrustLevel::Untrusted;
  v.detail = fmt::format("signed as '{}' but with a key the trust store does not list for it ({})", sig.publisher,
                         named.str());
  return v;
}

}  // namespace kcpp::hub
