// Trust: the trust store file, key files, keys and base64, Ed25519 signatures and the verdict on a
// manifest (src/hub/trust.h, src/hub/crypto.h).  Byte 0 picks what the rest of the input is:
//   0  a trust store file (TrustStore::load_file), then the verdict on a manifest signed with the
//      RFC 8032 test key 1 as "acme" under that store
//   1  a key file: NAME.pub (load_public_key) and NAME.key (KeyPair::load)
//   2  a key or base64 text (PublicKey::parse, base64_decode)
//   3  "KEY\nSIGNATURE\nMESSAGE" (verify_signature)
//   4  a manifest (Manifest::parse), judged by a store that trusts the test key 1 as "acme"
//   5  a KCPP_TRUSTED_PUBLISHERS value (TrustStore::add_list)
//
// Properties: every publisher of a store is a valid name and every key prints back to itself;
// base64 that decodes is the canonical encoding of what it decodes to; a loaded key pair's
// signatures verify under its public key and not under another; a verdict of Trusted is only for a
// publisher the store lists with the very key that verifies the signature.
#include <algorithm>
#include <optional>
#include <string>

#include "fuzz.h"
#include "hub/crypto.h"
#include "hub/manifest.h"
#include "hub/reference.h"
#include "hub/trust.h"

using namespace kcpp;
using namespace kcpp::hub;

