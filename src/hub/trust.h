// Which publishers' signatures are trusted, and the verdict on a manifest.
//
// The trust store is the union of
//   - the file $KCPP_TRUST_STORE, else $XDG_CONFIG_HOME/kcpp/trusted_publishers.json, else
//     ~/.config/kcpp/trusted_publishers.json:  {"publishers": {"acme": ["ed25519:BASE64", ...]}}
//   - $KCPP_TRUSTED_PUBLISHERS: "acme=ed25519:BASE64;other=ed25519:BASE64" (';' or ',' separated).
// A manifest is Trusted when its signature verifies under a key listed for the publisher it names.
// Load policy (Hub::load): Trusted loads; Unsigned and Untrusted load only with allow_all_kernels;
// a signature that does not verify (BadSignature) never loads: that is a tampered package.
#pragma once

#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "hub/crypto.h"
#include "hub/manifest.h"

namespace kcpp::hub {

enum class TrustLevel { Trusted, Untrusted, Unsigned, BadSignature };
const char* trust_level_name(TrustLevel t);

struct TrustVerdict {
  TrustLevel level = TrustLevel::Unsigned;
  std::string publisher;  // as the signature names it
  std::string detail;     // a sentence for messages and `kcpp show`
};

class TrustStore {
 public:
  // From the environment and the default file (a missing file is an empty store; a malformed one throws).
  static TrustStore from_env();
  static std::filesystem::path default_path();
  void load_file(const std::filesystem::path& file);  // merges; throws naming the file
  void add(const std::string& publisher, const PublicKey& key);
  // Merges a KCPP_TRUSTED_PUBLISHERS value: "acme=ed25519:BASE64;other=ed25519:BASE64" (';' or ','
  // separated, spaces around items ignored); throws naming the item that is not NAME=KEY.
  void add_list(std::string_view list);
  // Adds to the store file (creating it) and saves it atomically.
  static void add_to_file(const std::filesystem::path& file, const std::string& publisher, const PublicKey& key);

  TrustVerdict verify(const Manifest& m) const;
  const std::map<std::string, std::vector<PublicKey>>& publishers() const { return keys_; }

 private:
  std::map<std::string, std::vector<PublicKey>> keys_;
};

}  // namespace kcpp::hub