namespace {

// RFC 8032, section 7.1, TEST 1: the public key of the secret key 9d61b1...7f60.
const PublicKey& test_key() {
  static const PublicKey k = PublicKey::parse("ed25519:11qYAYKxCrfVS/7TyWQHOg7hcvPapiMlrwIaaPcHURo=", "test key");
  return k;
}

// A manifest signed with the test key as "acme" (tests/fuzz/make_corpus.py writes the same one).
const Manifest& signed_manifest() {
  static const Manifest signed_one = [] {
    const Manifest m = Manifest::parse(
      R"({"abi_version":1,"kcpp_manifest":1,"name":"example","signature":{"algorithm":"ed25519",)"
      R"("public_key":"ed25519:11qYAYKxCrfVS/7TyWQHOg7hcvPapiMlrwIaaPcHURo=","publisher":"acme","value":)"
      R"("8Iel8aVI6lx9c+M9mH92MO7zoN2lqt353waGKV3Npl7d1f2Mi87dp1k4/R4+YWxHAmYEBBhV7f0Jbxf4UPvGAw=="},)"
      R"("variants":{"kcpp1-cpu-x86_64-linux":{"files":{"build/kcpp1-cpu-x86_64-linux/libexample.so":)"
      R"({"sha256":"0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef","size":4096}},)"
      R"("library":"build/kcpp1-cpu-x86_64-linux/libexample.so"}},"version":"1.0.0"})",
      "signed manifest");
    KCPP_FUZZ_EXPECT(verify_signature(test_key(), m.canonical_bytes(), m.signature->value), "the test manifest's signature");
    return m;
  }();
  return signed_one;
}

void check_store(const TrustStore& s) {
  for (const auto& [name, keys] : s.publishers()) {
    KCPP_FUZZ_EXPECT(repo_part_problem(name, "publisher").empty(), "the store holds the publisher '{}': {}", name,
                     repo_part_problem(name, "publisher"));
    for (const PublicKey& k : keys)
      KCPP_FUZZ_EXPECT(PublicKey::parse(k.str(), "written back") == k, "key {} does not read back", k.str());
  }
}

void check_verdict(const TrustStore& s, const Manifest& m) {
  const TrustVerdict v = s.verify(m);
  KCPP_FUZZ_EXPECT(!v.detail.empty(), "a verdict of '{}' with no detail", trust_level_name(v.level));
  KCPP_FUZZ_EXPECT((v.level == TrustLevel::Unsigned) == !m.signature, "'{}' for a manifest {}", trust_level_name(v.level),
                   m.signature ? "with a signature" : "without one");
  if (v.level != TrustLevel::Trusted) return;
  const PublicKey named = PublicKey::parse(m.signature->public_key, "signature.public_key");
  KCPP_FUZZ_EXPECT(verify_signature(named, m.canonical_bytes(), m.signature->value), "trusted, yet it does not verify");
  const auto it = s.publishers().find(m.signature->publisher);
  KCPP_FUZZ_EXPECT(it != s.publishers().end() && std::find(it->second.begin(), it->second.end(), named) != it->second.end(),
                   "trusted, yet the store does not list {} for '{}'", named.str(), m.signature->publisher);
}

void store_file(std::string_view text) {
  static fuzz::MemFile file;
  TrustStore s;
  try {
    s.load_file(file.write(text));
  } catch (const Error&) {
    return;
  }
  check_store(s);
  check_verdict(s, signed_manifest());
}

void key_file(std::string_view text) {
  static fuzz::MemFile file;
  const std::string& path = file.write(text);
  std::optional<std::pair<std::string, PublicKey>> pub;
  try {
    pub = load_public_key(path);
  } catch (const Error&) {
  }
  if (pub) {
    KCPP_FUZZ_EXPECT(repo_part_problem(pub->first, "publisher").empty(), "publisher '{}'", pub->first);
    KCPP_FUZZ_EXPECT(PublicKey::parse(pub->second.str(), "written back") == pub->second, "key {} does not read back",
                     pub->second.str());
  }
  KeyPair pair;
  try {
    pair = KeyPair::load(path);
  } catch (const Error&) {
    return;
  }
  const std::string sig = pair.sign(text);
  KCPP_FUZZ_EXPECT(verify_signature(pair.public_key, text, sig), "a signature by {} does not verify", pair.public_key.str());
  KCPP_FUZZ_EXPECT(pair.public_key == test_key() || !verify_signature(test_key(), text, sig),
                   "a signature by {} verifies under another key", pair.public_key.str());
}

void key_text(std::string_view text) {
  try {
    const std::string raw = base64_decode(text, "fuzz");
    KCPP_FUZZ_EXPECT(base64_encode(raw) == text, "'{}' decodes to {} bytes that encode as '{}'", text, raw.size(),
                     base64_encode(raw));
  } catch (const Error&) {
  }
  try {
    const PublicKey k = PublicKey::parse(text, "fuzz");
    KCPP_FUZZ_EXPECT(PublicKey::parse(k.str(), "written back") == k, "key {} does not read back", k.str());
  } catch (const Error&) {
  }
  KCPP_FUZZ_EXPECT(base64_decode(base64_encode(text), "encoded") == text, "{} bytes do not survive base64", text.size());
}

void signature(std::string_view text) {
  const size_t a = text.find('\n');
  if (a == std::string_view::npos) return;
  const size_t b = text.find('\n', a + 1);
  if (b == std::string_view::npos) return;
  PublicKey key;
  try {
    key = PublicKey::parse(text.substr(0, a), "fuzz key");
  } catch (const Error&) {
    return;
  }
  const std::string_view sig = text.substr(a + 1, b - a - 1), message = text.substr(b + 1);
  if (verify_signature(key, message, sig) && !message.empty()) {
    std::string other(message);
    other[0] ^= 1;
    KCPP_FUZZ_EXPECT(!verify_signature(key, other, sig), "a signature verifies for two messages");
  }
}

void manifest(std::string_view text) {
  Manifest m;
  try {
    m = Manifest::parse(text, "fuzz");
  } catch (const Error&) {
    return;
  }
  static const TrustStore store = [] {
    TrustStore s;
    s.add("acme", test_key());
    return s;
  }();
  check_verdict(store, m);
  check_verdict(TrustStore(), m);
}

void list(std::string_view text) {
  TrustStore s;
  try {
    s.add_list(text);
  } catch (const Error&) {
    return;
  }
  check_store(s);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const std::string_view rest = fuzz::text(data + 1, size - 1);
  switch (data[0] % 6) {
    case 0: store_file(rest); break;
    case 1: key_file(rest); break;
    case 2: key_text(rest); break;
    case 3: signature(rest); break;
    case 4: manifest(rest); break;
    case 5: list(rest); break;
  }
  return 0;
}
